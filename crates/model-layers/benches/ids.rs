//! Throughput of the PLE id hash at the flagship geometry (3-grams, 16
//! heads): the reciprocal fast path against the plain `%` form, both
//! measured in the same run on one core, with their ratio.
//!
//! Run: `cargo bench -p metrale-model-layers --bench ids`.

use std::hint::black_box;
use std::time::{Duration, Instant};

use metrale_model_layers::layers::ple::ids::{
    PleHashParams, PleIdHasher, ple_ngram_ids_into_plain, splitmix64,
};

/// Best times of `reps` interleaved runs of each closure. Each run is short
/// (well under a scheduler time slice) and they alternate, so the minimum
/// is the undisturbed cost of each even on a loaded machine, and slow drift
/// hits all alike.
fn best_of(reps: usize, fs: &mut [&mut dyn FnMut()]) -> Vec<Duration> {
    let mut best = vec![Duration::MAX; fs.len()];
    for _ in 0..reps {
        for (f, b) in fs.iter_mut().zip(&mut best) {
            let t = Instant::now();
            f();
            *b = (*b).min(t.elapsed());
        }
    }
    best
}

fn main() -> anyhow::Result<()> {
    let derived = PleHashParams {
        vocab_size: 151_936,
        eos_token_id: 151_645,
        ngram_size: 3,
        heads_per_ngram: 8,
        ngram_vocab_size_base: 20_000_000,
        divisible_by: 128,
        seed: 1234,
        site: 0,
    }
    .derive()?;
    let dims = derived.dims;
    let hasher = PleIdHasher::new(&dims)?;
    let scalar = PleIdHasher::new_portable(&dims)?;
    let heads = dims.ngram_heads();

    // Random tokens with an EOS about every 500 tokens, as in packed text.
    let t = 4096;
    let mut x = 42u64;
    let tokens: Vec<u32> = (0..t)
        .map(|_| {
            x = splitmix64(x);
            if x.is_multiple_of(500) {
                dims.eos_token_id
            } else {
                (x % 151_936) as u32
            }
        })
        .collect();
    let history = [dims.eos_token_id; 2];
    let mut best_out = vec![0u64; t * heads];
    let mut scalar_out = vec![0u64; t * heads];
    let mut plain_out = vec![0u64; t * heads];
    let reps = 2000;

    let times = best_of(
        reps,
        &mut [
            &mut || {
                hasher
                    .ids_with_history_into(black_box(&history), black_box(&tokens), &mut best_out)
                    .unwrap();
                black_box(&best_out);
            },
            &mut || {
                scalar
                    .ids_with_history_into(black_box(&history), black_box(&tokens), &mut scalar_out)
                    .unwrap();
                black_box(&scalar_out);
            },
            &mut || {
                ple_ngram_ids_into_plain(
                    &dims,
                    black_box(&history),
                    black_box(&tokens),
                    &mut plain_out,
                )
                .unwrap();
                black_box(&plain_out);
            },
        ],
    );
    assert_eq!(best_out, plain_out, "fast and plain ids differ");
    assert_eq!(scalar_out, plain_out, "scalar and plain ids differ");
    let rate = |n: usize, d: Duration| n as f64 / d.as_secs_f64() / 1e6;
    let (best, scal, plain) = (times[0], times[1], times[2]);
    println!(
        "prefill T={t} N=3 heads={heads}: {} {:.1} M tokens/s ({:.2}x), scalar reciprocal {:.1} M tokens/s ({:.2}x), plain % {:.1} M tokens/s (1.00x baseline)",
        hasher.path(),
        rate(t, best),
        plain.as_secs_f64() / best.as_secs_f64(),
        rate(t, scal),
        plain.as_secs_f64() / scal.as_secs_f64(),
        rate(t, plain),
    );

    // Batched decode: one token per sequence, each with its own history.
    let b = 1024;
    let histories: Vec<[u32; 2]> = tokens
        .chunks_exact(2)
        .take(b)
        .map(|c| [c[0], c[1]])
        .collect();
    let flat: Vec<u32> = histories.iter().flatten().copied().collect();
    let new_tokens = &tokens[t - b..];
    let mut out = vec![0u64; b * heads];
    let mut reference = vec![0u64; b * heads];
    let times = best_of(
        reps,
        &mut [
            &mut || {
                hasher
                    .decode_batch_flat_into(black_box(&flat), black_box(new_tokens), &mut out)
                    .unwrap();
                black_box(&out);
            },
            &mut || {
                for (i, h) in histories.iter().enumerate() {
                    ple_ngram_ids_into_plain(
                        &dims,
                        black_box(h),
                        black_box(&new_tokens[i..i + 1]),
                        &mut reference[i * heads..(i + 1) * heads],
                    )
                    .unwrap();
                }
                black_box(&reference);
            },
        ],
    );
    assert_eq!(out, reference, "batched and per-sequence ids differ");
    println!(
        "decode  B={b} N=3 heads={heads}: batched {} {:.1} M tokens/s ({:.2}x), per-sequence plain % {:.1} M tokens/s (1.00x baseline)",
        hasher.path(),
        rate(b, times[0]),
        times[1].as_secs_f64() / times[0].as_secs_f64(),
        rate(b, times[1]),
    );
    Ok(())
}
