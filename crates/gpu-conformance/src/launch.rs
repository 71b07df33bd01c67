//! Kernel cases: the registry, argument passing, launch-time refusals, and
//! errors raised by queued work (sticky per stream until reported).

use std::sync::Arc;

use metrale_gpu_runtime::GpuError;
use metrale_gpu_runtime::gpu::{
    ArgKind, DevicePtr, GpuBackend, KernelArg, KernelHandle, LaunchConfig,
};

use crate::CaseResult;
use crate::check::{Context, Scope, expect_root, one, read_u32, write_version};

/// `register_host_kernel`, `kernel`, `load_module`: lookups by module and
/// name, errors naming both, re-registration replaces the body.
pub fn kernel_registry(gpu: &dyn GpuBackend) -> CaseResult {
    let mut sc = Scope::with_kernels(gpu)?;
    let k1 = gpu.kernel("conformance", "fill")?;
    let k2 = gpu.kernel("conformance", "add")?;
    ensure!(k1 != k2, "distinct kernels share a handle");
    ensure!(
        gpu.kernel("conformance", "fill")? == k1,
        "handle not stable"
    );
    expect_err!(
        gpu.kernel("conformance", "nope"),
        GpuError::NoSuchKernel { .. },
        &["conformance::nope"],
    )?;
    expect_err!(
        gpu.kernel("no_such_module", "fill"),
        GpuError::NoSuchKernel { .. },
        &["no_such_module::fill"],
    )?;
    expect_err!(
        gpu.load_module("conformance_mod", b"not a module"),
        GpuError::Unsupported { .. } | GpuError::InvalidArgument { .. },
        &["load_module", "conformance_mod"],
    )?;

    let p = sc.alloc(4, "conformance out")?;
    let sig = [ArgKind::Ptr];
    gpu.register_host_kernel("conformance", "version", &sig, Arc::new(write_version::<1>))?;
    let kv = gpu.kernel("conformance", "version")?;
    gpu.launch(kv, one()).ptr(p).run(0)?;
    ensure!(read_u32(gpu, p, 1, 0)? == [1], "first body");
    gpu.register_host_kernel("conformance", "version", &sig, Arc::new(write_version::<2>))?;
    ensure!(
        gpu.kernel("conformance", "version")? == kv,
        "re-registration changed the handle"
    );
    gpu.launch(kv, one()).ptr(p).run(0)?;
    ensure!(
        read_u32(gpu, p, 1, 0)? == [2],
        "re-registration did not replace the body"
    );
    sc.finish()
}

/// Every argument kind reaches the kernel intact, with the launch geometry.
pub fn kernel_arguments(gpu: &dyn GpuBackend) -> CaseResult {
    let mut sc = Scope::with_kernels(gpu)?;
    let out = sc.alloc(28, "conformance args")?;
    let k = gpu.kernel("conformance", "args")?;
    gpu.launch(k, LaunchConfig::linear(3, 128))
        .ptr(out)
        .u32(0xDEAD_BEEF)
        .u64(0x0123_4567_89AB_CDEF)
        .i32(-5)
        .f32(1.5)
        .run(0)?;
    let mut b = [0u8; 28];
    gpu.copy_d2h_on_stream(out, &mut b, 0)?;
    let mut want = Vec::new();
    want.extend_from_slice(&0xDEAD_BEEFu32.to_le_bytes());
    want.extend_from_slice(&0x0123_4567_89AB_CDEFu64.to_le_bytes());
    want.extend_from_slice(&(-5i32).to_le_bytes());
    want.extend_from_slice(&1.5f32.to_le_bytes());
    want.extend_from_slice(&3u32.to_le_bytes());
    want.extend_from_slice(&128u32.to_le_bytes());
    ensure!(b[..] == want[..], "kernel saw {b:?}, want {want:?}");
    // The same through launch_kernel directly, on another stream.
    let s = sc.stream()?;
    let args = [
        KernelArg::Ptr(out),
        KernelArg::U32(1),
        KernelArg::U64(2),
        KernelArg::I32(3),
        KernelArg::F32(4.0),
    ];
    gpu.launch_kernel(k, one(), &args, s)?;
    gpu.copy_d2h_on_stream(out, &mut b, s)?;
    ensure!(
        b[..4] == [1, 0, 0, 0] && b[4..12] == 2u64.to_le_bytes(),
        "direct launch: {b:?}"
    );
    sc.finish()
}

/// Launch errors name the kernel, the argument position, what was expected
/// and what was given; bad pointers are caught at launch.
pub fn kernel_argument_errors(gpu: &dyn GpuBackend) -> CaseResult {
    let mut sc = Scope::with_kernels(gpu)?;
    let k = gpu.kernel("conformance", "fill")?;
    let p = sc.alloc(16, "conformance fill target")?;
    expect_err!(
        gpu.launch(k, one()).ptr(p).u32(4).run(0),
        GpuError::ArgCount {
            expected: 3,
            got: 2,
            ..
        },
        &["conformance::fill", "expected 3 arguments, got 2"],
    )?;
    expect_err!(
        gpu.launch(k, one()).ptr(p).u32(4).f32(1.0).run(0),
        GpuError::ArgType { index: 2, .. },
        &["conformance::fill", "argument 2", "expected U32", "got F32"],
    )?;
    expect_err!(
        gpu.launch(k, one()).u32(0).u32(4).u32(1).run(0),
        GpuError::ArgType { index: 0, .. },
        &["conformance::fill", "argument 0", "expected Ptr", "got U32"],
    )?;
    expect_err!(
        gpu.launch(k, LaunchConfig::linear(0, 1))
            .ptr(p)
            .u32(4)
            .u32(1)
            .run(0),
        GpuError::InvalidLaunch { .. },
        &["conformance::fill", "grid"],
    )?;
    expect_err!(
        gpu.launch_kernel(KernelHandle(987_654), one(), &[], 0),
        GpuError::UnknownKernelHandle { handle: 987_654 },
        &["launch_kernel", "987654"],
    )?;
    expect_err!(
        gpu.launch(k, one()).ptr(p).u32(4).u32(1).run(4242),
        GpuError::UnknownStream { stream: 4242, .. },
        &["launch_kernel", "unknown stream", "4242"],
    )?;
    let wild = DevicePtr(0x7777);
    expect_err!(
        gpu.launch(k, one()).ptr(wild).u32(4).u32(1).run(0),
        GpuError::InvalidPointer { .. },
        &["conformance::fill", "argument 0", "0x7777"],
    )?;
    // A kernel reading past its buffer fails at execution, naming it.
    gpu.launch(k, one()).ptr(p).u32(5).u32(1).run(0)?;
    let e = expect_err!(
        gpu.synchronize(0),
        GpuError::Stream { .. },
        &[
            "conformance::fill",
            &p.to_string(),
            "conformance fill target"
        ],
    )?;
    expect_root(&e, "OutOfBounds", |r| {
        matches!(r, GpuError::OutOfBounds { .. })
    })?;
    sc.free(p)?;
    expect_err!(
        gpu.launch(k, one()).ptr(p).u32(4).u32(1).run(0),
        GpuError::UseAfterFree { .. },
        &["conformance::fill", &p.to_string(), "freed"],
    )?;
    gpu.synchronize(0)?;
    sc.finish()
}

/// An error raised by queued work is reported by the next synchronising
/// call on that stream (first error wins), then cleared; later work on the
/// stream still runs; other streams are unaffected.
pub fn sticky_async_errors(gpu: &dyn GpuBackend) -> CaseResult {
    let deliberate = |r: &GpuError| matches!(r, GpuError::Kernel { .. });
    let mut sc = Scope::with_kernels(gpu)?;
    let s = sc.stream()?;
    let other = sc.stream()?;
    let fail = gpu.kernel("conformance", "fail")?;
    let touch = gpu.kernel("conformance", "touch")?;
    let p = sc.alloc(32, "conformance sticky")?;
    gpu.launch(fail, one()).u32(1).run(s)?;
    gpu.launch(fail, one()).u32(2).run(s)?;
    gpu.memset_async(p, 9, 32, s)?;
    gpu.synchronize(other)?;
    let e = expect_err!(
        gpu.synchronize(s),
        GpuError::Stream { .. },
        &["synchronize", "deliberate failure #1"],
    )?;
    ensure!(e.is_sticky(), "{e:?} is not a sticky stream error");
    expect_root(&e, "a kernel error", deliberate)?;
    ensure!(!e.to_string().contains("#2"), "first error must win: {e}");
    gpu.synchronize(s)
        .context("the error must be cleared once reported")?;
    let mut out = [0u8; 32];
    gpu.copy_d2h_on_stream(p, &mut out, s)?;
    ensure!(out == [9; 32], "work after a failure did not run");

    // copy_d2h_on_stream reports it too, and does not copy.
    gpu.launch(touch, one()).ptr(p).u32(33).run(s)?;
    let mut out = [0u8; 4];
    let e = expect_err!(
        gpu.copy_d2h_on_stream(p, &mut out, s),
        GpuError::Stream { .. },
        &["copy_d2h_on_stream", "conformance::touch", &p.to_string()],
    )?;
    ensure!(e.pointer() == Some(p), "{e:?} does not name {p}");
    gpu.copy_d2h_on_stream(p, &mut out, s)?;
    ensure!(out == [9; 4], "copy after the reported error");

    // The default stream's errors surface in the synchronous calls.
    gpu.launch(fail, one()).u32(3).run(0)?;
    let e = expect_err!(
        gpu.copy_d2h(p, &mut out),
        GpuError::Stream { stream: 0, .. },
        &["copy_d2h", "deliberate failure #3"],
    )?;
    expect_root(&e, "a kernel error", deliberate)?;
    gpu.copy_d2h(p, &mut out)?;
    sc.finish()
}
