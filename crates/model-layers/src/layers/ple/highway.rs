//! Highway rows held on the host, run through a device buffer: the
//! host-slice convenience over the calls that take the highway as a device
//! pointer (the layer's `run`, `forward`, `forward_batch`). The engine and
//! the Python binding copy rows in and out through this one helper.
//!
//! Invariant: the copies are queued on the call's stream around the work,
//! and the copy out waits for that stream, so `rows` holds the result when
//! it returns.

use metrale_gpu_runtime::gpu::{DevicePtr, GpuBackend, GpuError, StreamId};

/// `rows` as bytes.
pub fn f32_bytes(rows: &[f32]) -> &[u8] {
    // SAFETY: f32 has no padding and u8 has alignment 1; the view covers
    // exactly the slice's memory and borrows it immutably.
    unsafe { std::slice::from_raw_parts(rows.as_ptr().cast::<u8>(), std::mem::size_of_val(rows)) }
}

/// `rows` as writable bytes.
pub fn f32_bytes_mut(rows: &mut [f32]) -> &mut [u8] {
    // SAFETY: as in `f32_bytes`; every byte pattern is a valid f32, so
    // writes through the view cannot create an invalid value.
    unsafe {
        std::slice::from_raw_parts_mut(rows.as_mut_ptr().cast::<u8>(), std::mem::size_of_val(rows))
    }
}

/// Copy `rows` into the device buffer `buf` (room for them), run `work`
/// on it, and copy the rows back, all on `stream`. A failed copy is mapped
/// by `copy_err` (told which way it went); a failed `work` is returned as
/// is and the rows are left as they were.
pub fn on_device<T, E>(
    gpu: &dyn GpuBackend,
    buf: DevicePtr,
    rows: &mut [f32],
    stream: StreamId,
    copy_err: impl Fn(&'static str, GpuError) -> E,
    work: impl FnOnce(DevicePtr) -> Result<T, E>,
) -> Result<T, E> {
    gpu.copy_h2d_async(f32_bytes(rows), buf, stream)
        .map_err(|e| copy_err("copying the highway rows in", e))?;
    let out = work(buf)?;
    gpu.copy_d2h_on_stream(buf, f32_bytes_mut(rows), stream)
        .map_err(|e| copy_err("copying the highway rows out", e))?;
    Ok(out)
}
