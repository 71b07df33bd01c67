//! The conformance suite run against the CPU backend in debug mode, one test
//! per case so failures are named, plus `run_all` as a whole.

use std::sync::Arc;

use metrale_gpu_conformance::{self as conformance, CASES};
use metrale_gpu_runtime::cpu::CpuBackend;
use metrale_gpu_runtime::gpu::GpuBackend;

fn run(name: &str) {
    let case = CASES
        .iter()
        .find(|(n, _)| *n == name)
        .unwrap_or_else(|| panic!("no case {name}"))
        .1;
    let gpu = CpuBackend::new_debug();
    if let Err(e) = case(&gpu) {
        panic!("{name}: {e:#}");
    }
    assert_eq!(
        gpu.live_alloc_count(),
        0,
        "{name} leaked:\n{}",
        (&gpu as &dyn GpuBackend).live_report()
    );
}

macro_rules! cases {
    ($($name:ident),* $(,)?) => {
        $(#[test] fn $name() { run(stringify!($name)); })*

        #[test]
        fn every_case_has_a_test() {
            let named: &[&str] = &[$(stringify!($name)),*];
            for (n, _) in CASES {
                assert!(named.contains(n), "case {n} has no #[test] here");
            }
        }
    };
}

cases!(
    alloc_free_accounting,
    sync_copies,
    async_copies_in_order,
    h2d_async_source_copied_at_call,
    memory_errors,
    free_errors,
    host_mapped_memory,
    registered_host_memory,
    streams,
    stream_asynchrony_and_events,
    events,
    kernel_registry,
    kernel_arguments,
    kernel_argument_errors,
    sticky_async_errors,
    capture_and_replay,
    capture_refusals,
    capture_of_mapped_staging,
    capture_with_events,
    graph_errors,
);

#[test]
fn run_all_passes_on_the_cpu_backend() {
    let make = || Arc::new(CpuBackend::new()) as Arc<dyn GpuBackend>;
    let r = conformance::run_all(&make);
    assert!(r.failed.is_empty(), "failed: {:#?}", r.failed);
    assert!(r.skipped.is_empty(), "skipped: {:#?}", r.skipped);
    assert_eq!(r.passed.len(), CASES.len());
}
