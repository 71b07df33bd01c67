//! Tensor-parallel shards of a site (docs/SPEC.md §5, "Tensor-parallel
//! shards"): for every family and R in {2, 4}, R in-process ranks, each an
//! engine over sites holding its column slice of every table and weight
//! and completing its projections through an in-process all-reduce,
//! reproduce the unsharded engine's outputs to FP32 accuracy through
//! chunked prefill, batched decode and a snapshot and restore, agreeing
//! with each other bit for bit; each rank's share of a checkpoint, as
//! `table shard` writes it, opens and its row cache reads 1/R of the
//! unsharded table's bytes; splits that do not divide are refused by
//! name.

use std::path::Path;
use std::sync::Arc;

use metrale_checkpoint::synth::write_spec_synthetic;
use metrale_checkpoint::tensor_parallel::{RankCheckpoint, open_group, write_rank};
use metrale_checkpoint::{Checkpoint, Preset, TableDType};
use metrale_engine::ple_site::PleSite;
use metrale_engine::{Engine, EngineConfig, SeqId};
use metrale_gpu_runtime::cpu::CpuBackend;
use metrale_gpu_runtime::gpu::GpuBackend;
use metrale_model_layers::layers::ple::family::qwen4_exp::Qwen4Exp;
use metrale_model_layers::layers::ple::spec::ModelSpec;
use metrale_model_layers::layers::ple::{
    ForwardContext, InProcessGroup, LayerError, PleLayer, Reduce, Shard, ShardError, TensorParallel,
};
use metrale_storage::TableMode;
use metrale_storage::cached::CacheConfig;
use metrale_testkit::families::{TinyFamily, family_site_of};
use metrale_testkit::rows::rows_for;
use metrale_testkit::tensor_parallel::{engine_of, shard_of, tiny_site_shard};
use metrale_testkit::tiny::{TinySpec, tiny_site, tiny_weights};

const SEED: u64 = 11;
const MAX_TOKENS: usize = 8;

/// The models under test: Qwen4-Exp (the tiny model) or a family's.
#[derive(Clone, Copy, Debug)]
enum Model {
    Qwen,
    Family(TinyFamily),
}

impl Model {
    const ALL: [Model; 4] = [
        Model::Qwen,
        Model::Family(TinyFamily::EngramConv),
        Model::Family(TinyFamily::EngramV41),
        Model::Family(TinyFamily::LongCat),
    ];

    /// The family's tiny spec; DeepSeek-V4.1's rows widened to 128 values
    /// so that a quarter of a row is a whole 32-value scale block.
    fn spec(self) -> Option<ModelSpec> {
        match self {
            Model::Qwen => None,
            Model::Family(f @ TinyFamily::EngramV41) => Some(ModelSpec {
                head_dim: 128,
                ..f.spec()
            }),
            Model::Family(f) => Some(f.spec()),
        }
    }

    fn tiny() -> TinySpec {
        TinySpec {
            max_tokens: MAX_TOKENS,
            ..TinySpec::default()
        }
    }

    /// The model's engine on `gpu`, unsharded or opened for `shard`.
    fn engine(self, gpu: &Arc<dyn GpuBackend>, shard: Option<Shard>) -> Engine<PleSite> {
        let cfg = EngineConfig {
            prefill_chunk: 5,
            ..Default::default()
        };
        match self {
            Model::Qwen => engine_of(gpu, 2, cfg, |i| match &shard {
                Some(s) => tiny_site_shard(gpu, &Self::tiny(), i, SEED, s.clone()),
                None => tiny_site(gpu, &Self::tiny(), i, SEED),
            }),
            Model::Family(f) => {
                let g = self.spec().expect("a family");
                engine_of(gpu, g.sites(), cfg, |i| {
                    family_site_of(gpu, &g, f, i, SEED, MAX_TOKENS, shard.clone())
                })
            }
        }
        .unwrap_or_else(|e| panic!("{self:?} engine ({shard:?}): {e:#}"))
    }
}

/// Tokens below 40 are in every family's vocabulary.
fn tokens(n: usize, salt: u32) -> Vec<u32> {
    (0..n as u32)
        .map(|i| (i * 7 + salt * 13 + 1) % 40)
        .collect()
}

/// Chunked prefill of two sequences, batched decode, a snapshot, release
/// and restore of one, and more batched decode: every output row, in
/// order.
fn script(e: &mut Engine<PleSite>) -> Vec<f32> {
    script_with_inputs(e).1
}

/// [`script`]'s input rows and output rows.
fn script_with_inputs(e: &mut Engine<PleSite>) -> (Vec<f32>, Vec<f32>) {
    let w = e.width();
    let mut inputs = Vec::new();
    let mut out = Vec::new();
    let mut seqs = Vec::new();
    for (salt, len) in [(1, 13), (2, 7)] {
        let prompt = tokens(len, salt);
        let id = e.add_sequence(&prompt).unwrap().id;
        let mut hw = rows_for(&prompt, 0, len, w);
        inputs.extend_from_slice(&hw);
        e.prefill(id, &prompt, &mut hw).unwrap();
        out.extend_from_slice(&hw);
        seqs.push((id, prompt));
    }
    let mut decode = |e: &mut Engine<PleSite>, seqs: &mut Vec<(SeqId, Vec<u32>)>, steps: usize| {
        for step in 0..steps {
            let mut batch = Vec::new();
            let mut hw = Vec::new();
            for (k, (id, toks)) in seqs.iter_mut().enumerate() {
                let t = ((step * 5 + k * 11 + toks.len()) % 40) as u32;
                toks.push(t);
                hw.extend(rows_for(toks, toks.len() - 1, toks.len(), w));
                batch.push((*id, t));
            }
            inputs.extend_from_slice(&hw);
            e.decode(&batch, &mut hw).unwrap();
            out.extend_from_slice(&hw);
        }
    };
    decode(e, &mut seqs, 5);
    let (id, toks) = seqs[0].clone();
    let snap = e.snapshot(id).unwrap();
    e.release(id).unwrap();
    let restored = e.add_from_snapshot(&snap, &toks).unwrap();
    seqs[0].0 = restored;
    decode(e, &mut seqs, 4);
    for (id, _) in seqs {
        e.release(id).unwrap();
    }
    (inputs, out)
}

/// The outputs of `ranks` in-process ranks of `model`, one thread and one
/// backend a rank.
fn ranks_run(model: Model, ranks: usize) -> Vec<Vec<f32>> {
    let group = InProcessGroup::ranks(ranks);
    std::thread::scope(|s| {
        let handles: Vec<_> = (0..ranks)
            .map(|r| {
                let shard = shard_of(&group, r);
                s.spawn(move || {
                    let gpu: Arc<dyn GpuBackend> = Arc::new(CpuBackend::new());
                    let mut e = model.engine(&gpu, Some(shard));
                    let out = script(&mut e);
                    e.close().unwrap();
                    assert_eq!(gpu.live_alloc_count(), 0, "{model:?} rank {r} leaks");
                    out
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

/// The largest difference between `got` and `want`, relative to the
/// largest magnitude of `want`.
fn max_rel_diff(got: &[f32], want: &[f32]) -> f32 {
    assert_eq!(got.len(), want.len());
    let scale = want.iter().fold(1.0f32, |m, v| m.max(v.abs()));
    got.iter()
        .zip(want)
        .map(|(a, b)| (a - b).abs() / scale)
        .fold(0.0, f32::max)
}

#[test]
fn tensor_parallel_ranks_reproduce_the_unsharded_site_for_every_family() {
    for model in Model::ALL {
        let gpu: Arc<dyn GpuBackend> = Arc::new(CpuBackend::new());
        let mut e = model.engine(&gpu, None);
        let (inputs, want) = script_with_inputs(&mut e);
        e.close().unwrap();
        // The sites change every row well beyond the tolerance below, so
        // matching within it means the ranks computed the sites' updates.
        let moved = max_rel_diff(&want, &inputs);
        assert!(
            moved > 1e-2,
            "{model:?}: the sites moved the rows by {moved:e}"
        );
        for ranks in [2, 4] {
            let outs = ranks_run(model, ranks);
            for (r, got) in outs.iter().enumerate() {
                assert!(
                    metrale_testkit::same_bits(got, &outs[0]),
                    "{model:?}: rank {r} of {ranks} differs from rank 0"
                );
            }
            let d = max_rel_diff(&outs[0], &want);
            assert!(
                d <= 2e-6,
                "{model:?} over {ranks} ranks: largest difference {d:e} of the output scale"
            );
            eprintln!("{model:?} over {ranks} ranks: largest difference {d:e}");
        }
    }
}

/// An engine over every site of the checkpoint `ck`, its tables served in
/// `mode` (with `cache` when cached); as a rank of `rank`'s share,
/// reducing through the given collective, when given.
fn checkpoint_engine(
    ck: &Checkpoint,
    gpu: &Arc<dyn GpuBackend>,
    mode: TableMode,
    cache: &CacheConfig,
    rank: Option<(&RankCheckpoint, Arc<dyn Reduce>)>,
) -> Engine<PleSite> {
    let cfg = EngineConfig {
        prefill_chunk: 5,
        ..Default::default()
    };
    engine_of(gpu, ck.sites.len(), cfg, |i| {
        let table = ck.serve_table(i, mode, cache.clone(), gpu.clone())?;
        let layer = match &rank {
            Some((rc, reduce)) => {
                rc.build_layer(i, table, MAX_TOKENS, gpu.as_ref(), reduce.clone())?
            }
            None => ck.build_layer(i, table, MAX_TOKENS, gpu.as_ref())?,
        };
        Ok(PleSite::new(layer))
    })
    .unwrap()
}

/// Write the `ranks` shares of the checkpoint `src` under `root` with the
/// production writer, run [`script`] over every rank (one thread and
/// backend each, an in-process all-reduce) and return each rank's outputs
/// and table bytes read.
fn shares_run(
    src: &Path,
    root: &Path,
    ranks: usize,
    mode: TableMode,
    cache: &CacheConfig,
) -> Vec<(Vec<f32>, u64)> {
    let dirs: Vec<_> = (0..ranks)
        .map(|r| {
            let out = root.join(format!("rank-{r}-of-{ranks}"));
            let tp = TensorParallel::new(r, ranks).unwrap();
            write_rank(src, tp, &out, &mut |_, _| {}).unwrap();
            out
        })
        .collect();
    let group = open_group(&dirs).unwrap();
    let reduces = InProcessGroup::ranks(ranks);
    std::thread::scope(|s| {
        let hs: Vec<_> = group
            .iter()
            .zip(&reduces)
            .map(|(rc, reduce)| {
                s.spawn(move || {
                    let gpu: Arc<dyn GpuBackend> = Arc::new(CpuBackend::new());
                    let mut e =
                        checkpoint_engine(&rc.ck, &gpu, mode, cache, Some((rc, reduce.clone())));
                    let out = script(&mut e);
                    let read = e.table_stats().bytes_read;
                    e.close().unwrap();
                    assert_eq!(gpu.live_alloc_count(), 0);
                    (out, read)
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

#[test]
fn tensor_parallel_shares_written_by_the_writer_reproduce_every_family() {
    let root = tempfile::tempdir().unwrap();
    let cache = CacheConfig {
        slots: 1024,
        direct: false,
        ..CacheConfig::default()
    };
    let cases = [
        ("qwen", Preset::Tiny.spec(), TableDType::Bf16),
        ("qwen-fp8", Preset::Tiny.spec(), TableDType::Fp8),
        (
            "engram-conv",
            TinyFamily::EngramConv.spec(),
            TableDType::Bf16,
        ),
        (
            "engram-v41",
            Model::Family(TinyFamily::EngramV41).spec().unwrap(),
            TableDType::Fp8Block,
        ),
        ("longcat", TinyFamily::LongCat.spec(), TableDType::Bf16),
    ];
    for (name, spec, dtype) in cases {
        let src = root.path().join(name).join("full");
        let rows = spec.family.get::<Qwen4Exp>().is_some().then_some(1024);
        write_spec_synthetic(&src, &spec, rows, dtype, SEED).unwrap();
        let full = Checkpoint::open(&src).unwrap();
        let gpu: Arc<dyn GpuBackend> = Arc::new(CpuBackend::new());
        let mut e = checkpoint_engine(&full, &gpu, TableMode::Resident, &cache, None);
        let (inputs, want) = script_with_inputs(&mut e);
        e.close().unwrap();
        assert!(
            max_rel_diff(&want, &inputs) > 1e-2,
            "{name}: the sites moved nothing"
        );
        for ranks in [2, 4] {
            for mode in [TableMode::Resident, TableMode::Cached] {
                let sub = root.path().join(name).join(format!("{mode:?}"));
                let outs = shares_run(&src, &sub, ranks, mode, &cache);
                for (r, (got, _)) in outs.iter().enumerate() {
                    assert!(
                        metrale_testkit::same_bits(got, &outs[0].0),
                        "{name}: rank {r} of {ranks} differs from rank 0"
                    );
                }
                let d = max_rel_diff(&outs[0].0, &want);
                assert!(d <= 2e-6, "{name} over {ranks} ranks ({mode:?}): {d:e}");
            }
        }
    }
}

#[test]
fn tensor_parallel_ranks_read_a_share_of_the_table_bytes() {
    // A checkpoint with rows of 1024 BF16 values: a quarter row is one
    // 512-byte I/O granule (and the writer puts the tables first in each
    // 4 KiB-aligned file), so each rank's row cache reads exactly its
    // columns of the rows the unsharded cache reads. The shares are written by the production writer and opened
    // as the runtime opens them.
    let spec = ModelSpec {
        head_dim: 1024,
        ..Preset::Tiny.spec()
    };
    let dir = tempfile::tempdir().unwrap();
    let written = dir.path().join("written");
    write_spec_synthetic(&written, &spec, Some(4096), TableDType::Bf16, SEED).unwrap();
    // The unsharded reference laid out as the shares are (one rank of one:
    // whole rows, the tables first in each file), so its rows fill whole
    // granules as theirs do.
    let src = dir.path().join("full");
    write_rank(&written, TensorParallel::SINGLE, &src, &mut |_, _| {}).unwrap();
    let cache = CacheConfig {
        slots: 4096,
        direct: false,
        ..CacheConfig::default()
    };
    let full = Checkpoint::open(&src).unwrap();
    let gpu: Arc<dyn GpuBackend> = Arc::new(CpuBackend::new());
    let mut e = checkpoint_engine(&full, &gpu, TableMode::Cached, &cache, None);
    let want = script(&mut e);
    let whole = e.table_stats().bytes_read;
    e.close().unwrap();
    assert!(whole > 0, "the unsharded cache read nothing");
    for ranks in [2usize, 4] {
        let sub = dir.path().join(format!("of{ranks}"));
        let results = shares_run(&src, &sub, ranks, TableMode::Cached, &cache);
        for (r, (out, read)) in results.iter().enumerate() {
            assert_eq!(
                *read * ranks as u64,
                whole,
                "rank {r} of {ranks} read {read} bytes, the unsharded table {whole}"
            );
            assert!(max_rel_diff(out, &want) <= 2e-6, "rank {r} of {ranks}");
            eprintln!("rank {r} of {ranks}: read {read} bytes, the unsharded table {whole}");
        }
        let share = Checkpoint::open(&full.dir).unwrap().table_bytes() / ranks as u64;
        let opened = open_group(
            &(0..ranks)
                .map(|r| sub.join(format!("rank-{r}-of-{ranks}")))
                .collect::<Vec<_>>(),
        )
        .unwrap();
        for rc in &opened {
            assert_eq!(rc.ck.table_bytes(), share);
        }
    }
}

#[test]
fn tensor_parallel_splits_that_do_not_divide_are_refused_by_name() {
    let gpu: Arc<dyn GpuBackend> = Arc::new(CpuBackend::new());
    let (site, weights, table) = tiny_weights(&Model::tiny(), 0, SEED);
    let whole = Arc::new(
        metrale_storage::resident::ResidentTable::from_bf16(gpu.clone(), &table, 16).unwrap(),
    );
    // 16 values over 3 ranks.
    let group = InProcessGroup::ranks(3);
    let e = PleLayer::new_sharded(
        &site,
        weights.clone(),
        whole.clone(),
        MAX_TOKENS,
        gpu.as_ref(),
        shard_of(&group, 0),
    )
    .unwrap_err();
    assert!(
        matches!(
            e,
            LayerError::Shard(ShardError::Indivisible {
                head_dim: 16,
                ranks: 3
            })
        ),
        "{e}"
    );
    let msg = e.to_string();
    assert!(
        msg.contains("head_dim 16") && msg.contains("3 ranks"),
        "{msg}"
    );
    // DeepSeek-V4.1's 32-value rows over 2 ranks would cut a scale block.
    let f = TinyFamily::EngramV41;
    let group = InProcessGroup::ranks(2);
    let e = family_site_of(
        &gpu,
        &f.spec(),
        f,
        0,
        SEED,
        MAX_TOKENS,
        Some(shard_of(&group, 1)),
    )
    .err()
    .expect("16 values a rank cut the 32-value scale block");
    let msg = format!("{e:#}");
    assert!(
        msg.contains("32 values over 2 ranks give 16 values a rank")
            && msg.contains("32-value scale block"),
        "{msg}"
    );
    // A whole-width table given to a rank.
    let shard = Shard::new(TensorParallel::new(1, 2).unwrap(), group[1].clone());
    let e =
        PleLayer::new_sharded(&site, weights, whole, MAX_TOKENS, gpu.as_ref(), shard).unwrap_err();
    assert!(
        matches!(
            e,
            LayerError::ShardTableWidth {
                rank: 1,
                ranks: 2,
                table: 16,
                head_dim: 16,
                width: 8
            }
        ),
        "{e}"
    );
    assert_eq!(gpu.live_alloc_count(), 0);
}

#[test]
fn tensor_parallel_one_rank_is_the_unsharded_layer_bit_for_bit() {
    let gpu: Arc<dyn GpuBackend> = Arc::new(CpuBackend::new());
    let mut plain = Model::Qwen.engine(&gpu, None);
    let want = script(&mut plain);
    plain.close().unwrap();
    let group = InProcessGroup::ranks(1);
    let mut one = Model::Qwen.engine(&gpu, Some(shard_of(&group, 0)));
    assert!(one.sites()[0].layer().tensor_parallel().is_single());
    let got = script(&mut one);
    one.close().unwrap();
    assert!(metrale_testkit::same_bits(&got, &want));
}

#[test]
fn tensor_parallel_ranks_without_a_capturable_collective_refuse_graphs() {
    let gpu: Arc<dyn GpuBackend> = Arc::new(CpuBackend::new());
    let group = InProcessGroup::ranks(2);
    let mut e = Model::Qwen.engine(&gpu, Some(shard_of(&group, 0)));
    assert!(!e.sites()[0].layer().supports_capture());
    assert!(e.enable_decode_graphs().is_err());
    assert!(!e.decode_graphs());
    // The layer itself refuses a capturing forward before touching the
    // carry.
    let layer = e.sites()[0].layer();
    let mut st = layer.new_seq_state(gpu.as_ref()).unwrap();
    let hw = gpu.alloc(layer.channels() * 4, "highway").unwrap();
    let ctx = ForwardContext::new(gpu.as_ref())
        .with_host_ids(&[5])
        .capturing(true);
    let err = layer.forward(&mut st, hw, 1, true, &ctx, 0).unwrap_err();
    assert!(
        matches!(&err, LayerError::Capture(m) if m.contains("rank 0 of 2")),
        "{err}"
    );
    assert!(st.history().is_empty());
    layer.release_seq_state(&mut st, gpu.as_ref()).unwrap();
    gpu.free(hw).unwrap();
    e.close().unwrap();
    // One rank captures as before.
    let one = InProcessGroup::ranks(1);
    let mut e = Model::Qwen.engine(&gpu, Some(shard_of(&one, 0)));
    e.enable_decode_graphs().unwrap();
    e.close().unwrap();
}

#[test]
fn tensor_parallel_ranks_continue_an_unsharded_snapshot() {
    let model = Model::Family(TinyFamily::EngramConv);
    let prompt = tokens(11, 3);
    let steps: Vec<u32> = vec![4, 17, 29, 8];
    // Decode `steps` after `prompt` restored from `snap`: the output rows.
    let continue_from = |e: &mut Engine<PleSite>, snap: &[u8]| -> Vec<f32> {
        let w = e.width();
        let id = e.add_from_snapshot(snap, &prompt).unwrap();
        let mut toks = prompt.clone();
        let mut out = Vec::new();
        for &t in &steps {
            toks.push(t);
            let mut hw = rows_for(&toks, toks.len() - 1, toks.len(), w);
            e.decode(&[(id, t)], &mut hw).unwrap();
            out.extend_from_slice(&hw);
        }
        e.release(id).unwrap();
        out
    };
    let gpu: Arc<dyn GpuBackend> = Arc::new(CpuBackend::new());
    let mut e = model.engine(&gpu, None);
    let id = e.add_sequence(&prompt).unwrap().id;
    let mut hw = rows_for(&prompt, 0, prompt.len(), e.width());
    e.prefill(id, &prompt, &mut hw).unwrap();
    let snap = e.snapshot(id).unwrap();
    e.release(id).unwrap();
    let want = continue_from(&mut e, &snap);
    e.close().unwrap();
    let group = InProcessGroup::ranks(2);
    let outs: Vec<Vec<f32>> = std::thread::scope(|s| {
        let hs: Vec<_> = (0..2)
            .map(|r| {
                let shard = shard_of(&group, r);
                let (snap, continue_from) = (&snap, &continue_from);
                s.spawn(move || {
                    let gpu: Arc<dyn GpuBackend> = Arc::new(CpuBackend::new());
                    let mut e = model.engine(&gpu, Some(shard));
                    let out = continue_from(&mut e, snap);
                    e.close().unwrap();
                    out
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    assert!(metrale_testkit::same_bits(&outs[0], &outs[1]));
    let d = max_rel_diff(&outs[0], &want);
    assert!(d <= 2e-6, "largest difference {d:e}");
}
