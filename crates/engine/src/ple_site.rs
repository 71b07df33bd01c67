//! The PLE layer as an engine [`Site`].
//!
//! [`PleSite`] wraps a [`PleLayer`]; the site's geometry is the layer's
//! [`SiteSpec`]. Every call maps onto the layer's own API: the carry half
//! ([`CarrySite`]) onto `new_seq_state`, `snapshot` / `restore` (the aux
//! blob codec of `carry_blob`) and the seed's `release_seq_state`; the
//! step half onto `plan`, `prefetch`, `run`, `run_batch` and, for a
//! captured decode step, `prestage_plan` and the prestaged
//! `forward_batch`. A step's plan is a value the engine hands from the
//! prefetch to the forwards: the site keeps none.
//!
//! Invariant: the wrapper adds no state of a carry's, so a carry's meaning
//! is exactly the layer's.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use metrale_gpu_runtime::gpu::{DevicePtr, GpuBackend, StreamId};
use metrale_model_layers::layers::ple::{
    ForwardContext, PlanPart, PleLayer, PleSeqState, SeqWork, SiteSpec, StepPlan,
};
use metrale_storage::table::TableStats;

use crate::engine::{CarrySite, Site, SiteResult};

/// A PLE layer driven by the engine.
pub struct PleSite {
    layer: PleLayer,
    /// Host time of the plans whose reads were started, and of starting
    /// them.
    hash_ns: AtomicU64,
    prefetch_ns: AtomicU64,
}

/// Host time a site spent on the steps whose reads were started ahead.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PrefetchTime {
    /// Hashing those steps into plans (a forward that plans for itself
    /// hashes in its own host time instead).
    pub hash: Duration,
    /// Handing plans to the table (claiming slots, queueing the reads).
    pub queue: Duration,
}

impl PleSite {
    /// Wrap `layer`; the site's conv kernel size, dilation and every other
    /// dimension are those of the layer's spec.
    pub fn new(layer: PleLayer) -> Self {
        PleSite {
            layer,
            hash_ns: AtomicU64::new(0),
            prefetch_ns: AtomicU64::new(0),
        }
    }

    /// Host time of the plans prefetched so far, and of their prefetches.
    pub fn prefetch_time(&self) -> PrefetchTime {
        PrefetchTime {
            hash: Duration::from_nanos(self.hash_ns.load(Ordering::Relaxed)),
            queue: Duration::from_nanos(self.prefetch_ns.load(Ordering::Relaxed)),
        }
    }

    /// The wrapped layer.
    pub fn layer(&self) -> &PleLayer {
        &self.layer
    }
}

impl CarrySite for PleSite {
    type State = PleSeqState;

    fn geometry(&self) -> SiteSpec {
        self.layer.spec().clone()
    }

    fn carry_bytes(&self) -> usize {
        self.layer.conv_state_bytes()
    }

    fn new_state(&self, gpu: &dyn GpuBackend) -> SiteResult<PleSeqState> {
        Ok(self.layer.new_seq_state(gpu)?)
    }

    fn history<'s>(&self, st: &'s PleSeqState) -> &'s [u32] {
        // A history of another length is reset by the next forward.
        match st.history().len() == self.layer.dims().context_len() {
            true => st.history(),
            false => &[],
        }
    }

    fn snapshot(
        &self,
        st: &PleSeqState,
        gpu: &dyn GpuBackend,
        stream: StreamId,
    ) -> SiteResult<Vec<u8>> {
        Ok(self.layer.snapshot(st, gpu, stream)?)
    }

    fn restore(
        &self,
        st: &mut PleSeqState,
        blob: &[u8],
        gpu: &dyn GpuBackend,
        stream: StreamId,
    ) -> SiteResult<()> {
        Ok(self.layer.restore(st, blob, gpu, stream)?)
    }

    fn release(&self, st: &mut PleSeqState, gpu: &dyn GpuBackend) -> SiteResult<()> {
        Ok(self.layer.release_seq_state(st, gpu)?)
    }

    fn free(&mut self, gpu: &dyn GpuBackend) -> SiteResult<()> {
        Ok(self.layer.free(gpu)?)
    }
}

impl Site for PleSite {
    type Plan = StepPlan;

    fn max_tokens(&self) -> usize {
        self.layer.max_tokens().min(self.layer.max_batch())
    }

    fn plan(&self, work: &[SeqWork<'_>]) -> SiteResult<StepPlan> {
        Ok(self.layer.plan(work)?)
    }

    fn prefetch(&self, plan: &StepPlan) -> SiteResult<()> {
        self.hash_ns
            .fetch_add(plan.hash_time().as_nanos() as u64, Ordering::Relaxed);
        let t0 = Instant::now();
        let r = self.layer.prefetch(plan);
        self.prefetch_ns
            .fetch_add(t0.elapsed().as_nanos() as u64, Ordering::Relaxed);
        Ok(r?)
    }

    fn run(
        &self,
        plan: &StepPlan,
        part: PlanPart,
        st: &mut PleSeqState,
        highway: DevicePtr,
        fresh: bool,
        gpu: &dyn GpuBackend,
        stream: StreamId,
    ) -> SiteResult<()> {
        Ok(self
            .layer
            .run(plan, part, st, highway, fresh, gpu, stream)?)
    }

    fn run_batch(
        &self,
        plan: &StepPlan,
        seqs: &[usize],
        states: &mut [&mut PleSeqState],
        highway: DevicePtr,
        gpu: &dyn GpuBackend,
        stream: StreamId,
    ) -> SiteResult<()> {
        let rows = states.len();
        Ok(self
            .layer
            .run_batch(plan, seqs, states, highway, rows, gpu, stream)?)
    }

    fn supports_graphs(&self) -> bool {
        // A tensor-parallel rank whose collective cannot be captured runs
        // its decode eagerly.
        self.layer.supports_capture()
    }

    fn max_prestage_batch(&self) -> Option<usize> {
        Some(self.layer.max_prestage_batch())
    }

    fn prestage(
        &self,
        plan: &StepPlan,
        seqs: &[usize],
        states: &mut [&mut PleSeqState],
        rows: usize,
        gpu: &dyn GpuBackend,
        stream: StreamId,
    ) -> SiteResult<()> {
        Ok(self
            .layer
            .prestage_plan(plan, seqs, states, rows, gpu, stream)?)
    }

    fn forward_prestaged(
        &self,
        states: &mut [&mut PleSeqState],
        highway: DevicePtr,
        rows: usize,
        gpu: &dyn GpuBackend,
        stream: StreamId,
    ) -> SiteResult<()> {
        let capturing = gpu.stream_is_capturing(stream)?;
        let ctx = ForwardContext::new(gpu).capturing(capturing);
        Ok(self
            .layer
            .forward_batch(states, highway, rows, &ctx, stream)?)
    }

    fn note_replayed(
        &self,
        states: &mut [&mut PleSeqState],
        gpu: &dyn GpuBackend,
        stream: StreamId,
    ) -> SiteResult<()> {
        Ok(self.layer.note_replayed(states, gpu, stream)?)
    }

    fn rearm(&self, st: &mut PleSeqState) {
        self.layer.rearm(st);
    }

    fn table_stats(&self) -> TableStats {
        self.layer.table().stats()
    }
}
