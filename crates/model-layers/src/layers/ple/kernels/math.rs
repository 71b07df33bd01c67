//! The scalar math every kernel path shares.
//!
//! Sums over a vector use a fixed 16-lane layout: element `i` goes into lane
//! `i % 16` in index order and the lanes are combined by one fixed tree. The
//! order is therefore a function of the length alone, never of how many rows
//! a call holds, which thread runs it, or which instruction set compiled it
//! (Rust never fuses or reassociates float operations on its own), and the
//! loop still vectorises.

/// Lanes of the fixed-order sums.
const LANES: usize = 16;

pub use metrale_storage::dtype::bf16_to_f32;

/// `x` rounded to the nearest BF16 value (ties to even), as f32. NaN stays
/// NaN. The one BF16 encoder of the project does the rounding.
#[inline(always)]
pub fn bf16_round(x: f32) -> f32 {
    bf16_to_f32(metrale_storage::dtype::f32_to_bf16(x))
}

/// Combine the 16 lanes in a fixed tree.
#[inline(always)]
fn fold(mut acc: [f32; LANES]) -> f32 {
    let mut w = LANES / 2;
    while w > 0 {
        for i in 0..w {
            acc[i] += acc[i + w];
        }
        w /= 2;
    }
    acc[0]
}

/// `sum(f(i))` over `0..n` in the fixed lane order.
#[inline(always)]
fn lane_sum(n: usize, f: impl Fn(usize) -> f32) -> f32 {
    let mut acc = [0.0f32; LANES];
    let full = n / LANES * LANES;
    let mut i = 0;
    while i < full {
        for (l, a) in acc.iter_mut().enumerate() {
            *a += f(i + l);
        }
        i += LANES;
    }
    for (l, a) in acc.iter_mut().enumerate().take(n - full) {
        *a += f(full + l);
    }
    fold(acc)
}

/// `sum(x[i]^2)` in the fixed lane order.
#[inline(always)]
pub fn sum_sq(x: &[f32]) -> f32 {
    lane_sum(x.len(), |i| x[i] * x[i])
}

/// The RMS-norm factor `1 / sqrt(mean(x^2) + eps)`.
#[inline(always)]
pub fn rms_factor(x: &[f32], eps: f32) -> f32 {
    1.0 / (sum_sq(x) / x.len() as f32 + eps).sqrt()
}

/// `dot(norm(q), norm(k))` where `norm(v)[d] = v[d] * rv * (1 + wv[d])`,
/// in the fixed lane order. All slices have one length.
#[inline(always)]
pub fn normed_dot(q: &[f32], rq: f32, wq: &[f32], k: &[f32], rk: f32, wk: &[f32]) -> f32 {
    normed_dot_off(q, rq, wq, k, rk, wk, 1.0)
}

/// [`normed_dot`] with `norm(v)[d] = v[d] * rv * (off + wv[d])`: `off` 1
/// is the `(1 + w)` form, 0 the `w` form (adding 0.0 changes no weight).
#[inline(always)]
pub fn normed_dot_off(
    q: &[f32],
    rq: f32,
    wq: &[f32],
    k: &[f32],
    rk: f32,
    wk: &[f32],
    off: f32,
) -> f32 {
    let n = q.len();
    let (k, wq, wk) = (&k[..n], &wq[..n], &wk[..n]);
    lane_sum(n, |i| {
        (q[i] * rq * (off + wq[i])) * (k[i] * rk * (off + wk[i]))
    })
}

/// The gate of one stream: `sigmoid(sign(g) * sqrt(max(|g|, 1e-6)))`, with
/// `sign(0) = 0` (so `g == 0` gives exactly 0.5).
#[inline(always)]
pub fn gate_sigma(g: f32) -> f32 {
    let sign = if g > 0.0 {
        1.0
    } else if g < 0.0 {
        -1.0
    } else if g == 0.0 {
        0.0
    } else {
        g
    };
    sigmoid(sign * g.abs().max(1e-6).sqrt())
}

/// DeepSeek-V4.1's gate of one stream:
/// `sigmoid(copysign(sqrt(max(|g|, 1e-6)), g))`. The sign bit of `g` picks
/// the side even at zero (`+0` gives `sigmoid(1e-3)`, `-0`
/// `sigmoid(-1e-3)`), and NaN stays NaN (torch's `clamp_min` propagates it,
/// where `f32::max` would not).
#[inline(always)]
pub fn gate_sigma_copysign(g: f32) -> f32 {
    if g.is_nan() {
        return g;
    }
    sigmoid(g.abs().max(1e-6).sqrt().copysign(g))
}

/// `1 / (1 + exp(-z))`.
#[inline(always)]
pub fn sigmoid(z: f32) -> f32 {
    1.0 / (1.0 + (-z).exp())
}

/// `y * sigmoid(y)`, written as `y / (1 + exp(-y))` with [`exp_vec`].
#[inline(always)]
pub fn silu(y: f32) -> f32 {
    y / (1.0 + exp_vec(-y))
}

/// `e^x` to within 2 ulp over the normal range, in plain arithmetic that
/// vectorises (the library `exp` is a call per element). Inputs are clamped
/// to `[-87, 88]`, so results stay finite and normal; NaN stays NaN.
///
/// Method: `x = n ln2 + r` with `n` rounded to nearest by the 1.5 * 2^23
/// trick (which also leaves `n` in the low mantissa bits), `|r| <= ln2/2`,
/// a degree-6 polynomial for `e^r`, and `2^n` built from its bits.
#[inline(always)]
pub fn exp_vec(x: f32) -> f32 {
    const MAGIC: f32 = 12_582_912.0; // 1.5 * 2^23
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    // ln 2 split so that n * LN2_HI is exact for |n| < 2^9.
    const LN2_HI: f32 = 0.693_359_4;
    const LN2_LO: f32 = -2.121_944_4e-4;
    let x = x.clamp(-87.0, 88.0);
    let t = x * LOG2E + MAGIC;
    let n = t - MAGIC;
    let ni = (t.to_bits() as i32).wrapping_sub(0x4B40_0000);
    let r = (x - n * LN2_HI) - n * LN2_LO;
    let mut p = 1.987_569_1e-4f32;
    p = p * r + 1.398_199_9e-3;
    p = p * r + 8.333_452e-3;
    p = p * r + 4.166_579_6e-2;
    p = p * r + 1.666_666_5e-1;
    p = p * r + 0.5;
    let er = p * (r * r) + r + 1.0;
    f32::from_bits((ni.wrapping_add(127) as u32) << 23) * er
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bf16_round_is_nearest_even() {
        assert_eq!(bf16_round(1.0), 1.0);
        // 1 + 2^-8 lies exactly between 1 and 1 + 2^-7: ties go to even (1).
        assert_eq!(bf16_round(1.0 + 1.0 / 256.0), 1.0);
        // 1 + 3 * 2^-8 lies between 1 + 2^-7 (odd) and 1 + 2^-6 (even).
        assert_eq!(bf16_round(1.0 + 3.0 / 256.0), 1.0 + 1.0 / 64.0);
        assert_eq!(bf16_round(1.0 + 1.5 / 256.0), 1.0 + 1.0 / 128.0);
        assert_eq!(bf16_round(-3.0), -3.0);
        assert!(bf16_round(f32::NAN).is_nan());
        assert_eq!(bf16_round(f32::INFINITY), f32::INFINITY);
        assert_eq!(bf16_to_f32(0x3F80), 1.0);
        assert_eq!(bf16_to_f32(0xC040), -3.0);
    }

    #[test]
    fn lane_sum_matches_plain_sum_on_exact_values() {
        for n in [0usize, 1, 5, 16, 17, 33, 160, 161] {
            let x: Vec<f32> = (0..n).map(|i| (i % 7) as f32 - 3.0).collect();
            let plain: f32 = x.iter().map(|v| v * v).sum();
            assert_eq!(sum_sq(&x), plain, "n = {n}");
        }
    }

    #[test]
    fn gate_sigma_special_values() {
        assert_eq!(gate_sigma(0.0), 0.5);
        assert_eq!(gate_sigma(-0.0), 0.5);
        let s = gate_sigma(4.0);
        assert!((s - 1.0 / (1.0 + (-2.0f32).exp())).abs() < 1e-7);
        assert!((gate_sigma(-4.0) + s - 1.0).abs() < 1e-6);
        // Tiny |g| is clamped to 1e-6 before the root.
        assert_eq!(gate_sigma(1e-12), sigmoid(1e-3));
        assert!(gate_sigma(f32::NAN).is_nan());
        // The published V4.1 gate: zero keeps its sign, the clamp applies.
        assert_eq!(gate_sigma_copysign(0.0), sigmoid(1e-3));
        assert_eq!(gate_sigma_copysign(-0.0), sigmoid(-1e-3));
        assert!(gate_sigma_copysign(0.0) > 0.5002);
        assert_eq!(gate_sigma_copysign(4.0), gate_sigma(4.0));
        assert_eq!(gate_sigma_copysign(-4.0), gate_sigma(-4.0));
        assert!(gate_sigma_copysign(f32::NAN).is_nan());
    }

    #[test]
    fn exp_vec_is_within_two_ulp() {
        let mut worst = 0.0f64;
        let mut x = -87.0f32;
        while x <= 88.0 {
            let want = (x as f64).exp();
            let got = exp_vec(x) as f64;
            // One ulp of the f32 result.
            let ulp = (want as f32).abs() as f64 * f32::EPSILON as f64;
            worst = worst.max((got - want).abs() / ulp);
            x += 0.000_731;
        }
        assert!(worst <= 2.0, "worst error {worst} ulp");
        assert_eq!(exp_vec(0.0), 1.0);
        assert!(exp_vec(f32::NAN).is_nan());
        assert!(exp_vec(1000.0).is_finite() && exp_vec(-1000.0) > 0.0);
    }

    #[test]
    fn silu_values() {
        assert_eq!(silu(0.0), 0.0);
        assert!((silu(1.0) - 0.731_058_6).abs() < 1e-6);
        assert!((silu(-1.0) + 0.268_941_4).abs() < 1e-6);
    }
}
