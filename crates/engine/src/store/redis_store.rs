//! A carry store in Redis: one key per snapshot (`SET` of the whole value,
//! so a reader sees a whole value or none), through the synchronous
//! client with connect, read and write timeouts and a small pool of
//! connections.
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

use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

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

struct Health {
    down_until: Option<Instant>,
    backoff: Duration,
    last_error: String,
    was_down: bool,
}

/// A Redis-backed store. See the module docs.
pub struct RedisStore {
    client: redis::Client,
    url: String,
    cfg: RedisConfig,
    idle: Mutex<Vec<redis::Connection>>,
    health: Mutex<Health>,
    reconnects: AtomicU64,
    failures: AtomicU64,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl RedisStore {
    /// A store at `url` (`redis://HOST:PORT[/DB]`). Only the address is
    /// checked here; nothing connects until the first call.
    pub fn open(url: &str, cfg: RedisConfig) -> Result<RedisStore, StoreError> {
        let client = redis::Client::open(url).map_err(|e| StoreError::Address {
            url: url.to_string(),
            reason: e.to_string(),
        })?;
        Ok(RedisStore {
            client,
            url: url.to_string(),
            health: Mutex::new(Health {
                down_until: None,
                backoff: cfg.backoff_min,
                last_error: String::new(),
                was_down: false,
            }),
            cfg,
            idle: Mutex::new(Vec::new()),
            reconnects: AtomicU64::new(0),
            failures: AtomicU64::new(0),
        })
    }

    /// Connections opened again after the store had been marked down.
    pub fn reconnects(&self) -> u64 {
        self.reconnects.load(Ordering::Relaxed)
    }

    /// Operations that failed (each one started a backoff).
    pub fn failures(&self) -> u64 {
        self.failures.load(Ordering::Relaxed)
    }

    fn key(&self, key: &StoreKey) -> String {
        format!("{}{}", self.cfg.key_prefix, key.hex())
    }

    fn check_up(&self) -> Result<(), StoreError> {
        let h = lock(&self.health);
        match h.down_until {
            Some(t) if Instant::now() < t => Err(StoreError::Unavailable {
                retry_in_ms: (t - Instant::now()).as_millis() as u64,
                cause: h.last_error.clone(),
            }),
            _ => Ok(()),
        }
    }

    fn mark_down(&self, cause: &str) {
        self.failures.fetch_add(1, Ordering::Relaxed);
        lock(&self.idle).clear();
        let mut h = lock(&self.health);
        h.down_until = Some(Instant::now() + h.backoff);
        h.backoff = (h.backoff * 2).min(self.cfg.backoff_max);
        h.last_error = cause.to_string();
        h.was_down = true;
    }

    fn mark_up(&self) {
        let mut h = lock(&self.health);
        h.down_until = None;
        h.backoff = self.cfg.backoff_min;
    }

    fn connect(&self) -> Result<redis::Connection, redis::RedisError> {
        let c = self
            .client
            .get_connection_with_timeout(self.cfg.connect_timeout)?;
        c.set_read_timeout(Some(self.cfg.io_timeout))?;
        c.set_write_timeout(Some(self.cfg.io_timeout))?;
        let mut h = lock(&self.health);
        if h.was_down {
            h.was_down = false;
            self.reconnects.fetch_add(1, Ordering::Relaxed);
        }
        Ok(c)
    }

    fn run<T>(
        &self,
        op: &'static str,
        f: impl FnOnce(&mut redis::Connection) -> redis::RedisResult<T>,
    ) -> Result<T, StoreError> {
        self.check_up()?;
        let pooled = lock(&self.idle).pop();
        let mut conn = match pooled {
            Some(c) => c,
            None => match self.connect() {
                Ok(c) => c,
                Err(e) => {
                    let err = map_err(op, &e);
                    self.mark_down(&err.to_string());
                    return Err(err);
                }
            },
        };
        match f(&mut conn) {
            Ok(v) => {
                self.mark_up();
                let mut idle = lock(&self.idle);
                if idle.len() < self.cfg.pool_size {
                    idle.push(conn);
                }
                Ok(v)
            }
            Err(e) => {
                let err = map_err(op, &e);
                self.mark_down(&err.to_string());
                Err(err)
            }
        }
    }
}

fn map_err(op: &'static str, e: &redis::RedisError) -> StoreError {
    if e.is_timeout() {
        StoreError::Timeout { op }
    } else if e.is_io_error() || e.is_connection_refusal() || e.is_connection_dropped() {
        StoreError::Backend {
            op,
            message: e.to_string(),
        }
    } else {
        StoreError::Protocol {
            op,
            what: e.to_string(),
        }
    }
}

impl CarryStore for RedisStore {
    fn describe(&self) -> String {
        self.url.clone()
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
