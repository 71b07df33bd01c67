//! The CUDA backend's ledger: which device address ranges are live, with
//! their labels and kinds, and which were freed recently.
//!
//! The bookkeeping is the CPU backend's own ([`crate::ledger_core`]), so it
//! reports exactly what the CPU backend's ledger reports (`live_bytes`
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
//!   after taking it out with `remove`.

use std::fmt;
use std::ops::Deref;

use crate::error::Result;
use crate::gpu::{DevicePtr, MemoryKind};
use crate::ledger_core::{Book, Tracked};

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
/// (freeing, host lookups, accounting, teardown) plus insertion of
/// driver-chosen addresses.
#[derive(Default)]
pub(crate) struct Ledger {
    book: Book<Entry>,
}

impl Deref for Ledger {
    type Target = Book<Entry>;

    fn deref(&self) -> &Book<Entry> {
        &self.book
    }
}

impl Ledger {
    /// Record a new allocation at `ptr`, forgetting any freed range the
    /// driver has handed out again.
    pub fn insert(&self, ptr: DevicePtr, entry: Entry) {
        self.book.forget_freed(ptr.0, entry.bytes);
        self.book.record(ptr.0, entry);
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
        self.book.locate(op, ptr, bytes, |_, _| ()).map(drop)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::GpuError;

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

    #[test]
    fn a_reused_range_forgets_every_freed_range_it_overlaps() {
        let l = Ledger::default();
        l.insert(DevicePtr(0x1000), dev(16, "a"));
        l.insert(DevicePtr(0x2000), dev(16, "b"));
        l.insert(DevicePtr(0x3000), dev(16, "c"));
        for p in [0x1000, 0x2000, 0x3000] {
            l.remove(DevicePtr(p)).unwrap();
        }
        l.insert(DevicePtr(0x1008), dev(0x1000, "d"));
        let e = l.check_freeable(DevicePtr(0x1000)).unwrap_err();
        assert!(matches!(e, GpuError::NotAllocated { .. }), "{e:?}");
        let e = l.check_freeable(DevicePtr(0x2000)).unwrap_err();
        assert!(matches!(e, GpuError::InteriorFree { .. }), "{e:?}");
        let e = l.check_freeable(DevicePtr(0x3000)).unwrap_err();
        assert!(matches!(e, GpuError::DoubleFree { .. }), "{e:?}");
    }
}
