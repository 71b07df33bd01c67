//! `metrale_ple.Engine`: sequences over every PLE site of a checkpoint, as
//! a server drives them (add with prefix-cache restore, chunked prefill,
//! batched decode, speculative verify and commit, snapshots, swaps,
//! release).
//!
//! The engine lives behind one mutex and every call releases the GIL while
//! it runs, so one engine can be driven from several Python threads (the
//! calls serialise). Highway arrays follow the rules of [`crate::args`]:
//! `len(tokens)` rows of `hc_mult * hidden_size` float32 values, updated in
//! place.

use std::borrow::Cow;
use std::path::PathBuf;
use std::sync::Arc;

use parking_lot::Mutex;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict};

use metrale_checkpoint::Checkpoint as CkInner;
use metrale_checkpoint::runtime::TableMode;
use metrale_engine::ple_site::PleSite;
use metrale_engine::{CarrySite, EngineConfig, EngineStats, SeqId, SwapTarget};
use metrale_gpu_runtime::cpu::CpuBackend;
use metrale_gpu_runtime::gpu::GpuBackend;
use metrale_storage::cached::CacheConfig;
use metrale_storage::remote::RemoteTier;
use metrale_storage::remote::redis::{RedisTier, link_config, parse_urls};
use metrale_storage::table::TableStats;

use crate::args::{self, Width};
use crate::checkpoint::Checkpoint;
use crate::error::{py_err, value_error};

/// The engine type the bindings drive.
pub(crate) type Inner = metrale_engine::Engine<PleSite>;

/// How to build an engine over a checkpoint.
#[derive(Clone, Debug)]
pub(crate) struct Setup {
    /// How table rows are served.
    pub mode: TableMode,
    /// Row-cache slots per site (cached tables).
    pub slots: usize,
    /// The remote servers a cached table reads its misses from.
    pub remote: Option<args::RemoteSetup>,
    /// Most rows per layer forward (prefill chunk and decode batch).
    pub max_tokens: usize,
    /// Carries the device budget holds; 0: no limit.
    pub resident_carries: usize,
    /// The engine settings (the budget is set from `resident_carries`).
    pub engine: EngineConfig,
}

/// The facts about an engine the bindings check arguments against.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Facts {
    /// The highway row shape.
    pub width: Width,
    /// Tokens must be below this.
    pub vocab: u64,
    /// Device bytes one sequence's carry holds.
    pub carry_bytes: usize,
    /// Most sequences per batched forward.
    pub batch_capacity: usize,
}

/// An engine over every site of `ck` on a new CPU backend.
pub(crate) fn build(ck: &CkInner, s: &Setup) -> anyhow::Result<(Inner, Facts)> {
    anyhow::ensure!(
        s.max_tokens > 0,
        "prefill_chunk and max_batch must be positive"
    );
    anyhow::ensure!(
        s.mode != TableMode::Cached || s.slots > 0,
        "slots must be positive"
    );
    let gpu: Arc<dyn GpuBackend> = Arc::new(CpuBackend::new());
    let remote: Option<Arc<dyn RemoteTier>> = match &s.remote {
        Some(r) => Some(Arc::new(RedisTier::open(
            &parse_urls(&r.urls),
            link_config(r.timeout_ms),
        )?)),
        None => None,
    };
    let mut sites = Vec::with_capacity(ck.sites.len());
    for i in 0..ck.sites.len() {
        // The cache settings count only for a cached table.
        let mut cfg = CacheConfig::new(s.slots);
        cfg.remote = remote.clone();
        cfg.remote_fallback = s.remote.as_ref().is_some_and(|r| r.fallback);
        let table = ck.serve_table(i, s.mode, cfg, gpu.clone())?;
        let layer = ck.build_layer(i, table, s.max_tokens, gpu.as_ref())?;
        sites.push(PleSite::new(layer));
    }
    let mut cfg = s.engine.clone();
    if s.resident_carries > 0 {
        let carry: usize = sites.iter().map(CarrySite::carry_bytes).sum();
        cfg.device_budget_bytes = s.resident_carries.saturating_mul(carry);
    }
    let engine = Inner::new(gpu, sites, cfg)?;
    let facts = Facts {
        width: Width {
            hc: ck.spec.hc_mult,
            hidden: ck.spec.hidden_size,
        },
        vocab: ck.spec.vocab_size,
        carry_bytes: engine.carry_bytes(),
        batch_capacity: engine.batch_capacity(),
    };
    Ok((engine, facts))
}

/// The engine's counters, the row tables' and the budget's, as a dict.
pub(crate) fn stats_dict<'py>(
    py: Python<'py>,
    st: &EngineStats,
    t: &TableStats,
) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("sequences", st.sequences)?;
    d.set_item("resident", st.resident)?;
    d.set_item("swapped_host", st.swapped_host)?;
    d.set_item("swapped_file", st.swapped_file)?;
    d.set_item("swap_host_bytes", st.swap_host_bytes)?;
    d.set_item("swap_outs", st.swap_outs)?;
    d.set_item("swap_ins", st.swap_ins)?;
    d.set_item("preemptions", st.preemptions)?;
    d.set_item("prefix_hits", st.prefix_hits)?;
    d.set_item("prefix_tokens_restored", st.prefix_tokens_restored)?;
    d.set_item("cache_snapshot_failures", st.cache_snapshot_failures)?;
    d.set_item("prefill_tokens", st.prefill_tokens)?;
    d.set_item("decode_tokens", st.decode_tokens)?;
    d.set_item("masked_boundaries_skipped", st.masked_boundaries_skipped)?;
    d.set_item("masked_eager_steps", st.masked_eager_steps)?;
    d.set_item("graph_replays", st.graph_replays)?;
    d.set_item("graph_captures", st.graph_captures)?;
    d.set_item("verifies", st.verifies)?;
    d.set_item("accepted_tokens", st.accepted_tokens)?;
    d.set_item("rejected_tokens", st.rejected_tokens)?;
    let b = PyDict::new(py);
    b.set_item("limit_bytes", st.budget.limit_bytes)?;
    b.set_item("used_bytes", st.budget.used_bytes)?;
    b.set_item("peak_bytes", st.budget.peak_bytes)?;
    b.set_item("resident", st.budget.resident)?;
    d.set_item("budget", b)?;
    let p = PyDict::new(py);
    p.set_item("entries", st.prefix_cache.entries)?;
    p.set_item("used_bytes", st.prefix_cache.used_bytes)?;
    p.set_item("capacity_bytes", st.prefix_cache.capacity_bytes)?;
    p.set_item("hits", st.prefix_cache.hits)?;
    p.set_item("misses", st.prefix_cache.misses)?;
    d.set_item("prefix_cache", p)?;
    let tb = PyDict::new(py);
    tb.set_item("hits", t.hits)?;
    tb.set_item("misses", t.misses)?;
    tb.set_item("evictions", t.evictions)?;
    tb.set_item("bytes_read", t.bytes_read)?;
    tb.set_item("read_calls", t.read_calls)?;
    tb.set_item("io_wait_ns", t.io_wait_ns)?;
    d.set_item("table", tb)?;
    Ok(d)
}

/// An engine over every PLE site of a checkpoint (CPU backend).
///
/// `table` serves the rows (`"cached"` with `slots` rows per site,
/// `"mapped"`, `"resident"`); the prefix cache holds `prefix_cache_mib`
/// MiB of snapshots at `block_size`-token boundaries (0 disables it); the
/// device budget holds `resident_carries` carries (0: no limit) and the
/// engine preempts the least recently used ones to host memory (or to
/// files in `swap_dir` with `preempt_to="file"`). A context manager:
/// leaving the block closes the engine.
#[pyclass(frozen, module = "metrale_ple", name = "Engine")]
pub struct Engine {
    inner: Arc<Mutex<Option<Inner>>>,
    facts: Facts,
}

impl Engine {
    /// Run `f` on the open engine without the GIL.
    fn with<T: Send>(
        &self,
        py: Python<'_>,
        f: impl FnOnce(&mut Inner) -> anyhow::Result<T> + Send,
    ) -> PyResult<T> {
        let inner = &self.inner;
        py.detach(|| {
            let mut g = inner.lock();
            let e = g
                .as_mut()
                .ok_or_else(|| anyhow::anyhow!("the engine is closed"))?;
            f(e)
        })
        .map_err(py_err)
    }

    /// The shared engine (for the timing helper).
    pub(crate) fn shared(&self) -> (Arc<Mutex<Option<Inner>>>, Facts) {
        (self.inner.clone(), self.facts)
    }
}

fn swap_target(s: &str) -> PyResult<SwapTarget> {
    match s {
        "host" => Ok(SwapTarget::Host),
        "file" => Ok(SwapTarget::File),
        _ => Err(value_error(format!(
            "target must be \"host\" or \"file\", got {s:?}"
        ))),
    }
}

/// Engine settings from the keyword arguments; settings the bindings do
/// not expose keep the engine's defaults.
#[allow(clippy::needless_update)]
pub(crate) fn engine_config(
    prefill_chunk: usize,
    block_size: usize,
    prefix_cache_mib: usize,
    preempt_to: &str,
    swap_dir: Option<PathBuf>,
) -> PyResult<EngineConfig> {
    Ok(EngineConfig {
        prefill_chunk,
        block_size,
        prefix_cache_bytes: prefix_cache_mib
            .checked_mul(1 << 20)
            .ok_or_else(|| value_error("prefix_cache_mib is too large"))?,
        device_budget_bytes: usize::MAX,
        preempt_to: swap_target(preempt_to)?,
        swap_dir,
        ..EngineConfig::default()
    })
}

/// The `(seq_id, token)` pairs of a decode batch.
pub(crate) fn batch_arg(obj: &Bound<'_, PyAny>, vocab: u64) -> PyResult<Vec<(SeqId, u32)>> {
    let pairs: Vec<(i64, i64)> = obj.extract().map_err(|_| {
        value_error("batch: a sequence of (seq_id, token) pairs of ints is required")
    })?;
    pairs
        .into_iter()
        .enumerate()
        .map(|(i, (s, t))| {
            let s = SeqId::try_from(s)
                .map_err(|_| value_error(format!("batch[{i}]: seq_id {s} is negative")))?;
            match u32::try_from(t) {
                Ok(t) if u64::from(t) < vocab => Ok((s, t)),
                _ => Err(value_error(format!(
                    "batch[{i}]: token {t} is not below vocab_size {vocab}"
                ))),
            }
        })
        .collect()
}

#[pymethods]
impl Engine {
    #[new]
    #[pyo3(signature = (
        checkpoint, *, table = "cached", block_size = 64, prefix_cache_mib = 64,
        resident_carries = 32, prefill_chunk = 128, max_batch = 64, slots = 65536,
        preempt_to = "host", swap_dir = None, remote = None, remote_timeout_ms = 250,
        remote_fallback = false
    ))]
    #[allow(clippy::too_many_arguments)]
    fn py_new(
        py: Python<'_>,
        checkpoint: &Bound<'_, PyAny>,
        table: &str,
        block_size: usize,
        prefix_cache_mib: usize,
        resident_carries: usize,
        prefill_chunk: usize,
        max_batch: usize,
        slots: usize,
        preempt_to: &str,
        swap_dir: Option<PathBuf>,
        remote: Option<String>,
        remote_timeout_ms: u64,
        remote_fallback: bool,
    ) -> PyResult<Engine> {
        let ck = Checkpoint::from_arg(py, checkpoint)?;
        if block_size == 0 || prefill_chunk == 0 || max_batch == 0 {
            return Err(value_error(
                "block_size, prefill_chunk and max_batch must be positive",
            ));
        }
        let (mode, remote) = args::table_setup(table, remote, remote_timeout_ms, remote_fallback)?;
        let setup = Setup {
            mode,
            remote,
            slots,
            max_tokens: prefill_chunk.max(max_batch),
            resident_carries,
            engine: engine_config(
                prefill_chunk,
                block_size,
                prefix_cache_mib,
                preempt_to,
                swap_dir,
            )?,
        };
        let (engine, facts) = py.detach(|| build(&ck, &setup)).map_err(py_err)?;
        Ok(Engine {
            inner: Arc::new(Mutex::new(Some(engine))),
            facts,
        })
    }

    /// Add a sequence that will run `prompt`; returns `(seq_id,
    /// restored_tokens)`: the leading prompt tokens restored from the
    /// prefix cache. Prefill `prompt[restored_tokens:]` next. With `mask`
    /// (one bool per prompt token, `True`: masked; DeepSeek-V4.1 sites
    /// only), only a prefix before the first masked token is restored;
    /// prefill the rest with `mask[restored_tokens:]`.
    #[pyo3(signature = (prompt, *, mask = None))]
    fn add_sequence(
        &self,
        py: Python<'_>,
        prompt: &Bound<'_, PyAny>,
        mask: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<(SeqId, usize)> {
        let prompt = args::tokens(prompt, "prompt", Some(self.facts.vocab))?;
        let mask = mask
            .map(|m| args::mask(m, "mask", prompt.len()))
            .transpose()?;
        let a = self.with(py, |e| {
            Ok(match &mask {
                Some(m) => e.add_sequence_masked(&prompt, m)?,
                None => e.add_sequence(&prompt)?,
            })
        })?;
        Ok((a.id, a.cached))
    }

    /// Run `tokens` through sequence `seq_id`, adding every site's output
    /// into `hidden` (`len(tokens)` rows) in place. `mask` (one bool per
    /// token, `True`: masked) shuts a masked token's gate and stops later
    /// tokens' hash look-back there (DeepSeek-V4.1's `token_mask`, with the
    /// opposite polarity); any other family raises `ValueError`.
    #[pyo3(signature = (seq_id, tokens, hidden, *, mask = None))]
    fn prefill(
        &self,
        py: Python<'_>,
        seq_id: SeqId,
        tokens: &Bound<'_, PyAny>,
        hidden: &Bound<'_, PyAny>,
        mask: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<()> {
        let toks = args::tokens(tokens, "tokens", Some(self.facts.vocab))?;
        let mask = mask
            .map(|m| args::mask(m, "mask", toks.len()))
            .transpose()?;
        let mut rw = args::highway(hidden, toks.len(), self.facts.width, "hidden")?;
        let hw = args::values(&mut rw)?;
        self.with(py, |e| {
            match &mask {
                Some(m) => e.prefill_masked(seq_id, &toks, m, hw)?,
                None => e.prefill(seq_id, &toks, hw)?,
            }
            Ok(())
        })
    }

    /// One decode step: `batch` is a list of `(seq_id, token)` pairs and
    /// row `b` of `hidden` belongs to `batch[b]`; updated in place. `mask`
    /// holds one bool per pair (`True`: that token is masked), as in
    /// `prefill`.
    #[pyo3(signature = (batch, hidden, *, mask = None))]
    fn decode(
        &self,
        py: Python<'_>,
        batch: &Bound<'_, PyAny>,
        hidden: &Bound<'_, PyAny>,
        mask: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<()> {
        let batch = batch_arg(batch, self.facts.vocab)?;
        let mask = mask
            .map(|m| args::mask(m, "mask", batch.len()))
            .transpose()?;
        let mut rw = args::highway(hidden, batch.len(), self.facts.width, "hidden")?;
        let hw = args::values(&mut rw)?;
        self.with(py, |e| {
            match &mask {
                Some(m) => e.decode_masked(&batch, m, hw)?,
                None => e.decode(&batch, hw)?,
            }
            Ok(())
        })
    }

    /// Speculative verify: run `draft` through `seq_id` (outputs in
    /// `hidden`, in place) keeping the carry from before it until `commit`.
    fn verify(
        &self,
        py: Python<'_>,
        seq_id: SeqId,
        draft: &Bound<'_, PyAny>,
        hidden: &Bound<'_, PyAny>,
    ) -> PyResult<()> {
        let toks = args::tokens(draft, "draft", Some(self.facts.vocab))?;
        let mut rw = args::highway(hidden, toks.len(), self.facts.width, "hidden")?;
        let hw = args::values(&mut rw)?;
        self.with(py, |e| Ok(e.verify(seq_id, &toks, hw)?))
    }

    /// Keep the first `accepted` tokens of the pending draft of `seq_id`.
    fn commit(&self, py: Python<'_>, seq_id: SeqId, accepted: usize) -> PyResult<()> {
        self.with(py, |e| Ok(e.commit(seq_id, accepted)?))
    }

    /// The sequence's carry over every site as a checksummed snapshot
    /// (docs/SPEC.md, "Snapshot container").
    fn snapshot<'py>(&self, py: Python<'py>, seq_id: SeqId) -> PyResult<Bound<'py, PyBytes>> {
        let blob = self.with(py, |e| Ok(e.snapshot(seq_id)?))?;
        Ok(PyBytes::new(py, &blob))
    }

    /// A new sequence whose carry is `snapshot` and whose tokens are
    /// `tokens` (the tokens the snapshot absorbed), run with `mask` when
    /// they were masked. A malformed or foreign snapshot, or one whose
    /// carried history is not that of `tokens` (and `mask`), raises
    /// `ValueError` and changes nothing.
    #[pyo3(signature = (snapshot, tokens, *, mask = None))]
    fn add_from_snapshot(
        &self,
        py: Python<'_>,
        snapshot: Cow<'_, [u8]>,
        tokens: &Bound<'_, PyAny>,
        mask: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<SeqId> {
        let toks = args::tokens(tokens, "tokens", Some(self.facts.vocab))?;
        let mask = mask
            .map(|m| args::mask(m, "mask", toks.len()))
            .transpose()?;
        let blob: &[u8] = &snapshot;
        self.with(py, |e| {
            Ok(match &mask {
                Some(m) => e.add_from_snapshot_masked(blob, &toks, m)?,
                None => e.add_from_snapshot(blob, &toks)?,
            })
        })
    }

    /// Move the carry of `seq_id` off the device (`"host"` or `"file"`).
    #[pyo3(signature = (seq_id, target = "host"))]
    fn swap_out(&self, py: Python<'_>, seq_id: SeqId, target: &str) -> PyResult<()> {
        let t = swap_target(target)?;
        self.with(py, |e| Ok(e.swap_out(seq_id, t)?))
    }

    /// Bring the carry of `seq_id` back to the device.
    fn swap_in(&self, py: Python<'_>, seq_id: SeqId) -> PyResult<()> {
        self.with(py, |e| Ok(e.swap_in(seq_id)?))
    }

    /// Release sequence `seq_id` and everything it holds.
    fn release(&self, py: Python<'_>, seq_id: SeqId) -> PyResult<()> {
        self.with(py, |e| Ok(e.release(seq_id)?))
    }

    /// Start the table reads `tokens` of `seq_id` will need (advice only).
    fn prefetch(&self, py: Python<'_>, seq_id: SeqId, tokens: &Bound<'_, PyAny>) -> PyResult<()> {
        let toks = args::tokens(tokens, "tokens", Some(self.facts.vocab))?;
        self.with(py, |e| Ok(e.prefetch(seq_id, &toks)?))
    }

    /// The tokens sequence `seq_id` has absorbed.
    fn tokens(&self, py: Python<'_>, seq_id: SeqId) -> PyResult<Vec<u32>> {
        self.with(py, |e| Ok(e.tokens(seq_id)?.to_vec()))
    }

    /// Whether the carry of `seq_id` is on the device.
    fn is_resident(&self, py: Python<'_>, seq_id: SeqId) -> PyResult<bool> {
        self.with(py, |e| Ok(e.is_resident(seq_id)?))
    }

    /// Live sequence ids, sorted.
    fn sequence_ids(&self, py: Python<'_>) -> PyResult<Vec<SeqId>> {
        self.with(py, |e| {
            let mut v = e.sequence_ids();
            v.sort_unstable();
            Ok(v)
        })
    }

    /// Drop every prefix-cache entry.
    fn clear_prefix_cache(&self, py: Python<'_>) -> PyResult<()> {
        self.with(py, |e| {
            e.clear_prefix_cache();
            Ok(())
        })
    }

    /// The engine's counters (and the row tables', the budget's and the
    /// prefix cache's) as a dict.
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let (st, t) = self.with(py, |e| Ok((e.stats(), e.table_stats())))?;
        stats_dict(py, &st, &t)
    }

    /// Values per highway row (`hc_mult * hidden_size`).
    #[getter]
    fn width(&self) -> usize {
        self.facts.width.channels()
    }
    /// Width of one highway stream.
    #[getter]
    fn hidden_size(&self) -> usize {
        self.facts.width.hidden
    }
    /// Highway streams.
    #[getter]
    fn hc_mult(&self) -> usize {
        self.facts.width.hc
    }
    /// Device bytes one sequence's carry holds over every site.
    #[getter]
    fn carry_bytes(&self) -> usize {
        self.facts.carry_bytes
    }
    /// Most sequences one batched forward takes (larger batches split).
    #[getter]
    fn batch_capacity(&self) -> usize {
        self.facts.batch_capacity
    }
    /// Whether `close` has run.
    #[getter]
    fn closed(&self) -> bool {
        self.inner.lock().is_none()
    }

    /// Release every sequence and free the engine. Idempotent; later calls
    /// raise `ValueError`.
    fn close(&self, py: Python<'_>) -> PyResult<()> {
        let inner = &self.inner;
        py.detach(|| match inner.lock().take() {
            Some(e) => e.close().map_err(anyhow::Error::from),
            None => Ok(()),
        })
        .map_err(py_err)
    }

    fn __enter__(slf: Py<Self>) -> Py<Self> {
        slf
    }

    #[pyo3(signature = (*_exc))]
    fn __exit__(&self, py: Python<'_>, _exc: &Bound<'_, pyo3::types::PyTuple>) -> PyResult<bool> {
        self.close(py)?;
        Ok(false)
    }

    fn __repr__(&self) -> String {
        format!(
            "Engine(width={}, carry_bytes={}, closed={})",
            self.facts.width.channels(),
            self.facts.carry_bytes,
            self.closed()
        )
    }
}
