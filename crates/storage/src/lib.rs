//! metrale-storage: the PLE n-gram table and its row cache.
//!
//! [`table`] is the interface the layer uses; the resident, mapped and
//! cached tables implement it. [`safetensors`] reads shard headers (and
//! writes files), [`layout`] validates a set of table shards and locates
//! rows in them, [`dtype`] converts BF16 and FP8 E4M3 elements.

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
