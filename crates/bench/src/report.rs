//! The table `metrale-ple bench` prints: one [`Row`] per figure, as
//! aligned text or as JSON.
//!
//! Invariant: a row's ratio is always "times faster than the baseline"
//! (below 1: slower), whatever the unit: value / baseline for rates
//! ([`Row::rate`]), baseline / value for times ([`Row::cost`]).

use std::io::Write;

use anyhow::Result;
use serde::Serialize;

/// One line of the table.
#[derive(Serialize, Debug)]
pub struct Row {
    area: &'static str,
    figure: String,
    value: f64,
    unit: &'static str,
    /// What the baseline is (same unit as the value).
    baseline: String,
    baseline_value: f64,
    /// Times faster than the baseline.
    ratio: f64,
}

impl Row {
    /// A rate (higher is better).
    pub fn rate(
        area: &'static str,
        figure: String,
        value: f64,
        unit: &'static str,
        baseline: &str,
        base: f64,
    ) -> Row {
        Row {
            area,
            figure,
            value,
            unit,
            baseline: baseline.to_string(),
            baseline_value: base,
            ratio: value / base,
        }
    }

    /// A time or cost (lower is better).
    pub fn cost(
        area: &'static str,
        figure: String,
        value: f64,
        unit: &'static str,
        baseline: &str,
        base: f64,
    ) -> Row {
        Row {
            ratio: base / value,
            ..Row::rate(area, figure, value, unit, baseline, base)
        }
    }
}

/// Three significant figures or so, without exponents.
fn num(v: f64) -> String {
    let a = v.abs();
    if a >= 100.0 {
        format!("{v:.1}")
    } else if a >= 10.0 {
        format!("{v:.2}")
    } else if a >= 0.01 {
        format!("{v:.3}")
    } else {
        format!("{v:.3e}")
    }
}

/// Print `rows` to stdout, as JSON or as a text table.
pub fn print_rows(rows: &[Row], json: bool) -> Result<()> {
    let mut out = std::io::stdout().lock();
    if json {
        serde_json::to_writer_pretty(&mut out, rows)?;
        writeln!(out)?;
        return Ok(out.flush()?);
    }
    let cells: Vec<[String; 5]> = rows
        .iter()
        .map(|r| {
            [
                r.area.to_string(),
                r.figure.clone(),
                format!("{} {}", num(r.value), r.unit),
                format!("{}: {} {}", r.baseline, num(r.baseline_value), r.unit),
                format!("{}x", num(r.ratio)),
            ]
        })
        .collect();
    let head = ["area", "figure", "value", "baseline (same run)", "ratio"];
    let mut w = head.map(str::len);
    for c in &cells {
        for (w, c) in w.iter_mut().zip(c) {
            *w = (*w).max(c.chars().count());
        }
    }
    let line = |out: &mut std::io::StdoutLock<'_>, c: &[&str; 5]| {
        writeln!(
            out,
            "{:<w0$} | {:<w1$} | {:>w2$} | {:<w3$} | {:>w4$}",
            c[0],
            c[1],
            c[2],
            c[3],
            c[4],
            w0 = w[0],
            w1 = w[1],
            w2 = w[2],
            w3 = w[3],
            w4 = w[4]
        )
    };
    line(&mut out, &head)?;
    writeln!(
        out,
        "{}",
        w.iter()
            .map(|&n| "-".repeat(n))
            .collect::<Vec<_>>()
            .join("-+-")
    )?;
    for c in &cells {
        line(&mut out, &c.each_ref().map(String::as_str))?;
    }
    writeln!(
        out,
        "ratio: times faster than the baseline (below 1: slower); medians of repeated runs"
    )?;
    Ok(out.flush()?)
}
