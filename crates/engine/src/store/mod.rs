//! Shared carry stores: prefix snapshots kept outside one process, so
//! processes serving one model restore each other's prefixes.
//!
//! A [`CarryStore`] puts, gets and deletes whole values under a
//! [`StoreKey`], the digest of (model identity, geometry fingerprint,
//! block-aligned token prefix) ([`key`]). A value is a snapshot container
//! behind a header naming the model and the key ([`value`]). Stores:
//! - [`dir::DirStore`]: one file per key in a directory, written to a
//!   temporary name and renamed into place;
//! - [`redis_store::RedisStore`]: one Redis key per value, with timeouts, a small
//!   connection pool and a backoff while the server is unreachable;
//! - [`memory::MemoryStore`]: an in-process map, for one process and tests.
//!
//! [`tier::CarryTier`] is what the engine holds: the store behind its
//! in-process prefix cache, with a bounded write-behind queue drained by a
//! worker thread, and the counters reported as [`CarryStoreStats`].
//!
//! Invariants: a store is an optimisation: every failure of it is a miss
//! or a dropped write, counted, never an error of a sequence; a value is
//! used only after the container's own checks, the model, the key, the
//! token count and the carried history all agree ([`value::open_value`]).

pub mod dir;
pub mod key;
pub mod memory;
pub mod redis_store;
pub mod tier;
pub mod value;

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use thiserror::Error;

pub use key::{ModelDigest, StoreKey};
pub use tier::{CarryStoreStats, CarryTier, TierConfig};
pub use value::MissCause;

/// Why a store call failed.
#[derive(Debug, Error)]
#[non_exhaustive]
pub enum StoreError {
    /// The store address does not parse or names an unknown kind.
    #[error("carry store address '{url}': {reason}")]
    Address {
        /// The address given.
        url: String,
        /// What is wrong with it.
        reason: String,
    },
    /// A file operation of a directory store failed.
    #[error("carry store: {op} {path}")]
    Io {
        /// What was being done.
        op: &'static str,
        /// The file or directory.
        path: PathBuf,
        /// The I/O error.
        #[source]
        source: std::io::Error,
    },
    /// The store is backing off after a failure; nothing was sent.
    #[error("carry store unavailable for {retry_in_ms} more ms after: {cause}")]
    Unavailable {
        /// Time left before the next attempt.
        retry_in_ms: u64,
        /// The failure that started the backoff.
        cause: String,
    },
    /// An operation took longer than its timeout.
    #[error("carry store {op} timed out")]
    Timeout {
        /// The operation.
        op: &'static str,
    },
    /// The connection failed (refused, reset, closed).
    #[error("carry store {op}: {message}")]
    Backend {
        /// The operation.
        op: &'static str,
        /// The client's description.
        message: String,
    },
    /// The server answered something that is not a valid reply.
    #[error("carry store {op}: unexpected reply: {what}")]
    Protocol {
        /// The operation.
        op: &'static str,
        /// The client's description.
        what: String,
    },
    /// A value over the size limit.
    #[error("carry store value of {bytes} bytes exceeds the limit of {limit} bytes")]
    TooLarge {
        /// The value's size.
        bytes: u64,
        /// The limit.
        limit: u64,
    },
}

/// A store of whole values by key, shared between processes. Every call
/// either completes or fails: a reader never sees half a value.
pub trait CarryStore: Send + Sync {
    /// The store's address, for reports.
    fn describe(&self) -> String;
    /// Store `value` under `key`, replacing any value there.
    fn put(&self, key: &StoreKey, value: &[u8]) -> Result<(), StoreError>;
    /// The value under `key`, or `None`.
    fn get(&self, key: &StoreKey) -> Result<Option<Vec<u8>>, StoreError>;
    /// Remove the value under `key` (nothing when there is none).
    fn delete(&self, key: &StoreKey) -> Result<(), StoreError>;
}

/// Settings for [`open_store`].
#[derive(Clone, Debug)]
pub struct OpenOptions {
    /// Redis: connect timeout.
    pub connect_timeout: Duration,
    /// Redis: read and write timeout.
    pub io_timeout: Duration,
    /// Largest value stored or read.
    pub max_value_bytes: u64,
}

impl Default for OpenOptions {
    fn default() -> Self {
        let r = redis_store::RedisConfig::default();
        OpenOptions {
            connect_timeout: r.connect_timeout,
            io_timeout: r.io_timeout,
            max_value_bytes: r.max_value_bytes,
        }
    }
}

/// Open the store at `url`: `redis://HOST:PORT[/DB]`, `dir:PATH` or
/// `mem:` (an in-process store of 256 MiB). A Redis store that cannot be
/// reached is opened all the same (it is down until it answers).
pub fn open_store(url: &str, opts: &OpenOptions) -> Result<Arc<dyn CarryStore>, StoreError> {
    if url.starts_with("redis://") {
        let cfg = redis_store::RedisConfig {
            connect_timeout: opts.connect_timeout,
            io_timeout: opts.io_timeout,
            max_value_bytes: opts.max_value_bytes,
            ..redis_store::RedisConfig::default()
        };
        return Ok(Arc::new(redis_store::RedisStore::open(url, cfg)?));
    }
    if let Some(path) = url.strip_prefix("dir:") {
        if path.is_empty() {
            return Err(StoreError::Address {
                url: url.into(),
                reason: "dir: needs a path".into(),
            });
        }
        return Ok(Arc::new(dir::DirStore::open(path, opts.max_value_bytes)?));
    }
    if url == "mem:" {
        return Ok(Arc::new(memory::MemoryStore::new(256 << 20)));
    }
    Err(StoreError::Address {
        url: url.into(),
        reason: "expected redis://HOST:PORT[/DB], dir:PATH or mem:".into(),
    })
}
