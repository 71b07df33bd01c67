//! Tiny real PLE models: random weights, a small device-resident BF16
//! table (a [`ResidentTable`] of rows in memory), and the engine over them.
//!
//! Everything here is deterministic in its seed. The hash constants follow
//! docs/SPEC.md §4 (Constant derivation): the production
//! `derive_multipliers` for a unigram vocabulary of 1000, seed 1234, with
//! small prime head sizes so the table is a few hundred rows.

use std::path::Path;
use std::sync::Arc;

use anyhow::Result;
use metrale_checkpoint::names::{SiteNames, table_shard};
use metrale_engine::ple_site::PleSite;
use metrale_engine::{CarrySite, Engine, EngineConfig};
use metrale_gpu_runtime::gpu::GpuBackend;
use metrale_model_layers::layers::ple::ids::{PleIdDims, derive_multipliers, is_prime, splitmix64};
use metrale_model_layers::layers::ple::{PleLayer, PleWeights, SiteSpec};
use metrale_storage::dtype::f32_to_bf16;
use metrale_storage::layout::TableFiles;
use metrale_storage::resident::ResidentTable;

use crate::shards::write_bf16_shards;

/// The shape of a tiny PLE site.
#[derive(Clone, Debug)]
pub struct TinySpec {
    /// H.
    pub hidden: usize,
    /// hc.
    pub hc_mult: usize,
    /// Heads per n-gram order (N is 3, so there are `2 * heads_per_ngram`
    /// heads).
    pub heads_per_ngram: usize,
    /// Values per table row.
    pub head_dim: usize,
    /// Conv kernel size.
    pub kernel: usize,
    /// Conv dilation (N in the real model).
    pub dilation: usize,
    /// Most tokens per forward, and the largest decode batch.
    pub max_tokens: usize,
    /// The EOS token id.
    pub eos: u32,
}

impl Default for TinySpec {
    fn default() -> Self {
        TinySpec {
            hidden: 32,
            hc_mult: 2,
            heads_per_ngram: 2,
            head_dim: 16,
            kernel: 4,
            dilation: 3,
            max_tokens: 64,
            eos: 0,
        }
    }
}

/// The hash constants of site `site` (N = 3, `k` heads per order), derived
/// as docs/SPEC.md §4 (Constant derivation) does for a unigram vocabulary
/// of 1000, seed 1234, with head sizes the primes above 60 (so the table
/// has a few hundred rows).
pub fn tiny_dims(site: usize, k: usize, eos: u32) -> PleIdDims {
    let n = 3usize;
    let multipliers =
        derive_multipliers(1000, n, 1234, site).expect("a vocabulary of 1000 derives");
    let heads = (n - 1) * k;
    let sizes: Vec<u64> = (61u64..)
        .filter(|&p| is_prime(p))
        .skip(site * heads)
        .take(heads)
        .collect();
    let mut offsets = Vec::with_capacity(heads);
    let mut at = 0;
    for s in &sizes {
        offsets.push(at);
        at += s;
    }
    PleIdDims {
        ngram_size: n,
        heads_per_ngram: k,
        multipliers,
        head_vocab_sizes: sizes,
        head_offsets: offsets,
        eos_token_id: eos,
        family: Default::default(),
    }
}

/// Site `site` of a tiny model: its spec, random BF16 projections, random
/// norm and conv weights, and the table rows as BF16 bits, all from `seed`.
pub fn tiny_weights(spec: &TinySpec, site: usize, seed: u64) -> (SiteSpec, PleWeights, Vec<u16>) {
    let dims = tiny_dims(site, spec.heads_per_ngram, spec.eos);
    let e = dims.ngram_heads() * spec.head_dim;
    let c = spec.hidden * spec.hc_mult;
    let rows = dims.head_vocab_sizes.iter().sum::<u64>() as usize;
    // Weights follow an iterated splitmix64 (each output is the next state),
    // which fixes the tiny models' weights for a seed.
    let mut state = seed ^ (site as u64).wrapping_mul(0xA076_1D64_78BD_642F);
    let mut unit = move || {
        state = splitmix64(state);
        ((state >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    };
    let key_proj = (0..c * e).map(|_| f32_to_bf16(unit() * 0.25)).collect();
    let value_proj = (0..spec.hidden * e)
        .map(|_| f32_to_bf16(unit() * 0.25))
        .collect();
    let table: Vec<u16> = (0..rows * spec.head_dim)
        .map(|_| f32_to_bf16(unit()))
        .collect();
    let weights = PleWeights {
        key_proj,
        value_proj,
        norm_key: (0..c).map(|_| unit() * 0.2).collect(),
        norm_query: (0..c).map(|_| unit() * 0.2).collect(),
        norm_conv: (0..c).map(|_| unit() * 0.2).collect(),
        conv1d: (0..c * spec.kernel).map(|_| unit() * 0.6).collect(),
        key_bias: Vec::new(),
        value_bias: Vec::new(),
    };
    let site_spec = SiteSpec::new(
        dims,
        spec.head_dim,
        spec.hidden,
        spec.hc_mult,
        spec.kernel,
        spec.dilation,
    );
    (site_spec, weights, table)
}

/// Site `site` of a tiny model over its rows in a [`ResidentTable`].
pub fn tiny_site(
    gpu: &Arc<dyn GpuBackend>,
    spec: &TinySpec,
    site: usize,
    seed: u64,
) -> Result<PleSite> {
    let (site_spec, weights, table) = tiny_weights(spec, site, seed);
    let table = Arc::new(ResidentTable::from_bf16(
        gpu.clone(),
        &table,
        spec.head_dim,
    )?);
    let layer = PleLayer::new(&site_spec, weights, table, spec.max_tokens, gpu.as_ref())?;
    Ok(PleSite::new(layer))
}

/// Site `site` of a tiny model with its table on disk: one BF16
/// safetensors shard `site{site}-0.safetensors` under `dir` (see
/// [`write_bf16_shards`]), written when absent (so several engines can
/// share the files). Its spec, files and weights.
pub fn tiny_site_files(
    dir: &Path,
    spec: &TinySpec,
    site: usize,
    seed: u64,
) -> Result<(SiteSpec, TableFiles, PleWeights)> {
    let (site_spec, weights, table) = tiny_weights(spec, site, seed);
    let stem = format!("site{site}");
    let first = dir.join(format!("{stem}-0.safetensors"));
    let files = if first.exists() {
        let rows = (table.len() / spec.head_dim) as u64;
        let weight = SiteNames::new(site).shard_weight(0);
        TableFiles::open(&[table_shard(first, &weight)], Some(rows))?
    } else {
        write_bf16_shards(dir, &stem, site, &table, spec.head_dim, 1)?
    };
    Ok((site_spec, files, weights))
}

/// An engine over `sites` tiny sites (site `i` hashes with site index `i`'s
/// constants).
pub fn tiny_engine(
    gpu: &Arc<dyn GpuBackend>,
    spec: &TinySpec,
    sites: usize,
    seed: u64,
    cfg: EngineConfig,
) -> Result<Engine<PleSite>> {
    let mut built = Vec::with_capacity(sites);
    for i in 0..sites {
        match tiny_site(gpu, spec, i, seed) {
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tiny_dims_are_odd_multipliers_over_prime_heads() {
        let d = tiny_dims(1, 2, 0);
        assert!(d.multipliers.iter().all(|m| m % 2 == 1));
        assert_eq!(d.head_vocab_sizes, vec![79, 83, 89, 97]);
        assert_eq!(d.head_offsets, vec![0, 79, 162, 251]);
    }
}
