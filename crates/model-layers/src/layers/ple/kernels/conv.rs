//! The dilated causal depthwise conv with its carried state, the residual
//! `out = gated + silu(y)` and the highway add of docs/SPEC.md §5 (Layer
//! math).
//!
//! For one sequence, with `x = state ++ xn` (`S = (K-1)*D` state rows first):
//! `y[t, c] = sum_{j<K} w[c, j] * x[S + t - (K-1-j)*D, c]`, summed in `j`
//! order as `y = 0; y += w * x`; then `highway[t, c] += gated[t, c] +
//! silu(y)` and the state becomes the last `S` rows of `x`.
//!
//! Invariants: every element uses the same operations in the same order
//! whatever `T`, so a prefill in any chunking, token-by-token decode and the
//! batched form give identical bits; all outputs are computed from the old
//! state before the state moves; shapes are checked before anything is
//! written, so a failed call changes nothing.

use rayon::prelude::*;

use super::cpu::CpuPath;
use super::error::KernelError;
use super::math::silu;

/// Shapes of one conv call.
#[derive(Clone, Copy, Debug)]
pub struct ConvDims {
    /// Token rows (per sequence for [`conv`], sequences for [`conv_batch`]).
    pub t: usize,
    /// Channels C.
    pub c: usize,
    /// Kernel size K.
    pub k: usize,
    /// Dilation D.
    pub d: usize,
}

impl ConvDims {
    /// `S = (K-1)*D`: state rows per sequence.
    pub fn state_len(&self) -> usize {
        (self.k - 1) * self.d
    }

    fn check(&self, kernel: &'static str) -> Result<(), KernelError> {
        if self.c > 0 && self.k > 0 && self.d > 0 {
            return Ok(());
        }
        Err(KernelError::ZeroSize {
            kernel,
            sizes: format!("C = {}, K = {}, D = {}", self.c, self.k, self.d),
        })
    }

    fn shape(&self) -> String {
        format!(
            "T = {}, C = {}, K = {}, D = {}",
            self.t, self.c, self.k, self.d
        )
    }
}

/// Refuse `what` unless it holds `want` values.
fn check_len(
    kernel: &'static str,
    dims: &ConvDims,
    what: &str,
    len: usize,
    want: usize,
) -> Result<(), KernelError> {
    KernelError::check_len(kernel, || what.to_string(), len, want, || dims.shape())
}

/// The checks [`conv_on`] and [`conv_batch_on`] share: the path, the sizes,
/// and every slice but the states (`dims.t` rows of `C` values each).
fn check_rows(
    kernel: &'static str,
    path: CpuPath,
    dims: &ConvDims,
    xn: &[f32],
    gated: &[f32],
    w: &[f32],
    highway: &[f32],
) -> Result<(), KernelError> {
    KernelError::check_path(kernel, path)?;
    dims.check(kernel)?;
    let ConvDims { t, c, k, .. } = *dims;
    check_len(kernel, dims, "xn", xn.len(), t * c)?;
    check_len(kernel, dims, "gated", gated.len(), t * c)?;
    check_len(kernel, dims, "w", w.len(), c * k)?;
    check_len(kernel, dims, "highway", highway.len(), t * c)
}

/// `w [C, K]` as `[K, C]`, so each tap is a contiguous channel vector.
fn transpose(w: &[f32], c: usize, k: usize) -> Vec<f32> {
    let mut wt = vec![0.0f32; c * k];
    for ci in 0..c {
        for j in 0..k {
            wt[j * c + ci] = w[ci * k + j];
        }
    }
    wt
}

/// One sequence, `T` new rows, on the best path.
pub fn conv(
    dims: ConvDims,
    xn: &[f32],
    gated: &[f32],
    state: &mut [f32],
    w: &[f32],
    highway: &mut [f32],
) -> Result<(), KernelError> {
    conv_on(super::cpu::best_path(), dims, xn, gated, state, w, highway)
}

/// [`conv`] on a chosen path.
pub fn conv_on(
    path: CpuPath,
    dims: ConvDims,
    xn: &[f32],
    gated: &[f32],
    state: &mut [f32],
    w: &[f32],
    highway: &mut [f32],
) -> Result<(), KernelError> {
    const NAME: &str = "conv";
    check_rows(NAME, path, &dims, xn, gated, w, highway)?;
    let ConvDims { t, c, k, .. } = dims;
    let s = dims.state_len();
    check_len(NAME, &dims, "state", state.len(), s * c)?;
    if t == 0 {
        return Ok(());
    }
    let wt = transpose(w, c, k);
    let old: &[f32] = state;
    highway
        .par_chunks_mut(c)
        .enumerate()
        .with_min_len(2)
        .for_each(|(ti, hw)| {
            let mut y = vec![0.0f32; c];
            run_row(
                path,
                dims,
                ti,
                xn,
                old,
                &wt,
                &gated[ti * c..(ti + 1) * c],
                hw,
                &mut y,
            );
        });
    advance_state(state, xn, s, t, c);
    Ok(())
}

/// `B` sequences, one new row each, each with its own state: row `b` is
/// exactly [`conv`] with `T = 1` on `states[b]`.
pub fn conv_batch(
    dims: ConvDims,
    xn: &[f32],
    gated: &[f32],
    states: &mut [&mut [f32]],
    w: &[f32],
    highway: &mut [f32],
) -> Result<(), KernelError> {
    conv_batch_on(super::cpu::best_path(), dims, xn, gated, states, w, highway)
}

/// [`conv_batch`] on a chosen path.
pub fn conv_batch_on(
    path: CpuPath,
    dims: ConvDims,
    xn: &[f32],
    gated: &[f32],
    states: &mut [&mut [f32]],
    w: &[f32],
    highway: &mut [f32],
) -> Result<(), KernelError> {
    const NAME: &str = "conv_batch";
    check_rows(NAME, path, &dims, xn, gated, w, highway)?;
    let ConvDims { t: b, c, k, .. } = dims;
    let s = dims.state_len();
    check_len(NAME, &dims, "states", states.len(), b)?;
    for (i, st) in states.iter().enumerate() {
        check_len(NAME, &dims, &format!("state {i}"), st.len(), s * c)?;
    }
    if b == 0 {
        return Ok(());
    }
    let wt = transpose(w, c, k);
    let one = ConvDims { t: 1, ..dims };
    highway
        .par_chunks_mut(c)
        .zip(states.par_iter_mut())
        .enumerate()
        .for_each(|(bi, (hw, st))| {
            let x = &xn[bi * c..(bi + 1) * c];
            let mut y = vec![0.0f32; c];
            run_row(
                path,
                one,
                0,
                x,
                st,
                &wt,
                &gated[bi * c..(bi + 1) * c],
                hw,
                &mut y,
            );
            advance_state(st, x, s, 1, c);
        });
    Ok(())
}

/// The state after `t` new rows: the last `s` rows of `state ++ xn`.
fn advance_state(state: &mut [f32], xn: &[f32], s: usize, t: usize, c: usize) {
    if s == 0 {
        return;
    }
    if t >= s {
        state.copy_from_slice(&xn[(t - s) * c..t * c]);
    } else {
        state.copy_within(t * c.., 0);
        state[(s - t) * c..].copy_from_slice(&xn[..t * c]);
    }
}

#[allow(clippy::too_many_arguments)]
fn run_row(
    path: CpuPath,
    dims: ConvDims,
    ti: usize,
    xn: &[f32],
    state: &[f32],
    wt: &[f32],
    gated: &[f32],
    hw: &mut [f32],
    y: &mut [f32],
) {
    match path {
        CpuPath::Portable => conv_row(dims, ti, xn, state, wt, gated, hw, y),
        #[cfg(target_arch = "x86_64")]
        // SAFETY: the caller checked that the CPU has AVX2 and FMA.
        CpuPath::Avx2Fma | CpuPath::Avx512Bf16 | CpuPath::Amx => unsafe {
            conv_row_avx2(dims, ti, xn, state, wt, gated, hw, y)
        },
        #[cfg(not(target_arch = "x86_64"))]
        CpuPath::Avx2Fma | CpuPath::Avx512Bf16 | CpuPath::Amx => {
            unreachable!("AVX2 is never available off x86-64")
        }
    }
}

/// [`conv_row`] compiled for AVX2 (same operations, wider registers).
///
/// # Safety
/// The CPU must support AVX2 and FMA.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
#[allow(clippy::too_many_arguments)]
unsafe fn conv_row_avx2(
    dims: ConvDims,
    ti: usize,
    xn: &[f32],
    state: &[f32],
    wt: &[f32],
    gated: &[f32],
    hw: &mut [f32],
    y: &mut [f32],
) {
    conv_row(dims, ti, xn, state, wt, gated, hw, y)
}

/// Row `ti` of one sequence: `y` is scratch of `C` values.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn conv_row(
    dims: ConvDims,
    ti: usize,
    xn: &[f32],
    state: &[f32],
    wt: &[f32],
    gated: &[f32],
    hw: &mut [f32],
    y: &mut [f32],
) {
    let ConvDims { c, k, d, .. } = dims;
    let s = dims.state_len();
    y.fill(0.0);
    for j in 0..k {
        // Row of `state ++ xn` this tap reads; never negative since the
        // lag (K-1-j)*D is at most S.
        let r = s + ti - (k - 1 - j) * d;
        let src = if r < s {
            &state[r * c..(r + 1) * c]
        } else {
            &xn[(r - s) * c..(r - s + 1) * c]
        };
        for ((yv, &wv), &xv) in y.iter_mut().zip(&wt[j * c..(j + 1) * c]).zip(src) {
            *yv += wv * xv;
        }
    }
    for ((h, &g), &yv) in hw.iter_mut().zip(gated).zip(y.iter()) {
        *h += g + silu(yv);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn vals(n: usize, seed: u32) -> Vec<f32> {
        (0..n)
            .map(|i| ((i as u32).wrapping_mul(2_654_435_761) ^ seed) % 1000)
            .map(|v| v as f32 / 500.0 - 1.0)
            .collect()
    }

    /// The formula over the whole sequence at once, in f64.
    fn reference(
        c: usize,
        k: usize,
        d: usize,
        xs: &[f32],
        gs: &[f32],
        w: &[f32],
        hw0: &[f32],
    ) -> Vec<f64> {
        let t = xs.len() / c;
        let mut out = vec![0.0f64; t * c];
        for ti in 0..t {
            for ci in 0..c {
                let mut y = 0.0f64;
                for j in 0..k {
                    let lag = (k - 1 - j) * d;
                    if ti >= lag {
                        y += w[ci * k + j] as f64 * xs[(ti - lag) * c + ci] as f64;
                    }
                }
                let silu = y / (1.0 + (-y).exp());
                out[ti * c + ci] = hw0[ti * c + ci] as f64 + gs[ti * c + ci] as f64 + silu;
            }
        }
        out
    }

    fn bits(v: &[f32]) -> Vec<u32> {
        v.iter().map(|x| x.to_bits()).collect()
    }

    #[test]
    fn chunked_matches_formula_and_is_chunking_invariant() {
        let (c, k, d, t) = (37, 4, 3, 23);
        let s = (k - 1) * d;
        let xs = vals(t * c, 1);
        let gs = vals(t * c, 2);
        let w = vals(c * k, 3);
        let hw0 = vals(t * c, 4);
        let want = reference(c, k, d, &xs, &gs, &w, &hw0);
        let mut results = Vec::new();
        for path in CpuPath::all_available() {
            for chunks in [
                vec![23],
                vec![1; 23],
                vec![5, 1, 9, 2, 6],
                vec![9, 9, 5],
                vec![2, 10, 11],
            ] {
                let mut state = vec![0.0f32; s * c];
                let mut hw = hw0.clone();
                let mut t0 = 0;
                for n in chunks {
                    let r = t0 * c..(t0 + n) * c;
                    conv_on(
                        path,
                        ConvDims { t: n, c, k, d },
                        &xs[r.clone()],
                        &gs[r.clone()],
                        &mut state,
                        &w,
                        &mut hw[r],
                    )
                    .unwrap();
                    t0 += n;
                }
                // The state is the last S rows of xn.
                assert_eq!(bits(&state), bits(&xs[(t - s) * c..]));
                results.push(hw);
            }
        }
        for r in &results[1..] {
            assert_eq!(bits(r), bits(&results[0]));
        }
        for (a, b) in results[0].iter().zip(&want) {
            assert!((*a as f64 - b).abs() < 1e-5 * (1.0 + b.abs()), "{a} vs {b}");
        }
    }

    #[test]
    fn batch_row_equals_single_row_call() {
        let (c, k, d, b) = (21, 4, 3, 5);
        let s = (k - 1) * d;
        let xn = vals(b * c, 7);
        let gated = vals(b * c, 8);
        let w = vals(c * k, 9);
        let hw0 = vals(b * c, 10);
        let mut states: Vec<Vec<f32>> = (0..b).map(|i| vals(s * c, 20 + i as u32)).collect();
        let mut singles = Vec::new();
        for (bi, st0) in states.iter().enumerate() {
            let mut st = st0.clone();
            let mut hw = hw0[bi * c..(bi + 1) * c].to_vec();
            let r = bi * c..(bi + 1) * c;
            conv(
                ConvDims { t: 1, c, k, d },
                &xn[r.clone()],
                &gated[r],
                &mut st,
                &w,
                &mut hw,
            )
            .unwrap();
            singles.push((st, hw));
        }
        for path in CpuPath::all_available() {
            let mut sts: Vec<Vec<f32>> = states.clone();
            let mut refs: Vec<&mut [f32]> = sts.iter_mut().map(|v| v.as_mut_slice()).collect();
            let mut hw = hw0.clone();
            conv_batch_on(
                path,
                ConvDims { t: b, c, k, d },
                &xn,
                &gated,
                &mut refs,
                &w,
                &mut hw,
            )
            .unwrap();
            for bi in 0..b {
                assert_eq!(bits(&sts[bi]), bits(&singles[bi].0));
                assert_eq!(bits(&hw[bi * c..(bi + 1) * c]), bits(&singles[bi].1));
            }
        }
        states.clear();
    }

    #[test]
    fn kernel_one_has_no_state_and_bad_shapes_fail_without_writes() {
        let c = 3;
        let mut hw = vec![1.0f32; c];
        conv(
            ConvDims {
                t: 1,
                c,
                k: 1,
                d: 2,
            },
            &[0.0; 3],
            &[0.5; 3],
            &mut [],
            &[1.0; 3],
            &mut hw,
        )
        .unwrap();
        assert_eq!(hw, [1.5; 3]);
        let mut state = vec![7.0f32; 3 * c];
        let e = conv(
            ConvDims {
                t: 1,
                c,
                k: 4,
                d: 1,
            },
            &[0.0; 3],
            &[0.5; 3],
            &mut state,
            &[1.0; 11],
            &mut hw,
        )
        .unwrap_err();
        assert!(
            e.to_string().contains("w holds 11 values, expected 12"),
            "{e}"
        );
        assert_eq!(state, vec![7.0; 9]);
        assert_eq!(hw, [1.5; 3]);
        assert!(
            conv(
                ConvDims {
                    t: 1,
                    c,
                    k: 0,
                    d: 1
                },
                &[0.0; 3],
                &[0.5; 3],
                &mut [],
                &[],
                &mut hw
            )
            .is_err()
        );
        let mut st1 = vec![0.0f32; 2];
        let mut sts: Vec<&mut [f32]> = vec![st1.as_mut_slice()];
        let e = conv_batch(
            ConvDims {
                t: 1,
                c,
                k: 2,
                d: 1,
            },
            &[0.0; 3],
            &[0.0; 3],
            &mut sts,
            &[0.0; 6],
            &mut hw,
        )
        .unwrap_err();
        assert!(e.to_string().contains("state 0 holds 2 values"), "{e}");
    }
}
