//! The AVX-512 path (x86-64 with AVX-512F and AVX-512 BF16): two register
//! tiles over the same packed weights, 16-lane f32 FMAs over weights
//! widened one block at a time, and `vdpbf16ps` over BF16 pairs; and the
//! single-row kernel. Both tiles keep the sequential FMA chain of the
//! parent module bit for bit.

use std::arch::x86_64::*;

use rayon::prelude::*;

use super::{KC, NR, TILE_ROWS, Tile, panel_len, zeroed};

/// Rows of the AVX-512 BF16 register tile (of 32 registers: 8 accumulators,
/// the weight pair, the broadcasts).
const MR_BF16: usize = 8;
/// Depth of a weight block the AVX-512 FMA kernel widens at once (two
/// panels: 16 KiB of f32, a third of L1, so the activation rows of a tile
/// stay cached beside it).
const KC_512: usize = 128;
/// Rows of the AVX-512 FMA register tile (of 32 registers: 2 x 12
/// accumulators, the two weight vectors, the broadcast).
const MR_512: usize = 12;

/// The activations of one token tile as a kernel reads them, reused from
/// tile to tile of a call.
#[derive(Default)]
pub(super) struct Scratch {
    /// BF16 pairs for `vdpbf16ps` (see [`panels_bf16`]).
    pairs: Vec<u32>,
    /// f32 register tiles for the FMA kernel (see [`pack_tiles`]).
    packed: Vec<f32>,
}

/// One token tile (`xt`, `tile.rows` rows of `e`) against all `np` panels
/// of `w`, steps `k0..k1`, with `vdpbf16ps` when `dot`, else the f32 FMA
/// tile: rayon over pairs of panels (two panels a task share every
/// activation broadcast). Continues the sums `tile` holds when
/// `accumulate`.
///
/// The caller has checked that this CPU has AVX-512F, and AVX-512 BF16
/// when `dot`, and that the activations are exact BF16 values when `dot`.
#[allow(clippy::too_many_arguments)]
pub(super) fn token_tile(
    dot: bool,
    xt: &[f32],
    w: &[u16],
    tile: Tile,
    np: usize,
    e: usize,
    (k0, k1): (usize, usize),
    accumulate: bool,
    scratch: &mut Scratch,
) {
    let rows = tile.rows;
    // Only the steps of this call are packed: a projection cut into
    // ranges packs each activation once, as one call does.
    if dot {
        scratch.pairs.clear();
        scratch.pairs.extend(xt.chunks_exact(e).flat_map(|row| {
            (k0 / 2..k1.div_ceil(2)).map(move |i| {
                let hi = row[2 * i].to_bits() >> 16;
                let lo = row.get(2 * i + 1).map_or(0, |v| v.to_bits() >> 16);
                (hi << 16) | lo
            })
        }));
    } else {
        pack_tiles(xt, rows, e, k0, k1, &mut scratch.packed);
    }
    let (xpairs, xpacked) = (&scratch.pairs[..], &scratch.packed[..]);
    let groups = np.div_ceil(2);
    let min_len = (groups / (rayon::current_num_threads() * 8)).max(1);
    (0..groups)
        .into_par_iter()
        .with_min_len(min_len)
        .for_each(|g| {
            let p0 = 2 * g;
            let n = 2.min(np - p0);
            let mut acc_buf = [std::mem::MaybeUninit::<f32>::uninit(); 2 * TILE_ROWS * NR];
            let acc = zeroed(&mut acc_buf[..n * rows * NR]);
            if accumulate {
                for q in 0..n {
                    // SAFETY: panel `p0 + q` belongs to this task alone
                    // (see `Tile`).
                    unsafe { tile.load(&mut acc[q * rows * NR..], p0 + q) };
                }
            }
            let wg = &w[p0 * panel_len(e)..(p0 + n) * panel_len(e)];
            if dot {
                panels_bf16(xpairs, wg, n, acc, rows, e, k0, k1);
            } else {
                let next = &w[((p0 + n) * panel_len(e)).min(w.len())..];
                panels_fma512(xpacked, wg, next, n, acc, rows, e, k0, k1);
            }
            for q in 0..n {
                // SAFETY: as above.
                unsafe { tile.store(&acc[q * rows * NR..], p0 + q) };
            }
        });
}

/// Weight lines for a micro-kernel to hint into L2 while it computes:
/// `lines` lines of each of `panels` panels from `from`, the second
/// `stride` words after the first. Into L2, not L1: L1 holds the block the
/// tiles are computing from, and the block after it would evict it.
/// Addresses past the weights are only ever prefetched, which never
/// faults.
#[derive(Clone, Copy)]
struct Ahead {
    from: *const u32,
    stride: usize,
    lines: usize,
    panels: usize,
}

impl Ahead {
    /// Tile `tile` of `tiles`' share of the block.
    fn share(self, tile: usize, tiles: usize) -> Ahead {
        let (lo, hi) = (self.lines * tile / tiles, self.lines * (tile + 1) / tiles);
        Ahead {
            from: self.from.wrapping_add(lo * NR),
            lines: hi - lo,
            ..self
        }
    }

    /// Hint line `p` of the share, if it has one.
    #[inline(always)]
    fn line(self, p: usize) {
        if p >= self.lines {
            return;
        }
        for q in 0..self.panels {
            let at = self.from.wrapping_add(q * self.stride + p * NR);
            // SAFETY: a prefetch never faults, whatever the address.
            unsafe { _mm_prefetch::<{ _MM_HINT_T1 }>(at.cast()) };
        }
    }
}

/// `n` (1 or 2) consecutive panels on the AVX-512 BF16 path for `rows`
/// token rows, steps `k0..k1` (`k0` even): `acc [n, rows, NR]` continues
/// their outputs. `xpairs` holds the rows' steps `k0..k1` as BF16 pairs,
/// `ceil((k1 - k0) / 2)` words a row.
#[allow(clippy::too_many_arguments)]
fn panels_bf16(
    xpairs: &[u32],
    wp: &[u16],
    n: usize,
    acc: &mut [f32],
    rows: usize,
    e: usize,
    k0: usize,
    k1: usize,
) {
    let pl = panel_len(e);
    assert!((1..=2).contains(&n) && wp.len() == n * pl && acc.len() == n * rows * NR);
    let e2 = e.div_ceil(2);
    let w2 = (k1 - k0).div_ceil(2);
    let (acc0, acc1) = acc.split_at_mut(rows * NR);
    // The packed words are the `vdpbf16ps` operands; a panel is `e2 * NR`
    // of them. The second panel's pointer is only read when n == 2.
    let words = wp.as_ptr().cast::<u32>();
    for kb in (k0..k1).step_by(KC) {
        let kc = KC.min(k1 - kb);
        let kp = kc.div_ceil(2);
        let tiles = rows.div_ceil(MR_BF16);
        let (base, extra) = (rows / tiles, rows % tiles);
        // The block after this one (the next pair of panels' first block
        // after the last), fetched a share a tile. Without it only the
        // first tile reads a block from memory, faster than memory
        // delivers, and the other tiles leave the memory idle: at decode
        // sizes (few tiles) that cost a tenth of the projection's rate.
        let next = {
            let (at, steps) = if kb + KC < k1 {
                ((kb + KC) / 2, KC.min(k1 - kb - KC))
            } else {
                (n * e2 + k0 / 2, KC.min(k1 - k0))
            };
            Ahead {
                from: words.wrapping_add(at * NR),
                stride: e2 * NR,
                lines: steps.div_ceil(2),
                panels: n,
            }
        };
        let mut r0 = 0;
        for tile in 0..tiles {
            let mr = base + usize::from(tile < extra);
            // KC and k0 are even, so block `kb` starts at pair `(kb - k0)
            // / 2` of a row.
            let xs = &xpairs[r0 * w2 + (kb - k0) / 2..];
            assert!(xs.len() >= (mr - 1) * w2 + kp);
            let a0 = &mut acc0[r0 * NR..(r0 + mr) * NR];
            let a1: &mut [f32] = if n == 2 {
                &mut acc1[r0 * NR..(r0 + mr) * NR]
            } else {
                &mut []
            };
            // SAFETY: `project_on` only picks this path when the CPU has
            // AVX-512F and AVX-512 BF16; the asserts above and the slice
            // lengths bound every access (`b1` and `a1` are only used when
            // n == 2, and `wp` then holds two panels).
            unsafe {
                // KC and k0 are even, so block `kb` starts at word `kb / 2 * NR`;
                // the loads are unaligned, so the u16 slice's alignment
                // does not matter.
                let b0 = words.add(kb / 2 * NR);
                let b1 = words.add(e2 * NR + kb / 2 * NR);
                let ahead = next.share(tile, tiles);
                let xp = xs.as_ptr();
                let (p0, p1) = (a0.as_mut_ptr(), a1.as_mut_ptr());
                macro_rules! tile {
                    ($($m:literal)*) => {
                        match (mr, n) {
                            $(($m, 2) => micro_bf16_2::<$m>(xp, w2, b0, b1, kp, p0, p1, ahead),
                              ($m, _) => micro_bf16::<$m>(xp, w2, b0, kp, p0, ahead),)*
                            _ => unreachable!("tile heights are at most MR_BF16"),
                        }
                    };
                }
                tile!(1 2 3 4 5 6 7 8);
            }
            r0 += mr;
        }
    }
}

/// The register-tile heights `rows` rows split into: near-equal, at most
/// `MR_512` (32 rows become 11 + 11 + 10: short tiles leave FMA latency
/// exposed). Heights change nothing in the results.
fn tiles_512(rows: usize) -> impl Iterator<Item = usize> {
    let tiles = rows.div_ceil(MR_512);
    let (base, extra) = (rows / tiles.max(1), rows % tiles.max(1));
    (0..tiles).map(move |tile| base + usize::from(tile < extra))
}

/// Steps `k0..k1` of `xt [rows, e]` into `out` tile by tile (heights from
/// [`tiles_512`]): with `w = k1 - k0`, a tile of height `m` starting at row
/// `r0` is `[w, m]` at `out[r0 * w..]`, so a register tile's activations
/// of one step lie side by side and its broadcasts walk one pointer.
fn pack_tiles(xt: &[f32], rows: usize, e: usize, k0: usize, k1: usize, out: &mut Vec<f32>) {
    let w = k1 - k0;
    out.clear();
    out.resize(rows * w, 0.0);
    let mut r0 = 0;
    for m in tiles_512(rows) {
        let dst = &mut out[r0 * w..(r0 + m) * w];
        for i in 0..m {
            let row = &xt[(r0 + i) * e + k0..(r0 + i) * e + k1];
            for (k, &v) in row.iter().enumerate() {
                dst[k * m + i] = v;
            }
        }
        r0 += m;
    }
}

/// `n` (1 or 2) consecutive panels with the AVX-512 FMA kernel for `rows`
/// token rows, `xp` their steps `k0..k1` packed by [`pack_tiles`]: `acc [n, rows, NR]` gets their
/// outputs. Each `KC` block of the weights is widened to f32 once, `[kc,
/// 2 * NR]` (both panels of a step side by side), and shared by every
/// register tile of the rows.
///
/// The weights stream from memory once per token tile: while a block is
/// multiplied, its tiles prefetch the next block (or, after the last one,
/// the first block of `next`, the panels the task likely runs next), so the
/// widening finds its block in cache.
#[allow(clippy::too_many_arguments)]
fn panels_fma512(
    xp: &[f32],
    wp: &[u16],
    next: &[u16],
    n: usize,
    acc: &mut [f32],
    rows: usize,
    e: usize,
    k0: usize,
    k1: usize,
) {
    let pl = panel_len(e);
    assert!((1..=2).contains(&n) && wp.len() == n * pl && acc.len() == n * rows * NR);
    assert!(xp.len() == rows * (k1 - k0));
    let mut buf = [0.0f32; KC_512 * 2 * NR];
    let (acc0, acc1) = acc.split_at_mut(rows * NR);
    for kb in (k0..k1).step_by(KC_512) {
        let kc = KC_512.min(k1 - kb);
        // The block to prefetch: panels `q` at `base + q * pl`, `len` halves
        // each (a 64-byte line holds one pair of 16 columns: 32 halves).
        let (pf, pf_panels, pf_steps) = if kb + KC_512 < k1 {
            (&wp[(kb + KC_512) * NR..], n, KC_512.min(k1 - kb - KC_512))
        } else {
            (
                next.get(k0 * NR..).unwrap_or(&[]),
                (next.len() / pl).min(2),
                KC_512.min(k1 - k0),
            )
        };
        let pf_lines = pf_steps.div_ceil(2);
        for q in 0..n {
            // KC_512 and k0 are even, so block `kb` starts at half `kb * NR`
            // of a panel.
            let src = &wp[q * pl + kb * NR..q * pl + kb * NR + kc.div_ceil(2) * 2 * NR];
            // SAFETY: `project_checked` picks this kernel only where the CPU
            // has AVX-512F; `src` and `buf` hold the block (checked inside).
            unsafe { widen(src, &mut buf[..kc * 2 * NR], q) };
        }
        let tiles = rows.div_ceil(MR_512);
        let mut r0 = 0;
        for (tile, mr) in tiles_512(rows).enumerate() {
            // This tile's share of the next block's lines.
            for q in 0..pf_panels {
                let (l0, l1) = (tile * pf_lines / tiles, (tile + 1) * pf_lines / tiles);
                for line in l0..l1 {
                    if let Some(h) = pf.get(q * pl + line * 32) {
                        prefetch(h);
                    }
                }
            }
            // Steps `kb .. kb + kc` of this tile, `[kc, mr]`.
            let w = k1 - k0;
            let xs = &xp[r0 * w + (kb - k0) * mr..r0 * w + (kb - k0 + kc) * mr];
            let a0 = &mut acc0[r0 * NR..(r0 + mr) * NR];
            let a1: &mut [f32] = if n == 2 {
                &mut acc1[r0 * NR..(r0 + mr) * NR]
            } else {
                &mut []
            };
            // SAFETY: AVX-512F as above; the slice lengths bound every
            // access (`a1` only when n == 2).
            unsafe {
                let (xs, bp, p0, p1) =
                    (xs.as_ptr(), buf.as_ptr(), a0.as_mut_ptr(), a1.as_mut_ptr());
                macro_rules! tile {
                    ($($m:literal)*) => {
                        match (mr, n) {
                            $(($m, 2) => micro_fma::<$m, 2>(xs, bp, kc, [p0, p1]),
                              ($m, _) => micro_fma::<$m, 1>(xs, bp, kc, [p0]),)*
                            _ => unreachable!("tile heights are at most MR_512"),
                        }
                    };
                }
                tile!(1 2 3 4 5 6 7 8 9 10 11 12);
            }
            r0 += mr;
        }
    }
}

/// Hint the cache line holding `v` into all cache levels.
#[inline(always)]
fn prefetch(v: &u16) {
    // SAFETY: a prefetch never faults; `v` is a valid reference anyway.
    unsafe { _mm_prefetch::<{ _MM_HINT_T0 }>((v as *const u16).cast()) };
}

/// Widen one packed block of a panel (`kc = dst.len() / (2 * NR)`
/// steps) into slot `q` (0 or 1) of `dst [kc, 2 * NR]`: each pair word
/// gives step `2i` (its high half, masked) and step `2i + 1` (its low
/// half, shifted up).
///
/// # Safety
/// The CPU must support AVX-512F.
#[target_feature(enable = "avx512f")]
unsafe fn widen(src: &[u16], dst: &mut [f32], q: usize) {
    let kc = dst.len() / (2 * NR);
    assert!(q < 2 && src.len() >= kc.div_ceil(2) * 2 * NR && dst.len() == kc * 2 * NR);
    let words = src.as_ptr().cast::<u32>();
    let d = dst.as_mut_ptr();
    // SAFETY: the assert bounds every load (pair `i` is words `i * NR ..
    // (i + 1) * NR`) and store (step `k`, slot `q` is `dst[k * 2 * NR +
    // q * NR ..][..NR]`); loads and stores are unaligned.
    unsafe {
        let mask = _mm512_set1_epi32(0xFFFF_0000u32 as i32);
        for i in 0..kc / 2 {
            let v = _mm512_loadu_si512(words.add(i * NR).cast());
            let even = _mm512_castsi512_ps(_mm512_and_si512(v, mask));
            let odd = _mm512_castsi512_ps(_mm512_slli_epi32::<16>(v));
            _mm512_storeu_ps(d.add(2 * i * 2 * NR + q * NR), even);
            _mm512_storeu_ps(d.add((2 * i + 1) * 2 * NR + q * NR), odd);
        }
        if kc % 2 == 1 {
            let i = kc / 2;
            let v = _mm512_loadu_si512(words.add(i * NR).cast());
            let even = _mm512_castsi512_ps(_mm512_and_si512(v, mask));
            _mm512_storeu_ps(d.add(2 * i * 2 * NR + q * NR), even);
        }
    }
}

/// `acc[p] [M, NR] += x [M, kc] @ b[.., p] [kc, NR]` for the `P` (1 or
/// 2) panels of `b [kc, 2 * NR]`: one FMA per element and step, `k`
/// ascending, exactly as `portable::micro`; each activation broadcast
/// feeds every panel.
///
/// # Safety
/// The CPU must support AVX-512F; `x` (`[kc, M]`) must be readable at
/// `k * M + i` for `i < M`, `k < kc`; `b` at `kc * 2 * NR` values; each
/// `acc[p]` readable and writable at `M * NR` values.
#[target_feature(enable = "avx512f")]
// Register tiles read clearest indexed by row and panel.
#[allow(clippy::needless_range_loop)]
unsafe fn micro_fma<const M: usize, const P: usize>(
    x: *const f32,
    b: *const f32,
    kc: usize,
    acc: [*mut f32; P],
) {
    // SAFETY: all reads and writes stay inside the ranges the caller
    // guarantees; unaligned loads and stores are used throughout.
    unsafe {
        let mut c = [[_mm512_setzero_ps(); M]; P];
        for p in 0..P {
            for i in 0..M {
                c[p][i] = _mm512_loadu_ps(acc[p].add(i * NR));
            }
        }
        for k in 0..kc {
            let mut bk = [_mm512_setzero_ps(); P];
            for (p, bp) in bk.iter_mut().enumerate() {
                *bp = _mm512_loadu_ps(b.add(k * 2 * NR + p * NR));
            }
            for i in 0..M {
                let a = _mm512_set1_ps(*x.add(k * M + i));
                for p in 0..P {
                    c[p][i] = _mm512_fmadd_ps(a, bk[p], c[p][i]);
                }
            }
        }
        for p in 0..P {
            for i in 0..M {
                _mm512_storeu_ps(acc[p].add(i * NR), c[p][i]);
            }
        }
    }
}

/// One row against `P` consecutive panels, widening the BF16 weights in
/// registers: `out [P * NR]` continues the sequential FMA chain over
/// steps `k0..k1` from the sums it holds, exactly as `portable::micro`
/// computes it through blocks.
///
/// # Safety
/// The CPU must support AVX-512F; `k0` even, `k0 < k1 <= e`; `x`
/// readable at `e` values, `w` at `P` packed panels of depth `e`, `out`
/// readable and writable at `P * NR` values.
#[target_feature(enable = "avx512f")]
#[allow(clippy::needless_range_loop)]
pub(super) unsafe fn row_direct<const P: usize>(
    x: *const f32,
    w: *const u16,
    e: usize,
    k0: usize,
    k1: usize,
    out: *mut f32,
) {
    // SAFETY: every access stays inside the ranges the caller guarantees;
    // loads and stores are unaligned.
    unsafe {
        let words = w.cast::<u32>();
        let pw = e.div_ceil(2) * NR;
        let mask = _mm512_set1_epi32(0xFFFF_0000u32 as i32);
        let mut c = [_mm512_setzero_ps(); P];
        for p in 0..P {
            c[p] = _mm512_loadu_ps(out.add(p * NR));
        }
        for i in k0 / 2..k1 / 2 {
            let a0 = _mm512_set1_ps(*x.add(2 * i));
            let a1 = _mm512_set1_ps(*x.add(2 * i + 1));
            for p in 0..P {
                let v = _mm512_loadu_si512(words.add(p * pw + i * NR).cast());
                let even = _mm512_castsi512_ps(_mm512_and_si512(v, mask));
                let odd = _mm512_castsi512_ps(_mm512_slli_epi32::<16>(v));
                c[p] = _mm512_fmadd_ps(a0, even, c[p]);
                c[p] = _mm512_fmadd_ps(a1, odd, c[p]);
            }
        }
        if k1 % 2 == 1 {
            // The last pair of an odd depth has no later step (`k1` is
            // odd only when it is `e`).
            let i = k1 / 2;
            let a0 = _mm512_set1_ps(*x.add(2 * i));
            for p in 0..P {
                let v = _mm512_loadu_si512(words.add(p * pw + i * NR).cast());
                let even = _mm512_castsi512_ps(_mm512_and_si512(v, mask));
                c[p] = _mm512_fmadd_ps(a0, even, c[p]);
            }
        }
        for p in 0..P {
            _mm512_storeu_ps(out.add(p * NR), c[p]);
        }
    }
}

/// `micro_bf16` for two panels at once (`b0`, `b1` into `acc0`,
/// `acc1`): each broadcast of an activation pair feeds both.
///
/// # Safety
/// As `micro_bf16`, for both panels.
#[target_feature(enable = "avx512f,avx512bf16")]
#[allow(clippy::too_many_arguments)]
unsafe fn micro_bf16_2<const M: usize>(
    x: *const u32,
    xs: usize,
    b0: *const u32,
    b1: *const u32,
    np: usize,
    acc0: *mut f32,
    acc1: *mut f32,
    ahead: Ahead,
) {
    // SAFETY: as in `micro_bf16`.
    unsafe {
        let mut c0 = [_mm512_setzero_ps(); M];
        let mut c1 = [_mm512_setzero_ps(); M];
        for i in 0..M {
            c0[i] = _mm512_loadu_ps(acc0.add(i * NR));
            c1[i] = _mm512_loadu_ps(acc1.add(i * NR));
        }
        for p in 0..np {
            ahead.line(p);
            let w0: __m512bh = std::mem::transmute(_mm512_loadu_si512(b0.add(p * NR).cast()));
            let w1: __m512bh = std::mem::transmute(_mm512_loadu_si512(b1.add(p * NR).cast()));
            for i in 0..M {
                let a: __m512bh = std::mem::transmute(_mm512_set1_epi32(*x.add(i * xs + p) as i32));
                c0[i] = _mm512_dpbf16_ps(c0[i], a, w0);
                c1[i] = _mm512_dpbf16_ps(c1[i], a, w1);
            }
        }
        for i in 0..M {
            _mm512_storeu_ps(acc0.add(i * NR), c0[i]);
            _mm512_storeu_ps(acc1.add(i * NR), c1[i]);
        }
    }
}

/// `acc [M, NR] += x [M, 2 * np] @ b [2 * np, NR]` over BF16 pairs: `x`
/// holds `np` pair words a row (row stride `xs` words), `b` holds `np`
/// groups of `NR` pair words (see `pack_pairs`). One `vdpbf16ps` per row
/// and pair: the exact product of the earlier step, rounded, then that
/// of the later one, as the FMA chain.
///
/// # Safety
/// The CPU must support AVX-512F and AVX-512 BF16; `x` readable at
/// `i * xs + p` for `i < M`, `p < np`; `b` at `np * NR` words; `acc`
/// readable and writable at `M * NR` values.
#[target_feature(enable = "avx512f,avx512bf16")]
unsafe fn micro_bf16<const M: usize>(
    x: *const u32,
    xs: usize,
    b: *const u32,
    np: usize,
    acc: *mut f32,
    ahead: Ahead,
) {
    // SAFETY: all reads and writes stay inside the ranges the caller
    // guarantees; unaligned loads and stores are used throughout. The
    // transmutes reinterpret 512 bits as BF16 pairs, which every bit
    // pattern is.
    unsafe {
        let mut c = [_mm512_setzero_ps(); M];
        for (i, ci) in c.iter_mut().enumerate() {
            *ci = _mm512_loadu_ps(acc.add(i * NR));
        }
        for p in 0..np {
            ahead.line(p);
            let bv: __m512bh = std::mem::transmute(_mm512_loadu_si512(b.add(p * NR).cast()));
            for (i, ci) in c.iter_mut().enumerate() {
                let a: __m512bh = std::mem::transmute(_mm512_set1_epi32(*x.add(i * xs + p) as i32));
                *ci = _mm512_dpbf16_ps(*ci, a, bv);
            }
        }
        for (i, ci) in c.iter().enumerate() {
            _mm512_storeu_ps(acc.add(i * NR), *ci);
        }
    }
}
