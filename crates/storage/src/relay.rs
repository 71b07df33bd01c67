//! `relay`: rewrite a table's rows in a new order, so rows read together
//! (the hot ones) share pages and direct-I/O granules.
//!
//! [`relay_rows`] fills the rows of `dst` (shard files with the same rows
//! and row format as `src`, such as a packed copy, whose rows may be
//! padded to another stride) so that physical row `p` of `dst`
//! holds logical row `order[p]` of `src`, with its FP8 scale. The caller
//! stores the inverse permutation (logical row to physical row) next to
//! the table and applies it to every id before the table sees it, so the
//! layer reads the same values as before.
//!
//! Invariants: `order` must be a permutation of `0..rows`, and no file may
//! be both source and destination (both checked before anything is
//! written); `src` is only read; `dst`'s headers and every byte
//! outside its row and scale tensors are left as they are; `dst` is synced
//! before returning.

use std::collections::HashMap;
use std::fs::{File, OpenOptions};
use std::os::unix::fs::FileExt;
use std::path::PathBuf;

use crate::error::{IoContext, Result, StorageError};
use crate::layout::TableFiles;

/// Rows gathered per write.
const CHUNK_ROWS: usize = 8192;

/// Fill `dst`'s rows with `src`'s in `order` (see the module docs), calling
/// `progress(done, rows)` as rows are written.
pub fn relay_rows(
    src: &TableFiles,
    dst: &TableFiles,
    order: &[u32],
    progress: &mut dyn FnMut(u64, u64),
) -> Result<()> {
    let rows = src.info.rows;
    if dst.info != src.info || dst.rows_per_shard != src.rows_per_shard {
        return Err(StorageError::invalid(format!(
            "relay: the destination table ({:?}, {} rows per shard) does not match the source ({:?}, {} rows per shard)",
            dst.info, dst.rows_per_shard, src.info, src.rows_per_shard
        )));
    }
    check_permutation(order, rows)?;
    for d in &dst.shards {
        let same = src.shards.iter().any(
            |s| matches!((s.path.canonicalize(), d.path.canonicalize()), (Ok(a), Ok(b)) if a == b),
        );
        if same {
            return Err(StorageError::invalid(format!(
                "relay: {} is both source and destination; relay into a copy",
                d.path.display()
            )));
        }
    }
    let maps = src
        .shards
        .iter()
        .map(|s| {
            let f = File::open(&s.path).io_ctx(&s.path, || "relay: opening")?;
            // SAFETY: the source is only read, and the mapping is dropped
            // before this function returns; a file truncated meanwhile
            // would fault, as any mmap reader would.
            let m = unsafe { memmap2::Mmap::map(&f) }.io_ctx(&s.path, || "relay: mapping")?;
            let _ = m.advise(memmap2::Advice::Random);
            Ok(m)
        })
        .collect::<Result<Vec<_>>>()?;
    let mut files: HashMap<PathBuf, File> = HashMap::new();
    for s in &dst.shards {
        if !files.contains_key(&s.path) {
            let f = OpenOptions::new()
                .write(true)
                .open(&s.path)
                .io_ctx(&s.path, || "relay: opening for writing")?;
            files.insert(s.path.clone(), f);
        }
    }
    let rb = src.info.row_bytes();
    // Rows land `stride` apart, padding zeroed (the source's own stride
    // may differ: relaying pads or unpads).
    let stride = dst.row_stride as usize;
    let rps = src.rows_per_shard as usize;
    let mut rowbuf = vec![0u8; CHUNK_ROWS * stride];
    let mut scalebuf = vec![0u8; CHUNK_ROWS * 4];
    let mut done = 0u64;
    progress(0, rows);
    for (k, shard) in dst.shards.iter().enumerate() {
        let out = &files[&shard.path];
        // The last shard may be shorter than the others.
        let rows_here = shard.rows as usize;
        let mut r = 0usize;
        while r < rows_here {
            let n = (rows_here - r).min(CHUNK_ROWS);
            for i in 0..n {
                let logical = order[k * rps + r + i] as u64;
                let loc = src.locate(logical)?;
                let m = &maps[loc.shard];
                let at = loc.offset as usize;
                let bytes = m.get(at..at + rb).ok_or_else(|| StorageError::Truncated {
                    path: src.shards[loc.shard].path.clone(),
                    what: format!("row {logical}"),
                    offset: loc.offset,
                    needed: rb as u64,
                    got: m.len().saturating_sub(at) as u64,
                })?;
                rowbuf[i * stride..i * stride + rb].copy_from_slice(bytes);
                if let Some(so) = loc.scale_offset {
                    let so = so as usize;
                    let b = m.get(so..so + 4).ok_or_else(|| StorageError::Truncated {
                        path: src.shards[loc.shard].path.clone(),
                        what: format!("scale of row {logical}"),
                        offset: so as u64,
                        needed: 4,
                        got: m.len().saturating_sub(so) as u64,
                    })?;
                    scalebuf[i * 4..(i + 1) * 4].copy_from_slice(b);
                }
            }
            let at = shard.data_offset + (r * stride) as u64;
            out.write_all_at(&rowbuf[..n * stride], at)
                .io_ctx_at(&shard.path, at, || format!("relay: writing {n} rows"))?;
            if let Some(so) = shard.scale_offset {
                let at = so + (r * 4) as u64;
                out.write_all_at(&scalebuf[..n * 4], at)
                    .io_ctx_at(&shard.path, at, || format!("relay: writing {n} scales"))?;
            }
            r += n;
            done += n as u64;
            progress(done, rows);
        }
    }
    for (p, f) in &files {
        f.sync_all().io_ctx(p, || "relay: syncing")?;
    }
    Ok(())
}

/// Whether physical row `p` of `files` is read in the fewest `granule`-byte
/// granules a row of its size can take (`ceil(row / granule)`), i.e. does
/// not straddle one more boundary than it must. With 512-byte granules, 4
/// of every 8 positions of 320-byte rows fit (a miss reads 512 bytes) and
/// the other 4 straddle (1024 bytes).
pub fn fits_granule(files: &TableFiles, granule: u64) -> impl Fn(u64) -> bool + '_ {
    let rb = files.info.row_bytes() as u64;
    let stride = files.row_stride;
    let g = granule.max(1);
    let least = rb.div_ceil(g);
    move |p| {
        let k = (p / files.rows_per_shard) as usize;
        let off = files.shards[k].data_offset + (p % files.rows_per_shard) * stride;
        (off % g + rb).div_ceil(g) == least
    }
}

/// The physical order of `rows` rows given hit counts of rows (ids below
/// `rows`): `order[p]` is the row stored at position `p`. The hit rows,
/// most hit first (ties by id), take the positions that `fits` accepts
/// from the start of the table, so each is read in as few granules as its
/// size allows and together they fill the table's first pages; the other
/// rows, in id order, take every position in between and after. Hit rows
/// left when no fitting position is (rows wider than a granule's slack)
/// take the first free positions.
pub fn hot_order(rows: u64, counts: &HashMap<u64, u64>, fits: impl Fn(u64) -> bool) -> Vec<u32> {
    let mut hot: Vec<(u64, u64)> = counts
        .iter()
        .filter(|&(&id, &c)| id < rows && c > 0)
        .map(|(&id, &c)| (id, c))
        .collect();
    hot.sort_unstable_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(&b.0)));
    let n = rows as usize;
    let mut is_hot = vec![false; n];
    for &(id, _) in &hot {
        is_hot[id as usize] = true;
    }
    let mut cold = (0..rows as u32).filter(|&r| !is_hot[r as usize]);
    let mut order = vec![u32::MAX; n];
    let mut next_hot = hot.iter().map(|&(id, _)| id as u32).peekable();
    let mut p = 0usize;
    // Where no position fits (rows as wide as a granule's slack), plain
    // hottest-first order.
    let any_fits = (0..rows).any(&fits);
    // Hit rows into fitting positions, cold rows into the gaps between.
    while p < n && next_hot.peek().is_some() {
        if !any_fits || fits(p as u64) {
            order[p] = next_hot.next().expect("peeked");
        } else if let Some(c) = cold.next() {
            order[p] = c;
        } else {
            order[p] = next_hot.next().expect("peeked");
        }
        p += 1;
    }
    // Every position holds one row and a hit row goes wherever no cold row
    // is left, so the hit rows are all placed by now.
    debug_assert!(next_hot.peek().is_none());
    for (slot, c) in order.iter_mut().skip(p).zip(cold) {
        *slot = c;
    }
    order
}

/// An error unless `order` holds every row of `0..rows` exactly once.
fn check_permutation(order: &[u32], rows: u64) -> Result<()> {
    if order.len() as u64 != rows {
        return Err(StorageError::invalid(format!(
            "relay: an order of {} rows for a table of {rows}",
            order.len()
        )));
    }
    let mut seen = vec![0u64; (rows as usize).div_ceil(64)];
    for (p, &o) in order.iter().enumerate() {
        let o = o as usize;
        if o as u64 >= rows {
            return Err(StorageError::invalid(format!(
                "relay: position {p} takes row {o}, past the table's {rows} rows"
            )));
        }
        if seen[o / 64] & (1 << (o % 64)) != 0 {
            return Err(StorageError::invalid(format!(
                "relay: row {o} is placed twice (again at position {p})"
            )));
        }
        seen[o / 64] |= 1 << (o % 64);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::layout::ShardSource;
    use crate::safetensors::{Dtype, TensorSpec, write_file};
    use std::path::Path;

    fn table(dir: &Path, tag: &str, fp8: bool, fill: bool) -> TableFiles {
        let mut list = Vec::new();
        for i in 0..2u64 {
            let p = dir.join(format!("{tag}-{i}.safetensors"));
            let name = format!("x.ngram_embedding.shard_{i}.weight");
            let rows: Vec<u8> = (0..5 * 4)
                .map(|j| if fill { (i * 20 + j) as u8 } else { 0 })
                .collect();
            let scales: Vec<u8> = (0..5)
                .flat_map(|r| {
                    let v = if fill { (i * 5 + r) as f32 } else { 0.0 };
                    v.to_le_bytes()
                })
                .collect();
            let dt = if fp8 { Dtype::F8E4M3 } else { Dtype::BF16 };
            let dim = if fp8 { 4 } else { 2 };
            let mut t = vec![(TensorSpec::new(&name, dt, &[5, dim]), &rows[..])];
            let sn = format!("x.scale_{i}");
            if fp8 {
                t.push((TensorSpec::new(&sn, Dtype::F32, &[5]), &scales[..]));
            }
            write_file(&p, &t, if fill { 8 } else { 4096 }).unwrap();
            list.push(ShardSource::new(p, name, Some(sn)));
        }
        TableFiles::open(&list, Some(10)).unwrap()
    }

    #[test]
    fn rows_and_scales_land_where_the_order_says() {
        for fp8 in [false, true] {
            let d = tempfile::tempdir().unwrap();
            let src = table(d.path(), "src", fp8, true);
            let dst = table(d.path(), "dst", fp8, false);
            let order: Vec<u32> = vec![7, 2, 9, 0, 1, 3, 4, 5, 6, 8];
            let mut calls = 0;
            relay_rows(&src, &dst, &order, &mut |_, _| calls += 1).unwrap();
            assert!(calls >= 2);
            let read = |t: &TableFiles, id: u64| {
                let l = t.locate(id).unwrap();
                let f = std::fs::read(&t.shards[l.shard].path).unwrap();
                let row = f[l.offset as usize..l.offset as usize + 4].to_vec();
                let sc = l
                    .scale_offset
                    .map(|o| f[o as usize..o as usize + 4].to_vec());
                (row, sc)
            };
            for (p, &o) in order.iter().enumerate() {
                assert_eq!(read(&dst, p as u64), read(&src, o as u64), "position {p}");
            }
        }
    }

    #[test]
    fn hot_rows_take_fitting_positions_first() {
        let d = tempfile::tempdir().unwrap();
        // 2 shards of 5 rows of 4 bytes (BF16 x 2), data at offset 4096.
        let dst = table(d.path(), "dst", false, false);
        // Granule 8: rows at offsets 0, 4 (fit), 8, 12, 16, ... all fit;
        // granule 6 makes some straddle.
        let fits = fits_granule(&dst, 6);
        let fit: Vec<bool> = (0..10).map(&fits).collect();
        // Offsets mod 6 of 4096 + 4k: 4, 2, 0, 4, 2 in each shard: a 4-byte
        // row at 4 straddles, at 2 or 0 it does not.
        assert_eq!(
            fit,
            [
                false, true, true, false, true, false, true, true, false, true
            ]
        );
        let counts: HashMap<u64, u64> = [(9, 5), (3, 7), (4, 1), (42, 9)].into_iter().collect();
        let order = hot_order(10, &counts, &fits);
        check_permutation(&order, 10).unwrap();
        // Hot rows 3, 9, 4 (42 is past the table) at fitting positions 1, 2,
        // 4; cold rows 0, 1 in the gaps at 0 and 3, then the rest in order.
        assert_eq!(order, [0, 3, 9, 1, 4, 2, 5, 6, 7, 8]);
        // Nothing fits: plain hottest-first order.
        let order = hot_order(10, &counts, |_| false);
        assert_eq!(order, [3, 9, 4, 0, 1, 2, 5, 6, 7, 8]);
        let all: HashMap<u64, u64> = (0..10).map(|i| (i, 10 - i)).collect();
        let order = hot_order(10, &all, |p| p % 2 == 0);
        assert_eq!(order, [0, 1, 2, 3, 4, 5, 6, 7, 8, 9]);
    }

    #[test]
    fn a_bad_order_is_refused_before_writing() {
        let d = tempfile::tempdir().unwrap();
        let src = table(d.path(), "src", false, true);
        let dst = table(d.path(), "dst", false, false);
        let before: Vec<Vec<u8>> = dst
            .shards
            .iter()
            .map(|s| std::fs::read(&s.path).unwrap())
            .collect();
        for (order, want) in [
            (vec![0u32; 9], "of 9 rows"),
            (vec![0, 1, 2, 3, 4, 5, 6, 7, 8, 10], "past the table"),
            (vec![0, 1, 2, 3, 4, 5, 6, 7, 8, 8], "placed twice"),
        ] {
            let e = relay_rows(&src, &dst, &order, &mut |_, _| {})
                .unwrap_err()
                .to_string();
            assert!(e.contains(want), "{e}");
        }
        for (s, b) in dst.shards.iter().zip(before) {
            assert_eq!(std::fs::read(&s.path).unwrap(), b);
        }
        let order: Vec<u32> = (0..10).rev().collect();
        let e = relay_rows(&src, &src, &order, &mut |_, _| {})
            .unwrap_err()
            .to_string();
        assert!(e.contains("both source and destination"), "{e}");
    }
}
