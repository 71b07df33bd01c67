//! The plain sequential reference run and the randomised engine driver
//! that checks an engine against it.
//!
//! Invariant: the reference run feeds every site one fresh carry and
//! forwards of at most `max_tokens` tokens, with the same input rows
//! ([`crate::rows::rows_for`]) the driver feeds the engine, so any
//! difference is the engine's.

use std::collections::HashMap;

use metrale_engine::engine::forward_tokens;
use metrale_engine::{Engine, SeqId, Site, SwapTarget};
use metrale_gpu_runtime::gpu::GpuBackend;

use crate::Rng;
use crate::rows::rows_for;

/// Every site applied to `tokens` from a fresh carry, one forward per
/// `max_tokens` tokens: the plain sequential run over the input rows
/// [`rows_for`] gives.
pub fn reference_run<S: Site>(sites: &[S], gpu: &dyn GpuBackend, tokens: &[u32]) -> Vec<f32> {
    let g = sites[0].geometry();
    let rows = rows_for(tokens, 0, tokens.len(), g.hc_mult * g.hidden);
    sequential_run(sites, gpu, tokens, rows)
}

/// Every site applied to `tokens` from a fresh carry, one forward per
/// `max_tokens` tokens, over the input rows `rows` (`tokens.len()` rows of
/// the highway width): the output rows.
pub fn sequential_run<S: Site>(
    sites: &[S],
    gpu: &dyn GpuBackend,
    tokens: &[u32],
    mut rows: Vec<f32>,
) -> Vec<f32> {
    let g = sites[0].geometry();
    let width = g.hc_mult * g.hidden;
    assert_eq!(rows.len(), tokens.len() * width, "input rows");
    let cap = sites.iter().map(Site::max_tokens).min().unwrap();
    let hw = gpu.alloc(cap * width * 4, "reference highway").unwrap();
    let mut states: Vec<S::State> = sites.iter().map(|s| s.new_state(gpu).unwrap()).collect();
    let mut done = 0;
    while done < tokens.len() {
        let n = (tokens.len() - done).min(cap);
        let chunk = &mut rows[done * width..(done + n) * width];
        let bytes: Vec<u8> = chunk.iter().flat_map(|v| v.to_le_bytes()).collect();
        gpu.copy_h2d(&bytes, hw).unwrap();
        for (s, st) in sites.iter().zip(states.iter_mut()) {
            forward_tokens(s, st, &tokens[done..done + n], None, hw, done == 0, gpu, 0).unwrap();
        }
        let mut back = vec![0u8; bytes.len()];
        gpu.copy_d2h_on_stream(hw, &mut back, 0).unwrap();
        for (v, b) in chunk.iter_mut().zip(back.chunks_exact(4)) {
            *v = f32::from_le_bytes(b.try_into().unwrap());
        }
        done += n;
    }
    for (s, st) in sites.iter().zip(states.iter_mut()) {
        s.release(st, gpu).unwrap();
    }
    gpu.dealloc(hw).unwrap();
    rows
}

/// What the driver knows about one sequence.
#[derive(Default)]
struct Track {
    /// The prompt still to prefill.
    prompt_left: Vec<u32>,
    /// Committed tokens.
    tokens: Vec<u32>,
    /// Output row of each committed position (None: restored from cache).
    outputs: Vec<Option<Vec<f32>>>,
    /// Rejected drafts: (context, output rows of its last draft tokens).
    drafts: Vec<(Vec<u32>, usize, Vec<f32>)>,
}

/// Counters of what a drive exercised.
#[derive(Debug, Default)]
pub struct Exercised {
    /// Sequences added.
    pub added: usize,
    /// Rows compared bit for bit.
    pub rows_checked: usize,
    /// Commits by acceptance length.
    pub accept_lengths: Vec<usize>,
}

fn assert_rows_eq(what: &str, got: &[f32], want: &[f32]) {
    assert_eq!(got.len(), want.len(), "{what}: row length");
    for (i, (a, b)) in got.iter().zip(want).enumerate() {
        assert!(
            a.to_bits() == b.to_bits(),
            "{what}: value {i}: engine {a:e}, sequential {b:e}"
        );
    }
}

fn check_track<S: Site>(e: &Engine<S>, id: SeqId, t: &Track, ex: &mut Exercised) {
    let w = e.width();
    let gpu = e.gpu().clone();
    assert_eq!(
        e.tokens(id).unwrap(),
        &t.tokens[..],
        "sequence {id}: token list"
    );
    let want = reference_run(e.sites(), gpu.as_ref(), &t.tokens);
    for (p, o) in t.outputs.iter().enumerate() {
        if let Some(o) = o {
            assert_rows_eq(
                &format!("sequence {id} position {p}"),
                o,
                &want[p * w..(p + 1) * w],
            );
            ex.rows_checked += 1;
        }
    }
    for (ctx, n, rows) in &t.drafts {
        let want = reference_run(e.sites(), gpu.as_ref(), ctx);
        let from = ctx.len() - n;
        assert_rows_eq(
            &format!("sequence {id} draft at {from}"),
            rows,
            &want[from * w..],
        );
        ex.rows_checked += n;
    }
}

/// Drive `e` through `steps` random operations over up to `live` sequences
/// at a time, checking every output row against [`reference_run`] when each
/// sequence is released. Prompts share stems so the prefix cache hits.
///
/// Decode batches hold at most `max_batch` sequences (what the budget holds).
pub fn drive<S: Site>(
    e: &mut Engine<S>,
    seed: u64,
    steps: usize,
    live: usize,
    max_batch: usize,
) -> Exercised {
    let mut rng = Rng(seed);
    let w = e.width();
    let vocab = 40u32;
    let stems: Vec<Vec<u32>> = (0..5)
        .map(|_| {
            let n = 6 + rng.below(18);
            (0..n).map(|_| rng.below(vocab as usize) as u32).collect()
        })
        .collect();
    let mut tracks: HashMap<SeqId, Track> = HashMap::new();
    let mut ex = Exercised {
        accept_lengths: vec![0; 8],
        ..Default::default()
    };
    for _step in 0..steps {
        let ids: Vec<SeqId> = {
            let mut v: Vec<SeqId> = tracks.keys().copied().collect();
            v.sort();
            v
        };
        let op = rng.below(100);
        if ids.len() < live && (ids.is_empty() || op < 12) {
            // Add: a stem prefix (often whole) plus a random tail.
            let stem = &stems[rng.below(stems.len())];
            let keep = if rng.pct(70) {
                stem.len()
            } else {
                rng.below(stem.len() + 1)
            };
            let mut prompt = stem[..keep].to_vec();
            for _ in 0..1 + rng.below(12) {
                // Token 0 is EOS in the test geometries: segments restart.
                prompt.push(if rng.pct(5) {
                    0
                } else {
                    rng.below(vocab as usize) as u32
                });
            }
            let a = e.add_sequence(&prompt).unwrap();
            assert!(a.cached < prompt.len());
            assert_eq!(e.tokens(a.id).unwrap(), &prompt[..a.cached]);
            tracks.insert(
                a.id,
                Track {
                    prompt_left: prompt[a.cached..].to_vec(),
                    tokens: prompt[..a.cached].to_vec(),
                    outputs: vec![None; a.cached],
                    drafts: Vec::new(),
                },
            );
            ex.added += 1;
            continue;
        }
        let id = ids[rng.below(ids.len())];
        match op {
            0..=29 => {
                // Prefill part of what is left of the prompt.
                let t = tracks.get_mut(&id).unwrap();
                if t.prompt_left.is_empty() {
                    continue;
                }
                let n = 1 + rng.below(t.prompt_left.len());
                let chunk: Vec<u32> = t.prompt_left.drain(..n).collect();
                let start = t.tokens.len();
                t.tokens.extend_from_slice(&chunk);
                let mut rows = rows_for(&t.tokens, start, t.tokens.len(), w);
                e.prefill(id, &chunk, &mut rows).unwrap();
                for r in rows.chunks_exact(w) {
                    t.outputs.push(Some(r.to_vec()));
                }
            }
            30..=54 => {
                // A decode batch over started sequences with no prompt left.
                let mut batch = Vec::new();
                for &s in &ids {
                    let t = &tracks[&s];
                    if batch.len() < max_batch
                        && !t.tokens.is_empty()
                        && t.prompt_left.is_empty()
                        && rng.pct(60)
                    {
                        batch.push((s, rng.below(vocab as usize) as u32));
                    }
                }
                if batch.is_empty() {
                    continue;
                }
                let mut rows = Vec::with_capacity(batch.len() * w);
                for &(s, tok) in &batch {
                    let t = tracks.get_mut(&s).unwrap();
                    t.tokens.push(tok);
                    rows.extend(rows_for(&t.tokens, t.tokens.len() - 1, t.tokens.len(), w));
                }
                e.decode(&batch, &mut rows).unwrap();
                for (b, &(s, _)) in batch.iter().enumerate() {
                    tracks
                        .get_mut(&s)
                        .unwrap()
                        .outputs
                        .push(Some(rows[b * w..(b + 1) * w].to_vec()));
                }
            }
            55..=69 => {
                // Speculative verify, maybe a swap in between, then commit.
                let t = tracks.get_mut(&id).unwrap();
                if !t.prompt_left.is_empty() {
                    continue;
                }
                let n = 1 + rng.below(6);
                let draft: Vec<u32> = (0..n).map(|_| rng.below(vocab as usize) as u32).collect();
                let mut ctx = t.tokens.clone();
                ctx.extend_from_slice(&draft);
                let mut rows = rows_for(&ctx, t.tokens.len(), ctx.len(), w);
                e.verify(id, &draft, &mut rows).unwrap();
                if rng.pct(20) {
                    e.swap_out(id, SwapTarget::Host).unwrap();
                }
                let accepted = rng.below(n + 1);
                e.commit(id, accepted).unwrap();
                ex.accept_lengths[accepted] += 1;
                t.drafts.push((ctx.clone(), n, rows.clone()));
                t.tokens.extend_from_slice(&draft[..accepted]);
                for r in rows.chunks_exact(w).take(accepted) {
                    t.outputs.push(Some(r.to_vec()));
                }
            }
            70..=79 => {
                if e.is_resident(id).unwrap() {
                    let target = if rng.pct(50) {
                        SwapTarget::File
                    } else {
                        SwapTarget::Host
                    };
                    e.swap_out(id, target).unwrap();
                } else {
                    e.swap_in(id).unwrap();
                }
            }
            _ => {
                if rng.pct(40) || tracks[&id].prompt_left.is_empty() && rng.pct(30) {
                    let t = tracks.remove(&id).unwrap();
                    check_track(e, id, &t, &mut ex);
                    e.release(id).unwrap();
                }
            }
        }
        let b = e.stats().budget;
        assert!(b.used_bytes <= b.limit_bytes);
    }
    let mut ids: Vec<SeqId> = tracks.keys().copied().collect();
    ids.sort();
    for id in ids {
        let t = tracks.remove(&id).unwrap();
        check_track(e, id, &t, &mut ex);
        e.release(id).unwrap();
    }
    ex
}
