//! Fuzz the remote row tier's manifest parser.
//!
//! `Manifest::parse` must never panic on any bytes a server hands back; an
//! accepted manifest is consistent (its server is a place in its list, it
//! holds no more rows than were pushed, a complete one has every row and
//! a rows digest) and writes back to a manifest that parses equal.
#![no_main]

use libfuzzer_sys::fuzz_target;
use metrale_storage::remote::format::Manifest;

fuzz_target!(|data: &[u8]| {
    if let Ok(m) = Manifest::parse(data) {
        assert!(m.server < m.servers);
        assert!(m.rows_here <= m.pushed_through && m.pushed_through <= m.rows);
        assert!(!m.complete || (m.pushed_through == m.rows && !m.rows_digest.is_empty()));
        assert_eq!(Manifest::parse(m.to_json().as_bytes()).unwrap(), m);
    }
});
