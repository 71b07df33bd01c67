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
//!
//! The parts: [`engine`] builds the engine over the checkpoint's sites
//! (shared with `soak` and `bench offload`) and runs one pass through the
//! server; [`workload`] draws the requests; [`store`] attaches the shared
//! carry store; [`summary`] turns a pass into the printed summary.

use std::path::PathBuf;
use std::sync::Arc;

use anyhow::{Context, anyhow};
use clap::{Args, ValueEnum};
use indicatif::{ProgressBar, ProgressStyle};
use metrale_checkpoint::runtime::TableMode;
use metrale_checkpoint::synth::write_synthetic;
use metrale_checkpoint::tensor_parallel::RankCheckpoint;
use metrale_checkpoint::{Checkpoint, InitOptions, Preset, TableDType};
use metrale_engine::backbone::BackboneConfig;
use metrale_engine::server::Request;
use metrale_engine::{EngineConfig, SwapTarget};
use metrale_storage::cached::{DEFAULT_IO_DEPTH, Policy};
use metrale_storage::io::default_reader;

use metrale_ple_cli::parse::{parse_prompts, parse_text};

use super::common::{Device, Zipf, cache_root, open_backend};
use super::faults::FlakyReader;
use super::remote::{check_loaded, open_tier};
use super::{CmdError, failure, input};

mod engine;
mod store;
mod summary;
mod tensor_parallel;
mod workload;

pub(super) use self::engine::{EngineSetup, build_engine};
// `bench offload` builds its sites with its own cache options.
#[cfg(feature = "bench")]
pub(super) use self::engine::{CacheOptions, build_sites, engine_config};
use self::engine::{PassConfig, PassResult, pass};
use self::summary::{Ran, Summary, VerifySummary, render};
use self::workload::{from_prompt, synthetic};

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

/// Refuse flag combinations that cannot run, before anything is opened.
fn validate(a: &RunArgs) -> Result<(), CmdError> {
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
    Ok(())
}

/// The workload's requests: the prompts of `--prompts` or `--text`, each
/// followed by generated tokens, else the synthetic sequences.
fn plans(a: &RunArgs, ck: &Checkpoint) -> Result<Vec<Request>, CmdError> {
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
    Ok(match prompts {
        Some(list) => {
            let zipf = Zipf::new(vocab, eos, a.zipf);
            let mut st = a.seed;
            list.into_iter()
                .map(|pr| from_prompt(pr, a.decode_tokens, &zipf, &mut st))
                .collect()
        }
        None => synthetic(a, vocab, eos),
    })
}

/// The verify pass: the workload of `plans` rerun over a resident table
/// with no prefix cache, no preemption, no backbone and no prefetch, its
/// rows compared with those of the measured pass `r`.
fn verify(
    ranks: Option<&[RankCheckpoint]>,
    ck: &Checkpoint,
    plans: &[Request],
    a: &RunArgs,
    main: &PassConfig,
    r: &PassResult,
) -> Result<VerifySummary, CmdError> {
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
    let (v, _) = tensor_parallel::pass_all(ranks, ck, plans, a, &check, &bar).map_err(failure)?;
    bar.finish_and_clear();
    let (rows_compared, first_mismatch) = compare(&r.report.rows, &v.report.rows);
    Ok(VerifySummary {
        rows_compared,
        identical: first_mismatch.is_none(),
        first_mismatch,
        seconds: v.report.wall.as_secs_f64(),
    })
}

/// Run `run`.
pub fn run(a: &RunArgs) -> Result<(), CmdError> {
    validate(a)?;
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
    let plans = plans(a, &ck)?;
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
        Some(verify(ranks.as_deref(), &ck, &plans, a, &main, &r)?)
    } else {
        None
    };
    let summary = Ran {
        a,
        dir: &dir,
        ck: &ck,
        sequences: plans.len(),
        tokens: total_tokens,
        main: &main,
        r: &r,
        faults: faults.as_deref(),
        remote: remote.as_deref(),
    }
    .summary(verify, tp_run);
    if a.json {
        let text = serde_json::to_string_pretty(&summary).map_err(failure)?;
        println!("{text}");
    } else {
        print!("{}", render(&summary));
    }
    outcome(a, &summary, &r)
}

/// The run's verdict once its summary is out: a verify mismatch, sequences
/// that failed after their retries, or device memory the engine leaked
/// fail it.
fn outcome(a: &RunArgs, summary: &Summary, r: &PassResult) -> Result<(), CmdError> {
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
