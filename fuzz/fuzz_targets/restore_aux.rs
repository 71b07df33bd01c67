//! Fuzz `PleLayer::restore_aux` with arbitrary blobs on the CPU backend.
//!
//! A blob is accepted exactly when its size is `4 + 4 * hist_len +
//! conv_state_bytes`; an accepted blob snapshots back byte for byte; a
//! refused one leaves the carry exactly as it was. Whatever was restored,
//! the next forward must succeed (a history of the wrong length resets the
//! carry) and leave a history of `context_len` tokens.
#![no_main]

use std::sync::{Arc, Mutex, OnceLock};

use libfuzzer_sys::fuzz_target;
use metrale_gpu_runtime::cpu::CpuBackend;
use metrale_gpu_runtime::gpu::{DevicePtr, GpuBackend};
use metrale_model_layers::layers::ple::ids::PleIdDims;
use metrale_model_layers::layers::ple::carry_blob;
use metrale_model_layers::layers::ple::{ForwardContext, PleLayer, PleSeqState, PleWeights, SiteSpec};
use metrale_storage::resident::ResidentTable;

const HEAD_DIM: usize = 4;
/// Rows of the table: the sum of the two head sizes below.
const ROWS: usize = 18;

struct World {
    gpu: Arc<dyn GpuBackend>,
    layer: PleLayer,
    st: PleSeqState,
    highway: DevicePtr,
}

fn bf16(i: usize) -> u16 {
    // Small values of both signs, deterministic.
    let x = ((i * 37 % 17) as f32 - 8.0) / 64.0;
    (x.to_bits() >> 16) as u16
}

fn world() -> &'static Mutex<World> {
    static W: OnceLock<Mutex<World>> = OnceLock::new();
    W.get_or_init(|| {
        let gpu: Arc<dyn GpuBackend> = Arc::new(CpuBackend::new());
        let (hidden, hc, k) = (8usize, 2usize, 4usize);
        let c = hidden * hc;
        let e = 2 * HEAD_DIM;
        let dims = PleIdDims {
            ngram_size: 3,
            heads_per_ngram: 1,
            multipliers: vec![1, 3, 5],
            head_vocab_sizes: vec![7, 11],
            head_offsets: vec![0, 7],
            eos_token_id: 0,
            family: Default::default(),
        };
        let rows: Vec<u16> = (0..ROWS * HEAD_DIM).map(bf16).collect();
        let table =
            Arc::new(ResidentTable::from_bf16(gpu.clone(), &rows, HEAD_DIM).expect("fuzz table"));
        let w = PleWeights {
            key_proj: (0..c * e).map(bf16).collect(),
            value_proj: (0..hidden * e).map(|i| bf16(i + 5)).collect(),
            norm_key: vec![0.0; c],
            norm_query: vec![0.0; c],
            norm_conv: vec![0.0; c],
            conv1d: (0..c * k).map(|i| (i % 5) as f32 / 8.0).collect(),
            key_bias: Vec::new(),
            value_bias: Vec::new(),
        };
        let spec = SiteSpec::new(dims, HEAD_DIM, hidden, hc, k, 3);
        let layer = PleLayer::new(&spec, w, table, 4, gpu.as_ref())
            .expect("fuzz layer");
        let st = layer.new_seq_state(gpu.as_ref()).unwrap();
        let highway = gpu.alloc(c * 4, "fuzz.highway").unwrap();
        Mutex::new(World { gpu, layer, st, highway })
    })
}

fuzz_target!(|data: &[u8]| {
    let mut w = world().lock().unwrap();
    let World { gpu, layer, st, highway } = &mut *w;
    let gpu = gpu.as_ref();
    let conv = layer.conv_state_bytes();
    let Some((&mode, rest)) = data.split_first() else { return };
    // Mode 0: the raw bytes. Otherwise a well-formed blob (history of
    // `mode % 8` tokens) filled from the input, so the accepting path and
    // odd history lengths get exercised too.
    let blob: Vec<u8> = if mode == 0 {
        rest.to_vec()
    } else {
        let n = (mode % 8) as usize;
        let mut b = (n as u32).to_le_bytes().to_vec();
        b.extend(rest.iter().cycle().take(4 * n + conv));
        if rest.is_empty() {
            b.resize(4 + 4 * n + conv, 0);
        }
        b
    };
    let before = layer.snapshot_aux(st, gpu, 0).expect("snapshot");
    let want_ok = blob.len() >= 4 && {
        let n = u32::from_le_bytes(blob[..4].try_into().unwrap()) as usize;
        blob.len() == 4 + 4 * n + conv
    };
    let r = layer.restore_aux(st, &blob, gpu, 0);
    assert_eq!(r.is_ok(), want_ok, "restore_aux of {} bytes: {r:?}", blob.len());
    // The codec accepts a subset: exactly `context_len` history tokens.
    if let Ok(view) = carry_blob::decode(&blob, layer.spec()) {
        assert!(want_ok, "the codec accepted a blob restore_aux refuses");
        assert_eq!(carry_blob::encode(&view.history_tokens(), view.conv), blob);
    } else if want_ok {
        let n = carry_blob::declared_history_len(&blob).unwrap();
        assert_ne!(n, layer.dims().context_len(), "the codec refused a well-formed blob");
    }
    let after = layer.snapshot_aux(st, gpu, 0).expect("snapshot after restore");
    if want_ok {
        assert_eq!(after, blob, "an accepted blob must snapshot back unchanged");
    } else {
        assert_eq!(after, before, "a refused blob must leave the carry as it was");
    }
    assert!(!st.is_prestaged(), "restore must clear the prestage");
    let tok = [rest.first().copied().unwrap_or(1) as u32 % 5];
    let ctx = ForwardContext::new(gpu).with_host_ids(&tok);
    layer.forward(st, *highway, 1, false, &ctx, 0).expect("forward after restore");
    gpu.synchronize(0).expect("sync");
    assert_eq!(st.history().len(), layer.dims().context_len());
});
