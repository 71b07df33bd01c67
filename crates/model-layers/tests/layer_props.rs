//! Property tests of the PLE layer on the CPU backend: every way of feeding
//! the same tokens (chunked prefill, token-by-token decode with or without a
//! prestage, snapshot and restore, single rows or one batch, captured graphs
//! or eager) gives bit-identical highways and carries. Every case ends with
//! the backend's live allocations back where they started and no lease left
//! pinned.

mod layer_common;

use std::sync::Arc;

use layer_common::{
    Rng, Small, TestTable, assert_no_leaks, bits, download, highway, tokens, upload, write,
};
use metrale_gpu_runtime::cpu::CpuBackend;
use metrale_gpu_runtime::gpu::{DevicePtr, GpuBackend, StreamId};
use metrale_model_layers::layers::ple::{ForwardContext, PleLayer, PleSeqState};
use proptest::prelude::*;

const VOCAB: u64 = 40;

struct Env {
    gpu: CpuBackend,
    start: usize,
    small: Small,
    table: Arc<TestTable>,
    stream: StreamId,
}

impl Env {
    fn new(seed: u64, max_resolve: usize) -> Env {
        let gpu = CpuBackend::new_debug();
        let start = gpu.live_alloc_count();
        let small = Small::new(seed);
        let table = TestTable::new(&gpu, &small.table_bits, small.head_dim, max_resolve).unwrap();
        let stream = gpu.create_stream().unwrap();
        Env {
            gpu,
            start,
            small,
            table,
            stream,
        }
    }
    fn g(&self) -> &dyn GpuBackend {
        &self.gpu
    }
    fn layer(&self, max_tokens: usize) -> PleLayer {
        self.small
            .layer(self.g(), self.table.clone(), max_tokens)
            .unwrap()
    }
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
                .forward(st, p, n, fresh && i == 0, &ctx, self.stream)
                .unwrap();
            out.extend(bits(&download(g, p, n * c, self.stream)));
            g.free(p).unwrap();
            t0 += n;
        }
        out
    }
    fn finish(self, layers: Vec<PleLayer>, states: Vec<PleSeqState>) {
        let g: &dyn GpuBackend = &self.gpu;
        // Every lease so far was released with an event recorded after the
        // gather that read it, never at issue time.
        assert_eq!(
            self.table.bare_releases(),
            0,
            "a pinned lease was released without an event"
        );
        for mut st in states {
            layers[0].release_seq_state(&mut st, g).unwrap();
        }
        for mut l in layers {
            l.free(g).unwrap();
        }
        assert_eq!(self.table.pinned(g), 0, "leases left pinned");
        self.table.free(g);
        g.synchronize(self.stream).unwrap();
        g.destroy_stream(self.stream).unwrap();
        assert_no_leaks(g, self.start);
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
        let env = Env::new(seed, max_resolve);
        let mut r = Rng(seed ^ 1);
        let toks = tokens(&mut r, n, VOCAB);
        let hw = highway(&mut r, n, env.c());
        let whole_layer = env.layer(32);
        let split_layer = env.layer(4);
        let mut a = whole_layer.new_seq_state(env.g()).unwrap();
        let mut b = split_layer.new_seq_state(env.g()).unwrap();
        let want = env.run_chunks(&whole_layer, &mut a, &hw, &toks, &[n], true);
        let cuts = chunking(&mut r, n);
        let got = env.run_chunks(&split_layer, &mut b, &hw, &toks, &cuts, true);
        prop_assert_eq!(&got, &want, "chunks {:?}", cuts);
        prop_assert_eq!(whole_layer.snapshot_aux(&a, env.g(), env.stream).unwrap(),
                        split_layer.snapshot_aux(&b, env.g(), env.stream).unwrap());
        env.finish(vec![whole_layer, split_layer], vec![a, b]);
    }

    #[test]
    fn prefill_then_decode_any_way_is_bit_identical(seed in any::<u64>(), pre in 1usize..10, dec in 1usize..8) {
        let env = Env::new(seed, 64);
        let g = env.g();
        let c = env.c();
        let mut r = Rng(seed ^ 2);
        let n = pre + dec;
        let toks = tokens(&mut r, n, VOCAB);
        let hw = highway(&mut r, n, c);
        let layer = env.layer(8);
        let mut a = layer.new_seq_state(g).unwrap();
        let want = env.run_chunks(&layer, &mut a, &hw, &toks, &[n], true);
        let mut b = layer.new_seq_state(g).unwrap();
        let mut got = env.run_chunks(&layer, &mut b, &hw, &toks[..pre], &[pre], true);
        let row = g.alloc(c * 4, "row").unwrap();
        let ids = g.alloc(4, "ids").unwrap();
        let mut modes = Vec::new();
        for t in pre..n {
            write(g, &hw[t * c..(t + 1) * c], row, env.stream);
            let mode = r.below(4);
            modes.push(mode);
            let tok = [toks[t]];
            match mode {
                0 => layer.forward(&mut b, row, 1, false, &ForwardContext::new(g).with_host_ids(&tok), env.stream).unwrap(),
                1 => {
                    layer.prestage(&mut b, &tok, g, env.stream).unwrap();
                    layer.forward(&mut b, row, 1, false, &ForwardContext::new(g), env.stream).unwrap();
                }
                2 => {
                    layer.prestage_batch(&mut [&mut b], &tok, 1, g, env.stream).unwrap();
                    // Host ids present too: the prestage wins, they are not hashed again.
                    layer.forward(&mut b, row, 1, false, &ForwardContext::new(g).with_host_ids(&[1]), env.stream).unwrap();
                }
                _ => {
                    g.copy_h2d_async(&tok[0].to_le_bytes(), ids, env.stream).unwrap();
                    layer.forward(&mut b, row, 1, false, &ForwardContext::new(g).with_device_ids(ids), env.stream).unwrap();
                }
            }
            prop_assert!(!b.is_prestaged());
            got.extend(bits(&download(g, row, c, env.stream)));
        }
        prop_assert_eq!(&got, &want, "modes {:?}", modes);
        prop_assert_eq!(layer.snapshot_aux(&a, g, env.stream).unwrap(), layer.snapshot_aux(&b, g, env.stream).unwrap());
        g.free(row).unwrap();
        g.free(ids).unwrap();
        env.finish(vec![layer], vec![a, b]);
    }

    #[test]
    fn snapshot_restore_then_continue_is_bit_identical(seed in any::<u64>(), n in 2usize..30, cut_frac in 0.0f64..1.0) {
        let env = Env::new(seed, 64);
        let g = env.g();
        let c = env.c();
        let mut r = Rng(seed ^ 3);
        let toks = tokens(&mut r, n, VOCAB);
        let hw = highway(&mut r, n, c);
        let k = 1 + ((n - 1) as f64 * cut_frac) as usize;
        let layer = env.layer(8);
        let mut a = layer.new_seq_state(g).unwrap();
        let want = env.run_chunks(&layer, &mut a, &hw, &toks, &[n], true);
        let mut b = layer.new_seq_state(g).unwrap();
        let cuts = chunking(&mut r, k);
        let mut got = env.run_chunks(&layer, &mut b, &hw[..k * c], &toks[..k], &cuts, true);
        let blob = layer.snapshot_aux(&b, g, env.stream).unwrap();
        let mut fresh = layer.new_seq_state(g).unwrap();
        layer.restore_aux(&mut fresh, &blob, g, env.stream).unwrap();
        let rest = chunking(&mut r, n - k);
        got.extend(env.run_chunks(&layer, &mut fresh, &hw[k * c..], &toks[k..], &rest, false));
        prop_assert_eq!(&got, &want);
        // The original carry continues the same way.
        let again = env.run_chunks(&layer, &mut b, &hw[k * c..], &toks[k..], &[n - k], false);
        prop_assert_eq!(&again[..], &want[k * c..]);
        prop_assert_eq!(layer.snapshot_aux(&a, g, env.stream).unwrap(), layer.snapshot_aux(&fresh, g, env.stream).unwrap());
        env.finish(vec![layer], vec![a, b, fresh]);
    }

    #[test]
    fn forward_row_matches_the_batched_decode(seed in any::<u64>(), nb in 1usize..6, steps in 1usize..4, max_resolve in 3usize..30) {
        let env = Env::new(seed, max_resolve);
        let g = env.g();
        let c = env.c();
        let s = env.stream;
        let mut r = Rng(seed ^ 4);
        let layer = env.layer(8);
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
                env.run_chunks(&layer, st, &hw, p, &[p.len()], true);
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
        env.finish(vec![layer], all_states);
    }

    #[test]
    fn captured_decode_replays_bit_identical_to_eager(seed in any::<u64>(), cap in 1usize..5, steps in 1usize..5) {
        let env = Env::new(seed, 64);
        let g = env.g();
        let c = env.c();
        let s = env.stream;
        let mut r = Rng(seed ^ 5);
        let layer = env.layer(8);
        let prefixes: Vec<Vec<u32>> = (0..cap).map(|_| { let l = 1 + r.below(6); tokens(&mut r, l, VOCAB) }).collect();
        // Step 0 runs the full batch (it is captured); later steps any prefix of it.
        let active: Vec<usize> = (0..steps).map(|i| if i == 0 { cap } else { 1 + r.below(cap) }).collect();
        let step_toks: Vec<Vec<u32>> = (0..steps).map(|_| tokens(&mut r, cap, VOCAB)).collect();
        let step_hw: Vec<Vec<f32>> = (0..steps).map(|_| highway(&mut r, cap, c)).collect();
        let prefill = |states: &mut Vec<PleSeqState>| {
            for (st, p) in states.iter_mut().zip(&prefixes) {
                let hw = highway(&mut Rng(p.len() as u64 + 9), p.len(), c);
                env.run_chunks(&layer, st, &hw, p, &[p.len()], true);
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
        env.finish(vec![layer], eager);
    }
}
