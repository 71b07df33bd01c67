//! The file and tensor names of the checkpoint format.
//!
//! One Qwen4Exp PLE site at model layer `L` (0-based, `ple_layer_ids[s] -
//! 1`) owns every tensor under `model.layers.{L}.ple.` ([`SiteNames`]), as
//! transformers' `Qwen4ExpForCausalLM` names them: the projections, norms
//! and conv directly, the hash buffers and the table shards under
//! `ple.ple_embedding.`. The multimodal `Qwen4ExpForConditionalGeneration`
//! puts the same names under `model.language_model.` ([`MULTIMODAL_ROOT`]).
//! The other families keep their released names: the Engram demo's module
//! names under `model.layers.{L}.engram.` ([`EngramDemoNames`]),
//! DeepSeek-V4.1's under `layers.{L}.engram.` ([`V41Names`]), LongCat's
//! `model.ngram_embeddings.*` or LongCat-2.0's `model.oe_*`
//! ([`LongCatNames`]). These are the only place names are spelled, so the
//! writer and the loader cannot drift.

use metrale_storage::layout::ShardSource;

/// The model configuration file.
pub const CONFIG_FILE: &str = "config.json";
/// The weight map: tensor name to safetensors file.
pub const INDEX_FILE: &str = "model.safetensors.index.json";
/// The one weights file `save_pretrained` writes when the model fits one
/// (then there is no [`INDEX_FILE`]).
pub const SINGLE_FILE: &str = "model.safetensors";

/// The row remap of the table of the site at model layer `layer` (0-based),
/// written by `table pack --hot-rows` (format: [`crate::remap`]).
pub fn row_remap_file(layer: usize) -> String {
    format!("model.layers.{layer}.ple.row_remap.bin")
}

/// The per-row F32 scale tensor that goes with FP8 table tensor `weight`
/// (this project's extension): `.weight` becomes `.scale`, any other name
/// gets `.scale` appended.
pub fn scale_name(weight: &str) -> String {
    match weight.strip_suffix(".weight") {
        Some(stem) => format!("{stem}.scale"),
        None => format!("{weight}.scale"),
    }
}

/// A table tensor of the checkpoint as the storage layer opens it: the
/// file, the weight tensor and its scale tensor's name.
pub fn table_shard(path: impl Into<std::path::PathBuf>, weight: &str) -> ShardSource {
    ShardSource::new(path, weight, Some(scale_name(weight)))
}

/// The safetensors file `k` (1-based) of `n`, Hugging Face style.
pub fn shard_file(k: usize, n: usize) -> String {
    format!("model-{k:05}-of-{n:05}.safetensors")
}

/// Where a text model's layers live (`Qwen4ExpForCausalLM`).
pub const TEXT_ROOT: &str = "model.";
/// Where the multimodal model's text layers live
/// (`Qwen4ExpForConditionalGeneration`).
pub const MULTIMODAL_ROOT: &str = "model.language_model.";

/// The tensor names of the PLE site at model layer `layer`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SiteNames {
    prefix: String,
}

impl SiteNames {
    /// Names for model layer `layer` (0-based) of a text model.
    pub fn new(layer: usize) -> Self {
        Self::with_root(TEXT_ROOT, layer)
    }

    /// Names for model layer `layer` (0-based) under `root`
    /// ([`TEXT_ROOT`] or [`MULTIMODAL_ROOT`]).
    pub fn with_root(root: &str, layer: usize) -> Self {
        SiteNames {
            prefix: format!("{root}layers.{layer}.ple."),
        }
    }

    fn name(&self, suffix: &str) -> String {
        format!("{}{suffix}", self.prefix)
    }

    /// A name of the n-gram embedding submodule (`ple_embedding.`).
    fn embedding(&self, suffix: &str) -> String {
        format!("{}ple_embedding.{suffix}", self.prefix)
    }
    /// The prefix of every tensor of the site, without its final dot.
    pub fn prefix(&self) -> &str {
        self.prefix.trim_end_matches('.')
    }

    /// `key_proj.weight`, `[C, E]`. Dense weights may be stored in any
    /// float dtype transformers saves (F32, BF16, F16); the loader converts
    /// projections to BF16 and norms and conv to F32.
    pub fn key_proj(&self) -> String {
        self.name("key_proj.weight")
    }
    /// `value_proj.weight`, `[H, E]`.
    pub fn value_proj(&self) -> String {
        self.name("value_proj.weight")
    }
    /// `norm_key.weight`, `[C]`.
    pub fn norm_key(&self) -> String {
        self.name("norm_key.weight")
    }
    /// `norm_query.weight`, `[C]`.
    pub fn norm_query(&self) -> String {
        self.name("norm_query.weight")
    }
    /// `norm_conv.weight`, `[C]`.
    pub fn norm_conv(&self) -> String {
        self.name("norm_conv.weight")
    }
    /// `conv1d.weight`, `[C, 1, K]`.
    pub fn conv1d(&self) -> String {
        self.name("conv1d.weight")
    }
    /// `ple_embedding.layer_multipliers`, `[N]` I64.
    pub fn layer_multipliers(&self) -> String {
        self.embedding("layer_multipliers")
    }
    /// `ple_embedding.ngram_heads_vocab_sizes`, `[ngram_heads]` I64.
    pub fn vocab_sizes(&self) -> String {
        self.embedding("ngram_heads_vocab_sizes")
    }
    /// `ple_embedding.ngram_heads_offsets`, `[ngram_heads]` I64.
    pub fn offsets(&self) -> String {
        self.embedding("ngram_heads_offsets")
    }
    /// `ple_embedding.ngram_embedding.shard_{i}.weight`, `[rows, head_dim]`
    /// BF16, F32 or F8_E4M3 (transformers' `torch.chunk` of the table into
    /// `split_ngram_parts`: every shard but a shorter last one equal).
    pub fn shard_weight(&self, i: usize) -> String {
        self.embedding(&format!("ngram_embedding.shard_{i}.weight"))
    }
    /// `ple_embedding.ngram_embedding.shard_{i}.scale`, `[rows]` F32 (FP8
    /// only; this project's extension).
    pub fn shard_scale(&self, i: usize) -> String {
        self.embedding(&format!("ngram_embedding.shard_{i}.scale"))
    }
    /// The shard index of `name` if it is one of this site's shard weights.
    pub fn parse_shard_weight(&self, name: &str) -> Option<usize> {
        name.strip_prefix(&self.prefix)?
            .strip_prefix("ple_embedding.ngram_embedding.shard_")?
            .strip_suffix(".weight")?
            .parse()
            .ok()
    }
}

/// An Engram checkpoint's compressed-token map (a JSON array, entry `t`
/// the compressed id of raw token `t`): optional; when present the loader
/// checks it against `engram_compressed_vocab_size` and the sites hash
/// through it.
pub const TOKEN_MAP_FILE: &str = "engram_token_map.json";

/// The tokenizer a Hugging Face checkpoint ships; an Engram checkpoint
/// without a token map has its map built from it.
pub const TOKENIZER_FILE: &str = "tokenizer.json";

/// The compressed-token map as a tensor of the checkpoint instead of
/// [`TOKEN_MAP_FILE`]: `[vocab_size]` I64, I32 or U32, listed in the index
/// like any tensor (`crate::token_map`).
pub const TOKEN_MAP_TENSOR: &str = "engram.token_map";

/// The tensor names of one layer of the Engram demo (`engram_demo_v1.py`),
/// under `model.layers.{L}.engram.` with `L` the absolute 0-based block
/// index: the module's own `state_dict` names (`multi_head_embedding`,
/// `key_projs.{b}`, `value_proj`, `norm1.{b}` (keys), `norm2.{b}`
/// (queries), `short_conv.norms.{b}`, `short_conv.conv`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EngramDemoNames {
    prefix: String,
}

impl EngramDemoNames {
    /// Names for block `layer` (0-based).
    pub fn new(layer: usize) -> Self {
        EngramDemoNames {
            prefix: format!("model.layers.{layer}.engram."),
        }
    }
    fn name(&self, suffix: &str) -> String {
        format!("{}{suffix}", self.prefix)
    }
    /// The prefix of every tensor of the layer, without its final dot.
    pub fn prefix(&self) -> &str {
        self.prefix.trim_end_matches('.')
    }
    /// `multi_head_embedding.embedding.weight`, `[rows, head_dim]` BF16:
    /// every head's rows, concatenated (unpadded).
    pub fn table(&self) -> String {
        self.name("multi_head_embedding.embedding.weight")
    }
    /// `multi_head_embedding.offsets`, `[ngram_heads]` I64: each head's
    /// first row.
    pub fn offsets(&self) -> String {
        self.name("multi_head_embedding.offsets")
    }
    /// `key_projs.{b}.weight`, `[H, E]` BF16: branch `b`'s key projection.
    pub fn key_proj(&self, b: usize) -> String {
        self.name(&format!("key_projs.{b}.weight"))
    }
    /// `key_projs.{b}.bias`, `[H]` F32.
    pub fn key_bias(&self, b: usize) -> String {
        self.name(&format!("key_projs.{b}.bias"))
    }
    /// `value_proj.weight`, `[H, E]` BF16.
    pub fn value_proj(&self) -> String {
        self.name("value_proj.weight")
    }
    /// `value_proj.bias`, `[H]` F32.
    pub fn value_bias(&self) -> String {
        self.name("value_proj.bias")
    }
    /// `norm1.{b}.weight`, `[H]` F32: branch `b`'s key norm.
    pub fn norm_key(&self, b: usize) -> String {
        self.name(&format!("norm1.{b}.weight"))
    }
    /// `norm2.{b}.weight`, `[H]` F32: branch `b`'s query (highway) norm.
    pub fn norm_query(&self, b: usize) -> String {
        self.name(&format!("norm2.{b}.weight"))
    }
    /// `short_conv.norms.{b}.weight`, `[H]` F32: branch `b`'s conv norm.
    pub fn norm_conv(&self, b: usize) -> String {
        self.name(&format!("short_conv.norms.{b}.weight"))
    }
    /// `short_conv.conv.weight`, `[C, 1, K]` F32: the depthwise conv.
    pub fn conv(&self) -> String {
        self.name("short_conv.conv.weight")
    }
}

/// The tensor names of one DeepSeek-V4.1 Engram layer, under
/// `layers.{L}.engram.` as the release spells them (no `model.` prefix).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct V41Names {
    prefix: String,
}

impl V41Names {
    /// Names for block `layer` (0-based).
    pub fn new(layer: usize) -> Self {
        V41Names {
            prefix: format!("layers.{layer}.engram."),
        }
    }
    fn name(&self, suffix: &str) -> String {
        format!("{}{suffix}", self.prefix)
    }
    /// The prefix of every tensor of the layer, without its final dot.
    pub fn prefix(&self) -> &str {
        self.prefix.trim_end_matches('.')
    }
    /// `embed.weight`, the table: U8 `[rows, head_dim + head_dim / 32]`,
    /// each row's FP8 E4M3 values then its UE8M0 scales (what the runtime
    /// serves), or as released F8_E4M3 `[rows, head_dim]` with
    /// [`V41Names::table_scale`] (converted by `table pack`).
    pub fn table(&self) -> String {
        self.name("embed.weight")
    }
    /// `embed.scale`, `[rows, head_dim / 32]` F8_E8M0: one power-of-two
    /// scale per 32 values of a row (the released layout only).
    pub fn table_scale(&self) -> String {
        self.name("embed.scale")
    }
    /// `wkv.weight`, `[(hc + 1) * H, E]` F8_E4M3: the fused projection,
    /// the `hc` key projections first, then the value projection.
    pub fn wkv(&self) -> String {
        self.name("wkv.weight")
    }
    /// `wkv.scale`, `[(hc + 1) * H / 32, E / 32]` F8_E8M0: one scale per
    /// 32 x 32 block of `wkv.weight`.
    pub fn wkv_scale(&self) -> String {
        self.name("wkv.scale")
    }
    /// `q_weight`, `[hc, H]` BF16: the query (highway) norm of each branch.
    pub fn q_weight(&self) -> String {
        self.name("q_weight")
    }
    /// `k_weight`, `[hc, H]` BF16: the key norm of each branch.
    pub fn k_weight(&self) -> String {
        self.name("k_weight")
    }
}

/// The tensor names of LongCat's n-gram embedding (one site, at the
/// input), in LongCat-Flash's spelling or LongCat-2.0's `oe_*` one.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LongCatNames {
    oe: bool,
}

impl LongCatNames {
    /// LongCat-Flash's names (`model.ngram_embeddings.*`).
    pub fn flash() -> Self {
        LongCatNames { oe: false }
    }
    /// LongCat-2.0's names (`model.oe_embed_tokens{i}`, `model.oe_embed_proj{i}`).
    pub fn oe() -> Self {
        LongCatNames { oe: true }
    }
    /// The prefix the n-gram embedding's tensors share.
    pub fn prefix(&self) -> &'static str {
        if self.oe {
            "model.oe_*"
        } else {
            "model.ngram_embeddings"
        }
    }
    /// Sub-table `i` (order-major: order `2 + i / k`, split `i % k`),
    /// `[m + 2i + 1, hidden / (k * (n - 1))]` BF16.
    pub fn sub_table(&self, i: usize) -> String {
        if self.oe {
            format!("model.oe_embed_tokens{i}.weight")
        } else {
            format!("model.ngram_embeddings.embedders.{i}.weight")
        }
    }
    /// Sub-table `i`'s projection `Linear(d -> hidden, no bias)`,
    /// `[hidden, d]` BF16.
    pub fn post_proj(&self, i: usize) -> String {
        if self.oe {
            format!("model.oe_embed_proj{i}.weight")
        } else {
            format!("model.ngram_embeddings.post_projs.{i}.weight")
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_follow_the_format() {
        let n = SiteNames::new(1);
        assert_eq!(n.key_proj(), "model.layers.1.ple.key_proj.weight");
        assert_eq!(
            n.shard_weight(3),
            "model.layers.1.ple.ple_embedding.ngram_embedding.shard_3.weight"
        );
        assert_eq!(
            n.shard_scale(0),
            "model.layers.1.ple.ple_embedding.ngram_embedding.shard_0.scale"
        );
        assert_eq!(
            n.offsets(),
            "model.layers.1.ple.ple_embedding.ngram_heads_offsets"
        );
        assert_eq!(
            SiteNames::with_root(MULTIMODAL_ROOT, 1).key_proj(),
            "model.language_model.layers.1.ple.key_proj.weight"
        );
        assert_eq!(n.parse_shard_weight(&n.shard_weight(12)), Some(12));
        assert_eq!(
            n.parse_shard_weight(&SiteNames::new(2).shard_weight(0)),
            None
        );
        assert_eq!(n.parse_shard_weight(&n.shard_scale(0)), None);
        assert_eq!(shard_file(1, 3), "model-00001-of-00003.safetensors");
    }

    #[test]
    fn family_names_are_the_released_ones() {
        let d = EngramDemoNames::new(15);
        assert_eq!(
            d.table(),
            "model.layers.15.engram.multi_head_embedding.embedding.weight"
        );
        assert_eq!(d.key_bias(3), "model.layers.15.engram.key_projs.3.bias");
        assert_eq!(
            d.norm_conv(0),
            "model.layers.15.engram.short_conv.norms.0.weight"
        );
        assert_eq!(d.conv(), "model.layers.15.engram.short_conv.conv.weight");
        let v = V41Names::new(14);
        assert_eq!(v.table(), "layers.14.engram.embed.weight");
        assert_eq!(v.table_scale(), "layers.14.engram.embed.scale");
        assert_eq!(v.wkv(), "layers.14.engram.wkv.weight");
        assert_eq!(v.q_weight(), "layers.14.engram.q_weight");
        let l = LongCatNames::flash();
        assert_eq!(
            l.sub_table(11),
            "model.ngram_embeddings.embedders.11.weight"
        );
        assert_eq!(l.post_proj(0), "model.ngram_embeddings.post_projs.0.weight");
        let o = LongCatNames::oe();
        assert_eq!(o.sub_table(2), "model.oe_embed_tokens2.weight");
        assert_eq!(o.post_proj(2), "model.oe_embed_proj2.weight");
    }
}
