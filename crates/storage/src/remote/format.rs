//! What a remote row server holds: the table digest, the shard rule, the
//! keys, the value format and the per-server manifest
//! (docs/SPEC.md §9 (Row table and cache), "Remote rows").
//!
//! Invariants: keys, values and manifests are pure functions of the table
//! and of the server list's length and order, never of the process or the
//! build; [`decode_value`] and [`Manifest::parse`] accept exactly what
//! [`encode_value`] and [`Manifest::to_json`] write for the table asked
//! about and refuse anything else with a [`FormatError`] naming what is
//! wrong (they are the parsers of bytes that come from the network, and
//! the fuzz targets `remote_value` and `remote_manifest` drive them).

use std::fmt;
use std::os::unix::fs::FileExt;

use crate::digest::{Sha256, hex};
use crate::error::{Result, StorageError};
use crate::layout::TableFiles;
use crate::splitmix::splitmix64;
use crate::table::{RowDType, TableInfo};

/// The first bytes of every key.
pub const KEY_PREFIX: &str = "mple:";

/// The magic that starts every value.
pub const VALUE_MAGIC: [u8; 4] = *b"MPLR";

/// Bytes of a value's header (magic, payload length, digest, row id).
pub const VALUE_HEADER: usize = 32;

/// Bytes a value adds to its payload: the header and the CRC-32 after it.
pub const VALUE_OVERHEAD: usize = VALUE_HEADER + 4;

/// The `format` field of every manifest.
pub const MANIFEST_FORMAT: &str = "metrale-ple remote rows";

/// The manifest version this build writes and reads.
pub const MANIFEST_VERSION: u64 = 1;

/// Rows sampled (besides the first and last) into a [`TableDigest`].
pub const DIGEST_SAMPLES: u64 = 64;

/// A table's identity on remote servers: the first 16 bytes of a SHA-256
/// over its shape and the bytes of [`DIGEST_SAMPLES`] + 2 of its rows (see
/// [`table_digest`]).
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct TableDigest(pub [u8; 16]);

impl TableDigest {
    /// Lower-case hex, 32 characters (what keys carry).
    pub fn hex(&self) -> String {
        hex(&self.0)
    }

    /// Parse [`Self::hex`]'s form back.
    pub fn parse_hex(s: &str) -> Option<TableDigest> {
        if s.len() != 32 || !s.bytes().all(|b| b.is_ascii_hexdigit()) {
            return None;
        }
        let mut d = [0u8; 16];
        for (i, o) in d.iter_mut().enumerate() {
            *o = u8::from_str_radix(&s[2 * i..2 * i + 2], 16).ok()?;
        }
        Some(TableDigest(d))
    }

    /// The digest's first eight bytes as a little-endian u64 (the shard
    /// rule's seed).
    pub fn seed(&self) -> u64 {
        u64::from_le_bytes(self.0[..8].try_into().expect("8 bytes"))
    }
}

impl fmt::Debug for TableDigest {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "TableDigest({})", self.hex())
    }
}

impl fmt::Display for TableDigest {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.hex())
    }
}

/// The shard rule: the server (index into the list, of `servers`) that
/// holds row `id` of table `d`: `splitmix64(id ^ seed)` scaled to
/// `0..servers` by a 128-bit multiply (high half).
pub fn server_of(d: &TableDigest, id: u64, servers: usize) -> usize {
    let h = splitmix64(id ^ d.seed());
    ((h as u128 * servers as u128) >> 64) as usize
}

/// The key of row `id` of table `d`: `mple:{digest hex}:{id in lower-case
/// hex}`.
pub fn row_key(d: &TableDigest, id: u64) -> String {
    format!("{KEY_PREFIX}{}:{id:x}", d.hex())
}

/// The key of table `d`'s manifest on each server: `mple:{digest
/// hex}:manifest`.
pub fn manifest_key(d: &TableDigest) -> String {
    format!("{KEY_PREFIX}{}:manifest", d.hex())
}

/// Bytes of a row's payload in a value: the row as stored, then for
/// [`RowDType::Fp8E4M3`] its f32 scale (4 bytes, as stored).
pub fn payload_bytes(info: &TableInfo) -> usize {
    info.row_bytes()
        + if info.dtype == RowDType::Fp8E4M3 {
            4
        } else {
            0
        }
}

/// The name a manifest gives a row type.
pub fn dtype_name(d: RowDType) -> &'static str {
    match d {
        RowDType::Bf16 => "bf16",
        RowDType::Fp8E4M3 => "fp8_e4m3",
        RowDType::Fp8E4M3Block32 => "fp8_e4m3_block32",
        RowDType::F32 => "f32",
    }
}

/// Append the value of row `id` of table `d` with `payload` to `out`:
/// `MPLR`, u32 payload length, the 16 digest bytes, u64 id (little-endian),
/// the payload, and a CRC-32 (IEEE) of everything before it.
pub fn encode_value(d: &TableDigest, id: u64, payload: &[u8], out: &mut Vec<u8>) {
    let start = out.len();
    out.extend_from_slice(&VALUE_MAGIC);
    out.extend_from_slice(&(payload.len() as u32).to_le_bytes());
    out.extend_from_slice(&d.0);
    out.extend_from_slice(&id.to_le_bytes());
    out.extend_from_slice(payload);
    let crc = crc32fast::hash(&out[start..]);
    out.extend_from_slice(&crc.to_le_bytes());
}

/// What is wrong with a value or a manifest read from a server.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum FormatError {
    /// A value of the wrong total length.
    #[error("value of {got} bytes, expected {expected}")]
    Length {
        /// Bytes read.
        got: usize,
        /// Bytes a value of this table has.
        expected: usize,
    },
    /// A value without the `MPLR` magic.
    #[error("value does not start with MPLR")]
    Magic,
    /// A value whose payload length field disagrees with the table's.
    #[error("value says its payload is {got} bytes, the table's rows have {expected}")]
    Payload {
        /// The length field.
        got: u32,
        /// The table's payload bytes.
        expected: usize,
    },
    /// A value of another table.
    #[error("value belongs to table {got}, not {expected}")]
    Digest {
        /// The digest in the value.
        got: TableDigest,
        /// The table asked for.
        expected: TableDigest,
    },
    /// A value of another row.
    #[error("value holds row {got}, not {expected}")]
    Row {
        /// The id in the value.
        got: u64,
        /// The row asked for.
        expected: u64,
    },
    /// A value whose checksum does not match its bytes.
    #[error("value checksum {got:08x} does not match its bytes ({computed:08x})")]
    Checksum {
        /// The stored CRC-32.
        got: u32,
        /// The CRC-32 of the bytes.
        computed: u32,
    },
    /// A manifest that is not what [`Manifest::to_json`] writes.
    #[error("manifest: {0}")]
    Manifest(String),
}

/// The payload of a value, checked: `v` must be a whole value of row `id`
/// of table `d` with a payload of `payload` bytes and a matching CRC.
pub fn decode_value<'a>(
    v: &'a [u8],
    d: &TableDigest,
    id: u64,
    payload: usize,
) -> Result<&'a [u8], FormatError> {
    let expected = payload + VALUE_OVERHEAD;
    if v.len() != expected {
        return Err(FormatError::Length {
            got: v.len(),
            expected,
        });
    }
    if v[..4] != VALUE_MAGIC {
        return Err(FormatError::Magic);
    }
    let len = u32::from_le_bytes(v[4..8].try_into().expect("4 bytes"));
    if len as usize != payload {
        return Err(FormatError::Payload {
            got: len,
            expected: payload,
        });
    }
    let got = TableDigest(v[8..24].try_into().expect("16 bytes"));
    if got != *d {
        return Err(FormatError::Digest { got, expected: *d });
    }
    let row = u64::from_le_bytes(v[24..32].try_into().expect("8 bytes"));
    if row != id {
        return Err(FormatError::Row {
            got: row,
            expected: id,
        });
    }
    let body = expected - 4;
    let stored = u32::from_le_bytes(v[body..].try_into().expect("4 bytes"));
    let computed = crc32fast::hash(&v[..body]);
    if stored != computed {
        return Err(FormatError::Checksum {
            got: stored,
            computed,
        });
    }
    Ok(&v[VALUE_HEADER..body])
}

/// One server's record of a table's load: written by `table push` as it
/// goes (`complete: false`, `pushed_through` rising) and once more when the
/// server holds every row it should (`complete: true`, `rows_digest` set).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Manifest {
    /// The table.
    pub table: TableDigest,
    /// Rows of the table.
    pub rows: u64,
    /// Row type (a [`dtype_name`]).
    pub dtype: String,
    /// Values per row.
    pub head_dim: u64,
    /// Payload bytes of each value.
    pub payload: u64,
    /// Servers the table was sharded over.
    pub servers: u64,
    /// This server's place in that list.
    pub server: u64,
    /// Rows `0..pushed_through` have been pushed (this server holds its
    /// share of them).
    pub pushed_through: u64,
    /// Rows this server holds (of those pushed).
    pub rows_here: u64,
    /// SHA-256 (hex) of this server's values in id order; empty until
    /// complete.
    pub rows_digest: String,
    /// Whether the server holds every row the shard rule gives it.
    pub complete: bool,
}

impl Manifest {
    /// The manifest as one line of JSON.
    pub fn to_json(&self) -> String {
        serde_json::json!({
            "format": MANIFEST_FORMAT,
            "version": MANIFEST_VERSION,
            "table": self.table.hex(),
            "rows": self.rows,
            "dtype": self.dtype,
            "head_dim": self.head_dim,
            "payload": self.payload,
            "servers": self.servers,
            "server": self.server,
            "pushed_through": self.pushed_through,
            "rows_here": self.rows_here,
            "rows_digest": self.rows_digest,
            "complete": self.complete,
        })
        .to_string()
    }

    /// Parse a manifest read from a server; an error names the field that
    /// is missing or wrong.
    pub fn parse(bytes: &[u8]) -> Result<Manifest, FormatError> {
        let bad = |m: String| FormatError::Manifest(m);
        let v: serde_json::Value =
            serde_json::from_slice(bytes).map_err(|e| bad(format!("not JSON: {e}")))?;
        let o = v
            .as_object()
            .ok_or_else(|| bad("not a JSON object".into()))?;
        let text = |k: &str| -> Result<&str, FormatError> {
            o.get(k)
                .and_then(|x| x.as_str())
                .ok_or_else(|| bad(format!("field '{k}' missing or not a string")))
        };
        let num = |k: &str| -> Result<u64, FormatError> {
            o.get(k)
                .and_then(|x| x.as_u64())
                .ok_or_else(|| bad(format!("field '{k}' missing or not a whole number")))
        };
        if text("format")? != MANIFEST_FORMAT {
            return Err(bad(format!("format is not '{MANIFEST_FORMAT}'")));
        }
        let version = num("version")?;
        if version != MANIFEST_VERSION {
            return Err(bad(format!(
                "version {version}; this build reads version {MANIFEST_VERSION}"
            )));
        }
        let table = TableDigest::parse_hex(text("table")?)
            .ok_or_else(|| bad("field 'table' is not 32 hex digits".into()))?;
        let rows_digest = text("rows_digest")?.to_string();
        if !(rows_digest.is_empty()
            || rows_digest.len() == 64 && rows_digest.bytes().all(|b| b.is_ascii_hexdigit()))
        {
            return Err(bad(
                "field 'rows_digest' is neither empty nor 64 hex digits".into(),
            ));
        }
        let m = Manifest {
            table,
            rows: num("rows")?,
            dtype: text("dtype")?.to_string(),
            head_dim: num("head_dim")?,
            payload: num("payload")?,
            servers: num("servers")?,
            server: num("server")?,
            pushed_through: num("pushed_through")?,
            rows_here: num("rows_here")?,
            rows_digest,
            complete: o
                .get("complete")
                .and_then(|x| x.as_bool())
                .ok_or_else(|| bad("field 'complete' missing or not true/false".into()))?,
        };
        if m.servers == 0 || m.server >= m.servers {
            return Err(bad(format!(
                "server {} of {} is not a place in the list",
                m.server, m.servers
            )));
        }
        if m.pushed_through > m.rows || m.rows_here > m.pushed_through {
            return Err(bad(format!(
                "{} rows held and {} pushed of {} rows do not add up",
                m.rows_here, m.pushed_through, m.rows
            )));
        }
        if m.complete && (m.pushed_through != m.rows || m.rows_digest.is_empty()) {
            return Err(bad(
                "complete, but not every row pushed or no rows digest".into()
            ));
        }
        Ok(m)
    }
}

/// Reads rows' payloads from a table's shard files with plain positional
/// reads (the page cache is fine here: `table push` streams the table once,
/// and the digest samples a few rows).
pub struct LocalRows<'a> {
    files: &'a TableFiles,
    fds: Vec<std::fs::File>,
    payload: usize,
}

impl<'a> LocalRows<'a> {
    /// Open every shard of `files` for reading.
    pub fn open(files: &'a TableFiles) -> Result<LocalRows<'a>> {
        let fds = files
            .shards
            .iter()
            .map(|s| {
                std::fs::File::open(&s.path).map_err(|e| StorageError::io(&s.path, "opening", e))
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(LocalRows {
            files,
            fds,
            payload: payload_bytes(&files.info),
        })
    }

    /// Bytes of one row's payload.
    pub fn payload(&self) -> usize {
        self.payload
    }

    /// The payloads of rows `first..first + n` (all of one shard or not),
    /// back to back, into `out` (cleared first).
    pub fn read(&self, first: u64, n: u64, out: &mut Vec<u8>) -> Result<()> {
        out.clear();
        out.reserve(n as usize * self.payload);
        let rb = self.files.info.row_bytes();
        let mut id = first;
        let end = first + n;
        let mut span = Vec::new();
        while id < end {
            let loc = self.files.locate(id)?;
            let in_shard = self.files.rows_per_shard - id % self.files.rows_per_shard;
            let k = in_shard.min(end - id);
            let path = &self.files.shards[loc.shard].path;
            let fd = &self.fds[loc.shard];
            let stride = self.files.row_stride as usize;
            let len = (k as usize - 1) * stride + rb;
            span.resize(len, 0);
            fd.read_exact_at(&mut span, loc.offset).map_err(|e| {
                StorageError::io_at(
                    path,
                    loc.offset,
                    format!("reading rows {id}..{}", id + k),
                    e,
                )
            })?;
            let mut scales = Vec::new();
            if let Some(so) = loc.scale_offset {
                scales.resize(k as usize * 4, 0);
                fd.read_exact_at(&mut scales, so).map_err(|e| {
                    StorageError::io_at(path, so, format!("reading the scales of rows {id}.."), e)
                })?;
            }
            for r in 0..k as usize {
                out.extend_from_slice(&span[r * stride..r * stride + rb]);
                if !scales.is_empty() {
                    out.extend_from_slice(&scales[r * 4..r * 4 + 4]);
                }
            }
            id += k;
        }
        Ok(())
    }
}

/// The digest of the table stored in `files`: SHA-256 over
/// `"metrale-ple remote table v1\0"`, the row type's name, the rows, values
/// per row and payload bytes (u64 little-endian each), then, for row 0, row
/// `rows - 1` and rows `splitmix64(k) % rows` for `k` in
/// `1..=DIGEST_SAMPLES`, the id (u64) and the row's payload; the first 16
/// bytes. Reads [`DIGEST_SAMPLES`] + 2 rows, so opening a remote table
/// costs a few reads, and two tables that differ in their shape or in any
/// sampled row have different digests (and so different keys).
pub fn table_digest(files: &TableFiles) -> Result<TableDigest> {
    let rows = files.info.rows;
    if rows == 0 {
        return Err(StorageError::invalid("a table of no rows has no digest"));
    }
    let local = LocalRows::open(files)?;
    let mut h = Sha256::new();
    h.update(b"metrale-ple remote table v1\0");
    h.update(dtype_name(files.info.dtype).as_bytes());
    h.update(&[0]);
    for v in [rows, files.info.head_dim as u64, local.payload() as u64] {
        h.update(&v.to_le_bytes());
    }
    let mut ids = vec![0, rows - 1];
    ids.extend((1..=DIGEST_SAMPLES).map(|k| splitmix64(k) % rows));
    let mut buf = Vec::new();
    for id in ids {
        local.read(id, 1, &mut buf)?;
        h.update(&id.to_le_bytes());
        h.update(&buf);
    }
    let full = h.finish();
    Ok(TableDigest(full[..16].try_into().expect("16 bytes")))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn d(b: u8) -> TableDigest {
        TableDigest([b; 16])
    }

    #[test]
    fn values_round_trip_and_refuse_what_is_not_theirs() {
        let payload: Vec<u8> = (0..40u8).collect();
        let mut v = Vec::new();
        encode_value(&d(1), 77, &payload, &mut v);
        assert_eq!(v.len(), payload.len() + VALUE_OVERHEAD);
        assert_eq!(decode_value(&v, &d(1), 77, 40).unwrap(), &payload[..]);
        assert!(matches!(
            decode_value(&v, &d(2), 77, 40),
            Err(FormatError::Digest { .. })
        ));
        assert_eq!(
            decode_value(&v, &d(1), 78, 40),
            Err(FormatError::Row {
                got: 77,
                expected: 78
            })
        );
        assert!(matches!(
            decode_value(&v, &d(1), 77, 39),
            Err(FormatError::Length { .. })
        ));
        assert!(matches!(
            decode_value(&v[..v.len() - 1], &d(1), 77, 40),
            Err(FormatError::Length { .. })
        ));
        for at in [0, 5, 30, 40, v.len() - 1] {
            let mut bad = v.clone();
            bad[at] ^= 1;
            assert!(decode_value(&bad, &d(1), 77, 40).is_err(), "flip at {at}");
        }
    }

    #[test]
    fn keys_and_the_shard_rule_are_fixed() {
        let t = TableDigest::parse_hex("000102030405060708090a0b0c0d0e0f").unwrap();
        assert_eq!(t.hex(), "000102030405060708090a0b0c0d0e0f");
        assert_eq!(row_key(&t, 255), "mple:000102030405060708090a0b0c0d0e0f:ff");
        assert_eq!(
            manifest_key(&t),
            "mple:000102030405060708090a0b0c0d0e0f:manifest"
        );
        assert!(TableDigest::parse_hex("00").is_none());
        assert!(TableDigest::parse_hex(&"g".repeat(32)).is_none());
        // splitmix64's published first output for seed 0.
        assert_eq!(splitmix64(0), 0xE220_A839_7B1D_CDAF);
        // Every server gets about its share.
        let mut n = [0usize; 3];
        for id in 0..30_000 {
            n[server_of(&t, id, 3)] += 1;
        }
        assert!(n.iter().all(|&c| (9_000..11_000).contains(&c)), "{n:?}");
        assert!((0..1000).all(|id| server_of(&t, id, 1) == 0));
    }

    #[test]
    fn manifests_round_trip_and_refuse_nonsense() {
        let m = Manifest {
            table: d(7),
            rows: 100,
            dtype: "bf16".into(),
            head_dim: 16,
            payload: 32,
            servers: 3,
            server: 2,
            pushed_through: 100,
            rows_here: 31,
            rows_digest: "ab".repeat(32),
            complete: true,
        };
        assert_eq!(Manifest::parse(m.to_json().as_bytes()).unwrap(), m);
        let bad = |f: &dyn Fn(&mut serde_json::Value)| {
            let mut v: serde_json::Value = serde_json::from_str(&m.to_json()).unwrap();
            f(&mut v);
            Manifest::parse(v.to_string().as_bytes())
                .unwrap_err()
                .to_string()
        };
        assert!(bad(&|v| v["server"] = 3.into()).contains("server 3 of 3"));
        assert!(bad(&|v| v["version"] = 2.into()).contains("version 2"));
        assert!(bad(&|v| v["pushed_through"] = 99.into()).contains("complete"));
        assert!(bad(&|v| v["table"] = "xy".into()).contains("'table'"));
        assert!(bad(&|v| v["rows_here"] = 101.into()).contains("add up"));
        assert!(Manifest::parse(b"\xff{").is_err());
    }
}
