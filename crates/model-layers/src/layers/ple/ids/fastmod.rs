//! Exact `n % d` and `n / d` for a divisor fixed in advance, by one
//! multiply-high with a precomputed reciprocal instead of a hardware divide.
//!
//! The method is the round-up variant of division by invariant integers
//! (Granlund and Montgomery, 1994, figure 4.1): with `l = ceil(log2 d)` and
//! `m = floor(2^64 * (2^l - d) / d) + 1`, the quotient of any `n < 2^64` is
//! `(t + ((n - t) >> min(l, 1))) >> max(l - 1, 0)` where `t = mulhi(m, n)`.
//! It is exact for every divisor `1 <= d < 2^64` and every `n`, with no
//! correction step, which is what lets the id hash replace `%` by it and
//! stay bit-exact. `tests/ids_fastmod.rs` checks it against `%` over the
//! whole `u64` range.
//!
//! Invariants: a [`FastMod`] is only built for a non-zero divisor; `m`
//! always fits in 64 bits (shown in [`FastMod::new`]).

/// A non-zero divisor with its precomputed reciprocal.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FastMod {
    d: u64,
    m: u64,
    sh1: u32,
    sh2: u32,
}

impl FastMod {
    /// The reciprocal of `d`, or `None` when `d` is zero.
    pub fn new(d: u64) -> Option<Self> {
        if d == 0 {
            return None;
        }
        // l = ceil(log2 d); 0 for d = 1.
        let l = if d == 1 {
            0
        } else {
            64 - (d - 1).leading_zeros()
        };
        // 2^(l-1) < d <= 2^l, so 2^l - d < d and the quotient below is
        // below 2^64; the +1 reaches 2^64 only if 2^l >= 2d, which that
        // bound excludes. Hence the cast is lossless.
        let num = ((1u128 << l) - u128::from(d)) << 64;
        let m = (num / u128::from(d) + 1) as u64;
        Some(Self {
            d,
            m,
            sh1: l.min(1),
            sh2: l.saturating_sub(1),
        })
    }

    /// The divisor.
    #[inline]
    pub fn divisor(&self) -> u64 {
        self.d
    }

    /// `n / d`, exactly.
    #[inline(always)]
    pub fn div(&self, n: u64) -> u64 {
        let t = ((u128::from(self.m) * u128::from(n)) >> 64) as u64;
        // t <= n because m < 2^64, so neither the subtraction nor the
        // addition (at most n) can wrap.
        (t + ((n - t) >> self.sh1)) >> self.sh2
    }

    /// `n % d`, exactly.
    #[inline(always)]
    pub fn rem(&self, n: u64) -> u64 {
        n - self.div(n) * self.d
    }
}

#[cfg(test)]
mod tests {
    use super::FastMod;

    #[test]
    fn zero_divisor_is_refused() {
        assert!(FastMod::new(0).is_none());
    }

    #[test]
    fn small_divisors_and_edges_match_hardware_division() {
        let ns = [
            0u64,
            1,
            2,
            3,
            u64::MAX,
            u64::MAX - 1,
            1 << 63,
            (1 << 63) - 1,
            (1 << 63) + 1,
        ];
        for d in (1u64..=300).chain([u64::MAX, u64::MAX - 1, 1 << 63, (1 << 63) + 1, 20_000_003]) {
            let f = FastMod::new(d).unwrap();
            for &n in &ns {
                assert_eq!(f.div(n), n / d, "{n} / {d}");
                assert_eq!(f.rem(n), n % d, "{n} % {d}");
            }
            for k in [1u64, 2, 7, 1000] {
                if let Some(n) = d.checked_mul(k) {
                    for n in [n - 1, n, n.saturating_add(1)] {
                        assert_eq!(f.rem(n), n % d, "{n} % {d}");
                    }
                }
            }
        }
    }
}
