//! `bench offload --packed --padded` at the hidden `--smoke` sizes: the
//! hot-row packed table and the padded one are measured beside the others, every cached row reports
//! the bytes it read per byte of the rows it missed, every row the host
//! time of its phases, and the packed copy is removed after the run. With
//! `--corpus`, the decode tokens are a corpus's documents, and a bad
//! corpus is refused naming its file and line. With `--micro-batches`, each
//! step decodes its sequences in groups; `--cache-slots` sizes the row
//! cache, at most an eighth of the table.

use std::ffi::OsStr;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use serde_json::Value;

/// `bench offload` at the smoke sizes without the backbone, on the
/// checkpoint `ck` (written there when absent), with `extra` arguments.
fn smoke_without_backbone(ck: &Path, extra: &[&OsStr]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_metrale-ple"))
        .args(["bench", "offload", "--smoke", "--json"])
        .args(["--only-backbone", "off", "--checkpoint"])
        .arg(ck)
        .args(extra)
        .output()
        .expect("run metrale-ple")
}

/// The JSON report of a run that must have succeeded.
fn report_of(out: &Output) -> Value {
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "status {:?}: {stderr}", out.status);
    serde_json::from_slice(&out.stdout).expect("one JSON object")
}

/// Asserts that a run was refused as bad input (exit 2) with `message`.
fn assert_refused(out: &Output, message: &str) {
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains(message), "{stderr}");
}

#[test]
fn offload_measures_the_packed_table_and_reports_reads_per_missed_byte_and_phases() {
    let dir = tempfile::tempdir().unwrap();
    let ck = dir.path().join("ck");
    let out = Command::new(env!("CARGO_BIN_EXE_metrale-ple"))
        .args([
            "bench", "offload", "--smoke", "--json", "--packed", "--padded",
        ])
        .args(["--only-backbone", "off", "--checkpoint"])
        .arg(&ck)
        .output()
        .expect("run metrale-ple");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "status {:?}: {stderr}", out.status);
    let report: Value = serde_json::from_slice(&out.stdout).expect("one JSON object");
    let rows = report["rows"].as_array().expect("a rows array");
    let mut seen = Vec::new();
    for row in rows {
        let table = row["table"].as_str().unwrap();
        let prefetch = row["prefetch"].as_bool().unwrap();
        seen.push((table.to_string(), prefetch));
        let cached = matches!(table, "cached" | "packed" | "padded");
        let ratio = &row["read_bytes_per_missed_row_byte"];
        assert_eq!(ratio.is_number(), cached, "{row:#}");
        if cached {
            // Direct-I/O spans hold whole rows: at least the row's bytes.
            assert!(ratio.as_f64().unwrap() >= 1.0, "{row:#}");
            assert!(row["hit_rate"].is_number(), "{row:#}");
        }
        let p = &row["phases"];
        assert!(p["decode"].as_f64().unwrap() > 0.0, "{row:#}");
        for key in ["prefetch", "prefetch_hash", "site_host", "io_wait"] {
            assert!(p[key].as_f64().unwrap() >= 0.0, "{key} in {row:#}");
        }
        // The step prefetch hashes; without it nothing is timed there.
        assert_eq!(
            p["prefetch_hash"].as_f64().unwrap() > 0.0,
            prefetch,
            "{row:#}"
        );
        assert_eq!(
            p["prefetch_thread_cpu"].is_number(),
            cached && p["process_cpu"].is_number()
        );
    }
    let want: Vec<(String, bool)> = [false, true]
        .into_iter()
        .flat_map(|p| {
            ["resident", "mapped", "cached", "packed", "padded"].map(|t| (t.to_string(), p))
        })
        .collect();
    assert_eq!(seen, want);
    // Padded rows (320 bytes, 512 apart) sit in one granule each: a miss
    // reads no more than the unpadded table's.
    let ratio = |table: &str| {
        rows.iter()
            .filter(|r| r["table"] == table)
            .map(|r| r["read_bytes_per_missed_row_byte"].as_f64().unwrap())
            .fold(0.0f64, f64::max)
    };
    assert!(ratio("padded") <= ratio("cached"), "{rows:#?}");
    // The packed and padded copies live only for the run.
    let copies: Vec<PathBuf> = stderr
        .lines()
        .filter(|l| l.contains("relaying") || l.contains("padding"))
        .filter_map(|l| l.split(" into ").nth(1))
        .map(|p| PathBuf::from(p.trim()))
        .collect();
    assert_eq!(copies.len(), 2, "{stderr}");
    for c in copies {
        assert!(!c.exists(), "{} left behind", c.display());
    }
    assert!(ck.join("config.json").is_file());
}

#[test]
fn offload_decodes_a_corpus_and_refuses_a_bad_one() {
    let dir = tempfile::tempdir().unwrap();
    let ck = dir.path().join("ck");
    // Ten documents of a small repeating text: its rows repeat, so a
    // filled cache hits far more often than on Zipf draws.
    let corpus = dir.path().join("corpus.jsonl");
    let doc: Vec<u32> = (0..40).map(|i| 100 + (i * 7) % 13).collect();
    let text: String = (0..10)
        .map(|_| serde_json::to_string(&doc).unwrap() + "\n")
        .collect();
    std::fs::write(&corpus, text).unwrap();
    let run =
        |corpus: &Path| smoke_without_backbone(&ck, &[OsStr::new("--corpus"), corpus.as_os_str()]);
    let out = run(&corpus);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "status {:?}: {stderr}", out.status);
    let report: Value = serde_json::from_slice(&out.stdout).expect("one JSON object");
    assert_eq!(report["workload"], corpus.display().to_string());
    assert_eq!(report["corpus_documents"], 10);
    // The fill alone reads far more than ten short documents.
    assert_eq!(report["corpus_reread"], true);
    assert!(stderr.contains("read more than once"), "{stderr}");
    for row in report["rows"].as_array().unwrap() {
        if row["table"] == "cached" {
            let fill = row["fill_hit_rate"].as_f64().unwrap();
            assert!(fill > 0.5, "a repeating corpus hits: {row:#}");
        }
    }

    let bad = dir.path().join("bad.jsonl");
    std::fs::write(&bad, "[1, 2]\n[3, 99999999]\n").unwrap();
    let out = run(&bad);
    assert_eq!(out.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("bad.jsonl line 2") && stderr.contains("99999999"),
        "{stderr}"
    );
}

/// `--micro-batches 2`: every table measured with each step's sequences
/// decoded in two groups, the report saying so; more groups than the run
/// has sequences is refused before anything runs.
#[test]
fn offload_decodes_in_micro_batches_and_refuses_more_than_its_sequences() {
    let dir = tempfile::tempdir().unwrap();
    let ck = dir.path().join("ck");
    let groups =
        |n: &str| smoke_without_backbone(&ck, &[OsStr::new("--micro-batches"), OsStr::new(n)]);
    let report = report_of(&groups("2"));
    assert_eq!(report["micro_batches"], 2);
    let rows = report["rows"].as_array().expect("a rows array");
    assert_eq!(rows.len(), 6, "{report:#}");
    for row in rows {
        assert!(
            row["decode_tokens_per_s"].as_f64().unwrap() > 0.0,
            "{row:#}"
        );
    }
    assert_refused(
        &groups("3"),
        "--micro-batches must be between 1 and the run's 2 sequences",
    );
}

/// `--cache-slots`: the cache the run reports is the one asked for, and a
/// cache larger than an eighth of the table, or empty, is refused naming
/// the bound.
#[test]
fn offload_sizes_the_cache_and_refuses_one_over_an_eighth_of_the_table() {
    let dir = tempfile::tempdir().unwrap();
    let ck = dir.path().join("ck");
    let slots =
        |n: &str| smoke_without_backbone(&ck, &[OsStr::new("--cache-slots"), OsStr::new(n)]);
    let report = report_of(&slots("2048"));
    assert_eq!(report["table_rows"], 1 << 14, "{report:#}");
    assert_eq!(report["cache_slots"], 2048, "{report:#}");
    assert_eq!(report["cache_bytes"], 2048 * 256, "{report:#}");
    let cached: Vec<&Value> = report["rows"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|r| r["table"] == "cached")
        .collect();
    assert!(!cached.is_empty(), "{report:#}");
    for row in cached {
        assert!(row["hit_rate"].as_f64().is_some(), "{row:#}");
    }
    for bad in ["2049", "0"] {
        assert_refused(
            &slots(bad),
            &format!(
                "--cache-slots {bad}: must be between 1 and an eighth of the table's 16384 \
                 stored rows (2048)"
            ),
        );
    }
}
