//! Snapshots and the prefix cache: encoded snapshots of a sequence's
//! carry, sequences added from them, the block-boundary snapshots the
//! prefix cache keeps, and the shared carry store behind it
//! ([`crate::store`]).
//!
//! A new sequence restores the longest block-aligned prefix of its prompt
//! found in the prefix cache; when a store is attached and the cache has
//! nothing as long, the store is probed at block boundaries from the
//! longest down (at most [`TierConfig::max_probes`] of them, and never
//! shorter than the cache's hit). Block-boundary snapshots are written to
//! the store behind the step, through the tier's bounded queue.
//!
//! Invariants: a snapshot is validated (container, geometry, token count,
//! carried history) before any state is built; block-boundary caching and
//! the store are optimisations, so their failures fail nothing: a store
//! value that is missing, corrupt, of another geometry or another model is
//! a miss counted by cause, and the sequence starts from what the cache
//! had (or from nothing).

use std::sync::Arc;
use std::time::Instant;

use metrale_model_layers::layers::ple::carry_blob;

use super::{Carry, Engine, EngineError, Result, Seq, SeqId, Site};
use crate::snapshot::Snapshot;
use crate::store::{CarryStore, CarryTier, MissCause, StoreError, StoreKey, TierConfig};

impl<S: Site> Engine<S> {
    /// Add a sequence whose carry is the encoded snapshot `bytes`, taken
    /// after `tokens`. Refused, with nothing changed, when the snapshot does
    /// not decode, belongs to another geometry or another token count, or
    /// its carried history is not that of `tokens` (as after a masked token
    /// in the history's reach: use [`Self::add_from_snapshot_masked`]).
    pub fn add_from_snapshot(&mut self, bytes: &[u8], tokens: &[u32]) -> Result<SeqId> {
        self.check_tokens("add_from_snapshot", tokens.iter().copied())?;
        self.add_snapshot_checked(bytes, tokens, None)
    }

    /// [`Self::add_from_snapshot`] for a snapshot of a sequence that ran
    /// `tokens` with the token mask `masked` (one flag per token): the
    /// carried history must read the pad id at and before the last masked
    /// token, as the layer leaves it. The new sequence's boundaries are not
    /// cached when a flag is set. Refused as a mask is by
    /// [`Self::prefill_masked`].
    pub fn add_from_snapshot_masked(
        &mut self,
        bytes: &[u8],
        tokens: &[u32],
        masked: &[bool],
    ) -> Result<SeqId> {
        self.check_tokens("add_from_snapshot", tokens.iter().copied())?;
        self.check_mask("add_from_snapshot", masked, tokens.len())?;
        self.add_snapshot_checked(bytes, tokens, Some(masked))
    }

    fn add_snapshot_checked(
        &mut self,
        bytes: &[u8],
        tokens: &[u32],
        masked: Option<&[bool]>,
    ) -> Result<SeqId> {
        let snap = Snapshot::decode_for(bytes, &self.geoms)?;
        if snap.token_count != tokens.len() as u64 {
            return Err(EngineError::TokenCount {
                snapshot: snap.token_count,
                given: tokens.len(),
            });
        }
        let last_masked = masked.and_then(|m| m.iter().rposition(|&f| f));
        for (site, (g, blob)) in self.geoms.iter().zip(&snap.blobs).enumerate() {
            // The carried history is the last `context_len` tokens of the
            // EOS-filled start followed by the tokens: check it agrees.
            let mut want = vec![g.dims.eos_token_id; g.dims.context_len()];
            g.dims.advance_history(&mut want, tokens);
            if let Some(last) = last_masked {
                // The fill at and before the last masked token (docs/SPEC.md
                // §11): `after` tokens came after it.
                let after = tokens.len() - 1 - last;
                let upto = want.len().saturating_sub(after);
                want[..upto].fill(g.dims.eos_token_id);
            }
            // `decode_for` checked every blob against its site.
            let have = carry_blob::decode(blob, g)
                .map(|b| b.history_tokens())
                .unwrap_or_default();
            if have != want {
                return Err(EngineError::HistoryMismatch {
                    site,
                    snapshot: have,
                    tokens: want,
                });
            }
        }
        let id = self.next_id;
        let states = self.states_from(id, &snap.blobs, &[])?;
        self.next_id += 1;
        self.seqs.insert(
            id,
            Seq {
                tokens: tokens.to_vec(),
                masked: last_masked.is_some(),
                carry: Carry::Resident(states),
                pending: None,
            },
        );
        Ok(id)
    }

    /// The encoded snapshot of sequence `id`'s carry (swapping it in if
    /// needed). A sequence that has run no token has no carry to snapshot.
    pub fn snapshot(&mut self, id: SeqId) -> Result<Vec<u8>> {
        self.check_usable(id, "snapshot", false)?;
        if self.seq(id)?.tokens.is_empty() {
            return Err(EngineError::NoTokens(id));
        }
        self.ensure_resident(id, &[id])?;
        let s = self.seq(id)?;
        let Carry::Resident(states) = &s.carry else {
            unreachable!("made resident above")
        };
        let blobs = self.snapshot_states(states)?;
        Ok(Snapshot {
            fingerprint: self.fingerprint,
            token_count: s.tokens.len() as u64,
            blobs,
        }
        .encode())
    }

    /// Whether block boundaries are snapshotted at all: into the local
    /// prefix cache, the shared carry store, or both. Prefill and decode
    /// both ask this, so generated tokens reach every tier prompt tokens do.
    pub(super) fn caches_boundaries(&self) -> bool {
        self.cfg.prefix_cache_bytes > 0 || self.shared.is_some()
    }

    /// Snapshot sequence `id`'s carry at a block boundary into the prefix
    /// cache and the store, unless they hold it already. A sequence that has
    /// absorbed a masked token is skipped: both key carries by tokens alone,
    /// and its carry is not the carry of its tokens.
    pub(super) fn cache_boundary(&mut self, id: SeqId) -> Result<()> {
        let s = self.seq(id)?;
        if s.masked {
            self.stats.masked_boundaries_skipped += 1;
            return Ok(());
        }
        let local = self.cfg.prefix_cache_bytes > 0 && !self.cache.contains(&s.tokens);
        let store_key = self.shared.as_ref().and_then(|t| {
            let k = StoreKey::of(t.model(), self.fingerprint, &s.tokens);
            t.wants(&k).then_some(k)
        });
        if !local && store_key.is_none() {
            return Ok(());
        }
        let Carry::Resident(states) = &s.carry else {
            return Ok(());
        };
        let blobs = self.snapshot_states(states)?;
        let snap = Snapshot {
            fingerprint: self.fingerprint,
            token_count: s.tokens.len() as u64,
            blobs,
        };
        let bytes = snap.encoded_len();
        let key = s.tokens.clone();
        if let (Some(k), Some(t)) = (store_key, self.shared.as_mut()) {
            // Queued, never waited for: a full queue drops it.
            t.offer(k, &snap);
        }
        if local {
            // A snapshot larger than the whole cache is simply not cached.
            let _ = self.cache.insert(&key, Arc::new(snap), bytes);
        }
        Ok(())
    }

    /// Put a shared carry store behind the prefix cache: prefixes the cache
    /// misses are looked up there, and block-boundary snapshots are written
    /// there in the background. Values are keyed by `cfg.model_id`, this
    /// engine's geometry fingerprint and the token prefix. Replaces any
    /// store attached before (its queued writes are finished first).
    pub fn attach_carry_store(
        &mut self,
        store: Arc<dyn CarryStore>,
        cfg: TierConfig,
    ) -> std::result::Result<(), StoreError> {
        let tier = CarryTier::new(store, cfg)?;
        if let Some(old) = self.shared.replace(tier) {
            old.flush(old.config().flush_timeout);
        }
        Ok(())
    }

    /// Wait up to `timeout` for the store writes queued so far. `true` when
    /// they finished (or no store is attached).
    pub fn flush_carry_store(&self, timeout: std::time::Duration) -> bool {
        self.shared.as_ref().is_none_or(|t| t.flush(timeout))
    }

    /// The longest usable prefix of `prompt` (at least one token is left
    /// to compute): the prefix cache's hit, or a longer one from the store.
    /// The third field is the stored value's size when it came from the store.
    fn lookup_prefix(&mut self, prompt: &[u32]) -> Option<(usize, Arc<Snapshot>, Option<usize>)> {
        if prompt.len() <= 1 {
            return None;
        }
        let head = &prompt[..prompt.len() - 1];
        let local = if self.cfg.prefix_cache_bytes > 0 {
            self.cache.lookup(head)
        } else {
            None
        };
        let have = local.as_ref().map_or(0, |(n, _)| *n);
        let Some(tier) = &self.shared else {
            return local.map(|(n, s)| (n, s, None));
        };
        let b = self.cfg.block_size;
        let mut k = head.len() / b * b;
        let mut probes = 0;
        while k > have && probes < tier.config().max_probes {
            probes += 1;
            let key = StoreKey::of(tier.model(), self.fingerprint, &prompt[..k]);
            let got = tier.fetch(&key, &self.geoms, &prompt[..k]);
            if let Err(MissCause::Error(_)) = got {
                // A store that cannot answer one probe will not answer the
                // next: go on with what the cache had.
                break;
            }
            if let Ok((snap, bytes)) = got {
                let snap = Arc::new(snap);
                if let Some(t) = self.shared.as_mut() {
                    t.remember(key);
                }
                if self.cfg.prefix_cache_bytes > 0 {
                    let len = snap.encoded_len();
                    let _ = self.cache.insert(&prompt[..k], snap.clone(), len);
                }
                return Some((k, snap, Some(bytes)));
            }
            k -= b;
        }
        local.map(|(n, s)| (n, s, None))
    }

    /// Fresh states for new sequence `id`, holding the longest usable
    /// cached or stored prefix of `prompt`: `(tokens restored, states)`.
    pub(super) fn restore_prefix(
        &mut self,
        id: SeqId,
        prompt: &[u32],
    ) -> Result<(usize, Vec<S::State>)> {
        let t0 = Instant::now();
        match self.lookup_prefix(prompt) {
            Some((len, snap, stored)) => {
                let states = self.states_from(id, &snap.blobs, &[])?;
                if let (Some(bytes), Some(t)) = (stored, &self.shared) {
                    // Probes, get, checks and the restore itself.
                    t.note_restore(len, bytes, t0.elapsed());
                }
                Ok((len, states))
            }
            None => Ok((0, self.alloc_states(id, &[])?)),
        }
    }

    /// Drop every prefix-cache entry.
    pub fn clear_prefix_cache(&mut self) {
        self.cache.clear();
    }
}
