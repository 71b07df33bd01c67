//! How a PLE site's hash constants are derived from the model config
//! (docs/SPEC.md, "Constant derivation"), and the check of a checkpoint's stored copies.
//!
//! Invariants: every derived multiplier is odd; head sizes are distinct
//! primes in increasing order (site `s` takes the `s * ngram_heads + 1`-th
//! to `(s + 1) * ngram_heads`-th primes at or above the base, so sites never
//! share a modulus); offsets are the running sums of the sizes; the padded
//! row count is the smallest multiple of `divisible_by` at or above their
//! sum. All arithmetic that the definition makes wrapping is wrapping;
//! everything else is checked and overflow is an error, never a panic.

use super::error::{id_bail, id_ensure};
use super::{IdError, Result};

use super::PleIdDims;

pub use metrale_storage::splitmix::{SPLITMIX64_GAMMA, splitmix64};
/// Seed stride between PLE sites: site `s` hashes with `seed + 10007 * s`.
pub const SITE_SEED_STRIDE: u64 = 10007;
/// `ple_hash_seed` when config.json does not give one.
pub const DEFAULT_HASH_SEED: u64 = 1234;
/// `make_ngram_vocab_size_divisible_by` when config.json does not give one.
pub const DEFAULT_DIVISIBLE_BY: u64 = 128;
/// Largest accepted `ngram_size`. Real models use 2 to 4; the cap keeps a
/// malformed config from asking for absurd amounts of work and lets the
/// hash keep its per-token context on the stack.
pub const MAX_NGRAM_SIZE: usize = 32;
/// Largest accepted number of primes a derivation may have to step over
/// (`(site + 1) * ngram_heads`); beyond it the input is taken as malformed.
pub const MAX_PRIMES_SEARCHED: usize = 1 << 20;

/// The `ngram_size` odd multipliers of PLE site `site` (its position in
/// `ple_layer_ids`, not its layer number).
///
/// They are bounded by `(2^63 - 1) / vocab_size` so that the product of the
/// largest token with a multiplier stays below `2^63`.
pub fn derive_multipliers(
    vocab_size: u64,
    ngram_size: usize,
    seed: u64,
    site: usize,
) -> Result<Vec<u64>> {
    id_ensure!(
        vocab_size >= 1,
        Params,
        "vocab_size must be at least 1, got 0"
    );
    let max = (i64::MAX as u64) / vocab_size;
    let half = (max / 2).max(1);
    let base = seed.wrapping_add(SITE_SEED_STRIDE.wrapping_mul(site as u64));
    Ok((0..ngram_size as u64)
        .map(|i| {
            let v = splitmix64(base.wrapping_add(SPLITMIX64_GAMMA.wrapping_mul(i + 1)));
            2 * (v % half) + 1
        })
        .collect())
}

/// `a * b mod n` without overflow.
fn mul_mod(a: u64, b: u64, n: u64) -> u64 {
    ((u128::from(a) * u128::from(b)) % u128::from(n)) as u64
}

fn pow_mod(mut b: u64, mut e: u64, n: u64) -> u64 {
    let mut r = 1u64 % n;
    b %= n;
    while e > 0 {
        if e & 1 == 1 {
            r = mul_mod(r, b, n);
        }
        b = mul_mod(b, b, n);
        e >>= 1;
    }
    r
}

/// Deterministic primality for every `u64`: trial division by the primes
/// below 40, then Miller-Rabin with the first twelve prime bases, which has
/// no strong pseudoprime below 3.3e24 and so none in `u64`.
pub fn is_prime(n: u64) -> bool {
    const BASES: [u64; 12] = [2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37];
    if n < 2 {
        return false;
    }
    for p in BASES {
        if n.is_multiple_of(p) {
            return n == p;
        }
    }
    // n is odd and has no factor below 41 here.
    let s = (n - 1).trailing_zeros();
    let d = (n - 1) >> s;
    'witness: for a in BASES {
        let mut x = pow_mod(a, d, n);
        if x == 1 || x == n - 1 {
            continue;
        }
        for _ in 1..s {
            x = mul_mod(x, x, n);
            if x == n - 1 {
                continue 'witness;
            }
        }
        return false;
    }
    true
}

/// The `(skip + 1)`-th to `(skip + count)`-th primes at or above `base`
/// (i.e. strictly greater than `base - 1`), in increasing order.
pub fn primes_from(base: u64, skip: usize, count: usize) -> Result<Vec<u64>> {
    let total = skip
        .checked_add(count)
        .filter(|&t| t <= MAX_PRIMES_SEARCHED)
        .ok_or_else(|| {
            IdError::Params(format!(
                "asked for primes {} to {} at or above {base}: more than {MAX_PRIMES_SEARCHED} \
                 (site index or head count too large)",
                skip.saturating_add(1),
                skip.saturating_add(count)
            ))
        })?;
    let mut out = Vec::with_capacity(count);
    let mut found = 0usize;
    let mut n = base;
    while found < total {
        if is_prime(n) {
            if found >= skip {
                out.push(n);
            }
            found += 1;
        }
        n = match n.checked_add(1) {
            Some(n) => n,
            None if found < total => {
                id_bail!(
                    Params,
                    "fewer than {total} primes lie between {base} and 2^64 - 1"
                )
            }
            None => break,
        };
    }
    Ok(out)
}

/// Everything that determines one PLE site's hash constants.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PleHashParams {
    /// The unigram vocabulary size (`vocab_size`).
    pub vocab_size: u64,
    /// `eos_token_id` (the first entry when config.json gives a list).
    pub eos_token_id: u32,
    /// N (`ngram_size`).
    pub ngram_size: usize,
    /// K (`heads_per_ngram`).
    pub heads_per_ngram: usize,
    /// Head sizes are primes at or above this (`ngram_vocab_size_base`).
    pub ngram_vocab_size_base: u64,
    /// The table's row count is padded to a multiple of this
    /// (`make_ngram_vocab_size_divisible_by`).
    pub divisible_by: u64,
    /// `ple_hash_seed`.
    pub seed: u64,
    /// The site's position in `ple_layer_ids` (0-based).
    pub site: usize,
}

/// A site's derived hash constants.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DerivedPleIds {
    /// Multipliers, head sizes and offsets, ready for hashing.
    pub dims: PleIdDims,
    /// The table's row count: the sum of the head sizes, padded up to a
    /// multiple of `divisible_by`. Every id is below it.
    pub padded_rows: u64,
}

impl PleHashParams {
    /// Derive the site's constants; an error names the offending parameter.
    pub fn derive(&self) -> Result<DerivedPleIds> {
        id_ensure!(
            (2..=MAX_NGRAM_SIZE).contains(&self.ngram_size),
            Params,
            "ngram_size must be in 2..={MAX_NGRAM_SIZE}, got {}",
            self.ngram_size
        );
        id_ensure!(
            self.heads_per_ngram >= 1,
            Params,
            "heads_per_ngram must be at least 1, got 0"
        );
        id_ensure!(
            self.divisible_by >= 1,
            Params,
            "make_ngram_vocab_size_divisible_by must be at least 1, got 0"
        );
        let heads = (self.ngram_size - 1)
            .checked_mul(self.heads_per_ngram)
            .filter(|&h| h <= MAX_PRIMES_SEARCHED)
            .ok_or_else(|| {
                IdError::Params(format!(
                    "ngram_heads = (ngram_size - 1) * heads_per_ngram = {} * {} is too large",
                    self.ngram_size - 1,
                    self.heads_per_ngram
                ))
            })?;
        let skip = self
            .site
            .checked_mul(heads)
            .ok_or_else(|| IdError::Params(format!("site index {} is too large", self.site)))?;
        let multipliers =
            derive_multipliers(self.vocab_size, self.ngram_size, self.seed, self.site)?;
        let head_vocab_sizes = primes_from(self.ngram_vocab_size_base, skip, heads)?;
        let mut head_offsets = Vec::with_capacity(heads);
        let mut total = 0u64;
        for &s in &head_vocab_sizes {
            head_offsets.push(total);
            total = total
                .checked_add(s)
                .ok_or_else(|| IdError::Params("the head sizes sum past 2^64 - 1".into()))?;
        }
        let padded_rows = total
            .div_ceil(self.divisible_by)
            .checked_mul(self.divisible_by)
            .ok_or_else(|| {
                IdError::Params(format!(
                    "{total} rows padded to a multiple of {} exceed 2^64 - 1",
                    self.divisible_by
                ))
            })?;
        let dims = PleIdDims {
            ngram_size: self.ngram_size,
            heads_per_ngram: self.heads_per_ngram,
            multipliers,
            head_vocab_sizes,
            head_offsets,
            eos_token_id: self.eos_token_id,
            family: Default::default(),
        };
        dims.validate()?;
        Ok(DerivedPleIds { dims, padded_rows })
    }
}

fn check_buffer(name: &str, stored: &[i64], expected: &[u64]) -> Result<()> {
    id_ensure!(
        stored.len() == expected.len(),
        StoredBuffer,
        "stored buffer `{name}` has {} entries, the derivation gives {}",
        stored.len(),
        expected.len()
    );
    for (i, (&s, &e)) in stored.iter().zip(expected).enumerate() {
        if u64::try_from(s).ok() != Some(e) {
            id_bail!(
                StoredBuffer,
                "stored buffer `{name}` differs from the derivation at index {i}: stored {s}, derived {e}"
            );
        }
    }
    Ok(())
}

/// Check a checkpoint's stored I64 buffers (`layer_multipliers [N]`,
/// `ngram_heads_vocab_sizes [ngram_heads]`, `ngram_heads_offsets
/// [ngram_heads]`) against the derived constants. The error names the first
/// buffer that differs and its first differing index with both values.
pub fn check_stored_buffers(
    derived: &PleIdDims,
    layer_multipliers: &[i64],
    ngram_heads_vocab_sizes: &[i64],
    ngram_heads_offsets: &[i64],
) -> Result<()> {
    check_buffer("layer_multipliers", layer_multipliers, &derived.multipliers)?;
    check_buffer(
        "ngram_heads_vocab_sizes",
        ngram_heads_vocab_sizes,
        &derived.head_vocab_sizes,
    )?;
    check_buffer(
        "ngram_heads_offsets",
        ngram_heads_offsets,
        &derived.head_offsets,
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec_params(site: usize) -> PleHashParams {
        PleHashParams {
            vocab_size: 151_936,
            eos_token_id: 151_645,
            ngram_size: 3,
            heads_per_ngram: 8,
            ngram_vocab_size_base: 20_000_000,
            divisible_by: 128,
            seed: 1234,
            site,
        }
    }

    #[test]
    fn spec_worked_example() {
        let d = spec_params(0).derive().unwrap();
        assert_eq!(
            d.dims.multipliers,
            vec![15_411_308_609_579, 2_523_213_358_983, 11_275_943_025_685]
        );
        assert_eq!(
            &d.dims.head_vocab_sizes[..3],
            &[20_000_003, 20_000_023, 20_000_033]
        );
        assert_eq!(d.dims.head_offsets[0], 0);
        assert_eq!(d.dims.head_offsets[1], 20_000_003);
        assert_eq!(d.dims.table_rows(), 320_001_446);
        assert_eq!(d.padded_rows, 320_001_536);
    }

    #[test]
    fn site_one_continues_the_prime_sequence() {
        let s0 = spec_params(0).derive().unwrap();
        let s1 = spec_params(1).derive().unwrap();
        let all = primes_from(20_000_000, 0, 32).unwrap();
        assert_eq!(s0.dims.head_vocab_sizes, all[..16]);
        assert_eq!(s1.dims.head_vocab_sizes, all[16..]);
        assert_ne!(s0.dims.multipliers, s1.dims.multipliers);
        assert!(s1.dims.multipliers.iter().all(|m| m % 2 == 1));
    }

    #[test]
    fn is_prime_matches_a_sieve() {
        let n = 20_000;
        let mut sieve = vec![true; n];
        sieve[0] = false;
        sieve[1] = false;
        for i in 2..n {
            if sieve[i] {
                for j in (i * i..n).step_by(i) {
                    sieve[j] = false;
                }
            }
        }
        for (i, &p) in sieve.iter().enumerate() {
            assert_eq!(is_prime(i as u64), p, "{i}");
        }
    }

    #[test]
    fn is_prime_hard_cases() {
        // Carmichael numbers and strong pseudoprimes to the first bases,
        // each given with its factors so the test shows it is composite.
        let composites: [(u64, &[u64]); 7] = [
            (561, &[3, 11, 17]),
            (41_041, &[7, 11, 13, 41]),
            (3_215_031_751, &[151, 751, 28_351]),
            (2_152_302_898_747, &[6_763, 10_627, 29_947]),
            (3_474_749_660_383, &[1_303, 16_927, 157_543]),
            (341_550_071_728_321, &[10_670_053, 32_010_157]),
            (3_825_123_056_546_413_051, &[149_491, 747_451, 34_233_211]),
        ];
        for (c, factors) in composites {
            assert_eq!(factors.iter().product::<u64>(), c);
            assert!(!is_prime(c), "{c}");
        }
        assert!(is_prime((1 << 61) - 1));
        assert!(is_prime(18_446_744_073_709_551_557)); // largest u64 prime
        assert!(!is_prime(u64::MAX));
        assert!(!is_prime(4_294_967_291 * 4_294_967_279));
        assert!(is_prime(4_294_967_291) && is_prime(4_294_967_279));
    }

    #[test]
    fn primes_past_the_top_of_u64_are_an_error() {
        let e = primes_from(u64::MAX - 60, 0, 2).unwrap_err().to_string();
        assert!(e.contains("fewer than 2 primes"), "{e}");
        assert_eq!(
            primes_from(u64::MAX - 60, 0, 1).unwrap(),
            vec![18_446_744_073_709_551_557]
        );
    }

    #[test]
    fn bad_params_are_named() {
        let mut p = spec_params(0);
        p.vocab_size = 0;
        assert!(p.derive().unwrap_err().to_string().contains("vocab_size"));
        let mut p = spec_params(0);
        p.ngram_size = 1;
        assert!(p.derive().unwrap_err().to_string().contains("ngram_size"));
        let mut p = spec_params(0);
        p.heads_per_ngram = 0;
        assert!(
            p.derive()
                .unwrap_err()
                .to_string()
                .contains("heads_per_ngram")
        );
        let mut p = spec_params(0);
        p.divisible_by = 0;
        assert!(p.derive().unwrap_err().to_string().contains("divisible_by"));
        let mut p = spec_params(0);
        p.site = usize::MAX / 2;
        assert!(p.derive().unwrap_err().to_string().contains("too large"));
    }

    #[test]
    fn huge_vocab_gives_multiplier_one() {
        let m = derive_multipliers(u64::MAX, 3, 1234, 0).unwrap();
        assert_eq!(m, vec![1, 1, 1]);
    }

    #[test]
    fn stored_buffers_are_checked() {
        let d = spec_params(0).derive().unwrap().dims;
        let as_i64 = |v: &[u64]| v.iter().map(|&x| x as i64).collect::<Vec<_>>();
        let m = as_i64(&d.multipliers);
        let s = as_i64(&d.head_vocab_sizes);
        let o = as_i64(&d.head_offsets);
        check_stored_buffers(&d, &m, &s, &o).unwrap();

        let mut bad = s.clone();
        bad[5] += 2;
        let e = check_stored_buffers(&d, &m, &bad, &o)
            .unwrap_err()
            .to_string();
        assert!(e.contains("ngram_heads_vocab_sizes"), "{e}");
        assert!(e.contains("index 5"), "{e}");
        assert!(e.contains(&format!("stored {}", bad[5])), "{e}");
        assert!(e.contains(&format!("derived {}", s[5])), "{e}");

        let mut neg = m.clone();
        neg[0] = -1;
        let e = check_stored_buffers(&d, &neg, &s, &o)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("layer_multipliers") && e.contains("index 0") && e.contains("stored -1"),
            "{e}"
        );

        let e = check_stored_buffers(&d, &m, &s, &o[..15])
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("ngram_heads_offsets") && e.contains("15 entries"),
            "{e}"
        );
    }
}
