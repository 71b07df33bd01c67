//! `metrale-ple bench`: the project's key benchmarks run in this process,
//! printed as one table where every figure sits beside a baseline measured
//! in the same run, and the ratio of the two.
//!
//! Built only with the crate's `bench` feature. The workloads are
//! `metrale-bench`'s (the ones its `cargo bench` harnesses run); this
//! command only picks their sizes, times them and prints the table. The model geometry is a checkpoint preset's (flagship;
//! tiny for the hidden `--smoke` sizes):
//!
//! - ids ([`metrale_bench::layer`]): the hot-path hasher at the
//!   preset's first site against the plain `%` form, for a prefill run and
//!   for a batched decode step against per-sequence plain hashing;
//! - storage ([`metrale_bench::table`]): random row gather from a
//!   resident table (rows of the preset's `head_dim`) against a `memcpy` of
//!   the same bytes; the cached table's hit path against a `HashMap`
//!   lookup; random 4 KiB reads through the miss path's reader (io_uring at
//!   the row cache's depth, O_DIRECT where the file system allows it)
//!   against a plain `pread` loop on the same descriptor, one read at a
//!   time;
//! - layer ([`metrale_bench::layer`]): one PLE layer's forward on the
//!   CPU backend (a prefill chunk and a batched decode step) against a
//!   naive scalar projection of one token on one thread; the layer is built
//!   from a synthetic checkpoint of the preset (table cut to a bench size,
//!   resident);
//! - engine ([`metrale_bench::engine`]): over engines built from the same
//!   checkpoint, restoring a cached prefix against recomputing it, and
//!   swapping a carry out and in against a `memcpy` of the same bytes;
//! - runtime ([`metrale_bench::runtime`]): `copy_d2d_async` bandwidth
//!   against `memcpy`.
//!
//! Invariants: every value and baseline is the median of several
//! repetitions timed with [`Instant`], and where a figure and its baseline
//! are repeated they alternate, so slow drift of a shared machine hits both
//! alike. The ratio is always "times faster than the baseline" (below 1:
//! slower), whatever the unit: value / baseline for rates, baseline / value
//! for times. Results that must agree (fast and plain ids, restored prefix
//! length, cache hits) are checked by the workloads and a mismatch is an
//! error. Scratch files (table shards, the checkpoint) live in one fresh
//! directory that is removed at the end, also on failure. The table goes
//! to stdout; progress and diagnostics to stderr.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use clap::{Args, Subcommand};
use metrale_bench::engine::{PrefixRestore, SwapCarry};
use metrale_bench::layer::{IdsDecode, IdsPrefill, LayerForward, LayerSizes, token_bound};
use metrale_bench::runtime::CopyD2d;
use metrale_bench::table::{CacheHits, HitSizes, RandomReads, ResidentGather, write_table};
use metrale_checkpoint::runtime::TableMode;
use metrale_checkpoint::synth::write_synthetic;
use metrale_checkpoint::{Checkpoint, InitOptions, Preset};
use metrale_engine::{Engine, EngineConfig, Site};
use metrale_gpu_runtime::cpu::CpuBackend;
use metrale_gpu_runtime::gpu::GpuBackend;
use metrale_model_layers::layers::ple::ModelSpec;

use super::common::{Device, bytes, open_backend};
use super::init::PresetArg;
use super::run::{EngineSetup, build_engine};
use super::{CmdError, failure, input};
use metrale_bench::report::{Row, print_rows};
use metrale_bench::stats::{Step, infallible, interleaved, median, nothing, secs};

mod offload;
mod remote;
mod stream;

/// Arguments of `metrale-ple bench`.
#[derive(Args, Debug)]
#[command(after_help = "Example:\n  metrale-ple bench --quick")]
pub struct BenchArgs {
    /// A benchmark of its own instead of the table.
    #[command(subcommand)]
    command: Option<BenchCommand>,
    /// A short run (well under a minute): fewer repetitions, a 42 MB table
    /// file, a small layer table. The full run takes a few minutes.
    #[arg(long)]
    quick: bool,
    /// Print the table as a JSON array of objects (area, figure, value,
    /// unit, baseline, baseline_value, ratio).
    #[arg(long)]
    json: bool,
    /// Where to write scratch files (a fresh subdirectory, removed at the
    /// end); default the system temp dir.
    #[arg(long, value_name = "DIR")]
    dir: Option<PathBuf>,
    /// Every size shrunk to a few milliseconds of work: checks that each
    /// figure is produced, measures nothing worth reading.
    #[arg(long, hide = true)]
    smoke: bool,
    /// The backend of the layer and engine figures: cpu, or cuda[:N]
    /// (needs the `cuda` feature and a device). The id, storage and
    /// runtime figures measure host work and run on the CPU backend.
    #[arg(long, default_value = "cpu", value_name = "cpu|cuda[:N]")]
    device: Device,
    /// The geometry and hash family of every workload: flagship (the
    /// default), or a family preset (engram-demo, deepseek-v4.1,
    /// longcat-flash-lite) for its hash and layer figures.
    #[arg(long, value_enum, value_name = "PRESET")]
    preset: Option<PresetArg>,
    /// Only these sections, comma-separated (ids, storage, layer, engine,
    /// runtime); default all.
    #[arg(long, value_delimiter = ',', value_name = "SECTION")]
    only: Vec<SectionArg>,
}

/// A section of the table.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
enum SectionArg {
    /// The hash: prefill and batched decode ids.
    Ids,
    /// Resident gather, the cached table's hits and the miss path's reads.
    Storage,
    /// One layer's forward, prefill and batched decode.
    Layer,
    /// Prefix restore and carry swap.
    Engine,
    /// The runtime's device copy.
    Runtime,
}

/// The benchmarks `bench` runs apart from its table.
#[derive(Subcommand, Debug)]
enum BenchCommand {
    /// Decode throughput with the flagship table resident, mapped and
    /// behind the row cache, prefetch off and on, warmed to a steady hit
    /// rate, beside the disk's random-read ceiling.
    Offload(offload::OffloadArgs),
}

/// Every size and repetition count of one run.
#[derive(Clone, Copy, Debug)]
struct Sizes {
    name: &'static str,
    /// The geometry of every workload.
    model: Preset,
    ids_tokens: usize,
    ids_batch: usize,
    ids_reps: usize,
    shards: usize,
    rows_per_shard: u64,
    gather_rows: usize,
    gather_reps: usize,
    hit: HitSizes,
    miss_window: Duration,
    miss_reps: usize,
    miss_batch: usize,
    /// Table rows stored in the layer and engine checkpoint.
    table_rows: u64,
    prefill_tokens: usize,
    prefill_reps: usize,
    decode_batch: usize,
    decode_steps: usize,
    naive_reps: usize,
    prefix: usize,
    block: usize,
    recompute_reps: usize,
    restore_reps: usize,
    swap_reps: usize,
    copy_bytes: usize,
    copy_reps: usize,
}

const FULL: Sizes = Sizes {
    name: "full",
    model: Preset::Flagship,
    ids_tokens: 4096,
    ids_batch: 1024,
    ids_reps: 2000,
    shards: 4,
    rows_per_shard: 131_072,
    gather_rows: 65_536,
    gather_reps: 25,
    hit: HitSizes {
        slots: 16_384,
        hot: 8192,
        batch: 256,
        batches_per_round: 100,
        rounds: 40,
    },
    miss_window: Duration::from_millis(1500),
    miss_reps: 3,
    miss_batch: 4096,
    // 2^20 rows (320 MiB): far beyond any cache, as the real table is.
    table_rows: 1 << 20,
    prefill_tokens: 512,
    prefill_reps: 7,
    decode_batch: 32,
    decode_steps: 40,
    naive_reps: 5,
    prefix: 512,
    block: 64,
    recompute_reps: 5,
    restore_reps: 50,
    swap_reps: 100,
    copy_bytes: 64 << 20,
    copy_reps: 15,
};

const QUICK: Sizes = Sizes {
    name: "quick",
    ids_reps: 1000,
    rows_per_shard: 32_768,
    gather_rows: 32_768,
    hit: HitSizes {
        rounds: 10,
        ..FULL.hit
    },
    miss_window: Duration::from_millis(300),
    miss_batch: 1024,
    // 131,072 rows (40 MiB).
    table_rows: 1 << 17,
    prefill_reps: 5,
    decode_steps: 20,
    naive_reps: 3,
    recompute_reps: 3,
    restore_reps: 20,
    swap_reps: 50,
    copy_reps: 11,
    ..FULL
};

const SMOKE: Sizes = Sizes {
    name: "smoke",
    model: Preset::Tiny,
    ids_tokens: 256,
    ids_batch: 64,
    ids_reps: 5,
    shards: 2,
    rows_per_shard: 2048,
    gather_rows: 1024,
    gather_reps: 3,
    hit: HitSizes {
        slots: 512,
        hot: 256,
        batch: 64,
        batches_per_round: 4,
        rounds: 3,
    },
    miss_window: Duration::from_millis(20),
    miss_reps: 2,
    miss_batch: 32,
    table_rows: 4096,
    prefill_tokens: 32,
    prefill_reps: 2,
    decode_batch: 4,
    decode_steps: 2,
    naive_reps: 2,
    prefix: 64,
    block: 16,
    recompute_reps: 2,
    restore_reps: 3,
    swap_reps: 3,
    copy_bytes: 1 << 20,
    copy_reps: 3,
};

/// Removes a scratch directory when dropped, so a failed run leaves
/// nothing behind either; `who` names the command in the warning when it
/// cannot.
struct Scratch {
    dir: PathBuf,
    who: &'static str,
}

impl Scratch {
    fn new(who: &'static str, dir: PathBuf) -> Scratch {
        Scratch { dir, who }
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        if let Err(e) = std::fs::remove_dir_all(&self.dir) {
            eprintln!(
                "{}: could not remove scratch directory {}: {e}",
                self.who,
                self.dir.display()
            );
        }
    }
}

/// Run `metrale-ple bench`.
pub fn run(args: &BenchArgs) -> Result<(), CmdError> {
    if let Some(BenchCommand::Offload(a)) = &args.command {
        return offload::run(a);
    }
    let mut sizes = if args.smoke {
        SMOKE
    } else if args.quick {
        QUICK
    } else {
        FULL
    };
    if let Some(p) = args.preset {
        sizes.model = p.preset();
    }
    let parent = args.dir.clone().unwrap_or_else(std::env::temp_dir);
    if !parent.is_dir() {
        return Err(input(anyhow::anyhow!(
            "--dir {}: not a directory",
            parent.display()
        )));
    }
    let path = parent.join(format!("metrale-ple-bench-{}", std::process::id()));
    std::fs::create_dir(&path)
        .with_context(|| format!("creating scratch directory {}", path.display()))
        .map_err(input)?;
    let scratch = Scratch::new("bench", path);
    let t0 = Instant::now();
    eprintln!(
        "bench: {} run on {} CPU threads, {} geometry; scratch files under {}",
        sizes.name,
        std::thread::available_parallelism().map_or(1, |n| n.get()),
        sizes.model.name(),
        scratch.dir.display()
    );
    if args.device != Device::Cpu {
        eprintln!(
            "bench: layer and engine figures on {}; ids, storage and runtime on the CPU backend",
            args.device
        );
    }
    drop(open_backend(args.device)?);
    let mut ctx = Ctx {
        sizes,
        device: args.device,
        spec: sizes.model.spec(),
        dir: scratch.dir.clone(),
        checkpoint: None,
    };
    let rows = bench_all(&mut ctx, &args.only).map_err(failure)?;
    drop(ctx);
    drop(scratch);
    eprintln!("bench: done in {:.1} s", t0.elapsed().as_secs_f64());
    print_rows(&rows, args.json).map_err(failure)
}

/// What every section sees: the sizes, the preset's spec, the scratch
/// directory, and the synthetic checkpoint once written.
struct Ctx {
    sizes: Sizes,
    /// The backend of the layer and engine sections.
    device: Device,
    spec: ModelSpec,
    dir: PathBuf,
    checkpoint: Option<Checkpoint>,
}

impl Ctx {
    /// A fresh backend of `--device` for a section.
    fn backend(&self) -> Result<Arc<dyn GpuBackend>> {
        open_backend(self.device).map_err(|e| anyhow::anyhow!("{e}"))
    }

    /// The synthetic checkpoint of the preset with `table_rows` rows per
    /// site, written on first use.
    fn checkpoint(&mut self) -> Result<&Checkpoint> {
        if self.checkpoint.is_none() {
            let t0 = Instant::now();
            let dir = self.dir.join("model");
            let opts = InitOptions {
                preset: self.sizes.model,
                table_rows: Some(self.sizes.table_rows),
                dtype: self.sizes.model.default_dtype(),
                seed: 1,
            };
            write_synthetic(&dir, &opts, &mut |_, _| {})?;
            let ck = Checkpoint::open(&dir)?;
            eprintln!(
                "bench:   {} checkpoint, {} table rows per site, written and checked in {:.1} s",
                self.sizes.model.name(),
                ck.sites[0].table.stored_rows,
                t0.elapsed().as_secs_f64()
            );
            self.checkpoint = Some(ck);
        }
        self.checkpoint.as_ref().context("the bench checkpoint")
    }
}

/// "qwen4exp, H 2560, hc 4, 16x160 heads".
fn describe(g: &ModelSpec) -> String {
    format!(
        "{}, H {}, hc {}, {}x{} heads",
        g.family.name(),
        g.hidden_size,
        g.hc_mult,
        g.ngram_heads(),
        g.head_dim
    )
}

/// One area's benchmarks.
type Section = fn(&mut Ctx) -> Result<Vec<Row>>;

fn bench_all(ctx: &mut Ctx, only: &[SectionArg]) -> Result<Vec<Row>> {
    let mut rows = Vec::new();
    let sections: [(SectionArg, &str, Section); 5] = [
        (SectionArg::Ids, "ids", bench_ids),
        (SectionArg::Storage, "storage", bench_storage),
        (SectionArg::Layer, "layer", bench_layer),
        (SectionArg::Engine, "engine", bench_engine),
        (SectionArg::Runtime, "runtime", bench_runtime),
    ];
    for (which, name, f) in sections {
        if !only.is_empty() && !only.contains(&which) {
            continue;
        }
        let t0 = Instant::now();
        eprintln!("bench: {name} ...");
        rows.extend(f(ctx).with_context(|| format!("{name} benchmark"))?);
        eprintln!("bench: {name} done in {:.1} s", t0.elapsed().as_secs_f64());
    }
    Ok(rows)
}

// ---------------------------------------------------------------- ids

fn bench_ids(ctx: &mut Ctx) -> Result<Vec<Row>> {
    let s = &ctx.sizes;
    let rate = |n: usize, d: Duration| n as f64 / secs(d) / 1e6;
    let mut p = IdsPrefill::new(&ctx.spec, 0, s.ids_tokens)?;
    let times = interleaved(
        s.ids_reps,
        &mut p,
        &nothing,
        &[&|p| Ok(p.run()?), &|p| Ok(p.baseline()?)],
    )?;
    p.check()?;
    let (t, heads) = (p.tokens(), p.heads());
    let mut rows = vec![Row::rate(
        "ids",
        format!("prefill hash, {t} tokens, {heads} heads ({})", p.path()),
        rate(t, times[0]),
        "M tok/s",
        "plain %",
        rate(t, times[1]),
    )];

    // Batched decode: one token per sequence, each with its own history.
    let mut d = IdsDecode::new(&ctx.spec, 0, s.ids_batch.min(s.ids_tokens / 2))?;
    let times = interleaved(
        s.ids_reps,
        &mut d,
        &nothing,
        &[&|d| Ok(d.run()?), &|d| Ok(d.baseline()?)],
    )?;
    d.check()?;
    let b = d.batch();
    rows.push(Row::rate(
        "ids",
        format!("batched decode hash, {b} sequences ({})", d.path()),
        rate(b, times[0]),
        "M tok/s",
        "plain % per sequence",
        rate(b, times[1]),
    ));
    Ok(rows)
}

// ------------------------------------------------------------ storage

fn bench_storage(ctx: &mut Ctx) -> Result<Vec<Row>> {
    let s = &ctx.sizes;
    let t0 = Instant::now();
    let files = write_table(&ctx.dir, s.shards, s.rows_per_shard, ctx.spec.head_dim, 7)?;
    let rb = files.info.row_bytes();
    eprintln!(
        "bench:   table of {} rows x {rb} B ({}) in {} shards written in {:.1} s",
        files.info.rows,
        bytes(files.info.rows * rb as u64),
        s.shards,
        t0.elapsed().as_secs_f64()
    );
    let gpu: Arc<dyn GpuBackend> = Arc::new(CpuBackend::new());

    // Gather of freshly resolved random rows, alternating with its memcpy.
    let mut w = ResidentGather::new(&files, gpu.clone(), s.gather_rows, 1)?;
    let times = interleaved(
        s.gather_reps,
        &mut w,
        &|w| w.prepare(),
        &[&|w| w.run(), &infallible(ResidentGather::baseline)],
    )?;
    w.check()?;
    let (n, gb) = (w.rows(), w.bytes() as f64 / 1e9);
    w.close()?;
    let mut rows = vec![Row::rate(
        "storage",
        format!("resident gather, {n} random {rb} B rows"),
        gb / secs(times[0]),
        "GB/s",
        "memcpy of the same bytes",
        gb / secs(times[1]),
    )];

    // Hit path, alternating rounds with the HashMap.
    let mut w = CacheHits::new(&files, gpu.clone(), &s.hit, 2)?;
    let times = interleaved(
        s.hit.rounds,
        &mut w,
        &nothing,
        &[&|w| w.run(), &infallible(CacheHits::baseline)],
    )?;
    w.check()?;
    let ns = |d: Duration| secs(d) * 1e9 / w.ids_per_round() as f64;
    rows.push(Row::cost(
        "storage",
        format!("cached-table hit path, batches of {}", w.batch()),
        ns(times[0]),
        "ns/id",
        "std HashMap lookup",
        ns(times[1]),
    ));
    drop(w);

    rows.push(misses(s, &files.shards[0].path)?);
    Ok(rows)
}

/// Thousands of reads per second of `f` called for one window.
fn reads_in_window(window: Duration, mut f: impl FnMut() -> Result<u64>) -> Result<f64> {
    let t0 = Instant::now();
    let mut reads = 0u64;
    while t0.elapsed() < window {
        reads += f()?;
    }
    Ok(reads as f64 / secs(t0.elapsed()) / 1e3)
}

fn misses(s: &Sizes, path: &Path) -> Result<Row> {
    let mut w = RandomReads::new(path, s.miss_batch, 3)?;
    // Batches to the reader (it keeps 32 in flight) and single reads for the
    // baseline, alternating windows of equal length.
    let (mut ours, mut base) = (Vec::new(), Vec::new());
    for _ in 0..s.miss_reps.max(1) {
        ours.push(reads_in_window(s.miss_window, || w.run())?);
        base.push(reads_in_window(s.miss_window, || w.baseline())?);
    }
    let mode = if w.direct() {
        "O_DIRECT"
    } else {
        "buffered: O_DIRECT refused"
    };
    Ok(Row::rate(
        "storage",
        format!(
            "miss path: random 4 KiB reads, {} QD{} ({mode})",
            w.reader_name(),
            metrale_storage::cached::DEFAULT_IO_DEPTH
        ),
        median(ours),
        "k reads/s",
        "pread loop QD1, same file",
        median(base),
    ))
}

// -------------------------------------------------------------- layer

fn bench_layer(ctx: &mut Ctx) -> Result<Vec<Row>> {
    let s = ctx.sizes;
    let gpu = ctx.backend()?;
    let ck = ctx.checkpoint()?;
    let t0 = Instant::now();
    let table = ck.open_table(0, TableMode::Resident, gpu.clone())?;
    let max_tokens = s.prefill_tokens.max(s.decode_batch);
    let layer = ck.build_layer(0, table, max_tokens, gpu.as_ref())?;
    let site = &ck.sites[0];
    eprintln!(
        "bench:   layer {}, table {} rows ({}), built in {:.1} s",
        describe(&ck.spec),
        site.table.stored_rows,
        bytes(site.table.bytes),
        t0.elapsed().as_secs_f64()
    );
    let sizes = LayerSizes {
        prefill_tokens: s.prefill_tokens,
        decode_batch: s.decode_batch,
        vocab: token_bound(&ck.spec, 0)?,
    };
    let w = LayerForward::new(layer, &site.weights, gpu.as_ref(), sizes, 0x5EED)?;
    layer_rows(&s, &ck.spec, w)
}

fn layer_rows(s: &Sizes, g: &ModelSpec, mut w: LayerForward<'_>) -> Result<Vec<Row>> {
    let (t, b) = (s.prefill_tokens, s.decode_batch);
    // Baseline: a naive scalar projection, one token per repetition.
    let naive = interleaved(
        s.naive_reps,
        &mut w,
        &nothing,
        &[&infallible(LayerForward::naive)],
    )?[0];
    let prefill = interleaved(s.prefill_reps, &mut w, &nothing, &[&|w| Ok(w.prefill()?)])?[0];
    let decode = interleaved(s.decode_steps, &mut w, &nothing, &[&|w| Ok(w.decode()?)])?[0];
    w.close()?;
    let (naive, what) = (1.0 / secs(naive), "naive scalar projection alone, 1 thread");
    Ok(vec![
        Row::rate(
            "layer",
            format!("forward prefill, {t}-token chunk ({})", describe(g)),
            t as f64 / secs(prefill),
            "tok/s",
            what,
            naive,
        ),
        Row::rate(
            "layer",
            format!("forward batched decode, {b} sequences"),
            b as f64 / secs(decode),
            "tok/s",
            what,
            naive,
        ),
    ])
}

// ------------------------------------------------------------- engine

fn bench_engine(ctx: &mut Ctx) -> Result<Vec<Row>> {
    let s = ctx.sizes;
    let gpu = ctx.backend()?;
    let ck = ctx.checkpoint()?;
    let prefix = (s.prefix / s.block).max(1) * s.block;
    let setup = |prefix_cache_bytes| EngineSetup {
        mode: TableMode::Resident,
        slots: 0,
        faults: None,
        engine: EngineConfig {
            prefill_chunk: prefix,
            block_size: s.block,
            prefix_cache_bytes,
            ..Default::default()
        },
        resident_carries: 0,
    };
    let t0 = Instant::now();
    let mut cached = build_engine(ck, &gpu, &setup(64 << 20), prefix)?;
    // The same model without a prefix cache: the recompute path.
    let mut plain = match build_engine(ck, &gpu, &setup(0), prefix) {
        Ok(e) => e,
        Err(e) => {
            let _ = cached.close();
            return Err(e);
        }
    };
    eprintln!(
        "bench:   engines ({}) built in {:.1} s",
        describe(&ck.spec),
        t0.elapsed().as_secs_f64()
    );
    let r = engine_rows(&s, prefix, &mut cached, &mut plain);
    let closed = cached.close().and(plain.close());
    let rows = r?;
    closed?;
    Ok(rows)
}

fn engine_rows<S: Site>(
    s: &Sizes,
    prefix: usize,
    cached: &mut Engine<S>,
    plain: &mut Engine<S>,
) -> Result<Vec<Row>> {
    let ms = |d: Duration| secs(d) * 1e3;
    let us = |d: Duration| secs(d) * 1e6;

    // Prefix restore vs recompute; every step releases what the last added.
    let mut w = PrefixRestore::new(cached, plain, prefix, s.block)?;
    let prepare: Step<'_, PrefixRestore<'_, S>> = &|w| {
        w.release()?;
        w.prepare_baseline()
    };
    let recompute = interleaved(s.recompute_reps, &mut w, prepare, &[&|w| w.baseline()])?[0];
    w.release()?;
    let restore = interleaved(s.restore_reps, &mut w, &|w| w.release(), &[&|w| w.run()])?[0];
    w.release()?;
    let prefix = w.prefix();
    drop(w);
    let mut rows = vec![Row::cost(
        "engine",
        format!("prefix-cache restore of a {prefix}-token prefix"),
        ms(restore),
        "ms",
        &format!("recompute (prefill, chunks of {prefix})"),
        ms(recompute),
    )];

    // Swap-out / swap-in vs memcpy.
    let mut w = SwapCarry::new(cached, s.block + 1)?;
    let times = interleaved(
        s.swap_reps,
        &mut w,
        &nothing,
        &[
            &|w| w.swap_out(),
            &|w| w.swap_in(),
            &infallible(SwapCarry::baseline),
        ],
    )?;
    let carry = w.carry_bytes();
    w.close()?;
    for (what, t) in [("swap-out", times[0]), ("swap-in", times[1])] {
        rows.push(Row::cost(
            "engine",
            format!("{what} of a {carry}-byte carry (host)"),
            us(t),
            "us",
            "memcpy of the same bytes",
            us(times[2]),
        ));
    }
    Ok(rows)
}

// ------------------------------------------------------------ runtime

fn bench_runtime(ctx: &mut Ctx) -> Result<Vec<Row>> {
    let cpu = CpuBackend::new();
    let mut w = CopyD2d::new(&cpu, ctx.sizes.copy_bytes)?;
    let times = interleaved(
        ctx.sizes.copy_reps,
        &mut w,
        &nothing,
        &[&|w| Ok(w.run()?), &infallible(CopyD2d::baseline)],
    )?;
    let n = w.bytes();
    w.close()?;
    let gbs = |d: Duration| n as f64 / secs(d) / 1e9;
    Ok(vec![Row::rate(
        "runtime",
        format!("copy_d2d_async {} + synchronize", bytes(n as u64)),
        gbs(times[0]),
        "GB/s",
        "memcpy (copy_from_slice)",
        gbs(times[1]),
    )])
}
