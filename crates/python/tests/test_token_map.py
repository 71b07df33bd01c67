"""Engram's compressed-token map: `metrale_ple.token_map` against the
committed fixtures of fixtures/token_map/, and the Rust CLI (`metrale-ple
token-map`) against the Python reference (reference/token_map_reference.py)
on tokenizers trained here with the installed `tokenizers` package, so the
check follows whatever version of the library is installed rather than the
committed fixtures alone.

The second part skips, saying why, when `tokenizers` is not installed or
the CLI binary cannot be found or built."""

import json
import os
import shutil
import subprocess
import sys

import pytest

import metrale_ple

NAMES = ["byte_level_bpe", "llama_style_bpe", "unigram_metaspace"]


@pytest.fixture(scope="module")
def tokenizers():
    return pytest.importorskip(
        "tokenizers",
        reason="the Python `tokenizers` package is not installed (pip install tokenizers)",
    )


@pytest.mark.parametrize("name", NAMES)
def test_binding_matches_the_committed_fixtures(root, name):
    d = root / "fixtures" / "token_map"
    doc = json.loads((d / f"{name}.expected.json").read_text(encoding="utf-8"))
    got = metrale_ple.token_map(d / doc["tokenizer"])
    assert got == doc["map"]
    assert max(got) + 1 == doc["compressed_vocab_size"]


def test_binding_errors(tmp_path):
    with pytest.raises(FileNotFoundError):
        metrale_ple.token_map(tmp_path / "missing.json")
    bad = tmp_path / "bad.json"
    bad.write_text('{"model": {"type": "WordLevel", "vocab": {"a": 0}, "unk_token": "a"}, '
                   '"decoder": {"type": "Nope"}}')
    with pytest.raises(ValueError, match="bad.json"):
        metrale_ple.token_map(bad)


@pytest.fixture(scope="module")
def cli(root):
    """The metrale-ple binary: $METRALE_PLE_BIN, a built one under target/,
    or one cargo builds now."""
    env = os.environ.get("METRALE_PLE_BIN")
    if env:
        return env
    for profile in ("debug", "release"):
        p = root / "target" / profile / "metrale-ple"
        if p.is_file():
            return str(p)
    cargo = shutil.which("cargo")
    if cargo is None:
        pytest.skip("no metrale-ple binary under target/ and no cargo to build one")
    subprocess.run([cargo, "build", "-q", "-p", "metrale-ple"], cwd=root, check=True)
    return str(root / "target" / "debug" / "metrale-ple")


@pytest.fixture(scope="module")
def ref(root):
    sys.path.insert(0, str(root / "reference"))
    import token_map_reference

    return token_map_reference


@pytest.mark.parametrize("name", NAMES)
def test_cli_map_equals_the_reference(tokenizers, cli, ref, tmp_path, name):
    tok = ref.TOKENIZERS[name]()
    path = tmp_path / "tokenizer.json"
    tok.save(str(path))
    loaded = tokenizers.Tokenizer.from_file(str(path))
    want, keys = ref.build(loaded)
    out = tmp_path / "map.json"
    run = subprocess.run([cli, "token-map", str(path), "-o", str(out)],
                         capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    summary = json.loads(run.stdout)
    assert summary["compressed_vocab_size"] == len(keys)
    got = json.loads(out.read_text())
    assert len(got) == len(want)
    diff = [t for t, (g, w) in enumerate(zip(got, want)) if g != w]
    assert not diff, (
        f"{len(diff)} ids differ, first raw id {diff[0]}: "
        f"decoded {loaded.decode([diff[0]], skip_special_tokens=False)!r}"
    )


def test_committed_fixtures_still_hold(tokenizers, ref, root):
    """The committed tokenizers give the committed maps with this version
    of `tokenizers` too."""
    d = root / "fixtures" / "token_map"
    for name in ref.TOKENIZERS:
        doc = json.loads((d / f"{name}.expected.json").read_text(encoding="utf-8"))
        tok = tokenizers.Tokenizer.from_file(str(d / doc["tokenizer"]))
        got, keys = ref.build(tok)
        assert got == doc["map"], name
        assert keys == doc["keys"], name
