//! Table benchmarks. One run prints every figure beside a baseline measured
//! in the same run, and the ratio:
//! - random-row gather from the resident table (GB/s) vs `memcpy`;
//! - cache hit path (ns per id) vs a plain `HashMap` lookup, and the 50 ns
//!   target;
//! - cache miss path: O_DIRECT 4 KiB random reads/s at queue depth 32 vs
//!   `fio` on the same file (when `fio` is on PATH), plus rows/s through
//!   the whole cache;
//! - hit rate of the cache (default policy) on a Zipf(1.1) id stream over a
//!   table 20x the arena vs an exact LRU (and an S3-FIFO model) simulated on
//!   the stream.
//!
//! Files live in a temporary directory (`BENCH_DIR`, default the system
//! temp dir): about 168 MB, removed at the end. `BENCH_PF` sets the gather's
//! software prefetch distance in rows (default 16, 0 disables it).
//!
//! The gather, hit and read workloads are `metrale_bench::table`'s, the
//! ones `metrale-ple bench` times.

use std::collections::{HashMap, VecDeque};
use std::path::Path;
use std::process::Command;
use std::sync::Arc;
use std::time::Instant;

use anyhow::{Context, Result};
use metrale_bench::table::{CacheHits, HitSizes, RandomReads, ResidentGather, write_table};
use metrale_gpu_runtime::cpu::CpuBackend;
use metrale_gpu_runtime::gpu::GpuBackend;
use metrale_storage::cached::{CacheConfig, CachedTable};
use metrale_storage::layout::TableFiles;
use metrale_storage::table::{RowRef, RowTable};
use metrale_storage::zipf::Zipf;
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

const SHARDS: usize = 4;
const ROWS_PER_SHARD: u64 = 131_072;
const HEAD_DIM: usize = 160;
const ROW_BYTES: usize = 320;

fn line(what: &str, v: f64, unit: &str, base_what: &str, b: f64, bunit: &str, note: &str) {
    println!(
        "{what:<44} {v:>10.3} {unit:<8} | {base_what:<28} {b:>10.3} {bunit:<8} | ratio {:>6.3} {note}",
        v / b
    );
}

fn best(v: Vec<f64>) -> f64 {
    v.into_iter().fold(f64::MIN, f64::max)
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    v[v.len() / 2]
}

fn bench_resident(files: &TableFiles, gpu: &Arc<dyn GpuBackend>) -> Result<()> {
    let mut w = ResidentGather::new(files, gpu.clone(), 65_536, 1)?;
    if let Some(pf) = std::env::var("BENCH_PF").ok().and_then(|v| v.parse().ok()) {
        w.set_prefetch(pf);
    }
    let (n, bytes) = (w.rows(), w.bytes() as f64);
    let mut gather = Vec::new();
    let mut resolve_ns = Vec::new();
    // Baseline: memcpy of the same byte count, contiguous, interleaved with
    // the gather so both see the same machine load.
    let mut copy = Vec::new();
    for _ in 0..25 {
        let t0 = Instant::now();
        w.resolve()?;
        resolve_ns.push(t0.elapsed().as_nanos() as f64 / n as f64);
        w.upload()?;
        let t0 = Instant::now();
        w.run()?;
        gather.push(bytes / t0.elapsed().as_secs_f64() / 1e9);
        let t0 = Instant::now();
        w.baseline();
        copy.push(bytes / t0.elapsed().as_secs_f64() / 1e9);
    }
    line(
        &format!(
            "resident gather, {n} random {} B rows (best of 25)",
            w.row_bytes()
        ),
        best(gather),
        "GB/s",
        "memcpy same bytes",
        best(copy),
        "GB/s",
        "(target >= 0.5)",
    );
    println!(
        "{:<44} {:>10.3} ns/id",
        "  resident resolve",
        median(resolve_ns)
    );
    w.close()
}

fn bench_hits(files: &TableFiles, gpu: &Arc<dyn GpuBackend>) -> Result<()> {
    let sizes = HitSizes {
        slots: 16_384,
        hot: 8192,
        batch: 256,
        batches_per_round: 100,
        rounds: 40,
    };
    let mut w = CacheHits::new(files, gpu.clone(), &sizes, 2)?;
    let ids = w.ids_per_round() as f64;
    let (mut ours, mut theirs) = (Vec::new(), Vec::new());
    for _ in 0..sizes.rounds {
        let t0 = Instant::now();
        w.run()?;
        ours.push(t0.elapsed().as_nanos() as f64 / ids);
        let t0 = Instant::now();
        w.baseline();
        theirs.push(t0.elapsed().as_nanos() as f64 / ids);
    }
    w.check()?;
    let ns = -best(ours.iter().map(|v| -v).collect());
    let base = -best(theirs.iter().map(|v| -v).collect());
    println!(
        "{:<44} {:>10.3} ns/id (median of {} rounds)",
        "  cache hit path, median",
        median(ours),
        sizes.rounds
    );
    line(
        "cache hit path, batches of 256 (best round)",
        ns,
        "ns/id",
        "std HashMap lookup",
        base,
        "ns/id",
        "(target < 50 ns/id)",
    );
    Ok(())
}

fn fio_iops(file: &Path, secs: u32) -> Option<(f64, String)> {
    for engine in ["io_uring", "libaio"] {
        let out = Command::new("fio")
            .args([
                "--name=bench",
                &format!("--filename={}", file.display()),
                "--rw=randread",
                "--bs=4k",
                "--iodepth=32",
                &format!("--ioengine={engine}"),
                "--direct=1",
                "--numjobs=1",
                &format!("--runtime={secs}"),
                "--time_based",
                "--output-format=json",
            ])
            .output()
            .ok()?;
        if !out.status.success() {
            continue;
        }
        let text = String::from_utf8_lossy(&out.stdout);
        let start = text.find('{')?;
        let v: serde_json::Value = serde_json::from_str(&text[start..]).ok()?;
        if let Some(iops) = v["jobs"][0]["read"]["iops"].as_f64() {
            return Some((iops, engine.to_string()));
        }
    }
    None
}

fn bench_misses(files: &TableFiles, gpu: &Arc<dyn GpuBackend>) -> Result<()> {
    let path = &files.shards[0].path;
    // Batches of 4096 keep the ring at depth 32 except for a short drain at
    // each batch end. Ours and fio alternate, twice, and each keeps its best
    // run, so both see similar load from the shared disk.
    let mut w = RandomReads::new(path, 4096, 3)?;
    let mut rng = SmallRng::seed_from_u64(3);
    let mut ours_runs = Vec::new();
    let mut fio_runs = Vec::new();
    for _ in 0..2 {
        let t0 = Instant::now();
        let mut reads = 0u64;
        while t0.elapsed().as_secs_f64() < 2.0 {
            reads += w.run()?;
        }
        ours_runs.push(reads as f64 / t0.elapsed().as_secs_f64());
        if let Some(r) = fio_iops(path, 2) {
            fio_runs.push(r);
        }
    }
    let ours = best(ours_runs);
    let mode = if w.direct() {
        "O_DIRECT"
    } else {
        "buffered (O_DIRECT refused)"
    };
    let fio = fio_runs
        .iter()
        .map(|r| r.0)
        .fold(None, |a: Option<f64>, v| Some(a.map_or(v, |a| a.max(v))));
    match fio.zip(fio_runs.first().map(|r| r.1.clone())) {
        Some((fio, engine)) => line(
            &format!("miss path: {} 4 KiB reads QD32, {mode}", w.reader_name()),
            ours / 1e3,
            "kIOPS",
            &format!("fio randread {engine} QD32"),
            fio / 1e3,
            "kIOPS",
            "(target >= 0.9)",
        ),
        None => println!(
            "{:<44} {:>10.3} kIOPS | fio not on PATH or failed: no baseline measured",
            format!("miss path: {} 4 KiB reads QD32, {mode}", w.reader_name()),
            ours / 1e3
        ),
    }
    // The whole cache miss path: cold rows through resolve.
    let mut c = CacheConfig::new(65_536);
    c.max_resolve = 4096;
    let t = CachedTable::open(files.clone(), gpu.clone(), c)?;
    let mut out = vec![RowRef::default(); 256];
    let rows = files.info.rows;
    let t0 = Instant::now();
    while t0.elapsed().as_secs_f64() < 2.0 {
        let ids: Vec<u64> = (0..256).map(|_| rng.gen_range(0..rows)).collect();
        let l = t.resolve(&ids, &mut out)?;
        t.release(l, gpu.as_ref(), None)?;
    }
    let el = t0.elapsed().as_secs_f64();
    let st = t.stats();
    println!(
        "{:<44} {:>10.3} krows/s | {:.1} k read calls/s, {:.2} KiB/row, {} rows shared a page, direct={}",
        "  cache miss path, batches of 256 cold ids",
        st.misses as f64 / el / 1e3,
        st.read_calls as f64 / el / 1e3,
        st.bytes_read as f64 / st.misses.max(1) as f64 / 1024.0,
        st.pages_coalesced,
        t.direct_io()
    );
    Ok(())
}

fn lru_hits(stream: &[u64], cap: usize) -> u64 {
    // Exact LRU: a recency stamp per resident id plus a FIFO of (id, stamp)
    // with lazy deletion.
    let mut stamp: HashMap<u64, u64> = HashMap::new();
    let mut q: VecDeque<(u64, u64)> = VecDeque::new();
    let mut hits = 0;
    for (t, &id) in stream.iter().enumerate() {
        let t = t as u64;
        if stamp.insert(id, t).is_some() {
            hits += 1;
        } else if stamp.len() > cap {
            while let Some((old, st)) = q.pop_front() {
                if stamp.get(&old) == Some(&st) {
                    stamp.remove(&old);
                    break;
                }
            }
        }
        q.push_back((id, t));
    }
    hits
}

fn s3fifo_hits(stream: &[u64], cap: usize) -> u64 {
    let small_cap = (cap / 10).max(1);
    let main_cap = cap - small_cap;
    let mut small: VecDeque<u64> = VecDeque::new();
    let mut main: VecDeque<u64> = VecDeque::new();
    let mut freq: HashMap<u64, u8> = HashMap::new();
    let mut ghost: HashMap<u64, u64> = HashMap::new();
    let mut ghost_q: VecDeque<(u64, u64)> = VecDeque::new();
    let mut hits = 0;
    let mut tick = 0u64;
    let insert_main = |id: u64, main: &mut VecDeque<u64>, freq: &mut HashMap<u64, u8>| {
        while main.len() >= main_cap {
            let y = main.pop_front().unwrap();
            let f = freq[&y];
            if f > 0 {
                freq.insert(y, f - 1);
                main.push_back(y);
            } else {
                freq.remove(&y);
            }
        }
        main.push_back(id);
    };
    for &id in stream {
        tick += 1;
        if let Some(f) = freq.get_mut(&id) {
            *f = (*f + 1).min(3);
            hits += 1;
            continue;
        }
        if ghost.remove(&id).is_some() {
            freq.insert(id, 0);
            insert_main(id, &mut main, &mut freq);
            continue;
        }
        if small.len() >= small_cap {
            let y = small.pop_front().unwrap();
            if freq[&y] > 0 {
                freq.insert(y, 0);
                insert_main(y, &mut main, &mut freq);
            } else {
                freq.remove(&y);
                ghost.insert(y, tick);
                ghost_q.push_back((y, tick));
                while ghost.len() > main_cap {
                    let (g, t) = ghost_q.pop_front().unwrap();
                    if ghost.get(&g) == Some(&t) {
                        ghost.remove(&g);
                    }
                }
            }
        }
        small.push_back(id);
        freq.insert(id, 0);
    }
    hits
}

fn bench_zipf(files: &TableFiles, gpu: &Arc<dyn GpuBackend>) -> Result<()> {
    let rows = files.info.rows as usize;
    let slots = rows / 20;
    let mut rng = SmallRng::seed_from_u64(4);
    // Hot ranks scattered over the table, as the id hash scatters them.
    let mut perm: Vec<u64> = (0..rows as u64).collect();
    for i in (1..rows).rev() {
        perm.swap(i, rng.gen_range(0..=i));
    }
    let z = Zipf::new(rows, 1.1);
    let stream: Vec<u64> = (0..300_000).map(|_| perm[z.rank(rng.r#gen())]).collect();
    let mut c = CacheConfig::new(slots);
    c.max_resolve = 64;
    let t = CachedTable::open(files.clone(), gpu.clone(), c)?;
    let mut out = vec![RowRef::default(); 16];
    for b in stream.chunks(16) {
        let l = t.resolve(b, &mut out[..b.len()])?;
        t.release(l, gpu.as_ref(), None)?;
    }
    let st = t.stats();
    let ours = st.hits as f64 / (st.hits + st.misses) as f64;
    let lru = lru_hits(&stream, slots) as f64 / stream.len() as f64;
    let s3 = s3fifo_hits(&stream, slots) as f64 / stream.len() as f64;
    line(
        &format!(
            "hit rate, {} cache, Zipf 1.1, {slots} slots",
            t.policy().name()
        ),
        ours * 100.0,
        "%",
        "exact LRU (simulated)",
        lru * 100.0,
        "%",
        "(table = 20x arena, 300k ids in batches of 16)",
    );
    println!(
        "{:<44} {:>10.3} %        | S3-FIFO model on the same stream (benches/policy.rs compares the cache's own policies)",
        "",
        s3 * 100.0
    );
    Ok(())
}

fn main() -> Result<()> {
    let base = std::env::var_os("BENCH_DIR")
        .map(Into::into)
        .unwrap_or_else(std::env::temp_dir);
    let dir = tempfile::tempdir_in(&base)
        .with_context(|| format!("creating a temp dir in {}", base.display()))?;
    let t0 = Instant::now();
    let files = write_table(dir.path(), SHARDS, ROWS_PER_SHARD, HEAD_DIM, 7)?;
    println!(
        "table: {} rows x {} B in {} shards under {} (written in {:.1} s)",
        files.info.rows,
        ROW_BYTES,
        SHARDS,
        dir.path().display(),
        t0.elapsed().as_secs_f64()
    );
    let gpu: Arc<dyn GpuBackend> = Arc::new(CpuBackend::new());
    bench_resident(&files, &gpu)?;
    bench_hits(&files, &gpu)?;
    bench_misses(&files, &gpu)?;
    bench_zipf(&files, &gpu)?;
    Ok(())
}
