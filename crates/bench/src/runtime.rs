//! Benchmark workloads of the device runtime, shared by
//! `cargo bench --bench launch` and `metrale-ple bench`.
//!
//! A workload is set up from its sizes, exposes the measured operation as
//! [`CopyD2d::run`] and its same-run baseline as [`CopyD2d::baseline`];
//! the caller does the timing. Invariants: both methods move the same number
//! of bytes ([`CopyD2d::bytes`]); every device allocation and stream the
//! workload made is freed by [`CopyD2d::close`], or on drop (errors then
//! ignored).

use std::hint::black_box;

use metrale_gpu_runtime::Result;
use metrale_gpu_runtime::gpu::{DevicePtr, GpuBackend, StreamId};

/// A host `memcpy` (`copy_from_slice`) between two touched buffers of one
/// size: the baseline that copies of the same bytes (device copies, carry
/// swaps) are measured beside.
pub struct HostMemcpy {
    src: Vec<u8>,
    dst: Vec<u8>,
}

impl HostMemcpy {
    /// Two buffers of `n` bytes, the source filled with `fill`.
    pub fn new(n: usize, fill: u8) -> HostMemcpy {
        HostMemcpy {
            src: vec![fill; n],
            dst: vec![0u8; n],
        }
    }

    /// Bytes one [`run`](Self::run) copies.
    pub fn bytes(&self) -> usize {
        self.src.len()
    }

    /// One copy.
    pub fn run(&mut self) {
        self.dst.copy_from_slice(black_box(&self.src));
        black_box(&mut self.dst);
    }
}

/// `copy_d2d_async` of `n` bytes plus `synchronize`, against a
/// [`HostMemcpy`] of the same bytes.
pub struct CopyD2d<'a> {
    gpu: &'a dyn GpuBackend,
    n: usize,
    host: HostMemcpy,
    /// Device source and destination, and the stream; `None` once freed.
    dev: Option<(DevicePtr, DevicePtr, StreamId)>,
}

impl<'a> CopyD2d<'a> {
    /// Allocate two device buffers of `n` bytes (the source filled, the
    /// destination zeroed), a stream, and two host buffers for the baseline.
    pub fn new(gpu: &'a dyn GpuBackend, n: usize) -> Result<Self> {
        let host = HostMemcpy::new(n, 7);
        let a = gpu.alloc(n, "bench d2d src")?;
        let b = match gpu.alloc(n, "bench d2d dst") {
            Ok(b) => b,
            Err(e) => {
                let _ = gpu.dealloc(a);
                return Err(e);
            }
        };
        let stream = gpu.create_stream().and_then(|s| {
            gpu.copy_h2d(&host.src, a)
                .and_then(|()| gpu.memset(b, 0, n))
                .map(|()| s)
                .inspect_err(|_| {
                    let _ = gpu.destroy_stream(s);
                })
        });
        let s = match stream {
            Ok(s) => s,
            Err(e) => {
                let _ = gpu.dealloc(a);
                let _ = gpu.dealloc(b);
                return Err(e);
            }
        };
        Ok(CopyD2d {
            gpu,
            n,
            host,
            dev: Some((a, b, s)),
        })
    }

    /// Bytes moved by one [`run`](Self::run) or [`baseline`](Self::baseline).
    pub fn bytes(&self) -> usize {
        self.n
    }

    /// The measured operation: one device-to-device copy and a synchronize.
    pub fn run(&mut self) -> Result<()> {
        let Some((a, b, s)) = self.dev else {
            return Err(metrale_gpu_runtime::GpuError::invalid(
                "bench copy_d2d",
                "the workload was closed",
            ));
        };
        self.gpu.copy_d2d_async(a, b, self.n, s)?;
        self.gpu.synchronize(s)
    }

    /// The baseline: `memcpy` of the same bytes on the host.
    pub fn baseline(&mut self) {
        self.host.run();
    }

    /// Free the device buffers and the stream; the first error wins.
    pub fn close(mut self) -> Result<()> {
        self.free()
    }

    fn free(&mut self) -> Result<()> {
        let Some((a, b, s)) = self.dev.take() else {
            return Ok(());
        };
        let r = self.gpu.dealloc(a);
        let r = r.and(self.gpu.dealloc(b));
        r.and(self.gpu.destroy_stream(s))
    }
}

impl Drop for CopyD2d<'_> {
    fn drop(&mut self) {
        let _ = self.free();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use metrale_gpu_runtime::cpu::CpuBackend;

    #[test]
    fn copies_and_frees_everything() {
        let cpu = CpuBackend::new();
        let mut w = CopyD2d::new(&cpu, 4096).unwrap();
        w.run().unwrap();
        w.baseline();
        assert_eq!(w.bytes(), 4096);
        w.close().unwrap();
        assert_eq!(cpu.live_alloc_count(), 0);
    }
}
