//! The golden fixtures in `fixtures/ids/`, written by
//! `reference/make_fixtures.py` from the independent numpy reference, must
//! be reproduced exactly: the derived constants, every chunk's ids through
//! the fast path, the plain `%` form and the seed's `ple_ngram_ids`, and
//! the carried history.

use std::path::PathBuf;

use metrale_model_layers::layers::ple::ids::{
    PleHashParams, PleIdHasher, check_stored_buffers, ple_ngram_ids, ple_ngram_ids_into_plain,
};
use metrale_testkit::fixtures::{fixtures_dir, u32s, u64s};
use serde_json::Value;

const FIXTURES: [&str; 5] = [
    "flagship_site0.json",
    "flagship_site1.json",
    "small_n4_k2.json",
    "small_n2_k3.json",
    "small_n5_k1.json",
];

fn fixture_dir() -> PathBuf {
    fixtures_dir("ids")
}

fn params(p: &Value) -> PleHashParams {
    let n = |k: &str| p[k].as_u64().unwrap_or_else(|| panic!("params.{k}"));
    PleHashParams {
        vocab_size: n("vocab_size"),
        eos_token_id: n("eos_token_id") as u32,
        ngram_size: n("ngram_size") as usize,
        heads_per_ngram: n("heads_per_ngram") as usize,
        ngram_vocab_size_base: n("ngram_vocab_size_base"),
        divisible_by: n("divisible_by"),
        seed: n("seed"),
        site: n("site") as usize,
    }
}

fn check_fixture(name: &str) -> usize {
    let path = fixture_dir().join(name);
    let text = std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("cannot read {}: {e}", path.display()));
    let doc: Value = serde_json::from_str(&text).unwrap();

    let derived = params(&doc["params"]).derive().unwrap();
    let want = &doc["derived"];
    let dims = &derived.dims;
    assert_eq!(
        dims.multipliers,
        u64s(&want["multipliers"]),
        "{name}: multipliers"
    );
    assert_eq!(
        dims.head_vocab_sizes,
        u64s(&want["head_vocab_sizes"]),
        "{name}: sizes"
    );
    assert_eq!(
        dims.head_offsets,
        u64s(&want["head_offsets"]),
        "{name}: offsets"
    );
    assert_eq!(
        derived.padded_rows,
        want["padded_rows"].as_u64().unwrap(),
        "{name}: padded"
    );
    let as_i64 = |v: &[u64]| v.iter().map(|&x| x as i64).collect::<Vec<_>>();
    check_stored_buffers(
        dims,
        &as_i64(&u64s(&want["multipliers"])),
        &as_i64(&u64s(&want["head_vocab_sizes"])),
        &as_i64(&u64s(&want["head_offsets"])),
    )
    .unwrap();

    let hasher = PleIdHasher::new(dims).unwrap();
    let portable = PleIdHasher::new_portable(dims).unwrap();
    let heads = dims.ngram_heads();
    let mut rows_checked = 0;
    for case in doc["cases"].as_array().unwrap() {
        let cname = format!("{name}/{}", case["name"].as_str().unwrap());
        let mut history = u32s(&case["history"]);
        let mut window = history.clone();
        let chunks = case["chunks"].as_array().unwrap();
        assert!(!chunks.is_empty(), "{cname}: no chunks");
        for (c, chunk) in chunks.iter().enumerate() {
            let tokens = u32s(chunk);
            let want: Vec<u64> = case["ids"][c]
                .as_array()
                .unwrap()
                .iter()
                .flat_map(|row| {
                    let row = u64s(row);
                    assert_eq!(row.len(), heads, "{cname}: row width");
                    row
                })
                .collect();
            assert_eq!(want.len(), tokens.len() * heads, "{cname}: chunk {c} rows");

            let mut fast = vec![0u64; want.len()];
            hasher
                .ids_with_history_into(&history, &tokens, &mut fast)
                .unwrap();
            assert_eq!(
                fast,
                want,
                "{cname}: chunk {c}, fast path ({})",
                hasher.path()
            );
            portable
                .ids_with_history_into(&history, &tokens, &mut fast)
                .unwrap();
            assert_eq!(fast, want, "{cname}: chunk {c}, scalar path");
            let mut plain = vec![0u64; want.len()];
            ple_ngram_ids_into_plain(dims, &history, &tokens, &mut plain).unwrap();
            assert_eq!(plain, want, "{cname}: chunk {c}, plain form");
            let mut hw = history.clone();
            hw.extend_from_slice(&tokens);
            let seed_form: Vec<u64> = ple_ngram_ids(dims, &hw)[history.len()..].concat();
            assert_eq!(seed_form, want, "{cname}: chunk {c}, ple_ngram_ids");

            dims.advance_history(&mut history, &tokens);
            assert_eq!(
                history,
                u32s(&case["histories"][c]),
                "{cname}: history after chunk {c}"
            );
            window.extend_from_slice(&tokens);
            rows_checked += tokens.len();
        }
        // The whole window at once: its tail rows are the concatenated chunks.
        let all: Vec<u64> = case["ids"]
            .as_array()
            .unwrap()
            .iter()
            .flat_map(|c| c.as_array().unwrap().iter().flat_map(u64s))
            .collect();
        let start = u32s(&case["history"]).len();
        assert_eq!(
            ple_ngram_ids(dims, &window)[start..].concat(),
            all,
            "{cname}: whole"
        );
    }
    rows_checked
}

#[test]
fn fixtures_are_reproduced_exactly() {
    let mut total = 0;
    for name in FIXTURES {
        let rows = check_fixture(name);
        assert!(rows > 0, "{name}: no rows checked");
        total += rows;
    }
    assert!(total >= 50, "only {total} rows checked");
}

#[test]
fn every_fixture_file_is_listed() {
    let mut on_disk: Vec<String> = std::fs::read_dir(fixture_dir())
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .filter(|n| n.ends_with(".json"))
        .collect();
    on_disk.sort();
    let mut listed: Vec<String> = FIXTURES.iter().map(|s| s.to_string()).collect();
    listed.sort();
    assert_eq!(on_disk, listed);
}
