//! Several host threads share one CPU backend: each allocates, queues work on
//! its own stream, reads back and frees, while another thread replays a graph
//! on a third stream. Every thread sees its own data and the ledger ends
//! empty (frees wait for other streams' work, so none of them may fail).

mod common;

use std::sync::Arc;

use metrale_gpu_runtime::cpu::CpuBackend;
use metrale_gpu_runtime::gpu::{GpuBackend, LaunchConfig};

#[test]
fn threads_sharing_a_backend_keep_their_data_apart() {
    let gpu: Arc<dyn GpuBackend> = Arc::new(CpuBackend::new_debug());
    common::register_inc(gpu.as_ref(), "stress");
    let inc = gpu.kernel("stress", "inc").unwrap();

    // A graph that increments a counter buffer, replayed concurrently.
    let counter = gpu.alloc(64, "stress counter").unwrap();
    gpu.memset(counter, 0, 64).unwrap();
    let gs = gpu.create_stream().unwrap();
    gpu.begin_capture(gs).unwrap();
    gpu.launch(inc, LaunchConfig::linear(1, 1))
        .ptr(counter)
        .u32(64)
        .run(gs)
        .unwrap();
    let graph = gpu.end_capture(gs).unwrap();

    let mut handles = Vec::new();
    for t in 0..4u8 {
        let gpu = gpu.clone();
        handles.push(std::thread::spawn(move || {
            let s = gpu.create_stream().unwrap();
            for i in 0..150u32 {
                let n = 1 + (i as usize * 37 + t as usize * 11) % 4000;
                let p = gpu.alloc(n, &format!("stress t{t} i{i}")).unwrap();
                let fill = t.wrapping_mul(31).wrapping_add(i as u8);
                gpu.copy_h2d_async(&vec![fill; n], p, s).unwrap();
                gpu.launch(inc, LaunchConfig::linear(1, 1))
                    .ptr(p)
                    .u32(n as u32)
                    .run(s)
                    .unwrap();
                let mut out = vec![0u8; n];
                gpu.copy_d2h_on_stream(p, &mut out, s).unwrap();
                assert!(
                    out.iter().all(|&x| x == fill.wrapping_add(1)),
                    "thread {t} iteration {i}"
                );
                gpu.dealloc(p).unwrap();
            }
            gpu.destroy_stream(s).unwrap();
        }));
    }
    for _ in 0..200 {
        gpu.launch_graph(graph, gs).unwrap();
    }
    for h in handles {
        h.join().unwrap();
    }
    let mut out = [0u8; 64];
    gpu.copy_d2h_on_stream(counter, &mut out, gs).unwrap();
    assert_eq!(out, [200; 64]);
    gpu.destroy_graph(graph).unwrap();
    gpu.destroy_stream(gs).unwrap();
    gpu.dealloc(counter).unwrap();
    assert_eq!(gpu.live_alloc_count(), 0, "{}", gpu.live_report());
}
