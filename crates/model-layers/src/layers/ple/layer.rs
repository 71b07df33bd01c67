//! The PLE layer: weights on the device, the forward over a sequence's new
//! tokens, the batched decode step and the staging of table rows.
//!
//! One Qwen4Exp forward, the math of docs/SPEC.md §5 (Layer math), is four
//! kernel launches on one stream:
//! `gather` (table rows to `emb [T, E]`), `project` (`[key | value] = emb @
//! W^T`), `gate` (per-stream gate against the highway, then the grouped conv
//! norm) and `conv` (the dilated causal conv over the carried state, then
//! `highway += out`). A decode batch uses `conv_batch` instead of `conv`.
//! The site's [`super::Combine`] changes only what follows the projection:
//! Engram adds `bias_add`, gates with `gate_norms` and ends with `conv` or,
//! without a conv, `highway_add`; LongCat ends with `mean_add`. A site
//! without a conv still owns a (zero-byte) conv-state allocation, so a
//! carry's life (new, reset, snapshot, restore, release) is the same for
//! every site.
//!
//! Invariants:
//! - every result row depends only on its own token, its sequence's carry and
//!   the weights: kernels never let the number of rows in a launch change a
//!   row's arithmetic, so any chunking of a prefill, any batch and any replay
//!   of a captured graph give bit-identical highways;
//! - a step is hashed once into a [`StepPlan`] (`layer/plan.rs`); the
//!   table's prefetch, staging into a caller's buffer, the eager forwards and
//!   the batch prestage all take the ids from it, and a plan runs only on a
//!   carry whose history is the one it was made for;
//! - the history in a [`PleSeqState`] always has `context_len` entries after
//!   any forward or prestage, and advances exactly once per token: either by
//!   the prestage (which also stages the token's rows) or by the forward that
//!   runs the token's plan;
//! - a prestage is taken by the next forward of its sequence whatever that
//!   forward does, so a leftover is never applied to a later token;
//! - under graph capture nothing is hashed, resolved or read back: only a
//!   forward whose rows were staged at fixed addresses (`prestage_batch`) can
//!   be captured; anything else is refused before any state changes;
//! - device memory (weights, scratch, staging) is freed only by
//!   [`PleLayer::free`]; `Drop` frees nothing, as with every `DevicePtr`.
//!
//! Files: this one holds the types and the accessors; `layer/build.rs` the
//! constructor and its checks, `layer/plan.rs` the step plan (hashing a
//! step, prefetch and staging by plan, running a plan eagerly or prestaging
//! it), `layer/forward.rs` the eager forward and the row staging it uses, `layer/batch.rs` the batched decode step (prestage,
//! graph-capturable forward, replay bookkeeping) and `free`,
//! `layer/carry.rs` a carry's snapshot and restore through the aux blob
//! codec, `layer/pipeline.rs` the gather that projects each head group while the
//! next is read (tables whose resolve may wait).
//!
//! Concurrency: `PleLayer` is `Send + Sync`; the staging bookkeeping sits
//! behind a mutex, but the scratch buffers are shared, so all forwards of one
//! layer must be issued on one stream (or on streams ordered with events).

use std::sync::Arc;

use metrale_gpu_runtime::gpu::{DevicePtr, GpuBackend, KernelHandle};
use metrale_storage::table::RowTable;
use parking_lot::Mutex;

use super::ids::{PleIdDims, PleIdHasher};
use super::spec::SiteSpec;
use super::staging::Staging;

mod batch;
mod build;
mod carry;
mod error;
mod forward;
mod pipeline;
mod plan;

pub use error::LayerError;
pub(crate) use error::{DeviceContext, layer_ensure, table_err};
pub use plan::{PlanPart, SeqWork, StepPlan};

/// Results of the layer.
type Result<T, E = LayerError> = std::result::Result<T, E>;

/// Host-side weights of one PLE site, as stored in the checkpoint. A tensor
/// the site's [`super::Combine`] does not use is empty: the biases of a
/// Qwen4Exp site, the conv (and its norm) of a site without a conv, and
/// everything but `value_proj` of a LongCat site.
#[derive(Clone, Debug, Default)]
pub struct PleWeights {
    /// `key_proj [C, E]`, BF16 bit patterns, row-major: the keys of the
    /// `hc` streams stacked (Engram's per-stream key projections, or the
    /// first `C` rows of DeepSeek-V4.1's fused key/value projection).
    pub key_proj: Vec<u16>,
    /// `value_proj [H, E]`, BF16 bit patterns, row-major (LongCat: the
    /// sub-tables' `Linear(head_dim -> H)` projections side by side along
    /// the input dimension).
    pub value_proj: Vec<u16>,
    /// `norm_key [C]`.
    pub norm_key: Vec<f32>,
    /// `norm_query [C]`.
    pub norm_query: Vec<f32>,
    /// `norm_conv [C]`.
    pub norm_conv: Vec<f32>,
    /// `conv1d [C, 1, K]` flattened to `[C * K]`.
    pub conv1d: Vec<f32>,
    /// `key_bias [C]` (Engram), else empty.
    pub key_bias: Vec<f32>,
    /// `value_bias [H]` (Engram), else empty.
    pub value_bias: Vec<f32>,
}

/// One sequence's PLE carry: token history and the conv state on the device.
///
/// `conv` is a bare device pointer: dropping the state frees nothing; release
/// it with [`PleLayer::release_seq_state`].
#[derive(Debug)]
pub struct PleSeqState {
    /// The conv state, `state_len * C` f32 (null once released).
    pub(super) conv: DevicePtr,
    /// The last `context_len` tokens seen (empty until the first forward).
    pub(super) history: Vec<u32>,
    /// Device address of the rows staged for the next decode token.
    pub(super) prestaged_va: Option<u64>,
    /// The last address staged, for [`PleLayer::rearm`].
    pub(super) last_staged_va: u64,
}

impl PleSeqState {
    /// The conv state's device address (null once released).
    pub fn conv_ptr(&self) -> DevicePtr {
        self.conv
    }
    /// The carried token history.
    pub fn history(&self) -> &[u32] {
        &self.history
    }
    /// Whether a prestage is waiting for the next forward.
    pub fn is_prestaged(&self) -> bool {
        self.prestaged_va.is_some()
    }
    /// Whether [`PleLayer::release_seq_state`] has run.
    pub fn is_released(&self) -> bool {
        self.conv.is_null()
    }
}

/// Everything a forward needs besides the sequence and the highway.
///
/// Token ids come from `token_override`, else `host_ids`, else a blocking read
/// of `device_ids` (refused under capture). Slices hold one id per token (or
/// per batch row for [`PleLayer::forward_row`] and [`PleLayer::forward_batch`]).
#[derive(Clone, Copy)]
pub struct ForwardContext<'a> {
    /// The backend.
    pub gpu: &'a dyn GpuBackend,
    /// The new tokens, on the host.
    pub host_ids: Option<&'a [u32]>,
    /// The new tokens as u32 in device memory.
    pub device_ids: Option<DevicePtr>,
    /// Whether the stream is being captured (the layer also asks the backend).
    pub capturing: bool,
    /// Tokens that replace the others and never consume a prestage.
    pub token_override: Option<&'a [u32]>,
    /// Masked tokens, one flag per token (per batch row in a batch step),
    /// `true` where masked: DeepSeek-V4.1's `token_mask` with the opposite
    /// polarity (there `False` shuts the gate). A masked token's gate is 0,
    /// so its highway rows pass through unchanged, and it stops the hash's
    /// look-back of the tokens after it (docs/SPEC.md §11 (Families)). Only
    /// a site whose combination takes a mask accepts one
    /// ([`super::GatedSpec::token_mask`]); any other refuses it with
    /// [`LayerError::TokenMask`], even when no flag is set.
    pub masked: Option<&'a [bool]>,
}

impl<'a> ForwardContext<'a> {
    /// A context with no token source, not capturing.
    pub fn new(gpu: &'a dyn GpuBackend) -> Self {
        ForwardContext {
            gpu,
            host_ids: None,
            device_ids: None,
            capturing: false,
            token_override: None,
            masked: None,
        }
    }
    /// With host token ids.
    pub fn with_host_ids(mut self, ids: &'a [u32]) -> Self {
        self.host_ids = Some(ids);
        self
    }
    /// With device token ids (u32 each).
    pub fn with_device_ids(mut self, ids: DevicePtr) -> Self {
        self.device_ids = Some(ids);
        self
    }
    /// With a token override.
    pub fn with_override(mut self, ids: &'a [u32]) -> Self {
        self.token_override = Some(ids);
        self
    }
    /// With masked tokens (see [`Self::masked`]).
    pub fn with_masked(mut self, masked: &'a [bool]) -> Self {
        self.masked = Some(masked);
        self
    }
    /// Marked as capturing.
    pub fn capturing(mut self, capturing: bool) -> Self {
        self.capturing = capturing;
        self
    }
}

/// Resolved kernel handles and how to shape their launches. The kernels
/// only some combinations launch are resolved only by layers that use them.
#[derive(Clone, Copy, Debug)]
struct Kernels {
    shapes: super::device_kernels::LaunchShapes,
    gather: KernelHandle,
    /// The gather into strided runs (one head group of every token).
    gather_runs: KernelHandle,
    project: KernelHandle,
    /// The projection over a range of steps (one head group's columns).
    project_range: KernelHandle,
    gate: KernelHandle,
    conv: KernelHandle,
    conv_batch: KernelHandle,
    /// The gate with a norm form and an eps per norm (Engram).
    gate_norms: Option<KernelHandle>,
    /// The projection bias (Engram).
    bias_add: Option<KernelHandle>,
    /// `highway += gated` (a gated site without a conv).
    highway_add: Option<KernelHandle>,
    /// The mean with the word embedding (LongCat).
    mean_add: Option<KernelHandle>,
}

/// Device buffers owned by the layer.
#[derive(Clone, Copy, Debug, Default)]
struct DeviceBufs {
    w_proj: DevicePtr,
    norm_q: DevicePtr,
    norm_k: DevicePtr,
    norm_conv: DevicePtr,
    conv_w: DevicePtr,
    emb: DevicePtr,
    kv: DevicePtr,
    gated: DevicePtr,
    xn: DevicePtr,
    pad_row: DevicePtr,
    /// `[key_bias | value_bias]`, `[O]` (zeros where a bias is absent);
    /// null when the site has no bias.
    bias: DevicePtr,
}

impl DeviceBufs {
    fn all(&self) -> [DevicePtr; 11] {
        [
            self.bias,
            self.w_proj,
            self.norm_q,
            self.norm_k,
            self.norm_conv,
            self.conv_w,
            self.emb,
            self.kv,
            self.gated,
            self.xn,
            self.pad_row,
        ]
    }
}

/// One PLE site: weights on the device, scratch for `max_tokens` rows, the
/// table, and the staging area. See the module docs for the invariants.
///
/// The site's geometry lives in its spec alone: the layer dereferences to
/// its [`SiteSpec`], so `layer.dims`, `layer.hidden`, `layer.hc_mult` and
/// the spec's derived sizes are the spec's own. The carry code fixed by the
/// specification (`aux_state.rs`) reads those as fields of the layer; the
/// `Deref` is what lets it do so without a second copy.
pub struct PleLayer {
    /// What the layer was built from.
    spec: SiteSpec,
    /// The hash's hot path for `spec.dims`.
    hasher: PleIdHasher,
    /// `spec.state_len()`, computed once: `aux_state.rs` reads it as a
    /// field (`self.state_len`), which a method of the spec cannot be.
    pub(super) state_len: usize,
    max_tokens: usize,
    /// Values of each row this layer gathers: `head_dim`, or a
    /// tensor-parallel rank's share of it.
    row_dim: usize,
    /// The rank's split and collective; `None` for one rank.
    shard: Option<super::tensor_parallel::Shard>,
    table: Arc<dyn RowTable>,
    dtype_code: u32,
    kernels: Kernels,
    bufs: DeviceBufs,
    staging: Mutex<Staging>,
    freed: bool,
}

impl std::ops::Deref for PleLayer {
    type Target = SiteSpec;

    fn deref(&self) -> &SiteSpec {
        &self.spec
    }
}

impl std::fmt::Debug for PleLayer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PleLayer")
            .field("hidden", &self.hidden)
            .field("hc_mult", &self.hc_mult)
            .field("ngram_heads", &self.dims.ngram_heads())
            .field("head_dim", &self.spec.head_dim)
            .field("k_size", &self.spec.kernel)
            .field("dilation", &self.spec.dilation)
            .field("max_tokens", &self.max_tokens)
            .field("shard", &self.tensor_parallel())
            .field("freed", &self.freed)
            .finish()
    }
}

impl PleLayer {
    /// The site spec the layer was built from.
    pub fn spec(&self) -> &SiteSpec {
        &self.spec
    }
    /// The id hash geometry.
    pub fn dims(&self) -> &PleIdDims {
        &self.spec.dims
    }
    /// Width of one residual stream.
    pub fn hidden(&self) -> usize {
        self.spec.hidden
    }
    /// Number of residual streams.
    pub fn hc_mult(&self) -> usize {
        self.spec.hc_mult
    }
    /// Values per table row.
    pub fn head_dim(&self) -> usize {
        self.spec.head_dim
    }
    /// Which share of the site this layer runs ([`super::TensorParallel::SINGLE`]
    /// for an unsharded layer).
    pub fn tensor_parallel(&self) -> super::TensorParallel {
        self.shard
            .as_ref()
            .map_or(super::TensorParallel::SINGLE, |s| s.tp)
    }
    /// Values of each table row this layer gathers: `head_dim / ranks`.
    pub fn row_dim(&self) -> usize {
        self.row_dim
    }
    /// Most tokens per kernel launch (longer forwards are split), and the
    /// largest decode batch.
    pub fn max_tokens(&self) -> usize {
        self.max_tokens
    }
    /// Largest decode batch for [`Self::forward_batch`].
    pub fn max_batch(&self) -> usize {
        self.max_tokens
    }
    /// Bytes of one sequence's conv state.
    pub fn conv_state_bytes(&self) -> usize {
        self.spec.conv_bytes()
    }
    /// Bytes of the aux blob of a sequence with a full history.
    pub fn aux_blob_bytes(&self) -> usize {
        self.spec.aux_blob_len()
    }
    /// The table the layer reads.
    pub fn table(&self) -> &Arc<dyn RowTable> {
        &self.table
    }

    fn check_live(&self) -> Result<()> {
        if self.freed {
            return Err(LayerError::Freed);
        }
        Ok(())
    }

    /// A new sequence carry. Its history is empty, so the first forward or
    /// prestage resets it (zeroes the conv state).
    pub fn new_seq_state(&self, gpu: &dyn GpuBackend) -> Result<PleSeqState> {
        self.check_live()?;
        let bytes = self.conv_state_bytes();
        let conv = gpu
            .alloc(bytes, "ple.conv_state")
            .device(|| format!("allocating {bytes} bytes for a PLE conv state"))?;
        Ok(PleSeqState {
            conv,
            history: Vec::new(),
            prestaged_va: None,
            last_staged_va: 0,
        })
    }

    /// After a failed capture attempt: give the sequence back the prestage the
    /// captured forward took, so the eager re-run does not hash the token
    /// twice. Does nothing when a prestage is still waiting or none was made.
    pub fn rearm(&self, st: &mut PleSeqState) {
        if st.prestaged_va.is_none() && st.last_staged_va != 0 && !st.conv.is_null() {
            st.prestaged_va = Some(st.last_staged_va);
        }
    }
}

/// Where the conv kernel finds the conv state.
#[derive(Clone, Copy, Debug)]
enum ConvTarget {
    /// One sequence's state (`conv`).
    Single(DevicePtr),
    /// A device table of state addresses (`conv_batch`).
    Table(DevicePtr),
}

#[cfg(test)]
mod tests {
    use super::*;

    fn send_sync<T: Send + Sync>() {}

    #[test]
    fn layer_and_carry_cross_threads() {
        send_sync::<PleLayer>();
        send_sync::<PleSeqState>();
        send_sync::<PleWeights>();
    }
}
