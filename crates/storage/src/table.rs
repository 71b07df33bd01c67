//! The one interface the PLE layer uses to reach table rows.
//!
//! A [`RowTable`] turns row ids into device-readable [`RowRef`]s. Rows handed
//! out under a [`Lease`] stay where they are (never evicted or overwritten)
//! until the lease is released *and* the event given with the release has
//! completed, i.e. until the gather that reads them has actually run.
//!
//! Invariants:
//! - `resolve` never returns a reference to a row id `>= rows()`; such an id
//!   is an error naming it ([`crate::StorageError::RowOutOfRange`]);
//! - a failed `resolve` holds no pins and leaves the table as it was (the
//!   slots of a failed batch are unmapped, never half-filled);
//! - `resolve` accepts at most `max_resolve()` distinct ids (more is
//!   [`crate::StorageError::BatchTooLarge`]); callers split larger batches
//!   (the layer splits them, see `staging::part_end`);
//! - leases held together pin at most `max_pinned()` distinct rows; a
//!   caller that needs more must release earlier parts first (with the
//!   event of the gather that read them), see [`crate::parts`].

use metrale_gpu_runtime::gpu::{EventHandle, GpuBackend};

use crate::error::Result;

/// The element type of table rows.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum RowDType {
    /// `head_dim` BF16 values, 2 bytes each.
    Bf16,
    /// `head_dim` FP8 E4M3 values, 1 byte each, times a per-row f32 scale.
    Fp8E4M3,
    /// `head_dim` FP8 E4M3 values, 1 byte each, then one UE8M0 scale byte
    /// (a power of two, [`crate::dtype::ue8m0_to_f32`]) per block of
    /// [`crate::dtype::FP8_BLOCK`] values, inline in the row: a row of 256
    /// values is 264 bytes. `head_dim` must be a multiple of the block.
    Fp8E4M3Block32,
    /// `head_dim` F32 values, 4 bytes each: a table saved in float32 by
    /// transformers, served as stored (the layer projects the values
    /// exactly; `table pack` does not convert it).
    F32,
}

impl RowDType {
    /// Bytes of one value (the scales of [`RowDType::Fp8E4M3Block32`] come
    /// on top, see [`Self::row_bytes`]).
    pub fn elem_bytes(self) -> usize {
        match self {
            RowDType::F32 => 4,
            RowDType::Bf16 => 2,
            RowDType::Fp8E4M3 | RowDType::Fp8E4M3Block32 => 1,
        }
    }

    /// Bytes one row of `head_dim` values occupies in the table: the values,
    /// plus the inline block scales of [`RowDType::Fp8E4M3Block32`] (the
    /// per-row scale of [`RowDType::Fp8E4M3`] is stored apart).
    pub fn row_bytes(self, head_dim: usize) -> usize {
        match self {
            RowDType::Fp8E4M3Block32 => crate::dtype::fp8_block_row_bytes(head_dim),
            _ => head_dim * self.elem_bytes(),
        }
    }

    /// Whether rows of `head_dim` values have this type's layout: any
    /// positive width, a multiple of [`crate::dtype::FP8_BLOCK`] for
    /// [`RowDType::Fp8E4M3Block32`].
    pub fn fits_head_dim(self, head_dim: usize) -> bool {
        match self {
            RowDType::Fp8E4M3Block32 => {
                head_dim > 0 && head_dim.is_multiple_of(crate::dtype::FP8_BLOCK)
            }
            _ => head_dim > 0,
        }
    }

    /// Whether rows carry a separate per-row f32 scale ([`RowRef::scale`]).
    pub fn has_row_scale(self) -> bool {
        self == RowDType::Fp8E4M3
    }
}

/// Shape of a table.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TableInfo {
    /// Rows addressable by ids (ids are `0..rows`).
    pub rows: u64,
    /// Values per row.
    pub head_dim: usize,
    /// Element type.
    pub dtype: RowDType,
}

impl TableInfo {
    /// Bytes of one row as stored: its values, and its block scales for
    /// [`RowDType::Fp8E4M3Block32`] (without the per-row scale of
    /// [`RowDType::Fp8E4M3`], which is stored apart).
    pub fn row_bytes(&self) -> usize {
        self.dtype.row_bytes(self.head_dim)
    }
}

/// Where one resolved row can be read by a kernel. `#[repr(C)]` because
/// arrays of it are uploaded to the device as-is.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RowRef {
    /// Device address of the row's values.
    pub data: u64,
    /// Device address of the row's f32 scale (FP8), or 0 (BF16).
    pub scale: u64,
}

/// Pins held on resolved rows. Give it back with [`RowTable::release`].
#[derive(Debug)]
#[must_use = "a lease must be released, or its rows stay pinned"]
pub struct Lease {
    /// Table-private identifier.
    pub id: u64,
    /// Number of rows pinned.
    pub pinned: usize,
}

impl Lease {
    /// A lease that pins nothing (resident and mapped tables).
    pub fn empty() -> Self {
        Lease { id: 0, pinned: 0 }
    }
}

/// Counters every table keeps. Tables without a cache report zeros for the
/// cache fields.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TableStats {
    /// Ids found in place.
    pub hits: u64,
    /// Ids that had to be read.
    pub misses: u64,
    /// Slots taken from other rows.
    pub evictions: u64,
    /// Bytes read from disk.
    pub bytes_read: u64,
    /// Read calls issued.
    pub read_calls: u64,
    /// Rows whose read span overlapped another row's in the same read.
    pub pages_coalesced: u64,
    /// Nanoseconds spent waiting for reads.
    pub io_wait_ns: u64,
    /// Misses of the row cache served from its host-memory tier instead of
    /// the disk (counted in `misses` too).
    pub host_hits: u64,
}

impl TableStats {
    /// The counts since the snapshot `before` (taken earlier of the same
    /// table).
    pub fn since(&self, before: &TableStats) -> TableStats {
        TableStats {
            hits: self.hits - before.hits,
            misses: self.misses - before.misses,
            evictions: self.evictions - before.evictions,
            bytes_read: self.bytes_read - before.bytes_read,
            read_calls: self.read_calls - before.read_calls,
            pages_coalesced: self.pages_coalesced - before.pages_coalesced,
            io_wait_ns: self.io_wait_ns - before.io_wait_ns,
            host_hits: self.host_hits - before.host_hits,
        }
    }

    /// Bytes read from disk per row read from disk (`misses` less
    /// `host_hits`), or 0 when no row was read.
    pub fn bytes_per_miss(&self) -> f64 {
        let disk = self.misses.saturating_sub(self.host_hits);
        if disk == 0 {
            0.0
        } else {
            self.bytes_read as f64 / disk as f64
        }
    }
}

impl std::ops::Add for TableStats {
    type Output = TableStats;

    /// Counter-wise sum (several tables' counters together).
    fn add(self, o: TableStats) -> TableStats {
        TableStats {
            hits: self.hits + o.hits,
            misses: self.misses + o.misses,
            evictions: self.evictions + o.evictions,
            bytes_read: self.bytes_read + o.bytes_read,
            read_calls: self.read_calls + o.read_calls,
            pages_coalesced: self.pages_coalesced + o.pages_coalesced,
            io_wait_ns: self.io_wait_ns + o.io_wait_ns,
            host_hits: self.host_hits + o.host_hits,
        }
    }
}

/// A source of table rows; see the module docs for the lease rules.
pub trait RowTable: Send + Sync {
    /// The table's shape.
    fn info(&self) -> TableInfo;
    /// The most distinct ids one `resolve` accepts.
    fn max_resolve(&self) -> usize;
    /// The most distinct rows live leases can keep pinned at once (every
    /// slot of a row cache): a caller that holds several leases together,
    /// as a prestaged decode step does until its gather has run, must stay
    /// within it or its last resolve finds no free slot. Tables that hold
    /// every row in place pin nothing; the default is `usize::MAX`.
    fn max_pinned(&self) -> usize {
        usize::MAX
    }
    /// Whether resolving `ids` now may block on reads (a row cache that
    /// does not hold every one of them loaded): a caller then gains by
    /// resolving the batch in parts and queueing the work on each part
    /// before resolving the next, so later parts are read while earlier
    /// ones are computed on; when nothing is missing, one resolve is
    /// cheaper. A hint only: a row may be evicted or loaded in between.
    /// Tables that hold every row in place never wait; the default is
    /// `false`.
    fn would_wait(&self, ids: &[u64]) -> bool {
        let _ = ids;
        false
    }
    /// Resolve `ids` to row references, writing `out[i]` for `ids[i]`.
    /// `out.len()` must equal `ids.len()`.
    fn resolve(&self, ids: &[u64], out: &mut [RowRef]) -> Result<Lease>;
    /// Release a lease. When `after` is given the pins are dropped only
    /// once that event has completed, and the table destroys the event
    /// then; without it they are dropped now.
    fn release(&self, lease: Lease, gpu: &dyn GpuBackend, after: Option<EventHandle>)
    -> Result<()>;
    /// Start reading rows that will be resolved soon. A no-op for tables
    /// that hold every row in place.
    fn prefetch(&self, ids: &[u64]) -> Result<()>;
    /// Counters so far.
    fn stats(&self) -> TableStats;
}

/// An error unless `out` has one slot per id, as `resolve` requires.
#[inline]
pub fn check_out_len(ids: &[u64], out: &[RowRef]) -> Result<()> {
    if out.len() != ids.len() {
        return Err(crate::StorageError::OutputLength {
            ids: ids.len(),
            out: out.len(),
        });
    }
    Ok(())
}

/// `resolve` of a table that holds every row in place: checks the lengths
/// and every id against `rows`, writes `locate(id)` for each, and hands out
/// an empty lease (nothing can be evicted).
pub(crate) fn resolve_in_place(
    ids: &[u64],
    out: &mut [RowRef],
    rows: u64,
    locate: impl Fn(u64) -> RowRef,
) -> Result<Lease> {
    check_out_len(ids, out)?;
    for (o, &id) in out.iter_mut().zip(ids) {
        crate::layout::check_row(id, rows)?;
        *o = locate(id);
    }
    Ok(Lease::empty())
}

/// `release` of a table that holds every row in place: only empty leases
/// are its own (`why` says which table refused another); the event, if
/// any, is destroyed at once since no pin waits on it.
pub(crate) fn release_in_place(
    lease: Lease,
    gpu: &dyn GpuBackend,
    after: Option<EventHandle>,
    why: &'static str,
) -> Result<()> {
    if lease.pinned != 0 {
        return Err(crate::StorageError::UnknownLease {
            lease: lease.id,
            why,
        });
    }
    if let Some(ev) = after {
        gpu.destroy_event(ev)?;
    }
    Ok(())
}
