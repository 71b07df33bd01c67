//! A step as a value: [`PleLayer::plan`] hashes the tokens of every
//! sequence of a step once into a [`StepPlan`]: the ids in step order
//! (sequence after sequence, token after token, `ngram_heads` a token),
//! the distinct ids in the order the step reads them, and for each id the
//! slot of its row among the distinct ones. Whatever needs a step's ids
//! takes the plan: the table's prefetch ([`PleLayer::prefetch`]), rows
//! staged into a buffer the caller owns ([`PleLayer::stage`], for an
//! engine that runs its own kernels), the eager forwards ([`PleLayer::run`],
//! [`PleLayer::run_batch`]) and the batch prestage a captured step replays
//! ([`PleLayer::prestage_plan`]).
//!
//! Invariants: an entry's ids are the hash of exactly its carried history
//! (the last `context_len` tokens, EOS-padded as a fresh carry's) and its
//! tokens (and mask); running part of a plan on a carry whose history is
//! not the one the plan implies at that position is refused with
//! [`LayerError::Plan`] before anything changes, so a plan never changes
//! an output bit. Nothing looks a plan up by key: the caller names the
//! entry ([`PlanPart`]) it runs.

use std::collections::HashMap;
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use metrale_gpu_runtime::gpu::{DevicePtr, GpuBackend, StreamId};
use metrale_storage::table::RowRef;

use super::error::{DeviceContext, LayerError, layer_ensure, table_err};
use super::{ConvTarget, PleLayer, PleSeqState, Result};
use crate::layers::ple::ids::Boundaries;
use crate::layers::ple::staging;

/// One sequence's part of a step: the tokens it ends with (only the last
/// `context_len` matter; a shorter history acts as if EOS-padded, as for a
/// fresh carry), the tokens its next forward runs and, for a site that
/// takes one, their mask (`true`: masked).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SeqWork<'a> {
    /// The tokens the sequence ends with.
    pub history: &'a [u32],
    /// The tokens the step runs.
    pub tokens: &'a [u32],
    /// One flag per token, `true` where masked (see
    /// [`super::ForwardContext::masked`]).
    pub masked: Option<&'a [bool]>,
}

impl<'a> SeqWork<'a> {
    /// `tokens` after `history`, unmasked.
    pub fn new(history: &'a [u32], tokens: &'a [u32]) -> Self {
        SeqWork {
            history,
            tokens,
            masked: None,
        }
    }
    /// With a token mask.
    pub fn with_masked(mut self, masked: &'a [bool]) -> Self {
        self.masked = Some(masked);
        self
    }
}

/// Where one sequence's part of a plan lives.
#[derive(Clone, Copy, Debug)]
struct Entry {
    /// Start of its carried history in `StepPlan::hist` (`context_len`
    /// tokens).
    hist: usize,
    /// Its first token in `StepPlan::tokens` (ids from `first *
    /// ngram_heads`).
    first: usize,
    /// Its number of tokens.
    len: usize,
}

/// Tokens `from..from + len` of sequence `seq` of a [`StepPlan`]: what one
/// call runs (a prefill chunk split further runs several parts of one
/// entry, in order).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PlanPart {
    /// The sequence's index in the plan (its place in the work it was
    /// made from).
    pub seq: usize,
    /// Tokens of the entry that run before this part.
    pub from: usize,
    /// Tokens the part runs.
    pub len: usize,
}

/// The ids of a step, hashed once. See the module docs.
#[derive(Clone, Debug, Default)]
pub struct StepPlan {
    ctxl: usize,
    heads: usize,
    entries: Vec<Entry>,
    hist: Vec<u32>,
    tokens: Vec<u32>,
    /// One flag per token; empty when no token is masked.
    masked: Vec<bool>,
    ids: Vec<u64>,
    /// Heads per read group where the layer pipelines a step whose reads
    /// wait (`layer/pipeline.rs`); `None`: one read of every id.
    group_heads: Option<usize>,
    /// The distinct ids and their read order, worked out on first use (a
    /// forward that only gathers never needs them).
    order: OnceLock<Order>,
    /// Host time [`PleLayer::plan`] spent hashing it.
    hash_time: Duration,
}

/// A plan's distinct ids in read order.
#[derive(Clone, Debug, Default)]
struct Order {
    /// The distinct ids, in read order.
    distinct: Vec<u64>,
    /// For each id of `ids`, its index in `distinct`.
    slots: Vec<u32>,
    /// End (in `distinct`) of each read request, in order.
    reads: Vec<usize>,
}

impl StepPlan {
    /// Number of sequences (entries of the work it was made from).
    pub fn len(&self) -> usize {
        self.entries.len()
    }
    /// Whether it holds no sequence.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }
    /// Row ids per token.
    pub fn heads(&self) -> usize {
        self.heads
    }
    /// Host time spent hashing the plan (what a scheduler that plans ahead
    /// moved out of the step's forwards).
    pub fn hash_time(&self) -> Duration {
        self.hash_time
    }
    /// Every id in step order: sequence after sequence, token after token,
    /// `heads()` a token.
    pub fn ids(&self) -> &[u64] {
        &self.ids
    }
    /// The distinct ids, in the order the step reads them.
    pub fn distinct(&self) -> &[u64] {
        &self.order().distinct
    }
    /// For each id of [`Self::ids`], the index of its row among
    /// [`Self::distinct`] (the row [`PleLayer::stage`] writes it to).
    pub fn slots(&self) -> &[u32] {
        &self.order().slots
    }
    /// The read requests, in order: consecutive runs of
    /// [`Self::distinct`] (one head group of every token after another
    /// where the step is pipelined, so the first group's rows arrive
    /// first; else one run).
    pub fn reads(&self) -> impl Iterator<Item = &[u64]> + '_ {
        let order = self.order();
        let mut start = 0;
        order.reads.iter().map(move |&end| {
            let part = &order.distinct[start..end];
            start = end;
            part
        })
    }

    /// The distinct ids in read order: one head group of every token after
    /// another where the layer pipelines the step, else step order.
    fn order(&self) -> &Order {
        self.order.get_or_init(|| {
            let heads = self.heads.max(1);
            let groups: Vec<(usize, usize)> = match self.group_heads {
                Some(per) => (0..heads)
                    .step_by(per)
                    .map(|h0| (h0, per.min(heads - h0)))
                    .collect(),
                None => vec![(0, heads)],
            };
            let mut o = Order::default();
            let mut index: HashMap<u64, u32> = HashMap::with_capacity(self.ids.len());
            for (h0, run) in groups {
                for token in self.ids.chunks_exact(heads) {
                    for &id in &token[h0..h0 + run] {
                        index.entry(id).or_insert_with(|| {
                            o.distinct.push(id);
                            (o.distinct.len() - 1) as u32
                        });
                    }
                }
                // A group whose ids all came before adds no request.
                if o.distinct.len() > o.reads.last().copied().unwrap_or(0) {
                    o.reads.push(o.distinct.len());
                }
            }
            o.slots = self.ids.iter().map(|id| index[id]).collect();
            o
        })
    }
    /// The carried history sequence `seq` was planned against
    /// (`context_len` tokens).
    pub fn history(&self, seq: usize) -> &[u32] {
        let e = self.entries[seq];
        &self.hist[e.hist..e.hist + self.ctxl]
    }
    /// Sequence `seq`'s tokens.
    pub fn tokens(&self, seq: usize) -> &[u32] {
        self.part_tokens(PlanPart::whole(self, seq))
    }
    /// Sequence `seq`'s ids (`heads()` a token).
    pub fn seq_ids(&self, seq: usize) -> &[u64] {
        self.part_ids(PlanPart::whole(self, seq))
    }
    /// The tokens of `part`.
    fn part_tokens(&self, part: PlanPart) -> &[u32] {
        let at = self.entries[part.seq].first + part.from;
        &self.tokens[at..at + part.len]
    }
    /// The ids of `part`.
    fn part_ids(&self, part: PlanPart) -> &[u64] {
        let at = self.entries[part.seq].first + part.from;
        &self.ids[at * self.heads..(at + part.len) * self.heads]
    }
    /// The mask of `part`, `None` when no flag of it is set.
    fn part_masked(&self, part: PlanPart) -> Option<&[bool]> {
        if self.masked.is_empty() {
            return None;
        }
        let at = self.entries[part.seq].first + part.from;
        let m = &self.masked[at..at + part.len];
        m.contains(&true).then_some(m)
    }

    /// Check that `part` lies inside the plan.
    fn check_part(&self, part: PlanPart) -> Result<()> {
        let Some(e) = self.entries.get(part.seq) else {
            return Err(LayerError::Plan(format!(
                "PLE plan part names sequence {} of a plan of {}",
                part.seq,
                self.entries.len()
            )));
        };
        layer_ensure!(
            part.len > 0 && part.from + part.len <= e.len,
            Plan,
            "PLE plan part {}..{} of sequence {} lies outside its {} tokens",
            part.from,
            part.from + part.len,
            part.seq,
            e.len
        );
        Ok(())
    }
}

impl PlanPart {
    /// Every token of sequence `seq` of `plan`.
    pub fn whole(plan: &StepPlan, seq: usize) -> Self {
        PlanPart {
            seq,
            from: 0,
            len: plan.entries.get(seq).map_or(0, |e| e.len),
        }
    }
}

impl PleLayer {
    /// Hash a step: entry `i` of the plan is `work[i]`. Its reads are
    /// ordered as the step will resolve them where they wait (see
    /// [`StepPlan::reads`]). Refuses a mask on a site that takes none, or
    /// of the wrong length.
    pub fn plan(&self, work: &[SeqWork<'_>]) -> Result<StepPlan> {
        let t0 = Instant::now();
        let mut plan = self.hash_work(work)?;
        plan.group_heads = self.pipeline_heads();
        plan.hash_time = t0.elapsed();
        Ok(plan)
    }

    /// The ids of `work`, without the distinct ids and read order (what a
    /// forward that plans for itself needs).
    pub(super) fn hash_work(&self, work: &[SeqWork<'_>]) -> Result<StepPlan> {
        self.check_live()?;
        let ctxl = self.dims.context_len();
        let heads = self.dims.ngram_heads();
        let total: usize = work.iter().map(|w| w.tokens.len()).sum();
        let mut plan = StepPlan {
            ctxl,
            heads,
            entries: Vec::with_capacity(work.len()),
            hist: Vec::with_capacity(work.len() * ctxl),
            tokens: Vec::with_capacity(total),
            ids: vec![0u64; total * heads],
            ..StepPlan::default()
        };
        let mut masks = Vec::with_capacity(work.len());
        for w in work {
            masks.push(self.check_mask(w.masked, w.tokens.len(), false)?);
        }
        if masks.iter().any(Option::is_some) {
            plan.masked = vec![false; total];
        }
        let mut carried = Vec::with_capacity(ctxl);
        let single = work.iter().all(|w| w.tokens.len() == 1) && plan.masked.is_empty();
        for (w, m) in work.iter().zip(&masks) {
            // The history a carry holds before these tokens: EOS-padded
            // when shorter, as `reset` leaves a fresh one.
            carried.clear();
            self.dims.advance_history(&mut carried, w.history);
            let e = Entry {
                hist: plan.hist.len(),
                first: plan.tokens.len(),
                len: w.tokens.len(),
            };
            plan.hist.extend_from_slice(&carried);
            plan.tokens.extend_from_slice(w.tokens);
            if let Some(m) = m {
                plan.masked[e.first..e.first + e.len].copy_from_slice(m);
            }
            plan.entries.push(e);
            if single || e.len == 0 {
                continue;
            }
            let ids = &mut plan.ids[e.first * heads..(e.first + e.len) * heads];
            match m {
                Some(m) => {
                    // The history holds no masked token (the pad fill
                    // stands in for one), so only the new tokens carry
                    // flags.
                    let mut flags = vec![false; carried.len()];
                    flags.extend_from_slice(m);
                    let bounds = Boundaries {
                        doc_start: &[],
                        masked: &flags,
                    };
                    self.hasher
                        .engram_ids_bounded_into(&carried, w.tokens, bounds, ids)?;
                }
                None => self.hasher.ids_with_history_into(&carried, w.tokens, ids)?,
            }
        }
        if single && !work.is_empty() {
            // One token per sequence: the batched hash, in one call.
            let hists: Vec<&[u32]> = plan.hist.chunks_exact(ctxl).collect();
            self.hasher
                .decode_batch_into(&hists, &plan.tokens, &mut plan.ids)?;
        }
        Ok(plan)
    }

    /// The history a carry holds after the first `from` tokens of sequence
    /// `seq` of `plan` (masked tokens block the look-back as the forward
    /// leaves them).
    fn plan_history(&self, plan: &StepPlan, seq: usize, from: usize) -> Vec<u32> {
        let mut h = plan.history(seq).to_vec();
        if from > 0 {
            let part = PlanPart {
                seq,
                from: 0,
                len: from,
            };
            self.dims.advance_history(&mut h, plan.part_tokens(part));
            if let Some(m) = plan.part_masked(part) {
                self.apply_mask_to_history(&mut h, m);
            }
        }
        h
    }

    /// Refuse `part` of `plan` unless it lies in the plan and `history` (a
    /// carry's, after any reset) is the one the plan implies there.
    fn check_plan_history(&self, plan: &StepPlan, part: PlanPart, history: &[u32]) -> Result<()> {
        plan.check_part(part)?;
        layer_ensure!(
            plan.ctxl == self.dims.context_len() && plan.heads == self.dims.ngram_heads(),
            Plan,
            "PLE plan made for a site of another geometry"
        );
        let want = self.plan_history(plan, part.seq, part.from);
        layer_ensure!(
            history == want.as_slice(),
            Plan,
            "PLE plan for sequence {} at token {} was made for history {want:?}, the carry holds \
             {history:?}; plan the step against the carries it runs on",
            part.seq,
            part.from
        );
        Ok(())
    }

    /// The history a carry is hashed against: its own, or a fresh one's
    /// when it will be reset.
    fn effective_history<'a>(&self, st: &'a PleSeqState, fresh: bool, eos: &'a [u32]) -> &'a [u32] {
        if fresh || st.history.len() != self.dims.context_len() {
            eos
        } else {
            &st.history
        }
    }

    /// Start reading the rows of `plan`, request after request in its read
    /// order. Advice only: nothing is pinned and the results never change;
    /// a table that holds its rows in place does nothing. Lets a scheduler
    /// overlap a step's reads with other work.
    pub fn prefetch(&self, plan: &StepPlan) -> Result<()> {
        self.check_live()?;
        for part in plan.reads() {
            self.table
                .prefetch(part)
                .map_err(|e| table_err("prefetching PLE rows")(e))?;
        }
        Ok(())
    }

    /// Gather the rows of `plan`'s distinct ids into `out`, a buffer the
    /// caller owns of `distinct().len() * row_dim()` f32 (row `i` holds
    /// the row of `distinct()[i]`, converted from the table's row type as
    /// the forward's gather does), queued on `stream`. With
    /// [`StepPlan::slots`] this is all an engine that runs its own kernels
    /// needs of the layer. Rows are resolved in parts of what the table
    /// resolves at once; each part's lease is released with an event
    /// recorded right after its gather. Refused under capture.
    pub fn stage(
        &self,
        plan: &StepPlan,
        out: DevicePtr,
        gpu: &dyn GpuBackend,
        stream: StreamId,
    ) -> Result<()> {
        self.check_live()?;
        let ids = plan.distinct();
        if ids.is_empty() {
            return Ok(());
        }
        layer_ensure!(!out.is_null(), Usage, "PLE stage into a null buffer");
        layer_ensure!(
            !gpu.stream_is_capturing(stream)?,
            Capture,
            "PLE stage refused: stream {stream} is capturing (resolving rows is host work)"
        );
        let table = self.table.as_ref();
        // The refs go through the eager part of the staging area, which
        // holds `max_tokens * ngram_heads` of them.
        let cap = self.max_tokens * self.dims.ngram_heads();
        let mut stg = self.staging.lock();
        stg.streams.insert(stream);
        let at = stg.eager_ref(0);
        let mut start = 0;
        while start < ids.len() {
            let end = staging::part_end(ids, start, table.max_resolve()).min(start + cap);
            let mut refs = vec![RowRef::default(); end - start];
            let lease = table.resolve(&ids[start..end], &mut refs).map_err(|e| {
                table_err(format!(
                    "resolving PLE rows {start}..{end} of a plan of {} (first id {})",
                    ids.len(),
                    ids[start]
                ))(e)
            })?;
            let dst = out.offset(start * self.row_dim * 4);
            let queued = gpu
                .copy_h2d_async(&staging::refs_bytes(&refs), at, stream)
                .device(|| "uploading PLE row refs".into())
                .and_then(|()| self.launch_gather(gpu, at, end - start, dst, stream));
            let released = staging::release_at_tail(table, gpu, stream, vec![lease]);
            queued?;
            released?;
            start = end;
        }
        Ok(())
    }

    /// Run `part` of `plan` eagerly on one sequence, adding into `highway
    /// [part.len, C]`: reset the carry when `fresh` or its history has the
    /// wrong length, check it against the plan, gather the part's rows
    /// and run the kernels, advancing the history. Any waiting prestage is
    /// taken. Refused under capture (prestage a batch instead).
    #[allow(clippy::too_many_arguments)]
    pub fn run(
        &self,
        plan: &StepPlan,
        part: PlanPart,
        st: &mut PleSeqState,
        highway: DevicePtr,
        fresh: bool,
        gpu: &dyn GpuBackend,
        stream: StreamId,
    ) -> Result<()> {
        self.check_live()?;
        layer_ensure!(
            !st.conv.is_null(),
            Usage,
            "PLE forward on a released sequence state"
        );
        layer_ensure!(!highway.is_null(), Usage, "PLE forward with a null highway");
        layer_ensure!(
            !gpu.stream_is_capturing(stream)?,
            Capture,
            "PLE forward refused under capture: running a plan resolves rows on the host; \
             prestage the step before capture"
        );
        let eos = vec![self.dims.eos_token_id; self.dims.context_len()];
        self.check_plan_history(plan, part, self.effective_history(st, fresh, &eos))?;
        st.prestaged_va = None;
        if fresh || st.history.len() != self.dims.context_len() {
            self.reset(st, gpu, stream).map_err(LayerError::Reset)?;
        }
        let masked = plan.part_masked(part);
        self.forward_eager(
            gpu,
            st,
            highway,
            plan.part_ids(part),
            plan.part_tokens(part),
            masked,
            stream,
        )
    }

    /// Run one token of each of `states` eagerly: `states[i]` runs
    /// sequence `seqs[i]` of `plan` (one token each) on row `i` of
    /// `highway [rows, C]` (rows past `states.len()` are padding). One
    /// gather, projection, gate and batched conv for the whole batch,
    /// bit-identical to single-token forwards; any waiting prestages are
    /// taken. Refused under capture.
    #[allow(clippy::too_many_arguments)]
    pub fn run_batch(
        &self,
        plan: &StepPlan,
        seqs: &[usize],
        states: &mut [&mut PleSeqState],
        highway: DevicePtr,
        rows: usize,
        gpu: &dyn GpuBackend,
        stream: StreamId,
    ) -> Result<()> {
        self.check_live()?;
        layer_ensure!(
            !gpu.stream_is_capturing(stream)?,
            Capture,
            "PLE forward refused under capture: running a plan resolves rows on the host; \
             prestage the step before capture"
        );
        for st in states.iter_mut() {
            st.prestaged_va = None;
        }
        let flags: Vec<bool> = seqs
            .iter()
            .map(|&s| {
                plan.check_part(PlanPart::whole(plan, s))?;
                Ok(plan
                    .part_masked(PlanPart::whole(plan, s))
                    .is_some_and(|m| m[0]))
            })
            .collect::<Result<_>>()?;
        let masked = flags.contains(&true).then_some(flags.as_slice());
        self.run_batch_eager(plan, seqs, states, highway, rows, masked, gpu, stream)
    }

    /// The eager batch step over `plan`: stage and gather, then the
    /// kernels, then a masked token's history fill.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn run_batch_eager(
        &self,
        plan: &StepPlan,
        seqs: &[usize],
        states: &mut [&mut PleSeqState],
        highway: DevicePtr,
        rows: usize,
        masked: Option<&[bool]>,
        gpu: &dyn GpuBackend,
        stream: StreamId,
    ) -> Result<()> {
        layer_ensure!(
            !highway.is_null(),
            Usage,
            "PLE forward_batch with a null highway"
        );
        let masked = self.check_mask(masked, states.len(), false)?;
        let projected = self.stage_batch(
            states,
            plan,
            seqs,
            rows,
            gpu,
            stream,
            super::batch::Stage::Gather,
        )?;
        let conv = ConvTarget::Table(self.staging.lock().conv_table());
        if projected {
            self.launch_after_projection(gpu, highway, rows, conv, masked, stream)?;
        } else {
            self.launch_rest(gpu, highway, rows, conv, masked, stream)?;
        }
        if let Some(m) = masked {
            self.fill_masked_histories(states, m);
        }
        Ok(())
    }

    /// The host half of a replayable decode step from a plan: `states[i]`
    /// stages sequence `seqs[i]` of `plan` (one token each) at fixed batch
    /// slot `i`; see [`Self::prestage_batch`] for the slots, padding, pins
    /// and errors. The step's forward ([`Self::forward_batch`]) then reads
    /// fixed addresses only, so it can be captured and replayed.
    pub fn prestage_plan(
        &self,
        plan: &StepPlan,
        seqs: &[usize],
        states: &mut [&mut PleSeqState],
        rows: usize,
        gpu: &dyn GpuBackend,
        stream: StreamId,
    ) -> Result<()> {
        self.stage_batch(
            states,
            plan,
            seqs,
            rows,
            gpu,
            stream,
            super::batch::Stage::Hold,
        )
        .map(|_| ())
    }

    /// The plan of one token per state (`tokens[i]` for `states[i]`,
    /// with `masked[i]`), against the histories the states will hold when
    /// the step runs (a fresh carry's where a reset is due).
    pub(super) fn plan_states(
        &self,
        states: &[&mut PleSeqState],
        tokens: &[u32],
        masked: Option<&[bool]>,
    ) -> Result<StepPlan> {
        let eos = vec![self.dims.eos_token_id; self.dims.context_len()];
        let work: Vec<SeqWork<'_>> = states
            .iter()
            .enumerate()
            .map(|(i, st)| SeqWork {
                history: self.effective_history(st, false, &eos),
                tokens: &tokens[i..i + 1],
                masked: masked.map(|m| &m[i..i + 1]),
            })
            .collect();
        self.hash_work(&work)
    }

    /// Check the batch entries `seqs` of `plan` against `states` (one
    /// token each, planned against the history the state holds, or a
    /// fresh one's where a reset is due), returning their ids and each
    /// state's history after its token.
    pub(super) fn batch_ids(
        &self,
        plan: &StepPlan,
        seqs: &[usize],
        states: &[&mut PleSeqState],
    ) -> Result<(Vec<u64>, Vec<Vec<u32>>)> {
        layer_ensure!(
            seqs.len() == states.len(),
            Usage,
            "PLE batch step: {} plan entries for {} sequences",
            seqs.len(),
            states.len()
        );
        let eos = vec![self.dims.eos_token_id; self.dims.context_len()];
        let mut ids = Vec::with_capacity(seqs.len() * self.dims.ngram_heads());
        let mut hist = Vec::with_capacity(seqs.len());
        for (&s, st) in seqs.iter().zip(states) {
            let part = PlanPart::whole(plan, s);
            layer_ensure!(
                part.len == 1,
                Plan,
                "PLE batch step: plan sequence {s} holds {} tokens, a batch runs one each",
                part.len
            );
            self.check_plan_history(plan, part, self.effective_history(st, false, &eos))?;
            ids.extend_from_slice(plan.part_ids(part));
            let mut h = plan.history(s).to_vec();
            self.dims.advance_history(&mut h, plan.part_tokens(part));
            hist.push(h);
        }
        Ok((ids, hist))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Two sequences over a context of 2 and 2 heads, read in one run.
    fn two() -> StepPlan {
        StepPlan {
            ctxl: 2,
            heads: 2,
            entries: vec![
                Entry {
                    hist: 0,
                    first: 0,
                    len: 1,
                },
                Entry {
                    hist: 2,
                    first: 1,
                    len: 2,
                },
            ],
            hist: vec![7, 8, 1, 1],
            tokens: vec![9, 4, 5],
            masked: Vec::new(),
            ids: vec![10, 11, 20, 10, 30, 31],
            group_heads: Some(1),
            order: OnceLock::new(),
            hash_time: Duration::ZERO,
        }
    }

    #[test]
    fn a_plan_names_each_sequences_part() {
        let p = two();
        assert_eq!(p.len(), 2);
        assert_eq!(p.history(1), &[1, 1]);
        assert_eq!(p.tokens(1), &[4, 5]);
        assert_eq!(p.seq_ids(1), &[20, 10, 30, 31]);
        let part = PlanPart {
            seq: 1,
            from: 1,
            len: 1,
        };
        assert_eq!(p.part_ids(part), &[30, 31]);
        assert_eq!(p.part_tokens(part), &[5]);
        // Head 0 of every token, then head 1.
        assert_eq!(p.distinct(), &[10, 20, 30, 11, 31]);
        assert_eq!(p.slots(), &[0, 3, 1, 0, 2, 4]);
        assert_eq!(
            p.reads().collect::<Vec<_>>(),
            [&[10, 20, 30][..], &[11, 31]]
        );
        for (id, &s) in p.ids().iter().zip(p.slots()) {
            assert_eq!(p.distinct()[s as usize], *id);
        }
    }

    #[test]
    fn a_part_outside_the_plan_is_refused() {
        let p = two();
        let bad = [
            PlanPart {
                seq: 2,
                from: 0,
                len: 1,
            },
            PlanPart {
                seq: 1,
                from: 1,
                len: 2,
            },
            PlanPart {
                seq: 0,
                from: 0,
                len: 0,
            },
        ];
        for part in bad {
            assert!(
                matches!(p.check_part(part), Err(LayerError::Plan(_))),
                "{part:?}"
            );
        }
        assert!(p.check_part(PlanPart::whole(&p, 1)).is_ok());
    }

    #[test]
    fn an_empty_plan_reads_nothing() {
        let p = StepPlan {
            ctxl: 2,
            heads: 2,
            group_heads: Some(1),
            ..StepPlan::default()
        };
        assert!(p.is_empty());
        assert_eq!(p.reads().count(), 0);
        assert!(p.distinct().is_empty() && p.slots().is_empty());
    }
}
