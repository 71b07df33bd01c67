//! The mapped table: shard files memory-mapped read-only with random-access
//! advice and registered with the backend as device-addressable host
//! memory, so kernels read rows straight from the page cache.
//!
//! Invariants: each shard's whole file is mapped and registered once;
//! `RowRef.data` of a row is the registered base of its file plus the row's
//! absolute file offset; nothing is evicted, so leases are empty. Drop
//! unregisters every mapping before unmapping it. The shard files must not
//! be modified or truncated while mapped (as with any mapped loader); the
//! mapping is read-only, so kernels must only read through these pointers.

use std::fs::File;
use std::sync::Arc;

use memmap2::{Advice, Mmap};
use metrale_gpu_runtime::gpu::{DevicePtr, EventHandle, GpuBackend};

use crate::error::{IoContext, Result, StorageError};
use crate::layout::{TableFiles, check_row};
use crate::table::{
    Lease, RowRef, RowTable, TableInfo, TableStats, release_in_place, resolve_in_place,
};

/// A table served from memory-mapped shard files.
pub struct MappedTable {
    info: TableInfo,
    rows_per_shard: u64,
    /// Bytes between rows in the files ([`TableFiles::row_stride`]).
    stride: u64,
    gpu: Arc<dyn GpuBackend>,
    /// Per shard: (registered base, row-0 offset, scale-0 offset).
    bases: Vec<(DevicePtr, u64, Option<u64>)>,
    maps: Vec<Mmap>,
}

impl MappedTable {
    /// Map and register every shard of `files`.
    pub fn open(files: &TableFiles, gpu: Arc<dyn GpuBackend>) -> Result<MappedTable> {
        let mut t = MappedTable {
            info: files.info,
            rows_per_shard: files.rows_per_shard,
            stride: files.row_stride,
            gpu,
            bases: Vec::new(),
            maps: Vec::new(),
        };
        for (i, s) in files.shards.iter().enumerate() {
            let shard_bytes = (s.rows - 1) * files.row_stride + files.info.row_bytes() as u64;
            let p = s.path.display();
            let f = File::open(&s.path).io_ctx(&s.path, || "opening")?;
            // SAFETY: the mapping is read-only and the module contract
            // forbids modifying shard files while they are mapped.
            let m = unsafe { Mmap::map(&f) }.io_ctx(&s.path, || "mapping")?;
            if s.data_offset + shard_bytes > m.len() as u64 {
                return Err(StorageError::Truncated {
                    path: s.path.clone(),
                    what: format!("shard {i}"),
                    offset: s.data_offset,
                    needed: shard_bytes,
                    got: (m.len() as u64).saturating_sub(s.data_offset),
                });
            }
            if let Err(e) = m.advise(Advice::Random) {
                tracing::warn!(file = %p, error = %e, "madvise(RANDOM) failed");
            }
            // SAFETY: the mapping lives in `t.maps` until after `Drop`
            // unregisters it; the device only reads through it.
            let dev = unsafe {
                t.gpu
                    .register_host(m.as_ptr() as *mut u8, m.len(), "ple mapped table shard")
            }
            .map_err(|e| StorageError::device(format!("registering the mapping of {p}"), e))?;
            t.maps.push(m);
            t.bases.push((dev, s.data_offset, s.scale_offset));
        }
        Ok(t)
    }

    fn check(&self, id: u64) -> Result<()> {
        check_row(id, self.info.rows)
    }
}

impl RowTable for MappedTable {
    fn info(&self) -> TableInfo {
        self.info
    }

    fn max_resolve(&self) -> usize {
        usize::MAX
    }

    fn resolve(&self, ids: &[u64], out: &mut [RowRef]) -> Result<Lease> {
        let stride = self.stride;
        resolve_in_place(ids, out, self.info.rows, |id| {
            let (base, d0, s0) = self.bases[(id / self.rows_per_shard) as usize];
            let r = id % self.rows_per_shard;
            RowRef {
                data: base.0 + d0 + r * stride,
                scale: s0.map_or(0, |s0| base.0 + s0 + r * 4),
            }
        })
    }

    fn release(
        &self,
        lease: Lease,
        gpu: &dyn GpuBackend,
        after: Option<EventHandle>,
    ) -> Result<()> {
        release_in_place(lease, gpu, after, "does not belong to a mapped table")
    }

    fn prefetch(&self, ids: &[u64]) -> Result<()> {
        ids.iter().try_for_each(|&id| self.check(id))
    }

    fn stats(&self) -> TableStats {
        TableStats::default()
    }
}

impl Drop for MappedTable {
    fn drop(&mut self) {
        for (dev, _, _) in self.bases.drain(..) {
            if let Err(e) = self.gpu.dealloc(dev) {
                tracing::warn!(error = %e, "unregistering a mapped shard failed");
            }
        }
        // `maps` drop after this, once nothing is registered.
    }
}
