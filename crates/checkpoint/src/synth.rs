//! The synthetic checkpoint writer behind `metrale-ple init`.
//!
//! Weights are random but deterministic: every tensor draws from its own
//! splitmix64 stream keyed by (seed, site, tensor), so the bytes of a tensor
//! depend only on those and never on write order or thread count. The hash
//! buffers are the real derived constants.
//!
//! Files: `model-00001-of-{n}.safetensors` holds every site's dense tensors
//! (projections, norms, conv, hash buffers); each table shard has a file of
//! its own, so the row cache reads rows in place and `table pack` can
//! realign one shard at a time.
//!
//! Invariant: a checkpoint appears at its destination complete or not at
//! all. Everything is written into a sibling `*.partial-{pid}` directory
//! that is renamed into place only after the last file is synced.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use metrale_model_layers::layers::ple::ids::{SPLITMIX64_GAMMA, splitmix64};
use metrale_model_layers::layers::ple::spec::ModelSpec;
use metrale_storage::StorageError;
use metrale_storage::dtype::{f32_to_bf16, f32_to_fp8_e4m3};
use metrale_storage::safetensors::{Dtype, TensorSpec, Writer};

use crate::error::{CheckpointError, Result};
use crate::names::{CONFIG_FILE, INDEX_FILE, SiteNames, shard_file};
use crate::preset::Preset;

/// The element type of the table rows written.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TableDType {
    /// BF16 rows.
    Bf16,
    /// FP8 E4M3 rows with a per-row f32 scale.
    Fp8,
}

impl TableDType {
    /// Parse `bf16` or `fp8`.
    pub fn parse(s: &str) -> Option<TableDType> {
        match s {
            "bf16" => Some(TableDType::Bf16),
            "fp8" => Some(TableDType::Fp8),
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
    /// to a whole number of equal shards.
    pub table_rows: Option<u64>,
    /// The table's element type.
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
        let z = splitmix64(self.0);
        self.0 = self.0.wrapping_add(SPLITMIX64_GAMMA);
        z
    }
    /// Uniform in [-1, 1).
    fn unit(&mut self) -> f32 {
        ((self.next_u64() >> 40) as f32 / (1u64 << 23) as f32) - 1.0
    }
}

fn bf16_tensor(n: usize, amp: f32, s: &mut Stream) -> Vec<u8> {
    let mut out = Vec::with_capacity(n * 2);
    for _ in 0..n {
        out.extend_from_slice(&f32_to_bf16(s.unit() * amp).to_le_bytes());
    }
    out
}

fn f32_tensor(n: usize, amp: f32, s: &mut Stream) -> Vec<u8> {
    let mut out = Vec::with_capacity(n * 4);
    for _ in 0..n {
        out.extend_from_slice(&(s.unit() * amp).to_le_bytes());
    }
    out
}

fn i64_tensor(v: &[u64]) -> Vec<u8> {
    v.iter().flat_map(|&x| (x as i64).to_le_bytes()).collect()
}

/// The model spec `init` writes for `opts`, with the rows stored per site.
pub fn init_spec(opts: &InitOptions) -> Result<(ModelSpec, u64)> {
    let mut g = opts.preset.spec();
    // Later sites take later primes, so the last site's table is the largest.
    let mut padded = 0;
    for s in 0..g.sites() {
        padded = padded.max(derive_site(&g, s)?.padded_rows);
    }
    let want = opts.table_rows.or(opts.preset.default_table_rows());
    let parts = g.split_ngram_parts as u64;
    let stored = match want {
        Some(0) => {
            return Err(CheckpointError::Invalid(
                "--table-rows must be positive".into(),
            ));
        }
        Some(r) if r > padded => {
            return Err(CheckpointError::Invalid(format!(
                "--table-rows {r} is more than the {padded} rows the {} geometry addresses",
                opts.preset.name()
            )));
        }
        Some(r) => r.div_ceil(parts) * parts,
        None => padded.div_ceil(parts) * parts,
    };
    // A table cut below the padded size folds ids; the config records the
    // fold modulus, which is the number of rows stored.
    g.table_rows = (stored < padded).then_some(stored);
    Ok((g, stored))
}

fn derive_site(
    g: &ModelSpec,
    s: usize,
) -> Result<metrale_model_layers::layers::ple::ids::DerivedPleIds> {
    g.derive(s).map_err(|source| CheckpointError::Config {
        file: PathBuf::from(CONFIG_FILE),
        source: Box::new(source),
    })
}

/// Bytes `init` will write for `opts` (tensor data, not headers).
pub fn planned_bytes(opts: &InitOptions) -> Result<u64> {
    let (g, stored) = init_spec(opts)?;
    Ok(g.sites() as u64 * (dense_bytes(&g) + table_bytes(&g, stored, opts.dtype)))
}

fn dense_bytes(g: &ModelSpec) -> u64 {
    let (c, e, h) = (
        g.channels() as u64,
        g.emb_dim() as u64,
        g.hidden_size as u64,
    );
    2 * (c * e + h * e)
        + 4 * (3 * c + c * g.conv_kernel_size as u64)
        + 8 * (g.ngram_size as u64 + 2 * g.ngram_heads() as u64)
}

fn table_bytes(g: &ModelSpec, rows: u64, dtype: TableDType) -> u64 {
    match dtype {
        TableDType::Bf16 => rows * g.head_dim as u64 * 2,
        TableDType::Fp8 => rows * (g.head_dim as u64 + 4),
    }
}

/// Write a synthetic checkpoint into `dir`, which must not exist or be
/// empty. `progress(done, total)` is called with tensor bytes written.
/// Returns the geometry written.
pub fn write_synthetic(
    dir: &Path,
    opts: &InitOptions,
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
    let (g, stored) = init_spec(opts)?;
    let total = planned_bytes(opts)?;
    let name = dir
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let partial = dir.with_file_name(format!(".{name}.partial-{}", std::process::id()));
    if partial.exists() {
        std::fs::remove_dir_all(&partial).map_err(|e| CheckpointError::io(&partial, e))?;
    }
    std::fs::create_dir_all(&partial).map_err(|e| CheckpointError::io(&partial, e))?;
    let r = write_into(&partial, &g, stored, opts, total, progress);
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
    stored: u64,
    opts: &InitOptions,
    total: u64,
    progress: &mut dyn FnMut(u64, u64),
) -> Result<()> {
    let parts = g.split_ngram_parts;
    let nfiles = 1 + g.sites() * parts;
    let mut weight_map: BTreeMap<String, String> = BTreeMap::new();
    let mut done = 0u64;
    progress(0, total);

    let (c, e, h, k) = (g.channels(), g.emb_dim(), g.hidden_size, g.conv_kernel_size);
    let dense_file = shard_file(1, nfiles);
    let mut specs = Vec::new();
    let mut datas: Vec<Vec<u8>> = Vec::new();
    for s in 0..g.sites() {
        let d = derive_site(g, s)?;
        let n = SiteNames::new(g.site_layer(s));
        let amp = 1.0 / (e as f32).sqrt();
        let tensors: [(String, Dtype, Vec<u64>, Vec<u8>); 9] = [
            (n.key_proj(), Dtype::BF16, vec![c as u64, e as u64], {
                bf16_tensor(c * e, amp, &mut Stream::new(opts.seed, s, 1))
            }),
            (n.value_proj(), Dtype::BF16, vec![h as u64, e as u64], {
                bf16_tensor(h * e, amp, &mut Stream::new(opts.seed, s, 2))
            }),
            (n.norm_key(), Dtype::F32, vec![c as u64], {
                f32_tensor(c, 0.1, &mut Stream::new(opts.seed, s, 3))
            }),
            (n.norm_query(), Dtype::F32, vec![c as u64], {
                f32_tensor(c, 0.1, &mut Stream::new(opts.seed, s, 4))
            }),
            (n.norm_conv(), Dtype::F32, vec![c as u64], {
                f32_tensor(c, 0.1, &mut Stream::new(opts.seed, s, 5))
            }),
            (n.conv1d(), Dtype::F32, vec![c as u64, 1, k as u64], {
                f32_tensor(c * k, 0.5, &mut Stream::new(opts.seed, s, 6))
            }),
            (
                n.layer_multipliers(),
                Dtype::I64,
                vec![g.ngram_size as u64],
                i64_tensor(&d.dims.multipliers),
            ),
            (
                n.vocab_sizes(),
                Dtype::I64,
                vec![g.ngram_heads() as u64],
                i64_tensor(&d.dims.head_vocab_sizes),
            ),
            (
                n.offsets(),
                Dtype::I64,
                vec![g.ngram_heads() as u64],
                i64_tensor(&d.dims.head_offsets),
            ),
        ];
        for (name, dt, shape, data) in tensors {
            weight_map.insert(name.clone(), dense_file.clone());
            specs.push(TensorSpec::new(name, dt, &shape));
            datas.push(data);
        }
    }
    let path = dir.join(&dense_file);
    let mut w = Writer::create(&path, &specs, &BTreeMap::new(), 8).map_err(|e| st_err(&path, e))?;
    for d in &datas {
        w.write(d).map_err(|e| st_err(&path, e))?;
        done += d.len() as u64;
    }
    w.finish().map_err(|e| st_err(&path, e))?;
    progress(done, total);
    drop(datas);

    let rows_per_shard = stored / parts as u64;
    let hd = g.head_dim;
    for s in 0..g.sites() {
        let n = SiteNames::new(g.site_layer(s));
        for i in 0..parts {
            let file = shard_file(2 + s * parts + i, nfiles);
            let path = dir.join(&file);
            let mut specs = vec![TensorSpec::new(
                n.shard_weight(i),
                dtype_of(opts.dtype),
                &[rows_per_shard, hd as u64],
            )];
            weight_map.insert(n.shard_weight(i), file.clone());
            if opts.dtype == TableDType::Fp8 {
                specs.push(TensorSpec::new(
                    n.shard_scale(i),
                    Dtype::F32,
                    &[rows_per_shard],
                ));
                weight_map.insert(n.shard_scale(i), file.clone());
            }
            let mut w =
                Writer::create(&path, &specs, &BTreeMap::new(), 8).map_err(|e| st_err(&path, e))?;
            let mut rng = Stream::new(opts.seed, s, 0x100 + i as u64);
            let mut scales = Vec::new();
            let chunk_rows = (1 << 20) / hd.max(1) + 1;
            let mut row = vec![0f32; hd];
            let mut buf = Vec::with_capacity(chunk_rows * hd * 2);
            let mut r = 0u64;
            while r < rows_per_shard {
                let m = (rows_per_shard - r).min(chunk_rows as u64);
                buf.clear();
                for _ in 0..m {
                    // Rows get different magnitudes so FP8 scales differ.
                    let mag = 0.25 + (rng.unit() + 1.0);
                    for v in row.iter_mut() {
                        *v = rng.unit() * mag;
                    }
                    match opts.dtype {
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
                    }
                }
                w.write(&buf).map_err(|e| st_err(&path, e))?;
                done += buf.len() as u64;
                progress(done, total);
                r += m;
            }
            if !scales.is_empty() {
                w.write(&scales).map_err(|e| st_err(&path, e))?;
                done += scales.len() as u64;
            }
            w.finish().map_err(|e| st_err(&path, e))?;
            progress(done, total);
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
    std::fs::write(&cpath, g.to_config_json()).map_err(|e| CheckpointError::io(&cpath, e))?;
    progress(total, total);
    Ok(())
}

fn dtype_of(d: TableDType) -> Dtype {
    match d {
        TableDType::Bf16 => Dtype::BF16,
        TableDType::Fp8 => Dtype::F8E4M3,
    }
}
