//! The engine: sequences over one or more PLE sites, as a server drives them.
//!
//! A sequence is added (restoring the longest cached prefix), prefilled in
//! chunks, decoded in batches of one token each, verified speculatively and
//! committed, swapped out to host memory or a file and back, and released.
//! The caller passes the highway rows (`[T, hc * hidden]` f32) of every token
//! it runs and gets them back with every site applied in order: as a host
//! slice, copied through the engine's own device rows, or as rows already
//! on the device, run in place ([`Highway`]).
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
//!   prefill and decode, keyed by the tokens; it is only valid when the
//!   highway rows of a token are a function of the token prefix, as in a
//!   causal model;
//! - token masks (DeepSeek-V4.1's `token_mask`, through the `_masked`
//!   calls) change a carry without changing its tokens, so a sequence that
//!   has absorbed a masked token never caches a block boundary (in the
//!   prefix cache or the shared store), and a masked sequence is added from
//!   a cached prefix only up to its first masked token; a masked decode step
//!   runs eagerly, never from a captured graph (the layer resets the gate
//!   and the history of a masked token by host work a replay would not
//!   redo); a mask given to an engine with a site whose published layer has
//!   none is refused ([`EngineError::TokenMaskUnsupported`]) before
//!   anything runs.
//!
//! A step is a value: [`Engine::plan`] hashes a step once at every site
//! into [`StepPlans`], keyed by sequence and position; its reads start with
//! [`Engine::prefetch_plan`] and the planned prefill and decode run it, so
//! nothing is hashed twice and no site keeps ids between calls. A call
//! without a plan plans for itself against each site's carry.
//!
//! The methods are split by concern: this module holds the site traits
//! ([`CarrySite`]: what a carry needs; [`Site`]: what a step needs), the
//! step plan, the settings, the engine's state, its accessors and `close`;
//! `sequences` carries, the budget, add, prefill and release; `snapshots`
//! snapshots and the prefix cache; `swap` swap out and in; `speculate`
//! verify and commit; `decode` batched decode and decode graphs; `error`
//! [`EngineError`].
//!
//! Concurrency: the engine is driven through `&mut self` from one thread; it
//! uses one stream of the backend and synchronises on it before returning
//! outputs.
//!
//! Why one long file: it holds the [`Engine`] value, its configuration and
//! statistics and the calls every submodule above builds on (the step
//! plans, the forward of a token batch over every site); the operations
//! themselves live in the submodules.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;

use metrale_gpu_runtime::gpu::{DevicePtr, GpuBackend, GraphHandle, StreamId};
use metrale_storage::table::TableStats;

use crate::budget::{BudgetStats, MemoryBudget};
use crate::prefix_cache::{PrefixCache, PrefixCacheStats};
use crate::snapshot::{GeometryFingerprint, Snapshot};
use crate::store::{CarryStoreStats, CarryTier};
use metrale_model_layers::layers::ple::{PlanPart, SeqWork, SiteSpec};

mod decode;
mod error;
mod rows;
mod sequences;
mod snapshots;
mod speculate;
mod swap;

pub(crate) use error::chain as error_chain;
pub use error::{BoxError, EngineError, Place, Result};
pub use rows::Highway;

/// What a [`Site`] returns: any error type of the site's layer, table or
/// backend, boxed; the engine carries it, with its causes, as the source of
/// [`EngineError::Site`], where callers can downcast it.
pub type SiteResult<T> = std::result::Result<T, BoxError>;

/// A sequence id, unique for the engine's lifetime.
pub type SeqId = u64;

/// What the default graph methods of [`Site`] say.
const NO_GRAPHS: &str = "this site cannot replay decode graphs";

/// What a sequence's carry needs of a site: the site's geometry, its
/// per-sequence states, and their bytes through the one aux blob codec
/// (`carry_blob`). Swap, snapshots, the prefix cache and speculative
/// rollback use this half only.
pub trait CarrySite: Send + Sync {
    /// The per-sequence carry.
    type State: Send;

    /// The site's geometry and hash constants.
    fn geometry(&self) -> SiteSpec;
    /// Device bytes one carry holds.
    fn carry_bytes(&self) -> usize {
        self.geometry().conv_bytes()
    }
    /// Allocate a carry.
    fn new_state(&self, gpu: &dyn GpuBackend) -> SiteResult<Self::State>;
    /// The history the carry's next tokens are hashed against: the last
    /// `context_len` tokens it absorbed (masked ones blocked as the site
    /// leaves them), or empty when its next forward resets it.
    fn history<'s>(&self, st: &'s Self::State) -> &'s [u32];
    /// The carry's aux blob (the seed's format).
    fn snapshot(
        &self,
        st: &Self::State,
        gpu: &dyn GpuBackend,
        stream: StreamId,
    ) -> SiteResult<Vec<u8>>;
    /// Overwrite the carry from an aux blob.
    fn restore(
        &self,
        st: &mut Self::State,
        blob: &[u8],
        gpu: &dyn GpuBackend,
        stream: StreamId,
    ) -> SiteResult<()>;
    /// Free the carry's device memory. Idempotent.
    fn release(&self, st: &mut Self::State, gpu: &dyn GpuBackend) -> SiteResult<()>;
    /// Free the site's own device memory (weights, staging).
    fn free(&mut self, gpu: &dyn GpuBackend) -> SiteResult<()>;
}

/// What a step needs of a site: hash the step once into a plan, start its
/// reads, and run it (eagerly, or prestaged for a captured graph). Every
/// forward runs a plan: one the caller made ahead ([`Engine::plan`]) or one
/// the engine makes for the call. [`crate::ple_site::PleSite`] implements
/// it for the PLE layer.
pub trait Site: CarrySite {
    /// A step hashed once ([`metrale_model_layers::layers::ple::StepPlan`]
    /// for the PLE layer).
    type Plan: Send + Sync;

    /// The most tokens one forward (or sequences one batched forward) takes.
    fn max_tokens(&self) -> usize;
    /// Hash a step: entry `i` of the plan is `work[i]`. Refuses a mask the
    /// site cannot apply.
    fn plan(&self, work: &[SeqWork<'_>]) -> SiteResult<Self::Plan>;
    /// Start reading what `plan` will need. Advice: the default does
    /// nothing.
    fn prefetch(&self, plan: &Self::Plan) -> SiteResult<()> {
        let _ = plan;
        Ok(())
    }
    /// Run `part` of `plan` on one sequence over the `[part.len, C]` rows
    /// at `highway`. `fresh` starts the sequence over.
    #[allow(clippy::too_many_arguments)]
    fn run(
        &self,
        plan: &Self::Plan,
        part: PlanPart,
        st: &mut Self::State,
        highway: DevicePtr,
        fresh: bool,
        gpu: &dyn GpuBackend,
        stream: StreamId,
    ) -> SiteResult<()>;
    /// Run one token of each of `states.len()` sequences: `states[b]` runs
    /// entry `seqs[b]` of `plan` on row `b` of the `[B, C]` rows at
    /// `highway`.
    fn run_batch(
        &self,
        plan: &Self::Plan,
        seqs: &[usize],
        states: &mut [&mut Self::State],
        highway: DevicePtr,
        gpu: &dyn GpuBackend,
        stream: StreamId,
    ) -> SiteResult<()>;
    /// Whether the site's batched decode can be captured in a graph and
    /// replayed: [`Self::prestage`], [`Self::forward_prestaged`],
    /// [`Self::note_replayed`] and [`Self::rearm`]. The defaults refuse.
    fn supports_graphs(&self) -> bool {
        false
    }
    /// The most sequences one [`Self::prestage`] can stage: a prestaged
    /// step keeps its rows pinned in the site's row table until the replay
    /// has read them, so a row cache bounds it. `None` (the default): no
    /// bound besides [`Self::max_tokens`]; `Some(0)`: the table cannot keep
    /// even one sequence's rows pinned at once.
    fn max_prestage_batch(&self) -> Option<usize> {
        None
    }
    /// The host half of a replayable decode step: stage entry `seqs[i]` of
    /// `plan` for `states[i]` at fixed slot `i`, padding the slots up to
    /// `rows`.
    fn prestage(
        &self,
        plan: &Self::Plan,
        seqs: &[usize],
        states: &mut [&mut Self::State],
        rows: usize,
        gpu: &dyn GpuBackend,
        stream: StreamId,
    ) -> SiteResult<()> {
        let _ = (plan, seqs, states, rows, gpu, stream);
        Err(NO_GRAPHS.into())
    }
    /// The device half: the `[rows, C]` rows at `highway` through what
    /// `prestage` staged, reading fixed addresses only, so it can be
    /// captured (or run eagerly).
    fn forward_prestaged(
        &self,
        states: &mut [&mut Self::State],
        highway: DevicePtr,
        rows: usize,
        gpu: &dyn GpuBackend,
        stream: StreamId,
    ) -> SiteResult<()> {
        let _ = (states, highway, rows, gpu, stream);
        Err(NO_GRAPHS.into())
    }
    /// Right after each `launch_graph` of a captured step.
    fn note_replayed(
        &self,
        states: &mut [&mut Self::State],
        gpu: &dyn GpuBackend,
        stream: StreamId,
    ) -> SiteResult<()> {
        let _ = (states, gpu, stream);
        Err(NO_GRAPHS.into())
    }
    /// After a failed capture: give back the prestage it took.
    fn rearm(&self, st: &mut Self::State) {
        let _ = st;
    }
    /// The counters of the site's row table since it was opened. The
    /// default, for sites without a table, reports zeros.
    fn table_stats(&self) -> TableStats {
        TableStats::default()
    }
}

/// Run `tokens` (with `masked`) through one carry of `site`, planned here
/// against the carry (a fresh one's history when `fresh`): what a forward
/// without a step plan does, in the engine and in a plain sequential run.
#[allow(clippy::too_many_arguments)]
pub fn forward_tokens<S: Site + ?Sized>(
    site: &S,
    st: &mut S::State,
    tokens: &[u32],
    masked: Option<&[bool]>,
    highway: DevicePtr,
    fresh: bool,
    gpu: &dyn GpuBackend,
    stream: StreamId,
) -> SiteResult<()> {
    let history = if fresh { &[][..] } else { site.history(st) };
    let mut work = SeqWork::new(history, tokens);
    work.masked = masked;
    let plan = site.plan(&[work])?;
    let whole = PlanPart {
        seq: 0,
        from: 0,
        len: tokens.len(),
    };
    site.run(&plan, whole, st, highway, fresh, gpu, stream)
}

/// One sequence of a [`StepPlans`]: its entry in every site's plan, the
/// tokens it had absorbed when planned, and the tokens planned.
#[derive(Clone, Debug)]
struct Planned {
    entry: usize,
    start: usize,
    tokens: Vec<u32>,
}

/// A step planned ahead by [`Engine::plan`]: every site's plan of the same
/// work, keyed by sequence and by the position (tokens absorbed) it was
/// made at. [`Engine::prefetch_plan`] starts its reads; the planned
/// prefill and decode calls run it, so nothing of it is hashed twice.
pub struct StepPlans<P> {
    seqs: HashMap<SeqId, Planned>,
    sites: Vec<P>,
}

impl<P> StepPlans<P> {
    /// Each site's plan, in site order.
    pub fn sites(&self) -> &[P] {
        &self.sites
    }

    /// Whether the plan holds sequence `id`.
    pub fn holds(&self, id: SeqId) -> bool {
        self.seqs.contains_key(&id)
    }

    /// The part of the plan for `tokens` of sequence `id` run after
    /// `absorbed` tokens: `None` when the plan does not hold the sequence,
    /// refused when it holds it for other tokens or another position.
    fn part(&self, id: SeqId, absorbed: usize, tokens: &[u32]) -> Result<Option<PlanPart>> {
        let Some(p) = self.seqs.get(&id) else {
            return Ok(None);
        };
        let fits = absorbed >= p.start
            && absorbed - p.start + tokens.len() <= p.tokens.len()
            && p.tokens[absorbed - p.start..absorbed - p.start + tokens.len()] == *tokens;
        if !fits {
            return Err(EngineError::PlanMismatch {
                seq: id,
                planned_at: p.start,
                planned: p.tokens.len(),
                absorbed,
                tokens: tokens.len(),
            });
        }
        Ok(Some(PlanPart {
            seq: p.entry,
            from: absorbed - p.start,
            len: tokens.len(),
        }))
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
    /// Block boundaries not cached because the sequence had absorbed a
    /// masked token (the cache keys carries by tokens alone).
    pub masked_boundaries_skipped: u64,
    /// Decode steps (parts of a batch) run eagerly, with graphs enabled,
    /// because a sequence's token was masked.
    pub masked_eager_steps: u64,
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
    /// The shared carry store, when one is attached
    /// ([`Engine::attach_carry_store`]).
    pub carry_store: CarryStoreStats,
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
    /// Each site's aux blob.
    Host(Vec<Vec<u8>>),
    /// An encoded snapshot.
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
    /// Whether the carry has absorbed a masked token: then it is not the
    /// carry of `tokens` alone, and its block boundaries are never cached.
    masked: bool,
    carry: Carry<St>,
    pending: Option<Pending>,
}

/// The engine. See the module docs.
pub struct Engine<S: Site> {
    gpu: Arc<dyn GpuBackend>,
    stream: StreamId,
    sites: Vec<S>,
    geoms: Vec<SiteSpec>,
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
    /// The shared carry store behind the prefix cache, if attached.
    shared: Option<CarryTier>,
    budget: MemoryBudget,
    stats: EngineStats,
    /// Captured decode graphs by padded batch size; `None` while decode
    /// runs eagerly.
    graphs: Option<HashMap<usize, GraphHandle>>,
    closed: bool,
    /// Distinguishes the swap files of engines sharing a directory.
    instance: u64,
}

/// Whether a site of geometry `g` takes a token mask: its published layer
/// has one (DeepSeek-V4.1's Engram gate without a short conv).
pub fn takes_token_mask(g: &SiteSpec) -> bool {
    g.combine.gated().is_some_and(|c| c.token_mask)
}

/// The family of a site of geometry `g`, as a refused token mask names it:
/// the published layer the site follows ([`SiteSpec::published_layer`]).
pub fn mask_family(g: &SiteSpec) -> &'static str {
    g.published_layer()
}

static ENGINE_INSTANCES: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);

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
        let geoms: Vec<SiteSpec> = sites.iter().map(CarrySite::geometry).collect();
        let max_rows = cfg.prefill_chunk.max(batch_cap);
        let highway = match gpu.alloc(max_rows * width * 4, "engine highway rows") {
            Ok(p) => p,
            Err(e) => {
                for s in &mut sites {
                    let _ = s.free(gpu.as_ref());
                }
                return Err(EngineError::device(
                    "engine: allocating the highway staging rows",
                    e,
                ));
            }
        };
        Ok(Engine {
            stream: gpu.default_stream(),
            fingerprint: GeometryFingerprint::of(&geoms),
            carry_bytes: sites.iter().map(CarrySite::carry_bytes).sum(),
            geoms,
            width,
            max_rows,
            batch_cap,
            highway,
            seqs: HashMap::new(),
            next_id: 1,
            cache: PrefixCache::new(cfg.block_size, cfg.prefix_cache_bytes),
            shared: None,
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
            return Err(EngineError::Config(
                "at least one PLE site is needed".into(),
            ));
        };
        let g0 = first.geometry();
        let width = g0.hc_mult * g0.hidden;
        if width == 0 {
            return Err(EngineError::Config(
                "site 0 has a highway width of 0".into(),
            ));
        }
        let mut cap = usize::MAX;
        for (i, s) in sites.iter().enumerate() {
            let g = s.geometry();
            if g.hc_mult * g.hidden != width {
                return Err(EngineError::Config(format!(
                    "site {i} has highway width {} (hc {} x hidden {}), site 0 has {width}",
                    g.hc_mult * g.hidden,
                    g.hc_mult,
                    g.hidden
                )));
            }
            cap = cap.min(s.max_tokens());
        }
        if cap == 0 {
            return Err(EngineError::Config(
                "a site takes 0 tokens per forward".into(),
            ));
        }
        if cfg.prefill_chunk == 0 || cfg.prefill_chunk > cap {
            return Err(EngineError::Config(format!(
                "prefill_chunk {} must be in 1..={cap} (the sites' max_tokens)",
                cfg.prefill_chunk
            )));
        }
        if cfg.block_size == 0 {
            return Err(EngineError::Config("block_size must be at least 1".into()));
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
    pub fn geometries(&self) -> &[SiteSpec] {
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

    /// The tokens sequence `id` has absorbed.
    pub fn tokens(&self, id: SeqId) -> Result<&[u32]> {
        Ok(&self.seq(id)?.tokens)
    }

    /// Start the table reads that running `tokens` through sequence `id`
    /// next (a prefill chunk, or one decode token) will need, so they
    /// overlap other work. Advice only: outputs never change, nothing is
    /// pinned, and the sequence may be swapped out meanwhile.
    pub fn prefetch(&self, id: SeqId, tokens: &[u32]) -> Result<()> {
        self.prefetch_plan(&self.plan(&[(id, tokens)])?)
    }

    /// Hash a step once at every site: entry `i` runs `work[i].1` through
    /// sequence `work[i].0` next (a prefill chunk, or one decode token),
    /// against the tokens the sequence has absorbed. Hand the plan to
    /// [`Self::prefetch_plan`] to start its reads and to
    /// [`Self::prefill_planned`] and [`Self::decode_planned`] to run it. A
    /// sequence that has absorbed a masked token is left out (its carry's
    /// history is not its tokens'); the calls that run it plan it then.
    pub fn plan(&self, work: &[(SeqId, &[u32])]) -> Result<StepPlans<S::Plan>> {
        let mut seqs = HashMap::with_capacity(work.len());
        let mut entries = Vec::with_capacity(work.len());
        for &(id, tokens) in work {
            let seq = self.seq(id)?;
            self.check_tokens("plan", tokens.iter().copied())?;
            if seq.masked {
                continue;
            }
            let planned = Planned {
                entry: entries.len(),
                start: seq.tokens.len(),
                tokens: tokens.to_vec(),
            };
            if seqs.insert(id, planned).is_some() {
                return Err(EngineError::DuplicateInBatch(id));
            }
            entries.push(SeqWork::new(&seq.tokens, tokens));
        }
        let mut sites = Vec::with_capacity(self.sites.len());
        for (i, site) in self.sites.iter().enumerate() {
            sites.push(
                site.plan(&entries)
                    .map_err(|e| EngineError::site(i, format!("site {i} plan"), e))?,
            );
        }
        Ok(StepPlans { seqs, sites })
    }

    /// Start the table reads of `plan` at every site. Advice only.
    pub fn prefetch_plan(&self, plan: &StepPlans<S::Plan>) -> Result<()> {
        for (i, (site, p)) in self.sites.iter().zip(&plan.sites).enumerate() {
            site.prefetch(p)
                .map_err(|e| EngineError::site(i, format!("site {i} prefetch"), e))?;
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

    /// The row-table counters of every site, summed.
    pub fn table_stats(&self) -> TableStats {
        self.sites
            .iter()
            .map(Site::table_stats)
            .fold(TableStats::default(), |a, b| a + b)
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
                    s.swap_host_bytes += b.iter().map(Vec::len).sum::<usize>();
                }
                Carry::Swapped(Swapped::File(_)) => s.swapped_file += 1,
                Carry::Swapped(Swapped::Empty) => s.swapped_host += 1,
                Carry::Lost(_) => {}
            }
        }
        s.budget = self.budget.stats();
        s.prefix_cache = self.cache.stats();
        if let Some(t) = &self.shared {
            s.carry_store = t.stats();
        }
        s
    }

    fn seq(&self, id: SeqId) -> Result<&Seq<S::State>> {
        self.seqs.get(&id).ok_or(EngineError::UnknownSequence(id))
    }

    fn check_usable(&self, id: SeqId, op: &'static str, pending_ok: bool) -> Result<()> {
        let s = self.seq(id)?;
        if let Carry::Lost(cause) = &s.carry {
            return Err(EngineError::Lost {
                seq: id,
                cause: cause.clone(),
            });
        }
        if !pending_ok && s.pending.is_some() {
            return Err(EngineError::PendingVerify { op, seq: id });
        }
        Ok(())
    }

    /// Refuse a call whose tokens some site's hash family cannot take,
    /// before anything of the call runs (a chunked prefill would otherwise
    /// leave the chunks before the bad token applied).
    fn check_tokens(&self, op: &'static str, tokens: impl IntoIterator<Item = u32>) -> Result<()> {
        let Some((limit, family)) = self
            .geoms
            .iter()
            .filter_map(|g| Some((g.dims.family.token_limit()?, g.dims.family.name())))
            .min_by_key(|&(l, _)| l)
        else {
            return Ok(());
        };
        match tokens
            .into_iter()
            .enumerate()
            .find(|&(_, t)| u64::from(t) >= limit)
        {
            Some((position, token)) => Err(EngineError::TokenOutOfRange {
                op,
                position,
                token,
                limit,
                family,
            }),
            None => Ok(()),
        }
    }

    /// Refuse a token mask, before anything of the call runs, when some
    /// site's published layer has none (even when no flag is set, as the
    /// layer does), or when it does not hold one flag per token.
    fn check_mask(&self, op: &'static str, masked: &[bool], tokens: usize) -> Result<()> {
        if let Some((site, g)) = self
            .geoms
            .iter()
            .enumerate()
            .find(|(_, g)| !takes_token_mask(g))
        {
            return Err(EngineError::TokenMaskUnsupported {
                op,
                site,
                family: mask_family(g),
            });
        }
        if masked.len() != tokens {
            return Err(EngineError::MaskSize {
                op,
                flags: masked.len(),
                tokens,
            });
        }
        Ok(())
    }

    fn teardown(&mut self) -> Result<()> {
        if self.closed {
            return Ok(());
        }
        self.closed = true;
        // Queued store writes are worth finishing: another process may be
        // waiting for them. A store that does not finish in time is left.
        if let Some(t) = &self.shared {
            t.flush(t.config().flush_timeout);
        }
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
                let r = self
                    .gpu
                    .destroy_graph(g)
                    .map_err(|e| EngineError::device("close: destroying a decode graph", e));
                if first.is_ok() {
                    first = r;
                }
            }
        }
        let r = self
            .gpu
            .dealloc(self.highway)
            .map_err(|e| EngineError::device("close: freeing the highway staging rows", e));
        self.highway = DevicePtr::NULL;
        if first.is_ok() {
            first = r;
        }
        let gpu = self.gpu.clone();
        for (i, s) in self.sites.iter_mut().enumerate() {
            let r = s
                .free(gpu.as_ref())
                .map_err(|e| EngineError::site(i, format!("close: freeing site {i}"), e));
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
