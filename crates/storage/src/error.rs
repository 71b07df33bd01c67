//! The typed error of the table crate.
//!
//! Callers match a [`StorageError`] variant (a row id out of range, a batch
//! over the resolve limit, no free slot, a truncated shard, a malformed
//! header, an I/O failure, a device error, ...), never message text. Every
//! variant formats to a message naming what the current operation touched:
//! the file, offset, row, shard, tensor or header field.
//!
//! Invariant: an error that wraps another (an [`std::io::Error`], a
//! [`GpuError`]) prints it in its own message and keeps it as a `cause`
//! field rather than as `source()`, so a chain formatted with `{:#}` does
//! not repeat it.

use std::fmt;
use std::io;
use std::path::PathBuf;
use std::time::Duration;

use metrale_gpu_runtime::GpuError;

/// `Result` with [`StorageError`] as the default error.
pub type Result<T, E = StorageError> = std::result::Result<T, E>;

/// What went wrong reading, serving or writing table rows.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum StorageError {
    /// An operating-system I/O call failed.
    #[error("{}: {action}: {cause}", .path.display())]
    Io {
        /// The file.
        path: PathBuf,
        /// What was being done (`reading 4096 bytes at offset 8192`).
        action: String,
        /// The offset read or written, when there was one.
        offset: Option<u64>,
        /// The OS error.
        cause: io::Error,
    },
    /// A file shorter than its header or layout says.
    #[error(
        "{}: {what} needs {needed} bytes at offset {offset} but only {got} are there (file truncated?)",
        .path.display()
    )]
    Truncated {
        /// The file.
        path: PathBuf,
        /// What needed the bytes (`shard 2`, `row 17`).
        what: String,
        /// Absolute offset of the bytes.
        offset: u64,
        /// Bytes needed there.
        needed: u64,
        /// Bytes actually available there.
        got: u64,
    },
    /// A safetensors header that breaks the format.
    #[error("{}: {}{message}", .path.display(), where_in_header(.tensor, .field))]
    Header {
        /// The file.
        path: PathBuf,
        /// The tensor whose entry is wrong, if one is.
        tensor: Option<String>,
        /// The entry's field that is wrong (`dtype`, `shape[0]`,
        /// `data_offsets`), if one is.
        field: Option<String>,
        /// What is wrong.
        message: String,
    },
    /// A tensor the file does not have.
    #[error("{}: no tensor named '{name}'", .path.display())]
    NoTensor {
        /// The file.
        path: PathBuf,
        /// The tensor asked for.
        name: String,
    },
    /// A set of shard files that does not form one table.
    #[error("{message}")]
    Layout {
        /// The file at fault, if one is.
        path: Option<PathBuf>,
        /// The shard at fault, if one is.
        shard: Option<usize>,
        /// What is wrong, naming file, shard and tensor.
        message: String,
    },
    /// A row id at or past the end of the table.
    #[error("row id {id} is past the end of the table ({rows} rows)")]
    RowOutOfRange {
        /// The id.
        id: u64,
        /// Rows in the table.
        rows: u64,
    },
    /// `resolve` with an output slice of the wrong length.
    #[error("resolve: {ids} ids but {out} output slots")]
    OutputLength {
        /// Ids given.
        ids: usize,
        /// Output slots given.
        out: usize,
    },
    /// A resolve with more distinct ids than the table pins at once; split
    /// the batch with [`crate::parts::resolve_in_parts`].
    #[error(
        "a resolve of {distinct} distinct row ids exceeds this table's limit of {limit} per resolve; split the batch (resolve_in_parts)"
    )]
    BatchTooLarge {
        /// Distinct ids in the batch.
        distinct: usize,
        /// The table's `max_resolve`.
        limit: usize,
    },
    /// Every slot of the row cache stayed pinned for the whole wait.
    #[error(
        "no free slot after {waited:?}: {pinned} of {slots} slots are pinned by live leases (release leases, or resolve fewer distinct ids)"
    )]
    NoFreeSlot {
        /// How long the resolve waited.
        waited: Duration,
        /// Slots pinned when it gave up.
        pinned: usize,
        /// Slots in the arena.
        slots: usize,
    },
    /// Rows another resolve was reading did not arrive.
    #[error("{message}")]
    ConcurrentRead {
        /// What happened to the concurrent read.
        message: String,
    },
    /// A lease this table does not hold.
    #[error("release: lease {lease} {why}")]
    UnknownLease {
        /// The lease id.
        lease: u64,
        /// Why it is not one of this table's live leases.
        why: &'static str,
    },
    /// A lease released with an event the backend cannot query; its pins
    /// were dropped at once.
    #[error(
        "release: lease {lease} came with an event the backend cannot query; its pins were dropped: {cause}"
    )]
    LeaseEvent {
        /// The lease id.
        lease: u64,
        /// The backend's error.
        cause: GpuError,
    },
    /// A device call failed, with what the table was doing.
    #[error("{action}: {cause}")]
    Device {
        /// What the table was doing.
        action: String,
        /// The backend's error.
        cause: GpuError,
    },
    /// A device call failed.
    #[error(transparent)]
    Gpu(#[from] GpuError),
    /// A setting or argument the operation cannot accept.
    #[error("{message}")]
    InvalidArgument {
        /// What is wrong.
        message: String,
    },
    /// A broken internal invariant, found by a consistency check.
    #[error("{message}")]
    Invariant {
        /// What is inconsistent.
        message: String,
    },
    /// A write refused because it would not produce the declared file.
    #[error("{}: {message}", .path.display())]
    Write {
        /// The file being written.
        path: PathBuf,
        /// What is wrong.
        message: String,
    },
    /// A remote row server failed, or holds something the table cannot
    /// use (see [`RemoteFault`]). Nothing a failed fetch wrote is served.
    #[error("remote rows at {server}: {message}")]
    Remote {
        /// The server's address.
        server: String,
        /// What kind of fault.
        fault: RemoteFault,
        /// What happened, naming the row or the manifest field.
        message: String,
    },
    /// A worker thread could not be started.
    #[error("spawning {what}: {cause}")]
    Thread {
        /// The thread.
        what: &'static str,
        /// The OS error.
        cause: io::Error,
    },
}

/// The kind of a [`StorageError::Remote`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum RemoteFault {
    /// The server is backing off after a failure; nothing was sent.
    Unavailable,
    /// A call took longer than the timeout.
    Timeout,
    /// The connection failed (refused, reset, closed).
    Connection,
    /// A reply that is not what the command returns, or a server error.
    Protocol,
    /// A value of the wrong length, table, row or checksum.
    BadValue,
    /// A row the server should hold is not there (restarted empty?).
    MissingRow,
    /// The server holds no complete load of this table (not pushed, pushed
    /// partly, for another table, or for another server list).
    NotLoaded,
}

fn where_in_header(tensor: &Option<String>, field: &Option<String>) -> String {
    let mut s = String::new();
    if let Some(t) = tensor {
        s.push_str(&format!("tensor '{t}': "));
    }
    if let Some(f) = field {
        s.push_str(&format!("field '{f}': "));
    }
    s
}

impl StorageError {
    /// An [`StorageError::Io`] error of `path`.
    pub fn io(path: impl Into<PathBuf>, action: impl fmt::Display, cause: io::Error) -> Self {
        StorageError::Io {
            path: path.into(),
            action: action.to_string(),
            offset: None,
            cause,
        }
    }

    /// An [`StorageError::Io`] error of `path` at `offset`.
    pub fn io_at(
        path: impl Into<PathBuf>,
        offset: u64,
        action: impl fmt::Display,
        cause: io::Error,
    ) -> Self {
        StorageError::Io {
            path: path.into(),
            action: action.to_string(),
            offset: Some(offset),
            cause,
        }
    }

    /// An [`StorageError::InvalidArgument`].
    pub fn invalid(message: impl Into<String>) -> Self {
        StorageError::InvalidArgument {
            message: message.into(),
        }
    }

    /// A [`StorageError::Layout`] error naming `path` and `shard`.
    pub fn layout(path: Option<PathBuf>, shard: Option<usize>, message: impl Into<String>) -> Self {
        StorageError::Layout {
            path,
            shard,
            message: message.into(),
        }
    }

    /// A [`StorageError::Device`] error: `cause` while doing `action`.
    pub fn device(action: impl Into<String>, cause: GpuError) -> Self {
        StorageError::Device {
            action: action.into(),
            cause,
        }
    }

    /// The device error inside, if this is one.
    pub fn gpu(&self) -> Option<&GpuError> {
        match self {
            StorageError::Gpu(e)
            | StorageError::Device { cause: e, .. }
            | StorageError::LeaseEvent { cause: e, .. } => Some(e),
            _ => None,
        }
    }
}

/// Turn an [`io::Result`] into a [`StorageError::Io`] naming the file and
/// what was being done (formatted only on error).
pub(crate) trait IoContext<T> {
    /// The error names `path` and `action()`.
    fn io_ctx<D: fmt::Display>(
        self,
        path: &std::path::Path,
        action: impl FnOnce() -> D,
    ) -> Result<T>;
    /// The error names `path`, `offset` and `action()`.
    fn io_ctx_at<D: fmt::Display>(
        self,
        path: &std::path::Path,
        offset: u64,
        action: impl FnOnce() -> D,
    ) -> Result<T>;
}

impl<T> IoContext<T> for io::Result<T> {
    fn io_ctx<D: fmt::Display>(
        self,
        path: &std::path::Path,
        action: impl FnOnce() -> D,
    ) -> Result<T> {
        self.map_err(|e| StorageError::io(path, action(), e))
    }

    fn io_ctx_at<D: fmt::Display>(
        self,
        path: &std::path::Path,
        offset: u64,
        action: impl FnOnce() -> D,
    ) -> Result<T> {
        self.map_err(|e| StorageError::io_at(path, offset, action(), e))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn messages_name_file_tensor_and_field() {
        let e = StorageError::Header {
            path: "a.safetensors".into(),
            tensor: Some("t".into()),
            field: Some("dtype".into()),
            message: "unknown dtype 'Q9'".into(),
        };
        assert_eq!(
            e.to_string(),
            "a.safetensors: tensor 't': field 'dtype': unknown dtype 'Q9'"
        );
        let e = StorageError::io_at(
            "s.bin",
            4096,
            "reading 10 bytes at offset 4096",
            io::Error::from_raw_os_error(libc::EIO),
        );
        let s = e.to_string();
        assert!(
            s.starts_with("s.bin: reading 10 bytes at offset 4096: "),
            "{s}"
        );
        assert!(matches!(
            e,
            StorageError::Io {
                offset: Some(4096),
                ..
            }
        ));
        let g: StorageError = GpuError::NotAllocated {
            ptr: metrale_gpu_runtime::gpu::DevicePtr(0x42),
        }
        .into();
        assert_eq!(g.to_string(), "free: 0x42 is not a live allocation");
        assert!(g.gpu().is_some());
    }
}
