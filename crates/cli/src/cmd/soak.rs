//! `metrale-ple soak`: random sequence lifecycles on many threads against
//! one engine, every output checked against a sequential reference.
//!
//! The engine runs the PLE sites of the tiny synthetic checkpoint (the one
//! `run` uses by default, written on first use); their tables stay on disk
//! behind the row cache, read through a reader that fails a small share of
//! read batches (EIO or a short read). Each thread owns its sequences and draws
//! operations at random: add (sharing prompt prefixes, so the prefix cache
//! hits), prefill in random chunks, batched decode, snapshot and restore
//! into a new sequence, swap out (host or file), speculative verify and
//! commit of any acceptance length, and release. The engine sits behind one
//! mutex (its API takes `&mut self`); the threads contend for it and for the
//! row caches' slots.
//!
//! Batched decode runs through captured graphs unless `--eager`; the
//! engine has a device budget (`--resident-carries`), so carries are
//! preempted and swapped back in under contention.
//!
//! Checking: every output row a sequence produced is recorded by position.
//! When a sequence ends (release, or lost to an injected fault) its tokens
//! are run through a second engine over the same files with a clean reader,
//! one plain prefill, and every recorded row must match bit for bit. A
//! failed operation must be explained by an injected fault: a failed site
//! call, or a carry lost to one ([`EngineError`] variants, not message
//! text). At the end the
//! engines are closed and the backend must hold no live allocation.
//!
//! Exit status: 0 when there were no mismatches, no unexplained errors and
//! no leaked allocation, 1 otherwise.

use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use clap::Args;
use metrale_checkpoint::Checkpoint;
use metrale_checkpoint::runtime::TableMode;
use metrale_engine::ple_site::PleSite;
use metrale_engine::{Engine, EngineConfig, EngineError, Place, SeqId, SwapTarget};
use metrale_gpu_runtime::cpu::CpuBackend;
use metrale_gpu_runtime::gpu::GpuBackend;
use metrale_storage::io::default_reader;
use parking_lot::Mutex;

use super::faults::FlakyReader;
use super::run::{EngineSetup, build_engine, checkpoint_dir};
use super::{CmdError, failure, input};
use metrale_storage::splitmix::SplitMix64;

/// Arguments of `metrale-ple soak`.
#[derive(Args, Debug)]
#[command(after_help = "Example:\n  metrale-ple soak --minutes 30 --threads 8")]
pub struct SoakArgs {
    /// How long to run, in minutes (fractions allowed).
    #[arg(long, default_value_t = 1.0)]
    minutes: f64,
    /// Threads driving the engine.
    #[arg(long, default_value_t = 4)]
    threads: usize,
    /// Seed of the random operations.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Share of table read batches that fail, in percent.
    #[arg(long, default_value_t = 2)]
    fault_percent: u64,
    /// Carries the engine's device budget holds (each thread keeps up to
    /// six sequences, so more are preempted to host memory and swapped back
    /// in on use); 0 for no limit.
    #[arg(long, default_value_t = 12)]
    resident_carries: usize,
    /// Decode eagerly instead of through captured graphs.
    #[arg(long)]
    eager: bool,
}

/// Most tokens per forward (prefill chunk, decode batch) of the engines.
const MAX_TOKENS: usize = 16;

/// An engine over the checkpoint's sites, tables behind a row cache of
/// `slots` slots per site read through `reader` (the default reader when
/// `None`).
fn build(
    ck: &Checkpoint,
    gpu: &Arc<dyn GpuBackend>,
    reader: Option<Arc<FlakyReader>>,
    cfg: EngineConfig,
    slots: usize,
    resident_carries: usize,
) -> Result<Engine<PleSite>> {
    build_engine(
        ck,
        gpu,
        &EngineSetup {
            mode: TableMode::Cached,
            slots,
            faults: reader,
            engine: cfg,
            resident_carries,
        },
        MAX_TOKENS,
    )
}

/// Highway rows of positions `from..to`: a function of the token prefix.
fn rows(tokens: &[u32], from: usize, to: usize, width: usize) -> Vec<f32> {
    let mut h = 0x1234_5678u64;
    let mut out = Vec::with_capacity((to - from) * width);
    for (i, &t) in tokens[..to].iter().enumerate() {
        h ^= u64::from(t).wrapping_mul(0x100_0000_01b3);
        h = h.rotate_left(23).wrapping_mul(0x9E37_79B9_7F4A_7C15);
        if i >= from {
            let mut s = h;
            out.extend(
                (0..width)
                    .map(|_| ((SplitMix64::step(&mut s) >> 41) as f32 / (1u64 << 23) as f32) - 1.0),
            );
        }
    }
    out
}

/// One sequence as its thread knows it.
struct Track {
    id: SeqId,
    prompt_left: Vec<u32>,
    tokens: Vec<u32>,
    outputs: Vec<Option<Vec<f32>>>,
}

#[derive(Default)]
struct Counters {
    ops: AtomicU64,
    sequences: AtomicU64,
    lost: AtomicU64,
    rows_checked: AtomicU64,
    mismatches: AtomicU64,
    unexplained: AtomicU64,
}

struct Shared {
    engine: Mutex<Engine<PleSite>>,
    reference: Mutex<Engine<PleSite>>,
    flaky: Arc<FlakyReader>,
    c: Counters,
    width: usize,
}

impl Shared {
    /// Compare every recorded output of `t` with a clean sequential run.
    fn check(&self, t: &Track) {
        if t.tokens.is_empty() {
            return;
        }
        let mut want = rows(&t.tokens, 0, t.tokens.len(), self.width);
        let r = {
            let mut e = self.reference.lock();
            e.add_sequence(&t.tokens).and_then(|a| {
                let r = e.prefill(a.id, &t.tokens, &mut want);
                let rel = e.release(a.id);
                r.and(rel)
            })
        };
        if let Err(e) = r {
            eprintln!("soak: reference run failed: {}", e.chain());
            self.c.unexplained.fetch_add(1, Ordering::Relaxed);
            return;
        }
        let w = self.width;
        for (p, o) in t.outputs.iter().enumerate() {
            let Some(o) = o else { continue };
            let exp = &want[p * w..(p + 1) * w];
            if o.iter().zip(exp).any(|(a, b)| a.to_bits() != b.to_bits()) {
                eprintln!(
                    "soak: sequence {} position {p} differs from the sequential run",
                    t.id
                );
                self.c.mismatches.fetch_add(1, Ordering::Relaxed);
            }
            self.c.rows_checked.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// An operation failed: fine if a fault was injected meanwhile (the
    /// sequence is then lost and checked), otherwise an error to report.
    fn failed(&self, t: Track, faults_before: u64, what: &str, e: &EngineError) {
        let injected = self.flaky.injected.load(Ordering::Relaxed) > faults_before;
        // An injected read fault surfaces as a failed site call (the table
        // read under a forward), or later as the carry it lost.
        if !(injected && (e.is_device_failure() || e.is_lost())) {
            eprintln!("soak: {what} of sequence {} failed: {}", t.id, e.chain());
            self.c.unexplained.fetch_add(1, Ordering::Relaxed);
        }
        self.c.lost.fetch_add(1, Ordering::Relaxed);
        let _ = self.engine.lock().release(t.id);
        self.check(&t);
    }
}

const PREFIXES: [[u32; 6]; 3] = [
    [11, 12, 13, 14, 15, 16],
    [21, 22, 0, 23, 24, 25],
    [31, 32, 33, 34, 35, 36],
];

fn worker(sh: &Shared, seed: u64, deadline: Instant) {
    let mut rng = SplitMix64(seed);
    let mut mine: Vec<Track> = Vec::new();
    let w = sh.width;
    while Instant::now() < deadline {
        sh.c.ops.fetch_add(1, Ordering::Relaxed);
        let faults = sh.flaky.injected.load(Ordering::Relaxed);
        let op = rng.below(100);
        if mine.is_empty() || (op < 12 && mine.len() < 6) {
            // add
            let mut prompt: Vec<u32> = PREFIXES[rng.below(3)].to_vec();
            prompt.truncate(rng.below(7));
            let extra = 1 + rng.below(20);
            prompt.extend((0..extra).map(|_| {
                if rng.pct(8) {
                    0
                } else {
                    1 + rng.below(999) as u32
                }
            }));
            let added = sh.engine.lock().add_sequence(&prompt);
            match added {
                Ok(a) => {
                    sh.c.sequences.fetch_add(1, Ordering::Relaxed);
                    mine.push(Track {
                        id: a.id,
                        prompt_left: prompt[a.cached..].to_vec(),
                        tokens: prompt[..a.cached].to_vec(),
                        outputs: vec![None; a.cached],
                    });
                }
                Err(e) => {
                    eprintln!("soak: add failed: {}", e.chain());
                    sh.c.unexplained.fetch_add(1, Ordering::Relaxed);
                }
            }
            continue;
        }
        let k = rng.below(mine.len());
        if !mine[k].prompt_left.is_empty() {
            // prefill a random chunk of the rest of the prompt
            let t = &mut mine[k];
            let n = 1 + rng.below(t.prompt_left.len());
            let chunk: Vec<u32> = t.prompt_left[..n].to_vec();
            let mut all = t.tokens.clone();
            all.extend_from_slice(&chunk);
            let mut hw = rows(&all, t.tokens.len(), all.len(), w);
            let r = sh.engine.lock().prefill(t.id, &chunk, &mut hw);
            match r {
                Ok(()) => {
                    t.outputs.extend(hw.chunks(w).map(|r| Some(r.to_vec())));
                    t.tokens = all;
                    t.prompt_left.drain(..n);
                }
                Err(e) => {
                    let t = mine.swap_remove(k);
                    sh.failed(t, faults, "prefill", &e);
                }
            }
            continue;
        }
        match op {
            12..=44 => {
                // batched decode over the ready sequences
                let ready: Vec<usize> = (0..mine.len())
                    .filter(|&i| mine[i].prompt_left.is_empty())
                    .collect();
                let next: Vec<u32> = ready.iter().map(|_| 1 + rng.below(999) as u32).collect();
                let mut hw = Vec::new();
                for (&i, &tok) in ready.iter().zip(&next) {
                    let mut all = mine[i].tokens.clone();
                    all.push(tok);
                    hw.extend(rows(&all, all.len() - 1, all.len(), w));
                }
                let batch: Vec<(SeqId, u32)> = ready
                    .iter()
                    .zip(&next)
                    .map(|(&i, &t)| (mine[i].id, t))
                    .collect();
                let r = sh.engine.lock().decode(&batch, &mut hw);
                match r {
                    Ok(()) => {
                        for ((&i, &tok), row) in ready.iter().zip(&next).zip(hw.chunks(w)) {
                            mine[i].tokens.push(tok);
                            mine[i].outputs.push(Some(row.to_vec()));
                        }
                    }
                    Err(e) => {
                        let mut gone: Vec<usize> = ready.clone();
                        gone.sort_unstable_by(|a, b| b.cmp(a));
                        for i in gone {
                            let t = mine.swap_remove(i);
                            sh.failed(t, faults, "decode", &e);
                        }
                    }
                }
            }
            45..=59 => {
                // speculative verify, then commit a random acceptance length
                let t = &mut mine[k];
                let n = 1 + rng.below(4);
                let draft: Vec<u32> = (0..n).map(|_| 1 + rng.below(999) as u32).collect();
                let mut all = t.tokens.clone();
                all.extend_from_slice(&draft);
                let mut hw = rows(&all, t.tokens.len(), all.len(), w);
                let accepted = rng.below(n + 1);
                let r = {
                    let mut e = sh.engine.lock();
                    e.verify(t.id, &draft, &mut hw)
                        .and_then(|()| e.commit(t.id, accepted))
                };
                match r {
                    Ok(()) => {
                        t.tokens.extend_from_slice(&draft[..accepted]);
                        t.outputs
                            .extend(hw.chunks(w).take(accepted).map(|r| Some(r.to_vec())));
                    }
                    Err(e) => {
                        let t = mine.swap_remove(k);
                        sh.failed(t, faults, "verify/commit", &e);
                    }
                }
            }
            60..=69 => {
                // snapshot, restore into a new sequence, release the old one
                let t = &mut mine[k];
                let r = {
                    let mut e = sh.engine.lock();
                    e.snapshot(t.id).and_then(|b| {
                        let id = e.add_from_snapshot(&b, &t.tokens)?;
                        e.release(t.id)?;
                        Ok(id)
                    })
                };
                match r {
                    Ok(id) => {
                        // The restored sequence continues the same outputs.
                        t.id = id;
                        sh.c.sequences.fetch_add(1, Ordering::Relaxed);
                    }
                    Err(EngineError::NoTokens(_)) if t.tokens.is_empty() => {}
                    Err(e) => {
                        let t = mine.swap_remove(k);
                        sh.failed(t, faults, "snapshot/restore", &e);
                    }
                }
            }
            70..=81 => {
                // swap out; the next use swaps it back in
                let target = if rng.pct(30) {
                    SwapTarget::File
                } else {
                    SwapTarget::Host
                };
                let r = sh.engine.lock().swap_out(mine[k].id, target);
                match r {
                    Ok(())
                    | Err(EngineError::WrongPlace {
                        place: Place::Swapped,
                        ..
                    }) => {}
                    Err(e) => {
                        let t = mine.swap_remove(k);
                        sh.failed(t, faults, "swap_out", &e);
                    }
                }
            }
            _ => {
                // release and check
                let t = mine.swap_remove(k);
                let r = sh.engine.lock().release(t.id);
                if let Err(e) = r {
                    eprintln!("soak: release of sequence {} failed: {}", t.id, e.chain());
                    sh.c.unexplained.fetch_add(1, Ordering::Relaxed);
                }
                sh.check(&t);
            }
        }
    }
    for t in mine {
        let r = sh.engine.lock().release(t.id);
        if let Err(e) = r {
            eprintln!("soak: release of sequence {} failed: {}", t.id, e.chain());
            sh.c.unexplained.fetch_add(1, Ordering::Relaxed);
        }
        sh.check(&t);
    }
}

/// Run `metrale-ple soak`.
pub fn run(a: &SoakArgs) -> Result<(), CmdError> {
    if !(a.minutes > 0.0 && a.minutes.is_finite()) {
        return Err(input(anyhow::anyhow!(
            "--minutes must be a positive number, got {}",
            a.minutes
        )));
    }
    if a.threads == 0 || a.threads > 256 {
        return Err(input(anyhow::anyhow!(
            "--threads must be in 1..=256, got {}",
            a.threads
        )));
    }
    if a.fault_percent > 50 {
        return Err(input(anyhow::anyhow!(
            "--fault-percent must be at most 50, got {}",
            a.fault_percent
        )));
    }
    let ck_dir = checkpoint_dir(&None)?;
    soak(a, &ck_dir).map_err(failure)
}

fn soak(a: &SoakArgs, ck_dir: &std::path::Path) -> Result<()> {
    let dir: PathBuf = std::env::temp_dir().join(format!("metrale-soak-{}", std::process::id()));
    std::fs::create_dir_all(dir.join("swap"))
        .with_context(|| format!("creating {}", dir.display()))?;
    let gpu: Arc<dyn GpuBackend> = Arc::new(CpuBackend::new());
    let base = gpu.live_alloc_count();
    let flaky = Arc::new(FlakyReader::new(
        default_reader(8)?,
        a.fault_percent as f64,
        a.seed,
    ));
    let cfg = EngineConfig {
        prefill_chunk: 8,
        block_size: 4,
        prefix_cache_bytes: 1 << 20,
        device_budget_bytes: usize::MAX,
        preempt_to: SwapTarget::Host,
        swap_dir: Some(dir.join("swap")),
    };
    let ck = Checkpoint::open(ck_dir)?;
    let mut engine = build(&ck, &gpu, Some(flaky.clone()), cfg, 48, a.resident_carries)?;
    if !a.eager {
        engine.enable_decode_graphs()?;
    }
    let reference = build(
        &ck,
        &gpu,
        None,
        EngineConfig {
            prefill_chunk: MAX_TOKENS,
            prefix_cache_bytes: 0,
            ..Default::default()
        },
        256,
        0,
    )?;
    let width = engine.width();
    let sh = Shared {
        engine: Mutex::new(engine),
        reference: Mutex::new(reference),
        flaky: flaky.clone(),
        c: Counters::default(),
        width,
    };
    let start = Instant::now();
    let deadline = start + Duration::from_secs_f64(a.minutes * 60.0);
    std::thread::scope(|s| {
        for t in 0..a.threads {
            let sh = &sh;
            let seed = a.seed.wrapping_mul(1000).wrapping_add(t as u64);
            s.spawn(move || worker(sh, seed, deadline));
        }
    });
    let elapsed = start.elapsed();
    let Shared {
        engine,
        reference,
        c,
        ..
    } = sh;
    let stats = engine.lock().stats();
    engine.into_inner().close().context("closing the engine")?;
    reference
        .into_inner()
        .close()
        .context("closing the reference engine")?;
    let leaked = gpu.live_alloc_count() - base.min(gpu.live_alloc_count());
    let _ = std::fs::remove_dir_all(&dir);
    let g = |x: &AtomicU64| x.load(Ordering::Relaxed);
    println!(
        "soak: {:.1} minutes on {} threads (seed {})",
        elapsed.as_secs_f64() / 60.0,
        a.threads,
        a.seed
    );
    println!("  operations        {}", g(&c.ops));
    println!("  sequences         {}", g(&c.sequences));
    println!("  faults injected   {}", g(&flaky.injected));
    println!("  sequences lost    {}", g(&c.lost));
    println!("  rows checked      {}", g(&c.rows_checked));
    println!("  mismatches        {}", g(&c.mismatches));
    println!("  unexplained errors {}", g(&c.unexplained));
    println!("  leaked allocations {leaked}");
    println!("  engine stats      {stats:?}");
    if g(&c.mismatches) > 0 || g(&c.unexplained) > 0 || leaked > 0 {
        if leaked > 0 {
            eprintln!("{}", gpu.live_report());
        }
        anyhow::bail!("soak failed");
    }
    Ok(())
}
