//! Bit-for-bit comparison against outputs of the real numpy, stored in
//! `fixtures/numpy_rng/golden.json` by `reference/numpy_rng_fixtures.py`.

use metrale_numpy_rng::{Pcg64, SeedSequence, default_rng};
use metrale_testkit::fixtures::{i64s, read_json, u32s, u64s};
use serde_json::Value;

fn golden() -> Value {
    read_json("numpy_rng", "golden.json")
}

fn int(v: &Value) -> i64 {
    v.as_i64().expect("i64")
}

#[test]
fn seed_sequence_and_raw_pcg64() {
    let g = golden();
    let seeds = g["seeds"].as_array().unwrap();
    assert!(seeds.len() >= 10);
    for case in seeds {
        let words = u32s(&case["seed_words"]);
        let seq = SeedSequence::from_le_words(&words);
        if let Some(seed) = case["seed"].as_u64() {
            assert_eq!(SeedSequence::new(seed), seq, "seed {seed}: u64 vs words");
        }
        assert_eq!(
            seq.pool().to_vec(),
            u32s(&case["pool"]),
            "pool, words {words:?}"
        );
        assert_eq!(
            seq.generate_state_u32(8),
            u32s(&case["state_u32_8"]),
            "generate_state(8, uint32), words {words:?}"
        );
        assert_eq!(
            seq.generate_state_u64(4),
            u64s(&case["state_u64_4"]),
            "generate_state(4, uint64), words {words:?}"
        );
        let mut pcg = Pcg64::from_seed_sequence(&seq);
        let raw: Vec<u64> = (0..8).map(|_| pcg.next_u64()).collect();
        assert_eq!(raw, u64s(&case["raw"]), "PCG64 random_raw, words {words:?}");
        if let Some(seed) = case["seed"].as_u64() {
            assert_eq!(Pcg64::new(seed).next_u64(), raw[0]);
        }
    }
}

#[test]
fn integers_int64() {
    let g = golden();
    let cases = g["integers"].as_array().unwrap();
    assert!(cases.len() >= 100);
    for case in cases {
        let seed = case["seed"].as_u64().unwrap();
        let (low, high) = (int(&case["low"]), int(&case["high"]));
        let want = i64s(&case["values"]);
        let got = default_rng(seed)
            .integers_i64(low, high, want.len())
            .unwrap();
        assert_eq!(got, want, "default_rng({seed}).integers({low}, {high})");
    }
}

#[test]
fn engram_multipliers() {
    // The Engram derivation, spelled out: m = 2 * r + 1 with r drawn below
    // half = ((2^63 - 1) // V) // 2, seed = base + 10007 * layer_id.
    let g = golden();
    let mut checked = 0;
    for vocab in [129_280i64 * 5, 99_092, 129_280] {
        let half = (i64::MAX / vocab) / 2;
        for case in g["integers"].as_array().unwrap() {
            if int(&case["high"]) != half || int(&case["low"]) != 0 {
                continue;
            }
            let seed = case["seed"].as_u64().unwrap();
            let want = i64s(&case["values"]);
            let r = default_rng(seed).integers_i64(0, half, want.len()).unwrap();
            assert_eq!(r, want);
            for m in r.iter().map(|&r| 2 * r + 1) {
                assert!(m % 2 == 1 && m < 2 * half);
            }
            checked += 1;
        }
    }
    assert!(checked >= 24, "only {checked} Engram cases");
}

#[test]
fn calls_in_sequence_share_the_buffered_half_word() {
    let g = golden();
    for seq in g["sequences"].as_array().unwrap() {
        let seed = seq["seed"].as_u64().unwrap();
        let mut rng = default_rng(seed);
        for (i, call) in seq["calls"].as_array().unwrap().iter().enumerate() {
            let (low, high) = (int(&call["low"]), int(&call["high"]));
            let want = i64s(&call["values"]);
            let got = rng.integers_i64(low, high, want.len()).unwrap();
            assert_eq!(got, want, "seed {seed}, call {i}: integers({low}, {high})");
        }
    }
}

#[test]
fn advance_matches_numpy() {
    let g = golden();
    for case in g["advances"].as_array().unwrap() {
        let seed = case["seed"].as_u64().unwrap();
        let delta = (u128::from(case["delta_hi"].as_u64().unwrap()) << 64)
            | u128::from(case["delta_lo"].as_u64().unwrap());

        let mut pcg = Pcg64::new(seed);
        pcg.advance(delta);
        let raw: Vec<u64> = (0..3).map(|_| pcg.next_u64()).collect();
        assert_eq!(
            raw,
            u64s(&case["raw_after_advance"]),
            "seed {seed}, advance {delta}"
        );

        let mut rng = default_rng(seed);
        let first = rng.integers_i64(0, 7, 1).unwrap();
        assert_eq!(first[0], int(&case["first_small"]));
        rng.bit_generator().advance(delta);
        let after = rng.integers_i64(0, 1 << 62, 3).unwrap();
        assert_eq!(
            after,
            i64s(&case["after_large"]),
            "seed {seed}, advance {delta}"
        );
    }
}
