//! The decode workload over one engine and the row-cache fill before it:
//! sequences prefilled once, then decode steps of one token each in
//! groups, with the step prefetch ahead of each group when on; and the
//! running totals (prefetch, hashing, decode, the sites' host work, I/O
//! wait, CPU) the phases are differences of.
//!
//! Invariant: every configuration draws the same token stream (one seeded
//! stream per purpose: fill, trace, measured), so two tables differ only
//! by how their rows are served.

use super::*;

/// The engine the bench drives.
pub(super) type Served = Engine<Layered<PleSite>>;

/// The plan of one site of a [`Served`] engine.
pub(super) type PlanOf = <Layered<PleSite> as metrale_engine::Site>::Plan;

/// How a row cache was filled before decoding.
#[derive(Clone, Debug)]
pub(super) struct Filled {
    /// Tokens of the fill stream replayed.
    pub(super) tokens: u64,
    /// The hit rate of each window.
    pub(super) hit_rates: Vec<f64>,
    /// Whether the last two windows' hit rates were within [`SETTLED`]
    /// after the cache had filled up.
    pub(super) settled: bool,
    pub(super) secs: f64,
    /// Whether the fill stream read documents twice.
    pub(super) reread: bool,
}

/// Fill the row caches of `e` to their steady state under the workload's
/// stream before anything is measured: [`FILL_SEQUENCES`] sequences of the
/// stream drawn from [`FILL_SEED`] (a corpus's second half) are
/// replayed token by token as decode steps ask for rows (every sequence's
/// ids of a step, at every site, resolved and released), with nothing
/// computed, in windows of one cache's worth of lookups, until the cache
/// has evicted (it is full) and the hit rate of a window moved less than
/// [`SETTLED`] from the last, or after `max_windows`. A decode step's
/// warm-up alone reaches a few tens of thousands of tokens, far short of
/// the stream a server's cache has seen; this is what a long-running
/// server's cache holds when the measured steps arrive.
pub(super) fn fill(
    e: &Served,
    gpu: &dyn GpuBackend,
    source: &Source,
    slots: usize,
    max_windows: usize,
) -> Result<Filled> {
    let t0 = Instant::now();
    let mut streams = Streams::new(source, FILL_SEED, FILL_SEQUENCES, source.docs(0.5, 1.0));
    let mut hist: Vec<Vec<u32>> = vec![Vec::new(); FILL_SEQUENCES];
    // Only the last `context_len` tokens matter to a site's hash.
    let keep = e
        .geometries()
        .iter()
        .map(|g| g.dims.context_len())
        .max()
        .unwrap_or(0);
    let start = e.table_stats();
    let mut out = Filled {
        tokens: 0,
        hit_rates: Vec::new(),
        settled: false,
        secs: 0.0,
        reread: false,
    };
    let mut refs = Vec::new();
    for _ in 0..max_windows.max(1) {
        let before = e.table_stats();
        let mut lookups = 0u64;
        while lookups < slots as u64 {
            let tokens: Vec<u32> = (0..FILL_SEQUENCES).map(|i| streams.next(i)).collect();
            let work: Vec<SeqWork<'_>> = hist
                .iter()
                .zip(&tokens)
                .map(|(h, t)| SeqWork::new(h, std::slice::from_ref(t)))
                .collect();
            for site in e.sites() {
                let layer = site.inner().layer();
                let hashed = layer.plan(&work)?;
                let table = layer.table();
                for chunk in hashed.ids().chunks(table.max_resolve().max(1)) {
                    refs.clear();
                    refs.resize(chunk.len(), RowRef::default());
                    let lease = table.resolve(chunk, &mut refs)?;
                    table.release(lease, gpu, None)?;
                }
                lookups += hashed.ids().len() as u64;
            }
            for (h, &t) in hist.iter_mut().zip(&tokens) {
                h.push(t);
                if h.len() > keep {
                    h.remove(0);
                }
            }
            out.tokens += FILL_SEQUENCES as u64;
        }
        let s = e.table_stats().since(&before);
        let hr = s.hits as f64 / lookups.max(1) as f64;
        let prev = out.hit_rates.last().copied();
        out.hit_rates.push(hr);
        let full = e.table_stats().since(&start).evictions > 0;
        if full && prev.is_some_and(|p| (hr - p).abs() < SETTLED) {
            out.settled = true;
            break;
        }
    }
    out.secs = t0.elapsed().as_secs_f64();
    out.reread = streams.reread();
    Ok(out)
}

/// The decode workload over one engine: sequences prefilled once, then
/// steps of one token each, decoded in consecutive groups of sequences
/// (one group unless `--micro-batches`); a group's tokens are known once
/// its decode of the step before returned (what prefetch reads).
pub(super) struct Workload {
    pub(super) streams: Streams,
    pub(super) ids: Vec<SeqId>,
    pub(super) cur: Vec<u32>,
    pub(super) template: Vec<f32>,
    pub(super) highway: Vec<f32>,
    pub(super) prefetch: bool,
    /// The groups: consecutive ranges of `ids`.
    pub(super) groups: Vec<std::ops::Range<usize>>,
    /// Time in step prefetch calls and in decode calls.
    pub(super) prefetch_wall: Duration,
    pub(super) decode_wall: Duration,
}

impl Workload {
    pub(super) fn new(
        e: &mut Served,
        source: &Source,
        sizes: &Sizes,
        prefetch: bool,
    ) -> Result<Workload> {
        let mut streams = Streams::new(source, STREAM_SEED, sizes.sequences, source.docs(0.0, 1.0));
        let mut rng = Rng::new(STREAM_SEED);
        let w = e.width();
        let rows = sizes.sequences.max(sizes.prompt);
        let template: Vec<f32> = (0..rows * w)
            .map(|_| (unit(&mut rng) * 2.0 - 1.0) as f32)
            .collect();
        let mut ids = Vec::with_capacity(sizes.sequences);
        for i in 0..sizes.sequences {
            let prompt: Vec<u32> = (0..sizes.prompt).map(|_| streams.next(i)).collect();
            let id = e.add_sequence(&prompt)?.id;
            let mut hw = template[..prompt.len() * w].to_vec();
            e.prefill(id, &prompt, &mut hw)?;
            ids.push(id);
        }
        let cur = (0..ids.len()).map(|i| streams.next(i)).collect();
        let n = sizes.micro_batches.clamp(1, ids.len().max(1));
        let groups: Vec<_> = (0..n)
            .map(|g| g * ids.len() / n..(g + 1) * ids.len() / n)
            .collect();
        Ok(Workload {
            streams,
            ids,
            cur,
            highway: Vec::with_capacity(sizes.sequences * w),
            template,
            prefetch,
            groups,
            prefetch_wall: Duration::ZERO,
            decode_wall: Duration::ZERO,
        })
    }

    /// Plan group `g`'s current tokens at every site ([`Engine::plan`])
    /// and start their reads: for its decode now (the plan returned, which
    /// the decode runs), or `ahead` of it, behind the reads of the group
    /// decoding now (the plan dropped once its reads are queued).
    pub(super) fn prefetch_group(
        &mut self,
        e: &Served,
        g: usize,
        ahead: bool,
    ) -> Result<Option<StepPlans<PlanOf>>> {
        let t0 = Instant::now();
        let work: Vec<(SeqId, &[u32])> = self.groups[g]
            .clone()
            .map(|i| (self.ids[i], std::slice::from_ref(&self.cur[i])))
            .collect();
        let plan = e.plan(&work)?;
        e.prefetch_plan(&plan)?;
        self.prefetch_wall += t0.elapsed();
        Ok((!ahead).then_some(plan))
    }

    /// One decode step of every sequence, group after group. With
    /// prefetch, a group's reads start at the start of its turn and, with
    /// more than one group, as soon as its tokens are known: right after
    /// its decode of the step before, so that they overlap the other
    /// groups' decodes (its turn then asks again, finding them loaded or
    /// on their way). A `last` step starts nothing ahead, so no read of a
    /// repetition runs on into another table's turn.
    pub(super) fn step(&mut self, e: &mut Served, last: bool) -> Result<()> {
        for g in 0..self.groups.len() {
            let plan = match self.prefetch {
                true => self.prefetch_group(e, g, false)?,
                false => None,
            };
            let range = self.groups[g].clone();
            let batch: Vec<(SeqId, u32)> =
                range.clone().map(|i| (self.ids[i], self.cur[i])).collect();
            self.highway.clear();
            self.highway
                .extend_from_slice(&self.template[..batch.len() * e.width()]);
            let t1 = Instant::now();
            match &plan {
                Some(p) => e.decode_planned(&batch, p, &mut self.highway)?,
                None => e.decode(&batch, &mut self.highway)?,
            }
            self.decode_wall += t1.elapsed();
            for i in range {
                self.cur[i] = self.streams.next(i);
            }
            if self.prefetch && !last && self.groups.len() > 1 {
                self.prefetch_group(e, g, true)?;
            }
        }
        Ok(())
    }
}

/// The share of `lookups` row lookups of decode steps that found their
/// row mapped: a resolve counts a hit for each id found loaded, or being
/// loaded by a prefetch (whose wait is I/O wait); a prefetch's own reads
/// count as misses, so `hits / (hits + misses)` would count those rows
/// twice.
pub(super) fn hit_rate(s: &TableStats, lookups: u64) -> Option<f64> {
    (lookups > 0).then(|| s.hits as f64 / lookups as f64)
}

/// The running totals the phases are differences of.
#[derive(Clone, Copy, Default)]
pub(super) struct Counters {
    pub(super) prefetch: Duration,
    pub(super) hash: Duration,
    pub(super) decode: Duration,
    pub(super) site_host: Duration,
    pub(super) io_wait: Duration,
    pub(super) cpu: Option<(u64, u64)>,
}

impl Counters {
    pub(super) fn now(e: &Served, w: &Workload) -> Counters {
        let mut c = Counters {
            prefetch: w.prefetch_wall,
            decode: w.decode_wall,
            io_wait: Duration::from_nanos(e.table_stats().io_wait_ns),
            cpu: thread_cpu_ns(),
            ..Counters::default()
        };
        for s in e.sites() {
            c.hash += s.inner().prefetch_time().hash;
            c.site_host += s.host_time();
        }
        c
    }

    /// `self - before`, added to `acc`.
    pub(super) fn add_since(&self, before: &Counters, acc: &mut Counters) {
        acc.prefetch += self.prefetch.saturating_sub(before.prefetch);
        acc.hash += self.hash.saturating_sub(before.hash);
        acc.decode += self.decode.saturating_sub(before.decode);
        acc.site_host += self.site_host.saturating_sub(before.site_host);
        acc.io_wait += self.io_wait.saturating_sub(before.io_wait);
        acc.cpu = match (acc.cpu, self.cpu.zip(before.cpu)) {
            (Some((ap, at)), Some(((p1, t1), (p0, t0)))) => {
                Some((ap + p1.saturating_sub(p0), at + t1.saturating_sub(t0)))
            }
            _ => None,
        };
    }
}
