//! `run --carry-store`: prefix carries shared with other processes through
//! a store (`redis://HOST:PORT[/DB]` or `dir:PATH`), keyed by `--model-id`
//! (default: a digest of the checkpoint's `config.json`), and the summary
//! of what the store did: restores, misses by cause, writes, latencies, and
//! the time restores took against recomputing the same prefixes.

use std::fmt::Write as _;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result, anyhow};
use metrale_engine::store::key::sha256;
use metrale_engine::store::{CarryStore, CarryStoreStats, OpenOptions, TierConfig, open_store};
use metrale_engine::{Engine, Site};
use serde::Serialize;

use super::super::common::bytes;
use super::RunArgs;

/// An opened store and the model identity values are keyed by.
pub(super) struct StoreSetup {
    store: Arc<dyn CarryStore>,
    url: String,
    model_id: String,
    probes: usize,
}

/// The default model identity: `config-` and the first 16 hex digits of
/// the SHA-256 of the checkpoint's `config.json`.
pub(super) fn default_model_id(dir: &Path) -> Result<String> {
    let p = dir.join("config.json");
    let data = std::fs::read(&p).with_context(|| format!("reading {}", p.display()))?;
    let d = sha256(&data);
    Ok(format!(
        "config-{}",
        d[..8]
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect::<String>()
    ))
}

/// The store `a` asks for, if any.
pub(super) fn setup(a: &RunArgs, dir: &Path) -> Result<Option<StoreSetup>> {
    let Some(url) = &a.carry_store else {
        return Ok(None);
    };
    let opts = OpenOptions {
        connect_timeout: Duration::from_millis(a.store_timeout_ms.max(1)),
        io_timeout: Duration::from_millis(a.store_timeout_ms.max(1)),
        ..OpenOptions::default()
    };
    let store = open_store(url, &opts).map_err(|e| anyhow!("--carry-store: {e}"))?;
    let model_id = match &a.model_id {
        Some(m) => m.clone(),
        None => default_model_id(dir)?,
    };
    Ok(Some(StoreSetup {
        store,
        url: url.clone(),
        model_id,
        probes: a.store_probes,
    }))
}

impl StoreSetup {
    /// Put the store behind `engine`'s prefix cache.
    pub(super) fn attach<S: Site>(&self, engine: &mut Engine<S>) -> Result<()> {
        let mut cfg = TierConfig::new(self.model_id.clone());
        cfg.max_probes = self.probes;
        engine
            .attach_carry_store(self.store.clone(), cfg)
            .map_err(|e| anyhow!("attaching the carry store: {e}"))
    }
}

/// Misses by cause.
#[derive(Serialize)]
pub(super) struct Misses {
    absent: u64,
    corrupt: u64,
    geometry: u64,
    model: u64,
    error: u64,
}

/// What the store did in the run.
#[derive(Serialize)]
pub(super) struct StoreSummary {
    url: String,
    model_id: String,
    lookups: u64,
    restores: u64,
    tokens_restored: u64,
    bytes_restored: u64,
    misses: Misses,
    puts: u64,
    put_bytes: u64,
    put_errors: u64,
    drops: u64,
    errors: u64,
    skipped_while_down: u64,
    get_p50_ms: f64,
    get_p99_ms: f64,
    put_p50_ms: f64,
    put_p99_ms: f64,
    restore_seconds: f64,
    recompute_seconds_estimate: f64,
}

/// The summary of `s`; `prefill_per_token` (seconds) prices recomputing
/// the restored tokens.
pub(super) fn summary(
    setup: &StoreSetup,
    s: &CarryStoreStats,
    prefill_per_token: f64,
) -> StoreSummary {
    let ms = |us: u64| us as f64 / 1e3;
    StoreSummary {
        url: setup.url.clone(),
        model_id: setup.model_id.clone(),
        lookups: s.lookups,
        restores: s.hits,
        tokens_restored: s.tokens_restored,
        bytes_restored: s.bytes_restored,
        misses: Misses {
            absent: s.miss_absent,
            corrupt: s.miss_corrupt,
            geometry: s.miss_geometry,
            model: s.miss_model,
            error: s.miss_error,
        },
        puts: s.puts,
        put_bytes: s.put_bytes,
        put_errors: s.put_errors,
        drops: s.drops,
        errors: s.errors,
        skipped_while_down: s.skipped,
        get_p50_ms: ms(s.get_p50_us),
        get_p99_ms: ms(s.get_p99_us),
        put_p50_ms: ms(s.put_p50_us),
        put_p99_ms: ms(s.put_p99_us),
        restore_seconds: s.restore_ns as f64 / 1e9,
        recompute_seconds_estimate: s.tokens_restored as f64 * prefill_per_token,
    }
}

/// The summary's lines.
pub(super) fn render(s: &StoreSummary) -> String {
    let mut o = String::new();
    let _ = writeln!(o, "  carry store     {} (model {})", s.url, s.model_id);
    let _ = writeln!(
        o,
        "    restores      {} from the store, {} tokens, {} ({} lookups)",
        s.restores,
        s.tokens_restored,
        bytes(s.bytes_restored),
        s.lookups
    );
    let m = &s.misses;
    let _ = writeln!(
        o,
        "    misses        {} absent, {} corrupt, {} other geometry, {} other model, {} store errors",
        m.absent, m.corrupt, m.geometry, m.model, m.error
    );
    let _ = writeln!(
        o,
        "    writes        {} put ({}), {} dropped (queue full), {} failed; {} errors, {} calls skipped while down",
        s.puts,
        bytes(s.put_bytes),
        s.drops,
        s.put_errors,
        s.errors,
        s.skipped_while_down
    );
    let _ = writeln!(
        o,
        "    latency       get p50 {:.3} ms p99 {:.3} ms, put p50 {:.3} ms p99 {:.3} ms",
        s.get_p50_ms, s.get_p99_ms, s.put_p50_ms, s.put_p99_ms
    );
    if s.restores > 0 {
        let _ = writeln!(
            o,
            "    restore time  {:.4} s against about {:.4} s to recompute those prefixes",
            s.restore_seconds, s.recompute_seconds_estimate
        );
    }
    o
}
