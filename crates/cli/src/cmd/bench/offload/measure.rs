//! Measuring the tables of a run: the resident baseline (the whole table,
//! or its first shards with every id folded onto them), every prefetch and
//! backbone setting of the chosen tables, and each setting's tables
//! measured in turns against the resident one.
//!
//! Invariant: the tables of one setting are open together and measured
//! repetition by repetition, table after table, so that a shared
//! machine's drift slows them alike; an overhead is a median over rounds of
//! the ratio to the resident repetition of the same round.

use super::*;

/// Figures of one configuration before the resident comparison.
pub(super) struct Measured {
    /// See [`Config::rss_open`].
    pub(super) rss_open: Option<u64>,
    pub(super) tokens_per_s: f64,
    /// Tokens/s of each repetition, in order.
    pub(super) rates: Vec<f64>,
    pub(super) hit_rate: Option<f64>,
    pub(super) bytes_per_token: Option<f64>,
    pub(super) io_wait_share: Option<f64>,
    pub(super) read_share: Option<f64>,
    pub(super) exposed_wait_share: Option<f64>,
    pub(super) read_per_missed: Option<f64>,
    pub(super) phases: Phases,
    /// The row cache's fill (cached tables).
    pub(super) fill: Option<Filled>,
    /// Whether this configuration's streams read documents twice.
    pub(super) reread: bool,
}

/// What one setting of the tables shares: sizes, tokens, cache and
/// backbone.
pub(super) struct Setting<'a> {
    pub(super) sizes: &'a Sizes,
    pub(super) source: &'a Source,
    pub(super) slots: usize,
    pub(super) prefetch: bool,
    pub(super) backbone: Option<&'a BackboneConfig>,
    pub(super) tuning: &'a CacheOptions,
    pub(super) depth: usize,
    /// The tier the `remote` table reads its misses from.
    pub(super) remote: Option<&'a super::remote::Tier>,
    /// The rows the resident table serves.
    pub(super) fold: &'a ResidentFold,
}

/// Which tables a run measures, and the resident table's rows.
pub(super) struct Choice {
    pub(super) bases: Vec<Base>,
    pub(super) resident_rows: Option<u64>,
}

/// The rows the resident baseline holds of each site: the whole table, or
/// its first shards with every id folded onto them.
pub(super) struct ResidentFold {
    /// Rows held per site (of the first site, for the report).
    pub(super) rows: u64,
    /// Shards held of each site; `None`: all of them, unfolded.
    pub(super) shards: Vec<Option<usize>>,
}

/// What the resident baseline holds: `rows` of the `stored` rows of
/// `row_bytes` each (the whole table, or its first rows with every id
/// folded onto them).
pub(super) fn baseline_line(rows: u64, stored: u64, row_bytes: u64) -> String {
    if rows >= stored {
        format!(
            "resident baseline: the whole table ({stored} rows, {})",
            bytes(stored * row_bytes)
        )
    } else {
        format!(
            "resident baseline: the first {rows} of {stored} stored rows ({}), every id folded \
             onto them: the same rows per token, compute and token stream as the other tables, \
             other rows' values",
            bytes(rows * row_bytes)
        )
    }
}

/// The resident baseline's rows: `rows` when given (whole shards, at
/// least one), else the whole table when it takes at most half the memory
/// available, else the shards that fit in a quarter of it.
pub(super) fn resident_fold(ck: &Checkpoint, rows: Option<u64>) -> Result<ResidentFold> {
    let total: u64 = ck.sites.iter().map(|s| s.table.bytes).sum();
    // Bytes a site may hold when the whole table would not fit.
    let budget = memory::available_bytes()
        .filter(|&a| rows.is_none() && total > a / 2)
        .map(|a| a / 4 / ck.sites.len() as u64);
    let mut shards = Vec::with_capacity(ck.sites.len());
    let mut first = None;
    for s in &ck.sites {
        let t = &s.table;
        ensure!(
            t.sub_tables.is_empty() && t.release.is_none(),
            "bench offload serves the flagship's tables; this site's is not one table of equal \
             shards"
        );
        let row_bytes = t.bytes / t.stored_rows.max(1);
        let want = rows.or(budget.map(|b| b / row_bytes.max(1)));
        let keep = want
            .map(|w| (w / t.rows_per_shard).clamp(1, t.shards.len() as u64) as usize)
            .filter(|&k| k < t.shards.len());
        first.get_or_insert(keep.map_or(t.stored_rows, |k| k as u64 * t.rows_per_shard));
        shards.push(keep);
    }
    Ok(ResidentFold {
        rows: first.unwrap_or(0),
        shards,
    })
}

/// The resident sites of `fold`: each site's first shards loaded, every
/// id folded onto them.
pub(super) fn folded_resident_sites(
    ck: &Checkpoint,
    gpu: &Arc<dyn GpuBackend>,
    fold: &ResidentFold,
    max_tokens: usize,
) -> Result<Vec<PleSite>> {
    let mut sites = Vec::with_capacity(ck.sites.len());
    for (i, s) in ck.sites.iter().enumerate() {
        let t = &s.table;
        let table: Arc<dyn RowTable> = match fold.shards[i] {
            None => ck.open_table(i, TableMode::Resident, gpu.clone())?,
            Some(k) => {
                let part = TablePart {
                    shards: t.shards[..k].to_vec(),
                    stored_rows: k as u64 * t.rows_per_shard,
                    logical_rows: s.padded_rows,
                    remap: None,
                };
                metrale_storage::open(
                    &TableSpec {
                        parts: vec![part],
                        mode: TableMode::Resident,
                        cache: CacheConfig::default(),
                    },
                    gpu.clone(),
                )?
            }
        };
        sites.push(PleSite::new(ck.build_layer(
            i,
            table,
            max_tokens,
            gpu.as_ref(),
        )?));
    }
    Ok(sites)
}

/// Every shard file of `ck`'s tables.
pub(super) fn table_paths(ck: &Checkpoint) -> Vec<PathBuf> {
    let mut v: Vec<PathBuf> = ck
        .sites
        .iter()
        .flat_map(|s| s.table.shards.iter().map(|src| src.path.clone()))
        .collect();
    v.sort();
    v.dedup();
    v
}

/// The sites' waits for rows not covered by the blocks before them.
pub(super) fn exposed(e: &Served) -> Duration {
    e.sites().iter().map(|s| s.wait_split().exposed).sum()
}

#[allow(clippy::too_many_arguments)]
pub(super) fn measure_all(
    ck: &Checkpoint,
    choice: &Choice,
    packed: Option<&Checkpoint>,
    padded: Option<&Checkpoint>,
    sizes: &Sizes,
    source: &Source,
    scale: usize,
    backbones: &[bool],
    tuning: &CacheOptions,
    depth: usize,
    remote: Option<&super::remote::Tier>,
) -> Result<Report> {
    let site = &ck.sites[0];
    let stored = site.table.stored_rows;
    let row_bytes = site.table.head_dim as u64 * 2;
    // The table must be at least 8x the cache.
    let slots = sizes.slots.min((stored / 8) as usize).max(1);
    ensure!(
        site.table.dtype == metrale_storage::table::RowDType::Bf16,
        "bench offload reads BF16 tables; this checkpoint's is FP8"
    );
    eprintln!(
        "bench offload: {} run, {} sites, {} table rows ({}) per site, a row cache of {} slots \
         ({}), {} sequences",
        sizes.name,
        ck.sites.len(),
        stored,
        bytes(site.table.bytes),
        slots,
        bytes(slots as u64 * row_bytes),
        sizes.sequences
    );
    let disk = disk_ceiling(&site.table.shards[0].path, sizes.ceiling)
        .context("measuring the disk's random reads")?;
    eprintln!(
        "bench offload: {}",
        disk_line(
            disk.reads_per_s,
            &disk.reader,
            disk.direct,
            disk.round.as_secs_f64() * 1e6,
            disk.read_cpu_us
        )
    );
    let fold = resident_fold(ck, choice.resident_rows)?;
    if choice.bases.contains(&Base::Resident) {
        eprintln!(
            "bench offload: {}",
            baseline_line(fold.rows, stored, row_bytes)
        );
    }
    let mut tables: Vec<(&'static str, TableMode, &Checkpoint)> = choice
        .bases
        .iter()
        .map(|b| match b {
            Base::Resident => ("resident", TableMode::Resident, ck),
            Base::Mapped => ("mapped", TableMode::Mapped, ck),
            Base::Cached => ("cached", TableMode::Cached, ck),
        })
        .collect();
    if let Some(p) = packed {
        tables.push(("packed", TableMode::Cached, p));
    }
    if let Some(p) = padded {
        tables.push(("padded", TableMode::Cached, p));
    }
    if remote.is_some() {
        tables.push(("remote", TableMode::Cached, ck));
    }
    let mut rows = Vec::new();
    let mut reread = false;
    for &backbone in backbones {
        let bb = backbone.then(|| BackboneConfig::for_model(&ck.spec, scale));
        for prefetch in [false, true] {
            let setting = Setting {
                sizes,
                source,
                slots,
                prefetch,
                backbone: bb.as_ref(),
                tuning,
                depth,
                remote,
                fold: &fold,
            };
            let group = measure_group(&setting, &tables)
                .with_context(|| format!("prefetch {prefetch}, backbone {backbone}"))?;
            for (name, m, overhead) in group {
                reread |= m.reread;
                let (overhead, ci) = overhead.unzip();
                rows.push(OffloadRow {
                    table: name,
                    prefetch,
                    backbone,
                    decode_tokens_per_s: m.tokens_per_s,
                    overhead_vs_resident_pct: overhead,
                    overhead_ci95_pct: ci.flatten(),
                    hit_rate: m.hit_rate,
                    bytes_read_per_token: m.bytes_per_token,
                    io_wait_share: m.io_wait_share,
                    read_share: m.read_share,
                    exposed_wait_share: m.exposed_wait_share,
                    read_bytes_per_missed_row_byte: m.read_per_missed,
                    fill_tokens: m.fill.as_ref().map(|f| f.tokens),
                    fill_hit_rate: m.fill.as_ref().and_then(|f| f.hit_rates.last().copied()),
                    phases: m.phases,
                    rss_open_bytes: m.rss_open,
                });
            }
        }
    }
    Ok(Report {
        run: sizes.name,
        preset: Preset::Flagship.name(),
        checkpoint: ck.dir.display().to_string(),
        table_rows: stored,
        table_bytes: ck.table_bytes(),
        cache_slots: slots,
        cache_bytes: slots as u64 * row_bytes,
        sequences: sizes.sequences,
        micro_batches: sizes.micro_batches,
        measured_steps: sizes.measure,
        measured_reps: sizes.reps,
        disk_reader: disk.reader,
        disk_direct: disk.direct,
        disk_random_reads_per_s: disk.reads_per_s,
        disk_random_read_bytes_per_s: disk.reads_per_s * 4096.0,
        disk_round_us: disk.round.as_secs_f64() * 1e6,
        disk_read_cpu_us: disk.read_cpu_us,
        backbone_scale: scale,
        backbone_layers: ck.spec.num_hidden_layers,
        cache_policy: tuning.policy.unwrap_or(DEFAULT_POLICY).name(),
        host_rows: tuning.host_rows,
        read_depth: depth,
        workload: String::new(),
        corpus_documents: source.documents(),
        corpus_reread: reread,
        remote: None,
        resident_rows: choice.bases.contains(&Base::Resident).then_some(fold.rows),
        memory: None,
        rows,
    })
}

/// The overhead of one table against the resident one, per cent: the
/// median over repetitions of the ratio to the resident table's repetition
/// next to it, with [`median_ci95`] of those ratios.
pub(super) type Overhead = (f64, Option<[f64; 2]>);

/// Measure the tables of one setting: each opened and warmed up, then
/// measured in turns (a repetition of each, in table order, `reps` times),
/// so that a machine whose speed drifts slows every table alike; the
/// overhead is the median over repetitions of the ratio to the resident
/// table's repetition next to it.
pub(super) fn measure_group(
    set: &Setting<'_>,
    tables: &[(&'static str, TableMode, &Checkpoint)],
) -> Result<Vec<(&'static str, Measured, Option<Overhead>)>> {
    let sizes = set.sizes;
    let mut configs = Vec::with_capacity(tables.len());
    for &(name, mode, ck) in tables {
        let c = Config::open(name, ck, mode, set)
            .with_context(|| format!("opening the {name} table"))?;
        configs.push((name, c));
    }
    for _ in 0..sizes.reps.max(1) {
        for (name, c) in &mut configs {
            c.rep(sizes)
                .with_context(|| format!("measuring the {name} table"))?;
        }
    }
    let mut out = Vec::with_capacity(configs.len());
    let mut resident: Option<Vec<f64>> = None;
    for (name, c) in configs {
        let m = c.finish(sizes)?;
        if name == "resident" {
            resident = Some(m.rates.clone());
        }
        let overhead = resident.as_ref().map(|r| {
            let per_rep: Vec<f64> = r
                .iter()
                .zip(&m.rates)
                .map(|(r, t)| (r / t - 1.0) * 100.0)
                .collect();
            (median(per_rep.clone()), median_ci95(&per_rep))
        });
        out.push((name, m, overhead));
    }
    Ok(out)
}
