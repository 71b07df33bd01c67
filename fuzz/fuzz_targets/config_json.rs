//! Fuzz `config.json` parsing into a `ModelSpec`, and each site's spec.
//!
//! Nothing may panic on any text. A spec that parses must satisfy the
//! invariants `ModelSpec` documents (so every derived size is computable),
//! must validate again unchanged, must round-trip through its own
//! `config.json`, and every site that derives must give a `SiteSpec` whose
//! sizes agree with the model's.
#![no_main]

use libfuzzer_sys::fuzz_target;
use metrale_model_layers::layers::ple::ModelSpec;
use metrale_model_layers::layers::ple::ids::MAX_NGRAM_SIZE;

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else { return };
    let Ok(c) = ModelSpec::from_json_str(text, "fuzz/config.json") else { return };
    assert!((2..=MAX_NGRAM_SIZE).contains(&c.ngram_size), "ngram_size {}", c.ngram_size);
    assert!(c.vocab_size >= 1 && c.hidden_size >= 1 && c.hc_mult >= 1);
    assert!(c.heads_per_ngram >= 1 && c.conv_kernel_size >= 1 && c.head_dim >= 1);
    assert!(!c.ple_layer_ids.is_empty() && c.ple_layer_ids.iter().all(|&l| l >= 1));
    assert!(c.ple_layer_ids.windows(2).all(|w| w[0] < w[1]), "ple_layer_ids not increasing");
    assert!(c.ple_layer_ids.iter().all(|&l| l <= c.num_hidden_layers));
    assert!(c.rms_norm_eps.is_finite() && c.rms_norm_eps > 0.0);
    assert!(u64::from(c.eos_token_id) < c.vocab_size);
    c.validate("fuzz/config.json").expect("a parsed spec validates");
    let _ = (c.ngram_heads(), c.emb_dim(), c.channels(), c.state_len(), c.sites());
    let _ = (c.aux_blob_bytes(), c.carry_bytes_per_seq());
    let mut back = ModelSpec::from_json_str(&c.to_config_json(), "fuzz/back.json")
        .expect("a spec's own config.json parses");
    // serde_json parses floats to within an ulp, not always exactly.
    let eps_err = (back.rms_norm_eps - c.rms_norm_eps).abs();
    assert!(eps_err <= c.rms_norm_eps * 1e-15, "rms_norm_eps {} -> {}", c.rms_norm_eps, back.rms_norm_eps);
    back.rms_norm_eps = c.rms_norm_eps;
    assert_eq!(back, c, "config.json round trip");
    // Deriving searches primes (bounded by MAX_PRIMES_SEARCHED, but slow
    // near that bound): only for the first site of a small head count, so
    // one input stays fast.
    if c.ngram_heads() > 64 {
        return;
    }
    if let Ok(site) = c.site(0) {
        assert_eq!(site.aux_blob_len(), c.aux_blob_bytes());
        assert_eq!(site.conv_bytes() * c.sites(), c.carry_bytes_per_seq());
        assert_eq!(site.layer, c.ple_layer_ids[0] - 1);
    }
});
