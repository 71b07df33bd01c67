//! The PLE layer as an engine [`Site`].
//!
//! [`PleSite`] wraps a [`PleLayer`]; the site's geometry is the layer's
//! [`SiteSpec`]. Every call maps
//! onto the layer's own API: `forward` with host token ids, `forward_batch`
//! (one gather, one projection, one gate, one batched conv for the whole
//! batch), `snapshot` / `restore` (the aux blob codec of
//! `carry_blob`) and the seed's `release_seq_state`.
//!
//! A step's prefetch ([`Site::prefetch_step`]) hashes the step's tokens
//! once ([`PleLayer::hash_ahead`]) and keeps the ids, and the step's
//! forwards (eager batched, prestaged for a graph, or one sequence's
//! chunk) take them from there instead of hashing again.
//!
//! Invariant: the wrapper adds no state of a carry's, so a carry's meaning
//! is exactly the layer's; the ids it keeps are a pure function of a
//! carried history and tokens, which the layer matches before using them,
//! so they never change an output.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use metrale_gpu_runtime::gpu::{DevicePtr, GpuBackend, StreamId};
use metrale_model_layers::layers::ple::{
    ForwardContext, HashedIds, PleLayer, PleSeqState, SiteSpec,
};
use metrale_storage::table::TableStats;

use crate::engine::{Site, SiteResult};

/// A PLE layer driven by the engine.
pub struct PleSite {
    layer: PleLayer,
    /// The ids of the last step prefetch, for that step's forwards.
    hashed: Mutex<Option<Arc<HashedIds>>>,
    /// Host time of step prefetches: hashing, then queueing the reads.
    hash_ns: AtomicU64,
    prefetch_ns: AtomicU64,
}

/// Host time a site spent starting its step prefetches.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PrefetchTime {
    /// Hashing the step's ids.
    pub hash: Duration,
    /// Handing them to the table (claiming slots, queueing the reads).
    pub queue: Duration,
}

impl PleSite {
    /// Wrap `layer`; the site's conv kernel size, dilation and every other
    /// dimension are those of the layer's spec.
    pub fn new(layer: PleLayer) -> Self {
        PleSite {
            layer,
            hashed: Mutex::new(None),
            hash_ns: AtomicU64::new(0),
            prefetch_ns: AtomicU64::new(0),
        }
    }

    /// Host time of the step prefetches so far.
    pub fn prefetch_time(&self) -> PrefetchTime {
        PrefetchTime {
            hash: Duration::from_nanos(self.hash_ns.load(Ordering::Relaxed)),
            queue: Duration::from_nanos(self.prefetch_ns.load(Ordering::Relaxed)),
        }
    }

    /// Hash `work` into one batch of ids and start their reads, timing
    /// both; with `keep`, the ids become the ones the next forwards take
    /// (kept even when starting the reads failed: hashing did not).
    fn hash_and_read(&self, work: &[(&[u32], &[u32])], keep: bool) -> SiteResult<()> {
        let t0 = Instant::now();
        let hashed = self.layer.hash_ahead(work)?;
        let t1 = Instant::now();
        self.hash_ns
            .fetch_add((t1 - t0).as_nanos() as u64, Ordering::Relaxed);
        if hashed.is_empty() {
            return Ok(());
        }
        let r = self.layer.prefetch_hashed(&hashed);
        if keep {
            *self.hashed.lock().unwrap_or_else(PoisonError::into_inner) = Some(Arc::new(hashed));
        }
        self.prefetch_ns
            .fetch_add(t1.elapsed().as_nanos() as u64, Ordering::Relaxed);
        Ok(r?)
    }

    /// The ids the last step prefetch hashed, if any.
    fn hashed(&self) -> Option<Arc<HashedIds>> {
        self.hashed
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    /// The wrapped layer.
    pub fn layer(&self) -> &PleLayer {
        &self.layer
    }
}

impl Site for PleSite {
    type State = PleSeqState;

    fn prefetch(&self, history: &[u32], tokens: &[u32]) -> SiteResult<()> {
        Ok(self.layer.prefetch(history, tokens)?)
    }

    fn prefetch_step(&self, work: &[(&[u32], &[u32])]) -> SiteResult<()> {
        // One batch of ids for the whole step, so the table reads them
        // together, kept for the step's forwards.
        self.hash_and_read(work, true)
    }

    fn prefetch_ahead(&self, work: &[(&[u32], &[u32])]) -> SiteResult<()> {
        // One batch for the later step, its ids not kept: the step under
        // way keeps finding its own.
        self.hash_and_read(work, false)
    }

    fn table_stats(&self) -> TableStats {
        self.layer.table().stats()
    }

    fn supports_graphs(&self) -> bool {
        // A tensor-parallel rank whose collective cannot be captured runs
        // its decode eagerly.
        self.layer.supports_capture()
    }

    fn max_prestage_batch(&self) -> Option<usize> {
        Some(self.layer.max_prestage_batch())
    }

    fn prestage_batch(
        &self,
        states: &mut [&mut PleSeqState],
        tokens: &[u32],
        rows: usize,
        gpu: &dyn GpuBackend,
        stream: StreamId,
    ) -> SiteResult<()> {
        let hashed = self.hashed();
        Ok(self.layer.prestage_batch_hashed(
            states,
            tokens,
            rows,
            hashed.as_deref(),
            gpu,
            stream,
        )?)
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

    fn geometry(&self) -> SiteSpec {
        self.layer.spec().clone()
    }

    fn max_tokens(&self) -> usize {
        self.layer.max_tokens().min(self.layer.max_batch())
    }

    fn carry_bytes(&self) -> usize {
        self.layer.conv_state_bytes()
    }

    fn new_state(&self, gpu: &dyn GpuBackend) -> SiteResult<PleSeqState> {
        Ok(self.layer.new_seq_state(gpu)?)
    }

    fn forward(
        &self,
        st: &mut PleSeqState,
        tokens: &[u32],
        highway: DevicePtr,
        fresh: bool,
        gpu: &dyn GpuBackend,
        stream: StreamId,
    ) -> SiteResult<()> {
        let ctx = ForwardContext::new(gpu).with_host_ids(tokens);
        let hashed = self.hashed();
        Ok(self.layer.forward_hashed(
            st,
            highway,
            tokens.len(),
            fresh,
            &ctx,
            hashed.as_deref(),
            stream,
        )?)
    }

    fn forward_masked(
        &self,
        st: &mut PleSeqState,
        tokens: &[u32],
        masked: &[bool],
        highway: DevicePtr,
        fresh: bool,
        gpu: &dyn GpuBackend,
        stream: StreamId,
    ) -> SiteResult<()> {
        // The layer checks the mask (its length, and that the site takes
        // one) and refuses with `LayerError::TokenMask`.
        let ctx = ForwardContext::new(gpu)
            .with_host_ids(tokens)
            .with_masked(masked);
        let hashed = self.hashed();
        Ok(self.layer.forward_hashed(
            st,
            highway,
            tokens.len(),
            fresh,
            &ctx,
            hashed.as_deref(),
            stream,
        )?)
    }

    fn forward_batch_masked(
        &self,
        states: &mut [&mut PleSeqState],
        tokens: &[u32],
        masked: &[bool],
        highway: DevicePtr,
        gpu: &dyn GpuBackend,
        stream: StreamId,
    ) -> SiteResult<()> {
        if tokens.len() != states.len() {
            return Err(format!(
                "PLE site: {} tokens for a batch of {} sequences",
                tokens.len(),
                states.len()
            )
            .into());
        }
        let ctx = ForwardContext::new(gpu)
            .with_host_ids(tokens)
            .with_masked(masked);
        let hashed = self.hashed();
        Ok(self.layer.forward_batch_hashed(
            states,
            highway,
            states.len(),
            &ctx,
            hashed.as_deref(),
            stream,
        )?)
    }

    fn forward_batch(
        &self,
        states: &mut [&mut PleSeqState],
        tokens: &[u32],
        highway: DevicePtr,
        gpu: &dyn GpuBackend,
        stream: StreamId,
    ) -> SiteResult<()> {
        if tokens.len() != states.len() {
            return Err(format!(
                "PLE site: {} tokens for a batch of {} sequences",
                tokens.len(),
                states.len()
            )
            .into());
        }
        let ctx = ForwardContext::new(gpu).with_host_ids(tokens);
        let hashed = self.hashed();
        Ok(self.layer.forward_batch_hashed(
            states,
            highway,
            states.len(),
            &ctx,
            hashed.as_deref(),
            stream,
        )?)
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
        *self
            .hashed
            .get_mut()
            .unwrap_or_else(PoisonError::into_inner) = None;
        Ok(self.layer.free(gpu)?)
    }
}
