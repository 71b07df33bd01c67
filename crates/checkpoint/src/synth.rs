//! The synthetic checkpoint writer behind `metrale-ple init`.
//!
//! Weights are random but deterministic: every tensor draws from its own
//! splitmix64 stream keyed by (seed, site, tensor), so the bytes of a tensor
//! depend only on those and never on write order or thread count. The hash
//! buffers are the real derived constants.
//!
//! Files: `model-00001-of-{n}.safetensors` holds every site's dense tensors
//! (projections, norms, conv, hash buffers, in the family's names); each
//! table tensor (a shard, an Engram layer's table, a LongCat sub-table) has
//! a file of its own, so the row cache reads rows in place and `table pack`
//! can realign one at a time. An Engram checkpoint also gets a synthetic
//! compressed-token map of the size its config states.
//!
//! [`TableLayout::Release`] stores DeepSeek-V4.1's block-scaled rows as
//! the release does (values and F8_E8M0 scales in two tensors, the fused
//! projection's scales F8_E8M0 too), the same bytes as the inline layout
//! for the same seed: what `table pack` converts, testable without a
//! download.
//!
//! Invariant: a checkpoint appears at its destination complete or not at
//! all. Everything is written into a sibling `*.partial-{pid}` directory
//! that is renamed into place only after the last file is synced.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use crate::names::scale_name;
use metrale_model_layers::layers::ple::ids::DerivedPleIds;
use metrale_model_layers::layers::ple::spec::ModelSpec;
use metrale_storage::StorageError;
use metrale_storage::dtype::{
    FP8_BLOCK, f32_to_bf16, f32_to_fp8_e4m3, fp8_block_row_bytes, quantize_fp8_block_row,
    ue8m0_block_scale, ue8m0_to_f32,
};
use metrale_storage::safetensors::{Dtype, TensorSpec, Writer};
use metrale_storage::splitmix::SplitMix64;

use crate::backbone::{Backbone, Init};
use crate::error::{CheckpointError, Result};
use crate::family::Layout;
use crate::names::{CONFIG_FILE, INDEX_FILE, TOKEN_MAP_FILE, shard_file};
use crate::preset::Preset;

/// The element type of the table rows written.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TableDType {
    /// BF16 rows.
    Bf16,
    /// FP8 E4M3 rows with a per-row f32 scale.
    Fp8,
    /// FP8 E4M3 rows with one UE8M0 scale per 32 values, inline after the
    /// values (DeepSeek-V4.1's table: 264 bytes a row of 256).
    Fp8Block,
}

impl TableDType {
    /// Parse `bf16`, `fp8` or `fp8-block`.
    pub fn parse(s: &str) -> Option<TableDType> {
        match s {
            "bf16" => Some(TableDType::Bf16),
            "fp8" => Some(TableDType::Fp8),
            "fp8-block" => Some(TableDType::Fp8Block),
            _ => None,
        }
    }

    /// Bytes of one stored row of `d` values, scales included.
    pub fn row_bytes(self, d: u64) -> u64 {
        match self {
            TableDType::Bf16 => 2 * d,
            TableDType::Fp8 => d + 4,
            TableDType::Fp8Block => fp8_block_row_bytes(d as usize) as u64,
        }
    }
}

/// How block-scaled FP8 tables ([`TableDType::Fp8Block`]) are stored.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum TableLayout {
    /// What the runtime serves: each row's values then its scales, one U8
    /// tensor `[rows, d + d / 32]`; the fused projection's block scales U8.
    #[default]
    Inline,
    /// DeepSeek-V4.1 as released: `embed.weight` F8_E4M3 `[rows, d]` and
    /// `embed.scale` F8_E8M0 `[rows, d / 32]`; the projection's block
    /// scales F8_E8M0. The loader refuses it until `table pack` converts it.
    Release,
}

impl TableLayout {
    /// Parse `inline` or `release`.
    pub fn parse(s: &str) -> Option<TableLayout> {
        match s {
            "inline" => Some(TableLayout::Inline),
            "release" => Some(TableLayout::Release),
            _ => None,
        }
    }
}

/// What `init` writes.
#[derive(Clone, Debug)]
pub struct InitOptions {
    /// The geometry preset.
    pub preset: Preset,
    /// Rows stored per site; `None` takes the preset's default. Rounded up
    /// to a whole number of equal table parts (shards, or LongCat's
    /// sub-tables).
    pub table_rows: Option<u64>,
    /// The table's element type ([`Preset::default_dtype`] is the family's).
    pub dtype: TableDType,
    /// The seed of the random weights (the hash seed stays the config's).
    pub seed: u64,
}

/// The largest finite E4M3 magnitude; per-row scales map each row's
/// largest value onto it.
const FP8_MAX: f32 = 448.0;

/// A splitmix64 stream: tiny, fast and the same on every platform.
struct Stream(u64);

impl Stream {
    fn new(seed: u64, site: usize, tag: u64) -> Self {
        let mut s = Stream(seed ^ (site as u64).wrapping_mul(0xA24B_AED4_963E_E407) ^ tag);
        s.next_u64();
        s
    }
    fn next_u64(&mut self) -> u64 {
        SplitMix64::step(&mut self.0)
    }
    /// Uniform in [-1, 1).
    fn unit(&mut self) -> f32 {
        ((self.next_u64() >> 40) as f32 / (1u64 << 23) as f32) - 1.0
    }
}

/// How a dense tensor's values are drawn.
pub(crate) enum Fill {
    /// BF16 `center + amp * u`.
    Bf16 { center: f32, amp: f32 },
    /// F32 `center + amp * u`.
    F32 { center: f32, amp: f32 },
    /// The given I64 values.
    I64(Vec<u64>),
    /// FP8 E4M3 `amp * u`, one UE8M0 scale per 32 x 32 block, which the
    /// next tensor ([`Fill::BlockScales`]) holds.
    Fp8Blocks { amp: f32 },
    /// The block scales of the FP8 tensor before it.
    BlockScales,
}

/// One dense tensor of a site.
pub(crate) struct Dense {
    name: String,
    dtype: Dtype,
    shape: Vec<u64>,
    tag: u64,
    fill: Fill,
}

impl Dense {
    pub(crate) fn new(name: String, dtype: Dtype, shape: &[u64], tag: u64, fill: Fill) -> Dense {
        Dense {
            name,
            dtype,
            shape: shape.to_vec(),
            tag,
            fill,
        }
    }
    fn bytes(&self) -> u64 {
        self.shape.iter().product::<u64>() * self.dtype.size() as u64
    }
}

/// The dense tensors of site `s` of `g`, in file order.
fn dense_tensors(g: &ModelSpec, s: usize, d: &DerivedPleIds) -> Result<Vec<Dense>> {
    Ok(Layout::of(g)?.dense_tensors(g, s, d))
}

/// The dtype the inline layout stores UE8M0 block scales as: raw bytes,
/// as checkpoints written before `F8_E8M0` was read have them (the loader
/// takes either; [`TableLayout::Release`] writes `F8_E8M0`).
pub const SCALE_DTYPE: Dtype = Dtype::U8;

/// The model spec `init` writes for `opts`, with the rows stored per site.
pub fn init_spec(opts: &InitOptions) -> Result<(ModelSpec, u64)> {
    plan(
        opts.preset.spec(),
        opts.preset.name(),
        opts.table_rows.or(opts.preset.default_table_rows()),
    )
}

/// `g` with its table cut to `want` rows (rounded up to whole table parts;
/// `None`: the whole table), and the rows stored per site; `name` names
/// the geometry in errors.
fn plan(mut g: ModelSpec, name: &str, want: Option<u64>) -> Result<(ModelSpec, u64)> {
    // Later sites take later primes, so the last site's table is the largest.
    let mut padded = 0;
    for s in 0..g.sites() {
        padded = padded.max(derive_site(&g, s)?.padded_rows);
    }
    let layout = Layout::of(&g)?;
    let parts = layout.table_parts(&g) as u64;
    let stored = match want {
        Some(0) => {
            return Err(CheckpointError::Invalid(
                "--table-rows must be positive".into(),
            ));
        }
        Some(r) if r > padded => {
            return Err(CheckpointError::Invalid(format!(
                "--table-rows {r} is more than the {padded} rows the {name} geometry addresses"
            )));
        }
        Some(r) => r.div_ceil(parts) * parts,
        None => padded.div_ceil(parts) * parts,
    };
    // A LongCat sub-table cannot store more rows than it has: a cut that
    // would is no cut.
    let smallest = if layout.sub_tables() {
        derive_site(&g, 0)?
            .dims
            .head_vocab_sizes
            .iter()
            .copied()
            .min()
            .unwrap_or(0)
    } else {
        u64::MAX
    };
    let stored = if stored / parts > smallest {
        padded
    } else {
        stored
    };
    // A table cut below the padded size folds ids; the config records the
    // fold modulus, which is the number of rows stored.
    g.table_rows = (stored < padded).then_some(stored);
    if layout.sub_tables() && g.table_rows.is_none() {
        // An uncut LongCat table stores every sub-table whole.
        return Ok((g, padded));
    }
    Ok((g, stored))
}

fn derive_site(g: &ModelSpec, s: usize) -> Result<DerivedPleIds> {
    g.derive(s).map_err(|source| CheckpointError::Config {
        file: PathBuf::from(CONFIG_FILE),
        source: Box::new(source),
    })
}

/// Rows stored in each table tensor of site `s` (in [`Layout::table_tensors`]
/// order).
fn part_rows(g: &ModelSpec, s: usize, d: &DerivedPleIds) -> Result<Vec<u64>> {
    Ok(Layout::of(g)?.part_rows(g, s, d.padded_rows))
}

/// Bytes `init` will write for `opts` (tensor data, not headers).
pub fn planned_bytes(opts: &InitOptions) -> Result<u64> {
    let (g, _) = init_spec(opts)?;
    planned(&g, opts.dtype)
}

fn planned(g: &ModelSpec, dtype: TableDType) -> Result<u64> {
    let mut total = 0;
    for s in 0..g.sites() {
        let d = derive_site(g, s)?;
        total += dense_tensors(g, s, &d)?
            .iter()
            .map(Dense::bytes)
            .sum::<u64>();
        total += part_rows(g, s, &d)?.iter().sum::<u64>() * dtype.row_bytes(g.head_dim as u64);
    }
    Ok(total)
}

/// Write a synthetic checkpoint into `dir`, which must not exist or be
/// empty. `progress(done, total)` is called with tensor bytes written.
/// Returns the geometry written.
pub fn write_synthetic(
    dir: &Path,
    opts: &InitOptions,
    progress: &mut dyn FnMut(u64, u64),
) -> Result<ModelSpec> {
    write_synthetic_as(dir, opts, TableLayout::Inline, progress)
}

/// [`write_synthetic`] with the block-scaled table stored in `layout`.
pub fn write_synthetic_as(
    dir: &Path,
    opts: &InitOptions,
    layout: TableLayout,
    progress: &mut dyn FnMut(u64, u64),
) -> Result<ModelSpec> {
    let (g, _) = init_spec(opts)?;
    let backbone = opts.preset.backbone();
    write_planned(dir, g, backbone, (opts.dtype, layout), opts.seed, progress)
}

/// Write a synthetic checkpoint of any valid `spec` (tests build small
/// models of every family this way) into `dir`, its table cut to
/// `table_rows` rows per site (`None`: whole), as [`write_synthetic`] does
/// for a preset.
pub fn write_spec_synthetic(
    dir: &Path,
    spec: &ModelSpec,
    table_rows: Option<u64>,
    dtype: TableDType,
    seed: u64,
) -> Result<ModelSpec> {
    write_spec_synthetic_as(dir, spec, table_rows, dtype, seed, TableLayout::Inline)
}

/// [`write_spec_synthetic`] with the block-scaled table stored in `layout`.
pub fn write_spec_synthetic_as(
    dir: &Path,
    spec: &ModelSpec,
    table_rows: Option<u64>,
    dtype: TableDType,
    seed: u64,
    layout: TableLayout,
) -> Result<ModelSpec> {
    spec.validate("the given spec")?;
    let (g, _) = plan(spec.clone(), "given", table_rows)?;
    write_planned(dir, g, None, (dtype, layout), seed, &mut |_, _| {})
}

fn write_planned(
    dir: &Path,
    g: ModelSpec,
    backbone: Option<Backbone>,
    (dtype, table_layout): (TableDType, TableLayout),
    seed: u64,
    progress: &mut dyn FnMut(u64, u64),
) -> Result<ModelSpec> {
    if dir.exists() {
        let mut entries = std::fs::read_dir(dir).map_err(|e| CheckpointError::io(dir, e))?;
        if entries.next().is_some() {
            return Err(CheckpointError::Invalid(format!(
                "{} already exists and is not empty; choose another directory or remove it",
                dir.display()
            )));
        }
    }
    let layout = Layout::of(&g)?;
    if table_layout == TableLayout::Release
        && (dtype != TableDType::Fp8Block || !layout.release_tables())
    {
        return Err(CheckpointError::Invalid(format!(
            "the release layout is DeepSeek-V4.1's FP8 block table (--preset deepseek-v4.1 \
             --dtype fp8-block); this is a {} table of {dtype:?} rows",
            layout.name()
        )));
    }
    if dtype == TableDType::Fp8Block && !g.head_dim.is_multiple_of(FP8_BLOCK) {
        return Err(CheckpointError::Invalid(format!(
            "--dtype fp8-block needs rows of a multiple of {FP8_BLOCK} values; this geometry's \
             have {}",
            g.head_dim
        )));
    }
    let total = planned(&g, dtype)?
        + backbone.map_or(0, |b| {
            b.tensors(&g)
                .iter()
                .map(|(_, shape, _)| 2 * shape.iter().product::<u64>())
                .sum()
        });
    let name = dir
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let partial = dir.with_file_name(format!(".{name}.partial-{}", std::process::id()));
    if partial.exists() {
        std::fs::remove_dir_all(&partial).map_err(|e| CheckpointError::io(&partial, e))?;
    }
    std::fs::create_dir_all(&partial).map_err(|e| CheckpointError::io(&partial, e))?;
    let r = write_into(
        &partial,
        &g,
        backbone,
        (dtype, table_layout, seed),
        total,
        progress,
    );
    if let Err(e) = r {
        let _ = std::fs::remove_dir_all(&partial);
        return Err(e);
    }
    if dir.exists() {
        // Checked empty above; rename cannot replace a directory portably.
        std::fs::remove_dir(dir).map_err(|e| CheckpointError::io(dir, e))?;
    }
    std::fs::rename(&partial, dir).map_err(|e| {
        let _ = std::fs::remove_dir_all(&partial);
        CheckpointError::io(dir, e)
    })?;
    Ok(g)
}

fn st_err(path: &Path, e: StorageError) -> CheckpointError {
    CheckpointError::Io {
        path: path.to_path_buf(),
        source: std::io::Error::other(e.to_string()),
    }
}

fn write_into(
    dir: &Path,
    g: &ModelSpec,
    backbone: Option<Backbone>,
    (dtype, table_layout, seed): (TableDType, TableLayout, u64),
    total: u64,
    progress: &mut dyn FnMut(u64, u64),
) -> Result<()> {
    let release = table_layout == TableLayout::Release;
    let layout = Layout::of(g)?;
    let tables: Vec<(Vec<String>, Vec<u64>)> = (0..g.sites())
        .map(|s| {
            let d = derive_site(g, s)?;
            Ok((layout.table_tensors(g, s), part_rows(g, s, &d)?))
        })
        .collect::<Result<_>>()?;
    let nfiles = 1 + tables.iter().map(|(n, _)| n.len()).sum::<usize>();
    let mut weight_map: BTreeMap<String, String> = BTreeMap::new();
    let mut done = 0u64;
    progress(0, total);

    // Every site's dense tensors go in the first file, drawn and written
    // one tensor at a time (DeepSeek-V4.1's fused projection alone is
    // 157 MB a layer).
    let dense_file = shard_file(1, nfiles);
    let mut dense = Vec::new();
    for s in 0..g.sites() {
        let d = derive_site(g, s)?;
        for mut t in dense_tensors(g, s, &d)? {
            if release && matches!(t.fill, Fill::BlockScales) {
                t.dtype = Dtype::F8E8M0;
            }
            dense.push((s, t));
        }
    }
    // The rest of the model, for transformers (never read by the runtime).
    if let Some(b) = backbone {
        for (i, (name, shape, init)) in b.tensors(g).into_iter().enumerate() {
            let fill = match init {
                Init::Random => Fill::Bf16 {
                    center: 0.0,
                    amp: 0.02,
                },
                Init::Constant(v) => Fill::Bf16 {
                    center: v,
                    amp: 0.0,
                },
            };
            dense.push((
                0,
                Dense::new(name, Dtype::BF16, &shape, 0x9000 + i as u64, fill),
            ));
        }
    }
    let specs: Vec<TensorSpec> = dense
        .iter()
        .map(|(_, t)| TensorSpec::new(t.name.clone(), t.dtype, &t.shape))
        .collect();
    for (_, t) in &dense {
        weight_map.insert(t.name.clone(), dense_file.clone());
    }
    let path = dir.join(&dense_file);
    let mut w = Writer::create(&path, &specs, &BTreeMap::new(), 8).map_err(|e| st_err(&path, e))?;
    let mut scales = Vec::new();
    for (s, t) in &dense {
        let data = draw(t, *s, seed, &mut scales);
        w.write(&data).map_err(|e| st_err(&path, e))?;
        done += data.len() as u64;
        progress(done, total);
    }
    w.finish().map_err(|e| st_err(&path, e))?;
    drop(dense);

    let hd = g.head_dim;
    let mut file_no = 2;
    for (s, (names, rows)) in tables.iter().enumerate() {
        for (i, (name, &r)) in names.iter().zip(rows).enumerate() {
            let file = shard_file(file_no, nfiles);
            file_no += 1;
            let path = dir.join(&file);
            let mut rng = Stream::new(seed, s, 0x100 + i as u64);
            let part = TablePart {
                name,
                rows: r,
                hd,
                dtype,
                release,
            };
            write_table_part(&path, &part, &mut rng, &mut |n| {
                done += n;
                progress(done, total);
            })?;
            weight_map.insert(name.clone(), file.clone());
            if dtype == TableDType::Fp8 || release {
                weight_map.insert(scale_name(name), file.clone());
            }
        }
    }

    let index = serde_json::json!({
        "metadata": { "total_size": total },
        "weight_map": weight_map,
    });
    let ipath = dir.join(INDEX_FILE);
    let mut text = serde_json::to_string_pretty(&index).expect("a JSON value always serialises");
    text.push('\n');
    std::fs::write(&ipath, text).map_err(|e| CheckpointError::io(&ipath, e))?;
    let cpath = dir.join(CONFIG_FILE);
    let config = match backbone {
        None => g.to_config_json(),
        Some(b) => {
            let mut v: serde_json::Value =
                serde_json::from_str(&g.to_config_json()).expect("the spec writes JSON");
            if let (Some(o), serde_json::Value::Object(extra)) = (v.as_object_mut(), b.config()) {
                o.extend(extra);
            }
            let mut text = serde_json::to_string_pretty(&v).expect("a JSON value serialises");
            text.push('\n');
            text
        }
    };
    std::fs::write(&cpath, config).map_err(|e| CheckpointError::io(&cpath, e))?;
    if let Some(compressed) = g.family.family().compressed_vocab() {
        let map = synthetic_token_map(g.vocab_size, compressed);
        let mpath = dir.join(TOKEN_MAP_FILE);
        let text = serde_json::to_string(&map).expect("a list of ids always serialises");
        std::fs::write(&mpath, text).map_err(|e| CheckpointError::io(&mpath, e))?;
    }
    progress(total, total);
    Ok(())
}

/// A compressed-token map of `vocab` raw ids onto exactly `0..compressed`
/// (`t % compressed`): a stand-in for the tokenizer-derived map, of the
/// size the config states.
pub fn synthetic_token_map(vocab: u64, compressed: u64) -> Vec<u32> {
    (0..vocab).map(|t| (t % compressed) as u32).collect()
}

/// The bytes of dense tensor `t` of site `s`. The block scales of an FP8
/// tensor are left in `scales` for the [`Fill::BlockScales`] tensor after
/// it.
fn draw(t: &Dense, s: usize, seed: u64, scales: &mut Vec<u8>) -> Vec<u8> {
    let n: usize = t.shape.iter().product::<u64>() as usize;
    let mut rng = Stream::new(seed, s, t.tag);
    match &t.fill {
        Fill::Bf16 { center, amp } => (0..n)
            .flat_map(|_| f32_to_bf16(center + rng.unit() * amp).to_le_bytes())
            .collect(),
        Fill::F32 { center, amp } => (0..n)
            .flat_map(|_| (center + rng.unit() * amp).to_le_bytes())
            .collect(),
        Fill::I64(v) => v.iter().flat_map(|&x| (x as i64).to_le_bytes()).collect(),
        Fill::Fp8Blocks { amp } => {
            let (rows, cols) = (t.shape[0] as usize, t.shape[1] as usize);
            let (rb, cb) = (rows.div_ceil(FP8_BLOCK), cols.div_ceil(FP8_BLOCK));
            let mut out = vec![0u8; rows * cols];
            scales.clear();
            scales.resize(rb * cb, 0);
            let mut vals = vec![0f32; FP8_BLOCK * cols];
            let mut block = Vec::with_capacity(FP8_BLOCK * FP8_BLOCK);
            for r0 in (0..rows).step_by(FP8_BLOCK) {
                let nr = (rows - r0).min(FP8_BLOCK);
                for v in vals[..nr * cols].iter_mut() {
                    *v = rng.unit() * amp;
                }
                for (j, c0) in (0..cols).step_by(FP8_BLOCK).enumerate() {
                    let nc = (cols - c0).min(FP8_BLOCK);
                    block.clear();
                    for r in 0..nr {
                        block.extend_from_slice(&vals[r * cols + c0..r * cols + c0 + nc]);
                    }
                    let e = ue8m0_block_scale(&block);
                    scales[(r0 / FP8_BLOCK) * cb + j] = e;
                    let scale = ue8m0_to_f32(e);
                    for r in 0..nr {
                        for c in c0..c0 + nc {
                            out[(r0 + r) * cols + c] = f32_to_fp8_e4m3(vals[r * cols + c] / scale);
                        }
                    }
                }
            }
            out
        }
        Fill::BlockScales => std::mem::take(scales),
    }
}

/// One table tensor to write: `rows` rows of `hd` values in `dtype`;
/// `release`: block-scaled rows split as released.
struct TablePart<'a> {
    name: &'a str,
    rows: u64,
    hd: usize,
    dtype: TableDType,
    release: bool,
}

/// Write one table tensor into its own file `path`; `wrote(bytes)` after
/// each chunk.
fn write_table_part(
    path: &Path,
    part: &TablePart<'_>,
    rng: &mut Stream,
    wrote: &mut dyn FnMut(u64),
) -> Result<()> {
    let TablePart {
        name,
        rows,
        hd,
        dtype,
        release,
    } = *part;
    let mut specs = vec![match dtype {
        TableDType::Bf16 => TensorSpec::new(name.to_string(), Dtype::BF16, &[rows, hd as u64]),
        TableDType::Fp8 => TensorSpec::new(name.to_string(), Dtype::F8E4M3, &[rows, hd as u64]),
        TableDType::Fp8Block if release => {
            TensorSpec::new(name.to_string(), Dtype::F8E4M3, &[rows, hd as u64])
        }
        TableDType::Fp8Block => TensorSpec::new(
            name.to_string(),
            Dtype::U8,
            &[rows, fp8_block_row_bytes(hd) as u64],
        ),
    }];
    if dtype == TableDType::Fp8 {
        specs.push(TensorSpec::new(scale_name(name), Dtype::F32, &[rows]));
    }
    if release {
        specs.push(TensorSpec::new(
            scale_name(name),
            Dtype::F8E8M0,
            &[rows, (hd / FP8_BLOCK) as u64],
        ));
    }
    let mut inline = Vec::with_capacity(fp8_block_row_bytes(hd));
    let mut w = Writer::create(path, &specs, &BTreeMap::new(), 8).map_err(|e| st_err(path, e))?;
    let mut scales = Vec::new();
    let chunk_rows = (1 << 20) / hd.max(1) + 1;
    let mut row = vec![0f32; hd];
    let mut buf = Vec::with_capacity(chunk_rows * hd * 2);
    let mut r = 0u64;
    while r < rows {
        let m = (rows - r).min(chunk_rows as u64);
        buf.clear();
        for _ in 0..m {
            // Rows get different magnitudes so FP8 scales differ.
            let mag = 0.25 + (rng.unit() + 1.0);
            for v in row.iter_mut() {
                *v = rng.unit() * mag;
            }
            match dtype {
                TableDType::Bf16 => {
                    for &v in &row {
                        buf.extend_from_slice(&f32_to_bf16(v).to_le_bytes());
                    }
                }
                TableDType::Fp8 => {
                    let max = row.iter().fold(0f32, |a, &v| a.max(v.abs()));
                    let scale = if max > 0.0 { max / FP8_MAX } else { 1.0 };
                    for &v in &row {
                        buf.push(f32_to_fp8_e4m3(v / scale));
                    }
                    scales.extend_from_slice(&scale.to_le_bytes());
                }
                // The same bytes either way: the release splits each row
                // into its values (here) and its scales (after them all).
                TableDType::Fp8Block if release => {
                    inline.clear();
                    quantize_fp8_block_row(&row, &mut inline);
                    buf.extend_from_slice(&inline[..hd]);
                    scales.extend_from_slice(&inline[hd..]);
                }
                TableDType::Fp8Block => quantize_fp8_block_row(&row, &mut buf),
            }
        }
        w.write(&buf).map_err(|e| st_err(path, e))?;
        wrote(buf.len() as u64);
        r += m;
    }
    if !scales.is_empty() {
        w.write(&scales).map_err(|e| st_err(path, e))?;
        wrote(scales.len() as u64);
    }
    w.finish().map_err(|e| st_err(path, e))
}
