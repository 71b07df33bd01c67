//! Model families as modules behind one trait, and the one registry that
//! spec parsing dispatches through (docs/SPEC.md §11 (Families)).
//!
//! A family is everything one published model says differently about its
//! n-gram embedding: the config keys it is named by and their checks, how
//! its hash constants derive (multipliers, head sizes, fill token), which
//! combination its layer applies, and how its config is written back. Each
//! family keeps all of that in its own module:
//!
//! - [`qwen4_exp`]: Qwen4-Exp PLE (transformers' `Qwen4ExpTextConfig`);
//! - [`engram_demo`] and [`deepseek_v41`]: DeepSeek's Engram, the demo's
//!   keys and DeepSeek-V4.1's, over the parts they share in [`engram`];
//! - [`longcat`]: LongCat's n-gram embedding (LongCat-Flash and LongCat-2.0
//!   keys).
//!
//! Each module exports a [`FamilyDesc`] (how a config is recognised and
//! parsed, and which published layer a site follows) and a type
//! implementing [`Family`] (the parsed family part of a [`ModelSpec`],
//! answering everything later code asks of it).
//! [`BUILTIN`] lists the descriptors, one line per family; [`register`]
//! adds one at run time (a family defined outside this crate).
//!
//! What stays closed: the hasher's [`HashFamily`] and the layer's
//! [`Combine`] are small enums because their per-token and per-element
//! loops branch on them; a family picks one of their variants and sets
//! their parameters, and a family with a new hash rule or a new combination
//! adds a variant there too. Outside their own modules, the kernels that
//! dispatch on a combination and the family modules, code asks the enums'
//! methods (`takes_boundaries`, `check_site`, ...) instead of matching
//! variants.
//!
//! Invariants: descriptor ids are unique across the registry; exactly one
//! registered family (Qwen4-Exp) has no `detect` and takes every config no
//! other family claims; a config claimed by two families is refused, naming
//! both keys.

use std::any::Any;
use std::fmt;
use std::sync::{Arc, RwLock};

use serde_json::Value;
use thiserror::Error;

use super::ids::{DerivedPleIds, IdError, PleIdDims, TokenMap, running_offsets, validate_family};
use super::spec::{Combine, Fields, HashFamily, ModelSpec, SiteSpec, SpecError};

pub mod deepseek_v41;
pub mod engram;
pub mod engram_demo;
pub mod longcat;
pub mod qwen4_exp;

/// The families this crate knows, in the order configs are tried.
pub const BUILTIN: &[&FamilyDesc] = &[
    &qwen4_exp::DESC,
    &engram_demo::DESC,
    &deepseek_v41::DESC,
    &longcat::DESC,
];

/// A family's detector: the key of a config that names the family, if any.
pub type Detect = fn(&Fields) -> Result<Option<&'static str>, SpecError>;

/// How a family is recognised and parsed; one `static` per family module.
pub struct FamilyDesc {
    /// Unique in the registry (`qwen4-exp`, `engram-demo`, ...).
    pub id: &'static str,
    /// The hash family's name in messages and JSON (`qwen4exp`, `engram`,
    /// `longcat`): two spellings of one family share it.
    pub name: &'static str,
    /// The published layer, as messages name it (`Engram demo`, ...).
    pub title: &'static str,
    /// Whether a config's keys name this family: the key that does, or
    /// `None`. `None` here makes the family the fallback, which takes
    /// every config no other family claims.
    pub detect: Option<Detect>,
    /// Parse and validate a config this family claimed.
    pub parse: fn(&Fields) -> Result<ModelSpec, SpecError>,
    /// The published layer a site follows, as messages name it, when its
    /// hash rule and combination are this family's; `None` for a site of
    /// another family. Families that share a site's rules (a second
    /// spelling of one model) answer `None` and leave it to the first.
    pub site_layer: fn(&SiteSpec) -> Option<&'static str>,
}

impl fmt::Debug for FamilyDesc {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("FamilyDesc").field("id", &self.id).finish()
    }
}

/// The parsed family part of a [`ModelSpec`]: what its config adds to the
/// shared fields and everything the family decides from them.
pub trait Family: fmt::Debug + Send + Sync + Any {
    /// The family's descriptor.
    fn desc(&self) -> &'static FamilyDesc;
    /// The family's own invariants over `spec`; `source` names the config.
    fn validate(&self, spec: &ModelSpec, source: &str) -> Result<(), SpecError>;
    /// Site `s`'s hash constants and padded row count (`s` is a site).
    fn derive(&self, spec: &ModelSpec, s: usize) -> Result<DerivedPleIds, SpecError>;
    /// The hasher's rule and its parameters for this family.
    fn hash_family(&self, spec: &ModelSpec) -> HashFamily;
    /// How the family's sites combine their rows with the highway.
    fn combine(&self, spec: &ModelSpec) -> Combine;
    /// The config.json object of `spec`, in the family's spelling.
    fn to_json(&self, spec: &ModelSpec) -> Value;
    /// Whether `other` is the same family with the same parameters
    /// (implement with [`same`]).
    fn eq_family(&self, other: &dyn Family) -> bool;
    /// The size of the compressed vocabulary a token map maps raw ids
    /// onto, for a family that hashes through one (`None`: raw ids).
    fn compressed_vocab(&self) -> Option<u64> {
        None
    }
    /// The compressed-token map the family hashes through, if any.
    fn token_map(&self) -> Option<&TokenMap> {
        None
    }
    /// This family with `map` as its token map; families without one
    /// refuse.
    fn with_token_map(&self, map: TokenMap, source: &str) -> Result<ModelFamily, SpecError> {
        let _ = map;
        Err(SpecError::TokenMap {
            file: source.to_string(),
            problem: format!(
                "only Engram configs hash through a token map; this one is {}",
                self.desc().name
            ),
        })
    }
}

/// [`Family::eq_family`] for a family type with `PartialEq`.
pub fn same<T: Family + PartialEq>(a: &T, b: &dyn Family) -> bool {
    (b as &dyn Any).downcast_ref::<T>() == Some(a)
}

/// A [`ModelSpec`]'s family: one shared [`Family`] value.
#[derive(Clone)]
pub struct ModelFamily(Arc<dyn Family>);

impl ModelFamily {
    /// Wrap a family value.
    pub fn new(family: impl Family) -> Self {
        ModelFamily(Arc::new(family))
    }
    /// The family's descriptor.
    pub fn desc(&self) -> &'static FamilyDesc {
        self.0.desc()
    }
    /// The hash family's name (`qwen4exp`, `engram`, `longcat`).
    pub fn name(&self) -> &'static str {
        self.desc().name
    }
    /// The family value, when it is a `T`.
    pub fn get<T: Family>(&self) -> Option<&T> {
        (&*self.0 as &dyn Any).downcast_ref::<T>()
    }
    /// The family's behaviour.
    pub fn family(&self) -> &dyn Family {
        &*self.0
    }
}

impl Default for ModelFamily {
    /// Qwen4-Exp, the fallback family.
    fn default() -> Self {
        ModelFamily::new(qwen4_exp::Qwen4Exp)
    }
}

impl PartialEq for ModelFamily {
    fn eq(&self, other: &Self) -> bool {
        self.0.eq_family(&*other.0)
    }
}

impl fmt::Debug for ModelFamily {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.fmt(f)
    }
}

/// A family could not be registered.
#[derive(Debug, Error, PartialEq, Eq)]
pub enum RegisterError {
    /// Another registered family has this id.
    #[error("a family with id `{0}` is already registered")]
    DuplicateId(&'static str),
    /// Only one family takes the configs nobody claims.
    #[error("family `{0}` has no detect, but `{1}` is already the fallback")]
    SecondFallback(&'static str, &'static str),
}

/// Families added at run time, after [`BUILTIN`].
static REGISTERED: RwLock<Vec<&'static FamilyDesc>> = RwLock::new(Vec::new());

/// Every family: [`BUILTIN`], then those [`register`]ed, in that order.
pub fn families() -> Vec<&'static FamilyDesc> {
    let extra = REGISTERED.read().unwrap_or_else(|e| e.into_inner());
    BUILTIN
        .iter()
        .copied()
        .chain(extra.iter().copied())
        .collect()
}

/// The family with id `id`.
pub fn find(id: &str) -> Option<&'static FamilyDesc> {
    families().into_iter().find(|d| d.id == id)
}

/// Add a family, tried after every family before it.
pub fn register(desc: &'static FamilyDesc) -> Result<(), RegisterError> {
    let mut extra = REGISTERED.write().unwrap_or_else(|e| e.into_inner());
    let all = BUILTIN.iter().chain(extra.iter());
    for d in all {
        if d.id == desc.id {
            return Err(RegisterError::DuplicateId(desc.id));
        }
        if d.detect.is_none() && desc.detect.is_none() {
            return Err(RegisterError::SecondFallback(desc.id, d.id));
        }
    }
    extra.push(desc);
    Ok(())
}

/// The family whose keys `f` holds, or `None` when no family claims them.
/// Two families claiming one config is an error naming both keys.
pub(crate) fn claim(f: &Fields) -> Result<Option<&'static FamilyDesc>, SpecError> {
    let mut found: Option<(&'static FamilyDesc, &'static str)> = None;
    for d in families() {
        let Some(detect) = d.detect else { continue };
        let Some(key) = detect(f)? else { continue };
        if let Some((first, first_key)) = found {
            return Err(f.field_err(
                key,
                format!(
                    "is set together with {} keys ({first_key}): a config names one family",
                    first.title
                ),
            ));
        }
        found = Some((d, key));
    }
    Ok(found.map(|(d, _)| d))
}

/// The published layer `site` follows, as messages name it: the answer of
/// the first family whose [`FamilyDesc::site_layer`] claims the site, or
/// the hash rule's name when none does.
pub fn site_layer(site: &SiteSpec) -> &'static str {
    families()
        .into_iter()
        .find_map(|d| (d.site_layer)(site))
        .unwrap_or_else(|| site.family.name())
}

/// The family that takes configs nobody claims.
pub(crate) fn fallback() -> &'static FamilyDesc {
    families()
        .into_iter()
        .find(|d| d.detect.is_none())
        .unwrap_or(&qwen4_exp::DESC)
}

/// Site `s`'s hash constants from a family's head sizes, multipliers and
/// fill token: offsets as the running sum of the sizes, rows padded to
/// `divisible_by`, checked with the hasher's rules.
pub fn derive_dims(
    spec: &ModelSpec,
    s: usize,
    multipliers: Vec<u64>,
    sizes: Vec<u64>,
    fill: u32,
) -> Result<DerivedPleIds, SpecError> {
    let wrap = |source: IdError| spec.derive_error(s, source);
    let (head_offsets, total) = running_offsets(&sizes).map_err(wrap)?;
    let padded_rows = total
        .div_ceil(spec.divisible_by)
        .checked_mul(spec.divisible_by)
        .ok_or_else(|| {
            wrap(IdError::Params(
                "the padded row count exceeds 2^64 - 1".into(),
            ))
        })?;
    let family = spec.hash_family();
    let dims = PleIdDims {
        ngram_size: spec.ngram_size,
        heads_per_ngram: spec.heads_per_ngram,
        multipliers,
        head_vocab_sizes: sizes,
        head_offsets,
        eos_token_id: fill,
        family: family.clone(),
    };
    validate_family(&family, &dims).map_err(wrap)?;
    Ok(DerivedPleIds { dims, padded_rows })
}
