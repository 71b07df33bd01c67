//! Fuzz the safetensors header parser and the table-shard opener.
//!
//! The input is a whole file. Parsing must never panic; a header that is
//! accepted must describe tensors inside the file that do not overlap,
//! `Header::read` through a real file must agree with `Header::parse` on
//! the bytes, `read_tensor` must return exactly the bytes at each extent,
//! and a table opened from the file (padded rows declared in its metadata
//! or not) must locate its last row inside the file, keep rows apart, and
//! refuse the id one past the end.
#![no_main]

use std::path::PathBuf;
use std::sync::OnceLock;

use libfuzzer_sys::fuzz_target;
use metrale_storage::layout::{ShardSource, TableFiles};
use metrale_storage::safetensors::{Header, MAX_HEADER_BYTES};

/// One scratch file per fuzzing process.
fn scratch() -> &'static PathBuf {
    static P: OnceLock<PathBuf> = OnceLock::new();
    P.get_or_init(|| {
        std::env::temp_dir().join(format!("metrale-fuzz-st-{}.safetensors", std::process::id()))
    })
}

fuzz_target!(|data: &[u8]| {
    let path = scratch();
    let parsed = if data.len() >= 8 {
        let n = u64::from_le_bytes(data[..8].try_into().unwrap());
        if n <= MAX_HEADER_BYTES && 8 + n <= data.len() as u64 {
            Some(Header::parse(path, &data[8..8 + n as usize], data.len() as u64))
        } else {
            None
        }
    } else {
        None
    };
    std::fs::write(path, data).expect("write scratch file");
    let read = Header::read(path);
    match (&parsed, &read) {
        (Some(Ok(_)), Err(e)) => panic!("parse accepted what read refused: {e:#}"),
        (Some(Err(_)), Ok(_)) => panic!("read accepted what parse refused"),
        (None, Ok(_)) => panic!("read accepted a header length out of range"),
        _ => {}
    }
    let Ok(h) = read else { return };
    let len = data.len() as u64;
    let mut end = h.data_start;
    for t in &h.tensors {
        assert!(t.offset >= end, "tensor {} overlaps the previous one or the header", t.name);
        end = t.offset + t.len;
        assert!(end <= len, "tensor {} ends past the file", t.name);
        assert!(h.tensor(&t.name).is_some());
        let bytes = h.read_tensor(&t.name).expect("read a checked extent");
        assert_eq!(&bytes[..], &data[t.offset as usize..end as usize], "tensor {}", t.name);
    }
    // Every 2-D tensor is tried as a one-shard table, its scale looked for
    // under the name the next tensor has (any name will do: storage takes
    // what it is given).
    let names: Vec<String> = h.tensors.iter().map(|t| t.name.clone()).collect();
    for (i, weight) in names.iter().enumerate() {
        let scale = names.get(i + 1).cloned();
        let Ok(files) = TableFiles::open(&[ShardSource::new(path, weight, scale)], None) else {
            continue;
        };
        let rows = files.info.rows;
        assert!(rows > 0);
        assert!(files.row_stride >= files.info.row_bytes() as u64, "rows overlap");
        let last = files.locate(rows - 1).expect("last row");
        assert!(last.offset + files.info.row_bytes() as u64 <= len, "last row past the file");
        if let Some(s) = last.scale_offset {
            assert!(s + 4 <= len, "last scale past the file");
        }
        assert!(files.locate(rows).is_err(), "id past the end accepted");
    }
});
