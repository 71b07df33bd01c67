//! Engram's hash constants (docs/SPEC.md, "Families"): multipliers drawn
//! from numpy's generator, prime head sizes from one `seen` set shared by
//! every layer.
//!
//! Also DeepSeek-V4.1's look-back boundaries ([`Boundaries`],
//! [`engram_ids_bounded_into`]): the n-gram look-back stops at document
//! starts and at masked (e.g. image) tokens, the blocked positions reading
//! the mapped pad id.
//!
//! Invariants: every multiplier is odd and at most `(2^63 - 1) / V'`, so
//! no product of a hashed id leaves the signed 64-bit range; the head sizes
//! of all layers are distinct primes; a layer's offsets are the running
//! sums of its sizes from 0. Overflow is an error, never a panic. With no
//! boundary flag set the bounded hash equals the plain Engram hash.

use std::collections::HashSet;

use super::error::{id_bail, id_ensure};
use super::{
    HashFamily, IdError, MAX_NGRAM_SIZE, MAX_PRIMES_SEARCHED, PleIdDims, PleIdHasher, Result,
    SITE_SEED_STRIDE, check_tokens, is_prime, validate_family,
};

/// The Engram multipliers of absolute (0-based) model layer `layer_id`:
/// `2 * r + 1` with `r = default_rng(seed + 10007 * layer_id).integers(0,
/// half, N)` and `half = max(1, ((2^63 - 1) // V') // 2)`.
pub fn engram_multipliers(
    hashed_vocab: u64,
    ngram_size: usize,
    seed: u64,
    layer_id: usize,
) -> Result<Vec<u64>> {
    id_ensure!(
        hashed_vocab >= 1,
        Params,
        "Engram: the compressed vocabulary size must be at least 1, got 0"
    );
    let half = ((i64::MAX as u64 / hashed_vocab) / 2).max(1);
    let rng_seed = SITE_SEED_STRIDE
        .checked_mul(layer_id as u64)
        .and_then(|v| v.checked_add(seed))
        .ok_or_else(|| {
            IdError::Params(format!(
                "Engram: seed {seed} + 10007 * layer {layer_id} does not fit 64 bits"
            ))
        })?;
    // half <= 2^62, so it is a valid i64 and the range is never empty.
    let r = metrale_numpy_rng::default_rng(rng_seed)
        .integers_i64(0, half as i64, ngram_size)
        .map_err(|e| IdError::Params(format!("Engram multipliers: {e}")))?;
    Ok(r.into_iter().map(|r| 2 * r as u64 + 1).collect())
}

/// The prime head sizes of the first `layers` Engram layers, in order:
/// for each layer, each order `n` in `2..=N` (base `bases[n - 2]`) and
/// each of its `heads`, the next prime above the running start (which
/// begins at `base - 1`) that no earlier head took.
pub fn engram_head_sizes(bases: &[u64], heads: usize, layers: usize) -> Result<Vec<Vec<u64>>> {
    id_ensure!(
        heads >= 1,
        Params,
        "Engram: n_head_per_ngram must be at least 1"
    );
    let total = bases
        .len()
        .checked_mul(heads)
        .and_then(|v| v.checked_mul(layers))
        .filter(|&v| v <= MAX_PRIMES_SEARCHED);
    id_ensure!(
        total.is_some(),
        Params,
        "Engram: {layers} layers x {} orders x {heads} heads need more than \
         {MAX_PRIMES_SEARCHED} primes",
        bases.len()
    );
    let mut seen = HashSet::new();
    let mut out = Vec::with_capacity(layers);
    for _ in 0..layers {
        let mut sizes = Vec::with_capacity(bases.len() * heads);
        for (o, &base) in bases.iter().enumerate() {
            id_ensure!(
                base >= 1,
                Params,
                "Engram: the table base of order {} is 0",
                o + 2
            );
            let mut start = base - 1;
            for _ in 0..heads {
                let mut c = start;
                loop {
                    c = match c.checked_add(1) {
                        Some(c) => c,
                        None => id_bail!(Params, "Engram: no prime left above {start} in 64 bits"),
                    };
                    if is_prime(c) && !seen.contains(&c) {
                        break;
                    }
                }
                seen.insert(c);
                sizes.push(c);
                start = c;
            }
        }
        out.push(sizes);
    }
    Ok(out)
}

/// Running sums from 0 of `sizes`, and their total.
pub fn running_offsets(sizes: &[u64]) -> Result<(Vec<u64>, u64)> {
    let mut offsets = Vec::with_capacity(sizes.len());
    let mut total = 0u64;
    for &s in sizes {
        offsets.push(total);
        total = total
            .checked_add(s)
            .ok_or_else(|| IdError::Params("the head sizes sum past 2^64 - 1".into()))?;
    }
    Ok((offsets, total))
}

/// Where DeepSeek-V4.1's Engram look-back stops, over the positions of
/// `history ++ tokens` (history first). Each slice is empty (no such
/// boundary) or holds one flag per position of `history ++ tokens`.
///
/// - `doc_start[i]`: position `i` starts a document. No n-gram ending at
///   or after `i` reaches before `i`: position `i` hashes as at a sequence
///   start, its predecessors reading the mapped pad id.
/// - `masked[i]`: position `i` is masked (an image token, say). It hashes
///   as an n-gram of mapped pad ids only, and no later n-gram reaches it or
///   anything before it.
///
/// Flags on history positions older than `context_len` change nothing
/// (no n-gram of the tokens reaches them).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Boundaries<'a> {
    /// Document starts, one flag per position, or empty.
    pub doc_start: &'a [bool],
    /// Masked positions, one flag per position, or empty.
    pub masked: &'a [bool],
}

impl Boundaries<'_> {
    /// One flag per position of `history ++ tokens` (`history` and
    /// `tokens` their lengths), set at each of `positions`, which count in
    /// `tokens`: what a caller naming token positions builds either slice
    /// from. `Err(p)` for the first position `p` past the tokens.
    pub fn flags_at(
        positions: impl IntoIterator<Item = usize>,
        history: usize,
        tokens: usize,
    ) -> std::result::Result<Vec<bool>, usize> {
        let mut flags = vec![false; history + tokens];
        for p in positions {
            if p >= tokens {
                return Err(p);
            }
            flags[history + p] = true;
        }
        Ok(flags)
    }

    /// Refuse flag slices that are neither empty nor `positions` long.
    fn check(&self, positions: usize) -> Result<()> {
        for (name, s) in [("doc_start", self.doc_start), ("masked", self.masked)] {
            id_ensure!(
                s.is_empty() || s.len() == positions,
                Shape,
                "Engram boundaries: {name} has {} flags, history ++ tokens has {positions} \
                 positions (give one flag per position, or none)",
                s.len()
            );
        }
        Ok(())
    }
}

/// Engram ids of `tokens` after `history` with look-back boundaries, with
/// the constants of `dims` and the family `family` (which takes the place
/// of `dims.family`, as in `family_ids_into_plain`; `%` form, any Engram
/// pair that passes [`validate_family`]): writes
/// `tokens.len() * ngram_heads` ids, row-major, to `out`. Refuses, before
/// writing anything, a family other than Engram, flag slices of the wrong
/// length, an `out` of the wrong length and out-of-vocabulary tokens.
pub fn engram_ids_bounded_into(
    family: &HashFamily,
    dims: &PleIdDims,
    history: &[u32],
    tokens: &[u32],
    bounds: Boundaries<'_>,
    out: &mut [u64],
) -> Result<()> {
    if !family.takes_boundaries() {
        id_bail!(
            Params,
            "look-back boundaries are defined for the Engram family, not {}",
            family.name()
        );
    }
    validate_family(family, dims)?;
    let positions = history.len() + tokens.len();
    bounds.check(positions)?;
    let heads = dims.ngram_heads();
    id_ensure!(
        Some(out.len()) == tokens.len().checked_mul(heads),
        Shape,
        "engram_ids_bounded_into: out holds {} ids, {} tokens x {heads} heads need {}",
        out.len(),
        tokens.len(),
        tokens.len().saturating_mul(heads)
    );
    check_tokens(family, "history", history)?;
    check_tokens(family, "tokens", tokens)?;

    let map = family.token_map().map(|m| &m[..]);
    let mapped = |t: u32| match map {
        // Tokens were checked against the map's length.
        Some(m) => u64::from(m[t as usize]),
        None => u64::from(t),
    };
    let pad = mapped(dims.eos_token_id);
    let flag = |s: &[bool], i: usize| s.get(i).copied().unwrap_or(false);
    let c = dims.context_len();
    let k = dims.heads_per_ngram;
    let mults = &dims.multipliers;
    // prev[p] is shift_{p+1}: the nearest predecessors first, the pad id
    // where the look-back is blocked (a blocked shift blocks all longer
    // ones, so the pads always sit at the far end).
    let mut prev = [pad; MAX_NGRAM_SIZE - 1];
    let push = |prev: &mut [u64; MAX_NGRAM_SIZE - 1], i: usize, x: u64| {
        if flag(bounds.masked, i) {
            prev[..c].fill(pad);
        } else {
            prev.copy_within(0..c - 1, 1);
            prev[0] = x;
        }
    };
    let first = history.len().saturating_sub(c);
    for (i, &t) in history.iter().enumerate().skip(first) {
        if flag(bounds.doc_start, i) {
            prev[..c].fill(pad);
        }
        push(&mut prev, i, mapped(t));
    }
    for (j, (&t, row)) in tokens.iter().zip(out.chunks_exact_mut(heads)).enumerate() {
        let i = history.len() + j;
        if flag(bounds.doc_start, i) || flag(bounds.masked, i) {
            prev[..c].fill(pad);
        }
        let x = if flag(bounds.masked, i) {
            pad
        } else {
            mapped(t)
        };
        let mut mixed = x.wrapping_mul(mults[0]);
        for p in 0..c {
            mixed ^= prev[p].wrapping_mul(mults[p + 1]);
            let order = p * k..(p + 1) * k;
            let sizes = &dims.head_vocab_sizes[order.clone()];
            let offsets = &dims.head_offsets[order.clone()];
            for ((slot, &size), &offset) in row[order].iter_mut().zip(sizes).zip(offsets) {
                *slot = mixed % size + offset;
            }
        }
        push(&mut prev, i, x);
    }
    Ok(())
}

impl PleIdHasher {
    /// [`engram_ids_bounded_into`] with this hasher's family and dims: the
    /// ids of `tokens` after `history` with DeepSeek-V4.1's look-back
    /// boundaries. Refuses a hasher of another family.
    pub fn engram_ids_bounded_into(
        &self,
        history: &[u32],
        tokens: &[u32],
        bounds: Boundaries<'_>,
        out: &mut [u64],
    ) -> Result<()> {
        engram_ids_bounded_into(self.family(), self.dims(), history, tokens, bounds, out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn flags_at_counts_positions_in_the_tokens() {
        assert_eq!(
            Boundaries::flags_at([0, 2], 2, 3),
            Ok(vec![false, false, true, false, true])
        );
        assert_eq!(Boundaries::flags_at([], 1, 2), Ok(vec![false; 3]));
        assert_eq!(Boundaries::flags_at([1, 3, 5], 2, 3), Err(3));
    }

    #[test]
    fn seen_set_spans_layers_and_orders() {
        let s = engram_head_sizes(&[10, 10], 2, 2).unwrap();
        // Primes from 10: 11 13 17 19 | 23 29 31 37.
        assert_eq!(s, vec![vec![11, 13, 17, 19], vec![23, 29, 31, 37]]);
        let s = engram_head_sizes(&[10, 20], 2, 1).unwrap();
        assert_eq!(s, vec![vec![11, 13, 23, 29]]);
        // A later order whose base is below an earlier one skips taken primes.
        let s = engram_head_sizes(&[10, 12], 2, 1).unwrap();
        assert_eq!(s, vec![vec![11, 13, 17, 19]]);
    }

    #[test]
    fn multipliers_are_odd_and_bounded() {
        let v = 99_092;
        let m = engram_multipliers(v, 4, 0, 14).unwrap();
        assert_eq!(m.len(), 4);
        assert!(m.iter().all(|&m| m % 2 == 1 && m <= i64::MAX as u64 / v));
        assert!(engram_multipliers(0, 3, 0, 1).is_err());
        assert!(engram_multipliers(5, 3, u64::MAX, 1).is_err());
    }
}
