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
//! AMX (`tdpbf16ps`, [`CpuPath::Amx`]) is the exception, a bit class of its
//! own: on a Sapphire Rapids-class CPU its sums over random BF16 operands
//! match neither the sequential chain (even or odd element first), nor a
//! pair-then-add, nor a per-tile sum added once, so no other path can
//! reproduce them. It is more accurate than the chain (docs/SPEC.md gives
//! the measured bound against the f64 reference), and keeps the
//! invariants above in its own form (see `amx`): bits independent of `T`,
//! the tiling and the thread count, and cut projections equal to one call
//! where the cuts fall on multiples of [`CUT_STEPS`]. It runs only for
//! exact BF16 activations (others take the AVX-512 kernel, in the chain's
//! class) and only where CPUID and Linux's tile permission allow.
//!
//! Files, one a path behind this entry point: `portable` (the chain in
//! plain Rust), `avx2`, `avx512` (FMA and `vdpbf16ps` tiles, the
//! single-row kernel), `amx` (tile configuration, `tileloadd`,
//! `tdpbf16ps`, `tilestored`).
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

/// The granularity at which a projection cut into ranges stays
/// bit-identical to one call on every path: any even step does on the
/// paths of the FMA chain, multiples of 32 (one `tdpbf16ps` block) on the
/// AMX path too.
pub const CUT_STEPS: usize = 32;

/// Output columns per panel (two AVX2 registers of f32).
pub const NR: usize = 16;
/// Rows of the register tile.
const MR: usize = 6;
/// Depth of a weight block converted to f32 at once (16 KiB of f32, in L1).
const KC: usize = 256;
/// Token rows sharing one pass over the weights (a multiple of `MR`).
const TILE_ROWS: usize = 96;
/// Token rows sharing one pass over the weights on the AMX path.
#[cfg(target_arch = "x86_64")]
const AMX_TILE_ROWS: usize = amx::TILE_ROWS;
#[cfg(not(target_arch = "x86_64"))]
const AMX_TILE_ROWS: usize = TILE_ROWS;
/// Panels one single-row task reads side by side.
#[cfg(target_arch = "x86_64")]
const GROUP: usize = 4;
/// The kernel a call runs: the CPU path, and on the AVX-512 BF16 path the
/// multiply instruction.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kernel {
    Portable,
    Avx2,
    Avx512Fma,
    Avx512Dot,
    /// `tdpbf16ps` tiles: a bit class of its own (see `amx`).
    Amx,
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

    /// The kernel of `path` for activations `x` (the `vdpbf16ps` and AMX
    /// kernels need exact BF16 values; on the AMX path other activations
    /// run the AVX-512 kernel, in the FMA chain's bit class).
    fn pick(path: CpuPath, x: &[f32]) -> Kernel {
        let exact = || x.iter().all(|v| v.to_bits() & 0xFFFF == 0);
        match path {
            CpuPath::Amx if exact() => Kernel::Amx,
            CpuPath::Amx => Kernel::pick(CpuPath::Avx512Bf16, x),
            CpuPath::Portable => Kernel::Portable,
            CpuPath::Avx2Fma => Kernel::Avx2,
            CpuPath::Avx512Bf16 => match super::cpu::avx512_projection() {
                Avx512Projection::Dot if exact() => Kernel::Avx512Dot,
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
    if !matches!(kernel, Kernel::Portable | Kernel::Amx) && t == 1 {
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
    #[cfg(target_arch = "x86_64")]
    let (mut scratch, mut amx_scratch) = (avx512::Scratch::default(), amx::Scratch::default());
    let mut snapshot: Vec<f32> = Vec::new();
    // The staged layout of a cut projection depends on the token tiles, so
    // every call of one keeps `TILE_ROWS`; a whole call on the AMX path
    // takes larger tiles (its weights stream from memory once a tile).
    let whole = k0 == 0 && k1 == e && !accumulate;
    let tile_rows = if kernel == Kernel::Amx && whole {
        AMX_TILE_ROWS
    } else {
        TILE_ROWS
    };
    for t0 in (0..t).step_by(tile_rows) {
        let rows = tile_rows.min(t - t0);
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
        #[cfg(target_arch = "x86_64")]
        if matches!(kernel, Kernel::Avx512Fma | Kernel::Avx512Dot) {
            let dot = kernel == Kernel::Avx512Dot;
            avx512::token_tile(dot, xt, w, tile, np, e, (k0, k1), accumulate, &mut scratch);
            continue;
        }
        #[cfg(target_arch = "x86_64")]
        if kernel == Kernel::Amx {
            amx::token_tile(xt, w, tile, np, e, (k0, k1), accumulate, &mut amx_scratch);
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
    let portable = kernel == Kernel::Portable;
    let mut buf = [0.0f32; KC * NR];
    for kb in (k0..k1).step_by(KC) {
        let kc = KC.min(k1 - kb);
        let src = &wp[kb * NR..kb * NR + kc.div_ceil(2) * 2 * NR];
        let b = &mut buf[..kc * NR];
        if portable {
            portable::convert(src, b);
        } else {
            #[cfg(target_arch = "x86_64")]
            // SAFETY: `project_on` checked that this CPU has AVX2 and FMA.
            unsafe {
                avx2::convert(src, b)
            };
            #[cfg(not(target_arch = "x86_64"))]
            unreachable!("AVX2 is never available off x86-64");
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
            if portable {
                match mr {
                    1 => portable::micro::<1>(xs, e, b, kc, a),
                    2 => portable::micro::<2>(xs, e, b, kc, a),
                    3 => portable::micro::<3>(xs, e, b, kc, a),
                    4 => portable::micro::<4>(xs, e, b, kc, a),
                    5 => portable::micro::<5>(xs, e, b, kc, a),
                    _ => portable::micro::<6>(xs, e, b, kc, a),
                }
            } else {
                #[cfg(target_arch = "x86_64")]
                // SAFETY: AVX2 and FMA were checked by `project_on`; the
                // assert above and the slice lengths bound every access.
                unsafe {
                    match mr {
                        1 => avx2::micro::<1>(xs.as_ptr(), e, b.as_ptr(), kc, a.as_mut_ptr()),
                        2 => avx2::micro::<2>(xs.as_ptr(), e, b.as_ptr(), kc, a.as_mut_ptr()),
                        3 => avx2::micro::<3>(xs.as_ptr(), e, b.as_ptr(), kc, a.as_mut_ptr()),
                        4 => avx2::micro::<4>(xs.as_ptr(), e, b.as_ptr(), kc, a.as_mut_ptr()),
                        5 => avx2::micro::<5>(xs.as_ptr(), e, b.as_ptr(), kc, a.as_mut_ptr()),
                        _ => avx2::micro::<6>(xs.as_ptr(), e, b.as_ptr(), kc, a.as_mut_ptr()),
                    }
                };
                #[cfg(not(target_arch = "x86_64"))]
                unreachable!("AVX2 is never available off x86-64");
            }
            r0 += mr;
        }
    }
}

/// Instructions per second of the AMX peak loop, for `cpu::mul_add_rate`
/// (see `amx::peak`).
///
/// # Safety
/// `cpu::amx_ready()` must hold.
#[cfg(target_arch = "x86_64")]
pub(super) unsafe fn amx_peak(iters: usize) -> f32 {
    // SAFETY: forwarded from the caller.
    unsafe { amx::peak(iters) }
}

#[cfg(target_arch = "x86_64")]
mod amx;
#[cfg(target_arch = "x86_64")]
mod avx2;
#[cfg(target_arch = "x86_64")]
mod avx512;
mod portable;

#[cfg(test)]
mod tests;
