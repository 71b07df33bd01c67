//! [`Wrapped`]: a site around another that hands every call on, consulting
//! a small middleware ([`SiteWrap`]) at the few places a wrapper changes
//! something: a check before a call (a test's hook failing it), the device
//! work of a forward (the backbone's blocks around it, its timing), the
//! token limit, and freeing.
//!
//! Invariant: every [`CarrySite`] and [`Site`] method reaches the inner
//! site with the arguments it came with, and returns what the inner site
//! returned, unless the middleware fails the call or adds work around it;
//! a middleware that changes nothing (`()`) makes the wrapper exactly the
//! inner site: its plans, prefetches, graphs (prestage, replay notes,
//! rearm), limits and counters. The forwarding is written once, here, so
//! no wrapper loses a method to the traits' defaults.

use metrale_gpu_runtime::gpu::{DevicePtr, GpuBackend, StreamId};
use metrale_model_layers::layers::ple::{PlanPart, SeqWork, SiteSpec};
use metrale_storage::table::TableStats;

use crate::engine::{CarrySite, Site, SiteResult};

/// A call a [`SiteWrap`] is shown before it reaches the inner site, with
/// what a check may want of it.
#[derive(Debug)]
pub enum WrappedCall<'a, P> {
    /// [`Site::plan`] of this work.
    Plan {
        /// Each sequence's history and next tokens.
        work: &'a [SeqWork<'a>],
    },
    /// [`Site::prefetch`] of a plan.
    Prefetch {
        /// The plan.
        plan: &'a P,
    },
    /// [`Site::run`] of part of a plan.
    Run {
        /// The plan.
        plan: &'a P,
        /// The part of it that runs.
        part: PlanPart,
    },
    /// [`Site::run_batch`] of entries of a plan.
    RunBatch {
        /// The plan.
        plan: &'a P,
        /// The entry each sequence of the batch runs.
        seqs: &'a [usize],
    },
    /// [`CarrySite::snapshot`].
    Snapshot,
    /// [`CarrySite::restore`].
    Restore,
}

/// Which forward a [`DeviceWork`] is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RunKind {
    /// [`Site::run`]: the rows of one sequence's tokens.
    Run,
    /// [`Site::run_batch`]: one row per sequence.
    RunBatch,
    /// [`Site::forward_prestaged`]: the device half of a replayable decode
    /// step (captured in a graph or run eagerly).
    Prestaged,
}

/// The device work of a forward, as [`SiteWrap::around`] is shown it.
#[derive(Clone, Copy)]
pub struct DeviceWork<'g> {
    /// Which forward.
    pub kind: RunKind,
    /// The `[rows, C]` highway rows it runs over.
    pub highway: DevicePtr,
    /// Rows at `highway`.
    pub rows: usize,
    /// The backend.
    pub gpu: &'g dyn GpuBackend,
    /// The stream it is queued on.
    pub stream: StreamId,
}

/// What a [`Wrapped`] site changes of the site it wraps. Every method has
/// a default that changes nothing.
pub trait SiteWrap<S: Site>: Send + Sync {
    /// Before `call` reaches the inner site: an error fails the call, which
    /// then never reaches it.
    fn check(&self, call: WrappedCall<'_, S::Plan>) -> SiteResult<()> {
        let _ = call;
        Ok(())
    }
    /// Around the inner site's forward `run` (a run, a batched run or a
    /// prestaged forward) over `work`, after [`Self::check`] passed it.
    /// Must call `run` at most once; its error is the forward's.
    fn around(
        &self,
        inner: &S,
        work: DeviceWork<'_>,
        run: impl FnOnce() -> SiteResult<()>,
    ) -> SiteResult<()> {
        let _ = (inner, work);
        run()
    }
    /// The most tokens one forward takes, given the inner site's `inner`.
    fn max_tokens(&self, inner: usize) -> usize {
        inner
    }
    /// After the inner site freed its own memory: free the wrapper's. Must
    /// be idempotent, as [`CarrySite::free`] is.
    fn free(&mut self, gpu: &dyn GpuBackend) -> SiteResult<()> {
        let _ = gpu;
        Ok(())
    }
}

/// The middleware that changes nothing: `Wrapped<S, ()>` is `S`.
impl<S: Site> SiteWrap<S> for () {}

/// `inner`, with `W` consulted where it changes a call. See the module
/// docs.
pub struct Wrapped<S, W> {
    /// The site every call goes to.
    pub inner: S,
    wrap: W,
}

impl<S, W> Wrapped<S, W> {
    /// Wrap `inner` with `wrap` (or anything that converts into it).
    pub fn new(inner: S, wrap: impl Into<W>) -> Self {
        Wrapped {
            inner,
            wrap: wrap.into(),
        }
    }

    /// The wrapped site.
    pub fn inner(&self) -> &S {
        &self.inner
    }

    /// The middleware.
    pub fn wrap(&self) -> &W {
        &self.wrap
    }
}

impl<S: Site, W: SiteWrap<S>> CarrySite for Wrapped<S, W> {
    type State = S::State;

    fn geometry(&self) -> SiteSpec {
        self.inner.geometry()
    }
    fn carry_bytes(&self) -> usize {
        self.inner.carry_bytes()
    }
    fn new_state(&self, gpu: &dyn GpuBackend) -> SiteResult<S::State> {
        self.inner.new_state(gpu)
    }
    fn history<'s>(&self, st: &'s S::State) -> &'s [u32] {
        self.inner.history(st)
    }
    fn snapshot(
        &self,
        st: &S::State,
        gpu: &dyn GpuBackend,
        stream: StreamId,
    ) -> SiteResult<Vec<u8>> {
        self.wrap.check(WrappedCall::Snapshot)?;
        self.inner.snapshot(st, gpu, stream)
    }
    fn restore(
        &self,
        st: &mut S::State,
        blob: &[u8],
        gpu: &dyn GpuBackend,
        stream: StreamId,
    ) -> SiteResult<()> {
        self.wrap.check(WrappedCall::Restore)?;
        self.inner.restore(st, blob, gpu, stream)
    }
    fn release(&self, st: &mut S::State, gpu: &dyn GpuBackend) -> SiteResult<()> {
        self.inner.release(st, gpu)
    }
    fn free(&mut self, gpu: &dyn GpuBackend) -> SiteResult<()> {
        // Both are freed whatever the other did; the inner site's error
        // comes first.
        let inner = self.inner.free(gpu);
        let wrap = self.wrap.free(gpu);
        inner.and(wrap)
    }
}

impl<S: Site, W: SiteWrap<S>> Site for Wrapped<S, W> {
    type Plan = S::Plan;

    fn max_tokens(&self) -> usize {
        self.wrap.max_tokens(self.inner.max_tokens())
    }
    fn plan(&self, work: &[SeqWork<'_>]) -> SiteResult<S::Plan> {
        self.wrap.check(WrappedCall::Plan { work })?;
        self.inner.plan(work)
    }
    fn prefetch(&self, plan: &S::Plan) -> SiteResult<()> {
        self.wrap.check(WrappedCall::Prefetch { plan })?;
        self.inner.prefetch(plan)
    }
    fn run(
        &self,
        plan: &S::Plan,
        part: PlanPart,
        st: &mut S::State,
        highway: DevicePtr,
        fresh: bool,
        gpu: &dyn GpuBackend,
        stream: StreamId,
    ) -> SiteResult<()> {
        self.wrap.check(WrappedCall::Run { plan, part })?;
        let work = DeviceWork {
            kind: RunKind::Run,
            highway,
            rows: part.len,
            gpu,
            stream,
        };
        self.wrap.around(&self.inner, work, || {
            self.inner.run(plan, part, st, highway, fresh, gpu, stream)
        })
    }
    fn run_batch(
        &self,
        plan: &S::Plan,
        seqs: &[usize],
        states: &mut [&mut S::State],
        highway: DevicePtr,
        gpu: &dyn GpuBackend,
        stream: StreamId,
    ) -> SiteResult<()> {
        self.wrap.check(WrappedCall::RunBatch { plan, seqs })?;
        let work = DeviceWork {
            kind: RunKind::RunBatch,
            highway,
            rows: states.len(),
            gpu,
            stream,
        };
        self.wrap.around(&self.inner, work, || {
            self.inner
                .run_batch(plan, seqs, states, highway, gpu, stream)
        })
    }
    fn supports_graphs(&self) -> bool {
        self.inner.supports_graphs()
    }
    fn max_prestage_batch(&self) -> Option<usize> {
        self.inner.max_prestage_batch()
    }
    fn prestage(
        &self,
        plan: &S::Plan,
        seqs: &[usize],
        states: &mut [&mut S::State],
        rows: usize,
        gpu: &dyn GpuBackend,
        stream: StreamId,
    ) -> SiteResult<()> {
        self.inner.prestage(plan, seqs, states, rows, gpu, stream)
    }
    fn forward_prestaged(
        &self,
        states: &mut [&mut S::State],
        highway: DevicePtr,
        rows: usize,
        gpu: &dyn GpuBackend,
        stream: StreamId,
    ) -> SiteResult<()> {
        let work = DeviceWork {
            kind: RunKind::Prestaged,
            highway,
            rows,
            gpu,
            stream,
        };
        self.wrap.around(&self.inner, work, || {
            self.inner
                .forward_prestaged(states, highway, rows, gpu, stream)
        })
    }
    fn note_replayed(
        &self,
        states: &mut [&mut S::State],
        gpu: &dyn GpuBackend,
        stream: StreamId,
    ) -> SiteResult<()> {
        self.inner.note_replayed(states, gpu, stream)
    }
    fn rearm(&self, st: &mut S::State) {
        self.inner.rearm(st)
    }
    fn table_stats(&self) -> TableStats {
        self.inner.table_stats()
    }
}
