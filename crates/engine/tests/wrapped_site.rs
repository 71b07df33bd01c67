//! The engine's one site wrapper, [`Wrapped`]: every `CarrySite` and
//! `Site` method of a wrapper that changes nothing reaches the inner site
//! with its arguments and returns the inner site's answer, for the plain
//! wrapper, the backbone's `Layered` without a backbone, and a hooked site
//! whose hook fails nothing; a middleware's check stops a call before the
//! inner site, and its `around`, `max_tokens` and `free` see what they
//! should.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use metrale_engine::backbone::layered;
use metrale_engine::wrap::{DeviceWork, SiteWrap, Wrapped, WrappedCall};
use metrale_engine::{CarrySite, Site, SiteResult};
use metrale_gpu_runtime::cpu::CpuBackend;
use metrale_gpu_runtime::gpu::{DevicePtr, GpuBackend, StreamId};
use metrale_model_layers::layers::ple::{PlanPart, SeqWork, SiteSpec};
use metrale_storage::table::TableStats;
use metrale_testkit::hooked_site::{HookedSite, PlanTokens, SiteCall};
use metrale_testkit::toy::ToySite;

type Log = Arc<Mutex<Vec<String>>>;

/// A site that answers every method with a value no default gives and
/// logs each call with its arguments.
struct Counting {
    geom: SiteSpec,
    log: Log,
}

struct State {
    history: Vec<u32>,
}

struct Plan(Vec<Vec<u32>>);

impl PlanTokens for Plan {
    fn sequences(&self) -> usize {
        self.0.len()
    }
    fn seq_tokens(&self, seq: usize) -> &[u32] {
        &self.0[seq]
    }
}

impl Counting {
    fn note(&self, s: String) {
        self.log.lock().unwrap().push(s);
    }
}

const CARRY_BYTES: usize = 4242;
const MAX_TOKENS: usize = 33;
const PRESTAGE: Option<usize> = Some(5);
const STATS: TableStats = TableStats {
    hits: 1,
    misses: 2,
    evictions: 3,
    bytes_read: 4,
    read_calls: 5,
    pages_coalesced: 6,
    io_wait_ns: 7,
    host_hits: 8,
};

impl CarrySite for Counting {
    type State = State;

    fn geometry(&self) -> SiteSpec {
        self.note("geometry".into());
        self.geom.clone()
    }
    fn carry_bytes(&self) -> usize {
        self.note("carry_bytes".into());
        CARRY_BYTES
    }
    fn new_state(&self, _gpu: &dyn GpuBackend) -> SiteResult<State> {
        self.note("new_state".into());
        Ok(State {
            history: vec![4, 5, 6],
        })
    }
    fn history<'s>(&self, st: &'s State) -> &'s [u32] {
        self.note("history".into());
        &st.history
    }
    fn snapshot(&self, st: &State, _gpu: &dyn GpuBackend, stream: StreamId) -> SiteResult<Vec<u8>> {
        self.note(format!("snapshot {:?} {stream}", st.history));
        Ok(vec![9, 8, 7])
    }
    fn restore(
        &self,
        st: &mut State,
        blob: &[u8],
        _gpu: &dyn GpuBackend,
        stream: StreamId,
    ) -> SiteResult<()> {
        self.note(format!("restore {blob:?} {stream}"));
        st.history = blob.iter().map(|&b| b as u32).collect();
        Ok(())
    }
    fn release(&self, st: &mut State, _gpu: &dyn GpuBackend) -> SiteResult<()> {
        self.note(format!("release {:?}", st.history));
        Ok(())
    }
    fn free(&mut self, _gpu: &dyn GpuBackend) -> SiteResult<()> {
        self.note("free".into());
        Ok(())
    }
}

impl Site for Counting {
    type Plan = Plan;

    fn max_tokens(&self) -> usize {
        self.note("max_tokens".into());
        MAX_TOKENS
    }
    fn plan(&self, work: &[SeqWork<'_>]) -> SiteResult<Plan> {
        self.note(format!("plan {work:?}"));
        Ok(Plan(work.iter().map(|w| w.tokens.to_vec()).collect()))
    }
    fn prefetch(&self, plan: &Plan) -> SiteResult<()> {
        self.note(format!("prefetch {:?}", plan.0));
        Ok(())
    }
    fn run(
        &self,
        plan: &Plan,
        part: PlanPart,
        st: &mut State,
        highway: DevicePtr,
        fresh: bool,
        _gpu: &dyn GpuBackend,
        stream: StreamId,
    ) -> SiteResult<()> {
        self.note(format!(
            "run {:?} {part:?} {:?} {highway} {fresh} {stream}",
            plan.0, st.history
        ));
        Ok(())
    }
    fn run_batch(
        &self,
        plan: &Plan,
        seqs: &[usize],
        states: &mut [&mut State],
        highway: DevicePtr,
        _gpu: &dyn GpuBackend,
        stream: StreamId,
    ) -> SiteResult<()> {
        self.note(format!(
            "run_batch {:?} {seqs:?} {} {highway} {stream}",
            plan.0,
            states.len()
        ));
        Ok(())
    }
    fn supports_graphs(&self) -> bool {
        self.note("supports_graphs".into());
        true
    }
    fn max_prestage_batch(&self) -> Option<usize> {
        self.note("max_prestage_batch".into());
        PRESTAGE
    }
    fn prestage(
        &self,
        plan: &Plan,
        seqs: &[usize],
        states: &mut [&mut State],
        rows: usize,
        _gpu: &dyn GpuBackend,
        stream: StreamId,
    ) -> SiteResult<()> {
        self.note(format!(
            "prestage {:?} {seqs:?} {} {rows} {stream}",
            plan.0,
            states.len()
        ));
        Ok(())
    }
    fn forward_prestaged(
        &self,
        states: &mut [&mut State],
        highway: DevicePtr,
        rows: usize,
        _gpu: &dyn GpuBackend,
        stream: StreamId,
    ) -> SiteResult<()> {
        self.note(format!(
            "forward_prestaged {} {highway} {rows} {stream}",
            states.len()
        ));
        Ok(())
    }
    fn note_replayed(
        &self,
        states: &mut [&mut State],
        _gpu: &dyn GpuBackend,
        stream: StreamId,
    ) -> SiteResult<()> {
        self.note(format!("note_replayed {} {stream}", states.len()));
        Ok(())
    }
    fn rearm(&self, st: &mut State) {
        self.note(format!("rearm {:?}", st.history));
    }
    fn table_stats(&self) -> TableStats {
        self.note("table_stats".into());
        STATS
    }
}

fn counting() -> (Counting, Log) {
    let log = Log::default();
    let site = Counting {
        geom: ToySite::new(8, 2, 0, 16).geom,
        log: log.clone(),
    };
    (site, log)
}

const HW: DevicePtr = DevicePtr(0x1000);
const STREAM: StreamId = 3;

/// Call every method of `site` once, checking each answer is the inner
/// site's; the calls the inner site should have logged, in order.
fn call_everything(
    site: &mut impl Site<State = State, Plan = Plan>,
    gpu: &dyn GpuBackend,
) -> Vec<String> {
    assert_eq!(site.geometry(), ToySite::new(8, 2, 0, 16).geom);
    assert_eq!(site.carry_bytes(), CARRY_BYTES);
    let mut st = site.new_state(gpu).unwrap();
    assert_eq!(site.history(&st), &[4, 5, 6]);
    assert_eq!(site.snapshot(&st, gpu, STREAM).unwrap(), vec![9, 8, 7]);
    site.restore(&mut st, &[1, 2], gpu, STREAM).unwrap();
    assert_eq!(site.max_tokens(), MAX_TOKENS);
    let work = [SeqWork::new(&[1], &[2, 3]), SeqWork::new(&[], &[4])];
    let plan = site.plan(&work).unwrap();
    site.prefetch(&plan).unwrap();
    let part = PlanPart {
        seq: 0,
        from: 1,
        len: 1,
    };
    site.run(&plan, part, &mut st, HW, true, gpu, STREAM)
        .unwrap();
    let mut other = State { history: vec![] };
    site.run_batch(&plan, &[1, 0], &mut [&mut st, &mut other], HW, gpu, STREAM)
        .unwrap();
    assert!(site.supports_graphs());
    assert_eq!(site.max_prestage_batch(), PRESTAGE);
    site.prestage(&plan, &[1], &mut [&mut st], 4, gpu, STREAM)
        .unwrap();
    site.forward_prestaged(&mut [&mut st], HW, 4, gpu, STREAM)
        .unwrap();
    site.note_replayed(&mut [&mut st], gpu, STREAM).unwrap();
    site.rearm(&mut st);
    assert_eq!(site.table_stats(), STATS);
    site.release(&mut st, gpu).unwrap();
    site.free(gpu).unwrap();
    [
        "geometry".to_string(),
        "carry_bytes".into(),
        "new_state".into(),
        "history".into(),
        format!("snapshot [4, 5, 6] {STREAM}"),
        format!("restore [1, 2] {STREAM}"),
        "max_tokens".into(),
        format!("plan {work:?}"),
        "prefetch [[2, 3], [4]]".into(),
        format!("run [[2, 3], [4]] {part:?} [1, 2] {HW} true {STREAM}"),
        format!("run_batch [[2, 3], [4]] [1, 0] 2 {HW} {STREAM}"),
        "supports_graphs".into(),
        "max_prestage_batch".into(),
        format!("prestage [[2, 3], [4]] [1] 1 4 {STREAM}"),
        format!("forward_prestaged 1 {HW} 4 {STREAM}"),
        format!("note_replayed 1 {STREAM}"),
        "rearm [1, 2]".into(),
        "table_stats".into(),
        "release [1, 2]".into(),
        "free".into(),
    ]
    .into()
}

/// `site` over the counting site whose calls `log` holds: every call
/// reached it, once, as it was made. A middleware may read the inner
/// site's counters for itself (the backbone times its waits by them), so
/// the `table_stats` calls besides the one made (after `rearm`) are left
/// out.
fn forwards_everything(mut site: impl Site<State = State, Plan = Plan>, log: &Log) {
    let gpu = CpuBackend::new();
    log.lock().unwrap().clear();
    let want = call_everything(&mut site, &gpu);
    let log = log.lock().unwrap();
    let got: Vec<&String> = log
        .iter()
        .enumerate()
        .filter(|&(i, c)| c != "table_stats" || i > 0 && log[i - 1].starts_with("rearm"))
        .map(|(_, c)| c)
        .collect();
    assert_eq!(got, want.iter().collect::<Vec<_>>());
}

#[test]
fn the_counting_site_itself_logs_every_call() {
    let (site, log) = counting();
    forwards_everything(site, &log);
}

#[test]
fn a_wrapper_that_changes_nothing_is_the_inner_site() {
    let (site, log) = counting();
    forwards_everything(Wrapped::<_, ()>::new(site, ()), &log);
}

#[test]
fn layered_without_a_backbone_is_the_inner_site() {
    let (site, log) = counting();
    let gpu = CpuBackend::new();
    let mut sites = layered(&gpu, vec![site], None, 64).unwrap();
    assert_eq!(sites[0].blocks(), (0, 0));
    forwards_everything(sites.pop().unwrap(), &log);
}

#[test]
fn a_hooked_site_whose_hook_fails_nothing_is_the_inner_site() {
    let (site, log) = counting();
    let shown = Arc::new(Mutex::new(Vec::new()));
    let s = shown.clone();
    let hooked = HookedSite::new(site, move |call: SiteCall<'_>| {
        s.lock().unwrap().push(format!("{call:?}"));
        None
    });
    forwards_everything(hooked, &log);
    // The hook saw the checked calls, with the tokens they run.
    let shown = shown.lock().unwrap();
    assert_eq!(shown.len(), 6, "{shown:?}");
    assert_eq!(shown[0], "Snapshot");
    assert_eq!(shown[1], "Restore");
    assert!(shown[2].starts_with("Plan"));
    assert_eq!(shown[3], "Prefetch { tokens: [[2, 3], [4]] }");
    assert_eq!(shown[4], "Run { tokens: [3] }");
    assert_eq!(shown[5], "RunBatch { tokens: [4, 2] }");
}

/// A middleware that refuses every checked call while `refuse` is set,
/// and notes what it sees.
struct Strict {
    seen: Log,
    refuse: AtomicBool,
}

impl SiteWrap<Counting> for Strict {
    fn check(&self, call: WrappedCall<'_, Plan>) -> SiteResult<()> {
        let name = match call {
            WrappedCall::Plan { .. } => "plan",
            WrappedCall::Prefetch { .. } => "prefetch",
            WrappedCall::Run { part, .. } => {
                assert_eq!(part.len, 2);
                "run"
            }
            WrappedCall::RunBatch { seqs, .. } => {
                assert_eq!(seqs, &[0]);
                "run_batch"
            }
            WrappedCall::Snapshot => "snapshot",
            WrappedCall::Restore => "restore",
        };
        if !self.refuse.load(Ordering::Relaxed) {
            return Ok(());
        }
        Err(format!("refused {name}").into())
    }
    fn around(
        &self,
        inner: &Counting,
        work: DeviceWork<'_>,
        run: impl FnOnce() -> SiteResult<()>,
    ) -> SiteResult<()> {
        assert_eq!(inner.table_stats(), STATS);
        self.seen.lock().unwrap().push(format!(
            "around {:?} {} {}",
            work.kind, work.highway, work.rows
        ));
        run()?;
        self.seen.lock().unwrap().push("after".into());
        Ok(())
    }
    fn max_tokens(&self, inner: usize) -> usize {
        inner - 1
    }
    fn free(&mut self, _gpu: &dyn GpuBackend) -> SiteResult<()> {
        self.seen.lock().unwrap().push("free".into());
        Err("the middleware's free failed".into())
    }
}

#[test]
fn a_middleware_sees_the_calls_it_changes() {
    let gpu = CpuBackend::new();
    let (site, log) = counting();
    let seen = Log::default();
    let strict = Strict {
        seen: seen.clone(),
        refuse: AtomicBool::new(true),
    };
    let mut w: Wrapped<_, Strict> = Wrapped::new(site, strict);
    assert_eq!(w.max_tokens(), MAX_TOKENS - 1);
    let mut st = w.new_state(&gpu).unwrap();
    let plan = Plan(vec![vec![1, 2]]);
    let part = PlanPart {
        seq: 0,
        from: 0,
        len: 2,
    };
    log.lock().unwrap().clear();
    let refused = [
        w.snapshot(&st, &gpu, 0).map(drop).unwrap_err(),
        w.restore(&mut st, &[], &gpu, 0).unwrap_err(),
        w.plan(&[]).map(drop).unwrap_err(),
        w.prefetch(&plan).unwrap_err(),
        w.run(&plan, part, &mut st, HW, false, &gpu, 0).unwrap_err(),
        w.run_batch(&plan, &[0], &mut [&mut st], HW, &gpu, 0)
            .unwrap_err(),
    ];
    let refused: Vec<String> = refused.iter().map(|e| e.to_string()).collect();
    assert_eq!(
        refused,
        [
            "snapshot",
            "restore",
            "plan",
            "prefetch",
            "run",
            "run_batch"
        ]
        .map(|n| format!("refused {n}"))
    );
    // Refused calls never reach the inner site, nor the middleware's
    // `around`.
    assert!(log.lock().unwrap().is_empty(), "{:?}", log.lock().unwrap());
    assert!(seen.lock().unwrap().is_empty());
    // The prestaged forward is not checked; `around` wraps it.
    w.forward_prestaged(&mut [&mut st], HW, 3, &gpu, 0).unwrap();
    assert_eq!(
        *seen.lock().unwrap(),
        [format!("around Prestaged {HW} 3"), "after".into()]
    );
    assert_eq!(
        log.lock().unwrap().last().unwrap(),
        &format!("forward_prestaged 1 {HW} 3 0")
    );
    // Passed checks reach the inner site, the runs inside `around`.
    w.wrap().refuse.store(false, Ordering::Relaxed);
    seen.lock().unwrap().clear();
    w.run(&plan, part, &mut st, HW, false, &gpu, 0).unwrap();
    w.run_batch(&plan, &[0], &mut [&mut st], HW, &gpu, 0)
        .unwrap();
    assert_eq!(
        *seen.lock().unwrap(),
        [
            format!("around Run {HW} 2"),
            "after".into(),
            format!("around RunBatch {HW} 1"),
            "after".into()
        ]
    );
    {
        let log = log.lock().unwrap();
        let log: Vec<&String> = log.iter().filter(|c| *c != "table_stats").collect();
        assert!(log[log.len() - 2].starts_with("run "), "{log:?}");
        assert!(log[log.len() - 1].starts_with("run_batch "), "{log:?}");
    }
    // `free` frees the inner site first, then the middleware; the inner
    // site's answer comes first, then the middleware's error.
    let e = w.free(&gpu).unwrap_err();
    assert_eq!(e.to_string(), "the middleware's free failed");
    assert_eq!(log.lock().unwrap().last().unwrap(), "free");
    assert_eq!(seen.lock().unwrap().last().unwrap(), "free");
}
