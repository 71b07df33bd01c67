//! TEMPORARY local scalar stub (never committed).
#![allow(missing_docs, clippy::all)]
use anyhow::Result;
use metrale_gpu_runtime::gpu::{
    ArgKind, DevicePtr, GpuBackend, HostMemory, KernelArg, LaunchConfig,
};
use std::sync::Arc;
pub fn pack_projection(w: &[u16], o: usize, e: usize) -> Vec<f32> {
    let _ = (o, e);
    w.iter()
        .map(|b| f32::from_bits((*b as u32) << 16))
        .collect()
}
pub fn packed_len(o: usize, e: usize) -> usize {
    o * e
}
fn p(a: &KernelArg) -> DevicePtr {
    if let KernelArg::Ptr(p) = a {
        *p
    } else {
        panic!()
    }
}
fn u(a: &KernelArg) -> usize {
    if let KernelArg::U32(v) = a {
        *v as usize
    } else {
        panic!()
    }
}
fn f(a: &KernelArg) -> f32 {
    if let KernelArg::F32(v) = a {
        *v
    } else {
        panic!()
    }
}
fn e4m3(b: u8) -> f32 {
    let s = if b & 0x80 != 0 { -1.0 } else { 1.0 };
    let e = ((b >> 3) & 15) as i32;
    let m = (b & 7) as f32;
    if e == 0 {
        s * m / 512.0
    } else {
        s * (1.0 + m / 8.0) * 2f32.powi(e - 7)
    }
}
fn bf16r(x: f32) -> f32 {
    let b = x.to_bits();
    f32::from_bits(((b + 0x7fff + ((b >> 16) & 1)) >> 16) << 16)
}
fn rms(x: &[f32], w: &[f32], eps: f32, out: &mut [f32]) {
    let mut s = 0f32;
    for v in x {
        s += v * v;
    }
    let r = 1.0 / (s / x.len() as f32 + eps).sqrt();
    for i in 0..x.len() {
        out[i] = x[i] * r * (1.0 + w[i]);
    }
}
fn conv1(
    xn: &[f32],
    gated: &[f32],
    state: &mut [f32],
    w: &[f32],
    hw: &mut [f32],
    t: usize,
    c: usize,
    k: usize,
    d: usize,
) {
    let s = (k - 1) * d;
    let mut x = state.to_vec();
    x.extend_from_slice(&xn[..t * c]);
    for ti in 0..t {
        for ci in 0..c {
            let mut y = 0f32;
            for j in 0..k {
                y += w[ci * k + j] * x[(s + ti - (k - 1 - j) * d) * c + ci];
            }
            let o = gated[ti * c + ci] + y / (1.0 + (-y).exp());
            hw[ti * c + ci] += o;
        }
    }
    let n = x.len();
    state.copy_from_slice(&x[n - s * c..]);
}
pub fn register_cpu_kernels(gpu: &dyn GpuBackend) -> Result<()> {
    use ArgKind::*;
    gpu.register_host_kernel(
        "ple",
        "gather",
        &[Ptr, U32, U32, U32, Ptr],
        Arc::new(
            |m: &dyn HostMemory, _: &LaunchConfig, a: &[KernelArg]| unsafe {
                let n = u(&a[1]);
                let hd = u(&a[2]);
                let dt = u(&a[3]);
                let refs = m.slice::<u64>(p(&a[0]), 2 * n)?;
                let out = m.slice_mut::<f32>(p(&a[4]), n * hd)?;
                for i in 0..n {
                    if dt == 0 {
                        let r = m.slice::<u16>(DevicePtr(refs[2 * i]), hd)?;
                        for j in 0..hd {
                            out[i * hd + j] = f32::from_bits((r[j] as u32) << 16);
                        }
                    } else {
                        let r = m.slice::<u8>(DevicePtr(refs[2 * i]), hd)?;
                        let sc = m.slice::<f32>(DevicePtr(refs[2 * i + 1]), 1)?[0];
                        for j in 0..hd {
                            out[i * hd + j] = bf16r(e4m3(r[j]) * sc);
                        }
                    }
                }
                Ok(())
            },
        ),
    )?;
    gpu.register_host_kernel(
        "ple",
        "project",
        &[Ptr, Ptr, Ptr, U32, U32, U32],
        Arc::new(
            |m: &dyn HostMemory, _: &LaunchConfig, a: &[KernelArg]| unsafe {
                let (t, e, o) = (u(&a[3]), u(&a[4]), u(&a[5]));
                let x = m.slice::<f32>(p(&a[0]), t * e)?;
                let w = m.slice::<f32>(p(&a[1]), o * e)?;
                let y = m.slice_mut::<f32>(p(&a[2]), t * o)?;
                for ti in 0..t {
                    for oi in 0..o {
                        let mut s = 0f32;
                        for ei in 0..e {
                            s += x[ti * e + ei] * w[oi * e + ei];
                        }
                        y[ti * o + oi] = s;
                    }
                }
                Ok(())
            },
        ),
    )?;
    gpu.register_host_kernel(
        "ple",
        "gate",
        &[Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, U32, U32, U32, F32],
        Arc::new(
            |m: &dyn HostMemory, _: &LaunchConfig, a: &[KernelArg]| unsafe {
                let (t, h, hc, eps) = (u(&a[7]), u(&a[8]), u(&a[9]), f(&a[10]));
                let c = h * hc;
                let hw = m.slice::<f32>(p(&a[0]), t * c)?;
                let kv = m.slice::<f32>(p(&a[1]), t * (c + h))?;
                let nq = m.slice::<f32>(p(&a[2]), c)?;
                let nk = m.slice::<f32>(p(&a[3]), c)?;
                let nc = m.slice::<f32>(p(&a[4]), c)?;
                let gated = m.slice_mut::<f32>(p(&a[5]), t * c)?;
                let xn = m.slice_mut::<f32>(p(&a[6]), t * c)?;
                let mut a1 = vec![0f32; h];
                let mut b1 = vec![0f32; h];
                for ti in 0..t {
                    for s in 0..hc {
                        let r = ti * c + s * h;
                        rms(&hw[r..r + h], &nq[s * h..s * h + h], eps, &mut a1);
                        rms(
                            &kv[ti * (c + h) + s * h..ti * (c + h) + s * h + h],
                            &nk[s * h..s * h + h],
                            eps,
                            &mut b1,
                        );
                        let mut g = 0f32;
                        for i in 0..h {
                            g += a1[i] * b1[i];
                        }
                        g /= (h as f32).sqrt();
                        let z = if g == 0.0 {
                            0.0
                        } else {
                            g.signum() * g.abs().max(1e-6).sqrt()
                        };
                        let sg = 1.0 / (1.0 + (-z).exp());
                        for d in 0..h {
                            gated[r + d] = sg * kv[ti * (c + h) + c + d];
                        }
                        rms(
                            &gated[r..r + h].to_vec(),
                            &nc[s * h..s * h + h],
                            eps,
                            &mut xn[r..r + h],
                        );
                    }
                }
                Ok(())
            },
        ),
    )?;
    gpu.register_host_kernel(
        "ple",
        "conv",
        &[Ptr, Ptr, Ptr, Ptr, Ptr, U32, U32, U32, U32],
        Arc::new(
            |m: &dyn HostMemory, _: &LaunchConfig, a: &[KernelArg]| unsafe {
                let (t, c, k, d) = (u(&a[5]), u(&a[6]), u(&a[7]), u(&a[8]));
                let s = (k - 1) * d;
                conv1(
                    m.slice::<f32>(p(&a[0]), t * c)?,
                    m.slice::<f32>(p(&a[1]), t * c)?,
                    m.slice_mut::<f32>(p(&a[2]), s * c)?,
                    m.slice::<f32>(p(&a[3]), c * k)?,
                    m.slice_mut::<f32>(p(&a[4]), t * c)?,
                    t,
                    c,
                    k,
                    d,
                );
                Ok(())
            },
        ),
    )?;
    gpu.register_host_kernel(
        "ple",
        "conv_batch",
        &[Ptr, Ptr, Ptr, Ptr, Ptr, U32, U32, U32, U32],
        Arc::new(
            |m: &dyn HostMemory, _: &LaunchConfig, a: &[KernelArg]| unsafe {
                let (b, c, k, d) = (u(&a[5]), u(&a[6]), u(&a[7]), u(&a[8]));
                let s = (k - 1) * d;
                let sts = m.slice::<u64>(p(&a[2]), b)?;
                let xn = m.slice::<f32>(p(&a[0]), b * c)?;
                let g = m.slice::<f32>(p(&a[1]), b * c)?;
                let w = m.slice::<f32>(p(&a[3]), c * k)?;
                let hw = m.slice_mut::<f32>(p(&a[4]), b * c)?;
                for i in 0..b {
                    conv1(
                        &xn[i * c..],
                        &g[i * c..],
                        m.slice_mut::<f32>(DevicePtr(sts[i]), s * c)?,
                        w,
                        &mut hw[i * c..(i + 1) * c],
                        1,
                        c,
                        k,
                        d,
                    );
                }
                Ok(())
            },
        ),
    )?;
    Ok(())
}
