//! `metrale_ple.Server` and `metrale_ple.serve`: the engine's serving loop
//! (`metrale_engine::server`) over a fixed workload of requests.
//!
//! A request is a dict `{"prompt": [...], "generate": [...]}` (the prompt
//! prefilled in chunks, the generated tokens decoded one per step in
//! batches), a pair `(prompt, generate)`, or `{"tokens": [...],
//! "segments": [("prefill" | "decode", end), ...]}`. The input highway row
//! of a token comes from `rows(token)` (a callable returning
//! `hc_mult * hidden_size` floats; it must depend on the token alone), or
//! by default from a hashed pseudo-embedding in [-1, 1).

use std::sync::Arc;

use parking_lot::Mutex;
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList, PyTuple};

use metrale_engine::ple_site::PleSite;
use metrale_engine::server::{Phase, Request, ServerConfig, ServerReport, Workload};

use crate::args;
use crate::checkpoint::Checkpoint;
use crate::engine::{Facts, Setup, build, engine_config, stats_dict};
use crate::error::{py_err, value_error};

/// Clears the runner mark when a run ends, however it ends.
struct Clear<'a>(&'a Mutex<Option<std::thread::ThreadId>>);

impl Drop for Clear<'_> {
    fn drop(&mut self) {
        *self.0.lock() = None;
    }
}

/// The default input row of `token`: a hashed pseudo-embedding in [-1, 1).
fn embed(token: u32, out: &mut [f32]) {
    let mut s = 0xE3B0_C442_98FC_1C14 ^ u64::from(token).wrapping_mul(0xD6E8_FEB8_6659_FD93);
    for v in out {
        s = s.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = s;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^= z >> 31;
        *v = ((z >> 40) as f32 / (1u64 << 23) as f32) - 1.0;
    }
}

fn phase(s: &str) -> PyResult<Phase> {
    match s {
        "prefill" => Ok(Phase::Prefill),
        "decode" => Ok(Phase::Decode),
        _ => Err(value_error(format!(
            "segment phase must be \"prefill\" or \"decode\", got {s:?}"
        ))),
    }
}

/// One request from its Python form.
fn request(obj: &Bound<'_, PyAny>, i: usize, vocab: u64) -> PyResult<Request> {
    let what = format!("requests[{i}]");
    let (prompt, generate) = if let Ok(d) = obj.cast::<PyDict>() {
        if let Some(tokens) = d.get_item("tokens")? {
            let tokens = args::tokens(&tokens, &format!("{what}.tokens"), Some(vocab))?;
            let segs = d
                .get_item("segments")?
                .ok_or_else(|| value_error(format!("{what}: \"tokens\" needs \"segments\"")))?;
            let segs: Vec<(String, usize)> = segs.extract().map_err(|_| {
                value_error(format!(
                    "{what}.segments: a list of (phase, end) pairs is required"
                ))
            })?;
            let segments = segs
                .iter()
                .map(|(p, e)| Ok((phase(p)?, *e)))
                .collect::<PyResult<Vec<_>>>()?;
            return Ok(Request { tokens, segments });
        }
        let p = d.get_item("prompt")?.ok_or_else(|| {
            value_error(format!(
                "{what}: a \"prompt\" or \"tokens\" key is required"
            ))
        })?;
        let g = d.get_item("generate")?;
        (
            args::tokens(&p, &format!("{what}.prompt"), Some(vocab))?,
            match g {
                Some(g) => args::tokens(&g, &format!("{what}.generate"), Some(vocab))?,
                None => Vec::new(),
            },
        )
    } else if let Ok(t) = obj.cast::<PyTuple>()
        && t.len() == 2
    {
        (
            args::tokens(&t.get_item(0)?, &format!("{what}[0]"), Some(vocab))?,
            args::tokens(&t.get_item(1)?, &format!("{what}[1]"), Some(vocab))?,
        )
    } else {
        return Err(value_error(format!(
            "{what}: a dict with \"prompt\" (and \"generate\"), a (prompt, generate) pair, or \
             a dict with \"tokens\" and \"segments\" is required"
        )));
    };
    if prompt.is_empty() {
        return Err(value_error(format!("{what}: the prompt is empty")));
    }
    let mut tokens = prompt;
    let mut segments = vec![(Phase::Prefill, tokens.len())];
    if !generate.is_empty() {
        tokens.extend_from_slice(&generate);
        segments.push((Phase::Decode, tokens.len()));
    }
    Ok(Request { tokens, segments })
}

fn report_dict<'py>(py: Python<'py>, r: &ServerReport) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    let rows = PyList::empty(py);
    for req in &r.rows {
        rows.append(req.clone())?;
    }
    d.set_item("rows", rows)?;
    d.set_item("prefill_seconds", r.prefill_time.as_secs_f64())?;
    d.set_item("decode_seconds", r.decode_time.as_secs_f64())?;
    d.set_item("wall_seconds", r.wall.as_secs_f64())?;
    d.set_item("io_wait_seconds", r.io_wait.as_secs_f64())?;
    d.set_item("stats", stats_dict(py, &r.stats, &r.table)?)?;
    d.set_item("failed_calls", r.failed_calls)?;
    d.set_item("retried", r.retried)?;
    d.set_item("failed", r.failed.clone())?;
    d.set_item("first_fault", r.first_fault.clone())?;
    Ok(d)
}

/// Server settings from the keyword arguments; settings the bindings do
/// not expose keep the server's defaults.
#[allow(clippy::needless_update)]
fn server_config(
    in_flight: usize,
    prefill_chunk: usize,
    decode_batch: usize,
    prefetch: bool,
    retries: Option<u32>,
) -> ServerConfig {
    ServerConfig {
        in_flight,
        prefill_chunk,
        decode_batch,
        prefetch,
        decode_graphs: false,
        retries,
        ..ServerConfig::default()
    }
}

/// The serving loop over an engine of every PLE site of a checkpoint.
///
/// Engine options as for `Engine`; `in_flight` requests are admitted at
/// once, each step runs one batched decode of up to `decode_batch`
/// sequences and one prefill chunk of up to `prefill_chunk` tokens;
/// `retries` (None: the first failure raises) reruns the sequences of a
/// failed call. A context manager: leaving the block closes it.
#[pyclass(frozen, module = "metrale_ple", name = "Server")]
pub struct Server {
    inner: Arc<Mutex<Option<metrale_engine::Server<PleSite>>>>,
    facts: Facts,
    /// The thread inside `run`, so that a `rows` callback calling back into
    /// the server is refused instead of waiting on itself.
    runner: Mutex<Option<std::thread::ThreadId>>,
}

impl Server {
    fn check_not_inside(&self) -> PyResult<()> {
        if *self.runner.lock() == Some(std::thread::current().id()) {
            return Err(value_error(
                "the server is running on this thread (called from its rows callback)",
            ));
        }
        Ok(())
    }
}

#[pymethods]
impl Server {
    #[new]
    #[pyo3(signature = (
        checkpoint, *, table = "cached", block_size = 64, prefix_cache_mib = 64,
        resident_carries = 32, slots = 65536, in_flight = 48, prefill_chunk = 128,
        decode_batch = 16, prefetch = true, retries = None, remote = None,
        remote_timeout_ms = 250, remote_fallback = false
    ))]
    #[allow(clippy::too_many_arguments)]
    fn py_new(
        py: Python<'_>,
        checkpoint: &Bound<'_, PyAny>,
        table: &str,
        block_size: usize,
        prefix_cache_mib: usize,
        resident_carries: usize,
        slots: usize,
        in_flight: usize,
        prefill_chunk: usize,
        decode_batch: usize,
        prefetch: bool,
        retries: Option<u32>,
        remote: Option<String>,
        remote_timeout_ms: u64,
        remote_fallback: bool,
    ) -> PyResult<Server> {
        let ck = Checkpoint::from_arg(py, checkpoint)?;
        if block_size == 0 || prefill_chunk == 0 || decode_batch == 0 || in_flight == 0 {
            return Err(value_error(
                "block_size, prefill_chunk, decode_batch and in_flight must be positive",
            ));
        }
        let (mode, remote) = args::table_setup(table, remote, remote_timeout_ms, remote_fallback)?;
        let setup = Setup {
            mode,
            remote,
            slots,
            max_tokens: prefill_chunk.max(decode_batch),
            resident_carries,
            engine: engine_config(prefill_chunk, block_size, prefix_cache_mib, "host", None)?,
        };
        let cfg = server_config(in_flight, prefill_chunk, decode_batch, prefetch, retries);
        let (server, facts) = py
            .detach(|| -> anyhow::Result<_> {
                let (engine, facts) = build(&ck, &setup)?;
                Ok((metrale_engine::Server::new(engine, cfg)?, facts))
            })
            .map_err(py_err)?;
        Ok(Server {
            inner: Arc::new(Mutex::new(Some(server))),
            facts,
            runner: Mutex::new(None),
        })
    }

    /// Run `requests` to completion and return the report as a dict:
    /// `rows` (per request, per position: the fingerprint of the output
    /// row, or None where the prefix cache restored it), `prefill_seconds`,
    /// `decode_seconds`, `wall_seconds`, `io_wait_seconds` (time blocked
    /// waiting for table rows), `stats` (as `Engine.stats()`),
    /// `failed_calls`, `retried`, `failed`, `first_fault`.
    #[pyo3(signature = (requests, *, rows = None))]
    fn run<'py>(
        &self,
        py: Python<'py>,
        requests: &Bound<'py, PyAny>,
        rows: Option<Py<PyAny>>,
    ) -> PyResult<Bound<'py, PyDict>> {
        self.check_not_inside()?;
        let list: Vec<Bound<'_, PyAny>> = requests
            .try_iter()
            .map_err(|_| value_error("requests: a sequence of requests is required"))?
            .collect::<PyResult<_>>()?;
        let reqs = list
            .iter()
            .enumerate()
            .map(|(i, r)| request(r, i, self.facts.vocab))
            .collect::<PyResult<Vec<_>>>()?;
        let width = self.facts.width.channels();
        let failure: Mutex<Option<PyErr>> = Mutex::new(None);
        let call = |token: u32, out: &mut [f32]| {
            let Some(f) = &rows else {
                embed(token, out);
                return;
            };
            out.fill(0.0);
            if failure.lock().is_some() {
                return;
            }
            Python::attach(|py| {
                let r = f.call1(py, (token,)).and_then(|v| {
                    let v: Vec<f32> = v.extract(py)?;
                    if v.len() != width {
                        return Err(value_error(format!(
                            "rows({token}) returned {} values, {width} expected",
                            v.len()
                        )));
                    }
                    out.copy_from_slice(&v);
                    Ok(())
                });
                if let Err(e) = r {
                    failure.lock().get_or_insert(e);
                }
            });
        };
        let inner = &self.inner;
        let runner = &self.runner;
        let report = py.detach(|| -> anyhow::Result<ServerReport> {
            let mut g = inner.lock();
            *runner.lock() = Some(std::thread::current().id());
            let _clear = Clear(runner);
            let s = g
                .as_mut()
                .ok_or_else(|| anyhow::anyhow!("the server is closed"))?;
            let w = Workload {
                requests: &reqs,
                rows: &call,
            };
            Ok(s.run(w, &mut |_| {})?)
        });
        if let Some(e) = failure.lock().take() {
            return Err(e);
        }
        report_dict(py, &report.map_err(py_err)?)
    }

    /// The engine's counters, as `Engine.stats()`.
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        self.check_not_inside()?;
        let inner = &self.inner;
        let (st, t) = py
            .detach(|| -> anyhow::Result<_> {
                let g = inner.lock();
                let s = g
                    .as_ref()
                    .ok_or_else(|| anyhow::anyhow!("the server is closed"))?;
                Ok((s.engine().stats(), s.engine().table_stats()))
            })
            .map_err(py_err)?;
        stats_dict(py, &st, &t)
    }

    /// Free the engine. Idempotent.
    fn close(&self, py: Python<'_>) -> PyResult<()> {
        self.check_not_inside()?;
        let inner = &self.inner;
        py.detach(|| match inner.lock().take() {
            Some(s) => s.into_engine().close().map_err(anyhow::Error::from),
            None => Ok(()),
        })
        .map_err(py_err)
    }

    fn __enter__(slf: Py<Self>) -> Py<Self> {
        slf
    }

    #[pyo3(signature = (*_exc))]
    fn __exit__(&self, py: Python<'_>, _exc: &Bound<'_, PyTuple>) -> PyResult<bool> {
        self.close(py)?;
        Ok(false)
    }
}

/// Build a `Server` over `checkpoint`, run `requests` and close it; the
/// keyword arguments are `Server`'s, plus `rows` as for `Server.run`.
#[pyfunction]
#[pyo3(signature = (checkpoint, requests, *, rows = None, **kwargs))]
pub(crate) fn serve<'py>(
    py: Python<'py>,
    checkpoint: &Bound<'py, PyAny>,
    requests: &Bound<'py, PyAny>,
    rows: Option<Py<PyAny>>,
    kwargs: Option<&Bound<'py, PyDict>>,
) -> PyResult<Bound<'py, PyDict>> {
    let cls = py.get_type::<Server>();
    let server = cls.call((checkpoint,), kwargs)?;
    let server = server.cast_into::<Server>()?;
    let r = server.get().run(py, requests, rows);
    let c = server.get().close(py);
    let r = r?;
    c?;
    Ok(r)
}
