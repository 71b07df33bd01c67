//! Typed kernel arguments: a kernel's argument list written once, as a
//! `#[repr(C)]` Rust struct declared with [`kernel_args!`](crate::kernel_args),
//! and everything else derived from it.
//!
//! From one declaration come: the struct the launch site fills by name
//! ([`Launch::args`](crate::gpu::Launch::args)), the signature a host kernel
//! is registered with and the decoding its body reads by name
//! (`register_typed_host_kernel` on `dyn GpuBackend`), and the CUDA C++
//! mirror of the struct ([`ArgsInfo::c_struct`]) that a device kernel takes
//! by value.
//!
//! Invariants:
//! - a struct's fields are [`ArgValue`]s (device pointers and 4- or 8-byte
//!   scalars); its launch arguments are its fields in declaration order, one
//!   [`KernelArg`] each, so every backend checks them as it checks any
//!   launch (each non-null pointer against its ledger);
//! - its layout is the C layout of its field kinds ([`c_layout`]: each field
//!   at the next multiple of its size, the whole a multiple of its largest
//!   field): what `repr(C)` gives the Rust struct, what [`ArgsInfo::c_struct`] declares
//!   for CUDA C++ (with a `static_assert` on the size), and what the CUDA
//!   backend packs the arguments into for a kernel whose one parameter is
//!   the struct by value.

use crate::gpu::{ArgKind, DevicePtr, KernelArg};

/// A type a kernel argument struct may hold as a field.
pub trait ArgValue: Copy {
    /// The argument kind it travels as.
    const KIND: ArgKind;
    /// Its CUDA C++ type, unless the field names one.
    const C_TYPE: &'static str;
    /// This value as a launch argument.
    fn into_arg(self) -> KernelArg;
    /// The value of a launch argument of this kind; `None` for another kind.
    fn from_arg(arg: &KernelArg) -> Option<Self>;
}

macro_rules! arg_value {
    ($($ty:ty => $variant:ident, $c:literal;)*) => {$(
        impl ArgValue for $ty {
            const KIND: ArgKind = ArgKind::$variant;
            const C_TYPE: &'static str = $c;
            fn into_arg(self) -> KernelArg {
                KernelArg::$variant(self)
            }
            fn from_arg(arg: &KernelArg) -> Option<Self> {
                match *arg {
                    KernelArg::$variant(v) => Some(v),
                    _ => None,
                }
            }
        }
    )*};
}

arg_value! {
    DevicePtr => Ptr, "unsigned long long";
    u32 => U32, "unsigned int";
    u64 => U64, "unsigned long long";
    i32 => I32, "int";
    f32 => F32, "float";
}

/// One field of a kernel argument struct.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ArgField {
    /// Its name, the same in Rust and CUDA C++.
    pub name: &'static str,
    /// The kind of argument it travels as.
    pub kind: ArgKind,
    /// Its byte offset in the Rust struct (`offset_of!`).
    pub offset: usize,
    /// Its CUDA C++ type.
    pub c_type: &'static str,
}

/// A kernel's arguments as one `#[repr(C)]` struct; implemented by
/// [`kernel_args!`](crate::kernel_args), not by hand.
pub trait KernelArgs: Copy + Send + Sync + 'static {
    /// The struct's name, the same in Rust and CUDA C++.
    const NAME: &'static str;
    /// Its fields in declaration order.
    const FIELDS: &'static [ArgField];
    /// Append the fields to `out` as launch arguments, in order.
    fn push_args(&self, out: &mut Vec<KernelArg>);
    /// The struct from launch arguments; `None` unless they are exactly
    /// the fields' kinds, in order.
    fn from_args(args: &[KernelArg]) -> Option<Self>;
}

/// The bytes an argument of `kind` occupies in a struct (its alignment too).
pub fn kind_size(kind: ArgKind) -> usize {
    match kind {
        ArgKind::Ptr | ArgKind::U64 => 8,
        ArgKind::U32 | ArgKind::I32 | ArgKind::F32 => 4,
    }
}

/// The C layout of a struct of fields of `kinds`: each field's offset and
/// the struct's size.
pub fn c_layout(kinds: impl IntoIterator<Item = ArgKind>) -> (Vec<usize>, usize) {
    let (mut offsets, mut at, mut align) = (Vec::new(), 0usize, 1usize);
    for k in kinds {
        let n = kind_size(k);
        at = at.next_multiple_of(n);
        offsets.push(at);
        at += n;
        align = align.max(n);
    }
    (offsets, at.next_multiple_of(align))
}

/// A kernel argument struct described by value: what its CUDA C++ mirror
/// and layout checks need, without naming the type.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ArgsInfo {
    /// The struct's name.
    pub name: &'static str,
    /// Its fields in order.
    pub fields: &'static [ArgField],
    /// `size_of` the Rust struct.
    pub size: usize,
}

impl ArgsInfo {
    /// The description of `T`.
    pub const fn of<T: KernelArgs>() -> ArgsInfo {
        ArgsInfo {
            name: T::NAME,
            fields: T::FIELDS,
            size: std::mem::size_of::<T>(),
        }
    }

    /// The kinds of its fields: the signature of a kernel taking it.
    pub fn signature(&self) -> Vec<ArgKind> {
        self.fields.iter().map(|f| f.kind).collect()
    }

    /// Whether the Rust layout is the C layout of the field kinds (what
    /// [`Self::c_struct`] declares and the CUDA backend packs).
    pub fn has_c_layout(&self) -> bool {
        let (offsets, size) = c_layout(self.signature());
        size == self.size && self.fields.iter().map(|f| f.offset).eq(offsets)
    }

    /// The CUDA C++ declaration: the struct with the same fields in the same
    /// order, and a `static_assert` that its size is the Rust struct's.
    pub fn c_struct(&self) -> String {
        let mut s = format!("struct {} {{\n", self.name);
        for f in self.fields {
            s.push_str(&format!("    {} {};\n", f.c_type, f.name));
        }
        s.push_str("};\n");
        s.push_str(&format!(
            "static_assert(sizeof({0}) == {1}, \"{0}: {1} bytes in Rust\");\n",
            self.name, self.size
        ));
        s
    }
}

/// Declare kernel argument structs: each a `#[repr(C)]` struct with
/// [`KernelArgs`](crate::args::KernelArgs) implemented from its fields.
///
/// A field is `name: Type`, with `Type` an
/// [`ArgValue`](crate::args::ArgValue); a pointer field may give its CUDA
/// C++ type as `name: DevicePtr as "const float*"`.
///
/// ```
/// metrale_gpu_runtime::kernel_args! {
///     /// `scale(x, n, by)`.
///     pub struct ScaleArgs {
///         /// The values, scaled in place.
///         pub x: metrale_gpu_runtime::gpu::DevicePtr as "float*",
///         /// How many.
///         pub n: u32,
///         /// The factor.
///         pub by: f32,
///     }
/// }
/// use metrale_gpu_runtime::args::{ArgsInfo, KernelArgs};
/// assert_eq!(ScaleArgs::FIELDS[2].offset, 12);
/// assert!(ArgsInfo::of::<ScaleArgs>().has_c_layout());
/// ```
#[macro_export]
macro_rules! kernel_args {
    (@c_type $ty:ty) => {
        <$ty as $crate::args::ArgValue>::C_TYPE
    };
    (@c_type $ty:ty, $c:literal) => {
        $c
    };
    ($(
        $(#[$meta:meta])*
        $vis:vis struct $name:ident {
            $(
                $(#[$fmeta:meta])*
                $fvis:vis $field:ident : $ty:ty $(as $c:literal)?
            ),* $(,)?
        }
    )*) => {$(
        $(#[$meta])*
        #[repr(C)]
        #[derive(Clone, Copy, Debug, PartialEq)]
        $vis struct $name {
            $(
                $(#[$fmeta])*
                $fvis $field: $ty,
            )*
        }

        impl $crate::args::KernelArgs for $name {
            const NAME: &'static str = stringify!($name);
            const FIELDS: &'static [$crate::args::ArgField] = &[$(
                $crate::args::ArgField {
                    name: stringify!($field),
                    kind: <$ty as $crate::args::ArgValue>::KIND,
                    offset: ::core::mem::offset_of!($name, $field),
                    c_type: $crate::kernel_args!(@c_type $ty $(, $c)?),
                },
            )*];

            fn push_args(&self, out: &mut Vec<$crate::gpu::KernelArg>) {
                $(out.push($crate::args::ArgValue::into_arg(self.$field));)*
            }

            fn from_args(args: &[$crate::gpu::KernelArg]) -> Option<Self> {
                let mut it = args.iter();
                let v = $name {
                    $($field: <$ty as $crate::args::ArgValue>::from_arg(it.next()?)?,)*
                };
                it.next().is_none().then_some(v)
            }
        }
    )*};
}

#[cfg(test)]
mod tests {
    use super::*;

    crate::kernel_args! {
        /// Every kind, in an order that needs padding.
        struct Mixed {
            a: u32,
            p: DevicePtr as "const float*",
            b: f32,
            c: i32,
            d: u64,
            e: u32,
        }

        /// Only 4-byte fields: 4-aligned, no tail padding.
        struct Small {
            n: u32,
            x: f32,
            m: u32,
        }
    }

    #[test]
    fn the_rust_layout_is_the_c_layout() {
        assert!(ArgsInfo::of::<Mixed>().has_c_layout());
        assert!(ArgsInfo::of::<Small>().has_c_layout());
        let off: Vec<usize> = Mixed::FIELDS.iter().map(|f| f.offset).collect();
        assert_eq!(off, [0, 8, 16, 20, 24, 32]);
        assert_eq!(std::mem::size_of::<Mixed>(), 40);
        assert_eq!(
            c_layout([ArgKind::U32, ArgKind::F32, ArgKind::U32]),
            (vec![0, 4, 8], 12)
        );
        assert_eq!(c_layout([]), (vec![], 0));
    }

    #[test]
    fn arguments_round_trip_in_field_order() {
        let m = Mixed {
            a: 1,
            p: DevicePtr(0x1000),
            b: 2.5,
            c: -3,
            d: 1 << 40,
            e: 7,
        };
        let mut args = Vec::new();
        m.push_args(&mut args);
        assert_eq!(
            args,
            [
                KernelArg::U32(1),
                KernelArg::Ptr(DevicePtr(0x1000)),
                KernelArg::F32(2.5),
                KernelArg::I32(-3),
                KernelArg::U64(1 << 40),
                KernelArg::U32(7),
            ]
        );
        assert_eq!(
            ArgsInfo::of::<Mixed>().signature(),
            args.iter().map(KernelArg::kind).collect::<Vec<_>>()
        );
        assert_eq!(Mixed::from_args(&args), Some(m));
        // A missing, an extra or a mistyped argument is no `Mixed`.
        assert_eq!(Mixed::from_args(&args[..5]), None);
        let mut extra = args.clone();
        extra.push(KernelArg::U32(0));
        assert_eq!(Mixed::from_args(&extra), None);
        args[1] = KernelArg::U64(0x1000);
        assert_eq!(Mixed::from_args(&args), None);
    }

    #[test]
    fn the_c_struct_names_every_field_and_the_size() {
        assert_eq!(
            ArgsInfo::of::<Small>().c_struct(),
            "struct Small {\n    unsigned int n;\n    float x;\n    unsigned int m;\n};\n\
             static_assert(sizeof(Small) == 12, \"Small: 12 bytes in Rust\");\n"
        );
        let m = ArgsInfo::of::<Mixed>().c_struct();
        assert!(
            m.contains("    const float* p;\n    float b;\n    int c;\n"),
            "{m}"
        );
        assert!(m.contains("    unsigned long long d;\n"), "{m}");
    }
}
