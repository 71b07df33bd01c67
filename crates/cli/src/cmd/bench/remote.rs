//! `bench offload --remote`: the remote row tier's own figures, measured in
//! the same run as the offload rows: the push of the checkpoint's tables
//! (resumed: a table already loaded sends nothing), then batches of a
//! decode step's rows of one site fetched through the tier (each value
//! checked and copied into a buffer standing in for the cache slots)
//! against the transport's ceiling, the same `MGET`s of the same keys with
//! the replies dropped unchecked, the two alternating batch by batch (and
//! which goes first with them, since the second finds the servers' lookups
//! of those keys warm) so a shared machine's drift slows both alike.
//!
//! Invariants: the ids are uniform draws over the site's stored rows (a
//! cold step: every row a miss); CPU figures are the process's CPU time
//! (every thread, the fetch's worker threads included) over the batches,
//! per row, on this host only (the servers' CPU is not counted).

use std::sync::Arc;
use std::time::Instant;

use anyhow::Result;
use metrale_bench::layer::Rng;
use metrale_checkpoint::Checkpoint;
use metrale_storage::remote::format::{payload_bytes, table_digest};
use metrale_storage::remote::push::{PushOptions, push_table};
use metrale_storage::remote::redis::RedisTier;
use metrale_storage::remote::{RemoteTier, RowDst, percentile_us, process_cpu_ns};
use serde::Serialize;

use crate::cmd::remote::{RemoteSummary, stored_tables};

/// Batches of each kind measured.
const BATCHES: usize = 200;

/// The remote tier's figures.
#[derive(Serialize, Debug, Clone)]
pub(super) struct RemoteBench {
    /// The servers.
    pub servers: String,
    /// Rows the push sent now (0 when every table was loaded already).
    pub push_sent_rows: u64,
    /// Rows per second the push sent, when it sent any.
    pub push_rows_per_s: Option<f64>,
    /// Rows per measured batch (a decode step's rows of one site).
    pub batch_rows: usize,
    /// Batches of each kind measured.
    pub batches: usize,
    /// Through the tier: rows per second of batch time.
    pub fetch_rows_per_s: f64,
    /// Through the tier: median batch time (µs).
    pub fetch_p50_us: f64,
    /// Through the tier: 99th percentile batch time (µs).
    pub fetch_p99_us: f64,
    /// Through the tier: this host's CPU per row (µs).
    pub fetch_cpu_us_per_row: f64,
    /// Raw `MGET`s: rows per second of batch time.
    pub mget_rows_per_s: f64,
    /// Raw `MGET`s: median batch time (µs).
    pub mget_p50_us: f64,
    /// Raw `MGET`s: 99th percentile batch time (µs).
    pub mget_p99_us: f64,
    /// Raw `MGET`s: this host's CPU per row (µs).
    pub mget_cpu_us_per_row: f64,
    /// The tier's counters over the offload rows served from it.
    pub served: Option<RemoteSummary>,
}

/// Push every table of `ck` to `tier` (resuming), then measure batches of
/// `batch_rows` rows of the first site's table.
pub(super) fn measure(ck: &Checkpoint, tier: &RedisTier, batch_rows: usize) -> Result<RemoteBench> {
    let mut sent = 0u64;
    let t0 = Instant::now();
    for s in 0..ck.sites.len() {
        for files in stored_tables(ck, s)? {
            let r = push_table(tier, &files, &PushOptions::default(), &mut |_, _| {})?;
            sent += r.sent_rows;
        }
    }
    let push_secs = t0.elapsed().as_secs_f64();
    eprintln!(
        "bench offload: remote: {sent} rows pushed to {} in {push_secs:.1} s",
        tier.describe()
    );
    let files = stored_tables(ck, 0)?.remove(0);
    let rows = tier.open(&files)?;
    let digest = table_digest(&files)?;
    let p = payload_bytes(&files.info);
    let rb = files.info.row_bytes();
    let stored = files.info.rows;
    let mut rng = Rng::new(0x5EED_0FF1_0AD5);
    let mut buf = vec![0u8; batch_rows * p];
    let (mut fetch_ns, mut mget_ns) = (Vec::new(), Vec::new());
    let (mut fetch_cpu, mut mget_cpu) = (0u64, 0u64);
    for b in 0..BATCHES {
        let ids: Vec<u64> = (0..batch_rows).map(|_| rng.next_u64() % stored).collect();
        // Which goes first alternates: the second request for the same keys
        // finds the servers' lookups warm.
        for k in 0..2 {
            let c0 = process_cpu_ns();
            let t = Instant::now();
            if (b + k) % 2 == 0 {
                let mut dst: Vec<RowDst<'_>> = buf
                    .chunks_exact_mut(p)
                    .zip(&ids)
                    .map(|(c, &id)| {
                        let (row, scale) = c.split_at_mut(rb);
                        RowDst { id, row, scale }
                    })
                    .collect();
                rows.fetch(&mut dst)?;
                fetch_ns.push(t.elapsed().as_nanos() as u64);
                fetch_cpu += process_cpu_ns() - c0;
            } else {
                tier.raw_mget(&digest, &ids)?;
                mget_ns.push(t.elapsed().as_nanos() as u64);
                mget_cpu += process_cpu_ns() - c0;
            }
        }
    }
    let n = (BATCHES * batch_rows) as f64;
    let rate = |v: &[u64]| n / (v.iter().sum::<u64>() as f64 / 1e9);
    let q = |v: &[u64], x| percentile_us(v, x).unwrap_or(0.0);
    Ok(RemoteBench {
        servers: tier.describe(),
        push_sent_rows: sent,
        push_rows_per_s: (sent > 0).then(|| sent as f64 / push_secs),
        batch_rows,
        batches: BATCHES,
        fetch_rows_per_s: rate(&fetch_ns),
        fetch_p50_us: q(&fetch_ns, 0.5),
        fetch_p99_us: q(&fetch_ns, 0.99),
        fetch_cpu_us_per_row: fetch_cpu as f64 / 1e3 / n,
        mget_rows_per_s: rate(&mget_ns),
        mget_p50_us: q(&mget_ns, 0.5),
        mget_p99_us: q(&mget_ns, 0.99),
        mget_cpu_us_per_row: mget_cpu as f64 / 1e3 / n,
        served: None,
    })
}

/// The report's lines for `r`, beside the disk's CPU per read.
pub(super) fn lines(r: &RemoteBench, disk_read_cpu_us: f64) -> String {
    let mut o = format!(
        "remote: {} servers ({}); a step's batch of {} rows of one site, {} batches each:\n  \
         through the tier  {:>9.0} rows/s  p50 {:>6.0} us  p99 {:>6.0} us  {:.2} CPU us per row\n  \
         raw MGET ceiling  {:>9.0} rows/s  p50 {:>6.0} us  p99 {:>6.0} us  {:.2} CPU us per row\n  \
         (disk: {:.1} us of CPU per read from computing cores)\n",
        r.servers.split(',').count(),
        r.servers,
        r.batch_rows,
        r.batches,
        r.fetch_rows_per_s,
        r.fetch_p50_us,
        r.fetch_p99_us,
        r.fetch_cpu_us_per_row,
        r.mget_rows_per_s,
        r.mget_p50_us,
        r.mget_p99_us,
        r.mget_cpu_us_per_row,
        disk_read_cpu_us,
    );
    if let Some(s) = &r.served {
        o.push_str(&s.render());
    }
    o
}

/// A tier shared by the bench's remote rows.
pub(super) type Tier = Arc<RedisTier>;
