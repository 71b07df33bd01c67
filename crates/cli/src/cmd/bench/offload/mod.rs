//! `metrale-ple bench offload`: what serving the PLE table from disk costs
//! a decode workload, at the flagship geometry.
//!
//! One synthetic flagship checkpoint (its table cut to a size several times
//! the row cache: at least 8x, several GiB on disk for the full run) is
//! served resident, memory-mapped and through the row cache, each with
//! prefetch off and on, and each without and with the compute backbone
//! ([`metrale_engine::backbone`]: GEMM blocks for every model layer around
//! the sites, widths divided by `--backbone-scale`). For each, a fresh
//! engine's row cache is first filled to its steady state with another
//! draw of the same token stream ([`fill`]: rows resolved as decode steps
//! would, nothing computed, until the cache is full and its hit rate has
//! settled), then it prefills a set of sequences and decodes them
//! together, one token each per step (Zipf draws over the vocabulary, or
//! with `--corpus` the documents of a token corpus), window after window
//! until the hit rate moved less than half a point between two
//! consecutive windows. The three tables of one prefetch and backbone
//! setting are open together and measured in turns (one repetition of each,
//! table after table, then the next round; each repetition after one step
//! not measured, whose reads ahead the first measured step finds, as each
//! step of a server finds the step before's), so that a shared machine's
//! drifting speed slows them alike: decode tokens/s (the median
//! repetition), the overhead against the resident table (the median over
//! rounds of the ratio to the resident repetition of the same round, with a
//! distribution-free 95% confidence interval of that median), the
//! hit rate, bytes read per token, the share of wall time the steps were
//! blocked waiting for rows, the share of it not covered by the backbone
//! blocks queued before the site (still running when the site's host work
//! ended), and (cached tables) the share spent in read calls at all,
//! foreground or prefetch, and the bytes read per byte of the rows read
//! from disk (what direct-I/O granules add to each miss). A second table
//! gives each row's host time per decode token by phase: the step prefetch
//! call and, of it, hashing; the decode call and, of it, the sites' own
//! host work and their waits for rows; and the CPU time of the row cache's
//! prefetch thread and of the whole process. With `--packed` the checkpoint
//! relaid by `table pack --hot-corpus` (hot rows from the tokens of the
//! same workload drawn with another seed) is served through the row cache too
//! (the `packed` rows); with `--padded`, the checkpoint with its rows
//! padded by `table pack --pad-rows` (the `padded` rows). The disk's random 4 KiB read ceiling
//! ([`RandomReads`], the miss path's reader) is measured in the same run,
//! on the checkpoint's own shard file, and beside it the round trip of a
//! batch of [`ROUND_READS`] reads issued together (a step waits at least
//! that long for the first rows it asks for when it starts, which nothing
//! hides without a backbone) and the CPU a read takes from cores that
//! compute ([`read_cpu_cost`]: what each miss costs a step whose compute
//! fills the machine).
//!
//! A table over half the memory available cannot be held resident: the
//! resident baseline then holds the table's first shards (a quarter of
//! that memory, or `--resident-rows`) with every id folded onto them, the
//! same rows per token, compute and token stream. The report gives the
//! process's RSS and the table files' page cache ([`memory`]); `--tables`
//! measures one table alone for its own peak RSS.
//!
//! Invariants: every configuration sees the same prompts and the same
//! decode tokens (one seeded stream), so the figures differ only by how
//! rows are served; figures are measured, never estimated: a figure a table
//! does not produce (a hit rate without a cache, I/O wait of page faults)
//! is left out (JSON `null`). Bytes read are the row cache's own reads for a
//! cached table, and the process's storage reads (`/proc/self/io`) for the
//! others. With prefetch on, the rows of every sequence's token of a step
//! are requested at every site at the start of the step (once its tokens
//! are known, as the server does), so their reads overlap the blocks that
//! run before each site.
//!
//! The parts: [`setup`] writes or opens the checkpoint and makes its packed
//! and padded copies; [`measure`] picks the resident baseline and measures
//! each setting's tables in turns; [`config`] is one table under
//! measurement; [`workload`] the decode workload and the cache fill before
//! it; [`output`] prints the report. The disk ceiling, the process counters,
//! the medians and the memory figures are `metrale-bench`'s.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, ensure};
use clap::Args;
use metrale_bench::layer::Rng;
use metrale_checkpoint::runtime::TableMode;
use metrale_checkpoint::synth::write_synthetic;
use metrale_checkpoint::{Checkpoint, InitOptions, Preset, TableDType};
use metrale_engine::backbone::{BackboneConfig, Layered, layered};
use metrale_engine::ple_site::PleSite;
use metrale_engine::server::TimedReader;
use metrale_engine::{Engine, EngineConfig, SeqId, StepPlans};
use metrale_gpu_runtime::cpu::CpuBackend;
use metrale_gpu_runtime::gpu::GpuBackend;
use metrale_model_layers::layers::ple::SeqWork;
use metrale_storage::cached::{CacheConfig, DEFAULT_IO_DEPTH, DEFAULT_POLICY, Policy};
use metrale_storage::io::{PageReader, default_reader};
use metrale_storage::remote::RemoteTier;
use metrale_storage::spec::{TablePart, TableSpec};
use metrale_storage::splitmix::SplitMix64;
use metrale_storage::table::{RowRef, RowTable, TableStats};
use serde::Serialize;

use crate::cmd::common::{Zipf, bytes};
use metrale_ple_cli::parse::parse_prompts;

use super::stream::{Source, Streams};
use super::{Scratch, remote};
use crate::cmd::run::{CacheOptions, EngineSetup, build_sites, engine_config};
use crate::cmd::{CmdError, failure, input};
use metrale_bench::counters::{process_read_bytes, thread_cpu_ns};
use metrale_bench::disk::{ROUND_READS, disk_ceiling};
use metrale_bench::memory;
use metrale_bench::stats::{median, median_ci95};

mod config;
mod measure;
mod output;
mod setup;
mod workload;

use self::config::*;
use self::measure::*;
use self::output::*;
use self::setup::*;
use self::workload::*;

/// Arguments of `metrale-ple bench offload`.
#[derive(Args, Debug)]
#[command(after_help = "Examples:\n  metrale-ple bench offload --quick\n  \
                        metrale-ple bench offload --checkpoint /data/flagship-offload --json")]
pub struct OffloadArgs {
    /// Print one JSON object (the run's sizes, the disk ceiling, and a
    /// `rows` array with one entry per table and prefetch setting).
    #[arg(long)]
    json: bool,
    /// The checkpoint to serve. A missing or empty directory gets the
    /// synthetic flagship checkpoint of the run's size, kept for later
    /// runs; default: one written under the temp dir and removed after.
    #[arg(long, value_name = "DIR")]
    checkpoint: Option<PathBuf>,
    /// A small run: a 320 MiB table, fewer sequences and shorter windows.
    #[arg(long)]
    quick: bool,
    /// Every size shrunk to a few milliseconds of work: checks that each
    /// figure is produced, measures nothing worth reading.
    #[arg(long, hide = true)]
    smoke: bool,
    /// Divide the backbone's widths by this (1: blocks of the model's
    /// highway width); the default keeps the flagship's blocks usable on a
    /// small CPU.
    #[arg(long, default_value_t = 8, value_name = "N")]
    backbone_scale: usize,
    /// Measure only without the backbone (or only with it).
    #[arg(long, value_name = "on|off")]
    only_backbone: Option<OnOff>,
    /// The row cache's eviction policy (clock or s3fifo). Default: the row
    /// cache's own.
    #[arg(long, value_name = "clock|s3fifo")]
    cache_policy: Option<Policy>,
    /// Rows per site of the row cache's host-memory tier (0: none).
    #[arg(long, default_value_t = 0, value_name = "ROWS")]
    host_rows: usize,
    /// Measured repetitions of each configuration (default: the run's, 20
    /// full, 12 quick); more give steadier figures on a busy machine.
    #[arg(long, value_name = "N")]
    reps: Option<usize>,
    /// Decode steps per measured repetition (default: the run's, 8 full, 4
    /// quick); shorter repetitions pair the tables' turns more closely.
    #[arg(long, value_name = "N")]
    steps: Option<usize>,
    /// Also serve the checkpoint relaid by `table pack --hot-corpus`
    /// through the row cache (the `packed` rows), its hot rows counted from
    /// the tokens of the same workload drawn with another seed. Needs as much disk
    /// again as the checkpoint.
    #[arg(long)]
    packed: bool,
    /// Also serve the checkpoint with its rows padded by `table pack
    /// --pad-rows` (each row inside the fewest direct-I/O granules) through
    /// the row cache (the `padded` rows). Needs the checkpoint's disk again
    /// and the padding.
    #[arg(long)]
    padded: bool,
    /// Decode each step's sequences in this many consecutive groups, one
    /// after another; with prefetch, a group's reads for its next step
    /// start as soon as its decode returns, so they overlap the other
    /// groups' decodes (what hides the disk's round trip without a
    /// backbone, at the price of smaller batches).
    #[arg(long, default_value_t = 1, value_name = "N")]
    micro_batches: usize,
    /// Row-cache slots per site (default: the run's, 2^20 full, 2^16
    /// quick). At most an eighth of the table's stored rows, so the table
    /// stays at least 8 times the cache.
    #[arg(long, value_name = "N")]
    cache_slots: Option<usize>,
    /// Reads the row cache keeps in flight (its io_uring depth, or pread
    /// threads up to 16).
    #[arg(long, default_value_t = DEFAULT_IO_DEPTH, value_name = "N")]
    read_depth: usize,
    /// Decode the documents of this token corpus (JSON lines, one array of
    /// token ids each, as `run --prompts` reads) instead of Zipf draws:
    /// the documents are shuffled (a fixed seed), then each sequence reads
    /// its documents in turn. The measured streams
    /// read the corpus from its first document, the cache fill its second
    /// half, the hot-row count of `--packed` its second quarter; a part
    /// shorter than its stream is read again from its start (the report
    /// says so).
    #[arg(long, value_name = "FILE")]
    corpus: Option<PathBuf>,
    /// Also serve the checkpoint from these Redis-protocol servers (the
    /// `remote` rows; its tables are pushed first, resuming a load already
    /// there), and measure a step's batch through the remote tier against
    /// raw MGETs of the same keys.
    #[arg(long, value_name = "redis://H:P[,redis://H:P...]")]
    remote: Option<String>,
    /// Connect, read and write timeout of each remote server (ms).
    #[arg(long, default_value_t = 1000, value_name = "MS")]
    remote_timeout_ms: u64,
    /// Serve the resident baseline from the first ROWS stored rows of each
    /// site (whole shards), the ids folded onto them: the same rows per
    /// token, the same compute and token stream, in memory that a table
    /// larger than the host's cannot have. Default: the whole table when it
    /// takes at most half the memory available, else the shards that fit
    /// in a quarter of it.
    #[arg(long, value_name = "ROWS")]
    resident_rows: Option<u64>,
    /// Measure only these tables (of resident, mapped, cached; the
    /// overheads need resident): one table a process gives its own peak
    /// RSS.
    #[arg(long, value_delimiter = ',', value_name = "LIST")]
    tables: Option<Vec<Base>>,
}

/// A table served from the checkpoint as it is.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
enum Base {
    Resident,
    Mapped,
    Cached,
}

/// A setting to keep.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
enum OnOff {
    /// Only with it.
    On,
    /// Only without it.
    Off,
}

/// The sizes of one run.
#[derive(Clone, Copy, Debug)]
struct Sizes {
    name: &'static str,
    /// Table rows stored when the checkpoint is written here.
    table_rows: u64,
    /// Row-cache slots (lowered to an eighth of the stored rows).
    slots: usize,
    /// Sequences decoded together.
    sequences: usize,
    /// Prompt tokens prefilled per sequence.
    prompt: usize,
    /// Decode steps per warm-up window.
    window: usize,
    /// Most warm-up windows before measuring anyway.
    max_windows: usize,
    /// Decode steps per measured repetition: short, so that the tables'
    /// turns sit close together in time.
    measure: usize,
    /// Measured repetitions (tokens/s is their median).
    reps: usize,
    /// How long the disk ceiling is measured.
    ceiling: Duration,
    /// Most fill windows of a row cache before decoding ([`fill`]).
    fill_windows: usize,
    /// Consecutive groups of the sequences a step decodes one after
    /// another (`--micro-batches`; 1: the step is one batch).
    micro_batches: usize,
}

/// 2^24 rows of 160 BF16 values: 5 GiB on disk, 16x a 2^20-slot cache.
const FULL: Sizes = Sizes {
    name: "full",
    table_rows: 1 << 24,
    slots: 1 << 20,
    sequences: 32,
    prompt: 32,
    window: 8,
    max_windows: 40,
    measure: 8,
    reps: 20,
    ceiling: Duration::from_secs(2),
    fill_windows: FILL_WINDOWS,
    micro_batches: 1,
};

/// 2^20 rows (320 MiB), 16x a 2^16-slot cache.
const QUICK: Sizes = Sizes {
    name: "quick",
    table_rows: 1 << 20,
    slots: 1 << 16,
    sequences: 16,
    prompt: 16,
    window: 4,
    max_windows: 16,
    measure: 4,
    reps: 12,
    ceiling: Duration::from_millis(500),
    fill_windows: FILL_WINDOWS,
    micro_batches: 1,
};

/// 2^14 rows (5 MiB), 16x a 2^10-slot cache, a few steps.
const SMOKE: Sizes = Sizes {
    name: "smoke",
    table_rows: 1 << 14,
    slots: 1 << 10,
    sequences: 2,
    prompt: 4,
    window: 2,
    max_windows: 3,
    measure: 2,
    reps: 1,
    ceiling: Duration::from_millis(20),
    fill_windows: 3,
    micro_batches: 1,
};

/// A hit rate that moved less than this between two consecutive windows
/// is settled (half a percentage point).
const SETTLED: f64 = 0.005;

/// The Zipf exponent of the decode tokens (as `run`'s default).
const ZIPF: f64 = 1.1;

/// Seed of the measured token stream.
const STREAM_SEED: u64 = 0x0FF1_0AD5;

/// Seed of the shuffle of a corpus's documents.
const CORPUS_SEED: u64 = 0xC0_2915;

/// Seed of the stream the row cache is filled with (not the measured one).
const FILL_SEED: u64 = 0xF111_0FF1;

/// Sequences the fill replays side by side: each of its steps resolves
/// this many tokens' rows at once, so their reads go out together.
const FILL_SEQUENCES: usize = 256;

/// Most fill windows (of one cache's worth of lookups each).
const FILL_WINDOWS: usize = 12;

/// One measured configuration.
#[derive(Serialize, Debug, Clone)]
struct OffloadRow {
    table: &'static str,
    prefetch: bool,
    /// Whether the backbone blocks ran around the sites.
    backbone: bool,
    decode_tokens_per_s: f64,
    overhead_vs_resident_pct: Option<f64>,
    /// A 95% confidence interval of that median, `[low, high]`, from the
    /// order statistics of the repetitions' overheads (no assumption on
    /// their distribution); `None` under 6 repetitions or without a
    /// resident table.
    overhead_ci95_pct: Option<[f64; 2]>,
    hit_rate: Option<f64>,
    bytes_read_per_token: Option<f64>,
    io_wait_share: Option<f64>,
    /// The share of wall time spent in read calls (foreground and
    /// prefetch, summed over concurrent readers); cached tables only.
    read_share: Option<f64>,
    /// The share of wall time blocked on rows while the backend was not
    /// still running the blocks before the site (all of the wait without
    /// the backbone): at most this much left the backend idle; cached
    /// tables only.
    exposed_wait_share: Option<f64>,
    /// Bytes read per byte of the rows read from disk (misses less the
    /// host tier's): what the direct-I/O spans add to each miss; cached
    /// tables only.
    read_bytes_per_missed_row_byte: Option<f64>,
    /// Tokens of the fill stream replayed through the row cache before
    /// the decode warm-up (cached tables only).
    fill_tokens: Option<u64>,
    /// The hit rate of the fill's last window: the cache's steady state
    /// under the workload's stream (cached tables only).
    fill_hit_rate: Option<f64>,
    /// Where a decode token's host time went, in microseconds per token.
    phases: Phases,
    /// What the process's RSS grew by while the table was opened, filled
    /// and warmed up (the other tables of the setting stayed open).
    rss_open_bytes: Option<u64>,
}

/// Microseconds per decode token of the steps' host work, over the
/// measured repetitions: each row of a step's sites added up.
#[derive(Serialize, Debug, Clone, Copy, Default)]
struct Phases {
    /// The step prefetch call (hashing plus queueing; 0 without prefetch).
    prefetch: f64,
    /// Of it, hashing the step's ids.
    prefetch_hash: f64,
    /// The decode call: the sites' forwards and the kernels they wait for.
    decode: f64,
    /// Of it, the sites' own host work (hashing what the prefetch did not,
    /// resolving rows, queueing kernels), waits for rows excluded.
    site_host: f64,
    /// Of it, waits for rows.
    io_wait: f64,
    /// CPU time of the row cache's prefetch thread (its reads and copies
    /// into slots); `null` where the kernel does not report it.
    prefetch_thread_cpu: Option<f64>,
    /// CPU time of the whole process, every thread.
    process_cpu: Option<f64>,
}

/// The whole report.
#[derive(Serialize, Debug)]
struct Report {
    run: &'static str,
    preset: &'static str,
    checkpoint: String,
    table_rows: u64,
    table_bytes: u64,
    cache_slots: usize,
    cache_bytes: u64,
    sequences: usize,
    /// Groups of the sequences decoded one after another in a step.
    micro_batches: usize,
    measured_steps: usize,
    measured_reps: usize,
    disk_reader: String,
    disk_direct: bool,
    disk_random_reads_per_s: f64,
    disk_random_read_bytes_per_s: f64,
    /// Median microseconds a batch of [`ROUND_READS`] random 4 KiB reads
    /// takes, issued together.
    disk_round_us: f64,
    /// Microseconds of CPU a random read takes from cores that compute.
    disk_read_cpu_us: f64,
    backbone_scale: usize,
    backbone_layers: usize,
    cache_policy: &'static str,
    host_rows: usize,
    /// Reads the row cache kept in flight.
    read_depth: usize,
    /// The decode tokens: `zipf` or the corpus file.
    workload: String,
    /// Documents in the corpus (0 for Zipf draws).
    corpus_documents: usize,
    /// Whether a stream read its part of the corpus more than once (the
    /// measured streams read all of it, the fill its second half, the
    /// hot-row count of `--packed` its second quarter).
    corpus_reread: bool,
    /// The remote tier's figures (`--remote`).
    remote: Option<remote::RemoteBench>,
    /// Rows per site the resident baseline held (fewer than `table_rows`:
    /// ids folded onto them); `None` without a resident table.
    resident_rows: Option<u64>,
    /// The process's memory and the table files' page cache.
    memory: Option<memory::Report>,
    rows: Vec<OffloadRow>,
}

/// Uniform in `[0, 1)` from `r`, the stream of the token draws and the
/// highway rows.
fn unit(r: &mut Rng) -> f64 {
    (r.next_u64() >> 11) as f64 / (1u64 << 53) as f64
}

/// Run `metrale-ple bench offload`.
pub fn run(args: &OffloadArgs) -> Result<(), CmdError> {
    let mut sizes = match (args.smoke, args.quick) {
        (true, _) => SMOKE,
        (false, true) => QUICK,
        (false, false) => FULL,
    };
    if let Some(n) = args.reps {
        if n == 0 {
            return Err(input(anyhow::anyhow!("--reps must be positive")));
        }
        sizes.reps = n;
    }
    if args.micro_batches == 0 || args.micro_batches > sizes.sequences {
        return Err(input(anyhow::anyhow!(
            "--micro-batches must be between 1 and the run's {} sequences",
            sizes.sequences
        )));
    }
    sizes.micro_batches = args.micro_batches;
    if let Some(n) = args.steps {
        if n == 0 {
            return Err(input(anyhow::anyhow!("--steps must be positive")));
        }
        sizes.measure = n;
    }
    let t0 = Instant::now();
    let (dir, _scratch) = match &args.checkpoint {
        Some(d) => (d.clone(), None),
        None => {
            let d =
                std::env::temp_dir().join(format!("metrale-ple-offload-{}", std::process::id()));
            (d.clone(), Some(Scratch::new("bench offload", d)))
        }
    };
    if args.read_depth == 0 {
        return Err(input(anyhow::anyhow!("--read-depth must be positive")));
    }
    if args.backbone_scale == 0 {
        return Err(input(anyhow::anyhow!("--backbone-scale must be positive")));
    }
    let ck = checkpoint(&dir, &sizes)?;
    if let Some(n) = args.cache_slots {
        let most = ck.sites.first().map_or(0, |s| s.table.stored_rows / 8);
        if n == 0 || n as u64 > most {
            return Err(input(anyhow::anyhow!(
                "--cache-slots {n}: must be between 1 and an eighth of the table's {} stored \
                 rows ({most}), so the table stays at least 8 times the cache",
                most * 8
            )));
        }
        sizes.slots = n;
    }
    let (source, workload) = match &args.corpus {
        None => (
            Source::Zipf(Arc::new(Zipf::new(
                ck.spec.vocab_size,
                ck.spec.eos_token_id,
                ZIPF,
            ))),
            "zipf".to_string(),
        ),
        Some(path) => {
            let text = std::fs::read_to_string(path)
                .with_context(|| format!("--corpus {}", path.display()))
                .map_err(input)?;
            let mut docs = parse_prompts(path, &text, ck.spec.vocab_size).map_err(input)?;
            // A file lists its documents by source; a server's requests
            // arrive mixed. Shuffled (with a fixed seed), the measured,
            // fill and hot-row parts are draws of one distribution.
            let mut st = CORPUS_SEED;
            for i in (1..docs.len()).rev() {
                let j = (SplitMix64::step(&mut st) % (i as u64 + 1)) as usize;
                docs.swap(i, j);
            }
            let tokens: usize = docs.iter().map(Vec::len).sum();
            eprintln!(
                "bench offload: corpus {}: {} documents, {tokens} tokens",
                path.display(),
                docs.len()
            );
            (Source::Corpus(Arc::new(docs)), path.display().to_string())
        }
    };
    let backbones: &[bool] = match args.only_backbone {
        None => &[false, true],
        Some(OnOff::On) => &[true],
        Some(OnOff::Off) => &[false],
    };
    let tuning = CacheOptions {
        reader: None,
        policy: args.cache_policy,
        host_rows: args.host_rows,
        ..CacheOptions::default()
    };
    let mut trace_reread = false;
    let (packed, _packed_scratch) = if args.packed {
        let d =
            std::env::temp_dir().join(format!("metrale-ple-offload-packed-{}", std::process::id()));
        let scratch = Scratch::new("bench offload", d.clone());
        let (p, reread) = pack_hot(&ck, &source, &sizes, &d)?;
        trace_reread = reread;
        (Some(p), Some(scratch))
    } else {
        (None, None)
    };
    let (padded, _padded_scratch) = if args.padded {
        let d =
            std::env::temp_dir().join(format!("metrale-ple-offload-padded-{}", std::process::id()));
        let scratch = Scratch::new("bench offload", d.clone());
        (Some(pack_padded(&ck, &d)?), Some(scratch))
    } else {
        (None, None)
    };
    let remote = match &args.remote {
        Some(urls) => {
            let tier = crate::cmd::remote::open_tier(urls, args.remote_timeout_ms)?;
            let per_step = sizes.sequences * ck.sites[0].spec.dims.ngram_heads();
            let bench = remote::measure(&ck, &tier, per_step).map_err(failure)?;
            Some((tier, bench))
        }
        None => None,
    };
    let bases = args
        .tables
        .clone()
        .unwrap_or_else(|| vec![Base::Resident, Base::Mapped, Base::Cached]);
    if bases.is_empty() {
        return Err(input(anyhow::anyhow!("--tables: name at least one table")));
    }
    let resident_rows = match args.resident_rows {
        Some(0) => return Err(input(anyhow::anyhow!("--resident-rows must be positive"))),
        r => r,
    };
    let before = memory::Snapshot::now(&table_paths(&ck));
    let mut report = measure_all(
        &ck,
        &Choice {
            bases,
            resident_rows,
        },
        packed.as_ref(),
        padded.as_ref(),
        &sizes,
        &source,
        args.backbone_scale,
        backbones,
        &tuning,
        args.read_depth,
        remote.as_ref().map(|r| &r.0),
    )
    .map_err(failure)?;
    report.remote = remote.map(|(tier, mut bench)| {
        bench.served = Some(crate::cmd::remote::RemoteSummary::of(
            tier.describe(),
            &tier.stats(),
        ));
        bench
    });
    report.workload = workload;
    report.memory = Some(memory::Report::since(&before, &table_paths(&ck)));
    report.corpus_reread |= trace_reread;
    if report.corpus_reread {
        eprintln!(
            "bench offload: the corpus's {} documents were read more than once (it is shorter \
             than the run's streams)",
            source.documents()
        );
    }
    eprintln!("bench offload: done in {:.1} s", t0.elapsed().as_secs_f64());
    print(&report, args.json).map_err(failure)
}
