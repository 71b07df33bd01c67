//! Run-time choice of the CPU code path.
//!
//! Every kernel has a portable path and, on x86-64 CPUs with AVX2 and FMA, a
//! vector path; on CPUs that also have AVX-512 BF16, the projection runs its
//! BF16 pair dot products (`vdpbf16ps`) and every other kernel the AVX2
//! path. All compute every output with the same operations in the same
//! order (the projection adds one exact BF16 product at a time, `e`
//! ascending, each rounded once, as a fused multiply-add does), so the
//! choice changes speed only, never a bit of any result; tests check that on
//! every path the CPU has. One caveat: `vdpbf16ps` treats subnormal inputs
//! and results as zero, so the BF16 path could differ where a weight or
//! activation below 2^-126 (or a partial sum that small) occurs; the
//! projection takes that path only for activations that are exact BF16
//! values, and real weights and rows are many orders of magnitude larger.
//!
//! On the AVX-512 BF16 path the projection multiplies with whichever of two
//! instructions this CPU runs faster, measured once per process
//! ([`avx512_projection`]): `vdpbf16ps` (one instruction, 32 BF16 products)
//! or `vfmadd231ps` on 16 f32 lanes over weights widened from BF16 (exact).
//! Both add the same exact products in the same order with one rounding
//! each, so the pick changes speed only; on Sapphire Rapids the f32 FMA
//! does twice the products per second, and it has no subnormal caveat.
//! [`mul_add_rate`] is that measurement, also used by benches for the
//! peak of an instruction.
//!
//! On CPUs with AMX-BF16, where Linux grants the process the tile data
//! state ([`amx_ready`]: CPUID, then `arch_prctl(ARCH_REQ_XCOMP_PERM)` once
//! per process), [`CpuPath::Amx`] is the default: the projection runs
//! `tdpbf16ps` tiles, every other kernel the AVX2 path. Its projection is
//! a bit class of its own (see `gemm`), the one exception to "same bits on
//! every path"; `METRALE_CPU_PATH=avx512bf16` keeps such a CPU in the
//! common class.

use std::sync::OnceLock;

/// A CPU code path.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum CpuPath {
    /// Plain Rust for any CPU.
    Portable,
    /// x86-64 AVX2 + FMA intrinsics.
    Avx2Fma,
    /// x86-64 AVX2 + FMA, and AVX-512 BF16 dot products for the projection.
    Avx512Bf16,
    /// x86-64 AVX2 + FMA, and AMX-BF16 tiles (`tdpbf16ps`) for the
    /// projection: its own bit class (see the module docs).
    Amx,
}

impl CpuPath {
    /// Whether this CPU can run `self`.
    pub fn available(self) -> bool {
        match self {
            CpuPath::Portable => true,
            CpuPath::Avx2Fma => avx2_fma_detected(),
            CpuPath::Avx512Bf16 => avx2_fma_detected() && avx512_bf16_detected(),
            CpuPath::Amx => avx2_fma_detected() && avx512_bf16_detected() && amx_ready(),
        }
    }

    /// Every path this CPU can run, portable first.
    pub fn all_available() -> Vec<CpuPath> {
        [
            CpuPath::Portable,
            CpuPath::Avx2Fma,
            CpuPath::Avx512Bf16,
            CpuPath::Amx,
        ]
        .into_iter()
        .filter(|p| p.available())
        .collect()
    }
}

#[cfg(target_arch = "x86_64")]
fn avx2_fma_detected() -> bool {
    std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma")
}

#[cfg(not(target_arch = "x86_64"))]
fn avx2_fma_detected() -> bool {
    false
}

#[cfg(target_arch = "x86_64")]
fn avx512_bf16_detected() -> bool {
    std::arch::is_x86_feature_detected!("avx512f")
        && std::arch::is_x86_feature_detected!("avx512bf16")
}

#[cfg(not(target_arch = "x86_64"))]
fn avx512_bf16_detected() -> bool {
    false
}

/// Whether this process may run AMX-BF16 tile instructions: the CPU has
/// them (CPUID leaf 7: AMX-TILE, AMX-BF16) and Linux granted the tile data
/// state (`arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)`, asked once
/// per process; a kernel without AMX support refuses it). Never assumed
/// from the CPU alone: without the permission the first tile load faults.
pub fn amx_ready() -> bool {
    static READY: OnceLock<bool> = OnceLock::new();
    *READY.get_or_init(|| amx_detected() && amx_permission())
}

#[cfg(target_arch = "x86_64")]
fn amx_detected() -> bool {
    // CPUID exists on every x86-64 CPU, so these calls are safe.
    let max = std::arch::x86_64::__cpuid(0).eax;
    if max < 7 {
        return false;
    }
    let edx = std::arch::x86_64::__cpuid_count(7, 0).edx;
    // EDX bit 22: AMX-BF16, bit 24: AMX-TILE.
    edx & (1 << 22) != 0 && edx & (1 << 24) != 0
}

#[cfg(not(target_arch = "x86_64"))]
fn amx_detected() -> bool {
    false
}

#[cfg(all(target_arch = "x86_64", target_os = "linux"))]
fn amx_permission() -> bool {
    const ARCH_REQ_XCOMP_PERM: libc::c_long = 0x1023;
    const XFEATURE_XTILEDATA: libc::c_long = 18;
    // SAFETY: arch_prctl with this request only reads its integer argument
    // and changes this process's permitted XSAVE features; it touches no
    // memory of ours.
    let r = unsafe {
        libc::syscall(
            libc::SYS_arch_prctl,
            ARCH_REQ_XCOMP_PERM,
            XFEATURE_XTILEDATA,
        )
    };
    r == 0
}

#[cfg(not(all(target_arch = "x86_64", target_os = "linux")))]
fn amx_permission() -> bool {
    false
}

/// The fastest path this CPU runs, detected once per process.
/// `METRALE_CPU_PATH=portable|avx2|avx512bf16|amx` picks another instead
/// (for comparisons); a path this CPU lacks, or an unknown name, is ignored.
pub fn best_path() -> CpuPath {
    static BEST: OnceLock<CpuPath> = OnceLock::new();
    *BEST.get_or_init(|| {
        let forced = match std::env::var("METRALE_CPU_PATH").as_deref() {
            Ok("portable") => Some(CpuPath::Portable),
            Ok("avx2") => Some(CpuPath::Avx2Fma),
            Ok("avx512bf16") => Some(CpuPath::Avx512Bf16),
            Ok("amx") => Some(CpuPath::Amx),
            _ => None,
        };
        if let Some(p) = forced.filter(|p| p.available()) {
            return p;
        }
        if CpuPath::Amx.available() {
            CpuPath::Amx
        } else if CpuPath::Avx512Bf16.available() {
            CpuPath::Avx512Bf16
        } else if CpuPath::Avx2Fma.available() {
            CpuPath::Avx2Fma
        } else {
            CpuPath::Portable
        }
    })
}

/// The multiply instruction of the projection on the AVX-512 BF16 path.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Avx512Projection {
    /// `vfmadd231ps` over 16 f32 lanes, weights widened from BF16.
    Fma,
    /// `vdpbf16ps` over BF16 pairs (needs BF16-exact activations).
    Dot,
}

/// The faster instruction for the projection on this CPU, measured once per
/// process (a few milliseconds); `METRALE_AVX512_PROJECTION=fma|dot`
/// forces one. Only meaningful where [`CpuPath::Avx512Bf16`] is available.
pub fn avx512_projection() -> Avx512Projection {
    static PICK: OnceLock<Avx512Projection> = OnceLock::new();
    *PICK.get_or_init(|| {
        match std::env::var("METRALE_AVX512_PROJECTION").as_deref() {
            Ok("fma") => return Avx512Projection::Fma,
            Ok("dot") => return Avx512Projection::Dot,
            _ => {}
        }
        // Products per second, best of a few short runs each (a shared
        // machine can preempt any one of them).
        let best = |l: MulAddLoop| {
            (0..5)
                .filter_map(|_| mul_add_rate(l, 200_000))
                .fold(0.0f64, f64::max)
                * l.products() as f64
        };
        if best(MulAddLoop::Dot512) > best(MulAddLoop::Fma512) {
            Avx512Projection::Dot
        } else {
            Avx512Projection::Fma
        }
    })
}

/// A tight loop of one vector multiply-add instruction on independent
/// accumulators, the peak of that instruction on one core.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum MulAddLoop {
    /// `vfmadd231ps` on 8 f32 lanes (AVX2 + FMA).
    Fma256,
    /// `vfmadd231ps` on 16 f32 lanes (AVX-512F).
    Fma512,
    /// `vdpbf16ps` on 32 BF16 pairs (AVX-512 BF16).
    Dot512,
    /// `tdpbf16ps` on 16 x 16 f32 sums of 16 BF16 pairs each (AMX-BF16).
    Amx,
}

impl MulAddLoop {
    /// Multiply-adds (products) per instruction; a FLOP count is twice it.
    pub fn products(self) -> usize {
        match self {
            MulAddLoop::Fma256 => 8,
            MulAddLoop::Fma512 => 16,
            MulAddLoop::Dot512 => 32,
            MulAddLoop::Amx => 16 * 16 * 32,
        }
    }

    /// Whether this CPU runs the instruction.
    pub fn available(self) -> bool {
        match self {
            MulAddLoop::Fma256 => avx2_fma_detected(),
            MulAddLoop::Fma512 => avx512f_detected(),
            MulAddLoop::Dot512 => avx512_bf16_detected(),
            MulAddLoop::Amx => amx_ready(),
        }
    }
}

#[cfg(target_arch = "x86_64")]
fn avx512f_detected() -> bool {
    std::arch::is_x86_feature_detected!("avx512f")
}

#[cfg(not(target_arch = "x86_64"))]
fn avx512f_detected() -> bool {
    false
}

/// Instructions per second of `iters` rounds of [`MulAddLoop`] `l` (12
/// independent accumulators a round, more than latency times throughput on
/// current cores) on the calling thread; `None` where the CPU lacks it.
pub fn mul_add_rate(l: MulAddLoop, iters: usize) -> Option<f64> {
    if !l.available() {
        return None;
    }
    let t0 = std::time::Instant::now();
    #[cfg(target_arch = "x86_64")]
    // SAFETY: `available` checked the instruction set above.
    let r = unsafe {
        match l {
            MulAddLoop::Fma256 => peak::fma256(iters),
            MulAddLoop::Fma512 => peak::fma512(iters),
            MulAddLoop::Dot512 => peak::dot512(iters),
            MulAddLoop::Amx => super::gemm::amx_peak(iters),
        }
    };
    #[cfg(not(target_arch = "x86_64"))]
    let r = 0.0f32;
    std::hint::black_box(r);
    let s = t0.elapsed().as_secs_f64();
    (s > 0.0).then(|| (iters * peak::CHAINS) as f64 / s)
}

mod peak {
    //! The peak loops: `CHAINS` independent accumulators, inputs hidden
    //! from the optimiser so no instruction is folded away.

    /// Accumulators a round.
    pub(super) const CHAINS: usize = 12;

    #[cfg(target_arch = "x86_64")]
    use std::arch::x86_64::*;

    /// # Safety
    /// The CPU must support AVX2 and FMA.
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn fma256(iters: usize) -> f32 {
        let a = _mm256_set1_ps(std::hint::black_box(1.0));
        let b = _mm256_set1_ps(std::hint::black_box(1e-9));
        let mut c = [_mm256_setzero_ps(); CHAINS];
        for _ in 0..iters {
            for ci in c.iter_mut() {
                *ci = _mm256_fmadd_ps(a, b, *ci);
            }
        }
        let mut s = _mm256_setzero_ps();
        for ci in c {
            s = _mm256_add_ps(s, ci);
        }
        _mm256_cvtss_f32(s)
    }

    /// # Safety
    /// The CPU must support AVX-512F.
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn fma512(iters: usize) -> f32 {
        let a = _mm512_set1_ps(std::hint::black_box(1.0));
        let b = _mm512_set1_ps(std::hint::black_box(1e-9));
        let mut c = [_mm512_setzero_ps(); CHAINS];
        for _ in 0..iters {
            for ci in c.iter_mut() {
                *ci = _mm512_fmadd_ps(a, b, *ci);
            }
        }
        let mut s = _mm512_setzero_ps();
        for ci in c {
            s = _mm512_add_ps(s, ci);
        }
        _mm512_reduce_add_ps(s)
    }

    /// # Safety
    /// The CPU must support AVX-512F and AVX-512 BF16.
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx512f,avx512bf16")]
    pub(super) unsafe fn dot512(iters: usize) -> f32 {
        // SAFETY: 512 bits are valid BF16 pairs whatever the pattern.
        let (a, b): (__m512bh, __m512bh) = unsafe {
            (
                std::mem::transmute::<__m512i, __m512bh>(_mm512_set1_epi32(std::hint::black_box(
                    0x3F81_3F93,
                ))),
                std::mem::transmute::<__m512i, __m512bh>(_mm512_set1_epi32(std::hint::black_box(
                    0x3001_B073,
                ))),
            )
        };
        let mut c = [_mm512_setzero_ps(); CHAINS];
        for _ in 0..iters {
            for ci in c.iter_mut() {
                *ci = _mm512_dpbf16_ps(*ci, a, b);
            }
        }
        let mut s = _mm512_setzero_ps();
        for ci in c {
            s = _mm512_add_ps(s, ci);
        }
        _mm512_reduce_add_ps(s)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn best_path_is_available_and_listed() {
        let best = best_path();
        assert!(best.available());
        assert!(CpuPath::all_available().contains(&best));
        assert_eq!(CpuPath::all_available()[0], CpuPath::Portable);
    }
}
