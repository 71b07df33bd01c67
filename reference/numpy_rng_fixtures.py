#!/usr/bin/env python3
"""Regenerate fixtures/numpy_rng/golden.json from the real numpy.

The Rust crate `metrale-numpy-rng` re-implements numpy's SeedSequence,
PCG64 and `Generator.integers(..., dtype=np.int64)`; its tests compare
bit for bit against the JSON written here. Only numpy is required:

    pip install numpy
    python3 reference/numpy_rng_fixtures.py

Every integer is written as a plain JSON number (all fit in u64 or i64).
"""

import json
import os
import sys

import numpy as np

OUT = os.path.join(
    os.path.dirname(os.path.abspath(__file__)), "..", "fixtures", "numpy_rng", "golden.json"
)

MASK32 = (1 << 32) - 1


def seed_words(seed):
    """numpy's little-endian u32 split of a non-negative integer seed."""
    if seed == 0:
        return [0]
    words = []
    while seed > 0:
        words.append(seed & MASK32)
        seed >>= 32
    return words


def engram_half(vocab):
    return ((2**63 - 1) // vocab) // 2


SEEDS = [0, 1, 1234, 10007, 10007 * 15, 2**32 + 5, 2**63 + 7]
# Seeds too large for u64: exercised through the word-slice entropy path.
BIG_SEEDS = [2**64, 2**100 + 12345, 1234567890123456789012345678901234567890]

HALVES = [1, 2, 3, 7, 1000, 2**32 - 1, 2**32, 2**32 + 1, 2**62 - 1, 2**63 - 1]
ENGRAM_VOCABS = [129280 * 5, 99092, 129280]


def seed_case(seed):
    ss = np.random.SeedSequence(seed)
    return {
        "seed": seed if seed < 2**64 else None,
        "seed_words": seed_words(seed),
        "pool": [int(x) for x in ss.pool],
        "state_u32_8": [int(x) for x in ss.generate_state(8, np.uint32)],
        "state_u64_4": [int(x) for x in ss.generate_state(4, np.uint64)],
        "raw": [int(x) for x in np.random.PCG64(seed).random_raw(8)],
    }


def integers_case(seed, low, high, size):
    vals = np.random.default_rng(seed).integers(low, high, size=size, dtype=np.int64)
    return {
        "seed": seed,
        "low": low,
        "high": high,
        "values": [int(x) for x in vals],
    }


def main():
    cases = []
    for seed in SEEDS:
        for half in HALVES:
            cases.append(integers_case(seed, 0, half, 6))
    # Engram multipliers: seed + 10007 * layer_id, N in {3, 4}.
    for base in (0, 1234):
        for layer_id in (1, 15):
            for vocab in ENGRAM_VOCABS:
                for n in (3, 4):
                    cases.append(integers_case(base + 10007 * layer_id, 0, engram_half(vocab), n))
    # Signed and offset ranges.
    for seed in (0, 42):
        cases.append(integers_case(seed, -5, 5, 8))
        cases.append(integers_case(seed, -(2**63), 2**63 - 1, 4))
        cases.append(integers_case(seed, -(2**63), 0, 4))
        cases.append(integers_case(seed, 2**62, 2**62 + 3, 8))
        cases.append(integers_case(seed, 7, 8, 3))
        cases.append(integers_case(seed, 0, 2**63 - 1, 4))
        # Range sizes just above a power of two: Lemire's method rejects
        # about half of all draws here, so the retry loops are exercised.
        cases.append(integers_case(seed, 0, 2**31 + 1, 16))
        cases.append(integers_case(seed, -(2**63), 1, 16))

    # One generator, several calls in order: the 32-bit path leaves half of a
    # 64-bit draw buffered in the bit generator, which later calls must see.
    sequences = []
    for seed in (0, 1234):
        g = np.random.default_rng(seed)
        calls = []
        for low, high, size in [(0, 7, 3), (0, 2**62, 2), (0, 100, 1), (0, 2**32, 1), (-3, 3, 5)]:
            vals = g.integers(low, high, size=size, dtype=np.int64)
            calls.append({"low": low, "high": high, "values": [int(x) for x in vals]})
        sequences.append({"seed": seed, "calls": calls})

    # PCG64.advance: one 32-bit draw (half buffered), then a jump, then draws.
    advances = []
    for seed, delta in [(0, 1), (1234, 5), (7, 2**64 + 3), (99, 2**128 - 1)]:
        g = np.random.default_rng(seed)
        first = int(g.integers(0, 7, size=1, dtype=np.int64)[0])
        g.bit_generator.advance(delta)
        after = [int(x) for x in g.integers(0, 2**62, size=3, dtype=np.int64)]
        raw = [int(x) for x in np.random.PCG64(seed).advance(delta).random_raw(3)]
        advances.append(
            {
                "seed": seed,
                "delta_hi": delta >> 64,
                "delta_lo": delta & (2**64 - 1),
                "first_small": first,
                "after_large": after,
                "raw_after_advance": raw,
            }
        )

    doc = {
        "numpy_version": np.__version__,
        "seeds": [seed_case(s) for s in SEEDS + BIG_SEEDS],
        "integers": cases,
        "sequences": sequences,
        "advances": advances,
    }
    os.makedirs(os.path.dirname(OUT), exist_ok=True)
    with open(OUT, "w") as f:
        json.dump(doc, f, indent=1)
        f.write("\n")
    print(f"wrote {OUT} ({len(cases)} integer cases)", file=sys.stderr)


if __name__ == "__main__":
    main()
