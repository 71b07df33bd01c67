//! metrale-model-layers: the PLE layer of metrale-ple.
//!
//! `layers::ple` holds the n-gram id hash, the layer forward and the
//! per-sequence carry.

pub mod layers;
