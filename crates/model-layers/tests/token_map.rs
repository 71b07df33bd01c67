//! Engram's compressed-token map built from a `tokenizer.json` (by the
//! `tokenizers` library) must equal the one
//! `reference/token_map_reference.py` builds with the Python `tokenizers`
//! package (its decoders) and `unicodedata` (the normaliser),
//! for the three tokenizers it trains: byte-level BPE with added and
//! special tokens, a Llama-style BPE with byte fallback and the
//! Replace/ByteFallback/Fuse/Strip decoder chain, and a Unigram with the
//! Metaspace decoder. The map also loads into an Engram spec whose
//! compressed vocabulary is the map's.

use metrale_model_layers::layers::ple::family::engram::{
    TokenizerJsonError, token_map_from_tokenizer_json, token_map_from_tokenizer_str,
};
use metrale_model_layers::layers::ple::ids::PleIdHasher;
use metrale_model_layers::layers::ple::spec::ModelSpec;
use metrale_testkit::fixtures::{fixtures_dir, read_json, u32s};
use serde_json::json;

const NAMES: [&str; 3] = ["byte_level_bpe", "llama_style_bpe", "unigram_metaspace"];

fn check(name: &str) {
    let want = read_json("token_map", &format!("{name}.expected.json"));
    let path = fixtures_dir("token_map").join(want["tokenizer"].as_str().unwrap());
    let got = token_map_from_tokenizer_json(&path).unwrap();
    let map = u32s(&want["map"]);
    assert_eq!(got.map.len(), map.len(), "{name}: raw vocabulary");
    for (t, (&g, &w)) in got.map.iter().zip(&map).enumerate() {
        assert_eq!(
            g,
            w,
            "{name}: raw id {t} maps to {g}, the reference to {w} (keys {:?} vs {:?})",
            got.keys.get(g as usize),
            want["keys"][w as usize]
        );
    }
    let keys: Vec<&str> = want["keys"]
        .as_array()
        .unwrap()
        .iter()
        .map(|k| k.as_str().unwrap())
        .collect();
    assert_eq!(got.keys, keys, "{name}: keys");
    assert_eq!(
        got.compressed_vocab_size(),
        want["compressed_vocab_size"].as_u64().unwrap()
    );
    // The map compresses, and the fixture exercises the U+FFFD rule where
    // the tokenizer has byte tokens.
    assert!(got.keys.len() < got.map.len(), "{name}");
}

#[test]
fn byte_level_bpe_matches_the_reference() {
    check(NAMES[0]);
    let want = read_json("token_map", "byte_level_bpe.expected.json");
    assert!(want["fffd_tokens"].as_u64().unwrap() > 100);
}

#[test]
fn llama_style_bpe_matches_the_reference() {
    check(NAMES[1]);
}

#[test]
fn unigram_metaspace_matches_the_reference() {
    check(NAMES[2]);
}

/// The built map goes into an Engram config stating its V' and hashes.
#[test]
fn built_map_serves_an_engram_spec() {
    let path = fixtures_dir("token_map").join("byte_level_bpe.tokenizer.json");
    let c = token_map_from_tokenizer_json(&path).unwrap();
    let config = json!({
        "vocab_size": c.map.len(), "hidden_size": 32,
        "engram_vocab_size": [101, 103], "max_ngram_size": 3, "n_embed_per_ngram": 32,
        "n_head_per_ngram": 2, "layer_ids": [1], "pad_id": 2, "seed": 0,
        "compressed_vocab_size": c.compressed_vocab_size(),
    });
    let spec = ModelSpec::from_json_str(&config.to_string(), "cfg")
        .unwrap()
        .with_token_map(c.map.clone(), "byte_level_bpe")
        .unwrap();
    let d = spec.derive(0).unwrap();
    let h = PleIdHasher::with_family(&spec.hash_family(), &d.dims).unwrap();
    let mut out = vec![0; 3 * h.ngram_heads()];
    h.ids_into(&[5, 6, 7], &mut out).unwrap();
    assert!(out.iter().all(|&id| id < d.padded_rows));

    // A V' that differs from the map's is refused.
    let mut bad = config.clone();
    bad["compressed_vocab_size"] = json!(c.compressed_vocab_size() + 1);
    let e = ModelSpec::from_json_str(&bad.to_string(), "cfg")
        .unwrap()
        .with_token_map(c.map.clone(), "byte_level_bpe")
        .unwrap_err();
    assert!(e.to_string().contains("byte_level_bpe"), "{e}");
}

#[test]
fn errors_name_file_and_field() {
    let e =
        token_map_from_tokenizer_json(std::path::Path::new("/nonexistent/tok.json")).unwrap_err();
    assert!(matches!(e, TokenizerJsonError::Read { .. }));
    assert!(e.to_string().contains("/nonexistent/tok.json"));
    let e = token_map_from_tokenizer_str(r#"{"model":{"vocab":[["a"]]}}"#, "t.json").unwrap_err();
    match &e {
        TokenizerJsonError::Json { file, .. } => assert_eq!(file, "t.json"),
        other => panic!("{other:?}"),
    }
    let e = token_map_from_tokenizer_str(
        r#"{"model":{"type":"WordLevel","vocab":{"a":0},"unk_token":"a"},"decoder":{"type":"Nope"}}"#,
        "t.json",
    )
    .unwrap_err();
    assert!(matches!(e, TokenizerJsonError::Json { .. }), "{e:?}");
    // The reader's message says where: an unknown decoder is at column 88.
    assert!(e.to_string().contains("line 1 column 88"), "{e}");
}
