//! Fuzz the token-map reader (`parse_token_map`: a JSON array of ids, what
//! `--token-map` and `metrale-ple token-map -o` use) and the check of a map
//! against an Engram spec.
//!
//! Nothing may panic on any text. A map that parses survives a round trip
//! through its JSON text, and `check_token_map` accepts it exactly when its
//! largest entry is `V' - 1` and the pad id is inside it.
#![no_main]

use libfuzzer_sys::fuzz_target;
use metrale_model_layers::layers::ple::family::engram::check_token_map;
use metrale_model_layers::layers::ple::family::engram::{EngramKeys, EngramSpec, parse_token_map};

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    let Ok(map) = parse_token_map(text, "fuzz/map.json") else {
        return;
    };
    let back: Vec<String> = map.iter().map(u32::to_string).collect();
    let again = parse_token_map(&format!("[{}]", back.join(",")), "fuzz/back.json")
        .expect("a map's own text parses");
    assert_eq!(again, map, "round trip");

    let max = map.iter().copied().max().map_or(0, u64::from);
    let e = EngramSpec {
        keys: EngramKeys::Demo,
        vocab_bases: vec![11],
        compressed_vocab_size: max + 1,
        pad_id: (data.len() % 7) as u32,
        num_embeddings: None,
        token_map: None,
    };
    let ok = check_token_map(&e, &map, "fuzz/map.json").is_ok();
    assert_eq!(ok, !map.is_empty() && (e.pad_id as usize) < map.len());
});
