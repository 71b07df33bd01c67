//! metrale-storage: the PLE n-gram table and its row cache.
//!
//! [`table`] is the interface the layer uses; the resident, mapped and
//! cached tables implement it. [`safetensors`] reads shard headers (and
//! writes files), [`layout`] validates a set of table shards and locates
//! rows in them, [`dtype`] converts BF16 and FP8 E4M3 elements.
//!
//! The three tables: [`resident::ResidentTable`] (rows in device memory),
//! [`mapped::MappedTable`] (shard files memory-mapped and registered as
//! device-addressable host memory), [`cached::CachedTable`] (a slot
//! arena in host-mapped memory filled by O_DIRECT reads through [`io`]) and
//! [`shared::SharedTable`] (the rows copied once per host into named
//! shared-memory segments every process maps).
//! [`open_table`] opens any of them, as a [`TableMode`] says. Every
//! fallible call returns [`StorageError`]. [`parts`] splits batches larger than a
//! table's `max_resolve`; [`pack`] aligns a shard's data section to 4 KiB;
//! [`relay`] rewrites a table's rows in a new order (hot rows together).
//! [`remote`] is the remote row tier a row cache can read its misses from
//! instead of the shard files (rows on Redis-protocol servers), and
//! `table push`'s loader; [`digest`] the one SHA-256; [`splitmix`] the one
//! splitmix64 mixer and stream; `zipf` (feature `bench`) the one Zipf
//! sampler of the synthetic workloads.

#[cfg(feature = "bench")]
pub mod bench;
pub mod cached;
pub mod digest;
pub mod dtype;
pub mod error;
pub mod io;
pub mod layout;
pub mod mapped;
mod mode;
pub mod pack;
pub mod parts;
pub mod relay;
pub mod remote;
pub mod resident;
pub mod safetensors;
pub mod shared;
pub mod splitmix;
pub mod table;
#[cfg(feature = "bench")]
pub mod zipf;

use std::sync::Arc;

use metrale_gpu_runtime::gpu::GpuBackend;

pub use error::{RemoteFault, Result, StorageError};
pub use mode::TableMode;

/// Open the table stored in `files`, serving its rows as `mode` says;
/// `cache` configures the row cache and is used only by
/// [`TableMode::Cached`].
pub fn open_table(
    files: layout::TableFiles,
    gpu: Arc<dyn GpuBackend>,
    mode: TableMode,
    cache: cached::CacheConfig,
) -> Result<Arc<dyn table::RowTable>> {
    Ok(match mode {
        TableMode::Resident => Arc::new(resident::ResidentTable::load(&files, gpu)?),
        TableMode::Mapped => Arc::new(mapped::MappedTable::open(&files, gpu)?),
        TableMode::Cached => Arc::new(cached::CachedTable::open(files, gpu, cache)?),
        TableMode::Shared => Arc::new(shared::SharedTable::open(&files, gpu)?),
    })
}
