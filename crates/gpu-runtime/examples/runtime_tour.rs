//! A short tour of the device runtime on the CPU backend: allocations, two
//! streams ordered by an event, a registered kernel that uses several cores,
//! a captured graph replayed with new inputs, the refusal of an unreplayable
//! copy under capture, a checked out-of-bounds access, and accounting back to
//! zero.
//!
//! Run: `cargo run --release --example runtime_tour -p metrale-gpu-runtime`

use std::sync::Arc;
use std::time::Instant;

use anyhow::{Result, ensure};
use metrale_gpu_runtime::cpu::CpuBackend;
use metrale_gpu_runtime::gpu::{
    ArgKind, GpuBackend, GpuError, HostMemory, KernelArg, LaunchConfig,
};
use rayon::prelude::*;

fn f32_bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

fn read_f32(
    gpu: &dyn GpuBackend,
    p: metrale_gpu_runtime::gpu::DevicePtr,
    n: usize,
    s: u64,
) -> Result<Vec<f32>> {
    let mut b = vec![0u8; n * 4];
    gpu.copy_d2h_on_stream(p, &mut b, s)?;
    Ok(b.chunks_exact(4)
        .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
        .collect())
}

fn main() -> Result<()> {
    let t0 = Instant::now();
    let cpu = CpuBackend::new_debug();
    let gpu: &dyn GpuBackend = &cpu;
    println!(
        "backend: {} (debug mode: new memory reads as NaN)",
        gpu.name()
    );

    // A kernel: y = a * x + y over n floats, split across cores with rayon.
    gpu.register_host_kernel(
        "tour",
        "saxpy",
        &[ArgKind::Ptr, ArgKind::Ptr, ArgKind::U32, ArgKind::F32],
        Arc::new(
            |m: &dyn HostMemory, _cfg: &LaunchConfig, args: &[KernelArg]| {
                let [
                    KernelArg::Ptr(y),
                    KernelArg::Ptr(x),
                    KernelArg::U32(n),
                    KernelArg::F32(a),
                ] = *args
                else {
                    return Err(GpuError::kernel(format!("saxpy: bad arguments {args:?}")));
                };
                // SAFETY: `x` and `y` are distinct buffers and this kernel is the
                // only user of both while it runs.
                let (x, y) = unsafe {
                    (
                        m.slice::<f32>(x, n as usize)?,
                        m.slice_mut::<f32>(y, n as usize)?,
                    )
                };
                y.par_chunks_mut(4096)
                    .zip(x.par_chunks(4096))
                    .for_each(|(y, x)| {
                        for (y, x) in y.iter_mut().zip(x) {
                            *y += a * x;
                        }
                    });
                Ok(())
            },
        ),
    )?;
    let saxpy = gpu.kernel("tour", "saxpy")?;
    println!("registered kernel tour::saxpy (ptr y, ptr x, u32 n, f32 a)");

    let n = 1 << 20;
    let x = gpu.alloc(n * 4, "tour x")?;
    let y = gpu.alloc(n * 4, "tour y")?;
    let fresh = read_f32(gpu, y, 1, 0)?;
    println!(
        "allocated x, y: {} floats each; fresh y[0] = {}",
        n, fresh[0]
    );

    // Two streams: A fills x and runs saxpy; B waits for A through an event
    // and then copies y into z.
    let a = gpu.create_stream()?;
    let b = gpu.create_stream()?;
    let z = gpu.alloc(n * 4, "tour z")?;
    let ones = f32_bytes(&vec![1.0; n]);
    gpu.copy_h2d_async(&ones, x, a)?;
    gpu.memset_async(y, 0, n * 4, a)?;
    gpu.launch(saxpy, LaunchConfig::linear((n / 256) as u32, 256))
        .ptr(y)
        .ptr(x)
        .u32(n as u32)
        .f32(3.0)
        .run(a)?;
    let ev = gpu.create_event()?;
    gpu.record_event(ev, a)?;
    gpu.stream_wait_event(b, ev)?;
    gpu.copy_d2d_async(y, z, n * 4, b)?;
    let got = read_f32(gpu, z, n, b)?;
    ensure!(got.iter().all(|&v| v == 3.0), "z should be all 3.0");
    println!(
        "stream {a}: h2d, memset, saxpy(a=3); stream {b}: waited on event {}, copied y -> z; z = 3.0 everywhere",
        ev.0
    );

    // Capture y += 2 * x on A into a graph, then replay it twice, changing x
    // through device memory in between.
    gpu.begin_capture(a)?;
    gpu.launch(saxpy, LaunchConfig::linear(1, 1))
        .ptr(y)
        .ptr(x)
        .u32(n as u32)
        .f32(2.0)
        .run(a)?;
    let refused = gpu.copy_h2d_async(&ones, x, a).unwrap_err();
    println!("under capture, a copy from ordinary host memory is refused:\n  {refused}");
    let capture = gpu.end_capture(a);
    println!("and the capture is invalidated: {}", capture.unwrap_err());

    let stage = gpu.alloc_host_mapped(n * 4, "tour staging")?;
    gpu.begin_capture(a)?;
    gpu.copy_d2d_async(stage.device, x, n * 4, a)?;
    gpu.launch(saxpy, LaunchConfig::linear(1, 1))
        .ptr(y)
        .ptr(x)
        .u32(n as u32)
        .f32(2.0)
        .run(a)?;
    let graph = gpu.end_capture(a)?;
    println!("captured graph {}: copy staging -> x, saxpy(a=2)", graph.0);
    for (round, value) in [(1, 10.0f32), (2, 100.0)] {
        // SAFETY: the staging buffer is host-mapped, owned by the backend
        // until freed below, and no queued work reads it while we write.
        let host = unsafe { std::slice::from_raw_parts_mut(stage.host as *mut f32, n) };
        host.fill(value);
        gpu.launch_graph(graph, a)?;
        let got = read_f32(gpu, y, 2, a)?;
        println!("replay {round}: staging = {value}, y[0] = {}", got[0]);
    }
    ensure!(
        read_f32(gpu, y, 1, a)?[0] == 3.0 + 20.0 + 200.0,
        "replays did not accumulate"
    );

    // Every access is checked against the ledger.
    let mut small = [0u8; 8];
    let oob = gpu.copy_d2h(x.offset(n * 4 - 4), &mut small).unwrap_err();
    println!("out-of-bounds read refused:\n  {oob}");
    gpu.dealloc(z)?;
    let uaf = gpu.copy_d2h(z, &mut small).unwrap_err();
    println!("use after free refused:\n  {uaf}");

    println!(
        "live before cleanup: {} allocations, {} bytes:",
        gpu.live_alloc_count(),
        gpu.live_bytes()
    );
    print!("{}", gpu.live_report());
    gpu.destroy_graph(graph)?;
    gpu.destroy_event(ev)?;
    gpu.destroy_stream(a)?;
    gpu.destroy_stream(b)?;
    for p in [x, y, stage.device] {
        gpu.dealloc(p)?;
    }
    ensure!(
        gpu.live_alloc_count() == 0 && gpu.live_bytes() == 0,
        "leak:\n{}",
        gpu.live_report()
    );
    println!(
        "after cleanup: {} allocations, {} bytes; done in {:.1} ms",
        gpu.live_alloc_count(),
        gpu.live_bytes(),
        t0.elapsed().as_secs_f64() * 1e3
    );
    Ok(())
}
