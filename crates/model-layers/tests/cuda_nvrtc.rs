//! `kernels/ple.cu` compiled by NVRTC from Rust, where the NVRTC library
//! loads (no GPU is needed): every kernel of [`KERNELS`] is in the PTX,
//! taking one by-value parameter the size of its Rust argument struct, and
//! the PTX has no other kernel. Without NVRTC the test prints `skipped:
//! <reason>` and checks nothing.

#![cfg(feature = "cuda")]

use metrale_gpu_runtime::cuda::nvrtc::{self, Arch};
use metrale_gpu_runtime::cuda::{ParamClass, ptx_entries};
use metrale_model_layers::layers::ple::device_kernels::PLE_CU;
use metrale_model_layers::layers::ple::kernels::args::KERNELS;

const H100: Arch = Arch { major: 9, minor: 0 };

#[test]
fn ple_kernels_take_their_argument_structs() {
    if let Err(e) = nvrtc::probe() {
        println!("skipped: {e}");
        return;
    }
    let ptx = nvrtc::compile_ptx("ple.cu", PLE_CU, H100).expect("ple.cu compiles");
    let entries = ptx_entries(&ptx);
    for (name, args) in KERNELS {
        let params = entries
            .get(name)
            .unwrap_or_else(|| panic!("kernel {name} missing; PTX has {:?}", entries.keys()));
        assert_eq!(
            params[..],
            [ParamClass::Other(args.size)],
            "{name}: one {}-byte {}",
            args.size,
            args.name
        );
    }
    assert_eq!(entries.len(), KERNELS.len(), "{:?}", entries.keys());
}
