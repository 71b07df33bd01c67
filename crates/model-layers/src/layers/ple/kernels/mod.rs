//! The PLE kernels for the CPU backend: row gather, the projection GEMM, the
//! gate and the dilated conv, and the element-wise kernels of the family
//! combinations, registered as host kernels of module `"ple"`.
//!
//! Each kernel is a pure function over slices (in the submodules) plus a thin
//! wrapper (`host`) that turns its argument struct ([`args`]) into checked
//! slices. The launch contract (names, argument structs, shapes) is fixed;
//! see [`register_cpu_kernels`].
//!
//! Invariants:
//! - every output element is computed by an order of operations that depends
//!   only on the shapes of one row (never on `T`, the tiling, the thread
//!   count, or the CPU path chosen at run time), so any chunking or batching
//!   of the same rows gives bit-identical results;
//! - emb and weights are BF16 values held in f32; products of two of them are
//!   exact in f32; norms, gate, conv, state and highway are f32;
//! - a launch checks every argument before it writes anything.

pub mod args;
pub mod combine;
pub mod conv;
pub mod cpu;
mod error;
pub mod gate;
pub mod gather;
pub mod gemm;
mod host;
pub mod math;

use metrale_gpu_runtime::gpu::{GpuBackend, GpuError};

pub use error::KernelError;
pub use gemm::{Steps, pack_projection, packed_len, try_pack_projection};

/// The kernel module name every PLE kernel is registered under, host or
/// device (one name, so the layer resolves its kernels the same way on
/// every backend).
pub use super::device_kernels::MODULE;

/// Register the PLE kernels on `gpu` (idempotent: registering again
/// replaces them with identical ones), each taking its argument struct of
/// [`args`] (the table below names the fields in order).
///
/// | name | args |
/// |---|---|
/// | `gather` | [`GatherArgs`](args::GatherArgs): refs, n, head_dim, dtype (0 BF16, 1 FP8 E4M3, 2 FP8 E4M3 + UE8M0 per 32, 3 F32), out |
/// | `gather_runs` | [`GatherRunsArgs`](args::GatherRunsArgs): refs, n, head_dim, dtype, out, run, stride: reference `i` to out row `(i / run) * stride + i % run` |
/// | `project` | [`ProjectArgs`](args::ProjectArgs): x, w (packed), y, t, e, o |
/// | `project_range` | [`ProjectRangeArgs`](args::ProjectRangeArgs): x, w, y, t, e, o, from, to, accumulate: steps `from..to` only, continuing `y` when accumulate is 1; `y` holds the projection's rows once `to == e` (before that, sums in a layout of the backend's own) |
/// | `gate` | [`GateArgs`](args::GateArgs): highway, kv, norm_q, norm_k, norm_conv, gated, xn, t, h, hc, eps |
/// | `gate_norms` | [`GateNormsArgs`](args::GateNormsArgs): highway, kv, norm_q, norm_k, norm_conv, gated, xn, t, h, hc, eps_q, eps_k, eps_conv, form (0 `1+w`, 1 `w`), conv (0: no `xn`) |
/// | `conv` | [`ConvArgs`](args::ConvArgs): xn, gated, state, w, highway, t, c, k, d |
/// | `conv_batch` | [`ConvBatchArgs`](args::ConvBatchArgs): xn, gated, states, w, highway, b, c, k, d |
/// | `bias_add` | [`BiasAddArgs`](args::BiasAddArgs): y, bias, t, o |
/// | `highway_add` | [`HighwayAddArgs`](args::HighwayAddArgs): highway, out, n |
/// | `mean_add` | [`MeanAddArgs`](args::MeanAddArgs): highway, value, n, divisor |
///
/// Errors ([`GpuError::Unsupported`]) when the backend runs no host kernels:
/// a device backend runs the device kernels of `kernels/ple.cu` instead,
/// which have the same names and take the same structs.
pub fn register_cpu_kernels(gpu: &dyn GpuBackend) -> Result<(), GpuError> {
    if !gpu.supports_host_kernels() {
        return Err(GpuError::unsupported(
            "register_cpu_kernels",
            format!("backend '{}' runs no host kernels", gpu.name()),
        ));
    }
    gpu.register_typed_host_kernel(MODULE, "gather", host::gather_kernel)?;
    gpu.register_typed_host_kernel(MODULE, "gather_runs", host::gather_runs_kernel)?;
    gpu.register_typed_host_kernel(MODULE, "project", host::project_kernel)?;
    gpu.register_typed_host_kernel(MODULE, "project_range", host::project_range_kernel)?;
    gpu.register_typed_host_kernel(MODULE, "gate", host::gate_kernel)?;
    gpu.register_typed_host_kernel(MODULE, "gate_norms", host::gate_norms_kernel)?;
    gpu.register_typed_host_kernel(MODULE, "bias_add", host::bias_add_kernel)?;
    gpu.register_typed_host_kernel(MODULE, "highway_add", host::highway_add_kernel)?;
    gpu.register_typed_host_kernel(MODULE, "mean_add", host::mean_add_kernel)?;
    gpu.register_typed_host_kernel(MODULE, "conv", host::conv_kernel)?;
    gpu.register_typed_host_kernel(MODULE, "conv_batch", host::conv_batch_kernel)?;
    Ok(())
}
