//! The host-kernel wrappers: each takes its kernel's argument struct
//! (`args.rs`), turns its pointers into checked slices of backend memory and
//! calls the pure kernel function.
//!
//! Invariants: every pointer range is checked against the backend's ledger
//! (through `HostMemory`) before use; a writable range may not overlap any
//! other range of the same launch (so the slices handed to the pure
//! functions never alias); all checks run before the first write, so a
//! refused launch leaves memory untouched.

use std::fmt::Display;

use metrale_gpu_runtime::gpu::{DevicePtr, GpuError, HostMemory, LaunchConfig};

use super::args::{
    BiasAddArgs, ConvArgs, ConvBatchArgs, GateArgs, GateNormsArgs, GatherArgs, GatherRunsArgs,
    HighwayAddArgs, MeanAddArgs, ProjectArgs, ProjectRangeArgs,
};
use super::combine::{bias_add, highway_add, mean_add};
use super::conv::{ConvDims, conv, conv_batch};
use super::gate::{GateDims, GateInputs, GateNorms, gate, gate_norms};
use super::gather::{GatherDType, RowSrc, gather_rows};
use super::gemm::{Steps, packed_len, project_range};

/// What a kernel body returns: failures are [`GpuError::Kernel`] messages.
type Result<T, E = GpuError> = std::result::Result<T, E>;

/// Return a [`GpuError::kernel`] error built from a format string.
macro_rules! bail {
    ($($t:tt)*) => {
        return Err(GpuError::kernel(format!($($t)*)))
    };
}

/// [`bail!`] unless the condition holds.
macro_rules! ensure {
    ($cond:expr, $($t:tt)*) => {
        if !$cond {
            bail!($($t)*);
        }
    };
}

/// Prefix an error with what the kernel was doing, as a kernel error whose
/// message keeps the whole cause chain.
trait KernelContext<T> {
    fn context(self, what: impl Display) -> Result<T>;
    fn with_context<D: Display>(self, what: impl FnOnce() -> D) -> Result<T>;
}

impl<T, E: Display> KernelContext<T> for std::result::Result<T, E> {
    fn context(self, what: impl Display) -> Result<T> {
        self.map_err(|e| GpuError::kernel(format!("{what}: {e:#}")))
    }
    fn with_context<D: Display>(self, what: impl FnOnce() -> D) -> Result<T> {
        self.map_err(|e| GpuError::kernel(format!("{}: {e:#}", what())))
    }
}

/// A byte range one launch reads or writes.
struct Region {
    name: String,
    ptr: DevicePtr,
    bytes: usize,
    write: bool,
}

impl Region {
    fn new(name: impl Into<String>, ptr: DevicePtr, bytes: usize, write: bool) -> Self {
        Region {
            name: name.into(),
            ptr,
            bytes,
            write,
        }
    }

    fn overlaps(&self, o: &Region) -> bool {
        self.bytes > 0
            && o.bytes > 0
            && self.ptr.0 < o.ptr.0.saturating_add(o.bytes as u64)
            && o.ptr.0 < self.ptr.0.saturating_add(self.bytes as u64)
    }
}

/// Refuse a launch where a written range overlaps any other range.
fn check_disjoint(kernel: &str, regions: &[Region]) -> Result<()> {
    for (i, w) in regions.iter().enumerate().filter(|(_, r)| r.write) {
        for (j, o) in regions.iter().enumerate() {
            if i != j && w.overlaps(o) {
                bail!(
                    "{kernel}: {} ({}, {} bytes) overlaps {} ({}, {} bytes)",
                    w.name,
                    w.ptr,
                    w.bytes,
                    o.name,
                    o.ptr,
                    o.bytes
                );
            }
        }
    }
    Ok(())
}

/// `a * b * c` in bytes, or an error naming the kernel.
fn size(kernel: &str, what: &str, dims: &[usize]) -> Result<usize> {
    dims.iter()
        .try_fold(1usize, |acc, &d| acc.checked_mul(d))
        .ok_or_else(|| GpuError::kernel(format!("{kernel}: the size of {what} overflows")))
}

/// `len` values of `T` at `ptr`, read-only; empty without touching memory.
///
/// # Safety
/// No writable view of the range may be live (callers run `check_disjoint`).
unsafe fn view<'m, T: Copy>(
    mem: &'m dyn HostMemory,
    ptr: DevicePtr,
    len: usize,
    what: &str,
) -> Result<&'m [T]> {
    if len == 0 {
        return Ok(&[]);
    }
    // SAFETY: forwarded from the caller.
    unsafe { mem.slice::<T>(ptr, len) }.with_context(|| format!("reading {what} at {ptr}"))
}

/// `len` values of `T` at `ptr`, writable; empty without touching memory.
///
/// # Safety
/// No other view of the range may be live (callers run `check_disjoint`).
#[allow(clippy::mut_from_ref)]
unsafe fn view_mut<'m, T: Copy>(
    mem: &'m dyn HostMemory,
    ptr: DevicePtr,
    len: usize,
    what: &str,
) -> Result<&'m mut [T]> {
    if len == 0 {
        return Ok(&mut []);
    }
    // SAFETY: forwarded from the caller.
    unsafe { mem.slice_mut::<T>(ptr, len) }.with_context(|| format!("writing {what} at {ptr}"))
}

/// `gather`: [`GatherArgs`].
pub(super) fn gather_kernel(
    mem: &dyn HostMemory,
    _cfg: &LaunchConfig,
    a: GatherArgs,
) -> Result<()> {
    let n = a.n as usize;
    let rows = GatherRows {
        refs: a.refs,
        n,
        head_dim: a.head_dim as usize,
        dtype: a.dtype,
        out: a.out,
    };
    gather_into(mem, rows, "ple::gather", n.max(1), n.max(1))
}

/// `gather_runs`: [`GatherRunsArgs`].
pub(super) fn gather_runs_kernel(
    mem: &dyn HostMemory,
    _cfg: &LaunchConfig,
    a: GatherRunsArgs,
) -> Result<()> {
    const K: &str = "ple::gather_runs";
    let (run, stride) = (a.run as usize, a.stride as usize);
    ensure!(
        run > 0 && stride >= run,
        "{K}: runs of {run} rows every {stride} rows (need 0 < run <= stride)"
    );
    let rows = GatherRows {
        refs: a.refs,
        n: a.n as usize,
        head_dim: a.head_dim as usize,
        dtype: a.dtype,
        out: a.out,
    };
    gather_into(mem, rows, K, run, stride)
}

/// What the two gathers share.
struct GatherRows {
    refs: DevicePtr,
    n: usize,
    head_dim: usize,
    dtype: u32,
    out: DevicePtr,
}

/// The gathers' body: reference `i` lands on out row `(i / run) * stride +
/// i % run`.
fn gather_into(
    mem: &dyn HostMemory,
    g: GatherRows,
    kernel: &'static str,
    run: usize,
    stride: usize,
) -> Result<()> {
    let GatherRows {
        refs,
        n,
        head_dim,
        out,
        ..
    } = g;
    let dtype = GatherDType::from_arg(g.dtype)?;
    ensure!(head_dim > 0, "{kernel}: head_dim is 0");
    if n == 0 {
        return Ok(());
    }
    // Out rows from the first to the last one written (the gaps between
    // runs are left as they are).
    let span = (n - 1)
        .checked_div(run)
        .and_then(|r| r.checked_mul(stride))
        .and_then(|r| r.checked_add((n - 1) % run + 1))
        .ok_or_else(|| GpuError::kernel(format!("{kernel}: {n} rows in runs overflow")))?;
    ensure!(
        dtype != GatherDType::Fp8E4M3Block32
            || head_dim.is_multiple_of(metrale_storage::dtype::FP8_BLOCK),
        "{kernel}: head_dim {head_dim} is not a multiple of the FP8 block of 32 values"
    );
    let row_bytes = dtype.row_bytes(head_dim);
    let mut regions = vec![
        Region::new("refs", refs, size(kernel, "refs", &[n, 16])?, false),
        Region::new("out", out, size(kernel, "out", &[span, head_dim, 4])?, true),
    ];
    // SAFETY: only `out` is written; it is checked below against `refs`
    // before the mutable view is made, and `refs` is only read.
    let ref_bytes: &[u8] = unsafe { view(mem, refs, n * 16, "the row references")? };
    let mut rows = Vec::with_capacity(n);
    for (i, r) in ref_bytes.chunks_exact(16).enumerate() {
        let data = DevicePtr(u64::from_le_bytes(r[..8].try_into().expect("8 bytes")));
        let scale_ptr = DevicePtr(u64::from_le_bytes(r[8..].try_into().expect("8 bytes")));
        let p = mem
            .host_ptr(data, row_bytes)
            .with_context(|| format!("{kernel}: row {i} data at {data}"))?;
        regions.push(Region::new(format!("row {i}"), data, row_bytes, false));
        let scale = match dtype {
            GatherDType::Bf16 | GatherDType::Fp8E4M3Block32 | GatherDType::F32 => 0.0,
            GatherDType::Fp8E4M3 => {
                ensure!(
                    !scale_ptr.is_null(),
                    "{kernel}: row {i} is FP8 but its scale pointer is null"
                );
                let sp = mem
                    .host_ptr(scale_ptr, 4)
                    .with_context(|| format!("{kernel}: row {i} scale at {scale_ptr}"))?;
                regions.push(Region::new(format!("row {i} scale"), scale_ptr, 4, false));
                // SAFETY: the ledger checked 4 readable bytes at `sp`; the
                // read is unaligned-safe.
                unsafe { (sp as *const f32).read_unaligned() }
            }
        };
        // SAFETY: the ledger checked `row_bytes` readable bytes at `p`; the
        // range is only read, and `check_disjoint` below refuses any
        // overlap with `out` before `out` is viewed mutably.
        let data = unsafe { std::slice::from_raw_parts(p as *const u8, row_bytes) };
        rows.push(RowSrc { data, scale });
    }
    check_disjoint(kernel, &regions)?;
    // SAFETY: `out` overlaps nothing else of this launch (checked above).
    let out: &mut [f32] = unsafe { view_mut(mem, out, span * head_dim, "out")? };
    for (r, part) in rows.chunks(run).enumerate() {
        let at = r * stride * head_dim;
        gather_rows(
            part,
            head_dim,
            dtype,
            &mut out[at..at + part.len() * head_dim],
        )
        .context(kernel)?;
    }
    Ok(())
}

/// `project`: [`ProjectArgs`].
pub(super) fn project_kernel(
    mem: &dyn HostMemory,
    _cfg: &LaunchConfig,
    a: ProjectArgs,
) -> Result<()> {
    project_steps(mem, "ple::project", a, Steps::all(a.e as usize))
}

/// `project_range`: [`ProjectRangeArgs`].
pub(super) fn project_range_kernel(
    mem: &dyn HostMemory,
    _cfg: &LaunchConfig,
    a: ProjectRangeArgs,
) -> Result<()> {
    let steps = Steps {
        from: a.from as usize,
        to: a.to as usize,
        accumulate: a.accumulate != 0,
    };
    let ProjectRangeArgs {
        x, w, y, t, e, o, ..
    } = a;
    project_steps(
        mem,
        "ple::project_range",
        ProjectArgs { x, w, y, t, e, o },
        steps,
    )
}

/// The projections' body, over `steps`.
fn project_steps(
    mem: &dyn HostMemory,
    kernel: &'static str,
    a: ProjectArgs,
    steps: Steps,
) -> Result<()> {
    let (x, w, y) = (a.x, a.w, a.y);
    let (t, e, o) = (a.t as usize, a.e as usize, a.o as usize);
    ensure!(
        e > 0 && o > 0,
        "{kernel}: E = {e} and O = {o} must both be positive"
    );
    if t == 0 {
        return Ok(());
    }
    let wlen = packed_len(o, e) * 2;
    check_disjoint(
        kernel,
        &[
            Region::new("x", x, size(kernel, "x", &[t, e, 4])?, false),
            Region::new("w", w, size(kernel, "w", &[wlen, 2])?, false),
            Region::new("y", y, size(kernel, "y", &[t, o, 4])?, true),
        ],
    )?;
    // SAFETY: `y` is the only written range and overlaps neither input.
    let (xs, ws, ys) = unsafe {
        (
            view::<f32>(mem, x, t * e, "x")?,
            view::<u16>(mem, w, wlen, "the packed weight")?,
            view_mut::<f32>(mem, y, t * o, "y")?,
        )
    };
    project_range(xs, ws, ys, t, e, o, steps).context(kernel)
}

/// `gate`: [`GateArgs`].
pub(super) fn gate_kernel(mem: &dyn HostMemory, _cfg: &LaunchConfig, a: GateArgs) -> Result<()> {
    let GateArgs {
        highway,
        kv,
        norm_q,
        norm_k,
        norm_conv,
        gated,
        xn,
        t,
        h,
        hc,
        eps,
    } = a;
    let ptrs = [highway, kv, norm_q, norm_k, norm_conv, gated, xn];
    let shape = [t, h, hc].map(|v| v as usize);
    gate_common(
        "ple::gate",
        mem,
        ptrs,
        shape,
        GateNorms::qwen4exp(eps),
        false,
    )
}

/// `gate_norms`: [`GateNormsArgs`].
pub(super) fn gate_norms_kernel(
    mem: &dyn HostMemory,
    _cfg: &LaunchConfig,
    a: GateNormsArgs,
) -> Result<()> {
    const K: &str = "ple::gate_norms";
    let form = a.form;
    let Some(offset) = GateNorms::offset_of_form(form) else {
        bail!(
            "{K}: form {form} is not a norm form (bit 0: 1 + w or w) with a zero-dot rule (bit 1: copysign)"
        );
    };
    let norms = GateNorms {
        offset,
        eps_q: a.eps_q,
        eps_k: a.eps_k,
        eps_conv: a.eps_conv,
        conv: a.conv != 0,
        copysign: GateNorms::copysign_of_form(form),
    };
    let ptrs = [
        a.highway,
        a.kv,
        a.norm_q,
        a.norm_k,
        a.norm_conv,
        a.gated,
        a.xn,
    ];
    let shape = [a.t, a.h, a.hc].map(|v| v as usize);
    gate_common(K, mem, ptrs, shape, norms, true)
}

/// The body `gate` and `gate_norms` share: `ptrs` are highway, kv, norm_q,
/// norm_k, norm_conv, gated and xn, `shape` is `[t, h, hc]`; `norm_conv`
/// and `xn` are neither read nor written without the conv norm.
fn gate_common(
    kernel: &'static str,
    mem: &dyn HostMemory,
    ptrs: [DevicePtr; 7],
    [t, h, hc]: [usize; 3],
    norms: GateNorms,
    with_norms: bool,
) -> Result<()> {
    let names = [
        "highway",
        "kv",
        "norm_q",
        "norm_k",
        "norm_conv",
        "gated",
        "xn",
    ];
    ensure!(
        h > 0 && hc > 0,
        "{kernel}: H = {h} and hc = {hc} must both be positive"
    );
    if t == 0 {
        return Ok(());
    }
    let c = size(kernel, "C", &[h, hc])?;
    let tc = size(kernel, "highway", &[t, c])?;
    let kv_len = size(kernel, "kv", &[t, c.saturating_add(h)])?;
    let (conv_c, conv_tc) = if norms.conv { (c, tc) } else { (0, 0) };
    let lens = [tc, kv_len, c, c, conv_c, tc, conv_tc];
    let regions: Vec<Region> = (0..7)
        .map(|i| {
            Ok(Region::new(
                names[i],
                ptrs[i],
                size(kernel, names[i], &[lens[i], 4])?,
                i >= 5,
            ))
        })
        .collect::<Result<_>>()?;
    check_disjoint(kernel, &regions)?;
    // SAFETY: only `gated` and `xn` are written, and they overlap nothing
    // else of this launch (checked above); empty views touch no memory.
    let (ins, gated, xn) = unsafe {
        let mut v = [&[][..]; 5];
        for i in 0..5 {
            v[i] = view::<f32>(mem, ptrs[i], lens[i], names[i])?;
        }
        (
            v,
            view_mut::<f32>(mem, ptrs[5], lens[5], "gated")?,
            view_mut::<f32>(mem, ptrs[6], lens[6], "xn")?,
        )
    };
    let inputs = GateInputs {
        highway: ins[0],
        kv: ins[1],
        norm_q: ins[2],
        norm_k: ins[3],
        norm_conv: ins[4],
    };
    let d = GateDims {
        t,
        h,
        hc,
        eps: norms.eps_q,
    };
    if with_norms {
        gate_norms(d, norms, inputs, gated, xn).context(kernel)
    } else {
        gate(d, inputs, gated, xn).context(kernel)
    }
}

/// `bias_add`: [`BiasAddArgs`].
pub(super) fn bias_add_kernel(
    mem: &dyn HostMemory,
    _cfg: &LaunchConfig,
    a: BiasAddArgs,
) -> Result<()> {
    const K: &str = "ple::bias_add";
    let (y, bias) = (a.y, a.bias);
    let (t, o) = (a.t as usize, a.o as usize);
    ensure!(o > 0, "{K}: O is 0");
    if t == 0 {
        return Ok(());
    }
    let to = size(K, "y", &[t, o])?;
    check_disjoint(
        K,
        &[
            Region::new("y", y, size(K, "y", &[to, 4])?, true),
            Region::new("bias", bias, size(K, "bias", &[o, 4])?, false),
        ],
    )?;
    // SAFETY: `y` is the only written range and does not overlap `bias`.
    unsafe {
        let b = view::<f32>(mem, bias, o, "bias")?;
        let ys = view_mut::<f32>(mem, y, to, "y")?;
        bias_add(ys, b, t, o).context(K)
    }
}

/// `highway_add`: [`HighwayAddArgs`].
pub(super) fn highway_add_kernel(
    mem: &dyn HostMemory,
    _cfg: &LaunchConfig,
    a: HighwayAddArgs,
) -> Result<()> {
    const K: &str = "ple::highway_add";
    let (hw, out) = (a.highway, a.out);
    let n = a.n as usize;
    if n == 0 {
        return Ok(());
    }
    let bytes = size(K, "highway", &[n, 4])?;
    check_disjoint(
        K,
        &[
            Region::new("highway", hw, bytes, true),
            Region::new("out", out, bytes, false),
        ],
    )?;
    // SAFETY: `highway` is the only written range and does not overlap
    // `out`.
    unsafe {
        let o = view::<f32>(mem, out, n, "out")?;
        let h = view_mut::<f32>(mem, hw, n, "highway")?;
        highway_add(h, o).context(K)
    }
}

/// `mean_add`: [`MeanAddArgs`].
pub(super) fn mean_add_kernel(
    mem: &dyn HostMemory,
    _cfg: &LaunchConfig,
    a: MeanAddArgs,
) -> Result<()> {
    const K: &str = "ple::mean_add";
    let (hw, value) = (a.highway, a.value);
    let n = a.n as usize;
    let divisor = a.divisor;
    if n == 0 {
        return Ok(());
    }
    let bytes = size(K, "highway", &[n, 4])?;
    check_disjoint(
        K,
        &[
            Region::new("highway", hw, bytes, true),
            Region::new("value", value, bytes, false),
        ],
    )?;
    // SAFETY: `highway` is the only written range and does not overlap
    // `value`.
    unsafe {
        let v = view::<f32>(mem, value, n, "value")?;
        let h = view_mut::<f32>(mem, hw, n, "highway")?;
        mean_add(h, v, divisor).context(K)
    }
}

/// The shape `conv` and `conv_batch` share (`t` rows, or `b` sequences of
/// one row), checked.
fn conv_dims(kernel: &str, [t, c, k, d]: [u32; 4]) -> Result<ConvDims> {
    let dims = ConvDims {
        t: t as usize,
        c: c as usize,
        k: k as usize,
        d: d as usize,
    };
    ensure!(
        dims.c > 0 && dims.k > 0 && dims.d > 0,
        "{kernel}: C = {}, K = {} and D = {} must all be positive",
        dims.c,
        dims.k,
        dims.d
    );
    Ok(dims)
}

/// `conv`: [`ConvArgs`].
pub(super) fn conv_kernel(mem: &dyn HostMemory, _cfg: &LaunchConfig, a: ConvArgs) -> Result<()> {
    const K: &str = "ple::conv";
    let (xn, gated, state, w, hw) = (a.xn, a.gated, a.state, a.w, a.highway);
    let dims = conv_dims(K, [a.t, a.c, a.k, a.d])?;
    if dims.t == 0 {
        return Ok(());
    }
    let (tc, sc, ck) = (
        size(K, "xn", &[dims.t, dims.c])?,
        size(K, "state", &[dims.state_len(), dims.c])?,
        size(K, "w", &[dims.c, dims.k])?,
    );
    check_disjoint(
        K,
        &[
            Region::new("xn", xn, tc * 4, false),
            Region::new("gated", gated, tc * 4, false),
            Region::new("state", state, sc * 4, true),
            Region::new("w", w, ck * 4, false),
            Region::new("highway", hw, tc * 4, true),
        ],
    )?;
    // SAFETY: `state` and `highway` are the written ranges and overlap
    // nothing else of this launch (checked above).
    unsafe {
        let xs = view::<f32>(mem, xn, tc, "xn")?;
        let gs = view::<f32>(mem, gated, tc, "gated")?;
        let ws = view::<f32>(mem, w, ck, "w")?;
        let st = view_mut::<f32>(mem, state, sc, "state")?;
        let hs = view_mut::<f32>(mem, hw, tc, "highway")?;
        conv(dims, xs, gs, st, ws, hs).context(K)
    }
}

/// `conv_batch`: [`ConvBatchArgs`].
pub(super) fn conv_batch_kernel(
    mem: &dyn HostMemory,
    _cfg: &LaunchConfig,
    a: ConvBatchArgs,
) -> Result<()> {
    const K: &str = "ple::conv_batch";
    let (xn, gated, states, w, hw) = (a.xn, a.gated, a.states, a.w, a.highway);
    let dims = conv_dims(K, [a.b, a.c, a.k, a.d])?;
    let b = dims.t;
    if b == 0 {
        return Ok(());
    }
    let (bc, sc, ck) = (
        size(K, "xn", &[b, dims.c])?,
        size(K, "state", &[dims.state_len(), dims.c])?,
        size(K, "w", &[dims.c, dims.k])?,
    );
    let mut regions = vec![
        Region::new("xn", xn, bc * 4, false),
        Region::new("gated", gated, bc * 4, false),
        Region::new("states", states, size(K, "states", &[b, 8])?, false),
        Region::new("w", w, ck * 4, false),
        Region::new("highway", hw, bc * 4, true),
    ];
    // SAFETY: the pointer table is only read; it is checked against every
    // written range below before any mutable view exists.
    let table: &[u8] = unsafe { view(mem, states, b * 8, "the state pointers")? };
    let state_ptrs: Vec<DevicePtr> = table
        .chunks_exact(8)
        .map(|c| DevicePtr(u64::from_le_bytes(c.try_into().expect("8 bytes"))))
        .collect();
    for (i, &p) in state_ptrs.iter().enumerate() {
        if sc > 0 {
            mem.host_ptr(p, sc * 4)
                .with_context(|| format!("{K}: state {i} at {p}"))?;
        }
        regions.push(Region::new(format!("state {i}"), p, sc * 4, true));
    }
    check_disjoint(K, &regions)?;
    // SAFETY: every written range (`highway`, each state) overlaps nothing
    // else of this launch (checked above), so the views never alias.
    unsafe {
        let xs = view::<f32>(mem, xn, bc, "xn")?;
        let gs = view::<f32>(mem, gated, bc, "gated")?;
        let ws = view::<f32>(mem, w, ck, "w")?;
        let mut sts = Vec::with_capacity(b);
        for (i, &p) in state_ptrs.iter().enumerate() {
            sts.push(view_mut::<f32>(mem, p, sc, &format!("state {i}"))?);
        }
        let hs = view_mut::<f32>(mem, hw, bc, "highway")?;
        conv_batch(dims, xs, gs, &mut sts, ws, hs).context(K)
    }
}
