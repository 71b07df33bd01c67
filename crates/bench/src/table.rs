//! Benchmark workloads of the table, shared by
//! `cargo bench --bench table` and `metrale-ple bench`.
//!
//! Each workload is set up from its sizes and exposes the measured
//! operation (`run`) and its same-run baseline (`baseline`) as methods; the
//! caller does the timing, so anything a method does besides the measured
//! work is left to an untimed `prepare`. Everything random comes from a
//! seeded generator, so a run is repeatable.
//!
//! Invariants: a method never leaves a lease pinned across calls except the
//! one [`ResidentGather`] holds between `prepare` and the next `prepare` or
//! `close`; every device allocation and stream a workload made is freed by
//! its `close`, or on drop (errors then ignored); [`CacheHits::check`]
//! fails if the hit workload ever missed.

use std::collections::HashMap;
use std::hint::black_box;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::{Context, Result, ensure};
use metrale_gpu_runtime::gpu::{
    ArgKind, DevicePtr, GpuBackend, GpuError, HostMemory, KernelArg, KernelHandle, LaunchConfig,
    StreamId,
};
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

use metrale_storage::cached::{CacheConfig, CachedTable};
use metrale_storage::io::{
    AlignedBuf, PAGE, PageReader, ReadReq, ShardFile, default_reader, pread_full,
};
use metrale_storage::layout::{ShardSource, TableFiles};
use metrale_storage::resident::ResidentTable;
use metrale_storage::safetensors::{Dtype, TensorSpec, Writer};
use metrale_storage::table::{Lease, RowRef, RowTable, TableStats};

/// Write a BF16 table of `shards` shard files, each `rows_per_shard` rows of
/// `head_dim` random values, into `dir` (`bench-{i}.safetensors`), and open
/// it.
pub fn write_table(
    dir: &Path,
    shards: usize,
    rows_per_shard: u64,
    head_dim: usize,
    seed: u64,
) -> Result<TableFiles> {
    let mut rng = SmallRng::seed_from_u64(seed);
    let row_bytes = head_dim * 2;
    let mut list = Vec::new();
    let mut chunk = vec![0u8; 1 << 20];
    for i in 0..shards {
        let p = dir.join(format!("bench-{i}.safetensors"));
        let name = format!("bench.shard_{i}.weight");
        let spec = TensorSpec::new(&name, Dtype::BF16, &[rows_per_shard, head_dim as u64]);
        let mut w = Writer::create(&p, &[spec], &Default::default(), 4096)?;
        let mut left = rows_per_shard as usize * row_bytes;
        while left > 0 {
            let n = left.min(chunk.len());
            rng.fill(&mut chunk[..n]);
            w.write(&chunk[..n])?;
            left -= n;
        }
        w.finish()?;
        list.push(ShardSource::new(p, name, None));
    }
    Ok(TableFiles::open(&list, None)?)
}

/// Hint the cache lines of one row of `rb` bytes at `p`: one hint a line
/// the row touches (a row that starts mid-line touches one more).
#[inline(always)]
fn prefetch_row(p: *const u8, rb: usize) {
    #[cfg(target_arch = "x86_64")]
    {
        // The row's first line starts `lead` bytes before it.
        let lead = p as usize & 63;
        let first = p.wrapping_sub(lead);
        let mut k = 0;
        while k < lead + rb {
            // SAFETY: prefetch never faults, whatever the address.
            unsafe {
                std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T0 }>(
                    first.wrapping_add(k).cast(),
                )
            };
            k += 64;
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = (p, rb);
}

/// How one row is copied: a plain `copy_from_slice`, or, for rows a whole
/// number of vector registers long, that many unaligned register loads
/// then stores (no call, no size dispatch: the row size is a constant).
#[derive(Clone, Copy, PartialEq, Eq)]
enum RowCopy {
    Plain,
    #[cfg(target_arch = "x86_64")]
    Avx2,
    #[cfg(target_arch = "x86_64")]
    Avx512,
}

impl RowCopy {
    /// The fastest copy of `rb`-byte rows on this CPU.
    fn pick(rb: usize) -> RowCopy {
        #[cfg(target_arch = "x86_64")]
        {
            if rb.is_multiple_of(64) && std::arch::is_x86_feature_detected!("avx512f") {
                return RowCopy::Avx512;
            }
            if rb.is_multiple_of(32) && std::arch::is_x86_feature_detected!("avx2") {
                return RowCopy::Avx2;
            }
        }
        let _ = rb;
        RowCopy::Plain
    }
}

/// Copy `RB` bytes from `src` to `dst` in 64-byte registers.
///
/// # Safety
/// The CPU must support AVX-512F; `src` readable and `dst` writable at
/// `RB` bytes, `RB` a multiple of 64; the ranges do not overlap.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn copy_row_512<const RB: usize>(src: *const u8, dst: *mut u8) {
    use std::arch::x86_64::*;
    // SAFETY: the caller guarantees both ranges; all loads come before the
    // stores so they issue back to back.
    unsafe {
        let v: [__m512i; 8] = std::array::from_fn(|k| {
            if k < RB / 64 {
                _mm512_loadu_si512(src.add(64 * k).cast())
            } else {
                _mm512_setzero_si512()
            }
        });
        for (k, vk) in v.iter().enumerate().take(RB / 64) {
            _mm512_storeu_si512(dst.add(64 * k).cast(), *vk);
        }
    }
}

/// Copy `RB` bytes from `src` to `dst` in 32-byte registers.
///
/// # Safety
/// As [`copy_row_512`], with AVX2 and `RB` a multiple of 32.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn copy_row_256<const RB: usize>(src: *const u8, dst: *mut u8) {
    use std::arch::x86_64::*;
    // SAFETY: as in `copy_row_512`.
    unsafe {
        let v: [__m256i; 16] = std::array::from_fn(|k| {
            if k < RB / 32 {
                _mm256_loadu_si256(src.add(32 * k).cast())
            } else {
                _mm256_setzero_si256()
            }
        });
        for (k, vk) in v.iter().enumerate().take(RB / 32) {
            _mm256_storeu_si256(dst.add(32 * k).cast(), *vk);
        }
    }
}

/// The copy loop of the gather kernel; `RB` is the row size (0: `rb`, not
/// known at compile time), so the hot sizes get a straight-line row copy.
/// Rows are random reads: the lines of the row `dist` ahead are hinted
/// while this one is copied, so the misses overlap.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn gather_loop<const RB: usize>(
    refs: &[u64],
    out: &mut [u8],
    tbl: *const u8,
    base: u64,
    len: usize,
    rb: usize,
    dist: usize,
    how: RowCopy,
) -> Result<(), GpuError> {
    let rb = if RB > 0 { RB } else { rb };
    let n = refs.len() / 2;
    if out.len() < n * rb {
        return Err(GpuError::kernel("bench gather: output too short"));
    }
    for i in 0..n {
        if dist > 0 && i + dist < n {
            let pf = refs[2 * (i + dist)].wrapping_sub(base) as usize;
            prefetch_row(tbl.wrapping_add(pf), rb);
        }
        let off = refs[2 * i].wrapping_sub(base) as usize;
        if off.checked_add(rb).is_none_or(|e| e > len) {
            return Err(GpuError::kernel(format!(
                "bench gather: ref {i} outside the table"
            )));
        }
        // SAFETY: `off + rb <= len` (checked above) and `tbl` spans `len`
        // bytes (checked by host_ptr); the table is only read; `out` holds
        // `n * rb` bytes (checked above) and is a distinct allocation.
        unsafe {
            let (src, dst) = (tbl.add(off), out.as_mut_ptr().add(i * rb));
            match how {
                #[cfg(target_arch = "x86_64")]
                RowCopy::Avx512 if RB > 0 && RB.is_multiple_of(64) && RB <= 512 => {
                    copy_row_512::<RB>(src, dst)
                }
                #[cfg(target_arch = "x86_64")]
                RowCopy::Avx2 if RB > 0 && RB.is_multiple_of(32) && RB <= 512 => {
                    copy_row_256::<RB>(src, dst)
                }
                _ => std::ptr::copy_nonoverlapping(src, dst, rb),
            }
        }
    }
    Ok(())
}

/// The gather kernel: args `refs` (n RowRefs), `n`, `out` (n rows), the
/// table base, its length, the row size and the prefetch distance in rows.
/// Rows are independent random reads, so the lines of rows `dist` ahead are
/// prefetched to overlap DRAM latency.
fn gather_kernel(mem: &dyn HostMemory, _c: &LaunchConfig, a: &[KernelArg]) -> Result<(), GpuError> {
    let (
        KernelArg::Ptr(refs),
        KernelArg::U32(n),
        KernelArg::Ptr(out),
        KernelArg::Ptr(base),
        KernelArg::U64(len),
        KernelArg::U32(rb),
        KernelArg::U32(dist),
    ) = (a[0], a[1], a[2], a[3], a[4], a[5], a[6])
    else {
        return Err(GpuError::kernel("bench gather: bad arguments"));
    };
    let (n, len, rb, dist) = (n as usize, len as usize, rb as usize, dist as usize);
    let tbl = mem.host_ptr(base, len)?;
    // SAFETY: refs, out and the table are distinct allocations of this
    // workload, nothing else touches them while the kernel runs, and the
    // backend checked both ranges and the alignment.
    let (r, o) = unsafe {
        (
            mem.slice::<u64>(refs, 2 * n)?,
            mem.slice_mut::<u8>(out, n * rb)?,
        )
    };
    let b = base.addr();
    let how = RowCopy::pick(rb);
    match rb {
        320 => gather_loop::<320>(r, o, tbl, b, len, rb, dist, how),
        256 => gather_loop::<256>(r, o, tbl, b, len, rb, dist, how),
        128 => gather_loop::<128>(r, o, tbl, b, len, rb, dist, how),
        64 => gather_loop::<64>(r, o, tbl, b, len, rb, dist, how),
        32 => gather_loop::<32>(r, o, tbl, b, len, rb, dist, how),
        _ => gather_loop::<0>(r, o, tbl, b, len, rb, dist, how),
    }
}

/// Keep the first error of a sequence of clean-up steps.
fn keep_first<E: Into<anyhow::Error>>(acc: &mut Result<()>, r: Result<(), E>) {
    if let (Ok(()), Err(e)) = (&acc, r) {
        *acc = Err(e.into());
    }
}

/// Random-row gather from a [`ResidentTable`] by a host kernel, against a
/// `memcpy` of the same bytes from a buffer as large as the table (so
/// neither side runs from cache).
pub struct ResidentGather {
    gpu: Arc<dyn GpuBackend>,
    table: ResidentTable,
    kernel: KernelHandle,
    n: usize,
    row_bytes: usize,
    total: usize,
    dist: u32,
    /// refs, out and the stream; `None` once freed.
    dev: Option<(DevicePtr, DevicePtr, StreamId)>,
    refs: Vec<RowRef>,
    lease: Option<Lease>,
    rng: SmallRng,
    src: Vec<u8>,
    dst: Vec<u8>,
    rep: usize,
}

impl ResidentGather {
    /// Load `files` into device memory and set up gathers of `rows` random
    /// rows (at most half the table).
    pub fn new(
        files: &TableFiles,
        gpu: Arc<dyn GpuBackend>,
        rows: usize,
        seed: u64,
    ) -> Result<Self> {
        let table = ResidentTable::load(files, gpu.clone())?;
        let row_bytes = files.info.row_bytes();
        let total = files.info.rows as usize * row_bytes;
        let kernel = match gpu.kernel("bench", "gather") {
            Ok(k) => k,
            Err(_) => {
                gpu.register_host_kernel(
                    "bench",
                    "gather",
                    &[
                        ArgKind::Ptr,
                        ArgKind::U32,
                        ArgKind::Ptr,
                        ArgKind::Ptr,
                        ArgKind::U64,
                        ArgKind::U32,
                        ArgKind::U32,
                    ],
                    Arc::new(gather_kernel),
                )?;
                gpu.kernel("bench", "gather")?
            }
        };
        let n = rows.min(files.info.rows as usize / 2).max(1);
        let refs_dev = gpu.alloc(16 * n, "bench refs")?;
        let out_dev = match gpu.alloc(n * row_bytes, "bench out") {
            Ok(p) => p,
            Err(e) => {
                let _ = gpu.dealloc(refs_dev);
                return Err(e.into());
            }
        };
        let stream = match gpu.create_stream() {
            Ok(s) => s,
            Err(e) => {
                let _ = gpu.dealloc(refs_dev);
                let _ = gpu.dealloc(out_dev);
                return Err(e.into());
            }
        };
        Ok(ResidentGather {
            table,
            kernel,
            n,
            row_bytes,
            total,
            dist: 8,
            dev: Some((refs_dev, out_dev, stream)),
            refs: vec![RowRef::default(); n],
            lease: None,
            rng: SmallRng::seed_from_u64(seed),
            src: vec![1u8; total],
            dst: vec![0u8; n * row_bytes],
            rep: 0,
            gpu,
        })
    }

    /// Rows per gather.
    pub fn rows(&self) -> usize {
        self.n
    }

    /// Bytes of one row.
    pub fn row_bytes(&self) -> usize {
        self.row_bytes
    }

    /// Bytes moved by one [`run`](Self::run) or [`baseline`](Self::baseline).
    pub fn bytes(&self) -> usize {
        self.n * self.row_bytes
    }

    /// Prefetch distance of the kernel in rows (default 8; 0 disables it).
    pub fn set_prefetch(&mut self, rows: u32) {
        self.dist = rows;
    }

    fn dev(&self) -> Result<(DevicePtr, DevicePtr, StreamId)> {
        self.dev.context("bench gather: the workload was closed")
    }

    /// Untimed: release the previous rows, then resolve new random ids.
    pub fn resolve(&mut self) -> Result<()> {
        self.release()?;
        let rows = self.table.info().rows;
        let ids: Vec<u64> = (0..self.n).map(|_| self.rng.gen_range(0..rows)).collect();
        self.lease = Some(self.table.resolve(&ids, &mut self.refs)?);
        Ok(())
    }

    /// Untimed: upload the resolved references to the device.
    pub fn upload(&mut self) -> Result<()> {
        let (refs_dev, _, _) = self.dev()?;
        let packed: Vec<u8> = self
            .refs
            .iter()
            .flat_map(|r| {
                r.data
                    .to_le_bytes()
                    .into_iter()
                    .chain(r.scale.to_le_bytes())
            })
            .collect();
        Ok(self.gpu.copy_h2d(&packed, refs_dev)?)
    }

    /// Untimed: [`resolve`](Self::resolve) then [`upload`](Self::upload).
    pub fn prepare(&mut self) -> Result<()> {
        self.resolve()?;
        self.upload()
    }

    /// The measured operation: one kernel launch gathering the prepared
    /// rows, and a synchronize.
    pub fn run(&mut self) -> Result<()> {
        ensure!(self.lease.is_some(), "bench gather: run before prepare");
        let (refs_dev, out_dev, stream) = self.dev()?;
        self.gpu
            .launch(self.kernel, LaunchConfig::linear(1, 1))
            .ptr(refs_dev)
            .u32(self.n as u32)
            .ptr(out_dev)
            .ptr(self.table.base())
            .u64(self.total as u64)
            .u32(self.row_bytes as u32)
            .u32(self.dist)
            .run(stream)?;
        Ok(self.gpu.synchronize(stream)?)
    }

    /// Untimed: check that the last [`run`](Self::run) wrote every
    /// prepared row, in order, as the table holds it.
    pub fn check(&self) -> Result<()> {
        let (_, out_dev, _) = self.dev()?;
        let rb = self.row_bytes;
        let mut out = vec![0u8; self.n * rb];
        self.gpu.copy_d2h(out_dev, &mut out)?;
        let base = self.table.base();
        let mut row = vec![0u8; rb];
        for (i, r) in self.refs.iter().enumerate() {
            let off = r
                .data
                .checked_sub(base.addr())
                .context("bench gather: ref below the table")?;
            self.gpu.copy_d2h(base.offset(off as usize), &mut row)?;
            ensure!(
                out[i * rb..(i + 1) * rb] == row[..],
                "bench gather: row {i} (table offset {off}) differs"
            );
        }
        Ok(())
    }

    /// The baseline: a contiguous `memcpy` of the same bytes, from an offset
    /// that moves on each call.
    pub fn baseline(&mut self) {
        let len = self.dst.len();
        let off = (self.rep * 7919 * PAGE) % (self.total - len).max(1);
        self.rep += 1;
        self.dst.copy_from_slice(&self.src[off..off + len]);
        black_box(&mut self.dst);
    }

    fn release(&mut self) -> Result<()> {
        match self.lease.take() {
            Some(l) => Ok(self.table.release(l, self.gpu.as_ref(), None)?),
            None => Ok(()),
        }
    }

    fn free(&mut self) -> Result<()> {
        let r = self.release();
        let Some((a, b, s)) = self.dev.take() else {
            return r;
        };
        let mut r = r;
        keep_first(&mut r, self.gpu.dealloc(a));
        keep_first(&mut r, self.gpu.dealloc(b));
        keep_first(&mut r, self.gpu.destroy_stream(s));
        r
    }

    /// Release the rows, free the buffers and the stream; the first error
    /// wins.
    pub fn close(mut self) -> Result<()> {
        self.free()
    }
}

impl Drop for ResidentGather {
    fn drop(&mut self) {
        let _ = self.free();
    }
}

/// The sizes of [`CacheHits`].
#[derive(Clone, Copy, Debug)]
pub struct HitSizes {
    /// Slots in the arena (also the most ids one resolve may pin).
    pub slots: usize,
    /// Hot ids drawn (duplicates dropped); all fit the arena.
    pub hot: usize,
    /// Ids per resolve.
    pub batch: usize,
    /// Batches per round (one `run` or `baseline`).
    pub batches_per_round: usize,
    /// Rounds of ids generated up front; `run` and `baseline` each cycle
    /// through them.
    pub rounds: usize,
}

/// The [`CachedTable`] hit path on a warm hot set, against a std `HashMap`
/// (SipHash) lookup per id writing a [`RowRef`].
pub struct CacheHits {
    gpu: Arc<dyn GpuBackend>,
    table: CachedTable,
    batch: usize,
    round: usize,
    stream: Vec<u64>,
    map: HashMap<u64, u32>,
    out: Vec<RowRef>,
    row_bytes: u64,
    before: TableStats,
    next_run: usize,
    next_base: usize,
}

impl CacheHits {
    /// Open a cached table over `files`, load the hot set, and draw the id
    /// stream.
    pub fn new(
        files: &TableFiles,
        gpu: Arc<dyn GpuBackend>,
        s: &HitSizes,
        seed: u64,
    ) -> Result<Self> {
        ensure!(
            s.slots > 0 && s.hot > 0 && s.batch > 0 && s.batches_per_round > 0,
            "bench hits: every size must be positive"
        );
        let mut c = CacheConfig::new(s.slots);
        c.max_resolve = s.slots;
        let table = CachedTable::open(files.clone(), gpu.clone(), c)?;
        let mut rng = SmallRng::seed_from_u64(seed);
        // Distinct hot ids, so every one of them fits the arena at once.
        let mut hot: Vec<u64> = (0..s.hot.min(s.slots))
            .map(|_| rng.gen_range(0..files.info.rows))
            .collect();
        hot.sort_unstable();
        hot.dedup();
        let mut refs = vec![RowRef::default(); hot.len()];
        let l = table.resolve(&hot, &mut refs)?;
        table.release(l, gpu.as_ref(), None)?;
        let round = s.batch * s.batches_per_round;
        let stream = (0..round * s.rounds.max(1))
            .map(|_| hot[rng.gen_range(0..hot.len())])
            .collect();
        let map = hot
            .iter()
            .enumerate()
            .map(|(i, &id)| (id, i as u32))
            .collect();
        let before = table.stats();
        Ok(CacheHits {
            gpu,
            table,
            batch: s.batch,
            round,
            stream,
            map,
            out: vec![RowRef::default(); s.batch],
            row_bytes: files.info.row_bytes() as u64,
            before,
            next_run: 0,
            next_base: 0,
        })
    }

    /// Ids looked up by one `run` or `baseline`.
    pub fn ids_per_round(&self) -> usize {
        self.round
    }

    /// Ids per resolve.
    pub fn batch(&self) -> usize {
        self.batch
    }

    fn round_ids(stream: &[u64], round: usize, k: &mut usize) -> std::ops::Range<usize> {
        let rounds = stream.len() / round;
        let r = *k % rounds;
        *k += 1;
        r * round..(r + 1) * round
    }

    /// The measured operation: one round of resolve and release calls.
    pub fn run(&mut self) -> Result<()> {
        let ids = Self::round_ids(&self.stream, self.round, &mut self.next_run);
        for b in self.stream[ids].chunks(self.batch) {
            let l = self.table.resolve(b, &mut self.out[..b.len()])?;
            black_box(&self.out);
            self.table.release(l, self.gpu.as_ref(), None)?;
        }
        Ok(())
    }

    /// The baseline: the same round of ids through a `HashMap` lookup each.
    pub fn baseline(&mut self) {
        let ids = Self::round_ids(&self.stream, self.round, &mut self.next_base);
        for b in self.stream[ids].chunks(self.batch) {
            for (o, id) in self.out.iter_mut().zip(b) {
                let slot = self.map.get(id).copied().unwrap_or_default();
                *o = RowRef {
                    data: 0x1000 + u64::from(slot) * self.row_bytes,
                    scale: 0,
                };
            }
            black_box(&self.out);
        }
    }

    /// Fails if any lookup since the hot set was loaded missed.
    pub fn check(&self) -> Result<()> {
        let misses = self.table.stats().misses - self.before.misses;
        ensure!(misses == 0, "the hit benchmark saw {misses} misses");
        Ok(())
    }
}

/// Random 4 KiB reads of one shard file through the miss path's reader
/// (io_uring at the row cache's depth, [`metrale_storage::cached::DEFAULT_IO_DEPTH`],
/// where available, O_DIRECT where the file system
/// allows it), against a plain `pread` loop on the same descriptor, one
/// read at a time.
pub struct RandomReads {
    path: PathBuf,
    file: ShardFile,
    reader: Arc<dyn PageReader>,
    pages: u64,
    batch: usize,
    rng: SmallRng,
    buf: AlignedBuf,
    one: AlignedBuf,
}

impl RandomReads {
    /// Open `path` for reads in batches of `batch` pages.
    pub fn new(path: &Path, batch: usize, seed: u64) -> Result<Self> {
        let file = ShardFile::open(path, true)?;
        let reader = default_reader(metrale_storage::cached::DEFAULT_IO_DEPTH)?;
        let pages = std::fs::metadata(path)
            .with_context(|| format!("reading the size of {}", path.display()))?
            .len()
            / PAGE as u64;
        ensure!(pages > 0, "{}: shorter than a page", path.display());
        let batch = batch.max(1);
        Ok(RandomReads {
            path: path.to_path_buf(),
            file,
            reader,
            pages,
            batch,
            rng: SmallRng::seed_from_u64(seed),
            buf: AlignedBuf::new(batch * PAGE),
            one: AlignedBuf::new(PAGE),
        })
    }

    /// The reader's name.
    pub fn reader_name(&self) -> &str {
        self.reader.name()
    }

    /// Whether reads bypass the page cache.
    pub fn direct(&self) -> bool {
        self.file.direct
    }

    /// The measured operation: one batch of random page reads through the
    /// reader (which keeps 32 in flight); returns the reads done.
    pub fn run(&mut self) -> Result<u64> {
        let fd = self.file.fd();
        let mut rest = self.buf.as_mut_slice();
        let mut reqs = Vec::with_capacity(self.batch);
        for _ in 0..self.batch {
            let (h, t) = rest.split_at_mut(PAGE);
            rest = t;
            reqs.push(ReadReq {
                fd,
                offset: self.rng.gen_range(0..self.pages) * PAGE as u64,
                buf: h,
            });
        }
        for r in self.reader.read_batch(&mut reqs) {
            ensure!(r? == PAGE, "short read from {}", self.path.display());
        }
        Ok(self.batch as u64)
    }

    /// The baseline: 16 random page reads with `pread`, one at a time;
    /// returns the reads done.
    pub fn baseline(&mut self) -> Result<u64> {
        for _ in 0..16 {
            let off = self.rng.gen_range(0..self.pages) * PAGE as u64;
            let n = pread_full(self.file.fd(), self.one.as_mut_slice(), off)
                .with_context(|| format!("reading {}", self.path.display()))?;
            ensure!(n == PAGE, "short read from {}", self.path.display());
        }
        Ok(16)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use metrale_gpu_runtime::cpu::CpuBackend;

    #[test]
    fn every_workload_runs_on_a_small_table() {
        let dir = tempfile::tempdir().unwrap();
        let files = write_table(dir.path(), 2, 256, 160, 7).unwrap();
        assert_eq!(files.info.rows, 512);
        let gpu: Arc<dyn GpuBackend> = Arc::new(CpuBackend::new());
        let mut g = ResidentGather::new(&files, gpu.clone(), 64, 1).unwrap();
        for pf in [0, 3, 8] {
            g.set_prefetch(pf);
            g.prepare().unwrap();
            g.run().unwrap();
            g.check().unwrap();
        }
        g.baseline();
        assert_eq!(g.bytes(), 64 * 320);
        g.close().unwrap();
        let sizes = HitSizes {
            slots: 64,
            hot: 32,
            batch: 8,
            batches_per_round: 2,
            rounds: 2,
        };
        let mut h = CacheHits::new(&files, gpu.clone(), &sizes, 2).unwrap();
        for _ in 0..3 {
            h.run().unwrap();
            h.baseline();
        }
        h.check().unwrap();
        drop(h);
        let mut r = RandomReads::new(&files.shards[0].path, 4, 3).unwrap();
        assert_eq!(r.run().unwrap(), 4);
        assert_eq!(r.baseline().unwrap(), 16);
        assert_eq!(gpu.live_alloc_count(), 0);
    }
}
