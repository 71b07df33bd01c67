"""metrale_ple.torch.PleEmbedding (skipped without torch)."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import metrale_ple  # noqa: E402
from metrale_ple.torch import PleEmbedding  # noqa: E402


def test_module_matches_the_layer(tiny):
    ple = PleEmbedding(tiny, site=0, table="resident")
    layer = metrale_ple.Layer(tiny, 0, table="resident")
    C = ple.channels
    g = tiny.geometry
    x = torch.randn(5, g["hc_mult"], g["hidden_size"])
    toks = torch.tensor([1, 2, 3, 4, 5])
    with ple.new_carry() as c:
        y = ple(x, toks, c)
        assert y.shape == x.shape and y.dtype == torch.float32
        ref = x.reshape(5, C).numpy().copy()
        with layer.new_carry() as rc:
            layer.prefill(rc, [1, 2, 3, 4, 5], ref)
            np.testing.assert_array_equal(y.reshape(5, C).numpy(), ref)
            step = torch.randn(1, C)
            z = ple.decode(step, [6], [c])
            r = step.numpy().copy()
            layer.decode([rc], [6], r)
            np.testing.assert_array_equal(z.numpy(), r)


def test_tensor_in_place_through_the_layer(tiny):
    layer = metrale_ple.Layer(tiny, 0, table="resident")
    t = torch.zeros(3, layer.channels)
    with layer.new_carry() as c:
        layer.prefill(c, [1, 2, 3], t)  # a CPU tensor is updated in place
    assert t.abs().sum() > 0
    b = torch.zeros(1, 3, layer.channels)  # a leading batch axis of 1
    with layer.new_carry() as c:
        layer.prefill(c, [1, 2, 3], b)
    assert torch.equal(b[0], t)
    with pytest.raises(ValueError):
        with layer.new_carry() as c:
            layer.prefill(c, [1], torch.zeros(1, layer.channels, requires_grad=True))
    with pytest.raises(ValueError):
        with layer.new_carry() as c:
            layer.prefill(c, [1], torch.zeros(1, layer.channels, dtype=torch.float64))


def test_in_a_module(tiny):
    class Tiny(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.ple = PleEmbedding(tiny, site=1, table="resident")
            self.lin = torch.nn.Linear(self.ple.channels, self.ple.channels)

        def forward(self, x, toks, carry):
            return self.lin(self.ple(x, toks, carry))

    m = Tiny()
    with torch.no_grad(), m.ple.new_carry() as c:
        out = m(torch.randn(4, m.ple.channels), [9, 8, 7, 6], c)
    assert out.shape == (4, m.ple.channels)
