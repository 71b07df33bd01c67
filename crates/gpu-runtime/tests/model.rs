//! Property test: random sequences of memory operations on the CPU backend,
//! spread over three streams ordered by events, agree with a plain model
//! (one `Vec<u8>` per allocation): same successes, same refusals, same bytes,
//! and the ledger ends empty.

use metrale_gpu_runtime::cpu::CpuBackend;
use metrale_gpu_runtime::gpu::{DevicePtr, GpuBackend, StreamId};
use proptest::prelude::*;

#[derive(Clone, Debug)]
enum Op {
    Alloc(usize),
    Free(usize),
    FreeInterior(usize, usize),
    H2d {
        a: usize,
        off: usize,
        len: usize,
        byte: u8,
        s: usize,
    },
    Memset {
        a: usize,
        off: usize,
        len: usize,
        byte: u8,
        s: usize,
    },
    D2d {
        a: usize,
        off: usize,
        b: usize,
        boff: usize,
        len: usize,
        s: usize,
    },
    D2h {
        a: usize,
        off: usize,
        len: usize,
        s: usize,
    },
    SyncCopy {
        a: usize,
        off: usize,
        len: usize,
        byte: u8,
    },
}

fn op() -> impl Strategy<Value = Op> {
    let i = 0usize..8;
    let off = 0usize..300;
    let len = 0usize..300;
    let s = 0usize..3;
    prop_oneof![
        2 => (0usize..256).prop_map(Op::Alloc),
        1 => i.clone().prop_map(Op::Free),
        1 => (i.clone(), 1usize..64).prop_map(|(a, o)| Op::FreeInterior(a, o)),
        3 => (i.clone(), off.clone(), len.clone(), any::<u8>(), s.clone())
            .prop_map(|(a, off, len, byte, s)| Op::H2d { a, off, len, byte, s }),
        2 => (i.clone(), off.clone(), len.clone(), any::<u8>(), s.clone())
            .prop_map(|(a, off, len, byte, s)| Op::Memset { a, off, len, byte, s }),
        3 => (i.clone(), off.clone(), i.clone(), off.clone(), len.clone(), s.clone())
            .prop_map(|(a, off, b, boff, len, s)| Op::D2d { a, off, b, boff, len, s }),
        3 => (i.clone(), off.clone(), len.clone(), s.clone())
            .prop_map(|(a, off, len, s)| Op::D2h { a, off, len, s }),
        1 => (i, off, len, any::<u8>()).prop_map(|(a, off, len, byte)| Op::SyncCopy { a, off, len, byte }),
    ]
}

/// The model: allocations by creation order; `None` once freed.
struct Model {
    ptrs: Vec<DevicePtr>,
    mem: Vec<Option<Vec<u8>>>,
}

impl Model {
    /// The live buffer `a` (modulo the count) if `[off, off+len)` fits.
    fn range(&self, a: usize, off: usize, len: usize) -> Option<(usize, std::ops::Range<usize>)> {
        if self.ptrs.is_empty() {
            return None;
        }
        let a = a % self.ptrs.len();
        let m = self.mem[a].as_ref()?;
        (off + len <= m.len()).then_some((a, off..off + len))
    }
    fn ptr(&self, a: usize, off: usize) -> DevicePtr {
        if self.ptrs.is_empty() {
            DevicePtr(0x5000)
        } else {
            self.ptrs[a % self.ptrs.len()].offset(off)
        }
    }
}

fn run(ops: &[Op]) -> Result<(), TestCaseError> {
    let gpu = CpuBackend::new_debug();
    let g: &dyn GpuBackend = &gpu;
    let streams: Vec<StreamId> = vec![0, g.create_stream().unwrap(), g.create_stream().unwrap()];
    let ev = g.create_event().unwrap();
    let mut last = 0usize;
    // Order stream `s` after everything queued so far on the last stream used.
    let mut order = |s: usize| {
        if s != last {
            g.record_event(ev, streams[last]).unwrap();
            g.stream_wait_event(streams[s], ev).unwrap();
            last = s;
        }
        streams[s]
    };
    let mut m = Model {
        ptrs: Vec::new(),
        mem: Vec::new(),
    };
    for (step, op) in ops.iter().enumerate() {
        let ctx = format!("step {step}: {op:?}");
        match *op {
            Op::Alloc(n) => {
                let p = g.alloc(n, &format!("buf{}", m.ptrs.len())).unwrap();
                m.ptrs.push(p);
                m.mem.push(Some(vec![0xFF; n]));
            }
            Op::Free(a) => {
                let ok = m.range(a, 0, 0).is_some();
                let r = g.dealloc(m.ptr(a, 0));
                prop_assert_eq!(r.is_ok(), ok, "{}: {:?}", ctx, r);
                if ok {
                    m.mem[a % m.ptrs.len()] = None;
                }
            }
            Op::FreeInterior(a, off) => {
                let r = g.dealloc(m.ptr(a, off));
                prop_assert!(r.is_err(), "{}: interior free accepted", ctx);
            }
            Op::H2d {
                a,
                off,
                len,
                byte,
                s,
            } => {
                let s = order(s);
                let r = g.copy_h2d_async(&vec![byte; len], m.ptr(a, off), s);
                let want = m.range(a, off, len);
                prop_assert_eq!(r.is_ok(), want.is_some(), "{}: {:?}", ctx, r);
                if let Some((i, rg)) = want {
                    m.mem[i].as_mut().unwrap()[rg].fill(byte);
                }
            }
            Op::Memset {
                a,
                off,
                len,
                byte,
                s,
            } => {
                let s = order(s);
                let r = g.memset_async(m.ptr(a, off), byte, len, s);
                let want = m.range(a, off, len);
                prop_assert_eq!(r.is_ok(), want.is_some(), "{}: {:?}", ctx, r);
                if let Some((i, rg)) = want {
                    m.mem[i].as_mut().unwrap()[rg].fill(byte);
                }
            }
            Op::D2d {
                a,
                off,
                b,
                boff,
                len,
                s,
            } => {
                let s = order(s);
                let r = g.copy_d2d_async(m.ptr(a, off), m.ptr(b, boff), len, s);
                let want = m.range(a, off, len).zip(m.range(b, boff, len));
                prop_assert_eq!(r.is_ok(), want.is_some(), "{}: {:?}", ctx, r);
                if let Some(((i, ri), (j, rj))) = want {
                    let src = m.mem[i].as_ref().unwrap()[ri].to_vec();
                    m.mem[j].as_mut().unwrap()[rj].copy_from_slice(&src);
                }
            }
            Op::D2h { a, off, len, s } => {
                let s = order(s);
                let mut out = vec![0u8; len];
                let r = g.copy_d2h_on_stream(m.ptr(a, off), &mut out, s);
                let want = m.range(a, off, len);
                prop_assert_eq!(r.is_ok(), want.is_some(), "{}: {:?}", ctx, r);
                if let Some((i, rg)) = want {
                    prop_assert_eq!(&out[..], &m.mem[i].as_ref().unwrap()[rg], "{}", ctx);
                }
            }
            Op::SyncCopy { a, off, len, byte } => {
                // Synchronous calls order after the default stream only.
                let s0 = order(0);
                assert_eq!(s0, 0);
                let r = g.copy_h2d(&vec![byte; len], m.ptr(a, off));
                let want = m.range(a, off, len);
                prop_assert_eq!(r.is_ok(), want.is_some(), "{}: {:?}", ctx, r);
                if let Some((i, rg)) = want {
                    m.mem[i].as_mut().unwrap()[rg].fill(byte);
                }
            }
        }
    }
    for s in &streams {
        prop_assert!(
            g.synchronize(*s).is_ok(),
            "a refused call left an error behind"
        );
    }
    for (i, p) in m.ptrs.iter().enumerate() {
        if let Some(bytes) = &m.mem[i] {
            let mut out = vec![0u8; bytes.len()];
            g.copy_d2h(*p, &mut out).unwrap();
            prop_assert_eq!(&out, bytes, "final contents of buf{}", i);
            g.dealloc(*p).unwrap();
        }
    }
    prop_assert_eq!(g.live_alloc_count(), 0);
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 96, ..ProptestConfig::default() })]

    #[test]
    fn random_operation_sequences_match_the_model(ops in prop::collection::vec(op(), 1..60)) {
        run(&ops)?;
    }
}
