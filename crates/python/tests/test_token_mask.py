"""Token masks (DeepSeek-V4.1's ``token_mask``, ``True``: masked) through
the bindings: a masked Engine prefill, chunked or whole, and masked decode
give the rows of the layers' own masked runs bit for bit; a masked
sequence's carry is never handed to an unmasked one by the prefix cache;
a family whose published layer has no mask, and a malformed mask, raise
ValueError and change nothing."""

import numpy as np
import pytest

import metrale_ple


@pytest.fixture(scope="module")
def v41(tmp_path_factory):
    path = tmp_path_factory.mktemp("ckpt") / "deepseek-v4.1"
    return metrale_ple.init_checkpoint(path, preset="deepseek-v4.1", table_rows=8192, seed=2)


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    path = tmp_path_factory.mktemp("ckpt") / "engram-demo"
    return metrale_ple.init_checkpoint(path, preset="engram-demo", table_rows=8192, seed=2)


def rows(n, width, seed):
    return np.random.default_rng(seed).standard_normal((n, width)).astype(np.float32)


def bits(a):
    return np.ascontiguousarray(a).view(np.uint32)


TOKENS = [5, 17, 300, 41, 9, 1000, 77, 3, 12, 650, 28, 90, 4, 31]
MASK = [False, False, True, False, False, False, True, True, False, False, False, True, False, False]


def layer_run(ck, steps, width):
    """Every site's Layer applied in order over ``steps``: a list of
    ``(tokens, mask, hidden)`` calls of one sequence, prefill for the
    first, decode of one token for each later one; the hidden rows out."""
    out = [h.copy() for (_, _, h) in steps]
    for site in range(len(ck.sites)):
        layer = metrale_ple.Layer(ck, site, table="resident", max_tokens=8)
        with layer.new_carry() as carry:
            for i, (toks, mask, _) in enumerate(steps):
                if i == 0:
                    layer.prefill(carry, toks, out[i], mask=mask)
                else:
                    layer.decode([carry], toks, out[i], mask=mask)
    return out


def test_masked_engine_prefill_is_the_layers_masked_prefill_bit_for_bit(v41):
    with metrale_ple.Engine(v41, table="resident", prefill_chunk=5, block_size=4) as e:
        w = e.width
        h_in = rows(len(TOKENS), w, 1)
        (want,) = layer_run(v41, [(TOKENS, MASK, h_in)], w)
        (plain,) = layer_run(v41, [(TOKENS, None, h_in)], w)
        # A masked token's gate is shut: its rows come back as they went in.
        for i, m in enumerate(MASK):
            if m:
                assert np.array_equal(bits(want[i]), bits(h_in[i]))
        # The look-back stops at a masked token, so later rows change.
        assert not np.array_equal(bits(want[3]), bits(plain[3]))
        assert np.array_equal(bits(want[:2]), bits(plain[:2]))

        # Whole, as a list of bools.
        sid, restored = e.add_sequence(TOKENS, mask=MASK)
        assert restored == 0
        h = h_in.copy()
        e.prefill(sid, TOKENS, h, mask=MASK)
        assert np.array_equal(bits(h), bits(want))
        e.release(sid)

        # Split around the masked tokens, as numpy bool arrays.
        mask = np.array(MASK, dtype=bool)
        sid, restored = e.add_sequence(np.array(TOKENS), mask=mask)
        assert restored == 0
        h = h_in.copy()
        for a, b in [(0, 2), (2, 7), (7, 8), (8, len(TOKENS))]:
            part = np.ascontiguousarray(h[a:b])
            e.prefill(sid, TOKENS[a:b], part, mask=mask[a:b])
            h[a:b] = part
        assert np.array_equal(bits(h), bits(want))
        e.release(sid)


def test_masked_engine_decode_is_the_layers_masked_decode(v41):
    with metrale_ple.Engine(v41, table="resident", prefill_chunk=8, block_size=4) as e:
        w = e.width
        prompt, prompt_mask = TOKENS[:6], MASK[:6]
        later = [(t, m) for t, m in zip(TOKENS[6:], MASK[6:])]
        steps = [(prompt, prompt_mask, rows(6, w, 2))]
        steps += [([t], [m], rows(1, w, 10 + i)) for i, (t, m) in enumerate(later)]
        want = layer_run(v41, steps, w)

        # Beside an unmasked sequence in every batch.
        other = list(reversed(TOKENS))
        ref_other = layer_run(
            v41,
            [(other[:6], None, rows(6, w, 3))]
            + [([t], None, rows(1, w, 30 + i)) for i, t in enumerate(other[6:])],
            w,
        )
        a, _ = e.add_sequence(prompt, mask=prompt_mask)
        b, _ = e.add_sequence(other[:6])
        h = rows(6, w, 2)
        e.prefill(a, prompt, h, mask=prompt_mask)
        assert np.array_equal(bits(h), bits(want[0]))
        h = rows(6, w, 3)
        e.prefill(b, other[:6], h)
        assert np.array_equal(bits(h), bits(ref_other[0]))
        for i, (t, m) in enumerate(later):
            h = np.concatenate([rows(1, w, 10 + i), rows(1, w, 30 + i)])
            e.decode([(a, t), (b, other[6 + i])], h, mask=np.array([m, False]))
            assert np.array_equal(bits(h[:1]), bits(want[1 + i])), i
            assert np.array_equal(bits(h[1:]), bits(ref_other[1 + i])), i


def test_the_prefix_cache_never_hands_a_masked_carry_to_an_unmasked_sequence(v41):
    with metrale_ple.Engine(v41, table="resident", prefill_chunk=8, block_size=4) as e:
        w = e.width
        h_in = rows(len(TOKENS), w, 4)
        sid, _ = e.add_sequence(TOKENS, mask=MASK)
        e.prefill(sid, TOKENS, h_in.copy(), mask=MASK)
        s = e.stats()
        assert s["masked_boundaries_skipped"] == 3
        assert s["prefix_cache"]["entries"] == 0
        e.release(sid)
        sid, restored = e.add_sequence(TOKENS)
        assert restored == 0
        h = h_in.copy()
        e.prefill(sid, TOKENS, h)
        (plain,) = layer_run(v41, [(TOKENS, None, h_in)], w)
        assert np.array_equal(bits(h), bits(plain))
        e.release(sid)
        # Unmasked boundaries are cached now; a masked prompt restores only
        # the prefix before its first masked token (position 2: nothing).
        assert e.stats()["prefix_cache"]["entries"] == 3
        _, restored = e.add_sequence(TOKENS, mask=MASK)
        assert restored == 0
        late = [i >= 9 for i in range(len(TOKENS))]
        _, restored = e.add_sequence(TOKENS, mask=late)
        assert restored == 8


def test_a_masked_snapshot_is_added_back_with_its_mask(v41):
    with metrale_ple.Engine(v41, table="resident", prefill_chunk=8, block_size=4) as e:
        w = e.width
        head = 8  # the masked tokens 6 and 7 are in the history's reach
        h_in = rows(len(TOKENS), w, 5)
        (want,) = layer_run(v41, [(TOKENS, MASK, h_in)], w)
        sid, _ = e.add_sequence(TOKENS[:head], mask=MASK[:head])
        e.prefill(sid, TOKENS[:head], h_in[:head].copy(), mask=MASK[:head])
        snap = e.snapshot(sid)
        with pytest.raises(ValueError, match="history"):
            e.add_from_snapshot(snap, TOKENS[:head])
        back = e.add_from_snapshot(snap, TOKENS[:head], mask=MASK[:head])
        h = np.ascontiguousarray(h_in[head:])
        e.prefill(back, TOKENS[head:], h, mask=MASK[head:])
        assert np.array_equal(bits(h), bits(want[head:]))


def test_a_family_without_a_mask_refuses_one_by_name(demo):
    layer = metrale_ple.Layer(demo, 0, table="resident", max_tokens=8)
    w = layer.channels
    toks = [5, 6, 7]
    with layer.new_carry() as carry:
        h = rows(3, w, 6)
        for mask in ([False, False, False], [True, False, False]):
            with pytest.raises(ValueError, match="Engram demo"):
                layer.prefill(carry, toks, h, mask=mask)
            with pytest.raises(ValueError, match="Engram demo"):
                layer.decode([carry], [5], h[:1], mask=mask[:1])
        # Nothing ran: the carry is still fresh and the rows untouched.
        assert np.array_equal(bits(h), bits(rows(3, w, 6)))
        assert carry.history == layer.new_carry().history
    with metrale_ple.Engine(demo, table="resident") as e:
        with pytest.raises(ValueError, match="Engram demo"):
            e.add_sequence(toks, mask=[False, False, False])
        assert e.sequence_ids() == []
        sid, _ = e.add_sequence(toks)
        h = rows(3, w, 7)
        with pytest.raises(ValueError, match="Engram demo"):
            e.prefill(sid, toks, h, mask=[False, True, False])
        assert e.tokens(sid) == []
        e.prefill(sid, toks, h)
        with pytest.raises(ValueError, match="Engram demo"):
            e.decode([(sid, 8)], rows(1, w, 8), mask=[True])
        assert e.tokens(sid) == toks


def test_a_malformed_mask_is_refused(v41):
    with metrale_ple.Engine(v41, table="resident") as e:
        w = e.width
        sid, _ = e.add_sequence([5, 6, 7])
        h = rows(3, w, 9)
        with pytest.raises(ValueError, match="one flag per token"):
            e.prefill(sid, [5, 6, 7], h, mask=[True, False])
        with pytest.raises(ValueError, match="bools are required"):
            e.prefill(sid, [5, 6, 7], h, mask=[1, 0, 0])
        with pytest.raises(ValueError, match="1-D"):
            e.prefill(sid, [5, 6, 7], h, mask=np.zeros((3, 1), dtype=bool))
        with pytest.raises(ValueError, match="one flag per token"):
            e.decode([(sid, 8)], h[:1], mask=[])
        assert e.tokens(sid) == []
        assert np.array_equal(bits(h), bits(rows(3, w, 9)))
