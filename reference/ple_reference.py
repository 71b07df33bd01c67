"""Reference model of the PLE n-gram id hash and its constants.

Written from the definitions in docs/SPEC.md §3 (Id hash) and docs/SPEC.md
§4 (Constant derivation) alone, with numpy only.
It favours clarity over speed: whole-array operations over the token
window, Python integers for the constant derivation. The Rust crate's
fixtures under fixtures/ids/ are produced from this module by
make_fixtures.py.
"""

from __future__ import annotations

import numpy as np

U64 = (1 << 64) - 1
GOLDEN_GAMMA = 0x9E3779B97F4A7C15
SITE_STRIDE = 10007
DEFAULT_SEED = 1234
DEFAULT_DIVISIBLE_BY = 128


def splitmix64(value: int) -> int:
    """One splitmix64 output for input `value` (64-bit wrapping)."""
    z = (value + GOLDEN_GAMMA) & U64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & U64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & U64
    return z ^ (z >> 31)


def layer_multipliers(vocab_size: int, ngram_size: int, seed: int, site: int) -> list[int]:
    """The odd per-position multipliers of PLE site `site`."""
    if vocab_size < 1:
        raise ValueError("vocab_size must be positive")
    limit = ((1 << 63) - 1) // vocab_size
    half = max(1, limit // 2)
    base = (seed + SITE_STRIDE * site) & U64
    out = []
    for i in range(ngram_size):
        r = splitmix64((base + GOLDEN_GAMMA * (i + 1)) & U64)
        out.append(2 * (r % half) + 1)
    return out


# Witnesses that make Miller-Rabin exact for every n < 2^64 (a set found
# by J. Sinclair), deliberately different from the Rust side's choice.
_MR_WITNESSES = (2, 325, 9375, 28178, 450775, 9780504, 1795265022)


def is_prime(n: int) -> bool:
    """Exact primality for 0 <= n < 2^64."""
    if n < 2:
        return False
    for small in (2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37):
        if n % small == 0:
            return n == small
    d, s = n - 1, 0
    while d % 2 == 0:
        d //= 2
        s += 1
    for a in _MR_WITNESSES:
        a %= n
        if a == 0:
            continue
        x = pow(a, d, n)
        if x in (1, n - 1):
            continue
        for _ in range(s - 1):
            x = x * x % n
            if x == n - 1:
                break
        else:
            return False
    return True


def head_vocab_sizes(base: int, ngram_heads: int, site: int) -> list[int]:
    """Head h of site s: the (s*ngram_heads + h + 1)-th prime > base - 1."""
    wanted = (site + 1) * ngram_heads
    primes = []
    candidate = max(base, 2)
    while len(primes) < wanted:
        if is_prime(candidate):
            primes.append(candidate)
        candidate += 1
    return primes[site * ngram_heads:]


def derive(vocab_size: int, eos_token_id: int, ngram_size: int, heads_per_ngram: int,
           ngram_vocab_size_base: int, divisible_by: int = DEFAULT_DIVISIBLE_BY,
           seed: int = DEFAULT_SEED, site: int = 0) -> dict:
    """All constants of one PLE site, as plain Python ints."""
    heads = (ngram_size - 1) * heads_per_ngram
    sizes = head_vocab_sizes(ngram_vocab_size_base, heads, site)
    offsets = [0]
    for s in sizes[:-1]:
        offsets.append(offsets[-1] + s)
    total = sum(sizes)
    padded = -(-total // divisible_by) * divisible_by
    return {
        "ngram_size": ngram_size,
        "heads_per_ngram": heads_per_ngram,
        "eos_token_id": eos_token_id,
        "multipliers": layer_multipliers(vocab_size, ngram_size, seed, site),
        "head_vocab_sizes": sizes,
        "head_offsets": offsets,
        "padded_rows": padded,
    }


def segment_starts(window: np.ndarray, eos: int) -> np.ndarray:
    """For each position, the index where its EOS-delimited segment begins.

    A segment begins right after an EOS; the EOS ends the segment before.
    """
    idx = np.arange(len(window), dtype=np.int64)
    after_eos = np.where(window == eos, idx + 1, 0)
    # Position i only sees EOS tokens strictly before it.
    seen = np.concatenate([np.zeros(1, dtype=np.int64), after_eos[:-1]])
    return np.maximum.accumulate(seen) if len(window) else seen[:0]


def shifted(window: np.ndarray, p: int, eos: int, starts: np.ndarray) -> np.ndarray:
    """shift_p: the token p places back within the segment, else EOS."""
    idx = np.arange(len(window), dtype=np.int64)
    src = idx - p
    inside = src >= starts
    out = np.full(len(window), eos, dtype=np.uint64)
    out[inside] = window[src[inside]].astype(np.uint64)
    return out


def ngram_ids(window, dims: dict) -> np.ndarray:
    """The ids of every position of `window`: shape [len, ngram_heads]."""
    window = np.asarray(window, dtype=np.int64)
    n_max = dims["ngram_size"]
    k = dims["heads_per_ngram"]
    eos = dims["eos_token_id"]
    mults = np.array(dims["multipliers"], dtype=np.uint64)
    sizes = np.array(dims["head_vocab_sizes"], dtype=np.uint64)
    offsets = np.array(dims["head_offsets"], dtype=np.uint64)
    starts = segment_starts(window, eos)
    shifts = [shifted(window, p, eos, starts) for p in range(n_max)]
    ids = np.zeros((len(window), (n_max - 1) * k), dtype=np.uint64)
    for order in range(2, n_max + 1):
        mixed = np.zeros(len(window), dtype=np.uint64)
        for p in range(order):
            mixed ^= shifts[p] * mults[p]  # uint64 arrays wrap mod 2^64
        first = (order - 2) * k
        for h in range(first, first + k):
            ids[:, h] = mixed % sizes[h] + offsets[h]
    return ids


def fresh_history(dims: dict) -> list[int]:
    """A sequence start: context_len EOS tokens."""
    return [dims["eos_token_id"]] * (dims["ngram_size"] - 1)


def hash_chunk(history: list[int], tokens: list[int], dims: dict):
    """Hash `tokens` after `history`: (ids [T, heads], new history)."""
    window = list(history) + list(tokens)
    ids = ngram_ids(window, dims)[len(history):]
    ctx = dims["ngram_size"] - 1
    return ids, window[len(window) - ctx:]


if __name__ == "__main__":
    d = derive(151936, 151645, 3, 8, 20_000_000)
    assert d["multipliers"] == [15411308609579, 2523213358983, 11275943025685]
    assert d["head_vocab_sizes"][:3] == [20000003, 20000023, 20000033]
    assert d["padded_rows"] == 320_001_536
    print("docs/SPEC.md §4 example reproduced")
