//! The validating checkpoint loader.
//!
//! [`Checkpoint::open`] checks everything a layer relies on before anything
//! is built from it: the config parses and its hash constants derive; the
//! weights are one `model.safetensors` or the files a
//! `model.safetensors.index.json` names (as `save_pretrained` writes
//! either), and the weight map names only plain files inside the directory; every safetensors
//! header parses and every extent lies inside its file; every tensor the
//! format requires is present with the right dtype and shape; the stored
//! hash buffers equal their derivation (odd multipliers first); norm,
//! conv, bias and projection weights are finite; the table shards are
//! contiguous, equal in shape and cover the table. A refusal is a
//! [`CheckpointError`] naming the file and tensor.
//!
//! Each family's tensors (docs/SPEC.md §10 (Checkpoint layout)) become the
//! one [`PleWeights`] the layer takes: the Engram demo's per-branch tensors
//! stacked branch by branch, DeepSeek-V4.1's fused FP8 projection
//! dequantised (exactly) and split keys first, LongCat's sub-table
//! projections side by side. An Engram checkpoint's token map
//! ([`TOKEN_MAP_FILE`], or the tensor [`TOKEN_MAP_TENSOR`]) goes into the
//! spec before any site is built.
//!
//! Dense weights may be stored in any float dtype transformers saves (F32,
//! BF16, F16): projections become BF16 (rounded to nearest even when they
//! were wider), norms, conv and biases F32. A Qwen4Exp table is served as
//! stored: BF16, FP8, or F32 rows as `save_pretrained` writes a float32
//! model.
//!
//! Only the dense weights are read (tens of MB at the flagship geometry,
//! 315 MB for DeepSeek-V4.1's projections); table shards are checked from
//! their headers alone.
//!
//! A DeepSeek-V4.1 table stored as released (values and block scales in
//! two tensors, [`crate::release`]) is refused by [`Checkpoint::open`]
//! with an error that says to convert it (`metrale-ple table pack`);
//! [`Checkpoint::open_with`] and [`OpenOptions::release_tables`] accept it
//! for that conversion only, as a site whose [`SiteTable::release`] names
//! the pair.
//!
//! Why one long file: the loader is one sequence of checks, each naming the
//! file, tensor or key it refuses, over state (the index, the headers seen,
//! the sites built so far) that every check reads; the family-specific
//! checks live in `family/`.

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};

use metrale_model_layers::layers::ple::PleWeights;
use metrale_model_layers::layers::ple::family::engram::load_token_map;
use metrale_model_layers::layers::ple::spec::{ModelSpec, SiteSpec};
use metrale_storage::StorageError;
use metrale_storage::dtype::{
    FP8_BLOCK, bf16_to_f32, f32_to_bf16, fp8_block_row_bytes, fp8_e4m3_to_f32, ue8m0_to_f32,
};
use metrale_storage::layout::{ShardSource, declared_row_width};
use metrale_storage::safetensors::{Dtype, Header, TensorInfo};
use metrale_storage::table::RowDType;
use serde::Deserialize;

use crate::error::{CheckpointError, Result};
use crate::family::Layout;
use crate::names::{
    CONFIG_FILE, INDEX_FILE, SINGLE_FILE, TOKEN_MAP_FILE, TOKEN_MAP_TENSOR, TOKENIZER_FILE,
    V41Names, scale_name, table_shard,
};
use crate::release::{SplitTable, check_split, is_block_scale};
use crate::token_map::decode_token_map;
use metrale_model_layers::layers::ple::family::engram::tokenizer::token_map_from_tokenizer_json;

/// Where one site's table rows are stored.
#[derive(Clone, Debug, PartialEq)]
pub struct SiteTable {
    /// Each shard's file, weight tensor and scale tensor name, in row
    /// order.
    pub shards: Vec<ShardSource>,
    /// Rows in every shard.
    pub rows_per_shard: u64,
    /// Rows stored (`shards * rows_per_shard`).
    pub stored_rows: u64,
    /// `Some(m)` when the table is cut: row `id` is stored at `id % m`.
    pub fold_rows: Option<u64>,
    /// Element type.
    pub dtype: RowDType,
    /// Values per stored row: the model's `head_dim`, or a tensor-parallel
    /// rank's share of it ([`OpenOptions::table_ranks`]).
    pub head_dim: usize,
    /// Bytes of row data (and FP8 scales) over all shards.
    pub bytes: u64,
    /// LongCat: one entry per shard, each shard being a sub-table of its
    /// own size (the table is their concatenation, each folded on its own
    /// when cut); empty when the shards are equal parts of one table.
    pub sub_tables: Vec<SubTable>,
    /// DeepSeek-V4.1 opened with [`OpenOptions::release_tables`]: the
    /// table's values and block scales are stored apart, as released, and
    /// the table cannot be served until converted; `dtype` and `bytes` are
    /// those of the converted table.
    pub release: Option<SplitTable>,
}

/// How [`Checkpoint::open_with`] opens a checkpoint.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct OpenOptions {
    /// Accept DeepSeek-V4.1 tables stored as released (F8_E4M3 values and
    /// F8_E8M0 scales in two tensors), checked from their headers, for
    /// `table pack` to convert; [`Checkpoint::open`] refuses them.
    pub release_tables: bool,
    /// Read every site's table as one tensor-parallel rank's column slice
    /// of this many ranks (rows of `head_dim / table_ranks` values, as
    /// [`crate::tensor_parallel::write_rank`] writes them); 0 and 1 read
    /// whole rows. [`crate::tensor_parallel::RankCheckpoint::open`] sets it
    /// from the directory's manifest.
    pub table_ranks: usize,
}

/// One LongCat sub-table.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SubTable {
    /// Rows its ids address (`m + 2i + 1`).
    pub logical_rows: u64,
    /// Rows stored (fewer when the table is cut: ids fold onto them).
    pub stored_rows: u64,
}

/// One PLE site of a checkpoint.
#[derive(Clone, Debug)]
pub struct Site {
    /// Position in `ple_layer_ids`.
    pub index: usize,
    /// 0-based model layer.
    pub layer: usize,
    /// The site's spec, with its checked hash constants.
    pub spec: SiteSpec,
    /// Rows the ids address (the derived padded table).
    pub padded_rows: u64,
    /// The dense weights, host-side, as the layer takes them.
    pub weights: PleWeights,
    /// The table shards.
    pub table: SiteTable,
}

/// One safetensors file of a checkpoint.
#[derive(Clone, Debug)]
pub struct FileSummary {
    /// Its name inside the directory.
    pub name: String,
    /// Its size in bytes.
    pub bytes: u64,
    /// Tensors it holds.
    pub tensors: usize,
    /// Offset of its data section (4096-aligned after `table pack`).
    pub data_start: u64,
}

/// A validated checkpoint.
#[derive(Clone, Debug)]
pub struct Checkpoint {
    /// Its directory.
    pub dir: PathBuf,
    /// The parsed and validated config.
    pub spec: ModelSpec,
    /// Where its tensors are (the family's names; for Qwen4Exp, whether
    /// they sit in a multimodal model).
    pub layout: Layout,
    /// Every site, in `ple_layer_ids` order.
    pub sites: Vec<Site>,
    /// Every safetensors file, sorted by name.
    pub files: Vec<FileSummary>,
}

#[derive(Deserialize)]
struct RawIndex {
    weight_map: BTreeMap<String, String>,
}

fn header_err(file: &Path, e: StorageError) -> CheckpointError {
    CheckpointError::Header {
        file: file.to_path_buf(),
        msg: e.to_string(),
    }
}

/// Read a config's model spec alone (no weights); `inspect` uses it to
/// show a model even when the rest of the checkpoint is refused.
pub fn read_spec(dir: &Path) -> Result<ModelSpec> {
    let path = dir.join(CONFIG_FILE);
    let text = std::fs::read_to_string(&path).map_err(|e| CheckpointError::io(&path, e))?;
    Ok(ModelSpec::from_json_str(
        &text,
        &path.display().to_string(),
    )?)
}

/// `spec` with the checkpoint's compressed-token map, when its family hashes
/// through one (Engram: `Family::compressed_vocab`) and the directory has
/// one, as the file [`TOKEN_MAP_FILE`] or the
/// tensor [`TOKEN_MAP_TENSOR`] listed in `files` (both only if they agree
/// entry for entry), or else built from the checkpoint's `tokenizer.json`
/// as the engines that serve DeepSeek's releases build it (a release ships
/// no map). The map must cover the raw vocabulary (`vocab_size` entries)
/// and map onto exactly `engram_compressed_vocab_size` ids containing the
/// pad id. An Engram checkpoint with none of the three is refused: hashing
/// raw ids would address other rows without a word.
fn with_token_map(spec: ModelSpec, dir: &Path, files: &Files) -> Result<ModelSpec> {
    if spec.family.family().compressed_vocab().is_none() {
        return Ok(spec);
    }
    let path = dir.join(TOKEN_MAP_FILE);
    let from_file = if path.exists() {
        Some((path.display().to_string(), load_token_map(&path)?.to_vec()))
    } else {
        None
    };
    let from_tensor = if files.weight_map.contains_key(TOKEN_MAP_TENSOR) {
        let (h, t) = files.find(TOKEN_MAP_TENSOR)?;
        let value = |msg: String| CheckpointError::Value {
            file: h.path.clone(),
            tensor: TOKEN_MAP_TENSOR.to_string(),
            msg,
        };
        let bytes = h
            .read_tensor(TOKEN_MAP_TENSOR)
            .map_err(|e| value(format!("{e:#}")))?;
        let ids = decode_token_map(t.dtype, &t.shape, &bytes).map_err(|e| value(e.to_string()))?;
        Some((
            format!("{} (tensor {TOKEN_MAP_TENSOR})", h.path.display()),
            ids,
        ))
    } else {
        None
    };
    let (source, map) = match (from_file, from_tensor) {
        (None, None) => {
            let tok = dir.join(TOKENIZER_FILE);
            if !tok.is_file() {
                return Err(CheckpointError::Invalid(format!(
                    "{}: an Engram checkpoint hashes compressed token ids, but it has no token \
                     map: none of {TOKEN_MAP_FILE}, the tensor {TOKEN_MAP_TENSOR} or \
                     {TOKENIZER_FILE} is there (`metrale-ple token-map tokenizer.json -o \
                     {TOKEN_MAP_FILE}` writes one)",
                    dir.display()
                )));
            }
            let built = token_map_from_tokenizer_json(&tok)
                .map_err(|e| CheckpointError::Invalid(format!("{e}")))?;
            (
                format!("{} (built from the tokenizer)", tok.display()),
                built.map.to_vec(),
            )
        }
        (Some(m), None) | (None, Some(m)) => m,
        (Some((file, a)), Some((tensor, b))) => {
            if let Some(i) = (0..a.len().max(b.len())).find(|&i| a.get(i) != b.get(i)) {
                return Err(CheckpointError::Invalid(format!(
                    "the token maps of {file} and {tensor} disagree at entry {i} ({:?} against \
                     {:?}); keep one",
                    a.get(i),
                    b.get(i)
                )));
            }
            (file, a)
        }
    };
    if map.len() as u64 != spec.vocab_size {
        return Err(CheckpointError::Invalid(format!(
            "{source}: the token map has {} entries, but config.json's vocab_size is {}",
            map.len(),
            spec.vocab_size
        )));
    }
    Ok(spec.with_token_map(map.into(), &source)?)
}

/// A checkpoint's weight map and headers, read by the families' loaders.
pub(crate) struct Files {
    dir: PathBuf,
    index_path: PathBuf,
    weight_map: BTreeMap<String, String>,
    headers: HashMap<String, Header>,
}

impl Files {
    /// The file holding `tensor` and its checked info.
    pub(crate) fn find(&self, tensor: &str) -> Result<(&Header, &TensorInfo)> {
        let file = self
            .weight_map
            .get(tensor)
            .ok_or_else(|| CheckpointError::MissingTensor {
                file: self.index_path.clone(),
                tensor: tensor.to_string(),
            })?;
        let h = &self.headers[file];
        let t = h
            .tensor(tensor)
            .ok_or_else(|| CheckpointError::MissingTensor {
                file: self.dir.join(file),
                tensor: tensor.to_string(),
            })?;
        Ok((h, t))
    }

    fn checked(&self, tensor: &str, dtype: Dtype, shape: &[u64]) -> Result<(&Header, &TensorInfo)> {
        let (h, t) = self.find(tensor)?;
        if t.dtype != dtype {
            return Err(CheckpointError::DType {
                file: h.path.clone(),
                tensor: tensor.to_string(),
                expected: dtype.name().to_string(),
                found: t.dtype.name().to_string(),
            });
        }
        if t.shape != shape {
            return Err(CheckpointError::Shape {
                file: h.path.clone(),
                tensor: tensor.to_string(),
                expected: shape.to_vec(),
                found: t.shape.clone(),
            });
        }
        Ok((h, t))
    }

    /// [`Files::checked`] for a table tensor of `rows` rows of `width`
    /// elements, which may be stored padded (wider, its row width declared
    /// in the file's metadata: `table pack --pad-rows`).
    fn checked_rows(
        &self,
        tensor: &str,
        dtype: Dtype,
        rows: u64,
        width: u64,
    ) -> Result<(&Header, &TensorInfo)> {
        let (h, t) = self.find(tensor)?;
        let declared = declared_row_width(h, tensor).map_err(|e| CheckpointError::Value {
            file: h.path.clone(),
            tensor: tensor.to_string(),
            msg: format!("{e}"),
        })?;
        match declared {
            Some(w) if w == width && t.shape.first() == Some(&rows) => {
                let stored = [rows, t.shape[1]];
                self.checked(tensor, dtype, &stored)
            }
            _ => self.checked(tensor, dtype, &[rows, width]),
        }
    }

    fn read(&self, tensor: &str, dtype: Dtype, shape: &[u64]) -> Result<(PathBuf, Vec<u8>)> {
        let (h, _) = self.checked(tensor, dtype, shape)?;
        let bytes = h.read_tensor(tensor).map_err(|e| CheckpointError::Value {
            file: h.path.clone(),
            tensor: tensor.to_string(),
            msg: format!("{e:#}"),
        })?;
        Ok((h.path.clone(), bytes))
    }

    /// A float tensor of `shape` as f32 values, in whichever float dtype
    /// it was saved (F32, BF16 or F16; each converts exactly); refuses
    /// non-finite values, naming the element.
    fn read_floats(&self, tensor: &str, shape: &[u64]) -> Result<(Dtype, Vec<f32>)> {
        let (h, t) = self.find(tensor)?;
        let dtype = match t.dtype {
            d @ (Dtype::F32 | Dtype::BF16 | Dtype::F16) => d,
            other => {
                return Err(CheckpointError::DType {
                    file: h.path.clone(),
                    tensor: tensor.to_string(),
                    expected: "a float dtype (F32, BF16 or F16)".into(),
                    found: other.name().to_string(),
                });
            }
        };
        let (file, b) = self.read(tensor, dtype, shape)?;
        let v: Vec<f32> = match dtype {
            Dtype::F32 => b
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
                .collect(),
            Dtype::BF16 => b
                .chunks_exact(2)
                .map(|c| bf16_to_f32(u16::from_le_bytes(c.try_into().unwrap())))
                .collect(),
            _ => b
                .chunks_exact(2)
                .map(|c| half::f16::from_le_bytes(c.try_into().unwrap()).to_f32())
                .collect(),
        };
        if let Some(i) = v.iter().position(|x| !x.is_finite()) {
            return Err(CheckpointError::Value {
                file,
                tensor: tensor.to_string(),
                msg: format!("element {i} is {}, not a finite number", v[i]),
            });
        }
        Ok((dtype, v))
    }

    /// A norm, conv or bias weight as f32.
    pub(crate) fn read_f32(&self, tensor: &str, shape: &[u64]) -> Result<Vec<f32>> {
        Ok(self.read_floats(tensor, shape)?.1)
    }

    /// A projection as BF16 bit patterns: BF16 as stored; F32 and F16
    /// rounded to the nearest BF16 (ties to even), the precision the
    /// projection runs at.
    pub(crate) fn read_bf16(&self, tensor: &str, shape: &[u64]) -> Result<Vec<u16>> {
        Ok(self
            .read_floats(tensor, shape)?
            .1
            .into_iter()
            .map(f32_to_bf16)
            .collect())
    }

    /// A `[rows, cols]` FP8 E4M3 tensor with one UE8M0 scale per 32 x 32
    /// block (tensor `scale`, `[ceil(rows/32), ceil(cols/32)]`, F8_E8M0 or
    /// U8), dequantised to BF16 bit patterns. The product of an E4M3
    /// value and a power of two is exact in BF16, so nothing is rounded.
    pub(crate) fn read_fp8_blocks(
        &self,
        tensor: &str,
        scale: &str,
        rows: usize,
        cols: usize,
    ) -> Result<Vec<u16>> {
        let (file, w) = self.read(tensor, Dtype::F8E4M3, &[rows as u64, cols as u64])?;
        let (rb, cb) = (rows.div_ceil(FP8_BLOCK), cols.div_ceil(FP8_BLOCK));
        // The release stores the scales as F8_E8M0; this project's inline
        // checkpoints as their raw U8 bytes. Same bytes either way.
        let (sh, st) = self.find(scale)?;
        let sdtype = match st.dtype {
            d @ (Dtype::F8E8M0 | Dtype::U8) => d,
            other => {
                return Err(CheckpointError::DType {
                    file: sh.path.clone(),
                    tensor: scale.to_string(),
                    expected: "F8_E8M0 (or U8)".into(),
                    found: other.name().into(),
                });
            }
        };
        let (sfile, sc) = self.read(scale, sdtype, &[rb as u64, cb as u64])?;
        if let Some(i) = sc.iter().position(|&b| b == 255) {
            return Err(CheckpointError::Value {
                file: sfile,
                tensor: scale.to_string(),
                msg: format!(
                    "block scale {i} (block [{}, {}]) is the UE8M0 NaN code 255",
                    i / cb,
                    i % cb
                ),
            });
        }
        // Every E4M3 code decoded once; each block's scale once per row.
        let lut: Vec<f32> = (0..=255u8).map(fp8_e4m3_to_f32).collect();
        let mut out = vec![0u16; rows * cols];
        for (r, (src, dst)) in w
            .chunks_exact(cols)
            .zip(out.chunks_exact_mut(cols))
            .enumerate()
        {
            let srow = &sc[(r / FP8_BLOCK) * cb..(r / FP8_BLOCK + 1) * cb];
            for (c0, (sb, db)) in src
                .chunks(FP8_BLOCK)
                .zip(dst.chunks_mut(FP8_BLOCK))
                .enumerate()
            {
                let scale = ue8m0_to_f32(srow[c0]);
                for (c, (&b, d)) in sb.iter().zip(db.iter_mut()).enumerate() {
                    let v = lut[b as usize] * scale;
                    if !v.is_finite() {
                        return Err(CheckpointError::Value {
                            file,
                            tensor: tensor.to_string(),
                            msg: format!(
                                "element {} (byte {b:#04x}) is not a finite number",
                                r * cols + c0 * FP8_BLOCK + c
                            ),
                        });
                    }
                    *d = f32_to_bf16(v);
                }
            }
        }
        Ok(out)
    }

    pub(crate) fn read_i64(&self, tensor: &str, len: usize) -> Result<(PathBuf, Vec<i64>)> {
        let (file, b) = self.read(tensor, Dtype::I64, &[len as u64])?;
        Ok((
            file,
            b.chunks_exact(8)
                .map(|c| i64::from_le_bytes(c.try_into().unwrap()))
                .collect(),
        ))
    }
}

/// Refuse a stored hash buffer that differs from its derivation.
pub(crate) fn check_buffer(
    file: &Path,
    tensor: &str,
    stored: &[i64],
    derived: &[u64],
) -> Result<()> {
    for (i, (&s, &d)) in stored.iter().zip(derived).enumerate() {
        if u64::try_from(s).ok() != Some(d) {
            return Err(CheckpointError::Value {
                file: file.to_path_buf(),
                tensor: tensor.to_string(),
                msg: format!("entry {i} is {s}, but the derivation from config.json gives {d}"),
            });
        }
    }
    Ok(())
}

impl Checkpoint {
    /// Open and fully validate the checkpoint in `dir`.
    pub fn open(dir: &Path) -> Result<Checkpoint> {
        Self::open_with(dir, OpenOptions::default())
    }

    /// [`Checkpoint::open`] with `opts`.
    pub fn open_with(dir: &Path, opts: OpenOptions) -> Result<Checkpoint> {
        // The config first: its errors say the most about a wrong directory.
        let spec = read_spec(dir)?;
        crate::tensor_parallel::check_ranks(dir, opts.table_ranks)?;
        let files = Self::open_files(dir)?;
        let spec = with_token_map(spec, dir, &files)?;
        let layout = Layout::detect(&spec, files.weight_map.keys())?;
        let mut sites = Vec::with_capacity(spec.sites());
        for s in 0..spec.sites() {
            sites.push(Self::open_site(&spec, &files, layout, s, opts)?);
        }
        let mut summaries: Vec<FileSummary> = files
            .headers
            .iter()
            .map(|(name, h)| FileSummary {
                name: name.clone(),
                bytes: h.file_len,
                tensors: h.tensors.len(),
                data_start: h.data_start,
            })
            .collect();
        summaries.sort_by(|a, b| a.name.cmp(&b.name));
        Ok(Checkpoint {
            dir: dir.to_path_buf(),
            spec,
            layout,
            sites,
            files: summaries,
        })
    }

    /// The weight map: [`INDEX_FILE`]'s, or, without one, every tensor of
    /// [`SINGLE_FILE`] (the single file `save_pretrained` writes for a
    /// model that fits one).
    fn open_files(dir: &Path) -> Result<Files> {
        let index_path = dir.join(INDEX_FILE);
        let single = dir.join(SINGLE_FILE);
        if !index_path.exists() && single.is_file() {
            let h = Header::read(&single).map_err(|e| header_err(&single, e))?;
            let weight_map = h
                .tensors
                .iter()
                .map(|t| (t.name.clone(), SINGLE_FILE.to_string()))
                .collect();
            return Ok(Files {
                dir: dir.to_path_buf(),
                index_path: single,
                weight_map,
                headers: HashMap::from([(SINGLE_FILE.to_string(), h)]),
            });
        }
        let text = std::fs::read_to_string(&index_path).map_err(|e| {
            if e.kind() == std::io::ErrorKind::NotFound {
                CheckpointError::Invalid(format!(
                    "{}: no weights: neither {INDEX_FILE} nor {SINGLE_FILE} is there",
                    dir.display()
                ))
            } else {
                CheckpointError::io(&index_path, e)
            }
        })?;
        let raw: RawIndex = serde_json::from_str(&text).map_err(|e| CheckpointError::Index {
            file: index_path.clone(),
            msg: e.to_string(),
        })?;
        let mut headers = HashMap::new();
        for (tensor, file) in &raw.weight_map {
            let plain = !file.is_empty()
                && !file.contains('/')
                && !file.contains('\\')
                && file != "."
                && file != "..";
            if !plain {
                return Err(CheckpointError::Index {
                    file: index_path.clone(),
                    msg: format!(
                        "tensor {tensor} maps to '{file}', which is not a file name inside the \
                         checkpoint directory"
                    ),
                });
            }
            if headers.contains_key(file) {
                continue;
            }
            let path = dir.join(file);
            if !path.is_file() {
                return Err(CheckpointError::MissingTensor {
                    file: path,
                    tensor: format!("{tensor} (its file does not exist)"),
                });
            }
            let h = Header::read(&path).map_err(|e| header_err(&path, e))?;
            headers.insert(file.clone(), h);
        }
        Ok(Files {
            dir: dir.to_path_buf(),
            index_path,
            weight_map: raw.weight_map,
            headers,
        })
    }

    /// The tables of this checkpoint stored as released (opened with
    /// [`OpenOptions::release_tables`]), in site order.
    pub fn release_tables(&self) -> Vec<SplitTable> {
        self.sites
            .iter()
            .filter_map(|s| s.table.release.clone())
            .collect()
    }

    fn open_site(
        g: &ModelSpec,
        files: &Files,
        layout: Layout,
        s: usize,
        opts: OpenOptions,
    ) -> Result<Site> {
        let layer = g.site_layer(s);
        let derived = g.derive(s).map_err(|source| CheckpointError::Config {
            file: files.dir.join(CONFIG_FILE),
            source: Box::new(source),
        })?;
        let dims = derived.dims;
        let spec = g.site_with(s, dims);
        let weights = layout.load_weights(g, files, &spec)?;
        let table = Self::check_table(g, files, layout, (s, &spec), derived.padded_rows, opts)?;
        Ok(Site {
            index: s,
            layer,
            spec,
            padded_rows: derived.padded_rows,
            weights,
            table,
        })
    }

    fn check_table(
        g: &ModelSpec,
        files: &Files,
        layout: Layout,
        (s, spec): (usize, &SiteSpec),
        padded_rows: u64,
        opts: OpenOptions,
    ) -> Result<SiteTable> {
        let layer = spec.layer;
        let shards_err = |msg: String| CheckpointError::Shards {
            file: files.index_path.clone(),
            layer,
            msg,
        };
        let names = layout.table_tensors(g, s);
        let parts = names.len();
        if let Some(n) = layout.site_names(layer) {
            let mut present: Vec<usize> = files
                .weight_map
                .keys()
                .filter_map(|t| n.parse_shard_weight(t))
                .collect();
            present.sort_unstable();
            if let Some(&extra) = present.iter().find(|&&i| i >= parts) {
                return Err(shards_err(format!(
                    "shard {extra} ({}) is one too many: the table's rows cut into \
                     split_ngram_parts = {} make {parts} shards",
                    n.shard_weight(extra),
                    g.split_ngram_parts
                )));
            }
        }
        for name in &names {
            if !files.weight_map.contains_key(name) {
                return Err(CheckpointError::MissingTensor {
                    file: files.index_path.clone(),
                    tensor: name.clone(),
                });
            }
        }
        let (h0, t0) = files.find(&names[0])?;
        let split = Self::split_table(g, files, layout, layer, (h0, t0))?;
        if let Some(sp) = &split
            && !opts.release_tables
        {
            return Err(CheckpointError::ReleasedTable {
                file: h0.path.clone(),
                tensor: sp.weight.clone(),
                scale: sp.scale.clone(),
            });
        }
        // A tensor-parallel rank's table holds its columns of every row.
        let ranks = opts.table_ranks.max(1);
        if !g.head_dim.is_multiple_of(ranks) {
            return Err(shards_err(format!(
                "head_dim {} does not divide among {ranks} tensor-parallel ranks",
                g.head_dim
            )));
        }
        let row_width = g.head_dim / ranks;
        let hd = row_width as u64;
        let block_width = fp8_block_row_bytes(row_width) as u64;
        // A padded table's rows are narrower than its tensor.
        let t0_width = declared_row_width(h0, &names[0])
            .ok()
            .flatten()
            .or_else(|| t0.shape.get(1).copied());
        let (dtype, st_dtype, width) = match t0.dtype {
            // The release's pair converts to inline block rows.
            Dtype::F8E4M3 if split.is_some() => (RowDType::Fp8E4M3Block32, Dtype::F8E4M3, hd),
            Dtype::BF16 => (RowDType::Bf16, Dtype::BF16, hd),
            Dtype::F32 if layout.site_names(layer).is_some() => (RowDType::F32, Dtype::F32, hd),
            Dtype::F8E4M3 => (RowDType::Fp8E4M3, Dtype::F8E4M3, hd),
            Dtype::U8 if t0_width == Some(block_width) && block_width != hd => {
                (RowDType::Fp8E4M3Block32, Dtype::U8, block_width)
            }
            Dtype::U8 => (RowDType::Fp8E4M3, Dtype::U8, hd),
            other => {
                return Err(CheckpointError::DType {
                    file: h0.path.clone(),
                    tensor: names[0].clone(),
                    expected: "BF16, F8_E4M3, U8 (FP8 rows with inline block scales), or F32 \
                               (Qwen4Exp)"
                        .into(),
                    found: other.name().into(),
                });
            }
        };
        if !dtype.fits_head_dim(row_width) {
            return Err(shards_err(format!(
                "{}: {dtype:?} rows need a head_dim that is a multiple of {FP8_BLOCK}, not {hd}",
                names[0]
            )));
        }
        // Rows of each part: equal shards of the cut or whole table, or
        // LongCat's sub-tables (whole: each its own size; cut: equal).
        let rows_per_shard = t0.shape.first().copied().unwrap_or(0);
        if rows_per_shard == 0 {
            return Err(shards_err(format!("{} has no rows", names[0])));
        }
        let logical: Vec<u64> = if layout.sub_tables() {
            spec.dims.head_vocab_sizes.clone()
        } else {
            Vec::new()
        };
        // Qwen4Exp's whole table is cut as torch.chunk cuts it (the last
        // shard may be shorter); the rest as before.
        let qwen_rows = match g.table_rows {
            None if layout.torch_chunked() => layout.part_rows(g, s, padded_rows),
            _ => Vec::new(),
        };
        let expect_rows = |i: usize| -> u64 {
            match (layout.sub_tables(), g.table_rows) {
                (true, None) => logical[i],
                _ => qwen_rows.get(i).copied().unwrap_or(rows_per_shard),
            }
        };
        let mut shards = Vec::with_capacity(parts);
        let mut part_rows = Vec::with_capacity(parts);
        let mut bytes = 0u64;
        for (i, name) in names.iter().enumerate() {
            let r = expect_rows(i);
            if let Some(sp) = &split {
                // One tensor (Engram), its pair checked by `split_table`.
                bytes += sp.rows * sp.row_bytes();
                shards.push(table_shard(sp.weight_file.clone(), name));
                part_rows.push(r);
                continue;
            }
            let (h, t) = files.checked_rows(name, st_dtype, r, width)?;
            bytes += t.len;
            if dtype.has_row_scale() {
                let sn = scale_name(name);
                let (sh, st) = files.checked(&sn, Dtype::F32, &[r])?;
                if sh.path != h.path {
                    return Err(shards_err(format!(
                        "{sn} must be in the same file as {name} ({})",
                        h.path.display()
                    )));
                }
                bytes += st.len;
            }
            shards.push(table_shard(h.path.clone(), name));
            part_rows.push(r);
        }
        let stored_rows: u64 = part_rows.iter().sum();
        let fold_rows = match g.table_rows {
            None if stored_rows < padded_rows => {
                return Err(shards_err(format!(
                    "{parts} table tensors of {rows_per_shard} rows hold {stored_rows} rows, fewer \
                     than the {padded_rows} rows the hash addresses (and config.json has no \
                     `ple_table_rows` to fold ids into a cut table)"
                )));
            }
            None => None,
            Some(m) if m != stored_rows => {
                return Err(shards_err(format!(
                    "{parts} table tensors of {rows_per_shard} rows hold {stored_rows} rows, but \
                     config.json says `ple_table_rows` = {m}"
                )));
            }
            Some(m) if m >= padded_rows => None,
            Some(m) => Some(m),
        };
        if let Some(i) = logical.iter().zip(&part_rows).position(|(l, r)| r > l) {
            return Err(shards_err(format!(
                "{} stores {} rows, more than the {} rows of its sub-table",
                names[i], part_rows[i], logical[i]
            )));
        }
        // The storage layer's own opener must agree (equal shapes, scales,
        // and the same row format), or the runtime would read other rows.
        // A released table is not served: only its conversion reads it.
        let opened: Vec<metrale_storage::layout::TableFiles> = if split.is_some() {
            Ok(Vec::new())
        } else if layout.sub_tables() {
            shards
                .iter()
                .zip(&part_rows)
                .map(|(shard, &r)| {
                    metrale_storage::layout::TableFiles::open(std::slice::from_ref(shard), Some(r))
                })
                .collect::<Result<_, _>>()
        } else {
            metrale_storage::layout::TableFiles::open(&shards, Some(stored_rows)).map(|t| vec![t])
        }
        .map_err(|e| shards_err(format!("{e:#}")))?;
        for t in &opened {
            if t.info.dtype != dtype || t.info.head_dim != row_width {
                return Err(shards_err(format!(
                    "{}: the table reads as {} values of {:?} a row, but the layer needs {} of \
                     {dtype:?}",
                    t.shards[0].tensor, t.info.head_dim, t.info.dtype, row_width
                )));
            }
        }
        Ok(SiteTable {
            shards,
            rows_per_shard,
            stored_rows,
            fold_rows,
            dtype,
            head_dim: row_width,
            bytes,
            sub_tables: logical
                .into_iter()
                .zip(part_rows)
                .map(|(logical_rows, stored_rows)| SubTable {
                    logical_rows,
                    stored_rows,
                })
                .collect(),
            release: split,
        })
    }

    /// A DeepSeek-V4.1 table `(h0, t0)` stored as released: F8_E4M3 values
    /// with block scales (F8_E8M0 or two-dimensional) under the scale name.
    /// A per-row F32 scale there is this project's `fp8` rows, not this.
    fn split_table(
        g: &ModelSpec,
        files: &Files,
        layout: Layout,
        layer: usize,
        (h0, t0): (&Header, &TensorInfo),
    ) -> Result<Option<SplitTable>> {
        if !layout.release_tables() || t0.dtype != Dtype::F8E4M3 {
            return Ok(None);
        }
        let sn = V41Names::new(layer).table_scale();
        if !files.weight_map.contains_key(&sn) {
            return Ok(None);
        }
        let (sh, st) = files.find(&sn)?;
        if !is_block_scale(st) {
            return Ok(None);
        }
        check_split(layer, g.head_dim, (h0, t0), (sh, st)).map(Some)
    }

    /// Bytes of table data over all sites.
    pub fn table_bytes(&self) -> u64 {
        self.sites.iter().map(|s| s.table.bytes).sum()
    }
}
