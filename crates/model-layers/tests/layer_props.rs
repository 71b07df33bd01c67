//! Property tests of the PLE layer on the CPU backend: every way of feeding
//! the same tokens (chunked prefill, token-by-token decode with or without a
//! prestage, snapshot and restore, single rows or one batch, captured graphs
//! or eager) gives bit-identical highways and carries. Every case ends with
//! the backend's live allocations back where they started and no lease left
//! pinned.

mod layer_common;

use layer_common::{Fx, Rng, bits, download, highway, tokens, upload, write};
use metrale_gpu_runtime::gpu::DevicePtr;
use metrale_model_layers::layers::ple::{ForwardContext, PleLayer, PleSeqState};
use proptest::prelude::*;

const VOCAB: u64 = 40;

/// What the properties add to the shared fixture.
impl Fx {
    fn c(&self) -> usize {
        self.small.channels()
    }
    /// Run `tokens` over `hw` rows as chunks of the given sizes (first fresh).
    fn run_chunks(
        &self,
        layer: &PleLayer,
        st: &mut PleSeqState,
        hw: &[f32],
        toks: &[u32],
        chunks: &[usize],
        fresh: bool,
    ) -> Vec<u32> {
        let g = self.g();
        let c = self.c();
        let mut out = Vec::new();
        let mut t0 = 0;
        for (i, &n) in chunks.iter().enumerate() {
            let p = upload(g, &hw[t0 * c..(t0 + n) * c], "hw");
            let ctx = ForwardContext::new(g).with_host_ids(&toks[t0..t0 + n]);
            layer
                .forward(st, p, n, fresh && i == 0, &ctx, self.s)
                .unwrap();
            out.extend(bits(&download(g, p, n * c, self.s)));
            g.free(p).unwrap();
            t0 += n;
        }
        out
    }
}

/// Random cut of `n` into chunk sizes.
fn chunking(r: &mut Rng, n: usize) -> Vec<usize> {
    let mut out = Vec::new();
    let mut left = n;
    while left > 0 {
        let k = 1 + r.below(left.min(9));
        out.push(k);
        left -= k;
    }
    out
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 24, ..ProptestConfig::default() })]

    #[test]
    fn any_chunking_of_a_prefill_is_bit_identical(seed in any::<u64>(), n in 1usize..30, max_resolve in 3usize..40) {
        let fx = Fx::new(seed, max_resolve);
        let mut r = Rng(seed ^ 1);
        let toks = tokens(&mut r, n, VOCAB);
        let hw = highway(&mut r, n, fx.c());
        let whole_layer = fx.layer(32);
        let split_layer = fx.layer(4);
        let mut a = whole_layer.new_seq_state(fx.g()).unwrap();
        let mut b = split_layer.new_seq_state(fx.g()).unwrap();
        let want = fx.run_chunks(&whole_layer, &mut a, &hw, &toks, &[n], true);
        let cuts = chunking(&mut r, n);
        let got = fx.run_chunks(&split_layer, &mut b, &hw, &toks, &cuts, true);
        prop_assert_eq!(&got, &want, "chunks {:?}", cuts);
        prop_assert_eq!(whole_layer.snapshot_aux(&a, fx.g(), fx.s).unwrap(),
                        split_layer.snapshot_aux(&b, fx.g(), fx.s).unwrap());
        fx.finish_all(vec![whole_layer, split_layer], vec![a, b]);
    }

    #[test]
    fn prefill_then_decode_any_way_is_bit_identical(seed in any::<u64>(), pre in 1usize..10, dec in 1usize..8) {
        let fx = Fx::new(seed, 64);
        let g = fx.g();
        let c = fx.c();
        let mut r = Rng(seed ^ 2);
        let n = pre + dec;
        let toks = tokens(&mut r, n, VOCAB);
        let hw = highway(&mut r, n, c);
        let layer = fx.layer(8);
        let mut a = layer.new_seq_state(g).unwrap();
        let want = fx.run_chunks(&layer, &mut a, &hw, &toks, &[n], true);
        let mut b = layer.new_seq_state(g).unwrap();
        let mut got = fx.run_chunks(&layer, &mut b, &hw, &toks[..pre], &[pre], true);
        let row = g.alloc(c * 4, "row").unwrap();
        let ids = g.alloc(4, "ids").unwrap();
        let mut modes = Vec::new();
        for t in pre..n {
            write(g, &hw[t * c..(t + 1) * c], row, fx.s);
            let mode = r.below(4);
            modes.push(mode);
            let tok = [toks[t]];
            match mode {
                0 => layer.forward(&mut b, row, 1, false, &ForwardContext::new(g).with_host_ids(&tok), fx.s).unwrap(),
                1 => {
                    layer.prestage(&mut b, &tok, g, fx.s).unwrap();
                    layer.forward(&mut b, row, 1, false, &ForwardContext::new(g), fx.s).unwrap();
                }
                2 => {
                    layer.prestage_batch(&mut [&mut b], &tok, 1, g, fx.s).unwrap();
                    // Host ids present too: the prestage wins, they are not hashed again.
                    layer.forward(&mut b, row, 1, false, &ForwardContext::new(g).with_host_ids(&[1]), fx.s).unwrap();
                }
                _ => {
                    g.copy_h2d_async(&tok[0].to_le_bytes(), ids, fx.s).unwrap();
                    layer.forward(&mut b, row, 1, false, &ForwardContext::new(g).with_device_ids(ids), fx.s).unwrap();
                }
            }
            prop_assert!(!b.is_prestaged());
            got.extend(bits(&download(g, row, c, fx.s)));
        }
        prop_assert_eq!(&got, &want, "modes {:?}", modes);
        prop_assert_eq!(layer.snapshot_aux(&a, g, fx.s).unwrap(), layer.snapshot_aux(&b, g, fx.s).unwrap());
        g.free(row).unwrap();
        g.free(ids).unwrap();
        fx.finish_all(vec![layer], vec![a, b]);
    }

    #[test]
    fn snapshot_restore_then_continue_is_bit_identical(seed in any::<u64>(), n in 2usize..30, cut_frac in 0.0f64..1.0) {
        let fx = Fx::new(seed, 64);
        let g = fx.g();
        let c = fx.c();
        let mut r = Rng(seed ^ 3);
        let toks = tokens(&mut r, n, VOCAB);
        let hw = highway(&mut r, n, c);
        let k = 1 + ((n - 1) as f64 * cut_frac) as usize;
        let layer = fx.layer(8);
        let mut a = layer.new_seq_state(g).unwrap();
        let want = fx.run_chunks(&layer, &mut a, &hw, &toks, &[n], true);
        let mut b = layer.new_seq_state(g).unwrap();
        let cuts = chunking(&mut r, k);
        let mut got = fx.run_chunks(&layer, &mut b, &hw[..k * c], &toks[..k], &cuts, true);
        let blob = layer.snapshot_aux(&b, g, fx.s).unwrap();
        let mut fresh = layer.new_seq_state(g).unwrap();
        layer.restore_aux(&mut fresh, &blob, g, fx.s).unwrap();
        let rest = chunking(&mut r, n - k);
        got.extend(fx.run_chunks(&layer, &mut fresh, &hw[k * c..], &toks[k..], &rest, false));
        prop_assert_eq!(&got, &want);
        // The original carry continues the same way.
        let again = fx.run_chunks(&layer, &mut b, &hw[k * c..], &toks[k..], &[n - k], false);
        prop_assert_eq!(&again[..], &want[k * c..]);
        prop_assert_eq!(layer.snapshot_aux(&a, g, fx.s).unwrap(), layer.snapshot_aux(&fresh, g, fx.s).unwrap());
        fx.finish_all(vec![layer], vec![a, b, fresh]);
    }

    #[test]
    fn forward_row_matches_the_batched_decode(seed in any::<u64>(), nb in 1usize..6, steps in 1usize..4, max_resolve in 3usize..30) {
        let fx = Fx::new(seed, max_resolve);
        let g = fx.g();
        let c = fx.c();
        let s = fx.s;
        let mut r = Rng(seed ^ 4);
        let layer = fx.layer(8);
        let prefixes: Vec<Vec<u32>> = (0..nb).map(|_| { let l = 1 + r.below(6); tokens(&mut r, l, VOCAB) }).collect();
        let step_toks: Vec<Vec<u32>> = (0..steps).map(|_| tokens(&mut r, nb, VOCAB)).collect();
        let step_hw: Vec<Vec<f32>> = (0..steps).map(|_| highway(&mut r, nb, c)).collect();
        let hwbuf = g.alloc(nb * c * 4, "batch hw").unwrap();
        let mut results = Vec::new();
        let mut all_states = Vec::new();
        for mode in 0..4 {
            let mut states: Vec<PleSeqState> = (0..nb).map(|_| layer.new_seq_state(g).unwrap()).collect();
            for (st, p) in states.iter_mut().zip(&prefixes) {
                let hw = highway(&mut Rng(p.len() as u64), p.len(), c);
                fx.run_chunks(&layer, st, &hw, p, &[p.len()], true);
            }
            let mut out = Vec::new();
            for (toks, hw) in step_toks.iter().zip(&step_hw) {
                write(g, hw, hwbuf, s);
                let ctx = ForwardContext::new(g).with_host_ids(toks);
                let mut refs: Vec<&mut PleSeqState> = states.iter_mut().collect();
                match mode {
                    0 => layer.forward_batch(&mut refs, hwbuf, nb, &ctx, s).unwrap(),
                    1 => for (i, st) in refs.iter_mut().enumerate() { layer.forward_row(st, hwbuf, i, &ctx, s).unwrap() },
                    2 => {
                        layer.prestage_batch(&mut refs, toks, nb, g, s).unwrap();
                        layer.forward_batch(&mut refs, hwbuf, nb, &ForwardContext::new(g), s).unwrap();
                    }
                    _ => {
                        layer.prestage_batch(&mut refs, toks, nb, g, s).unwrap();
                        for (i, st) in refs.iter_mut().enumerate() {
                            layer.forward_row(st, hwbuf, i, &ForwardContext::new(g), s).unwrap();
                        }
                    }
                }
                out.extend(bits(&download(g, hwbuf, nb * c, s)));
            }
            let snaps: Vec<Vec<u8>> = states.iter().map(|st| layer.snapshot_aux(st, g, s).unwrap()).collect();
            results.push((out, snaps));
            all_states.extend(states);
        }
        for m in 1..4 {
            prop_assert_eq!(&results[m], &results[0], "mode {} differs from the eager batch", m);
        }
        g.free(hwbuf).unwrap();
        fx.finish_all(vec![layer], all_states);
    }

    #[test]
    fn captured_decode_replays_bit_identical_to_eager(seed in any::<u64>(), cap in 1usize..5, steps in 1usize..5) {
        let fx = Fx::new(seed, 64);
        let g = fx.g();
        let c = fx.c();
        let s = fx.s;
        let mut r = Rng(seed ^ 5);
        let layer = fx.layer(8);
        let prefixes: Vec<Vec<u32>> = (0..cap).map(|_| { let l = 1 + r.below(6); tokens(&mut r, l, VOCAB) }).collect();
        // Step 0 runs the full batch (it is captured); later steps any prefix of it.
        let active: Vec<usize> = (0..steps).map(|i| if i == 0 { cap } else { 1 + r.below(cap) }).collect();
        let step_toks: Vec<Vec<u32>> = (0..steps).map(|_| tokens(&mut r, cap, VOCAB)).collect();
        let step_hw: Vec<Vec<f32>> = (0..steps).map(|_| highway(&mut r, cap, c)).collect();
        let prefill = |states: &mut Vec<PleSeqState>| {
            for (st, p) in states.iter_mut().zip(&prefixes) {
                let hw = highway(&mut Rng(p.len() as u64 + 9), p.len(), c);
                fx.run_chunks(&layer, st, &hw, p, &[p.len()], true);
            }
        };
        // Eager: one forward per sequence and step.
        let mut eager: Vec<PleSeqState> = (0..cap).map(|_| layer.new_seq_state(g).unwrap()).collect();
        prefill(&mut eager);
        let row = g.alloc(c * 4, "row").unwrap();
        let mut want = Vec::new();
        for ((toks, hw), &b) in step_toks.iter().zip(&step_hw).zip(&active) {
            for i in 0..b {
                write(g, &hw[i * c..(i + 1) * c], row, s);
                layer.forward(&mut eager[i], row, 1, false, &ForwardContext::new(g).with_host_ids(&toks[i..i + 1]), s).unwrap();
                want.extend(bits(&download(g, row, c, s)));
            }
        }
        // Graph: capture step 0, replay every step after a prestage.
        let mut graphed: Vec<PleSeqState> = (0..cap).map(|_| layer.new_seq_state(g).unwrap()).collect();
        prefill(&mut graphed);
        let hwbuf: DevicePtr = g.alloc(cap * c * 4, "batch hw").unwrap();
        let mut got = Vec::new();
        let mut graph = None;
        for (step, ((toks, hw), &b)) in step_toks.iter().zip(&step_hw).zip(&active).enumerate() {
            let mut refs: Vec<&mut PleSeqState> = graphed.iter_mut().take(b).collect();
            layer.prestage_batch(&mut refs, &toks[..b], cap, g, s).unwrap();
            write(g, hw, hwbuf, s);
            g.synchronize(s).unwrap();
            if step == 0 {
                g.begin_capture(s).unwrap();
                layer.forward_batch(&mut refs, hwbuf, cap, &ForwardContext::new(g).capturing(true), s).unwrap();
                graph = Some(g.end_capture(s).unwrap());
            }
            g.launch_graph(graph.unwrap(), s).unwrap();
            layer.note_replayed(&mut refs, g, s).unwrap();
            prop_assert!(refs.iter().all(|st| !st.is_prestaged()));
            // Noting the same replay twice is refused.
            prop_assert!(layer.note_replayed(&mut refs, g, s).is_err());
            let out = download(g, hwbuf, cap * c, s);
            got.extend(bits(&out[..b * c]));
        }
        prop_assert_eq!(&got, &want);
        for i in 0..cap {
            prop_assert_eq!(layer.snapshot_aux(&graphed[i], g, s).unwrap(), layer.snapshot_aux(&eager[i], g, s).unwrap());
        }
        g.destroy_graph(graph.unwrap()).unwrap();
        g.free(row).unwrap();
        g.free(hwbuf).unwrap();
        eager.extend(graphed);
        fx.finish_all(vec![layer], eager);
    }
}
