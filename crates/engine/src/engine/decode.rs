//! Batched decode: one token for each of many sequences per step, eager or
//! through graphs captured once per padded batch size and replayed.
//!
//! Invariants: a batch is validated whole before anything runs; a batch is
//! split into parts the device budget and the sites' `max_tokens` hold
//! (outputs do not depend on the split); a failed part loses the carries of
//! its sequences. With graphs, a failed capture gives the prestages back and
//! runs the same prestaged step eagerly, so nothing is hashed twice.
//!
//! Token masks: a decode step whose part holds a masked token runs eagerly
//! even with graphs enabled (the layer shuts a masked token's gate and
//! resets its history by host-issued work a replay would not redo); an
//! all-clear mask is no mask, so those steps replay as usual.
//!
//! Row caches: an eager step's site gathers its rows in parts its row table
//! can pin, so any batch runs on any cache. A graph step keeps every row it
//! prestaged pinned until the replay has read them, so with graphs a batch
//! is also split into steps of at most [`Site::max_prestage_batch`]
//! sequences, and graphs are refused over a site whose table cannot pin one
//! sequence's rows at once.

use std::collections::{HashMap, HashSet};

use metrale_gpu_runtime::gpu::DevicePtr;
use metrale_model_layers::layers::ple::SeqWork;

use super::rows::{Highway, run_on, run_staged};
use super::{Carry, Engine, EngineError, Result, Seq, SeqId, Site, StepPlans};

/// The carries of site `k` of the sequences of `taken`, in order.
fn states_of<St>(taken: &mut [Seq<St>], k: usize) -> Result<Vec<&mut St>> {
    taken
        .iter_mut()
        .map(|seq| match &mut seq.carry {
            Carry::Resident(st) => Ok(&mut st[k]),
            _ => Err(EngineError::Internal(
                "batched forward of a carry that is not resident",
            )),
        })
        .collect()
}

impl<S: Site> Engine<S> {
    /// Make batched decode run through graphs: each step first stages
    /// its rows on the host (`prestage_batch`), then replays a graph
    /// captured once per padded batch size (the next power of two, up to
    /// [`Self::batch_capacity`]), as a server replays CUDA graphs. Outputs
    /// are bit-identical to eager decode. The graphs read and write the
    /// engine's own device rows, so a step on device rows ([`Highway`])
    /// copies them in and out on the device around the replay. Refused when
    /// a site cannot replay.
    pub fn enable_decode_graphs(&mut self) -> Result<()> {
        if let Some(i) = self.sites.iter().position(|s| !s.supports_graphs()) {
            return Err(EngineError::GraphsUnsupported(i));
        }
        if let Some(i) = self
            .sites
            .iter()
            .position(|s| s.max_prestage_batch() == Some(0))
        {
            return Err(EngineError::GraphRowsDoNotFit(i));
        }
        self.graphs.get_or_insert_with(HashMap::new);
        Ok(())
    }

    /// Whether batched decode replays captured graphs.
    pub fn decode_graphs(&self) -> bool {
        self.graphs.is_some()
    }

    /// One decode step: token `batch[b].1` for sequence `batch[b].0`, on row
    /// `b` of `highway` (`batch.len()` rows in, out: host rows, or rows on
    /// the device run in place, see [`Highway`]). Batches larger than
    /// [`Self::batch_capacity`], than the device budget holds carries, or
    /// (with graphs) than a site's row table can keep pinned for one step,
    /// run as several batched forwards in order (outputs do not depend on
    /// the split); if a later part fails, the earlier parts have run.
    pub fn decode<'h>(
        &mut self,
        batch: &[(SeqId, u32)],
        highway: impl Into<Highway<'h>>,
    ) -> Result<()> {
        self.decode_with(batch, None, None, highway.into())
    }

    /// [`Self::decode`] running `plan` (from [`Self::plan`]) for each part
    /// of the batch whose sequences it holds, so their tokens are not
    /// hashed again (a part it holds only some of is planned anew).
    /// Refused, with nothing changed, when the plan holds a sequence for
    /// another token or position ([`EngineError::PlanMismatch`]).
    pub fn decode_planned<'h>(
        &mut self,
        batch: &[(SeqId, u32)],
        plan: &StepPlans<S::Plan>,
        highway: impl Into<Highway<'h>>,
    ) -> Result<()> {
        for &(id, t) in batch {
            let absorbed = self.seq(id)?.tokens.len();
            plan.part(id, absorbed, &[t])?;
        }
        self.decode_with(batch, None, Some(plan), highway.into())
    }

    /// [`Self::decode`] with a token mask: `masked[b]` flags the token of
    /// `batch[b]` (`true`: masked; see [`Self::prefill_masked`]). A part of
    /// the batch holding a masked token runs eagerly even with decode
    /// graphs; a sequence that absorbs one no longer caches its block
    /// boundaries. Refused, with nothing changed, when a site's published
    /// layer has no mask or the mask's length is not the batch's.
    pub fn decode_masked<'h>(
        &mut self,
        batch: &[(SeqId, u32)],
        masked: &[bool],
        highway: impl Into<Highway<'h>>,
    ) -> Result<()> {
        self.decode_with(batch, Some(masked), None, highway.into())
    }

    fn decode_with(
        &mut self,
        batch: &[(SeqId, u32)],
        masked: Option<&[bool]>,
        plan: Option<&StepPlans<S::Plan>>,
        mut highway: Highway<'_>,
    ) -> Result<()> {
        highway.check("decode", batch.len(), self.width)?;
        self.check_tokens("decode", batch.iter().map(|&(_, t)| t))?;
        if let Some(m) = masked {
            self.check_mask("decode", m, batch.len())?;
        }
        let mut seen = HashSet::with_capacity(batch.len());
        for &(id, _) in batch {
            if !seen.insert(id) {
                return Err(EngineError::DuplicateInBatch(id));
            }
            self.check_usable(id, "decode", false)?;
            if self.seq(id)?.tokens.is_empty() {
                return Err(EngineError::NotStarted(id));
            }
        }
        let fit = (self.budget.limit() / self.carry_bytes.max(1)).max(1);
        let mut part_len = self.batch_cap.min(fit);
        if self.graphs.is_some() {
            // Each graph step pins all its rows until the replay reads them;
            // enable_decode_graphs made sure every site fits one sequence.
            for site in &self.sites {
                if let Some(n) = site.max_prestage_batch() {
                    part_len = part_len.min(n.max(1));
                }
            }
        }
        for (i, part) in batch.chunks(part_len).enumerate() {
            let start = i * part_len;
            let rows = highway.rows(start, part.len(), self.width);
            // An all-clear part is no mask (the layer treats it so too).
            let part_masked = masked
                .map(|m| &m[start..start + part.len()])
                .filter(|m| m.contains(&true));
            self.decode_part(part, part_masked, plan, rows)?;
        }
        Ok(())
    }

    pub(super) fn decode_part(
        &mut self,
        part: &[(SeqId, u32)],
        masked: Option<&[bool]>,
        plan: Option<&StepPlans<S::Plan>>,
        rows: Highway<'_>,
    ) -> Result<()> {
        let ids: Vec<SeqId> = part.iter().map(|p| p.0).collect();
        for &id in &ids {
            self.ensure_resident(id, &ids)?;
        }
        let tokens: Vec<u32> = part.iter().map(|p| p.1).collect();
        // The step plan runs the part when it holds every sequence of it.
        let mut entries = Vec::with_capacity(part.len());
        if let (Some(p), None) = (plan, masked) {
            for &(id, t) in part {
                let absorbed = self.seq(id)?.tokens.len();
                match p.part(id, absorbed, &[t])? {
                    Some(e) => entries.push(e.seq),
                    None => break,
                }
            }
        }
        let planned = plan
            .filter(|_| entries.len() == part.len())
            .map(|p| (p, entries.as_slice()));
        let mut taken: Vec<Seq<S::State>> = ids
            .iter()
            .map(|id| self.seqs.remove(id).expect("validated"))
            .collect();
        let r = self.forward_batch_rows(&mut taken, &tokens, masked, planned, rows);
        for (i, mut seq) in taken.into_iter().enumerate() {
            match &r {
                Ok(()) => {
                    seq.tokens.push(tokens[i]);
                    seq.masked |= masked.is_some_and(|m| m[i]);
                }
                Err(e) => self.lose(
                    ids[i],
                    &mut seq,
                    format!("a batched decode failed: {}", e.chain()),
                ),
            }
            self.seqs.insert(ids[i], seq);
        }
        if r.is_ok() {
            self.stats.decode_tokens += tokens.len() as u64;
            // Generated tokens are cached at block boundaries too, so the
            // next turn of a conversation, sent as a new sequence, restores
            // past them. As in prefill, a failed snapshot fails nothing.
            if self.caches_boundaries() {
                let b = self.cfg.block_size;
                for &id in &ids {
                    if self.seq(id)?.tokens.len().is_multiple_of(b)
                        && self.cache_boundary(id).is_err()
                    {
                        self.stats.cache_snapshot_failures += 1;
                    }
                }
            }
        }
        r
    }

    /// One batched forward of `tokens` (with `masked`, checked and holding
    /// a flag, or `None`) over the resident carries of `taken`: from a graph
    /// when graphs are enabled and nothing is masked, else eagerly. With
    /// `planned`, sequence `b` runs entry `planned.1[b]` of the step plan.
    pub(super) fn forward_batch_rows(
        &mut self,
        taken: &mut [Seq<S::State>],
        tokens: &[u32],
        masked: Option<&[bool]>,
        planned: Option<(&StepPlans<S::Plan>, &[usize])>,
        rows: Highway<'_>,
    ) -> Result<()> {
        if self.graphs.is_some() {
            if masked.is_none() {
                return self.forward_batch_graph(taken, tokens, planned, rows);
            }
            self.stats.masked_eager_steps += 1;
        }
        let gpu = self.gpu.as_ref();
        run_on(gpu, self.highway, self.stream, rows, |hw| {
            for (k, site) in self.sites.iter().enumerate() {
                let mut states = states_of(taken, k)?;
                self.run_site_batch(
                    k,
                    site,
                    &mut states,
                    tokens,
                    masked,
                    planned,
                    |p, seqs, st| site.run_batch(p, seqs, st, hw, gpu, self.stream),
                )
                .map_err(|e| {
                    EngineError::site(
                        k,
                        format!("site {k} batched decode of {} sequences", tokens.len()),
                        e,
                    )
                })?;
            }
            Ok(())
        })
    }

    /// Run `f` on site `k`'s plan of one token for each of `states`: entry
    /// `planned.1[b]` of the step plan for `states[b]`, or without one a
    /// plan made here against the carries.
    #[allow(clippy::too_many_arguments)]
    fn run_site_batch(
        &self,
        k: usize,
        site: &S,
        states: &mut [&mut S::State],
        tokens: &[u32],
        masked: Option<&[bool]>,
        planned: Option<(&StepPlans<S::Plan>, &[usize])>,
        f: impl FnOnce(&S::Plan, &[usize], &mut [&mut S::State]) -> super::SiteResult<()>,
    ) -> super::SiteResult<()> {
        if let Some((plan, seqs)) = planned {
            return f(&plan.sites[k], seqs, states);
        }
        let work: Vec<SeqWork<'_>> = states
            .iter()
            .enumerate()
            .map(|(b, st)| SeqWork {
                history: site.history(st),
                tokens: &tokens[b..b + 1],
                masked: masked.map(|m| &m[b..b + 1]),
            })
            .collect();
        let plan = site.plan(&work)?;
        let seqs: Vec<usize> = (0..states.len()).collect();
        f(&plan, &seqs, states)
    }

    /// One batched decode step through a captured graph: prestage every
    /// site, capture the step for this padded size if it is the first,
    /// replay it, and note the replay. A failed capture gives the prestages
    /// back and runs the same prestaged step eagerly, so nothing is hashed
    /// twice and the outputs are the same. The graph runs on the engine's
    /// own rows, so device rows are copied through them.
    pub(super) fn forward_batch_graph(
        &mut self,
        taken: &mut [Seq<S::State>],
        tokens: &[u32],
        planned: Option<(&StepPlans<S::Plan>, &[usize])>,
        rows: Highway<'_>,
    ) -> Result<()> {
        let gpu = self.gpu.clone();
        let gpu = gpu.as_ref();
        let stream = self.stream;
        let padded = tokens.len().next_power_of_two().min(self.batch_cap);
        let staging = self.highway;
        let shape = (tokens.len(), self.width);
        run_staged(gpu, staging, stream, rows, shape, |hw| {
            self.graph_step(taken, tokens, planned, padded, hw)
        })
    }

    fn graph_step(
        &mut self,
        taken: &mut [Seq<S::State>],
        tokens: &[u32],
        planned: Option<(&StepPlans<S::Plan>, &[usize])>,
        padded: usize,
        highway: DevicePtr,
    ) -> Result<()> {
        let gpu = self.gpu.clone();
        let gpu = gpu.as_ref();
        let stream = self.stream;
        for (k, site) in self.sites.iter().enumerate() {
            let mut states = states_of(taken, k)?;
            self.run_site_batch(
                k,
                site,
                &mut states,
                tokens,
                None,
                planned,
                |p, seqs, st| site.prestage(p, seqs, st, padded, gpu, stream),
            )
            .map_err(|e| {
                EngineError::site(
                    k,
                    format!("site {k} prestage of {} sequences", tokens.len()),
                    e,
                )
            })?;
        }
        let known = self.graphs.as_ref().and_then(|g| g.get(&padded)).copied();
        let graph = match known {
            Some(g) => Some(g),
            None => {
                gpu.begin_capture(stream)
                    .map_err(|e| EngineError::device("decode graph: begin_capture", e))?;
                let mut captured = Ok(());
                for (k, site) in self.sites.iter().enumerate() {
                    captured = states_of(taken, k).and_then(|mut st| {
                        site.forward_prestaged(&mut st, highway, padded, gpu, stream)
                            .map_err(|e| EngineError::site(k, format!("site {k} capture"), e))
                    });
                    if captured.is_err() {
                        break;
                    }
                }
                match (captured, gpu.end_capture(stream)) {
                    (Ok(()), Ok(g)) => {
                        self.graphs
                            .get_or_insert_with(HashMap::new)
                            .insert(padded, g);
                        self.stats.graph_captures += 1;
                        Some(g)
                    }
                    (_, ended) => {
                        if let Ok(g) = ended {
                            let _ = gpu.destroy_graph(g);
                        }
                        for (k, site) in self.sites.iter().enumerate() {
                            for st in states_of(taken, k)? {
                                site.rearm(st);
                            }
                        }
                        None
                    }
                }
            }
        };
        match graph {
            Some(g) => {
                gpu.launch_graph(g, stream)
                    .map_err(|e| EngineError::device("decode graph: launch_graph", e))?;
                for (k, site) in self.sites.iter().enumerate() {
                    site.note_replayed(&mut states_of(taken, k)?, gpu, stream)
                        .map_err(|e| EngineError::site(k, format!("site {k} note_replayed"), e))?;
                }
                self.stats.graph_replays += 1;
            }
            None => {
                for (k, site) in self.sites.iter().enumerate() {
                    site.forward_prestaged(&mut states_of(taken, k)?, highway, padded, gpu, stream)
                        .map_err(|e| {
                            EngineError::site(
                                k,
                                format!("site {k} batched decode of {} sequences", tokens.len()),
                                e,
                            )
                        })?;
                }
            }
        }
        Ok(())
    }
}
