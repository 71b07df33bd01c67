//! The PLE layer (SPEC.md sections 4 and 5).
//!
//! - [`ids`]: the n-gram id hash;
//! - [`config`]: the PLE settings read from a checkpoint's config.json;
//! - [`kernels`]: the kernels the layer launches (gather, project, gate,
//!   conv, conv_batch) and their CPU implementations;
//! - `layer`: [`PleLayer`], [`PleSeqState`], [`PleWeights`],
//!   [`ForwardContext`]: the forward, the batched decode step and the row
//!   staging;
//! - `staging`: the device staging area for resolved row references and the
//!   lease rules that keep table rows in place until the gather has run;
//! - `aux_state`: the per-sequence carry (reset, prestage, snapshot, restore,
//!   release).

mod aux_state;
pub mod config;
pub mod ids;
pub mod kernels;
mod layer;
mod staging;

pub use layer::{ForwardContext, MAX_HC_MULT, PleLayer, PleSeqState, PleWeights};
