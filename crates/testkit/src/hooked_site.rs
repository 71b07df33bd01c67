//! A site wrapper that shows each call to a test's hook, which may fail it
//! (as a flaky table read or a damaged blob would) or only note it, and
//! otherwise hands every call to the site it wraps unchanged.
//!
//! It wraps sites whose plan says which tokens it runs ([`PlanTokens`]:
//! the layer's [`StepPlan`], the toy site's plan), so the hook can be
//! shown them.
//!
//! Invariant: every `CarrySite` and `Site` method reaches the inner site
//! exactly as it came unless the hook fails it, so a run whose hook fails
//! nothing is the inner site's run, plans, prefetches, graphs and counters
//! included.

use metrale_engine::{CarrySite, Site, SiteResult};
use metrale_gpu_runtime::gpu::{DevicePtr, GpuBackend, StreamId};
use metrale_model_layers::layers::ple::{PlanPart, SeqWork, StepPlan};

/// The calls a [`HookedSite`] shows its hook, with what the hook may want
/// to note of them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SiteCall<'a> {
    /// [`Site::run`] of these tokens of one sequence.
    Run {
        /// The tokens of the forward.
        tokens: &'a [u32],
    },
    /// [`Site::run_batch`]: one token for each sequence.
    RunBatch {
        /// Each sequence's token.
        tokens: &'a [u32],
    },
    /// [`CarrySite::snapshot`].
    Snapshot,
    /// [`CarrySite::restore`].
    Restore,
    /// [`Site::plan`]: each sequence's history and next tokens.
    Plan {
        /// The step's work.
        work: &'a [SeqWork<'a>],
    },
    /// [`Site::prefetch`] of a plan: the tokens of each of its sequences.
    Prefetch {
        /// Each planned sequence's tokens.
        tokens: &'a [&'a [u32]],
    },
}

/// What a hook is shown of a plan: the tokens of each of its sequences.
pub trait PlanTokens {
    /// Number of sequences.
    fn sequences(&self) -> usize;
    /// Sequence `seq`'s tokens.
    fn seq_tokens(&self, seq: usize) -> &[u32];
}

impl PlanTokens for StepPlan {
    fn sequences(&self) -> usize {
        self.len()
    }
    fn seq_tokens(&self, seq: usize) -> &[u32] {
        self.tokens(seq)
    }
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

impl<S: Site> CarrySite for HookedSite<S>
where
    S::Plan: PlanTokens,
{
    type State = S::State;

    metrale_engine::delegate_site!(inner:
        geometry, carry_bytes, new_state, history, release, free,
    );

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
}

impl<S: Site> Site for HookedSite<S>
where
    S::Plan: PlanTokens,
{
    type Plan = S::Plan;

    metrale_engine::delegate_site!(inner:
        max_tokens, supports_graphs, max_prestage_batch, prestage, forward_prestaged,
        note_replayed, rearm, table_stats,
    );

    fn plan(&self, work: &[SeqWork<'_>]) -> SiteResult<S::Plan> {
        self.check(SiteCall::Plan { work })?;
        self.inner.plan(work)
    }
    fn prefetch(&self, plan: &S::Plan) -> SiteResult<()> {
        let tokens: Vec<&[u32]> = (0..plan.sequences()).map(|i| plan.seq_tokens(i)).collect();
        self.check(SiteCall::Prefetch { tokens: &tokens })?;
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
        let tokens = &plan.seq_tokens(part.seq)[part.from..part.from + part.len];
        self.check(SiteCall::Run { tokens })?;
        self.inner.run(plan, part, st, highway, fresh, gpu, stream)
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
        let tokens: Vec<u32> = seqs.iter().map(|&s| plan.seq_tokens(s)[0]).collect();
        self.check(SiteCall::RunBatch { tokens: &tokens })?;
        self.inner
            .run_batch(plan, seqs, states, highway, gpu, stream)
    }
}
