//! The aux blob of docs/SPEC.md §7 (Aux blob format): one sequence's carry
//! at one site as bytes.
//!
//! Layout, all little-endian: `hist_len` (u32), then `hist_len` history
//! tokens (u32 each), then the conv state's `state_len * C` f32 values as
//! bytes. This is exactly what the seed's `snapshot_aux` writes and
//! `restore_aux` reads; [`encode`] and [`decode`] are the one definition
//! everything else (the layer's `snapshot` and `restore`, the engine's
//! snapshot container, swap, the prefix cache, Python) sizes, writes and
//! checks blobs with.
//!
//! Invariants: [`decode`] accepts a blob only when its history holds
//! exactly `context_len` tokens and the rest is exactly the site's conv
//! state, so an accepted blob always restores into a carry of that site.
//! [`decode_carry`] also accepts the blob of a carry that has not run yet
//! (an empty history), which is what such a carry snapshots to.

use thiserror::Error;

use super::spec::SiteSpec;

/// Bytes of the `hist_len` header.
const HEADER: usize = 4;

/// Bytes of a blob with `history_len` history tokens and `conv_bytes` of
/// conv state.
pub fn blob_len(history_len: usize, conv_bytes: usize) -> usize {
    HEADER + history_len * 4 + conv_bytes
}

/// [`blob_len`], or `None` when it overflows `usize`.
pub fn checked_blob_len(history_len: usize, conv_bytes: usize) -> Option<usize> {
    history_len
        .checked_mul(4)?
        .checked_add(HEADER)?
        .checked_add(conv_bytes)
}

/// Why a blob does not fit a site.
#[derive(Clone, Debug, PartialEq, Eq, Error)]
pub enum AuxBlobError {
    /// Shorter than its header or than the history it declares.
    #[error("PLE aux blob truncated: {len} bytes, {needed} needed for the header and history")]
    Truncated {
        /// The blob's length.
        len: usize,
        /// Bytes the header and the declared history need.
        needed: usize,
    },
    /// The history does not hold `context_len` tokens.
    #[error("PLE aux blob holds a history of {found} tokens, expected {expected}")]
    HistoryLen {
        /// `context_len` of the site.
        expected: usize,
        /// The `hist_len` in the blob.
        found: usize,
    },
    /// The bytes after the history are not one conv state of the site.
    #[error("PLE aux blob holds {found} bytes of conv state, expected {expected}")]
    ConvSize {
        /// `conv_bytes` of the site.
        expected: usize,
        /// The bytes after the history.
        found: usize,
    },
}

/// A decoded blob, borrowing the bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AuxBlobRef<'a> {
    /// The history tokens as little-endian u32 bytes (`4 * context_len`).
    pub history: &'a [u8],
    /// The conv state's f32 bytes.
    pub conv: &'a [u8],
}

impl AuxBlobRef<'_> {
    /// The history tokens.
    pub fn history_tokens(&self) -> Vec<u32> {
        self.history
            .chunks_exact(4)
            .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect()
    }
}

/// Encode a carry: `history` and the conv state's bytes.
pub fn encode(history: &[u32], conv_bytes: &[u8]) -> Vec<u8> {
    encode_with(history, conv_bytes.len(), |out| {
        out.copy_from_slice(conv_bytes);
        Ok::<(), std::convert::Infallible>(())
    })
    .unwrap_or_else(|never| match never {})
}

/// Encode a carry whose `conv_len` bytes of conv state `fill` writes in
/// place (a device download straight into the blob, say). The blob is
/// returned only when `fill` succeeds.
pub fn encode_with<E>(
    history: &[u32],
    conv_len: usize,
    fill: impl FnOnce(&mut [u8]) -> Result<(), E>,
) -> Result<Vec<u8>, E> {
    let mut blob = Vec::with_capacity(blob_len(history.len(), conv_len));
    blob.extend_from_slice(&(history.len() as u32).to_le_bytes());
    for t in history {
        blob.extend_from_slice(&t.to_le_bytes());
    }
    let off = blob.len();
    blob.resize(off + conv_len, 0);
    fill(&mut blob[off..])?;
    Ok(blob)
}

/// The blob of a fresh sequence at `spec`: `context_len` EOS tokens and a
/// zero conv state, the carry a reset installs.
pub fn fresh(spec: &SiteSpec) -> Vec<u8> {
    let history = vec![spec.dims.eos_token_id; spec.context_len()];
    encode(&history, &vec![0; spec.conv_bytes()])
}

/// The `hist_len` a blob declares, if it has a header.
pub fn declared_history_len(blob: &[u8]) -> Option<usize> {
    let h: [u8; HEADER] = blob.get(..HEADER)?.try_into().ok()?;
    Some(u32::from_le_bytes(h) as usize)
}

/// Check `blob` against `spec` and split it into history and conv state.
pub fn decode<'a>(blob: &'a [u8], spec: &SiteSpec) -> Result<AuxBlobRef<'a>, AuxBlobError> {
    split(blob, spec, false)
}

/// [`decode`], also accepting the blob of a carry that has not run (an
/// empty history, as such a carry snapshots to; its first forward resets
/// it). For restoring a carry, not for checking a snapshot of a sequence.
pub fn decode_carry<'a>(blob: &'a [u8], spec: &SiteSpec) -> Result<AuxBlobRef<'a>, AuxBlobError> {
    split(blob, spec, true)
}

fn split<'a>(
    blob: &'a [u8],
    spec: &SiteSpec,
    allow_unrun: bool,
) -> Result<AuxBlobRef<'a>, AuxBlobError> {
    let Some(found) = declared_history_len(blob) else {
        return Err(AuxBlobError::Truncated {
            len: blob.len(),
            needed: HEADER,
        });
    };
    let expected = spec.context_len();
    if found != expected && !(allow_unrun && found == 0) {
        return Err(AuxBlobError::HistoryLen { expected, found });
    }
    let hist_end = HEADER + 4 * found;
    if blob.len() < hist_end {
        return Err(AuxBlobError::Truncated {
            len: blob.len(),
            needed: hist_end,
        });
    }
    let conv = &blob[hist_end..];
    if conv.len() != spec.conv_bytes() {
        return Err(AuxBlobError::ConvSize {
            expected: spec.conv_bytes(),
            found: conv.len(),
        });
    }
    Ok(AuxBlobRef {
        history: &blob[HEADER..hist_end],
        conv,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::layers::ple::ids::PleIdDims;
    use crate::layers::ple::spec::HashFamily;

    fn spec() -> SiteSpec {
        SiteSpec {
            family: HashFamily::Qwen4Exp,
            layer: 0,
            dims: PleIdDims {
                ngram_size: 3,
                heads_per_ngram: 1,
                multipliers: vec![1, 3, 5],
                head_vocab_sizes: vec![7, 11],
                head_offsets: vec![0, 7],
                eos_token_id: 2,
                family: Default::default(),
            },
            head_dim: 4,
            hidden: 2,
            hc_mult: 1,
            kernel: 2,
            dilation: 1,
            rms_eps: 1e-6,
            combine: crate::layers::ple::spec::Combine::qwen4exp(),
        }
    }

    #[test]
    fn round_trip_and_refusals() {
        let s = spec();
        let conv: Vec<u8> = (0..s.conv_bytes() as u8).collect();
        let blob = encode(&[5, 6], &conv);
        assert_eq!(blob.len(), s.aux_blob_len());
        assert_eq!(&blob[..4], &2u32.to_le_bytes());
        let r = decode(&blob, &s).unwrap();
        assert_eq!(r.history_tokens(), vec![5, 6]);
        assert_eq!(r.conv, &conv[..]);

        assert_eq!(
            decode(&blob[..3], &s),
            Err(AuxBlobError::Truncated { len: 3, needed: 4 })
        );
        assert_eq!(
            decode(&blob[..8], &s),
            Err(AuxBlobError::Truncated { len: 8, needed: 12 })
        );
        assert_eq!(
            decode(&encode(&[1], &conv), &s),
            Err(AuxBlobError::HistoryLen {
                expected: 2,
                found: 1
            })
        );
        assert_eq!(
            decode(&blob[..blob.len() - 1], &s),
            Err(AuxBlobError::ConvSize {
                expected: 8,
                found: 7
            })
        );
        assert_eq!(checked_blob_len(usize::MAX, 0), None);

        // A carry that has not run: only `decode_carry` takes it.
        let unrun = encode(&[], &conv);
        assert_eq!(
            decode(&unrun, &s),
            Err(AuxBlobError::HistoryLen {
                expected: 2,
                found: 0
            })
        );
        let r = decode_carry(&unrun, &s).unwrap();
        assert!(r.history.is_empty());
        assert_eq!(r.conv, &conv[..]);
        assert_eq!(decode_carry(&blob, &s), decode(&blob, &s));
        assert!(decode_carry(&unrun[..unrun.len() - 1], &s).is_err());

        let f = fresh(&s);
        let r = decode(&f, &s).unwrap();
        assert_eq!(r.history_tokens(), vec![2, 2]);
        assert!(r.conv.iter().all(|&b| b == 0));
    }
}
