//! The PLE row-reference staging area: where resolved `RowRef`s wait, in
//! device memory, for the gather kernel that reads them.
//!
//! One device allocation (`ple.slots`) holds four parts, in this order:
//! - the *eager* part (`max_tokens * ngram_heads` refs): used by eager
//!   forwards and by `stage` (rows of a plan into a caller's buffer); it is
//!   rewritten by every such call,
//!   which is safe because the copy into it is queued on the same stream after
//!   the previous gather that read it;
//! - the *batch* part (`max_batch * ngram_heads` refs): `prestage_batch` puts
//!   sequence `i` of a decode batch at fixed slot `i`, so a captured decode
//!   graph reads the same addresses on every replay;
//! - the *ring* (`ring_tokens * ngram_heads` refs): every single-sequence
//!   prestage (`gather_host`) takes its own region at the ring cursor, so any
//!   number of sequences (up to `ring_tokens` tokens in all) can be prestaged
//!   before their forwards run;
//! - the *conv table* (`max_batch` u64): the device address of each batch
//!   slot's conv state, read by `conv_batch`, also at fixed addresses.
//!
//! Lease invariants (the table's pins on the rows the refs point at):
//! - a lease is never released at issue time: it is released either with an
//!   event recorded on the stream right after the gather that read its rows,
//!   or, when a region or the batch part is overwritten, with an event recorded
//!   at the stream's tail at that moment (which is after every gather, eager or
//!   replayed, that could still read it);
//! - a prestage that is never consumed (cleared by `restore_aux`, `reset` or
//!   `release_seq_state`) keeps its lease only until its region is reused or
//!   the layer is freed, never forever;
//! - a region or slot whose rows have been gathered eagerly is marked
//!   `Gathered` and cannot be consumed again (its lease may be gone), so a
//!   stray `rearm` after a successful eager forward is an error, not a read of
//!   evicted rows. A slot consumed under capture stays `Captured`, keeps its
//!   lease, and may be consumed again eagerly after `rearm`.
//!
//! Ordering assumption: all work of one layer is issued on one stream (or on
//! streams the caller orders with events); the staging area relies on stream
//! order between the copy that fills a region and the gather that reads it.

use std::collections::{BTreeSet, VecDeque};

use metrale_gpu_runtime::gpu::GpuError;

use super::layer::{LayerError, layer_ensure, table_err};

type Result<T, E = LayerError> = std::result::Result<T, E>;
use metrale_gpu_runtime::gpu::{DevicePtr, GpuBackend, StreamId};
use metrale_storage::table::{Lease, RowRef, RowTable};

/// Bytes of one `RowRef` on the device.
pub(super) const REF_BYTES: usize = std::mem::size_of::<RowRef>();

/// How a staged region or batch slot has been used so far.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum SlotUse {
    /// Filled, not yet read by any forward.
    Pending,
    /// Read by a forward recorded under graph capture (the lease is kept).
    Captured,
    /// Read by an eager forward; its lease may already be released.
    Gathered,
}

/// One single-sequence prestage in the ring.
#[derive(Debug)]
pub(super) struct RingRegion {
    /// First ref index (relative to the ring start).
    pub start: usize,
    /// Number of refs.
    pub len: usize,
    /// Use so far.
    pub state: SlotUse,
    /// Leases on the rows the refs point at.
    pub leases: Vec<Lease>,
    /// The row ids staged (checked against the consumer's history).
    pub ids: Vec<u64>,
}

/// The batch part's bookkeeping.
#[derive(Debug, Default)]
pub(super) struct BatchArea {
    /// Conv-state address of the sequence in each real slot.
    pub owners: Vec<u64>,
    /// Rows prestaged, real and padding (`>= owners.len()`).
    pub rows: usize,
    /// Use of each real slot.
    pub slots: Vec<SlotUse>,
    /// Leases on every row the batch refs point at.
    pub leases: Vec<Lease>,
}

/// Where a prestaged address lives.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum StagedAt {
    /// Index into the ring's region list.
    Ring(usize),
    /// A batch slot.
    Batch(usize),
}

/// The staging area's host-side state; see the module docs.
#[derive(Debug)]
pub(super) struct Staging {
    /// The whole device allocation.
    pub base: DevicePtr,
    /// Refs per token (`ngram_heads`).
    pub heads: usize,
    /// Tokens the eager part holds.
    pub max_tokens: usize,
    /// Slots of the batch part.
    pub max_batch: usize,
    /// Tokens the ring holds.
    pub ring_tokens: usize,
    /// Live ring regions, oldest first.
    pub ring: VecDeque<RingRegion>,
    /// Next free ref index in the ring.
    pub cursor: usize,
    /// The batch part.
    pub batch: BatchArea,
    /// Dummy conv states for padding rows of a batch, one per padding slot.
    pub pad_states: Vec<DevicePtr>,
    /// Streams this layer's work was issued on (synchronised by `free`).
    pub streams: BTreeSet<StreamId>,
}

impl Staging {
    /// Bytes of the whole staging allocation for this geometry.
    pub fn total_bytes(
        heads: usize,
        max_tokens: usize,
        max_batch: usize,
        ring_tokens: usize,
    ) -> usize {
        (max_tokens + max_batch + ring_tokens) * heads * REF_BYTES + max_batch * 8
    }

    /// Device address of ref `i` of the eager part.
    pub fn eager_ref(&self, i: usize) -> DevicePtr {
        self.base.offset(i * REF_BYTES)
    }

    fn batch_start(&self) -> usize {
        self.max_tokens * self.heads
    }

    fn ring_start(&self) -> usize {
        (self.max_tokens + self.max_batch) * self.heads
    }

    /// Device address of batch slot `slot`'s first ref.
    pub fn batch_slot(&self, slot: usize) -> DevicePtr {
        self.base
            .offset((self.batch_start() + slot * self.heads) * REF_BYTES)
    }

    /// Device address of the conv-state table.
    pub fn conv_table(&self) -> DevicePtr {
        self.base
            .offset((self.ring_start() + self.ring_tokens * self.heads) * REF_BYTES)
    }

    fn ring_addr(&self, start: usize) -> DevicePtr {
        self.base.offset((self.ring_start() + start) * REF_BYTES)
    }

    /// Take a ring region of `len` refs, evicting (and releasing the leases
    /// of) every older region it overlaps. Returns the region's address; the
    /// caller fills it and then calls [`Self::ring_commit`].
    pub fn ring_take(
        &mut self,
        len: usize,
        table: &dyn RowTable,
        gpu: &dyn GpuBackend,
        stream: StreamId,
    ) -> Result<(usize, DevicePtr)> {
        let cap = self.ring_tokens * self.heads;
        layer_ensure!(
            len > 0 && len <= cap,
            Usage,
            "PLE prestage of {len} row refs does not fit the staging ring of {cap} refs"
        );
        let start = if self.cursor + len > cap {
            0
        } else {
            self.cursor
        };
        let end = start + len;
        let mut evicted = Vec::new();
        let mut kept = VecDeque::with_capacity(self.ring.len());
        for r in self.ring.drain(..) {
            if r.start < end && start < r.start + r.len {
                evicted.push(r);
            } else {
                kept.push_back(r);
            }
        }
        self.ring = kept;
        for r in evicted {
            release_at_tail(table, gpu, stream, r.leases)?;
        }
        self.cursor = end;
        Ok((start, self.ring_addr(start)))
    }

    /// Record a filled ring region.
    pub fn ring_commit(&mut self, start: usize, ids: &[u64], leases: Vec<Lease>) {
        self.ring.push_back(RingRegion {
            start,
            len: ids.len(),
            state: SlotUse::Pending,
            leases,
            ids: ids.to_vec(),
        });
    }

    /// Find the staged region a sequence's `prestaged_va` names, checking that
    /// it holds `refs` refs, that (for batch slots) it belongs to the sequence
    /// whose conv state is at `owner`, and that its rows were not already
    /// gathered eagerly. For ring regions, whose owner is not recorded,
    /// `expect` gives the ids the consumer's history implies for the heads
    /// it can check (orders below N): a region staged for another token is
    /// refused.
    pub fn lookup(&self, va: u64, refs: usize, owner: u64, expect: &[u64]) -> Result<StagedAt> {
        let bs = self.batch_slot(0).addr();
        let slot_bytes = (self.heads * REF_BYTES) as u64;
        if va >= bs && va < bs + slot_bytes * self.max_batch as u64 {
            layer_ensure!(
                (va - bs).is_multiple_of(slot_bytes),
                Staging,
                "prestaged address {va:#x} is not the start of a batch slot"
            );
            let slot = ((va - bs) / slot_bytes) as usize;
            layer_ensure!(
                refs == self.heads,
                Staging,
                "a batch slot holds one token's rows, not {} tokens'",
                refs / self.heads.max(1)
            );
            layer_ensure!(
                slot < self.batch.owners.len() && self.batch.owners[slot] == owner,
                Staging,
                "batch slot {slot} (address {va:#x}) was prestaged again for another sequence \
                 since this sequence's prestage; prestage it again"
            );
            layer_ensure!(
                self.batch.slots[slot] != SlotUse::Gathered,
                Staging,
                "batch slot {slot} (address {va:#x}) was already gathered by an eager forward; \
                 rearm only applies after a failed capture"
            );
            return Ok(StagedAt::Batch(slot));
        }
        let idx = self
            .ring
            .iter()
            .position(|r| self.ring_addr(r.start).addr() == va)
            .ok_or_else(|| {
                LayerError::Staging(format!(
                    "prestaged address {va:#x} is stale: it names no live staging region (the ring \
                     of {} tokens was reused since the prestage); prestage the token again",
                    self.ring_tokens
                ))
            })?;
        let r = &self.ring[idx];
        layer_ensure!(
            r.len == refs,
            Staging,
            "prestaged region at {va:#x} holds {} row refs, the forward needs {refs}",
            r.len
        );
        layer_ensure!(
            r.state != SlotUse::Gathered,
            Staging,
            "prestaged region at {va:#x} was already gathered by an eager forward; \
             rearm only applies after a failed capture"
        );
        layer_ensure!(
            r.ids.len() >= expect.len() && r.ids[..expect.len()] == *expect,
            Staging,
            "prestaged address {va:#x} is stale: its region was reused for another token's rows \
             (more than {} tokens were prestaged since); prestage the token again",
            self.ring_tokens
        );
        Ok(StagedAt::Ring(idx))
    }

    /// Mark a staged region as read by a captured forward.
    pub fn mark_captured(&mut self, at: StagedAt) {
        match at {
            StagedAt::Ring(i) => self.ring[i].state = SlotUse::Captured,
            StagedAt::Batch(s) => self.batch.slots[s] = SlotUse::Captured,
        }
    }

    /// Mark a staged region as gathered by an eager forward whose gather has
    /// just been queued on `stream`, releasing leases nobody can read any more
    /// with an event recorded now (right after that gather).
    pub fn mark_gathered(
        &mut self,
        at: StagedAt,
        table: &dyn RowTable,
        gpu: &dyn GpuBackend,
        stream: StreamId,
    ) -> Result<()> {
        match at {
            StagedAt::Ring(i) => {
                let r = &mut self.ring[i];
                r.state = SlotUse::Gathered;
                let leases = std::mem::take(&mut r.leases);
                release_at_tail(table, gpu, stream, leases)
            }
            StagedAt::Batch(s) => {
                self.batch.slots[s] = SlotUse::Gathered;
                if self.batch.slots.iter().all(|u| *u == SlotUse::Gathered) {
                    let leases = std::mem::take(&mut self.batch.leases);
                    release_at_tail(table, gpu, stream, leases)
                } else {
                    Ok(())
                }
            }
        }
    }
}

/// Release `leases` once everything queued so far on `stream` has run.
///
/// Leases that pin nothing are released at once. When an event cannot be
/// recorded, the stream is synchronised instead, so pins are never dropped
/// before the gathers that read them.
pub(super) fn release_at_tail(
    table: &dyn RowTable,
    gpu: &dyn GpuBackend,
    stream: StreamId,
    leases: Vec<Lease>,
) -> Result<()> {
    let mut first_err: Option<LayerError> = None;
    let mut synced = false;
    for lease in leases {
        let r = if lease.pinned == 0 {
            table.release(lease, gpu, None)
        } else {
            match record_tail_event(gpu, stream) {
                Ok(ev) => table.release(lease, gpu, Some(ev)),
                Err(e) => {
                    if !synced {
                        if let Err(se) = gpu.synchronize(stream) {
                            first_err.get_or_insert(LayerError::Device {
                                what: format!(
                                    "synchronising stream {stream} to release PLE row leases \
                                     after: {e}"
                                ),
                                error: Box::new(se),
                            });
                        }
                        synced = true;
                    }
                    table.release(lease, gpu, None)
                }
            }
        };
        if let Err(e) = r {
            first_err.get_or_insert(table_err("releasing a PLE row lease")(e));
        }
    }
    match first_err {
        Some(e) => Err(e),
        None => Ok(()),
    }
}

fn record_tail_event(
    gpu: &dyn GpuBackend,
    stream: StreamId,
) -> Result<metrale_gpu_runtime::gpu::EventHandle, GpuError> {
    let ev = gpu.create_event()?;
    if let Err(e) = gpu.record_event(ev, stream) {
        let _ = gpu.destroy_event(ev);
        return Err(e);
    }
    Ok(ev)
}

/// The little-endian device image of `refs`.
pub(super) fn refs_bytes(refs: &[RowRef]) -> Vec<u8> {
    let mut out = Vec::with_capacity(refs.len() * REF_BYTES);
    for r in refs {
        out.extend_from_slice(&r.data.to_le_bytes());
        out.extend_from_slice(&r.scale.to_le_bytes());
    }
    out
}

/// Resolve `ids` through `table`, in parts of at most `max_resolve()`
/// distinct ids each, appending the refs to `out`. Returns every part's
/// lease; on failure the leases already taken are released (nothing was
/// gathered from them) and the error names the part. Every part stays
/// pinned until the caller releases it, so the ids' distinct count must fit
/// `max_pinned()` together with the pins others hold, or the last part
/// waits for a free slot (`prestage_batch` checks the count first; a gather
/// that can release as it goes splits with [`part_end`] instead).
pub(super) fn resolve_all(
    table: &dyn RowTable,
    ids: &[u64],
    out: &mut Vec<RowRef>,
    gpu: &dyn GpuBackend,
) -> Result<Vec<Lease>> {
    let mut leases = Vec::new();
    let base = out.len();
    out.resize(base + ids.len(), RowRef::default());
    let mut start = 0;
    while start < ids.len() {
        let end = part_end(ids, start, table.max_resolve());
        match table.resolve(&ids[start..end], &mut out[base + start..base + end]) {
            Ok(l) => leases.push(l),
            Err(e) => {
                for l in leases {
                    let _ = table.release(l, gpu, None);
                }
                out.truncate(base);
                return Err(table_err(format!(
                    "resolving PLE row ids {start}..{end} of {} (first id {})",
                    ids.len(),
                    ids[start]
                ))(e));
            }
        }
        start = end;
    }
    Ok(leases)
}

/// The end of the part of `ids` starting at `start` that holds at most
/// `max_distinct` distinct ids (at least one id, even if `max_distinct` is 0,
/// so the table reports its own limit).
pub(super) fn part_end(ids: &[u64], start: usize, max_distinct: usize) -> usize {
    if ids.len() - start <= max_distinct {
        return ids.len();
    }
    let mut seen = std::collections::HashSet::new();
    let mut end = start;
    while end < ids.len() {
        if !seen.contains(&ids[end]) {
            if seen.len() == max_distinct.max(1) {
                break;
            }
            seen.insert(ids[end]);
        }
        end += 1;
    }
    end
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn part_end_counts_distinct_ids() {
        let ids = [1, 1, 2, 1, 3, 3, 4];
        assert_eq!(part_end(&ids, 0, 2), 4);
        assert_eq!(part_end(&ids, 4, 2), 7);
        assert_eq!(part_end(&ids, 0, 10), 7);
        assert_eq!(part_end(&ids, 0, 1), 2);
        assert_eq!(part_end(&ids, 0, 0), 2);
    }

    #[test]
    fn refs_image_is_little_endian_pairs() {
        let b = refs_bytes(&[RowRef {
            data: 0x0102,
            scale: 7,
        }]);
        assert_eq!(b.len(), 16);
        assert_eq!(&b[..8], &0x0102u64.to_le_bytes());
        assert_eq!(&b[8..], &7u64.to_le_bytes());
    }
}
