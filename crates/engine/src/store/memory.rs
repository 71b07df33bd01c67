//! An in-process carry store: values by key in a map bounded by bytes,
//! oldest first out. It is the store behind `mem:` addresses, for a
//! single process and for tests; the engine's own first tier stays the
//! token-keyed [`crate::prefix_cache::PrefixCache`].
//!
//! Invariant: the bytes held never exceed the capacity after a call
//! returns; a value larger than the capacity is refused.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex};

use super::{CarryStore, StoreError, StoreKey};

#[derive(Default)]
struct Inner {
    map: HashMap<StoreKey, Arc<[u8]>>,
    order: VecDeque<StoreKey>,
    used: usize,
}

/// A byte-bounded in-memory store.
pub struct MemoryStore {
    capacity: usize,
    inner: Mutex<Inner>,
}

impl MemoryStore {
    /// A store holding at most `capacity_bytes` of values.
    pub fn new(capacity_bytes: usize) -> MemoryStore {
        MemoryStore {
            capacity: capacity_bytes,
            inner: Mutex::new(Inner::default()),
        }
    }

    /// Values held.
    pub fn len(&self) -> usize {
        self.lock().map.len()
    }

    /// Whether no value is held.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Replace the value under `key` without any check (tests use it to
    /// plant corrupt values).
    pub fn plant(&self, key: &StoreKey, value: &[u8]) {
        let mut g = self.lock();
        if let Some(old) = g.map.insert(*key, value.into()) {
            g.used -= old.len();
        } else {
            g.order.push_back(*key);
        }
        g.used += value.len();
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }
}

impl CarryStore for MemoryStore {
    fn describe(&self) -> String {
        format!("mem:{}", self.capacity)
    }

    fn put(&self, key: &StoreKey, value: &[u8]) -> Result<(), StoreError> {
        if value.len() > self.capacity {
            return Err(StoreError::TooLarge {
                bytes: value.len() as u64,
                limit: self.capacity as u64,
            });
        }
        let mut g = self.lock();
        if let Some(old) = g.map.remove(key) {
            g.used -= old.len();
            g.order.retain(|k| k != key);
        }
        while g.used + value.len() > self.capacity {
            let Some(k) = g.order.pop_front() else { break };
            if let Some(old) = g.map.remove(&k) {
                g.used -= old.len();
            }
        }
        g.map.insert(*key, value.into());
        g.order.push_back(*key);
        g.used += value.len();
        Ok(())
    }

    fn get(&self, key: &StoreKey) -> Result<Option<Vec<u8>>, StoreError> {
        Ok(self.lock().map.get(key).map(|v| v.to_vec()))
    }

    fn delete(&self, key: &StoreKey) -> Result<(), StoreError> {
        let mut g = self.lock();
        if let Some(old) = g.map.remove(key) {
            g.used -= old.len();
            g.order.retain(|k| k != key);
        }
        Ok(())
    }
}
