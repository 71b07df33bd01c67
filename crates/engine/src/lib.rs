//! metrale-engine: the PLE part of a model driven as a server drives it.
//!
//! - [`snapshot`]: the self-describing, checksummed container around the
//!   per-site aux blobs of a sequence's carry, and the geometry fingerprint
//!   that decides whether a snapshot fits an engine;
//! - [`prefix_cache`]: a radix tree over token ids holding snapshots at block
//!   boundaries, bounded by bytes with LRU eviction;
//! - [`budget`]: accounting of the device memory held by carries, and the
//!   policy that picks sequences to preempt when it runs short;
//! - [`engine`]: sequences over the PLE sites: add, chunked prefill, batched
//!   decode, speculative verify and commit, swap, release;
//! - [`ple_site`]: the PLE layer as an engine site;
//! - [`testing`]: tiny real PLE models with random weights for tests,
//!   benchmarks and demos.

pub mod budget;
pub mod engine;
pub mod ple_site;
pub mod prefix_cache;
pub mod snapshot;
pub mod testing;
