//! A checkpoint runs: its layers, over the table served resident, mapped
//! or behind the row cache, folded or not, give the same highway bit for
//! bit, and nothing stays allocated afterwards.

use std::sync::Arc;

use metrale_checkpoint::runtime::TableMode;
use metrale_checkpoint::synth::write_synthetic;
use metrale_checkpoint::{Checkpoint, InitOptions, Preset, TableDType};
use metrale_gpu_runtime::cpu::CpuBackend;
use metrale_gpu_runtime::gpu::GpuBackend;
use metrale_model_layers::layers::ple::ForwardContext;
use metrale_storage::cached::CacheConfig;

/// Run `tokens` in the given chunks through every site of `ck`, with the
/// table served in `mode`; returns the final highway.
fn forward_all(ck: &Checkpoint, mode: TableMode, tokens: &[u32], chunks: &[usize]) -> Vec<f32> {
    let gpu: Arc<dyn GpuBackend> = Arc::new(CpuBackend::new());
    let start = gpu.live_alloc_count();
    let width = ck.spec.channels();
    let mut host: Vec<f32> = (0..tokens.len() * width)
        .map(|i| ((i % 89) as f32 - 44.0) / 50.0)
        .collect();
    {
        let mut layers = Vec::new();
        for s in 0..ck.sites.len() {
            let table = match mode {
                // A small cache, so the forward evicts and re-reads rows.
                TableMode::Cached => ck.open_cached_table(s, CacheConfig::new(64), gpu.clone()),
                m => ck.open_table(s, m, gpu.clone()),
            }
            .unwrap();
            layers.push(ck.build_layer(s, table, 32, gpu.as_ref()).unwrap());
        }
        let hw = gpu.alloc(host.len() * 4, "highway").unwrap();
        let bytes: Vec<u8> = host.iter().flat_map(|v| v.to_le_bytes()).collect();
        gpu.copy_h2d(&bytes, hw).unwrap();
        let mut states: Vec<_> = layers
            .iter()
            .map(|l| l.new_seq_state(gpu.as_ref()).unwrap())
            .collect();
        let mut at = 0;
        for &n in chunks {
            let toks = &tokens[at..at + n];
            let rows = hw.offset(at * width * 4);
            for (l, st) in layers.iter().zip(states.iter_mut()) {
                let ctx = ForwardContext::new(gpu.as_ref()).with_host_ids(toks);
                l.forward(st, rows, n, at == 0, &ctx, 0).unwrap();
            }
            at += n;
        }
        assert_eq!(at, tokens.len());
        gpu.synchronize(0).unwrap();
        let mut out = vec![0u8; host.len() * 4];
        gpu.copy_d2h(hw, &mut out).unwrap();
        for (v, c) in host.iter_mut().zip(out.chunks_exact(4)) {
            *v = f32::from_le_bytes(c.try_into().unwrap());
        }
        for (l, st) in layers.iter().zip(states.iter_mut()) {
            l.release_seq_state(st, gpu.as_ref()).unwrap();
        }
        for l in layers.iter_mut() {
            l.free(gpu.as_ref()).unwrap();
        }
        gpu.free(hw).unwrap();
    }
    assert_eq!(
        gpu.live_alloc_count(),
        start,
        "leaked:\n{}",
        gpu.live_report()
    );
    host
}

fn check_modes(opts: &InitOptions) {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("ck");
    write_synthetic(&dir, opts, &mut |_, _| {}).unwrap();
    let ck = Checkpoint::open(&dir).unwrap();
    let tokens: Vec<u32> = (0..40u32)
        .map(|i| if i == 19 { 256 } else { (i * 37 + 5) % 4096 })
        .collect();
    let resident = forward_all(&ck, TableMode::Resident, &tokens, &[40]);
    let width = ck.spec.channels();
    let input: Vec<f32> = (0..tokens.len() * width)
        .map(|i| ((i % 89) as f32 - 44.0) / 50.0)
        .collect();
    assert!(resident.iter().all(|v| v.is_finite()));
    assert_ne!(resident, input, "the layers changed nothing");
    for (mode, chunks) in [
        (TableMode::Resident, &[17usize, 23][..]),
        (TableMode::Mapped, &[40][..]),
        (TableMode::Cached, &[5, 30, 5][..]),
    ] {
        let h = forward_all(&ck, mode, &tokens, chunks);
        let same = metrale_testkit::same_bits(&h, &resident);
        assert!(
            same,
            "{mode:?} with chunks {chunks:?} differs from resident"
        );
    }
}

#[test]
fn every_table_mode_gives_the_same_highway_on_a_folded_table() {
    check_modes(&InitOptions {
        preset: Preset::Tiny,
        table_rows: Some(1024),
        dtype: TableDType::Bf16,
        seed: 5,
    });
}

#[test]
fn every_table_mode_gives_the_same_highway_on_a_full_fp8_table() {
    check_modes(&InitOptions {
        preset: Preset::Tiny,
        table_rows: None,
        dtype: TableDType::Fp8,
        seed: 6,
    });
}
