//! Checkpoints from Python: `init_checkpoint` writes a synthetic one,
//! `Checkpoint.open` validates one and exposes its geometry and sites.

use std::path::PathBuf;
use std::sync::Arc;

use pyo3::prelude::*;
use pyo3::types::PyDict;

use metrale_checkpoint::{InitOptions, Preset, TableDType};
use metrale_model_layers::layers::ple::ids::PleIdHasher;

use crate::error::{py_err, value_error};
use crate::ids::{Bounds, Ids, hash};
use crate::layer::Layer;

/// Write a deterministic synthetic checkpoint (random weights from `seed`,
/// the real hash constants) into `path`, which must not exist or be empty,
/// and open it.
///
/// `preset` is `"tiny"`, `"small"`, `"flagship"` or a family preset
/// (`"engram-demo"`, `"deepseek-v4.1"`, `"longcat-flash-lite"`);
/// `table_rows` cuts the stored table (ids fold into it); `dtype` is
/// `"bf16"`, `"fp8"` or `"fp8-block"` (default: the family's, `"fp8-block"`
/// for DeepSeek-V4.1, else `"bf16"`). Raises `ValueError` for bad options
/// or a directory that already holds a checkpoint, `OSError` when writing
/// fails.
#[pyfunction]
#[pyo3(signature = (path, preset = "tiny", table_rows = None, dtype = None, seed = 0))]
pub(crate) fn init_checkpoint(
    py: Python<'_>,
    path: PathBuf,
    preset: &str,
    table_rows: Option<u64>,
    dtype: Option<&str>,
    seed: u64,
) -> PyResult<Checkpoint> {
    let preset =
        Preset::parse(preset).ok_or_else(|| value_error(format!("unknown preset {preset:?}")))?;
    let dtype = match dtype {
        None => preset.default_dtype(),
        Some(d) => TableDType::parse(d).ok_or_else(|| {
            value_error(format!(
                "dtype must be \"bf16\", \"fp8\" or \"fp8-block\", got {d:?}"
            ))
        })?,
    };
    let opts = InitOptions {
        preset,
        table_rows,
        dtype,
        seed,
    };
    let ck = py
        .detach(|| -> anyhow::Result<metrale_checkpoint::Checkpoint> {
            metrale_checkpoint::synth::write_synthetic(&path, &opts, &mut |_, _| {})?;
            Ok(metrale_checkpoint::Checkpoint::open(&path)?)
        })
        .map_err(py_err)?;
    Checkpoint::wrap(ck)
}

/// A validated checkpoint directory.
#[pyclass(frozen, module = "metrale_ple", name = "Checkpoint")]
pub struct Checkpoint {
    /// The loaded checkpoint (weights on the host, tables on disk).
    pub(crate) inner: Arc<metrale_checkpoint::Checkpoint>,
    sites: Vec<Py<Site>>,
}

impl Checkpoint {
    fn wrap(ck: metrale_checkpoint::Checkpoint) -> PyResult<Checkpoint> {
        let inner = Arc::new(ck);
        let sites = Python::attach(|py| -> PyResult<Vec<Py<Site>>> {
            (0..inner.sites.len())
                .map(|s| Py::new(py, Site::new(inner.clone(), s)?))
                .collect()
        })?;
        Ok(Checkpoint { inner, sites })
    }

    /// Open `path` without the GIL.
    pub(crate) fn open_path(py: Python<'_>, path: PathBuf) -> PyResult<Checkpoint> {
        let ck = py
            .detach(|| metrale_checkpoint::Checkpoint::open(&path))
            .map_err(py_err)?;
        Checkpoint::wrap(ck)
    }

    /// A checkpoint object, or a path to open.
    pub(crate) fn from_arg(
        py: Python<'_>,
        obj: &Bound<'_, PyAny>,
    ) -> PyResult<Arc<metrale_checkpoint::Checkpoint>> {
        if let Ok(c) = obj.cast::<Checkpoint>() {
            return Ok(c.get().inner.clone());
        }
        let path: PathBuf = obj.extract().map_err(|_| {
            value_error("checkpoint: a Checkpoint or a path (str or os.PathLike) is required")
        })?;
        Ok(Checkpoint::open_path(py, path)?.inner)
    }
}

#[pymethods]
impl Checkpoint {
    /// Open and fully validate the checkpoint in `path`. Raises `OSError`
    /// (`FileNotFoundError` for a missing one) when it cannot be read and
    /// `ValueError` when it is malformed.
    #[staticmethod]
    fn open(py: Python<'_>, path: PathBuf) -> PyResult<Checkpoint> {
        Checkpoint::open_path(py, path)
    }

    /// The checkpoint directory.
    #[getter]
    fn path(&self) -> PathBuf {
        self.inner.dir.clone()
    }

    /// The PLE sites, in `ple_layer_ids` order.
    #[getter]
    fn sites(&self, py: Python<'_>) -> Vec<Py<Site>> {
        self.sites.iter().map(|s| s.clone_ref(py)).collect()
    }

    /// The model geometry (the family, `"qwen4exp"`, `"engram"` or
    /// `"longcat"`, and the PLE fields of config.json) and the sizes derived
    /// from it, as a dict.
    #[getter]
    fn geometry<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let g = &self.inner.spec;
        let d = PyDict::new(py);
        d.set_item("family", g.family.name())?;
        d.set_item("vocab_size", g.vocab_size)?;
        d.set_item("hidden_size", g.hidden_size)?;
        d.set_item("hc_mult", g.hc_mult)?;
        d.set_item("rms_norm_eps", g.rms_norm_eps)?;
        d.set_item("eos_token_id", g.eos_token_id)?;
        d.set_item("ngram_size", g.ngram_size)?;
        d.set_item("heads_per_ngram", g.heads_per_ngram)?;
        d.set_item("head_dim", g.head_dim)?;
        d.set_item("ngram_vocab_size_base", g.ngram_vocab_size_base)?;
        d.set_item("divisible_by", g.divisible_by)?;
        d.set_item("split_ngram_parts", g.split_ngram_parts)?;
        d.set_item("conv_kernel_size", g.conv_kernel_size)?;
        d.set_item("ple_layer_ids", g.ple_layer_ids.clone())?;
        d.set_item("hash_seed", g.hash_seed)?;
        d.set_item("num_hidden_layers", g.num_hidden_layers)?;
        d.set_item("table_rows", g.table_rows)?;
        d.set_item("ngram_heads", g.ngram_heads())?;
        d.set_item("channels", g.channels())?;
        d.set_item("dilation", g.dilation())?;
        d.set_item("state_len", g.state_len())?;
        d.set_item("context_len", g.ngram_size - 1)?;
        d.set_item("aux_blob_bytes", g.aux_blob_bytes())?;
        d.set_item("carry_bytes_per_seq", g.carry_bytes_per_seq())?;
        Ok(d)
    }

    /// The layer of site `site` over its table served in `table` mode
    /// (`"resident"`, `"mapped"` or `"cached"` with `slots` rows).
    #[pyo3(signature = (site = 0, *, table = "cached", max_tokens = 256, slots = 65536))]
    fn layer(
        slf: &Bound<'_, Self>,
        site: usize,
        table: &str,
        max_tokens: usize,
        slots: usize,
    ) -> PyResult<Layer> {
        Layer::from_checkpoint(
            slf.py(),
            slf.get().inner.clone(),
            site,
            table,
            max_tokens,
            slots,
        )
    }

    fn __repr__(&self) -> String {
        format!(
            "Checkpoint({:?}, sites={}, hidden_size={}, hc_mult={})",
            self.inner.dir.display().to_string(),
            self.inner.sites.len(),
            self.inner.spec.hidden_size,
            self.inner.spec.hc_mult
        )
    }
}

/// One PLE site of a checkpoint: its hash constants and its id hash.
#[pyclass(frozen, module = "metrale_ple", name = "Site")]
pub struct Site {
    ck: Arc<metrale_checkpoint::Checkpoint>,
    index: usize,
    hasher: PleIdHasher,
}

impl Site {
    fn new(ck: Arc<metrale_checkpoint::Checkpoint>, index: usize) -> PyResult<Site> {
        let spec = &ck.sites[index].spec;
        let hasher = PleIdHasher::with_family(&spec.family, &spec.dims).map_err(py_err)?;
        Ok(Site { ck, index, hasher })
    }

    fn site(&self) -> &metrale_checkpoint::load::Site {
        &self.ck.sites[self.index]
    }
}

#[pymethods]
impl Site {
    /// The site's position in `ple_layer_ids`.
    #[getter]
    fn index(&self) -> usize {
        self.index
    }
    /// The 0-based model layer the site sits on.
    #[getter]
    fn layer(&self) -> usize {
        self.site().layer
    }
    /// Table rows the hash addresses (padded).
    #[getter]
    fn padded_rows(&self) -> u64 {
        self.site().padded_rows
    }
    /// Table rows stored in the checkpoint (ids fold into them when fewer).
    #[getter]
    fn stored_rows(&self) -> u64 {
        self.site().table.stored_rows
    }
    /// The hash multipliers.
    #[getter]
    fn multipliers(&self) -> Vec<u64> {
        self.site().spec.dims.multipliers.clone()
    }
    /// The prime size of each head.
    #[getter]
    fn head_vocab_sizes(&self) -> Vec<u64> {
        self.site().spec.dims.head_vocab_sizes.clone()
    }
    /// Where each head starts in the table.
    #[getter]
    fn head_offsets(&self) -> Vec<u64> {
        self.site().spec.dims.head_offsets.clone()
    }
    /// Ids per token.
    #[getter]
    fn ngram_heads(&self) -> usize {
        self.site().spec.dims.ngram_heads()
    }

    /// Hash `tokens` after `history` (default: a fresh sequence) into this
    /// site's row ids, as `metrale_ple.ids` with the site's constants.
    /// Engram sites also take DeepSeek-V4.1's document starts and masked
    /// positions (positions in `tokens`), as `metrale-ple ids
    /// --doc-starts/--masked` does.
    #[pyo3(signature = (tokens, history = None, *, doc_starts = None, masked = None))]
    fn ids(
        &self,
        py: Python<'_>,
        tokens: &Bound<'_, PyAny>,
        history: Option<&Bound<'_, PyAny>>,
        doc_starts: Option<Vec<usize>>,
        masked: Option<Vec<usize>>,
    ) -> PyResult<Ids> {
        hash(
            py,
            &self.hasher,
            self.ck.spec.vocab_size,
            self.site().padded_rows,
            tokens,
            history,
            &Bounds { doc_starts, masked },
        )
    }

    fn __repr__(&self) -> String {
        format!(
            "Site(index={}, layer={}, padded_rows={}, stored_rows={})",
            self.index,
            self.site().layer,
            self.site().padded_rows,
            self.site().table.stored_rows
        )
    }
}
