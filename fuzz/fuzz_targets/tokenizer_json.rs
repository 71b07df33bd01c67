//! Fuzz the `tokenizer.json` reader that builds Engram's compressed-token
//! map (docs/SPEC.md §11, "Token map").
//!
//! Nothing may panic on any text (a `Precompiled` normaliser aside, see
//! below). A map that builds has one entry per raw
//! id, uses exactly the ids `0..V'`, hands them out in first-seen order,
//! and comes out the same when built again.
#![no_main]

use libfuzzer_sys::fuzz_target;
use metrale_model_layers::layers::ple::family::engram::token_map_from_tokenizer_str;

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    // The reader turns the library's panic on a bad `Precompiled`
    // charsmap into an error with `catch_unwind`, which libFuzzer's panic
    // hook aborts before; the unit tests cover that path.
    if text.contains("Precompiled") {
        return;
    }
    let Ok(c) = token_map_from_tokenizer_str(text, "fuzz/tokenizer.json") else {
        return;
    };
    let mut next = 0u32;
    for &id in c.map.iter() {
        assert!(id <= next, "compressed id {id} before {next}");
        if id == next {
            next += 1;
        }
    }
    assert_eq!(
        u64::from(next),
        c.compressed_vocab_size(),
        "every compressed id is used"
    );
    let again = token_map_from_tokenizer_str(text, "fuzz/tokenizer.json").expect("builds again");
    assert_eq!(again, c, "deterministic");
});
