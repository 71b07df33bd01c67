//! `metrale-ple run`: the main job. A server-like workload through the
//! engine over a checkpoint's PLE sites, ending with a summary table.
//!
//! The workload is decided before anything runs and does not depend on the
//! outputs: many sequences, each a shared system prompt followed by turns of
//! Zipf-distributed user tokens and "generated" tokens (EOS between turns);
//! or prompts from `--prompts` (JSON lines) or `--text` (bytes as tokens),
//! each followed by generated tokens. The engine's serving loop
//! ([`metrale_engine::server::Server`]) keeps `--in-flight` sequences
//! admitted and alternates one batched decode step (up to `--decode-batch`
//! sequences) with one prefill chunk; this command only builds the
//! workload and the engine and prints the server's report. The engine
//! restores shared prefixes from its prefix cache and preempts carries
//! (swapping them to host memory) when more sequences are in flight than
//! `--resident-carries` allows.
//!
//! With `--backbone`, every model layer gets GEMM blocks standing in for its
//! attention and MLP (widths divided by `--backbone-scale`), each PLE site
//! at its layer among them, so the row reads started at the beginning of a
//! step have compute to hide behind; the summary then shows how much of
//! the read time the steps still waited for (`I/O wait` against `reads`).
//!
//! The highway rows fed in for a token are a function of the token alone
//! (a hashed pseudo-embedding), so they are a function of the token prefix
//! as the prefix cache requires. Every output row is fingerprinted by
//! (sequence, position); `--verify` reruns the same workload over a
//! resident table with no prefix cache and no preemption and demands the
//! same fingerprint for every row the first run produced, which checks
//! that chunking, batching, the row cache, prefix restores and swaps
//! changed no bit of any output.

use std::fmt::Write as _;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result, anyhow};
use clap::{Args, ValueEnum};
use indicatif::{ProgressBar, ProgressStyle};
use metrale_checkpoint::runtime::TableMode;
use metrale_checkpoint::synth::write_synthetic;
use metrale_checkpoint::{Checkpoint, InitOptions, Preset, TableDType};
use metrale_engine::backbone::{BackboneConfig, BlockShape, Layered, WaitSplit};
use metrale_engine::ple_site::PleSite;
use metrale_engine::server::{Request, Server, ServerConfig, ServerReport, TimedReader, Workload};
use metrale_engine::{Engine, EngineConfig, Site, SwapTarget};
use metrale_gpu_runtime::gpu::GpuBackend;
use metrale_model_layers::layers::ple::Shard;
use metrale_storage::cached::{CacheConfig, DEFAULT_IO_DEPTH, Policy};
use metrale_storage::io::{PageReader, default_reader};
use metrale_storage::remote::RemoteTier;
use metrale_storage::remote::redis::RedisTier;
use serde::Serialize;

use metrale_ple_cli::parse::{parse_prompts, parse_text};

use super::common::{Device, bytes, cache_root, open_backend};
use super::faults::FlakyReader;
use super::remote::{RemoteSummary, check_loaded, open_tier};
use super::{CmdError, failure, input};

mod store;
mod tensor_parallel;
mod workload;

use workload::{embed, from_prompt, synthetic};

use crate::cmd::common::Zipf;

/// How the table rows are served.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum TableArg {
    /// Rows read from the shard files on demand into a row cache.
    Cached,
    /// The shard files memory-mapped.
    Mapped,
    /// Every row loaded into device memory first.
    Resident,
    /// Rows placed once per host in shared memory (/dev/shm) that every
    /// process maps.
    Shared,
    /// Rows fetched from Redis-protocol servers (--remote, loaded by
    /// `table push`) into a row cache.
    Remote,
}

/// Arguments of `run`.
#[derive(Args, Debug)]
#[command(
    after_help = "Examples:\n  metrale-ple run\n  metrale-ple run --verify --json\n  \
                        metrale-ple run /tmp/flagship --sequences 64 --table cached --slots 262144\n  \
                        metrale-ple run --prompts prompts.jsonl --decode-tokens 32"
)]
pub struct RunArgs {
    /// The checkpoint directory. Default: the tiny checkpoint in the user's
    /// cache directory, written on first use.
    pub dir: Option<PathBuf>,
    /// Sequences in the synthetic workload.
    #[arg(long, default_value_t = 192)]
    pub sequences: usize,
    /// Sequences admitted at once.
    #[arg(long, default_value_t = 48)]
    pub in_flight: usize,
    /// Most turns per synthetic sequence (each has 1..=turns).
    #[arg(long, default_value_t = 3)]
    pub turns: usize,
    /// Most generated tokens per turn (synthetic workload), or exactly this
    /// many per prompt (--prompts, --text).
    #[arg(long, default_value_t = 96)]
    pub decode_tokens: usize,
    /// Distinct shared system prompts.
    #[arg(long, default_value_t = 8)]
    pub system_prompts: usize,
    /// Most tokens per prefill chunk.
    #[arg(long, default_value_t = 128)]
    pub prefill_chunk: usize,
    /// Most sequences per batched decode step.
    #[arg(long, default_value_t = 16)]
    pub decode_batch: usize,
    /// How table rows are served.
    #[arg(long, value_enum, default_value = "cached")]
    pub table: TableArg,
    /// Row slots per site in the row cache (--table cached or remote).
    #[arg(long, default_value_t = 65536)]
    pub slots: usize,
    /// Which rows the row cache keeps: clock, or s3fifo (one-off n-grams
    /// pass through a small FIFO before they can evict hot rows).
    /// Default: the row cache's own (s3fifo).
    #[arg(long, value_name = "clock|s3fifo")]
    pub cache_policy: Option<Policy>,
    /// Rows per site of the host-memory tier behind the row cache: rows
    /// evicted from the cache are kept there and copied back on a later
    /// miss instead of read from disk. 0: none.
    #[arg(long, default_value_t = 0, value_name = "ROWS")]
    pub host_rows: usize,
    /// Carries the device budget holds; more sequences in flight are
    /// preempted to host memory. 0: no limit.
    #[arg(long, default_value_t = 32)]
    pub resident_carries: usize,
    /// Prefix-cache block size in tokens.
    #[arg(long, default_value_t = 64)]
    pub block_size: usize,
    /// Prefix-cache capacity in MiB; 0 disables it.
    #[arg(long, default_value_t = 64)]
    pub prefix_cache_mib: usize,
    /// Zipf exponent of the synthetic tokens.
    #[arg(long, default_value_t = 1.1)]
    pub zipf: f64,
    /// Seed of the synthetic workload.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// Prompts as JSON lines, one array of token ids per line.
    #[arg(long, conflicts_with = "text")]
    pub prompts: Option<PathBuf>,
    /// A text file; each non-empty line is a prompt whose bytes are its
    /// token ids.
    #[arg(long)]
    pub text: Option<PathBuf>,
    /// Do not start the row reads of each step's decode batch and prefill
    /// chunk at the start of the step (by default they overlap the step's
    /// compute).
    #[arg(long)]
    pub no_prefetch: bool,
    /// Do not also start, at each step, the reads of the next step's
    /// decode batch (the sequences waiting behind this step's, whose
    /// tokens are known); by default they overlap this step's compute.
    #[arg(long)]
    pub no_prefetch_ahead: bool,
    /// Run a compute backbone: for every model layer, BF16 GEMMs standing
    /// in for its attention and MLP (a QKV and output projection, a gated
    /// MLP up and down of 8/3 the width), each PLE site at its layer among
    /// them. Outputs do not change; the reads have compute to hide behind.
    #[arg(long)]
    pub backbone: bool,
    /// Divide the backbone's widths by this: 1 is a block of the model's
    /// highway width; the default keeps a flagship block usable on a small
    /// CPU.
    #[arg(long, default_value_t = 8, value_name = "N")]
    pub backbone_scale: usize,
    /// Fail this percentage of the table's read batches (EIO or a short
    /// read; --table cached only). The sequences of a failed call are
    /// released and run again from the start, up to --retries times.
    #[arg(long, default_value_t = 0.0)]
    pub fault_percent: f64,
    /// How often a sequence hit by an injected fault is run again.
    #[arg(long, default_value_t = 10)]
    pub retries: u32,
    /// Run batched decode as captured graphs (prestage on the host, replay
    /// a graph captured once per padded batch size), as a server on a GPU
    /// does.
    #[arg(long)]
    pub decode_graphs: bool,
    /// The backend: cpu, or cuda[:N] (needs the `cuda` feature and a
    /// device).
    #[arg(long, default_value = "cpu", value_name = "cpu|cuda[:N]")]
    pub device: Device,
    /// Print the summary as JSON on stdout.
    #[arg(long)]
    pub json: bool,
    /// Rerun over a resident table without caches and check that every
    /// output row is bit-identical.
    #[arg(long)]
    pub verify: bool,
    /// Share prefix carries with other processes through a store:
    /// redis://HOST:PORT[/DB] or dir:PATH.
    #[arg(long, value_name = "redis://HOST:PORT[/DB]|dir:PATH")]
    pub carry_store: Option<String>,
    /// The model identity store keys are made of. Default: a digest of the
    /// checkpoint's config.json.
    #[arg(long)]
    pub model_id: Option<String>,
    /// Carry store and remote row server connect, read and write timeout
    /// in milliseconds.
    #[arg(long, default_value_t = 250)]
    pub store_timeout_ms: u64,
    /// The remote row servers of --table remote, comma-separated, listed
    /// as `table push --to` listed them.
    #[arg(long, value_name = "redis://H:P[,redis://H:P...]")]
    pub remote: Option<String>,
    /// With --table remote: read the rows of a failed remote fetch from the
    /// checkpoint's shard files instead of failing the call.
    #[arg(long)]
    pub remote_fallback: bool,
    /// Most block boundaries probed in the carry store per new sequence.
    #[arg(long, default_value_t = 8)]
    pub store_probes: usize,
    /// Tensor-parallel ranks run in this process.
    #[command(flatten)]
    pub tp: tensor_parallel::TpArgs,
}

/// How to build an engine over a checkpoint's sites (shared with `soak`).
pub(super) struct EngineSetup {
    /// How the table rows are served.
    pub(super) mode: TableMode,
    /// Row slots per site of a cached table.
    pub(super) slots: usize,
    /// Read through this reader (cached tables only).
    pub(super) faults: Option<Arc<FlakyReader>>,
    /// The engine settings; the device budget is set from
    /// `resident_carries` when that is positive.
    pub(super) engine: EngineConfig,
    /// Carries the device budget holds; 0: `engine`'s budget.
    pub(super) resident_carries: usize,
}

/// One pass: the engine and whether decode replays captured graphs.
struct PassConfig {
    setup: EngineSetup,
    /// Decode through captured graphs.
    graphs: bool,
    /// The shared carry store behind the prefix cache.
    store: Option<store::StoreSetup>,
    /// Start each step's reads at its start.
    prefetch: bool,
    /// The backbone around the sites.
    backbone: Option<BackboneConfig>,
    /// The remote tier a cached table reads its misses from.
    remote: Option<Arc<RedisTier>>,
}

/// What one pass measured.
struct PassResult {
    /// The server's figures and row fingerprints.
    report: ServerReport,
    /// The sites' row waits, split by whether the backbone's blocks before
    /// each site were still running.
    waits: WaitSplit,
    carry_bytes: usize,
    leaked: usize,
}

/// An engine over every site of `ck`, each layer taking up to
/// `max_tokens` rows per forward.
pub(super) fn build_engine(
    ck: &Checkpoint,
    gpu: &Arc<dyn GpuBackend>,
    pc: &EngineSetup,
    max_tokens: usize,
) -> Result<Engine<PleSite>> {
    let reader = pc.faults.as_ref().map(|r| r.clone() as Arc<dyn PageReader>);
    let cache = CacheOptions {
        reader,
        ..CacheOptions::default()
    };
    let sites = build_sites(ck, gpu, pc, max_tokens, &cache)?;
    let cfg = engine_config(pc, &sites);
    Ok(Engine::new(gpu.clone(), sites, cfg)?)
}

/// How a cached table is opened besides its slots.
#[derive(Clone, Default)]
pub(super) struct CacheOptions {
    /// Read through this reader instead of the automatic choice.
    pub(super) reader: Option<Arc<dyn PageReader>>,
    /// The eviction policy; `None`: the row cache's default.
    pub(super) policy: Option<Policy>,
    /// Rows of the host-memory tier (0: none).
    pub(super) host_rows: usize,
    /// Read misses from this remote tier instead of the shard files.
    pub(super) remote: Option<Arc<dyn RemoteTier>>,
    /// Read the rows of a failed remote fetch from the shard files.
    pub(super) remote_fallback: bool,
}

/// The PLE site of every site of `ck`, each layer taking up to
/// `max_tokens` rows per forward; a cached table is opened with `cache`.
pub(super) fn build_sites(
    ck: &Checkpoint,
    gpu: &Arc<dyn GpuBackend>,
    pc: &EngineSetup,
    max_tokens: usize,
    cache: &CacheOptions,
) -> Result<Vec<PleSite>> {
    build_rank_sites(ck, gpu, pc, max_tokens, cache, None)
}

/// [`build_sites`], each layer built for tensor-parallel rank `shard` when
/// given (`ck` then a rank's share, `tensor_parallel`).
fn build_rank_sites(
    ck: &Checkpoint,
    gpu: &Arc<dyn GpuBackend>,
    pc: &EngineSetup,
    max_tokens: usize,
    cache: &CacheOptions,
    shard: Option<&Shard>,
) -> Result<Vec<PleSite>> {
    let mut sites = Vec::new();
    for s in 0..ck.sites.len() {
        // The cache settings count only for a cached table.
        let mut cfg = CacheConfig::new(pc.slots);
        cfg.reader = cache.reader.clone();
        if let Some(p) = cache.policy {
            cfg.policy = p;
        }
        cfg.host_rows = cache.host_rows;
        cfg.remote = cache.remote.clone();
        cfg.remote_fallback = cache.remote_fallback;
        let table = ck.serve_table(s, pc.mode, cfg, gpu.clone())?;
        let layer = match shard {
            Some(sh) => ck.build_layer_sharded(s, table, max_tokens, gpu.as_ref(), sh.clone())?,
            None => ck.build_layer(s, table, max_tokens, gpu.as_ref())?,
        };
        sites.push(PleSite::new(layer));
    }
    Ok(sites)
}

/// `pc`'s engine settings, the device budget set from
/// `resident_carries` of `sites`' carries when that is positive.
pub(super) fn engine_config<S: Site>(pc: &EngineSetup, sites: &[S]) -> EngineConfig {
    let mut cfg = pc.engine.clone();
    if pc.resident_carries > 0 {
        let carry: usize = sites.iter().map(Site::carry_bytes).sum();
        cfg.device_budget_bytes = pc.resident_carries * carry;
    }
    cfg
}

/// Run the workload once, through the engine's server; as tensor-parallel
/// rank `shard` of `ck`, a rank's share, when given.
fn pass(
    ck: &Checkpoint,
    plans: &[Request],
    a: &RunArgs,
    pc: &PassConfig,
    bar: &ProgressBar,
    shard: Option<&Shard>,
) -> Result<PassResult> {
    let gpu: Arc<dyn GpuBackend> = open_backend(a.device).map_err(|e| anyhow!("{e}"))?;
    let max_tokens = a.prefill_chunk.max(a.decode_batch);
    // Every read of a cached table goes through one timed reader (over the
    // fault injector when there is one), for the total read time.
    let timed = match pc.setup.mode {
        TableMode::Cached => {
            let inner: Arc<dyn PageReader> = match &pc.setup.faults {
                Some(f) => f.clone(),
                None => default_reader(DEFAULT_IO_DEPTH)?,
            };
            Some(Arc::new(TimedReader::new(inner)))
        }
        _ => None,
    };
    let cache = CacheOptions {
        reader: timed.clone().map(|t| t as Arc<dyn PageReader>),
        policy: a.cache_policy,
        host_rows: a.host_rows,
        remote: pc.remote.clone().map(|t| t as Arc<dyn RemoteTier>),
        remote_fallback: a.remote_fallback,
    };
    let sites = build_rank_sites(ck, &gpu, &pc.setup, max_tokens, &cache, shard)?;
    let engine_cfg = engine_config(&pc.setup, &sites);
    let cfg = ServerConfig {
        in_flight: a.in_flight.max(1),
        prefill_chunk: a.prefill_chunk,
        decode_batch: a.decode_batch.max(1),
        prefetch: pc.prefetch,
        prefetch_ahead: !a.no_prefetch_ahead,
        backbone: pc.backbone.clone(),
        decode_graphs: pc.graphs,
        // Failed calls are tolerated (and rerun) only with injected faults
        // or remote servers, whose faults fail calls as disk faults do.
        retries: (pc.setup.faults.is_some() || pc.remote.is_some()).then_some(a.retries),
    };
    let mut server = Server::build(gpu.clone(), sites, engine_cfg, cfg)?;
    if let Some(t) = timed {
        server.time_reads(t);
    }
    if let Some(st) = &pc.store {
        st.attach(server.engine_mut())?;
    }
    let carry_bytes = server.engine().carry_bytes();
    let workload = Workload {
        requests: plans,
        rows: &embed,
    };
    let report = server.run(workload, &mut |_| bar.inc(1))?;
    let waits = server
        .engine()
        .sites()
        .iter()
        .map(Layered::wait_split)
        .fold(WaitSplit::default(), |a, b| WaitSplit {
            covered: a.covered + b.covered,
            exposed: a.exposed + b.exposed,
        });
    let engine = server.into_engine();
    engine.close()?;
    Ok(PassResult {
        report,
        waits,
        carry_bytes,
        leaked: gpu.live_alloc_count(),
    })
}

/// The summary, as printed and as JSON.
#[derive(Serialize)]
struct Summary {
    checkpoint: String,
    sequences: usize,
    in_flight: usize,
    tokens: u64,
    table: String,
    slots_per_site: Option<usize>,
    prefill: Phase2,
    decode: Phase2,
    row_cache: CacheSummary,
    bytes_read: u64,
    read_calls: u64,
    io_wait_seconds: f64,
    io_wait_share: f64,
    io_wait_covered_seconds: Option<f64>,
    read_seconds: Option<f64>,
    read_unwaited_share: Option<f64>,
    prefetch: bool,
    backbone: Option<BackboneSummary>,
    prefix_cache: PrefixSummary,
    swaps: SwapSummary,
    decode_graphs: Option<GraphSummary>,
    carry: CarrySummary,
    wall_seconds: f64,
    leaked_allocations: usize,
    faults: Option<FaultSummary>,
    verify: Option<VerifySummary>,
    carry_store: Option<store::StoreSummary>,
    remote: Option<RemoteRun>,
    tensor_parallel: Option<tensor_parallel::TpSummary>,
}

#[derive(Serialize)]
struct BackboneSummary {
    layers: usize,
    site_layers: Vec<usize>,
    scale: usize,
    model_width: usize,
    intermediate: usize,
    gflop_per_token: f64,
}

#[derive(Serialize)]
struct FaultSummary {
    percent: f64,
    injected: u64,
    failed_calls: u64,
    retried_sequences: u64,
    failed_sequences: usize,
    first_error: Option<String>,
}

#[derive(Serialize)]
struct Phase2 {
    tokens: u64,
    seconds: f64,
    tokens_per_second: f64,
    step: usize,
}

/// The remote tier's figures and the calls its faults failed.
#[derive(Serialize)]
struct RemoteRun {
    #[serde(flatten)]
    tier: RemoteSummary,
    failed_calls: u64,
    retried_sequences: u64,
    failed_sequences: usize,
    first_error: Option<String>,
}

#[derive(Serialize)]
struct CacheSummary {
    hits: u64,
    misses: u64,
    hit_rate: f64,
    host_hits: u64,
}

#[derive(Serialize)]
struct PrefixSummary {
    hits: u64,
    tokens_restored: u64,
}

#[derive(Serialize)]
struct SwapSummary {
    swap_outs: u64,
    swap_ins: u64,
    preemptions: u64,
}

#[derive(Serialize)]
struct GraphSummary {
    captured: u64,
    replays: u64,
}

#[derive(Serialize)]
struct CarrySummary {
    bytes_per_sequence: usize,
    peak_bytes: usize,
    budget_bytes: Option<usize>,
}

#[derive(Serialize)]
struct VerifySummary {
    rows_compared: u64,
    identical: bool,
    first_mismatch: Option<String>,
    seconds: f64,
}

fn rate(n: u64, d: Duration) -> f64 {
    if d.is_zero() {
        0.0
    } else {
        n as f64 / d.as_secs_f64()
    }
}

fn render(s: &Summary) -> String {
    let mut o = String::new();
    let table = match s.slots_per_site {
        Some(n) => format!("table {} ({n} slots per site)", s.table),
        None => format!("table {}", s.table),
    };
    let _ = writeln!(
        o,
        "metrale-ple run: {} sequences ({} tokens), {} in flight, {table}",
        s.sequences, s.tokens, s.in_flight
    );
    let _ = writeln!(o, "  checkpoint      {}", s.checkpoint);
    let _ = writeln!(
        o,
        "  prefill         {:>11} tokens  {:>8.1} ktokens/s  (chunks of {})",
        s.prefill.tokens,
        s.prefill.tokens_per_second / 1e3,
        s.prefill.step
    );
    let _ = writeln!(
        o,
        "  decode          {:>11} tokens  {:>8.1} ktokens/s  (batches of up to {})",
        s.decode.tokens,
        s.decode.tokens_per_second / 1e3,
        s.decode.step
    );
    if s.row_cache.hits + s.row_cache.misses > 0 {
        let _ = writeln!(
            o,
            "  row cache       hit rate {:.1}%  ({} hits, {} misses, {} of them from host memory)",
            100.0 * s.row_cache.hit_rate,
            s.row_cache.hits,
            s.row_cache.misses,
            s.row_cache.host_hits
        );
    } else {
        let _ = writeln!(o, "  row cache       none (every row in place)");
    }
    let _ = writeln!(
        o,
        "  bytes read      {} in {} read calls",
        bytes(s.bytes_read),
        s.read_calls
    );
    if let Some(b) = &s.backbone {
        let _ = writeln!(
            o,
            "  backbone        {} layers (sites at {:?}), blocks of width {} / MLP {} (scale 1/{}), {:.1} MFLOP per token",
            b.layers,
            b.site_layers,
            b.model_width,
            b.intermediate,
            b.scale,
            b.gflop_per_token * 1e3
        );
    }
    let _ = writeln!(
        o,
        "  I/O wait        {:.1}% of wall time ({:.3} s blocked on rows{}; prefetch {})",
        100.0 * s.io_wait_share,
        s.io_wait_seconds,
        match s.io_wait_covered_seconds {
            Some(c) => format!(", {c:.3} s of it while the blocks before the site still ran"),
            None => String::new(),
        },
        if s.prefetch { "on" } else { "off" }
    );
    if let (Some(r), Some(h)) = (s.read_seconds, s.read_unwaited_share) {
        let _ = writeln!(
            o,
            "  reads           {r:.3} s in read calls, {:.1}% of it never waited for",
            100.0 * h
        );
    }
    let _ = writeln!(
        o,
        "  prefix cache    {} hits, {} tokens restored",
        s.prefix_cache.hits, s.prefix_cache.tokens_restored
    );
    let _ = writeln!(
        o,
        "  swaps           {} out, {} in ({} preemptions)",
        s.swaps.swap_outs, s.swaps.swap_ins, s.swaps.preemptions
    );
    if let Some(g) = &s.decode_graphs {
        let _ = writeln!(
            o,
            "  decode graphs   {} captured, {} steps replayed",
            g.captured, g.replays
        );
    }
    let _ = writeln!(
        o,
        "  carry memory    {} per sequence, peak {}{}",
        bytes(s.carry.bytes_per_sequence as u64),
        bytes(s.carry.peak_bytes as u64),
        match s.carry.budget_bytes {
            Some(b) => format!(" (budget {})", bytes(b as u64)),
            None => " (no budget)".to_string(),
        }
    );
    if let Some(f) = &s.faults {
        let _ = writeln!(
            o,
            "  read faults     {} injected ({}% of read batches): {} calls failed, {} sequences rerun, {} given up",
            f.injected, f.percent, f.failed_calls, f.retried_sequences, f.failed_sequences
        );
    }
    if let Some(cs) = &s.carry_store {
        o.push_str(&store::render(cs));
    }
    if let Some(r) = &s.remote {
        o.push_str(&r.tier.render());
        let _ = writeln!(
            o,
            "                  {} calls failed, {} sequences rerun, {} given up{}",
            r.failed_calls,
            r.retried_sequences,
            r.failed_sequences,
            r.first_error
                .as_deref()
                .map_or(String::new(), |e| format!("; first: {e}"))
        );
    }
    if let Some(tp) = &s.tensor_parallel {
        o.push_str(&tensor_parallel::render(tp));
    }
    let _ = writeln!(o, "  wall time       {:.2} s", s.wall_seconds);
    match &s.verify {
        Some(VerifySummary {
            first_mismatch: Some(at),
            rows_compared,
            ..
        }) => {
            let _ = writeln!(
                o,
                "  verify          MISMATCH at {at} (after {rows_compared} identical rows)"
            );
        }
        Some(v) => {
            let _ = writeln!(
                o,
                "  verify          {} output rows bit-identical to a resident, uncached run ({:.2} s)",
                v.rows_compared, v.seconds
            );
        }
        None => {}
    }
    o
}

/// A progress bar over `n` sequences on stderr (hidden off a terminal).
fn sequence_bar(n: usize, msg: &'static str) -> ProgressBar {
    let bar = ProgressBar::new(n as u64);
    bar.set_style(
        ProgressStyle::with_template("{msg:>8} [{bar:40}] {pos}/{len} sequences {elapsed}")
            .expect("a valid template")
            .progress_chars("=> "),
    );
    bar.set_message(msg);
    bar
}

/// Compare the rows `got` computed with those of the check run `want`
/// (which computes every position): how many were compared, and the first
/// that differs or is missing.
fn compare(got: &[Vec<Option<u64>>], want: &[Vec<Option<u64>>]) -> (u64, Option<String>) {
    let mut compared = 0u64;
    for (s, (got, want)) in got.iter().zip(want).enumerate() {
        for (pos, g) in got.iter().enumerate() {
            let Some(g) = g else { continue };
            match want.get(pos) {
                Some(Some(w)) if w == g => compared += 1,
                _ => {
                    return (compared, Some(format!("sequence {s}, position {pos}")));
                }
            }
        }
    }
    (compared, None)
}

/// The checkpoint to run: `dir`, or the default tiny one (written on first
/// use).
pub(super) fn checkpoint_dir(dir: &Option<PathBuf>) -> Result<PathBuf, CmdError> {
    if let Some(d) = dir {
        return Ok(d.clone());
    }
    let d = cache_root()?.join("tiny");
    // A tiny checkpoint an earlier metrale-ple wrote in the project's
    // earlier layout (before transformers' names) is written anew.
    let config = d.join(metrale_checkpoint::names::CONFIG_FILE);
    if d.exists()
        && std::fs::read_to_string(&config).is_ok_and(|t| !t.contains("\"qwen4_exp_text\""))
    {
        eprintln!(
            "rewriting the tiny checkpoint at {} (an earlier layout)",
            d.display()
        );
        std::fs::remove_dir_all(&d)
            .with_context(|| format!("removing {}", d.display()))
            .map_err(failure)?;
    }
    if !d.exists() {
        eprintln!("writing the tiny checkpoint to {} (first use)", d.display());
        if let Some(parent) = d.parent() {
            std::fs::create_dir_all(parent)
                .with_context(|| format!("creating {}", parent.display()))
                .map_err(failure)?;
        }
        let opts = InitOptions {
            preset: Preset::Tiny,
            table_rows: None,
            dtype: TableDType::Bf16,
            seed: 1,
        };
        write_synthetic(&d, &opts, &mut |_, _| {}).map_err(failure)?;
    }
    Ok(d)
}

/// Run `run`.
pub fn run(a: &RunArgs) -> Result<(), CmdError> {
    if a.prefill_chunk == 0 || a.decode_batch == 0 || a.in_flight == 0 {
        return Err(input(anyhow!(
            "--prefill-chunk, --decode-batch and --in-flight must be positive"
        )));
    }
    if !(0.0..=100.0).contains(&a.fault_percent) {
        return Err(input(anyhow!(
            "--fault-percent {} is not a percentage (0 to 100)",
            a.fault_percent
        )));
    }
    if a.fault_percent > 0.0 && a.table != TableArg::Cached {
        return Err(input(anyhow!(
            "--fault-percent injects read faults into the row cache; it needs --table cached"
        )));
    }
    if (a.table == TableArg::Remote) != a.remote.is_some() {
        return Err(input(anyhow!(
            "--table remote and --remote go together: --remote names the servers \
             (redis://H:P[,redis://H:P...]) the rows are read from"
        )));
    }
    if a.remote_fallback && a.table != TableArg::Remote {
        return Err(input(anyhow!("--remote-fallback needs --table remote")));
    }
    if a.block_size == 0 {
        return Err(input(anyhow!("--block-size must be positive")));
    }
    if a.backbone_scale == 0 {
        return Err(input(anyhow!("--backbone-scale must be positive")));
    }
    drop(open_backend(a.device)?);
    let ranks = tensor_parallel::open(a)?;
    let (dir, ck) = match &ranks {
        Some(g) => (a.tp.tp_ranks[0].clone(), g[0].ck.clone()),
        None => {
            let dir = checkpoint_dir(&a.dir)?;
            let ck = Checkpoint::open(&dir).map_err(input)?;
            (dir, ck)
        }
    };
    let store_setup = store::setup(a, &dir).map_err(input)?;
    let g = &ck.spec;
    let vocab = g.vocab_size;
    let eos = g.eos_token_id;

    let prompts = if let Some(p) = &a.prompts {
        let text = std::fs::read_to_string(p)
            .with_context(|| format!("reading {}", p.display()))
            .map_err(input)?;
        Some(parse_prompts(p, &text, vocab).map_err(input)?)
    } else if let Some(p) = &a.text {
        let data = std::fs::read(p)
            .with_context(|| format!("reading {}", p.display()))
            .map_err(input)?;
        Some(parse_text(p, &data, vocab).map_err(input)?)
    } else {
        None
    };
    let plans = match prompts {
        Some(list) => {
            let zipf = Zipf::new(vocab, eos, a.zipf);
            let mut st = a.seed;
            list.into_iter()
                .map(|pr| from_prompt(pr, a.decode_tokens, &zipf, &mut st))
                .collect()
        }
        None => synthetic(a, vocab, eos),
    };
    let total_tokens: u64 = plans.iter().map(|p| p.tokens.len() as u64).sum();

    let remote = match &a.remote {
        Some(urls) => {
            let t = open_tier(urls, a.store_timeout_ms)?;
            check_loaded(&ck, t.as_ref()).map_err(input)?;
            Some(t)
        }
        None => None,
    };
    let mode = match a.table {
        TableArg::Cached | TableArg::Remote => TableMode::Cached,
        TableArg::Mapped => TableMode::Mapped,
        TableArg::Resident => TableMode::Resident,
        TableArg::Shared => TableMode::Shared,
    };
    let faults = if a.fault_percent > 0.0 {
        Some(Arc::new(FlakyReader::new(
            default_reader(DEFAULT_IO_DEPTH).map_err(failure)?,
            a.fault_percent,
            a.seed,
        )))
    } else {
        None
    };
    let main = PassConfig {
        setup: EngineSetup {
            mode,
            slots: a.slots,
            faults: faults.clone(),
            engine: EngineConfig {
                prefill_chunk: a.prefill_chunk,
                block_size: a.block_size,
                prefix_cache_bytes: a.prefix_cache_mib << 20,
                device_budget_bytes: usize::MAX,
                preempt_to: SwapTarget::Host,
                swap_dir: None,
            },
            resident_carries: a.resident_carries,
        },
        graphs: a.decode_graphs,
        store: store_setup,
        prefetch: !a.no_prefetch,
        backbone: a
            .backbone
            .then(|| BackboneConfig::for_model(&ck.spec, a.backbone_scale)),
        remote: remote.clone(),
    };
    let bar = sequence_bar(plans.len(), "run");
    let (r, tp_run) = tensor_parallel::pass_all(ranks.as_deref(), &ck, &plans, a, &main, &bar)
        .map_err(failure)?;
    bar.finish_and_clear();

    let verify = if a.verify {
        let check = PassConfig {
            setup: EngineSetup {
                mode: TableMode::Resident,
                slots: a.slots,
                faults: None,
                engine: EngineConfig {
                    prefix_cache_bytes: 0,
                    ..main.setup.engine.clone()
                },
                resident_carries: 0,
            },
            graphs: false,
            store: None,
            // The reference runs no backbone and no prefetch: neither may
            // change an output bit.
            prefetch: false,
            backbone: None,
            remote: None,
        };
        let bar = sequence_bar(plans.len(), "verify");
        let (v, _) = tensor_parallel::pass_all(ranks.as_deref(), &ck, &plans, a, &check, &bar)
            .map_err(failure)?;
        bar.finish_and_clear();
        let (rows_compared, first_mismatch) = compare(&r.report.rows, &v.report.rows);
        Some(VerifySummary {
            rows_compared,
            identical: first_mismatch.is_none(),
            first_mismatch,
            seconds: v.report.wall.as_secs_f64(),
        })
    } else {
        None
    };

    let st = r.report.stats;
    let lookups = r.report.table.hits + r.report.table.misses;
    let io_wait = r.report.io_wait.as_secs_f64();
    let summary = Summary {
        checkpoint: dir.display().to_string(),
        sequences: plans.len(),
        in_flight: a.in_flight,
        tokens: total_tokens,
        table: format!("{:?}", a.table).to_lowercase(),
        slots_per_site: matches!(a.table, TableArg::Cached | TableArg::Remote).then_some(a.slots),
        prefill: Phase2 {
            tokens: st.prefill_tokens,
            seconds: r.report.prefill_time.as_secs_f64(),
            tokens_per_second: rate(st.prefill_tokens, r.report.prefill_time),
            step: a.prefill_chunk,
        },
        decode: Phase2 {
            tokens: st.decode_tokens,
            seconds: r.report.decode_time.as_secs_f64(),
            tokens_per_second: rate(st.decode_tokens, r.report.decode_time),
            step: a.decode_batch,
        },
        row_cache: CacheSummary {
            hits: r.report.table.hits,
            misses: r.report.table.misses,
            hit_rate: if lookups == 0 {
                0.0
            } else {
                r.report.table.hits as f64 / lookups as f64
            },
            host_hits: r.report.table.host_hits,
        },
        bytes_read: r.report.table.bytes_read,
        read_calls: r.report.table.read_calls,
        io_wait_seconds: io_wait,
        io_wait_share: io_wait / r.report.wall.as_secs_f64().max(1e-9),
        io_wait_covered_seconds: main
            .backbone
            .is_some()
            .then_some(r.waits.covered.as_secs_f64()),
        read_seconds: r.report.read_time.map(|d| d.as_secs_f64()),
        read_unwaited_share: r.report.read_time.map(|d| {
            let read = d.as_secs_f64();
            if read > 0.0 {
                (1.0 - io_wait / read).clamp(0.0, 1.0)
            } else {
                1.0
            }
        }),
        prefetch: !a.no_prefetch,
        backbone: main.backbone.as_ref().map(|b| {
            let shape = BlockShape::new(g.hc_mult * g.hidden_size, b.scale);
            BackboneSummary {
                layers: b.layers,
                site_layers: b.site_layers.clone(),
                scale: b.scale,
                model_width: shape.model,
                intermediate: shape.intermediate,
                gflop_per_token: 2.0 * shape.macs_per_token() as f64 * b.layers as f64 / 1e9,
            }
        }),
        prefix_cache: PrefixSummary {
            hits: st.prefix_hits,
            tokens_restored: st.prefix_tokens_restored,
        },
        swaps: SwapSummary {
            swap_outs: st.swap_outs,
            swap_ins: st.swap_ins,
            preemptions: st.preemptions,
        },
        decode_graphs: a.decode_graphs.then_some(GraphSummary {
            captured: st.graph_captures,
            replays: st.graph_replays,
        }),
        carry: CarrySummary {
            bytes_per_sequence: r.carry_bytes,
            peak_bytes: st.budget.peak_bytes,
            budget_bytes: (a.resident_carries > 0).then_some(a.resident_carries * r.carry_bytes),
        },
        wall_seconds: r.report.wall.as_secs_f64(),
        leaked_allocations: r.leaked,
        faults: faults.as_ref().map(|f| FaultSummary {
            percent: a.fault_percent,
            injected: f.injected(),
            failed_calls: r.report.failed_calls,
            retried_sequences: r.report.retried,
            failed_sequences: r.report.failed.len(),
            first_error: r.report.first_fault.clone(),
        }),
        verify,
        carry_store: main.store.as_ref().map(|cs| {
            let per_token = r.report.prefill_time.as_secs_f64() / st.prefill_tokens.max(1) as f64;
            store::summary(cs, &st.carry_store, per_token)
        }),
        remote: remote.as_ref().map(|t| RemoteRun {
            tier: RemoteSummary::of(t.describe(), &t.stats()),
            failed_calls: r.report.failed_calls,
            retried_sequences: r.report.retried,
            failed_sequences: r.report.failed.len(),
            first_error: r.report.first_fault.clone(),
        }),
        tensor_parallel: tp_run,
    };
    if a.json {
        let text = serde_json::to_string_pretty(&summary).map_err(failure)?;
        println!("{text}");
    } else {
        print!("{}", render(&summary));
    }
    if let Some(VerifySummary {
        first_mismatch: Some(at),
        ..
    }) = &summary.verify
    {
        return Err(failure(anyhow!(
            "verify: the output row of {at} differs from a resident, uncached run"
        )));
    }
    if !r.report.failed.is_empty() {
        return Err(failure(anyhow!(
            "{} sequences still failed after {} retries (first: sequence {}); first error: {}",
            r.report.failed.len(),
            a.retries,
            r.report.failed[0],
            r.report.first_fault.as_deref().unwrap_or("?")
        )));
    }
    if r.leaked != 0 {
        return Err(failure(anyhow!(
            "{} device allocations were still live after the engine closed",
            r.leaked
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn verify_reports_the_first_difference() {
        let got = vec![vec![None, Some(1), Some(2)], vec![Some(3)]];
        let same = vec![vec![Some(9), Some(1), Some(2)], vec![Some(3)]];
        assert_eq!(compare(&got, &same), (3, None));
        let other = vec![vec![Some(9), Some(1), Some(2)], vec![Some(4)]];
        assert_eq!(
            compare(&got, &other),
            (2, Some("sequence 1, position 0".to_string()))
        );
        let missing = vec![vec![Some(9), None, Some(2)], vec![Some(3)]];
        assert_eq!(
            compare(&got, &missing).1.as_deref(),
            Some("sequence 0, position 1")
        );
    }
}
