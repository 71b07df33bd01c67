//! A site wrapper that fails the calls a test's hook names, as a flaky
//! table read or a damaged blob would, and otherwise hands every call to
//! the site it wraps unchanged.
//!
//! Invariant: a call the hook lets through reaches the inner site exactly
//! as it came, so a run without injected faults is the inner site's run.

use metrale_engine::{Site, SiteResult};
use metrale_gpu_runtime::gpu::{DevicePtr, GpuBackend, StreamId};
use metrale_model_layers::layers::ple::SiteSpec;

/// The calls a [`FaultySite`] asks its hook about.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FaultyCall {
    /// [`Site::forward`].
    Forward,
    /// [`Site::forward_batch`].
    ForwardBatch,
    /// [`Site::restore`].
    Restore,
}

/// The hook: the error message of a call to fail, `None` to let it run.
pub type FaultHook = Box<dyn Fn(FaultyCall) -> Option<String> + Send + Sync>;

/// `inner` with the calls `hook` names failed before they run.
pub struct FaultySite<S> {
    /// The site every call that is not failed goes to.
    pub inner: S,
    hook: FaultHook,
}

impl<S: Site> FaultySite<S> {
    /// Wrap `inner`; `hook` decides, call by call, which ones fail.
    pub fn new(
        inner: S,
        hook: impl Fn(FaultyCall) -> Option<String> + Send + Sync + 'static,
    ) -> Self {
        Self {
            inner,
            hook: Box::new(hook),
        }
    }

    fn check(&self, call: FaultyCall) -> SiteResult<()> {
        match (self.hook)(call) {
            Some(msg) => Err(msg.into()),
            None => Ok(()),
        }
    }
}

impl<S: Site> Site for FaultySite<S> {
    type State = S::State;

    fn geometry(&self) -> SiteSpec {
        self.inner.geometry()
    }
    fn max_tokens(&self) -> usize {
        self.inner.max_tokens()
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
        self.check(FaultyCall::Forward)?;
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
        self.check(FaultyCall::ForwardBatch)?;
        self.inner
            .forward_batch(states, tokens, highway, gpu, stream)
    }
    fn snapshot(
        &self,
        st: &S::State,
        gpu: &dyn GpuBackend,
        stream: StreamId,
    ) -> SiteResult<Vec<u8>> {
        self.inner.snapshot(st, gpu, stream)
    }
    fn restore(
        &self,
        st: &mut S::State,
        blob: &[u8],
        gpu: &dyn GpuBackend,
        stream: StreamId,
    ) -> SiteResult<()> {
        self.check(FaultyCall::Restore)?;
        self.inner.restore(st, blob, gpu, stream)
    }
    fn release(&self, st: &mut S::State, gpu: &dyn GpuBackend) -> SiteResult<()> {
        self.inner.release(st, gpu)
    }
    fn free(&mut self, gpu: &dyn GpuBackend) -> SiteResult<()> {
        self.inner.free(gpu)
    }
}
