//! The CPU backend's ledger: which synthetic device addresses are live, what
//! host memory backs them, and which were freed.
//!
//! Invariants:
//! - device addresses come from a bump counter and are never reused, with an
//!   unmapped guard gap after every allocation, so a stale or overrunning
//!   pointer can never silently land in a newer allocation;
//! - every live address range maps to host memory that stays valid until the
//!   entry is dropped: owned buffers are aligned (64 bytes for device memory,
//!   4096 for host-mapped memory so O_DIRECT reads can land in them) and
//!   always initialised (zeroes, or 0xFF in debug mode);
//! - an owned buffer is released only by dropping its [`Entry`], which poisons
//!   it first in debug mode; registered (caller-owned) memory is never
//!   written or freed by the ledger;
//! - the most recent frees are remembered (bounded) so a use after free is
//!   reported as such, with the allocation's label.

use std::alloc::Layout;
use std::collections::{BTreeMap, VecDeque};
use std::fmt;

use parking_lot::{Mutex, RwLock};

use crate::error::{AllocationRef, GpuError, Result};
use crate::gpu::{AllocationInfo, DevicePtr, MemoryKind};

/// First device address handed out; far from null and from small integers so
/// that confusing an index with a pointer fails loudly.
const BASE_ADDR: u64 = 0x1000_0000_0000;
/// Unmapped bytes left after every allocation.
const GUARD_BYTES: u64 = 64 * 1024;
/// Device addresses are handed out at this granularity.
const ADDR_GRANULE: u64 = 4096;
/// How many freed ranges are remembered for use-after-free reports.
const FREED_MEMORY: usize = 1 << 16;

/// Byte written over new allocations in debug mode (all-ones is a NaN in
/// f32, bf16 and f16, so reading uninitialised memory shows).
pub const DEBUG_FILL: u8 = 0xFF;
/// Byte written over freed allocations in debug mode.
pub const DEBUG_POISON: u8 = 0xDE;

/// Alignment of device allocations.
pub const DEVICE_ALIGN: usize = 64;
/// Alignment of host-mapped allocations.
pub const HOST_MAPPED_ALIGN: usize = 4096;

/// Who owns the host bytes behind an entry.
enum Backing {
    /// The ledger allocated them with this layout.
    Owned(Layout),
    /// The caller owns them (`register_host`).
    Borrowed,
}

/// One live allocation.
pub(crate) struct Entry {
    /// Logical size in bytes.
    pub bytes: usize,
    /// The label given at allocation.
    pub label: String,
    /// Where it lives.
    pub kind: MemoryKind,
    /// Host address of the first byte.
    pub host: usize,
    backing: Backing,
    /// Whether to poison the bytes when releasing them.
    poison: bool,
}

impl Entry {
    /// In debug mode, overwrite owned bytes with the poison pattern.
    fn scrub(&mut self) {
        if let (Backing::Owned(layout), true) = (&self.backing, self.poison) {
            // SAFETY: `host` was allocated with `layout` and is still owned
            // by this entry; nothing else can reach it once the entry is out
            // of the ledger and the execution barrier has been passed.
            unsafe { std::ptr::write_bytes(self.host as *mut u8, DEBUG_POISON, layout.size()) };
        }
    }
}

impl Drop for Entry {
    fn drop(&mut self) {
        self.scrub();
        if let Backing::Owned(layout) = self.backing {
            // SAFETY: allocated by `std::alloc` with exactly this layout, and
            // released exactly once (here).
            unsafe { std::alloc::dealloc(self.host as *mut u8, layout) };
        }
    }
}

/// A freed range, kept for error messages.
struct Freed {
    bytes: usize,
    label: String,
}

/// An allocation as errors name it.
fn alloc_ref(base: u64, bytes: usize, label: &str) -> AllocationRef {
    AllocationRef {
        label: label.to_string(),
        base: DevicePtr(base),
        bytes,
    }
}

/// Freed ranges, oldest evicted first.
#[derive(Default)]
struct FreedLog {
    by_addr: BTreeMap<u64, Freed>,
    order: VecDeque<u64>,
}

/// The ledger of live and recently freed allocations.
pub(crate) struct Ledger {
    live: RwLock<BTreeMap<u64, Entry>>,
    /// Host ranges of live host-mapped and registered entries, keyed by
    /// (host start, device start), with their size.
    host_index: RwLock<BTreeMap<(usize, u64), usize>>,
    freed: Mutex<FreedLog>,
    next_addr: Mutex<u64>,
    debug: bool,
}

impl Ledger {
    /// An empty ledger; `debug` turns on fill and poison patterns.
    pub fn new(debug: bool) -> Self {
        Ledger {
            live: RwLock::new(BTreeMap::new()),
            host_index: RwLock::new(BTreeMap::new()),
            freed: Mutex::new(FreedLog::default()),
            next_addr: Mutex::new(BASE_ADDR),
            debug,
        }
    }

    /// Reserve a fresh device address range for `bytes`.
    fn reserve(&self, op: &str, bytes: usize, label: &str) -> Result<u64> {
        let oom = |reason: &str| GpuError::OutOfMemory {
            op: op.to_string(),
            label: label.to_string(),
            bytes,
            reason: reason.to_string(),
        };
        let mut next = self.next_addr.lock();
        let span = (bytes.max(1) as u64)
            .checked_next_multiple_of(ADDR_GRANULE)
            .and_then(|s| s.checked_add(GUARD_BYTES))
            .ok_or_else(|| oom("too large for the device address space"))?;
        let addr = *next;
        *next = addr
            .checked_add(span)
            .ok_or_else(|| oom("device address space exhausted"))?;
        Ok(addr)
    }

    /// Allocate `bytes` of owned, aligned host memory under a new device
    /// address.
    pub fn alloc(
        &self,
        op: &str,
        bytes: usize,
        align: usize,
        label: &str,
        kind: MemoryKind,
    ) -> Result<(DevicePtr, usize)> {
        // A zero-byte allocation still gets a distinct address and a real
        // (unused) buffer so that its address is valid for empty ranges.
        let layout =
            Layout::from_size_align(bytes.max(1), align).map_err(|e| GpuError::OutOfMemory {
                op: op.to_string(),
                label: label.to_string(),
                bytes,
                reason: e.to_string(),
            })?;
        // SAFETY: `layout` has a non-zero size.
        let p = unsafe {
            if self.debug {
                let p = std::alloc::alloc(layout);
                if !p.is_null() {
                    std::ptr::write_bytes(p, DEBUG_FILL, layout.size());
                }
                p
            } else {
                std::alloc::alloc_zeroed(layout)
            }
        };
        if p.is_null() {
            return Err(GpuError::OutOfMemory {
                op: op.to_string(),
                label: label.to_string(),
                bytes,
                reason: "out of host memory".into(),
            });
        }
        let entry = Entry {
            bytes,
            label: label.to_string(),
            kind,
            host: p as usize,
            backing: Backing::Owned(layout),
            poison: self.debug,
        };
        let addr = match self.reserve(op, bytes, label) {
            Ok(a) => a,
            Err(e) => {
                drop(entry);
                return Err(e);
            }
        };
        if kind != MemoryKind::Device {
            self.host_index.write().insert((p as usize, addr), bytes);
        }
        self.live.write().insert(addr, entry);
        Ok((DevicePtr(addr), p as usize))
    }

    /// Give caller-owned memory a device address.
    pub fn register(
        &self,
        op: &str,
        host: *mut u8,
        bytes: usize,
        label: &str,
    ) -> Result<DevicePtr> {
        if host.is_null() {
            return Err(GpuError::invalid(
                format!("{op} '{label}'"),
                "host pointer is null",
            ));
        }
        if (host as usize).checked_add(bytes).is_none() {
            return Err(GpuError::invalid(
                format!("{op} '{label}'"),
                format!("{bytes} bytes at host {host:p} wrap the address space"),
            ));
        }
        let addr = self.reserve(op, bytes, label)?;
        self.host_index.write().insert((host as usize, addr), bytes);
        self.live.write().insert(
            addr,
            Entry {
                bytes,
                label: label.to_string(),
                kind: MemoryKind::HostRegistered,
                host: host as usize,
                backing: Backing::Borrowed,
                poison: false,
            },
        );
        Ok(DevicePtr(addr))
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

    /// Take the allocation starting at `ptr` out of the ledger. The caller
    /// decides when to drop the returned entry (which releases its memory).
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

    /// Translate `[ptr, ptr + bytes)` to a host pointer, checking that the
    /// whole range lies inside one live allocation. An empty range may sit
    /// anywhere from an allocation's start to its end, or at null.
    #[inline]
    pub fn resolve<D: fmt::Display + ?Sized>(
        &self,
        op: &D,
        ptr: DevicePtr,
        bytes: usize,
    ) -> Result<*mut u8> {
        {
            let live = self.live.read();
            if let Some((&base, e)) = live.range(..=ptr.0).next_back() {
                let off = ptr.0 - base;
                let end = off.checked_add(bytes as u64);
                if end.is_some_and(|end| end <= e.bytes as u64) {
                    return Ok((e.host + off as usize) as *mut u8);
                }
            }
        }
        if bytes == 0 && ptr.is_null() {
            return Ok(std::ptr::NonNull::<u8>::dangling().as_ptr());
        }
        Err(self.explain(op, ptr, bytes))
    }

    /// The error for a range that failed [`Self::resolve`].
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
                        over: u64::try_from(over).unwrap_or(u64::MAX),
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

    /// Bytes in live owned allocations (registered memory is not counted).
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
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn addresses_are_distinct_aligned_and_never_reused() {
        let l = Ledger::new(false);
        let (a, ha) = l.alloc("alloc", 10, 64, "a", MemoryKind::Device).unwrap();
        assert_eq!(ha % 64, 0);
        drop(l.remove(a).unwrap());
        let (b, _) = l.alloc("alloc", 10, 64, "b", MemoryKind::Device).unwrap();
        assert!(b.0 > a.0 + 10 + GUARD_BYTES - 1, "{a} then {b}");
        let (_, hm) = l
            .alloc("alloc_host_mapped", 1, 4096, "m", MemoryKind::HostMapped)
            .unwrap();
        assert_eq!(hm % 4096, 0);
    }

    #[test]
    fn resolve_checks_bounds_and_names_the_allocation() {
        let l = Ledger::new(false);
        let (a, h) = l
            .alloc("alloc", 100, 64, "buf", MemoryKind::Device)
            .unwrap();
        assert_eq!(l.resolve("op", a.offset(10), 90).unwrap() as usize, h + 10);
        assert_eq!(l.resolve("op", a.offset(100), 0).unwrap() as usize, h + 100);
        let e = l.resolve("op", a.offset(10), 91).unwrap_err().to_string();
        assert!(
            e.contains("op: 91 bytes at")
                && e.contains("run 1 bytes past the end")
                && e.contains("'buf'"),
            "{e}"
        );
        let e = l.resolve("op", a.offset(100), 1).unwrap_err().to_string();
        assert!(e.contains("run 1 bytes past"), "{e}");
        let e = l.resolve("op", a.offset(200), 1).unwrap_err().to_string();
        assert!(e.contains("not inside any live allocation"), "{e}");
        let e = l.resolve("op", DevicePtr::NULL, 4).unwrap_err().to_string();
        assert!(e.contains("null pointer"), "{e}");
        assert!(l.resolve("op", DevicePtr::NULL, 0).is_ok());
        drop(l.remove(a).unwrap());
        let e = l.resolve("op", a.offset(3), 1).unwrap_err().to_string();
        assert!(e.contains("use after free") && e.contains("'buf'"), "{e}");
    }

    #[test]
    fn debug_mode_fills_new_memory() {
        let l = Ledger::new(true);
        let (_, h) = l.alloc("alloc", 8, 64, "x", MemoryKind::Device).unwrap();
        // SAFETY: the ledger owns 8 initialised bytes at `h`.
        let bytes = unsafe { std::slice::from_raw_parts(h as *const u8, 8) };
        assert_eq!(bytes, &[DEBUG_FILL; 8]);
        let l = Ledger::new(false);
        let (_, h) = l.alloc("alloc", 8, 64, "x", MemoryKind::Device).unwrap();
        // SAFETY: as above.
        let bytes = unsafe { std::slice::from_raw_parts(h as *const u8, 8) };
        assert_eq!(bytes, &[0; 8]);
    }

    #[test]
    fn debug_mode_poisons_memory_on_release() {
        let l = Ledger::new(true);
        let (a, h) = l.alloc("alloc", 16, 64, "x", MemoryKind::Device).unwrap();
        let mut e = l.remove(a).unwrap();
        e.scrub();
        // SAFETY: `e` still owns the 16 bytes at `h` until it is dropped.
        let bytes = unsafe { std::slice::from_raw_parts(h as *const u8, 16) };
        assert_eq!(bytes, &[DEBUG_POISON; 16]);
        drop(e);
        let mut caller = [7u8; 8];
        let r = l
            .register("register_host", caller.as_mut_ptr(), 8, "r")
            .unwrap();
        drop(l.remove(r).unwrap());
        assert_eq!(caller, [7; 8], "registered memory is never poisoned");
    }

    #[test]
    fn host_addresses_of_mapped_and_registered_memory_translate_back() {
        let l = Ledger::new(false);
        let (d, h) = l
            .alloc("alloc_host_mapped", 100, 4096, "m", MemoryKind::HostMapped)
            .unwrap();
        assert_eq!(
            l.device_of_host((h + 10) as *const u8, 90),
            Some(d.offset(10))
        );
        assert_eq!(l.device_of_host((h + 10) as *const u8, 91), None);
        let mut mine = [0u8; 32];
        let r = l
            .register("register_host", mine.as_mut_ptr(), 32, "r")
            .unwrap();
        assert_eq!(l.device_of_host(mine[4..].as_ptr(), 8), Some(r.offset(4)));
        let (_, hd) = l
            .alloc("alloc", 100, 64, "dev", MemoryKind::Device)
            .unwrap();
        assert_eq!(
            l.device_of_host(hd as *const u8, 1),
            None,
            "device memory is not host-visible"
        );
        drop(l.remove(d).unwrap());
        assert_eq!(l.device_of_host(h as *const u8, 1), None);
        drop(l.remove(r).unwrap());
        assert_eq!(l.device_of_host(mine.as_ptr(), 1), None);
    }

    #[test]
    fn free_errors_distinguish_interior_double_and_unknown() {
        let l = Ledger::new(false);
        let (a, _) = l
            .alloc("alloc", 100, 64, "buf", MemoryKind::Device)
            .unwrap();
        let e = l.check_freeable(a.offset(8)).unwrap_err().to_string();
        assert!(
            e.contains("8 bytes inside allocation 'buf'") && e.contains("not its start"),
            "{e}"
        );
        drop(l.remove(a).unwrap());
        let e = l.remove(a).err().unwrap().to_string();
        assert!(e.contains("double free") && e.contains("'buf'"), "{e}");
        let e = l.check_freeable(DevicePtr(0x42)).unwrap_err().to_string();
        assert!(e.contains("0x42 is not a live allocation"), "{e}");
    }
}
