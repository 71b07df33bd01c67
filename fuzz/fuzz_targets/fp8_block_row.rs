//! Fuzz the block-scaled FP8 rows (`RowDType::Fp8E4M3Block32`): table rows
//! read from a checkpoint are arbitrary bytes.
//!
//! Any bytes must decode without a panic, value by value as
//! `fp8(b) * 2^(s - 127)`, and the gather kernel must give exactly those
//! values rounded to BF16. Any finite f32 row must quantise to bytes that
//! decode within half an FP8 step of the value (relative 2^-4, or half a
//! subnormal step of its block's scale).
#![no_main]

use libfuzzer_sys::arbitrary::{Result, Unstructured};
use libfuzzer_sys::fuzz_target;
use metrale_model_layers::layers::ple::kernels::gather::{GatherDType, RowSrc, gather_rows};
use metrale_model_layers::layers::ple::kernels::math::bf16_round;
use metrale_storage::dtype::{
    FP8_BLOCK, fp8_block_bytes_to_f32, fp8_block_row_bytes, fp8_block_value, quantize_fp8_block_row,
    ue8m0_to_f32,
};

fn same(a: f32, b: f32) -> bool {
    a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan())
}

fn run(u: &mut Unstructured<'_>) -> Result<()> {
    let head_dim = FP8_BLOCK * u.int_in_range(1usize..=4)?;
    let row_bytes = fp8_block_row_bytes(head_dim);
    let rows: Vec<Vec<u8>> = (0..u.int_in_range(0usize..=4)?)
        .map(|_| u.bytes(row_bytes).map(<[u8]>::to_vec))
        .collect::<Result<_>>()?;
    let mut decoded = vec![0f32; rows.len() * head_dim];
    for (r, row) in rows.iter().enumerate() {
        let out = &mut decoded[r * head_dim..(r + 1) * head_dim];
        fp8_block_bytes_to_f32(row, out);
        for (j, &v) in out.iter().enumerate() {
            assert!(same(v, fp8_block_value(row, head_dim, j)));
        }
    }
    let srcs: Vec<RowSrc<'_>> = rows
        .iter()
        .map(|r| RowSrc {
            data: r,
            scale: 0.0,
        })
        .collect();
    let mut gathered = vec![0f32; decoded.len()];
    gather_rows(&srcs, head_dim, GatherDType::Fp8E4M3Block32, &mut gathered)
        .expect("well-formed rows gather");
    for (g, d) in gathered.iter().zip(&decoded) {
        assert!(same(*g, bf16_round(*d)));
    }

    let values: Vec<f32> = (0..head_dim)
        .map(|_| u.arbitrary::<f32>().map(|v| if v.is_finite() { v } else { 0.0 }))
        .collect::<Result<_>>()?;
    let mut bytes = Vec::new();
    quantize_fp8_block_row(&values, &mut bytes);
    assert_eq!(bytes.len(), row_bytes);
    let mut back = vec![0f32; head_dim];
    fp8_block_bytes_to_f32(&bytes, &mut back);
    for (j, (&v, &b)) in values.iter().zip(&back).enumerate() {
        let scale = ue8m0_to_f32(bytes[head_dim + j / FP8_BLOCK]);
        let bound = (v.abs() as f64) / 16.0 + scale as f64 * 2f64.powi(-10) + 2f64.powi(-149);
        assert!(
            ((v as f64) - (b as f64)).abs() <= bound,
            "value {j}: {v} came back as {b} (scale {scale})"
        );
    }
    Ok(())
}

fuzz_target!(|data: &[u8]| {
    let _ = run(&mut Unstructured::new(data));
});
