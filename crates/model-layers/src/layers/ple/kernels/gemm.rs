//! The projection `y = x @ W^T` over BF16 weights packed once at load.
//!
//! Packed layout (private to this module): the `O` output rows of `W` are cut
//! into panels of [`NR`] rows (the last one zero-padded); a panel stores, for
//! each pair of steps `(2i, 2i + 1)` in order (the last padded with zero when
//! `E` is odd), `NR` words, one per output row `j`: BF16 `w[j, 2i + 1]` in
//! the low half and `w[j, 2i]` in the high half. That is the operand
//! `vdpbf16ps` takes, so the AVX-512 BF16 path reads the weights as they
//! lie; the other paths split each word into its two f32 values (a mask and
//! a shift). Words are the `f32` slots of the `Vec<f32>` that
//! [`pack_projection`] returns (an opaque container, never used as numbers),
//! so the weights take 2 bytes each: decode reads half the bytes an f32 copy
//! would. Viewed as `u16` halves (what [`project`] takes), word `m` is halves
//! `2m` (low) and `2m + 1` (high).
//!
//! Reduction-order invariant: every `y[t, o]` is `acc = 0; for e in 0..E:
//! acc = fma(x[t, e], w[o, e], acc)`, sequential in `e`, on every path. The
//! tiling (token tiles, `KC`-deep weight blocks, register tiles) only decides
//! where `acc` lives between steps (a register or a plain f32 in memory, both
//! exact), so results are bit-identical whatever `T`, the thread count or the
//! CPU path. Products of BF16 values are exact in f32, so the FMA matters only
//! for the additions, and both paths use it.
//!
//! On the AVX-512 BF16 path the projection runs one of two kernels, the
//! faster on this CPU ([`super::cpu::avx512_projection`]): 16-lane f32 FMAs
//! over weights widened to f32 one `KC_512` block at a time (the AVX2 scheme
//! on 512-bit registers, with each token tile's activations packed register
//! tile by register tile and the next weight block prefetched), or
//! `vdpbf16ps`. Both keep the chain's order.
//!
//! The `vdpbf16ps` kernel keeps that order: it feeds `vdpbf16ps` pairs
//! `(x[e], x[e+1])`, `(w[e], w[e+1])` with `e` in the half the instruction
//! takes first, so each lane adds the exact product of `e`, rounds, then
//! adds that of `e + 1` and rounds, as two FMAs do. It needs the activations
//! to be exact BF16 values (rows gathered from a BF16 table are); a call
//! with any other `x` runs the FMA kernel.
//!
//! AMX (`tdpbf16ps`) is not used, though it would be several times faster:
//! on a Sapphire Rapids-class CPU its sums over random BF16 operands
//! matched neither the sequential chain (even or odd element first), nor a
//! pair-then-add, nor a per-tile sum added once (300,939 to 443,119
//! of 512,000 outputs differed from each), so its results could not be
//! reproduced by any other path or host, and a carry moved between hosts
//! would no longer continue bit for bit.
//!
//! Partial reductions: [`project_range`] runs the chain over steps
//! `from..to` only, starting from zero or from the sums a call over the
//! steps before left in `y`. A projection cut into ranges at even steps,
//! each continuing from the last, is the same chain (the stored sum is the
//! exact f32 the register held), so its results are bit-identical to one
//! call: a layer can project the rows it has while the rest are still being
//! read. Between the calls of a cut projection `y` holds the sums in a
//! layout of this module's own (panel by panel, where whole panels fill the
//! rows, so each task reads and writes one contiguous run); only the call
//! whose range ends at `E` leaves `y` as the projection's rows.
//!
//! Work split: token tiles of `TILE_ROWS` rows, sequentially; within a tile,
//! rayon over weight panels. Each panel's weights are read once per tile and
//! shared by every row of the tile, so a decode batch of up to `TILE_ROWS`
//! rows streams the weights from memory once. On the `vdpbf16ps` path each
//! register tile of a weight block also hints a share of the next block
//! into L2, so the memory streams evenly instead of in bursts at each
//! block's first register tile.

use rayon::prelude::*;

use super::cpu::{Avx512Projection, CpuPath};
use super::error::KernelError;
use super::math::bf16_to_f32;

/// Output columns per panel (two AVX2 registers of f32).
pub const NR: usize = 16;
/// Rows of the register tile.
const MR: usize = 6;
/// Rows of the AVX-512 BF16 register tile (of 32 registers: 8 accumulators,
/// the weight pair, the broadcasts).
const MR_BF16: usize = 8;
/// Depth of a weight block converted to f32 at once (16 KiB of f32, in L1).
const KC: usize = 256;
/// Token rows sharing one pass over the weights (a multiple of `MR`).
const TILE_ROWS: usize = 96;
/// Panels one single-row task reads side by side.
#[cfg(target_arch = "x86_64")]
const GROUP: usize = 4;
/// Depth of a weight block the AVX-512 FMA kernel widens at once (two
/// panels: 16 KiB of f32, a third of L1, so the activation rows of a tile
/// stay cached beside it).
const KC_512: usize = 128;
/// Rows of the AVX-512 FMA register tile (of 32 registers: 2 x 12
/// accumulators, the two weight vectors, the broadcast).
const MR_512: usize = 12;

/// The kernel a call runs: the CPU path, and on the AVX-512 BF16 path the
/// multiply instruction.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kernel {
    Portable,
    Avx2,
    Avx512Fma,
    Avx512Dot,
}

impl Kernel {
    /// Every kernel this CPU runs (for tests: each must give the same bits).
    #[cfg(test)]
    fn all_available() -> Vec<Kernel> {
        let mut v = vec![Kernel::Portable];
        if CpuPath::Avx2Fma.available() {
            v.push(Kernel::Avx2);
        }
        if CpuPath::Avx512Bf16.available() {
            v.extend([Kernel::Avx512Fma, Kernel::Avx512Dot]);
        }
        v
    }

    /// The kernel of `path` for activations `x` (the `vdpbf16ps` kernel
    /// needs exact BF16 values).
    fn pick(path: CpuPath, x: &[f32]) -> Kernel {
        match path {
            CpuPath::Portable => Kernel::Portable,
            CpuPath::Avx2Fma => Kernel::Avx2,
            CpuPath::Avx512Bf16 => match super::cpu::avx512_projection() {
                Avx512Projection::Dot if x.iter().all(|v| v.to_bits() & 0xFFFF == 0) => {
                    Kernel::Avx512Dot
                }
                _ => Kernel::Avx512Fma,
            },
        }
    }
}

/// Number of `NR`-wide panels covering `o` output rows.
fn panels(o: usize) -> usize {
    o.div_ceil(NR)
}

/// Length in `f32` words of the packed form of an `[o, e]` weight.
pub fn packed_len(o: usize, e: usize) -> usize {
    panels(o) * e.div_ceil(2) * NR
}

/// BF16 halves one packed panel of depth `e` takes.
fn panel_len(e: usize) -> usize {
    e.div_ceil(2) * 2 * NR
}

/// Index, within a panel, of the half holding weight `(j, k)`: word
/// `(k / 2) * NR + j`, high half for even `k`.
fn half_index(j: usize, k: usize) -> usize {
    ((k / 2) * NR + j) * 2 + usize::from(k.is_multiple_of(2))
}

/// Pack a row-major `[o, e]` BF16 weight (raw bits) for [`project`].
///
/// # Panics
/// When `w_bf16_bits.len() != o * e`; [`try_pack_projection`] returns an
/// error instead.
pub fn pack_projection(w_bf16_bits: &[u16], o: usize, e: usize) -> Vec<f32> {
    match try_pack_projection(w_bf16_bits, o, e) {
        Ok(p) => p,
        Err(err) => panic!("{err}"),
    }
}

/// [`pack_projection`], with an error when the length does not match.
pub fn try_pack_projection(
    w_bf16_bits: &[u16],
    o: usize,
    e: usize,
) -> Result<Vec<f32>, KernelError> {
    const NAME: &str = "pack_projection";
    let want = o.checked_mul(e).ok_or_else(|| KernelError::Overflow {
        kernel: NAME,
        what: format!("[O = {o}, E = {e}]"),
    })?;
    KernelError::check_len(
        NAME,
        || "weight".to_string(),
        w_bf16_bits.len(),
        want,
        || format!("O = {o}, E = {e}"),
    )?;
    let np = panels(o);
    let pl = panel_len(e);
    let mut halves = vec![0u16; np * pl];
    for p in 0..np {
        let base = p * pl;
        for j in 0..NR.min(o - p * NR) {
            let row = &w_bf16_bits[(p * NR + j) * e..(p * NR + j + 1) * e];
            for (k, &v) in row.iter().enumerate() {
                halves[base + half_index(j, k)] = v;
            }
        }
    }
    // Native byte order for both halves, so that viewing the words' bytes as
    // u16 (what the kernel does) yields `halves` again on any endianness.
    Ok(halves
        .chunks_exact(2)
        .map(|h| {
            let (a, b) = (h[0].to_ne_bytes(), h[1].to_ne_bytes());
            f32::from_bits(u32::from_ne_bytes([a[0], a[1], b[0], b[1]]))
        })
        .collect())
}

/// The packed words as the BF16 halves they hold.
pub fn packed_as_bf16(words: &[f32]) -> &[u16] {
    // SAFETY: u16 has a smaller alignment than f32 and no invalid bit
    // patterns; the length covers exactly the same bytes.
    unsafe { std::slice::from_raw_parts(words.as_ptr() as *const u16, words.len() * 2) }
}

/// `y [t, o] = x [t, e] @ W^T` on the best path of this CPU. `w` is the
/// packed weight viewed as BF16 halves (see [`packed_as_bf16`]).
pub fn project(
    x: &[f32],
    w: &[u16],
    y: &mut [f32],
    t: usize,
    e: usize,
    o: usize,
) -> Result<(), KernelError> {
    project_on(super::cpu::best_path(), x, w, y, t, e, o)
}

/// The steps of the reduction one call runs, and where its sums start.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Steps {
    /// First step (even, so a call never splits a packed pair).
    pub from: usize,
    /// One past the last step (even, or `E`).
    pub to: usize,
    /// Continue from the sums a call over the steps before left in `y`
    /// (kept there in a layout of this module's own until a call ends at
    /// `E`); otherwise start from zero.
    pub accumulate: bool,
}

impl Steps {
    /// Every step of a depth-`e` reduction, from zero.
    pub fn all(e: usize) -> Steps {
        Steps {
            from: 0,
            to: e,
            accumulate: false,
        }
    }
}

/// `y [t, o]` continued over steps `steps.from..steps.to` of `x [t, e] @
/// W^T` on the best path of this CPU (see the module docs: calls over
/// consecutive ranges, the first from zero, equal one [`project`]).
#[allow(clippy::too_many_arguments)]
pub fn project_range(
    x: &[f32],
    w: &[u16],
    y: &mut [f32],
    t: usize,
    e: usize,
    o: usize,
    steps: Steps,
) -> Result<(), KernelError> {
    project_range_on(super::cpu::best_path(), x, w, y, t, e, o, steps)
}

/// [`project_range`] on a chosen path (errors when this CPU cannot run it).
#[allow(clippy::too_many_arguments)]
pub fn project_range_on(
    path: CpuPath,
    x: &[f32],
    w: &[u16],
    y: &mut [f32],
    t: usize,
    e: usize,
    o: usize,
    steps: Steps,
) -> Result<(), KernelError> {
    const NAME: &str = "project";
    KernelError::check_path(NAME, path)?;
    let Steps { from, to, .. } = steps;
    // A zero depth is `project_checked`'s to refuse, by its sizes.
    let bad = from >= to || to > e || !from.is_multiple_of(2) || (to != e && !to.is_multiple_of(2));
    if e > 0 && bad {
        return Err(KernelError::Layout {
            kernel: NAME,
            problem: format!(
                "steps {from}..{to} of E = {e}: need from < to <= E, from even, to even or E"
            ),
        });
    }
    project_checked(Kernel::pick(path, x), x, w, y, t, e, o, steps)
}

/// [`project`] on a chosen path (errors when this CPU cannot run it).
pub fn project_on(
    path: CpuPath,
    x: &[f32],
    w: &[u16],
    y: &mut [f32],
    t: usize,
    e: usize,
    o: usize,
) -> Result<(), KernelError> {
    project_range_on(path, x, w, y, t, e, o, Steps::all(e))
}

/// [`project_on`] once the path of `kernel` is known to run here, over
/// `steps` (already checked against `e`).
#[allow(clippy::too_many_arguments)]
fn project_checked(
    kernel: Kernel,
    x: &[f32],
    w: &[u16],
    y: &mut [f32],
    t: usize,
    e: usize,
    o: usize,
    steps: Steps,
) -> Result<(), KernelError> {
    let Steps {
        from: k0,
        to: k1,
        accumulate,
    } = steps;
    const NAME: &str = "project";
    if e == 0 || o == 0 {
        return Err(KernelError::ZeroSize {
            kernel: NAME,
            sizes: format!("E = {e}, O = {o}"),
        });
    }
    let shape = || format!("T = {t}, E = {e}, O = {o}");
    let overflow = || KernelError::Overflow {
        kernel: NAME,
        what: shape(),
    };
    let x_len = t.checked_mul(e).ok_or_else(overflow)?;
    let y_len = t.checked_mul(o).ok_or_else(overflow)?;
    KernelError::check_len(NAME, || "x".to_string(), x.len(), x_len, shape)?;
    KernelError::check_len(NAME, || "y".to_string(), y.len(), y_len, shape)?;
    KernelError::check_len(
        NAME,
        || "packed weight (BF16 halves)".to_string(),
        w.len(),
        packed_len(o, e) * 2,
        shape,
    )?;
    if t == 0 {
        return Ok(());
    }
    let np = panels(o);
    let min_len = (np / (rayon::current_num_threads() * 8)).max(1);
    let yp = SyncPtr(y.as_mut_ptr());
    #[cfg(target_arch = "x86_64")]
    if kernel != Kernel::Portable && t == 1 {
        // One row is bound by reading the weights: convert them in registers
        // and keep GROUP panels (2 * GROUP independent FMA chains) in flight.
        let groups = np.div_ceil(GROUP);
        let min_len = (groups / (rayon::current_num_threads() * 8)).max(1);
        (0..groups)
            .into_par_iter()
            .with_min_len(min_len)
            .for_each(|g| {
                let p0 = g * GROUP;
                let n = GROUP.min(np - p0);
                let mut out = [0.0f32; GROUP * NR];
                let cols = (o - p0 * NR).min(n * NR);
                if accumulate {
                    // SAFETY: columns `p0 * NR .. p0 * NR + cols` of the
                    // single row lie inside `y`; only this group reads or
                    // writes them.
                    unsafe {
                        std::ptr::copy_nonoverlapping(yp.get().add(p0 * NR), out.as_mut_ptr(), cols)
                    };
                }
                let pl = panel_len(e);
                let wg = &w[p0 * pl..(p0 + n) * pl];
                // SAFETY: the kernel's path runs here (checked by
                // `project_on`): AVX2 and FMA, and AVX-512F for the AVX-512
                // kernels; `x` holds `e` values, `k0 < k1 <= e`, `wg`
                // holds `n` packed panels, `out` holds `GROUP * NR >= n *
                // NR` values.
                unsafe {
                    let (xp, wp, op) = (x.as_ptr(), wg.as_ptr(), out.as_mut_ptr());
                    match (kernel, n) {
                        (Kernel::Avx512Fma | Kernel::Avx512Dot, 1) => {
                            avx512::row_direct::<1>(xp, wp, e, k0, k1, op)
                        }
                        (Kernel::Avx512Fma | Kernel::Avx512Dot, 2) => {
                            avx512::row_direct::<2>(xp, wp, e, k0, k1, op)
                        }
                        (Kernel::Avx512Fma | Kernel::Avx512Dot, 3) => {
                            avx512::row_direct::<3>(xp, wp, e, k0, k1, op)
                        }
                        (Kernel::Avx512Fma | Kernel::Avx512Dot, _) => {
                            avx512::row_direct::<4>(xp, wp, e, k0, k1, op)
                        }
                        (_, 1) => avx2::row_direct::<1>(xp, wp, e, k0, k1, op),
                        (_, 2) => avx2::row_direct::<2>(xp, wp, e, k0, k1, op),
                        (_, 3) => avx2::row_direct::<3>(xp, wp, e, k0, k1, op),
                        (_, _) => avx2::row_direct::<4>(xp, wp, e, k0, k1, op),
                    }
                }
                // SAFETY: columns `p0 * NR .. p0 * NR + cols` of the single row
                // lie inside `y` and belong to this group alone.
                unsafe { std::ptr::copy_nonoverlapping(out.as_ptr(), yp.get().add(p0 * NR), cols) };
            });
        return Ok(());
    }
    // Sums passed between the calls of a cut projection are kept panel by
    // panel (see `Tile`) where whole panels fill `y` exactly.
    let staged = o.is_multiple_of(NR);
    let (mut pairs, mut packed) = (Vec::new(), Vec::new());
    let mut snapshot: Vec<f32> = Vec::new();
    for t0 in (0..t).step_by(TILE_ROWS) {
        let rows = TILE_ROWS.min(t - t0);
        let store_staged = k1 < e && staged;
        let staged_from = (accumulate && staged).then(|| {
            if store_staged {
                // SAFETY: `t0 * o` lies inside `y` (`t0 < t`).
                SyncPtr(unsafe { yp.get().add(t0 * o) })
            } else {
                // The last call turns staged sums into rows in place: one
                // task's rows would overwrite panels other tasks have yet
                // to load, so they load from a copy, taken before any runs.
                snapshot.clear();
                // SAFETY: the tile's rows lie inside `y`; no task runs yet.
                snapshot.extend_from_slice(unsafe {
                    std::slice::from_raw_parts(yp.get().add(t0 * o), rows * o)
                });
                SyncPtr(snapshot.as_mut_ptr())
            }
        });
        let tile = Tile {
            y: yp,
            t0,
            rows,
            o,
            staged_from,
            store_staged,
        };
        let xt = &x[t0 * e..(t0 + rows) * e];
        // Only the steps of this call are packed: a projection cut into
        // ranges packs each activation once, as one call does.
        if kernel == Kernel::Avx512Dot {
            pairs.clear();
            pairs.extend(xt.chunks_exact(e).flat_map(|row| {
                (k0 / 2..k1.div_ceil(2)).map(move |i| {
                    let hi = row[2 * i].to_bits() >> 16;
                    let lo = row.get(2 * i + 1).map_or(0, |v| v.to_bits() >> 16);
                    (hi << 16) | lo
                })
            }));
        }
        if kernel == Kernel::Avx512Fma {
            pack_tiles(xt, rows, e, k0, k1, &mut packed);
        }
        let (xpairs, xpacked) = (&pairs[..], &packed[..]);
        if matches!(kernel, Kernel::Avx512Fma | Kernel::Avx512Dot) {
            // Two panels a task share every activation broadcast.
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
                            // SAFETY: panel `p0 + q` belongs to this task
                            // alone (see `Tile`).
                            unsafe { tile.load(&mut acc[q * rows * NR..], p0 + q) };
                        }
                    }
                    let wg = &w[p0 * panel_len(e)..(p0 + n) * panel_len(e)];
                    if kernel == Kernel::Avx512Dot {
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
            continue;
        }
        (0..np).into_par_iter().with_min_len(min_len).for_each(|p| {
            let mut acc_buf = [std::mem::MaybeUninit::<f32>::uninit(); TILE_ROWS * NR];
            let acc = zeroed(&mut acc_buf[..rows * NR]);
            if accumulate {
                // SAFETY: panel `p` belongs to this task alone (see `Tile`).
                unsafe { tile.load(acc, p) };
            }
            panel(
                kernel,
                xt,
                &w[p * panel_len(e)..(p + 1) * panel_len(e)],
                &mut acc[..rows * NR],
                rows,
                e,
                (k0, k1),
            );
            // SAFETY: as above.
            unsafe { tile.store(acc, p) };
        });
    }
    Ok(())
}

/// Rows `t0 .. t0 + rows` of `y [t, o]`, whose panels (`NR` columns each)
/// the tasks of one call read and write, each its own panels: panels are
/// disjoint column ranges, so no two tasks touch the same element, and `y`
/// is borrowed mutably for the whole call.
#[derive(Clone, Copy)]
struct Tile {
    y: SyncPtr,
    t0: usize,
    rows: usize,
    o: usize,
    /// Where the staged sums to continue start (this tile's rows of `y`,
    /// or a copy of them), when a call over earlier steps left them.
    staged_from: Option<SyncPtr>,
    /// Leave the sums staged: a later call continues them.
    store_staged: bool,
}

impl Tile {
    /// Where panel `p` of these rows lies while staged, from the tile's
    /// first value: the tile's rows `t0 .. t0 + rows` of `y [t, o]` hold,
    /// panel after panel, each panel's `[rows, NR]` sums side by side. A task's sums are then one
    /// contiguous run instead of a line in each of `rows` rows `4 * o`
    /// bytes apart, which made each call of a cut projection pay about a
    /// fifth of a millisecond at decode sizes to fetch and put them back.
    /// Needs `o` a multiple of `NR` (the panels fill the rows exactly).
    fn staged_at(self, p: usize) -> usize {
        p * self.rows * NR
    }

    /// Panel `p` of these rows into `acc [rows, NR]`.
    ///
    /// # Safety
    /// `y` holds at least `(t0 + rows) * o` values, `p * NR < o`, and no
    /// other task reads or writes panel `p` of these rows meanwhile.
    unsafe fn load(self, acc: &mut [f32], p: usize) {
        assert!(acc.len() >= self.rows * NR);
        if let Some(from) = self.staged_from {
            // SAFETY: forwarded from the caller; staged, the panel's sums
            // are `rows * NR` values inside the tile's `rows * o`.
            unsafe {
                std::ptr::copy_nonoverlapping(
                    from.get().add(self.staged_at(p)),
                    acc.as_mut_ptr(),
                    self.rows * NR,
                )
            };
            return;
        }
        let cols = NR.min(self.o - p * NR);
        for r in 0..self.rows {
            // SAFETY: forwarded from the caller; row t0 + r, columns
            // `p * NR .. p * NR + cols` lie inside `y`.
            unsafe {
                std::ptr::copy_nonoverlapping(
                    self.y.get().add((self.t0 + r) * self.o + p * NR),
                    acc[r * NR..].as_mut_ptr(),
                    cols,
                )
            };
        }
    }

    /// `acc [rows, NR]` into panel `p` of these rows.
    ///
    /// # Safety
    /// As [`Tile::load`].
    unsafe fn store(self, acc: &[f32], p: usize) {
        assert!(acc.len() >= self.rows * NR);
        if self.store_staged {
            // SAFETY: as in `load`.
            unsafe {
                std::ptr::copy_nonoverlapping(
                    acc.as_ptr(),
                    self.y.get().add(self.t0 * self.o + self.staged_at(p)),
                    self.rows * NR,
                )
            };
            return;
        }
        let cols = NR.min(self.o - p * NR);
        for r in 0..self.rows {
            // SAFETY: as in `load`.
            unsafe {
                std::ptr::copy_nonoverlapping(
                    acc[r * NR..].as_ptr(),
                    self.y.get().add((self.t0 + r) * self.o + p * NR),
                    cols,
                )
            };
        }
    }
}

/// `buf` cleared and viewed as f32s. A task's accumulators are sized for
/// the largest token tile; only the part its rows use is cleared.
fn zeroed(buf: &mut [std::mem::MaybeUninit<f32>]) -> &mut [f32] {
    for v in buf.iter_mut() {
        v.write(0.0);
    }
    // SAFETY: every element was just written; `MaybeUninit<f32>` has the
    // layout of `f32`.
    unsafe { &mut *(buf as *mut [std::mem::MaybeUninit<f32>] as *mut [f32]) }
}

/// A pointer shared by the tasks of one call, each writing its own elements.
#[derive(Clone, Copy)]
struct SyncPtr(*mut f32);
// SAFETY: tasks write disjoint elements (see the use site).
unsafe impl Send for SyncPtr {}
// SAFETY: as above.
unsafe impl Sync for SyncPtr {}
impl SyncPtr {
    fn get(self) -> *mut f32 {
        self.0
    }
}

/// Weight lines for a micro-kernel to hint into L2 while it computes:
/// `lines` lines of each of `panels` panels from `from`, the second
/// `stride` words after the first. Into L2, not L1: L1 holds the block the
/// tiles are computing from, and the block after it would evict it.
/// Addresses past the weights are only ever prefetched, which never
/// faults.
#[cfg(target_arch = "x86_64")]
#[derive(Clone, Copy)]
struct Ahead {
    from: *const u32,
    stride: usize,
    lines: usize,
    panels: usize,
}

#[cfg(target_arch = "x86_64")]
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
            unsafe {
                std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T1 }>(at.cast())
            };
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
        #[cfg(target_arch = "x86_64")]
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
            #[cfg(target_arch = "x86_64")]
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
                            $(($m, 2) => avx512::micro_bf16_2::<$m>(xp, w2, b0, b1, kp, p0, p1, ahead),
                              ($m, _) => avx512::micro_bf16::<$m>(xp, w2, b0, kp, p0, ahead),)*
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
            #[cfg(target_arch = "x86_64")]
            // SAFETY: `project_checked` picks this kernel only where the CPU
            // has AVX-512F; `src` and `buf` hold the block (checked inside).
            unsafe {
                avx512::widen(src, &mut buf[..kc * 2 * NR], q)
            };
            #[cfg(not(target_arch = "x86_64"))]
            unreachable!("AVX-512 is never available off x86-64: {src:?}");
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
            #[cfg(target_arch = "x86_64")]
            // SAFETY: AVX-512F as above; the slice lengths bound every
            // access (`a1` only when n == 2).
            unsafe {
                let (xs, bp, p0, p1) =
                    (xs.as_ptr(), buf.as_ptr(), a0.as_mut_ptr(), a1.as_mut_ptr());
                macro_rules! tile {
                    ($($m:literal)*) => {
                        match (mr, n) {
                            $(($m, 2) => avx512::micro_fma::<$m, 2>(xs, bp, kc, [p0, p1]),
                              ($m, _) => avx512::micro_fma::<$m, 1>(xs, bp, kc, [p0]),)*
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
    #[cfg(target_arch = "x86_64")]
    // SAFETY: a prefetch never faults; `v` is a valid reference anyway.
    unsafe {
        std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T0 }>(
            (v as *const u16).cast(),
        )
    };
    #[cfg(not(target_arch = "x86_64"))]
    let _ = v;
}

/// One panel for `rows` token rows on the portable or AVX2 path, steps
/// `k0..k1` of `(k0, k1)` (`k0` even): `acc [rows, NR]` continues the
/// panel's outputs.
fn panel(
    kernel: Kernel,
    xt: &[f32],
    wp: &[u16],
    acc: &mut [f32],
    rows: usize,
    e: usize,
    (k0, k1): (usize, usize),
) {
    let path = if kernel == Kernel::Portable {
        CpuPath::Portable
    } else {
        CpuPath::Avx2Fma
    };
    let mut buf = [0.0f32; KC * NR];
    for kb in (k0..k1).step_by(KC) {
        let kc = KC.min(k1 - kb);
        let src = &wp[kb * NR..kb * NR + kc.div_ceil(2) * 2 * NR];
        let b = &mut buf[..kc * NR];
        match path {
            CpuPath::Portable => convert_portable(src, b),
            #[cfg(target_arch = "x86_64")]
            // SAFETY: `project_on` checked that this CPU has AVX2 and FMA.
            CpuPath::Avx2Fma | CpuPath::Avx512Bf16 => unsafe { avx2::convert(src, b) },
            #[cfg(not(target_arch = "x86_64"))]
            CpuPath::Avx2Fma | CpuPath::Avx512Bf16 => {
                unreachable!("AVX2 is never available off x86-64")
            }
        }
        let b = &buf[..kc * NR];
        // Split the rows into register tiles of near-equal height (32 rows
        // become 6+6+5+5+5+5, not 6*5+2): short tiles leave FMA latency
        // exposed. Heights change nothing in the results.
        let tiles = rows.div_ceil(MR);
        let (base, extra) = (rows / tiles, rows % tiles);
        let mut r0 = 0;
        for tile in 0..tiles {
            let mr = base + usize::from(tile < extra);
            let xs = &xt[r0 * e + kb..];
            let a = &mut acc[r0 * NR..(r0 + mr) * NR];
            // The last x element read is (mr - 1) * e + kc - 1.
            assert!(xs.len() >= (mr - 1) * e + kc);
            match path {
                CpuPath::Portable => match mr {
                    1 => micro_portable::<1>(xs, e, b, kc, a),
                    2 => micro_portable::<2>(xs, e, b, kc, a),
                    3 => micro_portable::<3>(xs, e, b, kc, a),
                    4 => micro_portable::<4>(xs, e, b, kc, a),
                    5 => micro_portable::<5>(xs, e, b, kc, a),
                    _ => micro_portable::<6>(xs, e, b, kc, a),
                },
                #[cfg(target_arch = "x86_64")]
                // SAFETY: AVX2 and FMA were checked by `project_on`; the
                // assert above and the slice lengths bound every access.
                CpuPath::Avx2Fma | CpuPath::Avx512Bf16 => unsafe {
                    match mr {
                        1 => avx2::micro::<1>(xs.as_ptr(), e, b.as_ptr(), kc, a.as_mut_ptr()),
                        2 => avx2::micro::<2>(xs.as_ptr(), e, b.as_ptr(), kc, a.as_mut_ptr()),
                        3 => avx2::micro::<3>(xs.as_ptr(), e, b.as_ptr(), kc, a.as_mut_ptr()),
                        4 => avx2::micro::<4>(xs.as_ptr(), e, b.as_ptr(), kc, a.as_mut_ptr()),
                        5 => avx2::micro::<5>(xs.as_ptr(), e, b.as_ptr(), kc, a.as_mut_ptr()),
                        _ => avx2::micro::<6>(xs.as_ptr(), e, b.as_ptr(), kc, a.as_mut_ptr()),
                    }
                },
                #[cfg(not(target_arch = "x86_64"))]
                CpuPath::Avx2Fma | CpuPath::Avx512Bf16 => {
                    unreachable!("AVX2 is never available off x86-64")
                }
            }
            r0 += mr;
        }
    }
}

/// A packed weight block (`dst.len() / NR` steps) as f32, `[kc, NR]`.
fn convert_portable(src: &[u16], dst: &mut [f32]) {
    for (k, row) in dst.chunks_exact_mut(NR).enumerate() {
        for (j, d) in row.iter_mut().enumerate() {
            *d = bf16_to_f32(src[half_index(j, k)]);
        }
    }
}

/// The register tile on the portable path: `acc [M, NR] += x [M, kc] @ b
/// [kc, NR]`, one `mul_add` per element and step, `k` ascending.
fn micro_portable<const M: usize>(x: &[f32], xs: usize, b: &[f32], kc: usize, acc: &mut [f32]) {
    let mut c = [[0.0f32; NR]; M];
    for (i, ci) in c.iter_mut().enumerate() {
        ci.copy_from_slice(&acc[i * NR..(i + 1) * NR]);
    }
    for k in 0..kc {
        let bk = &b[k * NR..(k + 1) * NR];
        for (i, ci) in c.iter_mut().enumerate() {
            let a = x[i * xs + k];
            for (cj, &bj) in ci.iter_mut().zip(bk) {
                *cj = a.mul_add(bj, *cj);
            }
        }
    }
    for (i, ci) in c.iter().enumerate() {
        acc[i * NR..(i + 1) * NR].copy_from_slice(ci);
    }
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    //! The AVX2 + FMA register tile and weight conversion.

    use std::arch::x86_64::*;

    use super::NR;

    /// One packed weight block as f32 `[kc, NR]` (`kc = dst.len() / NR`):
    /// each pair word gives step `2i` (its high half, masked) and step
    /// `2i + 1` (its low half, shifted up).
    ///
    /// # Safety
    /// The CPU must support AVX2 and FMA.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn convert(src: &[u16], dst: &mut [f32]) {
        let kc = dst.len() / NR;
        assert!(src.len() >= kc.div_ceil(2) * 2 * NR && dst.len() == kc * NR);
        let words = src.as_ptr().cast::<u32>();
        // SAFETY: the assert bounds every load (pair `i` is words
        // `i * NR .. (i + 1) * NR`) and store; loads and stores are
        // unaligned.
        unsafe {
            let mask = _mm256_set1_epi32(0xFFFF_0000u32 as i32);
            for i in 0..kc.div_ceil(2) {
                for h in 0..2 {
                    let v = _mm256_loadu_si256(words.add(i * NR + 8 * h).cast());
                    let even = _mm256_castsi256_ps(_mm256_and_si256(v, mask));
                    _mm256_storeu_ps(dst.as_mut_ptr().add(2 * i * NR + 8 * h), even);
                    if 2 * i + 1 < kc {
                        let odd = _mm256_castsi256_ps(_mm256_slli_epi32::<16>(v));
                        _mm256_storeu_ps(dst.as_mut_ptr().add((2 * i + 1) * NR + 8 * h), odd);
                    }
                }
            }
        }
    }

    /// One row against `P` consecutive panels, converting the BF16 weights
    /// in registers: `out [P * NR]` continues the sequential FMA chain over
    /// steps `k0..k1` from the sums it holds, exactly as `micro_portable`
    /// computes it through blocks.
    ///
    /// # Safety
    /// The CPU must support AVX2 and FMA; `k0` even, `k0 < k1 <= e`; `x`
    /// readable at `e` values, `w` at `P` packed panels of depth `e`, `out`
    /// readable and writable at `P * NR` values.
    #[target_feature(enable = "avx2,fma")]
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
            let mask = _mm256_set1_epi32(0xFFFF_0000u32 as i32);
            let mut c0 = [_mm256_setzero_ps(); P];
            let mut c1 = [_mm256_setzero_ps(); P];
            for p in 0..P {
                c0[p] = _mm256_loadu_ps(out.add(p * NR));
                c1[p] = _mm256_loadu_ps(out.add(p * NR + 8));
            }
            for i in k0 / 2..k1.div_ceil(2) {
                // The last pair of an odd depth has no later step.
                let has_odd = 2 * i + 1 < k1;
                let a0 = _mm256_broadcast_ss(&*x.add(2 * i));
                for p in 0..P {
                    let src = words.add(p * pw + i * NR);
                    let v0 = _mm256_loadu_si256(src.cast());
                    let v1 = _mm256_loadu_si256(src.add(8).cast());
                    let e0 = _mm256_castsi256_ps(_mm256_and_si256(v0, mask));
                    let e1 = _mm256_castsi256_ps(_mm256_and_si256(v1, mask));
                    c0[p] = _mm256_fmadd_ps(a0, e0, c0[p]);
                    c1[p] = _mm256_fmadd_ps(a0, e1, c1[p]);
                    if has_odd {
                        let a1 = _mm256_broadcast_ss(&*x.add(2 * i + 1));
                        let o0 = _mm256_castsi256_ps(_mm256_slli_epi32::<16>(v0));
                        let o1 = _mm256_castsi256_ps(_mm256_slli_epi32::<16>(v1));
                        c0[p] = _mm256_fmadd_ps(a1, o0, c0[p]);
                        c1[p] = _mm256_fmadd_ps(a1, o1, c1[p]);
                    }
                }
            }
            for p in 0..P {
                _mm256_storeu_ps(out.add(p * NR), c0[p]);
                _mm256_storeu_ps(out.add(p * NR + 8), c1[p]);
            }
        }
    }

    /// `acc [M, NR] += x [M, kc] @ b [kc, NR]`: one FMA per element and
    /// step, `k` ascending, exactly as `micro_portable`.
    ///
    /// # Safety
    /// The CPU must support AVX2 and FMA; `x` must be readable at `i * xs +
    /// k` for `i < M`, `k < kc`; `b` at `kc * NR` values; `acc` readable and
    /// writable at `M * NR` values.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn micro<const M: usize>(
        x: *const f32,
        xs: usize,
        b: *const f32,
        kc: usize,
        acc: *mut f32,
    ) {
        // SAFETY: all reads and writes stay inside the ranges the caller
        // guarantees; unaligned loads and stores are used throughout.
        unsafe {
            let mut c0 = [_mm256_setzero_ps(); M];
            let mut c1 = [_mm256_setzero_ps(); M];
            for i in 0..M {
                c0[i] = _mm256_loadu_ps(acc.add(i * NR));
                c1[i] = _mm256_loadu_ps(acc.add(i * NR + 8));
            }
            for k in 0..kc {
                let b0 = _mm256_loadu_ps(b.add(k * NR));
                let b1 = _mm256_loadu_ps(b.add(k * NR + 8));
                for i in 0..M {
                    let a = _mm256_broadcast_ss(&*x.add(i * xs + k));
                    c0[i] = _mm256_fmadd_ps(a, b0, c0[i]);
                    c1[i] = _mm256_fmadd_ps(a, b1, c1[i]);
                }
            }
            for i in 0..M {
                _mm256_storeu_ps(acc.add(i * NR), c0[i]);
                _mm256_storeu_ps(acc.add(i * NR + 8), c1[i]);
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod avx512 {
    //! The AVX-512 register tiles (f32 FMA and BF16 pair dot products), the
    //! weight widening and the single-row kernel.

    use std::arch::x86_64::*;

    use super::{Ahead, NR};

    /// Widen one packed block of a panel (`kc = dst.len() / (2 * NR)`
    /// steps) into slot `q` (0 or 1) of `dst [kc, 2 * NR]`: each pair word
    /// gives step `2i` (its high half, masked) and step `2i + 1` (its low
    /// half, shifted up).
    ///
    /// # Safety
    /// The CPU must support AVX-512F.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn widen(src: &[u16], dst: &mut [f32], q: usize) {
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
    /// ascending, exactly as `micro_portable`; each activation broadcast
    /// feeds every panel.
    ///
    /// # Safety
    /// The CPU must support AVX-512F; `x` (`[kc, M]`) must be readable at
    /// `k * M + i` for `i < M`, `k < kc`; `b` at `kc * 2 * NR` values; each
    /// `acc[p]` readable and writable at `M * NR` values.
    #[target_feature(enable = "avx512f")]
    // Register tiles read clearest indexed by row and panel.
    #[allow(clippy::needless_range_loop)]
    pub(super) unsafe fn micro_fma<const M: usize, const P: usize>(
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
    /// steps `k0..k1` from the sums it holds, exactly as `micro_portable`
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
    pub(super) unsafe fn micro_bf16_2<const M: usize>(
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
                    let a: __m512bh =
                        std::mem::transmute(_mm512_set1_epi32(*x.add(i * xs + p) as i32));
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
    pub(super) unsafe fn micro_bf16<const M: usize>(
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
                    let a: __m512bh =
                        std::mem::transmute(_mm512_set1_epi32(*x.add(i * xs + p) as i32));
                    *ci = _mm512_dpbf16_ps(*ci, a, bv);
                }
            }
            for (i, ci) in c.iter().enumerate() {
                _mm512_storeu_ps(acc.add(i * NR), *ci);
            }
        }
    }
}

#[cfg(test)]
mod tests;
