//! The RowTable conformance suite over every table this crate serves:
//! resident (from shards and from rows in memory), mapped, shared, cached
//! (with a reader that can be made to fail), and tables opened from a
//! description: folded, remapped, and concatenated parts.

mod common;

use std::io;
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use common::{backend, make_table, row};
use metrale_storage::cached::{CacheConfig, CachedTable};
use metrale_storage::io::{PageReader, ReadReq, default_reader};
use metrale_storage::layout::{ShardSource, TableFiles};
use metrale_storage::mapped::MappedTable;
use metrale_storage::resident::ResidentTable;
use metrale_storage::shared::SharedTable;
use metrale_storage::table::RowDType;
use metrale_storage::{TableMode, TablePart, TableSpec};
use metrale_table_conformance::{Subject, assert_conforms};

/// Rows per shard and shards of the tables under test.
const ROWS_PER_SHARD: u64 = 64;
const SHARDS: usize = 2;
const HEAD_DIM: u64 = 32;

/// A reader whose every read fails while `fail` is set.
struct Switchable {
    inner: Arc<dyn PageReader>,
    fail: Arc<AtomicBool>,
}

impl PageReader for Switchable {
    fn name(&self) -> &str {
        "switchable"
    }
    fn read_batch(&self, reqs: &mut [ReadReq<'_>]) -> Vec<io::Result<usize>> {
        if self.fail.load(Ordering::SeqCst) {
            return reqs
                .iter()
                .map(|_| Err(io::Error::other("injected read failure")))
                .collect();
        }
        self.inner.read_batch(reqs)
    }
}

/// A row cache small enough to evict, with a reader that can fail.
fn cache(fail: &Arc<AtomicBool>) -> CacheConfig {
    let mut c = CacheConfig::new(48);
    c.max_resolve = 16;
    c.pin_wait = Duration::from_millis(200);
    c.reader = Some(Arc::new(Switchable {
        inner: default_reader(4).unwrap(),
        fail: fail.clone(),
    }));
    c
}

fn files(dir: &Path) -> TableFiles {
    make_table(dir, SHARDS, ROWS_PER_SHARD, HEAD_DIM, false, 4096)
}

fn sources(f: &TableFiles) -> Vec<ShardSource> {
    f.shards
        .iter()
        .map(|s| s.source_in(s.path.clone()))
        .collect()
}

fn rb() -> usize {
    HEAD_DIM as usize * 2
}

#[test]
fn resident_tables_conform() {
    let d = tempfile::tempdir().unwrap();
    let f = files(d.path());
    assert_conforms("ResidentTable::load", &|| {
        let (gpu, _) = backend();
        Subject {
            table: Arc::new(ResidentTable::load(&f, gpu.clone()).unwrap()),
            gpu,
            row: Box::new(|id| row(id, rb())),
            fault: None,
        }
    });
    assert_conforms("ResidentTable::from_rows", &|| {
        let (gpu, _) = backend();
        let bytes: Vec<u8> = (0..100).flat_map(|id| row(id, rb())).collect();
        let t = ResidentTable::from_rows(gpu.clone(), &bytes, HEAD_DIM as usize, RowDType::Bf16);
        Subject {
            table: Arc::new(t.unwrap()),
            gpu,
            row: Box::new(|id| row(id, rb())),
            fault: None,
        }
    });
}

#[test]
fn mapped_and_shared_tables_conform() {
    let d = tempfile::tempdir().unwrap();
    let f = files(d.path());
    assert_conforms("MappedTable", &|| {
        let (gpu, _) = backend();
        Subject {
            table: Arc::new(MappedTable::open(&f, gpu.clone()).unwrap()),
            gpu,
            row: Box::new(|id| row(id, rb())),
            fault: None,
        }
    });
    let shm = tempfile::tempdir().unwrap();
    assert_conforms("SharedTable", &|| {
        let (gpu, _) = backend();
        Subject {
            table: Arc::new(SharedTable::open_in(&f, gpu.clone(), shm.path()).unwrap()),
            gpu,
            row: Box::new(|id| row(id, rb())),
            fault: None,
        }
    });
}

#[test]
fn cached_tables_conform() {
    let d = tempfile::tempdir().unwrap();
    let f = files(d.path());
    assert_conforms("CachedTable", &|| {
        let (gpu, _) = backend();
        let fail = Arc::new(AtomicBool::new(false));
        Subject {
            table: Arc::new(CachedTable::open(f.clone(), gpu.clone(), cache(&fail)).unwrap()),
            gpu,
            row: Box::new(|id| row(id, rb())),
            fault: Some(fail),
        }
    });
    assert_conforms("CachedTable with a host tier", &|| {
        let (gpu, _) = backend();
        let fail = Arc::new(AtomicBool::new(false));
        let mut c = cache(&fail);
        c.host_rows = 32;
        Subject {
            table: Arc::new(CachedTable::open(f.clone(), gpu.clone(), c).unwrap()),
            gpu,
            row: Box::new(|id| row(id, rb())),
            fault: Some(fail),
        }
    });
}

#[test]
fn described_tables_conform() {
    let d = tempfile::tempdir().unwrap();
    let f = files(d.path());
    let stored = f.info.rows;
    let remap: Arc<[u32]> = (0..stored as u32).rev().collect::<Vec<_>>().into();
    for mode in [TableMode::Resident, TableMode::Cached] {
        // Cut: three times the ids, folded onto the stored rows, then
        // relaid in reverse order.
        let r = remap.clone();
        assert_conforms(&format!("a folded, remapped {mode} table"), &|| {
            let (gpu, _) = backend();
            let fail = Arc::new(AtomicBool::new(false));
            let spec = TableSpec {
                parts: vec![TablePart {
                    shards: sources(&f),
                    stored_rows: stored,
                    logical_rows: 3 * stored,
                    remap: Some(r.clone()),
                }],
                mode,
                cache: cache(&fail),
            };
            let r = r.clone();
            Subject {
                table: metrale_storage::open(&spec, gpu.clone()).unwrap(),
                gpu,
                row: Box::new(move |id| row(r[(id % stored) as usize] as u64, rb())),
                fault: (mode == TableMode::Cached).then_some(fail),
            }
        });
    }
    // Two parts: the second one's ids follow the first's, each folded.
    let d2 = tempfile::tempdir().unwrap();
    let g = make_table(d2.path(), 1, 40, HEAD_DIM, false, 4096);
    for mode in [TableMode::Mapped, TableMode::Cached] {
        assert_conforms(&format!("a concatenated {mode} table"), &|| {
            let (gpu, _) = backend();
            let fail = Arc::new(AtomicBool::new(false));
            let mut c = cache(&fail);
            // Each of the two parts gets half.
            c.slots *= 2;
            c.max_resolve *= 2;
            let spec = TableSpec {
                parts: vec![
                    TablePart::new(sources(&f), stored),
                    TablePart {
                        logical_rows: 50,
                        ..TablePart::new(sources(&g), 40)
                    },
                ],
                mode,
                cache: c,
            };
            Subject {
                table: metrale_storage::open(&spec, gpu.clone()).unwrap(),
                gpu,
                row: Box::new(move |id| {
                    if id < stored {
                        row(id, rb())
                    } else {
                        row((id - stored) % 40, rb())
                    }
                }),
                fault: (mode == TableMode::Cached).then_some(fail),
            }
        });
    }
}
