//! The ordering rules decode graphs must keep for a device backend, checked
//! on the CPU backend's capture through a backend that records every call.
//!
//! An engine with decode graphs over two PLE sites whose tables sit behind
//! the row cache (a slot arena in host-mapped memory, rows read from disk)
//! runs prefills and batched decode steps. What must hold, because a CUDA
//! stream capture forbids it or a replay would read stale rows otherwise:
//! - between `begin_capture` and `end_capture` nothing synchronises
//!   (`synchronize`, `event_synchronize`, blocking copies or memsets),
//!   nothing allocates, frees or registers memory (`alloc`,
//!   `alloc_host_mapped`, `register_host`, `free`), no module is loaded, and
//!   no table resolves a row (the host prestage);
//! - every `launch_graph` follows, within its own step, a prestage of every
//!   site (a `resolve` on each table) and the upload of its row references
//!   (`copy_h2d_async`), all issued before the replay;
//! - the outputs are bit-identical to an engine without graphs over the
//!   same files.
//!
//! The same recording backend, claiming to run no host kernels, checks the
//! layers' device path: GPU launch shapes within CUDA's limits, outputs
//! unchanged.

use std::path::Path;
use std::sync::{Arc, Mutex};

use metrale_engine::ple_site::PleSite;
use metrale_engine::{Engine, EngineConfig, SeqId};
use metrale_gpu_runtime::Result as GpuResult;
use metrale_gpu_runtime::cpu::CpuBackend;
use metrale_gpu_runtime::gpu::{
    AllocationInfo, ArgKind, DevicePtr, EventHandle, GpuBackend, GraphHandle, HostKernelFn,
    HostMapped, KernelArg, KernelHandle, LaunchConfig, StreamId,
};
use metrale_model_layers::layers::ple::PleLayer;
use metrale_storage::cached::{CacheConfig, CachedTable};
use metrale_testkit::hooked::hooked;
use metrale_testkit::rows::rows_for;
use metrale_testkit::tiny::{TinySpec, tiny_site_files};

/// The calls of interest, in order, shared by the backend and the tables.
#[derive(Default)]
struct Log(Mutex<Vec<String>>);

impl Log {
    fn push(&self, what: impl Into<String>) {
        self.0.lock().unwrap().push(what.into());
    }
    fn take(&self) -> Vec<String> {
        std::mem::take(&mut *self.0.lock().unwrap())
    }
}

/// A [`CpuBackend`] that logs each call by name before forwarding it.
///
/// With `device_shaped`, it says it runs no host kernels (as a device
/// backend does), so layers load their kernels as device code (here: they
/// find the CPU kernels already registered under the same names) and shape
/// their launches for a GPU; every launch configuration is then checked
/// against the CUDA limits and the block shapes `ple.cu` wants, and
/// violations are collected in `bad_launches`.
struct Recording {
    inner: CpuBackend,
    log: Arc<Log>,
    device_shaped: bool,
    names: Mutex<std::collections::HashMap<KernelHandle, String>>,
    bad_launches: Mutex<Vec<String>>,
    shaped_launches: std::sync::atomic::AtomicUsize,
}

impl Recording {
    fn new(log: Arc<Log>, device_shaped: bool) -> Recording {
        let inner = CpuBackend::new();
        if device_shaped {
            metrale_model_layers::layers::ple::kernels::register_cpu_kernels(&inner).unwrap();
        }
        Recording {
            inner,
            log,
            device_shaped,
            names: Mutex::default(),
            bad_launches: Mutex::default(),
            shaped_launches: Default::default(),
        }
    }

    /// Check `cfg` of kernel `name` against CUDA's limits and `ple.cu`'s
    /// fast shapes.
    fn check_shape(&self, name: &str, cfg: &LaunchConfig) {
        let (g, b) = (cfg.grid, cfg.block);
        let threads = u64::from(b.0) * u64::from(b.1) * u64::from(b.2);
        let mut why = Vec::new();
        if threads == 0 || threads > 1024 || b.2 > 64 {
            why.push("block size");
        }
        if g.0 == 0 || g.1 == 0 || g.2 == 0 || g.1 > 65_535 || g.2 > 65_535 {
            why.push("grid size");
        }
        match name {
            "ple::gate" if b.0 % 32 != 0 || b.1 != 1 || b.2 != 1 => {
                why.push("gate wants one-dimensional blocks of whole warps")
            }
            "ple::project" if b != (32, 8, 1) => why.push("project wants (32, 8) blocks"),
            _ => {}
        }
        if threads > 1 {
            self.shaped_launches
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        }
        if !why.is_empty() {
            self.bad_launches
                .lock()
                .unwrap()
                .push(format!("{name} {cfg:?}: {}", why.join(", ")));
        }
    }

    fn note(&self, what: &str) {
        self.log.push(what);
    }
}

impl GpuBackend for Recording {
    fn name(&self) -> &str {
        self.inner.name()
    }
    fn alloc(&self, bytes: usize, label: &str) -> GpuResult<DevicePtr> {
        self.note("alloc");
        self.inner.alloc(bytes, label)
    }
    fn dealloc(&self, ptr: DevicePtr) -> GpuResult<()> {
        self.note("free");
        self.inner.dealloc(ptr)
    }
    fn alloc_host_mapped(&self, bytes: usize, label: &str) -> GpuResult<HostMapped> {
        self.note("alloc_host_mapped");
        self.inner.alloc_host_mapped(bytes, label)
    }
    unsafe fn register_host(
        &self,
        host: *mut u8,
        bytes: usize,
        label: &str,
    ) -> GpuResult<DevicePtr> {
        self.note("register_host");
        // SAFETY: the caller's promise is passed on unchanged.
        unsafe { self.inner.register_host(host, bytes, label) }
    }
    fn memset(&self, dst: DevicePtr, value: u8, bytes: usize) -> GpuResult<()> {
        self.note("memset");
        self.inner.memset(dst, value, bytes)
    }
    fn memset_async(
        &self,
        dst: DevicePtr,
        value: u8,
        bytes: usize,
        stream: StreamId,
    ) -> GpuResult<()> {
        self.note("memset_async");
        self.inner.memset_async(dst, value, bytes, stream)
    }
    fn copy_h2d(&self, src: &[u8], dst: DevicePtr) -> GpuResult<()> {
        self.note("copy_h2d");
        self.inner.copy_h2d(src, dst)
    }
    fn copy_d2h(&self, src: DevicePtr, dst: &mut [u8]) -> GpuResult<()> {
        self.note("copy_d2h");
        self.inner.copy_d2h(src, dst)
    }
    fn copy_d2d(&self, src: DevicePtr, dst: DevicePtr, bytes: usize) -> GpuResult<()> {
        self.note("copy_d2d");
        self.inner.copy_d2d(src, dst, bytes)
    }
    fn copy_h2d_async(&self, src: &[u8], dst: DevicePtr, stream: StreamId) -> GpuResult<()> {
        self.note("copy_h2d_async");
        self.inner.copy_h2d_async(src, dst, stream)
    }
    fn copy_d2h_on_stream(
        &self,
        src: DevicePtr,
        dst: &mut [u8],
        stream: StreamId,
    ) -> GpuResult<()> {
        self.note("copy_d2h_on_stream");
        self.inner.copy_d2h_on_stream(src, dst, stream)
    }
    fn copy_d2d_async(
        &self,
        src: DevicePtr,
        dst: DevicePtr,
        bytes: usize,
        stream: StreamId,
    ) -> GpuResult<()> {
        self.note("copy_d2d_async");
        self.inner.copy_d2d_async(src, dst, bytes, stream)
    }
    fn default_stream(&self) -> StreamId {
        self.inner.default_stream()
    }
    fn create_stream(&self) -> GpuResult<StreamId> {
        self.note("create_stream");
        self.inner.create_stream()
    }
    fn destroy_stream(&self, stream: StreamId) -> GpuResult<()> {
        self.note("destroy_stream");
        self.inner.destroy_stream(stream)
    }
    fn synchronize(&self, stream: StreamId) -> GpuResult<()> {
        self.note("synchronize");
        self.inner.synchronize(stream)
    }
    fn create_event(&self) -> GpuResult<EventHandle> {
        self.note("create_event");
        self.inner.create_event()
    }
    fn record_event(&self, event: EventHandle, stream: StreamId) -> GpuResult<()> {
        self.note("record_event");
        self.inner.record_event(event, stream)
    }
    fn stream_wait_event(&self, stream: StreamId, event: EventHandle) -> GpuResult<()> {
        self.note("stream_wait_event");
        self.inner.stream_wait_event(stream, event)
    }
    fn event_synchronize(&self, event: EventHandle) -> GpuResult<()> {
        self.note("event_synchronize");
        self.inner.event_synchronize(event)
    }
    fn event_query(&self, event: EventHandle) -> GpuResult<bool> {
        self.inner.event_query(event)
    }
    fn destroy_event(&self, event: EventHandle) -> GpuResult<()> {
        self.note("destroy_event");
        self.inner.destroy_event(event)
    }
    fn begin_capture(&self, stream: StreamId) -> GpuResult<()> {
        self.note("begin_capture");
        self.inner.begin_capture(stream)
    }
    fn end_capture(&self, stream: StreamId) -> GpuResult<GraphHandle> {
        self.note("end_capture");
        self.inner.end_capture(stream)
    }
    fn stream_is_capturing(&self, stream: StreamId) -> GpuResult<bool> {
        self.inner.stream_is_capturing(stream)
    }
    fn launch_graph(&self, graph: GraphHandle, stream: StreamId) -> GpuResult<()> {
        self.note("launch_graph");
        self.inner.launch_graph(graph, stream)
    }
    fn destroy_graph(&self, graph: GraphHandle) -> GpuResult<()> {
        self.note("destroy_graph");
        self.inner.destroy_graph(graph)
    }
    fn supports_host_kernels(&self) -> bool {
        !self.device_shaped && self.inner.supports_host_kernels()
    }
    fn register_host_kernel(
        &self,
        module: &str,
        name: &str,
        signature: &[ArgKind],
        body: Arc<HostKernelFn>,
    ) -> GpuResult<()> {
        self.note("register_host_kernel");
        self.inner
            .register_host_kernel(module, name, signature, body)
    }
    fn load_module(&self, module: &str, image: &[u8]) -> GpuResult<()> {
        self.note("load_module");
        self.inner.load_module(module, image)
    }
    fn kernel(&self, module: &str, name: &str) -> GpuResult<KernelHandle> {
        let k = self.inner.kernel(module, name)?;
        self.names
            .lock()
            .unwrap()
            .insert(k, format!("{module}::{name}"));
        Ok(k)
    }
    fn launch_kernel(
        &self,
        kernel: KernelHandle,
        cfg: LaunchConfig,
        args: &[KernelArg],
        stream: StreamId,
    ) -> GpuResult<()> {
        self.note("launch_kernel");
        if self.device_shaped {
            let name = self.names.lock().unwrap().get(&kernel).cloned();
            self.check_shape(name.as_deref().unwrap_or("?"), &cfg);
        }
        self.inner.launch_kernel(kernel, cfg, args, stream)
    }
    fn live_bytes(&self) -> usize {
        self.inner.live_bytes()
    }
    fn live_alloc_count(&self) -> usize {
        self.inner.live_alloc_count()
    }
    fn live_allocations(&self) -> Vec<AllocationInfo> {
        self.inner.live_allocations()
    }
}

const SITES: usize = 2;
const MAX_TOKENS: usize = 8;

fn model() -> TinySpec {
    TinySpec {
        max_tokens: MAX_TOKENS,
        ..Default::default()
    }
}

/// An engine over `gpu` with cached tables on the files under `dir`.
fn engine(gpu: &Arc<dyn GpuBackend>, dir: &Path, log: &Arc<Log>) -> Engine<PleSite> {
    let mut sites = Vec::new();
    for site in 0..SITES {
        let (spec, files, weights) = tiny_site_files(dir, &model(), site, 0xC0DE).unwrap();
        // Few slots, so decode steps miss and read from disk.
        let cached = Arc::new(CachedTable::open(files, gpu.clone(), CacheConfig::new(96)).unwrap());
        // Each resolve (the host side of a prestage) logged as `resolve
        // <site>`.
        let logged = log.clone();
        let table = Arc::new(hooked(cached, move |_| {
            logged.push(format!("resolve {site}"))
        }));
        let layer = PleLayer::new(&spec, weights, table, MAX_TOKENS, gpu.as_ref()).unwrap();
        sites.push(PleSite::new(layer));
    }
    let cfg = EngineConfig {
        prefill_chunk: 8,
        prefix_cache_bytes: 0,
        ..Default::default()
    };
    Engine::new(gpu.clone(), sites, cfg).unwrap()
}

/// Calls that must never happen while a capture is under way.
const FORBIDDEN_IN_CAPTURE: &[&str] = &[
    "synchronize",
    "event_synchronize",
    "register_host",
    "alloc_host_mapped",
    "alloc",
    "free",
    "copy_h2d",
    "copy_d2h",
    "copy_d2d",
    "memset",
    "copy_d2h_on_stream",
    "load_module",
    "register_host_kernel",
    "create_stream",
    "destroy_stream",
];

/// Check the capture rules over one decode step's log; the number of
/// captures and replays in it.
fn check_step(step: usize, log: &[String]) -> (usize, usize) {
    let mut capturing = false;
    let (mut captures, mut replays) = (0, 0);
    let mut resolved = [false; SITES];
    let mut uploaded = false;
    for (i, call) in log.iter().enumerate() {
        let at = || format!("step {step}, call {i} of {log:#?}");
        match call.as_str() {
            "begin_capture" => {
                assert!(!capturing, "nested capture at {}", at());
                assert!(
                    resolved.iter().all(|&r| r) && uploaded,
                    "a capture before every site's prestage at {}",
                    at()
                );
                capturing = true;
            }
            "end_capture" => {
                assert!(capturing, "end_capture without a capture at {}", at());
                capturing = false;
                captures += 1;
            }
            "launch_graph" => {
                assert!(!capturing, "a replay inside a capture at {}", at());
                assert!(
                    resolved.iter().all(|&r| r) && uploaded,
                    "a replay before every site's prestage at {}",
                    at()
                );
                replays += 1;
            }
            "copy_h2d_async" if !capturing => uploaded = true,
            c if c.starts_with("resolve ") => {
                assert!(!capturing, "a table resolve under capture at {}", at());
                assert_eq!(replays, 0, "a resolve after the replay at {}", at());
                let site: usize = c["resolve ".len()..].parse().unwrap();
                resolved[site] = true;
            }
            c if capturing && FORBIDDEN_IN_CAPTURE.contains(&c) => {
                panic!("'{c}' while a capture is under way at {}", at());
            }
            _ => {}
        }
    }
    assert!(!capturing, "step {step} left a capture open");
    (captures, replays)
}

/// Prefill each prompt into a new sequence; their ids.
fn add_all(e: &mut Engine<PleSite>, prompts: &[Vec<u32>]) -> Vec<SeqId> {
    let w = e.width();
    prompts
        .iter()
        .map(|p| {
            let id = e.add_sequence(p).unwrap().id;
            let mut hw = rows_for(p, 0, p.len(), w);
            e.prefill(id, p, &mut hw).unwrap();
            id
        })
        .collect()
}

#[test]
fn decode_graphs_prestage_before_replay_and_never_synchronise_under_capture() {
    let dir = tempfile::tempdir().unwrap();
    let log = Arc::new(Log::default());
    let gpu: Arc<dyn GpuBackend> = Arc::new(Recording::new(log.clone(), false));
    let plain_log = Arc::new(Log::default());
    let plain: Arc<dyn GpuBackend> = Arc::new(CpuBackend::new());
    let mut graphs = engine(&gpu, dir.path(), &log);
    graphs.enable_decode_graphs().unwrap();
    let mut eager = engine(&plain, dir.path(), &plain_log);

    let prompts: Vec<Vec<u32>> = (0..5u32)
        .map(|s| (0..3 + s).map(|i| 7 + 13 * s + 5 * i).collect())
        .collect();
    let ids = add_all(&mut graphs, &prompts);
    let ids_eager = add_all(&mut eager, &prompts);
    let mut hist = prompts.clone();
    let w = graphs.width();
    let (mut captures, mut replays) = (0, 0);
    for step in 0..12usize {
        // Batches of 5, 3 and 1 sequences: padded sizes 8, 4 and 1.
        let n = [5, 3, 1][step % 3];
        let next: Vec<u32> = (0..n)
            .map(|i| (31 * step + 17 * i + 3) as u32 % 900)
            .collect();
        let mut hw = Vec::new();
        for (h, &t) in hist.iter().zip(&next) {
            let mut all = h.clone();
            all.push(t);
            hw.extend(rows_for(&all, all.len() - 1, all.len(), w));
        }
        let mut hw_eager = hw.clone();
        log.take();
        let batch: Vec<(SeqId, u32)> = ids.iter().copied().zip(next.iter().copied()).collect();
        graphs.decode(&batch, &mut hw).unwrap();
        let (c, r) = check_step(step, &log.take());
        captures += c;
        replays += r;
        assert_eq!(r, 1, "step {step}: one replay per batched step");
        let batch: Vec<(SeqId, u32)> = ids_eager
            .iter()
            .copied()
            .zip(next.iter().copied())
            .collect();
        eager.decode(&batch, &mut hw_eager).unwrap();
        assert!(
            metrale_testkit::same_bits(&hw, &hw_eager),
            "step {step}: the replayed step differs from the eager one"
        );
        for (h, &t) in hist.iter_mut().zip(&next) {
            h.push(t);
        }
    }
    assert_eq!(captures, 3, "one capture per padded batch size");
    assert_eq!(replays, 12);
    let s = graphs.stats();
    assert_eq!((s.graph_captures, s.graph_replays), (3, 12));
    graphs.close().unwrap();
    eager.close().unwrap();
}

/// The checker itself: a clean step passes, and each kind of violation is
/// caught.
#[test]
fn the_checker_catches_each_violation() {
    let step = |calls: &[&str]| -> Vec<String> { calls.iter().map(|c| c.to_string()).collect() };
    let clean = [
        "resolve 0",
        "resolve 1",
        "copy_h2d_async",
        "begin_capture",
        "launch_kernel",
        "record_event",
        "end_capture",
        "launch_graph",
    ];
    assert_eq!(check_step(0, &step(&clean)), (1, 1));
    let bad: [&[&str]; 5] = [
        // A synchronize under capture.
        &[
            "resolve 0",
            "resolve 1",
            "copy_h2d_async",
            "begin_capture",
            "synchronize",
            "end_capture",
            "launch_graph",
        ],
        // Host memory registered under capture.
        &[
            "resolve 0",
            "resolve 1",
            "copy_h2d_async",
            "begin_capture",
            "register_host",
            "end_capture",
            "launch_graph",
        ],
        // A prestage (resolve) under capture.
        &[
            "resolve 0",
            "copy_h2d_async",
            "begin_capture",
            "resolve 1",
            "end_capture",
            "launch_graph",
        ],
        // A replay before the prestage of site 1.
        &["resolve 0", "copy_h2d_async", "launch_graph", "resolve 1"],
        // A capture left open.
        &["resolve 0", "resolve 1", "copy_h2d_async", "begin_capture"],
    ];
    for (i, calls) in bad.iter().enumerate() {
        let log = step(calls);
        let caught = std::panic::catch_unwind(|| check_step(i, &log)).is_err();
        assert!(caught, "violation {i} not caught: {calls:?}");
    }
}

/// Layers on a backend without host kernels take the device path: the
/// kernels are resolved as device code (the CPU kernels stand in under the
/// same names) and launched with GPU shapes, which stay within CUDA's limits
/// and keep the outputs bit-identical to the host shapes, eager and through
/// decode graphs.
#[test]
fn layers_without_host_kernels_launch_with_device_shapes() {
    let dir = tempfile::tempdir().unwrap();
    let rec = Arc::new(Recording::new(Arc::new(Log::default()), true));
    let gpu: Arc<dyn GpuBackend> = rec.clone();
    let plain: Arc<dyn GpuBackend> = Arc::new(CpuBackend::new());
    let plain_log = Arc::new(Log::default());
    let mut shaped = engine(&gpu, dir.path(), &Arc::new(Log::default()));
    shaped.enable_decode_graphs().unwrap();
    let mut eager = engine(&plain, dir.path(), &plain_log);
    let prompts: Vec<Vec<u32>> = (0..6u32)
        .map(|s| (0..2 + 3 * s).map(|i| 11 + 17 * s + 3 * i).collect())
        .collect();
    let w = shaped.width();
    let mut outs = [Vec::new(), Vec::new()];
    for (e, out) in [&mut shaped, &mut eager].into_iter().zip(&mut outs) {
        let ids = add_all(e, &prompts);
        for p in &prompts {
            // The prefill rows again, through a second sequence each, so
            // they are part of the output too.
            let id = e.add_sequence(p).unwrap().id;
            let mut hw = rows_for(p, 0, p.len(), w);
            e.prefill(id, p, &mut hw).unwrap();
            out.extend(hw);
            e.release(id).unwrap();
        }
        for step in 0..5u32 {
            let n = [6, 3, 1, 5, 2][step as usize];
            let batch: Vec<(SeqId, u32)> = ids[..n]
                .iter()
                .enumerate()
                .map(|(i, &id)| (id, 5 + 29 * step + 7 * i as u32))
                .collect();
            let mut hw: Vec<f32> = (0..n * w).map(|i| (i % 13) as f32 * 0.125 - 0.75).collect();
            e.decode(&batch, &mut hw).unwrap();
            out.extend(hw);
        }
    }
    assert!(
        outs[0].len() == outs[1].len() && metrale_testkit::same_bits(&outs[0], &outs[1]),
        "device-shaped launches changed the outputs"
    );
    assert!(shaped.stats().graph_replays >= 5);
    shaped.close().unwrap();
    eager.close().unwrap();
    let bad = rec.bad_launches.lock().unwrap();
    assert!(bad.is_empty(), "{bad:#?}");
    assert!(
        rec.shaped_launches
            .load(std::sync::atomic::Ordering::Relaxed)
            > 50,
        "the layers did not shape their launches for a device"
    );
}
