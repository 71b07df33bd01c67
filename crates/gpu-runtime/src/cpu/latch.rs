//! A latch that holds a stream's queued work from the host until it opens.
//!
//! Asynchronous behaviour (work still queued when a call returns, a buffer
//! freed by earlier work before later work runs) can only be tested if the
//! test decides when queued work runs. A kernel that sleeps makes that a race
//! with the machine's speed; a latch kernel blocks its stream until the test
//! calls [`Latch::open`]. It gives up after [`Latch::BOUND`] with a kernel
//! error, so a test that fails before opening it ends instead of hanging on
//! a stream that never drains. Once open, a latch stays open.

use std::sync::{Arc, Condvar, Mutex, PoisonError};
use std::time::{Duration, Instant};

use crate::error::{GpuError, Result};
use crate::gpu::{GpuBackend, KernelHandle};

/// A one-way gate that host kernels wait on; see the module docs.
#[derive(Debug, Default)]
pub struct Latch {
    open: Mutex<bool>,
    cv: Condvar,
}

impl Latch {
    /// How long a latch kernel waits before it fails its stream.
    pub const BOUND: Duration = Duration::from_secs(60);

    /// A closed latch.
    pub fn new() -> Arc<Latch> {
        Arc::new(Latch::default())
    }

    /// Lets every kernel waiting on this latch, and every later one, run.
    pub fn open(&self) {
        *self.open.lock().unwrap_or_else(PoisonError::into_inner) = true;
        self.cv.notify_all();
    }

    /// Whether [`Latch::open`] has been called.
    pub fn is_open(&self) -> bool {
        *self.open.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Blocks until the latch opens, or fails after [`Latch::BOUND`].
    pub fn wait(&self) -> Result<()> {
        let t0 = Instant::now();
        let mut open = self.open.lock().unwrap_or_else(PoisonError::into_inner);
        while !*open {
            let Some(left) = Latch::BOUND.checked_sub(t0.elapsed()) else {
                return Err(GpuError::kernel(format!(
                    "latch not opened within {} s",
                    Latch::BOUND.as_secs()
                )));
            };
            open = self
                .cv
                .wait_timeout(open, left)
                .unwrap_or_else(PoisonError::into_inner)
                .0;
        }
        Ok(())
    }

    /// Registers `module::name` on `gpu`, a kernel without arguments that
    /// waits for this latch, and returns its handle. Only backends that run
    /// host kernels (the CPU backend) accept it.
    pub fn kernel(
        self: &Arc<Self>,
        gpu: &dyn GpuBackend,
        module: &str,
        name: &str,
    ) -> Result<KernelHandle> {
        let me = self.clone();
        gpu.register_host_kernel(module, name, &[], Arc::new(move |_, _, _| me.wait()))?;
        gpu.kernel(module, name)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cpu::CpuBackend;
    use crate::gpu::LaunchConfig;

    #[test]
    fn queued_work_waits_for_the_latch() {
        let cpu = CpuBackend::new();
        let gpu: &dyn GpuBackend = &cpu;
        let latch = Latch::new();
        let k = latch.kernel(gpu, "t", "hold").unwrap();
        let s = gpu.create_stream().unwrap();
        let p = gpu.alloc(4, "behind the latch").unwrap();
        gpu.launch(k, LaunchConfig::linear(1, 1)).run(s).unwrap();
        gpu.memset_async(p, 7, 4, s).unwrap();
        let ev = gpu.create_event().unwrap();
        gpu.record_event(ev, s).unwrap();
        std::thread::sleep(Duration::from_millis(20));
        assert!(
            !gpu.event_query(ev).unwrap(),
            "work ran past a closed latch"
        );
        latch.open();
        gpu.synchronize(s).unwrap();
        let mut out = [0u8; 4];
        gpu.copy_d2h(p, &mut out).unwrap();
        assert_eq!(out, [7; 4]);
        assert!(latch.is_open());
        gpu.destroy_event(ev).unwrap();
        gpu.destroy_stream(s).unwrap();
        gpu.dealloc(p).unwrap();
    }
}
