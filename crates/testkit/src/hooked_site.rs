//! A site wrapper that shows each call to a test's hook, which may fail it
//! (as a flaky table read or a damaged blob would) or only note it, and
//! otherwise hands every call to the site it wraps unchanged.
//!
//! Invariant: every `Site` method reaches the inner site exactly as it came
//! unless the hook fails it, so a run whose hook fails nothing is the inner
//! site's run, prefetches, graphs and counters included.

use metrale_engine::{Site, SiteResult};
use metrale_gpu_runtime::gpu::{DevicePtr, GpuBackend, StreamId};
use metrale_model_layers::layers::ple::SiteSpec;
use metrale_storage::table::TableStats;

/// The calls a [`HookedSite`] shows its hook, with what the hook may want
/// to note of them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SiteCall<'a> {
    /// [`Site::forward`] of these tokens.
    Forward {
        /// The tokens of the forward.
        tokens: &'a [u32],
    },
    /// [`Site::forward_batch`]: one token for each sequence.
    ForwardBatch {
        /// Each sequence's token.
        tokens: &'a [u32],
    },
    /// [`Site::snapshot`].
    Snapshot,
    /// [`Site::restore`].
    Restore,
    /// [`Site::prefetch_step`]: each entry's history and next tokens.
    PrefetchStep {
        /// The step's entries.
        work: &'a [(&'a [u32], &'a [u32])],
    },
    /// [`Site::prefetch_ahead`], entries as in [`SiteCall::PrefetchStep`].
    PrefetchAhead {
        /// The later step's entries.
        work: &'a [(&'a [u32], &'a [u32])],
    },
}

/// The hook: the error message of a call to fail, `None` to let it run.
pub type SiteHook = Box<dyn Fn(SiteCall<'_>) -> Option<String> + Send + Sync>;

/// `inner`, with every call shown to `hook` first, and failed if it says so.
pub struct HookedSite<S> {
    /// The site every call that is not failed goes to.
    pub inner: S,
    hook: SiteHook,
}

impl<S: Site> HookedSite<S> {
    /// Wrap `inner`; `hook` sees each call and decides which ones fail.
    pub fn new(
        inner: S,
        hook: impl Fn(SiteCall<'_>) -> Option<String> + Send + Sync + 'static,
    ) -> Self {
        Self {
            inner,
            hook: Box::new(hook),
        }
    }

    fn check(&self, call: SiteCall<'_>) -> SiteResult<()> {
        match (self.hook)(call) {
            Some(msg) => Err(msg.into()),
            None => Ok(()),
        }
    }
}

impl<S: Site> Site for HookedSite<S> {
    type State = S::State;

    fn geometry(&self) -> SiteSpec {
        self.inner.geometry()
    }
    fn max_tokens(&self) -> usize {
        self.inner.max_tokens()
    }
    fn carry_bytes(&self) -> usize {
        self.inner.carry_bytes()
    }
    fn new_state(&self, gpu: &dyn GpuBackend) -> SiteResult<S::State> {
        self.inner.new_state(gpu)
    }
    fn forward(
        &self,
        st: &mut S::State,
        tokens: &[u32],
        highway: DevicePtr,
        fresh: bool,
        gpu: &dyn GpuBackend,
        stream: StreamId,
    ) -> SiteResult<()> {
        self.check(SiteCall::Forward { tokens })?;
        self.inner.forward(st, tokens, highway, fresh, gpu, stream)
    }
    fn forward_batch(
        &self,
        states: &mut [&mut S::State],
        tokens: &[u32],
        highway: DevicePtr,
        gpu: &dyn GpuBackend,
        stream: StreamId,
    ) -> SiteResult<()> {
        self.check(SiteCall::ForwardBatch { tokens })?;
        self.inner
            .forward_batch(states, tokens, highway, gpu, stream)
    }
    fn snapshot(
        &self,
        st: &S::State,
        gpu: &dyn GpuBackend,
        stream: StreamId,
    ) -> SiteResult<Vec<u8>> {
        self.check(SiteCall::Snapshot)?;
        self.inner.snapshot(st, gpu, stream)
    }
    fn restore(
        &self,
        st: &mut S::State,
        blob: &[u8],
        gpu: &dyn GpuBackend,
        stream: StreamId,
    ) -> SiteResult<()> {
        self.check(SiteCall::Restore)?;
        self.inner.restore(st, blob, gpu, stream)
    }
    fn release(&self, st: &mut S::State, gpu: &dyn GpuBackend) -> SiteResult<()> {
        self.inner.release(st, gpu)
    }
    fn free(&mut self, gpu: &dyn GpuBackend) -> SiteResult<()> {
        self.inner.free(gpu)
    }
    fn supports_graphs(&self) -> bool {
        self.inner.supports_graphs()
    }
    fn max_prestage_batch(&self) -> Option<usize> {
        self.inner.max_prestage_batch()
    }
    fn prestage_batch(
        &self,
        states: &mut [&mut S::State],
        tokens: &[u32],
        rows: usize,
        gpu: &dyn GpuBackend,
        stream: StreamId,
    ) -> SiteResult<()> {
        self.inner.prestage_batch(states, tokens, rows, gpu, stream)
    }
    fn forward_prestaged(
        &self,
        states: &mut [&mut S::State],
        highway: DevicePtr,
        rows: usize,
        gpu: &dyn GpuBackend,
        stream: StreamId,
    ) -> SiteResult<()> {
        self.inner
            .forward_prestaged(states, highway, rows, gpu, stream)
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
        self.inner.rearm(st);
    }
    fn prefetch(&self, history: &[u32], tokens: &[u32]) -> SiteResult<()> {
        self.inner.prefetch(history, tokens)
    }
    fn prefetch_step(&self, work: &[(&[u32], &[u32])]) -> SiteResult<()> {
        self.check(SiteCall::PrefetchStep { work })?;
        self.inner.prefetch_step(work)
    }
    fn prefetch_ahead(&self, work: &[(&[u32], &[u32])]) -> SiteResult<()> {
        self.check(SiteCall::PrefetchAhead { work })?;
        self.inner.prefetch_ahead(work)
    }
    fn table_stats(&self) -> TableStats {
        self.inner.table_stats()
    }
}
