//! The pipelined gather: where resolving a step's rows would wait for
//! reads (a row cache missing some), they are resolved one head group at a
//! time, and each group's gather and its share of the projection are
//! queued before the next group is resolved, so the backend computes on
//! the rows it has while the rest are read. A step plan orders its reads
//! the same way ([`super::StepPlan::reads`]), so a prefetch by plan brings
//! the first group in first.
//!
//! Invariants: the projection over consecutive step ranges, each continuing
//! the sums of the last, is the same FMA chain as one projection
//! (`kernels::gemm`), so a pipelined step is bit-identical to a plain one;
//! group boundaries fall on even steps; every part's lease is released with
//! an event recorded right after the gather that read it, as in the plain
//! gather; nothing is written to the highway or to a carry here, so a step
//! that fails half-way leaves both as they were.

use metrale_gpu_runtime::gpu::{DevicePtr, GpuBackend, StreamId};
use metrale_storage::table::RowRef;

use super::error::{DeviceContext, table_err};
use super::{PleLayer, Result};
use crate::layers::ple::kernels::args::{GatherRunsArgs, ProjectRangeArgs};
use crate::layers::ple::kernels::gemm::CUT_STEPS;
use crate::layers::ple::staging;

/// Head groups a pipelined step cuts each token's rows into: more groups
/// start the compute sooner, but each adds a resolve, a gather launch and a
/// pass over the projection's outputs.
const PIPELINE_GROUPS: usize = 4;

/// One head group: its first head and its number of heads.
pub(super) type Group = (usize, usize);

impl PleLayer {
    /// The head groups of a pipelined step over `ids`, or `None` where the
    /// step gains nothing from one (the table holds every row loaded, so
    /// no resolve waits) or cannot be cut (one head, a group boundary on an
    /// odd step, a resolve limit below one token's rows).
    pub(super) fn pipeline_groups(&self, ids: &[u64]) -> Option<Vec<Group>> {
        let per = self.pipeline_heads()?;
        self.table.would_wait(ids).then(|| {
            let heads = self.dims.ngram_heads();
            (0..heads)
                .step_by(per)
                .map(|h0| (h0, per.min(heads - h0)))
                .collect()
        })
    }

    /// Heads per group of a pipelined step, `None` where the geometry or
    /// the table's resolve limit cannot cut one (one head, a group
    /// boundary on an odd step, a resolve limit below one token's rows).
    pub(super) fn pipeline_heads(&self) -> Option<usize> {
        let heads = self.dims.ngram_heads();
        let per = heads.div_ceil(PIPELINE_GROUPS.min(heads).max(1));
        let usable = heads >= 2
            && per < heads
            && self.table.max_resolve() >= heads
            && (per * self.row_dim).is_multiple_of(2);
        usable.then_some(per)
    }

    /// The ids of head group `(h0, run)` of every token of `ids`
    /// (token-major, `ngram_heads` a token), token by token.
    fn group_ids(&self, ids: &[u64], (h0, run): Group) -> Vec<u64> {
        let heads = self.dims.ngram_heads();
        ids.chunks_exact(heads)
            .flat_map(|t| t[h0..h0 + run].iter().copied())
            .collect()
    }

    /// Resolve, gather and project the rows of `ids` (`tokens` tokens,
    /// token-major) group by group: for each group, its rows in parts of
    /// at most `max_resolve()` distinct ids (whole tokens), each part's
    /// refs uploaded at `refs_at` (room for `tokens * ngram_heads` refs)
    /// and gathered into its tokens' `emb` rows, then the projection of
    /// the group's steps over `rows >= tokens` rows of `emb` (rows past
    /// `tokens` were gathered before). Leaves `kv` as the projection
    /// leaves it; the caller queues what follows it.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn gather_project_in_groups(
        &self,
        groups: &[Group],
        ids: &[u64],
        rows: usize,
        refs_at: DevicePtr,
        gpu: &dyn GpuBackend,
        stream: StreamId,
    ) -> Result<()> {
        let heads = self.dims.ngram_heads();
        let hd = self.row_dim;
        let e = heads * hd;
        let o = self.projection_outputs();
        let table = self.table.as_ref();
        let mut used = 0;
        // Steps projected so far. Cuts fall on multiples of `CUT_STEPS`
        // only (a group's last steps wait for the next group), so every
        // CPU path, AMX's included, gives the bits of one uncut call.
        let mut projected = 0;
        for &group in groups {
            let (h0, run) = group;
            let gids = self.group_ids(ids, group);
            let mut refs = vec![RowRef::default(); gids.len()];
            let mut start = 0;
            while start < gids.len() {
                let mut end = staging::part_end(&gids, start, table.max_resolve());
                if end < gids.len() {
                    // Whole tokens, so a part's rows land in runs from its
                    // first token on; a part holds at least one token's
                    // group since `max_resolve() >= heads >= run`.
                    end = start + (end - start) / run * run;
                }
                let lease = table
                    .resolve(&gids[start..end], &mut refs[start..end])
                    .map_err(|err| {
                        table_err(format!(
                            "resolving PLE row ids of heads {h0}..{} of tokens {}..{} (first id {})",
                            h0 + run,
                            start / run,
                            end.div_ceil(run),
                            gids[start]
                        ))(err)
                    })?;
                let at = refs_at.offset((used + start) * staging::REF_BYTES);
                let first_row = start / run * heads + h0;
                let queued = gpu
                    .copy_h2d_async(&staging::refs_bytes(&refs[start..end]), at, stream)
                    .device(|| "uploading PLE row refs".into())
                    .and_then(|()| {
                        self.launch_gather_runs(gpu, at, end - start, first_row, run, stream)
                    });
                // Released even when queueing failed: the event is recorded
                // after whatever did get queued.
                let released = staging::release_at_tail(table, gpu, stream, vec![lease]);
                queued?;
                released?;
                start = end;
            }
            used += gids.len();
            let end = (h0 + run) * hd;
            let to = if end == e {
                e
            } else {
                end / CUT_STEPS * CUT_STEPS
            };
            if to <= projected {
                continue;
            }
            let from = std::mem::replace(&mut projected, to);
            let a = ProjectRangeArgs {
                x: self.bufs.emb,
                w: self.bufs.w_proj,
                y: self.bufs.kv,
                t: rows as u32,
                e: e as u32,
                o: o as u32,
                from: from as u32,
                to: to as u32,
                accumulate: u32::from(from > 0),
            };
            gpu.launch(
                self.kernels.project_range,
                self.kernels.shapes.project(rows, o),
            )
            .args(&a)
            .run(stream)
            .device(|| {
                format!(
                    "launching PLE projection of heads {h0}..{} over {rows} rows",
                    h0 + run
                )
            })?;
        }
        Ok(())
    }

    /// Queue the gather of `n` rows whose refs are at `refs` into `emb`,
    /// in runs of `run` rows a token: ref `i` to emb row `first_row + (i /
    /// run) * ngram_heads + i % run` (in head rows).
    fn launch_gather_runs(
        &self,
        gpu: &dyn GpuBackend,
        refs: DevicePtr,
        n: usize,
        first_row: usize,
        run: usize,
        stream: StreamId,
    ) -> Result<()> {
        let heads = self.dims.ngram_heads();
        let cfg = self.kernels.shapes.gather(n, self.row_dim);
        let a = GatherRunsArgs {
            refs,
            n: n as u32,
            head_dim: self.row_dim as u32,
            dtype: self.dtype_code,
            out: self.bufs.emb.offset(first_row * self.row_dim * 4),
            run: run as u32,
            stride: heads as u32,
        };
        gpu.launch(self.kernels.gather_runs, cfg)
            .args(&a)
            .run(stream)
            .device(|| {
                format!("launching PLE gather of {n} rows in runs of {run} from refs at {refs}")
            })
    }
}
