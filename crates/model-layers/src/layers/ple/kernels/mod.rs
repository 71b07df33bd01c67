//! The PLE kernels for the CPU backend: row gather, the projection GEMM, the
//! gate and the dilated conv, and the element-wise kernels of the family
//! combinations, registered as host kernels of module `"ple"`.
//!
//! Each kernel is a pure function over slices (in the submodules) plus a thin
//! wrapper (`host`) that turns launch arguments into checked slices. The
//! launch contract (names, argument order, shapes) is fixed; see
//! [`register_cpu_kernels`].
//!
//! Invariants:
//! - every output element is computed by an order of operations that depends
//!   only on the shapes of one row (never on `T`, the tiling, the thread
//!   count, or the CPU path chosen at run time), so any chunking or batching
//!   of the same rows gives bit-identical results;
//! - emb and weights are BF16 values held in f32; products of two of them are
//!   exact in f32; norms, gate, conv, state and highway are f32;
//! - a launch checks every argument before it writes anything.

pub mod combine;
pub mod conv;
pub mod cpu;
mod error;
pub mod gate;
pub mod gather;
pub mod gemm;
mod host;
pub mod math;

use std::sync::Arc;

use metrale_gpu_runtime::gpu::{ArgKind, GpuBackend, GpuError};

pub use error::KernelError;
pub use gemm::{Steps, pack_projection, packed_len, try_pack_projection};

/// The kernel module name every PLE kernel is registered under, host or
/// device (one name, so the layer resolves its kernels the same way on
/// every backend).
pub use super::device_kernels::MODULE;

/// Register the PLE kernels on `gpu` (idempotent: registering again
/// replaces them with identical ones).
///
/// | name | args |
/// |---|---|
/// | `gather` | refs, n, head_dim, dtype (0 BF16, 1 FP8 E4M3, 2 FP8 E4M3 + UE8M0 per 32), out |
/// | `gather_runs` | refs, n, head_dim, dtype, out, run, stride: reference `i` to out row `(i / run) * stride + i % run` |
/// | `project` | x, w (packed), y, T, E, O |
/// | `project_range` | x, w, y, T, E, O, from, to, accumulate: steps `from..to` only, continuing `y` when accumulate is 1; `y` holds the projection's rows once `to == E` (before that, sums in a layout of the backend's own) |
/// | `gate` | highway, kv, norm_q, norm_k, norm_conv, gated, xn, T, H, hc, eps |
/// | `gate_norms` | highway, kv, norm_q, norm_k, norm_conv, gated, xn, T, H, hc, eps_q, eps_k, eps_conv, form (0 `1+w`, 1 `w`), conv (0: no `xn`) |
/// | `conv` | xn, gated, state, w, highway, T, C, K, D |
/// | `conv_batch` | xn, gated, states, w, highway, B, C, K, D |
/// | `bias_add` | y, bias, T, O |
/// | `highway_add` | highway, out, n |
/// | `mean_add` | highway, value, n, divisor |
///
/// Errors ([`GpuError::Unsupported`]) when the backend runs no host kernels:
/// a device backend runs the device kernels of `kernels/ple.cu` instead,
/// which have the same names and arguments.
pub fn register_cpu_kernels(gpu: &dyn GpuBackend) -> Result<(), GpuError> {
    use ArgKind::{F32, Ptr, U32};
    if !gpu.supports_host_kernels() {
        return Err(GpuError::unsupported(
            "register_cpu_kernels",
            format!("backend '{}' runs no host kernels", gpu.name()),
        ));
    }
    gpu.register_host_kernel(
        MODULE,
        "gather",
        &[Ptr, U32, U32, U32, Ptr],
        Arc::new(host::gather_kernel),
    )?;
    gpu.register_host_kernel(
        MODULE,
        "gather_runs",
        &[Ptr, U32, U32, U32, Ptr, U32, U32],
        Arc::new(host::gather_runs_kernel),
    )?;
    gpu.register_host_kernel(
        MODULE,
        "project",
        &[Ptr, Ptr, Ptr, U32, U32, U32],
        Arc::new(host::project_kernel),
    )?;
    gpu.register_host_kernel(
        MODULE,
        "project_range",
        &[Ptr, Ptr, Ptr, U32, U32, U32, U32, U32, U32],
        Arc::new(host::project_range_kernel),
    )?;
    gpu.register_host_kernel(
        MODULE,
        "gate",
        &[Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, U32, U32, U32, F32],
        Arc::new(host::gate_kernel),
    )?;
    gpu.register_host_kernel(
        MODULE,
        "gate_norms",
        &[
            Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, U32, U32, U32, F32, F32, F32, U32, U32,
        ],
        Arc::new(host::gate_norms_kernel),
    )?;
    gpu.register_host_kernel(
        MODULE,
        "bias_add",
        &[Ptr, Ptr, U32, U32],
        Arc::new(host::bias_add_kernel),
    )?;
    gpu.register_host_kernel(
        MODULE,
        "highway_add",
        &[Ptr, Ptr, U32],
        Arc::new(host::highway_add_kernel),
    )?;
    gpu.register_host_kernel(
        MODULE,
        "mean_add",
        &[Ptr, Ptr, U32, F32],
        Arc::new(host::mean_add_kernel),
    )?;
    gpu.register_host_kernel(
        MODULE,
        "conv",
        &[Ptr, Ptr, Ptr, Ptr, Ptr, U32, U32, U32, U32],
        Arc::new(host::conv_kernel),
    )?;
    gpu.register_host_kernel(
        MODULE,
        "conv_batch",
        &[Ptr, Ptr, Ptr, Ptr, Ptr, U32, U32, U32, U32],
        Arc::new(host::conv_batch_kernel),
    )?;
    Ok(())
}
