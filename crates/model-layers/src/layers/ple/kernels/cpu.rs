//! Run-time choice of the CPU code path.
//!
//! Every kernel has a portable path and, on x86-64 CPUs with AVX2 and FMA, a
//! vector path. Both compute every output with the same operations in the
//! same order (the projection uses fused multiply-adds on both paths), so the
//! choice changes speed only, never a bit of any result; tests check that.

use std::sync::OnceLock;

/// A CPU code path.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum CpuPath {
    /// Plain Rust for any CPU.
    Portable,
    /// x86-64 AVX2 + FMA intrinsics.
    Avx2Fma,
}

impl CpuPath {
    /// Whether this CPU can run `self`.
    pub fn available(self) -> bool {
        match self {
            CpuPath::Portable => true,
            CpuPath::Avx2Fma => avx2_fma_detected(),
        }
    }

    /// Every path this CPU can run, portable first.
    pub fn all_available() -> Vec<CpuPath> {
        [CpuPath::Portable, CpuPath::Avx2Fma]
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

/// The fastest path this CPU runs, detected once per process.
pub fn best_path() -> CpuPath {
    static BEST: OnceLock<CpuPath> = OnceLock::new();
    *BEST.get_or_init(|| {
        if CpuPath::Avx2Fma.available() {
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
