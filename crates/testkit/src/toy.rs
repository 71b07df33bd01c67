//! A toy engine site with the PLE carry's shape (token history and a
//! dilated conv state on the device, the aux blob of `carry_blob`) and simple
//! math, so the engine's bookkeeping can be tested on its own.
//!
//! Invariant: its forward is sequential per token, so chunking and
//! batching cannot change results.

use metrale_engine::{CarrySite, Site, SiteResult};
use metrale_gpu_runtime::gpu::{DevicePtr, GpuBackend, StreamId};
use metrale_model_layers::layers::ple::{PlanPart, SeqWork, SiteSpec};

use crate::hooked_site::PlanTokens;
use metrale_model_layers::layers::ple::carry_blob;
use metrale_model_layers::layers::ple::ids::{PleIdDims, ple_ngram_ids};

/// The toy site.
pub struct ToySite {
    /// Its geometry and hash constants.
    pub geom: SiteSpec,
    /// Conv weights, `C x kernel`.
    pub w: Vec<f32>,
    /// Most tokens per forward.
    pub max_tokens: usize,
}

/// Its plan: each sequence's tokens (its math hashes them as it runs).
pub struct ToyPlan(Vec<Vec<u32>>);

impl PlanTokens for ToyPlan {
    fn sequences(&self) -> usize {
        self.0.len()
    }
    fn seq_tokens(&self, seq: usize) -> &[u32] {
        &self.0[seq]
    }
}

/// Its carry.
pub struct ToyState {
    /// The conv state on the device.
    pub conv: DevicePtr,
    /// The carried token history.
    pub history: Vec<u32>,
}

impl ToySite {
    /// A toy site of highway width `hc * hidden`, whose hash multipliers
    /// depend on `salt`.
    pub fn new(hidden: usize, hc: usize, salt: u64, max_tokens: usize) -> Self {
        let dims = PleIdDims {
            ngram_size: 3,
            heads_per_ngram: 2,
            multipliers: vec![3 + 2 * salt, 5 + 2 * salt, 7 + 2 * salt],
            head_vocab_sizes: vec![11, 13, 17, 19],
            head_offsets: vec![0, 11, 24, 41],
            eos_token_id: 0,
            family: Default::default(),
        };
        let geom = SiteSpec::new(dims, 4, hidden, hc, 4, 3);
        let c = hidden * hc;
        let w = (0..c * 4)
            .map(|i| ((i * 7 + salt as usize) % 13) as f32 / 13.0 - 0.4)
            .collect();
        ToySite {
            geom,
            w,
            max_tokens,
        }
    }

    fn c(&self) -> usize {
        self.geom.hidden * self.geom.hc_mult
    }
}

fn f32s(b: &[u8]) -> Vec<f32> {
    b.chunks_exact(4)
        .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
        .collect()
}

fn bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

impl Site for ToySite {
    type Plan = ToyPlan;

    fn max_tokens(&self) -> usize {
        self.max_tokens
    }

    fn plan(&self, work: &[SeqWork<'_>]) -> SiteResult<ToyPlan> {
        if work.iter().any(|w| w.masked.is_some()) {
            return Err("toy: this site takes no token mask".into());
        }
        Ok(ToyPlan(work.iter().map(|w| w.tokens.to_vec()).collect()))
    }

    fn run(
        &self,
        plan: &ToyPlan,
        part: PlanPart,
        st: &mut ToyState,
        highway: DevicePtr,
        fresh: bool,
        gpu: &dyn GpuBackend,
        stream: StreamId,
    ) -> SiteResult<()> {
        let tokens = &plan.0[part.seq][part.from..part.from + part.len];
        self.forward(st, tokens, highway, fresh, gpu, stream)
    }

    fn run_batch(
        &self,
        plan: &ToyPlan,
        seqs: &[usize],
        states: &mut [&mut ToyState],
        highway: DevicePtr,
        gpu: &dyn GpuBackend,
        stream: StreamId,
    ) -> SiteResult<()> {
        for (b, (st, &s)) in states.iter_mut().zip(seqs).enumerate() {
            self.forward(
                st,
                &plan.0[s],
                highway.offset(b * self.c() * 4),
                false,
                gpu,
                stream,
            )?;
        }
        Ok(())
    }
}

impl ToySite {
    /// `tokens` of one sequence, hashed and run token after token.
    fn forward(
        &self,
        st: &mut ToyState,
        tokens: &[u32],
        highway: DevicePtr,
        fresh: bool,
        gpu: &dyn GpuBackend,
        stream: StreamId,
    ) -> SiteResult<()> {
        if tokens.len() > self.max_tokens {
            return Err("toy: too many tokens".into());
        }
        let (c, s, k, d) = (
            self.c(),
            self.geom.state_len(),
            self.geom.kernel,
            self.geom.dilation,
        );
        let ctx = self.geom.dims.context_len();
        let mut state = if fresh || st.history.len() != ctx {
            st.history = vec![self.geom.dims.eos_token_id; ctx];
            vec![0f32; s * c]
        } else {
            let mut b = vec![0u8; s * c * 4];
            gpu.copy_d2h_on_stream(st.conv, &mut b, stream)?;
            f32s(&b)
        };
        let t = tokens.len();
        let mut hb = vec![0u8; t * c * 4];
        gpu.copy_d2h_on_stream(highway, &mut hb, stream)?;
        let mut hw = f32s(&hb);
        let mut window = st.history.clone();
        window.extend_from_slice(tokens);
        let ids = ple_ngram_ids(&self.geom.dims, &window);
        let ids = &ids[ids.len() - t..];
        for i in 0..t {
            let mut xn = vec![0f32; c];
            for ch in 0..c {
                let id = ids[i][ch % ids[i].len()];
                xn[ch] = (hw[i * c + ch] * 0.5).tanh() + (id % 7) as f32 * 0.1;
            }
            for ch in 0..c {
                let mut y = 0f32;
                for j in 0..k {
                    let back = (k - 1 - j) * d;
                    let x = if back == 0 {
                        xn[ch]
                    } else {
                        state[(s - back) * c + ch]
                    };
                    y += self.w[ch * k + j] * x;
                }
                hw[i * c + ch] += y;
            }
            state.drain(..c);
            state.extend_from_slice(&xn);
        }
        st.history = window[window.len() - ctx..].to_vec();
        gpu.copy_h2d_async(&bytes(&hw), highway, stream)?;
        gpu.copy_h2d_async(&bytes(&state), st.conv, stream)?;
        Ok(())
    }
}

impl CarrySite for ToySite {
    type State = ToyState;

    fn geometry(&self) -> SiteSpec {
        self.geom.clone()
    }

    fn new_state(&self, gpu: &dyn GpuBackend) -> SiteResult<ToyState> {
        Ok(ToyState {
            conv: gpu.alloc(self.geom.conv_bytes(), "toy conv")?,
            history: Vec::new(),
        })
    }

    fn history<'s>(&self, st: &'s ToyState) -> &'s [u32] {
        &st.history
    }

    fn snapshot(
        &self,
        st: &ToyState,
        gpu: &dyn GpuBackend,
        stream: StreamId,
    ) -> SiteResult<Vec<u8>> {
        let mut conv = vec![0u8; self.geom.conv_bytes()];
        gpu.copy_d2h_on_stream(st.conv, &mut conv, stream)?;
        Ok(carry_blob::encode(&st.history, &conv))
    }

    fn restore(
        &self,
        st: &mut ToyState,
        blob: &[u8],
        gpu: &dyn GpuBackend,
        stream: StreamId,
    ) -> SiteResult<()> {
        let carry = carry_blob::decode(blob, &self.geom)?;
        st.history = carry.history_tokens();
        Ok(gpu.copy_h2d_async(carry.conv, st.conv, stream)?)
    }

    fn release(&self, st: &mut ToyState, gpu: &dyn GpuBackend) -> SiteResult<()> {
        if st.conv.is_null() {
            return Ok(());
        }
        let r = gpu.dealloc(st.conv);
        st.conv = DevicePtr::NULL;
        st.history.clear();
        Ok(r?)
    }

    fn free(&mut self, _gpu: &dyn GpuBackend) -> SiteResult<()> {
        Ok(())
    }
}
