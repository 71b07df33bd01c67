//! Store keys: a SHA-256 digest of (model identity, geometry fingerprint,
//! block-aligned token prefix), and the model digest values carry.
//!
//! Invariants: a key is a pure function of its three inputs and of nothing
//! about the process or the build (the digest is spelled out here, not
//! taken from the standard library's unstable hashers), so every process
//! on every host agrees on it; the encoding is length-prefixed, so no two
//! distinct inputs are encoded alike.

use std::fmt;

use crate::snapshot::GeometryFingerprint;

pub use metrale_storage::digest::{Sha256, sha256};

use metrale_storage::digest::hex;

/// The digest of a model identity (a name, or a digest of a checkpoint's
/// configuration): what a stored value says it belongs to.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct ModelDigest(pub [u8; 32]);

impl ModelDigest {
    /// The digest of the identity string `id`.
    pub fn of(id: &str) -> ModelDigest {
        let mut h = Sha256::new();
        h.update(b"metrale-ple model v1\0");
        h.update(&(id.len() as u64).to_le_bytes());
        h.update(id.as_bytes());
        ModelDigest(h.finish())
    }
}

impl fmt::Debug for ModelDigest {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "ModelDigest({})", hex(&self.0[..8]))
    }
}

/// Where one snapshot lives in a store: the digest of (model, geometry,
/// token prefix).
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct StoreKey(pub [u8; 32]);

impl StoreKey {
    /// The key of the carry after `tokens` of model `model` on an engine of
    /// geometry `fingerprint`.
    pub fn of(model: &ModelDigest, fingerprint: GeometryFingerprint, tokens: &[u32]) -> StoreKey {
        let mut h = Sha256::new();
        h.update(b"metrale-ple carry key v1\0");
        h.update(&model.0);
        h.update(&fingerprint.0.to_le_bytes());
        h.update(&(tokens.len() as u64).to_le_bytes());
        let mut buf = [0u8; 4 * 256];
        for chunk in tokens.chunks(256) {
            for (o, t) in buf.chunks_exact_mut(4).zip(chunk) {
                o.copy_from_slice(&t.to_le_bytes());
            }
            h.update(&buf[..4 * chunk.len()]);
        }
        StoreKey(h.finish())
    }

    /// The key in lower-case hex (64 characters): file names and Redis keys
    /// are built from it.
    pub fn hex(&self) -> String {
        hex(&self.0)
    }
}

impl fmt::Debug for StoreKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "StoreKey({})", hex(&self.0[..8]))
    }
}

impl fmt::Display for StoreKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.hex())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_see_every_input() {
        let m = ModelDigest::of("a");
        let f = GeometryFingerprint(1);
        let k = StoreKey::of(&m, f, &[1, 2, 3, 4]);
        assert_eq!(k, StoreKey::of(&m, f, &[1, 2, 3, 4]));
        assert_ne!(k, StoreKey::of(&ModelDigest::of("b"), f, &[1, 2, 3, 4]));
        assert_ne!(k, StoreKey::of(&m, GeometryFingerprint(2), &[1, 2, 3, 4]));
        assert_ne!(k, StoreKey::of(&m, f, &[1, 2, 3, 5]));
        assert_ne!(k, StoreKey::of(&m, f, &[1, 2, 3]));
        assert_eq!(k.hex().len(), 64);
    }
}
