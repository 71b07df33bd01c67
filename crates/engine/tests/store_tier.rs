//! The shared carry store behind the engine's prefix cache, over in-process
//! and directory stores: a second engine restores what a first one wrote,
//! values that do not fit are misses counted by cause, and every output is
//! the plain sequential run's.

use std::sync::Arc;
use std::time::Duration;

use metrale_engine::snapshot::Snapshot;
use metrale_engine::store::dir::DirStore;
use metrale_engine::store::memory::MemoryStore;
use metrale_engine::store::value::seal_value;
use metrale_engine::store::{CarryStore, ModelDigest, StoreKey, TierConfig};
use metrale_engine::{Engine, EngineConfig};
use metrale_gpu_runtime::cpu::CpuBackend;
use metrale_gpu_runtime::gpu::GpuBackend;
use metrale_testkit::drive::reference_run;
use metrale_testkit::rows::rows_for;
use metrale_testkit::toy::ToySite;

const BLOCK: usize = 4;

fn sites(salt: u64) -> Vec<ToySite> {
    vec![
        ToySite::new(8, 2, salt, 16),
        ToySite::new(8, 2, salt + 1, 16),
    ]
}

fn engine(gpu: &Arc<dyn GpuBackend>, salt: u64, local: bool) -> Engine<ToySite> {
    let cfg = EngineConfig {
        prefill_chunk: 5,
        block_size: BLOCK,
        prefix_cache_bytes: if local { 1 << 20 } else { 0 },
        ..Default::default()
    };
    Engine::new(gpu.clone(), sites(salt), cfg).unwrap()
}

fn attach(e: &mut Engine<ToySite>, store: &Arc<dyn CarryStore>, model: &str) {
    e.attach_carry_store(store.clone(), TierConfig::new(model))
        .unwrap();
}

/// Add `prompt` and prefill what was not restored; check every computed
/// row against the sequential run. Returns the tokens restored.
fn run_prompt(e: &mut Engine<ToySite>, gpu: &Arc<dyn GpuBackend>, prompt: &[u32]) -> usize {
    let added = e.add_sequence(prompt).unwrap();
    let w = e.width();
    let mut rows = rows_for(prompt, added.cached, prompt.len(), w);
    e.prefill(added.id, &prompt[added.cached..], &mut rows)
        .unwrap();
    let want = reference_run(&sites(salt_of(e)), gpu.as_ref(), prompt);
    assert_eq!(
        rows,
        want[added.cached * w..],
        "outputs after a restore of {} tokens",
        added.cached
    );
    e.release(added.id).unwrap();
    added.cached
}

fn salt_of(e: &Engine<ToySite>) -> u64 {
    // Site 0's first multiplier is 3 + 2 * salt.
    (e.geometries()[0].dims.multipliers[0] - 3) / 2
}

fn prompt(n: usize, seed: u32) -> Vec<u32> {
    (0..n as u32).map(|i| (i * 7 + seed) % 50 + 1).collect()
}

#[test]
fn a_second_engine_restores_what_the_first_wrote() {
    let gpu: Arc<dyn GpuBackend> = Arc::new(CpuBackend::new());
    let store: Arc<dyn CarryStore> = Arc::new(MemoryStore::new(1 << 20));
    let p = prompt(23, 3);
    let mut a = engine(&gpu, 0, true);
    attach(&mut a, &store, "m");
    assert_eq!(run_prompt(&mut a, &gpu, &p), 0);
    assert!(a.flush_carry_store(Duration::from_secs(5)));
    let sa = a.stats().carry_store;
    assert_eq!(sa.puts, 5, "{sa:?}");
    a.close().unwrap();

    // No local cache at all: everything comes from the store.
    let mut b = engine(&gpu, 0, false);
    attach(&mut b, &store, "m");
    assert_eq!(run_prompt(&mut b, &gpu, &p), 20);
    // A shorter prompt restores a shorter prefix; a longer one the longest.
    assert_eq!(run_prompt(&mut b, &gpu, &p[..10]), 8);
    let mut longer = p.clone();
    longer.extend_from_slice(&[9, 9, 9, 9, 9, 9]);
    assert_eq!(run_prompt(&mut b, &gpu, &longer), 20);
    let s = b.stats();
    assert_eq!(s.carry_store.hits, 3, "{:?}", s.carry_store);
    assert_eq!(s.carry_store.tokens_restored, 48);
    assert!(s.carry_store.bytes_restored > 0 && s.carry_store.restore_ns > 0);
    assert_eq!(s.prefix_hits, 3);
    b.close().unwrap();
    assert_eq!(gpu.live_alloc_count(), 0, "{}", gpu.live_report());
}

#[test]
fn decode_boundaries_reach_the_store_without_a_local_cache() {
    let gpu: Arc<dyn GpuBackend> = Arc::new(CpuBackend::new());
    let store: Arc<dyn CarryStore> = Arc::new(MemoryStore::new(1 << 20));
    let p = prompt(6, 11);
    let mut a = engine(&gpu, 0, false);
    attach(&mut a, &store, "m");
    let added = a.add_sequence(&p).unwrap();
    let w = a.width();
    let mut rows = rows_for(&p, 0, p.len(), w);
    a.prefill(added.id, &p, &mut rows).unwrap();
    // Two generated tokens take the sequence from 6 to 8 tokens: the
    // boundary at 8 is reached by decode alone.
    let mut full = p.clone();
    for t in [21u32, 22] {
        full.push(t);
        let mut row = rows_for(&full, full.len() - 1, full.len(), w);
        a.decode(&[(added.id, t)], &mut row).unwrap();
    }
    assert!(a.flush_carry_store(Duration::from_secs(5)));
    let puts = a.stats().carry_store.puts;
    // The boundary at 4 (prefill) and the one at 8 (decode).
    assert_eq!(puts, 2, "{:?}", a.stats().carry_store);
    a.release(added.id).unwrap();
    a.close().unwrap();

    // A next turn (one more token) restores past the generated tokens.
    full.push(30);
    let mut b = engine(&gpu, 0, false);
    attach(&mut b, &store, "m");
    assert_eq!(run_prompt(&mut b, &gpu, &full), 8);
    b.close().unwrap();
    assert_eq!(gpu.live_alloc_count(), 0, "{}", gpu.live_report());
}

#[test]
fn local_hits_do_not_ask_the_store() {
    let gpu: Arc<dyn GpuBackend> = Arc::new(CpuBackend::new());
    let store: Arc<dyn CarryStore> = Arc::new(MemoryStore::new(1 << 20));
    let mut a = engine(&gpu, 0, true);
    attach(&mut a, &store, "m");
    let p = prompt(17, 5);
    run_prompt(&mut a, &gpu, &p);
    let before = a.stats().carry_store.lookups;
    assert_eq!(run_prompt(&mut a, &gpu, &p), 16);
    assert_eq!(a.stats().carry_store.lookups, before);
    a.close().unwrap();
}

/// Plant `value` under the key engine `salt`/`model` would ask for after
/// `tokens`.
fn key_for(salt: u64, model: &str, tokens: &[u32]) -> StoreKey {
    let gpu: Arc<dyn GpuBackend> = Arc::new(CpuBackend::new());
    let e = engine(&gpu, salt, false);
    let k = StoreKey::of(&ModelDigest::of(model), e.fingerprint(), tokens);
    e.close().unwrap();
    k
}

#[test]
fn values_that_do_not_fit_are_misses_by_cause() {
    let gpu: Arc<dyn GpuBackend> = Arc::new(CpuBackend::new());
    let mem = Arc::new(MemoryStore::new(1 << 20));
    let store: Arc<dyn CarryStore> = mem.clone();
    let p = prompt(9, 11);
    // A genuine value for model "m", salt 0, after 8 tokens.
    let mut a = engine(&gpu, 0, true);
    attach(&mut a, &store, "m");
    run_prompt(&mut a, &gpu, &p);
    a.close().unwrap();
    let k8 = key_for(0, "m", &p[..8]);
    let good = store.get(&k8).unwrap().expect("written");
    let k4 = key_for(0, "m", &p[..4]);
    store.delete(&k4).unwrap();

    let cases: Vec<(&str, Vec<u8>)> = {
        let mut flipped = good.clone();
        let at = flipped.len() - 10;
        flipped[at] ^= 1;
        let container = &good[80..];
        let other = Snapshot::decode(container).unwrap();
        let foreign = Snapshot {
            fingerprint: metrale_engine::snapshot::GeometryFingerprint(7),
            ..other.clone()
        }
        .encode();
        let short = Snapshot {
            token_count: 4,
            ..other
        }
        .encode();
        vec![
            ("corrupt", flipped),
            ("corrupt", good[..good.len() - 1].to_vec()),
            ("corrupt", b"garbage".to_vec()),
            ("corrupt", seal_value(&ModelDigest::of("m"), &k8, &short)),
            ("geometry", seal_value(&ModelDigest::of("m"), &k8, &foreign)),
            (
                "model",
                seal_value(&ModelDigest::of("other"), &k8, container),
            ),
        ]
    };
    for (cause, value) in cases {
        // Each run writes back what it computed: set the stage again.
        store.delete(&k4).unwrap();
        mem.plant(&k8, &value);
        let mut b = engine(&gpu, 0, false);
        attach(&mut b, &store, "m");
        assert_eq!(run_prompt(&mut b, &gpu, &p), 0, "{cause}");
        let s = b.stats().carry_store;
        let counted = match cause {
            "corrupt" => s.miss_corrupt,
            "geometry" => s.miss_geometry,
            _ => s.miss_model,
        };
        assert_eq!(counted, 1, "{cause}: {s:?}");
        assert_eq!(s.miss_absent, 1, "the 4-token boundary: {s:?}");
        assert_eq!(s.hits, 0);
        b.close().unwrap();
    }
    // The other geometry (salt 2) and the other model ask other keys.
    mem.plant(&k8, &good);
    store.delete(&k4).unwrap();
    for (salt, model) in [(2, "m"), (0, "n")] {
        let mut c = engine(&gpu, salt, false);
        attach(&mut c, &store, model);
        assert_eq!(run_prompt(&mut c, &gpu, &p), 0);
        assert_eq!(c.stats().carry_store.miss_absent, 2);
        c.close().unwrap();
    }
    assert_eq!(gpu.live_alloc_count(), 0, "{}", gpu.live_report());
}

#[test]
fn dir_store_round_trip_and_corruption() {
    let dir = tempfile::tempdir().unwrap();
    let d = DirStore::open(dir.path().join("carries"), 1 << 20).unwrap();
    let k = StoreKey([1; 32]);
    assert_eq!(d.get(&k).unwrap(), None);
    d.put(&k, b"one").unwrap();
    d.put(&k, b"two").unwrap();
    assert_eq!(d.get(&k).unwrap().as_deref(), Some(&b"two"[..]));
    d.delete(&k).unwrap();
    d.delete(&k).unwrap();
    assert_eq!(d.get(&k).unwrap(), None);
    assert!(d.put(&k, &vec![0; (1 << 20) + 1]).is_err());
    let names: Vec<_> = std::fs::read_dir(d.dir()).unwrap().collect();
    assert!(names.is_empty(), "temporary files left: {names:?}");

    // Two engines through the directory; then every file cut short.
    let gpu: Arc<dyn GpuBackend> = Arc::new(CpuBackend::new());
    let store: Arc<dyn CarryStore> = Arc::new(d);
    let p = prompt(14, 2);
    let mut a = engine(&gpu, 0, true);
    attach(&mut a, &store, "m");
    run_prompt(&mut a, &gpu, &p);
    a.close().unwrap();
    let mut b = engine(&gpu, 0, true);
    attach(&mut b, &store, "m");
    assert_eq!(run_prompt(&mut b, &gpu, &p), 12);
    b.close().unwrap();
    let files: Vec<_> = std::fs::read_dir(dir.path().join("carries"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    assert_eq!(files.len(), 3, "{files:?}");
    for f in &files {
        let data = std::fs::read(f).unwrap();
        std::fs::write(f, &data[..data.len() / 2]).unwrap();
    }
    let mut c = engine(&gpu, 0, true);
    attach(&mut c, &store, "m");
    assert_eq!(run_prompt(&mut c, &gpu, &p), 0);
    let s = c.stats().carry_store;
    assert_eq!((s.miss_corrupt, s.hits), (3, 0), "{s:?}");
    c.close().unwrap();
}

/// A store whose every call fails: the run goes on with local caching,
/// counting errors, and writes are dropped rather than waited for.
#[test]
fn a_failing_store_changes_no_output() {
    struct Broken;
    impl CarryStore for Broken {
        fn describe(&self) -> String {
            "broken".into()
        }
        fn put(&self, _: &StoreKey, _: &[u8]) -> Result<(), metrale_engine::store::StoreError> {
            std::thread::sleep(Duration::from_millis(20));
            Err(metrale_engine::store::StoreError::Timeout { op: "put" })
        }
        fn get(&self, _: &StoreKey) -> Result<Option<Vec<u8>>, metrale_engine::store::StoreError> {
            Err(metrale_engine::store::StoreError::Timeout { op: "get" })
        }
        fn delete(&self, _: &StoreKey) -> Result<(), metrale_engine::store::StoreError> {
            Ok(())
        }
    }
    let gpu: Arc<dyn GpuBackend> = Arc::new(CpuBackend::new());
    let store: Arc<dyn CarryStore> = Arc::new(Broken);
    let mut e = engine(&gpu, 0, true);
    let mut cfg = TierConfig::new("m");
    cfg.queue_len = 1;
    e.attach_carry_store(store, cfg).unwrap();
    for seed in 0..6 {
        run_prompt(&mut e, &gpu, &prompt(30, seed));
    }
    // Local caching still works.
    assert_eq!(run_prompt(&mut e, &gpu, &prompt(30, 0)), 28);
    assert!(e.flush_carry_store(Duration::from_secs(5)));
    let s = e.stats().carry_store;
    assert!(s.miss_error > 0 && s.errors > 0 && s.hits == 0, "{s:?}");
    assert!(
        s.drops > 0,
        "a one-slot queue in front of a slow store drops: {s:?}"
    );
    assert_eq!(s.puts, 0);
    e.close().unwrap();
}
