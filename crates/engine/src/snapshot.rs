//! The snapshot container of docs/SPEC.md §8 (Snapshot container): a
//! sequence's carry at one token count, for every PLE site of a model, in a
//! self-describing, checksummed byte string.
//!
//! The per-site payload is the layer's aux blob unchanged, as docs/SPEC.md
//! §7 (Aux blob format) lays it out (sized and checked by
//! [`metrale_model_layers::layers::ple::carry_blob`]). Around the
//! blobs the container adds what is needed to refuse a snapshot that does not
//! fit: a magic number, a format version, a [`GeometryFingerprint`] of every
//! site's geometry and hash constants, the token count, and a CRC32.
//!
//! Layout (all integers little-endian):
//!
//! | offset | size | field |
//! |---|---|---|
//! | 0 | 8 | magic `MPLESNAP` |
//! | 8 | 4 | format version ([`FORMAT_VERSION`]) |
//! | 12 | 4 | flags, 0 in this version |
//! | 16 | 8 | total length in bytes, CRC included |
//! | 24 | 8 | geometry fingerprint |
//! | 32 | 8 | token count |
//! | 40 | 4 | blob count `n` |
//! | 44 | 4 | reserved, 0 |
//! | 48 | 8n | blob lengths |
//! | 48+8n | sum | the blobs, in site order |
//! | end-4 | 4 | CRC32 (IEEE) of every byte before it |
//!
//! Invariants:
//! - [`Snapshot::decode`] either returns a snapshot whose every length was
//!   checked against the bytes and whose CRC matched, or a typed
//!   [`SnapshotError`]; it never panics on any input;
//! - decoding is separate from applying: callers decode and
//!   [`Snapshot::validate_for`] the whole snapshot before touching any
//!   sequence state, so a refused snapshot changes nothing;
//! - the version is checked before the CRC, because a newer version may
//!   checksum differently; a newer snapshot is refused as such, not as
//!   corrupted.

use metrale_model_layers::layers::ple::carry_blob::{self, AuxBlobError};
use metrale_model_layers::layers::ple::ids::splitmix64;
use metrale_model_layers::layers::ple::spec::SiteSpec;
use thiserror::Error;

/// The magic number at offset 0.
pub const MAGIC: [u8; 8] = *b"MPLESNAP";
/// The format version this build writes and the newest it reads.
pub const FORMAT_VERSION: u32 = 1;
/// Bytes before the blob length table.
const HEADER_LEN: usize = 48;
/// Bytes of the trailing CRC.
const CRC_LEN: usize = 4;

/// A 64-bit digest of the geometry and hash constants of every site of an
/// engine, in site order.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct GeometryFingerprint(pub u64);

impl GeometryFingerprint {
    /// The fingerprint of `sites`: FNV-1a over a domain tag, the site count
    /// and each site's canonical encoding, finished with a splitmix64 round
    /// so that nearby inputs spread over all 64 bits.
    pub fn of(sites: &[SiteSpec]) -> Self {
        let mut buf = Vec::with_capacity(64 + sites.len() * 256);
        buf.extend_from_slice(b"metrale-ple geometry v1\0");
        buf.extend_from_slice(&(sites.len() as u64).to_le_bytes());
        for s in sites {
            s.encode_canonical(&mut buf);
        }
        let mut h: u64 = 0xcbf2_9ce4_8422_2325;
        for b in buf {
            h ^= b as u64;
            h = h.wrapping_mul(0x0000_0100_0000_01b3);
        }
        GeometryFingerprint(splitmix64(h))
    }
}

impl std::fmt::Display for GeometryFingerprint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{:016x}", self.0)
    }
}

/// Why a snapshot was refused.
#[derive(Debug, Error, Clone, PartialEq, Eq)]
pub enum SnapshotError {
    /// The bytes end before a field or region the container needs.
    #[error("snapshot truncated: {what} needs {needed} bytes, only {got} present")]
    Truncated {
        /// The field or region that does not fit.
        what: &'static str,
        /// Bytes it needs from the start of the snapshot.
        needed: u64,
        /// Bytes present.
        got: usize,
    },
    /// The first 8 bytes are not [`MAGIC`].
    #[error("not a PLE snapshot: magic is {found:02x?}, expected \"MPLESNAP\"")]
    BadMagic {
        /// The bytes found at offset 0.
        found: Vec<u8>,
    },
    /// Written by a newer format than this build reads.
    #[error(
        "snapshot format version {found} is newer than this build reads (up to {supported}); upgrade to restore it"
    )]
    NewerVersion {
        /// The version in the snapshot.
        found: u32,
        /// The newest version this build reads.
        supported: u32,
    },
    /// A version number no build ever wrote (0).
    #[error("snapshot format version {found} is not a valid version")]
    InvalidVersion {
        /// The version in the snapshot.
        found: u32,
    },
    /// More bytes than the header declares.
    #[error("snapshot has trailing bytes: header declares {declared} bytes, {got} present")]
    TrailingBytes {
        /// The length the header declares.
        declared: u64,
        /// Bytes present.
        got: usize,
    },
    /// The CRC does not match the contents.
    #[error("snapshot corrupted: CRC32 stored {stored:08x}, computed {computed:08x}")]
    Corrupted {
        /// The CRC at the end of the snapshot.
        stored: u32,
        /// The CRC of the bytes before it.
        computed: u32,
    },
    /// A header field is invalid although the CRC matched (a writer bug).
    #[error("snapshot malformed: {0}")]
    Malformed(String),
    /// The snapshot was taken by an engine of another geometry.
    #[error(
        "snapshot is for another geometry: fingerprint {found}, this engine is {expected} (PLE sites, hash constants or carry shape differ)"
    )]
    GeometryMismatch {
        /// This engine's fingerprint.
        expected: GeometryFingerprint,
        /// The snapshot's fingerprint.
        found: GeometryFingerprint,
    },
    /// The snapshot holds a different number of site blobs.
    #[error("snapshot holds {found} site blobs, this engine has {expected} PLE sites")]
    BlobCount {
        /// Sites of this engine.
        expected: usize,
        /// Blobs in the snapshot.
        found: usize,
    },
    /// One site's blob has the wrong size.
    #[error("snapshot blob of site {site} is {found} bytes, expected {expected}")]
    BlobSize {
        /// The site index.
        site: usize,
        /// The size this engine's geometry implies.
        expected: usize,
        /// The blob's size.
        found: usize,
    },
    /// One site's blob holds a history of the wrong length.
    #[error("snapshot blob of site {site} holds a history of {found} tokens, expected {expected}")]
    BlobHistory {
        /// The site index.
        site: usize,
        /// `context_len` of the site.
        expected: usize,
        /// The history length in the blob.
        found: usize,
    },
}

/// A decoded snapshot: the carry of one sequence at `token_count` tokens.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Snapshot {
    /// The fingerprint of the engine that took it.
    pub fingerprint: GeometryFingerprint,
    /// Tokens the sequence had run when it was taken.
    pub token_count: u64,
    /// One aux blob per PLE site, in site order.
    pub blobs: Vec<Vec<u8>>,
}

fn read_u32(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]])
}

fn read_u64(b: &[u8], at: usize) -> u64 {
    let mut a = [0u8; 8];
    a.copy_from_slice(&b[at..at + 8]);
    u64::from_le_bytes(a)
}

impl Snapshot {
    /// Bytes of [`Self::encode`]'s output.
    pub fn encoded_len(&self) -> usize {
        HEADER_LEN + 8 * self.blobs.len() + self.blobs.iter().map(Vec::len).sum::<usize>() + CRC_LEN
    }

    /// The container bytes.
    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(self.encoded_len());
        self.encode_into(&mut out);
        out
    }

    /// Append the container bytes to `out` (a stored value puts them
    /// behind its header without a second copy).
    pub fn encode_into(&self, out: &mut Vec<u8>) {
        let total = self.encoded_len();
        let start = out.len();
        out.reserve(total);
        out.extend_from_slice(&MAGIC);
        out.extend_from_slice(&FORMAT_VERSION.to_le_bytes());
        out.extend_from_slice(&0u32.to_le_bytes());
        out.extend_from_slice(&(total as u64).to_le_bytes());
        out.extend_from_slice(&self.fingerprint.0.to_le_bytes());
        out.extend_from_slice(&self.token_count.to_le_bytes());
        out.extend_from_slice(&(self.blobs.len() as u32).to_le_bytes());
        out.extend_from_slice(&0u32.to_le_bytes());
        for b in &self.blobs {
            out.extend_from_slice(&(b.len() as u64).to_le_bytes());
        }
        for b in &self.blobs {
            out.extend_from_slice(b);
        }
        let crc = crc32fast::hash(&out[start..]);
        out.extend_from_slice(&crc.to_le_bytes());
        debug_assert_eq!(out.len() - start, total);
    }

    /// Parse and check a container: magic, version, length, CRC and the blob
    /// table. Says nothing about whether it fits an engine; see
    /// [`Self::validate_for`].
    pub fn decode(bytes: &[u8]) -> Result<Snapshot, SnapshotError> {
        let got = bytes.len();
        if got < 12 {
            return Err(SnapshotError::Truncated {
                what: "the header",
                needed: 12,
                got,
            });
        }
        if bytes[..8] != MAGIC {
            return Err(SnapshotError::BadMagic {
                found: bytes[..8].to_vec(),
            });
        }
        let version = read_u32(bytes, 8);
        if version > FORMAT_VERSION {
            return Err(SnapshotError::NewerVersion {
                found: version,
                supported: FORMAT_VERSION,
            });
        }
        if version == 0 {
            return Err(SnapshotError::InvalidVersion { found: version });
        }
        if got < HEADER_LEN {
            return Err(SnapshotError::Truncated {
                what: "the header",
                needed: HEADER_LEN as u64,
                got,
            });
        }
        let declared = read_u64(bytes, 16);
        if declared > got as u64 {
            return Err(SnapshotError::Truncated {
                what: "the declared length",
                needed: declared,
                got,
            });
        }
        if declared < got as u64 {
            return Err(SnapshotError::TrailingBytes { declared, got });
        }
        if got < HEADER_LEN + CRC_LEN {
            return Err(SnapshotError::Malformed(format!(
                "declared length {declared} is shorter than a header and a CRC"
            )));
        }
        let body = got - CRC_LEN;
        let stored = read_u32(bytes, body);
        let computed = crc32fast::hash(&bytes[..body]);
        if stored != computed {
            return Err(SnapshotError::Corrupted { stored, computed });
        }
        let flags = read_u32(bytes, 12);
        if flags != 0 {
            return Err(SnapshotError::Malformed(format!(
                "flags {flags:#x} are set, version {version} defines none"
            )));
        }
        let reserved = read_u32(bytes, 44);
        if reserved != 0 {
            return Err(SnapshotError::Malformed(format!(
                "reserved field at offset 44 is {reserved:#x}, must be 0"
            )));
        }
        let fingerprint = GeometryFingerprint(read_u64(bytes, 24));
        let token_count = read_u64(bytes, 32);
        let count = read_u32(bytes, 40) as usize;
        let table_end = count
            .checked_mul(8)
            .and_then(|t| t.checked_add(HEADER_LEN))
            .filter(|&e| e <= body)
            .ok_or_else(|| {
                SnapshotError::Malformed(format!(
                    "blob count {count} needs a length table past the end of the data"
                ))
            })?;
        let mut lens = Vec::with_capacity(count);
        let mut sum: u64 = 0;
        for i in 0..count {
            let l = read_u64(bytes, HEADER_LEN + 8 * i);
            sum = sum.saturating_add(l);
            lens.push(l);
        }
        if sum != (body - table_end) as u64 {
            return Err(SnapshotError::Malformed(format!(
                "blob lengths sum to {sum} bytes, the data holds {}",
                body - table_end
            )));
        }
        let mut blobs = Vec::with_capacity(count);
        let mut at = table_end;
        for l in lens {
            // The sum check above bounds every length by the data length.
            let l = l as usize;
            blobs.push(bytes[at..at + l].to_vec());
            at += l;
        }
        Ok(Snapshot {
            fingerprint,
            token_count,
            blobs,
        })
    }

    /// Check that this snapshot fits an engine whose sites are `sites`: the
    /// fingerprint, the blob count, every blob's size and history length.
    pub fn validate_for(&self, sites: &[SiteSpec]) -> Result<(), SnapshotError> {
        let expected = GeometryFingerprint::of(sites);
        if self.fingerprint != expected {
            return Err(SnapshotError::GeometryMismatch {
                expected,
                found: self.fingerprint,
            });
        }
        if self.blobs.len() != sites.len() {
            return Err(SnapshotError::BlobCount {
                expected: sites.len(),
                found: self.blobs.len(),
            });
        }
        for (site, (blob, g)) in self.blobs.iter().zip(sites).enumerate() {
            // The size first: a blob of the wrong size is refused as such
            // whatever its header says.
            if blob.len() != g.aux_blob_len() {
                return Err(SnapshotError::BlobSize {
                    site,
                    expected: g.aux_blob_len(),
                    found: blob.len(),
                });
            }
            match carry_blob::decode(blob, g) {
                Ok(_) => {}
                Err(AuxBlobError::HistoryLen { expected, found }) => {
                    return Err(SnapshotError::BlobHistory {
                        site,
                        expected,
                        found,
                    });
                }
                Err(_) => {
                    return Err(SnapshotError::BlobSize {
                        site,
                        expected: g.aux_blob_len(),
                        found: blob.len(),
                    });
                }
            }
        }
        Ok(())
    }

    /// [`Self::decode`] then [`Self::validate_for`].
    pub fn decode_for(bytes: &[u8], sites: &[SiteSpec]) -> Result<Snapshot, SnapshotError> {
        let s = Self::decode(bytes)?;
        s.validate_for(sites)?;
        Ok(s)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    use metrale_model_layers::layers::ple::HashFamily;
    use metrale_model_layers::layers::ple::ids::PleIdDims;

    fn dims() -> PleIdDims {
        PleIdDims {
            ngram_size: 3,
            heads_per_ngram: 2,
            multipliers: vec![3, 5, 7],
            head_vocab_sizes: vec![11, 13, 17, 19],
            head_offsets: vec![0, 11, 24, 41],
            eos_token_id: 0,
            family: Default::default(),
        }
    }

    fn geom() -> SiteSpec {
        SiteSpec {
            family: HashFamily::Qwen4Exp,
            layer: 1,
            dims: dims(),
            head_dim: 8,
            hidden: 4,
            hc_mult: 2,
            kernel: 4,
            dilation: 3,
            rms_eps: 1e-6,
            combine: metrale_model_layers::layers::ple::Combine::qwen4exp(),
        }
    }

    fn blob(g: &SiteSpec, fill: u8) -> Vec<u8> {
        let mut b = (g.dims.context_len() as u32).to_le_bytes().to_vec();
        b.resize(g.aux_blob_len(), fill);
        b
    }

    fn snap(sites: &[SiteSpec]) -> Snapshot {
        Snapshot {
            fingerprint: GeometryFingerprint::of(sites),
            token_count: 42,
            blobs: sites
                .iter()
                .enumerate()
                .map(|(i, g)| blob(g, i as u8 + 1))
                .collect(),
        }
    }

    #[test]
    fn round_trip() {
        let sites = [geom(), geom()];
        let s = snap(&sites);
        let bytes = s.encode();
        assert_eq!(bytes.len(), s.encoded_len());
        assert_eq!(Snapshot::decode_for(&bytes, &sites).unwrap(), s);
    }

    #[test]
    fn fingerprint_sees_every_field() {
        let base = GeometryFingerprint::of(&[geom()]);
        let mut variants = Vec::new();
        let mut g = geom();
        g.dims.multipliers[2] = 9;
        variants.push(g);
        let mut g = geom();
        g.dims.head_vocab_sizes[3] = 23;
        variants.push(g);
        let mut g = geom();
        g.dims.head_offsets[1] = 12;
        variants.push(g);
        let mut g = geom();
        g.dims.eos_token_id = 1;
        variants.push(g);
        let mut g = geom();
        g.hidden = 8;
        variants.push(g);
        let mut g = geom();
        g.hc_mult = 4;
        variants.push(g);
        let mut g = geom();
        g.kernel = 3;
        variants.push(g);
        let mut g = geom();
        g.dilation = 2;
        variants.push(g);
        let mut g = geom();
        g.head_dim = 16;
        variants.push(g);
        for v in variants {
            assert_ne!(GeometryFingerprint::of(&[v]), base);
        }
        assert_ne!(GeometryFingerprint::of(&[geom(), geom()]), base);
        assert_eq!(GeometryFingerprint::of(&[geom()]), base);
        // The layer index and the eps do not change what a blob means.
        let mut g = geom();
        g.layer = 7;
        g.rms_eps = 1e-5;
        assert_eq!(GeometryFingerprint::of(&[g]), base);
    }

    /// The fingerprint of `geom()` as the first release of the format
    /// computed it.
    const FINGERPRINT_OF_GEOM: u64 = 0x53a8_ce51_f155_857a;

    /// The fingerprint is part of every stored snapshot: its value for a
    /// fixed geometry must never change.
    #[test]
    fn fingerprint_is_stable() {
        assert_eq!(GeometryFingerprint::of(&[geom()]).0, FINGERPRINT_OF_GEOM);
    }

    #[test]
    fn every_truncation_is_refused() {
        let bytes = snap(&[geom()]).encode();
        for cut in 0..bytes.len() {
            let e = Snapshot::decode(&bytes[..cut]).unwrap_err();
            assert!(
                matches!(e, SnapshotError::Truncated { .. }),
                "cut {cut}: {e}"
            );
        }
    }

    #[test]
    fn every_flipped_byte_is_refused() {
        let bytes = snap(&[geom()]).encode();
        for i in 0..bytes.len() {
            let mut b = bytes.clone();
            b[i] ^= 0x40;
            assert!(Snapshot::decode(&b).is_err(), "flip at {i} accepted");
        }
    }
}
