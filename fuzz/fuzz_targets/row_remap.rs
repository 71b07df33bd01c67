//! Fuzz the row remap file parser and the hot-row trace parser.
//!
//! `RowRemap::parse` must never panic, and must accept only permutations:
//! an accepted remap re-encodes to the very bytes it came from, and maps
//! every row to a distinct row below its row count. Half the inputs get a
//! valid header and checksum first, so the fuzzer reaches the entry checks
//! (range, duplicates). `parse_trace` must never panic on any text.
#![no_main]

use std::path::Path;

use libfuzzer_sys::fuzz_target;
use metrale_checkpoint::remap::{HEADER_BYTES, MAGIC, RowRemap, VERSION, parse_trace};

fuzz_target!(|data: &[u8]| {
    let Some((&mode, rest)) = data.split_first() else { return };
    let path = Path::new("fuzz.row_remap.bin");
    let bytes = if mode & 1 == 1 {
        let entries = &rest[..rest.len() / 4 * 4];
        let mut b = Vec::with_capacity(HEADER_BYTES + entries.len());
        b.extend_from_slice(MAGIC);
        b.extend_from_slice(&VERSION.to_le_bytes());
        b.extend_from_slice(&4u32.to_le_bytes());
        b.extend_from_slice(&((entries.len() / 4) as u64).to_le_bytes());
        b.extend_from_slice(&crc32fast::hash(entries).to_le_bytes());
        b.extend_from_slice(&[0; 4]);
        b.extend_from_slice(entries);
        b
    } else {
        rest.to_vec()
    };
    let expected = (mode & 2 == 2).then(|| (mode >> 2) as u64);
    if let Ok(r) = RowRemap::parse(&bytes, expected, path) {
        assert_eq!(r.encode(), bytes, "an accepted remap re-encodes to its bytes");
        let mut seen = vec![false; r.rows() as usize];
        for i in 0..r.rows() {
            let p = r.physical(i) as usize;
            assert!(p < seen.len() && !seen[p], "not a permutation");
            seen[p] = true;
        }
        if let Some(e) = expected {
            assert_eq!(r.rows(), e);
        }
    }
    let text = String::from_utf8_lossy(rest);
    let _ = parse_trace(&text, (mode % 4) as usize, Path::new("fuzz-trace.txt"));
});
