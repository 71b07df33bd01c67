//! The PLE carry and the layer's refusals: restore of a bad blob, double
//! release, constructor validation, capture refusals, `rearm`, stale
//! prestages, and lease and allocation accounting.

mod layer_common;

use std::sync::Arc;

use layer_common::{
    Fx, Rng, Small, TestTable, assert_no_leaks, bits, download, highway, tokens, upload, write,
};
use metrale_gpu_runtime::cpu::CpuBackend;
use metrale_gpu_runtime::gpu::GpuBackend;
use metrale_model_layers::layers::ple::carry_blob::{self, AuxBlobError};
use metrale_model_layers::layers::ple::ids::IdError;
use metrale_model_layers::layers::ple::{ForwardContext, LayerError, PleLayer, SpecError};

fn err_text<T, E: std::fmt::Display>(r: Result<T, E>) -> String {
    match r {
        Ok(_) => panic!("expected an error"),
        Err(e) => format!("{e:#}"),
    }
}

#[test]
fn restore_of_a_wrong_size_blob_fails_and_changes_nothing() {
    let fx = Fx::new(1, 5);
    let g = fx.g();
    let layer = fx.layer(8);
    let c = fx.small.channels();
    let mut r = Rng(7);
    let mut st = layer.new_seq_state(g).unwrap();
    let toks = tokens(&mut r, 6, 40);
    let hw = upload(g, &highway(&mut r, 6, c), "hw");
    layer
        .forward(
            &mut st,
            hw,
            6,
            true,
            &ForwardContext::new(g).with_host_ids(&toks),
            0,
        )
        .unwrap();
    let before = layer.snapshot_aux(&st, g, 0).unwrap();
    assert_eq!(before.len(), layer.aux_blob_bytes());
    for bad in [&before[..before.len() - 1], &before[..3], &[][..]] {
        let e = err_text(layer.restore_aux(&mut st, bad, g, 0));
        assert!(e.contains("PLE aux blob"), "{e}");
        assert_eq!(layer.snapshot_aux(&st, g, 0).unwrap(), before);
    }
    let mut longer = before.clone();
    longer.extend_from_slice(&[0; 4]);
    assert!(layer.restore_aux(&mut st, &longer, g, 0).is_err());
    // A history-length field that does not match the rest is refused too.
    let mut lying = before.clone();
    lying[0] = 3;
    assert!(layer.restore_aux(&mut st, &lying, g, 0).is_err());
    assert_eq!(layer.snapshot_aux(&st, g, 0).unwrap(), before);
    g.free(hw).unwrap();
    fx.finish(layer, vec![st]);
}

/// The codec and the seed's `snapshot_aux` / `restore_aux` read and write
/// the same bytes, both ways.
#[test]
fn codec_matches_the_seed_blob_both_ways() {
    let fx = Fx::new(11, 5);
    let g = fx.g();
    let layer = fx.layer(8);
    let spec = layer.spec().clone();
    let c = fx.small.channels();
    let mut r = Rng(5);
    let mut st = layer.new_seq_state(g).unwrap();
    let toks = tokens(&mut r, 5, 40);
    let hw = upload(g, &highway(&mut r, 5, c), "hw");
    layer
        .forward(
            &mut st,
            hw,
            5,
            true,
            &ForwardContext::new(g).with_host_ids(&toks),
            0,
        )
        .unwrap();
    // Seed to codec.
    let seed_blob = layer.snapshot_aux(&st, g, 0).unwrap();
    assert_eq!(
        seed_blob.len(),
        carry_blob::blob_len(spec.context_len(), spec.conv_bytes())
    );
    let view = carry_blob::decode(&seed_blob, &spec).unwrap();
    assert_eq!(view.history_tokens(), st.history());
    assert_eq!(view.conv.len(), spec.conv_bytes());
    assert_eq!(carry_blob::encode(st.history(), view.conv), seed_blob);

    // Codec to seed: a carry with another history and conv state.
    let history: Vec<u32> = vec![7, 9];
    assert_eq!(history.len(), spec.context_len());
    let conv: Vec<u8> = (0..spec.conv_bytes() / 4)
        .flat_map(|i| (i as f32 * 0.25 - 3.0).to_le_bytes())
        .collect();
    let blob = carry_blob::encode(&history, &conv);
    let mut other = layer.new_seq_state(g).unwrap();
    layer.restore_aux(&mut other, &blob, g, 0).unwrap();
    assert_eq!(other.history(), &history[..]);
    assert_eq!(layer.snapshot_aux(&other, g, 0).unwrap(), blob);

    // What the codec refuses, by variant.
    assert!(matches!(
        carry_blob::decode(&seed_blob[..2], &spec),
        Err(AuxBlobError::Truncated { .. })
    ));
    assert!(matches!(
        carry_blob::decode(&carry_blob::encode(&[1], &conv), &spec),
        Err(AuxBlobError::HistoryLen {
            expected: 2,
            found: 1
        })
    ));
    assert!(matches!(
        carry_blob::decode(&seed_blob[..seed_blob.len() - 4], &spec),
        Err(AuxBlobError::ConvSize { .. })
    ));
    g.free(hw).unwrap();
    fx.finish(layer, vec![st, other]);
}

/// The layer's `snapshot` / `restore` (the codec, typed errors) give and
/// take the seed's bytes: for a carry that ran and for one that has not.
#[test]
fn layer_snapshot_and_restore_are_the_seeds_bytes() {
    let fx = Fx::new(12, 5);
    let g = fx.g();
    let layer = fx.layer(8);
    let c = fx.small.channels();
    let mut r = Rng(6);
    let fresh = layer.new_seq_state(g).unwrap();
    let unrun = layer.snapshot(&fresh, g, 0).unwrap();
    assert_eq!(unrun, layer.snapshot_aux(&fresh, g, 0).unwrap());
    assert_eq!(
        unrun.len(),
        layer.aux_blob_bytes() - 4 * layer.spec().context_len()
    );

    let mut st = layer.new_seq_state(g).unwrap();
    let toks = tokens(&mut r, 7, 40);
    let hw = upload(g, &highway(&mut r, 7, c), "hw");
    let ctx = ForwardContext::new(g).with_host_ids(&toks);
    layer.forward(&mut st, hw, 7, true, &ctx, 0).unwrap();
    let blob = layer.snapshot(&st, g, 0).unwrap();
    assert_eq!(blob, layer.snapshot_aux(&st, g, 0).unwrap());

    // Restored both ways, the carries snapshot alike and run alike.
    let mut a = layer.new_seq_state(g).unwrap();
    let mut b = layer.new_seq_state(g).unwrap();
    layer.restore(&mut a, &blob, g, 0).unwrap();
    layer.restore_aux(&mut b, &blob, g, 0).unwrap();
    assert_eq!(a.history(), b.history());
    assert_eq!(layer.snapshot(&a, g, 0).unwrap(), blob);
    let next = tokens(&mut r, 3, 40);
    let rows = highway(&mut r, 3, c);
    let (ha, hb) = (upload(g, &rows, "ha"), upload(g, &rows, "hb"));
    let ctx = ForwardContext::new(g).with_host_ids(&next);
    layer.forward(&mut a, ha, 3, true, &ctx, 0).unwrap();
    layer.forward(&mut b, hb, 3, true, &ctx, 0).unwrap();
    assert_eq!(
        bits(&download(g, ha, 3 * c, 0)),
        bits(&download(g, hb, 3 * c, 0))
    );
    assert_eq!(
        layer.snapshot(&a, g, 0).unwrap(),
        layer.snapshot_aux(&b, g, 0).unwrap()
    );

    // The blob of a carry that has not run restores as such.
    layer.restore(&mut a, &unrun, g, 0).unwrap();
    assert!(a.history().is_empty());

    // Refusals are typed and change nothing.
    layer.restore(&mut b, &blob, g, 0).unwrap();
    for bad in [&blob[..blob.len() - 1], &blob[..3], &[][..]] {
        let e = layer.restore(&mut b, bad, g, 0).unwrap_err();
        assert!(matches!(e, LayerError::AuxBlob(_)), "{e:?}");
        assert_eq!(layer.snapshot(&b, g, 0).unwrap(), blob);
    }
    for x in [&ha, &hb, &hw] {
        g.free(*x).unwrap();
    }
    fx.finish(layer, vec![st, fresh, a, b]);
}

#[test]
fn release_twice_is_fine_and_a_released_state_is_refused() {
    let fx = Fx::new(2, 5);
    let g = fx.g();
    let layer = fx.layer(8);
    let mut st = layer.new_seq_state(g).unwrap();
    layer.release_seq_state(&mut st, g).unwrap();
    layer.release_seq_state(&mut st, g).unwrap();
    assert!(st.is_released());
    let hw = upload(g, &[0.0; 32], "hw");
    let e = err_text(layer.forward(
        &mut st,
        hw,
        1,
        true,
        &ForwardContext::new(g).with_host_ids(&[1]),
        0,
    ));
    assert!(e.contains("released"), "{e}");
    g.free(hw).unwrap();
    fx.finish(layer, vec![st]);
}

#[test]
fn constructor_validates_every_shape_and_leaks_nothing() {
    let fx = Fx::new(3, 5);
    let g = fx.g();
    let s = &fx.small;
    let table = || Arc::clone(&fx.table) as Arc<dyn metrale_storage::table::RowTable>;
    let mk_err = |f: &dyn Fn(&mut Small)| {
        let mut s2 = Small::new(3);
        f(&mut s2);
        let e = PleLayer::new(&s2.spec(), s2.weights.clone(), table(), 8, g).unwrap_err();
        (format!("{e:#}"), e)
    };
    let mk = |f: &dyn Fn(&mut Small)| mk_err(f).0;
    assert!(matches!(
        mk_err(&|s| s.weights.value_proj.push(0)).1,
        LayerError::WeightShape {
            tensor: "value_proj",
            ..
        }
    ));
    assert!(matches!(
        mk_err(&|s| s.weights.norm_key[4] = f32::NAN).1,
        LayerError::NonFinite {
            tensor: "norm_key",
            index: 4,
            ..
        }
    ));
    assert!(matches!(
        mk_err(&|s| s.dims.head_vocab_sizes[3] += 100).1,
        LayerError::Ids(IdError::TableRows { .. })
    ));
    assert!(matches!(
        mk_err(&|s| s.k = 1).1,
        LayerError::Spec(SpecError::Site { .. })
    ));
    assert!(mk(&|s| s.weights.key_proj.pop().map(|_| ()).unwrap()).contains("key_proj"));
    assert!(mk(&|s| s.weights.value_proj.push(0)).contains("value_proj"));
    assert!(mk(&|s| s.weights.norm_conv.truncate(3)).contains("norm_conv"));
    assert!(mk(&|s| s.weights.conv1d.push(0.0)).contains("conv1d"));
    assert!(mk(&|s| s.weights.norm_key[4] = f32::NAN).contains("norm_key[4]"));
    assert!(mk(&|s| s.weights.key_proj[9] = 0x7f80).contains("key_proj[9]"));
    assert!(mk(&|s| s.hc = 0).contains("hc_mult"));
    assert!(mk(&|s| s.k = 1).contains("kernel size"));
    assert!(mk(&|s| s.dil = 0).contains("dilation"));
    assert!(mk(&|s| s.head_dim = 4).contains("head_dim"));
    assert!(mk(&|s| s.dims.multipliers[1] &= !1).contains("even"));
    assert!(mk(&|s| s.dims.head_offsets[2] += 1).contains("head_offsets[2]"));
    assert!(mk(&|s| s.dims.head_vocab_sizes[3] += 100).contains("table has"));
    let e = PleLayer::new(&s.spec(), s.weights.clone(), table(), 0, g).unwrap_err();
    assert!(matches!(e, LayerError::NoTokens), "{e}");
    assert!(e.to_string().contains("max_tokens"), "{e}");
    let layer = fx.layer(8);
    fx.finish(layer, vec![]);
}

/// Eager decode of `toks` after a prefill of `pre`, one token a forward.
fn eager_run(
    layer: &PleLayer,
    g: &dyn GpuBackend,
    pre: &[u32],
    toks: &[u32],
    hws: &[Vec<f32>],
) -> (Vec<u32>, Vec<u8>) {
    let c = layer.channels();
    let mut st = layer.new_seq_state(g).unwrap();
    let hw = upload(g, &vec![0.5; pre.len() * c], "hw");
    layer
        .forward(
            &mut st,
            hw,
            pre.len(),
            true,
            &ForwardContext::new(g).with_host_ids(pre),
            0,
        )
        .unwrap();
    g.free(hw).unwrap();
    let row = upload(g, &hws[0], "row");
    let mut out = Vec::new();
    for (t, h) in toks.iter().zip(hws) {
        write(g, h, row, 0);
        layer
            .forward(
                &mut st,
                row,
                1,
                false,
                &ForwardContext::new(g).with_host_ids(&[*t]),
                0,
            )
            .unwrap();
        out.extend(bits(&download(g, row, c, 0)));
    }
    g.free(row).unwrap();
    let blob = layer.snapshot_aux(&st, g, 0).unwrap();
    layer.release_seq_state(&mut st, g).unwrap();
    (out, blob)
}

#[test]
fn capture_refusals_name_the_reason() {
    let fx = Fx::new(4, 5);
    let g = fx.g();
    let layer = fx.layer(8);
    let c = layer.channels();
    let s = fx.s;
    let mut st = layer.new_seq_state(g).unwrap();
    let hw = upload(g, &vec![0.25; c], "hw");
    layer
        .forward(
            &mut st,
            hw,
            1,
            true,
            &ForwardContext::new(g).with_host_ids(&[3]),
            s,
        )
        .unwrap();
    g.synchronize(s).unwrap();

    g.begin_capture(s).unwrap();
    let e = err_text(layer.forward(
        &mut st,
        hw,
        1,
        false,
        &ForwardContext::new(g).with_host_ids(&[4]),
        s,
    ));
    assert!(e.contains("refused under capture"), "{e}");
    let ids = g.alloc(4, "ids").unwrap();
    let e = err_text(layer.forward(
        &mut st,
        hw,
        1,
        false,
        &ForwardContext::new(g).with_device_ids(ids),
        s,
    ));
    assert!(e.contains("blocking read"), "{e}");
    let e = err_text(layer.forward(
        &mut st,
        hw,
        1,
        true,
        &ForwardContext::new(g).with_host_ids(&[4]),
        s,
    ));
    assert!(e.contains("cannot be captured"), "{e}");
    let e = err_text(layer.prestage(&mut st, &[4], g, s));
    assert!(e.contains("capturing"), "{e}");
    let gr = g.end_capture(s);
    if let Ok(gr) = gr {
        g.destroy_graph(gr).unwrap();
    }
    // A single-sequence prestage lives in the ring; capturing its forward is refused.
    layer.prestage(&mut st, &[4], g, s).unwrap();
    g.synchronize(s).unwrap();
    g.begin_capture(s).unwrap();
    let e = err_text(layer.forward(&mut st, hw, 1, false, &ForwardContext::new(g), s));
    assert!(e.contains("staging ring"), "{e}");
    if let Ok(gr) = g.end_capture(s) {
        g.destroy_graph(gr).unwrap();
    }
    g.free(ids).unwrap();
    g.free(hw).unwrap();
    g.synchronize(s).unwrap();
    fx.finish(layer, vec![st]);
}

#[test]
fn rearm_after_a_failed_capture_makes_the_eager_rerun_correct() {
    let fx = Fx::new(5, 5);
    let g = fx.g();
    let layer = fx.layer(8);
    let c = layer.channels();
    let mut r = Rng(55);
    let pre = tokens(&mut r, 5, 40);
    let toks = tokens(&mut r, 3, 40);
    let hws: Vec<Vec<f32>> = (0..3).map(|_| highway(&mut r, 1, c)).collect();
    let (want, want_blob) = eager_run(&layer, g, &pre, &toks, &hws);

    let s = fx.s;
    let mut st = layer.new_seq_state(g).unwrap();
    let hw = upload(g, &vec![0.5; pre.len() * c], "hw");
    layer
        .forward(
            &mut st,
            hw,
            pre.len(),
            true,
            &ForwardContext::new(g).with_host_ids(&pre),
            s,
        )
        .unwrap();
    let row = upload(g, &hws[0], "row");
    let mut got = Vec::new();
    for (i, (t, h)) in toks.iter().zip(&hws).enumerate() {
        layer
            .prestage_batch(&mut [&mut st], &[*t], 1, g, s)
            .unwrap();
        write(g, h, row, s);
        g.synchronize(s).unwrap();
        if i == 1 {
            // The capture fails after the forward took the prestage.
            g.begin_capture(s).unwrap();
            layer
                .forward(&mut st, row, 1, false, &ForwardContext::new(g), s)
                .unwrap();
            assert!(!st.is_prestaged());
            assert!(g.copy_h2d_async(&[0u8; 4], row, s).is_err());
            if let Ok(gr) = g.end_capture(s) {
                g.destroy_graph(gr).unwrap();
            }
            layer.rearm(&mut st);
            assert!(st.is_prestaged());
        }
        layer
            .forward(&mut st, row, 1, false, &ForwardContext::new(g), s)
            .unwrap();
        got.extend(bits(&download(g, row, c, s)));
        // A rearm after a successful eager forward must not gather again.
        if i == 2 {
            layer.rearm(&mut st);
            let e = err_text(layer.forward(&mut st, row, 1, false, &ForwardContext::new(g), s));
            assert!(e.contains("already gathered"), "{e}");
        }
    }
    assert_eq!(got, want);
    assert_eq!(layer.snapshot_aux(&st, g, s).unwrap(), want_blob);
    g.free(hw).unwrap();
    g.free(row).unwrap();
    g.synchronize(s).unwrap();
    fx.finish(layer, vec![st]);
}

#[test]
fn stale_and_overridden_prestages_are_never_applied() {
    let fx = Fx::new(6, 5);
    let g = fx.g();
    let layer = fx.layer(4);
    let c = layer.channels();
    let mut a = layer.new_seq_state(g).unwrap();
    let mut b = layer.new_seq_state(g).unwrap();
    let row = upload(g, &vec![0.5; 2 * c], "row");
    // Batch slot 0 handed to another sequence: a's prestage is refused.
    layer.prestage_batch(&mut [&mut a], &[7], 1, g, 0).unwrap();
    layer.prestage_batch(&mut [&mut b], &[8], 1, g, 0).unwrap();
    let e = err_text(layer.forward(&mut a, row, 1, false, &ForwardContext::new(g), 0));
    assert!(e.contains("prestaged again for another sequence"), "{e}");
    assert!(!a.is_prestaged(), "the prestage is taken even when refused");
    // A batch step over a prestage of a different batch is refused.
    let e =
        err_text(layer.forward_batch(&mut [&mut a, &mut b], row, 2, &ForwardContext::new(g), 0));
    assert!(e.contains("not prestaged at batch slot 0"), "{e}");
    // An override forward takes the prestage without using it.
    layer.prestage(&mut a, &[9], g, 0).unwrap();
    let hist = a.history().to_vec();
    layer
        .forward(
            &mut a,
            row,
            1,
            false,
            &ForwardContext::new(g).with_override(&[11]),
            0,
        )
        .unwrap();
    assert!(!a.is_prestaged());
    assert_eq!(a.history(), &[hist[1], 11]);
    // Many single prestages never consumed: the ring reuses their regions,
    // their leases are released, and a forward on a reused region is refused.
    layer.prestage(&mut b, &[1], g, 0).unwrap();
    let old = layer.snapshot_aux(&b, g, 0).unwrap();
    for i in 0..200u32 {
        layer.prestage(&mut a, &[i % 30], g, 0).unwrap();
        layer.restore_aux(&mut a, &old, g, 0).unwrap();
    }
    g.synchronize(0).unwrap();
    // At most the ring (64 tokens of 4 rows) and one batch slot stay pinned,
    // not the 800 rows of 200 prestages.
    assert!(
        fx.table.pinned(g) <= 65 * 4,
        "ring leases not released: {}",
        fx.table.pinned(g)
    );
    let e = err_text(layer.forward(&mut b, row, 1, false, &ForwardContext::new(g), 0));
    assert!(e.contains("is stale"), "{e}");
    g.free(row).unwrap();
    fx.finish(layer, vec![a, b]);
}

#[test]
fn fp8_rows_give_the_same_highway_as_their_bf16_rounding() {
    use layer_common::{bf16_bits, e4m3};
    let gpu = CpuBackend::new_debug();
    let g: &dyn GpuBackend = &gpu;
    let start = g.live_alloc_count();
    let small = Small::new(8);
    let hd = small.head_dim;
    let rows = small.table_bits.len() / hd;
    let mut r = Rng(88);
    let bytes: Vec<u8> = (0..rows * hd)
        .map(|_| {
            loop {
                let b = r.below(256) as u8;
                if b & 0x7f != 0x7f {
                    break b;
                }
            }
        })
        .collect();
    let scales: Vec<f32> = (0..rows).map(|_| 0.05 + r.unit().abs() * 0.3).collect();
    let bf: Vec<u16> = (0..rows * hd)
        .map(|i| bf16_bits(e4m3(bytes[i]) * scales[i / hd]))
        .collect();
    let t8 = TestTable::new_fp8(g, &bytes, &scales, hd, 9).unwrap();
    let t16 = TestTable::new(g, &bf, hd, 9).unwrap();
    let mut l8 = small.layer(g, t8.clone(), 4).unwrap();
    let mut l16 = small.layer(g, t16.clone(), 4).unwrap();
    let c = small.channels();
    let toks = tokens(&mut r, 11, 40);
    let hw = highway(&mut r, 11, c);
    let mut outs = Vec::new();
    for l in [&l8, &l16] {
        let mut st = l.new_seq_state(g).unwrap();
        let p = upload(g, &hw, "hw");
        l.forward(
            &mut st,
            p,
            11,
            true,
            &ForwardContext::new(g).with_host_ids(&toks),
            0,
        )
        .unwrap();
        outs.push(bits(&download(g, p, 11 * c, 0)));
        g.free(p).unwrap();
        l.release_seq_state(&mut st, g).unwrap();
    }
    assert_eq!(outs[0], outs[1]);
    l8.free(g).unwrap();
    l16.free(g).unwrap();
    assert_eq!(t8.pinned(g) + t16.pinned(g), 0);
    t8.free(g);
    t16.free(g);
    assert_no_leaks(g, start);
}

#[test]
fn leases_outlive_the_call_until_the_gather_has_run() {
    use metrale_gpu_runtime::cpu::Latch;
    use metrale_gpu_runtime::gpu::LaunchConfig;
    let fx = Fx::new(9, 5);
    let g = fx.g();
    let layer = fx.layer(8);
    let c = layer.channels();
    let s = fx.s;
    let mut st = layer.new_seq_state(g).unwrap();
    let hw = upload(g, &vec![0.5; 3 * c], "hw");
    for staged in [false, true] {
        // Holds the stream until the test opens it, so the forward's gather
        // is still queued when the forward returns, however slow the machine.
        let latch = Latch::new();
        let stall = latch.kernel(g, "test", &format!("stall_{staged}")).unwrap();
        g.launch(stall, LaunchConfig::linear(1, 1)).run(s).unwrap();
        if staged {
            layer.prestage_batch(&mut [&mut st], &[4], 1, g, s).unwrap();
            layer
                .forward(&mut st, hw, 1, false, &ForwardContext::new(g), s)
                .unwrap();
        } else {
            layer
                .forward(
                    &mut st,
                    hw,
                    3,
                    true,
                    &ForwardContext::new(g).with_host_ids(&[1, 2, 3]),
                    s,
                )
                .unwrap();
        }
        assert!(
            fx.table.pinned(g) > 0,
            "pins dropped before the gather ran (staged: {staged})"
        );
        latch.open();
        g.synchronize(s).unwrap();
        assert_eq!(
            fx.table.pinned(g),
            0,
            "pins kept after the gather ran (staged: {staged})"
        );
    }
    assert_eq!(fx.table.bare_releases(), 0);
    g.free(hw).unwrap();
    fx.finish(layer, vec![st]);
}
