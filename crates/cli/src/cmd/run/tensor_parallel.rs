//! `run --tp-ranks DIR0,DIR1,..`: the workload over `R` tensor-parallel
//! ranks in this process (docs/SPEC.md §5, "Tensor-parallel shards").
//!
//! Each directory is one rank's share written by `table shard` (rank `r`
//! listed `r`-th, all of one split of one checkpoint). Each rank runs on a
//! thread of its own with its own backend and engine over its share, and
//! the ranks complete their projections through one in-process all-reduce
//! ([`InProcessGroup`], a sum through host memory in rank order), so every
//! rank computes the full output. Every rank runs the same workload, the
//! same calls in the same order (which the collective needs): flags whose
//! effects depend on timing or on other processes (injected faults, remote
//! row servers, a shared carry store) are refused, as are captured decode
//! graphs (the in-process collective cannot be captured). The summary is
//! rank 0's, plus each rank's table bytes and bytes read; the run fails
//! unless every rank produced the same bits for every output row, and
//! `--verify` reruns the ranks over resident tables without caches and
//! demands the same bits. The outputs equal the unsharded checkpoint's to
//! f32 accuracy, not bit for bit (the partial sums round differently).

use std::fmt::Write as _;
use std::path::PathBuf;

use anyhow::{Result, anyhow};
use clap::Args;
use indicatif::ProgressBar;
use metrale_checkpoint::Checkpoint;
use metrale_checkpoint::tensor_parallel::{RankCheckpoint, open_group};
use metrale_engine::server::Request;
use metrale_model_layers::layers::ple::InProcessGroup;
use serde::Serialize;

use super::{PassConfig, PassResult, RunArgs, TableArg, pass};
use crate::cmd::common::bytes;
use crate::cmd::{CmdError, input};

/// The tensor-parallel flags of `run`.
#[derive(Args, Debug, Default)]
pub struct TpArgs {
    /// Run tensor-parallel ranks in this process: one directory a rank,
    /// as `table shard` wrote them, rank 0 first (comma-separated). Every
    /// rank computes its share and the ranks sum their projections, so the
    /// outputs are the whole model's.
    #[arg(
        long,
        value_name = "DIR0,DIR1[,...]",
        value_delimiter = ',',
        conflicts_with = "dir"
    )]
    pub tp_ranks: Vec<PathBuf>,
}

/// What the ranks of a tensor-parallel run did.
#[derive(Serialize)]
pub struct TpSummary {
    /// The number of ranks.
    ranks: usize,
    /// How the tables were split: `"column"`.
    split: &'static str,
    /// Each rank's directory.
    dirs: Vec<String>,
    /// Bytes of table data each rank stores.
    table_bytes: Vec<u64>,
    /// Bytes each rank's tables read in the run.
    bytes_read: Vec<u64>,
    /// Whether every rank produced the same bits for every output row
    /// (always true in a summary that is printed: the run fails otherwise).
    identical_across_ranks: bool,
}

/// The ranks `a` names, opened and checked, with the flags that cannot run
/// over ranks refused; `None` without `--tp-ranks`.
pub(super) fn open(a: &RunArgs) -> Result<Option<Vec<RankCheckpoint>>, CmdError> {
    if a.tp.tp_ranks.is_empty() {
        return Ok(None);
    }
    let refused = [
        (a.fault_percent > 0.0, "--fault-percent"),
        (a.table == TableArg::Remote, "--table remote"),
        (a.carry_store.is_some(), "--carry-store"),
        (a.decode_graphs, "--decode-graphs"),
    ];
    if let Some((_, flag)) = refused.iter().find(|(on, _)| *on) {
        return Err(input(anyhow!(
            "{flag} cannot run with --tp-ranks: every rank must make the same calls in the same \
             order, and the in-process collective cannot be captured"
        )));
    }
    let group = open_group(&a.tp.tp_ranks).map_err(input)?;
    Ok(Some(group))
}

/// Run one pass: unsharded over `ck` without `ranks`, else every rank on a
/// thread of its own (progress shown by rank 0), checking that every rank
/// produced the same output bits; rank 0's result and the ranks' figures.
pub(super) fn pass_all(
    ranks: Option<&[RankCheckpoint]>,
    ck: &Checkpoint,
    plans: &[Request],
    a: &RunArgs,
    pc: &PassConfig,
    bar: &ProgressBar,
) -> Result<(PassResult, Option<TpSummary>)> {
    let Some(ranks) = ranks else {
        return Ok((pass(ck, plans, a, pc, bar, None)?, None));
    };
    let shards = InProcessGroup::shards(ranks.len())?;
    let hidden = ProgressBar::hidden();
    let results: Vec<Result<PassResult>> = std::thread::scope(|s| {
        let handles: Vec<_> = ranks
            .iter()
            .zip(shards)
            .enumerate()
            .map(|(r, (rc, shard))| {
                let bar = if r == 0 { bar } else { &hidden };
                s.spawn(move || pass(&rc.ck, plans, a, pc, bar, Some(&shard)))
            })
            .collect();
        handles
            .into_iter()
            .enumerate()
            .map(|(r, h)| {
                h.join()
                    .unwrap_or_else(|_| Err(anyhow!("tensor-parallel rank {r} panicked")))
            })
            .collect()
    });
    let mut out = Vec::with_capacity(results.len());
    for (r, res) in results.into_iter().enumerate() {
        out.push(res.map_err(|e| e.context(format!("tensor-parallel rank {r}")))?);
    }
    for (r, o) in out.iter().enumerate().skip(1) {
        if let Some((seq, pos)) = first_difference(&o.report.rows, &out[0].report.rows) {
            return Err(anyhow!(
                "tensor-parallel rank {r} computed other bits than rank 0 for sequence {seq}, \
                 position {pos}"
            ));
        }
    }
    let summary = TpSummary {
        ranks: ranks.len(),
        split: "column",
        dirs: ranks
            .iter()
            .map(|r| r.ck.dir.display().to_string())
            .collect(),
        table_bytes: ranks.iter().map(|r| r.ck.table_bytes()).collect(),
        bytes_read: out.iter().map(|o| o.report.table.bytes_read).collect(),
        identical_across_ranks: true,
    };
    let leaked: usize = out.iter().map(|o| o.leaked).sum();
    let mut first = out.swap_remove(0);
    first.leaked = leaked;
    Ok((first, Some(summary)))
}

/// The first (sequence, position) whose output fingerprint differs
/// between `a` and `b`, or is present in one only.
fn first_difference(a: &[Vec<Option<u64>>], b: &[Vec<Option<u64>>]) -> Option<(usize, usize)> {
    if a.len() != b.len() {
        return Some((a.len().min(b.len()), 0));
    }
    a.iter().zip(b).enumerate().find_map(|(s, (x, y))| {
        (0..x.len().max(y.len()))
            .find(|&p| x.get(p) != y.get(p))
            .map(|p| (s, p))
    })
}

/// The summary's tensor-parallel lines.
pub(super) fn render(tp: &TpSummary) -> String {
    let mut o = String::new();
    let _ = writeln!(
        o,
        "  tensor-parallel {} ranks in this process ({} split), outputs bit-identical across ranks",
        tp.ranks, tp.split
    );
    for (r, (t, read)) in tp.table_bytes.iter().zip(&tp.bytes_read).enumerate() {
        let _ = writeln!(
            o,
            "                  rank {r}: {} of table, {} read  ({})",
            bytes(*t),
            bytes(*read),
            tp.dirs[r]
        );
    }
    o
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_first_difference_between_ranks_is_named() {
        let a = vec![vec![None, Some(1)], vec![Some(2)]];
        assert_eq!(first_difference(&a, &a.clone()), None);
        let b = vec![vec![None, Some(1)], vec![Some(3)]];
        assert_eq!(first_difference(&a, &b), Some((1, 0)));
        let c = vec![vec![None, Some(1), Some(5)], vec![Some(2)]];
        assert_eq!(first_difference(&a, &c), Some((0, 2)));
        assert_eq!(first_difference(&a, &a[..1]), Some((1, 0)));
    }
}
