//! Engine benchmark, each figure beside a baseline measured in the same run:
//!
//! 1. a prefix-cache hit (add a sequence whose prompt prefix is cached:
//!    lookup, carry allocation, restore) against recomputing the same prefix
//!    (add without cache, prefill the prefix in chunks of 512);
//! 2. swap-out and swap-in of one sequence's carry (host target) against a
//!    `memcpy` of the same number of bytes.
//!
//! The geometry is the flagship's carry and compute shape (hidden 2560,
//! hc 4, 16 heads of 160, kernel 4, dilation 3: a 368,640-byte conv state)
//! with random weights and a small resident table.
//! `METRALE_BENCH_PREFIX` sets the prefix length (default 512, rounded down
//! to the block size of 64).
//!
//! The workloads are `metrale_bench::engine`'s, the ones `metrale-ple
//! bench` times.
//!
//! Run: `cargo bench -p metrale-bench --bench engine`.

use std::sync::Arc;
use std::time::{Duration, Instant};

use metrale_bench::engine::{PrefixRestore, SwapCarry};
use metrale_engine::EngineConfig;
use metrale_gpu_runtime::cpu::CpuBackend;
use metrale_gpu_runtime::gpu::GpuBackend;
use metrale_testkit::tiny::{TinySpec, tiny_engine};

fn median(mut v: Vec<Duration>) -> Duration {
    v.sort();
    v[v.len() / 2]
}

fn fmt(d: Duration) -> String {
    let us = d.as_secs_f64() * 1e6;
    if us >= 1000.0 {
        format!("{:.2} ms", us / 1000.0)
    } else {
        format!("{us:.1} us")
    }
}

fn main() {
    let prefix: usize = std::env::var("METRALE_BENCH_PREFIX")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(512);
    let gpu: Arc<dyn GpuBackend> = Arc::new(CpuBackend::new());
    let spec = TinySpec {
        hidden: 2560,
        hc_mult: 4,
        heads_per_ngram: 8,
        head_dim: 160,
        kernel: 4,
        dilation: 3,
        max_tokens: 512,
        eos: 0,
    };
    let block = 64;
    let cfg = EngineConfig {
        prefill_chunk: 512,
        block_size: block,
        prefix_cache_bytes: 64 << 20,
        ..Default::default()
    };
    let t0 = Instant::now();
    let mut e = tiny_engine(&gpu, &spec, 1, 1, cfg.clone()).expect("building the engine");
    // The same model (same seed) without a prefix cache: the recompute path.
    let plain_cfg = EngineConfig {
        prefix_cache_bytes: 0,
        ..cfg
    };
    let mut plain = tiny_engine(&gpu, &spec, 1, 1, plain_cfg).expect("building the engine");
    eprintln!("engines built in {:.2} s", t0.elapsed().as_secs_f64());

    // ---- 1. prefix restore vs recompute ----
    let t = Instant::now();
    let mut w = PrefixRestore::new(&mut e, &mut plain, prefix, block).expect("filling the cache");
    let populate = t.elapsed();
    let prefix = w.prefix();
    let mut recompute = Vec::new();
    for _ in 0..3 {
        w.prepare_baseline().unwrap();
        let t = Instant::now();
        w.baseline().unwrap();
        recompute.push(t.elapsed());
        w.release().unwrap();
    }
    let mut restore = Vec::new();
    for _ in 0..50 {
        let t = Instant::now();
        w.run().unwrap();
        restore.push(t.elapsed());
        w.release().unwrap();
    }
    drop(w);
    let (rc, rs) = (median(recompute), median(restore));
    println!(
        "prefix {prefix} tokens: restore from cache {} vs recompute {} (ratio {:.0}x faster)",
        fmt(rs),
        fmt(rc),
        rc.as_secs_f64() / rs.as_secs_f64()
    );
    println!(
        "prefill of {prefix} tokens with a snapshot every {block}: {} vs plain {} (ratio {:.2})",
        fmt(populate),
        fmt(rc),
        populate.as_secs_f64() / rc.as_secs_f64()
    );

    // ---- 2. swap-out / swap-in vs memcpy ----
    let mut w = SwapCarry::new(&mut e, block + 1).expect("adding the sequence");
    let bytes = w.carry_bytes();
    let (mut outs, mut ins, mut copies) = (Vec::new(), Vec::new(), Vec::new());
    for _ in 0..100 {
        let t = Instant::now();
        w.swap_out().unwrap();
        outs.push(t.elapsed());
        let t = Instant::now();
        w.swap_in().unwrap();
        ins.push(t.elapsed());
        let t = Instant::now();
        w.baseline();
        copies.push(t.elapsed());
    }
    let (o, i, m) = (median(outs), median(ins), median(copies));
    println!(
        "swap of a {bytes}-byte carry: out {} ({:.1}x memcpy), in {} ({:.1}x memcpy), memcpy {}",
        fmt(o),
        o.as_secs_f64() / m.as_secs_f64(),
        fmt(i),
        i.as_secs_f64() / m.as_secs_f64(),
        fmt(m)
    );
    w.close().unwrap();
    e.close().unwrap();
    plain.close().unwrap();
}
