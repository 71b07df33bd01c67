//! How Rust errors reach Python.
//!
//! A failure whose cause chain holds an operating-system error becomes an
//! `OSError` (`FileNotFoundError` and `PermissionError` where the kind says
//! so); anything else a caller can cause (a bad argument, a malformed blob,
//! file or config, a refused engine call) becomes a `ValueError`. The
//! message is the whole cause chain, `: `-separated.

use std::io::ErrorKind;

use pyo3::PyErr;
use pyo3::exceptions::{PyFileNotFoundError, PyOSError, PyPermissionError, PyValueError};

/// The first I/O error in the cause chain of `err`.
fn io_kind(err: &anyhow::Error) -> Option<ErrorKind> {
    err.chain()
        .find_map(|e| e.downcast_ref::<std::io::Error>())
        .map(std::io::Error::kind)
}

/// `err` as the Python exception the module documents.
pub(crate) fn py_err(err: impl Into<anyhow::Error>) -> PyErr {
    let err: anyhow::Error = err.into();
    let msg = format!("{err:#}");
    match io_kind(&err) {
        Some(ErrorKind::NotFound) => PyFileNotFoundError::new_err(msg),
        Some(ErrorKind::PermissionDenied) => PyPermissionError::new_err(msg),
        Some(_) => PyOSError::new_err(msg),
        None => PyValueError::new_err(msg),
    }
}

/// A `ValueError` saying `msg`.
pub(crate) fn value_error(msg: impl Into<String>) -> PyErr {
    PyValueError::new_err(msg.into())
}
