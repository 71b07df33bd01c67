//! Engram demo checkpoints (`model.layers.{L}.engram.*`,
//! [`EngramDemoNames`]): one table tensor per layer holding every head's
//! rows back to back, and per-branch key projections, biases and norms that
//! the loader stacks into the layer's `[C, ...]` tensors.

use metrale_model_layers::layers::ple::PleWeights;
use metrale_model_layers::layers::ple::ids::DerivedPleIds;
use metrale_model_layers::layers::ple::spec::{ModelSpec, SiteSpec};
use metrale_storage::safetensors::Dtype;

use super::TensorFamily;
use crate::error::Result;
use crate::load::{Files, check_buffer};
use crate::names::EngramDemoNames;
use crate::synth::{Dense, Fill};

/// The checkpoint side of the Engram demo.
pub(super) struct EngramDemoTensors;

impl TensorFamily for EngramDemoTensors {
    fn id(&self) -> &'static str {
        "engram-demo"
    }

    fn name(&self, _variant: u8) -> &'static str {
        "Engram (demo)"
    }

    fn table_parts(&self, _g: &ModelSpec) -> usize {
        1
    }

    fn table_tensors(&self, _variant: u8, g: &ModelSpec, s: usize) -> Vec<String> {
        vec![EngramDemoNames::new(g.site_layer(s)).table()]
    }

    fn site_prefix(&self, _variant: u8, g: &ModelSpec, s: usize) -> String {
        EngramDemoNames::new(g.site_layer(s)).prefix().to_string()
    }

    fn load_weights(
        &self,
        _variant: u8,
        g: &ModelSpec,
        files: &Files,
        spec: &SiteSpec,
    ) -> Result<PleWeights> {
        load(g, files, spec)
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

/// The demo's per-branch tensors, stacked branch by branch into the
/// layer's `[C, ...]` ones.
fn load(g: &ModelSpec, files: &Files, spec: &SiteSpec) -> Result<PleWeights> {
    let n = EngramDemoNames::new(spec.layer);
    let (file, o) = files.read_i64(&n.offsets(), g.ngram_heads())?;
    check_buffer(&file, &n.offsets(), &o, &spec.dims.head_offsets)?;
    let (c, e, h) = (
        g.channels() as u64,
        g.emb_dim() as u64,
        g.hidden_size as u64,
    );
    let mut w = PleWeights::default();
    let conv = spec.combine.has_conv();
    for b in 0..g.hc_mult {
        w.key_proj.extend(files.read_bf16(&n.key_proj(b), &[h, e])?);
        w.key_bias.extend(files.read_f32(&n.key_bias(b), &[h])?);
        w.norm_key.extend(files.read_f32(&n.norm_key(b), &[h])?);
        w.norm_query.extend(files.read_f32(&n.norm_query(b), &[h])?);
        if conv {
            w.norm_conv.extend(files.read_f32(&n.norm_conv(b), &[h])?);
        }
    }
    w.value_proj = files.read_bf16(&n.value_proj(), &[h, e])?;
    w.value_bias = files.read_f32(&n.value_bias(), &[h])?;
    if conv {
        w.conv1d = files.read_f32(&n.conv(), &[c, 1, g.conv_kernel_size as u64])?;
    }
    Ok(w)
}

/// The dense tensors `init` writes for site `s`.
fn dense(g: &ModelSpec, s: usize, d: &DerivedPleIds) -> Vec<Dense> {
    let (c, e, h, k) = (
        g.channels() as u64,
        g.emb_dim() as u64,
        g.hidden_size as u64,
        g.conv_kernel_size as u64,
    );
    let hc = g.hc_mult;
    let amp = 1.0 / (e as f32).sqrt();
    let heads = g.ngram_heads() as u64;
    let layer = g.site_layer(s);
    let bf = |center, amp| Fill::Bf16 { center, amp };
    let f32f = |center, amp| Fill::F32 { center, amp };
    let mut v = Vec::new();
    // Norm weights of the `w` form sit around 1, as they start.
    let n = EngramDemoNames::new(layer);
    for b in 0..hc {
        let t = 0x1000 + 16 * b as u64;
        v.push(Dense::new(
            n.key_proj(b),
            Dtype::BF16,
            &[h, e],
            t,
            bf(0.0, amp),
        ));
        v.push(Dense::new(
            n.key_bias(b),
            Dtype::F32,
            &[h],
            t + 1,
            f32f(0.0, 0.05),
        ));
        v.push(Dense::new(
            n.norm_key(b),
            Dtype::F32,
            &[h],
            t + 2,
            f32f(1.0, 0.1),
        ));
        v.push(Dense::new(
            n.norm_query(b),
            Dtype::F32,
            &[h],
            t + 3,
            f32f(1.0, 0.1),
        ));
        v.push(Dense::new(
            n.norm_conv(b),
            Dtype::F32,
            &[h],
            t + 4,
            f32f(1.0, 0.1),
        ));
    }
    v.push(Dense::new(
        n.value_proj(),
        Dtype::BF16,
        &[h, e],
        0x2000,
        bf(0.0, amp),
    ));
    v.push(Dense::new(
        n.value_bias(),
        Dtype::F32,
        &[h],
        0x2001,
        f32f(0.0, 0.05),
    ));
    v.push(Dense::new(
        n.conv(),
        Dtype::F32,
        &[c, 1, k],
        0x2002,
        f32f(0.0, 0.5),
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
