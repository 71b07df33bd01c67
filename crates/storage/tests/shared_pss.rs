//! The shared table: rows read back from the shared segment, one segment
//! per shard however many tables attach it, removed by its last user, a
//! wrong segment refused; and, measured with PSS, two processes holding
//! one copy of the rows.

mod common;

use std::io::{BufRead, BufReader, Write};
use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::Arc;

use common::{backend, gather_and_check, make_table};
use metrale_gpu_runtime::gpu::GpuBackend;
use metrale_storage::layout::{ShardSource, TableFiles};
use metrale_storage::shared::SharedTable;
use metrale_storage::table::RowTable;

#[test]
fn rows_segments_and_lifetime() {
    for fp8 in [false, true] {
        let d = tempfile::tempdir().unwrap();
        let shm = tempfile::tempdir().unwrap();
        let files = make_table(d.path(), 2, 40, 96, fp8, 8);
        let (gpu, _) = backend();
        let s = gpu.create_stream().unwrap();
        let a = SharedTable::open_in(&files, gpu.clone(), shm.path()).unwrap();
        let b = SharedTable::open_in(&files, gpu.clone(), shm.path()).unwrap();
        assert_eq!(a.segment_paths(), b.segment_paths());
        assert_eq!(std::fs::read_dir(shm.path()).unwrap().count(), 2);
        for t in [&a, &b] {
            assert_eq!(t.info(), files.info);
            gather_and_check(gpu.as_ref(), t, &[0, 1, 39, 40, 79, 41, 0], s);
        }
        drop(a);
        assert_eq!(std::fs::read_dir(shm.path()).unwrap().count(), 2);
        drop(b);
        assert_eq!(
            std::fs::read_dir(shm.path()).unwrap().count(),
            0,
            "the last user removes the segments"
        );
        assert_eq!(gpu.live_alloc_count(), 0);
    }
}

#[test]
fn a_wrong_segment_is_refused() {
    let d = tempfile::tempdir().unwrap();
    let shm = tempfile::tempdir().unwrap();
    let files = make_table(d.path(), 1, 16, 32, false, 8);
    let (gpu, _) = backend();
    let t = SharedTable::open_in(&files, gpu.clone(), shm.path()).unwrap();
    let seg = t.segment_paths()[0].clone();
    std::mem::forget(t);
    let len = std::fs::metadata(&seg).unwrap().len();
    std::fs::remove_file(&seg).unwrap();
    std::fs::write(&seg, vec![0x5a; len as usize]).unwrap();
    let e = SharedTable::open_in(&files, gpu, shm.path())
        .err()
        .expect("refused")
        .to_string();
    assert!(e.contains("does not hold what its name says"), "{e}");
}

/// Pss and Rss (KiB) of this process's mappings of files whose name
/// starts with `prefix`, and the whole process's Pss from smaps_rollup.
fn pss(prefix: &str) -> (u64, u64, u64) {
    let smaps = std::fs::read_to_string("/proc/self/smaps").unwrap();
    let (mut p, mut r, mut inside) = (0, 0, false);
    for line in smaps.lines() {
        let mut f = line.split_whitespace();
        let first = f.next().unwrap_or("");
        if first.contains('-') && !first.ends_with(':') {
            inside = line
                .split_whitespace()
                .nth(5)
                .is_some_and(|n| n.starts_with(prefix));
            continue;
        }
        if inside {
            let kb = f.next().and_then(|v| v.parse::<u64>().ok()).unwrap_or(0);
            match first {
                "Pss:" => p += kb,
                "Rss:" => r += kb,
                _ => {}
            }
        }
    }
    let rollup = std::fs::read_to_string("/proc/self/smaps_rollup").unwrap();
    let total = rollup
        .lines()
        .find(|l| l.starts_with("Pss:"))
        .and_then(|l| l.split_whitespace().nth(1)?.parse().ok())
        .unwrap_or(0);
    (p, r, total)
}

fn open_and_touch(files: &TableFiles, gpu: &Arc<dyn GpuBackend>) -> SharedTable {
    let t = SharedTable::open(files, gpu.clone()).unwrap();
    let s = gpu.create_stream().unwrap();
    let ids: Vec<u64> = (0..files.info.rows).collect();
    for chunk in ids.chunks(512) {
        gather_and_check(gpu.as_ref(), &t, chunk, s);
    }
    t
}

const ROWS: u64 = 4096;
const HEAD_DIM: u64 = 1024;

#[test]
fn two_processes_hold_one_copy() {
    if let Ok(list) = std::env::var("METRALE_PSS_CHILD") {
        // The second process: attach, touch every row, report, wait.
        let shards: Vec<_> = list
            .split(';')
            .map(|s| {
                let (p, n) = s.split_once('|').unwrap();
                ShardSource::new(p, n, None)
            })
            .collect();
        let files = TableFiles::open(&shards, None).unwrap();
        let (gpu, _) = backend();
        let t = open_and_touch(&files, &gpu);
        let (p, r, total) = pss("/dev/shm/metrale-ple-");
        // Straight to the descriptor: the test harness captures `println!`.
        let mut out = std::io::stdout().lock();
        writeln!(out, "CHILD {p} {r} {total}").unwrap();
        out.flush().unwrap();
        drop(out);
        let mut line = String::new();
        let _ = std::io::stdin().read_line(&mut line);
        drop(t);
        return;
    }
    if !Path::new("/dev/shm").is_dir() {
        println!("skipped: no /dev/shm");
        return;
    }
    let d = tempfile::tempdir().unwrap();
    let files = make_table(d.path(), 2, ROWS / 2, HEAD_DIM, false, 4096);
    let table_kib = ROWS * HEAD_DIM * 2 / 1024;
    let (gpu, _) = backend();
    let t = open_and_touch(&files, &gpu);
    let (alone, rss_alone, _) = pss("/dev/shm/metrale-ple-");
    let list: Vec<String> = files
        .shards
        .iter()
        .map(|s| format!("{}|{}", s.path.display(), s.tensor))
        .collect();
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "two_processes_hold_one_copy",
            "--nocapture",
            "--test-threads=1",
        ])
        .env("METRALE_PSS_CHILD", list.join(";"))
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let out = BufReader::new(child.stdout.take().unwrap());
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in out.lines().map_while(Result::ok) {
            // The harness's "test ... " may precede it on the line.
            if let Some(at) = line.find("CHILD ") {
                let rest = &line[at + 6..];
                let v: Vec<u64> = rest.split(' ').filter_map(|x| x.parse().ok()).collect();
                if let [p, r, t] = v[..] {
                    let _ = tx.send((p, r, t));
                }
            }
        }
    });
    let child_figures = rx.recv_timeout(std::time::Duration::from_secs(120)).ok();
    if child_figures.is_none() {
        let _ = child.kill();
    }
    let (shared, rss_shared, total) = pss("/dev/shm/metrale-ple-");
    drop(child.stdin.take());
    let status = child.wait().unwrap();
    let (c_pss, c_rss, c_total) = child_figures.expect("the child reported its PSS");
    println!(
        "shared table of {table_kib} KiB: one process: Pss {alone} KiB (Rss {rss_alone}); \
         two processes: this one Pss {shared} KiB (Rss {rss_shared}, process Pss {total}), \
         the other Pss {c_pss} KiB (Rss {c_rss}, process Pss {c_total})"
    );
    assert!(status.success());
    let segs = std::fs::read_dir("/dev/shm")
        .unwrap()
        .filter(|e| t.segment_paths().contains(&e.as_ref().unwrap().path()))
        .count();
    assert_eq!(segs, 2, "one segment per shard");
    assert!(alone >= table_kib * 9 / 10, "every row touched: {alone}");
    assert!(rss_shared >= table_kib * 9 / 10 && c_rss >= table_kib * 9 / 10);
    // One copy between two: each holds about half.
    assert!(shared <= table_kib * 6 / 10, "{shared} of {table_kib}");
    assert!(c_pss <= table_kib * 6 / 10, "{c_pss} of {table_kib}");
    drop(t);
}
