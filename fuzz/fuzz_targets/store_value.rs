//! Fuzz the shared carry store's value decoder.
//!
//! `open_value` must never panic on any bytes a store hands back. Half the
//! inputs are sealed with the expected model and key first, so the fuzzer
//! reaches the snapshot container and the token and history checks behind
//! the header. An accepted value must hold one blob per site, each of the
//! site's size, taken after exactly the prefix's token count.
#![no_main]

use libfuzzer_sys::fuzz_target;
use metrale_engine::snapshot::GeometryFingerprint;
use metrale_engine::store::value::{open_value, seal_value};
use metrale_engine::store::{ModelDigest, StoreKey};
use metrale_model_layers::layers::ple::SiteSpec;
use metrale_testkit::tiny::tiny_dims;

fn geometry() -> Vec<SiteSpec> {
    (0..2).map(|s| SiteSpec::new(tiny_dims(s, 1, 0), 4, 2, 1, 2, 3)).collect()
}

fuzz_target!(|data: &[u8]| {
    let Some((&mode, rest)) = data.split_first() else { return };
    let g = geometry();
    let model = ModelDigest::of("fuzz");
    let n = (mode >> 4) as usize;
    let tokens: Vec<u32> = rest.iter().take(n).map(|&b| b as u32).collect();
    let key = StoreKey::of(&model, GeometryFingerprint::of(&g), &tokens);
    let value = if mode & 1 == 1 {
        seal_value(&model, &key, rest)
    } else {
        rest.to_vec()
    };
    if let Ok(s) = open_value(&value, &model, &key, &g, &tokens) {
        assert_eq!(s.token_count, tokens.len() as u64);
        assert_eq!(s.blobs.len(), g.len());
        for (blob, site) in s.blobs.iter().zip(&g) {
            assert_eq!(blob.len(), site.aux_blob_len());
        }
    }
});
