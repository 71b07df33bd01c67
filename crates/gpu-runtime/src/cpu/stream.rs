//! Streams, events and queued operations of the CPU backend.
//!
//! Each stream is an in-order queue drained by its own worker thread.
//! Invariants:
//! - `submitted` counts operations sent to the worker and `completed` those
//!   it has finished; both only grow, under the stream's lock, so "all work
//!   queued before now" is `completed >= submitted-at-call-time`;
//! - a host-to-device copy submitted from an ordinary thread to an idle
//!   stream (`completed == submitted`, not capturing, not closed) runs on
//!   the caller under the state lock instead of being sent, and is counted
//!   in neither: nothing is outstanding before it and nothing can be
//!   submitted until it is done, so the stream's order is the queue's;
//! - the first error raised by a queued operation is kept (later ones are
//!   dropped) until a synchronising call takes it; operations queued after a
//!   failed one still run, as on CUDA, where a failed copy does not cancel the
//!   rest of the stream;
//! - while a stream captures, submissions go to its capture list instead of
//!   the worker; a refused submission invalidates the capture;
//! - every event record gets a fresh generation; a generation is pending from
//!   its submission until its marker runs, and a wait blocks on exactly the
//!   generation that was the event's last record when the wait was queued
//!   (a never-recorded event never blocks).

use std::collections::BTreeSet;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, Sender, TryRecvError};
use parking_lot::{Condvar, Mutex};

use crate::error::{GpuError, Result};
use crate::gpu::{ArgKind, DevicePtr, HostKernelFn, KernelArg, LaunchConfig, StreamId};

/// How long a worker, or a thread waiting for one, polls before sleeping.
/// Waking a sleeping thread costs several microseconds, which would dominate
/// the launch of a small kernel; polling this long is cheap by comparison.
/// Work that arrives after a longer pause still finds the worker asleep,
/// and its wake-up is far slower when the worker's CPU has gone idle: that
/// is why a lone host-to-device copy to an idle stream skips the worker
/// (see `Inner::submit_h2d`).
const SPIN: Duration = Duration::from_micros(30);

/// The next message for a worker, polling briefly before blocking; `None`
/// once every sender is gone.
pub(crate) fn next_msg(rx: &Receiver<Msg>) -> Option<Msg> {
    let t0 = Instant::now();
    loop {
        match rx.try_recv() {
            Ok(m) => return Some(m),
            Err(TryRecvError::Disconnected) => return None,
            Err(TryRecvError::Empty) if t0.elapsed() < SPIN => std::thread::yield_now(),
            Err(TryRecvError::Empty) => return rx.recv().ok(),
        }
    }
}

/// A registered host kernel.
pub(crate) struct KernelEntry {
    /// `module::name`, for messages.
    pub qualified: String,
    /// The argument kinds it takes.
    pub signature: Vec<ArgKind>,
    /// Its body.
    pub body: Arc<HostKernelFn>,
}

/// An operation as submitted (and as recorded in a graph).
#[derive(Clone)]
pub(crate) enum Node {
    /// Fill bytes.
    Memset {
        /// Destination.
        dst: DevicePtr,
        /// Fill byte.
        value: u8,
        /// Length.
        bytes: usize,
    },
    /// Copy bytes captured from the host at submission.
    CopyH2D {
        /// The bytes, owned by the operation.
        src: Arc<[u8]>,
        /// Destination.
        dst: DevicePtr,
    },
    /// Copy between device addresses (overlap allowed).
    CopyD2D {
        /// Source.
        src: DevicePtr,
        /// Destination.
        dst: DevicePtr,
        /// Length.
        bytes: usize,
    },
    /// Run a host kernel.
    Kernel {
        /// The kernel as registered when submitted.
        kernel: Arc<KernelEntry>,
        /// Grid and block.
        cfg: LaunchConfig,
        /// Checked arguments.
        args: Arc<[KernelArg]>,
    },
    /// Record an event.
    Record(Arc<Event>),
    /// Wait for an event's last record.
    Wait(Arc<Event>),
}

impl Node {
    /// The API call that produced this node, for messages.
    pub fn op_name(&self) -> &'static str {
        match self {
            Node::Memset { .. } => "memset_async",
            Node::CopyH2D { .. } => "copy_h2d_async",
            Node::CopyD2D { .. } => "copy_d2d_async",
            Node::Kernel { .. } => "launch_kernel",
            Node::Record(_) => "record_event",
            Node::Wait(_) => "stream_wait_event",
        }
    }
}

/// What a worker receives.
pub(crate) enum Msg {
    /// Run a memory operation or kernel.
    Work(Node),
    /// Mark generation `.1` of the event complete.
    Record(Arc<Event>, u64),
    /// Block until generation `.1` of the event is complete.
    Wait(Arc<Event>, u64),
    /// Finish: the worker exits after everything queued before it.
    Shutdown,
}

/// An event: a sequence of recorded generations.
pub(crate) struct Event {
    /// Its handle value.
    pub id: u64,
    state: Mutex<EventState>,
    cv: Condvar,
}

#[derive(Default)]
struct EventState {
    next_gen: u64,
    /// The last generation recorded (0: never recorded).
    last: u64,
    /// Generations submitted but not yet reached by their stream.
    pending: BTreeSet<u64>,
}

impl Event {
    /// A never-recorded event.
    pub fn new(id: u64) -> Self {
        Event {
            id,
            state: Mutex::new(EventState::default()),
            cv: Condvar::new(),
        }
    }

    /// Start a new record: returns its generation, now pending.
    pub fn issue(&self) -> u64 {
        let mut s = self.state.lock();
        s.next_gen += 1;
        let g = s.next_gen;
        s.last = g;
        s.pending.insert(g);
        g
    }

    /// The last recorded generation, 0 when never recorded.
    pub fn last(&self) -> u64 {
        self.state.lock().last
    }

    /// Mark generation `g` complete.
    pub fn complete(&self, g: u64) {
        self.state.lock().pending.remove(&g);
        self.cv.notify_all();
    }

    /// Whether generation `g` is complete.
    pub fn is_complete(&self, g: u64) -> bool {
        !self.state.lock().pending.contains(&g)
    }

    /// Block until generation `g` is complete.
    pub fn wait(&self, g: u64) {
        let mut s = self.state.lock();
        while s.pending.contains(&g) {
            self.cv.wait(&mut s);
        }
    }
}

/// A capture in progress.
pub(crate) struct Capture {
    /// Nodes recorded so far.
    pub nodes: Vec<Node>,
    /// Why the capture can no longer succeed, if it cannot.
    pub invalid: Option<GpuError>,
}

/// Mutable state of a stream.
pub(crate) struct StreamState {
    /// Operations sent to the worker.
    pub submitted: u64,
    /// Operations the worker has finished.
    pub completed: u64,
    /// The first error not yet reported.
    pub error: Option<GpuError>,
    /// The capture in progress.
    pub capture: Option<Capture>,
    /// Set when the stream is shut down; later submissions are refused, so
    /// everything counted in `submitted` is reached before `Shutdown`.
    pub closed: bool,
}

/// One in-order stream.
pub(crate) struct Stream {
    /// Its id.
    pub id: StreamId,
    tx: Sender<Msg>,
    /// Counters, pending error and capture.
    pub state: Mutex<StreamState>,
    /// A lock-free copy of `state.completed`, for polling.
    completed: AtomicU64,
    done: Condvar,
    worker: Mutex<Option<JoinHandle<()>>>,
}

impl Stream {
    /// A stream and the receiving end its worker must drain.
    pub fn new(id: StreamId) -> (Arc<Stream>, Receiver<Msg>) {
        let (tx, rx) = crossbeam_channel::unbounded();
        let s = Stream {
            id,
            tx,
            state: Mutex::new(StreamState {
                submitted: 0,
                completed: 0,
                error: None,
                capture: None,
                closed: false,
            }),
            completed: AtomicU64::new(0),
            done: Condvar::new(),
            worker: Mutex::new(None),
        };
        (Arc::new(s), rx)
    }

    /// Attach the worker thread that drains this stream.
    pub fn set_worker(&self, h: JoinHandle<()>) {
        *self.worker.lock() = Some(h);
    }

    /// Send a message to the worker, counting it in `submitted`; the caller
    /// holds the state lock. A record that cannot be sent is completed at
    /// once, so no one waits for it forever.
    pub fn send_locked(&self, st: &mut StreamState, msg: Msg) -> Result<()> {
        let refused = if st.closed {
            Some(msg)
        } else {
            self.tx.send(msg).err().map(|e| e.into_inner())
        };
        match refused {
            None => {
                st.submitted += 1;
                Ok(())
            }
            Some(msg) => {
                if let Msg::Record(ev, g) = msg {
                    ev.complete(g);
                }
                Err(GpuError::StreamDestroyed { stream: self.id })
            }
        }
    }

    /// The worker finished one operation with result `r`.
    pub fn finish(&self, r: Result<()>) {
        let mut st = self.state.lock();
        if let Err(e) = r {
            st.error.get_or_insert(e);
        }
        st.completed += 1;
        self.completed.store(st.completed, Ordering::Release);
        drop(st);
        self.done.notify_all();
    }

    /// Block until everything submitted before this call has run; returns
    /// the locked state so the caller can take the pending error atomically.
    pub fn drain(&self) -> parking_lot::MutexGuard<'_, StreamState> {
        let target = self.state.lock().submitted;
        let t0 = Instant::now();
        while self.completed.load(Ordering::Acquire) < target && t0.elapsed() < SPIN {
            std::thread::yield_now();
        }
        let mut st = self.state.lock();
        while st.completed < target {
            self.done.wait(&mut st);
        }
        st
    }

    /// Ask the worker to stop after its queue and join it.
    pub fn shutdown(&self) {
        {
            let mut st = self.state.lock();
            if !st.closed {
                st.closed = true;
                // A send error means the worker is already gone.
                let _ = self.tx.send(Msg::Shutdown);
            }
        }
        if let Some(h) = self.worker.lock().take() {
            // A worker cannot join itself (a kernel body that held the last
            // handle to the backend): it exits on its own after `Shutdown`.
            if h.thread().id() != std::thread::current().id() {
                // A panicking worker already lost its queue; nothing to add.
                let _ = h.join();
            }
        }
    }
}
