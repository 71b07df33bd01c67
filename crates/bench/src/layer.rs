//! Benchmark workloads of the PLE layer, shared by
//! `cargo bench --bench ids`, `--bench ple_forward` and `metrale-ple bench`.
//!
//! Each workload is set up from a [`ModelSpec`] (a preset's geometry) and
//! its sizes, and exposes the measured operation (`run`, or `prefill` and
//! `decode` for the layer) and its same-run baseline (`baseline`, or
//! `naive`) as methods; the caller does the timing. Results that must
//! agree are compared by `check`.
//!
//! Invariants: everything random is drawn from [`Rng`], a stream over the
//! production [`splitmix64`], so a run is repeatable; [`LayerForward`]
//! owns the layer it is given and frees it with everything it allocated
//! (carries, highway, stream: the layer synchronises its streams when
//! freed, so the stream goes last) in `close`, or on drop (errors then
//! ignored). Every call returns a [`BenchError`].

use std::hint::black_box;

use metrale_gpu_runtime::GpuError;
use metrale_gpu_runtime::gpu::{DevicePtr, GpuBackend, StreamId};
use metrale_storage::dtype::bf16_to_f32;
use thiserror::Error;

use metrale_model_layers::layers::ple::ids::{
    IdError, PleIdDims, PleIdHasher, ple_ngram_ids_into_plain, splitmix64,
};
use metrale_model_layers::layers::ple::{
    ForwardContext, LayerError, ModelSpec, PleLayer, PleSeqState, PleWeights, SpecError,
};

/// Why a workload could not be set up, run, checked or closed.
#[derive(Debug, Error)]
pub enum BenchError {
    /// The preset's hash constants could not be derived.
    #[error("deriving the hash constants of site {site}: {error}")]
    Derive {
        /// The site.
        site: usize,
        /// The spec's error.
        error: SpecError,
    },
    /// The hasher refused its constants or inputs.
    #[error(transparent)]
    Ids(#[from] IdError),
    /// The layer refused a call.
    #[error(transparent)]
    Layer(#[from] LayerError),
    /// A device call failed.
    #[error(transparent)]
    Gpu(#[from] GpuError),
    /// Releasing a carry failed (the seed's `release_seq_state` returns
    /// `anyhow::Result`).
    #[error("releasing a bench carry: {0:#}")]
    Release(anyhow::Error),
    /// The sizes or weights given do not fit, or the workload was closed.
    #[error("bench layer: {0}")]
    Setup(&'static str),
    /// Two results that must agree differ.
    #[error("{0}")]
    Mismatch(&'static str),
}

/// `Result` with [`BenchError`].
pub type Result<T, E = BenchError> = std::result::Result<T, E>;

/// A deterministic stream of numbers: the one splitmix64 stream
/// (`metrale_storage::splitmix`), with the draws the workloads use.
#[derive(Clone, Debug)]
pub struct Rng(u64);

impl Rng {
    /// A stream starting at `seed`.
    pub fn new(seed: u64) -> Rng {
        Rng(seed)
    }

    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        metrale_storage::splitmix::SplitMix64::step(&mut self.0)
    }

    /// Uniform in `[0, n)` (`n` 0 reads as 1).
    pub fn below(&mut self, n: u64) -> u64 {
        self.next_u64() % n.max(1)
    }

    /// Uniform in `[-a, a)`.
    pub fn f32(&mut self, a: f32) -> f32 {
        ((self.next_u64() >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0) * a
    }

    /// BF16 bits of a value uniform in `[-a, a)` (truncated).
    pub fn bf16(&mut self, a: f32) -> u16 {
        (self.f32(a).to_bits() >> 16) as u16
    }
}

/// `n` random tokens below `vocab`, with an EOS about every 500, as in
/// packed text.
pub fn tokens(n: usize, vocab: u64, eos: u32, seed: u64) -> Vec<u32> {
    let mut x = seed;
    (0..n)
        .map(|_| {
            x = splitmix64(x);
            if x.is_multiple_of(500) {
                eos
            } else {
                (x % vocab.max(1)) as u32
            }
        })
        .collect()
}

/// Site `site`'s derived hash constants.
fn site_dims(spec: &ModelSpec, site: usize) -> Result<PleIdDims> {
    Ok(spec
        .derive(site)
        .map_err(|error| BenchError::Derive { site, error })?
        .dims)
}

/// Tokens of site `site` must be below this: the family's bound on the
/// ids it hashes (Engram's compressed vocabulary when there is no token
/// map), else the vocabulary.
pub fn token_bound(spec: &ModelSpec, site: usize) -> Result<u64> {
    let dims = site_dims(spec, site)?;
    Ok(dims
        .family
        .token_limit()
        .map_or(spec.vocab_size, |l| l.min(spec.vocab_size)))
}

/// Prefill hashing: the ids of `tokens` new tokens after an EOS history,
/// through the fast hasher, against the plain `%` form.
pub struct IdsPrefill {
    dims: PleIdDims,
    hasher: PleIdHasher,
    portable: PleIdHasher,
    history: Vec<u32>,
    tokens: Vec<u32>,
    fast: Vec<u64>,
    scalar: Vec<u64>,
    plain: Vec<u64>,
    portable_ran: bool,
}

impl IdsPrefill {
    /// Site `site` of `spec`, `tokens` random tokens (seed 42).
    pub fn new(spec: &ModelSpec, site: usize, tokens: usize) -> Result<Self> {
        let dims = site_dims(spec, site)?;
        let hasher = PleIdHasher::new(&dims)?;
        let portable = PleIdHasher::new_portable(&dims)?;
        let out = tokens * dims.ngram_heads();
        Ok(IdsPrefill {
            history: vec![dims.eos_token_id; dims.context_len()],
            tokens: self::tokens(tokens, token_bound(spec, site)?, dims.eos_token_id, 42),
            hasher,
            portable,
            dims,
            fast: vec![0; out],
            scalar: vec![0; out],
            plain: vec![0; out],
            portable_ran: false,
        })
    }

    /// Tokens hashed per call.
    pub fn tokens(&self) -> usize {
        self.tokens.len()
    }

    /// Ids per token.
    pub fn heads(&self) -> usize {
        self.dims.ngram_heads()
    }

    /// The fast hasher's code path (`avx2`, `scalar`, ...).
    pub fn path(&self) -> &'static str {
        self.hasher.path()
    }

    /// The measured operation: the fast hasher.
    pub fn run(&mut self) -> Result<()> {
        self.hasher.ids_with_history_into(
            black_box(&self.history),
            black_box(&self.tokens),
            &mut self.fast,
        )?;
        black_box(&self.fast);
        Ok(())
    }

    /// The fast hasher's portable (reciprocal, no SIMD) path.
    pub fn portable(&mut self) -> Result<()> {
        self.portable.ids_with_history_into(
            black_box(&self.history),
            black_box(&self.tokens),
            &mut self.scalar,
        )?;
        black_box(&self.scalar);
        self.portable_ran = true;
        Ok(())
    }

    /// The baseline: the plain `%` form.
    pub fn baseline(&mut self) -> Result<()> {
        ple_ngram_ids_into_plain(
            &self.dims,
            black_box(&self.history),
            black_box(&self.tokens),
            &mut self.plain,
        )?;
        black_box(&self.plain);
        Ok(())
    }

    /// Fails unless [`run`](Self::run) and [`baseline`](Self::baseline)
    /// (and [`portable`](Self::portable), if it ran) wrote the same ids.
    pub fn check(&self) -> Result<()> {
        if self.fast != self.plain {
            return Err(BenchError::Mismatch("fast and plain ids differ"));
        }
        if self.portable_ran && self.scalar != self.plain {
            return Err(BenchError::Mismatch("portable and plain ids differ"));
        }
        Ok(())
    }
}

/// Batched decode hashing: one new token for each of `batch` sequences,
/// each with its own history, in one call, against the plain `%` form per
/// sequence.
pub struct IdsDecode {
    dims: PleIdDims,
    hasher: PleIdHasher,
    histories: Vec<u32>,
    tokens: Vec<u32>,
    out: Vec<u64>,
    reference: Vec<u64>,
}

impl IdsDecode {
    /// Site `site` of `spec`, `batch` sequences with random histories and
    /// tokens (seed 42).
    pub fn new(spec: &ModelSpec, site: usize, batch: usize) -> Result<Self> {
        let dims = site_dims(spec, site)?;
        let hasher = PleIdHasher::new(&dims)?;
        let c = dims.context_len();
        let all = tokens(
            batch * (c + 1),
            token_bound(spec, site)?,
            dims.eos_token_id,
            42,
        );
        let (histories, new) = all.split_at(batch * c);
        let out = batch * dims.ngram_heads();
        Ok(IdsDecode {
            histories: histories.to_vec(),
            tokens: new.to_vec(),
            hasher,
            dims,
            out: vec![0; out],
            reference: vec![0; out],
        })
    }

    /// Sequences per call.
    pub fn batch(&self) -> usize {
        self.tokens.len()
    }

    /// The fast hasher's code path.
    pub fn path(&self) -> &'static str {
        self.hasher.path()
    }

    /// The measured operation: one batched call.
    pub fn run(&mut self) -> Result<()> {
        self.hasher.decode_batch_flat_into(
            black_box(&self.histories),
            black_box(&self.tokens),
            &mut self.out,
        )?;
        black_box(&self.out);
        Ok(())
    }

    /// The baseline: the plain `%` form, one call per sequence.
    pub fn baseline(&mut self) -> Result<()> {
        let (c, heads) = (self.dims.context_len(), self.dims.ngram_heads());
        for i in 0..self.tokens.len() {
            ple_ngram_ids_into_plain(
                &self.dims,
                black_box(&self.histories[c * i..c * (i + 1)]),
                black_box(&self.tokens[i..i + 1]),
                &mut self.reference[i * heads..(i + 1) * heads],
            )?;
        }
        black_box(&self.reference);
        Ok(())
    }

    /// Fails unless the batched and per-sequence ids agree.
    pub fn check(&self) -> Result<()> {
        if self.out != self.reference {
            return Err(BenchError::Mismatch("batched and per-sequence ids differ"));
        }
        Ok(())
    }
}

/// `y = x @ W^T` as a plain loop over the unpacked BF16 weights
/// (`key_proj` then `value_proj`) for one token of `e` inputs: the
/// baseline of the forward benchmarks.
pub fn naive_project(x: &[f32], w: &PleWeights, e: usize, y: &mut [f32]) {
    let rows = w
        .key_proj
        .chunks_exact(e)
        .chain(w.value_proj.chunks_exact(e));
    for (o, wr) in y.iter_mut().zip(rows) {
        let mut acc = 0.0f32;
        for (a, &b) in x.iter().zip(wr) {
            acc += a * bf16_to_f32(b);
        }
        *o = acc;
    }
}

/// Random weights for a site of `spec` (BF16 projections of amplitude
/// 0.02, norms 0.1, conv 0.5), drawn from `rng`.
pub fn random_weights(spec: &ModelSpec, rng: &mut Rng) -> PleWeights {
    let (e, c, h) = (spec.emb_dim(), spec.channels(), spec.hidden_size);
    PleWeights {
        key_proj: (0..c * e).map(|_| rng.bf16(0.02)).collect(),
        value_proj: (0..h * e).map(|_| rng.bf16(0.02)).collect(),
        norm_key: (0..c).map(|_| rng.f32(0.1)).collect(),
        norm_query: (0..c).map(|_| rng.f32(0.1)).collect(),
        norm_conv: (0..c).map(|_| rng.f32(0.1)).collect(),
        conv1d: (0..c * spec.conv_kernel_size)
            .map(|_| rng.f32(0.5))
            .collect(),
        key_bias: Vec::new(),
        value_bias: Vec::new(),
    }
}

/// The sizes of [`LayerForward`].
#[derive(Clone, Copy, Debug)]
pub struct LayerSizes {
    /// Tokens per prefill chunk (one sequence).
    pub prefill_tokens: usize,
    /// Sequences per decode step (one token each).
    pub decode_batch: usize,
    /// Tokens are drawn below this.
    pub vocab: u64,
}

/// One PLE layer's forward through its backend: a prefill chunk of one
/// sequence and a batched decode step, against a naive scalar projection
/// of one token on one thread (the projection alone).
pub struct LayerForward<'a> {
    layer: PleLayer,
    weights: &'a PleWeights,
    gpu: &'a dyn GpuBackend,
    sizes: LayerSizes,
    rng: Rng,
    /// The highway and the stream; `None` once freed.
    dev: Option<(DevicePtr, StreamId)>,
    /// The prefill sequence, then the decode batch.
    states: Vec<PleSeqState>,
    x: Vec<f32>,
    y: Vec<f32>,
    e: usize,
}

impl<'a> LayerForward<'a> {
    /// Set up over `layer` (built for at least `max(prefill_tokens,
    /// decode_batch)` tokens) whose unpacked weights are `weights`: a
    /// random highway, one prefill carry warmed by one chunk, and a decode
    /// batch whose fresh carries were reset by one step. The layer is freed
    /// with the workload, also when this fails.
    pub fn new(
        mut layer: PleLayer,
        weights: &'a PleWeights,
        gpu: &'a dyn GpuBackend,
        sizes: LayerSizes,
        seed: u64,
    ) -> Result<Self> {
        let (t, b) = (sizes.prefill_tokens, sizes.decode_batch);
        let c = layer.channels();
        let e = layer.dims().ngram_heads() * layer.head_dim();
        let h = layer.hidden();
        let dev = (|| -> Result<(DevicePtr, StreamId)> {
            if t == 0 || b == 0 {
                return Err(BenchError::Setup("sizes must be positive"));
            }
            // A site without a gate (LongCat's mean) has no key projection.
            let keys = weights.key_proj.len();
            if (keys != c * e && keys != 0) || weights.value_proj.len() != h * e {
                return Err(BenchError::Setup("the weights do not match the layer"));
            }
            let stream = gpu.create_stream()?;
            match gpu.alloc(t.max(b) * c * 4, "bench highway") {
                Ok(p) => Ok((p, stream)),
                Err(err) => {
                    let _ = gpu.destroy_stream(stream);
                    Err(err.into())
                }
            }
        })();
        let (highway, stream) = match dev {
            Ok(d) => d,
            Err(err) => {
                let _ = layer.free(gpu);
                return Err(err);
            }
        };
        let mut w = LayerForward {
            layer,
            weights,
            gpu,
            sizes,
            rng: Rng::new(seed),
            dev: Some((highway, stream)),
            states: Vec::new(),
            x: (0..e)
                .map(|i| bf16_to_f32((i as u16).wrapping_mul(7919)))
                .collect(),
            y: vec![0.0; (weights.key_proj.len() + weights.value_proj.len()) / e.max(1)],
            e,
        };
        let init: Vec<u8> = (0..t.max(b) * c)
            .flat_map(|_| w.rng.f32(1.0).to_le_bytes())
            .collect();
        gpu.copy_h2d(&init, highway)?;
        for _ in 0..=b {
            let st = w.layer.new_seq_state(gpu)?;
            w.states.push(st);
        }
        w.prefill()?;
        w.decode()?;
        Ok(w)
    }

    /// The sizes.
    pub fn sizes(&self) -> LayerSizes {
        self.sizes
    }

    fn dev(&self) -> Result<(DevicePtr, StreamId)> {
        self.dev.ok_or(BenchError::Setup("the workload was closed"))
    }

    fn draw(&mut self, n: usize) -> Vec<u32> {
        (0..n)
            .map(|_| self.rng.below(self.sizes.vocab) as u32)
            .collect()
    }

    /// The measured operation: one chunk of `prefill_tokens` new random
    /// tokens through the prefill sequence, and a synchronize.
    pub fn prefill(&mut self) -> Result<()> {
        let (highway, stream) = self.dev()?;
        let toks = self.draw(self.sizes.prefill_tokens);
        let ctx = ForwardContext::new(self.gpu).with_host_ids(&toks);
        self.layer.forward(
            &mut self.states[0],
            highway,
            toks.len(),
            false,
            &ctx,
            stream,
        )?;
        Ok(self.gpu.synchronize(stream)?)
    }

    /// The measured operation: one batched decode step, one new random
    /// token for each of `decode_batch` sequences, and a synchronize.
    pub fn decode(&mut self) -> Result<()> {
        let (highway, stream) = self.dev()?;
        let toks = self.draw(self.sizes.decode_batch);
        let ctx = ForwardContext::new(self.gpu).with_host_ids(&toks);
        let mut batch: Vec<&mut PleSeqState> = self.states[1..].iter_mut().collect();
        self.layer
            .forward_batch(&mut batch, highway, toks.len(), &ctx, stream)?;
        Ok(self.gpu.synchronize(stream)?)
    }

    /// The baseline: [`naive_project`] of one token.
    pub fn naive(&mut self) {
        naive_project(black_box(&self.x), self.weights, self.e, &mut self.y);
        black_box(&self.y);
    }

    fn free(&mut self) -> Result<()> {
        let mut r: Result<()> = Ok(());
        for st in &mut self.states {
            keep_first(
                &mut r,
                self.layer
                    .release_seq_state(st, self.gpu)
                    .map_err(BenchError::Release),
            );
        }
        self.states.clear();
        keep_first(&mut r, self.layer.free(self.gpu));
        if let Some((highway, stream)) = self.dev.take() {
            keep_first(&mut r, self.gpu.dealloc(highway));
            keep_first(&mut r, self.gpu.destroy_stream(stream));
        }
        r
    }

    /// Release the carries, free the layer, the highway and the stream; the
    /// first error wins.
    pub fn close(mut self) -> Result<()> {
        self.free()
    }
}

impl Drop for LayerForward<'_> {
    fn drop(&mut self) {
        let _ = self.free();
    }
}

/// Keep the first error of a sequence of clean-up steps.
fn keep_first<E: Into<BenchError>>(acc: &mut Result<()>, r: Result<(), E>) {
    if let (Ok(()), Err(e)) = (&acc, r) {
        *acc = Err(e.into());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec() -> ModelSpec {
        ModelSpec::from_json_str(
            r#"{"vocab_size": 1000, "hidden_size": 32, "hc_mult": 2,
                "rms_norm_eps": 1e-6, "eos_token_id": 0, "ngram_size": 3,
                "heads_per_ngram": 2, "ple_head_dim": 16,
                "ngram_vocab_size_base": 200, "split_ngram_parts": 1,
                "ple_conv_kernel_size": 4, "ple_layer_ids": [1]}"#,
            "test",
        )
        .unwrap()
    }

    #[test]
    fn ids_workloads_agree_with_their_baselines() {
        let s = spec();
        let mut p = IdsPrefill::new(&s, 0, 300).unwrap();
        p.run().unwrap();
        p.portable().unwrap();
        p.baseline().unwrap();
        p.check().unwrap();
        let mut d = IdsDecode::new(&s, 0, 17).unwrap();
        d.run().unwrap();
        d.baseline().unwrap();
        d.check().unwrap();
        assert_eq!(d.batch(), 17);
    }

    #[test]
    fn rng_is_the_splitmix_stream() {
        let mut r = Rng::new(5);
        assert_eq!(r.next_u64(), splitmix64(5));
        assert_eq!(
            r.next_u64(),
            splitmix64(5u64.wrapping_add(0x9E37_79B9_7F4A_7C15))
        );
        let w = random_weights(&spec(), &mut r);
        assert_eq!(w.key_proj.len(), 64 * 64);
        let mut y = vec![0.0; 64 + 32];
        naive_project(&vec![1.0; 64], &w, 64, &mut y);
        assert!(y.iter().all(|v| v.is_finite()));
    }
}
