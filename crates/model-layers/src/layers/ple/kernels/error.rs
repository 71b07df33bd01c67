//! The typed error of the pure kernel functions.
//!
//! A kernel function checks every slice and size before it writes anything,
//! and says which check failed: the kernel, the argument and both sizes. The
//! host-kernel wrappers turn it into a [`metrale_gpu_runtime::GpuError`]
//! kernel error, so a launch reports it through the backend.

use thiserror::Error;

use super::cpu::CpuPath;

/// Why a kernel function refused its arguments.
#[derive(Clone, Debug, PartialEq, Error)]
#[non_exhaustive]
pub enum KernelError {
    /// The chosen CPU code path cannot run on this CPU.
    #[error("{kernel}: CPU path {path:?} is not available on this CPU")]
    PathUnavailable {
        /// The kernel.
        kernel: &'static str,
        /// The path asked for.
        path: CpuPath,
    },
    /// A size the kernel divides or iterates by is zero.
    #[error("{kernel}: {sizes} must all be positive")]
    ZeroSize {
        /// The kernel.
        kernel: &'static str,
        /// The sizes with their values, e.g. "H = 0, hc = 2".
        sizes: String,
    },
    /// A size does not fit the layout the kernel reads (e.g. a block-scaled
    /// row whose width is not a multiple of its block).
    #[error("{kernel}: {problem}")]
    Layout {
        /// The kernel.
        kernel: &'static str,
        /// The size and the rule it breaks.
        problem: String,
    },
    /// The norm epsilon is NaN, infinite or negative.
    #[error("{kernel}: eps {eps} is not a finite non-negative number")]
    Eps {
        /// The kernel.
        kernel: &'static str,
        /// The value given.
        eps: f32,
    },
    /// A slice holds the wrong number of values.
    #[error("{kernel}: {what} holds {found} values, expected {expected} ({shape})")]
    Length {
        /// The kernel.
        kernel: &'static str,
        /// The argument, e.g. "kv" or "state 3".
        what: String,
        /// Values given.
        found: usize,
        /// Values the sizes imply.
        expected: usize,
        /// The sizes, e.g. "T = 2, H = 4, hc = 2".
        shape: String,
    },
    /// A table row has the wrong number of bytes for `head_dim` values.
    #[error("{kernel}: row {row} has {found} bytes, expected {expected}")]
    RowBytes {
        /// The kernel.
        kernel: &'static str,
        /// The first bad row.
        row: usize,
        /// Its bytes.
        found: usize,
        /// `head_dim` times the value size.
        expected: usize,
    },
    /// A product of sizes does not fit `usize`.
    #[error("{kernel}: {what} overflows")]
    Overflow {
        /// The kernel.
        kernel: &'static str,
        /// The product, e.g. "[O = 3, E = 4]".
        what: String,
    },
}

impl KernelError {
    /// Refuse `path` unless this CPU can run it.
    pub(crate) fn check_path(kernel: &'static str, path: CpuPath) -> Result<(), KernelError> {
        if path.available() {
            Ok(())
        } else {
            Err(KernelError::PathUnavailable { kernel, path })
        }
    }

    /// Refuse a slice of `found` values where `expected` are needed.
    pub(crate) fn check_len(
        kernel: &'static str,
        what: impl FnOnce() -> String,
        found: usize,
        expected: usize,
        shape: impl FnOnce() -> String,
    ) -> Result<(), KernelError> {
        if found == expected {
            Ok(())
        } else {
            Err(KernelError::Length {
                kernel,
                what: what(),
                found,
                expected,
                shape: shape(),
            })
        }
    }
}
