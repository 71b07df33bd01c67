//! Accounting of the device memory held by sequence carries, and the policy
//! that picks sequences to preempt when a new charge would not fit.
//!
//! The budget does not allocate anything: the engine charges a sequence when
//! it allocates its carry (add, swap-in) and releases the charge when it
//! frees it (release, swap-out). Before a charge that would not fit, the
//! engine asks [`MemoryBudget::plan_preemption`] which resident sequences to
//! swap out.
//!
//! Invariants:
//! - `used` is the sum of the live charges and never exceeds the limit: a
//!   charge that would is refused and changes nothing;
//! - a sequence has at most one charge;
//! - victims are chosen least recently used first (by [`MemoryBudget::touch`]
//!   order), never among the protected sequences, and a plan is only returned
//!   when it frees enough; otherwise the error says how much could be freed.

use std::collections::{BTreeMap, HashMap};

use thiserror::Error;

/// Why a charge or a plan was refused.
#[derive(Debug, Error, Clone, PartialEq, Eq)]
pub enum BudgetError {
    /// The charge does not fit even after preempting every candidate.
    #[error(
        "device memory budget exhausted: need {need} bytes, {used} of {limit} in use, at most {freeable} could be freed by preemption"
    )]
    Exhausted {
        /// Bytes asked for.
        need: usize,
        /// Bytes charged now.
        used: usize,
        /// The limit.
        limit: usize,
        /// Bytes held by sequences that may be preempted.
        freeable: usize,
    },
    /// The sequence already holds a charge.
    #[error("sequence {0} is already charged to the device memory budget")]
    AlreadyCharged(u64),
}

/// Figures of a budget.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct BudgetStats {
    /// The limit in bytes.
    pub limit_bytes: usize,
    /// Bytes charged now.
    pub used_bytes: usize,
    /// The most bytes charged at once.
    pub peak_bytes: usize,
    /// Sequences charged now.
    pub resident: usize,
    /// Charges made.
    pub charges: u64,
    /// Charges released.
    pub releases: u64,
    /// Victims named by preemption plans.
    pub preemptions_planned: u64,
    /// Charges or plans refused for lack of memory.
    pub refusals: u64,
}

#[derive(Clone, Copy, Debug)]
struct Charge {
    bytes: usize,
    tick: u64,
}

/// A byte budget over per-sequence charges with LRU preemption planning.
#[derive(Debug)]
pub struct MemoryBudget {
    limit: usize,
    used: usize,
    charges: HashMap<u64, Charge>,
    by_tick: BTreeMap<u64, u64>,
    tick: u64,
    stats: BudgetStats,
}

impl MemoryBudget {
    /// A budget of `limit_bytes`.
    pub fn new(limit_bytes: usize) -> Self {
        MemoryBudget {
            limit: limit_bytes,
            used: 0,
            charges: HashMap::new(),
            by_tick: BTreeMap::new(),
            tick: 0,
            stats: BudgetStats::default(),
        }
    }

    /// The limit in bytes.
    pub fn limit(&self) -> usize {
        self.limit
    }

    /// Bytes charged now.
    pub fn used(&self) -> usize {
        self.used
    }

    /// Bytes still free.
    pub fn available(&self) -> usize {
        self.limit - self.used
    }

    /// The bytes `seq` holds, if charged.
    pub fn charged(&self, seq: u64) -> Option<usize> {
        self.charges.get(&seq).map(|c| c.bytes)
    }

    /// Whether `bytes` more would fit without preemption.
    pub fn fits(&self, bytes: usize) -> bool {
        bytes <= self.available()
    }

    fn refuse(&mut self, need: usize, freeable: usize) -> BudgetError {
        self.stats.refusals += 1;
        BudgetError::Exhausted {
            need,
            used: self.used,
            limit: self.limit,
            freeable,
        }
    }

    /// Charge `bytes` to `seq`, marking it most recently used. Refused (and
    /// nothing changes) when it does not fit or `seq` is already charged.
    pub fn charge(&mut self, seq: u64, bytes: usize) -> Result<(), BudgetError> {
        if self.charges.contains_key(&seq) {
            return Err(BudgetError::AlreadyCharged(seq));
        }
        if !self.fits(bytes) {
            return Err(self.refuse(bytes, 0));
        }
        self.tick += 1;
        self.charges.insert(
            seq,
            Charge {
                bytes,
                tick: self.tick,
            },
        );
        self.by_tick.insert(self.tick, seq);
        self.used += bytes;
        self.stats.charges += 1;
        self.stats.peak_bytes = self.stats.peak_bytes.max(self.used);
        Ok(())
    }

    /// Drop `seq`'s charge; returns the bytes it held (0 if none).
    pub fn release(&mut self, seq: u64) -> usize {
        match self.charges.remove(&seq) {
            Some(c) => {
                self.by_tick.remove(&c.tick);
                self.used -= c.bytes;
                self.stats.releases += 1;
                c.bytes
            }
            None => 0,
        }
    }

    /// Mark `seq` most recently used. A no-op when it is not charged.
    pub fn touch(&mut self, seq: u64) {
        if let Some(c) = self.charges.get_mut(&seq) {
            self.by_tick.remove(&c.tick);
            self.tick += 1;
            c.tick = self.tick;
            self.by_tick.insert(self.tick, seq);
        }
    }

    /// The sequences to preempt, least recently used first, so that `need`
    /// more bytes fit; `protected` sequences are never chosen. An empty plan
    /// means it fits already. Refused when even preempting every candidate
    /// would not free enough.
    pub fn plan_preemption(
        &mut self,
        need: usize,
        protected: &[u64],
    ) -> Result<Vec<u64>, BudgetError> {
        if need > self.limit {
            let freeable = self.freeable(protected);
            return Err(self.refuse(need, freeable));
        }
        let mut short = need.saturating_sub(self.available());
        let mut plan = Vec::new();
        for &seq in self.by_tick.values() {
            if short == 0 {
                break;
            }
            if protected.contains(&seq) {
                continue;
            }
            let bytes = self.charges[&seq].bytes;
            if bytes == 0 {
                continue;
            }
            plan.push(seq);
            short = short.saturating_sub(bytes);
        }
        if short > 0 {
            let freeable = self.freeable(protected);
            return Err(self.refuse(need, freeable));
        }
        self.stats.preemptions_planned += plan.len() as u64;
        Ok(plan)
    }

    fn freeable(&self, protected: &[u64]) -> usize {
        self.charges
            .iter()
            .filter(|(s, _)| !protected.contains(s))
            .map(|(_, c)| c.bytes)
            .sum()
    }

    /// Current figures.
    pub fn stats(&self) -> BudgetStats {
        BudgetStats {
            limit_bytes: self.limit,
            used_bytes: self.used,
            resident: self.charges.len(),
            ..self.stats
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn charge_release_and_peak() {
        let mut b = MemoryBudget::new(100);
        b.charge(1, 60).unwrap();
        assert_eq!(b.charge(1, 1), Err(BudgetError::AlreadyCharged(1)));
        let e = b.charge(2, 41).unwrap_err();
        assert_eq!(
            e.to_string(),
            "device memory budget exhausted: need 41 bytes, 60 of 100 in use, at most 0 could be freed by preemption"
        );
        assert_eq!(b.used(), 60);
        b.charge(2, 40).unwrap();
        assert_eq!(b.release(1), 60);
        assert_eq!(b.release(1), 0);
        let s = b.stats();
        assert_eq!(
            (s.used_bytes, s.peak_bytes, s.resident, s.refusals),
            (40, 100, 1, 1)
        );
    }

    #[test]
    fn plan_is_lru_and_skips_protected() {
        let mut b = MemoryBudget::new(100);
        for s in 1..=4 {
            b.charge(s, 25).unwrap();
        }
        b.touch(1);
        // Order now 2, 3, 4, 1.
        assert_eq!(b.plan_preemption(0, &[]).unwrap(), Vec::<u64>::new());
        assert_eq!(b.plan_preemption(30, &[]).unwrap(), vec![2, 3]);
        assert_eq!(b.plan_preemption(30, &[2]).unwrap(), vec![3, 4]);
        let e = b.plan_preemption(80, &[1, 2]).unwrap_err();
        assert_eq!(
            e,
            BudgetError::Exhausted {
                need: 80,
                used: 100,
                limit: 100,
                freeable: 50
            }
        );
        assert!(b.plan_preemption(101, &[]).is_err());
    }
}
