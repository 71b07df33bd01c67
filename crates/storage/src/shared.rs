//! The shared table: each shard's rows placed once per host in a named
//! shared-memory file (under `/dev/shm` by default) that every process
//! serving the same checkpoint maps, so N processes hold one copy.
//!
//! A segment's name is derived from the shard's identity: its canonical
//! path, device and inode, length and modification time, and the row
//! extents. The first process copies the rows into a temporary file it
//! created exclusively and links it to the final name (a link never
//! replaces an existing name, so a half-written segment is never attached
//! and two racing creators end with one segment); later processes open the
//! final name read-only. Every process maps the segment `MAP_SHARED`
//! read-only and registers it with the backend as device-addressable host
//! memory, as [`crate::mapped::MappedTable`] does with shard files.
//!
//! Lifetime: every user holds a shared `flock` on the segment; the process
//! that drops it last (its exclusive lock succeeds) unlinks it, so segments
//! live while some process uses them. An attacher that finds the name
//! unlinked under its lock starts over. A segment left by a crashed
//! process is attached as is (its name says what it holds; its header is
//! checked) and removed by its next last user.
//!
//! Segment layout: a 64-byte header (magic `MPLESHM\0`, version 1, rows,
//! the row stride, data and scale lengths, the identity digest) padded to
//! 4096 bytes, the rows at the files' stride (padded rows stay padded),
//! then the FP8 scales at the next 4096-byte boundary.

use std::fs::{File, OpenOptions};
use std::io::ErrorKind;
use std::os::fd::AsRawFd;
use std::os::unix::fs::{FileExt, MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use memmap2::Mmap;
use metrale_gpu_runtime::gpu::{DevicePtr, EventHandle, GpuBackend};

use crate::error::{IoContext, Result, StorageError};
use crate::layout::{Shard, TableFiles, check_row};
use crate::table::{
    Lease, RowRef, RowTable, TableInfo, TableStats, release_in_place, resolve_in_place,
};

/// Where segments go by default.
pub const DEFAULT_SHM_DIR: &str = "/dev/shm";
const MAGIC: [u8; 8] = *b"MPLESHM\0";
const VERSION: u32 = 1;
const PAGE: u64 = 4096;
const CHUNK: usize = 16 << 20;

static TMP_COUNTER: AtomicU64 = AtomicU64::new(0);

fn round_up(v: u64) -> u64 {
    v.div_ceil(PAGE) * PAGE
}

fn fnv(seed: u64, parts: &[&[u8]]) -> u64 {
    let mut h = 0xcbf2_9ce4_8422_2325 ^ seed;
    for p in parts {
        for &b in *p {
            h ^= b as u64;
            h = h.wrapping_mul(0x0000_0100_0000_01b3);
        }
        h ^= p.len() as u64;
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    crate::splitmix::mix64(h)
}

/// What one shard's segment holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Extent {
    rows: u64,
    stride: u64,
    data_len: u64,
    scale_len: u64,
    digest: u64,
}

impl Extent {
    fn scale_at(&self) -> u64 {
        PAGE + round_up(self.data_len)
    }

    fn total(&self) -> u64 {
        self.scale_at() + self.scale_len
    }

    fn header(&self) -> [u8; 64] {
        let mut h = [0u8; 64];
        h[..8].copy_from_slice(&MAGIC);
        h[8..12].copy_from_slice(&VERSION.to_le_bytes());
        h[16..24].copy_from_slice(&self.rows.to_le_bytes());
        h[24..32].copy_from_slice(&self.stride.to_le_bytes());
        h[32..40].copy_from_slice(&self.data_len.to_le_bytes());
        h[40..48].copy_from_slice(&self.scale_len.to_le_bytes());
        h[48..56].copy_from_slice(&self.digest.to_le_bytes());
        h
    }
}

/// The segment name of `shard` of `files`, and what it holds.
fn identity(files: &TableFiles, shard: &Shard) -> Result<(String, Extent)> {
    let canon = std::fs::canonicalize(&shard.path).io_ctx(&shard.path, || "resolving")?;
    let md = std::fs::metadata(&canon).io_ctx(&canon, || "reading the metadata of")?;
    let stride = files.row_stride;
    let nums: Vec<u8> = [
        md.dev(),
        md.ino(),
        md.len(),
        md.mtime() as u64,
        md.mtime_nsec() as u64,
        shard.data_offset,
        shard.scale_offset.map_or(u64::MAX, |s| s),
        files.rows_per_shard,
        stride,
    ]
    .iter()
    .flat_map(|v| v.to_le_bytes())
    .collect();
    let path = canon.as_os_str().as_encoded_bytes();
    let a = fnv(0, &[b"metrale-ple shared table v1", path, &nums]);
    let b = fnv(
        0x9e37_79b9_7f4a_7c15,
        &[b"metrale-ple shared table v1", path, &nums],
    );
    let ext = Extent {
        rows: files.rows_per_shard,
        stride,
        data_len: files.rows_per_shard * stride,
        scale_len: if shard.scale_offset.is_some() {
            files.rows_per_shard * 4
        } else {
            0
        },
        digest: a,
    };
    Ok((format!("metrale-ple-{a:016x}{b:016x}.rows"), ext))
}

fn flock(f: &File, op: libc::c_int) -> std::io::Result<()> {
    // SAFETY: flock on a descriptor this process owns; no memory involved.
    let r = unsafe { libc::flock(f.as_raw_fd(), op) };
    if r == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}

/// Copy the shard's rows (and scales) into a new temporary file in `dir`,
/// under a shared lock, and link it to `path`. `Ok(None)` when another
/// process linked the name first.
fn create(dir: &Path, path: &Path, shard: &Shard, ext: &Extent) -> Result<Option<File>> {
    let tmp = dir.join(format!(
        ".{}.{}.{}.tmp",
        path.file_name()
            .map_or("segment".into(), |n| n.to_string_lossy()),
        std::process::id(),
        TMP_COUNTER.fetch_add(1, Ordering::Relaxed)
    ));
    let f = OpenOptions::new()
        .read(true)
        .write(true)
        .create_new(true)
        .mode(0o644)
        .open(&tmp)
        .io_ctx(&tmp, || "creating the shared segment")?;
    let fill = || -> Result<()> {
        flock(&f, libc::LOCK_SH).io_ctx(&tmp, || "locking")?;
        f.set_len(ext.total()).io_ctx(&tmp, || "sizing")?;
        f.write_all_at(&ext.header(), 0)
            .io_ctx(&tmp, || "writing the header of")?;
        let src = File::open(&shard.path).io_ctx(&shard.path, || "opening")?;
        let mut buf = vec![0u8; CHUNK];
        let mut copy = |from: u64, len: u64, to: u64| -> Result<()> {
            let mut done = 0;
            while done < len {
                let n = (len - done).min(CHUNK as u64) as usize;
                src.read_exact_at(&mut buf[..n], from + done).io_ctx_at(
                    &shard.path,
                    from + done,
                    || format!("reading {n} table bytes (file truncated?)"),
                )?;
                f.write_all_at(&buf[..n], to + done)
                    .io_ctx(&tmp, || "writing")?;
                done += n as u64;
            }
            Ok(())
        };
        copy(shard.data_offset, ext.data_len, PAGE)?;
        if let Some(so) = shard.scale_offset {
            copy(so, ext.scale_len, ext.scale_at())?;
        }
        Ok(())
    };
    let r = fill().and_then(|()| match std::fs::hard_link(&tmp, path) {
        Ok(()) => Ok(true),
        Err(e) if e.kind() == ErrorKind::AlreadyExists => Ok(false),
        Err(e) => Err(e).io_ctx(path, || "linking the shared segment"),
    });
    let _ = std::fs::remove_file(&tmp);
    match r {
        Ok(true) => Ok(Some(f)),
        Ok(false) => Ok(None),
        Err(e) => Err(e),
    }
}

/// Open `path` read-only under a shared lock; `Ok(None)` when it does not
/// exist or was unlinked by its last user meanwhile.
fn attach(path: &Path) -> Result<Option<File>> {
    let f = match File::open(path) {
        Ok(f) => f,
        Err(e) if e.kind() == ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(e).io_ctx(path, || "opening the shared segment"),
    };
    flock(&f, libc::LOCK_SH).io_ctx(path, || "locking")?;
    let md = f.metadata().io_ctx(path, || "reading the metadata of")?;
    if md.nlink() == 0 {
        return Ok(None);
    }
    Ok(Some(f))
}

/// A table served from per-host shared-memory segments. See the module
/// docs.
pub struct SharedTable {
    info: TableInfo,
    rows_per_shard: u64,
    /// Bytes between rows in a segment: the files' row stride (padded rows
    /// stay padded).
    stride: u64,
    gpu: Arc<dyn GpuBackend>,
    /// Per shard: (registered base, scale offset in the segment).
    bases: Vec<(DevicePtr, Option<u64>)>,
    maps: Vec<Mmap>,
    /// Per shard: the segment's name and its open, shared-locked file.
    segments: Vec<(PathBuf, File)>,
}

impl SharedTable {
    /// Attach (creating when needed) the segments of every shard of
    /// `files` in [`DEFAULT_SHM_DIR`].
    pub fn open(files: &TableFiles, gpu: Arc<dyn GpuBackend>) -> Result<SharedTable> {
        Self::open_in(files, gpu, Path::new(DEFAULT_SHM_DIR))
    }

    /// As [`Self::open`], with the segments in `dir`.
    pub fn open_in(
        files: &TableFiles,
        gpu: Arc<dyn GpuBackend>,
        dir: &Path,
    ) -> Result<SharedTable> {
        let mut t = SharedTable {
            info: files.info,
            rows_per_shard: files.rows_per_shard,
            stride: files.row_stride,
            gpu,
            bases: Vec::new(),
            maps: Vec::new(),
            segments: Vec::new(),
        };
        for shard in &files.shards {
            let (name, ext) = identity(files, shard)?;
            let path = dir.join(name);
            let mut file = None;
            for _ in 0..8 {
                file = attach(&path)?;
                if file.is_some() {
                    break;
                }
                // Ours or a racing creator's; the new file's lock is held
                // until the name is attached, so no last user removes it
                // meanwhile. Every process maps the name read-only.
                let creator = create(dir, &path, shard, &ext)?;
                file = attach(&path)?;
                drop(creator);
                if file.is_some() {
                    break;
                }
            }
            let file = file.ok_or_else(|| {
                StorageError::invalid(format!(
                    "shared segment {} kept disappearing while attaching",
                    path.display()
                ))
            })?;
            // SAFETY: the segment is only ever written before it is linked
            // under its name; mapped read-only, it does not change.
            let m = unsafe { Mmap::map(&file) }.io_ctx(&path, || "mapping")?;
            if m.len() as u64 != ext.total() || m[..64] != ext.header() {
                return Err(StorageError::invalid(format!(
                    "shared segment {} does not hold what its name says (remove it)",
                    path.display()
                )));
            }
            // SAFETY: the mapping lives in `t.maps` until after `Drop`
            // unregisters it; the device only reads through it.
            let dev = unsafe {
                t.gpu
                    .register_host(m.as_ptr() as *mut u8, m.len(), "ple shared table segment")
            }
            .map_err(|e| {
                StorageError::device(format!("registering the segment {}", path.display()), e)
            })?;
            t.maps.push(m);
            t.bases
                .push((dev, shard.scale_offset.map(|_| ext.scale_at())));
            t.segments.push((path, file));
        }
        Ok(t)
    }

    /// The segment files this table maps, one per shard.
    pub fn segment_paths(&self) -> Vec<PathBuf> {
        self.segments.iter().map(|(p, _)| p.clone()).collect()
    }
}

impl RowTable for SharedTable {
    fn info(&self) -> TableInfo {
        self.info
    }

    fn max_resolve(&self) -> usize {
        usize::MAX
    }

    fn resolve(&self, ids: &[u64], out: &mut [RowRef]) -> Result<Lease> {
        let rb = self.stride;
        resolve_in_place(ids, out, self.info.rows, |id| {
            let (base, s0) = self.bases[(id / self.rows_per_shard) as usize];
            let r = id % self.rows_per_shard;
            RowRef {
                data: base.0 + PAGE + r * rb,
                scale: s0.map_or(0, |s0| base.0 + s0 + r * 4),
            }
        })
    }

    fn release(
        &self,
        lease: Lease,
        gpu: &dyn GpuBackend,
        after: Option<EventHandle>,
    ) -> Result<()> {
        release_in_place(lease, gpu, after, "does not belong to a shared table")
    }

    fn prefetch(&self, ids: &[u64]) -> Result<()> {
        ids.iter().try_for_each(|&id| check_row(id, self.info.rows))
    }

    fn stats(&self) -> TableStats {
        TableStats::default()
    }
}

impl Drop for SharedTable {
    fn drop(&mut self) {
        for (dev, _) in self.bases.drain(..) {
            if let Err(e) = self.gpu.dealloc(dev) {
                tracing::warn!(error = %e, "unregistering a shared segment failed");
            }
        }
        self.maps.clear();
        for (path, file) in self.segments.drain(..) {
            // The last user (no other shared lock) removes the name, if it
            // still names this segment.
            if flock(&file, libc::LOCK_EX | libc::LOCK_NB).is_ok() {
                let same = match (std::fs::metadata(&path), file.metadata()) {
                    (Ok(a), Ok(b)) => a.ino() == b.ino() && a.dev() == b.dev(),
                    _ => false,
                };
                if same {
                    let _ = std::fs::remove_file(&path);
                }
            }
        }
    }
}
