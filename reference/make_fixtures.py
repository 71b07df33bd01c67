"""Write the golden id-hash fixtures under fixtures/ids/.

Each fixture is one PLE site (its parameters and derived constants) and a
few cases. A case starts from a history and hashes its chunks in order,
carrying the history; `ids[c]` holds the rows of chunk c and `histories[c]`
the history after it. Run from the repository root:

    python3 reference/make_fixtures.py
"""

from __future__ import annotations

import json
import pathlib

import ple_reference as ref

OUT = pathlib.Path(__file__).resolve().parent.parent / "fixtures" / "ids"

QWEN_EOS = 151645


def slow_ids(window, dims):
    """A loop-by-loop second opinion on ref.ngram_ids, for self-checking."""
    eos, n_max, k = dims["eos_token_id"], dims["ngram_size"], dims["heads_per_ngram"]
    rows = []
    seg = 0
    for i, _ in enumerate(window):
        if i > 0 and window[i - 1] == eos:
            seg = i
        row = []
        for order in range(2, n_max + 1):
            mixed = 0
            for p in range(order):
                tok = window[i - p] if i - p >= seg else eos
                mixed ^= (tok * dims["multipliers"][p]) & ref.U64
            for h in range((order - 2) * k, (order - 1) * k):
                row.append(mixed % dims["head_vocab_sizes"][h] + dims["head_offsets"][h])
        rows.append(row)
    return rows


def run_case(name, dims, chunks, history=None):
    history = list(ref.fresh_history(dims) if history is None else history)
    start = list(history)
    ids, hists = [], []
    for chunk in chunks:
        got, history = ref.hash_chunk(history, chunk, dims)
        ids.append(got.tolist())
        hists.append(list(history))
    # Chunking must not matter: the whole sequence in one go agrees.
    whole = [t for c in chunks for t in c]
    assert [r for c in ids for r in c] == ref.hash_chunk(start, whole, dims)[0].tolist()
    assert ref.ngram_ids(start + whole, dims).tolist() == slow_ids(start + whole, dims)
    return {"name": name, "history": start, "chunks": chunks, "ids": ids, "histories": hists}


def fixture(path, description, params, cases):
    dims = ref.derive(**params)
    doc = {
        "description": description,
        "params": params,
        "derived": {
            "multipliers": dims["multipliers"],
            "head_vocab_sizes": dims["head_vocab_sizes"],
            "head_offsets": dims["head_offsets"],
            "padded_rows": dims["padded_rows"],
        },
        "cases": [run_case(dims=dims, **c) for c in cases],
    }
    text = json.dumps(doc, separators=(",", ":"))
    (OUT / path).write_text(text + "\n")
    print(f"{path}: {len(text)} bytes")
    return dims


def params(**kw):
    base = {"divisible_by": 128, "seed": 1234, "site": 0}
    base.update(kw)
    return base


def main():
    OUT.mkdir(parents=True, exist_ok=True)
    e = QWEN_EOS
    flagship = dict(vocab_size=151936, eos_token_id=e, ngram_size=3, heads_per_ngram=8,
                    ngram_vocab_size_base=20_000_000)

    d0 = fixture("flagship_site0.json", "Flagship geometry (N=3, K=8), site 0",
                 params(**flagship), [
                     dict(name="one_token_shorter_than_context", chunks=[[9707]]),
                     dict(name="mid_sequence_eos", chunks=[[9707, 11, 1879, e, 785, 3974, 13]]),
                     dict(name="runs_of_eos", chunks=[[e, e, 42, e, e, e, 7]]),
                     dict(name="chunked", chunks=[[0, 200, 300], [e], [5, 6], [151935]]),
                 ])
    assert d0["multipliers"] == [15411308609579, 2523213358983, 11275943025685]
    assert d0["head_vocab_sizes"][:3] == [20000003, 20000023, 20000033]
    assert d0["padded_rows"] == 320_001_536

    d1 = fixture("flagship_site1.json", "Flagship geometry (N=3, K=8), site 1",
                 params(**flagship, site=1), [
                     dict(name="mid_sequence_eos", chunks=[[9707, 11, e, 785, 13]]),
                     dict(name="chunked_from_mid_sequence_history", history=[77, 88],
                          chunks=[[1, 2], [3], [e, 4]]),
                 ])
    assert d1["head_vocab_sizes"][0] > d0["head_vocab_sizes"][-1]

    small = dict(vocab_size=1000, eos_token_id=2, ngram_vocab_size_base=1000,
                 divisible_by=64, seed=99)
    fixture("small_n4_k2.json", "Small geometry N=4, K=2, site 3",
            dict(small, ngram_size=4, heads_per_ngram=2, site=3), [
                dict(name="one_token_shorter_than_context", chunks=[[17]]),
                dict(name="two_tokens_shorter_than_context", chunks=[[17, 18]]),
                dict(name="mid_sequence_eos", chunks=[[5, 6, 7, 2, 8, 9, 10, 11]]),
                dict(name="runs_of_eos", chunks=[[2, 2, 2, 5, 2, 2, 6, 7, 8]]),
                dict(name="chunked", chunks=[[5], [6, 7], [], [2, 9, 10, 11, 12], [13]]),
                dict(name="history_with_eos", history=[5, 2, 7], chunks=[[8], [9, 2], [3]]),
            ])
    fixture("small_n2_k3.json", "Small geometry N=2 (bigrams only), K=3",
            dict(small, ngram_size=2, heads_per_ngram=3, site=0), [
                dict(name="mid_sequence_eos_chunked", chunks=[[5, 6], [2, 7], [2, 2, 8]]),
            ])
    fixture("small_n5_k1.json", "Small geometry N=5, K=1, seed 7",
            dict(small, ngram_size=5, heads_per_ngram=1, site=1, seed=7), [
                dict(name="mid_sequence_eos_chunked",
                     chunks=[[5, 6, 7], [8, 2, 9], [10, 11, 12, 13, 14], [2]]),
                dict(name="history_with_eos", history=[3, 2, 4, 5], chunks=[[6, 7]]),
            ])


if __name__ == "__main__":
    main()
