//! NVRTC driven from Rust, where the NVRTC library loads (no GPU is
//! needed): a kernel source compiles to PTX for the asked architecture, its
//! entries' parameters are read back (one per scalar argument, one
//! aggregate for a struct taken by value), the cache is used, and a broken
//! source is an error naming the file and carrying NVRTC's log. Without
//! NVRTC the test prints `skipped: <reason>` and checks nothing.

#![cfg(feature = "cuda")]

use metrale_gpu_runtime::GpuError;
use metrale_gpu_runtime::cuda::nvrtc::{self, Arch};
use metrale_gpu_runtime::cuda::{ParamClass, ptx_entries};

/// Two kernels: scalar parameters, and one struct by value.
const SOURCE: &str = r#"
struct ScaleArgs {
    float* x;
    unsigned int n;
    float by;
};
static_assert(sizeof(ScaleArgs) == 16, "ScaleArgs");

extern "C" __global__ void scale(float* x, unsigned int n, float by) {
    for (unsigned int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
        x[i] *= by;
    }
}

extern "C" __global__ void scale_struct(ScaleArgs a) {
    for (unsigned int i = blockIdx.x * blockDim.x + threadIdx.x; i < a.n; i += gridDim.x * blockDim.x) {
        a.x[i] *= a.by;
    }
}
"#;
const H100: Arch = Arch { major: 9, minor: 0 };

#[test]
fn sources_compile_and_are_cached() {
    if let Err(e) = nvrtc::probe() {
        println!("skipped: {e}");
        return;
    }
    let ptx = nvrtc::compile_ptx("scale.cu", SOURCE, H100).expect("the source compiles");
    assert!(ptx.contains(".target sm_90"), "PTX for compute_90");
    let entries = ptx_entries(&ptx);
    use ParamClass::{F32, Int32, Int64, Other};
    assert_eq!(entries["scale"], [Int64, Int32, F32]);
    assert_eq!(entries["scale_struct"], [Other(16)]);
    assert_eq!(entries.len(), 2, "{:?}", entries.keys());

    // Through the cache: a second call reads the file the first wrote.
    let dir = std::env::temp_dir().join(format!("metrale-nvrtc-cache-{}", std::process::id()));
    // SAFETY: this is the only test in this binary, so no other thread reads
    // the environment while it is changed.
    unsafe { std::env::set_var("XDG_CACHE_HOME", &dir) };
    let a = nvrtc::compile_ptx_cached("scale.cu", SOURCE, H100).unwrap();
    let path = nvrtc::cache_path(
        &nvrtc::cache_root().unwrap(),
        "scale.cu",
        SOURCE,
        H100,
        nvrtc::version().unwrap(),
    );
    assert!(
        path.starts_with(dir.join("metrale-ple/ptx/compute_90")),
        "{path:?}"
    );
    assert_eq!(std::fs::read_to_string(&path).unwrap(), a);
    assert_eq!(
        nvrtc::compile_ptx_cached("scale.cu", SOURCE, H100).unwrap(),
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
