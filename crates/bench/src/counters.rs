//! Process-wide counters the kernel keeps, read from `/proc`: the bytes
//! this process read from storage and the CPU time of its threads.
//!
//! Invariant: a counter the kernel cannot give (another OS, a thread that
//! exited between listing and reading) is `None` or skipped, never a
//! guess; only differences over a span mean anything.

/// Bytes this process has read from storage so far (`read_bytes` of
/// `/proc/self/io`), when the kernel reports it.
pub fn process_read_bytes() -> Option<u64> {
    let s = std::fs::read_to_string("/proc/self/io").ok()?;
    s.lines()
        .find_map(|l| l.strip_prefix("read_bytes:"))
        .and_then(|v| v.trim().parse().ok())
}

/// CPU time so far, in nanoseconds, of this process's threads named
/// `table-prefetch` (the row caches' prefetch threads) and of all its
/// threads (`/proc/self/task/*/schedstat`), when the kernel reports it.
/// Threads that have exited are not counted, so only differences over a
/// span in which none exits mean anything.
pub fn thread_cpu_ns() -> Option<(u64, u64)> {
    let mut prefetch = 0u64;
    let mut total = 0u64;
    for t in std::fs::read_dir("/proc/self/task").ok()? {
        let dir = t.ok()?.path();
        // A thread may exit between the listing and the reads.
        let Ok(stat) = std::fs::read_to_string(dir.join("schedstat")) else {
            continue;
        };
        let ns: u64 = stat.split_whitespace().next()?.parse().ok()?;
        total += ns;
        let comm = std::fs::read_to_string(dir.join("comm")).unwrap_or_default();
        if comm.trim_end() == "table-prefetch" {
            prefetch += ns;
        }
    }
    Some((prefetch, total))
}
