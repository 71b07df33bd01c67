//! The conformance suite: behaviour every [`RowTable`] must show.
//!
//! One suite for every table: a [`Subject`] is a table with what the suite
//! needs to judge it (the backend it serves, the bytes each row must hold,
//! and, where the table reads rows at run time, a switch that makes its
//! reads fail). Each case is a [`Case`], a `fn(&Subject) -> Result<(),
//! Failure>` reporting the first thing that went wrong; [`CASES`] lists
//! them by name and [`run_each`] runs each on a fresh subject. Errors are
//! checked by [`StorageError`] variant, so a table conforms by behaviour,
//! not by wording.
//!
//! The properties: rows read back as stored ([`rows_read_back`]); leases
//! keep their rows in place until released and, with an event, until the
//! gather behind that event has run ([`leases_held_until_gather`]); bad
//! ids and output lengths are refused with typed errors and leave no pins
//! ([`bad_ids_refused`]); prefetch is advice that never changes what a
//! resolve returns ([`prefetch_is_advice`]); counters never go back and
//! count each resolved id once ([`stats_count_ids`]); failed reads surface
//! as errors, leave no pins and are read again once the fault is gone
//! ([`faults_surfaced`]).
//!
//! Invariants the cases rely on: the subject's backend runs host kernels
//! (the CPU backend), so a latch can hold a gather's event pending; a
//! caching subject has at least `max_resolve` slots beyond the rows one
//! lease pins, so other rows can be resolved while it is held; and its
//! pin wait is short, so a leaked pin fails a case instead of stalling it.

use std::collections::BTreeSet;
use std::fmt;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use metrale_gpu_runtime::cpu::Latch;
use metrale_gpu_runtime::gpu::{DevicePtr, GpuBackend, LaunchConfig};
use metrale_storage::StorageError;
use metrale_storage::table::{RowRef, RowTable};

/// Why a case did not pass: the outcome type of every conformance suite
/// of the workspace, so a harness reads both suites' results alike.
pub use metrale_gpu_conformance::Failure;

/// Fail the case with a formatted message.
macro_rules! bail {
    ($($t:tt)*) => {
        return Err(Failure::Failed(format!($($t)*)))
    };
}

/// Fail the case with a formatted message unless the condition holds.
macro_rules! ensure {
    ($cond:expr, $($t:tt)*) => {
        if !$cond {
            bail!($($t)*);
        }
    };
}

/// A failed call as a case failure naming the step.
fn step<T, E: fmt::Display>(what: &str, r: Result<T, E>) -> Result<T, Failure> {
    r.map_err(|e| Failure::Failed(format!("{what}: {e}")))
}

/// A table under test and what the suite judges it by.
pub struct Subject {
    /// The table.
    pub table: Arc<dyn RowTable>,
    /// The backend it serves (one that runs host kernels).
    pub gpu: Arc<dyn GpuBackend>,
    /// The bytes row `id` must hold (`info().row_bytes()` of them).
    pub row: Box<dyn Fn(u64) -> Vec<u8> + Send + Sync>,
    /// While set, the table's reads of rows fail; `None` for tables that
    /// read nothing after they are opened.
    pub fault: Option<Arc<AtomicBool>>,
}

/// One property, checked on one subject.
pub type Case = fn(&Subject) -> Result<(), Failure>;

/// Every case, by name.
pub const CASES: &[(&str, Case)] = &[
    ("rows_read_back", rows_read_back),
    ("leases_held_until_gather", leases_held_until_gather),
    ("bad_ids_refused", bad_ids_refused),
    ("prefetch_is_advice", prefetch_is_advice),
    ("stats_count_ids", stats_count_ids),
    ("faults_surfaced", faults_surfaced),
];

/// Run every case on a fresh subject from `make`; the failures (skips
/// included), by case name.
pub fn run_each(make: &dyn Fn() -> Subject) -> Vec<(&'static str, Failure)> {
    CASES
        .iter()
        .filter_map(|(name, case)| case(&make()).err().map(|f| (*name, f)))
        .collect()
}

/// Panic naming every case that failed on the subjects of `make` (skips
/// are printed, not failures); what a test of one implementation calls.
pub fn assert_conforms(what: &str, make: &dyn Fn() -> Subject) {
    let mut failed = Vec::new();
    for (name, f) in run_each(make) {
        match f {
            Failure::Skipped(why) => eprintln!("{what}: {name} skipped: {why}"),
            Failure::Failed(m) => failed.push(format!("{name}: {m}")),
        }
    }
    assert!(
        failed.is_empty(),
        "{what} does not conform:\n{}",
        failed.join("\n")
    );
}

/// Up to `n` distinct ids spread over the table, first and last included.
fn spread(rows: u64, n: usize) -> Vec<u64> {
    let n = (n as u64).clamp(1, rows);
    if n == 1 {
        return vec![0];
    }
    let ids: BTreeSet<u64> = (0..n).map(|k| k * (rows - 1) / (n - 1)).collect();
    ids.into_iter().collect()
}

/// Check that the rows `refs` point at hold the bytes of `ids`.
fn check_rows(s: &Subject, ids: &[u64], refs: &[RowRef], when: &str) -> Result<(), Failure> {
    let rb = s.table.info().row_bytes();
    let mut buf = vec![0u8; rb];
    for (&id, r) in ids.iter().zip(refs) {
        step(
            &format!("{when}: reading row {id} at {:#x}", r.data),
            s.gpu.copy_d2h(DevicePtr(r.data), &mut buf),
        )?;
        ensure!(
            buf == (s.row)(id),
            "{when}: row {id} does not hold its bytes"
        );
    }
    Ok(())
}

/// Resolve `ids` in parts the table accepts, releasing each at once, and
/// check every part's rows.
fn resolve_all(s: &Subject, ids: &[u64], when: &str) -> Result<(), Failure> {
    let limit = s.table.max_resolve().max(1);
    for part in ids.chunks(limit) {
        let mut refs = vec![RowRef::default(); part.len()];
        let lease = step(
            &format!("{when}: resolve"),
            s.table.resolve(part, &mut refs),
        )?;
        let checked = check_rows(s, part, &refs, when);
        step(
            &format!("{when}: release"),
            s.table.release(lease, s.gpu.as_ref(), None),
        )?;
        checked?;
    }
    Ok(())
}

/// Hold leases on as many distinct rows as the table lets leases pin (up
/// to every row): a pin left behind by an earlier call shows as a resolve
/// that finds no slot.
fn no_pins_left(s: &Subject, when: &str) -> Result<(), Failure> {
    let rows = s.table.info().rows;
    let want = (s.table.max_pinned() as u64).min(rows).min(4096);
    let limit = s.table.max_resolve().max(1);
    let ids: Vec<u64> = (0..want).collect();
    let mut leases = Vec::new();
    let mut result = Ok(());
    for part in ids.chunks(limit) {
        let mut refs = vec![RowRef::default(); part.len()];
        match s.table.resolve(part, &mut refs) {
            Ok(l) => leases.push(l),
            Err(e) => {
                result = Err(Failure::Failed(format!(
                    "{when}: {want} rows could not all be pinned at once (a pin was left \
                     behind?): {e}"
                )));
                break;
            }
        }
    }
    for l in leases {
        step("release", s.table.release(l, s.gpu.as_ref(), None))?;
    }
    result
}

/// Rows read back as stored, through any mix of ids (repeats included).
pub fn rows_read_back(s: &Subject) -> Result<(), Failure> {
    let rows = s.table.info().rows;
    let mut ids = spread(rows, 64);
    ids.extend(spread(rows, 8));
    resolve_all(s, &ids, "a first resolve")?;
    resolve_all(s, &ids, "a second resolve")
}

/// A lease's rows stay in place while it is held, and after a release
/// with an event until that event has completed, however many other rows
/// are resolved meanwhile.
pub fn leases_held_until_gather(s: &Subject) -> Result<(), Failure> {
    let gpu = s.gpu.as_ref();
    let rows = s.table.info().rows;
    let held: Vec<u64> = spread(rows, s.table.max_resolve().clamp(1, 8));
    let others: Vec<u64> = (0..rows).filter(|i| !held.contains(i)).collect();
    let mut refs = vec![RowRef::default(); held.len()];
    // Held, not yet released.
    let lease = step("resolve", s.table.resolve(&held, &mut refs))?;
    resolve_all(s, &others, "other rows while a lease is held")?;
    check_rows(
        s,
        &held,
        &refs,
        "a held lease after other rows were resolved",
    )?;
    // Released behind a gather that has not run.
    let latch = Latch::new();
    let k = step(
        "latch kernel",
        latch.kernel(gpu, "table_conformance", "gate"),
    )?;
    let stream = step("stream", gpu.create_stream())?;
    let ev = step("event", gpu.create_event())?;
    let queued = gpu
        .launch(k, LaunchConfig::linear(1, 1))
        .run(stream)
        .and_then(|()| gpu.record_event(ev, stream));
    if let Err(e) = queued {
        latch.open();
        bail!("queueing the gate: {e}");
    }
    step(
        "release with a pending event",
        s.table.release(lease, gpu, Some(ev)),
    )?;
    let checked = resolve_all(s, &others, "other rows before the gather ran").and_then(|()| {
        check_rows(
            s,
            &held,
            &refs,
            "rows released behind a gather that has not run",
        )
    });
    latch.open();
    step("synchronize", gpu.synchronize(stream))?;
    checked?;
    step("stream", gpu.destroy_stream(stream))?;
    // Once it has run, the pins are gone.
    resolve_all(s, &others, "other rows after the gather ran")?;
    no_pins_left(s, "after the gather ran")
}

/// Ids at or past the end and outputs of the wrong length are refused with
/// their typed errors, and a refused batch pins nothing.
pub fn bad_ids_refused(s: &Subject) -> Result<(), Failure> {
    let rows = s.table.info().rows;
    for bad in [rows, rows + 1, u64::MAX] {
        let ids = [0, bad];
        let mut refs = [RowRef::default(); 2];
        match s.table.resolve(&ids, &mut refs) {
            Err(StorageError::RowOutOfRange { id, rows: r }) if id == bad && r == rows => {}
            Err(e) => bail!("id {bad} of a {rows}-row table: expected RowOutOfRange, got {e:?}"),
            Ok(l) => {
                let _ = s.table.release(l, s.gpu.as_ref(), None);
                bail!("id {bad} of a {rows}-row table was resolved")
            }
        }
    }
    let mut short = [RowRef::default(); 1];
    match s.table.resolve(&[0, rows - 1], &mut short) {
        Err(StorageError::OutputLength { ids: 2, out: 1 }) => {}
        Err(e) => bail!("2 ids into 1 output: expected OutputLength, got {e:?}"),
        Ok(l) => {
            let _ = s.table.release(l, s.gpu.as_ref(), None);
            bail!("2 ids were resolved into 1 output")
        }
    }
    no_pins_left(s, "after refused batches")?;
    resolve_all(s, &spread(rows, 16), "after refused batches")
}

/// Prefetch changes no resolve: of good ids it succeeds, of ids past the
/// end it succeeds or refuses them as a resolve does, and the rows resolve
/// to their bytes either way.
pub fn prefetch_is_advice(s: &Subject) -> Result<(), Failure> {
    let rows = s.table.info().rows;
    let ids = spread(rows, 32);
    step("prefetch", s.table.prefetch(&ids))?;
    match s.table.prefetch(&[0, rows]) {
        Ok(()) | Err(StorageError::RowOutOfRange { .. }) => {}
        Err(e) => bail!("prefetch of an id past the end: expected Ok or RowOutOfRange, got {e:?}"),
    }
    resolve_all(s, &ids, "prefetched rows")?;
    no_pins_left(s, "after prefetches")
}

/// Counters never go back, and a resolve of `n` ids counts each once, as
/// a hit or a miss, or not at all (tables without a cache report zeros).
pub fn stats_count_ids(s: &Subject) -> Result<(), Failure> {
    let rows = s.table.info().rows;
    let ids = spread(rows, s.table.max_resolve().clamp(1, 16));
    let before = s.table.stats();
    let mut refs = vec![RowRef::default(); ids.len()];
    let lease = step("resolve", s.table.resolve(&ids, &mut refs))?;
    step("release", s.table.release(lease, s.gpu.as_ref(), None))?;
    let after = s.table.stats();
    let counters = |t: &metrale_storage::table::TableStats| {
        [
            t.hits,
            t.misses,
            t.evictions,
            t.bytes_read,
            t.read_calls,
            t.pages_coalesced,
            t.host_hits,
        ]
    };
    ensure!(
        counters(&after)
            .iter()
            .zip(counters(&before))
            .all(|(a, b)| *a >= b),
        "counters went back: {before:?} then {after:?}"
    );
    let d = after.since(&before);
    let n = ids.len() as u64;
    ensure!(
        d.hits + d.misses == n || d.hits + d.misses == 0,
        "a resolve of {n} ids counted {} hits and {} misses",
        d.hits,
        d.misses
    );
    ensure!(
        d.host_hits <= d.misses,
        "more host-tier hits than misses: {d:?}"
    );
    ensure!(
        (d.misses > d.host_hits) == (d.bytes_read > 0) || d.hits + d.misses == 0,
        "rows read from disk and bytes read disagree: {d:?}"
    );
    Ok(())
}

/// A read that fails surfaces as an error from resolve, leaves no pins,
/// and the rows are read again once the fault is gone.
pub fn faults_surfaced(s: &Subject) -> Result<(), Failure> {
    let Some(fault) = &s.fault else {
        return Err(Failure::Skipped(
            "the table reads nothing after it is opened".into(),
        ));
    };
    let rows = s.table.info().rows;
    let ids = spread(rows, s.table.max_resolve().clamp(1, 16));
    fault.store(true, Ordering::SeqCst);
    let mut refs = vec![RowRef::default(); ids.len()];
    let r = s.table.resolve(&ids, &mut refs);
    fault.store(false, Ordering::SeqCst);
    if let Ok(l) = r {
        let _ = s.table.release(l, s.gpu.as_ref(), None);
        bail!("a resolve whose reads all failed succeeded");
    }
    no_pins_left(s, "after a failed resolve")?;
    resolve_all(s, &ids, "after the fault was gone")
}
