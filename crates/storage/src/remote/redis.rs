//! [`RedisTier`]: the remote row tier over Redis-protocol servers (one
//! server process per core per host, persistence off), each behind a
//! [`RedisLink`].
//!
//! A batch of rows is split by the shard rule ([`server_of`]); each
//! server touched gets one `MGET` of its rows' keys, the servers asked in
//! parallel (scoped threads, the calling thread taking one server), and
//! each value is checked by [`decode_value`] before its payload is
//! copied into the row's slot.
//!
//! Faults: a server down or slow past the link's I/O timeout fails the
//! batch with a [`StorageError::Remote`] (the link backs off; a call that
//! finds it backing off waits for the backoff when it ends within the
//! timeout, so a restarted server is tried again without a burst of
//! failures); a missing row ([`RemoteFault::MissingRow`]: a server
//! restarted empty) fails the batch and starts the link's backoff too, so
//! calls retried while the server is reloaded wait rather than spin; a
//! refused value ([`RemoteFault::BadValue`]) fails the batch.
//!
//! Invariant: nothing is written into a slot but the payload of a value
//! accepted for that table and that row.

use std::collections::VecDeque;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::time::{Duration, Instant};

use parking_lot::Mutex;

use super::format::{
    LocalRows, Manifest, TableDigest, decode_value, dtype_name, manifest_key, payload_bytes,
    row_key, server_of, table_digest,
};
use super::link::{LinkConfig, LinkError, RedisLink};
use super::{
    LATENCY_SAMPLES, RemoteRows, RemoteStats, RemoteTier, RowDst, remote_error, thread_cpu_ns,
};
use crate::error::{RemoteFault, Result, StorageError};
use crate::layout::TableFiles;

/// Largest manifest accepted from a server.
const MAX_MANIFEST_BYTES: usize = 64 * 1024;

#[derive(Default)]
struct Counters {
    rows: AtomicU64,
    batches: AtomicU64,
    requests: AtomicU64,
    bytes: AtomicU64,
    failed_batches: AtomicU64,
    bad_values: AtomicU64,
    missing_rows: AtomicU64,
    fallback_rows: AtomicU64,
    cpu_ns: AtomicU64,
    batch_ns: Mutex<VecDeque<u64>>,
}

/// Redis-protocol servers holding tables' rows. See the module docs.
pub struct RedisTier {
    links: Vec<Arc<RedisLink>>,
    counters: Arc<Counters>,
}

/// Split a comma-separated server list (`redis://H:P,redis://H:P`).
pub fn parse_urls(list: &str) -> Vec<String> {
    list.split(',')
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .map(str::to_string)
        .collect()
}

impl RedisTier {
    /// A tier over `urls`, in this order (the order is part of the shard
    /// rule: every reader must list the servers as the push did). Only the
    /// addresses are checked here; nothing connects.
    pub fn open(urls: &[String], cfg: LinkConfig) -> Result<RedisTier> {
        if urls.is_empty() {
            return Err(StorageError::invalid(
                "a remote tier needs at least one server",
            ));
        }
        for (i, u) in urls.iter().enumerate() {
            if urls[..i].contains(u) {
                return Err(StorageError::invalid(format!(
                    "remote server {u} is listed twice"
                )));
            }
        }
        let links = urls
            .iter()
            .map(|u| {
                RedisLink::open(u, cfg.clone())
                    .map(Arc::new)
                    .map_err(|e| StorageError::invalid(format!("remote server address '{u}': {e}")))
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(RedisTier {
            links,
            counters: Arc::default(),
        })
    }

    /// The servers' links, in the list's order.
    pub fn links(&self) -> &[Arc<RedisLink>] {
        &self.links
    }

    /// Server `i`'s manifest of table `d`, if it holds one.
    pub fn manifest(&self, i: usize, d: &TableDigest) -> Result<Option<Manifest>> {
        let link = &self.links[i];
        let key = manifest_key(d);
        let v = link
            .run("GET manifest", None, |c| {
                redis::cmd("GET").arg(&key).query::<Option<Vec<u8>>>(c)
            })
            .map_err(|e| link_error(link, "reading the manifest", e))?;
        let Some(b) = v else { return Ok(None) };
        if b.len() > MAX_MANIFEST_BYTES {
            return Err(remote_error(
                link.url(),
                RemoteFault::NotLoaded,
                format!(
                    "manifest {key} is {} bytes, more than a manifest has",
                    b.len()
                ),
            ));
        }
        Manifest::parse(&b)
            .map(Some)
            .map_err(|e| remote_error(link.url(), RemoteFault::NotLoaded, format!("{key}: {e}")))
    }

    /// Why server `i`'s manifest `m` (of table `d`) is not a complete load
    /// of `files` over this tier's server list, or `None` when it is.
    pub fn refusal(&self, i: usize, files: &TableFiles, m: &Manifest) -> Option<String> {
        let info = &files.info;
        let n = self.links.len() as u64;
        if m.rows != info.rows
            || m.dtype != dtype_name(info.dtype)
            || m.head_dim != info.head_dim as u64
            || m.payload != payload_bytes(info) as u64
        {
            return Some(format!(
                "its manifest describes {} {} rows of {} values, the table has {} {} rows of {}",
                m.rows,
                m.dtype,
                m.head_dim,
                info.rows,
                dtype_name(info.dtype),
                info.head_dim
            ));
        }
        if m.servers != n || m.server != i as u64 {
            return Some(format!(
                "the rows were pushed to it as server {} of {}, but it is server {} of {} here \
                 (list the servers as the push did, or push again)",
                m.server + 1,
                m.servers,
                i + 1,
                n
            ));
        }
        if !m.complete {
            return Some(format!(
                "partial load: rows 0..{} of {} pushed (run `metrale-ple table push` again to \
                 finish it)",
                m.pushed_through, m.rows
            ));
        }
        None
    }

    /// The transport's ceiling for a batch: the same `MGET`s as a fetch of
    /// `ids` of table `d` (one per server, in parallel), the replies
    /// received and dropped, nothing checked or copied. Returns the value
    /// bytes received.
    pub fn raw_mget(&self, d: &TableDigest, ids: &[u64]) -> Result<u64> {
        let n = self.links.len();
        let mut per: Vec<Vec<String>> = vec![Vec::new(); n];
        for &id in ids {
            per[server_of(d, id, n)].push(row_key(d, id));
        }
        let one = |i: usize, keys: &[String]| -> Result<u64> {
            let link = &self.links[i];
            let v = link
                .run("MGET", None, |c| {
                    redis::cmd("MGET").arg(keys).query::<redis::Value>(c)
                })
                .map_err(|e| link_error(link, "MGET", e))?;
            Ok(match v {
                redis::Value::Array(items) => items
                    .iter()
                    .map(|x| match x {
                        redis::Value::BulkString(b) => b.len() as u64,
                        _ => 0,
                    })
                    .sum(),
                _ => 0,
            })
        };
        let busy: Vec<(usize, &Vec<String>)> = per
            .iter()
            .enumerate()
            .filter(|(_, k)| !k.is_empty())
            .collect();
        let results: Vec<Result<u64>> = std::thread::scope(|s| {
            let mut it = busy.iter();
            let first = it.next();
            let handles: Vec<_> = it.map(|&(i, k)| s.spawn(move || one(i, k))).collect();
            let mut out: Vec<Result<u64>> = first.map(|&(i, k)| one(i, k)).into_iter().collect();
            out.extend(handles.into_iter().map(|h| h.join().expect("MGET thread")));
            out
        });
        results.into_iter().sum()
    }

    fn stats_now(&self) -> RemoteStats {
        let c = &self.counters;
        RemoteStats {
            rows: c.rows.load(Relaxed),
            batches: c.batches.load(Relaxed),
            requests: c.requests.load(Relaxed),
            bytes: c.bytes.load(Relaxed),
            failed_batches: c.failed_batches.load(Relaxed),
            bad_values: c.bad_values.load(Relaxed),
            missing_rows: c.missing_rows.load(Relaxed),
            fallback_rows: c.fallback_rows.load(Relaxed),
            cpu_ns: c.cpu_ns.load(Relaxed),
            batch_ns: c.batch_ns.lock().iter().copied().collect(),
        }
    }
}

/// A link failure as a [`StorageError::Remote`].
pub(crate) fn link_error(link: &RedisLink, what: &str, e: LinkError) -> StorageError {
    let fault = if matches!(e, LinkError::Unavailable { .. }) {
        RemoteFault::Unavailable
    } else if e.is_timeout() {
        RemoteFault::Timeout
    } else if e.is_connection() {
        RemoteFault::Connection
    } else {
        RemoteFault::Protocol
    };
    let message = match fault {
        RemoteFault::Timeout => format!(
            "{what}: no answer within {} ms",
            link.config().io_timeout.as_millis()
        ),
        _ => format!("{what}: {e}"),
    };
    remote_error(link.url(), fault, message)
}

impl RemoteTier for RedisTier {
    fn describe(&self) -> String {
        self.links
            .iter()
            .map(|l| l.url())
            .collect::<Vec<_>>()
            .join(",")
    }

    fn open(&self, files: &TableFiles) -> Result<Arc<dyn RemoteRows>> {
        let digest = table_digest(files)?;
        for (i, link) in self.links.iter().enumerate() {
            let why = match self.manifest(i, &digest)? {
                None => Some(format!(
                    "it holds no load of table {digest} (nothing pushed there for this table; \
                     run `metrale-ple table push DIR --to {}`)",
                    self.describe()
                )),
                Some(m) => self.refusal(i, files, &m),
            };
            if let Some(why) = why {
                return Err(remote_error(link.url(), RemoteFault::NotLoaded, why));
            }
        }
        Ok(Arc::new(RedisRows {
            digest,
            payload: payload_bytes(&files.info),
            row_bytes: files.info.row_bytes(),
            links: self.links.clone(),
            counters: self.counters.clone(),
        }))
    }

    fn stats(&self) -> RemoteStats {
        self.stats_now()
    }
}

/// One table's rows on a [`RedisTier`].
struct RedisRows {
    digest: TableDigest,
    payload: usize,
    row_bytes: usize,
    links: Vec<Arc<RedisLink>>,
    counters: Arc<Counters>,
}

impl RedisRows {
    /// One server's share of a batch: one `MGET`, each value checked and
    /// copied into its slot. Returns the value bytes received.
    fn fetch_one(&self, i: usize, rows: &mut [&mut RowDst<'_>]) -> Result<u64> {
        let link = &self.links[i];
        let keys: Vec<String> = rows.iter().map(|d| row_key(&self.digest, d.id)).collect();
        let wait = Instant::now() + link.config().io_timeout;
        self.counters.requests.fetch_add(1, Relaxed);
        let reply = link
            .run("MGET", Some(wait), |c| {
                redis::cmd("MGET").arg(&keys).query::<redis::Value>(c)
            })
            .map_err(|e| link_error(link, &format!("MGET of {} rows", keys.len()), e))?;
        let items = match reply {
            redis::Value::Array(v) if v.len() == rows.len() => v,
            other => {
                return Err(remote_error(
                    link.url(),
                    RemoteFault::Protocol,
                    format!(
                        "MGET of {} keys answered with something else: {:.80}",
                        keys.len(),
                        format!("{other:?}")
                    ),
                ));
            }
        };
        let mut bytes = 0u64;
        for (d, v) in rows.iter_mut().zip(items) {
            match v {
                redis::Value::BulkString(b) => {
                    let p = decode_value(&b, &self.digest, d.id, self.payload).map_err(|e| {
                        self.counters.bad_values.fetch_add(1, Relaxed);
                        remote_error(
                            link.url(),
                            RemoteFault::BadValue,
                            format!(
                                "row {} ({}): {e}; not used",
                                d.id,
                                row_key(&self.digest, d.id)
                            ),
                        )
                    })?;
                    d.row.copy_from_slice(&p[..self.row_bytes]);
                    d.scale.copy_from_slice(&p[self.row_bytes..]);
                    bytes += b.len() as u64;
                }
                redis::Value::Nil => {
                    self.counters.missing_rows.fetch_add(1, Relaxed);
                    link.mark_failed(format!("row {} missing", d.id));
                    return Err(remote_error(
                        link.url(),
                        RemoteFault::MissingRow,
                        format!(
                            "row {} of table {} is not there (the server restarted empty, or was \
                             flushed? push the table again)",
                            d.id, self.digest
                        ),
                    ));
                }
                other => {
                    return Err(remote_error(
                        link.url(),
                        RemoteFault::Protocol,
                        format!(
                            "row {}: a reply that is not a value: {:.80}",
                            d.id,
                            format!("{other:?}")
                        ),
                    ));
                }
            }
        }
        Ok(bytes)
    }
}

impl RemoteRows for RedisRows {
    fn describe(&self) -> String {
        self.links
            .iter()
            .map(|l| l.url())
            .collect::<Vec<_>>()
            .join(",")
    }

    fn fell_back(&self, rows: u64) {
        self.counters.fallback_rows.fetch_add(rows, Relaxed);
    }

    fn fetch(&self, dst: &mut [RowDst<'_>]) -> Result<u64> {
        if dst.is_empty() {
            return Ok(0);
        }
        let t0 = Instant::now();
        let cpu0 = thread_cpu_ns();
        let n = self.links.len();
        for d in dst.iter() {
            if d.row.len() != self.row_bytes || d.row.len() + d.scale.len() != self.payload {
                return Err(StorageError::invalid(format!(
                    "row {}: a slot of {}+{} bytes for a payload of {}",
                    d.id,
                    d.row.len(),
                    d.scale.len(),
                    self.payload
                )));
            }
        }
        let mut per: Vec<Vec<&mut RowDst<'_>>> = (0..n).map(|_| Vec::new()).collect();
        for d in dst.iter_mut() {
            per[server_of(&self.digest, d.id, n)].push(d);
        }
        let mut busy: Vec<(usize, Vec<&mut RowDst<'_>>)> = per
            .into_iter()
            .enumerate()
            .filter(|(_, v)| !v.is_empty())
            .collect();
        let mut other_cpu = 0u64;
        let results: Vec<Result<u64>> = if busy.len() == 1 {
            let (i, mut rows) = busy.pop().expect("one");
            vec![self.fetch_one(i, &mut rows)]
        } else {
            std::thread::scope(|s| {
                let mut it = busy.into_iter();
                let first = it.next();
                let handles: Vec<_> = it
                    .map(|(i, mut rows)| {
                        s.spawn(move || {
                            let c = thread_cpu_ns();
                            let r = self.fetch_one(i, &mut rows);
                            (r, thread_cpu_ns().saturating_sub(c))
                        })
                    })
                    .collect();
                let mut out = Vec::with_capacity(n);
                if let Some((i, mut rows)) = first {
                    out.push(self.fetch_one(i, &mut rows));
                }
                for h in handles {
                    let (r, c) = h.join().expect("fetch thread");
                    other_cpu += c;
                    out.push(r);
                }
                out
            })
        };
        let c = &self.counters;
        c.batches.fetch_add(1, Relaxed);
        let mut bytes = 0;
        let mut first_err = None;
        for r in results {
            match r {
                Ok(b) => bytes += b,
                Err(e) => {
                    first_err.get_or_insert(e);
                }
            }
        }
        c.bytes.fetch_add(bytes, Relaxed);
        c.cpu_ns
            .fetch_add(thread_cpu_ns().saturating_sub(cpu0) + other_cpu, Relaxed);
        if let Some(e) = first_err {
            c.failed_batches.fetch_add(1, Relaxed);
            return Err(e);
        }
        c.rows.fetch_add(dst.len() as u64, Relaxed);
        let mut lat = c.batch_ns.lock();
        if lat.len() == LATENCY_SAMPLES {
            lat.pop_front();
        }
        lat.push_back(t0.elapsed().as_nanos() as u64);
        Ok(bytes)
    }
}

/// The link settings a tier gets from one timeout (milliseconds): connect,
/// read and write timeouts of `timeout_ms`, backoff from 20 ms up to the
/// timeout, so a restarted server is asked again within one timeout.
pub fn link_config(timeout_ms: u64) -> LinkConfig {
    let t = Duration::from_millis(timeout_ms.max(1));
    LinkConfig {
        connect_timeout: t,
        io_timeout: t,
        pool_size: 8,
        backoff_min: Duration::from_millis(20).min(t),
        backoff_max: t,
    }
}

/// Read rows `first..first + n` of `files` and check them against what
/// table `d` on `tier` serves; for tests and `table push --check`. Returns
/// the first row that differs, if any.
pub fn compare_rows(
    tier: &RedisTier,
    files: &TableFiles,
    first: u64,
    n: u64,
) -> Result<Option<u64>> {
    let rows = tier.open(files)?;
    let local = LocalRows::open(files)?;
    let mut want = Vec::new();
    local.read(first, n, &mut want)?;
    let p = local.payload();
    let rb = files.info.row_bytes();
    let mut got = vec![0u8; n as usize * p];
    {
        let mut dst: Vec<RowDst<'_>> = got
            .chunks_exact_mut(p)
            .enumerate()
            .map(|(k, c)| {
                let (row, scale) = c.split_at_mut(rb);
                RowDst {
                    id: first + k as u64,
                    row,
                    scale,
                }
            })
            .collect();
        rows.fetch(&mut dst)?;
    }
    Ok((0..n)
        .find(|&k| {
            let r = k as usize * p..(k as usize + 1) * p;
            got[r.clone()] != want[r]
        })
        .map(|k| first + k))
}
