//! The engine's bookkeeping over a toy site (see `common/toy.rs`): the
//! randomised drive against sequential runs, every acceptance length of a
//! verify on a fresh sequence, and refusals that change nothing.

use std::sync::Arc;

use metrale_engine::snapshot::SnapshotError;
use metrale_engine::{Engine, EngineConfig, EngineError, SwapTarget};
use metrale_gpu_runtime::cpu::CpuBackend;
use metrale_gpu_runtime::gpu::GpuBackend;
use metrale_testkit::drive::{drive, reference_run};
use metrale_testkit::rows::rows_for;
use metrale_testkit::toy::ToySite;

fn engine(gpu: &Arc<dyn GpuBackend>, cfg: EngineConfig) -> Engine<ToySite> {
    let sites = vec![ToySite::new(8, 2, 0, 16), ToySite::new(8, 2, 1, 16)];
    Engine::new(gpu.clone(), sites, cfg).unwrap()
}

#[test]
fn randomised_drive_matches_sequential_runs() {
    let gpu: Arc<dyn GpuBackend> = Arc::new(CpuBackend::new());
    let base = gpu.live_alloc_count();
    let dir = tempfile::tempdir().unwrap();
    let probe = engine(
        &gpu,
        EngineConfig {
            prefill_chunk: 5,
            ..Default::default()
        },
    );
    let carry = probe.carry_bytes();
    let snap_bytes = 48 + 16 + 2 * probe.geometries()[0].aux_blob_len() + 4;
    probe.close().unwrap();
    let cfg = EngineConfig {
        prefill_chunk: 5,
        block_size: 4,
        prefix_cache_bytes: 12 * snap_bytes,
        device_budget_bytes: 6 * carry,
        preempt_to: SwapTarget::File,
        swap_dir: Some(dir.path().to_path_buf()),
    };
    let mut e = engine(&gpu, cfg);
    let ex = drive(&mut e, 7, 4000, 14, 6);
    let s = e.stats();
    eprintln!("{ex:?}\n{s:#?}");
    assert!(ex.added >= 200, "only {} sequences", ex.added);
    assert!(
        ex.accept_lengths[..7].iter().all(|&n| n > 0),
        "{:?}",
        ex.accept_lengths
    );
    assert!(s.prefix_hits > 0 && s.preemptions > 0 && s.swap_ins > 0);
    assert!(s.prefix_cache.evictions > 0);
    assert_eq!(s.sequences, 0);
    assert_eq!(s.budget.used_bytes, 0);
    e.close().unwrap();
    assert_eq!(gpu.live_alloc_count(), base, "{}", gpu.live_report());
    assert_eq!(
        std::fs::read_dir(dir.path()).unwrap().count(),
        0,
        "swap files left"
    );
}

#[test]
fn verify_on_a_fresh_sequence_every_acceptance_length() {
    let gpu: Arc<dyn GpuBackend> = Arc::new(CpuBackend::new());
    let base = gpu.live_alloc_count();
    let mut e = engine(
        &gpu,
        EngineConfig {
            prefill_chunk: 4,
            prefix_cache_bytes: 0,
            ..Default::default()
        },
    );
    let w = e.width();
    let draft = [5u32, 0, 7, 9, 9, 3];
    for accepted in 0..=draft.len() {
        let id = e.add_sequence(&[1]).unwrap().id;
        let mut rows = rows_for(&draft, 0, draft.len(), w);
        e.verify(id, &draft, &mut rows).unwrap();
        e.commit(id, accepted).unwrap();
        assert_eq!(e.tokens(id).unwrap(), &draft[..accepted]);
        // Continue with two more tokens; the result must be as if only the
        // accepted ones had run.
        let mut all = draft[..accepted].to_vec();
        all.extend_from_slice(&[11, 12]);
        let mut more = rows_for(&all, accepted, all.len(), w);
        e.prefill(id, &[11, 12], &mut more).unwrap();
        let want = reference_run(e.sites(), gpu.as_ref(), &all);
        assert_eq!(more, want[accepted * w..], "accepted {accepted}");
        if accepted > 0 {
            assert_eq!(rows[..accepted * w], want[..accepted * w]);
        }
        e.release(id).unwrap();
    }
    e.close().unwrap();
    assert_eq!(gpu.live_alloc_count(), base);
}

#[test]
fn refusals_change_nothing() {
    let gpu: Arc<dyn GpuBackend> = Arc::new(CpuBackend::new());
    let base = gpu.live_alloc_count();
    let mut e = engine(
        &gpu,
        EngineConfig {
            prefill_chunk: 4,
            ..Default::default()
        },
    );
    let w = e.width();
    let toks = [3u32, 4, 5];
    let id = e.add_sequence(&toks).unwrap().id;
    let mut rows = rows_for(&toks, 0, 3, w);
    e.prefill(id, &toks, &mut rows).unwrap();
    let snap = e.snapshot(id).unwrap();
    let before = (e.stats(), gpu.live_alloc_count(), gpu.live_bytes());
    let same = |e: &Engine<ToySite>| {
        let now = (e.stats(), gpu.live_alloc_count(), gpu.live_bytes());
        assert_eq!(now, before);
    };

    // Another geometry: an engine whose second site hashes differently.
    let other = Engine::new(
        gpu.clone(),
        vec![ToySite::new(8, 2, 0, 16), ToySite::new(8, 2, 5, 16)],
        EngineConfig {
            prefill_chunk: 4,
            ..Default::default()
        },
    )
    .unwrap();
    let mut other = other;
    let err = other.add_from_snapshot(&snap, &toks).unwrap_err();
    assert!(matches!(
        err,
        EngineError::Snapshot(SnapshotError::GeometryMismatch { .. })
    ));
    assert!(
        err.to_string()
            .starts_with("snapshot is for another geometry"),
        "{err}"
    );
    assert_eq!(other.stats().sequences, 0);
    other.close().unwrap();
    same(&e);

    let err = e
        .add_from_snapshot(&snap[..snap.len() - 3], &toks)
        .unwrap_err();
    assert!(err.to_string().starts_with("snapshot truncated"), "{err}");
    let mut bad = snap.clone();
    bad[100] ^= 2;
    let err = e.add_from_snapshot(&bad, &toks).unwrap_err();
    assert!(
        err.to_string().starts_with("snapshot corrupted: CRC32"),
        "{err}"
    );
    let mut newer = snap.clone();
    newer[8] = 2;
    let err = e.add_from_snapshot(&newer, &toks).unwrap_err();
    assert!(
        err.to_string()
            .starts_with("snapshot format version 2 is newer"),
        "{err}"
    );
    let err = e.add_from_snapshot(&snap, &toks[..2]).unwrap_err();
    assert_eq!(
        err.to_string(),
        "snapshot holds the carry of 3 tokens, 2 tokens given"
    );
    let err = e.add_from_snapshot(&snap, &[3, 9, 5]).unwrap_err();
    assert_eq!(
        err.to_string(),
        "snapshot history of site 0 is [4, 5], but the tokens given end in [9, 5]"
    );
    same(&e);
    // The good one is accepted, and continues like the original.
    let copy = e.add_from_snapshot(&snap, &toks).unwrap();
    let all = [3u32, 4, 5, 6];
    let mut a = rows_for(&all, 3, 4, w);
    let mut b = a.clone();
    e.prefill(id, &[6], &mut a).unwrap();
    e.prefill(copy, &[6], &mut b).unwrap();
    assert_eq!(a, b);
    e.release(copy).unwrap();
    let before = (e.stats(), gpu.live_alloc_count(), gpu.live_bytes());
    let same = |e: &Engine<ToySite>| {
        let now = (e.stats(), gpu.live_alloc_count(), gpu.live_bytes());
        assert_eq!(now, before);
    };
    same(&e);

    let mut r1 = rows_for(&[1], 0, 1, w);
    let err = e.prefill(id, &[1, 2], &mut r1).unwrap_err();
    assert!(
        matches!(
            err,
            EngineError::HighwaySize {
                op: "prefill",
                rows,
                tokens: 2,
                width
            } if rows == w && width == w
        ),
        "{err}"
    );
    let mut r2 = vec![0f32; 2 * w];
    let err = e.decode(&[(id, 1), (id, 2)], &mut r2).unwrap_err();
    assert_eq!(
        err.to_string(),
        format!("decode: sequence {id} appears twice in one batch")
    );
    let err = e.decode(&[(99, 1)], &mut r1).unwrap_err();
    assert_eq!(err.to_string(), "no sequence 99");
    let err = e.commit(id, 0).unwrap_err();
    assert_eq!(
        err.to_string(),
        format!("commit: sequence {id} has no pending verify")
    );
    same(&e);
    let fresh = e.add_sequence(&[9]).unwrap().id;
    let before_fresh = (gpu.live_alloc_count(), e.tokens(fresh).unwrap().len());
    let err = e.decode(&[(fresh, 1)], &mut r1).unwrap_err();
    assert_eq!(
        err.to_string(),
        format!("decode: sequence {fresh} has run no token; prefill it first")
    );
    assert_eq!(before_fresh, (gpu.live_alloc_count(), 0));
    e.release(fresh).unwrap();

    let mut d = rows_for(&[3, 4, 5, 6, 6, 7], 4, 6, w);
    e.verify(id, &[6, 7], &mut d).unwrap();
    let err = e.prefill(id, &[1], &mut r1).unwrap_err();
    assert_eq!(
        err.to_string(),
        format!("prefill: sequence {id} has a pending verify; commit it first")
    );
    let err = e.commit(id, 3).unwrap_err();
    assert_eq!(
        err.to_string(),
        format!("commit: sequence {id} accepted 3 of 2 draft tokens")
    );
    e.commit(id, 2).unwrap();
    let err = e.swap_out(id, SwapTarget::File).unwrap_err();
    assert_eq!(
        err.to_string(),
        "swap to file: no swap directory configured"
    );
    let err = e.swap_in(id).unwrap_err();
    assert_eq!(
        err.to_string(),
        format!("swap_in: sequence {id} is resident")
    );
    e.swap_out(id, SwapTarget::Host).unwrap();
    let err = e.swap_out(id, SwapTarget::Host).unwrap_err();
    assert_eq!(
        err.to_string(),
        format!("swap_out: sequence {id} is already swapped out")
    );

    e.close().unwrap();
    assert_eq!(gpu.live_alloc_count(), base);
}

#[test]
fn a_batch_larger_than_the_budget_runs_in_parts() {
    let gpu: Arc<dyn GpuBackend> = Arc::new(CpuBackend::new());
    let base = gpu.live_alloc_count();
    let probe = engine(
        &gpu,
        EngineConfig {
            prefill_chunk: 4,
            ..Default::default()
        },
    );
    let carry = probe.carry_bytes();
    probe.close().unwrap();
    let mut e = engine(
        &gpu,
        EngineConfig {
            prefill_chunk: 4,
            device_budget_bytes: 2 * carry,
            ..Default::default()
        },
    );
    let w = e.width();
    let mut ids = Vec::new();
    for i in 0..5u32 {
        let id = e.add_sequence(&[i + 1]).unwrap().id;
        let mut r = rows_for(&[i + 1], 0, 1, w);
        e.prefill(id, &[i + 1], &mut r).unwrap();
        ids.push(id);
    }
    // Each add past the second preempted the oldest.
    assert!(!e.is_resident(ids[0]).unwrap());
    assert_eq!(e.stats().preemptions, 3);
    // Five sequences, room for two carries: the batch runs in parts of
    // two, swapping carries in and out, and every row is the sequential
    // run's.
    let mut r = Vec::new();
    for i in 0..5u32 {
        r.extend(rows_for(&[i + 1, 2], 1, 2, w));
    }
    let batch: Vec<(u64, u32)> = ids.iter().map(|&id| (id, 2)).collect();
    e.decode(&batch, &mut r).unwrap();
    for i in 0..5u32 {
        let want = reference_run(e.sites(), gpu.as_ref(), &[i + 1, 2]);
        let got = &r[i as usize * w..(i as usize + 1) * w];
        assert!(
            got.iter()
                .zip(&want[w..])
                .all(|(a, b)| a.to_bits() == b.to_bits()),
            "sequence {i} differs"
        );
    }
    let s = e.stats();
    assert!(s.budget.peak_bytes <= 2 * carry);
    assert_eq!(s.decode_tokens, 5);
    e.close().unwrap();
    assert_eq!(gpu.live_alloc_count(), base);
}

/// Block boundaries reached by decode are cached: a new sequence whose
/// prompt extends a conversation restores past its generated tokens, and
/// its outputs are the sequential run's.
#[test]
fn decode_boundaries_are_cached_for_the_next_turn() {
    let gpu: Arc<dyn GpuBackend> = Arc::new(CpuBackend::new());
    let base = gpu.live_alloc_count();
    let mut e = engine(
        &gpu,
        EngineConfig {
            prefill_chunk: 4,
            block_size: 4,
            ..Default::default()
        },
    );
    let w = e.width();
    let prompt = [5u32, 6, 7];
    let a = e.add_sequence(&prompt).unwrap().id;
    let mut r = rows_for(&prompt, 0, 3, w);
    e.prefill(a, &prompt, &mut r).unwrap();
    // Decode five tokens: the carry passes the boundaries at 4 and 8.
    let mut all = prompt.to_vec();
    for t in 20..25u32 {
        all.push(t);
        let mut r = rows_for(&all, all.len() - 1, all.len(), w);
        e.decode(&[(a, t)], &mut r).unwrap();
    }
    // The next turn: the conversation so far plus new tokens.
    let mut next = all.clone();
    next.extend([0u32, 9, 10]);
    let added = e.add_sequence(&next).unwrap();
    assert_eq!(added.cached, 8, "restored up to the last decode boundary");
    let rest = &next[added.cached..];
    let mut r = rows_for(&next, added.cached, next.len(), w);
    e.prefill(added.id, rest, &mut r).unwrap();
    let want = reference_run(e.sites(), gpu.as_ref(), &next);
    assert!(
        r.iter()
            .zip(&want[added.cached * w..])
            .all(|(x, y)| x.to_bits() == y.to_bits()),
        "restored continuation differs from the sequential run"
    );
    e.close().unwrap();
    assert_eq!(gpu.live_alloc_count(), base);
}
