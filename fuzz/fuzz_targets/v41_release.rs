//! Fuzz the conversion of DeepSeek-V4.1's table as released: the values
//! (F8_E4M3) and block scales (F8_E8M0) it reads, their headers, the
//! weight map it rewrites and the config are bytes from outside.
//!
//! A small released checkpoint (the tiny V4.1 config of
//! `metrale_testkit::families`, table cut) is written once; each input
//! overwrites bytes of one of its files at an offset the input gives.
//! `Checkpoint::open_with` (released tables accepted) must accept the
//! directory or refuse it; when it accepts, the conversion `table pack`
//! runs (`convert_file`, `convert_index`, the other files packed) must
//! succeed or refuse with an error, never panic, and a conversion that
//! succeeds must open with the strict loader and hold, for every table,
//! each value row followed by its scale row, byte for byte.
#![no_main]

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use libfuzzer_sys::fuzz_target;
use metrale_checkpoint::load::OpenOptions;
use metrale_checkpoint::names::{CONFIG_FILE, INDEX_FILE, TOKEN_MAP_FILE};
use metrale_checkpoint::release::{SplitTable, convert_file, convert_index};
use metrale_checkpoint::synth::{TableDType, TableLayout, write_spec_synthetic_as};
use metrale_checkpoint::{Checkpoint, CheckpointError};
use metrale_storage::pack::pack;
use metrale_storage::safetensors::Header;
use metrale_testkit::families::TinyFamily;

/// The seed checkpoint's files: (name, bytes).
fn seed() -> &'static Vec<(String, Vec<u8>)> {
    static SEED: OnceLock<Vec<(String, Vec<u8>)>> = OnceLock::new();
    SEED.get_or_init(|| {
        let dir =
            std::env::temp_dir().join(format!("metrale-fuzz-v41-seed-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        write_spec_synthetic_as(
            &dir,
            &TinyFamily::EngramV41.spec(),
            Some(48),
            TableDType::Fp8Block,
            1,
            TableLayout::Release,
        )
        .expect("seed checkpoint");
        let mut files: Vec<(String, Vec<u8>)> = std::fs::read_dir(&dir)
            .expect("seed dir")
            .map(|e| {
                let p = e.expect("entry").path();
                let name = p.file_name().unwrap().to_string_lossy().into_owned();
                (name, std::fs::read(&p).expect("seed file"))
            })
            .collect();
        files.sort();
        let _ = std::fs::remove_dir_all(&dir);
        files
    })
}

fn root() -> &'static PathBuf {
    static ROOT: OnceLock<PathBuf> = OnceLock::new();
    ROOT.get_or_init(|| {
        std::env::temp_dir().join(format!("metrale-fuzz-v41-{}", std::process::id()))
    })
}

/// The conversion `table pack` runs, into `dst`.
fn convert(
    src: &Path,
    dst: &Path,
    ck: &Checkpoint,
    tables: &[SplitTable],
) -> Result<(), CheckpointError> {
    std::fs::create_dir_all(dst).expect("out dir");
    let text =
        std::fs::read_to_string(src.join(INDEX_FILE)).map_err(|e| CheckpointError::io(src, e))?;
    let index = convert_index(&text, &src.join(INDEX_FILE), tables)?;
    for f in &ck.files {
        let (a, b) = (src.join(&f.name), dst.join(&f.name));
        if tables
            .iter()
            .any(|t| t.weight_file == a || t.scale_file == a)
        {
            convert_file(&a, &b, tables, &mut |_, _| {})?;
        } else {
            pack(&a, &b, &mut |_, _| {}).map_err(|e| CheckpointError::Invalid(e.to_string()))?;
        }
    }
    std::fs::write(dst.join(INDEX_FILE), index).expect("index");
    for n in [CONFIG_FILE, TOKEN_MAP_FILE] {
        if src.join(n).exists() {
            std::fs::copy(src.join(n), dst.join(n)).expect("copy");
        }
    }
    Ok(())
}

fuzz_target!(|data: &[u8]| {
    let [which, o0, o1, o2, o3, patch @ ..] = data else {
        return;
    };
    let files = seed();
    let (src, dst) = (root().join("src"), root().join("dst"));
    let _ = std::fs::remove_dir_all(root());
    std::fs::create_dir_all(&src).expect("work dir");
    let target = *which as usize % files.len();
    for (i, (name, bytes)) in files.iter().enumerate() {
        let mut b = bytes.clone();
        if i == target && !b.is_empty() {
            let at = u32::from_le_bytes([*o0, *o1, *o2, *o3]) as usize % b.len();
            let n = patch.len().min(b.len() - at);
            b[at..at + n].copy_from_slice(&patch[..n]);
        }
        std::fs::write(src.join(name), b).expect("work file");
    }
    let Ok(ck) = Checkpoint::open_with(
        &src,
        OpenOptions {
            release_tables: true,
            ..OpenOptions::default()
        },
    ) else {
        return;
    };
    let tables = ck.release_tables();
    if convert(&src, &dst, &ck, &tables).is_err() {
        return;
    }
    let out = Checkpoint::open(&dst).expect("a converted checkpoint opens");
    for t in &tables {
        let site = out
            .sites
            .iter()
            .find(|s| s.layer == t.layer)
            .expect("the converted site");
        let shard = &site.table.shards[0];
        let (wf, name) = (&shard.path, &shard.weight);
        assert_eq!(name, &t.weight);
        let got = Header::read(wf).unwrap().read_tensor(name).unwrap();
        let vals = Header::read(&t.weight_file)
            .unwrap()
            .read_tensor(&t.weight)
            .unwrap();
        let scales = Header::read(&t.scale_file)
            .unwrap()
            .read_tensor(&t.scale)
            .unwrap();
        let mut want = Vec::with_capacity(got.len());
        for (v, s) in vals
            .chunks_exact(t.head_dim)
            .zip(scales.chunks_exact(t.blocks()))
        {
            want.extend_from_slice(v);
            want.extend_from_slice(s);
        }
        assert!(got == want, "layer {}: the converted rows differ", t.layer);
    }
});
