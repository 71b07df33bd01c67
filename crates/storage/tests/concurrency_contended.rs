//! The row cache under contention: many threads resolving, gathering on
//! their own streams and releasing through events, against an arena only
//! just large enough for all of them, with a hot set that every thread
//! hits (so resolves keep finding slots another thread is still loading),
//! and with read faults injected while the others carry on.
//!
//! What must hold: every row a successful resolve hands out is
//! byte-identical to the file; a failed resolve affects only its own batch
//! (its error names the row) and holds no pins; the cache's invariants hold
//! at the end; with faults off every id reads back correctly; and when the
//! table is dropped the backend has no live allocations left.

mod common;

use std::io;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use common::*;
use metrale_storage::cached::{CacheConfig, CachedTable};
use metrale_storage::io::{PageReader, ReadReq, default_reader};
use metrale_storage::parts::split_points;
use metrale_storage::table::{RowRef, RowTable};
use rand::{Rng, SeedableRng, rngs::StdRng};

const THREADS: u64 = 12;
const MAX_RESOLVE: usize = 4;

fn cfg(reader: Option<Arc<dyn PageReader>>) -> CacheConfig {
    // Exactly one full resolve per thread fits: progress is guaranteed,
    // but almost every miss must wait for or evict someone else's slot.
    let mut c = CacheConfig::new(THREADS as usize * MAX_RESOLVE);
    c.max_resolve = MAX_RESOLVE;
    c.pin_wait = Duration::from_secs(20);
    c.reader = reader;
    c
}

/// Ids with heavy overlap between threads: a hot set of 6 rows, a warm set
/// of 40 and a cold tail over the whole table, with repeats.
fn pick_ids(rng: &mut StdRng, rows: u64) -> Vec<u64> {
    let n = rng.gen_range(1..=2 * MAX_RESOLVE);
    (0..n)
        .map(|_| match rng.gen_range(0..10) {
            0..=4 => rng.gen_range(0..6),
            5..=7 => rng.gen_range(0..40),
            _ => rng.gen_range(0..rows),
        })
        .collect()
}

/// Fails a deterministic pseudo-random share of requests, with EIO or by
/// reporting a short count, while `on` is set; reads for real otherwise.
struct FlakyReader {
    inner: Arc<dyn PageReader>,
    on: AtomicBool,
    calls: AtomicU64,
    injected: AtomicU64,
}

impl PageReader for FlakyReader {
    fn name(&self) -> &str {
        "flaky"
    }

    fn read_batch(&self, reqs: &mut [ReadReq<'_>]) -> Vec<io::Result<usize>> {
        let mut res = self.inner.read_batch(reqs);
        if !self.on.load(Ordering::SeqCst) {
            return res;
        }
        let call = self.calls.fetch_add(1, Ordering::Relaxed);
        for (i, r) in res.iter_mut().enumerate() {
            let h = (call * 64 + i as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 58;
            // 6 of 64 requests fail: half with EIO, half short.
            match h {
                0..=2 => *r = Err(io::Error::from_raw_os_error(libc::EIO)),
                3..=5 => {
                    *r = r
                        .as_ref()
                        .map(|&n| n.min(100))
                        .map_err(|e| io::Error::other(e.to_string()))
                }
                _ => continue,
            }
            self.injected.fetch_add(1, Ordering::Relaxed);
        }
        res
    }
}

/// Resolve, gather on `s`, release behind an event and compare, but return
/// the resolve error instead of panicking on it.
fn try_gather(
    gpu: &dyn metrale_gpu_runtime::gpu::GpuBackend,
    t: &CachedTable,
    ids: &[u64],
    s: u64,
) -> anyhow::Result<()> {
    let rb = t.info().row_bytes();
    let mut refs = vec![RowRef::default(); ids.len()];
    let lease = t.resolve(ids, &mut refs)?;
    let bufs = GatherBufs::new(gpu, ids.len(), rb, false);
    bufs.queue(gpu, &refs, s);
    let ev = gpu.create_event().unwrap();
    gpu.record_event(ev, s).unwrap();
    t.release(lease, gpu, Some(ev)).unwrap();
    let (out, _) = bufs.read(gpu, s);
    for (i, &id) in ids.iter().enumerate() {
        assert_eq!(
            &out[i * rb..(i + 1) * rb],
            &row(id, rb)[..],
            "row {id} (position {i})"
        );
    }
    bufs.free(gpu);
    Ok(())
}

#[test]
fn many_threads_on_a_hot_set_with_a_just_large_enough_arena() {
    let d = tempfile::tempdir().unwrap();
    let files = make_table(d.path(), 3, 200, 160, false, 8);
    let rows = files.info.rows;
    let (gpu, _) = backend();
    let t = Arc::new(CachedTable::open(files, gpu.clone(), cfg(None)).unwrap());
    let threads: Vec<_> = (0..THREADS)
        .map(|k| {
            let (t, gpu) = (t.clone(), gpu.clone());
            std::thread::spawn(move || {
                let mut rng = StdRng::seed_from_u64(100 + k);
                let s = gpu.create_stream().unwrap();
                for it in 0..60 {
                    let ids = pick_ids(&mut rng, rows);
                    if it % 7 == 0 {
                        t.prefetch(&ids).unwrap();
                    }
                    for p in split_points(&ids, t.max_resolve()) {
                        try_gather(gpu.as_ref(), &t, &ids[p], s).unwrap();
                    }
                }
                gpu.synchronize(s).unwrap();
                gpu.destroy_stream(s).unwrap();
            })
        })
        .collect();
    for h in threads {
        h.join().unwrap();
    }
    t.wait_prefetched();
    t.check_invariants().unwrap();
    let st = t.stats();
    assert!(st.hits > 0 && st.misses > 0 && st.evictions > 0, "{st:?}");
    drop(t);
    assert_eq!(gpu.live_alloc_count(), 0, "{}", gpu.live_report());
}

#[test]
fn faults_under_contention_fail_only_their_batch_and_leave_the_cache_whole() {
    let d = tempfile::tempdir().unwrap();
    let files = make_table(d.path(), 3, 200, 160, false, 8);
    let rows = files.info.rows;
    let flaky = Arc::new(FlakyReader {
        inner: default_reader(8).unwrap(),
        on: AtomicBool::new(true),
        calls: AtomicU64::new(0),
        injected: AtomicU64::new(0),
    });
    let (gpu, _) = backend();
    let t = Arc::new(CachedTable::open(files, gpu.clone(), cfg(Some(flaky.clone()))).unwrap());
    let failed = Arc::new(AtomicU64::new(0));
    let ok = Arc::new(AtomicU64::new(0));
    let threads: Vec<_> = (0..THREADS)
        .map(|k| {
            let (t, gpu) = (t.clone(), gpu.clone());
            let (failed, ok) = (failed.clone(), ok.clone());
            std::thread::spawn(move || {
                let mut rng = StdRng::seed_from_u64(200 + k);
                let s = gpu.create_stream().unwrap();
                for _ in 0..60 {
                    let ids = pick_ids(&mut rng, rows);
                    for p in split_points(&ids, t.max_resolve()) {
                        match try_gather(gpu.as_ref(), &t, &ids[p.clone()], s) {
                            Ok(()) => ok.fetch_add(1, Ordering::Relaxed),
                            Err(e) => {
                                let e = format!("{e:#}");
                                assert!(
                                    e.contains("row ") && e.contains("offset"),
                                    "a read fault must name the row and offset: {e}"
                                );
                                assert!(
                                    ids[p].iter().any(|id| e.contains(&format!("row {id}"))),
                                    "the error names a row of this batch: {e}"
                                );
                                failed.fetch_add(1, Ordering::Relaxed)
                            }
                        };
                    }
                }
                gpu.synchronize(s).unwrap();
                gpu.destroy_stream(s).unwrap();
            })
        })
        .collect();
    for h in threads {
        h.join().unwrap();
    }
    let (n_ok, n_failed) = (ok.load(Ordering::Relaxed), failed.load(Ordering::Relaxed));
    assert!(flaky.injected.load(Ordering::Relaxed) > 0);
    assert!(n_ok > 0 && n_failed > 0, "ok {n_ok}, failed {n_failed}");
    t.check_invariants().unwrap();

    // Faults off: every row of the table reads back right, so no failed
    // load left a slot mapped to wrong or missing bytes.
    flaky.on.store(false, Ordering::SeqCst);
    let s = gpu.create_stream().unwrap();
    let all: Vec<u64> = (0..rows).collect();
    for part in all.chunks(MAX_RESOLVE) {
        try_gather(gpu.as_ref(), &t, part, s).unwrap();
    }
    gpu.synchronize(s).unwrap();
    gpu.destroy_stream(s).unwrap();
    t.check_invariants().unwrap();
    drop(t);
    assert_eq!(gpu.live_alloc_count(), 0, "{}", gpu.live_report());
}
