//! Fuzz the engine's snapshot container decoder.
//!
//! `Snapshot::decode` must never panic. Half the inputs get a valid magic,
//! version, total length and CRC patched in, so the fuzzer reaches the
//! length and blob checks behind the checksum. An accepted snapshot must
//! re-encode to exactly the input bytes, and `decode_for` a small geometry
//! must accept only snapshots whose fingerprint and blob sizes fit it.
#![no_main]

use libfuzzer_sys::fuzz_target;
use metrale_engine::snapshot::{FORMAT_VERSION, GeometryFingerprint, MAGIC, Snapshot};
use metrale_testkit::tiny::tiny_dims;
use metrale_model_layers::layers::ple::SiteSpec;

fn geometry() -> Vec<SiteSpec> {
    (0..2).map(|s| SiteSpec::new(tiny_dims(s, 1, 0), 4, 2, 1, 2, 3)).collect()
}

fuzz_target!(|data: &[u8]| {
    let Some((&mode, rest)) = data.split_first() else { return };
    let mut b = rest.to_vec();
    if mode & 1 == 1 && b.len() >= 52 {
        b[..8].copy_from_slice(&MAGIC);
        b[8..12].copy_from_slice(&FORMAT_VERSION.to_le_bytes());
        if mode & 2 == 2 {
            b[12..16].fill(0);
            b[44..48].fill(0);
        }
        let n = b.len() as u64;
        b[16..24].copy_from_slice(&n.to_le_bytes());
        if mode & 4 == 4 {
            // The fingerprint of the geometry below, so decode_for gets past it.
            let fp = GeometryFingerprint::of(&geometry());
            b[24..32].copy_from_slice(&fp.0.to_le_bytes());
        }
        let crc = crc32fast::hash(&b[..b.len() - 4]);
        let at = b.len() - 4;
        b[at..].copy_from_slice(&crc.to_le_bytes());
    }
    let Ok(s) = Snapshot::decode(&b) else {
        assert!(Snapshot::decode_for(&b, &geometry()).is_err());
        return;
    };
    assert_eq!(s.encode(), b, "an accepted snapshot must re-encode to its bytes");
    assert_eq!(s.encoded_len(), b.len());
    let g = geometry();
    if let Ok(t) = Snapshot::decode_for(&b, &g) {
        assert_eq!(t.blobs.len(), g.len());
        for (blob, site) in t.blobs.iter().zip(&g) {
            assert_eq!(blob.len(), site.aux_blob_len());
        }
    }
});
