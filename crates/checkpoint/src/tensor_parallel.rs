//! One tensor-parallel rank's share of a checkpoint on disk
//! (docs/SPEC.md §5, "Tensor-parallel shards"): [`write_rank`] writes it,
//! [`RankCheckpoint::open`] opens it, [`open_group`] opens the ranks of one
//! split in order.
//!
//! A rank directory is a checkpoint directory: the source's config, weight
//! map, token map, row remaps and every other file copied as they are, and
//! its safetensors files with the same tensors, except that every table
//! tensor holds only rank `r`'s columns of each row
//! ([`TensorParallel::shard_rows`]: rows of `head_dim / R` values in the
//! table's dtype, with the scale bytes of its own blocks for block-scaled
//! FP8). Per-row FP8 scales and the dense weights are copied whole: the
//! layer selects its projection columns when it is built. The manifest
//! [`MANIFEST_FILE`] names the rank, the number of ranks and a digest of
//! the source, so ranks of different splits or sources are never run
//! together, and only a rank opener reads the directory ([`check_ranks`]).
//!
//! Invariants: the manifest is written last, after the directory opened
//! and validated as the rank's checkpoint, so a directory with it is
//! complete; each safetensors file appears complete or not at all
//! (written beside itself, synced, renamed), so an interrupted write
//! resumes by skipping the files already there; a split that does not
//! divide `head_dim`, or cuts a 32-value FP8 scale block, is refused before
//! anything is written, naming the numbers.

use std::collections::{BTreeMap, HashMap};
use std::io::Read as _;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use metrale_gpu_runtime::gpu::GpuBackend;
use metrale_model_layers::layers::ple::{PleLayer, Reduce, Shard, TensorParallel};
use metrale_storage::digest::{Sha256, hex};
use metrale_storage::layout::row_width_key;
use metrale_storage::safetensors::{Header, TensorInfo, TensorSpec, Writer};
use metrale_storage::table::{RowDType, RowTable};
use serde::{Deserialize, Serialize};

use crate::error::{CheckpointError, Result};
use crate::load::{Checkpoint, OpenOptions};

/// The manifest that makes a directory one rank's share.
pub const MANIFEST_FILE: &str = "tensor_parallel.json";
/// The manifest of a share still being written (resumed by a rerun).
const PARTIAL_FILE: &str = ".tensor_parallel.partial.json";
/// The data section alignment of the files written (O_DIRECT row reads).
const ALIGN: u64 = 4096;
/// Source bytes read per step, and between progress calls.
const CHUNK: u64 = 8 << 20;

/// The directory name of rank `rank` of `ranks` when every rank's share
/// is written under one directory: `rank-{rank}-of-{ranks}`.
pub fn rank_dir_name(rank: usize, ranks: usize) -> String {
    format!("rank-{rank}-of-{ranks}")
}

/// What a rank directory is: [`MANIFEST_FILE`]'s contents.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct RankManifest {
    /// This rank.
    pub rank: usize,
    /// The number of ranks of the split.
    pub ranks: usize,
    /// How the tables are split: `"columns"`.
    pub split: String,
    /// The source checkpoint's digest ([`source_digest`]), the same for
    /// every rank of one split.
    pub source: String,
}

/// The split [`RankManifest::split`] names.
const COLUMNS: &str = "columns";

impl RankManifest {
    /// The manifest's rank as a split.
    pub fn tensor_parallel(&self) -> Result<TensorParallel> {
        TensorParallel::new(self.rank, self.ranks)
            .map_err(|e| CheckpointError::Invalid(format!("{MANIFEST_FILE}: {e}")))
    }
}

/// Read `dir`'s manifest, `None` when it has none.
pub fn read_manifest(dir: &Path) -> Result<Option<RankManifest>> {
    read_manifest_file(&dir.join(MANIFEST_FILE))
}

fn read_manifest_file(path: &Path) -> Result<Option<RankManifest>> {
    let text = match std::fs::read_to_string(path) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(CheckpointError::io(path, e)),
    };
    parse_manifest(&text, path).map(Some)
}

/// Parse a manifest's `text` (read from `path`, which errors name):
/// refused unless it names the column split and a rank below a positive
/// number of ranks.
pub fn parse_manifest(text: &str, path: &Path) -> Result<RankManifest> {
    let m: RankManifest = serde_json::from_str(text).map_err(|e| {
        CheckpointError::Invalid(format!(
            "{}: not a tensor-parallel manifest: {e}",
            path.display()
        ))
    })?;
    if m.split != COLUMNS {
        return Err(CheckpointError::Invalid(format!(
            "{}: split \"{}\" is not one this runtime serves (\"{COLUMNS}\")",
            path.display(),
            m.split
        )));
    }
    TensorParallel::new(m.rank, m.ranks)
        .map_err(|e| CheckpointError::Invalid(format!("{}: {e}", path.display())))?;
    Ok(m)
}

/// Refuse to open `dir` with `table_ranks` (see
/// [`OpenOptions::table_ranks`]) where its manifest says another number of
/// ranks: a rank's share opened as a whole checkpoint would read narrower
/// rows than its layers need, and is refused here with a message that
/// says how to open it.
pub fn check_ranks(dir: &Path, table_ranks: usize) -> Result<()> {
    let want = table_ranks.max(1);
    match read_manifest(dir)? {
        // Without a manifest the tables' widths decide (a share being
        // validated before its manifest is written opens this way).
        None => Ok(()),
        Some(m) if m.ranks == want => Ok(()),
        Some(m) => Err(CheckpointError::Invalid(format!(
            "{}: rank {} of {} ranks' column slice of a checkpoint (written by `metrale-ple \
             table shard`): open it as a rank (`run --tp-ranks DIR0,DIR1,..`, \
             `RankCheckpoint::open`), not as a whole checkpoint",
            dir.display(),
            m.rank,
            m.ranks
        ))),
    }
}

/// A digest of `ck`'s config and safetensors headers: what every rank of
/// one split records, so ranks cut from different checkpoints are told
/// apart without reading the tables.
pub fn source_digest(ck: &Checkpoint) -> Result<String> {
    let mut h = Sha256::new();
    let config = ck.dir.join(crate::names::CONFIG_FILE);
    let text = std::fs::read(&config).map_err(|e| CheckpointError::io(&config, e))?;
    h.update(&(text.len() as u64).to_le_bytes());
    h.update(&text);
    for f in &ck.files {
        let path = ck.dir.join(&f.name);
        let raw = raw_header(&path)?;
        h.update(&(f.name.len() as u64).to_le_bytes());
        h.update(f.name.as_bytes());
        h.update(&f.bytes.to_le_bytes());
        h.update(&(raw.len() as u64).to_le_bytes());
        h.update(&raw);
    }
    Ok(hex(&h.finish()))
}

/// The header bytes of the safetensors file `path` (length prefix
/// included), as stored.
fn raw_header(path: &Path) -> Result<Vec<u8>> {
    let mut f = std::fs::File::open(path).map_err(|e| CheckpointError::io(path, e))?;
    let mut len = [0u8; 8];
    f.read_exact(&mut len)
        .map_err(|e| CheckpointError::io(path, e))?;
    let n = u64::from_le_bytes(len);
    let file_len = f
        .metadata()
        .map_err(|e| CheckpointError::io(path, e))?
        .len();
    if n > file_len.saturating_sub(8) {
        return Err(CheckpointError::Header {
            file: path.to_path_buf(),
            msg: format!("a header of {n} bytes in a file of {file_len}"),
        });
    }
    let mut out = len.to_vec();
    out.resize(8 + n as usize, 0);
    f.read_exact(&mut out[8..])
        .map_err(|e| CheckpointError::io(path, e))?;
    Ok(out)
}

/// A rank's share of a checkpoint, opened: the checkpoint (its tables the
/// rank's columns) and the rank.
#[derive(Clone, Debug)]
pub struct RankCheckpoint {
    /// The validated checkpoint; its sites' tables hold rows of
    /// `head_dim / ranks` values.
    pub ck: Checkpoint,
    /// What the directory says it is.
    pub manifest: RankManifest,
}

impl RankCheckpoint {
    /// Open the rank directory `dir` (written by [`write_rank`]).
    pub fn open(dir: &Path) -> Result<RankCheckpoint> {
        let manifest = read_manifest(dir)?.ok_or_else(|| {
            CheckpointError::Invalid(format!(
                "{}: no {MANIFEST_FILE}: not a tensor-parallel rank's share (`metrale-ple table \
                 shard` writes one)",
                dir.display()
            ))
        })?;
        let ck = Checkpoint::open_with(
            dir,
            OpenOptions {
                table_ranks: manifest.ranks,
                ..OpenOptions::default()
            },
        )?;
        Ok(RankCheckpoint { ck, manifest })
    }

    /// This rank.
    pub fn tensor_parallel(&self) -> TensorParallel {
        self.manifest
            .tensor_parallel()
            .expect("checked when the manifest was read")
    }

    /// Site `site`'s layer for this rank over `table` (one of this
    /// directory's tables), completing its projections through `reduce`.
    pub fn build_layer(
        &self,
        site: usize,
        table: Arc<dyn RowTable>,
        max_tokens: usize,
        gpu: &dyn GpuBackend,
        reduce: Arc<dyn Reduce>,
    ) -> Result<PleLayer> {
        let shard = Shard::new(self.tensor_parallel(), reduce);
        self.ck
            .build_layer_sharded(site, table, max_tokens, gpu, shard)
    }
}

/// Open the ranks of one split, `dirs[r]` being rank `r`: refused unless
/// there is one directory per rank, in rank order, all of one split of one
/// source.
pub fn open_group(dirs: &[PathBuf]) -> Result<Vec<RankCheckpoint>> {
    let mut out: Vec<RankCheckpoint> = Vec::with_capacity(dirs.len());
    for (r, d) in dirs.iter().enumerate() {
        let rc = RankCheckpoint::open(d)?;
        let m = &rc.manifest;
        if m.ranks != dirs.len() || m.rank != r {
            return Err(CheckpointError::Invalid(format!(
                "{}: rank {} of {} ranks, given as rank {r} of {}: list one directory per rank, \
                 in rank order",
                d.display(),
                m.rank,
                m.ranks,
                dirs.len()
            )));
        }
        if let Some(first) = out.first()
            && first.manifest.source != m.source
        {
            return Err(CheckpointError::Invalid(format!(
                "{} and {} were cut from different checkpoints (source digests {} and {})",
                dirs[0].display(),
                d.display(),
                first.manifest.source,
                m.source
            )));
        }
        out.push(rc);
    }
    if out.is_empty() {
        return Err(CheckpointError::Invalid(
            "no rank directories given".to_string(),
        ));
    }
    Ok(out)
}

/// What [`write_rank`] did.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RankReport {
    /// Safetensors files written now.
    pub written: usize,
    /// Safetensors files already complete from an earlier, interrupted
    /// run (left as they were).
    pub resumed: usize,
    /// Whether the whole share was already complete (nothing written).
    pub complete: bool,
    /// Bytes of the source's table tensors (the values, and the scales
    /// stored with them).
    pub source_table_bytes: u64,
    /// Bytes of this rank's table tensors.
    pub table_bytes: u64,
    /// Bytes of this rank's safetensors files.
    pub file_bytes: u64,
}

/// One table tensor of a source file and how its rows are cut.
#[derive(Clone, Copy, Debug)]
struct TableCut {
    dtype: RowDType,
    head_dim: usize,
}

/// Write rank `tp`'s share of the checkpoint `src` into `out` (a new
/// directory, or one an interrupted run of the same split left), calling
/// `progress(done, total)` with source data bytes processed. Reads the
/// source in bounded chunks; validates the result as the rank's checkpoint
/// before its manifest is written.
pub fn write_rank(
    src: &Path,
    tp: TensorParallel,
    out: &Path,
    progress: &mut dyn FnMut(u64, u64),
) -> Result<RankReport> {
    let ck = Checkpoint::open(src)?;
    // Every table must split before a byte is written.
    let mut tables: HashMap<PathBuf, BTreeMap<String, TableCut>> = HashMap::new();
    let mut report = RankReport::default();
    for s in &ck.sites {
        tp.columns(s.table.head_dim, s.table.dtype)
            .map_err(|split| CheckpointError::TensorParallel {
                layer: s.layer,
                split,
            })?;
        report.source_table_bytes += s.table.bytes;
        for sh in &s.table.shards {
            tables.entry(sh.path.clone()).or_default().insert(
                sh.weight.clone(),
                TableCut {
                    dtype: s.table.dtype,
                    head_dim: s.table.head_dim,
                },
            );
        }
    }
    let manifest = RankManifest {
        rank: tp.rank(),
        ranks: tp.ranks(),
        split: COLUMNS.to_string(),
        source: source_digest(&ck)?,
    };
    if let Some(m) = read_manifest(out)? {
        if m == manifest {
            let done = RankCheckpoint::open(out)?;
            report.complete = true;
            report.resumed = done.ck.files.len();
            fill_sizes(&done.ck, &mut report);
            return Ok(report);
        }
        return Err(CheckpointError::Invalid(format!(
            "{} already holds rank {} of {} of another checkpoint or split; write the share \
             into a new directory",
            out.display(),
            m.rank,
            m.ranks
        )));
    }
    let partial = out.join(PARTIAL_FILE);
    match read_manifest_file(&partial)? {
        Some(m) if m == manifest => {}
        Some(m) => {
            return Err(CheckpointError::Invalid(format!(
                "{} holds an interrupted write of rank {} of {} of another checkpoint or \
                 split; remove it or write into a new directory",
                out.display(),
                m.rank,
                m.ranks
            )));
        }
        None => {
            if out.exists() {
                let mut entries =
                    std::fs::read_dir(out).map_err(|e| CheckpointError::io(out, e))?;
                if entries.next().is_some() {
                    return Err(CheckpointError::Invalid(format!(
                        "{} exists and is not an interrupted write of this rank; the share is \
                         written into a new or empty directory",
                        out.display()
                    )));
                }
            }
            std::fs::create_dir_all(out).map_err(|e| CheckpointError::io(out, e))?;
            write_json_atomic(&partial, &manifest)?;
        }
    }
    let mut total = 0u64;
    let mut headers = Vec::with_capacity(ck.files.len());
    for f in &ck.files {
        let path = ck.dir.join(&f.name);
        let h = Header::read(&path).map_err(|e| storage(&path, e))?;
        total += h.file_len - h.data_start;
        headers.push(h);
    }
    let mut done = 0u64;
    progress(0, total);
    let none = BTreeMap::new();
    for (f, h) in ck.files.iter().zip(&headers) {
        let cuts = tables.get(&h.path).unwrap_or(&none);
        let dst = out.join(&f.name);
        let (specs, metadata) = rank_layout(h, cuts, tp)?;
        if is_complete(&dst, &specs, &metadata) {
            report.resumed += 1;
            done += h.file_len - h.data_start;
            progress(done, total);
        } else {
            write_file(h, cuts, tp, &dst, (&specs, &metadata), &mut |n| {
                done += n;
                progress(done, total)
            })?;
            report.written += 1;
        }
    }
    progress(total, total);
    copy_other_files(&ck, out)?;
    // The rank's checkpoint must open and agree with the source.
    let opened = Checkpoint::open_with(
        out,
        OpenOptions {
            table_ranks: tp.ranks(),
            ..OpenOptions::default()
        },
    )?;
    for (a, b) in ck.sites.iter().zip(&opened.sites) {
        if a.table.stored_rows != b.table.stored_rows
            || a.table.dtype != b.table.dtype
            || a.table.head_dim != b.table.head_dim * tp.ranks()
        {
            return Err(CheckpointError::Invalid(format!(
                "{}: the written table of layer {} reads as {} rows of {} {:?} values, the \
                 source's as {} rows of {} (over {} ranks)",
                out.display(),
                a.layer,
                b.table.stored_rows,
                b.table.head_dim,
                b.table.dtype,
                a.table.stored_rows,
                a.table.head_dim,
                tp.ranks()
            )));
        }
    }
    fill_sizes(&opened, &mut report);
    write_json_atomic(&out.join(MANIFEST_FILE), &manifest)?;
    let _ = std::fs::remove_file(&partial);
    Ok(report)
}

/// The table and file bytes of the rank checkpoint `ck`.
fn fill_sizes(ck: &Checkpoint, report: &mut RankReport) {
    report.table_bytes = ck.table_bytes();
    report.file_bytes = ck.files.iter().map(|f| f.bytes).sum();
}

fn storage(path: &Path, e: metrale_storage::StorageError) -> CheckpointError {
    CheckpointError::Storage {
        file: path.to_path_buf(),
        source: Box::new(e),
    }
}

/// The tensors of `h` in the order the rank's copy stores them: the table
/// tensors first (the data section is 4 KiB-aligned, so the first table's
/// rows start on a granule), then the rest, each group in source order.
fn rank_order<'a>(h: &'a Header, cuts: &BTreeMap<String, TableCut>) -> Vec<&'a TensorInfo> {
    let (mut order, rest): (Vec<&TensorInfo>, Vec<&TensorInfo>) =
        h.tensors.iter().partition(|t| cuts.contains_key(&t.name));
    order.extend(rest);
    order
}

/// The tensors and metadata of the rank's copy of the file `h`, in
/// [`rank_order`]: each table tensor `[rows, w]` (or the inline
/// block-scaled row of `w` values), unpadded.
fn rank_layout(
    h: &Header,
    cuts: &BTreeMap<String, TableCut>,
    tp: TensorParallel,
) -> Result<(Vec<TensorSpec>, BTreeMap<String, String>)> {
    let mut metadata = h.metadata.clone();
    let mut specs = Vec::with_capacity(h.tensors.len());
    for t in rank_order(h, cuts) {
        let Some(cut) = cuts.get(&t.name) else {
            specs.push(TensorSpec::new(t.name.clone(), t.dtype, &t.shape));
            continue;
        };
        let w = tp.columns(cut.head_dim, cut.dtype).map_err(|e| {
            CheckpointError::Invalid(format!("{}: {}: {e}", h.path.display(), t.name))
        })?;
        let row = cut.dtype.row_bytes(w.len()) as u64;
        let es = t.dtype.size() as u64;
        if t.shape.len() != 2 || !row.is_multiple_of(es) {
            return Err(CheckpointError::Shape {
                file: h.path.clone(),
                tensor: t.name.clone(),
                expected: vec![t.shape.first().copied().unwrap_or(0), row / es.max(1)],
                found: t.shape.clone(),
            });
        }
        specs.push(TensorSpec::new(
            t.name.clone(),
            t.dtype,
            &[t.shape[0], row / es],
        ));
        metadata.remove(&row_width_key(&t.name));
    }
    Ok((specs, metadata))
}

/// Whether `dst` is already the complete file of `specs` and `metadata`
/// (files appear only complete, so a header that matches is a whole file).
fn is_complete(dst: &Path, specs: &[TensorSpec], metadata: &BTreeMap<String, String>) -> bool {
    let Ok(h) = Header::read(dst) else {
        return false;
    };
    let data: u64 = specs.iter().filter_map(|s| s.bytes().ok()).sum();
    h.metadata == *metadata
        && h.file_len == h.data_start + data
        && h.tensors.len() == specs.len()
        && h.tensors
            .iter()
            .zip(specs)
            .all(|(t, s)| t.name == s.name && t.dtype == s.dtype && t.shape == s.shape)
}

/// Write the rank's copy of the file `h` to `dst`: table tensors' rows cut
/// to the rank's columns, every other tensor byte for byte; `advance(n)`
/// after each `n` source bytes.
fn write_file(
    h: &Header,
    cuts: &BTreeMap<String, TableCut>,
    tp: TensorParallel,
    dst: &Path,
    (specs, metadata): (&[TensorSpec], &BTreeMap<String, String>),
    advance: &mut dyn FnMut(u64),
) -> Result<()> {
    let file = std::fs::File::open(&h.path).map_err(|e| CheckpointError::io(&h.path, e))?;
    let mut w = Writer::create(dst, specs, metadata, ALIGN).map_err(|e| storage(dst, e))?;
    let mut buf = Vec::new();
    for t in rank_order(h, cuts) {
        let read = |buf: &mut Vec<u8>, at: u64, n: u64| -> Result<()> {
            buf.resize(n as usize, 0);
            file.read_exact_at(buf, at)
                .map_err(|e| CheckpointError::io(&h.path, e))
        };
        match cuts.get(&t.name) {
            None => {
                let mut at = t.offset;
                let end = t.offset + t.len;
                while at < end {
                    let n = (end - at).min(CHUNK);
                    read(&mut buf, at, n)?;
                    w.write(&buf).map_err(|e| storage(dst, e))?;
                    at += n;
                    advance(n);
                }
            }
            Some(cut) => {
                let rows = t.shape[0];
                let stride = t.len / rows.max(1);
                let row = cut.dtype.row_bytes(cut.head_dim) as u64;
                let per = (CHUNK / stride.max(1)).max(1);
                let mut packed = Vec::new();
                let mut r = 0u64;
                while r < rows {
                    let n = (rows - r).min(per);
                    read(&mut buf, t.offset + r * stride, n * stride)?;
                    // Padded rows: the values of each row, back to back.
                    let rows_bytes: &[u8] = if stride == row {
                        &buf
                    } else {
                        packed.clear();
                        for c in buf.chunks_exact(stride as usize) {
                            packed.extend_from_slice(&c[..row as usize]);
                        }
                        &packed
                    };
                    let cut_rows =
                        tp.shard_rows(rows_bytes, cut.head_dim, cut.dtype)
                            .map_err(|e| {
                                CheckpointError::Invalid(format!(
                                    "{}: {}: {e}",
                                    h.path.display(),
                                    t.name
                                ))
                            })?;
                    w.write(&cut_rows).map_err(|e| storage(dst, e))?;
                    r += n;
                    advance(n * stride);
                }
            }
        }
    }
    w.finish().map_err(|e| storage(dst, e))
}

/// Copy every regular file of the source directory that is not one of its
/// safetensors files (config, weight map, token map, tokenizer, remaps)
/// into `out`, each written beside itself and renamed.
fn copy_other_files(ck: &Checkpoint, out: &Path) -> Result<()> {
    let entries = std::fs::read_dir(&ck.dir).map_err(|e| CheckpointError::io(&ck.dir, e))?;
    for e in entries {
        let e = e.map_err(|e| CheckpointError::io(&ck.dir, e))?;
        let name = e.file_name();
        let name = name.to_string_lossy();
        let is_file = e
            .file_type()
            .map_err(|err| CheckpointError::io(e.path(), err))?
            .is_file();
        if !is_file
            || name.starts_with('.')
            || name == MANIFEST_FILE
            || ck.files.iter().any(|f| f.name == name)
        {
            continue;
        }
        let dst = out.join(name.as_ref());
        let tmp = out.join(format!(".{name}.partial"));
        std::fs::copy(e.path(), &tmp).map_err(|err| CheckpointError::io(&tmp, err))?;
        std::fs::rename(&tmp, &dst).map_err(|err| CheckpointError::io(&dst, err))?;
    }
    Ok(())
}

/// Write `value` as JSON to `path` (beside it, synced, renamed).
fn write_json_atomic<T: Serialize>(path: &Path, value: &T) -> Result<()> {
    let text = serde_json::to_string_pretty(value).expect("a manifest serialises");
    let tmp = path.with_extension("json.partial");
    let f = std::fs::File::create(&tmp).map_err(|e| CheckpointError::io(&tmp, e))?;
    f.write_all_at(text.as_bytes(), 0)
        .and_then(|_| f.sync_all())
        .map_err(|e| CheckpointError::io(&tmp, e))?;
    std::fs::rename(&tmp, path).map_err(|e| CheckpointError::io(path, e))
}
