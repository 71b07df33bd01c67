//! A site wrapper that shows each call to a test's hook, which may fail it
//! (as a flaky table read or a damaged blob would) or only note it, and
//! otherwise hands every call to the site it wraps unchanged: the engine's
//! [`Wrapped`] site with a [`CallHook`] middleware.
//!
//! It wraps sites whose plan says which tokens it runs ([`PlanTokens`]:
//! the layer's [`StepPlan`], the toy site's plan), so the hook can be
//! shown them.
//!
//! Invariant: every `CarrySite` and `Site` method reaches the inner site
//! exactly as it came unless the hook fails it (the engine's [`Wrapped`]
//! forwards them), so a run whose hook fails nothing is the inner site's
//! run, plans, prefetches, graphs and counters included.

use metrale_engine::wrap::{SiteWrap, Wrapped, WrappedCall};
use metrale_engine::{Site, SiteResult};
use metrale_model_layers::layers::ple::{SeqWork, StepPlan};

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
    /// [`metrale_engine::CarrySite::snapshot`].
    Snapshot,
    /// [`metrale_engine::CarrySite::restore`].
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

/// The middleware of a [`HookedSite`]: the hook every checked call is
/// shown. Made from the hook's closure, so `HookedSite::new(inner, hook)`
/// takes the closure itself.
pub struct CallHook(SiteHook);

impl<F> From<F> for CallHook
where
    F: Fn(SiteCall<'_>) -> Option<String> + Send + Sync + 'static,
{
    fn from(hook: F) -> Self {
        CallHook(Box::new(hook))
    }
}

impl CallHook {
    fn show(&self, call: SiteCall<'_>) -> SiteResult<()> {
        match (self.0)(call) {
            Some(msg) => Err(msg.into()),
            None => Ok(()),
        }
    }
}

impl<S: Site> SiteWrap<S> for CallHook
where
    S::Plan: PlanTokens,
{
    fn check(&self, call: WrappedCall<'_, S::Plan>) -> SiteResult<()> {
        match call {
            WrappedCall::Plan { work } => self.show(SiteCall::Plan { work }),
            WrappedCall::Prefetch { plan } => {
                let tokens: Vec<&[u32]> =
                    (0..plan.sequences()).map(|i| plan.seq_tokens(i)).collect();
                self.show(SiteCall::Prefetch { tokens: &tokens })
            }
            WrappedCall::Run { plan, part } => {
                let tokens = &plan.seq_tokens(part.seq)[part.from..part.from + part.len];
                self.show(SiteCall::Run { tokens })
            }
            WrappedCall::RunBatch { plan, seqs } => {
                let tokens: Vec<u32> = seqs.iter().map(|&s| plan.seq_tokens(s)[0]).collect();
                self.show(SiteCall::RunBatch { tokens: &tokens })
            }
            WrappedCall::Snapshot => self.show(SiteCall::Snapshot),
            WrappedCall::Restore => self.show(SiteCall::Restore),
        }
    }
}

/// `inner`, with every call shown to its hook first, and failed if it says
/// so: `HookedSite::new(inner, hook)`, where `hook` sees each call and
/// decides which ones fail. A closure written in the call names its
/// argument's type (`|call: SiteCall<'_>|`); a hook returned by a function
/// as `impl Fn(SiteCall<'_>) -> Option<String>` needs nothing.
pub type HookedSite<S> = Wrapped<S, CallHook>;
