//! From a validated checkpoint to running parts: tables and layers.
//!
//! [`Checkpoint::table_spec`] describes a site's table for the storage
//! layer (its shards, cut and relaid as the checkpoint says; LongCat's
//! sub-tables as parts of their own), and [`Checkpoint::open_table`]
//! serves it through [`metrale_storage::open`];
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
use metrale_storage::cached::CacheConfig;
use metrale_storage::table::RowTable;
use metrale_storage::{TablePart, TableSpec};

use crate::error::{CheckpointError, Result};
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
        self.serve_table(site, mode, CacheConfig::default(), gpu)
    }

    /// Serve site `site`'s table behind a row cache configured by `cfg`
    /// (slots, I/O depth, O_DIRECT, an injected reader).
    pub fn open_cached_table(
        &self,
        site: usize,
        cfg: CacheConfig,
        gpu: Arc<dyn GpuBackend>,
    ) -> Result<Arc<dyn RowTable>> {
        self.serve_table(site, TableMode::Cached, cfg, gpu)
    }

    /// Serve site `site`'s table in `mode`; `cache` configures the row
    /// cache and is used only by [`TableMode::Cached`].
    pub fn serve_table(
        &self,
        site: usize,
        mode: TableMode,
        cache: CacheConfig,
        gpu: Arc<dyn GpuBackend>,
    ) -> Result<Arc<dyn RowTable>> {
        self.open_spec(site, &self.table_spec(site, mode, cache)?, gpu)
    }

    /// Site `site`'s table as the storage layer opens it, served in `mode`
    /// with `cache` (for [`TableMode::Cached`]): one part of the table's
    /// shards, cut to the padded id range when folded and relaid when the
    /// checkpoint has a row remap, or LongCat's sub-tables each a part,
    /// folded on its own when cut. A table stored as released (opened for
    /// its conversion only) is refused as the loader refuses it.
    pub fn table_spec(
        &self,
        site: usize,
        mode: TableMode,
        cache: CacheConfig,
    ) -> Result<TableSpec> {
        let s = &self.sites[site];
        if let Some(r) = &s.table.release {
            return Err(CheckpointError::ReleasedTable {
                file: r.weight_file.clone(),
                tensor: r.weight.clone(),
                scale: r.scale.clone(),
            });
        }
        let parts = if s.table.sub_tables.is_empty() {
            vec![TablePart {
                shards: s.table.shards.clone(),
                stored_rows: s.table.stored_rows,
                logical_rows: match s.table.fold_rows {
                    Some(_) => s.padded_rows,
                    None => s.table.stored_rows,
                },
                remap: crate::remap::site_remap(self, site)?,
            }]
        } else {
            s.table
                .sub_tables
                .iter()
                .zip(&s.table.shards)
                .map(|(sub, shard)| TablePart {
                    shards: vec![shard.clone()],
                    stored_rows: sub.stored_rows,
                    logical_rows: sub.logical_rows,
                    remap: None,
                })
                .collect()
        };
        Ok(TableSpec { parts, mode, cache })
    }

    /// Serve `spec`, a description of site `site`'s table.
    fn open_spec(
        &self,
        site: usize,
        spec: &TableSpec,
        gpu: Arc<dyn GpuBackend>,
    ) -> Result<Arc<dyn RowTable>> {
        metrale_storage::open(spec, gpu).map_err(|e| CheckpointError::Table {
            layer: self.sites[site].layer,
            what: "opening the table",
            source: Box::new(e),
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
