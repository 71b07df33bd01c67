//! The LongCat family (docs/SPEC.md §11 (Families)): its n-gram embedding
//! configs,
//! LongCat-Flash's `ngram_vocab_size_ratio` (its presence switches the path
//! on), `emb_neighbor_num`, `emb_split_num`, and LongCat-2.0's renames
//! `oe_vocab_size_ratio`, `oe_neighbor_num`, `oe_split_num`.
//!
//! Invariants of a parsed LongCat spec: `ngram_size` is the neighbour
//! count n, `heads_per_ngram` the split count k, `ngram_vocab_size_base`
//! the row base `m = floor(ratio * vocab_size)` (sub-table `i` has
//! `m + 2i + 1` rows); one site on layer 1 (the input), no conv
//! (`conv_kernel_size` 1), unpadded rows in one part, and `hidden_size`
//! split evenly over the `k * (n - 1)` sub-tables.
//!
//! The family's hash is the polynomial one ([`HashFamily::LongCat`]) over
//! sub-tables of `m + 2i + 1` rows ([`longcat_layout`]), and its layer
//! takes the mean with the word embedding ([`Combine::Mean`]).

use serde_json::{Value, json};

use super::{Family, FamilyDesc, ModelFamily, derive_dims, same};
use crate::layers::ple::ids::{DerivedPleIds, TokenMap, longcat_layout};
use crate::layers::ple::spec::{Combine, Fields, HashFamily, ModelSpec, SpecError, TABLE_ROWS_KEY};

/// The registry entry: a config with a non-null `ngram_vocab_size_ratio`
/// or (unless `use_oe_embedding` is false) `oe_vocab_size_ratio`.
pub static DESC: FamilyDesc = FamilyDesc {
    id: "longcat",
    name: "longcat",
    title: "LongCat",
    detect: Some(detect),
    parse: |f| parse(f, keys_of(f)),
    site_layer: |site| matches!(site.family, HashFamily::LongCat { .. }).then_some(DESC.title),
};

/// The key spelling of a claimed config.
fn keys_of(f: &Fields) -> LongCatKeys {
    if f.has("ngram_vocab_size_ratio") {
        LongCatKeys::Flash
    } else {
        LongCatKeys::Oe
    }
}

/// The key that names LongCat in `f`, if any.
fn detect(f: &Fields) -> Result<Option<&'static str>, SpecError> {
    // SGLang reads `use_oe_embedding` by truthiness and vLLM ignores it:
    // only a boolean is unambiguous.
    let use_oe = match f.map.get("use_oe_embedding") {
        None | Some(Value::Null) => true,
        Some(Value::Bool(b)) => *b,
        Some(v) => {
            return Err(f.field_err(
                "use_oe_embedding",
                format!("must be true or false, got {v}"),
            ));
        }
    };
    if !use_oe && f.has("oe_vocab_size_ratio") && !f.has("ngram_vocab_size_ratio") {
        return Err(f.field_err(
            "use_oe_embedding",
            "is false: the config turns its n-gram embedding off, so it has no site to \
             serve"
                .into(),
        ));
    }
    Ok(if f.has("ngram_vocab_size_ratio") {
        Some("ngram_vocab_size_ratio")
    } else if f.has("oe_vocab_size_ratio") && use_oe {
        Some("oe_vocab_size_ratio")
    } else {
        None
    })
}

/// The config.json key of this project's extension that states `m`
/// exactly when the ratio is not an integer.
pub const ROWS_BASE_KEY: &str = "ngram_rows_base";

/// Which key spelling a config uses.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LongCatKeys {
    /// LongCat-Flash: `ngram_vocab_size_ratio`, `emb_*`.
    Flash,
    /// LongCat-2.0: `oe_vocab_size_ratio`, `oe_*`.
    Oe,
}

/// What a LongCat config adds to [`ModelSpec`]: only its spelling.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LongCatSpec {
    /// The key spelling, kept so that the config written back reads alike.
    pub keys: LongCatKeys,
}

impl Family for LongCatSpec {
    fn desc(&self) -> &'static FamilyDesc {
        &DESC
    }

    fn validate(&self, spec: &ModelSpec, source: &str) -> Result<(), SpecError> {
        let bad = |field: &str, problem: String| SpecError::Field {
            file: source.to_string(),
            field: field.to_string(),
            problem,
        };
        let (base, _, _) = key_names(self.keys);
        if spec.ple_layer_ids != [1] {
            return Err(bad(
                "ple_layer_ids",
                "must be [1]: the LongCat n-gram embedding sits at the input".into(),
            ));
        }
        longcat_layout(spec.ngram_vocab_size_base, spec.ngram_heads())
            .map(|_| ())
            .map_err(|err| bad(base, err.to_string()))
    }

    fn derive(&self, spec: &ModelSpec, s: usize) -> Result<DerivedPleIds, SpecError> {
        let (sizes, _, _) = longcat_layout(spec.ngram_vocab_size_base, spec.ngram_heads())
            .map_err(|e| spec.derive_error(s, e))?;
        // An EOS history reads as "no predecessor".
        derive_dims(spec, s, Vec::new(), sizes, spec.eos_token_id)
    }

    fn hash_family(&self, spec: &ModelSpec) -> HashFamily {
        HashFamily::LongCat {
            vocab_size: spec.vocab_size,
        }
    }

    fn combine(&self, _spec: &ModelSpec) -> Combine {
        Combine::Mean
    }

    fn to_json(&self, spec: &ModelSpec) -> Value {
        to_json(spec, self)
    }

    fn eq_family(&self, other: &dyn Family) -> bool {
        same(self, other)
    }

    fn token_map(&self) -> Option<&TokenMap> {
        None
    }
}

/// `m` from the ratio: exact for an integer ratio, else the truncated
/// double product, as the reference's `int(ratio * vocab_size)`.
fn rows_base(f: &Fields, name: &str, vocab: u64) -> Result<u64, SpecError> {
    let v = f.get(name)?;
    if let Some(r) = v.as_u64() {
        return r.checked_mul(vocab).filter(|&m| m >= 1).ok_or_else(|| {
            f.field_err(
                name,
                format!("= {r} times vocab_size {vocab} gives no usable row count"),
            )
        });
    }
    match v.as_f64() {
        Some(r) if r.is_finite() && r > 0.0 => {
            let m = (r * vocab as f64).trunc();
            if (1.0..9.0e18).contains(&m) {
                Ok(m as u64)
            } else {
                Err(f.field_err(
                    name,
                    format!("= {r} times vocab_size {vocab} gives no usable row count"),
                ))
            }
        }
        _ => Err(f.field_err(name, format!("must be a positive number, got {v}"))),
    }
}

/// The ratio, order and split keys in the spelling `keys`.
fn key_names(keys: LongCatKeys) -> (&'static str, &'static str, &'static str) {
    match keys {
        LongCatKeys::Flash => (
            "ngram_vocab_size_ratio",
            "emb_neighbor_num",
            "emb_split_num",
        ),
        LongCatKeys::Oe => ("oe_vocab_size_ratio", "oe_neighbor_num", "oe_split_num"),
    }
}

/// Parse a LongCat config whose spelling is `keys`.
fn parse(f: &Fields, keys: LongCatKeys) -> Result<ModelSpec, SpecError> {
    let (ratio_name, n_name, k_name) = key_names(keys);
    let vocab_size = f.vocab_size()?;
    let hidden_size = f.count("hidden_size", 1)?;
    let hc_mult = match f.u64_opt("hc_mult")? {
        Some(h) => f.count_of("hc_mult", h, 1)?,
        None => 1,
    };
    let rms_norm_eps = f.eps_or("rms_norm_eps", 1e-5)?;
    let eos_token_id = f.eos()?;
    let ngram_size = f.ngram_size(n_name)?;
    let heads_per_ngram = f.count(k_name, 1)?;
    let tables = (ngram_size - 1)
        .checked_mul(heads_per_ngram)
        .ok_or_else(|| f.field_err(k_name, "is too large".into()))?;
    if hidden_size % tables != 0 {
        return Err(f.field_err(
            "hidden_size",
            format!(
                "= {hidden_size} is not a multiple of the {tables} sub-tables ({k_name} * ({n_name} - 1))"
            ),
        ));
    }
    let m = match f.u64_opt(ROWS_BASE_KEY)? {
        Some(m) => {
            // The ratio must still be there and positive; `m` is exact.
            let r = f.get(ratio_name)?;
            if !r.as_f64().is_some_and(|r| r.is_finite() && r > 0.0) {
                return Err(f.field_err(ratio_name, format!("must be a positive number, got {r}")));
            }
            if m == 0 {
                return Err(f.field_err(ROWS_BASE_KEY, "must be at least 1, got 0".into()));
            }
            m
        }
        None => rows_base(f, ratio_name, vocab_size)?,
    };
    let num_hidden_layers = match f.u64_opt("num_hidden_layers")? {
        Some(n) => f.count_of("num_hidden_layers", n, 1)?,
        None => f.layers_or(1)?,
    };
    let spec = ModelSpec {
        vocab_size,
        hidden_size,
        hc_mult,
        rms_norm_eps,
        eos_token_id,
        ngram_size,
        heads_per_ngram,
        head_dim: hidden_size / tables,
        ngram_vocab_size_base: m,
        divisible_by: 1,
        split_ngram_parts: 1,
        conv_kernel_size: 1,
        ple_layer_ids: vec![1],
        hash_seed: 0,
        num_hidden_layers,
        table_rows: f.u64_opt(TABLE_ROWS_KEY)?,
        family: ModelFamily::new(LongCatSpec { keys }),
    };
    spec.validate(f.file)?;
    Ok(spec)
}

/// The config.json object of a LongCat spec, in its own spelling.
fn to_json(spec: &ModelSpec, l: &LongCatSpec) -> Value {
    let (ratio_name, n_name, k_name) = key_names(l.keys);
    let m = spec.ngram_vocab_size_base;
    let mut v = json!({
        "vocab_size": spec.vocab_size,
        "hidden_size": spec.hidden_size,
        "hc_mult": spec.hc_mult,
        "rms_norm_eps": spec.rms_norm_eps,
        "eos_token_id": spec.eos_token_id,
        "num_hidden_layers": spec.num_hidden_layers,
    });
    if m.is_multiple_of(spec.vocab_size) {
        v[ratio_name] = json!(m / spec.vocab_size);
    } else {
        v[ratio_name] = json!(m as f64 / spec.vocab_size as f64);
        v[ROWS_BASE_KEY] = json!(m);
    }
    v[n_name] = json!(spec.ngram_size);
    v[k_name] = json!(spec.heads_per_ngram);
    v
}
