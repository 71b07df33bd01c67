//! The backend conformance suite on [`CudaBackend`], when a CUDA device
//! opens. Without one the test prints `skipped: <reason>` and checks
//! nothing: it is not a pass of the suite.
//!
//! Cases that need host kernels report themselves skipped on CUDA (the
//! backend runs device kernels only); every other case must pass.

#![cfg(feature = "cuda")]

use std::sync::Arc;

use metrale_gpu_conformance::{self as conformance, CASES};
use metrale_gpu_runtime::cuda::CudaBackend;
use metrale_gpu_runtime::gpu::GpuBackend;

/// Run the conformance suite on CUDA device `ordinal`: `Err(reason)` when no
/// device opens, else the report.
pub fn run_on_cuda(ordinal: usize) -> Result<conformance::Report, String> {
    let first = CudaBackend::new(ordinal).map_err(|e| e.to_string())?;
    drop(first);
    let make = move || {
        Arc::new(CudaBackend::new(ordinal).expect("the device opened a moment ago"))
            as Arc<dyn GpuBackend>
    };
    Ok(conformance::run_each(&make))
}

#[test]
fn conformance_on_cuda() {
    let r = match run_on_cuda(0) {
        Ok(r) => r,
        Err(reason) => {
            println!("skipped: {reason}");
            return;
        }
    };
    for (name, why) in &r.skipped {
        println!("{name}: {why}");
    }
    println!(
        "{} passed, {} skipped, {} failed of {}",
        r.passed.len(),
        r.skipped.len(),
        r.failed.len(),
        CASES.len()
    );
    assert!(r.failed.is_empty(), "failed: {:#?}", r.failed);
    assert_eq!(r.passed.len() + r.skipped.len(), CASES.len());
}
