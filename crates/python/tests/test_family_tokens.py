"""Out-of-vocabulary tokens on the family presets: every entry point that
takes tokens (Site.ids, Layer.prefill and decode, Engine.add_sequence,
prefill, decode and verify) raises ValueError naming the token, and the
sequence runs on afterwards."""

import numpy as np
import pytest

import metrale_ple


@pytest.fixture(scope="module", params=["engram-demo", "longcat-flash-lite"])
def family_ckpt(request, tmp_path_factory):
    path = tmp_path_factory.mktemp("ckpt") / request.param
    return metrale_ple.init_checkpoint(path, preset=request.param, table_rows=8192, seed=2)


def test_every_entry_point_refuses_a_token_past_the_vocabulary(family_ckpt):
    g = family_ckpt.geometry
    bad = g["vocab_size"]
    width = g["channels"]
    with pytest.raises(ValueError, match=str(bad)):
        family_ckpt.sites[0].ids([1, bad])

    layer = metrale_ple.Layer(family_ckpt, 0, table="resident", max_tokens=8)
    carry = layer.new_carry()
    hidden = np.zeros((2, layer.channels), dtype=np.float32)
    with pytest.raises(ValueError, match=str(bad)):
        layer.prefill(carry, [5, bad], hidden)
    layer.prefill(carry, [5, 6], hidden)
    with pytest.raises(ValueError, match=str(bad)):
        layer.decode([carry], [bad], hidden[:1])
    carry.release()

    with metrale_ple.Engine(family_ckpt, table="resident") as e:
        with pytest.raises(ValueError, match=str(bad)):
            e.add_sequence([3, bad])
        sid, _ = e.add_sequence([3, 4, 5])
        h = np.zeros((3, width), dtype=np.float32)
        e.prefill(sid, [3, 4, 5], h)
        for call in (
            lambda: e.prefill(sid, [6, bad], np.zeros((2, width), dtype=np.float32)),
            lambda: e.decode([(sid, bad)], np.zeros((1, width), dtype=np.float32)),
            lambda: e.verify(sid, [bad], np.zeros((1, width), dtype=np.float32)),
        ):
            with pytest.raises(ValueError, match=str(bad)):
                call()
        e.decode([(sid, 6)], np.zeros((1, width), dtype=np.float32))
        assert e.tokens(sid) == [3, 4, 5, 6]
        e.release(sid)
