//! Engram and LongCat checkpoints end to end: `init` writes each family
//! preset with its real config keys, tensor names, shapes and dtypes; the
//! loader rebuilds the layer's weights from them and refuses damage naming
//! the file and tensor; every table mode gives the same highway.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use metrale_checkpoint::family::Layout;
use metrale_checkpoint::names::{
    CONFIG_FILE, EngramDemoNames, LongCatNames, TOKEN_MAP_FILE, V41Names, shard_file,
};
use metrale_checkpoint::runtime::TableMode;
use metrale_checkpoint::synth::{write_spec_synthetic, write_synthetic};
use metrale_checkpoint::{Checkpoint, CheckpointError, InitOptions, Preset, TableDType};
use metrale_gpu_runtime::cpu::CpuBackend;
use metrale_gpu_runtime::gpu::GpuBackend;
use metrale_model_layers::layers::ple::ForwardContext;
use metrale_storage::cached::CacheConfig;
use metrale_storage::safetensors::{Dtype, Header, TensorSpec};
use metrale_storage::table::RowDType;
use metrale_testkit::families::TinyFamily;
use metrale_testkit::files::{file_of, replace_tensor, reshape_tensor};

fn write(dir: &Path, preset: Preset, rows: u64) -> PathBuf {
    let p = dir.join(preset.name());
    let o = InitOptions {
        preset,
        table_rows: Some(rows),
        dtype: preset.default_dtype(),
        seed: 3,
    };
    write_synthetic(&p, &o, &mut |_, _| {}).unwrap();
    p
}

fn config(ck: &Path) -> serde_json::Value {
    serde_json::from_str(&std::fs::read_to_string(ck.join(CONFIG_FILE)).unwrap()).unwrap()
}

fn refusal(ck: &Path) -> String {
    let e: CheckpointError = Checkpoint::open(ck).unwrap_err();
    e.to_string()
}

#[test]
fn the_engram_demo_checkpoint_has_the_demo_names_and_keys() {
    let tmp = tempfile::tempdir().unwrap();
    let ck = write(tmp.path(), Preset::EngramDemo, 4096);
    let v = config(&ck);
    for key in [
        "engram_vocab_size",
        "max_ngram_size",
        "n_embed_per_ngram",
        "n_head_per_ngram",
        "layer_ids",
        "pad_id",
        "kernel_size",
    ] {
        assert!(v.get(key).is_some(), "config.json lacks {key}: {v}");
    }
    assert_eq!(v["layer_ids"], serde_json::json!([1, 15]));
    assert_eq!(v["ple_table_rows"], serde_json::json!(4096));
    assert!(ck.join(TOKEN_MAP_FILE).exists());
    let c = Checkpoint::open(&ck).unwrap();
    assert_eq!(Layout::of(&c.spec).unwrap().family_id(), "engram-demo");
    assert_eq!(c.sites.len(), 2);
    let (h, hc) = (1024usize, 4usize);
    for s in &c.sites {
        assert_eq!(s.weights.key_proj.len(), hc * h * 1024);
        assert_eq!(s.weights.key_bias.len(), hc * h);
        assert_eq!(s.weights.value_bias.len(), h);
        assert_eq!(s.weights.norm_conv.len(), hc * h);
        assert_eq!(s.weights.conv1d.len(), hc * h * 4);
        assert_eq!(s.table.dtype, RowDType::Bf16);
        assert_eq!(s.table.stored_rows, 4096);
        assert_eq!(s.table.fold_rows, Some(4096));
        assert_eq!(
            s.table.shards[0].weight,
            EngramDemoNames::new(s.layer).table(),
            "site {}",
            s.index
        );
        assert_eq!(
            s.padded_rows,
            s.spec.dims.head_vocab_sizes.iter().sum::<u64>()
        );
    }
    // The token map went into the sites' hash family.
    assert!(c.sites[0].spec.family.token_limit() == Some(129_280));
}

#[test]
fn the_longcat_checkpoint_has_twelve_sub_tables() {
    let tmp = tempfile::tempdir().unwrap();
    let ck = write(tmp.path(), Preset::LongcatFlashLite, 1000);
    let v = config(&ck);
    assert_eq!(v["ngram_vocab_size_ratio"], serde_json::json!(78));
    assert_eq!(v["emb_neighbor_num"], serde_json::json!(4));
    assert_eq!(v["emb_split_num"], serde_json::json!(4));
    // 1000 rows round up to 12 equal sub-tables of 84.
    assert_eq!(v["ple_table_rows"], serde_json::json!(1008));
    let c = Checkpoint::open(&ck).unwrap();
    let s = &c.sites[0];
    assert_eq!(s.table.sub_tables.len(), 12);
    let n = LongCatNames::flash();
    for (i, sub) in s.table.sub_tables.iter().enumerate() {
        assert_eq!(sub.stored_rows, 84);
        assert_eq!(sub.logical_rows, 78 * 131_072 + 2 * i as u64 + 1);
        assert_eq!(s.table.shards[i].weight, n.sub_table(i));
    }
    assert_eq!(s.weights.value_proj.len(), 3072 * 3072);
    assert!(s.weights.key_proj.is_empty() && s.weights.conv1d.is_empty());
    // Row r of the value projection holds sub-table i's projection row r
    // at columns i*256..(i+1)*256.
    let p3 = file_of(&ck, &n.post_proj(3));
    let raw = Header::read(&p3)
        .unwrap()
        .read_tensor(&n.post_proj(3))
        .unwrap();
    let want = u16::from_le_bytes([raw[2 * (5 * 256 + 7)], raw[2 * (5 * 256 + 7) + 1]]);
    assert_eq!(s.weights.value_proj[5 * 3072 + 3 * 256 + 7], want);
}

#[test]
fn longcat_refuses_a_sub_table_of_the_wrong_size() {
    let tmp = tempfile::tempdir().unwrap();
    let ck = write(tmp.path(), Preset::LongcatFlashLite, 1200);
    let n = LongCatNames::flash();
    let f = file_of(&ck, &n.sub_table(7));
    reshape_tensor(&f, &n.sub_table(7), &[99, 256]);
    let e = refusal(&ck);
    assert!(
        e.contains(&n.sub_table(7)) && e.contains("[99, 256]"),
        "{e}"
    );
    let ck = write(&tmp.path().join("b"), Preset::LongcatFlashLite, 1200);
    let f = file_of(&ck, &n.post_proj(0));
    reshape_tensor(&f, &n.post_proj(0), &[256, 3072]);
    let e = refusal(&ck);
    assert!(
        e.contains(&n.post_proj(0)) && e.contains(&f.display().to_string()),
        "{e}"
    );
}

#[test]
fn engram_refusals_name_the_file_and_tensor() {
    let tmp = tempfile::tempdir().unwrap();
    let ck = write(tmp.path(), Preset::EngramDemo, 2048);
    let n = EngramDemoNames::new(15);
    let dense = ck.join(shard_file(1, 3));
    // A non-finite bias.
    let mut bad = vec![0u8; 1024 * 4];
    bad[4 * 17..4 * 18].copy_from_slice(&f32::NAN.to_le_bytes());
    replace_tensor(
        &dense,
        &n.key_bias(2),
        TensorSpec::new(n.key_bias(2), Dtype::F32, &[1024]),
        bad,
    );
    let e = refusal(&ck);
    assert!(
        e.contains(&n.key_bias(2)) && e.contains("element 17") && e.contains("model-00001"),
        "{e}"
    );
    // Offsets that are not the running sums of the head sizes.
    let ck = write(&tmp.path().join("b"), Preset::EngramDemo, 2048);
    let dense = ck.join(shard_file(1, 3));
    replace_tensor(
        &dense,
        &n.offsets(),
        TensorSpec::new(n.offsets(), Dtype::I64, &[16]),
        vec![0u8; 16 * 8],
    );
    let e = refusal(&ck);
    assert!(e.contains(&n.offsets()) && e.contains("entry 1"), "{e}");
    // A token map of the wrong size, and one onto too few ids.
    let ck = write(&tmp.path().join("c"), Preset::EngramDemo, 2048);
    std::fs::write(ck.join(TOKEN_MAP_FILE), "[0, 1, 2]").unwrap();
    let e = refusal(&ck);
    assert!(
        e.contains(TOKEN_MAP_FILE) && e.contains("vocab_size"),
        "{e}"
    );
    let map: Vec<u32> = (0..129_280u32).map(|t| t % 1000).collect();
    std::fs::write(
        ck.join(TOKEN_MAP_FILE),
        serde_json::to_string(&map).unwrap(),
    )
    .unwrap();
    let e = refusal(&ck);
    assert!(e.contains("engram_compressed_vocab_size"), "{e}");
}

#[test]
fn a_stated_table_size_that_the_config_does_not_rebuild_is_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let ck = tmp.path();
    let mut v: serde_json::Value =
        serde_json::from_str(&Preset::DeepseekV41.spec().to_config_json()).unwrap();
    v["engram_num_embeddings"] = serde_json::json!([384_006_168u64, 5]);
    std::fs::write(ck.join(CONFIG_FILE), v.to_string()).unwrap();
    let e = refusal(ck);
    assert!(
        e.contains("engram_num_embeddings[1]") && e.contains(CONFIG_FILE),
        "{e}"
    );
}

#[test]
fn deepseek_v41_has_its_fused_fp8_projection_and_block_rows() {
    let tmp = tempfile::tempdir().unwrap();
    let ck = write(tmp.path(), Preset::DeepseekV41, 512);
    let v = config(&ck);
    assert_eq!(
        v["engram_num_embeddings"],
        serde_json::json!([384_006_168u64, 384_016_682u64])
    );
    assert_eq!(v["engram_layer_ids"], serde_json::json!([1, 14]));
    let n = V41Names::new(14);
    let dense = ck.join(shard_file(1, 3));
    let h = Header::read(&dense).unwrap();
    let wkv = h.get(&n.wkv()).unwrap();
    assert_eq!(wkv.dtype, Dtype::F8E4M3);
    assert_eq!(wkv.shape, [5 * 5120, 24 * 256]);
    assert_eq!(h.get(&n.wkv_scale()).unwrap().shape, [5 * 160, 24 * 8]);
    assert_eq!(h.get(&n.q_weight()).unwrap().shape, [4, 5120]);
    let c = Checkpoint::open(&ck).unwrap();
    let s = &c.sites[1];
    assert_eq!(s.table.dtype, RowDType::Fp8E4M3Block32);
    assert_eq!(s.table.bytes, 512 * 264);
    assert_eq!(s.padded_rows, 384_016_682);
    assert_eq!(s.weights.key_proj.len(), 4 * 5120 * 6144);
    assert_eq!(s.weights.value_proj.len(), 5120 * 6144);
    // A NaN block scale is refused by name.
    let mut sc = h.read_tensor(&n.wkv_scale()).unwrap();
    sc[3] = 255;
    replace_tensor(
        &dense,
        &n.wkv_scale(),
        TensorSpec::new(n.wkv_scale(), Dtype::U8, &[800, 192]),
        sc,
    );
    let e = refusal(&ck);
    assert!(
        e.contains(&n.wkv_scale()) && e.contains("block scale 3"),
        "{e}"
    );
}

/// Run `tokens` through every site of `ck` with the table in `mode` (a
/// small cache for [`TableMode::Cached`]), in `chunks`; the final highway.
fn forward_all(ck: &Checkpoint, mode: TableMode, tokens: &[u32], chunks: &[usize]) -> Vec<f32> {
    forward_cached(ck, mode, tokens, chunks, 768)
}

/// [`forward_all`] with a row cache of `slots` slots.
fn forward_cached(
    ck: &Checkpoint,
    mode: TableMode,
    tokens: &[u32],
    chunks: &[usize],
    slots: usize,
) -> Vec<f32> {
    let gpu: Arc<dyn GpuBackend> = Arc::new(CpuBackend::new());
    let start = gpu.live_alloc_count();
    let width = ck.sites[0].spec.channels();
    let mut host: Vec<f32> = (0..tokens.len() * width)
        .map(|i| ((i % 89) as f32 - 44.0) / 50.0)
        .collect();
    {
        let mut layers = Vec::new();
        for s in 0..ck.sites.len() {
            let table = match mode {
                TableMode::Cached => ck.open_cached_table(s, CacheConfig::new(slots), gpu.clone()),
                m => ck.open_table(s, m, gpu.clone()),
            }
            .unwrap();
            layers.push(ck.build_layer(s, table, 16, gpu.as_ref()).unwrap());
        }
        let hw = gpu.alloc(host.len() * 4, "highway").unwrap();
        let bytes: Vec<u8> = host.iter().flat_map(|v| v.to_le_bytes()).collect();
        gpu.copy_h2d(&bytes, hw).unwrap();
        let mut states: Vec<_> = layers
            .iter()
            .map(|l| l.new_seq_state(gpu.as_ref()).unwrap())
            .collect();
        let mut at = 0;
        for &n in chunks {
            let toks = &tokens[at..at + n];
            let rows = hw.offset(at * width * 4);
            for (l, st) in layers.iter().zip(states.iter_mut()) {
                let ctx = ForwardContext::new(gpu.as_ref()).with_host_ids(toks);
                l.forward(st, rows, n, at == 0, &ctx, 0).unwrap();
            }
            at += n;
        }
        gpu.synchronize(0).unwrap();
        let mut out = vec![0u8; host.len() * 4];
        gpu.copy_d2h(hw, &mut out).unwrap();
        for (v, c) in host.iter_mut().zip(out.chunks_exact(4)) {
            *v = f32::from_le_bytes(c.try_into().unwrap());
        }
        for (l, st) in layers.iter().zip(states.iter_mut()) {
            l.release_seq_state(st, gpu.as_ref()).unwrap();
        }
        for l in layers.iter_mut() {
            l.free(gpu.as_ref()).unwrap();
        }
        gpu.free(hw).unwrap();
    }
    assert_eq!(
        gpu.live_alloc_count(),
        start,
        "leaked:\n{}",
        gpu.live_report()
    );
    host
}

fn check_modes(preset: Preset, rows: u64) {
    let tmp = tempfile::tempdir().unwrap();
    let ck = Checkpoint::open(&write(tmp.path(), preset, rows)).unwrap();
    // Tokens across the raw vocabulary, with EOS (2) in the middle.
    let tokens: Vec<u32> = (0..20u32)
        .map(|i| {
            if i == 9 {
                2
            } else {
                (i * 48_271 + 11) % 129_280
            }
        })
        .collect();
    let resident = forward_all(&ck, TableMode::Resident, &tokens, &[20]);
    assert!(resident.iter().all(|v| v.is_finite()));
    for (mode, chunks) in [
        (TableMode::Resident, &[7usize, 13][..]),
        (TableMode::Mapped, &[20][..]),
        (TableMode::Cached, &[3, 16, 1][..]),
    ] {
        let h = forward_all(&ck, mode, &tokens, chunks);
        assert!(
            metrale_testkit::same_bits(&h, &resident),
            "{}: {mode:?} with chunks {chunks:?} differs from resident",
            preset.name()
        );
    }
}

#[test]
fn every_table_mode_gives_the_same_highway_for_the_engram_demo() {
    check_modes(Preset::EngramDemo, 3000);
}

#[test]
fn every_table_mode_gives_the_same_highway_for_longcat() {
    check_modes(Preset::LongcatFlashLite, 1200);
}

/// LongCat-2.0 spells the config keys `oe_*` and the tensors
/// `model.oe_embed_tokens{i}` / `model.oe_embed_proj{i}`: the same model
/// under those names loads to the same weights and table.
#[test]
fn longcat_2_0_names_load_as_the_same_model() {
    let tmp = tempfile::tempdir().unwrap();
    let ck = write(tmp.path(), Preset::LongcatFlashLite, 1200);
    let flash = Checkpoint::open(&ck).unwrap();
    let mut v = config(&ck);
    for (old, new) in [
        ("ngram_vocab_size_ratio", "oe_vocab_size_ratio"),
        ("emb_neighbor_num", "oe_neighbor_num"),
        ("emb_split_num", "oe_split_num"),
    ] {
        let x = v.as_object_mut().unwrap().remove(old).unwrap();
        v[new] = x;
    }
    std::fs::write(ck.join(CONFIG_FILE), v.to_string()).unwrap();
    let index_path = ck.join(metrale_checkpoint::names::INDEX_FILE);
    let mut index: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&index_path).unwrap()).unwrap();
    let (f, o) = (LongCatNames::flash(), LongCatNames::oe());
    for i in 0..12 {
        for (old, new) in [
            (f.sub_table(i), o.sub_table(i)),
            (f.post_proj(i), o.post_proj(i)),
        ] {
            let map = index["weight_map"].as_object_mut().unwrap();
            let file = map.remove(&old).unwrap();
            let path = ck.join(file.as_str().unwrap());
            let h = Header::read(&path).unwrap();
            let t = h.get(&old).unwrap();
            let spec = TensorSpec::new(new.clone(), t.dtype, &t.shape);
            replace_tensor(&path, &old, spec, h.read_tensor(&old).unwrap());
            map.insert(new, file);
        }
    }
    std::fs::write(&index_path, index.to_string()).unwrap();
    let oe = Checkpoint::open(&ck).unwrap();
    assert_eq!(
        Layout::of(&oe.spec).unwrap().name(),
        "LongCat n-gram embedding (oe_* names)"
    );
    let (a, b) = (&flash.sites[0], &oe.sites[0]);
    assert_eq!(a.weights.value_proj, b.weights.value_proj);
    assert_eq!(a.table.sub_tables, b.table.sub_tables);
    assert_eq!(b.table.shards[4].weight, "model.oe_embed_tokens4.weight");
    assert_eq!(a.spec.dims, b.spec.dims);
}

/// Small checkpoints of every family (the tiny configs of
/// `testkit::families`, tables cut so ids fold): the highway is the same
/// from every table mode and chunking, for BF16 rows, FP8 block rows and
/// LongCat's folded sub-tables behind small per-sub-table caches.
#[test]
fn tiny_family_checkpoints_agree_across_table_modes() {
    for (family, cut) in [
        (TinyFamily::EngramConv, 100),
        (TinyFamily::EngramV41, 120),
        (TinyFamily::LongCat, 80),
    ] {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join("ck");
        let dtype = match family.row_dtype() {
            RowDType::Fp8E4M3Block32 => TableDType::Fp8Block,
            _ => TableDType::Bf16,
        };
        write_spec_synthetic(&dir, &family.spec(), Some(cut), dtype, 4).unwrap();
        let ck = Checkpoint::open(&dir).unwrap();
        assert!(ck.sites.iter().all(|s| s.table.fold_rows.is_some()));
        assert_eq!(ck.sites[0].table.dtype, family.row_dtype());
        let tokens: Vec<u32> = (0..24u32)
            .map(|i| if i == 9 { 0 } else { (i * 37 + 5) % 1000 })
            .collect();
        let resident = forward_cached(&ck, TableMode::Resident, &tokens, &[24], 64);
        let width = ck.sites[0].spec.channels();
        let input: Vec<f32> = (0..tokens.len() * width)
            .map(|i| ((i % 89) as f32 - 44.0) / 50.0)
            .collect();
        assert!(resident.iter().all(|v| v.is_finite()), "{family:?}");
        assert_ne!(resident, input, "{family:?}: the layers changed nothing");
        for (mode, chunks) in [
            (TableMode::Resident, &[1usize, 9, 14][..]),
            (TableMode::Mapped, &[16, 8][..]),
            (TableMode::Cached, &[5, 16, 3][..]),
        ] {
            let h = forward_cached(&ck, mode, &tokens, chunks, 64);
            assert!(
                metrale_testkit::same_bits(&h, &resident),
                "{family:?}: {mode:?} with chunks {chunks:?} differs from resident"
            );
        }
    }
}

/// Random damage to any file of a small checkpoint of each family is
/// refused with an error or leaves a checkpoint with finite weights: the
/// loader never panics (what the `family_checkpoint` fuzz target checks
/// at length).
#[test]
fn random_damage_never_panics_the_loader() {
    let mut rng = metrale_testkit::Rng(0xDA3A6E);
    for family in TinyFamily::ALL {
        let tmp = tempfile::tempdir().unwrap();
        let seed = tmp.path().join("seed");
        let dtype = match family.row_dtype() {
            RowDType::Fp8E4M3Block32 => TableDType::Fp8Block,
            _ => TableDType::Bf16,
        };
        write_spec_synthetic(&seed, &family.spec(), Some(48), dtype, 1).unwrap();
        let mut files: Vec<(String, Vec<u8>)> = std::fs::read_dir(&seed)
            .unwrap()
            .map(|e| {
                let p = e.unwrap().path();
                let name = p.file_name().unwrap().to_string_lossy().into_owned();
                (name, std::fs::read(&p).unwrap())
            })
            .collect();
        files.sort();
        let mut refused = 0;
        for round in 0..60 {
            let dir = tmp.path().join(format!("r{round}"));
            std::fs::create_dir(&dir).unwrap();
            let target = rng.below(files.len());
            for (i, (name, bytes)) in files.iter().enumerate() {
                let mut b = bytes.clone();
                if i == target {
                    let at = rng.below(b.len());
                    for x in b.iter_mut().skip(at).take(1 + rng.below(8)) {
                        *x = rng.below(256) as u8;
                    }
                }
                std::fs::write(dir.join(name), b).unwrap();
            }
            match Checkpoint::open(&dir) {
                Err(_) => refused += 1,
                Ok(ck) => {
                    for s in &ck.sites {
                        let w = &s.weights;
                        for v in [&w.norm_key, &w.norm_query, &w.key_bias, &w.value_bias] {
                            assert!(v.iter().all(|x| x.is_finite()), "{family:?} round {round}");
                        }
                    }
                }
            }
        }
        assert!(refused > 0, "{family:?}: no damage was refused");
    }
}

#[test]
fn init_refuses_block_rows_that_do_not_split_into_blocks_and_keeps_sub_tables_whole() {
    let tmp = tempfile::tempdir().unwrap();
    let o = InitOptions {
        preset: Preset::Tiny,
        table_rows: None,
        dtype: TableDType::Fp8Block,
        seed: 0,
    };
    let e = write_synthetic(&tmp.path().join("t"), &o, &mut |_, _| {}).unwrap_err();
    assert!(e.to_string().contains("multiple of 32"), "{e}");
    assert!(!tmp.path().join("t").exists());
    // A LongCat cut that would give a sub-table more rows than it has
    // stores the sub-tables whole.
    let g = TinyFamily::LongCat.spec();
    let padded = g.derive(0).unwrap().padded_rows;
    let dir = tmp.path().join("l");
    let w = write_spec_synthetic(&dir, &g, Some(padded - 8), TableDType::Bf16, 0).unwrap();
    assert_eq!(w.table_rows, None);
    let c = Checkpoint::open(&dir).unwrap();
    assert!(
        c.sites[0]
            .table
            .sub_tables
            .iter()
            .all(|s| s.stored_rows == s.logical_rows)
    );
}
