//! Kernel parameters: the signatures a PTX module declares, and the
//! marshalling of [`KernelArg`]s into the `void**` array `cuLaunchKernel`
//! reads.
//!
//! A PTX `.entry` lists its parameters with their PTX types; that is all the
//! driver knows of a kernel's signature, so launches are checked against it:
//! pointers and `u64` need an 8-byte integer parameter, `u32` and `i32` a
//! 4-byte integer one, `f32` an `.f32` one. A kernel whose one parameter is
//! a struct by value (a typed argument struct, see [`crate::args`]) takes
//! the arguments as the fields of that struct, in order, laid out as C lays
//! them out ([`crate::args::c_layout`]); the launch is checked by size.
//!
//! Invariants: every argument occupies its own 8-byte, 8-aligned slot whose
//! first (little-endian) bytes hold the value, so a 4-byte parameter reads
//! exactly the 4 bytes of its value; a packed struct starts 8-aligned, each
//! field at its C offset; the pointer array points into the slot buffer,
//! which is never reallocated after it is built.

use std::collections::BTreeMap;
use std::ffi::c_void;

use crate::args::c_layout;
use crate::gpu::{ArgKind, KernelArg};

/// One parameter as a PTX entry declares it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ParamClass {
    /// `.u32`, `.s32`, `.b32`.
    Int32,
    /// `.u64`, `.s64`, `.b64` (pointers are these).
    Int64,
    /// `.f32`.
    F32,
    /// Anything else (`.f64`, byte arrays of structs), with its size.
    Other(usize),
}

impl ParamClass {
    /// Whether an argument of `kind` fits this parameter.
    pub fn accepts(self, kind: ArgKind) -> bool {
        matches!(
            (self, kind),
            (ParamClass::Int64, ArgKind::Ptr | ArgKind::U64)
                | (ParamClass::Int32, ArgKind::U32 | ArgKind::I32)
                | (ParamClass::F32, ArgKind::F32)
        )
    }

    /// The argument kind named in an error for this parameter.
    pub fn expected_kind(self) -> ArgKind {
        match self {
            ParamClass::Int32 => ArgKind::U32,
            ParamClass::F32 => ArgKind::F32,
            ParamClass::Int64 | ParamClass::Other(_) => ArgKind::U64,
        }
    }
}

/// The class of one `.param` declaration (`.param .align 8 .b8 p[16]`,
/// `.param .u64 p`).
fn classify(decl: &str) -> Option<ParamClass> {
    let toks: Vec<&str> = decl.split_whitespace().collect();
    if toks.first() != Some(&".param") {
        return None;
    }
    let mut i = 1;
    while toks
        .get(i)
        .is_some_and(|t| *t == ".align" || t.starts_with(".ptr"))
    {
        i += if toks[i] == ".align" { 2 } else { 1 };
    }
    let ty = *toks.get(i)?;
    let name = toks.get(i + 1).copied().unwrap_or("");
    let count = name
        .split_once('[')
        .and_then(|(_, n)| n.trim_end_matches(']').parse::<usize>().ok());
    let width = match ty {
        ".u32" | ".s32" | ".b32" => {
            return Some(count.map_or(ParamClass::Int32, |n| ParamClass::Other(4 * n)));
        }
        ".u64" | ".s64" | ".b64" => {
            return Some(count.map_or(ParamClass::Int64, |n| ParamClass::Other(8 * n)));
        }
        ".f32" => return Some(count.map_or(ParamClass::F32, |n| ParamClass::Other(4 * n))),
        ".f64" => 8,
        ".u16" | ".s16" | ".b16" | ".f16" => 2,
        ".u8" | ".s8" | ".b8" => 1,
        _ => return None,
    };
    Some(ParamClass::Other(width * count.unwrap_or(1)))
}

/// Every `.entry` of a PTX text with its parameter classes, by name.
pub fn ptx_entries(ptx: &str) -> BTreeMap<String, Vec<ParamClass>> {
    let mut out = BTreeMap::new();
    let mut rest = ptx;
    while let Some(at) = rest.find(".entry") {
        rest = &rest[at + ".entry".len()..];
        let listed = rest.find('(').filter(|&open| {
            let name = rest[..open].trim();
            !name.is_empty() && !name.contains(|c: char| c.is_whitespace() || c == '{')
        });
        let Some(open) = listed else {
            // An entry without a parameter list: `.entry name {` (any `(`
            // further on belongs to something else).
            let name: String = rest
                .trim_start()
                .chars()
                .take_while(|c| c.is_alphanumeric() || *c == '_' || *c == '$')
                .collect();
            if !name.is_empty() {
                out.insert(name, Vec::new());
            }
            continue;
        };
        let name = rest[..open].trim();
        let Some(close) = rest[open..].find(')') else {
            break;
        };
        let list = &rest[open + 1..open + close];
        let params = list
            .split(',')
            .map(str::trim)
            .filter(|d| !d.is_empty())
            .map(|d| classify(d).unwrap_or(ParamClass::Other(0)))
            .collect();
        out.insert(name.to_string(), params);
        rest = &rest[open + close..];
    }
    out
}

/// Launch arguments laid out for `cuLaunchKernel`.
pub(crate) struct Params {
    slots: Vec<u64>,
    ptrs: Vec<*mut c_void>,
}

impl Params {
    /// Lay out `args`, one 8-byte slot each.
    pub fn new(args: &[KernelArg]) -> Params {
        let mut slots: Vec<u64> = args
            .iter()
            .map(|a| match *a {
                KernelArg::Ptr(p) => p.0,
                KernelArg::U64(v) => v,
                KernelArg::U32(v) => u64::from(v),
                KernelArg::I32(v) => u64::from(v as u32),
                KernelArg::F32(v) => u64::from(v.to_bits()),
            })
            .collect();
        let base = slots.as_mut_ptr();
        let ptrs = (0..slots.len())
            // SAFETY: `i < slots.len()`, so the offset stays inside the
            // buffer; the buffer is never resized after this.
            .map(|i| unsafe { base.add(i) } as *mut c_void)
            .collect();
        Params { slots, ptrs }
    }

    /// Lay out `args` as the fields of one C struct, passed as the only
    /// parameter.
    pub fn packed(args: &[KernelArg]) -> Params {
        let (offsets, size) = c_layout(args.iter().map(KernelArg::kind));
        let mut bytes = vec![0u8; size.next_multiple_of(8)];
        for (a, at) in args.iter().zip(offsets) {
            let v: &[u8] = &match *a {
                KernelArg::Ptr(p) => p.0.to_le_bytes().to_vec(),
                KernelArg::U64(v) => v.to_le_bytes().to_vec(),
                KernelArg::U32(v) => v.to_le_bytes().to_vec(),
                KernelArg::I32(v) => v.to_le_bytes().to_vec(),
                KernelArg::F32(v) => v.to_le_bytes().to_vec(),
            };
            bytes[at..at + v.len()].copy_from_slice(v);
        }
        let mut slots: Vec<u64> = bytes
            .chunks_exact(8)
            .map(|c| u64::from_le_bytes(c.try_into().expect("8 bytes")))
            .collect();
        let ptrs = if slots.is_empty() {
            Vec::new()
        } else {
            vec![slots.as_mut_ptr() as *mut c_void]
        };
        Params { slots, ptrs }
    }

    /// The bytes parameter `i` passes: 8 for pointers and `u64`, else 4.
    #[cfg(test)]
    fn bytes(&self, i: usize, kind: ArgKind) -> Vec<u8> {
        let b = self.slots[i].to_le_bytes();
        match kind {
            ArgKind::Ptr | ArgKind::U64 => b.to_vec(),
            ArgKind::U32 | ArgKind::I32 | ArgKind::F32 => b[..4].to_vec(),
        }
    }

    /// The `kernelParams` array: one pointer per parameter.
    pub fn as_mut_ptrs(&mut self) -> &mut [*mut c_void] {
        // One slot per argument, or a packed struct in one or more slots.
        debug_assert!(self.ptrs.len() <= self.slots.len());
        &mut self.ptrs
    }

    /// Whether pointer `i` of the array points at slot `i`.
    #[cfg(test)]
    fn points_at_slots(&self) -> bool {
        self.ptrs
            .iter()
            .zip(&self.slots)
            .all(|(p, s)| std::ptr::eq(*p as *const u64, s))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gpu::DevicePtr;

    #[test]
    fn arguments_marshal_little_endian_one_slot_each() {
        let args = [
            KernelArg::Ptr(DevicePtr(0x7f00_1234_5678)),
            KernelArg::U32(0xDEAD_BEEF),
            KernelArg::U64(0x0123_4567_89AB_CDEF),
            KernelArg::I32(-5),
            KernelArg::F32(1.5),
        ];
        let mut p = Params::new(&args);
        assert!(p.points_at_slots());
        assert_eq!(p.as_mut_ptrs().len(), 5);
        assert_eq!(p.bytes(0, ArgKind::Ptr), 0x7f00_1234_5678u64.to_le_bytes());
        assert_eq!(p.bytes(1, ArgKind::U32), 0xDEAD_BEEFu32.to_le_bytes());
        assert_eq!(
            p.bytes(2, ArgKind::U64),
            0x0123_4567_89AB_CDEFu64.to_le_bytes()
        );
        assert_eq!(p.bytes(3, ArgKind::I32), (-5i32).to_le_bytes());
        assert_eq!(p.bytes(4, ArgKind::F32), 1.5f32.to_le_bytes());
        // What the driver reads through each pointer.
        for (i, a) in args.iter().enumerate() {
            let n = if matches!(a.kind(), ArgKind::Ptr | ArgKind::U64) {
                8
            } else {
                4
            };
            // SAFETY: each pointer names an 8-byte slot owned by `p`.
            let seen = unsafe { std::slice::from_raw_parts(p.as_mut_ptrs()[i] as *const u8, n) };
            assert_eq!(seen, &p.bytes(i, a.kind())[..], "argument {i}");
        }
        // The pointers survive moving the Params value.
        let moved = p;
        assert!(moved.points_at_slots());
        assert!(Params::new(&[]).slots.is_empty());
    }

    #[test]
    fn a_struct_parameter_holds_the_arguments_at_their_c_offsets() {
        let args = [
            KernelArg::Ptr(DevicePtr(0x7f00_1234_5678)),
            KernelArg::U32(3),
            KernelArg::F32(1.5),
            KernelArg::I32(-2),
            KernelArg::U64(0x0123_4567_89AB_CDEF),
            KernelArg::U32(9),
        ];
        let mut p = Params::packed(&args);
        assert_eq!(p.as_mut_ptrs().len(), 1, "one parameter");
        assert!(std::ptr::eq(p.ptrs[0] as *const u64, &p.slots[0]));
        // SAFETY: the one pointer names the 40 bytes of `p.slots`.
        let seen = unsafe { std::slice::from_raw_parts(p.as_mut_ptrs()[0] as *const u8, 40) };
        let mut want = Vec::new();
        want.extend(0x7f00_1234_5678u64.to_le_bytes());
        want.extend(3u32.to_le_bytes());
        want.extend(1.5f32.to_le_bytes());
        want.extend((-2i32).to_le_bytes());
        want.extend([0; 4]);
        want.extend(0x0123_4567_89AB_CDEFu64.to_le_bytes());
        want.extend(9u32.to_le_bytes());
        want.extend([0; 4]);
        assert_eq!(seen, &want[..]);
        assert!(Params::packed(&[]).ptrs.is_empty());
    }

    #[test]
    fn ptx_signatures_are_read_from_entries() {
        let ptx = r#"
.version 8.5
.target sm_90
.address_size 64

	// .globl	gather
.visible .entry gather(
	.param .u64 gather_param_0,
	.param .u32 gather_param_1,
	.param .u32 gather_param_2,
	.param .u32 gather_param_3,
	.param .u64 gather_param_4
)
{
	ret;
}
.visible .entry gate(
	.param .u64 .ptr .global .align 4 gate_param_0,
	.param .f32 gate_param_1,
	.param .align 8 .b8 gate_param_2[16]
)
{
	ret;
}
.visible .entry empty()
{
	ret;
}
"#;
        let e = ptx_entries(ptx);
        use ParamClass::*;
        assert_eq!(e["gather"], [Int64, Int32, Int32, Int32, Int64]);
        assert_eq!(e["gate"], [Int64, F32, Other(16)]);
        assert_eq!(e["empty"], []);
        assert_eq!(e.len(), 3);
        assert!(Int64.accepts(ArgKind::Ptr) && Int64.accepts(ArgKind::U64));
        assert!(Int32.accepts(ArgKind::I32) && !Int32.accepts(ArgKind::F32));
        assert!(!F32.accepts(ArgKind::U32) && !Other(16).accepts(ArgKind::U64));
    }
}
