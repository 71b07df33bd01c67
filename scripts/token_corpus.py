#!/usr/bin/env python3
"""Turn text files into a token corpus for `metrale-ple bench offload
--corpus`, `run --prompts` and `table pack --hot-corpus`: JSON lines, one
array of token ids per document.

Usage:
  token_corpus.py --tokenizer tokenizer.json --out corpus.jsonl PATH...
  token_corpus.py --train-vocab 32000 --out corpus.jsonl PATH...

Each PATH is a file or a directory searched for files ending in one of
--ext (less those whose path contains an --exclude). HTML keeps the text of its <main> element (the whole body where
there is none), without tags, scripts or styles. Files are read in sorted
order; each becomes one document, cut into documents of at most
--max-tokens tokens; documents under --min-tokens are dropped.

--tokenizer encodes with the model's own tokenizer (Hugging Face
tokenizer.json, through the `tokenizers` package), which is what a served
model sees. Without one, --train-vocab trains a byte-level BPE of that many
tokens on the files themselves; its ids are then below that size, so they
fit any model with a larger vocabulary. Statistics go to stderr.
"""

import argparse
import html.parser
import json
import os
import sys


class _Text(html.parser.HTMLParser):
    """The text of an HTML page: <main> where it has one, else <body>."""

    SKIP = {"script", "style", "nav", "header", "footer", "noscript"}

    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.main, self.body = [], []
        self.in_main = 0
        self.skip = 0

    def handle_starttag(self, tag, attrs):
        if tag in self.SKIP:
            self.skip += 1
        elif tag == "main":
            self.in_main += 1

    def handle_endtag(self, tag):
        if tag in self.SKIP:
            self.skip = max(0, self.skip - 1)
        elif tag == "main":
            self.in_main = max(0, self.in_main - 1)

    def handle_data(self, data):
        if self.skip:
            return
        self.body.append(data)
        if self.in_main:
            self.main.append(data)

    def text(self):
        parts = self.main if self.main else self.body
        lines = (l.strip() for l in "".join(parts).splitlines())
        return "\n".join(l for l in lines if l)


def read_text(path):
    with open(path, encoding="utf-8", errors="replace") as f:
        raw = f.read()
    if path.endswith((".html", ".htm")):
        p = _Text()
        p.feed(raw)
        return p.text()
    return raw


def files(paths, exts, exclude):
    out = []
    for p in paths:
        if os.path.isdir(p):
            for root, _, names in os.walk(p):
                out.extend(
                    f
                    for f in (os.path.join(root, n) for n in names if n.endswith(exts))
                    if not any(x in f for x in exclude)
                )
        elif os.path.isfile(p):
            out.append(p)
        else:
            sys.exit(f"token_corpus: {p}: no such file or directory")
    return sorted(set(out))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("paths", nargs="+")
    ap.add_argument("--out", required=True)
    how = ap.add_mutually_exclusive_group(required=True)
    how.add_argument("--tokenizer", help="a Hugging Face tokenizer.json")
    how.add_argument("--train-vocab", type=int, help="train a byte-level BPE of this size")
    ap.add_argument("--ext", default=".html,.md,.txt", help="file endings to read (comma-separated)")
    ap.add_argument(
        "--exclude",
        action="append",
        default=[],
        help="skip files whose path contains this (repeatable; e.g. print.html, a copy of a whole book)",
    )
    ap.add_argument("--min-tokens", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=4096)
    a = ap.parse_args()
    if a.min_tokens < 1 or a.max_tokens < a.min_tokens:
        sys.exit("token_corpus: need 1 <= --min-tokens <= --max-tokens")

    exts = tuple(e.strip() for e in a.ext.split(",") if e.strip())
    paths = files(a.paths, exts, a.exclude)
    texts = [t for t in (read_text(p) for p in paths) if t.strip()]
    if not texts:
        sys.exit("token_corpus: no text found")
    try:
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    except ImportError:
        sys.exit("token_corpus: needs the `tokenizers` package (pip install tokenizers)")
    if a.tokenizer:
        tok = Tokenizer.from_file(a.tokenizer)
    else:
        if a.train_vocab < 512:
            sys.exit("token_corpus: --train-vocab must be at least 512")
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=a.train_vocab,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        )
        tok.train_from_iterator(texts, trainer=trainer)
    docs = 0
    tokens = 0
    vocab = 0
    with open(a.out, "w") as out:
        for enc in tok.encode_batch(texts, add_special_tokens=False):
            ids = enc.ids
            for i in range(0, len(ids), a.max_tokens):
                d = ids[i : i + a.max_tokens]
                if len(d) < a.min_tokens:
                    continue
                out.write(json.dumps(d, separators=(",", ":")) + "\n")
                docs += 1
                tokens += len(d)
                vocab = max(vocab, max(d) + 1)
    print(
        f"token_corpus: {len(paths)} files, {docs} documents, {tokens} tokens, "
        f"ids below {vocab} (tokenizer of {tok.get_vocab_size()} tokens) -> {a.out}",
        file=sys.stderr,
    )


if __name__ == "__main__":
    main()
