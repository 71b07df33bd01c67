//! The row cache's newer parts: the host-memory tier (rows evicted from the
//! arena served back without a disk read, values and FP8 scales intact),
//! the admission policy (S3-FIFO keeps hot rows through a scan of one-off
//! ids that CLOCK lets flush them), read spans no wider than the file's
//! direct-I/O granule, and prefetch of a whole step that a foreground
//! resolve never waits behind, whose rows are usable one by one as their
//! reads finish.

mod common;

use std::io;
use std::sync::Arc;
use std::sync::mpsc;
use std::time::Duration;

use common::*;
use metrale_storage::cached::{CacheConfig, CachedTable, PREFETCH_CHUNK, Policy};
use metrale_storage::io::{PageReader, ReadFeed, ReadReq, default_reader, pread_full};
use metrale_storage::table::{RowRef, RowTable};
use parking_lot::Mutex;

fn cfg(slots: usize, max_resolve: usize, policy: Policy, host_rows: usize) -> CacheConfig {
    let mut c = CacheConfig::new(slots);
    c.max_resolve = max_resolve;
    c.policy = policy;
    c.host_rows = host_rows;
    c
}

#[test]
fn evicted_rows_come_back_from_the_host_tier_without_disk_reads() {
    for fp8 in [false, true] {
        for policy in [Policy::Clock, Policy::S3Fifo] {
            let d = tempfile::tempdir().unwrap();
            let files = make_table(d.path(), 2, 64, 160, fp8, 4096);
            let (gpu, _) = backend();
            let t = CachedTable::open(files, gpu.clone(), cfg(8, 8, policy, 64)).unwrap();
            let s = gpu.create_stream().unwrap();
            let first: Vec<u64> = (0..8).map(|i| i * 13).collect();
            gather_and_check(gpu.as_ref(), &t, &first, s);
            // Eight other rows push the first eight out of the arena.
            let other: Vec<u64> = (0..8).map(|i| 1 + i * 13).collect();
            gather_and_check(gpu.as_ref(), &t, &other, s);
            assert_eq!(t.host_rows(), 8, "{policy:?}");
            let before = t.stats();
            gather_and_check(gpu.as_ref(), &t, &first, s);
            let st = t.stats().since(&before);
            assert_eq!(st.misses, 8, "{policy:?} fp8={fp8} {st:?}");
            assert_eq!(st.host_hits, 8, "{policy:?} fp8={fp8} {st:?}");
            assert_eq!(st.bytes_read, 0, "{policy:?} fp8={fp8} {st:?}");
            assert_eq!(st.read_calls, 0, "{policy:?} fp8={fp8} {st:?}");
            t.check_invariants().unwrap();
        }
    }
}

#[test]
fn a_host_tier_too_large_to_index_is_refused() {
    let d = tempfile::tempdir().unwrap();
    let files = make_table(d.path(), 1, 8, 16, false, 4096);
    let (gpu, _) = backend();
    for rows in [u32::MAX as usize, usize::MAX / 8] {
        let e = match CachedTable::open(files.clone(), gpu.clone(), cfg(4, 4, Policy::Clock, rows))
        {
            Ok(_) => panic!("host_rows {rows} was accepted"),
            Err(e) => e.to_string(),
        };
        assert!(
            e.contains("host_rows") && e.contains(&rows.to_string()),
            "{e}"
        );
    }
}

#[test]
fn without_a_host_tier_every_miss_reads_the_disk() {
    let d = tempfile::tempdir().unwrap();
    let files = make_table(d.path(), 1, 64, 16, false, 4096);
    let (gpu, _) = backend();
    let t = CachedTable::open(files, gpu.clone(), cfg(4, 4, Policy::S3Fifo, 0)).unwrap();
    let s = gpu.create_stream().unwrap();
    for round in 0..3 {
        gather_and_check(gpu.as_ref(), &t, &[0, 20, 40, 60], s);
        gather_and_check(gpu.as_ref(), &t, &[1, 21, 41, 61], s);
        assert_eq!(t.stats().misses, 8 * (round + 1));
    }
    assert_eq!((t.stats().host_hits, t.host_rows()), (0, 0));
}

/// A scan of one-off ids between rounds over a hot set: S3-FIFO keeps the
/// hot rows (they live in the main queue), CLOCK does not.
#[test]
fn s3fifo_keeps_hot_rows_through_a_scan_of_one_off_ids() {
    let d = tempfile::tempdir().unwrap();
    let files = make_table(d.path(), 1, 4096, 16, false, 4096);
    let (gpu, _) = backend();
    let mut misses = Vec::new();
    for policy in [Policy::S3Fifo, Policy::Clock] {
        let t = CachedTable::open(files.clone(), gpu.clone(), cfg(64, 16, policy, 0)).unwrap();
        assert_eq!(t.policy(), policy);
        let hot: Vec<u64> = (0..32).map(|i| i * 7).collect();
        let mut out = vec![RowRef::default(); 16];
        let mut run = |ids: &[u64]| {
            for b in ids.chunks(16) {
                let l = t.resolve(b, &mut out[..b.len()]).unwrap();
                t.release(l, gpu.as_ref(), None).unwrap();
            }
        };
        run(&hot);
        run(&hot);
        let mut next = 1000u64;
        for _ in 0..20 {
            let scan: Vec<u64> = (next..next + 48).collect();
            next += 48;
            run(&scan);
            run(&hot);
        }
        t.check_invariants().unwrap();
        misses.push(t.stats().misses);
    }
    let (s3, clock) = (misses[0], misses[1]);
    // Every scan id misses once under both (20 * 48) and the hot set is read
    // once at the start; S3-FIFO misses nothing else.
    assert_eq!(s3, 20 * 48 + 32, "S3-FIFO let one-off ids flush hot rows");
    assert!(clock > s3, "CLOCK {clock} vs S3-FIFO {s3}");
}

/// Spans never exceed what the granule forces: one row in at most
/// `ceil(row / granule) + 1` granules, and spans of rows in one batch that
/// share a granule are read once.
#[test]
fn reads_cover_only_the_granules_a_row_needs() {
    let d = tempfile::tempdir().unwrap();
    let files = make_table(d.path(), 1, 4096, 160, false, 4096);
    let (gpu, _) = backend();
    let t = CachedTable::open(files, gpu.clone(), cfg(512, 256, Policy::S3Fifo, 0)).unwrap();
    let a = t.read_alignment()[0].offset as u64;
    let s = gpu.create_stream().unwrap();
    let mut expect = 0u64;
    for id in [5u64, 900, 1800, 2700, 3600] {
        let before = t.stats();
        gather_and_check(gpu.as_ref(), &t, &[id], s);
        let st = t.stats().since(&before);
        assert_eq!(st.read_calls, 1);
        assert!(
            st.bytes_read <= (320u64.div_ceil(a) + 1) * a,
            "{} bytes for one 320-byte row with a {a}-byte granule",
            st.bytes_read
        );
        assert_eq!(st.bytes_read % a, 0);
        expect += st.bytes_read;
    }
    assert_eq!(t.stats().bytes_read, expect);
    // 64 adjacent rows: one extent, exactly the granules they cover.
    let before = t.stats();
    let ids: Vec<u64> = (100..164).collect();
    gather_and_check(gpu.as_ref(), &t, &ids, s);
    let st = t.stats().since(&before);
    assert_eq!(st.read_calls, 1, "{st:?}");
    assert!(st.bytes_read < 64 * 320 + 2 * a, "{st:?}");
}

/// A one-time stop for a test reader: the first `wait_here` says so on
/// `entered` and waits (at most 20 s) for `release`; later ones pass.
struct Hold {
    release: Mutex<Option<mpsc::Receiver<()>>>,
    entered: Mutex<Option<mpsc::Sender<()>>>,
}

impl Hold {
    /// The stop, the sender that releases it, and the receiver told when
    /// a reader reaches it.
    fn new() -> (Hold, mpsc::Sender<()>, mpsc::Receiver<()>) {
        let (release_tx, release_rx) = mpsc::channel();
        let (entered_tx, entered_rx) = mpsc::channel();
        let hold = Hold {
            release: Mutex::new(Some(release_rx)),
            entered: Mutex::new(Some(entered_tx)),
        };
        (hold, release_tx, entered_rx)
    }

    fn wait_here(&self) {
        // Taken out first: the lock must not be held while waiting, or
        // every other read through the reader would wait too.
        let release = self.release.lock().take();
        if let Some(rx) = release {
            if let Some(tx) = self.entered.lock().take() {
                let _ = tx.send(());
            }
            let _ = rx.recv_timeout(Duration::from_secs(20));
        }
    }
}

/// A reader whose first batch blocks until released: the prefetch thread
/// is stuck on its first chunk while the test resolves.
struct Gate {
    inner: Arc<dyn PageReader>,
    hold: Hold,
}

impl PageReader for Gate {
    fn name(&self) -> &str {
        "gate"
    }
    fn read_batch(&self, reqs: &mut [ReadReq<'_>]) -> Vec<io::Result<usize>> {
        self.hold.wait_here();
        self.inner.read_batch(reqs)
    }
}

#[test]
fn a_resolve_takes_over_queued_prefetches_instead_of_waiting() {
    let d = tempfile::tempdir().unwrap();
    let files = make_table(d.path(), 4, 1024, 16, false, 4096);
    let (gpu, _) = backend();
    let (hold, release_tx, entered_rx) = Hold::new();
    let gate = Arc::new(Gate {
        inner: default_reader(8).unwrap(),
        hold,
    });
    let mut c = cfg(4096, 256, Policy::S3Fifo, 0);
    c.reader = Some(gate);
    c.pin_wait = Duration::from_secs(5);
    let t = CachedTable::open(files, gpu.clone(), c).unwrap();
    // One step of every site at once: far more ids than one resolve takes.
    let step: Vec<u64> = (0..4 * PREFETCH_CHUNK as u64).map(|i| i * 3).collect();
    t.prefetch(&step).unwrap();
    entered_rx
        .recv_timeout(Duration::from_secs(10))
        .expect("the prefetch thread starts its first chunk");
    // The first chunk is stuck in the reader; rows of the last chunk are
    // still queued and must be read by the resolve itself, now.
    let s = gpu.create_stream().unwrap();
    let late: Vec<u64> = step[step.len() - 10..].to_vec();
    let before = t.stats();
    let t0 = std::time::Instant::now();
    gather_and_check(gpu.as_ref(), &t, &late, s);
    // The gate holds the first chunk for 20 s: a resolve that waited behind
    // the prefetch queue would take that long.
    assert!(t0.elapsed() < Duration::from_secs(5), "{:?}", t0.elapsed());
    let st = t.stats().since(&before);
    assert_eq!(st.misses, 10, "{st:?}");
    release_tx.send(()).unwrap();
    t.wait_prefetched();
    // Every prefetched row is now a hit, none was read twice.
    let before = t.stats();
    gather_and_check(gpu.as_ref(), &t, &step[..200], s);
    assert_eq!(t.stats().since(&before).misses, 0);
    assert_eq!(t.stats().misses, step.len() as u64);
    t.check_invariants().unwrap();
}

#[test]
fn prefetch_leaves_room_for_foreground_resolves() {
    let d = tempfile::tempdir().unwrap();
    let files = make_table(d.path(), 2, 1024, 16, false, 4096);
    let (gpu, _) = backend();
    let t = CachedTable::open(files, gpu.clone(), cfg(64, 16, Policy::S3Fifo, 0)).unwrap();
    // Far more ids than slots: prefetch claims at most slots - max_resolve.
    let step: Vec<u64> = (0..2000).collect();
    t.prefetch(&step).unwrap();
    assert!(t.mapped_rows() <= 64 - 16, "{}", t.mapped_rows());
    // Foreground resolves of other rows go through at once.
    let s = gpu.create_stream().unwrap();
    let other: Vec<u64> = (2000..2016).collect();
    gather_and_check(gpu.as_ref(), &t, &other, s);
    t.wait_prefetched();
    t.check_invariants().unwrap();
}

/// A reader that reads the first read of a feed, reports it, then holds
/// the rest until released.
struct Trickle {
    hold: Hold,
}

impl PageReader for Trickle {
    fn name(&self) -> &str {
        "trickle"
    }
    /// A whole batch is held like the rest of a feed: a reader that can
    /// only report a batch at once makes every row of it wait.
    fn read_batch(&self, reqs: &mut [ReadReq<'_>]) -> Vec<io::Result<usize>> {
        let res = reqs
            .iter_mut()
            .map(|r| pread_full(r.fd, r.buf, r.offset))
            .collect();
        self.hold.wait_here();
        res
    }
    fn read_feed(&self, feed: &mut dyn ReadFeed) {
        let mut first = true;
        while let Some(r) = feed.next(true) {
            // SAFETY: the feed keeps the bytes for this read until `done`.
            let buf = unsafe { std::slice::from_raw_parts_mut(r.ptr, r.len) };
            let res = pread_full(r.fd, buf, r.offset);
            feed.done(r.tag, res);
            feed.settled();
            if std::mem::take(&mut first) {
                self.hold.wait_here();
            }
        }
    }
}

#[test]
fn a_prefetched_row_is_usable_as_soon_as_its_own_read_is_in() {
    for fp8 in [false, true] {
        let d = tempfile::tempdir().unwrap();
        let files = make_table(d.path(), 1, 1024, 160, fp8, 4096);
        let (gpu, _) = backend();
        let (hold, release_tx, entered_rx) = Hold::new();
        let mut c = cfg(64, 16, Policy::S3Fifo, 0);
        c.reader = Some(Arc::new(Trickle { hold }));
        let t = CachedTable::open(files, gpu.clone(), c).unwrap();
        // Two rows far apart: two reads, the lower offset first. With FP8
        // the scales are a third read, after both rows' values.
        let step = [10u64, 1000];
        t.prefetch(&step).unwrap();
        entered_rx
            .recv_timeout(Duration::from_secs(10))
            .expect("the prefetch thread reads its first row");
        let s = gpu.create_stream().unwrap();
        let before = t.stats();
        let t0 = std::time::Instant::now();
        if fp8 {
            // A row is ready only when its scale is in too: row 10 still
            // waits for the held reads, so only check it is not handed out
            // half-read once they are released.
            release_tx.send(()).unwrap();
            gather_and_check(gpu.as_ref(), &t, &step[..1], s);
        } else {
            gather_and_check(gpu.as_ref(), &t, &step[..1], s);
            // The reader holds row 1000 for 20 s: a row published only
            // with its whole chunk would wait that long.
            assert!(t0.elapsed() < Duration::from_secs(5), "{:?}", t0.elapsed());
            release_tx.send(()).unwrap();
        }
        assert_eq!(t.stats().since(&before).misses, 0, "fp8={fp8}");
        t.wait_prefetched();
        let before = t.stats();
        gather_and_check(gpu.as_ref(), &t, &step, s);
        assert_eq!(t.stats().since(&before).misses, 0, "fp8={fp8}");
        t.check_invariants().unwrap();
    }
}
