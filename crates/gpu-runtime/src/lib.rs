//! metrale-gpu-runtime: the device layer of metrale-ple.
//!
//! [`gpu`] holds the backend-neutral [`gpu::GpuBackend`] trait and its
//! pointer, stream, event, graph and kernel types. Implementations live in
//! their own modules so that no caller needs `cfg`:
//! - [`cpu::CpuBackend`], a real backend on the host (always built);
//! - [`cuda::CudaBackend`], behind the `cuda` feature.
//!
//! Every call returns [`error::GpuError`], a typed error callers match on
//! (re-exported with its [`Result`] alias at the crate root); only
//! [`gpu::GpuBackend::free`] boxes it in `anyhow::Error`, for the reason
//! given there, beside the typed [`gpu::GpuBackend::dealloc`].
//!
//! The behaviour every backend must show lives in the separate
//! `metrale-gpu-conformance` crate, so each backend runs the same suite
//! without shipping it in release builds.

use std::sync::Arc;

#[cfg(feature = "bench")]
pub mod bench;
pub mod cpu;
#[cfg(feature = "cuda")]
pub mod cuda;
pub mod error;
pub mod gpu;

pub use error::{GpuError, Result};

/// The backend to use by default: CUDA device 0 when built with the `cuda`
/// feature and it can be opened, else a [`cpu::CpuBackend`].
pub fn default_backend() -> Arc<dyn gpu::GpuBackend> {
    #[cfg(feature = "cuda")]
    if let Ok(b) = cuda::CudaBackend::new(0) {
        return Arc::new(b);
    }
    Arc::new(cpu::CpuBackend::new())
}
