//! `metrale-ple run --carry-store`: two processes share one `dir:` store;
//! the second restores its prefixes from what the first wrote, and both
//! pass `--verify`. A Redis address nothing listens on changes no output.

mod common;

use std::path::Path;

use common::count;
use serde_json::Value;

fn run(cache: &Path, args: &[&str]) -> Value {
    let (o, out, err) = common::run(cache, args);
    assert!(o.status.success(), "{args:?} failed\n{out}\n{err}");
    serde_json::from_str(&out).unwrap_or_else(|e| panic!("{e}: {out}"))
}

const SMALL: &[&str] = &[
    "run",
    "--verify",
    "--json",
    "--sequences",
    "8",
    "--in-flight",
    "4",
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
fn two_processes_share_a_dir_store() {
    let tmp = tempfile::tempdir().unwrap();
    let url = format!("dir:{}", tmp.path().join("carries").display());
    let mut args = SMALL.to_vec();
    args.extend_from_slice(&["--carry-store", &url]);
    let first = run(tmp.path(), &args);
    let cs = &first["carry_store"];
    assert_eq!(count(cs, &["restores"]), 0, "{cs}");
    assert!(count(cs, &["puts"]) > 0, "{cs}");
    assert_eq!(first["verify"]["identical"], true);
    assert!(cs["model_id"].as_str().unwrap().starts_with("config-"));

    let second = run(tmp.path(), &args);
    let cs = &second["carry_store"];
    eprintln!("second run's store: {cs:#}");
    assert!(count(cs, &["restores"]) > 0, "{cs}");
    assert!(count(cs, &["tokens_restored"]) > 0 && count(cs, &["bytes_restored"]) > 0);
    assert_eq!(count(cs, &["misses", "corrupt"]), 0);
    assert_eq!(second["verify"]["identical"], true);

    // Another model id shares nothing.
    let mut other = args.clone();
    other.extend_from_slice(&["--model-id", "another-model"]);
    let third = run(tmp.path(), &other);
    assert_eq!(count(&third["carry_store"], &["restores"]), 0);
}

#[test]
fn an_unreachable_redis_store_changes_no_output() {
    let tmp = tempfile::tempdir().unwrap();
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let url = format!("redis://127.0.0.1:{port}/");
    let mut args = SMALL.to_vec();
    args.extend_from_slice(&["--carry-store", &url, "--store-timeout-ms", "100"]);
    let v = run(tmp.path(), &args);
    let cs = &v["carry_store"];
    assert_eq!(count(cs, &["restores"]), 0);
    assert!(count(cs, &["misses", "error"]) > 0, "{cs}");
    assert_eq!(v["verify"]["identical"], true);
}
