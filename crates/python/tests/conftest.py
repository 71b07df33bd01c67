"""Shared fixtures: the repository root (fixtures/, reference/), a tiny
synthetic checkpoint written once per session, and the layer fixture of
fixtures/layer/ loaded as arrays."""

import json
import os
import sys
from pathlib import Path

import numpy as np
import pytest

import metrale_ple

ROOT = Path(os.environ.get("METRALE_PLE_ROOT", Path(__file__).resolve().parents[3]))


@pytest.fixture(scope="session")
def root() -> Path:
    if not (ROOT / "fixtures").is_dir():
        pytest.fail(f"repository fixtures not found under {ROOT} (set METRALE_PLE_ROOT)")
    return ROOT


@pytest.fixture(scope="session")
def reference(root):
    """The numpy reference modules of reference/."""
    sys.path.insert(0, str(root / "reference"))
    import ple_layer
    import ple_reference

    return ple_layer, ple_reference


@pytest.fixture(scope="session")
def tiny(tmp_path_factory) -> metrale_ple.Checkpoint:
    path = tmp_path_factory.mktemp("ckpt") / "tiny"
    return metrale_ple.init_checkpoint(path, preset="tiny", seed=3)


class LayerFixture:
    """fixtures/layer/small.*: geometry, weights, table, tokens, chunks and
    the reference's highway in and out."""

    def __init__(self, root: Path):
        d = root / "fixtures" / "layer"
        self.meta = json.loads((d / "small.json").read_text())
        m = self.meta
        files = m["files"]
        self.u16 = {k: np.fromfile(d / files[k], dtype="<u2") for k in ("table", "key_proj", "value_proj")}
        self.f32 = {
            k: np.fromfile(d / files[k], dtype="<f4")
            for k in ("norm_key", "norm_query", "norm_conv", "conv1d", "highway_in", "highway_out")
        }
        self.C = m["hidden"] * m["hc_mult"]
        self.tokens = [int(t) for t in m["tokens"]]
        self.chunks = [int(c) for c in m["chunks"]]

    def dims(self) -> dict:
        m = self.meta
        return {
            "ngram_size": m["ngram_size"],
            "heads_per_ngram": m["heads_per_ngram"],
            "multipliers": [int(x) for x in m["multipliers"]],
            "head_vocab_sizes": [int(x) for x in m["head_vocab_sizes"]],
            "head_offsets": [int(x) for x in m["head_offsets"]],
        }

    def layer(self, max_tokens=4) -> metrale_ple.Layer:
        m = self.meta
        d = self.dims()
        return metrale_ple.Layer.from_weights(
            hidden=m["hidden"],
            hc_mult=m["hc_mult"],
            head_dim=m["head_dim"],
            ngram_size=d["ngram_size"],
            heads_per_ngram=d["heads_per_ngram"],
            multipliers=d["multipliers"],
            head_vocab_sizes=d["head_vocab_sizes"],
            head_offsets=d["head_offsets"],
            eos=m["eos"],
            conv_kernel=m["conv_kernel"],
            dilation=m["dilation"],
            eps=m["eps"],
            key_proj=self.u16["key_proj"],
            value_proj=self.u16["value_proj"],
            norm_key=self.f32["norm_key"],
            norm_query=self.f32["norm_query"],
            norm_conv=self.f32["norm_conv"],
            conv1d=self.f32["conv1d"],
            table=self.u16["table"].reshape(-1, m["head_dim"]),
            max_tokens=max_tokens,
            vocab_size=m["vocab_size"],
        )

    def highway_in(self) -> np.ndarray:
        return self.f32["highway_in"].reshape(-1, self.C).copy()

    def highway_out(self) -> np.ndarray:
        return self.f32["highway_out"].reshape(-1, self.C)


@pytest.fixture(scope="session")
def layer_fixture(root) -> LayerFixture:
    return LayerFixture(root)


def highway_rows(tokens, width, seed=0) -> np.ndarray:
    """Input rows that depend on the token alone (as the prefix cache
    requires)."""
    out = np.empty((len(tokens), width), dtype=np.float32)
    for i, t in enumerate(tokens):
        out[i] = np.random.default_rng([seed, int(t)]).uniform(-1, 1, width)
    return out
