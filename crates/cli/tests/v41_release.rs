//! DeepSeek-V4.1 as released, end to end through the binary: `init
//! --layout release` writes the table as two tensors (values F8_E4M3,
//! scales F8_E8M0), the loader refuses it pointing at `table pack`, the
//! pack converts it to the inline rows the runtime reads (the same bytes
//! as `init`'s inline layout, the same highway in every table mode), and a
//! malformed scale tensor fails the pack naming the file and the tensor
//! with nothing left at the destination.

// Shared with the `run` tests; this file needs only `run`.
#[allow(dead_code)]
mod common;

use std::path::Path;
use std::sync::Arc;

use metrale_checkpoint::names::{INDEX_FILE, TOKEN_MAP_FILE, V41Names};
use metrale_checkpoint::runtime::TableMode;
use metrale_checkpoint::synth::{TableLayout, write_spec_synthetic_as};
use metrale_checkpoint::{Checkpoint, TableDType};
use metrale_engine::ple_site::PleSite;
use metrale_gpu_runtime::cpu::CpuBackend;
use metrale_gpu_runtime::gpu::GpuBackend;
use metrale_storage::cached::CacheConfig;
use metrale_storage::safetensors::{Dtype, Header, TensorSpec};
use metrale_testkit::families::TinyFamily;
use metrale_testkit::files::{file_of, replace_tensor};

fn run(tmp: &Path, args: &[&str]) -> (std::process::Output, String, String) {
    common::run(&tmp.join("cache"), args)
}

/// The bytes of `tensor` in checkpoint `ck`.
fn tensor(ck: &Path, tensor: &str) -> (Dtype, Vec<u64>, Vec<u8>) {
    let h = Header::read(file_of(ck, tensor)).unwrap();
    let t = h.get(tensor).unwrap();
    (t.dtype, t.shape.clone(), h.read_tensor(tensor).unwrap())
}

/// Nothing at `dst`, and no staging directory beside it.
fn nothing_at(dst: &Path) {
    assert!(!dst.exists(), "{} was written", dst.display());
    let stem = format!(".{}.packing", dst.file_name().unwrap().to_string_lossy());
    let left: Vec<_> = std::fs::read_dir(dst.parent().unwrap())
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with(&stem))
        .collect();
    assert!(left.is_empty(), "left behind: {left:?}");
}

#[test]
fn the_real_geometry_released_packs_to_the_inline_rows() {
    let tmp = tempfile::tempdir().unwrap();
    let t = tmp.path();
    let (rel, inline, packed) = (t.join("rel"), t.join("inline"), t.join("packed"));
    for (dir, layout) in [(&rel, "release"), (&inline, "inline")] {
        let (o, out, err) = run(
            t,
            &[
                "init",
                dir.to_str().unwrap(),
                "--preset",
                "deepseek-v4.1",
                "--table-rows",
                "256",
                "--layout",
                layout,
            ],
        );
        assert!(o.status.success(), "{out} {err}");
    }
    let n = V41Names::new(14);
    let (dt, shape, _) = tensor(&rel, &n.table());
    assert_eq!((dt, shape), (Dtype::F8E4M3, vec![256, 256]));
    let (dt, shape, _) = tensor(&rel, &n.table_scale());
    assert_eq!((dt, shape), (Dtype::F8E8M0, vec![256, 8]));
    assert_eq!(tensor(&rel, &n.wkv_scale()).0, Dtype::F8E8M0);
    // Refused as it is, pointing at the conversion.
    let (o, _, err) = run(t, &["inspect", rel.to_str().unwrap()]);
    assert!(!o.status.success());
    assert!(
        err.contains(&V41Names::new(1).table()) && err.contains("metrale-ple table pack"),
        "{err}"
    );
    let (o, out, err) = run(
        t,
        &[
            "table",
            "pack",
            rel.to_str().unwrap(),
            packed.to_str().unwrap(),
        ],
    );
    assert!(o.status.success(), "{out} {err}");
    assert!(
        out.contains("converted layers.14.engram.embed.weight (256 rows")
            && out.contains("validation OK"),
        "{out}"
    );
    let ck = Checkpoint::open(&packed).unwrap();
    assert!(ck.files.iter().all(|f| f.data_start % 4096 == 0));
    for layer in [1, 14] {
        let n = V41Names::new(layer);
        let got = tensor(&packed, &n.table());
        assert_eq!((got.0, got.1.as_slice()), (Dtype::U8, &[256u64, 264][..]));
        assert!(got.2 == tensor(&inline, &n.table()).2, "layer {layer}");
        assert!(
            Header::read(file_of(&packed, &n.table()))
                .unwrap()
                .tensor(&n.table_scale())
                .is_none()
        );
    }
    let index = std::fs::read_to_string(packed.join(INDEX_FILE)).unwrap();
    assert!(!index.contains("embed.scale"), "{index}");
    // The token map travels with the checkpoint.
    assert_eq!(
        std::fs::read(packed.join(TOKEN_MAP_FILE)).unwrap(),
        std::fs::read(inline.join(TOKEN_MAP_FILE)).unwrap()
    );
    let want = Checkpoint::open(&inline).unwrap();
    for (a, b) in ck.sites.iter().zip(&want.sites) {
        assert_eq!(a.weights.key_proj, b.weights.key_proj);
        assert_eq!(a.table.bytes, b.table.bytes);
    }
}

/// Every site of `ck` over `tokens` from a fresh carry, tables in `mode`.
fn highway(ck: &Checkpoint, mode: TableMode, tokens: &[u32]) -> Vec<f32> {
    let gpu: Arc<dyn GpuBackend> = Arc::new(CpuBackend::new());
    let sites: Vec<PleSite> = (0..ck.sites.len())
        .map(|s| {
            let t = match mode {
                TableMode::Cached => ck.open_cached_table(s, CacheConfig::new(32), gpu.clone()),
                m => ck.open_table(s, m, gpu.clone()),
            }
            .unwrap();
            PleSite::new(ck.build_layer(s, t, 16, gpu.as_ref()).unwrap())
        })
        .collect();
    metrale_testkit::drive::reference_run(&sites, gpu.as_ref(), tokens)
}

fn write_tiny(dir: &Path, layout: TableLayout) {
    write_spec_synthetic_as(
        dir,
        &TinyFamily::EngramV41.spec(),
        Some(120),
        TableDType::Fp8Block,
        9,
        layout,
    )
    .unwrap();
}

#[test]
fn a_packed_release_gives_the_inline_highway_in_every_table_mode() {
    let tmp = tempfile::tempdir().unwrap();
    let t = tmp.path();
    let (rel, inline, packed) = (t.join("rel"), t.join("inline"), t.join("packed"));
    write_tiny(&rel, TableLayout::Release);
    write_tiny(&inline, TableLayout::Inline);
    let (o, out, err) = run(
        t,
        &[
            "table",
            "pack",
            rel.to_str().unwrap(),
            packed.to_str().unwrap(),
        ],
    );
    assert!(o.status.success(), "{out} {err}");
    let got = Checkpoint::open(&packed).unwrap();
    let want = Checkpoint::open(&inline).unwrap();
    let tokens: Vec<u32> = (0..40u32).map(|i| (i * 37 + 5) % 1000).collect();
    let reference = highway(&want, TableMode::Resident, &tokens);
    assert!(reference.iter().all(|v| v.is_finite()));
    for mode in [TableMode::Resident, TableMode::Mapped, TableMode::Cached] {
        let h = highway(&got, mode, &tokens);
        assert!(
            metrale_testkit::same_bits(&h, &reference),
            "{mode:?}: the packed release's highway differs from the inline checkpoint's"
        );
    }
}

/// Damage done to a released checkpoint's directory.
type Damage<'a> = Box<dyn Fn(&Path) + 'a>;

#[test]
fn malformed_release_tables_fail_the_pack_naming_file_and_tensor() {
    let tmp = tempfile::tempdir().unwrap();
    let t = tmp.path();
    let spec = TinyFamily::EngramV41.spec();
    let n = V41Names::new(spec.site_layer(1));
    let sn = n.table_scale();
    let good = t.join("good");
    write_tiny(&good, TableLayout::Release);
    let scales = tensor(&good, &sn).2;
    let nb = spec.head_dim as u64 / 32;
    let cases: Vec<(&str, Damage, &str)> = vec![
        (
            "nan",
            Box::new(|ck: &Path| {
                let mut s = scales.clone();
                s[33] = 255;
                let spec = TensorSpec::new(&sn, Dtype::F8E8M0, &[120, nb]);
                replace_tensor(&file_of(ck, &sn), &sn, spec, s);
            }),
            "row 33",
        ),
        (
            "shape",
            Box::new(|ck: &Path| {
                let spec = TensorSpec::new(&sn, Dtype::F8E8M0, &[119, nb]);
                replace_tensor(&file_of(ck, &sn), &sn, spec, vec![127; 119 * nb as usize]);
            }),
            "has shape [119, 1], expected [120, 1]",
        ),
        (
            "dtype",
            Box::new(|ck: &Path| {
                let spec = TensorSpec::new(&sn, Dtype::U16, &[120, nb]);
                replace_tensor(&file_of(ck, &sn), &sn, spec, vec![0; 240 * nb as usize]);
            }),
            "has dtype U16, expected F8_E8M0",
        ),
        (
            "missing",
            Box::new(|ck: &Path| {
                let ip = ck.join(INDEX_FILE);
                let mut index: serde_json::Value =
                    serde_json::from_str(&std::fs::read_to_string(&ip).unwrap()).unwrap();
                index["weight_map"].as_object_mut().unwrap().remove(&sn);
                std::fs::write(&ip, index.to_string()).unwrap();
            }),
            "is missing",
        ),
    ];
    for (name, damage, want) in cases {
        let src = t.join(format!("src-{name}"));
        write_tiny(&src, TableLayout::Release);
        damage(&src);
        let named = if name == "missing" {
            src.join(INDEX_FILE)
        } else {
            file_of(&src, &sn)
        };
        let dst = t.join(format!("dst-{name}"));
        let (o, out, err) = run(
            t,
            &[
                "table",
                "pack",
                src.to_str().unwrap(),
                dst.to_str().unwrap(),
            ],
        );
        assert_eq!(o.status.code(), Some(2), "{name}: {out} {err}");
        assert!(
            err.contains(&named.display().to_string()) && err.contains(&sn) && err.contains(want),
            "{name}: {err}"
        );
        nothing_at(&dst);
    }
}

#[test]
fn release_layout_misuse_is_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let t = tmp.path();
    let x = t.join("x");
    let (o, _, err) = run(
        t,
        &[
            "init",
            x.to_str().unwrap(),
            "--preset",
            "tiny",
            "--layout",
            "release",
        ],
    );
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(err.contains("release layout"), "{err}");
    assert!(!x.exists());
    // Hot-row relaying reads inline rows: convert first.
    let rel = t.join("rel");
    write_tiny(&rel, TableLayout::Release);
    let trace = t.join("trace.txt");
    std::fs::write(&trace, "0 5\n0 7\n").unwrap();
    let dst = t.join("hot");
    let (o, _, err) = run(
        t,
        &[
            "table",
            "pack",
            "--hot-rows",
            trace.to_str().unwrap(),
            rel.to_str().unwrap(),
            dst.to_str().unwrap(),
        ],
    );
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(err.contains("convert it first"), "{err}");
    nothing_at(&dst);
}
