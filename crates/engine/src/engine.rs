//! The engine: sequences over one or more PLE sites, as a server drives them.
//!
//! A sequence is added (restoring the longest cached prefix), prefilled in
//! chunks, decoded in batches of one token each, verified speculatively and
//! committed, swapped out to host memory or a file and back, and released.
//! The caller passes the highway rows (`[T, hc * hidden]` f32) of every token
//! it runs and gets them back with every site applied in order.
//!
//! Invariants:
//! - a sequence's carry is in exactly one place: resident (one state per
//!   site, charged to the [`MemoryBudget`]), swapped (an encoded
//!   [`Snapshot`] in host memory or in a file, nothing on the device), or
//!   lost (a device operation failed mid-forward; every later use is refused
//!   until it is released);
//! - `tokens` holds exactly the tokens the carry has absorbed; a pending
//!   speculative verify keeps the carry from before it and the draft's input
//!   rows, so `commit(k)` can rebuild the carry of exactly `tokens ++
//!   draft[..k]`;
//! - every input is validated before any state changes (ids, lengths, row
//!   counts, pending verifies), so malformed requests change nothing;
//!   swap-in and snapshot restore build new states and install them only
//!   when everything succeeded;
//! - outputs do not depend on how the work is split: prefill chunking,
//!   batching, prefix hits, swaps and speculative rollback all give the
//!   highway a plain sequential run gives, bit for bit (this rests on the
//!   site's forward being independent of chunking and batching);
//! - the prefix cache holds snapshots taken at block boundaries during
//!   prefill and decode, keyed by the tokens; it is only valid when the highway rows
//!   of a token are a function of the token prefix, as in a causal model.
//!
//! Concurrency: the engine is driven through `&mut self` from one thread; it
//! uses one stream of the backend and synchronises on it before returning
//! outputs.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;

use anyhow::{Context, Result, anyhow, bail};
use metrale_gpu_runtime::gpu::{DevicePtr, GpuBackend, GraphHandle, StreamId};
use thiserror::Error;

use crate::budget::{BudgetStats, MemoryBudget};
use crate::prefix_cache::{PrefixCache, PrefixCacheStats};
use crate::snapshot::{GeometryFingerprint, SiteGeometry, Snapshot};

/// A sequence id, unique for the engine's lifetime.
pub type SeqId = u64;

/// What the engine needs of a PLE site. [`crate::ple_site::PleSite`]
/// implements it for the PLE layer.
pub trait Site: Send + Sync {
    /// The per-sequence carry.
    type State: Send;

    /// The site's geometry and hash constants.
    fn geometry(&self) -> SiteGeometry;
    /// The most tokens one forward (or sequences one batched forward) takes.
    fn max_tokens(&self) -> usize;
    /// Device bytes one carry holds.
    fn carry_bytes(&self) -> usize {
        self.geometry().conv_bytes()
    }
    /// Allocate a carry.
    fn new_state(&self, gpu: &dyn GpuBackend) -> Result<Self::State>;
    /// Run `tokens` of one sequence over the `[T, C]` rows at `highway`.
    /// `fresh` starts the sequence over.
    fn forward(
        &self,
        st: &mut Self::State,
        tokens: &[u32],
        highway: DevicePtr,
        fresh: bool,
        gpu: &dyn GpuBackend,
        stream: StreamId,
    ) -> Result<()>;
    /// Run one token of each of `states.len()` sequences; row `b` of the
    /// `[B, C]` rows at `highway` belongs to `states[b]`.
    fn forward_batch(
        &self,
        states: &mut [&mut Self::State],
        tokens: &[u32],
        highway: DevicePtr,
        gpu: &dyn GpuBackend,
        stream: StreamId,
    ) -> Result<()>;
    /// The carry's aux blob (the seed's format).
    fn snapshot(&self, st: &Self::State, gpu: &dyn GpuBackend, stream: StreamId)
    -> Result<Vec<u8>>;
    /// Overwrite the carry from an aux blob.
    fn restore(
        &self,
        st: &mut Self::State,
        blob: &[u8],
        gpu: &dyn GpuBackend,
        stream: StreamId,
    ) -> Result<()>;
    /// Free the carry's device memory. Idempotent.
    fn release(&self, st: &mut Self::State, gpu: &dyn GpuBackend) -> Result<()>;
    /// Free the site's own device memory (weights, staging).
    fn free(&mut self, gpu: &dyn GpuBackend) -> Result<()>;
    /// Whether the site's batched decode can be captured in a graph and
    /// replayed: [`Self::prestage_batch`], [`Self::forward_prestaged`],
    /// [`Self::note_replayed`] and [`Self::rearm`]. The defaults refuse.
    fn supports_graphs(&self) -> bool {
        false
    }
    /// The host half of a replayable decode step: stage sequence `i`'s
    /// token `tokens[i]` at fixed slot `i`, padding the slots up to `rows`.
    fn prestage_batch(
        &self,
        states: &mut [&mut Self::State],
        tokens: &[u32],
        rows: usize,
        gpu: &dyn GpuBackend,
        stream: StreamId,
    ) -> Result<()> {
        let _ = (states, tokens, rows, gpu, stream);
        Err(anyhow!("this site cannot replay decode graphs"))
    }
    /// The device half: the `[rows, C]` rows at `highway` through what
    /// `prestage_batch` staged, reading fixed addresses only, so it can be
    /// captured (or run eagerly).
    fn forward_prestaged(
        &self,
        states: &mut [&mut Self::State],
        highway: DevicePtr,
        rows: usize,
        gpu: &dyn GpuBackend,
        stream: StreamId,
    ) -> Result<()> {
        let _ = (states, highway, rows, gpu, stream);
        Err(anyhow!("this site cannot replay decode graphs"))
    }
    /// Right after each `launch_graph` of a captured step.
    fn note_replayed(
        &self,
        states: &mut [&mut Self::State],
        gpu: &dyn GpuBackend,
        stream: StreamId,
    ) -> Result<()> {
        let _ = (states, gpu, stream);
        Err(anyhow!("this site cannot replay decode graphs"))
    }
    /// After a failed capture: give back the prestage it took.
    fn rearm(&self, st: &mut Self::State) {
        let _ = st;
    }
    /// Start reading what a forward of `tokens` after a sequence whose
    /// tokens end with `history` will need. Advice: the default does
    /// nothing.
    fn prefetch(&self, history: &[u32], tokens: &[u32]) -> Result<()> {
        let _ = (history, tokens);
        Ok(())
    }
}

/// Where a swapped-out carry goes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SwapTarget {
    /// Host memory.
    Host,
    /// A file in [`EngineConfig::swap_dir`].
    File,
}

/// Engine settings.
#[derive(Clone, Debug)]
pub struct EngineConfig {
    /// Most tokens per prefill forward. At most every site's `max_tokens`.
    pub prefill_chunk: usize,
    /// Tokens per prefix-cache block.
    pub block_size: usize,
    /// Prefix-cache capacity in bytes of encoded snapshots; 0 disables it.
    pub prefix_cache_bytes: usize,
    /// Device bytes carries may hold; preemption keeps them within it.
    pub device_budget_bytes: usize,
    /// Where preemption sends carries.
    pub preempt_to: SwapTarget,
    /// Directory for [`SwapTarget::File`].
    pub swap_dir: Option<PathBuf>,
}

impl Default for EngineConfig {
    fn default() -> Self {
        EngineConfig {
            prefill_chunk: 512,
            block_size: 64,
            prefix_cache_bytes: 256 << 20,
            device_budget_bytes: usize::MAX,
            preempt_to: SwapTarget::Host,
            swap_dir: None,
        }
    }
}

/// Requests the engine refuses before changing anything.
#[derive(Debug, Error, Clone, PartialEq, Eq)]
pub enum EngineError {
    /// No such sequence.
    #[error("no sequence {0}")]
    UnknownSequence(SeqId),
    /// The highway rows do not match the tokens.
    #[error("{op}: {rows} highway values given for {tokens} tokens of width {width}")]
    HighwaySize {
        /// The operation.
        op: &'static str,
        /// Values given.
        rows: usize,
        /// Tokens given.
        tokens: usize,
        /// Values per token.
        width: usize,
    },
    /// A speculative verify is pending on the sequence.
    #[error("{op}: sequence {seq} has a pending verify; commit it first")]
    PendingVerify {
        /// The operation.
        op: &'static str,
        /// The sequence.
        seq: SeqId,
    },
    /// `commit` without a verify.
    #[error("commit: sequence {0} has no pending verify")]
    NoPendingVerify(SeqId),
    /// More accepted tokens than drafted.
    #[error("commit: sequence {seq} accepted {accepted} of {drafted} draft tokens")]
    TooManyAccepted {
        /// The sequence.
        seq: SeqId,
        /// Tokens accepted.
        accepted: usize,
        /// Tokens drafted.
        drafted: usize,
    },
    /// A sequence appears twice in one batch.
    #[error("decode: sequence {0} appears twice in one batch")]
    DuplicateInBatch(SeqId),
    /// Decode of a sequence that has run no token.
    #[error("decode: sequence {0} has run no token; prefill it first")]
    NotStarted(SeqId),
    /// The carry was lost by a failed device operation.
    #[error("sequence {seq}: its carry was lost when {cause}; release it")]
    Lost {
        /// The sequence.
        seq: SeqId,
        /// What failed.
        cause: String,
    },
    /// A swap of a sequence in the wrong place.
    #[error("{op}: sequence {seq} is {state}")]
    WrongPlace {
        /// The operation.
        op: &'static str,
        /// The sequence.
        seq: SeqId,
        /// Where it is.
        state: &'static str,
    },
    /// File swap without a directory.
    #[error("swap to file: no swap directory configured")]
    NoSwapDir,
    /// A snapshot's token count differs from the tokens given with it.
    #[error("snapshot holds the carry of {snapshot} tokens, {given} tokens given")]
    TokenCount {
        /// The snapshot's count.
        snapshot: u64,
        /// Tokens given.
        given: usize,
    },
    /// A snapshot's carried history disagrees with the tokens given with it.
    #[error(
        "snapshot history of site {site} is {snapshot:?}, but the tokens given end in {tokens:?}"
    )]
    HistoryMismatch {
        /// The site.
        site: usize,
        /// The history in the snapshot.
        snapshot: Vec<u32>,
        /// The history the tokens imply.
        tokens: Vec<u32>,
    },
    /// A configuration value is out of range.
    #[error("engine config: {0}")]
    Config(String),
}

/// Engine counters and sizes.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct EngineStats {
    /// Live sequences.
    pub sequences: usize,
    /// Sequences with a resident carry.
    pub resident: usize,
    /// Sequences swapped to host memory.
    pub swapped_host: usize,
    /// Sequences swapped to files.
    pub swapped_file: usize,
    /// Host bytes held by swapped carries.
    pub swap_host_bytes: usize,
    /// Swap-outs done (explicit and preemption).
    pub swap_outs: u64,
    /// Swap-ins done.
    pub swap_ins: u64,
    /// Swap-outs done by budget preemption.
    pub preemptions: u64,
    /// Sequences added with a prefix-cache hit.
    pub prefix_hits: u64,
    /// Tokens restored from the prefix cache instead of computed.
    pub prefix_tokens_restored: u64,
    /// Block-boundary snapshots that could not be taken (not cached).
    pub cache_snapshot_failures: u64,
    /// Tokens run by prefill.
    pub prefill_tokens: u64,
    /// Tokens run by decode.
    pub decode_tokens: u64,
    /// Batched decode steps replayed from a captured graph.
    pub graph_replays: u64,
    /// Decode graphs captured (one per padded batch size).
    pub graph_captures: u64,
    /// Speculative verifies.
    pub verifies: u64,
    /// Draft tokens accepted by commits.
    pub accepted_tokens: u64,
    /// Draft tokens rejected by commits.
    pub rejected_tokens: u64,
    /// The device memory budget.
    pub budget: BudgetStats,
    /// The prefix cache.
    pub prefix_cache: PrefixCacheStats,
}

/// What [`Engine::add_sequence`] did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Added {
    /// The new sequence.
    pub id: SeqId,
    /// Leading prompt tokens restored from the prefix cache; prefill the
    /// rest (`prompt[cached..]`).
    pub cached: usize,
}

enum Swapped {
    /// The sequence had run no token: nothing to keep.
    Empty,
    Host(Vec<u8>),
    File(PathBuf),
}

enum Carry<St> {
    Resident(Vec<St>),
    Swapped(Swapped),
    Lost(String),
}

struct Pending {
    /// Per-site blobs of the carry before the verify; `None` when the
    /// sequence had run no token.
    before: Option<Vec<Vec<u8>>>,
    draft: Vec<u32>,
    rows_in: Vec<f32>,
}

struct Seq<St> {
    tokens: Vec<u32>,
    carry: Carry<St>,
    pending: Option<Pending>,
}

/// The engine. See the module docs.
pub struct Engine<S: Site> {
    gpu: Arc<dyn GpuBackend>,
    stream: StreamId,
    sites: Vec<S>,
    geoms: Vec<SiteGeometry>,
    fingerprint: GeometryFingerprint,
    width: usize,
    carry_bytes: usize,
    max_rows: usize,
    batch_cap: usize,
    cfg: EngineConfig,
    highway: DevicePtr,
    seqs: HashMap<SeqId, Seq<S::State>>,
    next_id: SeqId,
    cache: PrefixCache<Arc<Snapshot>>,
    budget: MemoryBudget,
    stats: EngineStats,
    /// Captured decode graphs by padded batch size; `None` while decode
    /// runs eagerly.
    graphs: Option<HashMap<usize, GraphHandle>>,
    closed: bool,
    /// Distinguishes the swap files of engines sharing a directory.
    instance: u64,
}

static ENGINE_INSTANCES: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);

fn as_bytes(v: &[f32]) -> &[u8] {
    // SAFETY: f32 has no padding and u8 has alignment 1; the view covers
    // exactly the slice's memory and borrows it immutably.
    unsafe { std::slice::from_raw_parts(v.as_ptr() as *const u8, std::mem::size_of_val(v)) }
}

fn as_bytes_mut(v: &mut [f32]) -> &mut [u8] {
    // SAFETY: as in `as_bytes`; every byte pattern is a valid f32, so writes
    // through the view cannot create an invalid value.
    unsafe { std::slice::from_raw_parts_mut(v.as_mut_ptr() as *mut u8, std::mem::size_of_val(v)) }
}

impl<S: Site> Engine<S> {
    /// An engine over `sites` (applied in order) on `gpu`. All sites must
    /// share the highway width `hc * hidden`.
    pub fn new(gpu: Arc<dyn GpuBackend>, mut sites: Vec<S>, cfg: EngineConfig) -> Result<Self> {
        let r = Self::validate(&sites, &cfg);
        let (width, batch_cap) = match r {
            Ok(v) => v,
            Err(e) => {
                for s in &mut sites {
                    let _ = s.free(gpu.as_ref());
                }
                return Err(e);
            }
        };
        let geoms: Vec<SiteGeometry> = sites.iter().map(Site::geometry).collect();
        let max_rows = cfg.prefill_chunk.max(batch_cap);
        let highway = match gpu.alloc(max_rows * width * 4, "engine highway rows") {
            Ok(p) => p,
            Err(e) => {
                for s in &mut sites {
                    let _ = s.free(gpu.as_ref());
                }
                return Err(anyhow::Error::new(e).context("engine: allocating the highway staging rows"));
            }
        };
        Ok(Engine {
            stream: gpu.default_stream(),
            fingerprint: GeometryFingerprint::of(&geoms),
            carry_bytes: sites.iter().map(Site::carry_bytes).sum(),
            geoms,
            width,
            max_rows,
            batch_cap,
            highway,
            seqs: HashMap::new(),
            next_id: 1,
            cache: PrefixCache::new(cfg.block_size, cfg.prefix_cache_bytes),
            budget: MemoryBudget::new(cfg.device_budget_bytes),
            graphs: None,
            stats: EngineStats::default(),
            closed: false,
            instance: ENGINE_INSTANCES.fetch_add(1, std::sync::atomic::Ordering::Relaxed),
            sites,
            cfg,
            gpu,
        })
    }

    fn validate(sites: &[S], cfg: &EngineConfig) -> Result<(usize, usize)> {
        let Some(first) = sites.first() else {
            bail!(EngineError::Config(
                "at least one PLE site is needed".into()
            ));
        };
        let g0 = first.geometry();
        let width = g0.hc_mult * g0.hidden;
        if width == 0 {
            bail!(EngineError::Config(
                "site 0 has a highway width of 0".into()
            ));
        }
        let mut cap = usize::MAX;
        for (i, s) in sites.iter().enumerate() {
            let g = s.geometry();
            if g.hc_mult * g.hidden != width {
                bail!(EngineError::Config(format!(
                    "site {i} has highway width {} (hc {} x hidden {}), site 0 has {width}",
                    g.hc_mult * g.hidden,
                    g.hc_mult,
                    g.hidden
                )));
            }
            cap = cap.min(s.max_tokens());
        }
        if cap == 0 {
            bail!(EngineError::Config(
                "a site takes 0 tokens per forward".into()
            ));
        }
        if cfg.prefill_chunk == 0 || cfg.prefill_chunk > cap {
            bail!(EngineError::Config(format!(
                "prefill_chunk {} must be in 1..={cap} (the sites' max_tokens)",
                cfg.prefill_chunk
            )));
        }
        if cfg.block_size == 0 {
            bail!(EngineError::Config("block_size must be at least 1".into()));
        }
        Ok((width, cap))
    }

    /// Values per highway row: `hc * hidden`.
    pub fn width(&self) -> usize {
        self.width
    }

    /// The geometry fingerprint snapshots of this engine carry.
    pub fn fingerprint(&self) -> GeometryFingerprint {
        self.fingerprint
    }

    /// Every site's geometry, in order.
    pub fn geometries(&self) -> &[SiteGeometry] {
        &self.geoms
    }

    /// The sites, in order.
    pub fn sites(&self) -> &[S] {
        &self.sites
    }

    /// The backend.
    pub fn gpu(&self) -> &Arc<dyn GpuBackend> {
        &self.gpu
    }

    /// Device bytes one sequence's carry holds (all sites).
    pub fn carry_bytes(&self) -> usize {
        self.carry_bytes
    }

    /// The most sequences one batched forward takes; larger decode batches
    /// are split.
    pub fn batch_capacity(&self) -> usize {
        self.batch_cap
    }

    /// Run batched decode as captured graphs from now on: each step stages
    /// its rows on the host (`prestage_batch`), then replays a graph
    /// captured once per padded batch size (the next power of two, up to
    /// [`Self::batch_capacity`]), as a server replays CUDA graphs. Outputs
    /// are bit-identical to eager decode. Refused when a site cannot replay.
    pub fn enable_decode_graphs(&mut self) -> Result<()> {
        if let Some(i) = self.sites.iter().position(|s| !s.supports_graphs()) {
            bail!("decode graphs: site {i} cannot replay decode graphs");
        }
        self.graphs.get_or_insert_with(HashMap::new);
        Ok(())
    }

    /// Whether batched decode replays captured graphs.
    pub fn decode_graphs(&self) -> bool {
        self.graphs.is_some()
    }

    /// The tokens sequence `id` has absorbed.
    pub fn tokens(&self, id: SeqId) -> Result<&[u32]> {
        Ok(&self.seq(id)?.tokens)
    }

    /// Start the table reads that running `tokens` through sequence `id`
    /// next (a prefill chunk, or one decode token) will need, so they
    /// overlap other work. Advice only: outputs never change, nothing is
    /// pinned, and the sequence may be swapped out meanwhile.
    pub fn prefetch(&self, id: SeqId, tokens: &[u32]) -> Result<()> {
        let history = &self.seq(id)?.tokens;
        for site in &self.sites {
            site.prefetch(history, tokens)?;
        }
        Ok(())
    }

    /// Whether sequence `id`'s carry is on the device.
    pub fn is_resident(&self, id: SeqId) -> Result<bool> {
        Ok(matches!(self.seq(id)?.carry, Carry::Resident(_)))
    }

    /// Live sequence ids, in no particular order.
    pub fn sequence_ids(&self) -> Vec<SeqId> {
        self.seqs.keys().copied().collect()
    }

    /// Counters and sizes.
    pub fn stats(&self) -> EngineStats {
        let mut s = self.stats;
        s.sequences = self.seqs.len();
        s.resident = 0;
        s.swapped_host = 0;
        s.swapped_file = 0;
        s.swap_host_bytes = 0;
        for q in self.seqs.values() {
            match &q.carry {
                Carry::Resident(_) => s.resident += 1,
                Carry::Swapped(Swapped::Host(b)) => {
                    s.swapped_host += 1;
                    s.swap_host_bytes += b.len();
                }
                Carry::Swapped(Swapped::File(_)) => s.swapped_file += 1,
                Carry::Swapped(Swapped::Empty) => s.swapped_host += 1,
                Carry::Lost(_) => {}
            }
        }
        s.budget = self.budget.stats();
        s.prefix_cache = self.cache.stats();
        s
    }

    fn seq(&self, id: SeqId) -> Result<&Seq<S::State>> {
        self.seqs
            .get(&id)
            .ok_or_else(|| anyhow!(EngineError::UnknownSequence(id)))
    }

    fn check_usable(&self, id: SeqId, op: &'static str, pending_ok: bool) -> Result<()> {
        let s = self.seq(id)?;
        if let Carry::Lost(cause) = &s.carry {
            bail!(EngineError::Lost {
                seq: id,
                cause: cause.clone()
            });
        }
        if !pending_ok && s.pending.is_some() {
            bail!(EngineError::PendingVerify { op, seq: id });
        }
        Ok(())
    }

    fn check_rows(&self, op: &'static str, tokens: usize, rows: &[f32]) -> Result<()> {
        if rows.len() != tokens * self.width {
            bail!(EngineError::HighwaySize {
                op,
                rows: rows.len(),
                tokens,
                width: self.width
            });
        }
        Ok(())
    }

    // ---- carries ----

    /// Fresh states for every site, charged to the budget (preempting others
    /// when needed, never `protect`). On failure nothing is held.
    fn alloc_states(&mut self, id: SeqId, protect: &[SeqId]) -> Result<Vec<S::State>> {
        let victims = self.budget.plan_preemption(self.carry_bytes, protect)?;
        for v in victims {
            self.swap_out(v, self.cfg.preempt_to)
                .with_context(|| format!("preempting sequence {v} for sequence {id}"))?;
            self.stats.preemptions += 1;
        }
        self.budget.charge(id, self.carry_bytes)?;
        let mut states = Vec::with_capacity(self.sites.len());
        for (i, site) in self.sites.iter().enumerate() {
            match site.new_state(self.gpu.as_ref()) {
                Ok(st) => states.push(st),
                Err(e) => {
                    let _ = self.free_states(&mut states);
                    self.budget.release(id);
                    return Err(e.context(format!("allocating the carry of site {i}")));
                }
            }
        }
        Ok(states)
    }

    /// Release the states of every site; the first error is returned but
    /// every state is released regardless.
    fn free_states(&self, states: &mut [S::State]) -> Result<()> {
        let mut first = Ok(());
        for (site, st) in self.sites.iter().zip(states.iter_mut()) {
            let r = site.release(st, self.gpu.as_ref());
            if first.is_ok() {
                first = r;
            }
        }
        first
    }

    fn snapshot_states(&self, states: &[S::State]) -> Result<Vec<Vec<u8>>> {
        let mut blobs = Vec::with_capacity(states.len());
        for (i, (site, st)) in self.sites.iter().zip(states).enumerate() {
            blobs.push(
                site.snapshot(st, self.gpu.as_ref(), self.stream)
                    .with_context(|| format!("snapshot of site {i}"))?,
            );
        }
        Ok(blobs)
    }

    fn restore_states(&self, states: &mut [S::State], blobs: &[Vec<u8>]) -> Result<()> {
        for (i, ((site, st), blob)) in self
            .sites
            .iter()
            .zip(states.iter_mut())
            .zip(blobs)
            .enumerate()
        {
            site.restore(st, blob, self.gpu.as_ref(), self.stream)
                .with_context(|| format!("restoring site {i}"))?;
        }
        Ok(self.gpu.synchronize(self.stream)?)
    }

    /// Fresh states holding `blobs` (already validated). On failure nothing
    /// is held.
    fn states_from(
        &mut self,
        id: SeqId,
        blobs: &[Vec<u8>],
        protect: &[SeqId],
    ) -> Result<Vec<S::State>> {
        let mut states = self.alloc_states(id, protect)?;
        if let Err(e) = self.restore_states(&mut states, blobs) {
            let _ = self.free_states(&mut states);
            self.budget.release(id);
            return Err(e);
        }
        Ok(states)
    }

    /// Make `id` resident, swapping it in when needed.
    fn ensure_resident(&mut self, id: SeqId, protect: &[SeqId]) -> Result<()> {
        if !matches!(self.seq(id)?.carry, Carry::Resident(_)) {
            self.swap_in_protected(id, protect)?;
        }
        self.budget.touch(id);
        Ok(())
    }

    // ---- sequences ----

    /// Add a sequence that will run `prompt`. The longest cached block
    /// boundary strictly inside the prompt (at least one token is left to
    /// compute, so the last prompt token gets its output) is restored; the
    /// caller prefills `prompt[added.cached..]`.
    pub fn add_sequence(&mut self, prompt: &[u32]) -> Result<Added> {
        let id = self.next_id;
        let hit = if self.cfg.prefix_cache_bytes > 0 && prompt.len() > 1 {
            self.cache.lookup(&prompt[..prompt.len() - 1])
        } else {
            None
        };
        let (cached, states) = match hit {
            Some((len, snap)) => (len, self.states_from(id, &snap.blobs, &[])?),
            None => (0, self.alloc_states(id, &[])?),
        };
        self.next_id += 1;
        if cached > 0 {
            self.stats.prefix_hits += 1;
            self.stats.prefix_tokens_restored += cached as u64;
        }
        self.seqs.insert(
            id,
            Seq {
                tokens: prompt[..cached].to_vec(),
                carry: Carry::Resident(states),
                pending: None,
            },
        );
        Ok(Added { id, cached })
    }

    /// Add a sequence whose carry is the encoded snapshot `bytes`, taken
    /// after `tokens`. Refused, with nothing changed, when the snapshot does
    /// not decode, belongs to another geometry or another token count.
    pub fn add_from_snapshot(&mut self, bytes: &[u8], tokens: &[u32]) -> Result<SeqId> {
        let snap = Snapshot::decode_for(bytes, &self.geoms)?;
        if snap.token_count != tokens.len() as u64 {
            bail!(EngineError::TokenCount {
                snapshot: snap.token_count,
                given: tokens.len()
            });
        }
        for (site, (g, blob)) in self.geoms.iter().zip(&snap.blobs).enumerate() {
            // The carried history is the last `context_len` tokens of the
            // EOS-filled start followed by the tokens: check it agrees.
            let ctx = g.dims.context_len();
            let mut window = vec![g.dims.eos_token_id; ctx];
            window.extend_from_slice(&tokens[tokens.len().saturating_sub(ctx)..]);
            let want = &window[window.len() - ctx..];
            let have: Vec<u32> = blob[4..4 + 4 * ctx]
                .chunks_exact(4)
                .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect();
            if have != want {
                bail!(EngineError::HistoryMismatch {
                    site,
                    snapshot: have,
                    tokens: want.to_vec()
                });
            }
        }
        let id = self.next_id;
        let states = self.states_from(id, &snap.blobs, &[])?;
        self.next_id += 1;
        self.seqs.insert(
            id,
            Seq {
                tokens: tokens.to_vec(),
                carry: Carry::Resident(states),
                pending: None,
            },
        );
        Ok(id)
    }

    /// The encoded snapshot of sequence `id`'s carry (swapping it in if
    /// needed). A sequence that has run no token has no carry to snapshot.
    pub fn snapshot(&mut self, id: SeqId) -> Result<Vec<u8>> {
        self.check_usable(id, "snapshot", false)?;
        if self.seq(id)?.tokens.is_empty() {
            bail!("snapshot: sequence {id} has run no token");
        }
        self.ensure_resident(id, &[id])?;
        let s = self.seq(id)?;
        let Carry::Resident(states) = &s.carry else {
            unreachable!("made resident above")
        };
        let blobs = self.snapshot_states(states)?;
        Ok(Snapshot {
            fingerprint: self.fingerprint,
            token_count: s.tokens.len() as u64,
            blobs,
        }
        .encode())
    }

    /// Run `tokens` through sequence `id` in chunks of at most
    /// `prefill_chunk` (split further at prefix-cache block boundaries, where
    /// snapshots are cached). `highway` holds `tokens.len()` rows in, and
    /// gets them back with every site applied.
    pub fn prefill(&mut self, id: SeqId, tokens: &[u32], highway: &mut [f32]) -> Result<()> {
        self.check_usable(id, "prefill", false)?;
        self.check_rows("prefill", tokens.len(), highway)?;
        if tokens.is_empty() {
            return Ok(());
        }
        self.ensure_resident(id, &[id])?;
        let caching = self.cfg.prefix_cache_bytes > 0;
        let b = self.cfg.block_size;
        let mut done = 0;
        while done < tokens.len() {
            let have = self.seq(id)?.tokens.len();
            let mut n = (tokens.len() - done).min(self.cfg.prefill_chunk);
            if caching {
                n = n.min(b - have % b);
            }
            let rows = &mut highway[done * self.width..(done + n) * self.width];
            self.run_one(id, &tokens[done..done + n], rows, "prefill")?;
            done += n;
            self.stats.prefill_tokens += n as u64;
            if caching && (have + n).is_multiple_of(b) {
                // Caching is an optimisation: a failed snapshot must not fail
                // a prefill whose forward already ran.
                if self.cache_boundary(id).is_err() {
                    self.stats.cache_snapshot_failures += 1;
                }
            }
        }
        Ok(())
    }

    /// One forward of `tokens` on resident sequence `id`, every site in
    /// order; appends the tokens. A device failure loses the carry.
    fn run_one(&mut self, id: SeqId, tokens: &[u32], rows: &mut [f32], op: &str) -> Result<()> {
        let mut seq = self.seqs.remove(&id).expect("checked by the caller");
        let r = self.forward_rows(&mut seq, tokens, rows);
        match r {
            Ok(()) => seq.tokens.extend_from_slice(tokens),
            Err(ref e) => self.lose(id, &mut seq, format!("{op} failed: {e:#}")),
        }
        self.seqs.insert(id, seq);
        r
    }

    fn forward_rows(
        &self,
        seq: &mut Seq<S::State>,
        tokens: &[u32],
        rows: &mut [f32],
    ) -> Result<()> {
        let Carry::Resident(states) = &mut seq.carry else {
            bail!("internal: forward of a carry that is not resident");
        };
        let fresh = seq.tokens.is_empty();
        let gpu = self.gpu.as_ref();
        gpu.copy_h2d_async(as_bytes(rows), self.highway, self.stream)?;
        for (i, (site, st)) in self.sites.iter().zip(states.iter_mut()).enumerate() {
            site.forward(st, tokens, self.highway, fresh, gpu, self.stream)
                .with_context(|| format!("site {i} forward of {} tokens", tokens.len()))?;
        }
        Ok(gpu.copy_d2h_on_stream(self.highway, as_bytes_mut(rows), self.stream)?)
    }

    /// Drop a carry whose state is unknown after a failed device operation.
    /// Its device memory is freed, so its budget charge goes too: a lost
    /// sequence must never be picked for preemption.
    fn lose(&mut self, id: SeqId, seq: &mut Seq<S::State>, cause: String) {
        if let Carry::Resident(states) = &mut seq.carry {
            let _ = self.free_states(states);
            self.budget.release(id);
        }
        seq.carry = Carry::Lost(cause);
        seq.pending = None;
    }

    fn cache_boundary(&mut self, id: SeqId) -> Result<()> {
        let s = self.seq(id)?;
        if self.cache.contains(&s.tokens) {
            return Ok(());
        }
        let Carry::Resident(states) = &s.carry else {
            return Ok(());
        };
        let blobs = self.snapshot_states(states)?;
        let snap = Snapshot {
            fingerprint: self.fingerprint,
            token_count: s.tokens.len() as u64,
            blobs,
        };
        let bytes = snap.encoded_len();
        let key = s.tokens.clone();
        // A snapshot larger than the whole cache is simply not cached.
        let _ = self.cache.insert(&key, Arc::new(snap), bytes);
        Ok(())
    }

    /// One decode step: token `batch[b].1` for sequence `batch[b].0`, on row
    /// `b` of `highway` (`batch.len()` rows in, out). Batches larger than
    /// [`Self::batch_capacity`], or than the device budget holds carries,
    /// run as several batched forwards in order (outputs do not depend on
    /// the split); if a later part fails, the earlier parts have run.
    pub fn decode(&mut self, batch: &[(SeqId, u32)], highway: &mut [f32]) -> Result<()> {
        self.check_rows("decode", batch.len(), highway)?;
        let mut seen = std::collections::HashSet::with_capacity(batch.len());
        for &(id, _) in batch {
            if !seen.insert(id) {
                bail!(EngineError::DuplicateInBatch(id));
            }
            self.check_usable(id, "decode", false)?;
            if self.seq(id)?.tokens.is_empty() {
                bail!(EngineError::NotStarted(id));
            }
        }
        let fit = (self.budget.limit() / self.carry_bytes.max(1)).max(1);
        let part_len = self.batch_cap.min(fit);
        for (part, rows) in batch
            .chunks(part_len)
            .zip(highway.chunks_mut(part_len * self.width))
        {
            self.decode_part(part, rows)?;
        }
        Ok(())
    }

    fn decode_part(&mut self, part: &[(SeqId, u32)], rows: &mut [f32]) -> Result<()> {
        let ids: Vec<SeqId> = part.iter().map(|p| p.0).collect();
        for &id in &ids {
            self.ensure_resident(id, &ids)?;
        }
        let tokens: Vec<u32> = part.iter().map(|p| p.1).collect();
        let mut taken: Vec<Seq<S::State>> = ids
            .iter()
            .map(|id| self.seqs.remove(id).expect("validated"))
            .collect();
        let r = self.forward_batch_rows(&mut taken, &tokens, rows);
        for (i, mut seq) in taken.into_iter().enumerate() {
            match &r {
                Ok(()) => seq.tokens.push(tokens[i]),
                Err(e) => self.lose(ids[i], &mut seq, format!("a batched decode failed: {e:#}")),
            }
            self.seqs.insert(ids[i], seq);
        }
        if r.is_ok() {
            self.stats.decode_tokens += tokens.len() as u64;
            // Generated tokens are cached at block boundaries too, so the
            // next turn of a conversation, sent as a new sequence, restores
            // past them. As in prefill, a failed snapshot fails nothing.
            if self.cfg.prefix_cache_bytes > 0 {
                let b = self.cfg.block_size;
                for &id in &ids {
                    if self.seq(id)?.tokens.len().is_multiple_of(b)
                        && self.cache_boundary(id).is_err()
                    {
                        self.stats.cache_snapshot_failures += 1;
                    }
                }
            }
        }
        r
    }

    fn forward_batch_rows(
        &mut self,
        taken: &mut [Seq<S::State>],
        tokens: &[u32],
        rows: &mut [f32],
    ) -> Result<()> {
        if self.graphs.is_some() {
            return self.forward_batch_graph(taken, tokens, rows);
        }
        let gpu = self.gpu.as_ref();
        gpu.copy_h2d_async(as_bytes(rows), self.highway, self.stream)?;
        for (k, site) in self.sites.iter().enumerate() {
            let mut states: Vec<&mut S::State> = Vec::with_capacity(taken.len());
            for seq in taken.iter_mut() {
                let Carry::Resident(st) = &mut seq.carry else {
                    bail!("internal: batched forward of a carry that is not resident");
                };
                states.push(&mut st[k]);
            }
            site.forward_batch(&mut states, tokens, self.highway, gpu, self.stream)
                .with_context(|| {
                    format!("site {k} batched decode of {} sequences", tokens.len())
                })?;
        }
        Ok(gpu.copy_d2h_on_stream(self.highway, as_bytes_mut(rows), self.stream)?)
    }

    /// One batched decode step through a captured graph: prestage every
    /// site, capture the step for this padded size if it is the first,
    /// replay it, and note the replay. A failed capture gives the prestages
    /// back and runs the same prestaged step eagerly, so nothing is hashed
    /// twice and the outputs are the same.
    fn forward_batch_graph(
        &mut self,
        taken: &mut [Seq<S::State>],
        tokens: &[u32],
        rows: &mut [f32],
    ) -> Result<()> {
        fn states_of<St>(taken: &mut [Seq<St>], k: usize) -> Result<Vec<&mut St>> {
            taken
                .iter_mut()
                .map(|seq| match &mut seq.carry {
                    Carry::Resident(st) => Ok(&mut st[k]),
                    _ => Err(anyhow!(
                        "internal: batched forward of a carry that is not resident"
                    )),
                })
                .collect()
        }
        let gpu = self.gpu.clone();
        let gpu = gpu.as_ref();
        let stream = self.stream;
        let padded = tokens.len().next_power_of_two().min(self.batch_cap);
        gpu.copy_h2d_async(as_bytes(rows), self.highway, stream)?;
        for (k, site) in self.sites.iter().enumerate() {
            site.prestage_batch(&mut states_of(taken, k)?, tokens, padded, gpu, stream)
                .with_context(|| format!("site {k} prestage of {} sequences", tokens.len()))?;
        }
        let known = self.graphs.as_ref().and_then(|g| g.get(&padded)).copied();
        let graph = match known {
            Some(g) => Some(g),
            None => {
                gpu.begin_capture(stream)?;
                let mut captured = Ok(());
                for (k, site) in self.sites.iter().enumerate() {
                    captured = states_of(taken, k).and_then(|mut st| {
                        site.forward_prestaged(&mut st, self.highway, padded, gpu, stream)
                    });
                    if captured.is_err() {
                        break;
                    }
                }
                match (captured, gpu.end_capture(stream)) {
                    (Ok(()), Ok(g)) => {
                        self.graphs
                            .get_or_insert_with(HashMap::new)
                            .insert(padded, g);
                        self.stats.graph_captures += 1;
                        Some(g)
                    }
                    (_, ended) => {
                        if let Ok(g) = ended {
                            let _ = gpu.destroy_graph(g);
                        }
                        for (k, site) in self.sites.iter().enumerate() {
                            for st in states_of(taken, k)? {
                                site.rearm(st);
                            }
                        }
                        None
                    }
                }
            }
        };
        match graph {
            Some(g) => {
                gpu.launch_graph(g, stream)?;
                for (k, site) in self.sites.iter().enumerate() {
                    site.note_replayed(&mut states_of(taken, k)?, gpu, stream)?;
                }
                self.stats.graph_replays += 1;
            }
            None => {
                for (k, site) in self.sites.iter().enumerate() {
                    site.forward_prestaged(
                        &mut states_of(taken, k)?,
                        self.highway,
                        padded,
                        gpu,
                        stream,
                    )
                    .with_context(|| {
                        format!("site {k} batched decode of {} sequences", tokens.len())
                    })?;
                }
            }
        }
        Ok(gpu.copy_d2h_on_stream(self.highway, as_bytes_mut(rows), stream)?)
    }

    /// Speculative verify: run `draft` through sequence `id` and return, in
    /// `highway`, the output rows of every draft position. The carry from
    /// before is kept until [`Self::commit`] says how many tokens stay.
    pub fn verify(&mut self, id: SeqId, draft: &[u32], highway: &mut [f32]) -> Result<()> {
        self.check_usable(id, "verify", false)?;
        self.check_rows("verify", draft.len(), highway)?;
        self.ensure_resident(id, &[id])?;
        let before = {
            let s = self.seq(id)?;
            match &s.carry {
                Carry::Resident(states) if !s.tokens.is_empty() => {
                    Some(self.snapshot_states(states)?)
                }
                _ => None,
            }
        };
        let rows_in = highway.to_vec();
        let start = self.seq(id)?.tokens.len();
        let mut done = 0;
        while done < draft.len() {
            let n = (draft.len() - done).min(self.max_rows);
            let rows = &mut highway[done * self.width..(done + n) * self.width];
            self.run_one(id, &draft[done..done + n], rows, "verify")?;
            done += n;
        }
        let s = self.seqs.get_mut(&id).expect("present");
        // `tokens` holds the committed tokens only; the draft lives in the
        // pending record until the commit.
        s.tokens.truncate(start);
        s.pending = Some(Pending {
            before,
            draft: draft.to_vec(),
            rows_in,
        });
        self.stats.verifies += 1;
        Ok(())
    }

    /// Keep the first `accepted` tokens of the pending draft of `id`: the
    /// carry becomes exactly that of `tokens ++ draft[..accepted]`.
    pub fn commit(&mut self, id: SeqId, accepted: usize) -> Result<()> {
        self.check_usable(id, "commit", true)?;
        let drafted = match &self.seq(id)?.pending {
            Some(p) => p.draft.len(),
            None => bail!(EngineError::NoPendingVerify(id)),
        };
        if accepted > drafted {
            bail!(EngineError::TooManyAccepted {
                seq: id,
                accepted,
                drafted
            });
        }
        self.stats.accepted_tokens += accepted as u64;
        self.stats.rejected_tokens += (drafted - accepted) as u64;
        if accepted == drafted && self.is_resident(id)? {
            let s = self.seqs.get_mut(&id).expect("present");
            let p = s.pending.take().expect("checked");
            s.tokens.extend_from_slice(&p.draft);
            return Ok(());
        }
        let p = {
            let s = self.seqs.get_mut(&id).expect("present");
            s.pending.take().expect("checked")
        };
        if accepted == drafted {
            // Swapped since the verify: the swapped carry already holds all
            // of the draft.
            self.seqs
                .get_mut(&id)
                .expect("present")
                .tokens
                .extend_from_slice(&p.draft);
            return Ok(());
        }
        self.ensure_resident(id, &[id])?;
        let restored = {
            let mut seq = self.seqs.remove(&id).expect("present");
            let Carry::Resident(states) = &mut seq.carry else {
                unreachable!("made resident")
            };
            let r = match &p.before {
                Some(blobs) => self.restore_states(states, blobs),
                None => Ok(()),
            };
            if let Err(e) = &r {
                self.lose(
                    id,
                    &mut seq,
                    format!("commit could not restore the carry: {e:#}"),
                );
            }
            self.seqs.insert(id, seq);
            r
        };
        restored?;
        if accepted > 0 {
            let mut rows = p.rows_in[..accepted * self.width].to_vec();
            let mut done = 0;
            if p.before.is_none() {
                // The sequence had run nothing: the re-run starts it fresh.
                self.seqs.get_mut(&id).expect("present").tokens.clear();
            }
            while done < accepted {
                let n = (accepted - done).min(self.max_rows);
                let r = &mut rows[done * self.width..(done + n) * self.width];
                self.run_one(id, &p.draft[done..done + n], r, "commit")?;
                done += n;
            }
        }
        // With nothing accepted into a sequence that had run nothing, its
        // token list stays empty, so its next forward passes `fresh` and
        // resets every site: the rejected draft leaves no trace.
        Ok(())
    }

    /// Swap sequence `id`'s carry out to `target`, freeing its device
    /// memory. Refused for a sequence that is not resident.
    pub fn swap_out(&mut self, id: SeqId, target: SwapTarget) -> Result<()> {
        let s = self.seq(id)?;
        let state = match &s.carry {
            Carry::Resident(_) => None,
            Carry::Swapped(_) => Some("already swapped out"),
            Carry::Lost(_) => Some("lost"),
        };
        if let Some(state) = state {
            bail!(EngineError::WrongPlace {
                op: "swap_out",
                seq: id,
                state
            });
        }
        if target == SwapTarget::File && self.cfg.swap_dir.is_none() {
            bail!(EngineError::NoSwapDir);
        }
        let place = if s.tokens.is_empty() && s.pending.is_none() {
            Swapped::Empty
        } else {
            let Carry::Resident(states) = &s.carry else {
                unreachable!()
            };
            let blobs = self.snapshot_states(states)?;
            // A pending verify's draft is in the carry too.
            let absorbed = s.tokens.len() + s.pending.as_ref().map_or(0, |p| p.draft.len());
            let bytes = Snapshot {
                fingerprint: self.fingerprint,
                token_count: absorbed as u64,
                blobs,
            }
            .encode();
            match target {
                SwapTarget::Host => Swapped::Host(bytes),
                SwapTarget::File => {
                    let dir = self.cfg.swap_dir.as_ref().expect("checked");
                    let path = dir.join(format!(
                        "metrale-{}-{}-seq-{id}.mplesnap",
                        std::process::id(),
                        self.instance
                    ));
                    std::fs::write(&path, &bytes)
                        .with_context(|| format!("swap_out: writing {}", path.display()))?;
                    Swapped::File(path)
                }
            }
        };
        let mut seq = self.seqs.remove(&id).expect("present");
        let Carry::Resident(mut states) = std::mem::replace(&mut seq.carry, Carry::Swapped(place))
        else {
            unreachable!()
        };
        self.seqs.insert(id, seq);
        self.budget.release(id);
        self.stats.swap_outs += 1;
        // The snapshot is safe in `place`; a failed free leaks device memory
        // but not the sequence.
        self.free_states(&mut states)
            .with_context(|| format!("swap_out: freeing sequence {id}'s carry"))
    }

    /// Swap sequence `id`'s carry back onto the device, preempting others if
    /// the budget needs it. Refused for a resident sequence; on failure the
    /// sequence stays swapped out.
    pub fn swap_in(&mut self, id: SeqId) -> Result<()> {
        self.swap_in_protected(id, &[id])
    }

    fn swap_in_protected(&mut self, id: SeqId, protect: &[SeqId]) -> Result<()> {
        let s = self.seq(id)?;
        let state = match &s.carry {
            Carry::Resident(_) => Some("resident"),
            Carry::Swapped(_) => None,
            Carry::Lost(_) => Some("lost"),
        };
        if let Some(state) = state {
            bail!(EngineError::WrongPlace {
                op: "swap_in",
                seq: id,
                state
            });
        }
        let Carry::Swapped(place) = &s.carry else {
            unreachable!()
        };
        let blobs = match place {
            Swapped::Empty => None,
            Swapped::Host(bytes) => Some(Snapshot::decode_for(bytes, &self.geoms)?.blobs),
            Swapped::File(path) => {
                let bytes = std::fs::read(path)
                    .with_context(|| format!("swap_in: reading {}", path.display()))?;
                let snap = Snapshot::decode_for(&bytes, &self.geoms)
                    .with_context(|| format!("swap_in: {}", path.display()))?;
                Some(snap.blobs)
            }
        };
        let mut protect = protect.to_vec();
        protect.push(id);
        let states = match &blobs {
            Some(b) => self.states_from(id, b, &protect)?,
            None => self.alloc_states(id, &protect)?,
        };
        let seq = self.seqs.get_mut(&id).expect("present");
        let old = std::mem::replace(&mut seq.carry, Carry::Resident(states));
        if let Carry::Swapped(Swapped::File(path)) = old {
            let _ = std::fs::remove_file(path);
        }
        self.stats.swap_ins += 1;
        Ok(())
    }

    /// Release sequence `id`: free its carry, drop any swap record.
    pub fn release(&mut self, id: SeqId) -> Result<()> {
        let mut seq = self
            .seqs
            .remove(&id)
            .ok_or(EngineError::UnknownSequence(id))?;
        self.budget.release(id);
        match &mut seq.carry {
            Carry::Resident(states) => self.free_states(states),
            Carry::Swapped(Swapped::File(path)) => std::fs::remove_file(&*path)
                .with_context(|| format!("release: removing {}", path.display())),
            _ => Ok(()),
        }
    }

    /// Drop every prefix-cache entry.
    pub fn clear_prefix_cache(&mut self) {
        self.cache.clear();
    }

    fn teardown(&mut self) -> Result<()> {
        if self.closed {
            return Ok(());
        }
        self.closed = true;
        let mut first: Result<()> = Ok(());
        let ids: Vec<SeqId> = self.seqs.keys().copied().collect();
        for id in ids {
            let r = self.release(id);
            if first.is_ok() {
                first = r;
            }
        }
        if let Some(graphs) = self.graphs.take() {
            for (_, g) in graphs {
                let r = self.gpu.destroy_graph(g);
                if first.is_ok() {
                    first = r.map_err(Into::into);
                }
            }
        }
        let r = self.gpu.free(self.highway);
        self.highway = DevicePtr::NULL;
        if first.is_ok() {
            first = r;
        }
        let gpu = self.gpu.clone();
        for s in &mut self.sites {
            let r = s.free(gpu.as_ref());
            if first.is_ok() {
                first = r;
            }
        }
        first
    }

    /// Release every sequence, free the staging rows and the sites. Dropping
    /// the engine does the same but cannot report errors.
    pub fn close(mut self) -> Result<()> {
        self.teardown()
    }
}

impl<S: Site> Drop for Engine<S> {
    fn drop(&mut self) {
        let _ = self.teardown();
    }
}
