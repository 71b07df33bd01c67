//! The engine's calls on highway rows already on the device
//! ([`Highway::Device`]) against the same calls on host rows: chunked
//! prefill, decode split into parts, the planned and masked variants,
//! speculative verify and commit, and decode replayed from graphs all give
//! the same output rows and the same carries, bit for bit; a null device
//! highway is refused with nothing run; a device step that fails loses its
//! carry as a host step does; the backend is clean at the end.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use metrale_engine::ple_site::PleSite;
use metrale_engine::{Engine, EngineConfig, EngineError, Highway, Site};
use metrale_gpu_runtime::cpu::CpuBackend;
use metrale_gpu_runtime::gpu::{DevicePtr, GpuBackend};
use metrale_testkit::families::{TinyFamily, family_engine};
use metrale_testkit::hooked_site::{HookedSite, SiteCall};
use metrale_testkit::rows::rows_for;
use metrale_testkit::same_bits;
use metrale_testkit::tiny::{TinySpec, tiny_engine};
use metrale_testkit::toy::ToySite;

/// Bytes of padding before the rows in a device allocation, so a device
/// highway is never the start of its allocation.
const PAD: usize = 3 * 64;

/// Device rows of one engine: an allocation holding `rows` after `PAD`
/// bytes.
struct DeviceRows {
    alloc: DevicePtr,
    len: usize,
}

impl DeviceRows {
    fn new(gpu: &dyn GpuBackend, rows: &[f32]) -> Self {
        let alloc = gpu.alloc(PAD + rows.len() * 4, "test highway").unwrap();
        let bytes: Vec<u8> = rows.iter().flat_map(|v| v.to_ne_bytes()).collect();
        gpu.copy_h2d(&bytes, alloc.offset(PAD)).unwrap();
        DeviceRows {
            alloc,
            len: rows.len(),
        }
    }

    fn ptr(&self) -> DevicePtr {
        self.alloc.offset(PAD)
    }

    fn read(&self, gpu: &dyn GpuBackend) -> Vec<f32> {
        let mut b = vec![0u8; self.len * 4];
        gpu.copy_d2h(self.ptr(), &mut b).unwrap();
        b.chunks_exact(4)
            .map(|c| f32::from_ne_bytes(c.try_into().unwrap()))
            .collect()
    }

    fn free(self, gpu: &dyn GpuBackend) {
        gpu.dealloc(self.alloc).unwrap();
    }
}

/// Two engines built alike: `host` runs host rows, `dev` device rows.
struct Pair<S: Site> {
    host: Engine<S>,
    dev: Engine<S>,
}

impl<S: Site> Pair<S> {
    /// Run `f` on both engines, `rows` in: the host engine on a copy of
    /// the rows in host memory, the device engine on a copy of them on its
    /// device. Both results and both output rows must agree; returns the
    /// host engine's result and rows.
    fn both(
        &mut self,
        rows: &[f32],
        f: impl Fn(&mut Engine<S>, Highway<'_>) -> Result<(), EngineError>,
    ) -> (Result<(), EngineError>, Vec<f32>) {
        let mut host_rows = rows.to_vec();
        let rh = f(&mut self.host, Highway::from(&mut host_rows));
        let gpu = self.dev.gpu().clone();
        let d = DeviceRows::new(gpu.as_ref(), rows);
        let rd = f(&mut self.dev, Highway::Device(d.ptr()));
        let dev_rows = d.read(gpu.as_ref());
        d.free(gpu.as_ref());
        assert_eq!(
            rh.as_ref().map_err(|e| e.to_string()),
            rd.as_ref().map_err(|e| e.to_string()),
            "the two paths' results"
        );
        if rh.is_ok() {
            assert!(same_bits(&host_rows, &dev_rows), "output rows differ");
        }
        (rh, host_rows)
    }

    /// Both engines hold the same carry and tokens for `id`.
    fn same_carry(&mut self, id: u64) {
        assert_eq!(self.host.tokens(id).unwrap(), self.dev.tokens(id).unwrap());
        assert_eq!(
            self.host.snapshot(id).unwrap(),
            self.dev.snapshot(id).unwrap(),
            "carries of sequence {id} differ"
        );
    }

    fn add(&mut self, prompt: &[u32]) -> u64 {
        let a = self.host.add_sequence(prompt).unwrap();
        let b = self.dev.add_sequence(prompt).unwrap();
        assert_eq!(a, b);
        a.id
    }

    fn close(self) {
        self.host.close().unwrap();
        self.dev.close().unwrap();
    }
}

fn tiny_pair(gpu: &Arc<dyn GpuBackend>, cfg: &EngineConfig) -> Pair<PleSite> {
    let spec = TinySpec {
        max_tokens: 4,
        ..Default::default()
    };
    Pair {
        host: tiny_engine(gpu, &spec, 2, 5, cfg.clone()).unwrap(),
        dev: tiny_engine(gpu, &spec, 2, 5, cfg.clone()).unwrap(),
    }
}

fn cfg() -> EngineConfig {
    EngineConfig {
        prefill_chunk: 3,
        block_size: 4,
        ..Default::default()
    }
}

fn tokens(n: usize, salt: u32) -> Vec<u32> {
    (0..n as u32)
        .map(|i| (i * 37 + salt * 11) % 500 + 1)
        .collect()
}

/// Prefill `n` tokens of `prompt` into fresh sequences on both engines
/// (several chunks) and return the ids; checks rows and carries.
fn prefilled<S: Site>(p: &mut Pair<S>, prompts: &[Vec<u32>]) -> Vec<u64> {
    let w = p.host.width();
    let mut ids = Vec::new();
    for toks in prompts {
        let id = p.add(toks);
        let rows = rows_for(toks, 0, toks.len(), w);
        let (r, _) = p.both(&rows, |e, h| e.prefill(id, toks, h));
        r.unwrap();
        p.same_carry(id);
        ids.push(id);
    }
    ids
}

/// Decode `steps` steps of every sequence of `ids` in one batch; checks
/// rows each step and carries at the end.
fn decode_steps<S: Site>(p: &mut Pair<S>, ids: &[u64], steps: usize, planned: bool) {
    let w = p.host.width();
    for step in 0..steps {
        let batch: Vec<(u64, u32)> = ids
            .iter()
            .map(|&id| (id, (id as u32 * 31 + step as u32 * 7) % 400 + 1))
            .collect();
        let rows = rows_for(
            &batch.iter().map(|b| b.1).collect::<Vec<_>>(),
            0,
            batch.len(),
            w,
        );
        let (r, _) = if planned {
            p.both(&rows, |e, h| {
                let work: Vec<(u64, Vec<u32>)> = batch.iter().map(|&(i, t)| (i, vec![t])).collect();
                let work: Vec<(u64, &[u32])> = work.iter().map(|(i, t)| (*i, &t[..])).collect();
                let plan = e.plan(&work)?;
                e.decode_planned(&batch, &plan, h)
            })
        } else {
            p.both(&rows, |e, h| e.decode(&batch, h))
        };
        r.unwrap();
    }
    for &id in ids {
        p.same_carry(id);
    }
}

#[test]
fn chunked_prefill_and_decode_in_parts_match_host_rows() {
    let gpu: Arc<dyn GpuBackend> = Arc::new(CpuBackend::new());
    let base = gpu.live_alloc_count();
    let mut p = tiny_pair(&gpu, &cfg());
    // 11 tokens: chunks of 3, cut at block boundaries of 4.
    let prompts: Vec<Vec<u32>> = (0..7).map(|i| tokens(11 + i % 3, i as u32)).collect();
    let ids = prefilled(&mut p, &prompts);
    // Seven sequences, four to a batched forward: two parts per step.
    assert!(p.dev.batch_capacity() < ids.len());
    decode_steps(&mut p, &ids, 5, false);
    decode_steps(&mut p, &ids, 2, true);
    assert!(p.dev.stats().decode_tokens == 7 * 7);
    p.close();
    assert_eq!(gpu.live_alloc_count(), base, "{}", gpu.live_report());
}

#[test]
fn planned_prefill_matches_host_rows() {
    let gpu: Arc<dyn GpuBackend> = Arc::new(CpuBackend::new());
    let mut p = tiny_pair(&gpu, &cfg());
    let toks = tokens(10, 3);
    let id = p.add(&toks[..2]);
    let w = p.host.width();
    let rows = rows_for(&toks, 0, 10, w);
    let (r, _) = p.both(&rows, |e, h| {
        let plan = e.plan(&[(id, &toks[..])])?;
        e.prefill_planned(id, &toks, &plan, h)
    });
    r.unwrap();
    p.same_carry(id);
    p.close();
}

#[test]
fn decode_graphs_on_device_rows_match_host_rows() {
    let gpu: Arc<dyn GpuBackend> = Arc::new(CpuBackend::new());
    let base = gpu.live_alloc_count();
    let mut p = tiny_pair(&gpu, &cfg());
    p.host.enable_decode_graphs().unwrap();
    p.dev.enable_decode_graphs().unwrap();
    let prompts: Vec<Vec<u32>> = (0..6).map(|i| tokens(5 + i, 9 + i as u32)).collect();
    let ids = prefilled(&mut p, &prompts);
    decode_steps(&mut p, &ids, 4, false);
    decode_steps(&mut p, &ids[..3], 3, false);
    let s = p.dev.stats();
    assert!(s.graph_replays >= 8, "{} replays", s.graph_replays);
    assert_eq!(s.graph_replays, p.host.stats().graph_replays);
    p.close();
    assert_eq!(gpu.live_alloc_count(), base, "{}", gpu.live_report());
}

#[test]
fn verify_and_commit_on_device_rows_match_host_rows() {
    let gpu: Arc<dyn GpuBackend> = Arc::new(CpuBackend::new());
    let base = gpu.live_alloc_count();
    let mut p = tiny_pair(&gpu, &cfg());
    let w = p.host.width();
    for accepted in [0, 2, 6, 9] {
        let toks = tokens(7, accepted as u32);
        let ids = prefilled(&mut p, std::slice::from_ref(&toks));
        let id = ids[0];
        // Longer than one forward takes: the verify runs in chunks.
        let draft = tokens(9, 40 + accepted as u32);
        let mut all = toks.clone();
        all.extend_from_slice(&draft);
        let rows = rows_for(&all, toks.len(), all.len(), w);
        let (r, _) = p.both(&rows, |e, h| e.verify(id, &draft, h));
        r.unwrap();
        p.host.commit(id, accepted).unwrap();
        p.dev.commit(id, accepted).unwrap();
        p.same_carry(id);
        decode_steps(&mut p, &[id], 2, false);
        p.host.release(id).unwrap();
        p.dev.release(id).unwrap();
    }
    p.close();
    assert_eq!(gpu.live_alloc_count(), base, "{}", gpu.live_report());
}

#[test]
fn masked_prefill_and_decode_on_device_rows_match_host_rows() {
    let gpu: Arc<dyn GpuBackend> = Arc::new(CpuBackend::new());
    let cfg = EngineConfig {
        prefill_chunk: 3,
        block_size: 4,
        ..Default::default()
    };
    let mut p = Pair {
        host: family_engine(&gpu, TinyFamily::EngramV41, 21, 4, cfg.clone()).unwrap(),
        dev: family_engine(&gpu, TinyFamily::EngramV41, 21, 4, cfg).unwrap(),
    };
    let w = p.host.width();
    let mut ids = Vec::new();
    for i in 0..5u32 {
        let toks = tokens(9, i);
        let masked: Vec<bool> = (0..9).map(|k| (k + i as usize) % 4 == 1).collect();
        let id = p.add(&toks);
        let rows = rows_for(&toks, 0, toks.len(), w);
        let (r, _) = p.both(&rows, |e, h| e.prefill_masked(id, &toks, &masked, h));
        r.unwrap();
        p.same_carry(id);
        ids.push(id);
    }
    for step in 0..3u32 {
        let batch: Vec<(u64, u32)> = ids.iter().map(|&id| (id, id as u32 + step + 1)).collect();
        let masked: Vec<bool> = (0..batch.len())
            .map(|b| (b + step as usize).is_multiple_of(3))
            .collect();
        let toks: Vec<u32> = batch.iter().map(|b| b.1).collect();
        let rows = rows_for(&toks, 0, toks.len(), w);
        let (r, _) = p.both(&rows, |e, h| e.decode_masked(&batch, &masked, h));
        r.unwrap();
    }
    for &id in &ids {
        p.same_carry(id);
    }
    p.close();
}

#[test]
fn a_null_device_highway_is_refused_with_nothing_run() {
    let gpu: Arc<dyn GpuBackend> = Arc::new(CpuBackend::new());
    let mut e = tiny_pair(&gpu, &cfg()).dev;
    let toks = tokens(5, 1);
    let id = e.add_sequence(&toks).unwrap().id;
    let null = Highway::Device(DevicePtr::NULL);
    match e.prefill(id, &toks, null) {
        Err(EngineError::NullHighway { op, tokens }) => assert_eq!((op, tokens), ("prefill", 5)),
        other => panic!("{other:?}"),
    }
    assert!(e.tokens(id).unwrap().is_empty());
    // No tokens, no rows: nothing to refuse.
    e.prefill(id, &[], DevicePtr::NULL).unwrap();
    let mut rows = rows_for(&toks, 0, 5, e.width());
    e.prefill(id, &toks, &mut rows).unwrap();
    assert!(matches!(
        e.decode(&[(id, 3)], DevicePtr::NULL),
        Err(EngineError::NullHighway { op: "decode", .. })
    ));
    assert!(matches!(
        e.verify(id, &[3, 4], DevicePtr::NULL),
        Err(EngineError::NullHighway { op: "verify", .. })
    ));
    assert_eq!(e.tokens(id).unwrap(), &toks[..]);
    e.close().unwrap();
}

/// A forward that fails on device rows loses the carry, as on host rows;
/// the engine's other sequences go on.
#[test]
fn a_failed_device_step_loses_the_carry() {
    let gpu: Arc<dyn GpuBackend> = Arc::new(CpuBackend::new());
    let base = gpu.live_alloc_count();
    let fail = Arc::new(AtomicBool::new(false));
    let engine = |fail: &Arc<AtomicBool>| {
        let sites = (0..2)
            .map(|i| {
                let fail = fail.clone();
                HookedSite::new(ToySite::new(8, 2, i, 8), move |call: SiteCall<'_>| {
                    let run = matches!(call, SiteCall::Run { .. } | SiteCall::RunBatch { .. });
                    (i == 1 && run && fail.load(Ordering::SeqCst))
                        .then(|| "injected: forward failed".to_string())
                })
            })
            .collect();
        Engine::new(gpu.clone(), sites, cfg()).unwrap()
    };
    let mut p = Pair {
        host: engine(&fail),
        dev: engine(&fail),
    };
    let prompts: Vec<Vec<u32>> = (0..2).map(|i| tokens(6, i)).collect();
    let ids = prefilled(&mut p, &prompts);
    let w = p.host.width();
    fail.store(true, Ordering::SeqCst);
    let more = tokens(4, 7);
    let rows = rows_for(&more, 0, 4, w);
    let (r, _) = p.both(&rows, |e, h| e.prefill(ids[0], &more, h));
    assert!(r.unwrap_err().is_device_failure());
    let rows = rows_for(&more, 0, 2, w);
    let (r, _) = p.both(&rows, |e, h| e.decode(&[(ids[1], 5), (ids[0], 6)], h));
    assert!(
        r.unwrap_err().is_lost(),
        "the lost sequence is refused first"
    );
    fail.store(false, Ordering::SeqCst);
    for e in [&mut p.host, &mut p.dev] {
        assert!(e.tokens(ids[0]).is_ok());
        assert!(matches!(e.snapshot(ids[0]), Err(EngineError::Lost { .. })));
    }
    decode_steps(&mut p, &ids[1..], 2, false);
    p.close();
    assert_eq!(gpu.live_alloc_count(), base, "{}", gpu.live_report());
}
