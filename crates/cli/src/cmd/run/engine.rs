//! Building an engine over a checkpoint's PLE sites (shared with `soak`
//! and `bench offload`) and one pass of the workload through the engine's
//! server.
//!
//! Invariant: a pass opens its own backend and engine and closes the
//! engine before it returns, so the live allocations it reports are what
//! the engine leaked.

use std::sync::Arc;

use anyhow::{Result, anyhow};
use indicatif::ProgressBar;
use metrale_checkpoint::Checkpoint;
use metrale_checkpoint::runtime::TableMode;
use metrale_engine::backbone::{BackboneConfig, Layered, WaitSplit};
use metrale_engine::ple_site::PleSite;
use metrale_engine::server::{Request, Server, ServerConfig, ServerReport, TimedReader, Workload};
use metrale_engine::{CarrySite, Engine, EngineConfig, Site};
use metrale_gpu_runtime::gpu::GpuBackend;
use metrale_model_layers::layers::ple::Shard;
use metrale_storage::cached::{CacheConfig, DEFAULT_IO_DEPTH, Policy};
use metrale_storage::io::{PageReader, default_reader};
use metrale_storage::remote::RemoteTier;
use metrale_storage::remote::redis::RedisTier;

use super::super::common::open_backend;
use super::super::faults::FlakyReader;
use super::RunArgs;
use super::store;
use super::workload::embed;

/// How to build an engine over a checkpoint's sites (shared with `soak`).
pub(in crate::cmd) struct EngineSetup {
    /// How the table rows are served.
    pub(in crate::cmd) mode: TableMode,
    /// Row slots per site of a cached table.
    pub(in crate::cmd) slots: usize,
    /// Read through this reader (cached tables only).
    pub(in crate::cmd) faults: Option<Arc<FlakyReader>>,
    /// The engine settings; the device budget is set from
    /// `resident_carries` when that is positive.
    pub(in crate::cmd) engine: EngineConfig,
    /// Carries the device budget holds; 0: `engine`'s budget.
    pub(in crate::cmd) resident_carries: usize,
}

/// One pass: the engine and whether decode replays captured graphs.
pub(super) struct PassConfig {
    pub(super) setup: EngineSetup,
    /// Decode through captured graphs.
    pub(super) graphs: bool,
    /// The shared carry store behind the prefix cache.
    pub(super) store: Option<store::StoreSetup>,
    /// Start each step's reads at its start.
    pub(super) prefetch: bool,
    /// The backbone around the sites.
    pub(super) backbone: Option<BackboneConfig>,
    /// The remote tier a cached table reads its misses from.
    pub(super) remote: Option<Arc<RedisTier>>,
}

/// What one pass measured.
pub(super) struct PassResult {
    /// The server's figures and row fingerprints.
    pub(super) report: ServerReport,
    /// The sites' row waits, split by whether the backbone's blocks before
    /// each site were still running.
    pub(super) waits: WaitSplit,
    pub(super) carry_bytes: usize,
    pub(super) leaked: usize,
}

/// An engine over every site of `ck`, each layer taking up to
/// `max_tokens` rows per forward.
pub(in crate::cmd) fn build_engine(
    ck: &Checkpoint,
    gpu: &Arc<dyn GpuBackend>,
    pc: &EngineSetup,
    max_tokens: usize,
) -> Result<Engine<PleSite>> {
    let reader = pc.faults.as_ref().map(|r| r.clone() as Arc<dyn PageReader>);
    let cache = CacheOptions {
        reader,
        ..CacheOptions::default()
    };
    let sites = build_sites(ck, gpu, pc, max_tokens, &cache)?;
    let cfg = engine_config(pc, &sites);
    Ok(Engine::new(gpu.clone(), sites, cfg)?)
}

/// How a cached table is opened besides its slots.
#[derive(Clone, Default)]
pub(in crate::cmd) struct CacheOptions {
    /// Read through this reader instead of the automatic choice.
    pub(in crate::cmd) reader: Option<Arc<dyn PageReader>>,
    /// The eviction policy; `None`: the row cache's default.
    pub(in crate::cmd) policy: Option<Policy>,
    /// Rows of the host-memory tier (0: none).
    pub(in crate::cmd) host_rows: usize,
    /// Read misses from this remote tier instead of the shard files.
    pub(in crate::cmd) remote: Option<Arc<dyn RemoteTier>>,
    /// Read the rows of a failed remote fetch from the shard files.
    pub(in crate::cmd) remote_fallback: bool,
}

/// The PLE site of every site of `ck`, each layer taking up to
/// `max_tokens` rows per forward; a cached table is opened with `cache`.
pub(in crate::cmd) fn build_sites(
    ck: &Checkpoint,
    gpu: &Arc<dyn GpuBackend>,
    pc: &EngineSetup,
    max_tokens: usize,
    cache: &CacheOptions,
) -> Result<Vec<PleSite>> {
    build_rank_sites(ck, gpu, pc, max_tokens, cache, None)
}

/// [`build_sites`], each layer built for tensor-parallel rank `shard` when
/// given (`ck` then a rank's share, `tensor_parallel`).
fn build_rank_sites(
    ck: &Checkpoint,
    gpu: &Arc<dyn GpuBackend>,
    pc: &EngineSetup,
    max_tokens: usize,
    cache: &CacheOptions,
    shard: Option<&Shard>,
) -> Result<Vec<PleSite>> {
    let mut sites = Vec::new();
    for s in 0..ck.sites.len() {
        // The cache settings count only for a cached table.
        let mut cfg = CacheConfig::new(pc.slots);
        cfg.reader = cache.reader.clone();
        if let Some(p) = cache.policy {
            cfg.policy = p;
        }
        cfg.host_rows = cache.host_rows;
        cfg.remote = cache.remote.clone();
        cfg.remote_fallback = cache.remote_fallback;
        let table = ck.serve_table(s, pc.mode, cfg, gpu.clone())?;
        let layer = match shard {
            Some(sh) => ck.build_layer_sharded(s, table, max_tokens, gpu.as_ref(), sh.clone())?,
            None => ck.build_layer(s, table, max_tokens, gpu.as_ref())?,
        };
        sites.push(PleSite::new(layer));
    }
    Ok(sites)
}

/// `pc`'s engine settings, the device budget set from
/// `resident_carries` of `sites`' carries when that is positive.
pub(in crate::cmd) fn engine_config<S: Site>(pc: &EngineSetup, sites: &[S]) -> EngineConfig {
    let mut cfg = pc.engine.clone();
    if pc.resident_carries > 0 {
        let carry: usize = sites.iter().map(CarrySite::carry_bytes).sum();
        cfg.device_budget_bytes = pc.resident_carries * carry;
    }
    cfg
}

/// Run the workload once, through the engine's server; as tensor-parallel
/// rank `shard` of `ck`, a rank's share, when given.
pub(super) fn pass(
    ck: &Checkpoint,
    plans: &[Request],
    a: &RunArgs,
    pc: &PassConfig,
    bar: &ProgressBar,
    shard: Option<&Shard>,
) -> Result<PassResult> {
    let gpu: Arc<dyn GpuBackend> = open_backend(a.device).map_err(|e| anyhow!("{e}"))?;
    let max_tokens = a.prefill_chunk.max(a.decode_batch);
    // Every read of a cached table goes through one timed reader (over the
    // fault injector when there is one), for the total read time.
    let timed = match pc.setup.mode {
        TableMode::Cached => {
            let inner: Arc<dyn PageReader> = match &pc.setup.faults {
                Some(f) => f.clone(),
                None => default_reader(DEFAULT_IO_DEPTH)?,
            };
            Some(Arc::new(TimedReader::new(inner)))
        }
        _ => None,
    };
    let cache = CacheOptions {
        reader: timed.clone().map(|t| t as Arc<dyn PageReader>),
        policy: a.cache_policy,
        host_rows: a.host_rows,
        remote: pc.remote.clone().map(|t| t as Arc<dyn RemoteTier>),
        remote_fallback: a.remote_fallback,
    };
    let sites = build_rank_sites(ck, &gpu, &pc.setup, max_tokens, &cache, shard)?;
    let engine_cfg = engine_config(&pc.setup, &sites);
    let cfg = ServerConfig {
        in_flight: a.in_flight.max(1),
        prefill_chunk: a.prefill_chunk,
        decode_batch: a.decode_batch.max(1),
        prefetch: pc.prefetch,
        prefetch_ahead: !a.no_prefetch_ahead,
        backbone: pc.backbone.clone(),
        decode_graphs: pc.graphs,
        // Failed calls are tolerated (and rerun) only with injected faults
        // or remote servers, whose faults fail calls as disk faults do.
        retries: (pc.setup.faults.is_some() || pc.remote.is_some()).then_some(a.retries),
    };
    let mut server = Server::build(gpu.clone(), sites, engine_cfg, cfg)?;
    if let Some(t) = timed {
        server.time_reads(t);
    }
    if let Some(st) = &pc.store {
        st.attach(server.engine_mut())?;
    }
    let carry_bytes = server.engine().carry_bytes();
    let workload = Workload {
        requests: plans,
        rows: &embed,
    };
    let report = server.run(workload, &mut |_| bar.inc(1))?;
    let waits = server
        .engine()
        .sites()
        .iter()
        .map(Layered::wait_split)
        .fold(WaitSplit::default(), |a, b| WaitSplit {
            covered: a.covered + b.covered,
            exposed: a.exposed + b.exposed,
        });
    let engine = server.into_engine();
    engine.close()?;
    Ok(PassResult {
        report,
        waits,
        carry_bytes,
        leaked: gpu.live_alloc_count(),
    })
}
