//! Python bindings of the metrale-ple runtime: the native module
//! `metrale_ple._metrale_ple`, re-exported by the `metrale_ple` package
//! (`python/metrale_ple/`).
//!
//! - `ids`: the n-gram id hash with derived constants ([`ids`]);
//! - `init_checkpoint`, `Checkpoint`, `Site` ([`checkpoint`]);
//! - `Layer`, `Carry`, `Plan`: one site's forward, per-sequence carry and
//!   a step hashed once, with its rows staged for an engine that runs its
//!   own kernels ([`layer`]);
//! - `Engine`: sequences over every site with the prefix cache, swaps and
//!   speculation ([`engine`]);
//! - `Server`, `serve`: the serving loop over a fixed workload
//!   ([`server`]);
//! - `shard_checkpoint`, `TensorParallelEngine`: tensor-parallel ranks'
//!   shares of a checkpoint, and sequences over them ([`tensor_parallel`]);
//! - `_rust_decode_timing`: the engine's batched decode timed from Rust,
//!   beside which a Python loop's overhead is measured ([`timing`]).
//!
//! Everything runs on the CPU backend. Errors follow [`error`]: `OSError`
//! for I/O failures, `ValueError` for anything a caller passed wrong; the
//! arguments are checked ([`args`]) before memory is touched. Every object
//! holds its state behind a mutex and releases the GIL while it works, so
//! it can be shared between Python threads.

use pyo3::prelude::*;

mod args;
mod checkpoint;
mod engine;
mod error;
mod ids;
mod layer;
mod server;
mod tensor_parallel;
mod timing;

/// The native module.
#[pymodule]
#[pyo3(name = "_metrale_ple")]
fn metrale_ple_native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    m.add_function(wrap_pyfunction!(ids::ids, m)?)?;
    m.add_function(wrap_pyfunction!(ids::token_map, m)?)?;
    m.add_function(wrap_pyfunction!(checkpoint::init_checkpoint, m)?)?;
    m.add_function(wrap_pyfunction!(server::serve, m)?)?;
    m.add_function(wrap_pyfunction!(timing::_rust_decode_timing, m)?)?;
    m.add_function(wrap_pyfunction!(tensor_parallel::shard_checkpoint, m)?)?;
    m.add_class::<ids::Ids>()?;
    m.add_class::<checkpoint::Checkpoint>()?;
    m.add_class::<checkpoint::Site>()?;
    m.add_class::<layer::Layer>()?;
    m.add_class::<layer::Carry>()?;
    m.add_class::<layer::Plan>()?;
    m.add_class::<engine::Engine>()?;
    m.add_class::<server::Server>()?;
    m.add_class::<tensor_parallel::TensorParallelEngine>()?;
    Ok(())
}
