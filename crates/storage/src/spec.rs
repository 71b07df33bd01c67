//! A table as a description, and the one place tables are opened.
//!
//! A [`TableSpec`] says everything needed to serve a table: its parts
//! (each a set of shards with its stored and logical row counts and an
//! optional row permutation), how rows are served ([`TableMode`]) and the
//! row cache's settings. [`open`] turns it into one [`RowTable`]: each
//! part is opened in the mode ([`open_files`], the only match over
//! [`TableMode`]), served through an [`IdMap`] when its ids are folded or
//! remapped, and several parts are joined by a [`ConcatTable`].
//!
//! Invariants: a one-part spec is served without a concatenation and a
//! part whose ids reach its stored rows unchanged without a decorator, so
//! the description adds no layer a table does not need; a cached table of
//! `n` parts gives each part an `n`-th of the slots (at least 2) and of
//! the per-resolve limit, so the parts together take what one table would.

use std::sync::Arc;

use metrale_gpu_runtime::gpu::GpuBackend;

use crate::cached::{CacheConfig, CachedTable};
use crate::concat::ConcatTable;
use crate::error::{Result, StorageError};
use crate::idmap::IdMap;
use crate::layout::{ShardSource, TableFiles};
use crate::mapped::MappedTable;
use crate::mode::TableMode;
use crate::resident::ResidentTable;
use crate::shared::SharedTable;
use crate::table::RowTable;

/// One part of a table: stored shards and how ids reach their rows.
#[derive(Clone, Debug)]
pub struct TablePart {
    /// The shards, in row order.
    pub shards: Vec<ShardSource>,
    /// Rows the shards hold (checked when they are opened).
    pub stored_rows: u64,
    /// Rows the part's ids address: more than `stored_rows` when the part
    /// is cut (ids fold onto the stored rows as `id % stored_rows`).
    pub logical_rows: u64,
    /// Where each stored row was relaid (entry `i` the physical row of row
    /// `i`, a permutation of `0..stored_rows`), applied after folding.
    pub remap: Option<Arc<[u32]>>,
}

impl TablePart {
    /// Shards holding `rows` rows, addressed as stored.
    pub fn new(shards: Vec<ShardSource>, rows: u64) -> Self {
        TablePart {
            shards,
            stored_rows: rows,
            logical_rows: rows,
            remap: None,
        }
    }
}

/// Everything needed to serve a table.
#[derive(Clone)]
pub struct TableSpec {
    /// The parts, in id order: part `i`'s ids follow part `i - 1`'s.
    pub parts: Vec<TablePart>,
    /// How rows are served.
    pub mode: TableMode,
    /// The row cache's settings ([`TableMode::Cached`] only), for the whole
    /// table.
    pub cache: CacheConfig,
}

/// Serve the table `spec` describes (see the module docs).
pub fn open(spec: &TableSpec, gpu: Arc<dyn GpuBackend>) -> Result<Arc<dyn RowTable>> {
    let n = spec.parts.len();
    if n == 0 {
        return Err(StorageError::invalid("a table needs a part"));
    }
    let mut cache = spec.cache.clone();
    if n > 1 {
        cache.slots = (cache.slots / n).max(2);
        cache.max_resolve /= n;
    }
    let mut parts: Vec<Arc<dyn RowTable>> = Vec::with_capacity(n);
    for p in &spec.parts {
        // The map is checked before any row is loaded.
        let map = IdMap::new(p.logical_rows, p.stored_rows, p.remap.clone())?;
        let files = TableFiles::open(&p.shards, Some(p.stored_rows))?;
        let table = open_files(files, gpu.clone(), spec.mode, cache.clone())?;
        parts.push(if map.is_identity() {
            table
        } else {
            Arc::new(map.apply(table)?)
        });
    }
    if n == 1 {
        return Ok(parts.pop().expect("one part"));
    }
    Ok(Arc::new(ConcatTable::new(parts, gpu)?))
}

/// Serve the opened shards `files` as `mode` says; `cache` configures the
/// row cache and is used only by [`TableMode::Cached`].
pub fn open_files(
    files: TableFiles,
    gpu: Arc<dyn GpuBackend>,
    mode: TableMode,
    cache: CacheConfig,
) -> Result<Arc<dyn RowTable>> {
    Ok(match mode {
        TableMode::Resident => Arc::new(ResidentTable::load(&files, gpu)?),
        TableMode::Mapped => Arc::new(MappedTable::open(&files, gpu)?),
        TableMode::Cached => Arc::new(CachedTable::open(files, gpu, cache)?),
        TableMode::Shared => Arc::new(SharedTable::open(&files, gpu)?),
    })
}
