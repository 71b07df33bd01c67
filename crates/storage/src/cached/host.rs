//! The host-memory tier: a victim cache of rows evicted from the slot
//! arena, kept in plain (pageable) host memory so a later miss copies them
//! back instead of reading the disk.
//!
//! Every row the arena evicts enters it (the policy has already kept the
//! rows it thinks hot in the arena; the storage bench's `policy` run
//! measured that stashing every evictee saves more disk reads than
//! stashing only rows hit in the arena or only S3-FIFO main-queue
//! evictees). It evicts by CLOCK on its own reference bits, so a row hit
//! here outlives the one-off rows stashed after it.
//!
//! Invariants: it has its own mutex, taken either alone (a load copying
//! rows out) or inside the cache's state mutex (an eviction copying a row
//! in), never the other way round; a row is copied in and out whole, under
//! that mutex, so a reader never sees half of one.

use parking_lot::Mutex;

use super::IdMap;

/// One entry's bytes: the row's values, then its FP8 scale when it has one.
pub(super) struct HostTier {
    rows: usize,
    entry: usize,
    st: Mutex<HostState>,
}

struct HostState {
    map: IdMap<u32>,
    ids: Vec<u64>,
    referenced: Vec<bool>,
    hand: usize,
    data: Vec<u8>,
}

impl HostTier {
    /// A tier of `rows` entries of `entry` bytes each; memory is taken as
    /// entries are filled.
    pub(super) fn new(rows: usize, entry: usize) -> HostTier {
        HostTier {
            rows,
            entry,
            st: Mutex::new(HostState {
                map: IdMap::with_capacity_and_hasher(rows.min(1 << 20), Default::default()),
                ids: Vec::new(),
                referenced: Vec::new(),
                hand: 0,
                data: Vec::new(),
            }),
        }
    }

    /// Copy row `id` into `row` and `scale` (together `entry` bytes) if the
    /// tier holds it.
    pub(super) fn get(&self, id: u64, row: &mut [u8], scale: &mut [u8]) -> bool {
        let mut g = self.st.lock();
        let Some(&e) = g.map.get(&id) else {
            return false;
        };
        let e = e as usize;
        g.referenced[e] = true;
        let src = &g.data[e * self.entry..(e + 1) * self.entry];
        row.copy_from_slice(&src[..row.len()]);
        scale.copy_from_slice(&src[row.len()..]);
        true
    }

    /// Keep row `id`: its values `row` and its scale bytes `scale`
    /// (together `entry` bytes).
    pub(super) fn put(&self, id: u64, row: &[u8], scale: &[u8]) {
        debug_assert_eq!(row.len() + scale.len(), self.entry);
        let mut g = self.st.lock();
        let st = &mut *g;
        let e = if let Some(&e) = st.map.get(&id) {
            e as usize
        } else if st.ids.len() < self.rows {
            st.ids.push(id);
            st.referenced.push(false);
            st.data.extend_from_slice(row);
            st.data.extend_from_slice(scale);
            st.map.insert(id, (st.ids.len() - 1) as u32);
            return;
        } else {
            // CLOCK: at most two sweeps find an entry with its bit clear.
            let n = st.ids.len();
            let mut e = st.hand;
            while st.referenced[e] {
                st.referenced[e] = false;
                e = if e + 1 == n { 0 } else { e + 1 };
            }
            st.hand = if e + 1 == n { 0 } else { e + 1 };
            st.map.remove(&st.ids[e]);
            st.ids[e] = id;
            st.map.insert(id, e as u32);
            e
        };
        st.referenced[e] = false;
        let dst = &mut st.data[e * self.entry..(e + 1) * self.entry];
        dst[..row.len()].copy_from_slice(row);
        dst[row.len()..].copy_from_slice(scale);
    }

    /// Rows held now.
    pub(super) fn len(&self) -> usize {
        self.st.lock().ids.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keeps_rows_and_evicts_unreferenced_first() {
        let t = HostTier::new(3, 5);
        for id in 0..3u64 {
            t.put(id, &[id as u8; 4], &[100 + id as u8]);
        }
        let (mut row, mut sc) = ([0u8; 4], [0u8; 1]);
        assert!(t.get(1, &mut row, &mut sc) && row == [1; 4] && sc == [101]);
        t.put(7, &[7; 4], &[107]);
        assert_eq!(t.len(), 3);
        assert!(
            t.get(1, &mut row, &mut sc),
            "the referenced row was evicted"
        );
        assert!(t.get(7, &mut row, &mut sc) && row == [7; 4] && sc == [107]);
        assert!(!t.get(0, &mut row, &mut sc), "row 0 was the CLOCK victim");
        // Re-putting a held row overwrites it in place.
        t.put(7, &[9; 4], &[1]);
        assert!(t.get(7, &mut row, &mut sc) && row == [9; 4] && sc == [1]);
        assert_eq!(t.len(), 3);
    }
}
