//! The device-facing parts of the command line without a device:
//! - the `gpu_check` example's sections (its modules, compiled into this
//!   test), run with a CPU backend standing in for the device, give a
//!   report in which every check passed and which says it is a stand-in;
//! - `gpu_check` on the CUDA device, where none opens (or without the
//!   `cuda` feature), says `no CUDA device: <reason>` and exits with status
//!   2: no fake pass;
//! - `metrale-ple run --device cuda` and (with the `bench` feature) `bench
//!   --device cuda` are clear errors where no device opens, and `--device` refuses what is not a
//!   device.
//!
//! The no-device cases ask for device 2^20, which no machine has.

#[path = "../examples/gpu_check/compare.rs"]
mod compare;
#[path = "../examples/gpu_check/conformance.rs"]
mod conformance;
#[path = "../examples/gpu_check/measure.rs"]
mod measure;
#[path = "../examples/gpu_check/report.rs"]
mod report;
#[path = "../examples/gpu_check/target.rs"]
mod target;

use std::path::PathBuf;
use std::process::Command;
use std::sync::Arc;

use metrale_gpu_runtime::cpu::CpuBackend;
use metrale_gpu_runtime::gpu::GpuBackend;
use serde_json::Value;

use report::{Diff, Report};
pub use target::Target;

/// The `gpu_check` example, built by `cargo test` beside the test binaries.
fn gpu_check() -> Option<PathBuf> {
    let exe = std::env::current_exe().ok()?;
    let profile_dir = exe.parent()?.parent()?;
    let p = profile_dir.join("examples").join("gpu_check");
    p.exists().then_some(p)
}

#[test]
fn gpu_check_on_a_cpu_stand_in_passes_and_says_so() {
    let target = Target {
        make: Box::new(|| Arc::new(CpuBackend::new()) as Arc<dyn GpuBackend>),
        name: "cpu stand-in".into(),
        stand_in: true,
        quick: true,
    };
    let dir = tempfile::tempdir().unwrap();
    let mut report = Report::new(&target);
    conformance::run(&target, &mut report);
    compare::run(&target, dir.path(), &mut report);
    measure::run(&target, dir.path(), &mut report);
    assert_eq!(report.failures(), 0, "{:#}", report.to_json());
    assert!(report.ok());
    let out = dir.path().join("r.json");
    report.write(&out).unwrap();
    let v: Value = serde_json::from_str(&std::fs::read_to_string(&out).unwrap()).unwrap();
    assert_eq!(v["stand_in"], true);
    assert_eq!(v["passed"], true);
    let checks = v["checks"].as_array().unwrap();
    assert_eq!(checks.len(), report.checks());
    assert!(checks.len() >= 30, "{} checks", checks.len());
    assert!(checks.iter().all(|c| c["passed"] == true));
    for needle in [
        "conformance suite",
        "layer bf16 resident",
        "layer fp8 mapped",
        "layer fp8 cached: decode graphs",
        "engine lifecycle",
        "engine drive",
    ] {
        assert!(
            checks
                .iter()
                .any(|c| c["name"].as_str().unwrap().starts_with(needle)),
            "no check '{needle}'"
        );
    }
    let m = v["measurements"].as_array().unwrap();
    assert!(m.len() >= 6, "{m:#?}");
    assert!(m.iter().filter(|x| x.get("skipped").is_none()).all(|x| {
        x["value"].as_f64().unwrap() > 0.0 && x["baseline_value"].as_f64().unwrap() > 0.0
    }));
}

/// The comparison statistics: bit-identity, the tolerance, NaN.
#[test]
fn diffs_count_bits_tolerance_and_nan() {
    let d = Diff::of(&[1.0, 2.0], &[1.0, 2.0], 0.0, 0.0);
    assert!(d.identical() && d.outside == 0 && d.max_abs == 0.0);
    let d = Diff::of(&[1.0, 2.0001], &[1.0, 2.0], 1e-4, 1e-4);
    assert_eq!((d.differing, d.outside), (1, 0));
    assert!((d.max_abs - 1e-4).abs() < 1e-6 && d.mean_abs > 0.0);
    let d = Diff::of(&[1.0, 2.1], &[1.0, 2.0], 1e-4, 1e-4);
    assert_eq!(d.outside, 1);
    let d = Diff::of(&[f32::NAN], &[0.0], 1.0, 1.0);
    assert_eq!(d.outside, 1);
    assert!(d.max_abs.is_infinite());
    assert_eq!(Diff::of(&[1.0], &[1.0, 2.0], 1.0, 1.0).outside, 1);
}

#[test]
fn gpu_check_without_a_device_fails_plainly() {
    let Some(exe) = gpu_check() else {
        println!("skipped: the gpu_check example was not built with the tests");
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("r.json");
    let o = Command::new(&exe)
        .args(["--ordinal", "1048576"])
        .arg(&out)
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(err.starts_with("no CUDA device: "), "{err}");
    assert!(!out.exists(), "no report without a device");
}

#[test]
fn run_on_a_missing_cuda_device_is_a_clear_error() {
    let cache = tempfile::tempdir().unwrap();
    let o = Command::new(env!("CARGO_BIN_EXE_metrale-ple"))
        .env("XDG_CACHE_HOME", cache.path())
        .args(["run", "--device", "cuda:1048576", "--sequences", "1"])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success());
    assert!(err.contains("--device cuda:1048576"), "{err}");
    if cfg!(feature = "cuda") {
        assert!(err.contains("no CUDA device"), "{err}");
    } else {
        assert!(err.contains("`cuda` feature"), "{err}");
    }
    if cfg!(feature = "bench") {
        let scratch = tempfile::tempdir().unwrap();
        let o = Command::new(env!("CARGO_BIN_EXE_metrale-ple"))
            .args(["bench", "--smoke", "--device", "cuda:1048576", "--dir"])
            .arg(scratch.path())
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(!o.status.success());
        assert!(err.contains("--device cuda:1048576"), "{err}");
        assert_eq!(
            std::fs::read_dir(scratch.path()).unwrap().count(),
            0,
            "bench left scratch files"
        );
    }
    let o = Command::new(env!("CARGO_BIN_EXE_metrale-ple"))
        .args(["run", "--device", "tpu"])
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&o.stderr).contains("cuda:N"));
}
