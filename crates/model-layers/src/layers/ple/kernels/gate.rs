//! The gate of docs/SPEC.md §5 (Layer math): per token and stream, the
//! grouped-RMS-normed highway slice against the normed key slice decides how much of the value
//! passes; the gated values are then normed again for the conv.
//!
//! [`gate`] is the Qwen4Exp form (`(1 + w)` norms, one eps); [`gate_norms`]
//! takes the form and an eps per norm ([`GateNorms`], Engram) and may skip
//! the conv norm. Both run the same row code, so [`gate`] equals
//! [`gate_norms`] with [`GateNorms::qwen4exp`] bit for bit.
//!
//! The zero-dot rule is part of [`GateNorms`]: `copysign` selects
//! DeepSeek-V4.1's `sigmoid(copysign(sqrt(max(|g|, 1e-6)), g))` in place of
//! `sign(0) = 0`.
//!
//! Invariants: each output row depends only on its own input row and the
//! weights; the sums use the fixed lane order of `math`, so a row's result is
//! the same whatever `T`, the thread split or the CPU path. Rows run in
//! parallel; streams of a row run in order.

use rayon::prelude::*;

use super::cpu::CpuPath;
use super::error::KernelError;
use super::math::{gate_sigma, gate_sigma_copysign, normed_dot_off, rms_factor};

/// Rows per rayon task (a row is `hc * H` values, tens of KiB at most).
const ROWS_PER_TASK: usize = 4;

/// Shapes and the epsilon of one gate call.
#[derive(Clone, Copy, Debug)]
pub struct GateDims {
    /// Token rows.
    pub t: usize,
    /// Hidden size H (one stream's width).
    pub h: usize,
    /// Streams (hc_mult).
    pub hc: usize,
    /// RMS-norm epsilon.
    pub eps: f32,
}

/// The norms of [`gate_norms`]: their form and epsilons, and whether the
/// conv-input norm (`xn`) is computed at all.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct GateNorms {
    /// Added to every norm weight: 1 for `(1 + w)`, 0 for `w`.
    pub offset: f32,
    /// Epsilon of the query (highway) norm.
    pub eps_q: f32,
    /// Epsilon of the key norm.
    pub eps_k: f32,
    /// Epsilon of the conv-input norm.
    pub eps_conv: f32,
    /// Whether `xn` is written; without it `norm_conv` and `xn` are empty.
    pub conv: bool,
    /// The sign of the signed square root is `copysign` (DeepSeek-V4.1), not
    /// `sign` with `sign(0) = 0`.
    pub copysign: bool,
}

impl GateNorms {
    /// The Qwen4Exp norms: `(1 + w)`, `eps` everywhere, with `xn`.
    pub fn qwen4exp(eps: f32) -> Self {
        GateNorms {
            offset: 1.0,
            eps_q: eps,
            eps_k: eps,
            eps_conv: eps,
            conv: true,
            copysign: false,
        }
    }

    /// Decode the `form` kernel argument's norm form (bit 0; 0: `1 + w`,
    /// 1: `w`). `None` when a bit other than the two known ones is set.
    pub fn offset_of_form(form: u32) -> Option<f32> {
        if form & !3 != 0 {
            return None;
        }
        Some(if form & 1 == 0 { 1.0 } else { 0.0 })
    }

    /// Decode the `form` kernel argument's zero-dot rule (bit 1: copysign).
    pub fn copysign_of_form(form: u32) -> bool {
        form & 2 != 0
    }
}

/// The gate's inputs.
#[derive(Clone, Copy, Debug)]
pub struct GateInputs<'a> {
    /// `[T, C]` highway.
    pub highway: &'a [f32],
    /// `[T, C + H]`: key then value per row.
    pub kv: &'a [f32],
    /// `[C]` query norm weight.
    pub norm_q: &'a [f32],
    /// `[C]` key norm weight.
    pub norm_k: &'a [f32],
    /// `[C]` conv-input norm weight.
    pub norm_conv: &'a [f32],
}

/// Run the gate on the best path: `gated [T, C]` and `xn [T, C]`.
pub fn gate(
    d: GateDims,
    inp: GateInputs<'_>,
    gated: &mut [f32],
    xn: &mut [f32],
) -> Result<(), KernelError> {
    gate_on(super::cpu::best_path(), d, inp, gated, xn)
}

/// [`gate`] on a chosen path.
pub fn gate_on(
    path: CpuPath,
    d: GateDims,
    inp: GateInputs<'_>,
    gated: &mut [f32],
    xn: &mut [f32],
) -> Result<(), KernelError> {
    run("gate", path, d, GateNorms::qwen4exp(d.eps), inp, gated, xn)
}

/// The gate with the norms of `norms` on the best path: `gated [T, C]`,
/// and `xn [T, C]` when `norms.conv` (else `norm_conv` and `xn` are
/// empty). `d.eps` is not read: each norm has its own.
pub fn gate_norms(
    d: GateDims,
    norms: GateNorms,
    inp: GateInputs<'_>,
    gated: &mut [f32],
    xn: &mut [f32],
) -> Result<(), KernelError> {
    gate_norms_on(super::cpu::best_path(), d, norms, inp, gated, xn)
}

/// [`gate_norms`] on a chosen path.
pub fn gate_norms_on(
    path: CpuPath,
    d: GateDims,
    norms: GateNorms,
    inp: GateInputs<'_>,
    gated: &mut [f32],
    xn: &mut [f32],
) -> Result<(), KernelError> {
    run("gate_norms", path, d, norms, inp, gated, xn)
}

fn run(
    name: &'static str,
    path: CpuPath,
    d: GateDims,
    norms: GateNorms,
    inp: GateInputs<'_>,
    gated: &mut [f32],
    xn: &mut [f32],
) -> Result<(), KernelError> {
    KernelError::check_path(name, path)?;
    if d.h == 0 || d.hc == 0 {
        return Err(KernelError::ZeroSize {
            kernel: name,
            sizes: format!("H = {}, hc = {}", d.h, d.hc),
        });
    }
    for eps in [norms.eps_q, norms.eps_k, norms.eps_conv] {
        if !(eps.is_finite() && eps >= 0.0) {
            return Err(KernelError::Eps { kernel: name, eps });
        }
    }
    let c = d.h * d.hc;
    let check = |what: &str, len: usize, want: usize| {
        KernelError::check_len(
            name,
            || what.to_string(),
            len,
            want,
            || format!("T = {}, H = {}, hc = {}", d.t, d.h, d.hc),
        )
    };
    let (conv_c, conv_tc) = if norms.conv { (c, d.t * c) } else { (0, 0) };
    check("highway", inp.highway.len(), d.t * c)?;
    check("kv", inp.kv.len(), d.t * (c + d.h))?;
    check("norm_q", inp.norm_q.len(), c)?;
    check("norm_k", inp.norm_k.len(), c)?;
    check("norm_conv", inp.norm_conv.len(), conv_c)?;
    check("gated", gated.len(), d.t * c)?;
    check("xn", xn.len(), conv_tc)?;
    if d.t == 0 {
        return Ok(());
    }
    let rows = |task: usize, g: &mut [f32], mut x: Option<&mut [f32]>| {
        let t0 = task * ROWS_PER_TASK;
        for (r, gr) in g.chunks_exact_mut(c).enumerate() {
            let t = t0 + r;
            let hw = &inp.highway[t * c..(t + 1) * c];
            let kv = &inp.kv[t * (c + d.h)..(t + 1) * (c + d.h)];
            let xr = match x.as_deref_mut() {
                Some(x) => &mut x[r * c..(r + 1) * c],
                None => &mut [][..],
            };
            match path {
                CpuPath::Portable => gate_row(d, norms, inp, hw, kv, gr, xr),
                #[cfg(target_arch = "x86_64")]
                // SAFETY: `run` checked that the CPU has AVX2 and FMA.
                CpuPath::Avx2Fma | CpuPath::Avx512Bf16 | CpuPath::Amx => unsafe {
                    gate_row_avx2(d, norms, inp, hw, kv, gr, xr)
                },
                #[cfg(not(target_arch = "x86_64"))]
                CpuPath::Avx2Fma | CpuPath::Avx512Bf16 | CpuPath::Amx => {
                    unreachable!("AVX2 is never available off x86-64")
                }
            }
        }
    };
    if norms.conv {
        gated
            .par_chunks_mut(c * ROWS_PER_TASK)
            .zip(xn.par_chunks_mut(c * ROWS_PER_TASK))
            .enumerate()
            .for_each(|(task, (g, x))| rows(task, g, Some(x)));
    } else {
        gated
            .par_chunks_mut(c * ROWS_PER_TASK)
            .enumerate()
            .for_each(|(task, g)| rows(task, g, None));
    }
    Ok(())
}

/// [`gate_row`] compiled for AVX2 (same operations, wider registers).
///
/// # Safety
/// The CPU must support AVX2 and FMA.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn gate_row_avx2(
    d: GateDims,
    norms: GateNorms,
    inp: GateInputs<'_>,
    hw: &[f32],
    kv: &[f32],
    gated: &mut [f32],
    xn: &mut [f32],
) {
    gate_row(d, norms, inp, hw, kv, gated, xn)
}

/// One token row, all streams.
#[inline(always)]
fn gate_row(
    d: GateDims,
    norms: GateNorms,
    inp: GateInputs<'_>,
    hw: &[f32],
    kv: &[f32],
    gated: &mut [f32],
    xn: &mut [f32],
) {
    let h = d.h;
    let c = h * d.hc;
    let off = norms.offset;
    let value = &kv[c..c + h];
    let inv_sqrt_h = 1.0 / (h as f32).sqrt();
    for s in 0..d.hc {
        let r = s * h..(s + 1) * h;
        let q = &hw[r.clone()];
        let k = &kv[r.clone()];
        let rq = rms_factor(q, norms.eps_q);
        let rk = rms_factor(k, norms.eps_k);
        let g = normed_dot_off(
            q,
            rq,
            &inp.norm_q[r.clone()],
            k,
            rk,
            &inp.norm_k[r.clone()],
            off,
        ) * inv_sqrt_h;
        let sigma = if norms.copysign {
            gate_sigma_copysign(g)
        } else {
            gate_sigma(g)
        };
        let gs = &mut gated[r.clone()];
        for (o, &v) in gs.iter_mut().zip(value) {
            *o = sigma * v;
        }
        if !norms.conv {
            continue;
        }
        let rc = rms_factor(gs, norms.eps_conv);
        for ((o, &v), &w) in xn[r.clone()]
            .iter_mut()
            .zip(gs.iter())
            .zip(&inp.norm_conv[r])
        {
            *o = v * rc * (off + w);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn vals(n: usize, seed: u32) -> Vec<f32> {
        (0..n)
            .map(|i| ((i as u32).wrapping_mul(2_654_435_761) ^ seed) % 1000)
            .map(|v| v as f32 / 250.0 - 2.0)
            .collect()
    }

    /// SPEC section 4 written out plainly in f64 for one row.
    #[allow(clippy::too_many_arguments)]
    fn reference(
        h: usize,
        hc: usize,
        eps: f64,
        hw: &[f32],
        kv: &[f32],
        nq: &[f32],
        nk: &[f32],
        nc: &[f32],
    ) -> (Vec<f64>, Vec<f64>) {
        let c = h * hc;
        let norm = |x: &[f64], w: &[f32]| -> Vec<f64> {
            let ms = x.iter().map(|v| v * v).sum::<f64>() / x.len() as f64;
            let r = 1.0 / (ms + eps).sqrt();
            x.iter()
                .zip(w)
                .map(|(v, w)| v * r * (1.0 + *w as f64))
                .collect()
        };
        let mut gated = vec![0.0; c];
        let mut xn = vec![0.0; c];
        for s in 0..hc {
            let q: Vec<f64> = hw[s * h..(s + 1) * h].iter().map(|&v| v as f64).collect();
            let k: Vec<f64> = kv[s * h..(s + 1) * h].iter().map(|&v| v as f64).collect();
            let nq = norm(&q, &nq[s * h..(s + 1) * h]);
            let nk = norm(&k, &nk[s * h..(s + 1) * h]);
            let g = nq.iter().zip(&nk).map(|(a, b)| a * b).sum::<f64>() / (h as f64).sqrt();
            let sign = if g > 0.0 {
                1.0
            } else if g < 0.0 {
                -1.0
            } else {
                0.0
            };
            let z = sign * g.abs().max(1e-6).sqrt();
            let sigma = 1.0 / (1.0 + (-z).exp());
            for dd in 0..h {
                gated[s * h + dd] = sigma * kv[c + dd] as f64;
            }
            let n = norm(&gated[s * h..(s + 1) * h], &nc[s * h..(s + 1) * h]);
            xn[s * h..(s + 1) * h].copy_from_slice(&n);
        }
        (gated, xn)
    }

    #[test]
    fn matches_the_formula_and_is_row_independent() {
        let (t, h, hc, eps) = (5, 24, 3, 1e-6f32);
        let c = h * hc;
        let hw = vals(t * c, 1);
        let kv = vals(t * (c + h), 2);
        let nq: Vec<f32> = vals(c, 3).iter().map(|v| v * 0.1).collect();
        let nk: Vec<f32> = vals(c, 4).iter().map(|v| v * 0.1).collect();
        let nc: Vec<f32> = vals(c, 5).iter().map(|v| v * 0.1).collect();
        let inp = GateInputs {
            highway: &hw,
            kv: &kv,
            norm_q: &nq,
            norm_k: &nk,
            norm_conv: &nc,
        };
        let d = GateDims { t, h, hc, eps };
        let mut runs = Vec::new();
        for path in CpuPath::all_available() {
            let (mut g, mut x) = (vec![0.0; t * c], vec![0.0; t * c]);
            gate_on(path, d, inp, &mut g, &mut x).unwrap();
            runs.push((g, x));
        }
        let (g, x) = &runs[0];
        for (gi, xi) in &runs[1..] {
            assert!(gi.iter().zip(g).all(|(a, b)| a.to_bits() == b.to_bits()));
            assert!(xi.iter().zip(x).all(|(a, b)| a.to_bits() == b.to_bits()));
        }
        for row in 0..t {
            let (rg, rx) = reference(
                h,
                hc,
                eps as f64,
                &hw[row * c..(row + 1) * c],
                &kv[row * (c + h)..(row + 1) * (c + h)],
                &nq,
                &nk,
                &nc,
            );
            for i in 0..c {
                assert!(
                    (g[row * c + i] as f64 - rg[i]).abs() < 1e-5,
                    "gated row {row} col {i}"
                );
                assert!(
                    (x[row * c + i] as f64 - rx[i]).abs() < 1e-4 * (1.0 + rx[i].abs()),
                    "xn row {row} col {i}"
                );
            }
            // The same row alone gives the same bits.
            let one = GateInputs {
                highway: &hw[row * c..(row + 1) * c],
                kv: &kv[row * (c + h)..(row + 1) * (c + h)],
                ..inp
            };
            let (mut g1, mut x1) = (vec![0.0; c], vec![0.0; c]);
            gate(GateDims { t: 1, ..d }, one, &mut g1, &mut x1).unwrap();
            assert!(
                g1.iter()
                    .zip(&g[row * c..])
                    .all(|(a, b)| a.to_bits() == b.to_bits())
            );
            assert!(
                x1.iter()
                    .zip(&x[row * c..])
                    .all(|(a, b)| a.to_bits() == b.to_bits())
            );
        }
    }

    #[test]
    fn zero_highway_gives_half_gate() {
        // q = 0 makes norm(q) = 0, g = 0, sign(0) = 0, sigma = 0.5 exactly.
        let (h, hc) = (8, 2);
        let c = h * hc;
        let hw = vec![0.0; c];
        let mut kv = vals(c + h, 9);
        kv[c..]
            .iter_mut()
            .enumerate()
            .for_each(|(i, v)| *v = i as f32);
        let z = vec![0.0; c];
        let inp = GateInputs {
            highway: &hw,
            kv: &kv,
            norm_q: &z,
            norm_k: &z,
            norm_conv: &z,
        };
        let (mut g, mut x) = (vec![0.0; c], vec![0.0; c]);
        gate(
            GateDims {
                t: 1,
                h,
                hc,
                eps: 1e-6,
            },
            inp,
            &mut g,
            &mut x,
        )
        .unwrap();
        for s in 0..hc {
            for dd in 0..h {
                assert_eq!(g[s * h + dd], 0.5 * dd as f32);
            }
        }
    }

    #[test]
    fn bad_shapes_are_errors() {
        let z = vec![0.0; 16];
        let inp = GateInputs {
            highway: &z[..8],
            kv: &z,
            norm_q: &z[..8],
            norm_k: &z[..8],
            norm_conv: &z[..8],
        };
        let (mut g, mut x) = (vec![0.0; 8], vec![0.0; 8]);
        let e = gate(
            GateDims {
                t: 1,
                h: 4,
                hc: 2,
                eps: 1e-6,
            },
            inp,
            &mut g,
            &mut x,
        )
        .unwrap_err();
        assert!(
            e.to_string().contains("kv holds 16 values, expected 12"),
            "{e}"
        );
        assert!(
            gate(
                GateDims {
                    t: 1,
                    h: 0,
                    hc: 2,
                    eps: 1e-6
                },
                inp,
                &mut g,
                &mut x
            )
            .is_err()
        );
        assert!(
            gate(
                GateDims {
                    t: 1,
                    h: 4,
                    hc: 2,
                    eps: f32::NAN
                },
                inp,
                &mut g,
                &mut x
            )
            .is_err()
        );
    }
}
