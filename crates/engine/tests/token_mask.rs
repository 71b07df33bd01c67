//! Token masks through the engine (DeepSeek-V4.1's `token_mask`, `true`:
//! masked): a masked prefill, chunked any way, and masked decode, eager or
//! with decode graphs, give the rows of the layer's own masked forward over
//! the whole sequence bit for bit; the prefix cache never hands a masked
//! sequence's carry to another sequence, and a masked sequence restores a
//! cached prefix only up to its first masked token; a masked sequence's
//! snapshot round-trips; every family whose published layer has no mask,
//! and a mask of the wrong length, is refused with nothing run.

use std::sync::Arc;

use metrale_engine::ple_site::PleSite;
use metrale_engine::{Engine, EngineConfig, EngineError, SwapTarget};
use metrale_gpu_runtime::cpu::CpuBackend;
use metrale_gpu_runtime::gpu::GpuBackend;
use metrale_model_layers::layers::ple::ForwardContext;
use metrale_testkit::drive::reference_run;
use metrale_testkit::families::{TinyFamily, family_engine};
use metrale_testkit::rows::rows_for;
use metrale_testkit::tiny::{TinySpec, tiny_engine};

const MAX_TOKENS: usize = 16;

/// Every site's layer applied to `tokens` with `masked` from a fresh carry,
/// one masked forward per site over the whole sequence (the layer chunks
/// it itself): the output rows.
fn layer_masked_run(
    sites: &[PleSite],
    gpu: &dyn GpuBackend,
    tokens: &[u32],
    masked: &[bool],
) -> Vec<f32> {
    let g = sites[0].layer().spec().clone();
    let width = g.hc_mult * g.hidden;
    let rows = rows_for(tokens, 0, tokens.len(), width);
    let bytes: Vec<u8> = rows.iter().flat_map(|v| v.to_le_bytes()).collect();
    let hw = gpu.alloc(bytes.len(), "reference highway").unwrap();
    gpu.copy_h2d(&bytes, hw).unwrap();
    for s in sites {
        let layer = s.layer();
        let mut st = layer.new_seq_state(gpu).unwrap();
        let ctx = ForwardContext::new(gpu)
            .with_host_ids(tokens)
            .with_masked(masked);
        layer
            .forward(&mut st, hw, tokens.len(), true, &ctx, 0)
            .unwrap();
        layer.release_seq_state(&mut st, gpu).unwrap();
    }
    let mut back = vec![0u8; bytes.len()];
    gpu.copy_d2h_on_stream(hw, &mut back, 0).unwrap();
    gpu.free(hw).unwrap();
    back.chunks_exact(4)
        .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
        .collect()
}

fn v41_engine(gpu: &Arc<dyn GpuBackend>, cfg: EngineConfig) -> Engine<PleSite> {
    family_engine(gpu, TinyFamily::EngramV41, 21, MAX_TOKENS, cfg).unwrap()
}

fn cached_cfg() -> EngineConfig {
    EngineConfig {
        prefill_chunk: 5,
        block_size: 4,
        prefix_cache_bytes: 1 << 20,
        ..Default::default()
    }
}

fn tokens(n: usize) -> Vec<u32> {
    (0..n as u32).map(|i| 3 + (i * 7) % 31).collect()
}

fn mask_at(n: usize, at: &[usize]) -> Vec<bool> {
    (0..n).map(|i| at.contains(&i)).collect()
}

/// Rows of token `i` of `rows` (width `w`).
fn row(rows: &[f32], i: usize, w: usize) -> &[f32] {
    &rows[i * w..(i + 1) * w]
}

#[test]
fn masked_prefill_gives_the_layers_masked_forward_however_it_is_chunked() {
    let gpu: Arc<dyn GpuBackend> = Arc::new(CpuBackend::new());
    let base = gpu.live_alloc_count();
    let mut e = v41_engine(&gpu, cached_cfg());
    let w = e.width();
    let toks = tokens(23);
    let masked = mask_at(23, &[3, 9, 10, 17]);
    let want = layer_masked_run(e.sites(), gpu.as_ref(), &toks, &masked);
    let plain = reference_run(e.sites(), gpu.as_ref(), &toks);
    let input = rows_for(&toks, 0, toks.len(), w);
    for (i, _) in masked.iter().enumerate().filter(|(_, m)| **m) {
        // A shut gate leaves the highway rows as they were.
        assert!(row(&want, i, w) == row(&input, i, w), "token {i}");
    }
    // The mask matters: past a masked token the look-back differs.
    assert!(row(&want, 11, w) != row(&plain, 11, w));
    assert!(row(&want, 2, w) == row(&plain, 2, w));

    // Whole, and split at every kind of place: before, on and after a
    // masked token, across block boundaries and prefill chunks.
    for splits in [vec![], vec![1, 9], vec![3, 4, 10, 11, 18], vec![10, 17, 22]] {
        let added = e.add_sequence_masked(&toks, &masked).unwrap();
        assert_eq!(added.cached, 0, "nothing masked is ever cached");
        let id = added.id;
        let mut got = Vec::new();
        let mut from = 0;
        for to in splits.iter().copied().chain([toks.len()]) {
            let mut r = rows_for(&toks, from, to, w);
            e.prefill_masked(id, &toks[from..to], &masked[from..to], &mut r)
                .unwrap();
            got.extend_from_slice(&r);
            from = to;
        }
        assert!(got == want, "splits {splits:?}");
        e.release(id).unwrap();
    }
    e.close().unwrap();
    assert_eq!(gpu.live_alloc_count(), base, "{}", gpu.live_report());
}

/// Masked decode, eager and with decode graphs, in a batch beside an
/// unmasked sequence: each gives its whole masked run's rows; masked steps
/// run eagerly, the others replay.
#[test]
fn masked_decode_gives_the_layers_masked_forward_eager_and_with_graphs() {
    for graphs in [false, true] {
        let gpu: Arc<dyn GpuBackend> = Arc::new(CpuBackend::new());
        let base = gpu.live_alloc_count();
        let mut e = v41_engine(&gpu, cached_cfg());
        if graphs {
            e.enable_decode_graphs().unwrap();
        }
        let w = e.width();
        let all = tokens(20);
        let prompt = 7;
        let a_mask = mask_at(all.len(), &[2, 9, 13]);
        let want_a = layer_masked_run(e.sites(), gpu.as_ref(), &all, &a_mask);
        let want_b = reference_run(e.sites(), gpu.as_ref(), &all);
        let a = e
            .add_sequence_masked(&all[..prompt], &a_mask[..prompt])
            .unwrap()
            .id;
        let b = e.add_sequence(&all[..prompt]).unwrap().id;
        let mut r = rows_for(&all, 0, prompt, w);
        e.prefill_masked(a, &all[..prompt], &a_mask[..prompt], &mut r)
            .unwrap();
        assert!(r == want_a[..prompt * w]);
        let mut r = rows_for(&all, 0, prompt, w);
        e.prefill(b, &all[..prompt], &mut r).unwrap();
        for t in prompt..all.len() {
            let mut rows = rows_for(&all, t, t + 1, w);
            rows.extend(rows_for(&all, t, t + 1, w));
            e.decode_masked(&[(a, all[t]), (b, all[t])], &[a_mask[t], false], &mut rows)
                .unwrap();
            assert!(row(&rows, 0, w) == row(&want_a, t, w), "{graphs}: a, {t}");
            assert!(row(&rows, 1, w) == row(&want_b, t, w), "{graphs}: b, {t}");
        }
        let s = e.stats();
        if graphs {
            // Steps 9 and 13 hold a masked token; the other 11 replay.
            assert_eq!((s.masked_eager_steps, s.graph_replays), (2, 11), "{s:#?}");
        } else {
            assert_eq!((s.masked_eager_steps, s.graph_replays), (0, 0), "{s:#?}");
        }
        e.release(a).unwrap();
        e.release(b).unwrap();
        e.close().unwrap();
        assert_eq!(gpu.live_alloc_count(), base, "{}", gpu.live_report());
    }
}

/// The prefix cache keys carries by tokens: a masked sequence caches no
/// boundary, so an unmasked sequence with the same tokens restores nothing
/// of it; a masked sequence restores an unmasked sequence's cached prefix
/// up to its first masked token only.
#[test]
fn the_prefix_cache_never_hands_a_masked_carry_to_another_sequence() {
    let gpu: Arc<dyn GpuBackend> = Arc::new(CpuBackend::new());
    let base = gpu.live_alloc_count();
    let mut e = v41_engine(&gpu, cached_cfg());
    let w = e.width();
    let toks = tokens(18);
    let masked = mask_at(toks.len(), &[1]);
    let id = e.add_sequence_masked(&toks, &masked).unwrap().id;
    let mut r = rows_for(&toks, 0, toks.len(), w);
    e.prefill_masked(id, &toks, &masked, &mut r).unwrap();
    // Boundaries 4, 8, 12 and 16 come after the masked token.
    assert_eq!(e.stats().masked_boundaries_skipped, 4);
    assert_eq!(e.stats().prefix_cache.entries, 0);
    // Decoded tokens of a masked sequence are not cached either.
    let mut d = rows_for(&toks, 17, 18, w);
    for t in [5u32, 6] {
        e.decode(&[(id, t)], &mut d).unwrap();
    }
    assert_eq!(e.stats().masked_boundaries_skipped, 5);
    e.release(id).unwrap();

    // The same tokens unmasked: nothing to restore, the plain rows.
    let plain = e.add_sequence(&toks).unwrap();
    assert_eq!(plain.cached, 0);
    let mut r = rows_for(&toks, 0, toks.len(), w);
    e.prefill(plain.id, &toks, &mut r).unwrap();
    assert!(r == reference_run(e.sites(), gpu.as_ref(), &toks));
    assert_eq!(e.stats().prefix_cache.entries, 4);
    e.release(plain.id).unwrap();

    // Now the cache holds the unmasked boundaries 4..=16: a masked sequence
    // restores up to its first masked token, never past it.
    for (first, cached) in [(0, 0), (3, 0), (4, 4), (9, 8), (16, 16)] {
        let masked = mask_at(toks.len(), &[first, 17]);
        let added = e.add_sequence_masked(&toks, &masked).unwrap();
        assert_eq!(added.cached, cached, "first masked {first}");
        let c = added.cached;
        let mut r = rows_for(&toks, c, toks.len(), w);
        e.prefill_masked(added.id, &toks[c..], &masked[c..], &mut r)
            .unwrap();
        let want = layer_masked_run(e.sites(), gpu.as_ref(), &toks, &masked);
        assert!(r == want[c * w..], "first masked {first}");
        e.release(added.id).unwrap();
    }
    // An all-clear mask is no mask: the whole cached prefix is usable.
    let clear = vec![false; toks.len()];
    assert_eq!(e.add_sequence_masked(&toks, &clear).unwrap().cached, 16);
    e.close().unwrap();
    assert_eq!(gpu.live_alloc_count(), base, "{}", gpu.live_report());
}

/// Swap and snapshots carry a masked sequence unchanged; its snapshot is
/// added back with its mask, and refused without it while the masked
/// token is in the history's reach.
#[test]
fn a_masked_carry_swaps_and_snapshots_unchanged() {
    let gpu: Arc<dyn GpuBackend> = Arc::new(CpuBackend::new());
    let base = gpu.live_alloc_count();
    let dir = tempfile::tempdir().unwrap();
    let cfg = EngineConfig {
        swap_dir: Some(dir.path().to_path_buf()),
        ..cached_cfg()
    };
    let mut e = v41_engine(&gpu, cfg);
    let w = e.width();
    let toks = tokens(16);
    let masked = mask_at(toks.len(), &[5, 10]);
    let want = layer_masked_run(e.sites(), gpu.as_ref(), &toks, &masked);
    let head = 11;
    for (target, cached) in [(SwapTarget::Host, 0), (SwapTarget::File, 4)] {
        // The boundary at 4 comes before the first masked token, so the
        // first sequence cached it and the second restores it.
        let added = e
            .add_sequence_masked(&toks[..head], &masked[..head])
            .unwrap();
        assert_eq!(added.cached, cached, "{target:?}");
        let id = added.id;
        let mut r = rows_for(&toks, cached, head, w);
        e.prefill_masked(id, &toks[cached..head], &masked[cached..head], &mut r)
            .unwrap();
        assert!(r == want[cached * w..head * w], "{target:?}");
        let snap = e.snapshot(id).unwrap();
        e.swap_out(id, target).unwrap();
        e.swap_in(id).unwrap();
        let mut r = rows_for(&toks, head, toks.len(), w);
        e.prefill_masked(id, &toks[head..], &masked[head..], &mut r)
            .unwrap();
        assert!(r == want[head * w..], "{target:?}");
        e.release(id).unwrap();

        // Token 10 is within the history's reach at 11 tokens.
        let refused = e.add_from_snapshot(&snap, &toks[..head]);
        assert!(
            matches!(refused, Err(EngineError::HistoryMismatch { .. })),
            "{refused:?}"
        );
        let id = e
            .add_from_snapshot_masked(&snap, &toks[..head], &masked[..head])
            .unwrap();
        let mut r = rows_for(&toks, head, toks.len(), w);
        e.prefill(id, &toks[head..], &mut r).unwrap();
        assert!(r == want[head * w..], "{target:?}: from the snapshot");
        e.release(id).unwrap();
    }
    // Only the boundary before the first masked token reached the cache.
    assert_eq!(e.stats().prefix_cache.entries, 1);
    e.close().unwrap();
    assert_eq!(gpu.live_alloc_count(), base, "{}", gpu.live_report());
    assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0);
}

/// A refused call changed nothing: the sequence's next tokens give the
/// plain sequential rows.
fn runs_on_unchanged(e: &mut Engine<PleSite>, gpu: &dyn GpuBackend, id: u64, prompt: &[u32]) {
    let w = e.width();
    let mut all = prompt.to_vec();
    all.push(13);
    let mut r = rows_for(&all, all.len() - 1, all.len(), w);
    e.decode(&[(id, 13)], &mut r).unwrap();
    let want = reference_run(e.sites(), gpu, &all);
    assert!(r == want[(all.len() - 1) * w..]);
}

#[test]
fn families_without_a_token_mask_refuse_one_by_name() {
    type Make = Box<dyn Fn(&Arc<dyn GpuBackend>) -> Engine<PleSite>>;
    let cases: [(&str, Make); 3] = [
        (
            "Engram demo",
            Box::new(|g| {
                family_engine(g, TinyFamily::EngramConv, 3, MAX_TOKENS, cached_cfg()).unwrap()
            }),
        ),
        (
            "LongCat",
            Box::new(|g| {
                family_engine(g, TinyFamily::LongCat, 3, MAX_TOKENS, cached_cfg()).unwrap()
            }),
        ),
        (
            "Qwen4-Exp",
            Box::new(|g| tiny_engine(g, &TinySpec::default(), 2, 3, cached_cfg()).unwrap()),
        ),
    ];
    for (name, make) in cases {
        let gpu: Arc<dyn GpuBackend> = Arc::new(CpuBackend::new());
        let base = gpu.live_alloc_count();
        let mut e = make(&gpu);
        let w = e.width();
        let prompt = [7u32, 8, 9, 10, 11];
        let check = |what: &str, r: Result<(), EngineError>| match &r {
            Err(err @ EngineError::TokenMaskUnsupported { site, family, .. }) => {
                assert_eq!((*site, *family), (0, name), "{what}");
                let msg = err.to_string();
                assert!(msg.contains(name), "{what}: {msg}");
            }
            other => panic!("{name} {what}: {other:?}"),
        };
        // Even an all-clear mask: the site cannot take one at all.
        check(
            "add_sequence_masked",
            e.add_sequence_masked(&prompt, &[false; 5]).map(|_| ()),
        );
        assert_eq!(e.stats().sequences, 0);
        let id = e.add_sequence(&prompt).unwrap().id;
        let mut scratch = rows_for(&prompt, 0, prompt.len(), w);
        check(
            "prefill_masked",
            e.prefill_masked(
                id,
                &prompt,
                &[false, true, false, false, false],
                &mut scratch,
            ),
        );
        assert!(e.tokens(id).unwrap().is_empty());
        let mut rows = rows_for(&prompt, 0, prompt.len(), w);
        e.prefill(id, &prompt, &mut rows).unwrap();
        let mut one = vec![0.5f32; w];
        check(
            "decode_masked",
            e.decode_masked(&[(id, 12)], &[true], &mut one),
        );
        let snap = e.snapshot(id).unwrap();
        check(
            "add_from_snapshot_masked",
            e.add_from_snapshot_masked(&snap, &prompt, &[false; 5])
                .map(|_| ()),
        );
        runs_on_unchanged(&mut e, gpu.as_ref(), id, &prompt);
        e.release(id).unwrap();
        e.close().unwrap();
        assert_eq!(gpu.live_alloc_count(), base, "{}", gpu.live_report());
    }
}

#[test]
fn a_mask_of_the_wrong_length_is_refused_with_nothing_run() {
    let gpu: Arc<dyn GpuBackend> = Arc::new(CpuBackend::new());
    let mut e = v41_engine(&gpu, cached_cfg());
    let w = e.width();
    let prompt = [7u32, 8, 9, 10, 11];
    let r = e.add_sequence_masked(&prompt, &[true; 4]);
    assert!(
        matches!(
            r,
            Err(EngineError::MaskSize {
                flags: 4,
                tokens: 5,
                ..
            })
        ),
        "{r:?}"
    );
    let id = e.add_sequence(&prompt).unwrap().id;
    let mut scratch = rows_for(&prompt, 0, prompt.len(), w);
    let r = e.prefill_masked(id, &prompt, &[true; 6], &mut scratch);
    assert!(
        matches!(r, Err(EngineError::MaskSize { flags: 6, .. })),
        "{r:?}"
    );
    assert!(e.tokens(id).unwrap().is_empty());
    let mut rows = rows_for(&prompt, 0, prompt.len(), w);
    e.prefill(id, &prompt, &mut rows).unwrap();
    let mut one = vec![0.5f32; w];
    let r = e.decode_masked(&[(id, 12)], &[], &mut one);
    assert!(
        matches!(r, Err(EngineError::MaskSize { flags: 0, .. })),
        "{r:?}"
    );
    runs_on_unchanged(&mut e, gpu.as_ref(), id, &prompt);
    e.close().unwrap();
}
