//! Hot-row packing: a site's table rows relaid so the most-hit rows share
//! pages, and the row remap that keeps ids unchanged.
//!
//! `metrale-ple table pack --hot-rows TRACE` counts how often each row id
//! of each site appears in TRACE ([`parse_trace`], [`fold_counts`]),
//! relays the table's rows hottest first, each hot row where it is read in
//! the fewest direct-I/O granules ([`metrale_storage::relay::hot_order`],
//! then [`metrale_storage::relay::relay_rows`]) and stores
//! the permutation, logical row to physical row, in the file
//! [`crate::names::row_remap_file`] beside the checkpoint's files.
//! [`site_remap`] hands it to the table description, whose id map
//! ([`metrale_storage::idmap::IdMap`]) applies it to every id after
//! hashing (and after folding a cut table), so the layer asks for the same
//! ids and reads the same values as from the original checkpoint.
//!
//! The remap file: a 32-byte header, magic `MPLEREMP`, then little-endian
//! `u32` version (1), `u32` entry width (4), `u64` rows, `u32` CRC-32 of
//! the entries, `u32` zero; then `rows` `u32` entries, entry `i` the
//! physical row of logical row `i`. The trace: text, one `SITE ROW_ID` pair
//! of decimal integers per line (blank lines and `#` comments allowed),
//! row ids as the site's table is asked for them (the hashed ids; a cut
//! table folds them as it does when serving).
//!
//! Invariants: a [`RowRemap`] exists only for a permutation of `0..rows`
//! (every entry below `rows`, none repeated) read from a file whose length
//! and CRC check; anything else is a [`RemapError`] naming the file (and
//! the entry or line).

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use metrale_storage::StorageError;

use crate::error::CheckpointError;
use crate::load::Checkpoint;
use crate::names::row_remap_file;

/// The remap file's first eight bytes.
pub const MAGIC: &[u8; 8] = b"MPLEREMP";
/// The remap format version written and read.
pub const VERSION: u32 = 1;
/// Bytes before the entries.
pub const HEADER_BYTES: usize = 32;

/// What is wrong with a remap file or a trace.
#[derive(Debug, thiserror::Error)]
pub enum RemapError {
    /// The file could not be read or written.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The OS error.
        source: std::io::Error,
    },
    /// Not a remap file of this version: magic, version, width, length or
    /// checksum.
    #[error("{path}: not a valid row remap file: {msg}")]
    Format {
        /// The file.
        path: PathBuf,
        /// What is wrong.
        msg: String,
    },
    /// A remap of another table size.
    #[error("{path}: a remap of {found} rows, but the table has {expected}")]
    Rows {
        /// The file.
        path: PathBuf,
        /// Rows the file holds.
        found: u64,
        /// Rows of the table.
        expected: u64,
    },
    /// An entry naming a row past the table.
    #[error("{path}: entry {index} sends row {index} to row {value}, past the table's {rows} rows")]
    OutOfRange {
        /// The file.
        path: PathBuf,
        /// The entry (logical row).
        index: u64,
        /// Its value.
        value: u64,
        /// Rows of the table.
        rows: u64,
    },
    /// Two entries naming the same row (not a permutation).
    #[error(
        "{path}: entries {first} and {second} both send their rows to row {value}; a remap must be a permutation"
    )]
    Duplicate {
        /// The file.
        path: PathBuf,
        /// The first entry naming `value`.
        first: u64,
        /// The second.
        second: u64,
        /// The row named twice.
        value: u64,
    },
    /// A malformed trace line.
    #[error("{path}: line {line}: {msg}")]
    Trace {
        /// The trace file.
        path: PathBuf,
        /// 1-based line number.
        line: usize,
        /// What is wrong.
        msg: String,
    },
}

/// A permutation of a table's rows: `physical(i)` is where logical row `i`
/// is stored.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RowRemap {
    map: Vec<u32>,
}

impl RowRemap {
    /// The remap that stores row `order[p]` at physical row `p`, or an
    /// error (naming `path`) unless `order` is a permutation.
    pub fn from_order(order: &[u32], path: &Path) -> Result<RowRemap, RemapError> {
        let rows = order.len() as u64;
        let mut map = vec![u32::MAX; order.len()];
        for (p, &o) in order.iter().enumerate() {
            let slot = map
                .get_mut(o as usize)
                .ok_or_else(|| RemapError::OutOfRange {
                    path: path.to_path_buf(),
                    index: o as u64,
                    value: p as u64,
                    rows,
                })?;
            if *slot != u32::MAX {
                return Err(RemapError::Duplicate {
                    path: path.to_path_buf(),
                    first: *slot as u64,
                    second: p as u64,
                    value: o as u64,
                });
            }
            *slot = p as u32;
        }
        Ok(RowRemap { map })
    }

    /// Rows remapped.
    pub fn rows(&self) -> u64 {
        self.map.len() as u64
    }

    /// Where logical row `id` is stored (`id < rows()`).
    #[inline]
    pub fn physical(&self, id: u64) -> u64 {
        self.map[id as usize] as u64
    }

    /// The file's bytes.
    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(HEADER_BYTES + 4 * self.map.len());
        out.extend_from_slice(MAGIC);
        out.extend_from_slice(&VERSION.to_le_bytes());
        out.extend_from_slice(&4u32.to_le_bytes());
        out.extend_from_slice(&(self.map.len() as u64).to_le_bytes());
        out.extend_from_slice(&[0; 8]);
        for &v in &self.map {
            out.extend_from_slice(&v.to_le_bytes());
        }
        let crc = crc32fast::hash(&out[HEADER_BYTES..]);
        out[24..28].copy_from_slice(&crc.to_le_bytes());
        out
    }

    /// Parse a remap file's bytes (`path` names it in errors), checking it
    /// against a table of `expected_rows` rows when given.
    pub fn parse(
        bytes: &[u8],
        expected_rows: Option<u64>,
        path: &Path,
    ) -> Result<RowRemap, RemapError> {
        let bad = |msg: String| RemapError::Format {
            path: path.to_path_buf(),
            msg,
        };
        if bytes.len() < HEADER_BYTES {
            return Err(bad(format!(
                "{} bytes, shorter than the {HEADER_BYTES}-byte header",
                bytes.len()
            )));
        }
        if &bytes[..8] != MAGIC {
            return Err(bad("wrong magic (expected MPLEREMP)".into()));
        }
        let u32_at = |o: usize| u32::from_le_bytes(bytes[o..o + 4].try_into().expect("4 bytes"));
        let version = u32_at(8);
        if version != VERSION {
            return Err(bad(format!("version {version}, expected {VERSION}")));
        }
        let width = u32_at(12);
        if width != 4 {
            return Err(bad(format!("entry width {width}, expected 4")));
        }
        let rows = u64::from_le_bytes(bytes[16..24].try_into().expect("8 bytes"));
        if let Some(want) = expected_rows
            && rows != want
        {
            return Err(RemapError::Rows {
                path: path.to_path_buf(),
                found: rows,
                expected: want,
            });
        }
        if rows > u32::MAX as u64 + 1 {
            return Err(bad(format!(
                "{rows} rows, more than 4-byte entries address"
            )));
        }
        let body = &bytes[HEADER_BYTES..];
        if body.len() as u64 != rows * 4 {
            return Err(bad(format!(
                "{} bytes of entries, but {rows} rows need {}",
                body.len(),
                rows * 4
            )));
        }
        let crc = crc32fast::hash(body);
        if crc != u32_at(24) {
            return Err(bad(format!(
                "entry checksum {crc:#010x} does not match the header's {:#010x}",
                u32_at(24)
            )));
        }
        let mut map = Vec::with_capacity(rows as usize);
        // One bit per physical row (an eighth of the entries' size, which
        // matters at hundreds of millions of rows); the first holder of a
        // repeated row is looked up only when there is one.
        let mut seen = vec![0u64; (rows as usize).div_ceil(64)];
        for (i, c) in body.chunks_exact(4).enumerate() {
            let v = u32::from_le_bytes(c.try_into().expect("4 bytes"));
            if v as u64 >= rows {
                return Err(RemapError::OutOfRange {
                    path: path.to_path_buf(),
                    index: i as u64,
                    value: v as u64,
                    rows,
                });
            }
            let (w, b) = (v as usize / 64, v % 64);
            if seen[w] & (1 << b) != 0 {
                let first = map.iter().position(|&m| m == v).expect("seen before");
                return Err(RemapError::Duplicate {
                    path: path.to_path_buf(),
                    first: first as u64,
                    second: i as u64,
                    value: v as u64,
                });
            }
            seen[w] |= 1 << b;
            map.push(v);
        }
        Ok(RowRemap { map })
    }

    /// Read and check the remap file at `path` for a table of
    /// `expected_rows` rows.
    pub fn load(path: &Path, expected_rows: u64) -> Result<RowRemap, RemapError> {
        let bytes = std::fs::read(path).map_err(|source| RemapError::Io {
            path: path.to_path_buf(),
            source,
        })?;
        Self::parse(&bytes, Some(expected_rows), path)
    }

    /// Write the remap to `path`, complete or not at all (a temporary file
    /// beside it, synced, then renamed).
    pub fn write(&self, path: &Path) -> Result<(), RemapError> {
        let io = |source| RemapError::Io {
            path: path.to_path_buf(),
            source,
        };
        let mut tmp = path.as_os_str().to_owned();
        tmp.push(".tmp");
        let tmp = PathBuf::from(tmp);
        let r = (|| {
            use std::io::Write;
            let mut f = std::fs::File::create(&tmp)?;
            f.write_all(&self.encode())?;
            f.sync_all()?;
            std::fs::rename(&tmp, path)
        })();
        if let Err(e) = r {
            let _ = std::fs::remove_file(&tmp);
            return Err(io(e));
        }
        Ok(())
    }
}

/// Row hit counts per site from a trace's text (see the module docs for
/// the format); `sites` is the number of sites, `path` names the trace in
/// errors. Counts are keyed by row id as given.
pub fn parse_trace(
    text: &str,
    sites: usize,
    path: &Path,
) -> Result<Vec<HashMap<u64, u64>>, RemapError> {
    let mut out = vec![HashMap::new(); sites];
    for (k, line) in text.lines().enumerate() {
        let err = |msg: String| RemapError::Trace {
            path: path.to_path_buf(),
            line: k + 1,
            msg,
        };
        let line = line.split('#').next().unwrap_or("").trim();
        if line.is_empty() {
            continue;
        }
        let mut f = line.split_whitespace();
        let (Some(site), Some(id), None) = (f.next(), f.next(), f.next()) else {
            return Err(err(format!("expected `SITE ROW_ID`, found '{line}'")));
        };
        let site: usize = site
            .parse()
            .map_err(|_| err(format!("site '{site}' is not a number")))?;
        let id: u64 = id
            .parse()
            .map_err(|_| err(format!("row id '{id}' is not a number")))?;
        let counts = out.get_mut(site).ok_or_else(|| {
            err(format!(
                "site {site} does not exist (the checkpoint has {sites})"
            ))
        })?;
        *counts.entry(id).or_insert(0) += 1;
    }
    Ok(out)
}

/// Hit counts of trace ids folded onto a table of `rows` stored rows
/// (`id % rows`, as a cut table folds ids when serving), ready for
/// [`metrale_storage::relay::hot_order`].
pub fn fold_counts(rows: u64, counts: &HashMap<u64, u64>) -> HashMap<u64, u64> {
    let mut folded: HashMap<u64, u64> = HashMap::with_capacity(counts.len());
    for (&id, &c) in counts {
        *folded.entry(id % rows).or_insert(0) += c;
    }
    folded
}

/// Site `site`'s row remap, when the checkpoint has one: entry `i` the
/// physical row of stored row `i`, for the table description
/// ([`metrale_storage::TablePart::remap`]). A remap that is unreadable or
/// malformed, or made for another row count, is an error naming the file.
pub fn site_remap(ck: &Checkpoint, site: usize) -> Result<Option<Arc<[u32]>>, CheckpointError> {
    let s = &ck.sites[site];
    let path = ck.dir.join(row_remap_file(s.layer));
    let err = |e: String| CheckpointError::Table {
        layer: s.layer,
        what: "loading the row remap",
        source: Box::new(StorageError::layout(Some(path.clone()), None, e)),
    };
    match std::fs::symlink_metadata(&path) {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(err(format!("{}: {e}", path.display()))),
        Ok(_) => {}
    }
    let remap = RowRemap::load(&path, s.table.stored_rows).map_err(|e| err(e.to_string()))?;
    Ok(Some(Arc::from(remap.map)))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn p() -> PathBuf {
        PathBuf::from("/ck/model.layers.1.ple.row_remap.bin")
    }

    #[test]
    fn remaps_round_trip_and_invert_the_order() {
        let order = vec![3u32, 0, 4, 1, 2];
        let r = RowRemap::from_order(&order, &p()).unwrap();
        for (phys, &logical) in order.iter().enumerate() {
            assert_eq!(r.physical(logical as u64), phys as u64);
        }
        let bytes = r.encode();
        assert_eq!(bytes.len(), HEADER_BYTES + 20);
        assert_eq!(RowRemap::parse(&bytes, Some(5), &p()).unwrap(), r);
        let d = tempfile::tempdir().unwrap();
        let f = d.path().join("r.bin");
        r.write(&f).unwrap();
        assert_eq!(RowRemap::load(&f, 5).unwrap(), r);
    }

    /// Re-seal the entries' checksum, so a test reaches the entry checks.
    fn reseal(mut b: Vec<u8>) -> Vec<u8> {
        let crc = crc32fast::hash(&b[HEADER_BYTES..]);
        b[24..28].copy_from_slice(&crc.to_le_bytes());
        b
    }

    #[test]
    fn malformed_remaps_are_refused_naming_the_file() {
        let good = RowRemap::from_order(&[1, 2, 0, 3], &p()).unwrap().encode();
        let mut cases: Vec<(Vec<u8>, Option<u64>, &str)> = Vec::new();
        cases.push((good[..20].to_vec(), None, "shorter than the 32-byte header"));
        let mut b = good.clone();
        b[0] = b'X';
        cases.push((b, None, "wrong magic"));
        let mut b = good.clone();
        b[8] = 2;
        cases.push((b, None, "version 2"));
        let mut b = good.clone();
        b[12] = 8;
        cases.push((b, None, "entry width 8"));
        cases.push((
            good.clone(),
            Some(5),
            "a remap of 4 rows, but the table has 5",
        ));
        cases.push((
            good[..good.len() - 4].to_vec(),
            None,
            "12 bytes of entries, but 4 rows need 16",
        ));
        let mut b = good.clone();
        b[HEADER_BYTES] ^= 1;
        cases.push((b, None, "checksum"));
        let mut b = good.clone();
        b[HEADER_BYTES + 4..HEADER_BYTES + 8].copy_from_slice(&9u32.to_le_bytes());
        cases.push((
            reseal(b),
            None,
            "entry 1 sends row 1 to row 9, past the table's 4 rows",
        ));
        let mut b = good.clone();
        b[HEADER_BYTES + 12..HEADER_BYTES + 16].copy_from_slice(&2u32.to_le_bytes());
        cases.push((
            reseal(b),
            None,
            "entries 0 and 3 both send their rows to row 2",
        ));
        for (bytes, rows, want) in cases {
            let e = RowRemap::parse(&bytes, rows, &p()).unwrap_err();
            let m = e.to_string();
            assert!(m.contains(want), "{m}");
            assert!(m.contains("row_remap.bin"), "{m}");
        }
        assert!(matches!(
            RowRemap::from_order(&[0, 0], &p()),
            Err(RemapError::Duplicate { .. })
        ));
        assert!(matches!(
            RowRemap::from_order(&[0, 2], &p()),
            Err(RemapError::OutOfRange { .. })
        ));
        let missing = RowRemap::load(Path::new("/nonexistent/r.bin"), 4).unwrap_err();
        assert!(matches!(missing, RemapError::Io { .. }), "{missing}");
    }

    #[test]
    fn traces_count_rows_per_site_and_name_bad_lines() {
        let t = "# site row\n0 5\n0 5\n1 7   # comment\n\n0 9\n";
        let c = parse_trace(t, 2, Path::new("trace.txt")).unwrap();
        assert_eq!(c[0][&5], 2);
        assert_eq!(c[0][&9], 1);
        assert_eq!(c[1][&7], 1);
        for (bad, want) in [
            ("0 5\n3 1\n", "line 2: site 3 does not exist"),
            ("x 1\n", "line 1: site 'x' is not a number"),
            ("0 -1\n", "row id '-1' is not a number"),
            ("0 1 2\n", "expected `SITE ROW_ID`"),
        ] {
            let e = parse_trace(bad, 2, Path::new("trace.txt"))
                .unwrap_err()
                .to_string();
            assert!(e.contains("trace.txt") && e.contains(want), "{e}");
        }
    }

    #[test]
    fn trace_ids_fold_onto_stored_rows() {
        let counts: HashMap<u64, u64> = [(4, 1), (2, 5), (7, 3), (12, 1)].into_iter().collect();
        // 12 folds onto 2 (10 rows): row 2 has 6 hits, 7 has 3, 4 has 1.
        let f = fold_counts(10, &counts);
        assert_eq!(f.len(), 3);
        assert_eq!((f[&2], f[&7], f[&4]), (6, 3, 1));
    }
}
