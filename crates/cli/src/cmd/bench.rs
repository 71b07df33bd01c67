//! `metrale-ple bench`: not built yet; it refuses to run.
use clap::Args;

use super::CmdError;

/// Arguments of `bench`.
#[derive(Args, Debug)]
pub struct BenchArgs {}

/// Run `bench`.
pub fn run(_a: &BenchArgs) -> Result<(), CmdError> {
    Err(super::failure(anyhow::anyhow!("bench is not built yet")))
}
