//! `table push`: load one table's rows onto a [`RedisTier`]'s servers.
//!
//! The rows are read from the shard files in id order, in chunks of
//! [`PushOptions::chunk_rows`]; each chunk's values go to their servers
//! (the shard rule) as one pipeline of `SET`s per server, the servers
//! written in parallel, each pipeline ending with a `SET` of that server's
//! manifest recording the rows pushed so far (`complete: false`). A server
//! runs a connection's commands in order, so a manifest never claims rows
//! its server does not hold. When every row is in, each server's manifest
//! is written `complete: true` with the SHA-256 of its values in id order
//! (`rows_digest`): a reader ([`super::RemoteTier::open`]) refuses a
//! server without a complete manifest of its table.
//!
//! Resuming: a server whose manifest (same table, same server list) says
//! `complete` is left alone; one with a partial manifest gets only the rows
//! after its `pushed_through`; the others get every row. The rows before
//! are read again locally (not sent) to compute the rows digest.
//!
//! Invariant: a manifest is written `complete` only after every `SET` of
//! that server succeeded; any failure stops the push with an error, leaving
//! at most a partial manifest.

use std::time::{Duration, Instant};

use super::format::{
    LocalRows, Manifest, TableDigest, dtype_name, encode_value, manifest_key, row_key, server_of,
    table_digest,
};
use super::redis::{RedisTier, link_error};
use crate::digest::{Sha256, hex};
use crate::error::Result;
use crate::layout::TableFiles;

/// How [`push_table`] goes.
#[derive(Clone, Debug)]
pub struct PushOptions {
    /// Rows read and sent per round (each server gets its share of them as
    /// one pipeline).
    pub chunk_rows: u64,
    /// Push every row again, ignoring what the manifests say was pushed.
    pub restart: bool,
    /// Stop after this many rows (for tests of a partial load); `None`:
    /// every row.
    pub stop_after: Option<u64>,
}

impl Default for PushOptions {
    fn default() -> Self {
        PushOptions {
            chunk_rows: 16_384,
            restart: false,
            stop_after: None,
        }
    }
}

/// What a push did.
#[derive(Clone, Debug)]
pub struct PushReport {
    /// The table's digest (what its keys carry).
    pub digest: TableDigest,
    /// Rows of the table.
    pub rows: u64,
    /// Rows sent now.
    pub sent_rows: u64,
    /// Value bytes sent now.
    pub sent_bytes: u64,
    /// Servers that already held a complete load.
    pub already_complete: usize,
    /// Rows each server holds now.
    pub rows_per_server: Vec<u64>,
    /// Whether every server holds a complete load now.
    pub complete: bool,
    /// Time taken.
    pub elapsed: Duration,
}

/// Push the table stored in `files` to `tier`, calling `progress(rows done,
/// rows)` after each chunk. See the module docs.
pub fn push_table(
    tier: &RedisTier,
    files: &TableFiles,
    opts: &PushOptions,
    progress: &mut dyn FnMut(u64, u64),
) -> Result<PushReport> {
    let t0 = Instant::now();
    let digest = table_digest(files)?;
    let info = files.info;
    let rows = info.rows;
    let n = tier.links().len();
    let local = LocalRows::open(files)?;
    let payload = local.payload();
    // Where each server's push resumes; `rows` for a complete one.
    let mut resume = vec![0u64; n];
    let mut already = 0;
    for (i, r) in resume.iter_mut().enumerate() {
        if opts.restart {
            continue;
        }
        if let Some(m) = tier.manifest(i, &digest).ok().flatten()
            && m.servers == n as u64
            && m.server == i as u64
            && m.rows == rows
            && m.payload == payload as u64
        {
            *r = if m.complete { rows } else { m.pushed_through };
            if m.complete {
                already += 1;
            }
        }
    }
    let manifest = |i: usize, through: u64, here: u64, digest_hex: String| Manifest {
        table: digest,
        rows,
        dtype: dtype_name(info.dtype).to_string(),
        head_dim: info.head_dim as u64,
        payload: payload as u64,
        servers: n as u64,
        server: i as u64,
        pushed_through: through,
        rows_here: here,
        complete: !digest_hex.is_empty(),
        rows_digest: digest_hex,
    };
    let mut hashers: Vec<Sha256> = (0..n).map(|_| Sha256::new()).collect();
    let mut here = vec![0u64; n];
    let mut sent_rows = 0u64;
    let mut sent_bytes = 0u64;
    let end = opts.stop_after.map_or(rows, |s| s.min(rows));
    let chunk = opts.chunk_rows.max(1);
    let mut buf = Vec::new();
    let mut value = Vec::with_capacity(payload + super::format::VALUE_OVERHEAD);
    let all_done = resume.iter().all(|&r| r == rows);
    let mut id = 0u64;
    while id < end && !all_done {
        let k = chunk.min(end - id);
        local.read(id, k, &mut buf)?;
        let mut pipes: Vec<Option<redis::Pipeline>> = (0..n).map(|_| None).collect();
        for r in 0..k {
            let row = id + r;
            let s = server_of(&digest, row, n);
            if resume[s] == rows {
                continue;
            }
            value.clear();
            encode_value(
                &digest,
                row,
                &buf[r as usize * payload..][..payload],
                &mut value,
            );
            hashers[s].update(&value);
            here[s] += 1;
            if row >= resume[s] {
                pipes[s]
                    .get_or_insert_with(redis::pipe)
                    .cmd("SET")
                    .arg(row_key(&digest, row))
                    .arg(&value)
                    .ignore();
                sent_rows += 1;
                sent_bytes += value.len() as u64;
            }
        }
        let through = id + k;
        for (i, p) in pipes.iter_mut().enumerate() {
            if let Some(p) = p {
                let m = manifest(i, through, here[i], String::new());
                p.cmd("SET")
                    .arg(manifest_key(&digest))
                    .arg(m.to_json())
                    .ignore();
            }
        }
        send_all(tier, &mut pipes)?;
        id = through;
        progress(id, rows);
    }
    let complete = end == rows;
    if complete {
        let mut pipes: Vec<Option<redis::Pipeline>> = (0..n).map(|_| None).collect();
        for (i, h) in hashers.into_iter().enumerate() {
            if resume[i] == rows {
                continue;
            }
            let m = manifest(i, rows, here[i], hex(&h.finish()));
            let mut p = redis::pipe();
            p.cmd("SET")
                .arg(manifest_key(&digest))
                .arg(m.to_json())
                .ignore();
            pipes[i] = Some(p);
        }
        send_all(tier, &mut pipes)?;
    }
    let rows_per_server = (0..n)
        .map(|i| {
            if resume[i] == rows {
                tier.manifest(i, &digest)
                    .ok()
                    .flatten()
                    .map_or(0, |m| m.rows_here)
            } else {
                here[i]
            }
        })
        .collect();
    Ok(PushReport {
        digest,
        rows,
        sent_rows,
        sent_bytes,
        already_complete: already,
        rows_per_server,
        complete,
        elapsed: t0.elapsed(),
    })
}

/// Send each server's pipeline, the servers in parallel.
fn send_all(tier: &RedisTier, pipes: &mut [Option<redis::Pipeline>]) -> Result<()> {
    let results: Vec<Result<()>> = std::thread::scope(|s| {
        let handles: Vec<_> = pipes
            .iter()
            .enumerate()
            .filter_map(|(i, p)| p.as_ref().map(|p| (i, p)))
            .map(|(i, p)| {
                s.spawn(move || {
                    let link = &tier.links()[i];
                    link.run("push", None, |c| p.query::<()>(c))
                        .map_err(|e| link_error(link, "pushing rows", e))
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("push thread"))
            .collect()
    });
    results.into_iter().collect()
}
