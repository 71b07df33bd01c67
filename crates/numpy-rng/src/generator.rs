//! numpy's `Generator.integers(low, high, size, dtype=np.int64)`.
//!
//! With `endpoint=False` numpy samples `off + u` where `off = low` and `u`
//! is uniform on the inclusive span `[0, high - 1 - low]`, all as wrapping
//! 64-bit arithmetic. How `u` is drawn depends on the span:
//!
//! - span 0: no draw, every value is `low`;
//! - span below `2^32 - 1`: Lemire's bounded method on 32-bit draws (the
//!   bit generator's buffered 32-bit output);
//! - span exactly `2^32 - 1`: a raw 32-bit draw;
//! - larger spans below `2^64 - 1`: Lemire's method on 64-bit draws;
//! - span `2^64 - 1`: a raw 64-bit draw (unreachable with exclusive `i64`
//!   bounds, kept for completeness).
//!
//! Lemire's method multiplies a draw by the range size `r`, keeps the high
//! half, and rejects the draw only when the low half falls below
//! `2^k mod r`; the modulus is computed only when the low half is below `r`.

use crate::pcg64::Pcg64;

/// Errors from [`Generator`] methods.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum NumpyRngError {
    /// `integers` was asked for an empty range (numpy raises
    /// `ValueError: low >= high`).
    #[error("empty integer range: low ({low}) >= high ({high})")]
    EmptyRange {
        /// The inclusive lower bound requested.
        low: i64,
        /// The exclusive upper bound requested.
        high: i64,
    },
}

/// numpy's `Generator` over a [`Pcg64`] bit generator.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Generator {
    bits: Pcg64,
}

impl Generator {
    /// `Generator(bit_generator)`.
    pub fn new(bits: Pcg64) -> Self {
        Self { bits }
    }

    /// The underlying bit generator (numpy's `Generator.bit_generator`).
    pub fn bit_generator(&mut self) -> &mut Pcg64 {
        &mut self.bits
    }

    /// `integers(low, high, size=size, dtype=np.int64)` with
    /// `endpoint=False`: `size` values uniform on `[low, high)`.
    ///
    /// # Errors
    /// [`NumpyRngError::EmptyRange`] when `low >= high`; nothing is drawn.
    pub fn integers_i64(
        &mut self,
        low: i64,
        high: i64,
        size: usize,
    ) -> Result<Vec<i64>, NumpyRngError> {
        let mut out = vec![0i64; size];
        self.fill_integers_i64(low, high, &mut out)?;
        Ok(out)
    }

    /// As [`Generator::integers_i64`], writing `out.len()` values into `out`.
    ///
    /// # Errors
    /// [`NumpyRngError::EmptyRange`] when `low >= high`; `out` is untouched.
    pub fn fill_integers_i64(
        &mut self,
        low: i64,
        high: i64,
        out: &mut [i64],
    ) -> Result<(), NumpyRngError> {
        if low >= high {
            return Err(NumpyRngError::EmptyRange { low, high });
        }
        // Inclusive span and offset, reinterpreted as unsigned like numpy.
        let span = (high as u64).wrapping_sub(1).wrapping_sub(low as u64);
        let off = low as u64;
        let bits = &mut self.bits;
        let mut emit = |draw: &mut dyn FnMut() -> u64| {
            for v in out.iter_mut() {
                *v = off.wrapping_add(draw()) as i64;
            }
        };
        match span {
            0 => emit(&mut || 0),
            // Below 2^32 - 1, so the narrowing is exact.
            s if s < u64::from(u32::MAX) => emit(&mut || u64::from(lemire_u32(bits, s as u32))),
            s if s == u64::from(u32::MAX) => emit(&mut || u64::from(bits.next_u32())),
            u64::MAX => emit(&mut || bits.next_u64()),
            s => emit(&mut || lemire_u64(bits, s)),
        }
        Ok(())
    }
}

/// Uniform on `[0, span]` from 32-bit draws; `span < 2^32 - 1`.
fn lemire_u32(bits: &mut Pcg64, span: u32) -> u32 {
    let size = span + 1;
    let mut m = u64::from(bits.next_u32()) * u64::from(size);
    let mut low = m as u32;
    if low < size {
        // 2^32 mod size, written without overflow.
        let threshold = (u32::MAX - span) % size;
        while low < threshold {
            m = u64::from(bits.next_u32()) * u64::from(size);
            low = m as u32;
        }
    }
    (m >> 32) as u32
}

/// Uniform on `[0, span]` from 64-bit draws; `span < 2^64 - 1`.
fn lemire_u64(bits: &mut Pcg64, span: u64) -> u64 {
    let size = span + 1;
    let mut m = u128::from(bits.next_u64()) * u128::from(size);
    let mut low = m as u64;
    if low < size {
        // 2^64 mod size, written without overflow.
        let threshold = (u64::MAX - span) % size;
        while low < threshold {
            m = u128::from(bits.next_u64()) * u128::from(size);
            low = m as u64;
        }
    }
    (m >> 64) as u64
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::default_rng;

    #[test]
    fn values_stay_in_range_and_repeat() {
        for &(low, high) in &[
            (0i64, 1i64),
            (0, 3),
            (-5, 5),
            (0, 1 << 32),
            (0, (1 << 32) + 1),
            (0, (1 << 62) - 1),
            (i64::MIN, i64::MAX),
            (i64::MAX - 2, i64::MAX),
        ] {
            let a = default_rng(77).integers_i64(low, high, 64).unwrap();
            let b = default_rng(77).integers_i64(low, high, 64).unwrap();
            assert_eq!(a, b, "not deterministic for [{low}, {high})");
            assert!(
                a.iter().all(|&v| low <= v && v < high),
                "out of [{low}, {high}): {a:?}"
            );
        }
    }

    #[test]
    fn single_value_range_draws_nothing() {
        let mut g = default_rng(3);
        assert_eq!(g.integers_i64(9, 10, 4).unwrap(), vec![9; 4]);
        let mut fresh = default_rng(3);
        assert_eq!(
            g.bit_generator().next_u64(),
            fresh.bit_generator().next_u64()
        );
    }

    #[test]
    fn empty_range_is_an_error_and_draws_nothing() {
        let mut g = default_rng(5);
        let err = g.integers_i64(4, 4, 3).unwrap_err();
        assert_eq!(err, NumpyRngError::EmptyRange { low: 4, high: 4 });
        assert!(err.to_string().contains("low (4) >= high (4)"));
        assert!(g.integers_i64(10, -10, 0).is_err());
        assert_eq!(g, default_rng(5));
    }

    #[test]
    fn small_range_covers_every_value() {
        let vals = default_rng(11).integers_i64(0, 7, 500).unwrap();
        for k in 0..7 {
            assert!(vals.contains(&k), "{k} never drawn");
        }
    }
}
