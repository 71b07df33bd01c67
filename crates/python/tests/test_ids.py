"""metrale_ple.ids and Site.ids against the golden fixtures of fixtures/ids/
(written by reference/make_fixtures.py from the numpy reference)."""

import json

import numpy as np
import pytest

import metrale_ple

FIXTURES = [
    "flagship_site0.json",
    "flagship_site1.json",
    "small_n4_k2.json",
    "small_n2_k3.json",
    "small_n5_k1.json",
]


def kwargs(p):
    return dict(
        vocab_size=p["vocab_size"],
        eos=p["eos_token_id"],
        ngram_size=p["ngram_size"],
        heads_per_ngram=p["heads_per_ngram"],
        vocab_base=p["ngram_vocab_size_base"],
        divisible_by=p["divisible_by"],
        seed=p["seed"],
        site=p["site"],
    )


@pytest.mark.parametrize("name", FIXTURES)
def test_ids_match_the_golden_fixtures(root, name):
    doc = json.loads((root / "fixtures" / "ids" / name).read_text())
    kw = kwargs(doc["params"])
    want = doc["derived"]
    checked = 0
    for case in doc["cases"]:
        history = case["history"]
        for c, chunk in enumerate(case["chunks"]):
            r = metrale_ple.ids(chunk, history=history, **kw)
            assert r.multipliers == want["multipliers"]
            assert r.head_vocab_sizes == want["head_vocab_sizes"]
            assert r.head_offsets == want["head_offsets"]
            assert r.padded_rows == want["padded_rows"]
            assert r.ids.dtype == np.int64
            heads = len(want["head_vocab_sizes"])
            assert r.ids.shape == (len(chunk), heads)
            np.testing.assert_array_equal(r.ids, np.asarray(case["ids"][c], dtype=np.int64).reshape(-1, heads))
            assert r.history == case["histories"][c], f"{case['name']} chunk {c}"
            history = r.history
            checked += len(chunk)
    assert checked > 0


def test_defaults_and_input_forms():
    kw = dict(vocab_size=151936, eos=151645, ngram_size=3, heads_per_ngram=8, vocab_base=20_000_000)
    fresh = metrale_ple.ids([1, 2, 3], **kw)
    # docs/SPEC.md, Constant derivation: the example constants.
    assert fresh.multipliers == [15411308609579, 2523213358983, 11275943025685]
    assert fresh.head_vocab_sizes[:3] == [20000003, 20000023, 20000033]
    assert fresh.padded_rows == 320_001_536
    assert fresh.history == [2, 3]
    explicit = metrale_ple.ids([1, 2, 3], history=[151645, 151645], divisible_by=128, seed=1234, site=0, **kw)
    np.testing.assert_array_equal(fresh.ids, explicit.ids)
    for form in (np.array([1, 2, 3], dtype=np.int32), np.array([1, 2, 3], dtype=np.uint64), (1, 2, 3)):
        np.testing.assert_array_equal(metrale_ple.ids(form, **kw).ids, fresh.ids)
    # Chunking with the history carried gives the ids of the whole.
    a = metrale_ple.ids([1, 2], **kw)
    b = metrale_ple.ids([3], history=a.history, **kw)
    np.testing.assert_array_equal(np.vstack([a.ids, b.ids]), fresh.ids)
    assert metrale_ple.ids([], **kw).ids.shape == (0, 16)


def test_site_ids_use_the_checkpoint_constants(tiny):
    g = tiny.geometry
    for site in tiny.sites:
        toks = [5, 6, g["eos_token_id"], 7, 8]
        r = site.ids(toks)
        direct = metrale_ple.ids(
            toks,
            vocab_size=g["vocab_size"],
            eos=g["eos_token_id"],
            ngram_size=g["ngram_size"],
            heads_per_ngram=g["heads_per_ngram"],
            vocab_base=g["ngram_vocab_size_base"],
            divisible_by=g["divisible_by"],
            seed=g["hash_seed"],
            site=site.index,
        )
        np.testing.assert_array_equal(r.ids, direct.ids)
        assert r.multipliers == site.multipliers
        assert r.padded_rows == site.padded_rows
        np.testing.assert_array_equal(site.ids([7, 8], history=[5, 6]).ids, metrale_ple.ids([7, 8], history=[5, 6], vocab_size=g["vocab_size"], eos=g["eos_token_id"], ngram_size=g["ngram_size"], heads_per_ngram=g["heads_per_ngram"], vocab_base=g["ngram_vocab_size_base"], divisible_by=g["divisible_by"], seed=g["hash_seed"], site=site.index).ids)


@pytest.mark.parametrize(
    "tokens, extra",
    [
        ([1, 1000], {}),  # token >= vocab_size
        ([-1], {}),  # negative
        ([2**32], {}),  # not a u32
        ("abc", {}),  # not tokens
        (np.array([1.5]), {}),  # float array
        (np.zeros((2, 2), dtype=np.int64), {}),  # 2-D
        ([1], {"history": [1, 2, 3]}),  # history of the wrong length
        ([1], {"ngram_size": 1}),  # geometry refused
        ([1], {"heads_per_ngram": 0}),
    ],
)
def test_bad_arguments_raise_value_error(tokens, extra):
    kw = dict(vocab_size=1000, eos=2, ngram_size=3, heads_per_ngram=2, vocab_base=1000)
    kw.update(extra)
    with pytest.raises(ValueError):
        metrale_ple.ids(tokens, **kw)


def test_keyword_only_geometry():
    with pytest.raises(TypeError):
        metrale_ple.ids([1], 1000, 2, 3, 2, 1000)
