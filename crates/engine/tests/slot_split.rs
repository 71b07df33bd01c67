//! Batched decode through row caches with fewer slots than one step's
//! distinct row ids (docs/SPEC.md §9: such a batch is split, never
//! refused or stalled).
//!
//! What must hold, against an engine over resident tables built from the
//! same files:
//! - eager batched decode runs every step, whatever the slot count (down to
//!   fewer slots than one token's rows), with bit-identical outputs;
//! - with decode graphs the engine runs each step as several replays of at
//!   most `max_prestage_batch` sequences, with bit-identical outputs;
//! - graphs over a cache that cannot pin one sequence's rows are refused at
//!   once with a typed error, and eager decode still runs there;
//! - the caches hold no pins once the engine is idle, and nothing leaks.

use std::path::Path;
use std::sync::Arc;

use metrale_engine::ple_site::PleSite;
use metrale_engine::{Engine, EngineConfig, EngineError, SeqId, Site};
use metrale_gpu_runtime::cpu::CpuBackend;
use metrale_gpu_runtime::gpu::GpuBackend;
use metrale_model_layers::layers::ple::PleLayer;
use metrale_storage::cached::{CacheConfig, CachedTable};
use metrale_storage::resident::ResidentTable;
use metrale_storage::table::RowTable;
use metrale_testkit::Rng;
use metrale_testkit::rows::rows_for;
use metrale_testkit::tiny::{TinySpec, tiny_site_files};

const SITES: usize = 2;
const SEQS: usize = 6;
const STEPS: usize = 5;

fn model() -> TinySpec {
    TinySpec {
        max_tokens: 16,
        ..Default::default()
    }
}

/// How the sites' tables are served.
#[derive(Clone, Copy, Debug)]
enum Tables {
    Resident,
    /// A row cache of this many slots per site (max_resolve: half of them).
    Cached(usize),
}

struct Rig {
    engine: Engine<PleSite>,
    caches: Vec<Arc<CachedTable>>,
}

fn rig(gpu: &Arc<dyn GpuBackend>, dir: &Path, tables: Tables) -> Rig {
    let mut sites = Vec::new();
    let mut caches = Vec::new();
    for site in 0..SITES {
        let (spec, files, weights) = tiny_site_files(dir, &model(), site, 0x5107).unwrap();
        let table: Arc<dyn RowTable> = match tables {
            Tables::Resident => Arc::new(ResidentTable::load(&files, gpu.clone()).unwrap()),
            Tables::Cached(slots) => {
                let t = Arc::new(
                    CachedTable::open(files, gpu.clone(), CacheConfig::new(slots)).unwrap(),
                );
                caches.push(t.clone());
                t
            }
        };
        let layer = PleLayer::new(&spec, weights, table, model().max_tokens, gpu.as_ref()).unwrap();
        sites.push(PleSite::new(layer));
    }
    let cfg = EngineConfig {
        prefill_chunk: 8,
        prefix_cache_bytes: 0,
        ..Default::default()
    };
    Rig {
        engine: Engine::new(gpu.clone(), sites, cfg).unwrap(),
        caches,
    }
}

/// Prefill `SEQS` sequences, then decode all of them together for `STEPS`
/// steps; every output row, in order.
fn workload(e: &mut Engine<PleSite>) -> Vec<u32> {
    let w = e.width();
    let mut r = Rng(0x51);
    let mut out = Vec::new();
    let mut seqs: Vec<(SeqId, Vec<u32>)> = Vec::new();
    for _ in 0..SEQS {
        let n = 3 + r.below(10);
        let prompt: Vec<u32> = (0..n).map(|_| r.below(400) as u32).collect();
        let id = e.add_sequence(&prompt).unwrap().id;
        let mut hw = rows_for(&prompt, 0, n, w);
        e.prefill(id, &prompt, &mut hw).unwrap();
        out.extend(hw.iter().map(|v| v.to_bits()));
        seqs.push((id, prompt));
    }
    for _ in 0..STEPS {
        let mut hw = Vec::new();
        let mut batch = Vec::new();
        for (id, toks) in seqs.iter_mut() {
            let t = r.below(400) as u32;
            toks.push(t);
            hw.extend(rows_for(toks, toks.len() - 1, toks.len(), w));
            batch.push((*id, t));
        }
        e.decode(&batch, &mut hw).unwrap();
        out.extend(hw.iter().map(|v| v.to_bits()));
    }
    for (id, _) in seqs {
        e.release(id).unwrap();
    }
    out
}

/// Run the workload over `tables`; the outputs and the caches' total
/// misses. Checks the caches are idle and consistent afterwards.
fn run(gpu: &Arc<dyn GpuBackend>, dir: &Path, tables: Tables, graphs: bool) -> (Vec<u32>, u64) {
    let mut rig = rig(gpu, dir, tables);
    if graphs {
        rig.engine.enable_decode_graphs().unwrap();
    }
    let out = workload(&mut rig.engine);
    if graphs {
        assert!(
            rig.engine.stats().graph_replays > 0,
            "no graph was replayed"
        );
    }
    rig.engine.close().unwrap();
    let mut misses = 0;
    for t in &rig.caches {
        t.check_invariants().unwrap();
        misses += t.stats().misses;
    }
    (out, misses)
}

#[test]
fn eager_and_graph_decode_split_batches_larger_than_the_cache() {
    let gpu: Arc<dyn GpuBackend> = Arc::new(CpuBackend::new());
    let base = gpu.live_alloc_count();
    let dir = tempfile::tempdir().unwrap();
    let heads = 2 * model().heads_per_ngram;
    let want = run(&gpu, dir.path(), Tables::Resident, false).0;
    // One step needs up to SEQS * heads = 24 distinct rows per site.
    for slots in [2, 3, heads, heads + 2, 2 * heads] {
        let (got, misses) = run(&gpu, dir.path(), Tables::Cached(slots), false);
        assert!(got == want, "eager decode over {slots} slots differs");
        assert!(misses > 0, "the cache of {slots} slots read nothing");
    }
    // Graph steps keep their rows pinned until the replay: at most
    // slots / heads sequences per replay.
    for slots in [heads, heads + 2, 2 * heads, 3 * heads] {
        let (got, _) = run(&gpu, dir.path(), Tables::Cached(slots), true);
        assert!(got == want, "graph decode over {slots} slots differs");
    }
    assert_eq!(gpu.live_alloc_count(), base, "{}", gpu.live_report());
}

#[test]
fn graphs_over_a_cache_smaller_than_one_sequence_are_refused() {
    let gpu: Arc<dyn GpuBackend> = Arc::new(CpuBackend::new());
    let base = gpu.live_alloc_count();
    let dir = tempfile::tempdir().unwrap();
    let heads = 2 * model().heads_per_ngram;
    let mut rig = rig(&gpu, dir.path(), Tables::Cached(heads - 1));
    assert_eq!(rig.engine.sites()[0].max_prestage_batch(), Some(0));
    match rig.engine.enable_decode_graphs() {
        Err(EngineError::GraphRowsDoNotFit(0)) => {}
        other => panic!("expected GraphRowsDoNotFit(0), got {other:?}"),
    }
    assert!(!rig.engine.decode_graphs());
    // Eager decode still runs over the same cache.
    workload(&mut rig.engine);
    rig.engine.close().unwrap();
    for t in &rig.caches {
        t.check_invariants().unwrap();
    }
    drop(rig.caches);
    assert_eq!(gpu.live_alloc_count(), base, "{}", gpu.live_report());
}
