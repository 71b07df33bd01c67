//! The conformance suite: behaviour every [`GpuBackend`] must show.
//!
//! One suite for every backend: each case is a [`Case`], a
//! `fn(&dyn GpuBackend) -> Result<(), Failure>` that reports the first thing
//! that went wrong; [`CASES`] lists them all by name, [`run_all`] runs them
//! on one backend and [`run_each`] each on a fresh one. Errors are checked
//! by [`GpuError`] variant first and by what their message names (operation,
//! pointer, stream, kernel) second, so a backend conforms by behaviour, not
//! by wording. Cases that need kernels use host kernels the suite registers
//! itself (module `conformance`); on a backend without host kernels they
//! return [`Failure::Skipped`].
//!
//! Invariants the cases rely on: each case leaves the backend with the live
//! allocations it found (checked at the end), and nothing blocks forever:
//! the gate kernel gives up after a timeout and fails instead.
//!
//! The cases live by concern in [`memory`], [`streams`], [`launch`] and
//! [`graphs`]; `check` holds what they share.

use std::fmt;
use std::sync::Arc;

use metrale_gpu_runtime::GpuError;
use metrale_gpu_runtime::gpu::GpuBackend;

/// Fail the case with a formatted message.
macro_rules! bail {
    ($($t:tt)*) => {
        return Err($crate::Failure::Failed(format!($($t)*)))
    };
}

/// Fail the case with a formatted message unless the condition holds.
macro_rules! ensure {
    ($cond:expr $(,)?) => {
        ensure!($cond, "check failed: {}", stringify!($cond))
    };
    ($cond:expr, $($t:tt)*) => {
        if !$cond {
            bail!($($t)*);
        }
    };
}

/// Check that a call failed with an error matching the pattern whose
/// message names every needle; evaluates to the error.
macro_rules! expect_err {
    ($r:expr, $pat:pat, $needles:expr $(,)?) => {
        $crate::check::expect_err(
            $r,
            stringify!($pat),
            |e: &GpuError| matches!(e, $pat),
            $needles,
        )
    };
}

mod check;
pub mod graphs;
pub mod launch;
pub mod memory;
pub mod streams;

/// Why a case did not pass.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Failure {
    /// The subject cannot run or show the case (a backend without host
    /// kernels, a table without reads to fault); not a failure of it.
    Skipped(String),
    /// The subject behaved wrongly: what was expected and what happened.
    Failed(String),
}

impl fmt::Display for Failure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Failure::Skipped(why) => write!(f, "skipped: {why}"),
            Failure::Failed(what) => f.write_str(what),
        }
    }
}

impl std::error::Error for Failure {}

/// A backend error where the case expected success.
impl From<GpuError> for Failure {
    fn from(e: GpuError) -> Self {
        Failure::Failed(format!("unexpected error: {e}"))
    }
}

/// What a case returns.
pub type CaseResult = Result<(), Failure>;

/// A conformance case.
pub type Case = fn(&dyn GpuBackend) -> CaseResult;

/// Every case, by name.
pub const CASES: &[(&str, Case)] = &[
    ("alloc_free_accounting", memory::alloc_free_accounting),
    ("sync_copies", memory::sync_copies),
    ("async_copies_in_order", memory::async_copies_in_order),
    (
        "h2d_async_source_copied_at_call",
        memory::h2d_async_source_copied_at_call,
    ),
    ("memory_errors", memory::memory_errors),
    ("free_errors", memory::free_errors),
    ("host_mapped_memory", memory::host_mapped_memory),
    ("registered_host_memory", memory::registered_host_memory),
    ("streams", streams::streams),
    (
        "stream_asynchrony_and_events",
        streams::stream_asynchrony_and_events,
    ),
    ("events", streams::events),
    ("kernel_registry", launch::kernel_registry),
    ("kernel_arguments", launch::kernel_arguments),
    ("kernel_argument_errors", launch::kernel_argument_errors),
    ("sticky_async_errors", launch::sticky_async_errors),
    ("capture_and_replay", graphs::capture_and_replay),
    ("capture_refusals", graphs::capture_refusals),
    (
        "capture_of_mapped_staging",
        graphs::capture_of_mapped_staging,
    ),
    ("capture_with_events", graphs::capture_with_events),
    ("graph_errors", graphs::graph_errors),
];

/// The case called `name`.
pub fn case(name: &str) -> Option<Case> {
    CASES.iter().find(|(n, _)| *n == name).map(|&(_, c)| c)
}

/// The outcome of a run of the suite.
#[derive(Debug, Default)]
pub struct Report {
    /// Cases that passed.
    pub passed: Vec<&'static str>,
    /// Cases the backend could not run, with why.
    pub skipped: Vec<(&'static str, String)>,
    /// Cases that failed, with what went wrong.
    pub failed: Vec<(&'static str, String)>,
}

impl Report {
    /// Whether no case failed (skipped cases do not count against it).
    pub fn is_ok(&self) -> bool {
        self.failed.is_empty()
    }

    fn record(&mut self, name: &'static str, r: CaseResult) {
        match r {
            Ok(()) => self.passed.push(name),
            Err(Failure::Skipped(why)) => self.skipped.push((name, why)),
            Err(Failure::Failed(what)) => self.failed.push((name, what)),
        }
    }
}

impl fmt::Display for Report {
    /// One line of counts, then one line per failed or skipped case.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(
            f,
            "{} passed, {} failed, {} skipped",
            self.passed.len(),
            self.failed.len(),
            self.skipped.len()
        )?;
        for (name, what) in &self.failed {
            writeln!(f, "FAILED {name}: {what}")?;
        }
        for (name, why) in &self.skipped {
            writeln!(f, "skipped {name}: {why}")?;
        }
        Ok(())
    }
}

/// Run every case, in order, on `gpu` (each case cleans up after itself).
pub fn run_all(gpu: &dyn GpuBackend) -> Report {
    let mut r = Report::default();
    for &(name, case) in CASES {
        r.record(name, case(gpu));
    }
    r
}

/// Run every case, each on a fresh backend from `make`, so one case's
/// failure cannot leak into the next.
pub fn run_each(make: &dyn Fn() -> Arc<dyn GpuBackend>) -> Report {
    let mut r = Report::default();
    for &(name, case) in CASES {
        let gpu = make();
        r.record(name, case(gpu.as_ref()));
    }
    r
}
