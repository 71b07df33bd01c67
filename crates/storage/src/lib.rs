//! metrale-storage: the PLE n-gram table and its row cache.
//!
//! [`table`] is the interface the layer uses; the resident, mapped and
//! cached tables implement it. [`safetensors`] reads shard headers (and
//! writes files), [`layout`] validates a set of table shards and locates
//! rows in them, [`dtype`] converts BF16 and FP8 E4M3 elements.
//!
//! The three tables: [`resident::ResidentTable`] (rows in device memory),
//! [`mapped::MappedTable`] (shard files memory-mapped and registered as
//! device-addressable host memory) and [`cached::CachedTable`] (a slot
//! arena in host-mapped memory filled by O_DIRECT reads through [`io`]).
//! [`open_table`] opens any of them. [`parts`] splits batches larger than a
//! table's `max_resolve`; [`pack`] aligns a shard's data section to 4 KiB.

pub mod cached;
pub mod dtype;
pub mod io;
pub mod layout;
pub mod mapped;
pub mod pack;
pub mod parts;
pub mod resident;
pub mod safetensors;
pub mod table;

use std::sync::Arc;

use anyhow::Result;
use metrale_gpu_runtime::gpu::GpuBackend;

/// Which kind of table to open.
#[derive(Clone)]
pub enum TableKind {
    /// Every row copied to device memory ([`resident::ResidentTable`]).
    Resident,
    /// Shard files memory-mapped and registered ([`mapped::MappedTable`]).
    Mapped,
    /// Rows on disk behind a slot cache ([`cached::CachedTable`]).
    Cached(cached::CacheConfig),
}

/// Open the table stored in `files` as `kind`.
pub fn open_table(
    files: layout::TableFiles,
    gpu: Arc<dyn GpuBackend>,
    kind: TableKind,
) -> Result<Arc<dyn table::RowTable>> {
    Ok(match kind {
        TableKind::Resident => Arc::new(resident::ResidentTable::load(&files, gpu)?),
        TableKind::Mapped => Arc::new(mapped::MappedTable::open(&files, gpu)?),
        TableKind::Cached(cfg) => Arc::new(cached::CachedTable::open(files, gpu, cfg)?),
    })
}
