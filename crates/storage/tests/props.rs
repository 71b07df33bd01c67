//! Property tests: the dtype conversions round to nearest-even, safetensors
//! files round-trip through the writer, pack and the header reader, and the
//! row cache keeps its invariants and serves file bytes under random
//! sequences of resolves, releases (immediate and event-guarded) and
//! prefetches, under either policy, with or without a host tier.

mod common;

use std::collections::BTreeMap;

use common::*;
use metrale_storage::cached::{CacheConfig, CachedTable, Policy};
use metrale_storage::dtype::*;
use metrale_storage::pack::pack;
use metrale_storage::safetensors::{Dtype, Header, TensorSpec, Writer};
use metrale_storage::table::{RowRef, RowTable};
use proptest::prelude::*;

/// The representable value nearest to `x` among `cands` (ties to the one
/// whose encoding is even), computed in f64.
fn nearest_even(x: f64, cands: impl Iterator<Item = (u32, f64)>) -> u32 {
    let mut best: Option<(u32, f64)> = None;
    for (code, v) in cands {
        if v.is_nan() {
            continue;
        }
        let d = (v - x).abs();
        best = match best {
            None => Some((code, d)),
            Some((bc, bd)) if d < bd || (d == bd && code % 2 == 0 && bc % 2 == 1) => {
                Some((code, d))
            }
            b => b,
        };
    }
    best.unwrap().0
}

proptest! {
    #[test]
    fn bf16_rounds_to_nearest_even(bits in any::<u32>()) {
        let x = f32::from_bits(bits);
        prop_assume!(x.is_finite() && x.abs() < 3.0e38);
        let got = f32_to_bf16(x);
        // Candidates: the two bf16 values bracketing x (same sign).
        let lo = (bits >> 16) as u16;
        let hi = lo.wrapping_add(1);
        let want = nearest_even(x as f64, [lo, hi].into_iter().map(|c| (c as u32, bf16_to_f32(c) as f64)));
        prop_assert_eq!(got as u32, want, "x = {:e}", x);
    }

    #[test]
    fn fp8_rounds_to_nearest_even_in_range(x in -464.0f32..464.0f32) {
        let got = f32_to_fp8_e4m3(x);
        let sign = if x.is_sign_negative() { 0x80u32 } else { 0 };
        let want = nearest_even(
            x as f64,
            (0..0x7Fu32).map(|c| (c | sign, fp8_e4m3_to_f32((c | sign) as u8) as f64)),
        );
        prop_assert_eq!(got as u32, want, "x = {:e}", x);
    }

}

proptest! {
    #![proptest_config(ProptestConfig { cases: 32, ..ProptestConfig::default() })]

    #[test]
    fn safetensors_round_trip_through_pack(
        shapes in proptest::collection::vec(proptest::collection::vec(0u64..5, 0..3), 1..5),
        align_pow in 3u32..13,
    ) {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("x.safetensors");
        let dts = [Dtype::BF16, Dtype::U8, Dtype::F32, Dtype::I64];
        let specs: Vec<TensorSpec> = shapes
            .iter()
            .enumerate()
            .map(|(i, s)| TensorSpec::new(format!("t.{i}"), dts[i % dts.len()], s))
            .collect();
        let mut w = Writer::create(&p, &specs, &BTreeMap::new(), 1 << align_pow).unwrap();
        let mut datas = Vec::new();
        for (i, s) in specs.iter().enumerate() {
            let data: Vec<u8> = (0..s.bytes().unwrap()).map(|j| (j as usize * 13 + i) as u8).collect();
            w.write(&data).unwrap();
            datas.push(data);
        }
        w.finish().unwrap();
        let h = Header::read(&p).unwrap();
        prop_assert_eq!(h.data_start % (1u64 << align_pow), 0);
        let q = d.path().join("y.safetensors");
        pack(&p, &q, &mut |_, _| {}).unwrap();
        let hq = Header::read(&q).unwrap();
        prop_assert_eq!(hq.data_start % 4096, 0);
        for (s, data) in specs.iter().zip(&datas) {
            prop_assert_eq!(&h.get(&s.name).unwrap().shape, &s.shape);
            prop_assert_eq!(&h.read_tensor(&s.name).unwrap(), data);
            prop_assert_eq!(&hq.read_tensor(&s.name).unwrap(), data);
        }
    }
}

#[derive(Clone, Debug)]
enum Op {
    Resolve(Vec<u64>),
    ReleaseOldest { with_event: bool },
    Prefetch(Vec<u64>),
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => proptest::collection::vec(0u64..60, 1..6).prop_map(Op::Resolve),
        3 => any::<bool>().prop_map(|with_event| Op::ReleaseOldest { with_event }),
        1 => proptest::collection::vec(0u64..60, 1..6).prop_map(Op::Prefetch),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 24, ..ProptestConfig::default() })]

    #[test]
    fn cache_serves_file_bytes_under_random_ops(
        ops in proptest::collection::vec(op(), 1..40),
        s3fifo in any::<bool>(),
        host_rows in prop_oneof![Just(0usize), 1usize..30],
    ) {
        let d = tempfile::tempdir().unwrap();
        let files = make_table(d.path(), 3, 20, 24, false, 8);
        let rb = 48;
        let (gpu, _) = backend();
        let mut c = CacheConfig::new(12);
        c.max_resolve = 6;
        c.pin_wait = std::time::Duration::from_millis(5);
        c.policy = if s3fifo { Policy::S3Fifo } else { Policy::Clock };
        c.host_rows = host_rows;
        let t = CachedTable::open(files, gpu.clone(), c).unwrap();
        let s = gpu.create_stream().unwrap();
        let mut live: Vec<(metrale_storage::table::Lease, Vec<u64>, Vec<RowRef>)> = Vec::new();
        for op in ops {
            match op {
                Op::Resolve(ids) => {
                    let mut refs = vec![RowRef::default(); ids.len()];
                    match t.resolve(&ids, &mut refs) {
                        Ok(l) => live.push((l, ids, refs)),
                        // Only legitimate failure: every slot pinned by our own live leases.
                        Err(e) => prop_assert!(e.to_string().contains("no free slot"), "{e}"),
                    }
                }
                Op::ReleaseOldest { with_event } => {
                    if live.is_empty() { continue; }
                    let (l, _, _) = live.remove(0);
                    let ev = if with_event {
                        let ev = gpu.create_event().unwrap();
                        gpu.record_event(ev, s).unwrap();
                        Some(ev)
                    } else {
                        None
                    };
                    t.release(l, gpu.as_ref(), ev).unwrap();
                }
                Op::Prefetch(ids) => t.prefetch(&ids).unwrap(),
            }
            t.check_invariants().unwrap();
            // Every row under a live lease still holds its file bytes.
            for (_, ids, refs) in &live {
                for (id, r) in ids.iter().zip(refs) {
                    let mut b = vec![0u8; rb];
                    gpu.copy_d2h(metrale_gpu_runtime::gpu::DevicePtr(r.data), &mut b).unwrap();
                    prop_assert_eq!(&b, &row(*id, rb), "row {} under a live lease", id);
                }
            }
        }
        for (l, _, _) in live.drain(..) {
            t.release(l, gpu.as_ref(), None).unwrap();
        }
        t.wait_prefetched();
        t.check_invariants().unwrap();
    }
}
