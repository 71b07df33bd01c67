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
}

impl CpuPath {
    /// Whether this CPU can run `self`.
    pub fn available(self) -> bool {
        match self {
            CpuPath::Portable => true,
            CpuPath::Avx2Fma => avx2_fma_detected(),
            CpuPath::Avx512Bf16 => avx2_fma_detected() && avx512_bf16_detected(),
        }
    }

    /// Every path this CPU can run, portable first.
    pub fn all_available() -> Vec<CpuPath> {
        [CpuPath::Portable, CpuPath::Avx2Fma, CpuPath::Avx512Bf16]
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

/// The fastest path this CPU runs, detected once per process.
/// `METRALE_CPU_PATH=portable|avx2|avx512bf16` picks a slower one instead
/// (for comparisons); a path this CPU lacks, or an unknown name, is ignored.
pub fn best_path() -> CpuPath {
    static BEST: OnceLock<CpuPath> = OnceLock::new();
    *BEST.get_or_init(|| {
        let forced = match std::env::var("METRALE_CPU_PATH").as_deref() {
            Ok("portable") => Some(CpuPath::Portable),
            Ok("avx2") => Some(CpuPath::Avx2Fma),
            Ok("avx512bf16") => Some(CpuPath::Avx512Bf16),
            _ => None,
        };
        if let Some(p) = forced.filter(|p| p.available()) {
            return p;
        }
        if CpuPath::Avx512Bf16.available() {
            CpuPath::Avx512Bf16
        } else if CpuPath::Avx2Fma.available() {
            CpuPath::Avx2Fma
        } else {
            CpuPath::Portable
        }
    })
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
