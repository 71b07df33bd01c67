//! Tensor-parallel ranks in one process for the tests: the tiny models'
//! sites and engines opened for one rank (each rank's table holds its
//! column slice of the rows the unsharded model reads, docs/SPEC.md §5,
//! "Tensor-parallel shards"), reducing through the layer crate's
//! [`metrale_model_layers::layers::ple::InProcessGroup`].

use std::sync::Arc;

use anyhow::Result;
use metrale_engine::ple_site::PleSite;
use metrale_engine::{CarrySite, Engine, EngineConfig};
use metrale_gpu_runtime::gpu::GpuBackend;
use metrale_model_layers::layers::ple::{PleLayer, Reduce, Shard, TensorParallel};
use metrale_storage::resident::ResidentTable;
use metrale_storage::table::RowDType;

use crate::tiny::{TinySpec, tiny_weights};

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
