"""Checkpoints: init, open, geometry; missing and malformed ones raise the
documented exceptions."""

import json
import shutil

import pytest

import metrale_ple


def test_geometry_and_sites(tiny):
    g = tiny.geometry
    assert g["hidden_size"] == 64 and g["hc_mult"] == 4 and g["channels"] == 256
    assert len(tiny.sites) == len(g["ple_layer_ids"]) == 2
    for i, s in enumerate(tiny.sites):
        assert s.index == i and s.layer == g["ple_layer_ids"][i] - 1
        assert s.ngram_heads == g["ngram_heads"]
        assert s.padded_rows % g["divisible_by"] == 0
    again = metrale_ple.Checkpoint.open(tiny.path)
    assert again.geometry == g
    assert "Checkpoint(" in repr(again)


def test_missing_checkpoint_raises_file_not_found(tmp_path):
    with pytest.raises(FileNotFoundError):
        metrale_ple.Checkpoint.open(tmp_path / "nothing")
    with pytest.raises(OSError):
        metrale_ple.Engine(tmp_path / "nothing")
    with pytest.raises(OSError):
        metrale_ple.Layer(str(tmp_path / "nothing"))


def test_malformed_checkpoint_raises_value_error(tiny, tmp_path):
    bad = tmp_path / "bad"
    shutil.copytree(tiny.path, bad)
    cfg = json.loads((bad / "config.json").read_text())
    cfg["ngram_size"] = 1
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError):
        metrale_ple.Checkpoint.open(bad)
    (bad / "config.json").write_text("{not json")
    with pytest.raises(ValueError):
        metrale_ple.Checkpoint.open(bad)


def test_init_checkpoint_refusals(tiny, tmp_path):
    with pytest.raises(ValueError):
        metrale_ple.init_checkpoint(tmp_path / "x", preset="huge")
    with pytest.raises(ValueError):
        metrale_ple.init_checkpoint(tmp_path / "x", dtype="fp16")
    with pytest.raises(ValueError):
        metrale_ple.init_checkpoint(tiny.path)  # already holds a checkpoint
    ck = metrale_ple.init_checkpoint(tmp_path / "fp8", preset="tiny", dtype="fp8", table_rows=4096, seed=1)
    assert all(s.stored_rows < s.padded_rows for s in ck.sites)
    with pytest.raises(ValueError):
        metrale_ple.Engine(ck, table="paged")
    with pytest.raises(ValueError):
        metrale_ple.Engine(ck, block_size=0)
    with pytest.raises(TypeError):
        metrale_ple.Engine(ck, "cached")  # keyword-only
