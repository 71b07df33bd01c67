//! Fuzz the Engram and LongCat config keys of docs/SPEC.md §11 (Families):
//! parsing, validation, the config.json round trip, site derivation and
//! hashing.
//!
//! Nothing may panic on any text. A spec that parses must validate again,
//! round-trip through its own config.json, and (for small head counts)
//! derive sites whose hasher agrees with the plain form, hashes chunked
//! input like whole input, keeps every id below the table's rows, and
//! refuses a token at the family's limit without writing anything.
#![no_main]

use libfuzzer_sys::fuzz_target;
use metrale_model_layers::layers::ple::ModelSpec;
use metrale_model_layers::layers::ple::ids::{PleIdHasher, family_ids_into_plain};
use metrale_model_layers::layers::ple::family::qwen4_exp::Qwen4Exp;

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else { return };
    let Ok(c) = ModelSpec::from_json_str(text, "fuzz/config.json") else { return };
    c.validate("fuzz/config.json").expect("a parsed spec validates");
    let mut back = ModelSpec::from_json_str(&c.to_config_json(), "fuzz/back.json")
        .expect("a spec's own config.json parses");
    // serde_json parses floats to within an ulp, not always exactly.
    let eps_err = (back.rms_norm_eps - c.rms_norm_eps).abs();
    assert!(eps_err <= c.rms_norm_eps * 1e-15);
    back.rms_norm_eps = c.rms_norm_eps;
    assert_eq!(back, c, "config.json round trip");
    if c.family.get::<Qwen4Exp>().is_some() || c.ngram_heads() > 64 || c.sites() > 4 {
        return;
    }
    let Ok(site) = c.site(0) else { return };
    let dims = &site.dims;
    let hasher = PleIdHasher::with_family(&site.family, dims).expect("a derived site hashes");
    let limit = site.family.token_limit().expect("families bound their tokens");
    // Tokens from the input bytes, all below the limit.
    let tokens: Vec<u32> = data
        .iter()
        .take(64)
        .map(|&b| (u64::from(b) * 2_654_435_761 % limit) as u32)
        .collect();
    let heads = dims.ngram_heads();
    let mut whole = vec![0u64; tokens.len() * heads];
    hasher.ids_into(&tokens, &mut whole).expect("in-vocabulary tokens hash");
    let mut plain = vec![0u64; whole.len()];
    family_ids_into_plain(&site.family, dims, &[], &tokens, &mut plain).unwrap();
    assert_eq!(whole, plain, "hasher and plain form");
    assert!(whole.iter().all(|&id| id < dims.table_rows()), "ids past the table");
    let mut history = vec![dims.eos_token_id; dims.context_len()];
    let mut at = 0;
    for chunk in tokens.chunks(3) {
        let mut out = vec![0u64; chunk.len() * heads];
        hasher.ids_with_history_into(&history, chunk, &mut out).unwrap();
        assert_eq!(out, whole[at * heads..(at + chunk.len()) * heads], "chunked");
        dims.advance_history(&mut history, chunk);
        at += chunk.len();
    }
    if let Ok(big) = u32::try_from(limit) {
        let mut out = vec![7u64; heads];
        assert!(hasher.ids_into(&[big], &mut out).is_err());
        assert!(out.iter().all(|&v| v == 7), "a refusal writes nothing");
    }
});
