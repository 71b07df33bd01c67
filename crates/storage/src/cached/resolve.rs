//! Slot planning for the row cache: the CLOCK victim choice, pending
//! (event-guarded) releases, and mapping a batch of ids to pinned slots.
//!
//! Everything here runs under the cache's state mutex and never touches
//! slot bytes; the module invariants are those of [`super`]: a pinned or
//! loading slot is never a victim, and a refused batch holds no pins and
//! leaves no slot half-mapped.

use std::sync::atomic::Ordering::Relaxed;
use std::time::{Duration, Instant};

use super::{Attempt, FREE, Inner, LOADING, NO_ID, READY, Slot, State};
use crate::error::{Result, StorageError};
use crate::table::{Lease, RowRef};

impl Inner {
    /// A CLOCK victim: unpinned, not loading, reference bit clear.
    pub(super) fn clock(&self, st: &mut State) -> Option<u32> {
        let n = st.slots.len();
        for _ in 0..2 * n + 1 {
            let s = st.hand;
            st.hand = if s + 1 == n { 0 } else { s + 1 };
            let sl = &mut st.slots[s];
            if sl.pins > 0 || sl.state == LOADING {
                continue;
            }
            if sl.referenced {
                sl.referenced = false;
                continue;
            }
            return Some(s as u32);
        }
        None
    }

    fn victim(&self, st: &mut State) -> Option<u32> {
        if let Some(v) = self.clock(st) {
            return Some(v);
        }
        if !st.pending.is_empty() && self.poll_pending(st) {
            return self.clock(st);
        }
        None
    }

    /// Drop the pins of releases whose event has completed. Returns whether
    /// any were dropped.
    pub(super) fn poll_pending(&self, st: &mut State) -> bool {
        let mut freed = false;
        let mut i = 0;
        while i < st.pending.len() {
            let done = match self.gpu.event_query(st.pending[i].0) {
                Ok(d) => d,
                Err(e) => {
                    tracing::warn!(error = %e, "querying a lease event failed; dropping its pins");
                    true
                }
            };
            if done {
                let (ev, slots) = st.pending.swap_remove(i);
                for s in slots {
                    st.slots[s as usize].pins -= 1;
                }
                if let Err(e) = self.gpu.destroy_event(ev) {
                    tracing::warn!(error = %e, "destroying a lease event failed");
                }
                freed = true;
            } else {
                i += 1;
            }
        }
        if freed {
            self.cv.notify_all();
        }
        freed
    }

    pub(super) fn unpin(st: &mut State, slots: &[u32]) {
        for &s in slots {
            st.slots[s as usize].pins -= 1;
        }
    }

    fn unmap(st: &mut State, s: u32) {
        let sl = &mut st.slots[s as usize];
        if sl.id != NO_ID && st.map.get(&sl.id) == Some(&s) {
            st.map.remove(&sl.id);
        }
        sl.id = NO_ID;
        sl.state = FREE;
        sl.referenced = false;
        sl.generation = sl.generation.wrapping_add(1);
    }

    /// Hand slot `v` to `id`: loading, stamped `batch`, with `pins` pins,
    /// and mapped. True when it held a ready row (an eviction).
    pub(super) fn claim(st: &mut State, v: u32, id: u64, batch: u64, pins: u32) -> bool {
        let sl = &mut st.slots[v as usize];
        let evicted = sl.state == READY;
        if evicted {
            st.map.remove(&sl.id);
        }
        *sl = Slot {
            id,
            stamp: batch,
            pins,
            generation: sl.generation.wrapping_add(1),
            state: LOADING,
            referenced: false,
        };
        st.map.insert(id, v);
        evicted
    }

    /// Publish the outcome of loads: ready, or unmapped on failure.
    pub(super) fn finish_loads(&self, st: &mut State, loads: &[(u32, u64)], ok: bool) {
        for &(s, _) in loads {
            if ok {
                st.slots[s as usize].state = READY;
            } else {
                Self::unmap(st, s);
            }
        }
        self.cv.notify_all();
    }

    pub(super) fn try_resolve(&self, ids: &[u64], out: &mut [RowRef]) -> Result<Attempt> {
        let mut g = self.st.lock();
        if !g.pending.is_empty() {
            self.poll_pending(&mut g);
        }
        let st = &mut *g;
        let batch = st.next_batch;
        st.next_batch += 1;
        let mut pinned: Vec<u32> = Vec::with_capacity(ids.len().min(self.max_resolve));
        let mut loads: Vec<(u32, u64)> = Vec::new();
        let mut waits: Vec<(u32, u32)> = Vec::new();
        let mut evictions = 0u64;
        let mut over = false;
        for (i, &id) in ids.iter().enumerate() {
            let s = match st.map.get(&id) {
                Some(&s) => {
                    let sl = &mut st.slots[s as usize];
                    if sl.stamp != batch {
                        sl.stamp = batch;
                        sl.pins += 1;
                        pinned.push(s);
                        if sl.state == LOADING {
                            waits.push((s, sl.generation));
                        }
                    }
                    sl.referenced = true;
                    s
                }
                None => {
                    if pinned.len() >= self.max_resolve {
                        over = true;
                        break;
                    }
                    let Some(v) = self.victim(st) else {
                        Self::undo(st, &pinned, &loads);
                        self.stats.evictions.fetch_add(evictions, Relaxed);
                        return Ok(Attempt::NoVictim);
                    };
                    evictions += u64::from(Self::claim(st, v, id, batch, 1));
                    pinned.push(v);
                    loads.push((v, id));
                    v
                }
            };
            out[i] = self.row_ref(s);
        }
        self.stats.evictions.fetch_add(evictions, Relaxed);
        if over || pinned.len() > self.max_resolve {
            Self::undo(st, &pinned, &loads);
            let distinct: std::collections::HashSet<u64> = ids.iter().copied().collect();
            return Err(StorageError::BatchTooLarge {
                distinct: distinct.len(),
                limit: self.max_resolve,
            });
        }
        if !loads.is_empty() {
            drop(g);
            let t0 = Instant::now();
            let r = self.load(&loads);
            self.stats
                .io_wait_ns
                .fetch_add(t0.elapsed().as_nanos() as u64, Relaxed);
            g = self.st.lock();
            self.finish_loads(&mut g, &loads, r.is_ok());
            if let Err(e) = r {
                Self::unpin(&mut g, &pinned);
                return Err(e);
            }
        }
        if !waits.is_empty() {
            let t0 = Instant::now();
            let deadline = t0 + self.pin_wait.max(Duration::from_secs(60));
            loop {
                let busy = waits.iter().any(|&(s, g0)| {
                    let sl = &g.slots[s as usize];
                    sl.state == LOADING && sl.generation == g0
                });
                if !busy {
                    self.stats
                        .io_wait_ns
                        .fetch_add(t0.elapsed().as_nanos() as u64, Relaxed);
                    break;
                }
                if self.cv.wait_until(&mut g, deadline).timed_out() {
                    Self::unpin(&mut g, &pinned);
                    return Err(StorageError::ConcurrentRead {
                        message: "timed out waiting for a concurrent read of table rows".into(),
                    });
                }
            }
            if waits
                .iter()
                .any(|&(s, g0)| g.slots[s as usize].generation != g0)
            {
                Self::unpin(&mut g, &pinned);
                return Ok(Attempt::PeerFailed);
            }
        }
        let lease_id = g.next_lease;
        g.next_lease += 1;
        let n = pinned.len();
        g.leases.insert(lease_id, pinned);
        drop(g);
        self.stats.misses.fetch_add(loads.len() as u64, Relaxed);
        self.stats
            .hits
            .fetch_add((ids.len() - loads.len()) as u64, Relaxed);
        Ok(Attempt::Done(Lease {
            id: lease_id,
            pinned: n,
        }))
    }

    fn undo(st: &mut State, pinned: &[u32], loads: &[(u32, u64)]) {
        Self::unpin(st, pinned);
        for &(s, _) in loads {
            Self::unmap(st, s);
        }
    }
}
