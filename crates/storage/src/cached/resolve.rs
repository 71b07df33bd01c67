//! Slot planning for the row cache: taking victims (through the policy,
//! stashing hot ones in the host tier), pending (event-guarded) releases,
//! prefetch hand-over, and mapping a batch of ids to pinned slots.
//!
//! Everything here runs under the cache's state mutex and never touches
//! slot bytes; the module invariants are those of [`super`]: a pinned or
//! loading slot is never a victim, and a refused batch holds no pins and
//! leaves no slot half-mapped.

use std::sync::atomic::Ordering::Relaxed;
use std::time::{Duration, Instant};

use parking_lot::MutexGuard;

use super::policy::Evictor;
use super::{Attempt, FREE, Inner, LOADING, NO_ID, QUEUED, READY, Slot, State};
use crate::error::{Result, StorageError};
use crate::table::{Lease, RowRef};

impl Inner {
    /// Take a victim slot for `id` and claim it (`state`, stamped `batch`,
    /// `pins` pins, mapped). A ready row leaving the arena is copied to the
    /// host tier first. With `poll`, completed pending releases are
    /// dropped when no victim is free. Returns the slot and whether a ready
    /// row was evicted, or `None` when every slot is busy.
    pub(super) fn take(
        &self,
        st: &mut State,
        id: u64,
        batch: u64,
        pins: u32,
        state: u8,
        poll: bool,
    ) -> Option<(u32, bool)> {
        let v = match st.evict.victim(&mut st.slots) {
            Some(v) => v,
            None if poll && !st.pending.is_empty() && self.poll_pending(st) => {
                st.evict.victim(&mut st.slots)?
            }
            None => return None,
        };
        if st.slots[v as usize].state == READY
            && let Some(host) = &self.host
        {
            let sl = &st.slots[v as usize];
            let s = v as usize;
            // SAFETY: the slot is READY and unpinned (a victim), so no load
            // writes it and no queued gather reads it; the ranges lie in the
            // arena (slot index < slots).
            let (row, scale) = unsafe {
                (
                    std::slice::from_raw_parts(
                        self.arena.host.add(s * self.stride),
                        self.row_bytes,
                    ),
                    if self.fp8 {
                        std::slice::from_raw_parts(self.arena.host.add(self.scale_base + s * 4), 4)
                    } else {
                        &[][..]
                    },
                )
            };
            host.put(sl.id, row, scale);
        }
        let evicted = Self::claim(st, v, id, batch, pins, state);
        st.evict.admit(&mut st.slots, v, id);
        Some((v, evicted))
    }

    /// Claim slots for the ids of one prefetch request not mapped yet, as
    /// `QUEUED`, in the order asked, and count the request as claimed.
    /// Stops quietly once prefetches hold `prefetch_cap` slots or no victim
    /// is left (prefetch is advice). Returns `(slot, id, generation)` of
    /// each claimed row.
    pub(super) fn claim_prefetch(&self, ids: &[u64]) -> Vec<(u32, u64, u32)> {
        let (mut g, batch) = self.lock_batch();
        let st = &mut *g;
        let mut claimed = Vec::new();
        let mut evictions = 0;
        for &id in ids {
            if st.prefetching >= self.prefetch_cap {
                break;
            }
            if st.map.contains_key(&id) {
                continue;
            }
            let Some((v, evicted)) = self.take(st, id, batch, 0, QUEUED, false) else {
                break;
            };
            evictions += u64::from(evicted);
            st.prefetching += 1;
            claimed.push((v, id, st.slots[v as usize].generation));
        }
        // Counted under the mutex, so `wait_prefetched` (which checks it
        // under the mutex too) sees either the request or its claimed rows.
        self.unclaimed.fetch_sub(1, Relaxed);
        drop(g);
        self.stats.evictions.fetch_add(evictions, Relaxed);
        // Wakes `wait_prefetched` when nothing was left to claim.
        self.cv.notify_all();
        claimed
    }

    /// Move the rows of a prefetch chunk that are still `QUEUED` (not
    /// taken over by a resolve, not remapped since) to `LOADING`: the
    /// prefetch thread reads those. Counts them as misses.
    pub(super) fn start_prefetch(&self, chunk: &[(u32, u64, u32)]) -> Vec<(u32, u64)> {
        let mut g = self.st.lock();
        let mut loads = Vec::with_capacity(chunk.len());
        for &(s, id, gen0) in chunk {
            let sl = &mut g.slots[s as usize];
            if sl.state == QUEUED && sl.generation == gen0 && sl.id == id {
                sl.state = LOADING;
                loads.push((s, id));
            }
        }
        drop(g);
        self.stats.misses.fetch_add(loads.len() as u64, Relaxed);
        loads
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
        sl.freq = 0;
        sl.generation = sl.generation.wrapping_add(1);
    }

    /// Hand slot `v` to `id`: in `state` (`LOADING` or `QUEUED`), stamped
    /// `batch`, with `pins` pins, and mapped. True when it held a ready row
    /// (an eviction).
    fn claim(st: &mut State, v: u32, id: u64, batch: u64, pins: u32, state: u8) -> bool {
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
            state,
            freq: 0,
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

    /// Take the state mutex for a new batch: releases whose event has
    /// completed are dropped first (their slots may be the victims this
    /// batch needs), then the batch gets its stamp.
    fn lock_batch(&self) -> (MutexGuard<'_, State>, u64) {
        let mut g = self.st.lock();
        if !g.pending.is_empty() {
            self.poll_pending(&mut g);
        }
        let batch = g.next_batch;
        g.next_batch += 1;
        (g, batch)
    }

    pub(super) fn try_resolve(&self, ids: &[u64], out: &mut [RowRef]) -> Result<Attempt> {
        let (mut g, batch) = self.lock_batch();
        let st = &mut *g;
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
                        } else if sl.state == QUEUED {
                            // Queued by a prefetch, not started: read it now
                            // rather than wait behind the prefetch queue.
                            sl.state = LOADING;
                            st.prefetching -= 1;
                            loads.push((s, id));
                            out[i] = self.row_ref(s);
                            continue;
                        }
                    }
                    Evictor::touch(sl);
                    s
                }
                None => {
                    if pinned.len() >= self.max_resolve {
                        over = true;
                        break;
                    }
                    let Some((v, evicted)) = self.take(st, id, batch, 1, LOADING, true) else {
                        Self::undo(st, &pinned, &loads);
                        self.stats.evictions.fetch_add(evictions, Relaxed);
                        return Ok(Attempt::NoVictim);
                    };
                    evictions += u64::from(evicted);
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
