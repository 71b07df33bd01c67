//! `metrale-ple table shard`: write tensor-parallel ranks' shares of a
//! checkpoint (`metrale_checkpoint::tensor_parallel`, docs/SPEC.md §5,
//! "Tensor-parallel shards").
//!
//! `--rank r --of R --out OUT` writes rank `r`'s share into OUT; without
//! `--rank`, every rank's into `OUT/rank-{r}-of-{R}`. Each share is a
//! checkpoint directory whose tables hold the rank's `head_dim / R`
//! columns of every row (the dense weights are copied whole), written with
//! bounded memory (8 MiB of rows at a time) under a progress bar; each
//! file appears complete or not at all, a rerun after an interruption
//! resumes where it stopped, and the share's manifest is written last,
//! once the share opened as the rank's checkpoint. A split that does not
//! divide `head_dim`, or cuts a 32-value FP8 scale block, is refused
//! before anything is written, naming the numbers. `run --tp-ranks` runs
//! the shares.

use std::path::PathBuf;

use clap::Args;
use metrale_checkpoint::CheckpointError;
use metrale_checkpoint::tensor_parallel::{rank_dir_name, write_rank};
use metrale_model_layers::layers::ple::TensorParallel;

use super::common::{byte_bar, bytes};
use super::{CmdError, failure, input};

/// Arguments of `table shard`.
#[derive(Args, Debug)]
pub struct ShardArgs {
    /// The checkpoint directory to split.
    pub src: PathBuf,
    /// The rank to write (0-based); every rank when left out.
    #[arg(long)]
    pub rank: Option<usize>,
    /// The number of tensor-parallel ranks.
    #[arg(long, value_name = "R")]
    pub of: usize,
    /// Where to write: the rank's directory with --rank, else the
    /// directory that gets one `rank-{r}-of-{R}` directory per rank.
    #[arg(long)]
    pub out: PathBuf,
}

/// Run `table shard`.
pub fn run(a: ShardArgs) -> Result<(), CmdError> {
    if a.of == 0 {
        return Err(input(anyhow::anyhow!(
            "--of must be a positive number of ranks"
        )));
    }
    let targets: Vec<(usize, PathBuf)> = match a.rank {
        Some(r) => vec![(r, a.out.clone())],
        None => (0..a.of)
            .map(|r| (r, a.out.join(rank_dir_name(r, a.of))))
            .collect(),
    };
    for (r, out) in targets {
        let tp = TensorParallel::new(r, a.of).map_err(input)?;
        let pb = byte_bar(0, &format!("rank {r}/{}", a.of));
        let rep = write_rank(&a.src, tp, &out, &mut |done, total| {
            pb.set_length(total);
            pb.set_position(done);
        });
        pb.finish_and_clear();
        let rep = rep.map_err(|e| match e {
            CheckpointError::Io { .. } | CheckpointError::Storage { .. } => failure(e),
            e => input(e),
        })?;
        let state = if rep.complete {
            "already complete".to_string()
        } else {
            format!(
                "{} files written, {} resumed from an earlier run",
                rep.written, rep.resumed
            )
        };
        println!(
            "rank {r} of {} -> {}: {state}; tables {} of the source's {}, files {}; validation OK",
            a.of,
            out.display(),
            bytes(rep.table_bytes),
            bytes(rep.source_table_bytes),
            bytes(rep.file_bytes)
        );
    }
    Ok(())
}
