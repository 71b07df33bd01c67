//! Unit tests of the CPU backend's own behaviour (debug fill, worker
//! threads, deadlock refusal); the backend-neutral behaviour is in
//! `conformance` and runs from `tests/conformance.rs`.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use super::*;
use crate::gpu::{ArgKind, GpuBackend, HostMemory, KernelArg, LaunchConfig};

fn f32s(b: &[u8]) -> Vec<f32> {
    b.chunks_exact(4)
        .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
        .collect()
}

#[test]
fn debug_mode_fills_new_allocations_with_nan() {
    let gpu = CpuBackend::new_debug();
    assert!(gpu.is_debug());
    let p = gpu.alloc(16, "fresh").unwrap();
    let mut out = [0u8; 16];
    gpu.copy_d2h(p, &mut out).unwrap();
    assert!(f32s(&out).iter().all(|v| v.is_nan()));
    let m = gpu.alloc_host_mapped(8, "mapped").unwrap();
    // SAFETY: `m.host` has 8 initialised bytes owned by the backend.
    let host = unsafe { std::slice::from_raw_parts(m.host, 8) };
    assert_eq!(host, &[0xFF; 8]);
    gpu.dealloc(p).unwrap();
    gpu.dealloc(m.device).unwrap();

    // What `new()` builds unless METRALE_GPU_DEBUG=1.
    let gpu = CpuBackend::build(false);
    assert!(!gpu.is_debug());
    let want = std::env::var_os("METRALE_GPU_DEBUG").is_some_and(|v| v == "1");
    assert_eq!(CpuBackend::new().is_debug(), want);
    let p = gpu.alloc(16, "fresh").unwrap();
    gpu.copy_d2h(p, &mut out).unwrap();
    assert_eq!(out, [0; 16]);
    gpu.dealloc(p).unwrap();
}

#[test]
fn synchronising_from_inside_a_kernel_is_refused_not_deadlocked() {
    let gpu = Arc::new(CpuBackend::new());
    let inner = Arc::downgrade(&gpu);
    let seen = Arc::new(Mutex::new(String::new()));
    let seen2 = seen.clone();
    gpu.register_host_kernel(
        "t",
        "sync_inside",
        &[],
        Arc::new(
            move |_m: &dyn HostMemory, _c: &LaunchConfig, _a: &[KernelArg]| {
                let g = inner.upgrade().unwrap();
                let e = g.synchronize(0).unwrap_err();
                *seen2.lock() = e.to_string();
                Ok(())
            },
        ),
    )
    .unwrap();
    let k = gpu.kernel("t", "sync_inside").unwrap();
    gpu.launch_kernel(k, LaunchConfig::linear(1, 1), &[], 0)
        .unwrap();
    gpu.synchronize(0).unwrap();
    let s = seen.lock().clone();
    assert!(
        s.contains("synchronize: called from inside a queued operation"),
        "{s}"
    );
}

#[test]
fn free_waits_for_queued_work_that_uses_the_buffer() {
    let gpu = CpuBackend::new();
    let release = Arc::new(AtomicBool::new(false));
    let r2 = release.clone();
    gpu.register_host_kernel(
        "t",
        "gate",
        &[ArgKind::Ptr],
        Arc::new(
            move |m: &dyn HostMemory, _c: &LaunchConfig, a: &[KernelArg]| {
                while !r2.load(Ordering::Acquire) {
                    std::thread::sleep(Duration::from_millis(1));
                }
                let KernelArg::Ptr(p) = a[0] else {
                    unreachable!()
                };
                // SAFETY: sole user of these 4 bytes while the kernel runs.
                let s = unsafe { m.slice_mut::<u32>(p, 1)? };
                s[0] = 7;
                Ok(())
            },
        ),
    )
    .unwrap();
    let s = gpu.create_stream().unwrap();
    let p = gpu.alloc(4, "gated").unwrap();
    let k = gpu.kernel("t", "gate").unwrap();
    gpu.launch_kernel(k, LaunchConfig::linear(1, 1), &[KernelArg::Ptr(p)], s)
        .unwrap();
    let r3 = release.clone();
    let t = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(50));
        r3.store(true, Ordering::Release);
    });
    // Returns only after the kernel has run, so the kernel never sees a
    // freed buffer and the stream has no pending error.
    gpu.dealloc(p).unwrap();
    assert!(release.load(Ordering::Acquire));
    t.join().unwrap();
    gpu.synchronize(s).unwrap();
    gpu.destroy_stream(s).unwrap();
    assert_eq!(gpu.live_alloc_count(), 0);
}

#[test]
fn destroying_a_stream_reports_its_pending_error() {
    let gpu = CpuBackend::new();
    let s = gpu.create_stream().unwrap();
    let p = gpu.alloc(8, "short-lived").unwrap();
    gpu.memset_async(p, 1, 8, s).unwrap();
    gpu.synchronize(s).unwrap();
    // Make the queued op fail at execution: a kernel that frees nothing but
    // errors.
    gpu.register_host_kernel(
        "t",
        "fail",
        &[],
        Arc::new(|_m: &dyn HostMemory, _c: &LaunchConfig, _a: &[KernelArg]| {
            Err(GpuError::kernel("deliberate failure"))
        }),
    )
    .unwrap();
    let k = gpu.kernel("t", "fail").unwrap();
    gpu.launch_kernel(k, LaunchConfig::linear(1, 1), &[], s)
        .unwrap();
    let e = gpu.destroy_stream(s).unwrap_err();
    assert!(
        matches!(&e, GpuError::Stream { op, stream, .. } if op == "destroy_stream" && *stream == s),
        "{e:?}"
    );
    assert!(
        matches!(e.root(), GpuError::Kernel { message } if message == "deliberate failure"),
        "{e}"
    );
    let e = gpu.synchronize(s).unwrap_err();
    assert!(matches!(e, GpuError::UnknownStream { .. }), "{e}");
    gpu.dealloc(p).unwrap();
}

#[test]
fn drop_runs_queued_work_and_joins_workers() {
    let done = Arc::new(AtomicBool::new(false));
    let d2 = done.clone();
    {
        let gpu = CpuBackend::new();
        gpu.register_host_kernel(
            "t",
            "slow",
            &[],
            Arc::new(
                move |_m: &dyn HostMemory, _c: &LaunchConfig, _a: &[KernelArg]| {
                    std::thread::sleep(Duration::from_millis(30));
                    d2.store(true, Ordering::Release);
                    Ok(())
                },
            ),
        )
        .unwrap();
        let s = gpu.create_stream().unwrap();
        let k = gpu.kernel("t", "slow").unwrap();
        gpu.launch_kernel(k, LaunchConfig::linear(1, 1), &[], s)
            .unwrap();
    }
    assert!(done.load(Ordering::Acquire));
}

#[test]
fn kernel_panics_become_stream_errors() {
    let gpu = CpuBackend::new();
    gpu.register_host_kernel(
        "t",
        "boom",
        &[],
        Arc::new(|_m: &dyn HostMemory, _c: &LaunchConfig, _a: &[KernelArg]| panic!("kaboom")),
    )
    .unwrap();
    let k = gpu.kernel("t", "boom").unwrap();
    gpu.launch_kernel(k, LaunchConfig::linear(1, 1), &[], 0)
        .unwrap();
    let e = gpu.synchronize(0).unwrap_err().to_string();
    assert!(
        e.contains("launch_kernel on stream 0 t::boom panicked: kaboom"),
        "{e}"
    );
    gpu.synchronize(0).unwrap();
}

/// Registers `t::free_arg`, a kernel that frees its pointer argument through
/// the backend, as a concurrent host thread could at any time.
fn register_freeing_kernel(gpu: &Arc<CpuBackend>) -> KernelHandle {
    let weak = Arc::downgrade(gpu);
    gpu.register_host_kernel(
        "t",
        "free_arg",
        &[ArgKind::U64],
        Arc::new(
            move |_m: &dyn HostMemory, _c: &LaunchConfig, a: &[KernelArg]| {
                let KernelArg::U64(p) = a[0] else {
                    unreachable!()
                };
                weak.upgrade().unwrap().dealloc(DevicePtr(p))
            },
        ),
    )
    .unwrap();
    gpu.kernel("t", "free_arg").unwrap()
}

#[test]
fn pointers_are_checked_again_when_the_operation_runs() {
    let gpu = Arc::new(CpuBackend::new_debug());
    let kfree = register_freeing_kernel(&gpu);
    gpu.register_host_kernel(
        "t",
        "read",
        &[ArgKind::Ptr],
        Arc::new(|m: &dyn HostMemory, _c: &LaunchConfig, a: &[KernelArg]| {
            let KernelArg::Ptr(p) = a[0] else {
                unreachable!()
            };
            m.host_ptr(p, 4).map(drop)
        }),
    )
    .unwrap();
    let kread = gpu.kernel("t", "read").unwrap();
    // The stream's worker runs as soon as work is queued, so without a latch
    // the free could run before the next submission is checked, and that
    // submission, not its execution, would be refused.
    let (first, second) = (Latch::new(), Latch::new());
    let khold1 = first.kernel(&*gpu, "t", "hold1").unwrap();
    let khold2 = second.kernel(&*gpu, "t", "hold2").unwrap();
    let s = gpu.create_stream().unwrap();
    let x = gpu.alloc(64, "victim").unwrap();
    let y = gpu.alloc(64, "bystander").unwrap();
    // Both submissions are valid when queued; the buffer is gone by the time
    // they run.
    gpu.launch_kernel(khold1, LaunchConfig::linear(1, 1), &[], s)
        .unwrap();
    gpu.launch_kernel(kfree, LaunchConfig::linear(1, 1), &[KernelArg::U64(x.0)], s)
        .unwrap();
    gpu.memset_async(x, 1, 64, s).unwrap();
    first.open();
    let e = gpu.synchronize(s).unwrap_err().to_string();
    assert!(
        e.contains(&format!("memset_async on stream {s}: use after free: {x}"))
            && e.contains("'victim'"),
        "{e}"
    );
    gpu.launch_kernel(khold2, LaunchConfig::linear(1, 1), &[], s)
        .unwrap();
    gpu.launch_kernel(kfree, LaunchConfig::linear(1, 1), &[KernelArg::U64(y.0)], s)
        .unwrap();
    gpu.launch_kernel(kread, LaunchConfig::linear(1, 1), &[KernelArg::Ptr(y)], s)
        .unwrap();
    second.open();
    let e = gpu.synchronize(s).unwrap_err().to_string();
    assert!(
        e.contains("t::read: argument 0: use after free") && e.contains("'bystander'"),
        "{e}"
    );
    assert_eq!(gpu.live_alloc_count(), 0);
    gpu.destroy_stream(s).unwrap();
}

#[test]
fn host_ptr_translates_inside_kernels_and_refuses_outside() {
    let gpu = CpuBackend::new();
    let (tx, rx) = crossbeam_channel::unbounded::<String>();
    gpu.register_host_kernel(
        "t",
        "probe",
        &[ArgKind::Ptr],
        Arc::new(
            move |m: &dyn HostMemory, _c: &LaunchConfig, a: &[KernelArg]| {
                let KernelArg::Ptr(p) = a[0] else {
                    unreachable!()
                };
                let ok = m.host_ptr(p.offset(8), 8)?;
                // SAFETY: 8 checked bytes, this kernel is their only user.
                unsafe { std::ptr::write_bytes(ok, 0x33, 8) };
                tx.send(m.host_ptr(p.offset(8), 9).unwrap_err().to_string())
                    .unwrap();
                // SAFETY: read-only view of 16 checked bytes; the mutable
                // pointer above is no longer used.
                let misaligned = unsafe { m.slice::<u32>(p.offset(1), 2) };
                tx.send(misaligned.unwrap_err().to_string()).unwrap();
                Ok(())
            },
        ),
    )
    .unwrap();
    let p = gpu.alloc(16, "probe target").unwrap();
    let k = gpu.kernel("t", "probe").unwrap();
    gpu.launch_kernel(k, LaunchConfig::linear(1, 1), &[KernelArg::Ptr(p)], 0)
        .unwrap();
    gpu.synchronize(0).unwrap();
    let oob = rx.recv().unwrap();
    assert!(
        oob.contains("launch_kernel on stream 0 t::probe: 9 bytes at")
            && oob.contains("'probe target'"),
        "{oob}"
    );
    let mis = rx.recv().unwrap();
    assert!(mis.contains("not aligned for u32"), "{mis}");
    let mut out = [0u8; 16];
    gpu.copy_d2h(p, &mut out).unwrap();
    assert_eq!(&out[8..], &[0x33; 8]);
    gpu.dealloc(p).unwrap();
}

#[test]
fn kernels_can_check_pointers_from_rayon_workers() {
    use rayon::prelude::*;
    let gpu = CpuBackend::new();
    let rows = 1000usize;
    let table = gpu.alloc(rows * 16, "table").unwrap();
    let bytes: Vec<u8> = (0..rows * 16).map(|i| (i / 16) as u8).collect();
    gpu.copy_h2d(&bytes, table).unwrap();
    let out = gpu.alloc(rows * 4, "sums").unwrap();
    gpu.register_host_kernel(
        "t",
        "row_sums",
        &[ArgKind::Ptr, ArgKind::Ptr, ArgKind::U32],
        Arc::new(|m: &dyn HostMemory, _c: &LaunchConfig, a: &[KernelArg]| {
            let (KernelArg::Ptr(t), KernelArg::Ptr(o), KernelArg::U32(n)) = (a[0], a[1], a[2])
            else {
                return Err(GpuError::kernel("bad arguments"));
            };
            let shared = m.as_sync().expect("the CPU backend shares its memory view");
            let sums: Vec<u32> = (0..n as usize)
                .into_par_iter()
                .map(|r| {
                    let p = shared.host_ptr(t.offset(r * 16), 16)?;
                    // SAFETY: 16 checked bytes, only read while the kernel runs.
                    let row = unsafe { std::slice::from_raw_parts(p, 16) };
                    Ok(row.iter().map(|&x| x as u32).sum())
                })
                .collect::<Result<_>>()?;
            // SAFETY: sole writer of `o` while the kernel runs.
            unsafe { m.slice_mut::<u32>(o, n as usize)? }.copy_from_slice(&sums);
            Ok(())
        }),
    )
    .unwrap();
    let k = gpu.kernel("t", "row_sums").unwrap();
    let args = [
        KernelArg::Ptr(table),
        KernelArg::Ptr(out),
        KernelArg::U32(rows as u32),
    ];
    gpu.launch_kernel(k, LaunchConfig::linear(1, 1), &args, 0)
        .unwrap();
    let mut b = vec![0u8; rows * 4];
    gpu.copy_d2h_on_stream(out, &mut b, 0).unwrap();
    for (r, c) in b.chunks_exact(4).enumerate() {
        assert_eq!(
            u32::from_le_bytes(c.try_into().unwrap()),
            (r as u8) as u32 * 16
        );
    }
    // One row past the end fails inside a rayon worker and reaches the stream.
    let args = [
        KernelArg::Ptr(table),
        KernelArg::Ptr(out),
        KernelArg::U32(rows as u32 + 1),
    ];
    gpu.launch_kernel(k, LaunchConfig::linear(1, 1), &args, 0)
        .unwrap();
    let e = gpu.synchronize(0).unwrap_err().to_string();
    assert!(e.contains("t::row_sums") && e.contains("'table'"), "{e}");
    gpu.dealloc(table).unwrap();
    gpu.dealloc(out).unwrap();
}

#[test]
fn a_kernel_may_drop_the_last_handle_to_the_backend() {
    let gpu = Arc::new(CpuBackend::new());
    let slot: Arc<Mutex<Option<Arc<CpuBackend>>>> = Arc::new(Mutex::new(None));
    let slot2 = slot.clone();
    let (go_tx, go_rx) = crossbeam_channel::bounded::<()>(1);
    let (done_tx, done_rx) = crossbeam_channel::bounded::<()>(1);
    gpu.register_host_kernel(
        "t",
        "drop_backend",
        &[],
        Arc::new(
            move |_m: &dyn HostMemory, _c: &LaunchConfig, _a: &[KernelArg]| {
                // Wait until the test has let go of its own handle.
                go_rx
                    .recv_timeout(Duration::from_secs(10))
                    .map_err(GpuError::kernel)?;
                let last = slot2.lock().take();
                drop(last);
                // Reached only if dropping the backend here did not panic.
                done_tx.send(()).map_err(GpuError::kernel)?;
                Ok(())
            },
        ),
    )
    .unwrap();
    let k = gpu.kernel("t", "drop_backend").unwrap();
    let s = gpu.create_stream().unwrap();
    gpu.launch_kernel(k, LaunchConfig::linear(1, 1), &[], s)
        .unwrap();
    *slot.lock() = Some(gpu);
    go_tx.send(()).unwrap();
    done_rx
        .recv_timeout(Duration::from_secs(10))
        .expect("dropping the backend inside its own kernel failed");
}

#[test]
fn submissions_racing_a_destroy_are_refused_not_lost() {
    let gpu = CpuBackend::new();
    let s = gpu.create_stream().unwrap();
    let stream = gpu.inner.stream("test", s).unwrap();
    let ev = gpu.create_event().unwrap();
    gpu.destroy_stream(s).unwrap();
    // A thread that looked the stream up before it was destroyed submits
    // afterwards: refused, and the event does not stay pending.
    let e = gpu.inner.submit(
        "record_event",
        &stream,
        &[Node::Record(gpu.inner.event("t", ev).unwrap())],
    );
    assert!(
        e.unwrap_err()
            .to_string()
            .contains(&format!("stream {s} has been destroyed"))
    );
    assert!(gpu.event_query(ev).unwrap());
    gpu.event_synchronize(ev).unwrap();
    drop(stream.drain());
}
