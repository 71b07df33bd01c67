//! From a validated checkpoint to running parts: tables and layers.
//!
//! [`Checkpoint::open_table`] serves a site's table resident, mapped, shared
//! or behind the row cache, wrapped in a [`FoldedTable`] when the table is
//! cut; LongCat's sub-tables are each served (and folded) alone and joined
//! by a [`ConcatTable`];
//! [`Checkpoint::build_layer`] builds the site's [`PleLayer`] over it,
//! [`Checkpoint::build_layer_sharded`] a tensor-parallel rank's.
//!
//! Invariant: the layer always sees the full padded id range; whether rows
//! are folded is decided here from the validated [`SiteTable`] alone.
//! Tables free their device memory when the last `Arc` drops; layers must
//! be freed with `PleLayer::free` (device pointers are not freed by Drop).
//!
//! [`SiteTable`]: crate::load::SiteTable

use std::sync::Arc;

use metrale_gpu_runtime::gpu::GpuBackend;
use metrale_model_layers::layers::ple::{PleLayer, Shard};
use metrale_storage::StorageError;
use metrale_storage::cached::{CacheConfig, CachedTable};
use metrale_storage::layout::TableFiles;
use metrale_storage::mapped::MappedTable;
use metrale_storage::resident::ResidentTable;
use metrale_storage::shared::SharedTable;
use metrale_storage::table::RowTable;

use crate::concat::ConcatTable;
use crate::error::{CheckpointError, Result};
use crate::fold::FoldedTable;
use crate::load::Checkpoint;

/// How a site's table rows are served: the one mode enum, defined by the
/// storage crate.
pub use metrale_storage::TableMode;

impl Checkpoint {
    /// Serve site `site`'s table in `mode`; a [`TableMode::Cached`] table
    /// gets a [`CacheConfig::default`] cache (size it with
    /// [`Self::open_cached_table`]).
    pub fn open_table(
        &self,
        site: usize,
        mode: TableMode,
        gpu: Arc<dyn GpuBackend>,
    ) -> Result<Arc<dyn RowTable>> {
        if !self.sites[site].table.sub_tables.is_empty() {
            return self.open_sub_tables(site, mode, None, gpu);
        }
        let layer = self.sites[site].layer;
        let err = |what| {
            move |source: StorageError| CheckpointError::Table {
                layer,
                what,
                source: Box::new(source),
            }
        };
        let inner: Arc<dyn RowTable> = match mode {
            TableMode::Resident => Arc::new(
                ResidentTable::load(&self.table_files(site)?, gpu)
                    .map_err(err("loading the resident table"))?,
            ),
            TableMode::Mapped => Arc::new(
                MappedTable::open(&self.table_files(site)?, gpu)
                    .map_err(err("mapping the table"))?,
            ),
            TableMode::Shared => Arc::new(
                SharedTable::open(&self.table_files(site)?, gpu)
                    .map_err(err("attaching the shared table"))?,
            ),
            TableMode::Cached => {
                return self.open_cached_table(site, CacheConfig::default(), gpu);
            }
        };
        self.fold(site, inner)
    }

    /// Serve site `site`'s table behind a row cache configured by `cfg`
    /// (slots, I/O depth, O_DIRECT, an injected reader).
    pub fn open_cached_table(
        &self,
        site: usize,
        cfg: CacheConfig,
        gpu: Arc<dyn GpuBackend>,
    ) -> Result<Arc<dyn RowTable>> {
        if !self.sites[site].table.sub_tables.is_empty() {
            return self.open_sub_tables(site, TableMode::Cached, Some(cfg), gpu);
        }
        let files = self.table_files(site)?;
        let table = CachedTable::open(files, gpu, cfg).map_err(|e| CheckpointError::Table {
            layer: self.sites[site].layer,
            what: "opening the row cache",
            source: Box::new(e),
        })?;
        self.fold(site, Arc::new(table))
    }

    /// LongCat's sub-tables, each served in `mode` (a cached one gets an
    /// equal share of `cfg`'s slots) and folded on its own when cut, as one
    /// [`ConcatTable`].
    fn open_sub_tables(
        &self,
        site: usize,
        mode: TableMode,
        cfg: Option<CacheConfig>,
        gpu: Arc<dyn GpuBackend>,
    ) -> Result<Arc<dyn RowTable>> {
        let s = &self.sites[site];
        let err = |what| {
            move |source: StorageError| CheckpointError::Table {
                layer: s.layer,
                what,
                source: Box::new(source),
            }
        };
        let n = s.table.sub_tables.len();
        let mut parts: Vec<Arc<dyn RowTable>> = Vec::with_capacity(n);
        for (i, sub) in s.table.sub_tables.iter().enumerate() {
            let files = TableFiles::open(&s.table.shards[i..=i], Some(sub.stored_rows))
                .map_err(err("opening a sub-table"))?;
            let inner: Arc<dyn RowTable> = match mode {
                TableMode::Resident => Arc::new(
                    ResidentTable::load(&files, gpu.clone())
                        .map_err(err("loading a resident sub-table"))?,
                ),
                TableMode::Mapped => Arc::new(
                    MappedTable::open(&files, gpu.clone()).map_err(err("mapping a sub-table"))?,
                ),
                TableMode::Shared => Arc::new(
                    SharedTable::open(&files, gpu.clone())
                        .map_err(err("attaching a shared sub-table"))?,
                ),
                TableMode::Cached => {
                    let mut c = cfg.clone().unwrap_or_default();
                    c.slots = (c.slots / n).max(2);
                    c.max_resolve /= n;
                    Arc::new(
                        CachedTable::open(files, gpu.clone(), c)
                            .map_err(err("opening a sub-table's row cache"))?,
                    )
                }
            };
            parts.push(if sub.stored_rows < sub.logical_rows {
                Arc::new(
                    FoldedTable::new(inner, sub.logical_rows)
                        .map_err(err("folding a sub-table"))?,
                )
            } else {
                inner
            });
        }
        Ok(Arc::new(
            ConcatTable::new(parts, gpu).map_err(err("concatenating the sub-tables"))?,
        ))
    }

    /// Site `site`'s validated shards, opened. A table stored as released
    /// (opened for its conversion only) is refused as the loader refuses it.
    fn table_files(&self, site: usize) -> Result<TableFiles> {
        let s = &self.sites[site];
        if let Some(r) = &s.table.release {
            return Err(CheckpointError::ReleasedTable {
                file: r.weight_file.clone(),
                tensor: r.weight.clone(),
                scale: r.scale.clone(),
            });
        }
        TableFiles::open(&s.table.shards, Some(s.table.stored_rows)).map_err(|e| {
            CheckpointError::Table {
                layer: s.layer,
                what: "opening the table shards",
                source: Box::new(e),
            }
        })
    }

    /// Present a cut table at the full padded size.
    fn fold(&self, site: usize, inner: Arc<dyn RowTable>) -> Result<Arc<dyn RowTable>> {
        // The remap sits beneath any folding: ids are folded, then remapped.
        let inner = crate::remap::remap_site(self, site, inner)?;
        let s = &self.sites[site];
        Ok(match s.table.fold_rows {
            Some(_) => Arc::new(FoldedTable::new(inner, s.padded_rows).map_err(|e| {
                CheckpointError::Table {
                    layer: s.layer,
                    what: "folding the table",
                    source: Box::new(e),
                }
            })?),
            None => inner,
        })
    }

    /// Build site `site`'s layer over `table`, for forwards of up to
    /// `max_tokens` rows (longer ones are split by the layer).
    pub fn build_layer(
        &self,
        site: usize,
        table: Arc<dyn RowTable>,
        max_tokens: usize,
        gpu: &dyn GpuBackend,
    ) -> Result<PleLayer> {
        let s = &self.sites[site];
        PleLayer::new(&s.spec, s.weights.clone(), table, max_tokens, gpu).map_err(|source| {
            CheckpointError::Layer {
                layer: s.layer,
                source: Box::new(source),
            }
        })
    }

    /// [`Self::build_layer`] for tensor-parallel rank `shard.tp`
    /// (docs/SPEC.md §5, "Tensor-parallel shards"): `table` serves the
    /// rank's column slice of the site's rows, the layer keeps the rank's
    /// columns of the checkpoint's projections and completes each
    /// projection through `shard.reduce`. Refused where the split does not
    /// divide the rows.
    pub fn build_layer_sharded(
        &self,
        site: usize,
        table: Arc<dyn RowTable>,
        max_tokens: usize,
        gpu: &dyn GpuBackend,
        shard: Shard,
    ) -> Result<PleLayer> {
        let s = &self.sites[site];
        PleLayer::new_sharded(&s.spec, s.weights.clone(), table, max_tokens, gpu, shard).map_err(
            |source| CheckpointError::Layer {
                layer: s.layer,
                source: Box::new(source),
            },
        )
    }
}
