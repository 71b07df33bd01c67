//! The AVX2 head reduction (x86_64, picked at run time): one order's mixed
//! value reduced by four head moduli at once.
//!
//! Per lane: `q = floor(fl(x) * fl(1/d))` in f64, `r = x - q*d` in 64-bit
//! integers, then at most one `+d` or `-d`. Why that is exact: `fl(x)`,
//! `fl(1/d)` and their product each round once with relative error at most
//! 2^-53, so the estimate of `x/d` is off by less than
//! `(x/d) * 2^-51 < 2^13 / d`, which is below 1 for `d >= 2^16`. Then `q`
//! is `floor(x/d)` or one off, `r` lies in `[-d, 2d)`, and since
//! `d < 2^32` that range fits an `i64`, so the wrapped subtraction gives
//! the true `r` and the signed compares fix it up. `q < 2^48` becomes an
//! integer by adding 2^52 (exact below 2^52), and its low 64-bit product
//! with `d` is two 32x32 multiplies. Divisors outside `[2^16, 2^32)` never
//! reach this path. The unit tests below check it against `%` over the
//! whole `u64` range and at multiples of `d`.
//!
//! Invariants: an [`Avx2Plan`] exists only when the CPU has AVX2 and every
//! head size is in range; [`Avx2Rows`] can only be built from a plan, which
//! is what makes its `unsafe` intrinsics sound.

use std::arch::x86_64::{
    __m256d, __m256i, _mm256_add_epi64, _mm256_add_pd, _mm256_and_si256, _mm256_castpd_si256,
    _mm256_cmpgt_epi64, _mm256_floor_pd, _mm256_loadu_pd, _mm256_loadu_si256, _mm256_mul_epu32,
    _mm256_mul_pd, _mm256_set1_epi64x, _mm256_set1_pd, _mm256_setzero_si256, _mm256_slli_epi64,
    _mm256_srli_epi64, _mm256_storeu_si256, _mm256_sub_epi64,
};

use super::{HeadMod, HeadRows, PleIdDims};

/// Smallest head size the f64 estimate handles exactly (see the module doc).
pub(super) const MIN_DIVISOR: u64 = 1 << 16;
/// Head sizes must be below 2^32 for the 32x32-bit product and `i64` range.
pub(super) const MAX_DIVISOR: u64 = (1 << 32) - 1;

/// Four heads' constants, laid out for 256-bit loads.
#[derive(Clone, Copy, Debug)]
#[repr(C, align(32))]
pub(super) struct Group4 {
    inv: [f64; 4],
    d: [u64; 4],
    d_minus_1: [u64; 4],
    offset: [u64; 4],
}

impl Group4 {
    fn new(heads: &[(u64, u64)]) -> Self {
        let mut g = Group4 {
            inv: [0.0; 4],
            d: [0; 4],
            d_minus_1: [0; 4],
            offset: [0; 4],
        };
        for (i, &(d, off)) in heads.iter().enumerate() {
            g.inv[i] = 1.0 / d as f64;
            g.d[i] = d;
            g.d_minus_1[i] = d - 1;
            g.offset[i] = off;
        }
        g
    }
}

/// The vector constants of every order: `per_order` groups of four heads
/// each; an order's remaining `K % 4` heads stay scalar.
#[derive(Clone, Debug)]
pub(super) struct Avx2Plan {
    groups: Vec<Group4>,
    per_order: usize,
}

impl Avx2Plan {
    /// A plan for `dims`, or `None` when the CPU lacks AVX2, an order has
    /// fewer than four heads, or a head size is outside the exact range.
    pub(super) fn new(dims: &PleIdDims) -> Option<Self> {
        Self::build(dims).filter(|_| std::arch::is_x86_feature_detected!("avx2"))
    }

    fn build(dims: &PleIdDims) -> Option<Self> {
        let k = dims.heads_per_ngram;
        let per_order = k / 4;
        if per_order == 0
            || dims
                .head_vocab_sizes
                .iter()
                .any(|d| !(MIN_DIVISOR..=MAX_DIVISOR).contains(d))
        {
            return None;
        }
        let pairs: Vec<(u64, u64)> = dims
            .head_vocab_sizes
            .iter()
            .copied()
            .zip(dims.head_offsets.iter().copied())
            .collect();
        let groups = pairs
            .chunks_exact(k)
            .flat_map(|order| order.chunks_exact(4).map(Group4::new))
            .collect();
        Some(Self { groups, per_order })
    }
}

/// [`HeadRows`] through a plan: vector groups first, scalar for the rest.
pub(super) struct Avx2Rows<'a> {
    plan: &'a Avx2Plan,
    heads: &'a [HeadMod],
}

impl<'a> Avx2Rows<'a> {
    /// Rows for a plan built from the same dims as `heads`.
    pub(super) fn new(plan: &'a Avx2Plan, heads: &'a [HeadMod]) -> Self {
        Self { plan, heads }
    }
}

/// `x % d + offset` for the four heads of `g`, stored at `out`.
///
/// # Safety
/// The CPU must support AVX2 and `out` must be valid for four `u64` writes.
#[inline(always)]
unsafe fn reduce4(g: &Group4, xf: __m256d, xi: __m256i, out: *mut u64) {
    // SAFETY: the caller guarantees AVX2 and that `out` holds four u64;
    // the loads read the four-element arrays of `g`.
    unsafe {
        let two52 = _mm256_set1_pd(4_503_599_627_370_496.0);
        let inv = _mm256_loadu_pd(g.inv.as_ptr());
        let d = _mm256_loadu_si256(g.d.as_ptr().cast());
        let q = _mm256_floor_pd(_mm256_mul_pd(xf, inv));
        // q < 2^52: adding 2^52 leaves q in the mantissa bits.
        let q = _mm256_sub_epi64(
            _mm256_castpd_si256(_mm256_add_pd(q, two52)),
            _mm256_castpd_si256(two52),
        );
        let qd = _mm256_add_epi64(
            _mm256_mul_epu32(q, d),
            _mm256_slli_epi64::<32>(_mm256_mul_epu32(_mm256_srli_epi64::<32>(q), d)),
        );
        let r = _mm256_sub_epi64(xi, qd);
        let neg = _mm256_cmpgt_epi64(_mm256_setzero_si256(), r);
        let r = _mm256_add_epi64(r, _mm256_and_si256(neg, d));
        let over = _mm256_cmpgt_epi64(r, _mm256_loadu_si256(g.d_minus_1.as_ptr().cast()));
        let r = _mm256_sub_epi64(r, _mm256_and_si256(over, d));
        let id = _mm256_add_epi64(r, _mm256_loadu_si256(g.offset.as_ptr().cast()));
        _mm256_storeu_si256(out.cast(), id);
    }
}

impl HeadRows for Avx2Rows<'_> {
    #[inline(always)]
    fn order_rows(&self, order: usize, first: usize, mixed: u64, out: &mut [u64]) {
        let n = self.plan.per_order;
        let groups = &self.plan.groups[order * n..(order + 1) * n];
        assert!(out.len() >= 4 * n);
        // SAFETY: an Avx2Rows exists only through an Avx2Plan, which is only
        // built after AVX2 was detected; `out` holds at least 4n entries
        // (asserted), so group i writes out[4i..4i+4] in bounds.
        unsafe {
            let xf = _mm256_set1_pd(mixed as f64);
            let xi = _mm256_set1_epi64x(mixed as i64);
            for (i, g) in groups.iter().enumerate() {
                reduce4(g, xf, xi, out.as_mut_ptr().add(4 * i));
            }
        }
        let done = 4 * n;
        for (o, h) in out[done..].iter_mut().zip(&self.heads[first + done..]) {
            *o = h.m.rem(mixed) + h.offset;
        }
    }
}

/// [`super::hash_run`] compiled with AVX2 enabled, so the intrinsics inline.
///
/// # Safety
/// The CPU must support AVX2 (true whenever an [`Avx2Rows`] exists).
#[target_feature(enable = "avx2")]
pub(super) unsafe fn hash_run_avx2(
    dims: &PleIdDims,
    rows: &Avx2Rows<'_>,
    history: &[u32],
    tokens: &[u32],
    out: &mut [u64],
) {
    super::hash_run(dims, rows, history, tokens, out);
}

/// [`super::family::engram_run`] compiled with AVX2 enabled.
///
/// # Safety
/// The CPU must support AVX2 (true whenever an [`Avx2Rows`] exists).
#[target_feature(enable = "avx2")]
pub(super) unsafe fn engram_run_avx2(
    dims: &PleIdDims,
    map: Option<&[u32]>,
    fill: u64,
    rows: &Avx2Rows<'_>,
    history: &[u32],
    tokens: &[u32],
    out: &mut [u64],
) {
    super::family::engram_run(dims, map, fill, rows, history, tokens, out);
}

/// [`super::hash_batch`] compiled with AVX2 enabled.
///
/// # Safety
/// The CPU must support AVX2 (true whenever an [`Avx2Rows`] exists).
#[target_feature(enable = "avx2")]
pub(super) unsafe fn hash_batch_avx2<'h>(
    dims: &PleIdDims,
    rows: &Avx2Rows<'_>,
    histories: impl Iterator<Item = &'h [u32]>,
    tokens: &[u32],
    out: &mut [u64],
) {
    super::hash_batch(dims, rows, histories, tokens, out);
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// The vector reduction of `x` by four divisors, or `None` without AVX2.
    fn rem4(ds: [u64; 4], x: u64) -> Option<[u64; 4]> {
        if !std::arch::is_x86_feature_detected!("avx2") {
            return None;
        }
        let g = Group4::new(&ds.map(|d| (d, 0)));
        let mut out = [0u64; 4];
        // SAFETY: AVX2 was just detected and `out` holds four u64.
        unsafe { reduce4_avx2(&g, x, out.as_mut_ptr()) };
        Some(out)
    }

    #[target_feature(enable = "avx2")]
    unsafe fn reduce4_avx2(g: &Group4, x: u64, out: *mut u64) {
        // SAFETY: the caller guarantees AVX2 and four writable u64.
        unsafe {
            reduce4(
                g,
                _mm256_set1_pd(x as f64),
                _mm256_set1_epi64x(x as i64),
                out,
            )
        }
    }

    fn check(ds: [u64; 4], x: u64) -> Result<(), TestCaseError> {
        if let Some(got) = rem4(ds, x) {
            prop_assert_eq!(got, ds.map(|d| x % d), "x = {}", x);
        }
        Ok(())
    }

    fn divisor() -> impl Strategy<Value = u64> {
        prop_oneof![
            MIN_DIVISOR..=MAX_DIVISOR,
            Just(MIN_DIVISOR),
            Just(MAX_DIVISOR),
            (1u64 << 24)..(1u64 << 26),
        ]
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(4096))]

        #[test]
        fn matches_rem_over_all_u64(ds in prop::array::uniform4(divisor()), x in any::<u64>()) {
            check(ds, x)?;
        }

        #[test]
        fn matches_rem_at_multiples(ds in prop::array::uniform4(divisor()), k in any::<u64>(), lane in 0usize..4) {
            let d = ds[lane];
            let m = (k % (u64::MAX / d)) * d;
            for x in [m.saturating_sub(1), m, m + 1, m + d - 1, (u64::MAX / d) * d, u64::MAX, 0] {
                check(ds, x)?;
            }
        }
    }

    #[test]
    fn extreme_divisors_and_values() {
        let ds = [MIN_DIVISOR, MIN_DIVISOR + 1, MAX_DIVISOR, MAX_DIVISOR - 1];
        for x in [
            0,
            1,
            u64::MAX,
            u64::MAX - 1,
            1 << 63,
            (1 << 63) - 1,
            1 << 53,
            (1 << 53) + 1,
        ] {
            check(ds, x).unwrap();
        }
        for d in ds {
            for k in [1u64, 2, 3, (u64::MAX / d) - 1, u64::MAX / d] {
                let m = k * d;
                for x in [m - 1, m, m.saturating_add(1)] {
                    check(ds, x).unwrap();
                }
            }
        }
    }

    #[test]
    fn plan_refuses_out_of_range_heads() {
        let mut dims = PleIdDims {
            ngram_size: 2,
            heads_per_ngram: 4,
            multipliers: vec![1, 3],
            head_vocab_sizes: vec![65_537, 65_539, 65_543, 65_551],
            head_offsets: vec![0, 65_537, 131_076, 196_619],
            eos_token_id: 0,
            family: Default::default(),
        };
        assert!(Avx2Plan::build(&dims).is_some());
        dims.head_vocab_sizes[2] = 65_521; // below 2^16
        assert!(Avx2Plan::build(&dims).is_none());
        dims.head_vocab_sizes[2] = 1 << 32;
        assert!(Avx2Plan::build(&dims).is_none());
    }
}
