//! Printing a `bench offload` report: the table of rows, the phase table
//! and the disk's figures as text, or the whole report as one JSON object.

use super::*;

pub(super) fn opt(v: Option<f64>, f: impl Fn(f64) -> String) -> String {
    v.map_or_else(|| "-".to_string(), f)
}

pub(super) fn print(r: &Report, json: bool) -> Result<()> {
    use std::io::Write;
    let mut out = std::io::stdout().lock();
    if json {
        serde_json::to_writer_pretty(&mut out, r)?;
        writeln!(out)?;
        return Ok(());
    }
    writeln!(
        out,
        "bench offload ({} run): flagship geometry, {} table rows ({}), row cache {} slots ({}), \
         {} sequences{}, {} x {} steps measured",
        r.run,
        r.table_rows,
        bytes(r.table_bytes),
        r.cache_slots,
        bytes(r.cache_bytes),
        r.sequences,
        if r.micro_batches > 1 {
            format!(" in {} micro-batches", r.micro_batches)
        } else {
            String::new()
        },
        r.measured_reps,
        r.measured_steps
    )?;
    writeln!(
        out,
        "{}",
        disk_line(
            r.disk_random_reads_per_s,
            &r.disk_reader,
            r.disk_direct,
            r.disk_round_us,
            r.disk_read_cpu_us
        )
    )?;
    if let Some(rb) = &r.remote {
        write!(out, "{}", super::remote::lines(rb, r.disk_read_cpu_us))?;
    }
    writeln!(
        out,
        "backbone: {} layers of GEMM blocks at 1/{} width where on; row cache policy {}, \
         host tier {} rows per site, {} reads in flight",
        r.backbone_layers, r.backbone_scale, r.cache_policy, r.host_rows, r.read_depth
    )?;
    if let Some(rows) = r.resident_rows.filter(|&n| n < r.table_rows) {
        let row_bytes = r.cache_bytes / r.cache_slots.max(1) as u64;
        writeln!(out, "{}", baseline_line(rows, r.table_rows, row_bytes))?;
    }
    if let Some(m) = &r.memory {
        let b = |v: Option<u64>| v.map_or_else(|| "-".to_string(), bytes);
        writeln!(
            out,
            "memory: RSS {} before the tables, peak {}; table files in the page cache {} at the \
             start, {} at the end (all page cache {} -> {})",
            b(m.rss_start_bytes),
            b(m.peak_rss_bytes),
            b(m.table_page_cache_start_bytes),
            b(m.table_page_cache_end_bytes),
            b(m.page_cache_start_bytes),
            b(m.page_cache_end_bytes),
        )?;
    }
    let fill = r
        .rows
        .iter()
        .find_map(|row| row.fill_tokens.zip(row.fill_hit_rate));
    writeln!(
        out,
        "decode tokens: {}; row caches filled first with {} tokens of the stream (last window \
         hit rate {})",
        if r.corpus_documents > 0 {
            format!(
                "corpus {} ({} documents{})",
                r.workload,
                r.corpus_documents,
                if r.corpus_reread {
                    ", some read more than once"
                } else {
                    ""
                }
            )
        } else {
            format!("Zipf {ZIPF} draws over the vocabulary")
        },
        fill.map_or_else(|| "-".to_string(), |(t, _)| t.to_string()),
        fill.map_or_else(|| "-".to_string(), |(_, h)| format!("{:.1}%", h * 100.0)),
    )?;
    writeln!(
        out,
        "{:<9} {:<8} {:<8} {:>12} {:>10} {:>16} {:>9} {:>12} {:>9} {:>9} {:>9} {:>9} {:>10}",
        "table",
        "prefetch",
        "backbone",
        "tokens/s",
        "overhead",
        "95% CI",
        "hit rate",
        "bytes/token",
        "I/O wait",
        "exposed",
        "reads",
        "read/miss",
        "RSS open"
    )?;
    for row in &r.rows {
        writeln!(
            out,
            "{:<9} {:<8} {:<8} {:>12.1} {:>10} {:>16} {:>9} {:>12} {:>9} {:>9} {:>9} {:>9} {:>10}",
            row.table,
            if row.prefetch { "on" } else { "off" },
            if row.backbone { "on" } else { "off" },
            row.decode_tokens_per_s,
            opt(row.overhead_vs_resident_pct, |v| format!("{v:+.1}%")),
            row.overhead_ci95_pct
                .filter(|_| row.table != "resident")
                .map_or_else(
                    || "-".to_string(),
                    |[lo, hi]| format!("{lo:+.1}..{hi:+.1}%")
                ),
            opt(row.hit_rate, |v| format!("{:.1}%", v * 100.0)),
            opt(row.bytes_read_per_token, |v| format!("{v:.0}")),
            opt(row.io_wait_share, |v| format!("{:.1}%", v * 100.0)),
            opt(row.exposed_wait_share, |v| format!("{:.1}%", v * 100.0)),
            opt(row.read_share, |v| format!("{:.1}%", v * 100.0)),
            opt(row.read_bytes_per_missed_row_byte, |v| format!("{v:.2}x")),
            row.rss_open_bytes.map_or_else(|| "-".to_string(), bytes),
        )?;
    }
    writeln!(
        out,
        "host time per decode token (us): prefetch call (of it hashing), decode call (of it the \
         sites' host work without waits, and waits for rows), CPU of the cache's prefetch \
         thread and of the process"
    )?;
    writeln!(
        out,
        "{:<9} {:<8} {:<8} {:>9} {:>8} {:>9} {:>9} {:>8} {:>9} {:>9}",
        "table",
        "prefetch",
        "backbone",
        "prefetch",
        "hash",
        "decode",
        "site host",
        "wait",
        "pf thread",
        "process"
    )?;
    for row in &r.rows {
        let p = &row.phases;
        writeln!(
            out,
            "{:<9} {:<8} {:<8} {:>9.1} {:>8.2} {:>9.1} {:>9.1} {:>8.1} {:>9} {:>9}",
            row.table,
            if row.prefetch { "on" } else { "off" },
            if row.backbone { "on" } else { "off" },
            p.prefetch,
            p.prefetch_hash,
            p.decode,
            p.site_host,
            p.io_wait,
            opt(p.prefetch_thread_cpu, |v| format!("{v:.1}")),
            opt(p.process_cpu, |v| format!("{v:.1}")),
        )?;
    }
    Ok(())
}

/// The disk's figures as one line, for the progress log and the report.
pub(super) fn disk_line(
    reads_per_s: f64,
    reader: &str,
    direct: bool,
    round_us: f64,
    cpu_us: f64,
) -> String {
    format!(
        "disk random 4 KiB reads: {reads_per_s:.0}/s ({}/s) through {reader}{}; {ROUND_READS} at \
         once take {round_us:.0} us; a read takes {cpu_us:.1} us of CPU from computing cores",
        bytes((reads_per_s * 4096.0) as u64),
        if direct { ", O_DIRECT" } else { ", buffered" },
    )
}
