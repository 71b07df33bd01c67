//! numpy's `PCG64` bit generator: PCG XSL-RR 128/64.
//!
//! State is a 128-bit linear congruential generator `s <- s * M + inc`
//! (with `inc` odd); each 64-bit output first steps the state, then xors its
//! two halves and rotates right by the top six bits of the state.
//!
//! Seeding follows `np.random.PCG64(seed)`: four 64-bit words from
//! [`SeedSequence::generate_state_u64`]; words 0 and 1 form the initial state
//! value and words 2 and 3 the stream selector (first word = high half), fed
//! through PCG's standard `srandom` procedure.
//!
//! 32-bit output is numpy's buffered scheme: one 64-bit draw serves two
//! 32-bit requests, low half first. The buffered half lives in the
//! generator, so it carries over between calls, and a 64-bit draw does not
//! consume or clear it.

use crate::seed_sequence::SeedSequence;

/// PCG's default 128-bit LCG multiplier.
const MULTIPLIER: u128 = 0x2360_ed05_1fc6_5da4_4385_df64_9fcc_f645;

/// numpy's `np.random.PCG64` state (LCG state, increment, buffered half).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Pcg64 {
    state: u128,
    inc: u128,
    buffered: Option<u32>,
}

impl Pcg64 {
    /// `np.random.PCG64(seed)` for a non-negative integer seed.
    pub fn new(seed: u64) -> Self {
        Self::from_seed_sequence(&SeedSequence::new(seed))
    }

    /// `np.random.PCG64(seed_sequence)`.
    pub fn from_seed_sequence(seq: &SeedSequence) -> Self {
        let w = seq.generate_state_u64(4);
        Self::from_seed_words([w[0], w[1], w[2], w[3]])
    }

    /// Seeds from four words as numpy's `PCG64` reads them from its seed
    /// sequence: `(words[0] << 64) | words[1]` is the initial state value and
    /// `(words[2] << 64) | words[3]` the stream selector.
    pub fn from_seed_words(words: [u64; 4]) -> Self {
        let init_state = (u128::from(words[0]) << 64) | u128::from(words[1]);
        let stream = (u128::from(words[2]) << 64) | u128::from(words[3]);
        let mut rng = Self {
            state: 0,
            inc: (stream << 1) | 1,
            buffered: None,
        };
        rng.step();
        rng.state = rng.state.wrapping_add(init_state);
        rng.step();
        rng
    }

    fn step(&mut self) {
        self.state = self.state.wrapping_mul(MULTIPLIER).wrapping_add(self.inc);
    }

    /// The next 64-bit output (numpy's `random_raw`). Leaves any buffered
    /// 32-bit half untouched.
    pub fn next_u64(&mut self) -> u64 {
        self.step();
        // Truncations select the two halves of the state.
        let hi = (self.state >> 64) as u64;
        let lo = self.state as u64;
        let rot = (hi >> 58) as u32;
        (hi ^ lo).rotate_right(rot)
    }

    /// The next 32-bit output: the high half of the previous 64-bit draw
    /// made for 32 bits if one is buffered, else the low half of a fresh
    /// draw (buffering its high half).
    pub fn next_u32(&mut self) -> u32 {
        if let Some(v) = self.buffered.take() {
            return v;
        }
        let x = self.next_u64();
        self.buffered = Some((x >> 32) as u32);
        x as u32
    }

    /// Jumps the LCG ahead by `delta` steps (modulo `2^128`) in
    /// `O(log delta)`, as `PCG64.advance(delta)` does; like numpy, this also
    /// drops a buffered 32-bit half.
    pub fn advance(&mut self, delta: u128) -> &mut Self {
        // Square-and-multiply on the affine map s -> s * M + inc.
        let (mut acc_mul, mut acc_add) = (1u128, 0u128);
        let (mut cur_mul, mut cur_add) = (MULTIPLIER, self.inc);
        let mut d = delta;
        while d > 0 {
            if d & 1 == 1 {
                acc_mul = acc_mul.wrapping_mul(cur_mul);
                acc_add = acc_add.wrapping_mul(cur_mul).wrapping_add(cur_add);
            }
            cur_add = cur_mul.wrapping_add(1).wrapping_mul(cur_add);
            cur_mul = cur_mul.wrapping_mul(cur_mul);
            d >>= 1;
        }
        self.state = acc_mul.wrapping_mul(self.state).wrapping_add(acc_add);
        self.buffered = None;
        self
    }
}
