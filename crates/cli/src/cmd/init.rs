//! `metrale-ple init`: write a deterministic synthetic checkpoint.
//!
//! Random weights from `--seed`, the real hash constants, and for
//! `flagship` and the family presets (`engram-demo`, `deepseek-v4.1`,
//! `longcat-flash-lite`) the real geometry, config keys and tensor names
//! with the table cut to `--table-rows` rows per site (ids folded into
//! them as `id % rows`, see README.md).

use std::path::PathBuf;

use clap::{Args, ValueEnum};
use metrale_checkpoint::synth::{planned_bytes, write_synthetic};
use metrale_checkpoint::{InitOptions, Preset, TableDType};

use super::common::{byte_bar, bytes, cache_root};
use super::{CmdError, failure, input};

/// A geometry preset.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum PresetArg {
    /// Hidden 64, two sites, ~200k-row tables (12 MiB): seconds to write.
    Tiny,
    /// Hidden 256, one site, a ~2M-row table (128 MiB).
    Small,
    /// The real Qwen4Exp geometry; the table is cut to --table-rows.
    Flagship,
    /// The Engram demo (two layers, orders 2 and 3, the short conv); the
    /// table is cut to --table-rows.
    EngramDemo,
    /// DeepSeek-V4.1's Engram (two layers, orders 2 to 4, FP8 block rows,
    /// no conv); the table is cut to --table-rows.
    #[value(name = "deepseek-v4.1")]
    DeepseekV41,
    /// LongCat-Flash-Lite's n-gram embedding (12 sub-tables at the input);
    /// the sub-tables are cut to --table-rows in all.
    LongcatFlashLite,
}

impl PresetArg {
    /// The checkpoint crate's preset.
    pub fn preset(self) -> Preset {
        match self {
            PresetArg::Tiny => Preset::Tiny,
            PresetArg::Small => Preset::Small,
            PresetArg::Flagship => Preset::Flagship,
            PresetArg::EngramDemo => Preset::EngramDemo,
            PresetArg::DeepseekV41 => Preset::DeepseekV41,
            PresetArg::LongcatFlashLite => Preset::LongcatFlashLite,
        }
    }
}

/// The table element type.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum DTypeArg {
    /// BF16 rows.
    Bf16,
    /// FP8 E4M3 rows with a per-row f32 scale.
    Fp8,
    /// FP8 E4M3 rows with a UE8M0 scale per 32 values, inline (264 bytes a
    /// row of 256).
    Fp8Block,
}

/// Arguments of `init`.
#[derive(Args, Debug)]
#[command(
    after_help = "Example:\n  metrale-ple init /tmp/flagship --preset flagship --table-rows 1000000 --dtype fp8"
)]
pub struct InitArgs {
    /// Where to write the checkpoint (must not exist, or be empty).
    /// Default: <cache dir>/metrale-ple/<preset>, which `run` uses for tiny.
    pub dir: Option<PathBuf>,
    /// The geometry.
    #[arg(long, value_enum, default_value = "tiny")]
    pub preset: PresetArg,
    /// Table rows stored per site, rounded up to equal shards (or LongCat
    /// sub-tables); ids are folded into them. Default: the full table
    /// (tiny, small) or 1048576 (flagship and the family presets).
    #[arg(long)]
    pub table_rows: Option<u64>,
    /// Table element type. Default: the family's (fp8-block for
    /// deepseek-v4.1, bf16 for the rest).
    #[arg(long, value_enum)]
    pub dtype: Option<DTypeArg>,
    /// Seed of the random weights (the hash constants are the real ones).
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
}

/// The default checkpoint directory of a preset.
pub fn default_dir(p: Preset) -> Result<PathBuf, CmdError> {
    Ok(cache_root()?.join(p.name()))
}

/// Run `init`.
pub fn run(a: InitArgs) -> Result<(), CmdError> {
    let preset = a.preset.preset();
    let dir = match a.dir {
        Some(d) => d,
        None => default_dir(preset)?,
    };
    let opts = InitOptions {
        preset,
        table_rows: a.table_rows,
        dtype: match a.dtype {
            None => preset.default_dtype(),
            Some(DTypeArg::Bf16) => TableDType::Bf16,
            Some(DTypeArg::Fp8) => TableDType::Fp8,
            Some(DTypeArg::Fp8Block) => TableDType::Fp8Block,
        },
        seed: a.seed,
    };
    let g = write_with_progress(&dir, &opts)?;
    println!(
        "wrote {} checkpoint to {} ({} sites, {} of tensors{})",
        preset.name(),
        dir.display(),
        g.sites(),
        bytes(planned_bytes(&opts).map_err(input)?),
        match g.table_rows {
            Some(r) => format!(", table cut to {r} rows per site"),
            None => String::new(),
        }
    );
    Ok(())
}

/// Write `opts` into `dir` behind a progress bar.
pub fn write_with_progress(
    dir: &std::path::Path,
    opts: &InitOptions,
) -> Result<metrale_model_layers::layers::ple::ModelSpec, CmdError> {
    use metrale_checkpoint::CheckpointError;
    let total = planned_bytes(opts).map_err(input)?;
    if let Some(parent) = dir.parent().filter(|p| !p.as_os_str().is_empty()) {
        std::fs::create_dir_all(parent)
            .map_err(|e| failure(anyhow::anyhow!("creating {}: {e}", parent.display())))?;
    }
    let pb = byte_bar(total, "init");
    tracing::info!(dir = %dir.display(), preset = opts.preset.name(), total, "writing checkpoint");
    let r = write_synthetic(dir, opts, &mut |done, _| pb.set_position(done));
    pb.finish_and_clear();
    r.map_err(|e| match e {
        CheckpointError::Io { .. } => failure(e),
        _ => input(e),
    })
}
