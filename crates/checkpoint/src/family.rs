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
//! Invariant: the writer and the loader take the table tensors of a site
//! from [`Layout::table_tensors`] alone.

use metrale_model_layers::layers::ple::family::engram::{EngramKeys, EngramSpec};
use metrale_model_layers::layers::ple::family::longcat::{LongCatKeys, LongCatSpec};
use metrale_model_layers::layers::ple::spec::ModelSpec;

use crate::names::{
    EngramDemoNames, LongCatNames, MULTIMODAL_ROOT, SiteNames, TEXT_ROOT, V41Names,
};

/// How transformers' `torch.chunk` cuts `rows` rows into `parts` shards:
/// `(rows per shard, shards)`. Every shard holds `ceil(rows / parts)` rows
/// but the last, which holds the rest; when the rows run out early there
/// are fewer than `parts` shards.
pub fn chunk_rows(rows: u64, parts: u64) -> (u64, u64) {
    let per = rows.div_ceil(parts.max(1)).max(1);
    (per, rows.div_ceil(per))
}

/// The checkpoint layout of a model family (and key spelling).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Layout {
    /// Qwen4Exp PLE sites (`model.layers.{L}.ple.*`, or
    /// `model.language_model.layers.{L}.ple.*` when `multimodal`).
    Qwen4Exp {
        /// Saved from `Qwen4ExpForConditionalGeneration`.
        multimodal: bool,
    },
    /// The Engram demo (`model.layers.{L}.engram.*`).
    EngramDemo,
    /// DeepSeek-V4.1's Engram (`layers.{L}.engram.*`).
    EngramV41,
    /// LongCat's n-gram embedding; `oe` for LongCat-2.0's `oe_*` names.
    LongCat {
        /// LongCat-2.0's spelling.
        oe: bool,
    },
}

impl Layout {
    /// The layout of `g`'s family.
    pub fn of(g: &ModelSpec) -> Layout {
        if let Some(e) = g.family.get::<EngramSpec>() {
            match e.keys {
                EngramKeys::Demo => Layout::EngramDemo,
                EngramKeys::V41 => Layout::EngramV41,
            }
        } else if let Some(l) = g.family.get::<LongCatSpec>() {
            Layout::LongCat {
                oe: l.keys == LongCatKeys::Oe,
            }
        } else {
            Layout::Qwen4Exp { multimodal: false }
        }
    }

    /// How `inspect` names the layout.
    pub fn name(self) -> &'static str {
        match self {
            Layout::Qwen4Exp { multimodal: false } => "Qwen4Exp PLE",
            Layout::Qwen4Exp { multimodal: true } => "Qwen4Exp PLE (multimodal model)",
            Layout::EngramDemo => "Engram (demo)",
            Layout::EngramV41 => "Engram (DeepSeek-V4.1)",
            Layout::LongCat { oe: false } => "LongCat n-gram embedding",
            Layout::LongCat { oe: true } => "LongCat n-gram embedding (oe_* names)",
        }
    }

    /// Whether the table tensors are sub-tables of their own sizes
    /// (LongCat) rather than equal shards of one table.
    pub fn sub_tables(self) -> bool {
        matches!(self, Layout::LongCat { .. })
    }

    /// The layout of a Qwen4Exp checkpoint whose tensors are `names`:
    /// multimodal when its PLE tensors sit under [`MULTIMODAL_ROOT`]; the
    /// family's own layout otherwise.
    pub fn detect<'a>(g: &ModelSpec, mut names: impl Iterator<Item = &'a String>) -> Layout {
        match Layout::of(g) {
            Layout::Qwen4Exp { .. } => {
                let prefix = format!("{MULTIMODAL_ROOT}layers.");
                Layout::Qwen4Exp {
                    multimodal: names.any(|n| n.starts_with(&prefix) && n.contains(".ple.")),
                }
            }
            other => other,
        }
    }

    /// The names of Qwen4Exp site tensors at model layer `layer`.
    fn qwen_names(self, layer: usize) -> SiteNames {
        let root = match self {
            Layout::Qwen4Exp { multimodal: true } => MULTIMODAL_ROOT,
            _ => TEXT_ROOT,
        };
        SiteNames::with_root(root, layer)
    }

    /// The site names of a Qwen4Exp layout (`None` for other families).
    pub fn site_names(self, layer: usize) -> Option<SiteNames> {
        matches!(self, Layout::Qwen4Exp { .. }).then(|| self.qwen_names(layer))
    }

    /// The number of table tensors a cut table has: the `split_ngram_parts`
    /// equal shards of a Qwen4Exp table, 1 for Engram, the `k * (n - 1)`
    /// sub-tables of LongCat. A cut table stores the same number of rows
    /// in each. (A whole Qwen4Exp table is cut as [`chunk_rows`] says,
    /// which may make fewer: [`Self::table_tensors`] counts them.)
    pub fn table_parts(self, g: &ModelSpec) -> usize {
        match self {
            Layout::Qwen4Exp { .. } => g.split_ngram_parts,
            Layout::EngramDemo | Layout::EngramV41 => 1,
            Layout::LongCat { .. } => g.ngram_heads(),
        }
    }

    /// Rows each table tensor of site `s` stores, in
    /// [`Self::table_tensors`] order, given the site's padded row count.
    pub fn part_rows(self, g: &ModelSpec, s: usize, padded_rows: u64) -> Vec<u64> {
        let parts = self.table_parts(g) as u64;
        match (self, g.table_rows) {
            (Layout::Qwen4Exp { .. }, None) => {
                let (per, n) = chunk_rows(padded_rows, parts);
                (0..n).map(|i| per.min(padded_rows - i * per)).collect()
            }
            (Layout::LongCat { .. }, None) => g
                .derive(s)
                .map(|d| d.dims.head_vocab_sizes)
                .unwrap_or_default(),
            (_, Some(r)) => vec![r / parts; parts as usize],
            (_, None) => vec![padded_rows.div_ceil(parts); parts as usize],
        }
    }

    /// The weight tensors of site `s`'s table, in id order.
    pub fn table_tensors(self, g: &ModelSpec, s: usize) -> Vec<String> {
        let layer = g.site_layer(s);
        match self {
            Layout::Qwen4Exp { .. } => {
                let n = self.qwen_names(layer);
                let count = match g.table_rows {
                    Some(_) => g.split_ngram_parts as u64,
                    None => g
                        .derive(s)
                        .map(|d| chunk_rows(d.padded_rows, g.split_ngram_parts as u64).1)
                        .unwrap_or(g.split_ngram_parts as u64),
                };
                (0..count as usize).map(|i| n.shard_weight(i)).collect()
            }
            Layout::EngramDemo => vec![EngramDemoNames::new(layer).table()],
            Layout::EngramV41 => vec![V41Names::new(layer).table()],
            Layout::LongCat { oe } => {
                let n = if oe {
                    LongCatNames::oe()
                } else {
                    LongCatNames::flash()
                };
                (0..g.ngram_heads()).map(|i| n.sub_table(i)).collect()
            }
        }
    }

    /// The prefix of site `s`'s tensors (`model.layers.1.ple`,
    /// `layers.14.engram`, `model.ngram_embeddings`, ...).
    pub fn site_prefix(self, g: &ModelSpec, s: usize) -> String {
        let layer = g.site_layer(s);
        match self {
            Layout::Qwen4Exp { .. } => self.qwen_names(layer).prefix().to_string(),
            Layout::EngramDemo => EngramDemoNames::new(layer).prefix().to_string(),
            Layout::EngramV41 => V41Names::new(layer).prefix().to_string(),
            Layout::LongCat { .. } => self
                .longcat_names()
                .map(|n| n.prefix().to_string())
                .unwrap_or_default(),
        }
    }

    /// The LongCat names of this layout (`None` for other families).
    pub fn longcat_names(self) -> Option<LongCatNames> {
        match self {
            Layout::LongCat { oe: false } => Some(LongCatNames::flash()),
            Layout::LongCat { oe: true } => Some(LongCatNames::oe()),
            _ => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::preset::Preset;

    #[test]
    fn every_preset_has_its_family_layout() {
        let lite = Preset::LongcatFlashLite.spec();
        let l = Layout::of(&lite);
        assert_eq!(l, Layout::LongCat { oe: false });
        assert_eq!(l.table_parts(&lite), 12);
        let t = l.table_tensors(&lite, 0);
        assert_eq!(t.len(), 12);
        assert_eq!(t[11], "model.ngram_embeddings.embedders.11.weight");
        let v41 = Preset::DeepseekV41.spec();
        assert_eq!(Layout::of(&v41), Layout::EngramV41);
        assert_eq!(
            Layout::of(&v41).table_tensors(&v41, 1),
            ["layers.14.engram.embed.weight"]
        );
        let demo = Preset::EngramDemo.spec();
        assert_eq!(
            Layout::of(&demo).table_tensors(&demo, 0),
            ["model.layers.1.engram.multi_head_embedding.embedding.weight"]
        );
        let tiny = Preset::Tiny.spec();
        assert_eq!(Layout::of(&tiny).table_parts(&tiny), 2);
    }
}
