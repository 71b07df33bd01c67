//! A safetensors reader that parses only the header, and a streaming writer.
//!
//! File layout: an 8-byte little-endian header length `n`, `n` bytes of
//! JSON (`{"name": {"dtype", "shape", "data_offsets": [begin, end]}, ...,
//! "__metadata__": {str: str}}`, which may be padded with trailing spaces),
//! then the data section; `data_offsets` are relative to its start.
//!
//! Invariants:
//! - opening a file reads its first `8 + n` bytes and nothing else, so a
//!   100 GB shard opens in microseconds;
//! - every [`TensorInfo`] returned has been checked: known dtype, shape
//!   whose byte size equals its extent, extent inside the file, no two
//!   extents overlapping; errors name the file, the tensor and the field;
//! - [`TensorInfo::offset`] is absolute (from the start of the file);
//! - the writer emits a header padded with spaces so that the data section
//!   starts on the requested alignment, and refuses to finish a file whose
//!   data does not match the declared tensors; the file appears at its path
//!   only once complete (written beside it, synced, renamed).

use std::collections::{BTreeMap, HashMap};
use std::fs::File;
use std::io::{BufWriter, Read, Write};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use crate::error::{IoContext, Result, StorageError};

/// A malformed-header error of `path`, about `tensor`'s `field`.
fn bad(
    path: &Path,
    tensor: Option<&str>,
    field: Option<&str>,
    message: impl Into<String>,
) -> StorageError {
    StorageError::Header {
        path: path.to_path_buf(),
        tensor: tensor.map(str::to_string),
        field: field.map(str::to_string),
        message: message.into(),
    }
}

/// Largest header accepted (the format's own limit).
pub const MAX_HEADER_BYTES: u64 = 100 * 1024 * 1024;

/// A safetensors element type.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[allow(missing_docs)]
pub enum Dtype {
    Bool,
    U8,
    I8,
    F8E4M3,
    F8E5M2,
    /// `F8_E8M0`: an unsigned power-of-two exponent (UE8M0), the value
    /// `2^(e - 127)`; 255 is NaN. One byte; what DeepSeek's releases store
    /// FP8 block scales as. The reader checks sizes only: a caller that
    /// decodes scales refuses the NaN code itself, naming tensor and index.
    F8E8M0,
    I16,
    U16,
    F16,
    BF16,
    I32,
    U32,
    F32,
    F64,
    I64,
    U64,
}

impl Dtype {
    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            Dtype::Bool | Dtype::U8 | Dtype::I8 | Dtype::F8E4M3 | Dtype::F8E5M2 | Dtype::F8E8M0 => {
                1
            }
            Dtype::I16 | Dtype::U16 | Dtype::F16 | Dtype::BF16 => 2,
            Dtype::I32 | Dtype::U32 | Dtype::F32 => 4,
            Dtype::F64 | Dtype::I64 | Dtype::U64 => 8,
        }
    }

    /// The name used in headers.
    pub fn name(self) -> &'static str {
        match self {
            Dtype::Bool => "BOOL",
            Dtype::U8 => "U8",
            Dtype::I8 => "I8",
            Dtype::F8E4M3 => "F8_E4M3",
            Dtype::F8E5M2 => "F8_E5M2",
            Dtype::F8E8M0 => "F8_E8M0",
            Dtype::I16 => "I16",
            Dtype::U16 => "U16",
            Dtype::F16 => "F16",
            Dtype::BF16 => "BF16",
            Dtype::I32 => "I32",
            Dtype::U32 => "U32",
            Dtype::F32 => "F32",
            Dtype::F64 => "F64",
            Dtype::I64 => "I64",
            Dtype::U64 => "U64",
        }
    }

    /// Parse a header dtype name.
    pub fn parse(s: &str) -> Option<Dtype> {
        Some(match s {
            "BOOL" => Dtype::Bool,
            "U8" => Dtype::U8,
            "I8" => Dtype::I8,
            "F8_E4M3" => Dtype::F8E4M3,
            "F8_E5M2" => Dtype::F8E5M2,
            "F8_E8M0" => Dtype::F8E8M0,
            "I16" => Dtype::I16,
            "U16" => Dtype::U16,
            "F16" => Dtype::F16,
            "BF16" => Dtype::BF16,
            "I32" => Dtype::I32,
            "U32" => Dtype::U32,
            "F32" => Dtype::F32,
            "F64" => Dtype::F64,
            "I64" => Dtype::I64,
            "U64" => Dtype::U64,
            _ => return None,
        })
    }
}

/// One tensor of a file, checked against the file.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TensorInfo {
    /// Its name in the header.
    pub name: String,
    /// Element type.
    pub dtype: Dtype,
    /// Dimensions.
    pub shape: Vec<u64>,
    /// Absolute file offset of its first byte.
    pub offset: u64,
    /// Bytes of data.
    pub len: u64,
}

impl TensorInfo {
    /// Number of elements.
    pub fn numel(&self) -> u64 {
        self.shape.iter().product()
    }
}

/// The parsed header of one safetensors file.
#[derive(Clone, Debug)]
pub struct Header {
    /// The file it came from.
    pub path: PathBuf,
    /// Bytes of header JSON (including padding).
    pub header_len: u64,
    /// Absolute offset of the data section.
    pub data_start: u64,
    /// The file's length when it was opened.
    pub file_len: u64,
    /// Tensors in ascending offset order.
    pub tensors: Vec<TensorInfo>,
    /// The `__metadata__` map (empty when absent).
    pub metadata: BTreeMap<String, String>,
    index: HashMap<String, usize>,
}

impl Header {
    /// Read and check the header of `path`, reading nothing past it.
    pub fn read(path: impl AsRef<Path>) -> Result<Header> {
        let path = path.as_ref();
        let mut f = File::open(path).io_ctx(path, || "opening safetensors file")?;
        let file_len = f.metadata().io_ctx(path, || "reading the file size")?.len();
        if file_len < 8 {
            return Err(StorageError::Truncated {
                path: path.to_path_buf(),
                what: "a safetensors header length".into(),
                offset: 0,
                needed: 8,
                got: file_len,
            });
        }
        let mut len8 = [0u8; 8];
        f.read_exact(&mut len8)
            .io_ctx_at(path, 0, || "reading the header length")?;
        let n = u64::from_le_bytes(len8);
        if n > MAX_HEADER_BYTES {
            return Err(bad(
                path,
                None,
                None,
                format!("header length {n} exceeds the {MAX_HEADER_BYTES}-byte limit"),
            ));
        }
        if 8 + n > file_len {
            return Err(StorageError::Truncated {
                path: path.to_path_buf(),
                what: format!("a header of length {n}"),
                offset: 8,
                needed: n,
                got: file_len - 8,
            });
        }
        let mut json = vec![0u8; n as usize];
        f.read_exact(&mut json)
            .io_ctx_at(path, 8, || format!("reading the {n}-byte header"))?;
        Self::parse(path, &json, file_len)
    }

    /// Check the header JSON `json` of a file of `file_len` bytes.
    pub fn parse(path: &Path, json: &[u8], file_len: u64) -> Result<Header> {
        let header_len = json.len() as u64;
        let data_start = 8 + header_len;
        if data_start > file_len {
            return Err(StorageError::Truncated {
                path: path.to_path_buf(),
                what: "the header".into(),
                offset: 8,
                needed: header_len,
                got: file_len.saturating_sub(8),
            });
        }
        let data_len = file_len - data_start;
        if json.first() != Some(&b'{') {
            return Err(bad(path, None, None, "header does not start with '{'"));
        }
        let text = std::str::from_utf8(json)
            .map_err(|e| bad(path, None, None, format!("header is not UTF-8: {e}")))?;
        let value: serde_json::Value = serde_json::from_str(text)
            .map_err(|e| bad(path, None, None, format!("header is not valid JSON: {e}")))?;
        let obj = value
            .as_object()
            .ok_or_else(|| bad(path, None, None, "header is not a JSON object"))?;
        let mut tensors = Vec::with_capacity(obj.len());
        let mut metadata = BTreeMap::new();
        for (name, v) in obj {
            if name == "__metadata__" {
                let m = v
                    .as_object()
                    .ok_or_else(|| bad(path, None, None, "__metadata__ is not an object"))?;
                for (k, mv) in m {
                    let s = mv.as_str().ok_or_else(|| {
                        bad(
                            path,
                            None,
                            None,
                            format!("__metadata__ entry '{k}' is not a string"),
                        )
                    })?;
                    metadata.insert(k.clone(), s.to_string());
                }
                continue;
            }
            let t = v
                .as_object()
                .ok_or_else(|| bad(path, Some(name), None, "the entry is not an object"))?;
            let field = |f: &str, m: String| bad(path, Some(name), Some(f), m);
            let dtype_s = t
                .get("dtype")
                .and_then(|d| d.as_str())
                .ok_or_else(|| field("dtype", "missing or not a string".into()))?;
            let dtype = Dtype::parse(dtype_s)
                .ok_or_else(|| field("dtype", format!("unknown dtype '{dtype_s}'")))?;
            let shape_v = t
                .get("shape")
                .and_then(|s| s.as_array())
                .ok_or_else(|| field("shape", "missing or not an array".into()))?;
            let mut shape = Vec::with_capacity(shape_v.len());
            for (i, d) in shape_v.iter().enumerate() {
                let d = d.as_u64().ok_or_else(|| {
                    field(&format!("shape[{i}]"), "not a non-negative integer".into())
                })?;
                shape.push(d);
            }
            let offs = t
                .get("data_offsets")
                .and_then(|s| s.as_array())
                .filter(|a| a.len() == 2)
                .ok_or_else(|| field("data_offsets", "not a [begin, end] pair".into()))?;
            let (Some(begin), Some(end)) = (offs[0].as_u64(), offs[1].as_u64()) else {
                return Err(field("data_offsets", "holds a non-integer".into()));
            };
            if begin > end {
                return Err(field("data_offsets", format!("begin {begin} > end {end}")));
            }
            if end > data_len {
                return Err(field(
                    "data_offsets",
                    format!(
                        "end {end} runs past the data section ({data_len} bytes; file truncated?)"
                    ),
                ));
            }
            let bytes = shape
                .iter()
                .try_fold(dtype.size() as u64, |acc, &d| acc.checked_mul(d))
                .ok_or_else(|| field("shape", format!("{shape:?} overflows")))?;
            if bytes != end - begin {
                return Err(field(
                    "shape",
                    format!(
                        "shape {shape:?} of {} needs {bytes} bytes but data_offsets span {}",
                        dtype.name(),
                        end - begin
                    ),
                ));
            }
            tensors.push(TensorInfo {
                name: name.clone(),
                dtype,
                shape,
                offset: data_start + begin,
                len: bytes,
            });
        }
        tensors.sort_by_key(|t| (t.offset, t.len));
        for w in tensors.windows(2) {
            if w[0].offset + w[0].len > w[1].offset {
                return Err(bad(
                    path,
                    None,
                    None,
                    format!(
                        "tensors '{}' and '{}' overlap in the data section",
                        w[0].name, w[1].name
                    ),
                ));
            }
        }
        let index = tensors
            .iter()
            .enumerate()
            .map(|(i, t)| (t.name.clone(), i))
            .collect();
        Ok(Header {
            path: path.to_path_buf(),
            header_len,
            data_start,
            file_len,
            tensors,
            metadata,
            index,
        })
    }

    /// The tensor called `name`, if present.
    pub fn tensor(&self, name: &str) -> Option<&TensorInfo> {
        self.index.get(name).map(|&i| &self.tensors[i])
    }

    /// The tensor called `name`, or an error naming the file and tensor.
    pub fn get(&self, name: &str) -> Result<&TensorInfo> {
        self.tensor(name).ok_or_else(|| StorageError::NoTensor {
            path: self.path.clone(),
            name: name.to_string(),
        })
    }

    /// Read the bytes of tensor `name` (positional read of its extent only).
    pub fn read_tensor(&self, name: &str) -> Result<Vec<u8>> {
        let t = self.get(name)?;
        let f = File::open(&self.path).io_ctx(&self.path, || "opening")?;
        let mut buf = vec![0u8; t.len as usize];
        f.read_exact_at(&mut buf, t.offset)
            .io_ctx_at(&self.path, t.offset, || {
                format!(
                    "reading tensor '{name}' ({} bytes at offset {})",
                    t.len, t.offset
                )
            })?;
        Ok(buf)
    }
}

/// A tensor to be written: name, dtype and shape.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TensorSpec {
    /// Its name.
    pub name: String,
    /// Element type.
    pub dtype: Dtype,
    /// Dimensions.
    pub shape: Vec<u64>,
}

impl TensorSpec {
    /// A spec from its parts.
    pub fn new(name: impl Into<String>, dtype: Dtype, shape: &[u64]) -> Self {
        TensorSpec {
            name: name.into(),
            dtype,
            shape: shape.to_vec(),
        }
    }

    /// Bytes of data.
    pub fn bytes(&self) -> Result<u64> {
        self.shape
            .iter()
            .try_fold(self.dtype.size() as u64, |acc, &d| acc.checked_mul(d))
            .ok_or_else(|| {
                StorageError::invalid(format!(
                    "tensor '{}': shape {:?} overflows",
                    self.name, self.shape
                ))
            })
    }
}

/// Strings, string maps and integer lists always serialise.
const JSON_OK: &str = "strings, string maps and u64 lists serialise to JSON";

/// Build a header (length prefix included) for tensors laid out at the given
/// relative `(begin, end)` offsets, padded with spaces so that the data
/// section starts at a multiple of `align` (at least 8).
pub fn encode_header(
    entries: &[(TensorSpec, (u64, u64))],
    metadata: &BTreeMap<String, String>,
    align: u64,
) -> Result<Vec<u8>> {
    if !align.is_power_of_two() {
        return Err(StorageError::invalid(format!(
            "header alignment {align} is not a power of two"
        )));
    }
    let align = align.max(8);
    let mut json = String::from("{");
    let mut first = true;
    if !metadata.is_empty() {
        json.push_str("\"__metadata__\":");
        json.push_str(&serde_json::to_string(metadata).expect(JSON_OK));
        first = false;
    }
    let mut seen = std::collections::HashSet::new();
    for (spec, (b, e)) in entries {
        if spec.name == "__metadata__" {
            return Err(StorageError::invalid(
                "a tensor cannot be named '__metadata__'",
            ));
        }
        if !seen.insert(spec.name.as_str()) {
            return Err(StorageError::invalid(format!(
                "tensor '{}' is listed twice",
                spec.name
            )));
        }
        if !first {
            json.push(',');
        }
        first = false;
        json.push_str(&serde_json::to_string(&spec.name).expect(JSON_OK));
        json.push_str(&format!(
            ":{{\"dtype\":\"{}\",\"shape\":{},\"data_offsets\":[{b},{e}]}}",
            spec.dtype.name(),
            serde_json::to_string(&spec.shape).expect(JSON_OK)
        ));
    }
    json.push('}');
    let mut n = json.len() as u64;
    let rem = (8 + n) % align;
    if rem != 0 {
        n += align - rem;
    }
    let mut out = Vec::with_capacity(8 + n as usize);
    out.extend_from_slice(&n.to_le_bytes());
    out.extend_from_slice(json.as_bytes());
    out.resize(8 + n as usize, b' ');
    Ok(out)
}

/// Streams tensors into a new safetensors file, in the order declared.
///
/// The bytes go to `<path>.partial`, renamed to `path` by [`Writer::finish`]
/// once complete and synced; a writer dropped unfinished (or failing to
/// finish) removes the partial file, so `path` only ever appears whole.
pub struct Writer {
    path: PathBuf,
    tmp: PathBuf,
    out: Option<BufWriter<File>>,
    total: u64,
    written: u64,
}

impl Writer {
    /// Create `path` for `specs` (data laid out back to back in this order),
    /// with the data section aligned to `align` bytes.
    pub fn create(
        path: impl AsRef<Path>,
        specs: &[TensorSpec],
        metadata: &BTreeMap<String, String>,
        align: u64,
    ) -> Result<Writer> {
        let path = path.as_ref().to_path_buf();
        let mut entries = Vec::with_capacity(specs.len());
        let mut at = 0u64;
        for s in specs {
            let b = s.bytes()?;
            entries.push((s.clone(), (at, at + b)));
            at += b;
        }
        let header = encode_header(&entries, metadata, align)?;
        let mut name = path
            .file_name()
            .map(|n| n.to_os_string())
            .unwrap_or_default();
        name.push(".partial");
        let tmp = path.with_file_name(name);
        let f = File::create(&tmp).io_ctx(&tmp, || "creating")?;
        let mut w = Writer {
            path,
            tmp,
            out: Some(BufWriter::with_capacity(1 << 20, f)),
            total: at,
            written: 0,
        };
        let out = w.out.as_mut().expect("just created");
        out.write_all(&header)
            .io_ctx_at(&w.tmp, 0, || "writing the header")?;
        Ok(w)
    }

    /// Append data bytes (tensors in declared order, back to back).
    pub fn write(&mut self, bytes: &[u8]) -> Result<()> {
        if self.written + bytes.len() as u64 > self.total {
            return Err(self.refuse(format!(
                "writing {} more bytes would exceed the declared {} bytes of tensor data",
                bytes.len(),
                self.total
            )));
        }
        let Some(out) = self.out.as_mut() else {
            return Err(self.refuse("writer already finished".into()));
        };
        out.write_all(bytes)
            .io_ctx(&self.tmp, || format!("writing {} bytes", bytes.len()))?;
        self.written += bytes.len() as u64;
        Ok(())
    }

    /// Check that every declared byte was written, flush, sync and move the
    /// file into place.
    pub fn finish(mut self) -> Result<()> {
        if self.written != self.total {
            return Err(self.refuse(format!(
                "only {} of the declared {} bytes of tensor data were written",
                self.written, self.total
            )));
        }
        let Some(out) = self.out.take() else {
            return Err(self.refuse("writer already finished".into()));
        };
        let f = out
            .into_inner()
            .map_err(|e| e.into_error())
            .io_ctx(&self.tmp, || "flushing")?;
        f.sync_all().io_ctx(&self.tmp, || "syncing")?;
        std::fs::rename(&self.tmp, &self.path)
            .io_ctx(&self.tmp, || format!("renaming to {}", self.path.display()))?;
        Ok(())
    }

    fn refuse(&self, message: String) -> StorageError {
        StorageError::Write {
            path: self.path.clone(),
            message,
        }
    }
}

impl Drop for Writer {
    fn drop(&mut self) {
        // Unfinished or failed: never leave a partial file behind.
        if self.tmp.exists() {
            let _ = std::fs::remove_file(&self.tmp);
        }
    }
}

/// Write a whole file from in-memory tensors (tests and small files).
pub fn write_file(
    path: impl AsRef<Path>,
    tensors: &[(TensorSpec, &[u8])],
    align: u64,
) -> Result<()> {
    let specs: Vec<TensorSpec> = tensors.iter().map(|(s, _)| s.clone()).collect();
    let mut w = Writer::create(path, &specs, &BTreeMap::new(), align)?;
    for (s, data) in tensors {
        if data.len() as u64 != s.bytes()? {
            return Err(StorageError::invalid(format!(
                "tensor '{}': {} bytes given, shape needs {}",
                s.name,
                data.len(),
                s.bytes()?
            )));
        }
        w.write(data)?;
    }
    w.finish()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tmp() -> tempfile::TempDir {
        tempfile::tempdir().unwrap()
    }

    #[test]
    fn writes_and_reads_back() {
        let d = tmp();
        let p = d.path().join("a.safetensors");
        let a: Vec<u8> = (0..24u8).collect();
        let b: Vec<u8> = vec![7; 6];
        write_file(
            &p,
            &[
                (TensorSpec::new("x.weight", Dtype::BF16, &[3, 4]), &a),
                (TensorSpec::new("y", Dtype::U8, &[6]), &b),
            ],
            4096,
        )
        .unwrap();
        let h = Header::read(&p).unwrap();
        assert_eq!(h.data_start % 4096, 0);
        let x = h.get("x.weight").unwrap();
        assert_eq!(x.dtype, Dtype::BF16);
        assert_eq!(x.shape, vec![3, 4]);
        assert_eq!(x.offset, h.data_start);
        assert_eq!(h.read_tensor("x.weight").unwrap(), a);
        assert_eq!(h.read_tensor("y").unwrap(), b);
        let err = h.get("z").unwrap_err().to_string();
        assert!(
            err.contains("a.safetensors") && err.contains("'z'"),
            "{err}"
        );
    }

    fn write_raw(path: &Path, json: &str, data: usize) {
        let mut v = (json.len() as u64).to_le_bytes().to_vec();
        v.extend_from_slice(json.as_bytes());
        v.resize(v.len() + data, 0);
        std::fs::write(path, v).unwrap();
    }

    #[test]
    fn bad_headers_name_file_tensor_and_field() {
        let d = tmp();
        let p = d.path().join("bad.safetensors");
        let cases = [
            (
                r#"{"t":{"dtype":"Q9","shape":[2],"data_offsets":[0,2]}}"#,
                2,
                "field 'dtype'",
            ),
            (
                r#"{"t":{"dtype":"U8","shape":[3],"data_offsets":[0,2]}}"#,
                2,
                "shape [3]",
            ),
            (
                r#"{"t":{"dtype":"U8","shape":[2],"data_offsets":[0,2]}}"#,
                1,
                "runs past the data section",
            ),
            (
                r#"{"t":{"dtype":"U8","shape":[-1],"data_offsets":[0,2]}}"#,
                2,
                "field 'shape[0]'",
            ),
            (
                r#"{"t":{"dtype":"U8","shape":[2]}}"#,
                2,
                "field 'data_offsets'",
            ),
            (
                r#"{"t":{"dtype":"U8","shape":[2],"data_offsets":[2,0]}}"#,
                2,
                "begin 2 > end 0",
            ),
            (
                r#"{"t":{"dtype":"U8","shape":[2],"data_offsets":[0,2]},"u":{"dtype":"U8","shape":[2],"data_offsets":[1,3]}}"#,
                3,
                "overlap",
            ),
            (
                r#"{"t":{"dtype":"U8","shape":[2],"data_offsets":[0,2]}"#,
                2,
                "not valid JSON",
            ),
            (r#"[1]"#, 0, "does not start"),
        ];
        for (json, data, want) in cases {
            write_raw(&p, json, data);
            let err = format!("{:#}", Header::read(&p).unwrap_err());
            assert!(err.contains("bad.safetensors"), "{err}");
            assert!(err.contains(want), "want '{want}' in: {err}");
            if json.starts_with("{\"t\"") && !want.contains("JSON") && !want.contains("overlap") {
                assert!(
                    matches!(Header::read(&p).unwrap_err(), StorageError::Header { tensor: Some(t), .. } if t == "t"),
                    "{err}"
                );
                assert!(err.contains("tensor 't'"), "{err}");
            }
        }
        // Header length past the end of the file.
        let mut v = 1000u64.to_le_bytes().to_vec();
        v.extend_from_slice(b"{}");
        std::fs::write(&p, v).unwrap();
        let e = Header::read(&p).unwrap_err();
        assert!(
            matches!(e, StorageError::Truncated { needed: 1000, .. })
                && e.to_string().contains("truncated"),
            "{e}"
        );
        std::fs::write(&p, [1u8, 2]).unwrap();
        let e = Header::read(&p).unwrap_err();
        assert!(matches!(e, StorageError::Truncated { got: 2, .. }), "{e}");
    }

    #[test]
    fn writer_refuses_wrong_amounts() {
        let d = tmp();
        let p = d.path().join("w.safetensors");
        let mut w = Writer::create(
            &p,
            &[TensorSpec::new("t", Dtype::F32, &[2])],
            &BTreeMap::new(),
            8,
        )
        .unwrap();
        w.write(&[0; 4]).unwrap();
        assert!(w.write(&[0; 8]).is_err());
        assert!(
            w.finish()
                .unwrap_err()
                .to_string()
                .contains("only 4 of the declared 8")
        );
        let dup = [
            TensorSpec::new("t", Dtype::U8, &[1]),
            TensorSpec::new("t", Dtype::U8, &[1]),
        ];
        assert!(Writer::create(&p, &dup, &BTreeMap::new(), 8).is_err());
    }

    #[test]
    fn f8_e8m0_is_one_byte_and_round_trips() {
        let d = tmp();
        let p = d.path().join("s.safetensors");
        assert_eq!(Dtype::parse("F8_E8M0"), Some(Dtype::F8E8M0));
        assert_eq!(Dtype::F8E8M0.name(), "F8_E8M0");
        assert_eq!(Dtype::F8E8M0.size(), 1);
        let scales: Vec<u8> = vec![127, 126, 0, 254, 255, 130];
        write_file(
            &p,
            &[(
                TensorSpec::new("embed.scale", Dtype::F8E8M0, &[3, 2]),
                &scales,
            )],
            8,
        )
        .unwrap();
        let h = Header::read(&p).unwrap();
        let t = h.get("embed.scale").unwrap();
        assert_eq!(
            (t.dtype, t.shape.as_slice(), t.len),
            (Dtype::F8E8M0, &[3u64, 2][..], 6)
        );
        // The reader moves bytes; the NaN code is the decoder's to refuse.
        assert_eq!(h.read_tensor("embed.scale").unwrap(), scales);
        write_raw(
            &p,
            r#"{"s":{"dtype":"F8_E8M0","shape":[2,8],"data_offsets":[0,15]}}"#,
            15,
        );
        let e = format!("{:#}", Header::read(&p).unwrap_err());
        assert!(
            e.contains("tensor 's'") && e.contains("needs 16 bytes"),
            "{e}"
        );
    }

    #[test]
    fn metadata_round_trips() {
        let d = tmp();
        let p = d.path().join("m.safetensors");
        let mut md = BTreeMap::new();
        md.insert("format".to_string(), "pt".to_string());
        let mut w = Writer::create(&p, &[TensorSpec::new("t", Dtype::U8, &[1])], &md, 8).unwrap();
        w.write(&[9]).unwrap();
        w.finish().unwrap();
        let h = Header::read(&p).unwrap();
        assert_eq!(h.metadata, md);
        assert_eq!(h.data_start % 8, 0);
    }
}
