"""Several Python threads at once on one layer and one engine: every
result equals the single-threaded one."""

import threading

import numpy as np

import metrale_ple
from conftest import highway_rows


def run_threads(n, target):
    errors = []

    def wrap(i):
        try:
            target(i)
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    ts = [threading.Thread(target=wrap, args=(i,)) for i in range(n)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    if errors:
        raise errors[0]


def test_threads_share_a_layer(tiny):
    layer = tiny.layer(1, table="cached", slots=2048, max_tokens=16)
    C = layer.channels
    rng = np.random.default_rng(3)
    work = [rng.integers(0, 4000, 40).tolist() for _ in range(6)]
    inputs = [rng.uniform(-1, 1, (40, C)).astype(np.float32) for _ in work]

    def solo(i):
        with layer.new_carry() as c:
            out = inputs[i].copy()
            for j in range(0, 40, 8):
                layer.prefill(c, work[i][j : j + 8], out[j : j + 8])
            return out, c.snapshot()

    want = [solo(i) for i in range(len(work))]
    got = [None] * len(work)

    def worker(i):
        for _ in range(3):
            got[i] = solo(i)

    run_threads(len(work), worker)
    for (a, sa), (b, sb) in zip(got, want):
        np.testing.assert_array_equal(a, b)
        assert sa == sb


def test_threads_share_an_engine(tiny):
    with metrale_ple.Engine(tiny, table="cached", slots=4096, resident_carries=3,
                            block_size=16) as e:
        W = e.width
        prompts = [[(7 * i + j) % 4000 for j in range(30 + i)] for i in range(8)]
        results = [None] * len(prompts)

        def worker(i):
            p = prompts[i]
            sid, restored = e.add_sequence(p)
            hw = highway_rows(p[restored:], W)
            e.prefill(sid, p[restored:], hw)
            for t in (11, 12, 13):
                row = highway_rows([t], W)
                e.decode([(sid, t)], row)
                hw = np.vstack([hw, row])
            results[i] = (restored, hw, e.snapshot(sid))
            e.release(sid)

        run_threads(len(prompts), worker)
        assert e.sequence_ids() == []
    with metrale_ple.Engine(tiny, table="resident", prefix_cache_mib=0) as plain:
        for i, p in enumerate(prompts):
            sid, _ = plain.add_sequence(p)
            hw = highway_rows(p, W)
            plain.prefill(sid, p, hw)
            for t in (11, 12, 13):
                row = highway_rows([t], W)
                plain.decode([(sid, t)], row)
                hw = np.vstack([hw, row])
            restored, got, snap = results[i]
            np.testing.assert_array_equal(got, hw[restored:])
            assert snap == plain.snapshot(sid)


def test_calls_release_the_gil(tiny):
    """The main thread keeps running Python while another thread is inside
    layer calls: the calls release the GIL."""
    import time

    layer = tiny.layer(0, table="resident", max_tokens=256)
    toks = [t % 4000 for t in range(4096)]
    hw = np.zeros((len(toks), layer.channels), np.float32)
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < 0.05:
        n += 1
    rate = n / (time.perf_counter() - t0)
    done = threading.Event()

    def work():
        with layer.new_carry() as c:
            for _ in range(4):
                layer.prefill(c, toks, hw)
        done.set()

    th = threading.Thread(target=work)
    t0 = time.perf_counter()
    th.start()
    n = 0
    while not done.is_set():
        n += 1
    elapsed = time.perf_counter() - t0
    th.join()
    # Holding the GIL through the calls would leave the loop only the
    # moments between them.
    assert n > 0.1 * rate * elapsed, (n, rate, elapsed)
