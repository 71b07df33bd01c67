//! The one description of a PLE model and of each of its sites.
//!
//! [`ModelSpec`] is everything `config.json` says about the PLE part of a
//! model (docs/SPEC.md, "Geometry"): it is parsed once
//! ([`ModelSpec::from_json_str`], [`ModelSpec::from_file`]) and validated
//! once ([`ModelSpec::validate`]); an error is a [`SpecError`] naming the
//! source and the field. [`ModelSpec::site`] derives one site's hash
//! constants (docs/SPEC.md, "Constant derivation") into a [`SiteSpec`],
//! which is what a layer is built from and what an engine fingerprints.
//!
//! Invariants of a validated [`ModelSpec`]: every count is at least 1,
//! `ngram_size` is in `2..=MAX_NGRAM_SIZE`, `ple_layer_ids` is non-empty,
//! 1-based, strictly increasing and at most `num_hidden_layers`,
//! `eos_token_id < vocab_size`, `rms_norm_eps` is finite and positive,
//! `table_rows` (when set) is positive, and every derived size (heads,
//! embedding width, channels, conv state, aux blob, the carry of all sites)
//! fits in an `isize`, so no later computation of a size can overflow.
//!
//! Every derived size of a site (`ngram_heads`, `emb_dim`, `channels`,
//! `state_len`, `conv_bytes`, `aux_blob_len`, `carry_bytes`) is defined on
//! [`SiteSpec`] alone; the aux blob layout itself lives in
//! [`super::carry_blob`].
//!
//! Layout: the error type is in `spec/error.rs`, [`SiteSpec`] in
//! `spec/site.rs`; each family's keys, checks, hash constants and
//! combination are in its module under `ple/family/`, reached through the
//! [`ModelFamily`] a spec holds and the registry in `ple/family.rs`. This
//! file keeps [`ModelSpec`] with its field reader ([`Fields`]) and the
//! checks every family shares.

use std::path::{Path, PathBuf};

use serde_json::{Map, Value};
use thiserror::Error;

use super::carry_blob;
use super::family;
pub use super::family::ModelFamily;
use super::ids::{DerivedPleIds, IdError, MAX_NGRAM_SIZE, PleIdDims};
pub use super::ids::{HashFamily, TokenMap};

pub mod combine;
mod error;
mod site;

pub use combine::{Combine, GateSign, GatedSpec, NormForm};
pub use error::SpecError;
pub use site::SiteSpec;

/// The config.json key of the extension this project adds for cut tables.
pub const TABLE_ROWS_KEY: &str = "ple_table_rows";

/// Largest supported `hc_mult` (parallel residual streams).
pub const MAX_HC_MULT: usize = 64;

/// Everything `config.json` says about the PLE part of a model.
#[derive(Clone, Debug, PartialEq)]
pub struct ModelSpec {
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
    /// Values per table row (`ple_head_dim`, default `hidden_size /
    /// ngram_heads` when that divides exactly).
    pub head_dim: usize,
    /// Head sizes are the primes above this.
    pub ngram_vocab_size_base: u64,
    /// The table's rows are padded to a multiple of this
    /// (`make_ngram_vocab_size_divisible_by`, default 128).
    pub divisible_by: u64,
    /// The number of table shards per site.
    pub split_ngram_parts: usize,
    /// The conv kernel size (`ple_conv_kernel_size`).
    pub conv_kernel_size: usize,
    /// The 1-based model layers that hold a PLE site, in site order.
    pub ple_layer_ids: Vec<usize>,
    /// The hash seed (`ple_hash_seed`, 1234 by default).
    pub hash_seed: u64,
    /// The number of model layers (default: the largest PLE layer id).
    pub num_hidden_layers: usize,
    /// Rows actually stored per site when the table is cut (the
    /// `ple_table_rows` extension, synthetic checkpoints only); `None` means
    /// the full padded table is stored. Ids are folded into the stored rows
    /// as `id % table_rows`.
    pub table_rows: Option<u64>,
    /// The family and what its config adds. For Engram and LongCat the
    /// shared fields read: `ngram_size` N, `heads_per_ngram` K (LongCat's
    /// split count), `ngram_vocab_size_base` the first order's base
    /// (Engram) or the row base `m` (LongCat), `hash_seed` Engram's seed,
    /// and `ple_layer_ids` the 0-based block indices plus 1.
    pub family: ModelFamily,
}

/// Reads typed fields out of a config's JSON object, naming the file on
/// error; what a family's parser and detector read a config through.
pub struct Fields<'a> {
    /// The object the keys are read from.
    pub map: &'a Map<String, Value>,
    /// The config's name in errors (usually its path).
    pub file: &'a str,
}

impl Fields<'_> {
    /// An error about `field` of this config.
    pub fn field_err(&self, field: &str, problem: String) -> SpecError {
        SpecError::Field {
            file: self.file.to_string(),
            field: field.to_string(),
            problem,
        }
    }

    /// The value of `name`, which must be present and not null.
    pub fn get(&self, name: &str) -> Result<&Value, SpecError> {
        match self.map.get(name) {
            Some(v) if !v.is_null() => Ok(v),
            _ => Err(SpecError::Missing {
                file: self.file.to_string(),
                field: name.to_string(),
            }),
        }
    }

    /// `v` (the value of `name`) as a non-negative integer.
    pub fn u64_of(&self, name: &str, v: &Value) -> Result<u64, SpecError> {
        v.as_u64()
            .ok_or_else(|| self.field_err(name, format!("must be a non-negative integer, got {v}")))
    }

    /// `name` as a non-negative integer.
    pub fn u64(&self, name: &str) -> Result<u64, SpecError> {
        self.u64_of(name, self.get(name)?)
    }

    /// `name` as a non-negative integer, `None` when absent or null.
    pub fn u64_opt(&self, name: &str) -> Result<Option<u64>, SpecError> {
        match self.map.get(name) {
            None | Some(Value::Null) => Ok(None),
            Some(v) => self.u64_of(name, v).map(Some),
        }
    }

    /// A count that must be at least `min` and fit in `usize`.
    pub fn count(&self, name: &str, min: u64) -> Result<usize, SpecError> {
        self.count_of(name, self.u64(name)?, min)
    }

    /// `v` (the value of `name`) as a count of at least `min`.
    pub fn count_of(&self, name: &str, v: u64, min: u64) -> Result<usize, SpecError> {
        if v < min {
            return Err(self.field_err(name, format!("must be at least {min}, got {v}")));
        }
        usize::try_from(v).map_err(|_| self.field_err(name, format!("= {v} is too large")))
    }

    /// `vocab_size`, at least 1.
    pub fn vocab_size(&self) -> Result<u64, SpecError> {
        let v = self.u64("vocab_size")?;
        if v == 0 {
            return Err(self.field_err("vocab_size", "must be at least 1, got 0".into()));
        }
        Ok(v)
    }

    /// The n-gram order `name`, in `2..=MAX_NGRAM_SIZE`.
    pub fn ngram_size(&self, name: &str) -> Result<usize, SpecError> {
        let n = self.count(name, 2)?;
        if n > MAX_NGRAM_SIZE {
            return Err(self.field_err(name, format!("must be at most {MAX_NGRAM_SIZE}, got {n}")));
        }
        Ok(n)
    }

    /// Whether `name` is present and not null.
    pub fn has(&self, name: &str) -> bool {
        self.map.get(name).is_some_and(|v| !v.is_null())
    }

    /// A positive finite number, `default` when absent.
    pub fn eps_or(&self, name: &str, default: f64) -> Result<f64, SpecError> {
        if !self.has(name) {
            return Ok(default);
        }
        let v = self.get(name)?;
        match v.as_f64() {
            Some(e) if e.is_finite() && e > 0.0 => Ok(e),
            _ => Err(self.field_err(name, format!("must be a positive number, got {v}"))),
        }
    }

    /// `eos_token_id`: an integer, or a list whose first entry is used.
    pub fn eos(&self) -> Result<u32, SpecError> {
        let eos = match self.get("eos_token_id")? {
            Value::Array(items) => {
                let first = items
                    .first()
                    .ok_or_else(|| self.field_err("eos_token_id", "is an empty list".into()))?;
                self.u64_of("eos_token_id[0]", first)?
            }
            v => self.u64_of("eos_token_id", v)?,
        };
        u32::try_from(eos).map_err(|_| {
            self.field_err(
                "eos_token_id",
                format!("= {eos} does not fit a u32 token id"),
            )
        })
    }

    /// `eos_token_id` when present.
    pub fn eos_opt(&self) -> Result<Option<u32>, SpecError> {
        if self.has("eos_token_id") {
            self.eos().map(Some)
        } else {
            Ok(None)
        }
    }

    /// `num_hidden_layers`, else `num_layers`, else `default`.
    pub fn layers_or(&self, default: usize) -> Result<usize, SpecError> {
        for name in ["num_hidden_layers", "num_layers"] {
            if let Some(n) = self.u64_opt(name)? {
                return self.count_of(name, n, 0);
            }
        }
        Ok(default)
    }
}

impl ModelSpec {
    /// Read, parse and validate `path`.
    pub fn from_file(path: &Path) -> Result<Self, SpecError> {
        let text = std::fs::read_to_string(path).map_err(|source| SpecError::Read {
            path: path.to_path_buf(),
            source,
        })?;
        Self::from_json_str(&text, &path.display().to_string())
    }

    /// Parse and validate config JSON; `source` names it in errors (usually
    /// the path). Unknown fields are ignored; `eos_token_id` may be an
    /// integer or a list (its first entry is used).
    pub fn from_json_str(text: &str, source: &str) -> Result<Self, SpecError> {
        let root: Value = serde_json::from_str(text).map_err(|e| SpecError::Json {
            file: source.to_string(),
            msg: e.to_string(),
        })?;
        let Some(map) = root.as_object() else {
            return Err(SpecError::NotObject {
                file: source.to_string(),
            });
        };
        let f = Fields { map, file: source };
        if let Some(d) = family::claim(&f)? {
            return (d.parse)(&f);
        }
        // Multimodal configs nest the language model's keys under
        // `text_config`; a family found there is parsed from there.
        if let Some(inner) = map.get("text_config").and_then(Value::as_object) {
            let t = Fields {
                map: inner,
                file: source,
            };
            if let Some(d) = family::claim(&t)? {
                return (d.parse)(&t);
            }
        }
        (family::fallback().parse)(&f)
    }

    /// This spec with its compressed-token map, checked by the family;
    /// `source` names the map in errors. Families without a map (all but
    /// Engram) refuse.
    pub fn with_token_map(mut self, map: TokenMap, source: &str) -> Result<Self, SpecError> {
        self.family = self.family.family().with_token_map(map, source)?;
        Ok(self)
    }

    /// The site-level family: what a hasher needs beyond the dims.
    pub fn hash_family(&self) -> HashFamily {
        self.family.family().hash_family(self)
    }

    /// Check the invariants in the module docs; `source` names the config
    /// in errors. Parsing runs this; call it on a spec built in code.
    pub fn validate(&self, source: &str) -> Result<(), SpecError> {
        let bad = |field: &str, problem: String| SpecError::Field {
            file: source.to_string(),
            field: field.to_string(),
            problem,
        };
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
                return Err(bad(name, "must be positive, got 0".into()));
            }
        }
        if self.ngram_size < 2 {
            return Err(bad(
                "ngram_size",
                format!("must be at least 2, got {}", self.ngram_size),
            ));
        }
        if !(self.rms_norm_eps.is_finite() && self.rms_norm_eps > 0.0) {
            return Err(bad(
                "rms_norm_eps",
                format!("must be a positive number, got {}", self.rms_norm_eps),
            ));
        }
        if u64::from(self.eos_token_id) >= self.vocab_size {
            return Err(bad(
                "eos_token_id",
                format!(
                    "= {} is not below vocab_size {}",
                    self.eos_token_id, self.vocab_size
                ),
            ));
        }
        if self.ple_layer_ids.is_empty() {
            return Err(bad("ple_layer_ids", "is empty (no PLE site)".into()));
        }
        for (i, &l) in self.ple_layer_ids.iter().enumerate() {
            if l == 0 {
                return Err(bad(
                    &format!("ple_layer_ids[{i}]"),
                    "is 0; layer ids are 1-based".into(),
                ));
            }
            if i > 0 && l <= self.ple_layer_ids[i - 1] {
                return Err(bad(
                    "ple_layer_ids",
                    format!("must be strictly increasing, but entry {i} is {l}"),
                ));
            }
            if l > self.num_hidden_layers {
                return Err(bad(
                    &format!("ple_layer_ids[{i}]"),
                    format!("= {l} is past num_hidden_layers {}", self.num_hidden_layers),
                ));
            }
        }
        if self.table_rows == Some(0) {
            return Err(bad(TABLE_ROWS_KEY, "must be positive, got 0".into()));
        }
        self.check_sizes(source)?;
        self.family.family().validate(self, source)
    }

    /// Every size derived from the fields must be computable: a config with
    /// absurd fields is refused here, naming them, instead of overflowing
    /// later. The limit is what an allocation can address.
    fn check_sizes(&self, source: &str) -> Result<(), SpecError> {
        const LIMIT: usize = isize::MAX as usize;
        let fits = |v: Option<usize>| v.filter(|&v| v <= LIMIT);
        let too_big = |what: &'static str| {
            Err(SpecError::TooLarge {
                file: source.to_string(),
                what,
            })
        };
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
            .and_then(|conv| carry_blob::checked_blob_len(self.ngram_size - 1, conv));
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
    /// Panics when `s` is not a site.
    pub fn site_layer(&self, s: usize) -> usize {
        self.ple_layer_ids[s] - 1
    }
    /// Bytes of one site's aux blob (every site has the same shape).
    pub fn aux_blob_bytes(&self) -> usize {
        carry_blob::blob_len(self.ngram_size - 1, self.conv_bytes())
    }
    /// Bytes of one site's conv state: `state_len * C` f32 values.
    pub fn conv_bytes(&self) -> usize {
        4 * self.state_len() * self.channels()
    }
    /// Bytes of device memory one sequence's carry holds over all sites.
    pub fn carry_bytes_per_seq(&self) -> usize {
        self.sites() * self.conv_bytes()
    }

    /// Refuse `s` when it is not a site.
    pub fn check_site(&self, s: usize) -> Result<(), SpecError> {
        if s >= self.sites() {
            return Err(SpecError::NoSuchSite {
                site: s,
                count: self.sites(),
                ids: self.ple_layer_ids.clone(),
            });
        }
        Ok(())
    }

    /// A failed derivation of site `s`'s constants, naming the site.
    pub fn derive_error(&self, s: usize, source: IdError) -> SpecError {
        SpecError::Derive {
            site: s,
            layer_id: self.ple_layer_ids[s],
            source,
        }
    }

    /// Site `s`'s derived hash constants and padded table size.
    pub fn derive(&self, s: usize) -> Result<DerivedPleIds, SpecError> {
        self.check_site(s)?;
        self.family.family().derive(self, s)
    }

    /// The spec of site `s`: its derived hash constants and carry shape.
    pub fn site(&self, s: usize) -> Result<SiteSpec, SpecError> {
        let derived = self.derive(s)?;
        Ok(self.site_with(s, derived.dims))
    }

    /// The spec of site `s` with hash constants derived elsewhere (by
    /// [`Self::derive`], whose padded row count the caller also needs).
    pub fn site_with(&self, s: usize, dims: PleIdDims) -> SiteSpec {
        SiteSpec {
            family: self.hash_family(),
            layer: self.site_layer(s),
            dims,
            head_dim: self.head_dim,
            hidden: self.hidden_size,
            hc_mult: self.hc_mult,
            kernel: self.conv_kernel_size,
            dilation: self.dilation(),
            rms_eps: self.rms_norm_eps as f32,
            combine: self.combine(),
        }
    }

    /// How the family's sites combine their rows with the highway (the
    /// family decides: see its module under `ple/family/`).
    pub fn combine(&self) -> Combine {
        self.family.family().combine(self)
    }

    /// The `config.json` text of this spec.
    pub fn to_config_json(&self) -> String {
        let mut v = self.family.family().to_json(self);
        if let Some(r) = self.table_rows {
            v[TABLE_ROWS_KEY] = serde_json::json!(r);
        }
        let mut s = serde_json::to_string_pretty(&v).expect("a JSON value always serialises");
        s.push('\n');
        s
    }
}

#[cfg(test)]
mod tests;
