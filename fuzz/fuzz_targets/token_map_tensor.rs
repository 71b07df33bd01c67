//! Fuzz the decoder of Engram's token map stored as a tensor
//! (`metrale_checkpoint::token_map::decode_token_map`): the first byte picks
//! the dtype, the next eight the declared length, the rest is the payload.
//!
//! Nothing may panic. A decode succeeds exactly when the dtype is I64, I32
//! or U32, the payload holds the declared entries exactly, and every entry
//! is in `0..=u32::MAX`; then it returns one id per entry, each equal to
//! the entry.
#![no_main]

use libfuzzer_sys::fuzz_target;
use metrale_checkpoint::token_map::decode_token_map;
use metrale_storage::safetensors::Dtype;

const DTYPES: [Dtype; 5] = [Dtype::I64, Dtype::I32, Dtype::U32, Dtype::F32, Dtype::U8];

fuzz_target!(|data: &[u8]| {
    let Some((&pick, rest)) = data.split_first() else {
        return;
    };
    let Some((len, payload)) = rest.split_first_chunk::<8>() else {
        return;
    };
    let dtype = DTYPES[pick as usize % DTYPES.len()];
    // Mostly a length that fits the payload, sometimes the raw bytes.
    let width = dtype.size() as u64;
    let declared = if pick & 0x80 == 0 {
        payload.len() as u64 / width
    } else {
        u64::from_le_bytes(*len)
    };
    let shape: Vec<u64> = if pick & 0x40 == 0 {
        vec![declared]
    } else {
        vec![declared, 1]
    };
    let got = decode_token_map(dtype, &shape, payload);
    let entries: Option<Vec<i64>> = match dtype {
        Dtype::I64 => Some(
            payload
                .chunks_exact(8)
                .map(|c| i64::from_le_bytes(c.try_into().unwrap()))
                .collect(),
        ),
        Dtype::I32 => Some(
            payload
                .chunks_exact(4)
                .map(|c| i64::from(i32::from_le_bytes(c.try_into().unwrap())))
                .collect(),
        ),
        Dtype::U32 => Some(
            payload
                .chunks_exact(4)
                .map(|c| i64::from(u32::from_le_bytes(c.try_into().unwrap())))
                .collect(),
        ),
        _ => None,
    };
    let valid = entries.as_ref().filter(|_| {
        shape.len() == 1 && declared.checked_mul(width) == Some(payload.len() as u64)
    });
    match (valid, got) {
        (Some(e), Ok(ids)) => {
            assert_eq!(ids.len(), e.len());
            for (&i, &v) in ids.iter().zip(e) {
                assert_eq!(i64::from(i), v);
            }
        }
        (Some(e), Err(err)) => {
            assert!(
                e.iter().any(|&v| u32::try_from(v).is_err()),
                "refused a valid map: {err}"
            );
        }
        (None, Ok(_)) => panic!("accepted a malformed tensor"),
        (None, Err(_)) => {}
    }
});
