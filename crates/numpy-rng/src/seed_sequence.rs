//! numpy's `SeedSequence`: turns integer entropy into generator seed words.
//!
//! The entropy (a non-negative integer, split into little-endian 32-bit
//! words) is folded into a pool of four 32-bit words with a multiply-xorshift
//! hash whose multiplier is itself advanced after every use; the pool words
//! are then cross-mixed so that every entropy word reaches every pool word.
//! `generate_state` runs a second, independently keyed hash over the pool,
//! cycling through it, to produce as many output words as requested.
//!
//! Only the default configuration numpy uses for `default_rng(int)` is
//! supported: a pool of four words and an empty spawn key. All arithmetic is
//! on `u32` modulo `2^32`, as in numpy.

/// Number of 32-bit words in the entropy pool (numpy's default).
const POOL_SIZE: usize = 4;

/// Initial multiplier of the pool hash.
const INIT_A: u32 = 0x43b0_d7e5;
/// Step applied to the pool hash multiplier after each use.
const MULT_A: u32 = 0x931e_8875;
/// Initial multiplier of the output hash in `generate_state`.
const INIT_B: u32 = 0x8b51_f9dd;
/// Step applied to the output hash multiplier after each use.
const MULT_B: u32 = 0x58f3_8ded;
/// Left coefficient of the two-word mix.
const MIX_MULT_L: u32 = 0xca01_f9dd;
/// Right coefficient of the two-word mix.
const MIX_MULT_R: u32 = 0x4973_f715;
/// Shift of the xorshift step (half a word).
const XSHIFT: u32 = 16;

/// The pool hash: xor with the running multiplier, advance the multiplier,
/// multiply by it, then fold the high half into the low half.
fn hash_word(value: u32, multiplier: &mut u32) -> u32 {
    let mut v = value ^ *multiplier;
    *multiplier = multiplier.wrapping_mul(MULT_A);
    v = v.wrapping_mul(*multiplier);
    v ^ (v >> XSHIFT)
}

/// Combines a pool word with a hashed word (a difference of two products,
/// then a fold).
fn combine(x: u32, y: u32) -> u32 {
    let r = MIX_MULT_L
        .wrapping_mul(x)
        .wrapping_sub(MIX_MULT_R.wrapping_mul(y));
    r ^ (r >> XSHIFT)
}

/// numpy's `SeedSequence(entropy)` with the default pool size and no spawn
/// key. Holds only the mixed pool; it is cheap to copy.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SeedSequence {
    pool: [u32; POOL_SIZE],
}

impl SeedSequence {
    /// `SeedSequence(seed)` for a non-negative integer that fits in 64 bits.
    pub fn new(seed: u64) -> Self {
        // Truncation is the point: the low and high halves of the seed.
        let words = [seed as u32, (seed >> 32) as u32];
        Self::from_le_words(&words)
    }

    /// `SeedSequence(n)` for an arbitrary non-negative integer `n` given as
    /// little-endian 32-bit words (`n = sum(words[i] << (32 * i))`).
    ///
    /// Like numpy's integer conversion, high zero words are dropped and zero
    /// becomes the single word `[0]`, so `[5]` and `[5, 0, 0]` both mean 5.
    pub fn from_le_words(words: &[u32]) -> Self {
        let used = words.iter().rposition(|&w| w != 0).map_or(0, |i| i + 1);
        if used == 0 {
            Self::from_entropy_array(&[0])
        } else {
            Self::from_entropy_array(&words[..used])
        }
    }

    /// `SeedSequence(np.array(words, dtype=np.uint32))`: the words are used
    /// exactly as given, including any high zero words (which change the
    /// result once there are more than four words).
    pub fn from_entropy_array(words: &[u32]) -> Self {
        let mut pool = [0u32; POOL_SIZE];
        let mut multiplier = INIT_A;
        // Fill the pool with hashed entropy, hashing zeros past its end.
        for (i, slot) in pool.iter_mut().enumerate() {
            let word = words.get(i).copied().unwrap_or(0);
            *slot = hash_word(word, &mut multiplier);
        }
        // Cross-mix: every pool word is combined into every other one, in
        // source-major order, the multiplier advancing at each step.
        for src in 0..POOL_SIZE {
            for dst in 0..POOL_SIZE {
                if src != dst {
                    let h = hash_word(pool[src], &mut multiplier);
                    pool[dst] = combine(pool[dst], h);
                }
            }
        }
        // Entropy beyond the pool size is mixed into every pool word.
        for &word in words.iter().skip(POOL_SIZE) {
            for slot in pool.iter_mut() {
                let h = hash_word(word, &mut multiplier);
                *slot = combine(*slot, h);
            }
        }
        Self { pool }
    }

    /// The mixed entropy pool (numpy's `SeedSequence.pool`).
    pub fn pool(&self) -> [u32; POOL_SIZE] {
        self.pool
    }

    /// `generate_state(n_words, np.uint32)`.
    pub fn generate_state_u32(&self, n_words: usize) -> Vec<u32> {
        let mut multiplier = INIT_B;
        self.pool
            .iter()
            .cycle()
            .take(n_words)
            .map(|&word| {
                let mut v = word ^ multiplier;
                multiplier = multiplier.wrapping_mul(MULT_B);
                v = v.wrapping_mul(multiplier);
                v ^ (v >> XSHIFT)
            })
            .collect()
    }

    /// `generate_state(n_words, np.uint64)`: twice as many 32-bit words,
    /// paired little-endian (the earlier word is the low half).
    pub fn generate_state_u64(&self, n_words: usize) -> Vec<u64> {
        self.generate_state_u32(2 * n_words)
            .chunks_exact(2)
            .map(|pair| u64::from(pair[0]) | (u64::from(pair[1]) << 32))
            .collect()
    }
}
