//! Throughput of the PLE id hash at the flagship geometry (3-grams, 16
//! heads): the reciprocal fast path against the plain `%` form, both
//! measured in the same run on one core, with their ratio. The workloads
//! are `metrale_bench::layer`'s, the ones `metrale-ple bench` times.
//!
//! Run: `cargo bench -p metrale-bench --bench ids`.

use std::time::{Duration, Instant};

use metrale_bench::layer::{IdsDecode, IdsPrefill};
use metrale_model_layers::layers::ple::ModelSpec;

/// The flagship geometry of docs/SPEC.md §2 (Geometry), as its config.json
/// says it.
const FLAGSHIP: &str = r#"{
    "vocab_size": 151936, "hidden_size": 2560, "hc_mult": 4,
    "rms_norm_eps": 1e-6, "eos_token_id": 151645, "ngram_size": 3,
    "heads_per_ngram": 8, "ple_head_dim": 160,
    "ngram_vocab_size_base": 20000000, "make_ngram_vocab_size_divisible_by": 128,
    "split_ngram_parts": 8, "ple_conv_kernel_size": 4, "ple_layer_ids": [2],
    "num_hidden_layers": 4
}"#;

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
    let spec = ModelSpec::from_json_str(FLAGSHIP, "flagship")?;
    let reps = 2000;
    let rate = |n: usize, d: Duration| n as f64 / d.as_secs_f64() / 1e6;

    let mut p = IdsPrefill::new(&spec, 0, 4096)?;
    let (t, heads) = (p.tokens(), p.heads());
    let path = p.path();
    let times = {
        let p = std::cell::RefCell::new(&mut p);
        best_of(
            reps,
            &mut [
                &mut || p.borrow_mut().run().unwrap(),
                &mut || p.borrow_mut().portable().unwrap(),
                &mut || p.borrow_mut().baseline().unwrap(),
            ],
        )
    };
    p.check()?;
    let (best, scal, plain) = (times[0], times[1], times[2]);
    println!(
        "prefill T={t} N=3 heads={heads}: {path} {:.1} M tokens/s ({:.2}x), scalar reciprocal {:.1} M tokens/s ({:.2}x), plain % {:.1} M tokens/s (1.00x baseline)",
        rate(t, best),
        plain.as_secs_f64() / best.as_secs_f64(),
        rate(t, scal),
        plain.as_secs_f64() / scal.as_secs_f64(),
        rate(t, plain),
    );

    // Batched decode: one token per sequence, each with its own history.
    let mut d = IdsDecode::new(&spec, 0, 1024)?;
    let b = d.batch();
    let times = {
        let d = std::cell::RefCell::new(&mut d);
        best_of(
            reps,
            &mut [&mut || d.borrow_mut().run().unwrap(), &mut || {
                d.borrow_mut().baseline().unwrap()
            }],
        )
    };
    d.check()?;
    println!(
        "decode  B={b} N=3 heads={heads}: batched {path} {:.1} M tokens/s ({:.2}x), per-sequence plain % {:.1} M tokens/s (1.00x baseline)",
        rate(b, times[0]),
        times[1].as_secs_f64() / times[0].as_secs_f64(),
        rate(b, times[1]),
    );
    Ok(())
}
