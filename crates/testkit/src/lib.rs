//! metrale-testkit: what the tests and benches of several crates share.
//! A dev-dependency only: no release code links it.
//!
//! - [`rng`]: [`rng::Rng`], a deterministic generator over the production
//!   splitmix64, so failures replay;
//! - [`rows`]: highway rows that are a function of the token prefix;
//! - [`tiny`]: tiny real PLE models with random weights over a small
//!   device-resident table, and engines over them;
//! - [`families`]: tiny real models of the Engram and LongCat families and
//!   engines over them;
//! - [`tensor_parallel`]: an in-process all-reduce for tensor-parallel
//!   ranks, and the tiny models' sites opened for one rank;
//! - [`toy`]: a toy engine site with the PLE carry's shape and simple math;
//! - [`shards`]: BF16 table shard files in the checkpoint's naming;
//! - [`fixtures`]: the golden fixtures the numpy references write;
//! - [`files`]: checkpoint files damaged on purpose (a tensor replaced or
//!   reshaped) for refusal tests;
//! - [`hooked_site`]: a site wrapper that shows each call to a test's
//!   hook, which notes it or fails it;
//! - [`hooked`]: a row table decoration that counts or logs resolves;
//! - [`drive`]: the plain sequential reference run and the randomised
//!   engine driver that checks every output row against it;
//! - [`same_bits`]: equality of two output slices bit for bit;
//! - [`redis`]: `redis-server` processes on free loopback ports.

pub mod drive;
pub mod families;
pub mod files;
pub mod fixtures;
pub mod hooked;
pub mod hooked_site;
pub mod redis;
pub mod rng;
pub mod rows;
pub mod shards;
pub mod tensor_parallel;
pub mod tiny;
pub mod toy;

pub use rng::Rng;

/// Whether `a` and `b` have the same length and every value the same bits
/// (so `-0.0 != 0.0` and a NaN equals only itself): the test of "the same
/// outputs" between two paths.
pub fn same_bits(a: &[f32], b: &[f32]) -> bool {
    a.len() == b.len() && a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits())
}
