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
const TR: usize = 16;
/// Token rows sharing one pass over the weights on this path when the call
/// is not cut into ranges: their activations (1.25 MiB at E = 2560) stay
/// in a 2 MiB L2 while every panel streams past them. (Measured: 512 rows
/// a tile were no faster, 128 slower.)
pub(super) const TILE_ROWS: usize = 256;
/// Bytes between the rows of a weight tile and of a sum tile.
const ROW_BYTES: usize = 64;

/// A tile configuration (palette 1): eight tiles of 16 rows of 64 bytes.
#[repr(C, align(64))]
struct Config([u8; 64]);

impl Config {
    fn new() -> Config {
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
    unsafe fn load(&self) {
        // SAFETY: forwarded from the caller; the 64 bytes are readable.
        unsafe { asm!("ldtilecfg [{}]", in(reg) self.0.as_ptr(), options(nostack, readonly)) };
    }
}

/// Return the tiles to their initial state.
///
/// # Safety
/// As [`Config::load`].
unsafe fn release() {
    // SAFETY: forwarded from the caller.
    unsafe { asm!("tilerelease", options(nostack, nomem)) };
}

/// The operands of one run of blocks (see [`run`]).
struct Run {
    /// Sums of token block 0, panel 0 (`[16, NR]` f32, rows 64 bytes
    /// apart); token block 1 is 1 KiB after it.
    c0: *mut f32,
    /// The same for panel 1.
    c1: *mut f32,
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
}

/// `blocks` blocks of `tdpbf16ps` for one or two (`TWO`) token blocks and
/// two panels: the sums are loaded, each block adds its 32 steps, the sums
/// are stored.
///
/// # Safety
/// The tiles are configured by [`Config::load`] on this thread; every
/// pointer of `r` is valid for the tiles it names (`c0`, `c1`: `TWO`
/// KiB-sized sum tiles, read and written; `a`: `TWO` token blocks of
/// `blocks * 16` pair words a row; `b0`, `b1`: `blocks` KiB).
unsafe fn run<const TWO: bool>(r: &Run) {
    if r.blocks == 0 {
        return;
    }
    // SAFETY: forwarded from the caller; the loop reads `blocks` tiles of
    // each operand, advancing 64 bytes (16 pairs) along the activation
    // rows and 1 KiB along the weights.
    unsafe {
        if TWO {
            asm!(
                "tileloadd tmm0, [{c0} + {s}*1]",
                "tileloadd tmm1, [{c1} + {s}*1]",
                "tileloadd tmm2, [{c0} + {s}*1 + 1024]",
                "tileloadd tmm3, [{c1} + {s}*1 + 1024]",
                "2:",
                ".irp off,0,64,128,192,256,320,384,448,512,576,640,704,768,832,896,960",
                "prefetcht0 [{a0} + 2048 + \\off]",
                "prefetcht0 [{a1} + 2048 + \\off]",
                "prefetcht0 [{b0} + 2048 + \\off]",
                "prefetcht0 [{b1} + 2048 + \\off]",
                ".endr",
                "tileloadd tmm4, [{a0} + {s}*1]",
                "tileloadd tmm6, [{b0} + {s}*1]",
                "tileloadd tmm7, [{b1} + {s}*1]",
                "tdpbf16ps tmm0, tmm4, tmm6",
                "tileloadd tmm5, [{a1} + {s}*1]",
                "tdpbf16ps tmm1, tmm4, tmm7",
                "tdpbf16ps tmm2, tmm5, tmm6",
                "tdpbf16ps tmm3, tmm5, tmm7",
                "add {a0}, 1024",
                "add {a1}, 1024",
                "add {b0}, 1024",
                "add {b1}, 1024",
                "dec {n}",
                "jnz 2b",
                "tilestored [{c0} + {s}*1], tmm0",
                "tilestored [{c1} + {s}*1], tmm1",
                "tilestored [{c0} + {s}*1 + 1024], tmm2",
                "tilestored [{c1} + {s}*1 + 1024], tmm3",
                c0 = in(reg) r.c0,
                c1 = in(reg) r.c1,
                s = in(reg) ROW_BYTES,
                a0 = inout(reg) r.a => _,
                a1 = inout(reg) r.a.cast::<u8>().add(r.ta) => _,
                b0 = inout(reg) r.b0 => _,
                b1 = inout(reg) r.b1 => _,
                n = inout(reg) r.blocks => _,
                options(nostack),
            );
        } else {
            asm!(
                "tileloadd tmm0, [{c0} + {s}*1]",
                "tileloadd tmm1, [{c1} + {s}*1]",
                "2:",
                ".irp off,0,64,128,192,256,320,384,448,512,576,640,704,768,832,896,960",
                "prefetcht0 [{a0} + 2048 + \\off]",
                "prefetcht0 [{b0} + 2048 + \\off]",
                "prefetcht0 [{b1} + 2048 + \\off]",
                ".endr",
                "tileloadd tmm4, [{a0} + {s}*1]",
                "tileloadd tmm6, [{b0} + {s}*1]",
                "tileloadd tmm7, [{b1} + {s}*1]",
                "tdpbf16ps tmm0, tmm4, tmm6",
                "tdpbf16ps tmm1, tmm4, tmm7",
                "add {a0}, 1024",
                "add {b0}, 1024",
                "add {b1}, 1024",
                "dec {n}",
                "jnz 2b",
                "tilestored [{c0} + {s}*1], tmm0",
                "tilestored [{c1} + {s}*1], tmm1",
                c0 = in(reg) r.c0,
                c1 = in(reg) r.c1,
                s = in(reg) ROW_BYTES,
                a0 = inout(reg) r.a => _,
                b0 = inout(reg) r.b0 => _,
                b1 = inout(reg) r.b1 => _,
                n = inout(reg) r.blocks => _,
                options(nostack),
            );
        }
    }
}

/// The activation pairs of one token tile, reused from tile to tile.
#[derive(Default)]
pub(super) struct Scratch {
    pairs: Vec<u32>,
}

/// One token tile (`xt`, `tile.rows` rows of `e`) against all `np` panels
/// of `w`, steps `k0..k1`: rayon over pairs of panels. Continues the sums
/// `tile` holds when `accumulate`.
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
    // Blocks aligned to step 0.
    let (j0, j1) = (k0 / KB, k1.div_ceil(KB));
    let nb = j1 - j0;
    // Tile-major: the tile of token block `tb`, block `j0 + jb` is the 256
    // words at `(tb * nb + jb) * 256`, token row `r` of it 16 words from
    // `r * 16`: each tile one contiguous KiB, where rows 64 bytes apart in
    // rows of `E` steps would touch a page a row.
    let pairs = &mut scratch.pairs;
    pairs.clear();
    pairs.resize(rp * nb * KB / 2, 0);
    let (lo, hi) = (k0 / 2, k1.div_ceil(2));
    let base = j0 * KB / 2;
    pairs
        .par_chunks_mut(nb * TR * KB / 2)
        .zip(xt.par_chunks(TR * e))
        .for_each(|(dst, rows)| {
            let mut line = vec![0u32; nb * KB / 2];
            for (tr, row) in rows.chunks_exact(e).enumerate() {
                for (i, v) in line[lo - base..hi - base].iter_mut().enumerate() {
                    let k = 2 * (lo + i);
                    let even = row[k].to_bits() & 0xFFFF_0000;
                    let odd = row.get(k + 1).map_or(0, |v| v.to_bits() >> 16);
                    *v = even | odd;
                }
                for (jb, part) in line.chunks_exact(KB / 2).enumerate() {
                    let at = jb * TR * KB / 2 + tr * KB / 2;
                    dst[at..at + KB / 2].copy_from_slice(part);
                }
            }
        });
    let pairs = &pairs[..];
    let pl = panel_len(e);
    let pw = pl / 2;
    let groups = np.div_ceil(2);
    let min_len = (groups / (rayon::current_num_threads() * 8)).max(1);
    (0..groups)
        .into_par_iter()
        .with_min_len(min_len)
        .for_each(|g| {
            let p0 = 2 * g;
            let n = 2.min(np - p0);
            let mut acc = vec![0.0f32; 2 * rp * NR];
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
            // Weight tiles of a block cut to the call's steps: the steps
            // outside are zero, as are the activations there.
            let mut cut = [[0u32; TR * NR]; 2];
            let cfg = Config::new();
            // SAFETY: `project_checked` picks this kernel only where
            // `CpuPath::Amx` is available; released below before the task
            // ends.
            unsafe { cfg.load() };
            // The steps as runs of blocks: whole blocks straight from the
            // panels, a cut first or last block from `cut`. A whole run
            // keeps its sums in the tiles from its first block to its last
            // (reloading them every few blocks, to keep a chunk of weights
            // in L1 for all token blocks, measured slower).
            let first_cut = k0 % KB != 0;
            let last_cut = k1 % KB != 0 && !(first_cut && j1 - j0 == 1);
            let mut segs: [(usize, usize, bool); 3] = [(0, 0, false); 3];
            let mut ns = 0;
            let mut j = j0;
            if first_cut {
                segs[ns] = (j, j + 1, true);
                ns += 1;
                j += 1;
            }
            let whole_end = if last_cut { j1 - 1 } else { j1 };
            if whole_end > j {
                segs[ns] = (j, whole_end, false);
                ns += 1;
                j = whole_end;
            }
            if last_cut && j < j1 {
                segs[ns] = (j, j1, true);
                ns += 1;
            }
            {
                for &(ja, jb, is_cut) in &segs[..ns] {
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
                    let mut tb = 0;
                    while tb < rp / TR {
                        let two = tb + 1 < rp / TR;
                        let base = acc.as_mut_ptr();
                        // SAFETY: token block `tb` (and `tb + 1` when
                        // `two`) of each panel's sums lies in `acc`
                        // (`[2, rp, NR]`) or `spare` (two token blocks).
                        let (c0p, c1p) = unsafe {
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
                            c0: c0p,
                            c1: c1p,
                            // SAFETY: tile `(tb, ja - j0)` lies in
                            // `pairs` (`rp / 16` token blocks of `nb`).
                            a: unsafe { pairs.as_ptr().add((tb * nb + ja - j0) * TR * KB / 2) },
                            ta: nb * TR * KB / 2 * 4,
                            b0,
                            b1,
                            blocks: jb - ja,
                        };
                        // SAFETY: configured above; `r` names tiles inside
                        // `acc`/`spare`, `pairs` (tiles `ja - j0 .. jb - j0`
                        // of token blocks `tb` and, when `two`, `tb + 1`)
                        // and the panels or `cut`.
                        unsafe {
                            if two {
                                run::<true>(&r)
                            } else {
                                run::<false>(&r)
                            }
                        };
                        tb += if two { 2 } else { 1 };
                    }
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
