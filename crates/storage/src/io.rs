//! Positional page reads for the row cache: io_uring, a `pread` thread pool,
//! O_DIRECT files with a buffered fallback, and page-aligned buffers.
//!
//! The cache talks to a [`PageReader`], so tests can inject faults and the
//! runtime can pick io_uring or the pool by what the kernel allows.
//!
//! Invariants:
//! - a reader fills each request's buffer from its offset until the buffer
//!   is full or the file ends, retrying short transfers; it reports the
//!   bytes read (a count below the buffer length means end of file) or the
//!   OS error, per request, and never leaves a request in flight when it
//!   returns (buffers may be reused at once); a [`ReadFeed`] is read the
//!   same way, each read reported exactly once, as it finishes, and only
//!   once nothing writes its buffer any more;
//! - files opened with [`ShardFile::open`] use O_DIRECT when the file system
//!   accepts it, and carry the file's direct-I/O alignment ([`DioAlign`],
//!   queried once at open); the cache then only issues reads whose offset
//!   and length are multiples of its offset granule and whose buffer starts
//!   on a multiple of its memory granule (both at most [`PAGE`], which
//!   [`AlignedBuf`] guarantees for whole buffers);
//! - where O_DIRECT is refused the file is read through the page cache with
//!   `POSIX_FADV_RANDOM`, and a warning is logged once per file.
//!
//! Why one long file: a quarter of it is the tests of the readers against
//! each other (io_uring, the thread pool, O_DIRECT and its fallback), which
//! need the private buffer and alignment helpers they share.

use std::alloc::{Layout, alloc_zeroed, dealloc};
use std::fs::{File, OpenOptions};
use std::io;
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::thread::JoinHandle;

use crossbeam_channel::{Receiver, Sender, unbounded};
use parking_lot::Mutex;

use crate::error::{IoContext, Result, StorageError};

/// The largest I/O granule the cache supports, and the alignment of every
/// [`AlignedBuf`]: any direct-I/O alignment a file reports must divide it.
pub const PAGE: usize = 4096;

/// Where a file's [`DioAlign`] came from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AlignSource {
    /// `statx(STATX_DIO_READ_ALIGN)` (Linux 6.14+) or
    /// `statx(STATX_DIOALIGN)` (Linux 6.1+): the file system's own answer.
    Statx,
    /// The logical block size of the device holding the file
    /// (`BLKSSZGET` on a block device, else
    /// `/sys/dev/block/MAJ:MIN/queue/logical_block_size`).
    BlockDevice,
    /// Nothing answered: [`FALLBACK_DIRECT_ALIGN`] for O_DIRECT files.
    Fallback,
    /// The file is read through the page cache, which needs no alignment;
    /// reads still cover whole [`BUFFERED_ALIGN`] sectors so their spans
    /// (and byte counts) match what a direct read of the same rows would be.
    Buffered,
}

/// Alignment assumed for an O_DIRECT file when neither `statx` nor the
/// block device answers: 4096 is a multiple of every logical block size up
/// to a page, so it is always accepted (at the cost of reading more than a
/// 512-byte-sector device needs).
pub const FALLBACK_DIRECT_ALIGN: usize = 4096;

/// The span granule of buffered files (one classic sector).
pub const BUFFERED_ALIGN: usize = 512;

/// A file's direct-I/O alignment: reads must start and end on multiples of
/// `offset` and land in memory aligned to `mem`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DioAlign {
    /// File offset and length granule (a power of two, at most [`PAGE`]).
    pub offset: usize,
    /// Buffer address granule (a power of two, at most [`PAGE`]).
    pub mem: usize,
    /// Where the numbers came from.
    pub source: AlignSource,
}

impl DioAlign {
    /// The alignment of a file read through the page cache.
    pub const BUFFERED: DioAlign = DioAlign {
        offset: BUFFERED_ALIGN,
        mem: 1,
        source: AlignSource::Buffered,
    };

    /// Ask the kernel for the direct-I/O alignment of the open `file`:
    /// `statx` first, then the device's logical block size, then
    /// [`FALLBACK_DIRECT_ALIGN`]. Answers that are not powers of two or
    /// exceed [`PAGE`] are not used (the next source is asked).
    pub fn query(file: &File) -> DioAlign {
        let fd = file.as_raw_fd();
        if let Some((offset, mem)) = statx_dio(fd)
            && usable(offset)
            && usable(mem)
        {
            return DioAlign {
                offset,
                mem,
                source: AlignSource::Statx,
            };
        }
        if let Some(lbs) = block_size(file)
            && usable(lbs)
        {
            return DioAlign {
                offset: lbs,
                mem: lbs,
                source: AlignSource::BlockDevice,
            };
        }
        DioAlign {
            offset: FALLBACK_DIRECT_ALIGN,
            mem: FALLBACK_DIRECT_ALIGN,
            source: AlignSource::Fallback,
        }
    }
}

fn usable(a: usize) -> bool {
    a.is_power_of_two() && a <= PAGE
}

/// `(offset, memory)` direct-I/O alignment from `statx`, preferring the
/// read-specific offset alignment where the kernel reports one. `None`
/// where the kernel or file system does not answer (or reports 0: no
/// direct I/O for this file).
fn statx_dio(fd: RawFd) -> Option<(usize, usize)> {
    // SAFETY: an all-zero statx is a valid value of this plain C struct.
    let mut st: libc::statx = unsafe { std::mem::zeroed() };
    // SAFETY: the empty path with AT_EMPTY_PATH names `fd` itself; `st` is
    // a writable statx the kernel fills.
    let rc = unsafe {
        libc::statx(
            fd,
            c"".as_ptr(),
            libc::AT_EMPTY_PATH,
            libc::STATX_DIOALIGN | libc::STATX_DIO_READ_ALIGN,
            &mut st,
        )
    };
    if rc != 0 || st.stx_mask & libc::STATX_DIOALIGN == 0 {
        return None;
    }
    let mut offset = st.stx_dio_offset_align as usize;
    if st.stx_mask & libc::STATX_DIO_READ_ALIGN != 0 && st.stx_dio_read_offset_align != 0 {
        offset = st.stx_dio_read_offset_align as usize;
    }
    let mem = st.stx_dio_mem_align as usize;
    (offset != 0 && mem != 0).then_some((offset, mem))
}

/// The logical block size under `file`: `BLKSSZGET` when the file is a
/// block device itself, else sysfs for the device its file system is on
/// (a partition's own directory has no `queue/`, its disk's has).
fn block_size(file: &File) -> Option<usize> {
    use std::os::unix::fs::{FileTypeExt, MetadataExt};
    let md = file.metadata().ok()?;
    if md.file_type().is_block_device() {
        let mut lbs: libc::c_int = 0;
        // SAFETY: BLKSSZGET writes one int through the pointer.
        let rc = unsafe { libc::ioctl(file.as_raw_fd(), libc::BLKSSZGET, &mut lbs) };
        return (rc == 0 && lbs > 0).then_some(lbs as usize);
    }
    let dev = md.dev();
    let dir = PathBuf::from(format!(
        "/sys/dev/block/{}:{}",
        libc::major(dev),
        libc::minor(dev)
    ));
    ["queue/logical_block_size", "../queue/logical_block_size"]
        .iter()
        .find_map(|rel| std::fs::read_to_string(dir.join(rel)).ok())
        .and_then(|s| s.trim().parse().ok())
}

/// A heap buffer aligned to [`PAGE`], zero-initialised.
pub struct AlignedBuf {
    ptr: *mut u8,
    len: usize,
}

// SAFETY: the buffer is uniquely owned; access goes through &self/&mut self.
unsafe impl Send for AlignedBuf {}
// SAFETY: shared access only hands out `&[u8]`.
unsafe impl Sync for AlignedBuf {}

impl AlignedBuf {
    /// A zeroed buffer of `len` bytes rounded up to a whole page.
    pub fn new(len: usize) -> AlignedBuf {
        let len = len.max(PAGE).next_multiple_of(PAGE);
        let layout = Layout::from_size_align(len, PAGE).expect("page-aligned layout");
        // SAFETY: the layout has a non-zero size.
        let ptr = unsafe { alloc_zeroed(layout) };
        if ptr.is_null() {
            std::alloc::handle_alloc_error(layout);
        }
        AlignedBuf { ptr, len }
    }

    /// Its length in bytes (a multiple of [`PAGE`]).
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether it is empty (never: buffers hold at least a page).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The bytes.
    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: `ptr` owns `len` initialised bytes.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }

    /// The bytes, writable.
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: `ptr` owns `len` initialised bytes, borrowed uniquely.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
    }

    /// The start of the bytes, for [`FeedRead`]s into disjoint parts of
    /// the buffer while other parts are read or copied out.
    pub fn as_mut_ptr(&mut self) -> *mut u8 {
        self.ptr
    }
}

impl Drop for AlignedBuf {
    fn drop(&mut self) {
        let layout = Layout::from_size_align(self.len, PAGE).expect("page-aligned layout");
        // SAFETY: allocated in `new` with this layout.
        unsafe { dealloc(self.ptr, layout) };
    }
}

/// An open table shard file.
#[derive(Debug)]
pub struct ShardFile {
    /// Its path, for error messages.
    pub path: PathBuf,
    /// The open file.
    pub file: File,
    /// Whether reads bypass the page cache (O_DIRECT).
    pub direct: bool,
    /// The granules reads of this file keep to.
    pub align: DioAlign,
}

impl ShardFile {
    /// Open `path` for page reads: O_DIRECT when `direct` is asked for and
    /// the file system accepts it (probed with a real read), otherwise
    /// buffered with random-access advice and a logged warning.
    pub fn open(path: &Path, direct: bool) -> Result<ShardFile> {
        Self::open_with(path, direct, Self::try_direct)
    }

    /// [`Self::open`] with the O_DIRECT attempt supplied (tests simulate
    /// file systems that refuse it).
    fn open_with(
        path: &Path,
        direct: bool,
        try_direct: impl Fn(&Path) -> io::Result<File>,
    ) -> Result<ShardFile> {
        if direct {
            match try_direct(path) {
                Ok(f) => {
                    let align = DioAlign::query(&f);
                    return Ok(ShardFile {
                        path: path.to_path_buf(),
                        file: f,
                        direct: true,
                        align,
                    });
                }
                Err(e) if e.raw_os_error() == Some(libc::EINVAL) => {
                    tracing::warn!(
                        file = %path.display(),
                        "O_DIRECT refused by the file system; reading through the page cache"
                    );
                }
                Err(e) => return Err(e).io_ctx(path, || "opening with O_DIRECT"),
            }
        }
        let file = File::open(path).io_ctx(path, || "opening")?;
        // SAFETY: plain syscall on an fd we own.
        let rc = unsafe { libc::posix_fadvise(file.as_raw_fd(), 0, 0, libc::POSIX_FADV_RANDOM) };
        if rc != 0 {
            tracing::warn!(file = %path.display(), rc, "posix_fadvise(RANDOM) failed");
        }
        Ok(ShardFile {
            path: path.to_path_buf(),
            file,
            direct: false,
            align: DioAlign::BUFFERED,
        })
    }

    fn try_direct(path: &Path) -> io::Result<File> {
        let f = OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_DIRECT)
            .open(path)?;
        // Some file systems accept the flag at open and refuse the read.
        let mut probe = AlignedBuf::new(PAGE);
        f.read_at(probe.as_mut_slice(), 0)?;
        Ok(f)
    }

    /// The raw descriptor.
    pub fn fd(&self) -> RawFd {
        self.file.as_raw_fd()
    }
}

/// One positional read into a caller buffer.
#[derive(Debug)]
pub struct ReadReq<'a> {
    /// The file.
    pub fd: RawFd,
    /// Absolute offset.
    pub offset: u64,
    /// Destination; its length is the requested length.
    pub buf: &'a mut [u8],
}

/// One read of a [`ReadFeed`]: like [`ReadReq`], but into memory the feed
/// owns.
#[derive(Debug)]
pub struct FeedRead {
    /// The file.
    pub fd: RawFd,
    /// Absolute offset.
    pub offset: u64,
    /// Destination: `len` writable bytes that nothing else touches until
    /// the read is reported through [`ReadFeed::done`].
    pub ptr: *mut u8,
    /// Bytes requested.
    pub len: usize,
    /// The feed's name for this read, handed back in `done`.
    pub tag: u64,
}

/// A stream of reads handed to [`PageReader::read_feed`] one at a time
/// and reported as each finishes, so a caller can use early rows while
/// later ones are still on their way and add reads while others are in
/// flight.
///
/// # Safety
///
/// Every [`FeedRead`] returned by `next` must point at `len` writable
/// bytes that stay allocated, and that nothing else (no other read of the
/// feed included) reads or writes, until the reader has passed its tag to
/// `done`.
pub unsafe trait ReadFeed {
    /// The next read to submit, or `None` when there is none now. With
    /// `may_start` false the feed hands out only reads of work it has
    /// already started (see [`PageReader::read_feed`]).
    fn next(&mut self, may_start: bool) -> Option<FeedRead>;
    /// A read finished: the bytes it read (fewer than asked only at end of
    /// file) or its error. Called once per read, on the reading thread.
    fn done(&mut self, tag: u64, result: io::Result<usize>);
    /// Called after each run of `done` calls, before the reader blocks for
    /// more, so the feed can publish what arrived in one step.
    fn settled(&mut self) {}
}

/// Reads a default [`PageReader::read_feed`] takes into one batch at most.
const FEED_BATCH: usize = 512;

/// Something that performs batches of positional reads.
pub trait PageReader: Send + Sync {
    /// A short name for logs and benchmarks.
    fn name(&self) -> &str;
    /// Perform every request; `result[i]` is the byte count read into
    /// `reqs[i].buf` (less than its length only at end of file) or the error.
    fn read_batch(&self, reqs: &mut [ReadReq<'_>]) -> Vec<io::Result<usize>>;

    /// Perform the reads of `feed` until it has none left and none is in
    /// flight, reporting each as it finishes. Returns with nothing in
    /// flight. This default reads in batches through
    /// [`read_batch`](Self::read_batch): each batch starts with one
    /// `next(true)` and takes the rest with `next(false)`, so a feed whose
    /// work comes in chunks reads one chunk per batch.
    fn read_feed(&self, feed: &mut dyn ReadFeed) {
        loop {
            let mut batch: Vec<FeedRead> = Vec::new();
            while batch.len() < FEED_BATCH {
                match feed.next(batch.is_empty()) {
                    Some(r) => batch.push(r),
                    None => break,
                }
            }
            if batch.is_empty() {
                return;
            }
            let results = {
                let mut reqs: Vec<ReadReq<'_>> = batch
                    .iter()
                    .map(|r| ReadReq {
                        fd: r.fd,
                        offset: r.offset,
                        // SAFETY: the feed keeps `len` bytes at `ptr`
                        // untouched until `done` (the `ReadFeed` contract),
                        // and reads of one feed never overlap.
                        buf: unsafe { std::slice::from_raw_parts_mut(r.ptr, r.len) },
                    })
                    .collect();
                self.read_batch(&mut reqs)
            };
            for (r, res) in batch.iter().zip(results) {
                feed.done(r.tag, res);
            }
            feed.settled();
        }
    }
}

/// Read with `pread`, retrying short transfers until the buffer is full or
/// the file ends.
pub fn pread_full(fd: RawFd, buf: &mut [u8], offset: u64) -> io::Result<usize> {
    let mut done = 0usize;
    while done < buf.len() {
        let rest = &mut buf[done..];
        // SAFETY: `rest` is a valid writable buffer of the given length.
        let n = unsafe {
            libc::pread(
                fd,
                rest.as_mut_ptr().cast(),
                rest.len(),
                (offset + done as u64) as libc::off_t,
            )
        };
        if n < 0 {
            let e = io::Error::last_os_error();
            if e.kind() == io::ErrorKind::Interrupted {
                continue;
            }
            return Err(e);
        }
        if n == 0 {
            break;
        }
        done += n as usize;
    }
    Ok(done)
}

/// A read of a feed in flight on a ring, with the bytes it has so far.
struct InFlight {
    read: FeedRead,
    done: usize,
}

/// The io_uring reader: keeps up to `depth` reads in flight per batch or
/// feed.
pub struct UringReader {
    depth: usize,
    rings: Mutex<Vec<io_uring::IoUring>>,
}

impl UringReader {
    /// A reader with `depth` reads in flight, or an error when io_uring is
    /// unavailable (old kernel, seccomp, `io_uring_disabled`).
    pub fn new(depth: usize) -> io::Result<UringReader> {
        let depth = depth.clamp(1, 4096);
        let r = UringReader {
            depth,
            rings: Mutex::new(Vec::new()),
        };
        // Probe with a no-op so a ring that cannot run anything is caught now.
        let mut ring = r.new_ring()?;
        let nop = io_uring::opcode::Nop::new().build().user_data(0);
        // SAFETY: a no-op references no memory.
        unsafe { ring.submission().push(&nop) }
            .map_err(|_| io::Error::other("io_uring queue full"))?;
        ring.submit_and_wait(1)?;
        let cqe = ring
            .completion()
            .next()
            .ok_or_else(|| io::Error::other("io_uring gave no completion"))?;
        if cqe.result() < 0 {
            return Err(io::Error::from_raw_os_error(-cqe.result()));
        }
        r.rings.lock().push(ring);
        Ok(r)
    }

    fn new_ring(&self) -> io::Result<io_uring::IoUring> {
        io_uring::IoUring::new((self.depth as u32).next_power_of_two())
    }

    /// Keep up to `depth` reads of `feed` in flight on `ring`, asking the
    /// feed for more after every completion. Returns `Err` (with every
    /// read it had started reported, and none in flight) when the ring
    /// itself fails; the feed may still have reads to give.
    fn run_feed(&self, ring: &mut io_uring::IoUring, feed: &mut dyn ReadFeed) -> io::Result<()> {
        let mut slab: Vec<Option<InFlight>> = Vec::new();
        let mut free: Vec<usize> = Vec::new();
        // Slab entries whose remainder still has to be (re)submitted.
        let mut queue: std::collections::VecDeque<usize> = std::collections::VecDeque::new();
        let mut inflight = 0usize;
        loop {
            let mut dry = false;
            {
                let mut sq = ring.submission();
                while inflight < self.depth && !sq.is_full() {
                    let i = match queue.pop_front() {
                        Some(i) => i,
                        None => match feed.next(true) {
                            Some(read) => {
                                let e = Some(InFlight { read, done: 0 });
                                match free.pop() {
                                    Some(i) => {
                                        slab[i] = e;
                                        i
                                    }
                                    None => {
                                        slab.push(e);
                                        slab.len() - 1
                                    }
                                }
                            }
                            None => {
                                dry = true;
                                break;
                            }
                        },
                    };
                    let f = slab[i].as_ref().expect("queued reads are live");
                    let rest = f.read.len - f.done;
                    let sqe = io_uring::opcode::Read::new(
                        io_uring::types::Fd(f.read.fd),
                        // SAFETY: `done < len`, inside the feed's buffer.
                        unsafe { f.read.ptr.add(f.done) },
                        rest.min(u32::MAX as usize) as u32,
                    )
                    .offset(f.read.offset + f.done as u64)
                    .build()
                    .user_data(i as u64);
                    // SAFETY: the feed keeps the buffer alive and untouched
                    // until `done`, which is called only once the read has
                    // completed (`ReadFeed` contract).
                    if unsafe { sq.push(&sqe) }.is_err() {
                        queue.push_front(i);
                        break;
                    }
                    inflight += 1;
                }
            }
            if inflight == 0 {
                if dry && queue.is_empty() {
                    return Ok(());
                }
                continue;
            }
            match ring.submit_and_wait(1) {
                Ok(_) => {}
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => {
                    // The ring failed: wait out what is in flight, then
                    // report every started read as failed.
                    while inflight > 0 {
                        if ring.submit_and_wait(1).is_err() {
                            break;
                        }
                        inflight -= ring.completion().count();
                    }
                    for f in slab.into_iter().flatten() {
                        feed.done(f.read.tag, Err(io::Error::new(e.kind(), e.to_string())));
                    }
                    feed.settled();
                    return Err(e);
                }
            }
            let cqes: Vec<(usize, i32)> = ring
                .completion()
                .map(|c| (c.user_data() as usize, c.result()))
                .collect();
            for (i, r) in cqes {
                inflight -= 1;
                let f = slab[i].as_mut().expect("completed reads are live");
                let finished = if r < 0 {
                    if r == -libc::EINTR || r == -libc::EAGAIN {
                        None
                    } else {
                        Some(Err(io::Error::from_raw_os_error(-r)))
                    }
                } else if r == 0 {
                    Some(Ok(f.done))
                } else {
                    f.done += r as usize;
                    (f.done >= f.read.len).then_some(Ok(f.done))
                };
                match finished {
                    None => queue.push_back(i),
                    Some(res) => {
                        let f = slab[i].take().expect("live");
                        free.push(i);
                        feed.done(f.read.tag, res);
                    }
                }
            }
            feed.settled();
        }
    }
}

/// [`PageReader::read_feed`] by plain `pread`s, one read at a time.
fn feed_by_pread(feed: &mut dyn ReadFeed) {
    while let Some(r) = feed.next(true) {
        // SAFETY: the feed keeps `len` bytes at `ptr` untouched until
        // `done` (the `ReadFeed` contract).
        let buf = unsafe { std::slice::from_raw_parts_mut(r.ptr, r.len) };
        let res = pread_full(r.fd, buf, r.offset);
        feed.done(r.tag, res);
        feed.settled();
    }
}

impl PageReader for UringReader {
    fn name(&self) -> &str {
        "io_uring"
    }

    fn read_feed(&self, feed: &mut dyn ReadFeed) {
        let ring = self.rings.lock().pop();
        let mut ring = match ring.map_or_else(|| self.new_ring(), Ok) {
            Ok(r) => r,
            Err(e) => {
                tracing::warn!(error = %e, "io_uring ring creation failed; using pread");
                return feed_by_pread(feed);
            }
        };
        match self.run_feed(&mut ring, feed) {
            Ok(()) => self.rings.lock().push(ring),
            Err(e) => {
                tracing::warn!(error = %e, "io_uring ring failed; reading the rest with pread");
                feed_by_pread(feed);
            }
        }
    }

    fn read_batch(&self, reqs: &mut [ReadReq<'_>]) -> Vec<io::Result<usize>> {
        let mut feed = BatchFeed {
            results: (0..reqs.len()).map(|_| None).collect(),
            reqs,
            next: 0,
        };
        self.read_feed(&mut feed);
        feed.results
            .into_iter()
            .map(|r| r.unwrap_or_else(|| Err(io::Error::other("a read was never reported"))))
            .collect()
    }
}

/// The requests of one batch as a [`ReadFeed`], so a streaming reader
/// reads a batch the way it reads a feed.
struct BatchFeed<'r, 'b> {
    reqs: &'r mut [ReadReq<'b>],
    next: usize,
    results: Vec<Option<io::Result<usize>>>,
}

// SAFETY: each read points at its own request's buffer, borrowed (and so
// kept and untouched) for as long as the feed lives.
unsafe impl ReadFeed for BatchFeed<'_, '_> {
    fn next(&mut self, _may_start: bool) -> Option<FeedRead> {
        let i = self.next;
        let r = self.reqs.get_mut(i)?;
        self.next += 1;
        Some(FeedRead {
            fd: r.fd,
            offset: r.offset,
            ptr: r.buf.as_mut_ptr(),
            len: r.buf.len(),
            tag: i as u64,
        })
    }

    fn done(&mut self, tag: u64, result: io::Result<usize>) {
        self.results[tag as usize] = Some(result);
    }
}

struct PoolJob {
    fd: RawFd,
    offset: u64,
    ptr: usize,
    len: usize,
    index: usize,
    reply: Sender<(usize, io::Result<usize>)>,
}

/// A pool of threads doing blocking `pread`s, for kernels without io_uring.
pub struct PreadPool {
    tx: Option<Sender<PoolJob>>,
    threads: Vec<JoinHandle<()>>,
}

impl PreadPool {
    /// A pool of `threads` reader threads.
    pub fn new(threads: usize) -> Result<PreadPool> {
        let (tx, rx): (Sender<PoolJob>, Receiver<PoolJob>) = unbounded();
        let mut handles = Vec::new();
        for i in 0..threads.max(1) {
            let rx = rx.clone();
            let h = std::thread::Builder::new()
                .name(format!("table-pread-{i}"))
                .spawn(move || {
                    for job in rx.iter() {
                        // SAFETY: the submitter keeps the buffer alive and
                        // untouched until it has received this job's reply.
                        let buf =
                            unsafe { std::slice::from_raw_parts_mut(job.ptr as *mut u8, job.len) };
                        let r = pread_full(job.fd, buf, job.offset);
                        let _ = job.reply.send((job.index, r));
                    }
                })
                .map_err(|cause| StorageError::Thread {
                    what: "a pread thread",
                    cause,
                })?;
            handles.push(h);
        }
        Ok(PreadPool {
            tx: Some(tx),
            threads: handles,
        })
    }
}

impl PageReader for PreadPool {
    fn name(&self) -> &str {
        "pread-pool"
    }

    fn read_batch(&self, reqs: &mut [ReadReq<'_>]) -> Vec<io::Result<usize>> {
        let tx = self.tx.as_ref().expect("pool is live until dropped");
        let (rtx, rrx) = unbounded();
        let mut sent = 0;
        let mut out: Vec<Option<io::Result<usize>>> = (0..reqs.len()).map(|_| None).collect();
        for (i, r) in reqs.iter_mut().enumerate() {
            let job = PoolJob {
                fd: r.fd,
                offset: r.offset,
                ptr: r.buf.as_mut_ptr() as usize,
                len: r.buf.len(),
                index: i,
                reply: rtx.clone(),
            };
            if tx.send(job).is_err() {
                out[i] = Some(pread_full(r.fd, r.buf, r.offset));
            } else {
                sent += 1;
            }
        }
        drop(rtx);
        for _ in 0..sent {
            match rrx.recv() {
                Ok((i, r)) => out[i] = Some(r),
                // Unreachable while the pool lives: every job replies.
                Err(_) => break,
            }
        }
        out.into_iter()
            .map(|r| r.unwrap_or_else(|| Err(io::Error::other("pread pool lost a request"))))
            .collect()
    }
}

impl Drop for PreadPool {
    fn drop(&mut self) {
        self.tx.take();
        for h in self.threads.drain(..) {
            let _ = h.join();
        }
    }
}

/// The best reader this kernel allows: io_uring with `depth` reads in
/// flight, else a pool of `depth.min(16)` `pread` threads (logged).
pub fn default_reader(depth: usize) -> Result<Arc<dyn PageReader>> {
    match UringReader::new(depth) {
        Ok(r) => Ok(Arc::new(r)),
        Err(e) => {
            tracing::warn!(error = %e, "io_uring unavailable; using a pread thread pool");
            Ok(Arc::new(PreadPool::new(depth.clamp(1, 16))?))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample_file(dir: &Path, len: usize) -> (PathBuf, Vec<u8>) {
        let data: Vec<u8> = (0..len).map(|i| (i * 7 + i / 4096) as u8).collect();
        let p = dir.join("f.bin");
        std::fs::write(&p, &data).unwrap();
        (p, data)
    }

    fn check_reader(r: &dyn PageReader, f: &ShardFile, data: &[u8]) {
        let offs = [0u64, 4096 * 3, 4096 * 9, (data.len() / PAGE * PAGE) as u64];
        let mut bufs: Vec<AlignedBuf> = offs.iter().map(|_| AlignedBuf::new(2 * PAGE)).collect();
        let mut reqs: Vec<ReadReq<'_>> = bufs
            .iter_mut()
            .zip(offs)
            .map(|(b, o)| ReadReq {
                fd: f.fd(),
                offset: o,
                buf: b.as_mut_slice(),
            })
            .collect();
        let res = r.read_batch(&mut reqs);
        for ((res, o), b) in res.into_iter().zip(offs).zip(&bufs) {
            let n = res.unwrap();
            let want = (data.len() - o as usize).min(2 * PAGE);
            assert_eq!(n, want, "{} at {o}", r.name());
            assert_eq!(&b.as_slice()[..n], &data[o as usize..o as usize + n]);
        }
    }

    #[test]
    fn readers_read_what_is_there() {
        let d = tempfile::tempdir().unwrap();
        let (p, data) = sample_file(d.path(), 4096 * 12 + 100);
        let f = ShardFile::open(&p, true).unwrap();
        check_reader(&PreadPool::new(3).unwrap(), &f, &data);
        match UringReader::new(4) {
            Ok(u) => check_reader(&u, &f, &data),
            Err(e) => eprintln!("io_uring unavailable here ({e}); only the pool was checked"),
        }
        let buffered = ShardFile::open(&p, false).unwrap();
        assert!(!buffered.direct);
        check_reader(default_reader(8).unwrap().as_ref(), &buffered, &data);
    }

    /// A feed of `n` one-page reads at scattered offsets (one of them
    /// past the end of the file, one on a bad descriptor), handing out a
    /// new "chunk" of `chunk` reads only when allowed to start one, and
    /// recording what each report said.
    struct TestFeed {
        fd: RawFd,
        bufs: Vec<AlignedBuf>,
        offs: Vec<u64>,
        next: usize,
        chunk: usize,
        reported: Vec<Option<io::Result<usize>>>,
        settles: usize,
        /// Reads handed out before the first report.
        before_first_report: Option<usize>,
    }

    // SAFETY: each read gets its own buffer, kept until the feed is dropped.
    unsafe impl ReadFeed for TestFeed {
        fn next(&mut self, may_start: bool) -> Option<FeedRead> {
            if self.next == self.offs.len() || (!may_start && self.next.is_multiple_of(self.chunk))
            {
                return None;
            }
            let i = self.next;
            self.next += 1;
            Some(FeedRead {
                fd: if i == 3 { -1 } else { self.fd },
                offset: self.offs[i],
                ptr: self.bufs[i].as_mut_ptr(),
                len: PAGE,
                tag: 1000 + i as u64,
            })
        }
        fn done(&mut self, tag: u64, result: io::Result<usize>) {
            self.before_first_report.get_or_insert(self.next);
            let i = (tag - 1000) as usize;
            assert!(self.reported[i].is_none(), "read {i} reported twice");
            self.reported[i] = Some(result);
        }
        fn settled(&mut self) {
            self.settles += 1;
        }
    }

    #[test]
    fn feeds_are_read_in_full_and_reported_once_each() {
        let d = tempfile::tempdir().unwrap();
        let (p, data) = sample_file(d.path(), 40 * PAGE + 100);
        let f = ShardFile::open(&p, true).unwrap();
        let n = 37;
        let offs: Vec<u64> = (0..n)
            .map(|i| {
                if i == 5 {
                    60 * PAGE as u64
                } else {
                    ((i * 11) % 41) as u64 * PAGE as u64
                }
            })
            .collect();
        let mut readers: Vec<Arc<dyn PageReader>> = vec![Arc::new(PreadPool::new(2).unwrap())];
        match UringReader::new(8) {
            Ok(u) => readers.push(Arc::new(u)),
            Err(e) => eprintln!("io_uring unavailable here ({e}); only the pool was checked"),
        }
        for r in readers {
            let mut feed = TestFeed {
                fd: f.fd(),
                bufs: (0..n).map(|_| AlignedBuf::new(PAGE)).collect(),
                offs: offs.clone(),
                next: 0,
                chunk: 10,
                reported: (0..n).map(|_| None).collect(),
                settles: 0,
                before_first_report: None,
            };
            r.read_feed(&mut feed);
            assert_eq!(feed.next, n, "{}", r.name());
            for (i, &o) in offs.iter().enumerate() {
                let res = feed.reported[i].take().expect("every read is reported");
                let o = o as usize;
                match i {
                    3 => assert_eq!(res.unwrap_err().raw_os_error(), Some(libc::EBADF)),
                    5 => assert_eq!(res.unwrap(), 0, "{}: past the end", r.name()),
                    _ => {
                        let got = res.unwrap();
                        let want = (data.len() - o).min(PAGE);
                        assert_eq!(got, want, "{} read {i}", r.name());
                        assert_eq!(&feed.bufs[i].as_slice()[..got], &data[o..o + got]);
                    }
                }
            }
            assert!(feed.settles >= 1, "{}", r.name());
            if r.name() == "io_uring" {
                // At most the ring's depth goes out before the first
                // report: later reads are asked for as earlier ones finish.
                assert!(
                    feed.before_first_report.unwrap() <= 8,
                    "{:?}",
                    feed.before_first_report
                );
            } else {
                // A batching reader reads one chunk at a time.
                assert!(
                    feed.before_first_report.unwrap() <= 10,
                    "{:?}",
                    feed.before_first_report
                );
            }
        }
    }

    #[test]
    fn errors_are_reported_per_request() {
        let mut b = AlignedBuf::new(PAGE);
        let mut reqs = [ReadReq {
            fd: -1,
            offset: 0,
            buf: b.as_mut_slice(),
        }];
        for r in [
            default_reader(4).unwrap(),
            Arc::new(PreadPool::new(1).unwrap()) as Arc<dyn PageReader>,
        ] {
            let res = r.read_batch(&mut reqs);
            assert_eq!(
                res[0].as_ref().unwrap_err().raw_os_error(),
                Some(libc::EBADF),
                "{}",
                r.name()
            );
        }
    }

    #[test]
    fn refused_o_direct_falls_back_to_buffered_reads() {
        let d = tempfile::tempdir().unwrap();
        let (p, data) = sample_file(d.path(), 12 * PAGE + 100);
        let einval = |_: &Path| Err(io::Error::from_raw_os_error(libc::EINVAL));
        let f = ShardFile::open_with(&p, true, einval).unwrap();
        assert!(!f.direct);
        check_reader(&PreadPool::new(1).unwrap(), &f, &data);
        let eacces = |_: &Path| Err(io::Error::from_raw_os_error(libc::EACCES));
        let e = format!("{:#}", ShardFile::open_with(&p, true, eacces).unwrap_err());
        assert!(e.contains("f.bin") && e.contains("O_DIRECT"), "{e}");
        let missing = ShardFile::open(&d.path().join("nope"), true).unwrap_err();
        assert!(format!("{missing:#}").contains("nope"));
    }

    #[test]
    fn direct_files_know_their_alignment() {
        let d = tempfile::tempdir().unwrap();
        let (p, data) = sample_file(d.path(), 4 * PAGE);
        let f = ShardFile::open(&p, true).unwrap();
        let a = f.align;
        eprintln!("direct={} alignment {a:?}", f.direct);
        if f.direct {
            assert!(a.offset.is_power_of_two() && a.offset <= PAGE, "{a:?}");
            assert!(a.mem.is_power_of_two() && a.mem <= PAGE, "{a:?}");
            assert_ne!(a.source, AlignSource::Buffered);
            // A read of exactly one offset granule at an unaligned-to-page
            // position must be accepted by the kernel.
            let mut b = AlignedBuf::new(PAGE);
            let off = (PAGE + a.offset) as u64 % (4 * PAGE) as u64;
            let n = pread_full(f.fd(), &mut b.as_mut_slice()[..a.offset], off).unwrap();
            assert_eq!(&b.as_slice()[..n], &data[off as usize..off as usize + n]);
        } else {
            assert_eq!(a, DioAlign::BUFFERED);
        }
        assert_eq!(
            ShardFile::open(&p, false).unwrap().align,
            DioAlign::BUFFERED
        );
        assert!(!usable(0) && !usable(3) && !usable(8192) && usable(512));
    }

    #[test]
    fn aligned_buf_is_aligned() {
        let b = AlignedBuf::new(100);
        assert_eq!(b.len(), PAGE);
        assert_eq!(b.as_slice().as_ptr() as usize % PAGE, 0);
    }
}
