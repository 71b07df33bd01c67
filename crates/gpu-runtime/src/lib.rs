//! metrale-gpu-runtime: the device layer of metrale-ple.
//!
//! [`gpu`] holds the backend-neutral [`gpu::GpuBackend`] trait and its
//! pointer, stream, event, graph and kernel types. Implementations live in
//! their own modules so that no caller needs `cfg`.

pub mod gpu;
