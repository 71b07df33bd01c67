//! `table pack --hot-rows`, `--hot-corpus` and `--pad-rows` end to end: the
//! packed checkpoint's tables are really relaid (hot rows first) or padded, its
//! layers give the original's highway bit for bit in every table mode, and
//! a damaged row remap is refused naming the file.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::Arc;

use metrale_checkpoint::Checkpoint;
use metrale_checkpoint::names::row_remap_file;
use metrale_checkpoint::remap::{HEADER_BYTES, RowRemap};
use metrale_checkpoint::runtime::TableMode;
use metrale_engine::ple_site::PleSite;
use metrale_gpu_runtime::cpu::CpuBackend;
use metrale_gpu_runtime::gpu::GpuBackend;
use metrale_storage::cached::CacheConfig;
use metrale_storage::layout::TableFiles;

fn run(args: &[&str]) -> (Output, String, String) {
    let o = Command::new(env!("CARGO_BIN_EXE_metrale-ple"))
        .env_remove("RUST_LOG")
        .args(args)
        .output()
        .expect("the binary runs");
    let out = String::from_utf8_lossy(&o.stdout).into_owned();
    let err = String::from_utf8_lossy(&o.stderr).into_owned();
    (o, out, err)
}

fn init(dir: &Path, dtype: &str, rows: Option<&str>) -> PathBuf {
    init_preset(dir, "tiny", dtype, rows)
}

fn init_preset(dir: &Path, preset: &str, dtype: &str, rows: Option<&str>) -> PathBuf {
    let p = dir.join(format!("ck-{preset}-{dtype}"));
    let mut args = vec![
        "init",
        p.to_str().unwrap(),
        "--preset",
        preset,
        "--dtype",
        dtype,
        "--seed",
        "7",
    ];
    if let Some(r) = rows {
        args.extend(["--table-rows", r]);
    }
    let (o, out, err) = run(&args);
    assert!(o.status.success(), "init failed: {out} {err}");
    p
}

/// Every site of `ck` over `tokens` from a fresh carry, tables in `mode`.
fn highway(ck: &Checkpoint, mode: TableMode, tokens: &[u32]) -> Vec<f32> {
    let gpu: Arc<dyn GpuBackend> = Arc::new(CpuBackend::new());
    let sites: Vec<PleSite> = (0..ck.sites.len())
        .map(|s| {
            let t = match mode {
                // A small cache, so rows are evicted and read again.
                TableMode::Cached => ck.open_cached_table(s, CacheConfig::new(64), gpu.clone()),
                m => ck.open_table(s, m, gpu.clone()),
            }
            .unwrap();
            PleSite::new(ck.build_layer(s, t, 16, gpu.as_ref()).unwrap())
        })
        .collect();
    metrale_testkit::drive::reference_run(&sites, gpu.as_ref(), tokens)
}

/// A trace: for each site, row ids with a skewed count (id `k` of the list
/// appears `1 + 8 / (k + 1)` times), spread over the padded id range so a
/// cut table folds some of them.
fn write_trace(dir: &Path, ck: &Checkpoint) -> PathBuf {
    let mut t = String::from("# SITE ROW_ID\n");
    for (i, s) in ck.sites.iter().enumerate() {
        for k in 0..300u64 {
            let id = (k * 7919 + 13) % s.padded_rows;
            for _ in 0..1 + 8 / (k + 1) {
                t.push_str(&format!("{i} {id}\n"));
            }
        }
    }
    let p = dir.join("trace.txt");
    std::fs::write(&p, t).unwrap();
    p
}

#[test]
fn packed_hot_rows_give_the_same_highway_and_come_first() {
    let tmp = tempfile::tempdir().unwrap();
    let tokens: Vec<u32> = (0..48u32).map(|i| (i * 37 + 5) % 4096).collect();
    for (dtype, rows) in [("bf16", Some("1024")), ("fp8", None)] {
        let src = init(tmp.path(), dtype, rows);
        let ck = Checkpoint::open(&src).unwrap();
        let trace = write_trace(tmp.path(), &ck);
        let dst = tmp.path().join(format!("hot-{dtype}"));
        let (o, out, err) = run(&[
            "table",
            "pack",
            "--hot-rows",
            trace.to_str().unwrap(),
            src.to_str().unwrap(),
            dst.to_str().unwrap(),
        ]);
        assert!(o.status.success(), "{out} {err}");
        assert!(out.contains("validation OK"), "{out}");
        assert_eq!(
            out.matches("trace hits on 300 distinct rows,").count(),
            ck.sites.len(),
            "{out}"
        );
        let packed = Checkpoint::open(&dst).unwrap();
        // The relay happened: the hottest row (k = 0) is now physical row 0,
        // and the table bytes differ from the source's.
        for s in &packed.sites {
            let path = dst.join(row_remap_file(s.layer));
            let remap = RowRemap::load(&path, s.table.stored_rows).unwrap();
            assert_eq!(remap.physical(13 % s.table.stored_rows), 0);
            let a = TableFiles::open(&ck.sites[s.index].table.shards, None).unwrap();
            let b = TableFiles::open(&s.table.shards, None).unwrap();
            let read = |t: &TableFiles| {
                let sh = &t.shards[0];
                let f = std::fs::read(&sh.path).unwrap();
                f[sh.data_offset as usize..sh.data_offset as usize + 4096].to_vec()
            };
            assert_ne!(read(&a), read(&b), "site {} was not relaid", s.index);
        }
        let want = highway(&ck, TableMode::Resident, &tokens);
        for mode in [TableMode::Resident, TableMode::Mapped, TableMode::Cached] {
            let got = highway(&packed, mode, &tokens);
            let same = metrale_testkit::same_bits(&got, &want);
            assert!(
                same,
                "{dtype} {mode:?}: the packed checkpoint's highway differs"
            );
        }
        // A plain pack of the packed checkpoint keeps its remaps.
        let again = tmp.path().join(format!("again-{dtype}"));
        let (o, out, err) = run(&[
            "table",
            "pack",
            dst.to_str().unwrap(),
            again.to_str().unwrap(),
        ]);
        assert!(o.status.success(), "{out} {err}");
        let again = Checkpoint::open(&again).unwrap();
        let got = highway(&again, TableMode::Resident, &tokens);
        assert!(metrale_testkit::same_bits(&got, &want));
        // --hot-rows refuses a source that already has remaps.
        let (o, _, err) = run(&[
            "table",
            "pack",
            "--hot-rows",
            trace.to_str().unwrap(),
            dst.to_str().unwrap(),
            tmp.path().join("x").to_str().unwrap(),
        ]);
        assert_eq!(o.status.code(), Some(2), "{err}");
        assert!(err.contains("already has a row remap"), "{err}");
    }
}

/// Flagship rows (160 values: 320 bytes BF16, 160 FP8) padded for 512-byte
/// granules, then also relaid hot rows first: the same highway in every
/// table mode, rows 512 (256) bytes apart.
#[test]
fn padded_rows_give_the_same_highway_in_every_mode() {
    let tmp = tempfile::tempdir().unwrap();
    let tokens: Vec<u32> = (0..6u32).map(|i| (i * 7919 + 11) % 151_936).collect();
    for (dtype, stride) in [("bf16", 256u64), ("fp8", 128)] {
        let src = init_preset(tmp.path(), "flagship", dtype, Some("2048"));
        let ck = Checkpoint::open(&src).unwrap();
        let want = highway(&ck, TableMode::Resident, &tokens);
        let trace = write_trace(tmp.path(), &ck);
        for hot in [false, true] {
            let dst = tmp.path().join(format!("padded-{dtype}-{hot}"));
            let mut args = vec!["table", "pack", "--pad-rows", "--granule", "512"];
            if hot {
                args.extend(["--hot-rows", trace.to_str().unwrap()]);
            }
            args.extend([src.to_str().unwrap(), dst.to_str().unwrap()]);
            let (o, out, err) = run(&args);
            assert!(o.status.success(), "{out} {err}");
            assert!(
                out.contains(&format!("now {stride} bytes apart for 512-byte granules")),
                "{out}"
            );
            let packed = Checkpoint::open(&dst).unwrap();
            for s in &packed.sites {
                let t = TableFiles::open(&s.table.shards, None).unwrap();
                assert_eq!(t.row_stride, stride, "site {}", s.index);
            }
            let (o, out, err) = run(&["inspect", dst.to_str().unwrap()]);
            assert!(o.status.success(), "{err}");
            // Flagship's 256-byte BF16 rows already tile 512-byte granules:
            // nothing to pad, so inspect names no padding.
            assert!(
                dtype == "bf16" || out.contains(&format!("padded to {stride} B apart on disk")),
                "{out}"
            );
            for mode in [TableMode::Resident, TableMode::Mapped, TableMode::Cached] {
                let got = highway(&packed, mode, &tokens);
                assert!(
                    metrale_testkit::same_bits(&got, &want),
                    "{dtype} hot={hot} {mode:?}: the padded checkpoint's highway differs"
                );
            }
        }
    }
    // Refusals: a file source, a granule without a use, a bad granule.
    let src = init(tmp.path(), "bf16", None);
    let shard = std::fs::read_dir(&src)
        .unwrap()
        .map(|e| e.unwrap().path())
        .find(|p| p.extension().is_some_and(|e| e == "safetensors"))
        .unwrap();
    for (args, msg) in [
        (
            vec!["--pad-rows", shard.to_str().unwrap(), "/tmp/x.safetensors"],
            "must be a checkpoint directory",
        ),
        (
            vec![
                "--granule",
                "512",
                src.to_str().unwrap(),
                "/tmp/nothing-here",
            ],
            "give one of them",
        ),
        (
            vec![
                "--pad-rows",
                "--granule",
                "384",
                src.to_str().unwrap(),
                "/tmp/nothing-here",
            ],
            "power of two",
        ),
    ] {
        let mut a = vec!["table", "pack"];
        a.extend(args);
        let (o, _, err) = run(&a);
        assert_eq!(o.status.code(), Some(2), "{err}");
        assert!(err.contains(msg), "{err}");
    }
}

/// `--hot-corpus` counts rows as a trace of the corpus's ids would: the
/// remaps equal those of `--hot-rows` over the trace the sites' hashers
/// give for the same prompts, and the highway is unchanged.
#[test]
fn a_token_corpus_packs_as_its_trace_does() {
    use metrale_model_layers::layers::ple::ids::PleIdHasher;
    let tmp = tempfile::tempdir().unwrap();
    let src = init(tmp.path(), "bf16", Some("1024"));
    let ck = Checkpoint::open(&src).unwrap();
    let prompts: Vec<Vec<u32>> = (0..12u32)
        .map(|p| {
            (0..20u32)
                .map(|i| (p * 131 + i * 17 + (i % 3) * 500) % 4096)
                .collect()
        })
        .collect();
    let corpus = tmp.path().join("corpus.jsonl");
    let text: String = prompts
        .iter()
        .map(|p| format!("{}\n", serde_json::to_string(p).unwrap()))
        .collect();
    std::fs::write(&corpus, format!("\n{text}\n")).unwrap();
    let mut trace = String::new();
    for (i, _) in ck.sites.iter().enumerate() {
        let spec = ck.spec.site(i).unwrap();
        let h = PleIdHasher::with_family(&spec.family, &spec.dims).unwrap();
        for p in &prompts {
            let mut ids = vec![0u64; p.len() * spec.dims.ngram_heads()];
            h.ids_with_history_into(&[], p, &mut ids).unwrap();
            for id in ids {
                trace.push_str(&format!("{i} {id}\n"));
            }
        }
    }
    let trace_path = tmp.path().join("corpus-trace.txt");
    std::fs::write(&trace_path, trace).unwrap();
    let by_corpus = tmp.path().join("by-corpus");
    let by_trace = tmp.path().join("by-trace");
    for (flag, file, dst) in [
        ("--hot-corpus", &corpus, &by_corpus),
        ("--hot-rows", &trace_path, &by_trace),
    ] {
        let (o, out, err) = run(&[
            "table",
            "pack",
            flag,
            file.to_str().unwrap(),
            src.to_str().unwrap(),
            dst.to_str().unwrap(),
        ]);
        assert!(o.status.success(), "{flag}: {out} {err}");
    }
    for s in &ck.sites {
        let name = row_remap_file(s.layer);
        assert_eq!(
            std::fs::read(by_corpus.join(&name)).unwrap(),
            std::fs::read(by_trace.join(&name)).unwrap(),
            "{name}"
        );
    }
    let tokens: Vec<u32> = prompts.concat();
    let want = highway(&ck, TableMode::Resident, &tokens);
    let packed = Checkpoint::open(&by_corpus).unwrap();
    assert!(metrale_testkit::same_bits(
        &highway(&packed, TableMode::Cached, &tokens),
        &want
    ));
    // A token past the vocabulary names the corpus and its line; the two
    // sources of counts exclude each other.
    std::fs::write(&corpus, "[1, 2]\n[3, 99999]\n").unwrap();
    let (o, _, err) = run(&[
        "table",
        "pack",
        "--hot-corpus",
        corpus.to_str().unwrap(),
        src.to_str().unwrap(),
        tmp.path().join("bad").to_str().unwrap(),
    ]);
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(
        err.contains("corpus.jsonl line 2") && err.contains("99999"),
        "{err}"
    );
    assert!(!tmp.path().join("bad").exists());
    let (o, _, err) = run(&[
        "table",
        "pack",
        "--hot-corpus",
        corpus.to_str().unwrap(),
        "--hot-rows",
        trace_path.to_str().unwrap(),
        src.to_str().unwrap(),
        tmp.path().join("bad").to_str().unwrap(),
    ]);
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(err.contains("cannot be used with"), "{err}");
}

#[test]
fn malformed_remaps_and_traces_are_refused_naming_the_file() {
    let tmp = tempfile::tempdir().unwrap();
    let src = init(tmp.path(), "bf16", Some("1024"));
    let ck = Checkpoint::open(&src).unwrap();
    let trace = write_trace(tmp.path(), &ck);
    let dst = tmp.path().join("hot");
    let (o, out, err) = run(&[
        "table",
        "pack",
        "--hot-rows",
        trace.to_str().unwrap(),
        src.to_str().unwrap(),
        dst.to_str().unwrap(),
    ]);
    assert!(o.status.success(), "{out} {err}");
    let layer = ck.sites[0].layer;
    let path = dst.join(row_remap_file(layer));
    let good = std::fs::read(&path).unwrap();
    let reseal = |mut b: Vec<u8>| {
        let crc = crc32(&b[HEADER_BYTES..]);
        b[24..28].copy_from_slice(&crc.to_le_bytes());
        b
    };
    let entry = |b: &mut Vec<u8>, i: usize, v: u32| {
        b[HEADER_BYTES + 4 * i..HEADER_BYTES + 4 * i + 4].copy_from_slice(&v.to_le_bytes());
    };
    let mut short = good[..good.len() - 4].to_vec();
    short[16..24].copy_from_slice(&1023u64.to_le_bytes());
    let mut out_of_range = good.clone();
    entry(&mut out_of_range, 5, 5000);
    let mut dup = good.clone();
    let first = u32::from_le_bytes(good[HEADER_BYTES..HEADER_BYTES + 4].try_into().unwrap());
    entry(&mut dup, 1, first);
    for (bytes, want) in [
        (
            reseal(short),
            "a remap of 1023 rows, but the table has 1024",
        ),
        (reseal(out_of_range), "entry 5 sends row 5 to row 5000"),
        (reseal(dup), "entries 0 and 1 both send their rows"),
    ] {
        std::fs::write(&path, bytes).unwrap();
        let ck = Checkpoint::open(&dst).unwrap();
        let gpu: Arc<dyn GpuBackend> = Arc::new(CpuBackend::new());
        for mode in [TableMode::Resident, TableMode::Cached] {
            let e = match ck.open_table(0, mode, gpu.clone()) {
                Ok(_) => panic!("a damaged remap was accepted ({want})"),
                Err(e) => chain(&e),
            };
            assert!(e.contains(want), "{e}");
            assert!(e.contains(&row_remap_file(layer)), "{e}");
        }
    }
    // A bad trace line is refused before anything is written.
    std::fs::write(&trace, "0 1\n0 x\n").unwrap();
    let out_dir = tmp.path().join("never");
    let (o, _, err) = run(&[
        "table",
        "pack",
        "--hot-rows",
        trace.to_str().unwrap(),
        src.to_str().unwrap(),
        out_dir.to_str().unwrap(),
    ]);
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(err.contains("trace.txt") && err.contains("line 2"), "{err}");
    assert!(!out_dir.exists());
}

#[test]
fn sites_split_into_sub_tables_are_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let src = tmp.path().join("lc");
    let (o, out, err) = run(&[
        "init",
        src.to_str().unwrap(),
        "--preset",
        "longcat-flash-lite",
        "--table-rows",
        "4096",
    ]);
    assert!(o.status.success(), "{out} {err}");
    let trace = tmp.path().join("trace.txt");
    std::fs::write(&trace, "0 1\n0 2\n").unwrap();
    let dst = tmp.path().join("hot");
    let (o, _, err) = run(&[
        "table",
        "pack",
        "--hot-rows",
        trace.to_str().unwrap(),
        src.to_str().unwrap(),
        dst.to_str().unwrap(),
    ]);
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(
        err.contains("sub-tables") && err.contains("trace.txt"),
        "{err}"
    );
    assert!(!dst.exists());
}

/// An error and its sources, one after another.
fn chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut cur = e.source();
    while let Some(c) = cur {
        s.push_str(": ");
        s.push_str(&c.to_string());
        cur = c.source();
    }
    s
}

/// CRC-32 (IEEE), bitwise: the remap's checksum, computed independently.
fn crc32(b: &[u8]) -> u32 {
    let mut c = !0u32;
    for &x in b {
        c ^= x as u32;
        for _ in 0..8 {
            c = if c & 1 != 0 {
                (c >> 1) ^ 0xEDB8_8320
            } else {
                c >> 1
            };
        }
    }
    !c
}
