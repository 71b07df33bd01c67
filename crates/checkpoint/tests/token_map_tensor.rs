//! Engram's token map stored as the tensor `engram.token_map` instead of
//! the JSON file: the loader takes it (I64, I32 or U32), hashes through it
//! as through the file, refuses a file and a tensor that disagree, and
//! names the tensor and entry of a value that is not an id.

use std::path::{Path, PathBuf};

use metrale_checkpoint::names::{INDEX_FILE, TOKEN_MAP_FILE, TOKEN_MAP_TENSOR};
use metrale_checkpoint::synth::write_synthetic;
use metrale_checkpoint::{Checkpoint, CheckpointError, InitOptions, Preset};
use metrale_model_layers::layers::ple::ids::PleIdHasher;
use metrale_storage::safetensors::{Dtype, TensorSpec, write_file};

const TM_FILE: &str = "token-map.safetensors";

fn engram_demo(dir: &Path) -> PathBuf {
    let p = dir.join("engram");
    let o = InitOptions {
        preset: Preset::EngramDemo,
        table_rows: Some(4096),
        dtype: Preset::EngramDemo.default_dtype(),
        seed: 4,
    };
    write_synthetic(&p, &o, &mut |_, _| {}).unwrap();
    p
}

fn json_map(ck: &Path) -> Vec<u32> {
    serde_json::from_str(&std::fs::read_to_string(ck.join(TOKEN_MAP_FILE)).unwrap()).unwrap()
}

/// Store `bytes` as the map tensor of `dtype` and `shape`, listed in the
/// index.
fn put_tensor(ck: &Path, dtype: Dtype, shape: &[u64], bytes: &[u8]) {
    let spec = TensorSpec::new(TOKEN_MAP_TENSOR, dtype, shape);
    write_file(ck.join(TM_FILE), &[(spec, bytes)], 8).unwrap();
    let index = ck.join(INDEX_FILE);
    let mut v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&index).unwrap()).unwrap();
    v["weight_map"][TOKEN_MAP_TENSOR] = TM_FILE.into();
    std::fs::write(&index, serde_json::to_string(&v).unwrap()).unwrap();
}

fn i64_bytes(map: &[i64]) -> Vec<u8> {
    map.iter().flat_map(|v| v.to_le_bytes()).collect()
}

/// Site 0's ids of `tokens` from a fresh sequence.
fn ids(ck: &Checkpoint, tokens: &[u32]) -> Vec<u64> {
    let spec = &ck.sites[0].spec;
    let h = PleIdHasher::with_family(&spec.family, &spec.dims).unwrap();
    let history = vec![spec.dims.eos_token_id; spec.dims.context_len()];
    let mut out = vec![0; tokens.len() * spec.dims.ngram_heads()];
    h.ids_with_history_into(&history, tokens, &mut out).unwrap();
    out
}

fn loaded_map(ck: &Checkpoint) -> Vec<u32> {
    match ck.spec.family.family().token_map() {
        Some(m) => m.to_vec(),
        None => panic!("no token map: {:?}", ck.spec.family),
    }
}

#[test]
fn the_tensor_serves_as_the_file_does() {
    let tmp = tempfile::tempdir().unwrap();
    let ck = engram_demo(tmp.path());
    let map = json_map(&ck);
    let with_file = Checkpoint::open(&ck).unwrap();
    let tokens = [5u32, 77, 129_279, 2, 9];
    let ids_file = ids(&with_file, &tokens);

    for dtype in [Dtype::I64, Dtype::I32, Dtype::U32] {
        let bytes: Vec<u8> = match dtype {
            Dtype::I64 => map
                .iter()
                .flat_map(|&v| i64::from(v).to_le_bytes())
                .collect(),
            _ => map.iter().flat_map(|&v| v.to_le_bytes()).collect(),
        };
        put_tensor(&ck, dtype, &[map.len() as u64], &bytes);
        // Both, agreeing: accepted.
        Checkpoint::open(&ck).unwrap();
        // The tensor alone.
        let saved = std::fs::read(ck.join(TOKEN_MAP_FILE)).unwrap();
        std::fs::remove_file(ck.join(TOKEN_MAP_FILE)).unwrap();
        let c = Checkpoint::open(&ck).unwrap();
        assert_eq!(loaded_map(&c), map, "{dtype:?}");
        assert_eq!(ids(&c, &tokens), ids_file, "{dtype:?}");
        std::fs::write(ck.join(TOKEN_MAP_FILE), saved).unwrap();
    }
}

#[test]
fn disagreeing_and_malformed_maps_are_refused_by_name() {
    let tmp = tempfile::tempdir().unwrap();
    let ck = engram_demo(tmp.path());
    let map: Vec<i64> = json_map(&ck).into_iter().map(i64::from).collect();
    let refusal = |ck: &Path| -> String {
        let e: CheckpointError = Checkpoint::open(ck).unwrap_err();
        e.to_string()
    };

    let mut other = map.clone();
    other[300] = (other[300] + 1) % 1000;
    put_tensor(&ck, Dtype::I64, &[map.len() as u64], &i64_bytes(&other));
    let msg = refusal(&ck);
    assert!(msg.contains("disagree at entry 300"), "{msg}");

    std::fs::remove_file(ck.join(TOKEN_MAP_FILE)).unwrap();
    let mut neg = map.clone();
    neg[17] = -1;
    put_tensor(&ck, Dtype::I64, &[map.len() as u64], &i64_bytes(&neg));
    let msg = refusal(&ck);
    assert!(
        msg.contains(TOKEN_MAP_TENSOR) && msg.contains("entry 17 is -1"),
        "{msg}"
    );

    put_tensor(&ck, Dtype::I64, &[10], &i64_bytes(&map[..10]));
    let msg = refusal(&ck);
    assert!(
        msg.contains("10 entries") && msg.contains("vocab_size is 129280"),
        "{msg}"
    );

    put_tensor(&ck, Dtype::F32, &[2], &[0; 8]);
    let msg = refusal(&ck);
    assert!(msg.contains("dtype F32 is not I64, I32 or U32"), "{msg}");
}
