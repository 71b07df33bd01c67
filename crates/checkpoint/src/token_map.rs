//! Engram's compressed-token map stored as a tensor of the checkpoint
//! ([`TOKEN_MAP_TENSOR`]), the alternative to the JSON file
//! [`crate::names::TOKEN_MAP_FILE`].
//!
//! The tensor is one-dimensional, I64, I32 or U32, entry `t` the compressed
//! id of raw token `t`. Every entry must be a `u32`; the loader then checks
//! the map against the config as it checks the file's. Invariant: the
//! decoder reads only the bytes the header declares and refuses, naming the
//! entry, any value that is not an id.

use metrale_storage::safetensors::Dtype;

pub use crate::names::TOKEN_MAP_TENSOR;

/// Why a token-map tensor cannot be read as ids.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TokenMapTensorError {
    /// Not a dtype a map of ids comes in.
    #[error("dtype {0} is not I64, I32 or U32")]
    DType(&'static str),
    /// Not a vector.
    #[error("shape {0:?} is not one-dimensional")]
    Shape(Vec<u64>),
    /// The byte count does not match the shape.
    #[error("{bytes} bytes for {entries} entries of {width} bytes")]
    Length {
        /// Bytes given.
        bytes: usize,
        /// Entries the shape declares.
        entries: u64,
        /// Bytes per entry.
        width: usize,
    },
    /// An entry outside `0..=u32::MAX`.
    #[error("entry {index} is {value}, not an id in 0..=4294967295")]
    Entry {
        /// The entry's index (the raw token).
        index: usize,
        /// Its value.
        value: i64,
    },
}

/// The ids of a token-map tensor of `dtype` and `shape` whose
/// little-endian payload is `bytes`.
pub fn decode_token_map(
    dtype: Dtype,
    shape: &[u64],
    bytes: &[u8],
) -> Result<Vec<u32>, TokenMapTensorError> {
    let width = match dtype {
        Dtype::I64 => 8,
        Dtype::I32 | Dtype::U32 => 4,
        other => return Err(TokenMapTensorError::DType(other.name())),
    };
    let &[entries] = shape else {
        return Err(TokenMapTensorError::Shape(shape.to_vec()));
    };
    if u64::try_from(bytes.len()).ok() != entries.checked_mul(width as u64) {
        return Err(TokenMapTensorError::Length {
            bytes: bytes.len(),
            entries,
            width,
        });
    }
    bytes
        .chunks_exact(width)
        .enumerate()
        .map(|(index, c)| {
            let value = match dtype {
                Dtype::I64 => i64::from_le_bytes(c.try_into().expect("8-byte chunk")),
                Dtype::I32 => i64::from(i32::from_le_bytes(c.try_into().expect("4-byte chunk"))),
                _ => i64::from(u32::from_le_bytes(c.try_into().expect("4-byte chunk"))),
            };
            u32::try_from(value).map_err(|_| TokenMapTensorError::Entry { index, value })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn decodes_every_dtype_and_names_what_is_wrong() {
        let ids = [0u32, 7, 3, u32::MAX];
        let i64s: Vec<u8> = ids
            .iter()
            .flat_map(|&v| i64::from(v).to_le_bytes())
            .collect();
        let u32s: Vec<u8> = ids.iter().flat_map(|&v| v.to_le_bytes()).collect();
        assert_eq!(decode_token_map(Dtype::I64, &[4], &i64s).unwrap(), ids);
        assert_eq!(decode_token_map(Dtype::U32, &[4], &u32s).unwrap(), ids);
        let i32s: Vec<u8> = [0i32, 7, 3].iter().flat_map(|v| v.to_le_bytes()).collect();
        assert_eq!(
            decode_token_map(Dtype::I32, &[3], &i32s).unwrap(),
            [0, 7, 3]
        );

        let neg: Vec<u8> = [1i64, -2].iter().flat_map(|v| v.to_le_bytes()).collect();
        assert_eq!(
            decode_token_map(Dtype::I64, &[2], &neg).unwrap_err(),
            TokenMapTensorError::Entry {
                index: 1,
                value: -2
            }
        );
        let big = (1i64 << 32).to_le_bytes();
        let e = decode_token_map(Dtype::I64, &[1], &big).unwrap_err();
        assert_eq!(
            e.to_string(),
            "entry 0 is 4294967296, not an id in 0..=4294967295"
        );
        assert!(matches!(
            decode_token_map(Dtype::F32, &[1], &[0; 4]),
            Err(TokenMapTensorError::DType("F32"))
        ));
        assert!(matches!(
            decode_token_map(Dtype::U32, &[2, 2], &[0; 16]),
            Err(TokenMapTensorError::Shape(_))
        ));
        assert!(matches!(
            decode_token_map(Dtype::U32, &[3], &[0; 8]),
            Err(TokenMapTensorError::Length { .. })
        ));
        assert!(matches!(
            decode_token_map(Dtype::I64, &[u64::MAX], &[]),
            Err(TokenMapTensorError::Length { .. })
        ));
    }
}
