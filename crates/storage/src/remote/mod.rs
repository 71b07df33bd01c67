//! The remote row tier: rows served from other hosts' memory, read by the
//! row cache ([`crate::cached::CachedTable`]) on a miss instead of the
//! shard files, so the cache, its host-memory tier, step prefetch and
//! look-ahead work unchanged in front of it.
//!
//! Two small traits keep the transport apart, so that another store (RDMA,
//! say) is one more implementation:
//! - [`RemoteTier`]: a set of servers; [`RemoteTier::open`] checks that they
//!   hold a complete load of one table and gives its [`RemoteRows`];
//! - [`RemoteRows`]: [`RemoteRows::fetch`] fills the cache slots of a batch
//!   of rows, all of them or an error.
//!
//! [`redis::RedisTier`] implements them over Redis-protocol servers
//! (Debian's `redis-server`, Valkey), rows sharded by [`format::server_of`],
//! one `MGET` per server per batch, the servers asked in parallel;
//! [`push::push_table`] loads a table onto them. [`format`] is the key,
//! value and manifest format (docs/SPEC.md §9 (Row table and cache)),
//! [`link`] the connection handling shared with the engine's Redis carry
//! store.
//!
//! Invariants: a row is written into a slot only from a value that
//! [`format::decode_value`] accepted for that table and that row, so a
//! server never serves another table's rows or a damaged value; a fetch
//! that fails (a server down, slow past its timeout, a row missing, a bad
//! value) returns a [`StorageError::Remote`] and the cache unmaps every
//! slot of the batch, as for a failed disk read.

pub mod format;
pub mod link;
pub mod push;
pub mod redis;

use std::sync::Arc;

use crate::error::{Result, StorageError};
use crate::layout::TableFiles;

/// Where one fetched row goes: its id, its slot's bytes and (for
/// [`crate::table::RowDType::Fp8E4M3`]) its slot's 4 scale bytes (empty
/// otherwise).
pub struct RowDst<'a> {
    /// The row.
    pub id: u64,
    /// The slot's row bytes (exactly the row's).
    pub row: &'a mut [u8],
    /// The slot's scale bytes (4, or none).
    pub scale: &'a mut [u8],
}

/// One table's rows on a remote tier.
pub trait RemoteRows: Send + Sync {
    /// The servers, for messages.
    fn describe(&self) -> String;

    /// Fill every `dst` with its row; returns the bytes received. On an
    /// error some may have been written; the caller uses none of them.
    fn fetch(&self, dst: &mut [RowDst<'_>]) -> Result<u64>;

    /// The caller read `rows` rows of a failed fetch from a local tier
    /// instead (counted in [`RemoteStats::fallback_rows`]).
    fn fell_back(&self, rows: u64);
}

/// A set of remote servers that tables are served from.
pub trait RemoteTier: Send + Sync {
    /// The servers, for messages.
    fn describe(&self) -> String;

    /// The rows of the table stored in `files`, once every server was
    /// found holding a complete load of it (else a
    /// [`StorageError::Remote`] with [`crate::error::RemoteFault::NotLoaded`]
    /// naming the server and what is wrong).
    fn open(&self, files: &TableFiles) -> Result<Arc<dyn RemoteRows>>;

    /// What the tier has done so far, over every table opened from it.
    fn stats(&self) -> RemoteStats;
}

/// Counters of a remote tier.
#[derive(Clone, Debug, Default)]
pub struct RemoteStats {
    /// Rows fetched and written into slots.
    pub rows: u64,
    /// Batches asked for ([`RemoteRows::fetch`] calls).
    pub batches: u64,
    /// Requests sent (one per server a batch touched).
    pub requests: u64,
    /// Value bytes received.
    pub bytes: u64,
    /// Batches that failed.
    pub failed_batches: u64,
    /// Values refused (wrong length, table, row or checksum).
    pub bad_values: u64,
    /// Rows a server should have held and did not.
    pub missing_rows: u64,
    /// Rows of failed fetches read from a local tier instead.
    pub fallback_rows: u64,
    /// CPU time the fetches took on this host, every thread together
    /// (nanoseconds).
    pub cpu_ns: u64,
    /// Wall time of each successful batch (nanoseconds), in order, the
    /// last [`LATENCY_SAMPLES`] at most.
    pub batch_ns: Vec<u64>,
}

/// Batch times a tier keeps for its percentiles.
pub const LATENCY_SAMPLES: usize = 1 << 16;

impl RemoteStats {
    /// The `q` quantile (0..=1) of the batch times, in microseconds.
    pub fn batch_us(&self, q: f64) -> Option<f64> {
        percentile_us(&self.batch_ns, q)
    }
}

/// The `q` quantile (nearest rank) of `ns`, in microseconds.
pub fn percentile_us(ns: &[u64], q: f64) -> Option<f64> {
    if ns.is_empty() {
        return None;
    }
    let mut v = ns.to_vec();
    v.sort_unstable();
    let i = ((q.clamp(0.0, 1.0) * v.len() as f64).ceil() as usize).clamp(1, v.len()) - 1;
    Some(v[i] as f64 / 1e3)
}

/// The CPU time of the calling thread (nanoseconds).
pub fn thread_cpu_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a valid timespec for the call to fill.
    let r = unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
    if r != 0 {
        return 0;
    }
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

/// The CPU time of the whole process, every thread, exited ones included
/// (nanoseconds).
pub fn process_cpu_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a valid timespec for the call to fill.
    let r = unsafe { libc::clock_gettime(libc::CLOCK_PROCESS_CPUTIME_ID, &mut ts) };
    if r != 0 {
        return 0;
    }
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

/// A [`StorageError::Remote`].
pub(crate) fn remote_error(
    server: &str,
    fault: crate::error::RemoteFault,
    message: impl Into<String>,
) -> StorageError {
    StorageError::Remote {
        server: server.to_string(),
        fault,
        message: message.into(),
    }
}
