"""Reference ids of the Engram and LongCat hash families, and the golden
fixtures under fixtures/families/.

Written from docs/SPEC.md §11 (Families) and the public descriptions of the
two families (the Engram demo, DeepSeek-V4.1 ports, LongCat's n-gram
embedding), not from the Rust code. numpy only; the Rust tests read the
JSON this writes and never run Python.

Engram: tokens go through an optional compressed-token map; the n-gram
context is the mapped predecessors, the mapped pad id before the sequence
start; order n mixes (x * m[0]) ^ (shift_1 * m[1]) ^ ... in signed int64
and head j of that order reads mix % prime_j + offset_j (numpy's floor
modulo). Multipliers: 2 * default_rng(seed + 10007 * layer).integers(0,
half, N) + 1 with half = max(1, ((2^63 - 1) // V') // 2), layer the
absolute 0-based block index. Head sizes: one set of taken primes across
all layers, in the order layer, order, head; each order restarts its
search at base - 1 and each head takes the next untaken prime above the
running start.

LongCat: m = int(ratio * V); sub-table i (order-major: i = (n-2)*k + j)
has M_i = m + 2i + 1 rows; the id of order n at t is
(x_t + sum_{d=1}^{n-1} x_{t-d} * (V^d mod M_i)) mod M_i + offset_i, where a
predecessor in an earlier segment (a segment starts right after an EOS) or
before the sequence counts as 0. An EOS at t itself belongs to the segment
before it.

Usage: python3 reference/families_reference.py [OUT_DIR]
"""

import json
import os
import sys

import numpy as np

from ple_reference import is_prime

INT64_MAX = (1 << 63) - 1


# ---------------------------------------------------------------- Engram


def engram_sizes(bases, heads, n_layers):
    taken = set()
    out = []
    for _ in range(n_layers):
        layer = []
        for base in bases:
            start = base - 1
            for _ in range(heads):
                c = start + 1
                while not (is_prime(c) and c not in taken):
                    c += 1
                taken.add(c)
                layer.append(c)
                start = c
        out.append(layer)
    return out


def engram_multipliers(hashed_vocab, n, seed, layer):
    half = max(1, (INT64_MAX // hashed_vocab) // 2)
    g = np.random.default_rng(seed + 10007 * layer)
    r = g.integers(low=0, high=half, size=(n,), dtype=np.int64)
    return [int(v) for v in r * 2 + 1]


def offsets_of(sizes):
    out, total = [], 0
    for s in sizes:
        out.append(total)
        total += s
    return out, total


def engram_ids(seq, token_map, pad, mults, sizes, offsets, n, heads):
    """Ids of every position of seq (a whole sequence from its start)."""
    x = np.asarray(seq, dtype=np.int64)
    if token_map is not None:
        x = np.asarray(token_map, dtype=np.int64)[x]
        pad = int(token_map[pad])
    T = len(x)

    def shift(k):
        if k == 0:
            return x
        return np.concatenate([np.full(k, pad, dtype=np.int64), x])[:T]

    shifts = [shift(k) for k in range(n)]
    m = np.asarray(mults, dtype=np.int64)
    cols = []
    for order in range(2, n + 1):
        mix = shifts[0] * m[0]
        for k in range(1, order):
            mix = np.bitwise_xor(mix, shifts[k] * m[k])
        for j in range(heads):
            h = (order - 2) * heads + j
            cols.append(mix % np.int64(sizes[h]) + np.int64(offsets[h]))
    return [[int(v) for v in row] for row in np.stack(cols, axis=1)] if T else []


def engram_ids_bounded(seq, doc_start, masked, token_map, pad, mults, sizes, offsets, n,
                       heads):
    """engram_ids with DeepSeek-V4.1's look-back boundaries (docs/SPEC.md §11):
    a masked position reads as DEAD, and the look-back of position t is
    blocked from the first shift that reaches a DEAD position, a position
    before the sequence, or a position before a document start at or before
    t; blocked shifts (and all longer ones) read the mapped pad id."""
    x = [int(v) for v in seq]
    if token_map is not None:
        x = [int(token_map[v]) for v in x]
        pad = int(token_map[pad])
    T = len(x)
    out = []
    for t in range(T):
        shifted = []
        blocked = False
        for s in range(n):
            u = t - s
            if u < 0:
                blocked = True
            else:
                if s > 0 and doc_start[u + 1]:
                    blocked = True
                if masked[u]:
                    blocked = True
            shifted.append(pad if blocked else x[u])
        row = []
        for order in range(2, n + 1):
            mix = np.int64(shifted[0]) * np.int64(mults[0])
            for k in range(1, order):
                mix = np.bitwise_xor(mix, np.int64(shifted[k]) * np.int64(mults[k]))
            for j in range(heads):
                h = (order - 2) * heads + j
                row.append(int(mix % np.int64(sizes[h]) + np.int64(offsets[h])))
        out.append(row)
    return out


def flags(count, positions):
    return [i in positions for i in range(count)]


def boundaries_fixture(name, base):
    """Cases of look-back boundaries on the sites of an Engram fixture
    `base` (its config, token map and constants)."""
    config, token_map = base["config"], base["token_map"]
    v41 = "engram_max_ngram_size" in config
    n = config["engram_max_ngram_size" if v41 else "max_ngram_size"]
    heads = config["engram_n_heads" if v41 else "n_head_per_ngram"]
    pad = config["engram_pad_token_id" if v41 else "pad_id"]
    ctx = n - 1
    limit = len(token_map) if token_map is not None else (
        config["engram_compressed_vocab_size"] if v41 else config["compressed_vocab_size"])
    toks = pseudo_tokens(17, 30, limit)
    specs = [
        # name, history (None: fresh), history doc starts, history masked,
        # tokens, doc starts, masked, chunks
        ("none", None, [], [], toks, [], [], [30]),
        ("doc_starts", None, [], [], toks, [0, 5, 6, 17], [], [30]),
        ("masked_span", None, [], [], toks, [], [3, 4, 5, 6, 7, 20], [30]),
        ("masked_first", None, [], [], toks[:6], [], [0], [6]),
        ("both", None, [], [], toks, [9, 22], [2, 9, 10, 23, 29], [30]),
        ("both_chunked", None, [], [], toks, [9, 22], [2, 9, 10, 23, 29], [1, 8, 2, 12, 7]),
        ("history_masked", toks[:ctx], [], [ctx - 1], toks[ctx:ctx + 8], [], [], [8]),
        ("history_doc_start", toks[:ctx], [ctx - 1], [], toks[ctx:ctx + 8], [], [], [3, 5]),
        ("doc_start_cuts_history", toks[:ctx], [], [], toks[ctx:ctx + 8], [0], [4], [8]),
    ]
    cases = []
    for si, site in enumerate(base["sites"]):
        for (cname, hist, hds, hms, tk, ds, ms, chunks) in specs:
            hist_seq = [pad] * ctx if hist is None else list(hist)
            seq = hist_seq + list(tk)
            h = len(hist_seq)
            d = flags(h, hds) + flags(len(tk), ds)
            m = flags(h, hms) + flags(len(tk), ms)
            # A position after the last needs no flag: pad one for u + 1.
            ids = engram_ids_bounded(seq, d + [False], m, token_map, pad, site["multipliers"],
                                     site["head_vocab_sizes"], site["head_offsets"], n,
                                     heads)[h:]
            assert sum(chunks) == len(tk)
            cases.append({"name": cname, "site": si, "history": hist,
                          "history_doc_starts": hds, "history_masked": hms, "tokens": tk,
                          "doc_starts": ds, "masked": ms, "chunks": chunks, "ids": ids})
    # Without boundaries the bounded hash is the plain one.
    for c in cases:
        if c["name"] == "none":
            site = base["sites"][c["site"]]
            plain = engram_ids([pad] * ctx + c["tokens"], token_map, pad, site["multipliers"],
                               site["head_vocab_sizes"], site["head_offsets"], n, heads)[ctx:]
            assert plain == c["ids"]
    return {"name": name, "family": "engram", "config": config, "token_map": token_map,
            "sites": base["sites"], "cases": cases}


# --------------------------------------------------------------- LongCat


def longcat_layout(m, count):
    sizes = [m + 2 * i + 1 for i in range(count)]
    offs, total = offsets_of(sizes)
    return sizes, offs, total


def longcat_ids(seq, vocab, eos, sizes, offsets, n, k):
    out = []
    for t in range(len(seq)):
        # The segment of t starts right after the last EOS strictly before t.
        start = 0
        for u in range(t - 1, -1, -1):
            if seq[u] == eos:
                start = u + 1
                break
        row = []
        for order in range(2, n + 1):
            for j in range(k):
                i = (order - 2) * k + j
                M = sizes[i]
                acc = seq[t]
                for d in range(1, order):
                    prev = seq[t - d] if t - d >= start else 0
                    acc += prev * pow(vocab, d, M)
                row.append(acc % M + offsets[i])
        out.append(row)
    return out


# -------------------------------------------------------------- fixtures


def pseudo_tokens(seed, count, limit, specials=(), every=0):
    """Deterministic tokens below limit; every `every`-th one a special."""
    state = seed & 0xFFFFFFFFFFFFFFFF
    out = []
    for i in range(count):
        state = (state * 6364136223846793005 + 1442695040888963407) & 0xFFFFFFFFFFFFFFFF
        if specials and every and i % every == every - 1:
            out.append(specials[(state >> 33) % len(specials)])
        else:
            out.append(int((state >> 33) % limit))
    return out


def history_after(history, tokens, ctx, fill):
    full = list(history) + list(tokens)
    tail = full[-ctx:] if len(full) >= ctx else full
    return [fill] * (ctx - len(tail)) + tail


def case(name, family, hist, tokens, chunks, ctx, fill, whole_ids):
    """whole_ids(seq) gives the ids of every position of seq."""
    seq = list(hist or []) + list(tokens)
    ids = whole_ids(seq)[len(seq) - len(tokens):]
    assert sum(chunks) == len(tokens)
    return {
        "name": name,
        "history": hist,
        "tokens": tokens,
        "chunks": chunks,
        "ids": ids,
        "history_after": history_after([fill] * ctx if hist is None else hist, tokens, ctx, fill),
    }


def engram_fixture(name, config, keys, token_map, cases_spec, oov):
    v41 = keys == "v41"
    g = (lambda a, b: config[b] if v41 else config[a])
    n = g("max_ngram_size", "engram_max_ngram_size")
    heads = g("n_head_per_ngram", "engram_n_heads")
    bases = config["engram_vocab_size"]
    if not isinstance(bases, list):
        bases = [bases] * (n - 1)
    layers = g("layer_ids", "engram_layer_ids")
    pad = g("pad_id", "engram_pad_token_id")
    seed = config.get("engram_seed" if v41 else "seed", 0)
    hv = config["engram_compressed_vocab_size"] if v41 else config.get(
        "compressed_vocab_size", config["vocab_size"])
    sizes = engram_sizes(bases, heads, len(layers))
    sites = []
    for li, layer in enumerate(layers):
        offs, total = offsets_of(sizes[li])
        mults = engram_multipliers(hv, n, seed, layer)
        # No product of a hashed id leaves int64.
        assert all(m * (hv - 1) <= INT64_MAX for m in mults)
        sites.append({"layer": layer, "multipliers": mults, "head_vocab_sizes": sizes[li],
                      "head_offsets": offs, "padded_rows": total})
    if "engram_num_embeddings" in config:
        assert [s["padded_rows"] for s in sites] == config["engram_num_embeddings"], \
            "rebuilt table sizes differ from engram_num_embeddings"
    cases = []
    for si, site in enumerate(sites):
        for (cname, hist, toks, chunks) in cases_spec:
            c = case(cname, "engram", hist, toks, chunks, n - 1, pad,
                     lambda seq: engram_ids(seq, token_map, pad, site["multipliers"],
                                            site["head_vocab_sizes"], site["head_offsets"],
                                            n, heads))
            c["site"] = si
            cases.append(c)
    return {"name": name, "family": "engram", "config": config, "token_map": token_map,
            "sites": sites, "cases": cases, "oov": oov}


def longcat_fixture(name, config, cases_spec, oov):
    oe = "oe_vocab_size_ratio" in config
    ratio = config["oe_vocab_size_ratio" if oe else "ngram_vocab_size_ratio"]
    n = config["oe_neighbor_num" if oe else "emb_neighbor_num"]
    k = config["oe_split_num" if oe else "emb_split_num"]
    vocab = config["vocab_size"]
    eos = config["eos_token_id"]
    m = int(ratio * vocab)
    sizes, offs, total = longcat_layout(m, k * (n - 1))
    sites = [{"layer": 0, "multipliers": [], "head_vocab_sizes": sizes, "head_offsets": offs,
              "padded_rows": total}]
    cases = []
    for (cname, hist, toks, chunks) in cases_spec:
        c = case(cname, "longcat", hist, toks, chunks, n - 1, eos,
                 lambda seq: longcat_ids(seq, vocab, eos, sizes, offs, n, k))
        c["site"] = 0
        cases.append(c)
    return {"name": name, "family": "longcat", "config": config, "token_map": None,
            "sites": sites, "cases": cases, "oov": oov}


def main():
    out_dir = sys.argv[1] if len(sys.argv) > 1 else os.path.join(
        os.path.dirname(__file__), "..", "fixtures", "families")
    os.makedirs(out_dir, exist_ok=True)
    fixtures = []

    # A small Engram with a token map: raw vocabulary 50, 20 compressed ids.
    tmap = [(t * 7) % 20 for t in range(50)]
    small_cfg = {
        "vocab_size": 50, "hidden_size": 32, "hc_mult": 2,
        "engram_vocab_size": [31, 37], "max_ngram_size": 3, "n_embed_per_ngram": 32,
        "n_head_per_ngram": 2, "layer_ids": [1, 3], "pad_id": 2, "seed": 5,
        "kernel_size": 4, "compressed_vocab_size": 20,
    }
    toks = pseudo_tokens(11, 40, 50, specials=(2,), every=7)
    fixtures.append(engram_fixture("engram_small", small_cfg, "demo", tmap, [
        ("fresh", None, toks, [40]),
        ("chunked", None, toks, [1, 2, 13, 1, 23]),
        ("carried_history", [2, 49], toks[:10], [3, 7]),
        ("pad_inside", None, [2, 2, 7, 2, 9], [5]),
    ], [{"history": None, "tokens": [3, 50], "input": "tokens", "position": 1, "token": 50},
        {"history": [1, 60], "tokens": [3], "input": "history", "position": 1, "token": 60}]))

    # The Engram demo's constants (raw vocabulary 129280). The demo derives V'
    # from DeepSeek-V3's tokenizer; 99092 is the value DeepSeek-V4.1 states
    # for its 129280-entry vocabulary, taken here for the demo as well.
    demo_cfg = {
        "vocab_size": 129280, "hidden_size": 1024, "hc_mult": 4, "num_layers": 30,
        "engram_vocab_size": [129280 * 5, 129280 * 5], "max_ngram_size": 3,
        "n_embed_per_ngram": 512, "n_head_per_ngram": 8, "layer_ids": [1, 15],
        "pad_id": 2, "seed": 0, "kernel_size": 4, "compressed_vocab_size": 99092,
    }
    toks = pseudo_tokens(3, 24, 99092, specials=(2,), every=5)
    fixtures.append(engram_fixture("engram_demo", demo_cfg, "demo", None, [
        ("fresh", None, toks, [24]),
        ("chunked", None, toks, [5, 1, 18]),
    ], [{"history": None, "tokens": [99092], "input": "tokens", "position": 0, "token": 99092}]))

    # DeepSeek-V4.1's engram_* keys; the rebuilt sizes equal
    # engram_num_embeddings (asserted above).
    v41_cfg = {
        "vocab_size": 129280, "hidden_size": 5120, "hc_mult": 4, "num_hidden_layers": 40,
        "rms_norm_eps": 1e-20,
        "engram_layer_ids": [1, 14], "engram_num_embeddings": [384006168, 384016682],
        "engram_max_ngram_size": 4, "engram_vocab_size": 16000000, "engram_n_heads": 8,
        "engram_head_dim": 256, "engram_pad_token_id": 2,
        "engram_compressed_vocab_size": 99092,
    }
    toks = pseudo_tokens(9, 20, 99092, specials=(2,), every=6)
    fixtures.append(engram_fixture("deepseek_v41", v41_cfg, "v41", None, [
        ("fresh", None, toks, [20]),
        ("chunked", None, toks, [7, 1, 1, 11]),
        ("carried_history", [5, 6, 7], toks[:6], [6]),
    ], [{"history": [0, 0, 99099], "tokens": [1], "input": "history", "position": 2,
         "token": 99099}]))

    # A small LongCat: EOS (2) inside, at a chunk edge, twice in a row, first.
    lc_cfg = {
        "vocab_size": 100, "hidden_size": 24, "eos_token_id": 2, "rms_norm_eps": 1e-5,
        "ngram_vocab_size_ratio": 3, "emb_neighbor_num": 4, "emb_split_num": 2,
    }
    toks = [2, 5, 9, 2, 2, 7, 99, 0, 3, 2, 8, 1, 2, 4, 6, 50, 51, 52, 2]
    rnd = pseudo_tokens(21, 30, 100, specials=(2,), every=4)
    fixtures.append(longcat_fixture("longcat_small", lc_cfg, [
        ("eos_everywhere", None, toks, [len(toks)]),
        ("chunked", None, toks, [4, 1, 6, 8]),
        ("random", None, rnd, [30]),
        ("random_chunked", None, rnd, [2, 2, 9, 17]),
        ("carried_history", [9, 2, 8], [7, 2, 6], [1, 2]),
    ], [{"history": None, "tokens": [1, 100], "input": "tokens", "position": 1, "token": 100}]))

    # LongCat-Flash-Lite's constants.
    lite_cfg = {
        "vocab_size": 131072, "hidden_size": 3072, "eos_token_id": 2, "rms_norm_eps": 1e-5,
        "ngram_vocab_size_ratio": 78, "emb_neighbor_num": 4, "emb_split_num": 4,
        "num_layers": 14,
    }
    toks = pseudo_tokens(5, 24, 131072, specials=(2,), every=5)
    fixtures.append(longcat_fixture("longcat_flash_lite", lite_cfg, [
        ("fresh", None, toks, [24]),
        ("chunked", None, toks, [3, 3, 18]),
    ], []))

    # LongCat-2.0 spelling with a fractional ratio: m = int(1.5 * 100) = 150.
    oe_cfg = {
        "vocab_size": 100, "hidden_size": 32, "eos_token_id": 1,
        "oe_vocab_size_ratio": 1.5, "oe_neighbor_num": 5, "oe_split_num": 2,
    }
    rnd = pseudo_tokens(8, 25, 100, specials=(1,), every=6)
    fixtures.append(longcat_fixture("longcat_oe", oe_cfg, [
        ("random", None, rnd, [25]),
        ("chunked", None, rnd, [4, 4, 17]),
    ], []))

    # DeepSeek-V4.1's look-back boundaries (document starts, masked tokens)
    # on the small Engram (with its token map) and on V4.1's constants.
    fixtures.append(boundaries_fixture("engram_boundaries_small", fixtures[0]))
    fixtures.append(boundaries_fixture("engram_boundaries_v41", fixtures[2]))

    for f in fixtures:
        # The boundary cases have their own format: a directory of their own.
        sub = "boundaries" if f["name"].startswith("engram_boundaries_") else ""
        os.makedirs(os.path.join(out_dir, sub), exist_ok=True)
        path = os.path.join(out_dir, sub, f["name"][len("engram_boundaries_"):] if sub
                            else f["name"]) + ".json"
        with open(path, "w") as fh:
            json.dump(f, fh, separators=(",", ":"))
            fh.write("\n")
        print("wrote", path)


if __name__ == "__main__":
    main()
