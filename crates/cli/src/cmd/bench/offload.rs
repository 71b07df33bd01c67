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

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, ensure};
use clap::Args;
use metrale_bench::layer::Rng;
use metrale_bench::table::RandomReads;
use metrale_checkpoint::runtime::TableMode;
use metrale_checkpoint::synth::write_synthetic;
use metrale_checkpoint::{Checkpoint, InitOptions, Preset, TableDType};
use metrale_engine::backbone::{BackboneConfig, Layered, layered};
use metrale_engine::ple_site::PleSite;
use metrale_engine::server::TimedReader;
use metrale_engine::{Engine, EngineConfig, EngineError, SeqId, Site};
use metrale_gpu_runtime::cpu::CpuBackend;
use metrale_gpu_runtime::gpu::GpuBackend;
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
use crate::cmd::run::{CacheOptions, EngineSetup, build_sites, engine_config};
use crate::cmd::{CmdError, failure, input};
use metrale_bench::memory;

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
    remote: Option<super::remote::RemoteBench>,
    /// Rows per site the resident baseline held (fewer than `table_rows`:
    /// ids folded onto them); `None` without a resident table.
    resident_rows: Option<u64>,
    /// The process's memory and the table files' page cache.
    memory: Option<memory::Report>,
    rows: Vec<OffloadRow>,
}

/// Removes a directory when dropped, so a failed run leaves nothing behind.
struct Scratch(PathBuf);

impl Drop for Scratch {
    fn drop(&mut self) {
        if let Err(e) = std::fs::remove_dir_all(&self.0) {
            eprintln!("bench offload: could not remove {}: {e}", self.0.display());
        }
    }
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
            (d.clone(), Some(Scratch(d)))
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
        let scratch = Scratch(d.clone());
        let (p, reread) = pack_hot(&ck, &source, &sizes, &d)?;
        trace_reread = reread;
        (Some(p), Some(scratch))
    } else {
        (None, None)
    };
    let (padded, _padded_scratch) = if args.padded {
        let d =
            std::env::temp_dir().join(format!("metrale-ple-offload-padded-{}", std::process::id()));
        let scratch = Scratch(d.clone());
        (Some(pack_padded(&ck, &d)?), Some(scratch))
    } else {
        (None, None)
    };
    let remote = match &args.remote {
        Some(urls) => {
            let tier = crate::cmd::remote::open_tier(urls, args.remote_timeout_ms)?;
            let per_step = sizes.sequences * ck.sites[0].spec.dims.ngram_heads();
            let bench = super::remote::measure(&ck, &tier, per_step).map_err(failure)?;
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

/// The checkpoint in `dir`: opened when it holds one, else the synthetic
/// flagship checkpoint of `sizes` written there first.
fn checkpoint(dir: &Path, sizes: &Sizes) -> Result<Checkpoint, CmdError> {
    let empty = match std::fs::read_dir(dir) {
        Ok(mut entries) => entries.next().is_none(),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => true,
        Err(e) => {
            return Err(input(
                anyhow::Error::new(e).context(format!("--checkpoint {}", dir.display())),
            ));
        }
    };
    if empty {
        let t0 = Instant::now();
        let opts = InitOptions {
            preset: Preset::Flagship,
            table_rows: Some(sizes.table_rows),
            dtype: TableDType::Bf16,
            seed: 1,
        };
        eprintln!(
            "bench offload: writing a flagship checkpoint with {} table rows to {}",
            sizes.table_rows,
            dir.display()
        );
        write_synthetic(dir, &opts, &mut |_, _| {})
            .with_context(|| format!("writing the checkpoint to {}", dir.display()))
            .map_err(failure)?;
        eprintln!(
            "bench offload: written in {:.1} s",
            t0.elapsed().as_secs_f64()
        );
    }
    let ck = Checkpoint::open(dir)
        .with_context(|| format!("opening the checkpoint in {}", dir.display()))
        .map_err(input)?;
    Ok(ck)
}

/// Seed of the token stream the hot rows are counted from (the measured
/// stream uses another).
const TRACE_SEED: u64 = 0x7ACE_0FF1;

/// `ck` relaid by `table pack --hot-corpus` into `dst` (run as a child
/// process, so its report stays off this command's output), the hot rows
/// counted from the decode workload of `sizes` drawn from [`TRACE_SEED`]
/// (a corpus's second quarter): every sequence's prompt and as many decode
/// tokens as a run takes at most, which `table pack` hashes with every
/// site's hash. Also returns whether the count read its documents more than
/// once.
fn pack_hot(
    ck: &Checkpoint,
    source: &Source,
    sizes: &Sizes,
    dst: &Path,
) -> Result<(Checkpoint, bool), CmdError> {
    let t0 = Instant::now();
    let steps = sizes.max_windows * sizes.window + sizes.reps * sizes.measure;
    let mut streams = Streams::new(source, TRACE_SEED, sizes.sequences, source.docs(0.25, 0.5));
    let mut seqs: Vec<Vec<u32>> = (0..sizes.sequences)
        .map(|i| (0..sizes.prompt).map(|_| streams.next(i)).collect())
        .collect();
    for _ in 0..steps {
        for (i, s) in seqs.iter_mut().enumerate() {
            s.push(streams.next(i));
        }
    }
    // The workload's own token stream, as a corpus `table pack` hashes
    // with every site's hash.
    let mut corpus = String::new();
    for s in &seqs {
        corpus.push_str(
            &serde_json::to_string(s)
                .context("encoding the corpus")
                .map_err(failure)?,
        );
        corpus.push('\n');
    }
    let corpus_path = dst.with_extension("corpus.jsonl");
    std::fs::write(&corpus_path, &corpus)
        .with_context(|| format!("writing {}", corpus_path.display()))
        .map_err(failure)?;
    eprintln!(
        "bench offload: relaying the table's hot rows ({} sequences of {} tokens) into {}",
        seqs.len(),
        seqs.first().map_or(0, Vec::len),
        dst.display()
    );
    let packed = run_pack(ck, dst, &["--hot-corpus".as_ref(), corpus_path.as_os_str()]);
    let _ = std::fs::remove_file(&corpus_path);
    let packed = packed?;
    eprintln!(
        "bench offload: packed in {:.1} s",
        t0.elapsed().as_secs_f64()
    );
    Ok((packed, streams.reread()))
}

/// `ck` with its table rows padded by `table pack --pad-rows` into `dst`.
fn pack_padded(ck: &Checkpoint, dst: &Path) -> Result<Checkpoint, CmdError> {
    let t0 = Instant::now();
    eprintln!(
        "bench offload: padding the table's rows into {}",
        dst.display()
    );
    let padded = run_pack(ck, dst, &["--pad-rows".as_ref()])?;
    eprintln!(
        "bench offload: padded in {:.1} s",
        t0.elapsed().as_secs_f64()
    );
    Ok(padded)
}

/// Run `table pack FLAGS ck dst` as a child process (its report stays off
/// this command's output) and open what it wrote.
fn run_pack(
    ck: &Checkpoint,
    dst: &Path,
    flags: &[&std::ffi::OsStr],
) -> Result<Checkpoint, CmdError> {
    let exe = std::env::current_exe()
        .context("locating this program to run `table pack`")
        .map_err(failure)?;
    let out = std::process::Command::new(exe)
        .arg("table")
        .arg("pack")
        .args(flags)
        .arg(&ck.dir)
        .arg(dst)
        .stdin(std::process::Stdio::null())
        .output()
        .context("running `table pack`")
        .map_err(failure)?;
    if !out.status.success() {
        return Err(failure(anyhow::anyhow!(
            "`table pack {}` failed: {}",
            flags
                .iter()
                .map(|f| f.to_string_lossy())
                .collect::<Vec<_>>()
                .join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        )));
    }
    Checkpoint::open(dst)
        .with_context(|| format!("opening the packed checkpoint in {}", dst.display()))
        .map_err(failure)
}

/// Reads in a batch of the disk's round-trip probe: about the misses of
/// one pipeline group of a full-run decode step.
const ROUND_READS: usize = 64;

/// Random reads a second the CPU-cost probe asks for: about what a
/// full-run decode step without the backbone asks of the disk.
const COST_READS_PER_S: f64 = 30_000.0;

/// What the disk gives the miss path, measured on one shard file.
struct Disk {
    /// Random 4 KiB reads per second, 1024 at a time.
    reads_per_s: f64,
    /// Median wall time of a batch of [`ROUND_READS`] random 4 KiB reads
    /// issued together: the least a step waits for rows first asked for
    /// when it starts.
    round: Duration,
    /// Microseconds of CPU one random read takes from cores that compute
    /// (see [`read_cpu_cost`]).
    read_cpu_us: f64,
    reader: String,
    direct: bool,
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
fn read_cpu_cost(path: &Path, window: Duration) -> Result<f64> {
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

/// The disk's figures as one line, for the progress log and the report.
fn disk_line(reads_per_s: f64, reader: &str, direct: bool, round_us: f64, cpu_us: f64) -> String {
    format!(
        "disk random 4 KiB reads: {reads_per_s:.0}/s ({}/s) through {reader}{}; {ROUND_READS} at \
         once take {round_us:.0} us; a read takes {cpu_us:.1} us of CPU from computing cores",
        bytes((reads_per_s * 4096.0) as u64),
        if direct { ", O_DIRECT" } else { ", buffered" },
    )
}

/// The disk's random 4 KiB read rate, round trip and CPU per read on
/// `path` through the miss path's reader.
fn disk_ceiling(path: &Path, window: Duration) -> Result<Disk> {
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

/// Figures of one configuration before the resident comparison.
struct Measured {
    /// See [`Config::rss_open`].
    rss_open: Option<u64>,
    tokens_per_s: f64,
    /// Tokens/s of each repetition, in order.
    rates: Vec<f64>,
    hit_rate: Option<f64>,
    bytes_per_token: Option<f64>,
    io_wait_share: Option<f64>,
    read_share: Option<f64>,
    exposed_wait_share: Option<f64>,
    read_per_missed: Option<f64>,
    phases: Phases,
    /// The row cache's fill (cached tables).
    fill: Option<Filled>,
    /// Whether this configuration's streams read documents twice.
    reread: bool,
}

/// What one setting of the tables shares: sizes, tokens, cache and
/// backbone.
struct Setting<'a> {
    sizes: &'a Sizes,
    source: &'a Source,
    slots: usize,
    prefetch: bool,
    backbone: Option<&'a BackboneConfig>,
    tuning: &'a CacheOptions,
    depth: usize,
    /// The tier the `remote` table reads its misses from.
    remote: Option<&'a super::remote::Tier>,
    /// The rows the resident table serves.
    fold: &'a ResidentFold,
}

/// Which tables a run measures, and the resident table's rows.
struct Choice {
    bases: Vec<Base>,
    resident_rows: Option<u64>,
}

/// The rows the resident baseline holds of each site: the whole table, or
/// its first shards with every id folded onto them.
struct ResidentFold {
    /// Rows held per site (of the first site, for the report).
    rows: u64,
    /// Shards held of each site; `None`: all of them, unfolded.
    shards: Vec<Option<usize>>,
}

/// What the resident baseline holds: `rows` of the `stored` rows of
/// `row_bytes` each (the whole table, or its first rows with every id
/// folded onto them).
fn baseline_line(rows: u64, stored: u64, row_bytes: u64) -> String {
    if rows >= stored {
        format!(
            "resident baseline: the whole table ({stored} rows, {})",
            bytes(stored * row_bytes)
        )
    } else {
        format!(
            "resident baseline: the first {rows} of {stored} stored rows ({}), every id folded \
             onto them: the same rows per token, compute and token stream as the other tables, \
             other rows' values",
            bytes(rows * row_bytes)
        )
    }
}

/// The resident baseline's rows: `rows` when given (whole shards, at
/// least one), else the whole table when it takes at most half the memory
/// available, else the shards that fit in a quarter of it.
fn resident_fold(ck: &Checkpoint, rows: Option<u64>) -> Result<ResidentFold> {
    let total: u64 = ck.sites.iter().map(|s| s.table.bytes).sum();
    // Bytes a site may hold when the whole table would not fit.
    let budget = memory::available_bytes()
        .filter(|&a| rows.is_none() && total > a / 2)
        .map(|a| a / 4 / ck.sites.len() as u64);
    let mut shards = Vec::with_capacity(ck.sites.len());
    let mut first = None;
    for s in &ck.sites {
        let t = &s.table;
        ensure!(
            t.sub_tables.is_empty() && t.release.is_none(),
            "bench offload serves the flagship's tables; this site's is not one table of equal \
             shards"
        );
        let row_bytes = t.bytes / t.stored_rows.max(1);
        let want = rows.or(budget.map(|b| b / row_bytes.max(1)));
        let keep = want
            .map(|w| (w / t.rows_per_shard).clamp(1, t.shards.len() as u64) as usize)
            .filter(|&k| k < t.shards.len());
        first.get_or_insert(keep.map_or(t.stored_rows, |k| k as u64 * t.rows_per_shard));
        shards.push(keep);
    }
    Ok(ResidentFold {
        rows: first.unwrap_or(0),
        shards,
    })
}

/// The resident sites of `fold`: each site's first shards loaded, every
/// id folded onto them.
fn folded_resident_sites(
    ck: &Checkpoint,
    gpu: &Arc<dyn GpuBackend>,
    fold: &ResidentFold,
    max_tokens: usize,
) -> Result<Vec<PleSite>> {
    let mut sites = Vec::with_capacity(ck.sites.len());
    for (i, s) in ck.sites.iter().enumerate() {
        let t = &s.table;
        let table: Arc<dyn RowTable> = match fold.shards[i] {
            None => ck.open_table(i, TableMode::Resident, gpu.clone())?,
            Some(k) => {
                let part = TablePart {
                    shards: t.shards[..k].to_vec(),
                    stored_rows: k as u64 * t.rows_per_shard,
                    logical_rows: s.padded_rows,
                    remap: None,
                };
                metrale_storage::open(
                    &TableSpec {
                        parts: vec![part],
                        mode: TableMode::Resident,
                        cache: CacheConfig::default(),
                    },
                    gpu.clone(),
                )?
            }
        };
        sites.push(PleSite::new(ck.build_layer(
            i,
            table,
            max_tokens,
            gpu.as_ref(),
        )?));
    }
    Ok(sites)
}

/// Every shard file of `ck`'s tables.
fn table_paths(ck: &Checkpoint) -> Vec<PathBuf> {
    let mut v: Vec<PathBuf> = ck
        .sites
        .iter()
        .flat_map(|s| s.table.shards.iter().map(|src| src.path.clone()))
        .collect();
    v.sort();
    v.dedup();
    v
}

/// The sites' waits for rows not covered by the blocks before them.
fn exposed(e: &Served) -> Duration {
    e.sites().iter().map(|s| s.wait_split().exposed).sum()
}

#[allow(clippy::too_many_arguments)]
fn measure_all(
    ck: &Checkpoint,
    choice: &Choice,
    packed: Option<&Checkpoint>,
    padded: Option<&Checkpoint>,
    sizes: &Sizes,
    source: &Source,
    scale: usize,
    backbones: &[bool],
    tuning: &CacheOptions,
    depth: usize,
    remote: Option<&super::remote::Tier>,
) -> Result<Report> {
    let site = &ck.sites[0];
    let stored = site.table.stored_rows;
    let row_bytes = site.table.head_dim as u64 * 2;
    // The table must be at least 8x the cache.
    let slots = sizes.slots.min((stored / 8) as usize).max(1);
    ensure!(
        site.table.dtype == metrale_storage::table::RowDType::Bf16,
        "bench offload reads BF16 tables; this checkpoint's is FP8"
    );
    eprintln!(
        "bench offload: {} run, {} sites, {} table rows ({}) per site, a row cache of {} slots \
         ({}), {} sequences",
        sizes.name,
        ck.sites.len(),
        stored,
        bytes(site.table.bytes),
        slots,
        bytes(slots as u64 * row_bytes),
        sizes.sequences
    );
    let disk = disk_ceiling(&site.table.shards[0].path, sizes.ceiling)
        .context("measuring the disk's random reads")?;
    eprintln!(
        "bench offload: {}",
        disk_line(
            disk.reads_per_s,
            &disk.reader,
            disk.direct,
            disk.round.as_secs_f64() * 1e6,
            disk.read_cpu_us
        )
    );
    let fold = resident_fold(ck, choice.resident_rows)?;
    if choice.bases.contains(&Base::Resident) {
        eprintln!(
            "bench offload: {}",
            baseline_line(fold.rows, stored, row_bytes)
        );
    }
    let mut tables: Vec<(&'static str, TableMode, &Checkpoint)> = choice
        .bases
        .iter()
        .map(|b| match b {
            Base::Resident => ("resident", TableMode::Resident, ck),
            Base::Mapped => ("mapped", TableMode::Mapped, ck),
            Base::Cached => ("cached", TableMode::Cached, ck),
        })
        .collect();
    if let Some(p) = packed {
        tables.push(("packed", TableMode::Cached, p));
    }
    if let Some(p) = padded {
        tables.push(("padded", TableMode::Cached, p));
    }
    if remote.is_some() {
        tables.push(("remote", TableMode::Cached, ck));
    }
    let mut rows = Vec::new();
    let mut reread = false;
    for &backbone in backbones {
        let bb = backbone.then(|| BackboneConfig::for_model(&ck.spec, scale));
        for prefetch in [false, true] {
            let setting = Setting {
                sizes,
                source,
                slots,
                prefetch,
                backbone: bb.as_ref(),
                tuning,
                depth,
                remote,
                fold: &fold,
            };
            let group = measure_group(&setting, &tables)
                .with_context(|| format!("prefetch {prefetch}, backbone {backbone}"))?;
            for (name, m, overhead) in group {
                reread |= m.reread;
                let (overhead, ci) = overhead.unzip();
                rows.push(OffloadRow {
                    table: name,
                    prefetch,
                    backbone,
                    decode_tokens_per_s: m.tokens_per_s,
                    overhead_vs_resident_pct: overhead,
                    overhead_ci95_pct: ci.flatten(),
                    hit_rate: m.hit_rate,
                    bytes_read_per_token: m.bytes_per_token,
                    io_wait_share: m.io_wait_share,
                    read_share: m.read_share,
                    exposed_wait_share: m.exposed_wait_share,
                    read_bytes_per_missed_row_byte: m.read_per_missed,
                    fill_tokens: m.fill.as_ref().map(|f| f.tokens),
                    fill_hit_rate: m.fill.as_ref().and_then(|f| f.hit_rates.last().copied()),
                    phases: m.phases,
                    rss_open_bytes: m.rss_open,
                });
            }
        }
    }
    Ok(Report {
        run: sizes.name,
        preset: Preset::Flagship.name(),
        checkpoint: ck.dir.display().to_string(),
        table_rows: stored,
        table_bytes: ck.table_bytes(),
        cache_slots: slots,
        cache_bytes: slots as u64 * row_bytes,
        sequences: sizes.sequences,
        micro_batches: sizes.micro_batches,
        measured_steps: sizes.measure,
        measured_reps: sizes.reps,
        disk_reader: disk.reader,
        disk_direct: disk.direct,
        disk_random_reads_per_s: disk.reads_per_s,
        disk_random_read_bytes_per_s: disk.reads_per_s * 4096.0,
        disk_round_us: disk.round.as_secs_f64() * 1e6,
        disk_read_cpu_us: disk.read_cpu_us,
        backbone_scale: scale,
        backbone_layers: ck.spec.num_hidden_layers,
        cache_policy: tuning.policy.unwrap_or(DEFAULT_POLICY).name(),
        host_rows: tuning.host_rows,
        read_depth: depth,
        workload: String::new(),
        corpus_documents: source.documents(),
        corpus_reread: reread,
        remote: None,
        resident_rows: choice.bases.contains(&Base::Resident).then_some(fold.rows),
        memory: None,
        rows,
    })
}

/// The engine the bench drives.
type Served = Engine<Layered<PleSite>>;

/// How a row cache was filled before decoding.
#[derive(Clone, Debug)]
struct Filled {
    /// Tokens of the fill stream replayed.
    tokens: u64,
    /// The hit rate of each window.
    hit_rates: Vec<f64>,
    /// Whether the last two windows' hit rates were within [`SETTLED`]
    /// after the cache had filled up.
    settled: bool,
    secs: f64,
    /// Whether the fill stream read documents twice.
    reread: bool,
}

/// Fill the row caches of `e` to their steady state under the workload's
/// stream before anything is measured: [`FILL_SEQUENCES`] sequences of the
/// stream drawn from [`FILL_SEED`] (a corpus's second half) are
/// replayed token by token as decode steps ask for rows (every sequence's
/// ids of a step, at every site, resolved and released), with nothing
/// computed, in windows of one cache's worth of lookups, until the cache
/// has evicted (it is full) and the hit rate of a window moved less than
/// [`SETTLED`] from the last, or after `max_windows`. A decode step's
/// warm-up alone reaches a few tens of thousands of tokens, far short of
/// the stream a server's cache has seen; this is what a long-running
/// server's cache holds when the measured steps arrive.
fn fill(
    e: &Served,
    gpu: &dyn GpuBackend,
    source: &Source,
    slots: usize,
    max_windows: usize,
) -> Result<Filled> {
    let t0 = Instant::now();
    let mut streams = Streams::new(source, FILL_SEED, FILL_SEQUENCES, source.docs(0.5, 1.0));
    let mut hist: Vec<Vec<u32>> = vec![Vec::new(); FILL_SEQUENCES];
    // Only the last `context_len` tokens matter to a site's hash.
    let keep = e
        .geometries()
        .iter()
        .map(|g| g.dims.context_len())
        .max()
        .unwrap_or(0);
    let start = e.table_stats();
    let mut out = Filled {
        tokens: 0,
        hit_rates: Vec::new(),
        settled: false,
        secs: 0.0,
        reread: false,
    };
    let mut refs = Vec::new();
    for _ in 0..max_windows.max(1) {
        let before = e.table_stats();
        let mut lookups = 0u64;
        while lookups < slots as u64 {
            let tokens: Vec<u32> = (0..FILL_SEQUENCES).map(|i| streams.next(i)).collect();
            let work: Vec<(&[u32], &[u32])> = hist
                .iter()
                .zip(&tokens)
                .map(|(h, t)| (h.as_slice(), std::slice::from_ref(t)))
                .collect();
            for site in e.sites() {
                let layer = site.inner().layer();
                let hashed = layer.hash_ahead(&work)?;
                let table = layer.table();
                for chunk in hashed.ids().chunks(table.max_resolve().max(1)) {
                    refs.clear();
                    refs.resize(chunk.len(), RowRef::default());
                    let lease = table.resolve(chunk, &mut refs)?;
                    table.release(lease, gpu, None)?;
                }
                lookups += hashed.ids().len() as u64;
            }
            for (h, &t) in hist.iter_mut().zip(&tokens) {
                h.push(t);
                if h.len() > keep {
                    h.remove(0);
                }
            }
            out.tokens += FILL_SEQUENCES as u64;
        }
        let s = e.table_stats().since(&before);
        let hr = s.hits as f64 / lookups.max(1) as f64;
        let prev = out.hit_rates.last().copied();
        out.hit_rates.push(hr);
        let full = e.table_stats().since(&start).evictions > 0;
        if full && prev.is_some_and(|p| (hr - p).abs() < SETTLED) {
            out.settled = true;
            break;
        }
    }
    out.secs = t0.elapsed().as_secs_f64();
    out.reread = streams.reread();
    Ok(out)
}

/// The decode workload over one engine: sequences prefilled once, then
/// steps of one token each, decoded in consecutive groups of sequences
/// (one group unless `--micro-batches`); a group's tokens are known once
/// its decode of the step before returned (what prefetch reads).
struct Workload {
    streams: Streams,
    ids: Vec<SeqId>,
    cur: Vec<u32>,
    template: Vec<f32>,
    highway: Vec<f32>,
    prefetch: bool,
    /// The groups: consecutive ranges of `ids`.
    groups: Vec<std::ops::Range<usize>>,
    /// Time in step prefetch calls and in decode calls.
    prefetch_wall: Duration,
    decode_wall: Duration,
}

impl Workload {
    fn new(e: &mut Served, source: &Source, sizes: &Sizes, prefetch: bool) -> Result<Workload> {
        let mut streams = Streams::new(source, STREAM_SEED, sizes.sequences, source.docs(0.0, 1.0));
        let mut rng = Rng::new(STREAM_SEED);
        let w = e.width();
        let rows = sizes.sequences.max(sizes.prompt);
        let template: Vec<f32> = (0..rows * w)
            .map(|_| (unit(&mut rng) * 2.0 - 1.0) as f32)
            .collect();
        let mut ids = Vec::with_capacity(sizes.sequences);
        for i in 0..sizes.sequences {
            let prompt: Vec<u32> = (0..sizes.prompt).map(|_| streams.next(i)).collect();
            let id = e.add_sequence(&prompt)?.id;
            let mut hw = template[..prompt.len() * w].to_vec();
            e.prefill(id, &prompt, &mut hw)?;
            ids.push(id);
        }
        let cur = (0..ids.len()).map(|i| streams.next(i)).collect();
        let n = sizes.micro_batches.clamp(1, ids.len().max(1));
        let groups: Vec<_> = (0..n)
            .map(|g| g * ids.len() / n..(g + 1) * ids.len() / n)
            .collect();
        Ok(Workload {
            streams,
            ids,
            cur,
            highway: Vec::with_capacity(sizes.sequences * w),
            template,
            prefetch,
            groups,
            prefetch_wall: Duration::ZERO,
            decode_wall: Duration::ZERO,
        })
    }

    /// Start every site's reads of group `g`'s current tokens, in one
    /// call per site: for its decode now ([`Site::prefetch_step`], whose
    /// ids the decode's forwards take), or `ahead` of it, behind the reads
    /// of the group decoding now ([`Site::prefetch_ahead`]).
    fn prefetch_group(&mut self, e: &Served, g: usize, ahead: bool) -> Result<()> {
        let t0 = Instant::now();
        let mut work = Vec::with_capacity(self.groups[g].len());
        for i in self.groups[g].clone() {
            work.push((e.tokens(self.ids[i])?, std::slice::from_ref(&self.cur[i])));
        }
        for (k, site) in e.sites().iter().enumerate() {
            let (r, what) = if ahead {
                (site.prefetch_ahead(&work), "prefetch ahead")
            } else {
                (site.prefetch_step(&work), "step prefetch")
            };
            r.map_err(|err| EngineError::site(k, format!("site {k} {what}"), err))?;
        }
        self.prefetch_wall += t0.elapsed();
        Ok(())
    }

    /// One decode step of every sequence, group after group. With
    /// prefetch, a group's reads start at the start of its turn and, with
    /// more than one group, as soon as its tokens are known: right after
    /// its decode of the step before, so that they overlap the other
    /// groups' decodes (its turn then asks again, finding them loaded or
    /// on their way). A `last` step starts nothing ahead, so no read of a
    /// repetition runs on into another table's turn.
    fn step(&mut self, e: &mut Served, last: bool) -> Result<()> {
        for g in 0..self.groups.len() {
            if self.prefetch {
                self.prefetch_group(e, g, false)?;
            }
            let range = self.groups[g].clone();
            let batch: Vec<(SeqId, u32)> =
                range.clone().map(|i| (self.ids[i], self.cur[i])).collect();
            self.highway.clear();
            self.highway
                .extend_from_slice(&self.template[..batch.len() * e.width()]);
            let t1 = Instant::now();
            e.decode(&batch, &mut self.highway)?;
            self.decode_wall += t1.elapsed();
            for i in range {
                self.cur[i] = self.streams.next(i);
            }
            if self.prefetch && !last && self.groups.len() > 1 {
                self.prefetch_group(e, g, true)?;
            }
        }
        Ok(())
    }
}

/// The share of `lookups` row lookups of decode steps that found their
/// row mapped: a resolve counts a hit for each id found loaded, or being
/// loaded by a prefetch (whose wait is I/O wait); a prefetch's own reads
/// count as misses, so `hits / (hits + misses)` would count those rows
/// twice.
fn hit_rate(s: &TableStats, lookups: u64) -> Option<f64> {
    (lookups > 0).then(|| s.hits as f64 / lookups as f64)
}

/// Bytes this process has read from storage so far (`read_bytes` of
/// `/proc/self/io`), when the kernel reports it.
fn process_read_bytes() -> Option<u64> {
    let s = std::fs::read_to_string("/proc/self/io").ok()?;
    s.lines()
        .find_map(|l| l.strip_prefix("read_bytes:"))
        .and_then(|v| v.trim().parse().ok())
}

/// CPU time so far, in nanoseconds, of this process's threads named
/// `table-prefetch` (the row caches' prefetch threads) and of all its
/// threads (`/proc/self/task/*/schedstat`), when the kernel reports it.
/// Threads that have exited are not counted, so only differences over a
/// span in which none exits mean anything.
fn thread_cpu_ns() -> Option<(u64, u64)> {
    let mut prefetch = 0u64;
    let mut total = 0u64;
    for t in std::fs::read_dir("/proc/self/task").ok()? {
        let dir = t.ok()?.path();
        // A thread may exit between the listing and the reads.
        let Ok(stat) = std::fs::read_to_string(dir.join("schedstat")) else {
            continue;
        };
        let ns: u64 = stat.split_whitespace().next()?.parse().ok()?;
        total += ns;
        let comm = std::fs::read_to_string(dir.join("comm")).unwrap_or_default();
        if comm.trim_end() == "table-prefetch" {
            prefetch += ns;
        }
    }
    Some((prefetch, total))
}

/// The running totals the phases are differences of.
#[derive(Clone, Copy, Default)]
struct Counters {
    prefetch: Duration,
    hash: Duration,
    decode: Duration,
    site_host: Duration,
    io_wait: Duration,
    cpu: Option<(u64, u64)>,
}

impl Counters {
    fn now(e: &Served, w: &Workload) -> Counters {
        let mut c = Counters {
            prefetch: w.prefetch_wall,
            decode: w.decode_wall,
            io_wait: Duration::from_nanos(e.table_stats().io_wait_ns),
            cpu: thread_cpu_ns(),
            ..Counters::default()
        };
        for s in e.sites() {
            c.hash += s.inner().prefetch_time().hash;
            c.site_host += s.host_time();
        }
        c
    }

    /// `self - before`, added to `acc`.
    fn add_since(&self, before: &Counters, acc: &mut Counters) {
        acc.prefetch += self.prefetch.saturating_sub(before.prefetch);
        acc.hash += self.hash.saturating_sub(before.hash);
        acc.decode += self.decode.saturating_sub(before.decode);
        acc.site_host += self.site_host.saturating_sub(before.site_host);
        acc.io_wait += self.io_wait.saturating_sub(before.io_wait);
        acc.cpu = match (acc.cpu, self.cpu.zip(before.cpu)) {
            (Some((ap, at)), Some(((p1, t1), (p0, t0)))) => {
                Some((ap + p1.saturating_sub(p0), at + t1.saturating_sub(t0)))
            }
            _ => None,
        };
    }
}

/// One configuration under measurement: its engine, workload and counters.
struct Config {
    /// The process's RSS grown while this table was opened, filled and
    /// warmed up.
    rss_open: Option<u64>,
    label: String,
    cached: bool,
    engine: Served,
    w: Workload,
    timed: Option<Arc<TimedReader>>,
    /// Row lookups of one step (every site, every sequence).
    per_step: u64,
    /// Tokens/s of each repetition.
    rates: Vec<f64>,
    wall: f64,
    stats: TableStats,
    read: Duration,
    exposed: Duration,
    io_bytes: Option<u64>,
    /// The phases' totals over the measured repetitions.
    spent: Counters,
    /// Bytes of one row.
    row_bytes: u64,
    /// The row cache's fill (cached tables).
    filled: Option<Filled>,
}

impl Config {
    /// A fresh engine over `mode`, its row cache filled to its steady
    /// state ([`fill`]), its sequences prefilled and then warmed up by
    /// decode windows until the hit rate settles (one window for tables
    /// without a cache, which only fault pages in).
    fn open(name: &str, ck: &Checkpoint, mode: TableMode, set: &Setting<'_>) -> Result<Config> {
        let Setting {
            sizes,
            source,
            slots,
            prefetch,
            backbone,
            tuning,
            depth,
            remote,
            fold: _,
        } = *set;
        let gpu: Arc<dyn GpuBackend> = Arc::new(CpuBackend::new());
        let setup = EngineSetup {
            mode,
            slots,
            faults: None,
            engine: EngineConfig {
                prefill_chunk: sizes.prompt,
                prefix_cache_bytes: 0,
                ..Default::default()
            },
            resident_carries: 0,
        };
        let t_open = Instant::now();
        let rows = sizes.sequences.max(sizes.prompt);
        let cached = mode == TableMode::Cached;
        // The remote table reads no disk: no timed reader, so its read
        // share is left out rather than shown as nothing.
        let remote = remote.filter(|_| name == "remote");
        let timed = if cached && remote.is_none() {
            Some(Arc::new(TimedReader::new(default_reader(depth)?)))
        } else {
            None
        };
        let cache = CacheOptions {
            reader: timed.clone().map(|t| t as Arc<dyn PageReader>),
            remote: remote.map(|t| t.clone() as Arc<dyn RemoteTier>),
            ..tuning.clone()
        };
        let rss0 = memory::rss_bytes();
        let sites = if mode == TableMode::Resident {
            folded_resident_sites(ck, &gpu, set.fold, rows)?
        } else {
            build_sites(ck, &gpu, &setup, rows, &cache)?
        };
        let cfg = engine_config(&setup, &sites);
        let sites = layered(gpu.as_ref(), sites, backbone, rows)?;
        let mut e = Engine::new(gpu.clone(), sites, cfg)?;
        let opened = t_open.elapsed();
        let label = format!(
            "{name} table, prefetch {}, backbone {}",
            if prefetch { "on" } else { "off" },
            if backbone.is_some() { "on" } else { "off" }
        );
        let filled = if cached {
            let f = fill(&e, gpu.as_ref(), source, slots, sizes.fill_windows)?;
            let rates: Vec<String> = f
                .hit_rates
                .iter()
                .map(|h| format!("{:.1}%", h * 100.0))
                .collect();
            eprintln!(
                "bench offload: {label}: cache filled with {} tokens of the stream in {:.1} s; hit \
                 rates [{}]{}",
                f.tokens,
                f.secs,
                rates.join(", "),
                if f.settled {
                    ""
                } else {
                    " (not settled; measured anyway)"
                }
            );
            Some(f)
        } else {
            None
        };
        let mut w = Workload::new(&mut e, source, sizes, prefetch)?;
        // Every decode token looks up `ngram_heads` rows at every site.
        let per_token: usize = e.geometries().iter().map(|g| g.dims.ngram_heads()).sum();
        let per_step = (per_token * sizes.sequences) as u64;
        let mut trace = Vec::new();
        let mut settled = false;
        for _ in 0..sizes.max_windows {
            let before = e.table_stats();
            for _ in 0..sizes.window {
                w.step(&mut e, true)?;
            }
            if !cached {
                settled = true;
                break;
            }
            let s = e.table_stats().since(&before);
            let hr = hit_rate(&s, per_step * sizes.window as u64).unwrap_or(0.0);
            let prev = trace.last().copied();
            trace.push(hr);
            if prev.is_some_and(|p: f64| (hr - p).abs() < SETTLED) {
                settled = true;
                break;
            }
        }
        let trace_text: Vec<String> = trace.iter().map(|h| format!("{:.1}%", h * 100.0)).collect();
        eprintln!(
            "bench offload: {label}: opened in {:.2} s; warm-up hit rates [{}]{}",
            opened.as_secs_f64(),
            trace_text.join(", "),
            if settled {
                ""
            } else {
                " (not settled; measured anyway)"
            }
        );
        let rss_open = memory::rss_bytes()
            .zip(rss0)
            .map(|(a, b)| a.saturating_sub(b));
        Ok(Config {
            rss_open,
            label,
            cached,
            engine: e,
            w,
            timed,
            per_step,
            rates: Vec::new(),
            wall: 0.0,
            stats: TableStats::default(),
            read: Duration::ZERO,
            exposed: Duration::ZERO,
            io_bytes: Some(0),
            spent: Counters {
                cpu: Some((0, 0)),
                ..Counters::default()
            },
            row_bytes: ck.sites[0].table.head_dim as u64 * 2,
            filled,
        })
    }

    /// One measured repetition: a step not measured, then `sizes.measure`
    /// steps, their counters added to the configuration's.
    fn rep(&mut self, sizes: &Sizes) -> Result<()> {
        // A step not measured first: the other tables' turns broke the
        // stream, and in a server each step's reads were started by the
        // step before (with micro-batches, by each group's decode before).
        self.w.step(&mut self.engine, false)?;
        let stats0 = self.engine.table_stats();
        let read0 = self.timed.as_ref().map(|t| t.elapsed());
        let exposed0 = exposed(&self.engine);
        let io0 = process_read_bytes();
        let c0 = Counters::now(&self.engine, &self.w);
        let t0 = Instant::now();
        for i in 0..sizes.measure {
            self.w.step(&mut self.engine, i + 1 == sizes.measure)?;
        }
        let dt = t0.elapsed().as_secs_f64().max(1e-9);
        Counters::now(&self.engine, &self.w).add_since(&c0, &mut self.spent);
        let io1 = process_read_bytes();
        self.wall += dt;
        self.rates
            .push((sizes.measure * sizes.sequences) as f64 / dt);
        self.stats = self.stats + self.engine.table_stats().since(&stats0);
        self.exposed += exposed(&self.engine).saturating_sub(exposed0);
        if let (Some(a), Some(b)) = (read0, self.timed.as_ref().map(|t| t.elapsed())) {
            self.read += b.saturating_sub(a);
        }
        self.io_bytes = match (self.io_bytes, io0.zip(io1)) {
            (Some(acc), Some((a, b))) => Some(acc + b.saturating_sub(a)),
            _ => None,
        };
        Ok(())
    }

    /// The figures over every repetition; closes the engine.
    fn finish(self, sizes: &Sizes) -> Result<Measured> {
        let steps = (sizes.measure * self.rates.len()) as u64;
        let tokens = (steps * sizes.sequences as u64) as f64;
        let s = self.stats;
        let bytes_read = if self.cached {
            Some(s.bytes_read)
        } else {
            self.io_bytes
        };
        let m = Measured {
            rss_open: self.rss_open,
            tokens_per_s: median(self.rates.clone()),
            rates: self.rates,
            hit_rate: if self.cached {
                hit_rate(&s, self.per_step * steps)
            } else {
                None
            },
            bytes_per_token: bytes_read.map(|b| b as f64 / tokens),
            io_wait_share: self.cached.then(|| s.io_wait_ns as f64 / 1e9 / self.wall),
            read_share: self
                .timed
                .is_some()
                .then(|| self.read.as_secs_f64() / self.wall),
            exposed_wait_share: self.cached.then(|| self.exposed.as_secs_f64() / self.wall),
            read_per_missed: (self.cached && s.misses > s.host_hits)
                .then(|| s.bytes_read as f64 / ((s.misses - s.host_hits) * self.row_bytes) as f64),
            reread: self.w.streams.reread() || self.filled.as_ref().is_some_and(|f| f.reread),
            fill: self.filled.clone(),
            phases: {
                let c = &self.spent;
                let us = |d: Duration| d.as_secs_f64() * 1e6 / tokens.max(1.0);
                let us_ns = |ns: u64| ns as f64 / 1e3 / tokens.max(1.0);
                Phases {
                    prefetch: us(c.prefetch),
                    prefetch_hash: us(c.hash),
                    decode: us(c.decode),
                    site_host: us(c.site_host.saturating_sub(c.io_wait)),
                    io_wait: us(c.io_wait),
                    prefetch_thread_cpu: c.cpu.filter(|_| self.cached).map(|(p, _)| us_ns(p)),
                    process_cpu: c.cpu.map(|(_, t)| us_ns(t)),
                }
            },
        };
        eprintln!(
            "bench offload: {}: {:.1} tokens/s (median of {} x {} steps; {:.2} s in all)",
            self.label,
            m.tokens_per_s,
            m.rates.len(),
            sizes.measure,
            self.wall
        );
        self.engine.close()?;
        Ok(m)
    }
}

/// The median of `v` (the upper one of an even count); 0 when empty.
fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v.get(v.len() / 2).copied().unwrap_or(0.0)
}

/// A 95% confidence interval of the median of `v`, distribution-free: the
/// `j`-th smallest and `j`-th largest values, `j` the largest rank with
/// `P(Binomial(n, 1/2) < j) <= 0.025` (the chance that fewer than `j` of
/// `n` draws fall below the true median). `None` for fewer than 6 values,
/// where even the extremes cover less than 95%.
fn median_ci95(v: &[f64]) -> Option<[f64; 2]> {
    let n = v.len();
    // P(X < j) for X ~ Binomial(n, 1/2), summed term by term in f64
    // (exact enough for the repetition counts a bench runs).
    let mut below = 0.0f64;
    let mut term = 0.5f64.powi(n as i32);
    let mut j = 0;
    for i in 0..n {
        if below + term > 0.025 {
            break;
        }
        below += term;
        j = i + 1;
        term *= (n - i) as f64 / (i + 1) as f64;
    }
    if j == 0 {
        return None;
    }
    let mut s = v.to_vec();
    s.sort_by(f64::total_cmp);
    Some([s[j - 1], s[n - j]])
}

/// The overhead of one table against the resident one, per cent: the
/// median over repetitions of the ratio to the resident table's repetition
/// next to it, with [`median_ci95`] of those ratios.
type Overhead = (f64, Option<[f64; 2]>);

/// Measure the tables of one setting: each opened and warmed up, then
/// measured in turns (a repetition of each, in table order, `reps` times),
/// so that a machine whose speed drifts slows every table alike; the
/// overhead is the median over repetitions of the ratio to the resident
/// table's repetition next to it.
fn measure_group(
    set: &Setting<'_>,
    tables: &[(&'static str, TableMode, &Checkpoint)],
) -> Result<Vec<(&'static str, Measured, Option<Overhead>)>> {
    let sizes = set.sizes;
    let mut configs = Vec::with_capacity(tables.len());
    for &(name, mode, ck) in tables {
        let c = Config::open(name, ck, mode, set)
            .with_context(|| format!("opening the {name} table"))?;
        configs.push((name, c));
    }
    for _ in 0..sizes.reps.max(1) {
        for (name, c) in &mut configs {
            c.rep(sizes)
                .with_context(|| format!("measuring the {name} table"))?;
        }
    }
    let mut out = Vec::with_capacity(configs.len());
    let mut resident: Option<Vec<f64>> = None;
    for (name, c) in configs {
        let m = c.finish(sizes)?;
        if name == "resident" {
            resident = Some(m.rates.clone());
        }
        let overhead = resident.as_ref().map(|r| {
            let per_rep: Vec<f64> = r
                .iter()
                .zip(&m.rates)
                .map(|(r, t)| (r / t - 1.0) * 100.0)
                .collect();
            (median(per_rep.clone()), median_ci95(&per_rep))
        });
        out.push((name, m, overhead));
    }
    Ok(out)
}

fn opt(v: Option<f64>, f: impl Fn(f64) -> String) -> String {
    v.map_or_else(|| "-".to_string(), f)
}

fn print(r: &Report, json: bool) -> Result<()> {
    use std::io::Write;
    let mut out = std::io::stdout().lock();
    if json {
        serde_json::to_writer_pretty(&mut out, r)?;
        writeln!(out)?;
        return Ok(());
    }
    writeln!(
        out,
        "bench offload ({} run): flagship geometry, {} table rows ({}), row cache {} slots ({}), \
         {} sequences{}, {} x {} steps measured",
        r.run,
        r.table_rows,
        bytes(r.table_bytes),
        r.cache_slots,
        bytes(r.cache_bytes),
        r.sequences,
        if r.micro_batches > 1 {
            format!(" in {} micro-batches", r.micro_batches)
        } else {
            String::new()
        },
        r.measured_reps,
        r.measured_steps
    )?;
    writeln!(
        out,
        "{}",
        disk_line(
            r.disk_random_reads_per_s,
            &r.disk_reader,
            r.disk_direct,
            r.disk_round_us,
            r.disk_read_cpu_us
        )
    )?;
    if let Some(rb) = &r.remote {
        write!(out, "{}", super::remote::lines(rb, r.disk_read_cpu_us))?;
    }
    writeln!(
        out,
        "backbone: {} layers of GEMM blocks at 1/{} width where on; row cache policy {}, \
         host tier {} rows per site, {} reads in flight",
        r.backbone_layers, r.backbone_scale, r.cache_policy, r.host_rows, r.read_depth
    )?;
    if let Some(rows) = r.resident_rows.filter(|&n| n < r.table_rows) {
        let row_bytes = r.cache_bytes / r.cache_slots.max(1) as u64;
        writeln!(out, "{}", baseline_line(rows, r.table_rows, row_bytes))?;
    }
    if let Some(m) = &r.memory {
        let b = |v: Option<u64>| v.map_or_else(|| "-".to_string(), bytes);
        writeln!(
            out,
            "memory: RSS {} before the tables, peak {}; table files in the page cache {} at the \
             start, {} at the end (all page cache {} -> {})",
            b(m.rss_start_bytes),
            b(m.peak_rss_bytes),
            b(m.table_page_cache_start_bytes),
            b(m.table_page_cache_end_bytes),
            b(m.page_cache_start_bytes),
            b(m.page_cache_end_bytes),
        )?;
    }
    let fill = r
        .rows
        .iter()
        .find_map(|row| row.fill_tokens.zip(row.fill_hit_rate));
    writeln!(
        out,
        "decode tokens: {}; row caches filled first with {} tokens of the stream (last window \
         hit rate {})",
        if r.corpus_documents > 0 {
            format!(
                "corpus {} ({} documents{})",
                r.workload,
                r.corpus_documents,
                if r.corpus_reread {
                    ", some read more than once"
                } else {
                    ""
                }
            )
        } else {
            format!("Zipf {ZIPF} draws over the vocabulary")
        },
        fill.map_or_else(|| "-".to_string(), |(t, _)| t.to_string()),
        fill.map_or_else(|| "-".to_string(), |(_, h)| format!("{:.1}%", h * 100.0)),
    )?;
    writeln!(
        out,
        "{:<9} {:<8} {:<8} {:>12} {:>10} {:>16} {:>9} {:>12} {:>9} {:>9} {:>9} {:>9} {:>10}",
        "table",
        "prefetch",
        "backbone",
        "tokens/s",
        "overhead",
        "95% CI",
        "hit rate",
        "bytes/token",
        "I/O wait",
        "exposed",
        "reads",
        "read/miss",
        "RSS open"
    )?;
    for row in &r.rows {
        writeln!(
            out,
            "{:<9} {:<8} {:<8} {:>12.1} {:>10} {:>16} {:>9} {:>12} {:>9} {:>9} {:>9} {:>9} {:>10}",
            row.table,
            if row.prefetch { "on" } else { "off" },
            if row.backbone { "on" } else { "off" },
            row.decode_tokens_per_s,
            opt(row.overhead_vs_resident_pct, |v| format!("{v:+.1}%")),
            row.overhead_ci95_pct
                .filter(|_| row.table != "resident")
                .map_or_else(
                    || "-".to_string(),
                    |[lo, hi]| format!("{lo:+.1}..{hi:+.1}%")
                ),
            opt(row.hit_rate, |v| format!("{:.1}%", v * 100.0)),
            opt(row.bytes_read_per_token, |v| format!("{v:.0}")),
            opt(row.io_wait_share, |v| format!("{:.1}%", v * 100.0)),
            opt(row.exposed_wait_share, |v| format!("{:.1}%", v * 100.0)),
            opt(row.read_share, |v| format!("{:.1}%", v * 100.0)),
            opt(row.read_bytes_per_missed_row_byte, |v| format!("{v:.2}x")),
            row.rss_open_bytes.map_or_else(|| "-".to_string(), bytes),
        )?;
    }
    writeln!(
        out,
        "host time per decode token (us): prefetch call (of it hashing), decode call (of it the \
         sites' host work without waits, and waits for rows), CPU of the cache's prefetch \
         thread and of the process"
    )?;
    writeln!(
        out,
        "{:<9} {:<8} {:<8} {:>9} {:>8} {:>9} {:>9} {:>8} {:>9} {:>9}",
        "table",
        "prefetch",
        "backbone",
        "prefetch",
        "hash",
        "decode",
        "site host",
        "wait",
        "pf thread",
        "process"
    )?;
    for row in &r.rows {
        let p = &row.phases;
        writeln!(
            out,
            "{:<9} {:<8} {:<8} {:>9.1} {:>8.2} {:>9.1} {:>9.1} {:>8.1} {:>9} {:>9}",
            row.table,
            if row.prefetch { "on" } else { "off" },
            if row.backbone { "on" } else { "off" },
            p.prefetch,
            p.prefetch_hash,
            p.decode,
            p.site_host,
            p.io_wait,
            opt(p.prefetch_thread_cpu, |v| format!("{v:.1}")),
            opt(p.process_cpu, |v| format!("{v:.1}")),
        )?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::median_ci95;

    #[test]
    fn the_median_interval_takes_the_binomial_ranks() {
        // n = 10: P(X <= 1) = 11/1024 <= 0.025 < P(X <= 2) = 56/1024, so the
        // 2nd smallest and the 2nd largest.
        let v = [7.0, 3.0, 10.0, 1.0, 5.0, 9.0, 2.0, 8.0, 6.0, 4.0];
        assert_eq!(median_ci95(&v), Some([2.0, 9.0]));
        // n = 6: only the extremes (2/64 <= 0.025 fails, 1/64 holds).
        let v = [6.0, 1.0, 5.0, 2.0, 4.0, 3.0];
        assert_eq!(median_ci95(&v), Some([1.0, 6.0]));
        // n = 40: P(X <= 13) = 0.0192, P(X <= 14) = 0.0403: ranks 14 and 27.
        let v: Vec<f64> = (1..=40).rev().map(f64::from).collect();
        assert_eq!(median_ci95(&v), Some([14.0, 27.0]));
        // Under 6 values even the extremes cover less than 95%.
        assert_eq!(median_ci95(&[1.0, 2.0, 3.0, 4.0, 5.0]), None);
        assert_eq!(median_ci95(&[]), None);
    }
}
