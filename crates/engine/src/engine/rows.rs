//! [`Highway`]: the rows an engine call runs, either host rows (a slice)
//! or rows already on the device, and the one path both take to the sites:
//! host rows are copied into the engine's staging rows, run there and
//! copied back; device rows are run where they are.
//!
//! Invariants: chunks of a call (prefill chunks, decode parts) address
//! their rows by offset, `rows * width * 4` bytes into a device highway, so
//! a step's outputs do not depend on where its rows live; a call on device
//! rows synchronises the engine's stream before it returns, as a call on
//! host rows does, so a failed step is found (and its carries lost) by the
//! call that ran it; decode graphs are captured on the staging rows, so a
//! replayed step on device rows copies them in and out on the device.

use metrale_gpu_runtime::gpu::{DevicePtr, GpuBackend, StreamId};
use metrale_model_layers::layers::ple::highway;

use super::{EngineError, Result};

/// The highway rows of an engine call (`[T, width]` f32, one row per token
/// or per sequence of a batch), in and out.
///
/// Host rows (`&mut [f32]`, `&mut Vec<f32>`, converted by `From`) are
/// checked against the call's tokens and copied through the engine's own
/// device rows at every call. Device rows are not copied: the caller
/// guarantees that the pointer holds `T * width` f32 values on the
/// engine's backend ([`super::Engine::gpu`]), written before the call on the
/// engine's stream (or synchronised), and not touched by other work while
/// the call runs. Only a null pointer can be refused. Outputs are the same
/// bits either way. A refused call leaves the rows as they were; a step
/// that fails on the device leaves host rows as they were and device rows
/// unspecified (the carries it ran are lost either way).
#[derive(Debug)]
pub enum Highway<'a> {
    /// Rows in host memory.
    Host(&'a mut [f32]),
    /// Rows at this device address.
    Device(DevicePtr),
}

impl<'a> From<&'a mut [f32]> for Highway<'a> {
    fn from(rows: &'a mut [f32]) -> Self {
        Highway::Host(rows)
    }
}

impl<'a> From<&'a mut Vec<f32>> for Highway<'a> {
    fn from(rows: &'a mut Vec<f32>) -> Self {
        Highway::Host(rows.as_mut_slice())
    }
}

impl<'a, const N: usize> From<&'a mut [f32; N]> for Highway<'a> {
    fn from(rows: &'a mut [f32; N]) -> Self {
        Highway::Host(rows.as_mut_slice())
    }
}

impl From<DevicePtr> for Highway<'_> {
    fn from(rows: DevicePtr) -> Self {
        Highway::Device(rows)
    }
}

impl Highway<'_> {
    /// Rows `from..from + n` of rows of `width` values.
    pub(super) fn rows(&mut self, from: usize, n: usize, width: usize) -> Highway<'_> {
        match self {
            Highway::Host(r) => Highway::Host(&mut r[from * width..(from + n) * width]),
            Highway::Device(p) => Highway::Device(p.offset(from * width * 4)),
        }
    }

    /// Refuse rows that cannot be the `tokens` rows of `width` values: a
    /// host slice of another length, a null device pointer.
    pub(super) fn check(&self, op: &'static str, tokens: usize, width: usize) -> Result<()> {
        match self {
            Highway::Host(r) if r.len() != tokens * width => Err(EngineError::HighwaySize {
                op,
                rows: r.len(),
                tokens,
                width,
            }),
            Highway::Device(p) if p.is_null() && tokens > 0 => {
                Err(EngineError::NullHighway { op, tokens })
            }
            _ => Ok(()),
        }
    }

    /// A copy of the first `n` rows of `width` values on the host (device
    /// rows are read after the work queued on `stream`).
    pub(super) fn to_host(
        &self,
        n: usize,
        width: usize,
        gpu: &dyn GpuBackend,
        stream: StreamId,
    ) -> Result<Vec<f32>> {
        match self {
            Highway::Host(r) => Ok(r[..n * width].to_vec()),
            Highway::Device(p) => {
                let mut v = vec![0f32; n * width];
                gpu.copy_d2h_on_stream(*p, highway::f32_bytes_mut(&mut v), stream)
                    .map_err(|e| EngineError::device("reading the device highway rows", e))?;
                Ok(v)
            }
        }
    }
}

/// Run `work` on the device address of `rows`: host rows through the
/// staging rows `staging`; device rows in place, then `stream`
/// synchronised, so a failure of the queued work is this call's.
pub(super) fn run_on<T>(
    gpu: &dyn GpuBackend,
    staging: DevicePtr,
    stream: StreamId,
    rows: Highway<'_>,
    work: impl FnOnce(DevicePtr) -> Result<T>,
) -> Result<T> {
    match rows {
        Highway::Host(r) => highway::on_device(gpu, staging, r, stream, copy_err, work),
        Highway::Device(p) => {
            let out = work(p)?;
            finish(gpu, stream)?;
            Ok(out)
        }
    }
}

/// [`run_on`] for work that must run on the staging rows (a decode graph
/// captured on them): device rows, `n` rows of `width` values, are copied
/// into `staging` and back on the device.
pub(super) fn run_staged<T>(
    gpu: &dyn GpuBackend,
    staging: DevicePtr,
    stream: StreamId,
    rows: Highway<'_>,
    (n, width): (usize, usize),
    work: impl FnOnce(DevicePtr) -> Result<T>,
) -> Result<T> {
    match rows {
        Highway::Host(r) => highway::on_device(gpu, staging, r, stream, copy_err, work),
        Highway::Device(p) => {
            let bytes = n * width * 4;
            gpu.copy_d2d_async(p, staging, bytes, stream)
                .map_err(|e| copy_err("copying the device highway rows in", e))?;
            let out = work(staging)?;
            gpu.copy_d2d_async(staging, p, bytes, stream)
                .map_err(|e| copy_err("copying the device highway rows out", e))?;
            finish(gpu, stream)?;
            Ok(out)
        }
    }
}

fn copy_err(what: &'static str, e: metrale_gpu_runtime::GpuError) -> EngineError {
    EngineError::device(what, e)
}

fn finish(gpu: &dyn GpuBackend, stream: StreamId) -> Result<()> {
    gpu.synchronize(stream)
        .map_err(|e| EngineError::device("synchronising the device highway rows", e))
}
