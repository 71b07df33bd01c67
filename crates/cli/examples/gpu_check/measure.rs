//! Measurements on the device, each beside a baseline taken in the same
//! run (medians of timed repetitions; every device figure includes the
//! synchronize that waits for it):
//! - id hash: the device `hash` kernel in tokens/s against the host hasher
//!   (and its ids checked equal to the host's);
//! - device-table gather: GB/s of rows gathered from device memory against
//!   a device-to-device copy of the same bytes;
//! - pinned-host gather: GB/s of rows gathered from host-mapped memory
//!   over the bus (zero-copy) against a copy of the same bytes from that
//!   memory into device memory;
//! - layer prefill and batched decode in tokens/s at the flagship geometry
//!   (its table cut to a few hundred MiB) against the CPU backend;
//! - a batched decode step with decode graphs against the same step eager.

use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, ensure};
use metrale_bench::layer::{LayerForward, LayerSizes};
use metrale_checkpoint::runtime::TableMode;
use metrale_checkpoint::{Checkpoint, Preset, TableDType};
use metrale_engine::{EngineConfig, SeqId};
use metrale_gpu_runtime::cpu::CpuBackend;
use metrale_gpu_runtime::gpu::{DevicePtr, GpuBackend};
use metrale_model_layers::layers::ple::device_kernels::{LaunchShapes, load_ple_module};
use metrale_model_layers::layers::ple::ids::PleIdHasher;
use metrale_model_layers::layers::ple::kernels::args::{GatherArgs, HashArgs};
use metrale_model_layers::layers::ple::kernels::register_cpu_kernels;
use metrale_storage::table::RowRef;
use serde_json::json;

use super::Target;
use super::compare::{checkpoint, engine_over, rows, workload};
use super::report::Report;

/// Sizes of one run.
#[derive(Clone, Copy, Debug)]
struct Sizes {
    preset: Preset,
    table_rows: u64,
    hash_tokens: usize,
    gather_rows: usize,
    reps: usize,
    prefill_tokens: usize,
    decode_batch: usize,
    cpu_reps: usize,
    decode_steps: usize,
}

const FULL: Sizes = Sizes {
    preset: Preset::Flagship,
    table_rows: 1 << 20,
    hash_tokens: 1 << 20,
    gather_rows: 1 << 17,
    reps: 15,
    prefill_tokens: 512,
    decode_batch: 32,
    cpu_reps: 3,
    decode_steps: 30,
};

const QUICK: Sizes = Sizes {
    preset: Preset::Tiny,
    table_rows: 1 << 14,
    hash_tokens: 1 << 12,
    gather_rows: 1 << 10,
    reps: 3,
    prefill_tokens: 32,
    decode_batch: 4,
    cpu_reps: 2,
    decode_steps: 4,
};

/// The median wall time of `reps` runs of `f`.
fn median(reps: usize, mut f: impl FnMut() -> Result<()>) -> Result<Duration> {
    let mut t = Vec::with_capacity(reps.max(1));
    for _ in 0..reps.max(1) {
        let t0 = Instant::now();
        f()?;
        t.push(t0.elapsed());
    }
    t.sort();
    Ok(t[t.len() / 2])
}

fn secs(d: Duration) -> f64 {
    d.as_secs_f64().max(1e-9)
}

fn le_bytes<T: Copy>(v: &[T]) -> &[u8] {
    // SAFETY: plain-old-data values viewed as their bytes, for as long as
    // the slice lives.
    unsafe { std::slice::from_raw_parts(v.as_ptr() as *const u8, std::mem::size_of_val(v)) }
}

/// Device allocations freed on drop.
struct Bufs<'a> {
    gpu: &'a dyn GpuBackend,
    ptrs: Vec<DevicePtr>,
}

impl Bufs<'_> {
    fn alloc(&mut self, bytes: usize, label: &str) -> Result<DevicePtr> {
        let p = self.gpu.alloc(bytes.max(4), label)?;
        self.ptrs.push(p);
        Ok(p)
    }
    fn upload<T: Copy>(&mut self, v: &[T], label: &str) -> Result<DevicePtr> {
        let p = self.alloc(std::mem::size_of_val(v), label)?;
        self.gpu.copy_h2d(le_bytes(v), p)?;
        Ok(p)
    }
}

impl Drop for Bufs<'_> {
    fn drop(&mut self) {
        for p in self.ptrs.drain(..) {
            let _ = self.gpu.free(p);
        }
    }
}

/// Load the PLE kernels of `gpu`'s kind.
fn kernels(gpu: &dyn GpuBackend) -> Result<()> {
    if gpu.supports_host_kernels() {
        register_cpu_kernels(gpu)?;
    } else {
        load_ple_module(gpu)?;
    }
    Ok(())
}

/// Every measurement; a failed one is recorded as a failed check.
pub fn run(target: &Target, dir: &Path, report: &mut Report) {
    let s = if target.quick { QUICK } else { FULL };
    eprintln!(
        "gpu_check: measurements ({} geometry, table cut to {} rows)",
        s.preset.name(),
        s.table_rows
    );
    let ck = match checkpoint(dir, s.preset, s.table_rows, TableDType::Bf16, "bench") {
        Ok(c) => c,
        Err(e) => return report.error("measurements: checkpoint", &e),
    };
    let sections: [(&str, Section); 5] = [
        ("hash", hash),
        ("device-table gather", gather_device),
        ("pinned-host gather", gather_pinned),
        ("layer", layer),
        ("decode graphs", graphs),
    ];
    for (name, f) in sections {
        let gpu = (target.make)();
        if let Err(e) = f(&ck, &gpu, s, report) {
            report.error(&format!("measure {name}"), &e);
        }
    }
}

type Section = fn(&Checkpoint, &Arc<dyn GpuBackend>, Sizes, &mut Report) -> Result<()>;

fn hash(ck: &Checkpoint, gpu: &Arc<dyn GpuBackend>, s: Sizes, report: &mut Report) -> Result<()> {
    let name = "id hash (prefill), tokens/s";
    kernels(gpu.as_ref())?;
    let Ok(k) = gpu.kernel("ple", "hash") else {
        report.unmeasured(
            name,
            "the backend has no device hash kernel (host kernels only)",
        );
        return Ok(());
    };
    let dims = &ck.sites[0].spec.dims;
    let hasher = PleIdHasher::new(dims)?;
    let heads = dims.ngram_heads();
    let mut st = 0x4A5u64;
    let tokens: Vec<u32> = (0..s.hash_tokens)
        .map(|_| {
            st = metrale_model_layers::layers::ple::ids::splitmix64(st);
            (st % ck.spec.vocab_size) as u32
        })
        .collect();
    let mut host = vec![0u64; tokens.len() * heads];
    let mut b = Bufs {
        gpu: gpu.as_ref(),
        ptrs: Vec::new(),
    };
    let d_hist = b.upload(&[0u32], "hash history")?;
    let d_tok = b.upload(&tokens, "hash tokens")?;
    let d_mult = b.upload(&dims.multipliers, "hash multipliers")?;
    let d_size = b.upload(&dims.head_vocab_sizes, "hash sizes")?;
    let d_off = b.upload(&dims.head_offsets, "hash offsets")?;
    let d_out = b.alloc(host.len() * 8, "hash out")?;
    let n = tokens.len() as u32;
    let blocks = (tokens.len() as u32).div_ceil(256).clamp(1, 1 << 16);
    let launch = || -> Result<()> {
        let a = HashArgs {
            history: d_hist,
            hist_len: 0,
            tokens: d_tok,
            t: n,
            mults: d_mult,
            sizes: d_size,
            offsets: d_off,
            ngram_size: dims.ngram_size as u32,
            heads_per_ngram: dims.heads_per_ngram as u32,
            eos: dims.eos_token_id,
            out: d_out,
        };
        gpu.launch(
            k,
            metrale_gpu_runtime::gpu::LaunchConfig::linear(blocks, 256),
        )
        .args(&a)
        .run(0)?;
        Ok(gpu.synchronize(0)?)
    };
    launch()?;
    let dev = median(s.reps, launch)?;
    let base = median(s.reps, || Ok(hasher.ids_into(&tokens, &mut host)?))?;
    let mut got = vec![0u8; host.len() * 8];
    gpu.copy_d2h(d_out, &mut got)?;
    let same = got
        .chunks_exact(8)
        .zip(&host)
        .all(|(c, &h)| u64::from_le_bytes(c.try_into().expect("8 bytes")) == h);
    report.check(
        "hash kernel ids equal the host hasher's",
        same,
        json!({ "tokens": tokens.len(), "heads": heads }),
    );
    let rate = |d| tokens.len() as f64 / secs(d);
    report.measure(
        name,
        rate(dev),
        "tokens/s",
        "host hasher (PleIdHasher)",
        rate(base),
    );
    Ok(())
}

/// `n` random row refs of `table`-like rows at `base + r * row_bytes` for
/// `r < rows`, as the bytes of a `RowRef` array.
fn refs(base: u64, rows: u64, row_bytes: u64, n: usize, seed: u64) -> Vec<RowRef> {
    let mut st = seed;
    (0..n)
        .map(|_| {
            st = metrale_model_layers::layers::ple::ids::splitmix64(st);
            RowRef {
                data: base + (st % rows) * row_bytes,
                scale: 0,
            }
        })
        .collect()
}

/// Gather `refs` (BF16 rows of `head_dim`) into a device buffer, timed,
/// against `baseline`.
fn time_gather(
    gpu: &dyn GpuBackend,
    refs: &[RowRef],
    head_dim: usize,
    reps: usize,
    mut baseline: impl FnMut() -> Result<()>,
) -> Result<(Duration, Duration)> {
    kernels(gpu)?;
    let k = gpu.kernel("ple", "gather")?;
    let mut b = Bufs {
        gpu,
        ptrs: Vec::new(),
    };
    let d_refs = b.upload(refs, "gather refs")?;
    let out = b.alloc(refs.len() * head_dim * 4, "gather out")?;
    let cfg = LaunchShapes::for_backend(gpu).gather(refs.len(), head_dim);
    let launch = || -> Result<()> {
        let a = GatherArgs {
            refs: d_refs,
            n: refs.len() as u32,
            head_dim: head_dim as u32,
            dtype: 0,
            out,
        };
        gpu.launch(k, cfg).args(&a).run(0)?;
        Ok(gpu.synchronize(0)?)
    };
    launch()?;
    baseline()?;
    let g = median(reps, launch)?;
    let c = median(reps, &mut baseline)?;
    Ok((g, c))
}

fn gather_device(
    ck: &Checkpoint,
    gpu: &Arc<dyn GpuBackend>,
    s: Sizes,
    report: &mut Report,
) -> Result<()> {
    let head_dim = ck.spec.head_dim;
    let rb = head_dim * 2;
    let rows = s.table_rows.min(1 << 20);
    let mut b = Bufs {
        gpu: gpu.as_ref(),
        ptrs: Vec::new(),
    };
    let table = b.alloc(rows as usize * rb, "device table")?;
    gpu.memset(table, 0x3F, rows as usize * rb)?;
    let dst = b.alloc(s.gather_rows * rb, "copy destination")?;
    let r = refs(table.addr(), rows, rb as u64, s.gather_rows, 5);
    let bytes = s.gather_rows * rb;
    let (g, c) = time_gather(gpu.as_ref(), &r, head_dim, s.reps, || {
        gpu.copy_d2d_async(table, dst, bytes, 0)?;
        Ok(gpu.synchronize(0)?)
    })?;
    let gbs = |d| bytes as f64 / secs(d) / 1e9;
    report.measure(
        &format!(
            "device-table gather, {} random rows of {rb} B, GB/s of rows",
            s.gather_rows
        ),
        gbs(g),
        "GB/s",
        "device-to-device copy of the same bytes",
        gbs(c),
    );
    Ok(())
}

fn gather_pinned(
    ck: &Checkpoint,
    gpu: &Arc<dyn GpuBackend>,
    s: Sizes,
    report: &mut Report,
) -> Result<()> {
    let head_dim = ck.spec.head_dim;
    let rb = head_dim * 2;
    let rows = (s.gather_rows * 4) as u64;
    let arena = gpu.alloc_host_mapped(rows as usize * rb, "pinned rows")?;
    let result = (|| -> Result<(Duration, Duration)> {
        // SAFETY: the arena is live until freed below and nothing else
        // touches it yet.
        unsafe { std::ptr::write_bytes(arena.host, 0x3F, arena.bytes) };
        let mut b = Bufs {
            gpu: gpu.as_ref(),
            ptrs: Vec::new(),
        };
        let dst = b.alloc(s.gather_rows * rb, "copy destination")?;
        let r = refs(arena.device.addr(), rows, rb as u64, s.gather_rows, 9);
        let bytes = s.gather_rows * rb;
        time_gather(gpu.as_ref(), &r, head_dim, s.reps, || {
            gpu.copy_d2d_async(arena.device, dst, bytes, 0)?;
            Ok(gpu.synchronize(0)?)
        })
    })();
    gpu.free(arena.device)?;
    let (g, c) = result?;
    let bytes = s.gather_rows * rb;
    let gbs = |d| bytes as f64 / secs(d) / 1e9;
    report.measure(
        &format!(
            "pinned-host gather (zero-copy), {} random rows of {rb} B, GB/s of rows",
            s.gather_rows
        ),
        gbs(g),
        "GB/s",
        "copy of the same bytes from pinned host memory to the device",
        gbs(c),
    );
    Ok(())
}

/// Prefill and decode seconds of the layer on `gpu`.
fn layer_times(
    ck: &Checkpoint,
    gpu: &Arc<dyn GpuBackend>,
    s: Sizes,
    reps: usize,
) -> Result<(Duration, Duration)> {
    let table = ck.open_table(0, TableMode::Resident, gpu.clone())?;
    let layer = ck.build_layer(0, table, s.prefill_tokens.max(s.decode_batch), gpu.as_ref())?;
    let sizes = LayerSizes {
        prefill_tokens: s.prefill_tokens,
        decode_batch: s.decode_batch,
        vocab: ck.spec.vocab_size,
    };
    let mut w = LayerForward::new(layer, &ck.sites[0].weights, gpu.as_ref(), sizes, 0x5EED)?;
    let p = median(reps, || {
        w.prefill()?;
        Ok(())
    })?;
    let d = median(reps, || {
        w.decode()?;
        Ok(())
    })?;
    w.close()?;
    Ok((p, d))
}

fn layer(ck: &Checkpoint, gpu: &Arc<dyn GpuBackend>, s: Sizes, report: &mut Report) -> Result<()> {
    let (p, d) = layer_times(ck, gpu, s, s.reps).context("on the device")?;
    let cpu: Arc<dyn GpuBackend> = Arc::new(CpuBackend::new());
    let (cp, cd) = layer_times(ck, &cpu, s, s.cpu_reps).context("on the CPU backend")?;
    let t = s.prefill_tokens as f64;
    let b = s.decode_batch as f64;
    report.measure(
        &format!(
            "layer prefill, {}-token chunk ({} geometry), tokens/s",
            s.prefill_tokens,
            s.preset.name()
        ),
        t / secs(p),
        "tokens/s",
        "the same on the CPU backend",
        t / secs(cp),
    );
    report.measure(
        &format!(
            "layer batched decode, {} sequences, tokens/s",
            s.decode_batch
        ),
        b / secs(d),
        "tokens/s",
        "the same on the CPU backend",
        b / secs(cd),
    );
    Ok(())
}

/// Median seconds of one batched decode step of `decode_batch` sequences
/// through an engine over every site of `ck`, eager or through graphs (the
/// first step, which captures, not timed).
fn step_time(
    ck: &Checkpoint,
    gpu: &Arc<dyn GpuBackend>,
    s: Sizes,
    graphs: bool,
) -> Result<Duration> {
    let cfg = EngineConfig {
        prefill_chunk: 8,
        prefix_cache_bytes: 0,
        ..Default::default()
    };
    let mut e = engine_over(ck, gpu, TableMode::Resident, s.decode_batch.max(8), cfg)?;
    if graphs {
        e.enable_decode_graphs()?;
    }
    let w = e.width();
    let wl = workload(
        s.decode_batch,
        s.decode_steps + 1,
        ck.spec.vocab_size,
        ck.spec.eos_token_id,
        0xDEC,
    );
    let mut ids: Vec<SeqId> = Vec::new();
    for p in &wl.prompts {
        let p = &p[..p.len().min(8)];
        let id = e.add_sequence(p)?.id;
        let mut hw = rows(p, w);
        e.prefill(id, p, &mut hw)?;
        ids.push(id);
    }
    let mut steps = wl.steps.iter();
    let mut step = |e: &mut metrale_engine::Engine<_>| -> Result<()> {
        let toks = steps.next().context("out of decode steps")?;
        let mut hw = rows(toks, w);
        let batch: Vec<(SeqId, u32)> = ids.iter().copied().zip(toks.iter().copied()).collect();
        Ok(e.decode(&batch, &mut hw)?)
    };
    step(&mut e)?;
    let mut times = Vec::new();
    for _ in 0..s.decode_steps {
        let t0 = Instant::now();
        step(&mut e)?;
        times.push(t0.elapsed());
    }
    if graphs {
        let st = e.stats();
        ensure!(
            st.graph_replays as usize > s.decode_steps,
            "only {} graph replays",
            st.graph_replays
        );
    }
    for id in ids {
        e.release(id)?;
    }
    e.close()?;
    times.sort();
    Ok(times[times.len() / 2])
}

fn graphs(ck: &Checkpoint, gpu: &Arc<dyn GpuBackend>, s: Sizes, report: &mut Report) -> Result<()> {
    let g = step_time(ck, gpu, s, true)?;
    let e = step_time(ck, gpu, s, false)?;
    let b = s.decode_batch as f64;
    report.measure(
        &format!(
            "engine decode step with graphs, {} sequences x {} sites, tokens/s",
            s.decode_batch,
            ck.sites.len()
        ),
        b / secs(g),
        "tokens/s",
        "the same step eager",
        b / secs(e),
    );
    Ok(())
}
