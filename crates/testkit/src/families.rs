//! Tiny real models of each hash family (docs/SPEC.md §11 (Families)):
//! small configs whose constants come from the production derivation,
//! random weights shaped by the site's combination, and engines over them.
//!
//! - [`TinyFamily::EngramConv`], the Engram demo's layer (`w` norms, key
//!   and value biases, the dilated short conv) over BF16 rows;
//! - [`TinyFamily::EngramV41`], DeepSeek-V4.1's (no conv, orders 2..=4)
//!   over FP8 rows with inline UE8M0 block scales;
//! - [`TinyFamily::LongCat`], the mean with the word embedding, one stream,
//!   its sub-tables each a table of its own joined by a
//!   [`ConcatTable`], as a checkpoint serves them.
//!
//! Invariants: everything is deterministic in the seed; token ids below 40
//! (what [`crate::drive::drive`] feeds) are in every family's vocabulary;
//! token 0 is EOS, as in the Qwen4Exp test geometries.

use std::sync::Arc;

use anyhow::Result;
use metrale_engine::ple_site::PleSite;
use metrale_engine::{CarrySite, Engine, EngineConfig};
use metrale_gpu_runtime::gpu::GpuBackend;
use metrale_model_layers::layers::ple::family::ModelFamily;
use metrale_model_layers::layers::ple::family::engram::{EngramKeys, EngramSpec};
use metrale_model_layers::layers::ple::family::longcat::{LongCatKeys, LongCatSpec};
use metrale_model_layers::layers::ple::ids::splitmix64;
use metrale_model_layers::layers::ple::spec::ModelSpec;
use metrale_model_layers::layers::ple::{PleLayer, PleWeights, Shard, SiteSpec};
use metrale_storage::concat::ConcatTable;
use metrale_storage::dtype::{f32_to_bf16, quantize_fp8_block_row};
use metrale_storage::resident::ResidentTable;
use metrale_storage::table::{RowDType, RowTable};

/// A tiny model of one family.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TinyFamily {
    /// The Engram demo's layer: gated, biased, with the short conv; two
    /// sites.
    EngramConv,
    /// DeepSeek-V4.1's Engram layer: gated, no conv, block-scaled FP8 rows;
    /// two sites.
    EngramV41,
    /// LongCat's mean at the input: one site, one stream.
    LongCat,
}

impl TinyFamily {
    /// Every family.
    pub const ALL: [TinyFamily; 3] = [
        TinyFamily::EngramConv,
        TinyFamily::EngramV41,
        TinyFamily::LongCat,
    ];

    /// The family's tiny config, validated like any parsed one.
    pub fn spec(self) -> ModelSpec {
        let engram = |keys, bases: Vec<u64>| {
            ModelFamily::new(EngramSpec {
                keys,
                vocab_bases: bases,
                compressed_vocab_size: 1000,
                pad_id: 2,
                num_embeddings: None,
                token_map: None,
            })
        };
        let base = ModelSpec {
            vocab_size: 1000,
            hidden_size: 32,
            hc_mult: 2,
            rms_norm_eps: 1e-6,
            eos_token_id: 0,
            ngram_size: 3,
            heads_per_ngram: 2,
            head_dim: 16,
            ngram_vocab_size_base: 61,
            divisible_by: 1,
            split_ngram_parts: 1,
            conv_kernel_size: 4,
            ple_layer_ids: vec![2, 4],
            hash_seed: 0,
            num_hidden_layers: 4,
            table_rows: None,
            family: ModelFamily::default(),
        };
        let g = match self {
            TinyFamily::EngramConv => ModelSpec {
                family: engram(EngramKeys::Demo, vec![61, 67]),
                ..base
            },
            TinyFamily::EngramV41 => ModelSpec {
                ngram_size: 4,
                head_dim: 32,
                conv_kernel_size: 1,
                family: engram(EngramKeys::V41, vec![53, 53, 53]),
                ..base
            },
            TinyFamily::LongCat => ModelSpec {
                hidden_size: 48,
                hc_mult: 1,
                head_dim: 12,
                ngram_vocab_size_base: 50,
                conv_kernel_size: 1,
                ple_layer_ids: vec![1],
                num_hidden_layers: 1,
                family: ModelFamily::new(LongCatSpec {
                    keys: LongCatKeys::Flash,
                }),
                ..base
            },
        };
        g.validate("tiny family spec")
            .expect("the tiny family specs are valid");
        g
    }

    /// The element type of the family's table rows.
    pub fn row_dtype(self) -> RowDType {
        match self {
            TinyFamily::EngramV41 => RowDType::Fp8E4M3Block32,
            _ => RowDType::Bf16,
        }
    }
}

/// Random weights for `site`, every tensor its combination uses and none
/// other: norms around their starting value (0 for `(1 + w)`, 1 for `w`).
pub fn family_weights(site: &SiteSpec, seed: u64, index: usize) -> PleWeights {
    let (c, e, h) = (site.channels(), site.emb_dim(), site.hidden);
    let mut state = seed ^ (index as u64).wrapping_mul(0xA076_1D64_78BD_642F);
    let mut unit = move || {
        state = splitmix64(state);
        ((state >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    };
    let mut w = PleWeights {
        value_proj: (0..h * e).map(|_| f32_to_bf16(unit() * 0.25)).collect(),
        ..PleWeights::default()
    };
    if let Some(g) = site.combine.gated() {
        let center = 1.0 - g.norm.offset();
        w.key_proj = (0..c * e).map(|_| f32_to_bf16(unit() * 0.25)).collect();
        w.norm_key = (0..c).map(|_| center + unit() * 0.2).collect();
        w.norm_query = (0..c).map(|_| center + unit() * 0.2).collect();
        if g.conv {
            w.norm_conv = (0..c).map(|_| center + unit() * 0.2).collect();
            w.conv1d = (0..c * site.kernel).map(|_| unit() * 0.6).collect();
        }
        if g.key_bias {
            w.key_bias = (0..c).map(|_| unit() * 0.1).collect();
        }
        if g.value_bias {
            w.value_bias = (0..h).map(|_| unit() * 0.1).collect();
        }
    }
    w
}

/// `rows` random rows of `head_dim` values in `dtype`, as the table stores
/// them.
fn random_rows(rows: u64, head_dim: usize, dtype: RowDType, seed: u64) -> Vec<u8> {
    let mut state = seed;
    let mut row = vec![0f32; head_dim];
    let mut out = Vec::with_capacity(rows as usize * dtype.row_bytes(head_dim));
    for _ in 0..rows {
        for v in row.iter_mut() {
            state = splitmix64(state);
            *v = ((state >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0;
        }
        match dtype {
            RowDType::Fp8E4M3Block32 => quantize_fp8_block_row(&row, &mut out),
            _ => out.extend(row.iter().flat_map(|&v| f32_to_bf16(v).to_le_bytes())),
        }
    }
    out
}

/// Site `index` of `family`'s tiny model, for forwards of up to
/// `max_tokens` tokens: its layer over the whole table (LongCat: one table
/// per sub-table, joined by a [`ConcatTable`]).
pub fn family_site(
    gpu: &Arc<dyn GpuBackend>,
    family: TinyFamily,
    index: usize,
    seed: u64,
    max_tokens: usize,
) -> Result<PleSite> {
    family_site_of(gpu, &family.spec(), family, index, seed, max_tokens, None)
}

/// [`family_site`] of the model `g` (the family's spec, or one changed
/// for a test, e.g. wider rows), opened for `shard` where given: each
/// table then holds the rank's column slice of the rows the unsharded
/// site reads (docs/SPEC.md §5, "Tensor-parallel shards").
pub fn family_site_of(
    gpu: &Arc<dyn GpuBackend>,
    g: &ModelSpec,
    family: TinyFamily,
    index: usize,
    seed: u64,
    max_tokens: usize,
    shard: Option<Shard>,
) -> Result<PleSite> {
    let derived = g.derive(index)?;
    let site = g.site_with(index, derived.dims);
    let dtype = family.row_dtype();
    let row_seed = seed ^ 0x7AB1_E000 ^ index as u64;
    let width = site.head_dim / shard.as_ref().map_or(1, |s| s.tp.ranks());
    let table_of = |bytes: Vec<u8>| -> Result<Arc<ResidentTable>> {
        let bytes = match &shard {
            Some(s) => s.tp.shard_rows(&bytes, site.head_dim, dtype)?,
            None => bytes,
        };
        Ok(Arc::new(ResidentTable::from_rows(
            gpu.clone(),
            &bytes,
            width,
            dtype,
        )?))
    };
    let table: Arc<dyn RowTable> = if family == TinyFamily::LongCat {
        let mut parts: Vec<Arc<dyn RowTable>> = Vec::new();
        for (i, &rows) in site.dims.head_vocab_sizes.iter().enumerate() {
            parts.push(table_of(random_rows(
                rows,
                site.head_dim,
                dtype,
                row_seed + i as u64,
            ))?);
        }
        Arc::new(ConcatTable::new(parts, gpu.clone())?)
    } else {
        table_of(random_rows(
            derived.padded_rows,
            site.head_dim,
            dtype,
            row_seed,
        ))?
    };
    let weights = family_weights(&site, seed, index);
    let layer = match shard {
        Some(s) => PleLayer::new_sharded(&site, weights, table, max_tokens, gpu.as_ref(), s)?,
        None => PleLayer::new(&site, weights, table, max_tokens, gpu.as_ref())?,
    };
    Ok(PleSite::new(layer))
}

/// An engine over every site of `family`'s tiny model.
pub fn family_engine(
    gpu: &Arc<dyn GpuBackend>,
    family: TinyFamily,
    seed: u64,
    max_tokens: usize,
    cfg: EngineConfig,
) -> Result<Engine<PleSite>> {
    let mut built = Vec::new();
    for i in 0..family.spec().sites() {
        match family_site(gpu, family, i, seed, max_tokens) {
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
    fn each_family_has_its_carry_and_combination() {
        for f in TinyFamily::ALL {
            let g = f.spec();
            let site = g.site(0).unwrap();
            site.validate().unwrap();
            let conv = f == TinyFamily::EngramConv;
            assert_eq!(site.combine.has_conv(), conv, "{f:?}");
            assert_eq!(site.conv_bytes() > 0, conv, "{f:?}");
            assert_eq!(site.combine.has_key(), f != TinyFamily::LongCat, "{f:?}");
            let w = family_weights(&site, 1, 0);
            assert_eq!(w.value_proj.len(), site.hidden * site.emb_dim());
            assert_eq!(w.conv1d.is_empty(), !conv);
        }
    }
}
