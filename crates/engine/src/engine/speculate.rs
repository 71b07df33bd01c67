//! Speculation: `verify` runs a draft and keeps the carry from before it;
//! `commit(k)` keeps the first `k` draft tokens.
//!
//! Invariants: `tokens` holds committed tokens only while a verify is
//! pending (the draft lives in the pending record); after `commit(k)` the
//! carry is exactly that of `tokens ++ draft[..k]`, rebuilt by restoring the
//! pre-draft carry and re-running the accepted tokens from their saved rows.

use super::rows::Highway;
use super::{Carry, Engine, EngineError, Pending, Result, SeqId, Site};

impl<S: Site> Engine<S> {
    /// Speculative verify: run `draft` through sequence `id` and return, in
    /// `highway`, the output rows of every draft position (host rows, or
    /// rows on the device run in place, see [`Highway`]). The carry from
    /// before is kept until [`Self::commit`] says how many tokens stay; so
    /// are the draft's input rows, on the host (device rows are read back
    /// once for them).
    pub fn verify<'h>(
        &mut self,
        id: SeqId,
        draft: &[u32],
        highway: impl Into<Highway<'h>>,
    ) -> Result<()> {
        let mut highway = highway.into();
        self.check_usable(id, "verify", false)?;
        highway.check("verify", draft.len(), self.width)?;
        self.check_tokens("verify", draft.iter().copied())?;
        self.ensure_resident(id, &[id])?;
        let before = {
            let s = self.seq(id)?;
            match &s.carry {
                Carry::Resident(states) if !s.tokens.is_empty() => {
                    Some(self.snapshot_states(states)?)
                }
                _ => None,
            }
        };
        let rows_in = highway.to_host(draft.len(), self.width, self.gpu.as_ref(), self.stream)?;
        let start = self.seq(id)?.tokens.len();
        let mut done = 0;
        while done < draft.len() {
            let n = (draft.len() - done).min(self.max_rows);
            let rows = highway.rows(done, n, self.width);
            self.run_one(id, &draft[done..done + n], None, None, rows, "verify")?;
            done += n;
        }
        let s = self.seqs.get_mut(&id).expect("present");
        // `tokens` holds the committed tokens only; the draft lives in the
        // pending record until the commit.
        s.tokens.truncate(start);
        s.pending = Some(Pending {
            before,
            draft: draft.to_vec(),
            rows_in,
        });
        self.stats.verifies += 1;
        Ok(())
    }

    /// Keep the first `accepted` tokens of the pending draft of `id`: the
    /// carry becomes exactly that of `tokens ++ draft[..accepted]`.
    pub fn commit(&mut self, id: SeqId, accepted: usize) -> Result<()> {
        self.check_usable(id, "commit", true)?;
        let drafted = match &self.seq(id)?.pending {
            Some(p) => p.draft.len(),
            None => return Err(EngineError::NoPendingVerify(id)),
        };
        if accepted > drafted {
            return Err(EngineError::TooManyAccepted {
                seq: id,
                accepted,
                drafted,
            });
        }
        self.stats.accepted_tokens += accepted as u64;
        self.stats.rejected_tokens += (drafted - accepted) as u64;
        if accepted == drafted && self.is_resident(id)? {
            let s = self.seqs.get_mut(&id).expect("present");
            let p = s.pending.take().expect("checked");
            s.tokens.extend_from_slice(&p.draft);
            return Ok(());
        }
        let p = {
            let s = self.seqs.get_mut(&id).expect("present");
            s.pending.take().expect("checked")
        };
        if accepted == drafted {
            // Swapped since the verify: the swapped carry already holds all
            // of the draft.
            self.seqs
                .get_mut(&id)
                .expect("present")
                .tokens
                .extend_from_slice(&p.draft);
            return Ok(());
        }
        self.ensure_resident(id, &[id])?;
        let restored = {
            let mut seq = self.seqs.remove(&id).expect("present");
            let Carry::Resident(states) = &mut seq.carry else {
                unreachable!("made resident")
            };
            let r = match &p.before {
                Some(blobs) => self.restore_states(states, blobs),
                None => Ok(()),
            };
            if let Err(e) = &r {
                self.lose(
                    id,
                    &mut seq,
                    format!("commit could not restore the carry: {}", e.chain()),
                );
            }
            self.seqs.insert(id, seq);
            r
        };
        restored?;
        if accepted > 0 {
            let mut rows = p.rows_in[..accepted * self.width].to_vec();
            let mut done = 0;
            if p.before.is_none() {
                // The sequence had run nothing: the re-run starts it fresh.
                self.seqs.get_mut(&id).expect("present").tokens.clear();
            }
            while done < accepted {
                let n = (accepted - done).min(self.max_rows);
                let r = Highway::Host(&mut rows[done * self.width..(done + n) * self.width]);
                self.run_one(id, &p.draft[done..done + n], None, None, r, "commit")?;
                done += n;
            }
        }
        // With nothing accepted into a sequence that had run nothing, its
        // token list stays empty, so its next forward passes `fresh` and
        // resets every site: the rejected draft leaves no trace.
        Ok(())
    }
}
