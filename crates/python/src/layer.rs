//! `metrale_ple.Layer` and `metrale_ple.Carry`: one PLE site's forward with
//! per-sequence carries, on the CPU backend.
//!
//! A layer owns its device buffers behind one mutex; a carry (one
//! sequence's `PleSeqState`) belongs to the layer that made it. Every
//! operation locks the layer first and then the carries it touches, so
//! calls from several Python threads serialise per layer and never
//! deadlock; the GIL is released while they run. Carry semantics are the
//! layer's own (docs/SPEC.md, "Carry lifecycle"): a new carry resets on
//! its first forward; `snapshot`/`restore` are the layer's, through the aux
//! blob codec (a blob that does not fit is refused, the prestage cleared); `reset`
//! installs `context_len` EOS tokens and a zero conv state; `release` is
//! idempotent, and a released carry refuses everything but `release`.
//!
//! Why one long file: `Layer`, `Plan` and `Carry` share the locking order
//! above and one `Shared` core, which each method takes; apart they would
//! need that core public to the crate.

use std::borrow::Cow;
use std::collections::HashSet;
use std::sync::Arc;

use numpy::{PyArrayMethods, PyReadonlyArrayDyn, PyUntypedArrayMethods};
use parking_lot::Mutex;
use pyo3::prelude::*;
use pyo3::types::PyBytes;

use metrale_checkpoint::Checkpoint as CkInner;
use metrale_checkpoint::runtime::TableMode;
use metrale_engine::engine::{mask_family, takes_token_mask};
use metrale_gpu_runtime::cpu::CpuBackend;
use metrale_gpu_runtime::gpu::{DevicePtr, GpuBackend};
use metrale_model_layers::layers::ple::carry_blob;
use metrale_model_layers::layers::ple::highway::{self, f32_bytes_mut};
use metrale_model_layers::layers::ple::ids::PleIdDims;
use metrale_model_layers::layers::ple::{
    ForwardContext, PleLayer, PleSeqState, PleWeights, SeqWork, SiteSpec, StepPlan,
};
use metrale_storage::cached::CacheConfig;
use metrale_storage::table::RowTable;

use crate::args::{self, Width};
use crate::error::{py_err, value_error};
use metrale_storage::resident::ResidentTable;

/// The layer and the device buffer highway rows pass through.
pub(crate) struct Core {
    gpu: Arc<dyn GpuBackend>,
    layer: PleLayer,
    highway: DevicePtr,
}

impl Core {
    fn channels(&self) -> usize {
        self.layer.channels()
    }

    /// `tokens` of one sequence (with `masked`, one flag per token)
    /// through the layer, in chunks of at most `max_tokens`, `hw` rows in
    /// and out.
    fn prefill(
        &self,
        st: &mut PleSeqState,
        tokens: &[u32],
        masked: Option<&[bool]>,
        hw: &mut [f32],
    ) -> anyhow::Result<()> {
        let c = self.channels();
        let step = self.layer.max_tokens();
        let g = self.gpu.as_ref();
        for (i, (t, rows)) in tokens.chunks(step).zip(hw.chunks_mut(step * c)).enumerate() {
            let mut ctx = ForwardContext::new(g).with_host_ids(t);
            if let Some(m) = masked {
                ctx = ctx.with_masked(&m[i * step..i * step + t.len()]);
            }
            highway::on_device(g, self.highway, rows, 0, copy_err, |hw| {
                Ok(self.layer.forward(st, hw, t.len(), false, &ctx, 0)?)
            })?;
        }
        Ok(())
    }

    /// One decode token per sequence (with `masked`, one flag per
    /// sequence), batched by `max_batch`.
    fn decode(
        &self,
        states: &mut [&mut PleSeqState],
        tokens: &[u32],
        masked: Option<&[bool]>,
        hw: &mut [f32],
    ) -> anyhow::Result<()> {
        let c = self.channels();
        let step = self.layer.max_batch();
        let g = self.gpu.as_ref();
        for (i, ((sts, t), rows)) in states
            .chunks_mut(step)
            .zip(tokens.chunks(step))
            .zip(hw.chunks_mut(step * c))
            .enumerate()
        {
            let mut ctx = ForwardContext::new(g).with_host_ids(t);
            if let Some(m) = masked {
                ctx = ctx.with_masked(&m[i * step..i * step + t.len()]);
            }
            highway::on_device(g, self.highway, rows, 0, copy_err, |hw| {
                Ok(self.layer.forward_batch(sts, hw, t.len(), &ctx, 0)?)
            })?;
        }
        Ok(())
    }

    /// The rows of `plan`'s distinct ids, `[distinct, row_dim]`, staged
    /// into a buffer of the caller's (here one allocated for the call) as
    /// an engine with kernels of its own would.
    fn stage(&self, plan: &StepPlan) -> anyhow::Result<Vec<f32>> {
        let g = self.gpu.as_ref();
        let n = plan.distinct().len() * self.layer.row_dim();
        if n == 0 {
            return Ok(Vec::new());
        }
        let out = g.alloc(n * 4, "python.staged_rows")?;
        let mut rows = vec![0f32; n];
        let r = self
            .layer
            .stage(plan, out, g, 0)
            .map_err(anyhow::Error::from)
            .and_then(|()| Ok(g.copy_d2h_on_stream(out, f32_bytes_mut(&mut rows), 0)?));
        g.dealloc(out)?;
        r.map(|()| rows)
    }

    fn check_live(st: &PleSeqState) -> anyhow::Result<()> {
        anyhow::ensure!(!st.is_released(), "the carry was released");
        Ok(())
    }

    fn snapshot(&self, st: &PleSeqState) -> anyhow::Result<Vec<u8>> {
        Self::check_live(st)?;
        Ok(self.layer.snapshot(st, self.gpu.as_ref(), 0)?)
    }

    fn restore(&self, st: &mut PleSeqState, blob: &[u8]) -> anyhow::Result<()> {
        Self::check_live(st)?;
        self.layer.restore(st, blob, self.gpu.as_ref(), 0)?;
        self.gpu.synchronize(0)?;
        Ok(())
    }

    /// The aux blob of a fresh sequence: `context_len` EOS tokens and a
    /// zero conv state.
    fn fresh_blob(&self) -> Vec<u8> {
        carry_blob::fresh(self.layer.spec())
    }
}

/// A failed highway copy, for [`highway::on_device`].
fn copy_err(what: &'static str, e: metrale_gpu_runtime::gpu::GpuError) -> anyhow::Error {
    anyhow::Error::from(e).context(what)
}

/// A layer shared by its Python object and its carries.
pub(crate) struct Shared {
    core: Mutex<Core>,
    /// Tokens must be below this (the checkpoint's vocabulary), if known.
    vocab: Option<u64>,
    width: Width,
    max_tokens: usize,
    context_len: usize,
    eos: u32,
    aux_blob_bytes: usize,
    state_len: usize,
    head_dim: usize,
    ngram_heads: usize,
    /// `None` when the site takes a token mask; else its family, as a
    /// refused mask names it.
    no_mask: Option<&'static str>,
}

impl Drop for Shared {
    fn drop(&mut self) {
        let core = self.core.get_mut();
        let _ = core.layer.free(core.gpu.as_ref());
        let _ = core.gpu.dealloc(core.highway);
    }
}

/// One PLE site's layer, over a table served resident, mapped or cached.
///
/// `prefill(carry, tokens, hidden)` and `decode(carries, tokens, hidden)`
/// add the site's output into `hidden` in place: a C-contiguous float32
/// numpy array (or CPU torch tensor) of `len(tokens)` rows of `hc_mult *
/// hidden_size` values, shaped `[T, C]` or `[T, hc_mult, hidden_size]`.
/// Do not touch `hidden` from another thread during the call.
#[pyclass(frozen, module = "metrale_ple", name = "Layer")]
pub struct Layer {
    shared: Arc<Shared>,
}

impl Layer {
    fn build(
        gpu: Arc<dyn GpuBackend>,
        spec: &SiteSpec,
        weights: PleWeights,
        table: Arc<dyn RowTable>,
        max_tokens: usize,
        vocab: Option<u64>,
    ) -> anyhow::Result<Layer> {
        anyhow::ensure!(max_tokens > 0, "max_tokens must be positive");
        let mut layer = PleLayer::new(spec, weights, table, max_tokens, gpu.as_ref())?;
        let bytes = max_tokens
            .checked_mul(layer.channels() * 4)
            .ok_or_else(|| anyhow::anyhow!("max_tokens {max_tokens} is too large"))?;
        let highway = match gpu.alloc(bytes, "python.highway") {
            Ok(p) => p,
            Err(e) => {
                let _ = layer.free(gpu.as_ref());
                return Err(e.into());
            }
        };
        let width = Width {
            hc: layer.hc_mult(),
            hidden: layer.hidden(),
        };
        let shared = Shared {
            vocab,
            width,
            max_tokens,
            context_len: layer.dims().context_len(),
            eos: layer.dims().eos_token_id,
            aux_blob_bytes: layer.aux_blob_bytes(),
            state_len: layer.state_len(),
            head_dim: layer.head_dim(),
            ngram_heads: layer.dims().ngram_heads(),
            no_mask: (!takes_token_mask(layer.spec())).then(|| mask_family(layer.spec())),
            core: Mutex::new(Core {
                gpu,
                layer,
                highway,
            }),
        };
        Ok(Layer {
            shared: Arc::new(shared),
        })
    }

    /// Site `site` of `ck` over its table in mode `table`.
    pub(crate) fn from_checkpoint(
        py: Python<'_>,
        ck: Arc<CkInner>,
        site: usize,
        table: &str,
        max_tokens: usize,
        slots: usize,
    ) -> PyResult<Layer> {
        let mode = args::table_mode(table)?;
        if site >= ck.sites.len() {
            return Err(value_error(format!(
                "site {site}: the checkpoint has {} sites",
                ck.sites.len()
            )));
        }
        if mode == TableMode::Cached && slots == 0 {
            return Err(value_error("slots must be positive"));
        }
        py.detach(|| -> anyhow::Result<Layer> {
            let gpu: Arc<dyn GpuBackend> = Arc::new(CpuBackend::new());
            let table = ck.serve_table(site, mode, CacheConfig::new(slots), gpu.clone())?;
            let s = &ck.sites[site];
            Layer::build(
                gpu,
                &s.spec,
                s.weights.clone(),
                table,
                max_tokens,
                Some(ck.spec.vocab_size),
            )
        })
        .map_err(py_err)
    }

    /// The `mask=` argument of a call over `n` tokens, checked before
    /// anything runs: refused on a site whose published layer has no token
    /// mask (even all clear, as the layer refuses it), or of the wrong
    /// length.
    fn mask_arg(&self, mask: Option<&Bound<'_, PyAny>>, n: usize) -> PyResult<Option<Vec<bool>>> {
        let Some(m) = mask else {
            return Ok(None);
        };
        if let Some(family) = self.shared.no_mask {
            return Err(value_error(format!(
                "mask: the site follows the {family} layer, which has no token mask (only \
                 DeepSeek-V4.1's Engram gate without a short conv takes one); leave the mask out"
            )));
        }
        args::mask(m, "mask", n).map(Some)
    }

    fn own_plan(&self, plan: &Plan) -> PyResult<()> {
        if !Arc::ptr_eq(&plan.shared, &self.shared) {
            return Err(value_error("the plan belongs to another layer"));
        }
        Ok(())
    }

    fn own<'a>(&self, carry: &'a Bound<'_, PyAny>) -> PyResult<&'a Carry> {
        let c = carry
            .cast::<Carry>()
            .map_err(|_| value_error("a Carry of this layer is required"))?
            .get();
        if !Arc::ptr_eq(&c.shared, &self.shared) {
            return Err(value_error("the carry belongs to another layer"));
        }
        Ok(c)
    }
}

fn u16s(obj: &Bound<'_, PyAny>, what: &str) -> PyResult<Vec<u16>> {
    let a = obj
        .cast::<numpy::PyArrayDyn<u16>>()
        .map_err(|_| value_error(format!("{what}: a uint16 array (BF16 bits) is required")))?;
    let ro: PyReadonlyArrayDyn<'_, u16> = a
        .try_readonly()
        .map_err(|e| value_error(format!("{what}: {e}")))?;
    Ok(ro.as_array().iter().copied().collect())
}

fn f32s(obj: &Bound<'_, PyAny>, what: &str) -> PyResult<Vec<f32>> {
    let a = obj
        .cast::<numpy::PyArrayDyn<f32>>()
        .map_err(|_| value_error(format!("{what}: a float32 array is required")))?;
    if a.ndim() == 0 {
        return Err(value_error(format!("{what}: an array is required")));
    }
    let ro = a
        .try_readonly()
        .map_err(|e| value_error(format!("{what}: {e}")))?;
    Ok(ro.as_array().iter().copied().collect())
}

#[pymethods]
impl Layer {
    /// The layer of PLE site `site` of `checkpoint` (a `Checkpoint` or a
    /// path), its table served `table` = `"resident"`, `"mapped"` or
    /// `"cached"` (a row cache of `slots` rows), taking up to `max_tokens`
    /// rows per forward (longer calls are split).
    #[new]
    #[pyo3(signature = (checkpoint, site = 0, *, table = "cached", max_tokens = 256, slots = 65536))]
    fn py_new(
        py: Python<'_>,
        checkpoint: &Bound<'_, PyAny>,
        site: usize,
        table: &str,
        max_tokens: usize,
        slots: usize,
    ) -> PyResult<Layer> {
        let ck = crate::checkpoint::Checkpoint::from_arg(py, checkpoint)?;
        Layer::from_checkpoint(py, ck, site, table, max_tokens, slots)
    }

    /// A layer from explicit weights and a BF16 table (no checkpoint): the
    /// hash constants, the shape, `key_proj [C, E]` and `value_proj [H, E]`
    /// as uint16 BF16 bits, the float32 norms `[C]` and `conv1d [C, k]`,
    /// and `table` as uint16 BF16 bits `[rows, head_dim]`.
    #[staticmethod]
    #[pyo3(signature = (
        *, hidden, hc_mult, head_dim, ngram_size, heads_per_ngram, multipliers,
        head_vocab_sizes, head_offsets, eos, conv_kernel, dilation, eps, key_proj,
        value_proj, norm_key, norm_query, norm_conv, conv1d, table, max_tokens = 256,
        vocab_size = None
    ))]
    #[allow(clippy::too_many_arguments)]
    fn from_weights(
        py: Python<'_>,
        hidden: usize,
        hc_mult: usize,
        head_dim: usize,
        ngram_size: usize,
        heads_per_ngram: usize,
        multipliers: Vec<u64>,
        head_vocab_sizes: Vec<u64>,
        head_offsets: Vec<u64>,
        eos: u32,
        conv_kernel: usize,
        dilation: usize,
        eps: f32,
        key_proj: &Bound<'_, PyAny>,
        value_proj: &Bound<'_, PyAny>,
        norm_key: &Bound<'_, PyAny>,
        norm_query: &Bound<'_, PyAny>,
        norm_conv: &Bound<'_, PyAny>,
        conv1d: &Bound<'_, PyAny>,
        table: &Bound<'_, PyAny>,
        max_tokens: usize,
        vocab_size: Option<u64>,
    ) -> PyResult<Layer> {
        let dims = PleIdDims {
            ngram_size,
            heads_per_ngram,
            multipliers,
            head_vocab_sizes,
            head_offsets,
            eos_token_id: eos,
            family: Default::default(),
        };
        let mut spec = SiteSpec::new(dims, head_dim, hidden, hc_mult, conv_kernel, dilation);
        spec.rms_eps = eps;
        let weights = PleWeights {
            key_proj: u16s(key_proj, "key_proj")?,
            value_proj: u16s(value_proj, "value_proj")?,
            norm_key: f32s(norm_key, "norm_key")?,
            norm_query: f32s(norm_query, "norm_query")?,
            norm_conv: f32s(norm_conv, "norm_conv")?,
            conv1d: f32s(conv1d, "conv1d")?,
            key_bias: Vec::new(),
            value_bias: Vec::new(),
        };
        let table_bits = u16s(table, "table")?;
        py.detach(|| -> anyhow::Result<Layer> {
            spec.validate()?;
            let gpu: Arc<dyn GpuBackend> = Arc::new(CpuBackend::new());
            let t = ResidentTable::from_bf16(gpu.clone(), &table_bits, head_dim)?;
            Layer::build(gpu, &spec, weights, Arc::new(t), max_tokens, vocab_size)
        })
        .map_err(py_err)
    }

    /// A new carry (one sequence's state); it resets on its first forward.
    fn new_carry(&self, py: Python<'_>) -> PyResult<Carry> {
        let shared = &self.shared;
        let st = py
            .detach(|| {
                let core = shared.core.lock();
                core.layer.new_seq_state(core.gpu.as_ref())
            })
            .map_err(py_err)?;
        Ok(Carry {
            shared: self.shared.clone(),
            state: Mutex::new(st),
        })
    }

    /// Run `tokens` of one sequence through the layer, adding the site's
    /// output into `hidden` (`len(tokens)` rows) in place. `mask` (one
    /// bool per token, `True`: masked) shuts a masked token's gate and
    /// stops later tokens' hash look-back there (DeepSeek-V4.1's
    /// `token_mask`, with the opposite polarity); a site of any other
    /// family raises `ValueError` naming it.
    #[pyo3(signature = (carry, tokens, hidden, *, mask = None))]
    fn prefill(
        &self,
        py: Python<'_>,
        carry: &Bound<'_, PyAny>,
        tokens: &Bound<'_, PyAny>,
        hidden: &Bound<'_, PyAny>,
        mask: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<()> {
        let carry = self.own(carry)?;
        let toks = args::tokens(tokens, "tokens", self.shared.vocab)?;
        let mask = self.mask_arg(mask, toks.len())?;
        let mut rw = args::highway(hidden, toks.len(), self.shared.width, "hidden")?;
        if toks.is_empty() {
            return Ok(());
        }
        let hw = args::values(&mut rw)?;
        let shared = &self.shared;
        let state = &carry.state;
        py.detach(|| {
            let core = shared.core.lock();
            let mut st = state.lock();
            Core::check_live(&st)?;
            core.prefill(&mut st, &toks, mask.as_deref(), hw)
        })
        .map_err(py_err)
    }

    /// One decode step: token `tokens[b]` for carry `carries[b]`, on row
    /// `b` of `hidden` (`len(carries)` rows), in place. A carry may appear
    /// once per call. `mask` holds one bool per carry (`True`: its token
    /// is masked), as in `prefill`.
    #[pyo3(signature = (carries, tokens, hidden, *, mask = None))]
    fn decode(
        &self,
        py: Python<'_>,
        carries: &Bound<'_, PyAny>,
        tokens: &Bound<'_, PyAny>,
        hidden: &Bound<'_, PyAny>,
        mask: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<()> {
        let list: Vec<Bound<'_, PyAny>> = carries
            .try_iter()
            .map_err(|_| value_error("carries: a sequence of Carry objects is required"))?
            .collect::<PyResult<_>>()?;
        let mut owned = Vec::with_capacity(list.len());
        let mut seen = HashSet::with_capacity(list.len());
        for c in &list {
            let c = self.own(c)?;
            if !seen.insert(c as *const Carry as usize) {
                return Err(value_error("carries: a carry appears twice in one batch"));
            }
            owned.push(&c.state);
        }
        let toks = args::tokens(tokens, "tokens", self.shared.vocab)?;
        if toks.len() != owned.len() {
            return Err(value_error(format!(
                "{} tokens given for {} carries",
                toks.len(),
                owned.len()
            )));
        }
        let mask = self.mask_arg(mask, toks.len())?;
        let mut rw = args::highway(hidden, toks.len(), self.shared.width, "hidden")?;
        if toks.is_empty() {
            return Ok(());
        }
        let hw = args::values(&mut rw)?;
        let shared = &self.shared;
        py.detach(|| {
            let core = shared.core.lock();
            let mut guards: Vec<_> = owned.iter().map(|m| m.lock()).collect();
            for (i, g) in guards.iter().enumerate() {
                Core::check_live(g).map_err(|e| e.context(format!("carries[{i}]")))?;
            }
            let mut states: Vec<&mut PleSeqState> = guards.iter_mut().map(|g| &mut **g).collect();
            core.decode(&mut states, &toks, mask.as_deref(), hw)
        })
        .map_err(py_err)
    }

    /// Hash a step once: `work` is a sequence of `(history, tokens)` pairs,
    /// the tokens a sequence ends with (only the last `context_len`
    /// matter; fewer act as a fresh sequence's EOS padding) and the tokens
    /// it runs next. The `Plan` holds the ids in step order, the distinct
    /// ids in read order and each id's slot among them.
    fn plan(&self, py: Python<'_>, work: &Bound<'_, PyAny>) -> PyResult<Plan> {
        let mut pairs: Vec<(Vec<u32>, Vec<u32>)> = Vec::new();
        for (i, item) in work
            .try_iter()
            .map_err(|_| value_error("work: a sequence of (history, tokens) pairs is required"))?
            .enumerate()
        {
            let item = item?;
            let (h, t): (Bound<'_, PyAny>, Bound<'_, PyAny>) = item.extract().map_err(|_| {
                value_error(format!("work[{i}]: a (history, tokens) pair is required"))
            })?;
            let vocab = self.shared.vocab;
            pairs.push((
                args::tokens(&h, &format!("work[{i}] history"), vocab)?,
                args::tokens(&t, &format!("work[{i}] tokens"), vocab)?,
            ));
        }
        let shared = &self.shared;
        let plan = py
            .detach(|| {
                let core = shared.core.lock();
                let work: Vec<SeqWork<'_>> =
                    pairs.iter().map(|(h, t)| SeqWork::new(h, t)).collect();
                core.layer.plan(&work)
            })
            .map_err(py_err)?;
        Ok(Plan {
            shared: self.shared.clone(),
            plan: Arc::new(plan),
        })
    }

    /// Start reading the table rows of `plan`, in its read order (advice:
    /// nothing changes but what is loaded).
    fn prefetch(&self, py: Python<'_>, plan: &Plan) -> PyResult<()> {
        self.own_plan(plan)?;
        let shared = &self.shared;
        py.detach(|| shared.core.lock().layer.prefetch(&plan.plan))
            .map_err(py_err)
    }

    /// The rows of `plan.distinct`, staged as an engine with kernels of its
    /// own gathers them: a float32 array `[len(plan.distinct), head_dim]`,
    /// row `i` the table row of `plan.distinct[i]` (converted from the
    /// table's row type); `rows[plan.slots]` are the rows of `plan.ids`.
    fn stage<'py>(
        &self,
        py: Python<'py>,
        plan: &Plan,
    ) -> PyResult<Bound<'py, numpy::PyArray2<f32>>> {
        self.own_plan(plan)?;
        let shared = &self.shared;
        let rows = py
            .detach(|| shared.core.lock().stage(&plan.plan))
            .map_err(py_err)?;
        let hd = self.shared.head_dim;
        let n = plan.plan.distinct().len();
        numpy::PyArray1::from_vec(py, rows).reshape([n, hd])
    }

    /// Width of one highway stream (H).
    #[getter]
    fn hidden_size(&self) -> usize {
        self.shared.width.hidden
    }
    /// Highway streams (hc).
    #[getter]
    fn hc_mult(&self) -> usize {
        self.shared.width.hc
    }
    /// Values per highway row (C = hc * H).
    #[getter]
    fn channels(&self) -> usize {
        self.shared.width.channels()
    }
    /// Most rows per forward before the layer splits the call.
    #[getter]
    fn max_tokens(&self) -> usize {
        self.shared.max_tokens
    }
    /// Tokens of history a carry holds (ngram_size - 1).
    #[getter]
    fn context_len(&self) -> usize {
        self.shared.context_len
    }
    /// The EOS token.
    #[getter]
    fn eos(&self) -> u32 {
        self.shared.eos
    }
    /// Bytes of a snapshot of a carry that has run.
    #[getter]
    fn aux_blob_bytes(&self) -> usize {
        self.shared.aux_blob_bytes
    }
    /// Rows of conv state.
    #[getter]
    fn state_len(&self) -> usize {
        self.shared.state_len
    }
    /// Values per table row.
    #[getter]
    fn head_dim(&self) -> usize {
        self.shared.head_dim
    }
    /// Ids per token.
    #[getter]
    fn ngram_heads(&self) -> usize {
        self.shared.ngram_heads
    }

    fn __repr__(&self) -> String {
        format!(
            "Layer(hidden_size={}, hc_mult={}, max_tokens={})",
            self.shared.width.hidden, self.shared.width.hc, self.shared.max_tokens
        )
    }
}

/// A step hashed once by `Layer.plan`: the ids of every sequence's tokens
/// (`ids`, step order, `ngram_heads` a token), the distinct ids in the
/// order the step reads them (`distinct`), and for each id the index of
/// its row among them (`slots`). Immutable; it belongs to its layer.
#[pyclass(frozen, module = "metrale_ple", name = "Plan")]
pub struct Plan {
    shared: Arc<Shared>,
    plan: Arc<StepPlan>,
}

#[pymethods]
impl Plan {
    /// Every id, in step order: a uint64 array `[tokens, ngram_heads]`.
    #[getter]
    fn ids<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, numpy::PyArray2<u64>>> {
        let heads = self.plan.heads();
        let n = self.plan.ids().len() / heads.max(1);
        numpy::PyArray1::from_slice(py, self.plan.ids()).reshape([n, heads])
    }
    /// The distinct ids, in read order (uint64).
    #[getter]
    fn distinct<'py>(&self, py: Python<'py>) -> Bound<'py, numpy::PyArray1<u64>> {
        numpy::PyArray1::from_slice(py, self.plan.distinct())
    }
    /// For each id, the index of its row in `distinct`: an int64 array
    /// shaped as `ids`.
    #[getter]
    fn slots<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, numpy::PyArray2<i64>>> {
        let heads = self.plan.heads();
        let n = self.plan.slots().len() / heads.max(1);
        let wide: Vec<i64> = self.plan.slots().iter().map(|&s| i64::from(s)).collect();
        numpy::PyArray1::from_vec(py, wide).reshape([n, heads])
    }
    /// The ids of sequence `i` of the work, `[len(tokens), ngram_heads]`.
    fn seq_ids<'py>(
        &self,
        py: Python<'py>,
        i: usize,
    ) -> PyResult<Bound<'py, numpy::PyArray2<u64>>> {
        if i >= self.plan.len() {
            return Err(value_error(format!(
                "sequence {i}: the plan holds {}",
                self.plan.len()
            )));
        }
        let heads = self.plan.heads();
        let ids = self.plan.seq_ids(i);
        numpy::PyArray1::from_slice(py, ids).reshape([ids.len() / heads.max(1), heads])
    }
    fn __len__(&self) -> usize {
        self.plan.len()
    }
    fn __repr__(&self) -> String {
        format!(
            "Plan(sequences={}, ids={}, distinct={})",
            self.plan.len(),
            self.plan.ids().len(),
            self.plan.distinct().len()
        )
    }
}

/// One sequence's carry at one layer: token history and conv state.
///
/// A context manager: leaving the `with` block releases it. Released
/// carries refuse every use (`ValueError`) except `release`, which is
/// idempotent. A carry dropped unreleased is released then.
#[pyclass(frozen, module = "metrale_ple", name = "Carry")]
pub struct Carry {
    shared: Arc<Shared>,
    state: Mutex<PleSeqState>,
}

impl Carry {
    fn with<T: Send>(
        &self,
        py: Python<'_>,
        f: impl FnOnce(&Core, &mut PleSeqState) -> anyhow::Result<T> + Send,
    ) -> PyResult<T> {
        let shared = &self.shared;
        let state = &self.state;
        py.detach(|| {
            let core = shared.core.lock();
            let mut st = state.lock();
            f(&core, &mut st)
        })
        .map_err(py_err)
    }
}

impl Drop for Carry {
    fn drop(&mut self) {
        let core = self.shared.core.lock();
        let st = self.state.get_mut();
        let _ = core.layer.release_seq_state(st, core.gpu.as_ref());
    }
}

#[pymethods]
impl Carry {
    /// The carry as an aux blob (docs/SPEC.md, "Aux blob format").
    fn snapshot<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyBytes>> {
        let blob = self.with(py, |core, st| core.snapshot(st))?;
        Ok(PyBytes::new(py, &blob))
    }

    /// Install an aux blob from `snapshot`; a blob of the wrong size is
    /// refused with `ValueError` and changes nothing.
    fn restore(&self, py: Python<'_>, blob: Cow<'_, [u8]>) -> PyResult<()> {
        let blob: &[u8] = &blob;
        self.with(py, |core, st| core.restore(st, blob))
    }

    /// Start the sequence over: `context_len` EOS tokens of history and a
    /// zero conv state.
    fn reset(&self, py: Python<'_>) -> PyResult<()> {
        self.with(py, |core, st| {
            let blob = core.fresh_blob();
            core.restore(st, &blob)
        })
    }

    /// Free the carry's device memory. Idempotent.
    fn release(&self, py: Python<'_>) -> PyResult<()> {
        self.with(py, |core, st| {
            core.layer.release_seq_state(st, core.gpu.as_ref())
        })
    }

    /// The carried token history (empty before the first forward and after
    /// release).
    #[getter]
    fn history(&self) -> Vec<u32> {
        self.state.lock().history().to_vec()
    }

    /// Whether `release` has run.
    #[getter]
    fn released(&self) -> bool {
        self.state.lock().is_released()
    }

    fn __enter__(slf: Py<Self>) -> Py<Self> {
        slf
    }

    #[pyo3(signature = (*_exc))]
    fn __exit__(&self, py: Python<'_>, _exc: &Bound<'_, pyo3::types::PyTuple>) -> PyResult<bool> {
        self.release(py)?;
        Ok(false)
    }

    fn __repr__(&self) -> String {
        let st = self.state.lock();
        if st.is_released() {
            "Carry(released)".to_string()
        } else {
            format!("Carry(history={:?})", st.history())
        }
    }
}
