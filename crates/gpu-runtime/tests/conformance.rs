//! The conformance suite run against the CPU backend in debug mode, one test
//! per case so failures are named, plus the whole suite on one backend and
//! on a fresh backend per case.

use std::sync::Arc;

use metrale_gpu_conformance::{CASES, Failure, case, run_all, run_each};
use metrale_gpu_runtime::cpu::CpuBackend;
use metrale_gpu_runtime::gpu::GpuBackend;

fn run(name: &str) {
    let case = case(name).unwrap_or_else(|| panic!("no case {name}"));
    let gpu = CpuBackend::new_debug();
    match case(&gpu) {
        Ok(()) => {}
        Err(Failure::Skipped(why)) => panic!("{name} skipped on the CPU backend: {why}"),
        Err(Failure::Failed(what)) => panic!("{name}: {what}"),
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
            assert_eq!(named.len(), CASES.len(), "a #[test] names no case");
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
fn the_whole_suite_passes_on_one_cpu_backend() {
    let gpu = CpuBackend::new();
    let r = run_all(&gpu);
    assert!(r.is_ok() && r.skipped.is_empty(), "{r}");
    assert_eq!(r.passed.len(), CASES.len());
    assert_eq!(gpu.live_alloc_count(), 0);
}

#[test]
fn the_whole_suite_passes_on_fresh_cpu_backends() {
    let make = || Arc::new(CpuBackend::new()) as Arc<dyn GpuBackend>;
    let r = run_each(&make);
    assert!(r.is_ok() && r.skipped.is_empty(), "{r}");
    assert_eq!(r.passed.len(), CASES.len());
}
