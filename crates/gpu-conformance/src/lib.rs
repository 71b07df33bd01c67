//! The conformance suite: behaviour every [`GpuBackend`] must show.
//!
//! Each case is a `pub fn(&dyn GpuBackend) -> Result<()>` that returns an
//! error describing the first thing that went wrong; [`CASES`] lists them all
//! and [`run_all`] runs each on a fresh backend. Cases that need kernels use
//! host kernels the suite registers itself (module `conformance`); on a
//! backend without host kernels they return [`Skipped`].
//!
//! Invariants the cases rely on: each case leaves the backend with the live
//! allocations it found (checked at the end), and nothing blocks forever: the
//! gate kernel gives up after a timeout and fails instead.

use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, anyhow, bail, ensure};

use metrale_gpu_runtime::GpuError;
use metrale_gpu_runtime::gpu::{
    ArgKind, DevicePtr, GpuBackend, HostMemory, KernelArg, LaunchConfig, MemoryKind, StreamId,
};

/// The error a case returns when the backend cannot run it (no host
/// kernels). [`run_all`] counts it separately from failures.
#[derive(Debug)]
pub struct Skipped(pub &'static str);

impl std::fmt::Display for Skipped {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "skipped: {}", self.0)
    }
}

impl std::error::Error for Skipped {}

/// A conformance case.
pub type Case = fn(&dyn GpuBackend) -> Result<()>;

/// Every case, by name.
pub const CASES: &[(&str, Case)] = &[
    ("alloc_free_accounting", alloc_free_accounting),
    ("sync_copies", sync_copies),
    ("async_copies_in_order", async_copies_in_order),
    (
        "h2d_async_source_copied_at_call",
        h2d_async_source_copied_at_call,
    ),
    ("memory_errors", memory_errors),
    ("free_errors", free_errors),
    ("host_mapped_memory", host_mapped_memory),
    ("registered_host_memory", registered_host_memory),
    ("streams", streams),
    ("stream_asynchrony_and_events", stream_asynchrony_and_events),
    ("events", events),
    ("kernel_registry", kernel_registry),
    ("kernel_arguments", kernel_arguments),
    ("kernel_argument_errors", kernel_argument_errors),
    ("sticky_async_errors", sticky_async_errors),
    ("capture_and_replay", capture_and_replay),
    ("capture_refusals", capture_refusals),
    ("capture_of_mapped_staging", capture_of_mapped_staging),
    ("capture_with_events", capture_with_events),
    ("graph_errors", graph_errors),
];

/// The outcome of [`run_all`].
#[derive(Debug, Default)]
pub struct Report {
    /// Cases that passed.
    pub passed: Vec<&'static str>,
    /// Cases the backend could not run, with why.
    pub skipped: Vec<(&'static str, String)>,
    /// Cases that failed, with the error.
    pub failed: Vec<(&'static str, String)>,
}

/// Run every case, each on a fresh backend from `make`.
pub fn run_all(make: &dyn Fn() -> Arc<dyn GpuBackend>) -> Report {
    let mut r = Report::default();
    for &(name, case) in CASES {
        let gpu = make();
        match case(&*gpu) {
            Ok(()) => r.passed.push(name),
            Err(e) if e.is::<Skipped>() => r.skipped.push((name, e.to_string())),
            Err(e) => r.failed.push((name, format!("{e:#}"))),
        }
    }
    r
}

// ---------------------------------------------------------------- helpers

/// Check that `r` failed with a message containing every needle.
fn expect_err<T, E: std::fmt::Display>(
    r: std::result::Result<T, E>,
    needles: &[&str],
) -> Result<String> {
    match r {
        Ok(_) => bail!("expected an error containing {needles:?}, got Ok"),
        Err(e) => {
            let s = format!("{e:#}");
            for n in needles {
                ensure!(s.contains(n), "error {s:?} does not contain {n:?}");
            }
            Ok(s)
        }
    }
}

fn u32_bytes(v: &[u32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

fn read_u32(gpu: &dyn GpuBackend, p: DevicePtr, n: usize, stream: StreamId) -> Result<Vec<u32>> {
    let mut b = vec![0u8; n * 4];
    gpu.copy_d2h_on_stream(p, &mut b, stream)?;
    Ok(b.chunks_exact(4)
        .map(|c| u32::from_le_bytes(c.try_into().unwrap()))
        .collect())
}

/// Fails the case unless the backend has as many live allocations as
/// `before` at the end.
struct Baseline {
    count: usize,
    bytes: usize,
}

impl Baseline {
    fn take(gpu: &dyn GpuBackend) -> Baseline {
        Baseline {
            count: gpu.live_alloc_count(),
            bytes: gpu.live_bytes(),
        }
    }
    fn check(&self, gpu: &dyn GpuBackend) -> Result<()> {
        ensure!(
            gpu.live_alloc_count() == self.count && gpu.live_bytes() == self.bytes,
            "allocations leaked: {} live ({} bytes), expected {} ({} bytes):\n{}",
            gpu.live_alloc_count(),
            gpu.live_bytes(),
            self.count,
            self.bytes,
            gpu.live_report()
        );
        Ok(())
    }
}

const GATE_TIMEOUT: Duration = Duration::from_secs(10);

fn arg_ptr(a: &[KernelArg], i: usize) -> Result<DevicePtr, GpuError> {
    match a.get(i) {
        Some(KernelArg::Ptr(p)) => Ok(*p),
        other => Err(GpuError::kernel(format!(
            "argument {i}: expected a pointer, got {other:?}"
        ))),
    }
}

fn arg_u32(a: &[KernelArg], i: usize) -> Result<u32, GpuError> {
    match a.get(i) {
        Some(KernelArg::U32(v)) => Ok(*v),
        other => Err(GpuError::kernel(format!(
            "argument {i}: expected a u32, got {other:?}"
        ))),
    }
}

/// Register the suite's host kernels (idempotent). Skips without host
/// kernels.
fn kernels(gpu: &dyn GpuBackend) -> Result<()> {
    if !gpu.supports_host_kernels() {
        return Err(Skipped("the backend does not run host kernels").into());
    }
    use ArgKind::*;
    // gate(flag): spin until the u32 at `flag` is non-zero.
    gpu.register_host_kernel(
        "conformance",
        "gate",
        &[Ptr],
        Arc::new(|m: &dyn HostMemory, _c: &LaunchConfig, a: &[KernelArg]| {
            let p = m.host_ptr(arg_ptr(a, 0)?, 4)?;
            if !(p as usize).is_multiple_of(4) {
                return Err(GpuError::kernel("gate flag is misaligned"));
            }
            // SAFETY: 4 checked, aligned bytes; others only touch them
            // atomically (the host side stores through an atomic too).
            let flag = unsafe { &*(p as *const std::sync::atomic::AtomicU32) };
            let t0 = Instant::now();
            while flag.load(std::sync::atomic::Ordering::Acquire) == 0 {
                if t0.elapsed() >= GATE_TIMEOUT {
                    return Err(GpuError::kernel("gate: flag never set"));
                }
                std::thread::sleep(Duration::from_micros(200));
            }
            Ok(())
        }),
    )?;
    // fill(dst, n, value)
    gpu.register_host_kernel(
        "conformance",
        "fill",
        &[Ptr, U32, U32],
        Arc::new(|m: &dyn HostMemory, _c: &LaunchConfig, a: &[KernelArg]| {
            let n = arg_u32(a, 1)? as usize;
            // SAFETY: this kernel is the only user of `dst` while it runs.
            let d = unsafe { m.slice_mut::<u32>(arg_ptr(a, 0)?, n)? };
            d.fill(arg_u32(a, 2)?);
            Ok(())
        }),
    )?;
    // add(dst, src, n): dst += src
    gpu.register_host_kernel(
        "conformance",
        "add",
        &[Ptr, Ptr, U32],
        Arc::new(|m: &dyn HostMemory, _c: &LaunchConfig, a: &[KernelArg]| {
            let n = arg_u32(a, 2)? as usize;
            // SAFETY: read-only view; the suite never passes overlapping
            // `dst` and `src`.
            let s: Vec<u32> = unsafe { m.slice::<u32>(arg_ptr(a, 1)?, n)? }.to_vec();
            // SAFETY: sole writer of `dst` while the kernel runs.
            let d = unsafe { m.slice_mut::<u32>(arg_ptr(a, 0)?, n)? };
            for (d, s) in d.iter_mut().zip(s) {
                *d = d.wrapping_add(s);
            }
            Ok(())
        }),
    )?;
    // args(out, u32, u64, i32, f32): writes the scalars little-endian plus
    // the launch geometry.
    gpu.register_host_kernel(
        "conformance",
        "args",
        &[Ptr, U32, U64, I32, F32],
        Arc::new(|m: &dyn HostMemory, c: &LaunchConfig, a: &[KernelArg]| {
            let mut b = Vec::with_capacity(32);
            for x in &a[1..] {
                match x {
                    KernelArg::U32(v) => b.extend_from_slice(&v.to_le_bytes()),
                    KernelArg::U64(v) => b.extend_from_slice(&v.to_le_bytes()),
                    KernelArg::I32(v) => b.extend_from_slice(&v.to_le_bytes()),
                    KernelArg::F32(v) => b.extend_from_slice(&v.to_le_bytes()),
                    KernelArg::Ptr(p) => b.extend_from_slice(&p.0.to_le_bytes()),
                }
            }
            b.extend_from_slice(&c.grid.0.to_le_bytes());
            b.extend_from_slice(&c.block.0.to_le_bytes());
            // SAFETY: sole writer of `out` while the kernel runs.
            let d = unsafe { m.slice_mut::<u8>(arg_ptr(a, 0)?, b.len())? };
            d.copy_from_slice(&b);
            Ok(())
        }),
    )?;
    // fail(): always errors.
    gpu.register_host_kernel(
        "conformance",
        "fail",
        &[U32],
        Arc::new(|_m: &dyn HostMemory, _c: &LaunchConfig, a: &[KernelArg]| {
            Err(GpuError::kernel(format!(
                "deliberate failure #{}",
                arg_u32(a, 0)?
            )))
        }),
    )?;
    // touch(p, bytes): asks for `bytes` at `p`, which may be out of bounds.
    gpu.register_host_kernel(
        "conformance",
        "touch",
        &[Ptr, U32],
        Arc::new(|m: &dyn HostMemory, _c: &LaunchConfig, a: &[KernelArg]| {
            m.host_ptr(arg_ptr(a, 0)?, arg_u32(a, 1)? as usize)
                .map(drop)
        }),
    )?;
    Ok(())
}

fn one() -> LaunchConfig {
    LaunchConfig::linear(1, 1)
}

/// A u32 flag in host-mapped memory, set from the host, read by `gate`.
struct Flag {
    device: DevicePtr,
    host: *mut u8,
}

impl Flag {
    fn new(gpu: &dyn GpuBackend) -> Result<Flag> {
        let m = gpu.alloc_host_mapped(4, "conformance gate flag")?;
        let f = Flag {
            device: m.device,
            host: m.host,
        };
        f.atomic().store(0, std::sync::atomic::Ordering::Release);
        Ok(f)
    }
    fn atomic(&self) -> &std::sync::atomic::AtomicU32 {
        // SAFETY: 4 bytes of host-mapped memory, page aligned, alive until
        // the case frees `device`, which happens after its last use.
        unsafe { &*(self.host as *const std::sync::atomic::AtomicU32) }
    }
    fn set(&self) {
        self.atomic().store(1, std::sync::atomic::Ordering::Release);
    }
}

// ------------------------------------------------------------------ cases

/// `alloc`, `free` (null no-op), `live_bytes`, `live_alloc_count`,
/// `live_allocations`, `live_report`: accounting returns to zero.
pub fn alloc_free_accounting(gpu: &dyn GpuBackend) -> Result<()> {
    ensure!(!gpu.name().is_empty(), "empty backend name");
    let base = Baseline::take(gpu);
    gpu.free(DevicePtr::NULL)
        .context("free(NULL) must be a no-op")?;
    expect_err(
        gpu.alloc(usize::MAX, "conformance huge"),
        &["alloc", "conformance huge"],
    )?;
    expect_err(
        gpu.alloc_host_mapped(usize::MAX, "conformance huge mapped"),
        &["alloc_host_mapped", "conformance huge mapped"],
    )?;
    ensure!(
        gpu.live_alloc_count() == base.count,
        "a failed alloc was counted"
    );
    let a = gpu.alloc(1000, "conformance a")?;
    let b = gpu.alloc(24, "conformance b")?;
    let z = gpu.alloc(0, "conformance empty")?;
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
    ensure!(gpu.live_alloc_count() == base.count + 3, "live_alloc_count");
    ensure!(
        gpu.live_bytes() == base.bytes + 1024,
        "live_bytes {}",
        gpu.live_bytes()
    );
    let infos = gpu.live_allocations();
    let ia = infos
        .iter()
        .find(|i| i.ptr == a)
        .ok_or_else(|| anyhow!("a not listed"))?;
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
    gpu.free(b)?;
    ensure!(
        gpu.live_alloc_count() == base.count + 2,
        "count after one free"
    );
    ensure!(
        !gpu.live_report().contains("conformance b"),
        "freed b still reported"
    );
    gpu.free(a)?;
    gpu.free(z)?;
    base.check(gpu)
}

/// `copy_h2d`, `copy_d2h`, `copy_d2d`, `memset`, at offsets.
pub fn sync_copies(gpu: &dyn GpuBackend) -> Result<()> {
    let base = Baseline::take(gpu);
    let a = gpu.alloc(64, "conformance a")?;
    let b = gpu.alloc(64, "conformance b")?;
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
    gpu.free(a)?;
    gpu.free(b)?;
    base.check(gpu)
}

/// Async copies and memsets on one stream run in submission order and
/// `copy_d2h_on_stream` sees all of them.
pub fn async_copies_in_order(gpu: &dyn GpuBackend) -> Result<()> {
    let base = Baseline::take(gpu);
    let s = gpu.create_stream()?;
    let a = gpu.alloc(4096, "conformance a")?;
    let b = gpu.alloc(4096, "conformance b")?;
    for round in 0..20u8 {
        gpu.memset_async(a, round, 4096, s)?;
        gpu.copy_h2d_async(&[round.wrapping_mul(3); 100], a.offset(100), s)?;
        gpu.copy_d2d_async(a, b, 4096, s)?;
        gpu.memset_async(a, 0, 4096, s)?;
        let mut out = vec![0u8; 4096];
        gpu.copy_d2h_on_stream(b, &mut out, s)?;
        ensure!(
            out[..100].iter().all(|&x| x == round),
            "round {round}: head {:?}",
            &out[..4]
        );
        ensure!(
            out[100..200].iter().all(|&x| x == round.wrapping_mul(3)),
            "round {round}: middle"
        );
        ensure!(
            out[200..].iter().all(|&x| x == round),
            "round {round}: tail"
        );
    }
    gpu.synchronize(s)?;
    let mut out = vec![1u8; 16];
    gpu.copy_d2h_on_stream(a, &mut out, s)?;
    ensure!(out == vec![0u8; 16], "last memset not seen: {out:?}");
    gpu.free(a)?;
    gpu.free(b)?;
    gpu.destroy_stream(s)?;
    base.check(gpu)
}

/// `copy_h2d_async` takes its source at call time: it may be overwritten
/// or dropped right after, even while the stream is blocked.
pub fn h2d_async_source_copied_at_call(gpu: &dyn GpuBackend) -> Result<()> {
    kernels(gpu)?;
    let base = Baseline::take(gpu);
    let s = gpu.create_stream()?;
    let flag = Flag::new(gpu)?;
    let dst = gpu.alloc(256, "conformance dst")?;
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
    gpu.destroy_stream(s)?;
    gpu.free(dst)?;
    gpu.free(flag.device)?;
    base.check(gpu)
}

/// Out-of-bounds, use-after-free, null and wild pointers are errors naming
/// the operation and the pointer, for every memory call.
pub fn memory_errors(gpu: &dyn GpuBackend) -> Result<()> {
    let base = Baseline::take(gpu);
    let s = gpu.create_stream()?;
    let a = gpu.alloc(64, "conformance victim")?;
    let b = gpu.alloc(64, "conformance other")?;
    let pa = a.to_string();
    let end = a.offset(60).to_string();
    let mut buf = [0u8; 8];
    expect_err(
        gpu.copy_h2d(&[0; 8], a.offset(60)),
        &["copy_h2d", &end, "conformance victim"],
    )?;
    expect_err(gpu.copy_d2h(a.offset(60), &mut buf), &["copy_d2h", &end])?;
    expect_err(gpu.copy_d2d(a.offset(60), b, 8), &["copy_d2d", &end])?;
    expect_err(gpu.copy_d2d(b, a.offset(60), 8), &["copy_d2d", &end])?;
    expect_err(gpu.memset(a.offset(60), 0, 8), &["memset", &end])?;
    expect_err(
        gpu.memset_async(a.offset(60), 0, 8, s),
        &["memset_async", &end],
    )?;
    expect_err(
        gpu.copy_h2d_async(&[0; 8], a.offset(60), s),
        &["copy_h2d_async", &end],
    )?;
    expect_err(
        gpu.copy_d2d_async(a, b.offset(1), 64, s),
        &["copy_d2d_async", &b.offset(1).to_string()],
    )?;
    expect_err(
        gpu.copy_d2h_on_stream(a.offset(60), &mut buf, s),
        &["copy_d2h_on_stream", &end],
    )?;
    expect_err(
        gpu.copy_d2h(DevicePtr::NULL, &mut buf),
        &["copy_d2h", "null"],
    )?;
    let wild = DevicePtr(0x42);
    expect_err(gpu.memset(wild, 0, 1), &["memset", "0x42"])?;
    // Nothing was written by the refused calls.
    let mut out = [1u8; 64];
    gpu.copy_d2h(a, &mut out)?;
    gpu.free(a)?;
    expect_err(gpu.copy_h2d(&[0; 4], a), &["copy_h2d", &pa, "freed"])?;
    expect_err(
        gpu.copy_d2h(a.offset(4), &mut buf),
        &["copy_d2h", &a.offset(4).to_string(), "freed"],
    )?;
    expect_err(
        gpu.memset_async(a, 0, 4, s),
        &["memset_async", &pa, "freed"],
    )?;
    expect_err(
        gpu.copy_d2d_async(a, b, 4, s),
        &["copy_d2d_async", &pa, "freed"],
    )?;
    expect_err(
        gpu.copy_d2h_on_stream(a, &mut buf, s),
        &["copy_d2h_on_stream", &pa, "freed"],
    )?;
    // Refused submissions leave no pending error behind.
    gpu.synchronize(s)?;
    gpu.free(b)?;
    gpu.destroy_stream(s)?;
    base.check(gpu)
}

/// Double free, freeing an interior pointer and freeing a wild pointer are
/// errors naming `free` and the pointer, and change nothing.
pub fn free_errors(gpu: &dyn GpuBackend) -> Result<()> {
    let base = Baseline::take(gpu);
    let a = gpu.alloc(128, "conformance twice")?;
    let inner = a.offset(16);
    expect_err(
        gpu.free(inner),
        &["free", &inner.to_string(), "conformance twice"],
    )?;
    ensure!(
        gpu.live_alloc_count() == base.count + 1,
        "interior free changed the ledger"
    );
    gpu.memset(a, 3, 128)
        .context("allocation must survive a refused interior free")?;
    gpu.free(a)?;
    expect_err(gpu.free(a), &["free", &a.to_string(), "double free"])?;
    expect_err(gpu.free(DevicePtr(0x1234)), &["free", "0x1234"])?;
    base.check(gpu)
}

/// `alloc_host_mapped`: both addresses see the same bytes; the host address
/// is page aligned; it counts in `live_bytes`.
pub fn host_mapped_memory(gpu: &dyn GpuBackend) -> Result<()> {
    let base = Baseline::take(gpu);
    let m = gpu.alloc_host_mapped(8192, "conformance mapped")?;
    ensure!(m.bytes == 8192 && !m.device.is_null() && !m.host.is_null());
    ensure!(
        (m.host as usize).is_multiple_of(4096),
        "host address {:p} not page aligned",
        m.host
    );
    ensure!(
        gpu.live_bytes() == base.bytes + 8192,
        "mapped bytes not counted"
    );
    let info = gpu
        .live_allocations()
        .into_iter()
        .find(|i| i.ptr == m.device);
    ensure!(
        info.map(|i| i.kind) == Some(MemoryKind::HostMapped),
        "kind not HostMapped"
    );
    // SAFETY: 8192 bytes owned by the backend until freed below; no queued
    // work touches them while this view lives.
    let host = unsafe { std::slice::from_raw_parts_mut(m.host, 8192) };
    host[..4].copy_from_slice(&[1, 2, 3, 4]);
    let mut out = [0u8; 4];
    gpu.copy_d2h(m.device, &mut out)?;
    ensure!(out == [1, 2, 3, 4], "device view of host writes: {out:?}");
    gpu.copy_h2d(&[9; 8], m.device.offset(4096))?;
    ensure!(host[4096..4104] == [9; 8], "host view of device writes");
    let d = gpu.alloc(16, "conformance device")?;
    gpu.copy_d2d(m.device, d, 4)?;
    gpu.copy_d2h(d, &mut out)?;
    ensure!(out == [1, 2, 3, 4], "d2d from mapped memory: {out:?}");
    expect_err(
        gpu.copy_d2h(m.device.offset(8190), &mut out),
        &["copy_d2h", "conformance mapped"],
    )?;
    gpu.free(d)?;
    gpu.free(m.device)?;
    base.check(gpu)
}

/// `register_host`: caller memory gets a device address, is counted in
/// `live_alloc_count` but not `live_bytes`, and `free` unregisters without
/// touching it.
pub fn registered_host_memory(gpu: &dyn GpuBackend) -> Result<()> {
    let base = Baseline::take(gpu);
    let mut mine = vec![0u8; 4096];
    mine[..4].copy_from_slice(&[5, 6, 7, 8]);
    // SAFETY: `mine` outlives the registration (freed below) and is not
    // reallocated meanwhile.
    let d = unsafe { gpu.register_host(mine.as_mut_ptr(), mine.len(), "conformance registered")? };
    ensure!(
        gpu.live_alloc_count() == base.count + 1,
        "registered memory not counted"
    );
    ensure!(
        gpu.live_bytes() == base.bytes,
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
    expect_err(
        gpu.copy_h2d(&[1, 1], d.offset(4095)),
        &["copy_h2d", "conformance registered"],
    )?;
    gpu.free(d)?;
    ensure!(
        mine[100..102] == [1, 1] && mine[..4] == [5, 6, 7, 8],
        "caller memory changed by free"
    );
    expect_err(gpu.copy_d2h(d, &mut out), &["copy_d2h", &d.to_string()])?;
    base.check(gpu)
}

/// `default_stream`, `create_stream`, `destroy_stream`, `synchronize`:
/// distinct ids, unknown ids refused, the default stream kept, destroy runs
/// queued work first.
pub fn streams(gpu: &dyn GpuBackend) -> Result<()> {
    let base = Baseline::take(gpu);
    ensure!(gpu.default_stream() == 0, "default stream is not 0");
    gpu.synchronize(gpu.default_stream())?;
    let s1 = gpu.create_stream()?;
    let s2 = gpu.create_stream()?;
    ensure!(s1 != s2 && s1 != 0 && s2 != 0, "stream ids {s1} {s2}");
    let a = gpu.alloc(1 << 20, "conformance big")?;
    gpu.memset_async(a, 0x11, 1 << 20, s1)?;
    gpu.destroy_stream(s1)?;
    let mut out = vec![0u8; 16];
    gpu.copy_d2h(a.offset((1 << 20) - 16), &mut out)?;
    ensure!(
        out.iter().all(|&x| x == 0x11),
        "destroy_stream dropped queued work"
    );
    expect_err(
        gpu.synchronize(s1),
        &["synchronize", "unknown stream", &s1.to_string()],
    )?;
    expect_err(
        gpu.memset_async(a, 0, 1, s1),
        &["memset_async", "unknown stream"],
    )?;
    expect_err(
        gpu.destroy_stream(s1),
        &["destroy_stream", "unknown stream"],
    )?;
    expect_err(gpu.destroy_stream(0), &["destroy_stream", "default stream"])?;
    expect_err(
        gpu.copy_d2d_async(a, a, 0, 9999),
        &["copy_d2d_async", "9999"],
    )?;
    gpu.synchronize(s2)?;
    gpu.destroy_stream(s2)?;
    gpu.free(a)?;
    base.check(gpu)
}

/// Work queued on stream A is still pending when the launch returns; an
/// event recorded on A makes stream B wait for it, and a copy on B then
/// sees A's result.
pub fn stream_asynchrony_and_events(gpu: &dyn GpuBackend) -> Result<()> {
    kernels(gpu)?;
    let base = Baseline::take(gpu);
    let a = gpu.create_stream()?;
    let b = gpu.create_stream()?;
    let flag = Flag::new(gpu)?;
    let marker = gpu.alloc_host_mapped(4, "conformance marker")?;
    let x = gpu.alloc(64, "conformance x")?;
    let y = gpu.alloc(64, "conformance y")?;
    gpu.memset(x, 0, 64)?;
    gpu.memset(y, 0, 64)?;
    gpu.memset(marker.device, 0, 4)?;
    let gate = gpu.kernel("conformance", "gate")?;
    let fill = gpu.kernel("conformance", "fill")?;
    let ev = gpu.create_event()?;

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
    gpu.destroy_event(ev)?;
    gpu.destroy_stream(a)?;
    gpu.destroy_stream(b)?;
    for p in [x, y, marker.device, flag.device] {
        gpu.free(p)?;
    }
    base.check(gpu)
}

/// `create_event`, `record_event`, `event_query`, `event_synchronize`,
/// `destroy_event`: an unrecorded event is complete, re-recording tracks the
/// latest record, unknown events are refused.
pub fn events(gpu: &dyn GpuBackend) -> Result<()> {
    kernels(gpu)?;
    let base = Baseline::take(gpu);
    let s = gpu.create_stream()?;
    let e1 = gpu.create_event()?;
    let e2 = gpu.create_event()?;
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

    let flag = Flag::new(gpu)?;
    let gate = gpu.kernel("conformance", "gate")?;
    gpu.launch_kernel(gate, one(), &[KernelArg::Ptr(flag.device)], s)?;
    gpu.record_event(e1, s)?;
    ensure!(
        !gpu.event_query(e1)?,
        "re-recorded event behind a gate reads complete"
    );
    // The default stream waiting on e1 is blocked too; other work is not.
    let t = {
        let f = flag.atomic() as *const std::sync::atomic::AtomicU32 as usize;
        std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(30));
            // SAFETY: the flag lives until the case frees it, after joining.
            unsafe { &*(f as *const std::sync::atomic::AtomicU32) }
                .store(1, std::sync::atomic::Ordering::Release);
        })
    };
    gpu.event_synchronize(e1)?;
    ensure!(
        flag.atomic().load(std::sync::atomic::Ordering::Acquire) == 1,
        "event_synchronize returned early"
    );
    ensure!(gpu.event_query(e1)?, "event_query after event_synchronize");
    t.join().map_err(|_| anyhow!("flag thread panicked"))?;

    gpu.destroy_event(e1)?;
    let id = e1.0.to_string();
    expect_err(gpu.event_query(e1), &["event_query", "unknown event", &id])?;
    expect_err(
        gpu.event_synchronize(e1),
        &["event_synchronize", "unknown event"],
    )?;
    expect_err(gpu.record_event(e1, s), &["record_event", "unknown event"])?;
    expect_err(
        gpu.stream_wait_event(s, e1),
        &["stream_wait_event", "unknown event"],
    )?;
    expect_err(gpu.destroy_event(e1), &["destroy_event", "unknown event"])?;
    expect_err(
        gpu.record_event(e2, 9999),
        &["record_event", "unknown stream"],
    )?;
    gpu.destroy_event(e2)?;
    gpu.destroy_stream(s)?;
    gpu.free(flag.device)?;
    base.check(gpu)
}

/// `register_host_kernel`, `kernel`, `load_module`: lookups by module and
/// name, errors naming both, re-registration replaces the body.
pub fn kernel_registry(gpu: &dyn GpuBackend) -> Result<()> {
    kernels(gpu)?;
    let base = Baseline::take(gpu);
    let k1 = gpu.kernel("conformance", "fill")?;
    let k2 = gpu.kernel("conformance", "add")?;
    ensure!(k1 != k2, "distinct kernels share a handle");
    ensure!(
        gpu.kernel("conformance", "fill")? == k1,
        "handle not stable"
    );
    expect_err(gpu.kernel("conformance", "nope"), &["conformance::nope"])?;
    expect_err(
        gpu.kernel("no_such_module", "fill"),
        &["no_such_module::fill"],
    )?;
    expect_err(
        gpu.load_module("conformance_mod", b"not a module"),
        &["load_module", "conformance_mod"],
    )?;

    let p = gpu.alloc(4, "conformance out")?;
    gpu.register_host_kernel(
        "conformance",
        "version",
        &[ArgKind::Ptr],
        Arc::new(|m: &dyn HostMemory, _c: &LaunchConfig, a: &[KernelArg]| {
            // SAFETY: sole writer while the kernel runs.
            let d = unsafe { m.slice_mut::<u32>(arg_ptr(a, 0)?, 1)? };
            d[0] = 1;
            Ok(())
        }),
    )?;
    let kv = gpu.kernel("conformance", "version")?;
    gpu.launch(kv, one()).ptr(p).run(0)?;
    ensure!(read_u32(gpu, p, 1, 0)? == [1], "first body");
    gpu.register_host_kernel(
        "conformance",
        "version",
        &[ArgKind::Ptr],
        Arc::new(|m: &dyn HostMemory, _c: &LaunchConfig, a: &[KernelArg]| {
            // SAFETY: sole writer while the kernel runs.
            let d = unsafe { m.slice_mut::<u32>(arg_ptr(a, 0)?, 1)? };
            d[0] = 2;
            Ok(())
        }),
    )?;
    ensure!(
        gpu.kernel("conformance", "version")? == kv,
        "re-registration changed the handle"
    );
    gpu.launch(kv, one()).ptr(p).run(0)?;
    ensure!(
        read_u32(gpu, p, 1, 0)? == [2],
        "re-registration did not replace the body"
    );
    gpu.free(p)?;
    base.check(gpu)
}

/// Every argument kind reaches the kernel intact, with the launch geometry.
pub fn kernel_arguments(gpu: &dyn GpuBackend) -> Result<()> {
    kernels(gpu)?;
    let base = Baseline::take(gpu);
    let out = gpu.alloc(28, "conformance args")?;
    let k = gpu.kernel("conformance", "args")?;
    gpu.launch(k, LaunchConfig::linear(3, 128))
        .ptr(out)
        .u32(0xDEAD_BEEF)
        .u64(0x0123_4567_89AB_CDEF)
        .i32(-5)
        .f32(1.5)
        .run(0)?;
    let mut b = [0u8; 28];
    gpu.copy_d2h_on_stream(out, &mut b, 0)?;
    let mut want = Vec::new();
    want.extend_from_slice(&0xDEAD_BEEFu32.to_le_bytes());
    want.extend_from_slice(&0x0123_4567_89AB_CDEFu64.to_le_bytes());
    want.extend_from_slice(&(-5i32).to_le_bytes());
    want.extend_from_slice(&1.5f32.to_le_bytes());
    want.extend_from_slice(&3u32.to_le_bytes());
    want.extend_from_slice(&128u32.to_le_bytes());
    ensure!(b[..] == want[..], "kernel saw {b:?}, want {want:?}");
    // The same through launch_kernel directly, on another stream.
    let s = gpu.create_stream()?;
    let args = [
        KernelArg::Ptr(out),
        KernelArg::U32(1),
        KernelArg::U64(2),
        KernelArg::I32(3),
        KernelArg::F32(4.0),
    ];
    gpu.launch_kernel(k, one(), &args, s)?;
    gpu.copy_d2h_on_stream(out, &mut b, s)?;
    ensure!(
        b[..4] == [1, 0, 0, 0] && b[4..12] == 2u64.to_le_bytes(),
        "direct launch: {b:?}"
    );
    gpu.destroy_stream(s)?;
    gpu.free(out)?;
    base.check(gpu)
}

/// Launch errors name the kernel, the argument position, what was expected
/// and what was given; bad pointers are caught at launch.
pub fn kernel_argument_errors(gpu: &dyn GpuBackend) -> Result<()> {
    kernels(gpu)?;
    let base = Baseline::take(gpu);
    let k = gpu.kernel("conformance", "fill")?;
    let p = gpu.alloc(16, "conformance fill target")?;
    expect_err(
        gpu.launch(k, one()).ptr(p).u32(4).run(0),
        &["conformance::fill", "expected 3 arguments, got 2"],
    )?;
    expect_err(
        gpu.launch(k, one()).ptr(p).u32(4).f32(1.0).run(0),
        &["conformance::fill", "argument 2", "expected U32", "got F32"],
    )?;
    expect_err(
        gpu.launch(k, one()).u32(0).u32(4).u32(1).run(0),
        &["conformance::fill", "argument 0", "expected Ptr", "got U32"],
    )?;
    expect_err(
        gpu.launch(k, LaunchConfig::linear(0, 1))
            .ptr(p)
            .u32(4)
            .u32(1)
            .run(0),
        &["conformance::fill", "grid"],
    )?;
    expect_err(
        gpu.launch_kernel(
            metrale_gpu_runtime::gpu::KernelHandle(987_654),
            one(),
            &[],
            0,
        ),
        &["launch_kernel", "987654"],
    )?;
    expect_err(
        gpu.launch(k, one()).ptr(p).u32(4).u32(1).run(4242),
        &["launch_kernel", "unknown stream", "4242"],
    )?;
    let wild = DevicePtr(0x7777);
    expect_err(
        gpu.launch(k, one()).ptr(wild).u32(4).u32(1).run(0),
        &["conformance::fill", "argument 0", "0x7777"],
    )?;
    // A kernel reading past its buffer fails at execution, naming it.
    gpu.launch(k, one()).ptr(p).u32(5).u32(1).run(0)?;
    expect_err(
        gpu.synchronize(0),
        &[
            "conformance::fill",
            &p.to_string(),
            "conformance fill target",
        ],
    )?;
    gpu.free(p)?;
    expect_err(
        gpu.launch(k, one()).ptr(p).u32(4).u32(1).run(0),
        &["conformance::fill", &p.to_string(), "freed"],
    )?;
    gpu.synchronize(0)?;
    base.check(gpu)
}

/// An error raised by queued work is reported by the next synchronising
/// call on that stream (first error wins), then cleared; later work on the
/// stream still runs; other streams are unaffected.
pub fn sticky_async_errors(gpu: &dyn GpuBackend) -> Result<()> {
    kernels(gpu)?;
    let base = Baseline::take(gpu);
    let s = gpu.create_stream()?;
    let other = gpu.create_stream()?;
    let fail = gpu.kernel("conformance", "fail")?;
    let touch = gpu.kernel("conformance", "touch")?;
    let p = gpu.alloc(32, "conformance sticky")?;
    gpu.launch(fail, one()).u32(1).run(s)?;
    gpu.launch(fail, one()).u32(2).run(s)?;
    gpu.memset_async(p, 9, 32, s)?;
    gpu.synchronize(other)?;
    let e = expect_err(
        gpu.synchronize(s),
        &["synchronize", "deliberate failure #1"],
    )?;
    ensure!(!e.contains("#2"), "first error must win: {e}");
    gpu.synchronize(s)
        .context("the error must be cleared once reported")?;
    let mut out = [0u8; 32];
    gpu.copy_d2h_on_stream(p, &mut out, s)?;
    ensure!(out == [9; 32], "work after a failure did not run");

    // copy_d2h_on_stream reports it too, and does not copy.
    gpu.launch(touch, one()).ptr(p).u32(33).run(s)?;
    let mut out = [0u8; 4];
    expect_err(
        gpu.copy_d2h_on_stream(p, &mut out, s),
        &["copy_d2h_on_stream", "conformance::touch", &p.to_string()],
    )?;
    gpu.copy_d2h_on_stream(p, &mut out, s)?;
    ensure!(out == [9; 4], "copy after the reported error");

    // The default stream's errors surface in the synchronous calls.
    gpu.launch(fail, one()).u32(3).run(0)?;
    expect_err(
        gpu.copy_d2h(p, &mut out),
        &["copy_d2h", "deliberate failure #3"],
    )?;
    gpu.copy_d2h(p, &mut out)?;
    gpu.destroy_stream(s)?;
    gpu.destroy_stream(other)?;
    gpu.free(p)?;
    base.check(gpu)
}

/// Capture records instead of running; a graph replays (twice) the recorded
/// work with pointers captured by value, and values that change between
/// replays through device memory show up in each replay.
pub fn capture_and_replay(gpu: &dyn GpuBackend) -> Result<()> {
    kernels(gpu)?;
    let base = Baseline::take(gpu);
    let s = gpu.create_stream()?;
    let n = 8u32;
    let param = gpu.alloc(32, "conformance param")?;
    let acc = gpu.alloc(32, "conformance acc")?;
    let copy = gpu.alloc(32, "conformance copy")?;
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
    let g = gpu.end_capture(s)?;
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

    gpu.destroy_graph(g)?;
    gpu.destroy_stream(s)?;
    for p in [param, acc, copy] {
        gpu.free(p)?;
    }
    base.check(gpu)
}

/// Under capture, copies from ordinary host memory, blocking reads,
/// `synchronize` and synchronous copies on the capturing stream are refused
/// with a clear error, and the capture is then invalid.
pub fn capture_refusals(gpu: &dyn GpuBackend) -> Result<()> {
    let base = Baseline::take(gpu);
    let s = gpu.create_stream()?;
    let p = gpu.alloc(16, "conformance target")?;
    let mut out = [0u8; 4];
    expect_err(gpu.end_capture(s), &["end_capture", "not capturing"])?;

    gpu.begin_capture(s)?;
    expect_err(
        gpu.begin_capture(s),
        &["begin_capture", "already capturing"],
    )?;
    expect_err(
        gpu.copy_h2d_async(&[1; 4], p, s),
        &["copy_h2d_async", "capturing"],
    )?;
    expect_err(
        gpu.copy_d2h_on_stream(p, &mut out, s),
        &["copy_d2h_on_stream", "capturing"],
    )?;
    expect_err(gpu.synchronize(s), &["synchronize", "capturing"])?;
    // Other streams are unaffected.
    gpu.copy_h2d_async(&[2; 4], p, 0)?;
    gpu.synchronize(0)?;
    expect_err(
        gpu.end_capture(s),
        &["end_capture", "invalidated", "copy_h2d_async"],
    )?;
    ensure!(
        !gpu.stream_is_capturing(s)?,
        "capture survived a failed end_capture"
    );
    gpu.synchronize(s)?;

    // Synchronous copies touch the default stream; refused while it captures.
    gpu.begin_capture(0)?;
    expect_err(gpu.copy_h2d(&[1; 4], p), &["copy_h2d", "capturing"])?;
    expect_err(gpu.copy_d2h(p, &mut out), &["copy_d2h", "capturing"])?;
    expect_err(gpu.memset(p, 0, 4), &["memset", "capturing"])?;
    expect_err(gpu.copy_d2d(p, p.offset(8), 4), &["copy_d2d", "capturing"])?;
    expect_err(
        gpu.end_capture(0),
        &["end_capture", "invalidated", "copy_h2d"],
    )?;
    gpu.copy_d2h(p, &mut out)?;
    ensure!(out == [2; 4], "refused copies wrote: {out:?}");
    gpu.destroy_stream(s)?;
    gpu.free(p)?;
    base.check(gpu)
}

/// Staging through host-mapped memory is capturable: `copy_d2d_async` from
/// the mapped buffer's device address, and `copy_h2d_async` from its host
/// address, replay with the buffer's contents at replay time.
pub fn capture_of_mapped_staging(gpu: &dyn GpuBackend) -> Result<()> {
    let base = Baseline::take(gpu);
    let s = gpu.create_stream()?;
    let stage = gpu.alloc_host_mapped(64, "conformance staging")?;
    let dst = gpu.alloc(64, "conformance dst")?;
    let dst2 = gpu.alloc(32, "conformance dst2")?;
    gpu.begin_capture(s)?;
    gpu.copy_d2d_async(stage.device, dst, 64, s)?;
    {
        // SAFETY: 64 bytes of mapped memory owned by the backend until freed
        // below; nothing writes them while this view lives.
        let host = unsafe { std::slice::from_raw_parts(stage.host, 64) };
        gpu.copy_h2d_async(&host[32..], dst2, s)?;
    }
    let g = gpu.end_capture(s)?;
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
    gpu.free(dst2)?;
    gpu.destroy_graph(g)?;
    gpu.destroy_stream(s)?;
    gpu.free(stage.device)?;
    gpu.free(dst)?;
    base.check(gpu)
}

/// Event records and waits inside a graph act at each replay.
pub fn capture_with_events(gpu: &dyn GpuBackend) -> Result<()> {
    kernels(gpu)?;
    let base = Baseline::take(gpu);
    let a = gpu.create_stream()?;
    let b = gpu.create_stream()?;
    let ev = gpu.create_event()?;
    let flag = Flag::new(gpu)?;
    let x = gpu.alloc(16, "conformance x")?;
    let y = gpu.alloc(16, "conformance y")?;
    gpu.memset(x, 0, 16)?;
    let gate = gpu.kernel("conformance", "gate")?;
    let fill = gpu.kernel("conformance", "fill")?;
    gpu.begin_capture(a)?;
    gpu.launch_kernel(gate, one(), &[KernelArg::Ptr(flag.device)], a)?;
    gpu.launch(fill, one()).ptr(x).u32(4).u32(5).run(a)?;
    gpu.record_event(ev, a)?;
    let g = gpu.end_capture(a)?;
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
    gpu.destroy_graph(g)?;
    gpu.destroy_event(ev)?;
    gpu.destroy_stream(a)?;
    gpu.destroy_stream(b)?;
    for p in [x, y, flag.device] {
        gpu.free(p)?;
    }
    base.check(gpu)
}

/// Unknown and destroyed graphs are refused; a graph whose memory was freed
/// is refused at launch, naming the pointer, and runs nothing.
pub fn graph_errors(gpu: &dyn GpuBackend) -> Result<()> {
    let base = Baseline::take(gpu);
    let s = gpu.create_stream()?;
    let keep = gpu.alloc(16, "conformance keep")?;
    let gone = gpu.alloc(16, "conformance gone")?;
    gpu.memset(keep, 0, 16)?;
    gpu.begin_capture(s)?;
    gpu.memset_async(keep, 1, 16, s)?;
    gpu.memset_async(gone, 2, 16, s)?;
    let g = gpu.end_capture(s)?;
    gpu.free(gone)?;
    expect_err(
        gpu.launch_graph(g, s),
        &["launch_graph", &gone.to_string(), "freed"],
    )?;
    let mut out = [9u8; 16];
    gpu.copy_d2h_on_stream(keep, &mut out, s)?;
    ensure!(
        out == [0; 16],
        "a refused graph launch ran part of the graph"
    );
    gpu.destroy_graph(g)?;
    let id = g.0.to_string();
    expect_err(
        gpu.launch_graph(g, s),
        &["launch_graph", "unknown graph", &id],
    )?;
    expect_err(
        gpu.destroy_graph(g),
        &["destroy_graph", "unknown graph", &id],
    )?;
    expect_err(gpu.begin_capture(777), &["begin_capture", "unknown stream"])?;
    expect_err(
        gpu.stream_is_capturing(777),
        &["stream_is_capturing", "unknown stream"],
    )?;
    gpu.destroy_stream(s)?;
    gpu.free(keep)?;
    base.check(gpu)
}
