//! The typed error of the PLE layer: building it and running it.
//!
//! Every shape error names the tensor or field and both sizes; device and
//! table errors keep the underlying error and say which step failed.
//! Errors that wrap another print it in their own message and keep it as a
//! field rather than as `source()`, so a chain formatted with `{:#}` does
//! not repeat it (the convention of `GpuError`).

use metrale_gpu_runtime::gpu::GpuError;
use metrale_storage::StorageError;
use thiserror::Error;

use crate::layers::ple::ids::IdError;
use crate::layers::ple::spec::SpecError;

/// Why a [`super::PleLayer`] could not be built or refused a call.
#[derive(Debug, Error)]
pub enum LayerError {
    /// The site spec is unusable.
    #[error(transparent)]
    Spec(#[from] SpecError),
    /// The hash constants are unusable or do not fit the table.
    #[error(transparent)]
    Ids(#[from] IdError),
    /// A weight tensor has the wrong number of values.
    #[error("PLE {tensor} has {found} values, expected {shape} = {expected}")]
    WeightShape {
        /// The tensor.
        tensor: &'static str,
        /// Values given.
        found: usize,
        /// Values the spec implies.
        expected: usize,
        /// The shape, with its symbols spelled out.
        shape: String,
    },
    /// An f32 weight is NaN or infinite.
    #[error("PLE {tensor}[{index}] is not finite ({value})")]
    NonFinite {
        /// The tensor.
        tensor: &'static str,
        /// The first bad index.
        index: usize,
        /// Its value.
        value: f32,
    },
    /// A BF16 weight is NaN or infinite.
    #[error("PLE {tensor}[{index}] is not a finite BF16 value (bits {bits:#06x})")]
    NonFiniteBf16 {
        /// The tensor.
        tensor: &'static str,
        /// The first bad index.
        index: usize,
        /// Its bit pattern.
        bits: u16,
    },
    /// The table's rows are not `head_dim` wide.
    #[error("PLE table rows hold {table} values, the layer's head_dim is {layer}")]
    TableHeadDim {
        /// Values per table row.
        table: usize,
        /// The spec's head_dim.
        layer: usize,
    },
    /// The table's row type cannot hold rows of the layer's width (a
    /// block-scaled FP8 row needs a multiple of its 32-value block).
    #[error("PLE table rows of type {dtype:?} cannot be {head_dim} values wide")]
    TableRowType {
        /// The table's row type.
        dtype: metrale_storage::table::RowDType,
        /// The spec's head_dim.
        head_dim: usize,
    },
    /// `max_tokens` is 0.
    #[error("PLE max_tokens must be positive")]
    NoTokens,
    /// A size the kernels take as a u32 argument does not fit one.
    #[error("PLE {what} = {value} does not fit the kernels' u32 arguments")]
    KernelArg {
        /// The size.
        what: &'static str,
        /// Its value.
        value: usize,
    },
    /// The projection packing disagrees with its own size formula.
    #[error("packed projection has {found} values, packed_len says {expected}")]
    Packing {
        /// Values packed.
        found: usize,
        /// `packed_len`.
        expected: usize,
    },
    /// The CPU kernels could not be registered on the backend (the device
    /// error is boxed, as in `Device`).
    #[error("registering the PLE CPU kernels: {0}")]
    Kernels(Box<GpuError>),
    /// A device call failed.
    #[error("{what}: {error}")]
    Device {
        /// The step, e.g. "allocating 64 bytes for 'ple.emb'".
        what: String,
        /// The device error (boxed: it is large, and errors are rare).
        error: Box<GpuError>,
    },
    /// A device call failed (without more context).
    #[error(transparent)]
    Gpu(Box<GpuError>),
    /// A row table call failed.
    #[error("{what}: {error}")]
    Table {
        /// The step, e.g. "resolving PLE row ids 0..16 of 16 (first id 7)".
        what: String,
        /// The table's error (boxed, as `Device`'s).
        error: Box<StorageError>,
    },
    /// A row table call failed (without more context).
    #[error(transparent)]
    Storage(Box<StorageError>),
    /// Resetting a carry (the seed's `reset`, whose signature is
    /// `anyhow::Result`) failed.
    #[error("{0:#}")]
    Reset(anyhow::Error),
    /// The layer was freed.
    #[error("this PLE layer was freed")]
    Freed,
    /// An aux blob that does not fit the site.
    #[error(transparent)]
    AuxBlob(#[from] crate::layers::ple::carry_blob::AuxBlobError),
    /// A tensor-parallel split the site cannot take (docs/SPEC.md §5,
    /// "Tensor-parallel shards").
    #[error(transparent)]
    Shard(#[from] crate::layers::ple::tensor_parallel::ShardError),
    /// A rank's table rows are not the rank's share of the row width.
    #[error(
        "PLE table of tensor-parallel rank {rank} of {ranks} holds rows of {table} values; the \
         rank's share of head_dim {head_dim} is {width} values (open the rank's column slice)"
    )]
    ShardTableWidth {
        /// The rank.
        rank: usize,
        /// The number of ranks.
        ranks: usize,
        /// Values per row of the table given.
        table: usize,
        /// The site's head_dim.
        head_dim: usize,
        /// Values per row of the rank's share.
        width: usize,
    },
    /// The all-reduce of a rank's partial projection failed (the
    /// collective's error boxed, printed in the message).
    #[error(
        "all-reduce of {len} PLE projection values on tensor-parallel rank {rank} of {ranks}: {error}"
    )]
    Reduce {
        /// The rank.
        rank: usize,
        /// The number of ranks.
        ranks: usize,
        /// Values reduced.
        len: usize,
        /// The collective's error.
        error: crate::layers::ple::tensor_parallel::ReduceError,
    },
    /// A call's arguments do not fit the layer or each other (counts, rows,
    /// a released carry, a null highway, no token source).
    #[error("{0}")]
    Usage(String),
    /// Refused because the stream is being captured: capture records only
    /// work that reads fixed addresses, never host work.
    #[error("{0}")]
    Capture(String),
    /// A token mask given to a site whose published layer has none (only
    /// DeepSeek-V4.1's Engram gate takes one), or one of the wrong length.
    #[error("{0}")]
    TokenMask(String),
    /// A prestage that cannot be consumed: stale, reused, already gathered,
    /// or not where the batch step expects it.
    #[error("{0}")]
    Staging(String),
    /// A step plan that does not fit the call: made for another carry
    /// history or other tokens, a part outside the plan, or a batch entry
    /// of more than one token.
    #[error("{0}")]
    Plan(String),
    /// A prestaged decode batch needs more distinct table rows than the
    /// table can keep pinned until the step's gather has run.
    #[error(
        "PLE prestage of {sequences} sequences needs {rows} distinct table rows pinned until its \
         gather has run, but the row table pins at most {limit} at once; stage at most {fit} \
         sequences per step, or run the batch eagerly"
    )]
    PrestageTooLarge {
        /// Sequences in the batch.
        sequences: usize,
        /// Distinct row ids the batch needs.
        rows: usize,
        /// The table's `max_pinned()`.
        limit: usize,
        /// Sequences one prestage always fits (`max_prestage_batch`).
        fit: usize,
    },
}

impl From<GpuError> for LayerError {
    fn from(e: GpuError) -> Self {
        LayerError::Gpu(Box::new(e))
    }
}

impl From<StorageError> for LayerError {
    fn from(e: StorageError) -> Self {
        LayerError::Storage(Box::new(e))
    }
}

/// `ensure!` for [`LayerError`]: return `Err(LayerError::$kind(format!(...)))`
/// unless `$cond` holds.
macro_rules! layer_ensure {
    ($cond:expr, $kind:ident, $($arg:tt)+) => {
        if !$cond {
            return Err($crate::layers::ple::LayerError::$kind(format!($($arg)+)));
        }
    };
}

/// `bail!` for [`LayerError`].
macro_rules! layer_bail {
    ($kind:ident, $($arg:tt)+) => {
        return Err($crate::layers::ple::LayerError::$kind(format!($($arg)+)))
    };
}

pub(crate) use {layer_bail, layer_ensure};

/// A table error with the step that failed.
pub(crate) fn table_err(what: impl Into<String>) -> impl FnOnce(StorageError) -> LayerError {
    let what = what.into();
    move |error| LayerError::Table {
        what,
        error: Box::new(error),
    }
}

/// Attach a build step to a device error.
pub(crate) trait DeviceContext<T> {
    /// Name the step that failed.
    fn device(self, what: impl FnOnce() -> String) -> Result<T, LayerError>;
}

impl<T> DeviceContext<T> for Result<T, GpuError> {
    fn device(self, what: impl FnOnce() -> String) -> Result<T, LayerError> {
        self.map_err(|error| LayerError::Device {
            what: what(),
            error: Box::new(error),
        })
    }
}
