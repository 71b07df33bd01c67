//! Element conversions for table rows: BF16 and FP8 E4M3 to and from f32.
//!
//! Invariants:
//! - every narrowing conversion rounds to nearest, ties to even;
//! - decoding is exact (both formats are subsets of f32);
//! - FP8 here is the "FN" flavour of E4M3 used by checkpoints
//!   (`F8_E4M3` in safetensors): bias 7, no infinities, largest finite
//!   value 448, NaN is `S.1111.111`. [`f32_to_fp8_e4m3`] maps values whose
//!   rounded magnitude would exceed 448, infinities and NaN to NaN (the
//!   convention of the common ML frameworks); [`f32_to_fp8_e4m3_sat`]
//!   clamps finite values and infinities to ±448 instead;
//! - BF16 NaN inputs stay NaN (quietened), never rounded into infinity;
//! - a scaled FP8 row stores `v / scale` per value and decodes as
//!   `byte_value * scale`; [`fp8_row_scale`] picks `amax / 448` so the
//!   largest magnitude lands on the largest finite code and nothing
//!   overflows, which is how checkpoints quantise table rows.
//!
//! - a block-scaled FP8 row ([`crate::table::RowDType::Fp8E4M3Block32`])
//!   holds its values, then one UE8M0 byte per [`FP8_BLOCK`] values: the
//!   block's scale is `2^(byte - 127)` (byte 255 is NaN). A power-of-two
//!   scale makes decoding `byte_value * scale` exact (barring f32 underflow);
//!   [`ue8m0_block_scale`] picks the smallest power of two at or above
//!   `amax / 448` (computed in f64), so nothing overflows.
//!
//! API at a glance: [`f32_to_bf16`] / [`bf16_to_f32`] (bits),
//! [`round_to_bf16`] (an f32 rounded through BF16); [`f32_to_fp8_e4m3`] /
//! [`fp8_e4m3_to_f32`] (bytes), [`f32_to_fp8_e4m3_scaled`] /
//! [`fp8_e4m3_scaled_to_f32`] (with a scale), [`quantize_fp8_row`] (a whole
//! row and its scale); row helpers for little-endian byte buffers.

/// The largest finite FP8 E4M3 ("FN") magnitude.
pub const FP8_E4M3_MAX: f32 = 448.0;

/// Decode one BF16 value.
#[inline]
pub fn bf16_to_f32(v: u16) -> f32 {
    f32::from_bits((v as u32) << 16)
}

/// Encode one f32 as BF16, rounding to nearest, ties to even.
#[inline]
pub fn f32_to_bf16(v: f32) -> u16 {
    let bits = v.to_bits();
    if v.is_nan() {
        // Keep the sign and the top payload bits, force the quiet bit so a
        // signalling NaN whose payload lives in the low bits stays a NaN.
        return ((bits >> 16) as u16) | 0x0040;
    }
    let lsb = (bits >> 16) & 1;
    (bits.wrapping_add(0x7FFF + lsb) >> 16) as u16
}

/// `v` rounded to the nearest BF16 value (ties to even), as an f32.
#[inline]
pub fn round_to_bf16(v: f32) -> f32 {
    bf16_to_f32(f32_to_bf16(v))
}

/// Decode one FP8 E4M3 value by direct bit manipulation (used to build
/// [`FP8_E4M3_TABLE`]; call [`fp8_e4m3_to_f32`] instead).
const fn fp8_e4m3_decode_bits(b: u8) -> u32 {
    let sign = ((b as u32) >> 7) << 31;
    let e = ((b >> 3) & 0xF) as u32;
    let m = (b & 0x7) as u32;
    if e == 0xF && m == 0x7 {
        return sign | 0x7FC0_0000;
    }
    if e == 0 {
        if m == 0 {
            return sign;
        }
        // Subnormal: m * 2^-9. Normalise around the highest set bit p.
        let p = 31 - m.leading_zeros();
        let exp = p + 118; // (p - 9) + 127
        let mant = (m - (1 << p)) << (23 - p);
        return sign | (exp << 23) | mant;
    }
    sign | ((e + 120) << 23) | (m << 20)
}

const fn build_fp8_table() -> [f32; 256] {
    let mut t = [0.0f32; 256];
    let mut i = 0;
    while i < 256 {
        t[i] = f32::from_bits(fp8_e4m3_decode_bits(i as u8));
        i += 1;
    }
    t
}

/// The f32 value of every FP8 E4M3 byte.
pub static FP8_E4M3_TABLE: [f32; 256] = build_fp8_table();

/// Decode one FP8 E4M3 value (a table lookup).
#[inline]
pub fn fp8_e4m3_to_f32(v: u8) -> f32 {
    FP8_E4M3_TABLE[v as usize]
}

/// Encode one f32 as FP8 E4M3, rounding to nearest, ties to even. Values
/// that round past 448, infinities and NaN become NaN (`0x7F`, signed).
#[inline]
pub fn f32_to_fp8_e4m3(v: f32) -> u8 {
    let bits = v.to_bits();
    let sign = ((bits >> 24) & 0x80) as u8;
    let abs = bits & 0x7FFF_FFFF;
    // 480.0: everything from here up rounds to the NaN encoding.
    if abs >= 0x43F0_0000 {
        return sign | 0x7F;
    }
    if abs < (121 << 23) {
        // Below the smallest normal (2^-6): the result is subnormal. Adding
        // 2^14 puts the FP8 subnormal step (2^-9) exactly at the f32 ulp,
        // so the FPU's own round-to-nearest-even does the rounding.
        let denorm = f32::from_bits(141 << 23);
        let r = (f32::from_bits(abs) + denorm).to_bits() - denorm.to_bits();
        return sign | r as u8;
    }
    let odd = (abs >> 20) & 1;
    // Rebias the exponent (127 -> 7) and round the 20 dropped bits.
    let r = abs.wrapping_add(((7u32.wrapping_sub(127)) << 23).wrapping_add(0x7_FFFF) + odd);
    sign | (r >> 20) as u8
}

/// Encode one f32 as FP8 E4M3, rounding to nearest, ties to even, clamping
/// finite overflow and infinities to ±448. NaN stays NaN.
#[inline]
pub fn f32_to_fp8_e4m3_sat(v: f32) -> u8 {
    if v.is_nan() {
        return f32_to_fp8_e4m3(v);
    }
    f32_to_fp8_e4m3(v.clamp(-448.0, 448.0))
}

/// Encode `v` as the FP8 E4M3 byte of `v / scale` (round to nearest even;
/// past ±448 after scaling is NaN, as [`f32_to_fp8_e4m3`]).
#[inline]
pub fn f32_to_fp8_e4m3_scaled(v: f32, scale: f32) -> u8 {
    f32_to_fp8_e4m3(v / scale)
}

/// Decode FP8 E4M3 byte `b` of a row with scale `scale`.
#[inline]
pub fn fp8_e4m3_scaled_to_f32(b: u8, scale: f32) -> f32 {
    fp8_e4m3_to_f32(b) * scale
}

/// The scale that maps a row's largest magnitude onto [`FP8_E4M3_MAX`]
/// (`amax / 448`), or 1 for an all-zero row (any scale would do; 1 keeps
/// decoding exact).
pub fn fp8_row_scale(row: &[f32]) -> f32 {
    let amax = row.iter().fold(0f32, |a, &v| a.max(v.abs()));
    if amax > 0.0 { amax / FP8_E4M3_MAX } else { 1.0 }
}

/// Quantise a row to FP8 E4M3 with [`fp8_row_scale`]: appends one byte per
/// value to `dst` and returns the scale to store beside the row.
pub fn quantize_fp8_row(src: &[f32], dst: &mut Vec<u8>) -> f32 {
    let scale = fp8_row_scale(src);
    dst.reserve(src.len());
    dst.extend(src.iter().map(|&v| f32_to_fp8_e4m3_scaled(v, scale)));
    scale
}

/// Values per UE8M0 scale in a block-scaled FP8 row.
pub const FP8_BLOCK: usize = 32;

/// Bytes of a block-scaled FP8 row of `head_dim` values: the values, then
/// one scale byte per started block (264 for 256 values).
pub const fn fp8_block_row_bytes(head_dim: usize) -> usize {
    head_dim + head_dim.div_ceil(FP8_BLOCK)
}

/// Decode a UE8M0 scale byte: `2^(e - 127)`; 255 is NaN. Exact for every
/// byte (`e = 0` is the f32 subnormal `2^-127`).
#[inline]
pub fn ue8m0_to_f32(e: u8) -> f32 {
    match e {
        255 => f32::NAN,
        0 => f32::from_bits(1 << 22),
        e => f32::from_bits(u32::from(e) << 23),
    }
}

/// The UE8M0 byte of the smallest power of two at or above `amax / 448`
/// over `block` (the quotient computed in f64), clamped to the encodable
/// range `2^-127..=2^127`; 127 (scale 1) for an all-zero block. Non-finite
/// values are ignored by the max (they encode as NaN either way).
pub fn ue8m0_block_scale(block: &[f32]) -> u8 {
    let amax = block
        .iter()
        .filter(|v| v.is_finite())
        .fold(0f32, |a, &v| a.max(v.abs()));
    if amax == 0.0 {
        return 127;
    }
    let q = f64::from(amax) / f64::from(FP8_E4M3_MAX);
    let bits = q.to_bits();
    // q is a normal f64 (amax >= 2^-149): its unbiased exponent, plus one
    // when any mantissa bit makes it exceed that power of two.
    let exp = ((bits >> 52) & 0x7FF) as i64 - 1023 + i64::from(bits & ((1 << 52) - 1) != 0);
    (exp + 127).clamp(0, 254) as u8
}

/// Quantise a row to block-scaled FP8 E4M3: appends the `src.len()` value
/// bytes (each `v / scale` of its block, rounded to nearest even, except
/// that a code whose decoded value would overflow f32 (only for values
/// within 2^-4 of `f32::MAX`) is replaced by the next code toward zero),
/// then one [`ue8m0_block_scale`] byte per block, to `dst`.
///
/// # Panics
/// If `src.len()` is not a multiple of [`FP8_BLOCK`] (a caller bug).
pub fn quantize_fp8_block_row(src: &[f32], dst: &mut Vec<u8>) {
    assert!(
        src.len().is_multiple_of(FP8_BLOCK),
        "block-scaled fp8 row of {} values is not a multiple of {FP8_BLOCK}",
        src.len()
    );
    dst.reserve(fp8_block_row_bytes(src.len()));
    let scales: Vec<u8> = src.chunks_exact(FP8_BLOCK).map(ue8m0_block_scale).collect();
    for (block, &e) in src.chunks_exact(FP8_BLOCK).zip(&scales) {
        let scale = ue8m0_to_f32(e);
        dst.extend(block.iter().map(|&v| {
            let b = f32_to_fp8_e4m3(v / scale);
            // Near f32::MAX the nearest code times the scale can overflow:
            // take the next code toward zero, whose product is finite.
            if (fp8_e4m3_to_f32(b) * scale).is_infinite() {
                b - 1
            } else {
                b
            }
        }));
    }
    dst.extend_from_slice(&scales);
}

/// Decode value `i` of a block-scaled FP8 row of `head_dim` values held in
/// `row` (values, then scales).
///
/// # Panics
/// If `row` is shorter than [`fp8_block_row_bytes`]`(head_dim)` or `i >=
/// head_dim` (caller bugs).
#[inline]
pub fn fp8_block_value(row: &[u8], head_dim: usize, i: usize) -> f32 {
    assert!(i < head_dim, "value {i} of a row of {head_dim}");
    fp8_e4m3_to_f32(row[i]) * ue8m0_to_f32(row[head_dim + i / FP8_BLOCK])
}

/// Decode a block-scaled FP8 row (values, then scales) into `dst`.
///
/// # Panics
/// If `src.len() != fp8_block_row_bytes(dst.len())` (a caller bug).
pub fn fp8_block_bytes_to_f32(src: &[u8], dst: &mut [f32]) {
    let n = dst.len();
    assert_eq!(
        src.len(),
        fp8_block_row_bytes(n),
        "block-scaled fp8 row length mismatch"
    );
    let (values, scales) = src.split_at(n);
    for ((d, &b), i) in dst.iter_mut().zip(values).zip(0..) {
        *d = fp8_e4m3_to_f32(b) * ue8m0_to_f32(scales[i / FP8_BLOCK]);
    }
}

/// Decode a row of little-endian BF16 bytes into `dst`.
///
/// # Panics
/// If `src.len() != 2 * dst.len()` (a caller bug, not an input error).
pub fn bf16_bytes_to_f32(src: &[u8], dst: &mut [f32]) {
    assert_eq!(src.len(), dst.len() * 2, "bf16 row length mismatch");
    for (d, c) in dst.iter_mut().zip(src.chunks_exact(2)) {
        *d = bf16_to_f32(u16::from_le_bytes([c[0], c[1]]));
    }
}

/// Decode a row of FP8 E4M3 bytes times `scale` into `dst`.
///
/// # Panics
/// If `src.len() != dst.len()` (a caller bug, not an input error).
pub fn fp8_bytes_to_f32(src: &[u8], scale: f32, dst: &mut [f32]) {
    assert_eq!(src.len(), dst.len(), "fp8 row length mismatch");
    for (d, &b) in dst.iter_mut().zip(src) {
        *d = fp8_e4m3_scaled_to_f32(b, scale);
    }
}

/// Encode f32 values as little-endian BF16 bytes, appended to `dst`.
pub fn f32_to_bf16_bytes(src: &[f32], dst: &mut Vec<u8>) {
    dst.reserve(src.len() * 2);
    for &v in src {
        dst.extend_from_slice(&f32_to_bf16(v).to_le_bytes());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bf16_round_trips_every_value() {
        for v in 0..=u16::MAX {
            let f = bf16_to_f32(v);
            let back = f32_to_bf16(f);
            if f.is_nan() {
                assert!(bf16_to_f32(back).is_nan(), "{v:#06x}");
            } else {
                assert_eq!(back, v, "{v:#06x} -> {f}");
            }
        }
    }

    #[test]
    fn bf16_ties_go_to_even() {
        // 1.0 + 2^-8 is exactly halfway between 1.0 (even) and 1.0 + 2^-7.
        assert_eq!(f32_to_bf16(1.0 + 2f32.powi(-8)), f32_to_bf16(1.0));
        // 1.0 + 3 * 2^-8 is halfway between 1 + 2^-7 (odd) and 1 + 2^-6.
        assert_eq!(
            f32_to_bf16(1.0 + 3.0 * 2f32.powi(-8)),
            f32_to_bf16(1.0 + 2f32.powi(-6))
        );
        // Just above the tie rounds up.
        let above = f32::from_bits((1.0 + 2f32.powi(-8)).to_bits() + 1);
        assert_eq!(f32_to_bf16(above), f32_to_bf16(1.0 + 2f32.powi(-7)));
        assert_eq!(bf16_to_f32(f32_to_bf16(f32::MAX)), f32::INFINITY);
        assert!(bf16_to_f32(f32_to_bf16(f32::NAN)).is_nan());
        // A NaN with only low payload bits must not collapse to infinity.
        assert!(bf16_to_f32(f32_to_bf16(f32::from_bits(0x7F80_0001))).is_nan());
    }

    #[test]
    fn fp8_table_has_known_values() {
        assert_eq!(fp8_e4m3_to_f32(0x00), 0.0);
        assert_eq!(fp8_e4m3_to_f32(0x80).to_bits(), (-0.0f32).to_bits());
        assert_eq!(fp8_e4m3_to_f32(0x38), 1.0);
        assert_eq!(fp8_e4m3_to_f32(0x7E), 448.0);
        assert_eq!(fp8_e4m3_to_f32(0xFE), -448.0);
        assert_eq!(fp8_e4m3_to_f32(0x01), 2f32.powi(-9));
        assert_eq!(fp8_e4m3_to_f32(0x07), 7.0 * 2f32.powi(-9));
        assert_eq!(fp8_e4m3_to_f32(0x08), 2f32.powi(-6));
        assert_eq!(fp8_e4m3_to_f32(0x3C), 1.5);
        assert!(fp8_e4m3_to_f32(0x7F).is_nan());
        assert!(fp8_e4m3_to_f32(0xFF).is_nan());
    }

    #[test]
    fn fp8_round_trips_every_value() {
        for b in 0..=255u8 {
            let f = fp8_e4m3_to_f32(b);
            let back = f32_to_fp8_e4m3(f);
            assert_eq!(back, b, "{b:#04x} -> {f}");
        }
    }

    #[test]
    fn fp8_rounding_and_overflow() {
        // Halfway between 1.0 (0x38, even) and 1.125 (0x39): to even.
        assert_eq!(f32_to_fp8_e4m3(1.0625), 0x38);
        // Halfway between 1.125 (odd) and 1.25 (0x3A): to even.
        assert_eq!(f32_to_fp8_e4m3(1.1875), 0x3A);
        // Subnormal tie: 1.5 * 2^-9 between 2^-9 (odd) and 2 * 2^-9.
        assert_eq!(f32_to_fp8_e4m3(1.5 * 2f32.powi(-9)), 0x02);
        assert_eq!(f32_to_fp8_e4m3(0.5 * 2f32.powi(-9)), 0x00);
        assert_eq!(f32_to_fp8_e4m3(-0.0), 0x80);
        // 464 is the tie between 448 and the NaN code: even wins.
        assert_eq!(f32_to_fp8_e4m3(464.0), 0x7E);
        assert_eq!(f32_to_fp8_e4m3(470.0), 0x7F);
        assert_eq!(f32_to_fp8_e4m3(1e6), 0x7F);
        assert_eq!(f32_to_fp8_e4m3(f32::NEG_INFINITY), 0xFF);
        assert_eq!(f32_to_fp8_e4m3_sat(1e6), 0x7E);
        assert_eq!(f32_to_fp8_e4m3_sat(f32::NEG_INFINITY), 0xFE);
        assert!(fp8_e4m3_to_f32(f32_to_fp8_e4m3_sat(f32::NAN)).is_nan());
    }

    #[test]
    fn scaled_fp8_rows_round_trip() {
        let row = [0.5f32, -3.0, 1.25, 0.0];
        let mut bytes = Vec::new();
        let scale = quantize_fp8_row(&row, &mut bytes);
        assert_eq!(scale, 3.0 / FP8_E4M3_MAX);
        assert_eq!(
            bytes[1], 0xFE,
            "the largest magnitude takes the largest code"
        );
        let back: Vec<f32> = bytes
            .iter()
            .map(|&b| fp8_e4m3_scaled_to_f32(b, scale))
            .collect();
        for (a, b) in row.iter().zip(&back) {
            assert!((a - b).abs() <= a.abs() / 16.0, "{a} -> {b}");
        }
        assert_eq!(fp8_row_scale(&[0.0, -0.0]), 1.0);
        assert_eq!(f32_to_fp8_e4m3_scaled(2.0, 2.0), 0x38);
        assert_eq!(round_to_bf16(1.0 + 2f32.powi(-9)), 1.0);
    }

    #[test]
    fn ue8m0_scales_are_powers_of_two() {
        assert_eq!(ue8m0_to_f32(127), 1.0);
        assert_eq!(ue8m0_to_f32(128), 2.0);
        assert_eq!(ue8m0_to_f32(120), 2f32.powi(-7));
        assert_eq!(ue8m0_to_f32(254), 2f32.powi(127));
        assert_eq!(ue8m0_to_f32(1), 2f32.powi(-126));
        assert_eq!(ue8m0_to_f32(0), 2f32.powi(-127));
        assert!(ue8m0_to_f32(255).is_nan());
        // amax 448 fits scale 1 exactly; a hair above needs 2.
        assert_eq!(ue8m0_block_scale(&[448.0, -1.0]), 127);
        assert_eq!(ue8m0_block_scale(&[-448.5]), 128);
        assert_eq!(ue8m0_block_scale(&[1.0]), 127 - 8);
        assert_eq!(ue8m0_block_scale(&[0.0, -0.0]), 127);
        assert_eq!(ue8m0_block_scale(&[1e-45]), 0);
        assert_eq!(fp8_block_row_bytes(256), 264);
        assert_eq!(fp8_block_row_bytes(32), 33);
    }

    #[test]
    fn block_fp8_rows_round_trip() {
        let row: Vec<f32> = (0..64)
            .map(|i| {
                if i < 32 {
                    i as f32 * 0.25 - 3.0
                } else {
                    (i as f32 - 40.0) * 1e-3
                }
            })
            .collect();
        let mut bytes = Vec::new();
        quantize_fp8_block_row(&row, &mut bytes);
        assert_eq!(bytes.len(), 66);
        // Block 0: amax 4.75, 4.75 / 448 in (2^-7, 2^-6]: scale 2^-6.
        assert_eq!(bytes[64], 127 - 6);
        // Block 1: amax 0.023, / 448 in (2^-15, 2^-14]: scale 2^-14.
        assert_eq!(bytes[65], 127 - 14);
        let mut back = vec![0.0f32; 64];
        fp8_block_bytes_to_f32(&bytes, &mut back);
        for (i, (a, b)) in row.iter().zip(&back).enumerate() {
            assert!((a - b).abs() <= a.abs() / 16.0, "{i}: {a} -> {b}");
            assert_eq!(*b, fp8_block_value(&bytes, 64, i));
        }
        // Values that are exact in FP8 at their block's scale come back bit
        // for bit: 1.5 * 2^-6 is FP8 0x3C at scale 2^-6.
        assert_eq!(back[18], -3.0 + 18.0 * 0.25);
        // -f32::MAX / 2^120 rounds to -256, whose decode -2^128 is no f32:
        // the next code toward zero (-240 * 2^120) is stored instead.
        let mut bytes = Vec::new();
        let mut big = vec![0f32; 32];
        big[1] = -f32::MAX;
        quantize_fp8_block_row(&big, &mut bytes);
        let mut back = vec![0f32; 32];
        fp8_block_bytes_to_f32(&bytes, &mut back);
        assert_eq!(back[1], -240.0 * 2f32.powi(120));
    }

    #[test]
    fn row_helpers_decode() {
        let mut bytes = Vec::new();
        f32_to_bf16_bytes(&[1.0, -2.5, 0.0], &mut bytes);
        let mut out = [0.0f32; 3];
        bf16_bytes_to_f32(&bytes, &mut out);
        assert_eq!(out, [1.0, -2.5, 0.0]);
        let mut out = [0.0f32; 2];
        fp8_bytes_to_f32(&[0x38, 0xBC], 2.0, &mut out);
        assert_eq!(out, [2.0, -3.0]);
    }
}
