//! The PLE kernel source compiled by NVRTC from Rust, where the NVRTC
//! library loads (no GPU is needed): every kernel the CPU backend registers
//! is in the PTX with a parameter list that accepts the host kernel's
//! signature, the cache is used, and a broken source is an error naming the
//! file and carrying NVRTC's log. Without NVRTC the test prints
//! `skipped: <reason>` and checks nothing.

#![cfg(feature = "cuda")]

use metrale_gpu_runtime::GpuError;
use metrale_gpu_runtime::cuda::nvrtc::{self, Arch};
use metrale_gpu_runtime::cuda::ptx_entries;
use metrale_gpu_runtime::gpu::ArgKind;

const PLE_CU: &str = include_str!("../../model-layers/kernels/ple.cu");
const H100: Arch = Arch { major: 9, minor: 0 };

/// The signatures `register_cpu_kernels` (model-layers) gives the host
/// kernels, and those of the device-only kernels.
fn signatures() -> Vec<(&'static str, Vec<ArgKind>)> {
    use ArgKind::{F32, Ptr, U32, U64};
    vec![
        ("gather", vec![Ptr, U32, U32, U32, Ptr]),
        ("gather_runs", vec![Ptr, U32, U32, U32, Ptr, U32, U32]),
        ("project", vec![Ptr, Ptr, Ptr, U32, U32, U32]),
        (
            "project_range",
            vec![Ptr, Ptr, Ptr, U32, U32, U32, U32, U32, U32],
        ),
        (
            "gate",
            vec![Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, U32, U32, U32, F32],
        ),
        (
            "gate_norms",
            vec![
                Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, U32, U32, U32, F32, F32, F32, U32, U32,
            ],
        ),
        ("bias_add", vec![Ptr, Ptr, U32, U32]),
        ("mean_add", vec![Ptr, Ptr, U32, F32]),
        ("conv", vec![Ptr, Ptr, Ptr, Ptr, Ptr, U32, U32, U32, U32]),
        (
            "conv_batch",
            vec![Ptr, Ptr, Ptr, Ptr, Ptr, U32, U32, U32, U32],
        ),
        (
            "hash",
            vec![Ptr, U32, Ptr, U32, Ptr, Ptr, Ptr, U32, U32, U32, Ptr],
        ),
        ("gather_ids", vec![Ptr, U32, U32, U32, Ptr, Ptr, U64, Ptr]),
        ("rms_norm", vec![Ptr, Ptr, Ptr, U32, U32, U32, F32]),
        ("highway_add", vec![Ptr, Ptr, U32]),
    ]
}

#[test]
fn ple_kernels_compile_with_the_host_signatures() {
    if let Err(e) = nvrtc::probe() {
        println!("skipped: {e}");
        return;
    }
    let ptx = nvrtc::compile_ptx("ple.cu", PLE_CU, H100).expect("ple.cu compiles");
    assert!(ptx.contains(".target sm_90"), "PTX for compute_90");
    let entries = ptx_entries(&ptx);
    for (name, sig) in signatures() {
        let params = entries
            .get(name)
            .unwrap_or_else(|| panic!("kernel {name} missing; PTX has {:?}", entries.keys()));
        assert_eq!(params.len(), sig.len(), "{name}: parameter count");
        for (i, (p, k)) in params.iter().zip(&sig).enumerate() {
            assert!(
                p.accepts(*k),
                "{name}: parameter {i} is {p:?}, the host passes {k:?}"
            );
        }
    }
    assert_eq!(entries.len(), signatures().len(), "{:?}", entries.keys());

    // Through the cache: a second call reads the file the first wrote.
    let dir = std::env::temp_dir().join(format!("metrale-nvrtc-cache-{}", std::process::id()));
    // SAFETY: this is the only test in this binary, so no other thread reads
    // the environment while it is changed.
    unsafe { std::env::set_var("XDG_CACHE_HOME", &dir) };
    let a = nvrtc::compile_ptx_cached("ple.cu", PLE_CU, H100).unwrap();
    let path = nvrtc::cache_path(
        &nvrtc::cache_root().unwrap(),
        "ple.cu",
        PLE_CU,
        H100,
        nvrtc::version().unwrap(),
    );
    assert!(
        path.starts_with(dir.join("metrale-ple/ptx/compute_90")),
        "{path:?}"
    );
    assert_eq!(std::fs::read_to_string(&path).unwrap(), a);
    assert_eq!(
        nvrtc::compile_ptx_cached("ple.cu", PLE_CU, H100).unwrap(),
        a
    );
    std::fs::remove_dir_all(&dir).unwrap();

    // A source that does not compile: the file and NVRTC's log.
    let e = nvrtc::compile_ptx(
        "broken.cu",
        "extern \"C\" __global__ void k() { nope; }",
        H100,
    )
    .unwrap_err();
    assert!(matches!(e, GpuError::Driver { .. }), "{e:?}");
    let s = e.to_string();
    assert!(
        s.starts_with("compile broken.cu for compute_90: nvrtcCompileProgram failed"),
        "{s}"
    );
    assert!(s.contains("identifier \"nope\" is undefined"), "{s}");
}
