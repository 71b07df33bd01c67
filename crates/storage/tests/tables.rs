//! The resident and mapped tables against the CPU backend: every row and
//! scale a kernel reads through their `RowRef`s equals the file, ids past
//! the end are refused, and dropping a table frees what it allocated.

mod common;

use common::*;
use metrale_storage::mapped::MappedTable;
use metrale_storage::pack::pack;
use metrale_storage::resident::ResidentTable;
use metrale_storage::table::{RowRef, RowTable};

#[test]
fn resident_and_mapped_tables_serve_file_bytes() {
    let d = tempfile::tempdir().unwrap();
    for fp8 in [false, true] {
        let sub = d.path().join(if fp8 { "fp8" } else { "bf16" });
        std::fs::create_dir(&sub).unwrap();
        let files = make_table(&sub, 3, 33, 160, fp8, 8);
        let (gpu, _) = backend();
        let s = gpu.create_stream().unwrap();
        let ids: Vec<u64> = vec![0, 32, 33, 98, 50, 50, 1];
        {
            let r = ResidentTable::load(&files, gpu.clone()).unwrap();
            gather_and_check(gpu.as_ref(), &r, &ids, s);
            let m = MappedTable::open(&files, gpu.clone()).unwrap();
            gather_and_check(gpu.as_ref(), &m, &ids, s);
            for t in [&r as &dyn RowTable, &m] {
                let mut out = vec![RowRef::default(); 1];
                let e = t.resolve(&[99], &mut out).unwrap_err().to_string();
                assert!(e.contains("row id 99") && e.contains("(99 rows)"), "{e}");
                assert!(t.prefetch(&[99]).is_err());
                assert_eq!(t.max_resolve(), usize::MAX);
            }
        }
        gpu.synchronize(s).unwrap();
        gpu.destroy_stream(s).unwrap();
        assert_eq!(
            gpu.live_alloc_count(),
            0,
            "tables leaked:\n{}",
            gpu.live_report()
        );
    }
}

#[test]
fn tables_open_packed_shards() {
    let d = tempfile::tempdir().unwrap();
    let files = make_table(d.path(), 2, 20, 160, false, 8);
    let mut packed = Vec::new();
    for s in &files.shards {
        let dst = s.path.with_extension("packed");
        let rep = pack(&s.path, &dst, &mut |_, _| {}).unwrap();
        assert_eq!(rep.new_data_start % 4096, 0);
        packed.push(s.source_in(dst));
    }
    let pf = metrale_storage::layout::TableFiles::open(&packed, Some(40)).unwrap();
    let (gpu, _) = backend();
    let s = gpu.create_stream().unwrap();
    let m = MappedTable::open(&pf, gpu.clone()).unwrap();
    gather_and_check(gpu.as_ref(), &m, &[0, 19, 20, 39], s);
}

#[test]
fn a_truncated_shard_is_refused_at_load() {
    let d = tempfile::tempdir().unwrap();
    let files = make_table(d.path(), 2, 20, 160, false, 8);
    let p = &files.shards[1].path;
    let len = std::fs::metadata(p).unwrap().len();
    std::fs::OpenOptions::new()
        .write(true)
        .open(p)
        .unwrap()
        .set_len(len - 100)
        .unwrap();
    let (gpu, _) = backend();
    let e = format!(
        "{:#}",
        ResidentTable::load(&files, gpu.clone()).err().unwrap()
    );
    assert!(
        e.contains("table-1.safetensors") && e.contains("truncated"),
        "{e}"
    );
    let e = format!(
        "{:#}",
        MappedTable::open(&files, gpu.clone()).err().unwrap()
    );
    assert!(
        e.contains("table-1.safetensors") && e.contains("truncated"),
        "{e}"
    );
    assert_eq!(
        gpu.live_alloc_count(),
        0,
        "a failed load leaked:\n{}",
        gpu.live_report()
    );
}

#[test]
fn open_files_opens_every_kind() {
    use metrale_storage::{TableMode, cached::CacheConfig, open_files};
    let d = tempfile::tempdir().unwrap();
    let files = make_table(d.path(), 2, 30, 160, false, 8);
    let (gpu, _) = backend();
    let s = gpu.create_stream().unwrap();
    for mode in TableMode::ALL {
        let t = open_files(files.clone(), gpu.clone(), mode, CacheConfig::new(8)).unwrap();
        assert_eq!(t.info(), files.info);
        gather_and_check(gpu.as_ref(), t.as_ref(), &[0, 29, 30, 59], s);
    }
}
