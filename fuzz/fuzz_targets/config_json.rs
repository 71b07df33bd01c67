//! Fuzz `config.json` parsing: the layer crate's `PleModelConfig` and the
//! checkpoint's `Geometry` built on it.
//!
//! Neither may panic on any text. A config that parses must satisfy the
//! invariants `PleModelConfig` documents, and the geometry parser must
//! accept only configs the layer parser accepts.
#![no_main]

use std::path::Path;

use libfuzzer_sys::fuzz_target;
use metrale_checkpoint::geometry::Geometry;
use metrale_model_layers::layers::ple::config::PleModelConfig;
use metrale_model_layers::layers::ple::ids::MAX_NGRAM_SIZE;

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else { return };
    let c = PleModelConfig::from_json_str(text, "fuzz/config.json");
    let g = Geometry::parse(Path::new("fuzz/config.json"), text);
    if g.is_ok() {
        assert!(c.is_ok(), "the geometry accepted a config the layer parser refused");
    }
    if let Ok(c) = c {
        assert!((2..=MAX_NGRAM_SIZE).contains(&c.ngram_size), "ngram_size {}", c.ngram_size);
        assert!(c.vocab_size >= 1 && c.hidden_size >= 1 && c.hc_mult >= 1);
        assert!(c.heads_per_ngram >= 1 && c.ple_conv_kernel_size >= 1);
        assert!(!c.ple_layer_ids.is_empty() && c.ple_layer_ids.iter().all(|&l| l >= 1));
        let mut ids = c.ple_layer_ids.clone();
        ids.sort_unstable();
        ids.dedup();
        assert_eq!(ids.len(), c.ple_layer_ids.len(), "duplicate ple_layer_ids accepted");
        assert!(c.rms_norm_eps.is_finite() && c.rms_norm_eps > 0.0);
        assert!(c.ple_head_dim >= 1);
        let _ = c.ngram_heads();
    }
    if let Ok(g) = g {
        if g.check().is_err() {
            return;
        }
        let _ = (g.ngram_heads(), g.channels(), g.state_len(), g.sites());
        let _ = (g.aux_blob_bytes(), g.carry_bytes_per_seq());
    }
});
