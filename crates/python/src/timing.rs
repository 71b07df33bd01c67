//! `_rust_decode_timing`: the engine's batched decode timed in a Rust loop,
//! the baseline `bench/overhead.py` sets the same calls from Python beside.

use std::time::Instant;

use pyo3::prelude::*;

use crate::engine::{Engine, batch_arg};
use crate::error::{py_err, value_error};

/// Run `steps` decode steps of `batch` (`(seq_id, token)` pairs; every
/// step feeds the same tokens) through `engine` from Rust, with the highway
/// rows in a Rust buffer filled with `value`, and return the seconds of
/// each step. The GIL is released throughout.
#[pyfunction]
#[pyo3(signature = (engine, batch, steps, value = 0.5))]
pub(crate) fn _rust_decode_timing(
    py: Python<'_>,
    engine: &Bound<'_, Engine>,
    batch: &Bound<'_, PyAny>,
    steps: usize,
    value: f32,
) -> PyResult<Vec<f64>> {
    let (inner, facts) = engine.get().shared();
    let batch = batch_arg(batch, facts.vocab)?;
    if batch.is_empty() {
        return Err(value_error("batch is empty"));
    }
    let width = facts.width.channels();
    py.detach(|| -> anyhow::Result<Vec<f64>> {
        let mut hw = vec![value; batch.len() * width];
        let mut times = Vec::with_capacity(steps);
        for _ in 0..steps {
            hw.fill(value);
            let t = Instant::now();
            let mut g = inner.lock();
            let e = g
                .as_mut()
                .ok_or_else(|| anyhow::anyhow!("the engine is closed"))?;
            e.decode(&batch, &mut hw)?;
            drop(g);
            times.push(t.elapsed().as_secs_f64());
        }
        Ok(times)
    })
    .map_err(py_err)
}
