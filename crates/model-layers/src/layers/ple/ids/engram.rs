//! Engram's hash constants (docs/SPEC.md, "Families"): multipliers drawn
//! from numpy's generator, prime head sizes from one `seen` set shared by
//! every layer.
//!
//! Invariants: every multiplier is odd and at most `(2^63 - 1) / V'`, so
//! no product of a hashed id leaves the signed 64-bit range; the head sizes
//! of all layers are distinct primes; a layer's offsets are the running
//! sums of its sizes from 0. Overflow is an error, never a panic.

use std::collections::HashSet;

use super::error::{id_bail, id_ensure};
use super::{IdError, MAX_PRIMES_SEARCHED, Result, SITE_SEED_STRIDE, is_prime};

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

#[cfg(test)]
mod tests {
    use super::*;

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
