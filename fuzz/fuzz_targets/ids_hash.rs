//! Fuzz the n-gram id hash with arbitrary geometries and token streams.
//!
//! Dims that fail `PleIdDims::validate` must be refused by every entry point
//! with an error, never a panic. Dims that pass must give ids below
//! `table_rows()`, the reciprocal hot path must equal the `%` form bit for
//! bit, hashing in two chunks with the history carried must equal hashing
//! whole, and the batched decode form must equal the one-token form.
#![no_main]

use libfuzzer_sys::arbitrary::{Result, Unstructured};
use libfuzzer_sys::fuzz_target;
use metrale_model_layers::layers::ple::ids::{
    PleIdDims, PleIdHasher, ple_ngram_ids_into_plain,
};

/// Build dims from fuzz bytes. Most inputs are made valid (odd multipliers,
/// offsets the running sums) so the hash itself gets exercised; a flag byte
/// lets the fuzzer break each rule too.
fn dims(u: &mut Unstructured<'_>) -> Result<PleIdDims> {
    let ngram_size = u.int_in_range(0usize..=34)?;
    let heads_per_ngram = u.int_in_range(0usize..=5)?;
    let breakage: u8 = u.arbitrary()?;
    let mut multipliers = Vec::new();
    let n_mult = if breakage & 1 != 0 { u.int_in_range(0usize..=34)? } else { ngram_size };
    for _ in 0..n_mult {
        let m: u64 = u.arbitrary()?;
        multipliers.push(if breakage & 2 != 0 { m } else { m | 1 });
    }
    let heads = ngram_size.saturating_sub(1) * heads_per_ngram;
    let n_heads = if breakage & 4 != 0 { u.int_in_range(0usize..=200)? } else { heads };
    let mut head_vocab_sizes = Vec::new();
    let mut head_offsets = Vec::new();
    let mut running = 0u64;
    for _ in 0..n_heads {
        let size: u64 = if breakage & 8 != 0 {
            u.arbitrary()?
        } else {
            // Mostly small primes-ish moduli, sometimes huge ones.
            let wide: bool = u.arbitrary()?;
            if wide { u.arbitrary::<u64>()? >> u.int_in_range(0u32..=63)? } else { u.int_in_range(1u64..=1 << 20)? }
        };
        head_offsets.push(if breakage & 16 != 0 { u.arbitrary()? } else { running });
        running = running.wrapping_add(size);
        head_vocab_sizes.push(size);
    }
    Ok(PleIdDims {
        ngram_size,
        heads_per_ngram,
        multipliers,
        head_vocab_sizes,
        head_offsets,
        eos_token_id: u.arbitrary()?,
        family: Default::default(),
    })
}

fn run(data: &[u8]) -> Result<()> {
    let mut u = Unstructured::new(data);
    let d = dims(&mut u)?;
    let eos = d.eos_token_id;
    let n_hist = u.int_in_range(0usize..=40)?;
    let mut history = Vec::with_capacity(n_hist);
    for _ in 0..n_hist {
        // Bias towards EOS so segment boundaries show up often.
        history.push(if u.ratio(1, 4)? { eos } else { u.arbitrary()? });
    }
    let mut tokens = Vec::new();
    while !u.is_empty() && tokens.len() < 256 {
        tokens.push(if u.ratio(1, 4)? { eos } else { u.int_in_range(0u32..=64)? });
    }

    let valid = d.validate();
    let hasher = PleIdHasher::new(&d);
    assert_eq!(valid.is_ok(), hasher.is_ok(), "validate and PleIdHasher::new disagree");
    let heads = d.ngram_heads();
    let mut plain = vec![0u64; tokens.len() * heads];
    let plain_res = ple_ngram_ids_into_plain(&d, &history, &tokens, &mut plain);
    let Ok(h) = hasher else {
        assert!(plain_res.is_err(), "invalid dims hashed: {d:?}");
        return Ok(());
    };
    plain_res.expect("valid dims and a right-sized buffer must hash");

    let mut fast = vec![0u64; plain.len()];
    h.ids_with_history_into(&history, &tokens, &mut fast).expect("hot path");
    assert_eq!(plain, fast, "reciprocal path differs from %");
    let rows = d.table_rows();
    assert!(plain.iter().all(|&id| id < rows), "id past table_rows {rows}");

    // A wrong-sized buffer is an error, not a panic or a partial write.
    if !tokens.is_empty() && heads > 0 {
        let mut short = vec![0u64; plain.len() - 1];
        assert!(h.ids_with_history_into(&history, &tokens, &mut short).is_err());
    }

    // Chunked with the history carried equals whole.
    let split = if tokens.is_empty() { 0 } else { u.int_in_range(0..=tokens.len()).unwrap_or(0) };
    let (a, b) = tokens.split_at(split);
    let mut hist = history.clone();
    let mut chunked = vec![0u64; plain.len()];
    h.ids_with_history_into(&hist, a, &mut chunked[..a.len() * heads]).expect("chunk a");
    d.advance_history(&mut hist, a);
    assert_eq!(hist.len(), d.context_len(), "advance_history length");
    h.ids_with_history_into(&hist, b, &mut chunked[a.len() * heads..]).expect("chunk b");
    assert_eq!(plain, chunked, "chunked hash differs from whole");

    // Batched decode: token i with the history it would have at that point.
    let mut hist = history.clone();
    let mut histories = Vec::new();
    for &t in &tokens {
        histories.push(hist.clone());
        d.advance_history(&mut hist, &[t]);
    }
    let mut batched = vec![0u64; plain.len()];
    h.decode_batch_into(&histories, &tokens, &mut batched).expect("batched decode");
    assert_eq!(plain, batched, "batched decode differs from whole");
    Ok(())
}

fuzz_target!(|data: &[u8]| {
    let _ = run(data);
});
