//! A carry store in Redis: one key per snapshot (`SET` of the whole value,
//! so a reader sees a whole value or none), through the synchronous
//! client with connect, read and write timeouts and a small pool of
//! connections (the connection handling is [`RedisLink`], shared with the
//! remote row tier).
//!
//! Faults: any failed operation (refused, reset, timed out, a reply that
//! does not parse) drops the connection it used and every idle one, and
//! marks the store down for a backoff that doubles from
//! [`RedisConfig::backoff_min`] up to [`RedisConfig::backoff_max`]. While
//! down, calls fail at once with [`StoreError::Unavailable`] without
//! touching the network; the first call after the backoff tries to
//! connect again. A store that is down at start is just down: opening never
//! connects.
//!
//! Invariant: no call blocks longer than about the connect timeout plus
//! the read and write timeouts.

use std::time::Duration;

use metrale_storage::remote::link::{LinkConfig, LinkError, RedisLink};

use super::{CarryStore, StoreError, StoreKey};

/// Settings of a [`RedisStore`].
#[derive(Clone, Debug)]
pub struct RedisConfig {
    /// Most time to open a connection (TCP and the setup commands).
    pub connect_timeout: Duration,
    /// Most time one read or write of a command may take.
    pub io_timeout: Duration,
    /// Idle connections kept for reuse.
    pub pool_size: usize,
    /// First backoff after a failure.
    pub backoff_min: Duration,
    /// Longest backoff.
    pub backoff_max: Duration,
    /// Largest value put or accepted from a get.
    pub max_value_bytes: u64,
    /// Prefix of every key.
    pub key_prefix: String,
}

impl Default for RedisConfig {
    fn default() -> Self {
        RedisConfig {
            connect_timeout: Duration::from_millis(200),
            io_timeout: Duration::from_millis(250),
            pool_size: 4,
            backoff_min: Duration::from_millis(50),
            backoff_max: Duration::from_secs(2),
            max_value_bytes: 256 << 20,
            key_prefix: "metrale-ple:carry:".into(),
        }
    }
}

/// A Redis-backed store. See the module docs.
pub struct RedisStore {
    link: RedisLink,
    cfg: RedisConfig,
}

impl RedisStore {
    /// A store at `url` (`redis://HOST:PORT[/DB]`). Only the address is
    /// checked here; nothing connects until the first call.
    pub fn open(url: &str, cfg: RedisConfig) -> Result<RedisStore, StoreError> {
        let link_cfg = LinkConfig {
            connect_timeout: cfg.connect_timeout,
            io_timeout: cfg.io_timeout,
            pool_size: cfg.pool_size,
            backoff_min: cfg.backoff_min,
            backoff_max: cfg.backoff_max,
        };
        let link = RedisLink::open(url, link_cfg).map_err(|e| StoreError::Address {
            url: url.to_string(),
            reason: e.to_string(),
        })?;
        Ok(RedisStore { link, cfg })
    }

    /// Connections opened again after the store had been marked down.
    pub fn reconnects(&self) -> u64 {
        self.link.reconnects()
    }

    /// Operations that failed (each one started a backoff).
    pub fn failures(&self) -> u64 {
        self.link.failures()
    }

    fn key(&self, key: &StoreKey) -> String {
        format!("{}{}", self.cfg.key_prefix, key.hex())
    }

    fn run<T>(
        &self,
        op: &'static str,
        f: impl FnOnce(&mut redis::Connection) -> redis::RedisResult<T>,
    ) -> Result<T, StoreError> {
        // A carry store is an optimisation: while the server backs off,
        // calls fail at once rather than wait.
        self.link.run(op, None, f).map_err(|e| map_err(op, e))
    }
}

fn map_err(op: &'static str, e: LinkError) -> StoreError {
    if e.is_timeout() {
        return StoreError::Timeout { op };
    }
    let connection = e.is_connection();
    match e {
        LinkError::Unavailable { retry_in_ms, cause } => {
            StoreError::Unavailable { retry_in_ms, cause }
        }
        LinkError::Redis(e) if connection => StoreError::Backend {
            op,
            message: e.to_string(),
        },
        LinkError::Redis(e) => StoreError::Protocol {
            op,
            what: e.to_string(),
        },
    }
}

impl CarryStore for RedisStore {
    fn describe(&self) -> String {
        self.link.url().to_string()
    }

    fn put(&self, key: &StoreKey, value: &[u8]) -> Result<(), StoreError> {
        if value.len() as u64 > self.cfg.max_value_bytes {
            return Err(StoreError::TooLarge {
                bytes: value.len() as u64,
                limit: self.cfg.max_value_bytes,
            });
        }
        let k = self.key(key);
        self.run("put", |c| {
            redis::cmd("SET").arg(&k).arg(value).query::<()>(c)
        })
    }

    fn get(&self, key: &StoreKey) -> Result<Option<Vec<u8>>, StoreError> {
        let k = self.key(key);
        let v = self.run("get", |c| {
            redis::cmd("GET").arg(&k).query::<Option<Vec<u8>>>(c)
        })?;
        match v {
            Some(b) if b.len() as u64 > self.cfg.max_value_bytes => Err(StoreError::TooLarge {
                bytes: b.len() as u64,
                limit: self.cfg.max_value_bytes,
            }),
            v => Ok(v),
        }
    }

    fn delete(&self, key: &StoreKey) -> Result<(), StoreError> {
        let k = self.key(key);
        self.run("delete", |c| redis::cmd("DEL").arg(&k).query::<i64>(c))
            .map(|_| ())
    }
}
