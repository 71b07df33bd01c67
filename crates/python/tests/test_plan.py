"""A step as a value from Python: Layer.plan hashes a step once and
Layer.stage hands back its rows, which is all an engine with kernels of its
own needs of the layer. The ids are the numpy reference's, bit for bit; the
staged rows are the table's; rows[slots] give every id's row; a plan of
one layer is refused by another."""

import numpy as np
import pytest

import metrale_ple


def _dims(fx):
    return dict(fx.dims(), eos_token_id=fx.meta["eos"])


def test_plan_ids_are_the_reference_hash(layer_fixture, reference):
    _, ple_reference = reference
    fx = layer_fixture
    layer = fx.layer(max_tokens=4)
    dims = _dims(fx)
    ctx = layer.context_len
    tokens = fx.tokens
    work = [
        ([], tokens[:5]),
        (tokens[:5], tokens[5:6]),
        (tokens[:9], tokens[9:20]),
        (tokens[2:3], tokens[20:21]),
    ]
    plan = layer.plan(work)
    assert len(plan) == len(work)
    want = []
    for i, (history, toks) in enumerate(work):
        padded = ple_reference.fresh_history(dims) + list(history)
        ids, _ = ple_reference.hash_chunk(padded[len(padded) - ctx :], toks, dims)
        np.testing.assert_array_equal(plan.seq_ids(i), ids)
        want.append(ids)
    np.testing.assert_array_equal(plan.ids, np.concatenate(want))
    assert len(np.unique(plan.distinct)) == len(plan.distinct)
    np.testing.assert_array_equal(plan.distinct[plan.slots], plan.ids)


def test_staged_rows_are_the_table_rows(layer_fixture):
    fx = layer_fixture
    # Several parts of the staging area (max_tokens * ngram_heads refs).
    layer = fx.layer(max_tokens=2)
    tokens = fx.tokens
    plan = layer.plan([([], tokens[:12]), (tokens[:3], tokens[12:14])])
    layer.prefetch(plan)
    rows = layer.stage(plan)
    hd = fx.meta["head_dim"]
    assert rows.dtype == np.float32
    assert rows.shape == (len(plan.distinct), hd)
    assert len(plan.distinct) > 2 * layer.ngram_heads
    table = fx.u16["table"].reshape(-1, hd)
    want = (table[plan.distinct.astype(np.int64)].astype(np.uint32) << 16).view(np.float32)
    np.testing.assert_array_equal(rows.view(np.uint32), want.view(np.uint32))
    # What an engine gathers for every id of the step.
    per_id = rows[plan.slots]
    assert per_id.shape == (*plan.ids.shape, hd)
    np.testing.assert_array_equal(
        per_id.view(np.uint32), table[plan.ids.astype(np.int64)].astype(np.uint32) << 16
    )


def test_a_plan_belongs_to_its_layer(layer_fixture):
    fx = layer_fixture
    a = fx.layer(max_tokens=4)
    b = fx.layer(max_tokens=4)
    plan = a.plan([([], fx.tokens[:3])])
    with pytest.raises(ValueError, match="another layer"):
        b.stage(plan)
    with pytest.raises(ValueError):
        a.plan([([], [fx.meta["vocab_size"]])])
    with pytest.raises(ValueError):
        a.plan([(1, 2)])
    assert len(a.stage(a.plan([]))) == 0
