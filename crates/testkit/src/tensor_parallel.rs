//! Tensor-parallel ranks in one process: an in-process all-reduce
//! ([`InProcessGroup`]: threads meeting at a barrier) behind the layer's
//! [`Reduce`] hook, and the tiny models' sites and engines opened for one
//! rank (each rank's table holds its column slice of the rows the
//! unsharded model reads, docs/SPEC.md §5, "Tensor-parallel shards").
//!
//! Invariants: every rank receives the same sum, added in rank order
//! (rank 0 first), so the ranks' outputs agree bit for bit; a rank that
//! waits more than [`InProcessGroup::TIMEOUT`] for the others gets an
//! error instead of hanging the test; the group is reusable call after
//! call (generations), and calls must come in the same order and lengths
//! on every rank, as a collective's.

use std::sync::{Arc, Condvar, Mutex, PoisonError};
use std::time::Duration;

use anyhow::Result;
use metrale_engine::ple_site::PleSite;
use metrale_engine::{CarrySite, Engine, EngineConfig};
use metrale_gpu_runtime::gpu::{DevicePtr, GpuBackend, StreamId};
use metrale_model_layers::layers::ple::{PleLayer, Reduce, ReduceError, Shard, TensorParallel};
use metrale_storage::resident::ResidentTable;
use metrale_storage::table::RowDType;

use crate::tiny::{TinySpec, tiny_weights};

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

/// `ranks` in-process ranks summing their buffers.
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

    /// Give `part` for `rank`, wait for every rank's, and return the sum
    /// added in rank order.
    fn sum(&self, rank: usize, part: Vec<f32>) -> Result<Arc<Vec<f32>>, ReduceError> {
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
            return Err(format!("rank {rank} waited too long for the last sum to be taken").into());
        }
        if m.parts[rank].is_some() {
            return Err(format!("rank {rank} gave two parts to one all-reduce").into());
        }
        if let Some(other) = m.parts.iter().flatten().next()
            && other.len() != part.len()
        {
            return Err(format!(
                "rank {rank} reduces {} values, another rank {}",
                part.len(),
                other.len()
            )
            .into());
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
                return Err(format!(
                    "rank {rank} of {} waited {:?} for the other ranks' parts",
                    self.ranks,
                    Self::TIMEOUT
                )
                .into());
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
        let mut bytes = vec![0u8; len * 4];
        gpu.copy_d2h_on_stream(buf, &mut bytes, stream)?;
        let part = bytes
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes(b.try_into().expect("4 bytes")))
            .collect();
        let sum = self.group.sum(self.rank, part)?;
        let out: Vec<u8> = sum.iter().flat_map(|v| v.to_le_bytes()).collect();
        gpu.copy_h2d_async(&out, buf, stream)?;
        Ok(())
    }
}

/// Site `site` of a tiny Qwen4-Exp model (as [`crate::tiny::tiny_site`])
/// opened for `shard`: its table the rank's column slice of the tiny
/// table's rows.
pub fn tiny_site_shard(
    gpu: &Arc<dyn GpuBackend>,
    spec: &TinySpec,
    site: usize,
    seed: u64,
    shard: Shard,
) -> Result<PleSite> {
    let (site_spec, weights, table) = tiny_weights(spec, site, seed);
    let bytes: Vec<u8> = table.iter().flat_map(|b| b.to_le_bytes()).collect();
    let rows = shard.tp.shard_rows(&bytes, spec.head_dim, RowDType::Bf16)?;
    let width = spec.head_dim / shard.tp.ranks();
    let table = Arc::new(ResidentTable::from_rows(
        gpu.clone(),
        &rows,
        width,
        RowDType::Bf16,
    )?);
    let layer = PleLayer::new_sharded(
        &site_spec,
        weights,
        table,
        spec.max_tokens,
        gpu.as_ref(),
        shard,
    )?;
    Ok(PleSite::new(layer))
}

/// An engine over `sites` sites built by `site` (freeing those built
/// when one fails).
pub fn engine_of(
    gpu: &Arc<dyn GpuBackend>,
    sites: usize,
    cfg: EngineConfig,
    mut site: impl FnMut(usize) -> Result<PleSite>,
) -> Result<Engine<PleSite>> {
    let mut built = Vec::with_capacity(sites);
    for i in 0..sites {
        match site(i) {
            Ok(s) => built.push(s),
            Err(e) => {
                for mut s in built {
                    let _ = CarrySite::free(&mut s, gpu.as_ref());
                }
                return Err(e);
            }
        }
    }
    Ok(Engine::new(gpu.clone(), built, cfg)?)
}

/// Rank `rank` of `ranks` with its end of `group`.
pub fn shard_of(group: &[Arc<dyn Reduce>], rank: usize) -> Shard {
    let tp = TensorParallel::new(rank, group.len()).expect("rank below the group's size");
    Shard::new(tp, group[rank].clone())
}
