//! splitmix64: the one definition of the mixer and of the stream stepped
//! by its increment, for every crate of the workspace.
//!
//! The id hash derives its constants with [`splitmix64`] (docs/SPEC.md §4
//! (Constant derivation); `metrale_model_layers::layers::ple::ids`
//! re-exports it from here), the remote tier shards rows by it, and the
//! synthetic workloads, fault schedules, synthetic checkpoints and tests
//! draw from [`SplitMix64`]. It lives in this crate, the lowest one that
//! needs it, so that every crate above reaches the same code.
//!
//! Invariant: [`SplitMix64::next_u64`] returns `splitmix64(state)` and
//! then steps the state by [`SPLITMIX64_GAMMA`], so a stream seeded with 0
//! gives the published splitmix64 sequence (a test checks its first
//! outputs); any change here changes every id and every seeded stream.

/// The splitmix64 increment (the 64-bit golden ratio).
pub const SPLITMIX64_GAMMA: u64 = 0x9E37_79B9_7F4A_7C15;

/// The splitmix64 finaliser alone (no increment): a bijection of `u64`
/// that spreads every input bit over the output.
pub fn mix64(z: u64) -> u64 {
    let z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    let z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// One step of splitmix64 as docs/SPEC.md §4 (Constant derivation)
/// defines it: add the increment, then finalise (all wrapping).
pub fn splitmix64(v: u64) -> u64 {
    mix64(v.wrapping_add(SPLITMIX64_GAMMA))
}

/// A splitmix64 stream: tiny, fast and the same on every platform, so a
/// seeded run repeats.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SplitMix64(pub u64);

impl SplitMix64 {
    /// The next 64 bits of the stream whose state is `state`, stepping it:
    /// for callers that keep a bare `u64` state.
    pub fn step(state: &mut u64) -> u64 {
        let z = splitmix64(*state);
        *state = state.wrapping_add(SPLITMIX64_GAMMA);
        z
    }

    /// The next 64 bits.
    pub fn next_u64(&mut self) -> u64 {
        Self::step(&mut self.0)
    }

    /// Uniform-ish in `0..n` by the remainder (`n` of 0 counts as 1).
    pub fn below(&mut self, n: usize) -> usize {
        (self.next_u64() % n.max(1) as u64) as usize
    }

    /// True with probability `p` percent (by the remainder).
    pub fn pct(&mut self, p: u64) -> bool {
        self.next_u64() % 100 < p
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn is_the_published_splitmix64_stream() {
        // The published first outputs of splitmix64 seeded with 0.
        let mut r = SplitMix64(0);
        assert_eq!(r.next_u64(), 0xE220_A839_7B1D_CDAF);
        assert_eq!(r.next_u64(), 0x6E78_9E6A_A1B9_65F4);
        let mut s = 0u64;
        assert_eq!(SplitMix64::step(&mut s), 0xE220_A839_7B1D_CDAF);
        assert_eq!(s, SPLITMIX64_GAMMA);
        assert_eq!(splitmix64(0), mix64(SPLITMIX64_GAMMA));
    }
}
