//! The disk's random-read ceiling on one file through the miss path's
//! reader ([`RandomReads`]): reads a second, the round trip of a batch of
//! [`ROUND_READS`] reads issued together, and the CPU one read takes from
//! cores that compute ([`read_cpu_cost`]).
//!
//! Invariant: every figure is measured in the calling run on the given
//! file; nothing is estimated.

use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::Result;

use crate::table::RandomReads;

/// Reads in a batch of the disk's round-trip probe: about the misses of
/// one pipeline group of a full-run decode step.
pub const ROUND_READS: usize = 64;

/// Random reads a second the CPU-cost probe asks for: about what a
/// full-run decode step without the backbone asks of the disk.
pub const COST_READS_PER_S: f64 = 30_000.0;

/// What the disk gives the miss path, measured on one shard file.
pub struct Disk {
    /// Random 4 KiB reads per second, 1024 at a time.
    pub reads_per_s: f64,
    /// Median wall time of a batch of [`ROUND_READS`] random 4 KiB reads
    /// issued together: the least a step waits for rows first asked for
    /// when it starts.
    pub round: Duration,
    /// Microseconds of CPU one random read takes from cores that compute
    /// (see [`read_cpu_cost`]).
    pub read_cpu_us: f64,
    /// The reader's name (io_uring, or the pread pool).
    pub reader: String,
    /// Whether the file was read with O_DIRECT (else buffered).
    pub direct: bool,
}

/// A chain of dependent multiply-adds on each of `cores` threads: `iters`
/// steps each.
fn spin_all(cores: usize, iters: u64) -> Duration {
    let t0 = Instant::now();
    std::thread::scope(|s| {
        for _ in 0..cores {
            s.spawn(move || {
                let mut x = 1.0f64;
                for i in 0..iters {
                    x = std::hint::black_box(x * 1.000_000_1 + i as f64 * 1e-12);
                }
                x
            });
        }
    });
    t0.elapsed()
}

/// The CPU one random 4 KiB read takes from the cores that compute: a
/// fixed spin on every core, timed alone and beside a thread reading
/// [`ROUND_READS`] at a time at [`COST_READS_PER_S`]; the core time the
/// spin lost, over the reads done meanwhile. It counts what no thread's
/// clock shows (interrupts and completions handled on a computing core),
/// which is what a miss costs a step whose compute fills every core. The
/// two timings alternate, three pairs, and the median pair counts, so a
/// shared machine's drift slows both sides of a pair alike; the figure can
/// still come out below zero where reads cost less than that noise.
pub fn read_cpu_cost(path: &Path, window: Duration) -> Result<f64> {
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    // About `window` of spin: calibrated on a short run.
    let probe = 2_000_000;
    let per = spin_all(cores, probe).as_secs_f64().max(1e-6) / probe as f64;
    let iters = (window.as_secs_f64() / per) as u64;
    let mut costs = Vec::new();
    for seed in [13, 17, 19] {
        let alone = spin_all(cores, iters);
        let mut r = RandomReads::new(path, ROUND_READS, seed)?;
        let stop = std::sync::atomic::AtomicBool::new(false);
        let (with, reads) = std::thread::scope(|s| {
            let reader = s.spawn(|| -> Result<u64> {
                let t0 = Instant::now();
                let mut n = 0u64;
                while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                    n += r.run()?;
                    let due = Duration::from_secs_f64(n as f64 / COST_READS_PER_S);
                    if let Some(w) = due.checked_sub(t0.elapsed()) {
                        std::thread::sleep(w);
                    }
                }
                Ok(n)
            });
            let took = spin_all(cores, iters);
            stop.store(true, std::sync::atomic::Ordering::Relaxed);
            (took, reader.join())
        });
        let reads = reads.map_err(|_| anyhow::anyhow!("the read-cost reader panicked"))??;
        let lost = (with.as_secs_f64() - alone.as_secs_f64()) * cores as f64;
        costs.push(lost / reads.max(1) as f64 * 1e6);
    }
    costs.sort_by(f64::total_cmp);
    Ok(costs[costs.len() / 2])
}

/// The disk's random 4 KiB read rate, round trip and CPU per read on
/// `path` through the miss path's reader.
pub fn disk_ceiling(path: &Path, window: Duration) -> Result<Disk> {
    let mut w = RandomReads::new(path, 1024, 7)?;
    let t0 = Instant::now();
    let mut reads = 0u64;
    while t0.elapsed() < window {
        reads += w.run()?;
    }
    let reads_per_s = reads as f64 / t0.elapsed().as_secs_f64().max(1e-9);
    let mut r = RandomReads::new(path, ROUND_READS, 11)?;
    let mut rounds = Vec::new();
    let t0 = Instant::now();
    while rounds.len() < 16 || (t0.elapsed() < window / 4 && rounds.len() < 2000) {
        let t = Instant::now();
        r.run()?;
        rounds.push(t.elapsed());
    }
    rounds.sort_unstable();
    Ok(Disk {
        reads_per_s,
        round: rounds[rounds.len() / 2],
        read_cpu_us: read_cpu_cost(path, window / 4)?,
        reader: w.reader_name().to_string(),
        direct: w.direct(),
    })
}
