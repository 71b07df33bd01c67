//! Disk faults in the middle of an engine workload, end to end: two PLE
//! sites whose tables stay on disk behind the row cache, read through an
//! injectable reader that fails on demand (an OS error, or a short read).
//!
//! What must hold, against a second engine over the same files with a clean
//! reader:
//! - a prefill or a batched decode whose rows could not be read returns an
//!   error naming the row and offset, and only the sequences of that call
//!   are affected (the engine marks them lost and refuses them after);
//! - every other sequence continues and its outputs are bit-identical to the
//!   clean run;
//! - the row caches stay consistent (`check_invariants`), hold no pins once
//!   the engine is idle, and every table row still reads correctly;
//! - the failed sequences, re-added and run again, give the clean outputs;
//! - after closing everything the backend has no live allocation.

use std::collections::HashMap;
use std::io;
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};

use metrale_engine::ple_site::PleSite;
use metrale_engine::{CarrySite, Engine, EngineConfig, EngineError, SeqId};
use metrale_gpu_runtime::cpu::CpuBackend;
use metrale_gpu_runtime::gpu::GpuBackend;
use metrale_model_layers::layers::ple::PleLayer;
use metrale_storage::cached::{CacheConfig, CachedTable};
use metrale_storage::io::{PageReader, ReadReq, default_reader};
use metrale_storage::table::RowRef;
use metrale_testkit::Rng;
use metrale_testkit::rows::rows_for;
use metrale_testkit::same_bits;
use metrale_testkit::tiny::{TinySpec, tiny_site_files};

const HIDDEN: usize = 32;
const HC: usize = 2;
const K_PER_ORDER: usize = 2;
const HEAD_DIM: usize = 16;
const KERNEL: usize = 4;
const DILATION: usize = 3;
const MAX_TOKENS: usize = 16;
const SLOTS: usize = 48;
const SITES: usize = 2;
/// Linux errno for an I/O error.
const EIO: i32 = 5;

/// What the next faulty read batches do.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Fault {
    Eio = 1,
    Short = 2,
}

/// Reads for real, except that the next `arm`ed batch fails every request
/// with EIO or reports a short count.
struct FaultyReader {
    inner: Arc<dyn PageReader>,
    armed: AtomicU32,
    fired: AtomicU64,
}

impl FaultyReader {
    /// The default reader, unarmed.
    fn new() -> Self {
        FaultyReader {
            inner: default_reader(8).unwrap(),
            armed: AtomicU32::new(0),
            fired: AtomicU64::new(0),
        }
    }
    fn arm(&self, f: Fault) {
        self.armed.store(f as u32, Ordering::SeqCst);
    }
    fn fired(&self) -> u64 {
        self.fired.load(Ordering::SeqCst)
    }
}

impl PageReader for FaultyReader {
    fn name(&self) -> &str {
        "faulty"
    }
    fn read_batch(&self, reqs: &mut [ReadReq<'_>]) -> Vec<io::Result<usize>> {
        let fault = self.armed.swap(0, Ordering::SeqCst);
        if fault == 0 {
            return self.inner.read_batch(reqs);
        }
        self.fired.fetch_add(1, Ordering::SeqCst);
        if fault == Fault::Eio as u32 {
            return reqs
                .iter()
                .map(|_| Err(io::Error::from_raw_os_error(EIO)))
                .collect();
        }
        self.inner
            .read_batch(reqs)
            .into_iter()
            .map(|r| r.map(|n| n.min(64)))
            .collect()
    }
}

/// The tiny model of both engines: `SITES` sites, tables on disk.
fn model() -> TinySpec {
    TinySpec {
        hidden: HIDDEN,
        hc_mult: HC,
        heads_per_ngram: K_PER_ORDER,
        head_dim: HEAD_DIM,
        kernel: KERNEL,
        dilation: DILATION,
        max_tokens: MAX_TOKENS,
        eos: 0,
    }
}

struct Rig {
    engine: Engine<PleSite>,
    tables: Vec<Arc<CachedTable>>,
}

fn rig(gpu: &Arc<dyn GpuBackend>, dir: &Path, reader: Option<Arc<dyn PageReader>>) -> Rig {
    rig_with_budget(gpu, dir, reader, None)
}

/// `rig`, with a device budget of `carries` carries when given.
fn rig_with_budget(
    gpu: &Arc<dyn GpuBackend>,
    dir: &Path,
    reader: Option<Arc<dyn PageReader>>,
    carries: Option<usize>,
) -> Rig {
    let mut sites = Vec::new();
    let mut tables = Vec::new();
    for site in 0..SITES {
        let (spec, files, weights) = tiny_site_files(dir, &model(), site, 0xFA17).unwrap();
        let mut cfg = CacheConfig::new(SLOTS);
        cfg.reader = reader.clone();
        let table = Arc::new(CachedTable::open(files, gpu.clone(), cfg).unwrap());
        let layer = PleLayer::new(&spec, weights, table.clone(), MAX_TOKENS, gpu.as_ref()).unwrap();
        sites.push(PleSite::new(layer));
        tables.push(table);
    }
    let carry: usize = sites.iter().map(CarrySite::carry_bytes).sum();
    let cfg = EngineConfig {
        prefill_chunk: 8,
        prefix_cache_bytes: 0,
        device_budget_bytes: carries.map_or(usize::MAX, |n| n * carry),
        ..Default::default()
    };
    Rig {
        engine: Engine::new(gpu.clone(), sites, cfg).unwrap(),
        tables,
    }
}

/// Prefill `tokens` into sequence `id`; the output rows.
fn prefill(e: &mut Engine<PleSite>, id: SeqId, tokens: &[u32]) -> Result<Vec<f32>, EngineError> {
    let mut hw = rows_for(tokens, 0, tokens.len(), e.width());
    e.prefill(id, tokens, &mut hw)?;
    Ok(hw)
}

/// One batched decode step: sequence `ids[i]` (whose tokens so far are
/// `hist[i]`) gets token `next[i]`; the output rows, one per sequence.
fn decode(
    e: &mut Engine<PleSite>,
    ids: &[SeqId],
    hist: &[&Vec<u32>],
    next: &[u32],
) -> Result<Vec<Vec<f32>>, EngineError> {
    let w = e.width();
    let mut hw = Vec::new();
    for (h, &t) in hist.iter().zip(next) {
        let mut all = (*h).clone();
        all.push(t);
        hw.extend(rows_for(&all, all.len() - 1, all.len(), w));
    }
    let batch: Vec<(SeqId, u32)> = ids.iter().copied().zip(next.iter().copied()).collect();
    e.decode(&batch, &mut hw)?;
    Ok(hw.chunks(w).map(<[f32]>::to_vec).collect())
}

/// Every row of every table reads back (no fault armed): no failed load
/// left a slot mapped to bad bytes, and the invariants hold.
fn check_tables(tables: &[Arc<CachedTable>], gpu: &dyn GpuBackend) {
    for t in tables {
        t.check_invariants().unwrap();
        let n = metrale_storage::table::RowTable::info(t.as_ref()).rows;
        for part in (0..n).collect::<Vec<u64>>().chunks(8) {
            let mut refs = vec![RowRef::default(); part.len()];
            let lease =
                metrale_storage::table::RowTable::resolve(t.as_ref(), part, &mut refs).unwrap();
            metrale_storage::table::RowTable::release(t.as_ref(), lease, gpu, None).unwrap();
        }
        t.check_invariants().unwrap();
    }
}

#[test]
fn read_faults_fail_only_their_sequences_and_a_retry_matches_a_clean_run() {
    let gpu: Arc<dyn GpuBackend> = Arc::new(CpuBackend::new());
    let base = gpu.live_alloc_count();
    let dir = tempfile::tempdir().unwrap();
    let faulty = Arc::new(FaultyReader::new());
    let mut clean = rig(&gpu, dir.path(), None);
    let mut hurt = rig(&gpu, dir.path(), Some(faulty.clone()));
    let w = clean.engine.width();

    // Six sequences: prompts of 20 tokens (with EOS now and then), then
    // eight decode steps in two batches of three.
    let mut s = Rng(77);
    let n_seq = 6;
    let prompts: Vec<Vec<u32>> = (0..n_seq)
        .map(|_| {
            (0..20)
                .map(|_| {
                    if s.next().is_multiple_of(9) {
                        0
                    } else {
                        (s.next() % 999) as u32 + 1
                    }
                })
                .collect()
        })
        .collect();
    let steps: Vec<Vec<u32>> = (0..8)
        .map(|_| (0..n_seq).map(|_| (s.next() % 999) as u32 + 1).collect())
        .collect();

    // The clean run: the outputs of every position of every sequence.
    let mut want: Vec<Vec<f32>> = Vec::new();
    {
        let e = &mut clean.engine;
        let ids: Vec<SeqId> = prompts
            .iter()
            .map(|p| e.add_sequence(p).unwrap().id)
            .collect();
        let mut toks = prompts.clone();
        for (i, &id) in ids.iter().enumerate() {
            want.push(prefill(e, id, &prompts[i]).unwrap());
        }
        for step in &steps {
            for half in [0..3, 3..6] {
                let hist: Vec<&Vec<u32>> = toks[half.clone()].iter().collect();
                let out = decode(e, &ids[half.clone()], &hist, &step[half.clone()]).unwrap();
                for (k, o) in half.clone().zip(out) {
                    want[k].extend(o);
                }
            }
            for (k, t) in step.iter().enumerate() {
                toks[k].push(*t);
            }
        }
    }

    // The faulty run. Prefill: sequence 1 meets EIO, sequence 4 a short read.
    let e = &mut hurt.engine;
    let ids: Vec<SeqId> = prompts
        .iter()
        .map(|p| e.add_sequence(p).unwrap().id)
        .collect();
    let mut toks = prompts.clone();
    let mut got: Vec<Vec<f32>> = vec![Vec::new(); n_seq];
    let mut lost: HashMap<usize, String> = HashMap::new();
    for (i, &id) in ids.iter().enumerate() {
        let fault = match i {
            1 => Some(Fault::Eio),
            4 => Some(Fault::Short),
            _ => None,
        };
        let fired = faulty.fired();
        if let Some(f) = fault {
            faulty.arm(f);
        }
        match prefill(e, id, &prompts[i]) {
            Ok(o) => {
                assert!(
                    fault.is_none(),
                    "sequence {i}: prefill survived an injected {fault:?}"
                );
                got[i] = o;
            }
            Err(err) => {
                let msg = err.chain();
                assert!(fault.is_some(), "sequence {i}: unexpected error {msg}");
                assert!(matches!(err, EngineError::Site { .. }), "{msg}");
                assert_eq!(faulty.fired(), fired + 1, "the fault hit this prefill");
                assert!(msg.contains("row ") && msg.contains("offset"), "{msg}");
                if fault == Some(Fault::Short) {
                    assert!(msg.contains("short read"), "{msg}");
                }
                lost.insert(i, msg);
            }
        }
    }
    assert_eq!(lost.len(), 2);
    // A fault in the middle of decode: step 3, the first batch (sequences
    // 0 and 2 alive in it, 1 lost) fails; the second batch carries on.
    for (n, step) in steps.iter().enumerate() {
        for half in [0..3, 3..6] {
            let alive: Vec<usize> = half.clone().filter(|k| !lost.contains_key(k)).collect();
            if alive.is_empty() {
                continue;
            }
            let arm = n == 3 && half.start == 0;
            let fired = faulty.fired();
            if arm {
                faulty.arm(Fault::Eio);
            }
            let a_ids: Vec<SeqId> = alive.iter().map(|&k| ids[k]).collect();
            let hist: Vec<&Vec<u32>> = alive.iter().map(|&k| &toks[k]).collect();
            let next: Vec<u32> = alive.iter().map(|&k| step[k]).collect();
            match decode(e, &a_ids, &hist, &next) {
                Ok(out) => {
                    assert!(
                        !arm || faulty.fired() == fired,
                        "decode survived a fault that fired"
                    );
                    for (k, o) in alive.iter().zip(out) {
                        got[*k].extend(o);
                    }
                }
                Err(err) => {
                    assert!(
                        arm && faulty.fired() == fired + 1,
                        "unexpected decode error {}",
                        err.chain()
                    );
                    for &k in &alive {
                        lost.insert(k, err.chain());
                    }
                }
            }
        }
        for (k, t) in step.iter().enumerate() {
            if !lost.contains_key(&k) {
                toks[k].push(*t);
            }
        }
    }
    assert!(
        lost.len() > 2,
        "the decode fault was armed but no read happened: pick another seed"
    );

    // Survivors: bit-identical to the clean run, every position.
    for k in 0..n_seq {
        if !lost.contains_key(&k) {
            assert!(
                same_bits(&got[k], &want[k]),
                "sequence {k} differs from the clean run"
            );
        }
    }
    // Lost sequences are refused, not silently wrong.
    for &k in lost.keys() {
        let mut hw = vec![0f32; w];
        assert!(
            e.prefill(ids[k], &[1], &mut hw).is_err(),
            "sequence {k} was lost"
        );
    }
    check_tables(&hurt.tables, gpu.as_ref());

    // Retry: release the lost sequences and run their whole token lists
    // again from scratch; the outputs are the clean ones.
    let mut retried: Vec<usize> = lost.keys().copied().collect();
    retried.sort();
    for &k in &retried {
        e.release(ids[k]).unwrap();
        let all: Vec<u32> = prompts[k]
            .iter()
            .chain(steps.iter().map(|s| &s[k]))
            .copied()
            .collect();
        let id = e.add_sequence(&all).unwrap().id;
        let out = prefill(e, id, &all).unwrap();
        assert!(
            same_bits(&out, &want[k]),
            "retried sequence {k} differs from the clean run"
        );
        e.release(id).unwrap();
    }
    for (k, &id) in ids.iter().enumerate() {
        if !lost.contains_key(&k) {
            e.release(id).unwrap();
        }
    }
    check_tables(&hurt.tables, gpu.as_ref());

    let Rig { engine, tables } = hurt;
    engine.close().unwrap();
    drop(tables);
    let Rig { engine, tables } = clean;
    engine.close().unwrap();
    drop(tables);
    assert_eq!(gpu.live_alloc_count(), base, "{}", gpu.live_report());
}

/// A sequence lost to a read fault gives its budget charge back with its
/// device memory, so preemption never picks it (it cannot be swapped out).
/// Found by `metrale-ple soak` once it ran under a device budget.
#[test]
fn a_lost_sequence_leaves_the_budget_and_is_never_preempted() {
    let gpu: Arc<dyn GpuBackend> = Arc::new(CpuBackend::new());
    let base = gpu.live_alloc_count();
    let dir = tempfile::tempdir().unwrap();
    let faulty = Arc::new(FaultyReader::new());
    let mut rig = rig_with_budget(&gpu, dir.path(), Some(faulty.clone()), Some(2));
    let e = &mut rig.engine;
    let carry = e.carry_bytes();
    let toks: Vec<u32> = (1..=12).collect();

    let a = e.add_sequence(&toks).unwrap().id;
    prefill(e, a, &toks).unwrap();
    let b = e.add_sequence(&toks).unwrap().id;
    faulty.arm(Fault::Eio);
    // Other rows than `a`'s, so the read really happens.
    let other: Vec<u32> = (500..512).collect();
    let err = prefill(e, b, &other).unwrap_err();
    assert!(
        faulty.fired() > 0,
        "the fault did not fire: {}",
        err.chain()
    );
    assert_eq!(
        e.stats().budget.used_bytes,
        carry,
        "the lost carry is still charged"
    );

    // Two more sequences: the second needs a preemption, and the victim
    // must be `a` (resident), never `b` (lost).
    let c = e.add_sequence(&toks).unwrap().id;
    prefill(e, c, &toks).unwrap();
    let d = e.add_sequence(&toks).unwrap().id;
    prefill(e, d, &toks).unwrap();
    assert_eq!(e.stats().preemptions, 1);
    assert!(!e.is_resident(a).unwrap());
    assert!(e.stats().budget.used_bytes <= 2 * carry);
    let err = prefill(e, b, &toks).unwrap_err();
    assert!(
        matches!(err, EngineError::Lost { seq, .. } if seq == b),
        "{}",
        err.chain()
    );

    // `a` comes back (preempting another), `b` is released.
    let hist = e.tokens(a).unwrap().to_vec();
    decode(e, &[a], &[&hist], &[7]).unwrap();
    e.release(b).unwrap();
    for id in [a, c, d] {
        e.release(id).unwrap();
    }
    assert_eq!(e.stats().budget.used_bytes, 0);
    check_tables(&rig.tables, gpu.as_ref());
    rig.engine.close().unwrap();
    drop(rig.tables);
    assert_eq!(gpu.live_alloc_count(), base, "{}", gpu.live_report());
}
