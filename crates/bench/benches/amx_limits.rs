//! The AMX projection against the limits of this CPU: the microbenchmarks
//! of `gemm::amx_limits` (one thread), the measured `tdpbf16ps` peak on
//! every rayon thread, and the projection alone at the bench geometry
//! (E 2560, O 12800) for prefill 512 and decode 1, 16, 32, 64 tokens: the
//! fastest and the median of many calls, in GFLOP/s and as a share of that
//! peak. Quick to run beside `ple_forward` (no table, no PyTorch).
//!
//! Environment: `AMX_LIMITS_CALLS` (timed calls a size, default 40).

use std::hint::black_box;
use std::time::Instant;

use metrale_bench::layer::Rng;
use metrale_model_layers::layers::ple::kernels::cpu::{
    CpuPath, MulAddLoop, best_path, mul_add_rate,
};
use metrale_model_layers::layers::ple::kernels::gemm::{amx_limits, packed_as_bf16, project};
use metrale_model_layers::layers::ple::kernels::pack_projection;
use metrale_storage::dtype::bf16_to_f32;

const E: usize = 2560;
const O: usize = 12800;

fn main() {
    let calls: usize = std::env::var("AMX_LIMITS_CALLS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(40);
    let threads = rayon::current_num_threads();
    println!("path {:?}, {threads} rayon threads", best_path());
    if best_path() != CpuPath::Amx {
        println!("no AMX here: nothing to measure");
        return;
    }
    println!("limits on one thread (min / median of short trials):");
    for l in amx_limits() {
        println!(
            "  {:<55} {:>9.3} / {:>9.3} {}",
            l.what, l.min, l.median, l.unit
        );
    }
    let per_thread = rayon::broadcast(|_| {
        (0..5)
            .filter_map(|_| mul_add_rate(MulAddLoop::Amx, 100_000))
            .fold(0.0f64, f64::max)
    });
    let peak = per_thread.iter().sum::<f64>() * MulAddLoop::Amx.products() as f64 * 2.0 / 1e9;
    println!("tdpbf16ps peak on {threads} threads: {peak:.1} GFLOP/s");

    let mut rng = Rng::new(7);
    let small = std::env::var("AMX_SMALL").is_ok();
    let o = if small { 128 } else { O };
    let w: Vec<u16> = (0..o * E).map(|_| rng.bf16(0.02)).collect();
    let packed = pack_projection(&w, o, E);
    let wb = packed_as_bf16(&packed);
    let sizes: &[usize] = if small {
        &[256, 32, 64]
    } else {
        &[512, 1, 16, 32, 64]
    };
    for &t in sizes {
        let x: Vec<f32> = (0..t * E).map(|_| bf16_to_f32(rng.bf16(1.0))).collect();
        let mut y = vec![0.0f32; t * o];
        project(&x, wb, &mut y, t, E, o).unwrap();
        let mut v: Vec<f64> = (0..calls)
            .map(|_| {
                let t0 = Instant::now();
                project(&x, wb, &mut y, t, E, o).unwrap();
                t0.elapsed().as_secs_f64()
            })
            .collect();
        black_box(&y);
        v.sort_by(f64::total_cmp);
        let flop = 2.0 * (t * E * o) as f64;
        let (best, med) = (flop / v[0] / 1e9, flop / v[v.len() / 2] / 1e9);
        let bytes = (packed.len() * 4) as f64;
        println!(
            "  T {t:>3}: {:>8.3} ms min, {:>8.3} ms median; {best:>7.1} / {med:>7.1} GFLOP/s = {:>5.1}% / {:>5.1}% of peak; weights {:.1} / {:.1} GB/s",
            v[0] * 1e3,
            v[v.len() / 2] * 1e3,
            100.0 * best / peak,
            100.0 * med / peak,
            bytes / v[0] / 1e9,
            bytes / v[v.len() / 2] / 1e9,
        );
    }
}
