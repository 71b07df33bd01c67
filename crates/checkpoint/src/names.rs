//! The file and tensor names of the checkpoint format.
//!
//! One PLE site at model layer `L` (0-based, `ple_layer_ids[s] - 1`) owns
//! every tensor under `model.layers.{L}.ple.`. These functions are the only
//! place the names are spelled, so the writer and the loader cannot drift.

/// The model configuration file.
pub const CONFIG_FILE: &str = "config.json";
/// The weight map: tensor name to safetensors file.
pub const INDEX_FILE: &str = "model.safetensors.index.json";

/// The safetensors file `k` (1-based) of `n`, Hugging Face style.
pub fn shard_file(k: usize, n: usize) -> String {
    format!("model-{k:05}-of-{n:05}.safetensors")
}

/// The tensor names of the PLE site at model layer `layer`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SiteNames {
    prefix: String,
}

impl SiteNames {
    /// Names for model layer `layer` (0-based).
    pub fn new(layer: usize) -> Self {
        SiteNames {
            prefix: format!("model.layers.{layer}.ple."),
        }
    }

    fn name(&self, suffix: &str) -> String {
        format!("{}{suffix}", self.prefix)
    }

    /// `key_proj.weight`, `[C, E]` BF16.
    pub fn key_proj(&self) -> String {
        self.name("key_proj.weight")
    }
    /// `value_proj.weight`, `[H, E]` BF16.
    pub fn value_proj(&self) -> String {
        self.name("value_proj.weight")
    }
    /// `norm_key.weight`, `[C]` F32.
    pub fn norm_key(&self) -> String {
        self.name("norm_key.weight")
    }
    /// `norm_query.weight`, `[C]` F32.
    pub fn norm_query(&self) -> String {
        self.name("norm_query.weight")
    }
    /// `norm_conv.weight`, `[C]` F32.
    pub fn norm_conv(&self) -> String {
        self.name("norm_conv.weight")
    }
    /// `conv1d.weight`, `[C, 1, K]` F32.
    pub fn conv1d(&self) -> String {
        self.name("conv1d.weight")
    }
    /// `layer_multipliers`, `[N]` I64.
    pub fn layer_multipliers(&self) -> String {
        self.name("layer_multipliers")
    }
    /// `ngram_heads_vocab_sizes`, `[ngram_heads]` I64.
    pub fn vocab_sizes(&self) -> String {
        self.name("ngram_heads_vocab_sizes")
    }
    /// `ngram_heads_offsets`, `[ngram_heads]` I64.
    pub fn offsets(&self) -> String {
        self.name("ngram_heads_offsets")
    }
    /// `ngram_embedding.shard_{i}.weight`, `[rows_per_shard, head_dim]`
    /// BF16 or F8_E4M3.
    pub fn shard_weight(&self, i: usize) -> String {
        self.name(&format!("ngram_embedding.shard_{i}.weight"))
    }
    /// `ngram_embedding.shard_{i}.scale`, `[rows_per_shard]` F32 (FP8 only).
    pub fn shard_scale(&self, i: usize) -> String {
        self.name(&format!("ngram_embedding.shard_{i}.scale"))
    }
    /// The shard index of `name` if it is one of this site's shard weights.
    pub fn parse_shard_weight(&self, name: &str) -> Option<usize> {
        name.strip_prefix(&self.prefix)?
            .strip_prefix("ngram_embedding.shard_")?
            .strip_suffix(".weight")?
            .parse()
            .ok()
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
            "model.layers.1.ple.ngram_embedding.shard_3.weight"
        );
        assert_eq!(
            n.shard_scale(0),
            "model.layers.1.ple.ngram_embedding.shard_0.scale"
        );
        assert_eq!(n.parse_shard_weight(&n.shard_weight(12)), Some(12));
        assert_eq!(
            n.parse_shard_weight(&SiteNames::new(2).shard_weight(0)),
            None
        );
        assert_eq!(n.parse_shard_weight(&n.shard_scale(0)), None);
        assert_eq!(shard_file(1, 3), "model-00001-of-00003.safetensors");
    }
}
