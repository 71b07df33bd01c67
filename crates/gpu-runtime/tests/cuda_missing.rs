//! `CudaBackend::new` on a machine without the CUDA driver: a typed error
//! naming the missing library, never a panic; `default_backend` falls back
//! to the CPU backend.

#![cfg(feature = "cuda")]

use metrale_gpu_runtime::GpuError;
use metrale_gpu_runtime::cuda::{CudaBackend, driver_present};

#[test]
fn missing_driver_is_an_error_naming_it() {
    if driver_present() {
        println!("skipped: the CUDA driver library is present on this machine");
        return;
    }
    let e = CudaBackend::new(0)
        .err()
        .expect("no driver, yet a backend opened");
    assert!(matches!(e, GpuError::Unsupported { .. }), "{e:?}");
    assert_eq!(
        e.to_string(),
        "CudaBackend::new(device 0): the CUDA driver library (libcuda.so.1) is not \
         installed or not on the loader path"
    );
    // Asking again gives the same answer (nothing was half-initialised).
    assert_eq!(
        CudaBackend::new(3).err().unwrap().to_string().len(),
        e.to_string().len()
    );
    assert_eq!(metrale_gpu_runtime::default_backend().name(), "cpu");
}

#[test]
fn a_device_that_does_not_exist_is_an_error() {
    let e = CudaBackend::new(1 << 20).err().expect("device 2^20 opened");
    assert!(
        e.to_string()
            .starts_with("CudaBackend::new(device 1048576)"),
        "{e}"
    );
}
