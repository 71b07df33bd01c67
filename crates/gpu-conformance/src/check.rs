//! What the cases share: error expectations, the [`Scope`] that creates a
//! case's resources and releases them (checking that nothing leaked), the
//! suite's host kernels, and small data helpers.
//!
//! Invariant: everything a case creates through its [`Scope`] is released
//! by [`Scope::finish`] unless the case released it itself through the
//! scope, so no case can leak by returning early on success paths, and a
//! leak the backend itself causes shows as a baseline mismatch.

use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

use metrale_gpu_runtime::GpuError;
use metrale_gpu_runtime::gpu::{
    ArgKind, DevicePtr, EventHandle, GpuBackend, GraphHandle, HostMapped, HostMemory, KernelArg,
    LaunchConfig, StreamId,
};

use crate::{CaseResult, Failure};

/// Check that `r` failed with an error `is` accepts (described by
/// `pattern`) whose message contains every needle; returns the error.
pub(crate) fn expect_err<T>(
    r: Result<T, GpuError>,
    pattern: &str,
    is: impl Fn(&GpuError) -> bool,
    needles: &[&str],
) -> Result<GpuError, Failure> {
    let e = match r {
        Ok(_) => bail!("expected an error matching {pattern} naming {needles:?}, got Ok"),
        Err(e) => e,
    };
    ensure!(is(&e), "expected an error matching {pattern}, got {e:?}");
    let s = e.to_string();
    for n in needles {
        ensure!(s.contains(n), "error {s:?} does not contain {n:?}");
    }
    Ok(e)
}

/// Check that the innermost error of `e` (see [`GpuError::root`]) is what
/// `is` accepts.
pub(crate) fn expect_root(e: &GpuError, what: &str, is: impl Fn(&GpuError) -> bool) -> CaseResult {
    ensure!(
        is(e.root()),
        "expected {what} at the root of {e}, got {:?}",
        e.root()
    );
    Ok(())
}

/// Turn an unexpected backend error into a failure saying what the case
/// was doing.
pub(crate) trait Context<T> {
    fn context(self, what: &str) -> Result<T, Failure>;
}

impl<T> Context<T> for Result<T, GpuError> {
    fn context(self, what: &str) -> Result<T, Failure> {
        self.map_err(|e| Failure::Failed(format!("{what}: {e}")))
    }
}

/// The bytes of `v`, little-endian.
pub(crate) fn u32_bytes(v: &[u32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

/// `n` u32s read from `p` after the work queued on `stream`.
pub(crate) fn read_u32(
    gpu: &dyn GpuBackend,
    p: DevicePtr,
    n: usize,
    stream: StreamId,
) -> Result<Vec<u32>, Failure> {
    let mut b = vec![0u8; n * 4];
    gpu.copy_d2h_on_stream(p, &mut b, stream)?;
    Ok(b.chunks_exact(4)
        .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect())
}

/// A one-thread launch.
pub(crate) fn one() -> LaunchConfig {
    LaunchConfig::linear(1, 1)
}

/// A case's resources: created through it, released by [`Self::finish`]
/// (graphs, then events, then streams after their queued work, then
/// memory), which then checks the backend is back to the allocations it
/// had when the scope began.
pub(crate) struct Scope<'g> {
    pub gpu: &'g dyn GpuBackend,
    live_count: usize,
    live_bytes: usize,
    ptrs: Vec<DevicePtr>,
    streams: Vec<StreamId>,
    events: Vec<EventHandle>,
    graphs: Vec<GraphHandle>,
}

impl<'g> Scope<'g> {
    /// A scope over `gpu`, taking its current allocations as the baseline.
    pub fn new(gpu: &'g dyn GpuBackend) -> Self {
        Scope {
            gpu,
            live_count: gpu.live_alloc_count(),
            live_bytes: gpu.live_bytes(),
            ptrs: Vec::new(),
            streams: Vec::new(),
            events: Vec::new(),
            graphs: Vec::new(),
        }
    }

    /// [`Self::new`] after registering the suite's kernels; skips the case
    /// on a backend without host kernels.
    pub fn with_kernels(gpu: &'g dyn GpuBackend) -> Result<Self, Failure> {
        register_kernels(gpu)?;
        Ok(Self::new(gpu))
    }

    /// Live allocations above the baseline.
    pub fn extra_allocs(&self) -> usize {
        self.gpu.live_alloc_count() - self.live_count
    }

    /// Live bytes above the baseline.
    pub fn extra_bytes(&self) -> usize {
        self.gpu.live_bytes() - self.live_bytes
    }

    /// Device memory, freed at the end.
    pub fn alloc(&mut self, bytes: usize, label: &str) -> Result<DevicePtr, Failure> {
        let p = self.gpu.alloc(bytes, label)?;
        self.ptrs.push(p);
        Ok(p)
    }

    /// Host-mapped memory, freed at the end.
    pub fn mapped(&mut self, bytes: usize, label: &str) -> Result<HostMapped, Failure> {
        let m = self.gpu.alloc_host_mapped(bytes, label)?;
        self.ptrs.push(m.device);
        Ok(m)
    }

    /// A gate flag (see [`Flag`]), freed at the end.
    pub fn flag(&mut self) -> Result<Flag, Failure> {
        let m = self.mapped(4, "conformance gate flag")?;
        let f = Flag {
            device: m.device,
            host: m.host,
        };
        f.atomic().store(0, Ordering::Release);
        Ok(f)
    }

    /// Free `p` now, as part of what the case checks.
    pub fn free(&mut self, p: DevicePtr) -> CaseResult {
        self.gpu.dealloc(p)?;
        self.ptrs.retain(|&q| q != p);
        Ok(())
    }

    /// A stream, destroyed at the end.
    pub fn stream(&mut self) -> Result<StreamId, Failure> {
        let s = self.gpu.create_stream()?;
        self.streams.push(s);
        Ok(s)
    }

    /// Destroy `s` now, as part of what the case checks.
    pub fn destroy_stream(&mut self, s: StreamId) -> CaseResult {
        self.gpu.destroy_stream(s)?;
        self.streams.retain(|&t| t != s);
        Ok(())
    }

    /// An event, destroyed at the end.
    pub fn event(&mut self) -> Result<EventHandle, Failure> {
        let e = self.gpu.create_event()?;
        self.events.push(e);
        Ok(e)
    }

    /// Destroy `e` now, as part of what the case checks.
    pub fn destroy_event(&mut self, e: EventHandle) -> CaseResult {
        self.gpu.destroy_event(e)?;
        self.events.retain(|&f| f != e);
        Ok(())
    }

    /// End the capture on `s`; the graph is destroyed at the end.
    pub fn end_capture(&mut self, s: StreamId) -> Result<GraphHandle, Failure> {
        let g = self.gpu.end_capture(s)?;
        self.graphs.push(g);
        Ok(g)
    }

    /// Destroy `g` now, as part of what the case checks.
    pub fn destroy_graph(&mut self, g: GraphHandle) -> CaseResult {
        self.gpu.destroy_graph(g)?;
        self.graphs.retain(|&h| h != g);
        Ok(())
    }

    /// Release everything still held and check for leaks.
    pub fn finish(self) -> CaseResult {
        let gpu = self.gpu;
        for g in self.graphs {
            gpu.destroy_graph(g).context("destroy_graph at the end")?;
        }
        for e in self.events {
            gpu.destroy_event(e).context("destroy_event at the end")?;
        }
        for s in self.streams {
            gpu.destroy_stream(s).context("destroy_stream at the end")?;
        }
        for p in self.ptrs {
            gpu.dealloc(p).context("free at the end")?;
        }
        ensure!(
            gpu.live_alloc_count() == self.live_count && gpu.live_bytes() == self.live_bytes,
            "allocations leaked: {} live ({} bytes), expected {} ({} bytes):\n{}",
            gpu.live_alloc_count(),
            gpu.live_bytes(),
            self.live_count,
            self.live_bytes,
            gpu.live_report()
        );
        Ok(())
    }
}

/// How long the gate kernel waits for its flag before failing.
const GATE_TIMEOUT: Duration = Duration::from_secs(10);

/// A u32 flag in host-mapped memory, set from the host, read by the `gate`
/// kernel: work queued behind a gate stays pending until [`Flag::set`].
pub(crate) struct Flag {
    pub device: DevicePtr,
    host: *mut u8,
}

impl Flag {
    pub fn atomic(&self) -> &AtomicU32 {
        // SAFETY: 4 bytes of page-aligned host-mapped memory, alive until
        // the scope that made the flag frees it, after its last use.
        unsafe { &*(self.host as *const AtomicU32) }
    }

    pub fn set(&self) {
        self.atomic().store(1, Ordering::Release);
    }
}

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

/// Register kernel `conformance::name` with a plain function body.
fn register(
    gpu: &dyn GpuBackend,
    name: &str,
    sig: &[ArgKind],
    body: fn(&dyn HostMemory, &LaunchConfig, &[KernelArg]) -> Result<(), GpuError>,
) -> CaseResult {
    gpu.register_host_kernel("conformance", name, sig, Arc::new(body))?;
    Ok(())
}

/// `version(out)`: writes `V` to the u32 at `out` (re-registration checks).
pub(crate) fn write_version<const V: u32>(
    m: &dyn HostMemory,
    _c: &LaunchConfig,
    a: &[KernelArg],
) -> Result<(), GpuError> {
    // SAFETY: sole writer of `out` while the kernel runs.
    let d = unsafe { m.slice_mut::<u32>(arg_ptr(a, 0)?, 1)? };
    d[0] = V;
    Ok(())
}

/// Register the suite's host kernels (idempotent). Skips without host
/// kernels.
pub(crate) fn register_kernels(gpu: &dyn GpuBackend) -> CaseResult {
    use ArgKind::*;
    if !gpu.supports_host_kernels() {
        return Err(Failure::Skipped(
            "the backend does not run host kernels".into(),
        ));
    }
    // gate(flag): spin until the u32 at `flag` is non-zero.
    register(gpu, "gate", &[Ptr], |m, _c, a| {
        let p = m.host_ptr(arg_ptr(a, 0)?, 4)?;
        if !(p as usize).is_multiple_of(4) {
            return Err(GpuError::kernel("gate flag is misaligned"));
        }
        // SAFETY: 4 checked, aligned bytes; others only touch them
        // atomically (the host side stores through an atomic too).
        let flag = unsafe { &*(p as *const AtomicU32) };
        let t0 = Instant::now();
        while flag.load(Ordering::Acquire) == 0 {
            if t0.elapsed() >= GATE_TIMEOUT {
                return Err(GpuError::kernel("gate: flag never set"));
            }
            std::thread::sleep(Duration::from_micros(200));
        }
        Ok(())
    })?;
    // fill(dst, n, value)
    register(gpu, "fill", &[Ptr, U32, U32], |m, _c, a| {
        let n = arg_u32(a, 1)? as usize;
        // SAFETY: this kernel is the only user of `dst` while it runs.
        let d = unsafe { m.slice_mut::<u32>(arg_ptr(a, 0)?, n)? };
        d.fill(arg_u32(a, 2)?);
        Ok(())
    })?;
    // add(dst, src, n): dst += src
    register(gpu, "add", &[Ptr, Ptr, U32], |m, _c, a| {
        let n = arg_u32(a, 2)? as usize;
        // SAFETY: read-only view; the suite never passes overlapping `dst`
        // and `src`.
        let s: Vec<u32> = unsafe { m.slice::<u32>(arg_ptr(a, 1)?, n)? }.to_vec();
        // SAFETY: sole writer of `dst` while the kernel runs.
        let d = unsafe { m.slice_mut::<u32>(arg_ptr(a, 0)?, n)? };
        for (d, s) in d.iter_mut().zip(s) {
            *d = d.wrapping_add(s);
        }
        Ok(())
    })?;
    // args(out, u32, u64, i32, f32): writes the scalars little-endian plus
    // the launch geometry.
    register(gpu, "args", &[Ptr, U32, U64, I32, F32], |m, c, a| {
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
    })?;
    // fail(n): always errors, naming `n`.
    register(gpu, "fail", &[U32], |_m, _c, a| {
        Err(GpuError::kernel(format!(
            "deliberate failure #{}",
            arg_u32(a, 0)?
        )))
    })?;
    // touch(p, bytes): asks for `bytes` at `p`, which may be out of bounds.
    register(gpu, "touch", &[Ptr, U32], |m, _c, a| {
        m.host_ptr(arg_ptr(a, 0)?, arg_u32(a, 1)? as usize)
            .map(drop)
    })?;
    Ok(())
}
