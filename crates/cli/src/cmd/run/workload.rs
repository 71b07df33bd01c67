//! The workload of `metrale-ple run`, decided before anything runs:
//! Zipf-distributed tokens, the synthetic multi-turn sequences over shared
//! system prompts, prompts followed by generated tokens, and the highway row
//! fed in for a token (a function of the token alone, so of the prefix, as
//! the prefix cache requires).

use metrale_engine::server::{Phase, Request};
use metrale_storage::splitmix::SplitMix64;

use super::RunArgs;
use crate::cmd::common::Zipf;

fn between(state: &mut u64, lo: usize, hi: usize) -> usize {
    lo + (SplitMix64::step(state) % (hi - lo + 1) as u64) as usize
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
        *v = ((SplitMix64::step(&mut s) >> 40) as f32 / (1u64 << 23) as f32) - 1.0;
    }
}
