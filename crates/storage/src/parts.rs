//! The split protocol for batches with more distinct ids than one resolve
//! may pin.
//!
//! A caller with `n` ids cuts them, in order, into parts of at most
//! `max_resolve()` distinct ids; for each part it resolves, queues the
//! gather that reads the rows, records an event after it and releases the
//! lease with that event before resolving the next part. Each part's row
//! references are valid only for that part's gather: a later part may
//! evict the rows of an earlier one once its gather has run. So any batch
//! runs on any cache, whereas a caller that keeps every part's lease until
//! one later gather (a prestaged decode step) needs all its distinct ids
//! to fit `max_pinned()` at once.

use std::collections::HashSet;
use std::hash::BuildHasherDefault;

use metrale_gpu_runtime::gpu::{EventHandle, GpuBackend};

use crate::StorageError;
use crate::cached::IdHasher;
use crate::table::{RowRef, RowTable};

/// Cut `ids` into consecutive ranges of at most `limit` distinct ids each.
pub fn split_points(ids: &[u64], limit: usize) -> Vec<std::ops::Range<usize>> {
    let limit = limit.max(1);
    let mut parts = Vec::new();
    let mut seen: HashSet<u64, BuildHasherDefault<IdHasher>> = HashSet::default();
    let mut start = 0;
    for (i, &id) in ids.iter().enumerate() {
        if !seen.contains(&id) && seen.len() == limit {
            parts.push(start..i);
            start = i;
            seen.clear();
        }
        seen.insert(id);
    }
    if start < ids.len() {
        parts.push(start..ids.len());
    }
    parts
}

/// Resolve `ids` through `table` part by part (see the module docs).
///
/// `gather(start, part_ids, part_refs)` queues the work that reads the
/// part's rows and returns the event recorded after it, or `None` when the
/// work has already completed. The part's lease is released with that
/// event. If `gather` fails, the lease is released at once, so `gather`
/// must not leave queued work reading the rows when it returns an error.
/// Returns the number of parts. The error type is the caller's: any `E`
/// that table errors convert into (`StorageError` itself, `anyhow::Error`).
pub fn resolve_in_parts<F, E>(
    table: &dyn RowTable,
    gpu: &dyn GpuBackend,
    ids: &[u64],
    mut gather: F,
) -> Result<usize, E>
where
    F: FnMut(usize, &[u64], &[RowRef]) -> Result<Option<EventHandle>, E>,
    E: From<StorageError>,
{
    let limit = table.max_resolve();
    if limit == 0 {
        return Err(StorageError::invalid("the table accepts no ids per resolve").into());
    }
    let parts = split_points(ids, limit);
    let mut refs = vec![RowRef::default(); ids.len()];
    for r in &parts {
        let part = &ids[r.clone()];
        let out = &mut refs[r.clone()];
        let lease = table.resolve(part, out)?;
        match gather(r.start, part, out) {
            Ok(ev) => table.release(lease, gpu, ev)?,
            Err(e) => {
                table.release(lease, gpu, None)?;
                return Err(e);
            }
        }
    }
    Ok(parts.len())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn splits_by_distinct_ids() {
        assert_eq!(
            split_points(&[1, 2, 1, 3, 3, 4, 1], 2),
            vec![0..3, 3..6, 6..7]
        );
        assert_eq!(split_points(&[5, 5, 5], 1), vec![0..3]);
        assert_eq!(split_points(&[], 4), Vec::<std::ops::Range<usize>>::new());
        for p in split_points(&[9, 8, 7, 6, 5], 2) {
            assert!(p.len() <= 2);
        }
    }
}
