//! The PLE device kernels (`kernels/ple.cu`) run on a CUDA device and
//! checked against this crate's own references: the id hasher
//! ([`PleIdHasher`], docs/SPEC.md §3 (Id hash)) and the pure kernel
//! functions on the portable CPU path (gather, projection, gate, conv),
//! launched through the same argument structs the layer fills. Without a
//! device the test prints `skipped: <reason>` and checks nothing.
//!
//! Exact (bitwise) where the kernels promise the host's operation order:
//! hash, gather, project, conv, conv_batch, and the chunking and batching
//! invariance of the conv and the projection. The gate is compared within a
//! small tolerance (its sigmoid uses the device `expf`).

#![cfg(feature = "cuda")]

use metrale_gpu_runtime::args::KernelArgs;
use metrale_gpu_runtime::cuda::CudaBackend;
use metrale_gpu_runtime::gpu::{DevicePtr, GpuBackend, LaunchConfig};
use metrale_model_layers::layers::ple::device_kernels::PLE_CU;
use metrale_model_layers::layers::ple::ids::PleIdHasher;
use metrale_model_layers::layers::ple::kernels::args::{
    ConvArgs, ConvBatchArgs, GateArgs, GatherArgs, GatherRunsArgs, HashArgs, ProjectArgs,
    ProjectRangeArgs,
};
use metrale_model_layers::layers::ple::kernels::conv::{ConvDims, conv_batch_on, conv_on};
use metrale_model_layers::layers::ple::kernels::cpu::CpuPath;
use metrale_model_layers::layers::ple::kernels::gate::{GateDims, GateInputs, gate_on};
use metrale_model_layers::layers::ple::kernels::gather::{GatherDType, RowSrc, gather_rows};
use metrale_model_layers::layers::ple::kernels::gemm::{packed_as_bf16, project_on};
use metrale_model_layers::layers::ple::kernels::math::bf16_round;
use metrale_model_layers::layers::ple::kernels::pack_projection;
use metrale_testkit::Rng;
use metrale_testkit::tiny::tiny_dims;

type Gpu = CudaBackend;

/// The reference path: the one every other CPU path matches bit for bit
/// (docs/SPEC.md §5), and the device kernels too.
const REF: CpuPath = CpuPath::Portable;

fn put<T: Copy>(gpu: &Gpu, v: &[T], label: &str) -> DevicePtr {
    let bytes = std::mem::size_of_val(v);
    let p = gpu.alloc(bytes.max(1), label).unwrap();
    // SAFETY: a plain-old-data slice viewed as its bytes.
    let b = unsafe { std::slice::from_raw_parts(v.as_ptr() as *const u8, bytes) };
    gpu.copy_h2d(b, p).unwrap();
    p
}

fn get_f32(gpu: &Gpu, p: DevicePtr, n: usize) -> Vec<f32> {
    let mut b = vec![0u8; n * 4];
    gpu.copy_d2h(p, &mut b).unwrap();
    b.chunks_exact(4)
        .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
        .collect()
}

fn get_u64(gpu: &Gpu, p: DevicePtr, n: usize) -> Vec<u64> {
    let mut b = vec![0u8; n * 8];
    gpu.copy_d2h(p, &mut b).unwrap();
    b.chunks_exact(8)
        .map(|c| u64::from_le_bytes(c.try_into().unwrap()))
        .collect()
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

/// Launch kernel `name` with `args` and wait for it.
fn launch<A: KernelArgs>(gpu: &Gpu, name: &str, cfg: LaunchConfig, args: &A) {
    let g: &dyn GpuBackend = gpu;
    let k = g.kernel("ple", name).unwrap();
    g.launch(k, cfg).args(args).run(0).unwrap();
    g.synchronize(0).unwrap_or_else(|e| panic!("{name}: {e}"));
}

/// A BF16-exact value in about [-2, 2).
fn bf16(rng: &mut Rng) -> f32 {
    bf16_round((rng.next() % 4096) as f32 / 1024.0 - 2.0)
}

fn open() -> Option<Gpu> {
    match CudaBackend::new(0) {
        Ok(g) => Some(g),
        Err(e) => {
            println!("skipped: {e}");
            None
        }
    }
}

#[test]
fn ple_kernels_match_the_references() {
    let Some(gpu) = open() else { return };
    gpu.load_source("ple", "ple.cu", PLE_CU).unwrap();
    let mut rng = Rng(42);
    check_hash(&gpu);
    check_gather(&gpu, &mut rng);
    check_project(&gpu, &mut rng);
    check_gate(&gpu, &mut rng);
    check_conv(&gpu, &mut rng);
    assert_eq!(
        gpu.live_alloc_count(),
        0,
        "{}",
        (&gpu as &dyn GpuBackend).live_report()
    );
}

fn check_hash(gpu: &Gpu) {
    let eos = 7u32;
    let dims = tiny_dims(0, 2, eos);
    let hasher = PleIdHasher::new(&dims).unwrap();
    let heads = dims.ngram_heads();
    for (history, tokens) in [
        (vec![], vec![5u32, 9, 7, 11, 12, 7, 7, 3]),
        (vec![1u32, 2, 3], vec![4, 7, 5]),
        (vec![3u32, 7], vec![6]),
    ] {
        let mut want = vec![0u64; tokens.len() * heads];
        hasher
            .ids_with_history_into(&history, &tokens, &mut want)
            .unwrap();
        let hist = put(
            gpu,
            if history.is_empty() {
                &[0u32][..]
            } else {
                &history
            },
            "hist",
        );
        let toks = put(gpu, &tokens, "tokens");
        let (m, s, o) = (
            put(gpu, &dims.multipliers, "m"),
            put(gpu, &dims.head_vocab_sizes, "s"),
            put(gpu, &dims.head_offsets, "o"),
        );
        let out = gpu.alloc(want.len() * 8, "ids").unwrap();
        let a = HashArgs {
            history: hist,
            hist_len: history.len() as u32,
            tokens: toks,
            t: tokens.len() as u32,
            mults: m,
            sizes: s,
            offsets: o,
            ngram_size: dims.ngram_size as u32,
            heads_per_ngram: dims.heads_per_ngram as u32,
            eos,
            out,
        };
        launch(gpu, "hash", LaunchConfig::linear(1, 4), &a);
        assert_eq!(get_u64(gpu, out, want.len()), want, "history {history:?}");
        for p in [hist, toks, m, s, o, out] {
            gpu.dealloc(p).unwrap();
        }
    }
}

fn check_gather(gpu: &Gpu, rng: &mut Rng) {
    let (rows, hd) = (9usize, 5usize);
    let bf: Vec<u8> = (0..rows * hd)
        .flat_map(|_| ((bf16(rng).to_bits() >> 16) as u16).to_le_bytes())
        .collect();
    let f8: Vec<u8> = (0..rows * hd).map(|i| (i * 37 % 255) as u8).collect();
    let scales: Vec<f32> = (0..rows).map(|i| 0.5 + i as f32 / 7.0).collect();
    let pick = [3usize, 0, 8, 3, 5];
    // Rows in device memory, and in host-mapped memory read in place.
    let dev_bf = put(gpu, &bf, "bf16 table");
    let mapped = gpu
        .alloc_host_mapped(f8.len() + rows * 4, "fp8 table")
        .unwrap();
    // SAFETY: the mapped buffer holds f8.len() + 4 * rows bytes, used by
    // nothing else until it is freed below.
    unsafe {
        std::ptr::copy_nonoverlapping(f8.as_ptr(), mapped.host, f8.len());
        std::ptr::copy_nonoverlapping(
            scales.as_ptr() as *const u8,
            mapped.host.add(f8.len()),
            rows * 4,
        );
    }
    for dtype in [GatherDType::Bf16, GatherDType::Fp8E4M3] {
        let bf16_rows = dtype == GatherDType::Bf16;
        let refs: Vec<u64> = pick
            .iter()
            .flat_map(|&r| {
                if bf16_rows {
                    [dev_bf.offset(r * hd * 2).0, 0]
                } else {
                    [
                        mapped.device.offset(r * hd).0,
                        mapped.device.offset(f8.len() + r * 4).0,
                    ]
                }
            })
            .collect();
        let srcs: Vec<RowSrc> = pick
            .iter()
            .map(|&r| {
                if bf16_rows {
                    RowSrc {
                        data: &bf[r * hd * 2..(r + 1) * hd * 2],
                        scale: 0.0,
                    }
                } else {
                    RowSrc {
                        data: &f8[r * hd..(r + 1) * hd],
                        scale: scales[r],
                    }
                }
            })
            .collect();
        let mut want = vec![0f32; pick.len() * hd];
        gather_rows(&srcs, hd, dtype, &mut want).unwrap();
        let rp = put(gpu, &refs, "refs");
        let out = gpu.alloc(want.len() * 4, "out").unwrap();
        let a = GatherArgs {
            refs: rp,
            n: pick.len() as u32,
            head_dim: hd as u32,
            dtype: dtype.arg(),
            out,
        };
        launch(gpu, "gather", LaunchConfig::linear(2, 8), &a);
        assert_eq!(
            bits(&get_f32(gpu, out, want.len())),
            bits(&want),
            "gather {dtype:?}"
        );
        // In runs of 2 rows every 3 (one head group of each token): ref i
        // to row (i / 2) * 3 + i % 2; the rows between runs stay as they
        // were.
        let n = pick.len();
        let span = (n - 1) / 2 * 3 + (n - 1) % 2 + 1;
        let runs = put(gpu, &vec![f32::NAN; span * hd], "runs out");
        let a = GatherRunsArgs {
            refs: rp,
            n: n as u32,
            head_dim: hd as u32,
            dtype: dtype.arg(),
            out: runs,
            run: 2,
            stride: 3,
        };
        launch(gpu, "gather_runs", LaunchConfig::linear(2, 8), &a);
        let got = get_f32(gpu, runs, span * hd);
        for (row, chunk) in got.chunks_exact(hd).enumerate() {
            let want_row: Vec<u32> = if row % 3 == 2 {
                vec![f32::NAN.to_bits(); hd]
            } else {
                let i = row / 3 * 2 + row % 3;
                bits(&want[i * hd..(i + 1) * hd])
            };
            assert_eq!(
                bits(chunk),
                want_row,
                "gather_runs {dtype:?}, out row {row}"
            );
        }
        for p in [runs, rp, out] {
            gpu.dealloc(p).unwrap();
        }
    }
    gpu.dealloc(dev_bf).unwrap();
    gpu.dealloc(mapped.device).unwrap();
}

fn check_project(gpu: &Gpu, rng: &mut Rng) {
    let (e, o) = (7usize, 20usize);
    let w: Vec<u16> = (0..o * e)
        .map(|_| (bf16(rng).to_bits() >> 16) as u16)
        .collect();
    let packed = pack_projection(&w, o, e);
    let wp = put(gpu, &packed, "w");
    let mut results = Vec::new();
    let tiles = |grid| LaunchConfig {
        grid: (grid, 1, 1),
        block: (32, 8, 1),
        shared_mem_bytes: 0,
    };
    for (t, cfg) in [
        (9usize, tiles(3)),
        (9, LaunchConfig::linear(2, 64)),
        (1, tiles(1)),
    ] {
        let x: Vec<f32> = {
            let mut r = Rng(7);
            (0..t * e).map(|_| bf16(&mut r)).collect()
        };
        let mut want = vec![0f32; t * o];
        project_on(REF, &x, packed_as_bf16(&packed), &mut want, t, e, o).unwrap();
        let xp = put(gpu, &x, "x");
        let y = gpu.alloc(t * o * 4, "y").unwrap();
        let (t32, e32, o32) = (t as u32, e as u32, o as u32);
        let a = ProjectArgs {
            x: xp,
            w: wp,
            y,
            t: t32,
            e: e32,
            o: o32,
        };
        launch(gpu, "project", cfg, &a);
        let got = bits(&get_f32(gpu, y, t * o));
        assert_eq!(got, bits(&want), "project T = {t}, {cfg:?}");
        // The same chain in two step ranges, the second continuing the
        // first's sums (what the pipelined gather launches).
        let y2 = gpu.alloc(t * o * 4, "y2").unwrap();
        for (from, to, accumulate) in [(0u32, 4u32, 0u32), (4, e32, 1)] {
            let a = ProjectRangeArgs {
                x: xp,
                w: wp,
                y: y2,
                t: t32,
                e: e32,
                o: o32,
                from,
                to,
                accumulate,
            };
            launch(gpu, "project_range", cfg, &a);
        }
        let split = bits(&get_f32(gpu, y2, t * o));
        assert_eq!(split, bits(&want), "project_range T = {t}, {cfg:?}");
        results.push(got);
        for p in [y2, xp, y] {
            gpu.dealloc(p).unwrap();
        }
    }
    assert_eq!(
        results[2][..],
        results[0][..o],
        "a row does not depend on T"
    );
    gpu.dealloc(wp).unwrap();
}

fn check_gate(gpu: &Gpu, rng: &mut Rng) {
    let (t, h, hc, eps) = (3usize, 20usize, 2usize, 1e-6f32);
    let c = h * hc;
    let hw: Vec<f32> = (0..t * c).map(|_| bf16(rng)).collect();
    let kv: Vec<f32> = (0..t * (c + h)).map(|_| bf16(rng)).collect();
    let norms: Vec<Vec<f32>> = (0..3)
        .map(|_| (0..c).map(|_| bf16(rng) / 8.0).collect())
        .collect();
    let (mut g_want, mut x_want) = (vec![0.0f32; t * c], vec![0.0f32; t * c]);
    let inputs = GateInputs {
        highway: &hw,
        kv: &kv,
        norm_q: &norms[0],
        norm_k: &norms[1],
        norm_conv: &norms[2],
    };
    gate_on(
        REF,
        GateDims { t, h, hc, eps },
        inputs,
        &mut g_want,
        &mut x_want,
    )
    .unwrap();
    let ptrs: Vec<DevicePtr> = [&hw, &kv, &norms[0], &norms[1], &norms[2]]
        .iter()
        .map(|v| put(gpu, v.as_slice(), "in"))
        .collect();
    let gated = gpu.alloc(t * c * 4, "gated").unwrap();
    let xn = gpu.alloc(t * c * 4, "xn").unwrap();
    let a = GateArgs {
        highway: ptrs[0],
        kv: ptrs[1],
        norm_q: ptrs[2],
        norm_k: ptrs[3],
        norm_conv: ptrs[4],
        gated,
        xn,
        t: t as u32,
        h: h as u32,
        hc: hc as u32,
        eps,
    };
    launch(gpu, "gate", LaunchConfig::linear(1, 64), &a);
    let mut first = Vec::new();
    for (name, p, want) in [("gated", gated, &g_want), ("xn", xn, &x_want)] {
        let got = get_f32(gpu, p, t * c);
        for (i, (a, b)) in got.iter().zip(want.iter()).enumerate() {
            assert!(
                (a - b).abs() <= 1e-6 * b.abs().max(1.0),
                "gate {name}[{i}]: {a} vs {b}"
            );
        }
        first.push(bits(&got));
    }
    // One thread per row (a block that is not whole warps): the same bits.
    gpu.memset(gated, 0, t * c * 4).unwrap();
    gpu.memset(xn, 0, t * c * 4).unwrap();
    launch(gpu, "gate", LaunchConfig::linear(3, 7), &a);
    for (i, p) in [gated, xn].into_iter().enumerate() {
        let got = bits(&get_f32(gpu, p, t * c));
        assert_eq!(got, first[i], "gate with one thread per row");
    }
    for p in ptrs.into_iter().chain([gated, xn]) {
        gpu.dealloc(p).unwrap();
    }
}

fn check_conv(gpu: &Gpu, rng: &mut Rng) {
    let (c, k, d) = (6usize, 3usize, 2usize);
    let s = (k - 1) * d;
    let dims = |t| ConvDims { t, c, k, d };
    let w: Vec<f32> = (0..c * k).map(|_| bf16(rng)).collect();
    let wp = put(gpu, &w, "w");
    let total = 7usize;
    let xn: Vec<f32> = (0..total * c).map(|_| bf16(rng)).collect();
    let gated: Vec<f32> = (0..total * c).map(|_| bf16(rng)).collect();
    let hw0: Vec<f32> = (0..total * c).map(|_| bf16(rng)).collect();
    let st0: Vec<f32> = (0..s * c).map(|_| bf16(rng)).collect();
    // Reference: the whole sequence in one call.
    let (mut hw_want, mut st_want) = (hw0.clone(), st0.clone());
    conv_on(
        REF,
        dims(total),
        &xn,
        &gated,
        &mut st_want,
        &w,
        &mut hw_want,
    )
    .unwrap();
    // Device: chunks 5 (>= S) then 2 (< S), then token by token; both
    // must give the reference's bits.
    for chunks in [
        vec![(0usize, 5usize), (5, 7)],
        (0..total).map(|i| (i, i + 1)).collect(),
    ] {
        let (xp, gp, hp) = (
            put(gpu, &xn, "xn"),
            put(gpu, &gated, "gated"),
            put(gpu, &hw0, "hw"),
        );
        let sp = put(gpu, &st0, "state");
        for &(a, b) in &chunks {
            let args = ConvArgs {
                xn: xp.offset(a * c * 4),
                gated: gp.offset(a * c * 4),
                state: sp,
                w: wp,
                highway: hp.offset(a * c * 4),
                t: (b - a) as u32,
                c: c as u32,
                k: k as u32,
                d: d as u32,
            };
            launch(gpu, "conv", LaunchConfig::linear(1, 32), &args);
        }
        assert_eq!(
            bits(&get_f32(gpu, hp, total * c)),
            bits(&hw_want),
            "conv highway, chunks {chunks:?}"
        );
        assert_eq!(
            bits(&get_f32(gpu, sp, s * c)),
            bits(&st_want),
            "conv state, chunks {chunks:?}"
        );
        for p in [xp, gp, hp, sp] {
            gpu.dealloc(p).unwrap();
        }
    }
    // conv_batch: three sequences, one token each, states by pointer.
    let b = 3usize;
    let states: Vec<Vec<f32>> = (0..b)
        .map(|_| (0..s * c).map(|_| bf16(rng)).collect())
        .collect();
    let mut hw_want = hw0[..b * c].to_vec();
    let mut st_want = states.clone();
    {
        let mut views: Vec<&mut [f32]> = st_want.iter_mut().map(|s| s.as_mut_slice()).collect();
        conv_batch_on(
            REF,
            dims(b),
            &xn[..b * c],
            &gated[..b * c],
            &mut views,
            &w,
            &mut hw_want,
        )
        .unwrap();
    }
    let sps: Vec<DevicePtr> = states.iter().map(|s| put(gpu, s, "state")).collect();
    let table = put(
        gpu,
        &sps.iter().map(|p| p.0).collect::<Vec<u64>>(),
        "states",
    );
    let (xp, gp, hp) = (
        put(gpu, &xn[..b * c], "xn"),
        put(gpu, &gated[..b * c], "gated"),
        put(gpu, &hw0[..b * c], "hw"),
    );
    let args = ConvBatchArgs {
        xn: xp,
        gated: gp,
        states: table,
        w: wp,
        highway: hp,
        b: b as u32,
        c: c as u32,
        k: k as u32,
        d: d as u32,
    };
    launch(gpu, "conv_batch", LaunchConfig::linear(2, 8), &args);
    assert_eq!(
        bits(&get_f32(gpu, hp, b * c)),
        bits(&hw_want),
        "conv_batch highway"
    );
    for (i, p) in sps.iter().enumerate() {
        assert_eq!(
            bits(&get_f32(gpu, *p, s * c)),
            bits(&st_want[i]),
            "conv_batch state {i}"
        );
    }
    for p in sps.into_iter().chain([table, xp, gp, hp, wp]) {
        gpu.dealloc(p).unwrap();
    }
}
