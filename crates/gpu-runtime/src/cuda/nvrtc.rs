//! Run-time compilation of CUDA C++ kernel sources to PTX with NVRTC, cached
//! per architecture on disk.
//!
//! A source is compiled for a virtual architecture `compute_XY` (the
//! device's compute capability); the driver turns the PTX into `sm_XY`
//! machine code when the module is loaded. Products and sums are kept
//! unfused (`--fmad=false`) so kernels round exactly where their source
//! says, as the host kernels do; kernels that want a fused multiply-add call
//! `fmaf` themselves.
//!
//! Cache: `$XDG_CACHE_HOME/metrale-ple/ptx/<arch>/<hash>.ptx`, else
//! `$HOME/.cache/metrale-ple/ptx/<arch>/<hash>.ptx`. The hash covers the
//! file name, the source, the options and the NVRTC version, so a stale
//! entry is never used. Entries are written to a temporary file and renamed
//! into place, so a reader sees a whole file or none; a cache that cannot be
//! read or written only costs a compile.
//!
//! Errors name the kernel file, the architecture and carry NVRTC's log.

use std::ffi::CString;
use std::path::{Path, PathBuf};

use cudarc::nvrtc::{result as nvrtc, sys};

use crate::error::{GpuError, Result};

/// Options every compile uses, besides the architecture.
const OPTIONS: &[&str] = &["--fmad=false", "--std=c++17", "-default-device"];

/// A compute capability, `(major, minor)`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Arch {
    /// Major version (9 for Hopper).
    pub major: u32,
    /// Minor version.
    pub minor: u32,
}

impl Arch {
    /// `compute_XY`, the virtual architecture PTX is generated for.
    pub fn compute(self) -> String {
        format!("compute_{}{}", self.major, self.minor)
    }

    /// `sm_XY`, the machine architecture the driver compiles PTX to.
    pub fn sm(self) -> String {
        format!("sm_{}{}", self.major, self.minor)
    }
}

/// The PTX cache root: `$XDG_CACHE_HOME/metrale-ple/ptx`, else
/// `$HOME/.cache/metrale-ple/ptx`; `None` when neither variable is set.
pub fn cache_root() -> Option<PathBuf> {
    cache_root_from(
        std::env::var_os("XDG_CACHE_HOME").as_deref().map(Path::new),
        std::env::var_os("HOME").as_deref().map(Path::new),
    )
}

/// [`cache_root`] from explicit variable values (empty counts as unset).
pub fn cache_root_from(xdg_cache_home: Option<&Path>, home: Option<&Path>) -> Option<PathBuf> {
    let base = match xdg_cache_home.filter(|p| !p.as_os_str().is_empty()) {
        Some(x) => x.to_path_buf(),
        None => home.filter(|p| !p.as_os_str().is_empty())?.join(".cache"),
    };
    Some(base.join("metrale-ple").join("ptx"))
}

/// FNV-1a (64 bit) over `parts`, each followed by a separator byte.
fn fnv1a(parts: &[&[u8]]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for p in parts {
        for &b in p.iter().chain(&[0xFF]) {
            h ^= u64::from(b);
            h = h.wrapping_mul(0x0100_0000_01b3);
        }
    }
    h
}

/// The cache key of compiling `source` (named `file`) for `arch` with
/// NVRTC `version`.
pub fn cache_key(file: &str, source: &str, arch: Arch, version: (i32, i32)) -> String {
    let opts = OPTIONS.join(" ");
    let ver = format!("{}.{}", version.0, version.1);
    let h = fnv1a(&[
        file.as_bytes(),
        source.as_bytes(),
        arch.compute().as_bytes(),
        opts.as_bytes(),
        ver.as_bytes(),
    ]);
    format!("{h:016x}")
}

/// Where the PTX of `source` for `arch` is cached under `root`.
pub fn cache_path(
    root: &Path,
    file: &str,
    source: &str,
    arch: Arch,
    version: (i32, i32),
) -> PathBuf {
    root.join(arch.compute())
        .join(format!("{}.ptx", cache_key(file, source, arch, version)))
}

/// An error unless the NVRTC library can be loaded.
pub fn probe() -> Result<()> {
    // SAFETY: only tries to open the library by its usual names.
    if unsafe { sys::is_culib_present() } {
        Ok(())
    } else {
        Err(GpuError::unsupported(
            "NVRTC",
            "the NVRTC library (libnvrtc.so.12) is not installed or not on the loader path",
        ))
    }
}

/// The NVRTC version, `(major, minor)`.
pub fn version() -> Result<(i32, i32)> {
    probe()?;
    let (mut major, mut minor) = (0, 0);
    // SAFETY: the library is present (probed); both out-pointers are valid.
    let r = unsafe { sys::nvrtcVersion(&mut major, &mut minor) };
    r.result().map_err(|e| GpuError::Driver {
        op: "NVRTC".into(),
        call: "nvrtcVersion".into(),
        error: format!("{e:?}"),
    })?;
    Ok((major, minor))
}

/// Compile `source` (named `file` in errors and logs) to PTX for `arch`,
/// without the cache.
pub fn compile_ptx(file: &str, source: &str, arch: Arch) -> Result<String> {
    probe()?;
    let op = format!("compile {file} for {}", arch.compute());
    let fail = |call: &str, error: String| GpuError::Driver {
        op: op.clone(),
        call: call.to_string(),
        error,
    };
    let src = CString::new(source)
        .map_err(|_| GpuError::invalid(op.clone(), "the source contains a NUL byte"))?;
    let name = CString::new(file)
        .map_err(|_| GpuError::invalid(op.clone(), "the file name contains a NUL byte"))?;
    let prog = nvrtc::create_program(&src, Some(&name))
        .map_err(|e| fail("nvrtcCreateProgram", format!("{e:?}")))?;
    let mut opts: Vec<String> = vec![format!("--gpu-architecture={}", arch.compute())];
    opts.extend(OPTIONS.iter().map(|s| s.to_string()));
    // SAFETY: `prog` was just created and is destroyed once, below.
    let compiled = unsafe { nvrtc::compile_program(prog, &opts) };
    // SAFETY: as above.
    let log = unsafe { nvrtc::get_program_log(prog) }
        .map(|l| c_chars_to_string(&l))
        .unwrap_or_default();
    let out = match compiled {
        Err(e) => Err(fail(
            "nvrtcCompileProgram",
            format!("{e:?}; log:\n{}", log.trim_end()),
        )),
        // SAFETY: as above; the program compiled.
        Ok(()) => unsafe { nvrtc::get_ptx(prog) }
            .map(|p| c_chars_to_string(&p))
            .map_err(|e| fail("nvrtcGetPTX", format!("{e:?}"))),
    };
    // SAFETY: `prog` is live and not used after this.
    let _ = unsafe { nvrtc::destroy_program(prog) };
    out
}

/// [`compile_ptx`] through the on-disk cache (see the module docs).
pub fn compile_ptx_cached(file: &str, source: &str, arch: Arch) -> Result<String> {
    let ver = version()?;
    let path = cache_root().map(|r| cache_path(&r, file, source, arch, ver));
    if let Some(p) = &path
        && let Ok(ptx) = std::fs::read_to_string(p)
        && ptx.contains(".entry")
    {
        return Ok(ptx);
    }
    let ptx = compile_ptx(file, source, arch)?;
    if let Some(p) = &path {
        let _ = write_atomically(p, ptx.as_bytes());
    }
    Ok(ptx)
}

/// Write `bytes` to `path` through a temporary file renamed into place.
fn write_atomically(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    let dir = path.parent().unwrap_or(Path::new("."));
    std::fs::create_dir_all(dir)?;
    let tmp = dir.join(format!(
        ".{}.{}.tmp",
        path.file_name().and_then(|n| n.to_str()).unwrap_or("ptx"),
        std::process::id()
    ));
    std::fs::write(&tmp, bytes)?;
    std::fs::rename(&tmp, path).inspect_err(|_| {
        let _ = std::fs::remove_file(&tmp);
    })
}

/// A NUL-terminated C char buffer as a string (lossy, without the NUL).
fn c_chars_to_string(c: &[std::ffi::c_char]) -> String {
    let bytes: Vec<u8> = c.iter().map(|&b| b as u8).take_while(|&b| b != 0).collect();
    String::from_utf8_lossy(&bytes).into_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    const H90: Arch = Arch { major: 9, minor: 0 };

    #[test]
    fn cache_root_prefers_xdg_then_home() {
        let r = cache_root_from(Some(Path::new("/x/cache")), Some(Path::new("/home/u")));
        assert_eq!(r.unwrap(), Path::new("/x/cache/metrale-ple/ptx"));
        let r = cache_root_from(None, Some(Path::new("/home/u")));
        assert_eq!(r.unwrap(), Path::new("/home/u/.cache/metrale-ple/ptx"));
        let r = cache_root_from(Some(Path::new("")), Some(Path::new("/home/u")));
        assert_eq!(r.unwrap(), Path::new("/home/u/.cache/metrale-ple/ptx"));
        assert_eq!(cache_root_from(None, None), None);
    }

    #[test]
    fn cache_path_is_per_arch_and_content() {
        let root = Path::new("/c");
        let p = cache_path(root, "ple.cu", "src", H90, (12, 8));
        let s = p.to_str().unwrap();
        assert!(
            s.starts_with("/c/compute_90/") && s.ends_with(".ptx"),
            "{s}"
        );
        assert_eq!(p.file_stem().unwrap().len(), 16);
        assert_eq!(p, cache_path(root, "ple.cu", "src", H90, (12, 8)), "stable");
        let other = [
            cache_path(root, "ple.cu", "src2", H90, (12, 8)),
            cache_path(root, "x.cu", "src", H90, (12, 8)),
            cache_path(root, "ple.cu", "src", Arch { major: 8, minor: 0 }, (12, 8)),
            cache_path(root, "ple.cu", "src", H90, (12, 9)),
        ];
        for o in other {
            assert_ne!(o, p);
        }
        assert_eq!(H90.sm(), "sm_90");
    }

    #[test]
    fn atomic_write_replaces_whole_files() {
        let dir = std::env::temp_dir().join(format!("metrale-ptx-test-{}", std::process::id()));
        let p = dir.join("compute_90").join("k.ptx");
        write_atomically(&p, b"one").unwrap();
        write_atomically(&p, b"two").unwrap();
        assert_eq!(std::fs::read(&p).unwrap(), b"two");
        let left: Vec<_> = std::fs::read_dir(p.parent().unwrap()).unwrap().collect();
        assert_eq!(left.len(), 1, "no temporary file left");
        std::fs::remove_dir_all(dir).unwrap();
    }
}
