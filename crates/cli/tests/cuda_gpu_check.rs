//! The device-facing parts of the command line without a device:
//! - the `gpu_check` example, run with a CPU backend standing in for the
//!   device (`--cpu-stand-in`), writes a JSON report in which every check
//!   passed and which says it is a stand-in;
//! - `gpu_check` on the CUDA device, where none opens (or without the
//!   `cuda` feature), says `no CUDA device: <reason>` and exits with status
//!   2: no fake pass;
//! - `metrale-ple run --device cuda` is a clear error where no device
//!   opens, and `--device` refuses what is not a device.
//!
//! The no-device cases ask for device 2^20, which no machine has.

use std::path::PathBuf;
use std::process::Command;

use serde_json::Value;

/// The `gpu_check` example, built by `cargo test` beside the test binaries.
fn gpu_check() -> Option<PathBuf> {
    let exe = std::env::current_exe().ok()?;
    let profile_dir = exe.parent()?.parent()?;
    let p = profile_dir.join("examples").join("gpu_check");
    p.exists().then_some(p)
}

#[test]
fn gpu_check_on_a_cpu_stand_in_passes_and_says_so() {
    let Some(exe) = gpu_check() else {
        println!("skipped: the gpu_check example was not built with the tests");
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("r.json");
    let o = Command::new(&exe)
        .arg("--cpu-stand-in")
        .arg(&out)
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "{err}");
    let v: Value = serde_json::from_str(&std::fs::read_to_string(&out).unwrap()).unwrap();
    assert_eq!(v["stand_in"], true);
    assert_eq!(v["passed"], true, "{v:#}");
    let checks = v["checks"].as_array().unwrap();
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
    assert!(
        m.iter()
            .filter(|x| x.get("skipped").is_none())
            .all(|x| x["value"].as_f64().unwrap() > 0.0
                && x["baseline_value"].as_f64().unwrap() > 0.0)
    );
    assert!(err.contains("stand-in"), "{err}");
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
    let o = Command::new(env!("CARGO_BIN_EXE_metrale-ple"))
        .args(["run", "--device", "tpu"])
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&o.stderr).contains("cuda:N"));
}
