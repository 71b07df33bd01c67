//! Ordering of `copy_h2d_async` on the CPU backend, whose copy may run on
//! the calling thread when its stream is idle: it must never overtake work
//! queued before it on the same stream (directly, or behind a
//! `stream_wait_event`), work queued after it must see its bytes, and the
//! caller's buffer is free for reuse once the call returns.

mod common;

use std::sync::Arc;

use metrale_gpu_runtime::cpu::{CpuBackend, Latch};
use metrale_gpu_runtime::gpu::{GpuBackend, GpuError, LaunchConfig};

/// A backend with kernel `t::gate` (waits for `gate`) and `t::inc` (adds 1
/// to each of `n` bytes at a pointer).
fn backend(gate: &Arc<Latch>) -> CpuBackend {
    let gpu = CpuBackend::new_debug();
    gate.kernel(&gpu, "t", "gate").unwrap();
    common::register_inc(&gpu, "t");
    gpu
}

fn read(gpu: &dyn GpuBackend, p: metrale_gpu_runtime::gpu::DevicePtr, n: usize) -> Vec<u8> {
    let mut out = vec![0u8; n];
    gpu.copy_d2h(p, &mut out).unwrap();
    out
}

#[test]
fn h2d_behind_queued_work_waits_its_turn() {
    let gate = Latch::new();
    let cpu = backend(&gate);
    let gpu: &dyn GpuBackend = &cpu;
    let n = 4096;
    let dst = gpu.alloc(n, "dst").unwrap();
    gpu.memset(dst, 0, n).unwrap();
    let s = gpu.create_stream().unwrap();
    let k = gpu.kernel("t", "gate").unwrap();
    gpu.launch(k, LaunchConfig::linear(1, 1)).run(s).unwrap();
    gpu.memset_async(dst, 0xaa, n, s).unwrap();
    gpu.copy_h2d_async(&vec![0x55; n], dst, s).unwrap();
    // Nothing on `s` may have run while the gate is shut (the synchronous
    // read waits for the default stream only). Open it before asserting,
    // so a failure does not leave the worker blocked.
    let early = read(gpu, dst, n);
    gate.open();
    assert_eq!(early, vec![0; n], "the copy overtook the gated kernel");
    gpu.synchronize(s).unwrap();
    assert_eq!(
        read(gpu, dst, n),
        vec![0x55; n],
        "the copy ran before the memset"
    );
    gpu.destroy_stream(s).unwrap();
    gpu.dealloc(dst).unwrap();
}

#[test]
fn h2d_behind_an_event_wait_waits_for_the_event() {
    let gate = Latch::new();
    let cpu = backend(&gate);
    let gpu: &dyn GpuBackend = &cpu;
    let n = 1000;
    let dst = gpu.alloc(n, "dst").unwrap();
    let (a, b) = (gpu.create_stream().unwrap(), gpu.create_stream().unwrap());
    let ev = gpu.create_event().unwrap();
    let k = gpu.kernel("t", "gate").unwrap();
    gpu.launch(k, LaunchConfig::linear(1, 1)).run(a).unwrap();
    gpu.memset_async(dst, 0xaa, n, a).unwrap();
    gpu.record_event(ev, a).unwrap();
    // `b` has queued nothing but the wait: it is not idle.
    gpu.stream_wait_event(b, ev).unwrap();
    gpu.copy_h2d_async(&vec![0x55; n], dst, b).unwrap();
    let early = gpu.event_query(ev).unwrap();
    gate.open();
    assert!(!early);
    gpu.synchronize(b).unwrap();
    assert_eq!(
        read(gpu, dst, n),
        vec![0x55; n],
        "the copy ignored the wait"
    );
    gpu.synchronize(a).unwrap();
    gpu.destroy_event(ev).unwrap();
    gpu.destroy_stream(a).unwrap();
    gpu.destroy_stream(b).unwrap();
    gpu.dealloc(dst).unwrap();
}

#[test]
fn h2d_on_an_idle_stream_is_seen_by_later_work_and_owns_its_source() {
    let gate = Latch::new();
    gate.open();
    let cpu = backend(&gate);
    let gpu: &dyn GpuBackend = &cpu;
    let n = 300;
    let (x, y) = (gpu.alloc(n, "x").unwrap(), gpu.alloc(n, "y").unwrap());
    let inc = gpu.kernel("t", "inc").unwrap();
    for s in [0, gpu.create_stream().unwrap()] {
        let mut src: Vec<u8> = (0..n).map(|i| i as u8).collect();
        gpu.synchronize(s).unwrap();
        gpu.copy_h2d_async(&src, x, s).unwrap();
        // The call took the bytes: changing them now changes nothing.
        src.fill(0xee);
        gpu.copy_d2d_async(x, y, n, s).unwrap();
        gpu.launch(inc, LaunchConfig::linear(1, 1))
            .ptr(y)
            .u32(n as u32)
            .run(s)
            .unwrap();
        // Queued behind the kernel this time, and still in order.
        gpu.copy_h2d_async(&vec![9; n], x, s).unwrap();
        let mut out = vec![0u8; n];
        gpu.copy_d2h_on_stream(y, &mut out, s).unwrap();
        let want: Vec<u8> = (0..n).map(|i| (i as u8).wrapping_add(1)).collect();
        assert_eq!(out, want, "stream {s}");
        gpu.copy_d2h_on_stream(x, &mut out, s).unwrap();
        assert_eq!(out, vec![9; n], "stream {s}");
        if s != 0 {
            gpu.destroy_stream(s).unwrap();
        }
    }
    gpu.dealloc(x).unwrap();
    gpu.dealloc(y).unwrap();
}

#[test]
fn h2d_under_capture_is_still_refused() {
    let cpu = CpuBackend::new();
    let gpu: &dyn GpuBackend = &cpu;
    let dst = gpu.alloc(64, "dst").unwrap();
    gpu.memset(dst, 0, 64).unwrap();
    let s = gpu.create_stream().unwrap();
    gpu.begin_capture(s).unwrap();
    let e = gpu.copy_h2d_async(&[1; 64], dst, s).unwrap_err();
    assert!(matches!(e, GpuError::CaptureViolation { .. }), "{e}");
    assert!(matches!(
        gpu.end_capture(s),
        Err(GpuError::CaptureInvalidated { .. })
    ));
    // Nothing was written.
    assert_eq!(read(gpu, dst, 64), vec![0; 64]);
    gpu.destroy_stream(s).unwrap();
    gpu.dealloc(dst).unwrap();
}
