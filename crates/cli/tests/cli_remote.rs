//! The remote row tier end to end against real `redis-server` processes on
//! free loopback ports (each test prints `skipped` without one): `table
//! push` (partial, resumed, complete), `run --table remote --verify`, loads
//! refused (partial, another table, servers listed in another order), a
//! damaged value never served, and a server killed and restarted empty in
//! the middle of a run, with and without the local fallback.

mod common;

use std::path::Path;
use std::process::Stdio;
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::{bin, count};
use metrale_storage::layout::TableFiles;
use metrale_storage::remote::format::{row_key, table_digest};
use metrale_storage::remote::redis::{RedisTier, compare_rows, link_config};
use metrale_storage::remote::{RemoteTier, RowDst};
use metrale_storage::{RemoteFault, StorageError};
use metrale_testkit::redis::{RedisServer, have_redis};
use serde_json::Value;

fn servers(n: usize) -> Vec<RedisServer> {
    (0..n).map(|_| RedisServer::start_free()).collect()
}

fn urls(s: &[&RedisServer]) -> String {
    s.iter().map(|s| s.url()).collect::<Vec<_>>().join(",")
}

fn all(s: &[RedisServer]) -> String {
    urls(&s.iter().collect::<Vec<_>>())
}

/// Run the binary; its status, parsed stdout (when JSON) and stderr.
fn run(cache: &Path, args: &[&str]) -> (bool, Value, String) {
    let (o, out, err) = common::run(cache, args);
    let v = serde_json::from_str(&out).unwrap_or(Value::Null);
    (o.status.success(), v, format!("{out}\n{err}"))
}

fn ok(cache: &Path, args: &[&str]) -> Value {
    let (okay, v, text) = run(cache, args);
    assert!(okay, "{args:?} failed\n{text}");
    v
}

const SMALL: &[&str] = &[
    "run",
    "--table",
    "remote",
    "--verify",
    "--json",
    "--sequences",
    "12",
    "--in-flight",
    "6",
    "--decode-tokens",
    "8",
    "--turns",
    "2",
    "--slots",
    "4096",
];

/// The tiny checkpoint in `cache` (written by a first `run`), its
/// directory.
fn tiny(cache: &Path) -> std::path::PathBuf {
    ok(cache, &["init", "--preset", "tiny"]);
    cache.join("metrale-ple").join("tiny")
}

#[test]
fn push_run_and_refusals() {
    if !have_redis() {
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let dir = tiny(tmp.path());
    let d = dir.to_str().unwrap();
    let s = servers(3);
    let to = all(&s);

    // A partial load is refused, naming it.
    let partial = ok(
        tmp.path(),
        &[
            "table",
            "push",
            d,
            "--to",
            &to,
            "--chunk-rows",
            "1000",
            "--stop-after",
            "5000",
            "--json",
        ],
    );
    assert_eq!(partial[0]["complete"], false, "{partial}");
    let mut args = SMALL.to_vec();
    args.extend_from_slice(&["--remote", &to]);
    let (okay, _, text) = run(tmp.path(), &args);
    assert!(
        !okay && text.contains("partial load: rows 0..5000"),
        "{text}"
    );

    // Resumed: only the rows after the partial load are sent.
    let pushed = ok(tmp.path(), &["table", "push", d, "--to", &to, "--json"]);
    for t in pushed.as_array().unwrap() {
        assert_eq!(t["complete"], true, "{t}");
        assert_eq!(count(t, &["sent_rows"]), count(t, &["rows"]) - 5000, "{t}");
        let per: u64 = t["rows_per_server"]
            .as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_u64().unwrap())
            .sum();
        assert_eq!(per, count(t, &["rows"]), "{t}");
    }
    // Again: nothing to send.
    let again = ok(tmp.path(), &["table", "push", d, "--to", &to, "--json"]);
    assert_eq!(count(&again[0], &["sent_rows"]), 0, "{again}");
    assert_eq!(
        count(&again[0], &["already_complete_servers"]),
        3,
        "{again}"
    );

    let v = ok(tmp.path(), &args);
    assert_eq!(v["verify"]["identical"], true, "{v}");
    let r = &v["remote"];
    assert!(
        count(r, &["rows"]) > 0 && count(r, &["requests"]) > 0,
        "{r}"
    );
    assert_eq!(count(r, &["failed_batches"]), 0, "{r}");
    assert!(r["batch_p99_us"].as_f64().unwrap() >= r["batch_p50_us"].as_f64().unwrap());

    // The servers listed in another order: refused, naming the place.
    let swapped = urls(&[&s[1], &s[0], &s[2]]);
    let mut args2 = SMALL.to_vec();
    args2.extend_from_slice(&["--remote", &swapped]);
    let (okay, _, text) = run(tmp.path(), &args2);
    assert!(
        !okay && text.contains("as server 2 of 3, but it is server 1 of 3"),
        "{text}"
    );

    // Another checkpoint (other weights and rows): its tables were never
    // pushed, so no server holds them.
    let other = tmp.path().join("other");
    ok(
        tmp.path(),
        &["init", other.to_str().unwrap(), "--seed", "7"],
    );
    let mut args3 = SMALL.to_vec();
    args3.extend_from_slice(&[other.to_str().unwrap(), "--remote", &to]);
    let (okay, _, text) = run(tmp.path(), &args3);
    assert!(!okay && text.contains("holds no load of table"), "{text}");

    // Without --remote, or --remote without --table remote: usage errors.
    let (o, _, _) = common::run(tmp.path(), &["run", "--table", "remote"]);
    assert_eq!(o.status.code(), Some(2));
    let (o, _, _) = common::run(tmp.path(), &["run", "--remote", &to]);
    assert_eq!(o.status.code(), Some(2));
}

/// The first table of the tiny checkpoint's first site.
fn first_table(dir: &Path) -> TableFiles {
    // A single table (the tiny preset has no sub-tables).
    let ck = metrale_checkpoint::Checkpoint::open(dir).unwrap();
    let s = &ck.sites[0];
    TableFiles::open(&s.table.shards, Some(s.table.stored_rows)).unwrap()
}

#[test]
fn damaged_values_are_never_served() {
    if !have_redis() {
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let dir = tiny(tmp.path());
    let s = servers(2);
    let to = all(&s);
    ok(
        tmp.path(),
        &["table", "push", dir.to_str().unwrap(), "--to", &to],
    );
    let files = first_table(&dir);
    let tier = RedisTier::open(&[s[0].url(), s[1].url()], link_config(1000)).unwrap();
    assert_eq!(
        compare_rows(&tier, &files, 0, 300).unwrap(),
        None,
        "pushed rows read back"
    );

    // Row 7's value replaced by row 8's (a value of the wrong row), then
    // by row 8's cut short (the wrong length), then removed: each fetch
    // of row 7 is refused and writes nothing it could not check.
    let d = table_digest(&files).unwrap();
    let at = |id: u64| {
        let u = tier
            .links()
            .iter()
            .position(|l| l.url() == s[metrale_storage::remote::format::server_of(&d, id, 2)].url())
            .unwrap();
        &s[u]
    };
    let get = |id: u64| {
        let r = at(id)
            .command(&[b"GET", row_key(&d, id).as_bytes()])
            .unwrap();
        // A bulk reply: `$LEN\r\n` then the value.
        let head = r.iter().position(|&b| b == b'\n').unwrap() + 1;
        r[head..r.len() - 2].to_vec()
    };
    let row8 = get(8);
    let rows = tier.open(&files).unwrap();
    let payload = metrale_storage::remote::format::payload_bytes(&files.info);
    let fetch7 = || {
        let mut buf = vec![0xAAu8; payload];
        let mut dst = [RowDst {
            id: 7,
            row: &mut buf[..],
            scale: &mut [][..],
        }];
        rows.fetch(&mut dst).map(|_| ())
    };
    for (value, fault) in [
        (row8.clone(), RemoteFault::BadValue),
        (row8[..row8.len() - 1].to_vec(), RemoteFault::BadValue),
    ] {
        let r = at(7)
            .command(&[b"SET", row_key(&d, 7).as_bytes(), &value])
            .unwrap();
        assert!(r.starts_with(b"+OK"));
        match fetch7() {
            Err(StorageError::Remote {
                fault: f, message, ..
            }) => {
                assert_eq!(f, fault, "{message}");
                assert!(message.contains("row 7"), "{message}");
            }
            other => panic!("a damaged value was accepted: {other:?}"),
        }
    }
    at(7).command(&[b"DEL", row_key(&d, 7).as_bytes()]).unwrap();
    std::thread::sleep(Duration::from_millis(100));
    assert!(matches!(
        fetch7(),
        Err(StorageError::Remote {
            fault: RemoteFault::MissingRow,
            ..
        })
    ));
    assert!(tier.stats().bad_values >= 2);

    // A row cache over the tier with the local fallback reads row 7 from
    // the shard files; without it, the resolve fails and holds nothing.
    let gpu: Arc<dyn metrale_gpu_runtime::gpu::GpuBackend> =
        Arc::new(metrale_gpu_runtime::cpu::CpuBackend::new());
    for fallback in [false, true] {
        std::thread::sleep(Duration::from_millis(1100));
        let mut cfg = metrale_storage::cached::CacheConfig::new(64);
        cfg.remote = Some(Arc::new(
            RedisTier::open(&[s[0].url(), s[1].url()], link_config(1000)).unwrap(),
        ) as Arc<dyn RemoteTier>);
        cfg.remote_fallback = fallback;
        let t =
            metrale_storage::cached::CachedTable::open(files.clone(), gpu.clone(), cfg).unwrap();
        use metrale_storage::table::{RowRef, RowTable};
        let mut out = [RowRef::default(); 2];
        let r = t.resolve(&[7, 9], &mut out);
        if fallback {
            let lease = r.unwrap();
            let mut got = vec![0u8; files.info.row_bytes()];
            gpu.copy_d2h(metrale_gpu_runtime::gpu::DevicePtr(out[0].data), &mut got)
                .unwrap();
            let mut want = Vec::new();
            metrale_storage::remote::format::LocalRows::open(&files)
                .unwrap()
                .read(7, 1, &mut want)
                .unwrap();
            assert_eq!(got, want, "row 7 as stored");
            t.release(lease, gpu.as_ref(), None).unwrap();
        } else {
            assert!(matches!(r, Err(StorageError::Remote { .. })), "{r:?}");
        }
        t.check_invariants().unwrap();
        assert_eq!(t.mapped_rows(), if fallback { 2 } else { 0 });
    }
}

/// Spawn `run` with `args`, wait until `watch` has served `hits` keys,
/// kill `s[victim]` and start it again empty on its port, run `then`, and
/// return the run's report.
fn kill_mid_run(
    cache: &Path,
    args: &[&str],
    s: &mut [RedisServer],
    victim: usize,
    then: &dyn Fn(),
) -> Value {
    let mut child = bin(cache)
        .args(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let t0 = Instant::now();
    while s[victim].info_stat("keyspace_hits") < 300 {
        assert!(
            t0.elapsed() < Duration::from_secs(60),
            "the run fetched nothing"
        );
        if child.try_wait().unwrap().is_some() {
            let o = child.wait_with_output().unwrap();
            panic!(
                "the run ended before the kill\n{}\n{}",
                String::from_utf8_lossy(&o.stdout),
                String::from_utf8_lossy(&o.stderr)
            );
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    let port = s[victim].port;
    s[victim].kill();
    std::thread::sleep(Duration::from_millis(300));
    s[victim] = RedisServer::start(port).expect("restarting on the same port");
    then();
    let o = child.wait_with_output().unwrap();
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(
        o.status.success(),
        "{out}\n{}",
        String::from_utf8_lossy(&o.stderr)
    );
    serde_json::from_str(&out).unwrap()
}

#[test]
fn a_server_killed_and_restarted_empty_mid_run() {
    if !have_redis() {
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let dir = tiny(tmp.path());
    let d = dir.to_str().unwrap().to_string();
    let mut s = servers(3);
    let to = all(&s);
    let push = || {
        ok(tmp.path(), &["table", "push", &d, "--to", &to]);
    };
    push();
    let args: Vec<&str> = vec![
        "run",
        "--table",
        "remote",
        "--verify",
        "--json",
        "--in-flight",
        "6",
        "--turns",
        "2",
        "--slots",
        "4096",
        "--remote",
        &to,
        "--sequences",
        "48",
        "--decode-tokens",
        "24",
        "--retries",
        "200",
    ];

    // With the fallback: the rows of failed fetches come from the shard
    // files; every output row is the resident run's.
    let mut fb = args.clone();
    fb.push("--remote-fallback");
    let v = kill_mid_run(tmp.path(), &fb, &mut s, 1, &|| {});
    let r = &v["remote"];
    eprintln!("fallback: {r:#}");
    assert_eq!(v["verify"]["identical"], true, "{v}");
    assert!(count(r, &["failed_batches"]) > 0, "{r}");
    assert!(count(r, &["fallback_rows"]) > 0, "{r}");
    assert_eq!(count(r, &["failed_sequences"]), 0, "{r}");

    // Without it: the calls that met the dead or empty server fail, their
    // sequences rerun, and once the server is loaded again they pass.
    push();
    let v = kill_mid_run(tmp.path(), &args, &mut s, 1, &push);
    let r = &v["remote"];
    eprintln!("no fallback: {r:#}");
    assert_eq!(v["verify"]["identical"], true, "{v}");
    assert!(count(r, &["failed_batches"]) > 0, "{r}");
    assert_eq!(count(r, &["fallback_rows"]), 0, "{r}");
    assert_eq!(count(r, &["failed_sequences"]), 0, "{r}");
}
