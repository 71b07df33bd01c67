//! Fuzz the remote row tier's value decoder.
//!
//! `decode_value` must never panic on any bytes a server hands back, and
//! accepts a value only for the table, row and payload length asked for.
//! Half the inputs are encoded properly first (the fuzzer's bytes as the
//! payload), so a damaged copy reaches the checksum: every accepted value
//! is exactly what `encode_value` writes for that row.
#![no_main]

use libfuzzer_sys::fuzz_target;
use metrale_storage::remote::format::{TableDigest, VALUE_OVERHEAD, decode_value, encode_value};

fuzz_target!(|data: &[u8]| {
    let Some((&mode, rest)) = data.split_first() else { return };
    let d = TableDigest([mode & 0x0f; 16]);
    let id = u64::from(mode >> 5);
    let value = if mode & 0x10 != 0 {
        let mut v = Vec::new();
        encode_value(&d, id, rest, &mut v);
        // A flip inside the value, chosen by the payload's first byte.
        if let Some(&at) = rest.first()
            && at & 1 == 1
        {
            let i = at as usize % v.len();
            v[i] ^= 0x40;
        }
        v
    } else {
        rest.to_vec()
    };
    let payload = value.len().saturating_sub(VALUE_OVERHEAD);
    if let Ok(p) = decode_value(&value, &d, id, payload) {
        let mut again = Vec::new();
        encode_value(&d, id, p, &mut again);
        assert_eq!(again, value, "an accepted value is the row's encoding");
    }
});
