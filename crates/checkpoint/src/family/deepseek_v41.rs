//! DeepSeek-V4.1 checkpoints (`layers.{L}.engram.*`, [`V41Names`]): one
//! table tensor per layer, FP8 rows with UE8M0 block scales (inline, or as
//! released in their own tensor and converted on open), a fused FP8
//! key/value projection and BF16 norms.

use metrale_model_layers::layers::ple::PleWeights;
use metrale_model_layers::layers::ple::ids::DerivedPleIds;
use metrale_model_layers::layers::ple::spec::{ModelSpec, SiteSpec};
use metrale_storage::dtype::bf16_to_f32;
use metrale_storage::safetensors::Dtype;

use super::TensorFamily;
use crate::error::Result;
use crate::load::Files;
use crate::names::V41Names;
use crate::synth::{Dense, Fill, SCALE_DTYPE};
use metrale_storage::dtype::FP8_BLOCK;

/// The checkpoint side of DeepSeek-V4.1's Engram.
pub(super) struct V41Tensors;

impl TensorFamily for V41Tensors {
    fn id(&self) -> &'static str {
        "deepseek-v4.1"
    }

    fn name(&self, _variant: u8) -> &'static str {
        "Engram (DeepSeek-V4.1)"
    }

    fn table_parts(&self, _g: &ModelSpec) -> usize {
        1
    }

    fn release_tables(&self) -> bool {
        true
    }

    fn table_tensors(&self, _variant: u8, g: &ModelSpec, s: usize) -> Vec<String> {
        vec![V41Names::new(g.site_layer(s)).table()]
    }

    fn site_prefix(&self, _variant: u8, g: &ModelSpec, s: usize) -> String {
        V41Names::new(g.site_layer(s)).prefix().to_string()
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
        _d: &DerivedPleIds,
    ) -> Vec<Dense> {
        dense(g, s)
    }
}

/// DeepSeek-V4.1: the fused FP8 projection dequantised (exactly) to
/// BF16, keys first; the norms from `[hc, H]` BF16. The release has no
/// projection biases, so a site whose combination asks for them gets
/// zeros.
fn load(g: &ModelSpec, files: &Files, spec: &SiteSpec) -> Result<PleWeights> {
    let n = V41Names::new(spec.layer);
    let (c, e, h) = (g.channels(), g.emb_dim(), g.hidden_size);
    let rows = c + h;
    let kv = files.read_fp8_blocks(&n.wkv(), &n.wkv_scale(), rows, e)?;
    let (key, value) = kv.split_at(c * e);
    let hc = g.hc_mult as u64;
    let bf16_f32 = |name: &str| -> Result<Vec<f32>> {
        Ok(files
            .read_bf16(name, &[hc, h as u64])?
            .into_iter()
            .map(bf16_to_f32)
            .collect())
    };
    let gated = spec.combine.gated().copied();
    Ok(PleWeights {
        key_proj: key.to_vec(),
        value_proj: value.to_vec(),
        norm_key: bf16_f32(&n.k_weight())?,
        norm_query: bf16_f32(&n.q_weight())?,
        norm_conv: Vec::new(),
        conv1d: Vec::new(),
        key_bias: if gated.is_some_and(|g| g.key_bias) {
            vec![0.0; c]
        } else {
            Vec::new()
        },
        value_bias: if gated.is_some_and(|g| g.value_bias) {
            vec![0.0; h]
        } else {
            Vec::new()
        },
    })
}

/// The dense tensors `init` writes for site `s`.
fn dense(g: &ModelSpec, s: usize) -> Vec<Dense> {
    let (c, e, h) = (
        g.channels() as u64,
        g.emb_dim() as u64,
        g.hidden_size as u64,
    );
    let hc = g.hc_mult;
    let amp = 1.0 / (e as f32).sqrt();
    let layer = g.site_layer(s);
    let bf = |center, amp| Fill::Bf16 { center, amp };
    let mut v = Vec::new();
    let n = V41Names::new(layer);
    let rows = c + h;
    let blk = FP8_BLOCK as u64;
    v.push(Dense::new(
        n.wkv(),
        Dtype::F8E4M3,
        &[rows, e],
        0x3000,
        Fill::Fp8Blocks { amp },
    ));
    v.push(Dense::new(
        n.wkv_scale(),
        SCALE_DTYPE,
        &[rows.div_ceil(blk), e.div_ceil(blk)],
        0,
        Fill::BlockScales,
    ));
    v.push(Dense::new(
        n.q_weight(),
        Dtype::BF16,
        &[hc as u64, h],
        0x3001,
        bf(1.0, 0.1),
    ));
    v.push(Dense::new(
        n.k_weight(),
        Dtype::BF16,
        &[hc as u64, h],
        0x3002,
        bf(1.0, 0.1),
    ));
    v
}
