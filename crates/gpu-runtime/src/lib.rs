//! metrale-gpu-runtime: the device layer of metrale-ple.
//!
//! [`gpu`] holds the backend-neutral [`gpu::GpuBackend`] trait and its
//! pointer, stream, event, graph and kernel types; [`args`] the typed
//! kernel argument structs ([`kernel_args!`]). Implementations live in
//! their own modules so that no caller needs `cfg`:
//! - [`cpu::CpuBackend`], a real backend on the host (always built);
//! - [`cuda::CudaBackend`], behind the `cuda` feature.
//!
//! Every call returns [`error::GpuError`], a typed error callers match on
//! (re-exported with its [`Result`] alias at the crate root). Backends
//! free memory through [`gpu::GpuBackend::dealloc`] alone; the `free`
//! method of `dyn GpuBackend` boxes its error in `anyhow::Error`, for the
//! reason given there.
//!
//! The behaviour every backend must show lives in the separate
//! `metrale-gpu-conformance` crate, so each backend runs the same suite
//! without shipping it in release builds.

use std::sync::Arc;

pub mod args;
pub mod cpu;
#[cfg(feature = "cuda")]
pub mod cuda;
pub mod error;
pub mod gpu;
mod ledger_core;

pub use error::{GpuError, Result};

/// Compile CUDA C++ `source` (named `file` in errors) into a module image
/// that `gpu` loads with [`gpu::GpuBackend::load_module`].
///
/// The backend-neutral way for a layer to bring its device kernels: on the
/// CUDA backend the source is compiled to PTX with NVRTC (through the
/// on-disk cache of [`cuda::nvrtc`]) for the lowest compute capability of
/// the devices present, which the driver compiles for the device at load.
/// Any other backend, or a build without the `cuda` feature, gets
/// [`GpuError::Unsupported`] naming why.
pub fn compile_source(gpu: &dyn gpu::GpuBackend, file: &str, source: &str) -> Result<Vec<u8>> {
    let op = format!("compile {file} for the {} backend", gpu.name());
    #[cfg(feature = "cuda")]
    if gpu.name() == "cuda" {
        let arch = cuda::lowest_arch(&op)?;
        return cuda::nvrtc::compile_ptx_cached(file, source, arch).map(String::into_bytes);
    }
    #[cfg(not(feature = "cuda"))]
    if gpu.name() == "cuda" {
        return Err(GpuError::unsupported(
            op,
            "built without the `cuda` feature: no CUDA C++ compiler is linked",
        ));
    }
    let _ = source;
    Err(GpuError::unsupported(
        op,
        "this backend loads no device code compiled from CUDA C++",
    ))
}

/// The backend to use by default: CUDA device 0 when built with the `cuda`
/// feature and it can be opened, else a [`cpu::CpuBackend`].
pub fn default_backend() -> Arc<dyn gpu::GpuBackend> {
    #[cfg(feature = "cuda")]
    if let Ok(b) = cuda::CudaBackend::new(0) {
        return Arc::new(b);
    }
    Arc::new(cpu::CpuBackend::new())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn compile_source_is_unsupported_on_the_cpu_backend() {
        let cpu = cpu::CpuBackend::new();
        let e = compile_source(&cpu, "k.cu", "extern \"C\" __global__ void k() {}").unwrap_err();
        assert!(matches!(e, GpuError::Unsupported { .. }), "{e:?}");
        assert!(e.to_string().contains("k.cu"), "{e}");
    }
}
