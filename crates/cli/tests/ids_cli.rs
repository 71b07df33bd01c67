//! `metrale-ple ids` end to end: the example of docs/SPEC.md §4 (Constant
//! derivation) prints the constants given there, config mode agrees with
//! flag mode, and bad
//! input exits with status 2 and a message naming what is wrong.

use std::path::PathBuf;
use std::process::{Command, Output};

use serde_json::Value;

const SPEC_FLAGS: [&str; 10] = [
    "--vocab-size",
    "151936",
    "--eos",
    "151645",
    "--ngram-size",
    "3",
    "--heads-per-ngram",
    "8",
    "--vocab-base",
    "20000000",
];

fn run(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_metrale-ple"))
        .arg("ids")
        .args(args)
        .output()
        .expect("run metrale-ple")
}

fn ok_json(args: &[&str]) -> Value {
    let out = run(args);
    assert!(
        out.status.success(),
        "status {:?}, stderr: {}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8(out.stdout).unwrap();
    assert_eq!(
        text.lines().count(),
        1,
        "one JSON object on one line: {text}"
    );
    serde_json::from_str(&text).unwrap()
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

fn nums(v: &Value) -> Vec<u64> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap())
        .collect()
}

fn with<'a>(extra: &[&'a str]) -> Vec<&'a str> {
    SPEC_FLAGS
        .iter()
        .copied()
        .chain(extra.iter().copied())
        .collect()
}

#[test]
fn spec_example_geometry() {
    let v = ok_json(&with(&["--tokens", "9707,11,151645,42"]));
    assert_eq!(
        nums(&v["multipliers"]),
        [15_411_308_609_579, 2_523_213_358_983, 11_275_943_025_685]
    );
    let sizes = nums(&v["head_vocab_sizes"]);
    assert_eq!(sizes.len(), 16);
    assert_eq!(sizes[..3], [20_000_003, 20_000_023, 20_000_033]);
    let offsets = nums(&v["head_offsets"]);
    assert_eq!(offsets[..2], [0, 20_000_003]);
    assert_eq!(v["padded_rows"].as_u64(), Some(320_001_536));
    let ids = v["ids"].as_array().unwrap();
    assert_eq!(ids.len(), 4);
    assert!(ids.iter().all(|r| r.as_array().unwrap().len() == 16));
    assert_eq!(nums(&v["history"]), [151_645, 42]);
    // 42 follows an EOS, so its n-grams start a new segment: the same ids
    // as 42 at the start of a sequence.
    let fresh = ok_json(&with(&["--tokens", "42"]));
    assert_eq!(ids[3], fresh["ids"][0]);
}

#[test]
fn default_history_is_eos_and_history_is_carried() {
    let a = ok_json(&with(&["--tokens", "5,6,7"]));
    let b = ok_json(&with(&["--tokens", "5,6,7", "--history", "151645,151645"]));
    assert_eq!(a, b);
    // Hash 5,6 then 7 with the printed history: same last row.
    let first = ok_json(&with(&["--tokens", "5,6"]));
    let hist = nums(&first["history"]);
    let h = format!("{},{}", hist[0], hist[1]);
    let second = ok_json(&with(&["--tokens", "7", "--history", &h]));
    assert_eq!(second["ids"][0], a["ids"][2]);
    assert_eq!(second["history"], a["history"]);
}

#[test]
fn config_mode_matches_flags() {
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR"));
    let path = dir.join("ids_cli_config.json");
    std::fs::write(
        &path,
        r#"{"vocab_size": 151936, "hidden_size": 2560, "hc_mult": 4, "rms_norm_eps": 1e-6,
            "eos_token_id": [151645, 151643], "ngram_size": 3, "heads_per_ngram": 8,
            "ngram_vocab_size_base": 20000000, "split_ngram_parts": 16,
            "ple_conv_kernel_size": 4, "ple_layer_ids": [2, 5], "unknown_field": true}"#,
    )
    .unwrap();
    let p = path.to_str().unwrap();
    let from_cfg = ok_json(&["--config", p, "--site", "1", "--tokens", "1,2,3"]);
    let from_flags = ok_json(&with(&["--site", "1", "--tokens", "1,2,3"]));
    assert_eq!(from_cfg, from_flags);
    fails_with(
        &["--config", p, "--site", "2", "--tokens", "1"],
        "site 2 does not exist",
    );

    let bad = dir.join("ids_cli_bad_config.json");
    std::fs::write(&bad, r#"{"vocab_size": 151936}"#).unwrap();
    let b = bad.to_str().unwrap();
    fails_with(
        &["--config", b, "--tokens", "1"],
        "missing required field `eos_token_id`",
    );
    fails_with(&["--config", b, "--tokens", "1"], "ids_cli_bad_config.json");
    fails_with(
        &["--config", "/nonexistent/config.json", "--tokens", "1"],
        "/nonexistent/config.json",
    );
}

#[test]
fn bad_input_exits_2_with_a_clear_message() {
    fails_with(&with(&["--tokens", "1,x,3"]), "item \"x\" at position 1");
    fails_with(&with(&["--tokens", "1,,3"]), "position 1 is empty");
    fails_with(
        &with(&["--tokens", "1,151936"]),
        "token 151936 at position 1 is not below vocab_size 151936",
    );
    fails_with(
        &with(&["--tokens", "1", "--history", "5"]),
        "1 tokens given, context_len (ngram_size - 1) is 2",
    );
    fails_with(
        &with(&["--tokens", "1", "--history", "5,-2"]),
        "--history: item \"-2\" at position 1",
    );
    fails_with(&with(&["--tokens", ""]), "no tokens given");
    fails_with(&["--tokens", "1"], "--vocab-size");
    fails_with(&["--vocab-size", "x", "--tokens", "1"], "--vocab-size");
    fails_with(
        &["--config", "c.json", "--vocab-size", "5", "--tokens", "1"],
        "cannot be used with",
    );
    let mut n1 = with(&["--tokens", "1"]);
    n1[5] = "1";
    fails_with(&n1, "ngram_size must be in 2..=32, got 1");
    let mut k0 = with(&["--tokens", "1"]);
    k0[7] = "0";
    fails_with(&k0, "heads_per_ngram must be at least 1");
    fails_with(
        &with(&["--tokens", "1", "--divisible-by", "0"]),
        "divisible_by must be at least 1",
    );
}

/// A family fixture of `fixtures/families/`.
fn family_fixture(name: &str) -> Value {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../fixtures/families")
        .join(name);
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

fn join(v: &Value) -> String {
    nums(v)
        .iter()
        .map(u64::to_string)
        .collect::<Vec<_>>()
        .join(",")
}

/// Every case of a family fixture on one site, through `--config`
/// (`--layer` naming the site), `--token-map` and `--history`.
fn family_cases_match(name: &str) {
    let doc = family_fixture(name);
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("config.json");
    std::fs::write(&config, doc["config"].to_string()).unwrap();
    let map = dir.path().join("map.json");
    std::fs::write(&map, doc["token_map"].to_string()).unwrap();
    let config = config.to_str().unwrap();
    let map = map.to_str().unwrap();
    for c in doc["cases"].as_array().unwrap() {
        let site = &doc["sites"][c["site"].as_u64().unwrap() as usize];
        let layer = site["layer"].to_string();
        let tokens = join(&c["tokens"]);
        let history = (!c["history"].is_null()).then(|| join(&c["history"]));
        let mut args = vec!["--config", config, "--layer", &layer, "--tokens", &tokens];
        if let Some(h) = &history {
            args.extend(["--history", h]);
        }
        if !doc["token_map"].is_null() {
            args.extend(["--token-map", map]);
        }
        let v = ok_json(&args);
        assert_eq!(v["family"], doc["family"], "{name}");
        assert_eq!(v["ids"], c["ids"], "{name} {}", c["name"]);
        assert_eq!(v["history"], c["history_after"], "{name} {}", c["name"]);
        for key in [
            "multipliers",
            "head_vocab_sizes",
            "head_offsets",
            "padded_rows",
        ] {
            assert_eq!(v[key], site[key], "{name}: {key}");
        }
    }
}

#[test]
fn family_configs_hash_like_the_reference() {
    for name in [
        "engram_small.json",
        "deepseek_v41.json",
        "longcat_small.json",
        "longcat_oe.json",
    ] {
        family_cases_match(name);
    }
}

#[test]
fn family_refusals_exit_2_naming_what_is_wrong() {
    let doc = family_fixture("deepseek_v41.json");
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("config.json");
    std::fs::write(&config, doc["config"].to_string()).unwrap();
    let config = config.to_str().unwrap();
    fails_with(
        &["--config", config, "--tokens", "1,99092"],
        "tokens[1] = 99092",
    );
    fails_with(
        &["--config", config, "--layer", "2", "--tokens", "1"],
        "no site on that layer",
    );
    let map = dir.path().join("map.json");
    std::fs::write(&map, "[0, 1, 2]").unwrap();
    fails_with(
        &[
            "--config",
            config,
            "--token-map",
            map.to_str().unwrap(),
            "--tokens",
            "1",
        ],
        "engram_compressed_vocab_size",
    );
    let mut bad = doc["config"].clone();
    bad["engram_num_embeddings"] = serde_json::json!([1, 2]);
    std::fs::write(dir.path().join("bad.json"), bad.to_string()).unwrap();
    fails_with(
        &[
            "--config",
            dir.path().join("bad.json").to_str().unwrap(),
            "--tokens",
            "1",
        ],
        "engram_num_embeddings[0]",
    );
}
