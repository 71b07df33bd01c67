//! Fuzz the loader of the Engram and LongCat checkpoints: their dense
//! tensors (a fused FP8 projection and its UE8M0 block scales, per-branch
//! weights and biases, LongCat's sub-table projections), table headers,
//! token map and config are bytes from outside.
//!
//! A small checkpoint of each family (the tiny configs of
//! `metrale_testkit::families`, tables cut) is written once; each input
//! picks a family and one of its files and overwrites bytes of it at an
//! offset the input gives. `Checkpoint::open` must then accept the
//! directory or refuse it with an error: it must never panic, and a
//! checkpoint it accepts must have finite weights.
#![no_main]

use std::path::PathBuf;
use std::sync::OnceLock;

use libfuzzer_sys::fuzz_target;
use metrale_checkpoint::Checkpoint;
use metrale_checkpoint::synth::{TableDType, write_spec_synthetic};
use metrale_storage::table::RowDType;
use metrale_testkit::families::TinyFamily;

/// Each family's files: (name, bytes).
type Files = Vec<(String, Vec<u8>)>;

fn seeds() -> &'static Vec<Files> {
    static SEEDS: OnceLock<Vec<Files>> = OnceLock::new();
    SEEDS.get_or_init(|| {
        let root =
            std::env::temp_dir().join(format!("metrale-fuzz-families-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&root);
        TinyFamily::ALL
            .iter()
            .enumerate()
            .map(|(i, f)| {
                let dir = root.join(format!("seed{i}"));
                let dtype = match f.row_dtype() {
                    RowDType::Fp8E4M3Block32 => TableDType::Fp8Block,
                    _ => TableDType::Bf16,
                };
                write_spec_synthetic(&dir, &f.spec(), Some(48), dtype, 1).expect("seed checkpoint");
                let mut files: Files = std::fs::read_dir(&dir)
                    .expect("seed dir")
                    .map(|e| {
                        let p = e.expect("entry").path();
                        let name = p.file_name().unwrap().to_string_lossy().into_owned();
                        (name, std::fs::read(&p).expect("seed file"))
                    })
                    .collect();
                files.sort();
                files
            })
            .collect()
    })
}

fn work_dir() -> &'static PathBuf {
    static WORK: OnceLock<PathBuf> = OnceLock::new();
    WORK.get_or_init(|| {
        std::env::temp_dir().join(format!("metrale-fuzz-family-ck-{}", std::process::id()))
    })
}

fuzz_target!(|data: &[u8]| {
    let [fam, which, o0, o1, o2, o3, patch @ ..] = data else {
        return;
    };
    let files = &seeds()[*fam as usize % TinyFamily::ALL.len()];
    let dir = work_dir();
    let _ = std::fs::remove_dir_all(dir);
    std::fs::create_dir_all(dir).expect("work dir");
    let target = *which as usize % files.len();
    for (i, (name, bytes)) in files.iter().enumerate() {
        let mut b = bytes.clone();
        if i == target && !b.is_empty() {
            let at = u32::from_le_bytes([*o0, *o1, *o2, *o3]) as usize % b.len();
            let n = patch.len().min(b.len() - at);
            b[at..at + n].copy_from_slice(&patch[..n]);
        }
        std::fs::write(dir.join(name), b).expect("work file");
    }
    if let Ok(ck) = Checkpoint::open(dir) {
        for s in &ck.sites {
            let w = &s.weights;
            for v in [
                &w.norm_key,
                &w.norm_query,
                &w.norm_conv,
                &w.conv1d,
                &w.key_bias,
                &w.value_bias,
            ] {
                assert!(
                    v.iter().all(|x| x.is_finite()),
                    "accepted a non-finite weight"
                );
            }
        }
    }
});
