//! `pack`: rewrite a safetensors file so its data section starts on a
//! 4 KiB boundary, keeping it valid safetensors.
//!
//! The header is re-emitted with the same tensors, offsets and metadata and
//! padded with trailing spaces (which the format allows); the data section
//! is copied byte for byte, so every tensor's relative `data_offsets` stay
//! as they were and a table row that was at relative offset `o` lands on
//! absolute offset `4096 k + o`.
//!
//! [`pad_rows`] also pads the rows of named table tensors to a stride that
//! keeps every row inside the fewest direct-I/O granules
//! ([`crate::layout::padded_stride`]: 320-byte rows become 512 bytes
//! apart), declaring each row's own width in the file's metadata
//! ([`crate::layout::row_width_key`]). The tables go first in the data
//! section, widest stride first, so each starts on a multiple of its stride
//! (or of the granule); the other tensors follow, copied byte for byte.
//! The file stays valid safetensors (no holes), the tensors' values are
//! unchanged, and a row miss then reads one granule instead of two for
//! half of such rows (320-byte rows, 512-byte granules), at the cost of the padding on disk.
//!
//! Invariants: the destination appears only complete (written to a
//! temporary file beside it, synced, then renamed); on any error the
//! temporary file is removed and the destination left untouched; the
//! source is never written.

use std::collections::BTreeMap;
use std::fs::File;
use std::io::Write;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use crate::error::{IoContext, Result, StorageError};
use crate::io::PAGE;
use crate::layout::{declared_row_width, padded_stride, row_width_key};
use crate::safetensors::{Header, TensorInfo, TensorSpec, Writer, encode_header};

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
    refuse_same_file("pack", src, dst)?;
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

/// One table tensor [`pad_rows`] wrote.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PaddedTable {
    /// The tensor.
    pub tensor: String,
    /// Bytes of one row's values.
    pub row_bytes: u64,
    /// Bytes from one row to the next, as written.
    pub stride: u64,
}

/// Rewrite `src` into `dst` with a 4 KiB-aligned data section and the rows
/// of each tensor in `tables` (2-D, `[rows, width]`) padded for reads of
/// `granule`-byte direct-I/O granules (see the module docs), calling
/// `progress(copied, total)` as source data bytes are copied.
pub fn pad_rows(
    src: &Path,
    dst: &Path,
    tables: &[String],
    granule: u64,
    progress: &mut dyn FnMut(u64, u64),
) -> Result<Vec<PaddedTable>> {
    let h = Header::read(src)?;
    refuse_same_file("pad", src, dst)?;
    if granule == 0 || !granule.is_power_of_two() {
        return Err(StorageError::invalid(format!(
            "pad: the granule must be a power of two, not {granule}"
        )));
    }
    // (tensor, values per row, source stride in bytes, new stride).
    let mut padded: Vec<(&TensorInfo, u64, u64, u64)> = Vec::with_capacity(tables.len());
    for name in tables {
        let t = h.get(name)?;
        if t.shape.len() != 2 || t.shape[0] == 0 || t.shape[1] == 0 {
            return Err(StorageError::Header {
                path: h.path.clone(),
                tensor: Some(name.clone()),
                field: Some("shape".into()),
                message: format!("{:?} is not [rows, width] (a table to pad)", t.shape),
            });
        }
        let es = t.dtype.size() as u64;
        let width = declared_row_width(&h, name)?.unwrap_or(t.shape[1]);
        let row_bytes = width * es;
        let stride = padded_stride(row_bytes, granule);
        if !stride.is_multiple_of(es) {
            return Err(StorageError::invalid(format!(
                "pad: {}: tensor '{name}': a stride of {stride} bytes is not whole {} elements",
                h.path.display(),
                t.dtype.name()
            )));
        }
        if padded.iter().any(|p| p.0.name == *name) {
            return Err(StorageError::invalid(format!(
                "pad: tensor '{name}' named twice"
            )));
        }
        padded.push((t, width, t.shape[1] * es, stride));
    }
    // Widest stride first: each table then starts on a multiple of its
    // stride (powers of two up to the granule, multiples of it above).
    padded.sort_by(|a, b| b.3.cmp(&a.3).then(a.0.offset.cmp(&b.0.offset)));
    let mut rest: Vec<&TensorInfo> = h
        .tensors
        .iter()
        .filter(|t| !padded.iter().any(|p| p.0.name == t.name))
        .collect();
    rest.sort_by_key(|t| t.offset);
    let mut specs = Vec::with_capacity(h.tensors.len());
    let mut metadata: BTreeMap<String, String> = h.metadata.clone();
    for &(t, width, _, stride) in &padded {
        let es = t.dtype.size() as u64;
        specs.push(TensorSpec::new(
            t.name.clone(),
            t.dtype,
            &[t.shape[0], stride / es],
        ));
        let key = row_width_key(&t.name);
        if stride / es == width {
            metadata.remove(&key);
        } else {
            metadata.insert(key, width.to_string());
        }
    }
    specs.extend(
        rest.iter()
            .map(|t| TensorSpec::new(t.name.clone(), t.dtype, &t.shape)),
    );
    let total: u64 = h.tensors.iter().map(|t| t.len).sum();
    let file = File::open(&h.path).io_ctx(&h.path, || "pad: opening")?;
    let mut w = Writer::create(dst, &specs, &metadata, PAGE as u64)?;
    let mut done = 0u64;
    progress(0, total);
    let mut buf = vec![0u8; CHUNK];
    for &(t, width, from, stride) in &padded {
        let row_bytes = width * t.dtype.size() as u64;
        let per = (CHUNK as u64 / from.max(stride)).max(1);
        let mut out = vec![0u8; (per * stride) as usize];
        if buf.len() < (per * from) as usize {
            buf.resize((per * from) as usize, 0);
        }
        let rows = t.shape[0];
        let mut r = 0u64;
        while r < rows {
            let n = (rows - r).min(per);
            let at = t.offset + r * from;
            let len = (n * from) as usize;
            file.read_exact_at(&mut buf[..len], at)
                .io_ctx_at(&h.path, at, || {
                    format!("pad: reading rows {r}.. of '{}' (truncated?)", t.name)
                })?;
            for i in 0..n as usize {
                let (a, b) = (i * from as usize, i * stride as usize);
                out[b..b + row_bytes as usize].copy_from_slice(&buf[a..a + row_bytes as usize]);
            }
            w.write(&out[..(n * stride) as usize])?;
            r += n;
            done += len as u64;
            progress(done, total);
        }
    }
    for t in rest {
        let mut left = t.len;
        let mut at = t.offset;
        while left > 0 {
            let n = left.min(buf.len() as u64) as usize;
            file.read_exact_at(&mut buf[..n], at)
                .io_ctx_at(&h.path, at, || {
                    format!("pad: reading '{}' (truncated?)", t.name)
                })?;
            w.write(&buf[..n])?;
            at += n as u64;
            left -= n as u64;
            done += n as u64;
            progress(done, total);
        }
    }
    w.finish()?;
    Ok(padded
        .iter()
        .map(|&(t, width, _, stride)| PaddedTable {
            tensor: t.name.clone(),
            row_bytes: width * t.dtype.size() as u64,
            stride,
        })
        .collect())
}

/// An error when `src` and `dst` name one file (a rewrite in place would
/// read what it has already overwritten).
fn refuse_same_file(what: &str, src: &Path, dst: &Path) -> Result<()> {
    match (src.canonicalize(), dst.canonicalize()) {
        (Ok(a), Ok(b)) if a == b => Err(StorageError::invalid(format!(
            "{what}: source and destination are the same file ({})",
            src.display()
        ))),
        _ => Ok(()),
    }
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
