//! One table configuration under measurement: its engine (sites built
//! through the command's `run` helpers, with or without the backbone),
//! its warmed-up workload, and the figures of its repetitions.
//!
//! Invariant: a configuration is opened, filled and warmed up before any
//! repetition is measured, and each repetition starts after one
//! unmeasured step whose reads ahead the first measured step finds.

use super::*;

/// One configuration under measurement: its engine, workload and counters.
pub(super) struct Config {
    /// The process's RSS grown while this table was opened, filled and
    /// warmed up.
    pub(super) rss_open: Option<u64>,
    pub(super) label: String,
    pub(super) cached: bool,
    pub(super) engine: Served,
    pub(super) w: Workload,
    pub(super) timed: Option<Arc<TimedReader>>,
    /// Row lookups of one step (every site, every sequence).
    pub(super) per_step: u64,
    /// Tokens/s of each repetition.
    pub(super) rates: Vec<f64>,
    pub(super) wall: f64,
    pub(super) stats: TableStats,
    pub(super) read: Duration,
    pub(super) exposed: Duration,
    pub(super) io_bytes: Option<u64>,
    /// The phases' totals over the measured repetitions.
    pub(super) spent: Counters,
    /// Bytes of one row.
    pub(super) row_bytes: u64,
    /// The row cache's fill (cached tables).
    pub(super) filled: Option<Filled>,
}

impl Config {
    /// A fresh engine over `mode`, its row cache filled to its steady
    /// state ([`fill`]), its sequences prefilled and then warmed up by
    /// decode windows until the hit rate settles (one window for tables
    /// without a cache, which only fault pages in).
    pub(super) fn open(
        name: &str,
        ck: &Checkpoint,
        mode: TableMode,
        set: &Setting<'_>,
    ) -> Result<Config> {
        let Setting {
            sizes,
            source,
            slots,
            prefetch,
            backbone,
            tuning,
            depth,
            remote,
            fold: _,
        } = *set;
        let gpu: Arc<dyn GpuBackend> = Arc::new(CpuBackend::new());
        let setup = EngineSetup {
            mode,
            slots,
            faults: None,
            engine: EngineConfig {
                prefill_chunk: sizes.prompt,
                prefix_cache_bytes: 0,
                ..Default::default()
            },
            resident_carries: 0,
        };
        let t_open = Instant::now();
        let rows = sizes.sequences.max(sizes.prompt);
        let cached = mode == TableMode::Cached;
        // The remote table reads no disk: no timed reader, so its read
        // share is left out rather than shown as nothing.
        let remote = remote.filter(|_| name == "remote");
        let timed = if cached && remote.is_none() {
            Some(Arc::new(TimedReader::new(default_reader(depth)?)))
        } else {
            None
        };
        let cache = CacheOptions {
            reader: timed.clone().map(|t| t as Arc<dyn PageReader>),
            remote: remote.map(|t| t.clone() as Arc<dyn RemoteTier>),
            ..tuning.clone()
        };
        let rss0 = memory::rss_bytes();
        let sites = if mode == TableMode::Resident {
            folded_resident_sites(ck, &gpu, set.fold, rows)?
        } else {
            build_sites(ck, &gpu, &setup, rows, &cache)?
        };
        let cfg = engine_config(&setup, &sites);
        let sites = layered(gpu.as_ref(), sites, backbone, rows)?;
        let mut e = Engine::new(gpu.clone(), sites, cfg)?;
        let opened = t_open.elapsed();
        let label = format!(
            "{name} table, prefetch {}, backbone {}",
            if prefetch { "on" } else { "off" },
            if backbone.is_some() { "on" } else { "off" }
        );
        let filled = if cached {
            let f = fill(&e, gpu.as_ref(), source, slots, sizes.fill_windows)?;
            let rates: Vec<String> = f
                .hit_rates
                .iter()
                .map(|h| format!("{:.1}%", h * 100.0))
                .collect();
            eprintln!(
                "bench offload: {label}: cache filled with {} tokens of the stream in {:.1} s; hit \
                 rates [{}]{}",
                f.tokens,
                f.secs,
                rates.join(", "),
                if f.settled {
                    ""
                } else {
                    " (not settled; measured anyway)"
                }
            );
            Some(f)
        } else {
            None
        };
        let mut w = Workload::new(&mut e, source, sizes, prefetch)?;
        // Every decode token looks up `ngram_heads` rows at every site.
        let per_token: usize = e.geometries().iter().map(|g| g.dims.ngram_heads()).sum();
        let per_step = (per_token * sizes.sequences) as u64;
        let mut trace = Vec::new();
        let mut settled = false;
        for _ in 0..sizes.max_windows {
            let before = e.table_stats();
            for _ in 0..sizes.window {
                w.step(&mut e, true)?;
            }
            if !cached {
                settled = true;
                break;
            }
            let s = e.table_stats().since(&before);
            let hr = hit_rate(&s, per_step * sizes.window as u64).unwrap_or(0.0);
            let prev = trace.last().copied();
            trace.push(hr);
            if prev.is_some_and(|p: f64| (hr - p).abs() < SETTLED) {
                settled = true;
                break;
            }
        }
        let trace_text: Vec<String> = trace.iter().map(|h| format!("{:.1}%", h * 100.0)).collect();
        eprintln!(
            "bench offload: {label}: opened in {:.2} s; warm-up hit rates [{}]{}",
            opened.as_secs_f64(),
            trace_text.join(", "),
            if settled {
                ""
            } else {
                " (not settled; measured anyway)"
            }
        );
        let rss_open = memory::rss_bytes()
            .zip(rss0)
            .map(|(a, b)| a.saturating_sub(b));
        Ok(Config {
            rss_open,
            label,
            cached,
            engine: e,
            w,
            timed,
            per_step,
            rates: Vec::new(),
            wall: 0.0,
            stats: TableStats::default(),
            read: Duration::ZERO,
            exposed: Duration::ZERO,
            io_bytes: Some(0),
            spent: Counters {
                cpu: Some((0, 0)),
                ..Counters::default()
            },
            row_bytes: ck.sites[0].table.head_dim as u64 * 2,
            filled,
        })
    }

    /// One measured repetition: a step not measured, then `sizes.measure`
    /// steps, their counters added to the configuration's.
    pub(super) fn rep(&mut self, sizes: &Sizes) -> Result<()> {
        // A step not measured first: the other tables' turns broke the
        // stream, and in a server each step's reads were started by the
        // step before (with micro-batches, by each group's decode before).
        self.w.step(&mut self.engine, false)?;
        let stats0 = self.engine.table_stats();
        let read0 = self.timed.as_ref().map(|t| t.elapsed());
        let exposed0 = exposed(&self.engine);
        let io0 = process_read_bytes();
        let c0 = Counters::now(&self.engine, &self.w);
        let t0 = Instant::now();
        for i in 0..sizes.measure {
            self.w.step(&mut self.engine, i + 1 == sizes.measure)?;
        }
        let dt = t0.elapsed().as_secs_f64().max(1e-9);
        Counters::now(&self.engine, &self.w).add_since(&c0, &mut self.spent);
        let io1 = process_read_bytes();
        self.wall += dt;
        self.rates
            .push((sizes.measure * sizes.sequences) as f64 / dt);
        self.stats = self.stats + self.engine.table_stats().since(&stats0);
        self.exposed += exposed(&self.engine).saturating_sub(exposed0);
        if let (Some(a), Some(b)) = (read0, self.timed.as_ref().map(|t| t.elapsed())) {
            self.read += b.saturating_sub(a);
        }
        self.io_bytes = match (self.io_bytes, io0.zip(io1)) {
            (Some(acc), Some((a, b))) => Some(acc + b.saturating_sub(a)),
            _ => None,
        };
        Ok(())
    }

    /// The figures over every repetition; closes the engine.
    pub(super) fn finish(self, sizes: &Sizes) -> Result<Measured> {
        let steps = (sizes.measure * self.rates.len()) as u64;
        let tokens = (steps * sizes.sequences as u64) as f64;
        let s = self.stats;
        let bytes_read = if self.cached {
            Some(s.bytes_read)
        } else {
            self.io_bytes
        };
        let m = Measured {
            rss_open: self.rss_open,
            tokens_per_s: median(self.rates.clone()),
            rates: self.rates,
            hit_rate: if self.cached {
                hit_rate(&s, self.per_step * steps)
            } else {
                None
            },
            bytes_per_token: bytes_read.map(|b| b as f64 / tokens),
            io_wait_share: self.cached.then(|| s.io_wait_ns as f64 / 1e9 / self.wall),
            read_share: self
                .timed
                .is_some()
                .then(|| self.read.as_secs_f64() / self.wall),
            exposed_wait_share: self.cached.then(|| self.exposed.as_secs_f64() / self.wall),
            read_per_missed: (self.cached && s.misses > s.host_hits)
                .then(|| s.bytes_read as f64 / ((s.misses - s.host_hits) * self.row_bytes) as f64),
            reread: self.w.streams.reread() || self.filled.as_ref().is_some_and(|f| f.reread),
            fill: self.filled.clone(),
            phases: {
                let c = &self.spent;
                let us = |d: Duration| d.as_secs_f64() * 1e6 / tokens.max(1.0);
                let us_ns = |ns: u64| ns as f64 / 1e3 / tokens.max(1.0);
                Phases {
                    prefetch: us(c.prefetch),
                    prefetch_hash: us(c.hash),
                    decode: us(c.decode),
                    site_host: us(c.site_host.saturating_sub(c.io_wait)),
                    io_wait: us(c.io_wait),
                    prefetch_thread_cpu: c.cpu.filter(|_| self.cached).map(|(p, _)| us_ns(p)),
                    process_cpu: c.cpu.map(|(_, t)| us_ns(t)),
                }
            },
        };
        eprintln!(
            "bench offload: {}: {:.1} tokens/s (median of {} x {} steps; {:.2} s in all)",
            self.label,
            m.tokens_per_s,
            m.rates.len(),
            sizes.measure,
            self.wall
        );
        self.engine.close()?;
        Ok(m)
    }
}
