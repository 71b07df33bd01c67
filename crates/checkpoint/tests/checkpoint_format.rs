//! The checkpoint format end to end: a synthetic checkpoint loads, is
//! deterministic, and every kind of damage is refused with a message naming
//! the file and tensor.

use std::path::{Path, PathBuf};

use metrale_checkpoint::names::{INDEX_FILE, SiteNames, shard_file};
use metrale_checkpoint::synth::write_synthetic;
use metrale_checkpoint::{Checkpoint, CheckpointError, InitOptions, Preset, TableDType};
use metrale_storage::safetensors::{Header, TensorSpec};
use metrale_storage::table::RowDType;
use metrale_testkit::files::replace_tensor;

fn opts(rows: Option<u64>, dtype: TableDType, seed: u64) -> InitOptions {
    InitOptions {
        preset: Preset::Tiny,
        table_rows: rows,
        dtype,
        seed,
    }
}

fn write(dir: &Path, o: &InitOptions) -> PathBuf {
    let p = dir.join("ckpt");
    write_synthetic(&p, o, &mut |_, _| {}).unwrap();
    p
}

/// A small cut tiny checkpoint: 2 sites, 2 shards of 2048 rows each.
fn small(dir: &Path) -> PathBuf {
    write(dir, &opts(Some(4096), TableDType::Bf16, 7))
}

fn dense(ck: &Path) -> PathBuf {
    ck.join(shard_file(1, 5))
}

fn patch_i64(file: &Path, name: &str, index: usize, value: i64) {
    use std::os::unix::fs::FileExt;
    let h = Header::read(file).unwrap();
    let t = h.get(name).unwrap();
    let f = std::fs::OpenOptions::new().write(true).open(file).unwrap();
    f.write_all_at(&value.to_le_bytes(), t.offset + 8 * index as u64)
        .unwrap();
}

fn refusal(ck: &Path) -> String {
    let e: CheckpointError = Checkpoint::open(ck).unwrap_err();
    e.to_string()
}

#[test]
fn a_synthetic_checkpoint_loads_with_its_spec() {
    let tmp = tempfile::tempdir().unwrap();
    let ck = small(tmp.path());
    let c = Checkpoint::open(&ck).unwrap();
    let g = &c.spec;
    assert_eq!(g.ple_layer_ids, vec![2, 3]);
    assert_eq!(g.table_rows, Some(4096));
    assert_eq!(c.sites.len(), 2);
    for (s, site) in c.sites.iter().enumerate() {
        assert_eq!(site.layer, g.ple_layer_ids[s] - 1);
        assert_eq!(site.table.shards.len(), 2);
        assert_eq!(site.table.rows_per_shard, 2048);
        assert_eq!(site.table.fold_rows, Some(4096));
        assert_eq!(site.table.dtype, RowDType::Bf16);
        assert!(site.padded_rows > 4096);
        assert!(site.spec.dims.multipliers.iter().all(|m| m % 2 == 1));
        assert_eq!(site.weights.key_proj.len(), g.channels() * g.emb_dim());
        assert_eq!(site.weights.conv1d.len(), g.channels() * g.conv_kernel_size);
    }
    // Two sites hash with different constants.
    assert_ne!(
        c.sites[0].spec.dims.multipliers,
        c.sites[1].spec.dims.multipliers
    );
    assert_eq!(c.files.len(), 5);
}

#[test]
fn the_full_tiny_table_is_not_folded() {
    let tmp = tempfile::tempdir().unwrap();
    let ck = write(tmp.path(), &opts(None, TableDType::Bf16, 1));
    let c = Checkpoint::open(&ck).unwrap();
    for site in &c.sites {
        assert_eq!(site.table.fold_rows, None);
        assert!(site.table.stored_rows >= site.padded_rows);
    }
    assert_eq!(c.spec.table_rows, None);
}

#[test]
fn fp8_tables_carry_scales() {
    let tmp = tempfile::tempdir().unwrap();
    let ck = write(tmp.path(), &opts(Some(1000), TableDType::Fp8, 3));
    let c = Checkpoint::open(&ck).unwrap();
    assert_eq!(c.sites[0].table.dtype, RowDType::Fp8E4M3);
    // 1000 rows round up to two equal shards.
    assert_eq!(c.sites[0].table.stored_rows, 1000);
    assert_eq!(c.sites[0].table.bytes, 1000 * (16 + 4));
}

#[test]
fn the_writer_is_deterministic_in_its_seed() {
    let a = tempfile::tempdir().unwrap();
    let b = tempfile::tempdir().unwrap();
    let c = tempfile::tempdir().unwrap();
    let pa = write(a.path(), &opts(Some(512), TableDType::Bf16, 11));
    let pb = write(b.path(), &opts(Some(512), TableDType::Bf16, 11));
    let pc = write(c.path(), &opts(Some(512), TableDType::Bf16, 12));
    for k in 1..=5 {
        let f = shard_file(k, 5);
        let (x, y, z) = (
            std::fs::read(pa.join(&f)).unwrap(),
            std::fs::read(pb.join(&f)).unwrap(),
            std::fs::read(pc.join(&f)).unwrap(),
        );
        assert_eq!(x, y, "{f}");
        assert_ne!(x, z, "{f}");
    }
}

#[test]
fn init_refuses_a_non_empty_directory_and_too_many_rows() {
    let tmp = tempfile::tempdir().unwrap();
    let ck = small(tmp.path());
    let e =
        write_synthetic(&ck, &opts(Some(4096), TableDType::Bf16, 7), &mut |_, _| {}).unwrap_err();
    assert!(
        e.to_string().contains("already exists and is not empty"),
        "{e}"
    );
    let e = write_synthetic(
        &tmp.path().join("x"),
        &opts(Some(1 << 40), TableDType::Bf16, 7),
        &mut |_, _| {},
    )
    .unwrap_err();
    assert!(e.to_string().contains("more than the"), "{e}");
    assert!(!tmp.path().join("x").exists());
}

#[test]
fn a_wrong_shape_is_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let ck = small(tmp.path());
    let g = Checkpoint::open(&ck).unwrap().spec;
    let name = SiteNames::new(1).value_proj();
    let (h, e) = (g.hidden_size as u64, g.emb_dim() as u64);
    let spec = TensorSpec::new(
        &name,
        metrale_storage::safetensors::Dtype::BF16,
        &[h + 1, e],
    );
    replace_tensor(
        &dense(&ck),
        &name,
        spec,
        vec![0u8; ((h + 1) * e * 2) as usize],
    );
    let msg = refusal(&ck);
    assert!(msg.contains(&name), "{msg}");
    assert!(
        msg.contains(&format!("has shape [{}, {e}], expected [{h}, {e}]", h + 1)),
        "{msg}"
    );
    assert!(msg.contains("model-00001-of-00005.safetensors"), "{msg}");
}

#[test]
fn a_wrong_dtype_is_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let ck = small(tmp.path());
    let g = Checkpoint::open(&ck).unwrap().spec;
    let name = SiteNames::new(2).norm_conv();
    let c = g.channels() as u64;
    let spec = TensorSpec::new(&name, metrale_storage::safetensors::Dtype::I32, &[c]);
    replace_tensor(&dense(&ck), &name, spec, vec![0u8; (c * 4) as usize]);
    let msg = refusal(&ck);
    assert!(
        msg.contains(&format!(
            "tensor {name} has dtype I32, expected a float dtype (F32, BF16 or F16)"
        )),
        "{msg}"
    );
}

/// Any float dtype transformers saves converts: a BF16 norm reads as the
/// same f32 values, an F16 norm exactly, an F32 projection rounds to BF16.
#[test]
fn dense_weights_in_any_float_dtype_convert() {
    use metrale_storage::dtype::{bf16_to_f32, f32_to_bf16};
    use metrale_storage::safetensors::Dtype;
    let tmp = tempfile::tempdir().unwrap();
    let ck = small(tmp.path());
    let before = Checkpoint::open(&ck).unwrap();
    let g = before.spec.clone();
    let c = g.channels();
    let site = &before.sites[1];
    // norm_conv as BF16 of its values (rounded), F16 for norm_key.
    let n = SiteNames::new(2);
    let conv_bf: Vec<u16> = site
        .weights
        .norm_conv
        .iter()
        .map(|&v| f32_to_bf16(v))
        .collect();
    let bytes: Vec<u8> = conv_bf.iter().flat_map(|v| v.to_le_bytes()).collect();
    replace_tensor(
        &dense(&ck),
        &n.norm_conv(),
        TensorSpec::new(n.norm_conv(), Dtype::BF16, &[c as u64]),
        bytes,
    );
    let key_f16: Vec<u8> = site
        .weights
        .norm_key
        .iter()
        .flat_map(|&v| half::f16::from_f32(v).to_le_bytes())
        .collect();
    replace_tensor(
        &dense(&ck),
        &n.norm_key(),
        TensorSpec::new(n.norm_key(), Dtype::F16, &[c as u64]),
        key_f16,
    );
    let e = g.emb_dim();
    let value_f32: Vec<u8> = site
        .weights
        .value_proj
        .iter()
        .flat_map(|&b| (bf16_to_f32(b) * (1.0 + 2f32.powi(-12))).to_le_bytes())
        .collect();
    replace_tensor(
        &dense(&ck),
        &n.value_proj(),
        TensorSpec::new(
            n.value_proj(),
            Dtype::F32,
            &[g.hidden_size as u64, e as u64],
        ),
        value_f32,
    );
    let after = Checkpoint::open(&ck).unwrap();
    let w = &after.sites[1].weights;
    let want: Vec<f32> = conv_bf.iter().map(|&b| bf16_to_f32(b)).collect();
    assert_eq!(w.norm_conv, want);
    let want: Vec<f32> = site
        .weights
        .norm_key
        .iter()
        .map(|&v| half::f16::from_f32(v).to_f32())
        .collect();
    assert_eq!(w.norm_key, want);
    // A value a hair above a BF16 value rounds back to it.
    assert_eq!(w.value_proj, site.weights.value_proj);
}

#[test]
fn an_even_multiplier_is_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let ck = small(tmp.path());
    let name = SiteNames::new(1).layer_multipliers();
    patch_i64(&dense(&ck), &name, 2, 1234);
    let msg = refusal(&ck);
    assert!(msg.contains(&name), "{msg}");
    assert!(msg.contains("multiplier 2 is 1234, which is even"), "{msg}");
}

#[test]
fn hash_buffers_must_match_their_derivation() {
    let tmp = tempfile::tempdir().unwrap();
    let ck = small(tmp.path());
    let name = SiteNames::new(2).offsets();
    patch_i64(&dense(&ck), &name, 1, 5);
    let msg = refusal(&ck);
    assert!(
        msg.contains(&name) && msg.contains("entry 1 is 5, but the derivation"),
        "{msg}"
    );

    let ck2 = write(
        &tmp.path().join("b"),
        &opts(Some(4096), TableDType::Bf16, 7),
    );
    let name = SiteNames::new(1).layer_multipliers();
    patch_i64(&dense(&ck2), &name, 0, 3);
    let msg = refusal(&ck2);
    assert!(
        msg.contains(&name) && msg.contains("entry 0 is 3, but the derivation"),
        "{msg}"
    );
}

#[test]
fn a_missing_shard_is_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let ck = small(tmp.path());
    // The shard file is gone.
    std::fs::remove_file(ck.join(shard_file(3, 5))).unwrap();
    let msg = refusal(&ck);
    assert!(msg.contains("model-00003-of-00005.safetensors"), "{msg}");
    assert!(
        msg.contains("model.layers.1.ple.ple_embedding.ngram_embedding.shard_1.weight"),
        "{msg}"
    );

    // The shard is absent from the weight map.
    let ck2 = write(
        &tmp.path().join("b"),
        &opts(Some(4096), TableDType::Bf16, 7),
    );
    let ipath = ck2.join(INDEX_FILE);
    let mut v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&ipath).unwrap()).unwrap();
    v["weight_map"]
        .as_object_mut()
        .unwrap()
        .remove("model.layers.2.ple.ple_embedding.ngram_embedding.shard_0.weight");
    std::fs::write(&ipath, v.to_string()).unwrap();
    let msg = refusal(&ck2);
    assert!(msg.contains(INDEX_FILE), "{msg}");
    assert!(
        msg.contains(
            "tensor model.layers.2.ple.ple_embedding.ngram_embedding.shard_0.weight is missing"
        ),
        "{msg}"
    );
}

#[test]
fn a_corrupt_header_is_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let ck = small(tmp.path());
    let f = ck.join(shard_file(4, 5));
    let mut bytes = std::fs::read(&f).unwrap();
    bytes[8..16].copy_from_slice(b"#garbage");
    std::fs::write(&f, bytes).unwrap();
    let msg = refusal(&ck);
    assert!(
        msg.contains("model-00004-of-00005.safetensors: corrupt safetensors header"),
        "{msg}"
    );

    // A truncated shard is caught from its header alone.
    let ck2 = write(
        &tmp.path().join("b"),
        &opts(Some(4096), TableDType::Bf16, 7),
    );
    let f = ck2.join(shard_file(5, 5));
    let len = std::fs::metadata(&f).unwrap().len();
    std::fs::OpenOptions::new()
        .write(true)
        .open(&f)
        .unwrap()
        .set_len(len - 100)
        .unwrap();
    let msg = refusal(&ck2);
    assert!(
        msg.contains("model-00005-of-00005.safetensors: corrupt safetensors header"),
        "{msg}"
    );
}

#[test]
fn a_short_table_without_a_fold_is_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let ck = small(tmp.path());
    let cpath = ck.join("config.json");
    let mut v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&cpath).unwrap()).unwrap();
    v.as_object_mut().unwrap().remove("ple_table_rows");
    std::fs::write(&cpath, v.to_string()).unwrap();
    let msg = refusal(&ck);
    // Without the fold, each shard must hold its torch.chunk share of the
    // site's 200,192 padded rows.
    assert!(
        msg.contains("shard_0.weight has shape [2048, 16], expected [100096, 16]"),
        "{msg}"
    );
}

#[test]
fn a_weight_map_escaping_the_directory_is_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let ck = small(tmp.path());
    let ipath = ck.join(INDEX_FILE);
    let mut v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&ipath).unwrap()).unwrap();
    v["weight_map"]["model.layers.1.ple.key_proj.weight"] = serde_json::json!("../x.safetensors");
    std::fs::write(&ipath, v.to_string()).unwrap();
    let msg = refusal(&ck);
    assert!(
        msg.contains("not a file name inside the checkpoint directory"),
        "{msg}"
    );
}
