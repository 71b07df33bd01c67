//! A page reader that fails a share of read batches on purpose, for `soak`
//! and `run --fault-percent`: each failing batch either returns EIO for
//! every request or cuts every read short (64 bytes), as a flaky disk or a
//! truncated file would.
//!
//! Invariant: while it is off, or for the batches it lets through, it is
//! exactly the inner reader; the decision is a deterministic function of
//! the seed and the order of batches.

use std::io;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use metrale_storage::io::{PageReader, ReadReq};
use metrale_storage::splitmix::SplitMix64;

const EIO: i32 = 5;

/// Fails `percent` of read batches while enabled.
pub struct FlakyReader {
    inner: Arc<dyn PageReader>,
    /// Failing batches per million.
    per_million: u64,
    /// Whether faults are injected now.
    pub on: AtomicBool,
    state: AtomicU64,
    /// Batches failed so far.
    pub injected: AtomicU64,
}

impl FlakyReader {
    /// Fail `percent` of the batches read through `inner`, decided from
    /// `seed`; starts enabled.
    pub fn new(inner: Arc<dyn PageReader>, percent: f64, seed: u64) -> FlakyReader {
        FlakyReader {
            inner,
            per_million: (percent.clamp(0.0, 100.0) * 10_000.0).round() as u64,
            on: AtomicBool::new(true),
            state: AtomicU64::new(seed),
            injected: AtomicU64::new(0),
        }
    }

    /// Batches failed so far.
    pub fn injected(&self) -> u64 {
        self.injected.load(Ordering::Relaxed)
    }
}

impl PageReader for FlakyReader {
    fn name(&self) -> &str {
        "flaky"
    }
    fn read_batch(&self, reqs: &mut [ReadReq<'_>]) -> Vec<io::Result<usize>> {
        let mut s = self
            .state
            .fetch_add(0x9E37_79B9_7F4A_7C15, Ordering::Relaxed);
        let r = SplitMix64::step(&mut s) % 1_000_000;
        if !self.on.load(Ordering::Relaxed) || r >= self.per_million {
            return self.inner.read_batch(reqs);
        }
        self.injected.fetch_add(1, Ordering::Relaxed);
        if r.is_multiple_of(2) {
            reqs.iter()
                .map(|_| Err(io::Error::from_raw_os_error(EIO)))
                .collect()
        } else {
            self.inner
                .read_batch(reqs)
                .into_iter()
                .map(|r| r.map(|n| n.min(64)))
                .collect()
        }
    }
}
