//! The CUDA backend, behind the `cuda` feature: [`CudaBackend`] implements
//! [`GpuBackend`] on the CUDA driver API, loaded at run time (no toolkit is
//! needed to build, and a machine without a driver or a device gets an error
//! from [`CudaBackend::new`], never a panic).
//!
//! Mapping of the trait onto the driver:
//! - one primary context per backend, made current on the calling thread
//!   by every call (the trait is `Send + Sync`, CUDA contexts are
//!   per-thread);
//! - stream `0` is a stream of the backend's own, created non-blocking like
//!   every other, so no stream synchronises implicitly with another;
//!   synchronous copies and memsets run on it and wait for it;
//! - events are created without timing; graphs are `cuStreamBeginCapture`
//!   (relaxed mode) / `cuStreamEndCapture` / `cuGraphInstantiate`, replayed
//!   with `cuGraphLaunch`; inside a capture, event records and waits are
//!   captured as external event nodes, so they act at each replay;
//! - kernels come from PTX (or cubin) images loaded with `cuModuleLoadData`;
//!   the parameter list of each PTX `.entry` is read from the text, and
//!   launches are checked against it (count, and the width and kind of
//!   each argument; for a kernel taking one struct by value, the size of
//!   the arguments laid out as its fields; the kernels of a cubin image are
//!   launched unchecked);
//!   [`CudaBackend::load_source`] compiles CUDA C++ with NVRTC first
//!   ([`nvrtc`]);
//! - host kernels are not supported ([`GpuBackend::supports_host_kernels`]
//!   is false).
//!
//! Length: this file is mostly the one `impl GpuBackend for CudaBackend`
//! (about 830 of its 1,550 lines), kept whole so each trait method sits
//! next to the driver calls it makes; the ledger, NVRTC, argument
//! marshalling and PTX signatures live in their own modules.
//!
//! Invariants (the ones of the CPU backend that a driver allows):
//! - every allocation is in the ledger with its label and kind, so
//!   `live_bytes`, `live_alloc_count` and `live_allocations` report as the
//!   CPU backend does; new device and host-mapped memory reads as zeroes;
//! - every pointer a copy, memset or launch names is checked against the
//!   ledger when the call is made (a refused call queues nothing), and every
//!   range a captured graph touches is checked again at each
//!   `launch_graph`; kernels themselves are not checked while they run;
//! - host-mapped memory is page-locked at exactly the size asked for (page
//!   aligned, as `O_DIRECT` reads need); registered memory is the caller's,
//!   and `free` only unregisters it;
//! - `free` first waits for every stream that is not capturing, so no
//!   queued work still uses the memory;
//! - `copy_h2d_async` takes its source at call time outside a capture (a
//!   source in page-locked memory is staged through pageable memory, which
//!   the driver copies before returning); inside a capture only page-locked
//!   sources are accepted, and the graph reads them at each replay;
//! - refusals under capture (pageable sources, blocking reads, waits on a
//!   capturing stream, synchronous calls while stream 0 captures)
//!   invalidate the capture, and `end_capture` then reports the first one.
//!
//! Unlike the CPU backend, the driver may reuse a freed address for a later
//! allocation, after which a stale pointer into it reads as live; errors in
//! queued kernels are the driver's own (and an illegal address poisons the
//! whole context).
//!
//! Why one long file: every method of [`CudaBackend`] goes through the same
//! context guard, the capture-refusal bookkeeping and the allocation ledger
//! that the invariants above describe; split by method they would be read
//! and changed apart. What stands alone already lives beside it (`ledger`,
//! `nvrtc`, `params`).

mod ledger;
pub mod nvrtc;
mod params;

use std::collections::{BTreeMap, HashMap};
use std::ffi::c_void;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use cudarc::driver::result::DriverError;
use cudarc::driver::sys;
use parking_lot::Mutex;

use crate::args::c_layout;
use crate::error::{GpuError, Result};
use crate::gpu::{
    AllocationInfo, ArgKind, DevicePtr, EventHandle, GpuBackend, GraphHandle, HostKernelFn,
    HostMapped, KernelArg, KernelHandle, LaunchConfig, MemoryKind, StreamId,
};

use ledger::{Entry, Ledger, Release};
use params::Params;

pub use nvrtc::Arch;
pub use params::{ParamClass, ptx_entries};

/// Page size for host-mapped memory alignment.
const PAGE: usize = 4096;

/// Driver functions the backend calls; checked at construction so that an
/// old driver is an error naming the missing function, not a panic later.
const REQUIRED_SYMBOLS: &[&str] = &[
    "cuInit",
    "cuDeviceGetCount",
    "cuDeviceGet",
    "cuDeviceGetAttribute",
    "cuDeviceGetName",
    "cuDevicePrimaryCtxRetain",
    "cuDevicePrimaryCtxRelease_v2",
    "cuCtxSetCurrent",
    "cuGetErrorName",
    "cuGetErrorString",
    "cuMemAlloc_v2",
    "cuMemFree_v2",
    "cuMemHostAlloc",
    "cuMemFreeHost",
    "cuMemHostRegister_v2",
    "cuMemHostUnregister",
    "cuMemHostGetDevicePointer_v2",
    "cuMemsetD8Async",
    "cuMemcpyHtoDAsync_v2",
    "cuMemcpyDtoHAsync_v2",
    "cuMemcpyDtoDAsync_v2",
    "cuStreamCreate",
    "cuStreamDestroy_v2",
    "cuStreamSynchronize",
    "cuStreamWaitEvent",
    "cuStreamBeginCapture_v2",
    "cuStreamEndCapture",
    "cuEventCreate",
    "cuEventRecord",
    "cuEventRecordWithFlags",
    "cuEventQuery",
    "cuEventSynchronize",
    "cuEventDestroy_v2",
    "cuGraphInstantiateWithFlags",
    "cuGraphLaunch",
    "cuGraphExecDestroy",
    "cuGraphDestroy",
    "cuModuleLoadData",
    "cuModuleGetFunction",
    "cuModuleUnload",
    "cuLaunchKernel",
];

/// The text of a driver error: its name and description (just the code
/// when the driver library is absent, so this never loads it).
fn describe(r: sys::CUresult) -> String {
    if !driver_present() {
        return format!("{r:?}");
    }
    let e = DriverError(r);
    let name = e
        .error_name()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_else(|_| format!("{r:?}"));
    match e.error_string() {
        Ok(s) => format!("{name} ({})", s.to_string_lossy()),
        Err(_) => name,
    }
}

/// `Ok` for `CUDA_SUCCESS`, else a [`GpuError::Driver`] naming `op` and
/// `call`.
fn check(op: &str, call: &str, r: sys::CUresult) -> Result<()> {
    if r == sys::CUresult::CUDA_SUCCESS {
        Ok(())
    } else {
        Err(GpuError::Driver {
            op: op.to_string(),
            call: call.to_string(),
            error: describe(r),
        })
    }
}

/// A driver handle (a pointer the driver owns) that may move between
/// threads: the driver API is thread-safe for these objects once the owning
/// context is current.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Handle<T>(T);
// SAFETY: see the type's documentation; the backend makes its context
// current on every thread before using a handle.
unsafe impl<T> Send for Handle<T> {}
// SAFETY: as above.
unsafe impl<T> Sync for Handle<T> {}

/// A capture in progress on one stream.
#[derive(Default)]
struct Capture {
    /// Ranges the captured work touches, checked at each replay.
    touched: Vec<(DevicePtr, usize)>,
    /// The first refusal, which invalidates the capture.
    invalid: Option<GpuError>,
}

/// A stream handle, destroyed when the last user drops it: an operation
/// that looked the stream up keeps it alive even if another thread destroys
/// the stream meanwhile.
struct RawStream(sys::CUstream, Handle<sys::CUcontext>);
// SAFETY: a stream handle may be used from any thread once its context is
// current, which every user of it makes sure of.
unsafe impl Send for RawStream {}
// SAFETY: as above.
unsafe impl Sync for RawStream {}

impl Drop for RawStream {
    fn drop(&mut self) {
        // SAFETY: the stream was created by `cuStreamCreate` in this context
        // and is destroyed once, here, with the context current; the driver
        // lets queued work finish first.
        unsafe {
            sys::cuCtxSetCurrent(self.1.0);
            sys::cuStreamDestroy_v2(self.0);
        }
    }
}

struct StreamEntry {
    raw: Arc<RawStream>,
    capture: Option<Capture>,
}

struct GraphEntry {
    graph: Handle<sys::CUgraph>,
    exec: Handle<sys::CUgraphExec>,
    touched: Vec<(DevicePtr, usize)>,
}

struct ModuleEntry {
    raw: Handle<sys::CUmodule>,
    /// Entry points and their parameters, when the image was PTX.
    entries: Option<BTreeMap<String, Vec<ParamClass>>>,
}

#[derive(Clone)]
struct KernelEntry {
    /// `module::name`.
    qualified: String,
    module: String,
    name: String,
    func: Option<Handle<sys::CUfunction>>,
    params: Option<Vec<ParamClass>>,
}

/// A CUDA device behind the [`GpuBackend`] trait.
pub struct CudaBackend {
    ordinal: usize,
    ctx: Handle<sys::CUcontext>,
    arch: Arch,
    device_name: String,
    ledger: Ledger,
    streams: Mutex<HashMap<StreamId, StreamEntry>>,
    /// A stream of the backend's own, never captured, that zeroes new
    /// allocations.
    util: Arc<RawStream>,
    next_stream: AtomicU64,
    events: Mutex<HashMap<u64, Handle<sys::CUevent>>>,
    next_event: AtomicU64,
    graphs: Mutex<HashMap<u64, GraphEntry>>,
    next_graph: AtomicU64,
    modules: Mutex<HashMap<String, ModuleEntry>>,
    kernels: Mutex<Vec<KernelEntry>>,
    /// Declared last: dropped after every other field, it releases the
    /// primary context the streams and memory belong to.
    _primary: PrimaryCtx,
}

/// A retained primary context, released on drop.
struct PrimaryCtx(sys::CUdevice);

impl Drop for PrimaryCtx {
    fn drop(&mut self) {
        // SAFETY: retained once in `CudaBackend::open`, released once here.
        unsafe { sys::cuDevicePrimaryCtxRelease_v2(self.0) };
    }
}

/// Whether the CUDA driver library can be loaded (probed once).
pub fn driver_present() -> bool {
    static PRESENT: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    // SAFETY: only tries to open the library by its usual names.
    *PRESENT.get_or_init(|| unsafe { sys::is_culib_present() })
}

/// An error unless the driver library loads and has every function the
/// backend calls.
fn probe_driver(op: &str) -> Result<()> {
    if !driver_present() {
        return Err(GpuError::unsupported(
            op,
            "the CUDA driver library (libcuda.so.1) is not installed or not on the loader path",
        ));
    }
    // SAFETY: the library is present (checked above), so `culib` loads it
    // rather than panicking.
    let lib = unsafe { sys::culib() };
    for s in REQUIRED_SYMBOLS {
        // SAFETY: only looks the symbol up; the pointer is not called.
        if unsafe { lib.get::<*const c_void>(s.as_bytes()) }.is_err() {
            return Err(GpuError::unsupported(
                op,
                format!("the CUDA driver library lacks {s}: the driver is too old"),
            ));
        }
    }
    Ok(())
}

/// The lowest compute capability among the CUDA devices present: PTX for
/// it loads on every one of them (the driver compiles it for each device at
/// load). `op` names the caller in errors.
pub fn lowest_arch(op: &str) -> Result<Arch> {
    probe_driver(op)?;
    // SAFETY: plain driver calls with valid out-pointers; the library was
    // probed.
    check(op, "cuInit", unsafe { sys::cuInit(0) })?;
    let mut count = 0;
    // SAFETY: as above.
    check(op, "cuDeviceGetCount", unsafe {
        sys::cuDeviceGetCount(&mut count)
    })?;
    let mut lowest: Option<Arch> = None;
    for ordinal in 0..count.max(0) {
        let mut device = 0;
        // SAFETY: valid out-pointer; `ordinal < count`.
        check(op, "cuDeviceGet", unsafe {
            sys::cuDeviceGet(&mut device, ordinal)
        })?;
        let attr = |a: sys::CUdevice_attribute| -> Result<u32> {
            let mut v = 0;
            // SAFETY: valid device and out-pointer.
            check(op, "cuDeviceGetAttribute", unsafe {
                sys::cuDeviceGetAttribute(&mut v, a, device)
            })?;
            Ok(v.max(0) as u32)
        };
        let arch = Arch {
            major: attr(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)?,
            minor: attr(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)?,
        };
        if lowest.is_none_or(|l| (arch.major, arch.minor) < (l.major, l.minor)) {
            lowest = Some(arch);
        }
    }
    lowest.ok_or_else(|| GpuError::unsupported(op, "no CUDA device is present"))
}

impl CudaBackend {
    /// Open CUDA device `ordinal` (its primary context).
    ///
    /// Errors, never panics, when the driver library or NVRTC cannot be
    /// loaded, the driver is too old, or there is no such device; the error
    /// names what is missing.
    pub fn new(ordinal: usize) -> Result<CudaBackend> {
        let op = format!("CudaBackend::new(device {ordinal})");
        probe_driver(&op)?;
        nvrtc::probe().map_err(|e| match e {
            GpuError::Unsupported { reason, .. } => GpuError::unsupported(op.clone(), reason),
            e => e,
        })?;
        let opened = std::panic::catch_unwind(|| Self::open(&op, ordinal));
        match opened {
            Ok(r) => r,
            Err(p) => Err(GpuError::unsupported(
                op.clone(),
                format!(
                    "the driver bindings panicked: {}",
                    p.downcast_ref::<String>()
                        .map(String::as_str)
                        .or_else(|| p.downcast_ref::<&str>().copied())
                        .unwrap_or("(no message)")
                ),
            )),
        }
    }

    fn open(op: &str, ordinal: usize) -> Result<CudaBackend> {
        // SAFETY: plain driver calls with valid out-pointers; the library
        // was probed.
        check(op, "cuInit", unsafe { sys::cuInit(0) })?;
        let mut count = 0;
        // SAFETY: as above.
        check(op, "cuDeviceGetCount", unsafe {
            sys::cuDeviceGetCount(&mut count)
        })?;
        if ordinal >= count.max(0) as usize {
            return Err(GpuError::unsupported(
                op,
                format!("no CUDA device {ordinal} ({count} device(s) present)"),
            ));
        }
        let mut device = 0;
        // SAFETY: as above; `ordinal < count`.
        check(op, "cuDeviceGet", unsafe {
            sys::cuDeviceGet(&mut device, ordinal as i32)
        })?;
        let attr = |a: sys::CUdevice_attribute| -> Result<i32> {
            let mut v = 0;
            // SAFETY: valid device and out-pointer.
            check(op, "cuDeviceGetAttribute", unsafe {
                sys::cuDeviceGetAttribute(&mut v, a, device)
            })?;
            Ok(v)
        };
        let arch = Arch {
            major: attr(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)?
                as u32,
            minor: attr(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)?
                as u32,
        };
        let mut name = [0 as std::ffi::c_char; 256];
        // SAFETY: the buffer holds 256 chars, as passed.
        check(op, "cuDeviceGetName", unsafe {
            sys::cuDeviceGetName(name.as_mut_ptr(), name.len() as i32, device)
        })?;
        // SAFETY: the driver wrote a NUL-terminated string into `name`.
        let device_name = unsafe { std::ffi::CStr::from_ptr(name.as_ptr()) }
            .to_string_lossy()
            .into_owned();
        let mut ctx = std::ptr::null_mut();
        // SAFETY: valid device and out-pointer; released in `Drop`.
        check(op, "cuDevicePrimaryCtxRetain", unsafe {
            sys::cuDevicePrimaryCtxRetain(&mut ctx, device)
        })?;
        let primary = PrimaryCtx(device);
        let ctx = Handle(ctx);
        // SAFETY: the context was just retained.
        check(op, "cuCtxSetCurrent", unsafe {
            sys::cuCtxSetCurrent(ctx.0)
        })?;
        let s0 = create_stream(op, ctx)?;
        let util = create_stream(op, ctx)?;
        let b = CudaBackend {
            ordinal,
            ctx,
            arch,
            device_name,
            ledger: Ledger::default(),
            streams: Mutex::new(HashMap::new()),
            util,
            next_stream: AtomicU64::new(1),
            events: Mutex::new(HashMap::new()),
            next_event: AtomicU64::new(1),
            graphs: Mutex::new(HashMap::new()),
            next_graph: AtomicU64::new(1),
            modules: Mutex::new(HashMap::new()),
            kernels: Mutex::new(Vec::new()),
            _primary: primary,
        };
        b.streams.lock().insert(
            0,
            StreamEntry {
                raw: s0,
                capture: None,
            },
        );
        Ok(b)
    }

    /// The device ordinal.
    pub fn ordinal(&self) -> usize {
        self.ordinal
    }

    /// The device's compute capability.
    pub fn arch(&self) -> Arch {
        self.arch
    }

    /// The device's name as the driver reports it.
    pub fn device_name(&self) -> &str {
        &self.device_name
    }

    /// Compile CUDA C++ `source` (named `file` in errors) with NVRTC for
    /// this device, through the PTX cache, and load it as `module`.
    pub fn load_source(&self, module: &str, file: &str, source: &str) -> Result<()> {
        let ptx = nvrtc::compile_ptx_cached(file, source, self.arch)?;
        self.load_module(module, ptx.as_bytes())
    }

    /// Make the backend's context current on this thread.
    fn bind(&self, op: &str) -> Result<()> {
        // SAFETY: the context was retained in `open` and is released only in
        // `Drop`.
        check(op, "cuCtxSetCurrent", unsafe {
            sys::cuCtxSetCurrent(self.ctx.0)
        })
    }

    /// The raw stream of `stream` and whether it is capturing.
    fn stream(&self, op: &str, stream: StreamId) -> Result<(Arc<RawStream>, bool)> {
        let t = self.streams.lock();
        let e = t.get(&stream).ok_or_else(|| GpuError::UnknownStream {
            op: op.to_string(),
            stream,
        })?;
        Ok((e.raw.clone(), e.capture.is_some()))
    }

    /// Refuse `op` on a capturing `stream`: the capture is invalidated and
    /// the refusal returned.
    fn refuse_capture(&self, op: &str, stream: StreamId, why: &str) -> GpuError {
        let e = GpuError::CaptureViolation {
            op: op.to_string(),
            stream,
            why: why.to_string(),
        };
        if let Some(c) = self
            .streams
            .lock()
            .get_mut(&stream)
            .and_then(|s| s.capture.as_mut())
            && c.invalid.is_none()
        {
            c.invalid = Some(e.clone());
        }
        e
    }

    /// Note ranges touched by work captured on `stream`.
    fn note_touched(&self, stream: StreamId, ranges: &[(DevicePtr, usize)]) {
        if let Some(c) = self
            .streams
            .lock()
            .get_mut(&stream)
            .and_then(|s| s.capture.as_mut())
        {
            c.touched.extend_from_slice(ranges);
        }
    }

    /// Wait for `stream`; a failure is the stream's sticky error.
    fn sync_raw(&self, op: &str, stream: StreamId, raw: &RawStream) -> Result<()> {
        // SAFETY: `raw` is a live stream of this context.
        let r = unsafe { sys::cuStreamSynchronize(raw.0) };
        check("queued work", "cuStreamSynchronize", r).map_err(|cause| GpuError::Stream {
            op: op.to_string(),
            stream,
            cause: Box::new(cause),
        })
    }

    /// The default stream for a synchronous call, refused while it captures.
    fn sync_stream(&self, op: &str) -> Result<Arc<RawStream>> {
        let (raw, capturing) = self.stream(op, 0)?;
        if capturing {
            return Err(self.refuse_capture(
                op,
                0,
                "a synchronous call waits for the default stream, which cannot be captured",
            ));
        }
        Ok(raw)
    }

    /// Wait for every stream that is not capturing (errors stay with the
    /// streams' own synchronising calls).
    fn quiesce(&self) {
        let raws: Vec<_> = self
            .streams
            .lock()
            .values()
            .filter(|s| s.capture.is_none())
            .map(|s| s.raw.clone())
            .collect();
        for r in raws {
            // SAFETY: a live stream of this context.
            let _ = unsafe { sys::cuStreamSynchronize(r.0) };
        }
    }

    /// Release the memory an entry names.
    fn release(&self, op: &str, ptr: DevicePtr, e: &Entry) -> Result<()> {
        match e.release {
            // SAFETY: `ptr` came from `cuMemAlloc` and was just taken out of
            // the ledger, so it is freed once.
            Release::DeviceFree => check(op, "cuMemFree", unsafe { sys::cuMemFree_v2(ptr.0) }),
            // SAFETY: `host` came from `cuMemHostAlloc`; freed once.
            Release::HostFree => check(op, "cuMemFreeHost", unsafe {
                sys::cuMemFreeHost(e.host as *mut c_void)
            }),
            // SAFETY: `host` was registered by `register_host`; it is
            // unregistered once.
            Release::Unregister => check(op, "cuMemHostUnregister", unsafe {
                sys::cuMemHostUnregister(e.host as *mut c_void)
            }),
            Release::UnregisterAndFree => {
                // SAFETY: registered by `alloc_host_mapped`; unregistered once.
                let r = unsafe { sys::cuMemHostUnregister(e.host as *mut c_void) };
                let layout = page_layout(e.bytes).expect("the layout was valid at allocation");
                // SAFETY: allocated with exactly this layout in
                // `alloc_host_mapped`, freed once, after unregistering.
                unsafe { std::alloc::dealloc(e.host as *mut u8, layout) };
                check(op, "cuMemHostUnregister", r)
            }
        }
    }

    fn kernel_entry(&self, kernel: KernelHandle) -> Result<KernelEntry> {
        (kernel.0 as usize)
            .checked_sub(1)
            .and_then(|i| self.kernels.lock().get(i).cloned())
            .ok_or(GpuError::UnknownKernelHandle { handle: kernel.0 })
    }
}

/// A new non-blocking stream in `ctx` (current on this thread).
fn create_stream(op: &str, ctx: Handle<sys::CUcontext>) -> Result<Arc<RawStream>> {
    let mut s = std::ptr::null_mut();
    // SAFETY: valid out-pointer; the context is current.
    check(op, "cuStreamCreate", unsafe {
        sys::cuStreamCreate(&mut s, sys::CUstream_flags::CU_STREAM_NON_BLOCKING as u32)
    })?;
    Ok(Arc::new(RawStream(s, ctx)))
}

/// The page-aligned layout of a fallback host-mapped buffer of `bytes`.
fn page_layout(bytes: usize) -> Option<std::alloc::Layout> {
    let size = bytes.max(1).checked_next_multiple_of(PAGE)?;
    std::alloc::Layout::from_size_align(size, PAGE).ok()
}

impl Drop for CudaBackend {
    fn drop(&mut self) {
        if self.bind("drop").is_err() {
            return;
        }
        self.quiesce();
        for (_, g) in self.graphs.get_mut().drain() {
            // SAFETY: live graph handles, destroyed once.
            unsafe {
                sys::cuGraphExecDestroy(g.exec.0);
                sys::cuGraphDestroy(g.graph.0);
            }
        }
        for (_, e) in self.events.get_mut().drain() {
            // SAFETY: a live event, destroyed once.
            unsafe { sys::cuEventDestroy_v2(e.0) };
        }
        for (_, s) in self.streams.get_mut().drain() {
            if s.capture.is_some() {
                let mut g = std::ptr::null_mut();
                // SAFETY: ends the capture so the stream can be destroyed;
                // any graph it returns is destroyed right away.
                unsafe {
                    sys::cuStreamEndCapture(s.raw.0, &mut g);
                    if !g.is_null() {
                        sys::cuGraphDestroy(g);
                    }
                }
            }
            // Dropping the entry destroys the stream.
            drop(s);
        }

        for (_, m) in self.modules.get_mut().drain() {
            // SAFETY: a loaded module; no work is queued any more.
            unsafe { sys::cuModuleUnload(m.raw.0) };
        }
        for (p, e) in self.ledger.drain() {
            let _ = self.release("drop", p, &e);
        }
        // `util`, then `_primary` (which releases the context) drop after
        // this, in field order.
    }
}

impl GpuBackend for CudaBackend {
    fn name(&self) -> &str {
        "cuda"
    }

    fn alloc(&self, bytes: usize, label: &str) -> Result<DevicePtr> {
        const OP: &str = "alloc";
        self.bind(OP)?;
        let mut p = 0;
        // SAFETY: valid out-pointer; the context is current.
        let r = unsafe { sys::cuMemAlloc_v2(&mut p, bytes.max(1)) };
        if r != sys::CUresult::CUDA_SUCCESS {
            return Err(GpuError::OutOfMemory {
                op: OP.into(),
                label: label.into(),
                bytes,
                reason: format!("cuMemAlloc failed: {}", describe(r)),
            });
        }
        // New memory reads as zeroes; the backend's own stream does it, so
        // no stream of the caller (capturing or not) is involved.
        // SAFETY: `p` is a fresh allocation of at least `bytes.max(1)` bytes
        // and `util` a live stream of this context.
        let zero = unsafe { sys::cuMemsetD8Async(p, 0, bytes.max(1), self.util.0) };
        let zero = check(OP, "cuMemsetD8Async", zero).and_then(|()| {
            // SAFETY: `util` is a live stream of this context.
            check(OP, "cuStreamSynchronize", unsafe {
                sys::cuStreamSynchronize(self.util.0)
            })
        });
        if let Err(e) = zero {
            // SAFETY: freed once; nothing else knows the address yet.
            unsafe { sys::cuMemFree_v2(p) };
            return Err(e);
        }
        self.ledger.insert(
            DevicePtr(p),
            Entry {
                bytes,
                label: label.into(),
                kind: MemoryKind::Device,
                host: 0,
                release: Release::DeviceFree,
            },
        );
        Ok(DevicePtr(p))
    }

    fn dealloc(&self, ptr: DevicePtr) -> Result<()> {
        if ptr.is_null() {
            return Ok(());
        }
        self.ledger.check_freeable(ptr)?;
        self.bind("free")?;
        self.quiesce();
        let e = self.ledger.remove(ptr)?;
        self.release("free", ptr, &e)
    }

    fn alloc_host_mapped(&self, bytes: usize, label: &str) -> Result<HostMapped> {
        const OP: &str = "alloc_host_mapped";
        self.bind(OP)?;
        let oom = |reason: String| GpuError::OutOfMemory {
            op: OP.into(),
            label: label.into(),
            bytes,
            reason,
        };
        let flags = sys::CU_MEMHOSTALLOC_DEVICEMAP | sys::CU_MEMHOSTALLOC_PORTABLE;
        let mut host: *mut c_void = std::ptr::null_mut();
        // SAFETY: valid out-pointer; the context is current.
        let r = unsafe { sys::cuMemHostAlloc(&mut host, bytes.max(1), flags) };
        if r != sys::CUresult::CUDA_SUCCESS {
            return Err(oom(format!("cuMemHostAlloc failed: {}", describe(r))));
        }
        let mut release = Release::HostFree;
        if !(host as usize).is_multiple_of(PAGE) {
            // The driver suballocated: use a page-aligned buffer of our own,
            // registered at exactly `bytes`.
            // SAFETY: from `cuMemHostAlloc` just above; freed once.
            unsafe { sys::cuMemFreeHost(host) };
            let layout =
                page_layout(bytes).ok_or_else(|| oom("too large for the address space".into()))?;
            // SAFETY: `layout` has a non-zero size.
            let p = unsafe { std::alloc::alloc_zeroed(layout) };
            if p.is_null() {
                return Err(oom("out of host memory".into()));
            }
            let reg = sys::CU_MEMHOSTREGISTER_DEVICEMAP | sys::CU_MEMHOSTREGISTER_PORTABLE;
            // SAFETY: `p` owns `layout.size() >= bytes.max(1)` bytes until it
            // is unregistered and freed in `release`.
            let r = unsafe { sys::cuMemHostRegister_v2(p as *mut c_void, bytes.max(1), reg) };
            if r != sys::CUresult::CUDA_SUCCESS {
                // SAFETY: allocated just above with `layout`.
                unsafe { std::alloc::dealloc(p, layout) };
                return Err(oom(format!("cuMemHostRegister failed: {}", describe(r))));
            }
            host = p as *mut c_void;
            release = Release::UnregisterAndFree;
        } else {
            // SAFETY: `host` owns `bytes.max(1)` bytes just allocated.
            unsafe { std::ptr::write_bytes(host as *mut u8, 0, bytes.max(1)) };
        }
        let mut dptr = 0;
        // SAFETY: `host` is mapped page-locked memory of this context.
        let r = unsafe { sys::cuMemHostGetDevicePointer_v2(&mut dptr, host, 0) };
        let entry = Entry {
            bytes,
            label: label.into(),
            kind: MemoryKind::HostMapped,
            host: host as usize,
            release,
        };
        if let Err(e) = check(OP, "cuMemHostGetDevicePointer", r) {
            let _ = self.release(OP, DevicePtr::NULL, &entry);
            return Err(e);
        }
        self.ledger.insert(DevicePtr(dptr), entry);
        Ok(HostMapped {
            device: DevicePtr(dptr),
            host: host as *mut u8,
            bytes,
        })
    }

    unsafe fn register_host(&self, host: *mut u8, bytes: usize, label: &str) -> Result<DevicePtr> {
        let op = format!("register_host '{label}'");
        if host.is_null() {
            return Err(GpuError::invalid(op, "host pointer is null"));
        }
        if bytes == 0 {
            return Err(GpuError::invalid(
                op,
                "the driver cannot register an empty range",
            ));
        }
        if (host as usize).checked_add(bytes).is_none() {
            return Err(GpuError::invalid(
                op,
                format!("{bytes} bytes at host {host:p} wrap the address space"),
            ));
        }
        self.bind(&op)?;
        let flags = sys::CU_MEMHOSTREGISTER_DEVICEMAP | sys::CU_MEMHOSTREGISTER_PORTABLE;
        // SAFETY: the caller promised `host .. host + bytes` stays valid
        // until it is unregistered by `free`.
        let mut r = unsafe { sys::cuMemHostRegister_v2(host as *mut c_void, bytes, flags) };
        if r != sys::CUresult::CUDA_SUCCESS
            && r != sys::CUresult::CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED
        {
            // Read-only mappings (memory-mapped files) register only as such.
            // SAFETY: as above.
            r = unsafe {
                sys::cuMemHostRegister_v2(
                    host as *mut c_void,
                    bytes,
                    flags | sys::CU_MEMHOSTREGISTER_READ_ONLY,
                )
            };
        }
        check(&op, "cuMemHostRegister", r)?;
        let mut dptr = 0;
        // SAFETY: the range was just registered with DEVICEMAP.
        let r = unsafe { sys::cuMemHostGetDevicePointer_v2(&mut dptr, host as *mut c_void, 0) };
        if let Err(e) = check(&op, "cuMemHostGetDevicePointer", r) {
            // SAFETY: registered just above; unregistered once.
            unsafe { sys::cuMemHostUnregister(host as *mut c_void) };
            return Err(e);
        }
        self.ledger.insert(
            DevicePtr(dptr),
            Entry {
                bytes,
                label: label.into(),
                kind: MemoryKind::HostRegistered,
                host: host as usize,
                release: Release::Unregister,
            },
        );
        Ok(DevicePtr(dptr))
    }

    fn memset(&self, dst: DevicePtr, value: u8, bytes: usize) -> Result<()> {
        const OP: &str = "memset";
        self.ledger.check(OP, dst, bytes)?;
        self.bind(OP)?;
        let raw = self.sync_stream(OP)?;
        if bytes > 0 {
            // SAFETY: the range lies in a live allocation (checked).
            check(OP, "cuMemsetD8Async", unsafe {
                sys::cuMemsetD8Async(dst.0, value, bytes, raw.0)
            })?;
        }
        self.sync_raw(OP, 0, &raw)
    }

    fn memset_async(
        &self,
        dst: DevicePtr,
        value: u8,
        bytes: usize,
        stream: StreamId,
    ) -> Result<()> {
        const OP: &str = "memset_async";
        let (raw, _) = self.stream(OP, stream)?;
        self.ledger.check(OP, dst, bytes)?;
        self.bind(OP)?;
        if bytes > 0 {
            // SAFETY: the range lies in a live allocation (checked).
            check(OP, "cuMemsetD8Async", unsafe {
                sys::cuMemsetD8Async(dst.0, value, bytes, raw.0)
            })?;
        }
        self.note_touched(stream, &[(dst, bytes)]);
        Ok(())
    }

    fn copy_h2d(&self, src: &[u8], dst: DevicePtr) -> Result<()> {
        const OP: &str = "copy_h2d";
        self.ledger.check(OP, dst, src.len())?;
        self.bind(OP)?;
        let raw = self.sync_stream(OP)?;
        if !src.is_empty() {
            // SAFETY: `dst` range checked; `src` is borrowed until the
            // stream is synchronised below.
            check(OP, "cuMemcpyHtoDAsync", unsafe {
                sys::cuMemcpyHtoDAsync_v2(dst.0, src.as_ptr() as *const c_void, src.len(), raw.0)
            })?;
        }
        self.sync_raw(OP, 0, &raw)
    }

    fn copy_d2h(&self, src: DevicePtr, dst: &mut [u8]) -> Result<()> {
        const OP: &str = "copy_d2h";
        self.ledger.check(OP, src, dst.len())?;
        self.bind(OP)?;
        let raw = self.sync_stream(OP)?;
        if !dst.is_empty() {
            // SAFETY: `src` range checked; `dst` is borrowed mutably until
            // the stream is synchronised below.
            check(OP, "cuMemcpyDtoHAsync", unsafe {
                sys::cuMemcpyDtoHAsync_v2(dst.as_mut_ptr() as *mut c_void, src.0, dst.len(), raw.0)
            })?;
        }
        self.sync_raw(OP, 0, &raw)
    }

    fn copy_d2d(&self, src: DevicePtr, dst: DevicePtr, bytes: usize) -> Result<()> {
        const OP: &str = "copy_d2d";
        self.ledger.check("copy_d2d (source)", src, bytes)?;
        self.ledger.check("copy_d2d (destination)", dst, bytes)?;
        self.bind(OP)?;
        let raw = self.sync_stream(OP)?;
        if bytes > 0 {
            // SAFETY: both ranges checked.
            check(OP, "cuMemcpyDtoDAsync", unsafe {
                sys::cuMemcpyDtoDAsync_v2(dst.0, src.0, bytes, raw.0)
            })?;
        }
        self.sync_raw(OP, 0, &raw)
    }

    fn copy_h2d_async(&self, src: &[u8], dst: DevicePtr, stream: StreamId) -> Result<()> {
        const OP: &str = "copy_h2d_async";
        let (raw, capturing) = self.stream(OP, stream)?;
        self.ledger.check(OP, dst, src.len())?;
        self.bind(OP)?;
        let pinned = self.ledger.device_of_host(src.as_ptr(), src.len());
        if capturing && pinned.is_none() && !src.is_empty() {
            return Err(self.refuse_capture(
                OP,
                stream,
                "the source is pageable host memory, which a graph cannot read at replay",
            ));
        }
        if src.is_empty() {
            return Ok(());
        }
        if capturing {
            let via = pinned.expect("checked above");
            // SAFETY: `dst` checked; the source lies in live page-locked
            // memory, which the graph reads at each replay.
            check(OP, "cuMemcpyHtoDAsync", unsafe {
                sys::cuMemcpyHtoDAsync_v2(dst.0, src.as_ptr() as *const c_void, src.len(), raw.0)
            })?;
            self.note_touched(stream, &[(dst, src.len()), (via, src.len())]);
            return Ok(());
        }
        // Outside a capture the source is taken now: a page-locked source
        // would be read later by the DMA engine, so it goes through a
        // pageable copy, which the driver stages before returning.
        let staged;
        let from: &[u8] = if pinned.is_some() {
            staged = src.to_vec();
            &staged
        } else {
            src
        };
        // SAFETY: `dst` checked; `from` is pageable, so the driver has copied
        // it when the call returns.
        check(OP, "cuMemcpyHtoDAsync", unsafe {
            sys::cuMemcpyHtoDAsync_v2(dst.0, from.as_ptr() as *const c_void, from.len(), raw.0)
        })
    }

    fn copy_d2h_on_stream(&self, src: DevicePtr, dst: &mut [u8], stream: StreamId) -> Result<()> {
        const OP: &str = "copy_d2h_on_stream";
        let (raw, capturing) = self.stream(OP, stream)?;
        if capturing {
            return Err(self.refuse_capture(OP, stream, "a blocking read cannot be captured"));
        }
        self.ledger.check(OP, src, dst.len())?;
        self.bind(OP)?;
        if !dst.is_empty() {
            // SAFETY: `src` checked; `dst` is borrowed until the stream is
            // synchronised below.
            check(OP, "cuMemcpyDtoHAsync", unsafe {
                sys::cuMemcpyDtoHAsync_v2(dst.as_mut_ptr() as *mut c_void, src.0, dst.len(), raw.0)
            })?;
        }
        self.sync_raw(OP, stream, &raw)
    }

    fn copy_d2d_async(
        &self,
        src: DevicePtr,
        dst: DevicePtr,
        bytes: usize,
        stream: StreamId,
    ) -> Result<()> {
        const OP: &str = "copy_d2d_async";
        let (raw, _) = self.stream(OP, stream)?;
        self.ledger.check("copy_d2d_async (source)", src, bytes)?;
        self.ledger
            .check("copy_d2d_async (destination)", dst, bytes)?;
        self.bind(OP)?;
        if bytes > 0 {
            // SAFETY: both ranges checked.
            check(OP, "cuMemcpyDtoDAsync", unsafe {
                sys::cuMemcpyDtoDAsync_v2(dst.0, src.0, bytes, raw.0)
            })?;
        }
        self.note_touched(stream, &[(src, bytes), (dst, bytes)]);
        Ok(())
    }

    fn create_stream(&self) -> Result<StreamId> {
        const OP: &str = "create_stream";
        self.bind(OP)?;
        let raw = create_stream(OP, self.ctx)?;
        let id = self.next_stream.fetch_add(1, Ordering::Relaxed);
        self.streams
            .lock()
            .insert(id, StreamEntry { raw, capture: None });
        Ok(id)
    }

    fn destroy_stream(&self, stream: StreamId) -> Result<()> {
        const OP: &str = "destroy_stream";
        if stream == 0 {
            return Err(GpuError::invalid(
                OP,
                "the default stream cannot be destroyed",
            ));
        }
        let e = {
            let mut t = self.streams.lock();
            match t.get(&stream) {
                None => {
                    return Err(GpuError::UnknownStream {
                        op: OP.into(),
                        stream,
                    });
                }
                Some(e) if e.capture.is_some() => {
                    return Err(GpuError::AlreadyCapturing {
                        op: OP.into(),
                        stream,
                    });
                }
                Some(_) => t.remove(&stream).expect("present"),
            }
        };
        self.bind(OP)?;
        // Dropping the entry destroys the stream once no other call uses it.
        self.sync_raw(OP, stream, &e.raw)
    }

    fn synchronize(&self, stream: StreamId) -> Result<()> {
        const OP: &str = "synchronize";
        let (raw, capturing) = self.stream(OP, stream)?;
        if capturing {
            return Err(self.refuse_capture(OP, stream, "a capturing stream cannot be waited for"));
        }
        self.bind(OP)?;
        self.sync_raw(OP, stream, &raw)
    }

    fn create_event(&self) -> Result<EventHandle> {
        const OP: &str = "create_event";
        self.bind(OP)?;
        let mut e = std::ptr::null_mut();
        // SAFETY: valid out-pointer; the context is current.
        check(OP, "cuEventCreate", unsafe {
            sys::cuEventCreate(&mut e, sys::CUevent_flags::CU_EVENT_DISABLE_TIMING as u32)
        })?;
        let id = self.next_event.fetch_add(1, Ordering::Relaxed);
        self.events.lock().insert(id, Handle(e));
        Ok(EventHandle(id))
    }

    fn record_event(&self, event: EventHandle, stream: StreamId) -> Result<()> {
        const OP: &str = "record_event";
        let ev = self.event(OP, event)?;
        let (raw, capturing) = self.stream(OP, stream)?;
        self.bind(OP)?;
        if capturing {
            // SAFETY: live event and stream; captured as an event record
            // node that fires at each replay.
            check(OP, "cuEventRecordWithFlags", unsafe {
                sys::cuEventRecordWithFlags(
                    ev.0,
                    raw.0,
                    sys::CUevent_record_flags::CU_EVENT_RECORD_EXTERNAL as u32,
                )
            })
        } else {
            // SAFETY: live event and stream.
            check(OP, "cuEventRecord", unsafe {
                sys::cuEventRecord(ev.0, raw.0)
            })
        }
    }

    fn stream_wait_event(&self, stream: StreamId, event: EventHandle) -> Result<()> {
        const OP: &str = "stream_wait_event";
        let ev = self.event(OP, event)?;
        let (raw, capturing) = self.stream(OP, stream)?;
        self.bind(OP)?;
        let flags = if capturing {
            sys::CUevent_wait_flags::CU_EVENT_WAIT_EXTERNAL as u32
        } else {
            0
        };
        // SAFETY: live event and stream.
        check(OP, "cuStreamWaitEvent", unsafe {
            sys::cuStreamWaitEvent(raw.0, ev.0, flags)
        })
    }

    fn event_synchronize(&self, event: EventHandle) -> Result<()> {
        const OP: &str = "event_synchronize";
        let ev = self.event(OP, event)?;
        self.bind(OP)?;
        // SAFETY: a live event.
        check(OP, "cuEventSynchronize", unsafe {
            sys::cuEventSynchronize(ev.0)
        })
    }

    fn event_query(&self, event: EventHandle) -> Result<bool> {
        const OP: &str = "event_query";
        let ev = self.event(OP, event)?;
        self.bind(OP)?;
        // SAFETY: a live event.
        match unsafe { sys::cuEventQuery(ev.0) } {
            sys::CUresult::CUDA_SUCCESS => Ok(true),
            sys::CUresult::CUDA_ERROR_NOT_READY => Ok(false),
            r => check(OP, "cuEventQuery", r).map(|_| false),
        }
    }

    fn destroy_event(&self, event: EventHandle) -> Result<()> {
        const OP: &str = "destroy_event";
        let ev = self
            .events
            .lock()
            .remove(&event.0)
            .ok_or(GpuError::UnknownEvent {
                op: OP.into(),
                event: event.0,
            })?;
        self.bind(OP)?;
        // SAFETY: a live event, out of the table, destroyed once.
        check(OP, "cuEventDestroy", unsafe {
            sys::cuEventDestroy_v2(ev.0)
        })
    }

    fn begin_capture(&self, stream: StreamId) -> Result<()> {
        const OP: &str = "begin_capture";
        self.bind(OP)?;
        let mut t = self.streams.lock();
        let e = t.get_mut(&stream).ok_or_else(|| GpuError::UnknownStream {
            op: OP.into(),
            stream,
        })?;
        if e.capture.is_some() {
            return Err(GpuError::AlreadyCapturing {
                op: OP.into(),
                stream,
            });
        }
        // SAFETY: a live stream of this context.
        check(OP, "cuStreamBeginCapture", unsafe {
            sys::cuStreamBeginCapture_v2(
                e.raw.0,
                sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED,
            )
        })?;
        e.capture = Some(Capture::default());
        Ok(())
    }

    fn end_capture(&self, stream: StreamId) -> Result<GraphHandle> {
        const OP: &str = "end_capture";
        self.bind(OP)?;
        let (raw, capture) = {
            let mut t = self.streams.lock();
            let e = t.get_mut(&stream).ok_or_else(|| GpuError::UnknownStream {
                op: OP.into(),
                stream,
            })?;
            let c = e.capture.take().ok_or(GpuError::NotCapturing { stream })?;
            (e.raw.clone(), c)
        };
        let mut graph = std::ptr::null_mut();
        // SAFETY: the stream is capturing (our state says so).
        let r = unsafe { sys::cuStreamEndCapture(raw.0, &mut graph) };
        let destroy = |g: sys::CUgraph| {
            if !g.is_null() {
                // SAFETY: a graph the capture returned, destroyed once.
                unsafe { sys::cuGraphDestroy(g) };
            }
        };
        if let Some(cause) = capture.invalid {
            destroy(graph);
            return Err(GpuError::CaptureInvalidated {
                stream,
                cause: Box::new(cause),
            });
        }
        if let Err(e) = check(OP, "cuStreamEndCapture", r) {
            destroy(graph);
            return Err(e);
        }
        let mut exec = std::ptr::null_mut();
        // SAFETY: `graph` is a valid captured graph.
        let r = unsafe { sys::cuGraphInstantiateWithFlags(&mut exec, graph, 0) };
        if let Err(e) = check(OP, "cuGraphInstantiate", r) {
            destroy(graph);
            return Err(e);
        }
        let id = self.next_graph.fetch_add(1, Ordering::Relaxed);
        self.graphs.lock().insert(
            id,
            GraphEntry {
                graph: Handle(graph),
                exec: Handle(exec),
                touched: capture.touched,
            },
        );
        Ok(GraphHandle(id))
    }

    fn stream_is_capturing(&self, stream: StreamId) -> Result<bool> {
        Ok(self.stream("stream_is_capturing", stream)?.1)
    }

    fn launch_graph(&self, graph: GraphHandle, stream: StreamId) -> Result<()> {
        const OP: &str = "launch_graph";
        let (exec, touched) = {
            let g = self.graphs.lock();
            let e = g.get(&graph.0).ok_or(GpuError::UnknownGraph {
                op: OP.into(),
                graph: graph.0,
            })?;
            (e.exec, e.touched.clone())
        };
        let (raw, _) = self.stream(OP, stream)?;
        for &(p, n) in &touched {
            self.ledger.check(OP, p, n)?;
        }
        self.bind(OP)?;
        // SAFETY: a live executable graph and stream; every range it touches
        // is live (checked above).
        check(OP, "cuGraphLaunch", unsafe {
            sys::cuGraphLaunch(exec.0, raw.0)
        })?;
        self.note_touched(stream, &touched);
        Ok(())
    }

    fn destroy_graph(&self, graph: GraphHandle) -> Result<()> {
        const OP: &str = "destroy_graph";
        let g = self
            .graphs
            .lock()
            .remove(&graph.0)
            .ok_or(GpuError::UnknownGraph {
                op: OP.into(),
                graph: graph.0,
            })?;
        self.bind(OP)?;
        // SAFETY: live handles, out of the table, destroyed once.
        let r1 = unsafe { sys::cuGraphExecDestroy(g.exec.0) };
        // SAFETY: as above.
        let r2 = unsafe { sys::cuGraphDestroy(g.graph.0) };
        check(OP, "cuGraphExecDestroy", r1)?;
        check(OP, "cuGraphDestroy", r2)
    }

    fn supports_host_kernels(&self) -> bool {
        false
    }

    fn register_host_kernel(
        &self,
        module: &str,
        name: &str,
        _signature: &[ArgKind],
        _body: Arc<HostKernelFn>,
    ) -> Result<()> {
        Err(GpuError::unsupported(
            format!("register_host_kernel {module}::{name}"),
            "the CUDA backend runs device kernels only (load PTX with load_module)",
        ))
    }

    fn load_module(&self, module: &str, image: &[u8]) -> Result<()> {
        let op = format!("load_module '{module}'");
        if module.is_empty() {
            return Err(GpuError::invalid(op, "empty module name"));
        }
        let mut img = image.to_vec();
        if img.last() != Some(&0) {
            img.push(0);
        }
        let entries = std::str::from_utf8(&img[..img.len() - 1])
            .ok()
            .filter(|t| t.contains(".entry"))
            .map(ptx_entries);
        self.bind(&op)?;
        let mut m = std::ptr::null_mut();
        // SAFETY: `img` is a NUL-terminated image, alive during the call.
        let r = unsafe { sys::cuModuleLoadData(&mut m, img.as_ptr() as *const c_void) };
        use sys::CUresult::*;
        if matches!(
            r,
            CUDA_ERROR_INVALID_IMAGE
                | CUDA_ERROR_INVALID_PTX
                | CUDA_ERROR_INVALID_SOURCE
                | CUDA_ERROR_NO_BINARY_FOR_GPU
                | CUDA_ERROR_UNSUPPORTED_PTX_VERSION
        ) {
            return Err(GpuError::invalid(
                op,
                format!(
                    "the image is not a module for this device: cuModuleLoadData failed: {}",
                    describe(r)
                ),
            ));
        }
        check(&op, "cuModuleLoadData", r)?;
        let new = ModuleEntry {
            raw: Handle(m),
            entries,
        };
        let old = {
            let mut mods = self.modules.lock();
            let mut ks = self.kernels.lock();
            for k in ks.iter_mut().filter(|k| k.module == module) {
                k.func = lookup(new.raw, &k.name);
                k.params = new.entries.as_ref().and_then(|e| e.get(&k.name).cloned());
            }
            mods.insert(module.to_string(), new)
        };
        if let Some(old) = old {
            // Work queued with the old functions must finish first.
            self.quiesce();
            // SAFETY: no kernel handle refers to the old module any more and
            // no queued work uses it.
            unsafe { sys::cuModuleUnload(old.raw.0) };
        }
        Ok(())
    }

    fn kernel(&self, module: &str, name: &str) -> Result<KernelHandle> {
        let qualified = format!("{module}::{name}");
        if let Some(i) = self
            .kernels
            .lock()
            .iter()
            .position(|k| k.qualified == qualified)
        {
            return Ok(KernelHandle(i as u64 + 1));
        }
        let no_such = |known: Vec<String>| GpuError::NoSuchKernel {
            module: module.into(),
            name: name.into(),
            known,
        };
        let mods = self.modules.lock();
        let Some(m) = mods.get(module) else {
            return Err(no_such(Vec::new()));
        };
        let known: Vec<String> = m
            .entries
            .as_ref()
            .map(|e| e.keys().cloned().collect())
            .unwrap_or_default();
        if m.entries.as_ref().is_some_and(|e| !e.contains_key(name)) {
            return Err(no_such(known));
        }
        self.bind("kernel")?;
        let func = lookup(m.raw, name).ok_or_else(|| no_such(known))?;
        let params = m.entries.as_ref().and_then(|e| e.get(name).cloned());
        let mut ks = self.kernels.lock();
        ks.push(KernelEntry {
            qualified,
            module: module.into(),
            name: name.into(),
            func: Some(func),
            params,
        });
        Ok(KernelHandle(ks.len() as u64))
    }

    fn launch_kernel(
        &self,
        kernel: KernelHandle,
        cfg: LaunchConfig,
        args: &[KernelArg],
        stream: StreamId,
    ) -> Result<()> {
        let k = self.kernel_entry(kernel)?;
        let q = &k.qualified;
        let (g, b) = (cfg.grid, cfg.block);
        if g.0 == 0 || g.1 == 0 || g.2 == 0 || b.0 == 0 || b.1 == 0 || b.2 == 0 {
            return Err(GpuError::InvalidLaunch {
                kernel: q.clone(),
                grid: g,
                block: b,
            });
        }
        // A kernel whose one parameter is a struct takes the arguments as
        // its fields (see `params`).
        let by_struct = match k.params.as_deref() {
            Some(&[ParamClass::Other(size)]) => {
                let (_, packed) = c_layout(args.iter().map(KernelArg::kind));
                if args.is_empty() || packed != size {
                    return Err(GpuError::invalid(
                        format!("launch_kernel {q}"),
                        format!(
                            "the kernel takes one {size}-byte struct; the {} arguments lay out as {packed} bytes",
                            args.len()
                        ),
                    ));
                }
                true
            }
            _ => false,
        };
        if let Some(sig) = k.params.as_ref().filter(|_| !by_struct) {
            if args.len() != sig.len() {
                return Err(GpuError::ArgCount {
                    kernel: q.clone(),
                    expected: sig.len(),
                    got: args.len(),
                });
            }
            for (i, (a, p)) in args.iter().zip(sig).enumerate() {
                if !p.accepts(a.kind()) {
                    return Err(GpuError::ArgType {
                        kernel: q.clone(),
                        index: i,
                        expected: p.expected_kind(),
                        got: *a,
                    });
                }
            }
        }
        let op = format!("launch_kernel on stream {stream}");
        let (raw, _) = self.stream("launch_kernel", stream)?;
        let mut touched = Vec::new();
        for (i, a) in args.iter().enumerate() {
            if let KernelArg::Ptr(p) = a
                && !p.is_null()
            {
                self.ledger
                    .check(&format_args!("launch_kernel {q}: argument {i}"), *p, 0)?;
                touched.push((*p, 0));
            }
        }
        let func = k.func.ok_or_else(|| {
            GpuError::unsupported(
                format!("launch_kernel {q}"),
                "the module was reloaded without this kernel",
            )
        })?;
        self.bind(&op)?;
        let mut params = if by_struct {
            Params::packed(args)
        } else {
            Params::new(args)
        };
        let ptrs = params.as_mut_ptrs();
        // SAFETY: `func` is a function of a loaded module; `ptrs` holds one
        // pointer per argument into `params`, which outlives the call (the
        // driver copies the values at launch); pointer arguments name live
        // allocations (checked).
        let r = unsafe {
            sys::cuLaunchKernel(
                func.0,
                g.0,
                g.1,
                g.2,
                b.0,
                b.1,
                b.2,
                cfg.shared_mem_bytes,
                raw.0,
                if ptrs.is_empty() {
                    std::ptr::null_mut()
                } else {
                    ptrs.as_mut_ptr()
                },
                std::ptr::null_mut(),
            )
        };
        check(&format!("{op} {q}"), "cuLaunchKernel", r)?;
        self.note_touched(stream, &touched);
        Ok(())
    }

    fn live_bytes(&self) -> usize {
        self.ledger.live_bytes()
    }

    fn live_alloc_count(&self) -> usize {
        self.ledger.live_count()
    }

    fn live_allocations(&self) -> Vec<AllocationInfo> {
        self.ledger.allocations()
    }
}

impl CudaBackend {
    fn event(&self, op: &str, event: EventHandle) -> Result<Handle<sys::CUevent>> {
        self.events
            .lock()
            .get(&event.0)
            .copied()
            .ok_or(GpuError::UnknownEvent {
                op: op.into(),
                event: event.0,
            })
    }
}

/// Function `name` of a loaded module, if it has one.
fn lookup(m: Handle<sys::CUmodule>, name: &str) -> Option<Handle<sys::CUfunction>> {
    let c = std::ffi::CString::new(name).ok()?;
    let mut f = std::ptr::null_mut();
    // SAFETY: a loaded module, a NUL-terminated name, a valid out-pointer.
    let r = unsafe { sys::cuModuleGetFunction(&mut f, m.0, c.as_ptr()) };
    (r == sys::CUresult::CUDA_SUCCESS).then_some(Handle(f))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn construction_fails_cleanly_without_a_driver() {
        // On a machine with a driver and a device this opens it; elsewhere
        // it must be an error that names what is missing, not a panic.
        match CudaBackend::new(0) {
            Ok(b) => assert_eq!((&b as &dyn GpuBackend).name(), "cuda"),
            Err(e) => {
                let s = e.to_string();
                assert!(s.starts_with("CudaBackend::new(device 0)"), "{s}");
                assert!(
                    s.contains("libcuda")
                        || s.contains("NVRTC")
                        || s.contains("device")
                        || s.contains("cu"),
                    "{s}"
                );
            }
        }
        assert!(CudaBackend::new(usize::MAX).is_err());
    }

    #[test]
    fn default_backend_falls_back_to_cpu_without_a_device() {
        let b = crate::default_backend();
        if CudaBackend::new(0).is_err() {
            assert_eq!(b.name(), "cpu");
        }
    }

    #[test]
    fn driver_errors_name_the_call() {
        let e = check(
            "alloc",
            "cuMemAlloc",
            sys::CUresult::CUDA_ERROR_OUT_OF_MEMORY,
        )
        .unwrap_err();
        let s = e.to_string();
        assert!(s.starts_with("alloc: cuMemAlloc failed: "), "{s}");
        assert!(check("x", "y", sys::CUresult::CUDA_SUCCESS).is_ok());
    }

    #[test]
    fn fallback_layout_is_page_aligned_and_covers_the_size() {
        let l = page_layout(1).unwrap();
        assert_eq!((l.size(), l.align()), (4096, 4096));
        assert_eq!(page_layout(8193).unwrap().size(), 12288);
        assert!(page_layout(usize::MAX).is_none());
    }
}
