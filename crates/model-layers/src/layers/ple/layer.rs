//! The PLE layer: weights on the device, the forward over a sequence's new
//! tokens, the batched decode step and the staging of table rows.
//!
//! One forward (SPEC.md section 4) is four kernel launches on one stream:
//! `gather` (table rows to `emb [T, E]`), `project` (`[key | value] = emb @
//! W^T`), `gate` (per-stream gate against the highway, then the grouped conv
//! norm) and `conv` (the dilated causal conv over the carried state, then
//! `highway += out`). A decode batch uses `conv_batch` instead of `conv`.
//!
//! Invariants:
//! - every result row depends only on its own token, its sequence's carry and
//!   the weights: kernels never let the number of rows in a launch change a
//!   row's arithmetic, so any chunking of a prefill, any batch and any replay
//!   of a captured graph give bit-identical highways;
//! - the history in a [`PleSeqState`] always has `context_len` entries after
//!   any forward or prestage, and advances exactly once per token: either by
//!   the prestage (which also stages the token's rows) or by the forward that
//!   hashes the token itself;
//! - a prestage is taken by the next forward of its sequence whatever that
//!   forward does, so a leftover is never applied to a later token;
//! - under graph capture nothing is hashed, resolved or read back: only a
//!   forward whose rows were staged at fixed addresses (`prestage_batch`) can
//!   be captured; anything else is refused before any state changes;
//! - device memory (weights, scratch, staging) is freed only by
//!   [`PleLayer::free`]; `Drop` frees nothing, as with every `DevicePtr`.
//!
//! Concurrency: `PleLayer` is `Send + Sync`; the staging bookkeeping sits
//! behind a mutex, but the scratch buffers are shared, so all forwards of one
//! layer must be issued on one stream (or on streams ordered with events).

use std::sync::Arc;

use anyhow::{Context, Result, bail, ensure};
use metrale_gpu_runtime::gpu::{DevicePtr, GpuBackend, KernelHandle, LaunchConfig, StreamId};
use metrale_storage::table::{RowDType, RowRef, RowTable};
use parking_lot::Mutex;

use super::ids::{PleIdDims, PleIdHasher, ple_ngram_ids};
use super::kernels;
use super::staging::{self, StagedAt, Staging};

/// Largest supported `hc_mult` (parallel residual streams).
pub const MAX_HC_MULT: usize = 64;

/// Host-side weights of one PLE site, as stored in the checkpoint.
#[derive(Clone, Debug, Default)]
pub struct PleWeights {
    /// `key_proj [C, E]`, BF16 bit patterns, row-major.
    pub key_proj: Vec<u16>,
    /// `value_proj [H, E]`, BF16 bit patterns, row-major.
    pub value_proj: Vec<u16>,
    /// `norm_key [C]`.
    pub norm_key: Vec<f32>,
    /// `norm_query [C]`.
    pub norm_query: Vec<f32>,
    /// `norm_conv [C]`.
    pub norm_conv: Vec<f32>,
    /// `conv1d [C, 1, K]` flattened to `[C * K]`.
    pub conv1d: Vec<f32>,
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
    /// Marked as capturing.
    pub fn capturing(mut self, capturing: bool) -> Self {
        self.capturing = capturing;
        self
    }
}

/// Resolved kernel handles.
#[derive(Clone, Copy, Debug)]
struct Kernels {
    gather: KernelHandle,
    project: KernelHandle,
    gate: KernelHandle,
    conv: KernelHandle,
    conv_batch: KernelHandle,
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
}

impl DeviceBufs {
    fn all(&self) -> [DevicePtr; 10] {
        [
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
pub struct PleLayer {
    /// The id hash geometry and constants.
    pub(super) dims: PleIdDims,
    /// The hash's hot path for `dims`.
    hasher: PleIdHasher,
    /// `(K - 1) * D` rows of conv state.
    pub(super) state_len: usize,
    /// Parallel residual streams.
    pub(super) hc_mult: usize,
    /// Width of one stream.
    pub(super) hidden: usize,
    head_dim: usize,
    k_size: usize,
    dilation: usize,
    eps: f32,
    max_tokens: usize,
    table: Arc<dyn RowTable>,
    dtype_code: u32,
    kernels: Kernels,
    bufs: DeviceBufs,
    staging: Mutex<Staging>,
    freed: bool,
}

impl std::fmt::Debug for PleLayer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PleLayer")
            .field("hidden", &self.hidden)
            .field("hc_mult", &self.hc_mult)
            .field("ngram_heads", &self.dims.ngram_heads())
            .field("head_dim", &self.head_dim)
            .field("k_size", &self.k_size)
            .field("dilation", &self.dilation)
            .field("max_tokens", &self.max_tokens)
            .field("freed", &self.freed)
            .finish()
    }
}

/// Allocations made so far by a constructor, freed if it fails.
struct AllocGuard<'a> {
    gpu: &'a dyn GpuBackend,
    ptrs: Vec<DevicePtr>,
}

impl AllocGuard<'_> {
    fn alloc(&mut self, bytes: usize, label: &str) -> Result<DevicePtr> {
        let p = self
            .gpu
            .alloc(bytes.max(4), label)
            .with_context(|| format!("allocating {bytes} bytes for '{label}'"))?;
        self.ptrs.push(p);
        Ok(p)
    }
    fn upload_f32(&mut self, data: &[f32], label: &str) -> Result<DevicePtr> {
        let p = self.alloc(data.len() * 4, label)?;
        self.gpu
            .copy_h2d(&f32_bytes(data), p)
            .with_context(|| format!("uploading '{label}'"))?;
        Ok(p)
    }
}

impl Drop for AllocGuard<'_> {
    fn drop(&mut self) {
        for p in self.ptrs.drain(..) {
            let _ = self.gpu.free(p);
        }
    }
}

fn f32_bytes(v: &[f32]) -> Vec<u8> {
    let mut out = Vec::with_capacity(v.len() * 4);
    for x in v {
        out.extend_from_slice(&x.to_le_bytes());
    }
    out
}

fn fits_u32(what: &str, v: usize) -> Result<u32> {
    u32::try_from(v)
        .map_err(|_| anyhow::anyhow!("PLE {what} = {v} does not fit the kernels' u32 arguments"))
}

impl PleLayer {
    /// Build a layer: validate every shape against the others, register the
    /// CPU kernels where the backend runs host kernels, upload the packed
    /// projection and the norm and conv weights, and allocate scratch for
    /// `max_tokens` rows per launch (longer forwards are split) and a decode
    /// batch of up to `max_tokens` sequences.
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        dims: PleIdDims,
        head_dim: usize,
        hidden: usize,
        hc_mult: usize,
        k_size: usize,
        dilation: usize,
        eps: f32,
        weights: PleWeights,
        table: Arc<dyn RowTable>,
        max_tokens: usize,
        gpu: &dyn GpuBackend,
    ) -> Result<PleLayer> {
        let hasher = PleIdHasher::new(&dims)?;
        let heads = dims.ngram_heads();
        ensure!(head_dim > 0, "PLE head_dim must be positive");
        ensure!(hidden > 0, "PLE hidden must be positive");
        ensure!(
            (1..=MAX_HC_MULT).contains(&hc_mult),
            "PLE hc_mult = {hc_mult} is outside 1..={MAX_HC_MULT}"
        );
        ensure!(
            k_size >= 2,
            "PLE conv kernel size must be at least 2, got {k_size}"
        );
        ensure!(
            dilation >= 1,
            "PLE conv dilation must be at least 1, got {dilation}"
        );
        ensure!(
            eps.is_finite() && eps >= 0.0,
            "PLE rms eps must be finite and >= 0, got {eps}"
        );
        ensure!(max_tokens > 0, "PLE max_tokens must be positive");
        let e = heads * head_dim;
        let c = hc_mult * hidden;
        let state_len = (k_size - 1) * dilation;
        let info = table.info();
        ensure!(
            info.head_dim == head_dim,
            "PLE table rows hold {} values, the layer's head_dim is {head_dim}",
            info.head_dim
        );
        dims.check_table_rows(info.rows)?;
        let w = &weights;
        ensure!(
            w.key_proj.len() == c * e,
            "PLE key_proj has {} values, expected [C = hc_mult*hidden = {c}, E = ngram_heads*head_dim = {e}] = {}",
            w.key_proj.len(),
            c * e
        );
        ensure!(
            w.value_proj.len() == hidden * e,
            "PLE value_proj has {} values, expected [H = {hidden}, E = {e}] = {}",
            w.value_proj.len(),
            hidden * e
        );
        for (name, v) in [
            ("norm_key", &w.norm_key),
            ("norm_query", &w.norm_query),
            ("norm_conv", &w.norm_conv),
        ] {
            ensure!(
                v.len() == c,
                "PLE {name} has {} values, expected C = {c}",
                v.len()
            );
            if let Some(i) = v.iter().position(|x| !x.is_finite()) {
                bail!("PLE {name}[{i}] is not finite ({})", v[i]);
            }
        }
        ensure!(
            w.conv1d.len() == c * k_size,
            "PLE conv1d has {} values, expected [C = {c}, 1, K = {k_size}] = {}",
            w.conv1d.len(),
            c * k_size
        );
        if let Some(i) = w.conv1d.iter().position(|x| !x.is_finite()) {
            bail!("PLE conv1d[{i}] is not finite ({})", w.conv1d[i]);
        }
        for (name, v) in [("key_proj", &w.key_proj), ("value_proj", &w.value_proj)] {
            if let Some(i) = v.iter().position(|b| b & 0x7f80 == 0x7f80) {
                bail!(
                    "PLE {name}[{i}] is not a finite BF16 value (bits {:#06x})",
                    v[i]
                );
            }
        }
        let o = c + hidden;
        for (what, v) in [
            ("tokens*ngram_heads", max_tokens * heads),
            ("head_dim", head_dim),
            ("E", e),
            ("C + hidden", o),
            ("max_tokens", max_tokens),
            ("kernel size", k_size),
            ("dilation", dilation),
        ] {
            fits_u32(what, v)?;
        }
        let dtype_code = match info.dtype {
            RowDType::Bf16 => 0,
            RowDType::Fp8E4M3 => 1,
        };

        if gpu.supports_host_kernels() {
            kernels::register_cpu_kernels(gpu).context("registering the PLE CPU kernels")?;
        }
        let k = |name: &str| {
            gpu.kernel("ple", name)
                .with_context(|| format!("resolving PLE kernel '{name}'"))
        };
        let kernels = Kernels {
            gather: k("gather")?,
            project: k("project")?,
            gate: k("gate")?,
            conv: k("conv")?,
            conv_batch: k("conv_batch")?,
        };

        let mut g = AllocGuard {
            gpu,
            ptrs: Vec::new(),
        };
        let mut wbits = Vec::with_capacity(o * e);
        wbits.extend_from_slice(&w.key_proj);
        wbits.extend_from_slice(&w.value_proj);
        let packed = kernels::pack_projection(&wbits, o, e);
        ensure!(
            packed.len() == kernels::packed_len(o, e),
            "packed projection has {} values, packed_len says {}",
            packed.len(),
            kernels::packed_len(o, e)
        );
        drop(wbits);
        let mut bufs = DeviceBufs {
            w_proj: g.upload_f32(&packed, "ple.w_proj")?,
            ..Default::default()
        };
        drop(packed);
        bufs.norm_q = g.upload_f32(&w.norm_query, "ple.norm_query")?;
        bufs.norm_k = g.upload_f32(&w.norm_key, "ple.norm_key")?;
        bufs.norm_conv = g.upload_f32(&w.norm_conv, "ple.norm_conv")?;
        bufs.conv_w = g.upload_f32(&w.conv1d, "ple.conv1d")?;
        bufs.emb = g.alloc(max_tokens * e * 4, "ple.emb")?;
        bufs.kv = g.alloc(max_tokens * o * 4, "ple.kv")?;
        bufs.gated = g.alloc(max_tokens * c * 4, "ple.gated")?;
        bufs.xn = g.alloc(max_tokens * c * 4, "ple.xn")?;
        // The padding row: zero values, then a zero f32 scale (FP8 only).
        let pad_bytes = (info.row_bytes() + 7) / 4 * 4 + 4;
        bufs.pad_row = g.alloc(pad_bytes, "ple.pad_row")?;
        gpu.memset(bufs.pad_row, 0, pad_bytes)
            .context("zeroing the PLE padding row")?;
        let max_batch = max_tokens;
        let ring_tokens = (4 * max_tokens).max(64);
        let slots = g.alloc(
            Staging::total_bytes(heads, max_tokens, max_batch, ring_tokens),
            "ple.slots",
        )?;
        let staging = Staging {
            base: slots,
            heads,
            max_tokens,
            max_batch,
            ring_tokens,
            ring: Default::default(),
            cursor: 0,
            batch: Default::default(),
            pad_states: Vec::new(),
            streams: Default::default(),
        };
        g.ptrs.clear();
        Ok(PleLayer {
            dims,
            hasher,
            state_len,
            hc_mult,
            hidden,
            head_dim,
            k_size,
            dilation,
            eps,
            max_tokens,
            table,
            dtype_code,
            kernels,
            bufs,
            staging: Mutex::new(staging),
            freed: false,
        })
    }

    /// The id hash geometry.
    pub fn dims(&self) -> &PleIdDims {
        &self.dims
    }
    /// Width of one residual stream.
    pub fn hidden(&self) -> usize {
        self.hidden
    }
    /// Number of residual streams.
    pub fn hc_mult(&self) -> usize {
        self.hc_mult
    }
    /// `C = hc_mult * hidden`, the width of one highway row.
    pub fn channels(&self) -> usize {
        self.hc_mult * self.hidden
    }
    /// Rows of conv state, `(K - 1) * D`.
    pub fn state_len(&self) -> usize {
        self.state_len
    }
    /// Values per table row.
    pub fn head_dim(&self) -> usize {
        self.head_dim
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
        self.state_len * self.channels() * 4
    }
    /// Bytes of the aux blob of a sequence with a full history.
    pub fn aux_blob_bytes(&self) -> usize {
        4 + 4 * self.dims.context_len() + self.conv_state_bytes()
    }
    /// The table the layer reads.
    pub fn table(&self) -> &Arc<dyn RowTable> {
        &self.table
    }

    /// Start reading the table rows a forward of `tokens` will gather,
    /// for a sequence whose tokens so far end with `history` (only the last
    /// `context_len` matter; a shorter one acts as if EOS-padded, as for a
    /// fresh carry). Advice only: nothing is pinned and the results never
    /// change; a table that holds its rows in place does nothing. Lets a
    /// scheduler overlap the next step's reads with this step's compute.
    pub fn prefetch(&self, history: &[u32], tokens: &[u32]) -> Result<()> {
        self.check_live()?;
        if tokens.is_empty() {
            return Ok(());
        }
        let heads = self.dims.ngram_heads();
        let mut ids = vec![0u64; tokens.len() * heads];
        self.hasher
            .ids_with_history_into(history, tokens, &mut ids)?;
        Ok(self.table.prefetch(&ids)?)
    }

    fn check_live(&self) -> Result<()> {
        ensure!(!self.freed, "this PLE layer was freed");
        Ok(())
    }

    /// A new sequence carry. Its history is empty, so the first forward or
    /// prestage resets it (zeroes the conv state).
    pub fn new_seq_state(&self, gpu: &dyn GpuBackend) -> Result<PleSeqState> {
        self.check_live()?;
        let conv = gpu.alloc(self.conv_state_bytes(), "ple.conv_state")?;
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

    /// Resolve `flat_ids` through the table, upload the row refs into a fresh
    /// region of the staging ring and return the region's device address.
    /// The region keeps the table's leases until its rows have been gathered
    /// (or the region is reused, or the layer freed).
    pub(super) fn gather_host(
        &self,
        flat_ids: &[u64],
        gpu: &dyn GpuBackend,
        stream: u64,
    ) -> Result<u64> {
        self.check_live()?;
        ensure!(!flat_ids.is_empty(), "PLE gather_host called with no ids");
        ensure!(
            !gpu.stream_is_capturing(stream)?,
            "PLE prestage refused: stream {stream} is capturing (prestage before capture or replay)"
        );
        let mut stg = self.staging.lock();
        stg.streams.insert(stream);
        let (start, va) = stg.ring_take(flat_ids.len(), self.table.as_ref(), gpu, stream)?;
        let mut refs = Vec::with_capacity(flat_ids.len());
        let leases = staging::resolve_all(self.table.as_ref(), flat_ids, &mut refs, gpu)?;
        if let Err(e) = gpu.copy_h2d_async(&staging::refs_bytes(&refs), va, stream) {
            let _ = staging::release_at_tail(self.table.as_ref(), gpu, stream, leases);
            return Err(anyhow::Error::new(e).context("uploading PLE row refs to the staging ring"));
        }
        stg.ring_commit(start, flat_ids, leases);
        Ok(va.addr())
    }

    /// The ids of the heads of orders below N for the last token of a
    /// post-prestage `history`: the only ones the history still determines
    /// (order N also needs the token that left the history).
    fn checkable_ids(&self, history: &[u32]) -> Vec<u64> {
        if history.is_empty() {
            return Vec::new();
        }
        let n = self.dims.ngram_size;
        let known = (n - 2) * self.dims.heads_per_ngram;
        let rows = ple_ngram_ids(&self.dims, history);
        rows[rows.len() - 1][..known].to_vec()
    }

    /// Token ids for `n` tokens starting at entry `first` of the context's
    /// source (override, else host ids, else a blocking device read).
    fn tokens_from(
        &self,
        ctx: &ForwardContext<'_>,
        first: usize,
        n: usize,
        capturing: bool,
        stream: StreamId,
    ) -> Result<Vec<u32>> {
        let pick = |src: &[u32], what: &str| -> Result<Vec<u32>> {
            ensure!(
                src.len() >= first + n,
                "PLE forward needs {} {what} token ids, the context holds {}",
                first + n,
                src.len()
            );
            Ok(src[first..first + n].to_vec())
        };
        if let Some(o) = ctx.token_override {
            return pick(o, "override");
        }
        if let Some(h) = ctx.host_ids {
            return pick(h, "host");
        }
        if let Some(d) = ctx.device_ids {
            ensure!(
                !capturing,
                "PLE forward refused: reading token ids back from device address {d} is a blocking \
                 read and stream {stream} is capturing; prestage the step before capture"
            );
            let mut buf = vec![0u8; n * 4];
            ctx.gpu
                .copy_d2h_on_stream(d.offset(first * 4), &mut buf, stream)
                .with_context(|| format!("reading {n} PLE token ids from device address {d}"))?;
            return Ok(buf
                .chunks_exact(4)
                .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect());
        }
        bail!(
            "PLE forward has no token ids: no override, host ids or device ids in the context, and no prestage"
        )
    }

    fn check_capture(ctx: &ForwardContext<'_>, stream: StreamId) -> Result<bool> {
        Ok(ctx.capturing || ctx.gpu.stream_is_capturing(stream)?)
    }

    /// Run the forward over `num_tokens` new tokens of one sequence, adding
    /// into `highway [num_tokens, C]`, with the semantics of SPEC.md section 5:
    /// reset when `fresh` or the history has the wrong length; a single-token,
    /// non-fresh forward without an override consumes the prestage; the
    /// prestage is taken in every case; without one, the forward hashes,
    /// gathers and advances the history itself, which is refused under
    /// capture.
    pub fn forward(
        &self,
        st: &mut PleSeqState,
        highway: DevicePtr,
        num_tokens: usize,
        fresh: bool,
        ctx: &ForwardContext<'_>,
        stream: StreamId,
    ) -> Result<()> {
        self.check_live()?;
        let gpu = ctx.gpu;
        ensure!(
            !st.conv.is_null(),
            "PLE forward on a released sequence state"
        );
        ensure!(num_tokens > 0, "PLE forward over zero tokens");
        ensure!(!highway.is_null(), "PLE forward with a null highway");
        let capturing = Self::check_capture(ctx, stream)?;
        let staged = st.prestaged_va.take();
        let needs_reset = fresh || st.history.len() != self.dims.context_len();
        if needs_reset {
            ensure!(
                !capturing,
                "PLE forward refused: resetting a sequence (fresh, or a history of {} tokens) \
                 cannot be captured; run it eagerly",
                st.history.len()
            );
            self.reset(st, gpu, stream)?;
        }
        let heads = self.dims.ngram_heads();
        let usable = num_tokens == 1 && !needs_reset && ctx.token_override.is_none();
        if let (Some(va), true) = (staged, usable) {
            let mut stg = self.staging.lock();
            stg.streams.insert(stream);
            let expect = self.checkable_ids(&st.history);
            let at = stg.lookup(va, heads, st.conv.addr(), &expect)?;
            ensure!(
                !capturing || matches!(at, StagedAt::Batch(_)),
                "PLE forward refused under capture: the prestage at {va:#x} lives in the staging \
                 ring, whose addresses change every step; use prestage_batch so that a replay \
                 reads fixed slots"
            );
            self.launch_gather(gpu, DevicePtr(va), heads, 0, stream)?;
            if capturing {
                stg.mark_captured(at);
            } else {
                stg.mark_gathered(at, self.table.as_ref(), gpu, stream)?;
            }
            drop(stg);
            return self.launch_rest(gpu, highway, 1, ConvTarget::Single(st.conv), stream);
        }
        if capturing {
            Self::refuse_unstaged(ctx, stream)?;
        }
        let tokens = self.tokens_from(ctx, 0, num_tokens, capturing, stream)?;
        self.forward_eager(gpu, st, highway, &tokens, stream)
    }

    fn refuse_unstaged(ctx: &ForwardContext<'_>, stream: StreamId) -> Result<()> {
        if ctx.token_override.is_none() && ctx.host_ids.is_none() && ctx.device_ids.is_some() {
            bail!(
                "PLE forward refused: reading token ids back from the device is a blocking read \
                 and stream {stream} is capturing; prestage the step before capture"
            );
        }
        bail!(
            "PLE forward refused under capture: no prestage for this step, and hashing and row \
             resolution are host work that a graph cannot replay; prestage before capture"
        )
    }

    /// Hash `tokens` against the history, gather their rows chunk by chunk
    /// through the eager staging part and run the kernels, advancing the
    /// history after each chunk.
    fn forward_eager(
        &self,
        gpu: &dyn GpuBackend,
        st: &mut PleSeqState,
        highway: DevicePtr,
        tokens: &[u32],
        stream: StreamId,
    ) -> Result<()> {
        let heads = self.dims.ngram_heads();
        let mut all = vec![0u64; tokens.len() * heads];
        self.hasher
            .ids_with_history_into(&st.history, tokens, &mut all)?;
        let c = self.channels();
        let mut t0 = 0;
        while t0 < tokens.len() {
            let tn = (tokens.len() - t0).min(self.max_tokens);
            self.gather_eager(gpu, &all[t0 * heads..(t0 + tn) * heads], stream)?;
            self.launch_rest(
                gpu,
                highway.offset(t0 * c * 4),
                tn,
                ConvTarget::Single(st.conv),
                stream,
            )?;
            // Per chunk, so a failure in a later chunk leaves a carry that is
            // consistent with the chunks that ran.
            self.dims
                .advance_history(&mut st.history, &tokens[t0..t0 + tn]);
            t0 += tn;
        }
        Ok(())
    }

    /// Resolve and gather `ids` (at most `max_tokens * heads`) into `emb`
    /// through the eager staging part, in parts of at most `max_resolve()`
    /// distinct ids; each part's lease is released with an event recorded
    /// right after its gather.
    fn gather_eager(&self, gpu: &dyn GpuBackend, ids: &[u64], stream: StreamId) -> Result<()> {
        let mut stg = self.staging.lock();
        stg.streams.insert(stream);
        let table = self.table.as_ref();
        let mut start = 0;
        while start < ids.len() {
            let end = staging::part_end(ids, start, table.max_resolve());
            let mut refs = vec![RowRef::default(); end - start];
            let lease = table
                .resolve(&ids[start..end], &mut refs)
                .with_context(|| {
                    format!(
                        "resolving PLE row ids {start}..{end} of {} (first id {})",
                        ids.len(),
                        ids[start]
                    )
                })?;
            let queued = gpu
                .copy_h2d_async(&staging::refs_bytes(&refs), stg.eager_ref(start), stream)
                .context("uploading PLE row refs")
                .and_then(|()| {
                    self.launch_gather(gpu, stg.eager_ref(start), end - start, start, stream)
                });
            let released = staging::release_at_tail(table, gpu, stream, vec![lease]);
            queued?;
            released?;
            start = end;
        }
        Ok(())
    }

    /// Queue the gather of `n` rows whose refs are at `refs` into `emb`,
    /// starting at emb row `first_row` (in head rows).
    fn launch_gather(
        &self,
        gpu: &dyn GpuBackend,
        refs: DevicePtr,
        n: usize,
        first_row: usize,
        stream: StreamId,
    ) -> Result<()> {
        gpu.launch(self.kernels.gather, LaunchConfig::linear(1, 1))
            .ptr(refs)
            .u32(n as u32)
            .u32(self.head_dim as u32)
            .u32(self.dtype_code)
            .ptr(self.bufs.emb.offset(first_row * self.head_dim * 4))
            .run(stream)
            .with_context(|| format!("launching PLE gather of {n} rows from refs at {refs}"))
    }

    /// Queue projection, gate and conv over `t` rows of `emb` and `highway`.
    fn launch_rest(
        &self,
        gpu: &dyn GpuBackend,
        highway: DevicePtr,
        t: usize,
        conv: ConvTarget,
        stream: StreamId,
    ) -> Result<()> {
        let e = self.dims.ngram_heads() * self.head_dim;
        let c = self.channels();
        let o = c + self.hidden;
        let cfg = LaunchConfig::linear(1, 1);
        gpu.launch(self.kernels.project, cfg)
            .ptr(self.bufs.emb)
            .ptr(self.bufs.w_proj)
            .ptr(self.bufs.kv)
            .u32(t as u32)
            .u32(e as u32)
            .u32(o as u32)
            .run(stream)
            .with_context(|| format!("launching PLE projection over {t} rows"))?;
        gpu.launch(self.kernels.gate, cfg)
            .ptr(highway)
            .ptr(self.bufs.kv)
            .ptr(self.bufs.norm_q)
            .ptr(self.bufs.norm_k)
            .ptr(self.bufs.norm_conv)
            .ptr(self.bufs.gated)
            .ptr(self.bufs.xn)
            .u32(t as u32)
            .u32(self.hidden as u32)
            .u32(self.hc_mult as u32)
            .f32(self.eps)
            .run(stream)
            .with_context(|| format!("launching PLE gate over {t} rows of highway {highway}"))?;
        let (kernel, state) = match conv {
            ConvTarget::Single(p) => (self.kernels.conv, p),
            ConvTarget::Table(p) => (self.kernels.conv_batch, p),
        };
        gpu.launch(kernel, cfg)
            .ptr(self.bufs.xn)
            .ptr(self.bufs.gated)
            .ptr(state)
            .ptr(self.bufs.conv_w)
            .ptr(highway)
            .u32(t as u32)
            .u32(c as u32)
            .u32(self.k_size as u32)
            .u32(self.dilation as u32)
            .run(stream)
            .with_context(|| format!("launching PLE conv over {t} rows (state {state})"))
    }

    /// One sequence's single decode token on row `row` of a batch highway
    /// `[B, C]`: the context's ids (override, host or device) hold one id per
    /// batch row and entry `row` is used. Otherwise exactly [`Self::forward`]
    /// with one non-fresh token.
    pub fn forward_row(
        &self,
        st: &mut PleSeqState,
        highway: DevicePtr,
        row: usize,
        ctx: &ForwardContext<'_>,
        stream: StreamId,
    ) -> Result<()> {
        let pick = |s: Option<&'_ [u32]>, what: &str| -> Result<Option<std::ops::Range<usize>>> {
            match s {
                Some(v) => {
                    ensure!(
                        row < v.len(),
                        "PLE forward_row: row {row} but the {what} ids hold {} rows",
                        v.len()
                    );
                    Ok(Some(row..row + 1))
                }
                None => Ok(None),
            }
        };
        let mut sub = ForwardContext::new(ctx.gpu).capturing(ctx.capturing);
        if let (Some(o), Some(r)) = (ctx.token_override, pick(ctx.token_override, "override")?) {
            sub.token_override = Some(&o[r]);
        }
        if let (Some(h), Some(r)) = (ctx.host_ids, pick(ctx.host_ids, "host")?) {
            sub.host_ids = Some(&h[r]);
        }
        sub.device_ids = ctx.device_ids.map(|d| d.offset(row * 4));
        self.forward(
            st,
            highway.offset(row * self.channels() * 4),
            1,
            false,
            &sub,
            stream,
        )
    }

    /// The host half of one batched decode step: for sequence `i` (one new
    /// token `tokens[i]` each), hash, resolve and stage its rows at fixed batch
    /// slot `i`, put its conv-state address in slot `i` of the conv table, and
    /// advance its history. Slots `B..rows` are padding (a zero row and a
    /// layer-owned dummy conv state), so a graph captured for `rows` rows can
    /// be replayed for any smaller batch. The previous batch's leases are
    /// released once everything queued so far has run.
    ///
    /// On error nothing is staged and no history advances (a sequence whose
    /// history had the wrong length may have been reset, as any forward would).
    pub fn prestage_batch(
        &self,
        states: &mut [&mut PleSeqState],
        tokens: &[u32],
        rows: usize,
        gpu: &dyn GpuBackend,
        stream: StreamId,
    ) -> Result<()> {
        self.check_live()?;
        let b = states.len();
        ensure!(b > 0, "PLE prestage_batch with no sequences");
        ensure!(
            tokens.len() == b,
            "PLE prestage_batch: {} tokens for {b} sequences",
            tokens.len()
        );
        ensure!(
            rows >= b && rows <= self.max_batch(),
            "PLE prestage_batch: {rows} rows for {b} sequences (at most {} rows)",
            self.max_batch()
        );
        ensure!(
            !gpu.stream_is_capturing(stream)?,
            "PLE prestage refused: stream {stream} is capturing (prestage before capture or replay)"
        );
        let mut seen = std::collections::HashSet::new();
        for (i, st) in states.iter().enumerate() {
            ensure!(
                !st.conv.is_null(),
                "PLE prestage_batch: sequence {i} was released"
            );
            ensure!(
                seen.insert(st.conv.addr()),
                "PLE prestage_batch: sequence {i} appears twice in the batch"
            );
        }
        let ctxl = self.dims.context_len();
        for st in states.iter_mut() {
            if st.history.len() != ctxl {
                self.reset(st, gpu, stream)?;
            }
        }
        let heads = self.dims.ngram_heads();
        let mut ids = vec![0u64; b * heads];
        let histories: Vec<&[u32]> = states.iter().map(|s| s.history.as_slice()).collect();
        self.hasher
            .decode_batch_into(&histories, tokens, &mut ids)?;
        let new_hist: Vec<Vec<u32>> = states
            .iter()
            .zip(tokens)
            .map(|(st, &tok)| {
                let mut h = st.history.clone();
                self.dims.advance_history(&mut h, &[tok]);
                h
            })
            .collect();
        let table = self.table.as_ref();
        let mut stg = self.staging.lock();
        stg.streams.insert(stream);
        let old = std::mem::take(&mut stg.batch);
        staging::release_at_tail(table, gpu, stream, old.leases)?;
        while stg.pad_states.len() < rows - b {
            let p = gpu.alloc(self.conv_state_bytes(), "ple.pad_conv_state")?;
            stg.pad_states.push(p);
            gpu.memset(p, 0, self.conv_state_bytes())?;
        }
        let mut refs = Vec::with_capacity(rows * heads);
        let leases = staging::resolve_all(table, &ids, &mut refs, gpu)?;
        let pad_scale = match self.dtype_code {
            0 => 0,
            _ => self
                .bufs
                .pad_row
                .offset(self.table.info().row_bytes().div_ceil(4) * 4)
                .addr(),
        };
        let pad = RowRef {
            data: self.bufs.pad_row.addr(),
            scale: pad_scale,
        };
        refs.resize(rows * heads, pad);
        let mut table_bytes = Vec::with_capacity(rows * 8);
        for st in states.iter() {
            table_bytes.extend_from_slice(&st.conv.addr().to_le_bytes());
        }
        for p in &stg.pad_states[..rows - b] {
            table_bytes.extend_from_slice(&p.addr().to_le_bytes());
        }
        let up = gpu
            .copy_h2d_async(&staging::refs_bytes(&refs), stg.batch_slot(0), stream)
            .and_then(|()| gpu.copy_h2d_async(&table_bytes, stg.conv_table(), stream));
        if let Err(e) = up {
            let _ = staging::release_at_tail(table, gpu, stream, leases);
            return Err(anyhow::Error::new(e).context("uploading the PLE batch staging"));
        }
        stg.batch = staging::BatchArea {
            owners: states.iter().map(|s| s.conv.addr()).collect(),
            rows,
            slots: vec![staging::SlotUse::Pending; b],
            leases,
        };
        for (i, (st, h)) in states.iter_mut().zip(new_hist).enumerate() {
            let va = stg.batch_slot(i).addr();
            st.history = h;
            st.prestaged_va = Some(va);
            st.last_staged_va = va;
        }
        Ok(())
    }

    /// One decode step for `B = states.len()` sequences, one token each, over
    /// the first `rows >= B` rows of `highway [rows, C]` (rows past `B` are
    /// padding prestaged by [`Self::prestage_batch`]): one gather, one
    /// projection, one gate and one `conv_batch`. Bit-identical to `B`
    /// single-token forwards.
    ///
    /// With every sequence prestaged by one `prestage_batch` (sequence `i` at
    /// slot `i`) and no override, the prestages are consumed; the step can
    /// then be captured. Otherwise (not capturing) the tokens come from the
    /// context, one per sequence, and the step stages them itself. The
    /// prestages are taken in every case.
    pub fn forward_batch(
        &self,
        states: &mut [&mut PleSeqState],
        highway: DevicePtr,
        rows: usize,
        ctx: &ForwardContext<'_>,
        stream: StreamId,
    ) -> Result<()> {
        self.check_live()?;
        let gpu = ctx.gpu;
        let b = states.len();
        ensure!(b > 0, "PLE forward_batch with no sequences");
        ensure!(
            rows >= b && rows <= self.max_batch(),
            "PLE forward_batch: {rows} rows for {b} sequences (at most {} rows)",
            self.max_batch()
        );
        ensure!(!highway.is_null(), "PLE forward_batch with a null highway");
        let capturing = Self::check_capture(ctx, stream)?;
        let staged: Vec<Option<u64>> = states.iter_mut().map(|s| s.prestaged_va.take()).collect();
        if ctx.token_override.is_none() && staged.iter().any(Option::is_some) {
            return self.run_batch_staged(gpu, states, &staged, highway, rows, capturing, stream);
        }
        if capturing {
            Self::refuse_unstaged(ctx, stream)?;
        }
        let tokens = self.tokens_from(ctx, 0, b, capturing, stream)?;
        self.prestage_batch(states, &tokens, rows, gpu, stream)?;
        let staged: Vec<Option<u64>> = states.iter_mut().map(|s| s.prestaged_va.take()).collect();
        self.run_batch_staged(gpu, states, &staged, highway, rows, false, stream)
    }

    /// Check that `staged[i]` is batch slot `i` of the current batch prestage,
    /// for every sequence, and that the batch prestage has exactly these
    /// sequences and at least `rows` rows.
    fn check_batch_staged(
        &self,
        stg: &Staging,
        states: &[&mut PleSeqState],
        staged: &[Option<u64>],
        rows: usize,
    ) -> Result<()> {
        let heads = self.dims.ngram_heads();
        for (i, (st, va)) in states.iter().zip(staged).enumerate() {
            let want = stg.batch_slot(i).addr();
            ensure!(
                *va == Some(want),
                "PLE batch step: sequence {i} is not prestaged at batch slot {i} ({}); prestage the \
                 whole batch with one prestage_batch",
                match va {
                    Some(v) => format!("its prestage is at {v:#x}"),
                    None => "it has no prestage".to_string(),
                }
            );
            match stg.lookup(want, heads, st.conv.addr(), &[])? {
                StagedAt::Batch(s) if s == i => {}
                other => bail!("PLE batch step: sequence {i} resolved to {other:?}"),
            }
        }
        ensure!(
            stg.batch.owners.len() == states.len(),
            "PLE batch step over {} sequences, but the batch prestage holds {}",
            states.len(),
            stg.batch.owners.len()
        );
        ensure!(
            stg.batch.rows >= rows,
            "PLE batch step over {rows} rows, but only {} were prestaged",
            stg.batch.rows
        );
        Ok(())
    }

    #[allow(clippy::too_many_arguments)]
    fn run_batch_staged(
        &self,
        gpu: &dyn GpuBackend,
        states: &mut [&mut PleSeqState],
        staged: &[Option<u64>],
        highway: DevicePtr,
        rows: usize,
        capturing: bool,
        stream: StreamId,
    ) -> Result<()> {
        let mut stg = self.staging.lock();
        stg.streams.insert(stream);
        self.check_batch_staged(&stg, states, staged, rows)?;
        let heads = self.dims.ngram_heads();
        self.launch_gather(gpu, stg.batch_slot(0), rows * heads, 0, stream)?;
        for i in 0..states.len() {
            if capturing {
                stg.mark_captured(StagedAt::Batch(i));
            } else {
                stg.mark_gathered(StagedAt::Batch(i), self.table.as_ref(), gpu, stream)?;
            }
        }
        let table_ptr = stg.conv_table();
        drop(stg);
        self.launch_rest(gpu, highway, rows, ConvTarget::Table(table_ptr), stream)
    }

    /// Call right after each `launch_graph` of a captured decode step whose
    /// rows `prestage_batch` staged (the first replay after the capture
    /// included): takes the sequences' prestages (the replay consumed them
    /// but runs no host code, so none may be applied again to a later token)
    /// and releases the step's leases with an event recorded now on
    /// `stream`, i.e. after the replay's gather. Sequence `i` must hold batch
    /// slot `i`: still prestaged there, or taken by the capture itself.
    pub fn note_replayed(
        &self,
        states: &mut [&mut PleSeqState],
        gpu: &dyn GpuBackend,
        stream: StreamId,
    ) -> Result<()> {
        self.check_live()?;
        let mut stg = self.staging.lock();
        stg.streams.insert(stream);
        ensure!(
            stg.batch.owners.len() == states.len(),
            "PLE note_replayed over {} sequences, but the batch prestage holds {}",
            states.len(),
            stg.batch.owners.len()
        );
        for (i, st) in states.iter().enumerate() {
            let slot = stg.batch_slot(i).addr();
            ensure!(
                stg.batch.owners[i] == st.conv.addr(),
                "PLE note_replayed: batch slot {i} belongs to another sequence"
            );
            match st.prestaged_va {
                Some(va) => ensure!(
                    va == slot,
                    "PLE note_replayed: sequence {i} is prestaged at {va:#x}, not at batch slot {i}"
                ),
                None => ensure!(
                    stg.batch.slots[i] == staging::SlotUse::Captured,
                    "PLE note_replayed: sequence {i} has no prestage at batch slot {i} \
                     (already replayed, or gathered eagerly)"
                ),
            }
            ensure!(
                stg.batch.slots[i] != staging::SlotUse::Gathered,
                "PLE note_replayed: batch slot {i} was already gathered"
            );
        }
        for st in states.iter_mut() {
            st.prestaged_va = None;
        }
        stg.batch
            .slots
            .iter_mut()
            .for_each(|u| *u = staging::SlotUse::Gathered);
        let leases = std::mem::take(&mut stg.batch.leases);
        drop(stg);
        staging::release_at_tail(self.table.as_ref(), gpu, stream, leases)
    }

    /// Free every device allocation of the layer, after synchronising the
    /// streams it was used on and releasing every lease still held.
    /// Idempotent; later calls on the layer fail. Sequence states are not
    /// freed (see [`Self::release_seq_state`]). Call it before destroying
    /// those streams: synchronising a destroyed stream is an error (the
    /// memory is freed all the same, and the first error returned).
    pub fn free(&mut self, gpu: &dyn GpuBackend) -> Result<()> {
        if self.freed {
            return Ok(());
        }
        self.freed = true;
        let mut first_err: Option<anyhow::Error> = None;
        let stg = self.staging.get_mut();
        for s in std::mem::take(&mut stg.streams) {
            if let Err(e) = gpu.synchronize(s) {
                first_err.get_or_insert(anyhow::Error::new(e).context(format!(
                    "synchronising stream {s} before freeing the PLE layer"
                )));
            }
        }
        let mut leases = std::mem::take(&mut stg.batch.leases);
        for r in stg.ring.drain(..) {
            leases.extend(r.leases);
        }
        for l in leases {
            if let Err(e) = self.table.release(l, gpu, None) {
                first_err.get_or_insert(e.into());
            }
        }
        let mut ptrs: Vec<DevicePtr> = std::mem::take(&mut stg.pad_states);
        ptrs.push(stg.base);
        stg.base = DevicePtr::NULL;
        ptrs.extend(self.bufs.all());
        self.bufs = DeviceBufs::default();
        for p in ptrs {
            if let Err(e) = gpu.free(p) {
                first_err.get_or_insert(e);
            }
        }
        match first_err {
            Some(e) => Err(e),
            None => Ok(()),
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

    #[test]
    fn f32_image_is_little_endian() {
        assert_eq!(
            f32_bytes(&[1.0, -2.5]),
            [1.0f32.to_le_bytes(), (-2.5f32).to_le_bytes()].concat()
        );
    }

    #[test]
    fn oversized_kernel_arguments_are_named() {
        assert_eq!(fits_u32("E", 7).unwrap(), 7);
        let e = fits_u32("tokens*ngram_heads", 1 << 33)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("tokens*ngram_heads") && e.contains("8589934592"),
            "{e}"
        );
    }
}
