//! Tensor-parallel ranks from Python (docs/SPEC.md §5, "Tensor-parallel
//! shards"): `shard_checkpoint` writes ranks' shares of a checkpoint (as
//! `metrale-ple table shard`), and `TensorParallelEngine` runs sequences
//! over them, either every rank of a split in this process (one thread
//! and backend a rank, summing their projections through an in-process
//! all-reduce) or one rank whose projections a Python callable completes
//! (`reduce(partial)`: replace the float32 array's values, in place, with
//! their sum over every rank, e.g. through `torch.distributed.all_reduce`
//! on `torch.from_numpy(partial)`).
//!
//! Invariants: every call runs on every rank of the engine, in the same
//! order (a collective's requirement); a highway passed in is written only
//! after every rank finished the call and agreed bit for bit; the GIL is
//! released while the ranks run and taken back only to call `reduce`.

use std::path::PathBuf;
use std::sync::Arc;

use numpy::{PyArray1, PyArrayMethods};
use parking_lot::Mutex;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict};

use metrale_checkpoint::tensor_parallel::{RankCheckpoint, open_group, rank_dir_name, write_rank};
use metrale_engine::ple_site::PleSite;
use metrale_engine::{CarrySite, SeqId};
use metrale_gpu_runtime::cpu::CpuBackend;
use metrale_gpu_runtime::gpu::{DevicePtr, GpuBackend, StreamId};
use metrale_model_layers::layers::ple::highway;
use metrale_model_layers::layers::ple::{InProcessGroup, Reduce, ReduceError, TensorParallel};

use crate::args::{self, Width};
use crate::engine::{Inner, batch_arg, engine_config, stats_dict};
use crate::error::{py_err, value_error};

/// Write ranks' shares of the checkpoint `checkpoint` (a path): rank
/// `rank` of `ranks` into `out`, or every rank into
/// `out/rank-{r}-of-{ranks}` when `rank` is None. Returns the share
/// directories. A split that does not divide `head_dim`, or cuts a
/// 32-value FP8 scale block, raises `ValueError` naming the numbers.
#[pyfunction]
#[pyo3(signature = (checkpoint, out, *, ranks, rank = None))]
pub(crate) fn shard_checkpoint(
    py: Python<'_>,
    checkpoint: PathBuf,
    out: PathBuf,
    ranks: usize,
    rank: Option<usize>,
) -> PyResult<Vec<PathBuf>> {
    let targets: Vec<(usize, PathBuf)> = match rank {
        Some(r) => vec![(r, out)],
        None => (0..ranks)
            .map(|r| (r, out.join(rank_dir_name(r, ranks))))
            .collect(),
    };
    py.detach(|| {
        for (r, dir) in &targets {
            let tp = TensorParallel::new(*r, ranks)?;
            write_rank(&checkpoint, tp, dir, &mut |_, _| {})?;
        }
        Ok::<_, anyhow::Error>(())
    })
    .map_err(py_err)?;
    Ok(targets.into_iter().map(|(_, d)| d).collect())
}

/// A Python callable as a rank's all-reduce: called with the partial
/// projection as a 1-D float32 array, which it must overwrite with the sum
/// over every rank.
struct PyReduce {
    reduce: Py<PyAny>,
}

impl Reduce for PyReduce {
    fn all_reduce_sum(
        &self,
        gpu: &dyn GpuBackend,
        buf: DevicePtr,
        len: usize,
        stream: StreamId,
    ) -> Result<(), ReduceError> {
        let mut vals = vec![0f32; len];
        gpu.copy_d2h_on_stream(buf, highway::f32_bytes_mut(&mut vals), stream)?;
        Python::attach(|py| -> PyResult<()> {
            let arr = PyArray1::from_slice(py, &vals);
            self.reduce.call1(py, (arr.clone(),))?;
            let ro = arr.readonly();
            vals.copy_from_slice(ro.as_slice()?);
            Ok(())
        })?;
        gpu.copy_h2d_async(highway::f32_bytes(&vals), buf, stream)?;
        Ok(())
    }
}

/// One rank: its engine.
type Ranks = Vec<Inner>;

/// Sequences over tensor-parallel ranks' shares of one checkpoint (the
/// directories `shard_checkpoint` or `metrale-ple table shard` wrote, rank
/// 0 first). Without `reduce`, every rank of the split runs in this
/// process and `rank_dirs` lists them all; with `reduce`, `rank_dirs` is
/// this process's one rank and `reduce(partial)` completes each
/// projection (see the module docs). The outputs are the whole model's to
/// float32 accuracy (the partial sums round differently), the same bits
/// on every rank. The methods are `Engine`'s. A context manager.
#[pyclass(frozen, module = "metrale_ple", name = "TensorParallelEngine")]
pub struct TensorParallelEngine {
    ranks: Arc<Mutex<Option<Ranks>>>,
    width: Width,
    vocab: u64,
    table_bytes: Vec<u64>,
}

impl TensorParallelEngine {
    /// Run `f` on every rank (each on a thread of its own when there are
    /// several) without the GIL; the ranks' results in rank order.
    fn each<T: Send>(
        &self,
        py: Python<'_>,
        f: impl Fn(usize, &mut Inner) -> anyhow::Result<T> + Sync,
    ) -> PyResult<Vec<T>> {
        let ranks = &self.ranks;
        py.detach(|| {
            let mut g = ranks.lock();
            let engines = g
                .as_mut()
                .ok_or_else(|| anyhow::anyhow!("the engine is closed"))?;
            if engines.len() == 1 {
                return Ok(vec![f(0, &mut engines[0])?]);
            }
            let f = &f;
            std::thread::scope(|s| {
                let hs: Vec<_> = engines
                    .iter_mut()
                    .enumerate()
                    .map(|(r, e)| s.spawn(move || f(r, e)))
                    .collect();
                hs.into_iter()
                    .enumerate()
                    .map(|(r, h)| {
                        h.join().unwrap_or_else(|_| {
                            Err(anyhow::anyhow!("tensor-parallel rank {r} panicked"))
                        })
                    })
                    .collect::<anyhow::Result<Vec<T>>>()
            })
        })
        .map_err(py_err)
    }

    /// Run `f` with a copy of `hw` on every rank and write the ranks'
    /// common result into `hw`.
    fn each_highway(
        &self,
        py: Python<'_>,
        hw: &mut [f32],
        f: impl Fn(&mut Inner, &mut [f32]) -> anyhow::Result<()> + Sync,
    ) -> PyResult<()> {
        let input: &[f32] = hw;
        let outs = self.each(py, |_, e| {
            let mut mine = input.to_vec();
            f(e, &mut mine)?;
            Ok(mine)
        })?;
        if let Some(r) = outs.iter().position(|o| {
            o.iter()
                .zip(&outs[0])
                .any(|(a, b)| a.to_bits() != b.to_bits())
        }) {
            return Err(value_error(format!(
                "tensor-parallel rank {r} computed other bits than rank 0"
            )));
        }
        hw.copy_from_slice(&outs[0]);
        Ok(())
    }

    /// The one value every rank returned.
    fn agreed<T: PartialEq + std::fmt::Debug>(mut v: Vec<T>, what: &str) -> PyResult<T> {
        if let Some(r) = v.iter().position(|x| x != &v[0]) {
            return Err(value_error(format!(
                "tensor-parallel rank {r} {what} {:?}, rank 0 {:?}",
                v[r], v[0]
            )));
        }
        Ok(v.swap_remove(0))
    }
}

/// Engines over `group`, rank `r` reducing through `reduces[r]`.
fn build(
    group: &[RankCheckpoint],
    reduces: Vec<Arc<dyn Reduce>>,
    mode: metrale_checkpoint::runtime::TableMode,
    slots: usize,
    max_tokens: usize,
    resident_carries: usize,
    cfg: &metrale_engine::EngineConfig,
) -> anyhow::Result<Ranks> {
    let mut out = Vec::with_capacity(group.len());
    for (rc, reduce) in group.iter().zip(reduces) {
        let gpu: Arc<dyn GpuBackend> = Arc::new(CpuBackend::new());
        let mut sites = Vec::with_capacity(rc.ck.sites.len());
        for i in 0..rc.ck.sites.len() {
            let cache = metrale_storage::cached::CacheConfig::new(slots);
            let table = rc.ck.serve_table(i, mode, cache, gpu.clone())?;
            let layer = rc.build_layer(i, table, max_tokens, gpu.as_ref(), reduce.clone());
            match layer {
                Ok(l) => sites.push(PleSite::new(l)),
                Err(e) => {
                    for mut s in sites {
                        let _ = CarrySite::free(&mut s, gpu.as_ref());
                    }
                    return Err(e.into());
                }
            }
        }
        let mut cfg = cfg.clone();
        if resident_carries > 0 {
            let carry: usize = sites.iter().map(CarrySite::carry_bytes).sum();
            cfg.device_budget_bytes = resident_carries.saturating_mul(carry);
        }
        out.push(Inner::new(gpu, sites, cfg)?);
    }
    Ok(out)
}

#[pymethods]
impl TensorParallelEngine {
    #[new]
    #[pyo3(signature = (
        rank_dirs, *, reduce = None, table = "cached", block_size = 64, prefix_cache_mib = 64,
        resident_carries = 32, prefill_chunk = 128, max_batch = 64, slots = 65536
    ))]
    #[allow(clippy::too_many_arguments)]
    fn py_new(
        py: Python<'_>,
        rank_dirs: Vec<PathBuf>,
        reduce: Option<Py<PyAny>>,
        table: &str,
        block_size: usize,
        prefix_cache_mib: usize,
        resident_carries: usize,
        prefill_chunk: usize,
        max_batch: usize,
        slots: usize,
    ) -> PyResult<TensorParallelEngine> {
        if block_size == 0 || prefill_chunk == 0 || max_batch == 0 || slots == 0 {
            return Err(value_error(
                "block_size, prefill_chunk, max_batch and slots must be positive",
            ));
        }
        let mode = args::table_mode(table)?;
        let cfg = engine_config(prefill_chunk, block_size, prefix_cache_mib, "host", None)?;
        let max_tokens = prefill_chunk.max(max_batch);
        let (group, reduces) = match reduce {
            Some(f) => {
                if !f.bind(py).is_callable() {
                    return Err(value_error("reduce: a callable is required"));
                }
                let [dir] = rank_dirs.as_slice() else {
                    return Err(value_error(format!(
                        "with reduce, rank_dirs is this process's one rank, got {} directories",
                        rank_dirs.len()
                    )));
                };
                let rc = py.detach(|| RankCheckpoint::open(dir)).map_err(py_err)?;
                let r: Arc<dyn Reduce> = Arc::new(PyReduce { reduce: f });
                (vec![rc], vec![r])
            }
            None => {
                let group = py.detach(|| open_group(&rank_dirs)).map_err(py_err)?;
                let reduces = InProcessGroup::ranks(group.len());
                (group, reduces)
            }
        };
        let ranks = py
            .detach(|| {
                build(
                    &group,
                    reduces,
                    mode,
                    slots,
                    max_tokens,
                    resident_carries,
                    &cfg,
                )
            })
            .map_err(py_err)?;
        let spec = &group[0].ck.spec;
        Ok(TensorParallelEngine {
            ranks: Arc::new(Mutex::new(Some(ranks))),
            width: Width {
                hc: spec.hc_mult,
                hidden: spec.hidden_size,
            },
            vocab: spec.vocab_size,
            table_bytes: group.iter().map(|rc| rc.ck.table_bytes()).collect(),
        })
    }

    /// As `Engine.add_sequence`: `(seq_id, restored_tokens)`.
    fn add_sequence(&self, py: Python<'_>, prompt: &Bound<'_, PyAny>) -> PyResult<(SeqId, usize)> {
        let prompt = args::tokens(prompt, "prompt", Some(self.vocab))?;
        let got = self.each(py, |_, e| {
            let a = e.add_sequence(&prompt)?;
            Ok((a.id, a.cached))
        })?;
        Self::agreed(got, "added the sequence as")
    }

    /// As `Engine.prefill`: `hidden` updated in place.
    fn prefill(
        &self,
        py: Python<'_>,
        seq_id: SeqId,
        tokens: &Bound<'_, PyAny>,
        hidden: &Bound<'_, PyAny>,
    ) -> PyResult<()> {
        let toks = args::tokens(tokens, "tokens", Some(self.vocab))?;
        let mut rw = args::highway(hidden, toks.len(), self.width, "hidden")?;
        let hw = args::values(&mut rw)?;
        self.each_highway(py, hw, |e, h| Ok(e.prefill(seq_id, &toks, h)?))
    }

    /// As `Engine.decode`: `hidden` updated in place.
    fn decode(
        &self,
        py: Python<'_>,
        batch: &Bound<'_, PyAny>,
        hidden: &Bound<'_, PyAny>,
    ) -> PyResult<()> {
        let batch = batch_arg(batch, self.vocab)?;
        let mut rw = args::highway(hidden, batch.len(), self.width, "hidden")?;
        let hw = args::values(&mut rw)?;
        self.each_highway(py, hw, |e, h| Ok(e.decode(&batch, h)?))
    }

    /// As `Engine.snapshot`: the carry is the unsharded site's, the same
    /// on every rank, so the snapshot restores on any rank or engine.
    fn snapshot<'py>(&self, py: Python<'py>, seq_id: SeqId) -> PyResult<Bound<'py, PyBytes>> {
        let got = self.each(py, |_, e| Ok(e.snapshot(seq_id)?))?;
        let snap = Self::agreed(got, "snapshot")?;
        Ok(PyBytes::new(py, &snap))
    }

    /// As `Engine.add_from_snapshot`: the new sequence's id.
    fn add_from_snapshot(
        &self,
        py: Python<'_>,
        snapshot: &[u8],
        tokens: &Bound<'_, PyAny>,
    ) -> PyResult<SeqId> {
        let toks = args::tokens(tokens, "tokens", Some(self.vocab))?;
        let got = self.each(py, |_, e| Ok(e.add_from_snapshot(snapshot, &toks)?))?;
        Self::agreed(got, "restored the sequence as")
    }

    /// As `Engine.release`.
    fn release(&self, py: Python<'_>, seq_id: SeqId) -> PyResult<()> {
        self.each(py, |_, e| Ok(e.release(seq_id)?))?;
        Ok(())
    }

    /// Rank 0's counters (as `Engine.stats`), with `ranks`, each rank's
    /// `rank_table_bytes` (table data it stores) and `rank_bytes_read`.
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let got = self.each(py, |_, e| Ok((e.stats(), e.table_stats())))?;
        let d = stats_dict(py, &got[0].0, &got[0].1)?;
        d.set_item("ranks", got.len())?;
        d.set_item("rank_table_bytes", self.table_bytes.clone())?;
        let read: Vec<u64> = got.iter().map(|(_, t)| t.bytes_read).collect();
        d.set_item("rank_bytes_read", read)?;
        Ok(d)
    }

    /// The number of ranks this engine runs.
    #[getter]
    fn ranks(&self) -> usize {
        self.table_bytes.len()
    }

    /// Values per highway row (`hc_mult * hidden_size`).
    #[getter]
    fn width(&self) -> usize {
        self.width.channels()
    }

    /// Free every rank's engine; later calls raise `ValueError`.
    fn close(&self, py: Python<'_>) -> PyResult<()> {
        let ranks = &self.ranks;
        py.detach(|| {
            if let Some(engines) = ranks.lock().take() {
                for e in engines {
                    e.close()?;
                }
            }
            Ok::<_, anyhow::Error>(())
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
}
