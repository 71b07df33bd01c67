//! Microbenchmarks of the limits the AMX projection runs into: how fast
//! `tileloadd` streams tiles from L1, L2 and beyond, how fast `tdpbf16ps`
//! runs when its operands come from each level, and what packing the
//! activations costs. Each figure is timed over many short trials on the
//! calling thread; the minimum and the median are reported, so a trial
//! that the OS preempts (whole milliseconds on a shared machine) moves the
//! median, not the minimum.
//!
//! Only for measurement: nothing here takes part in a projection.

use std::arch::asm;
use std::time::Instant;

use super::amx::{Config, ROW_BYTES, TR, pack_activations, release};
use super::{AmxLimit, NR};

/// Seconds of the fastest and of the median of `n` calls of `f`.
fn trials(n: usize, mut f: impl FnMut()) -> (f64, f64) {
    f();
    let mut v: Vec<f64> = (0..n)
        .map(|_| {
            let t0 = Instant::now();
            f();
            t0.elapsed().as_secs_f64()
        })
        .collect();
    v.sort_by(f64::total_cmp);
    (v[0], v[v.len() / 2])
}

/// `passes` passes of `tileloadd` over `tiles` contiguous KiB tiles at `p`,
/// four loads in flight into `tmm4..tmm7`.
///
/// # Safety
/// Tiles configured ([`Config::load`]); `p` valid for `tiles` KiB, `tiles`
/// a nonzero multiple of 4.
unsafe fn loads(p: *const u8, tiles: usize, passes: usize) {
    for _ in 0..passes {
        // SAFETY: forwarded from the caller; the loop reads `tiles` KiB.
        unsafe {
            asm!(
                "2:",
                "tileloadd tmm4, [{p} + {s}*1]",
                "tileloadd tmm5, [{p} + {s}*1 + 1024]",
                "tileloadd tmm6, [{p} + {s}*1 + 2048]",
                "tileloadd tmm7, [{p} + {s}*1 + 3072]",
                "add {p}, 4096",
                "dec {n}",
                "jnz 2b",
                p = inout(reg) p => _,
                s = in(reg) ROW_BYTES,
                n = inout(reg) tiles / 4 => _,
                options(nostack, readonly),
            )
        };
    }
}

/// Where the operand tiles of [`dots`] come from: a stream of `stride`
/// bytes a block (0: the same tile every block, in L1) over two regions,
/// `half` bytes apart.
#[derive(Clone, Copy)]
struct Stream {
    p: *const u8,
    half: usize,
    stride: usize,
}

/// `blocks` blocks of the projection's 2 x 2 shape (two activation tiles,
/// two weight tiles, four `tdpbf16ps`), operands loaded from `a` and `b`.
///
/// # Safety
/// Tiles configured; each stream valid for `half + blocks * stride + 1024`
/// bytes.
unsafe fn dots(a: Stream, b: Stream, blocks: usize) {
    let mut out = [0.0f32; TR * NR];
    // SAFETY: forwarded from the caller; `out` holds one sum tile.
    unsafe {
        asm!(
            "tilezero tmm0",
            "tilezero tmm1",
            "tilezero tmm2",
            "tilezero tmm3",
            "2:",
            "tileloadd tmm4, [{a0} + {s}*1]",
            "tileloadd tmm6, [{b0} + {s}*1]",
            "tileloadd tmm7, [{b1} + {s}*1]",
            "tdpbf16ps tmm0, tmm4, tmm6",
            "tileloadd tmm5, [{a1} + {s}*1]",
            "tdpbf16ps tmm1, tmm4, tmm7",
            "tdpbf16ps tmm2, tmm5, tmm6",
            "tdpbf16ps tmm3, tmm5, tmm7",
            "add {a0}, {sa}",
            "add {a1}, {sa}",
            "add {b0}, {sb}",
            "add {b1}, {sb}",
            "dec {n}",
            "jnz 2b",
            "tilestored [{o} + {s}*1], tmm3",
            a0 = inout(reg) a.p => _,
            a1 = inout(reg) a.p.add(a.half) => _,
            b0 = inout(reg) b.p => _,
            b1 = inout(reg) b.p.add(b.half) => _,
            sa = in(reg) a.stride,
            sb = in(reg) b.stride,
            o = in(reg) out.as_mut_ptr(),
            s = in(reg) ROW_BYTES,
            n = inout(reg) blocks => _,
            options(nostack),
        )
    };
    std::hint::black_box(out[0]);
}

/// The limits on the calling thread (see the module docs).
///
/// # Safety
/// `cpu::amx_ready()` must hold.
pub(super) unsafe fn measure() -> Vec<AmxLimit> {
    const KIB: usize = 1024;
    let mut out = Vec::new();
    let mut push = |what: String, unit: &'static str, (min, median): (f64, f64)| {
        out.push(AmxLimit {
            what,
            unit,
            min,
            median,
        })
    };
    // The core clock, from a chain of dependent multiplies (three cycles
    // each; a chain of adds of constants is folded by recent cores), so
    // the figures below can be read in cycles.
    let adds = 100_000usize;
    let t = trials(200, || {
        // SAFETY: register arithmetic only.
        unsafe {
            asm!(
                "2:",
                ".rept 10",
                "imul {x}, {x}",
                ".endr",
                "dec {n}",
                "jnz 2b",
                x = inout(reg) 3usize => _,
                n = inout(reg) adds / 10 => _,
                options(nostack, nomem),
            )
        }
    });
    push(
        "core clock (dependent imul, 3 cycles each)".into(),
        "GHz",
        (3.0 * adds as f64 / t.0 / 1e9, 3.0 * adds as f64 / t.1 / 1e9),
    );
    let big = vec![0x3F80_3F80u32; 64 << 20 >> 2];
    let ptr = big.as_ptr().cast::<u8>();
    let cfg = Config::new();
    // SAFETY: forwarded from the caller; released below.
    unsafe { cfg.load() };

    // Peak: four independent sums from operands loaded once.
    let l1 = Stream {
        p: ptr,
        half: 2 * KIB,
        stride: 0,
    };
    let ops = 4 * 2000;
    // SAFETY: stride 0 reads 3 KiB of `big`.
    let peak = trials(200, || unsafe { dots(l1, l1, ops / 4) });
    let per_op = |t: (f64, f64), n: usize| (t.0 / n as f64 * 1e9, t.1 / n as f64 * 1e9);
    push(
        "tdpbf16ps, 2x2, all tiles L1 (same tiles)".into(),
        "ns/op",
        per_op(peak, ops),
    );

    // tileloadd streams: GB/s over buffers of each size.
    for (size, passes, label) in [
        (32 * KIB, 64, "L1"),
        (512 * KIB, 8, "L2"),
        (64 << 20, 1, "64 MiB"),
    ] {
        let n = if size > (1 << 20) { 5 } else { 200 };
        // SAFETY: `size` bytes of `big`; a multiple of 4 KiB.
        let t = trials(n, || unsafe { loads(ptr, size / KIB, passes) });
        let bytes = (size * passes) as f64;
        push(
            format!("tileloadd stream over {label} ({} KiB)", size / KIB),
            "GB/s",
            (bytes / t.0 / 1e9, bytes / t.1 / 1e9),
        );
    }

    // The 2 x 2 shape with operands from each level: activations `a`,
    // weights `b`, streaming (1 KiB a block) or not (stride 0).
    let blocks = 128;
    let l2a = Stream {
        p: ptr,
        half: 128 * KIB,
        stride: KIB,
    };
    // SAFETY: offsets stay inside `big` (64 MiB).
    let l2b = Stream {
        p: unsafe { ptr.add(256 * KIB) },
        half: 128 * KIB,
        stride: KIB,
    };
    let mem_blocks = 8 * KIB;
    let memb = Stream {
        // SAFETY: as above.
        p: unsafe { ptr.add(1 << 20) },
        half: 8 << 20,
        stride: KIB,
    };
    let l1b = Stream {
        // SAFETY: as above.
        p: unsafe { ptr.add(8 * KIB) },
        half: 2 * KIB,
        stride: 0,
    };
    for (a, b, n, label) in [
        (l2a, l2b, blocks, "A and B from L2 (4 tiles/4 ops)"),
        (l1, l2b, blocks, "A in L1, B from L2 (2 tiles/4 ops)"),
        (l2a, l1b, blocks, "A from L2, B in L1 (2 tiles/4 ops)"),
        (l1, memb, mem_blocks, "A in L1, B streaming 16 MiB"),
    ] {
        let reps = if n > blocks { 3 } else { 20 };
        // SAFETY: each stream stays inside `big`: `half + n * stride + 1
        // KiB` bytes from its start.
        let t = trials(200 / reps.max(1) * 3, || {
            for _ in 0..reps {
                unsafe { dots(a, b, n) }
            }
        });
        push(
            format!("tdpbf16ps, 2x2, {label}"),
            "ns/op",
            per_op(t, 4 * n * reps),
        );
    }
    // SAFETY: loaded above.
    unsafe { release() };

    // Packing a token tile of 256 rows of E = 2560 (the bench's geometry).
    let (rows, e) = (256, 2560);
    let x: Vec<f32> = (0..rows * e)
        .map(|i| {
            f32::from_bits(((i as u32).wrapping_mul(2_654_435_761) >> 16 & 0x3FFF | 0x3C00) << 16)
        })
        .collect();
    let mut pairs = Vec::new();
    let t = trials(100, || pack_activations(&x, rows, e, (0, e), &mut pairs));
    push(
        format!("pack activations, {rows} x {e}, all threads"),
        "us",
        (t.0 * 1e6, t.1 * 1e6),
    );
    out
}
