//! The PLE n-gram id hash (SPEC.md section 3).
//!
//! Placeholder with the straightforward `%` form; the derivation, the fast
//! path and the batched form land with the ids work.

/// The hash geometry and constants of one PLE site.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PleIdDims {
    /// N: the largest n-gram order (orders 2..=N are hashed).
    pub ngram_size: usize,
    /// K: heads per order.
    pub heads_per_ngram: usize,
    /// One odd multiplier per position `0..N`.
    pub multipliers: Vec<u64>,
    /// One modulus (a prime) per head.
    pub head_vocab_sizes: Vec<u64>,
    /// Running sums of `head_vocab_sizes`.
    pub head_offsets: Vec<u64>,
    /// The EOS token that starts every sequence and ends segments.
    pub eos_token_id: u32,
}

impl PleIdDims {
    /// `(N - 1) * K`.
    pub fn ngram_heads(&self) -> usize {
        self.ngram_size.saturating_sub(1) * self.heads_per_ngram
    }
    /// `N - 1`: tokens of history carried per sequence.
    pub fn context_len(&self) -> usize {
        self.ngram_size.saturating_sub(1)
    }
}

/// The ids of the n-grams ending at each token of `tokens` (history first),
/// one row of `ngram_heads` ids per token.
pub fn ple_ngram_ids(dims: &PleIdDims, tokens: &[u32]) -> Vec<Vec<u64>> {
    let n = dims.ngram_size;
    let k = dims.heads_per_ngram;
    let eos = dims.eos_token_id;
    let mut out = Vec::with_capacity(tokens.len());
    let mut seg_start = 0usize;
    for i in 0..tokens.len() {
        if i > 0 && tokens[i - 1] == eos {
            seg_start = i;
        }
        let mut row = Vec::with_capacity(dims.ngram_heads());
        let mut mixed = 0u64;
        for p in 0..n {
            let t = if i >= p && i - p >= seg_start {
                tokens[i - p]
            } else {
                eos
            };
            mixed ^= (t as u64).wrapping_mul(dims.multipliers[p]);
            if p >= 1 {
                let order = p + 1;
                for h in (order - 2) * k..(order - 1) * k {
                    row.push(mixed % dims.head_vocab_sizes[h] + dims.head_offsets[h]);
                }
            }
        }
        out.push(row);
    }
    out
}
