//! `metrale-ple token-map` and the Engram flags of `metrale-ple ids` end
//! to end: the map built from each tokenizer of `fixtures/token_map/`
//! equals the Python reference's, `ids --tokenizer` hashes like `ids
//! --token-map` with that map, `--doc-starts`/`--masked` reproduce the
//! look-back boundary fixtures, and bad input exits 2 naming what is
//! wrong.

use std::path::PathBuf;
use std::process::{Command, Output};

use serde_json::Value;

fn fixtures(sub: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../fixtures")
        .join(sub)
}

fn read(path: &std::path::Path) -> Value {
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

fn run(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_metrale-ple"))
        .args(args)
        .output()
        .expect("run metrale-ple")
}

fn ok_json(args: &[&str]) -> Value {
    let out = run(args);
    assert!(
        out.status.success(),
        "args {args:?}: status {:?}, stderr: {}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap()
}

fn fails_with(args: &[&str], want: &str) {
    let out = run(args);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "args {args:?}: stderr {err}");
    assert!(
        err.contains(want),
        "args {args:?}: {err:?} should contain {want:?}"
    );
    assert!(out.stdout.is_empty(), "nothing on stdout on error");
}

fn join(v: &Value) -> String {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap().to_string())
        .collect::<Vec<_>>()
        .join(",")
}

#[test]
fn token_map_matches_the_reference() {
    let dir = tempfile::tempdir().unwrap();
    for name in ["byte_level_bpe", "llama_style_bpe", "unigram_metaspace"] {
        let want = read(&fixtures("token_map").join(format!("{name}.expected.json")));
        let tok = fixtures("token_map").join(want["tokenizer"].as_str().unwrap());
        let tok = tok.to_str().unwrap();
        // To stdout: the array alone.
        let printed = ok_json(&["token-map", tok]);
        assert_eq!(printed, want["map"], "{name}");
        // To a file: the array there, a summary on stdout.
        let out = dir.path().join(format!("{name}.map.json"));
        let summary = ok_json(&["token-map", tok, "-o", out.to_str().unwrap()]);
        assert_eq!(read(&out), want["map"], "{name}");
        assert_eq!(
            summary["compressed_vocab_size"], want["compressed_vocab_size"],
            "{name}"
        );
        assert_eq!(summary["raw_vocab_size"], want["raw_vocab_size"], "{name}");
    }
    fails_with(
        &["token-map", "/nonexistent/tokenizer.json"],
        "/nonexistent/tokenizer.json",
    );
    let bad = dir.path().join("bad.json");
    std::fs::write(
        &bad,
        r#"{"model":{"type":"WordLevel","vocab":{"a":0},"unk_token":"a"},"decoder":{"type":"Nope"}}"#,
    )
    .unwrap();
    fails_with(&["token-map", bad.to_str().unwrap()], "bad.json");
}

/// `--tokenizer` builds the same map `--token-map` reads.
#[test]
fn ids_with_a_tokenizer_equals_ids_with_its_map() {
    let dir = tempfile::tempdir().unwrap();
    let want = read(&fixtures("token_map").join("byte_level_bpe.expected.json"));
    let tok = fixtures("token_map").join("byte_level_bpe.tokenizer.json");
    let config = serde_json::json!({
        "vocab_size": want["raw_vocab_size"], "hidden_size": 32,
        "engram_vocab_size": [101, 103], "max_ngram_size": 3, "n_embed_per_ngram": 32,
        "n_head_per_ngram": 2, "layer_ids": [1], "pad_id": 2, "seed": 0,
        "compressed_vocab_size": want["compressed_vocab_size"],
    });
    let cfg = dir.path().join("config.json");
    std::fs::write(&cfg, config.to_string()).unwrap();
    let map = dir.path().join("map.json");
    std::fs::write(&map, want["map"].to_string()).unwrap();
    let cfg = cfg.to_str().unwrap();
    let toks = "72,40,41,300,301,302,5";
    let a = ok_json(&[
        "ids",
        "--config",
        cfg,
        "--tokenizer",
        tok.to_str().unwrap(),
        "--tokens",
        toks,
    ]);
    let b = ok_json(&[
        "ids",
        "--config",
        cfg,
        "--token-map",
        map.to_str().unwrap(),
        "--tokens",
        toks,
    ]);
    assert_eq!(a, b);
    let c = ok_json(&["ids", "--config", cfg, "--tokens", toks]);
    assert_ne!(a["ids"], c["ids"], "the map changes the ids");
}

/// The look-back boundary fixtures through `--doc-starts` and `--masked`
/// (cases whose flags are all on the tokens, with the history given).
#[test]
fn ids_with_boundaries_match_the_reference() {
    let doc = read(&fixtures("families/boundaries").join("small.json"));
    let dir = tempfile::tempdir().unwrap();
    let cfg = dir.path().join("config.json");
    std::fs::write(&cfg, doc["config"].to_string()).unwrap();
    let map = dir.path().join("map.json");
    std::fs::write(&map, doc["token_map"].to_string()).unwrap();
    let (cfg, map) = (cfg.to_str().unwrap(), map.to_str().unwrap());
    let mut checked = 0;
    for c in doc["cases"].as_array().unwrap() {
        let on_history = !c["history_doc_starts"].as_array().unwrap().is_empty()
            || !c["history_masked"].as_array().unwrap().is_empty();
        if on_history {
            continue;
        }
        let site = &doc["sites"][c["site"].as_u64().unwrap() as usize];
        let layer = site["layer"].to_string();
        let tokens = join(&c["tokens"]);
        let mut args = vec![
            "ids",
            "--config",
            cfg,
            "--layer",
            &layer,
            "--token-map",
            map,
        ];
        args.extend(["--tokens", &tokens]);
        let history = (!c["history"].is_null()).then(|| join(&c["history"]));
        if let Some(h) = &history {
            args.extend(["--history", h]);
        }
        let ds = join(&c["doc_starts"]);
        let ms = join(&c["masked"]);
        if !ds.is_empty() {
            args.extend(["--doc-starts", &ds]);
        }
        if !ms.is_empty() {
            args.extend(["--masked", &ms]);
        }
        let v = ok_json(&args);
        assert_eq!(v["ids"], c["ids"], "{}", c["name"]);
        checked += 1;
    }
    assert_eq!(checked, 14);

    fails_with(
        &[
            "ids",
            "--config",
            cfg,
            "--token-map",
            map,
            "--tokens",
            "1,2",
            "--masked",
            "2",
        ],
        "position 2",
    );
    let qwen = dir.path().join("qwen.json");
    std::fs::write(
        &qwen,
        r#"{"vocab_size": 1000, "hidden_size": 64, "hc_mult": 1, "rms_norm_eps": 1e-6,
            "eos_token_id": 2, "ngram_size": 3, "heads_per_ngram": 2,
            "ngram_vocab_size_base": 5000, "split_ngram_parts": 1,
            "ple_conv_kernel_size": 4, "ple_layer_ids": [1]}"#,
    )
    .unwrap();
    fails_with(
        &[
            "ids",
            "--config",
            qwen.to_str().unwrap(),
            "--tokens",
            "1,2",
            "--doc-starts",
            "1",
        ],
        "Engram",
    );
}
