//! The CUDA backend's ledger: which device address ranges are live, with
//! their labels and kinds, and which were freed recently.
//!
//! It reports exactly what the CPU backend's ledger reports (`live_bytes`
//! counts device and host-mapped bytes, never registered ones; every kind
//! counts in `live_count`), and checks ranges the same way, so the two
//! backends refuse the same bad pointers with the same errors.
//!
//! Invariants:
//! - keys are the device addresses the driver returned (with unified
//!   addressing a mapped or registered range's device address is its host
//!   address); a zero-byte allocation is backed by one driver byte so its
//!   address is distinct, but is recorded with `bytes == 0`;
//! - unlike the CPU backend, the driver may hand out an address again after
//!   it was freed: an allocation drops every remembered freed range it
//!   overlaps, so a stale pointer into a reused range reads as live (the
//!   driver cannot tell them apart either);
//! - the ledger owns no memory: the backend frees what an [`Entry`] names
//!   after taking it out with [`Ledger::remove`].

use std::collections::{BTreeMap, VecDeque};
use std::fmt;

use parking_lot::{Mutex, RwLock};

use crate::error::{AllocationRef, GpuError, Result};
use crate::gpu::{AllocationInfo, DevicePtr, MemoryKind};

/// How many freed ranges are remembered for use-after-free reports.
const FREED_MEMORY: usize = 1 << 16;

/// What the backend must do to release an entry's memory.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Release {
    /// `cuMemFree`.
    DeviceFree,
    /// `cuMemFreeHost` of the host address.
    HostFree,
    /// `cuMemHostUnregister` of the host address, then free the
    /// page-aligned buffer the backend allocated itself (`bytes`, rounded
    /// up to a page).
    UnregisterAndFree,
    /// `cuMemHostUnregister` of the host address only (caller memory).
    Unregister,
}

/// One live allocation.
#[derive(Clone, Debug)]
pub(crate) struct Entry {
    /// Logical size in bytes.
    pub bytes: usize,
    /// The label given at allocation.
    pub label: String,
    /// Where it lives.
    pub kind: MemoryKind,
    /// Host address of the first byte (0 for device memory).
    pub host: usize,
    /// How to release it.
    pub release: Release,
}

struct Freed {
    bytes: usize,
    label: String,
}

#[derive(Default)]
struct FreedLog {
    by_addr: BTreeMap<u64, Freed>,
    order: VecDeque<u64>,
}

fn alloc_ref(base: u64, bytes: usize, label: &str) -> AllocationRef {
    AllocationRef {
        label: label.to_string(),
        base: DevicePtr(base),
        bytes,
    }
}

/// The ledger of live and recently freed allocations.
#[derive(Default)]
pub(crate) struct Ledger {
    live: RwLock<BTreeMap<u64, Entry>>,
    /// Host ranges of live host-mapped and registered entries, keyed by
    /// (host start, device start), with their size.
    host_index: RwLock<BTreeMap<(usize, u64), usize>>,
    freed: Mutex<FreedLog>,
}

impl Ledger {
    /// Record a new allocation at `ptr`.
    pub fn insert(&self, ptr: DevicePtr, entry: Entry) {
        {
            let mut freed = self.freed.lock();
            let end = ptr.0.saturating_add(entry.bytes.max(1) as u64);
            let stale: Vec<u64> = freed
                .by_addr
                .range(..end)
                .filter(|(b, f)| **b + f.bytes.max(1) as u64 > ptr.0)
                .map(|(b, _)| *b)
                .collect();
            for b in stale {
                freed.by_addr.remove(&b);
                freed.order.retain(|&o| o != b);
            }
        }
        if entry.kind != MemoryKind::Device {
            self.host_index
                .write()
                .insert((entry.host, ptr.0), entry.bytes);
        }
        self.live.write().insert(ptr.0, entry);
    }

    /// Check that `ptr` is the start of a live allocation, as `free` needs.
    pub fn check_freeable(&self, ptr: DevicePtr) -> Result<()> {
        let live = self.live.read();
        if live.contains_key(&ptr.0) {
            return Ok(());
        }
        let interior = live.range(..=ptr.0).next_back();
        if let Some((&base, e)) = interior.filter(|(b, e)| ptr.0 < **b + e.bytes.max(1) as u64) {
            return Err(GpuError::InteriorFree {
                ptr,
                offset: ptr.0 - base,
                alloc: alloc_ref(base, e.bytes, &e.label),
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

    /// Take the allocation starting at `ptr` out of the ledger and remember
    /// it as freed. The caller releases the memory the entry names.
    pub fn remove(&self, ptr: DevicePtr) -> Result<Entry> {
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
        if entry.kind != MemoryKind::Device {
            self.host_index.write().remove(&(entry.host, ptr.0));
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
                bytes: entry.bytes,
                label: entry.label.clone(),
            },
        );
        Ok(entry)
    }

    /// Check that `[ptr, ptr + bytes)` lies inside one live allocation. An
    /// empty range may sit anywhere from an allocation's start to its end,
    /// or at null.
    pub fn check<D: fmt::Display + ?Sized>(
        &self,
        op: &D,
        ptr: DevicePtr,
        bytes: usize,
    ) -> Result<()> {
        {
            let live = self.live.read();
            if let Some((&base, e)) = live.range(..=ptr.0).next_back() {
                let off = ptr.0 - base;
                if off
                    .checked_add(bytes as u64)
                    .is_some_and(|end| end <= e.bytes as u64)
                {
                    return Ok(());
                }
            }
        }
        if bytes == 0 && ptr.is_null() {
            return Ok(());
        }
        Err(self.explain(op, ptr, bytes))
    }

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
                if off < e.bytes as u64 || (off == e.bytes as u64 && bytes > 0) {
                    let over = (off as u128 + bytes as u128) - e.bytes as u128;
                    return GpuError::OutOfBounds {
                        op,
                        ptr,
                        bytes,
                        over: over as u64,
                        alloc: alloc_ref(base, e.bytes, &e.label),
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

    /// Bytes in live device and host-mapped allocations.
    pub fn live_bytes(&self) -> usize {
        self.live
            .read()
            .values()
            .filter(|e| e.kind != MemoryKind::HostRegistered)
            .map(|e| e.bytes)
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
                bytes: e.bytes,
                label: e.label.clone(),
                kind: e.kind,
            })
            .collect()
    }

    /// Every live entry, for teardown.
    pub fn drain(&self) -> Vec<(DevicePtr, Entry)> {
        self.host_index.write().clear();
        std::mem::take(&mut *self.live.write())
            .into_iter()
            .map(|(a, e)| (DevicePtr(a), e))
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dev(bytes: usize, label: &str) -> Entry {
        Entry {
            bytes,
            label: label.into(),
            kind: MemoryKind::Device,
            host: 0,
            release: Release::DeviceFree,
        }
    }

    #[test]
    fn reports_like_the_cpu_ledger() {
        let l = Ledger::default();
        l.insert(DevicePtr(0x1000), dev(1000, "a"));
        l.insert(DevicePtr(0x2000), dev(0, "z"));
        l.insert(
            DevicePtr(0x9000),
            Entry {
                bytes: 4096,
                label: "r".into(),
                kind: MemoryKind::HostRegistered,
                host: 0x9000,
                release: Release::Unregister,
            },
        );
        assert_eq!(l.live_bytes(), 1000);
        assert_eq!(l.live_count(), 3);
        assert_eq!(
            l.device_of_host(0x9010 as *const u8, 16),
            Some(DevicePtr(0x9010))
        );
        assert_eq!(l.device_of_host(0x9ff0 as *const u8, 17), None);
        assert!(l.check("op", DevicePtr(0x1000 + 999), 1).is_ok());
        let e = l.check("copy", DevicePtr(0x1000 + 996), 8).unwrap_err();
        assert!(
            e.to_string()
                .contains("run 4 bytes past the end of allocation 'a'"),
            "{e}"
        );
        let e = l.check_freeable(DevicePtr(0x1010)).unwrap_err();
        assert!(
            matches!(e, GpuError::InteriorFree { offset: 16, .. }),
            "{e:?}"
        );
        l.remove(DevicePtr(0x1000)).unwrap();
        let e = l.check("copy_h2d", DevicePtr(0x1004), 4).unwrap_err();
        assert!(e.to_string().contains("freed"), "{e}");
        let e = l.remove(DevicePtr(0x1000)).unwrap_err();
        assert!(matches!(e, GpuError::DoubleFree { .. }), "{e:?}");
        // The driver reuses the range: the stale record goes.
        l.insert(DevicePtr(0x1000), dev(64, "b"));
        assert!(l.check("op", DevicePtr(0x1004), 4).is_ok());
        let e = l.check("op", DevicePtr(0x42), 1).unwrap_err();
        assert!(matches!(e, GpuError::InvalidPointer { .. }), "{e:?}");
    }
}
