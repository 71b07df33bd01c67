//! `metrale-ple run` end to end: the default checkpoint written on first
//! use, a small workload with `--verify --json` that exercises prefix
//! hits, preemption and the row cache, prompt files, and refusals.

mod common;

use common::{count, run};
use serde_json::Value;

const SMALL: &[&str] = &[
    "--sequences",
    "10",
    "--in-flight",
    "6",
    "--resident-carries",
    "4",
    "--decode-batch",
    "3",
    "--decode-tokens",
    "6",
    "--turns",
    "2",
    "--system-prompts",
    "2",
    "--prefill-chunk",
    "48",
    "--block-size",
    "32",
    "--slots",
    "4096",
];

#[test]
fn default_checkpoint_then_verified_json_run() {
    let tmp = tempfile::tempdir().unwrap();
    let mut args = vec!["run", "--verify", "--json"];
    args.extend_from_slice(SMALL);
    let (o, out, err) = run(tmp.path(), &args);
    assert!(o.status.success(), "{out}\n{err}");
    assert!(err.contains("(first use)"), "{err}");
    assert!(tmp.path().join("metrale-ple/tiny/config.json").exists());

    let v: Value = serde_json::from_str(&out).expect("JSON on stdout");
    assert_eq!(count(&v, &["sequences"]), 10);
    let prefill = count(&v, &["prefill", "tokens"]);
    let decode = count(&v, &["decode", "tokens"]);
    let restored = count(&v, &["prefix_cache", "tokens_restored"]);
    assert_eq!(prefill + decode + restored, count(&v, &["tokens"]));
    assert!(decode > 0 && prefill > 0);
    // Two system prompts shared by ten sequences: the cache must hit.
    assert!(count(&v, &["prefix_cache", "hits"]) > 0, "{out}");
    // Six in flight over a budget of four carries: preemption must happen.
    assert!(count(&v, &["swaps", "preemptions"]) > 0, "{out}");
    assert_eq!(
        count(&v, &["swaps", "swap_outs"]),
        count(&v, &["swaps", "swap_ins"])
    );
    assert!(count(&v, &["carry", "peak_bytes"]) <= count(&v, &["carry", "budget_bytes"]));
    assert!(count(&v, &["row_cache", "misses"]) > 0 && count(&v, &["bytes_read"]) > 0);
    assert_eq!(count(&v, &["leaked_allocations"]), 0);
    assert_eq!(v["verify"]["identical"], Value::Bool(true), "{out}");
    assert_eq!(count(&v, &["verify", "rows_compared"]), prefill + decode);

    // The second run finds the checkpoint and prints the table.
    let mut args = vec!["run"];
    args.extend_from_slice(SMALL);
    let (o, out, err) = run(tmp.path(), &args);
    assert!(o.status.success(), "{out}\n{err}");
    assert!(!err.contains("first use"), "{err}");
    for row in [
        "prefill",
        "decode",
        "row cache",
        "bytes read",
        "I/O wait",
        "prefix cache",
        "swaps",
        "carry memory",
    ] {
        assert!(out.contains(row), "no {row} in {out}");
    }
}

#[test]
fn prompt_and_text_files_run_and_bad_ones_are_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let ck = tmp.path().join("ck");
    let (o, out, err) = run(
        tmp.path(),
        &["init", ck.to_str().unwrap(), "--table-rows", "4096"],
    );
    assert!(o.status.success(), "{out}\n{err}");
    let ck = ck.to_str().unwrap();

    let prompts = tmp.path().join("p.jsonl");
    std::fs::write(&prompts, "[1,2,3,4,5]\n\n[1,2,3,9]\n[7]\n").unwrap();
    let (o, out, err) = run(
        tmp.path(),
        &[
            "run",
            ck,
            "--prompts",
            prompts.to_str().unwrap(),
            "--decode-tokens",
            "3",
            "--table",
            "mapped",
            "--verify",
            "--json",
        ],
    );
    assert!(o.status.success(), "{out}\n{err}");
    let v: Value = serde_json::from_str(&out).unwrap();
    assert_eq!(count(&v, &["sequences"]), 3);
    assert_eq!(count(&v, &["tokens"]), 10 + 9);
    assert_eq!(count(&v, &["decode", "tokens"]), 9);
    assert_eq!(v["verify"]["identical"], Value::Bool(true));

    let text = tmp.path().join("t.txt");
    std::fs::write(&text, "hello\nworld, again\n").unwrap();
    let (o, out, err) = run(
        tmp.path(),
        &["run", ck, "--text", text.to_str().unwrap(), "--verify"],
    );
    assert!(o.status.success(), "{out}\n{err}");
    assert!(out.contains("metrale-ple run: 2 sequences"), "{out}");
    assert!(out.contains("bit-identical"), "{out}");

    // A bad prompt file is an input error (exit 2) naming the line.
    let refused = |contents: &str| {
        let bad = tmp.path().join("bad.jsonl");
        std::fs::write(&bad, contents).unwrap();
        let (o, _, err) = run(tmp.path(), &["run", ck, "--prompts", bad.to_str().unwrap()]);
        assert_eq!(o.status.code(), Some(2), "{err}");
        err
    };
    let err = refused("[1,2]\n[3,\"x\"]\n");
    assert!(
        err.contains("bad.jsonl line 2: expected a JSON array"),
        "{err}"
    );
    let err = refused("[1,5000]\n");
    assert!(
        err.contains("line 1: token 5000 at index 1 is not below the vocabulary size 4096"),
        "{err}"
    );

    // Decode through captured graphs: every row still matches.
    let mut args = vec!["run", ck, "--decode-graphs", "--verify", "--json"];
    args.extend_from_slice(&SMALL[..SMALL.len() - 2]);
    let (o, out, err) = run(tmp.path(), &args);
    assert!(o.status.success(), "{out}\n{err}");
    let v: Value = serde_json::from_str(&out).unwrap();
    assert!(count(&v, &["decode_graphs", "replays"]) > 0, "{out}");
    assert!(count(&v, &["decode_graphs", "captured"]) >= 1, "{out}");
    assert_eq!(v["verify"]["identical"], Value::Bool(true), "{out}");

    // A budget smaller than a decode batch: the engine splits the batch.
    let (o, out, err) = run(
        tmp.path(),
        &[
            "run",
            ck,
            "--prompts",
            prompts.to_str().unwrap(),
            "--resident-carries",
            "1",
            "--decode-batch",
            "3",
            "--verify",
        ],
    );
    assert!(o.status.success(), "{out}\n{err}");
    assert!(out.contains("bit-identical"), "{out}");

    let missing = tmp.path().join("nothing-here");
    let (o, _, err) = run(tmp.path(), &["run", missing.to_str().unwrap()]);
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(err.contains("nothing-here"), "{err}");
}

#[test]
fn injected_read_faults_fail_only_their_sequences_and_reruns_verify() {
    let tmp = tempfile::tempdir().unwrap();
    let mut args = vec![
        "run",
        "--verify",
        "--json",
        "--no-prefetch",
        "--fault-percent",
        "5",
        "--retries",
        "100",
    ];
    args.extend_from_slice(SMALL);
    let (o, out, err) = run(tmp.path(), &args);
    assert!(o.status.success(), "{out}\n{err}");
    let v: Value = serde_json::from_str(&out).unwrap();
    assert!(count(&v, &["faults", "injected"]) > 0, "{out}");
    assert!(count(&v, &["faults", "failed_calls"]) > 0, "{out}");
    assert!(count(&v, &["faults", "retried_sequences"]) > 0, "{out}");
    assert_eq!(count(&v, &["faults", "failed_sequences"]), 0, "{out}");
    let first = v["faults"]["first_error"].as_str().unwrap();
    assert!(
        first.contains(".safetensors") && first.contains(" at offset ") && first.contains("row "),
        "{first}"
    );
    assert_eq!(v["verify"]["identical"], Value::Bool(true), "{out}");
    assert_eq!(count(&v, &["leaked_allocations"]), 0);

    // Faults are for the row cache only.
    let (o, _, err) = run(
        tmp.path(),
        &["run", "--table", "resident", "--fault-percent", "1"],
    );
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(err.contains("needs --table cached"), "{err}");
}

/// A decode batch whose rows outnumber the row cache's slots (4 sequences
/// of 4 heads over 4 slots per site) is split, eager or through graphs, and
/// verifies; graphs over fewer slots than one sequence's rows are refused
/// with a message saying so.
#[test]
fn decode_batches_larger_than_the_row_cache_run_and_verify() {
    let tmp = tempfile::tempdir().unwrap();
    let base = [
        "run",
        "--sequences",
        "4",
        "--in-flight",
        "4",
        "--decode-tokens",
        "4",
        "--turns",
        "1",
        "--decode-batch",
        "4",
        "--slots",
    ];
    for extra in [
        &["4"][..],
        &["4", "--verify"],
        &["4", "--verify", "--decode-graphs"],
        &["4", "--verify", "--backbone"],
    ] {
        let args = [&base[..], extra].concat();
        let (o, out, err) = run(tmp.path(), &args);
        assert!(o.status.success(), "{args:?}: {out}\n{err}");
        assert!(
            out.contains("bit-identical") || !args.contains(&"--verify"),
            "{args:?}: {out}"
        );
    }
    let args = [&base[..], &["3", "--decode-graphs"]].concat();
    let (o, _, err) = run(tmp.path(), &args);
    assert_eq!(o.status.code(), Some(1), "{err}");
    assert!(
        err.contains("cannot keep one sequence's rows pinned"),
        "{err}"
    );
}

/// With the backbone the outputs verify against a run without it (eager
/// and through graphs), the summary names the blocks and carries the read
/// time beside the wait; a scale of 0 is refused.
#[test]
fn the_backbone_changes_no_output_and_the_reads_are_reported() {
    let tmp = tempfile::tempdir().unwrap();
    for extra in [&[][..], &["--decode-graphs"], &["--no-prefetch"]] {
        let mut args = vec![
            "run",
            "--verify",
            "--json",
            "--backbone",
            "--backbone-scale",
            "2",
        ];
        args.extend_from_slice(SMALL);
        args.extend_from_slice(extra);
        let (o, out, err) = run(tmp.path(), &args);
        assert!(o.status.success(), "{extra:?}: {out}\n{err}");
        let v: Value = serde_json::from_str(&out).expect("JSON on stdout");
        assert_eq!(v["verify"]["identical"], Value::Bool(true), "{out}");
        assert_eq!(count(&v, &["backbone", "layers"]), 4, "{out}");
        assert_eq!(v["backbone"]["site_layers"], serde_json::json!([2, 3]));
        assert_eq!(count(&v, &["backbone", "model_width"]), 128);
        assert_eq!(
            v["prefetch"],
            Value::Bool(!extra.contains(&"--no-prefetch"))
        );
        let read = v["read_seconds"]
            .as_f64()
            .expect("a cached table's read time");
        let wait = v["io_wait_seconds"].as_f64().unwrap();
        let covered = v["io_wait_covered_seconds"]
            .as_f64()
            .expect("with the backbone");
        assert!(covered <= wait, "{out}");
        assert!(read > 0.0, "{out}");
        let hidden = v["read_unwaited_share"].as_f64().unwrap();
        assert!((0.0..=1.0).contains(&hidden), "{out}");
        assert!(wait >= 0.0);
    }
    let mut args = vec!["run", "--backbone"];
    args.extend_from_slice(SMALL);
    let (o, out, err) = run(tmp.path(), &args);
    assert!(o.status.success(), "{out}\n{err}");
    for row in ["backbone", "I/O wait", "reads"] {
        assert!(out.contains(row), "no {row} in {out}");
    }
    // The row cache's policy and host tier: evicted rows come back from
    // host memory, and the outputs still verify.
    let (o, out, err) = run(
        tmp.path(),
        &[
            "run",
            "--sequences",
            "8",
            "--in-flight",
            "4",
            "--decode-tokens",
            "8",
            "--slots",
            "512",
            "--cache-policy",
            "clock",
            "--host-rows",
            "4096",
            "--backbone",
            "--verify",
            "--json",
        ],
    );
    assert!(o.status.success(), "{out}\n{err}");
    let v: Value = serde_json::from_str(&out).expect("JSON on stdout");
    assert_eq!(v["verify"]["identical"], Value::Bool(true), "{out}");
    assert!(count(&v, &["row_cache", "host_hits"]) > 0, "{out}");
    let (o, _, err) = run(tmp.path(), &["run", "--cache-policy", "lru"]);
    assert_eq!(o.status.code(), Some(2), "{err}");
    let (o, _, err) = run(tmp.path(), &["run", "--backbone", "--backbone-scale", "0"]);
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(err.contains("--backbone-scale"), "{err}");
}
