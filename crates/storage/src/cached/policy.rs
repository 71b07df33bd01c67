//! Eviction and admission for the slot arena: CLOCK, or S3-FIFO (a small
//! probationary FIFO, a main FIFO with reinsertion, and a ghost list of
//! ids recently dropped from probation).
//!
//! S3-FIFO is the admission policy: a row enters the small queue (a tenth
//! of the slots) and moves to the main queue only if it is hit again before
//! it reaches the small queue's head, so a stream of one-off n-grams cycles
//! through the small queue without flushing the hot rows of the main one. A
//! row missed again while its id is still in the ghost list goes straight
//! to the main queue. Rows move between queues by slot index only; no row
//! bytes are copied.
//!
//! Invariants (under the cache's state mutex, like everything here):
//! - a slot with pins, or one being loaded or queued for a prefetch, is
//!   never returned as a victim;
//! - with S3-FIFO every slot is in exactly one of the two queues, except a
//!   victim between [`Evictor::victim`] and the [`Evictor::admit`] that
//!   follows it in the same critical section.

use std::collections::VecDeque;

use super::{FREE, IdMap, READY, Slot};

/// Which eviction policy a [`super::CachedTable`] uses.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Policy {
    /// CLOCK (second chance) over every slot: cheap, but a burst of one-off
    /// ids evicts hot rows whose reference bit the hand has just cleared.
    Clock,
    /// S3-FIFO: one-off ids are filtered through a small FIFO and a ghost
    /// list before they can displace rows of the main FIFO.
    S3Fifo,
}

impl Policy {
    /// The policy's name: `clock` or `s3fifo`.
    pub fn name(self) -> &'static str {
        match self {
            Policy::Clock => "clock",
            Policy::S3Fifo => "s3fifo",
        }
    }
}

impl std::str::FromStr for Policy {
    type Err = crate::StorageError;

    /// Parse a policy name (ASCII case-insensitive).
    fn from_str(s: &str) -> Result<Self, crate::StorageError> {
        [Policy::Clock, Policy::S3Fifo]
            .into_iter()
            .find(|p| p.name().eq_ignore_ascii_case(s))
            .ok_or_else(|| {
                crate::StorageError::invalid(format!(
                    "unknown cache policy '{s}' (expected one of: clock, s3fifo)"
                ))
            })
    }
}

/// Frequency counters saturate here (S3-FIFO's two bits).
const MAX_FREQ: u8 = 3;

pub(super) enum Evictor {
    Clock {
        hand: usize,
    },
    S3 {
        small: VecDeque<u32>,
        main: VecDeque<u32>,
        small_target: usize,
        /// Ids dropped from the small queue, oldest first, with the
        /// sequence number under which `ghost_set` knows them.
        ghost: VecDeque<(u64, u64)>,
        ghost_set: IdMap<u64>,
        ghost_cap: usize,
        ghost_seq: u64,
    },
}

fn busy(sl: &Slot) -> bool {
    sl.pins > 0 || (sl.state != READY && sl.state != FREE)
}

impl Evictor {
    pub(super) fn new(policy: Policy, slots: usize) -> Evictor {
        match policy {
            Policy::Clock => Evictor::Clock { hand: 0 },
            Policy::S3Fifo => Evictor::S3 {
                // Every slot starts free in the small queue.
                small: (0..slots as u32).collect(),
                main: VecDeque::with_capacity(slots),
                small_target: (slots / 10).max(1),
                ghost: VecDeque::with_capacity(slots),
                ghost_set: IdMap::with_capacity_and_hasher(slots, Default::default()),
                ghost_cap: slots,
                ghost_seq: 0,
            },
        }
    }

    /// A hit on slot `s`.
    #[inline]
    pub(super) fn touch(sl: &mut Slot) {
        sl.freq = (sl.freq + 1).min(MAX_FREQ);
    }

    /// A victim among `slots`, or `None` when every slot is busy.
    pub(super) fn victim(&mut self, slots: &mut [Slot]) -> Option<u32> {
        match self {
            Evictor::Clock { hand } => {
                let n = slots.len();
                for _ in 0..2 * n + 1 {
                    let s = *hand;
                    *hand = if s + 1 == n { 0 } else { s + 1 };
                    let sl = &mut slots[s];
                    if busy(sl) {
                        continue;
                    }
                    if sl.freq > 0 {
                        sl.freq = 0;
                        continue;
                    }
                    return Some(s as u32);
                }
                None
            }
            Evictor::S3 {
                small,
                main,
                small_target,
                ghost,
                ghost_set,
                ghost_cap,
                ghost_seq,
            } => {
                let prefer_small = small.len() > *small_target || main.is_empty();
                for from_small in [prefer_small, !prefer_small] {
                    let got = if from_small {
                        evict_small(small, main, slots, |id| {
                            *ghost_seq += 1;
                            ghost.push_back((id, *ghost_seq));
                            ghost_set.insert(id, *ghost_seq);
                            while ghost.len() > *ghost_cap {
                                let (old, seq) = ghost.pop_front().expect("non-empty");
                                if ghost_set.get(&old) == Some(&seq) {
                                    ghost_set.remove(&old);
                                }
                            }
                        })
                    } else {
                        evict_main(main, slots)
                    };
                    if got.is_some() {
                        return got;
                    }
                }
                None
            }
        }
    }

    /// Slot `s` now holds `id` (just claimed from [`Self::victim`]).
    pub(super) fn admit(&mut self, slots: &mut [Slot], s: u32, id: u64) {
        let sl = &mut slots[s as usize];
        sl.freq = 0;
        if let Evictor::S3 {
            small,
            main,
            ghost_set,
            ..
        } = self
        {
            if ghost_set.remove(&id).is_some() {
                main.push_back(s);
            } else {
                small.push_back(s);
            }
        }
    }

    /// Ids in the ghost list (tests and statistics).
    #[cfg(test)]
    pub(super) fn ghosts(&self) -> usize {
        match self {
            Evictor::Clock { .. } => 0,
            Evictor::S3 { ghost_set, .. } => ghost_set.len(),
        }
    }
}

/// Pop the small queue until a victim: rows hit while on probation move to
/// the main queue, the first untouched one is dropped into the ghost list.
fn evict_small(
    small: &mut VecDeque<u32>,
    main: &mut VecDeque<u32>,
    slots: &mut [Slot],
    mut to_ghost: impl FnMut(u64),
) -> Option<u32> {
    for _ in 0..small.len() {
        let s = small.pop_front()?;
        let sl = &mut slots[s as usize];
        if sl.state == FREE && sl.pins == 0 {
            return Some(s);
        }
        if busy(sl) {
            small.push_back(s);
            continue;
        }
        if sl.freq > 0 {
            sl.freq = 0;
            main.push_back(s);
            continue;
        }
        to_ghost(sl.id);
        return Some(s);
    }
    None
}

/// Pop the main queue until a row with no hits left: FIFO with
/// reinsertion, each hit buys one more pass.
fn evict_main(main: &mut VecDeque<u32>, slots: &mut [Slot]) -> Option<u32> {
    for _ in 0..(MAX_FREQ as usize + 1) * main.len() + 1 {
        let s = main.pop_front()?;
        let sl = &mut slots[s as usize];
        if sl.state == FREE && sl.pins == 0 {
            return Some(s);
        }
        if busy(sl) {
            main.push_back(s);
            continue;
        }
        if sl.freq > 0 {
            sl.freq -= 1;
            main.push_back(s);
            continue;
        }
        return Some(s);
    }
    None
}

#[cfg(test)]
mod tests {
    use super::super::{LOADING, NO_ID};
    use super::*;

    fn slots(n: usize) -> Vec<Slot> {
        vec![
            Slot {
                id: NO_ID,
                stamp: 0,
                pins: 0,
                generation: 0,
                state: FREE,
                freq: 0,
            };
            n
        ]
    }

    /// Load `id` through the evictor (victim, then admit), as the cache does.
    fn load(e: &mut Evictor, sl: &mut [Slot], map: &mut IdMap<u32>, id: u64) -> Option<u64> {
        if let Some(&s) = map.get(&id) {
            Evictor::touch(&mut sl[s as usize]);
            return None;
        }
        let v = e.victim(sl).expect("a victim");
        let old = sl[v as usize].id;
        if old != NO_ID {
            map.remove(&old);
        }
        sl[v as usize].id = id;
        sl[v as usize].state = READY;
        e.admit(sl, v, id);
        map.insert(id, v);
        (old != NO_ID).then_some(old)
    }

    #[test]
    fn one_off_ids_do_not_flush_hot_rows() {
        for policy in [Policy::Clock, Policy::S3Fifo] {
            let n = 20;
            let mut e = Evictor::new(policy, n);
            let mut sl = slots(n);
            let mut map = IdMap::default();
            // Ten hot rows, each hit twice.
            for _ in 0..2 {
                for id in 0..10 {
                    load(&mut e, &mut sl, &mut map, id);
                }
            }
            // A long run of one-off ids, with the hot rows hit now and then.
            for k in 0..400u64 {
                load(&mut e, &mut sl, &mut map, 1000 + k);
                if k % 8 == 0 {
                    for id in 0..10 {
                        load(&mut e, &mut sl, &mut map, id);
                    }
                }
            }
            let kept = (0..10).filter(|id| map.contains_key(id)).count();
            if policy == Policy::S3Fifo {
                assert_eq!(kept, 10, "S3-FIFO lost hot rows to one-off ids");
                assert!(e.ghosts() > 0);
            } else {
                assert!(kept <= 10);
            }
        }
    }

    #[test]
    fn busy_slots_are_never_victims() {
        for policy in [Policy::Clock, Policy::S3Fifo] {
            let n = 4;
            let mut e = Evictor::new(policy, n);
            let mut sl = slots(n);
            let mut map = IdMap::default();
            for id in 0..4 {
                load(&mut e, &mut sl, &mut map, id);
            }
            sl[0].pins = 1;
            sl[1].state = LOADING;
            sl[2].pins = 2;
            let v = e.victim(&mut sl).expect("slot 3 is free to take");
            assert_eq!(v, 3, "{policy:?}");
            e.admit(&mut sl, 3, 99);
            sl[3].pins = 1;
            assert!(e.victim(&mut sl).is_none(), "{policy:?}");
            sl[0].pins = 0;
            assert_eq!(e.victim(&mut sl).unwrap(), 0, "{policy:?}");
        }
    }

    #[test]
    fn policy_names_parse() {
        for p in [Policy::Clock, Policy::S3Fifo] {
            assert_eq!(p.name().parse::<Policy>().unwrap(), p);
        }
        let e = "lru".parse::<Policy>().unwrap_err().to_string();
        assert!(e.contains("'lru'") && e.contains("s3fifo"), "{e}");
    }
}
