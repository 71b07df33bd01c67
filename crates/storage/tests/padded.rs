//! Padded rows (`pad_rows`, `table pack --pad-rows`): every table kind
//! serves the same bytes from a padded shard as from the original, a
//! cached miss reads one granule, and bad padding is refused by name.

mod common;

use common::*;
use metrale_storage::cached::{CacheConfig, CachedTable};
use metrale_storage::io::DioAlign;
use metrale_storage::layout::{ShardSource, TableFiles, padded_stride, row_width_key};
use metrale_storage::pack::{PaddedTable, pad_rows};
use metrale_storage::safetensors::{Dtype, Header, TensorSpec, Writer};
use metrale_storage::table::RowTable;
use metrale_storage::{TableMode, open_files};

/// Pad every shard of `files` for `granule`-byte reads.
fn padded(files: &TableFiles, granule: u64) -> TableFiles {
    let mut list = Vec::new();
    for s in &files.shards {
        let dst = s.path.with_extension("padded");
        let rep = pad_rows(
            &s.path,
            &dst,
            std::slice::from_ref(&s.tensor),
            granule,
            &mut |_, _| {},
        )
        .unwrap();
        let rb = files.info.row_bytes() as u64;
        assert_eq!(
            rep,
            vec![PaddedTable {
                tensor: s.tensor.clone(),
                row_bytes: rb,
                stride: padded_stride(rb, granule),
            }]
        );
        list.push(s.source_in(dst));
    }
    TableFiles::open(&list, Some(files.info.rows)).unwrap()
}

#[test]
fn every_table_kind_serves_padded_rows_as_the_original() {
    for fp8 in [false, true] {
        let d = tempfile::tempdir().unwrap();
        let files = make_table(d.path(), 2, 40, 160, fp8, 8);
        let p = padded(&files, 512);
        assert_eq!(p.info, files.info);
        let rb = files.info.row_bytes() as u64;
        assert_eq!(p.row_stride, if fp8 { 256 } else { 512 });
        let h = Header::read(&p.shards[0].path).unwrap();
        assert_eq!(h.data_start % 4096, 0);
        assert_eq!(
            h.metadata
                .get(&row_width_key(&p.shards[0].tensor))
                .map(String::as_str),
            Some("160")
        );
        // The table leads the data section, so no row crosses a granule.
        for id in 0..p.info.rows {
            let off = p.locate(id).unwrap().offset;
            assert!(off % 512 + rb <= 512, "row {id} at {off}");
        }
        // The other tensor is copied unchanged.
        let before = Header::read(&files.shards[0].path).unwrap();
        let name = "model.layers.1.ple.norm_key.weight";
        assert_eq!(
            h.read_tensor(name).unwrap(),
            before.read_tensor(name).unwrap()
        );
        let (gpu, _) = backend();
        let s = gpu.create_stream().unwrap();
        let ids: Vec<u64> = vec![0, 39, 40, 79, 17, 17, 63];
        for mode in TableMode::ALL {
            let t = open_files(p.clone(), gpu.clone(), mode, CacheConfig::new(32)).unwrap();
            assert_eq!(t.info(), files.info, "{mode:?}");
            gather_and_check(gpu.as_ref(), t.as_ref(), &ids, s);
        }
    }
}

#[test]
fn a_cached_miss_of_a_padded_row_reads_the_granules_it_needs() {
    let d = tempfile::tempdir().unwrap();
    let files = make_table(d.path(), 1, 2048, 160, false, 8);
    let f = std::fs::File::open(&files.shards[0].path).unwrap();
    let a = (DioAlign::query(&f).offset as u64).max(1);
    let granule = a.max(512);
    let p = padded(&files, granule);
    let (gpu, _) = backend();
    let t = CachedTable::open(p, gpu.clone(), CacheConfig::new(256)).unwrap();
    let a = t.read_alignment()[0].offset as u64;
    let s = gpu.create_stream().unwrap();
    // Whatever the reads' alignment, a row inside one aligned span of
    // `granule` bytes costs at most that span.
    let need = 320u64.div_ceil(a) * a;
    for id in [3u64, 700, 1401, 2047] {
        let before = t.stats();
        gather_and_check(gpu.as_ref(), &t, &[id], s);
        let st = t.stats().since(&before);
        assert_eq!(st.read_calls, 1, "{st:?}");
        assert!(
            st.bytes_read <= need.max(a),
            "row {id}: {st:?} (alignment {a})"
        );
    }
}

#[test]
fn bad_padding_is_refused_by_name() {
    let d = tempfile::tempdir().unwrap();
    let files = make_table(d.path(), 1, 4, 160, false, 8);
    let src = &files.shards[0].path;
    let dst = d.path().join("out.safetensors");
    let e = |r: metrale_storage::error::Result<Vec<PaddedTable>>| format!("{:#}", r.unwrap_err());
    let m = e(pad_rows(src, &dst, &["nope".into()], 512, &mut |_, _| {}));
    assert!(m.contains("nope"), "{m}");
    let m = e(pad_rows(
        src,
        &dst,
        &["model.layers.1.ple.norm_key.weight".into()],
        512,
        &mut |_, _| {},
    ));
    assert!(m.contains("norm_key") && m.contains("shape"), "{m}");
    let m = e(pad_rows(
        src,
        &dst,
        &[files.shards[0].tensor.clone()],
        384,
        &mut |_, _| {},
    ));
    assert!(m.contains("384"), "{m}");
    let m = e(pad_rows(
        src,
        src,
        &[files.shards[0].tensor.clone()],
        512,
        &mut |_, _| {},
    ));
    assert!(m.contains("same file"), "{m}");
    assert!(!dst.exists());
    // A declared width that is not a width of the tensor.
    let name = "m.ngram_embedding.shard_0.weight";
    for bad in ["abc", "0", "257", "-3"] {
        let p = d.path().join(format!("bad-{bad}.safetensors"));
        let md = [(row_width_key(name), bad.to_string())]
            .into_iter()
            .collect();
        let mut w =
            Writer::create(&p, &[TensorSpec::new(name, Dtype::BF16, &[2, 256])], &md, 8).unwrap();
        w.write(&[0u8; 1024]).unwrap();
        w.finish().unwrap();
        let m = format!(
            "{:#}",
            TableFiles::open(&[ShardSource::new(p.clone(), name, None)], None).unwrap_err()
        );
        assert!(
            m.contains(&row_width_key(name)) && m.contains(bad) && m.contains("bad-"),
            "{m}"
        );
    }
}

#[test]
fn relaying_unpads_and_repads() {
    let d = tempfile::tempdir().unwrap();
    let files = make_table(d.path(), 1, 64, 160, false, 8);
    let p = padded(&files, 512);
    // A padded table relaid into the original layout, and back.
    let plain = d.path().join("plain.safetensors");
    std::fs::copy(&files.shards[0].path, &plain).unwrap();
    let plain = TableFiles::open(&[files.shards[0].source_in(plain)], Some(64)).unwrap();
    let order: Vec<u32> = (0..64).rev().collect();
    metrale_storage::relay::relay_rows(&p, &plain, &order, &mut |_, _| {}).unwrap();
    assert_eq!(plain.row_stride, 320);
    // Physical row k holds logical row 63 - k.
    assert_eq!(read_row_at(&plain, 5), row(58, 320));
    let back = d.path().join("back.safetensors");
    std::fs::copy(&p.shards[0].path, &back).unwrap();
    let back = TableFiles::open(&[p.shards[0].source_in(back)], Some(64)).unwrap();
    metrale_storage::relay::relay_rows(&plain, &back, &order, &mut |_, _| {}).unwrap();
    assert_eq!(back.row_stride, 512);
    let (gpu, _) = backend();
    let s = gpu.create_stream().unwrap();
    let r = open_files(back, gpu.clone(), TableMode::Resident, CacheConfig::new(8)).unwrap();
    gather_and_check(gpu.as_ref(), r.as_ref(), &[0, 5, 63], s);
}

/// Row `id`'s bytes as stored in `t`'s files.
fn read_row_at(t: &TableFiles, id: u64) -> Vec<u8> {
    use std::os::unix::fs::FileExt;
    let l = t.locate(id).unwrap();
    let f = std::fs::File::open(&t.shards[l.shard].path).unwrap();
    let mut b = vec![0u8; t.info.row_bytes()];
    f.read_exact_at(&mut b, l.offset).unwrap();
    b
}
