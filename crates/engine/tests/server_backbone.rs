//! The serving loop with the compute backbone and step-start prefetch:
//! neither changes an output bit (with the backbone and without, prefetch
//! on and off, over resident and few-slot cached tables), the blocks sit
//! where the model's layers put them, the report carries the wait and the
//! read time, and a malformed backbone is refused with every site freed.

use std::path::Path;
use std::sync::Arc;

use metrale_engine::backbone::{BackboneConfig, BackboneError, BlockShape, layered};
use metrale_engine::ple_site::PleSite;
use metrale_engine::server::{Phase, Request, TimedReader, Workload};
use metrale_engine::{
    CarrySite, Engine, EngineConfig, EngineError, SeqId, Server, ServerConfig, ServerError,
    ServerReport,
};
use metrale_gpu_runtime::cpu::CpuBackend;
use metrale_gpu_runtime::gpu::GpuBackend;
use metrale_model_layers::layers::ple::PleLayer;
use metrale_storage::cached::{CacheConfig, CachedTable};
use metrale_storage::io::{PageReader, default_reader};
use metrale_storage::table::RowTable;
use metrale_testkit::Rng;
use metrale_testkit::families::{TinyFamily, family_site};
use metrale_testkit::tiny::{TinySpec, tiny_site, tiny_site_files};

fn spec() -> TinySpec {
    TinySpec {
        max_tokens: 16,
        ..Default::default()
    }
}

fn embed(token: u32, out: &mut [f32]) {
    let mut r = Rng(0x5EED ^ u64::from(token).wrapping_mul(0x9E37_79B9_7F4A_7C15));
    for v in out {
        *v = r.unit();
    }
}

/// Prompts, generated tokens, and second turns (a prefill due after a
/// decode step).
fn workload(n: usize, seed: u64) -> Vec<Request> {
    let mut rng = Rng(seed);
    (0..n)
        .map(|_| {
            let mut tokens = Vec::new();
            let mut segments = Vec::new();
            for turn in 0..1 + rng.below(2) {
                if turn > 0 {
                    tokens.push(0);
                }
                tokens.extend((0..2 + rng.below(9)).map(|_| 1 + rng.below(900) as u32));
                segments.push((Phase::Prefill, tokens.len()));
                tokens.extend((0..1 + rng.below(6)).map(|_| 1 + rng.below(900) as u32));
                segments.push((Phase::Decode, tokens.len()));
            }
            Request { tokens, segments }
        })
        .collect()
}

fn engine_cfg() -> EngineConfig {
    EngineConfig {
        prefill_chunk: 5,
        block_size: 4,
        prefix_cache_bytes: 0,
        ..Default::default()
    }
}

fn cfg(prefetch: bool, backbone: Option<BackboneConfig>) -> ServerConfig {
    ServerConfig {
        in_flight: 6,
        prefill_chunk: 5,
        decode_batch: 4,
        prefetch,
        prefetch_ahead: prefetch,
        backbone,
        decode_graphs: false,
        retries: None,
    }
}

/// A model of 5 layers with the two sites at layers 2 and 4.
fn backbone() -> BackboneConfig {
    BackboneConfig {
        layers: 5,
        site_layers: vec![2, 4],
        scale: 2,
    }
}

/// How the two sites' tables are held.
#[derive(Clone, Copy)]
enum Tables {
    InMemory,
    Cached(usize),
}

/// Two tiny sites (the same weights whatever the tables).
fn sites(
    gpu: &Arc<dyn GpuBackend>,
    dir: &Path,
    tables: Tables,
    reader: &Option<Arc<TimedReader>>,
) -> Vec<PleSite> {
    (0..2)
        .map(|i| match tables {
            Tables::InMemory => tiny_site(gpu, &spec(), i, 0xBB).unwrap(),
            Tables::Cached(slots) => {
                let (ss, files, weights) = tiny_site_files(dir, &spec(), i, 0xBB).unwrap();
                let mut cc = CacheConfig::new(slots);
                cc.reader = reader.clone().map(|r| r as Arc<dyn PageReader>);
                let table: Arc<dyn RowTable> =
                    Arc::new(CachedTable::open(files, gpu.clone(), cc).unwrap());
                let layer =
                    PleLayer::new(&ss, weights, table, spec().max_tokens, gpu.as_ref()).unwrap();
                PleSite::new(layer)
            }
        })
        .collect()
}

fn run(
    dir: &Path,
    tables: Tables,
    prefetch: bool,
    bb: Option<BackboneConfig>,
    reqs: &[Request],
) -> ServerReport {
    let gpu: Arc<dyn GpuBackend> = Arc::new(CpuBackend::new());
    let base = gpu.live_alloc_count();
    let reader = match tables {
        Tables::Cached(_) => Some(Arc::new(TimedReader::new(default_reader(4).unwrap()))),
        Tables::InMemory => None,
    };
    let s = sites(&gpu, dir, tables, &reader);
    let mut server =
        Server::build(gpu.clone(), s, engine_cfg(), cfg(prefetch, bb.clone())).unwrap();
    if let Some(r) = reader {
        server.time_reads(r);
    }
    let mut done = vec![0u32; reqs.len()];
    let w = Workload {
        requests: reqs,
        rows: &embed,
    };
    let report = server.run(w, &mut |i| done[i] += 1).unwrap();
    assert!(done.iter().all(|&d| d == 1), "each request done once");
    // Every wait for rows happens in a site's forward, and is filed as
    // covered by the blocks before the site or exposed, never both.
    let (covered, exposed) = server
        .engine()
        .sites()
        .iter()
        .map(|s| s.wait_split())
        .fold((0, 0), |(c, e), w| {
            (c + w.covered.as_nanos(), e + w.exposed.as_nanos())
        });
    assert_eq!(covered + exposed, report.io_wait.as_nanos());
    if bb.is_none() {
        assert_eq!(covered, 0, "no blocks, nothing covered");
    }
    server.into_engine().close().unwrap();
    assert_eq!(gpu.live_alloc_count(), base, "{}", gpu.live_report());
    report
}

#[test]
fn the_backbone_and_prefetch_change_no_output_row() {
    let dir = tempfile::tempdir().unwrap();
    let reqs = workload(14, 3);
    let want = run(dir.path(), Tables::InMemory, false, None, &reqs);
    assert!(want.rows.iter().flatten().all(Option::is_some));
    for (tables, prefetch, bb) in [
        (Tables::InMemory, true, None),
        (Tables::InMemory, false, Some(backbone())),
        (Tables::InMemory, true, Some(backbone())),
        (Tables::Cached(96), true, None),
        (Tables::Cached(96), false, Some(backbone())),
    ] {
        let got = run(dir.path(), tables, prefetch, bb.clone(), &reqs);
        assert_eq!(
            got.rows,
            want.rows,
            "prefetch {prefetch}, backbone {:?}",
            bb.is_some()
        );
    }
}

#[test]
fn a_few_slot_cache_with_the_backbone_serves_the_same_rows_and_reports_its_reads() {
    let dir = tempfile::tempdir().unwrap();
    let reqs = workload(16, 9);
    let want = run(dir.path(), Tables::InMemory, false, None, &reqs);
    // 48 slots per site: a decode batch of 4 needs 16 rows per site, a
    // prefill chunk of 5 needs 20, so the step's prefetch evicts rows the
    // step will still need, and resolves read them again.
    let got = run(
        dir.path(),
        Tables::Cached(48),
        true,
        Some(backbone()),
        &reqs,
    );
    assert_eq!(got.rows, want.rows);
    assert!(
        got.table.misses > 0 && got.table.evictions > 0,
        "{:?}",
        got.table
    );
    let read = got.read_time.expect("the timed reader was given");
    assert!(read > std::time::Duration::ZERO);
    assert_eq!(got.io_wait.as_nanos() as u64, got.table.io_wait_ns);
    // The same run without a timed reader has no read time.
    let plain = run(dir.path(), Tables::InMemory, true, Some(backbone()), &reqs);
    assert!(plain.read_time.is_none());
}

#[test]
fn blocks_sit_at_the_model_layers_of_the_sites() {
    let gpu: Arc<dyn GpuBackend> = Arc::new(CpuBackend::new());
    let base = gpu.live_alloc_count();
    let s: Vec<PleSite> = (0..2)
        .map(|i| tiny_site(&gpu, &spec(), i, 1).unwrap())
        .collect();
    let mut l = layered(gpu.as_ref(), s, Some(&backbone()), 16).unwrap();
    // Layers 1 (before site 1 at layer 2), 2..3 (site 2 at layer 4), and
    // 4..5 after the last site.
    assert_eq!(l[0].blocks(), (1, 0));
    assert_eq!(l[1].blocks(), (2, 2));
    let shape = l[0].backbone().unwrap().shape();
    assert_eq!(shape, BlockShape::new(64, 2));
    assert_eq!((shape.model, shape.intermediate), (32, 96));
    assert!(gpu.live_alloc_count() > base);
    for site in &mut l {
        site.free(gpu.as_ref()).unwrap();
    }
    // The tiny tables' rows go with the sites.
    drop(l);
    assert_eq!(gpu.live_alloc_count(), base, "{}", gpu.live_report());
    let s: Vec<PleSite> = (0..2)
        .map(|i| tiny_site(&gpu, &spec(), i, 1).unwrap())
        .collect();
    let l = layered(gpu.as_ref(), s, None, 16).unwrap();
    assert!(
        l.iter()
            .all(|s| s.blocks() == (0, 0) && s.backbone().is_none())
    );
}

#[test]
fn a_malformed_backbone_is_refused_and_frees_the_sites() {
    let gpu: Arc<dyn GpuBackend> = Arc::new(CpuBackend::new());
    let base = gpu.live_alloc_count();
    for bad in [
        BackboneConfig {
            site_layers: vec![2],
            ..backbone()
        },
        BackboneConfig {
            site_layers: vec![4, 2],
            ..backbone()
        },
        BackboneConfig {
            site_layers: vec![2, 6],
            ..backbone()
        },
        BackboneConfig {
            scale: 0,
            ..backbone()
        },
    ] {
        let s: Vec<PleSite> = (0..2)
            .map(|i| tiny_site(&gpu, &spec(), i, 1).unwrap())
            .collect();
        let err = Server::build(gpu.clone(), s, engine_cfg(), cfg(true, Some(bad.clone())))
            .err()
            .unwrap();
        assert!(
            matches!(err, ServerError::Backbone(BackboneError::Config(_))),
            "{bad:?}: {err}"
        );
        assert_eq!(gpu.live_alloc_count(), base, "{}", gpu.live_report());
    }
    // Server::new takes an engine whose sites are built: a backbone there
    // is refused rather than ignored.
    let s: Vec<PleSite> = (0..2)
        .map(|i| tiny_site(&gpu, &spec(), i, 1).unwrap())
        .collect();
    let engine = metrale_engine::Engine::new(gpu.clone(), s, engine_cfg()).unwrap();
    let err = Server::new(engine, cfg(true, Some(backbone())))
        .err()
        .unwrap();
    assert!(matches!(err, ServerError::Config(_)), "{err}");
}

/// The ids a step's prefetch reads are the ids its forwards resolve: once
/// the prefetch has landed, the decode step and prefill chunk it covered
/// miss no row.
#[test]
fn a_step_prefetch_reads_exactly_the_rows_the_step_resolves() {
    let dir = tempfile::tempdir().unwrap();
    let gpu: Arc<dyn GpuBackend> = Arc::new(CpuBackend::new());
    let mut caches = Vec::new();
    let s: Vec<PleSite> = (0..2)
        .map(|i| {
            let (ss, files, weights) = tiny_site_files(dir.path(), &spec(), i, 0xBB).unwrap();
            let t =
                Arc::new(CachedTable::open(files, gpu.clone(), CacheConfig::new(4096)).unwrap());
            caches.push(t.clone());
            let layer = PleLayer::new(
                &ss,
                weights,
                t as Arc<dyn RowTable>,
                spec().max_tokens,
                gpu.as_ref(),
            )
            .unwrap();
            PleSite::new(layer)
        })
        .collect();
    let mut e = metrale_engine::Engine::new(gpu.clone(), s, engine_cfg()).unwrap();
    let w = e.width();
    let rows = |toks: &[u32]| {
        let mut r = vec![0f32; toks.len() * w];
        for (k, &t) in toks.iter().enumerate() {
            embed(t, &mut r[k * w..(k + 1) * w]);
        }
        r
    };
    let a = e.add_sequence(&[5, 6, 7]).unwrap().id;
    e.prefill(a, &[5, 6, 7], &mut rows(&[5, 6, 7])).unwrap();
    let b = e.add_sequence(&[8, 9]).unwrap().id;
    // The step: one decode token of `a`, a prefill chunk of `b`.
    let (ta, chunk) = (311u32, [412u32, 513, 614]);
    e.prefill(b, &[8, 9], &mut rows(&[8, 9])).unwrap();
    let plan = e.plan(&[(a, &[ta]), (b, &chunk)]).unwrap();
    e.prefetch_plan(&plan).unwrap();
    for c in &caches {
        c.wait_prefetched();
    }
    let before = e.table_stats();
    e.decode_planned(&[(a, ta)], &plan, &mut rows(&[ta]))
        .unwrap();
    e.prefill_planned(b, &chunk, &plan, &mut rows(&chunk))
        .unwrap();
    let d = e.table_stats().since(&before);
    let heads: u64 = e
        .geometries()
        .iter()
        .map(|g| g.dims.ngram_heads() as u64)
        .sum();
    assert_eq!(d.misses, 0, "{d:?}");
    assert_eq!(d.hits, heads * 4, "{d:?}");
    e.close().unwrap();
}

/// What a step is planned for before each call in [`planned_run`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Ahead {
    /// No plan: every call plans for itself.
    None,
    /// The call's own tokens: the call runs the plan.
    Same,
    /// Other tokens: the planned call is refused, changing nothing, and
    /// the call then runs unplanned.
    Other,
}

/// Three sequences prefilled (in two chunks each) then decoded six steps
/// together, eagerly or through decode graphs, each call planned and
/// prefetched ahead as `ahead` says; every output row's bits, in order.
fn planned_run(family: Option<TinyFamily>, graphs: bool, ahead: Ahead) -> Vec<u32> {
    let gpu: Arc<dyn GpuBackend> = Arc::new(CpuBackend::new());
    let s: Vec<PleSite> = match family {
        None => (0..2)
            .map(|i| tiny_site(&gpu, &spec(), i, 0xBB).unwrap())
            .collect(),
        Some(f) => (0..f.spec().sites())
            .map(|i| family_site(&gpu, f, i, 0xBB, spec().max_tokens).unwrap())
            .collect(),
    };
    let mut e = metrale_engine::Engine::new(gpu.clone(), s, engine_cfg()).unwrap();
    if graphs {
        e.enable_decode_graphs().unwrap();
    }
    let w = e.width();
    let rows = |toks: &[u32]| {
        let mut r = vec![0f32; toks.len() * w];
        for (k, &t) in toks.iter().enumerate() {
            embed(t, &mut r[k * w..(k + 1) * w]);
        }
        r
    };
    // The plan of `work` as `ahead` says, its reads started.
    let plan = |e: &Engine<PleSite>, work: &[(SeqId, Vec<u32>)]| {
        let shift = match ahead {
            Ahead::None => return None,
            Ahead::Same => 0,
            Ahead::Other => 1,
        };
        let shifted: Vec<Vec<u32>> = work
            .iter()
            .map(|(_, t)| t.iter().map(|v| v + shift).collect())
            .collect();
        let refs: Vec<(SeqId, &[u32])> = work
            .iter()
            .zip(&shifted)
            .map(|((id, _), t)| (*id, t.as_slice()))
            .collect();
        let p = e.plan(&refs).unwrap();
        e.prefetch_plan(&p).unwrap();
        Some(p)
    };
    let refused = |r: Result<(), EngineError>| match r {
        Err(EngineError::PlanMismatch { .. }) => {}
        other => panic!("a plan of other tokens ran: {other:?}"),
    };
    let mut rng = Rng(0xA11);
    let mut out = Vec::new();
    let mut ids = Vec::new();
    for _ in 0..3 {
        let prompt: Vec<u32> = (0..7).map(|_| 1 + rng.below(900) as u32).collect();
        let id = e.add_sequence(&prompt).unwrap().id;
        for chunk in prompt.chunks(4) {
            let p = plan(&e, &[(id, chunk.to_vec())]);
            let mut r = rows(chunk);
            match (&p, ahead) {
                (Some(p), Ahead::Same) => e.prefill_planned(id, chunk, p, &mut r).unwrap(),
                (Some(p), _) => {
                    refused(e.prefill_planned(id, chunk, p, &mut r));
                    assert_eq!(r, rows(chunk), "a refused call wrote rows");
                    e.prefill(id, chunk, &mut r).unwrap()
                }
                (None, _) => e.prefill(id, chunk, &mut r).unwrap(),
            }
            out.extend(r.iter().map(|v| v.to_bits()));
        }
        ids.push(id);
    }
    for _ in 0..6 {
        let toks: Vec<u32> = ids.iter().map(|_| 1 + rng.below(900) as u32).collect();
        let work: Vec<(SeqId, Vec<u32>)> = ids
            .iter()
            .zip(&toks)
            .map(|(&id, &t)| (id, vec![t]))
            .collect();
        let p = plan(&e, &work);
        let batch: Vec<_> = ids.iter().copied().zip(toks.iter().copied()).collect();
        let mut r = rows(&toks);
        match (&p, ahead) {
            (Some(p), Ahead::Same) => e.decode_planned(&batch, p, &mut r).unwrap(),
            (Some(p), _) => {
                refused(e.decode_planned(&batch, p, &mut r));
                e.decode(&batch, &mut r).unwrap()
            }
            (None, _) => e.decode(&batch, &mut r).unwrap(),
        }
        out.extend(r.iter().map(|v| v.to_bits()));
    }
    for site in e.sites() {
        let t = site.prefetch_time();
        assert_eq!(t.hash.is_zero(), ahead == Ahead::None, "{t:?}");
    }
    e.close().unwrap();
    out
}

/// A step plan made ahead runs in the step's calls (eager batched,
/// prestaged for a graph, a prefill chunk) and gives the rows of calls
/// that plan for themselves, for every family; a plan of other tokens is
/// refused.
#[test]
fn a_step_planned_ahead_gives_the_same_rows_on_every_path() {
    let families = std::iter::once(None).chain(TinyFamily::ALL.map(Some));
    for family in families {
        for graphs in [false, true] {
            let want = planned_run(family, graphs, Ahead::None);
            for ahead in [Ahead::Same, Ahead::Other] {
                let got = planned_run(family, graphs, ahead);
                assert!(got == want, "{family:?}, graphs {graphs}, plan {ahead:?}");
            }
        }
        assert!(
            planned_run(family, false, Ahead::None) == planned_run(family, true, Ahead::None),
            "{family:?}: eager and graph decode"
        );
    }
}
