//! The Redis carry store against servers that fail: nothing listening, a
//! server that answers garbage, one that never answers; and against a real
//! `redis-server` (when installed) that is killed and restarted mid-run.
//! Every wait is bounded; every server listens on 127.0.0.1 only.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use metrale_engine::store::redis_store::{RedisConfig, RedisStore};
use metrale_engine::store::{CarryStore, StoreError, StoreKey, TierConfig};
use metrale_engine::{Engine, EngineConfig};
use metrale_gpu_runtime::cpu::CpuBackend;
use metrale_gpu_runtime::gpu::GpuBackend;
use metrale_testkit::drive::reference_run;
use metrale_testkit::redis::{RedisServer as Server, free_port, have_redis};
use metrale_testkit::rows::rows_for;
use metrale_testkit::toy::ToySite;

fn cfg() -> RedisConfig {
    RedisConfig {
        connect_timeout: Duration::from_millis(150),
        io_timeout: Duration::from_millis(150),
        backoff_min: Duration::from_millis(20),
        backoff_max: Duration::from_millis(100),
        ..RedisConfig::default()
    }
}

/// A fake server on 127.0.0.1: `garbage` answers every read with bytes
/// that are not RESP; otherwise it never answers. Stops when dropped.
struct Fake {
    port: u16,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl Fake {
    fn start(garbage: bool) -> Fake {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        l.set_nonblocking(true).unwrap();
        let port = l.local_addr().unwrap().port();
        let stop = Arc::new(AtomicBool::new(false));
        let s = stop.clone();
        let thread = std::thread::spawn(move || {
            let mut conns: Vec<TcpStream> = Vec::new();
            let deadline = Instant::now() + Duration::from_secs(30);
            while !s.load(Ordering::Relaxed) && Instant::now() < deadline {
                if let Ok((c, _)) = l.accept() {
                    c.set_nonblocking(true).unwrap();
                    conns.push(c);
                }
                for c in &mut conns {
                    let mut buf = [0u8; 4096];
                    if let Ok(n) = c.read(&mut buf)
                        && n > 0
                        && garbage
                    {
                        let _ = c.write_all(b"%%garbage\x00\xff not a reply\r\n");
                    }
                }
                std::thread::sleep(Duration::from_millis(2));
            }
        });
        Fake {
            port,
            stop,
            thread: Some(thread),
        }
    }

    fn url(&self) -> String {
        format!("redis://127.0.0.1:{}/", self.port)
    }
}

impl Drop for Fake {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

fn sites() -> Vec<ToySite> {
    vec![ToySite::new(8, 2, 0, 16), ToySite::new(8, 2, 1, 16)]
}

fn engine(gpu: &Arc<dyn GpuBackend>, store: Arc<dyn CarryStore>) -> Engine<ToySite> {
    let cfg = EngineConfig {
        prefill_chunk: 5,
        block_size: 4,
        prefix_cache_bytes: 1 << 20,
        ..Default::default()
    };
    let mut e = Engine::new(gpu.clone(), sites(), cfg).unwrap();
    e.attach_carry_store(store, TierConfig::new("m")).unwrap();
    e
}

/// Run `prompt` on a new sequence, check its rows against the sequential
/// run, and return the tokens restored.
fn run_prompt(e: &mut Engine<ToySite>, gpu: &Arc<dyn GpuBackend>, prompt: &[u32]) -> usize {
    let added = e.add_sequence(prompt).unwrap();
    let w = e.width();
    let mut rows = rows_for(prompt, added.cached, prompt.len(), w);
    e.prefill(added.id, &prompt[added.cached..], &mut rows)
        .unwrap();
    let want = reference_run(&sites(), gpu.as_ref(), prompt);
    assert_eq!(rows, want[added.cached * w..]);
    e.release(added.id).unwrap();
    added.cached
}

fn prompt(seed: u32) -> Vec<u32> {
    (0..23u32).map(|i| (i * 5 + seed) % 40 + 1).collect()
}

/// A failing store: every call ends within its timeouts, then backs off;
/// an engine over it computes what it would without.
fn check_failing(url: &str, what: &str) {
    let store = RedisStore::open(url, cfg()).unwrap();
    let k = StoreKey([3; 32]);
    let t0 = Instant::now();
    let e = store.get(&k).unwrap_err();
    assert!(
        t0.elapsed() < Duration::from_secs(2),
        "{what}: {:?}",
        t0.elapsed()
    );
    eprintln!("{what}: {e}");
    assert!(matches!(
        store.put(&k, b"x"),
        Err(StoreError::Unavailable { .. })
    ));
    let gpu: Arc<dyn GpuBackend> = Arc::new(CpuBackend::new());
    let mut eng = engine(&gpu, Arc::new(store));
    let t0 = Instant::now();
    for seed in 0..4 {
        assert_eq!(run_prompt(&mut eng, &gpu, &prompt(seed)), 0);
    }
    assert_eq!(run_prompt(&mut eng, &gpu, &prompt(0)), 20, "local hits");
    let s = eng.stats().carry_store;
    eprintln!("{what}: {s:?} in {:?}", t0.elapsed());
    assert_eq!(s.hits, 0);
    assert!(s.miss_error > 0, "{s:?}");
    assert_eq!(s.puts, 0);
    eng.close().unwrap();
    assert!(t0.elapsed() < Duration::from_secs(20), "{what}: too slow");
}

#[test]
fn nothing_listening() {
    check_failing(&format!("redis://127.0.0.1:{}/", free_port()), "down");
}

#[test]
fn a_server_answering_garbage() {
    let f = Fake::start(true);
    check_failing(&f.url(), "garbage");
}

#[test]
fn a_server_that_never_answers() {
    let f = Fake::start(false);
    check_failing(&f.url(), "silent");
}

#[test]
fn bad_addresses_are_refused() {
    assert!(matches!(
        RedisStore::open("redis://", cfg()),
        Err(StoreError::Address { .. })
    ));
    assert!(metrale_engine::store::open_store("ftp://x", &Default::default()).is_err());
    assert!(metrale_engine::store::open_store("dir:", &Default::default()).is_err());
}

#[test]
fn real_redis_killed_and_restarted() {
    if !have_redis() {
        return;
    }
    let port = free_port();
    let server = Server::start(port).unwrap();
    let store = Arc::new(RedisStore::open(&server.url(), cfg()).unwrap());
    let k = StoreKey([9; 32]);
    store.put(&k, b"value").unwrap();
    assert_eq!(store.get(&k).unwrap().as_deref(), Some(&b"value"[..]));
    store.delete(&k).unwrap();
    assert_eq!(store.get(&k).unwrap(), None);

    let gpu: Arc<dyn GpuBackend> = Arc::new(CpuBackend::new());
    let mut a = engine(&gpu, store.clone());
    assert_eq!(run_prompt(&mut a, &gpu, &prompt(1)), 0);
    a.close().unwrap();
    let mut b = engine(&gpu, store.clone());
    assert_eq!(run_prompt(&mut b, &gpu, &prompt(1)), 20, "from the store");
    let s = b.stats().carry_store;
    assert_eq!(s.hits, 1, "{s:?}");
    assert!(s.get_p50_us > 0 && s.get_p99_us >= s.get_p50_us, "{s:?}");

    // Killed mid-run: misses, no error, same outputs.
    drop(server);
    for seed in 2..5 {
        assert_eq!(run_prompt(&mut b, &gpu, &prompt(seed)), 0);
    }
    let s = b.stats().carry_store;
    assert!(s.miss_error > 0, "{s:?}");
    // Restarted (empty): the store reconnects after its backoff and the
    // values written from then on are found again.
    let server = Server::start(port).unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    while store.get(&k).is_err() {
        assert!(Instant::now() < deadline, "no reconnect within 10 s");
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(store.reconnects() >= 1);
    assert_eq!(run_prompt(&mut b, &gpu, &prompt(7)), 0);
    assert!(b.flush_carry_store(Duration::from_secs(5)));
    b.close().unwrap();
    let mut c = engine(&gpu, store.clone());
    assert_eq!(run_prompt(&mut c, &gpu, &prompt(7)), 20);
    assert_eq!(c.stats().carry_store.hits, 1);
    c.close().unwrap();
    drop(server);
}
