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
//! Run: `cargo bench -p metrale-engine --bench engine`.

use std::hint::black_box;
use std::sync::Arc;
use std::time::{Duration, Instant};

use metrale_engine::engine::{EngineConfig, SwapTarget};
use metrale_engine::testing::{TinySpec, tiny_engine};
use metrale_gpu_runtime::cpu::CpuBackend;
use metrale_gpu_runtime::gpu::GpuBackend;

fn median(mut v: Vec<Duration>) -> Duration {
    v.sort();
    v[v.len() / 2]
}

fn rows(n: usize, width: usize, salt: u32) -> Vec<f32> {
    (0..n * width)
        .map(|i| {
            let x = (i as u32).wrapping_mul(2_654_435_761) ^ salt;
            (x >> 8) as f32 / (1u32 << 24) as f32 - 0.5
        })
        .collect()
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
    let w = e.width();
    let prefix = (prefix / block).max(1) * block;
    let prompt: Vec<u32> = (0..prefix as u32 + 1).map(|i| 1 + i * 7 % 997).collect();

    // ---- 1. prefix restore vs recompute ----
    let mut recompute = Vec::new();
    for rep in 0..3 {
        let id = plain.add_sequence(&prompt).unwrap().id;
        let mut hw = rows(prefix, w, rep);
        let t = Instant::now();
        plain.prefill(id, &prompt[..prefix], &mut hw).unwrap();
        recompute.push(t.elapsed());
        black_box(&hw);
        plain.release(id).unwrap();
    }
    // Populate the cache: one prefill that snapshots every block boundary.
    let id = e.add_sequence(&prompt).unwrap().id;
    let mut hw = rows(prefix, w, 0);
    let t = Instant::now();
    e.prefill(id, &prompt[..prefix], &mut hw).unwrap();
    let populate = t.elapsed();
    e.release(id).unwrap();
    let mut restore = Vec::new();
    for _ in 0..50 {
        let t = Instant::now();
        let a = e.add_sequence(&prompt).unwrap();
        restore.push(t.elapsed());
        assert_eq!(a.cached, prefix, "the whole prefix should hit");
        e.release(a.id).unwrap();
    }
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
    let id = e.add_sequence(&prompt[..65]).unwrap().id;
    let mut hw = rows(65, w, 9);
    e.prefill(id, &prompt[..65], &mut hw).unwrap();
    let bytes = e.carry_bytes();
    let (mut outs, mut ins, mut copies) = (Vec::new(), Vec::new(), Vec::new());
    let src = vec![0x5au8; bytes];
    let mut dst = vec![0u8; bytes];
    for _ in 0..100 {
        let t = Instant::now();
        e.swap_out(id, SwapTarget::Host).unwrap();
        outs.push(t.elapsed());
        let t = Instant::now();
        e.swap_in(id).unwrap();
        ins.push(t.elapsed());
        let t = Instant::now();
        dst.copy_from_slice(black_box(&src));
        black_box(&mut dst);
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
    e.release(id).unwrap();
    e.close().unwrap();
    plain.close().unwrap();
}
