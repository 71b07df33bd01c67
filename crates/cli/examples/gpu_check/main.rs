//! `gpu_check`: the CUDA backend checked against the CPU backend, and the
//! device measured beside same-run baselines; one JSON file of results.
//!
//! ```text
//! gpu_check [--ordinal N] [--quick] [--cpu-stand-in] [OUT.json]
//! ```
//!
//! `OUT.json` defaults to `$OUT/gpu-check.json`, else `gpu-check.json`.
//! Sections, in order (see each module):
//! - `conformance`: the backend conformance suite on the device;
//! - `compare`: the layer forward (prefill, token-by-token decode, batched
//!   decode, decode graphs) on every table tier, BF16 and FP8, against the
//!   CPU backend on the same synthetic checkpoint, and an engine lifecycle;
//! - `measure`: hash, gather, copies, layer and decode-step throughput.
//!
//! Without a device (or built without the `cuda` feature) it prints `no
//! CUDA device: <reason>` and exits with status 2: nothing is checked, and
//! nothing passes. `--cpu-stand-in` runs every section with a second CPU
//! backend in the device's place (small sizes): it checks the harness
//! itself, never a GPU; its JSON says `"stand_in": true`.
//!
//! Exit status: 0 when every check passed, 1 when one failed, 2 without a
//! device or on a usage error.

mod compare;
mod conformance;
mod measure;
mod report;
mod target;

use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;

use metrale_gpu_runtime::cpu::CpuBackend;
use metrale_gpu_runtime::gpu::GpuBackend;

use report::Report;
pub use target::Target;

struct Args {
    ordinal: usize,
    quick: bool,
    stand_in: bool,
    out: PathBuf,
}

fn parse_args() -> Result<Args, String> {
    let mut a = Args {
        ordinal: 0,
        quick: false,
        stand_in: false,
        out: std::env::var_os("OUT")
            .filter(|o| !o.is_empty())
            .map_or_else(|| PathBuf::from("."), PathBuf::from)
            .join("gpu-check.json"),
    };
    let mut it = std::env::args().skip(1);
    while let Some(arg) = it.next() {
        match arg.as_str() {
            "--quick" => a.quick = true,
            "--cpu-stand-in" => a.stand_in = true,
            "--ordinal" => {
                let v = it.next().ok_or("--ordinal needs a value")?;
                a.ordinal = v
                    .parse()
                    .map_err(|_| format!("--ordinal {v}: not a device ordinal"))?;
            }
            "-h" | "--help" => {
                return Err(
                    "usage: gpu_check [--ordinal N] [--quick] [--cpu-stand-in] [OUT.json]".into(),
                );
            }
            s if s.starts_with('-') => return Err(format!("unknown flag {s}")),
            path => a.out = PathBuf::from(path),
        }
    }
    Ok(a)
}

/// The device target, or why there is none.
fn open_target(a: &Args) -> Result<Target, String> {
    if a.stand_in {
        return Ok(Target {
            make: Box::new(|| Arc::new(CpuBackend::new()) as Arc<dyn GpuBackend>),
            name: "cpu (stand-in for a device; nothing here ran on a GPU)".into(),
            stand_in: true,
            quick: true,
        });
    }
    open_cuda(a.ordinal, a.quick)
}

#[cfg(feature = "cuda")]
fn open_cuda(ordinal: usize, quick: bool) -> Result<Target, String> {
    use metrale_gpu_runtime::cuda::CudaBackend;
    let first = CudaBackend::new(ordinal).map_err(|e| e.to_string())?;
    let name = format!(
        "cuda:{ordinal} {} (sm_{}{})",
        first.device_name(),
        first.arch().major,
        first.arch().minor
    );
    drop(first);
    Ok(Target {
        make: Box::new(move || {
            Arc::new(CudaBackend::new(ordinal).expect("the device opened a moment ago"))
                as Arc<dyn GpuBackend>
        }),
        name,
        stand_in: false,
        quick,
    })
}

#[cfg(not(feature = "cuda"))]
fn open_cuda(_ordinal: usize, _quick: bool) -> Result<Target, String> {
    Err("built without the `cuda` feature (build with --features cuda)".into())
}

fn main() -> ExitCode {
    let args = match parse_args() {
        Ok(a) => a,
        Err(e) => {
            eprintln!("gpu_check: {e}");
            return ExitCode::from(2);
        }
    };
    let target = match open_target(&args) {
        Ok(t) => t,
        Err(reason) => {
            eprintln!("no CUDA device: {reason}");
            return ExitCode::from(2);
        }
    };
    eprintln!("gpu_check: on {}", target.name);
    let scratch = match tempfile::Builder::new().prefix("gpu-check-").tempdir() {
        Ok(d) => d,
        Err(e) => {
            eprintln!("gpu_check: no scratch directory: {e}");
            return ExitCode::from(2);
        }
    };
    let mut report = Report::new(&target);
    conformance::run(&target, &mut report);
    compare::run(&target, scratch.path(), &mut report);
    measure::run(&target, scratch.path(), &mut report);
    let ok = report.ok();
    if let Err(e) = report.write(&args.out) {
        eprintln!("gpu_check: writing {}: {e}", args.out.display());
        return ExitCode::from(1);
    }
    eprintln!(
        "gpu_check: {} ({} checks, {} failed); results in {}",
        if ok { "passed" } else { "FAILED" },
        report.checks(),
        report.failures(),
        args.out.display()
    );
    if ok {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(1)
    }
}
