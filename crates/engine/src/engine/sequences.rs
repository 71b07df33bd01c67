//! Sequences and the device budget: carries are allocated against the
//! [`crate::budget::MemoryBudget`] (preempting least recently used
//! sequences), added, prefilled in chunks and released.
//!
//! Invariants: a failed allocation holds nothing (no state, no charge); a
//! failed forward loses the carry ([`EngineError::Lost`] from then on) and
//! releases its charge, so preemption never picks a lost sequence.

use metrale_model_layers::layers::ple::PlanPart;

use super::rows::{Highway, run_on};
use super::{Added, Carry, Engine, EngineError, Result, Seq, SeqId, Site, StepPlans, Swapped};

impl<S: Site> Engine<S> {
    // ---- carries ----

    /// Fresh states for every site, charged to the budget (preempting others
    /// when needed, never `protect`). On failure nothing is held.
    pub(super) fn alloc_states(&mut self, id: SeqId, protect: &[SeqId]) -> Result<Vec<S::State>> {
        let victims = self.budget.plan_preemption(self.carry_bytes, protect)?;
        for v in victims {
            self.swap_out(v, self.cfg.preempt_to)
                .map_err(|e| EngineError::Preempt {
                    victim: v,
                    seq: id,
                    source: Box::new(e),
                })?;
            self.stats.preemptions += 1;
        }
        self.budget.charge(id, self.carry_bytes)?;
        let mut states = Vec::with_capacity(self.sites.len());
        for (i, site) in self.sites.iter().enumerate() {
            match site.new_state(self.gpu.as_ref()) {
                Ok(st) => states.push(st),
                Err(e) => {
                    let _ = self.free_states(&mut states);
                    self.budget.release(id);
                    return Err(EngineError::site(
                        i,
                        format!("allocating the carry of site {i}"),
                        e,
                    ));
                }
            }
        }
        Ok(states)
    }

    /// Release the states of every site; the first error is returned but
    /// every state is released regardless.
    pub(super) fn free_states(&self, states: &mut [S::State]) -> Result<()> {
        let mut first = Ok(());
        for (i, (site, st)) in self.sites.iter().zip(states.iter_mut()).enumerate() {
            let r = site
                .release(st, self.gpu.as_ref())
                .map_err(|e| EngineError::site(i, format!("releasing the carry of site {i}"), e));
            if first.is_ok() {
                first = r;
            }
        }
        first
    }

    pub(super) fn snapshot_states(&self, states: &[S::State]) -> Result<Vec<Vec<u8>>> {
        let mut blobs = Vec::with_capacity(states.len());
        for (i, (site, st)) in self.sites.iter().zip(states).enumerate() {
            blobs.push(
                site.snapshot(st, self.gpu.as_ref(), self.stream)
                    .map_err(|e| EngineError::site(i, format!("snapshot of site {i}"), e))?,
            );
        }
        Ok(blobs)
    }

    pub(super) fn restore_states(&self, states: &mut [S::State], blobs: &[Vec<u8>]) -> Result<()> {
        for (i, ((site, st), blob)) in self
            .sites
            .iter()
            .zip(states.iter_mut())
            .zip(blobs)
            .enumerate()
        {
            site.restore(st, blob, self.gpu.as_ref(), self.stream)
                .map_err(|e| EngineError::site(i, format!("restoring site {i}"), e))?;
        }
        self.gpu
            .synchronize(self.stream)
            .map_err(|e| EngineError::device("restoring a carry: synchronize", e))
    }

    /// Fresh states holding `blobs` (already validated). On failure nothing
    /// is held.
    pub(super) fn states_from(
        &mut self,
        id: SeqId,
        blobs: &[Vec<u8>],
        protect: &[SeqId],
    ) -> Result<Vec<S::State>> {
        let mut states = self.alloc_states(id, protect)?;
        if let Err(e) = self.restore_states(&mut states, blobs) {
            let _ = self.free_states(&mut states);
            self.budget.release(id);
            return Err(e);
        }
        Ok(states)
    }

    /// Make `id` resident, swapping it in when needed.
    pub(super) fn ensure_resident(&mut self, id: SeqId, protect: &[SeqId]) -> Result<()> {
        if !matches!(self.seq(id)?.carry, Carry::Resident(_)) {
            self.swap_in_protected(id, protect)?;
        }
        self.budget.touch(id);
        Ok(())
    }

    // ---- sequences ----

    /// Add a sequence that will run `prompt`. The longest cached block
    /// boundary strictly inside the prompt (at least one token is left to
    /// compute, so the last prompt token gets its output) is restored; the
    /// caller prefills `prompt[added.cached..]`.
    pub fn add_sequence(&mut self, prompt: &[u32]) -> Result<Added> {
        self.check_tokens("add_sequence", prompt.iter().copied())?;
        self.add_checked(prompt, prompt.len())
    }

    /// [`Self::add_sequence`] for a prompt that will be prefilled with the
    /// token mask `masked` (one flag per prompt token, `true`: masked; see
    /// [`Self::prefill_masked`]). A cached carry is the carry of unmasked
    /// tokens, so only a prefix up to the first masked token is restored;
    /// the caller prefills `prompt[added.cached..]` with
    /// `masked[added.cached..]`. Refused, with nothing changed, when a site
    /// takes no mask or the mask's length is not the prompt's.
    pub fn add_sequence_masked(&mut self, prompt: &[u32], masked: &[bool]) -> Result<Added> {
        self.check_tokens("add_sequence", prompt.iter().copied())?;
        self.check_mask("add_sequence", masked, prompt.len())?;
        // `restore_prefix` leaves at least one token of what it is given,
        // so a prefix never reaches past the first masked token.
        let usable = masked
            .iter()
            .position(|&m| m)
            .map_or(prompt.len(), |p| p + 1);
        self.add_checked(prompt, usable)
    }

    /// Add a sequence for a checked `prompt`, restoring a cached prefix of
    /// `prompt[..usable]` only.
    fn add_checked(&mut self, prompt: &[u32], usable: usize) -> Result<Added> {
        let id = self.next_id;
        let (cached, states) = self.restore_prefix(id, &prompt[..usable])?;
        self.next_id += 1;
        if cached > 0 {
            self.stats.prefix_hits += 1;
            self.stats.prefix_tokens_restored += cached as u64;
        }
        self.seqs.insert(
            id,
            Seq {
                tokens: prompt[..cached].to_vec(),
                masked: false,
                carry: Carry::Resident(states),
                pending: None,
            },
        );
        Ok(Added { id, cached })
    }

    /// Run `tokens` through sequence `id` in chunks of at most
    /// `prefill_chunk` (split further at prefix-cache block boundaries, where
    /// snapshots are cached). `highway` holds `tokens.len()` rows in, and
    /// gets them back with every site applied: host rows, or rows on the
    /// device run in place ([`Highway`]; a chunk runs the rows at its
    /// offset).
    pub fn prefill<'h>(
        &mut self,
        id: SeqId,
        tokens: &[u32],
        highway: impl Into<Highway<'h>>,
    ) -> Result<()> {
        self.prefill_with(id, tokens, None, None, highway.into())
    }

    /// [`Self::prefill`] running `plan` (from [`Self::plan`]) where it
    /// holds the sequence, so its tokens are not hashed again. Refused,
    /// with nothing changed, when the plan holds the sequence for other
    /// tokens or another position ([`EngineError::PlanMismatch`]).
    pub fn prefill_planned<'h>(
        &mut self,
        id: SeqId,
        tokens: &[u32],
        plan: &StepPlans<S::Plan>,
        highway: impl Into<Highway<'h>>,
    ) -> Result<()> {
        let absorbed = self.seq(id)?.tokens.len();
        plan.part(id, absorbed, tokens)?;
        self.prefill_with(id, tokens, None, Some(plan), highway.into())
    }

    /// [`Self::prefill`] with a token mask: one flag per token, `true` where
    /// masked (DeepSeek-V4.1's `token_mask` with the opposite polarity). A
    /// masked token's gate is 0, so its highway rows come back unchanged,
    /// and the hash treats it as a dead token: later tokens' look-back stops
    /// there. Chunking does not change the outputs. Once a sequence has
    /// absorbed a masked token its block boundaries are no longer cached.
    /// Refused, with nothing changed, when a site's published layer has no
    /// mask ([`EngineError::TokenMaskUnsupported`]) or the mask's length is
    /// not the tokens' ([`EngineError::MaskSize`]).
    pub fn prefill_masked<'h>(
        &mut self,
        id: SeqId,
        tokens: &[u32],
        masked: &[bool],
        highway: impl Into<Highway<'h>>,
    ) -> Result<()> {
        self.prefill_with(id, tokens, Some(masked), None, highway.into())
    }

    fn prefill_with(
        &mut self,
        id: SeqId,
        tokens: &[u32],
        masked: Option<&[bool]>,
        plan: Option<&StepPlans<S::Plan>>,
        mut highway: Highway<'_>,
    ) -> Result<()> {
        self.check_usable(id, "prefill", false)?;
        highway.check("prefill", tokens.len(), self.width)?;
        self.check_tokens("prefill", tokens.iter().copied())?;
        if let Some(m) = masked {
            self.check_mask("prefill", m, tokens.len())?;
        }
        if tokens.is_empty() {
            return Ok(());
        }
        self.ensure_resident(id, &[id])?;
        let caching = self.caches_boundaries();
        let b = self.cfg.block_size;
        let mut done = 0;
        while done < tokens.len() {
            let have = self.seq(id)?.tokens.len();
            let mut n = (tokens.len() - done).min(self.cfg.prefill_chunk);
            if caching {
                n = n.min(b - have % b);
            }
            let rows = highway.rows(done, n, self.width);
            let chunk_masked = masked.map(|m| &m[done..done + n]);
            self.run_one(
                id,
                &tokens[done..done + n],
                chunk_masked,
                plan,
                rows,
                "prefill",
            )?;
            done += n;
            self.stats.prefill_tokens += n as u64;
            if caching && (have + n).is_multiple_of(b) {
                // Caching is an optimisation: a failed snapshot must not fail
                // a prefill whose forward already ran.
                if self.cache_boundary(id).is_err() {
                    self.stats.cache_snapshot_failures += 1;
                }
            }
        }
        Ok(())
    }

    /// One forward of `tokens` (with `masked`, checked by the caller) on
    /// resident sequence `id`, every site in order, running `plan` where it
    /// holds the sequence; appends the tokens. A device failure loses the
    /// carry.
    pub(super) fn run_one(
        &mut self,
        id: SeqId,
        tokens: &[u32],
        masked: Option<&[bool]>,
        plan: Option<&StepPlans<S::Plan>>,
        rows: Highway<'_>,
        op: &str,
    ) -> Result<()> {
        // An all-clear mask is no mask (the layer treats it so too).
        let masked = masked.filter(|m| m.contains(&true));
        let absorbed = self.seq(id)?.tokens.len();
        let part = match (plan, masked) {
            (Some(p), None) => p.part(id, absorbed, tokens)?,
            _ => None,
        };
        let planned = plan.zip(part);
        let mut seq = self.seqs.remove(&id).expect("checked by the caller");
        let r = self.forward_rows(&mut seq, tokens, masked, planned, rows);
        match r {
            Ok(()) => {
                seq.tokens.extend_from_slice(tokens);
                seq.masked |= masked.is_some();
            }
            Err(ref e) => self.lose(id, &mut seq, format!("{op} failed: {}", e.chain())),
        }
        self.seqs.insert(id, seq);
        r
    }

    /// `tokens` of one resident sequence through every site, running part
    /// `planned` of a step plan or, without one, a plan made here against
    /// each site's carry.
    pub(super) fn forward_rows(
        &self,
        seq: &mut Seq<S::State>,
        tokens: &[u32],
        masked: Option<&[bool]>,
        planned: Option<(&StepPlans<S::Plan>, PlanPart)>,
        rows: Highway<'_>,
    ) -> Result<()> {
        let Carry::Resident(states) = &mut seq.carry else {
            return Err(EngineError::Internal(
                "forward of a carry that is not resident",
            ));
        };
        let fresh = seq.tokens.is_empty();
        let gpu = self.gpu.as_ref();
        run_on(gpu, self.highway, self.stream, rows, |hw| {
            for (i, (site, st)) in self.sites.iter().zip(states.iter_mut()).enumerate() {
                let err = |e| {
                    EngineError::site(i, format!("site {i} forward of {} tokens", tokens.len()), e)
                };
                match planned {
                    Some((plan, part)) => {
                        site.run(&plan.sites[i], part, st, hw, fresh, gpu, self.stream)
                    }
                    None => {
                        super::forward_tokens(site, st, tokens, masked, hw, fresh, gpu, self.stream)
                    }
                }
                .map_err(err)?;
            }
            Ok(())
        })
    }

    /// Drop a carry whose state is unknown after a failed device operation.
    /// Its device memory is freed, so its budget charge goes too: a lost
    /// sequence must never be picked for preemption.
    pub(super) fn lose(&mut self, id: SeqId, seq: &mut Seq<S::State>, cause: String) {
        if let Carry::Resident(states) = &mut seq.carry {
            let _ = self.free_states(states);
            self.budget.release(id);
        }
        seq.carry = Carry::Lost(cause);
        seq.pending = None;
    }
    /// Release sequence `id`: free its carry, drop any swap record.
    pub fn release(&mut self, id: SeqId) -> Result<()> {
        let mut seq = self
            .seqs
            .remove(&id)
            .ok_or(EngineError::UnknownSequence(id))?;
        self.budget.release(id);
        match &mut seq.carry {
            Carry::Resident(states) => self.free_states(states),
            Carry::Swapped(Swapped::File(path)) => {
                std::fs::remove_file(&*path).map_err(|source| EngineError::SwapFile {
                    op: "release: removing",
                    path: path.clone(),
                    source,
                })
            }
            _ => Ok(()),
        }
    }
}
