//! Swapping to host memory keeps each site's aux blob as it came: the
//! stats count exactly those bytes, a swap-in that fails part-way (a site
//! refuses its blob) leaves the sequence swapped out with its blobs intact
//! and holds no device memory or budget, and the retry continues the
//! sequence bit-identically to a run that never swapped.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use metrale_engine::{Engine, EngineConfig, EngineError, SwapTarget};
use metrale_gpu_runtime::cpu::CpuBackend;
use metrale_gpu_runtime::gpu::GpuBackend;
use metrale_testkit::drive::reference_run;
use metrale_testkit::hooked_site::{HookedSite, SiteCall};
use metrale_testkit::rows::rows_for;
use metrale_testkit::toy::ToySite;

#[test]
fn a_failed_host_swap_in_changes_nothing_and_the_retry_continues_bit_identically() {
    let gpu: Arc<dyn GpuBackend> = Arc::new(CpuBackend::new_debug());
    let base = gpu.live_alloc_count();
    let refuse = Arc::new(AtomicBool::new(false));
    // The second site fails, so the first one's new state was allocated
    // and filled before the failure and must be given back.
    let sites = (0..2)
        .map(|i| {
            let refuse = refuse.clone();
            HookedSite::new(ToySite::new(8, 2, i, 16), move |call: SiteCall<'_>| {
                (i == 1 && call == SiteCall::Restore && refuse.load(Ordering::SeqCst))
                    .then(|| "flaky: restore refused".to_string())
            })
        })
        .collect::<Vec<_>>();
    let cfg = EngineConfig {
        prefill_chunk: 5,
        ..Default::default()
    };
    let mut e = Engine::new(gpu.clone(), sites, cfg).unwrap();
    let w = e.width();
    let toks: Vec<u32> = (1..40).map(|t| t * 3 % 37 + 1).collect();
    let id = e.add_sequence(&toks[..13]).unwrap().id;
    let mut r = rows_for(&toks, 0, 13, w);
    e.prefill(id, &toks[..13], &mut r).unwrap();
    let resident = gpu.live_bytes();

    e.swap_out(id, SwapTarget::Host).unwrap();
    let swapped = gpu.live_bytes();
    assert_eq!(swapped, resident - e.carry_bytes());
    let st = e.stats();
    let blobs: usize = e.geometries().iter().map(|g| g.aux_blob_len()).sum();
    assert_eq!((st.swapped_host, st.swap_host_bytes), (1, blobs));
    assert_eq!(st.budget.used_bytes, 0);

    refuse.store(true, Ordering::SeqCst);
    for _ in 0..2 {
        let err = e.swap_in(id).unwrap_err();
        assert!(matches!(err, EngineError::Site { site: 1, .. }), "{err:?}");
        let st = e.stats();
        assert_eq!(
            (st.swapped_host, st.swap_host_bytes, st.swap_ins),
            (1, blobs, 0)
        );
        assert_eq!(st.budget.used_bytes, 0, "a failed swap-in holds no budget");
        assert_eq!(gpu.live_bytes(), swapped, "{}", gpu.live_report());
        assert!(!e.is_resident(id).unwrap());
    }

    refuse.store(false, Ordering::SeqCst);
    e.swap_in(id).unwrap();
    let st = e.stats();
    assert_eq!(
        (
            st.swapped_host,
            st.swap_host_bytes,
            st.swap_ins,
            st.resident
        ),
        (0, 0, 1, 1)
    );
    assert_eq!(gpu.live_bytes(), resident);
    let mut r = rows_for(&toks, 13, 39, w);
    e.prefill(id, &toks[13..39], &mut r).unwrap();
    let want = reference_run(e.sites(), gpu.as_ref(), &toks[..39]);
    assert!(
        r == want[13 * w..],
        "the swapped carry did not continue exactly"
    );
    e.release(id).unwrap();
    e.close().unwrap();
    assert_eq!(gpu.live_alloc_count(), base, "{}", gpu.live_report());
}

#[test]
fn host_swaps_round_trip_many_times_bit_identically() {
    let gpu: Arc<dyn GpuBackend> = Arc::new(CpuBackend::new());
    let sites = (0..2).map(|i| ToySite::new(8, 2, i, 16)).collect();
    let cfg = EngineConfig {
        prefill_chunk: 4,
        ..Default::default()
    };
    let mut e = Engine::new(gpu.clone(), sites, cfg).unwrap();
    let w = e.width();
    let toks: Vec<u32> = (1..30).map(|t| t * 5 % 31 + 1).collect();
    let id = e.add_sequence(&toks[..1]).unwrap().id;
    // A swap before any token, then one after every token.
    e.swap_out(id, SwapTarget::Host).unwrap();
    assert_eq!(e.stats().swap_host_bytes, 0);
    let mut got = Vec::new();
    for t in 0..toks.len() {
        e.swap_in(id).unwrap();
        let mut r = rows_for(&toks, t, t + 1, w);
        e.prefill(id, &toks[t..t + 1], &mut r).unwrap();
        got.extend_from_slice(&r);
        e.swap_out(id, SwapTarget::Host).unwrap();
    }
    assert_eq!(e.stats().swap_outs, toks.len() as u64 + 1);
    let want = reference_run(e.sites(), gpu.as_ref(), &toks);
    assert!(got == want, "swapping after every token changed the rows");
    e.release(id).unwrap();
    e.close().unwrap();
}
