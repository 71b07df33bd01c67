//! One Redis-protocol server behind a small pool of synchronous
//! connections with connect, read and write timeouts, and a backoff while
//! the server is unreachable: the connection handling the carry store
//! (`metrale_engine::store::redis_store`) and the remote row tier share.
//!
//! Faults: any failed operation (refused, reset, timed out, a reply that
//! does not parse) drops the connection it used and every idle one, and
//! marks the server down for a backoff that doubles from
//! [`LinkConfig::backoff_min`] up to [`LinkConfig::backoff_max`]. While
//! down, calls fail at once with [`LinkError::Unavailable`] without
//! touching the network (or, given a deadline, wait for the backoff to end
//! when it ends before the deadline); the first call after the backoff
//! tries to connect again. A link that is down at start is just down:
//! opening never connects.
//!
//! Invariant: no call blocks longer than about the connect timeout plus
//! the read and write timeouts (plus the wait a caller allowed).

use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// Timeouts, pool and backoff of a [`RedisLink`].
#[derive(Clone, Debug)]
pub struct LinkConfig {
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
}

impl Default for LinkConfig {
    fn default() -> Self {
        LinkConfig {
            connect_timeout: Duration::from_millis(200),
            io_timeout: Duration::from_millis(250),
            pool_size: 4,
            backoff_min: Duration::from_millis(50),
            backoff_max: Duration::from_secs(2),
        }
    }
}

/// Why a call through a [`RedisLink`] failed.
#[derive(Debug)]
pub enum LinkError {
    /// The server is backing off after a failure; nothing was sent.
    Unavailable {
        /// Time left before the next attempt.
        retry_in_ms: u64,
        /// The failure that started the backoff.
        cause: String,
    },
    /// Connecting or the command failed (the server is now backing off).
    Redis(redis::RedisError),
}

impl LinkError {
    /// Whether the call ran into a timeout.
    pub fn is_timeout(&self) -> bool {
        matches!(self, LinkError::Redis(e) if e.is_timeout())
    }

    /// Whether the connection failed (refused, reset, closed), as opposed
    /// to a reply that does not parse or a server error.
    pub fn is_connection(&self) -> bool {
        matches!(self, LinkError::Redis(e)
            if e.is_io_error() || e.is_connection_refusal() || e.is_connection_dropped())
    }
}

impl std::fmt::Display for LinkError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            LinkError::Unavailable { retry_in_ms, cause } => {
                write!(f, "unavailable for {retry_in_ms} more ms after: {cause}")
            }
            LinkError::Redis(e) => write!(f, "{e}"),
        }
    }
}

struct Health {
    down_until: Option<Instant>,
    backoff: Duration,
    last_error: String,
    was_down: bool,
}

/// One server's connections. See the module docs.
pub struct RedisLink {
    client: redis::Client,
    url: String,
    cfg: LinkConfig,
    idle: Mutex<Vec<redis::Connection>>,
    health: Mutex<Health>,
    reconnects: AtomicU64,
    failures: AtomicU64,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl RedisLink {
    /// A link to `url` (`redis://HOST:PORT[/DB]`). Only the address is
    /// checked here; nothing connects until the first call.
    pub fn open(url: &str, cfg: LinkConfig) -> Result<RedisLink, redis::RedisError> {
        let client = redis::Client::open(url)?;
        Ok(RedisLink {
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

    /// The address given to [`Self::open`].
    pub fn url(&self) -> &str {
        &self.url
    }

    /// The link's settings.
    pub fn config(&self) -> &LinkConfig {
        &self.cfg
    }

    /// Connections opened again after the server had been marked down.
    pub fn reconnects(&self) -> u64 {
        self.reconnects.load(Ordering::Relaxed)
    }

    /// Operations that failed (each one started a backoff).
    pub fn failures(&self) -> u64 {
        self.failures.load(Ordering::Relaxed)
    }

    /// Ok when a call may go out now; with `wait_until`, first sleep out a
    /// backoff that ends before it.
    fn check_up(&self, wait_until: Option<Instant>) -> Result<(), LinkError> {
        let down_until = {
            let h = lock(&self.health);
            match h.down_until {
                Some(t) if Instant::now() < t => (t, h.last_error.clone()),
                _ => return Ok(()),
            }
        };
        let (t, cause) = down_until;
        match wait_until {
            Some(w) if t <= w => {
                std::thread::sleep(t.saturating_duration_since(Instant::now()));
                Ok(())
            }
            _ => Err(LinkError::Unavailable {
                retry_in_ms: t.saturating_duration_since(Instant::now()).as_millis() as u64,
                cause,
            }),
        }
    }

    /// Start a backoff after a failure found above the connection (a
    /// server that answers but lacks what it should hold): later calls
    /// wait for the backoff, as after a connection failure, so a caller
    /// retrying does not spin against a server being reloaded.
    pub(crate) fn mark_failed(&self, cause: String) {
        self.mark_down(cause);
    }

    fn mark_down(&self, cause: String) {
        self.failures.fetch_add(1, Ordering::Relaxed);
        lock(&self.idle).clear();
        let mut h = lock(&self.health);
        h.down_until = Some(Instant::now() + h.backoff);
        h.backoff = (h.backoff * 2).min(self.cfg.backoff_max);
        h.last_error = cause;
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

    /// Run `f` on a pooled (or new) connection. `op` names the call in the
    /// backoff's cause; with `wait_until`, a backoff ending before it is
    /// slept out instead of failing at once.
    pub fn run<T>(
        &self,
        op: &str,
        wait_until: Option<Instant>,
        f: impl FnOnce(&mut redis::Connection) -> redis::RedisResult<T>,
    ) -> Result<T, LinkError> {
        self.check_up(wait_until)?;
        let pooled = lock(&self.idle).pop();
        let mut conn = match pooled {
            Some(c) => c,
            None => match self.connect() {
                Ok(c) => c,
                Err(e) => {
                    self.mark_down(format!("{op}: {e}"));
                    return Err(LinkError::Redis(e));
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
                self.mark_down(format!("{op}: {e}"));
                Err(LinkError::Redis(e))
            }
        }
    }
}
