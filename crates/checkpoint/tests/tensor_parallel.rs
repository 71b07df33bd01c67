//! The tensor-parallel share writer and opener: each rank's tables hold
//! exactly its columns of every source row (1/R of the table bytes where
//! the scales are inline), the shares open only as ranks and only in rank
//! order, an interrupted write resumes, and splits that do not divide are
//! refused by name before anything is written.

use std::os::unix::fs::FileExt;
use std::path::Path;

use metrale_checkpoint::synth::write_spec_synthetic;
use metrale_checkpoint::tensor_parallel::{MANIFEST_FILE, RankCheckpoint, open_group, write_rank};
use metrale_checkpoint::{Checkpoint, CheckpointError, Preset, TableDType};
use metrale_model_layers::layers::ple::family::qwen4_exp::Qwen4Exp;
use metrale_model_layers::layers::ple::spec::ModelSpec;
use metrale_model_layers::layers::ple::{ShardError, TensorParallel};
use metrale_storage::layout::TableFiles;
use metrale_testkit::families::TinyFamily;

/// Every stored row of site `site`'s table (its bytes, and for per-row
/// FP8 its scale's 4 bytes after them).
fn rows(ck: &Checkpoint, site: usize) -> Vec<Vec<u8>> {
    let t = &ck.sites[site].table;
    let files = if t.sub_tables.is_empty() {
        vec![TableFiles::open(&t.shards, Some(t.stored_rows)).unwrap()]
    } else {
        t.shards
            .iter()
            .zip(&t.sub_tables)
            .map(|(s, sub)| {
                TableFiles::open(std::slice::from_ref(s), Some(sub.stored_rows)).unwrap()
            })
            .collect()
    };
    let mut out = Vec::new();
    for f in files {
        for id in 0..f.info.rows {
            let l = f.locate(id).unwrap();
            let file = std::fs::File::open(&f.shards[l.shard].path).unwrap();
            let mut b = vec![0u8; f.info.row_bytes()];
            file.read_exact_at(&mut b, l.offset).unwrap();
            if let Some(so) = l.scale_offset {
                let mut s = [0u8; 4];
                file.read_exact_at(&mut s, so).unwrap();
                b.extend_from_slice(&s);
            }
            out.push(b);
        }
    }
    out
}

/// Write `ranks` shares of `src` under `root` and check each holds its
/// columns of every row, and the bytes it should.
fn check_split(src: &Path, root: &Path, ranks: usize) {
    let full = Checkpoint::open(src).unwrap();
    let dirs: Vec<_> = (0..ranks)
        .map(|r| root.join(format!("rank-{r}-of-{ranks}")))
        .collect();
    for (r, d) in dirs.iter().enumerate() {
        let tp = TensorParallel::new(r, ranks).unwrap();
        let mut last = (0, 0);
        let rep = write_rank(src, tp, d, &mut |a, b| last = (a, b)).unwrap();
        assert!(
            last.1 > 0 && last.0 == last.1,
            "progress ends complete: {last:?}"
        );
        assert!(!rep.complete && rep.resumed == 0 && rep.written == full.files.len());
        assert_eq!(rep.source_table_bytes, full.table_bytes());
        let scales: u64 = full
            .sites
            .iter()
            .filter(|s| s.table.dtype.has_row_scale())
            .map(|s| 4 * s.table.stored_rows)
            .sum();
        // Per-row FP8 scales apply to every slice and are kept whole.
        assert_eq!(
            (rep.table_bytes - scales) * ranks as u64,
            full.table_bytes() - scales,
            "rank {r} of {ranks}"
        );
        // A plain open refuses a share; a rerun finds it complete.
        let e = Checkpoint::open(d).unwrap_err();
        assert!(
            e.to_string()
                .contains(&format!("rank {r} of {ranks} ranks")),
            "{e}"
        );
        let again = write_rank(src, tp, d, &mut |_, _| {}).unwrap();
        assert!(again.complete && again.written == 0);
    }
    let group = open_group(&dirs).unwrap();
    for s in 0..full.sites.len() {
        let want = rows(&full, s);
        let d = full.sites[s].table.head_dim;
        let dtype = full.sites[s].table.dtype;
        let parts: Vec<Vec<Vec<u8>>> = group.iter().map(|rc| rows(&rc.ck, s)).collect();
        for (id, row) in want.iter().enumerate() {
            for (r, p) in parts.iter().enumerate() {
                let tp = TensorParallel::new(r, ranks).unwrap();
                let (vals, scale) = row.split_at(dtype.row_bytes(d));
                let mut expect = tp.shard_rows(vals, d, dtype).unwrap();
                expect.extend_from_slice(scale);
                assert_eq!(p[id], expect, "site {s} row {id} rank {r} of {ranks}");
            }
        }
    }
}

/// A small checkpoint of `spec` (Qwen4-Exp tables cut to 512 rows, the
/// tiny families' whole).
fn tiny(dir: &Path, spec: &ModelSpec, dtype: TableDType) {
    let rows = spec.family.get::<Qwen4Exp>().is_some().then_some(512);
    write_spec_synthetic(dir, spec, rows, dtype, 5).unwrap();
}

#[test]
fn tensor_parallel_shares_hold_each_ranks_columns_for_every_family_and_dtype() {
    let root = tempfile::tempdir().unwrap();
    let mut cases: Vec<(String, ModelSpec, TableDType)> = vec![
        ("qwen-bf16".into(), Preset::Tiny.spec(), TableDType::Bf16),
        ("qwen-fp8".into(), Preset::Tiny.spec(), TableDType::Fp8),
    ];
    for f in TinyFamily::ALL {
        let (spec, dtype) = match f {
            TinyFamily::EngramV41 => (
                ModelSpec {
                    head_dim: 128,
                    ..f.spec()
                },
                TableDType::Fp8Block,
            ),
            _ => (f.spec(), TableDType::Bf16),
        };
        cases.push((format!("{f:?}"), spec, dtype));
    }
    for (name, spec, dtype) in cases {
        let src = root.path().join(&name).join("full");
        tiny(&src, &spec, dtype);
        for ranks in [2, 4] {
            if spec.head_dim % ranks != 0 {
                continue;
            }
            check_split(&src, &root.path().join(&name), ranks);
        }
    }
}

#[test]
fn tensor_parallel_splits_that_do_not_divide_are_refused_before_writing() {
    let root = tempfile::tempdir().unwrap();
    let src = root.path().join("full");
    tiny(&src, &Preset::Tiny.spec(), TableDType::Bf16);
    let out = root.path().join("r0of3");
    let e = write_rank(
        &src,
        TensorParallel::new(0, 3).unwrap(),
        &out,
        &mut |_, _| {},
    )
    .unwrap_err();
    assert!(
        matches!(
            e,
            CheckpointError::TensorParallel {
                split: ShardError::Indivisible {
                    head_dim: 16,
                    ranks: 3
                },
                ..
            }
        ),
        "{e}"
    );
    assert!(
        e.to_string()
            .contains("head_dim 16 is not divisible by 3 ranks"),
        "{e}"
    );
    assert!(!out.exists(), "nothing is written for a refused split");
    // DeepSeek-V4.1's 32-value block-scaled rows over 2 ranks cut a block.
    let f = TinyFamily::EngramV41;
    let src = root.path().join("v41");
    tiny(&src, &f.spec(), TableDType::Fp8Block);
    let e = write_rank(
        &src,
        TensorParallel::new(1, 2).unwrap(),
        &out,
        &mut |_, _| {},
    )
    .unwrap_err();
    assert!(
        matches!(
            e,
            CheckpointError::TensorParallel {
                split: ShardError::ScaleBlock {
                    head_dim: 32,
                    ranks: 2,
                    width: 16,
                    block: 32
                },
                ..
            }
        ),
        "{e}"
    );
    assert!(!out.exists());
}

#[test]
fn tensor_parallel_shares_open_only_as_one_split_in_rank_order() {
    let root = tempfile::tempdir().unwrap();
    let a = root.path().join("a");
    let b = root.path().join("b");
    tiny(&a, &Preset::Tiny.spec(), TableDType::Bf16);
    tiny(&b, &Preset::Small.spec(), TableDType::Bf16);
    let share = |src: &Path, r: usize, n: usize| {
        let out = root.path().join(format!(
            "{}-{r}of{n}",
            src.file_name().unwrap().to_string_lossy()
        ));
        write_rank(
            src,
            TensorParallel::new(r, n).unwrap(),
            &out,
            &mut |_, _| {},
        )
        .unwrap();
        out
    };
    let (a0, a1, b1) = (share(&a, 0, 2), share(&a, 1, 2), share(&b, 1, 2));
    assert_eq!(open_group(&[a0.clone(), a1.clone()]).unwrap().len(), 2);
    let e = open_group(&[a1.clone(), a0.clone()]).unwrap_err();
    assert!(
        e.to_string().contains("rank 1 of 2 ranks, given as rank 0"),
        "{e}"
    );
    let e = open_group(std::slice::from_ref(&a0)).unwrap_err();
    assert!(e.to_string().contains("given as rank 0 of 1"), "{e}");
    let e = open_group(&[a0.clone(), b1]).unwrap_err();
    assert!(e.to_string().contains("different checkpoints"), "{e}");
    // The whole checkpoint is not a share.
    let e = RankCheckpoint::open(&a).unwrap_err();
    assert!(e.to_string().contains(MANIFEST_FILE), "{e}");
    // Another rank's share is not overwritten.
    let e = write_rank(&a, TensorParallel::new(1, 2).unwrap(), &a0, &mut |_, _| {}).unwrap_err();
    assert!(e.to_string().contains("already holds rank 0 of 2"), "{e}");
}

#[test]
fn tensor_parallel_an_interrupted_share_resumes_to_the_same_bytes() {
    let root = tempfile::tempdir().unwrap();
    let src = root.path().join("full");
    tiny(&src, &Preset::Tiny.spec(), TableDType::Bf16);
    let out = root.path().join("r1of2");
    let tp = TensorParallel::new(1, 2).unwrap();
    write_rank(&src, tp, &out, &mut |_, _| {}).unwrap();
    let ck = Checkpoint::open(&src).unwrap();
    let first = &ck.files[0].name;
    let before = std::fs::read(out.join(first)).unwrap();
    // As a run stopped after writing every file but the first: no
    // manifest yet, the manifest of the write in progress in its place.
    std::fs::rename(
        out.join(MANIFEST_FILE),
        out.join(".tensor_parallel.partial.json"),
    )
    .unwrap();
    std::fs::remove_file(out.join(first)).unwrap();
    let rep = write_rank(&src, tp, &out, &mut |_, _| {}).unwrap();
    assert_eq!((rep.written, rep.resumed), (1, ck.files.len() - 1));
    assert_eq!(std::fs::read(out.join(first)).unwrap(), before);
    assert!(RankCheckpoint::open(&out).is_ok());
    // A directory holding something else is refused.
    let other = root.path().join("other");
    std::fs::create_dir_all(&other).unwrap();
    std::fs::write(other.join("x"), b"x").unwrap();
    let e = write_rank(&src, tp, &other, &mut |_, _| {}).unwrap_err();
    assert!(e.to_string().contains("new or empty directory"), "{e}");
}
