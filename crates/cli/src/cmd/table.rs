//! `metrale-ple table pack`: rewrite safetensors files so their data
//! sections start on a 4 KiB boundary (what O_DIRECT row reads want).
//!
//! SRC may be one safetensors file (DST is then a file) or a checkpoint
//! directory (DST is then a new directory holding every file packed, the
//! config and weight map copied, and is validated before the command
//! reports success). Tensor data is copied byte for byte; only header
//! padding changes.

use std::path::{Path, PathBuf};

use anyhow::Context;
use clap::{Args, Subcommand};
use metrale_checkpoint::Checkpoint;
use metrale_checkpoint::names::{CONFIG_FILE, INDEX_FILE};
use metrale_storage::pack::pack;
use metrale_storage::safetensors::Header;

use super::common::{byte_bar, bytes};
use super::{CmdError, failure, input};

/// Arguments of `table`.
#[derive(Args, Debug)]
pub struct TableArgs {
    #[command(subcommand)]
    cmd: TableCmd,
}

#[derive(Subcommand, Debug)]
enum TableCmd {
    /// Rewrite a shard file, or every file of a checkpoint, 4 KiB-aligned.
    #[command(
        after_help = "Examples:\n  metrale-ple table pack ckpt/model-00002-of-00005.safetensors /fast/shard.safetensors\n  metrale-ple table pack ~/.cache/metrale-ple/tiny /tmp/tiny-packed"
    )]
    Pack(PackArgs),
}

/// Arguments of `table pack`.
#[derive(Args, Debug)]
pub struct PackArgs {
    /// A safetensors file or a checkpoint directory.
    pub src: PathBuf,
    /// The file or directory to write (must not exist for a directory).
    pub dst: PathBuf,
}

/// Run `table`.
pub fn run(a: TableArgs) -> Result<(), CmdError> {
    match a.cmd {
        TableCmd::Pack(p) => pack_cmd(p),
    }
}

fn pack_files(files: &[(PathBuf, PathBuf)]) -> Result<u64, CmdError> {
    let mut total = 0;
    for (src, _) in files {
        let h = Header::read(src).map_err(input)?;
        total += h.file_len - h.data_start;
    }
    let pb = byte_bar(total, "pack");
    let mut base = 0;
    for (src, dst) in files {
        tracing::info!(src = %src.display(), dst = %dst.display(), "packing");
        let r = pack(src, dst, &mut |done, _| pb.set_position(base + done));
        match r {
            Ok(rep) => {
                base += rep.data_bytes;
                tracing::info!(
                    old = rep.old_data_start,
                    new = rep.new_data_start,
                    "packed {}",
                    dst.display()
                );
            }
            Err(e) => {
                pb.finish_and_clear();
                return Err(failure(e));
            }
        }
    }
    pb.finish_and_clear();
    Ok(total)
}

fn pack_cmd(a: PackArgs) -> Result<(), CmdError> {
    if a.src.is_file() {
        let total = pack_files(&[(a.src.clone(), a.dst.clone())])?;
        let h = Header::read(&a.dst).map_err(failure)?;
        println!(
            "packed {} -> {} ({} of data at offset {})",
            a.src.display(),
            a.dst.display(),
            bytes(total),
            h.data_start
        );
        return Ok(());
    }
    if !a.src.is_dir() {
        return Err(input(anyhow::anyhow!(
            "{}: no such file or directory",
            a.src.display()
        )));
    }
    // Refuse a bad source before writing anything.
    let ck = Checkpoint::open(&a.src).map_err(input)?;
    if a.dst.exists() {
        return Err(input(anyhow::anyhow!(
            "{} already exists; pack writes a new directory",
            a.dst.display()
        )));
    }
    std::fs::create_dir_all(&a.dst)
        .with_context(|| format!("creating {}", a.dst.display()))
        .map_err(failure)?;
    let r = (|| {
        let files: Vec<(PathBuf, PathBuf)> = ck
            .files
            .iter()
            .map(|f| (a.src.join(&f.name), a.dst.join(&f.name)))
            .collect();
        let total = pack_files(&files)?;
        for name in [CONFIG_FILE, INDEX_FILE] {
            copy(&a.src.join(name), &a.dst.join(name))?;
        }
        let packed = Checkpoint::open(&a.dst).map_err(failure)?;
        if let Some(f) = packed.files.iter().find(|f| f.data_start % 4096 != 0) {
            return Err(failure(anyhow::anyhow!(
                "{}: data still at offset {}",
                f.name,
                f.data_start
            )));
        }
        Ok(total)
    })();
    match r {
        Ok(total) => {
            println!(
                "packed {} files ({} of data) from {} into {}; validation OK",
                ck.files.len(),
                bytes(total),
                a.src.display(),
                a.dst.display()
            );
            Ok(())
        }
        Err(e) => {
            let _ = std::fs::remove_dir_all(&a.dst);
            Err(e)
        }
    }
}

fn copy(src: &Path, dst: &Path) -> Result<(), CmdError> {
    std::fs::copy(src, dst)
        .with_context(|| format!("copying {} to {}", src.display(), dst.display()))
        .map_err(failure)?;
    Ok(())
}
