//! A small deterministic generator, so failures replay.
//!
//! Invariant: the stream is the workspace's one splitmix64 stream
//! (`metrale_storage::splitmix`); nothing here re-derives the mixing or
//! the stepping.

use metrale_storage::splitmix::SplitMix64;

/// A splitmix64 stream.
#[derive(Clone, Debug)]
pub struct Rng(pub u64);

impl Rng {
    /// The next 64 random bits.
    #[allow(clippy::should_implement_trait)]
    pub fn next(&mut self) -> u64 {
        SplitMix64::step(&mut self.0)
    }

    /// Uniform in `0..n` (`n` of 0 counts as 1).
    pub fn below(&mut self, n: usize) -> usize {
        (self.next() % n.max(1) as u64) as usize
    }

    /// True with probability `p` percent.
    pub fn pct(&mut self, p: u64) -> bool {
        self.next() % 100 < p
    }

    /// Uniform in `[-1, 1)`, 24 bits.
    pub fn unit(&mut self) -> f32 {
        ((self.next() >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn is_the_standard_splitmix64_stream() {
        // The published first outputs of splitmix64 seeded with 0.
        let mut r = Rng(0);
        assert_eq!(r.next(), 0xE220_A839_7B1D_CDAF);
        assert_eq!(r.next(), 0x6E78_9E6A_A1B9_65F4);
    }
}
