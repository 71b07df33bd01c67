//! metrale-numpy-rng: numpy's default random stream, reproduced exactly.
//!
//! Some hashed-embedding models (DeepSeek's Engram among them) derive their
//! per-layer hash multipliers with
//! `numpy.random.default_rng(seed).integers(0, half, size=n, dtype=np.int64)`.
//! To rebuild those constants without Python, this crate re-implements the
//! three pieces involved so that every output matches numpy bit for bit:
//!
//! - [`SeedSequence`]: numpy's entropy pool (four 32-bit words mixed with
//!   its multiply-xorshift hash) and its `generate_state` expansion;
//! - [`Pcg64`]: the PCG XSL-RR 128/64 bit generator behind `np.random.PCG64`,
//!   including the half-word buffering of its 32-bit output;
//! - [`Generator`]: `Generator.integers(low, high, size, dtype=np.int64)`
//!   with `endpoint=False`, i.e. Lemire's nearly-divisionless bounded
//!   sampling on 32 or 64 bits depending on the width of the range.
//!
//! [`default_rng`] ties them together the way `np.random.default_rng(seed)`
//! does for a non-negative integer seed.
//!
//! Invariants: nothing here allocates global state or reads the clock; a
//! generator's output depends only on its seed and on the calls made on it,
//! in order. Only numpy's current algorithms are reproduced (numpy 1.18.4 and
//! later; earlier releases returned zeros for a range of exactly `2^32`).

mod generator;
mod pcg64;
mod seed_sequence;

pub use generator::{Generator, NumpyRngError};
pub use pcg64::Pcg64;
pub use seed_sequence::SeedSequence;

/// The generator `numpy.random.default_rng(seed)` returns for a
/// non-negative integer `seed`: [`Pcg64`] seeded through a [`SeedSequence`]
/// built from `seed`, with an empty spawn key.
pub fn default_rng(seed: u64) -> Generator {
    Generator::new(Pcg64::new(seed))
}
