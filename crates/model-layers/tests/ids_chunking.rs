//! Chunking and batching never change the ids: hashing a sequence in any
//! chunks, carrying the history between them, equals hashing it whole, and
//! the batched decode form equals one call per sequence.

use metrale_model_layers::layers::ple::ids::{
    PleHashParams, PleIdDims, PleIdHasher, ple_ngram_ids, ple_ngram_ids_into_plain,
};
use proptest::prelude::*;

/// A random geometry: N in 2..=6, K in 1..=9 (so the vector path's groups
/// of four and its scalar tails both occur), small, flagship-sized or any
/// 2^16..2^32 moduli, any site and seed. EOS is token 3, so the small token
/// alphabets below hit it often.
fn dims() -> impl Strategy<Value = PleIdDims> {
    (
        2usize..=6,
        prop_oneof![1usize..=3, 4usize..=9],
        prop_oneof![2u64..500, Just(20_000_000u64), (1u64 << 16)..(1u64 << 32)],
        any::<u64>(),
        0usize..4,
        prop_oneof![Just(151_936u64), 4u64..1000],
    )
        .prop_map(|(n, k, base, seed, site, vocab)| {
            PleHashParams {
                vocab_size: vocab,
                eos_token_id: 3,
                ngram_size: n,
                heads_per_ngram: k,
                ngram_vocab_size_base: base,
                divisible_by: 128,
                seed,
                site,
            }
            .derive()
            .unwrap()
            .dims
        })
}

fn tokens(max_len: usize) -> impl Strategy<Value = Vec<u32>> {
    prop::collection::vec(prop_oneof![0u32..8, Just(3u32), any::<u32>()], 0..max_len)
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    #[test]
    fn chunked_equals_whole(d in dims(), seq in tokens(40), cuts in prop::collection::vec(0usize..41, 0..6)) {
        let heads = d.ngram_heads();
        let whole: Vec<u64> = ple_ngram_ids(&d, &seq).concat();
        let hasher = PleIdHasher::new(&d).unwrap();
        let portable = PleIdHasher::new_portable(&d).unwrap();

        let mut cuts: Vec<usize> = cuts.into_iter().map(|c| c.min(seq.len())).collect();
        cuts.push(0);
        cuts.push(seq.len());
        cuts.sort_unstable();

        let mut history = vec![d.eos_token_id; d.context_len()];
        let mut fast = Vec::new();
        let mut scalar = Vec::new();
        let mut plain = Vec::new();
        for w in cuts.windows(2) {
            let chunk = &seq[w[0]..w[1]];
            let mut out = vec![0u64; chunk.len() * heads];
            hasher.ids_with_history_into(&history, chunk, &mut out).unwrap();
            fast.extend_from_slice(&out);
            portable.ids_with_history_into(&history, chunk, &mut out).unwrap();
            scalar.extend_from_slice(&out);
            ple_ngram_ids_into_plain(&d, &history, chunk, &mut out).unwrap();
            plain.extend_from_slice(&out);
            // Also the seed's own way: hash history ++ chunk, keep the tail.
            let mut window = history.clone();
            window.extend_from_slice(chunk);
            let tail: Vec<u64> = ple_ngram_ids(&d, &window)[history.len()..].concat();
            prop_assert_eq!(&tail, &out);
            d.advance_history(&mut history, chunk);
            prop_assert_eq!(history.len(), d.context_len());
        }
        prop_assert_eq!(&fast, &whole);
        prop_assert_eq!(&scalar, &whole);
        prop_assert_eq!(&plain, &whole);

        // The final history is the last context_len tokens of EOS.. ++ seq.
        let mut padded = vec![d.eos_token_id; d.context_len()];
        padded.extend_from_slice(&seq);
        prop_assert_eq!(&history[..], &padded[padded.len() - d.context_len()..]);
        prop_assert!(whole.iter().all(|&id| id < d.table_rows()));
    }

    #[test]
    fn batched_decode_equals_per_sequence(
        d in dims(),
        seqs in prop::collection::vec((tokens(8), prop_oneof![0u32..8, Just(3u32)]), 0..12),
    ) {
        let heads = d.ngram_heads();
        let c = d.context_len();
        let hasher = PleIdHasher::new(&d).unwrap();
        // Each sequence's history: its prefix advanced from a fresh start.
        let histories: Vec<Vec<u32>> = seqs
            .iter()
            .map(|(prefix, _)| {
                let mut h = vec![d.eos_token_id; c];
                d.advance_history(&mut h, prefix);
                h
            })
            .collect();
        let new_tokens: Vec<u32> = seqs.iter().map(|(_, t)| *t).collect();

        let mut batched = vec![0u64; seqs.len() * heads];
        hasher.decode_batch_into(&histories, &new_tokens, &mut batched).unwrap();
        let flat_hist: Vec<u32> = histories.concat();
        let mut flat = vec![0u64; seqs.len() * heads];
        hasher.decode_batch_flat_into(&flat_hist, &new_tokens, &mut flat).unwrap();
        prop_assert_eq!(&flat, &batched);
        let mut scalar = vec![0u64; seqs.len() * heads];
        PleIdHasher::new_portable(&d)
            .unwrap()
            .decode_batch_into(&histories, &new_tokens, &mut scalar)
            .unwrap();
        prop_assert_eq!(&scalar, &batched);

        for (b, (prefix, t)) in seqs.iter().enumerate() {
            // The whole sequence hashed from its start, last row.
            let mut whole_seq = prefix.clone();
            whole_seq.push(*t);
            let rows = ple_ngram_ids(&d, &whole_seq);
            prop_assert_eq!(&batched[b * heads..(b + 1) * heads], &rows[rows.len() - 1][..]);
        }
    }
}
