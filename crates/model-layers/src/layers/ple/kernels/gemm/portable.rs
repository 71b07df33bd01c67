//! The portable path: plain Rust, any CPU. The weight block conversion and
//! the register tile of the sequential FMA chain every other path must
//! reproduce bit for bit (the AMX path excepted, see the parent module).

use super::super::math::bf16_to_f32;
use super::{NR, half_index};

/// A packed weight block (`dst.len() / NR` steps) as f32, `[kc, NR]`.
pub(super) fn convert(src: &[u16], dst: &mut [f32]) {
    for (k, row) in dst.chunks_exact_mut(NR).enumerate() {
        for (j, d) in row.iter_mut().enumerate() {
            *d = bf16_to_f32(src[half_index(j, k)]);
        }
    }
}

/// The register tile on the portable path: `acc [M, NR] += x [M, kc] @ b
/// [kc, NR]`, one `mul_add` per element and step, `k` ascending.
pub(super) fn micro<const M: usize>(x: &[f32], xs: usize, b: &[f32], kc: usize, acc: &mut [f32]) {
    let mut c = [[0.0f32; NR]; M];
    for (i, ci) in c.iter_mut().enumerate() {
        ci.copy_from_slice(&acc[i * NR..(i + 1) * NR]);
    }
    for k in 0..kc {
        let bk = &b[k * NR..(k + 1) * NR];
        for (i, ci) in c.iter_mut().enumerate() {
            let a = x[i * xs + k];
            for (cj, &bj) in ci.iter_mut().zip(bk) {
                *cj = a.mul_add(bj, *cj);
            }
        }
    }
    for (i, ci) in c.iter().enumerate() {
        acc[i * NR..(i + 1) * NR].copy_from_slice(ci);
    }
}
