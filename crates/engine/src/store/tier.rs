//! The engine's second tier: a [`CarryStore`] behind the in-process prefix
//! cache, with a write-behind queue and counters.
//!
//! Reads are synchronous (the engine needs the carry before it can
//! prefill), bounded by the store's own timeouts and by the number of
//! block boundaries probed. Writes go through a bounded queue to one
//! worker thread; when the queue is full the write is dropped and counted,
//! so a slow or dead store never holds a step up.
//!
//! Invariants: every lookup ends as exactly one hit or one miss of one
//! cause; a key is offered for writing at most once per tier (until the
//! bounded memory of written keys is reset); dropping the tier lets the
//! worker finish what is queued and joins it.

use std::collections::HashSet;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, Sender, TrySendError, bounded};
use metrale_model_layers::layers::ple::SiteSpec;

use super::value::{MissCause, open_value, seal_snapshot};
use super::{CarryStore, ModelDigest, StoreError, StoreKey};
use crate::snapshot::Snapshot;

/// Settings of a [`CarryTier`].
#[derive(Clone, Debug)]
pub struct TierConfig {
    /// The model identity values are stored for (a name or a digest of the
    /// checkpoint's configuration).
    pub model_id: String,
    /// Most block boundaries probed per lookup, longest first.
    pub max_probes: usize,
    /// Writes queued for the worker; more are dropped.
    pub queue_len: usize,
    /// Most time `close` waits for queued writes.
    pub flush_timeout: Duration,
}

impl TierConfig {
    /// Defaults for `model_id`: 8 probes, 256 queued writes, 10 s flush.
    pub fn new(model_id: impl Into<String>) -> TierConfig {
        TierConfig {
            model_id: model_id.into(),
            max_probes: 8,
            queue_len: 256,
            flush_timeout: Duration::from_secs(10),
        }
    }
}

/// Counters of a shared carry store as the engine used it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CarryStoreStats {
    /// Values asked for (one per probed block boundary).
    pub lookups: u64,
    /// Sequences whose prefix was restored from the store.
    pub hits: u64,
    /// Tokens restored from the store instead of computed.
    pub tokens_restored: u64,
    /// Bytes of the values restored.
    pub bytes_restored: u64,
    /// Nanoseconds spent restoring from the store (get, checks, restore).
    pub restore_ns: u64,
    /// Lookups that found no value.
    pub miss_absent: u64,
    /// Lookups whose value was corrupt (CRC, header, length, history).
    pub miss_corrupt: u64,
    /// Lookups whose value was from another geometry.
    pub miss_geometry: u64,
    /// Lookups whose value was from another model.
    pub miss_model: u64,
    /// Lookups the store could not answer (down, slow, garbage, backing
    /// off).
    pub miss_error: u64,
    /// Values written.
    pub puts: u64,
    /// Bytes written.
    pub put_bytes: u64,
    /// Writes that failed.
    pub put_errors: u64,
    /// Writes dropped because the queue was full.
    pub drops: u64,
    /// Calls not sent because the store was backing off.
    pub skipped: u64,
    /// Calls sent that failed (gets and puts).
    pub errors: u64,
    /// Median get latency, microseconds.
    pub get_p50_us: u64,
    /// 99th percentile get latency, microseconds.
    pub get_p99_us: u64,
    /// Median put latency, microseconds.
    pub put_p50_us: u64,
    /// 99th percentile put latency, microseconds.
    pub put_p99_us: u64,
}

/// The most latency samples kept per kind (the latest ones).
const SAMPLES: usize = 4096;

#[derive(Default)]
struct Ring {
    v: Vec<u32>,
    at: usize,
}

impl Ring {
    fn push(&mut self, d: Duration) {
        let us = d.as_micros().min(u32::MAX as u128) as u32;
        if self.v.len() < SAMPLES {
            self.v.push(us);
        } else {
            self.v[self.at] = us;
            self.at = (self.at + 1) % SAMPLES;
        }
    }

    fn percentiles(&self) -> (u64, u64) {
        if self.v.is_empty() {
            return (0, 0);
        }
        let mut s = self.v.clone();
        s.sort_unstable();
        let at = |p: usize| s[(s.len() - 1) * p / 100] as u64;
        (at(50), at(99))
    }
}

#[derive(Default)]
struct Counters {
    lookups: AtomicU64,
    hits: AtomicU64,
    tokens_restored: AtomicU64,
    bytes_restored: AtomicU64,
    restore_ns: AtomicU64,
    miss_absent: AtomicU64,
    miss_corrupt: AtomicU64,
    miss_geometry: AtomicU64,
    miss_model: AtomicU64,
    miss_error: AtomicU64,
    puts: AtomicU64,
    put_bytes: AtomicU64,
    put_errors: AtomicU64,
    drops: AtomicU64,
    skipped: AtomicU64,
    errors: AtomicU64,
    get_lat: Mutex<Ring>,
    put_lat: Mutex<Ring>,
}

fn add(c: &AtomicU64, n: u64) {
    c.fetch_add(n, Ordering::Relaxed);
}

fn ring(m: &Mutex<Ring>) -> std::sync::MutexGuard<'_, Ring> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

enum Job {
    Put(StoreKey, Vec<u8>),
    Flush(Sender<()>),
}

/// The most keys remembered as written before the memory is reset.
const WRITTEN_CAP: usize = 1 << 16;

/// A store as the engine's second tier. See the module docs.
pub struct CarryTier {
    store: Arc<dyn CarryStore>,
    model: ModelDigest,
    cfg: TierConfig,
    counters: Arc<Counters>,
    tx: Option<Sender<Job>>,
    worker: Option<JoinHandle<()>>,
    written: HashSet<StoreKey>,
}

fn worker(store: Arc<dyn CarryStore>, rx: Receiver<Job>, c: Arc<Counters>) {
    for job in rx {
        match job {
            Job::Put(key, value) => {
                let t0 = Instant::now();
                match store.put(&key, &value) {
                    Ok(()) => {
                        ring(&c.put_lat).push(t0.elapsed());
                        add(&c.puts, 1);
                        add(&c.put_bytes, value.len() as u64);
                    }
                    Err(StoreError::Unavailable { .. }) => {
                        add(&c.skipped, 1);
                        add(&c.put_errors, 1);
                    }
                    Err(_) => {
                        ring(&c.put_lat).push(t0.elapsed());
                        add(&c.errors, 1);
                        add(&c.put_errors, 1);
                    }
                }
            }
            Job::Flush(done) => {
                let _ = done.send(());
            }
        }
    }
}

impl CarryTier {
    /// A tier over `store`, starting its writer thread.
    pub fn new(store: Arc<dyn CarryStore>, cfg: TierConfig) -> Result<CarryTier, StoreError> {
        let (tx, rx) = bounded(cfg.queue_len.max(1));
        let counters = Arc::new(Counters::default());
        let (s, c) = (store.clone(), counters.clone());
        let worker = std::thread::Builder::new()
            .name("carry-store-writer".into())
            .spawn(move || worker(s, rx, c))
            .map_err(|source| StoreError::Io {
                op: "starting the writer thread",
                path: Default::default(),
                source,
            })?;
        Ok(CarryTier {
            model: ModelDigest::of(&cfg.model_id),
            store,
            cfg,
            counters,
            tx: Some(tx),
            worker: Some(worker),
            written: HashSet::new(),
        })
    }

    /// The store.
    pub fn store(&self) -> &Arc<dyn CarryStore> {
        &self.store
    }

    /// The settings.
    pub fn config(&self) -> &TierConfig {
        &self.cfg
    }

    /// The model digest values are stored for.
    pub fn model(&self) -> &ModelDigest {
        &self.model
    }

    /// Ask the store for the carry after `tokens` under `key`, for an
    /// engine of sites `sites`. Counts the lookup as a hit candidate or a
    /// miss of one cause.
    pub fn fetch(
        &self,
        key: &StoreKey,
        sites: &[SiteSpec],
        tokens: &[u32],
    ) -> Result<(Snapshot, usize), MissCause> {
        let c = &self.counters;
        add(&c.lookups, 1);
        let t0 = Instant::now();
        let got = self.store.get(key);
        let r = match got {
            Ok(Some(bytes)) => {
                ring(&c.get_lat).push(t0.elapsed());
                open_value(&bytes, &self.model, key, sites, tokens).map(|s| (s, bytes.len()))
            }
            Ok(None) => {
                ring(&c.get_lat).push(t0.elapsed());
                Err(MissCause::Absent)
            }
            Err(e @ StoreError::Unavailable { .. }) => {
                add(&c.skipped, 1);
                Err(MissCause::Error(e.to_string()))
            }
            Err(e) => {
                ring(&c.get_lat).push(t0.elapsed());
                add(&c.errors, 1);
                Err(MissCause::Error(e.to_string()))
            }
        };
        match &r {
            Ok(_) => {}
            Err(MissCause::Absent) => add(&c.miss_absent, 1),
            Err(MissCause::Corrupt(_)) => add(&c.miss_corrupt, 1),
            Err(MissCause::Geometry(_)) => add(&c.miss_geometry, 1),
            Err(MissCause::Model) => add(&c.miss_model, 1),
            Err(MissCause::Error(_)) => add(&c.miss_error, 1),
        }
        r
    }

    /// Count a restore from the store of `tokens` tokens and `bytes` bytes
    /// that took `elapsed` (get and checks included).
    pub fn note_restore(&self, tokens: usize, bytes: usize, elapsed: Duration) {
        let c = &self.counters;
        add(&c.hits, 1);
        add(&c.tokens_restored, tokens as u64);
        add(&c.bytes_restored, bytes as u64);
        add(
            &c.restore_ns,
            elapsed.as_nanos().min(u64::MAX as u128) as u64,
        );
    }

    /// Whether `key` has not been written (or found) by this tier yet.
    pub fn wants(&self, key: &StoreKey) -> bool {
        !self.written.contains(key)
    }

    /// Remember `key` as present in the store (written or found).
    pub fn remember(&mut self, key: StoreKey) {
        if self.written.len() >= WRITTEN_CAP {
            self.written.clear();
        }
        self.written.insert(key);
    }

    /// Queue snapshot `snap` for writing under `key`.
    /// Never blocks: a full queue drops it (counted). `false` when dropped.
    pub fn offer(&mut self, key: StoreKey, snap: &Snapshot) -> bool {
        let value = seal_snapshot(&self.model, &key, snap);
        let Some(tx) = &self.tx else { return false };
        match tx.try_send(Job::Put(key, value)) {
            Ok(()) => {
                self.remember(key);
                true
            }
            Err(TrySendError::Full(_)) | Err(TrySendError::Disconnected(_)) => {
                add(&self.counters.drops, 1);
                false
            }
        }
    }

    /// Wait up to `timeout` for the queued writes to finish. `true` when
    /// they did.
    pub fn flush(&self, timeout: Duration) -> bool {
        let Some(tx) = &self.tx else { return true };
        let (done_tx, done_rx) = bounded(1);
        let deadline = Instant::now() + timeout;
        if tx.send_timeout(Job::Flush(done_tx), timeout).is_err() {
            return false;
        }
        done_rx
            .recv_timeout(deadline.saturating_duration_since(Instant::now()))
            .is_ok()
    }

    /// The counters so far.
    pub fn stats(&self) -> CarryStoreStats {
        let c = &self.counters;
        let l = |a: &AtomicU64| a.load(Ordering::Relaxed);
        let (get_p50_us, get_p99_us) = ring(&c.get_lat).percentiles();
        let (put_p50_us, put_p99_us) = ring(&c.put_lat).percentiles();
        CarryStoreStats {
            lookups: l(&c.lookups),
            hits: l(&c.hits),
            tokens_restored: l(&c.tokens_restored),
            bytes_restored: l(&c.bytes_restored),
            restore_ns: l(&c.restore_ns),
            miss_absent: l(&c.miss_absent),
            miss_corrupt: l(&c.miss_corrupt),
            miss_geometry: l(&c.miss_geometry),
            miss_model: l(&c.miss_model),
            miss_error: l(&c.miss_error),
            puts: l(&c.puts),
            put_bytes: l(&c.put_bytes),
            put_errors: l(&c.put_errors),
            drops: l(&c.drops),
            skipped: l(&c.skipped),
            errors: l(&c.errors),
            get_p50_us,
            get_p99_us,
            put_p50_us,
            put_p99_us,
        }
    }
}

impl Drop for CarryTier {
    fn drop(&mut self) {
        // Closing the channel ends the worker once the queue is drained;
        // every queued put is bounded by the store's timeouts.
        self.tx = None;
        if let Some(w) = self.worker.take() {
            let _ = w.join();
        }
    }
}
