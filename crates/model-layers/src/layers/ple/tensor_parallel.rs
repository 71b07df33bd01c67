//! Tensor-parallel shards of a PLE site (docs/SPEC.md §5, "Tensor-parallel
//! shards"): the column split of the n-gram table and the projections, and
//! the all-reduce hook that completes a rank's partial projection, and an
//! in-process group of ranks ([`InProcessGroup`]) that sums through host
//! memory.
//!
//! A site opened for rank `r` of `R` ([`TensorParallel`]) holds columns
//! `[r*d/R, (r+1)*d/R)` of every table row (`d = head_dim`; transformers'
//! `embedding_colwise` plan for the n-gram embedding) and the matching
//! input columns of `key_proj` and `value_proj` (for every head `h`,
//! columns `h*d + r*d/R ..`). Its projection is then a partial sum; the
//! layer hands the `[T, O]` partial projection to the site's [`Reduce`]
//! right after the projection and before the bias, the gate, the conv or
//! the mean, and everything after runs on every rank identically (each
//! rank holds the whole carry).
//!
//! Invariants:
//! - the split is refused, naming the numbers, unless `R` divides `d`,
//!   and for block-scaled FP8 rows unless `d/R` is a multiple of the
//!   32-value scale block (a slice never cuts a block);
//! - [`TensorParallel::shard_rows`] and [`TensorParallel::shard_weights`]
//!   are pure column selections: the `R` shards hold every value of the
//!   unsharded table and weights exactly once;
//! - a single rank (`R = 1`) is no split at all: the layer runs the
//!   unsharded path, with no reduce call.

use std::ops::Range;
use std::sync::{Arc, Condvar, Mutex, PoisonError};
use std::time::Duration;

use metrale_gpu_runtime::gpu::{DevicePtr, GpuBackend, StreamId};
use metrale_storage::dtype::FP8_BLOCK;
use metrale_storage::table::RowDType;
use thiserror::Error;

use super::layer::PleWeights;
use super::spec::SiteSpec;

/// Which share of a site this process runs: rank `rank` of `ranks`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct TensorParallel {
    rank: usize,
    ranks: usize,
}

impl Default for TensorParallel {
    fn default() -> Self {
        Self::SINGLE
    }
}

/// Why a tensor-parallel split was refused.
#[derive(Debug, Error, Clone, PartialEq, Eq)]
pub enum ShardError {
    /// No ranks, or a rank not below the number of ranks.
    #[error(
        "tensor-parallel rank {rank} of {ranks} ranks: the rank must be below a positive number of ranks"
    )]
    Rank {
        /// The rank given.
        rank: usize,
        /// The number of ranks given.
        ranks: usize,
    },
    /// The rows do not divide among the ranks.
    #[error(
        "tensor-parallel column split refused: head_dim {head_dim} is not divisible by {ranks} ranks \
         (head_dim % ranks = {})",
        head_dim % ranks
    )]
    Indivisible {
        /// Values per table row.
        head_dim: usize,
        /// The number of ranks.
        ranks: usize,
    },
    /// A rank's slice of a block-scaled FP8 row would cut a scale block.
    #[error(
        "tensor-parallel column split refused: block-scaled FP8 rows of {head_dim} values over {ranks} \
         ranks give {width} values a rank, not a multiple of the {block}-value scale block"
    )]
    ScaleBlock {
        /// Values per table row.
        head_dim: usize,
        /// The number of ranks.
        ranks: usize,
        /// Values per rank.
        width: usize,
        /// The scale block.
        block: usize,
    },
    /// Table bytes that are not whole rows.
    #[error("{found} table bytes are not whole rows of {row_bytes} bytes")]
    Rows {
        /// Bytes given.
        found: usize,
        /// Bytes per row.
        row_bytes: usize,
    },
    /// A weight tensor of the wrong size (check the unsharded weights first).
    #[error("{tensor} has {found} values, not whole rows of E = {emb}")]
    Weights {
        /// The tensor.
        tensor: &'static str,
        /// Values given.
        found: usize,
        /// The unsharded input width.
        emb: usize,
    },
}

impl TensorParallel {
    /// One rank: no split.
    pub const SINGLE: TensorParallel = TensorParallel { rank: 0, ranks: 1 };

    /// Rank `rank` of `ranks`; refused unless `rank < ranks`.
    pub fn new(rank: usize, ranks: usize) -> Result<Self, ShardError> {
        if rank >= ranks {
            return Err(ShardError::Rank { rank, ranks });
        }
        Ok(TensorParallel { rank, ranks })
    }
    /// This rank.
    pub fn rank(&self) -> usize {
        self.rank
    }
    /// The number of ranks.
    pub fn ranks(&self) -> usize {
        self.ranks
    }
    /// Whether there is only one rank (no split).
    pub fn is_single(&self) -> bool {
        self.ranks == 1
    }

    /// This rank's columns of a row of `head_dim` values in `dtype`,
    /// refused where the split does not divide (see [`ShardError`]).
    pub fn columns(&self, head_dim: usize, dtype: RowDType) -> Result<Range<usize>, ShardError> {
        let ranks = self.ranks;
        if !head_dim.is_multiple_of(ranks) {
            return Err(ShardError::Indivisible { head_dim, ranks });
        }
        let width = head_dim / ranks;
        if dtype == RowDType::Fp8E4M3Block32 && !width.is_multiple_of(FP8_BLOCK) {
            return Err(ShardError::ScaleBlock {
                head_dim,
                ranks,
                width,
                block: FP8_BLOCK,
            });
        }
        Ok(self.rank * width..(self.rank + 1) * width)
    }

    /// This rank's share of `rows` (whole rows of `head_dim` values in
    /// `dtype`, as the table stores them): each row's columns, and for
    /// block-scaled FP8 the scale bytes of those columns' blocks, so the
    /// result is a table of rows of `head_dim / ranks` values in `dtype`.
    /// The per-row scale of [`RowDType::Fp8E4M3`] lives apart and applies
    /// to every slice unchanged.
    pub fn shard_rows(
        &self,
        rows: &[u8],
        head_dim: usize,
        dtype: RowDType,
    ) -> Result<Vec<u8>, ShardError> {
        let cols = self.columns(head_dim, dtype)?;
        let row_bytes = dtype.row_bytes(head_dim);
        if row_bytes == 0 || !rows.len().is_multiple_of(row_bytes) {
            return Err(ShardError::Rows {
                found: rows.len(),
                row_bytes,
            });
        }
        let width = cols.len();
        let mut out = Vec::with_capacity(rows.len() / row_bytes * dtype.row_bytes(width));
        let eb = dtype.elem_bytes();
        for row in rows.chunks_exact(row_bytes) {
            out.extend_from_slice(&row[cols.start * eb..cols.end * eb]);
            if dtype == RowDType::Fp8E4M3Block32 {
                let scales = &row[head_dim..];
                out.extend_from_slice(&scales[cols.start / FP8_BLOCK..cols.end / FP8_BLOCK]);
            }
        }
        Ok(out)
    }

    /// This rank's input columns of the projections of `weights`
    /// (unsharded, as checked against `spec`): for every output row and
    /// every head `h`, columns `h*d + columns(d)`. Every other tensor is
    /// kept whole (the norms, conv and biases apply after the reduce).
    pub fn shard_weights(
        &self,
        spec: &SiteSpec,
        weights: &PleWeights,
        dtype: RowDType,
    ) -> Result<PleWeights, ShardError> {
        let d = spec.head_dim;
        let cols = self.columns(d, dtype)?;
        let e = spec.emb_dim();
        let pick = |tensor: &'static str, w: &[u16]| -> Result<Vec<u16>, ShardError> {
            if !w.len().is_multiple_of(e) {
                return Err(ShardError::Weights {
                    tensor,
                    found: w.len(),
                    emb: e,
                });
            }
            let mut out = Vec::with_capacity(w.len() / self.ranks);
            for row in w.chunks_exact(e) {
                for head in row.chunks_exact(d) {
                    out.extend_from_slice(&head[cols.clone()]);
                }
            }
            Ok(out)
        };
        Ok(PleWeights {
            key_proj: pick("key_proj", &weights.key_proj)?,
            value_proj: pick("value_proj", &weights.value_proj)?,
            ..weights.clone()
        })
    }
}

/// The error a [`Reduce`] reports (the collective's own, boxed).
pub type ReduceError = Box<dyn std::error::Error + Send + Sync>;

/// The all-reduce that completes a rank's partial projection: the caller's
/// collective (the engine's own in production, an in-process sum in the
/// tests). The layer calls it once per projection, on every rank in the
/// same order with the same length.
pub trait Reduce: Send + Sync {
    /// Replace the `len` f32 values at `buf` (device memory of `gpu`) with
    /// their sum over every rank, in `stream` order: after every earlier
    /// operation of `stream` and before every later one. Every rank must
    /// receive the same bits (sum in one fixed order), since each runs the
    /// gate and the conv on the result.
    fn all_reduce_sum(
        &self,
        gpu: &dyn GpuBackend,
        buf: DevicePtr,
        len: usize,
        stream: StreamId,
    ) -> Result<(), ReduceError>;

    /// Whether [`Self::all_reduce_sum`] may be recorded in a captured graph
    /// and replayed (a collective queued on the stream, reading and
    /// writing `buf` at replay). The default says no: a sharded layer then
    /// refuses capture, and an engine runs its decode eagerly.
    fn capturable(&self) -> bool {
        false
    }
}

/// A rank's split and the collective it reduces with, as a layer holds it.
#[derive(Clone)]
pub struct Shard {
    /// Which share.
    pub tp: TensorParallel,
    /// The collective.
    pub reduce: Arc<dyn Reduce>,
}

impl Shard {
    /// Rank `tp` reducing through `reduce`.
    pub fn new(tp: TensorParallel, reduce: Arc<dyn Reduce>) -> Self {
        Shard { tp, reduce }
    }
}

impl std::fmt::Debug for Shard {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Shard").field("tp", &self.tp).finish()
    }
}

/// Why an [`InProcessGroup`] all-reduce failed.
#[derive(Debug, Error, Clone, PartialEq, Eq)]
pub enum GroupError {
    /// A rank waited past [`InProcessGroup::TIMEOUT`] for the others (a
    /// rank stopped calling, or the ranks' calls diverged).
    #[error("tensor-parallel rank {rank} of {ranks} waited {waited:?} for the other ranks")]
    Timeout {
        /// The waiting rank.
        rank: usize,
        /// The group's size.
        ranks: usize,
        /// How long it waited.
        waited: Duration,
    },
    /// One rank gave two parts to one all-reduce.
    #[error("tensor-parallel rank {rank} gave two parts to one all-reduce")]
    Twice {
        /// The rank.
        rank: usize,
    },
    /// The ranks reduce different lengths (their calls diverged).
    #[error("tensor-parallel rank {rank} reduces {len} values, another rank {other}")]
    Length {
        /// The rank.
        rank: usize,
        /// Its length.
        len: usize,
        /// Another rank's.
        other: usize,
    },
}

/// State shared by the ranks of one group.
#[derive(Default)]
struct Meeting {
    /// Each rank's contribution to the current call.
    parts: Vec<Option<Vec<f32>>>,
    /// Ranks that have taken the current sum.
    taken: usize,
    /// The sum of the current call, once every rank has given its part.
    sum: Option<Arc<Vec<f32>>>,
    /// Completed calls.
    generation: u64,
}

/// Tensor-parallel ranks in one process (one thread each): an all-reduce
/// that sums the ranks' buffers through host memory, the collective of
/// `run --tp-ranks`, Python's in-process ranks and the tests.
///
/// Every rank receives the same sum, added in rank order (rank 0 first),
/// so the ranks' outputs agree bit for bit; a rank that waits more than
/// [`InProcessGroup::TIMEOUT`] for the others gets [`GroupError::Timeout`]
/// instead of hanging; the group is reusable call after call
/// (generations), and calls must come in the same order and lengths on
/// every rank, as a collective's.
pub struct InProcessGroup {
    ranks: usize,
    meeting: Mutex<Meeting>,
    cv: Condvar,
}

impl InProcessGroup {
    /// How long a rank waits for the others.
    pub const TIMEOUT: Duration = Duration::from_secs(120);

    /// One [`Reduce`] per rank of a new group of `ranks`.
    pub fn ranks(ranks: usize) -> Vec<Arc<dyn Reduce>> {
        let group = Arc::new(InProcessGroup {
            ranks,
            meeting: Mutex::new(Meeting {
                parts: vec![None; ranks],
                ..Meeting::default()
            }),
            cv: Condvar::new(),
        });
        (0..ranks)
            .map(|rank| {
                Arc::new(RankReduce {
                    group: group.clone(),
                    rank,
                }) as Arc<dyn Reduce>
            })
            .collect()
    }

    /// One [`Shard`] per rank of a new group of `ranks` (`ranks > 0`).
    pub fn shards(ranks: usize) -> Result<Vec<Shard>, ShardError> {
        Self::ranks(ranks)
            .into_iter()
            .enumerate()
            .map(|(r, reduce)| Ok(Shard::new(TensorParallel::new(r, ranks)?, reduce)))
            .collect()
    }

    /// Give `part` for `rank`, wait for every rank's, and return the sum
    /// added in rank order.
    fn sum(&self, rank: usize, part: Vec<f32>) -> Result<Arc<Vec<f32>>, GroupError> {
        let timeout = GroupError::Timeout {
            rank,
            ranks: self.ranks,
            waited: Self::TIMEOUT,
        };
        let m = self.meeting.lock().unwrap_or_else(PoisonError::into_inner);
        // A rank that comes back before the last call's sum was taken by
        // everyone waits for that first.
        let gen0 = m.generation;
        let (mut m, t) = self
            .cv
            .wait_timeout_while(m, Self::TIMEOUT, |m| {
                m.sum.is_some() && m.generation == gen0
            })
            .unwrap_or_else(PoisonError::into_inner);
        if t.timed_out() {
            return Err(timeout);
        }
        if m.parts[rank].is_some() {
            return Err(GroupError::Twice { rank });
        }
        if let Some(other) = m.parts.iter().flatten().next()
            && other.len() != part.len()
        {
            return Err(GroupError::Length {
                rank,
                len: part.len(),
                other: other.len(),
            });
        }
        m.parts[rank] = Some(part);
        if m.parts.iter().all(Option::is_some) {
            let parts: Vec<Vec<f32>> = m.parts.iter_mut().map(|p| p.take().unwrap()).collect();
            let mut sum = parts[0].clone();
            for p in &parts[1..] {
                for (s, v) in sum.iter_mut().zip(p) {
                    *s += v;
                }
            }
            m.sum = Some(Arc::new(sum));
            m.taken = 0;
            self.cv.notify_all();
        } else {
            let (g, t) = self
                .cv
                .wait_timeout_while(m, Self::TIMEOUT, |m| m.sum.is_none())
                .unwrap_or_else(PoisonError::into_inner);
            m = g;
            if t.timed_out() {
                return Err(timeout);
            }
        }
        let sum = m.sum.clone().expect("set above or awaited");
        m.taken += 1;
        if m.taken == self.ranks {
            m.sum = None;
            m.generation += 1;
            self.cv.notify_all();
        }
        Ok(sum)
    }
}

/// One rank's end of an [`InProcessGroup`].
struct RankReduce {
    group: Arc<InProcessGroup>,
    rank: usize,
}

impl Reduce for RankReduce {
    fn all_reduce_sum(
        &self,
        gpu: &dyn GpuBackend,
        buf: DevicePtr,
        len: usize,
        stream: StreamId,
    ) -> Result<(), ReduceError> {
        let mut part = vec![0f32; len];
        gpu.copy_d2h_on_stream(buf, super::highway::f32_bytes_mut(&mut part), stream)?;
        let sum = self.group.sum(self.rank, part)?;
        gpu.copy_h2d_async(super::highway::f32_bytes(&sum), buf, stream)?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use metrale_storage::dtype::quantize_fp8_block_row;

    #[test]
    fn ranks_must_cover_the_rank() {
        assert!(TensorParallel::new(0, 1).unwrap().is_single());
        assert_eq!(
            TensorParallel::new(2, 2).unwrap_err(),
            ShardError::Rank { rank: 2, ranks: 2 }
        );
        assert!(TensorParallel::new(0, 0).is_err());
    }

    #[test]
    fn indivisible_and_block_cutting_splits_are_named() {
        let tp = TensorParallel::new(1, 4).unwrap();
        let e = tp.columns(18, RowDType::Bf16).unwrap_err();
        assert_eq!(
            e,
            ShardError::Indivisible {
                head_dim: 18,
                ranks: 4
            }
        );
        let msg = e.to_string();
        assert!(msg.contains("18") && msg.contains("4 ranks"), "{msg}");
        let e = tp.columns(64, RowDType::Fp8E4M3Block32).unwrap_err();
        assert!(e.to_string().contains("16 values a rank"), "{e}");
        assert_eq!(tp.columns(128, RowDType::Fp8E4M3Block32).unwrap(), 32..64);
        assert_eq!(tp.columns(12, RowDType::Bf16).unwrap(), 3..6);
    }

    #[test]
    fn shards_of_rows_hold_every_value_once() {
        let rows: Vec<u8> = (0..3 * 8 * 2).map(|i| i as u8).collect();
        let mut joined = vec![Vec::new(); 3];
        for r in 0..4 {
            let s = TensorParallel::new(r, 4)
                .unwrap()
                .shard_rows(&rows, 8, RowDType::Bf16)
                .unwrap();
            assert_eq!(s.len(), rows.len() / 4);
            for (row, part) in s.chunks_exact(4).enumerate() {
                joined[row].extend_from_slice(part);
            }
        }
        assert_eq!(joined.concat(), rows);
    }

    #[test]
    fn block_scaled_rows_keep_their_blocks_scales() {
        let vals: Vec<f32> = (0..64)
            .map(|i| (i as f32 - 20.0) * (1 + i / 32) as f32)
            .collect();
        let mut row = Vec::new();
        quantize_fp8_block_row(&vals, &mut row);
        let s = TensorParallel::new(1, 2)
            .unwrap()
            .shard_rows(&row, 64, RowDType::Fp8E4M3Block32)
            .unwrap();
        let mut expect = row[32..64].to_vec();
        expect.push(row[65]);
        assert_eq!(s, expect);
    }
}
