//! A BF16 table held whole in one device allocation, built from an array:
//! what `Layer.from_weights` serves rows from.
//!
//! Every row stays in place, so leases pin nothing and a release only
//! destroys its event.

use std::sync::Arc;

use metrale_gpu_runtime::gpu::{DevicePtr, EventHandle, GpuBackend};
use metrale_storage::table::{
    Lease, RowDType, RowRef, RowTable, TableInfo, TableStats, check_out_len,
};
use metrale_storage::{Result as StorageResult, StorageError};

/// Rows of `head_dim` BF16 values in device memory.
pub(crate) struct MemTable {
    gpu: Arc<dyn GpuBackend>,
    base: DevicePtr,
    info: TableInfo,
}

impl MemTable {
    /// Upload `bits` (`rows * head_dim` BF16 bit patterns, row-major).
    pub(crate) fn new(
        gpu: Arc<dyn GpuBackend>,
        bits: &[u16],
        head_dim: usize,
    ) -> anyhow::Result<MemTable> {
        anyhow::ensure!(head_dim > 0, "table: head_dim must be positive");
        anyhow::ensure!(
            !bits.is_empty() && bits.len().is_multiple_of(head_dim),
            "table: {} values are not a positive whole number of rows of {head_dim}",
            bits.len()
        );
        let bytes: Vec<u8> = bits.iter().flat_map(|b| b.to_le_bytes()).collect();
        let base = gpu.alloc(bytes.len(), "python.table")?;
        if let Err(e) = gpu.copy_h2d(&bytes, base) {
            let _ = gpu.dealloc(base);
            return Err(e.into());
        }
        Ok(MemTable {
            gpu,
            base,
            info: TableInfo {
                rows: (bits.len() / head_dim) as u64,
                head_dim,
                dtype: RowDType::Bf16,
            },
        })
    }
}

impl Drop for MemTable {
    fn drop(&mut self) {
        let _ = self.gpu.dealloc(self.base);
    }
}

impl RowTable for MemTable {
    fn info(&self) -> TableInfo {
        self.info
    }
    fn max_resolve(&self) -> usize {
        usize::MAX
    }
    fn resolve(&self, ids: &[u64], out: &mut [RowRef]) -> StorageResult<Lease> {
        check_out_len(ids, out)?;
        let row_bytes = self.info.row_bytes() as u64;
        for (o, &id) in out.iter_mut().zip(ids) {
            if id >= self.info.rows {
                return Err(StorageError::RowOutOfRange {
                    id,
                    rows: self.info.rows,
                });
            }
            *o = RowRef {
                data: self.base.addr() + id * row_bytes,
                scale: 0,
            };
        }
        Ok(Lease::empty())
    }
    fn release(
        &self,
        lease: Lease,
        gpu: &dyn GpuBackend,
        after: Option<EventHandle>,
    ) -> StorageResult<()> {
        if lease.pinned != 0 {
            return Err(StorageError::UnknownLease {
                lease: lease.id,
                why: "an in-memory table hands out empty leases only",
            });
        }
        if let Some(ev) = after {
            gpu.destroy_event(ev)?;
        }
        Ok(())
    }
    fn prefetch(&self, _ids: &[u64]) -> StorageResult<()> {
        Ok(())
    }
    fn stats(&self) -> TableStats {
        TableStats::default()
    }
}
