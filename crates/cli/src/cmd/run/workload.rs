//! The workload of `metrale-ple run`, decided before anything runs:
//! Zipf-distributed tokens, the synthetic multi-turn sequences over shared
//! system prompts, prompts followed by generated tokens, and the highway row
//! fed in for a token (a function of the token alone, so of the prefix, as
//! the prefix cache requires).

use metrale_engine::server::{Phase, Request};

use super::RunArgs;
use crate::cmd::common::splitmix;

/// Zipf-distributed token ids over the vocabulary, never EOS.
pub(super) struct Zipf {
    cdf: Vec<f64>,
    vocab: u64,
    eos: u32,
}

impl Zipf {
    pub(super) fn new(vocab: u64, eos: u32, s: f64) -> Zipf {
        let mut cdf = Vec::with_capacity(vocab as usize);
        let mut acc = 0.0;
        for r in 1..=vocab {
            acc += (r as f64).powf(-s);
            cdf.push(acc);
        }
        for c in &mut cdf {
            *c /= acc;
        }
        Zipf { cdf, vocab, eos }
    }

    pub(super) fn sample(&self, state: &mut u64) -> u32 {
        let u = (splitmix(state) >> 11) as f64 / (1u64 << 53) as f64;
        let rank = self.cdf.partition_point(|&c| c < u) as u64;
        // Scatter ranks over the vocabulary so frequent tokens are not all
        // small ids.
        let t = (rank.wrapping_mul(0x9E37_79B1) % self.vocab) as u32;
        if t == self.eos {
            ((t as u64 + 1) % self.vocab) as u32
        } else {
            t
        }
    }
}

fn between(state: &mut u64, lo: usize, hi: usize) -> usize {
    lo + (splitmix(state) % (hi - lo + 1) as u64) as usize
}

/// The synthetic workload: shared system prompts, multi-turn sequences.
pub(super) fn synthetic(a: &RunArgs, vocab: u64, eos: u32) -> Vec<Request> {
    let zipf = Zipf::new(vocab, eos, a.zipf);
    let mut st = a.seed ^ 0x005E_ED0F_7E57;
    let systems: Vec<Vec<u32>> = (0..a.system_prompts.max(1))
        .map(|_| {
            let n = between(&mut st, 192, 320);
            (0..n).map(|_| zipf.sample(&mut st)).collect()
        })
        .collect();
    (0..a.sequences)
        .map(|_| {
            let mut tokens = systems[between(&mut st, 0, systems.len() - 1)].clone();
            let mut segments = Vec::new();
            let turns = between(&mut st, 1, a.turns.max(1));
            for turn in 0..turns {
                if turn > 0 {
                    tokens.push(eos);
                }
                let user = between(&mut st, 16, 128);
                tokens.extend((0..user).map(|_| zipf.sample(&mut st)));
                segments.push((Phase::Prefill, tokens.len()));
                let generated = between(&mut st, a.decode_tokens.min(16), a.decode_tokens);
                if generated > 0 {
                    tokens.extend((0..generated).map(|_| zipf.sample(&mut st)));
                    segments.push((Phase::Decode, tokens.len()));
                }
            }
            Request { tokens, segments }
        })
        .collect()
}

/// A prompt followed by `decode` generated tokens.
pub(super) fn from_prompt(prompt: Vec<u32>, decode: usize, zipf: &Zipf, st: &mut u64) -> Request {
    let mut tokens = prompt;
    let mut segments = vec![(Phase::Prefill, tokens.len())];
    if decode > 0 {
        tokens.extend((0..decode).map(|_| zipf.sample(st)));
        segments.push((Phase::Decode, tokens.len()));
    }
    Request { tokens, segments }
}

/// The input highway row of `token`: a hashed pseudo-embedding in [-1, 1).
pub(super) fn embed(token: u32, out: &mut [f32]) {
    let mut s = 0xE3B0_C442_98FC_1C14 ^ (token as u64).wrapping_mul(0xD6E8_FEB8_6659_FD93);
    for v in out {
        *v = ((splitmix(&mut s) >> 40) as f32 / (1u64 << 23) as f32) - 1.0;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn zipf_never_draws_eos_and_favours_low_ranks() {
        let z = Zipf::new(64, 5, 1.1);
        let mut st = 3;
        let mut counts = [0u32; 64];
        for _ in 0..20_000 {
            let t = z.sample(&mut st);
            assert_ne!(t, 5);
            counts[t as usize] += 1;
        }
        // The most frequent rank maps to token 0, the next to
        // 0x9E3779B1 % 64 = 49.
        let top = (0..64).max_by_key(|&i| counts[i]).unwrap();
        assert_eq!(top, 0);
        assert!(counts[49] > counts[10] && counts[0] > 2 * counts[49] / 3);
    }
}
