//! The host-kernel wrappers: each turns the launch arguments into checked
//! slices of backend memory and calls the pure kernel function.
//!
//! Invariants: every pointer range is checked against the backend's ledger
//! (through `HostMemory`) before use; a writable range may not overlap any
//! other range of the same launch (so the slices handed to the pure
//! functions never alias); all checks run before the first write, so a
//! refused launch leaves memory untouched.

use std::fmt::Display;

use metrale_gpu_runtime::gpu::{DevicePtr, GpuError, HostMemory, KernelArg, LaunchConfig};

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

/// Typed access to a launch's arguments.
struct Args<'a> {
    kernel: &'static str,
    args: &'a [KernelArg],
}

impl<'a> Args<'a> {
    fn new(kernel: &'static str, args: &'a [KernelArg], count: usize) -> Result<Self> {
        ensure!(
            args.len() == count,
            "{kernel}: {} arguments given, {count} expected",
            args.len()
        );
        Ok(Args { kernel, args })
    }

    fn ptr(&self, i: usize, name: &str) -> Result<DevicePtr> {
        match self.args[i] {
            KernelArg::Ptr(p) => Ok(p),
            other => bail!(
                "{}: argument {i} ({name}) must be a pointer, got {other:?}",
                self.kernel
            ),
        }
    }

    fn usize(&self, i: usize, name: &str) -> Result<usize> {
        match self.args[i] {
            KernelArg::U32(v) => Ok(v as usize),
            other => bail!(
                "{}: argument {i} ({name}) must be a u32, got {other:?}",
                self.kernel
            ),
        }
    }

    fn f32(&self, i: usize, name: &str) -> Result<f32> {
        match self.args[i] {
            KernelArg::F32(v) => Ok(v),
            other => bail!(
                "{}: argument {i} ({name}) must be an f32, got {other:?}",
                self.kernel
            ),
        }
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

/// `gather(refs, n, head_dim, dtype, out)`.
pub(super) fn gather_kernel(
    mem: &dyn HostMemory,
    _cfg: &LaunchConfig,
    args: &[KernelArg],
) -> Result<()> {
    const K: &str = "ple::gather";
    let a = Args::new(K, args, 5)?;
    let n = a.usize(1, "n")?;
    gather_into(mem, &a, K, n.max(1), n.max(1))
}

/// `gather_runs(refs, n, head_dim, dtype, out, run, stride)`: reference
/// `i` to out row `(i / run) * stride + i % run`.
pub(super) fn gather_runs_kernel(
    mem: &dyn HostMemory,
    _cfg: &LaunchConfig,
    args: &[KernelArg],
) -> Result<()> {
    const K: &str = "ple::gather_runs";
    let a = Args::new(K, args, 7)?;
    let run = a.usize(5, "run")?;
    let stride = a.usize(6, "stride")?;
    ensure!(
        run > 0 && stride >= run,
        "{K}: runs of {run} rows every {stride} rows (need 0 < run <= stride)"
    );
    gather_into(mem, &a, K, run, stride)
}

/// The gathers' body: arguments 0..5 of `a` are `refs, n, head_dim, dtype,
/// out`, and reference `i` lands on out row `(i / run) * stride + i % run`.
fn gather_into(
    mem: &dyn HostMemory,
    a: &Args<'_>,
    kernel: &'static str,
    run: usize,
    stride: usize,
) -> Result<()> {
    let refs = a.ptr(0, "refs")?;
    let n = a.usize(1, "n")?;
    let head_dim = a.usize(2, "head_dim")?;
    let dtype = GatherDType::from_arg(a.usize(3, "dtype")? as u32)?;
    let out = a.ptr(4, "out")?;
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

/// `project(x, w, y, T, E, O)`.
pub(super) fn project_kernel(
    mem: &dyn HostMemory,
    _cfg: &LaunchConfig,
    args: &[KernelArg],
) -> Result<()> {
    const K: &str = "ple::project";
    let a = Args::new(K, args, 6)?;
    let e = a.usize(4, "E")?;
    project_steps(mem, &a, K, Steps::all(e))
}

/// `project_range(x, w, y, T, E, O, from, to, accumulate)`.
pub(super) fn project_range_kernel(
    mem: &dyn HostMemory,
    _cfg: &LaunchConfig,
    args: &[KernelArg],
) -> Result<()> {
    const K: &str = "ple::project_range";
    let a = Args::new(K, args, 9)?;
    let steps = Steps {
        from: a.usize(6, "from")?,
        to: a.usize(7, "to")?,
        accumulate: a.usize(8, "accumulate")? != 0,
    };
    project_steps(mem, &a, K, steps)
}

/// The projections' body: arguments 0..6 of `a` are `x, w, y, T, E, O`.
fn project_steps(
    mem: &dyn HostMemory,
    a: &Args<'_>,
    kernel: &'static str,
    steps: Steps,
) -> Result<()> {
    let (x, w, y) = (a.ptr(0, "x")?, a.ptr(1, "w")?, a.ptr(2, "y")?);
    let (t, e, o) = (a.usize(3, "T")?, a.usize(4, "E")?, a.usize(5, "O")?);
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

/// `gate(highway, kv, norm_q, norm_k, norm_conv, gated, xn, T, H, hc, eps)`.
pub(super) fn gate_kernel(
    mem: &dyn HostMemory,
    _cfg: &LaunchConfig,
    args: &[KernelArg],
) -> Result<()> {
    const K: &str = "ple::gate";
    let a = Args::new(K, args, 11)?;
    let eps = a.f32(10, "eps")?;
    gate_common(K, mem, &a, GateNorms::qwen4exp(eps), false)
}

/// `gate_norms(highway, kv, norm_q, norm_k, norm_conv, gated, xn, T, H, hc,
/// eps_q, eps_k, eps_conv, form, conv)`.
pub(super) fn gate_norms_kernel(
    mem: &dyn HostMemory,
    _cfg: &LaunchConfig,
    args: &[KernelArg],
) -> Result<()> {
    const K: &str = "ple::gate_norms";
    let a = Args::new(K, args, 15)?;
    let form = a.usize(13, "form")? as u32;
    let Some(offset) = GateNorms::offset_of_form(form) else {
        bail!(
            "{K}: form {form} is not a norm form (bit 0: 1 + w or w) with a zero-dot rule (bit 1: copysign)"
        );
    };
    let norms = GateNorms {
        offset,
        eps_q: a.f32(10, "eps_q")?,
        eps_k: a.f32(11, "eps_k")?,
        eps_conv: a.f32(12, "eps_conv")?,
        conv: a.usize(14, "conv")? != 0,
        copysign: GateNorms::copysign_of_form(form),
    };
    gate_common(K, mem, &a, norms, true)
}

/// The pointer and shape arguments `gate` and `gate_norms` share (the
/// first ten); `norm_conv` and `xn` are neither read nor written without
/// the conv norm.
fn gate_common(
    kernel: &'static str,
    mem: &dyn HostMemory,
    a: &Args<'_>,
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
    let mut ptrs = [DevicePtr::NULL; 7];
    for (i, p) in ptrs.iter_mut().enumerate() {
        *p = a.ptr(i, names[i])?;
    }
    let (t, h, hc) = (a.usize(7, "T")?, a.usize(8, "H")?, a.usize(9, "hc")?);
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

/// `bias_add(y, bias, T, O)`.
pub(super) fn bias_add_kernel(
    mem: &dyn HostMemory,
    _cfg: &LaunchConfig,
    args: &[KernelArg],
) -> Result<()> {
    const K: &str = "ple::bias_add";
    let a = Args::new(K, args, 4)?;
    let (y, bias) = (a.ptr(0, "y")?, a.ptr(1, "bias")?);
    let (t, o) = (a.usize(2, "T")?, a.usize(3, "O")?);
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

/// `highway_add(highway, out, n)`.
pub(super) fn highway_add_kernel(
    mem: &dyn HostMemory,
    _cfg: &LaunchConfig,
    args: &[KernelArg],
) -> Result<()> {
    const K: &str = "ple::highway_add";
    let a = Args::new(K, args, 3)?;
    let (hw, out) = (a.ptr(0, "highway")?, a.ptr(1, "out")?);
    let n = a.usize(2, "n")?;
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

/// `mean_add(highway, value, n, divisor)`.
pub(super) fn mean_add_kernel(
    mem: &dyn HostMemory,
    _cfg: &LaunchConfig,
    args: &[KernelArg],
) -> Result<()> {
    const K: &str = "ple::mean_add";
    let a = Args::new(K, args, 4)?;
    let (hw, value) = (a.ptr(0, "highway")?, a.ptr(1, "value")?);
    let n = a.usize(2, "n")?;
    let divisor = a.f32(3, "divisor")?;
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

/// Shared argument decoding of `conv` and `conv_batch`.
fn conv_dims(a: &Args<'_>) -> Result<ConvDims> {
    let dims = ConvDims {
        t: a.usize(5, "T")?,
        c: a.usize(6, "C")?,
        k: a.usize(7, "K")?,
        d: a.usize(8, "D")?,
    };
    ensure!(
        dims.c > 0 && dims.k > 0 && dims.d > 0,
        "{}: C = {}, K = {} and D = {} must all be positive",
        a.kernel,
        dims.c,
        dims.k,
        dims.d
    );
    Ok(dims)
}

/// `conv(xn, gated, state, w, highway, T, C, K, D)`.
pub(super) fn conv_kernel(
    mem: &dyn HostMemory,
    _cfg: &LaunchConfig,
    args: &[KernelArg],
) -> Result<()> {
    const K: &str = "ple::conv";
    let a = Args::new(K, args, 9)?;
    let (xn, gated, state, w, hw) = (
        a.ptr(0, "xn")?,
        a.ptr(1, "gated")?,
        a.ptr(2, "state")?,
        a.ptr(3, "w")?,
        a.ptr(4, "highway")?,
    );
    let dims = conv_dims(&a)?;
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

/// `conv_batch(xn, gated, states, w, highway, B, C, K, D)`.
pub(super) fn conv_batch_kernel(
    mem: &dyn HostMemory,
    _cfg: &LaunchConfig,
    args: &[KernelArg],
) -> Result<()> {
    const K: &str = "ple::conv_batch";
    let a = Args::new(K, args, 9)?;
    let (xn, gated, states, w, hw) = (
        a.ptr(0, "xn")?,
        a.ptr(1, "gated")?,
        a.ptr(2, "states")?,
        a.ptr(3, "w")?,
        a.ptr(4, "highway")?,
    );
    let dims = conv_dims(&a)?;
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
