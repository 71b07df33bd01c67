//! The row cache: a fixed arena of slots in device-addressable host memory
//! holding the hot rows of a table that stays on disk.
//!
//! `resolve(ids)` maps ids to slots. Hits pin their slot; misses take a
//! victim among unpinned slots (CLOCK, or S3-FIFO admission, see
//! [`Policy`]), are copied from the host-memory tier when it holds them,
//! and otherwise read from the shard files in one batch (each row's
//! smallest span of direct-I/O granules, rows sharing or touching a span
//! read together, O_DIRECT through a [`PageReader`]) and copied into their
//! slots. The pins of a resolve form a [`Lease`]; released with an event,
//! they are kept until the event has completed, i.e. until the gather that
//! reads the slots has run.
//!
//! Invariants (all under the one state mutex):
//! - `map[id] == s` iff `slots[s].id == id` and `slots[s].state != FREE`;
//! - `slots[s].pins` equals the number of live leases and pending
//!   (event-guarded) releases naming `s`, plus resolves currently waiting on
//!   `s`; a slot with pins, or one being loaded or queued, is never chosen
//!   as a victim, so a slot a queued gather will read is never overwritten;
//! - slot bytes are written only while the slot is `LOADING`, by the one
//!   thread that loads it, outside the mutex; no lease hands out a
//!   `LOADING` slot, and a resolve that finds one waits until it is `READY`
//!   (or its load failed, in which case it retries from scratch);
//! - a prefetched row is first `QUEUED` (mapped, unpinned, not yet read):
//!   a resolve that needs it takes the read over at once (it becomes one of
//!   the resolve's own loads), so a foreground miss never waits behind the
//!   prefetch queue, only behind the rest of a chunk of at most
//!   [`PREFETCH_CHUNK`] rows the prefetch thread has already started; the
//!   thread starts a chunk only when its reader has room for another read
//!   (io_uring: fewer than `io_depth` in flight), reads chunks in the order
//!   they were asked for, and publishes each row as soon as its own reads
//!   are in, so a resolve waiting on a prefetched row waits for that row
//!   only; prefetches hold at most `slots - max_resolve` slots queued or
//!   loading, so a resolve always finds room that leases do not hold;
//! - a failed resolve holds no pins, and the slots of its failed reads
//!   (rows copied from the host tier included) are unmapped (`FREE`), so a
//!   retry reads them again;
//! - a row leaves the arena only as a policy victim, and is then copied to
//!   the host tier (when there is one) before its slot is claimed, under
//!   the mutex, so the copy is of a ready, unpinned row;
//! - each resolve pins at most `max_resolve` distinct slots; a batch with
//!   more distinct ids is refused with an error naming both numbers (see
//!   [`crate::parts::resolve_in_parts`] for the split protocol); leases
//!   held together can pin every slot (`max_pinned`), and a resolve that
//!   finds none free waits `pin_wait` for releases before it gives up.
//!
//! Events given to `release` must come from the backend the cache was
//! opened with: pending releases are polled through that backend (on later
//! resolves, releases and prefetches) and their events destroyed by it.
//!
//! Concurrency: resolves from several threads take the mutex only to plan
//! and to publish; their reads run in parallel. A prefetch only checks its
//! ids and hands them to a background thread, which claims their slots in
//! the order asked and reads them as one stream of chunks
//! ([`PageReader::read_feed`]); until it has claimed a row, a resolve that
//! needs it reads it as its own miss.
//!
//! Statistics: `hits` counts ids found mapped (including repeats within a
//! batch and rows a prefetch brought in), `misses` rows read (by resolves or
//! prefetches), `pages_coalesced` rows whose span overlapped an earlier
//! row's in the same read, and `io_wait_ns` the time resolves spent blocked on
//! reads (their own, or a concurrent resolve's or prefetch's); reads done by
//! the prefetch thread alone do not count as waiting. `host_hits` counts
//! misses served from the host tier (no disk read); `bytes_read` counts the
//! bytes of the aligned spans read.
//!
//! Layout: this module holds the types, `open` and the [`RowTable`] calls;
//! `resolve` maps a batch of ids to slots, `policy` chooses victims,
//! `host` is the host-memory tier, `read` fills missed slots from the host
//! tier or the shard files.

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering::Relaxed};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crossbeam_channel::{Sender, unbounded};
use metrale_gpu_runtime::gpu::{EventHandle, GpuBackend, HostMapped};
use parking_lot::{Condvar, Mutex};

use crate::error::{Result, StorageError};
use crate::io::{AlignedBuf, PageReader, ShardFile, default_reader};
use crate::layout::TableFiles;
use crate::remote::{RemoteRows, RemoteTier};
use crate::table::{Lease, RowDType, RowRef, RowTable, TableInfo, TableStats, check_out_len};

mod host;
mod policy;
mod read;
mod resolve;

pub use policy::Policy;

use host::HostTier;
use policy::Evictor;

const FREE: u8 = 0;
const LOADING: u8 = 1;
const READY: u8 = 2;
/// Claimed by a prefetch, not yet read.
const QUEUED: u8 = 3;
const NO_ID: u64 = u64::MAX;

/// Rows the prefetch thread reads per batch: a resolve that needs a row the
/// thread has started on waits for at most this many.
pub const PREFETCH_CHUNK: usize = 256;

/// A multiplicative hash for row ids (uniform enough, and a few ns).
#[derive(Default, Clone, Copy)]
pub struct IdHasher(u64);

impl Hasher for IdHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0 ^ b as u64).wrapping_mul(0x100_0000_01B3);
        }
    }
    fn write_u64(&mut self, x: u64) {
        let h = x.wrapping_mul(0x9E37_79B9_7F4A_7C15);
        self.0 = h ^ (h >> 29);
    }
}

type IdMap<V> = HashMap<u64, V, BuildHasherDefault<IdHasher>>;

/// Settings of a [`CachedTable`].
#[derive(Clone)]
pub struct CacheConfig {
    /// Number of row slots in the arena.
    pub slots: usize,
    /// Most distinct ids one resolve may pin (0: half the slots).
    pub max_resolve: usize,
    /// Ask for O_DIRECT reads (falls back to buffered where refused).
    pub direct: bool,
    /// Reads in flight per batch (io_uring depth or pool size).
    pub io_depth: usize,
    /// A reader to use instead of the automatic choice (tests inject faults).
    pub reader: Option<Arc<dyn PageReader>>,
    /// How long a resolve waits for pinned slots to be released before it
    /// gives up with an error.
    pub pin_wait: Duration,
    /// Which rows the arena keeps (see [`Policy`]).
    pub policy: Policy,
    /// Rows of the host-memory tier behind the arena (0: none). Rows
    /// evicted from the arena are kept there, in pageable host memory of
    /// about `host_rows * row bytes`, and copied back on a later miss
    /// instead of read from disk.
    pub host_rows: usize,
    /// Read misses from this remote tier instead of the shard files: the
    /// table is opened on it at [`CachedTable::open`] (refused unless its
    /// servers hold a complete load of it, see [`crate::remote`]), and
    /// every miss the host tier does not hold is fetched from it.
    pub remote: Option<Arc<dyn RemoteTier>>,
    /// With `remote`: read the rows of a failed remote fetch from the
    /// shard files instead (else the resolve fails, as a failed disk read
    /// does).
    pub remote_fallback: bool,
}

/// The policy of [`CacheConfig::new`]: S3-FIFO, which keeps more hot rows
/// than CLOCK on a Zipf stream with one-off ids (the storage bench's
/// `policy` figures).
pub const DEFAULT_POLICY: Policy = Policy::S3Fifo;

/// Reads a [`CacheConfig::new`] cache keeps in flight. A decode step's
/// misses (a few hundred random rows) go out together, and a deeper queue
/// keeps the device's queue full when the reading thread is slow to reap
/// completions: on the flagship offload bench (quick, no backbone) with
/// other builds running on the machine, the waits for rows per decode
/// token were 193-248 us at depth 32 and 131-149 us at 128 in the same
/// runs (64 and 256 within the noise of 128); on an idle machine both
/// depths gave 137-153 us, the disk's random-read rate.
pub const DEFAULT_IO_DEPTH: usize = 128;

/// Slots of a [`CacheConfig::default`] arena (64 Ki rows).
pub const DEFAULT_SLOTS: usize = 1 << 16;

impl Default for CacheConfig {
    /// [`CacheConfig::new`] with [`DEFAULT_SLOTS`].
    fn default() -> Self {
        Self::new(DEFAULT_SLOTS)
    }
}

impl CacheConfig {
    /// Defaults for an arena of `slots` rows.
    pub fn new(slots: usize) -> Self {
        CacheConfig {
            slots,
            max_resolve: 0,
            direct: true,
            io_depth: DEFAULT_IO_DEPTH,
            reader: None,
            pin_wait: Duration::from_secs(10),
            policy: DEFAULT_POLICY,
            host_rows: 0,
            remote: None,
            remote_fallback: false,
        }
    }
}

#[derive(Clone, Copy, Debug)]
struct Slot {
    id: u64,
    /// The resolve batch that last pinned (or loads) this slot: dedups
    /// repeated ids within a batch without a per-batch set.
    stamp: u64,
    pins: u32,
    /// Bumped whenever the slot's mapping changes, so a waiter can tell a
    /// completed load from a failed-and-reused one.
    generation: u32,
    state: u8,
    /// Hits since loaded, saturating (the policy's reference count).
    freq: u8,
}

struct State {
    map: IdMap<u32>,
    slots: Vec<Slot>,
    evict: Evictor,
    /// Slots prefetches hold `QUEUED` or are reading.
    prefetching: usize,
    leases: IdMap<Vec<u32>>,
    next_lease: u64,
    next_batch: u64,
    pending: Vec<(EventHandle, Vec<u32>)>,
}

#[derive(Default)]
struct Stats {
    hits: AtomicU64,
    misses: AtomicU64,
    evictions: AtomicU64,
    bytes_read: AtomicU64,
    read_calls: AtomicU64,
    pages_coalesced: AtomicU64,
    io_wait_ns: AtomicU64,
    host_hits: AtomicU64,
}

struct Inner {
    files: TableFiles,
    fds: Vec<ShardFile>,
    reader: Arc<dyn PageReader>,
    gpu: Arc<dyn GpuBackend>,
    arena: HostMapped,
    stride: usize,
    scale_base: usize,
    row_bytes: usize,
    fp8: bool,
    max_resolve: usize,
    /// Most slots prefetches may hold queued or loading.
    prefetch_cap: usize,
    host: Option<HostTier>,
    /// Where misses are read from instead of the shard files.
    remote: Option<Arc<dyn RemoteRows>>,
    /// Read the rows of a failed remote fetch from the shard files.
    remote_fallback: bool,
    /// Slots in the arena (fixed at open; also `st.slots.len()`).
    slot_count: usize,
    pin_wait: Duration,
    st: Mutex<State>,
    cv: Condvar,
    stats: Stats,
    bufs: Mutex<Vec<AlignedBuf>>,
    /// Prefetch requests sent to the prefetch thread and not yet claimed
    /// (outside the state mutex, which the thread holds while it claims,
    /// so that asking never waits for a claim).
    unclaimed: AtomicUsize,
}

/// A table whose rows stay on disk, with the hot ones in a slot arena.
pub struct CachedTable {
    inner: Arc<Inner>,
    prefetch_tx: Option<Sender<Vec<u64>>>,
    worker: Option<JoinHandle<()>>,
}

enum Attempt {
    Done(Lease),
    NoVictim,
    PeerFailed,
}

impl CachedTable {
    /// Open a cache over `files` with an arena from `gpu.alloc_host_mapped`.
    pub fn open(
        files: TableFiles,
        gpu: Arc<dyn GpuBackend>,
        cfg: CacheConfig,
    ) -> Result<CachedTable> {
        if cfg.slots == 0 {
            return Err(StorageError::invalid("a row cache needs at least one slot"));
        }
        if cfg.slots >= u32::MAX as usize {
            return Err(StorageError::invalid(format!(
                "{} slots is more than a cache can index",
                cfg.slots
            )));
        }
        let max_resolve = if cfg.max_resolve == 0 {
            (cfg.slots / 2).max(1)
        } else {
            cfg.max_resolve
        };
        if max_resolve > cfg.slots {
            return Err(StorageError::invalid(format!(
                "max_resolve {max_resolve} exceeds the {} slots of the arena",
                cfg.slots
            )));
        }
        let info = files.info;
        let row_bytes = info.row_bytes();
        let fp8 = info.dtype == RowDType::Fp8E4M3;
        let host_entry = row_bytes + if fp8 { 4 } else { 0 };
        if cfg.host_rows >= u32::MAX as usize || cfg.host_rows.checked_mul(host_entry).is_none() {
            return Err(StorageError::invalid(format!(
                "host_rows {} is more than a host tier can index",
                cfg.host_rows
            )));
        }
        let stride = row_bytes.next_multiple_of(16);
        let scale_base = cfg.slots * stride;
        let arena_bytes = scale_base + if fp8 { cfg.slots * 4 } else { 0 };
        let fds = files
            .shards
            .iter()
            .map(|s| ShardFile::open(&s.path, cfg.direct))
            .collect::<Result<Vec<_>>>()?;
        let remote = match &cfg.remote {
            Some(tier) => Some(tier.open(&files)?),
            None => None,
        };
        let reader = match cfg.reader {
            Some(r) => r,
            None => default_reader(cfg.io_depth)?,
        };
        let arena = gpu
            .alloc_host_mapped(arena_bytes, "ple row cache arena")
            .map_err(|e| {
                StorageError::device(
                    format!("allocating a {arena_bytes}-byte row cache arena"),
                    e,
                )
            })?;
        let slots = vec![
            Slot {
                id: NO_ID,
                stamp: 0,
                pins: 0,
                generation: 0,
                state: FREE,
                freq: 0,
            };
            cfg.slots
        ];
        let inner = Arc::new(Inner {
            files,
            fds,
            reader,
            gpu,
            arena,
            stride,
            scale_base,
            row_bytes,
            fp8,
            max_resolve,
            prefetch_cap: cfg.slots - max_resolve,
            host: (cfg.host_rows > 0).then(|| HostTier::new(cfg.host_rows, host_entry)),
            remote,
            remote_fallback: cfg.remote_fallback,
            slot_count: cfg.slots,
            pin_wait: cfg.pin_wait,
            st: Mutex::new(State {
                map: IdMap::with_capacity_and_hasher(cfg.slots, Default::default()),
                slots,
                evict: Evictor::new(cfg.policy, cfg.slots),
                prefetching: 0,
                leases: IdMap::default(),
                next_lease: 1,
                next_batch: 1,
                pending: Vec::new(),
            }),
            cv: Condvar::new(),
            stats: Stats::default(),
            bufs: Mutex::new(Vec::new()),
            unclaimed: AtomicUsize::new(0),
        });
        let (tx, rx) = unbounded::<Vec<u64>>();
        let w = inner.clone();
        let worker = std::thread::Builder::new()
            .name("table-prefetch".into())
            .spawn(move || {
                if w.remote.is_some() {
                    w.remote_prefetch(&rx);
                    return;
                }
                let mut feed = read::PrefetchFeed::new(&w, &rx);
                while feed.wait() {
                    w.reader.read_feed(&mut feed);
                    feed.flush();
                }
            })
            .map_err(|cause| StorageError::Thread {
                what: "the prefetch thread",
                cause,
            })?;
        Ok(CachedTable {
            inner,
            prefetch_tx: Some(tx),
            worker: Some(worker),
        })
    }

    /// Number of slots in the arena.
    pub fn slots(&self) -> usize {
        self.inner.slot_count
    }

    /// The eviction policy in use.
    pub fn policy(&self) -> Policy {
        match self.inner.st.lock().evict {
            Evictor::Clock { .. } => Policy::Clock,
            Evictor::S3 { .. } => Policy::S3Fifo,
        }
    }

    /// Rows held by the host-memory tier now (0 without one).
    pub fn host_rows(&self) -> usize {
        self.inner.host.as_ref().map_or(0, HostTier::len)
    }

    /// The direct-I/O alignment reads of each shard keep to.
    pub fn read_alignment(&self) -> Vec<crate::io::DioAlign> {
        self.inner.fds.iter().map(|f| f.align).collect()
    }

    /// Name of the page reader in use (`io_uring`, `pread-pool`, ...).
    pub fn reader_name(&self) -> &str {
        self.inner.reader.name()
    }

    /// Whether every shard is read with O_DIRECT.
    pub fn direct_io(&self) -> bool {
        self.inner.fds.iter().all(|f| f.direct)
    }

    /// Rows currently mapped (loaded or loading).
    pub fn mapped_rows(&self) -> usize {
        self.inner.st.lock().map.len()
    }

    /// Check the cache's internal invariants (map and slots agree, pins
    /// match the live leases and pending releases). For tests and debugging.
    pub fn check_invariants(&self) -> Result<()> {
        let g = self.inner.st.lock();
        let mut want = vec![0u32; g.slots.len()];
        for v in g.leases.values() {
            for &s in v {
                want[s as usize] += 1;
            }
        }
        for (_, v) in &g.pending {
            for &s in v {
                want[s as usize] += 1;
            }
        }
        let broken = |m: String| Err(StorageError::Invariant { message: m });
        for (s, sl) in g.slots.iter().enumerate() {
            if sl.pins < want[s] {
                return broken(format!(
                    "slot {s}: {} pins but {} held by leases",
                    sl.pins, want[s]
                ));
            }
            if sl.state == FREE {
                if sl.id != NO_ID {
                    return broken(format!("free slot {s} still names row {}", sl.id));
                }
            } else if g.map.get(&sl.id) != Some(&(s as u32)) {
                return broken(format!(
                    "slot {s} holds row {} but the map disagrees",
                    sl.id
                ));
            }
        }
        for (&id, &s) in &g.map {
            let sl = &g.slots[s as usize];
            if sl.id != id || sl.state == FREE {
                return broken(format!(
                    "map sends row {id} to slot {s}, which holds {}",
                    sl.id
                ));
            }
        }
        Ok(())
    }

    /// Wait until every prefetch asked for so far has been claimed and
    /// read.
    pub fn wait_prefetched(&self) {
        let mut g = self.inner.st.lock();
        while self.inner.unclaimed.load(Relaxed) > 0
            || g.slots
                .iter()
                .any(|s| s.state == LOADING || s.state == QUEUED)
        {
            self.inner.cv.wait_for(&mut g, Duration::from_millis(5));
        }
    }
}

impl Inner {
    #[inline]
    fn row_ref(&self, s: u32) -> RowRef {
        let s = s as usize;
        RowRef {
            data: self.arena.device.0 + (s * self.stride) as u64,
            scale: if self.fp8 {
                self.arena.device.0 + (self.scale_base + s * 4) as u64
            } else {
                0
            },
        }
    }
}

impl Drop for Inner {
    fn drop(&mut self) {
        // A gather queued before the table was dropped may still read the
        // arena: wait for every pending release before freeing it.
        let pending = std::mem::take(&mut self.st.get_mut().pending);
        for (ev, _) in pending {
            let _ = self.gpu.event_synchronize(ev);
            let _ = self.gpu.destroy_event(ev);
        }
        if let Err(e) = self.gpu.dealloc(self.arena.device) {
            tracing::warn!(error = %e, "freeing the row cache arena failed");
        }
    }
}

impl Drop for CachedTable {
    fn drop(&mut self) {
        self.prefetch_tx.take();
        if let Some(w) = self.worker.take() {
            let _ = w.join();
        }
    }
}

impl RowTable for CachedTable {
    fn info(&self) -> TableInfo {
        self.inner.files.info
    }

    fn max_resolve(&self) -> usize {
        self.inner.max_resolve
    }

    fn max_pinned(&self) -> usize {
        self.inner.slot_count
    }

    fn would_wait(&self, ids: &[u64]) -> bool {
        let g = self.inner.st.lock();
        ids.iter().any(|id| {
            g.map
                .get(id)
                .is_none_or(|&s| g.slots[s as usize].state != READY)
        })
    }

    fn resolve(&self, ids: &[u64], out: &mut [RowRef]) -> Result<Lease> {
        check_out_len(ids, out)?;
        for &id in ids {
            self.inner.files.check_id(id)?;
        }
        let inner = &*self.inner;
        let deadline = Instant::now() + inner.pin_wait;
        let mut peer_failures = 0;
        loop {
            match inner.try_resolve(ids, out)? {
                Attempt::Done(l) => return Ok(l),
                Attempt::PeerFailed => {
                    peer_failures += 1;
                    if peer_failures > 3 {
                        return Err(StorageError::ConcurrentRead {
                            message: format!(
                                "rows of this batch failed to load in {peer_failures} concurrent reads; giving up"
                            ),
                        });
                    }
                }
                Attempt::NoVictim => {
                    let mut g = inner.st.lock();
                    if !g.pending.is_empty() {
                        inner.poll_pending(&mut g);
                    }
                    if Instant::now() >= deadline {
                        let pinned = g.slots.iter().filter(|s| s.pins > 0).count();
                        return Err(StorageError::NoFreeSlot {
                            waited: inner.pin_wait,
                            pinned,
                            slots: g.slots.len(),
                        });
                    }
                    inner.cv.wait_for(&mut g, Duration::from_micros(200));
                }
            }
        }
    }

    fn release(
        &self,
        lease: Lease,
        gpu: &dyn GpuBackend,
        after: Option<EventHandle>,
    ) -> Result<()> {
        let inner = &*self.inner;
        if lease.id == 0 {
            if let Some(ev) = after {
                gpu.destroy_event(ev)?;
            }
            return Ok(());
        }
        let mut g = inner.st.lock();
        let slots = g
            .leases
            .remove(&lease.id)
            .ok_or(StorageError::UnknownLease {
                lease: lease.id,
                why: "is not live (released twice?)",
            })?;
        match after {
            None => {
                Inner::unpin(&mut g, &slots);
                inner.cv.notify_all();
            }
            Some(ev) => match gpu.event_query(ev) {
                Ok(true) => {
                    Inner::unpin(&mut g, &slots);
                    inner.cv.notify_all();
                    drop(g);
                    gpu.destroy_event(ev)?;
                }
                Ok(false) => g.pending.push((ev, slots)),
                Err(e) => {
                    Inner::unpin(&mut g, &slots);
                    inner.cv.notify_all();
                    return Err(StorageError::LeaseEvent {
                        lease: lease.id,
                        cause: e,
                    });
                }
            },
        }
        Ok(())
    }

    /// Hand the ids to the prefetch thread, which claims slots for those
    /// not mapped yet (as `QUEUED`) and reads them in chunks. Any number of
    /// ids is accepted (a whole step of every site at once); claiming stops
    /// quietly once prefetches hold `slots - max_resolve` slots or no victim
    /// is left, since prefetch is advice. The caller pays only the id
    /// check: claiming takes the cache's lock and a victim per row (about a
    /// microsecond each), which would otherwise hold up the step that asked
    /// before it queues any work. Ids a resolve needs before the thread has
    /// claimed them, or before their read has started, are read by that
    /// resolve itself.
    fn prefetch(&self, ids: &[u64]) -> Result<()> {
        for &id in ids {
            self.inner.files.check_id(id)?;
        }
        if ids.is_empty() {
            return Ok(());
        }
        let inner = &*self.inner;
        inner.unclaimed.fetch_add(1, Relaxed);
        let tx = self
            .prefetch_tx
            .as_ref()
            .expect("prefetch channel lives until drop");
        if let Err(e) = tx.send(ids.to_vec()) {
            // The thread is gone (only while dropping): read here.
            let claimed = inner.claim_prefetch(&e.into_inner());
            for chunk in claimed.chunks(PREFETCH_CHUNK) {
                let loads = inner.start_prefetch(chunk);
                let r = inner.load(&loads);
                let mut g = inner.st.lock();
                g.prefetching -= loads.len();
                inner.finish_loads(&mut g, &loads, r.is_ok());
                r?;
            }
        }
        Ok(())
    }

    fn stats(&self) -> TableStats {
        let s = &self.inner.stats;
        TableStats {
            hits: s.hits.load(Relaxed),
            misses: s.misses.load(Relaxed),
            evictions: s.evictions.load(Relaxed),
            bytes_read: s.bytes_read.load(Relaxed),
            read_calls: s.read_calls.load(Relaxed),
            pages_coalesced: s.pages_coalesced.load(Relaxed),
            io_wait_ns: s.io_wait_ns.load(Relaxed),
            host_hits: s.host_hits.load(Relaxed),
        }
    }
}
