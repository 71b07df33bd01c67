//! Benchmark workloads of the engine, shared by
//! `cargo bench --bench engine` and `metrale-ple bench`.
//!
//! The workloads borrow engines their caller built (from any sites: a
//! checkpoint's PLE layers, a test model) and closes. Each exposes the
//! measured operation (`run`, or `swap_out` / `swap_in`) and its same-run
//! baseline (`baseline`) as methods; the caller does the timing, and the
//! untimed bookkeeping around a measured call (adding the sequence a
//! baseline prefills, releasing what a run added) is in separate methods.
//!
//! Invariants: a workload never leaves a sequence behind in an engine once
//! its `release` or `close` returned (or it was dropped, errors then
//! ignored); [`PrefixRestore::run`] fails unless the whole prefix came
//! from the cache.

use std::hint::black_box;

use crate::runtime::HostMemcpy;
use anyhow::{Context, Result, ensure};

use metrale_engine::engine::{Engine, SeqId, Site, SwapTarget};

/// Highway rows for `n` tokens of `width` values: any values will do.
pub fn highway_rows(n: usize, width: usize, salt: u32) -> Vec<f32> {
    (0..n * width)
        .map(|i| {
            let x = (i as u32).wrapping_mul(2_654_435_761) ^ salt;
            (x >> 8) as f32 / (1u32 << 24) as f32 - 0.5
        })
        .collect()
}

/// A prompt of `n` tokens (`1 + 7i mod 997`): no EOS in any vocabulary
/// larger than 998 whose EOS is not below 998 or is 0.
pub fn prompt(n: usize) -> Vec<u32> {
    (0..n as u32).map(|i| 1 + i * 7 % 997).collect()
}

/// Adding a sequence whose whole prefix is in the prefix cache (lookup,
/// carry allocation, restore), against recomputing the same prefix in an
/// engine without a prefix cache (prefill in chunks of the engine's
/// `prefill_chunk`).
pub struct PrefixRestore<'a, S: Site> {
    cached: &'a mut Engine<S>,
    plain: &'a mut Engine<S>,
    prompt: Vec<u32>,
    prefix: usize,
    restored: Option<SeqId>,
    recompute: Option<(SeqId, Vec<f32>)>,
    salt: u32,
}

impl<'a, S: Site> PrefixRestore<'a, S> {
    /// A prefix of `prefix` tokens rounded down to whole blocks of `block`
    /// (at least one block); `cached` must have a prefix cache that holds
    /// it, `plain` the same sites without one. Fills the cache with one
    /// prefill of the prefix.
    pub fn new(
        cached: &'a mut Engine<S>,
        plain: &'a mut Engine<S>,
        prefix: usize,
        block: usize,
    ) -> Result<Self> {
        ensure!(block > 0, "bench prefix: block size 0");
        let prefix = (prefix / block).max(1) * block;
        ensure!(
            cached.width() == plain.width(),
            "bench prefix: the engines' highway widths differ"
        );
        let prompt = prompt(prefix + 1);
        let id = cached.add_sequence(&prompt)?.id;
        let mut hw = highway_rows(prefix, cached.width(), 0);
        let filled = cached.prefill(id, &prompt[..prefix], &mut hw);
        let released = cached.release(id);
        filled.context("filling the prefix cache")?;
        released?;
        Ok(PrefixRestore {
            cached,
            plain,
            prompt,
            prefix,
            restored: None,
            recompute: None,
            salt: 1,
        })
    }

    /// Tokens of the prefix.
    pub fn prefix(&self) -> usize {
        self.prefix
    }

    /// The measured operation: add the sequence, its prefix restored from
    /// the cache. [`release`](Self::release) it before the next call.
    pub fn run(&mut self) -> Result<()> {
        ensure!(self.restored.is_none(), "bench prefix: run twice");
        let a = self.cached.add_sequence(&self.prompt)?;
        self.restored = Some(a.id);
        ensure!(
            a.cached == self.prefix,
            "only {} of the {} prefix tokens hit the cache",
            a.cached,
            self.prefix
        );
        Ok(())
    }

    /// Untimed: add the sequence [`baseline`](Self::baseline) prefills, and
    /// its highway rows.
    pub fn prepare_baseline(&mut self) -> Result<()> {
        ensure!(self.recompute.is_none(), "bench prefix: prepared twice");
        let id = self.plain.add_sequence(&self.prompt)?.id;
        let hw = highway_rows(self.prefix, self.plain.width(), self.salt);
        self.salt += 1;
        self.recompute = Some((id, hw));
        Ok(())
    }

    /// The baseline: prefill the prefix in the engine without a cache.
    pub fn baseline(&mut self) -> Result<()> {
        let (id, hw) = self
            .recompute
            .as_mut()
            .context("bench prefix: baseline before prepare_baseline")?;
        self.plain
            .prefill(*id, &self.prompt[..self.prefix], &mut *hw)?;
        black_box(hw);
        Ok(())
    }

    /// Untimed: release what [`run`](Self::run) and
    /// [`prepare_baseline`](Self::prepare_baseline) added.
    pub fn release(&mut self) -> Result<()> {
        let r = match self.restored.take() {
            Some(id) => self.cached.release(id),
            None => Ok(()),
        };
        let p = match self.recompute.take() {
            Some((id, _)) => self.plain.release(id),
            None => Ok(()),
        };
        r?;
        p?;
        Ok(())
    }
}

impl<S: Site> Drop for PrefixRestore<'_, S> {
    fn drop(&mut self) {
        let _ = self.release();
    }
}

/// Swapping one sequence's carry out to host memory and back in, against a
/// `memcpy` of the same number of bytes.
pub struct SwapCarry<'a, S: Site> {
    engine: &'a mut Engine<S>,
    id: Option<SeqId>,
    host: HostMemcpy,
}

impl<'a, S: Site> SwapCarry<'a, S> {
    /// Add a sequence to `engine` and prefill `tokens` tokens of it.
    pub fn new(engine: &'a mut Engine<S>, tokens: usize) -> Result<Self> {
        let p = prompt(tokens.max(1));
        let id = engine.add_sequence(&p)?.id;
        let mut hw = highway_rows(p.len(), engine.width(), 9);
        if let Err(e) = engine.prefill(id, &p, &mut hw) {
            let _ = engine.release(id);
            return Err(e.into());
        }
        let carry = engine.carry_bytes();
        Ok(SwapCarry {
            engine,
            id: Some(id),
            host: HostMemcpy::new(carry, 0x5a),
        })
    }

    /// Bytes of the carry (and of the baseline's copy).
    pub fn carry_bytes(&self) -> usize {
        self.host.bytes()
    }

    fn id(&self) -> Result<SeqId> {
        self.id.context("bench swap: the workload was closed")
    }

    /// The measured operation: swap the carry out to host memory.
    pub fn swap_out(&mut self) -> Result<()> {
        let id = self.id()?;
        self.engine.swap_out(id, SwapTarget::Host)?;
        Ok(())
    }

    /// The measured operation: swap the carry back in.
    pub fn swap_in(&mut self) -> Result<()> {
        let id = self.id()?;
        self.engine.swap_in(id)?;
        Ok(())
    }

    /// The baseline: `memcpy` of the carry's byte count.
    pub fn baseline(&mut self) {
        self.host.run();
    }

    /// Release the sequence.
    pub fn close(mut self) -> Result<()> {
        self.free()
    }

    fn free(&mut self) -> Result<()> {
        match self.id.take() {
            Some(id) => Ok(self.engine.release(id)?),
            None => Ok(()),
        }
    }
}

impl<S: Site> Drop for SwapCarry<'_, S> {
    fn drop(&mut self) {
        let _ = self.free();
    }
}
