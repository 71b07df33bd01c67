//! The summary `run` prints: what the server's report and the engine's
//! statistics say about one run (throughput per phase, the row cache, I/O
//! wait, prefix cache, swaps, carry memory, faults, the carry store, the
//! remote tier, the verify pass), as aligned text or as JSON.
//!
//! Invariant: every figure comes from the pass that was measured; the
//! verify pass contributes only its comparison and its time.

use std::fmt::Write as _;
use std::path::Path;
use std::time::Duration;

use metrale_checkpoint::Checkpoint;
use metrale_engine::backbone::BlockShape;
use metrale_storage::remote::RemoteTier;
use metrale_storage::remote::redis::RedisTier;
use serde::Serialize;

use super::super::common::bytes;
use super::super::faults::FlakyReader;
use super::super::remote::RemoteSummary;
use super::engine::{PassConfig, PassResult};
use super::{RunArgs, TableArg, store, tensor_parallel};

/// What a run did, for its summary: the arguments, the checkpoint, the
/// workload's size, and the measured pass with what it ran over.
pub(super) struct Ran<'a> {
    pub(super) a: &'a RunArgs,
    pub(super) dir: &'a Path,
    pub(super) ck: &'a Checkpoint,
    pub(super) sequences: usize,
    pub(super) tokens: u64,
    pub(super) main: &'a PassConfig,
    pub(super) r: &'a PassResult,
    pub(super) faults: Option<&'a FlakyReader>,
    pub(super) remote: Option<&'a RedisTier>,
}

/// The summary, as printed and as JSON.
#[derive(Serialize)]
pub(super) struct Summary {
    checkpoint: String,
    sequences: usize,
    in_flight: usize,
    tokens: u64,
    table: String,
    slots_per_site: Option<usize>,
    prefill: Phase2,
    decode: Phase2,
    row_cache: CacheSummary,
    bytes_read: u64,
    read_calls: u64,
    io_wait_seconds: f64,
    io_wait_share: f64,
    io_wait_covered_seconds: Option<f64>,
    read_seconds: Option<f64>,
    read_unwaited_share: Option<f64>,
    prefetch: bool,
    backbone: Option<BackboneSummary>,
    prefix_cache: PrefixSummary,
    swaps: SwapSummary,
    decode_graphs: Option<GraphSummary>,
    carry: CarrySummary,
    wall_seconds: f64,
    leaked_allocations: usize,
    faults: Option<FaultSummary>,
    pub(super) verify: Option<VerifySummary>,
    carry_store: Option<store::StoreSummary>,
    remote: Option<RemoteRun>,
    tensor_parallel: Option<tensor_parallel::TpSummary>,
}

#[derive(Serialize)]
pub(super) struct BackboneSummary {
    layers: usize,
    site_layers: Vec<usize>,
    scale: usize,
    model_width: usize,
    intermediate: usize,
    gflop_per_token: f64,
}

#[derive(Serialize)]
pub(super) struct FaultSummary {
    percent: f64,
    injected: u64,
    failed_calls: u64,
    retried_sequences: u64,
    failed_sequences: usize,
    first_error: Option<String>,
}

#[derive(Serialize)]
pub(super) struct Phase2 {
    tokens: u64,
    seconds: f64,
    tokens_per_second: f64,
    step: usize,
}

/// The remote tier's figures and the calls its faults failed.
#[derive(Serialize)]
pub(super) struct RemoteRun {
    #[serde(flatten)]
    tier: RemoteSummary,
    failed_calls: u64,
    retried_sequences: u64,
    failed_sequences: usize,
    first_error: Option<String>,
}

#[derive(Serialize)]
pub(super) struct CacheSummary {
    hits: u64,
    misses: u64,
    hit_rate: f64,
    host_hits: u64,
}

#[derive(Serialize)]
pub(super) struct PrefixSummary {
    hits: u64,
    tokens_restored: u64,
}

#[derive(Serialize)]
pub(super) struct SwapSummary {
    swap_outs: u64,
    swap_ins: u64,
    preemptions: u64,
}

#[derive(Serialize)]
pub(super) struct GraphSummary {
    captured: u64,
    replays: u64,
}

#[derive(Serialize)]
pub(super) struct CarrySummary {
    bytes_per_sequence: usize,
    peak_bytes: usize,
    budget_bytes: Option<usize>,
}

#[derive(Serialize)]
pub(super) struct VerifySummary {
    pub(super) rows_compared: u64,
    pub(super) identical: bool,
    pub(super) first_mismatch: Option<String>,
    pub(super) seconds: f64,
}

impl Ran<'_> {
    /// The summary of this run, with the verify pass's comparison and the
    /// tensor-parallel ranks' figures.
    pub(super) fn summary(
        &self,
        verify: Option<VerifySummary>,
        tensor_parallel: Option<tensor_parallel::TpSummary>,
    ) -> Summary {
        let (a, r, main) = (self.a, self.r, self.main);
        let g = &self.ck.spec;
        let st = r.report.stats;
        let lookups = r.report.table.hits + r.report.table.misses;
        let io_wait = r.report.io_wait.as_secs_f64();
        Summary {
            checkpoint: self.dir.display().to_string(),
            sequences: self.sequences,
            in_flight: a.in_flight,
            tokens: self.tokens,
            table: format!("{:?}", a.table).to_lowercase(),
            slots_per_site: matches!(a.table, TableArg::Cached | TableArg::Remote)
                .then_some(a.slots),
            prefill: Phase2 {
                tokens: st.prefill_tokens,
                seconds: r.report.prefill_time.as_secs_f64(),
                tokens_per_second: rate(st.prefill_tokens, r.report.prefill_time),
                step: a.prefill_chunk,
            },
            decode: Phase2 {
                tokens: st.decode_tokens,
                seconds: r.report.decode_time.as_secs_f64(),
                tokens_per_second: rate(st.decode_tokens, r.report.decode_time),
                step: a.decode_batch,
            },
            row_cache: CacheSummary {
                hits: r.report.table.hits,
                misses: r.report.table.misses,
                hit_rate: if lookups == 0 {
                    0.0
                } else {
                    r.report.table.hits as f64 / lookups as f64
                },
                host_hits: r.report.table.host_hits,
            },
            bytes_read: r.report.table.bytes_read,
            read_calls: r.report.table.read_calls,
            io_wait_seconds: io_wait,
            io_wait_share: io_wait / r.report.wall.as_secs_f64().max(1e-9),
            io_wait_covered_seconds: main
                .backbone
                .is_some()
                .then_some(r.waits.covered.as_secs_f64()),
            read_seconds: r.report.read_time.map(|d| d.as_secs_f64()),
            read_unwaited_share: r.report.read_time.map(|d| {
                let read = d.as_secs_f64();
                if read > 0.0 {
                    (1.0 - io_wait / read).clamp(0.0, 1.0)
                } else {
                    1.0
                }
            }),
            prefetch: !a.no_prefetch,
            backbone: main.backbone.as_ref().map(|b| {
                let shape = BlockShape::new(g.hc_mult * g.hidden_size, b.scale);
                BackboneSummary {
                    layers: b.layers,
                    site_layers: b.site_layers.clone(),
                    scale: b.scale,
                    model_width: shape.model,
                    intermediate: shape.intermediate,
                    gflop_per_token: 2.0 * shape.macs_per_token() as f64 * b.layers as f64 / 1e9,
                }
            }),
            prefix_cache: PrefixSummary {
                hits: st.prefix_hits,
                tokens_restored: st.prefix_tokens_restored,
            },
            swaps: SwapSummary {
                swap_outs: st.swap_outs,
                swap_ins: st.swap_ins,
                preemptions: st.preemptions,
            },
            decode_graphs: a.decode_graphs.then_some(GraphSummary {
                captured: st.graph_captures,
                replays: st.graph_replays,
            }),
            carry: CarrySummary {
                bytes_per_sequence: r.carry_bytes,
                peak_bytes: st.budget.peak_bytes,
                budget_bytes: (a.resident_carries > 0)
                    .then_some(a.resident_carries * r.carry_bytes),
            },
            wall_seconds: r.report.wall.as_secs_f64(),
            leaked_allocations: r.leaked,
            faults: self.faults.map(|f| FaultSummary {
                percent: a.fault_percent,
                injected: f.injected(),
                failed_calls: r.report.failed_calls,
                retried_sequences: r.report.retried,
                failed_sequences: r.report.failed.len(),
                first_error: r.report.first_fault.clone(),
            }),
            verify,
            carry_store: main.store.as_ref().map(|cs| {
                let per_token =
                    r.report.prefill_time.as_secs_f64() / st.prefill_tokens.max(1) as f64;
                store::summary(cs, &st.carry_store, per_token)
            }),
            remote: self.remote.map(|t| RemoteRun {
                tier: RemoteSummary::of(t.describe(), &t.stats()),
                failed_calls: r.report.failed_calls,
                retried_sequences: r.report.retried,
                failed_sequences: r.report.failed.len(),
                first_error: r.report.first_fault.clone(),
            }),
            tensor_parallel,
        }
    }
}

fn rate(n: u64, d: Duration) -> f64 {
    if d.is_zero() {
        0.0
    } else {
        n as f64 / d.as_secs_f64()
    }
}

pub(super) fn render(s: &Summary) -> String {
    let mut o = String::new();
    let table = match s.slots_per_site {
        Some(n) => format!("table {} ({n} slots per site)", s.table),
        None => format!("table {}", s.table),
    };
    let _ = writeln!(
        o,
        "metrale-ple run: {} sequences ({} tokens), {} in flight, {table}",
        s.sequences, s.tokens, s.in_flight
    );
    let _ = writeln!(o, "  checkpoint      {}", s.checkpoint);
    let _ = writeln!(
        o,
        "  prefill         {:>11} tokens  {:>8.1} ktokens/s  (chunks of {})",
        s.prefill.tokens,
        s.prefill.tokens_per_second / 1e3,
        s.prefill.step
    );
    let _ = writeln!(
        o,
        "  decode          {:>11} tokens  {:>8.1} ktokens/s  (batches of up to {})",
        s.decode.tokens,
        s.decode.tokens_per_second / 1e3,
        s.decode.step
    );
    if s.row_cache.hits + s.row_cache.misses > 0 {
        let _ = writeln!(
            o,
            "  row cache       hit rate {:.1}%  ({} hits, {} misses, {} of them from host memory)",
            100.0 * s.row_cache.hit_rate,
            s.row_cache.hits,
            s.row_cache.misses,
            s.row_cache.host_hits
        );
    } else {
        let _ = writeln!(o, "  row cache       none (every row in place)");
    }
    let _ = writeln!(
        o,
        "  bytes read      {} in {} read calls",
        bytes(s.bytes_read),
        s.read_calls
    );
    if let Some(b) = &s.backbone {
        let _ = writeln!(
            o,
            "  backbone        {} layers (sites at {:?}), blocks of width {} / MLP {} (scale 1/{}), {:.1} MFLOP per token",
            b.layers,
            b.site_layers,
            b.model_width,
            b.intermediate,
            b.scale,
            b.gflop_per_token * 1e3
        );
    }
    let _ = writeln!(
        o,
        "  I/O wait        {:.1}% of wall time ({:.3} s blocked on rows{}; prefetch {})",
        100.0 * s.io_wait_share,
        s.io_wait_seconds,
        match s.io_wait_covered_seconds {
            Some(c) => format!(", {c:.3} s of it while the blocks before the site still ran"),
            None => String::new(),
        },
        if s.prefetch { "on" } else { "off" }
    );
    if let (Some(r), Some(h)) = (s.read_seconds, s.read_unwaited_share) {
        let _ = writeln!(
            o,
            "  reads           {r:.3} s in read calls, {:.1}% of it never waited for",
            100.0 * h
        );
    }
    let _ = writeln!(
        o,
        "  prefix cache    {} hits, {} tokens restored",
        s.prefix_cache.hits, s.prefix_cache.tokens_restored
    );
    let _ = writeln!(
        o,
        "  swaps           {} out, {} in ({} preemptions)",
        s.swaps.swap_outs, s.swaps.swap_ins, s.swaps.preemptions
    );
    if let Some(g) = &s.decode_graphs {
        let _ = writeln!(
            o,
            "  decode graphs   {} captured, {} steps replayed",
            g.captured, g.replays
        );
    }
    let _ = writeln!(
        o,
        "  carry memory    {} per sequence, peak {}{}",
        bytes(s.carry.bytes_per_sequence as u64),
        bytes(s.carry.peak_bytes as u64),
        match s.carry.budget_bytes {
            Some(b) => format!(" (budget {})", bytes(b as u64)),
            None => " (no budget)".to_string(),
        }
    );
    if let Some(f) = &s.faults {
        let _ = writeln!(
            o,
            "  read faults     {} injected ({}% of read batches): {} calls failed, {} sequences rerun, {} given up",
            f.injected, f.percent, f.failed_calls, f.retried_sequences, f.failed_sequences
        );
    }
    if let Some(cs) = &s.carry_store {
        o.push_str(&store::render(cs));
    }
    if let Some(r) = &s.remote {
        o.push_str(&r.tier.render());
        let _ = writeln!(
            o,
            "                  {} calls failed, {} sequences rerun, {} given up{}",
            r.failed_calls,
            r.retried_sequences,
            r.failed_sequences,
            r.first_error
                .as_deref()
                .map_or(String::new(), |e| format!("; first: {e}"))
        );
    }
    if let Some(tp) = &s.tensor_parallel {
        o.push_str(&tensor_parallel::render(tp));
    }
    let _ = writeln!(o, "  wall time       {:.2} s", s.wall_seconds);
    match &s.verify {
        Some(VerifySummary {
            first_mismatch: Some(at),
            rows_compared,
            ..
        }) => {
            let _ = writeln!(
                o,
                "  verify          MISMATCH at {at} (after {rows_compared} identical rows)"
            );
        }
        Some(v) => {
            let _ = writeln!(
                o,
                "  verify          {} output rows bit-identical to a resident, uncached run ({:.2} s)",
                v.rows_compared, v.seconds
            );
        }
        None => {}
    }
    o
}
