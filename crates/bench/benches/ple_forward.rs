//! PLE forward throughput at the flagship geometry of docs/SPEC.md §2
//! (Geometry).
//!
//! Random weights and a resident random BF16 table are made in the process.
//! Prints prefill tokens/s (one 512-token chunk) and decode tokens/s (batch
//! 1, 16, 32, 64), the share of time in gather, projection, gate and conv, and,
//! as the baseline measured in the same run, a naive scalar projection
//! against the packed GEMM with their ratio.
//!
//! Then, side by side in the same run when the Python interpreter
//! (`PLE_PYTHON`, default `python3`) can import torch (or when `PLE_TORCH=1`
//! demands it; `PLE_TORCH=0` skips it), the same figures from
//! `reference/torch_bench.py` (PyTorch's CPU path doing the same math) and,
//! where it can import transformers' Qwen4-Exp, from
//! `reference/transformers_bench.py` (transformers' own
//! `Qwen4ExpTextPLELayer` in bfloat16 with its cache), and the ratio of ours
//! to each: `PLE_BENCH_ROUNDS` rounds (default 3), ours and theirs in turn,
//! so that a machine whose speed drifts slows all alike, the ratio being
//! the median of the rounds'. Beside
//! it, the ratio ours would reach were our projection at the measured peak
//! of its instruction and the rest as measured: where PyTorch's projection
//! is itself near that peak, no projection kernel can take the ratio past
//! it.
//!
//! Against the machine, in the same run: the measured peak of every
//! multiply instruction this CPU runs (a tight loop of it on independent
//! accumulators, on every rayon thread at once: FMA on 8 and 16 lanes,
//! `vdpbf16ps`, AMX `tdpbf16ps`), and the projection's GFLOP/s beside the
//! peak of the instruction it multiplies with and beside the best one; and
//! decode at batch 1 (which reads every weight once a step) its weight
//! bytes/s beside the measured read bandwidth of a buffer of the weights'
//! size (what decode rereads every step, as cache-resident as it can be)
//! and of 1 GiB (beyond the caches).
//!
//! Environment: `PLE_BENCH_ROWS` (table rows, default 3,000,000),
//! `PLE_BENCH_REPS` (timed repetitions, default 5).

use std::hint::black_box;
use std::time::{Duration, Instant};

use metrale_bench::layer::{Rng, naive_project};
use metrale_model_layers::layers::ple::PleWeights;
use metrale_model_layers::layers::ple::kernels::conv::{ConvDims, conv, conv_batch};
use metrale_model_layers::layers::ple::kernels::cpu::{
    Avx512Projection, CpuPath, MulAddLoop, avx512_projection, mul_add_rate,
};
use metrale_model_layers::layers::ple::kernels::gate::{GateDims, GateInputs, gate};
use metrale_model_layers::layers::ple::kernels::gather::{GatherDType, RowSrc, gather_rows};
use metrale_model_layers::layers::ple::kernels::gemm::{packed_as_bf16, project};
use metrale_model_layers::layers::ple::kernels::{cpu, pack_projection};
use metrale_storage::dtype::bf16_to_f32;

const H: usize = 2560;
const HC: usize = 4;
const C: usize = HC * H;
const HEADS: usize = 16;
const HEAD_DIM: usize = 160;
const E: usize = HEADS * HEAD_DIM;
const O: usize = C + H;
const KSIZE: usize = 4;
const DIL: usize = 3;
const S: usize = (KSIZE - 1) * DIL;
const EPS: f32 = 1e-6;

fn env_usize(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// Per-stage time of one forward.
#[derive(Default, Clone, Copy)]
struct Stages {
    gather: Duration,
    project: Duration,
    gate: Duration,
    conv: Duration,
}

impl Stages {
    fn total(&self) -> Duration {
        self.gather + self.project + self.gate + self.conv
    }
    fn share(&self) -> String {
        let t = self.total().as_secs_f64();
        let p = |d: Duration| 100.0 * d.as_secs_f64() / t;
        format!(
            "gather {:.1}%  project {:.1}%  gate {:.1}%  conv {:.1}%",
            p(self.gather),
            p(self.project),
            p(self.gate),
            p(self.conv)
        )
    }
}

struct Model {
    /// Little-endian BF16 rows.
    table: Vec<u8>,
    rows: usize,
    packed: Vec<f32>,
    /// The unpacked projections, for the baseline.
    weights: PleWeights,
    norm_q: Vec<f32>,
    norm_k: Vec<f32>,
    norm_conv: Vec<f32>,
    conv_w: Vec<f32>,
}

/// Scratch for up to `t` rows.
struct Scratch {
    emb: Vec<f32>,
    kv: Vec<f32>,
    gated: Vec<f32>,
    xn: Vec<f32>,
}

impl Scratch {
    fn new(t: usize) -> Self {
        Scratch {
            emb: vec![0.0; t * E],
            kv: vec![0.0; t * O],
            gated: vec![0.0; t * C],
            xn: vec![0.0; t * C],
        }
    }
}

/// Median and best step time in seconds, and the stage shares over all
/// steps.
fn summarize(runs: &[Stages]) -> (f64, f64, String) {
    let mut tot: Vec<f64> = runs.iter().map(|s| s.total().as_secs_f64()).collect();
    tot.sort_by(f64::total_cmp);
    let mut sum = Stages::default();
    for r in runs {
        sum.gather += r.gather;
        sum.project += r.project;
        sum.gate += r.gate;
        sum.conv += r.conv;
    }
    (tot[tot.len() / 2], tot[0], sum.share())
}

/// CPU time used so far by all live threads of this process, from
/// `/proc/self/task/*/schedstat` (nanoseconds on a CPU); `None` where that
/// is not readable. Wall time on a shared machine includes waiting for the
/// CPU; tokens per CPU-second do not.
fn cpu_seconds() -> Option<f64> {
    let mut ns = 0u64;
    for t in std::fs::read_dir("/proc/self/task").ok()? {
        let path = t.ok()?.path().join("schedstat");
        let text = std::fs::read_to_string(path).ok()?;
        ns += text.split_whitespace().next()?.parse::<u64>().ok()?;
    }
    Some(ns as f64 * 1e-9)
}

/// `tokens / cpu` formatted, or "n/a".
fn per_cpu(tokens: usize, cpu: Option<f64>) -> String {
    match cpu {
        Some(c) if c > 0.0 => format!("{:.1}", tokens as f64 / c),
        _ => "n/a".to_string(),
    }
}

/// The instruction the projection multiplies with on `path`, if any.
fn projection_loop(path: CpuPath) -> Option<MulAddLoop> {
    match path {
        CpuPath::Portable => None,
        CpuPath::Avx2Fma => Some(MulAddLoop::Fma256),
        CpuPath::Avx512Bf16 => Some(match avx512_projection() {
            Avx512Projection::Fma => MulAddLoop::Fma512,
            Avx512Projection::Dot => MulAddLoop::Dot512,
        }),
        // The bench's rows are BF16 values, so the tiles run.
        CpuPath::Amx => Some(MulAddLoop::Amx),
    }
}

/// Every multiply loop, in the order printed.
const LOOPS: [MulAddLoop; 4] = [
    MulAddLoop::Fma256,
    MulAddLoop::Fma512,
    MulAddLoop::Dot512,
    MulAddLoop::Amx,
];

/// The CPU's model name from `/proc/cpuinfo`, or "unknown CPU".
fn cpu_model() -> String {
    std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|t| {
            t.lines()
                .find(|l| l.starts_with("model name"))
                .and_then(|l| l.split_once(':'))
                .map(|(_, v)| v.trim().to_string())
        })
        .unwrap_or_else(|| "unknown CPU".to_string())
}

/// Peak GFLOP/s of `l` (two FLOPs a product) on every rayon thread at
/// once: each thread's best of three runs, summed.
fn peak_gflops(l: MulAddLoop) -> Option<f64> {
    // A tile instruction does 256 times the products of a vector one; the
    // loop runs about as long.
    let iters = if l == MulAddLoop::Amx {
        400_000
    } else {
        20_000_000
    };
    let per_thread = rayon::broadcast(|_| {
        (0..3)
            .filter_map(|_| mul_add_rate(l, iters))
            .fold(0.0f64, f64::max)
    });
    let instr: f64 = per_thread.iter().sum();
    (instr > 0.0).then(|| instr * l.products() as f64 * 2.0 / 1e9)
}

/// XOR of the 64-bit words of `b`, in 64-byte strides with eight
/// independent lanes so the loads, not the XORs, set the pace; with
/// 512-bit loads where the CPU has them (the projection's own width: a
/// narrower loop measures less than the memory delivers).
fn read_all(b: &[u64]) -> u64 {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx512f") {
        // SAFETY: AVX-512F is present (checked just above).
        return unsafe { read_all_512(b) };
    }
    read_all_scalar(b)
}

/// [`read_all`] with four independent 512-bit accumulators.
///
/// # Safety
/// The CPU must support AVX-512F.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn read_all_512(b: &[u64]) -> u64 {
    use std::arch::x86_64::*;
    let mut acc = [_mm512_setzero_si512(); 4];
    let blocks = b.chunks_exact(32);
    let tail = read_all_scalar(blocks.remainder());
    for c in blocks {
        for (i, a) in acc.iter_mut().enumerate() {
            // SAFETY: `c` holds 32 words, lanes `8 i .. 8 i + 8` of them;
            // the load is unaligned.
            let v = unsafe { _mm512_loadu_si512(c.as_ptr().add(8 * i).cast()) };
            *a = _mm512_xor_si512(*a, v);
        }
    }
    let x = _mm512_xor_si512(
        _mm512_xor_si512(acc[0], acc[1]),
        _mm512_xor_si512(acc[2], acc[3]),
    );
    let mut words = [0u64; 8];
    // SAFETY: `words` holds 64 bytes; the store is unaligned.
    unsafe { _mm512_storeu_si512(words.as_mut_ptr().cast(), x) };
    words.iter().fold(tail, |x, y| x ^ y)
}

/// [`read_all`] on 64-bit words.
fn read_all_scalar(b: &[u64]) -> u64 {
    let mut acc = [0u64; 8];
    for c in b.chunks_exact(8) {
        for (a, v) in acc.iter_mut().zip(c) {
            *a ^= *v;
        }
    }
    acc.iter().fold(0, |x, y| x ^ y)
}

/// Read bandwidth in GB/s over a buffer of `bytes`, split over every rayon
/// thread: best of five passes (the first also warms the caches it fits).
fn read_gbs(bytes: usize) -> f64 {
    let buf: Vec<u64> = (0..bytes / 8).map(|i| i as u64).collect();
    let threads = rayon::current_num_threads();
    let part = buf.len().div_ceil(threads).next_multiple_of(8);
    let mut best = 0.0f64;
    for _ in 0..5 {
        let t0 = Instant::now();
        let x = rayon::broadcast(|c| {
            let lo = (c.index() * part).min(buf.len());
            read_all(&buf[lo..(lo + part).min(buf.len())])
        });
        let dt = t0.elapsed().as_secs_f64();
        black_box(x);
        best = best.max(bytes as f64 / dt / 1e9);
    }
    best
}

fn time<R>(acc: &mut Duration, f: impl FnOnce() -> R) -> R {
    let t0 = Instant::now();
    let r = f();
    *acc += t0.elapsed();
    r
}

/// One prefill chunk (`states.len() == 1`, `t` rows) or one decode step
/// (`t == states.len()` sequences, one row each) through the kernel chain.
fn step(
    m: &Model,
    ids: &[u64],
    t: usize,
    highway: &mut [f32],
    states: &mut [Vec<f32>],
    sc: &mut Scratch,
    st: &mut Stages,
) {
    let rows: Vec<RowSrc> = ids
        .iter()
        .map(|&id| {
            let off = id as usize * HEAD_DIM * 2;
            RowSrc {
                data: &m.table[off..off + HEAD_DIM * 2],
                scale: 0.0,
            }
        })
        .collect();
    let emb = &mut sc.emb[..t * E];
    time(&mut st.gather, || {
        gather_rows(&rows, HEAD_DIM, GatherDType::Bf16, emb).unwrap()
    });
    let kv = &mut sc.kv[..t * O];
    time(&mut st.project, || {
        project(&sc.emb[..t * E], packed_as_bf16(&m.packed), kv, t, E, O).unwrap()
    });
    let (gated, xn) = (&mut sc.gated[..t * C], &mut sc.xn[..t * C]);
    let inp = GateInputs {
        highway,
        kv: &sc.kv[..t * O],
        norm_q: &m.norm_q,
        norm_k: &m.norm_k,
        norm_conv: &m.norm_conv,
    };
    time(&mut st.gate, || {
        gate(
            GateDims {
                t,
                h: H,
                hc: HC,
                eps: EPS,
            },
            inp,
            gated,
            xn,
        )
        .unwrap()
    });
    time(&mut st.conv, || {
        if states.len() == 1 {
            conv(
                ConvDims {
                    t,
                    c: C,
                    k: KSIZE,
                    d: DIL,
                },
                &sc.xn[..t * C],
                &sc.gated[..t * C],
                &mut states[0],
                &m.conv_w,
                highway,
            )
            .unwrap()
        } else {
            let mut refs: Vec<&mut [f32]> = states.iter_mut().map(|s| s.as_mut_slice()).collect();
            conv_batch(
                ConvDims {
                    t,
                    c: C,
                    k: KSIZE,
                    d: DIL,
                },
                &sc.xn[..t * C],
                &sc.gated[..t * C],
                &mut refs,
                &m.conv_w,
                highway,
            )
            .unwrap()
        }
    });
}

fn main() {
    let rows = env_usize("PLE_BENCH_ROWS", 3_000_000);
    let reps = env_usize("PLE_BENCH_REPS", 5).max(1);
    println!(
        "PLE forward, flagship geometry: H {H}, hc {HC}, {HEADS} heads x {HEAD_DIM}, conv {KSIZE} dil {DIL}; \
         table {rows} rows resident BF16; {} rayon threads",
        rayon::current_num_threads(),
    );
    let path = cpu::best_path();
    println!(
        "CPU {}; ISA path {path:?} (METRALE_CPU_PATH forces one); projection multiplies with {}",
        cpu_model(),
        projection_loop(path).map_or("scalar FMAs".to_string(), |l| format!("{l:?}")),
    );
    if path == CpuPath::Amx {
        println!(
            "  (AMX tiles for BF16-exact activations, as the table's rows are; others run the AVX-512 FMA kernel)"
        );
    }
    let mut rng = Rng::new(0x5EED);
    let t0 = Instant::now();
    let table: Vec<u8> = (0..rows * HEAD_DIM)
        .flat_map(|_| rng.bf16(1.0).to_le_bytes())
        .collect();
    let key_proj: Vec<u16> = (0..C * E).map(|_| rng.bf16(0.02)).collect();
    let value_proj: Vec<u16> = (0..H * E).map(|_| rng.bf16(0.02)).collect();
    let packed = pack_projection(&[key_proj.as_slice(), &value_proj].concat(), O, E);
    let m = Model {
        table,
        rows,
        packed,
        weights: PleWeights {
            key_proj,
            value_proj,
            norm_key: Vec::new(),
            norm_query: Vec::new(),
            norm_conv: Vec::new(),
            conv1d: Vec::new(),
            key_bias: Vec::new(),
            value_bias: Vec::new(),
        },
        norm_q: (0..C).map(|_| rng.f32(0.1)).collect(),
        norm_k: (0..C).map(|_| rng.f32(0.1)).collect(),
        norm_conv: (0..C).map(|_| rng.f32(0.1)).collect(),
        conv_w: (0..C * KSIZE).map(|_| rng.f32(0.5)).collect(),
    };
    println!("setup {:.1} s", t0.elapsed().as_secs_f64());

    let rounds = env_usize("PLE_BENCH_ROUNDS", 3).max(1);
    let first = measure(&m, &mut rng, reps, true);
    let flop_token = 2.0 * (E * O) as f64;
    let gflops: Vec<(String, f64)> = first
        .iter()
        .map(|f| {
            (
                f.label.clone(),
                flop_token * f.tokens as f64 / f.project / 1e9,
            )
        })
        .collect();
    let decode1_proj = first
        .iter()
        .find(|f| f.label == "decode batch 1")
        .map(|f| f.project);
    let prefill_proj = first[0].best_project / first[0].tokens as f64;

    // Baseline: a naive scalar projection on a few rows.
    let tb = 2;
    let x: Vec<f32> = (0..tb * E).map(|_| bf16_to_f32(rng.bf16(1.0))).collect();
    let mut y = vec![0.0f32; tb * O];
    let t0 = Instant::now();
    for (x, y) in x.chunks_exact(E).zip(y.chunks_exact_mut(O)) {
        naive_project(x, &m.weights, E, y);
    }
    black_box(&y);
    let naive = t0.elapsed().as_secs_f64() / tb as f64;
    println!(
        "projection per token: naive scalar {:.2} ms, packed GEMM (prefill, best chunk) {:.3} ms, ratio {:.1}x",
        naive * 1e3,
        prefill_proj * 1e3,
        naive / prefill_proj
    );
    let peak = machine_figures(&m.packed, &gflops, decode1_proj);
    torch_side_by_side(rows, reps, rounds, first, peak, || {
        measure(&m, &mut rng, reps, false)
    });
}

/// Our figures for one size of [`measure`].
#[derive(Clone, Debug)]
struct Figure {
    /// "prefill chunk 512" or "decode batch B", as torch_bench.py prints it.
    label: String,
    /// Tokens a step.
    tokens: usize,
    /// Median step time, seconds.
    step: f64,
    /// Median projection time of a step, seconds.
    project: f64,
    /// Best projection time of a step, seconds.
    best_project: f64,
}

impl Figure {
    fn tokens_per_s(&self) -> f64 {
        self.tokens as f64 / self.step
    }
}

/// The line of one measured size: tokens/s (median and best step, `tokens`
/// a step), tokens per CPU-second, the median time per `unit` and the
/// stages' shares.
fn print_size(head: &str, tokens: usize, runs: &[Stages], cpu: Option<f64>, unit: &str) {
    let (med, best, share) = summarize(runs);
    println!(
        "{head}: median {:>8.1} tokens/s, best {:>8.1} tokens/s, {} tokens/CPU-s  ({:.2} ms/{unit} median; {share})",
        tokens as f64 / med,
        tokens as f64 / best,
        per_cpu(tokens * runs.len(), cpu),
        med * 1e3
    );
}

/// `n` timed calls of `one` after one untimed (a warm-up): each call's
/// stages, and the CPU seconds the timed ones took.
fn timed(n: usize, mut one: impl FnMut(&mut Stages)) -> (Vec<Stages>, Option<f64>) {
    one(&mut Stages::default());
    let cpu0 = cpu_seconds();
    let runs = (0..n)
        .map(|_| {
            let mut st = Stages::default();
            one(&mut st);
            st
        })
        .collect();
    (runs, cpu_seconds().zip(cpu0).map(|(a, b)| a - b))
}

/// Decode batch sizes measured, one token per sequence a step.
const DECODE_BATCHES: [usize; 4] = [1, 16, 32, 64];

/// One prefill chunk and every decode batch of [`DECODE_BATCHES`], `reps`
/// timed repetitions each (more for small batches); prints each line when
/// `print`.
fn measure(m: &Model, rng: &mut Rng, reps: usize, print: bool) -> Vec<Figure> {
    let ids_for = |rng: &mut Rng, t: usize| -> Vec<u64> {
        (0..t * HEADS).map(|_| rng.below(m.rows as u64)).collect()
    };
    let figure = |label: String, tokens: usize, runs: &[Stages]| Figure {
        label,
        tokens,
        step: median(runs.iter().map(|s| s.total().as_secs_f64()).collect()),
        project: median(runs.iter().map(|s| s.project.as_secs_f64()).collect()),
        best_project: runs
            .iter()
            .map(|s| s.project.as_secs_f64())
            .fold(f64::INFINITY, f64::min),
    };
    let mut out = Vec::new();

    // Prefill: one 512-token chunk per step of one sequence.
    let t = 512;
    let mut sc = Scratch::new(t);
    let mut highway: Vec<f32> = (0..t * C).map(|_| rng.f32(1.0)).collect();
    let mut state = vec![vec![0.0f32; S * C]];
    let (runs, cpu) = timed(reps, |st| {
        let ids = ids_for(rng, t);
        step(m, &ids, t, &mut highway, &mut state, &mut sc, st);
    });
    out.push(figure(format!("prefill chunk {t}"), t, &runs));
    if print {
        print_size(&format!("prefill chunk {t}"), t, &runs, cpu, "chunk");
    }

    // Decode: B sequences, one token each, per step.
    for b in DECODE_BATCHES {
        let mut sc = Scratch::new(b);
        let mut highway: Vec<f32> = (0..b * C).map(|_| rng.f32(1.0)).collect();
        let mut states: Vec<Vec<f32>> = (0..b)
            .map(|_| (0..S * C).map(|_| rng.f32(1.0)).collect())
            .collect();
        let steps = (reps * 64 / b).clamp(reps, 200);
        let (runs, cpu) = timed(steps, |st| {
            let ids = ids_for(rng, b);
            step(m, &ids, b, &mut highway, &mut states, &mut sc, st);
        });
        out.push(figure(format!("decode batch {b}"), b, &runs));
        if print {
            print_size(&format!("decode batch {b:>3}"), b, &runs, cpu, "step");
        }
    }
    out
}

/// The projection against the measured peak of its instruction, and decode
/// at batch 1 against the measured read bandwidth (see the module docs).
/// Returns the peak in GFLOP/s, if the path has a vector loop.
fn machine_figures(
    packed: &[f32],
    gflops: &[(String, f64)],
    decode1_proj: Option<f64>,
) -> Option<f64> {
    let path = cpu::best_path();
    let threads = rayon::current_num_threads();
    let peaks: Vec<(MulAddLoop, f64)> = LOOPS
        .iter()
        .filter_map(|&l| Some((l, peak_gflops(l)?)))
        .collect();
    println!("multiply peaks on {threads} threads (two FLOPs a product):");
    for (l, g) in &peaks {
        println!(
            "  {:<8} {g:>8.1} GFLOP/s ({} products an instruction)",
            format!("{l:?}"),
            l.products()
        );
    }
    let best = peaks.iter().copied().max_by(|a, b| a.1.total_cmp(&b.1));
    let found = projection_loop(path).and_then(|l| peaks.iter().copied().find(|p| p.0 == l));
    match (found, best) {
        (Some((l, peak)), Some((bl, bpeak))) => {
            println!(
                "projection vs peak: it multiplies with {l:?} ({peak:.1} GFLOP/s); the best loop is {bl:?} ({bpeak:.1} GFLOP/s)"
            );
            for (label, g) in gflops {
                println!(
                    "  {label:<18} projection {g:>7.1} GFLOP/s, {:>5.1}% of its loop's peak, {:>5.1}% of the best",
                    100.0 * g / peak,
                    100.0 * g / bpeak
                );
            }
        }
        _ => println!("projection vs peak: no vector multiply loop on path {path:?}"),
    }
    if let Some(pm) = decode1_proj {
        // Decode at batch 1 reads every packed weight once a step.
        let bytes = std::mem::size_of_val(packed);
        let ours = bytes as f64 / pm / 1e9;
        let hot = read_gbs(bytes);
        let far = read_gbs(1 << 30);
        println!(
            "decode batch 1 vs memory: projection reads {:.1} MB of weights at {ours:.1} GB/s; \
             read bandwidth on {threads} threads {hot:.1} GB/s over a buffer of that size \
             ({:.0}% of it), {far:.1} GB/s over 1 GiB ({:.0}%)",
            bytes as f64 / 1e6,
            100.0 * ours / hot,
            100.0 * ours / far
        );
    }
    found.map(|(_, peak)| peak)
}

/// The Python interpreter for the side by side (`PLE_PYTHON`, default
/// `python3`).
fn python() -> String {
    std::env::var("PLE_PYTHON").unwrap_or_else(|_| "python3".to_string())
}

/// Whether the interpreter imports `module`.
fn can_import(module: &str) -> bool {
    std::process::Command::new(python())
        .args(["-c", &format!("import {module}")])
        .output()
        .map(|o| o.status.success())
        .unwrap_or(false)
}

/// Run `reference/<script>` with the bench's table size and repetitions;
/// its stdout, or why not.
fn run_reference(script: &str, rows: usize, reps: usize) -> Result<String, String> {
    let path = format!("{}/../../reference/{script}", env!("CARGO_MANIFEST_DIR"));
    let out = std::process::Command::new(python())
        .args([
            path.as_str(),
            "--rows",
            &rows.to_string(),
            "--reps",
            &reps.to_string(),
        ])
        .output()
        .map_err(|e| format!("cannot run {}: {e}", python()))?;
    if !out.status.success() {
        return Err(format!(
            "{script} failed: {}",
            String::from_utf8_lossy(&out.stderr)
        ));
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// The median tokens/s a reference script printed for `label` (lines
/// like "decode batch  32: median  1234.5 tokens/s").
fn parse_figure(text: &str, label: &str) -> Option<f64> {
    text.lines().find_map(|l| {
        let (head, rest) = l.split_once(": median")?;
        if head.split_whitespace().collect::<Vec<_>>() != label.split(' ').collect::<Vec<_>>() {
            return None;
        }
        rest.split_whitespace().next()?.parse::<f64>().ok()
    })
}

/// One size in one round of the side by side: ours tokens/s, PyTorch's,
/// transformers' layer's (where it ran), and ours were our projection at
/// the measured peak.
type Round = (f64, f64, Option<f64>, Option<f64>);

/// Median of `v` (not empty).
fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// Run `reference/torch_bench.py` (and `reference/transformers_bench.py`
/// where transformers imports) with the same table size and repetitions,
/// `rounds` times, alternating with a round of ours (`first`, then `again`
/// for each later round), so a drifting machine slows all alike; print
/// each size's median tokens/s, the median over rounds of the round's
/// ratio with its range, and, with the projection's `peak` (GFLOP/s), the
/// ratio to PyTorch ours would reach were our projection at that peak and
/// everything else unchanged: no projection kernel can pass it.
fn torch_side_by_side(
    rows: usize,
    reps: usize,
    rounds: usize,
    first: Vec<Figure>,
    peak: Option<f64>,
    mut again: impl FnMut() -> Vec<Figure>,
) {
    let want = std::env::var("PLE_TORCH").ok();
    if want.as_deref() == Some("0") {
        return;
    }
    if !can_import("torch") {
        println!(
            "PyTorch side by side: skipped ({} cannot import torch; pip install torch, or set PLE_PYTHON)",
            python()
        );
        if want.as_deref() == Some("1") {
            std::process::exit(1);
        }
        return;
    }
    let with_tf = can_import("transformers.models.qwen4_exp.modeling_qwen4_exp");
    let flop_token = 2.0 * (E * O) as f64;
    let mut paired: Vec<(String, Vec<Round>)> = first
        .iter()
        .map(|f| (f.label.clone(), Vec::new()))
        .collect();
    let (mut header, mut tf_header) = (String::new(), String::new());
    let mut ours = first;
    for round in 0..rounds {
        if round > 0 {
            ours = again();
        }
        let text = match run_reference("torch_bench.py", rows, reps) {
            Ok(t) => t,
            Err(e) => {
                println!("PyTorch side by side: {e}");
                return;
            }
        };
        header = text.lines().next().unwrap_or_default().to_string();
        let tf_text = if with_tf {
            match run_reference("transformers_bench.py", rows, reps) {
                Ok(t) => {
                    tf_header = t.lines().next().unwrap_or_default().to_string();
                    Some(t)
                }
                Err(e) => {
                    println!("transformers side by side: {e}");
                    None
                }
            }
        } else {
            None
        };
        for (f, (label, pairs)) in ours.iter().zip(paired.iter_mut()) {
            let at_peak = peak.map(|g| {
                let proj = f.tokens as f64 * flop_token / (g * 1e9);
                f.tokens as f64 / (f.step - f.project + proj)
            });
            let tf = tf_text.as_deref().and_then(|t| parse_figure(t, label));
            if let Some(v) = parse_figure(&text, label) {
                pairs.push((f.tokens_per_s(), v, tf, at_peak));
            }
        }
    }
    println!(
        "PyTorch side by side ({header}); {rounds} rounds, ours and theirs in turn; \
         ratio: the median of the rounds' ratios (lowest..highest)"
    );
    if with_tf {
        println!("  transformers: {tf_header}");
    } else {
        println!(
            "  transformers: skipped ({} cannot import transformers' Qwen4-Exp)",
            python()
        );
    }
    println!(
        "  {:<18} {:>11} {:>11} {:>7} {:>15} {:>9} {:>11} {:>7} {:>15}",
        "step",
        "ours tok/s",
        "torch tok/s",
        "ratio",
        "range",
        "at peak",
        "tf tok/s",
        "ratio",
        "range"
    );
    for (label, pairs) in &paired {
        if pairs.is_empty() {
            println!("  {label:<18} {:>11} {:>11} {:>7}", "?", "?", "?");
            continue;
        }
        let ratios: Vec<f64> = pairs.iter().map(|(a, b, _, _)| a / b).collect();
        let ceiling = pairs
            .iter()
            .map(|(_, b, _, p)| p.map(|p| p / b))
            .collect::<Option<Vec<f64>>>()
            .map_or("-".to_string(), |v| format!("{:.2}x", median(v)));
        let tf: Vec<(f64, f64)> = pairs
            .iter()
            .filter_map(|(a, _, t, _)| Some((*a, (*t)?)))
            .collect();
        let tf_cols = if tf.is_empty() {
            format!("{:>11} {:>7} {:>15}", "-", "-", "-")
        } else {
            let r: Vec<f64> = tf.iter().map(|(a, t)| a / t).collect();
            format!(
                "{:>11.1} {:>6.2}x {:>15}",
                median(tf.iter().map(|p| p.1).collect()),
                median(r.clone()),
                range(&r)
            )
        };
        println!(
            "  {label:<18} {:>11.1} {:>11.1} {:>6.2}x {:>15} {:>9} {tf_cols}",
            median(pairs.iter().map(|p| p.0).collect()),
            median(pairs.iter().map(|p| p.1).collect()),
            median(ratios.clone()),
            range(&ratios),
            ceiling
        );
    }
    println!(
        "  (at peak: the ratio to PyTorch were our projection at the measured peak of its \
         instruction, everything else as measured; tf: transformers' Qwen4ExpTextPLELayer in bfloat16)"
    );
}

/// "lowest..highest" of ratios.
fn range(r: &[f64]) -> String {
    let lo = r.iter().copied().fold(f64::INFINITY, f64::min);
    let hi = r.iter().copied().fold(0.0f64, f64::max);
    format!("{lo:.2}x..{hi:.2}x")
}
