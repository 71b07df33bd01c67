//! A compute backbone around the PLE sites: for every layer of the model,
//! GEMMs standing in for its attention and MLP, run on the backend over the
//! current rows, with each PLE site at its place among them. It gives the
//! row reads a site's table starts at the beginning of a step (see
//! [`crate::server`]) something to hide behind, as the layers before a
//! site do in a real model.
//!
//! One block (one model layer) over `T` rows of the highway (`W = hc *
//! hidden` values each), with `d = W / scale` and `I = 8d / 3` (the usual
//! gated-MLP width), both rounded up to a multiple of 16:
//! `qkv [T, 2d] = highway @ Wqkv^T`, `o [T, d] = qkv @ Wo^T` (the attention
//! stand-in: its projections, not the attention over a KV cache),
//! `up [T, 2I] = o @ Wup^T`, `act = silu(up[:, :I]) * up[:, I:]`,
//! `down [T, d] = act @ Wdown^T`. At `scale` 1 that is `8 W^2 + 6 W I`
//! multiply-adds per token per layer, as a block of that width with
//! multi-head attention; `scale` shrinks it so that a small CPU still runs
//! it. The GEMMs are the PLE module's BF16 `project` (model-layers' GEMM on
//! the CPU backend, `ple.cu` on a device); the activation is
//! `kernels/backbone.cu` on a device and a host kernel on the CPU backend.
//!
//! Invariants:
//! - the backbone reads the highway and writes only its own scratch, so it
//!   changes no output bit: an engine with it gives the highway an engine
//!   without it gives;
//! - every block shares one set of weights (seeded, uniform in
//!   `±sqrt(3 / E)` so values stay near unit scale): the compute per layer
//!   is a real block's, the weight memory one block's;
//! - site `k` (model layer `l_k`, 1-based) runs at the input of its layer:
//!   after the blocks of layers `l_{k-1}..l_k - 1` (from layer 1 for the
//!   first site), and the last site's wrapper runs the blocks of layers
//!   `l_last..=layers` after it;
//! - the weights and scratch are freed when the last [`Layered`] site over
//!   them is freed;
//! - each wait of a site's forward for table rows is filed once, as
//!   covered (an event recorded after the blocks before the site was still
//!   pending when the site's host work ended: the backend never idled for
//!   it) or exposed ([`Layered::wait_split`]).
//!
//! Why one long file: the blocks, the weights they share and the wait
//! accounting are one schedule around the sites; about a tenth of it is
//! tests of that schedule.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use metrale_gpu_runtime::gpu::{
    DevicePtr, GpuBackend, GpuError, HostMemory, KernelHandle, LaunchConfig, StreamId,
};
use metrale_gpu_runtime::{compile_source, kernel_args};
use metrale_model_layers::layers::ple::ModelSpec;
use metrale_model_layers::layers::ple::device_kernels::{LaunchShapes, load_ple_module};
use metrale_model_layers::layers::ple::kernels::args::ProjectArgs;
use metrale_model_layers::layers::ple::kernels::{self, pack_projection};
use thiserror::Error;

use crate::engine::{Site, SiteResult};
use crate::wrap::{DeviceWork, RunKind, SiteWrap, Wrapped};

/// The CUDA C++ source of the backbone's own kernel.
pub const BACKBONE_CU: &str = include_str!("../kernels/backbone.cu");

/// The kernel module of the backbone's own kernel.
pub const MODULE: &str = "backbone";

/// What the backbone is built from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BackboneConfig {
    /// Layers of the model (`num_hidden_layers`).
    pub layers: usize,
    /// The 1-based layer of each site, in site order (`ple_layer_ids`).
    pub site_layers: Vec<usize>,
    /// Widths are divided by this (at least 1): 1 is a block of the model's
    /// width.
    pub scale: usize,
}

impl BackboneConfig {
    /// The backbone of `spec`'s layers at `scale`.
    pub fn for_model(spec: &ModelSpec, scale: usize) -> Self {
        BackboneConfig {
            layers: spec.num_hidden_layers,
            site_layers: spec.ple_layer_ids.clone(),
            scale,
        }
    }
}

/// Why a backbone could not be built.
#[derive(Debug, Error)]
#[non_exhaustive]
pub enum BackboneError {
    /// The layers, the sites' places or the scale do not fit together.
    #[error("backbone config: {0}")]
    Config(String),
    /// A backend call failed.
    #[error("backbone: {what}")]
    Device {
        /// What was being done.
        what: String,
        /// The backend's error.
        #[source]
        source: GpuError,
    },
}

fn device(what: impl Into<String>) -> impl FnOnce(GpuError) -> BackboneError {
    let what = what.into();
    move |source| BackboneError::Device { what, source }
}

/// The widths of one block.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BlockShape {
    /// The highway width the first GEMM reads.
    pub width: usize,
    /// `d`: the block's model width.
    pub model: usize,
    /// `I`: the MLP's intermediate width.
    pub intermediate: usize,
}

impl BlockShape {
    /// The shape for a highway of `width` values at `scale`.
    pub fn new(width: usize, scale: usize) -> Self {
        let model = (width / scale.max(1)).max(1).next_multiple_of(16);
        let intermediate = (model * 8).div_ceil(3).next_multiple_of(16);
        BlockShape {
            width,
            model,
            intermediate,
        }
    }

    /// `(O, E)` of the four GEMMs, in order.
    fn gemms(&self) -> [(usize, usize); 4] {
        let (w, d, i) = (self.width, self.model, self.intermediate);
        [(2 * d, w), (d, 2 * d), (2 * i, d), (d, i)]
    }

    /// Multiply-adds of one block per token.
    pub fn macs_per_token(&self) -> u64 {
        self.gemms().iter().map(|&(o, e)| (o * e) as u64).sum()
    }
}

/// Device buffers of a backbone.
#[derive(Clone, Copy, Debug)]
struct Bufs {
    w: [DevicePtr; 4],
    qkv: DevicePtr,
    o: DevicePtr,
    up: DevicePtr,
    act: DevicePtr,
    down: DevicePtr,
}

impl Bufs {
    fn all(&self) -> impl Iterator<Item = DevicePtr> + '_ {
        self.w
            .iter()
            .copied()
            .chain([self.qkv, self.o, self.up, self.act, self.down])
    }
}

/// The weights, scratch and kernels of the blocks, shared by every
/// [`Layered`] site of one engine. See the module docs.
pub struct Backbone {
    shape: BlockShape,
    max_rows: usize,
    shapes: LaunchShapes,
    project: KernelHandle,
    silu_mul: KernelHandle,
    bufs: Mutex<Option<Bufs>>,
    /// Live [`Layered`] sites over it; the last one to be freed frees it.
    users: AtomicUsize,
}

impl std::fmt::Debug for Backbone {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Backbone")
            .field("shape", &self.shape)
            .field("max_rows", &self.max_rows)
            .finish()
    }
}

kernel_args! {
    /// `silu_mul`: `act [t, inter] = silu(up[:, :inter]) * up[:, inter:]`
    /// for `up [t, 2 * inter]`.
    pub struct SiluMulArgs {
        /// The up projection's rows.
        pub up: DevicePtr as "const float*",
        /// The activation rows.
        pub act: DevicePtr as "float*",
        /// Rows.
        pub t: u32,
        /// Activation values per row.
        pub inter: u32,
    }
}

/// `silu_mul` on the host.
fn silu_mul_host(
    mem: &dyn HostMemory,
    _cfg: &LaunchConfig,
    a: SiluMulArgs,
) -> Result<(), GpuError> {
    let (t, i) = (a.t as usize, a.inter as usize);
    // SAFETY: `act` and `up` are distinct allocations of the backbone (the
    // only caller), so the writable view overlaps no other.
    let (ups, acts) = unsafe {
        (
            mem.slice::<f32>(a.up, t * 2 * i)?,
            mem.slice_mut::<f32>(a.act, t * i)?,
        )
    };
    for (row, out) in ups.chunks_exact(2 * i).zip(acts.chunks_exact_mut(i)) {
        let (g, u) = row.split_at(i);
        for ((o, &g), &u) in out.iter_mut().zip(g).zip(u) {
            *o = g / (1.0 + (-g).exp()) * u;
        }
    }
    Ok(())
}

/// Make the kernels the backbone launches resolvable on `gpu`.
fn load_kernels(gpu: &dyn GpuBackend) -> Result<(KernelHandle, KernelHandle), BackboneError> {
    if gpu.supports_host_kernels() {
        kernels::register_cpu_kernels(gpu).map_err(device("registering the PLE host kernels"))?;
        if gpu.kernel(MODULE, "silu_mul").is_err() {
            gpu.register_typed_host_kernel(MODULE, "silu_mul", silu_mul_host)
                .map_err(device("registering the silu_mul host kernel"))?;
        }
    } else {
        load_ple_module(gpu).map_err(device("loading the PLE module"))?;
        if gpu.kernel(MODULE, "silu_mul").is_err() {
            let image = compile_source(gpu, "backbone.cu", BACKBONE_CU)
                .map_err(device("compiling backbone.cu"))?;
            gpu.load_module(MODULE, &image)
                .map_err(device("loading backbone.cu"))?;
        }
    }
    let project = gpu
        .kernel(kernels::MODULE, "project")
        .map_err(device("resolving the PLE project kernel"))?;
    let silu_mul = gpu
        .kernel(MODULE, "silu_mul")
        .map_err(device("resolving the silu_mul kernel"))?;
    Ok((project, silu_mul))
}

/// A row-major `[o, e]` BF16 weight, uniform in `±sqrt(3 / e)`, from `seed`.
fn weight(o: usize, e: usize, seed: u64) -> Vec<u16> {
    let a = (3.0 / e as f64).sqrt();
    let mut s = seed;
    (0..o * e)
        .map(|_| {
            s = s.wrapping_add(0x9E37_79B9_7F4A_7C15);
            let mut z = s;
            z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
            z ^= z >> 31;
            let u = (z >> 11) as f64 / (1u64 << 53) as f64;
            let v = ((u * 2.0 - 1.0) * a) as f32;
            (v.to_bits() >> 16) as u16
        })
        .collect()
}

impl Backbone {
    /// Weights and scratch for blocks over up to `max_rows` rows of a
    /// highway of `width` values, at `scale`.
    pub fn new(
        gpu: &dyn GpuBackend,
        width: usize,
        scale: usize,
        max_rows: usize,
    ) -> Result<Backbone, BackboneError> {
        if scale == 0 || width == 0 || max_rows == 0 {
            return Err(BackboneError::Config(format!(
                "scale ({scale}), highway width ({width}) and rows ({max_rows}) must be positive"
            )));
        }
        let shape = BlockShape::new(width, scale);
        let (project, silu_mul) = load_kernels(gpu)?;
        let mut held: Vec<DevicePtr> = Vec::new();
        let r = Self::alloc_all(gpu, &shape, max_rows, &mut held);
        let bufs = match r {
            Ok(b) => b,
            Err(e) => {
                for p in held {
                    let _ = gpu.dealloc(p);
                }
                return Err(e);
            }
        };
        Ok(Backbone {
            shape,
            max_rows,
            shapes: LaunchShapes::for_backend(gpu),
            project,
            silu_mul,
            bufs: Mutex::new(Some(bufs)),
            users: AtomicUsize::new(0),
        })
    }

    fn alloc_all(
        gpu: &dyn GpuBackend,
        shape: &BlockShape,
        rows: usize,
        held: &mut Vec<DevicePtr>,
    ) -> Result<Bufs, BackboneError> {
        let mut alloc = |bytes: usize, label: &str| -> Result<DevicePtr, BackboneError> {
            let p = gpu
                .alloc(bytes, label)
                .map_err(device(format!("allocating {bytes} bytes for {label}")))?;
            held.push(p);
            Ok(p)
        };
        let mut w = [DevicePtr::NULL; 4];
        for (k, &(o, e)) in shape.gemms().iter().enumerate() {
            let packed = pack_projection(&weight(o, e, 0xBAC0 + k as u64), o, e);
            let bytes: Vec<u8> = packed.iter().flat_map(|v| v.to_ne_bytes()).collect();
            w[k] = alloc(bytes.len(), "backbone weight")?;
            gpu.copy_h2d(&bytes, w[k])
                .map_err(device("uploading a backbone weight"))?;
        }
        let (d, i) = (shape.model, shape.intermediate);
        Ok(Bufs {
            w,
            qkv: alloc(rows * 2 * d * 4, "backbone qkv")?,
            o: alloc(rows * d * 4, "backbone attention out")?,
            up: alloc(rows * 2 * i * 4, "backbone mlp up")?,
            act: alloc(rows * i * 4, "backbone mlp act")?,
            down: alloc(rows * d * 4, "backbone mlp down")?,
        })
    }

    /// The widths of one block.
    pub fn shape(&self) -> BlockShape {
        self.shape
    }

    /// The most rows one call takes.
    pub fn max_rows(&self) -> usize {
        self.max_rows
    }

    /// Queue `blocks` blocks over the `rows` rows at `highway` on `stream`.
    pub fn run(
        &self,
        blocks: usize,
        highway: DevicePtr,
        rows: usize,
        gpu: &dyn GpuBackend,
        stream: StreamId,
    ) -> Result<(), GpuError> {
        if blocks == 0 || rows == 0 {
            return Ok(());
        }
        if rows > self.max_rows {
            return Err(GpuError::invalid(
                "backbone block",
                format!("{rows} rows, the scratch holds {}", self.max_rows),
            ));
        }
        let Some(b) = *self.bufs.lock().unwrap_or_else(PoisonError::into_inner) else {
            return Err(GpuError::invalid(
                "backbone block",
                "the backbone was freed",
            ));
        };
        let (d, i) = (self.shape.model, self.shape.intermediate);
        let gemm = |x: DevicePtr, w: DevicePtr, y: DevicePtr, e: usize, o: usize| {
            let a = ProjectArgs {
                x,
                w,
                y,
                t: rows as u32,
                e: e as u32,
                o: o as u32,
            };
            gpu.launch(self.project, self.shapes.project(rows, o))
                .args(&a)
                .run(stream)
        };
        let act_cfg = match self.shapes {
            LaunchShapes::Host => LaunchConfig::linear(1, 1),
            LaunchShapes::Device => LaunchConfig::linear(
                ((rows * i) as u64).div_ceil(256).clamp(1, 1 << 16) as u32,
                256,
            ),
        };
        for _ in 0..blocks {
            gemm(highway, b.w[0], b.qkv, self.shape.width, 2 * d)?;
            gemm(b.qkv, b.w[1], b.o, 2 * d, d)?;
            gemm(b.o, b.w[2], b.up, d, 2 * i)?;
            let a = SiluMulArgs {
                up: b.up,
                act: b.act,
                t: rows as u32,
                inter: i as u32,
            };
            gpu.launch(self.silu_mul, act_cfg).args(&a).run(stream)?;
            gemm(b.act, b.w[3], b.down, i, d)?;
        }
        Ok(())
    }

    /// Free the weights and scratch. Idempotent.
    fn free(&self, gpu: &dyn GpuBackend) -> Result<(), GpuError> {
        let Some(b) = self
            .bufs
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take()
        else {
            return Ok(());
        };
        let mut first = Ok(());
        for p in b.all() {
            let r = gpu.dealloc(p);
            if first.is_ok() {
                first = r;
            }
        }
        first
    }
}

/// The backbone's part of a [`Layered`] site: the blocks it runs before
/// the site's forwards (and, for the last site, after them), and the
/// accounting of its waits. Without a backbone it changes nothing.
pub struct Blocks {
    before: usize,
    after: usize,
    backbone: Option<Arc<Backbone>>,
    freed: bool,
    /// Row waits of this site's forwards while the backend was still
    /// running the blocks queued before the site, in nanoseconds.
    wait_covered_ns: AtomicU64,
    /// The other row waits: the backend may have run dry during them.
    wait_exposed_ns: AtomicU64,
    /// Host time of the wrapped site's eager forwards (hashing, resolving
    /// rows and waiting for them, queueing kernels), in nanoseconds.
    host_ns: AtomicU64,
}

/// A site with the backbone blocks that run before it (and, for the last
/// site, after it): the site wrapped with its [`Blocks`]. Without a
/// backbone it is the site itself. See the module docs.
pub type Layered<S> = Wrapped<S, Blocks>;

/// How a site's waits for table rows fell against the backend's work.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct WaitSplit {
    /// Waits during which the backend was still running the blocks queued
    /// before the site (its event was still pending when the site's host
    /// work ended): the device never idled for them.
    pub covered: Duration,
    /// The rest (every wait without blocks before the site): at most this
    /// much of the wait left the backend idle.
    pub exposed: Duration,
}

impl<S> Wrapped<S, Blocks> {
    /// Blocks run before the site and after it.
    pub fn blocks(&self) -> (usize, usize) {
        (self.wrap().before, self.wrap().after)
    }

    /// The shared backbone, if any.
    pub fn backbone(&self) -> Option<&Arc<Backbone>> {
        self.wrap().backbone.as_ref()
    }

    /// The site's waits for rows so far, split by whether the blocks before
    /// it covered them (see [`WaitSplit`]). Forwards replayed from a graph
    /// resolve nothing and are not counted.
    pub fn wait_split(&self) -> WaitSplit {
        let w = self.wrap();
        WaitSplit {
            covered: Duration::from_nanos(w.wait_covered_ns.load(Ordering::Relaxed)),
            exposed: Duration::from_nanos(w.wait_exposed_ns.load(Ordering::Relaxed)),
        }
    }

    /// Host time of the site's eager forwards so far (hashing, resolving
    /// rows, waiting for them and queueing the kernels; without the blocks).
    /// Forwards replayed from a graph are not counted.
    pub fn host_time(&self) -> Duration {
        Duration::from_nanos(self.wrap().host_ns.load(Ordering::Relaxed))
    }
}

impl Blocks {
    fn new(before: usize, after: usize, backbone: Option<Arc<Backbone>>) -> Self {
        if let Some(b) = &backbone {
            b.users.fetch_add(1, Ordering::AcqRel);
        }
        Blocks {
            before,
            after,
            backbone,
            freed: false,
            wait_covered_ns: AtomicU64::new(0),
            wait_exposed_ns: AtomicU64::new(0),
            host_ns: AtomicU64::new(0),
        }
    }

    fn blocks_around(&self, n: usize, w: &DeviceWork<'_>) -> SiteResult<()> {
        if let Some(b) = &self.backbone {
            b.run(n, w.highway, w.rows, w.gpu, w.stream)?;
        }
        Ok(())
    }

    /// Queue the blocks before the site, run `site` (the wrapped site's
    /// host work: hashing, resolving rows, queueing its kernels), file the
    /// time it waited for rows as covered when the blocks were still
    /// running when it returned, else as exposed, and queue the blocks
    /// after the site.
    fn measured<S: Site>(
        &self,
        inner: &S,
        w: &DeviceWork<'_>,
        site: impl FnOnce() -> SiteResult<()>,
    ) -> SiteResult<()> {
        let (gpu, stream) = (w.gpu, w.stream);
        self.blocks_around(self.before, w)?;
        // An event after the blocks tells whether they were still running;
        // without one (no blocks, or the backend refused it) every wait
        // counts as exposed.
        let ev = if self.before > 0 && self.backbone.is_some() {
            gpu.create_event().ok().and_then(|e| {
                if gpu.record_event(e, stream).is_ok() {
                    Some(e)
                } else {
                    let _ = gpu.destroy_event(e);
                    None
                }
            })
        } else {
            None
        };
        let w0 = inner.table_stats().io_wait_ns;
        let t0 = std::time::Instant::now();
        let r = site();
        self.host_ns
            .fetch_add(t0.elapsed().as_nanos() as u64, Ordering::Relaxed);
        let waited = inner.table_stats().io_wait_ns.saturating_sub(w0);
        let covered = match ev {
            Some(e) => {
                let done = gpu.event_query(e).unwrap_or(true);
                let _ = gpu.destroy_event(e);
                !done
            }
            None => false,
        };
        let counter = if covered {
            &self.wait_covered_ns
        } else {
            &self.wait_exposed_ns
        };
        counter.fetch_add(waited, Ordering::Relaxed);
        r?;
        self.blocks_around(self.after, w)
    }
}

impl<S: Site> SiteWrap<S> for Blocks {
    fn around(
        &self,
        inner: &S,
        work: DeviceWork<'_>,
        run: impl FnOnce() -> SiteResult<()>,
    ) -> SiteResult<()> {
        match work.kind {
            RunKind::Run | RunKind::RunBatch => self.measured(inner, &work, run),
            // A prestaged forward resolves nothing (its host half did), so
            // there is no wait to file: only the blocks around it.
            RunKind::Prestaged => {
                self.blocks_around(self.before, &work)?;
                run()?;
                self.blocks_around(self.after, &work)
            }
        }
    }

    fn max_tokens(&self, inner: usize) -> usize {
        match &self.backbone {
            Some(b) => inner.min(b.max_rows()),
            None => inner,
        }
    }

    fn free(&mut self, gpu: &dyn GpuBackend) -> SiteResult<()> {
        if !self.freed {
            self.freed = true;
            if let Some(b) = &self.backbone
                && b.users.fetch_sub(1, Ordering::AcqRel) == 1
            {
                b.free(gpu)?;
            }
        }
        Ok(())
    }
}

/// Wrap `sites` with the blocks of `cfg` (none when `cfg` is `None`), for
/// forwards of up to `max_rows` rows. On an error every site is freed.
pub fn layered<S: Site>(
    gpu: &dyn GpuBackend,
    mut sites: Vec<S>,
    cfg: Option<&BackboneConfig>,
    max_rows: usize,
) -> Result<Vec<Layered<S>>, BackboneError> {
    let plan = match cfg {
        None => Ok(None),
        Some(c) => plan(c, &sites, max_rows, gpu).map(Some),
    };
    let plan = match plan {
        Ok(p) => p,
        Err(e) => {
            for s in &mut sites {
                let _ = s.free(gpu);
            }
            return Err(e);
        }
    };
    let n = sites.len();
    Ok(sites
        .into_iter()
        .enumerate()
        .map(|(k, inner)| match &plan {
            None => Wrapped::new(inner, Blocks::new(0, 0, None)),
            Some((bb, cuts, layers)) => {
                let prev = if k == 0 { 1 } else { cuts[k - 1] };
                let after = if k + 1 == n { layers + 1 - cuts[k] } else { 0 };
                Wrapped::new(inner, Blocks::new(cuts[k] - prev, after, Some(bb.clone())))
            }
        })
        .collect())
}

/// The backbone and each site's layer, checked.
fn plan<S: Site>(
    c: &BackboneConfig,
    sites: &[S],
    max_rows: usize,
    gpu: &dyn GpuBackend,
) -> Result<(Arc<Backbone>, Vec<usize>, usize), BackboneError> {
    if c.site_layers.len() != sites.len() {
        return Err(BackboneError::Config(format!(
            "{} site layers for {} sites",
            c.site_layers.len(),
            sites.len()
        )));
    }
    let mut prev = 0;
    for &l in &c.site_layers {
        if l <= prev || l > c.layers {
            return Err(BackboneError::Config(format!(
                "site layers {:?} must increase within 1..={} (the model's layers)",
                c.site_layers, c.layers
            )));
        }
        prev = l;
    }
    let width = sites
        .first()
        .map(|s| {
            let g = s.geometry();
            g.hc_mult * g.hidden
        })
        .unwrap_or(0);
    let bb = Backbone::new(gpu, width, c.scale, max_rows)?;
    Ok((Arc::new(bb), c.site_layers.clone(), c.layers))
}

#[cfg(test)]
mod tests {
    use super::*;
    use metrale_gpu_runtime::cpu::CpuBackend;

    #[test]
    fn backbone_cu_declares_the_struct_and_its_kernel_takes_it() {
        use metrale_gpu_runtime::args::ArgsInfo;
        use metrale_model_layers::layers::ple::kernels::args::{
            REWRITE_VAR, check_block, cuda_block,
        };
        let info = ArgsInfo::of::<SiluMulArgs>();
        assert!(info.has_c_layout());
        let path = concat!(env!("CARGO_MANIFEST_DIR"), "/kernels/backbone.cu");
        let rewrite = std::env::var_os(REWRITE_VAR).is_some();
        if let Err(e) = check_block(path, BACKBONE_CU, &cuda_block([info]), rewrite) {
            panic!("{e}");
        }
        assert!(BACKBONE_CU.contains("extern \"C\" __global__ void silu_mul(SiluMulArgs a)"));
    }

    #[test]
    fn widths_round_up() {
        let s = BlockShape::new(10240, 8);
        assert_eq!((s.model, s.intermediate), (1280, 3424));
        assert_eq!(
            s.macs_per_token(),
            2560 * 10240 + 1280 * 2560 + 6848 * 1280 + 1280 * 3424
        );
        let tiny = BlockShape::new(40, 100);
        assert_eq!((tiny.model, tiny.intermediate), (16, 48));
    }

    #[test]
    fn silu_mul_gates_the_up_half_with_the_other() {
        let cpu = CpuBackend::new();
        let gpu: &dyn GpuBackend = &cpu;
        let (_, silu) = load_kernels(gpu).unwrap();
        let (t, i) = (2usize, 3usize);
        let up: Vec<f32> = (0..t * 2 * i).map(|k| k as f32 * 0.5 - 2.0).collect();
        let up_p = gpu.alloc(up.len() * 4, "up").unwrap();
        let act_p = gpu.alloc(t * i * 4, "act").unwrap();
        let bytes: Vec<u8> = up.iter().flat_map(|v| v.to_ne_bytes()).collect();
        gpu.copy_h2d(&bytes, up_p).unwrap();
        let s = gpu.default_stream();
        let a = SiluMulArgs {
            up: up_p,
            act: act_p,
            t: t as u32,
            inter: i as u32,
        };
        gpu.launch(silu, LaunchConfig::linear(1, 1))
            .args(&a)
            .run(s)
            .unwrap();
        gpu.synchronize(s).unwrap();
        let mut out = vec![0u8; t * i * 4];
        gpu.copy_d2h(act_p, &mut out).unwrap();
        for (k, c) in out.chunks_exact(4).enumerate() {
            let got = f32::from_ne_bytes([c[0], c[1], c[2], c[3]]);
            let (row, col) = (k / i, k % i);
            let g = up[row * 2 * i + col];
            let u = up[row * 2 * i + i + col];
            assert_eq!(got, g / (1.0 + (-g).exp()) * u, "output {k}");
        }
        gpu.dealloc(up_p).unwrap();
        gpu.dealloc(act_p).unwrap();
    }

    #[test]
    fn blocks_refuse_more_rows_than_the_scratch_and_run_after_free_is_refused() {
        let cpu = CpuBackend::new();
        let gpu: &dyn GpuBackend = &cpu;
        let base = gpu.live_alloc_count();
        let b = Backbone::new(gpu, 64, 2, 4).unwrap();
        let hw = gpu.alloc(8 * 64 * 4, "highway").unwrap();
        let s = gpu.default_stream();
        b.run(2, hw, 4, gpu, s).unwrap();
        gpu.synchronize(s).unwrap();
        assert!(b.run(1, hw, 5, gpu, s).is_err());
        b.free(gpu).unwrap();
        b.free(gpu).unwrap();
        assert!(b.run(1, hw, 1, gpu, s).is_err());
        gpu.dealloc(hw).unwrap();
        assert_eq!(gpu.live_alloc_count(), base, "{}", gpu.live_report());
    }
}
