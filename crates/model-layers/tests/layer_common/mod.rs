//! What the PLE layer tests share: a tiny device-resident row table
//! that counts its pins, a small random geometry, highway rows, and the
//! fixture holding them on a debug CPU backend ([`Fx`]).
//!
//! The table pins every resolved row and only unpins a lease once the event
//! given with its release has completed, so a test can check that no lease
//! is leaked and none is dropped before its gather.

#![allow(dead_code)]

use std::sync::Arc;

use anyhow::Result;
use metrale_gpu_runtime::cpu::CpuBackend;
use metrale_gpu_runtime::gpu::{DevicePtr, EventHandle, GpuBackend, StreamId};
use metrale_model_layers::layers::ple::ids::PleIdDims;
use metrale_model_layers::layers::ple::{PleLayer, PleSeqState, PleWeights, SiteSpec};
use metrale_storage::table::{Lease, RowDType, RowRef, RowTable, TableInfo, TableStats};
use metrale_storage::{Result as StorageResult, StorageError};
pub use metrale_testkit::Rng;
use parking_lot::Mutex;

/// The value of an FP8 E4M3 (fn variant, no infinities) byte.
pub fn e4m3(b: u8) -> f32 {
    let sign = if b & 0x80 != 0 { -1.0 } else { 1.0 };
    let e = ((b >> 3) & 0xf) as i32;
    let m = (b & 7) as f32;
    if e == 0 {
        sign * m / 8.0 * 2f32.powi(-6)
    } else {
        sign * (1.0 + m / 8.0) * 2f32.powi(e - 7)
    }
}

/// BF16 bits of `x`, rounded to nearest even.
pub fn bf16_bits(x: f32) -> u16 {
    let b = x.to_bits();
    ((b + 0x7fff + ((b >> 16) & 1)) >> 16) as u16
}

#[derive(Default)]
struct Pins {
    held: usize,
    /// Pinned leases released without an event (only safe after a sync).
    bare_releases: usize,
    pending: Vec<(EventHandle, usize)>,
    next_id: u64,
}

/// A BF16 or FP8 table held in one device allocation (FP8 scales after
/// the rows).
pub struct TestTable {
    base: DevicePtr,
    scales: DevicePtr,
    info: TableInfo,
    max_resolve: usize,
    pins: Mutex<Pins>,
}

impl TestTable {
    pub fn new(
        gpu: &dyn GpuBackend,
        rows_bits: &[u16],
        head_dim: usize,
        max_resolve: usize,
    ) -> Result<Arc<TestTable>> {
        let rows = rows_bits.len() / head_dim;
        let bytes: Vec<u8> = rows_bits.iter().flat_map(|b| b.to_le_bytes()).collect();
        let base = gpu.alloc(bytes.len(), "test.table")?;
        gpu.copy_h2d(&bytes, base)?;
        Ok(Arc::new(TestTable {
            base,
            scales: DevicePtr::NULL,
            info: TableInfo {
                rows: rows as u64,
                head_dim,
                dtype: RowDType::Bf16,
            },
            max_resolve,
            pins: Mutex::new(Pins::default()),
        }))
    }

    /// An FP8 E4M3 table: `head_dim` bytes a row and one f32 scale a row.
    pub fn new_fp8(
        gpu: &dyn GpuBackend,
        rows_bytes: &[u8],
        scales: &[f32],
        head_dim: usize,
        max_resolve: usize,
    ) -> Result<Arc<TestTable>> {
        let rows = rows_bytes.len() / head_dim;
        assert_eq!(scales.len(), rows);
        let mut bytes = rows_bytes.to_vec();
        bytes.resize(rows_bytes.len().div_ceil(4) * 4, 0);
        let soff = bytes.len();
        bytes.extend(scales.iter().flat_map(|s| s.to_le_bytes()));
        let base = gpu.alloc(bytes.len(), "test.table_fp8")?;
        gpu.copy_h2d(&bytes, base)?;
        Ok(Arc::new(TestTable {
            base,
            scales: base.offset(soff),
            info: TableInfo {
                rows: rows as u64,
                head_dim,
                dtype: RowDType::Fp8E4M3,
            },
            max_resolve,
            pins: Mutex::new(Pins::default()),
        }))
    }

    /// A table of FP8 E4M3 rows with an inline UE8M0 scale per 32 values
    /// (`RowDType::Fp8E4M3Block32`): `rows_bytes` holds whole rows.
    pub fn new_block_fp8(
        gpu: &dyn GpuBackend,
        rows_bytes: &[u8],
        head_dim: usize,
        max_resolve: usize,
    ) -> Result<Arc<TestTable>> {
        let dtype = RowDType::Fp8E4M3Block32;
        let rows = rows_bytes.len() / dtype.row_bytes(head_dim);
        let base = gpu.alloc(rows_bytes.len(), "test.table_fp8_block")?;
        gpu.copy_h2d(rows_bytes, base)?;
        Ok(Arc::new(TestTable {
            base,
            scales: DevicePtr::NULL,
            info: TableInfo {
                rows: rows as u64,
                head_dim,
                dtype,
            },
            max_resolve,
            pins: Mutex::new(Pins::default()),
        }))
    }

    /// Pins still held once every completed release event is accounted for.
    pub fn pinned(&self, gpu: &dyn GpuBackend) -> usize {
        let mut p = self.pins.lock();
        let mut still = Vec::new();
        for (ev, n) in std::mem::take(&mut p.pending) {
            if gpu.event_query(ev).unwrap() {
                gpu.destroy_event(ev).unwrap();
                p.held -= n;
            } else {
                still.push((ev, n));
            }
        }
        p.pending = still;
        p.held
    }

    /// Pinned leases released without an event so far.
    pub fn bare_releases(&self) -> usize {
        self.pins.lock().bare_releases
    }

    pub fn free(&self, gpu: &dyn GpuBackend) {
        gpu.free(self.base).unwrap();
    }
}

impl RowTable for TestTable {
    fn info(&self) -> TableInfo {
        self.info
    }
    fn max_resolve(&self) -> usize {
        self.max_resolve
    }
    fn resolve(&self, ids: &[u64], out: &mut [RowRef]) -> StorageResult<Lease> {
        if out.len() != ids.len() {
            return Err(StorageError::OutputLength {
                ids: ids.len(),
                out: out.len(),
            });
        }
        let distinct: std::collections::HashSet<u64> = ids.iter().copied().collect();
        if distinct.len() > self.max_resolve {
            return Err(StorageError::BatchTooLarge {
                distinct: distinct.len(),
                limit: self.max_resolve,
            });
        }
        for (i, &id) in ids.iter().enumerate() {
            if id >= self.info.rows {
                return Err(StorageError::RowOutOfRange {
                    id,
                    rows: self.info.rows,
                });
            }
            let scale = if self.scales.is_null() {
                0
            } else {
                self.scales.offset(id as usize * 4).addr()
            };
            out[i] = RowRef {
                data: self.base.offset(id as usize * self.info.row_bytes()).addr(),
                scale,
            };
        }
        let mut p = self.pins.lock();
        p.held += ids.len();
        p.next_id += 1;
        Ok(Lease {
            id: p.next_id,
            pinned: ids.len(),
        })
    }
    fn release(
        &self,
        lease: Lease,
        _gpu: &dyn GpuBackend,
        after: Option<EventHandle>,
    ) -> StorageResult<()> {
        let mut p = self.pins.lock();
        match after {
            Some(ev) => p.pending.push((ev, lease.pinned)),
            None => {
                p.held -= lease.pinned;
                if lease.pinned > 0 {
                    p.bare_releases += 1;
                }
            }
        }
        Ok(())
    }
    fn prefetch(&self, _ids: &[u64]) -> StorageResult<()> {
        Ok(())
    }
    fn stats(&self) -> TableStats {
        TableStats::default()
    }
}

/// A small geometry with random weights and table.
pub struct Small {
    pub dims: PleIdDims,
    pub head_dim: usize,
    pub hidden: usize,
    pub hc: usize,
    pub k: usize,
    pub dil: usize,
    pub weights: PleWeights,
    pub table_bits: Vec<u16>,
}

pub const EOS: u32 = 5;

impl Small {
    pub fn new(seed: u64) -> Small {
        let mut r = Rng(seed);
        let (hidden, hc, n, kpn, head_dim, k) = (16, 2, 3, 2, 8, 3);
        let heads = (n - 1) * kpn;
        let sizes: Vec<u64> = vec![13, 17, 19, 23];
        let mut offsets = vec![0u64];
        for s in &sizes[..heads - 1] {
            offsets.push(offsets.last().unwrap() + s);
        }
        let rows = sizes.iter().sum::<u64>() as usize + 3;
        let dims = PleIdDims {
            ngram_size: n,
            heads_per_ngram: kpn,
            multipliers: (0..n).map(|_| r.next() | 1).collect(),
            head_vocab_sizes: sizes,
            head_offsets: offsets,
            eos_token_id: EOS,
            family: Default::default(),
        };
        let e = heads * head_dim;
        let c = hidden * hc;
        let mut bf =
            |n: usize, s: f32| -> Vec<u16> { (0..n).map(|_| bf16_bits(r.unit() * s)).collect() };
        let key_proj = bf(c * e, 0.4);
        let value_proj = bf(hidden * e, 0.4);
        let table_bits = bf(rows * head_dim, 1.5);
        let mut f = |n: usize, s: f32| -> Vec<f32> { (0..n).map(|_| r.unit() * s).collect() };
        let weights = PleWeights {
            key_proj,
            value_proj,
            norm_key: f(c, 0.2),
            norm_query: f(c, 0.2),
            norm_conv: f(c, 0.2),
            conv1d: f(c * k, 0.8),
            key_bias: Vec::new(),
            value_bias: Vec::new(),
        };
        Small {
            dims,
            head_dim,
            hidden,
            hc,
            k,
            dil: 2,
            weights,
            table_bits,
        }
    }

    pub fn channels(&self) -> usize {
        self.hidden * self.hc
    }

    pub fn spec(&self) -> SiteSpec {
        SiteSpec::new(
            self.dims.clone(),
            self.head_dim,
            self.hidden,
            self.hc,
            self.k,
            self.dil,
        )
    }

    pub fn layer(
        &self,
        gpu: &dyn GpuBackend,
        table: Arc<dyn RowTable>,
        max_tokens: usize,
    ) -> Result<PleLayer> {
        Ok(PleLayer::new(
            &self.spec(),
            self.weights.clone(),
            table,
            max_tokens,
            gpu,
        )?)
    }
}

/// A small layer's world: a debug CPU backend (which checks every
/// pointer), a [`Small`] geometry, its [`TestTable`] and the stream every
/// call runs on. [`Fx::finish`] frees it all and fails on a leak.
pub struct Fx {
    pub gpu: CpuBackend,
    /// The backend's live allocations before the fixture made any.
    pub start: usize,
    pub small: Small,
    pub table: Arc<TestTable>,
    /// Destroyed after the layers are freed.
    pub s: StreamId,
}

impl Fx {
    /// Geometry and table drawn from `seed`; the table resolves at most
    /// `max_resolve` ids a call.
    pub fn new(seed: u64, max_resolve: usize) -> Fx {
        let gpu = CpuBackend::new_debug();
        let start = gpu.live_alloc_count();
        let small = Small::new(seed);
        let table = TestTable::new(&gpu, &small.table_bits, small.head_dim, max_resolve).unwrap();
        let s = gpu.create_stream().unwrap();
        Fx {
            gpu,
            start,
            small,
            table,
            s,
        }
    }

    pub fn g(&self) -> &dyn GpuBackend {
        &self.gpu
    }

    /// A layer over the fixture's table.
    pub fn layer(&self, max_tokens: usize) -> PleLayer {
        self.small
            .layer(self.g(), self.table.clone(), max_tokens)
            .unwrap()
    }

    /// [`Self::finish_all`] with one layer.
    pub fn finish(self, layer: PleLayer, states: Vec<PleSeqState>) {
        self.finish_all(vec![layer], states);
    }

    /// Release `states` (through the first layer), free `layers`, the
    /// table and the stream, and check that no lease was released without
    /// an event, none is left pinned and no allocation is left live.
    pub fn finish_all(self, layers: Vec<PleLayer>, states: Vec<PleSeqState>) {
        let g: &dyn GpuBackend = &self.gpu;
        // Every lease so far was released with an event recorded after the
        // gather that read it, never at issue time.
        assert_eq!(
            self.table.bare_releases(),
            0,
            "a pinned lease was released without an event"
        );
        for mut st in states {
            layers[0].release_seq_state(&mut st, g).unwrap();
        }
        for mut l in layers {
            l.free(g).unwrap();
        }
        assert_eq!(self.table.pinned(g), 0, "leases left pinned");
        self.table.free(g);
        g.synchronize(self.s).unwrap();
        g.destroy_stream(self.s).unwrap();
        assert_no_leaks(g, self.start);
    }
}

/// Random tokens in `0..vocab`, EOS with probability about 1/8.
pub fn tokens(r: &mut Rng, n: usize, vocab: u64) -> Vec<u32> {
    (0..n)
        .map(|_| {
            if r.below(8) == 0 {
                EOS
            } else {
                r.below(vocab as usize) as u32
            }
        })
        .collect()
}

/// Fail unless `g` holds exactly the `start` live allocations it held
/// before the test, listing the live ones when it does not.
#[track_caller]
pub fn assert_no_leaks(g: &dyn GpuBackend, start: usize) {
    assert_eq!(
        g.live_alloc_count(),
        start,
        "live allocations:\n{}",
        g.live_report()
    );
}

/// Random highway rows.
pub fn highway(r: &mut Rng, rows: usize, c: usize) -> Vec<f32> {
    (0..rows * c).map(|_| r.unit() * 2.0).collect()
}

pub fn upload(gpu: &dyn GpuBackend, v: &[f32], label: &str) -> DevicePtr {
    let p = gpu.alloc(v.len() * 4, label).unwrap();
    let b: Vec<u8> = v.iter().flat_map(|x| x.to_le_bytes()).collect();
    gpu.copy_h2d(&b, p).unwrap();
    p
}

pub fn write(gpu: &dyn GpuBackend, v: &[f32], p: DevicePtr, stream: StreamId) {
    let b: Vec<u8> = v.iter().flat_map(|x| x.to_le_bytes()).collect();
    gpu.copy_h2d_async(&b, p, stream).unwrap();
}

pub fn download(gpu: &dyn GpuBackend, p: DevicePtr, n: usize, stream: StreamId) -> Vec<f32> {
    let mut b = vec![0u8; n * 4];
    gpu.copy_d2h_on_stream(p, &mut b, stream).unwrap();
    b.chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}

pub fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}
