//! DeepSeek-V4.1's Engram table as released, and its conversion to the
//! rows the runtime serves.
//!
//! The release stores a layer's table as two tensors,
//! `layers.{L}.engram.embed.weight` F8_E4M3 `[rows, d]` and
//! `layers.{L}.engram.embed.scale` F8_E8M0 `[rows, d / 32]` (one UE8M0
//! scale per 32 values of a row). The row cache reads one row per miss, so
//! the runtime serves the inline layout instead
//! ([`RowDType::Fp8E4M3Block32`](metrale_storage::table::RowDType)): one
//! U8 tensor `[rows, d + d / 32]` under the weight's name, each row its `d`
//! value bytes then its `d / 32` scale bytes. [`convert_file`] rewrites a
//! safetensors file from the first layout to the second, which
//! `metrale-ple table pack` runs once per checkpoint: two reads a row at
//! serving time would double the I/O of a table too large to hold.
//!
//! Invariants:
//! - a split table is recognised from headers alone ([`is_block_scale`])
//!   and its pair of tensors checked (dtypes, shapes, equal rows) before
//!   any byte is written, and checked again on the headers the conversion
//!   reads;
//! - row `r` of the converted tensor is weight row `r` followed by scale
//!   row `r`, byte for byte; every other tensor of the file is copied
//!   unchanged and the scale tensor dropped;
//! - a UE8M0 scale of 255 (NaN) or an E4M3 NaN value is refused, naming
//!   the file, the tensor, the row and the element;
//! - the converted file appears complete or not at all (the safetensors
//!   writer's partial file is removed on any error).

use std::collections::BTreeMap;
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use metrale_storage::StorageError;
use metrale_storage::dtype::{FP8_BLOCK, fp8_block_row_bytes};
use metrale_storage::io::PAGE;
use metrale_storage::safetensors::{Dtype, Header, TensorInfo, TensorSpec, Writer};

use crate::error::{CheckpointError, Result};

/// One site's table stored as released: values and block scales apart.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SplitTable {
    /// The 0-based model layer of the site.
    pub layer: usize,
    /// Rows stored.
    pub rows: u64,
    /// Values per row.
    pub head_dim: usize,
    /// The file holding the values.
    pub weight_file: PathBuf,
    /// The values' tensor (`...embed.weight`), F8_E4M3 `[rows, head_dim]`;
    /// the converted tensor keeps this name.
    pub weight: String,
    /// The file holding the scales.
    pub scale_file: PathBuf,
    /// The scales' tensor (`...embed.scale`), F8_E8M0 `[rows, head_dim / 32]`.
    pub scale: String,
}

impl SplitTable {
    /// Scales per row.
    pub fn blocks(&self) -> usize {
        self.head_dim / FP8_BLOCK
    }

    /// Bytes of one converted row: the values, then the scales.
    pub fn row_bytes(&self) -> u64 {
        fp8_block_row_bytes(self.head_dim) as u64
    }

    /// The converted tensor: U8 `[rows, head_dim + head_dim / 32]`.
    pub fn inline_spec(&self) -> TensorSpec {
        TensorSpec::new(
            self.weight.clone(),
            Dtype::U8,
            &[self.rows, self.row_bytes()],
        )
    }
}

/// Whether `scale`, the tensor under a V4.1 table's scale name, holds the
/// release's block scales (F8_E8M0, or any two-dimensional tensor) rather
/// than the one F32 scale a row of this project's `fp8` tables has.
pub fn is_block_scale(scale: &TensorInfo) -> bool {
    scale.dtype == Dtype::F8E8M0 || scale.shape.len() == 2
}

/// Check the released pair of site tensors at model layer `layer` from
/// their headers: values F8_E4M3 `[rows, head_dim]` (rows > 0), scales
/// F8_E8M0 `[rows, head_dim / 32]`, `head_dim` a multiple of 32.
pub fn check_split(
    layer: usize,
    head_dim: usize,
    (wh, wt): (&Header, &TensorInfo),
    (sh, st): (&Header, &TensorInfo),
) -> Result<SplitTable> {
    if wt.dtype != Dtype::F8E4M3 {
        return Err(CheckpointError::DType {
            file: wh.path.clone(),
            tensor: wt.name.clone(),
            expected: Dtype::F8E4M3.name().into(),
            found: wt.dtype.name().into(),
        });
    }
    let hd = head_dim as u64;
    let rows = wt.shape.first().copied().unwrap_or(0);
    if wt.shape.len() != 2 || wt.shape[1] != hd || rows == 0 {
        return Err(CheckpointError::Shape {
            file: wh.path.clone(),
            tensor: wt.name.clone(),
            expected: vec![rows.max(1), hd],
            found: wt.shape.clone(),
        });
    }
    if head_dim == 0 || !head_dim.is_multiple_of(FP8_BLOCK) {
        return Err(CheckpointError::Value {
            file: wh.path.clone(),
            tensor: wt.name.clone(),
            msg: format!(
                "rows of {head_dim} values do not split into the {FP8_BLOCK}-value blocks its \
                 scales cover"
            ),
        });
    }
    if st.dtype != Dtype::F8E8M0 {
        return Err(CheckpointError::DType {
            file: sh.path.clone(),
            tensor: st.name.clone(),
            expected: Dtype::F8E8M0.name().into(),
            found: st.dtype.name().into(),
        });
    }
    let blocks = hd / FP8_BLOCK as u64;
    if st.shape != [rows, blocks] {
        return Err(CheckpointError::Shape {
            file: sh.path.clone(),
            tensor: st.name.clone(),
            expected: vec![rows, blocks],
            found: st.shape.clone(),
        });
    }
    Ok(SplitTable {
        layer,
        rows,
        head_dim,
        weight_file: wh.path.clone(),
        weight: wt.name.clone(),
        scale_file: sh.path.clone(),
        scale: st.name.clone(),
    })
}

fn header(path: &Path) -> Result<Header> {
    Header::read(path).map_err(|e| CheckpointError::Header {
        file: path.to_path_buf(),
        msg: format!("{e:#}"),
    })
}

fn storage_io(path: &Path, e: StorageError) -> CheckpointError {
    CheckpointError::Io {
        path: path.to_path_buf(),
        source: std::io::Error::other(format!("{e:#}")),
    }
}

fn read_at(f: &File, path: &Path, buf: &mut [u8], at: u64, what: &str) -> Result<()> {
    f.read_exact_at(buf, at).map_err(|e| CheckpointError::Io {
        path: path.to_path_buf(),
        source: std::io::Error::new(
            e.kind(),
            format!("reading {} bytes of {what} at offset {at}: {e}", buf.len()),
        ),
    })
}

/// Bytes read per step (and between progress calls).
const CHUNK: usize = 8 << 20;

/// Rewrite the safetensors file `src` into `dst` (data section aligned to
/// 4 KiB, as `table pack` leaves every file): each table of `tables` whose
/// values are in `src` becomes its inline tensor, every tensor under a
/// scale name of `tables` is dropped, every other tensor is copied as it
/// is. Calls
/// `progress(written, total)` with data bytes; returns the data bytes
/// written.
pub fn convert_file(
    src: &Path,
    dst: &Path,
    tables: &[SplitTable],
    progress: &mut dyn FnMut(u64, u64),
) -> Result<u64> {
    let h = header(src)?;
    let mine: Vec<&SplitTable> = tables.iter().filter(|t| t.weight_file == src).collect();
    // Any tensor under a scale's name goes, not only the one the weight
    // map names: a stray copy beside the values would make the inline
    // tensor read as per-row-scaled FP8.
    let dropped: Vec<&str> = tables.iter().map(|t| t.scale.as_str()).collect();
    // Check the pairs again on the headers read now: the data is read
    // from these extents.
    let mut scale_headers: BTreeMap<PathBuf, Header> = BTreeMap::new();
    for t in &mine {
        let wt = h
            .tensor(&t.weight)
            .ok_or_else(|| CheckpointError::MissingTensor {
                file: src.to_path_buf(),
                tensor: t.weight.clone(),
            })?;
        if !scale_headers.contains_key(&t.scale_file) {
            let sh = if t.scale_file == src {
                h.clone()
            } else {
                header(&t.scale_file)?
            };
            scale_headers.insert(t.scale_file.clone(), sh);
        }
        let sh = &scale_headers[&t.scale_file];
        let st = sh
            .tensor(&t.scale)
            .ok_or_else(|| CheckpointError::MissingTensor {
                file: t.scale_file.clone(),
                tensor: t.scale.clone(),
            })?;
        let again = check_split(t.layer, t.head_dim, (&h, wt), (sh, st))?;
        if again.rows != t.rows {
            return Err(CheckpointError::Shape {
                file: src.to_path_buf(),
                tensor: t.weight.clone(),
                expected: vec![t.rows, t.head_dim as u64],
                found: wt.shape.clone(),
            });
        }
    }
    let mut specs = Vec::with_capacity(h.tensors.len());
    for t in &h.tensors {
        if dropped.contains(&t.name.as_str()) {
            continue;
        }
        match mine.iter().find(|s| s.weight == t.name) {
            Some(s) => specs.push(s.inline_spec()),
            None => specs.push(TensorSpec::new(t.name.clone(), t.dtype, &t.shape)),
        }
    }
    let total = specs
        .iter()
        .map(TensorSpec::bytes)
        .sum::<std::result::Result<u64, _>>()
        .map_err(|e| storage_io(dst, e))?;
    let file = File::open(src).map_err(|e| CheckpointError::io(src, e))?;
    let mut w =
        Writer::create(dst, &specs, &h.metadata, PAGE as u64).map_err(|e| storage_io(dst, e))?;
    let mut done = 0u64;
    progress(0, total);
    let mut buf = vec![0u8; CHUNK];
    for t in &h.tensors {
        if dropped.contains(&t.name.as_str()) {
            continue;
        }
        if let Some(s) = mine.iter().find(|s| s.weight == t.name) {
            let sh = &scale_headers[&s.scale_file];
            let st = sh.get(&s.scale).map_err(|e| storage_io(&s.scale_file, e))?;
            let sf = if s.scale_file == src {
                file.try_clone().map_err(|e| CheckpointError::io(src, e))?
            } else {
                File::open(&s.scale_file).map_err(|e| CheckpointError::io(&s.scale_file, e))?
            };
            interleave(s, (&file, t.offset), (&sf, st.offset), &mut |bytes| {
                w.write(bytes).map_err(|e| storage_io(dst, e))?;
                done += bytes.len() as u64;
                progress(done, total);
                Ok(())
            })?;
            continue;
        }
        let mut at = 0u64;
        while at < t.len {
            let n = (t.len - at).min(CHUNK as u64) as usize;
            read_at(
                &file,
                src,
                &mut buf[..n],
                t.offset + at,
                &format!("tensor {}", t.name),
            )?;
            w.write(&buf[..n]).map_err(|e| storage_io(dst, e))?;
            at += n as u64;
            done += n as u64;
            progress(done, total);
        }
    }
    w.finish().map_err(|e| storage_io(dst, e))?;
    Ok(total)
}

/// Stream `s`'s rows, values from `(file, offset)` and scales from
/// `(file, offset)`, interleaved into `emit`, refusing NaN codes.
fn interleave(
    s: &SplitTable,
    (wf, woff): (&File, u64),
    (sf, soff): (&File, u64),
    emit: &mut dyn FnMut(&[u8]) -> Result<()>,
) -> Result<()> {
    let (hd, nb) = (s.head_dim, s.blocks());
    let rb = hd + nb;
    let step = (CHUNK / rb).max(1) as u64;
    let mut vals = Vec::new();
    let mut scales = Vec::new();
    let mut out = Vec::new();
    let mut r0 = 0u64;
    while r0 < s.rows {
        let m = (s.rows - r0).min(step) as usize;
        vals.resize(m * hd, 0);
        scales.resize(m * nb, 0);
        read_at(
            wf,
            &s.weight_file,
            &mut vals,
            woff + r0 * hd as u64,
            &format!("tensor {} (rows {r0}..)", s.weight),
        )?;
        read_at(
            sf,
            &s.scale_file,
            &mut scales,
            soff + r0 * nb as u64,
            &format!("tensor {} (rows {r0}..)", s.scale),
        )?;
        if let Some(i) = scales.iter().position(|&b| b == 255) {
            let r = r0 + (i / nb) as u64;
            return Err(CheckpointError::Value {
                file: s.scale_file.clone(),
                tensor: s.scale.clone(),
                msg: format!(
                    "scale {} of row {r} (element {}) is the UE8M0 NaN code 255",
                    i % nb,
                    r * nb as u64 + (i % nb) as u64
                ),
            });
        }
        // E4M3 has NaN at 0x7F and 0xFF only (no infinities).
        if let Some(i) = vals.iter().position(|&b| b & 0x7F == 0x7F) {
            let r = r0 + (i / hd) as u64;
            return Err(CheckpointError::Value {
                file: s.weight_file.clone(),
                tensor: s.weight.clone(),
                msg: format!(
                    "value {} of row {r} (element {}, byte {:#04x}) is an E4M3 NaN",
                    i % hd,
                    r * hd as u64 + (i % hd) as u64,
                    vals[i]
                ),
            });
        }
        out.clear();
        out.reserve(m * rb);
        for (v, sc) in vals.chunks_exact(hd).zip(scales.chunks_exact(nb)) {
            out.extend_from_slice(v);
            out.extend_from_slice(sc);
        }
        emit(&out)?;
        r0 += m as u64;
    }
    Ok(())
}

/// The weight map `text` (of `index`) with the scale tensors of `tables`
/// removed: after [`convert_file`] their bytes live inside the weight
/// tensors, which keep their names and files. Other keys stay as they
/// are (the total size is unchanged: `rows * (d + d / 32)` either way).
pub fn convert_index(text: &str, index: &Path, tables: &[SplitTable]) -> Result<String> {
    let bad = |msg: String| CheckpointError::Index {
        file: index.to_path_buf(),
        msg,
    };
    let mut v: serde_json::Value =
        serde_json::from_str(text).map_err(|e| bad(format!("not valid JSON: {e}")))?;
    let map = v
        .get_mut("weight_map")
        .and_then(|m| m.as_object_mut())
        .ok_or_else(|| bad("no weight_map object".into()))?;
    for t in tables {
        if map.remove(&t.scale).is_none() {
            return Err(CheckpointError::MissingTensor {
                file: index.to_path_buf(),
                tensor: t.scale.clone(),
            });
        }
        if !map.contains_key(&t.weight) {
            return Err(CheckpointError::MissingTensor {
                file: index.to_path_buf(),
                tensor: t.weight.clone(),
            });
        }
    }
    let mut out = serde_json::to_string_pretty(&v).expect("a JSON value always serialises");
    out.push('\n');
    Ok(out)
}
