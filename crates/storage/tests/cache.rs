//! Conformance tests of the row cache: leases against the asynchronous CPU
//! backend, dedup and page coalescing, splitting, prefetch, faults (an
//! injectable reader and a really truncated file) and concurrency.

mod common;

use std::io;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use common::*;
use metrale_gpu_runtime::cpu::Latch;
use metrale_gpu_runtime::gpu::LaunchConfig;
use metrale_storage::StorageError;
use metrale_storage::cached::{CacheConfig, CachedTable};
use metrale_storage::io::{PageReader, ReadReq, default_reader};
use metrale_storage::parts::resolve_in_parts;
use metrale_storage::table::{RowRef, RowTable};
use parking_lot::Mutex;
use rand::{Rng, SeedableRng, rngs::StdRng};

fn cfg(slots: usize, max_resolve: usize) -> CacheConfig {
    let mut c = CacheConfig::new(slots);
    c.max_resolve = max_resolve;
    c.pin_wait = Duration::from_secs(10);
    c
}

/// The lease rule: a slot read by a queued gather is not overwritten until
/// the gather has run, even when later resolves need every slot.
#[test]
fn lease_pins_rows_until_the_gather_has_run() {
    let d = tempfile::tempdir().unwrap();
    let files = make_table(d.path(), 2, 16, 160, false, 8);
    let (gpu, gathered) = backend();
    let t = CachedTable::open(files, gpu.clone(), cfg(4, 4)).unwrap();
    let rb = 320;
    let s = gpu.create_stream().unwrap();
    // A kernel that holds the stream until the test opens it, so the gather
    // queued behind it runs late however slow the machine.
    let latch = Latch::new();
    let hold = latch.kernel(gpu.as_ref(), "storage_test", "hold").unwrap();
    gpu.launch(hold, LaunchConfig::linear(1, 1)).run(s).unwrap();
    let a = [1u64, 5, 9, 30];
    let mut refs = vec![RowRef::default(); 4];
    let lease = t.resolve(&a, &mut refs).unwrap();
    let bufs = GatherBufs::new(gpu.as_ref(), 4, rb, false);
    bufs.queue(gpu.as_ref(), &refs, s);
    let ev = gpu.create_event().unwrap();
    gpu.record_event(ev, s).unwrap();
    t.release(lease, gpu.as_ref(), Some(ev)).unwrap();
    assert!(
        !gathered.load(Ordering::SeqCst),
        "the gather must still be queued here"
    );
    // Four other rows need all four slots: only possible once the gather ran,
    // which the stream allows a while after the resolve below has started.
    let opener = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(100));
        latch.open();
    });
    let b = [2u64, 6, 10, 31];
    let mut refs_b = vec![RowRef::default(); 4];
    let lease_b = t.resolve(&b, &mut refs_b).unwrap();
    assert!(
        gathered.load(Ordering::SeqCst),
        "slots were taken before the gather that reads them ran"
    );
    assert_eq!(t.stats().evictions, 4);
    opener.join().unwrap();
    t.release(lease_b, gpu.as_ref(), None).unwrap();
    let (out, _) = bufs.read(gpu.as_ref(), s);
    for (i, &id) in a.iter().enumerate() {
        assert_eq!(
            &out[i * rb..(i + 1) * rb],
            &row(id, rb)[..],
            "row {id} was overwritten before its gather ran"
        );
    }
    bufs.free(gpu.as_ref());
    t.check_invariants().unwrap();
}

#[test]
fn repeated_ids_fault_once_and_shared_pages_are_read_once() {
    let d = tempfile::tempdir().unwrap();
    let files = make_table(d.path(), 1, 64, 160, false, 4096);
    let base = files.shards[0].data_offset;
    let (gpu, _) = backend();
    let t = CachedTable::open(files, gpu.clone(), cfg(32, 32)).unwrap();
    let s = gpu.create_stream().unwrap();
    // Rows 0..=11 lie in the first page (12 * 320 = 3840 bytes); how they
    // are read depends on the file's direct-I/O granule.
    let a = t.read_alignment()[0].offset as u64;
    let ids = [3u64, 0, 3, 7, 11, 0, 3];
    let want = spans(&t, base, &[0, 3, 7, 11], a);
    gather_and_check(gpu.as_ref(), &t, &ids, s);
    let st = t.stats();
    assert_eq!(st.misses, 4, "{st:?}");
    assert_eq!(st.hits, 3, "{st:?}");
    assert_eq!(st.read_calls, want.calls, "{st:?} granule {a}");
    assert_eq!(st.pages_coalesced, want.shared, "{st:?} granule {a}");
    assert_eq!(st.bytes_read, want.bytes, "{st:?} granule {a}");
    if a == 4096 {
        assert_eq!((st.read_calls, st.bytes_read), (1, 4096));
    }
    // Each row costs less than a page whenever the granule is smaller.
    assert!(st.bytes_read <= 4096, "{st:?}");
    assert!(st.io_wait_ns > 0, "{st:?}");
    // Now all hits, no reads.
    gather_and_check(gpu.as_ref(), &t, &[11, 7, 0], s);
    let st2 = t.stats();
    assert_eq!((st2.misses, st2.hits, st2.read_calls), (4, 6, want.calls));
    t.check_invariants().unwrap();
}

/// What reading `ids` (sorted, distinct, one BF16 shard) should cost with
/// granule `a`: each row's span `[off & !(a-1), roundup(off + len, a))`,
/// overlapping or touching spans merged into one read.
struct Spans {
    calls: u64,
    bytes: u64,
    shared: u64,
}

fn spans(t: &CachedTable, base: u64, ids: &[u64], a: u64) -> Spans {
    let rb = t.info().row_bytes() as u64;
    let mut out = Spans {
        calls: 0,
        bytes: 0,
        shared: 0,
    };
    let mut cur: Option<(u64, u64)> = None;
    for &id in ids {
        let off = base + id * rb;
        let (lo, hi) = (off / a * a, (off + rb).div_ceil(a) * a);
        match &mut cur {
            Some((_, e)) if lo <= *e => {
                if lo < *e {
                    out.shared += 1;
                }
                *e = (*e).max(hi);
            }
            _ => {
                if let Some((s, e)) = cur {
                    out.calls += 1;
                    out.bytes += e - s;
                }
                cur = Some((lo, hi));
            }
        }
    }
    if let Some((s, e)) = cur {
        out.calls += 1;
        out.bytes += e - s;
    }
    out
}

#[test]
fn ids_past_the_end_are_refused_without_side_effects() {
    let d = tempfile::tempdir().unwrap();
    let files = make_table(d.path(), 2, 10, 8, false, 8);
    let (gpu, _) = backend();
    let t = CachedTable::open(files, gpu.clone(), cfg(4, 4)).unwrap();
    let mut out = vec![RowRef::default(); 2];
    let e = t.resolve(&[3, 20], &mut out).unwrap_err().to_string();
    assert!(e.contains("row id 20") && e.contains("(20 rows)"), "{e}");
    assert!(
        t.prefetch(&[99])
            .unwrap_err()
            .to_string()
            .contains("row id 99")
    );
    assert_eq!(t.mapped_rows(), 0);
    assert_eq!(t.stats(), Default::default());
    t.check_invariants().unwrap();
}

#[test]
fn batches_beyond_max_resolve_are_refused_then_split() {
    let d = tempfile::tempdir().unwrap();
    let files = make_table(d.path(), 3, 50, 16, false, 8);
    let (gpu, _) = backend();
    let t = CachedTable::open(files, gpu.clone(), cfg(8, 6)).unwrap();
    let ids: Vec<u64> = (0..40)
        .map(|i| (i * 37 % 150) as u64)
        .chain([3, 3, 77])
        .collect();
    let mut out = vec![RowRef::default(); ids.len()];
    let e = t.resolve(&ids, &mut out).unwrap_err();
    assert!(
        matches!(e, StorageError::BatchTooLarge { limit: 6, .. }),
        "{e:?}"
    );
    assert!(e.to_string().contains("limit of 6"), "{e}");
    t.check_invariants().unwrap();
    assert_eq!(t.stats().misses, 0);
    // The split protocol gathers every row correctly through 8 slots.
    let s = gpu.create_stream().unwrap();
    let rb = 32;
    let mut got = vec![0u8; ids.len() * rb];
    let parts = resolve_in_parts(&t, gpu.as_ref(), &ids, |start, part, refs| {
        let bufs = GatherBufs::new(gpu.as_ref(), part.len(), rb, false);
        bufs.queue(gpu.as_ref(), refs, s);
        let ev = gpu.create_event()?;
        gpu.record_event(ev, s)?;
        let (o, _) = bufs.read(gpu.as_ref(), s);
        got[start * rb..(start + part.len()) * rb].copy_from_slice(&o);
        bufs.free(gpu.as_ref());
        Ok::<_, StorageError>(Some(ev))
    })
    .unwrap();
    assert!(parts >= 7, "{parts} parts");
    for (i, &id) in ids.iter().enumerate() {
        assert_eq!(&got[i * rb..(i + 1) * rb], &row(id, rb)[..], "row {id}");
    }
    t.check_invariants().unwrap();
}

#[test]
fn prefetched_rows_are_hits() {
    let d = tempfile::tempdir().unwrap();
    let files = make_table(d.path(), 2, 100, 160, false, 4096);
    let (gpu, _) = backend();
    let t = CachedTable::open(files, gpu.clone(), cfg(64, 32)).unwrap();
    let ids = [5u64, 150, 99, 100, 42];
    t.prefetch(&ids).unwrap();
    t.wait_prefetched();
    let before = t.stats();
    assert_eq!(before.misses, 5);
    let s = gpu.create_stream().unwrap();
    gather_and_check(gpu.as_ref(), &t, &ids, s);
    let after = t.stats();
    assert_eq!(after.misses, 5, "resolve after prefetch must not read");
    assert_eq!(after.hits, 5);
    // A resolve racing a prefetch waits for it instead of reading twice.
    let more = [7u64, 8, 9, 170];
    t.prefetch(&more).unwrap();
    gather_and_check(gpu.as_ref(), &t, &more, s);
    assert_eq!(t.stats().misses, 9);
    t.check_invariants().unwrap();
}

/// `would_wait` is true while any id is not loaded (unseen, or queued by a
/// prefetch not yet read) and false once every one is, even unpinned.
#[test]
fn would_wait_until_every_row_is_loaded() {
    let d = tempfile::tempdir().unwrap();
    let files = make_table(d.path(), 2, 100, 160, false, 4096);
    let (gpu, _) = backend();
    let t = CachedTable::open(files, gpu.clone(), cfg(64, 32)).unwrap();
    let ids = [5u64, 150, 99];
    assert!(t.would_wait(&ids));
    let s = gpu.create_stream().unwrap();
    gather_and_check(gpu.as_ref(), &t, &ids, s);
    assert!(!t.would_wait(&ids), "loaded rows need no read");
    assert!(!t.would_wait(&[]));
    assert!(t.would_wait(&[5, 6]), "row 6 was never read");
    t.prefetch(&[6]).unwrap();
    t.wait_prefetched();
    assert!(!t.would_wait(&[5, 6]));
    t.check_invariants().unwrap();
}

#[test]
fn fp8_rows_come_with_their_scales() {
    let d = tempfile::tempdir().unwrap();
    let files = make_table(d.path(), 2, 40, 160, true, 8);
    let (gpu, _) = backend();
    let t = CachedTable::open(files, gpu.clone(), cfg(16, 16)).unwrap();
    let s = gpu.create_stream().unwrap();
    gather_and_check(gpu.as_ref(), &t, &[0, 39, 40, 79, 12, 12], s);
    t.check_invariants().unwrap();
}

/// When told to, fails every read of the next batch (with an errno or by
/// reporting a short count); otherwise reads for real.
struct Faulty {
    inner: Arc<dyn PageReader>,
    fault: Mutex<Option<Fault>>,
}

#[derive(Clone, Copy)]
enum Fault {
    Errno(i32),
    Short,
}

impl PageReader for Faulty {
    fn name(&self) -> &str {
        "faulty"
    }
    fn read_batch(&self, reqs: &mut [ReadReq<'_>]) -> Vec<io::Result<usize>> {
        match self.fault.lock().take() {
            None => self.inner.read_batch(reqs),
            Some(Fault::Errno(e)) => reqs
                .iter()
                .map(|_| Err(io::Error::from_raw_os_error(e)))
                .collect(),
            Some(Fault::Short) => self
                .inner
                .read_batch(reqs)
                .into_iter()
                .map(|r| r.map(|n| n.min(100)))
                .collect(),
        }
    }
}

#[test]
fn read_faults_name_file_offset_and_row_and_a_retry_succeeds() {
    let d = tempfile::tempdir().unwrap();
    let files = make_table(d.path(), 2, 100, 160, false, 4096);
    let path0 = files.shards[0].path.display().to_string();
    let row_off = files.locate(50).unwrap().offset;
    let faulty = Arc::new(Faulty {
        inner: default_reader(8).unwrap(),
        fault: Mutex::new(None),
    });
    let (gpu, _) = backend();
    let mut c = cfg(16, 16);
    c.reader = Some(faulty.clone());
    let t = CachedTable::open(files, gpu.clone(), c).unwrap();
    let granule = t.read_alignment()[0].offset as u64;
    let s = gpu.create_stream().unwrap();
    // Rows already cached and under a live lease must survive the fault.
    let held = [1u64, 2];
    let mut held_refs = vec![RowRef::default(); 2];
    let held_lease = t.resolve(&held, &mut held_refs).unwrap();
    let mapped = t.mapped_rows();
    for fault in [Fault::Errno(libc::EIO), Fault::Short] {
        *faulty.fault.lock() = Some(fault);
        let mut out = vec![RowRef::default(); 3];
        let e = format!("{:#}", t.resolve(&[50, 1, 150], &mut out).unwrap_err());
        assert!(e.contains(&path0) || e.contains("table-1"), "{e}");
        assert!(e.contains("offset"), "{e}");
        match fault {
            Fault::Errno(_) => assert!(
                e.contains(&format!("{}", row_off / granule * granule)) && e.contains("row 50"),
                "{e}"
            ),
            Fault::Short => assert!(e.contains("short read") && e.contains("row 50"), "{e}"),
        }
        t.check_invariants().unwrap();
        assert_eq!(
            t.mapped_rows(),
            mapped,
            "the failed batch's slots must be unmapped"
        );
    }
    // The retry reads for real and every byte is right.
    gather_and_check(gpu.as_ref(), &t, &[50, 1, 150], s);
    t.release(held_lease, gpu.as_ref(), None).unwrap();
    gather_and_check(gpu.as_ref(), &t, &held, s);
    t.check_invariants().unwrap();
}

#[test]
fn a_truncated_file_is_an_error_naming_file_offset_and_row() {
    let d = tempfile::tempdir().unwrap();
    let files = make_table(d.path(), 2, 100, 160, false, 4096);
    let p1 = files.shards[1].path.clone();
    let full = std::fs::read(&p1).unwrap();
    let cut = files.shards[1].data_offset + 60 * 320;
    let (gpu, _) = backend();
    let t = CachedTable::open(files, gpu.clone(), cfg(16, 16)).unwrap();
    let s = gpu.create_stream().unwrap();
    std::fs::OpenOptions::new()
        .write(true)
        .open(&p1)
        .unwrap()
        .set_len(cut)
        .unwrap();
    // Row 170 is row 70 of shard 1, past the cut.
    let mut out = vec![RowRef::default(); 2];
    let e = format!("{:#}", t.resolve(&[3, 170], &mut out).unwrap_err());
    assert!(
        e.contains("table-1.safetensors") && e.contains("row 170") && e.contains("offset"),
        "{e}"
    );
    t.check_invariants().unwrap();
    assert_eq!(t.mapped_rows(), 0);
    // Rows before the cut still read; restoring the file makes the retry work.
    gather_and_check(gpu.as_ref(), &t, &[3, 110], s);
    std::fs::write(&p1, &full).unwrap();
    gather_and_check(gpu.as_ref(), &t, &[3, 170], s);
}

/// Several threads resolve and gather against one cache that is far too
/// small for their ids; every gathered byte must match the file.
#[test]
fn concurrent_resolves_and_gathers_are_byte_exact() {
    let d = tempfile::tempdir().unwrap();
    let files = make_table(d.path(), 4, 100, 160, false, 8);
    let (gpu, _) = backend();
    let t = Arc::new(CachedTable::open(files, gpu.clone(), cfg(96, 24)).unwrap());
    let threads: Vec<_> = (0..4u64)
        .map(|k| {
            let t = t.clone();
            let gpu = gpu.clone();
            std::thread::spawn(move || {
                let mut rng = StdRng::seed_from_u64(k);
                let s = gpu.create_stream().unwrap();
                for it in 0..40 {
                    let n = rng.gen_range(1..=32);
                    // A hot set plus a cold tail, with repeats.
                    let ids: Vec<u64> = (0..n)
                        .map(|_| {
                            if rng.gen_bool(0.5) {
                                rng.gen_range(0..20)
                            } else {
                                rng.gen_range(0..400)
                            }
                        })
                        .collect();
                    if it % 3 == 0 {
                        t.prefetch(&ids[..n / 2]).unwrap();
                    }
                    let parts = metrale_storage::parts::split_points(&ids, t.max_resolve());
                    for p in parts {
                        gather_and_check(gpu.as_ref(), t.as_ref(), &ids[p], s);
                    }
                }
                gpu.synchronize(s).unwrap();
            })
        })
        .collect();
    for h in threads {
        h.join().unwrap();
    }
    t.wait_prefetched();
    t.check_invariants().unwrap();
    let st = t.stats();
    assert!(st.evictions > 0 && st.hits > 0 && st.misses > 0, "{st:?}");
}
