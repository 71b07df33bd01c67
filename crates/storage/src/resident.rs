//! The resident table: every row copied to device memory at load.
//!
//! Invariants: `RowRef.data` of row `r` is `base + r * row_bytes` (and the
//! scale, for FP8, `scale_base + 4 r`); nothing is ever evicted, so leases
//! are empty and `max_resolve` is unbounded. Padded rows on disk are
//! packed tight as they load, so padding costs no device memory. The device memory is freed
//! when the table is dropped; a failed load frees what it allocated.

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::sync::Arc;

use metrale_gpu_runtime::gpu::{DevicePtr, EventHandle, GpuBackend};

use crate::error::{IoContext, Result, StorageError};
use crate::layout::{TableFiles, check_row};
use crate::table::{
    Lease, RowDType, RowRef, RowTable, TableInfo, TableStats, release_in_place, resolve_in_place,
};

/// Bytes copied per host-to-device transfer while loading.
const CHUNK: usize = 16 << 20;

/// A table held entirely in device memory.
pub struct ResidentTable {
    info: TableInfo,
    gpu: Arc<dyn GpuBackend>,
    data: DevicePtr,
    scales: DevicePtr,
}

/// Free `ptrs` (non-null ones) on drop unless disarmed.
struct FreeGuard<'a> {
    gpu: &'a dyn GpuBackend,
    ptrs: Vec<DevicePtr>,
}

impl Drop for FreeGuard<'_> {
    fn drop(&mut self) {
        for p in self.ptrs.drain(..) {
            let _ = self.gpu.dealloc(p);
        }
    }
}

/// Copy `len` bytes at `offset` of `file` to `dst`, in chunks.
fn upload(
    gpu: &dyn GpuBackend,
    file: &File,
    path: &std::path::Path,
    offset: u64,
    len: u64,
    dst: DevicePtr,
) -> Result<()> {
    let mut buf = vec![0u8; CHUNK.min(len as usize)];
    let mut done = 0u64;
    while done < len {
        let n = (len - done).min(CHUNK as u64) as usize;
        let at = offset + done;
        file.read_exact_at(&mut buf[..n], at)
            .io_ctx_at(path, at, || {
                format!("reading {n} table bytes at offset {at} (file truncated?)")
            })?;
        gpu.copy_h2d(&buf[..n], dst.offset(done as usize))?;
        done += n as u64;
    }
    Ok(())
}

/// Copy `rows` rows of `row_bytes` each, `stride` bytes apart at `offset`
/// of `file`, to `dst` back to back.
#[allow(clippy::too_many_arguments)]
fn upload_rows(
    gpu: &dyn GpuBackend,
    file: &File,
    path: &std::path::Path,
    offset: u64,
    rows: u64,
    row_bytes: u64,
    stride: u64,
    dst: DevicePtr,
) -> Result<()> {
    if stride == row_bytes {
        return upload(gpu, file, path, offset, rows * row_bytes, dst);
    }
    let per = (CHUNK as u64 / stride).max(1);
    let mut buf = vec![0u8; (per.min(rows) * stride) as usize];
    let mut done = 0u64;
    while done < rows {
        let n = (rows - done).min(per);
        let at = offset + done * stride;
        // The last row's padding need not be there.
        let len = ((n - 1) * stride + row_bytes) as usize;
        file.read_exact_at(&mut buf[..len], at)
            .io_ctx_at(path, at, || {
                format!("reading {n} padded table rows at offset {at} (file truncated?)")
            })?;
        for i in 1..n as usize {
            let from = i * stride as usize;
            buf.copy_within(from..from + row_bytes as usize, i * row_bytes as usize);
        }
        gpu.copy_h2d(
            &buf[..(n * row_bytes) as usize],
            dst.offset((done * row_bytes) as usize),
        )?;
        done += n;
    }
    Ok(())
}

impl ResidentTable {
    /// Copy every row (and FP8 scale) of `files` into device memory.
    pub fn load(files: &TableFiles, gpu: Arc<dyn GpuBackend>) -> Result<ResidentTable> {
        let info = files.info;
        let row_bytes = info.row_bytes() as u64;
        let shard_bytes = files.rows_per_shard * row_bytes;
        let total = usize::try_from(info.rows * row_bytes).map_err(|_| {
            StorageError::invalid(format!(
                "a table of {} bytes is too large for this host",
                info.rows * row_bytes
            ))
        })?;
        let data = gpu.alloc(total, "ple resident table")?;
        let mut guard = FreeGuard {
            gpu: gpu.as_ref(),
            ptrs: vec![data],
        };
        let fp8 = info.dtype == RowDType::Fp8E4M3;
        let scales = if fp8 {
            let p = gpu.alloc(info.rows as usize * 4, "ple resident table scales")?;
            guard.ptrs.push(p);
            p
        } else {
            DevicePtr::NULL
        };
        for (i, s) in files.shards.iter().enumerate() {
            // What the shard spans on disk (the last row's padding excepted).
            let disk_bytes = (s.rows - 1) * files.row_stride + row_bytes;
            let f = File::open(&s.path).io_ctx(&s.path, || "opening")?;
            let len = f
                .metadata()
                .io_ctx(&s.path, || "reading the file size")?
                .len();
            if s.data_offset + disk_bytes > len {
                return Err(StorageError::Truncated {
                    path: s.path.clone(),
                    what: format!("shard {i}"),
                    offset: s.data_offset,
                    needed: disk_bytes,
                    got: len.saturating_sub(s.data_offset),
                });
            }
            upload_rows(
                gpu.as_ref(),
                &f,
                &s.path,
                s.data_offset,
                s.rows,
                row_bytes,
                files.row_stride,
                data.offset((i as u64 * shard_bytes) as usize),
            )?;
            if let Some(so) = s.scale_offset {
                let sb = s.rows * 4;
                upload(
                    gpu.as_ref(),
                    &f,
                    &s.path,
                    so,
                    sb,
                    scales.offset((i as u64 * files.rows_per_shard * 4) as usize),
                )?;
            }
        }
        guard.ptrs.clear();
        drop(guard);
        Ok(ResidentTable {
            info,
            gpu,
            data,
            scales,
        })
    }

    /// A table of the rows in `bytes` (whole rows of `head_dim` values in
    /// `dtype`, as a shard stores them: BF16 or F32 values, or FP8 values
    /// with their inline block scales), copied to device memory: rows that
    /// were never in a file (tests, a layer built from arrays). Not
    /// [`RowDType::Fp8E4M3`], whose scales are stored apart.
    pub fn from_rows(
        gpu: Arc<dyn GpuBackend>,
        bytes: &[u8],
        head_dim: usize,
        dtype: RowDType,
    ) -> Result<ResidentTable> {
        if dtype.has_row_scale() || !dtype.fits_head_dim(head_dim) {
            return Err(StorageError::invalid(format!(
                "an in-memory table cannot hold rows of {head_dim} {dtype:?} values"
            )));
        }
        let rb = dtype.row_bytes(head_dim);
        if bytes.is_empty() || !bytes.len().is_multiple_of(rb) {
            return Err(StorageError::invalid(format!(
                "{} bytes are not a positive whole number of rows of {rb}",
                bytes.len()
            )));
        }
        let data = gpu.alloc(bytes.len(), "ple resident table")?;
        if let Err(e) = gpu.copy_h2d(bytes, data) {
            let _ = gpu.free(data);
            return Err(e.into());
        }
        Ok(ResidentTable {
            info: TableInfo {
                rows: (bytes.len() / rb) as u64,
                head_dim,
                dtype,
            },
            gpu,
            data,
            scales: DevicePtr::NULL,
        })
    }

    /// [`Self::from_rows`] of BF16 bit patterns, `head_dim` per row.
    pub fn from_bf16(
        gpu: Arc<dyn GpuBackend>,
        bits: &[u16],
        head_dim: usize,
    ) -> Result<ResidentTable> {
        let bytes: Vec<u8> = bits.iter().flat_map(|b| b.to_le_bytes()).collect();
        Self::from_rows(gpu, &bytes, head_dim, RowDType::Bf16)
    }

    /// Device address of row 0 (rows are contiguous).
    pub fn base(&self) -> DevicePtr {
        self.data
    }

    /// Device address of the FP8 scales (null for BF16).
    pub fn scale_base(&self) -> DevicePtr {
        self.scales
    }

    fn check(&self, id: u64) -> Result<()> {
        check_row(id, self.info.rows)
    }
}

impl RowTable for ResidentTable {
    fn info(&self) -> TableInfo {
        self.info
    }

    fn max_resolve(&self) -> usize {
        usize::MAX
    }

    fn resolve(&self, ids: &[u64], out: &mut [RowRef]) -> Result<Lease> {
        let rb = self.info.row_bytes() as u64;
        resolve_in_place(ids, out, self.info.rows, |id| RowRef {
            data: self.data.0 + id * rb,
            scale: if self.scales.is_null() {
                0
            } else {
                self.scales.0 + id * 4
            },
        })
    }

    fn release(
        &self,
        lease: Lease,
        gpu: &dyn GpuBackend,
        after: Option<EventHandle>,
    ) -> Result<()> {
        release_in_place(lease, gpu, after, "does not belong to a resident table")
    }

    fn prefetch(&self, ids: &[u64]) -> Result<()> {
        ids.iter().try_for_each(|&id| self.check(id))
    }

    fn stats(&self) -> TableStats {
        TableStats::default()
    }
}

impl Drop for ResidentTable {
    fn drop(&mut self) {
        for p in [self.data, self.scales] {
            if let Err(e) = self.gpu.dealloc(p) {
                tracing::warn!(error = %e, "freeing the resident table failed");
            }
        }
    }
}
