//! The device against the CPU backend on the same synthetic checkpoints.
//!
//! Layer forward, per table dtype (BF16, FP8) and tier (resident, mapped,
//! cached): the same workload (prompts prefilled in chunks, then batched
//! decode steps) runs through an engine over the checkpoint's sites
//! - on the CPU backend over a resident table: the reference;
//! - on the device in chunks, compared with the reference within
//!   `ATOL + RTOL * |cpu|` (the device's sigmoid uses `expf`, which may
//!   differ from the host's `exp` in the last place, so the two backends are
//!   not bit-identical), printing the largest and mean error;
//! - on the device token by token (one-token forwards) with each sequence
//!   decoded alone, and with decode graphs: bit-identical to the chunked,
//!   batched device run (the kernels' order of arithmetic never depends on
//!   the number of rows);
//! - on each other tier: bit-identical to the device's resident tier.
//!
//! Engine lifecycle: a scripted run with a prefix cache, a device budget
//! that forces preemption to host memory and swap-in, decode graphs, a row
//! cache, releases and close, on both backends (within the tolerance), with
//! the device's live allocations back to where they started; then the
//! randomised engine drive of the test kit on the device, every output
//! checked bit for bit against sequential runs on the same device.

use std::panic::AssertUnwindSafe;
use std::path::Path;
use std::sync::Arc;

use anyhow::{Context, Result, ensure};
use metrale_checkpoint::runtime::TableMode;
use metrale_checkpoint::synth::write_synthetic;
use metrale_checkpoint::{Checkpoint, InitOptions, Preset, TableDType};
use metrale_engine::ple_site::PleSite;
use metrale_engine::{Engine, EngineConfig, SeqId, SwapTarget};
use metrale_gpu_runtime::cpu::CpuBackend;
use metrale_gpu_runtime::gpu::GpuBackend;
use metrale_storage::cached::CacheConfig;
use metrale_testkit::drive::drive;
use metrale_testkit::tiny::{TinySpec, tiny_engine};
use serde_json::json;

use super::Target;
use super::report::Report;

/// Absolute part of the device-against-CPU tolerance.
pub const ATOL: f64 = 1e-4;
/// Relative part of the device-against-CPU tolerance.
pub const RTOL: f64 = 1e-4;

/// Prompts and decode tokens of one comparison.
pub struct Workload {
    /// One prompt per sequence.
    pub prompts: Vec<Vec<u32>>,
    /// Per decode step, one token per sequence.
    pub steps: Vec<Vec<u32>>,
}

/// A deterministic workload of `seqs` sequences below `vocab`, avoiding
/// `eos`.
pub fn workload(seqs: usize, steps: usize, vocab: u64, eos: u32, seed: u64) -> Workload {
    let mut s = seed;
    let mut next = move || {
        s = metrale_model_layers::layers::ple::ids::splitmix64(s);
        let t = (s % vocab) as u32;
        if t == eos { (t + 1) % vocab as u32 } else { t }
    };
    let prompts = (0..seqs)
        .map(|i| (0..5 + 7 * i % 37).map(|_| next()).collect())
        .collect();
    let steps = (0..steps)
        .map(|_| (0..seqs).map(|_| next()).collect())
        .collect();
    Workload { prompts, steps }
}

/// The input highway rows of `tokens`: a function of the token alone.
pub fn rows(tokens: &[u32], width: usize) -> Vec<f32> {
    let mut out = Vec::with_capacity(tokens.len() * width);
    for &t in tokens {
        let mut s = 0xE3B0_C442_98FC_1C14 ^ u64::from(t).wrapping_mul(0xD6E8_FEB8_6659_FD93);
        for _ in 0..width {
            s = metrale_model_layers::layers::ple::ids::splitmix64(s);
            out.push(((s >> 40) as f32 / (1u64 << 23) as f32) - 1.0);
        }
    }
    out
}

/// How one run drives the engine.
#[derive(Clone, Copy, Debug)]
pub struct RunCfg {
    /// Table tier.
    pub mode: TableMode,
    /// Most tokens per prefill chunk (1: one-token forwards).
    pub chunk: usize,
    /// Decode graphs.
    pub graphs: bool,
    /// Decode each sequence alone instead of in one batch.
    pub solo: bool,
}

/// The engine over every site of `ck` on `gpu`, tables of `mode`.
pub fn engine_over(
    ck: &Checkpoint,
    gpu: &Arc<dyn GpuBackend>,
    mode: TableMode,
    max_tokens: usize,
    cfg: EngineConfig,
) -> Result<Engine<PleSite>> {
    let mut sites = Vec::with_capacity(ck.sites.len());
    for s in 0..ck.sites.len() {
        let table = match mode {
            TableMode::Cached => ck.open_cached_table(s, CacheConfig::new(4096), gpu.clone())?,
            m => ck.open_table(s, m, gpu.clone())?,
        };
        sites.push(PleSite::new(ck.build_layer(
            s,
            table,
            max_tokens,
            gpu.as_ref(),
        )?));
    }
    Ok(Engine::new(gpu.clone(), sites, cfg)?)
}

/// Every output row of `wl` through an engine on `gpu`: the prefills in
/// order, then each decode step.
pub fn run_engine(
    ck: &Checkpoint,
    gpu: &Arc<dyn GpuBackend>,
    wl: &Workload,
    rc: RunCfg,
) -> Result<Vec<f32>> {
    let cfg = EngineConfig {
        prefill_chunk: rc.chunk,
        prefix_cache_bytes: 0,
        ..Default::default()
    };
    let mut e = engine_over(ck, gpu, rc.mode, rc.chunk.max(wl.prompts.len()), cfg)?;
    if rc.graphs {
        e.enable_decode_graphs()?;
    }
    let w = e.width();
    let mut out = Vec::new();
    let mut ids: Vec<SeqId> = Vec::new();
    for p in &wl.prompts {
        let id = e.add_sequence(p)?.id;
        let mut hw = rows(p, w);
        e.prefill(id, p, &mut hw)?;
        out.extend(hw);
        ids.push(id);
    }
    for step in &wl.steps {
        let mut hw = rows(step, w);
        if rc.solo {
            for (i, (&id, &t)) in ids.iter().zip(step).enumerate() {
                e.decode(&[(id, t)], &mut hw[i * w..(i + 1) * w])?;
            }
        } else {
            let batch: Vec<(SeqId, u32)> = ids.iter().copied().zip(step.iter().copied()).collect();
            e.decode(&batch, &mut hw)?;
        }
        out.extend(hw);
    }
    if rc.graphs {
        let s = e.stats();
        ensure!(
            s.graph_replays >= wl.steps.len() as u64,
            "decode graphs: {} replays for {} steps",
            s.graph_replays,
            wl.steps.len()
        );
    }
    for id in ids {
        e.release(id)?;
    }
    e.close()?;
    Ok(out)
}

/// A synthetic checkpoint of `preset` under `dir`.
pub fn checkpoint(
    dir: &Path,
    preset: Preset,
    rows: u64,
    dtype: TableDType,
    tag: &str,
) -> Result<Checkpoint> {
    let d = dir.join(format!("{}-{tag}", preset.name()));
    if !d.exists() {
        let opts = InitOptions {
            preset,
            table_rows: Some(rows),
            dtype,
            seed: 7,
        };
        write_synthetic(&d, &opts, &mut |_, _| {})
            .with_context(|| format!("writing the synthetic checkpoint {}", d.display()))?;
    }
    Ok(Checkpoint::open(&d)?)
}

/// Every comparison; one check each.
pub fn run(target: &Target, dir: &Path, report: &mut Report) {
    eprintln!("gpu_check: layer forward against the CPU backend");
    for (dtype, tag) in [(TableDType::Bf16, "bf16"), (TableDType::Fp8, "fp8")] {
        if let Err(e) = layer(target, dir, dtype, tag, report) {
            report.error(&format!("layer {tag}: setup"), &e);
        }
    }
    eprintln!("gpu_check: engine lifecycle");
    match lifecycle(target, dir) {
        Ok((dev, cpu, detail)) => {
            report.within(
                "engine lifecycle: device against cpu",
                &dev,
                &cpu,
                ATOL,
                RTOL,
            );
            report.check("engine lifecycle: counters and leaks", detail.0, detail.1);
        }
        Err(e) => report.error("engine lifecycle", &e),
    }
    let gpu = (target.make)();
    let spec = TinySpec {
        max_tokens: 16,
        ..Default::default()
    };
    let steps = if target.quick { 300 } else { 1500 };
    let swap_dir = dir.join("swap");
    if let Err(e) = std::fs::create_dir_all(&swap_dir) {
        return report.error("engine drive: swap directory", &e.into());
    }
    let driven = std::panic::catch_unwind(AssertUnwindSafe(|| -> Result<String> {
        let cfg = EngineConfig {
            prefill_chunk: 5,
            block_size: 4,
            prefix_cache_bytes: 1 << 20,
            device_budget_bytes: usize::MAX,
            preempt_to: SwapTarget::File,
            swap_dir: Some(swap_dir.clone()),
        };
        let mut e = tiny_engine(&gpu, &spec, 2, 3, cfg)?;
        e.enable_decode_graphs()?;
        let ex = drive(&mut e, 11, steps, 14, 6);
        e.close()?;
        Ok(format!("{ex:?}"))
    }));
    match driven {
        Ok(Ok(ex)) => report.check(
            "engine drive on the device, bit for bit against sequential runs",
            true,
            json!({ "steps": steps, "exercised": ex }),
        ),
        Ok(Err(e)) => report.error("engine drive on the device", &e),
        Err(p) => report.check(
            "engine drive on the device, bit for bit against sequential runs",
            false,
            json!({ "panic": p.downcast_ref::<String>().cloned()
                .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string())) }),
        ),
    }
}

/// The layer checks of one dtype.
fn layer(
    target: &Target,
    dir: &Path,
    dtype: TableDType,
    tag: &str,
    report: &mut Report,
) -> Result<()> {
    let ck = checkpoint(dir, Preset::Tiny, 1 << 14, dtype, tag)?;
    let (seqs, steps) = if target.quick { (4, 4) } else { (8, 12) };
    let wl = workload(seqs, steps, ck.spec.vocab_size, ck.spec.eos_token_id, 0x6C);
    let cpu: Arc<dyn GpuBackend> = Arc::new(CpuBackend::new());
    let base = RunCfg {
        mode: TableMode::Resident,
        chunk: 16,
        graphs: false,
        solo: false,
    };
    let want = run_engine(&ck, &cpu, &wl, base).context("the CPU reference run")?;
    let mut resident: Option<Vec<f32>> = None;
    for mode in [TableMode::Resident, TableMode::Mapped, TableMode::Cached] {
        let gpu = (target.make)();
        let name = |what: &str| format!("layer {tag} {mode}: {what}");
        let chunked = match run_engine(&ck, &gpu, &wl, RunCfg { mode, ..base }) {
            Ok(v) => v,
            Err(e) => {
                report.error(&name("prefill and batched decode"), &e);
                continue;
            }
        };
        report.within(
            &name("prefill and batched decode, device against cpu"),
            &chunked,
            &want,
            ATOL,
            RTOL,
        );
        let variants = [
            (
                "one-token forwards and solo decode against chunked and batched",
                RunCfg {
                    mode,
                    chunk: 1,
                    graphs: false,
                    solo: true,
                },
            ),
            (
                "decode graphs against eager batched decode",
                RunCfg {
                    mode,
                    graphs: true,
                    ..base
                },
            ),
        ];
        for (what, rc) in variants {
            match run_engine(&ck, &gpu, &wl, rc) {
                Ok(v) => report.bitwise(&name(what), &v, &chunked),
                Err(e) => report.error(&name(what), &e),
            }
        }
        match &resident {
            None => resident = Some(chunked),
            Some(r) => report.bitwise(&name("against the resident tier"), &chunked, r),
        }
        report.check(
            &name("no live allocation left"),
            gpu.live_alloc_count() == 0,
            json!({ "live": gpu.live_report() }),
        );
    }
    Ok(())
}

/// The scripted lifecycle on the device and on the CPU backend: their
/// outputs, and (passed, detail) of the counters and leak check.
#[allow(clippy::type_complexity)]
fn lifecycle(
    target: &Target,
    dir: &Path,
) -> Result<(Vec<f32>, Vec<f32>, (bool, serde_json::Value))> {
    let ck = checkpoint(dir, Preset::Tiny, 1 << 14, TableDType::Bf16, "bf16")?;
    let cpu: Arc<dyn GpuBackend> = Arc::new(CpuBackend::new());
    let gpu = (target.make)();
    let base = gpu.live_alloc_count();
    let (want, _) = script(&ck, &cpu)?;
    let (got, stats) = script(&ck, &gpu)?;
    let live = gpu.live_alloc_count();
    let ok = live == base
        && stats.prefix_hits > 0
        && stats.preemptions > 0
        && stats.swap_ins > 0
        && stats.graph_replays > 0;
    let detail = json!({
        "prefix_hits": stats.prefix_hits,
        "preemptions": stats.preemptions,
        "swap_ins": stats.swap_ins,
        "graph_captures": stats.graph_captures,
        "graph_replays": stats.graph_replays,
        "live_allocations_before": base,
        "live_allocations_after": live,
    });
    Ok((got, want, (ok, detail)))
}

/// What the lifecycle script counted.
struct Counted {
    prefix_hits: u64,
    preemptions: u64,
    swap_ins: u64,
    graph_captures: u64,
    graph_replays: u64,
}

/// Add sequences over shared stems (prefix cache), prefill in chunks,
/// decode in batches through graphs with a budget of three carries
/// (preemption, swap-in), release half, add more from the same stems,
/// decode again, release all, close.
fn script(ck: &Checkpoint, gpu: &Arc<dyn GpuBackend>) -> Result<(Vec<f32>, Counted)> {
    let probe_cfg = EngineConfig {
        prefill_chunk: 16,
        ..Default::default()
    };
    let probe = engine_over(ck, gpu, TableMode::Cached, 16, probe_cfg)?;
    let carry = probe.carry_bytes();
    probe.close()?;
    let cfg = EngineConfig {
        prefill_chunk: 16,
        block_size: 16,
        prefix_cache_bytes: 8 << 20,
        device_budget_bytes: 3 * carry,
        preempt_to: SwapTarget::Host,
        ..Default::default()
    };
    let mut e = engine_over(ck, gpu, TableMode::Cached, 16, cfg)?;
    e.enable_decode_graphs()?;
    let w = e.width();
    let wl = workload(12, 6, ck.spec.vocab_size, ck.spec.eos_token_id, 0x11FE);
    let stems: Vec<Vec<u32>> = wl.prompts[..2]
        .iter()
        .map(|p| p.repeat(8)[..40].to_vec())
        .collect();
    let mut out = Vec::new();
    let mut live: Vec<SeqId> = Vec::new();
    let add = |e: &mut Engine<PleSite>, out: &mut Vec<f32>, i: usize| -> Result<SeqId> {
        let mut prompt = stems[i % 2].clone();
        prompt.extend(&wl.prompts[i][..3.min(wl.prompts[i].len())]);
        let added = e.add_sequence(&prompt)?;
        let rest = &prompt[added.cached..];
        let mut hw = rows(rest, w);
        e.prefill(added.id, rest, &mut hw)?;
        out.extend(hw);
        Ok(added.id)
    };
    for i in 0..6 {
        live.push(add(&mut e, &mut out, i)?);
    }
    for step in &wl.steps[..3] {
        for group in live.chunks(3) {
            let toks = &step[..group.len()];
            let mut hw = rows(toks, w);
            let batch: Vec<(SeqId, u32)> =
                group.iter().copied().zip(toks.iter().copied()).collect();
            e.decode(&batch, &mut hw)?;
            out.extend(hw);
        }
    }
    for id in live.drain(..3) {
        e.release(id)?;
    }
    for i in 6..9 {
        live.push(add(&mut e, &mut out, i)?);
    }
    for step in &wl.steps[3..] {
        for group in live.chunks(3) {
            let toks = &step[..group.len()];
            let mut hw = rows(toks, w);
            let batch: Vec<(SeqId, u32)> =
                group.iter().copied().zip(toks.iter().copied()).collect();
            e.decode(&batch, &mut hw)?;
            out.extend(hw);
        }
    }
    for id in live {
        e.release(id)?;
    }
    let s = e.stats();
    let counted = Counted {
        prefix_hits: s.prefix_hits,
        preemptions: s.preemptions,
        swap_ins: s.swap_ins,
        graph_captures: s.graph_captures,
        graph_replays: s.graph_replays,
    };
    e.close()?;
    Ok((out, counted))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn workloads_are_deterministic_and_avoid_eos() {
        let a = workload(5, 3, 50, 7, 1);
        let b = workload(5, 3, 50, 7, 1);
        assert_eq!(a.prompts, b.prompts);
        assert!(a.prompts.iter().flatten().all(|&t| t < 50 && t != 7));
        assert_eq!(rows(&[3, 4], 8).len(), 16);
        assert_eq!(rows(&[3], 8), rows(&[3], 8));
    }
}
