//! The element-wise kernels of the family combinations (docs/SPEC.md §5
//! (Layer math)): the projection bias (Engram), the plain highway add of a
//! gated site without a conv (DeepSeek-V4.1's Engram) and LongCat's mean
//! with the word embedding.
//!
//! Invariants: every output element is one or two f32 operations on
//! elements of the same index (and the bias of its column), so results
//! never depend on how many rows a launch holds; lengths are checked before
//! anything is written.

use super::error::KernelError;

/// `y[t, o] += bias[o]` over `y [T, O]`.
pub fn bias_add(y: &mut [f32], bias: &[f32], t: usize, o: usize) -> Result<(), KernelError> {
    const NAME: &str = "bias_add";
    if o == 0 {
        return Err(KernelError::ZeroSize {
            kernel: NAME,
            sizes: "O = 0".into(),
        });
    }
    let shape = || format!("T = {t}, O = {o}");
    KernelError::check_len(NAME, || "bias".into(), bias.len(), o, shape)?;
    KernelError::check_len(NAME, || "y".into(), y.len(), t * o, shape)?;
    for row in y.chunks_exact_mut(o) {
        for (v, &b) in row.iter_mut().zip(bias) {
            *v += b;
        }
    }
    Ok(())
}

/// `highway[i] += out[i]`.
pub fn highway_add(highway: &mut [f32], out: &[f32]) -> Result<(), KernelError> {
    const NAME: &str = "highway_add";
    let n = highway.len();
    KernelError::check_len(NAME, || "out".into(), out.len(), n, || format!("n = {n}"))?;
    for (h, &o) in highway.iter_mut().zip(out) {
        *h += o;
    }
    Ok(())
}

/// `highway[i] = (highway[i] + value[i]) / divisor`: the mean of the word
/// embedding the highway holds and the summed projections of the rows, over
/// `divisor` sources (LongCat: `1 + ngram_heads`).
pub fn mean_add(highway: &mut [f32], value: &[f32], divisor: f32) -> Result<(), KernelError> {
    const NAME: &str = "mean_add";
    if !(divisor.is_finite() && divisor >= 1.0) {
        return Err(KernelError::Layout {
            kernel: NAME,
            problem: format!("divisor {divisor} is not a finite number of at least 1"),
        });
    }
    let n = highway.len();
    KernelError::check_len(
        NAME,
        || "value".into(),
        value.len(),
        n,
        || format!("n = {n}"),
    )?;
    for (h, &v) in highway.iter_mut().zip(value) {
        *h = (*h + v) / divisor;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn element_wise_results_and_refusals() {
        let mut y = vec![1.0, 2.0, 3.0, 4.0, 5.0, 6.0];
        bias_add(&mut y, &[0.5, -1.0, 0.0], 2, 3).unwrap();
        assert_eq!(y, [1.5, 1.0, 3.0, 4.5, 4.0, 6.0]);
        assert!(bias_add(&mut y, &[0.5], 2, 3).is_err());
        let mut h = vec![1.0, -2.0];
        highway_add(&mut h, &[0.25, 0.5]).unwrap();
        assert_eq!(h, [1.25, -1.5]);
        assert!(highway_add(&mut h, &[1.0]).is_err());
        mean_add(&mut h, &[0.75, 4.5], 4.0).unwrap();
        assert_eq!(h, [0.5, 0.75]);
        let e = mean_add(&mut h, &[0.0, 0.0], 0.5).unwrap_err().to_string();
        assert!(e.contains("divisor 0.5"), "{e}");
    }
}
