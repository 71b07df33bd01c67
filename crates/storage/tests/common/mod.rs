//! What the storage tests share: synthetic table shards whose every
//! byte is a known function of the row id, and a gather kernel for the CPU
//! backend that reads rows through `RowRef`s on a stream.
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use metrale_gpu_runtime::cpu::CpuBackend;
use metrale_gpu_runtime::gpu::{
    ArgKind, DevicePtr, GpuBackend, GpuError, KernelArg, LaunchConfig, StreamId,
};
use metrale_storage::layout::{ShardSource, TableFiles};
use metrale_storage::safetensors::{Dtype, TensorSpec, Writer};
use metrale_storage::table::{RowRef, RowTable};

/// Byte `j` of row `id`.
pub fn row_byte(id: u64, j: usize) -> u8 {
    ((id.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> ((j % 8) * 8)) as u8) ^ (j as u8).wrapping_mul(3)
}

/// Bytes of row `id`.
pub fn row(id: u64, row_bytes: usize) -> Vec<u8> {
    (0..row_bytes).map(|j| row_byte(id, j)).collect()
}

/// The FP8 scale of row `id`.
pub fn scale(id: u64) -> f32 {
    1.0 + id as f32 / 1024.0
}

/// Write `shards` shard files of `rows_per_shard` rows each (a small
/// unrelated tensor first, so the rows do not start at the data section).
pub fn make_table(
    dir: &Path,
    shards: usize,
    rows_per_shard: u64,
    head_dim: u64,
    fp8: bool,
    align: u64,
) -> TableFiles {
    let mut list = Vec::new();
    let rb = head_dim as usize * if fp8 { 1 } else { 2 };
    for i in 0..shards {
        let p = dir.join(format!("table-{i}.safetensors"));
        let name = format!("model.layers.1.ple.ngram_embedding.shard_{i}.weight");
        let dt = if fp8 { Dtype::F8E4M3 } else { Dtype::BF16 };
        let mut specs = vec![
            TensorSpec::new("model.layers.1.ple.norm_key.weight", Dtype::F32, &[3]),
            TensorSpec::new(&name, dt, &[rows_per_shard, head_dim]),
        ];
        if fp8 {
            specs.push(TensorSpec::new(
                scale_of(&name),
                Dtype::F32,
                &[rows_per_shard],
            ));
        }
        let mut w = Writer::create(&p, &specs, &Default::default(), align).unwrap();
        w.write(&[0u8; 12]).unwrap();
        let base = i as u64 * rows_per_shard;
        for r in 0..rows_per_shard {
            w.write(&row(base + r, rb)).unwrap();
        }
        if fp8 {
            for r in 0..rows_per_shard {
                w.write(&scale(base + r).to_le_bytes()).unwrap();
            }
        }
        w.finish().unwrap();
        let scale = fp8.then(|| scale_of(&name));
        list.push(ShardSource::new(p, name, scale));
    }
    TableFiles::open(&list, Some(shards as u64 * rows_per_shard)).unwrap()
}

/// The scale tensor these tables give weight tensor `name`.
pub fn scale_of(name: &str) -> String {
    format!("{}.scale", name.trim_end_matches(".weight"))
}

/// Paths of the shards.
pub fn paths(t: &TableFiles) -> Vec<PathBuf> {
    t.shards.iter().map(|s| s.path.clone()).collect()
}

/// A CPU backend with the test gather kernel registered. `flag` is set
/// each time the gather kernel runs.
pub fn backend() -> (Arc<dyn GpuBackend>, Arc<AtomicBool>) {
    let gpu: Arc<dyn GpuBackend> = Arc::new(CpuBackend::new());
    let flag = Arc::new(AtomicBool::new(false));
    let f = flag.clone();
    gpu.register_host_kernel(
        "storage_test",
        "gather",
        &[
            ArgKind::Ptr,
            ArgKind::U32,
            ArgKind::U32,
            ArgKind::Ptr,
            ArgKind::Ptr,
        ],
        Arc::new(move |mem, _cfg, args| {
            let (
                KernelArg::Ptr(refs),
                KernelArg::U32(n),
                KernelArg::U32(rb),
                KernelArg::Ptr(out),
                KernelArg::Ptr(scales),
            ) = (args[0], args[1], args[2], args[3], args[4])
            else {
                return Err(GpuError::kernel("bad arguments"));
            };
            let (n, rb) = (n as usize, rb as usize);
            // SAFETY: test buffers; refs, out and the rows never overlap.
            unsafe {
                let r = mem.slice::<u64>(refs, 2 * n)?.to_vec();
                let o = mem.slice_mut::<u8>(out, n * rb)?;
                for i in 0..n {
                    o[i * rb..(i + 1) * rb]
                        .copy_from_slice(mem.slice::<u8>(DevicePtr(r[2 * i]), rb)?);
                }
                if !scales.is_null() {
                    let s = mem.slice_mut::<f32>(scales, n)?;
                    for i in 0..n {
                        s[i] = mem.slice::<f32>(DevicePtr(r[2 * i + 1]), 1)?[0];
                    }
                }
            }
            f.store(true, Ordering::SeqCst);
            Ok(())
        }),
    )
    .unwrap();
    (gpu, flag)
}

/// `RowRef`s as the bytes of a `#[repr(C)]` array.
pub fn refs_bytes(refs: &[RowRef]) -> Vec<u8> {
    refs.iter()
        .flat_map(|r| {
            r.data
                .to_le_bytes()
                .into_iter()
                .chain(r.scale.to_le_bytes())
        })
        .collect()
}

/// Device buffers for one gather of `n` rows.
pub struct GatherBufs {
    pub refs: DevicePtr,
    pub out: DevicePtr,
    pub scales: DevicePtr,
    pub n: usize,
    pub rb: usize,
}

impl GatherBufs {
    pub fn new(gpu: &dyn GpuBackend, n: usize, rb: usize, fp8: bool) -> Self {
        GatherBufs {
            refs: gpu.alloc(16 * n.max(1), "test refs").unwrap(),
            out: gpu.alloc(n.max(1) * rb, "test out").unwrap(),
            scales: if fp8 {
                gpu.alloc(4 * n.max(1), "test scales").unwrap()
            } else {
                DevicePtr::NULL
            },
            n,
            rb,
        }
    }

    /// Queue: upload refs (synchronously), then the gather kernel on `s`.
    pub fn queue(&self, gpu: &dyn GpuBackend, refs: &[RowRef], s: StreamId) {
        assert_eq!(refs.len(), self.n);
        gpu.copy_h2d(&refs_bytes(refs), self.refs).unwrap();
        let k = gpu.kernel("storage_test", "gather").unwrap();
        gpu.launch(k, LaunchConfig::linear(1, 1))
            .ptr(self.refs)
            .u32(self.n as u32)
            .u32(self.rb as u32)
            .ptr(self.out)
            .ptr(self.scales)
            .run(s)
            .unwrap();
    }

    /// Synchronise `s` and read the gathered rows (and scales).
    pub fn read(&self, gpu: &dyn GpuBackend, s: StreamId) -> (Vec<u8>, Vec<f32>) {
        let mut out = vec![0u8; self.n * self.rb];
        gpu.copy_d2h_on_stream(self.out, &mut out, s).unwrap();
        let mut sc = Vec::new();
        if !self.scales.is_null() {
            let mut b = vec![0u8; 4 * self.n];
            gpu.copy_d2h_on_stream(self.scales, &mut b, s).unwrap();
            sc = b
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
                .collect();
        }
        (out, sc)
    }

    pub fn free(self, gpu: &dyn GpuBackend) {
        gpu.free(self.refs).unwrap();
        gpu.free(self.out).unwrap();
        gpu.free(self.scales).unwrap();
    }
}

/// Resolve `ids`, gather them on stream `s`, release the lease after an
/// event recorded behind the gather, and check every byte (and scale).
pub fn gather_and_check(gpu: &dyn GpuBackend, table: &dyn RowTable, ids: &[u64], s: StreamId) {
    let info = table.info();
    let rb = info.row_bytes();
    let fp8 = info.dtype == metrale_storage::table::RowDType::Fp8E4M3;
    let mut refs = vec![RowRef::default(); ids.len()];
    let lease = table.resolve(ids, &mut refs).unwrap();
    let bufs = GatherBufs::new(gpu, ids.len(), rb, fp8);
    bufs.queue(gpu, &refs, s);
    let ev = gpu.create_event().unwrap();
    gpu.record_event(ev, s).unwrap();
    table.release(lease, gpu, Some(ev)).unwrap();
    let (out, sc) = bufs.read(gpu, s);
    for (i, &id) in ids.iter().enumerate() {
        assert_eq!(
            &out[i * rb..(i + 1) * rb],
            &row(id, rb)[..],
            "row {id} (position {i})"
        );
        if fp8 {
            assert_eq!(sc[i], scale(id), "scale of row {id}");
        }
    }
    bufs.free(gpu);
}
