//! A site wrapper that shows each call to a test's hook, which may fail it
//! (as a flaky table read or a damaged blob would) or only note it, and
//! otherwise hands every call to the site it wraps unchanged.
//!
//! Invariant: every `Site` method reaches the inner site exactly as it came
//! unless the hook fails it, so a run whose hook fails nothing is the inner
//! site's run, prefetches, graphs and counters included.

use metrale_engine::{Site, SiteResult};
use metrale_gpu_runtime::gpu::{DevicePtr, GpuBackend, StreamId};

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

    metrale_engine::delegate_site!(inner:
        geometry, max_tokens, carry_bytes, new_state, release, free,
        supports_graphs, max_prestage_batch, prestage_batch, forward_prestaged,
        note_replayed, rearm, prefetch, table_stats,
    );

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
    fn prefetch_step(&self, work: &[(&[u32], &[u32])]) -> SiteResult<()> {
        self.check(SiteCall::PrefetchStep { work })?;
        self.inner.prefetch_step(work)
    }
    fn prefetch_ahead(&self, work: &[(&[u32], &[u32])]) -> SiteResult<()> {
        self.check(SiteCall::PrefetchAhead { work })?;
        self.inner.prefetch_ahead(work)
    }
}
