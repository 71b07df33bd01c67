//! Memory cases: allocation and accounting, synchronous and queued copies,
//! pointer faults, `free` faults, host-mapped and registered host memory.

use metrale_gpu_runtime::GpuError;
use metrale_gpu_runtime::gpu::{DevicePtr, GpuBackend, KernelArg, MemoryKind};

use crate::CaseResult;
use crate::check::{Context, Scope, one};

/// `alloc`, `free` (null no-op), `live_bytes`, `live_alloc_count`,
/// `live_allocations`, `live_report`: accounting returns to zero.
pub fn alloc_free_accounting(gpu: &dyn GpuBackend) -> CaseResult {
    ensure!(!gpu.name().is_empty(), "empty backend name");
    let mut sc = Scope::new(gpu);
    gpu.dealloc(DevicePtr::NULL)
        .context("free(NULL) must be a no-op")?;
    expect_err!(
        gpu.alloc(usize::MAX, "conformance huge"),
        GpuError::OutOfMemory { .. },
        &["alloc", "conformance huge"],
    )?;
    expect_err!(
        gpu.alloc_host_mapped(usize::MAX, "conformance huge mapped"),
        GpuError::OutOfMemory { .. },
        &["alloc_host_mapped", "conformance huge mapped"],
    )?;
    ensure!(sc.extra_allocs() == 0, "a failed alloc was counted");
    let a = sc.alloc(1000, "conformance a")?;
    let b = gpu.alloc(24, "conformance b")?;
    let z = sc.alloc(0, "conformance empty")?;
    ensure!(
        !a.is_null() && !b.is_null() && !z.is_null(),
        "null allocation"
    );
    ensure!(
        a != b && b != z && a != z,
        "allocations share an address: {a} {b} {z}"
    );
    ensure!(
        a.0 % 64 == 0 && b.0 % 64 == 0,
        "allocations not 64-byte aligned: {a} {b}"
    );
    ensure!(sc.extra_allocs() == 3, "live_alloc_count");
    ensure!(sc.extra_bytes() == 1024, "live_bytes {}", gpu.live_bytes());
    let infos = gpu.live_allocations();
    let Some(ia) = infos.iter().find(|i| i.ptr == a) else {
        bail!("{a} not listed in live_allocations");
    };
    ensure!(ia.bytes == 1000 && ia.label == "conformance a" && ia.kind == MemoryKind::Device);
    let report = gpu.live_report();
    ensure!(
        report.contains("1000 bytes 'conformance a'"),
        "live_report: {report}"
    );
    ensure!(
        report.contains(&a.to_string()),
        "live_report lacks {a}: {report}"
    );
    // `free` is `dealloc` with its error boxed; both release.
    if let Err(e) = gpu.free(b) {
        bail!("free: {e:#}");
    }
    ensure!(sc.extra_allocs() == 2, "count after one free");
    ensure!(
        !gpu.live_report().contains("conformance b"),
        "freed b still reported"
    );
    sc.finish()
}

/// `copy_h2d`, `copy_d2h`, `copy_d2d`, `memset`, at offsets.
pub fn sync_copies(gpu: &dyn GpuBackend) -> CaseResult {
    let mut sc = Scope::new(gpu);
    let a = sc.alloc(64, "conformance a")?;
    let b = sc.alloc(64, "conformance b")?;
    let data: Vec<u8> = (0..64).collect();
    gpu.copy_h2d(&data, a)?;
    gpu.memset(b, 0xAB, 64)?;
    gpu.copy_d2d(a.offset(8), b.offset(16), 32)?;
    gpu.memset(b.offset(60), 7, 4)?;
    let mut out = vec![0u8; 64];
    gpu.copy_d2h(b, &mut out)?;
    let mut want = vec![0xABu8; 64];
    want[16..48].copy_from_slice(&data[8..40]);
    want[60..].fill(7);
    ensure!(out == want, "copies gave {out:?}");
    let mut part = [0u8; 5];
    gpu.copy_d2h(a.offset(59), &mut part)?;
    ensure!(part == [59, 60, 61, 62, 63], "partial read {part:?}");
    // Empty copies are fine at the end of an allocation.
    gpu.copy_h2d(&[], a.offset(64))?;
    gpu.copy_d2h(a.offset(64), &mut [])?;
    sc.finish()
}

/// Async copies and memsets on one stream run in submission order and
/// `copy_d2h_on_stream` sees all of them.
pub fn async_copies_in_order(gpu: &dyn GpuBackend) -> CaseResult {
    let mut sc = Scope::new(gpu);
    let s = sc.stream()?;
    let a = sc.alloc(4096, "conformance a")?;
    let b = sc.alloc(4096, "conformance b")?;
    for round in 0..20u8 {
        gpu.memset_async(a, round, 4096, s)?;
        gpu.copy_h2d_async(&[round.wrapping_mul(3); 100], a.offset(100), s)?;
        gpu.copy_d2d_async(a, b, 4096, s)?;
        gpu.memset_async(a, 0, 4096, s)?;
        let mut out = vec![0u8; 4096];
        gpu.copy_d2h_on_stream(b, &mut out, s)?;
        let region = |r: std::ops::Range<usize>, v: u8| out[r].iter().all(|&x| x == v);
        ensure!(region(0..100, round), "round {round}: head {:?}", &out[..4]);
        ensure!(
            region(100..200, round.wrapping_mul(3)),
            "round {round}: middle"
        );
        ensure!(region(200..4096, round), "round {round}: tail");
    }
    gpu.synchronize(s)?;
    let mut out = vec![1u8; 16];
    gpu.copy_d2h_on_stream(a, &mut out, s)?;
    ensure!(out == vec![0u8; 16], "last memset not seen: {out:?}");
    sc.finish()
}

/// `copy_h2d_async` takes its source at call time: it may be overwritten
/// or dropped right after, even while the stream is blocked.
pub fn h2d_async_source_copied_at_call(gpu: &dyn GpuBackend) -> CaseResult {
    let mut sc = Scope::with_kernels(gpu)?;
    let s = sc.stream()?;
    let flag = sc.flag()?;
    let dst = sc.alloc(256, "conformance dst")?;
    let gate = gpu.kernel("conformance", "gate")?;
    gpu.launch_kernel(gate, one(), &[KernelArg::Ptr(flag.device)], s)?;
    let mut src = vec![0x5Au8; 256];
    gpu.copy_h2d_async(&src, dst, s)?;
    src.fill(0);
    drop(src);
    let junk = vec![0xEEu8; 256];
    std::hint::black_box(&junk);
    flag.set();
    let mut out = vec![0u8; 256];
    gpu.copy_d2h_on_stream(dst, &mut out, s)?;
    ensure!(
        out.iter().all(|&x| x == 0x5A),
        "source not captured at call: {:?}",
        &out[..8]
    );
    sc.finish()
}

/// Out-of-bounds, use-after-free, null and wild pointers are errors naming
/// the operation and the pointer, for every memory call.
pub fn memory_errors(gpu: &dyn GpuBackend) -> CaseResult {
    use GpuError::{InvalidPointer, NullPointer, OutOfBounds, UseAfterFree};
    let mut sc = Scope::new(gpu);
    let s = sc.stream()?;
    let a = sc.alloc(64, "conformance victim")?;
    let b = sc.alloc(64, "conformance other")?;
    let pa = a.to_string();
    let end = a.offset(60).to_string();
    let mut buf = [0u8; 8];
    expect_err!(
        gpu.copy_h2d(&[0; 8], a.offset(60)),
        OutOfBounds { .. },
        &["copy_h2d", &end, "conformance victim"],
    )?;
    expect_err!(
        gpu.copy_d2h(a.offset(60), &mut buf),
        OutOfBounds { .. },
        &["copy_d2h", &end],
    )?;
    expect_err!(
        gpu.copy_d2d(a.offset(60), b, 8),
        OutOfBounds { .. },
        &["copy_d2d", &end],
    )?;
    expect_err!(
        gpu.copy_d2d(b, a.offset(60), 8),
        OutOfBounds { .. },
        &["copy_d2d", &end],
    )?;
    expect_err!(
        gpu.memset(a.offset(60), 0, 8),
        OutOfBounds { .. },
        &["memset", &end],
    )?;
    expect_err!(
        gpu.memset_async(a.offset(60), 0, 8, s),
        OutOfBounds { .. },
        &["memset_async", &end],
    )?;
    expect_err!(
        gpu.copy_h2d_async(&[0; 8], a.offset(60), s),
        OutOfBounds { .. },
        &["copy_h2d_async", &end],
    )?;
    expect_err!(
        gpu.copy_d2d_async(a, b.offset(1), 64, s),
        OutOfBounds { .. },
        &["copy_d2d_async", &b.offset(1).to_string()],
    )?;
    expect_err!(
        gpu.copy_d2h_on_stream(a.offset(60), &mut buf, s),
        OutOfBounds { .. },
        &["copy_d2h_on_stream", &end],
    )?;
    let e = expect_err!(
        gpu.copy_d2h(DevicePtr::NULL, &mut buf),
        NullPointer { .. },
        &["copy_d2h", "null"],
    )?;
    ensure!(
        e.pointer() == Some(DevicePtr::NULL),
        "{e:?} names no pointer"
    );
    let wild = DevicePtr(0x42);
    let e = expect_err!(
        gpu.memset(wild, 0, 1),
        InvalidPointer { .. },
        &["memset", "0x42"],
    )?;
    ensure!(e.pointer() == Some(wild), "{e:?} does not name {wild}");
    // Nothing was written by the refused calls.
    let mut out = [1u8; 64];
    gpu.copy_d2h(a, &mut out)?;
    sc.free(a)?;
    expect_err!(
        gpu.copy_h2d(&[0; 4], a),
        UseAfterFree { .. },
        &["copy_h2d", &pa, "freed"],
    )?;
    expect_err!(
        gpu.copy_d2h(a.offset(4), &mut buf),
        UseAfterFree { .. },
        &["copy_d2h", &a.offset(4).to_string(), "freed"],
    )?;
    expect_err!(
        gpu.memset_async(a, 0, 4, s),
        UseAfterFree { .. },
        &["memset_async", &pa, "freed"],
    )?;
    expect_err!(
        gpu.copy_d2d_async(a, b, 4, s),
        UseAfterFree { .. },
        &["copy_d2d_async", &pa, "freed"],
    )?;
    expect_err!(
        gpu.copy_d2h_on_stream(a, &mut buf, s),
        UseAfterFree { .. },
        &["copy_d2h_on_stream", &pa, "freed"],
    )?;
    // Refused submissions leave no pending error behind.
    gpu.synchronize(s)?;
    sc.finish()
}

/// Double free, freeing an interior pointer and freeing a wild pointer are
/// errors naming `free` and the pointer, and change nothing.
pub fn free_errors(gpu: &dyn GpuBackend) -> CaseResult {
    let mut sc = Scope::new(gpu);
    let a = sc.alloc(128, "conformance twice")?;
    let inner = a.offset(16);
    let e = expect_err!(
        gpu.dealloc(inner),
        GpuError::InteriorFree { offset: 16, .. },
        &["free", &inner.to_string(), "conformance twice"],
    )?;
    ensure!(e.pointer() == Some(inner), "{e:?} does not name {inner}");
    ensure!(sc.extra_allocs() == 1, "interior free changed the ledger");
    gpu.memset(a, 3, 128)
        .context("allocation must survive a refused interior free")?;
    sc.free(a)?;
    expect_err!(
        gpu.dealloc(a),
        GpuError::DoubleFree { .. },
        &["free", &a.to_string(), "double free"],
    )?;
    expect_err!(
        gpu.dealloc(DevicePtr(0x1234)),
        GpuError::NotAllocated { .. },
        &["free", "0x1234"],
    )?;
    // `free` reports the same error, boxed.
    match gpu.free(a) {
        Ok(()) => bail!("free of a freed pointer succeeded"),
        Err(e) => ensure!(
            matches!(
                e.downcast_ref::<GpuError>(),
                Some(GpuError::DoubleFree { .. })
            ),
            "free's error is not a DoubleFree GpuError: {e:#}"
        ),
    }
    sc.finish()
}

/// `alloc_host_mapped`: both addresses see the same bytes; the host address
/// is page aligned; it counts in `live_bytes`.
pub fn host_mapped_memory(gpu: &dyn GpuBackend) -> CaseResult {
    let mut sc = Scope::new(gpu);
    let m = sc.mapped(8192, "conformance mapped")?;
    ensure!(m.bytes == 8192 && !m.device.is_null() && !m.host.is_null());
    ensure!(
        (m.host as usize).is_multiple_of(4096),
        "host address {:p} not page aligned",
        m.host
    );
    ensure!(sc.extra_bytes() == 8192, "mapped bytes not counted");
    let info = gpu
        .live_allocations()
        .into_iter()
        .find(|i| i.ptr == m.device);
    ensure!(
        info.map(|i| i.kind) == Some(MemoryKind::HostMapped),
        "kind not HostMapped"
    );
    // SAFETY: 8192 bytes owned by the backend until the scope frees them; no
    // queued work touches them while this view lives.
    let host = unsafe { std::slice::from_raw_parts_mut(m.host, 8192) };
    host[..4].copy_from_slice(&[1, 2, 3, 4]);
    let mut out = [0u8; 4];
    gpu.copy_d2h(m.device, &mut out)?;
    ensure!(out == [1, 2, 3, 4], "device view of host writes: {out:?}");
    gpu.copy_h2d(&[9; 8], m.device.offset(4096))?;
    ensure!(host[4096..4104] == [9; 8], "host view of device writes");
    let d = sc.alloc(16, "conformance device")?;
    gpu.copy_d2d(m.device, d, 4)?;
    gpu.copy_d2h(d, &mut out)?;
    ensure!(out == [1, 2, 3, 4], "d2d from mapped memory: {out:?}");
    expect_err!(
        gpu.copy_d2h(m.device.offset(8190), &mut out),
        GpuError::OutOfBounds { .. },
        &["copy_d2h", "conformance mapped"],
    )?;
    sc.finish()
}

/// `register_host`: caller memory gets a device address, is counted in
/// `live_alloc_count` but not `live_bytes`, and `free` unregisters without
/// touching it.
pub fn registered_host_memory(gpu: &dyn GpuBackend) -> CaseResult {
    let sc = Scope::new(gpu);
    let mut mine = vec![0u8; 4096];
    mine[..4].copy_from_slice(&[5, 6, 7, 8]);
    // SAFETY: `mine` outlives the registration (freed below) and is not
    // reallocated meanwhile.
    let d = unsafe { gpu.register_host(mine.as_mut_ptr(), mine.len(), "conformance registered")? };
    ensure!(sc.extra_allocs() == 1, "registered memory not counted");
    ensure!(
        sc.extra_bytes() == 0,
        "registered memory counted in live_bytes"
    );
    let info = gpu.live_allocations().into_iter().find(|i| i.ptr == d);
    ensure!(
        info.map(|i| i.kind) == Some(MemoryKind::HostRegistered),
        "kind not HostRegistered"
    );
    let mut out = [0u8; 4];
    gpu.copy_d2h(d, &mut out)?;
    ensure!(out == [5, 6, 7, 8], "device view of caller memory: {out:?}");
    gpu.copy_h2d(&[1, 1], d.offset(100))?;
    expect_err!(
        gpu.copy_h2d(&[1, 1], d.offset(4095)),
        GpuError::OutOfBounds { .. },
        &["copy_h2d", "conformance registered"],
    )?;
    gpu.dealloc(d)?;
    ensure!(
        mine[100..102] == [1, 1] && mine[..4] == [5, 6, 7, 8],
        "caller memory changed by free"
    );
    expect_err!(
        gpu.copy_d2h(d, &mut out),
        GpuError::UseAfterFree { .. },
        &["copy_d2h", &d.to_string()],
    )?;
    sc.finish()
}
