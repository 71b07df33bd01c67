//! The batched decode step: `prestage_batch` (the host half: plan, resolve
//! and stage every sequence's rows at fixed batch slots; `prestage_plan`
//! with a plan made ahead),
//! `forward_batch` (one projection, gate and `conv_batch` for the whole
//! batch, capturable when prestaged), `note_replayed` (bookkeeping after a
//! graph replay) and `free`.
//!
//! Invariants: batch slot `i` belongs to sequence `i` of the last
//! `prestage_batch`; a step over any other arrangement is refused before
//! anything is launched, and the slots' leases are released only with an
//! event recorded after the gather that read them.
//!
//! Row-cache capacity (docs/SPEC.md §9): a prestaged step pins all its rows
//! until its gather has run, so it holds at most what the table can pin at
//! once (`max_pinned()` distinct ids, in parts of `max_resolve()`) and a
//! larger one is refused at once; the eager step gathers its rows in parts
//! of `max_resolve()`, releasing each part before resolving the next, so it
//! runs a batch of any size on a cache of any size.

use metrale_gpu_runtime::gpu::{DevicePtr, GpuBackend, StreamId};
use metrale_storage::table::RowRef;

use super::error::{DeviceContext, LayerError, layer_bail, layer_ensure, table_err};
use super::plan::StepPlan;
use super::{ConvTarget, DeviceBufs, ForwardContext, PleLayer, PleSeqState, Result};
use crate::layers::ple::staging::{self, StagedAt, Staging};

/// What [`PleLayer::stage_batch`] does with the rows it resolves.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Stage {
    /// Keep them pinned at the batch slots for a later (possibly captured)
    /// gather: `prestage_batch`.
    Hold,
    /// Gather them now, part by part: the eager `forward_batch`.
    Gather,
}

impl PleLayer {
    /// The most sequences one [`Self::prestage_batch`] always accepts: a
    /// prestaged step keeps every row it staged pinned until its gather has
    /// run (possibly in a graph replay), so all of them must fit what the
    /// table can pin at once (`max_pinned()`), and a sequence's token may
    /// need `ngram_heads` distinct rows. 0 when the table cannot pin one
    /// sequence's rows at once; then only the eager [`Self::forward_batch`]
    /// (which gathers in parts) can run a batch. Larger batches fit when
    /// their ids repeat.
    pub fn max_prestage_batch(&self) -> usize {
        (self.table.max_pinned() / self.dims.ngram_heads().max(1)).min(self.max_batch())
    }

    /// The host half of one batched decode step: for sequence `i` (one new
    /// token `tokens[i]` each), plan, resolve and stage its rows at fixed
    /// batch slot `i` (see [`Self::prestage_plan`] for a plan made ahead), put its conv-state address in slot `i` of the conv table, and
    /// advance its history. Slots `B..rows` are padding (a zero row and a
    /// layer-owned dummy conv state), so a graph captured for `rows` rows can
    /// be replayed for any smaller batch. The previous batch's leases are
    /// released once everything queued so far has run.
    ///
    /// Every staged row stays pinned until the step's gather has run, so the
    /// batch's distinct row ids must fit what the table can pin at once
    /// (`max_pinned()`; [`Self::max_prestage_batch`] sequences always do).
    /// A larger batch is refused at once with
    /// [`LayerError::PrestageTooLarge`], before anything changes: split it
    /// into several steps, as the engine does, or run it eagerly.
    ///
    /// On error nothing is staged and no history advances (a sequence whose
    /// history had the wrong length may have been reset, as any forward would).
    pub fn prestage_batch(
        &self,
        states: &mut [&mut PleSeqState],
        tokens: &[u32],
        rows: usize,
        gpu: &dyn GpuBackend,
        stream: StreamId,
    ) -> Result<()> {
        self.check_tokens_per_state(states.len(), tokens.len(), "prestage_batch")?;
        let plan = self.plan_states(states, tokens, None)?;
        let seqs: Vec<usize> = (0..states.len()).collect();
        self.prestage_plan(&plan, &seqs, states, rows, gpu, stream)
    }

    /// Refuse a batch call with other than one token per sequence.
    fn check_tokens_per_state(&self, states: usize, tokens: usize, call: &str) -> Result<()> {
        layer_ensure!(states > 0, Usage, "PLE {call} with no sequences");
        layer_ensure!(
            tokens == states,
            Usage,
            "PLE {call}: {tokens} tokens for {states} sequences"
        );
        Ok(())
    }

    /// Resolve and stage one token per sequence, sequence `seqs[i]` of
    /// `plan` for `states[i]`, at the batch slots (see
    /// [`Self::prestage_batch`]). With [`Stage::Hold`] the rows stay
    /// pinned for a later gather; with [`Stage::Gather`] they are gathered
    /// into `emb` part by part, each part's lease released with an event
    /// recorded right after its gather, so a batch may need more rows than
    /// the table can pin at once; where resolving them would wait for
    /// reads, the parts are head groups and each group's projection is queued with it
    /// (`layer/pipeline.rs`). Returns whether the projection was queued.
    /// A plan made for other histories is refused before anything changes.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn stage_batch(
        &self,
        states: &mut [&mut PleSeqState],
        plan: &StepPlan,
        seqs: &[usize],
        rows: usize,
        gpu: &dyn GpuBackend,
        stream: StreamId,
        stage: Stage,
    ) -> Result<bool> {
        self.check_live()?;
        let b = states.len();
        self.check_tokens_per_state(b, seqs.len(), "prestage_batch")?;
        layer_ensure!(
            rows >= b && rows <= self.max_batch(),
            Usage,
            "PLE prestage_batch: {rows} rows for {b} sequences (at most {} rows)",
            self.max_batch()
        );
        layer_ensure!(
            !gpu.stream_is_capturing(stream)?,
            Capture,
            "PLE prestage refused: stream {stream} is capturing (prestage before capture or replay)"
        );
        let mut seen = std::collections::HashSet::new();
        for (i, st) in states.iter().enumerate() {
            layer_ensure!(
                !st.conv.is_null(),
                Usage,
                "PLE prestage_batch: sequence {i} was released"
            );
            layer_ensure!(
                seen.insert(st.conv.addr()),
                Usage,
                "PLE prestage_batch: sequence {i} appears twice in the batch"
            );
        }
        let ctxl = self.dims.context_len();
        let heads = self.dims.ngram_heads();
        // Checked against the histories a reset would give, so a batch that
        // cannot be staged is refused before any carry is touched.
        let (ids, new_hist) = self.batch_ids(plan, seqs, states)?;
        let table = self.table.as_ref();
        if stage == Stage::Hold {
            let distinct = ids.iter().collect::<std::collections::HashSet<_>>().len();
            let limit = table.max_pinned();
            if distinct > limit {
                return Err(LayerError::PrestageTooLarge {
                    sequences: b,
                    rows: distinct,
                    limit,
                    fit: self.max_prestage_batch(),
                });
            }
        }
        for st in states.iter_mut() {
            if st.history.len() != ctxl {
                self.reset(st, gpu, stream).map_err(LayerError::Reset)?;
            }
        }
        let mut stg = self.staging.lock();
        stg.streams.insert(stream);
        let old = std::mem::take(&mut stg.batch);
        staging::release_at_tail(table, gpu, stream, old.leases)?;
        while stg.pad_states.len() < rows - b {
            let p = gpu.alloc(self.conv_state_bytes(), "ple.pad_conv_state")?;
            stg.pad_states.push(p);
            gpu.memset(p, 0, self.conv_state_bytes())?;
        }
        let pad_scale = match self.dtype_code {
            0 | 2 => 0,
            _ => self
                .bufs
                .pad_row
                .offset(self.table.info().row_bytes().div_ceil(4) * 4)
                .addr(),
        };
        let pad = RowRef {
            data: self.bufs.pad_row.addr(),
            scale: pad_scale,
        };
        let mut table_bytes = Vec::with_capacity(rows * 8);
        for st in states.iter() {
            table_bytes.extend_from_slice(&st.conv.addr().to_le_bytes());
        }
        for p in &stg.pad_states[..rows - b] {
            table_bytes.extend_from_slice(&p.addr().to_le_bytes());
        }
        let pads = vec![pad; (rows - b) * heads];
        let mut projected = false;
        let leases = match stage {
            Stage::Hold => {
                let mut refs = Vec::with_capacity(rows * heads);
                let leases = staging::resolve_all(table, &ids, &mut refs, gpu)?;
                refs.extend_from_slice(&pads);
                let up = gpu
                    .copy_h2d_async(&staging::refs_bytes(&refs), stg.batch_slot(0), stream)
                    .and_then(|()| gpu.copy_h2d_async(&table_bytes, stg.conv_table(), stream));
                if let Err(error) = up {
                    let _ = staging::release_at_tail(table, gpu, stream, leases);
                    return Err(LayerError::Device {
                        what: "uploading the PLE batch staging".into(),
                        error: Box::new(error),
                    });
                }
                leases
            }
            Stage::Gather => {
                gpu.copy_h2d_async(&table_bytes, stg.conv_table(), stream)
                    .device(|| "uploading the PLE batch conv-state table".into())?;
                if !pads.is_empty() {
                    let at = stg.batch_slot(b);
                    gpu.copy_h2d_async(&staging::refs_bytes(&pads), at, stream)
                        .device(|| "uploading the PLE batch padding refs".into())?;
                    self.launch_gather(gpu, at, pads.len(), self.emb_row(b * heads), stream)?;
                }
                match self.pipeline_groups(&ids) {
                    Some(groups) => {
                        let at = stg.batch_slot(0);
                        self.gather_project_in_groups(&groups, &ids, rows, at, gpu, stream)?;
                        projected = true;
                    }
                    None => self.gather_parts(&stg, &ids, gpu, stream)?,
                }
                Vec::new()
            }
        };
        let slot_use = match stage {
            Stage::Hold => staging::SlotUse::Pending,
            Stage::Gather => staging::SlotUse::Gathered,
        };
        stg.batch = staging::BatchArea {
            owners: states.iter().map(|s| s.conv.addr()).collect(),
            rows,
            slots: vec![slot_use; b],
            leases,
        };
        for (i, (st, h)) in states.iter_mut().zip(new_hist).enumerate() {
            let va = stg.batch_slot(i).addr();
            st.history = h;
            st.prestaged_va = (stage == Stage::Hold).then_some(va);
            st.last_staged_va = va;
        }
        Ok(projected)
    }

    /// Resolve `ids` (batch slot order) in parts of at most `max_resolve()`
    /// distinct ids, upload each part's refs to its batch slots and gather
    /// them into `emb`, releasing the part's lease with an event recorded
    /// right after its gather, before the next part is resolved: a later
    /// part may then take the slots of an earlier one once its gather has
    /// run, so no batch needs more slots than one part.
    fn gather_parts(
        &self,
        stg: &Staging,
        ids: &[u64],
        gpu: &dyn GpuBackend,
        stream: StreamId,
    ) -> Result<()> {
        let table = self.table.as_ref();
        let base = stg.batch_slot(0);
        let mut refs = vec![RowRef::default(); ids.len()];
        let mut start = 0;
        while start < ids.len() {
            let end = staging::part_end(ids, start, table.max_resolve());
            let lease = table
                .resolve(&ids[start..end], &mut refs[start..end])
                .map_err(|e| {
                    table_err(format!(
                        "resolving PLE batch row ids {start}..{end} of {} (first id {})",
                        ids.len(),
                        ids[start]
                    ))(e)
                })?;
            let at = base.offset(start * staging::REF_BYTES);
            let queued = gpu
                .copy_h2d_async(&staging::refs_bytes(&refs[start..end]), at, stream)
                .device(|| "uploading PLE batch row refs".into())
                .and_then(|()| {
                    self.launch_gather(gpu, at, end - start, self.emb_row(start), stream)
                });
            // Released even when queueing failed: the event is recorded after
            // whatever did get queued, so no pin outlives the work reading it.
            let released = staging::release_at_tail(table, gpu, stream, vec![lease]);
            queued?;
            released?;
            start = end;
        }
        Ok(())
    }

    /// One decode step for `B = states.len()` sequences, one token each, over
    /// the first `rows >= B` rows of `highway [rows, C]` (rows past `B` are
    /// padding prestaged by [`Self::prestage_batch`]): one gather, one
    /// projection, one gate and one `conv_batch`. Bit-identical to `B`
    /// single-token forwards.
    ///
    /// With every sequence prestaged by one `prestage_batch` (sequence `i` at
    /// slot `i`) and no override, the prestages are consumed; the step can
    /// then be captured. Otherwise (not capturing) the tokens come from the
    /// context, one per sequence, and the step stages and gathers them
    /// itself, in parts when the batch needs more rows than the table pins
    /// at once. The prestages are taken in every case.
    pub fn forward_batch(
        &self,
        states: &mut [&mut PleSeqState],
        highway: DevicePtr,
        rows: usize,
        ctx: &ForwardContext<'_>,
        stream: StreamId,
    ) -> Result<()> {
        self.check_live()?;
        let gpu = ctx.gpu;
        let b = states.len();
        layer_ensure!(b > 0, Usage, "PLE forward_batch with no sequences");
        layer_ensure!(
            rows >= b && rows <= self.max_batch(),
            Usage,
            "PLE forward_batch: {rows} rows for {b} sequences (at most {} rows)",
            self.max_batch()
        );
        layer_ensure!(
            !highway.is_null(),
            Usage,
            "PLE forward_batch with a null highway"
        );
        let capturing = self.check_capture(ctx, stream)?;
        let masked = self.check_mask(ctx.masked, b, capturing)?;
        let staged: Vec<Option<u64>> = states.iter_mut().map(|s| s.prestaged_va.take()).collect();
        if ctx.token_override.is_none() && staged.iter().any(Option::is_some) {
            self.run_batch_staged(
                gpu, states, &staged, highway, rows, capturing, masked, stream,
            )?;
            if let Some(m) = masked {
                self.fill_masked_histories(states, m);
            }
            return Ok(());
        }
        if capturing {
            Self::refuse_unstaged(ctx, stream)?;
        }
        let tokens = self.tokens_from(ctx, 0, b, capturing, stream)?;
        let plan = self.plan_states(states, &tokens, masked)?;
        let seqs: Vec<usize> = (0..b).collect();
        self.run_batch_eager(&plan, &seqs, states, highway, rows, masked, gpu, stream)
    }

    /// Each sequence's history has advanced by its token (at the prestage
    /// or in the step); a masked token now blocks the look-back of
    /// everything after it.
    pub(super) fn fill_masked_histories(&self, states: &mut [&mut PleSeqState], masked: &[bool]) {
        for (st, &flag) in states.iter_mut().zip(masked) {
            if flag {
                st.history.fill(self.dims.eos_token_id);
            }
        }
    }

    /// Check that `staged[i]` is batch slot `i` of the current batch prestage,
    /// for every sequence, and that the batch prestage has exactly these
    /// sequences and at least `rows` rows.
    fn check_batch_staged(
        &self,
        stg: &Staging,
        states: &[&mut PleSeqState],
        staged: &[Option<u64>],
        rows: usize,
    ) -> Result<()> {
        let heads = self.dims.ngram_heads();
        for (i, (st, va)) in states.iter().zip(staged).enumerate() {
            let want = stg.batch_slot(i).addr();
            layer_ensure!(
                *va == Some(want),
                Staging,
                "PLE batch step: sequence {i} is not prestaged at batch slot {i} ({}); prestage the \
                 whole batch with one prestage_batch",
                match va {
                    Some(v) => format!("its prestage is at {v:#x}"),
                    None => "it has no prestage".to_string(),
                }
            );
            match stg.lookup(want, heads, st.conv.addr(), &[])? {
                StagedAt::Batch(s) if s == i => {}
                other => layer_bail!(
                    Staging,
                    "PLE batch step: sequence {i} resolved to {other:?}"
                ),
            }
        }
        layer_ensure!(
            stg.batch.owners.len() == states.len(),
            Staging,
            "PLE batch step over {} sequences, but the batch prestage holds {}",
            states.len(),
            stg.batch.owners.len()
        );
        layer_ensure!(
            stg.batch.rows >= rows,
            Staging,
            "PLE batch step over {rows} rows, but only {} were prestaged",
            stg.batch.rows
        );
        Ok(())
    }

    #[allow(clippy::too_many_arguments)]
    fn run_batch_staged(
        &self,
        gpu: &dyn GpuBackend,
        states: &mut [&mut PleSeqState],
        staged: &[Option<u64>],
        highway: DevicePtr,
        rows: usize,
        capturing: bool,
        masked: Option<&[bool]>,
        stream: StreamId,
    ) -> Result<()> {
        let mut stg = self.staging.lock();
        stg.streams.insert(stream);
        self.check_batch_staged(&stg, states, staged, rows)?;
        let heads = self.dims.ngram_heads();
        self.launch_gather(
            gpu,
            stg.batch_slot(0),
            rows * heads,
            self.emb_row(0),
            stream,
        )?;
        for i in 0..states.len() {
            if capturing {
                stg.mark_captured(StagedAt::Batch(i));
            } else {
                stg.mark_gathered(StagedAt::Batch(i), self.table.as_ref(), gpu, stream)?;
            }
        }
        let table_ptr = stg.conv_table();
        drop(stg);
        self.launch_rest(
            gpu,
            highway,
            rows,
            ConvTarget::Table(table_ptr),
            masked,
            stream,
        )
    }

    /// Call right after each `launch_graph` of a captured decode step whose
    /// rows `prestage_batch` staged (the first replay after the capture
    /// included): takes the sequences' prestages (the replay consumed them
    /// but runs no host code, so none may be applied again to a later token)
    /// and releases the step's leases with an event recorded now on
    /// `stream`, i.e. after the replay's gather. Sequence `i` must hold batch
    /// slot `i`: still prestaged there, or taken by the capture itself.
    pub fn note_replayed(
        &self,
        states: &mut [&mut PleSeqState],
        gpu: &dyn GpuBackend,
        stream: StreamId,
    ) -> Result<()> {
        self.check_live()?;
        let mut stg = self.staging.lock();
        stg.streams.insert(stream);
        layer_ensure!(
            stg.batch.owners.len() == states.len(),
            Staging,
            "PLE note_replayed over {} sequences, but the batch prestage holds {}",
            states.len(),
            stg.batch.owners.len()
        );
        for (i, st) in states.iter().enumerate() {
            let slot = stg.batch_slot(i).addr();
            layer_ensure!(
                stg.batch.owners[i] == st.conv.addr(),
                Staging,
                "PLE note_replayed: batch slot {i} belongs to another sequence"
            );
            match st.prestaged_va {
                Some(va) => layer_ensure!(
                    va == slot,
                    Staging,
                    "PLE note_replayed: sequence {i} is prestaged at {va:#x}, not at batch slot {i}"
                ),
                None => layer_ensure!(
                    stg.batch.slots[i] == staging::SlotUse::Captured,
                    Staging,
                    "PLE note_replayed: sequence {i} has no prestage at batch slot {i} \
                     (already replayed, or gathered eagerly)"
                ),
            }
            layer_ensure!(
                stg.batch.slots[i] != staging::SlotUse::Gathered,
                Staging,
                "PLE note_replayed: batch slot {i} was already gathered"
            );
        }
        for st in states.iter_mut() {
            st.prestaged_va = None;
        }
        stg.batch
            .slots
            .iter_mut()
            .for_each(|u| *u = staging::SlotUse::Gathered);
        let leases = std::mem::take(&mut stg.batch.leases);
        drop(stg);
        staging::release_at_tail(self.table.as_ref(), gpu, stream, leases)
    }

    /// Free every device allocation of the layer, after synchronising the
    /// streams it was used on and releasing every lease still held.
    /// Idempotent; later calls on the layer fail. Sequence states are not
    /// freed (see [`Self::release_seq_state`]). Call it before destroying
    /// those streams: synchronising a destroyed stream is an error (the
    /// memory is freed all the same, and the first error returned).
    pub fn free(&mut self, gpu: &dyn GpuBackend) -> Result<()> {
        if self.freed {
            return Ok(());
        }
        self.freed = true;
        let mut first_err: Option<LayerError> = None;
        let stg = self.staging.get_mut();
        for s in std::mem::take(&mut stg.streams) {
            if let Err(error) = gpu.synchronize(s) {
                first_err.get_or_insert(LayerError::Device {
                    what: format!("synchronising stream {s} before freeing the PLE layer"),
                    error: Box::new(error),
                });
            }
        }
        let mut leases = std::mem::take(&mut stg.batch.leases);
        for r in stg.ring.drain(..) {
            leases.extend(r.leases);
        }
        for l in leases {
            if let Err(e) = self.table.release(l, gpu, None) {
                first_err.get_or_insert(table_err("releasing a PLE row lease")(e));
            }
        }
        let mut ptrs: Vec<DevicePtr> = std::mem::take(&mut stg.pad_states);
        ptrs.push(stg.base);
        stg.base = DevicePtr::NULL;
        ptrs.extend(self.bufs.all());
        self.bufs = DeviceBufs::default();
        for p in ptrs {
            if let Err(error) = gpu.dealloc(p) {
                first_err.get_or_insert(LayerError::Device {
                    what: format!("freeing PLE device memory at {p}"),
                    error: Box::new(error),
                });
            }
        }
        match first_err {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }
}
