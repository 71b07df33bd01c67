//! The bookkeeping both backends' ledgers share: which device address
//! ranges are live, the host ranges of the host-visible ones, and which were
//! freed recently, with the checks and errors built on them.
//!
//! Each backend's ledger wraps a [`Book`] of its own entry type and adds how
//! addresses are obtained and memory released, so both backends account for
//! memory and refuse bad pointers identically.
//!
//! Invariants:
//! - `live` never holds overlapping ranges (a zero-byte entry occupies one
//!   address);
//! - `host_index` holds exactly the live entries that are not device memory;
//! - the most recent frees are remembered (bounded, oldest evicted first),
//!   pairwise disjoint, so a use after free or a double free is reported as
//!   such, with the allocation's label.

use std::collections::{BTreeMap, VecDeque};
use std::fmt;

use parking_lot::{Mutex, RwLock};

use crate::error::{AllocationRef, GpuError, Result};
use crate::gpu::{AllocationInfo, DevicePtr, MemoryKind};

/// How many freed ranges are remembered for use-after-free reports.
const FREED_MEMORY: usize = 1 << 16;

/// What a [`Book`] needs to know of a backend's entry.
pub(crate) trait Tracked {
    /// Logical size in bytes.
    fn bytes(&self) -> usize;
    /// The label given at allocation.
    fn label(&self) -> &str;
    /// Where it lives.
    fn kind(&self) -> MemoryKind;
    /// Host address of the first byte (unused for device memory).
    fn host(&self) -> usize;
}

/// A freed range, kept for error messages.
struct Freed {
    bytes: usize,
    label: String,
}

/// Freed ranges, oldest evicted first.
#[derive(Default)]
struct FreedLog {
    by_addr: BTreeMap<u64, Freed>,
    order: VecDeque<u64>,
}

/// An allocation as errors name it.
fn alloc_ref(base: u64, bytes: usize, label: &str) -> AllocationRef {
    AllocationRef {
        label: label.to_string(),
        base: DevicePtr(base),
        bytes,
    }
}

/// Live and recently freed allocations, keyed by device address.
pub(crate) struct Book<E> {
    live: RwLock<BTreeMap<u64, E>>,
    /// Host ranges of live host-mapped and registered entries, keyed by
    /// (host start, device start), with their size.
    host_index: RwLock<BTreeMap<(usize, u64), usize>>,
    freed: Mutex<FreedLog>,
}

impl<E> Default for Book<E> {
    fn default() -> Self {
        Book {
            live: RwLock::new(BTreeMap::new()),
            host_index: RwLock::new(BTreeMap::new()),
            freed: Mutex::new(FreedLog::default()),
        }
    }
}

impl<E: Tracked> Book<E> {
    /// Record a new allocation at `addr`.
    pub fn record(&self, addr: u64, entry: E) {
        if entry.kind() != MemoryKind::Device {
            self.host_index
                .write()
                .insert((entry.host(), addr), entry.bytes());
        }
        self.live.write().insert(addr, entry);
    }

    /// Drop every remembered freed range that overlaps `bytes` at `addr`,
    /// for an address the allocator hands out again.
    #[cfg(feature = "cuda")]
    pub fn forget_freed(&self, addr: u64, bytes: usize) {
        let mut freed = self.freed.lock();
        let end = addr.saturating_add(bytes.max(1) as u64);
        // Remembered ranges are disjoint, so walking down from `end` the
        // overlapping ones come first.
        let stale: Vec<u64> = freed
            .by_addr
            .range(..end)
            .rev()
            .take_while(|(b, f)| **b + f.bytes.max(1) as u64 > addr)
            .map(|(b, _)| *b)
            .collect();
        for b in stale {
            freed.by_addr.remove(&b);
            freed.order.retain(|&o| o != b);
        }
    }

    /// Check that `ptr` is the start of a live allocation, as `free` needs.
    pub fn check_freeable(&self, ptr: DevicePtr) -> Result<()> {
        let live = self.live.read();
        if live.contains_key(&ptr.0) {
            return Ok(());
        }
        let interior = live.range(..=ptr.0).next_back();
        if let Some((&base, e)) = interior.filter(|(b, e)| ptr.0 < **b + e.bytes().max(1) as u64) {
            return Err(GpuError::InteriorFree {
                ptr,
                offset: ptr.0 - base,
                alloc: alloc_ref(base, e.bytes(), e.label()),
            });
        }
        drop(live);
        let freed = self.freed.lock();
        if let Some(f) = freed.by_addr.get(&ptr.0) {
            return Err(GpuError::DoubleFree {
                ptr,
                alloc: alloc_ref(ptr.0, f.bytes, &f.label),
            });
        }
        let inside = freed.by_addr.range(..=ptr.0).next_back();
        if let Some((&base, f)) = inside.filter(|(b, f)| ptr.0 < **b + f.bytes.max(1) as u64) {
            return Err(GpuError::UseAfterFree {
                op: "free".into(),
                ptr,
                alloc: alloc_ref(base, f.bytes, &f.label),
            });
        }
        Err(GpuError::NotAllocated { ptr })
    }

    /// Take the allocation starting at `ptr` out of the book and remember
    /// it as freed. The caller releases the memory the entry names.
    pub fn remove(&self, ptr: DevicePtr) -> Result<E> {
        let entry = {
            let mut live = self.live.write();
            match live.remove(&ptr.0) {
                Some(e) => e,
                None => {
                    drop(live);
                    self.check_freeable(ptr)?;
                    return Err(GpuError::NotAllocated { ptr });
                }
            }
        };
        if entry.kind() != MemoryKind::Device {
            self.host_index.write().remove(&(entry.host(), ptr.0));
        }
        let mut freed = self.freed.lock();
        if freed.order.len() >= FREED_MEMORY
            && let Some(old) = freed.order.pop_front()
        {
            freed.by_addr.remove(&old);
        }
        freed.order.push_back(ptr.0);
        freed.by_addr.insert(
            ptr.0,
            Freed {
                bytes: entry.bytes(),
                label: entry.label().to_string(),
            },
        );
        Ok(entry)
    }

    /// Check that `[ptr, ptr + bytes)` lies inside one live allocation and
    /// give `at(entry, offset)`; `None` for an empty range at null. An empty
    /// range may sit anywhere from an allocation's start to its end.
    #[inline]
    pub fn locate<D: fmt::Display + ?Sized, R>(
        &self,
        op: &D,
        ptr: DevicePtr,
        bytes: usize,
        at: impl FnOnce(&E, u64) -> R,
    ) -> Result<Option<R>> {
        {
            let live = self.live.read();
            if let Some((&base, e)) = live.range(..=ptr.0).next_back() {
                let off = ptr.0 - base;
                let end = off.checked_add(bytes as u64);
                if end.is_some_and(|end| end <= e.bytes() as u64) {
                    return Ok(Some(at(e, off)));
                }
            }
        }
        if bytes == 0 && ptr.is_null() {
            return Ok(None);
        }
        Err(self.explain(op, ptr, bytes))
    }

    /// The error for a range that failed [`Self::locate`].
    #[cold]
    fn explain<D: fmt::Display + ?Sized>(&self, op: &D, ptr: DevicePtr, bytes: usize) -> GpuError {
        let op = op.to_string();
        if ptr.is_null() {
            return GpuError::NullPointer { op, bytes };
        }
        {
            let live = self.live.read();
            if let Some((&base, e)) = live.range(..=ptr.0).next_back() {
                let off = ptr.0 - base;
                let len = e.bytes() as u64;
                if off < len || (off == len && bytes > 0) {
                    let over = (off as u128 + bytes as u128) - len as u128;
                    return GpuError::OutOfBounds {
                        op,
                        ptr,
                        bytes,
                        over: u64::try_from(over).unwrap_or(u64::MAX),
                        alloc: alloc_ref(base, e.bytes(), e.label()),
                    };
                }
            }
        }
        let freed = self.freed.lock();
        let inside = freed.by_addr.range(..=ptr.0).next_back();
        if let Some((&base, f)) = inside.filter(|(b, f)| ptr.0 - **b <= f.bytes as u64) {
            return GpuError::UseAfterFree {
                op,
                ptr,
                alloc: alloc_ref(base, f.bytes, &f.label),
            };
        }
        GpuError::InvalidPointer { op, ptr, bytes }
    }

    /// The device address of host memory `[host, host + bytes)` when it lies
    /// inside one live host-mapped or registered allocation.
    pub fn device_of_host(&self, host: *const u8, bytes: usize) -> Option<DevicePtr> {
        let h = host as usize;
        let idx = self.host_index.read();
        let (&(start, dev), &len) = idx.range(..=(h, u64::MAX)).next_back()?;
        let off = h - start;
        (off.checked_add(bytes)? <= len).then(|| DevicePtr(dev + off as u64))
    }

    /// Bytes in live device and host-mapped allocations (registered memory
    /// is not counted).
    pub fn live_bytes(&self) -> usize {
        self.live
            .read()
            .values()
            .filter(|e| e.kind() != MemoryKind::HostRegistered)
            .map(|e| e.bytes())
            .sum()
    }

    /// Number of live allocations of every kind.
    pub fn live_count(&self) -> usize {
        self.live.read().len()
    }

    /// Every live allocation, by address.
    pub fn allocations(&self) -> Vec<AllocationInfo> {
        self.live
            .read()
            .iter()
            .map(|(&a, e)| AllocationInfo {
                ptr: DevicePtr(a),
                bytes: e.bytes(),
                label: e.label().to_string(),
                kind: e.kind(),
            })
            .collect()
    }

    /// Every live entry, for teardown.
    #[cfg(feature = "cuda")]
    pub fn drain(&self) -> Vec<(DevicePtr, E)> {
        self.host_index.write().clear();
        std::mem::take(&mut *self.live.write())
            .into_iter()
            .map(|(a, e)| (DevicePtr(a), e))
            .collect()
    }
}
