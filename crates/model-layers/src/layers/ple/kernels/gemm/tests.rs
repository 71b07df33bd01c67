//! Tests of the projection: the packing round trip, every CPU path of the
//! FMA chain's bit class against the chain bit for bit, the AMX path
//! against the f64 reference (within its bound) and its own invariants,
//! and the refused shapes.

use super::*;
use crate::layers::ple::ids::splitmix64;
use crate::layers::ple::kernels::math::{bf16_round, bf16_to_f32};

/// A deterministic pseudo-random BF16 value in about [-2, 2).
fn val(seed: u64) -> u16 {
    let z = splitmix64(seed);
    let f = ((z >> 40) as f32 / (1u64 << 24) as f32) * 4.0 - 2.0;
    (bf16_round(f).to_bits() >> 16) as u16
}

/// The contract's formula, written out: a sequential FMA chain over `e`.
fn naive(x: &[f32], w: &[u16], t: usize, e: usize, o: usize) -> Vec<f32> {
    let mut y = vec![0.0f32; t * o];
    for ti in 0..t {
        for oi in 0..o {
            let mut acc = 0.0f32;
            for ei in 0..e {
                acc = x[ti * e + ei].mul_add(bf16_to_f32(w[oi * e + ei]), acc);
            }
            y[ti * o + oi] = acc;
        }
    }
    y
}

/// Every path of this CPU whose projection is the sequential FMA chain.
fn chain_paths() -> Vec<CpuPath> {
    CpuPath::all_available()
        .into_iter()
        .filter(|&p| p != CpuPath::Amx)
        .collect()
}

fn case(t: usize, e: usize, o: usize, seed: u64) -> (Vec<f32>, Vec<u16>) {
    let x = (0..t * e)
        .map(|i| bf16_to_f32(val(seed ^ (i as u64) << 1)))
        .collect();
    let w = (0..o * e).map(|i| val(!seed ^ (i as u64) << 3)).collect();
    (x, w)
}

#[test]
fn packed_len_and_roundtrip() {
    assert_eq!(packed_len(16, 4), 32);
    assert_eq!(packed_len(17, 4), 64);
    let w: Vec<u16> = (0..17 * 3).map(|i| i as u16 + 1).collect();
    let p = pack_projection(&w, 17, 3);
    assert_eq!(p.len(), packed_len(17, 3));
    let h = packed_as_bf16(&p);
    // Panel 0, step 1 (odd: the low half of pair 0), column 2 is w[2, 1].
    assert_eq!(h[half_index(2, 1)], w[2 * 3 + 1]);
    assert_eq!(half_index(2, 1), 4);
    // Step 0 is the high half of the same word.
    assert_eq!(h[5], w[2 * 3]);
    // Panel 1 holds row 16 then zero padding; step 2 is the high half
    // of pair 1, whose low half pads the odd depth.
    let p1 = panel_len(3);
    assert_eq!(p1, 64);
    assert_eq!(h[p1 + half_index(0, 2)], w[16 * 3 + 2]);
    assert_eq!(h[p1 + half_index(0, 2) - 1], 0);
    assert_eq!(h[p1 + half_index(1, 2)], 0);
    assert!(
        try_pack_projection(&w, 17, 4)
            .unwrap_err()
            .to_string()
            .contains("51 values")
    );
}

#[test]
fn every_path_equals_the_fma_chain_bit_for_bit() {
    // Shapes around the tile edges: T not a multiple of MR or TILE_ROWS,
    // O not a multiple of NR, E not a multiple of KC.
    for &(t, e, o) in &[
        (1, 1, 1),
        (1, 300, 150),
        (1, 513, 64),
        (7, 300, 33),
        (13, 17, 16),
        (97, 257, 20),
        (100, 40, 50),
        // Tile heights of the 12-row AVX-512 tile and a partial last block.
        (25, 259, 48),
        (12, 256, 32),
    ] {
        let (x, w) = case(t, e, o, (t * 131 + e * 7 + o) as u64);
        let want = naive(&x, &w, t, e, o);
        let packed = pack_projection(&w, o, e);
        for path in chain_paths() {
            let mut y = vec![f32::NAN; t * o];
            project_on(path, &x, packed_as_bf16(&packed), &mut y, t, e, o).unwrap();
            let same = y.iter().zip(&want).all(|(a, b)| a.to_bits() == b.to_bits());
            assert!(same, "path {path:?} differs at T={t} E={e} O={o}");
        }
        // Each kernel, whichever one `project_on` picks on this CPU.
        for kernel in Kernel::all_available() {
            let mut y = vec![f32::NAN; t * o];
            project_checked(
                kernel,
                &x,
                packed_as_bf16(&packed),
                &mut y,
                t,
                e,
                o,
                Steps::all(e),
            )
            .unwrap();
            let same = y.iter().zip(&want).all(|(a, b)| a.to_bits() == b.to_bits());
            assert!(same, "kernel {kernel:?} differs at T={t} E={e} O={o}");
        }
    }
}

/// `(from, to)` ranges covering `0..e` cut at each of `cuts` (even).
fn ranges(e: usize, cuts: &[usize]) -> Vec<(usize, usize)> {
    let mut edges = vec![0];
    edges.extend(cuts.iter().copied().filter(|&c| c > 0 && c < e));
    edges.push(e);
    edges.windows(2).map(|w| (w[0], w[1])).collect()
}

#[test]
fn consecutive_ranges_equal_one_call_on_every_kernel() {
    // Cuts inside and on KC blocks, odd depths (the last range ends at E),
    // single rows (the row-direct kernels) and tiles, outputs in whole
    // panels and not.
    for &(t, e, o, cuts) in &[
        (1, 300, 150, &[100, 256][..]),
        (1, 513, 64, &[2, 320, 512][..]),
        (7, 300, 33, &[160][..]),
        (25, 259, 48, &[128, 130, 258][..]),
        (32, 2560, 40, &[640, 1280, 1920][..]),
        (100, 640, 20, &[320][..]),
        // Whole panels: the sums between calls are staged panel by panel,
        // in two token tiles.
        (100, 640, 32, &[2, 320, 322][..]),
        (13, 17, 16, &[4, 8, 12, 16][..]),
    ] {
        let (x, w) = case(t, e, o, (t * 7 + e + o * 3) as u64);
        let want = naive(&x, &w, t, e, o);
        let packed = pack_projection(&w, o, e);
        let wb = packed_as_bf16(&packed);
        // Each range from where the last left off; stale values in `y` must
        // not leak into the first.
        let in_ranges = |call: &mut dyn FnMut(&mut [f32], Steps)| {
            let mut y = vec![f32::NAN; t * o];
            for (i, (from, to)) in ranges(e, cuts).into_iter().enumerate() {
                let accumulate = i > 0;
                call(
                    &mut y,
                    Steps {
                        from,
                        to,
                        accumulate,
                    },
                );
            }
            y.iter().zip(&want).all(|(a, b)| a.to_bits() == b.to_bits())
        };
        for kernel in Kernel::all_available() {
            let same = in_ranges(&mut |y, steps| {
                project_checked(kernel, &x, wb, y, t, e, o, steps).unwrap()
            });
            assert!(
                same,
                "kernel {kernel:?} in ranges {cuts:?} differs at T={t} E={e} O={o}"
            );
        }
        for path in chain_paths() {
            assert!(in_ranges(&mut |y, steps| {
                project_range_on(path, &x, wb, y, t, e, o, steps).unwrap()
            }));
        }
    }
}

#[test]
fn bad_ranges_are_refused() {
    let p = pack_projection(&[0u16; 8], 2, 4);
    let wb = packed_as_bf16(&p);
    let mut y = vec![0.0f32; 2];
    for (from, to) in [(1, 4), (0, 3), (2, 2), (0, 5), (4, 2)] {
        let steps = Steps {
            from,
            to,
            accumulate: true,
        };
        let err = project_range(&[0.0; 4], wb, &mut y, 1, 4, 2, steps).unwrap_err();
        assert!(
            err.to_string().contains(&format!("steps {from}..{to}")),
            "{err}"
        );
    }
}

#[test]
fn row_by_row_equals_one_call() {
    let (t, e, o) = (20, 70, 40);
    let (x, w) = case(t, e, o, 5);
    let packed = pack_projection(&w, o, e);
    let wb = packed_as_bf16(&packed);
    let mut all = vec![0.0f32; t * o];
    project(&x, wb, &mut all, t, e, o).unwrap();
    for ti in 0..t {
        let mut one = vec![0.0f32; o];
        project(&x[ti * e..(ti + 1) * e], wb, &mut one, 1, e, o).unwrap();
        assert_eq!(
            one.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
            all[ti * o..(ti + 1) * o]
                .iter()
                .map(|v| v.to_bits())
                .collect::<Vec<_>>()
        );
    }
}

#[test]
fn bad_lengths_are_errors() {
    let p = pack_projection(&[0u16; 8], 2, 4);
    let wb = packed_as_bf16(&p);
    let mut y = vec![0.0f32; 2];
    assert!(project(&[0.0; 4], wb, &mut y, 1, 4, 2).is_ok());
    assert!(
        project(&[0.0; 3], wb, &mut y, 1, 4, 2)
            .unwrap_err()
            .to_string()
            .contains("x holds 3")
    );
    assert!(
        project(&[0.0; 4], wb, &mut y[..1], 1, 4, 2)
            .unwrap_err()
            .to_string()
            .contains("y holds 1")
    );
    assert!(
        project(&[0.0; 4], &wb[..2], &mut y, 1, 4, 2)
            .unwrap_err()
            .to_string()
            .contains("packed")
    );
    assert!(project(&[], wb, &mut [], 0, 4, 2).is_ok());
}

/// The projection in f64 (exact products, near-exact sums) and, per
/// output, the sum of the products' magnitudes: the scale an f32 sum's
/// error is measured against.
fn reference_f64(x: &[f32], w: &[u16], t: usize, e: usize, o: usize) -> (Vec<f64>, Vec<f64>) {
    let mut y = vec![0.0f64; t * o];
    let mut mag = vec![0.0f64; t * o];
    for ti in 0..t {
        for oi in 0..o {
            let (mut acc, mut m) = (0.0f64, 0.0f64);
            for ei in 0..e {
                let p = f64::from(x[ti * e + ei]) * f64::from(bf16_to_f32(w[oi * e + ei]));
                acc += p;
                m += p.abs();
            }
            y[ti * o + oi] = acc;
            mag[ti * o + oi] = m;
        }
    }
    (y, mag)
}

/// The largest error of `y` against the f64 reference, in units of
/// `2^-24` (the f32 unit roundoff) times the output's magnitude sum.
fn error_units(y: &[f32], want: &[f64], mag: &[f64]) -> f64 {
    y.iter()
        .zip(want)
        .zip(mag)
        .map(|((&a, &b), &m)| {
            if m == 0.0 {
                f64::from(a).abs()
            } else {
                (f64::from(a) - b).abs() / (m * f64::powi(2.0, -24))
            }
        })
        .fold(0.0, f64::max)
}

/// The error bound of the AMX path, in the units of [`error_units`]; the
/// figure docs/SPEC.md states (see `amx_error_is_within_its_bound`).
const AMX_BOUND_UNITS: f64 = 4.0;

/// The AMX tests run only where the process may use AMX; elsewhere they
/// say so and pass.
fn amx_or_skip(test: &str) -> bool {
    if CpuPath::Amx.available() {
        true
    } else {
        eprintln!(
            "{test}: SKIPPED, this CPU or OS runs no AMX-BF16 (CPUID lacks AMX-TILE/AMX-BF16 \
             or Linux refused the tile data permission)"
        );
        false
    }
}

#[test]
fn amx_error_is_within_its_bound() {
    if !amx_or_skip("amx_error_is_within_its_bound") {
        return;
    }
    let mut worst = (0.0f64, 0.0f64);
    let (mut differ, mut total) = (0usize, 0usize);
    for &(t, e, o) in &[
        (1, 1, 1),
        (1, 300, 150),
        (7, 300, 33),
        (13, 17, 16),
        (17, 2560, 48),
        (97, 257, 20),
        (40, 640, 64),
    ] {
        let (x, w) = case(t, e, o, (t * 31 + e * 5 + o) as u64);
        let (want, mag) = reference_f64(&x, &w, t, e, o);
        let packed = pack_projection(&w, o, e);
        let mut y = vec![f32::NAN; t * o];
        project_on(CpuPath::Amx, &x, packed_as_bf16(&packed), &mut y, t, e, o).unwrap();
        let amx = error_units(&y, &want, &mag);
        let naive_y = naive(&x, &w, t, e, o);
        let chain = error_units(&naive_y, &want, &mag);
        differ += y
            .iter()
            .zip(&naive_y)
            .filter(|(a, b)| a.to_bits() != b.to_bits())
            .count();
        total += y.len();
        assert!(
            amx <= AMX_BOUND_UNITS,
            "AMX error {amx:.3} units at T={t} E={e} O={o} (bound {AMX_BOUND_UNITS}; the FMA chain {chain:.3})"
        );
        worst = (worst.0.max(amx), worst.1.max(chain));
    }
    eprintln!(
        "AMX error at most {:.3} units of 2^-24 x sum|x w| (the FMA chain: {:.3}); \
         {differ} of {total} outputs differ from the chain's bits",
        worst.0, worst.1
    );
}

/// The AMX projection of `x` in one call, as bits.
fn amx_bits(x: &[f32], wb: &[u16], t: usize, e: usize, o: usize) -> Vec<u32> {
    let mut y = vec![f32::NAN; t * o];
    project_on(CpuPath::Amx, x, wb, &mut y, t, e, o).unwrap();
    y.iter().map(|v| v.to_bits()).collect()
}

#[test]
fn amx_rows_do_not_depend_on_the_batch() {
    if !amx_or_skip("amx_rows_do_not_depend_on_the_batch") {
        return;
    }
    // Batches across the 16-row tiles and the 512-row token tiles.
    for &(t, e, o) in &[(40, 300, 48), (600, 96, 32)] {
        let (x, w) = case(t, e, o, 77);
        let packed = pack_projection(&w, o, e);
        let wb = packed_as_bf16(&packed);
        let all = amx_bits(&x, wb, t, e, o);
        for (t0, n) in [(0, 1), (5, 1), (17, 3), (3, 16), (20, 20), (t - 1, 1)] {
            let part = amx_bits(&x[t0 * e..(t0 + n) * e], wb, n, e, o);
            assert_eq!(
                part,
                all[t0 * o..(t0 + n) * o],
                "rows {t0}..{} of T={t}",
                t0 + n
            );
        }
        // Another thread count changes only which task runs a panel.
        let one = rayon::ThreadPoolBuilder::new()
            .num_threads(1)
            .build()
            .unwrap()
            .install(|| amx_bits(&x, wb, t, e, o));
        assert_eq!(one, all, "one thread against the pool at T={t}");
    }
}

#[test]
fn amx_ranges_at_block_edges_equal_one_call() {
    if !amx_or_skip("amx_ranges_at_block_edges_equal_one_call") {
        return;
    }
    for &(t, e, o, cuts) in &[
        (1, 2560, 64, &[640, 1280, 1920][..]),
        (33, 2560, 40, &[160, 320, 2240][..]),
        (100, 259, 32, &[32, 64, 256][..]),
    ] {
        let (x, w) = case(t, e, o, 9);
        let packed = pack_projection(&w, o, e);
        let wb = packed_as_bf16(&packed);
        let want = amx_bits(&x, wb, t, e, o);
        let mut y = vec![f32::NAN; t * o];
        for (i, (from, to)) in ranges(e, cuts).into_iter().enumerate() {
            let steps = Steps {
                from,
                to,
                accumulate: i > 0,
            };
            project_range_on(CpuPath::Amx, &x, wb, &mut y, t, e, o, steps).unwrap();
        }
        let got: Vec<u32> = y.iter().map(|v| v.to_bits()).collect();
        assert_eq!(got, want, "cuts {cuts:?} at T={t} E={e} O={o}");
    }
}

#[test]
fn amx_ranges_anywhere_stay_within_the_bound() {
    if !amx_or_skip("amx_ranges_anywhere_stay_within_the_bound") {
        return;
    }
    for &(t, e, o, cuts) in &[
        (7, 300, 33, &[2, 100, 258][..]),
        (13, 17, 16, &[4, 8, 12, 16][..]),
        (25, 259, 48, &[128, 130, 258][..]),
    ] {
        let (x, w) = case(t, e, o, 21);
        let (want, mag) = reference_f64(&x, &w, t, e, o);
        let packed = pack_projection(&w, o, e);
        let wb = packed_as_bf16(&packed);
        let mut y = vec![f32::NAN; t * o];
        for (i, (from, to)) in ranges(e, cuts).into_iter().enumerate() {
            let steps = Steps {
                from,
                to,
                accumulate: i > 0,
            };
            project_range_on(CpuPath::Amx, &x, wb, &mut y, t, e, o, steps).unwrap();
        }
        let err = error_units(&y, &want, &mag);
        assert!(err <= AMX_BOUND_UNITS, "cuts {cuts:?}: {err:.3} units");
    }
}

#[test]
fn amx_path_runs_the_chain_for_activations_that_are_not_bf16() {
    if !amx_or_skip("amx_path_runs_the_chain_for_activations_that_are_not_bf16") {
        return;
    }
    let (t, e, o) = (5, 70, 40);
    let (mut x, w) = case(t, e, o, 3);
    x[7] += x[7] * f32::EPSILON;
    let packed = pack_projection(&w, o, e);
    let mut y = vec![0.0f32; t * o];
    project_on(CpuPath::Amx, &x, packed_as_bf16(&packed), &mut y, t, e, o).unwrap();
    let want = naive(&x, &w, t, e, o);
    assert!(y.iter().zip(&want).all(|(a, b)| a.to_bits() == b.to_bits()));
}

#[test]
fn amx_peak_loop_runs() {
    if !amx_or_skip("amx_peak_loop_runs") {
        return;
    }
    use super::super::cpu::{MulAddLoop, mul_add_rate};
    let rate = mul_add_rate(MulAddLoop::Amx, 1000).unwrap();
    assert!(rate > 0.0);
}
