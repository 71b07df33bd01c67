//! The validating checkpoint loader.
//!
//! [`Checkpoint::open`] checks everything a layer relies on before anything
//! is built from it: the config parses and its hash constants derive; the
//! weight map names only plain files inside the directory; every safetensors
//! header parses and every extent lies inside its file; every tensor the
//! format requires is present with the right dtype and shape; the stored
//! hash buffers equal their derivation (odd multipliers first); norm and
//! conv weights are finite; the table shards are contiguous, equal in shape
//! and cover the table. A refusal is a [`CheckpointError`] naming the file
//! and tensor.
//!
//! Only the dense weights are read (tens of MB at the flagship geometry);
//! table shards are checked from their headers alone.

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};

use metrale_model_layers::layers::ple::PleWeights;
use metrale_model_layers::layers::ple::spec::{ModelSpec, SiteSpec};
use metrale_storage::StorageError;
use metrale_storage::safetensors::{Dtype, Header, TensorInfo};
use metrale_storage::table::RowDType;
use serde::Deserialize;

use crate::error::{CheckpointError, Result};
use crate::names::{CONFIG_FILE, INDEX_FILE, SiteNames};

/// Where one site's table rows are stored.
#[derive(Clone, Debug, PartialEq)]
pub struct SiteTable {
    /// `(file, tensor)` of each shard's weight, in row order.
    pub shards: Vec<(PathBuf, String)>,
    /// Rows in every shard.
    pub rows_per_shard: u64,
    /// Rows stored (`shards * rows_per_shard`).
    pub stored_rows: u64,
    /// `Some(m)` when the table is cut: row `id` is stored at `id % m`.
    pub fold_rows: Option<u64>,
    /// Element type.
    pub dtype: RowDType,
    /// Values per row.
    pub head_dim: usize,
    /// Bytes of row data (and FP8 scales) over all shards.
    pub bytes: u64,
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

struct Files {
    dir: PathBuf,
    index_path: PathBuf,
    weight_map: BTreeMap<String, String>,
    headers: HashMap<String, Header>,
}

impl Files {
    /// The file holding `tensor` and its checked info.
    fn find(&self, tensor: &str) -> Result<(&Header, &TensorInfo)> {
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

    fn read(&self, tensor: &str, dtype: Dtype, shape: &[u64]) -> Result<(PathBuf, Vec<u8>)> {
        let (h, _) = self.checked(tensor, dtype, shape)?;
        let bytes = h.read_tensor(tensor).map_err(|e| CheckpointError::Value {
            file: h.path.clone(),
            tensor: tensor.to_string(),
            msg: format!("{e:#}"),
        })?;
        Ok((h.path.clone(), bytes))
    }

    fn read_f32(&self, tensor: &str, shape: &[u64]) -> Result<Vec<f32>> {
        let (file, b) = self.read(tensor, Dtype::F32, shape)?;
        let v: Vec<f32> = b
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
            .collect();
        if let Some(i) = v.iter().position(|x| !x.is_finite()) {
            return Err(CheckpointError::Value {
                file,
                tensor: tensor.to_string(),
                msg: format!("element {i} is {}, not a finite number", v[i]),
            });
        }
        Ok(v)
    }

    fn read_bf16(&self, tensor: &str, shape: &[u64]) -> Result<Vec<u16>> {
        let (file, b) = self.read(tensor, Dtype::BF16, shape)?;
        let v: Vec<u16> = b
            .chunks_exact(2)
            .map(|c| u16::from_le_bytes(c.try_into().unwrap()))
            .collect();
        // BF16 shares f32's exponent: all-ones exponent bits mean Inf/NaN.
        if let Some(i) = v.iter().position(|x| x & 0x7F80 == 0x7F80) {
            return Err(CheckpointError::Value {
                file,
                tensor: tensor.to_string(),
                msg: format!("element {i} (bits {:#06x}) is not a finite number", v[i]),
            });
        }
        Ok(v)
    }

    fn read_i64(&self, tensor: &str, len: usize) -> Result<(PathBuf, Vec<i64>)> {
        let (file, b) = self.read(tensor, Dtype::I64, &[len as u64])?;
        Ok((
            file,
            b.chunks_exact(8)
                .map(|c| i64::from_le_bytes(c.try_into().unwrap()))
                .collect(),
        ))
    }
}

fn check_buffer(file: &Path, tensor: &str, stored: &[i64], derived: &[u64]) -> Result<()> {
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
        let spec = read_spec(dir)?;
        let files = Self::open_files(dir)?;
        let mut sites = Vec::with_capacity(spec.sites());
        for s in 0..spec.sites() {
            sites.push(Self::open_site(&spec, &files, s)?);
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
            sites,
            files: summaries,
        })
    }

    fn open_files(dir: &Path) -> Result<Files> {
        let index_path = dir.join(INDEX_FILE);
        let text = std::fs::read_to_string(&index_path)
            .map_err(|e| CheckpointError::io(&index_path, e))?;
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

    fn open_site(g: &ModelSpec, files: &Files, s: usize) -> Result<Site> {
        let layer = g.site_layer(s);
        let n = SiteNames::new(layer);
        let derived = g.derive(s).map_err(|source| CheckpointError::Config {
            file: files.dir.join(CONFIG_FILE),
            source: Box::new(source),
        })?;
        let dims = derived.dims;

        let (file, m) = files.read_i64(&n.layer_multipliers(), g.ngram_size)?;
        if let Some(i) = m.iter().position(|x| x % 2 == 0) {
            return Err(CheckpointError::Value {
                file,
                tensor: n.layer_multipliers(),
                msg: format!(
                    "multiplier {i} is {}, which is even; every multiplier is odd",
                    m[i]
                ),
            });
        }
        check_buffer(&file, &n.layer_multipliers(), &m, &dims.multipliers)?;
        let (file, v) = files.read_i64(&n.vocab_sizes(), g.ngram_heads())?;
        check_buffer(&file, &n.vocab_sizes(), &v, &dims.head_vocab_sizes)?;
        let (file, o) = files.read_i64(&n.offsets(), g.ngram_heads())?;
        check_buffer(&file, &n.offsets(), &o, &dims.head_offsets)?;

        let (c, e, h, k) = (
            g.channels() as u64,
            g.emb_dim() as u64,
            g.hidden_size as u64,
            g.conv_kernel_size,
        );
        let weights = PleWeights {
            key_proj: files.read_bf16(&n.key_proj(), &[c, e])?,
            value_proj: files.read_bf16(&n.value_proj(), &[h, e])?,
            norm_key: files.read_f32(&n.norm_key(), &[c])?,
            norm_query: files.read_f32(&n.norm_query(), &[c])?,
            norm_conv: files.read_f32(&n.norm_conv(), &[c])?,
            conv1d: files.read_f32(&n.conv1d(), &[c, 1, k as u64])?,
        };
        let table = Self::check_table(g, files, &n, layer, derived.padded_rows)?;
        Ok(Site {
            index: s,
            layer,
            spec: g.site_with(s, dims),
            padded_rows: derived.padded_rows,
            weights,
            table,
        })
    }

    fn check_table(
        g: &ModelSpec,
        files: &Files,
        n: &SiteNames,
        layer: usize,
        padded_rows: u64,
    ) -> Result<SiteTable> {
        let shards_err = |msg: String| CheckpointError::Shards {
            file: files.index_path.clone(),
            layer,
            msg,
        };
        let mut present: Vec<usize> = files
            .weight_map
            .keys()
            .filter_map(|t| n.parse_shard_weight(t))
            .collect();
        present.sort_unstable();
        let parts = g.split_ngram_parts;
        for i in 0..parts {
            if present.binary_search(&i).is_err() {
                return Err(CheckpointError::MissingTensor {
                    file: files.index_path.clone(),
                    tensor: n.shard_weight(i),
                });
            }
        }
        if let Some(&extra) = present.iter().find(|&&i| i >= parts) {
            return Err(shards_err(format!(
                "shard {extra} is past split_ngram_parts = {parts} ({})",
                n.shard_weight(extra)
            )));
        }
        let (_, t0) = files.find(&n.shard_weight(0))?;
        let rows_per_shard = t0.shape.first().copied().unwrap_or(0);
        let (dtype, st_dtype) = match t0.dtype {
            Dtype::BF16 => (RowDType::Bf16, Dtype::BF16),
            Dtype::F8E4M3 => (RowDType::Fp8E4M3, Dtype::F8E4M3),
            Dtype::U8 => (RowDType::Fp8E4M3, Dtype::U8),
            other => {
                return Err(CheckpointError::DType {
                    file: files.headers[&files.weight_map[&n.shard_weight(0)]]
                        .path
                        .clone(),
                    tensor: n.shard_weight(0),
                    expected: "BF16 or F8_E4M3".into(),
                    found: other.name().into(),
                });
            }
        };
        let mut shards = Vec::with_capacity(parts);
        let mut bytes = 0u64;
        for i in 0..parts {
            let (h, t) = files.checked(
                &n.shard_weight(i),
                st_dtype,
                &[rows_per_shard, g.head_dim as u64],
            )?;
            bytes += t.len;
            if dtype == RowDType::Fp8E4M3 {
                let (sh, st) = files.checked(&n.shard_scale(i), Dtype::F32, &[rows_per_shard])?;
                if sh.path != h.path {
                    return Err(shards_err(format!(
                        "{} must be in the same file as {} ({})",
                        n.shard_scale(i),
                        n.shard_weight(i),
                        h.path.display()
                    )));
                }
                bytes += st.len;
            }
            shards.push((h.path.clone(), n.shard_weight(i)));
        }
        let stored_rows = rows_per_shard * parts as u64;
        if rows_per_shard == 0 {
            return Err(shards_err(format!("{} has no rows", n.shard_weight(0))));
        }
        let fold_rows = match g.table_rows {
            None if stored_rows < padded_rows => {
                return Err(shards_err(format!(
                    "{parts} shards of {rows_per_shard} rows hold {stored_rows} rows, fewer than \
                     the {padded_rows} rows the hash addresses (and config.json has no \
                     `ple_table_rows` to fold ids into a cut table)"
                )));
            }
            None => None,
            Some(m) if m != stored_rows => {
                return Err(shards_err(format!(
                    "{parts} shards of {rows_per_shard} rows hold {stored_rows} rows, but \
                     config.json says `ple_table_rows` = {m}"
                )));
            }
            Some(m) if m >= padded_rows => None,
            Some(m) => Some(m),
        };
        // The storage layer's own opener must agree (equal shapes, scales).
        metrale_storage::layout::TableFiles::open(&shards, Some(stored_rows))
            .map_err(|e| shards_err(format!("{e:#}")))?;
        Ok(SiteTable {
            shards,
            rows_per_shard,
            stored_rows,
            fold_rows,
            dtype,
            head_dim: g.head_dim,
            bytes,
        })
    }

    /// Bytes of table data over all sites.
    pub fn table_bytes(&self) -> u64 {
        self.sites.iter().map(|s| s.table.bytes).sum()
    }
}
