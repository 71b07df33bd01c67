//! Launch and copy overheads of the CPU backend, each beside a plain
//! `memcpy` (`copy_from_slice`) of 64 MiB measured in the same run, since
//! absolute times drift on shared machines.
//!
//! Run: `cargo bench -p metrale-bench --bench launch`

use std::hint::black_box;
use std::sync::Arc;
use std::time::{Duration, Instant};

use metrale_bench::runtime::CopyD2d;
use metrale_gpu_runtime::cpu::CpuBackend;
use metrale_gpu_runtime::gpu::{
    ArgKind, DevicePtr, GpuBackend, HostMemory, KernelArg, LaunchConfig,
};

const BIG: usize = 64 << 20;

/// The median of `reps` timings of `f`.
fn median(reps: usize, mut f: impl FnMut()) -> Duration {
    let mut t: Vec<Duration> = (0..reps)
        .map(|_| {
            let t0 = Instant::now();
            f();
            t0.elapsed()
        })
        .collect();
    t.sort();
    t[reps / 2]
}

fn fmt(d: Duration) -> String {
    let ns = d.as_secs_f64() * 1e9;
    if ns < 1e3 {
        format!("{ns:.1} ns")
    } else if ns < 1e6 {
        format!("{:.2} us", ns / 1e3)
    } else {
        format!("{:.2} ms", ns / 1e6)
    }
}

fn main() -> anyhow::Result<()> {
    let cpu = CpuBackend::new();
    let gpu: &dyn GpuBackend = &cpu;
    gpu.register_host_kernel(
        "bench",
        "empty",
        &[],
        Arc::new(|_m: &dyn HostMemory, _c: &LaunchConfig, _a: &[KernelArg]| Ok(())),
    )?;
    let empty = gpu.kernel("bench", "empty")?;
    let one = LaunchConfig::linear(1, 1);
    let s = gpu.create_stream()?;

    // The shared workload: 64 MiB copy_d2d_async + synchronize, and its
    // baseline, a plain memcpy of 64 MiB between two touched host buffers.
    let mut copy = CopyD2d::new(gpu, BIG)?;
    let memcpy = median(15, || copy.baseline());
    let d2d = median(15, || copy.run().unwrap());
    copy.close()?;
    let a = gpu.alloc(BIG, "bench rows")?;

    // One empty kernel launch followed by synchronize, per launch.
    for _ in 0..200 {
        gpu.launch_kernel(empty, one, &[], s)?;
        gpu.synchronize(s)?;
    }
    let per = 2000;
    let launch_sync = median(7, || {
        for _ in 0..per {
            gpu.launch_kernel(empty, one, &[], s).unwrap();
            gpu.synchronize(s).unwrap();
        }
    }) / per;

    // 10k launches queued back to back, one synchronize at the end.
    let n = 10_000;
    let queued = median(7, || {
        for _ in 0..n {
            gpu.launch_kernel(empty, one, &[], s).unwrap();
        }
        gpu.synchronize(s).unwrap();
    });

    // The kernel-side pointer check: host_ptr on 1M scattered 320-byte rows
    // of a 64 MiB buffer, with 1000 other live allocations in the ledger.
    let others: Vec<DevicePtr> = (0..1000)
        .map(|i| gpu.alloc(4096, &format!("bench other {i}")))
        .collect::<Result<_, _>>()?;
    let lookups = 1_000_000u32;
    gpu.register_host_kernel(
        "bench",
        "rows",
        &[ArgKind::Ptr, ArgKind::U32],
        Arc::new(
            |m: &dyn HostMemory, _c: &LaunchConfig, args: &[KernelArg]| {
                let (KernelArg::Ptr(base), KernelArg::U32(n)) = (args[0], args[1]) else {
                    return Err(metrale_gpu_runtime::GpuError::kernel("bad arguments"));
                };
                let rows = (BIG / 320) as u64;
                let mut x = 0x9E37_79B9_7F4A_7C15u64;
                let mut acc = 0usize;
                for _ in 0..n {
                    x ^= x << 13;
                    x ^= x >> 7;
                    x ^= x << 17;
                    acc ^= m.host_ptr(base.offset(((x % rows) * 320) as usize), 320)? as usize;
                }
                black_box(acc);
                Ok(())
            },
        ),
    )?;
    let rows = gpu.kernel("bench", "rows")?;
    let host_ptr = median(5, || {
        gpu.launch_kernel(rows, one, &[KernelArg::Ptr(a), KernelArg::U32(lookups)], s)
            .unwrap();
        gpu.synchronize(s).unwrap();
    }) / lookups;

    for p in others.into_iter().chain([a]) {
        gpu.dealloc(p)?;
    }
    gpu.destroy_stream(s)?;

    let r = |d: Duration| d.as_secs_f64() / memcpy.as_secs_f64();
    println!(
        "CPU backend, baseline = memcpy (copy_from_slice) of 64 MiB in this run: {}",
        fmt(memcpy)
    );
    println!(
        "{:<44} {:>12} {:>12} {:>10}",
        "measure", "time", "baseline", "ratio"
    );
    let rows_out = [
        ("copy_d2d_async 64 MiB + synchronize", d2d),
        ("empty kernel: launch + synchronize (each)", launch_sync),
        ("empty kernel: 10k queued launches (total)", queued),
        ("empty kernel: 10k queued launches (each)", queued / n),
        ("host_ptr check in a kernel (each)", host_ptr),
    ];
    for (name, d) in rows_out {
        println!(
            "{name:<44} {:>12} {:>12} {:>10.6}",
            fmt(d),
            fmt(memcpy),
            r(d)
        );
    }
    println!(
        "64 MiB throughput: memcpy {:.2} GB/s, copy_d2d_async {:.2} GB/s",
        BIG as f64 / memcpy.as_secs_f64() / 1e9,
        BIG as f64 / d2d.as_secs_f64() / 1e9
    );
    Ok(())
}
