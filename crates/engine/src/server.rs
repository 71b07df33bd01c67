//! The serving loop over an [`Engine`]: a fixed workload of requests driven
//! as a server drives sequences.
//!
//! A [`Server`] keeps up to [`ServerConfig::in_flight`] requests admitted
//! (restoring shared prefixes from the engine's prefix cache), and
//! alternates one batched decode step (up to [`ServerConfig::decode_batch`]
//! sequences, resident carries first) with one prefill chunk (at most
//! [`ServerConfig::prefill_chunk`] tokens; the same request goes on until
//! its prompt is done, first come, first served). At the start of each step,
//! as soon as its tokens are known, it plans the step's decode batch and
//! prefill chunk at every site at once ([`Engine::plan`]: one plan per
//! site, each id hashed once), starts their row reads
//! ([`Engine::prefetch_plan`]) and runs the same plan in the step's decode
//! and prefill, which hash nothing again, so that the reads run while the
//! step computes, and with
//! [`ServerConfig::prefetch_ahead`] those of the next step's decode batch
//! too (sequences waiting behind this step's, whose tokens are known), so
//! that those overlap this whole step: with a backbone
//! ([`ServerConfig::backbone`], [`crate::backbone`]) the blocks before a
//! site hide its reads; without one the prefill chunk's reads overlap the
//! decode step. Preemption and swap under the device budget happen inside
//! the engine.
//!
//! The workload is an input: the [`Request`]s (tokens and how they are run)
//! and the input highway row of each token ([`Workload::rows`]). Every
//! output row is fingerprinted ([`fingerprint`]) by request and position,
//! so two runs of one workload can be compared row by row.
//!
//! Invariants:
//! - the input rows of a token depend on the token alone, so they are a
//!   function of the token prefix, as the prefix cache requires;
//! - with [`ServerConfig::retries`] set, a failed call releases its
//!   sequences, forgets their rows and queues them to run again from the
//!   start (or gives them up after the retries); the other sequences go on.
//!   Without it, the first failure ends the run;
//! - a report's rows hold exactly the positions computed by the last
//!   attempt of each request; positions restored from the prefix cache are
//!   `None`;
//! - prefetch and the backbone are advice and stand-in compute: neither
//!   changes an output bit.

use std::collections::VecDeque;
use std::io;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use metrale_gpu_runtime::gpu::GpuBackend;
use metrale_storage::io::{PageReader, ReadFeed, ReadReq};
use metrale_storage::table::TableStats;
use thiserror::Error;

use crate::backbone::{BackboneConfig, BackboneError, Layered, layered};
use crate::engine::{Engine, EngineConfig, EngineError, EngineStats, SeqId, Site, StepPlans};

/// Where a segment of a request's tokens goes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Phase {
    /// Run in chunks (a prompt).
    Prefill,
    /// Run one token per decode step (generated tokens).
    Decode,
}

/// One request of a workload: its tokens and how they are run.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Request {
    /// Every token the request runs.
    pub tokens: Vec<u32>,
    /// Consecutive segments `(phase, end)`: the tokens up to `end` (from the
    /// previous segment's end) run in `phase`. The first is a prefill and
    /// the last ends at `tokens.len()`.
    pub segments: Vec<(Phase, usize)>,
}

/// What a [`Server`] runs.
#[derive(Clone, Copy)]
pub struct Workload<'a> {
    /// The requests, in arrival order.
    pub requests: &'a [Request],
    /// Writes the input highway row (`hc * hidden` values) of a token. It
    /// must depend on the token alone.
    pub rows: &'a dyn Fn(u32, &mut [f32]),
}

/// How a [`Server`] schedules.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ServerConfig {
    /// Requests admitted at once.
    pub in_flight: usize,
    /// Most tokens per prefill call.
    pub prefill_chunk: usize,
    /// Most sequences per batched decode step.
    pub decode_batch: usize,
    /// Start the row reads of each step's decode batch and prefill chunk at
    /// the start of the step.
    pub prefetch: bool,
    /// With `prefetch`, also plan and start the reads of the next step's
    /// decode batch (the sequences waiting behind this step's, whose next
    /// tokens are known), after this step's own, so that they overlap this
    /// step's compute. The next step plans them again (a lookup a row) and
    /// runs its own plan.
    pub prefetch_ahead: bool,
    /// Run backbone blocks (one per model layer) around the sites. Taken by
    /// [`Server::build`], which wraps the sites; [`Server::new`] takes an
    /// engine whose sites are already built and refuses it.
    pub backbone: Option<BackboneConfig>,
    /// Decode through captured graphs ([`Engine::enable_decode_graphs`]).
    pub decode_graphs: bool,
    /// `Some(n)`: the sequences of a failed call are released and run again,
    /// each up to `n` times; `None`: the first failure ends the run.
    pub retries: Option<u32>,
}

impl Default for ServerConfig {
    fn default() -> Self {
        ServerConfig {
            in_flight: 48,
            prefill_chunk: 128,
            decode_batch: 16,
            prefetch: true,
            prefetch_ahead: true,
            backbone: None,
            decode_graphs: false,
            retries: None,
        }
    }
}

/// What a run did.
#[derive(Clone, Debug, Default)]
pub struct ServerReport {
    /// `rows[request][pos]`: the [`fingerprint`] of the output row of
    /// position `pos`, or `None` where it was restored rather than computed.
    pub rows: Vec<Vec<Option<u64>>>,
    /// Time in adds and prefill calls.
    pub prefill_time: Duration,
    /// Time in decode calls.
    pub decode_time: Duration,
    /// Time of the whole run.
    pub wall: Duration,
    /// The engine's figures at the end.
    pub stats: EngineStats,
    /// The sites' row-table counters over this run (the difference between
    /// its end and its start).
    pub table: TableStats,
    /// Time the run's calls were blocked on the host waiting for rows
    /// (foreground misses, and rows a prefetch was still reading):
    /// `table.io_wait_ns` as a duration. Launches are asynchronous, so the
    /// backend may meanwhile still run work queued before the site.
    pub io_wait: Duration,
    /// Time spent in read calls over the run, foreground and prefetch
    /// alike (summed over concurrent readers), when the tables read
    /// through the [`TimedReader`] given to [`Server::time_reads`].
    pub read_time: Option<Duration>,
    /// Calls that failed (tolerated with retries on).
    pub failed_calls: u64,
    /// Requests run again after a failed call.
    pub retried: u64,
    /// Requests given up after their retries, in order.
    pub failed: Vec<usize>,
    /// The first failure, with its causes.
    pub first_fault: Option<String>,
}

/// Why a run stopped.
#[derive(Debug, Error)]
#[non_exhaustive]
pub enum ServerError {
    /// A scheduling setting is out of range.
    #[error("server config: {0}")]
    Config(String),
    /// A request is malformed.
    #[error("request {request}: {reason}")]
    Request {
        /// The request.
        request: usize,
        /// What is wrong.
        reason: String,
    },
    /// Adding a request's sequence failed.
    #[error("adding sequence {request}")]
    Add {
        /// The request.
        request: usize,
        /// The engine's error.
        #[source]
        source: EngineError,
    },
    /// A prefill call failed (retries off).
    #[error("prefill of sequence {request}")]
    Prefill {
        /// The request.
        request: usize,
        /// The engine's error.
        #[source]
        source: EngineError,
    },
    /// A batched decode call failed (retries off).
    #[error("batched decode")]
    Decode {
        /// The engine's error.
        #[source]
        source: EngineError,
    },
    /// Any other engine call failed (prefetch, release, residency query).
    #[error(transparent)]
    Engine(#[from] EngineError),
    /// The backbone could not be built.
    #[error(transparent)]
    Backbone(#[from] BackboneError),
}

impl ServerError {
    /// The engine error inside, if any.
    pub fn engine_error(&self) -> Option<&EngineError> {
        match self {
            ServerError::Add { source, .. }
            | ServerError::Prefill { source, .. }
            | ServerError::Decode { source } => Some(source),
            ServerError::Engine(e) => Some(e),
            ServerError::Config(_) | ServerError::Request { .. } | ServerError::Backbone(_) => None,
        }
    }
}

/// A 64-bit fingerprint of one output row's bits.
pub fn fingerprint(row: &[f32]) -> u64 {
    let mut h = 0xCBF2_9CE4_8422_2325u64;
    for v in row {
        h = (h ^ v.to_bits() as u64).wrapping_mul(0x0000_0100_0000_01B3);
    }
    h ^ (h >> 29)
}

/// A page reader that times its reads: give it to the row tables
/// (`CacheConfig::reader`) and to [`Server::time_reads`], and the report
/// carries the total read time beside the wait.
pub struct TimedReader {
    inner: Arc<dyn PageReader>,
    ns: AtomicU64,
}

impl TimedReader {
    /// Time the reads of `inner`.
    pub fn new(inner: Arc<dyn PageReader>) -> Self {
        TimedReader {
            inner,
            ns: AtomicU64::new(0),
        }
    }

    /// Time spent in read batches so far.
    pub fn elapsed(&self) -> Duration {
        Duration::from_nanos(self.ns.load(Ordering::Relaxed))
    }
}

impl PageReader for TimedReader {
    fn name(&self) -> &str {
        self.inner.name()
    }
    fn read_batch(&self, reqs: &mut [ReadReq<'_>]) -> Vec<io::Result<usize>> {
        let t0 = Instant::now();
        let r = self.inner.read_batch(reqs);
        self.ns
            .fetch_add(t0.elapsed().as_nanos() as u64, Ordering::Relaxed);
        r
    }
    fn read_feed(&self, feed: &mut dyn ReadFeed) {
        // Passed on whole, so the inner reader keeps its own way of
        // streaming a feed; the feed's bookkeeping counts as read time.
        let t0 = Instant::now();
        self.inner.read_feed(feed);
        self.ns
            .fetch_add(t0.elapsed().as_nanos() as u64, Ordering::Relaxed);
    }
}

/// A serving loop over an engine. See the module docs.
pub struct Server<S: Site> {
    engine: Engine<S>,
    cfg: ServerConfig,
    reads: Option<Arc<TimedReader>>,
}

/// Where a prefill chunk's reads were started: request and position.
type Started = Option<(usize, usize)>;

/// A request in flight.
struct Live {
    req: usize,
    id: SeqId,
    pos: usize,
    seg: usize,
}

/// The mutable state of one run.
struct Run<'a> {
    w: Workload<'a>,
    waiting: VecDeque<usize>,
    prefilling: VecDeque<Live>,
    decoding: VecDeque<Live>,
    attempts: Vec<u32>,
    report: ServerReport,
}

impl<S: Site> Server<S> {
    /// A server over `engine`. Refused when a setting is 0, a backbone is
    /// asked for (see [`Server::build`]) or decode graphs are asked of sites
    /// that cannot replay them.
    pub fn new(engine: Engine<S>, cfg: ServerConfig) -> Result<Self, ServerError> {
        if cfg.backbone.is_some() {
            return Err(ServerError::Config(
                "a backbone wraps the sites: build the server with Server::build".into(),
            ));
        }
        Self::over(engine, cfg)
    }

    fn over(mut engine: Engine<S>, cfg: ServerConfig) -> Result<Self, ServerError> {
        if cfg.in_flight == 0 || cfg.prefill_chunk == 0 || cfg.decode_batch == 0 {
            return Err(ServerError::Config(format!(
                "in_flight ({}), prefill_chunk ({}) and decode_batch ({}) must be positive",
                cfg.in_flight, cfg.prefill_chunk, cfg.decode_batch
            )));
        }
        if cfg.decode_graphs {
            engine.enable_decode_graphs()?;
        }
        Ok(Server {
            engine,
            cfg,
            reads: None,
        })
    }

    /// Report the time spent in `reader`'s reads (the tables' reader) as
    /// [`ServerReport::read_time`].
    pub fn time_reads(&mut self, reader: Arc<TimedReader>) {
        self.reads = Some(reader);
    }

    /// The engine.
    pub fn engine(&self) -> &Engine<S> {
        &self.engine
    }

    /// The engine, to attach a carry store or change its settings.
    pub fn engine_mut(&mut self) -> &mut Engine<S> {
        &mut self.engine
    }

    /// The settings.
    pub fn config(&self) -> &ServerConfig {
        &self.cfg
    }

    /// The engine back, to close it or look at its sites.
    pub fn into_engine(self) -> Engine<S> {
        self.engine
    }

    /// Run `w` to the end. `done(request)` is called once for each request
    /// that finished or was given up. Every sequence the run added is
    /// released when it returns `Ok`.
    pub fn run(
        &mut self,
        w: Workload<'_>,
        done: &mut dyn FnMut(usize),
    ) -> Result<ServerReport, ServerError> {
        for (i, r) in w.requests.iter().enumerate() {
            check_request(i, r)?;
        }
        let mut run = Run {
            w,
            waiting: (0..w.requests.len()).collect(),
            prefilling: VecDeque::new(),
            decoding: VecDeque::new(),
            attempts: vec![0; w.requests.len()],
            report: ServerReport {
                rows: w
                    .requests
                    .iter()
                    .map(|r| vec![None; r.tokens.len()])
                    .collect(),
                ..ServerReport::default()
            },
        };
        let width = self.engine.width();
        let mut highway = vec![0f32; self.cfg.prefill_chunk.max(self.cfg.decode_batch) * width];
        let table_before = self.engine.table_stats();
        let reads_before = self.reads.as_ref().map(|r| r.elapsed());
        let start = Instant::now();
        loop {
            self.admit(&mut run, done)?;
            if run.prefilling.is_empty() && run.decoding.is_empty() {
                break;
            }
            let lives = self.pick_decode(&mut run)?;
            // The step's tokens are known: start every read it will make,
            // then those of the next step's decode batch.
            let (mut started, mut plan): (Started, _) = (None, None);
            if self.cfg.prefetch {
                (started, plan) = self.prefetch_step(&run, &lives, true, true)?;
            }
            if !self.decode_step(&mut run, lives, &mut highway, plan.as_ref(), done)? {
                // A failed step starts the next round: admission refills
                // the places of the sequences it released.
                continue;
            }
            // A prompt that became due during the decode step (a turn
            // after generated tokens) starts its reads now.
            if self.cfg.prefetch && started != self.prefill_due(&run) {
                plan = self.prefetch_step(&run, &[], true, false)?.1;
            }
            self.prefill_step(&mut run, &mut highway, plan.as_ref(), done)?;
        }
        run.report.wall = start.elapsed();
        run.report.stats = self.engine.stats();
        run.report.table = self.engine.table_stats().since(&table_before);
        run.report.io_wait = Duration::from_nanos(run.report.table.io_wait_ns);
        run.report.read_time = self
            .reads
            .as_ref()
            .zip(reads_before)
            .map(|(r, b)| r.elapsed().saturating_sub(b));
        Ok(run.report)
    }

    /// The request and position of the prefill chunk due next, if any.
    fn prefill_due(&self, run: &Run<'_>) -> Started {
        run.prefilling.front().map(|l| (l.req, l.pos))
    }

    /// Plan the step and start its row reads: `lives`' decode tokens and,
    /// with `prefill`, the prefill chunk due next, in one plan for every
    /// site ([`Engine::plan`]), which the step's decode and prefill then
    /// run; with `ahead` and [`ServerConfig::prefetch_ahead`], also plan
    /// and read the next step's decode batch (the first `decode_batch`
    /// sequences waiting to decode; a guess, since swaps may reorder them,
    /// and advice either way), whose plan is dropped once its reads are
    /// queued. Returns the chunk it covered and the step's plan.
    #[allow(clippy::type_complexity)]
    fn prefetch_step(
        &self,
        run: &Run<'_>,
        lives: &[Live],
        prefill: bool,
        ahead: bool,
    ) -> Result<(Started, Option<StepPlans<S::Plan>>), ServerError> {
        let reqs = run.w.requests;
        let peek = if ahead && self.cfg.prefetch_ahead {
            self.cfg.decode_batch.min(run.decoding.len())
        } else {
            0
        };
        // A decode token's entry: the sequence and its next token.
        let entry = |l: &Live| (l.id, &reqs[l.req].tokens[l.pos..l.pos + 1]);
        let mut work: Vec<(SeqId, &[u32])> = lives.iter().map(entry).collect();
        let later: Vec<(SeqId, &[u32])> = run.decoding.iter().take(peek).map(entry).collect();
        let mut started = None;
        if prefill && let Some(l) = run.prefilling.front() {
            let r = &reqs[l.req];
            let n = (r.segments[l.seg].1 - l.pos).min(self.cfg.prefill_chunk);
            work.push((l.id, &r.tokens[l.pos..l.pos + n]));
            started = Some((l.req, l.pos));
        }
        let mut plan = None;
        if !work.is_empty() {
            let p = self.engine.plan(&work)?;
            self.engine.prefetch_plan(&p)?;
            plan = Some(p);
        }
        if !later.is_empty() {
            self.engine.prefetch_plan(&self.engine.plan(&later)?)?;
        }
        Ok((started, plan))
    }

    /// Admit waiting requests up to `in_flight`.
    fn admit(&mut self, run: &mut Run<'_>, done: &mut dyn FnMut(usize)) -> Result<(), ServerError> {
        while run.prefilling.len() + run.decoding.len() < self.cfg.in_flight {
            let Some(p) = run.waiting.pop_front() else {
                break;
            };
            let req = &run.w.requests[p];
            let prompt_end = req.segments[0].1;
            let t0 = Instant::now();
            let added = self
                .engine
                .add_sequence(&req.tokens[..prompt_end])
                .map_err(|source| ServerError::Add { request: p, source })?;
            run.report.prefill_time += t0.elapsed();
            let l = Live {
                req: p,
                id: added.id,
                pos: added.cached,
                seg: 0,
            };
            self.advance(run, l, done)?;
        }
        Ok(())
    }

    /// The sequences of the next decode step, resident carries first (as a
    /// server schedules running sequences before swapped ones); the rest
    /// keep their order.
    fn pick_decode(&mut self, run: &mut Run<'_>) -> Result<Vec<Live>, ServerError> {
        let n = run.decoding.len().min(self.cfg.decode_batch);
        let mut lives = Vec::with_capacity(n);
        if n == 0 {
            return Ok(lives);
        }
        let mut rest = VecDeque::with_capacity(run.decoding.len());
        for l in run.decoding.drain(..) {
            if lives.len() < n && self.engine.is_resident(l.id)? {
                lives.push(l);
            } else {
                rest.push_back(l);
            }
        }
        while lives.len() < n {
            let Some(l) = rest.pop_front() else { break };
            lives.push(l);
        }
        run.decoding = rest;
        Ok(lives)
    }

    /// One batched decode step over `lives` (from [`Self::pick_decode`]).
    /// `false` when the step failed and its sequences were queued again.
    fn decode_step(
        &mut self,
        run: &mut Run<'_>,
        lives: Vec<Live>,
        highway: &mut [f32],
        plan: Option<&StepPlans<S::Plan>>,
        done: &mut dyn FnMut(usize),
    ) -> Result<bool, ServerError> {
        let n = lives.len();
        if n == 0 {
            return Ok(true);
        }
        let width = self.engine.width();
        let batch: Vec<(SeqId, u32)> = lives
            .iter()
            .map(|l| (l.id, run.w.requests[l.req].tokens[l.pos]))
            .collect();
        let rows = &mut highway[..n * width];
        for (b, &(_, t)) in batch.iter().enumerate() {
            (run.w.rows)(t, &mut rows[b * width..(b + 1) * width]);
        }
        let t0 = Instant::now();
        let r = match plan {
            Some(p) => self.engine.decode_planned(&batch, p, &mut *rows),
            None => self.engine.decode(&batch, &mut *rows),
        };
        run.report.decode_time += t0.elapsed();
        if let Err(source) = r {
            self.lose(run, lives, ServerError::Decode { source }, done)?;
            return Ok(false);
        }
        for (b, mut l) in lives.into_iter().enumerate() {
            run.report.rows[l.req][l.pos] = Some(fingerprint(&rows[b * width..(b + 1) * width]));
            l.pos += 1;
            self.advance(run, l, done)?;
        }
        Ok(true)
    }

    /// One prefill chunk; the same request goes on next step, so its prompt
    /// finishes before the next one starts.
    fn prefill_step(
        &mut self,
        run: &mut Run<'_>,
        highway: &mut [f32],
        plan: Option<&StepPlans<S::Plan>>,
        done: &mut dyn FnMut(usize),
    ) -> Result<(), ServerError> {
        let Some(mut l) = run.prefilling.pop_front() else {
            return Ok(());
        };
        let width = self.engine.width();
        let req = &run.w.requests[l.req];
        let end = req.segments[l.seg].1;
        let n = (end - l.pos).min(self.cfg.prefill_chunk);
        let toks = &req.tokens[l.pos..l.pos + n];
        let rows = &mut highway[..n * width];
        for (i, &t) in toks.iter().enumerate() {
            (run.w.rows)(t, &mut rows[i * width..(i + 1) * width]);
        }
        let t0 = Instant::now();
        let r = match plan {
            Some(p) => self.engine.prefill_planned(l.id, toks, p, &mut *rows),
            None => self.engine.prefill(l.id, toks, &mut *rows),
        };
        run.report.prefill_time += t0.elapsed();
        if let Err(source) = r {
            let e = ServerError::Prefill {
                request: l.req,
                source,
            };
            return self.lose(run, vec![l], e, done);
        }
        for i in 0..n {
            run.report.rows[l.req][l.pos + i] =
                Some(fingerprint(&rows[i * width..(i + 1) * width]));
        }
        l.pos += n;
        if l.pos < end {
            run.prefilling.push_front(l);
            Ok(())
        } else {
            self.advance(run, l, done)
        }
    }

    /// A call failed: its sequences are lost (the engine refuses them until
    /// released). Release them, forget their rows and queue them to run
    /// again from the start, or give up; without retries, stop.
    fn lose(
        &mut self,
        run: &mut Run<'_>,
        lives: Vec<Live>,
        err: ServerError,
        done: &mut dyn FnMut(usize),
    ) -> Result<(), ServerError> {
        let Some(retries) = self.cfg.retries else {
            return Err(err);
        };
        run.report.failed_calls += 1;
        run.report
            .first_fault
            .get_or_insert_with(|| crate::engine::error_chain(&err));
        for l in lives {
            self.engine.release(l.id)?;
            run.report.rows[l.req].iter_mut().for_each(|r| *r = None);
            run.attempts[l.req] += 1;
            if run.attempts[l.req] <= retries {
                run.report.retried += 1;
                run.waiting.push_front(l.req);
            } else {
                run.report.failed.push(l.req);
                done(l.req);
            }
        }
        Ok(())
    }

    /// Move `l` on to its next segment, or release it when it is done.
    fn advance(
        &mut self,
        run: &mut Run<'_>,
        mut l: Live,
        done: &mut dyn FnMut(usize),
    ) -> Result<(), ServerError> {
        let segs = &run.w.requests[l.req].segments;
        while l.seg < segs.len() && l.pos >= segs[l.seg].1 {
            l.seg += 1;
        }
        match segs.get(l.seg) {
            None => {
                self.engine.release(l.id)?;
                done(l.req);
            }
            Some((Phase::Prefill, _)) => run.prefilling.push_back(l),
            Some((Phase::Decode, _)) => run.decoding.push_back(l),
        }
        Ok(())
    }
}

impl<S: Site> Server<Layered<S>> {
    /// An engine over `sites` on `gpu`, each wrapped with the blocks of
    /// `cfg.backbone` (none when it is `None`), and a server over it. On an
    /// error every site is freed.
    pub fn build(
        gpu: Arc<dyn GpuBackend>,
        sites: Vec<S>,
        engine: EngineConfig,
        cfg: ServerConfig,
    ) -> Result<Self, ServerError> {
        let rows = engine
            .prefill_chunk
            .max(cfg.decode_batch)
            .max(cfg.prefill_chunk);
        let sites = layered(gpu.as_ref(), sites, cfg.backbone.as_ref(), rows)?;
        let engine = Engine::new(gpu, sites, engine)?;
        Self::over(engine, cfg)
    }
}

/// Segments must start with a prefill, end at the last token and not go
/// back; a decode segment needs a token before it.
fn check_request(i: usize, r: &Request) -> Result<(), ServerError> {
    let bad = |reason: String| Err(ServerError::Request { request: i, reason });
    match r.segments.first() {
        Some((Phase::Prefill, end)) if *end >= 1 => {}
        _ => return bad("the first segment must be a prefill of at least one token".into()),
    }
    let mut prev = 0;
    for &(_, end) in &r.segments {
        if end < prev || end > r.tokens.len() {
            return bad(format!(
                "segment end {end} is out of order or past the {} tokens",
                r.tokens.len()
            ));
        }
        prev = end;
    }
    if prev != r.tokens.len() {
        return bad(format!(
            "the segments end at {prev}, the request has {} tokens",
            r.tokens.len()
        ));
    }
    Ok(())
}
