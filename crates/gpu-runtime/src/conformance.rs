//! The conformance suite: behaviour every [`GpuBackend`] must show.
//!
//! Each case is a function over `&dyn GpuBackend` returning `Result<()>`.
