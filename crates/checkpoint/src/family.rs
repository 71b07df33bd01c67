//! What a checkpoint of each family holds besides `config.json`: which
//! tensors make a site's table and how they form the one table the ids
//! address (docs/SPEC.md §10 (Checkpoint layout), §11 (Families)).
//!
//! - Qwen4Exp: the table cut into `split_ngram_parts` shards as
//!   transformers' `torch.chunk` cuts it ([`chunk_rows`]: equal shards of
//!   `ceil(rows / parts)` rows, the last one shorter, and fewer shards than
//!   parts when the rows run out first) ([`SiteNames::shard_weight`]), under
//!   `model.` or, for the multimodal model, `model.language_model.`.
//! - Engram (the demo and DeepSeek-V4.1): one tensor per layer holding
//!   every head's rows back to back.
//! - LongCat: one tensor per (order, split) sub-table, each with its own
//!   row count `m + 2i + 1`. The hash adds each sub-table's offset, so the
//!   ids address the sub-tables concatenated in order; the runtime serves
//!   them as one table through [`metrale_storage::concat::ConcatTable`].
//!
//! A cut table (`ple_table_rows` = `r` in config.json) stores `r / parts`
//! rows in every table tensor (`r` a multiple of `parts`), `parts` being [`Layout::table_parts`]: ids
//! of an equal-shard table fold as `id % r`; ids of a LongCat sub-table
//! fold inside the sub-table, as `(id - offset_i) % (r / parts)`.
//!
//! Each family's checkpoint facts live in its module under `family/`
//! (`qwen4_exp.rs`, `engram_demo.rs`, `deepseek_v41.rs`, `longcat.rs`):
//! which tensors make its table, how its dense weights load into
//! [`PleWeights`], and which dense tensors `init` writes for it. They sit
//! behind `TensorFamily`; `BUILTIN` lists them, one line per family,
//! keyed by the model-layers family id, and [`Layout`] is a family with the
//! spelling of its names a checkpoint uses.
//!
//! Invariant: the writer and the loader take the table tensors of a site
//! from [`Layout::table_tensors`] alone; every family model-layers parses
//! has an entry here (a test checks the built-in ones).

use std::fmt;

use metrale_model_layers::layers::ple::PleWeights;
use metrale_model_layers::layers::ple::ids::DerivedPleIds;
use metrale_model_layers::layers::ple::spec::{ModelSpec, SiteSpec};

use crate::error::{CheckpointError, Result};
use crate::load::Files;
use crate::names::SiteNames;
use crate::synth::Dense;

mod deepseek_v41;
mod engram_demo;
mod longcat;
mod qwen4_exp;

/// The checkpoint side of the families this crate reads and writes.
const BUILTIN: &[&dyn TensorFamily] = &[
    &qwen4_exp::Qwen4ExpTensors,
    &engram_demo::EngramDemoTensors,
    &deepseek_v41::V41Tensors,
    &longcat::LongCatTensors,
];

/// How transformers' `torch.chunk` cuts `rows` rows into `parts` shards:
/// `(rows per shard, shards)`. Every shard holds `ceil(rows / parts)` rows
/// but the last, which holds the rest; when the rows run out early there
/// are fewer than `parts` shards.
pub fn chunk_rows(rows: u64, parts: u64) -> (u64, u64) {
    let per = rows.div_ceil(parts.max(1)).max(1);
    (per, rows.div_ceil(per))
}

/// What a family's checkpoint holds and how it is read and written.
pub(crate) trait TensorFamily: Send + Sync + 'static {
    /// The model-layers family id (`FamilyDesc::id`) this serves.
    fn id(&self) -> &'static str;
    /// How `inspect` names the layout in spelling `variant`.
    fn name(&self, variant: u8) -> &'static str;
    /// The spelling of `g`'s names, given a checkpoint's tensor names
    /// (empty when writing): 0 unless the family has several.
    fn variant(&self, g: &ModelSpec, tensors: &mut dyn Iterator<Item = &String>) -> u8 {
        let _ = (g, tensors);
        0
    }
    /// The number of table tensors of a cut table (see
    /// [`Layout::table_parts`]).
    fn table_parts(&self, g: &ModelSpec) -> usize;
    /// Whether the table tensors are sub-tables of their own sizes.
    fn sub_tables(&self) -> bool {
        false
    }
    /// Whether a whole table is cut as `torch.chunk` cuts it, so that its
    /// last shard may be shorter (Qwen4-Exp).
    fn torch_chunked(&self) -> bool {
        false
    }
    /// What `inspect` calls the table tensors.
    fn part_noun(&self) -> &'static str {
        "table tensor"
    }
    /// Rows each table tensor of an uncut table stores.
    fn whole_part_rows(&self, g: &ModelSpec, s: usize, padded_rows: u64) -> Vec<u64> {
        let _ = s;
        let parts = self.table_parts(g) as u64;
        vec![padded_rows.div_ceil(parts); parts as usize]
    }
    /// The weight tensors of site `s`'s table, in id order.
    fn table_tensors(&self, variant: u8, g: &ModelSpec, s: usize) -> Vec<String>;
    /// The prefix of site `s`'s tensors.
    fn site_prefix(&self, variant: u8, g: &ModelSpec, s: usize) -> String;
    /// The Qwen4-Exp site names (`None` for other families).
    fn site_names(&self, variant: u8, layer: usize) -> Option<SiteNames> {
        let _ = (variant, layer);
        None
    }
    /// Whether the family's tables may be stored as released (block
    /// scales in their own tensor) and converted on open.
    fn release_tables(&self) -> bool {
        false
    }
    /// Site `spec`'s dense weights from the checkpoint's tensors.
    fn load_weights(
        &self,
        variant: u8,
        g: &ModelSpec,
        files: &Files,
        spec: &SiteSpec,
    ) -> Result<PleWeights>;
    /// The dense tensors `init` writes for site `s`, in file order.
    fn dense_tensors(&self, variant: u8, g: &ModelSpec, s: usize, d: &DerivedPleIds) -> Vec<Dense>;
}

/// The checkpoint layout of a model family: the family and the spelling
/// of its tensor names.
#[derive(Clone, Copy)]
pub struct Layout {
    family: &'static dyn TensorFamily,
    variant: u8,
}

impl PartialEq for Layout {
    fn eq(&self, other: &Self) -> bool {
        self.family.id() == other.family.id() && self.variant == other.variant
    }
}

impl Eq for Layout {}

impl fmt::Debug for Layout {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl Layout {
    /// The layout of `g`'s family as `init` writes it.
    pub fn of(g: &ModelSpec) -> Result<Layout> {
        Self::detect(g, std::iter::empty())
    }

    /// The layout of a checkpoint of `g` whose tensors are `names` (the
    /// family picks its spelling from them, e.g. Qwen4-Exp's multimodal
    /// root).
    pub fn detect<'a>(
        g: &ModelSpec,
        mut names: impl Iterator<Item = &'a String>,
    ) -> Result<Layout> {
        let id = g.family.desc().id;
        let family = BUILTIN
            .iter()
            .copied()
            .find(|f| f.id() == id)
            .ok_or_else(|| {
                CheckpointError::Invalid(format!(
                    "family `{id}` has no checkpoint layout (crates/checkpoint/src/family.rs)"
                ))
            })?;
        let variant = family.variant(g, &mut names);
        Ok(Layout { family, variant })
    }

    /// The model-layers family id of this layout.
    pub fn family_id(self) -> &'static str {
        self.family.id()
    }

    /// How `inspect` names the layout.
    pub fn name(self) -> &'static str {
        self.family.name(self.variant)
    }

    /// What `inspect` calls the table tensors (`shards`, `sub-tables`, ...).
    pub fn part_noun(self) -> &'static str {
        self.family.part_noun()
    }

    /// Whether the table tensors are sub-tables of their own sizes
    /// (LongCat) rather than equal shards of one table.
    pub fn sub_tables(self) -> bool {
        self.family.sub_tables()
    }

    /// Whether a whole table is cut as `torch.chunk` cuts it (its last
    /// shard may be shorter).
    pub fn torch_chunked(self) -> bool {
        self.family.torch_chunked()
    }

    /// Whether the family's tables may be stored as released and converted
    /// on open (DeepSeek-V4.1's block-scaled rows).
    pub fn release_tables(self) -> bool {
        self.family.release_tables()
    }

    /// The site names of a Qwen4Exp layout (`None` for other families).
    pub fn site_names(self, layer: usize) -> Option<SiteNames> {
        self.family.site_names(self.variant, layer)
    }

    /// The number of table tensors a cut table has: the `split_ngram_parts`
    /// equal shards of a Qwen4Exp table, 1 for Engram, the `k * (n - 1)`
    /// sub-tables of LongCat. A cut table stores the same number of rows
    /// in each. (A whole Qwen4Exp table is cut as [`chunk_rows`] says,
    /// which may make fewer: [`Self::table_tensors`] counts them.)
    pub fn table_parts(self, g: &ModelSpec) -> usize {
        self.family.table_parts(g)
    }

    /// Rows each table tensor of site `s` stores, in
    /// [`Self::table_tensors`] order, given the site's padded row count.
    pub fn part_rows(self, g: &ModelSpec, s: usize, padded_rows: u64) -> Vec<u64> {
        match g.table_rows {
            Some(r) => {
                let parts = self.table_parts(g);
                vec![r / parts as u64; parts]
            }
            None => self.family.whole_part_rows(g, s, padded_rows),
        }
    }

    /// The weight tensors of site `s`'s table, in id order.
    pub fn table_tensors(self, g: &ModelSpec, s: usize) -> Vec<String> {
        self.family.table_tensors(self.variant, g, s)
    }

    /// The prefix of site `s`'s tensors (`model.layers.1.ple`,
    /// `layers.14.engram`, `model.ngram_embeddings`, ...).
    pub fn site_prefix(self, g: &ModelSpec, s: usize) -> String {
        self.family.site_prefix(self.variant, g, s)
    }

    /// Site `spec`'s dense weights, read from `files`.
    pub(crate) fn load_weights(
        self,
        g: &ModelSpec,
        files: &Files,
        spec: &SiteSpec,
    ) -> Result<PleWeights> {
        self.family.load_weights(self.variant, g, files, spec)
    }

    /// The dense tensors `init` writes for site `s`.
    pub(crate) fn dense_tensors(self, g: &ModelSpec, s: usize, d: &DerivedPleIds) -> Vec<Dense> {
        self.family.dense_tensors(self.variant, g, s, d)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::preset::Preset;

    #[test]
    fn every_preset_has_its_family_layout() {
        let lite = Preset::LongcatFlashLite.spec();
        let l = Layout::of(&lite).unwrap();
        assert_eq!(l.family_id(), "longcat");
        assert_eq!(l.name(), "LongCat n-gram embedding");
        assert_eq!(l.table_parts(&lite), 12);
        let t = l.table_tensors(&lite, 0);
        assert_eq!(t.len(), 12);
        assert_eq!(t[11], "model.ngram_embeddings.embedders.11.weight");
        let v41 = Preset::DeepseekV41.spec();
        assert_eq!(Layout::of(&v41).unwrap().family_id(), "deepseek-v4.1");
        assert_eq!(
            Layout::of(&v41).unwrap().table_tensors(&v41, 1),
            ["layers.14.engram.embed.weight"]
        );
        let demo = Preset::EngramDemo.spec();
        assert_eq!(
            Layout::of(&demo).unwrap().table_tensors(&demo, 0),
            ["model.layers.1.engram.multi_head_embedding.embedding.weight"]
        );
        let tiny = Preset::Tiny.spec();
        assert_eq!(Layout::of(&tiny).unwrap().table_parts(&tiny), 2);
    }

    #[test]
    fn every_builtin_model_family_has_a_checkpoint_layout() {
        use metrale_model_layers::layers::ple::family::BUILTIN as MODEL;
        for d in MODEL {
            assert!(
                BUILTIN.iter().any(|f| f.id() == d.id),
                "{} has no checkpoint layout",
                d.id
            );
        }
        assert_eq!(BUILTIN.len(), MODEL.len());
    }
}
