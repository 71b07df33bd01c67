//! metrale-storage: the PLE n-gram table and its row cache.
//!
//! [`table`] is the interface the layer uses; the resident, mapped, cached
//! and shared tables implement it. [`safetensors`] reads shard headers (and
//! writes files), [`layout`] validates a set of table shards and locates
//! rows in them, [`dtype`] converts BF16 and FP8 E4M3 elements.
//!
//! The four tables: [`resident::ResidentTable`] (rows in device memory),
//! [`mapped::MappedTable`] (shard files memory-mapped and registered as
//! device-addressable host memory), [`cached::CachedTable`] (a slot
//! arena in host-mapped memory filled by O_DIRECT reads through [`io`]) and
//! [`shared::SharedTable`] (the rows copied once per host into named
//! shared-memory segments every process maps).
//! [`spec`] describes a table (its parts, their id mapping, the mode and
//! the cache) and [`open`] serves any description: the one place a
//! [`TableMode`] picks a table. [`idmap`] serves a table under other ids
//! (folded when cut, remapped when relaid) and [`concat`] several tables
//! as one. Every fallible call returns [`StorageError`]. [`parts`] splits
//! batches larger than a table's `max_resolve`; [`pack`] aligns a shard's data section to 4 KiB;
//! [`relay`] rewrites a table's rows in a new order (hot rows together).
//! [`remote`] is the remote row tier a row cache can read its misses from
//! instead of the shard files (rows on Redis-protocol servers), and
//! `table push`'s loader; [`digest`] the one SHA-256; [`splitmix`] the one
//! splitmix64 mixer and stream; [`zipf`] the one Zipf
//! sampler of the synthetic workloads.

pub mod cached;
pub mod concat;
pub mod digest;
pub mod dtype;
pub mod error;
pub mod idmap;
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
pub mod spec;
pub mod splitmix;
pub mod table;
pub mod zipf;

pub use error::{RemoteFault, Result, StorageError};
pub use mode::TableMode;
pub use spec::{TablePart, TableSpec, open, open_files};
