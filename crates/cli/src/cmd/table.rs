//! `metrale-ple table pack`: rewrite safetensors files so their data
//! sections start on a 4 KiB boundary (what O_DIRECT row reads want).
//!
//! SRC may be one safetensors file (DST is then a file) or a checkpoint
//! directory (DST is then a new directory holding every file packed, the
//! config, weight map, token map and any row remaps copied, and is
//! validated before the command reports success). Tensor data is copied
//! byte for byte; only header padding changes (unless `--pad-rows`
//! pads the tables, below). The directory is written
//! beside DST under a temporary name and renamed into place once
//! validated, so DST appears complete or not at all.
//!
//! A DeepSeek-V4.1 checkpoint whose Engram tables are stored as released
//! (`embed.weight` F8_E4M3 plus `embed.scale` F8_E8M0, which the loader
//! refuses) is converted on the way: each table becomes the inline
//! `[rows, d + d/32]` U8 tensor the runtime reads in one read a row (row
//! `r` = values of row `r`, then its scales, byte for byte), the scale
//! tensors leave the files and the weight map
//! (`metrale_checkpoint::release`). A NaN scale or value is refused naming
//! the file, tensor and row.
//!
//! `--pad-rows` (checkpoint directories only) also pads every site's table
//! rows to a stride that keeps each row inside the fewest direct-I/O
//! granules (`--granule`, default the destination's alignment): 320-byte
//! BF16 rows become 512 bytes apart, so a row-cache miss reads one granule
//! where half of the unpadded rows straddle two, at the cost of the padding on
//! disk (`metrale_storage::pack::pad_rows`; the row width is declared in
//! each file's metadata and every table mode reads it).
//!
//! `--hot-rows TRACE` (checkpoint directories only) also relays each
//! site's table so the rows TRACE hits most come first, sharing pages and
//! direct-I/O granules, and writes the row remap
//! (`model.layers.{L}.ple.row_remap.bin`) the loader applies after hashing,
//! so ids and outputs stay the same. TRACE is text: one `SITE ROW_ID` pair
//! per line, the row ids a site's table is asked for (format:
//! `metrale_checkpoint::remap`). The source must not have remaps already,
//! and the trace may name only sites whose table is one table (not split
//! into sub-tables).
//!
//! `--hot-corpus FILE` does the same with the counts taken from a corpus
//! of token ids instead (JSON lines, one array of token ids each, as `run
//! --prompts` reads): each prompt is hashed from a fresh history by every
//! site's own hash, and each id it gives counts once, as a trace of serving
//! those prompts would list them.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use anyhow::Context;
use clap::{Args, Subcommand};
use metrale_checkpoint::load::OpenOptions;
use metrale_checkpoint::names::{CONFIG_FILE, INDEX_FILE, TOKEN_MAP_FILE, row_remap_file};
use metrale_checkpoint::release::{SplitTable, convert_file, convert_index};
use metrale_checkpoint::remap::{RowRemap, fold_counts, parse_trace};
use metrale_checkpoint::{Checkpoint, CheckpointError};
use metrale_model_layers::layers::ple::ids::PleIdHasher;
use metrale_ple_cli::parse::parse_prompts;
use metrale_storage::io::DioAlign;
use metrale_storage::layout::TableFiles;
use metrale_storage::pack::{pack, pad_rows};
use metrale_storage::relay::{fits_granule, hot_order, relay_rows};
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
        after_help = "Examples:\n  metrale-ple table pack ckpt/model-00002-of-00005.safetensors /fast/shard.safetensors\n  metrale-ple table pack ~/.cache/metrale-ple/tiny /tmp/tiny-packed\n  metrale-ple table pack --hot-rows trace.txt ~/.cache/metrale-ple/tiny /tmp/tiny-hot\n  metrale-ple table pack --hot-corpus prompts.jsonl ~/.cache/metrale-ple/tiny /tmp/tiny-hot\n  metrale-ple table pack --pad-rows ~/.cache/metrale-ple/tiny /tmp/tiny-padded"
    )]
    Pack(PackArgs),
    /// Load a checkpoint's tables onto Redis-protocol servers for `run
    /// --table remote` (pipelined, resumable, each server's load checked
    /// by a manifest).
    #[command(
        after_help = "Examples:\n  metrale-ple table push ~/.cache/metrale-ple/tiny --to redis://127.0.0.1:6379\n  metrale-ple table push /data/flagship --to redis://10.0.0.5:7000,redis://10.0.0.5:7001,redis://10.0.0.6:7000"
    )]
    Push(super::remote::PushArgs),
    /// Write tensor-parallel ranks' shares of a checkpoint (each rank's
    /// columns of every table row) for `run --tp-ranks`.
    #[command(
        after_help = "Examples:\n  metrale-ple table shard ~/.cache/metrale-ple/tiny --of 2 --out /tmp/tiny-tp2\n  metrale-ple table shard /data/flagship --rank 1 --of 4 --out /local/flagship-r1of4"
    )]
    Shard(super::shard::ShardArgs),
}

/// Arguments of `table pack`.
#[derive(Args, Debug)]
pub struct PackArgs {
    /// A safetensors file or a checkpoint directory.
    pub src: PathBuf,
    /// The file or directory to write (must not exist for a directory).
    pub dst: PathBuf,
    /// Relay each site's table rows hottest first, by the `SITE ROW_ID`
    /// lines of this trace, and store the row remap (directories only).
    #[arg(long, value_name = "TRACE", conflicts_with = "hot_corpus")]
    pub hot_rows: Option<PathBuf>,
    /// Relay each site's table rows hottest first, by the row ids every
    /// site hashes the prompts of this corpus to (JSON lines, one array of
    /// token ids each), and store the row remap (directories only).
    #[arg(long, value_name = "FILE")]
    pub hot_corpus: Option<PathBuf>,
    /// Pad each site's table rows so no row straddles more direct-I/O
    /// granules than it must (costs disk: 320-byte rows take 512;
    /// directories only).
    #[arg(long)]
    pub pad_rows: bool,
    /// With --hot-rows, --hot-corpus or --pad-rows: the direct-I/O granule, a power of
    /// two: hot rows go where a read of this many aligned bytes holds
    /// them, and padded rows fit it [default: the destination's
    /// direct-I/O alignment].
    #[arg(long, value_name = "BYTES")]
    pub granule: Option<u64>,
}

/// Run `table`.
pub fn run(a: TableArgs) -> Result<(), CmdError> {
    match a.cmd {
        TableCmd::Pack(p) => pack_cmd(p),
        TableCmd::Push(p) => super::remote::push(p),
        TableCmd::Shard(s) => super::shard::run(s),
    }
}

/// The tables `--pad-rows` pads: per source file, its table tensors, and
/// the granule their rows are padded for.
struct Padding {
    tables: HashMap<PathBuf, Vec<String>>,
    granule: u64,
}

/// Pack `files` (source, destination); a file holding a table of `release`
/// (its values or its scales) is converted instead, and one holding tables
/// to pad is padded.
fn pack_files(
    files: &[(PathBuf, PathBuf)],
    release: &[SplitTable],
    pad: Option<&Padding>,
) -> Result<u64, CmdError> {
    let mut total = 0;
    for (src, _) in files {
        let h = Header::read(src).map_err(input)?;
        total += h.file_len - h.data_start;
    }
    let pb = byte_bar(total, "pack");
    let mut base = 0;
    for (src, dst) in files {
        if release
            .iter()
            .any(|t| &t.weight_file == src || &t.scale_file == src)
        {
            tracing::info!(src = %src.display(), dst = %dst.display(), "converting released tables");
            match convert_file(src, dst, release, &mut |done, _| {
                pb.set_position(base + done)
            }) {
                Ok(n) => base += n,
                Err(e) => {
                    pb.finish_and_clear();
                    return Err(refusal(e));
                }
            }
            continue;
        }
        if let Some((p, tables)) = pad.and_then(|p| p.tables.get(src).map(|t| (p, t))) {
            tracing::info!(src = %src.display(), dst = %dst.display(), "padding rows");
            let before = Header::read(src).map_err(input)?;
            let done = before.file_len - before.data_start;
            match pad_rows(src, dst, tables, p.granule, &mut |d, _| {
                pb.set_position(base + d)
            }) {
                Ok(rep) => {
                    base += done;
                    let after = Header::read(dst).map_err(failure)?;
                    for t in rep {
                        pb.suspend(|| {
                            println!(
                                "padded {}: rows of {} bytes now {} bytes apart for {}-byte granules ({} -> {} on disk for the file)",
                                t.tensor,
                                t.row_bytes,
                                t.stride,
                                p.granule,
                                bytes(before.file_len),
                                bytes(after.file_len)
                            )
                        });
                    }
                }
                Err(e) => {
                    pb.finish_and_clear();
                    return Err(failure(e));
                }
            }
            continue;
        }
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
    // The source of the hot rows' counts: a trace of row ids or a corpus.
    let hot = a.hot_rows.as_ref().or(a.hot_corpus.as_ref());
    let hot_flag = if a.hot_corpus.is_some() {
        "--hot-corpus"
    } else {
        "--hot-rows"
    };
    if a.src.is_file() && hot.is_some() {
        return Err(input(anyhow::anyhow!(
            "{hot_flag} relays a checkpoint's tables: SRC must be a checkpoint directory, not {}",
            a.src.display()
        )));
    }
    if a.src.is_file() && a.pad_rows {
        return Err(input(anyhow::anyhow!(
            "--pad-rows pads a checkpoint's tables: SRC must be a checkpoint directory, not {}",
            a.src.display()
        )));
    }
    match a.granule {
        Some(_) if hot.is_none() && !a.pad_rows => {
            return Err(input(anyhow::anyhow!(
                "--granule places hot rows (--hot-rows, --hot-corpus) or pads rows (--pad-rows); \
                 give one of them"
            )));
        }
        Some(g) if g == 0 || !g.is_power_of_two() => {
            return Err(input(anyhow::anyhow!(
                "--granule must be a power of two, not {g}"
            )));
        }
        _ => {}
    }
    if a.src.is_file() {
        let total = pack_files(&[(a.src.clone(), a.dst.clone())], &[], None)?;
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
    // Refuse a bad source or trace before writing anything. Tables stored
    // as released are accepted here to be converted.
    let ck = Checkpoint::open_with(
        &a.src,
        OpenOptions {
            release_tables: true,
            ..OpenOptions::default()
        },
    )
    .map_err(input)?;
    let release = ck.release_tables();
    if let Some(t) = release.first()
        && (hot.is_some() || a.pad_rows)
    {
        let flag = if a.pad_rows {
            "--pad-rows"
        } else if a.hot_corpus.is_some() {
            "--hot-corpus FILE"
        } else {
            "--hot-rows TRACE"
        };
        return Err(input(anyhow::anyhow!(
            "{}: {} is stored as released; convert it first (`metrale-ple table pack SRC MID`), \
             then pack the converted copy (`metrale-ple table pack {flag} MID DST`)",
            t.weight_file.display(),
            t.weight
        )));
    }
    let remaps: Vec<String> = ck
        .sites
        .iter()
        .map(|s| row_remap_file(s.layer))
        .filter(|n| a.src.join(n).exists())
        .collect();
    let trace = match hot {
        None => None,
        Some(t) => {
            if let Some(n) = remaps.first() {
                return Err(input(anyhow::anyhow!(
                    "{} already has a row remap ({n}); pack hot rows from the original checkpoint",
                    a.src.display()
                )));
            }
            let counts = if a.hot_corpus.is_some() {
                corpus_counts(&ck, t)?
            } else {
                let text = std::fs::read_to_string(t)
                    .with_context(|| format!("reading the trace {}", t.display()))
                    .map_err(input)?;
                parse_trace(&text, ck.sites.len(), t).map_err(input)?
            };
            // A remap covers one whole table; sub-tables are served apart.
            if let Some((i, _)) = counts
                .iter()
                .enumerate()
                .find(|(i, c)| !c.is_empty() && !ck.sites[*i].table.sub_tables.is_empty())
            {
                return Err(input(anyhow::anyhow!(
                    "{}: site {i}'s table is split into sub-tables, which hot-row packing does not relay",
                    t.display()
                )));
            }
            Some(counts)
        }
    };
    if a.dst.exists() {
        return Err(input(anyhow::anyhow!(
            "{} already exists; pack writes a new directory",
            a.dst.display()
        )));
    }
    // Written beside DST and renamed into place once validated.
    let stage = staging_dir(&a.dst)?;
    if stage.exists() {
        std::fs::remove_dir_all(&stage)
            .with_context(|| format!("removing the stale {}", stage.display()))
            .map_err(failure)?;
    }
    std::fs::create_dir_all(&stage)
        .with_context(|| format!("creating {}", stage.display()))
        .map_err(failure)?;
    let r = (|| {
        let index_path = a.src.join(INDEX_FILE);
        let index = if release.is_empty() {
            None
        } else {
            let text = std::fs::read_to_string(&index_path)
                .with_context(|| format!("reading {}", index_path.display()))
                .map_err(failure)?;
            Some(convert_index(&text, &index_path, &release).map_err(refusal)?)
        };
        // A file left holding only scale tensors is not written.
        let emptied = |name: &str| -> Result<bool, CmdError> {
            if release.is_empty() {
                return Ok(false);
            }
            let h = Header::read(a.src.join(name)).map_err(input)?;
            Ok(h.tensors
                .iter()
                .all(|t| release.iter().any(|s| s.scale == t.name)))
        };
        let mut files: Vec<(PathBuf, PathBuf)> = Vec::with_capacity(ck.files.len());
        for f in &ck.files {
            if !emptied(&f.name)? {
                files.push((a.src.join(&f.name), stage.join(&f.name)));
            }
        }
        let padding = if a.pad_rows {
            let mut tables: HashMap<PathBuf, Vec<String>> = HashMap::new();
            for site in &ck.sites {
                for shard in &site.table.shards {
                    let tensor = &shard.weight;
                    let list = tables.entry(shard.path.clone()).or_default();
                    if !list.contains(tensor) {
                        list.push(tensor.clone());
                    }
                }
            }
            let granule = match a.granule {
                Some(g) => g,
                None => probe_granule(&stage)?,
            };
            Some(Padding { tables, granule })
        } else {
            None
        };
        let total = pack_files(&files, &release, padding.as_ref())?;
        let token_map = a
            .src
            .join(TOKEN_MAP_FILE)
            .exists()
            .then_some(TOKEN_MAP_FILE);
        for name in [CONFIG_FILE]
            .into_iter()
            .chain(token_map)
            .chain(remaps.iter().map(String::as_str))
        {
            copy(&a.src.join(name), &stage.join(name))?;
        }
        match &index {
            Some(text) => std::fs::write(stage.join(INDEX_FILE), text)
                .with_context(|| format!("writing {}", stage.join(INDEX_FILE).display()))
                .map_err(failure)?,
            None => copy(&index_path, &stage.join(INDEX_FILE))?,
        }
        let packed = Checkpoint::open(&stage).map_err(failure)?;
        if let Some(f) = packed.files.iter().find(|f| f.data_start % 4096 != 0) {
            return Err(failure(anyhow::anyhow!(
                "{}: data still at offset {}",
                f.name,
                f.data_start
            )));
        }
        if let Some(counts) = &trace {
            for (i, c) in counts.iter().enumerate() {
                if !c.is_empty() {
                    relay_site(&ck, &packed, i, c, a.granule, &a.dst)?;
                }
            }
        }
        std::fs::rename(&stage, &a.dst)
            .with_context(|| format!("renaming {} to {}", stage.display(), a.dst.display()))
            .map_err(failure)?;
        Ok((total, files.len()))
    })();
    match r {
        Ok((total, n)) => {
            for t in &release {
                println!(
                    "converted {} ({} rows as released, F8_E4M3 values + F8_E8M0 scales) into \
                     inline rows of {} bytes",
                    t.weight,
                    t.rows,
                    t.row_bytes()
                );
            }
            println!(
                "packed {n} files ({} of data) from {} into {}; validation OK",
                bytes(total),
                a.src.display(),
                a.dst.display()
            );
            Ok(())
        }
        Err(e) => {
            let _ = std::fs::remove_dir_all(&stage);
            Err(e)
        }
    }
}

/// Per site, how many times each row id is hashed from the prompts of the
/// token corpus at `path` (JSON lines, one array of token ids each), every
/// prompt from a fresh history, by the site's own hash.
fn corpus_counts(ck: &Checkpoint, path: &Path) -> Result<Vec<HashMap<u64, u64>>, CmdError> {
    let text = std::fs::read_to_string(path)
        .with_context(|| format!("reading the corpus {}", path.display()))
        .map_err(input)?;
    let prompts = parse_prompts(path, &text, ck.spec.vocab_size).map_err(input)?;
    let mut out = Vec::with_capacity(ck.sites.len());
    for site in 0..ck.sites.len() {
        let spec = ck.spec.site(site).map_err(failure)?;
        let hasher = PleIdHasher::with_family(&spec.family, &spec.dims).map_err(failure)?;
        let heads = spec.dims.ngram_heads();
        let mut counts: HashMap<u64, u64> = HashMap::new();
        let mut ids = Vec::new();
        for (k, p) in prompts.iter().enumerate() {
            ids.resize(p.len() * heads, 0);
            hasher
                .ids_with_history_into(&[], p, &mut ids)
                .with_context(|| format!("{}: prompt {}, site {site}", path.display(), k + 1))
                .map_err(input)?;
            for &id in &ids {
                *counts.entry(id).or_insert(0) += 1;
            }
        }
        out.push(counts);
    }
    Ok(out)
}

/// The direct-I/O alignment of a file written in `dir` (a probe file,
/// removed again).
fn probe_granule(dir: &Path) -> Result<u64, CmdError> {
    let p = dir.join(".granule-probe");
    let f = std::fs::File::create(&p)
        .with_context(|| format!("creating {}", p.display()))
        .map_err(failure)?;
    let g = DioAlign::query(&f).offset as u64;
    drop(f);
    let _ = std::fs::remove_file(&p);
    Ok(g)
}

/// The sibling directory `.{name}.packing-{pid}` a pack of `dst` is
/// written into.
fn staging_dir(dst: &Path) -> Result<PathBuf, CmdError> {
    let name = dst.file_name().ok_or_else(|| {
        input(anyhow::anyhow!(
            "{}: the destination needs a directory name",
            dst.display()
        ))
    })?;
    Ok(dst.with_file_name(format!(
        ".{}.packing-{}",
        name.to_string_lossy(),
        std::process::id()
    )))
}

/// A conversion error: the input's fault unless the operating system's.
fn refusal(e: CheckpointError) -> CmdError {
    match e {
        CheckpointError::Io { .. } => failure(e),
        e => input(e),
    }
}

/// Relay site `site`'s rows from `src` into the packed copy `dst` hottest
/// first by `counts`, write the remap, and check a sample of rows reads
/// back the same through it.
fn relay_site(
    src: &Checkpoint,
    dst: &Checkpoint,
    site: usize,
    counts: &std::collections::HashMap<u64, u64>,
    granule: Option<u64>,
    shown: &Path,
) -> Result<(), CmdError> {
    let s = &src.sites[site];
    let rows = s.table.stored_rows;
    let open = |ck: &Checkpoint| {
        TableFiles::open(&ck.sites[site].table.shards, Some(rows))
            .with_context(|| format!("opening the table of site {site}"))
            .map_err(failure)
    };
    let (from, to) = (open(src)?, open(dst)?);
    let granule = match granule {
        Some(g) if g > 0 => g,
        Some(_) => return Err(input(anyhow::anyhow!("--granule must be positive"))),
        None => {
            let p = &to.shards[0].path;
            let f = std::fs::File::open(p)
                .with_context(|| format!("opening {}", p.display()))
                .map_err(failure)?;
            DioAlign::query(&f).offset as u64
        }
    };
    let counts = fold_counts(rows, counts);
    let order = hot_order(rows, &counts, fits_granule(&to, granule));
    let path = dst.dir.join(row_remap_file(s.layer));
    let remap = RowRemap::from_order(&order, &path).map_err(failure)?;
    let rb = from.info.row_bytes() as u64;
    let pb = byte_bar(rows * rb, "relay");
    let r = relay_rows(&from, &to, &order, &mut |done, _| {
        pb.set_position(done * rb)
    });
    pb.finish_and_clear();
    r.map_err(failure)?;
    remap.write(&path).map_err(failure)?;
    // Spot check: the hottest rows and an even spread of the rest.
    let hot = counts.len();
    let step = (rows / 512).max(1);
    let sample = order[..hot.min(512)]
        .iter()
        .map(|&o| o as u64)
        .chain((0..rows).step_by(step as usize));
    for id in sample {
        let want = read_row(&from, id)?;
        let got = read_row(&to, remap.physical(id))?;
        if want != got {
            return Err(failure(anyhow::anyhow!(
                "site {site}: row {id} reads back different through the remap (physical row {})",
                remap.physical(id)
            )));
        }
    }
    let hits: u64 = counts.values().sum();
    let fits = fits_granule(&to, granule);
    let fitting = order[..]
        .iter()
        .enumerate()
        .filter(|&(p, &o)| counts.contains_key(&(o as u64)) && fits(p as u64))
        .count();
    let span = counts
        .keys()
        .map(|&id| remap.physical(id) + 1)
        .max()
        .unwrap_or(0);
    println!(
        "site {site} (layer {}): {hits} trace hits on {} distinct rows, now within the first {} of the table, {fitting} of them where one read of the fewest {granule}-byte granules holds them; remap {}",
        s.layer,
        counts.len(),
        bytes(span * rb),
        shown.join(row_remap_file(s.layer)).display()
    );
    Ok(())
}

/// Row `id`'s bytes (and FP8 scale) as stored in `t`'s files.
fn read_row(t: &TableFiles, id: u64) -> Result<Vec<u8>, CmdError> {
    use std::os::unix::fs::FileExt;
    let l = t.locate(id).map_err(failure)?;
    let path = &t.shards[l.shard].path;
    let f = std::fs::File::open(path)
        .with_context(|| format!("opening {}", path.display()))
        .map_err(failure)?;
    let mut b = vec![0u8; t.info.row_bytes()];
    f.read_exact_at(&mut b, l.offset)
        .with_context(|| format!("{}: reading row {id}", path.display()))
        .map_err(failure)?;
    if let Some(so) = l.scale_offset {
        let mut sc = [0u8; 4];
        f.read_exact_at(&mut sc, so)
            .with_context(|| format!("{}: reading the scale of row {id}", path.display()))
            .map_err(failure)?;
        b.extend_from_slice(&sc);
    }
    Ok(b)
}

fn copy(src: &Path, dst: &Path) -> Result<(), CmdError> {
    std::fs::copy(src, dst)
        .with_context(|| format!("copying {} to {}", src.display(), dst.display()))
        .map_err(failure)?;
    Ok(())
}
