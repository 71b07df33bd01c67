//! The layer over the storage crate's tables: the same tokens through a
//! resident table and through a small row cache (rows read from safetensors
//! shards, evicted and re-read between steps, pinned by real leases) give
//! bit-identical highways and carries to the in-memory test table, and so
//! does the pipelined gather (head group by head group, each projected
//! while the next is resolved) a table whose resolve may wait gets.

mod layer_common;

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use layer_common::{
    Rng, Small, TestTable, assert_no_leaks, bits, download, highway, tokens, upload, write,
};
use metrale_gpu_runtime::cpu::CpuBackend;
use metrale_gpu_runtime::gpu::GpuBackend;
use metrale_model_layers::layers::ple::{ForwardContext, PleSeqState, SeqWork};
use metrale_storage::cached::{CacheConfig, CachedTable};
use metrale_storage::layout::TableFiles;
use metrale_storage::resident::ResidentTable;
use metrale_storage::table::RowTable;
use metrale_testkit::hooked::hooked_waiting;
use metrale_testkit::shards::write_bf16_shards;

/// Prefill three sequences, decode them in batches (eager and captured),
/// with single prestages in between; returns every highway and final blob.
fn scenario(
    small: &Small,
    table: Arc<dyn RowTable>,
    gpu: &dyn GpuBackend,
) -> (Vec<u32>, Vec<Vec<u8>>) {
    let mut layer = small.layer(gpu, table, 8).unwrap();
    let c = small.channels();
    let s = gpu.create_stream().unwrap();
    let mut r = Rng(77);
    let mut out = Vec::new();
    let mut states: Vec<PleSeqState> = (0..3).map(|_| layer.new_seq_state(gpu).unwrap()).collect();
    for st in states.iter_mut() {
        let n = 3 + r.below(9);
        let toks = tokens(&mut r, n, 40);
        let hw = upload(gpu, &highway(&mut r, n, c), "hw");
        layer
            .forward(
                st,
                hw,
                n,
                true,
                &ForwardContext::new(gpu).with_host_ids(&toks),
                s,
            )
            .unwrap();
        out.extend(bits(&download(gpu, hw, n * c, s)));
        gpu.free(hw).unwrap();
    }
    let hwbuf = gpu.alloc(3 * c * 4, "batch hw").unwrap();
    let mut graph = None;
    for step in 0..6 {
        let toks = tokens(&mut r, 3, 40);
        write(gpu, &highway(&mut r, 3, c), hwbuf, s);
        let mut refs: Vec<&mut PleSeqState> = states.iter_mut().collect();
        match step {
            0 | 1 => layer
                .forward_batch(
                    &mut refs,
                    hwbuf,
                    3,
                    &ForwardContext::new(gpu).with_host_ids(&toks),
                    s,
                )
                .unwrap(),
            2 => {
                layer.prestage_batch(&mut refs, &toks, 3, gpu, s).unwrap();
                gpu.synchronize(s).unwrap();
                gpu.begin_capture(s).unwrap();
                layer
                    .forward_batch(&mut refs, hwbuf, 3, &ForwardContext::new(gpu), s)
                    .unwrap();
                graph = Some(gpu.end_capture(s).unwrap());
                gpu.launch_graph(graph.unwrap(), s).unwrap();
                layer.note_replayed(&mut refs, gpu, s).unwrap();
            }
            3 | 4 => {
                layer.prestage_batch(&mut refs, &toks, 3, gpu, s).unwrap();
                gpu.launch_graph(graph.unwrap(), s).unwrap();
                layer.note_replayed(&mut refs, gpu, s).unwrap();
            }
            _ => {
                for (i, st) in refs.iter_mut().enumerate() {
                    layer.prestage(st, &toks[i..i + 1], gpu, s).unwrap();
                }
                for (i, st) in refs.iter_mut().enumerate() {
                    layer
                        .forward_row(st, hwbuf, i, &ForwardContext::new(gpu), s)
                        .unwrap();
                }
            }
        }
        out.extend(bits(&download(gpu, hwbuf, 3 * c, s)));
    }
    let blobs = states
        .iter()
        .map(|st| layer.snapshot_aux(st, gpu, s).unwrap())
        .collect();
    gpu.destroy_graph(graph.unwrap()).unwrap();
    gpu.free(hwbuf).unwrap();
    for st in states.iter_mut() {
        layer.release_seq_state(st, gpu).unwrap();
    }
    layer.free(gpu).unwrap();
    gpu.destroy_stream(s).unwrap();
    (out, blobs)
}

/// Write the small table as three equal safetensors shards.
fn shards(dir: &std::path::Path, small: &Small) -> TableFiles {
    write_bf16_shards(dir, "table", 1, &small.table_bits, small.head_dim, 3).unwrap()
}

#[test]
fn storage_tables_give_the_test_tables_results() {
    let gpu: Arc<dyn GpuBackend> = Arc::new(CpuBackend::new_debug());
    let g = gpu.as_ref();
    let start = g.live_alloc_count();
    let small = Small::new(21);
    let test_table = TestTable::new(g, &small.table_bits, small.head_dim, 1000).unwrap();
    let want = scenario(&small, test_table.clone(), g);
    assert_eq!(test_table.pinned(g), 0);
    test_table.free(g);

    let dir = tempfile::tempdir().unwrap();
    let files = shards(dir.path(), &small);
    let resident: Arc<dyn RowTable> =
        Arc::new(ResidentTable::load(&files, Arc::clone(&gpu)).unwrap());
    assert!(
        scenario(&small, Arc::clone(&resident), g) == want,
        "resident table differs"
    );
    drop(resident);

    // 16 slots for 78 rows: rows are evicted and re-read throughout.
    let mut cfg = CacheConfig::new(16);
    cfg.max_resolve = 8;
    let cached = Arc::new(CachedTable::open(files, Arc::clone(&gpu), cfg).unwrap());
    assert!(
        scenario(&small, cached.clone() as Arc<dyn RowTable>, g) == want,
        "cached table differs"
    );
    let st = cached.stats();
    assert!(
        st.evictions > 0 && st.misses > 16,
        "the cache was not exercised: {st:?}"
    );
    cached.check_invariants().unwrap();
    drop(cached);
    assert_no_leaks(g, start);
}

/// `prefetch` reads exactly the rows the next forward gathers: after it
/// (and the background reads) the forward misses nothing, and its output is
/// the one the in-memory table gives.
#[test]
fn prefetch_brings_in_the_rows_of_the_next_forward() {
    let gpu: Arc<dyn GpuBackend> = Arc::new(CpuBackend::new_debug());
    let g = gpu.as_ref();
    let start = g.live_alloc_count();
    let small = Small::new(22);
    let c = small.channels();
    let s = g.create_stream().unwrap();
    let mut r = Rng(5);
    let first = tokens(&mut r, 6, 40);
    let next = tokens(&mut r, 5, 40);
    let hw1 = highway(&mut r, first.len(), c);
    let hw2 = highway(&mut r, next.len(), c);

    // Reference: the in-memory table.
    let test_table = TestTable::new(g, &small.table_bits, small.head_dim, 1000).unwrap();
    let run = |table: Arc<dyn RowTable>,
               hook: &dyn Fn(&metrale_model_layers::layers::ple::PleLayer)| {
        let mut layer = small.layer(g, table, 8).unwrap();
        let mut st = layer.new_seq_state(g).unwrap();
        let mut out = Vec::new();
        for (toks, rows, fresh) in [(&first, &hw1, true), (&next, &hw2, false)] {
            if !fresh {
                hook(&layer);
            }
            let hw = upload(g, rows, "hw");
            layer
                .forward(
                    &mut st,
                    hw,
                    toks.len(),
                    fresh,
                    &ForwardContext::new(g).with_host_ids(toks),
                    s,
                )
                .unwrap();
            out.extend(bits(&download(g, hw, toks.len() * c, s)));
            g.free(hw).unwrap();
        }
        layer.release_seq_state(&mut st, g).unwrap();
        layer.free(g).unwrap();
        out
    };
    let want = run(test_table.clone(), &|_| {});
    test_table.free(g);

    let dir = tempfile::tempdir().unwrap();
    let files = shards(dir.path(), &small);
    let cached =
        Arc::new(CachedTable::open(files, Arc::clone(&gpu), CacheConfig::new(256)).unwrap());
    let misses_before_next = std::cell::Cell::new(0);
    let got = run(cached.clone() as Arc<dyn RowTable>, &|layer| {
        // The history is what the carry absorbed: the first tokens.
        let plan = layer.plan(&[SeqWork::new(&first, &next)]).unwrap();
        layer.prefetch(&plan).unwrap();
        cached.wait_prefetched();
        misses_before_next.set(cached.stats().misses);
    });
    assert!(got == want, "prefetching changed the output");
    assert_eq!(
        cached.stats().misses,
        misses_before_next.get(),
        "the forward after prefetch still missed: {:?}",
        cached.stats()
    );
    // Prefetch for a fresh carry (empty history) and of nothing is fine.
    let layer = small
        .layer(g, cached.clone() as Arc<dyn RowTable>, 8)
        .unwrap();
    for work in [SeqWork::new(&[], &next), SeqWork::new(&first, &[])] {
        layer.prefetch(&layer.plan(&[work]).unwrap()).unwrap();
    }
    let mut layer = layer;
    layer.free(g).unwrap();
    drop(layer);
    cached.wait_prefetched();
    cached.check_invariants().unwrap();
    drop(cached);
    g.destroy_stream(s).unwrap();
    assert_eq!(g.live_alloc_count(), start, "{}", g.live_report());
}

#[test]
fn the_pipelined_gather_gives_the_plain_one_bits() {
    let gpu: Arc<dyn GpuBackend> = Arc::new(CpuBackend::new_debug());
    let g = gpu.as_ref();
    let start = g.live_alloc_count();
    let small = Small::new(23);
    let test_table = TestTable::new(g, &small.table_bits, small.head_dim, 1000).unwrap();
    let want = scenario(&small, test_table.clone(), g);
    let resolves = Arc::new(AtomicUsize::new(0));
    let counted = Arc::clone(&resolves);
    let waiting: Arc<dyn RowTable> = Arc::new(hooked_waiting(test_table.clone(), move |_| {
        counted.fetch_add(1, Ordering::Relaxed);
    }));
    assert!(
        scenario(&small, Arc::clone(&waiting), g) == want,
        "the pipelined gather differs"
    );
    // 4 heads a token, one head a group: every eager forward resolved in 4
    // group calls (prestages resolve at once, as before).
    let resolves = resolves.load(Ordering::Relaxed);
    assert!(
        resolves >= 4 * 5,
        "{resolves} resolves: the gathers were not pipelined"
    );
    drop(waiting);
    assert_eq!(test_table.pinned(g), 0);
    test_table.free(g);

    // The same through a row cache whose resolves read from disk, with
    // parts smaller than a group where a prefill chunk of 8 tokens has 8
    // ids in each (max_resolve 4).
    let dir = tempfile::tempdir().unwrap();
    let files = shards(dir.path(), &small);
    let mut cfg = CacheConfig::new(16);
    cfg.max_resolve = 4;
    let cached = Arc::new(CachedTable::open(files, Arc::clone(&gpu), cfg).unwrap());
    assert!(cached.would_wait(&[0, 1]), "an empty cache reads");
    assert!(
        scenario(&small, cached.clone() as Arc<dyn RowTable>, g) == want,
        "the pipelined gather over a row cache differs"
    );
    cached.check_invariants().unwrap();
    drop(cached);
    assert_no_leaks(g, start);
}

/// The layer tests' own pin-counting table conforms to the RowTable suite.
#[test]
fn the_test_table_conforms() {
    let head_dim = 8usize;
    let bits =
        move |id: u64| -> Vec<u16> { (0..head_dim as u64).map(|j| (id * 97 + j) as u16).collect() };
    let all: Vec<u16> = (0..50u64).flat_map(bits).collect();
    metrale_table_conformance::assert_conforms("the layer tests' TestTable", &|| {
        let gpu: Arc<dyn GpuBackend> = Arc::new(CpuBackend::new());
        let table = TestTable::new(gpu.as_ref(), &all, head_dim, 16).unwrap();
        metrale_table_conformance::Subject {
            table,
            gpu,
            row: Box::new(move |id| bits(id).iter().flat_map(|b| b.to_le_bytes()).collect()),
            fault: None,
        }
    });
}
