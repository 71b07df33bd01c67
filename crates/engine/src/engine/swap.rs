//! Swap: a resident carry out to host memory (the sites' aux blobs as they
//! came) or to a file (an encoded snapshot), and back.
//!
//! Invariants: a swap-out frees the device states only after the blobs are
//! safe in their place; a swap-in builds new states and installs them only
//! when everything succeeded, so on failure the sequence stays swapped out,
//! its blobs or file untouched. Host blobs never leave the process and were
//! made by this engine's sites, so they skip the snapshot container (its
//! CRC and geometry check guard bytes from outside: a file).

use super::{Carry, Engine, EngineError, Place, Result, SeqId, Site, SwapTarget, Swapped};
use crate::snapshot::Snapshot;

impl<S: Site> Engine<S> {
    /// Swap sequence `id`'s carry out to `target`, freeing its device
    /// memory. Refused for a sequence that is not resident.
    pub fn swap_out(&mut self, id: SeqId, target: SwapTarget) -> Result<()> {
        let s = self.seq(id)?;
        let place = match &s.carry {
            Carry::Resident(_) => None,
            Carry::Swapped(_) => Some(Place::Swapped),
            Carry::Lost(_) => Some(Place::Lost),
        };
        if let Some(place) = place {
            return Err(EngineError::WrongPlace {
                op: "swap_out",
                seq: id,
                place,
            });
        }
        if target == SwapTarget::File && self.cfg.swap_dir.is_none() {
            return Err(EngineError::NoSwapDir);
        }
        let place = if s.tokens.is_empty() && s.pending.is_none() {
            Swapped::Empty
        } else {
            let Carry::Resident(states) = &s.carry else {
                unreachable!()
            };
            let blobs = self.snapshot_states(states)?;
            match target {
                SwapTarget::Host => Swapped::Host(blobs),
                SwapTarget::File => {
                    // A pending verify's draft is in the carry too.
                    let absorbed = s.tokens.len() + s.pending.as_ref().map_or(0, |p| p.draft.len());
                    let bytes = Snapshot {
                        fingerprint: self.fingerprint,
                        token_count: absorbed as u64,
                        blobs,
                    }
                    .encode();
                    let dir = self.cfg.swap_dir.as_ref().expect("checked");
                    let path = dir.join(format!(
                        "metrale-{}-{}-seq-{id}.mplesnap",
                        std::process::id(),
                        self.instance
                    ));
                    std::fs::write(&path, &bytes).map_err(|source| EngineError::SwapFile {
                        op: "swap_out: writing",
                        path: path.clone(),
                        source,
                    })?;
                    Swapped::File(path)
                }
            }
        };
        let mut seq = self.seqs.remove(&id).expect("present");
        let Carry::Resident(mut states) = std::mem::replace(&mut seq.carry, Carry::Swapped(place))
        else {
            unreachable!()
        };
        self.seqs.insert(id, seq);
        self.budget.release(id);
        self.stats.swap_outs += 1;
        // The snapshot is safe in `place`; a failed free leaks device memory
        // but not the sequence.
        self.free_states(&mut states)
    }

    /// Swap sequence `id`'s carry back onto the device, preempting others if
    /// the budget needs it. Refused for a resident sequence; on failure the
    /// sequence stays swapped out.
    pub fn swap_in(&mut self, id: SeqId) -> Result<()> {
        self.swap_in_protected(id, &[id])
    }

    pub(super) fn swap_in_protected(&mut self, id: SeqId, protect: &[SeqId]) -> Result<()> {
        let s = self.seq(id)?;
        let place = match &s.carry {
            Carry::Resident(_) => Some(Place::Resident),
            Carry::Swapped(_) => None,
            Carry::Lost(_) => Some(Place::Lost),
        };
        if let Some(place) = place {
            return Err(EngineError::WrongPlace {
                op: "swap_in",
                seq: id,
                place,
            });
        }
        let mut protect = protect.to_vec();
        protect.push(id);
        // Borrowing the host blobs from the sequence while the states are
        // built (which needs `&mut self`) would take a copy of them; the
        // place is moved out instead and put back on failure. Nothing in
        // between reads this sequence's carry (it is protected from
        // preemption); should a panic cut this short, the placeholder
        // refuses the sequence rather than restarting it from nothing.
        let seq = self.seqs.get_mut(&id).expect("present");
        let interrupted = Carry::Lost("its swap-in was interrupted".into());
        let Carry::Swapped(place) = std::mem::replace(&mut seq.carry, interrupted) else {
            unreachable!()
        };
        let built = self.states_for(id, &place, &protect);
        let seq = self.seqs.get_mut(&id).expect("present");
        match built {
            Ok(states) => seq.carry = Carry::Resident(states),
            Err(e) => {
                seq.carry = Carry::Swapped(place);
                return Err(e);
            }
        }
        if let Swapped::File(path) = place {
            let _ = std::fs::remove_file(path);
        }
        self.stats.swap_ins += 1;
        Ok(())
    }

    /// New device states holding what `place` kept for sequence `id`.
    fn states_for(
        &mut self,
        id: SeqId,
        place: &Swapped,
        protect: &[SeqId],
    ) -> Result<Vec<S::State>> {
        match place {
            Swapped::Empty => self.alloc_states(id, protect),
            Swapped::Host(blobs) => self.states_from(id, blobs, protect),
            Swapped::File(path) => {
                let bytes = std::fs::read(path).map_err(|source| EngineError::SwapFile {
                    op: "swap_in: reading",
                    path: path.clone(),
                    source,
                })?;
                let snap = Snapshot::decode_for(&bytes, &self.geoms).map_err(|source| {
                    EngineError::SwapFileSnapshot {
                        path: path.clone(),
                        source,
                    }
                })?;
                self.states_from(id, &snap.blobs, protect)
            }
        }
    }
}
