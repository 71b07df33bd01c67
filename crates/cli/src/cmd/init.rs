//! `metrale-ple init`: write a deterministic synthetic checkpoint.
//!
//! Random weights from `--seed`, the real hash constants, and for
//! `flagship` and the family presets (`engram-demo`, `deepseek-v4.1`,
//! `longcat-flash-lite`) the real geometry, config keys and tensor names
//! with the table cut to `--table-rows` rows per site (ids folded into
//! them as `id % rows`, see README.md). `--layout release` writes
//! DeepSeek-V4.1's table as the release stores it (values and F8_E8M0
//! block scales apart), which `table pack` converts to the inline rows the
//! runtime serves.

use std::path::PathBuf;

use clap::{Args, ValueEnum};
use metrale_checkpoint::synth::{planned_bytes, write_synthetic_as};
use metrale_checkpoint::{InitOptions, Preset, TableDType, TableLayout};

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

/// How a block-scaled FP8 table is stored.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, ValueEnum)]
pub enum LayoutArg {
    /// Each row's values then its scales, in one tensor: what the runtime
    /// reads.
    #[default]
    Inline,
    /// As DeepSeek-V4.1 is released: `embed.weight` F8_E4M3 and
    /// `embed.scale` F8_E8M0 apart (deepseek-v4.1 only); convert with
    /// `table pack` before serving.
    Release,
}

/// Arguments of `init`.
#[derive(Args, Debug)]
#[command(
    after_help = "Examples:\n  metrale-ple init /tmp/flagship --preset flagship --table-rows 1000000 --dtype fp8\n  metrale-ple init /tmp/v41-release --preset deepseek-v4.1 --layout release\n  metrale-ple table pack /tmp/v41-release /tmp/v41"
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
    /// Storage of a block-scaled FP8 table: inline (served as written) or
    /// release (DeepSeek-V4.1's two tensors; the same values for the same
    /// seed).
    #[arg(long, value_enum, default_value = "inline")]
    pub layout: LayoutArg,
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
    let layout = match a.layout {
        LayoutArg::Inline => TableLayout::Inline,
        LayoutArg::Release => TableLayout::Release,
    };
    let g = write_with_progress(&dir, &opts, layout)?;
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
    if layout == TableLayout::Release {
        println!(
            "the tables are stored as released; convert before serving: metrale-ple table pack {} DST",
            dir.display()
        );
    }
    Ok(())
}

/// Write `opts` into `dir` behind a progress bar, a block-scaled table
/// stored in `layout`.
pub fn write_with_progress(
    dir: &std::path::Path,
    opts: &InitOptions,
    layout: TableLayout,
) -> Result<metrale_model_layers::layers::ple::ModelSpec, CmdError> {
    use metrale_checkpoint::CheckpointError;
    let total = planned_bytes(opts).map_err(input)?;
    if let Some(parent) = dir.parent().filter(|p| !p.as_os_str().is_empty()) {
        std::fs::create_dir_all(parent)
            .map_err(|e| failure(anyhow::anyhow!("creating {}: {e}", parent.display())))?;
    }
    let pb = byte_bar(total, "init");
    tracing::info!(dir = %dir.display(), preset = opts.preset.name(), total, "writing checkpoint");
    let r = write_synthetic_as(dir, opts, layout, &mut |done, _| pb.set_position(done));
    pb.finish_and_clear();
    r.map_err(|e| match e {
        CheckpointError::Io { .. } => failure(e),
        _ => input(e),
    })
}
