//! The remote row tier from the command line: `table push` (load a
//! checkpoint's tables onto Redis-protocol servers) and the tier `run
//! --table remote` and `bench offload --remote` serve rows from
//! (`metrale_storage::remote`).
//!
//! A site's table is pushed as it is stored: one table, or LongCat's
//! sub-tables each on its own (each with its own digest), the rows as on
//! disk (after any `table pack` relaying; a served remap and folding sit
//! above the row cache and apply to remote rows alike).

use std::sync::Arc;

use anyhow::{Context, anyhow};
use clap::Args;
use indicatif::{ProgressBar, ProgressStyle};
use metrale_checkpoint::Checkpoint;
use metrale_storage::layout::TableFiles;
use metrale_storage::remote::push::{PushOptions, push_table};
use metrale_storage::remote::redis::{RedisTier, link_config, parse_urls};
use metrale_storage::remote::{RemoteStats, RemoteTier};
use serde::Serialize;

use super::common::bytes;
use super::run::checkpoint_dir;
use super::{CmdError, failure, input};

/// Arguments of `table push`.
#[derive(Args, Debug)]
pub struct PushArgs {
    /// The checkpoint directory. Default: the tiny checkpoint in the user's
    /// cache directory.
    pub dir: Option<std::path::PathBuf>,
    /// The servers, comma-separated, in the order every reader will list
    /// them (the order is part of the shard rule).
    #[arg(long, value_name = "redis://H:P[,redis://H:P...]", required = true)]
    pub to: String,
    /// Rows read and sent per round (each server's share as one pipeline).
    #[arg(long, default_value_t = 16_384, value_name = "ROWS")]
    pub chunk_rows: u64,
    /// Push every row again, even to servers whose manifest says their
    /// load is complete or partly done.
    #[arg(long)]
    pub restart: bool,
    /// Connect, read and write timeout of each server, in milliseconds.
    #[arg(long, default_value_t = 5000)]
    pub timeout_ms: u64,
    /// Stop after this many rows of each table, leaving a partial load (for
    /// tests of refusal and resuming).
    #[arg(long, hide = true)]
    pub stop_after: Option<u64>,
    /// Print the report as JSON on stdout.
    #[arg(long)]
    pub json: bool,
}

/// The tables of site `site` as stored (LongCat's sub-tables each alone).
pub(super) fn stored_tables(ck: &Checkpoint, site: usize) -> anyhow::Result<Vec<TableFiles>> {
    let s = &ck.sites[site];
    if s.table.release.is_some() {
        return Err(anyhow!(
            "layer {}: the table is stored as released; convert it with `metrale-ple table pack` \
             first",
            s.layer
        ));
    }
    let open = |shards: &[metrale_storage::layout::ShardSource], rows: u64| {
        TableFiles::open(shards, Some(rows))
            .with_context(|| format!("layer {}: opening the table shards", s.layer))
    };
    if s.table.sub_tables.is_empty() {
        return Ok(vec![open(&s.table.shards, s.table.stored_rows)?]);
    }
    s.table
        .sub_tables
        .iter()
        .enumerate()
        .map(|(i, sub)| open(&s.table.shards[i..=i], sub.stored_rows))
        .collect()
}

/// The tier over the comma-separated `urls`, each server with timeouts of
/// `timeout_ms`.
pub fn open_tier(urls: &str, timeout_ms: u64) -> Result<Arc<RedisTier>, CmdError> {
    let list = parse_urls(urls);
    if list.is_empty() {
        return Err(input(anyhow!("--remote/--to names no server")));
    }
    RedisTier::open(&list, link_config(timeout_ms))
        .map(Arc::new)
        .map_err(input)
}

/// Refuse a tier that does not hold a complete load of every table of
/// `ck` (each server's manifest checked, as the row caches will at open),
/// naming the server and what is wrong.
pub fn check_loaded(ck: &Checkpoint, tier: &dyn RemoteTier) -> anyhow::Result<()> {
    for s in 0..ck.sites.len() {
        for (part, files) in stored_tables(ck, s)?.iter().enumerate() {
            tier.open(files).with_context(|| {
                format!(
                    "the table of layer {} (part {part}) is not served by {}",
                    ck.sites[s].layer,
                    tier.describe()
                )
            })?;
        }
    }
    Ok(())
}

#[derive(Serialize)]
struct PushedTable {
    layer: usize,
    part: usize,
    digest: String,
    rows: u64,
    sent_rows: u64,
    sent_bytes: u64,
    already_complete_servers: usize,
    rows_per_server: Vec<u64>,
    complete: bool,
    seconds: f64,
}

/// Run `table push`.
pub fn push(a: PushArgs) -> Result<(), CmdError> {
    let dir = checkpoint_dir(&a.dir)?;
    let ck = Checkpoint::open(&dir).map_err(input)?;
    let tier = open_tier(&a.to, a.timeout_ms)?;
    let opts = PushOptions {
        chunk_rows: a.chunk_rows.max(1),
        restart: a.restart,
        stop_after: a.stop_after,
    };
    let mut tables = Vec::new();
    for s in 0..ck.sites.len() {
        for (part, files) in stored_tables(&ck, s)
            .map_err(input)?
            .into_iter()
            .enumerate()
        {
            tables.push((ck.sites[s].layer, part, files));
        }
    }
    let total: u64 = tables.iter().map(|t| t.2.info.rows).sum();
    let bar = if a.json {
        ProgressBar::hidden()
    } else {
        let pb = ProgressBar::new(total);
        pb.set_style(
            ProgressStyle::with_template(
                "{msg:>10} [{bar:40}] {pos}/{len} rows {per_sec} eta {eta}",
            )
            .expect("a valid template")
            .progress_chars("=> "),
        );
        pb.set_message("push");
        pb
    };
    let mut report = Vec::new();
    let mut base = 0;
    for (layer, part, files) in &tables {
        let r = push_table(&tier, files, &opts, &mut |done, _| {
            bar.set_position(base + done)
        })
        .with_context(|| format!("pushing the table of layer {layer} (part {part})"))
        .map_err(failure)?;
        base += files.info.rows;
        bar.set_position(base);
        report.push(PushedTable {
            layer: *layer,
            part: *part,
            digest: r.digest.hex(),
            rows: r.rows,
            sent_rows: r.sent_rows,
            sent_bytes: r.sent_bytes,
            already_complete_servers: r.already_complete,
            rows_per_server: r.rows_per_server,
            complete: r.complete,
            seconds: r.elapsed.as_secs_f64(),
        });
    }
    bar.finish_and_clear();
    if a.json {
        println!(
            "{}",
            serde_json::to_string_pretty(&report).map_err(failure)?
        );
    } else {
        println!(
            "metrale-ple table push: {} tables of {} to {}",
            report.len(),
            dir.display(),
            tier.describe()
        );
        for t in &report {
            println!(
                "  layer {:>3} part {} table {}  {} rows: {} sent ({}) in {:.2} s{}{}",
                t.layer,
                t.part,
                t.digest,
                t.rows,
                t.sent_rows,
                bytes(t.sent_bytes),
                t.seconds,
                if t.already_complete_servers > 0 {
                    format!(", {} servers already complete", t.already_complete_servers)
                } else {
                    String::new()
                },
                if t.complete { "" } else { "  PARTIAL" }
            );
        }
    }
    if report.iter().any(|t| !t.complete) && a.stop_after.is_none() {
        return Err(failure(anyhow!("some tables were not pushed completely")));
    }
    Ok(())
}

/// What `run` and `bench offload` report of a remote tier.
#[derive(Serialize, Clone, Debug)]
pub struct RemoteSummary {
    /// The servers.
    pub servers: String,
    /// Rows fetched.
    pub rows: u64,
    /// Batches fetched (one request per server touched each).
    pub batches: u64,
    /// Requests sent.
    pub requests: u64,
    /// Value bytes received.
    pub bytes: u64,
    /// Rows per second of batch wall time.
    pub rows_per_s: Option<f64>,
    /// Median batch wall time (µs).
    pub batch_p50_us: Option<f64>,
    /// 99th percentile batch wall time (µs).
    pub batch_p99_us: Option<f64>,
    /// CPU time on this host per row fetched (µs).
    pub cpu_us_per_row: Option<f64>,
    /// Batches that failed.
    pub failed_batches: u64,
    /// Values refused.
    pub bad_values: u64,
    /// Rows a server should have held and did not.
    pub missing_rows: u64,
    /// Rows of failed fetches read from the shard files instead.
    pub fallback_rows: u64,
}

impl RemoteSummary {
    /// The summary of `s`, fetched from `servers`.
    pub fn of(servers: String, s: &RemoteStats) -> RemoteSummary {
        let wall: u64 = s.batch_ns.iter().sum();
        RemoteSummary {
            servers,
            rows: s.rows,
            batches: s.batches,
            requests: s.requests,
            bytes: s.bytes,
            rows_per_s: (wall > 0).then(|| s.rows as f64 / (wall as f64 / 1e9)),
            batch_p50_us: s.batch_us(0.5),
            batch_p99_us: s.batch_us(0.99),
            cpu_us_per_row: (s.rows > 0).then(|| s.cpu_ns as f64 / 1e3 / s.rows as f64),
            failed_batches: s.failed_batches,
            bad_values: s.bad_values,
            missing_rows: s.missing_rows,
            fallback_rows: s.fallback_rows,
        }
    }

    /// The summary's lines, indented as `run` prints its sections.
    pub fn render(&self) -> String {
        let f = |v: Option<f64>, d: usize| v.map_or("-".to_string(), |x| format!("{x:.d$}"));
        format!(
            "  remote          {} rows in {} batches ({} requests, {}) from {}\n                  \
             {} rows/s of batch time, batch p50 {} us p99 {} us, {} CPU us per row\n                  \
             {} failed batches, {} bad values, {} missing rows, {} rows read locally instead\n",
            self.rows,
            self.batches,
            self.requests,
            bytes(self.bytes),
            self.servers,
            f(self.rows_per_s, 0),
            f(self.batch_p50_us, 0),
            f(self.batch_p99_us, 0),
            f(self.cpu_us_per_row, 2),
            self.failed_batches,
            self.bad_values,
            self.missing_rows,
            self.fallback_rows
        )
    }
}
