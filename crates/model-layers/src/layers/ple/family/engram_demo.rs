//! The Engram demo family (DeepSeek's `engram_demo_v1.py`, docs/SPEC.md
//! §11 (Families)): recognised by `engram_vocab_size` without any of
//! DeepSeek-V4.1's geometry keys, its keys written back as the demo's
//! `EngramConfig` spells them, and its layer gated with `w` norms and the
//! dilated short conv when `kernel_size` is at least 2. The parse and the
//! hash constants it shares with DeepSeek-V4.1 are in [`super::engram`].

use serde_json::{Value, json};

use super::FamilyDesc;
use super::deepseek_v41;
use super::engram::{EngramKeys, EngramSpec, is_engram, parse, v41_gate};
use crate::layers::ple::spec::{Combine, Fields, GatedSpec, ModelSpec, SpecError};

/// The registry entry.
pub static DESC: FamilyDesc = FamilyDesc {
    id: "engram-demo",
    name: "engram",
    title: "Engram demo",
    detect: Some(detect),
    parse: |f| parse(f, EngramKeys::Demo),
    site_layer: |site| (is_engram(site) && !v41_gate(site)).then_some(DESC.title),
};

/// `engram_vocab_size`, unless DeepSeek-V4.1's keys claim the config.
fn detect(f: &Fields) -> Result<Option<&'static str>, SpecError> {
    if f.has("engram_vocab_size") && deepseek_v41::detect(f)?.is_none() {
        Ok(Some("engram_vocab_size"))
    } else {
        Ok(None)
    }
}

/// The demo's gate, with the short conv when `conv`.
pub(super) fn combine(conv: bool) -> Combine {
    Combine::Gated(GatedSpec::engram(conv))
}

/// The demo's own keys of `spec`.
pub(super) fn keys_json(spec: &ModelSpec, e: &EngramSpec) -> Value {
    let layers: Vec<usize> = spec.ple_layer_ids.iter().map(|l| l - 1).collect();
    json!({
        "engram_vocab_size": e.vocab_bases,
        "max_ngram_size": spec.ngram_size,
        "n_embed_per_ngram": spec.head_dim * spec.heads_per_ngram,
        "n_head_per_ngram": spec.heads_per_ngram,
        "layer_ids": layers,
        "pad_id": e.pad_id,
        "seed": spec.hash_seed,
        "kernel_size": spec.conv_kernel_size,
        "compressed_vocab_size": e.compressed_vocab_size,
    })
}
