//! The Qwen4-Exp family: configs as transformers' `Qwen4ExpTextConfig`
//! reads and writes them (docs/SPEC.md §2 (Geometry)), its hash constants
//! (docs/SPEC.md §3 (Constant derivation): [`PleHashParams`]) and its gated
//! layer with the short conv. It is the fallback family: a config no other
//! family claims is read as Qwen4-Exp.
//!
//! The keys are transformers' (`hc_count`, `seed`, `ple_embed_dim`, ...),
//! and an absent key takes transformers' default, so a config means here
//! what it means to `from_pretrained`. The multimodal
//! `Qwen4ExpForConditionalGeneration` config nests the same keys under
//! `text_config`. This project's earlier spellings (`hc_mult`,
//! `ple_hash_seed`, `ple_head_dim`) are still read; a config that gives an
//! old and a new spelling of one value with two different values is
//! refused, since either reading would change the ids or the layer.
//!
//! Invariant: every key of `Qwen4ExpTextConfig` that changes the PLE math
//! is read here or refused: `vocab_size`, `hidden_size`, `hc_count`,
//! `rms_norm_eps`, `eos_token_id`, `ngram_size`, `heads_per_ngram`,
//! `ngram_vocab_size_base`, `make_ngram_vocab_size_divisible_by`,
//! `split_ngram_parts`, `ple_conv_kernel_size`, `ple_embed_dim`, `seed`,
//! `ple_layer_ids` (sorted and deduplicated, as transformers does: a site's
//! index, which seeds its hash, is its rank in that order) and, to refuse
//! what transformers refuses, `layer_types` (PLE sits on linear-attention
//! layers only).

use serde_json::{Value, json};

use super::{Family, FamilyDesc, ModelFamily, same};
use crate::layers::ple::ids::{DerivedPleIds, PleHashParams};
use crate::layers::ple::spec::{Combine, Fields, HashFamily, ModelSpec, SpecError, TABLE_ROWS_KEY};

/// The registry entry: every config no other family claims.
pub static DESC: FamilyDesc = FamilyDesc {
    id: "qwen4-exp",
    name: "qwen4exp",
    title: "Qwen4-Exp",
    detect: None,
    parse,
    site_layer: |site| (site.family == HashFamily::Qwen4Exp).then_some(DESC.title),
};

/// The Qwen4-Exp family: its config adds nothing to the shared fields of
/// [`ModelSpec`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Qwen4Exp;

impl Family for Qwen4Exp {
    fn desc(&self) -> &'static FamilyDesc {
        &DESC
    }
    fn validate(&self, _spec: &ModelSpec, _source: &str) -> Result<(), SpecError> {
        Ok(())
    }
    fn derive(&self, spec: &ModelSpec, s: usize) -> Result<DerivedPleIds, SpecError> {
        hash_params(spec, s)?
            .derive()
            .map_err(|source| spec.derive_error(s, source))
    }
    fn hash_family(&self, _spec: &ModelSpec) -> HashFamily {
        HashFamily::Qwen4Exp
    }
    fn combine(&self, _spec: &ModelSpec) -> Combine {
        Combine::qwen4exp()
    }
    fn to_json(&self, spec: &ModelSpec) -> Value {
        to_json(spec)
    }
    fn eq_family(&self, other: &dyn Family) -> bool {
        same(self, other)
    }
}

/// The parameters that derive site `s`'s hash constants (a Qwen4-Exp spec
/// only).
pub fn hash_params(spec: &ModelSpec, s: usize) -> Result<PleHashParams, SpecError> {
    if spec.family.get::<Qwen4Exp>().is_none() {
        return Err(SpecError::Site {
            field: "family",
            problem: format!(
                "{} has no Qwen4Exp hash parameters; derive its sites with ModelSpec::derive",
                spec.family.name()
            ),
        });
    }
    spec.check_site(s)?;
    Ok(PleHashParams {
        vocab_size: spec.vocab_size,
        eos_token_id: spec.eos_token_id,
        ngram_size: spec.ngram_size,
        heads_per_ngram: spec.heads_per_ngram,
        ngram_vocab_size_base: spec.ngram_vocab_size_base,
        divisible_by: spec.divisible_by,
        seed: spec.hash_seed,
        site: s,
    })
}

/// `model_type` of the text model.
pub const MODEL_TYPE: &str = "qwen4_exp_text";
/// `model_type` of the multimodal model, whose keys sit under `text_config`.
pub const MULTIMODAL_MODEL_TYPE: &str = "qwen4_exp";
/// The layer type PLE may sit on.
pub const LINEAR_ATTENTION: &str = "linear_attention";
/// The other layer type (`full_attention` is read as this one).
pub const INDEXED_ATTENTION: &str = "indexed_attention";

/// transformers' `Qwen4ExpTextConfig` defaults, used for absent keys.
pub mod defaults {
    /// `vocab_size`.
    pub const VOCAB_SIZE: u64 = 248_320;
    /// `hidden_size`.
    pub const HIDDEN_SIZE: u64 = 2048;
    /// `hc_count`.
    pub const HC_COUNT: u64 = 4;
    /// `rms_norm_eps`.
    pub const RMS_NORM_EPS: f64 = 1e-6;
    /// `ngram_size`.
    pub const NGRAM_SIZE: u64 = 3;
    /// `heads_per_ngram`.
    pub const HEADS_PER_NGRAM: u64 = 8;
    /// `ngram_vocab_size_base`.
    pub const NGRAM_VOCAB_SIZE_BASE: u64 = 20_000_000;
    /// `make_ngram_vocab_size_divisible_by`.
    pub const DIVISIBLE_BY: u64 = crate::layers::ple::ids::DEFAULT_DIVISIBLE_BY;
    /// `split_ngram_parts`.
    pub const SPLIT_NGRAM_PARTS: u64 = 512;
    /// `ple_conv_kernel_size`.
    pub const CONV_KERNEL_SIZE: u64 = 4;
    /// `seed`.
    pub const SEED: u64 = crate::layers::ple::ids::DEFAULT_HASH_SEED;
    /// `num_hidden_layers`.
    pub const NUM_HIDDEN_LAYERS: u64 = 40;
    /// `full_attention_interval`: without `layer_types`, every layer whose
    /// 1-based number is a multiple of it is an attention layer.
    pub const FULL_ATTENTION_INTERVAL: u64 = 4;
}

/// Whether `map` is a transformers Qwen4-Exp config (by `model_type`).
fn is_transformers(f: &Fields) -> bool {
    matches!(
        f.map.get("model_type").and_then(Value::as_str),
        Some(MODEL_TYPE | MULTIMODAL_MODEL_TYPE)
    )
}

/// The fields a Qwen4-Exp config keeps its keys in: `text_config` when the
/// top level has none of its own PLE keys and nests them there.
fn text_fields<'a>(f: &Fields<'a>) -> Fields<'a> {
    if !f.has("ple_layer_ids")
        && let Some(inner) = f.map.get("text_config").and_then(Value::as_object)
    {
        return Fields {
            map: inner,
            file: f.file,
        };
    }
    Fields {
        map: f.map,
        file: f.file,
    }
}

/// A count under its transformers key `new`, or this project's earlier
/// key `old`; both given with different values is an error.
fn count_either(
    f: &Fields,
    new: &str,
    old: &str,
    default: Option<u64>,
    min: u64,
) -> Result<Option<usize>, SpecError> {
    let (a, b) = (f.u64_opt(new)?, f.u64_opt(old)?);
    let v = match (a, b) {
        (Some(a), Some(b)) if a != b => {
            return Err(f.field_err(
                new,
                format!("= {a}, but the older key `{old}` says {b}; give one of them"),
            ));
        }
        (Some(a), _) => Some((new, a)),
        (None, Some(b)) => Some((old, b)),
        (None, None) => default.map(|d| (new, d)),
    };
    v.map(|(name, v)| f.count_of(name, v, min)).transpose()
}

/// A count with transformers' default.
fn count_or(f: &Fields, name: &str, default: u64, min: u64) -> Result<usize, SpecError> {
    let v = f.u64_opt(name)?.unwrap_or(default);
    f.count_of(name, v, min)
}

/// Parse a Qwen4-Exp config (top level or `text_config`).
fn parse(top: &Fields) -> Result<ModelSpec, SpecError> {
    let f = text_fields(top);
    let transformers = is_transformers(&f) || is_transformers(top);
    let vocab_size = f.u64_opt("vocab_size")?.unwrap_or(defaults::VOCAB_SIZE);
    if vocab_size == 0 {
        return Err(f.field_err("vocab_size", "must be at least 1, got 0".into()));
    }
    let hidden_size = count_or(&f, "hidden_size", defaults::HIDDEN_SIZE, 1)?;
    let hc_mult = count_either(&f, "hc_count", "hc_mult", Some(defaults::HC_COUNT), 1)?
        .expect("a default is given");
    let rms_norm_eps = f.eps_or("rms_norm_eps", defaults::RMS_NORM_EPS)?;
    let eos_token_id = f.eos()?;
    let ngram_size = match f.u64_opt("ngram_size")? {
        Some(_) => f.ngram_size("ngram_size")?,
        None => defaults::NGRAM_SIZE as usize,
    };
    let heads_per_ngram = count_or(&f, "heads_per_ngram", defaults::HEADS_PER_NGRAM, 1)?;
    let ngram_vocab_size_base = f
        .u64_opt("ngram_vocab_size_base")?
        .unwrap_or(defaults::NGRAM_VOCAB_SIZE_BASE);
    let divisible_by = count_or(
        &f,
        "make_ngram_vocab_size_divisible_by",
        defaults::DIVISIBLE_BY,
        1,
    )? as u64;
    let split_ngram_parts = count_or(&f, "split_ngram_parts", defaults::SPLIT_NGRAM_PARTS, 1)?;
    let conv_kernel_size = count_or(&f, "ple_conv_kernel_size", defaults::CONV_KERNEL_SIZE, 1)?;
    let hash_seed = count_either(&f, "seed", "ple_hash_seed", Some(defaults::SEED), 0)?
        .expect("a default is given") as u64;

    let ids_v = f.get("ple_layer_ids")?;
    let Some(items) = ids_v.as_array() else {
        return Err(f.field_err(
            "ple_layer_ids",
            format!("must be a list of layer numbers, got {ids_v}"),
        ));
    };
    if items.is_empty() {
        return Err(f.field_err("ple_layer_ids", "is empty (no PLE site)".into()));
    }
    let mut ple_layer_ids = Vec::with_capacity(items.len());
    for (i, v) in items.iter().enumerate() {
        let name = format!("ple_layer_ids[{i}]");
        ple_layer_ids.push(f.count_of(&name, f.u64_of(&name, v)?, 1)?);
    }
    ple_layer_ids.sort_unstable();
    ple_layer_ids.dedup();

    let ngram_heads = (ngram_size - 1)
        .checked_mul(heads_per_ngram)
        .ok_or_else(|| SpecError::TooLarge {
            file: f.file.to_string(),
            what: "(ngram_size - 1) * heads_per_ngram",
        })?;
    let head_dim = head_dim(&f, hidden_size, ngram_heads)?;
    let num_hidden_layers = match f.u64_opt("num_hidden_layers")? {
        Some(n) => f.count_of("num_hidden_layers", n, 0)?,
        // transformers' default; a config of this project's earlier layout
        // has no model_type and sized the model by its last PLE layer.
        None if transformers => defaults::NUM_HIDDEN_LAYERS as usize,
        None => ple_layer_ids.iter().copied().max().unwrap_or(0),
    };
    check_layer_types(&f, &ple_layer_ids, num_hidden_layers, transformers)?;
    let table_rows = f.u64_opt(TABLE_ROWS_KEY)?;
    let spec = ModelSpec {
        vocab_size,
        hidden_size,
        hc_mult,
        rms_norm_eps,
        eos_token_id,
        ngram_size,
        heads_per_ngram,
        head_dim,
        ngram_vocab_size_base,
        divisible_by,
        split_ngram_parts,
        conv_kernel_size,
        ple_layer_ids,
        hash_seed,
        num_hidden_layers,
        table_rows,
        family: ModelFamily::new(Qwen4Exp),
    };
    spec.validate(f.file)?;
    Ok(spec)
}

/// Values per row: `ple_embed_dim / ngram_heads` (transformers; the width
/// defaults to `hidden_size`), or the older `ple_head_dim`.
fn head_dim(f: &Fields, hidden_size: usize, ngram_heads: usize) -> Result<usize, SpecError> {
    let embed = f.u64_opt("ple_embed_dim")?;
    let old = f.u64_opt("ple_head_dim")?;
    if let Some(d) = old {
        let d = f.count_of("ple_head_dim", d, 1)?;
        if let Some(e) = embed
            && Some(e) != (d as u64).checked_mul(ngram_heads as u64)
        {
            return Err(f.field_err(
                "ple_embed_dim",
                format!(
                    "= {e}, but the older key `ple_head_dim` = {d} gives {d} * {ngram_heads} \
                     heads; give one of them"
                ),
            ));
        }
        return Ok(d);
    }
    let (name, e) = match embed {
        Some(e) => ("ple_embed_dim", f.count_of("ple_embed_dim", e, 1)?),
        None => ("hidden_size (ple_embed_dim's default)", hidden_size),
    };
    if e % ngram_heads != 0 {
        return Err(f.field_err(
            "ple_embed_dim",
            format!(
                "{name} = {e} is not a multiple of the {ngram_heads} n-gram heads \
                 ((ngram_size - 1) * heads_per_ngram)"
            ),
        ));
    }
    Ok(e / ngram_heads)
}

/// transformers builds PLE on linear-attention layers only and refuses a
/// config that puts it elsewhere; so does this parser. Without
/// `layer_types`, a transformers config takes its default pattern.
fn check_layer_types(
    f: &Fields,
    ple_layer_ids: &[usize],
    num_hidden_layers: usize,
    transformers: bool,
) -> Result<(), SpecError> {
    let types: Vec<String> = match f.map.get("layer_types") {
        Some(Value::Array(items)) => {
            let mut out = Vec::with_capacity(items.len());
            for (i, v) in items.iter().enumerate() {
                let Some(t) = v.as_str() else {
                    return Err(f.field_err(
                        &format!("layer_types[{i}]"),
                        format!("must be a string, got {v}"),
                    ));
                };
                out.push(match t {
                    "full_attention" => INDEXED_ATTENTION.to_string(),
                    LINEAR_ATTENTION | INDEXED_ATTENTION => t.to_string(),
                    other => {
                        return Err(f.field_err(
                            &format!("layer_types[{i}]"),
                            format!(
                                "is `{other}`; Qwen4-Exp layers are `{LINEAR_ATTENTION}` or \
                                 `{INDEXED_ATTENTION}`"
                            ),
                        ));
                    }
                });
            }
            if out.len() != num_hidden_layers {
                return Err(f.field_err(
                    "layer_types",
                    format!(
                        "has {} entries for num_hidden_layers {num_hidden_layers}",
                        out.len()
                    ),
                ));
            }
            out
        }
        None | Some(Value::Null) if transformers => {
            let every = f
                .u64_opt("full_attention_interval")?
                .unwrap_or(defaults::FULL_ATTENTION_INTERVAL)
                .max(1) as usize;
            default_layer_types(num_hidden_layers, every)
        }
        None | Some(Value::Null) => return Ok(()),
        Some(v) => {
            return Err(f.field_err(
                "layer_types",
                format!("must be a list of layer types, got {v}"),
            ));
        }
    };
    for (i, &l) in ple_layer_ids.iter().enumerate() {
        match types.get(l - 1) {
            Some(t) if t == LINEAR_ATTENTION => {}
            Some(t) => {
                return Err(f.field_err(
                    &format!("ple_layer_ids[{i}]"),
                    format!(
                        "= {l} is a `{t}` layer; Qwen4-Exp puts PLE on `{LINEAR_ATTENTION}` \
                         layers only (layer_types[{}])",
                        l - 1
                    ),
                ));
            }
            // Past the last layer: validation names it.
            None => {}
        }
    }
    Ok(())
}

/// transformers' default `layer_types`: layer `i` (0-based) is an
/// attention layer when `i + 1` is a multiple of `every`.
pub fn default_layer_types(layers: usize, every: usize) -> Vec<String> {
    (0..layers)
        .map(|i| {
            if (i + 1) % every == 0 {
                INDEXED_ATTENTION
            } else {
                LINEAR_ATTENTION
            }
            .to_string()
        })
        .collect()
}

/// The config of `spec` as transformers writes a `Qwen4ExpTextConfig`'s
/// PLE keys (the backbone's own keys are the caller's: `init` adds them).
fn to_json(spec: &ModelSpec) -> Value {
    let mut v = json!({
        "architectures": ["Qwen4ExpForCausalLM"],
        "model_type": MODEL_TYPE,
        "vocab_size": spec.vocab_size,
        "hidden_size": spec.hidden_size,
        "hc_count": spec.hc_mult,
        "rms_norm_eps": spec.rms_norm_eps,
        "eos_token_id": spec.eos_token_id,
        "num_hidden_layers": spec.num_hidden_layers,
        "layer_types": default_layer_types(
            spec.num_hidden_layers,
            defaults::FULL_ATTENTION_INTERVAL as usize
        ),
        "ngram_size": spec.ngram_size,
        "heads_per_ngram": spec.heads_per_ngram,
        "ple_embed_dim": spec.emb_dim(),
        "ngram_vocab_size_base": spec.ngram_vocab_size_base,
        "make_ngram_vocab_size_divisible_by": spec.divisible_by,
        "split_ngram_parts": spec.split_ngram_parts,
        "ple_conv_kernel_size": spec.conv_kernel_size,
        "ple_layer_ids": spec.ple_layer_ids,
        "seed": spec.hash_seed,
    });
    // A PLE layer the default pattern makes an attention layer is a linear
    // one here, so the config stays one transformers builds.
    if let Some(Value::Array(types)) = v.get_mut("layer_types") {
        for &l in &spec.ple_layer_ids {
            if let Some(t) = types.get_mut(l - 1) {
                *t = json!(LINEAR_ATTENTION);
            }
        }
    }
    v
}
