//! The DeepSeek-V4.1 Engram family (docs/SPEC.md §11 (Families)):
//! recognised by any of its `engram_*` geometry keys, written back in
//! that spelling, its layer gated under the published V4.1 rules (one fused
//! key/value projection, no conv unless this project's `engram_kernel_size`
//! asks for one). The parse and the hash constants it shares with the demo
//! are in [`super::engram`].

use serde_json::{Value, json};

use super::FamilyDesc;
use super::engram::{EngramKeys, EngramSpec, is_engram, parse, v41_gate};
use crate::layers::ple::spec::{Combine, Fields, GatedSpec, ModelSpec, SiteSpec, SpecError};

/// The registry entry.
pub static DESC: FamilyDesc = FamilyDesc {
    id: "deepseek-v4.1",
    name: "engram",
    title: "DeepSeek-V4.1 Engram",
    detect: Some(detect),
    parse: |f| parse(f, EngramKeys::V41),
    site_layer,
};

/// An Engram site with V4.1's gate; "with a short conv" when it has this
/// project's conv, which the published layer lacks.
fn site_layer(site: &SiteSpec) -> Option<&'static str> {
    if !(is_engram(site) && v41_gate(site)) {
        return None;
    }
    Some(if site.combine.has_conv() {
        "DeepSeek-V4.1 Engram with a short conv"
    } else {
        DESC.title
    })
}

/// The geometry keys that name V4.1; other `engram_*` keys (a quantised
/// repack's `engram_rotation_config`) name no family.
const KEYS: [&str; 8] = [
    "engram_layer_ids",
    "engram_max_ngram_size",
    "engram_n_heads",
    "engram_head_dim",
    "engram_pad_token_id",
    "engram_pad_id",
    "engram_compressed_vocab_size",
    "engram_num_embeddings",
];

/// The first of [`KEYS`] that `f` holds.
pub(super) fn detect(f: &Fields) -> Result<Option<&'static str>, SpecError> {
    Ok(KEYS.iter().copied().find(|k| f.has(k)))
}

/// V4.1's gate, with the short conv when `conv`.
pub(super) fn combine(conv: bool) -> Combine {
    Combine::Gated(GatedSpec::deepseek_v41(conv))
}

/// V4.1's own keys of `spec`.
pub(super) fn keys_json(spec: &ModelSpec, e: &EngramSpec) -> Value {
    let layers: Vec<usize> = spec.ple_layer_ids.iter().map(|l| l - 1).collect();
    let bases = if e.vocab_bases.windows(2).all(|w| w[0] == w[1]) {
        json!(e.vocab_bases[0])
    } else {
        json!(e.vocab_bases)
    };
    json!({
        "architectures": ["DeepseekV41ForCausalLM"],
        "engram_layer_ids": layers,
        "engram_max_ngram_size": spec.ngram_size,
        "engram_vocab_size": bases,
        "engram_n_heads": spec.heads_per_ngram,
        "engram_head_dim": spec.head_dim,
        "engram_pad_token_id": e.pad_id,
        "engram_compressed_vocab_size": e.compressed_vocab_size,
        // This project's extension (the published model has no conv);
        // written only when it is used.
        "engram_kernel_size": (spec.conv_kernel_size != 1).then_some(spec.conv_kernel_size),
    })
}
