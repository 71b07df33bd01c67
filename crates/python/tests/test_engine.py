"""metrale_ple.Engine and the serving loop: a lifecycle with prefix hits,
preemption and a speculative commit, every output checked against a plain
sequential run; snapshots; refused calls."""

import numpy as np
import pytest

import metrale_ple
from conftest import highway_rows


def plain_outputs(ck, tokens, width):
    """The output rows of `tokens` run in one prefill with no cache."""
    with metrale_ple.Engine(ck, table="resident", prefix_cache_mib=0, resident_carries=0) as e:
        sid, restored = e.add_sequence(tokens)
        assert restored == 0
        hw = highway_rows(tokens, width)
        e.prefill(sid, tokens, hw)
        return hw


def test_lifecycle_prefix_hits_preemption_and_speculation(tiny):
    rng = np.random.default_rng(5)
    system = rng.integers(0, 4000, 150).tolist()
    users = [rng.integers(0, 4000, int(n)).tolist() for n in rng.integers(5, 40, 6)]
    gen = [rng.integers(0, 4000, 6).tolist() for _ in users]
    with metrale_ple.Engine(tiny, table="cached", block_size=32, prefix_cache_mib=16,
                            resident_carries=2, slots=4096) as e:
        W = e.width
        assert W == tiny.geometry["channels"]
        seqs = []
        outs = []
        for u in users:
            prompt = system + u
            sid, restored = e.add_sequence(prompt)
            rest = prompt[restored:]
            hw = highway_rows(rest, W)
            e.prefill(sid, rest, hw)
            seqs.append((sid, prompt, restored))
            outs.append(hw)
        # Every sequence after the first restored the shared system prompt.
        assert seqs[0][2] == 0
        assert all(r >= 128 for _, _, r in seqs[1:])
        st = e.stats()
        assert st["prefix_hits"] == len(users) - 1
        assert st["prefix_tokens_restored"] == sum(r for _, _, r in seqs)
        # Six sequences, two resident carries: the others were preempted.
        assert st["preemptions"] > 0 and st["resident"] <= 2
        # Batched decode over all of them (swapping in as needed).
        for step in range(len(gen[0])):
            batch = [(sid, gen[i][step]) for i, (sid, _, _) in enumerate(seqs)]
            hw = np.vstack([highway_rows([t], W) for _, t in batch])
            e.decode(batch, hw)
            for i in range(len(seqs)):
                outs[i] = np.vstack([outs[i], hw[i : i + 1]])
        # Speculation on sequence 0: verify a draft of 5, keep 2.
        sid0, prompt0, _ = seqs[0]
        draft = rng.integers(0, 4000, 5).tolist()
        hw = highway_rows(draft, W)
        e.verify(sid0, draft, hw)
        with pytest.raises(ValueError):
            e.decode([(sid0, 1)], np.zeros((1, W), np.float32))  # pending verify
        e.commit(sid0, 2)
        assert e.tokens(sid0) == prompt0 + gen[0] + draft[:2]
        outs[0] = np.vstack([outs[0], hw[:2]])
        nxt = highway_rows([9], W)
        e.decode([(sid0, 9)], nxt)
        outs[0] = np.vstack([outs[0], nxt])
        st = e.stats()
        assert st["verifies"] == 1 and st["accepted_tokens"] == 2 and st["rejected_tokens"] == 3
        assert st["swap_ins"] > 0 and st["table"]["misses"] > 0
        # Explicit swaps.
        e.swap_out(sid0, "host")
        assert not e.is_resident(sid0)
        e.swap_in(sid0)
        assert e.is_resident(sid0)
        # Every computed row equals a plain sequential run's.
        for i, (sid, prompt, restored) in enumerate(seqs):
            toks = e.tokens(sid)
            want = plain_outputs(tiny, toks, W)
            np.testing.assert_array_equal(outs[i], want[restored:], err_msg=f"sequence {i}")
        for sid, _, _ in seqs:
            e.release(sid)
        assert e.sequence_ids() == []
        with pytest.raises(ValueError):
            e.release(seqs[0][0])
    assert e.closed
    with pytest.raises(ValueError):
        e.stats()


def test_snapshots_round_trip_and_refuse_garbage(tiny):
    with metrale_ple.Engine(tiny, table="mapped", prefix_cache_mib=0) as e:
        W = e.width
        toks = list(range(100, 140))
        sid, _ = e.add_sequence(toks)
        e.prefill(sid, toks, highway_rows(toks, W))
        snap = e.snapshot(sid)
        assert snap[:8] == b"MPLESNAP"
        twin = e.add_from_snapshot(snap, toks)
        a = highway_rows([7, 8], W)
        b = a.copy()
        e.prefill(sid, [7, 8], a)
        e.prefill(twin, [7, 8], b)
        np.testing.assert_array_equal(a, b)
        before = e.sequence_ids()
        flipped = bytearray(snap)
        flipped[60] ^= 1
        for bad, t in ((b"", toks), (b"MPLESNAP" + b"\x00" * 40, toks), (bytes(flipped), toks),
                       (snap[:-1], toks), (snap, toks[:-1])):
            with pytest.raises(ValueError):
                e.add_from_snapshot(bad, t)
        assert e.sequence_ids() == before
        new, _ = e.add_sequence([1, 2])
        with pytest.raises(ValueError):
            e.snapshot(new)  # has run no token
        with pytest.raises(ValueError):
            e.decode([(new, 3)], np.zeros((1, W), np.float32))  # not started
        with pytest.raises(ValueError):
            e.decode([(sid, 3)], np.zeros((1, W), np.float64))
        with pytest.raises(ValueError):
            e.decode([(sid, 3), (sid, 4)], np.zeros((2, W), np.float32))
        with pytest.raises(ValueError):
            e.decode([(sid, 5000)], np.zeros((1, W), np.float32))
        with pytest.raises(ValueError):
            e.prefill(12345, [1], np.zeros((1, W), np.float32))
        with pytest.raises(ValueError):
            e.swap_out(sid, "disk")
        with pytest.raises(ValueError):
            e.swap_out(sid, "file")  # no swap_dir
        with pytest.raises(ValueError):
            e.commit(sid, 1)  # no pending verify


def test_swap_to_files(tiny, tmp_path):
    with metrale_ple.Engine(tiny, table="resident", swap_dir=tmp_path, preempt_to="file",
                            resident_carries=1) as e:
        W = e.width
        ids = []
        for p in ([1, 2, 3], [4, 5, 6]):
            sid, _ = e.add_sequence(p)
            e.prefill(sid, p, highway_rows(p, W))
            ids.append(sid)
        assert e.stats()["swapped_file"] == 1
        e.decode([(ids[0], 7), (ids[1], 8)], np.zeros((2, W), np.float32))


def test_serve_reports_prefix_hits_and_matches_a_plain_run(tiny):
    rng = np.random.default_rng(9)
    system = rng.integers(0, 4000, 100).tolist()
    reqs = [{"prompt": system + rng.integers(0, 4000, 10).tolist(),
             "generate": rng.integers(0, 4000, 8).tolist()} for _ in range(6)]
    reqs.append((system[:50], [1, 2, 3]))
    rep = metrale_ple.serve(tiny, reqs, block_size=32, in_flight=3, decode_batch=4,
                            resident_carries=2)
    assert rep["stats"]["prefix_hits"] > 0
    assert len(rep["rows"]) == len(reqs)
    plain = metrale_ple.serve(tiny, reqs, table="resident", prefix_cache_mib=0, resident_carries=0)
    for got, want in zip(rep["rows"], plain["rows"]):
        assert all(g is None or g == w for g, w in zip(got, want))
    assert all(w is not None for r in plain["rows"] for w in r)
    # A Python rows callable, and segments given explicitly.
    W = tiny.geometry["channels"]
    with metrale_ple.Server(tiny, table="resident") as s:
        r = s.run([{"tokens": [1, 2, 3, 4], "segments": [("prefill", 2), ("decode", 4)]}],
                  rows=lambda t: np.full(W, t / 10, np.float32))
        assert len(r["rows"][0]) == 4
        with pytest.raises(ValueError):
            s.run([{"tokens": [1, 2], "segments": [("decode", 2)]}])
        with pytest.raises(ValueError):
            s.run([([], [1])])
        with pytest.raises(ValueError):
            s.run([([1, 2], [])], rows=lambda t: [0.0])  # wrong width
        with pytest.raises(ZeroDivisionError):
            s.run([([1, 2], [])], rows=lambda t: 1 / 0)
        assert s.stats()["prefill_tokens"] > 0

        def reenter(t):
            s.stats()
            return [0.0] * W

        with pytest.raises(ValueError):
            s.run([([1, 2], [])], rows=reenter)  # refused, not a hang
