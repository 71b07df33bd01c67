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
use std::fmt;
use std::ops::Deref;

use parking_lot::Mutex;

use crate::error::{GpuError, Result};
use crate::gpu::{DevicePtr, MemoryKind};
use crate::ledger_core::{Book, Tracked};

/// First device address handed out; far from null and from small integers so
/// that confusing an index with a pointer fails loudly.
const BASE_ADDR: u64 = 0x1000_0000_0000;
/// Unmapped bytes left after every allocation.
const GUARD_BYTES: u64 = 64 * 1024;
/// Device addresses are handed out at this granularity.
const ADDR_GRANULE: u64 = 4096;

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

impl Tracked for Entry {
    fn bytes(&self) -> usize {
        self.bytes
    }
    fn label(&self) -> &str {
        &self.label
    }
    fn kind(&self) -> MemoryKind {
        self.kind
    }
    fn host(&self) -> usize {
        self.host
    }
}

/// The ledger of live and recently freed allocations: the shared [`Book`]
/// (freeing, host lookups, accounting) plus the address counter and the
/// host memory behind each address.
pub(crate) struct Ledger {
    book: Book<Entry>,
    next_addr: Mutex<u64>,
    debug: bool,
}

impl Deref for Ledger {
    type Target = Book<Entry>;

    fn deref(&self) -> &Book<Entry> {
        &self.book
    }
}

impl Ledger {
    /// An empty ledger; `debug` turns on fill and poison patterns.
    pub fn new(debug: bool) -> Self {
        Ledger {
            book: Book::default(),
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
        self.book.record(addr, entry);
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
        self.book.record(
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
        let host = self
            .book
            .locate(op, ptr, bytes, |e, off| (e.host + off as usize) as *mut u8)?;
        Ok(host.unwrap_or_else(|| std::ptr::NonNull::<u8>::dangling().as_ptr()))
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
