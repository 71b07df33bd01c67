//! SHA-256 for the digests shared between processes and hosts (carry
//! store keys, remote table digests), through the `sha2` crate; this
//! module keeps the one small face the rest of the project uses.
//!
//! Invariant: [`Sha256`] fed in any number of `update` calls gives the
//! digest of the bytes' concatenation.

use sha2::Digest as _;

/// The SHA-256 digest of `data` (FIPS 180-4).
pub fn sha256(data: &[u8]) -> [u8; 32] {
    sha2::Sha256::digest(data).into()
}

/// An incremental SHA-256.
#[derive(Clone, Default)]
pub struct Sha256(sha2::Sha256);

impl Sha256 {
    /// A fresh digest.
    pub fn new() -> Self {
        Sha256(sha2::Sha256::new())
    }

    /// Feed `data`.
    pub fn update(&mut self, data: &[u8]) {
        self.0.update(data);
    }

    /// The digest of everything fed.
    pub fn finish(self) -> [u8; 32] {
        self.0.finalize().into()
    }
}

/// `bytes` in lower-case hex.
pub fn hex(bytes: &[u8]) -> String {
    use std::fmt::Write as _;
    let mut s = String::with_capacity(bytes.len() * 2);
    for b in bytes {
        let _ = write!(s, "{b:02x}");
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sha256_vectors() {
        assert_eq!(
            hex(&sha256(b"")),
            "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"
        );
        assert_eq!(
            hex(&sha256(b"abc")),
            "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
        );
        let long = b"abcdbcdecdefdefgefghfghighijhijkijkljklmklmnlmnomnopnopq";
        assert_eq!(
            hex(&sha256(long)),
            "248d6a61d20638b8e5c026930c3e6039a33ce45964ff2167f6ecedd419db06c1"
        );
        // Split updates agree with one.
        let data: Vec<u8> = (0..1000u32).map(|i| (i * 7) as u8).collect();
        for cut in [0, 1, 63, 64, 65, 500, 999] {
            let mut h = Sha256::new();
            h.update(&data[..cut]);
            h.update(&data[cut..]);
            assert_eq!(h.finish(), sha256(&data));
        }
    }
}
