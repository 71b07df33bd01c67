//! The Rust layer against the numpy reference (`reference/ple_layer.py`):
//! the fixtures of `fixtures/layer/` (small geometry, 32 tokens with a
//! mid-sequence EOS, six chunks with the carry passed between them).

mod layer_common;

use std::path::PathBuf;
use std::sync::Arc;

use layer_common::{TestTable, assert_no_leaks, download, upload};
use metrale_gpu_runtime::cpu::CpuBackend;
use metrale_gpu_runtime::gpu::GpuBackend;
use metrale_model_layers::layers::ple::ids::PleIdDims;
use metrale_model_layers::layers::ple::{ForwardContext, PleLayer, PleWeights, SiteSpec};
use serde_json::Value;

fn dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/layer")
}

fn read_bytes(meta: &Value, name: &str) -> Vec<u8> {
    let f = meta["files"][name].as_str().unwrap();
    std::fs::read(dir().join(f)).unwrap_or_else(|e| panic!("reading fixture {f}: {e}"))
}

fn read_u16(meta: &Value, name: &str) -> Vec<u16> {
    read_bytes(meta, name)
        .chunks_exact(2)
        .map(|c| u16::from_le_bytes([c[0], c[1]]))
        .collect()
}

fn read_f32(meta: &Value, name: &str) -> Vec<f32> {
    read_bytes(meta, name)
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}

fn usize_of(meta: &Value, k: &str) -> usize {
    meta[k]
        .as_u64()
        .unwrap_or_else(|| panic!("fixture field {k}")) as usize
}

fn u64s(meta: &Value, k: &str) -> Vec<u64> {
    meta[k]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| {
            v.as_u64()
                .or_else(|| v.as_str().and_then(|s| s.parse().ok()))
                .unwrap()
        })
        .collect()
}

/// Errors of `got` against `want`: (max abs, mean abs, max rel).
fn errors(got: &[f32], want: &[f32]) -> (f64, f64, f64) {
    assert_eq!(got.len(), want.len());
    let (mut max_abs, mut sum_abs, mut max_rel) = (0f64, 0f64, 0f64);
    for (g, w) in got.iter().zip(want) {
        let a = (*g as f64 - *w as f64).abs();
        max_abs = max_abs.max(a);
        sum_abs += a;
        max_rel = max_rel.max(a / (w.abs() as f64).max(1e-3));
    }
    (max_abs, sum_abs / got.len() as f64, max_rel)
}

// Tolerance. The reference computes in float64 from the same BF16 inputs,
// so the difference is float32 rounding alone. Products of two BF16 values
// are exact in f32; the 64-term projection, norm and dot reductions each
// carry at most about 64 * 2^-24 (4e-6) relative error of the sum of their
// |terms|, usually far less. The gate passes an error in g through
// sigmoid'(z) * 1/(2 sqrt|g|) <= 0.25 * 2.8 here, since the fixture's
// smallest |g| is 0.033 (`min_abs_gate` in small.json; the 1e-6 floor, where
// the slope reaches 500, is never approached). Highway values are below
// ~10, whose f32 ulp is 1e-6. Hence 1e-5 absolute: ten times the measured
// maximum (about 1e-6), while one BF16 ulp of a single weight or a wrong
// conv tap moves outputs by 1e-3 or more.
const TOL_ABS: f64 = 1e-5;

#[test]
fn layer_matches_the_numpy_reference_across_chunks() {
    let meta: Value =
        serde_json::from_slice(&std::fs::read(dir().join("small.json")).unwrap()).unwrap();
    let gpu = CpuBackend::new_debug();
    let g: &dyn GpuBackend = &gpu;
    let start = g.live_alloc_count();
    let hidden = usize_of(&meta, "hidden");
    let hc = usize_of(&meta, "hc_mult");
    let head_dim = usize_of(&meta, "head_dim");
    let c = hidden * hc;
    let dims = PleIdDims {
        ngram_size: usize_of(&meta, "ngram_size"),
        heads_per_ngram: usize_of(&meta, "heads_per_ngram"),
        multipliers: u64s(&meta, "multipliers"),
        head_vocab_sizes: u64s(&meta, "head_vocab_sizes"),
        head_offsets: u64s(&meta, "head_offsets"),
        eos_token_id: usize_of(&meta, "eos") as u32,
        family: Default::default(),
    };
    let weights = PleWeights {
        key_proj: read_u16(&meta, "key_proj"),
        value_proj: read_u16(&meta, "value_proj"),
        norm_key: read_f32(&meta, "norm_key"),
        norm_query: read_f32(&meta, "norm_query"),
        norm_conv: read_f32(&meta, "norm_conv"),
        conv1d: read_f32(&meta, "conv1d"),
        key_bias: Vec::new(),
        value_bias: Vec::new(),
    };
    let table = TestTable::new(g, &read_u16(&meta, "table"), head_dim, 7).unwrap();
    // max_tokens 4 makes the longer chunks split inside the layer as well.
    let mut spec = SiteSpec::new(
        dims,
        head_dim,
        hidden,
        hc,
        usize_of(&meta, "conv_kernel"),
        usize_of(&meta, "dilation"),
    );
    spec.rms_eps = meta["eps"].as_f64().unwrap() as f32;
    let mut layer = PleLayer::new(&spec, weights, Arc::clone(&table) as _, 4, g).unwrap();
    let tokens: Vec<u32> = u64s(&meta, "tokens")
        .into_iter()
        .map(|t| t as u32)
        .collect();
    let chunks = u64s(&meta, "chunks");
    let hw_in = read_f32(&meta, "highway_in");
    let want = read_f32(&meta, "highway_out");
    let mut st = layer.new_seq_state(g).unwrap();
    let mut got = Vec::new();
    let mut t0 = 0;
    for (i, &n) in chunks.iter().enumerate() {
        let n = n as usize;
        let hw = upload(g, &hw_in[t0 * c..(t0 + n) * c], "test.highway");
        let ctx = ForwardContext::new(g).with_host_ids(&tokens[t0..t0 + n]);
        layer.forward(&mut st, hw, n, i == 0, &ctx, 0).unwrap();
        got.extend(download(g, hw, n * c, 0));
        g.free(hw).unwrap();
        t0 += n;
    }
    assert!(
        meta["min_abs_gate"].as_f64().unwrap() > 0.01,
        "the tolerance assumes |g| >= 0.01"
    );
    let (max_abs, mean_abs, max_rel) = errors(&got, &want);
    println!(
        "highway vs reference: max abs {max_abs:.3e}, mean abs {mean_abs:.3e}, max rel {max_rel:.3e}"
    );
    assert!(
        max_abs <= TOL_ABS,
        "max abs error {max_abs:e} over {TOL_ABS:e}"
    );

    let blob = layer.snapshot_aux(&st, g, 0).unwrap();
    let hist: Vec<u32> = u64s(&meta, "history_out")
        .into_iter()
        .map(|t| t as u32)
        .collect();
    assert_eq!(st.history(), &hist[..]);
    let off = 4 + 4 * hist.len();
    let conv: Vec<f32> = blob[off..]
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect();
    let (cmax, cmean, _) = errors(&conv, &read_f32(&meta, "conv_state_out"));
    println!("conv state vs reference: max abs {cmax:.3e}, mean abs {cmean:.3e}");
    assert!(cmax <= TOL_ABS, "conv state max abs error {cmax:e}");

    layer.release_seq_state(&mut st, g).unwrap();
    layer.free(g).unwrap();
    assert_eq!(table.pinned(g), 0, "leases left pinned");
    table.free(g);
    assert_no_leaks(g, start);
}
