//! The execution core of the CPU backend: the state shared by the backend
//! handle and its stream workers ([`Inner`]), the checks every submission
//! passes (pointers against the ledger, capture refusals), and running one
//! queued operation on a worker.
//!
//! Invariants (see the backend's module docs for the full list): every
//! pointer is checked when an operation is submitted and again when it
//! runs, under the shared execution barrier; a refused submission under
//! capture invalidates the capture; a blocking call from a worker thread is
//! refused rather than deadlocking.

use std::cell::Cell;
use std::collections::HashMap;
use std::fmt;
use std::sync::Arc;
use std::sync::atomic::AtomicU64;

use parking_lot::{Mutex, RwLock};

use super::ledger::{Entry, Ledger};
use super::stream::{self, Capture, Event, KernelEntry, Msg, Node, Stream};
use crate::error::{GpuError, Result};
use crate::gpu::{DevicePtr, EventHandle, HostMemory, KernelArg, StreamId};

thread_local! {
    /// Set on stream worker threads, where blocking on a stream would
    /// deadlock.
    static ON_WORKER: Cell<bool> = const { Cell::new(false) };
}

/// The pointer of a non-null pointer argument (null pointers are allowed
/// as kernel arguments: kernels may take optional buffers).
fn non_null_ptr(a: &KernelArg) -> Option<DevicePtr> {
    match a {
        KernelArg::Ptr(p) if !p.is_null() => Some(*p),
        _ => None,
    }
}

pub(super) fn on_worker() -> bool {
    ON_WORKER.with(|w| w.get())
}

/// Refuse a blocking `op` on a stream worker thread, where waiting on `on`
/// (formatted only when refused) would deadlock.
pub(super) fn refuse_on_worker(op: &str, on: impl FnOnce() -> String) -> Result<()> {
    if on_worker() {
        return Err(GpuError::WouldDeadlock {
            op: op.to_string(),
            on: on(),
        });
    }
    Ok(())
}

/// Why a copy from pageable host memory cannot be captured.
pub(super) const UNREPLAYABLE_COPY: &str = "a copy from ordinary host memory cannot be replayed (stage it \
                                 in alloc_host_mapped memory, whose copies replay)";

/// Refuse `op` on capturing `stream`: the capture is invalidated (the first
/// refusal is kept) and the error returned.
fn refuse(cap: &mut Capture, op: &str, stream: StreamId, why: &str) -> GpuError {
    let e = GpuError::CaptureViolation {
        op: op.to_string(),
        stream,
        why: why.to_string(),
    };
    cap.invalid.get_or_insert_with(|| e.clone());
    e
}

/// Registered kernels: handles index `slots`; re-registering a name replaces
/// its slot, so existing handles launch the new body.
#[derive(Default)]
pub(super) struct KernelTable {
    pub(super) by_name: HashMap<(String, String), usize>,
    pub(super) slots: Vec<Arc<KernelEntry>>,
}

/// State shared by the backend handle and its worker threads.
pub(super) struct Inner {
    pub(super) debug: bool,
    pub(super) ledger: Ledger,
    /// The execution barrier: shared while an operation touches memory,
    /// exclusive while `free` releases bytes.
    pub(super) exec: RwLock<()>,
    /// Allocations freed from a worker thread, released at the next `free`
    /// from an ordinary thread or on drop.
    pub(super) deferred: Mutex<Vec<Entry>>,
    pub(super) streams: RwLock<HashMap<StreamId, Arc<Stream>>>,
    pub(super) next_stream: AtomicU64,
    pub(super) events: Mutex<HashMap<u64, Arc<Event>>>,
    pub(super) next_event: AtomicU64,
    pub(super) graphs: Mutex<HashMap<u64, Arc<[Node]>>>,
    pub(super) next_graph: AtomicU64,
    pub(super) kernels: RwLock<KernelTable>,
}

/// Checked access to memory for a running kernel.
struct KernelMemory<'a> {
    ledger: &'a Ledger,
    op: &'a (dyn fmt::Display + Sync),
}

/// "`call` on stream `id`", formatted only when an error needs it.
struct OnStream(&'static str, StreamId);

impl fmt::Display for OnStream {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} on stream {}", self.0, self.1)
    }
}

/// Two parts of an operation's name, joined by a space when formatted.
struct Joined<'a>(&'a (dyn fmt::Display + Sync), &'a str);

impl fmt::Display for Joined<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} {}", self.0, self.1)
    }
}

impl HostMemory for KernelMemory<'_> {
    #[inline]
    fn host_ptr(&self, ptr: DevicePtr, bytes: usize) -> Result<*mut u8> {
        self.ledger.resolve(self.op, ptr, bytes)
    }

    fn as_sync(&self) -> Option<&(dyn HostMemory + Sync)> {
        Some(self)
    }
}

impl Inner {
    pub(super) fn stream(&self, op: &str, id: StreamId) -> Result<Arc<Stream>> {
        self.streams
            .read()
            .get(&id)
            .cloned()
            .ok_or_else(|| GpuError::UnknownStream {
                op: op.to_string(),
                stream: id,
            })
    }

    pub(super) fn event(&self, op: &str, ev: EventHandle) -> Result<Arc<Event>> {
        self.events
            .lock()
            .get(&ev.0)
            .cloned()
            .ok_or_else(|| GpuError::UnknownEvent {
                op: op.to_string(),
                event: ev.0,
            })
    }

    /// Check every pointer of `node` against the ledger.
    pub(super) fn validate(&self, op: &str, node: &Node) -> Result<()> {
        match node {
            Node::Memset { dst, bytes, .. } => self.ledger.resolve(op, *dst, *bytes).map(drop),
            Node::CopyH2D { src, dst } => self.ledger.resolve(op, *dst, src.len()).map(drop),
            Node::CopyD2D { src, dst, bytes } => {
                self.ledger
                    .resolve(&format_args!("{op} (source)"), *src, *bytes)?;
                self.ledger
                    .resolve(&format_args!("{op} (destination)"), *dst, *bytes)
                    .map(drop)
            }
            Node::Kernel { kernel, args, .. } => {
                for (i, a) in args.iter().enumerate() {
                    if let Some(p) = non_null_ptr(a) {
                        self.ledger.resolve(
                            &format_args!("{op} {}: argument {i}", kernel.qualified),
                            p,
                            0,
                        )?;
                    }
                }
                Ok(())
            }
            Node::Record(_) | Node::Wait(_) => Ok(()),
        }
    }

    /// Submit `nodes` to `stream` atomically (no other submission interleaves),
    /// after checking them all. Under capture they are recorded instead; a
    /// node that cannot be captured invalidates the capture and is refused.
    pub(super) fn submit(&self, op: &str, stream: &Stream, nodes: &[Node]) -> Result<()> {
        for n in nodes {
            self.validate(op, n)?;
        }
        let mut st = stream.state.lock();
        if let Some(cap) = st.capture.as_mut() {
            if let Some(n) = nodes.iter().find(|n| matches!(n, Node::CopyH2D { .. })) {
                return Err(refuse(cap, n.op_name(), stream.id, UNREPLAYABLE_COPY));
            }
            cap.nodes.extend_from_slice(nodes);
            return Ok(());
        }
        for n in nodes {
            let msg = match n {
                Node::Record(ev) => Msg::Record(ev.clone(), ev.issue()),
                Node::Wait(ev) => match ev.last() {
                    0 => continue,
                    g => Msg::Wait(ev.clone(), g),
                },
                n => Msg::Work(n.clone()),
            };
            stream.send_locked(&mut st, msg)?;
        }
        Ok(())
    }

    /// Submit a host-to-device copy of `src` to `stream` (not capturing when
    /// called; a capture begun since is refused by [`Self::submit`]).
    ///
    /// The source must be copied on this thread either way: queued, into a
    /// buffer the operation owns. So when the stream is idle (everything
    /// submitted has completed), the call is from an ordinary thread and the
    /// stream is neither capturing nor closed, the bytes go straight to
    /// `dst` under the stream's lock instead: no later submission can
    /// overtake the copy and no earlier one is outstanding, which is the
    /// order the queue would give, without waking the worker or a waiter.
    /// Such a copy is counted in neither `submitted` nor `completed`; an
    /// error it raises sticks to the stream like a queued one's.
    pub(super) fn submit_h2d(
        &self,
        op: &str,
        stream: &Stream,
        src: &[u8],
        dst: DevicePtr,
    ) -> Result<()> {
        self.ledger.resolve(op, dst, src.len())?;
        if !on_worker() {
            let mut st = stream.state.lock();
            if st.capture.is_none() && !st.closed && st.completed == st.submitted {
                if let Err(e) = self.copy_in(&OnStream("copy_h2d_async", stream.id), src, dst) {
                    st.error.get_or_insert(e);
                }
                return Ok(());
            }
        }
        let node = Node::CopyH2D {
            src: Arc::from(src),
            dst,
        };
        self.submit(op, stream, &[node])
    }

    /// Copy host bytes to `dst` on the calling thread, under the barrier.
    fn copy_in(&self, op: &(dyn fmt::Display + Sync), src: &[u8], dst: DevicePtr) -> Result<()> {
        let _barrier = self.exec.read_recursive();
        let d = self.ledger.resolve(op, dst, src.len())?;
        // SAFETY: `d` has `src.len()` checked bytes kept alive by the
        // barrier; `copy` allows a registered source that aliases `dst`.
        unsafe { std::ptr::copy(src.as_ptr(), d, src.len()) };
        Ok(())
    }

    /// Refuse `op` if `stream` is capturing, invalidating the capture.
    pub(super) fn refuse_if_capturing(&self, op: &str, stream: &Stream, what: &str) -> Result<()> {
        let mut st = stream.state.lock();
        match st.capture.as_mut() {
            Some(cap) => Err(refuse(cap, op, stream.id, what)),
            None => Ok(()),
        }
    }

    /// Wait for all work queued on `stream` and take its pending error.
    pub(super) fn sync_stream(&self, op: &str, stream: &Stream) -> Result<()> {
        refuse_on_worker(op, || format!("stream {}", stream.id))?;
        let mut st = stream.drain();
        match st.error.take() {
            None => Ok(()),
            Some(e) => Err(GpuError::Stream {
                op: op.to_string(),
                stream: stream.id,
                cause: Box::new(e),
            }),
        }
    }

    /// The prologue of a synchronous memory call: refuse under capture of the
    /// default stream, wait for it and report its pending error.
    pub(super) fn sync_prologue(&self, op: &str) -> Result<()> {
        let s = self.stream(op, 0)?;
        self.refuse_if_capturing(op, &s, "a synchronous copy cannot be captured")?;
        self.sync_stream(op, &s)
    }

    /// Run one node on the calling thread.
    pub(super) fn execute(&self, op: &(dyn fmt::Display + Sync), node: &Node) -> Result<()> {
        let _barrier = self.exec.read_recursive();
        match node {
            Node::Memset { dst, value, bytes } => {
                let d = self.ledger.resolve(op, *dst, *bytes)?;
                // SAFETY: the ledger checked `bytes` at `d`; the barrier keeps
                // the allocation alive while we write.
                unsafe { std::ptr::write_bytes(d, *value, *bytes) };
            }
            Node::CopyH2D { src, dst } => {
                let d = self.ledger.resolve(op, *dst, src.len())?;
                // SAFETY: `d` has `src.len()` checked bytes; `src` is our own
                // buffer, so they cannot overlap.
                unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), d, src.len()) };
            }
            Node::CopyD2D { src, dst, bytes } => {
                let s = self
                    .ledger
                    .resolve(&format_args!("{op} (source)"), *src, *bytes)?;
                let d = self
                    .ledger
                    .resolve(&format_args!("{op} (destination)"), *dst, *bytes)?;
                // SAFETY: both ranges were checked; `copy` allows overlap.
                unsafe { std::ptr::copy(s, d, *bytes) };
            }
            Node::Kernel { kernel, cfg, args } => {
                let what = Joined(op, &kernel.qualified);
                let failed = |cause| GpuError::KernelFailed {
                    op: op.to_string(),
                    kernel: kernel.qualified.clone(),
                    cause: Box::new(cause),
                };
                for (i, a) in args.iter().enumerate() {
                    if let Some(p) = non_null_ptr(a) {
                        self.ledger
                            .resolve(&format_args!("{what}: argument {i}"), p, 0)?;
                    }
                }
                let mem = KernelMemory {
                    ledger: &self.ledger,
                    op: &what,
                };
                let body = &kernel.body;
                let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                    body(&mem as &dyn HostMemory, cfg, args)
                }));
                match r {
                    Ok(r) => r.map_err(failed)?,
                    Err(p) => {
                        let message = p
                            .downcast_ref::<&str>()
                            .map(|s| s.to_string())
                            .or_else(|| p.downcast_ref::<String>().cloned())
                            .unwrap_or_else(|| "non-string panic".into());
                        return Err(GpuError::KernelPanicked {
                            op: op.to_string(),
                            kernel: kernel.qualified.clone(),
                            message,
                        });
                    }
                }
            }
            Node::Record(_) | Node::Wait(_) => {}
        }
        Ok(())
    }

    /// Release the memory of a removed entry once no operation can be
    /// touching it.
    pub(super) fn release(&self, entry: Entry) {
        if on_worker() {
            // This thread holds the barrier; waiting for it would deadlock.
            self.deferred.lock().push(entry);
            return;
        }
        let _excl = self.exec.write();
        drop(entry);
        let deferred = std::mem::take(&mut *self.deferred.lock());
        drop(deferred);
    }
}

/// The worker loop of one stream.
pub(super) fn worker(inner: Arc<Inner>, stream: Arc<Stream>, rx: crossbeam_channel::Receiver<Msg>) {
    ON_WORKER.with(|w| w.set(true));
    let id = stream.id;
    while let Some(msg) = stream::next_msg(&rx) {
        let r = match msg {
            Msg::Work(node) => inner.execute(&OnStream(node.op_name(), id), &node),
            Msg::Record(ev, g) => {
                ev.complete(g);
                Ok(())
            }
            Msg::Wait(ev, g) => {
                ev.wait(g);
                Ok(())
            }
            Msg::Shutdown => break,
        };
        stream.finish(r);
    }
}
