//! A cut table: the full id range folded onto the rows actually stored.
//!
//! A synthetic flagship checkpoint keeps the real hash (ids up to 320
//! million) but stores only `m` rows per site (`ple_table_rows` in
//! config.json). [`FoldedTable`] presents the layer with a table of the full
//! padded size, so every id the hash produces is in range and the layer's
//! checks hold unchanged, and resolves id `i` to stored row `i % m`. The
//! fold happens here, where rows are resolved, and nowhere else.
//!
//! Invariants: `info().rows` is the logical (padded) row count; ids at or
//! past it are refused exactly as an unfolded table refuses them; leases,
//! prefetch and statistics are the inner table's.

use std::sync::Arc;

use metrale_gpu_runtime::gpu::{EventHandle, GpuBackend};
use metrale_storage::table::{Lease, RowRef, RowTable, TableInfo, TableStats};
use metrale_storage::{Result, StorageError};

/// A [`RowTable`] of `logical_rows` rows backed by a smaller one.
pub struct FoldedTable {
    inner: Arc<dyn RowTable>,
    logical_rows: u64,
    modulus: u64,
}

impl FoldedTable {
    /// Fold ids below `logical_rows` onto the `inner.info().rows` stored
    /// rows as `id % inner.info().rows`.
    pub fn new(inner: Arc<dyn RowTable>, logical_rows: u64) -> Result<Self> {
        let modulus = inner.info().rows;
        if modulus == 0 || modulus > logical_rows {
            return Err(StorageError::InvalidArgument {
                message: format!(
                    "a folded table needs 0 < stored rows ({modulus}) <= logical rows \
                     ({logical_rows})"
                ),
            });
        }
        Ok(FoldedTable {
            inner,
            logical_rows,
            modulus,
        })
    }

    fn fold(&self, ids: &[u64]) -> Result<Vec<u64>> {
        ids.iter()
            .map(|&id| {
                if id >= self.logical_rows {
                    return Err(StorageError::RowOutOfRange {
                        id,
                        rows: self.logical_rows,
                    });
                }
                Ok(id % self.modulus)
            })
            .collect()
    }
}

impl RowTable for FoldedTable {
    fn info(&self) -> TableInfo {
        TableInfo {
            rows: self.logical_rows,
            ..self.inner.info()
        }
    }
    fn max_resolve(&self) -> usize {
        self.inner.max_resolve()
    }
    fn max_pinned(&self) -> usize {
        self.inner.max_pinned()
    }
    fn would_wait(&self, ids: &[u64]) -> bool {
        // An id out of range is the resolve's to refuse.
        self.fold(ids).map_or(true, |f| self.inner.would_wait(&f))
    }
    fn resolve(&self, ids: &[u64], out: &mut [RowRef]) -> Result<Lease> {
        let folded = self.fold(ids)?;
        self.inner.resolve(&folded, out)
    }
    fn release(
        &self,
        lease: Lease,
        gpu: &dyn GpuBackend,
        after: Option<EventHandle>,
    ) -> Result<()> {
        self.inner.release(lease, gpu, after)
    }
    fn prefetch(&self, ids: &[u64]) -> Result<()> {
        // Prefetch is advisory; out-of-range ids are simply skipped here and
        // refused by the resolve that follows.
        let folded: Vec<u64> = ids
            .iter()
            .filter(|&&id| id < self.logical_rows)
            .map(|&id| id % self.modulus)
            .collect();
        self.inner.prefetch(&folded)
    }
    fn stats(&self) -> TableStats {
        self.inner.stats()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use metrale_storage::table::RowDType;

    /// Rows at fake addresses `1000 + 10 * id`, to see which row was asked.
    struct Fake(u64);
    impl RowTable for Fake {
        fn info(&self) -> TableInfo {
            TableInfo {
                rows: self.0,
                head_dim: 4,
                dtype: RowDType::Bf16,
            }
        }
        fn max_resolve(&self) -> usize {
            64
        }
        fn resolve(&self, ids: &[u64], out: &mut [RowRef]) -> Result<Lease> {
            for (i, &id) in ids.iter().enumerate() {
                if id >= self.0 {
                    return Err(StorageError::RowOutOfRange { id, rows: self.0 });
                }
                out[i] = RowRef {
                    data: 1000 + 10 * id,
                    scale: 0,
                };
            }
            Ok(Lease::empty())
        }
        fn release(&self, _: Lease, _: &dyn GpuBackend, _: Option<EventHandle>) -> Result<()> {
            Ok(())
        }
        fn prefetch(&self, _: &[u64]) -> Result<()> {
            Ok(())
        }
        fn stats(&self) -> TableStats {
            TableStats::default()
        }
    }

    #[test]
    fn folds_ids_onto_stored_rows() {
        let t = FoldedTable::new(Arc::new(Fake(7)), 100).unwrap();
        assert_eq!(t.info().rows, 100);
        assert_eq!(t.info().head_dim, 4);
        let mut out = [RowRef::default(); 3];
        let _ = t.resolve(&[3, 7, 96], &mut out).unwrap();
        assert_eq!(out.map(|r| r.data), [1030, 1000, 1050]);
        let e = t.resolve(&[100], &mut out[..1]).unwrap_err();
        assert!(matches!(
            e,
            StorageError::RowOutOfRange { id: 100, rows: 100 }
        ));
        let e = e.to_string();
        assert!(
            e.contains("row id 100 is past the end of the table (100 rows)"),
            "{e}"
        );
        assert!(FoldedTable::new(Arc::new(Fake(7)), 6).is_err());
    }
}
