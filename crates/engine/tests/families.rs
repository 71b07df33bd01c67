//! The engine over the Engram and LongCat layers (tiny configs, random
//! weights): every path a server drives (chunked prefill, batched decode
//! eager and from captured graphs, the prefix cache, swap to host and file,
//! speculative verify and commit of every length, release) gives the plain
//! sequential run's rows bit for bit, and each family carries what it
//! should: its history, and conv state only where it has a conv.

use std::sync::Arc;

use metrale_engine::ple_site::PleSite;
use metrale_engine::{Engine, EngineConfig, SwapTarget};
use metrale_gpu_runtime::cpu::CpuBackend;
use metrale_gpu_runtime::gpu::GpuBackend;
use metrale_model_layers::layers::ple::carry_blob;
use metrale_testkit::drive::{drive, reference_run};
use metrale_testkit::families::{TinyFamily, family_engine, family_site};
use metrale_testkit::rows::rows_for;

const MAX_TOKENS: usize = 16;

fn drive_case(family: TinyFamily, graphs: bool) {
    let gpu: Arc<dyn GpuBackend> = Arc::new(CpuBackend::new());
    let base = gpu.live_alloc_count();
    let dir = tempfile::tempdir().unwrap();
    let probe_cfg = EngineConfig {
        prefill_chunk: 5,
        ..Default::default()
    };
    let probe = family_engine(&gpu, family, 3, MAX_TOKENS, probe_cfg).unwrap();
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
    let cfg = EngineConfig {
        prefill_chunk: 5,
        block_size: 4,
        prefix_cache_bytes: 12 * snap_bytes,
        // Six resident carries when there is conv state to hold; a family
        // without it holds nothing on the device and is never preempted.
        device_budget_bytes: if carry > 0 { 6 * carry } else { usize::MAX },
        preempt_to: SwapTarget::File,
        swap_dir: Some(dir.path().to_path_buf()),
    };
    let mut e = family_engine(&gpu, family, 3, MAX_TOKENS, cfg).unwrap();
    if graphs {
        e.enable_decode_graphs().unwrap();
    }
    let ex = drive(&mut e, 17, 1500, 12, 6);
    let s = e.stats();
    if graphs {
        assert!(
            s.graph_replays > 50,
            "{family:?}: {} replays",
            s.graph_replays
        );
    } else {
        assert_eq!(s.graph_replays, 0);
    }
    assert!(ex.added >= 100, "{family:?}: only {} sequences", ex.added);
    assert!(
        ex.accept_lengths[..5].iter().all(|&n| n > 0),
        "{family:?}: {:?}",
        ex.accept_lengths
    );
    assert!(s.prefix_hits > 0 && s.swap_ins > 0, "{family:?}: {s:#?}");
    if carry > 0 {
        assert!(s.preemptions > 0, "{family:?}: {s:#?}");
    }
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
fn engram_with_conv_drives_like_the_sequential_run() {
    drive_case(TinyFamily::EngramConv, false);
}

#[test]
fn engram_with_conv_decode_graphs_drive_like_the_sequential_run() {
    drive_case(TinyFamily::EngramConv, true);
}

#[test]
fn engram_v41_drives_like_the_sequential_run() {
    drive_case(TinyFamily::EngramV41, false);
}

#[test]
fn engram_v41_decode_graphs_drive_like_the_sequential_run() {
    drive_case(TinyFamily::EngramV41, true);
}

#[test]
fn longcat_drives_like_the_sequential_run() {
    drive_case(TinyFamily::LongCat, false);
}

#[test]
fn longcat_decode_graphs_drive_like_the_sequential_run() {
    drive_case(TinyFamily::LongCat, true);
}

/// Each family's carry: its `N - 1` history tokens in every aux blob, and
/// conv state (on the device, freed by a swap-out) only with a conv.
#[test]
fn each_family_carries_its_history_and_only_its_own_conv_state() {
    for family in TinyFamily::ALL {
        let gpu: Arc<dyn GpuBackend> = Arc::new(CpuBackend::new());
        let base = gpu.live_alloc_count();
        let dir = tempfile::tempdir().unwrap();
        let cfg = EngineConfig {
            prefill_chunk: 8,
            swap_dir: Some(dir.path().to_path_buf()),
            ..Default::default()
        };
        let mut e = family_engine(&gpu, family, 9, MAX_TOKENS, cfg).unwrap();
        let g = family.spec();
        let conv = family == TinyFamily::EngramConv;
        for geo in e.geometries() {
            assert_eq!(geo.context_len(), g.ngram_size - 1, "{family:?}");
            let state = if conv { geo.conv_bytes() } else { 0 };
            assert_eq!(geo.conv_bytes(), state, "{family:?}");
            assert_eq!(
                geo.aux_blob_len(),
                carry_blob::blob_len(g.ngram_size - 1, state),
                "{family:?}"
            );
        }
        assert_eq!(e.carry_bytes() > 0, conv, "{family:?}");
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
                "{family:?}: swap-out frees exactly the conv state"
            );
            e.swap_in(id).unwrap();
            let mut r = rows_for(&toks, 20, 29, w);
            e.prefill(id, &toks[20..29], &mut r).unwrap();
            let want = reference_run(e.sites(), gpu.as_ref(), &toks[..29]);
            assert!(r == want[20 * w..], "{family:?} {target:?}");
            e.release(id).unwrap();
        }
        assert_eq!(e.stats().budget.used_bytes, 0);
        e.close().unwrap();
        assert_eq!(gpu.live_alloc_count(), base, "{}", gpu.live_report());
    }
}

/// A fresh backend, its live allocation count, and an engine of `family`
/// over it with 8-token prefill chunks and no prefix cache.
fn uncached_engine(family: TinyFamily) -> (Arc<dyn GpuBackend>, usize, Engine<PleSite>) {
    let gpu: Arc<dyn GpuBackend> = Arc::new(CpuBackend::new());
    let base = gpu.live_alloc_count();
    let cfg = EngineConfig {
        prefill_chunk: 8,
        prefix_cache_bytes: 0,
        ..Default::default()
    };
    let e = family_engine(&gpu, family, 5, MAX_TOKENS, cfg).unwrap();
    (gpu, base, e)
}

/// A verify of twelve drafts, then a commit of every length, then a dozen
/// decoded tokens: the rows stay the sequential run's, so nothing of a
/// rejected draft survives in the history (or the conv state).
#[test]
fn every_acceptance_length_keeps_only_the_accepted_tokens() {
    for family in TinyFamily::ALL {
        let (gpu, base, mut e) = uncached_engine(family);
        let w = e.width();
        let prompt = [7u32, 8, 9, 0, 10, 11, 12, 13, 14, 15, 16];
        let draft = [21u32, 22, 0, 23, 24, 25, 26, 27, 28, 29, 30, 31];
        for accepted in [0, 1, 2, 5, draft.len()] {
            let id = e.add_sequence(&prompt).unwrap().id;
            let mut rows = rows_for(&prompt, 0, prompt.len(), w);
            e.prefill(id, &prompt, &mut rows).unwrap();
            let mut ctx = prompt.to_vec();
            ctx.extend_from_slice(&draft);
            let mut d = rows_for(&ctx, prompt.len(), ctx.len(), w);
            e.verify(id, &draft, &mut d).unwrap();
            let full = reference_run(e.sites(), gpu.as_ref(), &ctx);
            assert!(d == full[prompt.len() * w..], "{family:?}: verify outputs");
            e.commit(id, accepted).unwrap();
            let mut all = ctx[..prompt.len() + accepted].to_vec();
            for t in 0..12u32 {
                all.push(33 + t % 7);
                let mut r = rows_for(&all, all.len() - 1, all.len(), w);
                e.decode(&[(id, 33 + t % 7)], &mut r).unwrap();
                let want = reference_run(e.sites(), gpu.as_ref(), &all);
                assert!(
                    r == want[(all.len() - 1) * w..],
                    "{family:?}: accepted {accepted}, step {t}"
                );
            }
            e.release(id).unwrap();
        }
        e.close().unwrap();
        assert_eq!(gpu.live_alloc_count(), base, "{}", gpu.live_report());
    }
}

/// A token at or above the family's vocabulary, at every entry point that
/// takes tokens (add, prefill, decode, verify), is refused with an error
/// naming the token and the bound, and the sequence it was meant for (and
/// every other) runs on as if the call had not been made.
#[test]
fn out_of_vocabulary_tokens_are_refused_at_every_entry_point() {
    for family in TinyFamily::ALL {
        let (gpu, base, mut e) = uncached_engine(family);
        let w = e.width();
        let bad = family.spec().vocab_size as u32;
        let expect_refusal = |what: &str, r: Result<(), metrale_engine::EngineError>| {
            let msg = format!("{:#}", r.expect_err(what));
            assert!(
                msg.contains(&bad.to_string()) && msg.contains("not below"),
                "{family:?} {what}: {msg}"
            );
        };
        let refused_add = e.add_sequence(&[1, bad]).map(|_| ());
        expect_refusal("add_sequence", refused_add);
        let prompt = [7u32, 8, 9, 10];
        let id = e.add_sequence(&prompt).unwrap().id;
        let mut rows = rows_for(&prompt, 0, prompt.len(), w);
        e.prefill(id, &prompt, &mut rows).unwrap();
        let mut scratch = vec![0.5f32; 2 * w];
        expect_refusal("prefill", e.prefill(id, &[11, bad], &mut scratch));
        expect_refusal("decode", e.decode(&[(id, bad)], &mut scratch[..w]));
        expect_refusal("verify", e.verify(id, &[12, bad], &mut scratch));
        // Nothing of the refused calls is left: the next tokens give the
        // sequential run's rows.
        let mut all = prompt.to_vec();
        for t in [13u32, 14, 15] {
            all.push(t);
            let mut r = rows_for(&all, all.len() - 1, all.len(), w);
            e.decode(&[(id, t)], &mut r).unwrap();
            let want = reference_run(e.sites(), gpu.as_ref(), &all);
            assert!(r == want[(all.len() - 1) * w..], "{family:?}: token {t}");
        }
        e.release(id).unwrap();
        e.close().unwrap();
        assert_eq!(gpu.live_alloc_count(), base, "{}", gpu.live_report());
    }
}

#[test]
fn only_the_v41_site_takes_a_token_mask_through_the_site_api() {
    use metrale_engine::{CarrySite, Site};
    use metrale_model_layers::layers::ple::{LayerError, PlanPart, SeqWork};

    let gpu: Arc<dyn GpuBackend> = Arc::new(CpuBackend::new());
    let g = gpu.as_ref();
    let base = g.live_alloc_count();
    for family in [
        TinyFamily::EngramV41,
        TinyFamily::EngramConv,
        TinyFamily::LongCat,
    ] {
        let mut site = family_site(&gpu, family, 0, 11, MAX_TOKENS).unwrap();
        let c = site.geometry().channels();
        let tokens = [3u32, 4, 5, 6];
        let rows: Vec<f32> = (0..tokens.len() * c).map(|i| i as f32 * 0.25).collect();
        let hw = g.alloc(rows.len() * 4, "test.highway").unwrap();
        let bytes: Vec<u8> = rows.iter().flat_map(|v| v.to_le_bytes()).collect();
        g.copy_h2d(&bytes, hw).unwrap();
        let mut st = site.new_state(g).unwrap();
        let masked = [true; 4];
        let r = site.plan(&[SeqWork::new(&[], &tokens).with_masked(&masked)]);
        if family == TinyFamily::EngramV41 {
            let plan = r.unwrap();
            let whole = PlanPart::whole(&plan, 0);
            site.run(&plan, whole, &mut st, hw, true, g, 0).unwrap();
            // Every gate shut: the highway comes back bit for bit.
            let mut back = vec![0u8; bytes.len()];
            g.copy_d2h(hw, &mut back).unwrap();
            assert_eq!(back, bytes);
            let history = site.history(&st).to_vec();
            let plan = site
                .plan(&[SeqWork::new(&history, &[7]).with_masked(&[true])])
                .unwrap();
            site.run_batch(&plan, &[0], &mut [&mut st], hw, g, 0)
                .unwrap();
        } else {
            let e = r.unwrap_err();
            let layer = e.downcast_ref::<LayerError>();
            assert!(
                matches!(layer, Some(LayerError::TokenMask(_))),
                "{family:?}: {e}"
            );
            assert!(
                site.plan(&[SeqWork::new(&[], &[7]).with_masked(&[false])])
                    .is_err()
            );
        }
        site.release(&mut st, g).unwrap();
        g.free(hw).unwrap();
        site.free(g).unwrap();
    }
    assert_eq!(g.live_alloc_count(), base);
}
