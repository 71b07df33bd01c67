//! Swap: a resident carry out to host memory or a file as an encoded
//! snapshot, and back.
//!
//! Invariants: a swap-out frees the device states only after the snapshot
//! is safe in its place; a swap-in builds new states and installs them only
//! when everything succeeded, so on failure the sequence stays swapped out.

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
            // A pending verify's draft is in the carry too.
            let absorbed = s.tokens.len() + s.pending.as_ref().map_or(0, |p| p.draft.len());
            let bytes = Snapshot {
                fingerprint: self.fingerprint,
                token_count: absorbed as u64,
                blobs,
            }
            .encode();
            match target {
                SwapTarget::Host => Swapped::Host(bytes),
                SwapTarget::File => {
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
        let Carry::Swapped(place) = &s.carry else {
            unreachable!()
        };
        let blobs = match place {
            Swapped::Empty => None,
            Swapped::Host(bytes) => Some(Snapshot::decode_for(bytes, &self.geoms)?.blobs),
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
                Some(snap.blobs)
            }
        };
        let mut protect = protect.to_vec();
        protect.push(id);
        let states = match &blobs {
            Some(b) => self.states_from(id, b, &protect)?,
            None => self.alloc_states(id, &protect)?,
        };
        let seq = self.seqs.get_mut(&id).expect("present");
        let old = std::mem::replace(&mut seq.carry, Carry::Resident(states));
        if let Carry::Swapped(Swapped::File(path)) = old {
            let _ = std::fs::remove_file(path);
        }
        self.stats.swap_ins += 1;
        Ok(())
    }
}
