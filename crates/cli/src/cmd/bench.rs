//! `metrale-ple bench`: the project's key benchmarks run in this process,
//! printed as one table where every figure sits beside a baseline measured
//! in the same run, and the ratio of the two.
//!
//! The figures mirror the crate benchmarks (`cargo bench` in
//! model-layers, storage, engine and gpu-runtime) and use their methods:
//!
//! - ids: the hot-path hasher ([`PleIdHasher`]) at the flagship geometry
//!   (vocab 151,936, 3-grams, 8 heads per order, so 16 heads, base
//!   20,000,000) against the plain `%` form, for a prefill run and for a
//!   batched decode step against per-sequence plain hashing;
//! - storage: random 320 B row gather from a [`ResidentTable`] against a
//!   `memcpy` of the same bytes; the cached table's hit path against a
//!   `HashMap` lookup; random 4 KiB reads through the miss path's reader
//!   (io_uring at depth 32, O_DIRECT where the file system allows it)
//!   against a plain `pread` loop on the same descriptor, one read at a time;
//! - layer: one PLE layer's forward on the CPU backend (a prefill chunk and
//!   a batched decode step) against the baseline the `ple_forward` bench
//!   uses, a naive scalar projection of the same tokens on one thread;
//! - engine: restoring a cached prefix against recomputing it, and swapping
//!   a carry out and in against a `memcpy` of the same bytes;
//! - runtime: `copy_d2d_async` bandwidth against `memcpy`.
//!
//! Invariants: nothing is hard-coded; every value and baseline is the
//! median of several repetitions timed with [`Instant`], and where a figure
//! and its baseline are repeated they alternate, so slow drift of a shared
//! machine hits both alike. The ratio is always "times faster than the
//! baseline" (below 1: slower), whatever the unit: value / baseline for
//! rates, baseline / value for times. Results that must agree (fast and
//! plain ids, restored prefix length, cache hits) are checked and a
//! mismatch is an error. Scratch files live in one fresh directory that is
//! removed at the end, also on failure. The table goes to stdout; progress
//! and diagnostics to stderr.

use std::collections::HashMap;
use std::hint::black_box;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, ensure};
use clap::Args;
use metrale_checkpoint::Preset;
use metrale_checkpoint::names::SiteNames;
use metrale_engine::engine::{EngineConfig, SwapTarget};
use metrale_engine::testing::{TinySpec, TinyTable, tiny_engine};
use metrale_gpu_runtime::cpu::CpuBackend;
use metrale_gpu_runtime::gpu::{
    ArgKind, DevicePtr, GpuBackend, HostMemory, KernelArg, LaunchConfig, StreamId,
};
use metrale_model_layers::layers::ple::ids::{
    PleHashParams, PleIdHasher, ple_ngram_ids_into_plain, splitmix64,
};
use metrale_model_layers::layers::ple::kernels::math::bf16_to_f32;
use metrale_model_layers::layers::ple::{
    ForwardContext, PleLayer, PleSeqState, PleWeights, SiteSpec,
};
use metrale_storage::cached::{CacheConfig, CachedTable};
use metrale_storage::io::{AlignedBuf, PAGE, ReadReq, ShardFile, default_reader, pread_full};
use metrale_storage::layout::TableFiles;
use metrale_storage::resident::ResidentTable;
use metrale_storage::safetensors::{Dtype, TensorSpec, Writer};
use metrale_storage::table::{RowRef, RowTable};
use serde::Serialize;

use super::common::bytes;
use super::{CmdError, failure, input};

/// Arguments of `metrale-ple bench`.
#[derive(Args, Debug)]
#[command(after_help = "Example:\n  metrale-ple bench --quick")]
pub struct BenchArgs {
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
}

/// The shape of a PLE site (N = 3, kernel 4, dilation 3).
#[derive(Clone, Copy, Debug)]
struct Geometry {
    hidden: usize,
    hc: usize,
    heads_per_ngram: usize,
    head_dim: usize,
}

impl Geometry {
    fn heads(&self) -> usize {
        2 * self.heads_per_ngram
    }
    fn describe(&self) -> String {
        format!(
            "H {}, hc {}, {}x{} heads",
            self.hidden,
            self.hc,
            self.heads(),
            self.head_dim
        )
    }
}

/// SPEC.md section 2.
const FLAGSHIP: Geometry = Geometry {
    hidden: 2560,
    hc: 4,
    heads_per_ngram: 8,
    head_dim: 160,
};

const SMOKE_GEOMETRY: Geometry = Geometry {
    hidden: 64,
    hc: 2,
    heads_per_ngram: 2,
    head_dim: 16,
};

const KERNEL: usize = 4;
const DILATION: usize = 3;
const VOCAB: u64 = 151_936;
const EOS: u32 = 151_645;
/// One flagship table row: 160 BF16 values.
const ROW_BYTES: usize = 320;

/// Every size and repetition count of one run.
#[derive(Clone, Copy, Debug)]
struct Sizes {
    name: &'static str,
    ids_tokens: usize,
    ids_batch: usize,
    ids_reps: usize,
    shards: usize,
    rows_per_shard: u64,
    gather_rows: usize,
    gather_reps: usize,
    hit_slots: usize,
    hit_hot: usize,
    hit_batch: usize,
    hit_batches_per_round: usize,
    hit_rounds: usize,
    miss_window: Duration,
    miss_reps: usize,
    miss_batch: usize,
    layer: Geometry,
    layer_vocab_base: u64,
    prefill_tokens: usize,
    prefill_reps: usize,
    decode_batch: usize,
    decode_steps: usize,
    naive_reps: usize,
    engine: Geometry,
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
    ids_tokens: 4096,
    ids_batch: 1024,
    ids_reps: 2000,
    shards: 4,
    rows_per_shard: 131_072,
    gather_rows: 65_536,
    gather_reps: 25,
    hit_slots: 16_384,
    hit_hot: 8192,
    hit_batch: 256,
    hit_batches_per_round: 100,
    hit_rounds: 40,
    miss_window: Duration::from_millis(1500),
    miss_reps: 3,
    miss_batch: 4096,
    layer: FLAGSHIP,
    // About 1M rows (320 MB): far beyond any cache, as the real table is.
    layer_vocab_base: 62_500,
    prefill_tokens: 512,
    prefill_reps: 7,
    decode_batch: 32,
    decode_steps: 40,
    naive_reps: 5,
    engine: FLAGSHIP,
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
    hit_rounds: 10,
    miss_window: Duration::from_millis(300),
    miss_batch: 1024,
    // About 131k rows (42 MB).
    layer_vocab_base: 8192,
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
    ids_tokens: 256,
    ids_batch: 64,
    ids_reps: 5,
    shards: 2,
    rows_per_shard: 2048,
    gather_rows: 1024,
    gather_reps: 3,
    hit_slots: 512,
    hit_hot: 256,
    hit_batch: 64,
    hit_batches_per_round: 4,
    hit_rounds: 3,
    miss_window: Duration::from_millis(20),
    miss_reps: 2,
    miss_batch: 32,
    layer: SMOKE_GEOMETRY,
    layer_vocab_base: 1000,
    prefill_tokens: 32,
    prefill_reps: 2,
    decode_batch: 4,
    decode_steps: 2,
    naive_reps: 2,
    engine: SMOKE_GEOMETRY,
    prefix: 64,
    block: 16,
    recompute_reps: 2,
    restore_reps: 3,
    swap_reps: 3,
    copy_bytes: 1 << 20,
    copy_reps: 3,
};

/// One line of the table.
#[derive(Serialize, Debug)]
struct Row {
    area: &'static str,
    figure: String,
    value: f64,
    unit: &'static str,
    /// What the baseline is (same unit as the value).
    baseline: String,
    baseline_value: f64,
    /// Times faster than the baseline.
    ratio: f64,
}

impl Row {
    /// A rate (higher is better).
    fn rate(
        area: &'static str,
        figure: String,
        value: f64,
        unit: &'static str,
        baseline: &str,
        base: f64,
    ) -> Row {
        Row {
            area,
            figure,
            value,
            unit,
            baseline: baseline.to_string(),
            baseline_value: base,
            ratio: value / base,
        }
    }

    /// A time or cost (lower is better).
    fn cost(
        area: &'static str,
        figure: String,
        value: f64,
        unit: &'static str,
        baseline: &str,
        base: f64,
    ) -> Row {
        Row {
            ratio: base / value,
            ..Row::rate(area, figure, value, unit, baseline, base)
        }
    }
}

/// Seconds, never zero (a rate over a zero duration would be infinite).
fn secs(d: Duration) -> f64 {
    d.as_secs_f64().max(1e-9)
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn median_dur(mut v: Vec<Duration>) -> Duration {
    v.sort();
    v[v.len() / 2]
}

/// Median times of `reps` interleaved runs of each closure.
fn interleaved(reps: usize, fs: &mut [&mut dyn FnMut() -> Result<()>]) -> Result<Vec<Duration>> {
    let mut times = vec![Vec::with_capacity(reps); fs.len()];
    for _ in 0..reps.max(1) {
        for (f, t) in fs.iter_mut().zip(&mut times) {
            let t0 = Instant::now();
            f()?;
            t.push(t0.elapsed());
        }
    }
    Ok(times.into_iter().map(median_dur).collect())
}

/// A deterministic stream of numbers (splitmix64).
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        splitmix64(self.0.wrapping_sub(0x9E37_79B9_7F4A_7C15))
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }
    /// Uniform in [-a, a).
    fn f(&mut self, a: f32) -> f32 {
        ((self.next() >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0) * a
    }
    /// BF16 bits of a value uniform in [-a, a).
    fn bf16(&mut self, a: f32) -> u16 {
        (self.f(a).to_bits() >> 16) as u16
    }
}

/// Removes the scratch directory when dropped, so a failed run leaves
/// nothing behind either.
struct Scratch(PathBuf);

impl Drop for Scratch {
    fn drop(&mut self) {
        if let Err(e) = std::fs::remove_dir_all(&self.0) {
            eprintln!(
                "bench: could not remove scratch directory {}: {e}",
                self.0.display()
            );
        }
    }
}

/// Run `metrale-ple bench`.
pub fn run(args: &BenchArgs) -> Result<(), CmdError> {
    let sizes = if args.smoke {
        SMOKE
    } else if args.quick {
        QUICK
    } else {
        FULL
    };
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
    let scratch = Scratch(path);
    let t0 = Instant::now();
    eprintln!(
        "bench: {} run on {} CPU threads; scratch files under {}",
        sizes.name,
        std::thread::available_parallelism().map_or(1, |n| n.get()),
        scratch.0.display()
    );
    let rows = bench_all(&sizes, &scratch.0).map_err(failure)?;
    drop(scratch);
    eprintln!("bench: done in {:.1} s", t0.elapsed().as_secs_f64());
    print_rows(&rows, args.json).map_err(failure)
}

/// One area's benchmarks: the sizes and the scratch directory in, rows out.
type Section = fn(&Sizes, &Path) -> Result<Vec<Row>>;

fn bench_all(s: &Sizes, dir: &Path) -> Result<Vec<Row>> {
    let mut rows = Vec::new();
    let sections: [(&str, Section); 5] = [
        ("ids", bench_ids),
        ("storage", bench_storage),
        ("layer", bench_layer),
        ("engine", bench_engine),
        ("runtime", bench_runtime),
    ];
    for (name, f) in sections {
        let t0 = Instant::now();
        eprintln!("bench: {name} ...");
        rows.extend(f(s, dir).with_context(|| format!("{name} benchmark"))?);
        eprintln!("bench: {name} done in {:.1} s", t0.elapsed().as_secs_f64());
    }
    Ok(rows)
}

/// Three significant figures or so, without exponents.
fn num(v: f64) -> String {
    let a = v.abs();
    if a >= 100.0 {
        format!("{v:.1}")
    } else if a >= 10.0 {
        format!("{v:.2}")
    } else if a >= 0.01 {
        format!("{v:.3}")
    } else {
        format!("{v:.3e}")
    }
}

fn print_rows(rows: &[Row], json: bool) -> Result<()> {
    let mut out = std::io::stdout().lock();
    if json {
        serde_json::to_writer_pretty(&mut out, rows)?;
        writeln!(out)?;
        return Ok(out.flush()?);
    }
    let cells: Vec<[String; 5]> = rows
        .iter()
        .map(|r| {
            [
                r.area.to_string(),
                r.figure.clone(),
                format!("{} {}", num(r.value), r.unit),
                format!("{}: {} {}", r.baseline, num(r.baseline_value), r.unit),
                format!("{}x", num(r.ratio)),
            ]
        })
        .collect();
    let head = ["area", "figure", "value", "baseline (same run)", "ratio"];
    let mut w = head.map(str::len);
    for c in &cells {
        for (w, c) in w.iter_mut().zip(c) {
            *w = (*w).max(c.chars().count());
        }
    }
    let line = |out: &mut std::io::StdoutLock<'_>, c: &[&str; 5]| {
        writeln!(
            out,
            "{:<w0$} | {:<w1$} | {:>w2$} | {:<w3$} | {:>w4$}",
            c[0],
            c[1],
            c[2],
            c[3],
            c[4],
            w0 = w[0],
            w1 = w[1],
            w2 = w[2],
            w3 = w[3],
            w4 = w[4]
        )
    };
    line(&mut out, &head)?;
    writeln!(
        out,
        "{}",
        w.iter()
            .map(|&n| "-".repeat(n))
            .collect::<Vec<_>>()
            .join("-+-")
    )?;
    for c in &cells {
        line(&mut out, &c.each_ref().map(String::as_str))?;
    }
    writeln!(
        out,
        "ratio: times faster than the baseline (below 1: slower); medians of repeated runs"
    )?;
    Ok(out.flush()?)
}

// ---------------------------------------------------------------- ids

fn bench_ids(s: &Sizes, _dir: &Path) -> Result<Vec<Row>> {
    // The flagship geometry's first site (SPEC.md section 2).
    let dims = Preset::Flagship.spec().derive(0)?.dims;
    let hasher = PleIdHasher::new(&dims)?;
    let heads = dims.ngram_heads();
    // Random tokens with an EOS about every 500, as in packed text.
    let t = s.ids_tokens;
    let mut x = 42u64;
    let tokens: Vec<u32> = (0..t)
        .map(|_| {
            x = splitmix64(x);
            if x.is_multiple_of(500) {
                EOS
            } else {
                (x % VOCAB) as u32
            }
        })
        .collect();
    let history = [EOS; 2];
    let mut fast = vec![0u64; t * heads];
    let mut plain = vec![0u64; t * heads];
    let times = interleaved(
        s.ids_reps,
        &mut [
            &mut || {
                hasher.ids_with_history_into(black_box(&history), black_box(&tokens), &mut fast)?;
                black_box(&fast);
                Ok(())
            },
            &mut || {
                ple_ngram_ids_into_plain(
                    &dims,
                    black_box(&history),
                    black_box(&tokens),
                    &mut plain,
                )?;
                black_box(&plain);
                Ok(())
            },
        ],
    )?;
    ensure!(fast == plain, "fast and plain ids differ");
    let rate = |n: usize, d: Duration| n as f64 / secs(d) / 1e6;
    let mut rows = vec![Row::rate(
        "ids",
        format!(
            "prefill hash, {t} tokens, {heads} heads ({})",
            hasher.path()
        ),
        rate(t, times[0]),
        "M tok/s",
        "plain %",
        rate(t, times[1]),
    )];

    // Batched decode: one token per sequence, each with its own history.
    let b = s.ids_batch.min(t / 2);
    let flat: Vec<u32> = tokens[..2 * b].to_vec();
    let new_tokens = &tokens[t - b..];
    let mut out = vec![0u64; b * heads];
    let mut reference = vec![0u64; b * heads];
    let times = interleaved(
        s.ids_reps,
        &mut [
            &mut || {
                hasher.decode_batch_flat_into(black_box(&flat), black_box(new_tokens), &mut out)?;
                black_box(&out);
                Ok(())
            },
            &mut || {
                for i in 0..b {
                    ple_ngram_ids_into_plain(
                        &dims,
                        black_box(&flat[2 * i..2 * i + 2]),
                        black_box(&new_tokens[i..i + 1]),
                        &mut reference[i * heads..(i + 1) * heads],
                    )?;
                }
                black_box(&reference);
                Ok(())
            },
        ],
    )?;
    ensure!(out == reference, "batched and per-sequence ids differ");
    rows.push(Row::rate(
        "ids",
        format!("batched decode hash, {b} sequences ({})", hasher.path()),
        rate(b, times[0]),
        "M tok/s",
        "plain % per sequence",
        rate(b, times[1]),
    ));
    Ok(rows)
}

// ------------------------------------------------------------ storage

fn write_table(dir: &Path, s: &Sizes) -> Result<TableFiles> {
    let mut rng = Rng(7);
    let mut list = Vec::new();
    let mut chunk = vec![0u8; 1 << 20];
    for i in 0..s.shards {
        let p = dir.join(format!("bench-{i}.safetensors"));
        let name = SiteNames::new(1).shard_weight(i);
        let spec = TensorSpec::new(
            &name,
            Dtype::BF16,
            &[s.rows_per_shard, (ROW_BYTES / 2) as u64],
        );
        let mut w = Writer::create(&p, &[spec], &Default::default(), 4096)?;
        let mut left = s.rows_per_shard as usize * ROW_BYTES;
        while left > 0 {
            let n = left.min(chunk.len());
            for c in chunk[..n].chunks_mut(8) {
                let v = rng.next().to_le_bytes();
                c.copy_from_slice(&v[..c.len()]);
            }
            w.write(&chunk[..n])?;
            left -= n;
        }
        w.finish()?;
        list.push((p, name));
    }
    Ok(TableFiles::open(&list, None)?)
}

fn bench_storage(s: &Sizes, dir: &Path) -> Result<Vec<Row>> {
    let t0 = Instant::now();
    let files = write_table(dir, s)?;
    let total = files.info.rows as usize * ROW_BYTES;
    eprintln!(
        "bench:   table of {} rows x {ROW_BYTES} B ({}) in {} shards written in {:.1} s",
        files.info.rows,
        bytes(total as u64),
        s.shards,
        t0.elapsed().as_secs_f64()
    );
    let gpu: Arc<dyn GpuBackend> = Arc::new(CpuBackend::new());
    let mut rows = vec![gather(s, &files, &gpu)?];
    rows.push(hits(s, &files, &gpu)?);
    rows.push(misses(s, &files)?);
    Ok(rows)
}

/// Hint the cache lines of one row (up to 6 lines for an unaligned 320 B row).
#[inline(always)]
fn prefetch_row(p: *const u8) {
    #[cfg(target_arch = "x86_64")]
    for k in [0, 64, 128, 192, 256, ROW_BYTES - 1] {
        // SAFETY: prefetch never faults, whatever the address.
        unsafe {
            std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T0 }>(
                p.wrapping_add(k).cast(),
            )
        };
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = p;
}

/// The storage bench's gather kernel: args `refs` (n RowRefs), `n`, `out`
/// (n rows), the table base and its length. Rows are independent random
/// reads, so the next rows' lines are prefetched to overlap DRAM latency.
fn gather_kernel(
    mem: &dyn HostMemory,
    _c: &LaunchConfig,
    a: &[KernelArg],
) -> Result<(), metrale_gpu_runtime::GpuError> {
    use metrale_gpu_runtime::GpuError;
    const DIST: usize = 16;
    let (
        KernelArg::Ptr(refs),
        KernelArg::U32(n),
        KernelArg::Ptr(out),
        KernelArg::Ptr(base),
        KernelArg::U64(len),
    ) = (a[0], a[1], a[2], a[3], a[4])
    else {
        return Err(GpuError::kernel("bench gather: bad arguments"));
    };
    let (n, len) = (n as usize, len as usize);
    let tbl = mem.host_ptr(base, len)?;
    // SAFETY: refs, out and the table are distinct allocations of this
    // bench, nothing else touches them while the kernel runs, and the
    // backend checked both ranges and the alignment.
    let (r, o) = unsafe {
        (
            mem.slice::<u64>(refs, 2 * n)?,
            mem.slice_mut::<u8>(out, n * ROW_BYTES)?,
        )
    };
    for i in 0..n {
        if i + DIST < n {
            let pf = r[2 * (i + DIST)].wrapping_sub(base.addr()) as usize;
            prefetch_row(tbl.wrapping_add(pf));
        }
        let off = r[2 * i].wrapping_sub(base.addr()) as usize;
        if !off.checked_add(ROW_BYTES).is_some_and(|e| e <= len) {
            return Err(GpuError::kernel(format!(
                "bench gather: ref {i} outside the table"
            )));
        }
        // SAFETY: `off + ROW_BYTES <= len` (checked above) and `tbl` spans
        // `len` bytes (checked by host_ptr); the table is only read.
        let src = unsafe { std::slice::from_raw_parts(tbl.add(off), ROW_BYTES) };
        o[i * ROW_BYTES..(i + 1) * ROW_BYTES].copy_from_slice(src);
    }
    Ok(())
}

fn gather(s: &Sizes, files: &TableFiles, gpu: &Arc<dyn GpuBackend>) -> Result<Row> {
    let t = ResidentTable::load(files, gpu.clone())?;
    let rows = files.info.rows;
    let total = rows as usize * ROW_BYTES;
    gpu.register_host_kernel(
        "bench",
        "gather",
        &[
            ArgKind::Ptr,
            ArgKind::U32,
            ArgKind::Ptr,
            ArgKind::Ptr,
            ArgKind::U64,
        ],
        Arc::new(gather_kernel),
    )?;
    let k = gpu.kernel("bench", "gather")?;
    let n = s.gather_rows.min(rows as usize / 2);
    let refs_dev = gpu.alloc(16 * n, "bench refs")?;
    let out_dev = gpu.alloc(n * ROW_BYTES, "bench out")?;
    let stream = gpu.create_stream()?;
    let mut refs = vec![RowRef::default(); n];
    let mut rng = Rng(1);
    // Baseline: memcpy of the same byte count, contiguous, from a buffer as
    // large as the table (so neither side runs from cache), interleaved with
    // the gather so both see the same machine load.
    let src = vec![1u8; total];
    let mut dst = vec![0u8; n * ROW_BYTES];
    let (mut ours, mut base) = (Vec::new(), Vec::new());
    let mut run = || -> Result<()> {
        for rep in 0..s.gather_reps {
            let ids: Vec<u64> = (0..n).map(|_| rng.below(rows)).collect();
            let lease = t.resolve(&ids, &mut refs)?;
            let packed: Vec<u8> = refs
                .iter()
                .flat_map(|r| {
                    r.data
                        .to_le_bytes()
                        .into_iter()
                        .chain(r.scale.to_le_bytes())
                })
                .collect();
            gpu.copy_h2d(&packed, refs_dev)?;
            let t0 = Instant::now();
            gpu.launch(k, LaunchConfig::linear(1, 1))
                .ptr(refs_dev)
                .u32(n as u32)
                .ptr(out_dev)
                .ptr(t.base())
                .u64(total as u64)
                .run(stream)?;
            gpu.synchronize(stream)?;
            ours.push((n * ROW_BYTES) as f64 / secs(t0.elapsed()) / 1e9);
            t.release(lease, gpu.as_ref(), None)?;
            let off = (rep * 7919 * PAGE) % (total - dst.len()).max(1);
            let t0 = Instant::now();
            dst.copy_from_slice(&src[off..off + n * ROW_BYTES]);
            black_box(&mut dst);
            base.push((n * ROW_BYTES) as f64 / secs(t0.elapsed()) / 1e9);
        }
        Ok(())
    };
    let r = run();
    let freed = gpu
        .free(refs_dev)
        .and(gpu.free(out_dev))
        .and(gpu.destroy_stream(stream).map_err(Into::into));
    r?;
    freed?;
    Ok(Row::rate(
        "storage",
        format!("resident gather, {n} random {ROW_BYTES} B rows"),
        median(ours),
        "GB/s",
        "memcpy of the same bytes",
        median(base),
    ))
}

fn hits(s: &Sizes, files: &TableFiles, gpu: &Arc<dyn GpuBackend>) -> Result<Row> {
    let mut c = CacheConfig::new(s.hit_slots);
    c.max_resolve = s.hit_slots;
    let t = CachedTable::open(files.clone(), gpu.clone(), c)?;
    let mut rng = Rng(2);
    // Distinct hot ids, so every one of them fits the arena at once.
    let mut hot: Vec<u64> = (0..s.hit_hot).map(|_| rng.below(files.info.rows)).collect();
    hot.sort_unstable();
    hot.dedup();
    let mut refs = vec![RowRef::default(); hot.len()];
    let l = t.resolve(&hot, &mut refs)?;
    t.release(l, gpu.as_ref(), None)?;
    let round = s.hit_batch * s.hit_batches_per_round;
    let stream: Vec<u64> = (0..round * s.hit_rounds)
        .map(|_| hot[rng.below(hot.len() as u64) as usize])
        .collect();
    let mut out = vec![RowRef::default(); s.hit_batch];
    // Baseline: a std HashMap (SipHash) lookup per id writing a RowRef.
    let map: HashMap<u64, u32> = hot
        .iter()
        .enumerate()
        .map(|(i, &id)| (id, i as u32))
        .collect();
    let before = t.stats();
    let (mut ours, mut base) = (Vec::new(), Vec::new());
    for r in stream.chunks(round) {
        let t0 = Instant::now();
        for b in r.chunks(s.hit_batch) {
            let l = t.resolve(b, &mut out[..b.len()])?;
            black_box(&out);
            t.release(l, gpu.as_ref(), None)?;
        }
        ours.push(secs(t0.elapsed()) * 1e9 / r.len() as f64);
        let t0 = Instant::now();
        for b in r.chunks(s.hit_batch) {
            for (o, id) in out.iter_mut().zip(b) {
                let slot = map.get(id).copied().unwrap_or_default();
                *o = RowRef {
                    data: 0x1000 + u64::from(slot) * ROW_BYTES as u64,
                    scale: 0,
                };
            }
            black_box(&out);
        }
        base.push(secs(t0.elapsed()) * 1e9 / r.len() as f64);
    }
    let after = t.stats();
    ensure!(
        after.misses == before.misses,
        "the hit benchmark saw {} misses",
        after.misses - before.misses
    );
    Ok(Row::cost(
        "storage",
        format!("cached-table hit path, batches of {}", s.hit_batch),
        median(ours),
        "ns/id",
        "std HashMap lookup",
        median(base),
    ))
}

fn misses(s: &Sizes, files: &TableFiles) -> Result<Row> {
    let path = &files.shards[0].path;
    let f = ShardFile::open(path, true)?;
    let reader = default_reader(32)?;
    let pages = std::fs::metadata(path)?.len() / PAGE as u64;
    ensure!(pages > 0, "{}: shorter than a page", path.display());
    let mut rng = Rng(3);
    let mut buf = AlignedBuf::new(s.miss_batch * PAGE);
    let mut one = AlignedBuf::new(PAGE);
    let (mut ours, mut base) = (Vec::new(), Vec::new());
    // Reads go in batches to the reader (it keeps 32 in flight), and one at
    // a time to the baseline, alternating windows of equal length.
    for _ in 0..s.miss_reps {
        let t0 = Instant::now();
        let mut reads = 0u64;
        while t0.elapsed() < s.miss_window {
            let mut rest = buf.as_mut_slice();
            let mut reqs = Vec::with_capacity(s.miss_batch);
            for _ in 0..s.miss_batch {
                let (h, t) = rest.split_at_mut(PAGE);
                rest = t;
                reqs.push(ReadReq {
                    fd: f.fd(),
                    offset: rng.below(pages) * PAGE as u64,
                    buf: h,
                });
            }
            for r in reader.read_batch(&mut reqs) {
                ensure!(r? == PAGE, "short read from {}", path.display());
            }
            reads += s.miss_batch as u64;
        }
        ours.push(reads as f64 / secs(t0.elapsed()) / 1e3);
        let t0 = Instant::now();
        let mut reads = 0u64;
        while t0.elapsed() < s.miss_window {
            for _ in 0..16 {
                let off = rng.below(pages) * PAGE as u64;
                ensure!(
                    pread_full(f.fd(), one.as_mut_slice(), off)? == PAGE,
                    "short read from {}",
                    path.display()
                );
            }
            reads += 16;
        }
        base.push(reads as f64 / secs(t0.elapsed()) / 1e3);
    }
    let mode = if f.direct {
        "O_DIRECT"
    } else {
        "buffered: O_DIRECT refused"
    };
    Ok(Row::rate(
        "storage",
        format!(
            "miss path: random 4 KiB reads, {} QD32 ({mode})",
            reader.name()
        ),
        median(ours),
        "k reads/s",
        "pread loop QD1, same file",
        median(base),
    ))
}

// -------------------------------------------------------------- layer

/// The `ple_forward` bench's baseline: `y = x @ W^T` as a plain loop over
/// the unpacked BF16 weights (`key_proj` then `value_proj`), for one token.
fn naive_project(x: &[f32], w: &PleWeights, e: usize, y: &mut [f32]) {
    let rows = w
        .key_proj
        .chunks_exact(e)
        .chain(w.value_proj.chunks_exact(e));
    for (o, wr) in y.iter_mut().zip(rows) {
        let mut acc = 0.0f32;
        for (a, &b) in x.iter().zip(wr) {
            acc += a * bf16_to_f32(b);
        }
        *o = acc;
    }
}

fn bench_layer(s: &Sizes, _dir: &Path) -> Result<Vec<Row>> {
    let g = s.layer;
    let derived = PleHashParams {
        vocab_size: VOCAB,
        eos_token_id: EOS,
        ngram_size: 3,
        heads_per_ngram: g.heads_per_ngram,
        ngram_vocab_size_base: s.layer_vocab_base,
        divisible_by: 128,
        seed: 1234,
        site: 0,
    }
    .derive()?;
    let (e, c) = (g.heads() * g.head_dim, g.hidden * g.hc);
    let t0 = Instant::now();
    let mut rng = Rng(0x5EED);
    let weights = PleWeights {
        key_proj: (0..c * e).map(|_| rng.bf16(0.02)).collect(),
        value_proj: (0..g.hidden * e).map(|_| rng.bf16(0.02)).collect(),
        norm_key: (0..c).map(|_| rng.f(0.1)).collect(),
        norm_query: (0..c).map(|_| rng.f(0.1)).collect(),
        norm_conv: (0..c).map(|_| rng.f(0.1)).collect(),
        conv1d: (0..c * KERNEL).map(|_| rng.f(0.5)).collect(),
    };
    let rows = derived.padded_rows as usize;
    let table_bits: Vec<u16> = (0..rows * g.head_dim).map(|_| rng.bf16(1.0)).collect();
    let gpu: Arc<dyn GpuBackend> = Arc::new(CpuBackend::new());
    let table: Arc<dyn RowTable> = TinyTable::new(gpu.clone(), &table_bits, g.head_dim)?;
    drop(table_bits);
    let max_tokens = s.prefill_tokens.max(s.decode_batch);
    let mut layer = PleLayer::new(
        &SiteSpec::new(derived.dims, g.head_dim, g.hidden, g.hc, KERNEL, DILATION),
        weights.clone(),
        table,
        max_tokens,
        gpu.as_ref(),
    )?;
    eprintln!(
        "bench:   layer {}, table {rows} rows ({}), built in {:.1} s",
        g.describe(),
        bytes((rows * g.head_dim * 2) as u64),
        t0.elapsed().as_secs_f64()
    );
    let mut states = Vec::new();
    let mut bufs = Vec::new();
    let stream = gpu.create_stream();
    let r = stream
        .as_ref()
        .map_err(|e| anyhow::anyhow!("{e:#}"))
        .and_then(|&st| {
            layer_runs(
                s,
                &layer,
                &weights,
                &gpu,
                st,
                &mut rng,
                &mut states,
                &mut bufs,
            )
        });
    // Free everything whatever happened; the first error wins. The layer
    // synchronises its streams when freed, so the stream goes last.
    let mut freed: Result<()> = Ok(());
    for st in &mut states {
        freed = freed.and(layer.release_seq_state(st, gpu.as_ref()));
    }
    freed = freed.and(layer.free(gpu.as_ref()).map_err(Into::into));
    for p in bufs {
        freed = freed.and(gpu.free(p));
    }
    if let Ok(st) = stream {
        freed = freed.and(gpu.destroy_stream(st).map_err(Into::into));
    }
    let rows = r?;
    freed?;
    Ok(rows)
}

#[allow(clippy::too_many_arguments)]
fn layer_runs(
    s: &Sizes,
    layer: &PleLayer,
    weights: &PleWeights,
    gpu: &Arc<dyn GpuBackend>,
    stream: StreamId,
    rng: &mut Rng,
    states: &mut Vec<PleSeqState>,
    bufs: &mut Vec<DevicePtr>,
) -> Result<Vec<Row>> {
    let g = s.layer;
    let (e, c) = (g.heads() * g.head_dim, g.hidden * g.hc);
    let gpu = gpu.as_ref();
    let t = s.prefill_tokens;
    let b = s.decode_batch;
    let highway = gpu.alloc(t.max(b) * c * 4, "bench highway")?;
    bufs.push(highway);
    let init: Vec<u8> = (0..t.max(b) * c)
        .flat_map(|_| rng.f(1.0).to_le_bytes())
        .collect();
    gpu.copy_h2d(&init, highway)?;
    let mut tokens = |n: usize| -> Vec<u32> { (0..n).map(|_| rng.below(VOCAB) as u32).collect() };

    // Baseline: a naive scalar projection, one token per repetition.
    let x: Vec<f32> = (0..e)
        .map(|i| bf16_to_f32((i as u16).wrapping_mul(7919)))
        .collect();
    let mut y = vec![0.0f32; c + g.hidden];
    let naive = median_dur(
        (0..s.naive_reps.max(1))
            .map(|_| {
                let t0 = Instant::now();
                naive_project(black_box(&x), weights, e, &mut y);
                black_box(&y);
                t0.elapsed()
            })
            .collect(),
    );
    let naive_rate = 1.0 / secs(naive);

    // Prefill: one sequence, one chunk of `t` tokens per step.
    states.push(layer.new_seq_state(gpu)?);
    let step = |st: &mut PleSeqState, toks: &[u32]| -> Result<Duration> {
        let ctx = ForwardContext::new(gpu).with_host_ids(toks);
        let t0 = Instant::now();
        layer.forward(st, highway, toks.len(), false, &ctx, stream)?;
        gpu.synchronize(stream)?;
        Ok(t0.elapsed())
    };
    let warm = tokens(t);
    step(&mut states[0], &warm)?;
    let mut prefill = Vec::new();
    for _ in 0..s.prefill_reps.max(1) {
        let toks = tokens(t);
        prefill.push(step(&mut states[0], &toks)?);
    }
    let prefill = t as f64 / secs(median_dur(prefill));

    // Decode: `b` sequences, one token each, per step.
    for _ in 0..b {
        states.push(layer.new_seq_state(gpu)?);
    }
    let mut decode = Vec::new();
    for i in 0..=s.decode_steps.max(1) {
        let toks = tokens(b);
        let ctx = ForwardContext::new(gpu).with_host_ids(&toks);
        let mut batch: Vec<&mut PleSeqState> = states[1..].iter_mut().collect();
        let t0 = Instant::now();
        layer.forward_batch(&mut batch, highway, b, &ctx, stream)?;
        gpu.synchronize(stream)?;
        // Step 0 resets the fresh carries: a warm-up, not timed.
        if i > 0 {
            decode.push(t0.elapsed());
        }
    }
    let decode = b as f64 / secs(median_dur(decode));
    let what = "naive scalar projection alone, 1 thread";
    Ok(vec![
        Row::rate(
            "layer",
            format!("forward prefill, {t}-token chunk ({})", g.describe()),
            prefill,
            "tok/s",
            what,
            naive_rate,
        ),
        Row::rate(
            "layer",
            format!("forward batched decode, {b} sequences"),
            decode,
            "tok/s",
            what,
            naive_rate,
        ),
    ])
}

// ------------------------------------------------------------- engine

/// Highway rows for `n` tokens: any values will do.
fn highway_rows(n: usize, width: usize, salt: u32) -> Vec<f32> {
    (0..n * width)
        .map(|i| {
            let x = (i as u32).wrapping_mul(2_654_435_761) ^ salt;
            (x >> 8) as f32 / (1u32 << 24) as f32 - 0.5
        })
        .collect()
}

fn bench_engine(s: &Sizes, _dir: &Path) -> Result<Vec<Row>> {
    let g = s.engine;
    let gpu: Arc<dyn GpuBackend> = Arc::new(CpuBackend::new());
    let prefix = (s.prefix / s.block).max(1) * s.block;
    let spec = TinySpec {
        hidden: g.hidden,
        hc_mult: g.hc,
        heads_per_ngram: g.heads_per_ngram,
        head_dim: g.head_dim,
        kernel: KERNEL,
        dilation: DILATION,
        max_tokens: prefix,
        eos: 0,
    };
    let cfg = EngineConfig {
        prefill_chunk: prefix,
        block_size: s.block,
        prefix_cache_bytes: 64 << 20,
        ..Default::default()
    };
    let t0 = Instant::now();
    let mut cached = tiny_engine(&gpu, &spec, 1, 1, cfg.clone())?;
    // The same model (same seed) without a prefix cache: the recompute path.
    let plain_cfg = EngineConfig {
        prefix_cache_bytes: 0,
        ..cfg
    };
    let mut plain = match tiny_engine(&gpu, &spec, 1, 1, plain_cfg) {
        Ok(e) => e,
        Err(e) => {
            let _ = cached.close();
            return Err(e);
        }
    };
    eprintln!(
        "bench:   engines ({}) built in {:.1} s",
        g.describe(),
        t0.elapsed().as_secs_f64()
    );
    let w = cached.width();
    let prompt: Vec<u32> = (0..prefix as u32 + 1).map(|i| 1 + i * 7 % 997).collect();
    let mut run = || -> Result<Vec<Row>> {
        // Prefix restore vs recompute.
        let mut recompute = Vec::new();
        for rep in 0..s.recompute_reps.max(1) {
            let id = plain.add_sequence(&prompt)?.id;
            let mut hw = highway_rows(prefix, w, rep as u32);
            let t0 = Instant::now();
            plain.prefill(id, &prompt[..prefix], &mut hw)?;
            recompute.push(t0.elapsed());
            black_box(&hw);
            plain.release(id)?;
        }
        // Populate the cache: one prefill that snapshots every block.
        let id = cached.add_sequence(&prompt)?.id;
        let mut hw = highway_rows(prefix, w, 0);
        cached.prefill(id, &prompt[..prefix], &mut hw)?;
        cached.release(id)?;
        let mut restore = Vec::new();
        for _ in 0..s.restore_reps.max(1) {
            let t0 = Instant::now();
            let a = cached.add_sequence(&prompt)?;
            restore.push(t0.elapsed());
            cached.release(a.id)?;
            ensure!(
                a.cached == prefix,
                "only {} of the {prefix} prefix tokens hit the cache",
                a.cached
            );
        }
        let ms = |d: Duration| secs(d) * 1e3;
        let mut rows = vec![Row::cost(
            "engine",
            format!("prefix-cache restore of a {prefix}-token prefix"),
            ms(median_dur(restore)),
            "ms",
            &format!("recompute (prefill, chunks of {prefix})"),
            ms(median_dur(recompute)),
        )];

        // Swap-out / swap-in vs memcpy.
        let n = (s.block + 1).min(prompt.len());
        let id = cached.add_sequence(&prompt[..n])?.id;
        let mut hw = highway_rows(n, w, 9);
        cached.prefill(id, &prompt[..n], &mut hw)?;
        let carry = cached.carry_bytes();
        let src = vec![0x5au8; carry];
        let mut dst = vec![0u8; carry];
        let (mut outs, mut ins, mut copies) = (Vec::new(), Vec::new(), Vec::new());
        for _ in 0..s.swap_reps.max(1) {
            let t0 = Instant::now();
            cached.swap_out(id, SwapTarget::Host)?;
            outs.push(t0.elapsed());
            let t0 = Instant::now();
            cached.swap_in(id)?;
            ins.push(t0.elapsed());
            let t0 = Instant::now();
            dst.copy_from_slice(black_box(&src));
            black_box(&mut dst);
            copies.push(t0.elapsed());
        }
        cached.release(id)?;
        let us = |d: Duration| secs(d) * 1e6;
        let m = us(median_dur(copies));
        rows.push(Row::cost(
            "engine",
            format!("swap-out of a {carry}-byte carry (host)"),
            us(median_dur(outs)),
            "us",
            "memcpy of the same bytes",
            m,
        ));
        rows.push(Row::cost(
            "engine",
            format!("swap-in of a {carry}-byte carry (host)"),
            us(median_dur(ins)),
            "us",
            "memcpy of the same bytes",
            m,
        ));
        Ok(rows)
    };
    let r = run();
    let closed = cached.close().and(plain.close());
    let rows = r?;
    closed?;
    Ok(rows)
}

// ------------------------------------------------------------ runtime

fn bench_runtime(s: &Sizes, _dir: &Path) -> Result<Vec<Row>> {
    let cpu = CpuBackend::new();
    let gpu: &dyn GpuBackend = &cpu;
    let n = s.copy_bytes;
    let src = vec![7u8; n];
    let mut dst = vec![0u8; n];
    let a = gpu.alloc(n, "bench src")?;
    let b = gpu.alloc(n, "bench dst")?;
    let stream = gpu.create_stream();
    let mut run = || -> Result<Vec<Duration>> {
        let stream = stream.as_ref().map_err(|e| anyhow::anyhow!("{e:#}"))?;
        gpu.copy_h2d(&src, a)?;
        gpu.memset(b, 0, n)?;
        interleaved(
            s.copy_reps,
            &mut [
                &mut || {
                    gpu.copy_d2d_async(a, b, n, *stream)?;
                    Ok(gpu.synchronize(*stream)?)
                },
                &mut || {
                    dst.copy_from_slice(black_box(&src));
                    black_box(&mut dst);
                    Ok(())
                },
            ],
        )
    };
    let r = run();
    let mut freed = gpu.free(a).and(gpu.free(b));
    if let Ok(st) = stream {
        freed = freed.and(gpu.destroy_stream(st).map_err(Into::into));
    }
    let times = r?;
    freed?;
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
