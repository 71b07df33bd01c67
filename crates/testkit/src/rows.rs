//! Deterministic highway rows for tests.
//!
//! Invariant: row `i` of [`rows_for`] is a function of the token prefix
//! `tokens[..=i]` alone, as the hidden state of a causal model is, so
//! prefix-cache restores stay valid and a re-run of the same tokens gets
//! the same inputs.

use crate::Rng;

/// The highway rows of `tokens[from..to]`, `width` values each.
pub fn rows_for(tokens: &[u32], from: usize, to: usize, width: usize) -> Vec<f32> {
    let mut out = Vec::with_capacity((to - from) * width);
    let mut h: u64 = 0x51_7cc1_b727_220a;
    for (i, &t) in tokens[..to].iter().enumerate() {
        h = (h ^ t as u64).wrapping_mul(0x100_0000_01b3).rotate_left(17) ^ 0x9e37;
        if i >= from {
            let mut r = Rng(h);
            for _ in 0..width {
                out.push(r.unit());
            }
        }
    }
    out
}
