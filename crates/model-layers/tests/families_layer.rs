//! The Engram and LongCat layers against the numpy reference
//! (`reference/families_layer.py`, fixtures in `fixtures/families_layer/`):
//! an Engram-demo-like site with its short conv, a DeepSeek-V4.1-like site
//! without a conv over block-scaled FP8 rows, and a LongCat site (the mean
//! with the word embedding). Each is run as one prefill, as the fixture's
//! chunks, token by token, through `forward_batch` (eager and prestaged),
//! through the single-sequence prestage, and across a snapshot and restore;
//! every path must give the same bits, and those bits must match the
//! reference to FP32 accuracy. The V4.1 site follows the published gate:
//! `rms_norm_eps` in both gate norms, `copysign` at a zero dot product (a
//! token with an all-zero highway row) and masked tokens, passed on every
//! path. Also the FP8 block converter of
//! `metrale_storage::dtype` against the bytes and values the reference
//! computes.

mod layer_common;

use std::path::PathBuf;
use std::sync::Arc;

use layer_common::{TestTable, assert_no_leaks, download, upload};
use metrale_gpu_runtime::cpu::CpuBackend;
use metrale_gpu_runtime::gpu::GpuBackend;
use metrale_model_layers::layers::ple::ids::PleIdDims;
use metrale_model_layers::layers::ple::{
    Combine, ForwardContext, GatedSpec, HashFamily, LayerError, PleLayer, PleSeqState, PleWeights,
    SiteSpec,
};
use metrale_storage::dtype::{fp8_block_bytes_to_f32, quantize_fp8_block_row};
use serde_json::Value;

fn load(name: &str) -> Value {
    let p = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../fixtures/families_layer")
        .join(format!("{name}.json"));
    let text = std::fs::read(&p).unwrap_or_else(|e| panic!("reading {}: {e}", p.display()));
    serde_json::from_slice(&text).unwrap()
}

fn u64s(v: &Value) -> Vec<u64> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap())
        .collect()
}

fn f32s(v: &Value) -> Vec<f32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_f64().unwrap() as f32)
        .collect()
}

fn usize_of(m: &Value, k: &str) -> usize {
    m[k].as_u64().unwrap_or_else(|| panic!("fixture field {k}")) as usize
}

/// One fixture site: its spec, weights, table bytes and expected results.
struct Site {
    meta: Value,
    spec: SiteSpec,
    tokens: Vec<u32>,
    chunks: Vec<usize>,
    hw_in: Vec<f32>,
    want: Vec<f32>,
    c: usize,
    /// One flag per token (V4.1), else `None`.
    masked: Option<Vec<bool>>,
}

impl Site {
    fn new(name: &str) -> Site {
        let m = load(name);
        let family = m["family"].as_str().unwrap();
        let (hidden, hc, head_dim) = (
            usize_of(&m, "hidden"),
            usize_of(&m, "hc_mult"),
            usize_of(&m, "head_dim"),
        );
        let longcat = family == "longcat";
        let dims = PleIdDims {
            ngram_size: usize_of(&m, "ngram_size"),
            heads_per_ngram: usize_of(&m, "heads_per_ngram"),
            multipliers: if longcat {
                Vec::new()
            } else {
                u64s(&m["multipliers"])
            },
            head_vocab_sizes: u64s(&m["head_vocab_sizes"]),
            head_offsets: u64s(&m["head_offsets"]),
            eos_token_id: if longcat {
                usize_of(&m, "eos_token_id") as u32
            } else {
                usize_of(&m, "pad_id") as u32
            },
            family: if longcat {
                HashFamily::LongCat {
                    vocab_size: m["vocab_size"].as_u64().unwrap(),
                }
            } else {
                HashFamily::Engram {
                    token_map: None,
                    hashed_vocab: m["hashed_vocab"].as_u64().unwrap(),
                }
            },
        };
        let (kernel, dilation) = if longcat {
            (1, 1)
        } else {
            (usize_of(&m, "conv_kernel"), usize_of(&m, "dilation"))
        };
        let mut spec = SiteSpec::new(dims, head_dim, hidden, hc, kernel, dilation);
        if longcat {
            spec.combine = Combine::Mean;
        } else {
            let conv = m["conv"].as_bool().unwrap();
            let g = match m["gate"].as_str().unwrap() {
                "engram_demo" => GatedSpec::engram(conv),
                "deepseek_v41" => {
                    spec.rms_eps = m["rms_eps"].as_f64().unwrap() as f32;
                    GatedSpec::deepseek_v41(conv)
                }
                other => panic!("gate rule {other}"),
            };
            // The reference's epsilons are those of the family.
            assert_eq!(
                g.eps(spec.rms_eps),
                [
                    m["query_eps"].as_f64().unwrap() as f32,
                    m["key_eps"].as_f64().unwrap() as f32,
                    m["conv_eps"].as_f64().unwrap() as f32
                ]
            );
            spec.combine = Combine::Gated(g);
        }
        spec.validate().unwrap();
        let tokens = u64s(&m["tokens"]).into_iter().map(|t| t as u32).collect();
        let chunks = u64s(&m["chunks"]).into_iter().map(|t| t as usize).collect();
        let masked = m.get("masked").map(|v| {
            v.as_array()
                .unwrap()
                .iter()
                .map(|f| f.as_bool().unwrap())
                .collect()
        });
        Site {
            masked,
            hw_in: f32s(&m["highway_in"]),
            want: f32s(&m["highway_out"]),
            c: hidden * hc,
            meta: m,
            spec,
            tokens,
            chunks,
        }
    }

    fn weights(&self) -> PleWeights {
        let w = &self.meta["weights"];
        let bits = |k: &str| -> Vec<u16> {
            w.get(k)
                .map(|v| u64s(v).into_iter().map(|b| b as u16).collect())
                .unwrap_or_default()
        };
        let floats = |k: &str| w.get(k).map(f32s).unwrap_or_default();
        PleWeights {
            key_proj: bits("key_proj"),
            value_proj: bits("value_proj"),
            norm_key: floats("norm_key"),
            norm_query: floats("norm_query"),
            norm_conv: floats("norm_conv"),
            conv1d: floats("conv1d"),
            key_bias: floats("key_bias"),
            value_bias: floats("value_bias"),
        }
    }

    fn table(&self, g: &dyn GpuBackend) -> Arc<TestTable> {
        let head_dim = self.spec.head_dim;
        let raw = u64s(&self.meta["table"]);
        match self.meta["table_dtype"].as_str().unwrap() {
            "bf16" => {
                let bits: Vec<u16> = raw.into_iter().map(|b| b as u16).collect();
                TestTable::new(g, &bits, head_dim, 7).unwrap()
            }
            "fp8_e4m3_block32" => {
                let bytes: Vec<u8> = raw.into_iter().map(|b| b as u8).collect();
                TestTable::new_block_fp8(g, &bytes, head_dim, 7).unwrap()
            }
            other => panic!("table dtype {other}"),
        }
    }

    fn t(&self) -> usize {
        self.tokens.len()
    }

    /// The context of tokens `t0..t0 + n`, with their mask flags.
    fn ctx<'a>(&'a self, g: &'a dyn GpuBackend, t0: usize, n: usize) -> ForwardContext<'a> {
        let ctx = ForwardContext::new(g).with_host_ids(&self.tokens[t0..t0 + n]);
        self.with_mask(ctx, t0, n)
    }

    /// `ctx` with the mask flags of tokens `t0..t0 + n`, when the site has any.
    fn with_mask<'a>(&'a self, ctx: ForwardContext<'a>, t0: usize, n: usize) -> ForwardContext<'a> {
        match &self.masked {
            Some(m) => ctx.with_masked(&m[t0..t0 + n]),
            None => ctx,
        }
    }
}

/// The layer over `chunks` of the site's tokens on one sequence (the first
/// chunk fresh), from state `st`; returns the highway rows written.
fn run_chunks(
    layer: &PleLayer,
    site: &Site,
    g: &dyn GpuBackend,
    st: &mut PleSeqState,
    from: usize,
    chunks: &[usize],
) -> Vec<f32> {
    let c = site.c;
    let mut got = Vec::new();
    let mut t0 = from;
    for &n in chunks {
        let hw = upload(g, &site.hw_in[t0 * c..(t0 + n) * c], "test.highway");
        let ctx = site.ctx(g, t0, n);
        layer.forward(st, hw, n, t0 == 0, &ctx, 0).unwrap();
        got.extend(download(g, hw, n * c, 0));
        g.free(hw).unwrap();
        t0 += n;
    }
    got
}

/// Two sequences through `forward_batch`, one token a step, over three
/// highway rows (the last one padding): even steps hand the tokens to the
/// step, odd steps prestage them with `prestage_batch` first.
fn run_batch(layer: &PleLayer, site: &Site, g: &dyn GpuBackend) -> [Vec<f32>; 2] {
    let c = site.c;
    let mut a = layer.new_seq_state(g).unwrap();
    let mut b = layer.new_seq_state(g).unwrap();
    let mut out = [Vec::new(), Vec::new()];
    let hw = g.alloc(3 * c * 4, "test.batch_highway").unwrap();
    for t in 0..site.t() {
        let mut rows = site.hw_in[t * c..(t + 1) * c].repeat(2);
        rows.extend(vec![0.5f32; c]);
        layer_common::write(g, &rows, hw, 0);
        let toks = [site.tokens[t]; 2];
        let flags = site.masked.as_ref().map(|m| [m[t]; 2]);
        let mut states = [&mut a, &mut b];
        let mut ctx = ForwardContext::new(g);
        if let Some(f) = &flags {
            ctx = ctx.with_masked(f);
        }
        if t % 2 == 1 {
            layer.prestage_batch(&mut states, &toks, 3, g, 0).unwrap();
            layer.forward_batch(&mut states, hw, 3, &ctx, 0).unwrap();
        } else {
            let ctx = ctx.with_host_ids(&toks);
            layer.forward_batch(&mut states, hw, 3, &ctx, 0).unwrap();
        }
        let got = download(g, hw, 3 * c, 0);
        out[0].extend_from_slice(&got[..c]);
        out[1].extend_from_slice(&got[c..2 * c]);
    }
    g.free(hw).unwrap();
    layer.release_seq_state(&mut a, g).unwrap();
    layer.release_seq_state(&mut b, g).unwrap();
    out
}

/// Token by token through the single-sequence prestage (`prestage`, then a
/// forward that takes the staged rows and no ids).
fn run_prestaged(layer: &PleLayer, site: &Site, g: &dyn GpuBackend) -> Vec<f32> {
    let c = site.c;
    let mut st = layer.new_seq_state(g).unwrap();
    let mut got = Vec::new();
    // The first token resets the carry; the rest are prestaged.
    got.extend(run_chunks(layer, site, g, &mut st, 0, &[1]));
    for t in 1..site.t() {
        layer
            .prestage(&mut st, &site.tokens[t..t + 1], g, 0)
            .unwrap();
        let hw = upload(g, &site.hw_in[t * c..(t + 1) * c], "test.highway");
        let ctx = site.with_mask(ForwardContext::new(g), t, 1);
        layer.forward(&mut st, hw, 1, false, &ctx, 0).unwrap();
        got.extend(download(g, hw, c, 0));
        g.free(hw).unwrap();
    }
    layer.release_seq_state(&mut st, g).unwrap();
    got
}

/// (max abs, max abs relative to max(|want|, 1)).
fn errors(got: &[f32], want: &[f32]) -> (f64, f64) {
    assert_eq!(got.len(), want.len());
    got.iter().zip(want).fold((0f64, 0f64), |(a, r), (&g, &w)| {
        let d = (g as f64 - w as f64).abs();
        (a.max(d), r.max(d / (w.abs() as f64).max(1.0)))
    })
}

fn assert_same_bits(what: &str, got: &[f32], want: &[f32]) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    if let Some(i) = (0..got.len()).find(|&i| got[i].to_bits() != want[i].to_bits()) {
        panic!(
            "{what}: value {i} is {} where one whole prefill gives {}",
            got[i], want[i]
        );
    }
}

// Tolerance. The reference computes in float64 from the same BF16 (or
// decoded FP8) inputs, so the difference is the layer's float32 rounding.
// The projections sum 32 to 192 exact BF16 products (relative error about
// E * 2^-24 of the sum of |terms|, under 2e-5 of the outputs here); the
// norms and the gate add a few ulp; the gate slope is at most
// 0.25 / (2 sqrt(min |g|)) <= 1.3 (`min_abs_gate` of the fixtures is
// 0.0099 and above). Highway values are below 7 (f32 ulp 5e-7). Hence
// 2e-5 relative to max(|value|, 1): above the measured maximum (printed),
// while one BF16 ulp of a weight, a wrong norm form (w vs 1 + w) or a
// missing bias moves outputs by 1e-3 or more.
const TOL: f64 = 2e-5;

fn check_site(name: &str) {
    let site = Site::new(name);
    let gpu = CpuBackend::new_debug();
    let g: &dyn GpuBackend = &gpu;
    let start = g.live_alloc_count();
    let table = site.table(g);
    // max_tokens 4: the longer chunks split inside the layer as well.
    let mut layer = PleLayer::new(&site.spec, site.weights(), Arc::clone(&table) as _, 4, g)
        .unwrap_or_else(|e| panic!("{name}: {e}"));
    let t = site.t();
    let c = site.c;
    assert_eq!(layer.conv_state_bytes(), site.spec.conv_bytes());

    // One prefill of every token.
    let mut st = layer.new_seq_state(g).unwrap();
    let whole = run_chunks(&layer, &site, g, &mut st, 0, &[t]);
    let (abs, rel) = errors(&whole, &site.want);
    println!("{name}: highway vs reference: max abs {abs:.3e}, max rel {rel:.3e}");
    assert!(rel <= TOL, "{name}: error {rel:e} over {TOL:e}");
    let hist: Vec<u32> = u64s(&site.meta["history_out"])
        .into_iter()
        .map(|v| v as u32)
        .collect();
    assert_eq!(st.history(), &hist[..], "{name}: history");
    let blob = layer.snapshot_aux(&st, g, 0).unwrap();
    assert_eq!(
        blob.len(),
        site.spec.aux_blob_len(),
        "{name}: aux blob size"
    );
    let conv: Vec<f32> = blob[4 + 4 * hist.len()..]
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
        .collect();
    let want_conv = f32s(&site.meta["conv_state_out"]);
    let (cabs, crel) = errors(&conv, &want_conv);
    println!("{name}: conv state vs reference: max abs {cabs:.3e}");
    assert!(crel <= TOL, "{name}: conv state error {crel:e}");
    layer.release_seq_state(&mut st, g).unwrap();

    // The fixture's chunks, and token by token.
    let mut st = layer.new_seq_state(g).unwrap();
    let chunked = run_chunks(&layer, &site, g, &mut st, 0, &site.chunks);
    assert_same_bits(&format!("{name} chunked"), &chunked, &whole);
    layer.release_seq_state(&mut st, g).unwrap();
    let mut st = layer.new_seq_state(g).unwrap();
    let ones = vec![1; t];
    let single = run_chunks(&layer, &site, g, &mut st, 0, &ones);
    assert_same_bits(&format!("{name} token by token"), &single, &whole);
    layer.release_seq_state(&mut st, g).unwrap();

    // The batched decode step, eager and prestaged, and the seed prestage.
    let [ba, bb] = run_batch(&layer, &site, g);
    assert_same_bits(&format!("{name} batch row 0"), &ba, &whole);
    assert_same_bits(&format!("{name} batch row 1"), &bb, &whole);
    let pre = run_prestaged(&layer, &site, g);
    assert_same_bits(&format!("{name} prestaged"), &pre, &whole);

    // Snapshot after the first half, restore into a new carry, go on.
    let half = t / 2;
    let mut st = layer.new_seq_state(g).unwrap();
    let mut got = run_chunks(&layer, &site, g, &mut st, 0, &[half]);
    let blob = layer.snapshot_aux(&st, g, 0).unwrap();
    layer.release_seq_state(&mut st, g).unwrap();
    let mut back = layer.new_seq_state(g).unwrap();
    layer.restore_aux(&mut back, &blob, g, 0).unwrap();
    if site.masked.is_none() {
        assert_eq!(back.history(), &site.tokens[half - (hist.len())..half]);
    }
    got.extend(run_chunks(&layer, &site, g, &mut back, half, &[t - half]));
    assert_same_bits(&format!("{name} restored"), &got, &whole);
    assert_eq!(got.len(), t * c);
    layer.release_seq_state(&mut back, g).unwrap();

    layer.free(g).unwrap();
    assert_eq!(table.pinned(g), 0, "{name}: leases left pinned");
    table.free(g);
    assert_no_leaks(g, start);
}

#[test]
fn engram_demo_with_its_short_conv_matches_the_reference() {
    check_site("engram_demo_conv");
}

#[test]
fn engram_v41_without_conv_over_fp8_block_rows_matches_the_reference() {
    check_site("engram_v41_fp8");
}

#[test]
fn longcat_mean_with_the_word_embedding_matches_the_reference() {
    check_site("longcat");
}

#[test]
fn fp8_block_converter_matches_the_reference() {
    let m = load("fp8_block");
    for (i, case) in m["cases"].as_array().unwrap().iter().enumerate() {
        let values = f32s(&case["values"]);
        let want: Vec<u8> = u64s(&case["bytes"]).into_iter().map(|b| b as u8).collect();
        let mut bytes = Vec::new();
        quantize_fp8_block_row(&values, &mut bytes);
        assert_eq!(bytes, want, "case {i}: quantised bytes");
        let mut back = vec![0f32; values.len()];
        fp8_block_bytes_to_f32(&want, &mut back);
        let decoded = f32s(&case["decoded"]);
        assert_same_bits(&format!("case {i} decoded"), &back, &decoded);
    }
}

#[test]
fn weights_a_combination_does_not_use_are_refused() {
    let site = Site::new("engram_v41_fp8");
    let gpu = CpuBackend::new_debug();
    let g: &dyn GpuBackend = &gpu;
    let start = g.live_alloc_count();
    let table = site.table(g);
    let mut w = site.weights();
    w.conv1d = vec![0.0; site.c * 4];
    let e = PleLayer::new(&site.spec, w, Arc::clone(&table) as _, 4, g)
        .unwrap_err()
        .to_string();
    assert!(e.contains("conv1d"), "{e}");
    let mut w = site.weights();
    w.value_bias.clear();
    let e = PleLayer::new(&site.spec, w, Arc::clone(&table) as _, 4, g)
        .unwrap_err()
        .to_string();
    assert!(e.contains("value_bias"), "{e}");
    table.free(g);

    // A block-scaled FP8 table needs rows of whole 32-value blocks.
    let mut spec = site.spec.clone();
    spec.head_dim = 16;
    let rows = vec![0u8; usize_of(&site.meta, "table_rows") * 17];
    let odd = TestTable::new_block_fp8(g, &rows, 16, 7).unwrap();
    let e = PleLayer::new(&spec, site.weights(), Arc::clone(&odd) as _, 4, g)
        .unwrap_err()
        .to_string();
    assert!(e.contains("Fp8E4M3Block32") && e.contains("16"), "{e}");
    odd.free(g);
    assert_no_leaks(g, start);
}

#[test]
fn a_token_mask_is_refused_where_the_published_layer_has_none() {
    let gpu = CpuBackend::new_debug();
    let g: &dyn GpuBackend = &gpu;
    let start = g.live_alloc_count();
    for (name, takes) in [
        ("engram_demo_conv", false),
        ("longcat", false),
        ("engram_v41_fp8", true),
    ] {
        let site = Site::new(name);
        let table = site.table(g);
        let mut layer =
            PleLayer::new(&site.spec, site.weights(), Arc::clone(&table) as _, 4, g).unwrap();
        let mut st = layer.new_seq_state(g).unwrap();
        let c = site.c;
        let hw = upload(g, &site.hw_in[..2 * c], "test.highway");
        let toks = &site.tokens[..2];
        // An all-clear mask is refused too where no mask exists: silently
        // ignoring it would hide a caller's mistake.
        let clear = [false, false];
        let ctx = ForwardContext::new(g)
            .with_host_ids(toks)
            .with_masked(&clear);
        let r = layer.forward(&mut st, hw, 2, true, &ctx, 0);
        if takes {
            r.unwrap();
        } else {
            let e = r.unwrap_err();
            assert!(matches!(e, LayerError::TokenMask(_)), "{name}: {e:?}");
            assert!(e.to_string().contains("no token mask"), "{name}: {e}");
            // Nothing ran: the carry is still fresh.
            assert!(st.history().is_empty(), "{name}");
        }
        // One flag per token.
        let short = [true];
        let ctx = ForwardContext::new(g)
            .with_host_ids(toks)
            .with_masked(&short);
        let e = layer.forward(&mut st, hw, 2, true, &ctx, 0).unwrap_err();
        assert!(matches!(e, LayerError::TokenMask(_)), "{name}: {e:?}");
        if takes {
            assert!(e.to_string().contains("1 flags for 2 tokens"), "{e}");
            // A set flag cannot be captured: nothing would redo it on replay.
            let one = [true];
            let ctx = ForwardContext::new(g)
                .with_host_ids(&toks[..1])
                .with_masked(&one)
                .capturing(true);
            let e = layer.forward(&mut st, hw, 1, false, &ctx, 0).unwrap_err();
            assert!(matches!(e, LayerError::Capture(_)), "{e:?}");
        }
        g.free(hw).unwrap();
        layer.release_seq_state(&mut st, g).unwrap();
        layer.free(g).unwrap();
        table.free(g);
    }
    assert_no_leaks(g, start);
}

#[test]
fn a_masked_token_leaves_its_highway_rows_and_restarts_the_look_back() {
    // Every token masked: the highway passes through bit for bit, and the
    // carried history reads the pad id (as a fresh sequence's does).
    let site = Site::new("engram_v41_fp8");
    let gpu = CpuBackend::new_debug();
    let g: &dyn GpuBackend = &gpu;
    let start = g.live_alloc_count();
    let table = site.table(g);
    let mut layer =
        PleLayer::new(&site.spec, site.weights(), Arc::clone(&table) as _, 4, g).unwrap();
    let (t, c) = (site.t(), site.c);
    let mut st = layer.new_seq_state(g).unwrap();
    let hw = upload(g, &site.hw_in, "test.highway");
    let all = vec![true; t];
    let ctx = ForwardContext::new(g)
        .with_host_ids(&site.tokens)
        .with_masked(&all);
    layer.forward(&mut st, hw, t, true, &ctx, 0).unwrap();
    assert_same_bits("all masked", &download(g, hw, t * c, 0), &site.hw_in);
    let pad = usize_of(&site.meta, "pad_id") as u32;
    assert!(st.history().iter().all(|&v| v == pad), "{:?}", st.history());
    g.free(hw).unwrap();
    layer.release_seq_state(&mut st, g).unwrap();
    layer.free(g).unwrap();
    table.free(g);
    assert_no_leaks(g, start);
}
