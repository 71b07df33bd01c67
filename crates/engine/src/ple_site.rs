//! The PLE layer as an engine [`Site`].
//!
//! [`PleSite`] wraps a [`PleLayer`]; the site's geometry is the layer's
//! [`SiteSpec`]. Every call maps
//! onto the layer's own API: `forward` with host token ids, `forward_batch`
//! (one gather, one projection, one gate, one batched conv for the whole
//! batch), and the seed's `snapshot_aux` / `restore_aux` /
//! `release_seq_state`.
//!
//! Invariant: the wrapper adds no state of its own, so a carry's meaning is
//! exactly the layer's.

use metrale_gpu_runtime::gpu::{DevicePtr, GpuBackend, StreamId};
use metrale_model_layers::layers::ple::ids::PleIdHasher;
use metrale_model_layers::layers::ple::{ForwardContext, PleLayer, PleSeqState, SiteSpec};
use metrale_storage::table::TableStats;

use crate::engine::{Site, SiteResult};

/// A PLE layer driven by the engine.
pub struct PleSite {
    layer: PleLayer,
}

impl PleSite {
    /// Wrap `layer`; the site's conv kernel size, dilation and every other
    /// dimension are those of the layer's spec.
    pub fn new(layer: PleLayer) -> Self {
        PleSite { layer }
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
        // One batch of ids for the whole step, so the table reads them together.
        let spec = self.layer.spec();
        let heads = spec.dims.ngram_heads();
        let hasher = PleIdHasher::with_family(&spec.family, &spec.dims)?;
        let mut ids = vec![0u64; work.iter().map(|(_, t)| t.len()).sum::<usize>() * heads];
        let mut at = 0;
        for (history, tokens) in work {
            let n = tokens.len() * heads;
            hasher.ids_with_history_into(history, tokens, &mut ids[at..at + n])?;
            at += n;
        }
        if ids.is_empty() {
            return Ok(());
        }
        Ok(self.layer.table().prefetch(&ids)?)
    }

    fn table_stats(&self) -> TableStats {
        self.layer.table().stats()
    }

    fn supports_graphs(&self) -> bool {
        true
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
        Ok(self
            .layer
            .prestage_batch(states, tokens, rows, gpu, stream)?)
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
        Ok(self
            .layer
            .forward(st, highway, tokens.len(), fresh, &ctx, stream)?)
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
        Ok(self
            .layer
            .forward_batch(states, highway, states.len(), &ctx, stream)?)
    }

    fn snapshot(
        &self,
        st: &PleSeqState,
        gpu: &dyn GpuBackend,
        stream: StreamId,
    ) -> SiteResult<Vec<u8>> {
        Ok(self.layer.snapshot_aux(st, gpu, stream)?)
    }

    fn restore(
        &self,
        st: &mut PleSeqState,
        blob: &[u8],
        gpu: &dyn GpuBackend,
        stream: StreamId,
    ) -> SiteResult<()> {
        Ok(self.layer.restore_aux(st, blob, gpu, stream)?)
    }

    fn release(&self, st: &mut PleSeqState, gpu: &dyn GpuBackend) -> SiteResult<()> {
        Ok(self.layer.release_seq_state(st, gpu)?)
    }

    fn free(&mut self, gpu: &dyn GpuBackend) -> SiteResult<()> {
        Ok(self.layer.free(gpu)?)
    }
}
