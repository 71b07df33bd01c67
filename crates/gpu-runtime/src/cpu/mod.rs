//! `CpuBackend`: a real [`GpuBackend`] that runs on the host.
//!
//! Device memory is aligned host memory behind synthetic device addresses
//! kept in a ledger ([`ledger`]); streams are in-order queues each drained by
//! its own worker thread ([`stream`]); kernels are host functions registered
//! under `(module, name)`.
//!
//! Invariants and choices:
//! - every pointer an operation touches is checked against the ledger when
//!   the operation is submitted and again when it runs, so use after free,
//!   out-of-bounds access and double free are errors naming the operation and
//!   the pointer, never undefined behaviour;
//! - queued operations hold the execution barrier (a shared lock) while they
//!   touch memory; `free` removes the allocation from the ledger first and
//!   then takes the barrier exclusively before releasing the bytes, so no
//!   running operation can see memory disappear under it;
//! - `free` first waits for all queued work on every stream, as `cuMemFree`
//!   does, so freeing a buffer right after queueing work on it is correct;
//! - the synchronous copies and `memset` wait for the default stream and
//!   report its pending error (without doing their own work) if it has one;
//! - an error raised by queued work is kept on its stream (first error wins)
//!   and returned, then cleared, by the next `synchronize` or
//!   `copy_d2h_on_stream` on that stream; later work still runs;
//! - `copy_h2d_async` to an idle stream copies on the calling thread (the
//!   source has to be copied there anyway), so a lone upload followed by
//!   `synchronize` neither wakes the worker nor waits for it; behind queued
//!   work, under capture or from a worker thread it is queued as usual;
//! - a synchronising call made from inside a queued operation (a kernel body
//!   that holds the backend) would deadlock and is refused instead;
//! - under graph capture, submissions are recorded; copies from ordinary host
//!   memory (not host-mapped or registered, whose copies are recorded as
//!   reads of their device address at replay), blocking reads, `synchronize`
//!   and synchronous copies on the capturing stream are refused and
//!   invalidate the capture, as CUDA does;
//!   a graph holds pointers and kernel bodies by value and its launch
//!   re-submits every node (checked again) in order.
//!
//! Layout: this module is the [`CpuBackend`] handle and its [`GpuBackend`]
//! calls; `exec` the shared state, submission checks and execution on
//! workers; `stream` the queues, events and captures; `ledger` the memory;
//! `latch` a host-side gate that holds a stream for tests.

mod exec;
mod latch;
pub mod ledger;
mod stream;

pub use latch::Latch;

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use parking_lot::{Mutex, RwLock};

use crate::error::{GpuError, Result};
use crate::gpu::{
    AllocationInfo, ArgKind, DevicePtr, EventHandle, GpuBackend, GraphHandle, HostKernelFn,
    HostMapped, KernelArg, KernelHandle, LaunchConfig, MemoryKind, StreamId,
};
use exec::{Inner, KernelTable, UNREPLAYABLE_COPY, on_worker, refuse_on_worker, worker};
use ledger::{DEVICE_ALIGN, HOST_MAPPED_ALIGN, Ledger};
use stream::{Capture, Event, KernelEntry, Node, Stream};

/// The CPU backend. `CpuBackend::new()` returns a plain value; wrap it in an
/// `Arc` when it must be shared (`Arc<CpuBackend>` coerces to
/// `Arc<dyn GpuBackend>`). Dropping it waits for all queued work and joins
/// the stream workers.
pub struct CpuBackend {
    inner: Arc<Inner>,
}

impl Default for CpuBackend {
    fn default() -> Self {
        Self::new()
    }
}

impl CpuBackend {
    /// A backend whose new allocations are zeroed, unless the environment
    /// variable `METRALE_GPU_DEBUG` is `1`, which turns on debug mode (see
    /// [`Self::new_debug`]) for every backend made here, e.g. for a whole
    /// test run.
    pub fn new() -> CpuBackend {
        Self::build(std::env::var_os("METRALE_GPU_DEBUG").is_some_and(|v| v == "1"))
    }

    /// A backend in debug mode: new allocations are filled with 0xFF (NaN in
    /// every float format) and freed memory with 0xDE before release, so
    /// reading uninitialised or freed memory shows.
    pub fn new_debug() -> CpuBackend {
        Self::build(true)
    }

    /// Whether this backend is in debug mode.
    pub fn is_debug(&self) -> bool {
        self.inner.debug
    }

    fn build(debug: bool) -> CpuBackend {
        let inner = Arc::new(Inner {
            debug,
            ledger: Ledger::new(debug),
            exec: RwLock::new(()),
            deferred: Mutex::new(Vec::new()),
            streams: RwLock::new(HashMap::new()),
            next_stream: AtomicU64::new(1),
            events: Mutex::new(HashMap::new()),
            next_event: AtomicU64::new(1),
            graphs: Mutex::new(HashMap::new()),
            next_graph: AtomicU64::new(1),
            kernels: RwLock::new(KernelTable::default()),
        });
        let b = CpuBackend { inner };
        // The default stream cannot fail to start short of thread exhaustion
        // at construction, which is unrecoverable for a runtime.
        b.spawn_stream(0)
            .expect("cannot start the default stream's worker thread");
        b
    }

    fn spawn_stream(&self, id: StreamId) -> Result<()> {
        let (s, rx) = Stream::new(id);
        let inner = self.inner.clone();
        let s2 = s.clone();
        let h = std::thread::Builder::new()
            .name(format!("cpu-stream-{id}"))
            .spawn(move || worker(inner, s2, rx))
            .map_err(|e| GpuError::OutOfResources {
                op: "create_stream".into(),
                reason: format!("cannot start a worker thread: {e}"),
            })?;
        s.set_worker(h);
        self.inner.streams.write().insert(id, s);
        Ok(())
    }

    fn all_streams(&self) -> Vec<Arc<Stream>> {
        self.inner.streams.read().values().cloned().collect()
    }

    fn copy_sync(&self, op: &str, node: Node) -> Result<()> {
        self.inner.validate(op, &node)?;
        self.inner.sync_prologue(op)?;
        self.inner.execute(&op, &node)
    }
}

impl Drop for CpuBackend {
    fn drop(&mut self) {
        let streams: Vec<_> = self.inner.streams.write().drain().map(|(_, s)| s).collect();
        for s in streams {
            s.shutdown();
        }
    }
}

impl GpuBackend for CpuBackend {
    fn name(&self) -> &str {
        "cpu"
    }

    fn alloc(&self, bytes: usize, label: &str) -> Result<DevicePtr> {
        let (p, _) =
            self.inner
                .ledger
                .alloc("alloc", bytes, DEVICE_ALIGN, label, MemoryKind::Device)?;
        Ok(p)
    }

    fn dealloc(&self, ptr: DevicePtr) -> Result<()> {
        if ptr.is_null() {
            return Ok(());
        }
        self.inner.ledger.check_freeable(ptr)?;
        if !on_worker() {
            // As cuMemFree: work already queued may still use the memory.
            for s in self.all_streams() {
                drop(s.drain());
            }
        }
        let entry = self.inner.ledger.remove(ptr)?;
        self.inner.release(entry);
        Ok(())
    }

    fn alloc_host_mapped(&self, bytes: usize, label: &str) -> Result<HostMapped> {
        let (device, host) = self.inner.ledger.alloc(
            "alloc_host_mapped",
            bytes,
            HOST_MAPPED_ALIGN,
            label,
            MemoryKind::HostMapped,
        )?;
        Ok(HostMapped {
            device,
            host: host as *mut u8,
            bytes,
        })
    }

    unsafe fn register_host(&self, host: *mut u8, bytes: usize, label: &str) -> Result<DevicePtr> {
        self.inner
            .ledger
            .register("register_host", host, bytes, label)
    }

    fn memset(&self, dst: DevicePtr, value: u8, bytes: usize) -> Result<()> {
        self.copy_sync("memset", Node::Memset { dst, value, bytes })
    }

    fn memset_async(
        &self,
        dst: DevicePtr,
        value: u8,
        bytes: usize,
        stream: StreamId,
    ) -> Result<()> {
        let s = self.inner.stream("memset_async", stream)?;
        self.inner
            .submit("memset_async", &s, &[Node::Memset { dst, value, bytes }])
    }

    fn copy_h2d(&self, src: &[u8], dst: DevicePtr) -> Result<()> {
        let op = "copy_h2d";
        self.inner.ledger.resolve(op, dst, src.len())?;
        self.inner.sync_prologue(op)?;
        let _barrier = self.inner.exec.read_recursive();
        let d = self.inner.ledger.resolve(op, dst, src.len())?;
        // SAFETY: `d` has `src.len()` checked bytes kept alive by the
        // barrier; `src` is host memory outside the ledger's owned buffers
        // (a registered buffer overlapping it is the caller's aliasing).
        unsafe { std::ptr::copy(src.as_ptr(), d, src.len()) };
        Ok(())
    }

    fn copy_d2h(&self, src: DevicePtr, dst: &mut [u8]) -> Result<()> {
        let op = "copy_d2h";
        self.inner.ledger.resolve(op, src, dst.len())?;
        self.inner.sync_prologue(op)?;
        let _barrier = self.inner.exec.read_recursive();
        let s = self.inner.ledger.resolve(op, src, dst.len())?;
        // SAFETY: `s` has `dst.len()` checked bytes kept alive by the barrier.
        unsafe { std::ptr::copy(s, dst.as_mut_ptr(), dst.len()) };
        Ok(())
    }

    fn copy_d2d(&self, src: DevicePtr, dst: DevicePtr, bytes: usize) -> Result<()> {
        self.copy_sync("copy_d2d", Node::CopyD2D { src, dst, bytes })
    }

    fn copy_h2d_async(&self, src: &[u8], dst: DevicePtr, stream: StreamId) -> Result<()> {
        let op = "copy_h2d_async";
        let s = self.inner.stream(op, stream)?;
        self.inner.ledger.resolve(op, dst, src.len())?;
        // As CUDA allows copies from page-locked memory under capture: a
        // source inside host-mapped or registered memory is recorded as a
        // copy from its device address, read at each replay.
        if s.state.lock().capture.is_some()
            && let Some(dev) = self.inner.ledger.device_of_host(src.as_ptr(), src.len())
        {
            let node = Node::CopyD2D {
                src: dev,
                dst,
                bytes: src.len(),
            };
            return self.inner.submit(op, &s, &[node]);
        }
        // Refuse before copying the source: under capture it is never used.
        self.inner.refuse_if_capturing(op, &s, UNREPLAYABLE_COPY)?;
        self.inner.submit_h2d(op, &s, src, dst)
    }

    fn copy_d2h_on_stream(&self, src: DevicePtr, dst: &mut [u8], stream: StreamId) -> Result<()> {
        let op = "copy_d2h_on_stream";
        let s = self.inner.stream(op, stream)?;
        self.inner
            .refuse_if_capturing(op, &s, "a blocking read cannot be captured")?;
        self.inner.ledger.resolve(op, src, dst.len())?;
        self.inner.sync_stream(op, &s)?;
        let _barrier = self.inner.exec.read_recursive();
        let p = self.inner.ledger.resolve(op, src, dst.len())?;
        // SAFETY: `p` has `dst.len()` checked bytes kept alive by the barrier.
        unsafe { std::ptr::copy(p, dst.as_mut_ptr(), dst.len()) };
        Ok(())
    }

    fn copy_d2d_async(
        &self,
        src: DevicePtr,
        dst: DevicePtr,
        bytes: usize,
        stream: StreamId,
    ) -> Result<()> {
        let s = self.inner.stream("copy_d2d_async", stream)?;
        self.inner
            .submit("copy_d2d_async", &s, &[Node::CopyD2D { src, dst, bytes }])
    }

    fn create_stream(&self) -> Result<StreamId> {
        let id = self.inner.next_stream.fetch_add(1, Ordering::Relaxed);
        self.spawn_stream(id)?;
        Ok(id)
    }

    fn destroy_stream(&self, stream: StreamId) -> Result<()> {
        let op = "destroy_stream";
        if stream == 0 {
            return Err(GpuError::invalid(
                op,
                "the default stream cannot be destroyed",
            ));
        }
        let s = self.inner.stream(op, stream)?;
        if s.state.lock().capture.is_some() {
            return Err(GpuError::AlreadyCapturing {
                op: op.into(),
                stream,
            });
        }
        refuse_on_worker(op, || format!("stream {stream}"))?;
        self.inner.streams.write().remove(&stream);
        let pending = s.drain().error.take();
        s.shutdown();
        match pending {
            None => Ok(()),
            // The stream is gone either way; its sticky error is not lost.
            Some(e) => Err(GpuError::Stream {
                op: op.into(),
                stream,
                cause: Box::new(e),
            }),
        }
    }

    fn synchronize(&self, stream: StreamId) -> Result<()> {
        let s = self.inner.stream("synchronize", stream)?;
        self.inner
            .refuse_if_capturing("synchronize", &s, "a blocking wait cannot be captured")?;
        self.inner.sync_stream("synchronize", &s)
    }

    fn create_event(&self) -> Result<EventHandle> {
        let id = self.inner.next_event.fetch_add(1, Ordering::Relaxed);
        self.inner
            .events
            .lock()
            .insert(id, Arc::new(Event::new(id)));
        Ok(EventHandle(id))
    }

    fn record_event(&self, event: EventHandle, stream: StreamId) -> Result<()> {
        let ev = self.inner.event("record_event", event)?;
        let s = self.inner.stream("record_event", stream)?;
        self.inner.submit("record_event", &s, &[Node::Record(ev)])
    }

    fn stream_wait_event(&self, stream: StreamId, event: EventHandle) -> Result<()> {
        let ev = self.inner.event("stream_wait_event", event)?;
        let s = self.inner.stream("stream_wait_event", stream)?;
        self.inner
            .submit("stream_wait_event", &s, &[Node::Wait(ev)])
    }

    fn event_synchronize(&self, event: EventHandle) -> Result<()> {
        let ev = self.inner.event("event_synchronize", event)?;
        let g = ev.last();
        if g == 0 || ev.is_complete(g) {
            return Ok(());
        }
        refuse_on_worker("event_synchronize", || format!("event {}", ev.id))?;
        ev.wait(g);
        Ok(())
    }

    fn event_query(&self, event: EventHandle) -> Result<bool> {
        let ev = self.inner.event("event_query", event)?;
        let g = ev.last();
        Ok(g == 0 || ev.is_complete(g))
    }

    fn destroy_event(&self, event: EventHandle) -> Result<()> {
        // Queued records and waits hold their own reference, so they still
        // complete after the handle is gone.
        self.inner
            .events
            .lock()
            .remove(&event.0)
            .map(drop)
            .ok_or_else(|| GpuError::UnknownEvent {
                op: "destroy_event".into(),
                event: event.0,
            })
    }

    fn begin_capture(&self, stream: StreamId) -> Result<()> {
        let s = self.inner.stream("begin_capture", stream)?;
        let mut st = s.state.lock();
        if st.capture.is_some() {
            return Err(GpuError::AlreadyCapturing {
                op: "begin_capture".into(),
                stream,
            });
        }
        st.capture = Some(Capture {
            nodes: Vec::new(),
            invalid: None,
        });
        Ok(())
    }

    fn end_capture(&self, stream: StreamId) -> Result<GraphHandle> {
        let s = self.inner.stream("end_capture", stream)?;
        let cap = s
            .state
            .lock()
            .capture
            .take()
            .ok_or(GpuError::NotCapturing { stream })?;
        if let Some(why) = cap.invalid {
            return Err(GpuError::CaptureInvalidated {
                stream,
                cause: Box::new(why),
            });
        }
        let id = self.inner.next_graph.fetch_add(1, Ordering::Relaxed);
        self.inner.graphs.lock().insert(id, cap.nodes.into());
        Ok(GraphHandle(id))
    }

    fn stream_is_capturing(&self, stream: StreamId) -> Result<bool> {
        let s = self.inner.stream("stream_is_capturing", stream)?;
        Ok(s.state.lock().capture.is_some())
    }

    fn launch_graph(&self, graph: GraphHandle, stream: StreamId) -> Result<()> {
        let op = "launch_graph";
        let nodes = self
            .inner
            .graphs
            .lock()
            .get(&graph.0)
            .cloned()
            .ok_or_else(|| GpuError::UnknownGraph {
                op: op.into(),
                graph: graph.0,
            })?;
        let s = self.inner.stream(op, stream)?;
        self.inner
            .submit(&format!("{op} (graph {})", graph.0), &s, &nodes)
    }

    fn destroy_graph(&self, graph: GraphHandle) -> Result<()> {
        self.inner
            .graphs
            .lock()
            .remove(&graph.0)
            .map(drop)
            .ok_or_else(|| GpuError::UnknownGraph {
                op: "destroy_graph".into(),
                graph: graph.0,
            })
    }

    fn supports_host_kernels(&self) -> bool {
        true
    }

    fn register_host_kernel(
        &self,
        module: &str,
        name: &str,
        signature: &[ArgKind],
        body: Arc<HostKernelFn>,
    ) -> Result<()> {
        if module.is_empty() || name.is_empty() {
            return Err(GpuError::invalid(
                "register_host_kernel",
                format!("empty module or kernel name ('{module}::{name}')"),
            ));
        }
        let entry = Arc::new(KernelEntry {
            qualified: format!("{module}::{name}"),
            signature: signature.to_vec(),
            body,
        });
        let mut t = self.inner.kernels.write();
        match t.by_name.get(&(module.to_string(), name.to_string())) {
            Some(&i) => t.slots[i] = entry,
            None => {
                let i = t.slots.len();
                t.slots.push(entry);
                t.by_name.insert((module.to_string(), name.to_string()), i);
            }
        }
        Ok(())
    }

    fn load_module(&self, module: &str, _image: &[u8]) -> Result<()> {
        Err(GpuError::unsupported(
            format!("load_module '{module}'"),
            "device code modules need the CUDA backend; the CPU backend runs host kernels \
             registered with register_host_kernel",
        ))
    }

    fn kernel(&self, module: &str, name: &str) -> Result<KernelHandle> {
        let t = self.inner.kernels.read();
        if let Some(&i) = t.by_name.get(&(module.to_string(), name.to_string())) {
            return Ok(KernelHandle(i as u64 + 1));
        }
        let mut known: Vec<String> = t
            .by_name
            .keys()
            .filter(|(m, _)| m == module)
            .map(|(_, n)| n.clone())
            .collect();
        known.sort_unstable();
        Err(GpuError::NoSuchKernel {
            module: module.into(),
            name: name.into(),
            known,
        })
    }

    fn launch_kernel(
        &self,
        kernel: KernelHandle,
        cfg: LaunchConfig,
        args: &[KernelArg],
        stream: StreamId,
    ) -> Result<()> {
        let entry = {
            let t = self.inner.kernels.read();
            (kernel.0 as usize)
                .checked_sub(1)
                .and_then(|i| t.slots.get(i))
                .cloned()
                .ok_or(GpuError::UnknownKernelHandle { handle: kernel.0 })?
        };
        let q = &entry.qualified;
        let (g, b) = (cfg.grid, cfg.block);
        if g.0 == 0 || g.1 == 0 || g.2 == 0 || b.0 == 0 || b.1 == 0 || b.2 == 0 {
            return Err(GpuError::InvalidLaunch {
                kernel: q.clone(),
                grid: g,
                block: b,
            });
        }
        if args.len() != entry.signature.len() {
            return Err(GpuError::ArgCount {
                kernel: q.clone(),
                expected: entry.signature.len(),
                got: args.len(),
            });
        }
        for (i, (a, k)) in args.iter().zip(&entry.signature).enumerate() {
            if a.kind() != *k {
                return Err(GpuError::ArgType {
                    kernel: q.clone(),
                    index: i,
                    expected: *k,
                    got: *a,
                });
            }
        }
        let s = self.inner.stream("launch_kernel", stream)?;
        self.inner.submit(
            "launch_kernel",
            &s,
            &[Node::Kernel {
                kernel: entry,
                cfg,
                args: args.into(),
            }],
        )
    }

    fn live_bytes(&self) -> usize {
        self.inner.ledger.live_bytes()
    }

    fn live_alloc_count(&self) -> usize {
        self.inner.ledger.live_count()
    }

    fn live_allocations(&self) -> Vec<AllocationInfo> {
        self.inner.ledger.allocations()
    }
}

#[cfg(test)]
mod tests;
