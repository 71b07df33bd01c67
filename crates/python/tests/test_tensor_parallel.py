"""Tensor-parallel ranks from Python: shares written by shard_checkpoint
reproduce the unsharded engine to float32 accuracy through prefill, batched
decode and a snapshot restore, both as every rank in this process and as
ranks in Python threads whose projections a reduce callable sums; each rank
stores half the table bytes; splits that do not divide are refused."""

import threading

import numpy as np
import pytest

import metrale_ple
from conftest import highway_rows


def script(e, width):
    """Prefill two sequences, decode them in batches, snapshot one, release
    and restore it, decode again: every output row, in order."""
    rng = np.random.default_rng(7)
    prompts = [rng.integers(0, 4000, n).tolist() for n in (13, 7)]
    out = []
    seqs = []
    for p in prompts:
        sid, restored = e.add_sequence(p)
        assert restored == 0
        hw = highway_rows(p, width)
        e.prefill(sid, p, hw)
        out.append(hw.copy())
        seqs.append([sid, list(p)])

    def decode(steps):
        for _ in range(steps):
            batch = []
            for s in seqs:
                t = int(rng.integers(0, 4000))
                s[1].append(t)
                batch.append((s[0], t))
            hw = np.vstack([highway_rows([t], width) for _, t in batch])
            e.decode(batch, hw)
            out.append(hw.copy())

    decode(4)
    snap = e.snapshot(seqs[0][0])
    e.release(seqs[0][0])
    seqs[0][0] = e.add_from_snapshot(snap, seqs[0][1])
    decode(3)
    for sid, _ in seqs:
        e.release(sid)
    return np.vstack(out)


def unsharded(ck):
    with metrale_ple.Engine(ck, table="resident", prefix_cache_mib=0) as e:
        return script(e, e.width)


def close(got, want):
    scale = max(1.0, float(np.abs(want).max()))
    return float(np.abs(got - want).max()) / scale


def test_in_process_ranks_reproduce_the_unsharded_engine(tiny, tmp_path):
    want = unsharded(tiny)
    for ranks in (2, 4):
        dirs = metrale_ple.shard_checkpoint(tiny.path, tmp_path / f"of{ranks}", ranks=ranks)
        assert [d.name for d in dirs] == [f"rank-{r}-of-{ranks}" for r in range(ranks)]
        with metrale_ple.TensorParallelEngine(dirs, table="cached", slots=4096) as e:
            assert e.ranks == ranks
            got = script(e, e.width)
            st = e.stats()
        assert close(got, want) <= 2e-6, (ranks, close(got, want))
        assert st["ranks"] == ranks
        # Each rank stores, and reads, its share of the table.
        # The tiny checkpoint's rows: head_dim BF16 values.
        full = sum(s.stored_rows for s in tiny.sites) * tiny.geometry["head_dim"] * 2
        assert st["rank_table_bytes"] == [full // ranks] * ranks
        assert all(r > 0 for r in st["rank_bytes_read"])


def test_threads_with_a_reduce_callable_reproduce_the_unsharded_engine(tiny, tmp_path):
    want = unsharded(tiny)
    ranks = 2
    dirs = metrale_ple.shard_checkpoint(tiny.path, tmp_path / "tp", ranks=ranks)
    # The collective: each rank posts its partial, the last one sums them
    # in rank order, every rank copies the sum back (as an all-reduce).
    parts = [None] * ranks
    total = {}
    barrier = threading.Barrier(ranks)

    def reducer(rank):
        def reduce(partial):
            parts[rank] = partial.copy()
            if barrier.wait() == 0:
                total["sum"] = parts[0] + parts[1]
            barrier.wait()
            partial[:] = total["sum"]
            barrier.wait()

        return reduce

    outs = [None] * ranks
    errors = []

    def run(rank):
        try:
            with metrale_ple.TensorParallelEngine(
                [dirs[rank]], reduce=reducer(rank), table="resident"
            ) as e:
                assert e.ranks == 1
                outs[rank] = script(e, e.width)
        except Exception as ex:  # surfaced below
            errors.append(ex)
            barrier.abort()

    threads = [threading.Thread(target=run, args=(r,)) for r in range(ranks)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert np.array_equal(outs[0], outs[1])
    assert close(outs[0], want) <= 2e-6


def test_splits_that_do_not_divide_are_refused(tiny, tmp_path):
    with pytest.raises(ValueError, match="head_dim 16 is not divisible by 3 ranks"):
        metrale_ple.shard_checkpoint(tiny.path, tmp_path / "of3", ranks=3)
    assert not (tmp_path / "of3" / "rank-0-of-3").exists()
    dirs = metrale_ple.shard_checkpoint(tiny.path, tmp_path / "of2", ranks=2)
    with pytest.raises(ValueError, match="rank order"):
        metrale_ple.TensorParallelEngine(list(reversed(dirs)))
    with pytest.raises(ValueError, match="one rank"):
        metrale_ple.TensorParallelEngine(dirs, reduce=lambda a: None)
    with pytest.raises(ValueError, match="not as a whole checkpoint"):
        metrale_ple.Checkpoint.open(dirs[0])
