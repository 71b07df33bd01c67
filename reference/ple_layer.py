"""Reference PLE layer forward with its per-sequence carry (numpy only).

Written from docs/SPEC.md §5 (Layer math) and docs/SPEC.md §6 (Carry
lifecycle), independently of the Rust code; the id hash, docs/SPEC.md §3 (Id
hash), is the project's reference one, `ple_reference.py`. The
values that are BF16 in the model (table rows and the two projection
weights) are rounded to BF16 exactly as the Rust code holds them; everything
else is computed in float64 and rounded to float32 once, where the highway is
written. The result is the mathematically exact answer for the BF16 inputs,
up to float64 rounding, so a comparison against it measures the Rust code's
float32 rounding alone.
"""

import numpy as np

from ple_reference import hash_chunk

# ---------------------------------------------------------------- BF16

def bf16_round(x):
    """Round float32 values to the nearest BF16 (ties to even), as float32."""
    b = np.asarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    b = (b + 0x7FFF + ((b >> 16) & 1)) >> 16
    return (b.astype(np.uint32) << 16).view(np.float32)


def bf16_bits(x):
    return (bf16_round(x).view(np.uint32) >> 16).astype(np.uint16)


def from_bf16_bits(bits):
    return (np.asarray(bits, dtype=np.uint32) << 16).view(np.float32)


# ---------------------------------------------------------------- the layer

class PleLayerRef:
    def __init__(self, g, w, table_bits):
        """g: geometry dict holding the hash dims of `ple_reference.derive`
        (ngram_size, heads_per_ngram, eos_token_id, multipliers,
        head_vocab_sizes, head_offsets) and the layer's shape; w: weights dict
        (BF16 bits for the projections); table_bits: uint16 [rows, head_dim]."""
        self.g = g
        self.H = g["hidden"]
        self.hc = g["hc_mult"]
        self.C = self.H * self.hc
        self.K = g["conv_kernel"]
        self.D = g["dilation"]
        self.S = (self.K - 1) * self.D
        self.eps = g["eps"]
        self.ctx = g["ngram_size"] - 1
        self.table = from_bf16_bits(table_bits).astype(np.float64)
        self.wk = from_bf16_bits(w["key_proj"]).astype(np.float64)      # [C, E]
        self.wv = from_bf16_bits(w["value_proj"]).astype(np.float64)    # [H, E]
        self.nk = np.asarray(w["norm_key"], np.float64)
        self.nq = np.asarray(w["norm_query"], np.float64)
        self.nc = np.asarray(w["norm_conv"], np.float64)
        self.cw = np.asarray(w["conv1d"], np.float64).reshape(self.C, self.K)

    def new_state(self):
        return {"history": [self.g["eos_token_id"]] * self.ctx, "conv": np.zeros((self.S, self.C))}

    def _norm(self, x, w):
        """Grouped RMS norm over each H-wide stream slice of x [T, C]."""
        T = x.shape[0]
        xs = x.reshape(T, self.hc, self.H)
        r = 1.0 / np.sqrt(np.mean(xs * xs, axis=2, keepdims=True) + self.eps)
        return (xs * r).reshape(T, self.C) * (1.0 + w)

    def forward(self, st, highway, tokens):
        """highway: float32 [T, C]; returns the new float32 highway and
        updates st (history, conv) in place."""
        rows, new_history = hash_chunk(st["history"], tokens, self.g)
        T = len(tokens)
        emb = self.table[np.asarray(rows, dtype=np.int64)].reshape(T, -1)
        key = emb @ self.wk.T
        value = emb @ self.wv.T
        hw = highway.astype(np.float64)
        nq = self._norm(hw, self.nq).reshape(T, self.hc, self.H)
        nk = self._norm(key, self.nk).reshape(T, self.hc, self.H)
        gdot = np.sum(nq * nk, axis=2) / np.sqrt(self.H)                     # [T, hc]
        self.min_abs_gate = min(getattr(self, "min_abs_gate", np.inf), float(np.min(np.abs(gdot))))
        z = np.sign(gdot) * np.sqrt(np.maximum(np.abs(gdot), 1e-6))
        sigma = 1.0 / (1.0 + np.exp(-z))
        gated = (sigma[:, :, None] * value[:, None, :]).reshape(T, self.C)
        xn = self._norm(gated, self.nc)
        x = np.concatenate([st["conv"], xn])                                 # [S + T, C]
        y = np.zeros((T, self.C))
        for j in range(self.K):
            back = (self.K - 1 - j) * self.D
            y += self.cw[:, j] * x[self.S - back:self.S - back + T]
        out = gated + y / (1.0 + np.exp(-y))
        st["conv"] = x[-self.S:].copy()
        st["history"] = [int(t) for t in new_history]
        return (hw + out).astype(np.float32)
