//! `metrale-ple table shard` and `run --tp-ranks` end to end: the shares
//! the command writes hold 1/R of the table bytes, open as ranks and
//! reproduce the unsharded checkpoint's outputs to f32 accuracy; `run`
//! over them passes `--verify` with every rank agreeing; splits that do
//! not divide and flags that cannot run over ranks are refused.

mod common;

use std::path::{Path, PathBuf};
use std::sync::Arc;

use common::{count, run};
use metrale_checkpoint::Checkpoint;
use metrale_checkpoint::tensor_parallel::{RankCheckpoint, open_group};
use metrale_engine::ple_site::PleSite;
use metrale_engine::{Engine, EngineConfig};
use metrale_gpu_runtime::cpu::CpuBackend;
use metrale_gpu_runtime::gpu::GpuBackend;
use metrale_model_layers::layers::ple::{InProcessGroup, Reduce};
use metrale_storage::TableMode;
use metrale_testkit::rows::rows_for;
use serde_json::Value;

const SMALL: &[&str] = &[
    "--sequences",
    "8",
    "--in-flight",
    "4",
    "--resident-carries",
    "3",
    "--decode-batch",
    "3",
    "--decode-tokens",
    "5",
    "--turns",
    "2",
    "--system-prompts",
    "2",
    "--prefill-chunk",
    "32",
    "--block-size",
    "16",
    "--slots",
    "4096",
];

/// An engine over `ck`'s sites with resident tables; a rank of `rank`
/// when given.
fn engine(
    ck: &Checkpoint,
    gpu: &Arc<dyn GpuBackend>,
    rank: Option<(&RankCheckpoint, Arc<dyn Reduce>)>,
) -> Engine<PleSite> {
    let sites = (0..ck.sites.len())
        .map(|i| {
            let t = ck.open_table(i, TableMode::Resident, gpu.clone()).unwrap();
            let layer = match &rank {
                Some((rc, reduce)) => rc
                    .build_layer(i, t, 16, gpu.as_ref(), reduce.clone())
                    .unwrap(),
                None => ck.build_layer(i, t, 16, gpu.as_ref()).unwrap(),
            };
            PleSite::new(layer)
        })
        .collect();
    let cfg = EngineConfig {
        prefill_chunk: 7,
        ..Default::default()
    };
    Engine::new(gpu.clone(), sites, cfg).unwrap()
}

/// A prefill of 19 tokens and 6 decode steps: every output row.
fn outputs(e: &mut Engine<PleSite>) -> Vec<f32> {
    let w = e.width();
    let mut toks: Vec<u32> = (0..19u32).map(|i| (i * 211 + 5) % 4000).collect();
    let id = e.add_sequence(&toks).unwrap().id;
    let mut out = rows_for(&toks, 0, toks.len(), w);
    e.prefill(id, &toks, &mut out).unwrap();
    for step in 0..6u32 {
        let t = (step * 389 + 17) % 4000;
        toks.push(t);
        let mut hw = rows_for(&toks, toks.len() - 1, toks.len(), w);
        e.decode(&[(id, t)], &mut hw).unwrap();
        out.extend_from_slice(&hw);
    }
    e.release(id).unwrap();
    out
}

/// The shares in `dirs` reproduce `src`'s outputs to f32 accuracy, every
/// rank the same bits.
fn check_outputs(src: &Path, dirs: &[PathBuf]) {
    let full = Checkpoint::open(src).unwrap();
    let gpu: Arc<dyn GpuBackend> = Arc::new(CpuBackend::new());
    let mut e = engine(&full, &gpu, None);
    let want = outputs(&mut e);
    e.close().unwrap();
    let group = open_group(dirs).unwrap();
    let reduces = InProcessGroup::ranks(group.len());
    let outs: Vec<Vec<f32>> = std::thread::scope(|s| {
        let hs: Vec<_> = group
            .iter()
            .zip(&reduces)
            .map(|(rc, reduce)| {
                s.spawn(move || {
                    let gpu: Arc<dyn GpuBackend> = Arc::new(CpuBackend::new());
                    let mut e = engine(&rc.ck, &gpu, Some((rc, reduce.clone())));
                    let out = outputs(&mut e);
                    e.close().unwrap();
                    out
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let scale = want.iter().fold(1.0f32, |m, v| m.max(v.abs()));
    for (r, got) in outs.iter().enumerate() {
        assert!(metrale_testkit::same_bits(got, &outs[0]), "rank {r}");
        let d = got
            .iter()
            .zip(&want)
            .map(|(a, b)| (a - b).abs() / scale)
            .fold(0.0f32, f32::max);
        assert!(
            d <= 2e-6,
            "rank {r} of {}: largest difference {d:e}",
            dirs.len()
        );
    }
}

#[test]
fn tensor_parallel_table_shard_then_run_over_the_ranks() {
    let tmp = tempfile::tempdir().unwrap();
    let src = tmp.path().join("tiny");
    let s = src.to_str().unwrap();
    let (o, out, err) = run(tmp.path(), &["init", s, "--preset", "tiny", "--seed", "4"]);
    assert!(o.status.success(), "{out}\n{err}");
    let full = Checkpoint::open(&src).unwrap().table_bytes();
    for ranks in [2usize, 4] {
        let root = tmp.path().join(format!("tp{ranks}"));
        let (o, out, err) = run(
            tmp.path(),
            &[
                "table",
                "shard",
                s,
                "--of",
                &ranks.to_string(),
                "--out",
                root.to_str().unwrap(),
            ],
        );
        assert!(o.status.success(), "{out}\n{err}");
        assert_eq!(out.matches("validation OK").count(), ranks, "{out}");
        let dirs: Vec<PathBuf> = (0..ranks)
            .map(|r| root.join(format!("rank-{r}-of-{ranks}")))
            .collect();
        for d in &dirs {
            let rc = RankCheckpoint::open(d).unwrap();
            assert_eq!(rc.ck.table_bytes() * ranks as u64, full, "{}", d.display());
        }
        check_outputs(&src, &dirs);
        // A rerun finds the shares complete and writes nothing.
        let (o, out, _) = run(
            tmp.path(),
            &[
                "table",
                "shard",
                s,
                "--rank",
                "1",
                "--of",
                &ranks.to_string(),
                "--out",
                dirs[1].to_str().unwrap(),
            ],
        );
        assert!(
            o.status.success() && out.contains("already complete"),
            "{out}"
        );
        // `run` over the ranks, verified against a resident, uncached run
        // of the same ranks.
        let list = dirs
            .iter()
            .map(|d| d.to_str().unwrap())
            .collect::<Vec<_>>()
            .join(",");
        let mut args = vec!["run", "--tp-ranks", &list, "--verify", "--json"];
        args.extend_from_slice(SMALL);
        let (o, out, err) = run(tmp.path(), &args);
        assert!(o.status.success(), "{out}\n{err}");
        let v: Value = serde_json::from_str(&out).expect("JSON on stdout");
        let tp = &v["tensor_parallel"];
        assert_eq!(count(tp, &["ranks"]), ranks as u64, "{out}");
        assert_eq!(tp["identical_across_ranks"], Value::Bool(true));
        for r in 0..ranks {
            assert_eq!(tp["table_bytes"][r].as_u64(), Some(full / ranks as u64));
            assert!(tp["bytes_read"][r].as_u64().unwrap() > 0, "{out}");
        }
        assert_eq!(v["verify"]["identical"], Value::Bool(true), "{out}");
        assert!(count(&v, &["verify", "rows_compared"]) > 0);
        assert!(count(&v, &["prefix_cache", "hits"]) > 0, "{out}");
        assert_eq!(count(&v, &["leaked_allocations"]), 0);
    }
    // The text summary names the ranks.
    let list = format!(
        "{},{}",
        tmp.path().join("tp2/rank-0-of-2").display(),
        tmp.path().join("tp2/rank-1-of-2").display()
    );
    let mut args = vec!["run", "--tp-ranks", &list];
    args.extend_from_slice(SMALL);
    let (o, out, err) = run(tmp.path(), &args);
    assert!(o.status.success(), "{out}\n{err}");
    assert!(out.contains("tensor-parallel 2 ranks"), "{out}");
}

#[test]
fn tensor_parallel_refusals_name_the_numbers() {
    let tmp = tempfile::tempdir().unwrap();
    let src = tmp.path().join("tiny");
    let s = src.to_str().unwrap();
    let (o, _, err) = run(tmp.path(), &["init", s, "--preset", "tiny"]);
    assert!(o.status.success(), "{err}");
    let out3 = tmp.path().join("of3");
    let (o, _, err) = run(
        tmp.path(),
        &[
            "table",
            "shard",
            s,
            "--of",
            "3",
            "--out",
            out3.to_str().unwrap(),
        ],
    );
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(
        err.contains("head_dim 16 is not divisible by 3 ranks"),
        "{err}"
    );
    assert!(!out3.join("rank-0-of-3").exists());
    let (o, _, err) = run(
        tmp.path(),
        &[
            "table", "shard", s, "--rank", "2", "--of", "2", "--out", "x",
        ],
    );
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(err.contains("rank 2 of 2 ranks"), "{err}");
    let root = tmp.path().join("tp");
    let (o, _, err) = run(
        tmp.path(),
        &[
            "table",
            "shard",
            s,
            "--of",
            "2",
            "--out",
            root.to_str().unwrap(),
        ],
    );
    assert!(o.status.success(), "{err}");
    let (r0, r1) = (root.join("rank-0-of-2"), root.join("rank-1-of-2"));
    let reversed = format!("{},{}", r1.display(), r0.display());
    let (o, _, err) = run(tmp.path(), &["run", "--tp-ranks", &reversed]);
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(err.contains("in rank order"), "{err}");
    let ok = format!("{},{}", r0.display(), r1.display());
    let (o, _, err) = run(
        tmp.path(),
        &["run", "--tp-ranks", &ok, "--fault-percent", "5"],
    );
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(
        err.contains("--fault-percent cannot run with --tp-ranks"),
        "{err}"
    );
    // A share is not a whole checkpoint.
    let (o, _, err) = run(tmp.path(), &["run", r0.to_str().unwrap()]);
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(err.contains("rank 0 of 2 ranks' column slice"), "{err}");
}
