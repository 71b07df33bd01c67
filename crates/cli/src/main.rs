//! `metrale-ple`: the command line of the PLE runtime. Each subcommand lives
//! in its own module under `cmd/` and returns a [`cmd::CmdError`] that says
//! whether the input or the work failed.
//!
//! Exit status: 0 on success, 2 for usage or input errors (bad flags,
//! malformed lists, a bad config or checkpoint, a bad workload file), 1
//! when valid input could not be processed. Results go to stdout,
//! diagnostics and progress bars to stderr; logging goes through `tracing`,
//! filtered by `RUST_LOG` (default: warnings only).

mod cmd;

use std::process::ExitCode;

use clap::{Parser, Subcommand};

/// Tools for PLE (n-gram hashed per-layer embedding) layers.
#[derive(Parser, Debug)]
#[command(name = "metrale-ple", version, about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Derive a PLE site's hash constants and hash tokens into table row
    /// ids; prints one JSON object.
    Ids(cmd::ids::IdsArgs),
    /// Write a deterministic synthetic checkpoint (random weights, the
    /// real hash constants).
    Init(cmd::init::InitArgs),
    /// Show a checkpoint's geometry, sizes, shard layout and validation
    /// result.
    Inspect(cmd::inspect::InspectArgs),
    /// The main job: a serving workload (chunked prefill, batched decode,
    /// prefix caching, preemption) through the engine, with a summary.
    Run(cmd::run::RunArgs),
    /// Run the project's benchmarks and print each figure beside its
    /// same-run baseline and the ratio (built with the `bench` feature).
    #[cfg(feature = "bench")]
    Bench(cmd::bench::BenchArgs),
    /// Table tools: `table pack` realigns shards to 4 KiB, `table push`
    /// loads tables onto remote row servers.
    Table(cmd::table::TableArgs),
    /// Build Engram's compressed-token map from a tokenizer.json and
    /// write it as the JSON array `ids --token-map` reads.
    TokenMap(cmd::token_map::TokenMapArgs),
    /// Random sequence lifecycles on many threads against one engine, every
    /// output checked against a sequential run, with read faults injected.
    Soak(cmd::soak::SoakArgs),
}

/// Send `tracing` events to stderr, filtered by `RUST_LOG`.
fn init_logging() {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn"));
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .try_init();
}

fn main() -> ExitCode {
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        Err(e) => {
            // --help and --version also arrive here, on stdout, as success.
            let _ = e.print();
            return if e.use_stderr() {
                ExitCode::from(cmd::EXIT_INPUT)
            } else {
                ExitCode::SUCCESS
            };
        }
    };
    init_logging();
    let result = match cli.command {
        Command::Ids(args) => cmd::ids::run(&args),
        Command::Init(args) => cmd::init::run(args),
        Command::Inspect(args) => cmd::inspect::run(args),
        Command::Run(args) => cmd::run::run(&args),
        #[cfg(feature = "bench")]
        Command::Bench(args) => cmd::bench::run(&args),
        Command::Table(args) => cmd::table::run(args),
        Command::TokenMap(args) => cmd::token_map::run(&args),
        Command::Soak(args) => cmd::soak::run(&args),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("metrale-ple: {e}");
            ExitCode::from(e.exit_status())
        }
    }
}
