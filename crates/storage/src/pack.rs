//! `pack`: rewrite a safetensors file so its data section starts on a
//! 4 KiB boundary, keeping it valid safetensors.
//!
//! The header is re-emitted with the same tensors, offsets and metadata and
//! padded with trailing spaces (which the format allows); the data section
//! is copied byte for byte, so every tensor's relative `data_offsets` stay
//! as they were and a table row that was at relative offset `o` lands on
//! absolute offset `4096 k + o`.
//!
//! Invariants: the destination appears only complete (written to a
//! temporary file beside it, synced, then renamed); on any error the
//! temporary file is removed and the destination left untouched; the
//! source is never written.

use std::fs::File;
use std::io::Write;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use crate::error::{IoContext, Result, StorageError};
use crate::io::PAGE;
use crate::safetensors::{Header, TensorSpec, encode_header};

/// Bytes copied per step (and between progress calls).
const CHUNK: usize = 8 << 20;

/// What a pack did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PackReport {
    /// Data section offset before.
    pub old_data_start: u64,
    /// Data section offset after (a multiple of 4096).
    pub new_data_start: u64,
    /// Bytes of tensor data copied.
    pub data_bytes: u64,
}

/// Rewrite `src` into `dst` with a 4 KiB-aligned data section, calling
/// `progress(copied, total)` as data bytes are copied.
pub fn pack(src: &Path, dst: &Path, progress: &mut dyn FnMut(u64, u64)) -> Result<PackReport> {
    let h = Header::read(src)?;
    if let (Ok(a), Ok(b)) = (src.canonicalize(), dst.canonicalize())
        && a == b
    {
        return Err(StorageError::invalid(format!(
            "pack: source and destination are the same file ({})",
            src.display()
        )));
    }
    let entries: Vec<(TensorSpec, (u64, u64))> = h
        .tensors
        .iter()
        .map(|t| {
            let b = t.offset - h.data_start;
            (
                TensorSpec {
                    name: t.name.clone(),
                    dtype: t.dtype,
                    shape: t.shape.clone(),
                },
                (b, b + t.len),
            )
        })
        .collect();
    let header = encode_header(&entries, &h.metadata, PAGE as u64)?;
    let data_bytes = h.file_len - h.data_start;
    let tmp = tmp_path(dst);
    let r = write_packed(&h, &header, data_bytes, &tmp, progress);
    if let Err(e) = r {
        let _ = std::fs::remove_file(&tmp);
        return Err(e);
    }
    if let Err(e) = std::fs::rename(&tmp, dst) {
        let _ = std::fs::remove_file(&tmp);
        return Err(StorageError::io(
            &tmp,
            format!("pack: renaming to {}", dst.display()),
            e,
        ));
    }
    Ok(PackReport {
        old_data_start: h.data_start,
        new_data_start: header.len() as u64,
        data_bytes,
    })
}

fn tmp_path(dst: &Path) -> PathBuf {
    let mut name = dst
        .file_name()
        .map(|n| n.to_os_string())
        .unwrap_or_default();
    name.push(".packing");
    dst.with_file_name(name)
}

fn write_packed(
    h: &Header,
    header: &[u8],
    data_bytes: u64,
    tmp: &Path,
    progress: &mut dyn FnMut(u64, u64),
) -> Result<()> {
    let src = File::open(&h.path).io_ctx(&h.path, || "pack: opening")?;
    let mut out = File::create(tmp).io_ctx(tmp, || "pack: creating")?;
    out.write_all(header)
        .io_ctx_at(tmp, 0, || "pack: writing the header")?;
    let mut buf = vec![0u8; CHUNK.min(data_bytes as usize).max(1)];
    let mut done = 0u64;
    progress(0, data_bytes);
    while done < data_bytes {
        let n = (data_bytes - done).min(buf.len() as u64) as usize;
        let at = h.data_start + done;
        src.read_exact_at(&mut buf[..n], at)
            .io_ctx_at(&h.path, at, || {
                format!("pack: reading {n} bytes at offset {at} (truncated?)")
            })?;
        out.write_all(&buf[..n])
            .io_ctx(tmp, || format!("pack: writing {n} bytes"))?;
        done += n as u64;
        progress(done, data_bytes);
    }
    out.sync_all().io_ctx(tmp, || "pack: syncing")?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::safetensors::{Dtype, Writer};
    use std::collections::BTreeMap;

    #[test]
    fn pack_aligns_and_round_trips() {
        let d = tempfile::tempdir().unwrap();
        let src = d.path().join("a.safetensors");
        let dst = d.path().join("b.safetensors");
        let specs = [
            TensorSpec::new("m.ngram_embedding.shard_0.weight", Dtype::BF16, &[37, 5]),
            TensorSpec::new("odd name \"quoted\"", Dtype::U8, &[3]),
            TensorSpec::new("s", Dtype::F32, &[2]),
        ];
        let mut md = BTreeMap::new();
        md.insert("format".into(), "pt".into());
        let mut w = Writer::create(&src, &specs, &md, 8).unwrap();
        let data: Vec<u8> = (0..37 * 5 * 2 + 3 + 8)
            .map(|i| (i * 31 % 251) as u8)
            .collect();
        w.write(&data).unwrap();
        w.finish().unwrap();
        let before = Header::read(&src).unwrap();
        assert_ne!(
            before.data_start % 4096,
            0,
            "the test needs an unaligned source"
        );
        let mut calls = Vec::new();
        let rep = pack(&src, &dst, &mut |a, b| calls.push((a, b))).unwrap();
        assert_eq!(rep.new_data_start % 4096, 0);
        assert_eq!(calls.last(), Some(&(data.len() as u64, data.len() as u64)));
        let after = Header::read(&dst).unwrap();
        assert_eq!(after.data_start, rep.new_data_start);
        assert_eq!(after.metadata, md);
        for t in &before.tensors {
            let u = after.get(&t.name).unwrap();
            assert_eq!((u.dtype, &u.shape, u.len), (t.dtype, &t.shape, t.len));
            assert_eq!(u.offset - after.data_start, t.offset - before.data_start);
            assert_eq!(
                after.read_tensor(&t.name).unwrap(),
                before.read_tensor(&t.name).unwrap()
            );
        }
        // Packing a packed file is a fixed point of the layout.
        let again = d.path().join("c.safetensors");
        let rep2 = pack(&dst, &again, &mut |_, _| {}).unwrap();
        assert_eq!(rep2.new_data_start, rep.new_data_start);
        assert!(!tmp_path(&dst).exists());
    }

    #[test]
    fn pack_refuses_bad_input_and_leaves_nothing() {
        let d = tempfile::tempdir().unwrap();
        let src = d.path().join("a.safetensors");
        crate::safetensors::write_file(
            &src,
            &[(TensorSpec::new("t", Dtype::U8, &[4]), &[1, 2, 3, 4])],
            8,
        )
        .unwrap();
        let e = pack(&src, &src, &mut |_, _| {}).unwrap_err().to_string();
        assert!(e.contains("same file"), "{e}");
        let bad = d.path().join("bad.safetensors");
        std::fs::write(&bad, b"\x02\0\0\0\0\0\0\0{}").unwrap();
        let dst = d.path().join("out.safetensors");
        assert!(
            pack(&bad, &dst, &mut |_, _| {}).is_ok(),
            "an empty but valid file packs"
        );
        std::fs::write(&bad, b"\x05\0\0\0\0\0\0\0{oops").unwrap();
        let dst2 = d.path().join("out2.safetensors");
        let e = format!("{:#}", pack(&bad, &dst2, &mut |_, _| {}).unwrap_err());
        assert!(e.contains("bad.safetensors"), "{e}");
        assert!(!dst2.exists() && !tmp_path(&dst2).exists());
    }
}
