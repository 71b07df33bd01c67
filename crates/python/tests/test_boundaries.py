"""DeepSeek-V4.1's look-back boundaries through `Site.ids(doc_starts=...,
masked=...)` on an Engram checkpoint, against the numpy reference
(reference/families_reference.py, `engram_ids_bounded`), and the errors of
a bad position or a site of another family."""

import json
import sys
from pathlib import Path

import pytest

import metrale_ple


@pytest.fixture(scope="module")
def engram(tmp_path_factory):
    path = tmp_path_factory.mktemp("ckpt") / "engram"
    return metrale_ple.init_checkpoint(path, preset="engram-demo", table_rows=4096, seed=5)


@pytest.fixture(scope="module")
def families_reference(root):
    sys.path.insert(0, str(root / "reference"))
    import families_reference

    return families_reference


TOKENS = [7, 11, 2, 13, 17, 19, 23, 29, 31, 37]
CASES = [
    ([], []),
    ([0], []),
    ([4], []),
    ([], [3]),
    ([2, 7], [5, 6]),
    ([1, 2, 3], [0, 9]),
]


@pytest.mark.parametrize("doc_starts,masked", CASES)
def test_bounded_ids_match_the_reference(engram, families_reference, doc_starts, masked):
    g = engram.geometry
    d = Path(engram.path)
    config = json.loads((d / "config.json").read_text())
    token_map = json.loads((d / "engram_token_map.json").read_text())
    for site in engram.sites:
        got = site.ids(TOKENS, doc_starts=doc_starts, masked=masked).ids.tolist()
        want = families_reference.engram_ids_bounded(
            TOKENS,
            families_reference.flags(len(TOKENS), doc_starts),
            families_reference.flags(len(TOKENS), masked),
            token_map,
            config["pad_id"],
            site.multipliers,
            site.head_vocab_sizes,
            site.head_offsets,
            g["ngram_size"],
            g["heads_per_ngram"],
        )
        assert got == want, (site.layer, doc_starts, masked)


def test_a_document_start_hashes_like_a_fresh_sequence(engram):
    site = engram.sites[0]
    p = 4
    split = site.ids(TOKENS, doc_starts=[p]).ids.tolist()
    plain = site.ids(TOKENS).ids.tolist()
    fresh = site.ids(TOKENS[p:]).ids.tolist()
    assert split[:p] == plain[:p]
    assert split[p:] == fresh
    assert split != plain


def test_bad_positions_and_other_families(engram, tiny):
    site = engram.sites[0]
    with pytest.raises(ValueError, match="masked: position 10 is past the 10 tokens"):
        site.ids(TOKENS, masked=[10])
    with pytest.raises(ValueError, match="doc_starts: position 99"):
        site.ids(TOKENS, doc_starts=[99])
    with pytest.raises(ValueError, match="defined for the Engram family; this site is qwen4exp"):
        tiny.sites[0].ids([1, 2, 3], masked=[0])
