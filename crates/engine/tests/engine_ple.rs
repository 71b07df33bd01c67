//! The engine over real PLE layers (tiny geometry, random weights): the
//! randomised drive against plain sequential runs, bit for bit, every
//! acceptance length of a speculative commit, and a clean backend at the end.

use std::sync::Arc;

use metrale_engine::{EngineConfig, SwapTarget};
use metrale_gpu_runtime::cpu::CpuBackend;
use metrale_gpu_runtime::gpu::GpuBackend;
use metrale_testkit::drive::{drive, reference_run};
use metrale_testkit::rows::rows_for;
use metrale_testkit::tiny::{TinySpec, tiny_engine};

fn spec() -> TinySpec {
    TinySpec {
        max_tokens: 16,
        ..Default::default()
    }
}

#[test]
fn randomised_drive_matches_sequential_runs() {
    drive_case(false);
}

/// The same drive with every batched decode step replayed from a captured
/// graph: the outputs stay the sequential run's, bit for bit.
#[test]
fn randomised_drive_with_decode_graphs_matches_sequential_runs() {
    drive_case(true);
}

fn drive_case(graphs: bool) {
    let gpu: Arc<dyn GpuBackend> = Arc::new(CpuBackend::new());
    let base = gpu.live_alloc_count();
    let dir = tempfile::tempdir().unwrap();
    let probe = tiny_engine(
        &gpu,
        &spec(),
        2,
        3,
        EngineConfig {
            prefill_chunk: 5,
            ..Default::default()
        },
    )
    .unwrap();
    let carry = probe.carry_bytes();
    let snap_bytes = 48
        + 16
        + probe
            .geometries()
            .iter()
            .map(|g| g.aux_blob_len())
            .sum::<usize>()
        + 4;
    probe.close().unwrap();
    assert_eq!(gpu.live_alloc_count(), base, "{}", gpu.live_report());
    let cfg = EngineConfig {
        prefill_chunk: 5,
        block_size: 4,
        prefix_cache_bytes: 12 * snap_bytes,
        device_budget_bytes: 6 * carry,
        preempt_to: SwapTarget::File,
        swap_dir: Some(dir.path().to_path_buf()),
    };
    let mut e = tiny_engine(&gpu, &spec(), 2, 3, cfg).unwrap();
    if graphs {
        e.enable_decode_graphs().unwrap();
    }
    let ex = drive(&mut e, 11, 2500, 14, 6);
    let s = e.stats();
    if graphs {
        assert!(s.graph_replays > 100, "{} replays", s.graph_replays);
        // One capture per padded batch size: 1, 2, 4, 8 at most.
        assert!(
            (1..=4).contains(&s.graph_captures),
            "{} captures",
            s.graph_captures
        );
    } else {
        assert_eq!(s.graph_replays, 0);
    }
    eprintln!("{ex:?}\n{s:#?}");
    assert!(ex.added >= 200, "only {} sequences", ex.added);
    assert!(
        ex.accept_lengths[..7].iter().all(|&n| n > 0),
        "{:?}",
        ex.accept_lengths
    );
    assert!(s.prefix_hits > 0 && s.preemptions > 0 && s.swap_ins > 0);
    assert!(s.prefix_cache.evictions > 0);
    assert_eq!((s.sequences, s.budget.used_bytes), (0, 0));
    e.close().unwrap();
    assert_eq!(gpu.live_alloc_count(), base, "{}", gpu.live_report());
    assert_eq!(
        std::fs::read_dir(dir.path()).unwrap().count(),
        0,
        "swap files left"
    );
}

#[test]
fn every_acceptance_length_leaves_the_carry_of_the_accepted_tokens() {
    let gpu: Arc<dyn GpuBackend> = Arc::new(CpuBackend::new());
    let base = gpu.live_alloc_count();
    let cfg = EngineConfig {
        prefill_chunk: 8,
        prefix_cache_bytes: 0,
        ..Default::default()
    };
    let mut e = tiny_engine(&gpu, &spec(), 2, 5, cfg).unwrap();
    let w = e.width();
    let prompt = [7u32, 8, 9, 0, 10, 11, 12, 13, 14, 15, 16];
    let draft = [21u32, 22, 0, 23, 24, 25, 26, 27, 28, 29, 30, 31];
    for accepted in 0..=draft.len() {
        let id = e.add_sequence(&prompt).unwrap().id;
        let mut rows = rows_for(&prompt, 0, prompt.len(), w);
        e.prefill(id, &prompt, &mut rows).unwrap();
        let mut ctx = prompt.to_vec();
        ctx.extend_from_slice(&draft);
        let mut d = rows_for(&ctx, prompt.len(), ctx.len(), w);
        e.verify(id, &draft, &mut d).unwrap();
        let full = reference_run(e.sites(), gpu.as_ref(), &ctx);
        assert!(d == full[prompt.len() * w..], "verify outputs");
        e.commit(id, accepted).unwrap();
        // Continue for a dozen tokens (longer than the conv window, so any
        // rejected row left in the state would show) by decode.
        let mut all = ctx[..prompt.len() + accepted].to_vec();
        for t in 0..12u32 {
            all.push(40 + t);
            let mut r = rows_for(&all, all.len() - 1, all.len(), w);
            e.decode(&[(id, 40 + t)], &mut r).unwrap();
            let want = reference_run(e.sites(), gpu.as_ref(), &all);
            assert!(
                r == want[(all.len() - 1) * w..],
                "accepted {accepted}, step {t}"
            );
        }
        e.release(id).unwrap();
    }
    e.close().unwrap();
    assert_eq!(gpu.live_alloc_count(), base, "{}", gpu.live_report());
}

#[test]
fn swap_round_trip_continues_bit_identically() {
    let gpu: Arc<dyn GpuBackend> = Arc::new(CpuBackend::new());
    let base = gpu.live_alloc_count();
    let dir = tempfile::tempdir().unwrap();
    let cfg = EngineConfig {
        prefill_chunk: 8,
        swap_dir: Some(dir.path().to_path_buf()),
        ..Default::default()
    };
    let mut e = tiny_engine(&gpu, &spec(), 1, 9, cfg).unwrap();
    let w = e.width();
    let toks: Vec<u32> = (1..30).collect();
    for target in [SwapTarget::Host, SwapTarget::File] {
        let id = e.add_sequence(&toks[..20]).unwrap().id;
        let mut r = rows_for(&toks, 0, 20, w);
        e.prefill(id, &toks[..20], &mut r).unwrap();
        let live = gpu.live_bytes();
        e.swap_out(id, target).unwrap();
        assert_eq!(
            gpu.live_bytes(),
            live - e.carry_bytes(),
            "swap-out frees the carry"
        );
        e.swap_in(id).unwrap();
        let mut r = rows_for(&toks, 20, 29, w);
        e.prefill(id, &toks[20..29], &mut r).unwrap();
        let want = reference_run(e.sites(), gpu.as_ref(), &toks[..29]);
        assert!(r == want[20 * w..], "{target:?}");
        e.release(id).unwrap();
    }
    e.close().unwrap();
    assert_eq!(gpu.live_alloc_count(), base, "{}", gpu.live_report());
}

#[test]
fn snapshot_from_another_geometry_is_refused_and_changes_nothing() {
    let gpu: Arc<dyn GpuBackend> = Arc::new(CpuBackend::new());
    let base = gpu.live_alloc_count();
    let cfg = || EngineConfig {
        prefill_chunk: 8,
        ..Default::default()
    };
    let mut a = tiny_engine(&gpu, &spec(), 1, 2, cfg()).unwrap();
    let wide = TinySpec {
        hidden: 48,
        ..spec()
    };
    let mut b = tiny_engine(&gpu, &wide, 1, 2, cfg()).unwrap();
    let toks = [4u32, 5, 6, 7];
    let id = a.add_sequence(&toks).unwrap().id;
    let mut r = rows_for(&toks, 0, 4, a.width());
    a.prefill(id, &toks, &mut r).unwrap();
    let snap = a.snapshot(id).unwrap();
    let before = (b.stats(), gpu.live_alloc_count(), gpu.live_bytes());
    let err = b.add_from_snapshot(&snap, &toks).unwrap_err();
    assert_eq!(
        err.to_string(),
        format!(
            "snapshot is for another geometry: fingerprint {}, this engine is {} (PLE sites, hash constants or carry shape differ)",
            a.fingerprint(),
            b.fingerprint()
        )
    );
    assert_eq!(
        (b.stats(), gpu.live_alloc_count(), gpu.live_bytes()),
        before
    );
    // The same bytes restore into an engine of the same geometry.
    let copy = a.add_from_snapshot(&snap, &toks).unwrap();
    let all = [4u32, 5, 6, 7, 8];
    let mut x = rows_for(&all, 4, 5, a.width());
    let mut y = x.clone();
    a.prefill(id, &[8], &mut x).unwrap();
    a.prefill(copy, &[8], &mut y).unwrap();
    assert!(x == y);
    a.close().unwrap();
    b.close().unwrap();
    assert_eq!(gpu.live_alloc_count(), base, "{}", gpu.live_report());
}
