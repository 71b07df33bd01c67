//! The PLE fields of a Qwen4Exp `config.json`, parsed and checked.
//!
//! Unknown fields are ignored; a missing required field, a value of the
//! wrong type or out of range is an error naming the field and the file.
//! `eos_token_id` may be an integer or a list (its first entry is used).
//!
//! Invariants of a parsed [`PleModelConfig`]: every count is at least 1,
//! `ngram_size` is in `2..=MAX_NGRAM_SIZE`, `ple_layer_ids` is non-empty
//! with distinct entries of at least 1, `rms_norm_eps` is finite and
//! positive, and `ple_head_dim` is set (given, or `hidden_size /
//! ngram_heads` when that divides exactly).

use std::path::Path;

use anyhow::{Context as _, Result, bail};
use serde_json::{Map, Value};

use super::ids::{DEFAULT_DIVISIBLE_BY, DEFAULT_HASH_SEED, MAX_NGRAM_SIZE, PleHashParams};

/// The PLE-relevant part of a Qwen4Exp `config.json`.
#[derive(Clone, Debug, PartialEq)]
pub struct PleModelConfig {
    /// Unigram vocabulary size.
    pub vocab_size: u64,
    /// H: the residual width of one stream.
    pub hidden_size: usize,
    /// Parallel residual streams (hyper-connections).
    pub hc_mult: usize,
    /// Epsilon of the grouped RMS norms.
    pub rms_norm_eps: f64,
    /// EOS (the first entry when the file gives a list).
    pub eos_token_id: u32,
    /// N: the largest n-gram order.
    pub ngram_size: usize,
    /// K: heads per order.
    pub heads_per_ngram: usize,
    /// Head sizes are the primes at or above this.
    pub ngram_vocab_size_base: u64,
    /// The table's rows are padded to a multiple of this (default 128).
    pub make_ngram_vocab_size_divisible_by: u64,
    /// How many shards the table is split into in the checkpoint.
    pub split_ngram_parts: usize,
    /// Kernel size of the dilated causal conv.
    pub ple_conv_kernel_size: usize,
    /// 1-based layer numbers that carry a PLE site, in site order.
    pub ple_layer_ids: Vec<usize>,
    /// Hash seed (default 1234).
    pub ple_hash_seed: u64,
    /// Width of one table row (default `hidden_size / ngram_heads`).
    pub ple_head_dim: usize,
}

/// Reads typed fields out of the JSON object, naming the file on error.
struct Fields<'a> {
    map: &'a Map<String, Value>,
    source: &'a str,
}

impl Fields<'_> {
    fn get(&self, name: &str) -> Result<&Value> {
        match self.map.get(name) {
            Some(v) if !v.is_null() => Ok(v),
            _ => bail!("{}: missing required field `{name}`", self.source),
        }
    }

    fn u64_of(&self, name: &str, v: &Value) -> Result<u64> {
        v.as_u64().with_context(|| {
            format!(
                "{}: field `{name}` must be a non-negative integer, got {v}",
                self.source
            )
        })
    }

    fn u64(&self, name: &str) -> Result<u64> {
        self.u64_of(name, self.get(name)?)
    }

    fn u64_or(&self, name: &str, default: u64) -> Result<u64> {
        match self.map.get(name) {
            None | Some(Value::Null) => Ok(default),
            Some(v) => self.u64_of(name, v),
        }
    }

    /// A count that must be at least `min` and fit in `usize`.
    fn count(&self, name: &str, min: u64) -> Result<usize> {
        self.count_of(name, self.u64(name)?, min)
    }

    fn count_of(&self, name: &str, v: u64, min: u64) -> Result<usize> {
        if v < min {
            bail!(
                "{}: field `{name}` must be at least {min}, got {v}",
                self.source
            );
        }
        usize::try_from(v)
            .with_context(|| format!("{}: field `{name}` = {v} is too large", self.source))
    }
}

impl PleModelConfig {
    /// Read and parse `path`.
    pub fn from_file(path: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(path)
            .with_context(|| format!("cannot read config {}", path.display()))?;
        Self::from_json_str(&text, &path.display().to_string())
    }

    /// Parse config JSON; `source` names it in errors (usually the path).
    pub fn from_json_str(text: &str, source: &str) -> Result<Self> {
        let root: Value =
            serde_json::from_str(text).with_context(|| format!("{source}: not valid JSON"))?;
        let Some(map) = root.as_object() else {
            bail!("{source}: the top level must be a JSON object");
        };
        let f = Fields { map, source };

        let vocab_size = f.u64("vocab_size")?;
        if vocab_size == 0 {
            bail!("{source}: field `vocab_size` must be at least 1, got 0");
        }
        let hidden_size = f.count("hidden_size", 1)?;
        let hc_mult = f.count("hc_mult", 1)?;
        let eps_v = f.get("rms_norm_eps")?;
        let rms_norm_eps = match eps_v.as_f64() {
            Some(e) if e.is_finite() && e > 0.0 => e,
            _ => bail!("{source}: field `rms_norm_eps` must be a positive number, got {eps_v}"),
        };

        let eos_v = f.get("eos_token_id")?;
        let eos = match eos_v {
            Value::Array(items) => {
                let first = items
                    .first()
                    .with_context(|| format!("{source}: field `eos_token_id` is an empty list"))?;
                f.u64_of("eos_token_id[0]", first)?
            }
            v => f.u64_of("eos_token_id", v)?,
        };
        let eos_token_id = u32::try_from(eos).with_context(|| {
            format!("{source}: field `eos_token_id` = {eos} does not fit a u32 token id")
        })?;

        let ngram_size = f.count("ngram_size", 2)?;
        if ngram_size > MAX_NGRAM_SIZE {
            bail!(
                "{source}: field `ngram_size` must be at most {MAX_NGRAM_SIZE}, got {ngram_size}"
            );
        }
        let heads_per_ngram = f.count("heads_per_ngram", 1)?;
        let ngram_vocab_size_base = f.u64("ngram_vocab_size_base")?;
        let divisible = f.u64_or("make_ngram_vocab_size_divisible_by", DEFAULT_DIVISIBLE_BY)?;
        let make_ngram_vocab_size_divisible_by =
            f.count_of("make_ngram_vocab_size_divisible_by", divisible, 1)? as u64;
        let split_ngram_parts = f.count("split_ngram_parts", 1)?;
        let ple_conv_kernel_size = f.count("ple_conv_kernel_size", 1)?;

        let ids_v = f.get("ple_layer_ids")?;
        let Some(items) = ids_v.as_array() else {
            bail!("{source}: field `ple_layer_ids` must be a list of layer numbers, got {ids_v}");
        };
        if items.is_empty() {
            bail!("{source}: field `ple_layer_ids` is empty (no PLE site)");
        }
        let mut ple_layer_ids = Vec::with_capacity(items.len());
        for (i, v) in items.iter().enumerate() {
            let name = format!("ple_layer_ids[{i}]");
            let n = f.count_of(&name, f.u64_of(&name, v)?, 1)?;
            if ple_layer_ids.contains(&n) {
                bail!("{source}: field `ple_layer_ids` lists layer {n} twice");
            }
            ple_layer_ids.push(n);
        }
        let ple_hash_seed = f.u64_or("ple_hash_seed", DEFAULT_HASH_SEED)?;

        let ngram_heads = (ngram_size - 1)
            .checked_mul(heads_per_ngram)
            .with_context(|| format!("{source}: (ngram_size - 1) * heads_per_ngram overflows"))?;
        let ple_head_dim = match map.get("ple_head_dim") {
            None | Some(Value::Null) => {
                if hidden_size % ngram_heads != 0 {
                    bail!(
                        "{source}: field `ple_head_dim` is absent and hidden_size {hidden_size} \
                         is not a multiple of ngram_heads {ngram_heads}"
                    );
                }
                hidden_size / ngram_heads
            }
            Some(v) => {
                let d = f.u64_of("ple_head_dim", v)?;
                f.count_of("ple_head_dim", d, 1)?
            }
        };

        Ok(Self {
            vocab_size,
            hidden_size,
            hc_mult,
            rms_norm_eps,
            eos_token_id,
            ngram_size,
            heads_per_ngram,
            ngram_vocab_size_base,
            make_ngram_vocab_size_divisible_by,
            split_ngram_parts,
            ple_conv_kernel_size,
            ple_layer_ids,
            ple_hash_seed,
            ple_head_dim,
        })
    }

    /// `(ngram_size - 1) * heads_per_ngram`: ids (table rows) per token.
    pub fn ngram_heads(&self) -> usize {
        (self.ngram_size - 1) * self.heads_per_ngram
    }

    /// The hash parameters of PLE site `site` (its position in
    /// `ple_layer_ids`, not its layer number).
    pub fn hash_params(&self, site: usize) -> Result<PleHashParams> {
        if site >= self.ple_layer_ids.len() {
            bail!(
                "PLE site {site} does not exist: ple_layer_ids has {} entries ({:?})",
                self.ple_layer_ids.len(),
                self.ple_layer_ids
            );
        }
        Ok(PleHashParams {
            vocab_size: self.vocab_size,
            eos_token_id: self.eos_token_id,
            ngram_size: self.ngram_size,
            heads_per_ngram: self.heads_per_ngram,
            ngram_vocab_size_base: self.ngram_vocab_size_base,
            divisible_by: self.make_ngram_vocab_size_divisible_by,
            seed: self.ple_hash_seed,
            site,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const FLAGSHIP: &str = r#"{
        "architectures": ["Qwen4ExpForCausalLM"],
        "vocab_size": 151936, "hidden_size": 2560, "hc_mult": 4,
        "rms_norm_eps": 1e-6, "eos_token_id": [151645, 151643],
        "ngram_size": 3, "heads_per_ngram": 8, "ngram_vocab_size_base": 20000000,
        "split_ngram_parts": 16, "ple_conv_kernel_size": 4, "ple_layer_ids": [2]
    }"#;

    fn with(field: &str, value: &str) -> String {
        let mut v: Value = serde_json::from_str(FLAGSHIP).unwrap();
        if value == "DELETE" {
            v.as_object_mut().unwrap().remove(field);
        } else {
            v[field] = serde_json::from_str(value).unwrap();
        }
        v.to_string()
    }

    #[test]
    fn flagship_with_defaults() {
        let c = PleModelConfig::from_json_str(FLAGSHIP, "config.json").unwrap();
        assert_eq!(c.eos_token_id, 151_645);
        assert_eq!(c.make_ngram_vocab_size_divisible_by, 128);
        assert_eq!(c.ple_hash_seed, 1234);
        assert_eq!(c.ple_head_dim, 160);
        assert_eq!(c.ngram_heads(), 16);
        let d = c.hash_params(0).unwrap().derive().unwrap();
        assert_eq!(d.padded_rows, 320_001_536);
        let e = c.hash_params(1).unwrap_err().to_string();
        assert!(e.contains("site 1") && e.contains("1 entries"), "{e}");
    }

    #[test]
    fn eos_as_int_and_explicit_options() {
        let text = with("eos_token_id", "7");
        let c = PleModelConfig::from_json_str(&text, "c.json").unwrap();
        assert_eq!(c.eos_token_id, 7);
        let mut v: Value = serde_json::from_str(FLAGSHIP).unwrap();
        v["ple_hash_seed"] = 99.into();
        v["make_ngram_vocab_size_divisible_by"] = 64.into();
        v["ple_head_dim"] = 128.into();
        let c = PleModelConfig::from_json_str(&v.to_string(), "c.json").unwrap();
        assert_eq!(
            (
                c.ple_hash_seed,
                c.make_ngram_vocab_size_divisible_by,
                c.ple_head_dim
            ),
            (99, 64, 128)
        );
    }

    #[test]
    fn errors_name_field_and_file() {
        let cases = [
            (
                "vocab_size",
                "DELETE",
                "missing required field `vocab_size`",
            ),
            ("ngram_size", "null", "missing required field `ngram_size`"),
            ("ngram_size", "1", "`ngram_size` must be at least 2"),
            (
                "ngram_size",
                "\"3\"",
                "`ngram_size` must be a non-negative integer",
            ),
            (
                "heads_per_ngram",
                "-1",
                "`heads_per_ngram` must be a non-negative integer",
            ),
            ("eos_token_id", "[]", "`eos_token_id` is an empty list"),
            ("eos_token_id", "[\"x\"]", "`eos_token_id[0]` must be"),
            ("eos_token_id", "4294967296", "does not fit a u32"),
            (
                "rms_norm_eps",
                "0",
                "`rms_norm_eps` must be a positive number",
            ),
            ("ple_layer_ids", "[]", "`ple_layer_ids` is empty"),
            (
                "ple_layer_ids",
                "[2, 0]",
                "`ple_layer_ids[1]` must be at least 1",
            ),
            ("ple_layer_ids", "[2, 2]", "lists layer 2 twice"),
            ("ple_layer_ids", "2", "must be a list"),
            ("hidden_size", "2561", "not a multiple of ngram_heads 16"),
            (
                "make_ngram_vocab_size_divisible_by",
                "0",
                "must be at least 1",
            ),
        ];
        for (field, value, want) in cases {
            let e = PleModelConfig::from_json_str(&with(field, value), "model/config.json")
                .unwrap_err();
            let msg = format!("{e:#}");
            assert!(msg.contains(want), "{field}={value}: {msg}");
            assert!(msg.contains("model/config.json"), "{msg}");
        }
        let e = PleModelConfig::from_json_str("[1]", "a.json")
            .unwrap_err()
            .to_string();
        assert!(e.contains("a.json") && e.contains("JSON object"), "{e}");
        let e = format!(
            "{:#}",
            PleModelConfig::from_json_str("{", "b.json").unwrap_err()
        );
        assert!(e.contains("b.json: not valid JSON"), "{e}");
        let e = format!(
            "{:#}",
            PleModelConfig::from_file(Path::new("/nonexistent/c.json")).unwrap_err()
        );
        assert!(e.contains("/nonexistent/c.json"), "{e}");
    }
}
