//! Stream and event cases: stream lifetimes, asynchrony and ordering
//! through events, event records, queries and waits.

use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use metrale_gpu_runtime::GpuError;
use metrale_gpu_runtime::gpu::{GpuBackend, KernelArg};

use crate::CaseResult;
use crate::check::{Scope, one, read_u32};

/// `default_stream`, `create_stream`, `destroy_stream`, `synchronize`:
/// distinct ids, unknown ids refused, the default stream kept, destroy runs
/// queued work first.
pub fn streams(gpu: &dyn GpuBackend) -> CaseResult {
    use GpuError::UnknownStream;
    let mut sc = Scope::new(gpu);
    ensure!(gpu.default_stream() == 0, "default stream is not 0");
    gpu.synchronize(gpu.default_stream())?;
    let s1 = sc.stream()?;
    let s2 = sc.stream()?;
    ensure!(s1 != s2 && s1 != 0 && s2 != 0, "stream ids {s1} {s2}");
    let a = sc.alloc(1 << 20, "conformance big")?;
    gpu.memset_async(a, 0x11, 1 << 20, s1)?;
    sc.destroy_stream(s1)?;
    let mut out = vec![0u8; 16];
    gpu.copy_d2h(a.offset((1 << 20) - 16), &mut out)?;
    ensure!(
        out.iter().all(|&x| x == 0x11),
        "destroy_stream dropped queued work"
    );
    expect_err!(
        gpu.synchronize(s1),
        UnknownStream { .. },
        &["synchronize", "unknown stream", &s1.to_string()],
    )?;
    expect_err!(
        gpu.memset_async(a, 0, 1, s1),
        UnknownStream { .. },
        &["memset_async", "unknown stream"],
    )?;
    expect_err!(
        gpu.destroy_stream(s1),
        UnknownStream { .. },
        &["destroy_stream", "unknown stream"],
    )?;
    expect_err!(
        gpu.destroy_stream(0),
        GpuError::InvalidArgument { .. },
        &["destroy_stream", "default stream"],
    )?;
    expect_err!(
        gpu.copy_d2d_async(a, a, 0, 9999),
        UnknownStream { stream: 9999, .. },
        &["copy_d2d_async", "9999"],
    )?;
    gpu.synchronize(s2)?;
    sc.finish()
}

/// Work queued on stream A is still pending when the launch returns; an
/// event recorded on A makes stream B wait for it, and a copy on B then
/// sees A's result.
pub fn stream_asynchrony_and_events(gpu: &dyn GpuBackend) -> CaseResult {
    let mut sc = Scope::with_kernels(gpu)?;
    let a = sc.stream()?;
    let b = sc.stream()?;
    let flag = sc.flag()?;
    let marker = sc.mapped(4, "conformance marker")?;
    let x = sc.alloc(64, "conformance x")?;
    let y = sc.alloc(64, "conformance y")?;
    gpu.memset(x, 0, 64)?;
    gpu.memset(y, 0, 64)?;
    gpu.memset(marker.device, 0, 4)?;
    let gate = gpu.kernel("conformance", "gate")?;
    let fill = gpu.kernel("conformance", "fill")?;
    let ev = sc.event()?;

    // A: wait for the host, then x = 77.
    gpu.launch_kernel(gate, one(), &[KernelArg::Ptr(flag.device)], a)?;
    gpu.launch(fill, one()).ptr(x).u32(16).u32(77).run(a)?;
    gpu.record_event(ev, a)?;
    // B: wait for A, then y = x, then mark.
    gpu.stream_wait_event(b, ev)?;
    gpu.copy_d2d_async(x, y, 64, b)?;
    gpu.launch(fill, one())
        .ptr(marker.device)
        .u32(1)
        .u32(1)
        .run(b)?;

    // Everything above returned while A is blocked on the flag.
    std::thread::sleep(Duration::from_millis(50));
    ensure!(
        !gpu.event_query(ev)?,
        "event complete before the gated work ran"
    );
    // SAFETY: 4 bytes of mapped memory; the kernel writes them only after the
    // flag is set below, so this read does not race.
    let seen = unsafe { std::ptr::read_volatile(marker.host as *const u32) };
    ensure!(seen == 0, "stream B ran past its event wait");
    let mut early = [0u8; 4];
    gpu.copy_d2h(x, &mut early)?;
    ensure!(early == [0; 4], "stream A ran before its gate opened");

    flag.set();
    let got = read_u32(gpu, y, 16, b)?;
    ensure!(
        got.iter().all(|&v| v == 77),
        "B copied before A finished: {got:?}"
    );
    ensure!(
        gpu.event_query(ev)?,
        "event not complete after B observed it"
    );
    // SAFETY: the kernel that wrote it has completed (B was synchronised).
    let seen = unsafe { std::ptr::read_volatile(marker.host as *const u32) };
    ensure!(seen == 1, "marker {seen}");
    gpu.synchronize(a)?;
    sc.finish()
}

/// `create_event`, `record_event`, `event_query`, `event_synchronize`,
/// `destroy_event`: an unrecorded event is complete, re-recording tracks the
/// latest record, unknown events are refused.
pub fn events(gpu: &dyn GpuBackend) -> CaseResult {
    use GpuError::UnknownEvent;
    let mut sc = Scope::with_kernels(gpu)?;
    let s = sc.stream()?;
    let e1 = sc.event()?;
    let e2 = sc.event()?;
    ensure!(e1 != e2, "event handles collide");
    ensure!(
        gpu.event_query(e1)?,
        "an unrecorded event must read complete"
    );
    gpu.event_synchronize(e1)?;
    // A wait on an unrecorded event does not block.
    gpu.stream_wait_event(s, e1)?;
    gpu.synchronize(s)?;

    gpu.record_event(e1, s)?;
    gpu.event_synchronize(e1)?;
    ensure!(
        gpu.event_query(e1)?,
        "recorded event not complete after synchronize"
    );

    let flag = sc.flag()?;
    let gate = gpu.kernel("conformance", "gate")?;
    gpu.launch_kernel(gate, one(), &[KernelArg::Ptr(flag.device)], s)?;
    gpu.record_event(e1, s)?;
    ensure!(
        !gpu.event_query(e1)?,
        "re-recorded event behind a gate reads complete"
    );
    // Another thread opens the gate: event_synchronize must wait for it.
    let t = {
        let f = flag.atomic() as *const AtomicU32 as usize;
        std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(30));
            // SAFETY: the flag lives until the scope frees it, after joining.
            unsafe { &*(f as *const AtomicU32) }.store(1, Ordering::Release);
        })
    };
    gpu.event_synchronize(e1)?;
    ensure!(
        flag.atomic().load(Ordering::Acquire) == 1,
        "event_synchronize returned early"
    );
    ensure!(gpu.event_query(e1)?, "event_query after event_synchronize");
    if t.join().is_err() {
        bail!("flag thread panicked");
    }

    sc.destroy_event(e1)?;
    let id = e1.0.to_string();
    expect_err!(
        gpu.event_query(e1),
        UnknownEvent { .. },
        &["event_query", "unknown event", &id],
    )?;
    expect_err!(
        gpu.event_synchronize(e1),
        UnknownEvent { .. },
        &["event_synchronize", "unknown event"],
    )?;
    expect_err!(
        gpu.record_event(e1, s),
        UnknownEvent { .. },
        &["record_event", "unknown event"],
    )?;
    expect_err!(
        gpu.stream_wait_event(s, e1),
        UnknownEvent { .. },
        &["stream_wait_event", "unknown event"],
    )?;
    expect_err!(
        gpu.destroy_event(e1),
        UnknownEvent { .. },
        &["destroy_event", "unknown event"],
    )?;
    expect_err!(
        gpu.record_event(e2, 9999),
        GpuError::UnknownStream { .. },
        &["record_event", "unknown stream"],
    )?;
    sc.finish()
}
