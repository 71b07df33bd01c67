//! Graph cases: capture and replay, what capture refuses, staging through
//! host-mapped memory under capture, events inside graphs, graph errors.

use metrale_gpu_runtime::GpuError;
use metrale_gpu_runtime::gpu::{GpuBackend, KernelArg};

use crate::CaseResult;
use crate::check::{Scope, one, read_u32, u32_bytes};

/// Capture records instead of running; a graph replays (twice) the recorded
/// work with pointers captured by value, and values that change between
/// replays through device memory show up in each replay.
pub fn capture_and_replay(gpu: &dyn GpuBackend) -> CaseResult {
    let mut sc = Scope::with_kernels(gpu)?;
    let s = sc.stream()?;
    let n = 8u32;
    let param = sc.alloc(32, "conformance param")?;
    let acc = sc.alloc(32, "conformance acc")?;
    let copy = sc.alloc(32, "conformance copy")?;
    gpu.copy_h2d(&u32_bytes(&[1; 8]), param)?;
    gpu.memset(acc, 0, 32)?;
    gpu.memset(copy, 0, 32)?;
    let add = gpu.kernel("conformance", "add")?;

    ensure!(
        !gpu.stream_is_capturing(s)?,
        "capturing before begin_capture"
    );
    gpu.begin_capture(s)?;
    ensure!(
        gpu.stream_is_capturing(s)?,
        "not capturing after begin_capture"
    );
    ensure!(
        !gpu.stream_is_capturing(0)?,
        "capture leaked to the default stream"
    );
    gpu.launch(add, one()).ptr(acc).ptr(param).u32(n).run(s)?;
    gpu.copy_d2d_async(acc, copy, 32, s)?;
    gpu.memset_async(param.offset(28), 0, 4, s)?;
    let g = sc.end_capture(s)?;
    ensure!(
        !gpu.stream_is_capturing(s)?,
        "still capturing after end_capture"
    );
    // Nothing ran during capture.
    gpu.synchronize(s)?;
    ensure!(
        read_u32(gpu, acc, 8, 0)? == [0; 8],
        "captured work ran at capture"
    );

    gpu.launch_graph(g, s)?;
    let got = read_u32(gpu, copy, 8, s)?;
    ensure!(got == [1; 8], "first replay: {got:?}");
    // Change the input through device memory between replays.
    gpu.copy_h2d(&u32_bytes(&[10; 8]), param)?;
    gpu.launch_graph(g, s)?;
    let got = read_u32(gpu, copy, 8, s)?;
    ensure!(got == [11; 8], "second replay: {got:?}");
    ensure!(
        read_u32(gpu, param, 8, s)? == [10, 10, 10, 10, 10, 10, 10, 0],
        "memset replayed"
    );
    // A replay can be queued on another stream as well.
    gpu.launch_graph(g, 0)?;
    gpu.synchronize(0)?;
    // The second replay zeroed param[7] again after using it.
    let got = read_u32(gpu, acc, 8, 0)?;
    ensure!(
        got == [21, 21, 21, 21, 21, 21, 21, 11],
        "replay on stream 0: {got:?}"
    );
    sc.finish()
}

/// Under capture, copies from ordinary host memory, blocking reads,
/// `synchronize` and synchronous copies on the capturing stream are refused
/// with a clear error, and the capture is then invalid.
pub fn capture_refusals(gpu: &dyn GpuBackend) -> CaseResult {
    use GpuError::{CaptureInvalidated, CaptureViolation};
    let mut sc = Scope::new(gpu);
    let s = sc.stream()?;
    let p = sc.alloc(16, "conformance target")?;
    let mut out = [0u8; 4];
    expect_err!(
        gpu.end_capture(s),
        GpuError::NotCapturing { .. },
        &["end_capture", "not capturing"],
    )?;

    gpu.begin_capture(s)?;
    expect_err!(
        gpu.begin_capture(s),
        GpuError::AlreadyCapturing { .. },
        &["begin_capture", "already capturing"],
    )?;
    expect_err!(
        gpu.copy_h2d_async(&[1; 4], p, s),
        CaptureViolation { .. },
        &["copy_h2d_async", "capturing"],
    )?;
    expect_err!(
        gpu.copy_d2h_on_stream(p, &mut out, s),
        CaptureViolation { .. },
        &["copy_d2h_on_stream", "capturing"],
    )?;
    expect_err!(
        gpu.synchronize(s),
        CaptureViolation { .. },
        &["synchronize", "capturing"],
    )?;
    // Other streams are unaffected.
    gpu.copy_h2d_async(&[2; 4], p, 0)?;
    gpu.synchronize(0)?;
    let e = expect_err!(
        gpu.end_capture(s),
        CaptureInvalidated { .. },
        &["end_capture", "invalidated", "copy_h2d_async"],
    )?;
    ensure!(
        matches!(e.root(), CaptureViolation { .. }),
        "the invalidation does not carry the refusal: {e:?}"
    );
    ensure!(
        !gpu.stream_is_capturing(s)?,
        "capture survived a failed end_capture"
    );
    gpu.synchronize(s)?;

    // Synchronous copies touch the default stream; refused while it captures.
    gpu.begin_capture(0)?;
    expect_err!(
        gpu.copy_h2d(&[1; 4], p),
        CaptureViolation { .. },
        &["copy_h2d", "capturing"],
    )?;
    expect_err!(
        gpu.copy_d2h(p, &mut out),
        CaptureViolation { .. },
        &["copy_d2h", "capturing"],
    )?;
    expect_err!(
        gpu.memset(p, 0, 4),
        CaptureViolation { .. },
        &["memset", "capturing"],
    )?;
    expect_err!(
        gpu.copy_d2d(p, p.offset(8), 4),
        CaptureViolation { .. },
        &["copy_d2d", "capturing"],
    )?;
    expect_err!(
        gpu.end_capture(0),
        CaptureInvalidated { .. },
        &["end_capture", "invalidated", "copy_h2d"],
    )?;
    gpu.copy_d2h(p, &mut out)?;
    ensure!(out == [2; 4], "refused copies wrote: {out:?}");
    sc.finish()
}

/// Staging through host-mapped memory is capturable: `copy_d2d_async` from
/// the mapped buffer's device address, and `copy_h2d_async` from its host
/// address, replay with the buffer's contents at replay time.
pub fn capture_of_mapped_staging(gpu: &dyn GpuBackend) -> CaseResult {
    let mut sc = Scope::new(gpu);
    let s = sc.stream()?;
    let stage = sc.mapped(64, "conformance staging")?;
    let dst = sc.alloc(64, "conformance dst")?;
    let dst2 = sc.alloc(32, "conformance dst2")?;
    gpu.begin_capture(s)?;
    gpu.copy_d2d_async(stage.device, dst, 64, s)?;
    {
        // SAFETY: 64 bytes of mapped memory owned by the backend until the
        // scope frees them; nothing writes them while this view lives.
        let host = unsafe { std::slice::from_raw_parts(stage.host, 64) };
        gpu.copy_h2d_async(&host[32..], dst2, s)?;
    }
    let g = sc.end_capture(s)?;
    for round in 1..=3u8 {
        // SAFETY: 64 bytes of mapped memory; no queued work reads them until
        // the graph launched below, after this write.
        unsafe { std::ptr::write_bytes(stage.host, round, 64) };
        gpu.launch_graph(g, s)?;
        let mut out = [0u8; 64];
        gpu.copy_d2h_on_stream(dst, &mut out, s)?;
        ensure!(out == [round; 64], "replay {round} saw {:?}", &out[..4]);
        let mut out = [0u8; 32];
        gpu.copy_d2h_on_stream(dst2, &mut out, s)?;
        ensure!(
            out == [round; 32],
            "h2d from mapped, replay {round}: {:?}",
            &out[..4]
        );
    }
    sc.finish()
}

/// Event records and waits inside a graph act at each replay.
pub fn capture_with_events(gpu: &dyn GpuBackend) -> CaseResult {
    let mut sc = Scope::with_kernels(gpu)?;
    let a = sc.stream()?;
    let b = sc.stream()?;
    let ev = sc.event()?;
    let flag = sc.flag()?;
    let x = sc.alloc(16, "conformance x")?;
    let y = sc.alloc(16, "conformance y")?;
    gpu.memset(x, 0, 16)?;
    let gate = gpu.kernel("conformance", "gate")?;
    let fill = gpu.kernel("conformance", "fill")?;
    gpu.begin_capture(a)?;
    gpu.launch_kernel(gate, one(), &[KernelArg::Ptr(flag.device)], a)?;
    gpu.launch(fill, one()).ptr(x).u32(4).u32(5).run(a)?;
    gpu.record_event(ev, a)?;
    let g = sc.end_capture(a)?;
    ensure!(
        gpu.event_query(ev)?,
        "a captured record must not count as a record"
    );
    gpu.launch_graph(g, a)?;
    ensure!(!gpu.event_query(ev)?, "the replayed record is not pending");
    gpu.stream_wait_event(b, ev)?;
    gpu.copy_d2d_async(x, y, 16, b)?;
    flag.set();
    ensure!(
        read_u32(gpu, y, 4, b)? == [5; 4],
        "B did not wait for the replayed record"
    );
    gpu.synchronize(a)?;
    sc.finish()
}

/// Unknown and destroyed graphs are refused; a graph whose memory was freed
/// is refused at launch, naming the pointer, and runs nothing.
pub fn graph_errors(gpu: &dyn GpuBackend) -> CaseResult {
    use GpuError::{UnknownGraph, UnknownStream};
    let mut sc = Scope::new(gpu);
    let s = sc.stream()?;
    let keep = sc.alloc(16, "conformance keep")?;
    let gone = sc.alloc(16, "conformance gone")?;
    gpu.memset(keep, 0, 16)?;
    gpu.begin_capture(s)?;
    gpu.memset_async(keep, 1, 16, s)?;
    gpu.memset_async(gone, 2, 16, s)?;
    let g = sc.end_capture(s)?;
    sc.free(gone)?;
    expect_err!(
        gpu.launch_graph(g, s),
        GpuError::UseAfterFree { .. },
        &["launch_graph", &gone.to_string(), "freed"],
    )?;
    let mut out = [9u8; 16];
    gpu.copy_d2h_on_stream(keep, &mut out, s)?;
    ensure!(
        out == [0; 16],
        "a refused graph launch ran part of the graph"
    );
    sc.destroy_graph(g)?;
    let id = g.0.to_string();
    expect_err!(
        gpu.launch_graph(g, s),
        UnknownGraph { .. },
        &["launch_graph", "unknown graph", &id],
    )?;
    expect_err!(
        gpu.destroy_graph(g),
        UnknownGraph { .. },
        &["destroy_graph", "unknown graph", &id],
    )?;
    expect_err!(
        gpu.begin_capture(777),
        UnknownStream { .. },
        &["begin_capture", "unknown stream"],
    )?;
    expect_err!(
        gpu.stream_is_capturing(777),
        UnknownStream { .. },
        &["stream_is_capturing", "unknown stream"],
    )?;
    sc.finish()
}
