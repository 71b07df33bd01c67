//! The model geometry a checkpoint's `config.json` describes, and the
//! synthetic presets `metrale-ple init` writes.
//!
//! Invariants of a [`Geometry`] returned by [`Geometry::parse`] or a preset:
//! every size is non-zero, `ple_layer_ids` is non-empty, 1-based, distinct
//! and increasing, `eos_token_id < vocab_size`, and `table_rows` (when set)
//! is a positive row count. Whether the hash constants derive is checked by
//! the loader, which names the site.

use std::path::Path;

use metrale_model_layers::layers::ple::config::PleModelConfig;
use metrale_model_layers::layers::ple::ids::PleHashParams;
use serde::Deserialize;

use crate::error::{CheckpointError, Result};

/// The config.json key of the extension this project adds for cut tables.
pub const TABLE_ROWS_KEY: &str = "ple_table_rows";

/// Everything `config.json` says about the PLE part of the model.
#[derive(Clone, Debug, PartialEq)]
pub struct Geometry {
    /// The unigram vocabulary size.
    pub vocab_size: u64,
    /// H: the width of one residual stream.
    pub hidden_size: usize,
    /// hc: the number of parallel residual streams.
    pub hc_mult: usize,
    /// The epsilon of the RMS norms.
    pub rms_norm_eps: f64,
    /// The EOS token (the first one when config.json gives a list).
    pub eos_token_id: u32,
    /// N: the largest n-gram order.
    pub ngram_size: usize,
    /// K: hash heads per order.
    pub heads_per_ngram: usize,
    /// Values per table row.
    pub head_dim: usize,
    /// Head sizes are the primes above this.
    pub ngram_vocab_size_base: u64,
    /// The table's rows are padded to a multiple of this.
    pub divisible_by: u64,
    /// The number of table shards per site.
    pub split_ngram_parts: usize,
    /// The conv kernel size.
    pub conv_kernel_size: usize,
    /// The 1-based model layers that hold a PLE site.
    pub ple_layer_ids: Vec<usize>,
    /// The hash seed (`ple_hash_seed`, 1234 by default).
    pub hash_seed: u64,
    /// The number of model layers.
    pub num_hidden_layers: usize,
    /// Rows actually stored per site when the table is cut (synthetic
    /// checkpoints only); `None` means the full padded table is stored.
    /// Ids are folded into the stored rows as `id % table_rows`.
    pub table_rows: Option<u64>,
}

/// The fields this project reads beyond the Qwen4Exp ones that
/// [`PleModelConfig`] parses.
#[derive(Deserialize)]
struct Extra {
    num_hidden_layers: Option<usize>,
    ple_table_rows: Option<u64>,
}

impl Geometry {
    /// N - 1 times K: hash heads per token.
    pub fn ngram_heads(&self) -> usize {
        (self.ngram_size - 1) * self.heads_per_ngram
    }
    /// E = ngram_heads * head_dim: the width of the gathered embedding.
    pub fn emb_dim(&self) -> usize {
        self.ngram_heads() * self.head_dim
    }
    /// C = hc * H: the channels of the gate and the conv.
    pub fn channels(&self) -> usize {
        self.hc_mult * self.hidden_size
    }
    /// The conv dilation, which equals N.
    pub fn dilation(&self) -> usize {
        self.ngram_size
    }
    /// Rows of carried conv state: `(kernel - 1) * dilation`.
    pub fn state_len(&self) -> usize {
        (self.conv_kernel_size - 1) * self.dilation()
    }
    /// The number of PLE sites.
    pub fn sites(&self) -> usize {
        self.ple_layer_ids.len()
    }
    /// The 0-based model layer of site `s` (the `{layer}` in tensor names).
    pub fn site_layer(&self, s: usize) -> usize {
        self.ple_layer_ids[s] - 1
    }
    /// Bytes of one site's aux blob (SPEC.md section 5): hist_len, the
    /// history, the conv state.
    pub fn aux_blob_bytes(&self) -> usize {
        4 + 4 * (self.ngram_size - 1) + 4 * self.state_len() * self.channels()
    }
    /// Bytes of device memory one sequence's carry holds over all sites.
    pub fn carry_bytes_per_seq(&self) -> usize {
        self.sites() * 4 * self.state_len() * self.channels()
    }
    /// The parameters that derive site `s`'s hash constants.
    pub fn hash_params(&self, s: usize) -> PleHashParams {
        PleHashParams {
            vocab_size: self.vocab_size,
            eos_token_id: self.eos_token_id,
            ngram_size: self.ngram_size,
            heads_per_ngram: self.heads_per_ngram,
            ngram_vocab_size_base: self.ngram_vocab_size_base,
            divisible_by: self.divisible_by,
            seed: self.hash_seed,
            site: s,
        }
    }

    /// Parse `config.json` text; `file` only names the source in errors.
    /// The Qwen4Exp fields are parsed by the layer crate's
    /// [`PleModelConfig`], so the checkpoint and the `ids` command read a
    /// config the same way.
    pub fn parse(file: &Path, text: &str) -> Result<Geometry> {
        let bad = |msg: String| CheckpointError::Config {
            file: file.to_path_buf(),
            msg,
        };
        let c = PleModelConfig::from_json_str(text, &file.display().to_string()).map_err(|e| {
            // The layer crate's messages start with the source; keep one.
            let m = format!("{e:#}");
            let prefix = format!("{}: ", file.display());
            bad(m.strip_prefix(&prefix).map(str::to_string).unwrap_or(m))
        })?;
        let extra: Extra = serde_json::from_str(text).map_err(|e| bad(e.to_string()))?;
        let max_layer = c.ple_layer_ids.iter().copied().max().unwrap_or(0);
        let g = Geometry {
            vocab_size: c.vocab_size,
            hidden_size: c.hidden_size,
            hc_mult: c.hc_mult,
            rms_norm_eps: c.rms_norm_eps,
            eos_token_id: c.eos_token_id,
            ngram_size: c.ngram_size,
            heads_per_ngram: c.heads_per_ngram,
            head_dim: c.ple_head_dim,
            ngram_vocab_size_base: c.ngram_vocab_size_base,
            divisible_by: c.make_ngram_vocab_size_divisible_by,
            split_ngram_parts: c.split_ngram_parts,
            conv_kernel_size: c.ple_conv_kernel_size,
            ple_layer_ids: c.ple_layer_ids,
            hash_seed: c.ple_hash_seed,
            num_hidden_layers: extra.num_hidden_layers.unwrap_or(max_layer),
            table_rows: extra.ple_table_rows,
        };
        g.check().map_err(bad)?;
        Ok(g)
    }

    /// Check the invariants in the module docs; the message names the field.
    pub fn check(&self) -> std::result::Result<(), String> {
        let positive = [
            ("vocab_size", self.vocab_size),
            ("hidden_size", self.hidden_size as u64),
            ("hc_mult", self.hc_mult as u64),
            ("heads_per_ngram", self.heads_per_ngram as u64),
            ("ple_head_dim", self.head_dim as u64),
            ("ngram_vocab_size_base", self.ngram_vocab_size_base),
            ("make_ngram_vocab_size_divisible_by", self.divisible_by),
            ("split_ngram_parts", self.split_ngram_parts as u64),
            ("ple_conv_kernel_size", self.conv_kernel_size as u64),
        ];
        for (name, v) in positive {
            if v == 0 {
                return Err(format!("field `{name}` must be positive, got 0"));
            }
        }
        if self.ngram_size < 2 {
            return Err(format!(
                "field `ngram_size` must be at least 2, got {}",
                self.ngram_size
            ));
        }
        if !(self.rms_norm_eps.is_finite() && self.rms_norm_eps > 0.0) {
            return Err(format!(
                "field `rms_norm_eps` must be a positive number, got {}",
                self.rms_norm_eps
            ));
        }
        if u64::from(self.eos_token_id) >= self.vocab_size {
            return Err(format!(
                "field `eos_token_id` = {} is not below vocab_size {}",
                self.eos_token_id, self.vocab_size
            ));
        }
        if self.ple_layer_ids.is_empty() {
            return Err("field `ple_layer_ids` is empty".into());
        }
        for (i, &l) in self.ple_layer_ids.iter().enumerate() {
            if l == 0 {
                return Err(format!(
                    "field `ple_layer_ids`[{i}] is 0; layer ids are 1-based"
                ));
            }
            if i > 0 && l <= self.ple_layer_ids[i - 1] {
                return Err(format!(
                    "field `ple_layer_ids` must be strictly increasing, but entry {i} is {l}"
                ));
            }
            if l > self.num_hidden_layers {
                return Err(format!(
                    "field `ple_layer_ids`[{i}] = {l} is past num_hidden_layers {}",
                    self.num_hidden_layers
                ));
            }
        }
        if self.table_rows == Some(0) {
            return Err(format!("field `{TABLE_ROWS_KEY}` must be positive, got 0"));
        }
        self.check_sizes()
    }

    /// Every size derived from the fields must be computable: a config with
    /// absurd fields is refused here, naming them, instead of overflowing
    /// later. The limit is what an allocation can address.
    fn check_sizes(&self) -> std::result::Result<(), String> {
        const LIMIT: usize = isize::MAX as usize;
        let fits = |v: Option<usize>| v.filter(|&v| v <= LIMIT);
        let too_big = |what: &str| Err(format!("{what} is too large to address"));
        let Some(heads) = fits((self.ngram_size - 1).checked_mul(self.heads_per_ngram)) else {
            return too_big("(ngram_size - 1) * heads_per_ngram");
        };
        if fits(heads.checked_mul(self.head_dim)).is_none() {
            return too_big("(ngram_size - 1) * heads_per_ngram * ple_head_dim");
        }
        let Some(channels) = fits(self.hc_mult.checked_mul(self.hidden_size)) else {
            return too_big("hc_mult * hidden_size");
        };
        let Some(state) = fits((self.conv_kernel_size - 1).checked_mul(self.ngram_size)) else {
            return too_big("(ple_conv_kernel_size - 1) * ngram_size");
        };
        let blob = state
            .checked_mul(channels)
            .and_then(|v| v.checked_mul(4))
            .and_then(|v| v.checked_add(self.ngram_size.checked_mul(4)?));
        let Some(blob) = fits(blob) else {
            return too_big(
                "the conv state (ple_conv_kernel_size, ngram_size, hc_mult, hidden_size)",
            );
        };
        if fits(blob.checked_mul(self.sites())).is_none() {
            return too_big("the carry of all ple_layer_ids");
        }
        Ok(())
    }

    /// The `config.json` text of this geometry.
    pub fn to_config_json(&self) -> String {
        let mut v = serde_json::json!({
            "architectures": ["Qwen4ExpForCausalLM"],
            "model_type": "qwen4exp",
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "hc_mult": self.hc_mult,
            "rms_norm_eps": self.rms_norm_eps,
            "eos_token_id": self.eos_token_id,
            "num_hidden_layers": self.num_hidden_layers,
            "ngram_size": self.ngram_size,
            "heads_per_ngram": self.heads_per_ngram,
            "ple_head_dim": self.head_dim,
            "ngram_vocab_size_base": self.ngram_vocab_size_base,
            "make_ngram_vocab_size_divisible_by": self.divisible_by,
            "split_ngram_parts": self.split_ngram_parts,
            "ple_conv_kernel_size": self.conv_kernel_size,
            "ple_layer_ids": self.ple_layer_ids,
            "ple_hash_seed": self.hash_seed,
        });
        if let Some(r) = self.table_rows {
            v[TABLE_ROWS_KEY] = serde_json::json!(r);
        }
        let mut s = serde_json::to_string_pretty(&v).expect("a JSON value always serialises");
        s.push('\n');
        s
    }
}

/// The synthetic geometries `metrale-ple init` can write.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Preset {
    /// Hidden 64, 4 streams, 4 heads of 16, two sites, a ~200k-row table
    /// per site: the model `metrale-ple run` uses by default, seconds to build.
    Tiny,
    /// Hidden 256, 4 streams, 8 heads of 32, one site, a ~2M-row table.
    Small,
    /// The Qwen4Exp geometry of SPEC.md section 2; the table is cut to the
    /// rows asked for (ids folded into them).
    Flagship,
}

impl Preset {
    /// Parse `tiny`, `small` or `flagship`.
    pub fn parse(s: &str) -> Option<Preset> {
        match s {
            "tiny" => Some(Preset::Tiny),
            "small" => Some(Preset::Small),
            "flagship" => Some(Preset::Flagship),
            _ => None,
        }
    }

    /// The preset's name.
    pub fn name(self) -> &'static str {
        match self {
            Preset::Tiny => "tiny",
            Preset::Small => "small",
            Preset::Flagship => "flagship",
        }
    }

    /// Rows stored per site when `--table-rows` is not given: the full
    /// table for tiny and small, 2^20 rows (320 MiB in BF16) for flagship.
    pub fn default_table_rows(self) -> Option<u64> {
        match self {
            Preset::Tiny | Preset::Small => None,
            Preset::Flagship => Some(1 << 20),
        }
    }

    /// The preset's geometry, with the full table.
    pub fn geometry(self) -> Geometry {
        match self {
            Preset::Tiny => Geometry {
                vocab_size: 4096,
                hidden_size: 64,
                hc_mult: 4,
                rms_norm_eps: 1e-6,
                eos_token_id: 256,
                ngram_size: 3,
                heads_per_ngram: 2,
                head_dim: 16,
                ngram_vocab_size_base: 50_000,
                divisible_by: 128,
                split_ngram_parts: 2,
                conv_kernel_size: 4,
                ple_layer_ids: vec![2, 4],
                hash_seed: 1234,
                num_hidden_layers: 4,
                table_rows: None,
            },
            Preset::Small => Geometry {
                vocab_size: 32_000,
                hidden_size: 256,
                hc_mult: 4,
                rms_norm_eps: 1e-6,
                eos_token_id: 2,
                ngram_size: 3,
                heads_per_ngram: 4,
                head_dim: 32,
                ngram_vocab_size_base: 250_000,
                divisible_by: 128,
                split_ngram_parts: 4,
                conv_kernel_size: 4,
                ple_layer_ids: vec![2],
                hash_seed: 1234,
                num_hidden_layers: 8,
                table_rows: None,
            },
            Preset::Flagship => Geometry {
                vocab_size: 151_936,
                hidden_size: 2560,
                hc_mult: 4,
                rms_norm_eps: 1e-6,
                eos_token_id: 151_645,
                ngram_size: 3,
                heads_per_ngram: 8,
                head_dim: 160,
                ngram_vocab_size_base: 20_000_000,
                divisible_by: 128,
                split_ngram_parts: 8,
                conv_kernel_size: 4,
                ple_layer_ids: vec![2],
                hash_seed: 1234,
                num_hidden_layers: 4,
                table_rows: None,
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn presets_round_trip_through_config_json() {
        for p in [Preset::Tiny, Preset::Small, Preset::Flagship] {
            let mut g = p.geometry();
            g.table_rows = p.default_table_rows();
            g.check().unwrap();
            let back = Geometry::parse(Path::new("config.json"), &g.to_config_json()).unwrap();
            assert_eq!(back, g, "{}", p.name());
        }
    }

    /// Found by the `config_json` fuzz target: a huge `hc_mult` passed the
    /// checks and overflowed in `channels()`.
    #[test]
    fn sizes_that_overflow_are_refused_by_name() {
        let base: serde_json::Value =
            serde_json::from_str(&Preset::Tiny.geometry().to_config_json()).unwrap();
        for (field, value, want) in [
            (
                "hc_mult",
                serde_json::json!(477_777_776_777_777_777u64),
                "hc_mult * hidden_size",
            ),
            (
                "hidden_size",
                serde_json::json!(u64::MAX / 2),
                "hc_mult * hidden_size",
            ),
            (
                "ple_conv_kernel_size",
                serde_json::json!(u64::MAX / 2),
                "ple_conv_kernel_size",
            ),
        ] {
            let mut v = base.clone();
            v[field] = value;
            v.as_object_mut()
                .unwrap()
                .insert("ple_head_dim".into(), serde_json::json!(16));
            let e = Geometry::parse(Path::new("c.json"), &v.to_string()).unwrap_err();
            let msg = e.to_string();
            assert!(
                msg.contains(want) && msg.contains("too large"),
                "{field}: {msg}"
            );
        }
        let mut g = Preset::Tiny.geometry();
        g.ngram_size = usize::MAX;
        assert!(g.check().unwrap_err().contains("too large"));
    }

    #[test]
    fn flagship_matches_the_spec() {
        let g = Preset::Flagship.geometry();
        assert_eq!(g.ngram_heads(), 16);
        assert_eq!(g.emb_dim(), 2560);
        assert_eq!(g.channels(), 10240);
        assert_eq!(g.state_len(), 9);
        assert_eq!(g.aux_blob_bytes(), 368_652);
    }

    #[test]
    fn eos_list_and_defaults() {
        let mut v: serde_json::Value =
            serde_json::from_str(&Preset::Tiny.geometry().to_config_json()).unwrap();
        v["eos_token_id"] = serde_json::json!([7, 9]);
        v.as_object_mut().unwrap().remove("ple_hash_seed");
        v.as_object_mut().unwrap().remove("ple_head_dim");
        let g = Geometry::parse(Path::new("c.json"), &v.to_string()).unwrap();
        assert_eq!(g.eos_token_id, 7);
        assert_eq!(g.hash_seed, 1234);
        assert_eq!(g.head_dim, 16);
    }

    #[test]
    fn bad_configs_name_the_field() {
        let base: serde_json::Value =
            serde_json::from_str(&Preset::Tiny.geometry().to_config_json()).unwrap();
        let cases: [(&str, serde_json::Value, &str); 4] = [
            ("hc_mult", serde_json::json!(0), "`hc_mult`"),
            (
                "ple_layer_ids",
                serde_json::json!([4, 2]),
                "strictly increasing",
            ),
            (
                "eos_token_id",
                serde_json::json!(5000),
                "`eos_token_id` = 5000",
            ),
            (
                "ple_table_rows",
                serde_json::json!(0),
                "`ple_table_rows` must be positive",
            ),
        ];
        for (field, val, want) in cases {
            let mut v = base.clone();
            v[field] = val;
            let e = Geometry::parse(Path::new("dir/config.json"), &v.to_string()).unwrap_err();
            let msg = e.to_string();
            assert!(
                msg.contains(want) && msg.contains("dir/config.json"),
                "{msg}"
            );
        }
        let mut v = base.clone();
        v.as_object_mut().unwrap().remove("hidden_size");
        let msg = Geometry::parse(Path::new("c.json"), &v.to_string())
            .unwrap_err()
            .to_string();
        assert!(
            msg.contains("c.json") && msg.contains("`hidden_size`"),
            "{msg}"
        );
    }
}
