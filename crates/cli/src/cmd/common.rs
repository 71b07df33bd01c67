//! Helpers shared by the subcommands: byte formatting, progress bars, the
//! default checkpoint location, and the backend a `--device` names.
//!
//! Progress bars draw on stderr and hide themselves when stderr is not a
//! terminal, so scripted use and tests see only the results on stdout.

use std::fmt;
use std::path::PathBuf;
use std::str::FromStr;
use std::sync::Arc;
use std::time::Duration;

use indicatif::{ProgressBar, ProgressStyle};
use metrale_gpu_runtime::cpu::CpuBackend;
use metrale_gpu_runtime::gpu::GpuBackend;
use metrale_storage::splitmix::SplitMix64;

use super::{CmdError, input};

/// The backend a subcommand runs on: `cpu` (the default) or `cuda[:N]`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Device {
    /// The CPU backend.
    #[default]
    Cpu,
    /// CUDA device `N` (`cuda` is `cuda:0`).
    Cuda(usize),
}

impl FromStr for Device {
    type Err = String;

    fn from_str(s: &str) -> Result<Device, String> {
        match s {
            "cpu" => Ok(Device::Cpu),
            "cuda" => Ok(Device::Cuda(0)),
            _ => match s.strip_prefix("cuda:").map(str::parse::<usize>) {
                Some(Ok(n)) => Ok(Device::Cuda(n)),
                _ => Err(format!(
                    "'{s}' is not a device: use cpu, cuda or cuda:N (N a device ordinal)"
                )),
            },
        }
    }
}

impl fmt::Display for Device {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Device::Cpu => f.write_str("cpu"),
            Device::Cuda(n) => write!(f, "cuda:{n}"),
        }
    }
}

/// Open the backend `device` names. Without the `cuda` feature a CUDA
/// device is an input error saying so; a CUDA device that does not open is
/// a failure: `no CUDA device: <reason>`.
pub fn open_backend(device: Device) -> Result<Arc<dyn GpuBackend>, CmdError> {
    match device {
        Device::Cpu => Ok(Arc::new(CpuBackend::new())),
        Device::Cuda(n) => open_cuda(n),
    }
}

#[cfg(feature = "cuda")]
fn open_cuda(n: usize) -> Result<Arc<dyn GpuBackend>, CmdError> {
    match metrale_gpu_runtime::cuda::CudaBackend::new(n) {
        Ok(b) => Ok(Arc::new(b)),
        Err(e) => Err(super::failure(anyhow::anyhow!(
            "--device cuda:{n}: no CUDA device: {e}"
        ))),
    }
}

#[cfg(not(feature = "cuda"))]
fn open_cuda(n: usize) -> Result<Arc<dyn GpuBackend>, CmdError> {
    Err(input(anyhow::anyhow!(
        "--device cuda:{n}: this metrale-ple has no CUDA support (it was compiled without \
         the `cuda` feature)"
    )))
}

/// The per-user cache directory: `$XDG_CACHE_HOME/metrale-ple`, else
/// `$HOME/.cache/metrale-ple`.
pub fn cache_root() -> Result<PathBuf, CmdError> {
    if let Some(x) = std::env::var_os("XDG_CACHE_HOME").filter(|v| !v.is_empty()) {
        return Ok(PathBuf::from(x).join("metrale-ple"));
    }
    match std::env::var_os("HOME").filter(|v| !v.is_empty()) {
        Some(h) => Ok(PathBuf::from(h).join(".cache").join("metrale-ple")),
        None => Err(input(anyhow::anyhow!(
            "neither XDG_CACHE_HOME nor HOME is set; give a checkpoint directory explicitly"
        ))),
    }
}

/// Zipf-distributed token ids over the vocabulary, never EOS: ranks from
/// the workspace's one Zipf sampler, drawn with the splitmix64 stream.
pub struct Zipf {
    ranks: metrale_storage::zipf::Zipf,
    vocab: u64,
    eos: u32,
}

impl Zipf {
    pub fn new(vocab: u64, eos: u32, s: f64) -> Zipf {
        Zipf {
            ranks: metrale_storage::zipf::Zipf::new(vocab as usize, s),
            vocab,
            eos,
        }
    }

    pub fn sample(&self, state: &mut u64) -> u32 {
        let u = (SplitMix64::step(state) >> 11) as f64 / (1u64 << 53) as f64;
        let rank = self.ranks.rank(u) as u64;
        // Scatter ranks over the vocabulary so frequent tokens are not all
        // small ids.
        let t = (rank.wrapping_mul(0x9E37_79B1) % self.vocab) as u32;
        if t == self.eos {
            ((t as u64 + 1) % self.vocab) as u32
        } else {
            t
        }
    }
}

/// `1.50 GiB`-style sizes.
pub fn bytes(n: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = n as f64;
    let mut u = 0;
    while v >= 1024.0 && u + 1 < UNITS.len() {
        v /= 1024.0;
        u += 1;
    }
    if u == 0 {
        format!("{n} B")
    } else {
        format!("{v:.2} {}", UNITS[u])
    }
}

/// A byte-counting progress bar on stderr (hidden when stderr is not a
/// terminal, as indicatif does by default).
pub fn byte_bar(total: u64, msg: &str) -> ProgressBar {
    let pb = ProgressBar::new(total);
    pb.set_style(
        ProgressStyle::with_template(
            "{msg:>10} [{bar:40}] {bytes}/{total_bytes} {bytes_per_sec} eta {eta}",
        )
        .expect("a valid template")
        .progress_chars("=> "),
    );
    pb.set_message(msg.to_string());
    pb.enable_steady_tick(Duration::from_millis(200));
    pb
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn zipf_never_draws_eos_and_favours_low_ranks() {
        let z = Zipf::new(64, 5, 1.1);
        let mut st = 3;
        let mut counts = [0u32; 64];
        for _ in 0..20_000 {
            let t = z.sample(&mut st);
            assert_ne!(t, 5);
            counts[t as usize] += 1;
        }
        // The most frequent rank maps to token 0, the next to
        // 0x9E3779B1 % 64 = 49.
        let top = (0..64).max_by_key(|&i| counts[i]).unwrap();
        assert_eq!(top, 0);
        assert!(counts[49] > counts[10] && counts[0] > 2 * counts[49] / 3);
    }

    #[test]
    fn devices_parse_and_print() {
        assert_eq!("cpu".parse::<Device>(), Ok(Device::Cpu));
        assert_eq!("cuda".parse::<Device>(), Ok(Device::Cuda(0)));
        assert_eq!("cuda:3".parse::<Device>(), Ok(Device::Cuda(3)));
        for bad in ["gpu", "cuda:", "cuda:x", "cuda:-1", "CPU"] {
            let e = bad.parse::<Device>().unwrap_err();
            assert!(e.contains(bad) && e.contains("cuda:N"), "{e}");
        }
        assert_eq!(Device::Cuda(2).to_string(), "cuda:2");
        assert_eq!(Device::default().to_string(), "cpu");
        assert_eq!(open_backend(Device::Cpu).unwrap().name(), "cpu");
    }

    #[test]
    fn a_cuda_device_that_does_not_open_is_a_clear_error() {
        let e = open_backend(Device::Cuda(1 << 20)).err().unwrap();
        let msg = e.to_string();
        assert!(msg.starts_with("--device cuda:1048576: "), "{msg}");
        if cfg!(feature = "cuda") {
            assert!(msg.contains("no CUDA device"), "{msg}");
            assert_eq!(e.exit_status(), super::super::EXIT_FAILURE);
        } else {
            assert!(msg.contains("`cuda` feature"), "{msg}");
            assert_eq!(e.exit_status(), super::super::EXIT_INPUT);
        }
    }

    #[test]
    fn byte_sizes_read_well() {
        assert_eq!(bytes(512), "512 B");
        assert_eq!(bytes(1536), "1.50 KiB");
        assert_eq!(bytes(102_400_000_000), "95.37 GiB");
    }
}
