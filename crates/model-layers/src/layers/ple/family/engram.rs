//! What the two Engram families share (docs/SPEC.md §11 (Families)): the
//! [`EngramSpec`] both parse into (the demo's keys, `engram_vocab_size` as
//! a list per order, `max_ngram_size`, `n_embed_per_ngram`,
//! `n_head_per_ngram`, `layer_ids`, `pad_id`, `seed`, `kernel_size`, or
//! DeepSeek-V4.1's `engram_*` keys), the compressed-token map, and the hash
//! constants (prime head sizes searched across layers, numpy-drawn
//! multipliers, the pad id as the fill token) under the
//! [`HashFamily::Engram`] rule. What differs between the two (how a config
//! is recognised, the combination, the keys written back) is in
//! [`super::engram_demo`] and [`super::deepseek_v41`].
//!
//! Invariants of a parsed Engram spec: one table base per order, each at
//! least 1; `ple_layer_ids` are the config's 0-based block indices plus 1;
//! the fill token of a fresh history is the raw pad id; the table rows are
//! not padded (`divisible_by` 1) and live in one part; when the config
//! states `engram_num_embeddings`, the rebuilt per-layer row counts equal
//! it.

use std::path::Path;

use serde_json::{Value, json};

use super::{Family, FamilyDesc, ModelFamily, deepseek_v41, derive_dims, engram_demo, same};
use crate::layers::ple::ids::{
    DerivedPleIds, TokenMap, engram_head_sizes, engram_multipliers, running_offsets,
};
use crate::layers::ple::spec::{
    Combine, Fields, GateSign, HashFamily, ModelSpec, SiteSpec, SpecError, TABLE_ROWS_KEY,
};

pub mod tokenizer;

pub use tokenizer::{
    CompressedTokens, TokenizerJsonError, token_map_from_tokenizer_json,
    token_map_from_tokenizer_str,
};

/// Which key spelling a config uses.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum EngramKeys {
    /// The demo's `EngramConfig` and backbone keys.
    Demo,
    /// DeepSeek-V4.1's `engram_*` keys.
    V41,
}

/// What an Engram config adds to the shared fields of [`ModelSpec`]
/// (`ngram_size` is the largest order, `heads_per_ngram` the heads per
/// order, `hash_seed` the seed).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EngramSpec {
    /// The key spelling, kept so that the config written back reads alike.
    pub keys: EngramKeys,
    /// The table base of each order 2..=N: head sizes are primes above
    /// `base - 1`.
    pub vocab_bases: Vec<u64>,
    /// V': the size of the compressed vocabulary, which bounds the
    /// multipliers. Without a token map the raw ids are hashed and must be
    /// below it.
    pub compressed_vocab_size: u64,
    /// The raw pad id (mapped through the token map when there is one).
    pub pad_id: u32,
    /// The stated row count of each layer's table (`engram_num_embeddings`).
    pub num_embeddings: Option<Vec<u64>>,
    /// The compressed-token map, loaded separately ([`load_token_map`]).
    pub token_map: Option<TokenMap>,
}

impl Family for EngramSpec {
    fn desc(&self) -> &'static FamilyDesc {
        match self.keys {
            EngramKeys::Demo => &engram_demo::DESC,
            EngramKeys::V41 => &deepseek_v41::DESC,
        }
    }

    fn validate(&self, spec: &ModelSpec, source: &str) -> Result<(), SpecError> {
        validate(self, spec, source)
    }

    fn derive(&self, spec: &ModelSpec, s: usize) -> Result<DerivedPleIds, SpecError> {
        let wrap = |source| spec.derive_error(s, source);
        let mut all =
            engram_head_sizes(&self.vocab_bases, spec.heads_per_ngram, s + 1).map_err(wrap)?;
        let sizes = all.pop().unwrap_or_default();
        let m = engram_multipliers(
            self.compressed_vocab_size,
            spec.ngram_size,
            spec.hash_seed,
            spec.site_layer(s),
        )
        .map_err(wrap)?;
        // The raw pad id: the map turns it into the compressed one.
        derive_dims(spec, s, m, sizes, self.pad_id)
    }

    fn hash_family(&self, _spec: &ModelSpec) -> HashFamily {
        HashFamily::Engram {
            token_map: self.token_map.clone(),
            hashed_vocab: self.compressed_vocab_size,
        }
    }

    fn combine(&self, spec: &ModelSpec) -> Combine {
        let conv = spec.conv_kernel_size >= 2;
        match self.keys {
            EngramKeys::Demo => engram_demo::combine(conv),
            EngramKeys::V41 => deepseek_v41::combine(conv),
        }
    }

    fn to_json(&self, spec: &ModelSpec) -> Value {
        to_json(spec, self)
    }

    fn eq_family(&self, other: &dyn Family) -> bool {
        same(self, other)
    }

    fn compressed_vocab(&self) -> Option<u64> {
        Some(self.compressed_vocab_size)
    }

    fn token_map(&self) -> Option<&TokenMap> {
        self.token_map.as_ref()
    }

    fn with_token_map(&self, map: TokenMap, source: &str) -> Result<ModelFamily, SpecError> {
        check_token_map(self, &map, source)?;
        Ok(ModelFamily::new(EngramSpec {
            token_map: Some(map),
            ..self.clone()
        }))
    }
}

/// The Engram invariants a [`ModelSpec`] must keep: one base per order,
/// each at least 1, a pad inside the map or the compressed vocabulary, a
/// map that fits, and stated row counts equal to the rebuilt ones.
fn validate(e: &EngramSpec, spec: &ModelSpec, source: &str) -> Result<(), SpecError> {
    let bad = |field: &str, problem: String| SpecError::Field {
        file: source.to_string(),
        field: field.to_string(),
        problem,
    };
    let v41 = e.keys == EngramKeys::V41;
    let name = |demo: &'static str, v: &'static str| if v41 { v } else { demo };
    if e.vocab_bases.len() != spec.ngram_size - 1 {
        return Err(bad(
            "engram_vocab_size",
            format!(
                "has {} entries, orders 2..={} need {}",
                e.vocab_bases.len(),
                spec.ngram_size,
                spec.ngram_size - 1
            ),
        ));
    }
    if let Some(i) = e.vocab_bases.iter().position(|&b| b == 0) {
        return Err(bad(
            &format!("engram_vocab_size[{i}]"),
            "must be at least 1, got 0".into(),
        ));
    }
    let cv = e.compressed_vocab_size;
    let cv_name = name("compressed_vocab_size", "engram_compressed_vocab_size");
    if cv == 0 {
        return Err(bad(cv_name, "must be at least 1, got 0".into()));
    }
    let pad_limit = e.token_map.as_ref().map_or(cv, |m| m.len() as u64);
    if u64::from(e.pad_id) >= pad_limit {
        return Err(bad(
            name("pad_id", "engram_pad_token_id"),
            format!("= {} is not below {pad_limit}", e.pad_id),
        ));
    }
    if let Some(map) = &e.token_map {
        check_token_map(e, map, source)?;
    }
    if let Some(stated) = &e.num_embeddings {
        if stated.len() != spec.sites() {
            return Err(bad(
                "engram_num_embeddings",
                format!(
                    "has {} entries for {} Engram layers",
                    stated.len(),
                    spec.sites()
                ),
            ));
        }
        let sizes = engram_head_sizes(&e.vocab_bases, spec.heads_per_ngram, spec.sites())
            .map_err(|err| bad("engram_vocab_size", err.to_string()))?;
        for (i, (layer, &want)) in sizes.iter().zip(stated).enumerate() {
            let got = running_offsets(layer)
                .map_err(|err| bad("engram_vocab_size", err.to_string()))?
                .1;
            if got != want {
                return Err(bad(
                    &format!("engram_num_embeddings[{i}]"),
                    format!(
                        "= {want}, but the head sizes rebuilt for layer {} sum to {got}",
                        spec.site_layer(i)
                    ),
                ));
            }
        }
    }
    Ok(())
}

/// A list of non-negative integers, or (when `scalar_ok`) one integer.
fn u64_list(f: &Fields, name: &str, scalar_ok: bool) -> Result<Vec<u64>, SpecError> {
    match f.get(name)? {
        Value::Array(items) => items
            .iter()
            .enumerate()
            .map(|(i, v)| f.u64_of(&format!("{name}[{i}]"), v))
            .collect(),
        v if scalar_ok => Ok(vec![f.u64_of(name, v)?]),
        v => Err(f.field_err(name, format!("must be a list of integers, got {v}"))),
    }
}

fn u32_of(f: &Fields, name: &str, v: u64) -> Result<u32, SpecError> {
    u32::try_from(v).map_err(|_| f.field_err(name, format!("= {v} does not fit a u32 token id")))
}

/// Whether `site` hashes under the Engram rule (either spelling's site).
pub(super) fn is_engram(site: &SiteSpec) -> bool {
    matches!(site.family, HashFamily::Engram { .. })
}

/// Whether `site`'s gate is DeepSeek-V4.1's (copysign at a zero dot
/// product), which tells V4.1's sites from the demo's.
pub(super) fn v41_gate(site: &SiteSpec) -> bool {
    site.combine
        .gated()
        .is_some_and(|g| g.sign == GateSign::CopySign)
}

/// Parse an Engram config whose spelling is `keys`.
pub(super) fn parse(f: &Fields, keys: EngramKeys) -> Result<ModelSpec, SpecError> {
    let v41 = keys == EngramKeys::V41;
    let k = |demo: &'static str, v41_name: &'static str| if v41 { v41_name } else { demo };

    let vocab_size = f.vocab_size()?;
    let hidden_size = f.count("hidden_size", 1)?;
    let hc_mult = match f.u64_opt("hc_mult")? {
        Some(h) => f.count_of("hc_mult", h, 1)?,
        None => 1,
    };
    let rms_norm_eps = f.eps_or("rms_norm_eps", 1e-6)?;

    let n_name = k("max_ngram_size", "engram_max_ngram_size");
    let ngram_size = f.ngram_size(n_name)?;
    let heads_name = k("n_head_per_ngram", "engram_n_heads");
    let heads_per_ngram = f.count(heads_name, 1)?;
    let head_dim = if v41 {
        f.count("engram_head_dim", 1)?
    } else {
        let width = f.count("n_embed_per_ngram", 1)?;
        if width % heads_per_ngram != 0 {
            return Err(f.field_err(
                "n_embed_per_ngram",
                format!("= {width} is not a multiple of n_head_per_ngram {heads_per_ngram}"),
            ));
        }
        width / heads_per_ngram
    };

    let bases_name = "engram_vocab_size";
    let mut vocab_bases = u64_list(f, bases_name, v41)?;
    if v41 && vocab_bases.len() == 1 {
        // V4.1 states one base for every order.
        vocab_bases = vec![vocab_bases[0]; ngram_size - 1];
    }
    if vocab_bases.len() != ngram_size - 1 {
        return Err(f.field_err(
            bases_name,
            format!(
                "has {} entries, {n_name} {ngram_size} needs one per order 2..={ngram_size}",
                vocab_bases.len()
            ),
        ));
    }

    let layers_name = k("layer_ids", "engram_layer_ids");
    let layer_values = u64_list(f, layers_name, false)?;
    if layer_values.is_empty() {
        return Err(f.field_err(layers_name, "is empty (no Engram layer)".into()));
    }
    let mut ple_layer_ids = Vec::with_capacity(layer_values.len());
    for (i, &l) in layer_values.iter().enumerate() {
        let name = format!("{layers_name}[{i}]");
        let l = f.count_of(&name, l, 0)?;
        let one_based = l
            .checked_add(1)
            .ok_or_else(|| f.field_err(&name, format!("= {l} is too large")))?;
        if ple_layer_ids.contains(&one_based) {
            return Err(f.field_err(layers_name, format!("lists layer {l} twice")));
        }
        ple_layer_ids.push(one_based);
    }

    // transformers' DeepSeek-V4.1 config spells the pad `engram_pad_id`,
    // vLLM reads `engram_pad_token_id`; either is the pad, both must agree.
    let pad_name = k("pad_id", "engram_pad_token_id");
    let pad = match (
        f.u64_opt(pad_name)?,
        v41.then(|| f.u64_opt("engram_pad_id"))
            .transpose()?
            .flatten(),
    ) {
        (Some(a), Some(b)) if a != b => {
            return Err(f.field_err(
                pad_name,
                format!("= {a}, but `engram_pad_id` says {b}; give one of them"),
            ));
        }
        (Some(a), _) | (None, Some(a)) => a,
        (None, None) => f.u64(pad_name)?,
    };
    let pad_id = u32_of(f, pad_name, pad)?;
    let cv_name = k("compressed_vocab_size", "engram_compressed_vocab_size");
    let compressed_vocab_size = if v41 {
        f.u64(cv_name)?
    } else {
        f.u64_opt(cv_name)?.unwrap_or(vocab_size)
    };
    let hash_seed = f.u64_opt(k("seed", "engram_seed"))?.unwrap_or(0);
    if v41 && hash_seed != 0 {
        // The published V4.1 code and the engines that serve it hash with
        // seed 0 and read no seed key: a seed here would address other rows
        // than the model's.
        return Err(f.field_err(
            "engram_seed",
            format!(
                "= {hash_seed}, but DeepSeek-V4.1 hashes with seed 0 and its published code \
                 reads no seed key; remove it"
            ),
        ));
    }
    let kernel_name = k("kernel_size", "engram_kernel_size");
    let conv_kernel_size = match f.u64_opt(kernel_name)? {
        Some(v) => f.count_of(kernel_name, v, 1)?,
        // The demo's short conv has 4 taps; V4.1 has no conv.
        None if v41 => 1,
        None => 4,
    };
    let num_embeddings = if f.has("engram_num_embeddings") {
        Some(u64_list(f, "engram_num_embeddings", false)?)
    } else {
        None
    };
    let eos_token_id = f.eos_opt()?.unwrap_or(pad_id);
    let max_layer = ple_layer_ids.iter().copied().max().unwrap_or(0);
    let num_hidden_layers = f.layers_or(max_layer)?;
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
        ngram_vocab_size_base: vocab_bases[0],
        divisible_by: 1,
        split_ngram_parts: 1,
        conv_kernel_size,
        ple_layer_ids,
        hash_seed,
        num_hidden_layers,
        table_rows,
        family: ModelFamily::new(EngramSpec {
            keys,
            vocab_bases,
            compressed_vocab_size,
            pad_id,
            num_embeddings,
            token_map: None,
        }),
    };
    spec.validate(f.file)?;
    Ok(spec)
}

/// The config.json object of an Engram spec, in its own spelling.
fn to_json(spec: &ModelSpec, e: &EngramSpec) -> Value {
    let mut v = json!({
        "vocab_size": spec.vocab_size,
        "hidden_size": spec.hidden_size,
        "hc_mult": spec.hc_mult,
        "rms_norm_eps": spec.rms_norm_eps,
        "eos_token_id": spec.eos_token_id,
        "num_hidden_layers": spec.num_hidden_layers,
    });
    let extra = match e.keys {
        EngramKeys::Demo => engram_demo::keys_json(spec, e),
        EngramKeys::V41 => deepseek_v41::keys_json(spec, e),
    };
    if let (Some(obj), Value::Object(more)) = (v.as_object_mut(), extra) {
        obj.extend(more);
    }
    if let Some(n) = &e.num_embeddings {
        v["engram_num_embeddings"] = json!(n);
    }
    v
}

/// Check `map` against the spec: every entry below the compressed
/// vocabulary, and exactly that many distinct ids (ids are handed out
/// densely from 0, so the largest is `V' - 1`).
pub fn check_token_map(e: &EngramSpec, map: &[u32], source: &str) -> Result<(), SpecError> {
    let bad = |problem: String| SpecError::TokenMap {
        file: source.to_string(),
        problem,
    };
    if map.is_empty() {
        return Err(bad("is empty".into()));
    }
    let v = e.compressed_vocab_size;
    let max = map.iter().copied().max().map_or(0, u64::from);
    if max + 1 != v {
        return Err(bad(format!(
            "maps onto ids 0..={max}, but engram_compressed_vocab_size is {v}"
        )));
    }
    if u64::from(e.pad_id) >= map.len() as u64 {
        return Err(bad(format!(
            "has {} entries; the pad id {} is outside it",
            map.len(),
            e.pad_id
        )));
    }
    Ok(())
}

/// Read a token map: a JSON array of non-negative integers, entry `t`
/// being the compressed id of raw token `t`.
pub fn load_token_map(path: &Path) -> Result<TokenMap, SpecError> {
    let text = std::fs::read_to_string(path).map_err(|source| SpecError::Read {
        path: path.to_path_buf(),
        source,
    })?;
    parse_token_map(&text, &path.display().to_string())
}

/// [`load_token_map`] from text; `source` names it in errors.
pub fn parse_token_map(text: &str, source: &str) -> Result<TokenMap, SpecError> {
    let bad = |problem: String| SpecError::TokenMap {
        file: source.to_string(),
        problem,
    };
    let v: Value = serde_json::from_str(text).map_err(|e| bad(format!("not JSON: {e}")))?;
    let Value::Array(items) = v else {
        return Err(bad("must be a JSON array of token ids".into()));
    };
    items
        .iter()
        .enumerate()
        .map(|(i, x)| {
            x.as_u64()
                .and_then(|x| u32::try_from(x).ok())
                .ok_or_else(|| bad(format!("entry {i} = {x} is not an id in 0..=4294967295")))
        })
        .collect::<Result<Vec<u32>, _>>()
        .map(TokenMap::from)
}
