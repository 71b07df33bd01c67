//! Snapshots and the prefix cache: encoded snapshots of a sequence's
//! carry, sequences added from them, and the block-boundary snapshots the
//! prefix cache keeps.
//!
//! Invariants: a snapshot is validated (container, geometry, token count,
//! carried history) before any state is built; block-boundary caching is an
//! optimisation, so its failures fail nothing.

use std::sync::Arc;

use metrale_model_layers::layers::ple::carry_blob;

use super::{Carry, Engine, EngineError, Result, Seq, SeqId, Site};
use crate::snapshot::Snapshot;

impl<S: Site> Engine<S> {
    /// Add a sequence whose carry is the encoded snapshot `bytes`, taken
    /// after `tokens`. Refused, with nothing changed, when the snapshot does
    /// not decode, belongs to another geometry or another token count.
    pub fn add_from_snapshot(&mut self, bytes: &[u8], tokens: &[u32]) -> Result<SeqId> {
        let snap = Snapshot::decode_for(bytes, &self.geoms)?;
        if snap.token_count != tokens.len() as u64 {
            return Err(EngineError::TokenCount {
                snapshot: snap.token_count,
                given: tokens.len(),
            });
        }
        for (site, (g, blob)) in self.geoms.iter().zip(&snap.blobs).enumerate() {
            // The carried history is the last `context_len` tokens of the
            // EOS-filled start followed by the tokens: check it agrees.
            let ctx = g.dims.context_len();
            let mut window = vec![g.dims.eos_token_id; ctx];
            window.extend_from_slice(&tokens[tokens.len().saturating_sub(ctx)..]);
            let want = &window[window.len() - ctx..];
            // `decode_for` checked every blob against its site.
            let have = carry_blob::decode(blob, g)
                .map(|b| b.history_tokens())
                .unwrap_or_default();
            if have != want {
                return Err(EngineError::HistoryMismatch {
                    site,
                    snapshot: have,
                    tokens: want.to_vec(),
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

    pub(super) fn cache_boundary(&mut self, id: SeqId) -> Result<()> {
        let s = self.seq(id)?;
        if self.cache.contains(&s.tokens) {
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
        // A snapshot larger than the whole cache is simply not cached.
        let _ = self.cache.insert(&key, Arc::new(snap), bytes);
        Ok(())
    }

    /// Drop every prefix-cache entry.
    pub fn clear_prefix_cache(&mut self) {
        self.cache.clear();
    }
}
