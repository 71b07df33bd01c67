//! `metrale_ple.ids`: derive a site's hash constants and hash tokens into
//! row ids, as `metrale-ple ids` does (docs/SPEC.md, "Id hash" and
//! "Constant derivation"); `metrale_ple.token_map`: Engram's
//! compressed-token map built from a tokenizer.json, as `metrale-ple
//! token-map` does (docs/SPEC.md §11).

use numpy::{PyArray2, PyArrayMethods, PyUntypedArrayMethods};
use pyo3::prelude::*;

use metrale_model_layers::layers::ple::family::engram::token_map_from_tokenizer_json;
use metrale_model_layers::layers::ple::ids::{
    Boundaries, DEFAULT_DIVISIBLE_BY, DEFAULT_HASH_SEED, PleHashParams, PleIdDims, PleIdHasher,
};

use crate::args;
use crate::error::{py_err, value_error};

/// The result of hashing: the row ids of the new tokens, the site's hash
/// constants and the history after the tokens.
#[pyclass(frozen, module = "metrale_ple", name = "Ids")]
pub struct Ids {
    /// Row ids, int64 `[T, ngram_heads]`.
    #[pyo3(get)]
    ids: Py<PyArray2<i64>>,
    /// The hash multipliers, one per n-gram position.
    #[pyo3(get)]
    multipliers: Vec<u64>,
    /// The prime size of each head.
    #[pyo3(get)]
    head_vocab_sizes: Vec<u64>,
    /// Where each head starts in the table.
    #[pyo3(get)]
    head_offsets: Vec<u64>,
    /// Table rows after padding.
    #[pyo3(get)]
    padded_rows: u64,
    /// The last `context_len` tokens of `history ++ tokens`.
    #[pyo3(get)]
    history: Vec<u32>,
}

#[pymethods]
impl Ids {
    fn __repr__(&self, py: Python<'_>) -> String {
        let shape = self.ids.bind(py).shape().to_vec();
        format!(
            "Ids(ids=<int64 {shape:?}>, padded_rows={}, history={:?})",
            self.padded_rows, self.history
        )
    }
}

/// Engram's document starts and masked positions, each a list of
/// positions in `tokens` (`None`: no flags).
#[derive(Default)]
pub(crate) struct Bounds {
    pub doc_starts: Option<Vec<usize>>,
    pub masked: Option<Vec<usize>>,
}

impl Bounds {
    fn any(&self) -> bool {
        self.doc_starts.is_some() || self.masked.is_some()
    }
}

/// One flag per position of `history ++ tokens` from positions in
/// `tokens`, or an empty slice for `None`.
fn position_flags(
    what: &str,
    list: Option<&[usize]>,
    history: usize,
    tokens: usize,
) -> PyResult<Vec<bool>> {
    let Some(list) = list else {
        return Ok(Vec::new());
    };
    Boundaries::flags_at(list.iter().copied(), history, tokens).map_err(|p| {
        value_error(format!(
            "{what}: position {p} is past the {tokens} tokens given"
        ))
    })
}

/// Hash `tokens` after `history` (default: a fresh sequence) with `hasher`,
/// with Engram's document starts and masked positions when `bounds` has
/// any.
pub(crate) fn hash(
    py: Python<'_>,
    hasher: &PleIdHasher,
    vocab: u64,
    padded_rows: u64,
    tokens: &Bound<'_, PyAny>,
    history: Option<&Bound<'_, PyAny>>,
    bounds: &Bounds,
) -> PyResult<Ids> {
    let dims: &PleIdDims = hasher.dims();
    let ctx = dims.context_len();
    let tokens = args::tokens(tokens, "tokens", Some(vocab))?;
    let mut hist = match history {
        None => vec![dims.eos_token_id; ctx],
        Some(h) => {
            let h = args::tokens(h, "history", Some(vocab))?;
            if h.len() != ctx {
                return Err(value_error(format!(
                    "history: {} tokens given, context_len (ngram_size - 1) is {ctx}",
                    h.len()
                )));
            }
            h
        }
    };
    let heads = dims.ngram_heads();
    let n = tokens.len();
    if bounds.any() && !hasher.family().takes_boundaries() {
        return Err(value_error(format!(
            "doc_starts and masked are defined for the Engram family; this site is {}",
            hasher.family().name()
        )));
    }
    let doc_start = position_flags("doc_starts", bounds.doc_starts.as_deref(), ctx, n)?;
    let masked = position_flags("masked", bounds.masked.as_deref(), ctx, n)?;
    let flat = py.detach(|| -> anyhow::Result<Vec<u64>> {
        let mut ids = vec![0u64; n * heads];
        if bounds.any() {
            let b = Boundaries {
                doc_start: &doc_start,
                masked: &masked,
            };
            hasher.engram_ids_bounded_into(&hist, &tokens, b, &mut ids)?;
        } else {
            hasher.ids_with_history_into(&hist, &tokens, &mut ids)?;
        }
        dims.advance_history(&mut hist, &tokens);
        Ok(ids)
    });
    let flat = flat.map_err(py_err)?;
    let as_i64: Vec<i64> = flat.into_iter().map(|v| v as i64).collect();
    let arr = numpy::PyArray1::from_vec(py, as_i64).reshape([n, heads])?;
    Ok(Ids {
        ids: arr.unbind(),
        multipliers: dims.multipliers.clone(),
        head_vocab_sizes: dims.head_vocab_sizes.clone(),
        head_offsets: dims.head_offsets.clone(),
        padded_rows,
        history: hist,
    })
}

/// Derive a site's hash constants and hash `tokens` into row ids.
///
/// The same semantics and defaults as `metrale-ple ids`: without `history`
/// the sequence starts fresh (`ngram_size - 1` EOS tokens); every token must
/// be below `vocab_size`; a given history holds exactly `ngram_size - 1`
/// tokens. Raises `ValueError` for a bad geometry or token.
#[pyfunction]
#[pyo3(signature = (
    tokens, *, vocab_size, eos, ngram_size, heads_per_ngram, vocab_base,
    divisible_by = DEFAULT_DIVISIBLE_BY, seed = DEFAULT_HASH_SEED, site = 0, history = None
))]
#[allow(clippy::too_many_arguments)]
pub(crate) fn ids(
    py: Python<'_>,
    tokens: &Bound<'_, PyAny>,
    vocab_size: u64,
    eos: u32,
    ngram_size: usize,
    heads_per_ngram: usize,
    vocab_base: u64,
    divisible_by: u64,
    seed: u64,
    site: usize,
    history: Option<&Bound<'_, PyAny>>,
) -> PyResult<Ids> {
    let params = PleHashParams {
        vocab_size,
        eos_token_id: eos,
        ngram_size,
        heads_per_ngram,
        ngram_vocab_size_base: vocab_base,
        divisible_by,
        seed,
        site,
    };
    let (hasher, padded) = py
        .detach(|| -> anyhow::Result<(PleIdHasher, u64)> {
            let derived = params.derive()?;
            Ok((PleIdHasher::new(&derived.dims)?, derived.padded_rows))
        })
        .map_err(py_err)?;
    hash(
        py,
        &hasher,
        vocab_size,
        padded,
        tokens,
        history,
        &Bounds::default(),
    )
}

/// Engram's compressed-token map of the tokenizer in `tokenizer` (a
/// tokenizer.json path), built as the Engram demo does: entry `t` is the
/// compressed id of raw token `t`; the compressed vocabulary is
/// `max(map) + 1`. Raises `OSError` when the file cannot be read and
/// `ValueError` (naming the field) when it is malformed or uses a decoder
/// that is not supported.
#[pyfunction]
pub(crate) fn token_map(py: Python<'_>, tokenizer: std::path::PathBuf) -> PyResult<Vec<u32>> {
    let built = py
        .detach(|| token_map_from_tokenizer_json(&tokenizer))
        .map_err(py_err)?;
    Ok(built.map.to_vec())
}
