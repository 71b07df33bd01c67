"""Reference compressed-token maps (Engram) and the fixtures under
fixtures/token_map/.

Written from docs/SPEC.md §11 and the public description of the Engram
demo's CompressedTokenizer, not from the Rust code. For each raw id of a
tokenizer (len = the distinct token strings of the model and the added
tokens): decode the id alone; when the text holds U+FFFD the key is the raw
token string, otherwise the normalised text, or the text itself when that
is empty; compressed ids are handed out in first-seen order of keys.

The normaliser here is written with `unicodedata`: NFKC, NFD, drop every
combining mark (category M*), lowercase char by char, `[ \\t\\r\\n]+` to one
space, a lone space kept as a space, strip Unicode White_Space at both
ends. The demo runs the same steps through the `tokenizers` library's
normalizers; `build` asserts the two agree on every decoded text, so the
written-down description is checked against the library too.

Decoding uses the `tokenizers` package itself (Tokenizer.decode with
skip_special_tokens=False, Tokenizer.id_to_token); the Rust map is built
with the same library's Rust crate, and these fixtures check it.

The tokenizers are trained here on a tiny corpus (accents, capitals,
whitespace runs, CJK, Greek, Devanagari, emoji, ligatures) so every case
the keys distinguish occurs: byte tokens that decode to U+FFFD, a token
that is one space, tokens that only differ in case or accents, added and
special tokens. The two BPE tokenizers come out the same on every run; the
Unigram trainer's pieces vary between runs (its ties are not ordered), so
a rerun rewrites that fixture pair with another, equally valid, case.

Usage:
  python3 reference/token_map_reference.py [OUT_DIR]   write the fixtures
  (needs `pip install tokenizers`; the Rust tests read the committed files)
"""

import json
import os
import re
import sys
import unicodedata

# Unicode White_Space, what the library's Strip (Rust char::is_whitespace)
# removes. Python's str.strip() would also remove U+001C..U+001F.
WHITE_SPACE = (
    "\t\n\x0b\x0c\r \x85\xa0\u1680\u2000\u2001\u2002\u2003\u2004\u2005\u2006"
    "\u2007\u2008\u2009\u200a\u2028\u2029\u202f\u205f\u3000"
)

CORPUS = [
    "Hello HELLO hello héllo Héllo HÉLLO the The THE ThE",
    "Café CAFÉ café cafe\u0301 naïve NAÏVE Zoë Ångström ångström",
    "  double  spaces\tand\ttabs\n\nnewlines \r\n crlf   end  ",
    "日本語のテキスト 中文文本 한국어 텍스트 日本 日本語",
    "Ωμέγα ΣΊΣΥΦΟΣ σίσυφος straße STRASSE \ufb01ne \uff26\uff35\uff2c\uff2c width",
    "नमस्ते दुनिया काम का किताब",
    "emoji 🙂 👍🏽 🙂🙂 ❤️ ok",
    "İstanbul ıstanbul DŽ ǅ ǆ ﬀ Ⅻ ①②",
    "numbers 0123 ٠١٢٣ ¹²³ ½",
]


def normalize(text):
    s = unicodedata.normalize("NFKC", text)
    s = unicodedata.normalize("NFD", s)
    s = "".join(c for c in s if not unicodedata.category(c).startswith("M"))
    s = "".join(c.lower() for c in s)
    s = re.sub(r"[ \t\r\n]+", " ", s)
    if s == " ":
        return " "
    return s.strip(WHITE_SPACE)


def library_normalizer():
    """The demo's normalizer, built from the `tokenizers` library."""
    from tokenizers import Regex, normalizers

    sentinel = "\ue000"
    return normalizers.Sequence([
        normalizers.NFKC(),
        normalizers.NFD(),
        normalizers.StripAccents(),
        normalizers.Lowercase(),
        normalizers.Replace(Regex(r"[ \t\r\n]+"), " "),
        normalizers.Replace(Regex(r"^ $"), sentinel),
        normalizers.Strip(),
        normalizers.Replace(sentinel, " "),
    ])


def build(tok):
    """(map, keys) of a `tokenizers.Tokenizer`."""
    lib = library_normalizer()
    n = tok.get_vocab_size(with_added_tokens=True)
    index, keys, out = {}, [], []
    for tid in range(n):
        text = tok.decode([tid], skip_special_tokens=False)
        if "\ufffd" in text:
            key = tok.id_to_token(tid)
        else:
            norm = normalize(text)
            assert norm == lib.normalize_str(text), (tid, text, norm, lib.normalize_str(text))
            key = norm or text
        if key not in index:
            index[key] = len(keys)
            keys.append(key)
        out.append(index[key])
    return out, keys


def byte_level_bpe():
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=420,
        special_tokens=["<|begin|>", "<|end|>", "<pad>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS * 3, trainer)
    # Added tokens: one with a space (outside the byte table, kept as is),
    # CJK (outside the table), one with é (in the table: a lone 0xE9 byte,
    # so U+FFFD), one made of table chars, and specials.
    tok.add_tokens([
        AddedToken(" spaced tok ", normalized=False),
        "日本",
        AddedToken("bé", normalized=False),
        AddedToken("Ġhello", normalized=False),
        AddedToken("HELLO!", normalized=False),
    ])
    tok.add_special_tokens(["<image>", "<special é>"])
    return tok


def llama_style_bpe():
    """Metaspace pre-tokenizer, byte fallback and the Llama decoder chain."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first")
    tok.decoder = decoders.Sequence([
        decoders.Replace("\u2581", " "),
        decoders.ByteFallback(),
        decoders.Fuse(),
        decoders.Strip(" ", 1, 0),
    ])
    bytes_ = ["<0x%02X>" % b for b in range(256)]
    trainer = trainers.BpeTrainer(
        vocab_size=600,
        special_tokens=["<unk>", "<s>", "</s>"] + bytes_,
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS * 3, trainer)
    return tok


def unigram_metaspace():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.Unigram())
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="always")
    tok.decoder = decoders.Metaspace(replacement="\u2581", prepend_scheme="always")
    trainer = trainers.UnigramTrainer(
        vocab_size=260,
        special_tokens=["<pad>", "</s>", "<unk>"],
        unk_token="<unk>",
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS * 3, trainer)
    return tok


TOKENIZERS = {
    "byte_level_bpe": byte_level_bpe,
    "llama_style_bpe": llama_style_bpe,
    "unigram_metaspace": unigram_metaspace,
}


def write(out_dir):
    os.makedirs(out_dir, exist_ok=True)
    for name, make in TOKENIZERS.items():
        tok = make()
        tok_path = os.path.join(out_dir, name + ".tokenizer.json")
        tok.save(tok_path, pretty=False)
        # Decode from the saved file, as a user of the file would.
        from tokenizers import Tokenizer

        loaded = Tokenizer.from_file(tok_path)
        token_map, keys = build(loaded)
        assert sorted(set(token_map)) == list(range(len(keys)))
        fffd = sum(1 for t in range(len(token_map))
                   if "\ufffd" in loaded.decode([t], skip_special_tokens=False))
        doc = {
            "name": name,
            "tokenizer": name + ".tokenizer.json",
            "raw_vocab_size": len(token_map),
            "compressed_vocab_size": len(keys),
            "fffd_tokens": fffd,
            "map": token_map,
            "keys": keys,
        }
        with open(os.path.join(out_dir, name + ".expected.json"), "w", encoding="utf-8") as fh:
            json.dump(doc, fh, ensure_ascii=False, separators=(",", ":"))
            fh.write("\n")
        print("wrote", name, len(token_map), "->", len(keys), "ids,", fffd, "U+FFFD tokens")


if __name__ == "__main__":
    write(sys.argv[1] if len(sys.argv) > 1 else os.path.join(
        os.path.dirname(os.path.abspath(__file__)), "..", "fixtures", "token_map"))
