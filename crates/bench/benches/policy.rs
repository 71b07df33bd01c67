//! Row-cache policy and read-size benchmarks. Every figure is printed beside
//! a baseline measured in the same run, with the ratio:
//! - hit rate of the arena under S3-FIFO vs CLOCK, on one Zipf(1.0) stream
//!   of row ids mixed with one-off ids (none, 30 % and 60 % of the stream),
//!   replayed through real `CachedTable`s in batches of 16;
//! - disk reads saved by the host-memory tier (rows served from it) on the
//!   30 % stream, vs the same cache without one;
//! - bytes read per row missed, for 32 B and 320 B rows on cold random ids,
//!   vs the rows' own bytes (target: at most 2x);
//! - bytes read per row missed on a Zipf stream of 32 B and 320 B rows after
//!   hot-row packing (rows relaid by the hit counts of the stream's first half,
//!   replayed on its second half), vs the same cache on the unpacked table.
//!
//! Files live in a temporary directory (`BENCH_DIR`, default the system
//! temp dir): about 130 MB, removed at the end.

use std::sync::Arc;
use std::time::Instant;

use anyhow::{Context, Result};
use metrale_gpu_runtime::cpu::CpuBackend;
use metrale_gpu_runtime::gpu::GpuBackend;
use std::collections::HashMap;

use metrale_bench::table::write_table;
use metrale_storage::cached::{CacheConfig, CachedTable, Policy};
use metrale_storage::io::DioAlign;
use metrale_storage::layout::TableFiles;
use metrale_storage::relay::{fits_granule, hot_order, relay_rows};
use metrale_storage::table::{RowRef, RowTable, TableStats};
use metrale_storage::zipf::Zipf;
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

/// `len` ids: with probability `noise` the next id of a shuffled run of
/// ids outside the Zipf support (seen once per pass over half the table,
/// far beyond any arena's reach), else a Zipf(1.0) draw over the other half,
/// hot ranks scattered as the id hash scatters them.
fn stream(rows: u64, len: usize, noise: f64, seed: u64) -> Vec<u64> {
    let mut rng = SmallRng::seed_from_u64(seed);
    let mut perm: Vec<u64> = (0..rows).collect();
    for i in (1..perm.len()).rev() {
        perm.swap(i, rng.gen_range(0..=i));
    }
    let (hot, cold) = perm.split_at(perm.len() / 2);
    let z = Zipf::new(hot.len(), 1.0);
    let mut k = 0usize;
    (0..len)
        .map(|_| {
            if rng.r#gen::<f64>() < noise {
                k += 1;
                cold[k % cold.len()]
            } else {
                hot[z.rank(rng.r#gen())]
            }
        })
        .collect()
}

fn replay(
    files: &TableFiles,
    gpu: &Arc<dyn GpuBackend>,
    ids: &[u64],
    slots: usize,
    policy: Policy,
    host_rows: usize,
) -> Result<TableStats> {
    let mut c = CacheConfig::new(slots);
    c.max_resolve = 64;
    c.policy = policy;
    c.host_rows = host_rows;
    let t = CachedTable::open(files.clone(), gpu.clone(), c)?;
    let mut out = vec![RowRef::default(); 16];
    for b in ids.chunks(16) {
        let l = t.resolve(b, &mut out[..b.len()])?;
        t.release(l, gpu.as_ref(), None)?;
    }
    t.check_invariants()?;
    Ok(t.stats())
}

fn hit_rate(s: &TableStats) -> f64 {
    s.hits as f64 / (s.hits + s.misses) as f64
}

fn bench_policies(files: &TableFiles, gpu: &Arc<dyn GpuBackend>) -> Result<()> {
    let rows = files.info.rows;
    let slots = rows as usize / 20;
    for noise in [0.0, 0.3, 0.6] {
        let ids = stream(rows, 400_000, noise, 11);
        let s3 = replay(files, gpu, &ids, slots, Policy::S3Fifo, 0)?;
        let clock = replay(files, gpu, &ids, slots, Policy::Clock, 0)?;
        println!(
            "{:<50} {:>8.3} % | {:<10} {:>8.3} % | ratio {:>6.3}",
            format!(
                "hit rate S3-FIFO, Zipf 1.0 + {:.0}% one-off, {slots} slots",
                noise * 100.0
            ),
            hit_rate(&s3) * 100.0,
            "CLOCK",
            hit_rate(&clock) * 100.0,
            hit_rate(&s3) / hit_rate(&clock)
        );
    }
    let ids = stream(rows, 400_000, 0.3, 11);
    for policy in [Policy::S3Fifo, Policy::Clock] {
        let host = 4 * slots;
        let with = replay(files, gpu, &ids, slots, policy, host)?;
        let without = replay(files, gpu, &ids, slots, policy, 0)?;
        let disk = |s: &TableStats| (s.misses - s.host_hits) as f64;
        println!(
            "{:<50} {:>8.0} rows | {:<10} {:>8.0} rows | ratio {:>6.3} ({} host hits)",
            format!(
                "disk reads, {} + host tier of {host} rows, 30% one-off",
                policy.name()
            ),
            disk(&with),
            "no tier",
            disk(&without),
            disk(&with) / disk(&without),
            with.host_hits
        );
    }
    Ok(())
}

fn bench_bytes_per_miss(dir: &std::path::Path, gpu: &Arc<dyn GpuBackend>) -> Result<()> {
    for head_dim in [16usize, 160] {
        let sub = dir.join(format!("d{head_dim}"));
        std::fs::create_dir_all(&sub)?;
        let files = write_table(&sub, 1, 65_536, head_dim, 5)?;
        let rb = files.info.row_bytes() as f64;
        let mut c = CacheConfig::new(32_768);
        c.max_resolve = 256;
        let t = CachedTable::open(files.clone(), gpu.clone(), c)?;
        let granule = t.read_alignment()[0];
        let mut rng = SmallRng::seed_from_u64(9);
        let mut out = vec![RowRef::default(); 256];
        let t0 = Instant::now();
        for _ in 0..64 {
            let ids: Vec<u64> = (0..256)
                .map(|_| rng.gen_range(0..files.info.rows))
                .collect();
            let l = t.resolve(&ids, &mut out)?;
            t.release(l, gpu.as_ref(), None)?;
        }
        let el = t0.elapsed().as_secs_f64();
        let st = t.stats();
        println!(
            "{:<50} {:>8.1} B    | {:<10} {:>8.1} B    | ratio {:>6.3} (target <= 2; {} B granule from {:?}, direct={}, {:.0} krows/s)",
            format!("bytes read per row missed, {} B rows, cold", rb as usize),
            st.bytes_per_miss(),
            "row bytes",
            rb,
            st.bytes_per_miss() / rb,
            granule.offset,
            granule.source,
            t.direct_io(),
            st.misses as f64 / el / 1e3,
        );
    }
    Ok(())
}

/// Replay `ids` (mapped through `phys` when given) through a cache of
/// `slots` over `files`, in batches of 16.
fn replay_mapped(
    files: &TableFiles,
    gpu: &Arc<dyn GpuBackend>,
    ids: &[u64],
    phys: Option<&[u32]>,
    slots: usize,
) -> Result<TableStats> {
    let mapped: Vec<u64> = match phys {
        Some(m) => ids.iter().map(|&i| m[i as usize] as u64).collect(),
        None => ids.to_vec(),
    };
    replay(files, gpu, &mapped, slots, Policy::S3Fifo, 0)
}

fn bench_packing(dir: &std::path::Path, gpu: &Arc<dyn GpuBackend>) -> Result<()> {
    for head_dim in [16usize, 160] {
        pack_one(dir, gpu, head_dim)?;
    }
    Ok(())
}

fn pack_one(dir: &std::path::Path, gpu: &Arc<dyn GpuBackend>, head_dim: usize) -> Result<()> {
    let sub = dir.join(format!("pack-{head_dim}"));
    std::fs::create_dir_all(&sub)?;
    let src = write_table(&sub, 1, 131_072, head_dim, 21)?;
    let rows = src.info.rows;
    let rb = src.info.row_bytes() as f64;
    let slots = rows as usize / 20;
    let ids = stream(rows, 400_000, 0.0, 23);
    let (train, test) = ids.split_at(ids.len() / 2);
    let mut counts: HashMap<u64, u64> = HashMap::new();
    for &id in train {
        *counts.entry(id).or_insert(0) += 1;
    }
    let granule = DioAlign::query(&std::fs::File::open(&src.shards[0].path)?).offset as u64;
    let base = replay_mapped(&src, gpu, test, None, slots)?;
    for (what, aware) in [("granule-aware", true), ("dense", false)] {
        let path = sub.join(format!("packed-{what}.safetensors"));
        std::fs::copy(&src.shards[0].path, &path)?;
        let dst = TableFiles::open(&[src.shards[0].source_in(path)], Some(rows))?;
        let fits = fits_granule(&dst, granule);
        let order = if aware {
            hot_order(rows, &counts, &fits)
        } else {
            hot_order(rows, &counts, |_| true)
        };
        relay_rows(&src, &dst, &order, &mut |_, _| {})?;
        let mut phys = vec![0u32; order.len()];
        for (p, &o) in order.iter().enumerate() {
            phys[o as usize] = p as u32;
        }
        let packed = replay_mapped(&dst, gpu, test, Some(&phys), slots)?;
        println!(
            "{:<50} {:>8.1} B    | {:<10} {:>8.1} B    | ratio {:>6.3} ({:.2}x the row; unpacked {:.2}x; hit rates {:.1} % vs {:.1} %)",
            format!(
                "bytes per row missed, Zipf, {} B rows, packed {what}",
                rb as usize
            ),
            packed.bytes_per_miss(),
            "unpacked",
            base.bytes_per_miss(),
            packed.bytes_per_miss() / base.bytes_per_miss(),
            packed.bytes_per_miss() / rb,
            base.bytes_per_miss() / rb,
            hit_rate(&packed) * 100.0,
            hit_rate(&base) * 100.0,
        );
        std::fs::remove_file(&dst.shards[0].path)?;
    }
    Ok(())
}

fn main() -> Result<()> {
    let base = std::env::var_os("BENCH_DIR")
        .map(Into::into)
        .unwrap_or_else(std::env::temp_dir);
    let dir = tempfile::tempdir_in(&base)
        .with_context(|| format!("creating a temp dir in {}", base.display()))?;
    let gpu: Arc<dyn GpuBackend> = Arc::new(CpuBackend::new());
    bench_bytes_per_miss(dir.path(), &gpu)?;
    bench_packing(dir.path(), &gpu)?;
    let files = write_table(dir.path(), 2, 65_536, 160, 7)?;
    bench_policies(&files, &gpu)?;
    Ok(())
}
