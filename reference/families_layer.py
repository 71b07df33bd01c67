"""Reference layers of the Engram and LongCat families, and the fixtures
under fixtures/families_layer/.

Written from docs/SPEC.md §5 (Layer math) and §11 (Families) and the public
descriptions of the two families (the Engram demo's `Engram` module and
`ShortConv`, DeepSeek-V4.1's conv-less Engram with FP8 tables, LongCat's
n-gram embedding), not from the Rust code. numpy only, float64 throughout;
the ids come from `families_reference.py`. The Rust test
(crates/model-layers/tests/families_layer.rs) reads the JSON this writes.

Engram, per token and highway stream b (hc streams of width H):
  e        = the rows of every head concatenated (order 2 heads first)
  key_b    = e @ Wk_b^T + bk_b            (Wk stacks the streams: [hc*H, E])
  value    = e @ Wv^T + bv                ([H, E], shared by the streams)
  g_b      = sum(norm(key_b; wk_b, eps_k) * norm(h_b; wq_b, eps_q)) / sqrt(H)
  gate_b   = sigmoid(sign(g_b) * sqrt(max(|g_b|, 1e-6)))
  v_b      = gate_b * value
  norm(x; w, eps) = x / sqrt(mean(x^2) + eps) * w      (weights start at 1)
  with the short conv (the demo): xn_b = norm(v_b; wc_b, 1e-5), y = the
    causal depthwise conv of kernel K and dilation D over xn (the carried
    rows first), out = v + silu(y);
  without it (DeepSeek-V4.1): out = v.
  highway += out.
  The demo's query and key norms use the f32 machine epsilon
  (torch.nn.RMSNorm without an eps takes its dtype's).

DeepSeek-V4.1's published gate (`DeepseekV41Engram`) differs in three ways:
  both norms use config.rms_norm_eps (the fixture picks 0.05, far from the
  f32 epsilon, so the difference shows);
  gate_b = sigmoid(copysign(sqrt(max(|g_b|, 1e-6)), g_b)): a dot product of
    exactly +0 gives sigmoid(1e-3), not 0.5 (the fixture has a token whose
    highway row is all zeros);
  a per-token mask: a masked token's gate is 0 (its highway passes through),
    and its compressed id reads as DEAD in the look-back of the hash, so the
    next tokens' n-grams stop there (engram_ids_bounded).

LongCat (one stream, at the input; the highway holds the word embedding):
  highway = (highway + sum_i P_i @ row_i) / (1 + k*(n-1)), where the
  sub-table projections P_i [H, head_dim] side by side are one [H, E]
  matrix.

Table rows: BF16, or DeepSeek-V4.1's FP8 E4M3 with one UE8M0 byte per 32
values (the block's scale 2^(byte - 127)), stored after the values: a row of
head_dim values is head_dim + head_dim/32 bytes.

Usage: python3 reference/families_layer.py [OUT_DIR]
"""

import json
import math
import os
import sys

import numpy as np

from families_reference import engram_ids, engram_ids_bounded, engram_multipliers
from families_reference import engram_sizes, longcat_ids
from families_reference import longcat_layout, offsets_of
from ple_layer import bf16_bits, from_bf16_bits

F32_EPS = 2.0 ** -23
F32_MAX = float(np.finfo(np.float32).max)
FP8_BLOCK = 32

# ------------------------------------------------------------------- FP8


def fp8_e4m3_value(b):
    """The value of an FP8 E4M3 ("FN": no infinities, S.1111.111 NaN) byte."""
    s = -1.0 if b & 0x80 else 1.0
    e = (b >> 3) & 0xF
    m = b & 0x7
    if e == 0xF and m == 0x7:
        return float("nan")
    if e == 0:
        return s * m * 2.0 ** -9
    return s * (1.0 + m / 8.0) * 2.0 ** (e - 7)


FP8_VALUES = [fp8_e4m3_value(b) for b in range(256)]


def fp8_encode(v):
    """The nearest FP8 E4M3 byte to v (ties to the even code); |v| <= 448."""
    sign = 0x80 if math.copysign(1.0, v) < 0 else 0
    a = abs(v)
    best = None
    for b in range(0x7F):
        d = abs(FP8_VALUES[b] - a)
        if best is None or d < best[0] or (d == best[0] and b % 2 == 0):
            best = (d, b)
    return sign | best[1]


def ue8m0_value(e):
    return float("nan") if e == 255 else 2.0 ** (e - 127)


def ue8m0_scale(block):
    """The UE8M0 byte of the smallest power of two >= amax / 448."""
    amax = max(abs(float(v)) for v in block)
    if amax == 0.0:
        return 127
    m, ex = math.frexp(amax / 448.0)  # amax/448 = m * 2^ex, m in [0.5, 1)
    p = ex - 1 if m == 0.5 else ex
    return min(max(p + 127, 0), 254)


def quantize_block_row(values):
    """values (float32) -> the row's bytes: FP8 values, then block scales."""
    scales = [ue8m0_scale(values[i:i + FP8_BLOCK]) for i in range(0, len(values), FP8_BLOCK)]
    out = []
    for i, v in enumerate(values):
        scale = ue8m0_value(scales[i // FP8_BLOCK])
        b = fp8_encode(float(v) / scale)
        # A code whose value times the scale is past the f32 range (values
        # next to f32's largest) gives way to the next code toward zero.
        if abs(FP8_VALUES[b]) * scale > F32_MAX:
            b -= 1
        out.append(b)
    return out + scales


def decode_block_row(row, head_dim):
    return np.array([FP8_VALUES[row[i]] * ue8m0_value(row[head_dim + i // FP8_BLOCK])
                     for i in range(head_dim)])


# ------------------------------------------------------------------ layers


def norm(x, w, eps, hc, H):
    """Grouped RMS norm of the `x * w` form over x [T, hc*H]."""
    T = x.shape[0]
    xs = x.reshape(T, hc, H)
    r = 1.0 / np.sqrt(np.mean(xs * xs, axis=2, keepdims=True) + eps)
    return (xs * r).reshape(T, hc * H) * w


def engram_layer(g, w, emb, highway, conv_state, masked=None):
    """One Engram forward over T tokens: emb [T, E] (float64), highway
    [T, C]; conv_state [S, C] or None; masked: one flag per token (V4.1
    only) or None. The gate rule and the query and key epsilons are g's
    ("gate": "engram_demo" or "deepseek_v41"). Returns (new highway, new
    conv state, min |g| over the unmasked tokens whose g is not 0)."""
    H, hc = g["hidden"], g["hc_mult"]
    C = H * hc
    T = emb.shape[0]
    wk = from_bf16_bits(w["key_proj"]).astype(np.float64).reshape(C, -1)
    wv = from_bf16_bits(w["value_proj"]).astype(np.float64).reshape(H, -1)
    key = emb @ wk.T + np.asarray(w["key_bias"], np.float64)
    value = emb @ wv.T + np.asarray(w["value_bias"], np.float64)
    hw = np.asarray(highway, np.float64)
    nq = norm(hw, np.asarray(w["norm_query"], np.float64), g["query_eps"], hc, H).reshape(T, hc, H)
    nk = norm(key, np.asarray(w["norm_key"], np.float64), g["key_eps"], hc, H).reshape(T, hc, H)
    gdot = np.sum(nq * nk, axis=2) / math.sqrt(H)
    root = np.sqrt(np.maximum(np.abs(gdot), 1e-6))
    if g["gate"] == "deepseek_v41":
        z = np.copysign(root, gdot)
    else:
        z = np.sign(gdot) * root
    sigma = 1.0 / (1.0 + np.exp(-z))
    if masked is not None:
        sigma[np.asarray(masked, bool)] = 0.0
    v = (sigma[:, :, None] * value[:, None, :]).reshape(T, C)
    live = np.abs(gdot)[sigma > 0.0]
    live = live[live > 0.0]
    min_gate = float(np.min(live))
    if conv_state is None:
        return hw + v, None, min_gate
    K, D = g["conv_kernel"], g["dilation"]
    S = (K - 1) * D
    xn = norm(v, np.asarray(w["norm_conv"], np.float64), g["conv_eps"], hc, H)
    x = np.concatenate([conv_state, xn])
    cw = np.asarray(w["conv1d"], np.float64).reshape(C, K)
    y = np.zeros((T, C))
    for j in range(K):
        back = (K - 1 - j) * D
        y += cw[:, j] * x[S - back:S - back + T]
    out = v + y / (1.0 + np.exp(-y))
    return hw + out, x[-S:].copy(), min_gate


def longcat_layer(g, w, emb, highway):
    H = g["hidden"]
    wv = from_bf16_bits(w["value_proj"]).astype(np.float64).reshape(H, -1)
    return (np.asarray(highway, np.float64) + emb @ wv.T) / (1 + g["ngram_heads"])


# ---------------------------------------------------------------- fixtures


def f32_list(a):
    return [float(v) for v in np.asarray(a, np.float32).reshape(-1)]


def rows_of(table, ids):
    return np.stack([table[i] for row in ids for i in row]).reshape(len(ids), -1)


def engram_site(name, rng, *, hc, H, n, heads, head_dim, bases, hashed_vocab, pad, seed,
                layer, conv, fp8, tokens, chunks, v41=None):
    """v41: None for the demo's gate, else DeepSeek-V4.1's published gate
    with {"rms_eps": e, "zero_rows": [t, ...] (highway rows set to 0, so
    their dot products are exactly 0), "masked": [t, ...]}."""
    sizes = engram_sizes(bases, heads, layer + 1)[layer]
    offsets, rows = offsets_of(sizes)
    mults = engram_multipliers(hashed_vocab, n, seed, layer)
    E, C = (n - 1) * heads * head_dim, hc * H
    g = {
        "name": name, "family": "engram", "hidden": H, "hc_mult": hc, "head_dim": head_dim,
        "ngram_size": n, "heads_per_ngram": heads, "multipliers": mults,
        "head_vocab_sizes": sizes, "head_offsets": offsets, "pad_id": pad,
        "hashed_vocab": hashed_vocab, "table_rows": rows, "conv": conv,
        "conv_kernel": 4 if conv else 1, "dilation": n, "conv_eps": 1e-5,
        "query_eps": F32_EPS, "key_eps": F32_EPS, "gate": "engram_demo",
    }
    masked = None
    if v41 is not None:
        eps = float(np.float32(v41["rms_eps"]))
        masked = [t in v41["masked"] for t in range(len(tokens))]
        g.update({"gate": "deepseek_v41", "rms_eps": eps, "query_eps": eps, "key_eps": eps,
                  "masked": masked, "zero_rows": v41["zero_rows"]})
    if fp8:
        values = (rng.standard_normal((rows, head_dim)) *
                  np.exp(rng.uniform(-4, 2, (rows, 1)))).astype(np.float32)
        table_bytes = [quantize_block_row(r) for r in values]
        table = np.stack([decode_block_row(r, head_dim) for r in table_bytes])
        g["table_dtype"] = "fp8_e4m3_block32"
        g["table"] = [b for r in table_bytes for b in r]
    else:
        bits = bf16_bits(rng.standard_normal((rows, head_dim)).astype(np.float32))
        table = from_bf16_bits(bits).astype(np.float64)
        g["table_dtype"] = "bf16"
        g["table"] = [int(b) for b in bits.reshape(-1)]
    w = {
        "key_proj": bf16_bits((rng.standard_normal((C, E)) / math.sqrt(E)).astype(np.float32)),
        "value_proj": bf16_bits((rng.standard_normal((H, E)) / math.sqrt(E)).astype(np.float32)),
        "key_bias": (0.1 * rng.standard_normal(C)).astype(np.float32),
        "value_bias": (0.1 * rng.standard_normal(H)).astype(np.float32),
        "norm_query": (1.0 + 0.1 * rng.standard_normal(C)).astype(np.float32),
        "norm_key": (1.0 + 0.1 * rng.standard_normal(C)).astype(np.float32),
        "norm_conv": (1.0 + 0.1 * rng.standard_normal(C)).astype(np.float32) if conv else [],
        "conv1d": (0.5 * rng.standard_normal(C * 4)).astype(np.float32) if conv else [],
    }
    if masked is None:
        ids = engram_ids(tokens, None, pad, mults, sizes, offsets, n, heads)
    else:
        ids = engram_ids_bounded(tokens, [False] * len(tokens), masked, None, pad, mults,
                                 sizes, offsets, n, heads)
    emb = rows_of(table, ids)
    hw_in = rng.standard_normal((len(tokens), C)).astype(np.float32)
    if v41 is not None:
        wk = from_bf16_bits(w["key_proj"]).astype(np.float64).reshape(C, -1)
        key = (emb @ wk.T + np.asarray(w["key_bias"], np.float64)) * w["norm_key"]
        for t in v41["zero_rows"]:
            hw_in[t] = 0.0
            # A positive key term in every stream makes the f32 sum of the
            # products +0 (-0 terms alone would sum to -0, the other side).
            assert all(np.any(key[t, b * H:(b + 1) * H] > 0) for b in range(hc))
    state = np.zeros((3 * n, C)) if conv else None
    hw_out, state, min_gate = engram_layer(g, w, emb, hw_in, state, masked)
    history = tokens[-(n - 1):]
    if masked is not None and any(masked):
        # A masked token blocks every later look-back at it, so the carried
        # history reads as the pad id at and before the last masked token
        # (as the start of a sequence does).
        last = max(t for t in range(len(tokens)) if masked[t])
        history = [pad if len(tokens) - (n - 1) + i <= last else v
                   for i, v in enumerate(history)]
    g.update({
        "weights": {k: ([int(b) for b in np.asarray(v).reshape(-1)] if k.endswith("proj")
                        else f32_list(v)) for k, v in w.items()},
        "tokens": tokens, "chunks": chunks, "ids": ids,
        "highway_in": f32_list(hw_in), "highway_out": f32_list(hw_out),
        "history_out": history,
        "conv_state_out": f32_list(state) if conv else [],
        "min_abs_gate": min_gate,
    })
    return g


def longcat_site(name, rng, *, vocab, eos, n, k, head_dim, m, tokens, chunks):
    count = (n - 1) * k
    sizes, offsets, rows = longcat_layout(m, count)
    H = count * head_dim
    bits = bf16_bits(rng.standard_normal((rows, head_dim)).astype(np.float32))
    table = from_bf16_bits(bits).astype(np.float64)
    wv = bf16_bits((rng.standard_normal((H, H)) / math.sqrt(H)).astype(np.float32))
    g = {
        "name": name, "family": "longcat", "hidden": H, "hc_mult": 1, "head_dim": head_dim,
        "ngram_size": n, "heads_per_ngram": k, "ngram_heads": count, "vocab_size": vocab,
        "eos_token_id": eos, "head_vocab_sizes": sizes, "head_offsets": offsets,
        "table_rows": rows, "table_dtype": "bf16", "table": [int(b) for b in bits.reshape(-1)],
    }
    ids = longcat_ids(tokens, vocab, eos, sizes, offsets, n, k)
    emb = rows_of(table, ids)
    word = rng.standard_normal((len(tokens), H)).astype(np.float32)
    out = longcat_layer(g, {"value_proj": wv}, emb, word)
    g.update({
        "weights": {"value_proj": [int(b) for b in wv.reshape(-1)]},
        "tokens": tokens, "chunks": chunks, "ids": ids,
        "highway_in": f32_list(word), "highway_out": f32_list(out),
        "history_out": tokens[-(n - 1):],
        "conv_state_out": [],
    })
    return g


def fp8_block_cases(rng):
    """Rows the Rust converter must quantise to these bytes and decode to
    these values (64 values: two blocks of different magnitudes)."""
    cases = []
    for spread in (0.0, 3.0, 9.0):
        v = rng.standard_normal(64) * np.exp(rng.uniform(-spread, spread, 64))
        v[5] = 0.0
        v[40:44] = [448.0, -1e-3, 2.0 ** -10, 7.0]
        if spread == 9.0:
            v[60] = -F32_MAX
        v = v.astype(np.float32)
        row = quantize_block_row(v)
        cases.append({"values": f32_list(v), "bytes": row,
                      "decoded": f32_list(decode_block_row(row, 64))})
    zero = np.zeros(32, np.float32)
    row = quantize_block_row(zero)
    cases.append({"values": f32_list(zero), "bytes": row,
                  "decoded": f32_list(decode_block_row(row, 32))})
    return cases


def main():
    out = sys.argv[1] if len(sys.argv) > 1 else os.path.join(
        os.path.dirname(os.path.abspath(__file__)), "..", "fixtures", "families_layer")
    os.makedirs(out, exist_ok=True)
    rng = np.random.default_rng(20261204)

    def toks(count, limit, specials=()):
        t = [int(v) for v in rng.integers(0, limit, count)]
        for pos, val in specials:
            t[pos] = val
        return t

    sites = [
        engram_site("engram_demo_conv", rng, hc=4, H=16, n=3, heads=2, head_dim=8,
                    bases=[31, 41], hashed_vocab=97, pad=2, seed=0, layer=1, conv=True,
                    fp8=False, tokens=toks(19, 97, [(4, 2), (11, 2), (12, 2)]),
                    chunks=[4, 1, 7, 1, 6]),
        engram_site("engram_v41_fp8", rng, hc=2, H=16, n=4, heads=2, head_dim=32,
                    bases=[53, 59, 61], hashed_vocab=101, pad=0, seed=3, layer=2, conv=False,
                    fp8=True, tokens=toks(17, 101, [(0, 0), (9, 0)]),
                    chunks=[3, 1, 1, 8, 4],
                    v41={"rms_eps": 0.05, "zero_rows": [6], "masked": [2, 11, 12]}),
        longcat_site("longcat", rng, vocab=50, eos=2, n=3, k=2, head_dim=8, m=60,
                     tokens=toks(18, 50, [(5, 2), (6, 2), (13, 2)]),
                     chunks=[2, 5, 1, 1, 9]),
    ]
    for s in sites:
        assert sum(s["chunks"]) == len(s["tokens"])
        with open(os.path.join(out, s["name"] + ".json"), "w") as f:
            json.dump(s, f, separators=(",", ":"))
            f.write("\n")
    with open(os.path.join(out, "fp8_block.json"), "w") as f:
        json.dump({"cases": fp8_block_cases(rng)}, f, separators=(",", ":"))
        f.write("\n")


if __name__ == "__main__":
    main()
