//! `metrale-ple inspect`: a checkpoint's family, model spec, sizes, table
//! layout (shards, or LongCat's sub-tables), row format, carry and
//! validation result.
//!
//! The spec is printed from `config.json` alone first, so a checkpoint
//! that fails validation still shows what it claims to be; the validation
//! line then gives the loader's verdict (exit status 2 when refused).

use std::path::PathBuf;

use clap::Args;
use metrale_checkpoint::Checkpoint;
use metrale_checkpoint::family::Layout;
use metrale_checkpoint::load::read_spec;
use metrale_model_layers::layers::ple::ModelSpec;
use metrale_storage::layout::TableFiles;
use metrale_storage::table::RowDType;

use super::common::bytes;
use super::{CmdError, input};

/// Arguments of `inspect`.
#[derive(Args, Debug)]
#[command(after_help = "Example:\n  metrale-ple inspect ~/.cache/metrale-ple/tiny")]
pub struct InspectArgs {
    /// The checkpoint directory.
    pub dir: PathBuf,
}

fn print_spec(g: &ModelSpec) -> Result<(), CmdError> {
    let layout = Layout::of(g).map_err(input)?;
    println!("family              {}", layout.name());
    println!("  layer             {}", g.combine().describe());
    println!("geometry");
    println!(
        "  vocab_size        {} (eos {})",
        g.vocab_size, g.eos_token_id
    );
    println!(
        "  highway           hidden {} x hc {} = {} channels, rms_norm_eps {:e}",
        g.hidden_size,
        g.hc_mult,
        g.channels(),
        g.rms_norm_eps
    );
    println!(
        "  n-grams           orders 2..={} x {} heads = {} heads of {} values (E = {})",
        g.ngram_size,
        g.heads_per_ngram,
        g.ngram_heads(),
        g.head_dim,
        g.emb_dim()
    );
    println!(
        "  conv              kernel {}, dilation {}, state {} rows",
        g.conv_kernel_size,
        g.dilation(),
        g.state_len()
    );
    println!(
        "  hash              base {}, padded to a multiple of {}, seed {}",
        g.ngram_vocab_size_base, g.divisible_by, g.hash_seed
    );
    println!(
        "  sites             {} at layer ids {:?} ({} {} each)",
        g.sites(),
        g.ple_layer_ids,
        layout.table_parts(g),
        layout.part_noun()
    );
    Ok(())
}

/// Run `inspect`.
pub fn run(a: InspectArgs) -> Result<(), CmdError> {
    println!("checkpoint          {}", a.dir.display());
    let g = match read_spec(&a.dir) {
        Ok(g) => g,
        Err(e) => {
            println!("validation          REFUSED");
            return Err(input(e));
        }
    };
    print_spec(&g)?;
    let ck = match Checkpoint::open(&a.dir) {
        Ok(c) => c,
        Err(e) => {
            println!("validation          REFUSED");
            return Err(input(e));
        }
    };
    let mut gathered_per_token = 0u64;
    let layout = ck.layout;
    println!("layout              {}", layout.name());
    println!("sites");
    for s in &ck.sites {
        let t = &s.table;
        let row_bytes =
            t.dtype.row_bytes(t.head_dim) as u64 + if t.dtype.has_row_scale() { 4 } else { 0 };
        gathered_per_token += row_bytes * s.spec.dims.ngram_heads() as u64;
        println!(
            "  site {} ({}) at block {}",
            s.index,
            layout.site_prefix(&ck.spec, s.index),
            s.layer
        );
        if !s.spec.dims.multipliers.is_empty() {
            println!("    multipliers     {:?}", s.spec.dims.multipliers);
        }
        let sizes = &s.spec.dims.head_vocab_sizes;
        println!(
            "    head sizes      {} .. {} ({} {})",
            sizes.first().copied().unwrap_or(0),
            sizes.last().copied().unwrap_or(0),
            sizes.len(),
            if layout.sub_tables() {
                "sub-tables"
            } else {
                "heads"
            }
        );
        println!(
            "    table           {} rows addressed, {} stored{}, {}, {}",
            s.padded_rows,
            t.stored_rows,
            match (t.fold_rows, layout.sub_tables()) {
                (Some(_), true) => " (ids folded inside each sub-table)".to_string(),
                (Some(m), false) => format!(" (ids folded: row = id % {m})"),
                (None, _) => String::new(),
            },
            match t.dtype {
                RowDType::Bf16 => "BF16".to_string(),
                RowDType::F32 => "F32".to_string(),
                RowDType::Fp8E4M3 => "FP8 E4M3 + f32 row scales".to_string(),
                RowDType::Fp8E4M3Block32 => "FP8 E4M3 + UE8M0 scale per 32 values".to_string(),
            },
            bytes(t.bytes)
        );
        // Rows padded on disk (`table pack --pad-rows`) sit further apart.
        let stride = t
            .shards
            .first()
            .filter(|_| t.release.is_none())
            .and_then(|s| TableFiles::open(std::slice::from_ref(s), None).ok())
            .map(|f| f.row_stride)
            .filter(|&st| st != row_bytes);
        println!(
            "    rows            {} values, {row_bytes} B each{}",
            t.head_dim,
            stride.map_or(String::new(), |st| format!(
                ", padded to {st} B apart on disk"
            ))
        );
        println!(
            "    carry           {} history tokens, {} B conv state, aux blob {} B",
            s.spec.context_len(),
            s.spec.conv_bytes(),
            s.spec.aux_blob_len()
        );
        if layout.sub_tables() {
            println!("    sub-tables      {}", t.shards.len());
            let mut start = 0u64;
            for (i, (sub, shard)) in t.sub_tables.iter().zip(&t.shards).enumerate() {
                let name = shard
                    .path
                    .file_name()
                    .map(|n| n.to_string_lossy().into_owned())
                    .unwrap_or_default();
                println!(
                    "      sub-table {i:<3} ids {:>11} .. {:<11} {} stored  {name}",
                    start,
                    start + sub.logical_rows,
                    sub.stored_rows
                );
                start += sub.logical_rows;
            }
            continue;
        }
        println!(
            "    shards          {} x [{}, {}]",
            t.shards.len(),
            t.rows_per_shard,
            t.head_dim
        );
        for (i, shard) in t.shards.iter().enumerate() {
            let name = shard
                .path
                .file_name()
                .map(|n| n.to_string_lossy().into_owned())
                .unwrap_or_default();
            println!(
                "      shard {i:<3} rows {:>11} .. {:<11} {name}",
                i as u64 * t.rows_per_shard,
                (i as u64 + 1) * t.rows_per_shard
            );
        }
    }
    let heads: usize = ck.sites.iter().map(|s| s.spec.dims.ngram_heads()).sum();
    println!("sizes");
    println!(
        "  table bytes       {} ({} sites)",
        bytes(ck.table_bytes()),
        ck.sites.len()
    );
    println!(
        "  rows per token    {heads} ({} gathered bytes)",
        gathered_per_token
    );
    // Every site of a model has the same carry shape.
    let first = &ck.sites[0].spec;
    println!(
        "  carry per seq     {} on the device ({} B conv state per site), aux blob {} B per site",
        bytes(ck.sites.iter().map(|s| s.spec.carry_bytes() as u64).sum()),
        first.conv_bytes(),
        first.aux_blob_len()
    );
    println!("files");
    for f in &ck.files {
        println!(
            "  {:<36} {:>12}  {} tensors, data at {}{}",
            f.name,
            bytes(f.bytes),
            f.tensors,
            f.data_start,
            if f.data_start % 4096 == 0 {
                " (4 KiB aligned)"
            } else {
                ""
            }
        );
    }
    println!("validation          OK");
    Ok(())
}
