"""metrale_ple.Layer and Carry: the forward against the numpy reference
(reference/ple_layer.py and fixtures/layer/), batched decode against
sequential prefill, and the carry's snapshot/restore/reset/release."""

import struct

import numpy as np
import pytest

import metrale_ple

# As crates/model-layers/tests/layer_fixtures.rs: the reference computes in
# float64 from the same BF16 inputs, so only float32 rounding differs.
TOL = 1e-5


def test_forward_matches_the_fixture_across_chunks(layer_fixture):
    fx = layer_fixture
    layer = fx.layer(max_tokens=4)
    hw = fx.highway_in()
    with layer.new_carry() as carry:
        t0 = 0
        for n in fx.chunks:
            rows = hw[t0 : t0 + n]
            assert rows.flags.c_contiguous
            layer.prefill(carry, fx.tokens[t0 : t0 + n], rows)
            t0 += n
        assert carry.history == fx.meta["history_out"]
    np.testing.assert_allclose(hw, fx.highway_out(), atol=TOL, rtol=0)


def test_forward_matches_the_python_reference(layer_fixture, reference):
    ple_layer, ple_reference = reference
    fx = layer_fixture
    m = fx.meta
    g = dict(fx.dims(), eos_token_id=m["eos"], hidden=m["hidden"], hc_mult=m["hc_mult"],
             conv_kernel=m["conv_kernel"], dilation=m["dilation"], eps=m["eps"])
    w = {
        "key_proj": fx.u16["key_proj"].reshape(fx.C, -1),
        "value_proj": fx.u16["value_proj"].reshape(m["hidden"], -1),
        "norm_key": fx.f32["norm_key"],
        "norm_query": fx.f32["norm_query"],
        "norm_conv": fx.f32["norm_conv"],
        "conv1d": fx.f32["conv1d"],
    }
    ref = ple_layer.PleLayerRef(g, w, fx.u16["table"].reshape(-1, m["head_dim"]))
    st = ref.new_state()
    layer = fx.layer(max_tokens=64)
    carry = layer.new_carry()
    rng = np.random.default_rng(7)
    # Other chunkings than the fixture's, a [T, hc, H] view, and a decode step.
    tokens = fx.tokens
    hw_in = rng.uniform(-1, 1, (len(tokens), fx.C)).astype(np.float32)
    want = []
    got = []
    t0 = 0
    for n in (3, 7, 1, 11, len(tokens) - 22):
        x = hw_in[t0 : t0 + n]
        want.append(ref.forward(st, x, tokens[t0 : t0 + n]))
        y = x.copy().reshape(n, m["hc_mult"], m["hidden"])
        layer.prefill(carry, np.asarray(tokens[t0 : t0 + n], dtype=np.int64), y)
        got.append(y.reshape(n, fx.C))
        t0 += n
    x = rng.uniform(-1, 1, (1, fx.C)).astype(np.float32)
    want.append(ref.forward(st, x, [5]))
    y = x.copy()
    layer.decode([carry], [5], y)
    got.append(y)
    np.testing.assert_allclose(np.vstack(got), np.vstack(want), atol=TOL, rtol=0)
    assert carry.history == st["history"]
    # The conv state in the snapshot is the reference's.
    blob = carry.snapshot()
    ctx = m["ngram_size"] - 1
    (n,) = struct.unpack_from("<I", blob)
    assert n == ctx
    conv = np.frombuffer(blob, dtype="<f4", offset=4 + 4 * ctx).reshape(st["conv"].shape)
    np.testing.assert_allclose(conv, st["conv"], atol=TOL, rtol=0)
    carry.release()


def test_decode_batch_equals_sequential_prefill(tiny):
    layer = metrale_ple.Layer(tiny, 1, table="resident", max_tokens=8)
    C = layer.channels
    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, 4000, n).tolist() for n in (5, 9, 3, 12, 1, 7, 4, 6, 10, 2)]
    steps = [rng.integers(0, 4000, len(prompts)).tolist() for _ in range(3)]
    batch = [layer.new_carry() for _ in prompts]
    solo = [layer.new_carry() for _ in prompts]
    for c, d, p in zip(batch, solo, prompts):
        x = rng.uniform(-1, 1, (len(p), C)).astype(np.float32)
        layer.prefill(c, p, x.copy())
        layer.prefill(d, p, x.copy())
    for toks in steps:
        x = rng.uniform(-1, 1, (len(prompts), C)).astype(np.float32)
        a = x.copy()
        layer.decode(batch, toks, a)  # 10 carries over max_tokens 8: split in two
        b = x.copy()
        for i, (c, t) in enumerate(zip(solo, toks)):
            layer.prefill(c, [t], b[i : i + 1])
        np.testing.assert_array_equal(a, b)
    for c in batch + solo:
        c.release()


def test_carry_snapshot_restore_reset_release(tiny):
    layer = tiny.layer(0, table="mapped")
    C = layer.channels
    rng = np.random.default_rng(2)
    toks = rng.integers(0, 4000, 20).tolist()
    x = rng.uniform(-1, 1, (20, C)).astype(np.float32)

    fresh = layer.new_carry()
    assert fresh.history == []
    # A new carry's blob holds no history (the first forward resets it).
    assert len(fresh.snapshot()) == layer.aux_blob_bytes - 4 * layer.context_len

    a = layer.new_carry()
    layer.prefill(a, toks[:12], x[:12].copy())
    blob = a.snapshot()
    assert isinstance(blob, bytes) and len(blob) == layer.aux_blob_bytes
    rest_a = x[12:].copy()
    layer.prefill(a, toks[12:], rest_a)

    b = layer.new_carry()
    b.restore(blob)
    assert b.history == toks[10:12]
    rest_b = x[12:].copy()
    layer.prefill(b, toks[12:], rest_b)
    np.testing.assert_array_equal(rest_a, rest_b)
    assert a.snapshot() == b.snapshot()

    # reset == a fresh sequence.
    b.reset()
    assert b.history == [layer.eos] * layer.context_len
    y1 = x[:5].copy()
    layer.prefill(b, toks[:5], y1)
    c = layer.new_carry()
    y2 = x[:5].copy()
    layer.prefill(c, toks[:5], y2)
    np.testing.assert_array_equal(y1, y2)

    # Malformed blobs are refused and change nothing.
    before = b.snapshot()
    for bad in (b"", b"\x01\x00", blob[:-1], blob + b"\x00", struct.pack("<I", 7) + blob[4:]):
        with pytest.raises(ValueError):
            b.restore(bad)
    assert b.snapshot() == before
    b.restore(bytearray(blob))  # bytearray works too
    assert b.snapshot() == blob

    # release: idempotent; later use refused.
    b.release()
    b.release()
    assert b.released
    for call in (b.snapshot, b.reset, lambda: b.restore(blob),
                 lambda: layer.prefill(b, [1], np.zeros((1, C), np.float32)),
                 lambda: layer.decode([b], [1], np.zeros((1, C), np.float32))):
        with pytest.raises(ValueError):
            call()
    with layer.new_carry() as d:
        d.restore(blob)
    assert d.released
    for carry in (a, c, fresh):
        carry.release()


def test_bad_inputs_raise_value_error(tiny):
    layer = metrale_ple.Layer(tiny.path, 0, table="cached", slots=1024)
    other = tiny.layer(0, table="resident")
    C = layer.channels
    carry = layer.new_carry()
    ok = np.zeros((2, C), np.float32)
    bad = [
        lambda: layer.prefill(carry, [1, 2], np.zeros((2, C), np.float64)),  # dtype
        lambda: layer.prefill(carry, [1, 2], np.zeros((3, C), np.float32)),  # rows
        lambda: layer.prefill(carry, [1, 2], np.zeros((2, C - 1), np.float32)),  # width
        lambda: layer.prefill(carry, [1, 2], np.zeros((2, 2 * C), np.float32)[:, ::2]),  # strided
        lambda: layer.prefill(carry, [1, 2], np.asfortranarray(np.zeros((2, C), np.float32))),  # F order
        lambda: layer.prefill(carry, [1, 2], [[0.0] * C] * 2),  # a list
        lambda: layer.prefill(carry, [1, 5000], ok),  # token >= vocab
        lambda: layer.prefill(carry, [1, -2], ok),
        lambda: layer.prefill(other.new_carry(), [1, 2], ok),  # foreign carry
        lambda: layer.prefill("carry", [1, 2], ok),
        lambda: layer.decode([carry, carry], [1, 2], ok),  # twice in a batch
        lambda: layer.decode([carry], [1, 2], ok),  # tokens != carries
        lambda: layer.decode(5, [1], ok[:1]),
    ]
    ro = np.zeros((2, C), np.float32)
    ro.flags.writeable = False
    bad.append(lambda: layer.prefill(carry, [1, 2], ro))
    for i, call in enumerate(bad):
        with pytest.raises(ValueError):
            call()
            print(f"case {i} did not raise")
    # Nothing above changed the carry.
    assert carry.history == []
    with pytest.raises(ValueError):
        metrale_ple.Layer(tiny, 2)  # no such site
    with pytest.raises(ValueError):
        metrale_ple.Layer(tiny, 0, table="paged")
    with pytest.raises(ValueError):
        metrale_ple.Layer(tiny, 0, max_tokens=0)
    carry.release()


def test_from_weights_refuses_bad_shapes(layer_fixture):
    fx = layer_fixture
    good = fx.layer()
    assert good.channels == fx.C
    m = fx.meta
    base = dict(
        hidden=m["hidden"], hc_mult=m["hc_mult"], head_dim=m["head_dim"], eos=m["eos"],
        conv_kernel=m["conv_kernel"], dilation=m["dilation"], eps=m["eps"],
        key_proj=fx.u16["key_proj"], value_proj=fx.u16["value_proj"],
        norm_key=fx.f32["norm_key"], norm_query=fx.f32["norm_query"],
        norm_conv=fx.f32["norm_conv"], conv1d=fx.f32["conv1d"],
        table=fx.u16["table"].reshape(-1, m["head_dim"]), **fx.dims(),
    )
    for change in (
        {"key_proj": fx.u16["key_proj"][:-1]},
        {"norm_key": fx.f32["norm_key"].astype(np.float64)},
        {"table": fx.u16["table"][:10]},
        {"head_offsets": [0, 1, 2, 3]},
        {"multipliers": [2, 4, 6]},
        {"hidden": 0},
        {"max_tokens": 0},
    ):
        with pytest.raises(ValueError):
            metrale_ple.Layer.from_weights(**dict(base, **change))


def test_empty_calls_do_nothing(tiny):
    layer = tiny.layer(0, table="resident")
    carry = layer.new_carry()
    layer.prefill(carry, [], np.zeros((0, layer.channels), np.float32))
    layer.decode([], [], np.zeros((0, layer.channels), np.float32))
    assert carry.history == []
    carry.release()
