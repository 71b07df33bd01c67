//! A carry store in a directory: one file per key, written to a temporary
//! name in the same directory and renamed into place, so a reader sees a
//! whole value or none.
//!
//! Invariants: a file `<key hex>.snap` always holds one complete value
//! written by [`CarryStore::put`] (rename is atomic within a file system);
//! temporary files start with `.tmp-` and are never read; reading a value
//! larger than the limit is refused before it is read.

use std::fs;
use std::io::{ErrorKind, Read, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use super::{CarryStore, StoreError, StoreKey};

static TMP_COUNTER: AtomicU64 = AtomicU64::new(0);

/// A directory of snapshot files. See the module docs.
#[derive(Debug)]
pub struct DirStore {
    dir: PathBuf,
    max_value_bytes: u64,
}

impl DirStore {
    /// A store in `dir`, created if needed. Values over `max_value_bytes`
    /// are refused on both put and get.
    pub fn open(dir: impl Into<PathBuf>, max_value_bytes: u64) -> Result<DirStore, StoreError> {
        let dir = dir.into();
        fs::create_dir_all(&dir).map_err(|source| StoreError::Io {
            op: "creating the store directory",
            path: dir.clone(),
            source,
        })?;
        Ok(DirStore {
            dir,
            max_value_bytes,
        })
    }

    /// The directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The file that holds `key`'s value.
    pub fn path_of(&self, key: &StoreKey) -> PathBuf {
        self.dir.join(format!("{}.snap", key.hex()))
    }
}

impl CarryStore for DirStore {
    fn describe(&self) -> String {
        format!("dir:{}", self.dir.display())
    }

    fn put(&self, key: &StoreKey, value: &[u8]) -> Result<(), StoreError> {
        if value.len() as u64 > self.max_value_bytes {
            return Err(StoreError::TooLarge {
                bytes: value.len() as u64,
                limit: self.max_value_bytes,
            });
        }
        let path = self.path_of(key);
        let tmp = self.dir.join(format!(
            ".tmp-{}-{}-{}",
            key.hex(),
            std::process::id(),
            TMP_COUNTER.fetch_add(1, Ordering::Relaxed)
        ));
        let io = |op: &'static str, p: &Path| {
            let p = p.to_path_buf();
            move |source| StoreError::Io {
                op,
                path: p,
                source,
            }
        };
        let write = || -> Result<(), StoreError> {
            let mut f = fs::OpenOptions::new()
                .write(true)
                .create_new(true)
                .open(&tmp)
                .map_err(io("creating", &tmp))?;
            f.write_all(value).map_err(io("writing", &tmp))?;
            f.sync_data().map_err(io("syncing", &tmp))?;
            drop(f);
            fs::rename(&tmp, &path).map_err(io("renaming into place", &path))
        };
        let r = write();
        if r.is_err() {
            let _ = fs::remove_file(&tmp);
        }
        r
    }

    fn get(&self, key: &StoreKey) -> Result<Option<Vec<u8>>, StoreError> {
        let path = self.path_of(key);
        let f = match fs::File::open(&path) {
            Ok(f) => f,
            Err(e) if e.kind() == ErrorKind::NotFound => return Ok(None),
            Err(source) => {
                return Err(StoreError::Io {
                    op: "opening",
                    path,
                    source,
                });
            }
        };
        let len = f
            .metadata()
            .map_err(|source| StoreError::Io {
                op: "reading the size of",
                path: path.clone(),
                source,
            })?
            .len();
        if len > self.max_value_bytes {
            return Err(StoreError::TooLarge {
                bytes: len,
                limit: self.max_value_bytes,
            });
        }
        let mut buf = Vec::with_capacity(len as usize);
        // The file is replaced, never rewritten, so its length is fixed;
        // `take` bounds the read all the same.
        f.take(self.max_value_bytes + 1)
            .read_to_end(&mut buf)
            .map_err(|source| StoreError::Io {
                op: "reading",
                path,
                source,
            })?;
        Ok(Some(buf))
    }

    fn delete(&self, key: &StoreKey) -> Result<(), StoreError> {
        let path = self.path_of(key);
        match fs::remove_file(&path) {
            Ok(()) => Ok(()),
            Err(e) if e.kind() == ErrorKind::NotFound => Ok(()),
            Err(source) => Err(StoreError::Io {
                op: "removing",
                path,
                source,
            }),
        }
    }
}
