//! The device abstraction every layer is written against.
//!
//! `GpuBackend` is modelled on the CUDA driver API: raw device pointers,
//! in-order streams, events, graph capture and named kernels. It is
//! object-safe so that layers take `&dyn GpuBackend` and never need `cfg`.
//!
//! Invariants every backend upholds:
//! - a `DevicePtr` is only valid inside a live allocation; backends that can
//!   check (the CPU backend always does) refuse anything else with an error
//!   that names the operation and the pointer;
//! - work on one stream runs in submission order; work on different streams is
//!   ordered only through events;
//! - an error raised by queued work is reported by the next synchronising call
//!   on that stream (`synchronize`, `copy_d2h_on_stream`), never dropped;
//! - while a stream is capturing, operations are recorded, not run, and
//!   operations that cannot be replayed (copies from pageable host memory,
//!   blocking reads) are refused.

use std::fmt;

use crate::args::{ArgsInfo, KernelArgs};
pub use crate::error::GpuError;
use crate::error::Result;

/// A device address. `DevicePtr(0)` is null.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Default)]
pub struct DevicePtr(pub u64);

impl DevicePtr {
    /// The null pointer.
    pub const NULL: DevicePtr = DevicePtr(0);

    /// Whether this is the null pointer.
    pub fn is_null(self) -> bool {
        self.0 == 0
    }

    /// This pointer advanced by `bytes`.
    pub fn offset(self, bytes: usize) -> DevicePtr {
        DevicePtr(self.0.wrapping_add(bytes as u64))
    }

    /// The raw address.
    pub fn addr(self) -> u64 {
        self.0
    }
}

impl fmt::Debug for DevicePtr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "DevicePtr({:#x})", self.0)
    }
}

impl fmt::Display for DevicePtr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:#x}", self.0)
    }
}

/// A stream id. `0` is the default stream of every backend.
///
/// An alias, not a newtype: the carry code fixed by the specification
/// (`aux_state.rs`) takes streams as `u64` and passes them to the backend,
/// so the two spellings must name one type. Everything else spells it
/// `StreamId`.
pub type StreamId = u64;

/// A kernel resolved by [`GpuBackend::kernel`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct KernelHandle(pub u64);

/// A captured graph, replayed by [`GpuBackend::launch_graph`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct GraphHandle(pub u64);

/// An event created by [`GpuBackend::create_event`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct EventHandle(pub u64);

/// One typed kernel argument.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum KernelArg {
    /// A device pointer.
    Ptr(DevicePtr),
    /// An unsigned 32-bit scalar.
    U32(u32),
    /// An unsigned 64-bit scalar.
    U64(u64),
    /// A signed 32-bit scalar.
    I32(i32),
    /// A 32-bit float scalar.
    F32(f32),
}

impl KernelArg {
    /// The kind of this argument.
    pub fn kind(&self) -> ArgKind {
        match self {
            KernelArg::Ptr(_) => ArgKind::Ptr,
            KernelArg::U32(_) => ArgKind::U32,
            KernelArg::U64(_) => ArgKind::U64,
            KernelArg::I32(_) => ArgKind::I32,
            KernelArg::F32(_) => ArgKind::F32,
        }
    }
}

/// The kind of a kernel argument, for signature checks.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ArgKind {
    /// A device pointer.
    Ptr,
    /// `u32`.
    U32,
    /// `u64`.
    U64,
    /// `i32`.
    I32,
    /// `f32`.
    F32,
}

/// Grid and block dimensions of a launch.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LaunchConfig {
    /// Blocks in x, y, z.
    pub grid: (u32, u32, u32),
    /// Threads per block in x, y, z.
    pub block: (u32, u32, u32),
    /// Dynamic shared memory in bytes.
    pub shared_mem_bytes: u32,
}

impl LaunchConfig {
    /// A one-dimensional launch.
    pub fn linear(grid: u32, block: u32) -> Self {
        LaunchConfig {
            grid: (grid, 1, 1),
            block: (block, 1, 1),
            shared_mem_bytes: 0,
        }
    }
}

/// Where an allocation lives.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum MemoryKind {
    /// Device memory from [`GpuBackend::alloc`].
    Device,
    /// Page-locked host memory the device can address, from
    /// [`GpuBackend::alloc_host_mapped`].
    HostMapped,
    /// Caller-owned host memory registered with
    /// [`GpuBackend::register_host`].
    HostRegistered,
}

/// One live allocation, as reported by [`GpuBackend::live_allocations`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AllocationInfo {
    /// Its device address.
    pub ptr: DevicePtr,
    /// Its size in bytes.
    pub bytes: usize,
    /// The label given at allocation.
    pub label: String,
    /// Where it lives.
    pub kind: MemoryKind,
}

/// Device-addressable host memory: the same bytes seen from both sides.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HostMapped {
    /// The address kernels and device copies use.
    pub device: DevicePtr,
    /// The address the host uses. Valid until the memory is freed through
    /// [`GpuBackend::dealloc`] with `device`.
    pub host: *mut u8,
    /// Size in bytes.
    pub bytes: usize,
}

// SAFETY: the pointer names memory owned by the backend's ledger, which is
// itself `Send + Sync`; synchronising access to the bytes is the caller's job,
// exactly as with CUDA's mapped memory.
unsafe impl Send for HostMapped {}
// SAFETY: as above.
unsafe impl Sync for HostMapped {}

/// The body of a kernel run on the host by the CPU backend.
///
/// It receives a view of the backend's memory (to turn checked pointers into
/// slices), the launch configuration and the arguments, already checked
/// against the kernel's signature. A body reports its own failures with
/// [`GpuError::kernel`]; pointer errors from [`HostMemory`] pass through
/// with `?`.
pub type HostKernelFn =
    dyn Fn(&dyn HostMemory, &LaunchConfig, &[KernelArg]) -> Result<()> + Send + Sync;

/// Checked access to device memory from a host kernel.
///
/// Every method checks that `[ptr, ptr + bytes)` lies inside one live
/// allocation and errors otherwise.
pub trait HostMemory {
    /// A raw host pointer to `bytes` bytes at `ptr`, checked against the
    /// ledger. The caller is responsible for aliasing, as a CUDA kernel is.
    fn host_ptr(&self, ptr: DevicePtr, bytes: usize) -> Result<*mut u8>;

    /// This view as one that may be shared across threads (for a kernel
    /// that checks pointers from rayon workers), when the backend allows it.
    /// The CPU backend does; `&(dyn HostMemory + Sync)` coerces back to
    /// `&dyn HostMemory` for [`slice`](Self::slice)-style access.
    fn as_sync(&self) -> Option<&(dyn HostMemory + Sync)> {
        None
    }
}

/// An error unless host address `p` (of device pointer `ptr`) is aligned
/// for `T`.
fn check_aligned<T>(ptr: DevicePtr, p: *mut u8) -> Result<()> {
    if (p as usize).is_multiple_of(std::mem::align_of::<T>()) {
        Ok(())
    } else {
        Err(GpuError::Misaligned {
            ptr,
            ty: std::any::type_name::<T>(),
        })
    }
}

impl dyn HostMemory + '_ {
    /// `len` elements of `T` at `ptr`, read-only.
    ///
    /// # Safety
    /// No other live mutable view may overlap the range while the slice is in
    /// use, and `ptr` must be aligned for `T` (checked).
    pub unsafe fn slice<T: Copy>(&self, ptr: DevicePtr, len: usize) -> Result<&[T]> {
        let p = self.host_ptr(ptr, len * std::mem::size_of::<T>())?;
        check_aligned::<T>(ptr, p)?;
        // SAFETY: the ledger checked the range; the caller promised no overlap.
        Ok(unsafe { std::slice::from_raw_parts(p as *const T, len) })
    }

    /// `len` elements of `T` at `ptr`, writable.
    ///
    /// # Safety
    /// No other live view may overlap the range while the slice is in use,
    /// and `ptr` must be aligned for `T` (checked).
    #[allow(clippy::mut_from_ref)]
    pub unsafe fn slice_mut<T: Copy>(&self, ptr: DevicePtr, len: usize) -> Result<&mut [T]> {
        let p = self.host_ptr(ptr, len * std::mem::size_of::<T>())?;
        check_aligned::<T>(ptr, p)?;
        // SAFETY: the ledger checked the range; the caller promised no overlap.
        Ok(unsafe { std::slice::from_raw_parts_mut(p as *mut T, len) })
    }
}

/// A CUDA-driver-like device backend. Object-safe.
pub trait GpuBackend: Send + Sync {
    /// A short name: `"cpu"`, `"cuda"`.
    fn name(&self) -> &str;

    // ---- memory ----

    /// Allocate `bytes` of device memory. `label` shows in
    /// [`Self::live_allocations`].
    fn alloc(&self, bytes: usize, label: &str) -> Result<DevicePtr>;
    /// Free an allocation. Freeing null is a no-op; anything that is not the
    /// start of a live allocation is an error ([`GpuError::DoubleFree`],
    /// [`GpuError::InteriorFree`], [`GpuError::NotAllocated`], ...).
    fn dealloc(&self, ptr: DevicePtr) -> Result<()>;
    /// Allocate page-locked host memory that the device can address.
    fn alloc_host_mapped(&self, bytes: usize, label: &str) -> Result<HostMapped>;
    /// Make caller-owned host memory addressable by the device (as
    /// `cuMemHostRegister`). Release with [`Self::dealloc`] on the returned
    /// pointer, which unregisters and never frees the caller's memory.
    ///
    /// # Safety
    /// `host .. host + bytes` must stay valid until it is unregistered.
    unsafe fn register_host(&self, host: *mut u8, bytes: usize, label: &str) -> Result<DevicePtr>;

    /// Fill `bytes` at `dst` with `value`, synchronously.
    fn memset(&self, dst: DevicePtr, value: u8, bytes: usize) -> Result<()>;
    /// Fill `bytes` at `dst` with `value`, queued on `stream`.
    fn memset_async(&self, dst: DevicePtr, value: u8, bytes: usize, stream: StreamId)
    -> Result<()>;

    /// Copy host to device, synchronously (waits for the default stream).
    fn copy_h2d(&self, src: &[u8], dst: DevicePtr) -> Result<()>;
    /// Copy device to host, synchronously (waits for the default stream).
    fn copy_d2h(&self, src: DevicePtr, dst: &mut [u8]) -> Result<()>;
    /// Copy device to device, synchronously.
    fn copy_d2d(&self, src: DevicePtr, dst: DevicePtr, bytes: usize) -> Result<()>;
    /// Queue a host-to-device copy on `stream`. `src` may be dropped as soon
    /// as this returns. Refused while `stream` is capturing, unless `src`
    /// lies inside host-mapped or registered memory (as CUDA allows copies
    /// from page-locked memory): the graph then reads `src` at each replay.
    fn copy_h2d_async(&self, src: &[u8], dst: DevicePtr, stream: StreamId) -> Result<()>;
    /// Copy device to host after all earlier work on `stream`; returns when
    /// the bytes are in `dst`. Reports any earlier error of the stream.
    /// Refused while `stream` is capturing.
    fn copy_d2h_on_stream(&self, src: DevicePtr, dst: &mut [u8], stream: StreamId) -> Result<()>;
    /// Queue a device-to-device copy on `stream`.
    fn copy_d2d_async(
        &self,
        src: DevicePtr,
        dst: DevicePtr,
        bytes: usize,
        stream: StreamId,
    ) -> Result<()>;

    // ---- streams ----

    /// The default stream.
    fn default_stream(&self) -> StreamId {
        0
    }
    /// Create a new in-order stream.
    fn create_stream(&self) -> Result<StreamId>;
    /// Destroy a stream after its queued work has run.
    fn destroy_stream(&self, stream: StreamId) -> Result<()>;
    /// Wait for all work queued on `stream`; returns its first pending error.
    fn synchronize(&self, stream: StreamId) -> Result<()>;

    // ---- events ----

    /// Create an event (not yet recorded: queries report it complete).
    fn create_event(&self) -> Result<EventHandle>;
    /// Record `event` at the current tail of `stream`.
    fn record_event(&self, event: EventHandle, stream: StreamId) -> Result<()>;
    /// Make later work on `stream` wait for the last record of `event`.
    fn stream_wait_event(&self, stream: StreamId, event: EventHandle) -> Result<()>;
    /// Block until the last record of `event` has completed.
    fn event_synchronize(&self, event: EventHandle) -> Result<()>;
    /// Whether the last record of `event` has completed.
    fn event_query(&self, event: EventHandle) -> Result<bool>;
    /// Destroy an event.
    fn destroy_event(&self, event: EventHandle) -> Result<()>;

    // ---- graphs ----

    /// Start recording `stream`'s operations instead of running them.
    fn begin_capture(&self, stream: StreamId) -> Result<()>;
    /// Stop recording and return the graph.
    fn end_capture(&self, stream: StreamId) -> Result<GraphHandle>;
    /// Whether `stream` is capturing.
    fn stream_is_capturing(&self, stream: StreamId) -> Result<bool>;
    /// Replay a captured graph on `stream`.
    fn launch_graph(&self, graph: GraphHandle, stream: StreamId) -> Result<()>;
    /// Destroy a graph.
    fn destroy_graph(&self, graph: GraphHandle) -> Result<()>;

    // ---- kernels ----

    /// Whether this backend runs host kernels registered with
    /// [`Self::register_host_kernel`] (the CPU backend does).
    fn supports_host_kernels(&self) -> bool;
    /// Register a host function as kernel `module::name` with the given
    /// signature. Re-registering the same name replaces it.
    fn register_host_kernel(
        &self,
        module: &str,
        name: &str,
        signature: &[ArgKind],
        body: std::sync::Arc<HostKernelFn>,
    ) -> Result<()>;
    /// Load a device code module (PTX or cubin) under `module`.
    fn load_module(&self, module: &str, image: &[u8]) -> Result<()>;
    /// Resolve kernel `module::name`.
    fn kernel(&self, module: &str, name: &str) -> Result<KernelHandle>;
    /// Launch `kernel` on `stream`. The argument count and kinds are checked
    /// against the kernel's signature, and pointers against the ledger.
    fn launch_kernel(
        &self,
        kernel: KernelHandle,
        cfg: LaunchConfig,
        args: &[KernelArg],
        stream: StreamId,
    ) -> Result<()>;

    // ---- accounting ----

    /// Bytes in live allocations (device and host-mapped, not registered).
    fn live_bytes(&self) -> usize;
    /// Number of live allocations, of every kind.
    fn live_alloc_count(&self) -> usize;
    /// Every live allocation with its label.
    fn live_allocations(&self) -> Vec<AllocationInfo>;
}

impl dyn GpuBackend + '_ {
    /// [`GpuBackend::dealloc`], with its [`GpuError`] carried in an
    /// `anyhow::Error` (downcast it to match on the variant).
    ///
    /// Not a backend call: backends implement `dealloc` alone. This exists
    /// because the carry code fixed by the specification (`aux_state.rs`)
    /// calls `gpu.free(..)` on a `&dyn GpuBackend` and returns the result
    /// unchanged from a function returning `anyhow::Result<()>`, which pins
    /// the name and the type. Typed code calls `dealloc`.
    pub fn free(&self, ptr: DevicePtr) -> anyhow::Result<()> {
        Ok(self.dealloc(ptr)?)
    }

    /// Start a launch of `kernel` with the builder.
    pub fn launch(&self, kernel: KernelHandle, cfg: LaunchConfig) -> Launch<'_> {
        Launch {
            gpu: self,
            kernel,
            cfg,
            args: Vec::new(),
        }
    }

    /// Register `body` as host kernel `module::name` taking `T`: the
    /// signature is `T`'s fields, and the body gets them as a `T` (see
    /// [`Self::register_host_kernel`]).
    pub fn register_typed_host_kernel<T: KernelArgs>(
        &self,
        module: &str,
        name: &str,
        body: impl Fn(&dyn HostMemory, &LaunchConfig, T) -> Result<()> + Send + Sync + 'static,
    ) -> Result<()> {
        let qualified = format!("{module}::{name}");
        self.register_host_kernel(
            module,
            name,
            &ArgsInfo::of::<T>().signature(),
            std::sync::Arc::new(
                move |mem: &dyn HostMemory, cfg: &LaunchConfig, a: &[KernelArg]| {
                    // The backend checked the arguments against `T`'s signature.
                    let a = T::from_args(a).ok_or_else(|| {
                        GpuError::kernel(format!(
                            "{qualified}: the arguments are not a {}",
                            T::NAME
                        ))
                    })?;
                    body(mem, cfg, a)
                },
            ),
        )
    }

    /// A human-readable report of live allocations, one per line.
    pub fn live_report(&self) -> String {
        let mut out = String::new();
        for a in self.live_allocations() {
            out.push_str(&format!(
                "{} {:?} {} bytes '{}'\n",
                a.ptr, a.kind, a.bytes, a.label
            ));
        }
        out
    }
}

/// A kernel launch being assembled; see [`GpuBackend::launch_kernel`].
pub struct Launch<'a> {
    gpu: &'a dyn GpuBackend,
    kernel: KernelHandle,
    cfg: LaunchConfig,
    args: Vec<KernelArg>,
}

impl Launch<'_> {
    /// Append a pointer argument.
    pub fn ptr(mut self, p: DevicePtr) -> Self {
        self.args.push(KernelArg::Ptr(p));
        self
    }
    /// Append a `u32` argument.
    pub fn u32(mut self, v: u32) -> Self {
        self.args.push(KernelArg::U32(v));
        self
    }
    /// Append a `u64` argument.
    pub fn u64(mut self, v: u64) -> Self {
        self.args.push(KernelArg::U64(v));
        self
    }
    /// Append an `i32` argument.
    pub fn i32(mut self, v: i32) -> Self {
        self.args.push(KernelArg::I32(v));
        self
    }
    /// Append an `f32` argument.
    pub fn f32(mut self, v: f32) -> Self {
        self.args.push(KernelArg::F32(v));
        self
    }
    /// Append the fields of an argument struct, in order.
    pub fn args<T: KernelArgs>(mut self, a: &T) -> Self {
        a.push_args(&mut self.args);
        self
    }
    /// Queue the launch on `stream`.
    pub fn run(self, stream: StreamId) -> Result<()> {
        self.gpu
            .launch_kernel(self.kernel, self.cfg, &self.args, stream)
    }
}
