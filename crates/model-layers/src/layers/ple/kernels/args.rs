//! The argument struct of every kernel of module `"ple"`, the one statement
//! of each kernel's argument list.
//!
//! A launch site fills the struct by name and launches it
//! ([`Launch::args`](metrale_gpu_runtime::gpu::Launch::args)); a host
//! kernel (`host.rs`) is registered with its struct and reads it by name;
//! `kernels/ple.cu` declares the same structs in a block generated from
//! these definitions ([`cuda_block`]), checked by a test that regenerates it,
//! and each device kernel takes its struct by value.
//!
//! Invariants: field names are the same in Rust and CUDA C++; pointer fields
//! give the CUDA C++ type the device kernel reads them as; every struct has
//! the C layout of its fields (tested), which the CUDA backend packs.

use metrale_gpu_runtime::args::ArgsInfo;
use metrale_gpu_runtime::gpu::DevicePtr;
use metrale_gpu_runtime::kernel_args;

kernel_args! {
    /// `gather`: `n` rows through their references into `out` (`n *
    /// head_dim` values, f32).
    pub struct GatherArgs {
        /// The row references (`RowRef`, 16 bytes each).
        pub refs: DevicePtr as "const RowRef*",
        /// Rows to gather.
        pub n: u32,
        /// Values per row.
        pub head_dim: u32,
        /// The rows' type ([`GatherDType::arg`](super::gather::GatherDType::arg)).
        pub dtype: u32,
        /// The gathered rows.
        pub out: DevicePtr as "float*",
    }

    /// `gather_runs`: as `gather`, reference `i` to out row `(i / run) *
    /// stride + i % run` (the rows between runs are left as they are).
    pub struct GatherRunsArgs {
        /// The row references.
        pub refs: DevicePtr as "const RowRef*",
        /// Rows to gather.
        pub n: u32,
        /// Values per row.
        pub head_dim: u32,
        /// The rows' type.
        pub dtype: u32,
        /// The gathered rows, in runs.
        pub out: DevicePtr as "float*",
        /// Rows per run (`0 < run <= stride`).
        pub run: u32,
        /// Out rows from one run to the next.
        pub stride: u32,
    }

    /// `gather_ids` (device only): rows addressed by id in one table of
    /// `rows` rows; an id past the table gives a row of NaN.
    pub struct GatherIdsArgs {
        /// The ids, `n` of them.
        pub ids: DevicePtr as "const u64*",
        /// Rows to gather.
        pub n: u32,
        /// Values per row.
        pub head_dim: u32,
        /// The rows' type.
        pub dtype: u32,
        /// The table: row `r` at `table + r * row bytes`.
        pub table: DevicePtr as "const u8*",
        /// The FP8 rows' scales, one per row.
        pub scales: DevicePtr as "const float*",
        /// Rows in the table.
        pub rows: u64,
        /// The gathered rows.
        pub out: DevicePtr as "float*",
    }

    /// `hash` (device only): the ids of `t` new tokens after `hist_len`
    /// tokens of history (docs/SPEC.md §3 (Id hash)).
    pub struct HashArgs {
        /// The history (only its last `ngram_size - 1` tokens matter).
        pub history: DevicePtr as "const u32*",
        /// Tokens of history.
        pub hist_len: u32,
        /// The new tokens.
        pub tokens: DevicePtr as "const u32*",
        /// New tokens.
        pub t: u32,
        /// The multipliers, `ngram_size` of them.
        pub mults: DevicePtr as "const u64*",
        /// Each head's prime size.
        pub sizes: DevicePtr as "const u64*",
        /// Each head's first row in the table.
        pub offsets: DevicePtr as "const u64*",
        /// The n-gram size `N`.
        pub ngram_size: u32,
        /// Heads per n-gram `K`.
        pub heads_per_ngram: u32,
        /// The end-of-sequence token.
        pub eos: u32,
        /// The ids, `t * (N - 1) * K` of them, token-major.
        pub out: DevicePtr as "u64*",
    }

    /// `project`: `y [t, o] = x [t, e] · Wᵀ` with `W` packed
    /// ([`pack_projection`](super::pack_projection)).
    pub struct ProjectArgs {
        /// The input rows.
        pub x: DevicePtr as "const float*",
        /// The packed weight.
        pub w: DevicePtr as "const u32*",
        /// The output rows.
        pub y: DevicePtr as "float*",
        /// Rows.
        pub t: u32,
        /// Inputs per row.
        pub e: u32,
        /// Outputs per row.
        pub o: u32,
    }

    /// `project_range`: `project` over steps `from..to` only, continuing
    /// `y`'s sums when `accumulate` is 1.
    pub struct ProjectRangeArgs {
        /// The input rows.
        pub x: DevicePtr as "const float*",
        /// The packed weight.
        pub w: DevicePtr as "const u32*",
        /// The output rows (or partial sums).
        pub y: DevicePtr as "float*",
        /// Rows.
        pub t: u32,
        /// Inputs per row.
        pub e: u32,
        /// Outputs per row.
        pub o: u32,
        /// The first step (even).
        pub from: u32,
        /// The step after the last (even, or `e`).
        pub to: u32,
        /// 1: add to `y`'s sums; 0: start from zero.
        pub accumulate: u32,
    }

    /// `gate`: the Qwen4-Exp gate, `(1 + w)` norms with one eps, and `xn`.
    pub struct GateArgs {
        /// The highway rows `[t, h * hc]`.
        pub highway: DevicePtr as "const float*",
        /// The projection rows `[t, h * hc + h]`: keys, then the value.
        pub kv: DevicePtr as "const float*",
        /// The query norm weight `[h * hc]`.
        pub norm_q: DevicePtr as "const float*",
        /// The key norm weight.
        pub norm_k: DevicePtr as "const float*",
        /// The conv input norm weight.
        pub norm_conv: DevicePtr as "const float*",
        /// The gated values `[t, h * hc]`.
        pub gated: DevicePtr as "float*",
        /// The normed gated values, the conv's input.
        pub xn: DevicePtr as "float*",
        /// Rows.
        pub t: u32,
        /// Values per stream.
        pub h: u32,
        /// Streams.
        pub hc: u32,
        /// The norms' eps.
        pub eps: f32,
    }

    /// `gate_norms`: the gate with a norm form, a zero-dot rule and an
    /// eps per norm; without `conv`, `norm_conv` and `xn` are untouched.
    pub struct GateNormsArgs {
        /// The highway rows.
        pub highway: DevicePtr as "const float*",
        /// The projection rows.
        pub kv: DevicePtr as "const float*",
        /// The query norm weight.
        pub norm_q: DevicePtr as "const float*",
        /// The key norm weight.
        pub norm_k: DevicePtr as "const float*",
        /// The conv input norm weight (null without `conv`).
        pub norm_conv: DevicePtr as "const float*",
        /// The gated values.
        pub gated: DevicePtr as "float*",
        /// The normed gated values (null without `conv`).
        pub xn: DevicePtr as "float*",
        /// Rows.
        pub t: u32,
        /// Values per stream.
        pub h: u32,
        /// Streams.
        pub hc: u32,
        /// The query norm's eps.
        pub eps_q: f32,
        /// The key norm's eps.
        pub eps_k: f32,
        /// The conv input norm's eps.
        pub eps_conv: f32,
        /// Bit 0: the norm (0 `1 + w`, 1 `w`); bit 1: the zero-dot rule
        /// (copysign).
        pub form: u32,
        /// 1: compute `xn` for a conv; 0: no conv.
        pub conv: u32,
    }

    /// `rms_norm` (device only): `y = x * rsqrt(mean(x²) + eps) * (1 + w)`
    /// over each `h`-wide group of `x [t, hc * h]`.
    pub struct RmsNormArgs {
        /// The input rows.
        pub x: DevicePtr as "const float*",
        /// The weight `[hc * h]`.
        pub w: DevicePtr as "const float*",
        /// The output rows.
        pub y: DevicePtr as "float*",
        /// Rows.
        pub t: u32,
        /// Values per group.
        pub h: u32,
        /// Groups.
        pub hc: u32,
        /// The norm's eps.
        pub eps: f32,
    }

    /// `conv`: the dilated causal depthwise conv of `t` rows of one
    /// sequence with its carried state, and the highway add.
    pub struct ConvArgs {
        /// The conv input rows `[t, c]`.
        pub xn: DevicePtr as "const float*",
        /// The gated rows added to the highway.
        pub gated: DevicePtr as "const float*",
        /// The carried state `[(k - 1) * d, c]`, updated.
        pub state: DevicePtr as "float*",
        /// The conv weight `[c, k]`.
        pub w: DevicePtr as "const float*",
        /// The highway rows, added to.
        pub highway: DevicePtr as "float*",
        /// Rows.
        pub t: u32,
        /// Channels.
        pub c: u32,
        /// Kernel size.
        pub k: u32,
        /// Dilation.
        pub d: u32,
    }

    /// `conv_batch`: one row of each of `b` sequences, row `i`'s state at
    /// `states[i]`.
    pub struct ConvBatchArgs {
        /// The conv input rows `[b, c]`.
        pub xn: DevicePtr as "const float*",
        /// The gated rows.
        pub gated: DevicePtr as "const float*",
        /// The state pointers, one per row (distinct states).
        pub states: DevicePtr as "const u64*",
        /// The conv weight.
        pub w: DevicePtr as "const float*",
        /// The highway rows, added to.
        pub highway: DevicePtr as "float*",
        /// Rows (sequences).
        pub b: u32,
        /// Channels.
        pub c: u32,
        /// Kernel size.
        pub k: u32,
        /// Dilation.
        pub d: u32,
    }

    /// `bias_add`: `y[t, o] += bias[o]`.
    pub struct BiasAddArgs {
        /// The rows `[t, o]`, added to.
        pub y: DevicePtr as "float*",
        /// The bias `[o]`.
        pub bias: DevicePtr as "const float*",
        /// Rows.
        pub t: u32,
        /// Values per row.
        pub o: u32,
    }

    /// `highway_add`: `highway[i] += out[i]` for `i < n`.
    pub struct HighwayAddArgs {
        /// The highway, added to.
        pub highway: DevicePtr as "float*",
        /// What is added.
        pub out: DevicePtr as "const float*",
        /// Values.
        pub n: u32,
    }

    /// `mean_add`: `highway[i] = (highway[i] + value[i]) / divisor` for
    /// `i < n` (LongCat's mean).
    pub struct MeanAddArgs {
        /// The highway, updated.
        pub highway: DevicePtr as "float*",
        /// What is added before the division.
        pub value: DevicePtr as "const float*",
        /// Values.
        pub n: u32,
        /// The divisor.
        pub divisor: f32,
    }
}

/// Every kernel of module `"ple"` with its argument struct, in the order
/// of `ple.cu`'s generated block.
pub const KERNELS: [(&str, ArgsInfo); 14] = [
    ("gather", ArgsInfo::of::<GatherArgs>()),
    ("gather_runs", ArgsInfo::of::<GatherRunsArgs>()),
    ("gather_ids", ArgsInfo::of::<GatherIdsArgs>()),
    ("hash", ArgsInfo::of::<HashArgs>()),
    ("project", ArgsInfo::of::<ProjectArgs>()),
    ("project_range", ArgsInfo::of::<ProjectRangeArgs>()),
    ("gate", ArgsInfo::of::<GateArgs>()),
    ("gate_norms", ArgsInfo::of::<GateNormsArgs>()),
    ("rms_norm", ArgsInfo::of::<RmsNormArgs>()),
    ("conv", ArgsInfo::of::<ConvArgs>()),
    ("conv_batch", ArgsInfo::of::<ConvBatchArgs>()),
    ("bias_add", ArgsInfo::of::<BiasAddArgs>()),
    ("highway_add", ArgsInfo::of::<HighwayAddArgs>()),
    ("mean_add", ArgsInfo::of::<MeanAddArgs>()),
];

/// The first line of the generated block in a `.cu` file.
pub const BLOCK_BEGIN: &str =
    "// ---- kernel argument structs, generated from their Rust definitions: do not edit ----\n";
/// The last line of the generated block.
pub const BLOCK_END: &str = "// ---- end of the generated kernel argument structs ----\n";

/// The generated block of a `.cu` file declaring `structs`: each struct's
/// CUDA C++ declaration between [`BLOCK_BEGIN`] and [`BLOCK_END`].
pub fn cuda_block(structs: impl IntoIterator<Item = ArgsInfo>) -> String {
    let mut s = String::from(BLOCK_BEGIN);
    for (i, a) in structs.into_iter().enumerate() {
        if i > 0 {
            s.push('\n');
        }
        s.push_str(&a.c_struct());
    }
    s.push_str(BLOCK_END);
    s
}

/// The generated block of `source` (from [`BLOCK_BEGIN`] to [`BLOCK_END`],
/// both included), if it has one.
pub fn find_block(source: &str) -> Option<&str> {
    let start = source.find(BLOCK_BEGIN)?;
    let end = source[start..].find(BLOCK_END)? + start + BLOCK_END.len();
    Some(&source[start..end])
}

/// The variable that makes the block tests rewrite a stale block.
pub const REWRITE_VAR: &str = "METRALE_WRITE_CUDA_ARGS";

/// Check that the generated block of the `.cu` file at `path` (whose text
/// is `source`) is `want`. With `rewrite` (tests pass whether
/// [`REWRITE_VAR`] is set), a stale block is rewritten in place, and the
/// check still fails, so the rewrite is seen and committed.
pub fn check_block(path: &str, source: &str, want: &str, rewrite: bool) -> Result<(), String> {
    let Some(have) = find_block(source) else {
        return Err(format!("{path}: no generated kernel argument block"));
    };
    if have == want {
        return Ok(());
    }
    if rewrite {
        let fresh = source.replacen(have, want, 1);
        std::fs::write(path, fresh).map_err(|e| format!("{path}: {e}"))?;
        return Err(format!(
            "{path}: the kernel argument block was stale; rewritten"
        ));
    }
    Err(format!(
        "{path}: the kernel argument block differs from the Rust definitions; rerun with \
         {REWRITE_VAR}=1 to rewrite it. Expected:\n{want}"
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::layers::ple::device_kernels::PLE_CU;

    #[test]
    fn every_struct_has_the_c_layout() {
        for (k, a) in KERNELS {
            assert!(a.has_c_layout(), "{k}: {a:?}");
        }
    }

    #[test]
    fn ple_cu_declares_the_structs_and_its_kernels_take_them() {
        let want = cuda_block(KERNELS.map(|(_, a)| a));
        let path = concat!(env!("CARGO_MANIFEST_DIR"), "/kernels/ple.cu");
        let rewrite = std::env::var_os(REWRITE_VAR).is_some();
        if let Err(e) = check_block(path, PLE_CU, &want, rewrite) {
            panic!("{e}");
        }
        for (k, a) in KERNELS {
            let decl = format!("extern \"C\" __global__ void {k}({} a)", a.name);
            assert!(PLE_CU.contains(&decl), "ple.cu lacks `{decl}`");
        }
        assert_eq!(
            PLE_CU.matches("__global__").count(),
            KERNELS.len(),
            "a kernel of ple.cu without an entry in KERNELS"
        );
    }

    #[test]
    fn a_stale_block_is_found() {
        let want = cuda_block([ArgsInfo::of::<HighwayAddArgs>()]);
        let src = format!("// head\n{want}// tail\n");
        assert_eq!(find_block(&src), Some(want.as_str()));
        assert!(check_block("x.cu", &src, &want, false).is_ok());
        let stale = src.replace("unsigned int n;", "unsigned int count;");
        let e = check_block("x.cu", &stale, &want, false).unwrap_err();
        assert!(e.contains("x.cu") && e.contains("differs"), "{e}");
        assert!(check_block("x.cu", "// none", &want, false).is_err());
    }
}
