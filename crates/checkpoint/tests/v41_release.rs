//! DeepSeek-V4.1's table as released (`embed.weight` F8_E4M3 plus
//! `embed.scale` F8_E8M0, the projection's scales F8_E8M0): the writer's
//! release layout holds the inline layout's bytes split in two, the loader
//! refuses it pointing at `table pack` (or accepts it for the conversion
//! only), the conversion gives the inline tensor byte for byte, and every
//! malformed scale tensor is refused naming the file and the tensor,
//! leaving nothing at the destination.

use std::path::{Path, PathBuf};

use metrale_checkpoint::load::OpenOptions;
use metrale_checkpoint::names::{CONFIG_FILE, INDEX_FILE, TOKEN_MAP_FILE, V41Names};
use metrale_checkpoint::release::{SplitTable, convert_file, convert_index};
use metrale_checkpoint::runtime::TableMode;
use metrale_checkpoint::synth::{TableLayout, write_spec_synthetic_as};
use metrale_checkpoint::{Checkpoint, CheckpointError, TableDType};
use metrale_storage::pack::pack;
use metrale_storage::safetensors::{Dtype, Header, TensorSpec};
use metrale_storage::table::RowDType;
use metrale_testkit::families::TinyFamily;
use metrale_testkit::files::{file_of, replace_tensor};

/// Rows stored per site (cut, so ids fold).
const ROWS: u64 = 120;

fn write(dir: &Path, name: &str, layout: TableLayout) -> PathBuf {
    let p = dir.join(name);
    write_spec_synthetic_as(
        &p,
        &TinyFamily::EngramV41.spec(),
        Some(ROWS),
        TableDType::Fp8Block,
        4,
        layout,
    )
    .unwrap();
    p
}

fn release_opts() -> OpenOptions {
    OpenOptions {
        release_tables: true,
        ..OpenOptions::default()
    }
}

/// Convert the released checkpoint `src` into `dst` as `table pack` does:
/// files holding a released table converted, the rest realigned, the
/// weight map rewritten, config and token map copied.
fn convert_dir(src: &Path, dst: &Path) -> Result<Vec<SplitTable>, CheckpointError> {
    let ck = Checkpoint::open_with(src, release_opts())?;
    let tables = ck.release_tables();
    std::fs::create_dir_all(dst).unwrap();
    for f in &ck.files {
        let (a, b) = (src.join(&f.name), dst.join(&f.name));
        if tables
            .iter()
            .any(|t| t.weight_file == a || t.scale_file == a)
        {
            convert_file(&a, &b, &tables, &mut |_, _| {})?;
        } else {
            pack(&a, &b, &mut |_, _| {}).unwrap();
        }
    }
    let text = std::fs::read_to_string(src.join(INDEX_FILE)).unwrap();
    let index = convert_index(&text, &src.join(INDEX_FILE), &tables)?;
    std::fs::write(dst.join(INDEX_FILE), index).unwrap();
    for n in [CONFIG_FILE, TOKEN_MAP_FILE] {
        std::fs::copy(src.join(n), dst.join(n)).unwrap();
    }
    Ok(tables)
}

#[test]
fn the_release_layout_splits_the_inline_rows_and_open_points_at_table_pack() {
    let tmp = tempfile::tempdir().unwrap();
    let inline = write(tmp.path(), "inline", TableLayout::Inline);
    let rel = write(tmp.path(), "release", TableLayout::Release);
    let inl = Checkpoint::open(&inline).unwrap();
    let spec = TinyFamily::EngramV41.spec();
    let hd = spec.head_dim;
    let n = V41Names::new(inl.sites[0].layer);
    // The released tensors: values F8_E4M3, scales F8_E8M0, beside each
    // other; the projection's scales F8_E8M0 too.
    let tf = file_of(&rel, &n.table());
    let h = Header::read(&tf).unwrap();
    let w = h.get(&n.table()).unwrap();
    let s = h.get(&n.table_scale()).unwrap();
    assert_eq!(
        (w.dtype, w.shape.as_slice()),
        (Dtype::F8E4M3, &[ROWS, hd as u64][..])
    );
    assert_eq!(
        (s.dtype, s.shape.as_slice()),
        (Dtype::F8E8M0, &[ROWS, hd as u64 / 32][..])
    );
    let dense = Header::read(file_of(&rel, &n.wkv_scale())).unwrap();
    assert_eq!(dense.get(&n.wkv_scale()).unwrap().dtype, Dtype::F8E8M0);
    // Row r of the inline tensor is value row r then scale row r.
    let ih = Header::read(file_of(&inline, &n.table())).unwrap();
    let want = ih.read_tensor(&n.table()).unwrap();
    let (vals, scales) = (
        h.read_tensor(&n.table()).unwrap(),
        h.read_tensor(&n.table_scale()).unwrap(),
    );
    let nb = hd / 32;
    let mut got = Vec::new();
    for (v, s) in vals.chunks_exact(hd).zip(scales.chunks_exact(nb)) {
        got.extend_from_slice(v);
        got.extend_from_slice(s);
    }
    assert_eq!(got, want, "the release layout holds other values");

    // Refused by name, pointing at the conversion.
    let e = Checkpoint::open(&rel).unwrap_err();
    assert!(
        matches!(&e, CheckpointError::ReleasedTable { file, tensor, scale }
            if file == &tf && tensor == &n.table() && scale == &n.table_scale()),
        "{e:?}"
    );
    let msg = e.to_string();
    assert!(
        msg.contains("metrale-ple table pack") && msg.contains(&n.table()),
        "{msg}"
    );
    // Accepted for the conversion: the dense weights (F8_E8M0 projection
    // scales) equal the inline checkpoint's; the table reads as what it
    // converts to.
    let ck = Checkpoint::open_with(&rel, release_opts()).unwrap();
    for (a, b) in ck.sites.iter().zip(&inl.sites) {
        assert_eq!(a.weights.key_proj, b.weights.key_proj);
        assert_eq!(a.weights.value_proj, b.weights.value_proj);
        assert_eq!(a.weights.norm_key, b.weights.norm_key);
        assert_eq!(a.table.dtype, RowDType::Fp8E4M3Block32);
        assert_eq!(a.table.bytes, b.table.bytes);
        assert_eq!(a.table.fold_rows, b.table.fold_rows);
        let sp = a.table.release.as_ref().unwrap();
        assert_eq!(
            (sp.rows, sp.head_dim, sp.row_bytes()),
            (ROWS, hd, hd as u64 + 1)
        );
        assert!(b.table.release.is_none());
    }
    assert_eq!(ck.release_tables().len(), ck.sites.len());
    // Never served as it is, in any mode.
    let gpu: std::sync::Arc<dyn metrale_gpu_runtime::gpu::GpuBackend> =
        std::sync::Arc::new(metrale_gpu_runtime::cpu::CpuBackend::new());
    for mode in [TableMode::Resident, TableMode::Mapped, TableMode::Cached] {
        let e = ck.open_table(1, mode, gpu.clone()).err().unwrap();
        assert!(
            matches!(&e, CheckpointError::ReleasedTable { tensor, .. } if tensor == &V41Names::new(ck.sites[1].layer).table()),
            "{mode:?}: {e:?}"
        );
    }
}

#[test]
fn the_conversion_gives_the_inline_checkpoint_byte_for_byte() {
    let tmp = tempfile::tempdir().unwrap();
    let inline = write(tmp.path(), "inline", TableLayout::Inline);
    let rel = write(tmp.path(), "release", TableLayout::Release);
    let dst = tmp.path().join("converted");
    let tables = convert_dir(&rel, &dst).unwrap();
    assert_eq!(tables.len(), 2);
    let got = Checkpoint::open(&dst).unwrap();
    let want = Checkpoint::open(&inline).unwrap();
    let index: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dst.join(INDEX_FILE)).unwrap()).unwrap();
    for (a, b) in got.sites.iter().zip(&want.sites) {
        let n = V41Names::new(a.layer);
        assert!(index["weight_map"].get(n.table_scale()).is_none());
        assert_eq!(a.table.dtype, b.table.dtype);
        assert_eq!(a.table.stored_rows, b.table.stored_rows);
        assert_eq!(a.weights.key_proj, b.weights.key_proj);
        let read = |ck: &Path| {
            let f = file_of(ck, &n.table());
            let h = Header::read(&f).unwrap();
            assert!(h.tensor(&n.table_scale()).is_none());
            let t = h.get(&n.table()).unwrap();
            assert_eq!((t.dtype, t.shape.as_slice()), (Dtype::U8, &[ROWS, 33][..]));
            h.read_tensor(&n.table()).unwrap()
        };
        assert_eq!(read(&dst), read(&inline), "layer {}", a.layer);
    }
    assert!(got.files.iter().all(|f| f.data_start % 4096 == 0));
}

/// The released checkpoint with `tensor` of the file holding it replaced.
fn damaged(root: &Path, name: &str, tensor: &str, spec: TensorSpec, data: Vec<u8>) -> PathBuf {
    let ck = write(root, name, TableLayout::Release);
    replace_tensor(&file_of(&ck, tensor), tensor, spec, data);
    ck
}

#[test]
fn malformed_scales_are_refused_naming_file_and_tensor() {
    let tmp = tempfile::tempdir().unwrap();
    let spec = TinyFamily::EngramV41.spec();
    let layer = spec.site_layer(0);
    let n = V41Names::new(layer);
    let sn = n.table_scale();
    let nb = spec.head_dim as u64 / 32;

    // Wrong shape.
    let ck = damaged(
        tmp.path(),
        "shape",
        &sn,
        TensorSpec::new(&sn, Dtype::F8E8M0, &[ROWS, nb + 1]),
        vec![127; (ROWS * (nb + 1)) as usize],
    );
    for opts in [OpenOptions::default(), release_opts()] {
        let e = Checkpoint::open_with(&ck, opts).unwrap_err();
        assert!(
            matches!(&e, CheckpointError::Shape { tensor, expected, .. }
                if tensor == &sn && expected == &[ROWS, nb]),
            "{e:?}"
        );
        assert!(
            e.to_string()
                .contains(&file_of(&ck, &sn).display().to_string())
        );
    }
    // Wrong dtype, two-dimensional: the release's scales, mistyped.
    let ck = damaged(
        tmp.path(),
        "dtype",
        &sn,
        TensorSpec::new(&sn, Dtype::BF16, &[ROWS, nb]),
        vec![0; (ROWS * nb * 2) as usize],
    );
    let e = Checkpoint::open_with(&ck, release_opts()).unwrap_err();
    assert!(
        matches!(&e, CheckpointError::DType { tensor, expected, found, .. }
            if tensor == &sn && expected == "F8_E8M0" && found == "BF16"),
        "{e:?}"
    );
    // Values of the wrong width beside release scales.
    let ck = damaged(
        tmp.path(),
        "width",
        &n.table(),
        TensorSpec::new(n.table(), Dtype::F8E4M3, &[ROWS, 64]),
        vec![0; (ROWS * 64) as usize],
    );
    let e = Checkpoint::open_with(&ck, release_opts()).unwrap_err();
    assert!(
        matches!(&e, CheckpointError::Shape { tensor, .. } if tensor == &n.table()),
        "{e:?}"
    );
    // Missing scale: out of the file and the weight map.
    let ck = write(tmp.path(), "missing", TableLayout::Release);
    let f = file_of(&ck, &sn);
    let h = Header::read(&f).unwrap();
    let keep: Vec<(TensorSpec, Vec<u8>)> = h
        .tensors
        .iter()
        .filter(|t| t.name != sn)
        .map(|t| {
            (
                TensorSpec::new(&t.name, t.dtype, &t.shape),
                h.read_tensor(&t.name).unwrap(),
            )
        })
        .collect();
    let refs: Vec<(TensorSpec, &[u8])> = keep.iter().map(|(s, d)| (s.clone(), &d[..])).collect();
    metrale_storage::safetensors::write_file(&f, &refs, 8).unwrap();
    let ip = ck.join(INDEX_FILE);
    let mut index: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&ip).unwrap()).unwrap();
    index["weight_map"].as_object_mut().unwrap().remove(&sn);
    std::fs::write(&ip, index.to_string()).unwrap();
    let e = Checkpoint::open_with(&ck, release_opts()).unwrap_err();
    assert!(
        matches!(&e, CheckpointError::MissingTensor { file, tensor } if tensor == &sn && file == &ip),
        "{e:?}"
    );
    // In the weight map, not in its file.
    index["weight_map"][&sn] = serde_json::json!(f.file_name().unwrap().to_str().unwrap());
    std::fs::write(&ip, index.to_string()).unwrap();
    let e = Checkpoint::open_with(&ck, release_opts()).unwrap_err();
    assert!(
        matches!(&e, CheckpointError::MissingTensor { file, tensor } if tensor == &sn && file == &f),
        "{e:?}"
    );
}

#[test]
fn nan_codes_are_refused_by_the_conversion_leaving_nothing_behind() {
    let tmp = tempfile::tempdir().unwrap();
    let spec = TinyFamily::EngramV41.spec();
    let n = V41Names::new(spec.site_layer(1));
    let (hd, nb) = (spec.head_dim, spec.head_dim / 32);
    let good = write(tmp.path(), "good", TableLayout::Release);
    let h = Header::read(file_of(&good, &n.table())).unwrap();
    let scales = h.read_tensor(&n.table_scale()).unwrap();
    let vals = h.read_tensor(&n.table()).unwrap();

    // A UE8M0 NaN scale in row 77: headers pass, the conversion refuses.
    let mut bad = scales.clone();
    bad[77 * nb] = 255;
    let sn = n.table_scale();
    let ck = damaged(
        tmp.path(),
        "nan-scale",
        &sn,
        TensorSpec::new(&sn, Dtype::F8E8M0, &[ROWS, nb as u64]),
        bad,
    );
    let dst = tmp.path().join("out-scale");
    let e = convert_dir(&ck, &dst).unwrap_err();
    let f = file_of(&ck, &sn);
    assert!(
        matches!(&e, CheckpointError::Value { file, tensor, msg }
            if file == &f && tensor == &sn && msg.contains("row 77") && msg.contains("255")),
        "{e:?}"
    );
    // The converted file never appeared, nor its partial.
    let name = f.file_name().unwrap();
    let left: Vec<_> = std::fs::read_dir(&dst)
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .filter(|x| x.to_string_lossy().starts_with(&*name.to_string_lossy()))
        .collect();
    assert!(left.is_empty(), "{left:?}");

    // An E4M3 NaN value in row 5, column 3.
    let mut bad = vals.clone();
    bad[5 * hd + 3] = 0xFF;
    let ck = damaged(
        tmp.path(),
        "nan-value",
        &n.table(),
        TensorSpec::new(n.table(), Dtype::F8E4M3, &[ROWS, hd as u64]),
        bad,
    );
    let e = convert_dir(&ck, &tmp.path().join("out-value")).unwrap_err();
    assert!(
        matches!(&e, CheckpointError::Value { tensor, msg, .. }
            if tensor == &n.table() && msg.contains("value 3 of row 5")),
        "{e:?}"
    );
}

#[test]
fn projection_scales_in_f8_e8m0_are_checked_like_u8_ones() {
    let tmp = tempfile::tempdir().unwrap();
    let spec = TinyFamily::EngramV41.spec();
    let n = V41Names::new(spec.site_layer(0));
    let good = write(tmp.path(), "good", TableLayout::Release);
    let f = file_of(&good, &n.wkv_scale());
    let h = Header::read(&f).unwrap();
    let t = h.get(&n.wkv_scale()).unwrap().clone();
    let mut sc = h.read_tensor(&n.wkv_scale()).unwrap();
    sc[2] = 255;
    let ck = damaged(
        tmp.path(),
        "nan",
        &n.wkv_scale(),
        TensorSpec::new(n.wkv_scale(), Dtype::F8E8M0, &t.shape),
        sc.clone(),
    );
    let e = Checkpoint::open_with(&ck, release_opts()).unwrap_err();
    assert!(
        matches!(&e, CheckpointError::Value { tensor, msg, .. }
            if tensor == &n.wkv_scale() && msg.contains("block scale 2")),
        "{e:?}"
    );
    let ck = damaged(
        tmp.path(),
        "dtype",
        &n.wkv_scale(),
        TensorSpec::new(n.wkv_scale(), Dtype::I8, &t.shape),
        sc,
    );
    let e = Checkpoint::open_with(&ck, release_opts()).unwrap_err();
    assert!(
        matches!(&e, CheckpointError::DType { tensor, found, .. }
            if tensor == &n.wkv_scale() && found == "I8"),
        "{e:?}"
    );
}

#[test]
fn the_release_layout_is_only_for_v41_block_rows() {
    let tmp = tempfile::tempdir().unwrap();
    for (family, dtype) in [
        (TinyFamily::EngramV41, TableDType::Bf16),
        (TinyFamily::EngramConv, TableDType::Fp8Block),
    ] {
        let e = write_spec_synthetic_as(
            &tmp.path().join("x"),
            &family.spec(),
            Some(64),
            dtype,
            1,
            TableLayout::Release,
        )
        .unwrap_err();
        assert!(e.to_string().contains("release layout"), "{e}");
        assert!(!tmp.path().join("x").exists());
    }
}
