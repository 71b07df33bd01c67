//! The AMX path (x86-64 with AMX-TILE and AMX-BF16, Linux having granted
//! the tile data state): `tdpbf16ps` over 16 x 16 tiles of f32 sums.
//!
//! Operands are the packed weights as they lie: 16 pair words of a panel
//! (one step pair of its 16 output rows) are one 64-byte row of a weight
//! tile, so a block of 32 steps of a panel is a 1 KiB tile with rows 64
//! bytes apart. The activations are packed per call into the same pair
//! words (even step in the high half, as the weights), one token a tile
//! row, with zeros outside the call's steps and past the last token, so
//! every activation tile is whole.
//!
//! Bit class: `tdpbf16ps` adds its 32 products into a sum in an order and
//! with roundings of the hardware's own (not the sequential FMA chain of
//! the other paths), so this path has its own results. Within it the
//! invariant of the parent module holds in this form: every `y[t, o]` is
//! the sum over 32-step blocks aligned to step 0 (block `j` is steps
//! `32j .. 32j + 32`, cut to the call's steps), block after block, one
//! `tdpbf16ps` a block; nothing depends on `T`, the token tiling, the
//! thread count or the row's place in a tile. A projection cut into ranges
//! at multiples of 32 steps is therefore bit-identical to one call; cut
//! elsewhere, a block is summed in two parts, within the error bound of
//! docs/SPEC.md but not bit for bit.
//!
//! Tiles: sums in `tmm0..tmm3` (two token blocks of 16 rows by two
//! panels), activations in `tmm4`, `tmm5`, weights in `tmm6`, `tmm7`; all
//! 16 rows of 64 bytes. A task configures the tiles once, runs its
//! blocks, and releases them (so the thread's tile state is back to its
//! initial, cheap-to-switch form). Each `asm!` block loads the sums it
//! adds to and stores them before it ends, so no value lives in a tile
//! register between two blocks; only the configuration does, and nothing
//! else runs on the thread in between (the crate enables no AMX target
//! feature, so the compiler emits no tile instruction of its own).

use std::arch::asm;

use rayon::prelude::*;

use super::{NR, Tile, panel_len};

/// Steps one `tdpbf16ps` adds: 16 BF16 pairs a tile row.
const KB: usize = 32;
/// Rows of every tile (token rows of a sum or activation tile, step pairs
/// of a weight tile).
pub(super) const TR: usize = 16;
/// Token rows sharing one pass over the weights on this path when the call
/// is not cut into ranges: their activations (1.25 MiB at E = 2560) stay
/// in a 2 MiB L2 while every panel streams past them. (Measured: 512 rows
/// a tile were no faster, 128 slower.)
pub(super) const TILE_ROWS: usize = 256;
/// Bytes between the rows of a weight tile and of a sum tile.
pub(super) const ROW_BYTES: usize = 64;

/// A tile configuration (palette 1): eight tiles of 16 rows of 64 bytes.
#[repr(C, align(64))]
pub(super) struct Config([u8; 64]);

impl Config {
    pub(super) fn new() -> Config {
        let mut c = [0u8; 64];
        c[0] = 1;
        for t in 0..8 {
            c[16 + 2 * t..18 + 2 * t].copy_from_slice(&(ROW_BYTES as u16).to_le_bytes());
            c[48 + t] = TR as u8;
        }
        Config(c)
    }

    /// Load this configuration on the calling thread.
    ///
    /// # Safety
    /// The process must be allowed AMX (`CpuPath::Amx.available()`); the
    /// caller must call [`release`] before the thread runs anything else
    /// that may use tiles.
    pub(super) unsafe fn load(&self) {
        // SAFETY: forwarded from the caller; the 64 bytes are readable.
        unsafe { asm!("ldtilecfg [{}]", in(reg) self.0.as_ptr(), options(nostack, readonly)) };
    }
}

/// Return the tiles to their initial state.
///
/// # Safety
/// As [`Config::load`].
pub(super) unsafe fn release() {
    // SAFETY: forwarded from the caller.
    unsafe { asm!("tilerelease", options(nostack, nomem)) };
}

/// Blocks of a chunk: the sums of a token block pair stay in tiles over a
/// chunk. Chunks of 4, 8 and 16 blocks (a panel pair's weights in L1
/// while every token pair streams past) measured no faster than whole
/// runs on a Sapphire Rapids-class VM, so a chunk is the whole run.
const KC: usize = usize::MAX;

/// Start the sums of one or two (`TWO`) token blocks and two panels: zero,
/// or loaded from `c0`, `c1` (`[16, NR]` f32 tiles, token block 1 1 KiB
/// after token block 0).
///
/// # Safety
/// The tiles are configured by [`Config::load`] on this thread; unless
/// `zero`, `c0` and `c1` are readable for `TWO`-many KiB tiles.
unsafe fn sums_start<const TWO: bool>(c0: *const f32, c1: *const f32, zero: bool) {
    // SAFETY: forwarded from the caller.
    unsafe {
        match (TWO, zero) {
            (_, true) => asm!(
                "tilezero tmm0",
                "tilezero tmm1",
                "tilezero tmm2",
                "tilezero tmm3",
                options(nostack, nomem)
            ),
            (true, false) => asm!(
                "tileloadd tmm0, [{c0} + {s}*1]",
                "tileloadd tmm1, [{c1} + {s}*1]",
                "tileloadd tmm2, [{c0} + {s}*1 + 1024]",
                "tileloadd tmm3, [{c1} + {s}*1 + 1024]",
                c0 = in(reg) c0,
                c1 = in(reg) c1,
                s = in(reg) ROW_BYTES,
                options(nostack, readonly),
            ),
            (false, false) => asm!(
                "tileloadd tmm0, [{c0} + {s}*1]",
                "tileloadd tmm1, [{c1} + {s}*1]",
                c0 = in(reg) c0,
                c1 = in(reg) c1,
                s = in(reg) ROW_BYTES,
                options(nostack, readonly),
            ),
        }
    }
}

/// Store the sums [`sums_start`] started, to the same places.
///
/// # Safety
/// As [`sums_start`], the tiles writable.
unsafe fn sums_store<const TWO: bool>(c0: *mut f32, c1: *mut f32) {
    // SAFETY: forwarded from the caller.
    unsafe {
        if TWO {
            asm!(
                "tilestored [{c0} + {s}*1], tmm0",
                "tilestored [{c1} + {s}*1], tmm1",
                "tilestored [{c0} + {s}*1 + 1024], tmm2",
                "tilestored [{c1} + {s}*1 + 1024], tmm3",
                c0 = in(reg) c0,
                c1 = in(reg) c1,
                s = in(reg) ROW_BYTES,
                options(nostack),
            )
        } else {
            asm!(
                "tilestored [{c0} + {s}*1], tmm0",
                "tilestored [{c1} + {s}*1], tmm1",
                c0 = in(reg) c0,
                c1 = in(reg) c1,
                s = in(reg) ROW_BYTES,
                options(nostack),
            )
        }
    }
}

/// The operands of one run of blocks (see [`blocks`]).
struct Run {
    /// Activation tile of token block 0, first block of the run (1 KiB,
    /// rows 64 bytes apart); the next block is 1 KiB after it, token
    /// block 1 `ta` bytes after it.
    a: *const u32,
    /// Bytes between the tiles of two token blocks.
    ta: usize,
    /// Weight tiles of panels 0 and 1, first block; the next block is 1
    /// KiB after.
    b0: *const u32,
    b1: *const u32,
    /// Blocks to run.
    blocks: usize,
    /// Where to hint the next weights into L2 (`pf_lines` lines of 64
    /// bytes a block, from here on): a hint only, never dereferenced, so
    /// it may point past the weights.
    pf: *const u8,
    pf_lines: usize,
}

/// `r.blocks` blocks of `tdpbf16ps` into the sums [`sums_start`] started
/// (token block 1 and its products only when `TWO`). Returns where the
/// next hint goes.
///
/// # Safety
/// The sums are started on this thread; `a` is valid for `TWO`-many token
/// blocks of `blocks` tiles, `b0` and `b1` for `blocks` tiles.
unsafe fn blocks<const TWO: bool>(r: &Run) -> *const u8 {
    let mut pf = r.pf;
    if r.blocks == 0 {
        return pf;
    }
    // SAFETY: forwarded from the caller; the loop reads `blocks` tiles of
    // each operand, advancing 64 bytes (16 pairs) along the activation
    // rows and 1 KiB along the weights; a prefetch never faults.
    unsafe {
        if TWO {
            asm!(
                "2:",
                "tileloadd tmm4, [{a0} + {s}*1]",
                "tileloadd tmm6, [{b0} + {s}*1]",
                "tileloadd tmm7, [{b1} + {s}*1]",
                "tdpbf16ps tmm0, tmm4, tmm6",
                "tileloadd tmm5, [{a1} + {s}*1]",
                "tdpbf16ps tmm1, tmm4, tmm7",
                "tdpbf16ps tmm2, tmm5, tmm6",
                "tdpbf16ps tmm3, tmm5, tmm7",
                "mov {i}, {pl}",
                "test {i}, {i}",
                "jz 4f",
                "3:",
                "prefetcht1 [{pf}]",
                "add {pf}, 64",
                "dec {i}",
                "jnz 3b",
                "4:",
                "add {a0}, 1024",
                "add {a1}, 1024",
                "add {b0}, 1024",
                "add {b1}, 1024",
                "dec {n}",
                "jnz 2b",
                s = in(reg) ROW_BYTES,
                a0 = inout(reg) r.a => _,
                a1 = inout(reg) r.a.cast::<u8>().add(r.ta) => _,
                b0 = inout(reg) r.b0 => _,
                b1 = inout(reg) r.b1 => _,
                n = inout(reg) r.blocks => _,
                pf = inout(reg) pf,
                pl = in(reg) r.pf_lines,
                i = out(reg) _,
                options(nostack),
            );
        } else {
            asm!(
                "2:",
                "tileloadd tmm4, [{a0} + {s}*1]",
                "tileloadd tmm6, [{b0} + {s}*1]",
                "tileloadd tmm7, [{b1} + {s}*1]",
                "tdpbf16ps tmm0, tmm4, tmm6",
                "tdpbf16ps tmm1, tmm4, tmm7",
                "mov {i}, {pl}",
                "test {i}, {i}",
                "jz 4f",
                "3:",
                "prefetcht1 [{pf}]",
                "add {pf}, 64",
                "dec {i}",
                "jnz 3b",
                "4:",
                "add {a0}, 1024",
                "add {b0}, 1024",
                "add {b1}, 1024",
                "dec {n}",
                "jnz 2b",
                s = in(reg) ROW_BYTES,
                a0 = inout(reg) r.a => _,
                b0 = inout(reg) r.b0 => _,
                b1 = inout(reg) r.b1 => _,
                n = inout(reg) r.blocks => _,
                pf = inout(reg) pf,
                pl = in(reg) r.pf_lines,
                i = out(reg) _,
                options(nostack),
            );
        }
    }
    pf
}

/// The activation pairs of one token tile, reused from tile to tile.
#[derive(Default)]
pub(super) struct Scratch {
    pairs: Vec<u32>,
}

/// The activation pairs of `rows` rows of `xt` (each `e` steps), steps
/// `k0..k1`, into `pairs` in tile-major order: the tile of token block
/// `tb`, block `j0 + jb` (blocks aligned to step 0, `j0 = k0 / 32`) is
/// the 256 words at `(tb * nb + jb) * 256`, token row `r` of it the 16
/// words from `r * 16`: each tile one contiguous KiB, where rows 64 bytes
/// apart in rows of `E` steps would touch a page a row. Steps outside
/// `k0..k1` and rows past `rows` are zero. Every word of the tiles is
/// written, so the buffer is only grown, never cleared.
pub(super) fn pack_activations(
    xt: &[f32],
    rows: usize,
    e: usize,
    (k0, k1): (usize, usize),
    pairs: &mut Vec<u32>,
) {
    let rp = rows.div_ceil(TR) * TR;
    let (j0, j1) = (k0 / KB, k1.div_ceil(KB));
    let nb = j1 - j0;
    let need = rp * nb * KB / 2;
    if pairs.len() < need {
        pairs.resize(need, 0);
    }
    let wide = std::arch::is_x86_feature_detected!("avx512bw");
    pairs[..need]
        .par_chunks_mut(nb * TR * KB / 2)
        .enumerate()
        .for_each(|(tb, dst)| {
            for tr in 0..TR {
                let r = tb * TR + tr;
                let row = (r < rows).then(|| &xt[r * e..(r + 1) * e]);
                for jb in 0..nb {
                    let at = jb * TR * KB / 2 + tr * KB / 2;
                    let out = &mut dst[at..at + KB / 2];
                    let k = (j0 + jb) * KB;
                    match row {
                        None => out.fill(0),
                        Some(row) if wide && k >= k0 && k + KB <= k1 => {
                            // SAFETY: AVX-512BW is present; steps `k ..
                            // k + 32` lie in `row`, `out` holds 16 words.
                            unsafe { pair_block(row[k..k + KB].as_ptr(), out.as_mut_ptr()) }
                        }
                        Some(row) => {
                            for (i, v) in out.iter_mut().enumerate() {
                                let (ke, ko) = (k + 2 * i, k + 2 * i + 1);
                                let at = |k: usize| {
                                    if k >= k0 && k < k1 {
                                        row[k].to_bits()
                                    } else {
                                        0
                                    }
                                };
                                *v = (at(ke) & 0xFFFF_0000) | (at(ko) >> 16);
                            }
                        }
                    }
                }
            }
        });
}

/// 32 BF16-exact f32 steps at `x` as 16 pair words at `out`: even step in
/// the high half, odd in the low half, one word permutation of the steps'
/// high halves.
///
/// # Safety
/// AVX-512BW; `x` readable for 32 f32, `out` writable for 16 u32.
#[target_feature(enable = "avx512f,avx512bw")]
unsafe fn pair_block(x: *const f32, out: *mut u32) {
    use std::arch::x86_64::*;
    // Halfword `2i` of the result (low) is the high half of step `2i + 1`
    // (halfword `4i + 3` of the two loads side by side), halfword `2i + 1`
    // (high) that of step `2i` (halfword `4i + 1`).
    const IDX: [u16; 32] = {
        let mut v = [0u16; 32];
        let mut i = 0;
        while i < 16 {
            v[2 * i] = (4 * i + 3) as u16;
            v[2 * i + 1] = (4 * i + 1) as u16;
            i += 1;
        }
        v
    };
    // SAFETY: forwarded from the caller; the loads and the store are
    // unaligned.
    unsafe {
        let lo = _mm512_loadu_si512(x.cast());
        let hi = _mm512_loadu_si512(x.add(16).cast());
        let idx = _mm512_loadu_si512(IDX.as_ptr().cast());
        _mm512_storeu_si512(out.cast(), _mm512_permutex2var_epi16(lo, idx, hi));
    }
}

/// One token tile (`xt`, `tile.rows` rows of `e`) against all `np` panels
/// of `w`, steps `k0..k1`: rayon over pairs of panels. Continues the sums
/// `tile` holds when `accumulate`.
///
/// Within a task (a panel pair) the blocks run chunk by chunk, `KC` blocks
/// a chunk: for each chunk every token block pair runs its blocks of it,
/// starting its sums from zero (first chunk of a call from zero) or from
/// where the chunk before left them, so each sum still adds its blocks one
/// after the other, in order. Meanwhile the task hints the next panel
/// pair's weights into L2, a few lines a block, so they stream from memory
/// while this pair computes.
///
/// The caller has checked that the process may run AMX and that the
/// activations are exact BF16 values.
#[allow(clippy::too_many_arguments)]
pub(super) fn token_tile(
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
    let rp = rows.div_ceil(TR) * TR;
    let (j0, j1) = (k0 / KB, k1.div_ceil(KB));
    let nb = j1 - j0;
    pack_activations(xt, rows, e, (k0, k1), &mut scratch.pairs);
    let pairs = &scratch.pairs[..];
    let pl = panel_len(e);
    let pw = pl / 2;
    let groups = np.div_ceil(2);
    let min_len = (groups / (rayon::current_num_threads() * 8)).max(1);
    let kc = KC;
    // Token block pairs (a lone last block counts as one) and the blocks
    // each runs: the next pair's 2 * nb tiles spread over them.
    let tpairs = (rp / TR).div_ceil(2);
    let pf_lines = (2 * nb * 16).div_ceil(tpairs * nb);
    (0..groups)
        .into_par_iter()
        .with_min_len(min_len)
        .for_each_init(Vec::new, |acc: &mut Vec<f32>, g| {
            let p0 = 2 * g;
            let n = 2.min(np - p0);
            if acc.len() < 2 * rp * NR {
                acc.resize(2 * rp * NR, 0.0);
            }
            if accumulate {
                for q in 0..n {
                    // SAFETY: panel `p0 + q` belongs to this task alone
                    // (see `Tile`).
                    unsafe { tile.load(&mut acc[q * rp * NR..], p0 + q) };
                }
            }
            // A lone last panel runs beside itself into a spare sum tile.
            let mut spare = [0.0f32; 2 * TR * NR];
            let words = w.as_ptr().cast::<u32>();
            let panel_words = |q: usize| {
                // SAFETY: panel `p0 + q` (or `p0` when `n` is 1) lies in
                // `w`, which holds `np` panels.
                unsafe { words.add((p0 + q.min(n - 1)) * pw) }
            };
            // The next pair's weights, from block `j0`: only hinted.
            let mut pf = words
                .wrapping_add((p0 + 2) * pw + j0 * KB / 2 * NR)
                .cast::<u8>();
            // Weight tiles of a block cut to the call's steps: the steps
            // outside are zero, as are the activations there.
            let mut cut = [[0u32; TR * NR]; 2];
            let cfg = Config::new();
            // SAFETY: `project_checked` picks this kernel only where
            // `CpuPath::Amx` is available; released below before the task
            // ends.
            unsafe { cfg.load() };
            // The steps as chunks of blocks: whole blocks straight from
            // the panels, `kc` at most a chunk, a cut first or last block
            // from `cut`.
            let first_cut = k0 % KB != 0;
            let last_cut = k1 % KB != 0 && !(first_cut && j1 - j0 == 1);
            let whole = (j0 + usize::from(first_cut))..(j1 - usize::from(last_cut));
            let mut chunks: Vec<(usize, usize, bool)> = Vec::with_capacity(nb / kc + 3);
            if first_cut {
                chunks.push((j0, j0 + 1, true));
            }
            for ja in whole.clone().step_by(kc) {
                chunks.push((ja, ja.saturating_add(kc).min(whole.end), false));
            }
            if last_cut {
                chunks.push((j1 - 1, j1, true));
            }
            for (ci, &(ja, jb, is_cut)) in chunks.iter().enumerate() {
                let (b0, b1) = if is_cut {
                    // Pairs `lo..hi` of block `ja`, the call's steps.
                    let lo = (k0 / 2).max(ja * KB / 2);
                    let hi = k1.div_ceil(2).min((ja + 1) * KB / 2);
                    for (q, c) in cut.iter_mut().enumerate() {
                        c.fill(0);
                        let src = panel_words(q);
                        for i in lo..hi {
                            let at = (i - ja * KB / 2) * NR;
                            // SAFETY: pair `i < ceil(e / 2)` of the
                            // panel: words `i * NR .. (i + 1) * NR`.
                            let s = unsafe { std::slice::from_raw_parts(src.add(i * NR), NR) };
                            c[at..at + NR].copy_from_slice(s);
                        }
                    }
                    (cut[0].as_ptr(), cut[1].as_ptr())
                } else {
                    // SAFETY: blocks `ja..jb` are whole, inside the
                    // panel (`jb * 16 <= ceil(e / 2)` pairs).
                    unsafe {
                        (
                            panel_words(0).add(ja * KB / 2 * NR),
                            panel_words(1).add(ja * KB / 2 * NR),
                        )
                    }
                };
                let zero = ci == 0 && !accumulate;
                let mut tb = 0;
                while tb < rp / TR {
                    let two = tb + 1 < rp / TR;
                    let base = acc.as_mut_ptr();
                    // SAFETY: token block `tb` (and `tb + 1` when `two`)
                    // of each panel's sums lies in `acc` (`[2, rp, NR]`)
                    // or `spare` (two token blocks).
                    let (c0, c1) = unsafe {
                        (
                            base.add(tb * TR * NR),
                            if n == 2 {
                                base.add(rp * NR + tb * TR * NR)
                            } else {
                                spare.as_mut_ptr()
                            },
                        )
                    };
                    let r = Run {
                        // SAFETY: tile `(tb, ja - j0)` lies in `pairs`
                        // (`rp / 16` token blocks of `nb`).
                        a: unsafe { pairs.as_ptr().add((tb * nb + ja - j0) * TR * KB / 2) },
                        ta: nb * TR * KB / 2 * 4,
                        b0,
                        b1,
                        blocks: jb - ja,
                        pf,
                        pf_lines,
                    };
                    // SAFETY: configured above; the sums name tiles in
                    // `acc`/`spare`, `r` tiles of `pairs` (`ja - j0 .. jb
                    // - j0` of token blocks `tb` and, when `two`, `tb +
                    // 1`) and of the panels or `cut`.
                    unsafe {
                        if two {
                            sums_start::<true>(c0, c1, zero);
                            pf = blocks::<true>(&r);
                            sums_store::<true>(c0, c1);
                        } else {
                            sums_start::<false>(c0, c1, zero);
                            pf = blocks::<false>(&r);
                            sums_store::<false>(c0, c1);
                        }
                    };
                    tb += if two { 2 } else { 1 };
                }
            }
            // SAFETY: loaded above on this thread.
            unsafe { release() };
            for q in 0..n {
                // SAFETY: as above.
                unsafe { tile.store(&acc[q * rp * NR..], p0 + q) };
            }
        });
}

/// `iters` rounds of 12 `tdpbf16ps` on four independent sum tiles from
/// operands loaded once: the peak of the instruction on the calling
/// thread. Returns a value of the sums, so no round is folded away.
///
/// # Safety
/// `CpuPath::Amx`'s tile permission must be granted (see
/// `cpu::amx_ready`) and the CPU must have AMX-BF16.
pub(super) unsafe fn peak(iters: usize) -> f32 {
    let ops = [0x3F80_3F80u32; TR * NR];
    let mut out = [0.0f32; TR * NR];
    let cfg = Config::new();
    // SAFETY: forwarded from the caller; every tile named is 1 KiB and the
    // buffers hold 1 KiB each; released before returning.
    unsafe {
        cfg.load();
        asm!(
            "tilezero tmm0",
            "tilezero tmm1",
            "tilezero tmm2",
            "tilezero tmm3",
            "tileloadd tmm4, [{a} + {s}*1]",
            "tileloadd tmm5, [{a} + {s}*1]",
            "tileloadd tmm6, [{a} + {s}*1]",
            "tileloadd tmm7, [{a} + {s}*1]",
            "2:",
            "tdpbf16ps tmm0, tmm4, tmm6",
            "tdpbf16ps tmm1, tmm4, tmm7",
            "tdpbf16ps tmm2, tmm5, tmm6",
            "tdpbf16ps tmm3, tmm5, tmm7",
            "tdpbf16ps tmm0, tmm4, tmm6",
            "tdpbf16ps tmm1, tmm4, tmm7",
            "tdpbf16ps tmm2, tmm5, tmm6",
            "tdpbf16ps tmm3, tmm5, tmm7",
            "tdpbf16ps tmm0, tmm4, tmm6",
            "tdpbf16ps tmm1, tmm4, tmm7",
            "tdpbf16ps tmm2, tmm5, tmm6",
            "tdpbf16ps tmm3, tmm5, tmm7",
            "dec {n}",
            "jnz 2b",
            "tilestored [{o} + {s}*1], tmm3",
            a = in(reg) ops.as_ptr(),
            o = in(reg) out.as_mut_ptr(),
            s = in(reg) ROW_BYTES,
            n = inout(reg) iters.max(1) => _,
            options(nostack),
        );
        release();
    }
    out[0]
}
