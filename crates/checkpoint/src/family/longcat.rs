//! LongCat checkpoints ([`LongCatNames`]: `model.ngram_embeddings.*`, or
//! LongCat-2.0's `oe_*` spelling): one tensor per (order, split) sub-table,
//! each with its own row count `m + 2i + 1`, and one projection per
//! sub-table. The hash adds each sub-table's offset, so the ids address
//! the sub-tables concatenated in order; the runtime serves them as one
//! table through [`metrale_storage::concat::ConcatTable`].

use metrale_model_layers::layers::ple::PleWeights;
use metrale_model_layers::layers::ple::family::longcat::{LongCatKeys, LongCatSpec};
use metrale_model_layers::layers::ple::ids::DerivedPleIds;
use metrale_model_layers::layers::ple::spec::{ModelSpec, SiteSpec};
use metrale_storage::safetensors::Dtype;

use super::TensorFamily;
use crate::error::Result;
use crate::load::Files;
use crate::names::LongCatNames;
use crate::synth::{Dense, Fill};

/// The checkpoint side of LongCat; variant 1 is LongCat-2.0's `oe_*`
/// names.
pub(super) struct LongCatTensors;

/// The names in spelling `variant`.
fn names(variant: u8) -> LongCatNames {
    if variant == 1 {
        LongCatNames::oe()
    } else {
        LongCatNames::flash()
    }
}

impl TensorFamily for LongCatTensors {
    fn id(&self) -> &'static str {
        "longcat"
    }

    fn name(&self, variant: u8) -> &'static str {
        if variant == 1 {
            "LongCat n-gram embedding (oe_* names)"
        } else {
            "LongCat n-gram embedding"
        }
    }

    fn variant(&self, g: &ModelSpec, _tensors: &mut dyn Iterator<Item = &String>) -> u8 {
        u8::from(
            g.family
                .get::<LongCatSpec>()
                .is_some_and(|l| l.keys == LongCatKeys::Oe),
        )
    }

    fn table_parts(&self, g: &ModelSpec) -> usize {
        g.ngram_heads()
    }

    fn sub_tables(&self) -> bool {
        true
    }

    fn part_noun(&self) -> &'static str {
        "sub-tables"
    }

    fn whole_part_rows(&self, g: &ModelSpec, s: usize, _padded_rows: u64) -> Vec<u64> {
        g.derive(s)
            .map(|d| d.dims.head_vocab_sizes)
            .unwrap_or_default()
    }

    fn table_tensors(&self, variant: u8, g: &ModelSpec, _s: usize) -> Vec<String> {
        let n = names(variant);
        (0..g.ngram_heads()).map(|i| n.sub_table(i)).collect()
    }

    fn site_prefix(&self, variant: u8, _g: &ModelSpec, _s: usize) -> String {
        names(variant).prefix().to_string()
    }

    fn load_weights(
        &self,
        variant: u8,
        g: &ModelSpec,
        files: &Files,
        _spec: &SiteSpec,
    ) -> Result<PleWeights> {
        load(g, files, names(variant))
    }

    fn dense_tensors(
        &self,
        variant: u8,
        g: &ModelSpec,
        _s: usize,
        _d: &DerivedPleIds,
    ) -> Vec<Dense> {
        dense(variant, g)
    }
}

/// LongCat: the sub-tables' `[H, d]` projections side by side along the
/// input dimension, one `[H, E]` value projection.
fn load(g: &ModelSpec, files: &Files, n: LongCatNames) -> Result<PleWeights> {
    let (h, d, parts) = (g.hidden_size, g.head_dim, g.ngram_heads());
    let mut value = vec![0u16; h * d * parts];
    for i in 0..parts {
        let p = files.read_bf16(&n.post_proj(i), &[h as u64, d as u64])?;
        for r in 0..h {
            value[r * d * parts + i * d..r * d * parts + (i + 1) * d]
                .copy_from_slice(&p[r * d..(r + 1) * d]);
        }
    }
    Ok(PleWeights {
        value_proj: value,
        ..PleWeights::default()
    })
}

/// The dense tensors `init` writes for site `s`.
fn dense(variant: u8, g: &ModelSpec) -> Vec<Dense> {
    let (e, h) = (g.emb_dim() as u64, g.hidden_size as u64);
    let amp = 1.0 / (e as f32).sqrt();
    let bf = |center, amp| Fill::Bf16 { center, amp };
    let mut v = Vec::new();
    let n = names(variant);
    let dd = g.head_dim as u64;
    for i in 0..g.ngram_heads() {
        v.push(Dense::new(
            n.post_proj(i),
            Dtype::BF16,
            &[h, dd],
            0x4000 + i as u64,
            bf(0.0, amp),
        ));
    }
    v
}
