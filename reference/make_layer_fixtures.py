"""Write the PLE layer fixtures under fixtures/layer/ (run from the repo root).

Small geometry: hidden 64, hc_mult 4, ngram_size 3, 2 heads per order,
head_dim 16, conv kernel 4 with dilation 3, a 384-row BF16 table. One
sequence of 32 tokens with an EOS in the middle, run in six chunks (single
tokens among them) with the carry passed between chunks. Tensors are raw
little-endian binaries; small.json describes them and holds the geometry.
"""

import json
import os

import numpy as np

from ple_layer import PleLayerRef, bf16_bits
from ple_reference import derive

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "fixtures", "layer")


def main():
    rng = np.random.default_rng(20261202)
    hidden, hc, n, kpn, head_dim, kconv = 64, 4, 3, 2, 16, 4
    heads = (n - 1) * kpn
    E, C = heads * head_dim, hc * hidden
    vocab, eos, base, divisible = 1000, 999, 61, 128
    d = derive(vocab, eos, n, kpn, base, divisible)
    rows = d["padded_rows"]
    g = {
        "hidden": hidden, "hc_mult": hc, "head_dim": head_dim, "conv_kernel": kconv,
        "dilation": n, "eps": 1e-6, "eos": eos, "table_rows": rows,
        "ngram_size": n, "heads_per_ngram": kpn, "eos_token_id": eos,
        "multipliers": d["multipliers"], "head_vocab_sizes": d["head_vocab_sizes"],
        "head_offsets": d["head_offsets"],
    }
    table = bf16_bits(rng.standard_normal((rows, head_dim)).astype(np.float32))
    w = {
        "key_proj": bf16_bits((rng.standard_normal((C, E)) / np.sqrt(E)).astype(np.float32)),
        "value_proj": bf16_bits((rng.standard_normal((hidden, E)) / np.sqrt(E)).astype(np.float32)),
        "norm_key": (0.1 * rng.standard_normal(C)).astype(np.float32),
        "norm_query": (0.1 * rng.standard_normal(C)).astype(np.float32),
        "norm_conv": (0.1 * rng.standard_normal(C)).astype(np.float32),
        "conv1d": (0.5 * rng.standard_normal(C * kconv)).astype(np.float32),
    }
    tokens = [int(t) for t in rng.integers(0, vocab - 1, 32)]
    tokens[13] = eos
    tokens[20] = tokens[19]
    chunks = [5, 1, 9, 1, 1, 15]
    assert sum(chunks) == len(tokens)
    hw_in = rng.standard_normal((len(tokens), C)).astype(np.float32)

    layer = PleLayerRef(g, w, table)
    st = layer.new_state()
    outs, t0 = [], 0
    for c in chunks:
        outs.append(layer.forward(st, hw_in[t0:t0 + c], tokens[t0:t0 + c]))
        t0 += c
    hw_out = np.concatenate(outs)

    os.makedirs(OUT, exist_ok=True)
    files = {}

    def put(name, arr, dtype):
        fn = f"small.{name}.bin"
        np.ascontiguousarray(arr, dtype=dtype).astype(np.dtype(dtype).newbyteorder("<")).tofile(
            os.path.join(OUT, fn))
        files[name] = fn

    put("table", table, np.uint16)
    put("key_proj", w["key_proj"], np.uint16)
    put("value_proj", w["value_proj"], np.uint16)
    for k in ("norm_key", "norm_query", "norm_conv", "conv1d"):
        put(k, w[k], np.float32)
    put("highway_in", hw_in, np.float32)
    put("highway_out", hw_out, np.float32)
    put("conv_state_out", st["conv"].astype(np.float32), np.float32)
    meta = dict(g)
    del meta["eos_token_id"]
    meta["multipliers"] = [str(m) for m in g["multipliers"]]
    meta.update({"tokens": tokens, "chunks": chunks, "history_out": [int(t) for t in st["history"]],
                 "files": files, "vocab_size": vocab, "vocab_base": base,
                 "min_abs_gate": layer.min_abs_gate})
    with open(os.path.join(OUT, "small.json"), "w") as f:
        json.dump(meta, f, indent=1)
        f.write("\n")


if __name__ == "__main__":
    main()
