"""transformers' own Qwen4ExpTextPLELayer on the CPU, in bfloat16, at the flagship geometry.

The layer of `transformers.models.qwen4_exp` as the model runs it: hashing,
table lookup, key and value projections, norms, gate and the dilated conv,
with a `DynamicCache` carrying the n-gram context and the conv state from
step to step, every weight and the table in bfloat16. The table is smaller
than the real one (`--rows`, default about 3,000,000 rows, through
`ngram_vocab_size_base`): the work of a step does not depend on its size.
Prints tokens/s for one 512-token prefill chunk and for decode steps of
batch 1, 16, 32 and 64 (each sequence first prefilled with 16 tokens), in
the line format of `reference/torch_bench.py`, for the side by side of
`cargo bench -p metrale-bench --bench ple_forward`.

Not part of CI: it needs transformers with Qwen4-Exp (5.25 or later) and
torch. Usage:
    python3 reference/transformers_bench.py [--rows 3000000] [--reps 5] [--threads N]
"""

import argparse
import time

import torch
from transformers.cache_utils import DynamicCache
from transformers.models.qwen4_exp.configuration_qwen4_exp import Qwen4ExpTextConfig
from transformers.models.qwen4_exp.modeling_qwen4_exp import Qwen4ExpTextPLELayer

H, HC, HEADS, HEAD_DIM = 2560, 4, 16, 160
VOCAB = 151_936


def summary(steps):
    s = sorted(steps)
    return s[len(s) // 2], s[0]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=3_000_000)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=0)
    a = ap.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    config = Qwen4ExpTextConfig(
        vocab_size=VOCAB,
        hidden_size=H,
        num_hidden_layers=2,
        hc_count=HC,
        ple_layer_ids=[1],
        ple_embed_dim=HEADS * HEAD_DIM,
        ngram_size=3,
        heads_per_ngram=8,
        ngram_vocab_size_base=max(a.rows // HEADS, 1000),
        eos_token_id=VOCAB - 1,
    )
    t0 = time.perf_counter()
    torch.manual_seed(1234)
    layer = Qwen4ExpTextPLELayer(config, layer_idx=1, ple_layer_index=0).to(torch.bfloat16).eval()
    with torch.no_grad():
        for p in (layer.key_proj.weight, layer.value_proj.weight):
            p.uniform_(-0.02, 0.02)
        layer.ple_embedding.ngram_embedding.weight.uniform_(-1, 1)
    rows = layer.ple_embedding.ngram_embedding.weight.shape[0]
    print(f"transformers Qwen4ExpTextPLELayer, bfloat16, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads, table {rows} rows")
    print(f"setup {time.perf_counter() - t0:.1f} s")
    gen = torch.Generator().manual_seed(99)
    ids = lambda b, t: torch.randint(0, VOCAB - 1, (b, t), generator=gen)
    hid = lambda b, t: (torch.rand(b, t, HC * H, generator=gen) * 2 - 1).to(torch.bfloat16)
    with torch.inference_mode():
        t = 512
        layer(hid(1, t), ids(1, t), DynamicCache(config=config))
        steps = []
        for _ in range(a.reps):
            cache = DynamicCache(config=config)
            h, i = hid(1, t), ids(1, t)
            s0 = time.perf_counter()
            layer(h, i, cache)
            steps.append(time.perf_counter() - s0)
        med, best = summary(steps)
        print(f"prefill chunk {t}: median {t / med:8.1f} tokens/s, best {t / best:8.1f} tokens/s  "
              f"({med * 1e3:.1f} ms/chunk median)")
        for b in (1, 16, 32, 64):
            cache = DynamicCache(config=config)
            layer(hid(b, 16), ids(b, 16), cache)
            n = min(max(a.reps * 64 // b, a.reps), 200)
            layer(hid(b, 1), ids(b, 1), cache)
            per_step = []
            for _ in range(n):
                h, i = hid(b, 1), ids(b, 1)
                s0 = time.perf_counter()
                layer(h, i, cache)
                per_step.append(time.perf_counter() - s0)
            med, best = summary(per_step)
            print(f"decode batch {b:3d}: median {b / med:8.1f} tokens/s, best {b / best:8.1f} tokens/s  "
                  f"({med * 1e3:.2f} ms/step median)")


if __name__ == "__main__":
    main()
