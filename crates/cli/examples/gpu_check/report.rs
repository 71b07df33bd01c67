//! The results: checks (pass or fail, with error statistics where outputs
//! are compared), measurements (each beside its same-run baseline), and the
//! JSON file they are written to.

use std::path::Path;

use serde_json::{Value, json};

use super::Target;

/// Error statistics of one output against its reference.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Diff {
    /// Values compared.
    pub n: usize,
    /// Values whose bits differ.
    pub differing: usize,
    /// Largest absolute difference.
    pub max_abs: f64,
    /// Mean absolute difference.
    pub mean_abs: f64,
    /// Values outside `atol + rtol * |reference|` (NaN against a number
    /// counts).
    pub outside: usize,
}

impl Diff {
    /// Compare `got` with `want` under `atol + rtol * |want|`.
    pub fn of(got: &[f32], want: &[f32], atol: f64, rtol: f64) -> Diff {
        let mut d = Diff {
            n: got.len().min(want.len()),
            differing: got.len().abs_diff(want.len()),
            max_abs: 0.0,
            mean_abs: 0.0,
            outside: got.len().abs_diff(want.len()),
        };
        let mut sum = 0.0;
        for (&g, &w) in got.iter().zip(want) {
            if g.to_bits() == w.to_bits() {
                continue;
            }
            d.differing += 1;
            let e = (f64::from(g) - f64::from(w)).abs();
            if e.is_nan() {
                d.outside += 1;
                d.max_abs = f64::INFINITY;
                continue;
            }
            sum += e;
            d.max_abs = d.max_abs.max(e);
            if e > atol + rtol * f64::from(w).abs() {
                d.outside += 1;
            }
        }
        d.mean_abs = if d.n == 0 { 0.0 } else { sum / d.n as f64 };
        d
    }

    /// Whether every bit matches.
    pub fn identical(&self) -> bool {
        self.differing == 0
    }
}

/// Everything found so far.
pub struct Report {
    device: String,
    stand_in: bool,
    conformance: Value,
    checks: Vec<Value>,
    measurements: Vec<Value>,
    failed: usize,
}

impl Report {
    /// An empty report for `target`.
    pub fn new(target: &Target) -> Report {
        Report {
            device: target.name.clone(),
            stand_in: target.stand_in,
            conformance: Value::Null,
            checks: Vec::new(),
            measurements: Vec::new(),
            failed: 0,
        }
    }

    /// The conformance suite's counts.
    pub fn conformance(&mut self, v: Value) {
        self.conformance = v;
    }

    /// A check that passed or failed, with `detail`.
    pub fn check(&mut self, name: &str, passed: bool, detail: Value) {
        eprintln!(
            "gpu_check:   {} {name} {detail}",
            if passed { "ok  " } else { "FAIL" }
        );
        if !passed {
            self.failed += 1;
        }
        self.checks
            .push(json!({ "name": name, "passed": passed, "detail": detail }));
    }

    /// A check that `got` equals `want` bit for bit.
    pub fn bitwise(&mut self, name: &str, got: &[f32], want: &[f32]) {
        let d = Diff::of(got, want, 0.0, 0.0);
        self.check(name, d.identical(), diff_json(&d, "bit-identical"));
    }

    /// A check that `got` is within `atol + rtol * |want|` of `want`.
    pub fn within(&mut self, name: &str, got: &[f32], want: &[f32], atol: f64, rtol: f64) {
        let d = Diff::of(got, want, atol, rtol);
        let tol = format!("|d| <= {atol:e} + {rtol:e} * |cpu|");
        self.check(name, d.outside == 0 && d.n > 0, diff_json(&d, &tol));
    }

    /// A check that failed with an error before producing outputs.
    pub fn error(&mut self, name: &str, e: &anyhow::Error) {
        self.check(name, false, json!({ "error": format!("{e:#}") }));
    }

    /// A measurement beside its baseline (both in `unit`, higher is better).
    pub fn measure(&mut self, name: &str, value: f64, unit: &str, baseline: &str, base: f64) {
        let ratio = if base > 0.0 { value / base } else { f64::NAN };
        eprintln!(
            "gpu_check:   {name}: {value:.3} {unit} (baseline {baseline}: {base:.3} {unit}, x{ratio:.2})"
        );
        self.measurements.push(json!({
            "name": name,
            "value": value,
            "unit": unit,
            "baseline": baseline,
            "baseline_value": base,
            "ratio": ratio,
        }));
    }

    /// A measurement that could not be taken.
    pub fn unmeasured(&mut self, name: &str, why: &str) {
        eprintln!("gpu_check:   {name}: not measured: {why}");
        self.measurements
            .push(json!({ "name": name, "skipped": why }));
    }

    /// Checks recorded.
    pub fn checks(&self) -> usize {
        self.checks.len()
    }

    /// Checks failed.
    pub fn failures(&self) -> usize {
        self.failed
    }

    /// Whether every check passed.
    pub fn ok(&self) -> bool {
        self.failed == 0
    }

    /// The report as JSON.
    pub fn to_json(&self) -> Value {
        json!({
            "device": self.device,
            "stand_in": self.stand_in,
            "passed": self.ok(),
            "conformance": self.conformance,
            "checks": self.checks,
            "measurements": self.measurements,
        })
    }

    /// Write the JSON to `path`.
    pub fn write(&self, path: &Path) -> std::io::Result<()> {
        let text = serde_json::to_string_pretty(&self.to_json()).map_err(std::io::Error::other)?;
        std::fs::write(path, text + "\n")
    }
}

fn diff_json(d: &Diff, tolerance: &str) -> Value {
    json!({
        "values": d.n,
        "differing_bits": d.differing,
        "max_abs_err": d.max_abs,
        "mean_abs_err": d.mean_abs,
        "outside_tolerance": d.outside,
        "tolerance": tolerance,
    })
}
