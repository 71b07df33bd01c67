//! Stream, event and graph behaviour of [`CudaBackend`] that the
//! conformance suite checks with host kernels (which CUDA does not run),
//! checked here with small device kernels instead: work queued behind a
//! gate stays pending, events order streams, captured work replays with
//! values read at replay time, and event records inside a graph act at each
//! replay. Without a device the tests print `skipped: <reason>`.

#![cfg(feature = "cuda")]

use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use metrale_gpu_runtime::cuda::CudaBackend;
use metrale_gpu_runtime::gpu::{DevicePtr, GpuBackend, HostMapped, LaunchConfig, StreamId};

const KERNELS: &str = r#"
// Spin until *flag is non-zero, or about `max_cycles` clock cycles.
extern "C" __global__ void gate(const volatile unsigned int* flag, unsigned long long max_cycles) {
    long long start = clock64();
    while (*flag == 0u && (unsigned long long)(clock64() - start) < max_cycles) {
    }
}
extern "C" __global__ void fill(unsigned int* dst, unsigned int n, unsigned int value) {
    for (unsigned int i = threadIdx.x; i < n; i += blockDim.x) dst[i] = value;
}
extern "C" __global__ void add(unsigned int* dst, const unsigned int* src, unsigned int n) {
    for (unsigned int i = threadIdx.x; i < n; i += blockDim.x) dst[i] += src[i];
}
"#;

/// About 20 s at 2 GHz: a gate that is never opened fails the test rather
/// than hanging it.
const GATE_CYCLES: u64 = 40_000_000_000;

fn open() -> Option<CudaBackend> {
    match CudaBackend::new(0) {
        Ok(g) => {
            g.load_source("t", "stream_test.cu", KERNELS).unwrap();
            Some(g)
        }
        Err(e) => {
            println!("skipped: {e}");
            None
        }
    }
}

fn one() -> LaunchConfig {
    LaunchConfig::linear(1, 32)
}

fn flag(m: &HostMapped) -> &AtomicU32 {
    // SAFETY: 4 bytes of page-aligned mapped memory, alive until freed at
    // the end of the test that made it.
    unsafe { &*(m.host as *const AtomicU32) }
}

fn read_u32(gpu: &dyn GpuBackend, p: DevicePtr, n: usize, s: StreamId) -> Vec<u32> {
    let mut b = vec![0u8; n * 4];
    gpu.copy_d2h_on_stream(p, &mut b, s).unwrap();
    b.chunks_exact(4)
        .map(|c| u32::from_le_bytes(c.try_into().unwrap()))
        .collect()
}

#[test]
fn streams_are_asynchronous_and_events_order_them() {
    let Some(b) = open() else { return };
    let gpu: &dyn GpuBackend = &b;
    let (sa, sb) = (gpu.create_stream().unwrap(), gpu.create_stream().unwrap());
    let f = gpu.alloc_host_mapped(4, "flag").unwrap();
    let marker = gpu.alloc_host_mapped(4, "marker").unwrap();
    let x = gpu.alloc(64, "x").unwrap();
    let y = gpu.alloc(64, "y").unwrap();
    let (gate, fill) = (
        gpu.kernel("t", "gate").unwrap(),
        gpu.kernel("t", "fill").unwrap(),
    );
    let ev = gpu.create_event().unwrap();
    assert!(
        gpu.event_query(ev).unwrap(),
        "an unrecorded event reads complete"
    );

    gpu.launch(gate, one())
        .ptr(f.device)
        .u64(GATE_CYCLES)
        .run(sa)
        .unwrap();
    gpu.launch(fill, one())
        .ptr(x)
        .u32(16)
        .u32(77)
        .run(sa)
        .unwrap();
    gpu.record_event(ev, sa).unwrap();
    gpu.stream_wait_event(sb, ev).unwrap();
    gpu.copy_d2d_async(x, y, 64, sb).unwrap();
    gpu.launch(fill, one())
        .ptr(marker.device)
        .u32(1)
        .u32(1)
        .run(sb)
        .unwrap();

    std::thread::sleep(Duration::from_millis(50));
    assert!(
        !gpu.event_query(ev).unwrap(),
        "event complete before the gate opened"
    );
    assert_eq!(
        flag(&marker).load(Ordering::Acquire),
        0,
        "B ran past its wait"
    );
    let mut early = [0u8; 4];
    gpu.copy_d2h(x, &mut early).unwrap();
    assert_eq!(
        early, [0; 4],
        "A ran before its gate opened, or stream 0 waited for A"
    );

    flag(&f).store(1, Ordering::Release);
    assert_eq!(read_u32(gpu, y, 16, sb), [77; 16]);
    gpu.event_synchronize(ev).unwrap();
    assert!(gpu.event_query(ev).unwrap());
    assert_eq!(flag(&marker).load(Ordering::Acquire), 1);
    gpu.destroy_event(ev).unwrap();
    for s in [sa, sb] {
        gpu.destroy_stream(s).unwrap();
    }
    for p in [x, y, f.device, marker.device] {
        gpu.dealloc(p).unwrap();
    }
    assert_eq!(gpu.live_alloc_count(), 0);
}

#[test]
fn captured_work_replays_with_values_read_at_replay() {
    let Some(b) = open() else { return };
    let gpu: &dyn GpuBackend = &b;
    let s = gpu.create_stream().unwrap();
    let u32s = |v: &[u32]| v.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>();
    let (param, acc, copy) = (
        gpu.alloc(32, "param").unwrap(),
        gpu.alloc(32, "acc").unwrap(),
        gpu.alloc(32, "copy").unwrap(),
    );
    gpu.copy_h2d(&u32s(&[1; 8]), param).unwrap();
    let add = gpu.kernel("t", "add").unwrap();
    gpu.begin_capture(s).unwrap();
    assert!(gpu.stream_is_capturing(s).unwrap() && !gpu.stream_is_capturing(0).unwrap());
    gpu.launch(add, one())
        .ptr(acc)
        .ptr(param)
        .u32(8)
        .run(s)
        .unwrap();
    gpu.copy_d2d_async(acc, copy, 32, s).unwrap();
    gpu.memset_async(param.offset(28), 0, 4, s).unwrap();
    let g = gpu.end_capture(s).unwrap();
    gpu.synchronize(s).unwrap();
    assert_eq!(
        read_u32(gpu, acc, 8, 0),
        [0; 8],
        "captured work ran at capture"
    );
    gpu.launch_graph(g, s).unwrap();
    assert_eq!(read_u32(gpu, copy, 8, s), [1; 8]);
    gpu.copy_h2d(&u32s(&[10; 8]), param).unwrap();
    gpu.launch_graph(g, s).unwrap();
    assert_eq!(read_u32(gpu, copy, 8, s), [11; 8]);
    gpu.launch_graph(g, 0).unwrap();
    gpu.synchronize(0).unwrap();
    assert_eq!(read_u32(gpu, acc, 8, 0), [21, 21, 21, 21, 21, 21, 21, 11]);
    gpu.destroy_graph(g).unwrap();
    gpu.destroy_stream(s).unwrap();
    for p in [param, acc, copy] {
        gpu.dealloc(p).unwrap();
    }
}

#[test]
fn event_records_in_a_graph_act_at_each_replay() {
    let Some(b) = open() else { return };
    let gpu: &dyn GpuBackend = &b;
    let (sa, sb) = (gpu.create_stream().unwrap(), gpu.create_stream().unwrap());
    let ev = gpu.create_event().unwrap();
    let f = gpu.alloc_host_mapped(4, "flag").unwrap();
    let (x, y) = (gpu.alloc(16, "x").unwrap(), gpu.alloc(16, "y").unwrap());
    let (gate, fill) = (
        gpu.kernel("t", "gate").unwrap(),
        gpu.kernel("t", "fill").unwrap(),
    );
    gpu.begin_capture(sa).unwrap();
    gpu.launch(gate, one())
        .ptr(f.device)
        .u64(GATE_CYCLES)
        .run(sa)
        .unwrap();
    gpu.launch(fill, one())
        .ptr(x)
        .u32(4)
        .u32(5)
        .run(sa)
        .unwrap();
    gpu.record_event(ev, sa).unwrap();
    let g = gpu.end_capture(sa).unwrap();
    assert!(
        gpu.event_query(ev).unwrap(),
        "a captured record counts as none"
    );
    gpu.launch_graph(g, sa).unwrap();
    assert!(
        !gpu.event_query(ev).unwrap(),
        "the replayed record is pending"
    );
    gpu.stream_wait_event(sb, ev).unwrap();
    gpu.copy_d2d_async(x, y, 16, sb).unwrap();
    flag(&f).store(1, Ordering::Release);
    assert_eq!(
        read_u32(gpu, y, 4, sb),
        [5; 4],
        "B did not wait for the replayed record"
    );
    gpu.synchronize(sa).unwrap();
    gpu.destroy_graph(g).unwrap();
    gpu.destroy_event(ev).unwrap();
    for s in [sa, sb] {
        gpu.destroy_stream(s).unwrap();
    }
    for p in [x, y, f.device] {
        gpu.dealloc(p).unwrap();
    }
}

#[test]
fn launches_are_checked_against_the_ptx_signature() {
    let Some(b) = open() else { return };
    let gpu: &dyn GpuBackend = &b;
    let fill = gpu.kernel("t", "fill").unwrap();
    let p = gpu.alloc(16, "fill target").unwrap();
    let e = gpu.launch(fill, one()).ptr(p).u32(4).run(0).unwrap_err();
    assert!(e.to_string().contains("expected 3 arguments, got 2"), "{e}");
    let e = gpu
        .launch(fill, one())
        .ptr(p)
        .u32(4)
        .f32(1.0)
        .run(0)
        .unwrap_err();
    assert!(e.to_string().contains("argument 2"), "{e}");
    let e = gpu
        .launch(fill, one())
        .ptr(DevicePtr(0x7777))
        .u32(4)
        .u32(1)
        .run(0)
        .unwrap_err();
    assert!(
        e.to_string().contains("argument 0") && e.to_string().contains("0x7777"),
        "{e}"
    );
    let e = gpu.kernel("t", "nope").unwrap_err();
    assert!(
        e.to_string().contains("t::nope") && e.to_string().contains("fill"),
        "{e}"
    );
    let e = gpu.load_module("junk", b"not a module").unwrap_err();
    assert!(e.to_string().contains("load_module 'junk'"), "{e}");
    gpu.dealloc(p).unwrap();
}
