//! The PLE layer: the math of docs/SPEC.md §5 (Layer math) and the carry of
//! docs/SPEC.md §6 (Carry lifecycle).
//!
//! - [`spec`]: [`ModelSpec`] (the PLE part of config.json, parsed and
//!   validated once) and [`SiteSpec`] (one site: hash constants, carry shape
//!   and every size derived from them);
//! - [`family`]: one module per model family (its config keys, hash
//!   constants and combine rule) behind the [`family::Family`] trait, and
//!   the registry ([`family::BUILTIN`], [`family::register`]);
//! - [`carry_blob`]: the aux blob format, its size, encoder and decoder;
//! - [`ids`]: the n-gram id hash;
//! - [`highway`]: highway rows on the host run through a device buffer (the
//!   host-slice convenience over calls that take a device pointer);
//! - [`device_kernels`]: `kernels/ple.cu` loaded on a backend that runs
//!   device code, and the launch shapes of each kind of backend;
//! - [`kernels`]: the kernels the layer launches (gather, project, gate,
//!   conv, conv_batch) and their CPU implementations;
//! - `layer`: [`PleLayer`], [`PleSeqState`], [`PleWeights`],
//!   [`ForwardContext`], [`LayerError`], and a step as a value
//!   ([`StepPlan`], [`SeqWork`], [`PlanPart`]): construction, the plan, the
//!   forward, the batched decode step and the row staging;
//! - `staging`: the device staging area for resolved row references and the
//!   lease rules that keep table rows in place until the gather has run;
//! - [`tensor_parallel`]: a rank's column share of a site
//!   ([`TensorParallel`]) and the all-reduce hook ([`Reduce`]) that
//!   completes its partial projection;
//! - `aux_state`: the per-sequence carry (reset, prestage, snapshot, restore,
//!   release).

mod aux_state;
pub mod carry_blob;
pub mod device_kernels;
pub mod family;
pub mod highway;
pub mod ids;
pub mod kernels;
mod layer;
pub mod spec;
mod staging;
pub mod tensor_parallel;

pub use layer::{
    ForwardContext, LayerError, PlanPart, PleLayer, PleSeqState, PleWeights, SeqWork, StepPlan,
};
pub use spec::{
    Combine, GateSign, GatedSpec, HashFamily, MAX_HC_MULT, ModelSpec, NormForm, SiteSpec, SpecError,
};
pub use tensor_parallel::{
    GroupError, InProcessGroup, Reduce, ReduceError, Shard, ShardError, TensorParallel,
};
