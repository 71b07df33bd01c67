//! Where each table row lives on disk: the shard opener.
//!
//! A table is stored as shards: 2-D tensors `[rows_per_shard, head_dim]`,
//! all equal, either BF16, F32 or FP8 E4M3 (`F8_E4M3`, or `U8` holding
//! E4M3 bytes), each named by the caller with its file ([`ShardSource`]):
//! this crate spells no tensor name, the checkpoint's names module does.
//! FP8 shards carry the companion tensor the source names as its scale,
//! `[rows_per_shard]` F32 in the same file. A `U8` shard without that
//! companion whose width is `33 * d / 32` holds block-scaled FP8 rows of
//! `d` values, their UE8M0 scales inline ([`RowDType::Fp8E4M3Block32`]).
//! Row id `r` lives in shard `r / rows_per_shard` at row `r % rows_per_shard`.
//!
//! A shard may store its rows padded (`table pack --pad-rows`): the tensor
//! is wider than a row, and the file's `__metadata__` entry
//! `metrale.row_width.{tensor}` ([`row_width_key`]) gives the row's own
//! width in elements. Row `r` then starts `r * row_stride` bytes into the
//! tensor and only its first `row_bytes` bytes are read; the padding lets a
//! stride that divides the direct-I/O granule keep every row inside one
//! granule, so a miss reads one granule instead of two.
//!
//! A table split as transformers splits it (`torch.chunk` into
//! `split_ngram_parts`) has shards of `ceil(rows / parts)` rows and a last
//! one that may hold fewer; the id arithmetic is the same.
//!
//! Invariants of an opened [`TableFiles`]:
//! - every shard has the same width, dtype and stride, and every shard but
//!   the last `rows_per_shard` rows (the last at most that many), checked
//!   at open from the headers alone (no data is read);
//! - `info.rows` is the sum of the shards' rows, and, when the caller
//!   states the expected row count, equal to it;
//! - [`TableFiles::locate`] refuses ids `>= info.rows` with an error naming
//!   the id and the table size;
//! - `row_stride >= info.row_bytes()`, equal unless the shards declare
//!   padded rows, and every shard has the same stride.

use std::path::PathBuf;

use crate::error::{Result, StorageError};
use crate::safetensors::{Dtype, Header};
use crate::table::{RowDType, TableInfo};

/// One shard: a file and the extents of its rows (and scales).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Shard {
    /// The safetensors file.
    pub path: PathBuf,
    /// The weight tensor's name.
    pub tensor: String,
    /// The scale tensor's name as the shard was opened with it.
    pub scale: Option<String>,
    /// Absolute offset of the shard's first row.
    pub data_offset: u64,
    /// Absolute offset of the shard's first f32 scale (FP8 only).
    pub scale_offset: Option<u64>,
    /// The file's length when opened.
    pub file_len: u64,
    /// Rows this shard holds: [`TableFiles::rows_per_shard`], or fewer for
    /// the last shard of a table cut as `torch.chunk` cuts it.
    pub rows: u64,
}

/// One stored shard as its caller names it: the file, the weight tensor
/// and the tensor that would hold its per-row FP8 scales.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct ShardSource {
    /// The safetensors file.
    pub path: PathBuf,
    /// The weight tensor's name.
    pub weight: String,
    /// The name of its companion scale tensor, looked for in the same
    /// file; `None` when the shard can have none.
    pub scale: Option<String>,
}

impl ShardSource {
    /// The shard `weight` in `path`, its scales (if any) in `scale`.
    pub fn new(path: impl Into<PathBuf>, weight: impl Into<String>, scale: Option<String>) -> Self {
        ShardSource {
            path: path.into(),
            weight: weight.into(),
            scale,
        }
    }
}

impl Shard {
    /// This shard's tensors in another file (a copy of it).
    pub fn source_in(&self, path: impl Into<PathBuf>) -> ShardSource {
        ShardSource::new(path, self.tensor.clone(), self.scale.clone())
    }
}

/// Where one row is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RowLoc {
    /// Index into [`TableFiles::shards`].
    pub shard: usize,
    /// Absolute offset of the row's values in that shard's file.
    pub offset: u64,
    /// Absolute offset of the row's f32 scale (FP8 only).
    pub scale_offset: Option<u64>,
}

/// An opened, validated set of table shards.
#[derive(Clone, Debug)]
pub struct TableFiles {
    /// Shape of the whole table.
    pub info: TableInfo,
    /// Rows in each shard.
    pub rows_per_shard: u64,
    /// Bytes from one row's start to the next on disk: the row's bytes, or
    /// more for padded rows.
    pub row_stride: u64,
    /// The shards, in id order.
    pub shards: Vec<Shard>,
}

/// The `__metadata__` key that declares the rows of table tensor `tensor`
/// narrower than the tensor (padded rows).
pub fn row_width_key(tensor: &str) -> String {
    format!("metrale.row_width.{tensor}")
}

/// The row width (elements) `h` declares for `tensor` ([`row_width_key`]):
/// `None` when not declared, an error naming the file, tensor and key when
/// the value is not a whole number from 1 to the tensor's stored width.
pub fn declared_row_width(h: &Header, tensor: &str) -> Result<Option<u64>> {
    let key = row_width_key(tensor);
    let Some(v) = h.metadata.get(&key) else {
        return Ok(None);
    };
    let stored = h
        .tensor(tensor)
        .and_then(|t| (t.shape.len() == 2).then(|| t.shape[1]));
    match (v.trim().parse::<u64>(), stored) {
        (Ok(w), Some(s)) if w >= 1 && w <= s => Ok(Some(w)),
        _ => Err(StorageError::Header {
            path: h.path.clone(),
            tensor: Some(tensor.to_string()),
            field: Some(format!("__metadata__.{key}")),
            message: format!(
                "'{v}' is not a row width from 1 to the tensor's stored width{}",
                stored.map_or(String::new(), |s| format!(" ({s})"))
            ),
        }),
    }
}

/// The stride (bytes, a power of two up to `granule`, else a multiple of
/// it) that keeps rows of `row_bytes` each in the fewest granules:
/// rows at multiples of it never straddle a granule boundary they need not.
pub fn padded_stride(row_bytes: u64, granule: u64) -> u64 {
    let g = granule.max(1);
    if row_bytes <= g && g.is_power_of_two() {
        row_bytes.next_power_of_two()
    } else {
        row_bytes.next_multiple_of(g)
    }
}

impl TableFiles {
    /// Open the shards, in id order, checking equal shapes and, when
    /// given, the total row count.
    pub fn open(shards: &[ShardSource], expected_rows: Option<u64>) -> Result<TableFiles> {
        if shards.is_empty() {
            return Err(StorageError::layout(
                None,
                None,
                "a table needs at least one shard",
            ));
        }
        let mut out = Vec::with_capacity(shards.len());
        let mut geom: Option<(u64, u64, RowDType, u64, String)> = None;
        for (i, src) in shards.iter().enumerate() {
            let (path, name) = (&src.path, &src.weight);
            let h = Header::read(path)?;
            let p = path.display();
            let err = |m: String| StorageError::layout(Some(path.clone()), Some(i), m);
            let t = h.get(name)?;
            let scale = src.scale.as_deref().and_then(|sn| h.tensor(sn));
            if t.shape.len() != 2 {
                return Err(err(format!(
                    "{p}: shard {i} tensor '{name}': shape {:?} is not [rows_per_shard, head_dim]",
                    t.shape
                )));
            }
            let block = crate::dtype::FP8_BLOCK as u64 + 1;
            let stored = t.shape[1];
            let width = declared_row_width(&h, name)?.unwrap_or(stored);
            let dtype = match t.dtype {
                Dtype::BF16 => RowDType::Bf16,
                Dtype::F32 => RowDType::F32,
                // Bytes with no per-row scale beside them, `33 * d / 32`
                // wide: FP8 rows of `d` values with their UE8M0 block scales
                // inline (DeepSeek-V4.1's table).
                Dtype::U8 if scale.is_none() && width > 0 && width % block == 0 => {
                    RowDType::Fp8E4M3Block32
                }
                Dtype::F8E4M3 | Dtype::U8 => RowDType::Fp8E4M3,
                other => {
                    return Err(err(format!(
                        "{p}: shard {i} tensor '{name}': dtype {} is not a table dtype (BF16, F32, F8_E4M3 or U8)",
                        other.name()
                    )));
                }
            };
            let (rows, dim) = (t.shape[0], width);
            let stride = stored * t.dtype.size() as u64;
            if rows == 0 || dim == 0 {
                return Err(err(format!(
                    "{p}: shard {i} tensor '{name}': empty shape {:?}",
                    t.shape
                )));
            }
            // Only the last shard may be shorter (torch.chunk's remainder).
            let last = i + 1 == shards.len();
            match &geom {
                None => geom = Some((rows, dim, dtype, stride, name.clone())),
                Some((r0, d0, t0, s0, n0)) => {
                    let rows_ok = rows == *r0 || (last && rows < *r0);
                    if !rows_ok || (*d0, *t0, *s0) != (dim, dtype, stride) {
                        return Err(err(format!(
                            "{p}: shard {i} tensor '{name}' is [{rows}, {dim}] {dtype:?} rows {stride} bytes apart, but shard 0 ('{n0}') is [{r0}, {d0}] {t0:?} rows {s0} bytes apart"
                        )));
                    }
                }
            }
            let scale_offset = if dtype == RowDType::Fp8E4M3 {
                let sn = src.scale.as_deref().unwrap_or("(none named)");
                let s = scale.ok_or_else(|| {
                    err(format!(
                        "{p}: FP8 shard {i} tensor '{name}' has no companion scale tensor '{sn}'"
                    ))
                })?;
                if s.dtype != Dtype::F32 || s.shape != [rows] {
                    return Err(err(format!(
                        "{p}: scale tensor '{sn}' is {:?} {}, expected [{rows}] F32",
                        s.shape,
                        s.dtype.name()
                    )));
                }
                Some(s.offset)
            } else {
                None
            };
            out.push(Shard {
                path: path.clone(),
                tensor: name.clone(),
                scale: src.scale.clone(),
                data_offset: t.offset,
                scale_offset,
                file_len: h.file_len,
                rows,
            });
        }
        let (rows_per_shard, dim, dtype, row_stride, _) = geom.expect("at least one shard");
        let rows = out
            .iter()
            .try_fold(0u64, |a, s| a.checked_add(s.rows))
            .ok_or_else(|| StorageError::layout(None, None, "table row count overflows"))?;
        if let Some(want) = expected_rows
            && rows != want
        {
            return Err(StorageError::layout(
                None,
                None,
                format!(
                    "the table's {} shards of (at most) {rows_per_shard} rows hold {rows} rows, expected {want}",
                    out.len()
                ),
            ));
        }
        // A block-scaled row's width counts its scale bytes too.
        let dim = if dtype == RowDType::Fp8E4M3Block32 {
            dim / (crate::dtype::FP8_BLOCK as u64 + 1) * crate::dtype::FP8_BLOCK as u64
        } else {
            dim
        };
        let head_dim = usize::try_from(dim).map_err(|_| {
            StorageError::layout(None, None, format!("head_dim {dim} does not fit in usize"))
        })?;
        let info = TableInfo {
            rows,
            head_dim,
            dtype,
        };
        if row_stride < info.row_bytes() as u64 {
            return Err(StorageError::layout(
                Some(shards[0].path.clone()),
                Some(0),
                format!(
                    "tensor '{}': rows of {} bytes cannot sit {row_stride} bytes apart",
                    shards[0].weight,
                    info.row_bytes()
                ),
            ));
        }
        Ok(TableFiles {
            info,
            rows_per_shard,
            row_stride,
            shards: out,
        })
    }

    /// Where row `id` lives, or an error naming the id and the table size.
    #[inline]
    pub fn locate(&self, id: u64) -> Result<RowLoc> {
        self.check_id(id)?;
        let shard = (id / self.rows_per_shard) as usize;
        let r = id % self.rows_per_shard;
        let s = &self.shards[shard];
        Ok(RowLoc {
            shard,
            offset: s.data_offset + r * self.row_stride,
            scale_offset: s.scale_offset.map(|o| o + r * 4),
        })
    }

    /// An error unless `id` is a row of the table.
    #[inline]
    pub fn check_id(&self, id: u64) -> Result<()> {
        check_row(id, self.info.rows)
    }
}

/// An error unless `id` is below `rows`.
#[inline]
pub fn check_row(id: u64, rows: u64) -> Result<()> {
    if id >= rows {
        return Err(StorageError::RowOutOfRange { id, rows });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::safetensors::{TensorSpec, write_file};
    use std::path::Path;

    #[test]
    fn padded_strides_keep_rows_in_the_fewest_granules() {
        assert_eq!(padded_stride(320, 512), 512);
        assert_eq!(padded_stride(320, 4096), 512);
        assert_eq!(padded_stride(264, 512), 512);
        assert_eq!(padded_stride(256, 512), 256);
        assert_eq!(padded_stride(160, 512), 256);
        assert_eq!(padded_stride(1536, 512), 1536);
        assert_eq!(padded_stride(1600, 512), 2048);
        assert_eq!(padded_stride(320, 1), 320);
        for rb in 1..3000u64 {
            for g in [512u64, 4096] {
                let s = padded_stride(rb, g);
                assert!(s >= rb);
                // Rows at multiples of the stride sit in the fewest granules.
                for k in 0..64 {
                    let off = k * s;
                    assert_eq!((off % g + rb).div_ceil(g), rb.div_ceil(g), "{rb} {g} {k}");
                }
            }
        }
    }

    fn bf16_shard(dir: &Path, i: usize, rows: u64, dim: u64) -> ShardSource {
        let p = dir.join(format!("s{i}.safetensors"));
        let name = format!("rows.{i}.weight");
        let data = vec![i as u8; (rows * dim * 2) as usize];
        write_file(
            &p,
            &[(TensorSpec::new(&name, Dtype::BF16, &[rows, dim]), &data)],
            8,
        )
        .unwrap();
        ShardSource::new(p, name, None)
    }

    #[test]
    fn opens_and_locates() {
        let d = tempfile::tempdir().unwrap();
        let shards: Vec<_> = (0..3).map(|i| bf16_shard(d.path(), i, 10, 4)).collect();
        let t = TableFiles::open(&shards, Some(30)).unwrap();
        assert_eq!(
            t.info,
            TableInfo {
                rows: 30,
                head_dim: 4,
                dtype: RowDType::Bf16
            }
        );
        let l = t.locate(23).unwrap();
        assert_eq!(l.shard, 2);
        assert_eq!(l.offset, t.shards[2].data_offset + 3 * 8);
        let e = t.locate(30).unwrap_err().to_string();
        assert!(e.contains("30") && e.contains("30 rows"), "{e}");
        let e = TableFiles::open(&shards, Some(31)).unwrap_err().to_string();
        assert!(e.contains("expected 31"), "{e}");
    }

    #[test]
    fn refuses_unequal_shapes_and_missing_scales() {
        let d = tempfile::tempdir().unwrap();
        let a = bf16_shard(d.path(), 0, 10, 4);
        let b = bf16_shard(d.path(), 1, 11, 4);
        let e = TableFiles::open(&[a.clone(), b], None)
            .unwrap_err()
            .to_string();
        assert!(e.contains("shard 1") && e.contains("[11, 4]"), "{e}");
        let p = d.path().join("f.safetensors");
        let name = "x.weight";
        write_file(
            &p,
            &[(TensorSpec::new(name, Dtype::F8E4M3, &[2, 4]), &[0u8; 8])],
            8,
        )
        .unwrap();
        let src = ShardSource::new(p, name, Some("x.scale".into()));
        let e = TableFiles::open(&[src], None).unwrap_err().to_string();
        assert!(e.contains("x.scale"), "{e}");
    }

    #[test]
    fn fp8_shard_with_scale() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("f.safetensors");
        let name = "x.weight";
        let scales: Vec<u8> = [1.0f32, 2.0].iter().flat_map(|f| f.to_le_bytes()).collect();
        write_file(
            &p,
            &[
                (TensorSpec::new(name, Dtype::F8E4M3, &[2, 4]), &[0u8; 8]),
                (TensorSpec::new("x.scale", Dtype::F32, &[2]), &scales),
            ],
            8,
        )
        .unwrap();
        let t =
            TableFiles::open(&[ShardSource::new(p, name, Some("x.scale".into()))], None).unwrap();
        assert_eq!(t.info.dtype, RowDType::Fp8E4M3);
        let l = t.locate(1).unwrap();
        assert_eq!(l.scale_offset, Some(t.shards[0].scale_offset.unwrap() + 4));
    }
}
