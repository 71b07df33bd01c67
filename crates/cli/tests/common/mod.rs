//! Helpers the `run` end-to-end tests share: the binary with its cache
//! under a temporary directory, and counts read out of its JSON report.

use std::path::Path;
use std::process::{Command, Output};

use serde_json::Value;

/// The binary, with `cache` as its cache directory and no `RUST_LOG`.
pub fn bin(cache: &Path) -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_metrale-ple"));
    c.env_remove("RUST_LOG").env("XDG_CACHE_HOME", cache);
    c
}

/// Run the binary with `args`: its output, stdout and stderr.
pub fn run(cache: &Path, args: &[&str]) -> (Output, String, String) {
    let o = bin(cache).args(args).output().expect("the binary runs");
    let out = String::from_utf8_lossy(&o.stdout).into_owned();
    let err = String::from_utf8_lossy(&o.stderr).into_owned();
    (o, out, err)
}

/// The count at `path` of `v`.
pub fn count(v: &Value, path: &[&str]) -> u64 {
    let mut x = v;
    for p in path {
        x = &x[*p];
    }
    x.as_u64()
        .unwrap_or_else(|| panic!("{path:?} is not a count: {v}"))
}
