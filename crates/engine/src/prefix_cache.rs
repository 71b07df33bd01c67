//! The prefix cache: a radix tree over token ids holding values (encoded
//! snapshots, in the engine) at block boundaries, bounded by bytes with LRU
//! eviction.
//!
//! A key is a token prefix whose length is a positive multiple of the block
//! size. [`PrefixCache::lookup`] finds the longest cached key that is a
//! prefix of the tokens it is given.
//!
//! The tree is path-compressed: an edge carries a run of whole blocks, and
//! children are keyed by the first block of their edge, so a lookup costs one
//! hash per edge plus one comparison per token.
//!
//! Invariants (checked by [`PrefixCache::check_invariants`]):
//! - every non-root edge is a non-empty whole number of blocks; the children
//!   of a node have distinct first blocks, and each is keyed by it;
//! - every non-root node holds a value or has at least two children (empty
//!   leaves are pruned and single-child chains merged after eviction);
//! - `used_bytes` is the sum of the byte costs of the values held, and never
//!   exceeds the capacity after an operation returns;
//! - the LRU index holds exactly the nodes with values, each under its last
//!   use tick; ticks are unique and increase with every use.
//!
//! The cache is keyed by tokens only: a value must be a function of the
//! token prefix alone, which holds for the PLE carry when the highway rows
//! fed to the layer are themselves a function of the prefix (a causal model).

use std::collections::{BTreeMap, HashMap};

use thiserror::Error;

const ROOT: usize = 0;
const NO_PARENT: usize = usize::MAX;

/// Why an insertion was refused.
#[derive(Debug, Error, Clone, PartialEq, Eq)]
pub enum PrefixCacheError {
    /// The key is not a positive multiple of the block size.
    #[error(
        "prefix cache key of {len} tokens is not a positive multiple of the block size {block}"
    )]
    NotBlockAligned {
        /// The key's length.
        len: usize,
        /// The block size.
        block: usize,
    },
    /// The value alone is larger than the whole cache.
    #[error("prefix cache value of {bytes} bytes exceeds the capacity of {capacity} bytes")]
    TooLarge {
        /// The value's byte cost.
        bytes: usize,
        /// The cache capacity.
        capacity: usize,
    },
}

/// What an insertion did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum InsertOutcome {
    /// The value was stored; `evicted` older values were dropped for room.
    Inserted {
        /// Values evicted to make room.
        evicted: usize,
    },
    /// The key already held a value; it was kept and marked used.
    AlreadyPresent,
}

/// Counters and sizes of a prefix cache.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PrefixCacheStats {
    /// Values held.
    pub entries: usize,
    /// Tree nodes, root included.
    pub nodes: usize,
    /// Bytes of the values held.
    pub used_bytes: usize,
    /// The byte bound.
    pub capacity_bytes: usize,
    /// Lookups that found a value.
    pub hits: u64,
    /// Lookups that found none.
    pub misses: u64,
    /// Tokens covered by the values lookups returned.
    pub hit_tokens: u64,
    /// Values stored.
    pub inserts: u64,
    /// Values dropped for room.
    pub evictions: u64,
}

struct Entry<V> {
    value: V,
    bytes: usize,
    tick: u64,
}

struct Node<V> {
    parent: usize,
    edge: Vec<u32>,
    children: HashMap<Box<[u32]>, usize>,
    entry: Option<Entry<V>>,
}

/// A byte-bounded radix tree of values at block-aligned token prefixes.
pub struct PrefixCache<V> {
    block: usize,
    capacity: usize,
    used: usize,
    nodes: Vec<Option<Node<V>>>,
    free: Vec<usize>,
    lru: BTreeMap<u64, usize>,
    tick: u64,
    stats: PrefixCacheStats,
}

impl<V: Clone> PrefixCache<V> {
    /// An empty cache of blocks of `block_size` tokens holding at most
    /// `capacity_bytes` of values. A block size of 0 is taken as 1.
    pub fn new(block_size: usize, capacity_bytes: usize) -> Self {
        let root = Node {
            parent: NO_PARENT,
            edge: Vec::new(),
            children: HashMap::new(),
            entry: None,
        };
        PrefixCache {
            block: block_size.max(1),
            capacity: capacity_bytes,
            used: 0,
            nodes: vec![Some(root)],
            free: Vec::new(),
            lru: BTreeMap::new(),
            tick: 0,
            stats: PrefixCacheStats::default(),
        }
    }

    /// The block size in tokens.
    pub fn block_size(&self) -> usize {
        self.block
    }

    fn node(&self, id: usize) -> &Node<V> {
        self.nodes[id]
            .as_ref()
            .expect("prefix cache: dangling node id")
    }

    fn node_mut(&mut self, id: usize) -> &mut Node<V> {
        self.nodes[id]
            .as_mut()
            .expect("prefix cache: dangling node id")
    }

    fn alloc(&mut self, n: Node<V>) -> usize {
        if let Some(id) = self.free.pop() {
            self.nodes[id] = Some(n);
            id
        } else {
            self.nodes.push(Some(n));
            self.nodes.len() - 1
        }
    }

    fn next_tick(&mut self) -> u64 {
        self.tick += 1;
        self.tick
    }

    fn touch(&mut self, id: usize) {
        let t = self.next_tick();
        let e = self
            .node_mut(id)
            .entry
            .as_mut()
            .expect("touch of a node without value");
        let old = std::mem::replace(&mut e.tick, t);
        self.lru.remove(&old);
        self.lru.insert(t, id);
    }

    /// The node and token count of the longest valued key that prefixes
    /// `tokens`, without marking it used.
    fn find(&self, tokens: &[u32]) -> Option<(usize, usize)> {
        let b = self.block;
        let mut node = ROOT;
        let mut pos = 0;
        let mut best = None;
        loop {
            let n = self.node(node);
            if n.entry.is_some() {
                best = Some((node, pos));
            }
            if tokens.len() - pos < b {
                return best;
            }
            let Some(&child) = n.children.get(&tokens[pos..pos + b]) else {
                return best;
            };
            let edge = &self.node(child).edge;
            if tokens.len() - pos < edge.len() || tokens[pos..pos + edge.len()] != edge[..] {
                return best;
            }
            pos += edge.len();
            node = child;
        }
    }

    /// The longest cached key that is a prefix of `tokens`: its length in
    /// tokens and its value (marked used). `None` when no key matches.
    pub fn lookup(&mut self, tokens: &[u32]) -> Option<(usize, V)> {
        match self.find(tokens) {
            Some((id, len)) => {
                self.touch(id);
                self.stats.hits += 1;
                self.stats.hit_tokens += len as u64;
                let v = self.node(id).entry.as_ref().map(|e| e.value.clone());
                v.map(|v| (len, v))
            }
            None => {
                self.stats.misses += 1;
                None
            }
        }
    }

    /// Whether `tokens` is exactly a cached key (does not mark it used).
    pub fn contains(&self, tokens: &[u32]) -> bool {
        matches!(self.find(tokens), Some((_, len)) if len == tokens.len() && len > 0)
    }

    /// Store `value`, costing `bytes`, under the key `tokens` (a positive
    /// multiple of the block size), evicting least recently used values until
    /// the cache fits its capacity. On an error nothing changes.
    pub fn insert(
        &mut self,
        tokens: &[u32],
        value: V,
        bytes: usize,
    ) -> Result<InsertOutcome, PrefixCacheError> {
        let b = self.block;
        if tokens.is_empty() || !tokens.len().is_multiple_of(b) {
            return Err(PrefixCacheError::NotBlockAligned {
                len: tokens.len(),
                block: b,
            });
        }
        if bytes > self.capacity {
            return Err(PrefixCacheError::TooLarge {
                bytes,
                capacity: self.capacity,
            });
        }
        let mut node = ROOT;
        let mut pos = 0;
        while pos < tokens.len() {
            let key = &tokens[pos..pos + b];
            let Some(&child) = self.node(node).children.get(key) else {
                let leaf = self.alloc(Node {
                    parent: node,
                    edge: tokens[pos..].to_vec(),
                    children: HashMap::new(),
                    entry: None,
                });
                self.node_mut(node).children.insert(key.into(), leaf);
                node = leaf;
                break;
            };
            let edge = &self.node(child).edge;
            let rest = &tokens[pos..];
            let mut common = edge.iter().zip(rest).take_while(|(a, b)| a == b).count();
            common -= common % b;
            if common == edge.len() {
                pos += common;
                node = child;
                continue;
            }
            // Split the edge at the last shared block boundary.
            let tail = self.node(child).edge[common..].to_vec();
            let head = self.node(child).edge[..common].to_vec();
            let mid = self.alloc(Node {
                parent: node,
                edge: head,
                children: HashMap::new(),
                entry: None,
            });
            {
                let c = self.node_mut(child);
                c.edge = tail;
                c.parent = mid;
            }
            let tail_key: Box<[u32]> = self.node(child).edge[..b].into();
            self.node_mut(mid).children.insert(tail_key, child);
            let k: Box<[u32]> = key.into();
            self.node_mut(node).children.insert(k, mid);
            pos += common;
            node = mid;
        }
        if self.node(node).entry.is_some() {
            self.touch(node);
            return Ok(InsertOutcome::AlreadyPresent);
        }
        let tick = self.next_tick();
        self.node_mut(node).entry = Some(Entry { value, bytes, tick });
        self.lru.insert(tick, node);
        self.used += bytes;
        self.stats.inserts += 1;
        let mut evicted = 0;
        while self.used > self.capacity {
            let (&t, &victim) = self
                .lru
                .iter()
                .next()
                .expect("over capacity with nothing held");
            debug_assert_ne!(
                victim, node,
                "a value that fits alone is never its own victim"
            );
            self.lru.remove(&t);
            self.drop_entry(victim);
            evicted += 1;
        }
        self.stats.evictions += evicted as u64;
        Ok(InsertOutcome::Inserted { evicted })
    }

    /// Remove the value of `id` (already out of the LRU index) and tidy the
    /// tree around it.
    fn drop_entry(&mut self, id: usize) {
        if let Some(e) = self.node_mut(id).entry.take() {
            self.used -= e.bytes;
        }
        self.tidy(id);
    }

    /// Restore the "value or at least two children" invariant at `id` and
    /// above: prune empty leaves, merge single-child nodes into their child.
    fn tidy(&mut self, mut id: usize) {
        while id != ROOT {
            let n = self.node(id);
            if n.entry.is_some() || n.children.len() >= 2 {
                return;
            }
            let parent = n.parent;
            let key: Box<[u32]> = n.edge[..self.block].into();
            if n.children.is_empty() {
                self.node_mut(parent).children.remove(&key);
                self.nodes[id] = None;
                self.free.push(id);
                id = parent;
                continue;
            }
            // One child: fold this node's edge into it and take its place.
            let (_, &child) = n.children.iter().next().expect("one child");
            let mut edge = std::mem::take(&mut self.node_mut(id).edge);
            {
                let c = self.node_mut(child);
                edge.extend_from_slice(&c.edge);
                c.edge = edge;
                c.parent = parent;
            }
            self.node_mut(parent).children.insert(key, child);
            self.nodes[id] = None;
            self.free.push(id);
            return;
        }
    }

    /// Drop every value.
    pub fn clear(&mut self) {
        let ids: Vec<usize> = self.lru.values().copied().collect();
        self.lru.clear();
        for id in ids {
            self.drop_entry(id);
        }
    }

    /// Bytes of the values held.
    pub fn used_bytes(&self) -> usize {
        self.used
    }

    /// Counters and sizes.
    pub fn stats(&self) -> PrefixCacheStats {
        PrefixCacheStats {
            entries: self.lru.len(),
            nodes: self.nodes.len() - self.free.len(),
            used_bytes: self.used,
            capacity_bytes: self.capacity,
            ..self.stats
        }
    }

    /// Every key held with its value's byte cost, in LRU order (least
    /// recently used first).
    pub fn keys_lru(&self) -> Vec<(Vec<u32>, usize)> {
        self.lru
            .values()
            .map(|&id| {
                let mut key = Vec::new();
                let mut n = id;
                let mut parts = Vec::new();
                while n != ROOT {
                    parts.push(n);
                    n = self.node(n).parent;
                }
                for p in parts.into_iter().rev() {
                    key.extend_from_slice(&self.node(p).edge);
                }
                (key, self.node(id).entry.as_ref().map_or(0, |e| e.bytes))
            })
            .collect()
    }

    /// Check every structural invariant in the module docs, describing the
    /// first one broken. Meant for tests.
    pub fn check_invariants(&self) -> Result<(), String> {
        let b = self.block;
        let mut used = 0;
        let mut valued = 0;
        let mut live = 0;
        for (id, n) in self.nodes.iter().enumerate() {
            let Some(n) = n else { continue };
            live += 1;
            if id != ROOT {
                if n.edge.is_empty() || n.edge.len() % b != 0 {
                    return Err(format!("node {id}: edge of {} tokens", n.edge.len()));
                }
                if n.entry.is_none() && n.children.len() < 2 {
                    return Err(format!(
                        "node {id}: no value and {} children",
                        n.children.len()
                    ));
                }
                let p = self.nodes.get(n.parent).and_then(Option::as_ref);
                let Some(p) = p else {
                    return Err(format!("node {id}: parent {} is not live", n.parent));
                };
                if p.children.get(&n.edge[..b]) != Some(&id) {
                    return Err(format!(
                        "node {id}: parent does not key it by its first block"
                    ));
                }
            }
            for (k, &c) in &n.children {
                let Some(cn) = self.nodes.get(c).and_then(Option::as_ref) else {
                    return Err(format!("node {id}: child {c} is not live"));
                };
                if cn.parent != id || cn.edge.len() < b || cn.edge[..b] != k[..] {
                    return Err(format!("node {id}: child {c} is keyed wrongly"));
                }
            }
            if let Some(e) = &n.entry {
                used += e.bytes;
                valued += 1;
                if self.lru.get(&e.tick) != Some(&id) {
                    return Err(format!("node {id}: LRU index misses tick {}", e.tick));
                }
            }
        }
        if live != self.nodes.len() - self.free.len() {
            return Err("free list and live nodes disagree".into());
        }
        if valued != self.lru.len() {
            return Err(format!(
                "{valued} values but {} LRU entries",
                self.lru.len()
            ));
        }
        if used != self.used {
            return Err(format!(
                "values sum to {used} bytes, counter says {}",
                self.used
            ));
        }
        if self.used > self.capacity {
            return Err(format!(
                "{} bytes held over a capacity of {}",
                self.used, self.capacity
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn longest_boundary_wins() {
        let mut c = PrefixCache::new(2, 100);
        c.insert(&[1, 2], "a", 1).unwrap();
        c.insert(&[1, 2, 3, 4, 5, 6], "c", 1).unwrap();
        assert_eq!(c.lookup(&[1, 2, 3, 4, 5, 6, 7]), Some((6, "c")));
        assert_eq!(c.lookup(&[1, 2, 3, 4, 5]), Some((2, "a")));
        assert_eq!(c.lookup(&[1, 3]), None);
        c.insert(&[1, 2, 3, 4], "b", 1).unwrap();
        assert_eq!(c.lookup(&[1, 2, 3, 4, 5]), Some((4, "b")));
        c.check_invariants().unwrap();
    }

    #[test]
    fn split_inside_an_edge_and_merge_back() {
        let mut c = PrefixCache::new(2, 2);
        c.insert(&[1, 2, 3, 4, 5, 6], 1, 1).unwrap();
        c.insert(&[1, 2, 3, 4, 9, 9], 2, 1).unwrap();
        c.check_invariants().unwrap();
        assert_eq!(c.stats().nodes, 4);
        // Evicts the first value; the split node has one child left and merges.
        c.insert(&[7, 7], 3, 1).unwrap();
        c.check_invariants().unwrap();
        assert_eq!(c.stats().nodes, 3);
        assert_eq!(c.lookup(&[1, 2, 3, 4, 9, 9]), Some((6, 2)));
        assert_eq!(c.lookup(&[1, 2, 3, 4, 5, 6]), None);
    }

    #[test]
    fn refusals_change_nothing() {
        let mut c = PrefixCache::new(4, 10);
        assert_eq!(
            c.insert(&[1, 2, 3], 0, 1),
            Err(PrefixCacheError::NotBlockAligned { len: 3, block: 4 })
        );
        assert_eq!(
            c.insert(&[], 0, 1),
            Err(PrefixCacheError::NotBlockAligned { len: 0, block: 4 })
        );
        assert_eq!(
            c.insert(&[1, 2, 3, 4], 0, 11),
            Err(PrefixCacheError::TooLarge {
                bytes: 11,
                capacity: 10
            })
        );
        assert_eq!(c.stats().nodes, 1);
        assert_eq!(c.used_bytes(), 0);
    }

    #[test]
    fn lru_order_follows_use() {
        let mut c = PrefixCache::new(1, 3);
        c.insert(&[1], 1, 1).unwrap();
        c.insert(&[2], 2, 1).unwrap();
        c.insert(&[3], 3, 1).unwrap();
        assert!(c.lookup(&[1]).is_some());
        c.insert(&[4], 4, 1).unwrap();
        assert!(!c.contains(&[2]));
        assert!(c.contains(&[1]) && c.contains(&[3]) && c.contains(&[4]));
        c.clear();
        assert_eq!(c.stats().nodes, 1);
        c.check_invariants().unwrap();
    }
}
