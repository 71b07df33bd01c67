"""Python call overhead of a batched decode step.

Times ``Engine.decode(batch, hidden)`` called from a Python loop against the
same engine call made from Rust (``metrale_ple._rust_decode_timing``, which
holds the highway rows in a Rust buffer and times the call inside Rust), on
one engine, alternating step by step so drift hits both alike. Prints the median step time of each, the
difference (the Python call's overhead: argument checks, the GIL release,
the numpy view) and the ratio, and the median time of an empty decode
call from Python (the fixed cost of crossing into Rust).

Usage: python crates/python/bench/overhead.py [--presets flagship,tiny]
       [--batch 32] [--steps 20] [--rounds 5] [--dir DIR]

The flagship checkpoint has the real geometry (H = 2560, hc = 4, 16 heads
of 160) with its table cut to --table-rows rows (ids fold into them); it is
written on first use under --dir (default: a temporary directory).
"""

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

import metrale_ple


def bench(ck, batch: int, steps: int, rounds: int) -> dict:
    g = ck.geometry
    with metrale_ple.Engine(ck, table="resident", prefix_cache_mib=0, resident_carries=0,
                            max_batch=batch, prefill_chunk=16) as e:
        W = e.width
        rng = np.random.default_rng(0)
        seqs = []
        for _ in range(batch):
            p = rng.integers(0, min(g["vocab_size"], 1 << 16), 8).tolist()
            sid, _ = e.add_sequence(p)
            e.prefill(sid, p, np.full((len(p), W), 0.5, np.float32))
            seqs.append(sid)
        pairs = [(s, int(t)) for s, t in zip(seqs, rng.integers(0, 1000, batch))]
        hidden = np.full((batch, W), 0.5, np.float32)
        # Warm up both paths.
        for _ in range(3):
            e.decode(pairs, hidden)
        metrale_ple._rust_decode_timing(e, pairs, 3)
        py_t, rs_t = [], []
        # Steps alternate between the two so that load from elsewhere hits
        # both alike.
        for _ in range(rounds * steps):
            hidden.fill(0.5)
            t = time.perf_counter()
            e.decode(pairs, hidden)
            py_t.append(time.perf_counter() - t)
            rs_t.extend(metrale_ple._rust_decode_timing(e, pairs, 1))
        # The fixed cost of a call with no work: argument checks, the GIL
        # release and the lock.
        empty = np.empty((0, W), np.float32)
        call_t = []
        for _ in range(2000):
            t = time.perf_counter()
            e.decode([], empty)
            call_t.append(time.perf_counter() - t)
    py_m, rs_m = statistics.median(py_t), statistics.median(rs_t)
    return {"width": W, "python": py_m, "rust": rs_m, "overhead": py_m - rs_m, "ratio": py_m / rs_m,
            "python_min": min(py_t), "rust_min": min(rs_t), "empty_call": statistics.median(call_t)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--presets", default="flagship,tiny")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--table-rows", type=int, default=65536)
    ap.add_argument("--dir", type=Path)
    a = ap.parse_args()
    tmp = None
    if a.dir is None:
        tmp = tempfile.TemporaryDirectory()
        a.dir = Path(tmp.name)
    print(f"batched decode, batch {a.batch}, {a.rounds * a.steps} steps each way, alternating (medians)")
    for preset in a.presets.split(","):
        path = a.dir / preset
        if (path / "config.json").exists():
            ck = metrale_ple.Checkpoint.open(path)
        else:
            rows = a.table_rows if preset == "flagship" else None
            ck = metrale_ple.init_checkpoint(path, preset=preset, table_rows=rows)
        r = bench(ck, a.batch, a.steps, a.rounds)
        g = ck.geometry
        print(f"{preset:9s} H={g['hidden_size']} hc={g['hc_mult']} heads={g['ngram_heads']}x{g['head_dim']} "
              f"sites={len(ck.sites)}: python {r['python'] * 1e6:10.1f} us/step, "
              f"rust {r['rust'] * 1e6:10.1f} us/step, overhead {r['overhead'] * 1e6:+8.1f} us "
              f"(ratio {r['ratio']:.3f}; min {r['python_min'] * 1e6:.1f} vs {r['rust_min'] * 1e6:.1f} us; "
              f"an empty decode call from Python {r['empty_call'] * 1e6:.2f} us)")
    if tmp is not None:
        tmp.cleanup()


if __name__ == "__main__":
    main()
