//! The golden fixtures in `fixtures/families/`, written by
//! `reference/families_reference.py` from an independent numpy reference,
//! must be reproduced exactly for the Engram and LongCat families: the
//! config parses into the right family, every site's constants (the
//! DeepSeek-V4.1 sizes equal `engram_num_embeddings`), every case's ids
//! whole, chunk by chunk with the history carried, token by token through
//! batched decode and through the plain `%` form, the history after, and
//! the refusal of out-of-vocabulary tokens naming input, position and value.

use metrale_model_layers::layers::ple::ids::{
    HashFamily, IdError, PleIdHasher, TokenMap, family_ids_into_plain,
};
use metrale_model_layers::layers::ple::spec::{ModelSpec, SpecError};
use metrale_testkit::fixtures::{fixtures_dir, read_json, u32s, u64s};
use serde_json::Value;

const FIXTURES: [&str; 6] = [
    "engram_small.json",
    "engram_demo.json",
    "deepseek_v41.json",
    "longcat_small.json",
    "longcat_flash_lite.json",
    "longcat_oe.json",
];

fn fixture(name: &str) -> Value {
    read_json("families", name)
}

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

fn check(name: &str) -> usize {
    let doc = fixture(name);
    let spec = spec_of(&doc);
    let family = doc["family"].as_str().unwrap();
    assert_eq!(spec.family.name(), family, "{name}");
    let back = ModelSpec::from_json_str(&spec.to_config_json(), "back").unwrap();
    let mut back = match spec.family.family().token_map() {
        Some(m) => back.with_token_map(m.clone(), "map").unwrap(),
        None => back,
    };
    back.rms_norm_eps = spec.rms_norm_eps;
    assert_eq!(back, spec, "{name}: config.json round trip");

    let sites: Vec<_> = (0..spec.sites())
        .map(|s| {
            let want = &doc["sites"][s];
            let d = spec.derive(s).unwrap();
            assert_eq!(spec.site_layer(s) as u64, want["layer"].as_u64().unwrap());
            assert_eq!(
                d.dims.multipliers,
                u64s(&want["multipliers"]),
                "{name} site {s}"
            );
            assert_eq!(
                d.dims.head_vocab_sizes,
                u64s(&want["head_vocab_sizes"]),
                "{name} site {s}"
            );
            assert_eq!(d.dims.head_offsets, u64s(&want["head_offsets"]));
            assert_eq!(d.padded_rows, want["padded_rows"].as_u64().unwrap());
            let site = spec.site(s).unwrap();
            assert_eq!(site.family, spec.hash_family());
            // The layer of these families is built from the same spec, with
            // the family's combination.
            site.validate().unwrap_or_else(|e| panic!("{name}: {e}"));
            assert_eq!(site.combine, spec.combine(), "{name}");
            assert_eq!(site.dims.family, site.family, "{name}");
            site
        })
        .collect();

    let mut checked = 0;
    for c in doc["cases"].as_array().unwrap() {
        let site = &sites[c["site"].as_u64().unwrap() as usize];
        let label = format!("{name}/{}/site {}", c["name"], c["site"]);
        let dims = &site.dims;
        let heads = dims.ngram_heads();
        let fill = vec![dims.eos_token_id; dims.context_len()];
        let hist = if c["history"].is_null() {
            fill.clone()
        } else {
            u32s(&c["history"])
        };
        let tokens = u32s(&c["tokens"]);
        let want: Vec<u64> = c["ids"].as_array().unwrap().iter().flat_map(u64s).collect();
        let h = PleIdHasher::with_family(&site.family, dims).unwrap();
        // Engram reduces its heads four at a time where the CPU has AVX2;
        // LongCat's kernel is scalar.
        if matches!(site.family, HashFamily::LongCat { .. }) {
            assert_eq!(h.path(), "scalar");
        }
        let portable = PleIdHasher::new_portable(dims).unwrap();
        assert_eq!(portable.path(), "scalar");

        // Whole, with the given history and, for a fresh case, with none.
        let mut got = vec![0u64; tokens.len() * heads];
        h.ids_with_history_into(&hist, &tokens, &mut got).unwrap();
        assert_eq!(got, want, "{label}: whole ({} path)", h.path());
        portable
            .ids_with_history_into(&hist, &tokens, &mut got)
            .unwrap();
        assert_eq!(got, want, "{label}: whole (portable path)");
        if c["history"].is_null() {
            h.ids_into(&tokens, &mut got).unwrap();
            assert_eq!(got, want, "{label}: empty history");
        }
        let mut plain = vec![0u64; got.len()];
        family_ids_into_plain(&site.family, dims, &hist, &tokens, &mut plain).unwrap();
        assert_eq!(plain, want, "{label}: plain");

        // Chunk by chunk, the history carried.
        let mut history = hist.clone();
        let mut at = 0;
        for n in u64s(&c["chunks"]) {
            let chunk = &tokens[at..at + n as usize];
            let mut out = vec![0u64; chunk.len() * heads];
            h.ids_with_history_into(&history, chunk, &mut out).unwrap();
            assert_eq!(
                out,
                want[at * heads..(at + chunk.len()) * heads],
                "{label}: chunk at {at}"
            );
            dims.advance_history(&mut history, chunk);
            at += chunk.len();
        }
        assert_eq!(history, u32s(&c["history_after"]), "{label}: history after");

        // Token by token as batched decode (all positions in one batch).
        let mut histories = Vec::new();
        let mut hcur = hist.clone();
        for &t in &tokens {
            histories.push(hcur.clone());
            dims.advance_history(&mut hcur, &[t]);
        }
        let mut out = vec![0u64; got.len()];
        h.decode_batch_into(&histories, &tokens, &mut out).unwrap();
        assert_eq!(out, want, "{label}: decode batch");
        let flat: Vec<u32> = histories.concat();
        h.decode_batch_flat_into(&flat, &tokens, &mut out).unwrap();
        assert_eq!(out, want, "{label}: decode batch flat");
        checked += tokens.len();
    }

    for o in doc["oov"].as_array().unwrap() {
        let site = &sites[0];
        let dims = &site.dims;
        let h = PleIdHasher::with_family(&site.family, dims).unwrap();
        let hist = if o["history"].is_null() {
            vec![dims.eos_token_id; dims.context_len()]
        } else {
            u32s(&o["history"])
        };
        let tokens = u32s(&o["tokens"]);
        let mut out = vec![7u64; tokens.len() * dims.ngram_heads()];
        let want_input = o["input"].as_str().unwrap();
        let want_pos = o["position"].as_u64().unwrap() as usize;
        let want_tok = o["token"].as_u64().unwrap() as u32;
        let e = h
            .ids_with_history_into(&hist, &tokens, &mut out)
            .unwrap_err();
        match &e {
            IdError::TokenOutOfRange {
                input,
                position,
                token,
                ..
            } => {
                assert_eq!(
                    (*input, *position, *token),
                    (want_input, want_pos, want_tok),
                    "{e}"
                );
            }
            other => panic!("{name}: expected TokenOutOfRange, got {other}"),
        }
        assert!(
            out.iter().all(|&v| v == 7),
            "{name}: a refusal writes nothing"
        );
        let e = family_ids_into_plain(&site.family, dims, &hist, &tokens, &mut out).unwrap_err();
        assert!(matches!(e, IdError::TokenOutOfRange { .. }), "{e}");
        let e = h
            .decode_batch_into(
                std::slice::from_ref(&hist),
                &tokens[..1],
                &mut out[..dims.ngram_heads()],
            )
            .err();
        if want_input == "history" || want_pos == 0 {
            assert!(matches!(e, Some(IdError::TokenOutOfRange { .. })), "{e:?}");
        }
    }
    checked
}

#[test]
fn engram_small_with_token_map() {
    assert!(check("engram_small.json") > 0);
}

#[test]
fn engram_demo_constants() {
    assert!(check("engram_demo.json") > 0);
}

#[test]
fn deepseek_v41_sizes_equal_num_embeddings() {
    assert!(check("deepseek_v41.json") > 0);
}

#[test]
fn longcat_segments_and_chunks() {
    assert!(check("longcat_small.json") > 0);
    assert!(check("longcat_oe.json") > 0);
}

#[test]
fn longcat_flash_lite_constants() {
    assert!(check("longcat_flash_lite.json") > 0);
}

#[test]
fn every_fixture_is_listed() {
    let dir = fixtures_dir("families");
    let mut found: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.ends_with(".json"))
        .collect();
    found.sort();
    let mut listed: Vec<String> = FIXTURES.iter().map(|s| s.to_string()).collect();
    listed.sort();
    assert_eq!(found, listed);
}

#[test]
fn families_are_told_apart_and_inconsistent_configs_named() {
    let v41 = fixture("deepseek_v41.json")["config"].clone();
    let mut bad = v41.clone();
    bad["engram_num_embeddings"] = serde_json::json!([384006168, 384016683]);
    let e = ModelSpec::from_json_str(&bad.to_string(), "v41.json").unwrap_err();
    let msg = e.to_string();
    assert!(
        matches!(&e, SpecError::Field { field, .. } if field == "engram_num_embeddings[1]"),
        "{msg}"
    );
    assert!(
        msg.contains("384016682") && msg.contains("v41.json"),
        "{msg}"
    );

    let mut both = v41.clone();
    both["ngram_vocab_size_ratio"] = serde_json::json!(78);
    let e = ModelSpec::from_json_str(&both.to_string(), "c.json").unwrap_err();
    assert!(
        matches!(&e, SpecError::Field { field, .. } if field == "ngram_vocab_size_ratio"),
        "{e}"
    );

    let mut short = fixture("engram_small.json")["config"].clone();
    short["engram_vocab_size"] = serde_json::json!([31]);
    let e = ModelSpec::from_json_str(&short.to_string(), "c.json").unwrap_err();
    assert!(e.to_string().contains("engram_vocab_size"), "{e}");

    let mut lc = fixture("longcat_small.json")["config"].clone();
    lc["hidden_size"] = serde_json::json!(25);
    let e = ModelSpec::from_json_str(&lc.to_string(), "c.json").unwrap_err();
    assert!(
        matches!(&e, SpecError::Field { field, .. } if field == "hidden_size"),
        "{e}"
    );
    let mut lc = fixture("longcat_small.json")["config"].clone();
    lc.as_object_mut().unwrap().remove("emb_split_num");
    let e = ModelSpec::from_json_str(&lc.to_string(), "c.json").unwrap_err();
    assert!(
        matches!(&e, SpecError::Missing { field, .. } if field == "emb_split_num"),
        "{e}"
    );

    // A token map that does not fit the compressed vocabulary is named.
    let small = fixture("engram_small.json");
    let spec = ModelSpec::from_json_str(&small["config"].to_string(), "c.json").unwrap();
    let e = spec
        .clone()
        .with_token_map(vec![0u32, 1, 2].into(), "map.json")
        .unwrap_err();
    assert!(
        matches!(&e, SpecError::TokenMap { .. }) && e.to_string().contains("map.json"),
        "{e}"
    );
    // Qwen4Exp hashes never take a map.
    assert_eq!(HashFamily::default(), HashFamily::Qwen4Exp);
}

/// `n` tokens below `limit` from a 64-bit LCG seeded with `seed`.
fn random_tokens(n: usize, limit: u64, seed: u64) -> Vec<u32> {
    let mut x = seed;
    (0..n)
        .map(|_| {
            x = x
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((x >> 33) % limit) as u32
        })
        .collect()
}

/// Engram's AVX2 head reduction gives the portable path's ids over long
/// random streams (tokens anywhere below the family's bound, so the mixed
/// values span the whole `u64` range), whole, chunked and batched.
#[test]
fn engram_fast_path_equals_the_portable_one() {
    for file in ["engram_demo.json", "deepseek_v41.json"] {
        let spec = spec_of(&fixture(file));
        for s in 0..spec.sites() {
            let site = spec.site(s).unwrap();
            let fast = PleIdHasher::with_family(&site.family, &site.dims).unwrap();
            let portable = PleIdHasher::new_portable(&site.dims).unwrap();
            let limit = site.family.token_limit().unwrap_or(spec.vocab_size);
            let tokens = random_tokens(4000, limit, 0x9E37_79B9_7F4A_7C15 ^ s as u64);
            let heads = site.ngram_heads();
            let (mut a, mut b) = (
                vec![0u64; tokens.len() * heads],
                vec![0u64; tokens.len() * heads],
            );
            fast.ids_into(&tokens, &mut a).unwrap();
            portable.ids_into(&tokens, &mut b).unwrap();
            assert_eq!(a, b, "{file} site {s} ({} path)", fast.path());
            let hist = &tokens[..5];
            let (mut a, mut b) = (vec![0u64; 100 * heads], vec![0u64; 100 * heads]);
            fast.ids_with_history_into(hist, &tokens[5..105], &mut a)
                .unwrap();
            portable
                .ids_with_history_into(hist, &tokens[5..105], &mut b)
                .unwrap();
            assert_eq!(a, b, "{file} site {s}: with history");
            let histories: Vec<&[u32]> = (0..64).map(|i| &tokens[i..i + 3]).collect();
            let (mut a, mut b) = (vec![0u64; 64 * heads], vec![0u64; 64 * heads]);
            fast.decode_batch_into(&histories, &tokens[100..164], &mut a)
                .unwrap();
            portable
                .decode_batch_into(&histories, &tokens[100..164], &mut b)
                .unwrap();
            assert_eq!(a, b, "{file} site {s}: batched");
        }
    }
}

/// Hash throughput per family, printed (run with `cargo test --release -p
/// metrale-model-layers --test family_ids -- --ignored --nocapture`).
#[test]
#[ignore = "a measurement, not a check"]
fn family_hash_throughput() {
    use std::time::Instant;
    let qwen = ModelSpec::from_json_str(
        r#"{"vocab_size": 151936, "hidden_size": 2560, "hc_mult": 4, "rms_norm_eps": 1e-6,
            "eos_token_id": 151645, "ngram_size": 3, "heads_per_ngram": 8,
            "ngram_vocab_size_base": 20000000, "split_ngram_parts": 16,
            "ple_conv_kernel_size": 4, "ple_layer_ids": [2]}"#,
        "flagship",
    )
    .unwrap();
    let specs = [
        ("qwen4exp flagship", qwen),
        ("engram demo", spec_of(&fixture("engram_demo.json"))),
        ("deepseek-v4.1", spec_of(&fixture("deepseek_v41.json"))),
        (
            "longcat-flash-lite",
            spec_of(&fixture("longcat_flash_lite.json")),
        ),
    ];
    for (name, spec) in specs {
        let site = spec.site(0).unwrap();
        let h = PleIdHasher::with_family(&site.family, &site.dims).unwrap();
        let limit = site.family.token_limit().unwrap_or(spec.vocab_size);
        let tokens = random_tokens(1 << 20, limit, 1);
        let mut out = vec![0u64; tokens.len() * site.ngram_heads()];
        // The path this CPU picks and the portable one, in turns.
        let portable = PleIdHasher::new_portable(&site.dims).unwrap();
        for h in [&h, &portable, &h, &portable] {
            h.ids_into(&tokens, &mut out).unwrap();
            let t0 = Instant::now();
            let reps = 5;
            for _ in 0..reps {
                h.ids_into(&tokens, &mut out).unwrap();
            }
            let s = t0.elapsed().as_secs_f64() / reps as f64;
            println!(
                "{name:20} path {:6} {:3} ids/token: {:7.1} M tokens/s, {:7.1} M ids/s",
                h.path(),
                site.ngram_heads(),
                tokens.len() as f64 / s / 1e6,
                out.len() as f64 / s / 1e6
            );
        }
    }
}

/// A LongCat row base that is not a multiple of the vocabulary survives
/// the config.json round trip exactly (found by reasoning about the
/// `family_config` fuzz target: the ratio written back is inexact).
#[test]
fn longcat_fractional_row_base_round_trips() {
    for (vocab, ratio) in [(3u64, 0.5f64), (7, 0.3), (131_072, 100.567), (100, 1.5)] {
        let text = serde_json::json!({
            "vocab_size": vocab, "hidden_size": 12, "eos_token_id": 0,
            "oe_vocab_size_ratio": ratio, "oe_neighbor_num": 4, "oe_split_num": 2,
        })
        .to_string();
        let spec = ModelSpec::from_json_str(&text, "c.json").unwrap();
        assert_eq!(spec.ngram_vocab_size_base, (ratio * vocab as f64) as u64);
        let back = ModelSpec::from_json_str(&spec.to_config_json(), "back.json").unwrap();
        assert_eq!(back, spec, "vocab {vocab} ratio {ratio}");
    }
}

/// A multimodal config with the Engram keys under `text_config` parses
/// like the flat one.
#[test]
fn nested_text_config_parses_like_flat() {
    let flat = fixture("deepseek_v41.json")["config"].clone();
    let nested = serde_json::json!({
        "architectures": ["DeepseekV41ForConditionalGeneration"],
        "text_config": flat.clone(),
    });
    let a = ModelSpec::from_json_str(&flat.to_string(), "flat").unwrap();
    let b = ModelSpec::from_json_str(&nested.to_string(), "nested").unwrap();
    assert_eq!(a, b);
}
