//! The CUDA backend, behind the `cuda` feature.
//!
//! This build carries no CUDA bindings yet: [`CudaBackend::new`] always fails
//! with "built without CUDA support", and every method of the (unreachable)
//! value answers the same error, so callers compile unchanged with or without
//! the feature and fall back to the CPU backend.

use std::sync::Arc;

use crate::error::{GpuError, Result};
use crate::gpu::{
    AllocationInfo, ArgKind, DevicePtr, EventHandle, GpuBackend, GraphHandle, HostKernelFn,
    HostMapped, KernelArg, KernelHandle, LaunchConfig, StreamId,
};

const NO_CUDA: &str = "built without CUDA support";

/// A CUDA device. Cannot be constructed in this build.
pub struct CudaBackend {
    _device: usize,
}

impl CudaBackend {
    /// Open CUDA device `device`. Always fails in this build, naming why.
    pub fn new(device: usize) -> Result<CudaBackend> {
        Err(GpuError::unsupported(
            format!("CudaBackend::new(device {device})"),
            NO_CUDA,
        ))
    }
}

macro_rules! no_cuda {
    ($op:expr) => {
        Err(GpuError::unsupported($op, NO_CUDA))
    };
}

impl GpuBackend for CudaBackend {
    fn name(&self) -> &str {
        "cuda"
    }
    fn alloc(&self, _bytes: usize, _label: &str) -> Result<DevicePtr> {
        no_cuda!("alloc")
    }
    fn dealloc(&self, _ptr: DevicePtr) -> Result<()> {
        no_cuda!("free")
    }
    fn alloc_host_mapped(&self, _bytes: usize, _label: &str) -> Result<HostMapped> {
        no_cuda!("alloc_host_mapped")
    }
    unsafe fn register_host(&self, _h: *mut u8, _bytes: usize, _label: &str) -> Result<DevicePtr> {
        no_cuda!("register_host")
    }
    fn memset(&self, _dst: DevicePtr, _v: u8, _bytes: usize) -> Result<()> {
        no_cuda!("memset")
    }
    fn memset_async(&self, _dst: DevicePtr, _v: u8, _bytes: usize, _s: StreamId) -> Result<()> {
        no_cuda!("memset_async")
    }
    fn copy_h2d(&self, _src: &[u8], _dst: DevicePtr) -> Result<()> {
        no_cuda!("copy_h2d")
    }
    fn copy_d2h(&self, _src: DevicePtr, _dst: &mut [u8]) -> Result<()> {
        no_cuda!("copy_d2h")
    }
    fn copy_d2d(&self, _src: DevicePtr, _dst: DevicePtr, _bytes: usize) -> Result<()> {
        no_cuda!("copy_d2d")
    }
    fn copy_h2d_async(&self, _src: &[u8], _dst: DevicePtr, _s: StreamId) -> Result<()> {
        no_cuda!("copy_h2d_async")
    }
    fn copy_d2h_on_stream(&self, _src: DevicePtr, _dst: &mut [u8], _s: StreamId) -> Result<()> {
        no_cuda!("copy_d2h_on_stream")
    }
    fn copy_d2d_async(&self, _s: DevicePtr, _d: DevicePtr, _b: usize, _st: StreamId) -> Result<()> {
        no_cuda!("copy_d2d_async")
    }
    fn create_stream(&self) -> Result<StreamId> {
        no_cuda!("create_stream")
    }
    fn destroy_stream(&self, _s: StreamId) -> Result<()> {
        no_cuda!("destroy_stream")
    }
    fn synchronize(&self, _s: StreamId) -> Result<()> {
        no_cuda!("synchronize")
    }
    fn create_event(&self) -> Result<EventHandle> {
        no_cuda!("create_event")
    }
    fn record_event(&self, _e: EventHandle, _s: StreamId) -> Result<()> {
        no_cuda!("record_event")
    }
    fn stream_wait_event(&self, _s: StreamId, _e: EventHandle) -> Result<()> {
        no_cuda!("stream_wait_event")
    }
    fn event_synchronize(&self, _e: EventHandle) -> Result<()> {
        no_cuda!("event_synchronize")
    }
    fn event_query(&self, _e: EventHandle) -> Result<bool> {
        no_cuda!("event_query")
    }
    fn destroy_event(&self, _e: EventHandle) -> Result<()> {
        no_cuda!("destroy_event")
    }
    fn begin_capture(&self, _s: StreamId) -> Result<()> {
        no_cuda!("begin_capture")
    }
    fn end_capture(&self, _s: StreamId) -> Result<GraphHandle> {
        no_cuda!("end_capture")
    }
    fn stream_is_capturing(&self, _s: StreamId) -> Result<bool> {
        no_cuda!("stream_is_capturing")
    }
    fn launch_graph(&self, _g: GraphHandle, _s: StreamId) -> Result<()> {
        no_cuda!("launch_graph")
    }
    fn destroy_graph(&self, _g: GraphHandle) -> Result<()> {
        no_cuda!("destroy_graph")
    }
    fn supports_host_kernels(&self) -> bool {
        false
    }
    fn register_host_kernel(
        &self,
        _m: &str,
        _n: &str,
        _sig: &[ArgKind],
        _body: Arc<HostKernelFn>,
    ) -> Result<()> {
        no_cuda!("register_host_kernel")
    }
    fn load_module(&self, _m: &str, _image: &[u8]) -> Result<()> {
        no_cuda!("load_module")
    }
    fn kernel(&self, _m: &str, _n: &str) -> Result<KernelHandle> {
        no_cuda!("kernel")
    }
    fn launch_kernel(
        &self,
        _k: KernelHandle,
        _cfg: LaunchConfig,
        _args: &[KernelArg],
        _s: StreamId,
    ) -> Result<()> {
        no_cuda!("launch_kernel")
    }
    fn live_bytes(&self) -> usize {
        0
    }
    fn live_alloc_count(&self) -> usize {
        0
    }
    fn live_allocations(&self) -> Vec<AllocationInfo> {
        Vec::new()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn construction_says_why_it_fails() {
        let e = CudaBackend::new(0).err().unwrap();
        assert!(matches!(e, GpuError::Unsupported { .. }), "{e:?}");
        assert_eq!(
            e.to_string(),
            "CudaBackend::new(device 0): built without CUDA support"
        );
    }

    #[test]
    fn every_call_answers_the_same_error() {
        let b = CudaBackend { _device: 0 };
        let g: &dyn GpuBackend = &b;
        let e = g.alloc(4, "x").unwrap_err().to_string();
        assert_eq!(e, "alloc: built without CUDA support");
        let e = g.synchronize(0).unwrap_err().to_string();
        assert_eq!(e, "synchronize: built without CUDA support");
        assert!(!g.supports_host_kernels());
        assert_eq!(g.live_alloc_count(), 0);
    }

    #[test]
    fn default_backend_falls_back_to_cpu() {
        assert_eq!(crate::default_backend().name(), "cpu");
    }
}
