//! Helpers shared by the subcommands: byte formatting, progress bars, and
//! the default checkpoint location.
//!
//! Progress bars draw on stderr and hide themselves when stderr is not a
//! terminal, so scripted use and tests see only the results on stdout.

use std::path::PathBuf;
use std::time::Duration;

use indicatif::{ProgressBar, ProgressStyle};
use metrale_model_layers::layers::ple::ids::{SPLITMIX64_GAMMA, splitmix64};

use super::{CmdError, input};

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

/// splitmix64: the one small deterministic generator behind the synthetic
/// workloads and fault schedules, the same on every platform.
/// It steps the state by the splitmix64 increment and returns the
/// production [`splitmix64`] of the previous state.
pub fn splitmix(v: &mut u64) -> u64 {
    let z = splitmix64(*v);
    *v = v.wrapping_add(SPLITMIX64_GAMMA);
    z
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
    fn byte_sizes_read_well() {
        assert_eq!(bytes(512), "512 B");
        assert_eq!(bytes(1536), "1.50 KiB");
        assert_eq!(bytes(102_400_000_000), "95.37 GiB");
    }
}
