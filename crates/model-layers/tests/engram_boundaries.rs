//! DeepSeek-V4.1's Engram look-back boundaries (document starts, masked
//! tokens) must reproduce `fixtures/families/boundaries/*.json`,
//! written by `reference/families_reference.py` from the description in
//! docs/SPEC.md §11: whole, and chunk by chunk with the history and its
//! flags carried; without flags they equal the plain Engram hash; bad
//! flag slices, another family and out-of-vocabulary tokens are refused
//! before anything is written.

use metrale_model_layers::layers::ple::ids::{
    Boundaries, HashFamily, IdError, PleIdDims, PleIdHasher, TokenMap, engram_ids_bounded_into,
};
use metrale_model_layers::layers::ple::spec::ModelSpec;
use metrale_testkit::fixtures::{read_json, u32s, u64s};
use serde_json::Value;

fn spec_of(doc: &Value) -> ModelSpec {
    let name = doc["name"].as_str().unwrap();
    let spec = ModelSpec::from_json_str(&doc["config"].to_string(), name).unwrap();
    match doc["token_map"].as_array() {
        Some(_) => {
            let map: TokenMap = u32s(&doc["token_map"]).into();
            spec.with_token_map(map, name).unwrap()
        }
        None => spec,
    }
}

fn positions(v: &Value, count: usize) -> Vec<bool> {
    let mut f = vec![false; count];
    for p in u64s(v) {
        f[p as usize] = true;
    }
    f
}

fn run(name: &str) -> usize {
    let doc = read_json("families/boundaries", name);
    let spec = spec_of(&doc);
    let family = spec.hash_family();
    let mut checked = 0;
    for case in doc["cases"].as_array().unwrap() {
        let cname = format!("{name}/{}", case["name"].as_str().unwrap());
        let site = case["site"].as_u64().unwrap() as usize;
        let d = spec.derive(site).unwrap();
        let dims: &PleIdDims = &d.dims;
        let c = dims.context_len();
        let heads = dims.ngram_heads();
        let hasher = PleIdHasher::with_family(&family, dims).unwrap();
        let history = match case["history"].as_array() {
            Some(_) => u32s(&case["history"]),
            None => vec![dims.eos_token_id; c],
        };
        let tokens = u32s(&case["tokens"]);
        let h = history.len();
        let mut doc_start = positions(&case["history_doc_starts"], h);
        doc_start.extend(positions(&case["doc_starts"], tokens.len()));
        let mut masked = positions(&case["history_masked"], h);
        masked.extend(positions(&case["masked"], tokens.len()));
        let want: Vec<u64> = case["ids"]
            .as_array()
            .unwrap()
            .iter()
            .flat_map(u64s)
            .collect();

        // Whole, through the free function and the hasher.
        let bounds = Boundaries {
            doc_start: &doc_start,
            masked: &masked,
        };
        let mut got = vec![0; tokens.len() * heads];
        engram_ids_bounded_into(&family, dims, &history, &tokens, bounds, &mut got).unwrap();
        assert_eq!(got, want, "{cname}: whole");
        let mut again = vec![0; got.len()];
        hasher
            .engram_ids_bounded_into(&history, &tokens, bounds, &mut again)
            .unwrap();
        assert_eq!(again, want, "{cname}: hasher");

        // Chunk by chunk: the history is the last context_len positions
        // before the chunk, with their flags.
        let seq: Vec<u32> = history.iter().chain(&tokens).copied().collect();
        let mut start = h;
        let mut chunked = Vec::with_capacity(want.len());
        for n in u64s(&case["chunks"]) {
            let end = start + n as usize;
            let from = start - c;
            let b = Boundaries {
                doc_start: &doc_start[from..end],
                masked: &masked[from..end],
            };
            let mut part = vec![0; (end - start) * heads];
            hasher
                .engram_ids_bounded_into(&seq[from..start], &seq[start..end], b, &mut part)
                .unwrap();
            chunked.extend(part);
            start = end;
        }
        assert_eq!(chunked, want, "{cname}: chunked");

        // No flags: the plain Engram hash.
        if !doc_start.contains(&true) && !masked.contains(&true) {
            let mut plain = vec![0; want.len()];
            hasher
                .ids_with_history_into(&history, &tokens, &mut plain)
                .unwrap();
            assert_eq!(plain, want, "{cname}: plain");
            let mut none = vec![0; want.len()];
            hasher
                .engram_ids_bounded_into(&history, &tokens, Boundaries::default(), &mut none)
                .unwrap();
            assert_eq!(none, want, "{cname}: empty flags");
        }
        checked += 1;
    }
    checked
}

#[test]
fn small_engram_with_a_token_map() {
    assert_eq!(run("small.json"), 18);
}

#[test]
fn deepseek_v41_constants() {
    assert_eq!(run("v41.json"), 18);
}

#[test]
fn refusals_write_nothing() {
    let doc = read_json("families/boundaries", "small.json");
    let spec = spec_of(&doc);
    let d = spec.derive(0).unwrap();
    let family = spec.hash_family();
    let heads = d.dims.ngram_heads();
    let hist = [2, 2];
    let toks = [1, 2, 3];
    let mut out = vec![7; toks.len() * heads];

    // Flags over the tokens only (3) instead of history ++ tokens (5).
    let short = [false; 3];
    let e = engram_ids_bounded_into(
        &family,
        &d.dims,
        &hist,
        &toks,
        Boundaries {
            doc_start: &short,
            masked: &[],
        },
        &mut out,
    )
    .unwrap_err();
    assert!(
        matches!(&e, IdError::Shape(m) if m.contains("doc_start")),
        "{e}"
    );

    let e = engram_ids_bounded_into(
        &HashFamily::Qwen4Exp,
        &d.dims,
        &hist,
        &toks,
        Boundaries::default(),
        &mut out,
    )
    .unwrap_err();
    assert!(matches!(e, IdError::Params(_)), "{e}");

    let oov = [1, 50, 3];
    let e = engram_ids_bounded_into(
        &family,
        &d.dims,
        &hist,
        &oov,
        Boundaries::default(),
        &mut out,
    )
    .unwrap_err();
    assert!(
        matches!(
            e,
            IdError::TokenOutOfRange {
                input: "tokens",
                position: 1,
                token: 50,
                ..
            }
        ),
        "{e}"
    );
    let mut wrong = vec![0; 1];
    assert!(matches!(
        engram_ids_bounded_into(
            &family,
            &d.dims,
            &hist,
            &toks,
            Boundaries::default(),
            &mut wrong
        ),
        Err(IdError::Shape(_))
    ));
    assert!(out.iter().all(|&v| v == 7));
}

/// A masked token changes exactly the ids whose n-grams reach it: its own
/// and the next `context_len` positions' (the transformers port's test).
#[test]
fn a_masked_token_reaches_context_len_positions() {
    let doc = read_json("families/boundaries", "v41.json");
    let spec = spec_of(&doc);
    let d = spec.derive(1).unwrap();
    let family = spec.hash_family();
    let c = d.dims.context_len();
    let heads = d.dims.ngram_heads();
    let toks: Vec<u32> = (0..12).map(|i| 100 + 37 * i).collect();
    let hist = vec![d.dims.eos_token_id; c];
    let mut plain = vec![0; toks.len() * heads];
    let mut masked_ids = plain.clone();
    engram_ids_bounded_into(
        &family,
        &d.dims,
        &hist,
        &toks,
        Boundaries::default(),
        &mut plain,
    )
    .unwrap();
    let mut masked = vec![false; c + toks.len()];
    masked[c + 5] = true;
    engram_ids_bounded_into(
        &family,
        &d.dims,
        &hist,
        &toks,
        Boundaries {
            doc_start: &[],
            masked: &masked,
        },
        &mut masked_ids,
    )
    .unwrap();
    for t in 0..toks.len() {
        let row = t * heads..(t + 1) * heads;
        let same = plain[row.clone()] == masked_ids[row];
        assert_eq!(same, !(5..=5 + c).contains(&t), "position {t}");
    }
}
