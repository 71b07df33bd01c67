//! A step as a value: a plan's ids are the reference hash's, bit for bit;
//! its rows staged into a caller's buffer are the table's; running a plan
//! (whole, in parts, batched eagerly, prestaged and captured in a graph)
//! gives the highways and carries of the forwards that plan for
//! themselves; a plan made for another carry is refused and changes
//! nothing. The staging test is what an engine with kernels of its own
//! does with the layer: plan and stage, nothing else.

mod layer_common;

use layer_common::{Fx, Rng, Small, bits, download, highway, tokens, upload, write};
use metrale_gpu_runtime::gpu::{GpuBackend, StreamId};
use metrale_model_layers::layers::ple::ids::ple_ngram_ids;
use metrale_model_layers::layers::ple::{
    ForwardContext, LayerError, PlanPart, PleLayer, PleSeqState, SeqWork,
};

/// The reference ids of `tokens` after `history` (EOS-padded to the
/// context), token-major.
fn reference_ids(small: &Small, history: &[u32], tokens: &[u32]) -> Vec<u64> {
    let ctxl = small.dims.context_len();
    let mut window = vec![small.dims.eos_token_id; ctxl.saturating_sub(history.len())];
    window.extend_from_slice(&history[history.len().saturating_sub(ctxl)..]);
    window.extend_from_slice(tokens);
    let rows = ple_ngram_ids(&small.dims, &window);
    rows[rows.len() - tokens.len()..]
        .iter()
        .flat_map(|r| r.iter().copied())
        .collect()
}

/// A GPU engine with kernels of its own plans a step and stages its rows
/// into a buffer it owns: the ids are the reference hash's, every id's
/// slot names its row, and the staged rows are the table's (BF16 widened
/// to f32), through several resolve parts.
#[test]
fn plan_and_stage_alone_give_the_hash_and_the_rows() {
    let fx = Fx::new(21, 5);
    let g = fx.g();
    let layer = fx.layer(4);
    let mut r = Rng(2);
    let histories = [
        Vec::new(),
        tokens(&mut r, 1, 40),
        tokens(&mut r, 9, 40),
        tokens(&mut r, 2, 40),
    ];
    let toks = [
        tokens(&mut r, 6, 40),
        tokens(&mut r, 1, 40),
        tokens(&mut r, 11, 40),
        Vec::new(),
    ];
    let work: Vec<SeqWork<'_>> = histories
        .iter()
        .zip(&toks)
        .map(|(h, t)| SeqWork::new(h, t))
        .collect();
    let plan = layer.plan(&work).unwrap();
    assert_eq!(plan.len(), 4);
    let mut want = Vec::new();
    for (i, (h, t)) in histories.iter().zip(&toks).enumerate() {
        let ids = reference_ids(&fx.small, h, t);
        assert_eq!(plan.seq_ids(i), ids.as_slice(), "sequence {i}");
        assert_eq!(plan.tokens(i), t.as_slice());
        want.extend(ids);
    }
    assert_eq!(plan.ids(), want.as_slice());
    let mut distinct = plan.distinct().to_vec();
    distinct.sort_unstable();
    distinct.dedup();
    assert_eq!(distinct.len(), plan.distinct().len(), "distinct ids repeat");
    let read: Vec<u64> = plan.reads().flatten().copied().collect();
    assert_eq!(
        read,
        plan.distinct(),
        "the reads cover the distinct ids once"
    );
    for (id, &slot) in plan.ids().iter().zip(plan.slots()) {
        assert_eq!(plan.distinct()[slot as usize], *id);
    }

    let hd = layer.row_dim();
    let n = plan.distinct().len();
    assert!(n > 5, "the staging runs in several resolve parts");
    let s = fx.s;
    let out = upload(g, &vec![f32::NAN; n * hd], "engine rows");
    layer.stage(&plan, out, g, s).unwrap();
    let rows = download(g, out, n * hd, s);
    for (i, &id) in plan.distinct().iter().enumerate() {
        let at = id as usize * fx.small.head_dim;
        let want: Vec<u32> = fx.small.table_bits[at..at + hd]
            .iter()
            .map(|&b| u32::from(b) << 16)
            .collect();
        assert_eq!(bits(&rows[i * hd..(i + 1) * hd]), want, "row of id {id}");
    }
    g.synchronize(s).unwrap();
    assert_eq!(fx.table.pinned(g), 0, "staging left rows pinned");
    g.free(out).unwrap();
    fx.finish(layer, Vec::new());
}

/// What forwards that plan for themselves give: a prefill of `pre`, then
/// `steps` batched decode steps over `seqs` sequences.
fn by_forward(
    layer: &PleLayer,
    g: &dyn GpuBackend,
    s: StreamId,
    pres: &[Vec<u32>],
    steps: &[Vec<u32>],
    hws: &[Vec<f32>],
) -> (Vec<u32>, Vec<Vec<u8>>) {
    let c = layer.channels();
    let mut out = Vec::new();
    let mut states: Vec<PleSeqState> = pres
        .iter()
        .map(|_| layer.new_seq_state(g).unwrap())
        .collect();
    for (st, pre) in states.iter_mut().zip(pres) {
        let hw = upload(g, &hws[0][..pre.len() * c], "hw");
        let ctx = ForwardContext::new(g).with_host_ids(pre);
        layer.forward(st, hw, pre.len(), true, &ctx, s).unwrap();
        out.extend(bits(&download(g, hw, pre.len() * c, s)));
        g.free(hw).unwrap();
    }
    let b = pres.len();
    let hw = upload(g, &hws[1][..b * c], "hw");
    for (k, step) in steps.iter().enumerate() {
        write(g, &hws[2 + k][..b * c], hw, s);
        let mut refs: Vec<&mut PleSeqState> = states.iter_mut().collect();
        let ctx = ForwardContext::new(g).with_host_ids(step);
        layer.forward_batch(&mut refs, hw, b, &ctx, s).unwrap();
        out.extend(bits(&download(g, hw, b * c, s)));
    }
    let blobs = states
        .iter()
        .map(|st| layer.snapshot(st, g, s).unwrap())
        .collect();
    g.free(hw).unwrap();
    g.synchronize(s).unwrap();
    for mut st in states {
        layer.release_seq_state(&mut st, g).unwrap();
    }
    (out, blobs)
}

/// How [`by_plan`] runs the decode steps.
#[derive(Clone, Copy, Debug)]
enum Decode {
    /// `run_batch`.
    Eager,
    /// `prestage_plan`, then the step captured once and replayed.
    Graph,
}

/// [`by_forward`] through plans: each prefill planned once and run in
/// parts of `part` tokens, each decode step planned once for every
/// sequence.
#[allow(clippy::too_many_arguments)]
fn by_plan(
    layer: &PleLayer,
    g: &dyn GpuBackend,
    s: StreamId,
    pres: &[Vec<u32>],
    steps: &[Vec<u32>],
    hws: &[Vec<f32>],
    part: usize,
    decode: Decode,
) -> (Vec<u32>, Vec<Vec<u8>>) {
    let c = layer.channels();
    let mut out = Vec::new();
    let mut states: Vec<PleSeqState> = pres
        .iter()
        .map(|_| layer.new_seq_state(g).unwrap())
        .collect();
    let work: Vec<SeqWork<'_>> = pres.iter().map(|p| SeqWork::new(&[], p)).collect();
    let plan = layer.plan(&work).unwrap();
    for (i, (st, pre)) in states.iter_mut().zip(pres).enumerate() {
        let hw = upload(g, &hws[0][..pre.len() * c], "hw");
        let mut from = 0;
        while from < pre.len() {
            let len = part.min(pre.len() - from);
            let p = PlanPart { seq: i, from, len };
            layer
                .run(&plan, p, st, hw.offset(from * c * 4), from == 0, g, s)
                .unwrap();
            from += len;
        }
        out.extend(bits(&download(g, hw, pre.len() * c, s)));
        g.free(hw).unwrap();
    }
    let b = pres.len();
    let seqs: Vec<usize> = (0..b).collect();
    let hw = upload(g, &hws[1][..b * c], "hw");
    let mut graph = None;
    for (k, step) in steps.iter().enumerate() {
        let histories: Vec<Vec<u32>> = states.iter().map(|st| st.history().to_vec()).collect();
        let work: Vec<SeqWork<'_>> = histories
            .iter()
            .zip(step)
            .map(|(h, t)| SeqWork::new(h, std::slice::from_ref(t)))
            .collect();
        let plan = layer.plan(&work).unwrap();
        write(g, &hws[2 + k][..b * c], hw, s);
        let mut refs: Vec<&mut PleSeqState> = states.iter_mut().collect();
        match decode {
            Decode::Eager => layer
                .run_batch(&plan, &seqs, &mut refs, hw, b, g, s)
                .unwrap(),
            Decode::Graph => {
                layer
                    .prestage_plan(&plan, &seqs, &mut refs, b, g, s)
                    .unwrap();
                let gr = match graph {
                    Some(gr) => gr,
                    None => {
                        g.begin_capture(s).unwrap();
                        let ctx = ForwardContext::new(g).capturing(true);
                        layer.forward_batch(&mut refs, hw, b, &ctx, s).unwrap();
                        let gr = g.end_capture(s).unwrap();
                        graph = Some(gr);
                        gr
                    }
                };
                g.launch_graph(gr, s).unwrap();
                layer.note_replayed(&mut refs, g, s).unwrap();
            }
        }
        out.extend(bits(&download(g, hw, b * c, s)));
    }
    if let Some(gr) = graph {
        g.destroy_graph(gr).unwrap();
    }
    let blobs = states
        .iter()
        .map(|st| layer.snapshot(st, g, s).unwrap())
        .collect();
    g.free(hw).unwrap();
    g.synchronize(s).unwrap();
    for mut st in states {
        layer.release_seq_state(&mut st, g).unwrap();
    }
    (out, blobs)
}

#[test]
fn running_a_plan_gives_the_forwards_bits_in_every_mode() {
    let fx = Fx::new(31, 64);
    let g = fx.g();
    let layer = fx.layer(8);
    let c = layer.channels();
    let mut r = Rng(9);
    let pres: Vec<Vec<u32>> = [5, 13, 1].iter().map(|&n| tokens(&mut r, n, 40)).collect();
    let steps: Vec<Vec<u32>> = (0..4).map(|_| tokens(&mut r, 3, 40)).collect();
    let hws: Vec<Vec<f32>> = (0..6).map(|_| highway(&mut r, 13, c)).collect();
    let want = by_forward(&layer, g, fx.s, &pres, &steps, &hws);
    for (part, decode) in [(8, Decode::Eager), (3, Decode::Eager), (5, Decode::Graph)] {
        let got = by_plan(&layer, g, fx.s, &pres, &steps, &hws, part, decode);
        assert!(got.0 == want.0, "highways: parts of {part}, {decode:?}");
        assert!(got.1 == want.1, "carries: parts of {part}, {decode:?}");
    }
    fx.finish(layer, Vec::new());
}

/// A plan made for another history, for more tokens than a batch runs,
/// or a part outside it, is refused before anything changes.
#[test]
fn a_plan_for_another_carry_is_refused_and_changes_nothing() {
    let fx = Fx::new(41, 64);
    let g = fx.g();
    let layer = fx.layer(8);
    let c = layer.channels();
    let s = fx.s;
    let mut st = layer.new_seq_state(g).unwrap();
    let pre = [3u32, 4, 6];
    let hw = upload(g, &vec![0.25; 3 * c], "hw");
    let ctx = ForwardContext::new(g).with_host_ids(&pre);
    layer.forward(&mut st, hw, 3, true, &ctx, s).unwrap();
    let before = layer.snapshot(&st, g, s).unwrap();
    // Planned against another history.
    let plan = layer.plan(&[SeqWork::new(&[9, 9], &[7, 8])]).unwrap();
    let whole = PlanPart::whole(&plan, 0);
    let e = layer.run(&plan, whole, &mut st, hw, false, g, s);
    assert!(matches!(e, Err(LayerError::Plan(_))), "{e:?}");
    let e = layer.run_batch(&plan, &[0], &mut [&mut st], hw, 1, g, s);
    assert!(matches!(e, Err(LayerError::Plan(_))), "{e:?}");
    // Planned against the carry's history, but a part past its tokens,
    // and a later part before the earlier one ran.
    let plan = layer.plan(&[SeqWork::new(&pre, &[7, 8])]).unwrap();
    let past = PlanPart {
        seq: 0,
        from: 1,
        len: 2,
    };
    let e = layer.run(&plan, past, &mut st, hw, false, g, s);
    assert!(matches!(e, Err(LayerError::Plan(_))), "{e:?}");
    let later = PlanPart {
        seq: 0,
        from: 1,
        len: 1,
    };
    let e = layer.run(&plan, later, &mut st, hw, false, g, s);
    assert!(matches!(e, Err(LayerError::Plan(_))), "{e:?}");
    // A batch runs one token a sequence.
    let e = layer.prestage_plan(&plan, &[0], &mut [&mut st], 1, g, s);
    assert!(matches!(e, Err(LayerError::Plan(_))), "{e:?}");
    assert_eq!(layer.snapshot(&st, g, s).unwrap(), before);
    // The right part runs.
    let first = PlanPart {
        seq: 0,
        from: 0,
        len: 1,
    };
    layer.run(&plan, first, &mut st, hw, false, g, s).unwrap();
    layer.run(&plan, later, &mut st, hw, false, g, s).unwrap();
    assert_eq!(st.history(), &[7, 8]);
    g.free(hw).unwrap();
    g.synchronize(s).unwrap();
    fx.finish(layer, vec![st]);
}
