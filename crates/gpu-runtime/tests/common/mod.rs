//! What the CPU backend's integration tests share: small host kernels.

use std::sync::Arc;

use metrale_gpu_runtime::gpu::{ArgKind, GpuBackend, GpuError, KernelArg};

/// Register kernel `module::inc(p, n)`, which adds 1 to each of the `n`
/// bytes at `p`.
pub fn register_inc(gpu: &dyn GpuBackend, module: &str) {
    gpu.register_host_kernel(
        module,
        "inc",
        &[ArgKind::Ptr, ArgKind::U32],
        Arc::new(|m, _, a| {
            let (KernelArg::Ptr(p), KernelArg::U32(n)) = (a[0], a[1]) else {
                return Err(GpuError::kernel("bad arguments"));
            };
            // SAFETY: each test hands a buffer to one launch at a time.
            let b = unsafe { m.slice_mut::<u8>(p, n as usize)? };
            b.iter_mut().for_each(|x| *x = x.wrapping_add(1));
            Ok(())
        }),
    )
    .unwrap();
}
