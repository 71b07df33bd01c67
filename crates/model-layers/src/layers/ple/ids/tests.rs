//! Unit tests of the id hash: hand-worked geometries, the three forms
//! agreeing, and refusals.

use super::*;

/// A tiny geometry whose ids can be worked out by hand.
fn tiny() -> PleIdDims {
    PleIdDims {
        ngram_size: 3,
        heads_per_ngram: 1,
        multipliers: vec![1, 3, 5],
        head_vocab_sizes: vec![101, 103],
        head_offsets: vec![0, 101],
        eos_token_id: 0,
        family: Default::default(),
    }
}

fn flagship() -> PleIdDims {
    PleHashParams {
        vocab_size: 151_936,
        eos_token_id: 151_645,
        ngram_size: 3,
        heads_per_ngram: 8,
        ngram_vocab_size_base: 20_000_000,
        divisible_by: 128,
        seed: 1234,
        site: 0,
    }
    .derive()
    .unwrap()
    .dims
}

#[test]
fn hand_computed_ids() {
    let d = tiny();
    // Tokens 7, 9, then EOS (0), then 4.
    let ids = ple_ngram_ids(&d, &[7, 9, 0, 4]);
    // 7: context EOS EOS. order 2: 7*1 ^ 0*3 = 7; order 3: 7 ^ 0 = 7.
    assert_eq!(ids[0], vec![7, 101 + 7]);
    // 9: prev 7. order 2: 9 ^ 21 = 28; order 3: 28 ^ 0 = 28.
    assert_eq!(ids[1], vec![28, 101 + 28]);
    // EOS: prev 9, 7. order 2: 0 ^ 27 = 27; order 3: 27 ^ 35 = 56.
    assert_eq!(ids[2], vec![27, 101 + 56]);
    // 4 starts a new segment: prev EOS EOS, so 4 and 4.
    assert_eq!(ids[3], vec![4, 101 + 4]);
}

#[test]
fn fast_and_plain_agree_on_flagship() {
    let d = flagship();
    let hasher = PleIdHasher::new(&d).unwrap();
    let mut x = 0x1234_5678u64;
    let tokens: Vec<u32> = (0..2000)
        .map(|_| {
            x = splitmix64(x);
            // Plenty of EOS to exercise segment starts.
            if x.is_multiple_of(7) {
                d.eos_token_id
            } else {
                (x % 151_936) as u32
            }
        })
        .collect();
    let plain: Vec<u64> = ple_ngram_ids(&d, &tokens).concat();
    let mut fast = vec![0; plain.len()];
    hasher.ids_into(&tokens, &mut fast).unwrap();
    assert_eq!(plain, fast, "path {}", hasher.path());
    let portable = PleIdHasher::new_portable(&d).unwrap();
    assert_eq!(portable.path(), "scalar");
    portable.ids_into(&tokens, &mut fast).unwrap();
    assert_eq!(plain, fast, "scalar path");
    assert!(fast.iter().all(|&id| id < d.table_rows()));
}

#[test]
fn validate_names_each_problem() {
    let ok = tiny();
    ok.validate().unwrap();
    type Breakage = fn(&mut PleIdDims);
    let cases: Vec<(Breakage, &str)> = vec![
        (|d| d.ngram_size = 1, "ngram_size"),
        (|d| d.heads_per_ngram = 0, "heads_per_ngram"),
        (
            |d| {
                d.multipliers.pop();
            },
            "2 multipliers",
        ),
        (|d| d.multipliers[1] = 4, "multipliers[1] = 4 is even"),
        (|d| d.head_vocab_sizes.push(7), "3 head_vocab_sizes"),
        (|d| d.head_offsets.push(7), "3 head_offsets"),
        (|d| d.head_vocab_sizes[0] = 0, "head_vocab_sizes[0] is 0"),
        (|d| d.head_offsets[1] = 100, "head_offsets[1] = 100"),
        (|d| d.head_offsets[0] = 1, "head_offsets[0] = 1"),
        (
            |d| {
                d.head_vocab_sizes[1] = u64::MAX;
            },
            "past 2^64 - 1",
        ),
    ];
    for (f, want) in cases {
        let mut d = tiny();
        f(&mut d);
        let e = d.validate().unwrap_err().to_string();
        assert!(e.contains(want), "{e} should mention {want}");
        assert!(PleIdHasher::new(&d).is_err());
    }
}

#[test]
fn table_rows_check() {
    let d = tiny();
    assert_eq!(d.table_rows(), 204);
    d.check_table_rows(204).unwrap();
    let e = d.check_table_rows(203).unwrap_err().to_string();
    assert!(e.contains("row 203") && e.contains("203 rows"), "{e}");
}

#[test]
#[should_panic(expected = "invalid dims")]
fn plain_form_panics_on_invalid_dims() {
    let mut d = tiny();
    d.head_vocab_sizes[0] = 0;
    let _ = ple_ngram_ids(&d, &[1]);
}

#[test]
fn wrong_buffer_sizes_are_errors() {
    let d = tiny();
    let h = PleIdHasher::new(&d).unwrap();
    let e = h.ids_into(&[1, 2], &mut [0; 3]).unwrap_err().to_string();
    assert!(
        e.contains("3 entries") && e.contains("2 tokens x 2 heads need 4"),
        "{e}"
    );
    let e = h
        .decode_batch_into(&[vec![1, 2]], &[1, 2], &mut [0; 4])
        .unwrap_err()
        .to_string();
    assert!(e.contains("1 histories for 2 tokens"), "{e}");
    let e = h
        .decode_batch_flat_into(&[1, 2, 3], &[1, 2], &mut [0; 4])
        .unwrap_err()
        .to_string();
    assert!(e.contains("hold 3 tokens") && e.contains("need 4"), "{e}");
    let e = ple_ngram_ids_into_plain(&d, &[], &[1], &mut [])
        .unwrap_err()
        .to_string();
    assert!(e.contains("0 entries"), "{e}");
}

#[test]
fn advance_history_keeps_context_len() {
    let d = tiny();
    let mut h = vec![0, 0];
    d.advance_history(&mut h, &[5]);
    assert_eq!(h, vec![0, 5]);
    d.advance_history(&mut h, &[6, 7, 8]);
    assert_eq!(h, vec![7, 8]);
    d.advance_history(&mut h, &[]);
    assert_eq!(h, vec![7, 8]);
    let mut short = vec![];
    d.advance_history(&mut short, &[9]);
    assert_eq!(short, vec![0, 9]);
    let mut long = vec![1, 2, 3, 4];
    d.advance_history(&mut long, &[9]);
    assert_eq!(long, vec![4, 9]);
}

#[test]
fn empty_and_eos_history_start_alike() {
    let h = PleIdHasher::new(&flagship()).unwrap();
    let eos = h.dims().eos_token_id;
    let toks = [11, 22, 33];
    let mut a = vec![0; 48];
    let mut b = vec![0; 48];
    h.ids_with_history_into(&[], &toks, &mut a).unwrap();
    h.ids_with_history_into(&[eos, eos], &toks, &mut b).unwrap();
    assert_eq!(a, b);
}
