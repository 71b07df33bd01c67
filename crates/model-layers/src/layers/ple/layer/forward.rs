//! The eager forward of one sequence: token ids from the context, the
//! n-gram hash against the carried history (a plan of one sequence,
//! `layer/plan.rs`), row resolution through the staging area, and the
//! kernel launches (gather, project, then those of
//! the site's combination). Also the staging-ring upload the seed's
//! `prestage` uses.
//!
//! A token mask (DeepSeek-V4.1) shuts the gate of masked tokens by zeroing
//! their rows of `gated` between the gate and the highway add, hashes the
//! tokens with the look-back stopped at masked positions, and leaves the
//! history reading the pad id at and before the last masked token: every
//! later look-back is blocked there, exactly as at a sequence start, so the
//! carry needs no flags of its own.
//!
//! Invariant: the history advances once per token, chunk by chunk, only
//! after the chunk's kernels were queued, and never under capture (a
//! captured forward must consume a prestage made before the capture).

use metrale_gpu_runtime::gpu::{DevicePtr, GpuBackend, StreamId};
use metrale_storage::table::RowRef;

use super::error::{DeviceContext, LayerError, layer_bail, layer_ensure, table_err};
use super::plan::SeqWork;
use super::{ConvTarget, ForwardContext, PleLayer, PleSeqState, Result};
use crate::layers::ple::kernels::args::{
    BiasAddArgs, ConvArgs, ConvBatchArgs, GateArgs, GateNormsArgs, GatherArgs, HighwayAddArgs,
    MeanAddArgs, ProjectArgs,
};
use crate::layers::ple::spec::Combine;
use crate::layers::ple::staging::{self, StagedAt};

impl PleLayer {
    /// Resolve `flat_ids` through the table, upload the row refs into a fresh
    /// region of the staging ring and return the region's device address.
    /// The region keeps the table's leases until its rows have been gathered
    /// (or the region is reused, or the layer freed).
    pub(in crate::layers::ple) fn gather_host(
        &self,
        flat_ids: &[u64],
        gpu: &dyn GpuBackend,
        stream: StreamId,
    ) -> Result<u64> {
        self.check_live()?;
        layer_ensure!(
            !flat_ids.is_empty(),
            Usage,
            "PLE gather_host called with no ids"
        );
        layer_ensure!(
            !gpu.stream_is_capturing(stream)?,
            Capture,
            "PLE prestage refused: stream {stream} is capturing (prestage before capture or replay)"
        );
        let mut stg = self.staging.lock();
        stg.streams.insert(stream);
        let (start, va) = stg.ring_take(flat_ids.len(), self.table.as_ref(), gpu, stream)?;
        let mut refs = Vec::with_capacity(flat_ids.len());
        let leases = staging::resolve_all(self.table.as_ref(), flat_ids, &mut refs, gpu)?;
        if let Err(error) = gpu.copy_h2d_async(&staging::refs_bytes(&refs), va, stream) {
            let _ = staging::release_at_tail(self.table.as_ref(), gpu, stream, leases);
            return Err(LayerError::Device {
                what: "uploading PLE row refs to the staging ring".into(),
                error: Box::new(error),
            });
        }
        stg.ring_commit(start, flat_ids, leases);
        Ok(va.addr())
    }

    /// The ids of the heads of orders below N for the last token of a
    /// post-prestage `history`: the only ones the history still determines
    /// (order N also needs the token that left the history).
    fn checkable_ids(&self, history: &[u32]) -> Result<Vec<u64>> {
        if history.is_empty() {
            return Ok(Vec::new());
        }
        let n = self.dims.ngram_size;
        let known = (n - 2) * self.dims.heads_per_ngram;
        let heads = self.dims.ngram_heads();
        let (last, before) = history.split_last().expect("not empty");
        let mut row = vec![0u64; heads];
        self.hasher
            .ids_with_history_into(before, std::slice::from_ref(last), &mut row)?;
        row.truncate(known);
        Ok(row)
    }

    /// Token ids for `n` tokens starting at entry `first` of the context's
    /// source (override, else host ids, else a blocking device read).
    pub(super) fn tokens_from(
        &self,
        ctx: &ForwardContext<'_>,
        first: usize,
        n: usize,
        capturing: bool,
        stream: StreamId,
    ) -> Result<Vec<u32>> {
        let pick = |src: &[u32], what: &str| -> Result<Vec<u32>> {
            layer_ensure!(
                src.len() >= first + n,
                Usage,
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
            layer_ensure!(
                !capturing,
                Capture,
                "PLE forward refused: reading token ids back from device address {d} is a blocking \
                 read and stream {stream} is capturing; prestage the step before capture"
            );
            let mut buf = vec![0u8; n * 4];
            ctx.gpu
                .copy_d2h_on_stream(d.offset(first * 4), &mut buf, stream)
                .device(|| format!("reading {n} PLE token ids from device address {d}"))?;
            return Ok(buf
                .chunks_exact(4)
                .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect());
        }
        layer_bail!(
            Usage,
            "PLE forward has no token ids: no override, host ids or device ids in the context, and no prestage"
        )
    }

    pub(super) fn check_capture(&self, ctx: &ForwardContext<'_>, stream: StreamId) -> Result<bool> {
        let capturing = ctx.capturing || ctx.gpu.stream_is_capturing(stream)?;
        if capturing && !self.supports_capture() {
            let tp = self.tensor_parallel();
            layer_bail!(
                Capture,
                "PLE forward refused under capture: tensor-parallel rank {} of {} reduces its \
                 projection through a collective that cannot be captured; run it eagerly",
                tp.rank(),
                tp.ranks()
            );
        }
        Ok(capturing)
    }

    /// Whether forwards of this layer can be captured in a graph: always
    /// for one rank; for a tensor-parallel rank, when its collective can
    /// ([`crate::layers::ple::Reduce::capturable`]).
    pub fn supports_capture(&self) -> bool {
        self.shard.as_ref().is_none_or(|s| s.reduce.capturable())
    }

    /// The mask of a call over `n` tokens (or batch rows), checked: refused
    /// on a site whose combination takes none, when its length is not `n`,
    /// and, with a flag set, under capture (zeroing rows and resetting
    /// histories is per-step work a replayed graph would not redo). `None`
    /// when no flag is set, so an all-clear mask costs nothing.
    pub(super) fn check_mask<'m>(
        &self,
        masked: Option<&'m [bool]>,
        n: usize,
        capturing: bool,
    ) -> Result<Option<&'m [bool]>> {
        let Some(m) = masked else {
            return Ok(None);
        };
        let takes = self.spec.combine.gated().is_some_and(|g| g.token_mask);
        layer_ensure!(
            takes,
            TokenMask,
            "PLE token mask refused: this {} site's published layer has no token mask (only \
             DeepSeek-V4.1's Engram gate without a short conv takes one); leave the mask out",
            self.dims.family.name()
        );
        layer_ensure!(
            m.len() == n,
            TokenMask,
            "PLE token mask holds {} flags for {n} tokens; give one flag per token",
            m.len()
        );
        if !m.contains(&true) {
            return Ok(None);
        }
        layer_ensure!(
            !capturing,
            Capture,
            "PLE forward refused under capture: a masked token's gate and history are reset by \
             host-issued work that a graph replay would not repeat; run masked steps eagerly"
        );
        Ok(Some(m))
    }

    /// After masked tokens: the history reads the raw pad id (the fill of a
    /// fresh history) at and before the last masked token, which blocks the
    /// look-back of every later token (docs/SPEC.md §11 (Families)).
    /// `chunk_masked` flags the chunk that has just advanced `history`.
    pub(super) fn apply_mask_to_history(&self, history: &mut [u32], chunk_masked: &[bool]) {
        let Some(last) = chunk_masked.iter().rposition(|&m| m) else {
            return;
        };
        // The masked token is `after` tokens before the end of the history.
        let after = chunk_masked.len() - 1 - last;
        if after < history.len() {
            let upto = history.len() - after;
            history[..upto].fill(self.dims.eos_token_id);
        }
    }

    /// Run the forward over `num_tokens` new tokens of one sequence, adding
    /// into `highway [num_tokens, C]`, with the semantics of docs/SPEC.md §6
    /// (Carry lifecycle): reset when `fresh` or the history has the wrong
    /// length; a single-token, non-fresh forward without an override
    /// consumes the prestage; the prestage is taken in every case; without
    /// one, the forward plans the tokens against the carry, gathers and
    /// advances the history itself ([`Self::run`] of its own plan), which is
    /// refused under capture.
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
        layer_ensure!(
            !st.conv.is_null(),
            Usage,
            "PLE forward on a released sequence state"
        );
        layer_ensure!(num_tokens > 0, Usage, "PLE forward over zero tokens");
        layer_ensure!(!highway.is_null(), Usage, "PLE forward with a null highway");
        let capturing = self.check_capture(ctx, stream)?;
        let masked = self.check_mask(ctx.masked, num_tokens, capturing)?;
        let staged = st.prestaged_va.take();
        let needs_reset = fresh || st.history.len() != self.dims.context_len();
        if needs_reset {
            layer_ensure!(
                !capturing,
                Capture,
                "PLE forward refused: resetting a sequence (fresh, or a history of {} tokens) \
                 cannot be captured; run it eagerly",
                st.history.len()
            );
            self.reset(st, gpu, stream).map_err(LayerError::Reset)?;
        }
        let heads = self.dims.ngram_heads();
        let usable = num_tokens == 1 && !needs_reset && ctx.token_override.is_none();
        if let (Some(va), true) = (staged, usable) {
            let mut stg = self.staging.lock();
            stg.streams.insert(stream);
            let expect = self.checkable_ids(&st.history)?;
            let at = stg.lookup(va, heads, st.conv.addr(), &expect)?;
            layer_ensure!(
                !capturing || matches!(at, StagedAt::Batch(_)),
                Capture,
                "PLE forward refused under capture: the prestage at {va:#x} lives in the staging \
                 ring, whose addresses change every step; use prestage_batch so that a replay \
                 reads fixed slots"
            );
            self.launch_gather(gpu, DevicePtr(va), heads, self.emb_row(0), stream)?;
            if capturing {
                stg.mark_captured(at);
            } else {
                stg.mark_gathered(at, self.table.as_ref(), gpu, stream)?;
            }
            drop(stg);
            self.launch_rest(gpu, highway, 1, ConvTarget::Single(st.conv), masked, stream)?;
            // The prestage advanced the history by this token already.
            if let Some(m) = masked {
                self.apply_mask_to_history(&mut st.history, m);
            }
            return Ok(());
        }
        if capturing {
            Self::refuse_unstaged(ctx, stream)?;
        }
        let tokens = self.tokens_from(ctx, 0, num_tokens, capturing, stream)?;
        let mut work = SeqWork::new(&st.history, &tokens);
        work.masked = masked;
        let plan = self.hash_work(&[work])?;
        self.forward_eager(gpu, st, highway, plan.ids(), &tokens, masked, stream)
    }

    pub(super) fn refuse_unstaged(ctx: &ForwardContext<'_>, stream: StreamId) -> Result<()> {
        if ctx.token_override.is_none() && ctx.host_ids.is_none() && ctx.device_ids.is_some() {
            layer_bail!(
                Capture,
                "PLE forward refused: reading token ids back from the device is a blocking read \
                 and stream {stream} is capturing; prestage the step before capture"
            );
        }
        layer_bail!(
            Capture,
            "PLE forward refused under capture: no prestage for this step, and hashing and row \
             resolution are host work that a graph cannot replay; prestage before capture"
        )
    }

    /// Gather the rows of `all` (the ids of `tokens`, hashed against the
    /// carry's history) chunk by chunk through the eager staging part and
    /// run the kernels, advancing the history after each chunk. With
    /// `masked`, the gates of masked tokens are shut.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn forward_eager(
        &self,
        gpu: &dyn GpuBackend,
        st: &mut PleSeqState,
        highway: DevicePtr,
        all: &[u64],
        tokens: &[u32],
        masked: Option<&[bool]>,
        stream: StreamId,
    ) -> Result<()> {
        let heads = self.dims.ngram_heads();
        let c = self.channels();
        let mut t0 = 0;
        while t0 < tokens.len() {
            let tn = (tokens.len() - t0).min(self.max_tokens);
            let chunk = &all[t0 * heads..(t0 + tn) * heads];
            let at = highway.offset(t0 * c * 4);
            let conv = ConvTarget::Single(st.conv);
            let chunk_masked = masked.map(|m| &m[t0..t0 + tn]);
            match &self.pipeline_groups(chunk) {
                Some(groups) => {
                    let mut stg = self.staging.lock();
                    stg.streams.insert(stream);
                    let refs = stg.eager_ref(0);
                    self.gather_project_in_groups(groups, chunk, tn, refs, gpu, stream)?;
                    drop(stg);
                    self.launch_after_projection(gpu, at, tn, conv, chunk_masked, stream)?;
                }
                None => {
                    self.gather_eager(gpu, chunk, stream)?;
                    self.launch_rest(gpu, at, tn, conv, chunk_masked, stream)?;
                }
            }
            // Per chunk, so a failure in a later chunk leaves a carry that is
            // consistent with the chunks that ran.
            self.dims
                .advance_history(&mut st.history, &tokens[t0..t0 + tn]);
            if let Some(m) = chunk_masked {
                self.apply_mask_to_history(&mut st.history, m);
            }
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
            let lease = table.resolve(&ids[start..end], &mut refs).map_err(|e| {
                table_err(format!(
                    "resolving PLE row ids {start}..{end} of {} (first id {})",
                    ids.len(),
                    ids[start]
                ))(e)
            })?;
            let queued = gpu
                .copy_h2d_async(&staging::refs_bytes(&refs), stg.eager_ref(start), stream)
                .device(|| "uploading PLE row refs".into())
                .and_then(|()| {
                    let out = self.emb_row(start);
                    self.launch_gather(gpu, stg.eager_ref(start), end - start, out, stream)
                });
            let released = staging::release_at_tail(table, gpu, stream, vec![lease]);
            queued?;
            released?;
            start = end;
        }
        Ok(())
    }

    /// The address of head row `row` of `emb`.
    pub(super) fn emb_row(&self, row: usize) -> DevicePtr {
        self.bufs.emb.offset(row * self.row_dim * 4)
    }

    /// Queue the gather of `n` rows whose refs are at `refs` into `out`
    /// (`n * row_dim` f32: rows of `emb`, or a caller's buffer).
    pub(super) fn launch_gather(
        &self,
        gpu: &dyn GpuBackend,
        refs: DevicePtr,
        n: usize,
        out: DevicePtr,
        stream: StreamId,
    ) -> Result<()> {
        let cfg = self.kernels.shapes.gather(n, self.row_dim);
        let a = GatherArgs {
            refs,
            n: n as u32,
            head_dim: self.row_dim as u32,
            dtype: self.dtype_code,
            out,
        };
        gpu.launch(self.kernels.gather, cfg)
            .args(&a)
            .run(stream)
            .device(|| format!("launching PLE gather of {n} rows from refs at {refs}"))
    }

    /// Queue what follows the gather over `t` rows of `emb` and `highway`,
    /// as the site's combination says: the projection, its bias, then the
    /// gate and the conv (or the plain add of a gated site without one), or
    /// the mean with the word embedding. `masked` (checked by
    /// [`Self::check_mask`]) flags rows whose gate is shut.
    pub(super) fn launch_rest(
        &self,
        gpu: &dyn GpuBackend,
        highway: DevicePtr,
        t: usize,
        conv: ConvTarget,
        masked: Option<&[bool]>,
        stream: StreamId,
    ) -> Result<()> {
        let e = self.dims.ngram_heads() * self.row_dim;
        let o = self.projection_outputs();
        let a = ProjectArgs {
            x: self.bufs.emb,
            w: self.bufs.w_proj,
            y: self.bufs.kv,
            t: t as u32,
            e: e as u32,
            o: o as u32,
        };
        gpu.launch(self.kernels.project, self.kernels.shapes.project(t, o))
            .args(&a)
            .run(stream)
            .device(|| format!("launching PLE projection over {t} rows"))?;
        self.launch_after_projection(gpu, highway, t, conv, masked, stream)
    }

    /// Outputs of the projection: the keys of every stream and the value
    /// (gated sites), or the value alone.
    pub(super) fn projection_outputs(&self) -> usize {
        if self.spec.combine.has_key() {
            self.channels() + self.hidden
        } else {
            self.hidden
        }
    }

    /// What [`Self::launch_rest`] queues after the projection.
    pub(super) fn launch_after_projection(
        &self,
        gpu: &dyn GpuBackend,
        highway: DevicePtr,
        t: usize,
        conv: ConvTarget,
        masked: Option<&[bool]>,
        stream: StreamId,
    ) -> Result<()> {
        let c = self.channels();
        let o = self.projection_outputs();
        let shapes = self.kernels.shapes;
        if let Some(s) = &self.shard {
            // A rank's projection is a partial sum over its columns: the
            // collective completes it before anything that is not linear.
            s.reduce
                .all_reduce_sum(gpu, self.bufs.kv, t * o, stream)
                .map_err(|error| LayerError::Reduce {
                    rank: s.tp.rank(),
                    ranks: s.tp.ranks(),
                    len: t * o,
                    error,
                })?;
        }
        if let Some(k) = self.kernels.bias_add {
            let a = BiasAddArgs {
                y: self.bufs.kv,
                bias: self.bufs.bias,
                t: t as u32,
                o: o as u32,
            };
            gpu.launch(k, shapes.elementwise(t * o))
                .args(&a)
                .run(stream)
                .device(|| format!("launching PLE projection bias over {t} rows"))?;
        }
        // The combination's launch dispatch, over the kernels build.rs
        // resolved for its variant.
        let g = match self.spec.combine {
            Combine::Gated(g) => g,
            Combine::Mean => {
                let divisor = (1 + self.dims.ngram_heads()) as f32;
                let k = self
                    .kernels
                    .mean_add
                    .expect("resolved at build for a mean site");
                let a = MeanAddArgs {
                    highway,
                    value: self.bufs.kv,
                    n: (t * c) as u32,
                    divisor,
                };
                return gpu
                    .launch(k, shapes.elementwise(t * c))
                    .args(&a)
                    .run(stream)
                    .device(|| format!("launching PLE mean over {t} rows of highway {highway}"));
            }
        };
        let (t32, h, hc) = (t as u32, self.hidden as u32, self.hc_mult as u32);
        match self.kernels.gate_norms {
            None => {
                let a = GateArgs {
                    highway,
                    kv: self.bufs.kv,
                    norm_q: self.bufs.norm_q,
                    norm_k: self.bufs.norm_k,
                    norm_conv: self.bufs.norm_conv,
                    gated: self.bufs.gated,
                    xn: self.bufs.xn,
                    t: t32,
                    h,
                    hc,
                    eps: self.spec.rms_eps,
                };
                gpu.launch(self.kernels.gate, shapes.gate(t, self.hc_mult))
                    .args(&a)
                    .run(stream)
            }
            Some(k) => {
                let [eps_q, eps_k, eps_conv] = g.eps(self.spec.rms_eps);
                let a = GateNormsArgs {
                    highway,
                    kv: self.bufs.kv,
                    norm_q: self.bufs.norm_q,
                    norm_k: self.bufs.norm_k,
                    norm_conv: self.bufs.norm_conv,
                    gated: self.bufs.gated,
                    xn: self.bufs.xn,
                    t: t32,
                    h,
                    hc,
                    eps_q,
                    eps_k,
                    eps_conv,
                    form: g.form_code(),
                    conv: u32::from(g.conv),
                };
                gpu.launch(k, shapes.gate(t, self.hc_mult))
                    .args(&a)
                    .run(stream)
            }
        }
        .device(|| format!("launching PLE gate over {t} rows of highway {highway}"))?;
        if let Some(m) = masked {
            self.shut_gates(gpu, m, stream)?;
        }
        if !g.conv {
            let k = self
                .kernels
                .highway_add
                .expect("resolved at build for a conv-less site");
            let a = HighwayAddArgs {
                highway,
                out: self.bufs.gated,
                n: (t * c) as u32,
            };
            return gpu
                .launch(k, shapes.elementwise(t * c))
                .args(&a)
                .run(stream)
                .device(|| {
                    format!("launching PLE highway add over {t} rows of highway {highway}")
                });
        }
        let (t32, c32) = (t as u32, c as u32);
        let (k, d) = (self.spec.kernel as u32, self.spec.dilation as u32);
        let (xn, gated, w) = (self.bufs.xn, self.bufs.gated, self.bufs.conv_w);
        let (launch, state) = match conv {
            ConvTarget::Single(state) => {
                let a = ConvArgs {
                    xn,
                    gated,
                    state,
                    w,
                    highway,
                    t: t32,
                    c: c32,
                    k,
                    d,
                };
                (
                    gpu.launch(self.kernels.conv, shapes.conv(1, c)).args(&a),
                    state,
                )
            }
            ConvTarget::Table(states) => {
                let a = ConvBatchArgs {
                    xn,
                    gated,
                    states,
                    w,
                    highway,
                    b: t32,
                    c: c32,
                    k,
                    d,
                };
                let cfg = shapes.conv(t, c);
                (gpu.launch(self.kernels.conv_batch, cfg).args(&a), states)
            }
        };
        launch
            .run(stream)
            .device(|| format!("launching PLE conv over {t} rows (state {state})"))
    }

    /// Zero the rows of `gated` of each run of masked rows: a shut gate
    /// passes none of the value, so the highway add leaves those rows as
    /// they were. Only sites without a conv take a mask ([`Self::check_mask`]).
    fn shut_gates(&self, gpu: &dyn GpuBackend, masked: &[bool], stream: StreamId) -> Result<()> {
        let row_bytes = self.channels() * 4;
        let mut r = 0;
        while r < masked.len() {
            if !masked[r] {
                r += 1;
                continue;
            }
            let end = masked[r..]
                .iter()
                .position(|&m| !m)
                .map_or(masked.len(), |n| r + n);
            let at = self.bufs.gated.offset(r * row_bytes);
            gpu.memset_async(at, 0, (end - r) * row_bytes, stream)
                .device(|| format!("shutting the PLE gates of masked rows {r}..{end}"))?;
            r = end;
        }
        Ok(())
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
                    layer_ensure!(
                        row < v.len(),
                        Usage,
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
        if let Some(m) = ctx.masked {
            layer_ensure!(
                row < m.len(),
                TokenMask,
                "PLE forward_row: row {row} but the token mask holds {} rows",
                m.len()
            );
            sub.masked = Some(&m[row..row + 1]);
        }
        self.forward(
            st,
            highway.offset(row * self.channels() * 4),
            1,
            false,
            &sub,
            stream,
        )
    }
}
