//! The layer's batched decode over row caches with fewer slots than one
//! step's distinct row ids (docs/SPEC.md §9: a batch the cache cannot pin
//! at once is split by the caller, never refused outright or stalled).
//!
//! What must hold, against the same steps over a resident table:
//! - the eager `forward_batch` runs a whole batch over any cache, down to
//!   fewer slots than one token's rows, with bit-identical highways and
//!   carries;
//! - graph steps of at most `max_prestage_batch` sequences (prestage,
//!   capture or replay, `note_replayed`) give the same bits;
//! - a prestage that needs more rows pinned than the cache holds is refused
//!   at once with `LayerError::PrestageTooLarge`, changing nothing;
//! - the caches end consistent, with nothing pinned, and nothing leaks.

mod layer_common;

use std::path::Path;
use std::sync::Arc;

use layer_common::{Rng, Small, assert_no_leaks, bits, download, highway, tokens, upload, write};
use metrale_gpu_runtime::cpu::CpuBackend;
use metrale_gpu_runtime::gpu::{DevicePtr, GpuBackend, GraphHandle};
use metrale_model_layers::layers::ple::{ForwardContext, LayerError, PleLayer, PleSeqState};
use metrale_storage::cached::{CacheConfig, CachedTable};
use metrale_storage::layout::TableFiles;
use metrale_storage::resident::ResidentTable;
use metrale_storage::table::RowTable;
use metrale_testkit::shards::write_bf16_shards;

/// Sequences decoded together.
const SEQS: usize = 6;
/// Decode steps.
const STEPS: usize = 5;

/// How each decode step runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Mode {
    /// One eager `forward_batch` over the whole batch.
    Eager,
    /// Graph steps of `max_prestage_batch` sequences each.
    Graph,
}

/// The small table as one BF16 safetensors shard under `dir`.
fn table_files(dir: &Path, small: &Small) -> TableFiles {
    write_bf16_shards(dir, "table", 1, &small.table_bits, small.head_dim, 1).unwrap()
}

/// One graph step over `states` (at most the layer's prestage bound, which
/// is also the rows the graph is captured for): prestage, capture the step
/// the first time, replay, note the replay.
fn graph_step(
    layer: &PleLayer,
    states: &mut [&mut PleSeqState],
    toks: &[u32],
    hw: DevicePtr,
    graph: &mut Option<GraphHandle>,
    gpu: &dyn GpuBackend,
    s: u64,
) {
    let rows = layer.max_prestage_batch();
    layer.prestage_batch(states, toks, rows, gpu, s).unwrap();
    let g = match *graph {
        Some(g) => g,
        None => {
            gpu.begin_capture(s).unwrap();
            layer
                .forward_batch(states, hw, rows, &ForwardContext::new(gpu), s)
                .unwrap();
            let g = gpu.end_capture(s).unwrap();
            *graph = Some(g);
            g
        }
    };
    gpu.launch_graph(g, s).unwrap();
    layer.note_replayed(states, gpu, s).unwrap();
}

/// Prefill `SEQS` sequences, then decode them together for `STEPS` steps;
/// every highway row and every final carry blob.
fn scenario(
    small: &Small,
    table: Arc<dyn RowTable>,
    mode: Mode,
    gpu: &dyn GpuBackend,
) -> (Vec<u32>, Vec<Vec<u8>>) {
    let mut layer = small.layer(gpu, table.clone(), 8).unwrap();
    let c = small.channels();
    let s = gpu.create_stream().unwrap();
    let mut r = Rng(0x5EED);
    let mut out = Vec::new();
    let mut states: Vec<PleSeqState> = (0..SEQS)
        .map(|_| layer.new_seq_state(gpu).unwrap())
        .collect();
    for st in states.iter_mut() {
        let n = 2 + r.below(7);
        let toks = tokens(&mut r, n, 40);
        let hw = upload(gpu, &highway(&mut r, n, c), "hw");
        let ctx = ForwardContext::new(gpu).with_host_ids(&toks);
        layer.forward(st, hw, n, true, &ctx, s).unwrap();
        out.extend(bits(&download(gpu, hw, n * c, s)));
        gpu.free(hw).unwrap();
    }
    let per = layer.max_prestage_batch();
    // A graph step runs over `per` rows, padding included.
    let hwbuf = gpu.alloc(SEQS.max(per) * c * 4, "batch hw").unwrap();
    let mut graph = None;
    for _ in 0..STEPS {
        let toks = tokens(&mut r, SEQS, 40);
        let rows_in = highway(&mut r, SEQS, c);
        let mut refs: Vec<&mut PleSeqState> = states.iter_mut().collect();
        match mode {
            Mode::Eager => {
                write(gpu, &rows_in, hwbuf, s);
                let ctx = ForwardContext::new(gpu).with_host_ids(&toks);
                layer
                    .forward_batch(&mut refs, hwbuf, SEQS, &ctx, s)
                    .unwrap();
                out.extend(bits(&download(gpu, hwbuf, SEQS * c, s)));
            }
            Mode::Graph => {
                assert!(per > 0, "graph steps need room for one sequence");
                for (k, part) in refs.chunks_mut(per).enumerate() {
                    let lo = k * per;
                    let n = part.len();
                    write(gpu, &rows_in[lo * c..(lo + n) * c], hwbuf, s);
                    let t = &toks[lo..lo + n];
                    graph_step(&layer, part, t, hwbuf, &mut graph, gpu, s);
                    out.extend(bits(&download(gpu, hwbuf, n * c, s)));
                }
            }
        }
    }
    let blobs = states
        .iter()
        .map(|st| layer.snapshot_aux(st, gpu, s).unwrap())
        .collect();
    if let Some(g) = graph {
        gpu.destroy_graph(g).unwrap();
    }
    gpu.free(hwbuf).unwrap();
    for st in states.iter_mut() {
        layer.release_seq_state(st, gpu).unwrap();
    }
    layer.free(gpu).unwrap();
    gpu.destroy_stream(s).unwrap();
    (out, blobs)
}

#[test]
fn batches_larger_than_the_cache_match_a_resident_table() {
    let gpu: Arc<dyn GpuBackend> = Arc::new(CpuBackend::new_debug());
    let g = gpu.as_ref();
    let start = g.live_alloc_count();
    let small = Small::new(31);
    let heads = small.dims.ngram_heads();
    let dir = tempfile::tempdir().unwrap();
    let files = table_files(dir.path(), &small);
    let resident: Arc<dyn RowTable> = Arc::new(ResidentTable::load(&files, gpu.clone()).unwrap());
    let want = scenario(&small, resident.clone(), Mode::Eager, g);
    assert!(
        scenario(&small, resident.clone(), Mode::Graph, g) == want,
        "graph steps over the resident table differ"
    );
    drop(resident);
    // A step needs up to SEQS * heads = 24 distinct rows.
    let cases = [
        (Mode::Eager, 2),
        (Mode::Eager, heads + 1),
        (Mode::Eager, 2 * heads),
        (Mode::Graph, heads),
        (Mode::Graph, 2 * heads + 1),
        (Mode::Graph, 3 * heads),
    ];
    for (mode, slots) in cases {
        let cfg = CacheConfig::new(slots);
        let cached = Arc::new(CachedTable::open(files.clone(), gpu.clone(), cfg).unwrap());
        let got = scenario(&small, cached.clone(), mode, g);
        assert!(got == want, "{mode:?} over {slots} slots differs");
        let st = cached.stats();
        assert!(
            st.evictions > 0,
            "{mode:?} over {slots} slots evicted nothing: {st:?}"
        );
        cached.check_invariants().unwrap();
    }
    assert_no_leaks(g, start);
}

/// A prestage whose rows outnumber the cache's slots is refused at once,
/// typed, before any carry changes; the same batch then runs eagerly.
#[test]
fn a_prestage_larger_than_the_cache_is_refused_and_changes_nothing() {
    let gpu: Arc<dyn GpuBackend> = Arc::new(CpuBackend::new_debug());
    let g = gpu.as_ref();
    let start = g.live_alloc_count();
    let small = Small::new(32);
    let heads = small.dims.ngram_heads();
    let dir = tempfile::tempdir().unwrap();
    let files = table_files(dir.path(), &small);
    let slots = heads + 1;
    let cached = Arc::new(CachedTable::open(files, gpu.clone(), CacheConfig::new(slots)).unwrap());
    let mut layer = small.layer(g, cached.clone(), 8).unwrap();
    assert_eq!(layer.max_prestage_batch(), 1);
    let c = small.channels();
    let s = g.create_stream().unwrap();
    let mut r = Rng(3);
    let mut states: Vec<PleSeqState> = (0..SEQS).map(|_| layer.new_seq_state(g).unwrap()).collect();
    for st in states.iter_mut() {
        let toks = tokens(&mut r, 4, 40);
        let hw = upload(g, &highway(&mut r, 4, c), "hw");
        let ctx = ForwardContext::new(g).with_host_ids(&toks);
        layer.forward(st, hw, 4, true, &ctx, s).unwrap();
        g.free(hw).unwrap();
    }
    // Six distinct tokens need far more than `slots` distinct rows.
    let toks: Vec<u32> = (0..SEQS as u32).map(|i| 10 + i).collect();
    let before: Vec<Vec<u32>> = states.iter().map(|st| st.history().to_vec()).collect();
    let mut refs: Vec<&mut PleSeqState> = states.iter_mut().collect();
    match layer.prestage_batch(&mut refs, &toks, SEQS, g, s) {
        Err(LayerError::PrestageTooLarge {
            sequences,
            rows,
            limit,
            fit,
        }) => {
            assert_eq!((sequences, limit, fit), (SEQS, slots, 1));
            assert!(rows > slots, "{rows} rows");
        }
        other => panic!("expected PrestageTooLarge, got {other:?}"),
    }
    for (st, h) in refs.iter().zip(&before) {
        assert_eq!(st.history(), &h[..]);
        assert!(!st.is_prestaged());
    }
    let hw = upload(g, &highway(&mut r, SEQS, c), "hw");
    let ctx = ForwardContext::new(g).with_host_ids(&toks);
    layer.forward_batch(&mut refs, hw, SEQS, &ctx, s).unwrap();
    g.synchronize(s).unwrap();
    g.free(hw).unwrap();
    for st in states.iter_mut() {
        layer.release_seq_state(st, g).unwrap();
    }
    layer.free(g).unwrap();
    g.destroy_stream(s).unwrap();
    cached.check_invariants().unwrap();
    drop(layer);
    drop(cached);
    assert_no_leaks(g, start);
}
