//! `metrale-ple bench` end to end, at the hidden `--smoke` sizes (a debug
//! build must finish in seconds): the JSON table has every figure once,
//! each with a finite positive value, baseline and ratio, and the scratch
//! directory is left empty.

use std::process::Command;

use serde_json::Value;

/// Area and the start of the figure text of every row, in order.
const FIGURES: [(&str, &str); 11] = [
    ("ids", "prefill hash"),
    ("ids", "batched decode hash"),
    ("storage", "resident gather"),
    ("storage", "cached-table hit path"),
    ("storage", "miss path"),
    ("layer", "forward prefill"),
    ("layer", "forward batched decode"),
    ("engine", "prefix-cache restore"),
    ("engine", "swap-out"),
    ("engine", "swap-in"),
    ("runtime", "copy_d2d_async"),
];

#[test]
fn smoke_run_prints_every_figure_as_json() {
    let dir = tempfile::tempdir().unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_metrale-ple"))
        .args(["bench", "--quick", "--json", "--smoke", "--dir"])
        .arg(dir.path())
        .output()
        .expect("run metrale-ple");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "status {:?}, stderr: {stderr}",
        out.status
    );
    let rows: Value = serde_json::from_slice(&out.stdout).unwrap_or_else(|e| {
        panic!(
            "stdout is not JSON ({e}): {}",
            String::from_utf8_lossy(&out.stdout)
        )
    });
    let rows = rows.as_array().expect("a JSON array");
    assert_eq!(rows.len(), FIGURES.len(), "rows: {rows:#?}");
    for (row, (area, figure)) in rows.iter().zip(FIGURES) {
        assert_eq!(row["area"], area, "{row:#}");
        let text = row["figure"].as_str().expect("a figure string");
        assert!(text.starts_with(figure), "{text:?} is not {figure:?}");
        for key in ["unit", "baseline"] {
            assert!(
                row[key].as_str().is_some_and(|s| !s.is_empty()),
                "{key} missing in {row:#}"
            );
        }
        for key in ["value", "baseline_value", "ratio"] {
            let v = row[key].as_f64().unwrap_or(f64::NAN);
            assert!(v.is_finite() && v > 0.0, "{key} = {v} in {row:#}");
        }
    }
    let left: Vec<_> = std::fs::read_dir(dir.path()).unwrap().collect();
    assert!(left.is_empty(), "scratch files left behind: {left:?}");
}

#[test]
fn text_table_help_and_bad_dir() {
    let out = Command::new(env!("CARGO_BIN_EXE_metrale-ple"))
        .args(["bench", "--smoke"])
        .output()
        .expect("run metrale-ple");
    assert!(out.status.success());
    let text = String::from_utf8(out.stdout).unwrap();
    assert!(text.starts_with("area"), "{text}");
    // Header, rule, one line per figure, the note on ratios.
    assert_eq!(text.lines().count(), FIGURES.len() + 3, "{text}");
    assert!(text.contains("ratio: times faster than the baseline"));

    let out = Command::new(env!("CARGO_BIN_EXE_metrale-ple"))
        .args(["bench", "--help"])
        .output()
        .expect("run metrale-ple");
    let help = String::from_utf8(out.stdout).unwrap();
    assert!(
        help.contains("--quick") && help.contains("--json"),
        "{help}"
    );
    assert!(!help.contains("--smoke"), "{help}");

    let out = Command::new(env!("CARGO_BIN_EXE_metrale-ple"))
        .args(["bench", "--smoke", "--dir", "/nonexistent/metrale-bench"])
        .output()
        .expect("run metrale-ple");
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("not a directory"));
}

/// `bench offload` at the hidden `--smoke` sizes: one JSON object whose
/// rows cover every table with prefetch off and on, without and with the
/// backbone, with the measured figures present where the table produces
/// them.
#[test]
fn offload_smoke_run_prints_every_table_as_json() {
    let dir = tempfile::tempdir().unwrap();
    let ck = dir.path().join("ck");
    let out = Command::new(env!("CARGO_BIN_EXE_metrale-ple"))
        .args([
            "bench",
            "offload",
            "--smoke",
            "--reps",
            "6",
            "--json",
            "--checkpoint",
        ])
        .arg(&ck)
        .output()
        .expect("run metrale-ple");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "status {:?}, stderr: {stderr}",
        out.status
    );
    let report: Value = serde_json::from_slice(&out.stdout).expect("one JSON object");
    assert!(report["disk_random_reads_per_s"].as_f64().unwrap() > 0.0);
    assert!(report["disk_round_us"].as_f64().unwrap() > 0.0);
    assert!(report["disk_read_cpu_us"].as_f64().unwrap().is_finite());
    let rows = report["rows"].as_array().expect("a rows array");
    let mut seen = Vec::new();
    for row in rows {
        let table = row["table"].as_str().unwrap();
        seen.push((
            table.to_string(),
            row["prefetch"].as_bool().unwrap(),
            row["backbone"].as_bool().unwrap(),
        ));
        assert!(
            row["decode_tokens_per_s"].as_f64().unwrap() > 0.0,
            "{row:#}"
        );
        assert!(row["overhead_vs_resident_pct"].is_number(), "{row:#}");
        // Six repetitions give the median an interval, which holds it.
        let ci = row["overhead_ci95_pct"].as_array().expect("an interval");
        let (lo, hi) = (ci[0].as_f64().unwrap(), ci[1].as_f64().unwrap());
        let mid = row["overhead_vs_resident_pct"].as_f64().unwrap();
        assert!(lo <= mid && mid <= hi, "{row:#}");
        let cached = table == "cached";
        for key in [
            "hit_rate",
            "io_wait_share",
            "read_share",
            "exposed_wait_share",
        ] {
            assert_eq!(row[key].is_number(), cached, "{key} in {row:#}");
        }
        assert!(row["bytes_read_per_token"].as_f64().is_some() || !cached);
        // Row caches are filled with the stream before decoding.
        assert_eq!(row["fill_tokens"].as_u64().is_some_and(|t| t > 0), cached);
        assert_eq!(row["fill_hit_rate"].is_number(), cached, "{row:#}");
    }
    assert_eq!(report["workload"], "zipf");
    assert_eq!(report["corpus_documents"], 0);
    assert_eq!(report["corpus_reread"], false);
    let want: Vec<(String, bool, bool)> = [false, true]
        .into_iter()
        .flat_map(|b| [false, true].map(move |p| (p, b)))
        .flat_map(|(p, b)| ["resident", "mapped", "cached"].map(|t| (t.to_string(), p, b)))
        .collect();
    assert_eq!(seen, want);
    assert_eq!(report["micro_batches"], 1);
    // The checkpoint written for the run stays for the next one.
    assert!(ck.join("config.json").is_file());
}

/// `--preset` with `--only`: a family's hash and layer figures, the layer
/// rows naming the family. DeepSeek-V4.1 is left out: its [25600, 6144]
/// projection makes the naive baseline minutes long in a debug build.
#[test]
fn family_presets_print_their_hash_and_layer_figures() {
    for (preset, family) in [("engram-demo", "engram"), ("longcat-flash-lite", "longcat")] {
        let dir = tempfile::tempdir().unwrap();
        let out = Command::new(env!("CARGO_BIN_EXE_metrale-ple"))
            .args(["bench", "--json", "--smoke", "--only", "ids,layer"])
            .args(["--preset", preset, "--dir"])
            .arg(dir.path())
            .output()
            .expect("run metrale-ple");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "{preset}: {stderr}");
        let rows: Value = serde_json::from_slice(&out.stdout).expect("JSON");
        let rows = rows.as_array().expect("a JSON array");
        let areas: Vec<&str> = rows.iter().map(|r| r["area"].as_str().unwrap()).collect();
        assert_eq!(
            areas,
            ["ids", "ids", "layer", "layer"],
            "{preset}: {rows:#?}"
        );
        let prefill = rows[2]["figure"].as_str().unwrap();
        assert!(prefill.contains(family), "{preset}: {prefill}");
        for row in rows {
            let v = row["value"].as_f64().unwrap_or(f64::NAN);
            assert!(v.is_finite() && v > 0.0, "{preset}: {row:#}");
        }
    }
}
