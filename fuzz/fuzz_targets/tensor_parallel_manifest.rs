//! Fuzz the tensor-parallel share manifest parser.
//!
//! `parse_manifest` must never panic on any text found in a share
//! directory; an accepted manifest names the column split and a rank below
//! a positive number of ranks, and writes back to a manifest that parses
//! equal.
#![no_main]

use std::path::Path;

use libfuzzer_sys::fuzz_target;
use metrale_checkpoint::tensor_parallel::parse_manifest;

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else { return };
    let path = Path::new("tensor_parallel.json");
    if let Ok(m) = parse_manifest(text, path) {
        assert!(m.rank < m.ranks);
        assert_eq!(m.split, "columns");
        let again = serde_json::to_string(&m).unwrap();
        assert_eq!(parse_manifest(&again, path).unwrap(), m);
    }
});
