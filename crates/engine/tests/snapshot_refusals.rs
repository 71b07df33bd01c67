//! Each refusal of the snapshot container, with the error text a user sees.

use metrale_engine::snapshot::{FORMAT_VERSION, GeometryFingerprint, Snapshot, SnapshotError};
use metrale_model_layers::layers::ple::SiteSpec;
use metrale_model_layers::layers::ple::ids::PleIdDims;

fn geom(hidden: usize) -> SiteSpec {
    let dims = PleIdDims {
        ngram_size: 3,
        heads_per_ngram: 2,
        multipliers: vec![3, 5, 7],
        head_vocab_sizes: vec![11, 13, 17, 19],
        head_offsets: vec![0, 11, 24, 41],
        eos_token_id: 0,
        family: Default::default(),
    };
    SiteSpec::new(dims, 8, hidden, 2, 4, 3)
}

fn snapshot_for(sites: &[SiteSpec]) -> Snapshot {
    Snapshot {
        fingerprint: GeometryFingerprint::of(sites),
        token_count: 7,
        blobs: sites
            .iter()
            .map(|g| {
                let mut b = (g.dims.context_len() as u32).to_le_bytes().to_vec();
                b.extend((0..g.aux_blob_len() - 4).map(|i| i as u8));
                b
            })
            .collect(),
    }
}

/// Re-seal bytes whose header was edited, so only the edit is refused.
fn reseal(b: &mut [u8]) {
    let n = b.len() - 4;
    let crc = crc32fast::hash(&b[..n]);
    b[n..].copy_from_slice(&crc.to_le_bytes());
}

#[test]
fn another_geometry_is_refused() {
    let theirs = [geom(4)];
    let ours = [geom(8)];
    let bytes = snapshot_for(&theirs).encode();
    let e = Snapshot::decode_for(&bytes, &ours).unwrap_err();
    assert!(matches!(e, SnapshotError::GeometryMismatch { .. }));
    let fp_t = GeometryFingerprint::of(&theirs);
    let fp_o = GeometryFingerprint::of(&ours);
    assert_eq!(
        e.to_string(),
        format!(
            "snapshot is for another geometry: fingerprint {fp_t}, this engine is {fp_o} (PLE sites, hash constants or carry shape differ)"
        )
    );
}

#[test]
fn truncated_is_refused() {
    let bytes = snapshot_for(&[geom(4)]).encode();
    let n = bytes.len();
    let e = Snapshot::decode(&bytes[..n - 1]).unwrap_err();
    assert_eq!(
        e.to_string(),
        format!(
            "snapshot truncated: the declared length needs {n} bytes, only {} present",
            n - 1
        )
    );
    let e = Snapshot::decode(&bytes[..20]).unwrap_err();
    assert_eq!(
        e.to_string(),
        "snapshot truncated: the header needs 48 bytes, only 20 present"
    );
    let e = Snapshot::decode(&[]).unwrap_err();
    assert_eq!(
        e.to_string(),
        "snapshot truncated: the header needs 12 bytes, only 0 present"
    );
}

#[test]
fn corrupted_is_refused() {
    let mut bytes = snapshot_for(&[geom(4)]).encode();
    let stored = u32::from_le_bytes(bytes[bytes.len() - 4..].try_into().unwrap());
    let mid = bytes.len() / 2;
    bytes[mid] ^= 1;
    let computed = crc32fast::hash(&bytes[..bytes.len() - 4]);
    let e = Snapshot::decode(&bytes).unwrap_err();
    assert_eq!(e, SnapshotError::Corrupted { stored, computed });
    assert_eq!(
        e.to_string(),
        format!("snapshot corrupted: CRC32 stored {stored:08x}, computed {computed:08x}")
    );
}

#[test]
fn newer_version_is_refused() {
    let mut bytes = snapshot_for(&[geom(4)]).encode();
    bytes[8..12].copy_from_slice(&(FORMAT_VERSION + 1).to_le_bytes());
    // Not resealed: a newer version is reported as such even if its CRC
    // rules differ from ours.
    let e = Snapshot::decode(&bytes).unwrap_err();
    assert_eq!(
        e.to_string(),
        format!(
            "snapshot format version {} is newer than this build reads (up to {FORMAT_VERSION}); upgrade to restore it",
            FORMAT_VERSION + 1
        )
    );
    bytes[8..12].copy_from_slice(&0u32.to_le_bytes());
    let e = Snapshot::decode(&bytes).unwrap_err();
    assert_eq!(
        e.to_string(),
        "snapshot format version 0 is not a valid version"
    );
}

#[test]
fn bad_magic_is_refused() {
    let mut bytes = snapshot_for(&[geom(4)]).encode();
    bytes[0] = b'X';
    let e = Snapshot::decode(&bytes).unwrap_err();
    assert_eq!(
        e.to_string(),
        "not a PLE snapshot: magic is [58, 50, 4c, 45, 53, 4e, 41, 50], expected \"MPLESNAP\""
    );
}

#[test]
fn trailing_bytes_are_refused() {
    let mut bytes = snapshot_for(&[geom(4)]).encode();
    let n = bytes.len();
    bytes.push(0);
    let e = Snapshot::decode(&bytes).unwrap_err();
    assert_eq!(
        e.to_string(),
        format!(
            "snapshot has trailing bytes: header declares {n} bytes, {} present",
            n + 1
        )
    );
}

#[test]
fn blob_count_mismatch_is_refused() {
    // Same fingerprint, one blob missing: a writer bug the CRC cannot see.
    let sites = [geom(4), geom(4)];
    let mut s = snapshot_for(&sites);
    s.blobs.pop();
    let e = Snapshot::decode_for(&s.encode(), &sites).unwrap_err();
    assert_eq!(
        e.to_string(),
        "snapshot holds 1 site blobs, this engine has 2 PLE sites"
    );
}

#[test]
fn blob_size_mismatch_is_refused() {
    let sites = [geom(4)];
    let mut s = snapshot_for(&sites);
    let want = s.blobs[0].len();
    s.blobs[0].pop();
    let e = Snapshot::decode_for(&s.encode(), &sites).unwrap_err();
    assert_eq!(
        e.to_string(),
        format!(
            "snapshot blob of site 0 is {} bytes, expected {want}",
            want - 1
        )
    );
}

#[test]
fn blob_history_mismatch_is_refused() {
    let sites = [geom(4)];
    let mut s = snapshot_for(&sites);
    s.blobs[0][..4].copy_from_slice(&1u32.to_le_bytes());
    let e = Snapshot::decode_for(&s.encode(), &sites).unwrap_err();
    assert_eq!(
        e.to_string(),
        "snapshot blob of site 0 holds a history of 1 tokens, expected 2"
    );
}

#[test]
fn inconsistent_blob_table_is_refused() {
    let mut bytes = snapshot_for(&[geom(4)]).encode();
    // Claim a longer first blob; reseal so only the table is wrong.
    let l = u64::from_le_bytes(bytes[48..56].try_into().unwrap());
    bytes[48..56].copy_from_slice(&(l + 1).to_le_bytes());
    reseal(&mut bytes);
    let e = Snapshot::decode(&bytes).unwrap_err();
    assert_eq!(
        e.to_string(),
        format!(
            "snapshot malformed: blob lengths sum to {} bytes, the data holds {l}",
            l + 1
        )
    );
    let mut bytes = snapshot_for(&[geom(4)]).encode();
    bytes[40..44].copy_from_slice(&u32::MAX.to_le_bytes());
    reseal(&mut bytes);
    let e = Snapshot::decode(&bytes).unwrap_err();
    assert_eq!(
        e.to_string(),
        format!(
            "snapshot malformed: blob count {} needs a length table past the end of the data",
            u32::MAX
        )
    );
}
