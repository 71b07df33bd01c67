//! The RowTable conformance suite over the testkit's hooked table, over a
//! table that pins nothing and over a row cache that pins and evicts.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use metrale_gpu_runtime::cpu::CpuBackend;
use metrale_gpu_runtime::gpu::GpuBackend;
use metrale_storage::cached::{CacheConfig, CachedTable};
use metrale_storage::resident::ResidentTable;
use metrale_table_conformance::{Subject, assert_conforms};
use metrale_testkit::hooked::{hooked, hooked_waiting};
use metrale_testkit::shards::write_bf16_shards;

const HEAD_DIM: usize = 16;
const ROWS: usize = 120;

/// BF16 bits of row `id`.
fn bits(id: u64) -> Vec<u16> {
    (0..HEAD_DIM as u64)
        .map(|j| (id * 131 + j * 7) as u16)
        .collect()
}

fn bytes(id: u64) -> Vec<u8> {
    bits(id).iter().flat_map(|b| b.to_le_bytes()).collect()
}

#[test]
fn hooked_tables_conform() {
    let all: Vec<u16> = (0..ROWS as u64).flat_map(bits).collect();
    let seen = Arc::new(AtomicUsize::new(0));
    assert_conforms("a hooked resident table", &|| {
        let gpu: Arc<dyn GpuBackend> = Arc::new(CpuBackend::new());
        let inner = Arc::new(ResidentTable::from_bf16(gpu.clone(), &all, HEAD_DIM).unwrap());
        let s = seen.clone();
        Subject {
            table: Arc::new(hooked(inner, move |ids| {
                s.fetch_add(ids.len(), Ordering::Relaxed);
            })),
            gpu,
            row: Box::new(bytes),
            fault: None,
        }
    });
    assert!(seen.load(Ordering::Relaxed) > 0, "the hook never ran");
    let d = tempfile::tempdir().unwrap();
    let files = write_bf16_shards(d.path(), "t", 0, &all, HEAD_DIM, 2).unwrap();
    assert_conforms("a hooked row cache that always waits", &|| {
        let gpu: Arc<dyn GpuBackend> = Arc::new(CpuBackend::new());
        let mut c = CacheConfig::new(40);
        c.max_resolve = 8;
        c.pin_wait = Duration::from_millis(200);
        let inner = Arc::new(CachedTable::open(files.clone(), gpu.clone(), c).unwrap());
        Subject {
            table: Arc::new(hooked_waiting(inner, |_| {})),
            gpu,
            row: Box::new(bytes),
            fault: None,
        }
    });
}
