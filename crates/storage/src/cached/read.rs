//! Reading missed rows into their slots: the misses of one batch are
//! sorted, each row needs the smallest span of whole alignment granules
//! holding it (the shard file's [`crate::io::DioAlign`], 512 B on most
//! disks, not a whole 4 KiB page), rows whose spans overlap or touch are
//! merged into extents of at most [`MAX_EXTENT`] bytes, and the extents go
//! to the [`crate::io::PageReader`]: a resolve's own misses as one batch
//! ([`Inner::load`]), prefetched rows as a stream ([`PrefetchFeed`]).
//!
//! Invariants: slot bytes are written only here, only for slots the caller
//! holds `LOADING`. A resolve's batch is all or nothing: rows the host tier
//! holds are copied first, rows read from disk only after every read of the
//! batch succeeded in full, and a failed load unmaps every slot of the
//! batch, so none is handed out half-filled. A prefetch publishes row by
//! row: a row becomes `READY` once every read it needs (its values, and
//! its FP8 scale) has succeeded in full and been copied, and is unmapped
//! once they have all finished and one failed; a slot is never published
//! or unmapped while a read for it is still in flight.

use std::collections::VecDeque;
use std::sync::atomic::Ordering::Relaxed;

use crossbeam_channel::Receiver;

use super::Inner;
use crate::error::{Result, StorageError};
use crate::io::{AlignedBuf, FeedRead, ReadFeed, ReadReq};
use crate::remote::{RemoteRows, RowDst};

/// Largest single read: adjacent pages are merged up to this size.
const MAX_EXTENT: u64 = 128 * 1024;

/// One byte range a load needs: a row's values or its FP8 scale.
struct Need {
    shard: usize,
    off: u64,
    len: usize,
    dst: usize,
    id: u64,
    /// Index of the row in the load's list.
    row: usize,
}

/// One read: the granules of a run of needs of one shard.
struct Extent {
    shard: usize,
    lo: u64,
    hi: u64,
    /// The needs it serves: `needs[first..first + count]`.
    first: usize,
    count: usize,
    /// Where it lands in the load's buffer.
    at: usize,
}

/// What one batch of loads reads: its needs sorted by file position, the
/// extents serving them, and the buffer bytes they take.
struct Plan {
    needs: Vec<Need>,
    ext: Vec<Extent>,
    total: usize,
}

impl Inner {
    fn take_buf(&self, len: usize) -> AlignedBuf {
        let mut pool = self.bufs.lock();
        if let Some(i) = pool.iter().position(|b| b.len() >= len) {
            return pool.swap_remove(i);
        }
        drop(pool);
        AlignedBuf::new(len.next_multiple_of(64 * 1024))
    }

    fn give_buf(&self, b: AlignedBuf) {
        let mut pool = self.bufs.lock();
        if pool.len() < 8 {
            pool.push(b);
        }
    }

    /// Copy the rows of `loads` the host tier holds into their slots;
    /// returns the rest, which must come from disk. A row copied here into
    /// a slot whose batch then fails to read is unmapped with the others,
    /// so no half-loaded batch is ever handed out.
    fn copy_from_host(&self, host: &super::HostTier, loads: &[(u32, u64)]) -> Vec<(u32, u64)> {
        let mut rest = Vec::with_capacity(loads.len());
        for &(s, id) in loads {
            let s = s as usize;
            // SAFETY: the slot is LOADING and owned by this load (see
            // `load`); both ranges lie inside the arena.
            let (row, scale) = unsafe {
                (
                    std::slice::from_raw_parts_mut(
                        self.arena.host.add(s * self.stride),
                        self.row_bytes,
                    ),
                    if self.fp8 {
                        std::slice::from_raw_parts_mut(
                            self.arena.host.add(self.scale_base + s * 4),
                            4,
                        )
                    } else {
                        &mut [][..]
                    },
                )
            };
            if !host.get(id, row, scale) {
                rest.push((s as u32, id));
            }
        }
        self.stats
            .host_hits
            .fetch_add((loads.len() - rest.len()) as u64, Relaxed);
        rest
    }

    /// Plan the reads of `loads`: each row's smallest span of whole
    /// granules, spans that overlap or touch merged up to [`MAX_EXTENT`].
    /// Counts the reads (and the rows sharing a span) in the statistics.
    fn plan(&self, loads: &[(u32, u64)]) -> Result<Plan> {
        let mut needs = Vec::with_capacity(loads.len() * if self.fp8 { 2 } else { 1 });
        for (row, &(s, id)) in loads.iter().enumerate() {
            let loc = self.files.locate(id)?;
            let s = s as usize;
            needs.push(Need {
                shard: loc.shard,
                off: loc.offset,
                len: self.row_bytes,
                dst: s * self.stride,
                id,
                row,
            });
            if let Some(so) = loc.scale_offset {
                needs.push(Need {
                    shard: loc.shard,
                    off: so,
                    len: 4,
                    dst: self.scale_base + s * 4,
                    id,
                    row,
                });
            }
        }
        needs.sort_unstable_by_key(|n| (n.shard, n.off));
        let mut ext: Vec<Extent> = Vec::new();
        let mut coalesced = 0u64;
        for (k, n) in needs.iter().enumerate() {
            let a = self.fds[n.shard].align.offset as u64;
            let lo = n.off & !(a - 1);
            let hi = (n.off + n.len as u64).next_multiple_of(a);
            if let Some(e) = ext.last_mut()
                && e.shard == n.shard
                && lo <= e.hi
                && hi.max(e.hi) - e.lo <= MAX_EXTENT
            {
                if lo < e.hi {
                    coalesced += 1;
                }
                e.hi = e.hi.max(hi);
                e.count += 1;
                continue;
            }
            ext.push(Extent {
                shard: n.shard,
                lo,
                hi,
                first: k,
                count: 1,
                at: 0,
            });
        }
        // Each extent starts on its file's memory granule (extent lengths
        // are multiples of the offset granule, which may be smaller).
        let mut total = 0usize;
        for e in &mut ext {
            total = total.next_multiple_of(self.fds[e.shard].align.mem);
            e.at = total;
            total += (e.hi - e.lo) as usize;
        }
        // Counted here, where every planned read is about to be issued.
        self.stats.read_calls.fetch_add(ext.len() as u64, Relaxed);
        self.stats.pages_coalesced.fetch_add(coalesced, Relaxed);
        Ok(Plan { needs, ext, total })
    }

    /// Whether extent `e` of `plan` read what its needs cover, as an error
    /// naming the file, offset and first row when it did not.
    fn check_extent(&self, plan: &Plan, e: &Extent, r: &std::io::Result<usize>) -> Result<()> {
        let rows = &plan.needs[e.first..e.first + e.count];
        let path = &self.fds[e.shard].path;
        match r {
            Err(err) => {
                let more = if e.count > 1 {
                    format!(" and {} more", e.count - 1)
                } else {
                    String::new()
                };
                Err(StorageError::io_at(
                    path,
                    e.lo,
                    format!(
                        "reading {} bytes at offset {} for row {}{more}",
                        e.hi - e.lo,
                        e.lo,
                        rows[0].id
                    ),
                    copy_io_error(err),
                ))
            }
            Ok(n) => {
                for need in rows {
                    let end = need.off + need.len as u64 - e.lo;
                    if (*n as u64) < end {
                        return Err(StorageError::Truncated {
                            path: path.clone(),
                            what: format!("row {} (short read)", need.id),
                            offset: e.lo,
                            needed: end,
                            got: *n as u64,
                        });
                    }
                }
                Ok(())
            }
        }
    }

    /// Copy the needs of extent `e` from the load buffer at `src` into
    /// their slots.
    ///
    /// # Safety
    ///
    /// `src` is the start of the plan's buffer and the extent's bytes there
    /// are read in full and no longer written; the needs' slots are
    /// `LOADING` and owned by the caller.
    unsafe fn copy_extent(&self, plan: &Plan, e: &Extent, src: *const u8) {
        for need in &plan.needs[e.first..e.first + e.count] {
            let at = e.at + (need.off - e.lo) as usize;
            // SAFETY: `at + len` lies inside the extent's bytes (checked by
            // `check_extent`); `dst` lies inside the arena (slot index <
            // slots); the slot is owned by this load, so no other thread
            // and no queued gather touches it.
            unsafe {
                std::ptr::copy_nonoverlapping(src.add(at), self.arena.host.add(need.dst), need.len);
            }
        }
    }

    /// Read the rows of `loads` into their slots: from the host tier when
    /// it holds them, else from the remote tier when there is one (and,
    /// when its fetch fails and fallback is on, from the shard files), else
    /// from the shard files. The slots are `LOADING` and owned by the
    /// caller; nothing else reads or writes them.
    pub(super) fn load(&self, loads: &[(u32, u64)]) -> Result<()> {
        let from_disk;
        let loads = match &self.host {
            None => loads,
            Some(host) => {
                from_disk = self.copy_from_host(host, loads);
                if from_disk.is_empty() {
                    return Ok(());
                }
                &from_disk[..]
            }
        };
        if let Some(remote) = &self.remote {
            match self.fetch_remote(remote.as_ref(), loads) {
                Ok(()) => return Ok(()),
                Err(e) if self.remote_fallback => {
                    tracing::debug!(error = %e, rows = loads.len(), "remote fetch failed; reading the rows from the shard files");
                    remote.fell_back(loads.len() as u64);
                }
                Err(e) => return Err(e),
            }
        }
        self.load_disk(loads)
    }

    /// Fetch the rows of `loads` from the remote tier straight into their
    /// slots (`LOADING`, owned by the caller).
    fn fetch_remote(&self, remote: &dyn RemoteRows, loads: &[(u32, u64)]) -> Result<()> {
        let mut dst: Vec<RowDst<'_>> = loads
            .iter()
            .map(|&(s, id)| {
                let s = s as usize;
                // SAFETY: the slot is LOADING and owned by this load (see
                // `load`), so nothing else reads or writes it; both ranges
                // lie inside the arena and are disjoint from every other
                // slot's.
                let (row, scale) = unsafe {
                    (
                        std::slice::from_raw_parts_mut(
                            self.arena.host.add(s * self.stride),
                            self.row_bytes,
                        ),
                        if self.fp8 {
                            std::slice::from_raw_parts_mut(
                                self.arena.host.add(self.scale_base + s * 4),
                                4,
                            )
                        } else {
                            &mut [][..]
                        },
                    )
                };
                RowDst { id, row, scale }
            })
            .collect();
        let bytes = remote.fetch(&mut dst)?;
        self.stats.bytes_read.fetch_add(bytes, Relaxed);
        self.stats.read_calls.fetch_add(1, Relaxed);
        Ok(())
    }

    /// Read the rows of `loads` from the shard files into their slots.
    fn load_disk(&self, loads: &[(u32, u64)]) -> Result<()> {
        let plan = self.plan(loads)?;
        let mut buf = self.take_buf(plan.total);
        let results = {
            let mut reqs = Vec::with_capacity(plan.ext.len());
            let mut rest = buf.as_mut_slice();
            let mut pos = 0usize;
            for e in &plan.ext {
                let (_, tail) = rest.split_at_mut(e.at - pos);
                let (head, tail) = tail.split_at_mut((e.hi - e.lo) as usize);
                rest = tail;
                pos = e.at + head.len();
                reqs.push(ReadReq {
                    fd: self.fds[e.shard].fd(),
                    offset: e.lo,
                    buf: head,
                });
            }
            self.reader.read_batch(&mut reqs)
        };
        let got: u64 = results
            .iter()
            .filter_map(|r| r.as_ref().ok())
            .map(|&n| n as u64)
            .sum();
        self.stats.bytes_read.fetch_add(got, Relaxed);
        for (e, r) in plan.ext.iter().zip(&results) {
            if let Err(err) = self.check_extent(&plan, e, r) {
                self.give_buf(buf);
                return Err(err);
            }
        }
        let src = buf.as_mut_ptr().cast_const();
        for e in &plan.ext {
            // SAFETY: every read has finished in full (checked above); the
            // slots are LOADING and owned by this load.
            unsafe { self.copy_extent(&plan, e, src) };
        }
        self.give_buf(buf);
        Ok(())
    }

    /// The prefetch thread of a cache over a remote tier: each request's
    /// rows (and those of every request queued behind it) claimed, then
    /// loaded as one batch (one request per server), then published; a
    /// failed batch leaves its rows unmapped for a resolve to read itself.
    pub(super) fn remote_prefetch(&self, rx: &Receiver<Vec<u64>>) {
        while let Ok(ids) = rx.recv() {
            let mut claimed = self.claim_prefetch(&ids);
            while let Ok(more) = rx.try_recv() {
                claimed.extend(self.claim_prefetch(&more));
            }
            let loads = self.start_prefetch(&claimed);
            if loads.is_empty() {
                continue;
            }
            let r = self.load(&loads);
            if let Err(e) = &r {
                // Advice only: a resolve that needs these rows fetches them
                // itself and reports a lasting fault.
                tracing::debug!(error = %e, "remote prefetch failed; rows left unmapped");
            }
            let mut g = self.st.lock();
            g.prefetching -= loads.len();
            self.finish_loads(&mut g, &loads, r.is_ok());
        }
    }

    /// Make the rows of a prefetch visible: `ready` ones `READY`, `failed`
    /// ones unmapped (a resolve that needs them reads them again), and
    /// return their slots to the prefetch budget.
    fn publish(&self, ready: &mut Vec<(u32, u64)>, failed: &mut Vec<(u32, u64)>) {
        if ready.is_empty() && failed.is_empty() {
            return;
        }
        let mut g = self.st.lock();
        g.prefetching -= ready.len() + failed.len();
        self.finish_loads(&mut g, ready, true);
        if !failed.is_empty() {
            self.finish_loads(&mut g, failed, false);
        }
        drop(g);
        ready.clear();
        failed.clear();
    }
}

/// Reads of earlier chunks still in flight below which the prefetch
/// thread starts its next chunk. A step asks for its rows in the order its
/// pipelined gather resolves them (one chunk per head group), and a disk
/// serves the reads it holds together in no particular order: with every
/// chunk in flight at once, the first group's rows would come in with the
/// last group's. Holding the next chunk back until the one before is down
/// to its last few reads lets each group arrive in about one round trip
/// after the one before, while the tail of one chunk and the head of the
/// next keep the disk busy. Chunks of [`super::PREFETCH_CHUNK`] rows
/// (large prefetches) still keep the reader's whole depth in flight.
const PREFETCH_WINDOW: usize = 64;

/// A prefetch chunk being read.
struct ChunkRead {
    loads: Vec<(u32, u64)>,
    plan: Plan,
    buf: AlignedBuf,
    /// Needs of each row not yet read.
    left: Vec<u8>,
    /// Rows one of whose reads failed.
    failed: Vec<bool>,
    /// Extents handed to the reader so far.
    started: usize,
    /// Extents handed out and not yet reported.
    outstanding: usize,
}

/// The prefetch thread's [`ReadFeed`]: requests from the prefetch channel,
/// claimed (slots taken, rows `QUEUED`) as they come and cut into chunks,
/// each started (moved from `QUEUED` to `LOADING`) only when the reader has
/// room for their first read and fewer than [`PREFETCH_WINDOW`] reads of
/// earlier chunks are in flight, read in the order they were queued, each
/// row published `READY` as soon as its own reads are in, not when its
/// chunk or batch is done. A resolve that needs a prefetched row therefore
/// waits only for that row's read, and rows of chunks not yet started stay
/// `QUEUED` for a resolve to take over.
pub(super) struct PrefetchFeed<'a> {
    inner: &'a Inner,
    rx: &'a Receiver<Vec<u64>>,
    /// Chunks of claimed rows, not yet started.
    backlog: VecDeque<Vec<(u32, u64, u32)>>,
    /// Chunks in progress, by the high half of a read's tag.
    chunks: Vec<Option<ChunkRead>>,
    /// The chunk whose extents are being handed out.
    current: Option<usize>,
    ready: Vec<(u32, u64)>,
    failed: Vec<(u32, u64)>,
    /// Reads handed to the reader and not yet reported, of every chunk.
    outstanding: usize,
}

impl<'a> PrefetchFeed<'a> {
    pub(super) fn new(inner: &'a Inner, rx: &'a Receiver<Vec<u64>>) -> Self {
        PrefetchFeed {
            inner,
            rx,
            backlog: VecDeque::new(),
            chunks: Vec::new(),
            current: None,
            ready: Vec::new(),
            failed: Vec::new(),
            outstanding: 0,
        }
    }

    /// Block until there is a chunk to read; false once the channel is
    /// closed and nothing is left.
    pub(super) fn wait(&mut self) -> bool {
        while self.backlog.is_empty() {
            match self.rx.recv() {
                Ok(ids) => self.claim(&ids),
                Err(_) => return false,
            }
        }
        true
    }

    /// Claim the rows of one request and queue them in chunks.
    fn claim(&mut self, ids: &[u64]) {
        let claimed = self.inner.claim_prefetch(ids);
        self.backlog
            .extend(claimed.chunks(super::PREFETCH_CHUNK).map(<[_]>::to_vec));
    }

    /// Start the next claimed chunk: move its rows still `QUEUED` to
    /// `LOADING`, publish those the host tier holds, plan the reads of the
    /// rest. Returns its index in `chunks`.
    fn start_chunk(&mut self) -> Option<usize> {
        let inner = self.inner;
        loop {
            let chunk = match self.backlog.pop_front() {
                Some(c) => c,
                None => {
                    let ids = self.rx.try_recv().ok()?;
                    self.claim(&ids);
                    continue;
                }
            };
            let mut loads = inner.start_prefetch(&chunk);
            if let Some(host) = &inner.host {
                let rest = inner.copy_from_host(host, &loads);
                // `rest` keeps the order of `loads`: what it skips was copied.
                let mut left = rest.iter().peekable();
                for l in &loads {
                    if left.next_if_eq(&l).is_none() {
                        self.ready.push(*l);
                    }
                }
                loads = rest;
            }
            if loads.is_empty() {
                continue;
            }
            let plan = match inner.plan(&loads) {
                Ok(p) => p,
                Err(e) => {
                    tracing::debug!(error = %e, "planning a prefetch failed; rows left unmapped");
                    self.failed.extend_from_slice(&loads);
                    continue;
                }
            };
            let mut left = vec![0u8; loads.len()];
            for n in &plan.needs {
                left[n.row] += 1;
            }
            let c = ChunkRead {
                failed: vec![false; loads.len()],
                buf: inner.take_buf(plan.total),
                loads,
                plan,
                left,
                started: 0,
                outstanding: 0,
            };
            let i = match self.chunks.iter().position(Option::is_none) {
                Some(i) => {
                    self.chunks[i] = Some(c);
                    i
                }
                None => {
                    self.chunks.push(Some(c));
                    self.chunks.len() - 1
                }
            };
            return Some(i);
        }
    }

    /// Publish the rows whose reads have all finished.
    pub(super) fn flush(&mut self) {
        self.inner.publish(&mut self.ready, &mut self.failed);
    }
}

// SAFETY: each read points into its chunk's own buffer at its extent's
// place, extents of a chunk are disjoint, and the buffer is kept (the chunk
// stays in `chunks`) until every extent handed out has been reported.
unsafe impl ReadFeed for PrefetchFeed<'_> {
    fn next(&mut self, may_start: bool) -> Option<FeedRead> {
        let ci = match self.current {
            Some(ci) => ci,
            None if may_start && self.outstanding < PREFETCH_WINDOW => {
                let ci = self.start_chunk()?;
                self.current = Some(ci);
                ci
            }
            None => return None,
        };
        let c = self.chunks[ci].as_mut().expect("the current chunk is live");
        let k = c.started;
        let e = &c.plan.ext[k];
        c.started += 1;
        c.outstanding += 1;
        self.outstanding += 1;
        if c.started == c.plan.ext.len() {
            self.current = None;
        }
        Some(FeedRead {
            fd: self.inner.fds[e.shard].fd(),
            offset: e.lo,
            // SAFETY: `at + (hi - lo) <= total <= buf.len()`.
            ptr: unsafe { c.buf.as_mut_ptr().add(e.at) },
            len: (e.hi - e.lo) as usize,
            tag: ((ci as u64) << 32) | k as u64,
        })
    }

    fn done(&mut self, tag: u64, result: std::io::Result<usize>) {
        let inner = self.inner;
        let (ci, k) = ((tag >> 32) as usize, (tag & 0xffff_ffff) as usize);
        let c = self.chunks[ci].as_mut().expect("a reported chunk is live");
        c.outstanding -= 1;
        self.outstanding -= 1;
        if let Ok(n) = &result {
            inner.stats.bytes_read.fetch_add(*n as u64, Relaxed);
        }
        let e = &c.plan.ext[k];
        let ok = match inner.check_extent(&c.plan, e, &result) {
            Ok(()) => true,
            Err(err) => {
                // Advice only: the rows are unmapped and the resolve that
                // needs them reads them again and reports a lasting fault
                // itself, so a warning here would only repeat it.
                tracing::debug!(error = %err, "prefetch read failed; rows left unmapped");
                false
            }
        };
        if ok {
            // SAFETY: this extent's read has finished in full and nothing
            // writes its bytes again; its rows' slots are LOADING and owned
            // by this thread.
            unsafe { inner.copy_extent(&c.plan, e, c.buf.as_mut_ptr().cast_const()) };
        }
        for need in &c.plan.needs[e.first..e.first + e.count] {
            let r = need.row;
            c.failed[r] |= !ok;
            c.left[r] -= 1;
            if c.left[r] == 0 {
                if c.failed[r] {
                    self.failed.push(c.loads[r]);
                } else {
                    self.ready.push(c.loads[r]);
                }
            }
        }
        if c.outstanding == 0 && c.started == c.plan.ext.len() {
            let c = self.chunks[ci].take().expect("live");
            inner.give_buf(c.buf);
        }
    }

    fn settled(&mut self) {
        self.flush();
    }
}

/// An owned copy of a reader's error (readers report by reference), keeping
/// the OS error code when there is one.
fn copy_io_error(e: &std::io::Error) -> std::io::Error {
    match e.raw_os_error() {
        Some(code) => std::io::Error::from_raw_os_error(code),
        None => std::io::Error::new(e.kind(), e.to_string()),
    }
}
