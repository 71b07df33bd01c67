//! Building a [`PleLayer`]: check the weights and the table against the
//! site spec, register the CPU kernels where the backend runs host kernels
//! (else load the device kernels),
//! upload the packed projection and the norm and conv weights, and allocate
//! the scratch and staging area.
//!
//! Invariant: a failed build frees everything it allocated (see
//! `AllocGuard`), so a refused layer leaks no device memory.

use std::sync::Arc;

use metrale_gpu_runtime::gpu::{DevicePtr, GpuBackend};
use metrale_storage::table::RowTable;
use parking_lot::Mutex;

use super::error::{DeviceContext, LayerError};
use super::{DeviceBufs, Kernels, PleLayer, PleWeights};
use crate::layers::ple::device_kernels::{LaunchShapes, load_ple_module};
use crate::layers::ple::ids::PleIdHasher;
use crate::layers::ple::kernels;
use crate::layers::ple::spec::{Combine, NormForm, SiteSpec};
use crate::layers::ple::staging::Staging;
use crate::layers::ple::tensor_parallel::Shard;

/// Allocations made so far by a constructor, freed if it fails.
struct AllocGuard<'a> {
    gpu: &'a dyn GpuBackend,
    ptrs: Vec<DevicePtr>,
}

impl AllocGuard<'_> {
    fn alloc(&mut self, bytes: usize, label: &str) -> Result<DevicePtr, LayerError> {
        let p = self
            .gpu
            .alloc(bytes.max(4), label)
            .device(|| format!("allocating {bytes} bytes for '{label}'"))?;
        self.ptrs.push(p);
        Ok(p)
    }
    fn upload_f32(&mut self, data: &[f32], label: &str) -> Result<DevicePtr, LayerError> {
        let p = self.alloc(data.len() * 4, label)?;
        self.gpu
            .copy_h2d(&f32_bytes(data), p)
            .device(|| format!("uploading '{label}'"))?;
        Ok(p)
    }
}

impl Drop for AllocGuard<'_> {
    fn drop(&mut self) {
        for p in self.ptrs.drain(..) {
            let _ = self.gpu.dealloc(p);
        }
    }
}

fn f32_bytes(v: &[f32]) -> Vec<u8> {
    let mut out = Vec::with_capacity(v.len() * 4);
    for x in v {
        out.extend_from_slice(&x.to_le_bytes());
    }
    out
}

fn fits_u32(what: &'static str, value: usize) -> Result<u32, LayerError> {
    u32::try_from(value).map_err(|_| LayerError::KernelArg { what, value })
}

/// Check every weight tensor's size and values against the spec: the
/// tensors the site's combination uses have their shapes, the others are
/// empty.
fn check_weights(spec: &SiteSpec, w: &PleWeights) -> Result<(), LayerError> {
    let (c, e, hidden, k) = (spec.channels(), spec.emb_dim(), spec.hidden, spec.kernel);
    let gated = spec.combine.gated().copied();
    let keyed = gated.is_some();
    let conv = spec.combine.has_conv();
    let pick = |used: bool, n: usize| if used { n } else { 0 };
    let shape = |tensor, found: usize, expected: usize, shape: String| {
        if found == expected {
            Ok(())
        } else {
            let shape = if expected == 0 {
                format!(
                    "empty: the site's combination ({:?}) has no {tensor}",
                    spec.combine
                )
            } else {
                shape
            };
            Err(LayerError::WeightShape {
                tensor,
                found,
                expected,
                shape,
            })
        }
    };
    shape(
        "key_proj",
        w.key_proj.len(),
        pick(keyed, c * e),
        format!("[C = hc_mult*hidden = {c}, E = ngram_heads*head_dim = {e}]"),
    )?;
    shape(
        "value_proj",
        w.value_proj.len(),
        hidden * e,
        format!("[H = {hidden}, E = {e}]"),
    )?;
    let finite = |tensor, v: &[f32]| match v.iter().position(|x| !x.is_finite()) {
        Some(index) => Err(LayerError::NonFinite {
            tensor,
            index,
            value: v[index],
        }),
        None => Ok(()),
    };
    for (name, v, used) in [
        ("norm_key", &w.norm_key, keyed),
        ("norm_query", &w.norm_query, keyed),
        ("norm_conv", &w.norm_conv, conv),
    ] {
        shape(name, v.len(), pick(used, c), format!("C = {c}"))?;
        finite(name, v)?;
    }
    shape(
        "conv1d",
        w.conv1d.len(),
        pick(conv, c * k),
        format!("[C = {c}, 1, K = {k}]"),
    )?;
    finite("conv1d", &w.conv1d)?;
    for (name, v, used, n) in [
        (
            "key_bias",
            &w.key_bias,
            gated.is_some_and(|g| g.key_bias),
            c,
        ),
        (
            "value_bias",
            &w.value_bias,
            gated.is_some_and(|g| g.value_bias),
            hidden,
        ),
    ] {
        shape(name, v.len(), pick(used, n), format!("[{n}]"))?;
        finite(name, v)?;
    }
    for (tensor, v) in [("key_proj", &w.key_proj), ("value_proj", &w.value_proj)] {
        if let Some(index) = v.iter().position(|b| b & 0x7f80 == 0x7f80) {
            return Err(LayerError::NonFiniteBf16 {
                tensor,
                index,
                bits: v[index],
            });
        }
    }
    Ok(())
}

/// `[key_bias | value_bias]` over the `o` projection outputs, zeros where a
/// bias is absent, or `None` when the site has no bias at all.
fn bias_vector(spec: &SiteSpec, w: &PleWeights, o: usize) -> Option<Vec<f32>> {
    if w.key_bias.is_empty() && w.value_bias.is_empty() {
        return None;
    }
    let keys = o - spec.hidden;
    let mut b = vec![0.0f32; o];
    b[..w.key_bias.len()].copy_from_slice(&w.key_bias);
    b[keys..keys + w.value_bias.len()].copy_from_slice(&w.value_bias);
    Some(b)
}

impl PleLayer {
    /// Build the layer of site `spec` over `table`: validate the spec and
    /// every weight shape against it, register the CPU kernels where the
    /// backend runs host kernels, upload the packed projection and the norm
    /// and conv weights, and allocate scratch for `max_tokens` rows per
    /// launch (longer forwards are split) and a decode batch of up to
    /// `max_tokens` sequences.
    pub fn new(
        spec: &SiteSpec,
        weights: PleWeights,
        table: Arc<dyn RowTable>,
        max_tokens: usize,
        gpu: &dyn GpuBackend,
    ) -> Result<PleLayer, LayerError> {
        Self::build(spec, weights, table, max_tokens, gpu, None)
    }

    /// [`Self::new`] for tensor-parallel rank `shard.tp` (docs/SPEC.md §5,
    /// "Tensor-parallel shards"): `weights` are the site's whole weights
    /// (checked against `spec` as [`Self::new`] checks them; the layer
    /// keeps its rank's input columns of the projections), `table` holds
    /// the rank's column slice of every row (rows of `head_dim / ranks`
    /// values, e.g. [`crate::layers::ple::TensorParallel::shard_rows`]),
    /// and every projection is completed by `shard.reduce` before the
    /// combination. Refused, naming the numbers, where the split does not
    /// divide the rows. One rank is [`Self::new`] (the collective is
    /// never called).
    pub fn new_sharded(
        spec: &SiteSpec,
        weights: PleWeights,
        table: Arc<dyn RowTable>,
        max_tokens: usize,
        gpu: &dyn GpuBackend,
        shard: Shard,
    ) -> Result<PleLayer, LayerError> {
        let shard = (!shard.tp.is_single()).then_some(shard);
        Self::build(spec, weights, table, max_tokens, gpu, shard)
    }

    fn build(
        spec: &SiteSpec,
        weights: PleWeights,
        table: Arc<dyn RowTable>,
        max_tokens: usize,
        gpu: &dyn GpuBackend,
        shard: Option<Shard>,
    ) -> Result<PleLayer, LayerError> {
        spec.validate()?;
        let dims = spec.dims.clone();
        let hasher = PleIdHasher::with_family(&spec.family, &dims)?;
        if max_tokens == 0 {
            return Err(LayerError::NoTokens);
        }
        let heads = spec.ngram_heads();
        let (c, hidden) = (spec.channels(), spec.hidden);
        let info = table.info();
        let row_dim = match &shard {
            None => spec.head_dim,
            Some(s) => s.tp.columns(spec.head_dim, info.dtype)?.len(),
        };
        // The gathered embedding's width on this rank.
        let e = heads * row_dim;
        match &shard {
            Some(s) if info.head_dim != row_dim => {
                return Err(LayerError::ShardTableWidth {
                    rank: s.tp.rank(),
                    ranks: s.tp.ranks(),
                    table: info.head_dim,
                    head_dim: spec.head_dim,
                    width: row_dim,
                });
            }
            None if info.head_dim != spec.head_dim => {
                return Err(LayerError::TableHeadDim {
                    table: info.head_dim,
                    layer: spec.head_dim,
                });
            }
            _ => {}
        }
        if !info.dtype.fits_head_dim(info.head_dim) {
            return Err(LayerError::TableRowType {
                dtype: info.dtype,
                head_dim: info.head_dim,
            });
        }
        dims.check_table_rows(info.rows)?;
        check_weights(spec, &weights)?;
        let weights = match &shard {
            Some(s) => s.tp.shard_weights(spec, &weights, info.dtype)?,
            None => weights,
        };
        let w = &weights;
        // The projection's outputs: the keys of every stream (gated sites)
        // and the value.
        let o = if spec.combine.has_key() {
            c + hidden
        } else {
            hidden
        };
        let tokens_heads = max_tokens.checked_mul(heads).ok_or(LayerError::KernelArg {
            what: "tokens*ngram_heads",
            value: usize::MAX,
        })?;
        for (what, v) in [
            ("tokens*ngram_heads", tokens_heads),
            ("head_dim", row_dim),
            ("E", e),
            ("C + hidden", o),
            ("max_tokens", max_tokens),
            ("kernel size", spec.kernel),
            ("dilation", spec.dilation),
        ] {
            fits_u32(what, v)?;
        }
        let dtype_code = kernels::gather::GatherDType::of(info.dtype).arg();

        let shapes = LaunchShapes::for_backend(gpu);
        if shapes == LaunchShapes::Host {
            kernels::register_cpu_kernels(gpu).map_err(|e| LayerError::Kernels(Box::new(e)))?;
        } else {
            load_ple_module(gpu)
                .device(|| "loading the PLE device kernels (kernels/ple.cu)".into())?;
        }
        let k = |name: &str| {
            gpu.kernel(kernels::MODULE, name)
                .device(|| format!("resolving PLE kernel '{name}'"))
        };
        let kernels = Kernels {
            shapes,
            gather: k("gather")?,
            gather_runs: k("gather_runs")?,
            project: k("project")?,
            project_range: k("project_range")?,
            gate: k("gate")?,
            conv: k("conv")?,
            conv_batch: k("conv_batch")?,
            gate_norms: None,
            bias_add: None,
            highway_add: None,
            mean_add: None,
        };
        let mut kernels = kernels;
        let bias = bias_vector(spec, w, o);
        if bias.is_some() {
            kernels.bias_add = Some(k("bias_add")?);
        }
        // The combination's kernel dispatch: each variant resolves the
        // kernels its per-element loops run (forward.rs launches them).
        match spec.combine {
            Combine::Gated(g) => {
                let [q, k_eps, c_eps] = g.eps(spec.rms_eps);
                let plain = g.norm == NormForm::OnePlusWeight
                    && g.conv
                    && [q, k_eps, c_eps] == [spec.rms_eps; 3];
                if !plain {
                    kernels.gate_norms = Some(k("gate_norms")?);
                }
                if !g.conv {
                    kernels.highway_add = Some(k("highway_add")?);
                }
            }
            Combine::Mean => kernels.mean_add = Some(k("mean_add")?),
        }

        let mut g = AllocGuard {
            gpu,
            ptrs: Vec::new(),
        };
        let mut wbits = Vec::with_capacity(o * e);
        wbits.extend_from_slice(&w.key_proj);
        wbits.extend_from_slice(&w.value_proj);
        let packed = kernels::pack_projection(&wbits, o, e);
        if packed.len() != kernels::packed_len(o, e) {
            return Err(LayerError::Packing {
                found: packed.len(),
                expected: kernels::packed_len(o, e),
            });
        }
        drop(wbits);
        let mut bufs = DeviceBufs {
            w_proj: g.upload_f32(&packed, "ple.w_proj")?,
            ..Default::default()
        };
        drop(packed);
        bufs.norm_q = g.upload_f32(&w.norm_query, "ple.norm_query")?;
        bufs.norm_k = g.upload_f32(&w.norm_key, "ple.norm_key")?;
        bufs.norm_conv = g.upload_f32(&w.norm_conv, "ple.norm_conv")?;
        bufs.conv_w = g.upload_f32(&w.conv1d, "ple.conv1d")?;
        if let Some(b) = &bias {
            bufs.bias = g.upload_f32(b, "ple.proj_bias")?;
        }
        bufs.emb = g.alloc(max_tokens * e * 4, "ple.emb")?;
        bufs.kv = g.alloc(max_tokens * o * 4, "ple.kv")?;
        bufs.gated = g.alloc(max_tokens * c * 4, "ple.gated")?;
        bufs.xn = g.alloc(max_tokens * c * 4, "ple.xn")?;
        // The padding row: zero values, then a zero f32 scale (FP8 only).
        let pad_bytes = (info.row_bytes() + 7) / 4 * 4 + 4;
        bufs.pad_row = g.alloc(pad_bytes, "ple.pad_row")?;
        gpu.memset(bufs.pad_row, 0, pad_bytes)
            .device(|| "zeroing the PLE padding row".into())?;
        let max_batch = max_tokens;
        let ring_tokens = (4 * max_tokens).max(64);
        let slots = g.alloc(
            Staging::total_bytes(heads, max_tokens, max_batch, ring_tokens),
            "ple.slots",
        )?;
        let staging = Staging {
            base: slots,
            heads,
            max_tokens,
            max_batch,
            ring_tokens,
            ring: Default::default(),
            cursor: 0,
            batch: Default::default(),
            pad_states: Vec::new(),
            streams: Default::default(),
        };
        g.ptrs.clear();
        Ok(PleLayer {
            spec: spec.clone(),
            hasher,
            state_len: spec.state_len(),
            max_tokens,
            row_dim,
            shard,
            table,
            dtype_code,
            kernels,
            bufs,
            staging: Mutex::new(staging),
            freed: false,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn f32_image_is_little_endian() {
        assert_eq!(
            f32_bytes(&[1.0, -2.5]),
            [1.0f32.to_le_bytes(), (-2.5f32).to_le_bytes()].concat()
        );
    }

    #[test]
    fn oversized_kernel_arguments_are_named() {
        assert_eq!(fits_u32("E", 7).unwrap(), 7);
        let e = fits_u32("tokens*ngram_heads", 1 << 33)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("tokens*ngram_heads") && e.contains("8589934592"),
            "{e}"
        );
    }
}
