//! LongCat's table layout (docs/SPEC.md, "Families"): `k * (n - 1)`
//! sub-tables, order-major, sub-table `i` with `m + 2i + 1` rows.
//!
//! Invariant: sizes and offsets are computed with checked arithmetic; a
//! layout that does not fit 64 bits is an error.

use super::engram::running_offsets;
use super::{IdError, Result};

/// The sub-table sizes `m + 2i + 1` for `i` in `0..count`.
pub fn longcat_sizes(rows_base: u64, count: usize) -> Result<Vec<u64>> {
    (0..count as u64)
        .map(|i| {
            i.checked_mul(2)
                .and_then(|v| v.checked_add(1))
                .and_then(|v| v.checked_add(rows_base))
                .ok_or_else(|| {
                    IdError::Params(format!(
                        "LongCat: sub-table {i} has more than 2^64 - 1 rows (m = {rows_base})"
                    ))
                })
        })
        .collect()
}

/// Sizes, offsets and total rows of the layout.
pub fn longcat_layout(rows_base: u64, count: usize) -> Result<(Vec<u64>, Vec<u64>, u64)> {
    let sizes = longcat_sizes(rows_base, count)?;
    let (offsets, total) = running_offsets(&sizes)?;
    Ok((sizes, offsets, total))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lite_layout() {
        let m = 78 * 131_072;
        let (s, o, t) = longcat_layout(m, 12).unwrap();
        assert_eq!(s[0], m + 1);
        assert_eq!(s[11], m + 23);
        assert_eq!(o[1], m + 1);
        assert_eq!(t, 12 * m + 144);
        assert!(longcat_sizes(u64::MAX, 1).is_err());
    }
}
