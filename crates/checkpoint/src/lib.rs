//! metrale-checkpoint: the PLE checkpoint format, its synthetic writer and
//! its validating loader.
//!
//! A checkpoint is a Hugging Face-style directory: `config.json` (the
//! Qwen4Exp, Engram or LongCat fields, parsed into a
//! [`metrale_model_layers::layers::ple::ModelSpec`]; [`preset`] holds the
//! synthetic ones), safetensors files, and
//! `model.safetensors.index.json` mapping every tensor to its file. Tensor
//! names are spelled in [`names`] alone; [`family`] says which tensors make
//! each family's table, and [`runtime`] describes a site's table (cut,
//! relaid, or LongCat's sub-tables as parts) for the storage layer to
//! serve. [`synth`] writes deterministic
//! synthetic checkpoints; [`load`] refuses anything a layer could trip on,
//! with a [`CheckpointError`] naming the file and tensor; [`remap`] reads
//! the row order of a table whose hot rows were relaid together; [`release`] converts
//! DeepSeek-V4.1's table as released to the rows the runtime reads;
//! [`token_map`] reads Engram's token map stored as a tensor;
//! [`tensor_parallel`] writes and opens one tensor-parallel rank's column
//! slice of a checkpoint.
//!
//! Invariant: a [`load::Checkpoint`] exists only for a directory that
//! passed every check in [`load`].

pub mod backbone;
pub mod error;
pub mod family;
pub mod load;
pub mod names;
pub mod preset;
pub mod release;
pub mod remap;
pub mod runtime;
pub mod synth;
pub mod tensor_parallel;
pub mod token_map;

pub use error::CheckpointError;
pub use load::Checkpoint;
pub use preset::Preset;
pub use synth::{InitOptions, TableDType, TableLayout};
