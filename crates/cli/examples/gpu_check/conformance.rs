//! The backend conformance suite on the device: every case on a fresh
//! backend; cases that need host kernels report themselves skipped on a
//! backend without them.

use serde_json::json;

use super::Target;
use super::report::Report;

/// Run the suite and record one check.
pub fn run(target: &Target, report: &mut Report) {
    eprintln!("gpu_check: conformance suite");
    let r = metrale_gpu_conformance::run_each(&*target.make);
    let failed: Vec<_> = r
        .failed
        .iter()
        .map(|(n, why)| json!({ "case": n, "why": why }))
        .collect();
    let skipped: Vec<_> = r
        .skipped
        .iter()
        .map(|(n, why)| json!({ "case": n, "why": why }))
        .collect();
    let counts = json!({
        "cases": metrale_gpu_conformance::CASES.len(),
        "passed": r.passed.len(),
        "skipped": skipped,
        "failed": failed,
    });
    report.conformance(counts.clone());
    report.check(
        "conformance suite",
        r.failed.is_empty() && !r.passed.is_empty(),
        json!({ "passed": r.passed.len(), "skipped": r.skipped.len(), "failed": r.failed.len() }),
    );
}
