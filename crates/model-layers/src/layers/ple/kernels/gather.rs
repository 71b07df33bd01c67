//! Row gather: table rows (BF16, FP8 E4M3 with a per-row f32 scale, or FP8
//! E4M3 with an inline UE8M0 scale per 32 values) into f32 `emb` rows.
//!
//! Invariant: every value written is BF16-representable. BF16 rows convert
//! exactly; FP8 rows are decoded, scaled in f32 and rounded to BF16 (ties to
//! even), so the projection always sees BF16 inputs whatever the table type
//! (a block scale is a power of two, so its product is already BF16 unless
//! it underflows). Each output row depends on its source row alone.

use rayon::prelude::*;

use metrale_storage::dtype::{FP8_BLOCK, fp8_block_row_bytes, fp8_e4m3_to_f32, ue8m0_to_f32};
use metrale_storage::table::RowDType;

use super::error::KernelError;
use super::math::{bf16_round, bf16_to_f32};

/// Rows per rayon task: a row is a few hundred bytes, so tasks take many.
const ROWS_PER_TASK: usize = 64;

/// The element type of gathered rows, as the `gather` kernel's `dtype`
/// argument encodes it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GatherDType {
    /// `0`: BF16, two little-endian bytes per value.
    Bf16,
    /// `1`: FP8 E4M3, one byte per value, times the row's f32 scale.
    Fp8E4M3,
    /// `2`: FP8 E4M3, one byte per value, then one UE8M0 scale byte per 32
    /// values in the row itself (`head_dim` a multiple of 32).
    Fp8E4M3Block32,
    /// `3`: F32, four little-endian bytes per value, taken as stored.
    F32,
}

impl GatherDType {
    /// Decode the kernel argument; errors name the bad value.
    pub fn from_arg(v: u32) -> Result<Self, metrale_gpu_runtime::GpuError> {
        match v {
            0 => Ok(GatherDType::Bf16),
            1 => Ok(GatherDType::Fp8E4M3),
            2 => Ok(GatherDType::Fp8E4M3Block32),
            3 => Ok(GatherDType::F32),
            _ => Err(metrale_gpu_runtime::GpuError::kernel(format!(
                "gather: dtype {v} is not 0 (BF16), 1 (FP8 E4M3), 2 (FP8 E4M3, 32-value blocks) \
                 or 3 (F32)"
            ))),
        }
    }

    /// The kernel argument of this type.
    pub fn arg(self) -> u32 {
        match self {
            GatherDType::Bf16 => 0,
            GatherDType::Fp8E4M3 => 1,
            GatherDType::Fp8E4M3Block32 => 2,
            GatherDType::F32 => 3,
        }
    }

    /// The gather type of a table's rows.
    pub fn of(dtype: RowDType) -> Self {
        match dtype {
            RowDType::Bf16 => GatherDType::Bf16,
            RowDType::Fp8E4M3 => GatherDType::Fp8E4M3,
            RowDType::Fp8E4M3Block32 => GatherDType::Fp8E4M3Block32,
            RowDType::F32 => GatherDType::F32,
        }
    }

    /// Whether each row has an f32 scale apart from its bytes.
    pub fn has_row_scale(self) -> bool {
        self == GatherDType::Fp8E4M3
    }

    /// Bytes per value.
    pub fn elem_bytes(self) -> usize {
        match self {
            GatherDType::F32 => 4,
            GatherDType::Bf16 => 2,
            GatherDType::Fp8E4M3 | GatherDType::Fp8E4M3Block32 => 1,
        }
    }

    /// Bytes of one row of `head_dim` values (with its inline scales).
    pub fn row_bytes(self, head_dim: usize) -> usize {
        match self {
            GatherDType::Fp8E4M3Block32 => fp8_block_row_bytes(head_dim),
            _ => head_dim * self.elem_bytes(),
        }
    }
}

/// One source row: its bytes and its scale (ignored for BF16).
#[derive(Clone, Copy, Debug)]
pub struct RowSrc<'a> {
    /// `head_dim * elem_bytes` bytes.
    pub data: &'a [u8],
    /// The FP8 scale.
    pub scale: f32,
}

/// One BF16 row into f32.
#[inline]
pub fn gather_bf16_row(src: &[u8], out: &mut [f32]) {
    for (o, b) in out.iter_mut().zip(src.chunks_exact(2)) {
        *o = bf16_to_f32(u16::from_le_bytes([b[0], b[1]]));
    }
}

/// One F32 row, as stored.
#[inline]
pub fn gather_f32_row(src: &[u8], out: &mut [f32]) {
    for (o, b) in out.iter_mut().zip(src.chunks_exact(4)) {
        *o = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
    }
}

/// One FP8 row into f32: `bf16_round(decode(b) * scale)`.
#[inline]
pub fn gather_fp8_row(src: &[u8], scale: f32, out: &mut [f32]) {
    for (o, &b) in out.iter_mut().zip(src) {
        *o = bf16_round(fp8_e4m3_to_f32(b) * scale);
    }
}

/// One block-scaled FP8 row (values, then a UE8M0 byte per 32 values) into
/// f32: `bf16_round(decode(b) * 2^(e - 127))`.
#[inline]
pub fn gather_fp8_block_row(src: &[u8], out: &mut [f32]) {
    let (values, scales) = src.split_at(out.len());
    for ((o, &b), i) in out.iter_mut().zip(values).zip(0..) {
        *o = bf16_round(fp8_e4m3_to_f32(b) * ue8m0_to_f32(scales[i / FP8_BLOCK]));
    }
}

/// Gather `rows` into `out` (`rows.len() * head_dim` values), in parallel.
/// Errors when a row or `out` has the wrong length.
pub fn gather_rows(
    rows: &[RowSrc<'_>],
    head_dim: usize,
    dtype: GatherDType,
    out: &mut [f32],
) -> Result<(), KernelError> {
    const NAME: &str = "gather";
    if head_dim == 0 {
        return Err(KernelError::ZeroSize {
            kernel: NAME,
            sizes: "head_dim = 0".to_string(),
        });
    }
    let want = rows
        .len()
        .checked_mul(head_dim)
        .ok_or_else(|| KernelError::Overflow {
            kernel: NAME,
            what: format!("{} rows of {head_dim}", rows.len()),
        })?;
    KernelError::check_len(
        NAME,
        || "out".to_string(),
        out.len(),
        want,
        || format!("{} rows of {head_dim}", rows.len()),
    )?;
    if dtype == GatherDType::Fp8E4M3Block32 && !head_dim.is_multiple_of(FP8_BLOCK) {
        return Err(KernelError::Layout {
            kernel: NAME,
            problem: format!(
                "head_dim = {head_dim} is not a multiple of the FP8 block {FP8_BLOCK}"
            ),
        });
    }
    let row_bytes = dtype.row_bytes(head_dim);
    if let Some(row) = rows.iter().position(|r| r.data.len() != row_bytes) {
        return Err(KernelError::RowBytes {
            kernel: NAME,
            row,
            found: rows[row].data.len(),
            expected: row_bytes,
        });
    }
    out.par_chunks_mut(head_dim * ROWS_PER_TASK)
        .zip(rows.par_chunks(ROWS_PER_TASK))
        .for_each(|(o, rs)| {
            for (orow, r) in o.chunks_exact_mut(head_dim).zip(rs) {
                match dtype {
                    GatherDType::Bf16 => gather_bf16_row(r.data, orow),
                    GatherDType::F32 => gather_f32_row(r.data, orow),
                    GatherDType::Fp8E4M3 => gather_fp8_row(r.data, r.scale, orow),
                    GatherDType::Fp8E4M3Block32 => gather_fp8_block_row(r.data, orow),
                }
            }
        });
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gathers_bf16_and_fp8_rows() {
        let a: Vec<u8> = [0x3F80u16, 0xC040, 0x0000]
            .iter()
            .flat_map(|v| v.to_le_bytes())
            .collect();
        let b: Vec<u8> = [0x4000u16, 0x3F00, 0x8000]
            .iter()
            .flat_map(|v| v.to_le_bytes())
            .collect();
        let rows = [
            RowSrc {
                data: &b,
                scale: 0.0,
            },
            RowSrc {
                data: &a,
                scale: 0.0,
            },
        ];
        let mut out = vec![9.0f32; 6];
        gather_rows(&rows, 3, GatherDType::Bf16, &mut out).unwrap();
        assert_eq!(out, [2.0, 0.5, -0.0, 1.0, -3.0, 0.0]);

        let f = [0x38u8, 0xBC, 0x01];
        let rows = [RowSrc {
            data: &f,
            scale: 3.0,
        }];
        let mut out = vec![0.0f32; 3];
        gather_rows(&rows, 3, GatherDType::Fp8E4M3, &mut out).unwrap();
        assert_eq!(out, [3.0, -4.5, bf16_round(3.0 * 2f32.powi(-9))]);

        // A scale that makes the product need rounding: 1.5 * (1 + 2^-9).
        let s = 1.0 + 2f32.powi(-9);
        let mut out = vec![0.0f32; 1];
        gather_rows(
            &[RowSrc {
                data: &[0x3C],
                scale: s,
            }],
            1,
            GatherDType::Fp8E4M3,
            &mut out,
        )
        .unwrap();
        assert_eq!(out[0], bf16_round(1.5 * s));
        assert_eq!(out[0].to_bits() & 0xFFFF, 0);
    }

    #[test]
    fn many_rows_in_parallel_match_one_by_one() {
        let n = 300;
        let hd = 5;
        let bytes: Vec<u8> = (0..n * hd * 2)
            .map(|i| (i * 37 % 251) as u8 & 0x7F)
            .collect();
        let rows: Vec<RowSrc> = (0..n)
            .map(|i| RowSrc {
                data: &bytes[i * hd * 2..(i + 1) * hd * 2],
                scale: 1.0,
            })
            .collect();
        let mut out = vec![0.0f32; n * hd];
        gather_rows(&rows, hd, GatherDType::Bf16, &mut out).unwrap();
        for (i, r) in rows.iter().enumerate() {
            let mut one = vec![0.0f32; hd];
            gather_bf16_row(r.data, &mut one);
            assert_eq!(&out[i * hd..(i + 1) * hd], &one[..]);
        }
    }

    #[test]
    fn f32_rows_are_taken_as_stored() {
        let v = [1.0f32 + f32::EPSILON, -3.25, 1e-30];
        let data: Vec<u8> = v.iter().flat_map(|x| x.to_le_bytes()).collect();
        let rows = [RowSrc {
            data: &data,
            scale: 0.0,
        }];
        let mut out = vec![0.0f32; 3];
        gather_rows(&rows, 3, GatherDType::F32, &mut out).unwrap();
        assert_eq!(out, v);
    }

    #[test]
    fn bad_shapes_are_errors() {
        let d = [0u8; 4];
        let rows = [RowSrc {
            data: &d,
            scale: 1.0,
        }];
        let mut out = vec![0.0f32; 3];
        let e = gather_rows(&rows, 3, GatherDType::Bf16, &mut out).unwrap_err();
        assert!(e.to_string().contains("row 0 has 4 bytes"), "{e}");
        let mut out = vec![0.0f32; 2];
        assert!(gather_rows(&rows, 3, GatherDType::Bf16, &mut out).is_err());
        assert!(
            GatherDType::from_arg(4)
                .unwrap_err()
                .to_string()
                .contains("dtype 4")
        );
        assert_eq!(GatherDType::from_arg(3).unwrap(), GatherDType::F32);
    }
}
