//! One table over several: LongCat's sub-tables as the single row table
//! the layer reads.
//!
//! LongCat stores one tensor per (order, split) sub-table, each with its
//! own row count (`m + 2i + 1`), so no shard set of equal shapes holds
//! them. The hash already adds each sub-table's offset (the running sum of
//! the sizes before it) to its ids, so the ids address the concatenation
//! of the sub-tables. [`ConcatTable`] serves exactly that: id `x` with
//! `start[i] <= x < start[i] + rows[i]` is row `x - start[i]` of part `i`.
//! Each part is a table of its own (resident, mapped, shared or cached,
//! folded when cut, see [`crate::idmap`]), so nothing about a part's
//! storage changes; [`crate::spec::open`] builds one from a description
//! with several parts.
//!
//! Invariants: `info().rows` is the sum of the parts' rows; every part has
//! the same row width and dtype; an id at or past the end is refused as a
//! plain table refuses it; a failed resolve holds no pins (the parts
//! resolved before the failure are released at once, no gather having read
//! them). A lease's pins in every part are released with the caller's
//! event: one pinning part takes that event itself; when several do, the
//! others get events recorded on a side stream that first waits for it, so
//! no part unpins before the gather has run and nothing blocks the host
//! (should the side stream fail, the release waits for the event on the
//! host instead).

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use metrale_gpu_runtime::gpu::{EventHandle, GpuBackend, StreamId};

use crate::error::{Result, StorageError};
use crate::table::{Lease, RowRef, RowTable, TableInfo, TableStats, check_out_len};

/// A [`RowTable`] whose rows are those of its parts, one after another.
pub struct ConcatTable {
    parts: Vec<Arc<dyn RowTable>>,
    /// The backend the parts serve, for unpinning after a failed resolve.
    gpu: Arc<dyn GpuBackend>,
    /// First id of each part.
    starts: Vec<u64>,
    info: TableInfo,
    /// Leases that pin rows, by this table's lease id.
    leases: Mutex<HashMap<u64, Vec<(usize, Lease)>>>,
    next_lease: AtomicU64,
    /// The stream that turns one release event into one per part, made on
    /// first need.
    side: Mutex<Option<StreamId>>,
}

impl ConcatTable {
    /// The concatenation of `parts`, in order, served to `gpu`.
    pub fn new(parts: Vec<Arc<dyn RowTable>>, gpu: Arc<dyn GpuBackend>) -> Result<Self> {
        let Some(first) = parts.first() else {
            return Err(StorageError::invalid("a concatenated table needs a part"));
        };
        let first = first.info();
        let mut starts = Vec::with_capacity(parts.len());
        let mut rows = 0u64;
        for (i, p) in parts.iter().enumerate() {
            let info = p.info();
            if info.head_dim != first.head_dim || info.dtype != first.dtype {
                return Err(StorageError::invalid(format!(
                    "part {i} of a concatenated table has rows of {} {:?} values, part 0 of {} \
                     {:?}",
                    info.head_dim, info.dtype, first.head_dim, first.dtype
                )));
            }
            starts.push(rows);
            rows = rows.checked_add(info.rows).ok_or_else(|| {
                StorageError::invalid("the parts of a concatenated table overflow u64 rows")
            })?;
        }
        Ok(ConcatTable {
            parts,
            gpu,
            starts,
            info: TableInfo { rows, ..first },
            leases: Mutex::new(HashMap::new()),
            next_lease: AtomicU64::new(1),
            side: Mutex::new(None),
        })
    }

    /// The parts, in id order.
    pub fn parts(&self) -> &[Arc<dyn RowTable>] {
        &self.parts
    }

    /// The live pinning leases (a panic elsewhere leaves the map whole, so
    /// a poisoned lock is taken as is).
    fn held(&self) -> MutexGuard<'_, HashMap<u64, Vec<(usize, Lease)>>> {
        self.leases.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The part holding `id` and the row inside it.
    fn locate(&self, id: u64) -> Result<(usize, u64)> {
        if id >= self.info.rows {
            return Err(StorageError::RowOutOfRange {
                id,
                rows: self.info.rows,
            });
        }
        let p = self.starts.partition_point(|&s| s <= id) - 1;
        Ok((p, id - self.starts[p]))
    }

    /// `ids` split by part: for each part, the positions in `ids` of the
    /// ids it holds and their rows within it.
    fn by_part(&self, ids: &[u64]) -> Result<Vec<(Vec<usize>, Vec<u64>)>> {
        let mut by_part: Vec<(Vec<usize>, Vec<u64>)> = vec![Default::default(); self.parts.len()];
        for (i, &id) in ids.iter().enumerate() {
            let (p, row) = self.locate(id)?;
            by_part[p].0.push(i);
            by_part[p].1.push(row);
        }
        Ok(by_part)
    }

    /// `ev` and `n - 1` events that complete after it: recorded on the side
    /// stream once it has waited for `ev`.
    fn fan_out(&self, gpu: &dyn GpuBackend, ev: EventHandle, n: usize) -> Result<Vec<EventHandle>> {
        let mut side = self.side.lock().unwrap_or_else(|e| e.into_inner());
        let stream = match *side {
            Some(s) => s,
            None => {
                let s = self.gpu.create_stream()?;
                *side = Some(s);
                s
            }
        };
        gpu.stream_wait_event(stream, ev)?;
        let mut out = vec![ev];
        for _ in 1..n {
            let e = gpu.create_event()?;
            let recorded = gpu.record_event(e, stream);
            out.push(e);
            if let Err(err) = recorded {
                for &e in &out[1..] {
                    let _ = gpu.destroy_event(e);
                }
                return Err(err.into());
            }
        }
        Ok(out)
    }

    fn release_parts(
        &self,
        held: Vec<(usize, Lease)>,
        gpu: &dyn GpuBackend,
        after: Option<EventHandle>,
    ) -> Result<()> {
        let pinned = held.iter().filter(|(_, l)| l.pinned > 0).count();
        // One event for each pinning part (nothing waits for the others).
        let mut events: Vec<EventHandle> = match after {
            Some(ev) if pinned > 1 => match self.fan_out(gpu, ev, pinned) {
                Ok(v) => v,
                Err(_) => {
                    // No side stream: unpin once the gather has run, waiting
                    // for it here.
                    gpu.event_synchronize(ev)?;
                    gpu.destroy_event(ev)?;
                    Vec::new()
                }
            },
            Some(ev) if pinned == 1 => vec![ev],
            Some(ev) => {
                gpu.destroy_event(ev)?;
                Vec::new()
            }
            None => Vec::new(),
        };
        let mut first_err = None;
        for (p, lease) in held {
            let ev = if lease.pinned > 0 { events.pop() } else { None };
            if let Err(e) = self.parts[p].release(lease, gpu, ev) {
                first_err.get_or_insert(e);
            }
        }
        first_err.map_or(Ok(()), Err)
    }
}

impl Drop for ConcatTable {
    fn drop(&mut self) {
        let side = self.side.get_mut().unwrap_or_else(|e| e.into_inner());
        if let Some(s) = side.take() {
            let _ = self.gpu.destroy_stream(s);
        }
    }
}

impl RowTable for ConcatTable {
    fn info(&self) -> TableInfo {
        self.info
    }

    fn max_resolve(&self) -> usize {
        // Every id of a batch may fall in one part.
        self.parts
            .iter()
            .map(|p| p.max_resolve())
            .min()
            .unwrap_or(0)
    }

    fn max_pinned(&self) -> usize {
        self.parts.iter().map(|p| p.max_pinned()).min().unwrap_or(0)
    }

    fn would_wait(&self, ids: &[u64]) -> bool {
        // An id out of range is the resolve's to refuse.
        self.by_part(ids).map_or(true, |by_part| {
            self.parts
                .iter()
                .zip(&by_part)
                .any(|(p, (_, rows))| !rows.is_empty() && p.would_wait(rows))
        })
    }

    fn resolve(&self, ids: &[u64], out: &mut [RowRef]) -> Result<Lease> {
        check_out_len(ids, out)?;
        let by_part = self.by_part(ids)?;
        let mut held: Vec<(usize, Lease)> = Vec::new();
        let mut refs = Vec::new();
        for (p, (slots, rows)) in by_part.iter().enumerate() {
            if rows.is_empty() {
                continue;
            }
            refs.clear();
            refs.resize(rows.len(), RowRef::default());
            match self.parts[p].resolve(rows, &mut refs) {
                Ok(lease) => held.push((p, lease)),
                Err(e) => {
                    // Nothing has read these rows: unpin them now.
                    let _ = self.release_parts(held, self.gpu.as_ref(), None);
                    return Err(e);
                }
            }
            for (&slot, r) in slots.iter().zip(&refs) {
                out[slot] = *r;
            }
        }
        let pinned: usize = held.iter().map(|(_, l)| l.pinned).sum();
        // Only leases that are nothing at all may be dropped; any other is
        // the part's to take back.
        if held.iter().all(|(_, l)| l.pinned == 0 && l.id == 0) {
            return Ok(Lease::empty());
        }
        let id = self.next_lease.fetch_add(1, Ordering::Relaxed);
        self.held().insert(id, held);
        Ok(Lease { id, pinned })
    }

    fn release(
        &self,
        lease: Lease,
        gpu: &dyn GpuBackend,
        after: Option<EventHandle>,
    ) -> Result<()> {
        if lease.pinned == 0 && lease.id == 0 {
            if let Some(ev) = after {
                gpu.destroy_event(ev)?;
            }
            return Ok(());
        }
        let held = self
            .held()
            .remove(&lease.id)
            .ok_or(StorageError::UnknownLease {
                lease: lease.id,
                why: "not a live lease of this concatenated table",
            })?;
        self.release_parts(held, gpu, after)
    }

    fn prefetch(&self, ids: &[u64]) -> Result<()> {
        let mut by_part: Vec<Vec<u64>> = vec![Vec::new(); self.parts.len()];
        // Prefetch is advisory: ids past the end are left to resolve.
        for (p, row) in ids.iter().filter_map(|&id| self.locate(id).ok()) {
            by_part[p].push(row);
        }
        for (p, rows) in by_part.iter().enumerate() {
            if !rows.is_empty() {
                self.parts[p].prefetch(rows)?;
            }
        }
        Ok(())
    }

    fn stats(&self) -> TableStats {
        self.parts
            .iter()
            .fold(TableStats::default(), |t, p| t + p.stats())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::table::RowDType;
    use metrale_gpu_runtime::cpu::CpuBackend;

    /// Rows at fake addresses `base + id`; pins every row when `pins`.
    struct Fake {
        rows: u64,
        base: u64,
        pins: bool,
        fail: bool,
        live: Mutex<u64>,
    }
    impl Fake {
        fn new(rows: u64, base: u64, pins: bool) -> Arc<Self> {
            Arc::new(Fake {
                rows,
                base,
                pins,
                fail: false,
                live: Mutex::new(0),
            })
        }
        fn live(&self) -> u64 {
            *self.live.lock().unwrap()
        }
    }
    impl RowTable for Fake {
        fn info(&self) -> TableInfo {
            TableInfo {
                rows: self.rows,
                head_dim: 4,
                dtype: RowDType::Bf16,
            }
        }
        fn max_resolve(&self) -> usize {
            8 + self.rows as usize
        }
        fn resolve(&self, ids: &[u64], out: &mut [RowRef]) -> Result<Lease> {
            if self.fail {
                return Err(StorageError::invalid("refused"));
            }
            for (i, &id) in ids.iter().enumerate() {
                if id >= self.rows {
                    return Err(StorageError::RowOutOfRange {
                        id,
                        rows: self.rows,
                    });
                }
                out[i] = RowRef {
                    data: self.base + id,
                    scale: 0,
                };
            }
            if !self.pins {
                return Ok(Lease::empty());
            }
            *self.live.lock().unwrap() += 1;
            Ok(Lease {
                id: 7,
                pinned: ids.len(),
            })
        }
        fn release(
            &self,
            l: Lease,
            gpu: &dyn GpuBackend,
            after: Option<EventHandle>,
        ) -> Result<()> {
            if l.pinned > 0 {
                *self.live.lock().unwrap() -= 1;
            }
            if let Some(ev) = after {
                gpu.destroy_event(ev)?;
            }
            Ok(())
        }
        fn prefetch(&self, _: &[u64]) -> Result<()> {
            Ok(())
        }
        fn stats(&self) -> TableStats {
            TableStats {
                hits: self.rows,
                ..Default::default()
            }
        }
    }

    #[test]
    fn ids_reach_the_part_that_holds_them() {
        let gpu: Arc<dyn GpuBackend> = Arc::new(CpuBackend::new());
        let parts: Vec<Arc<dyn RowTable>> = vec![
            Fake::new(3, 1000, false),
            Fake::new(5, 2000, false),
            Fake::new(7, 3000, false),
        ];
        let t = ConcatTable::new(parts, gpu.clone()).unwrap();
        assert_eq!(t.info().rows, 15);
        assert_eq!(t.stats().hits, 15);
        let mut out = [RowRef::default(); 6];
        let l = t.resolve(&[0, 2, 3, 7, 8, 14], &mut out).unwrap();
        assert_eq!(out.map(|r| r.data), [1000, 1002, 2000, 2004, 3000, 3006]);
        assert_eq!(l.pinned, 0);
        t.release(l, gpu.as_ref(), None).unwrap();
        let e = t.resolve(&[15], &mut out[..1]).unwrap_err();
        assert!(
            matches!(e, StorageError::RowOutOfRange { id: 15, rows: 15 }),
            "{e}"
        );
    }

    #[test]
    fn pins_are_released_once_and_on_failure() {
        let gpu: Arc<dyn GpuBackend> = Arc::new(CpuBackend::new());
        let a = Fake::new(4, 0, true);
        let b = Fake::new(4, 100, true);
        let t = ConcatTable::new(vec![a.clone(), b.clone()], gpu.clone()).unwrap();
        let mut out = [RowRef::default(); 3];
        let l = t.resolve(&[1, 5, 6], &mut out).unwrap();
        assert_eq!(l.pinned, 3);
        assert_eq!((a.live(), b.live()), (1, 1));
        let ev = gpu.create_event().unwrap();
        gpu.record_event(ev, 0).unwrap();
        let again = Lease {
            id: l.id,
            pinned: l.pinned,
        };
        t.release(l, gpu.as_ref(), Some(ev)).unwrap();
        assert_eq!((a.live(), b.live()), (0, 0));
        // The two parts got an event each, the second from the side stream.
        assert!(t.side.lock().unwrap().is_some());
        assert!(matches!(
            t.release(again, gpu.as_ref(), None),
            Err(StorageError::UnknownLease { .. })
        ));
        // A part that refuses its ids leaves no pin in the parts before it.
        let failing = Arc::new(Fake {
            rows: 4,
            base: 100,
            pins: true,
            fail: true,
            live: Mutex::new(0),
        });
        let t = ConcatTable::new(vec![a.clone(), failing], gpu.clone()).unwrap();
        assert!(t.resolve(&[1, 5], &mut out[..2]).is_err());
        assert_eq!(a.live(), 0);
        assert!(ConcatTable::new(Vec::new(), gpu).is_err());
    }
}
