//! The PLE kernels launched through the CPU backend: each launch equals the
//! pure kernel function bit for bit, chunked and batched launches equal one
//! call, and bad launches fail with an error naming the culprit and change
//! nothing.

use std::sync::Arc;

use anyhow::Result;
use metrale_gpu_runtime::cpu::CpuBackend;
use metrale_gpu_runtime::gpu::{DevicePtr, GpuBackend, LaunchConfig};
use metrale_model_layers::layers::ple::kernels::args::{
    ConvArgs, ConvBatchArgs, GateArgs, GatherArgs, ProjectArgs,
};
use metrale_model_layers::layers::ple::kernels::conv::{ConvDims, conv};
use metrale_model_layers::layers::ple::kernels::gate::{GateDims, GateInputs, gate};
use metrale_model_layers::layers::ple::kernels::gather::{GatherDType, RowSrc, gather_rows};
use metrale_model_layers::layers::ple::kernels::gemm::{packed_as_bf16, project};
use metrale_model_layers::layers::ple::kernels::math::bf16_round;
use metrale_model_layers::layers::ple::kernels::{
    pack_projection, packed_len, register_cpu_kernels,
};
use metrale_testkit::Rng;
use proptest::prelude::*;

/// A small geometry: H 32, hc 2, 4 heads of 8, conv 4 dilation 2.
const H: usize = 32;
const HC: usize = 2;
const C: usize = H * HC;
const HEADS: usize = 4;
const HD: usize = 8;
const E: usize = HEADS * HD;
const O: usize = C + H;
const K: usize = 4;
const D: usize = 2;
const S: usize = (K - 1) * D;
const ROWS: usize = 50;
const EPS: f32 = 1e-6;

fn lin() -> LaunchConfig {
    LaunchConfig::linear(1, 1)
}

/// A BF16 `gather` of `n` rows.
fn gather_args(refs: DevicePtr, n: usize, dtype: u32, out: DevicePtr) -> GatherArgs {
    GatherArgs {
        refs,
        n: n as u32,
        head_dim: HD as u32,
        dtype,
        out,
    }
}

/// The small geometry's `project` over `t` rows.
fn project_args(x: DevicePtr, w: DevicePtr, y: DevicePtr, t: usize) -> ProjectArgs {
    ProjectArgs {
        x,
        w,
        y,
        t: t as u32,
        e: E as u32,
        o: O as u32,
    }
}

/// The BF16 bits of a uniform value in `[-a, a)`.
fn bf16(r: &mut Rng, a: f32) -> u16 {
    (bf16_round(r.unit() * a).to_bits() >> 16) as u16
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

fn up<T: Copy>(gpu: &dyn GpuBackend, v: &[T], label: &str) -> Result<DevicePtr> {
    let bytes = std::mem::size_of_val(v);
    let p = gpu.alloc(bytes.max(1), label)?;
    // SAFETY: plain-old-data values viewed as their bytes.
    let b = unsafe { std::slice::from_raw_parts(v.as_ptr() as *const u8, bytes) };
    gpu.copy_h2d(b, p)?;
    Ok(p)
}

fn down(gpu: &dyn GpuBackend, p: DevicePtr, n: usize) -> Result<Vec<f32>> {
    let mut b = vec![0u8; n * 4];
    gpu.copy_d2h(p, &mut b)?;
    Ok(b.chunks_exact(4)
        .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
        .collect())
}

/// The model of the small geometry, on the host and on the device.
struct Fixture {
    gpu: Arc<CpuBackend>,
    base_allocs: usize,
    table: Vec<u8>,
    table_dev: DevicePtr,
    packed: Vec<f32>,
    w_dev: DevicePtr,
    norms: [Vec<f32>; 3],
    norms_dev: [DevicePtr; 3],
    conv_w: Vec<f32>,
    conv_w_dev: DevicePtr,
    temps: Vec<DevicePtr>,
}

impl Fixture {
    fn new(seed: u64) -> Result<Self> {
        let gpu = Arc::new(CpuBackend::new());
        let base_allocs = gpu.live_alloc_count();
        register_cpu_kernels(gpu.as_ref())?;
        let mut r = Rng(seed);
        let table: Vec<u8> = (0..ROWS * HD)
            .flat_map(|_| bf16(&mut r, 1.0).to_le_bytes())
            .collect();
        let w: Vec<u16> = (0..O * E).map(|_| bf16(&mut r, 0.3)).collect();
        let packed = pack_projection(&w, O, E);
        let norms = [0, 1, 2].map(|_| (0..C).map(|_| r.unit() * 0.2).collect::<Vec<f32>>());
        let conv_w: Vec<f32> = (0..C * K).map(|_| r.unit() * 0.5).collect();
        let g: &dyn GpuBackend = gpu.as_ref();
        let table_dev = up(g, &table, "table")?;
        let w_dev = up(g, &packed, "w")?;
        let norms_dev = [
            up(g, &norms[0], "nq")?,
            up(g, &norms[1], "nk")?,
            up(g, &norms[2], "nc")?,
        ];
        let conv_w_dev = up(g, &conv_w, "conv_w")?;
        Ok(Fixture {
            gpu,
            base_allocs,
            table,
            table_dev,
            packed,
            w_dev,
            norms,
            norms_dev,
            conv_w,
            conv_w_dev,
            temps: Vec::new(),
        })
    }

    fn g(&self) -> &dyn GpuBackend {
        self.gpu.as_ref()
    }

    fn tmp<T: Copy>(&mut self, v: &[T]) -> Result<DevicePtr> {
        let p = up(self.gpu.as_ref(), v, "tmp")?;
        self.temps.push(p);
        Ok(p)
    }

    fn refs(&self, ids: &[usize]) -> Vec<u64> {
        ids.iter()
            .flat_map(|&i| [self.table_dev.0 + (i * HD * 2) as u64, 0])
            .collect()
    }

    /// Free everything and check the ledger is back where it started.
    fn finish(self) -> Result<()> {
        for p in self
            .temps
            .iter()
            .chain([&self.table_dev, &self.w_dev, &self.conv_w_dev])
            .chain(&self.norms_dev)
        {
            self.gpu.dealloc(*p)?;
        }
        anyhow::ensure!(
            self.gpu.live_alloc_count() == self.base_allocs,
            "leaked: {}",
            self.g().live_report()
        );
        Ok(())
    }

    /// One sequence's `t` new rows through all four kernels on the device.
    fn chain_dev(
        &mut self,
        ids: &[usize],
        t: usize,
        hw: DevicePtr,
        state: DevicePtr,
    ) -> Result<()> {
        let refs = self.refs(ids);
        let refs_dev = self.tmp(&refs)?;
        let emb = self.tmp(&vec![0f32; t * E])?;
        let kv = self.tmp(&vec![0f32; t * O])?;
        let gated = self.tmp(&vec![0f32; t * C])?;
        let xn = self.tmp(&vec![0f32; t * C])?;
        let g = self.g();
        let k = |n| g.kernel("ple", n);
        let t32 = t as u32;
        let gather = gather_args(refs_dev, t * HEADS, 0, emb);
        g.launch(k("gather")?, lin()).args(&gather).run(0)?;
        let project = project_args(emb, self.w_dev, kv, t);
        g.launch(k("project")?, lin()).args(&project).run(0)?;
        let [norm_q, norm_k, norm_conv] = self.norms_dev;
        let gate = GateArgs {
            highway: hw,
            kv,
            norm_q,
            norm_k,
            norm_conv,
            gated,
            xn,
            t: t32,
            h: H as u32,
            hc: HC as u32,
            eps: EPS,
        };
        g.launch(k("gate")?, lin()).args(&gate).run(0)?;
        let conv = ConvArgs {
            xn,
            gated,
            state,
            w: self.conv_w_dev,
            highway: hw,
            t: t32,
            c: C as u32,
            k: K as u32,
            d: D as u32,
        };
        g.launch(k("conv")?, lin()).args(&conv).run(0)?;
        Ok(g.synchronize(0)?)
    }

    /// The same chain through the pure functions.
    fn chain_host(&self, ids: &[usize], t: usize, hw: &mut [f32], state: &mut [f32]) -> Result<()> {
        let rows: Vec<RowSrc> = ids
            .iter()
            .map(|&i| RowSrc {
                data: &self.table[i * HD * 2..(i + 1) * HD * 2],
                scale: 0.0,
            })
            .collect();
        let mut emb = vec![0f32; t * E];
        gather_rows(&rows, HD, GatherDType::Bf16, &mut emb)?;
        let mut kv = vec![0f32; t * O];
        project(&emb, packed_as_bf16(&self.packed), &mut kv, t, E, O)?;
        let (mut gated, mut xn) = (vec![0f32; t * C], vec![0f32; t * C]);
        let inp = GateInputs {
            highway: hw,
            kv: &kv,
            norm_q: &self.norms[0],
            norm_k: &self.norms[1],
            norm_conv: &self.norms[2],
        };
        gate(
            GateDims {
                t,
                h: H,
                hc: HC,
                eps: EPS,
            },
            inp,
            &mut gated,
            &mut xn,
        )?;
        conv(
            ConvDims {
                t,
                c: C,
                k: K,
                d: D,
            },
            &xn,
            &gated,
            state,
            &self.conv_w,
            hw,
        )?;
        Ok(())
    }
}

#[test]
fn launches_equal_the_pure_functions() -> Result<()> {
    let mut f = Fixture::new(1)?;
    let t = 7;
    let mut r = Rng(2);
    let ids: Vec<usize> = (0..t * HEADS)
        .map(|_| (r.next() % ROWS as u64) as usize)
        .collect();
    let hw0: Vec<f32> = (0..t * C).map(|_| r.unit()).collect();
    let st0: Vec<f32> = (0..S * C).map(|_| r.unit()).collect();
    let hw = f.tmp(&hw0)?;
    let st = f.tmp(&st0)?;
    f.chain_dev(&ids, t, hw, st)?;
    let (mut hw_h, mut st_h) = (hw0.clone(), st0.clone());
    f.chain_host(&ids, t, &mut hw_h, &mut st_h)?;
    assert_eq!(bits(&down(f.g(), hw, t * C)?), bits(&hw_h));
    assert_eq!(bits(&down(f.g(), st, S * C)?), bits(&st_h));
    assert_ne!(bits(&hw_h), bits(&hw0));
    // Registering again is harmless.
    register_cpu_kernels(f.g())?;
    f.finish()
}

#[test]
fn fp8_gather_scales_and_rounds() -> Result<()> {
    let mut f = Fixture::new(3)?;
    let bytes: Vec<u8> = vec![0x38, 0xBC, 0x01, 0x7E, 0x3C, 0x00];
    let scales: Vec<f32> = vec![3.0, 1.0 + 2f32.powi(-9)];
    let data = f.tmp(&bytes)?;
    let sc = f.tmp(&scales)?;
    let refs: Vec<u64> = vec![data.0 + 3, sc.0 + 4, data.0, sc.0];
    let refs_dev = f.tmp(&refs)?;
    let out = f.tmp(&[0f32; 6])?;
    let g = f.g();
    g.launch(g.kernel("ple", "gather")?, lin())
        .args(&GatherArgs {
            refs: refs_dev,
            n: 2,
            head_dim: 3,
            dtype: 1,
            out,
        })
        .run(0)?;
    g.synchronize(0)?;
    let s1 = 1.0 + 2f32.powi(-9);
    let want = [
        bf16_round(448.0 * s1),
        bf16_round(1.5 * s1),
        0.0,
        3.0,
        -4.5,
        bf16_round(3.0 * 2f32.powi(-9)),
    ];
    assert_eq!(bits(&down(g, out, 6)?), bits(&want));
    f.finish()
}

#[test]
fn conv_batch_launch_equals_single_row_launches() -> Result<()> {
    let mut f = Fixture::new(4)?;
    let b = 5;
    let mut r = Rng(5);
    let xn: Vec<f32> = (0..b * C).map(|_| r.unit()).collect();
    let gated: Vec<f32> = (0..b * C).map(|_| r.unit()).collect();
    let hw0: Vec<f32> = (0..b * C).map(|_| r.unit()).collect();
    let states0: Vec<Vec<f32>> = (0..b)
        .map(|_| (0..S * C).map(|_| r.unit()).collect())
        .collect();
    let (xn_d, g_d, hw_d) = (f.tmp(&xn)?, f.tmp(&gated)?, f.tmp(&hw0)?);
    let st_d: Vec<DevicePtr> = states0.iter().map(|s| f.tmp(s)).collect::<Result<_>>()?;
    let table: Vec<u64> = st_d.iter().map(|p| p.0).collect();
    let table_d = f.tmp(&table)?;
    let w = f.conv_w_dev;
    let g = f.g();
    g.launch(g.kernel("ple", "conv_batch")?, lin())
        .args(&ConvBatchArgs {
            xn: xn_d,
            gated: g_d,
            states: table_d,
            w,
            highway: hw_d,
            b: b as u32,
            c: C as u32,
            k: K as u32,
            d: D as u32,
        })
        .run(0)?;
    g.synchronize(0)?;
    let hw_batch = down(g, hw_d, b * C)?;
    for i in 0..b {
        let mut st = states0[i].clone();
        let mut hw = hw0[i * C..(i + 1) * C].to_vec();
        let rr = i * C..(i + 1) * C;
        conv(
            ConvDims {
                t: 1,
                c: C,
                k: K,
                d: D,
            },
            &xn[rr.clone()],
            &gated[rr.clone()],
            &mut st,
            &f.conv_w,
            &mut hw,
        )?;
        assert_eq!(bits(&hw_batch[rr]), bits(&hw));
        assert_eq!(bits(&down(g, st_d[i], S * C)?), bits(&st));
    }
    f.finish()
}

/// Launch, then synchronise; the error of either.
fn expect_err(
    f: &Fixture,
    run: impl FnOnce(&dyn GpuBackend) -> Result<(), metrale_gpu_runtime::GpuError>,
) -> String {
    let g = f.g();
    match run(g).and_then(|_| g.synchronize(0)) {
        Ok(()) => panic!("the launch should have failed"),
        Err(e) => format!("{e:#}"),
    }
}

#[test]
fn bad_launches_fail_and_write_nothing() -> Result<()> {
    // Each refused launch on a fresh fixture: errors are sticky per stream.
    {
        let mut f = Fixture::new(6)?;
        let refs: Vec<u64> = vec![f.table_dev.0, 0, 0xdead_0000, 0];
        let refs_d = f.tmp(&refs)?;
        let out = f.tmp(&[7f32; 2 * HD])?;
        let e = expect_err(&f, |g| {
            g.launch(g.kernel("ple", "gather")?, lin())
                .args(&GatherArgs {
                    refs: refs_d,
                    n: 2,
                    head_dim: HD as u32,
                    dtype: 0,
                    out,
                })
                .run(0)
        });
        assert!(e.contains("row 1") && e.contains("0xdead0000"), "{e}");
        let mut b = vec![0u8; 2 * HD * 4];
        f.g().copy_d2h(out, &mut b)?;
        assert!(
            b.chunks_exact(4)
                .all(|c| f32::from_le_bytes(c.try_into().unwrap()) == 7.0)
        );
        f.finish()?;
    }
    {
        let mut f = Fixture::new(7)?;
        let refs: Vec<u64> = vec![f.table_dev.0, 0];
        let refs_d = f.tmp(&refs)?;
        let out = f.tmp(&[0f32; HD])?;
        let e = expect_err(&f, |g| {
            g.launch(g.kernel("ple", "gather")?, lin())
                .args(&GatherArgs {
                    refs: refs_d,
                    n: 1,
                    head_dim: HD as u32,
                    dtype: 4,
                    out,
                })
                .run(0)
        });
        assert!(e.contains("dtype 4"), "{e}");
        f.finish()?;
    }
    {
        // FP8 rows need a scale pointer.
        let mut f = Fixture::new(8)?;
        let refs: Vec<u64> = vec![f.table_dev.0, 0];
        let refs_d = f.tmp(&refs)?;
        let out = f.tmp(&[0f32; HD])?;
        let e = expect_err(&f, |g| {
            g.launch(g.kernel("ple", "gather")?, lin())
                .args(&GatherArgs {
                    refs: refs_d,
                    n: 1,
                    head_dim: HD as u32,
                    dtype: 1,
                    out,
                })
                .run(0)
        });
        assert!(e.contains("scale pointer is null"), "{e}");
        f.finish()?;
    }
    {
        // y overlapping x.
        let mut f = Fixture::new(9)?;
        let x = f.tmp(&[1f32; 2 * O])?;
        let w = f.w_dev;
        let e = expect_err(&f, |g| {
            g.launch(g.kernel("ple", "project")?, lin())
                .args(&project_args(x, w, x, 1))
                .run(0)
        });
        assert!(e.contains("y (") && e.contains("overlaps x"), "{e}");
        f.finish()?;
    }
    {
        // A packed weight shorter than [O, E] packs to.
        let mut f = Fixture::new(10)?;
        let x = f.tmp(&[1f32; E])?;
        let y = f.tmp(&[3f32; O])?;
        let short = f.tmp(&vec![0f32; packed_len(O, E) - 1])?;
        let e = expect_err(&f, |g| {
            g.launch(g.kernel("ple", "project")?, lin())
                .args(&project_args(x, short, y, 1))
                .run(0)
        });
        assert!(e.contains("the packed weight"), "{e}");
        assert!(down(f.g(), y, O)?.iter().all(|&v| v == 3.0));
        f.finish()?;
    }
    {
        // Two batch rows sharing one state would race: refused, nothing written.
        let mut f = Fixture::new(11)?;
        let xn = f.tmp(&vec![1f32; 2 * C])?;
        let hw = f.tmp(&vec![2f32; 2 * C])?;
        let st = f.tmp(&vec![5f32; S * C])?;
        let table = f.tmp(&[st.0, st.0])?;
        let w = f.conv_w_dev;
        let e = expect_err(&f, |g| {
            g.launch(g.kernel("ple", "conv_batch")?, lin())
                .args(&ConvBatchArgs {
                    xn,
                    gated: xn,
                    states: table,
                    w,
                    highway: hw,
                    b: 2,
                    c: C as u32,
                    k: K as u32,
                    d: D as u32,
                })
                .run(0)
        });
        assert!(
            e.contains("state 0") && e.contains("overlaps state 1"),
            "{e}"
        );
        assert!(down(f.g(), hw, 2 * C)?.iter().all(|&v| v == 2.0));
        assert!(down(f.g(), st, S * C)?.iter().all(|&v| v == 5.0));
        f.finish()?;
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 12, ..ProptestConfig::default() })]

    /// Any chunking of one sequence through the launched kernels gives the
    /// same highway and state, bit for bit, as one launch of the whole.
    #[test]
    fn any_chunking_gives_identical_bits(
        chunks in prop::collection::vec(1usize..9, 1..5),
        seed in any::<u64>(),
    ) {
        let t: usize = chunks.iter().sum();
        let mut f = Fixture::new(seed).unwrap();
        let mut r = Rng(seed ^ 0xABCD);
        let ids: Vec<usize> = (0..t * HEADS).map(|_| (r.next() % ROWS as u64) as usize).collect();
        let hw0: Vec<f32> = (0..t * C).map(|_| r.unit()).collect();
        let whole_hw = f.tmp(&hw0).unwrap();
        let whole_st = f.tmp(&vec![0f32; S * C]).unwrap();
        f.chain_dev(&ids, t, whole_hw, whole_st).unwrap();
        let st = f.tmp(&vec![0f32; S * C]).unwrap();
        let mut t0 = 0;
        let mut parts = Vec::new();
        for &n in &chunks {
            let hw = f.tmp(&hw0[t0 * C..(t0 + n) * C]).unwrap();
            f.chain_dev(&ids[t0 * HEADS..(t0 + n) * HEADS], n, hw, st).unwrap();
            parts.extend(down(f.g(), hw, n * C).unwrap());
            t0 += n;
        }
        prop_assert_eq!(bits(&parts), bits(&down(f.g(), whole_hw, t * C).unwrap()));
        prop_assert_eq!(bits(&down(f.g(), st, S * C).unwrap()), bits(&down(f.g(), whole_st, S * C).unwrap()));
        f.finish().unwrap();
    }
}
