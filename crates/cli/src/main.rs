//! `metrale-ple`: the command line of the PLE runtime. Each subcommand lives
//! in its own module under `cmd/` and returns a [`cmd::CmdError`] that says
//! whether the input or the work failed.
//!
//! Exit status: 0 on success, 2 for usage or input errors (bad flags,
//! malformed lists, a bad config), 1 when valid input could not be
//! processed. Results go to stdout, diagnostics to stderr.

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
    let result = match &cli.command {
        Command::Ids(args) => cmd::ids::run(args),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("metrale-ple: {e}");
            ExitCode::from(e.exit_status())
        }
    }
}
