//! Table shard files for tests: BF16 rows written as equal safetensors
//! shards in the checkpoint's naming, and opened as [`TableFiles`].
//!
//! Invariant: every shard holds the same number of rows (the last rows are
//! zero-padded up to a whole number of shards), each tensor's data starts on
//! a 4 KiB boundary as O_DIRECT reads need, and the tensor names are those
//! of `metrale_checkpoint::names`, so the files open as any table does.

use std::path::Path;

use anyhow::{Result, ensure};
use metrale_checkpoint::names::{SiteNames, table_shard};
use metrale_storage::layout::TableFiles;
use metrale_storage::safetensors::{Dtype, TensorSpec, write_file};

/// Alignment of every tensor's data.
const ALIGN: u64 = 4096;

/// Write `bits` (BF16 bit patterns, `head_dim` per row) as `shards` equal
/// shards `{stem}-{i}.safetensors` under `dir`, the tensors named for the
/// site at model layer `layer`, and open them. Rows beyond `bits` up to a
/// whole number of shards are zero and part of the table.
pub fn write_bf16_shards(
    dir: &Path,
    stem: &str,
    layer: usize,
    bits: &[u16],
    head_dim: usize,
    shards: usize,
) -> Result<TableFiles> {
    ensure!(
        head_dim > 0 && shards > 0 && !bits.is_empty() && bits.len().is_multiple_of(head_dim),
        "shards: {} values do not make whole rows of {head_dim} for {shards} shards",
        bits.len()
    );
    let per = (bits.len() / head_dim).div_ceil(shards);
    let names = SiteNames::new(layer);
    let mut list = Vec::with_capacity(shards);
    for i in 0..shards {
        let path = dir.join(format!("{stem}-{i}.safetensors"));
        let name = names.shard_weight(i);
        let rows = bits.get(i * per * head_dim..).unwrap_or(&[]);
        let mut bytes: Vec<u8> = rows
            .iter()
            .take(per * head_dim)
            .flat_map(|b| b.to_le_bytes())
            .collect();
        bytes.resize(per * head_dim * 2, 0);
        write_file(
            &path,
            &[(
                TensorSpec::new(&name, Dtype::BF16, &[per as u64, head_dim as u64]),
                &bytes[..],
            )],
            ALIGN,
        )?;
        list.push(table_shard(path, &name));
    }
    Ok(TableFiles::open(&list, Some((per * shards) as u64))?)
}
