//! The hash families (docs/SPEC.md, "Families"): what the Engram and
//! LongCat hashes do differently from the Qwen4Exp one, as parameters of the
//! one [`PleIdDims`] plus a [`HashFamily`].
//!
//! All three families hash the n-grams that end at each token into
//! `(N - 1) * K` row ids, order-major (the `K` ids of order 2, then order 3,
//! ...), and all three carry the last `N - 1` tokens as history. They differ
//! in:
//! - the token map: identity, except Engram, which may hash a compressed id
//!   looked up in a table ([`TokenMap`]);
//! - the history fill: Qwen4Exp fills with EOS and restarts after every EOS;
//!   Engram fills with the (mapped) pad id at the sequence start only and
//!   never restarts; LongCat counts every predecessor before the segment
//!   start as 0, a segment starting right after an EOS;
//! - the mixing: XOR of `token * multiplier` (Qwen4Exp, Engram), or the
//!   polynomial `x_t + sum_{d=1}^{n-1} x_{t-d} * (V^d mod M)` mod `M`
//!   (LongCat, whose `multipliers` are empty).
//!
//! For a family other than Qwen4Exp, [`PleIdDims::eos_token_id`] is the
//! fill token of a fresh history: the raw pad id for Engram (the map turns
//! it into the compressed pad id, as the reference does), the EOS for
//! LongCat (an EOS history reads as "no predecessor").
//!
//! Out-of-vocabulary ids: the references compute in signed 64-bit with a
//! floor modulo. Engram and LongCat refuse every token (new or history) at
//! or above their vocabulary with [`IdError::TokenOutOfRange`] naming the
//! input, the position and the value; below it the unsigned arithmetic
//! here equals the references' signed one (no product reaches 2^63, no
//! value is negative). Qwen4Exp keeps its SPEC.md definition, which is
//! unsigned and total over `u32`.
//!
//! Invariants: the kernels here allocate nothing and keep their context on
//! the stack (`N <= MAX_NGRAM_SIZE`); they run only on dims and families
//! that passed [`validate_family`], after every token passed
//! [`check_tokens`].

use std::sync::Arc;

use super::error::{id_bail, id_ensure};
use super::{HeadMod, HeadRows, IdError, MAX_NGRAM_SIZE, PleIdDims, Result};

/// A compressed-token map: entry `t` is the id hashed for raw token `t`.
/// Shared, since one map serves every site of a model.
pub type TokenMap = Arc<[u32]>;

/// The id-hash rule of a site: how n-grams map to rows. Every rule shares
/// the carry (the last `context_len` tokens) and the id layout.
///
/// A closed enum on purpose: the hasher's per-token loop branches on it
/// (through `Prepared`). Which rule a model uses, with which parameters,
/// is its family's decision (`Family::hash_family`, in the family's module
/// under `ple/family/`); families that hash alike share a variant.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Default)]
pub enum HashFamily {
    /// Qwen4Exp: XOR of `token * multiplier` over an EOS-delimited window,
    /// `mixed % prime + offset` per head (docs/SPEC.md, "Id hash").
    #[default]
    Qwen4Exp,
    /// DeepSeek's Engram: the Qwen4Exp mixing over compressed ids, with the
    /// pad id before the sequence start and no segments.
    Engram {
        /// The compressed-token map; `None` hashes the raw ids.
        token_map: Option<TokenMap>,
        /// V': the number of hashed ids (the compressed vocabulary). Every
        /// hashed id is below it; without a map it bounds the raw ids.
        hashed_vocab: u64,
    },
    /// LongCat's n-gram embedding: a polynomial hash modulo each sub-table's
    /// size, predecessors before the segment start counting as 0.
    LongCat {
        /// V: the vocabulary, the base of the polynomial and the bound of
        /// the token ids.
        vocab_size: u64,
    },
}

impl HashFamily {
    /// The family's name in messages and JSON: `qwen4exp`, `engram`,
    /// `longcat`.
    pub fn name(&self) -> &'static str {
        match self {
            HashFamily::Qwen4Exp => "qwen4exp",
            HashFamily::Engram { .. } => "engram",
            HashFamily::LongCat { .. } => "longcat",
        }
    }

    /// Tokens must be below this (`None`: any `u32`, Qwen4Exp).
    pub fn token_limit(&self) -> Option<u64> {
        match self {
            HashFamily::Qwen4Exp => None,
            HashFamily::Engram {
                token_map: Some(map),
                ..
            } => Some(map.len() as u64),
            HashFamily::Engram {
                token_map: None,
                hashed_vocab,
            } => Some(*hashed_vocab),
            HashFamily::LongCat { vocab_size } => Some(*vocab_size),
        }
    }

    /// The compressed-token map the rule hashes through (Engram's, when it
    /// has one).
    pub fn token_map(&self) -> Option<&TokenMap> {
        match self {
            HashFamily::Engram { token_map, .. } => token_map.as_ref(),
            HashFamily::Qwen4Exp | HashFamily::LongCat { .. } => None,
        }
    }

    /// Whether the rule defines look-back boundaries (document starts and
    /// masked positions, `Boundaries`): Engram only.
    pub fn takes_boundaries(&self) -> bool {
        matches!(self, HashFamily::Engram { .. })
    }

    /// Whether the heads of each order reduce one shared mixed value (the
    /// XOR mixing of Qwen4Exp and Engram), which the AVX2 head reduction
    /// needs; LongCat's polynomial gives every head a sum of its own.
    pub fn mixes_once_per_order(&self) -> bool {
        match self {
            HashFamily::Qwen4Exp | HashFamily::Engram { .. } => true,
            HashFamily::LongCat { .. } => false,
        }
    }

    /// Whether the rule's sites take the mean with the word embedding
    /// (LongCat's published layer) instead of a gate (the others').
    pub fn takes_mean(&self) -> bool {
        match self {
            HashFamily::LongCat { .. } => true,
            HashFamily::Qwen4Exp | HashFamily::Engram { .. } => false,
        }
    }

    /// Append the rule's part of a site's canonical encoding to `out`: a
    /// tag and every parameter, vectors with their lengths. Nothing for
    /// Qwen4Exp, so fingerprints of existing snapshots stay valid.
    pub fn encode_canonical(&self, out: &mut Vec<u8>) {
        match self {
            HashFamily::Qwen4Exp => {}
            HashFamily::Engram {
                token_map,
                hashed_vocab,
            } => {
                out.extend_from_slice(b"engram");
                out.extend_from_slice(&hashed_vocab.to_le_bytes());
                let map: &[u32] = token_map.as_deref().unwrap_or(&[]);
                out.extend_from_slice(&(map.len() as u64).to_le_bytes());
                for v in map {
                    out.extend_from_slice(&v.to_le_bytes());
                }
            }
            HashFamily::LongCat { vocab_size } => {
                out.extend_from_slice(b"longcat");
                out.extend_from_slice(&vocab_size.to_le_bytes());
            }
        }
    }
}

/// Check that `dims` and `family` describe a usable hash together
/// (`family` in place of `dims.family`; [`PleIdDims::validate`] passes
/// its own).
///
/// Qwen4Exp: [`PleIdDims::validate`]. Engram: the same, plus a non-empty
/// hashed vocabulary, map entries below it, a fill (pad) token inside the
/// map or the vocabulary, and multipliers small enough that no product of
/// a hashed id reaches 2^63 (so unsigned and signed arithmetic agree).
/// LongCat: the same layout with no multipliers, a vocabulary of at least
/// 1 and the fill (EOS) token below it.
pub fn validate_family(family: &HashFamily, dims: &PleIdDims) -> Result<()> {
    match family {
        HashFamily::Qwen4Exp => dims.validate_layout(true),
        HashFamily::Engram {
            token_map,
            hashed_vocab,
        } => {
            dims.validate_layout(true)?;
            let v = *hashed_vocab;
            id_ensure!(v >= 1, Dims, "Engram: the hashed vocabulary is empty");
            let bound = (i64::MAX as u64) / v;
            if let Some((i, m)) = dims
                .multipliers
                .iter()
                .enumerate()
                .find(|&(_, &m)| m > bound)
            {
                id_bail!(
                    Dims,
                    "Engram: multipliers[{i}] = {m} exceeds (2^63 - 1) / {v} = {bound}, so a \
                     product would leave the signed 64-bit range"
                );
            }
            let pad = u64::from(dims.eos_token_id);
            match token_map {
                Some(map) => {
                    id_ensure!(!map.is_empty(), Dims, "Engram: the token map is empty");
                    if let Some((i, &c)) = map.iter().enumerate().find(|&(_, &c)| u64::from(c) >= v)
                    {
                        id_bail!(
                            Dims,
                            "Engram: token map entry {i} = {c} is not below the hashed vocabulary {v}"
                        );
                    }
                    id_ensure!(
                        pad < map.len() as u64,
                        Dims,
                        "Engram: pad id {pad} is outside the token map ({} entries)",
                        map.len()
                    );
                }
                None => id_ensure!(
                    pad < v,
                    Dims,
                    "Engram: pad id {pad} is not below the hashed vocabulary {v}"
                ),
            }
            Ok(())
        }
        HashFamily::LongCat { vocab_size } => {
            dims.validate_layout(false)?;
            id_ensure!(
                *vocab_size >= 1,
                Dims,
                "LongCat: vocab_size must be at least 1"
            );
            id_ensure!(
                u64::from(dims.eos_token_id) < *vocab_size,
                Dims,
                "LongCat: eos {} is not below vocab_size {vocab_size}",
                dims.eos_token_id
            );
            Ok(())
        }
    }
}

/// Refuse any token of `tokens` (named `input` in the error) at or above
/// the family's limit, before anything is written.
pub fn check_tokens(family: &HashFamily, input: &'static str, tokens: &[u32]) -> Result<()> {
    let Some(limit) = family.token_limit() else {
        return Ok(());
    };
    match tokens.iter().position(|&t| u64::from(t) >= limit) {
        None => Ok(()),
        Some(position) => Err(IdError::TokenOutOfRange {
            family: family.name(),
            input,
            position,
            token: tokens[position],
            limit,
        }),
    }
}

/// `base^e mod n` without overflow.
fn pow_mod(base: u64, mut e: u64, n: u64) -> u64 {
    let n128 = u128::from(n);
    let mut r = 1u128 % n128;
    let mut b = u128::from(base) % n128;
    while e > 0 {
        if e & 1 == 1 {
            r = r * b % n128;
        }
        b = b * b % n128;
        e >>= 1;
    }
    r as u64
}

/// LongCat's per-sub-table weights, `N` per sub-table: entry `d` of
/// sub-table `i` is `V^d mod size[i]` (so entry 0 is `1 mod size[i]`).
pub fn longcat_weights(vocab_size: u64, dims: &PleIdDims) -> Vec<u64> {
    let n = dims.ngram_size;
    dims.head_vocab_sizes
        .iter()
        .flat_map(|&m| (0..n as u64).map(move |d| pow_mod(vocab_size, d, m)))
        .collect()
}

/// The per-family data a hasher precomputes.
#[derive(Clone, Debug)]
pub(super) enum Prepared {
    /// Nothing beyond the dims.
    Qwen4Exp,
    /// The map and the hashed fill (pad) id.
    Engram { map: Option<TokenMap>, fill: u64 },
    /// The polynomial weights, `N` per sub-table, and whether every sum
    /// of products fits 64 bits (then one reciprocal reduction per id).
    LongCat { weights: Vec<u64>, narrow: bool },
}

impl Prepared {
    /// Precompute for a validated pair.
    pub(super) fn new(family: &HashFamily, dims: &PleIdDims) -> Self {
        match family {
            HashFamily::Qwen4Exp => Prepared::Qwen4Exp,
            HashFamily::Engram { token_map, .. } => {
                let pad = dims.eos_token_id;
                let fill = match token_map {
                    Some(map) => map.get(pad as usize).copied().unwrap_or(pad),
                    None => pad,
                };
                Prepared::Engram {
                    map: token_map.clone(),
                    fill: u64::from(fill),
                }
            }
            HashFamily::LongCat { vocab_size } => {
                // A term is below V * M and an id adds at most N terms.
                let n = dims.ngram_size as u128;
                let narrow = dims
                    .head_vocab_sizes
                    .iter()
                    .all(|&m| u128::from(*vocab_size) * u128::from(m) * n <= u128::from(u64::MAX));
                Prepared::LongCat {
                    weights: longcat_weights(*vocab_size, dims),
                    narrow,
                }
            }
        }
    }
}

/// The hashed id of raw token `t` (tokens were checked against the map).
#[inline(always)]
fn mapped(map: Option<&[u32]>, t: u32) -> u64 {
    match map {
        Some(m) => u64::from(m.get(t as usize).copied().unwrap_or(0)),
        None => u64::from(t),
    }
}

/// Engram over `history ++ tokens`: the rows of `tokens` go to `out`
/// (`tokens.len() * ngram_heads`, checked by the caller). The context is
/// the mapped predecessors, the mapped pad id before the sequence start.
/// Always inlined, so that a caller compiled for a wider instruction set
/// (the AVX2 head reduction) gets the whole loop compiled for it.
#[inline(always)]
pub(super) fn engram_run<R: HeadRows>(
    dims: &PleIdDims,
    map: Option<&[u32]>,
    fill: u64,
    rows: &R,
    history: &[u32],
    tokens: &[u32],
    out: &mut [u64],
) {
    let c = dims.context_len();
    let k = dims.heads_per_ngram;
    let mults = &dims.multipliers;
    let mut prev = [fill; MAX_NGRAM_SIZE - 1];
    for &t in &history[history.len().saturating_sub(c)..] {
        prev.copy_within(0..c - 1, 1);
        prev[0] = mapped(map, t);
    }
    for (&t, row) in tokens.iter().zip(out.chunks_exact_mut(dims.ngram_heads())) {
        let x = mapped(map, t);
        let mut mixed = x.wrapping_mul(mults[0]);
        for p in 0..c {
            mixed ^= prev[p].wrapping_mul(mults[p + 1]);
            rows.order_rows(p, p * k, mixed, &mut row[p * k..(p + 1) * k]);
        }
        prev.copy_within(0..c - 1, 1);
        prev[0] = x;
    }
}

/// LongCat's context: the predecessors of the next token, nearest first,
/// 0 before the segment start.
struct LongCatContext {
    prev: [u64; MAX_NGRAM_SIZE - 1],
    len: usize,
    eos: u32,
}

impl LongCatContext {
    fn after(history: &[u32], len: usize, eos: u32) -> Self {
        let mut c = Self {
            prev: [0; MAX_NGRAM_SIZE - 1],
            len,
            eos,
        };
        for &t in &history[history.len().saturating_sub(len)..] {
            c.push(t);
        }
        c
    }

    /// Move past `t`: an EOS ends the segment, so nothing before the next
    /// token is its predecessor.
    fn push(&mut self, t: u32) {
        if t == self.eos {
            self.prev[..self.len].fill(0);
        } else {
            self.prev.copy_within(0..self.len - 1, 1);
            self.prev[0] = u64::from(t);
        }
    }
}

/// The LongCat ids of token `x` after `prev` into `row`.
#[inline(always)]
fn longcat_token(dims: &PleIdDims, weights: &[u64], prev: &[u64], x: u64, row: &mut [u64]) {
    let n = dims.ngram_size;
    let k = dims.heads_per_ngram;
    for (i, slot) in row.iter_mut().enumerate() {
        let order = i / k + 2;
        let w = &weights[i * n..i * n + order];
        let m = u128::from(dims.head_vocab_sizes[i]);
        // Exact: each product is below 2^128 / N because both factors are
        // below 2^64 and N <= 32 terms are added, each reduced first.
        let mut acc = u128::from(x) * u128::from(w[0]) % m;
        for d in 1..order {
            acc += u128::from(prev[d - 1]) * u128::from(w[d]) % m;
        }
        *slot = (acc % m) as u64 + dims.head_offsets[i];
    }
}

/// [`longcat_run`] when every sum fits 64 bits (`Prepared::LongCat`'s
/// `narrow`): the products are summed unreduced and reduced once by the
/// head's reciprocal, which gives the same ids.
pub(super) fn longcat_run_narrow(
    dims: &PleIdDims,
    weights: &[u64],
    heads: &[HeadMod],
    history: &[u32],
    tokens: &[u32],
    out: &mut [u64],
) {
    let n = dims.ngram_size;
    let k = dims.heads_per_ngram;
    let mut ctx = LongCatContext::after(history, dims.context_len(), dims.eos_token_id);
    for (&t, row) in tokens.iter().zip(out.chunks_exact_mut(dims.ngram_heads())) {
        let x = u64::from(t);
        for (i, (slot, h)) in row.iter_mut().zip(heads).enumerate() {
            let order = i / k + 2;
            let w = &weights[i * n..i * n + order];
            let mut acc = x * w[0];
            for (&p, &wd) in ctx.prev[..order - 1].iter().zip(&w[1..]) {
                acc += p * wd;
            }
            *slot = h.m.rem(acc) + h.offset;
        }
        ctx.push(t);
    }
}

/// LongCat over `history ++ tokens`, as [`engram_run`].
pub(super) fn longcat_run(
    dims: &PleIdDims,
    weights: &[u64],
    history: &[u32],
    tokens: &[u32],
    out: &mut [u64],
) {
    let mut ctx = LongCatContext::after(history, dims.context_len(), dims.eos_token_id);
    for (&t, row) in tokens.iter().zip(out.chunks_exact_mut(dims.ngram_heads())) {
        longcat_token(dims, weights, &ctx.prev[..ctx.len], u64::from(t), row);
        ctx.push(t);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pow_mod_small() {
        assert_eq!(pow_mod(10, 0, 7), 1);
        assert_eq!(pow_mod(10, 3, 7), 1000 % 7);
        assert_eq!(pow_mod(5, 2, 1), 0);
        assert_eq!(pow_mod(u64::MAX, 2, u64::MAX - 1), 1);
    }

    #[test]
    fn token_limits_by_family() {
        assert_eq!(HashFamily::Qwen4Exp.token_limit(), None);
        let map: TokenMap = vec![0, 1, 1].into();
        let e = HashFamily::Engram {
            token_map: Some(map),
            hashed_vocab: 2,
        };
        assert_eq!(e.token_limit(), Some(3));
        let err = check_tokens(&e, "tokens", &[0, 2, 3]).unwrap_err();
        assert_eq!(
            err,
            IdError::TokenOutOfRange {
                family: "engram",
                input: "tokens",
                position: 2,
                token: 3,
                limit: 3
            }
        );
        let l = HashFamily::LongCat { vocab_size: 10 };
        check_tokens(&l, "history", &[9]).unwrap();
        let msg = check_tokens(&l, "history", &[10]).unwrap_err().to_string();
        assert!(msg.contains("history") && msg.contains("10"), "{msg}");
    }

    /// The narrow (64-bit sums, one reciprocal reduction) and the wide
    /// (128-bit, reduced per term) LongCat kernels agree.
    #[test]
    fn longcat_narrow_equals_wide() {
        let vocab = 1000u64;
        let (sizes, offsets, _) = crate::layers::ple::ids::longcat_layout(2999, 6).unwrap();
        let dims = PleIdDims {
            ngram_size: 4,
            heads_per_ngram: 2,
            multipliers: vec![],
            head_vocab_sizes: sizes.clone(),
            head_offsets: offsets.clone(),
            eos_token_id: 7,
            family: Default::default(),
        };
        validate_family(&HashFamily::LongCat { vocab_size: vocab }, &dims).unwrap();
        let weights = longcat_weights(vocab, &dims);
        let heads: Vec<HeadMod> = sizes
            .iter()
            .zip(&offsets)
            .map(|(&s, &offset)| HeadMod {
                m: super::super::FastMod::new(s).unwrap(),
                offset,
            })
            .collect();
        let tokens: Vec<u32> = (0..200u32).map(|i| (i * 37 + i / 3) % 1000).collect();
        let tokens: Vec<u32> = tokens
            .iter()
            .enumerate()
            .map(|(i, &t)| if i % 9 == 4 { 7 } else { t })
            .collect();
        let mut wide = vec![0; tokens.len() * 6];
        let mut narrow = vec![0; tokens.len() * 6];
        longcat_run(&dims, &weights, &[999, 7, 3], &tokens, &mut wide);
        longcat_run_narrow(&dims, &weights, &heads, &[999, 7, 3], &tokens, &mut narrow);
        assert_eq!(wide, narrow);
    }
}
