//! Tables that serve another table's rows under other ids: the one
//! decorator, [`Decorated`], and the id mapping it is used for, [`IdMap`].
//!
//! A [`Decoration`] says only what differs from the table beneath (how
//! many rows are presented, which inner row an id reads, a hook on each
//! resolve); [`Decorated`] forwards everything else, so no wrapper repeats
//! the [`RowTable`] calls by hand. [`IdMap`] is the decoration a stored
//! table gets when it is cut (ids folded onto fewer stored rows, `id % m`)
//! and/or relaid (hot rows together, a permutation from logical to
//! physical row); the fold comes first, then the permutation.
//!
//! Invariants: `info().rows` is the decoration's row count and every other
//! field the inner table's; an id at or past it is refused with
//! [`StorageError::RowOutOfRange`] naming that count, before the inner
//! table sees the batch; leases, limits and statistics are the inner
//! table's; prefetch is advice, so out-of-range ids are skipped there and
//! refused by the resolve that follows.

use std::sync::Arc;

use metrale_gpu_runtime::gpu::{EventHandle, GpuBackend};

use crate::error::{Result, StorageError};
use crate::table::{Lease, RowRef, RowTable, TableInfo, TableStats, check_out_len};

/// What a [`Decorated`] table changes about the table beneath it. Every
/// method defaults to passing the inner table's answer through.
pub trait Decoration: Send + Sync {
    /// Rows presented, given the inner table's row count.
    fn rows(&self, inner_rows: u64) -> u64 {
        inner_rows
    }
    /// The inner row that id `id` reads; called only for `id < rows`.
    fn inner_id(&self, id: u64) -> u64 {
        id
    }
    /// Called with the ids of each resolve, as asked, before it runs.
    fn on_resolve(&self, ids: &[u64]) {
        let _ = ids;
    }
    /// Whether to report that every resolve would wait for reads, whatever
    /// the inner table holds (so a layer takes its pipelined path).
    fn always_waits(&self) -> bool {
        false
    }
}

/// A [`RowTable`] serving `inner`'s rows as the decoration `D` says.
pub struct Decorated<D> {
    inner: Arc<dyn RowTable>,
    deco: D,
    rows: u64,
}

impl<D: Decoration> Decorated<D> {
    /// `inner` under the decoration `deco`.
    pub fn new(inner: Arc<dyn RowTable>, deco: D) -> Self {
        let rows = deco.rows(inner.info().rows);
        Decorated { inner, deco, rows }
    }

    /// The decoration.
    pub fn decoration(&self) -> &D {
        &self.deco
    }

    /// The table beneath.
    pub fn inner(&self) -> &Arc<dyn RowTable> {
        &self.inner
    }

    /// The inner ids of `ids`, each checked against the rows presented.
    fn map(&self, ids: &[u64]) -> Result<Vec<u64>> {
        ids.iter()
            .map(|&id| {
                crate::layout::check_row(id, self.rows)?;
                Ok(self.deco.inner_id(id))
            })
            .collect()
    }
}

impl<D: Decoration> RowTable for Decorated<D> {
    fn info(&self) -> TableInfo {
        TableInfo {
            rows: self.rows,
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
        self.deco.always_waits() || self.map(ids).map_or(true, |m| self.inner.would_wait(&m))
    }
    fn resolve(&self, ids: &[u64], out: &mut [RowRef]) -> Result<Lease> {
        self.deco.on_resolve(ids);
        check_out_len(ids, out)?;
        self.inner.resolve(&self.map(ids)?, out)
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
        let mapped: Vec<u64> = ids
            .iter()
            .filter(|&&id| id < self.rows)
            .map(|&id| self.deco.inner_id(id))
            .collect();
        self.inner.prefetch(&mapped)
    }
    fn stats(&self) -> TableStats {
        self.inner.stats()
    }
}

/// How a stored table's rows are addressed: ids below `logical_rows`
/// folded onto the stored rows (`id % stored`), then, when the rows were
/// relaid, sent to their physical row.
#[derive(Clone, Debug)]
pub struct IdMap {
    logical_rows: u64,
    stored_rows: u64,
    /// Entry `i` is the physical row of stored row `i`.
    remap: Option<Arc<[u32]>>,
}

/// A table served through an [`IdMap`].
pub type IdMapped = Decorated<IdMap>;

impl IdMap {
    /// The map for a table of `stored_rows` rows addressed by ids below
    /// `logical_rows` (equal: no folding), its rows stored in the order
    /// `remap` gives (entry `i` the physical row of row `i`; a permutation
    /// of `0..stored_rows`, as the remap file's reader checks). Refused
    /// unless `0 < stored_rows <= logical_rows` and `remap` has one entry
    /// per stored row.
    pub fn new(logical_rows: u64, stored_rows: u64, remap: Option<Arc<[u32]>>) -> Result<IdMap> {
        if stored_rows == 0 || stored_rows > logical_rows {
            return Err(StorageError::invalid(format!(
                "a folded table needs 0 < stored rows ({stored_rows}) <= logical rows \
                 ({logical_rows})"
            )));
        }
        if let Some(r) = &remap
            && r.len() as u64 != stored_rows
        {
            return Err(StorageError::invalid(format!(
                "a remap of {} rows for a table of {stored_rows}",
                r.len()
            )));
        }
        Ok(IdMap {
            logical_rows,
            stored_rows,
            remap,
        })
    }

    /// Whether ids reach the stored rows unchanged (nothing to decorate).
    pub fn is_identity(&self) -> bool {
        self.logical_rows == self.stored_rows && self.remap.is_none()
    }

    /// Serve `inner` (of the map's stored rows) through the map.
    pub fn apply(self, inner: Arc<dyn RowTable>) -> Result<IdMapped> {
        let rows = inner.info().rows;
        if rows != self.stored_rows {
            return Err(StorageError::invalid(format!(
                "an id map for {} stored rows over a table of {rows}",
                self.stored_rows
            )));
        }
        Ok(Decorated::new(inner, self))
    }
}

impl Decoration for IdMap {
    fn rows(&self, _inner_rows: u64) -> u64 {
        self.logical_rows
    }
    #[inline]
    fn inner_id(&self, id: u64) -> u64 {
        let stored = id % self.stored_rows;
        match &self.remap {
            Some(r) => r[stored as usize] as u64,
            None => stored,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::table::RowDType;

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
                crate::layout::check_row(id, self.0)?;
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
        let t = IdMap::new(100, 7, None)
            .unwrap()
            .apply(Arc::new(Fake(7)))
            .unwrap();
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
        assert!(IdMap::new(6, 7, None).is_err());
        assert!(
            IdMap::new(9, 8, None)
                .unwrap()
                .apply(Arc::new(Fake(7)))
                .is_err()
        );
    }

    #[test]
    fn folds_then_remaps() {
        let remap: Arc<[u32]> = Arc::from(vec![2u32, 0, 1]);
        let t = IdMap::new(10, 3, Some(remap))
            .unwrap()
            .apply(Arc::new(Fake(3)))
            .unwrap();
        let mut out = [RowRef::default(); 4];
        let _ = t.resolve(&[0, 1, 2, 4], &mut out).unwrap();
        // 4 folds to 1, which is stored at physical row 0.
        assert_eq!(out.map(|r| r.data), [1020, 1000, 1010, 1000]);
        assert!(IdMap::new(10, 3, Some(Arc::from(vec![0u32, 1]))).is_err());
        assert!(IdMap::new(3, 3, None).unwrap().is_identity());
        assert!(
            !IdMap::new(3, 3, Some(Arc::from(vec![0u32, 2, 1])))
                .unwrap()
                .is_identity()
        );
    }
}
