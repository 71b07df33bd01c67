"""scripts/token_corpus.py: text files to the JSON-lines token corpus that
`--prompts`, `--hot-corpus` and `bench offload --corpus` read, with a BPE it
trains itself and with a given tokenizer.json, which must give the ids that
tokenizer gives. Skips, saying why, without the `tokenizers` package."""

import json
import subprocess
import sys

import pytest


@pytest.fixture(scope="module")
def tokenizers():
    return pytest.importorskip(
        "tokenizers",
        reason="the Python `tokenizers` package is not installed (pip install tokenizers)",
    )


def run(root, *args):
    return subprocess.run(
        [sys.executable, str(root / "scripts" / "token_corpus.py"), *map(str, args)],
        capture_output=True,
        text=True,
    )


def texts(tmp_path):
    d = tmp_path / "docs"
    d.mkdir()
    body = "the cache keeps the rows a token stream asks for again and again. " * 40
    (d / "a.txt").write_text(body, encoding="utf-8")
    (d / "b.html").write_text(
        "<html><head><style>p { color: red }</style></head><body>"
        "<nav>menu menu menu</nav><main><h1>Rows</h1><p>"
        + body
        + "</p><script>var x = 1;</script></main></body></html>",
        encoding="utf-8",
    )
    (d / "tiny.txt").write_text("too short", encoding="utf-8")
    (d / "skip.md").write_text(body, encoding="utf-8")
    return d


def test_a_trained_bpe_writes_documents_below_its_vocabulary(root, tokenizers, tmp_path):
    d = texts(tmp_path)
    out = tmp_path / "corpus.jsonl"
    r = run(root, "--train-vocab", 600, "--out", out, "--min-tokens", 16, "--max-tokens", 200,
            "--exclude", "skip.md", d)
    assert r.returncode == 0, r.stderr
    docs = [json.loads(l) for l in out.read_text().splitlines()]
    # a.txt and b.html, each cut at 200 tokens; tiny.txt and skip.md dropped.
    assert len(docs) >= 2
    assert all(16 <= len(doc) <= 200 for doc in docs)
    assert all(0 <= t < 600 for doc in docs for t in doc)
    assert "documents" in r.stderr


def test_a_given_tokenizer_gives_its_own_ids(root, tokenizers, tmp_path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    d = texts(tmp_path)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(
        [(d / "a.txt").read_text()],
        trainer=trainers.BpeTrainer(
            vocab_size=400, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
        ),
    )
    path = tmp_path / "tokenizer.json"
    tok.save(str(path))
    out = tmp_path / "corpus.jsonl"
    r = run(root, "--tokenizer", path, "--out", out, "--ext", ".txt", "--min-tokens", 1,
            "--max-tokens", 100000, d / "a.txt")
    assert r.returncode == 0, r.stderr
    docs = [json.loads(l) for l in out.read_text().splitlines()]
    want = tok.encode((d / "a.txt").read_text(), add_special_tokens=False).ids
    assert docs == [want]
    # The HTML page keeps its <main> text only: no menu, style or script.
    r = run(root, "--tokenizer", path, "--out", out, "--ext", ".html", "--min-tokens", 1, d)
    assert r.returncode == 0, r.stderr
    text = tok.decode(json.loads(out.read_text().splitlines()[0]))
    assert "Rows" in text and "menu" not in text and "color" not in text and "var x" not in text


def test_bad_arguments_are_refused(root, tmp_path):
    r = run(root, "--train-vocab", 600, "--out", tmp_path / "o.jsonl", tmp_path / "missing")
    assert r.returncode != 0 and "missing" in r.stderr
    r = run(root, "--train-vocab", 600, "--out", tmp_path / "o.jsonl", "--min-tokens", 0, tmp_path)
    assert r.returncode != 0 and "--min-tokens" in r.stderr
