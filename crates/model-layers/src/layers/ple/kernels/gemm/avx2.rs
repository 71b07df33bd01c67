//! The AVX2 + FMA register tile and weight conversion.

use std::arch::x86_64::*;

use super::NR;

/// One packed weight block as f32 `[kc, NR]` (`kc = dst.len() / NR`):
/// each pair word gives step `2i` (its high half, masked) and step
/// `2i + 1` (its low half, shifted up).
///
/// # Safety
/// The CPU must support AVX2 and FMA.
#[target_feature(enable = "avx2,fma")]
pub(super) unsafe fn convert(src: &[u16], dst: &mut [f32]) {
    let kc = dst.len() / NR;
    assert!(src.len() >= kc.div_ceil(2) * 2 * NR && dst.len() == kc * NR);
    let words = src.as_ptr().cast::<u32>();
    // SAFETY: the assert bounds every load (pair `i` is words
    // `i * NR .. (i + 1) * NR`) and store; loads and stores are
    // unaligned.
    unsafe {
        let mask = _mm256_set1_epi32(0xFFFF_0000u32 as i32);
        for i in 0..kc.div_ceil(2) {
            for h in 0..2 {
                let v = _mm256_loadu_si256(words.add(i * NR + 8 * h).cast());
                let even = _mm256_castsi256_ps(_mm256_and_si256(v, mask));
                _mm256_storeu_ps(dst.as_mut_ptr().add(2 * i * NR + 8 * h), even);
                if 2 * i + 1 < kc {
                    let odd = _mm256_castsi256_ps(_mm256_slli_epi32::<16>(v));
                    _mm256_storeu_ps(dst.as_mut_ptr().add((2 * i + 1) * NR + 8 * h), odd);
                }
            }
        }
    }
}

/// One row against `P` consecutive panels, converting the BF16 weights
/// in registers: `out [P * NR]` continues the sequential FMA chain over
/// steps `k0..k1` from the sums it holds, exactly as `portable::micro`
/// computes it through blocks.
///
/// # Safety
/// The CPU must support AVX2 and FMA; `k0` even, `k0 < k1 <= e`; `x`
/// readable at `e` values, `w` at `P` packed panels of depth `e`, `out`
/// readable and writable at `P * NR` values.
#[target_feature(enable = "avx2,fma")]
pub(super) unsafe fn row_direct<const P: usize>(
    x: *const f32,
    w: *const u16,
    e: usize,
    k0: usize,
    k1: usize,
    out: *mut f32,
) {
    // SAFETY: every access stays inside the ranges the caller guarantees;
    // loads and stores are unaligned.
    unsafe {
        let words = w.cast::<u32>();
        let pw = e.div_ceil(2) * NR;
        let mask = _mm256_set1_epi32(0xFFFF_0000u32 as i32);
        let mut c0 = [_mm256_setzero_ps(); P];
        let mut c1 = [_mm256_setzero_ps(); P];
        for p in 0..P {
            c0[p] = _mm256_loadu_ps(out.add(p * NR));
            c1[p] = _mm256_loadu_ps(out.add(p * NR + 8));
        }
        for i in k0 / 2..k1.div_ceil(2) {
            // The last pair of an odd depth has no later step.
            let has_odd = 2 * i + 1 < k1;
            let a0 = _mm256_broadcast_ss(&*x.add(2 * i));
            for p in 0..P {
                let src = words.add(p * pw + i * NR);
                let v0 = _mm256_loadu_si256(src.cast());
                let v1 = _mm256_loadu_si256(src.add(8).cast());
                let e0 = _mm256_castsi256_ps(_mm256_and_si256(v0, mask));
                let e1 = _mm256_castsi256_ps(_mm256_and_si256(v1, mask));
                c0[p] = _mm256_fmadd_ps(a0, e0, c0[p]);
                c1[p] = _mm256_fmadd_ps(a0, e1, c1[p]);
                if has_odd {
                    let a1 = _mm256_broadcast_ss(&*x.add(2 * i + 1));
                    let o0 = _mm256_castsi256_ps(_mm256_slli_epi32::<16>(v0));
                    let o1 = _mm256_castsi256_ps(_mm256_slli_epi32::<16>(v1));
                    c0[p] = _mm256_fmadd_ps(a1, o0, c0[p]);
                    c1[p] = _mm256_fmadd_ps(a1, o1, c1[p]);
                }
            }
        }
        for p in 0..P {
            _mm256_storeu_ps(out.add(p * NR), c0[p]);
            _mm256_storeu_ps(out.add(p * NR + 8), c1[p]);
        }
    }
}

/// `acc [M, NR] += x [M, kc] @ b [kc, NR]`: one FMA per element and
/// step, `k` ascending, exactly as `portable::micro`.
///
/// # Safety
/// The CPU must support AVX2 and FMA; `x` must be readable at `i * xs +
/// k` for `i < M`, `k < kc`; `b` at `kc * NR` values; `acc` readable and
/// writable at `M * NR` values.
#[target_feature(enable = "avx2,fma")]
pub(super) unsafe fn micro<const M: usize>(
    x: *const f32,
    xs: usize,
    b: *const f32,
    kc: usize,
    acc: *mut f32,
) {
    // SAFETY: all reads and writes stay inside the ranges the caller
    // guarantees; unaligned loads and stores are used throughout.
    unsafe {
        let mut c0 = [_mm256_setzero_ps(); M];
        let mut c1 = [_mm256_setzero_ps(); M];
        for i in 0..M {
            c0[i] = _mm256_loadu_ps(acc.add(i * NR));
            c1[i] = _mm256_loadu_ps(acc.add(i * NR + 8));
        }
        for k in 0..kc {
            let b0 = _mm256_loadu_ps(b.add(k * NR));
            let b1 = _mm256_loadu_ps(b.add(k * NR + 8));
            for i in 0..M {
                let a = _mm256_broadcast_ss(&*x.add(i * xs + k));
                c0[i] = _mm256_fmadd_ps(a, b0, c0[i]);
                c1[i] = _mm256_fmadd_ps(a, b1, c1[i]);
            }
        }
        for i in 0..M {
            _mm256_storeu_ps(acc.add(i * NR), c0[i]);
            _mm256_storeu_ps(acc.add(i * NR + 8), c1[i]);
        }
    }
}
