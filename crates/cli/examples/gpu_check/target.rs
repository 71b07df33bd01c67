//! What stands in the device's place: a maker of fresh backends on it and
//! how to describe and size the run.

use std::sync::Arc;

use metrale_gpu_runtime::gpu::GpuBackend;

/// What stands in the device's place.
pub struct Target {
    /// A fresh backend on the device.
    pub make: Box<dyn Fn() -> Arc<dyn GpuBackend>>,
    /// A description for the report.
    pub name: String,
    /// Whether this is the CPU stand-in.
    pub stand_in: bool,
    /// Small sizes.
    pub quick: bool,
}
