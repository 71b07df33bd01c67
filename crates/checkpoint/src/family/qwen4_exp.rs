//! Qwen4-Exp checkpoints (docs/SPEC.md §10 (Checkpoint layout)): the
//! table cut into `split_ngram_parts` shards as transformers'
//! `torch.chunk` cuts them ([`chunk_rows`]), under `model.` or, for the
//! multimodal model, `model.language_model.` ([`SiteNames`]); dense BF16
//! projections, f32 norms and conv, and the hash buffers, which the loader
//! checks against their derivation.

use metrale_model_layers::layers::ple::PleWeights;
use metrale_model_layers::layers::ple::ids::DerivedPleIds;
use metrale_model_layers::layers::ple::spec::{ModelSpec, SiteSpec};
use metrale_storage::safetensors::Dtype;

use super::{TensorFamily, chunk_rows};
use crate::error::{CheckpointError, Result};
use crate::load::{Files, check_buffer};
use crate::names::{MULTIMODAL_ROOT, SiteNames, TEXT_ROOT};
use crate::synth::{Dense, Fill};

/// The checkpoint side of Qwen4-Exp; variant 1 is the multimodal model's
/// root.
pub(super) struct Qwen4ExpTensors;

/// The names of site tensors at model layer `layer` in spelling `variant`.
fn names(variant: u8, layer: usize) -> SiteNames {
    let root = if variant == 1 {
        MULTIMODAL_ROOT
    } else {
        TEXT_ROOT
    };
    SiteNames::with_root(root, layer)
}

impl TensorFamily for Qwen4ExpTensors {
    fn id(&self) -> &'static str {
        "qwen4-exp"
    }

    fn name(&self, variant: u8) -> &'static str {
        if variant == 1 {
            "Qwen4Exp PLE (multimodal model)"
        } else {
            "Qwen4Exp PLE"
        }
    }

    fn variant(&self, _g: &ModelSpec, tensors: &mut dyn Iterator<Item = &String>) -> u8 {
        let prefix = format!("{MULTIMODAL_ROOT}layers.");
        let mut hit = false;
        for n in tensors {
            if n.starts_with(&prefix) && n.contains(".ple.") {
                hit = true;
                break;
            }
        }
        u8::from(hit)
    }

    fn table_parts(&self, g: &ModelSpec) -> usize {
        g.split_ngram_parts
    }

    fn torch_chunked(&self) -> bool {
        true
    }

    fn part_noun(&self) -> &'static str {
        "shards"
    }

    fn whole_part_rows(&self, g: &ModelSpec, _s: usize, padded_rows: u64) -> Vec<u64> {
        let (per, n) = chunk_rows(padded_rows, g.split_ngram_parts as u64);
        (0..n).map(|i| per.min(padded_rows - i * per)).collect()
    }

    fn table_tensors(&self, variant: u8, g: &ModelSpec, s: usize) -> Vec<String> {
        let n = names(variant, g.site_layer(s));
        let count = match g.table_rows {
            Some(_) => g.split_ngram_parts as u64,
            None => g
                .derive(s)
                .map(|d| chunk_rows(d.padded_rows, g.split_ngram_parts as u64).1)
                .unwrap_or(g.split_ngram_parts as u64),
        };
        (0..count as usize).map(|i| n.shard_weight(i)).collect()
    }

    fn site_prefix(&self, variant: u8, g: &ModelSpec, s: usize) -> String {
        names(variant, g.site_layer(s)).prefix().to_string()
    }

    fn site_names(&self, variant: u8, layer: usize) -> Option<SiteNames> {
        Some(names(variant, layer))
    }

    fn load_weights(
        &self,
        variant: u8,
        g: &ModelSpec,
        files: &Files,
        spec: &SiteSpec,
    ) -> Result<PleWeights> {
        load(g, files, names(variant, spec.layer), spec)
    }

    fn dense_tensors(
        &self,
        _variant: u8,
        g: &ModelSpec,
        s: usize,
        d: &DerivedPleIds,
    ) -> Vec<Dense> {
        dense(g, s, d)
    }
}

/// The site's projections, norms and conv, with its hash buffers checked
/// against their derivation.
fn load(g: &ModelSpec, files: &Files, n: SiteNames, spec: &SiteSpec) -> Result<PleWeights> {
    let dims = &spec.dims;
    let (file, m) = files.read_i64(&n.layer_multipliers(), g.ngram_size)?;
    if let Some(i) = m.iter().position(|x| x % 2 == 0) {
        return Err(CheckpointError::Value {
            file,
            tensor: n.layer_multipliers(),
            msg: format!(
                "multiplier {i} is {}, which is even; every multiplier is odd",
                m[i]
            ),
        });
    }
    check_buffer(&file, &n.layer_multipliers(), &m, &dims.multipliers)?;
    let (file, v) = files.read_i64(&n.vocab_sizes(), g.ngram_heads())?;
    check_buffer(&file, &n.vocab_sizes(), &v, &dims.head_vocab_sizes)?;
    let (file, o) = files.read_i64(&n.offsets(), g.ngram_heads())?;
    check_buffer(&file, &n.offsets(), &o, &dims.head_offsets)?;
    let (c, e, h, k) = (
        g.channels() as u64,
        g.emb_dim() as u64,
        g.hidden_size as u64,
        g.conv_kernel_size,
    );
    Ok(PleWeights {
        key_proj: files.read_bf16(&n.key_proj(), &[c, e])?,
        value_proj: files.read_bf16(&n.value_proj(), &[h, e])?,
        norm_key: files.read_f32(&n.norm_key(), &[c])?,
        norm_query: files.read_f32(&n.norm_query(), &[c])?,
        norm_conv: files.read_f32(&n.norm_conv(), &[c])?,
        conv1d: files.read_f32(&n.conv1d(), &[c, 1, k as u64])?,
        key_bias: Vec::new(),
        value_bias: Vec::new(),
    })
}

/// The dense tensors `init` writes for site `s`.
fn dense(g: &ModelSpec, s: usize, d: &DerivedPleIds) -> Vec<Dense> {
    let (c, e, h, k) = (
        g.channels() as u64,
        g.emb_dim() as u64,
        g.hidden_size as u64,
        g.conv_kernel_size as u64,
    );
    let amp = 1.0 / (e as f32).sqrt();
    let heads = g.ngram_heads() as u64;
    let layer = g.site_layer(s);
    let bf = |center, amp| Fill::Bf16 { center, amp };
    let f32f = |center, amp| Fill::F32 { center, amp };
    let mut v = Vec::new();
    let n = SiteNames::new(layer);
    v.push(Dense::new(
        n.key_proj(),
        Dtype::BF16,
        &[c, e],
        1,
        bf(0.0, amp),
    ));
    v.push(Dense::new(
        n.value_proj(),
        Dtype::BF16,
        &[h, e],
        2,
        bf(0.0, amp),
    ));
    v.push(Dense::new(
        n.norm_key(),
        Dtype::F32,
        &[c],
        3,
        f32f(0.0, 0.1),
    ));
    v.push(Dense::new(
        n.norm_query(),
        Dtype::F32,
        &[c],
        4,
        f32f(0.0, 0.1),
    ));
    v.push(Dense::new(
        n.norm_conv(),
        Dtype::F32,
        &[c],
        5,
        f32f(0.0, 0.1),
    ));
    v.push(Dense::new(
        n.conv1d(),
        Dtype::F32,
        &[c, 1, k],
        6,
        f32f(0.0, 0.5),
    ));
    v.push(Dense::new(
        n.layer_multipliers(),
        Dtype::I64,
        &[g.ngram_size as u64],
        0,
        Fill::I64(d.dims.multipliers.clone()),
    ));
    v.push(Dense::new(
        n.vocab_sizes(),
        Dtype::I64,
        &[heads],
        0,
        Fill::I64(d.dims.head_vocab_sizes.clone()),
    ));
    v.push(Dense::new(
        n.offsets(),
        Dtype::I64,
        &[heads],
        0,
        Fill::I64(d.dims.head_offsets.clone()),
    ));
    v
}
