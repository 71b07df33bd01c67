//! The PLE device kernels (crates/model-layers/kernels/ple.cu) run on a
//! CUDA device and checked against plain Rust references written here from
//! docs/SPEC.md §3 (Id hash), docs/SPEC.md §5 (Layer math) and the host
//! kernels' documented operation order. Without a
//! device the test prints `skipped: <reason>` and checks nothing.
//!
//! Exact (bitwise) where the kernels promise the host's operation order:
//! hash, gather, project, conv, conv_batch, and the chunking and batching
//! invariance of the conv and the projection. The gate is compared within a
//! small tolerance (its sigmoid uses the device `expf`).

#![cfg(feature = "cuda")]

use metrale_gpu_runtime::cuda::CudaBackend;
use metrale_gpu_runtime::gpu::{DevicePtr, GpuBackend, KernelArg, LaunchConfig};

const PLE_CU: &str = include_str!("../../model-layers/kernels/ple.cu");

type Gpu = CudaBackend;

fn put<T: Copy>(gpu: &Gpu, v: &[T], label: &str) -> DevicePtr {
    let bytes = std::mem::size_of_val(v);
    let p = gpu.alloc(bytes, label).unwrap();
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

fn launch(gpu: &Gpu, name: &str, cfg: LaunchConfig, args: &[KernelArg]) {
    let k = gpu.kernel("ple", name).unwrap();
    gpu.launch_kernel(k, cfg, args, 0).unwrap();
    gpu.synchronize(0).unwrap_or_else(|e| panic!("{name}: {e}"));
}

/// A small deterministic generator (splitmix64).
struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    /// A BF16-exact value in about [-2, 2).
    fn bf16(&mut self) -> f32 {
        let v = (self.next() % 4096) as f32 / 1024.0 - 2.0;
        bf16_round(v)
    }
}

fn bf16_bits(v: f32) -> u16 {
    let bits = v.to_bits();
    ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) as u16
}

fn bf16_round(v: f32) -> f32 {
    f32::from_bits((bf16_bits(v) as u32) << 16)
}

fn fp8_e4m3(b: u8) -> f32 {
    let sign = ((b as u32) >> 7) << 31;
    let e = ((b >> 3) & 0xF) as u32;
    let m = (b & 7) as u32;
    if e == 0xF && m == 7 {
        return f32::from_bits(sign | 0x7FC0_0000);
    }
    if e == 0 {
        if m == 0 {
            return f32::from_bits(sign);
        }
        let p = 31 - m.leading_zeros();
        return f32::from_bits(sign | ((p + 118) << 23) | ((m - (1 << p)) << (23 - p)));
    }
    f32::from_bits(sign | ((e + 120) << 23) | (m << 20))
}

fn lane_sum(n: usize, f: impl Fn(usize) -> f32) -> f32 {
    let mut acc = [0.0f32; 16];
    for i in 0..n {
        acc[i % 16] += f(i);
    }
    let mut w = 8;
    while w > 0 {
        for i in 0..w {
            acc[i] += acc[i + w];
        }
        w /= 2;
    }
    acc[0]
}

fn rms(x: &[f32], eps: f32) -> f32 {
    1.0 / (lane_sum(x.len(), |i| x[i] * x[i]) / x.len() as f32 + eps).sqrt()
}

fn exp_vec(x: f32) -> f32 {
    let x = x.clamp(-87.0, 88.0);
    let t = x * std::f32::consts::LOG2_E + 12_582_912.0;
    let n = t - 12_582_912.0;
    let ni = (t.to_bits() as i32).wrapping_sub(0x4B40_0000);
    let r = (x - n * 0.693_359_4) - n * -2.121_944_4e-4;
    let mut p = 1.987_569_1e-4f32;
    p = p * r + 1.398_199_9e-3;
    p = p * r + 8.333_452e-3;
    p = p * r + 4.166_579_6e-2;
    p = p * r + 1.666_666_5e-1;
    p = p * r + 0.5;
    let er = p * (r * r) + r + 1.0;
    f32::from_bits((ni.wrapping_add(127) as u32) << 23) * er
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
    let (n, k, eos) = (3usize, 2usize, 7u32);
    let heads = (n - 1) * k;
    let mults: Vec<u64> = vec![0x9E37_79B9_7F4A_7C15 | 1, 1_000_003, 0xBF58_476D_1CE4_E5B9];
    let sizes: Vec<u64> = vec![1009, 1013, 1019, 1021];
    let offsets: Vec<u64> = sizes
        .iter()
        .scan(0, |a, &s| {
            let o = *a;
            *a += s;
            Some(o)
        })
        .collect();
    for (history, tokens) in [
        (vec![], vec![5u32, 9, 7, 11, 12, 7, 7, 3]),
        (vec![1u32, 2, 3], vec![4, 7, 5]),
        (vec![3u32, 7], vec![6]),
    ] {
        // Reference: docs/SPEC.md §3 (Id hash).
        let mut ctx = vec![eos; n - 1];
        for &t in &history[history.len().saturating_sub(n - 1)..] {
            if t == eos {
                ctx.fill(eos)
            } else {
                ctx.rotate_right(1);
                ctx[0] = t;
            }
        }
        let mut want = Vec::new();
        for &t in &tokens {
            let mut mixed = u64::from(t).wrapping_mul(mults[0]);
            for p in 0..n - 1 {
                mixed ^= u64::from(ctx[p]).wrapping_mul(mults[p + 1]);
                for h in p * k..(p + 1) * k {
                    want.push(mixed % sizes[h] + offsets[h]);
                }
            }
            if t == eos {
                ctx.fill(eos)
            } else {
                ctx.rotate_right(1);
                ctx[0] = t;
            }
        }
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
            put(gpu, &mults, "m"),
            put(gpu, &sizes, "s"),
            put(gpu, &offsets, "o"),
        );
        let out = gpu.alloc(tokens.len() * heads * 8, "ids").unwrap();
        use KernelArg::{Ptr, U32};
        launch(
            gpu,
            "hash",
            LaunchConfig::linear(1, 4),
            &[
                Ptr(hist),
                U32(history.len() as u32),
                Ptr(toks),
                U32(tokens.len() as u32),
                Ptr(m),
                Ptr(s),
                Ptr(o),
                U32(n as u32),
                U32(k as u32),
                U32(eos),
                Ptr(out),
            ],
        );
        assert_eq!(get_u64(gpu, out, want.len()), want, "history {history:?}");
        for p in [hist, toks, m, s, o, out] {
            gpu.dealloc(p).unwrap();
        }
    }
}

fn check_gather(gpu: &Gpu, rng: &mut Rng) {
    let (rows, hd) = (9usize, 5usize);
    let bf: Vec<u16> = (0..rows * hd).map(|_| bf16_bits(rng.bf16())).collect();
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
    for dtype in [0u32, 1] {
        let refs: Vec<u64> = pick
            .iter()
            .flat_map(|&r| {
                if dtype == 0 {
                    [dev_bf.offset(r * hd * 2).0, 0]
                } else {
                    [
                        mapped.device.offset(r * hd).0,
                        mapped.device.offset(f8.len() + r * 4).0,
                    ]
                }
            })
            .collect();
        let want: Vec<f32> = pick
            .iter()
            .flat_map(|&r| (0..hd).map(move |j| (r, j)))
            .map(|(r, j)| {
                if dtype == 0 {
                    f32::from_bits((bf[r * hd + j] as u32) << 16)
                } else {
                    bf16_round(fp8_e4m3(f8[r * hd + j]) * scales[r])
                }
            })
            .collect();
        let rp = put(gpu, &refs, "refs");
        let out = gpu.alloc(want.len() * 4, "out").unwrap();
        use KernelArg::{Ptr, U32};
        launch(
            gpu,
            "gather",
            LaunchConfig::linear(2, 8),
            &[
                Ptr(rp),
                U32(pick.len() as u32),
                U32(hd as u32),
                U32(dtype),
                Ptr(out),
            ],
        );
        let got = get_f32(gpu, out, want.len());
        assert_eq!(
            got.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
            want.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
            "gather dtype {dtype}"
        );
        // In runs of 2 rows every 3 (one head group of each token): ref i
        // to row (i / 2) * 3 + i % 2; the rows between runs stay as they
        // were.
        let n = pick.len();
        let span = (n - 1) / 2 * 3 + (n - 1) % 2 + 1;
        let runs = put(gpu, &vec![f32::NAN; span * hd], "runs out");
        launch(
            gpu,
            "gather_runs",
            LaunchConfig::linear(2, 8),
            &[
                Ptr(rp),
                U32(n as u32),
                U32(hd as u32),
                U32(dtype),
                Ptr(runs),
                U32(2),
                U32(3),
            ],
        );
        let got = get_f32(gpu, runs, span * hd);
        for (row, chunk) in got.chunks_exact(hd).enumerate() {
            let want_row: Vec<u32> = if row % 3 == 2 {
                vec![f32::NAN.to_bits(); hd]
            } else {
                let i = row / 3 * 2 + row % 3;
                want[i * hd..(i + 1) * hd]
                    .iter()
                    .map(|v| v.to_bits())
                    .collect()
            };
            let got_row: Vec<u32> = chunk.iter().map(|v| v.to_bits()).collect();
            assert_eq!(
                got_row, want_row,
                "gather_runs dtype {dtype}, out row {row}"
            );
        }
        gpu.dealloc(runs).unwrap();
        gpu.dealloc(rp).unwrap();
        gpu.dealloc(out).unwrap();
    }
    gpu.dealloc(dev_bf).unwrap();
    gpu.dealloc(mapped.device).unwrap();
}

fn check_project(gpu: &Gpu, rng: &mut Rng) {
    let (e, o) = (7usize, 20usize);
    let w: Vec<f32> = (0..o * e).map(|_| rng.bf16()).collect();
    // The host's packing: panels of 16 rows, pairs of steps, hi = even step.
    let half = e.div_ceil(2);
    let panels = o.div_ceil(16);
    let mut packed = vec![0u32; panels * half * 16];
    for oo in 0..o {
        for i in 0..half {
            let hi = bf16_bits(w[oo * e + 2 * i]) as u32;
            let lo = if 2 * i + 1 < e {
                bf16_bits(w[oo * e + 2 * i + 1]) as u32
            } else {
                0
            };
            packed[((oo / 16) * half + i) * 16 + oo % 16] = (hi << 16) | lo;
        }
    }
    let wp = put(gpu, &packed, "w");
    let mut results = Vec::new();
    for (t, cfg) in [
        (
            9usize,
            LaunchConfig {
                grid: (3, 1, 1),
                block: (32, 8, 1),
                shared_mem_bytes: 0,
            },
        ),
        (9, LaunchConfig::linear(2, 64)),
        (
            1,
            LaunchConfig {
                grid: (1, 1, 1),
                block: (32, 8, 1),
                shared_mem_bytes: 0,
            },
        ),
    ] {
        let x: Vec<f32> = {
            let mut r = Rng(7);
            (0..t * e).map(|_| r.bf16()).collect()
        };
        let want: Vec<u32> = (0..t * o)
            .map(|i| {
                let (tt, oo) = (i / o, i % o);
                (0..e)
                    .fold(0.0f32, |acc, k| x[tt * e + k].mul_add(w[oo * e + k], acc))
                    .to_bits()
            })
            .collect();
        let xp = put(gpu, &x, "x");
        let y = gpu.alloc(t * o * 4, "y").unwrap();
        use KernelArg::{Ptr, U32};
        launch(
            gpu,
            "project",
            cfg,
            &[
                Ptr(xp),
                Ptr(wp),
                Ptr(y),
                U32(t as u32),
                U32(e as u32),
                U32(o as u32),
            ],
        );
        let got: Vec<u32> = get_f32(gpu, y, t * o).iter().map(|v| v.to_bits()).collect();
        assert_eq!(got, want, "project T = {t}, {cfg:?}");
        // The same chain in two step ranges, the second continuing the
        // first's sums (what the pipelined gather launches).
        let y2 = gpu.alloc(t * o * 4, "y2").unwrap();
        for (from, to, acc) in [(0u32, 4u32, 0u32), (4, e as u32, 1)] {
            launch(
                gpu,
                "project_range",
                cfg,
                &[
                    Ptr(xp),
                    Ptr(wp),
                    Ptr(y2),
                    U32(t as u32),
                    U32(e as u32),
                    U32(o as u32),
                    U32(from),
                    U32(to),
                    U32(acc),
                ],
            );
        }
        let split: Vec<u32> = get_f32(gpu, y2, t * o)
            .iter()
            .map(|v| v.to_bits())
            .collect();
        assert_eq!(split, want, "project_range T = {t}, {cfg:?}");
        gpu.dealloc(y2).unwrap();
        results.push(got);
        gpu.dealloc(xp).unwrap();
        gpu.dealloc(y).unwrap();
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
    let hw: Vec<f32> = (0..t * c).map(|_| rng.bf16()).collect();
    let kv: Vec<f32> = (0..t * (c + h)).map(|_| rng.bf16()).collect();
    let nq: Vec<f32> = (0..c).map(|_| rng.bf16() / 8.0).collect();
    let nk: Vec<f32> = (0..c).map(|_| rng.bf16() / 8.0).collect();
    let nc: Vec<f32> = (0..c).map(|_| rng.bf16() / 8.0).collect();
    let (mut g_want, mut x_want) = (vec![0.0f32; t * c], vec![0.0f32; t * c]);
    for tt in 0..t {
        for s in 0..hc {
            let q = &hw[tt * c + s * h..tt * c + (s + 1) * h];
            let k = &kv[tt * (c + h) + s * h..tt * (c + h) + (s + 1) * h];
            let v = &kv[tt * (c + h) + c..(tt + 1) * (c + h)];
            let (rq, rk) = (rms(q, eps), rms(k, eps));
            let g = lane_sum(h, |i| {
                (q[i] * rq * (1.0 + nq[s * h + i])) * (k[i] * rk * (1.0 + nk[s * h + i]))
            }) * (1.0 / (h as f32).sqrt());
            // sign(0) = 0 (not f32::signum, which gives 1 at 0).
            let sign = if g > 0.0 {
                1.0
            } else if g < 0.0 {
                -1.0
            } else {
                0.0
            };
            let z = sign * g.abs().max(1e-6).sqrt();
            let sigma = 1.0 / (1.0 + (-z).exp());
            let gs: Vec<f32> = v.iter().map(|&x| sigma * x).collect();
            let rc = rms(&gs, eps);
            for i in 0..h {
                g_want[tt * c + s * h + i] = gs[i];
                x_want[tt * c + s * h + i] = gs[i] * rc * (1.0 + nc[s * h + i]);
            }
        }
    }
    let ptrs: Vec<DevicePtr> = [&hw, &kv, &nq, &nk, &nc]
        .iter()
        .map(|v| put(gpu, v.as_slice(), "in"))
        .collect();
    let gated = gpu.alloc(t * c * 4, "gated").unwrap();
    let xn = gpu.alloc(t * c * 4, "xn").unwrap();
    use KernelArg::{F32, Ptr, U32};
    let mut args: Vec<KernelArg> = ptrs.iter().map(|&p| Ptr(p)).collect();
    args.extend([
        Ptr(gated),
        Ptr(xn),
        U32(t as u32),
        U32(h as u32),
        U32(hc as u32),
        F32(eps),
    ]);
    launch(gpu, "gate", LaunchConfig::linear(1, 64), &args);
    let mut first = Vec::new();
    for (name, p, want) in [("gated", gated, &g_want), ("xn", xn, &x_want)] {
        let got = get_f32(gpu, p, t * c);
        for (i, (a, b)) in got.iter().zip(want.iter()).enumerate() {
            assert!(
                (a - b).abs() <= 1e-6 * b.abs().max(1.0),
                "gate {name}[{i}]: {a} vs {b}"
            );
        }
        first.push(got.iter().map(|v| v.to_bits()).collect::<Vec<_>>());
    }
    // One thread per row (a block that is not whole warps): the same bits.
    gpu.memset(gated, 0, t * c * 4).unwrap();
    gpu.memset(xn, 0, t * c * 4).unwrap();
    launch(gpu, "gate", LaunchConfig::linear(3, 7), &args);
    for (i, p) in [gated, xn].into_iter().enumerate() {
        let got: Vec<u32> = get_f32(gpu, p, t * c).iter().map(|v| v.to_bits()).collect();
        assert_eq!(got, first[i], "gate with one thread per row");
    }
    for p in ptrs.into_iter().chain([gated, xn]) {
        gpu.dealloc(p).unwrap();
    }
}

/// Reference conv of T rows of one sequence; returns the new state.
#[allow(clippy::too_many_arguments)]
fn conv_ref(
    xn: &[f32],
    gated: &[f32],
    state: &[f32],
    w: &[f32],
    hw: &mut [f32],
    c: usize,
    k: usize,
    d: usize,
) -> Vec<f32> {
    let s = (k - 1) * d;
    let t = xn.len() / c;
    let x: Vec<f32> = state.iter().chain(xn).copied().collect();
    for tt in 0..t {
        for ci in 0..c {
            let mut y = 0.0f32;
            for j in 0..k {
                y += w[ci * k + j] * x[(s + tt - (k - 1 - j) * d) * c + ci];
            }
            hw[tt * c + ci] += gated[tt * c + ci] + y / (1.0 + exp_vec(-y));
        }
    }
    x[x.len() - s * c..].to_vec()
}

fn check_conv(gpu: &Gpu, rng: &mut Rng) {
    let (c, k, d) = (6usize, 3usize, 2usize);
    let s = (k - 1) * d;
    let w: Vec<f32> = (0..c * k).map(|_| rng.bf16()).collect();
    let wp = put(gpu, &w, "w");
    let total = 7usize;
    let xn: Vec<f32> = (0..total * c).map(|_| rng.bf16()).collect();
    let gated: Vec<f32> = (0..total * c).map(|_| rng.bf16()).collect();
    let hw0: Vec<f32> = (0..total * c).map(|_| rng.bf16()).collect();
    let st0: Vec<f32> = (0..s * c).map(|_| rng.bf16()).collect();
    // Reference over chunks 5 (>= S) then 2 (< S).
    let mut hw_want = hw0.clone();
    let mut st = st0.clone();
    for (a, b) in [(0usize, 5usize), (5, 7)] {
        st = conv_ref(
            &xn[a * c..b * c],
            &gated[a * c..b * c],
            &st,
            &w,
            &mut hw_want[a * c..b * c],
            c,
            k,
            d,
        );
    }
    use KernelArg::{Ptr, U32};
    // Device: the same chunks, then token by token; both must give the
    // reference's bits.
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
            launch(
                gpu,
                "conv",
                LaunchConfig::linear(1, 32),
                &[
                    Ptr(xp.offset(a * c * 4)),
                    Ptr(gp.offset(a * c * 4)),
                    Ptr(sp),
                    Ptr(wp),
                    Ptr(hp.offset(a * c * 4)),
                    U32((b - a) as u32),
                    U32(c as u32),
                    U32(k as u32),
                    U32(d as u32),
                ],
            );
        }
        let bits = |v: Vec<f32>| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(
            bits(get_f32(gpu, hp, total * c)),
            bits(hw_want.clone()),
            "conv highway, chunks {chunks:?}"
        );
        assert_eq!(
            bits(get_f32(gpu, sp, s * c)),
            bits(st.clone()),
            "conv state, chunks {chunks:?}"
        );
        for p in [xp, gp, hp, sp] {
            gpu.dealloc(p).unwrap();
        }
    }
    // conv_batch: three sequences, one token each, states by pointer.
    let b = 3usize;
    let states: Vec<Vec<f32>> = (0..b)
        .map(|_| (0..s * c).map(|_| rng.bf16()).collect())
        .collect();
    let mut hw_want = hw0[..b * c].to_vec();
    let st_want: Vec<Vec<f32>> = (0..b)
        .map(|i| {
            conv_ref(
                &xn[i * c..(i + 1) * c],
                &gated[i * c..(i + 1) * c],
                &states[i],
                &w,
                &mut hw_want[i * c..(i + 1) * c],
                c,
                k,
                d,
            )
        })
        .collect();
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
    launch(
        gpu,
        "conv_batch",
        LaunchConfig::linear(2, 8),
        &[
            Ptr(xp),
            Ptr(gp),
            Ptr(table),
            Ptr(wp),
            Ptr(hp),
            U32(b as u32),
            U32(c as u32),
            U32(k as u32),
            U32(d as u32),
        ],
    );
    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
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
