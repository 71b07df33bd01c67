//! The radix tree against a naive model: a map from keys to (value, bytes,
//! last-use tick) with the same LRU rule. Every lookup result, every
//! insertion outcome and the set of held keys must agree after each step,
//! and the tree's structural invariants must hold throughout.

use std::collections::HashMap;

use metrale_engine::prefix_cache::{InsertOutcome, PrefixCache, PrefixCacheError};
use proptest::prelude::*;

struct Model {
    block: usize,
    cap: usize,
    used: usize,
    tick: u64,
    map: HashMap<Vec<u32>, (u32, usize, u64)>,
}

impl Model {
    fn lookup(&mut self, tokens: &[u32]) -> Option<(usize, u32)> {
        let mut len = tokens.len() - tokens.len() % self.block;
        while len > 0 {
            if let Some(e) = self.map.get_mut(&tokens[..len]) {
                self.tick += 1;
                e.2 = self.tick;
                return Some((len, e.0));
            }
            len -= self.block;
        }
        None
    }

    fn insert(&mut self, tokens: &[u32], v: u32, bytes: usize) -> Result<InsertOutcome, ()> {
        if tokens.is_empty() || !tokens.len().is_multiple_of(self.block) || bytes > self.cap {
            return Err(());
        }
        self.tick += 1;
        if let Some(e) = self.map.get_mut(tokens) {
            e.2 = self.tick;
            return Ok(InsertOutcome::AlreadyPresent);
        }
        self.map.insert(tokens.to_vec(), (v, bytes, self.tick));
        self.used += bytes;
        let mut evicted = 0;
        while self.used > self.cap {
            let k = self
                .map
                .iter()
                .min_by_key(|(_, e)| e.2)
                .map(|(k, _)| k.clone())
                .unwrap();
            self.used -= self.map.remove(&k).unwrap().1;
            evicted += 1;
        }
        Ok(InsertOutcome::Inserted { evicted })
    }
}

#[derive(Clone, Debug)]
enum Op {
    Insert(Vec<u32>, usize),
    Lookup(Vec<u32>),
}

/// Keys over a tiny alphabet so that prefixes are shared often.
fn tokens(max: usize) -> impl Strategy<Value = Vec<u32>> {
    prop::collection::vec(0u32..3, 0..max)
}

fn op(block: usize) -> impl Strategy<Value = Op> {
    prop_oneof![
        (tokens(5 * block + 2), 0usize..12).prop_map(move |(mut t, b)| {
            // Mostly aligned keys, some deliberately not.
            if b % 5 != 0 {
                t.truncate(t.len() - t.len() % block);
            }
            Op::Insert(t, b)
        }),
        tokens(6 * block + 1).prop_map(Op::Lookup),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(192))]

    #[test]
    fn tree_matches_naive_model(
        block in 1usize..4,
        cap in 1usize..40,
        ops in prop::collection::vec((1usize..4).prop_flat_map(op), 1..120),
    ) {
        let mut tree = PrefixCache::new(block, cap);
        let mut model = Model { block, cap, used: 0, tick: 0, map: HashMap::new() };
        for (i, o) in ops.iter().enumerate() {
            match o {
                Op::Insert(t, bytes) => {
                    let v = i as u32;
                    let got = tree.insert(t, v, *bytes);
                    let want = model.insert(t, v, *bytes);
                    match (&got, &want) {
                        (Ok(a), Ok(b)) => prop_assert_eq!(a, b),
                        (Err(PrefixCacheError::NotBlockAligned { .. }), Err(()))
                        | (Err(PrefixCacheError::TooLarge { .. }), Err(())) => {}
                        _ => prop_assert!(false, "op {i}: tree {got:?}, model {want:?}"),
                    }
                }
                Op::Lookup(t) => {
                    prop_assert_eq!(tree.lookup(t), model.lookup(t), "op {}", i);
                }
            }
            if let Err(e) = tree.check_invariants() {
                prop_assert!(false, "op {i}: {e}");
            }
            prop_assert_eq!(tree.used_bytes(), model.used);
            let mut held: Vec<Vec<u32>> = tree.keys_lru().into_iter().map(|(k, _)| k).collect();
            let mut want: Vec<(u64, Vec<u32>)> =
                model.map.iter().map(|(k, e)| (e.2, k.clone())).collect();
            want.sort();
            // LRU order must agree too, not only the set.
            let want: Vec<Vec<u32>> = want.into_iter().map(|(_, k)| k).collect();
            prop_assert_eq!(&held, &want);
            held.sort();
            prop_assert_eq!(tree.stats().entries, held.len());
        }
    }
}
