//! The offload bench's memory figures: the process's resident set (now
//! and its peak, from `/proc/self/status`), the memory the kernel reports
//! available, and how much of the table files sits in the page cache
//! (`mincore` over a mapping that never touches the pages).
//!
//! Invariant: every figure is read from the kernel; one it cannot give
//! (another OS, a file that vanished) is `None`, never a guess.

use std::path::PathBuf;

use serde::Serialize;

/// A `kB` field of `/proc/self/status`, in bytes.
fn status_bytes(field: &str) -> Option<u64> {
    let text = std::fs::read_to_string("/proc/self/status").ok()?;
    kib_field(&text, field)
}

/// `field:   N kB` of a `/proc` text, in bytes.
fn kib_field(text: &str, field: &str) -> Option<u64> {
    text.lines().find_map(|l| {
        let rest = l.strip_prefix(field)?.strip_prefix(':')?;
        let kib: u64 = rest.trim().strip_suffix("kB")?.trim().parse().ok()?;
        Some(kib * 1024)
    })
}

/// The process's resident set now.
pub fn rss_bytes() -> Option<u64> {
    status_bytes("VmRSS")
}

/// The process's peak resident set.
pub fn peak_rss_bytes() -> Option<u64> {
    status_bytes("VmHWM")
}

/// `MemAvailable` of `/proc/meminfo`.
pub fn available_bytes() -> Option<u64> {
    kib_field(
        &std::fs::read_to_string("/proc/meminfo").ok()?,
        "MemAvailable",
    )
}

/// `Cached` of `/proc/meminfo`: the whole page cache.
fn page_cache_bytes() -> Option<u64> {
    kib_field(&std::fs::read_to_string("/proc/meminfo").ok()?, "Cached")
}

/// Bytes of `paths` in the page cache.
fn cached_bytes(paths: &[PathBuf]) -> Option<u64> {
    let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    let page = u64::try_from(page).ok().filter(|&p| p > 0)?;
    let mut total = 0u64;
    for p in paths {
        let f = std::fs::File::open(p).ok()?;
        let len = f.metadata().ok()?.len();
        if len == 0 {
            continue;
        }
        // SAFETY: the map is only handed to mincore, which reads page
        // residency and never the pages; a file truncated meanwhile makes
        // mincore fail (ENOMEM), not the process.
        let map = unsafe { memmap2::Mmap::map(&f) }.ok()?;
        let pages = len.div_ceil(page) as usize;
        let mut vec = vec![0u8; pages];
        // SAFETY: `map` spans `len` bytes and `vec` one byte per page.
        let rc = unsafe {
            libc::mincore(
                map.as_ptr() as *mut libc::c_void,
                len as usize,
                vec.as_mut_ptr(),
            )
        };
        if rc != 0 {
            return None;
        }
        let resident = vec.iter().filter(|&&b| b & 1 == 1).count() as u64;
        total += (resident * page).min(len);
    }
    Some(total)
}

/// The figures at the start of a run.
pub struct Snapshot {
    rss: Option<u64>,
    table_cached: Option<u64>,
    page_cache: Option<u64>,
}

impl Snapshot {
    /// Now, for the table files `paths`.
    pub fn now(paths: &[PathBuf]) -> Snapshot {
        Snapshot {
            rss: rss_bytes(),
            table_cached: cached_bytes(paths),
            page_cache: page_cache_bytes(),
        }
    }
}

/// A run's memory: the process's RSS with the checkpoint open and before
/// any table was, its peak over the run, and the table files' page cache
/// before and after (what the run leaves behind for the host).
#[derive(Serialize, Debug, Clone)]
pub struct Report {
    /// RSS with the checkpoint open, before the tables were opened.
    pub rss_start_bytes: Option<u64>,
    /// The process's peak RSS over the whole run.
    pub peak_rss_bytes: Option<u64>,
    /// Bytes of the table files in the page cache when the run started.
    pub table_page_cache_start_bytes: Option<u64>,
    /// ... and when it ended.
    pub table_page_cache_end_bytes: Option<u64>,
    /// The host's whole page cache (`Cached`) at the start and the end.
    pub page_cache_start_bytes: Option<u64>,
    /// See `page_cache_start_bytes`.
    pub page_cache_end_bytes: Option<u64>,
}

impl Report {
    /// From `start` to now, for the table files `paths`.
    pub fn since(start: &Snapshot, paths: &[PathBuf]) -> Report {
        Report {
            rss_start_bytes: start.rss,
            peak_rss_bytes: peak_rss_bytes(),
            table_page_cache_start_bytes: start.table_cached,
            table_page_cache_end_bytes: cached_bytes(paths),
            page_cache_start_bytes: start.page_cache,
            page_cache_end_bytes: page_cache_bytes(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_kib_fields() {
        let t = "Name:\tx\nVmHWM:\t  2048 kB\nVmRSS:\t 1024 kB\n";
        assert_eq!(kib_field(t, "VmRSS"), Some(1024 * 1024));
        assert_eq!(kib_field(t, "VmHWM"), Some(2048 * 1024));
        assert_eq!(kib_field(t, "VmSwap"), None);
        assert_eq!(kib_field("VmRSSx: 3 kB", "VmRSS"), None);
    }

    #[test]
    fn page_cache_of_a_file_just_written_and_read() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("f");
        std::fs::write(&p, vec![7u8; 1 << 20]).unwrap();
        let _ = std::fs::read(&p).unwrap();
        let c = cached_bytes(&[p]).expect("mincore on Linux");
        // Written and read at once: the kernel holds at least some of it.
        assert!(c > 0 && c <= 1 << 20, "{c}");
    }

    #[test]
    fn the_peak_is_at_least_the_rss_read_with_it() {
        // One read of the status: other tests' threads allocate between
        // two reads, so only figures of the same read compare.
        let t = std::fs::read_to_string("/proc/self/status").unwrap();
        let (rss, peak) = (kib_field(&t, "VmRSS"), kib_field(&t, "VmHWM"));
        assert!(
            rss.unwrap() > 0 && peak.unwrap() >= rss.unwrap(),
            "{rss:?} {peak:?}"
        );
        assert!(rss_bytes().is_some() && peak_rss_bytes().is_some());
    }
}
