//! The family presets end to end through the binary: `init` writes each
//! (few table rows), `inspect` shows its family and layout, and `run
//! --verify` serves a short prompt workload whose every output row equals
//! a resident, uncached run's.

mod common;

use std::path::Path;

use common::{count, run};
use serde_json::Value;

/// Three short prompts, one a prefix of another, with the EOS/pad id 2.
const PROMPTS: &str = "[5, 17, 300, 2, 9, 41, 1000, 77]\n\
                       [5, 17, 300, 2, 9, 41, 1000, 77, 12, 13]\n\
                       [100, 129279, 3]\n";

fn init(tmp: &Path, preset: &str, rows: &str) -> String {
    let ck = tmp.join(preset);
    let ck = ck.to_str().unwrap().to_string();
    let (o, out, err) = run(
        tmp,
        &["init", &ck, "--preset", preset, "--table-rows", rows],
    );
    assert!(o.status.success(), "{preset}: {out}\n{err}");
    assert!(out.contains(preset), "{out}");
    ck
}

fn inspect(tmp: &Path, ck: &str) -> String {
    let (o, out, err) = run(tmp, &["inspect", ck]);
    assert!(o.status.success(), "{out}\n{err}");
    assert!(out.contains("validation          OK"), "{out}");
    out
}

/// `run --verify --json` over `prompts` (JSON lines) with small flags
/// plus `extra`; the report, checked to be verified over at least
/// `min_rows` rows.
fn verified_run(tmp: &Path, ck: &str, prompts: &str, min_rows: u64, extra: &[&str]) -> Value {
    let file = tmp.join("prompts.jsonl");
    std::fs::write(&file, prompts).unwrap();
    let mut args = vec![
        "run",
        ck,
        "--prompts",
        file.to_str().unwrap(),
        "--decode-tokens",
        "3",
        "--in-flight",
        "2",
        "--decode-batch",
        "2",
        "--prefill-chunk",
        "4",
        "--block-size",
        "4",
        "--verify",
        "--json",
    ];
    args.extend_from_slice(extra);
    let (o, out, err) = run(tmp, &args);
    assert!(o.status.success(), "{ck}: {out}\n{err}");
    let v: Value = serde_json::from_str(&out).unwrap_or_else(|e| panic!("{e}: {out}"));
    assert_eq!(v["verify"]["identical"], Value::Bool(true), "{out}");
    assert!(count(&v, &["verify", "rows_compared"]) >= min_rows, "{out}");
    v
}

#[test]
fn the_engram_demo_runs_verified() {
    let tmp = tempfile::tempdir().unwrap();
    let ck = init(tmp.path(), "engram-demo", "2048");
    let out = inspect(tmp.path(), &ck);
    assert!(out.contains("family              Engram (demo)"), "{out}");
    assert!(out.contains("dilated short conv"), "{out}");
    assert!(out.contains("model.layers.15.engram"), "{out}");
    assert!(out.contains("147456 B conv state"), "{out}");
    verified_run(tmp.path(), &ck, PROMPTS, 12, &["--decode-graphs"]);
}

#[test]
fn longcat_runs_verified() {
    let tmp = tempfile::tempdir().unwrap();
    let ck = init(tmp.path(), "longcat-flash-lite", "1200");
    let out = inspect(tmp.path(), &ck);
    assert!(
        out.contains("family              LongCat n-gram embedding"),
        "{out}"
    );
    assert!(out.contains("sub-table 11"), "{out}");
    assert!(out.contains("0 B conv state"), "{out}");
    verified_run(tmp.path(), &ck, PROMPTS, 12, &["--table", "mapped"]);
    // Each sub-table behind its own small row cache (256 slots shared by
    // 12), decode steps replayed from a captured graph.
    let v = verified_run(
        tmp.path(),
        &ck,
        PROMPTS,
        12,
        &["--decode-graphs", "--slots", "256"],
    );
    assert!(count(&v, &["row_cache", "misses"]) > 0, "{v}");
    assert!(count(&v, &["decode_graphs", "replays"]) > 0, "{v}");
}

#[test]
fn deepseek_v41_runs_verified() {
    let tmp = tempfile::tempdir().unwrap();
    let ck = init(tmp.path(), "deepseek-v4.1", "256");
    let out = inspect(tmp.path(), &ck);
    assert!(
        out.contains("family              Engram (DeepSeek-V4.1)"),
        "{out}"
    );
    assert!(out.contains("UE8M0 scale per 32 values"), "{out}");
    assert!(out.contains("264 B each"), "{out}");
    // Fewer tokens: each runs a [25600, 6144] projection per layer.
    verified_run(
        tmp.path(),
        &ck,
        "[5, 17, 2, 9]\n[5, 17, 2, 9, 41]\n",
        6,
        &[],
    );
}
