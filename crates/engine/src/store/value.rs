//! Stored values: a snapshot container of docs/SPEC.md §8 (Snapshot
//! container), the bytes [`Snapshot::encode`] makes, behind a small header
//! naming the model and the key it was stored under.
//!
//! Layout (all integers little-endian):
//!
//! | offset | size | field |
//! |---|---|---|
//! | 0 | 8 | magic `MPLECARY` |
//! | 8 | 4 | format version (1) |
//! | 12 | 4 | CRC32 (IEEE) of bytes 0..12 and 16..80 |
//! | 16 | 32 | [`ModelDigest`] of the model that took it |
//! | 48 | 32 | the [`StoreKey`] it was stored under |
//! | 80 | rest | the snapshot container |
//!
//! Invariants: [`open_value`] never panics on any input, and either returns
//! a snapshot that fits the engine (the container's own checks, then the
//! token count and the carried history against the prefix) or says why it
//! does not, as a [`MissCause`]: a value that does not fit is a miss, never
//! an empty or a foreign carry.

use metrale_model_layers::layers::ple::SiteSpec;
use metrale_model_layers::layers::ple::carry_blob;

use super::key::{ModelDigest, StoreKey};
use crate::snapshot::{Snapshot, SnapshotError};

/// The magic number at offset 0.
pub const VALUE_MAGIC: [u8; 8] = *b"MPLECARY";
/// The value format version this build writes and reads.
pub const VALUE_VERSION: u32 = 1;
/// Bytes before the container.
pub const VALUE_HEADER_LEN: usize = 80;

/// Why a stored value was not used.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum MissCause {
    /// The store holds no value under the key.
    Absent,
    /// The value does not decode: header, CRC, length, blob table, or a
    /// token count or history that contradicts its key.
    Corrupt(String),
    /// The container was taken by an engine of another geometry.
    Geometry(String),
    /// The value belongs to another model.
    Model,
    /// The store could not be asked (down, slow, answering garbage).
    Error(String),
}

fn header_crc(bytes: &[u8]) -> u32 {
    let mut h = crc32fast::Hasher::new();
    h.update(&bytes[..12]);
    h.update(&bytes[16..VALUE_HEADER_LEN]);
    h.finalize()
}

/// A value's header under `key` for `model`, with room for a container of
/// `container_len` bytes after it.
fn value_header(model: &ModelDigest, key: &StoreKey, container_len: usize) -> Vec<u8> {
    let mut out = Vec::with_capacity(VALUE_HEADER_LEN + container_len);
    out.extend_from_slice(&VALUE_MAGIC);
    out.extend_from_slice(&VALUE_VERSION.to_le_bytes());
    out.extend_from_slice(&[0; 4]);
    out.extend_from_slice(&model.0);
    out.extend_from_slice(&key.0);
    let crc = header_crc(&out);
    out[12..16].copy_from_slice(&crc.to_le_bytes());
    out
}

/// The stored form of `container` (snapshot container bytes) under `key`
/// for `model`.
pub fn seal_value(model: &ModelDigest, key: &StoreKey, container: &[u8]) -> Vec<u8> {
    let mut out = value_header(model, key, container.len());
    out.extend_from_slice(container);
    out
}

/// The stored form of `snap` under `key` for `model`: [`seal_value`] of
/// its encoding, encoded in place.
pub fn seal_snapshot(model: &ModelDigest, key: &StoreKey, snap: &Snapshot) -> Vec<u8> {
    let mut out = value_header(model, key, snap.encoded_len());
    snap.encode_into(&mut out);
    out
}

/// Check a stored value's header and return its container bytes.
pub fn unseal_value<'a>(
    bytes: &'a [u8],
    model: &ModelDigest,
    key: &StoreKey,
) -> Result<&'a [u8], MissCause> {
    if bytes.len() < VALUE_HEADER_LEN {
        return Err(MissCause::Corrupt(format!(
            "value of {} bytes is shorter than its {VALUE_HEADER_LEN}-byte header",
            bytes.len()
        )));
    }
    if bytes[..8] != VALUE_MAGIC {
        return Err(MissCause::Corrupt("not a carry store value (magic)".into()));
    }
    let version = u32::from_le_bytes([bytes[8], bytes[9], bytes[10], bytes[11]]);
    if version != VALUE_VERSION {
        return Err(MissCause::Corrupt(format!(
            "value format version {version}, this build reads {VALUE_VERSION}"
        )));
    }
    let stored = u32::from_le_bytes([bytes[12], bytes[13], bytes[14], bytes[15]]);
    let computed = header_crc(bytes);
    if stored != computed {
        return Err(MissCause::Corrupt(format!(
            "value header CRC32 stored {stored:08x}, computed {computed:08x}"
        )));
    }
    if bytes[16..48] != model.0 {
        return Err(MissCause::Model);
    }
    if bytes[48..80] != key.0 {
        return Err(MissCause::Corrupt(
            "value was stored under another key".into(),
        ));
    }
    Ok(&bytes[VALUE_HEADER_LEN..])
}

/// Decode a stored value into the snapshot of the carry after `tokens`
/// for an engine of sites `sites`, or say why it cannot be used.
pub fn open_value(
    bytes: &[u8],
    model: &ModelDigest,
    key: &StoreKey,
    sites: &[SiteSpec],
    tokens: &[u32],
) -> Result<Snapshot, MissCause> {
    let container = unseal_value(bytes, model, key)?;
    let snap = Snapshot::decode_for(container, sites).map_err(|e| match e {
        SnapshotError::GeometryMismatch { .. }
        | SnapshotError::BlobCount { .. }
        | SnapshotError::BlobSize { .. }
        | SnapshotError::BlobHistory { .. } => MissCause::Geometry(e.to_string()),
        other => MissCause::Corrupt(other.to_string()),
    })?;
    if snap.token_count != tokens.len() as u64 {
        return Err(MissCause::Corrupt(format!(
            "snapshot after {} tokens stored under a prefix of {}",
            snap.token_count,
            tokens.len()
        )));
    }
    for (site, (g, blob)) in sites.iter().zip(&snap.blobs).enumerate() {
        let mut want = vec![g.dims.eos_token_id; g.dims.context_len()];
        g.dims.advance_history(&mut want, tokens);
        let fits = matches!(
            carry_blob::decode(blob, g).map(|b| b.history_tokens()),
            Ok(h) if h == want
        );
        if !fits {
            return Err(MissCause::Corrupt(format!(
                "site {site}: the carried history does not end the prefix"
            )));
        }
    }
    Ok(snap)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn header_round_trip_and_refusals() {
        let m = ModelDigest::of("m");
        let k = StoreKey([7; 32]);
        let v = seal_value(&m, &k, b"container");
        assert_eq!(unseal_value(&v, &m, &k).unwrap(), b"container");
        let snap = Snapshot {
            fingerprint: crate::snapshot::GeometryFingerprint(3),
            token_count: 2,
            blobs: vec![vec![1, 2, 3], vec![4]],
        };
        assert_eq!(
            seal_snapshot(&m, &k, &snap),
            seal_value(&m, &k, &snap.encode())
        );
        assert_eq!(
            unseal_value(&v, &ModelDigest::of("other"), &k),
            Err(MissCause::Model)
        );
        assert!(matches!(
            unseal_value(&v, &m, &StoreKey([8; 32])),
            Err(MissCause::Corrupt(_))
        ));
        for i in 0..VALUE_HEADER_LEN {
            let mut b = v.clone();
            b[i] ^= 0x10;
            assert!(
                matches!(unseal_value(&b, &m, &k), Err(MissCause::Corrupt(_))),
                "flip at {i}"
            );
        }
        for cut in 0..VALUE_HEADER_LEN {
            assert!(unseal_value(&v[..cut], &m, &k).is_err());
        }
    }
}
