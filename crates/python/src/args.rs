//! Checking what Python passes before any memory is touched: token lists,
//! highway arrays, table modes.
//!
//! Tokens are a list or tuple of ints, a 1-D integer numpy array, or
//! anything `numpy.asarray` turns into one (a torch tensor). A highway is a
//! C-contiguous, writeable float32 numpy array (or a CPU torch tensor, seen
//! through `tensor.numpy()`, which shares its memory) of `rows * width`
//! values whose last axis is the row width `C` (or `H`, after an axis of
//! `hc`); it is updated in place.

use numpy::{
    PyArrayDescrMethods, PyArrayDyn, PyArrayMethods, PyReadwriteArrayDyn, PyUntypedArray,
    PyUntypedArrayMethods,
};
use pyo3::prelude::*;
use pyo3::types::{PyList, PyTuple};

use metrale_storage::TableMode;

use crate::error::value_error;

/// `obj` as a numpy array: itself, or `numpy.asarray(obj)`.
fn as_ndarray<'py>(obj: &Bound<'py, PyAny>, what: &str) -> PyResult<Bound<'py, PyUntypedArray>> {
    if let Ok(a) = obj.cast::<PyUntypedArray>() {
        return Ok(a.clone());
    }
    let np = obj.py().import("numpy")?;
    let a = np
        .call_method1("asarray", (obj,))
        .map_err(|e| value_error(format!("{what}: not array-like ({e})")))?;
    a.cast_into::<PyUntypedArray>()
        .map_err(|_| value_error(format!("{what}: numpy.asarray did not give an array")))
}

/// Token ids: every value in `0..=u32::MAX`, and below `vocab` when given.
pub(crate) fn tokens(obj: &Bound<'_, PyAny>, what: &str, vocab: Option<u64>) -> PyResult<Vec<u32>> {
    let wide: Vec<i64> = if obj.is_instance_of::<PyList>() || obj.is_instance_of::<PyTuple>() {
        obj.extract::<Vec<i64>>()
            .map_err(|e| value_error(format!("{what}: a sequence of ints is required ({e})")))?
    } else {
        let a = as_ndarray(obj, what)?;
        if a.ndim() != 1 {
            return Err(value_error(format!(
                "{what}: a 1-D array of token ids is required, got shape {:?}",
                a.shape()
            )));
        }
        let kind = a.dtype().kind();
        if kind != b'i' && kind != b'u' {
            return Err(value_error(format!(
                "{what}: an integer array is required, got dtype kind '{}'",
                kind as char
            )));
        }
        if kind == b'u' && a.dtype().itemsize() == 8 {
            // uint64 values above i64::MAX would wrap in an int64 cast.
            let big = a.call_method0("max").ok().filter(|_| a.len() > 0);
            if let Some(m) = big
                && m.extract::<u64>().is_ok_and(|m| m > u32::MAX as u64)
            {
                return Err(value_error(format!("{what}: token {m} is not a u32")));
            }
        }
        let cast = a.call_method1("astype", ("int64",))?;
        let arr = cast
            .cast_into::<PyArrayDyn<i64>>()
            .map_err(|_| value_error(format!("{what}: cannot read as int64")))?;
        let ro = arr
            .try_readonly()
            .map_err(|e| value_error(format!("{what}: {e}")))?;
        ro.as_array().iter().copied().collect()
    };
    let mut out = Vec::with_capacity(wide.len());
    for (i, &t) in wide.iter().enumerate() {
        let Ok(v) = u32::try_from(t) else {
            return Err(value_error(format!(
                "{what}[{i}] = {t} is not a token id (0..=4294967295)"
            )));
        };
        if let Some(limit) = vocab
            && u64::from(v) >= limit
        {
            return Err(value_error(format!(
                "{what}[{i}] = {v} is not below vocab_size {limit}"
            )));
        }
        out.push(v);
    }
    Ok(out)
}

/// A token mask: one bool per token (`True`: masked), from a list or tuple
/// of bools, a 1-D numpy bool array, or anything `numpy.asarray` turns into
/// one (a torch bool tensor); exactly `n` flags. Ints are refused, so a
/// mask of ids or of 0/1 weights is not taken for one.
pub(crate) fn mask(obj: &Bound<'_, PyAny>, what: &str, n: usize) -> PyResult<Vec<bool>> {
    let empty_seq =
        (obj.is_instance_of::<PyList>() || obj.is_instance_of::<PyTuple>()) && obj.len()? == 0;
    let flags: Vec<bool> = if empty_seq {
        Vec::new()
    } else {
        let a = as_ndarray(obj, what)?;
        if a.ndim() != 1 {
            return Err(value_error(format!(
                "{what}: a 1-D sequence of bools is required, got shape {:?}",
                a.shape()
            )));
        }
        if a.dtype().kind() != b'b' {
            return Err(value_error(format!(
                "{what}: bools are required (True: masked), got dtype kind '{}'",
                a.dtype().kind() as char
            )));
        }
        let arr = a
            .cast_into::<PyArrayDyn<bool>>()
            .map_err(|_| value_error(format!("{what}: cannot read as bool")))?;
        let ro = arr
            .try_readonly()
            .map_err(|e| value_error(format!("{what}: {e}")))?;
        ro.as_array().iter().copied().collect()
    };
    if flags.len() != n {
        return Err(value_error(format!(
            "{what}: {} flags given for {n} tokens; give one flag per token",
            flags.len()
        )));
    }
    Ok(flags)
}

/// The shape of a highway row: `C` values, or `hc` streams of `H`.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Width {
    /// Streams.
    pub hc: usize,
    /// Values per stream.
    pub hidden: usize,
}

impl Width {
    /// Values per row.
    pub fn channels(self) -> usize {
        self.hc * self.hidden
    }
}

/// `obj` as a writeable float32 view of `rows` highway rows, checked.
pub(crate) fn highway<'py>(
    obj: &Bound<'py, PyAny>,
    rows: usize,
    width: Width,
    what: &str,
) -> PyResult<PyReadwriteArrayDyn<'py, f32>> {
    let py = obj.py();
    let arr: Bound<'py, PyUntypedArray> = if let Ok(a) = obj.cast::<PyUntypedArray>() {
        a.clone()
    } else if obj.hasattr("numpy")? && obj.hasattr("data_ptr")? {
        // A torch tensor: `numpy()` shares its memory (CPU tensors only).
        let view = obj.call_method0("numpy").map_err(|e| {
            value_error(format!(
                "{what}: cannot view the tensor as a numpy array ({e}); pass a contiguous \
                 float32 CPU tensor that does not require grad"
            ))
        })?;
        view.cast_into::<PyUntypedArray>()
            .map_err(|_| value_error(format!("{what}: tensor.numpy() is not an array")))?
    } else {
        return Err(value_error(format!(
            "{what}: a float32 numpy array (or CPU torch tensor) is required, got {}",
            obj.get_type().name()?
        )));
    };
    if !arr.dtype().is_equiv_to(&numpy::dtype::<f32>(py)) {
        return Err(value_error(format!(
            "{what}: dtype float32 is required, got {}",
            arr.dtype().str()?
        )));
    }
    let shape = arr.shape().to_vec();
    let c = width.channels();
    let last_ok = match shape.as_slice() {
        [.., l] if *l == c => true,
        [.., s, l] if *l == width.hidden && *s == width.hc => true,
        _ => false,
    };
    let size: usize = shape.iter().product();
    if !last_ok || Some(size) != rows.checked_mul(c) {
        return Err(value_error(format!(
            "{what}: {rows} rows of {c} values ([{rows}, {c}] or [{rows}, {}, {}]) are \
             required, got shape {shape:?}",
            width.hc, width.hidden
        )));
    }
    if !arr.is_c_contiguous() {
        return Err(value_error(format!(
            "{what}: a C-contiguous array is required (use numpy.ascontiguousarray)"
        )));
    }
    let typed = arr
        .cast_into::<PyArrayDyn<f32>>()
        .map_err(|_| value_error(format!("{what}: not a float32 array")))?;
    typed
        .try_readwrite()
        .map_err(|e| value_error(format!("{what}: cannot write to the array ({e})")))
}

/// The mutable values of a checked highway view.
pub(crate) fn values<'a>(rw: &'a mut PyReadwriteArrayDyn<'_, f32>) -> PyResult<&'a mut [f32]> {
    rw.as_slice_mut()
        .map_err(|e| value_error(format!("highway: {e}")))
}

/// How the rows are served: a table mode by name, or `"remote"` (a row
/// cache reading its misses from the servers `remote` names, with
/// timeouts of `timeout_ms` and, with `fallback`, the shard files behind).
pub(crate) fn table_setup(
    name: &str,
    remote: Option<String>,
    timeout_ms: u64,
    fallback: bool,
) -> PyResult<(TableMode, Option<RemoteSetup>)> {
    if name.eq_ignore_ascii_case("remote") {
        let Some(urls) = remote else {
            return Err(value_error(
                "table='remote' needs remote='redis://H:P[,redis://H:P...]'",
            ));
        };
        return Ok((
            TableMode::Cached,
            Some(RemoteSetup {
                urls,
                timeout_ms,
                fallback,
            }),
        ));
    }
    if remote.is_some() || fallback {
        return Err(value_error(
            "remote and remote_fallback go with table='remote'",
        ));
    }
    Ok((table_mode(name)?, None))
}

/// The remote row servers of `table="remote"`.
#[derive(Clone, Debug)]
pub(crate) struct RemoteSetup {
    /// The servers, comma-separated, in `table push`'s order.
    pub urls: String,
    /// Connect, read and write timeout (ms).
    pub timeout_ms: u64,
    /// Read a failed batch from the shard files.
    pub fallback: bool,
}

/// A table mode by name.
pub(crate) fn table_mode(name: &str) -> PyResult<TableMode> {
    name.parse::<TableMode>().map_err(|_| {
        value_error(format!(
            "table must be one of {:?}, got {name:?}",
            TableMode::names()
        ))
    })
}
