//! The serving loop over tiny real PLE engines: every row it serves equals
//! a plain sequential run, with the prefix cache, chunking, batching,
//! decode graphs and preemption under a tiny device budget; a failed call
//! releases and reruns only its own sequences; malformed requests and
//! settings are refused before anything runs.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use metrale_engine::ple_site::PleSite;
use metrale_engine::server::{Phase, Request, Workload, fingerprint};
use metrale_engine::{
    CarrySite, Engine, EngineConfig, EngineError, Server, ServerConfig, ServerError, ServerReport,
    Site, SwapTarget,
};
use metrale_gpu_runtime::cpu::CpuBackend;
use metrale_gpu_runtime::gpu::GpuBackend;
use metrale_testkit::Rng;
use metrale_testkit::drive::sequential_run;
use metrale_testkit::hooked_site::{HookedSite, SiteCall};
use metrale_testkit::tiny::{TinySpec, tiny_engine, tiny_site};

fn spec() -> TinySpec {
    TinySpec {
        max_tokens: 16,
        ..Default::default()
    }
}

/// The input row of a token: a function of the token alone.
fn embed(token: u32, out: &mut [f32]) {
    let mut r = Rng(0xE3B0 ^ u64::from(token).wrapping_mul(0xD6E8_FEB8_6659_FD93));
    for v in out {
        *v = r.unit();
    }
}

/// Requests sharing three system prompts (block-aligned prefixes hit the
/// cache), each a prompt then generated tokens, some with a second turn.
fn workload(n: usize, seed: u64) -> Vec<Request> {
    let mut rng = Rng(seed);
    let systems: Vec<Vec<u32>> = (0..3)
        .map(|_| {
            (0..9 + rng.below(8))
                .map(|_| 1 + rng.below(900) as u32)
                .collect()
        })
        .collect();
    (0..n)
        .map(|_| {
            let mut tokens = systems[rng.below(3)].clone();
            let mut segments = Vec::new();
            for turn in 0..1 + rng.below(2) {
                if turn > 0 {
                    tokens.push(0);
                }
                tokens.extend((0..1 + rng.below(7)).map(|_| 1 + rng.below(900) as u32));
                segments.push((Phase::Prefill, tokens.len()));
                let generated = rng.below(6);
                if generated > 0 {
                    tokens.extend((0..generated).map(|_| 1 + rng.below(900) as u32));
                    segments.push((Phase::Decode, tokens.len()));
                }
            }
            Request { tokens, segments }
        })
        .collect()
}

/// The fingerprint of every output row of every request, run sequentially
/// through `sites` from a fresh carry.
fn reference<S: Site>(sites: &[S], gpu: &dyn GpuBackend, reqs: &[Request]) -> Vec<Vec<u64>> {
    let g = sites[0].geometry();
    let w = g.hc_mult * g.hidden;
    reqs.iter()
        .map(|r| {
            let mut rows = vec![0f32; r.tokens.len() * w];
            for (i, &t) in r.tokens.iter().enumerate() {
                embed(t, &mut rows[i * w..(i + 1) * w]);
            }
            let out = sequential_run(sites, gpu, &r.tokens, rows);
            out.chunks_exact(w).map(fingerprint).collect()
        })
        .collect()
}

/// Every computed row equals the reference; restored rows are exactly the
/// prefix-cache restores the engine counted.
fn check(got: &[Vec<Option<u64>>], want: &[Vec<u64>], restored: u64) {
    let mut missing = 0u64;
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert_eq!(g.len(), w.len(), "request {i}: row count");
        for (p, (g, w)) in g.iter().zip(w).enumerate() {
            match g {
                Some(g) => assert_eq!(g, w, "request {i} position {p}"),
                None => missing += 1,
            }
        }
    }
    assert_eq!(
        missing, restored,
        "rows not computed must be prefix restores"
    );
}

/// Run `reqs` through `server` with [`embed`]'s rows: the report, and how
/// often each request was reported done.
fn serve<S: Site>(
    server: &mut Server<S>,
    reqs: &[Request],
) -> Result<(ServerReport, Vec<u32>), ServerError> {
    let mut done = vec![0u32; reqs.len()];
    let w = Workload {
        requests: reqs,
        rows: &embed,
    };
    let report = server.run(w, &mut |i| done[i] += 1)?;
    Ok((report, done))
}

fn cfg(in_flight: usize) -> ServerConfig {
    ServerConfig {
        in_flight,
        prefill_chunk: 5,
        decode_batch: 4,
        prefetch: true,
        prefetch_ahead: true,
        backbone: None,
        decode_graphs: false,
        retries: None,
    }
}

fn engine_cfg() -> EngineConfig {
    EngineConfig {
        prefill_chunk: 5,
        block_size: 4,
        prefix_cache_bytes: 1 << 20,
        ..Default::default()
    }
}

fn served_equals_sequential(graphs: bool) {
    let gpu: Arc<dyn GpuBackend> = Arc::new(CpuBackend::new());
    let base = gpu.live_alloc_count();
    let reqs = workload(24, 7);
    let engine = tiny_engine(&gpu, &spec(), 2, 3, engine_cfg()).unwrap();
    let want = reference(engine.sites(), gpu.as_ref(), &reqs);
    let mut server = Server::new(
        engine,
        ServerConfig {
            decode_graphs: graphs,
            ..cfg(6)
        },
    )
    .unwrap();
    let (report, done) = serve(&mut server, &reqs).unwrap();
    assert!(done.iter().all(|&d| d == 1), "each request done once");
    check(&report.rows, &want, report.stats.prefix_tokens_restored);
    assert!(report.stats.prefix_hits > 0, "shared prompts hit the cache");
    assert!(report.stats.decode_tokens > 0 && report.stats.prefill_tokens > 0);
    if graphs {
        assert!(report.stats.graph_replays > 0);
    }
    assert_eq!(report.stats.sequences, 0, "every sequence released");
    assert!(report.failed.is_empty() && report.failed_calls == 0);
    server.into_engine().close().unwrap();
    assert_eq!(gpu.live_alloc_count(), base, "{}", gpu.live_report());
}

#[test]
fn served_rows_equal_a_sequential_run() {
    served_equals_sequential(false);
}

#[test]
fn served_rows_equal_a_sequential_run_with_decode_graphs() {
    served_equals_sequential(true);
}

#[test]
fn a_tiny_budget_preempts_and_swaps_without_changing_a_row() {
    let gpu: Arc<dyn GpuBackend> = Arc::new(CpuBackend::new());
    let reqs = workload(16, 11);
    let probe = tiny_engine(&gpu, &spec(), 2, 3, engine_cfg()).unwrap();
    let carry = probe.carry_bytes();
    let want = reference(probe.sites(), gpu.as_ref(), &reqs);
    probe.close().unwrap();
    let engine = tiny_engine(
        &gpu,
        &spec(),
        2,
        3,
        EngineConfig {
            device_budget_bytes: 2 * carry,
            preempt_to: SwapTarget::Host,
            ..engine_cfg()
        },
    )
    .unwrap();
    let mut server = Server::new(engine, cfg(8)).unwrap();
    let (report, _) = serve(&mut server, &reqs).unwrap();
    check(&report.rows, &want, report.stats.prefix_tokens_restored);
    assert!(report.stats.preemptions > 0, "{:?}", report.stats);
    assert!(report.stats.swap_ins > 0, "{:?}", report.stats);
    assert!(report.stats.budget.peak_bytes <= 2 * carry);
    server.into_engine().close().unwrap();
}

/// Fail the forwards a shared schedule names (every `every`th forward
/// of any site while `left` is positive), as a flaky table read would.
fn scheduled_fault(
    calls: &Arc<AtomicU64>,
    left: &Arc<AtomicU64>,
    every: u64,
) -> impl Fn(SiteCall<'_>) -> Option<String> + Send + Sync + 'static {
    let (calls, left) = (calls.clone(), left.clone());
    move |call| {
        if !matches!(call, SiteCall::Run { .. } | SiteCall::RunBatch { .. }) {
            return None;
        }
        let n = calls.fetch_add(1, Ordering::Relaxed) + 1;
        if n.is_multiple_of(every) && left.load(Ordering::Relaxed) > 0 {
            left.fetch_sub(1, Ordering::Relaxed);
            return Some(format!("injected fault at call {n}"));
        }
        None
    }
}

fn flaky_engine(
    gpu: &Arc<dyn GpuBackend>,
    faults: u64,
) -> (Engine<HookedSite<PleSite>>, Arc<AtomicU64>) {
    let calls = Arc::new(AtomicU64::new(0));
    let left = Arc::new(AtomicU64::new(faults));
    let sites = (0..2)
        .map(|i| {
            let site = tiny_site(gpu, &spec(), i, 3).unwrap();
            HookedSite::new(site, scheduled_fault(&calls, &left, 7))
        })
        .collect();
    (Engine::new(gpu.clone(), sites, engine_cfg()).unwrap(), left)
}

#[test]
fn a_failed_call_reruns_its_sequences_and_the_others_go_on() {
    let gpu: Arc<dyn GpuBackend> = Arc::new(CpuBackend::new());
    let base = gpu.live_alloc_count();
    let reqs = workload(20, 5);
    let (engine, left) = flaky_engine(&gpu, 6);
    let mut server = Server::new(
        engine,
        ServerConfig {
            retries: Some(10),
            ..cfg(6)
        },
    )
    .unwrap();
    let (report, done) = serve(&mut server, &reqs).unwrap();
    assert_eq!(left.load(Ordering::Relaxed), 0, "every fault fired");
    assert_eq!(report.failed_calls, 6);
    assert!(report.retried >= 6, "{} retried", report.retried);
    assert!(report.failed.is_empty(), "{:?}", report.failed);
    assert!(done.iter().all(|&d| d == 1));
    let first = report.first_fault.as_deref().unwrap();
    assert!(first.contains("injected fault"), "{first}");
    server.into_engine().close().unwrap();
    // The same model (same seed) without faults.
    let mut plain: Vec<PleSite> = (0..2)
        .map(|i| tiny_site(&gpu, &spec(), i, 3).unwrap())
        .collect();
    let want = reference(&plain, gpu.as_ref(), &reqs);
    for s in &mut plain {
        s.free(gpu.as_ref()).unwrap();
    }
    drop(plain);
    check(&report.rows, &want, report.stats.prefix_tokens_restored);
    assert_eq!(gpu.live_alloc_count(), base, "{}", gpu.live_report());
}

#[test]
fn without_retries_the_first_failure_ends_the_run() {
    let gpu: Arc<dyn GpuBackend> = Arc::new(CpuBackend::new());
    let reqs = workload(8, 5);
    let (engine, _) = flaky_engine(&gpu, 1);
    let mut server = Server::new(engine, cfg(4)).unwrap();
    let err = serve(&mut server, &reqs).unwrap_err();
    match &err {
        ServerError::Prefill { source, .. } | ServerError::Decode { source } => {
            assert!(
                matches!(source, EngineError::Site { .. }),
                "{}",
                source.chain()
            );
        }
        other => panic!("unexpected {other}"),
    }
    server.into_engine().close().unwrap();
}

#[test]
fn malformed_requests_and_settings_are_refused() {
    let gpu: Arc<dyn GpuBackend> = Arc::new(CpuBackend::new());
    let engine = tiny_engine(&gpu, &spec(), 1, 3, engine_cfg()).unwrap();
    let err = Server::new(engine, cfg(0)).err().unwrap();
    assert!(matches!(err, ServerError::Config(_)), "{err}");
    let engine = tiny_engine(&gpu, &spec(), 1, 3, engine_cfg()).unwrap();
    let mut server = Server::new(engine, cfg(2)).unwrap();
    for bad in [
        Request {
            tokens: vec![1, 2, 3],
            segments: vec![(Phase::Decode, 3)],
        },
        Request {
            tokens: vec![1, 2, 3],
            segments: vec![(Phase::Prefill, 2)],
        },
        Request {
            tokens: vec![1, 2, 3],
            segments: vec![(Phase::Prefill, 2), (Phase::Decode, 1), (Phase::Decode, 3)],
        },
    ] {
        let err = serve(&mut server, &[bad]).unwrap_err();
        assert!(
            matches!(err, ServerError::Request { request: 0, .. }),
            "{err}"
        );
    }
    assert_eq!(server.engine().stats().sequences, 0);
    server.into_engine().close().unwrap();
}

/// What the site of `the_next_decode_batch_is_read_a_step_ahead` saw: the
/// last token of each step prefetch entry, of each look-ahead entry, and of
/// each batched decode.
#[derive(Debug, PartialEq)]
enum Seen {
    /// A prefetch of a plan: each planned sequence's tokens.
    Prefetch(Vec<Vec<u32>>),
    Batch(Vec<u32>),
}

/// A hook that notes prefetches and batched decodes in `seen` and fails
/// nothing.
fn watch(
    seen: &Arc<std::sync::Mutex<Vec<Seen>>>,
) -> impl Fn(SiteCall<'_>) -> Option<String> + Send + Sync + 'static {
    let seen = seen.clone();
    move |call| {
        let s = match call {
            SiteCall::Prefetch { tokens } => {
                Seen::Prefetch(tokens.iter().map(|t| t.to_vec()).collect())
            }
            SiteCall::RunBatch { tokens } => Seen::Batch(tokens.to_vec()),
            _ => return None,
        };
        seen.lock().unwrap().push(s);
        None
    }
}

/// Whether `a` and `b` hold the same tokens, in any order.
fn same_tokens(a: &[u32], b: &[u32]) -> bool {
    let (mut a, mut b) = (a.to_vec(), b.to_vec());
    a.sort_unstable();
    b.sort_unstable();
    a == b
}

/// Requests of a short prompt and `generated` tokens each, no shared
/// prefix.
fn decode_heavy(n: usize, generated: usize, seed: u64) -> Vec<Request> {
    let mut rng = Rng(seed);
    (0..n)
        .map(|_| {
            let prompt = 2 + rng.below(3);
            let tokens: Vec<u32> = (0..prompt + generated)
                .map(|_| 1 + rng.below(900) as u32)
                .collect();
            Request {
                segments: vec![(Phase::Prefill, prompt), (Phase::Decode, tokens.len())],
                tokens,
            }
        })
        .collect()
}

/// With more sequences decoding than a step takes, each step starts the
/// reads of the sequences waiting behind it with their next tokens, which
/// the next step then decodes; without `prefetch_ahead` nothing is read
/// ahead; the rows served are the sequential run's either way.
#[test]
fn the_next_decode_batch_is_read_a_step_ahead() {
    let gpu: Arc<dyn GpuBackend> = Arc::new(CpuBackend::new());
    let reqs = decode_heavy(24, 10, 11);
    for ahead in [true, false] {
        let seen = Arc::new(std::sync::Mutex::new(Vec::new()));
        let sites = vec![HookedSite::new(
            tiny_site(&gpu, &spec(), 0, 3).unwrap(),
            watch(&seen),
        )];
        let engine = Engine::new(gpu.clone(), sites, engine_cfg()).unwrap();
        let want = reference(engine.sites(), gpu.as_ref(), &reqs);
        seen.lock().unwrap().clear();
        let mut server = Server::new(
            engine,
            ServerConfig {
                prefetch_ahead: ahead,
                ..cfg(16)
            },
        )
        .unwrap();
        let (report, done) = serve(&mut server, &reqs).unwrap();
        assert!(done.iter().all(|&d| d == 1));
        check(&report.rows, &want, report.stats.prefix_tokens_restored);
        let seen = std::mem::take(&mut *seen.lock().unwrap());
        // A step's own prefetch plans exactly the decode tokens of the
        // batch that follows it (and any prefill chunk); a prefetch of
        // decode tokens the next batch does not run is a look-ahead.
        let is_ahead: Vec<bool> = seen
            .iter()
            .enumerate()
            .map(|(i, s)| {
                let Seen::Prefetch(entries) = s else {
                    return false;
                };
                let decode: Vec<u32> = entries
                    .iter()
                    .filter(|e| e.len() == 1)
                    .map(|e| e[0])
                    .collect();
                let next = seen[i..].iter().find_map(|s| match s {
                    Seen::Batch(t) => Some(t.as_slice()),
                    _ => None,
                });
                !decode.is_empty() && !next.is_some_and(|t| same_tokens(t, &decode))
            })
            .collect();
        // Each batch against the look-ahead started before the batch
        // before it: the step before this one's.
        let mut batches = 0;
        let mut covered = 0;
        let (mut last_ahead, mut ahead_of_prev) = (None::<Vec<u32>>, None::<Vec<u32>>);
        for (s, &ahead_call) in seen.iter().zip(&is_ahead) {
            match s {
                Seen::Prefetch(entries) if ahead_call => {
                    last_ahead = Some(entries.iter().flatten().copied().collect());
                }
                Seen::Batch(t) => {
                    batches += 1;
                    let mut pool = ahead_of_prev.clone().unwrap_or_default();
                    let all_in = t.iter().all(|tok| {
                        pool.iter()
                            .position(|p| p == tok)
                            .map(|i| pool.swap_remove(i))
                            .is_some()
                    });
                    covered += usize::from(all_in && !t.is_empty());
                    ahead_of_prev = last_ahead.take();
                }
                Seen::Prefetch(_) => {}
            }
        }
        let aheads = is_ahead.iter().filter(|&&a| a).count();
        if ahead {
            assert!(aheads > 0);
            assert!(
                covered * 2 >= batches,
                "{covered} of {batches} batches read a step ahead"
            );
        } else {
            assert_eq!(aheads, 0);
            assert_eq!(covered, 0);
        }
    }
}
