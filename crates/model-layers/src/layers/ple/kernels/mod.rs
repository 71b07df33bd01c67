//! The PLE kernels for the CPU backend: row gather, the projection GEMM, the
//! gate and the dilated conv, registered as host kernels of module `"ple"`.
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
pub use gemm::{pack_projection, packed_len, try_pack_projection};

/// The kernel module name every PLE kernel is registered under, host or
/// device (one name, so the layer resolves its kernels the same way on
/// every backend).
pub use super::device_kernels::MODULE;

/// Register the PLE kernels on `gpu` (idempotent: registering again
/// replaces them with identical ones).
///
/// | name | args |
/// |---|---|
/// | `gather` | refs, n, head_dim, dtype (0 BF16, 1 FP8 E4M3), out |
/// | `project` | x, w (packed), y, T, E, O |
/// | `gate` | highway, kv, norm_q, norm_k, norm_conv, gated, xn, T, H, hc, eps |
/// | `conv` | xn, gated, state, w, highway, T, C, K, D |
/// | `conv_batch` | xn, gated, states, w, highway, B, C, K, D |
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
        "project",
        &[Ptr, Ptr, Ptr, U32, U32, U32],
        Arc::new(host::project_kernel),
    )?;
    gpu.register_host_kernel(
        MODULE,
        "gate",
        &[Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, U32, U32, U32, F32],
        Arc::new(host::gate_kernel),
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
