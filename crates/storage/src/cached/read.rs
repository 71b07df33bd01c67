//! Reading missed rows into their slots: the misses of one batch are
//! sorted, each row needs the smallest span of whole alignment granules
//! holding it (the shard file's [`crate::io::DioAlign`], 512 B on most
//! disks, not a whole 4 KiB page), rows whose spans overlap or touch are
//! merged into extents of at most [`MAX_EXTENT`] bytes, and one batch of
//! reads goes to the [`crate::io::PageReader`].
//!
//! Invariant: slot bytes are written only here, only for slots the caller
//! holds `LOADING`: rows the host tier holds are copied first, rows read
//! from disk only after every read of the batch succeeded in full; a failed
//! load unmaps every slot of the batch, so none is handed out half-filled.

use std::sync::atomic::Ordering::Relaxed;

use super::Inner;
use crate::error::{Result, StorageError};
use crate::io::{AlignedBuf, ReadReq};

/// Largest single read: adjacent pages are merged up to this size.
const MAX_EXTENT: u64 = 128 * 1024;

/// One byte range a load needs: a row's values or its FP8 scale.
struct Need {
    shard: usize,
    off: u64,
    len: usize,
    dst: usize,
    id: u64,
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

    /// Read the rows of `loads` into their slots. The slots are `LOADING`
    /// and owned by the caller; nothing else reads or writes them.
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
        let mut needs = Vec::with_capacity(loads.len() * if self.fp8 { 2 } else { 1 });
        for &(s, id) in loads {
            let loc = self.files.locate(id)?;
            let s = s as usize;
            needs.push(Need {
                shard: loc.shard,
                off: loc.offset,
                len: self.row_bytes,
                dst: s * self.stride,
                id,
            });
            if let Some(so) = loc.scale_offset {
                needs.push(Need {
                    shard: loc.shard,
                    off: so,
                    len: 4,
                    dst: self.scale_base + s * 4,
                    id,
                });
            }
        }
        needs.sort_unstable_by_key(|n| (n.shard, n.off));
        // Extents: (shard, start, end, first need, need count).
        let mut ext: Vec<(usize, u64, u64, usize, usize)> = Vec::new();
        let mut coalesced = 0u64;
        for (k, n) in needs.iter().enumerate() {
            let a = self.fds[n.shard].align.offset as u64;
            let lo = n.off & !(a - 1);
            let hi = (n.off + n.len as u64).next_multiple_of(a);
            if let Some(e) = ext.last_mut()
                && e.0 == n.shard
                && lo <= e.2
                && hi.max(e.2) - e.1 <= MAX_EXTENT
            {
                if lo < e.2 {
                    coalesced += 1;
                }
                e.2 = e.2.max(hi);
                e.4 += 1;
                continue;
            }
            ext.push((n.shard, lo, hi, k, 1));
        }
        // Where each extent lands in the buffer: its start on the file's
        // memory granule (extent lengths are multiples of the offset
        // granule, which may be smaller).
        let mut at = Vec::with_capacity(ext.len());
        let mut total = 0usize;
        for e in &ext {
            total = total.next_multiple_of(self.fds[e.0].align.mem);
            at.push(total);
            total += (e.2 - e.1) as usize;
        }
        let mut buf = self.take_buf(total);
        let results = {
            let mut reqs = Vec::with_capacity(ext.len());
            let mut rest = buf.as_mut_slice();
            let mut pos = 0usize;
            for (e, &start) in ext.iter().zip(&at) {
                let (_, tail) = rest.split_at_mut(start - pos);
                let (head, tail) = tail.split_at_mut((e.2 - e.1) as usize);
                rest = tail;
                pos = start + head.len();
                reqs.push(ReadReq {
                    fd: self.fds[e.0].fd(),
                    offset: e.1,
                    buf: head,
                });
            }
            self.reader.read_batch(&mut reqs)
        };
        self.stats.read_calls.fetch_add(ext.len() as u64, Relaxed);
        self.stats.pages_coalesced.fetch_add(coalesced, Relaxed);
        let got: u64 = results
            .iter()
            .filter_map(|r| r.as_ref().ok())
            .map(|&n| n as u64)
            .sum();
        self.stats.bytes_read.fetch_add(got, Relaxed);
        let mut first_err = None;
        for (e, r) in ext.iter().zip(&results) {
            let rows = &needs[e.3..e.3 + e.4];
            let more = if e.4 > 1 {
                format!(" and {} more", e.4 - 1)
            } else {
                String::new()
            };
            match r {
                Err(err) => {
                    first_err = Some(StorageError::io_at(
                        &self.fds[e.0].path,
                        e.1,
                        format!(
                            "reading {} bytes at offset {} for row {}{more}",
                            e.2 - e.1,
                            e.1,
                            rows[0].id
                        ),
                        copy_io_error(err),
                    ));
                }
                Ok(n) => {
                    for need in rows {
                        let end = need.off + need.len as u64 - e.1;
                        if (*n as u64) < end {
                            first_err = Some(StorageError::Truncated {
                                path: self.fds[e.0].path.clone(),
                                what: format!("row {} (short read)", need.id),
                                offset: e.1,
                                needed: end,
                                got: *n as u64,
                            });
                            break;
                        }
                    }
                }
            }
            if first_err.is_some() {
                break;
            }
        }
        if let Some(e) = first_err {
            self.give_buf(buf);
            return Err(e);
        }
        let src = buf.as_slice();
        for (e, &base) in ext.iter().zip(&at) {
            for need in &needs[e.3..e.3 + e.4] {
                let at = base + (need.off - e.1) as usize;
                let from = &src[at..at + need.len];
                // SAFETY: `dst` lies inside the arena (slot index < slots,
                // checked at planning); the slot is LOADING and owned by this
                // load, so no other thread and no queued gather touches it.
                unsafe {
                    std::ptr::copy_nonoverlapping(
                        from.as_ptr(),
                        self.arena.host.add(need.dst),
                        need.len,
                    );
                }
            }
        }
        self.give_buf(buf);
        Ok(())
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
