//! The one error type of checkpoint loading and writing.
//!
//! Every variant names the file it is about and, where there is one, the
//! tensor, so that a refused checkpoint can be fixed from the message alone.

use std::path::PathBuf;

use metrale_model_layers::layers::ple::spec::SpecError;
use metrale_model_layers::layers::ple::{LayerError, ShardError};
use metrale_storage::StorageError;

/// Why a checkpoint could not be read, validated or written.
#[derive(Debug, thiserror::Error)]
pub enum CheckpointError {
    /// An operating-system error on a file.
    #[error("{path}: {source}")]
    Io {
        /// The file or directory.
        path: PathBuf,
        /// The underlying error.
        #[source]
        source: std::io::Error,
    },
    /// `config.json` does not describe a valid model (the error names the
    /// file and the field).
    #[error("invalid config: {0}")]
    Spec(#[from] SpecError),
    /// A site's hash constants do not derive from `config.json`.
    #[error("{file}: invalid config: {source}")]
    Config {
        /// The config file.
        file: PathBuf,
        /// What is wrong (boxed: errors are rare and this one is large).
        #[source]
        source: Box<SpecError>,
    },
    /// `model.safetensors.index.json` is unreadable or inconsistent.
    #[error("{file}: invalid weight map: {msg}")]
    Index {
        /// The index file.
        file: PathBuf,
        /// What is wrong.
        msg: String,
    },
    /// A safetensors file whose header cannot be parsed.
    #[error("{file}: corrupt safetensors header: {msg}")]
    Header {
        /// The safetensors file.
        file: PathBuf,
        /// What is wrong.
        msg: String,
    },
    /// A tensor the format requires is absent.
    #[error("{file}: tensor {tensor} is missing")]
    MissingTensor {
        /// Where it was looked for (the index or a safetensors file).
        file: PathBuf,
        /// Its name.
        tensor: String,
    },
    /// A tensor has the wrong shape.
    #[error("{file}: tensor {tensor} has shape {found:?}, expected {expected:?}")]
    Shape {
        /// The safetensors file.
        file: PathBuf,
        /// Its name.
        tensor: String,
        /// The shape the geometry requires.
        expected: Vec<u64>,
        /// The shape in the file.
        found: Vec<u64>,
    },
    /// A tensor has the wrong element type.
    #[error("{file}: tensor {tensor} has dtype {found}, expected {expected}")]
    DType {
        /// The safetensors file.
        file: PathBuf,
        /// Its name.
        tensor: String,
        /// The dtype the format requires.
        expected: String,
        /// The dtype in the file.
        found: String,
    },
    /// A tensor's values are wrong (hash buffers that do not match their
    /// derivation, non-finite weights, a bad scale).
    #[error("{file}: tensor {tensor}: {msg}")]
    Value {
        /// The safetensors file.
        file: PathBuf,
        /// Its name.
        tensor: String,
        /// What is wrong.
        msg: String,
    },
    /// The table shards do not form one table covering every row.
    #[error("{file}: table shards of layer {layer}: {msg}")]
    Shards {
        /// The index file.
        file: PathBuf,
        /// The 0-based model layer of the PLE site.
        layer: usize,
        /// What is wrong.
        msg: String,
    },
    /// A DeepSeek-V4.1 table stored as released (F8_E4M3 values, their
    /// F8_E8M0 block scales in a tensor of their own): the runtime reads a
    /// row in one read, from the inline layout `table pack` converts to.
    #[error(
        "{file}: tensor {tensor} is stored as released, its block scales apart in {scale}; the \
         runtime reads each row with its scales in one read: convert the checkpoint once with \
         `metrale-ple table pack SRC DST` (SRC this checkpoint's directory)"
    )]
    ReleasedTable {
        /// The safetensors file holding the values.
        file: PathBuf,
        /// The values' tensor.
        tensor: String,
        /// The scales' tensor.
        scale: String,
    },
    /// A site's table could not be opened or served.
    #[error("{what} of layer {layer}")]
    Table {
        /// The 0-based model layer of the PLE site.
        layer: usize,
        /// The step that failed.
        what: &'static str,
        /// The storage error (boxed, as `Config`'s).
        #[source]
        source: Box<StorageError>,
    },
    /// A site's layer could not be built.
    #[error("building the PLE layer of model layer {layer}")]
    Layer {
        /// The 0-based model layer of the PLE site.
        layer: usize,
        /// Why (boxed, as `Config`'s).
        #[source]
        source: Box<LayerError>,
    },
    /// A site's table cannot be split among tensor-parallel ranks as asked
    /// (the numbers are in the source's message).
    #[error("the table of layer {layer}: {split}")]
    TensorParallel {
        /// The 0-based model layer of the PLE site.
        layer: usize,
        /// Why the split was refused (in the message, not chained: it is
        /// the whole reason).
        split: ShardError,
    },
    /// A safetensors file could not be read or written.
    #[error("{file}: {source}")]
    Storage {
        /// The file.
        file: PathBuf,
        /// The storage layer's error (boxed, as `Config`'s).
        #[source]
        source: Box<StorageError>,
    },
    /// A request that cannot be met (bad preset, bad row count, a target
    /// directory that already holds a checkpoint).
    #[error("{0}")]
    Invalid(String),
}

impl CheckpointError {
    /// An [`CheckpointError::Io`] for `path`.
    pub fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        CheckpointError::Io {
            path: path.into(),
            source,
        }
    }
}

/// Results of this crate.
pub type Result<T, E = CheckpointError> = std::result::Result<T, E>;
