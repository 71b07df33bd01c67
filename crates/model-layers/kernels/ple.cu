// PLE device kernels, module "ple".
//
// The kernels the CPU backend registers as host kernels (gather,
// gather_runs, project, project_range, gate, gate_norms, conv, conv_batch,
// bias_add, highway_add, mean_add) have the same names here and take the
// same argument structs, so a layer launches the same kernels on either
// backend; hash, gather_ids and rms_norm have no host counterpart, for a
// path that stays on the device.
//
// Each kernel takes one argument struct by value (`gather` takes
// GatherArgs, `gather_runs` GatherRunsArgs, ...). The structs are defined
// once, in Rust (crates/model-layers/src/layers/ple/kernels/args.rs, where
// each field is documented); the block of them below is generated from
// those definitions, and a test there regenerates it and fails on a
// difference (METRALE_WRITE_CUDA_ARGS=1 rewrites it). Each struct asserts
// its size, which the runtime checks again against the PTX at launch.
//
// Invariants:
// - every kernel loops grid-stride over its work items, so any grid and any
//   block shape computes every output exactly once, with the same bits;
//   the fast shapes are one-dimensional blocks of a multiple of 32 threads
//   for gate and rms_norm (16 lanes per row, folded with warp shuffles) and
//   blocks of (32, 8) for the projection (shared-memory tiles);
// - arithmetic follows the host kernels operation for operation: the file
//   is compiled with --fmad=false, so a product and a sum round separately
//   unless the source calls fmaf; sums of a vector use the host's 16-lane
//   layout (element i in lane i % 16, in index order) and its fold tree
//   (8, 4, 2, 1); the projection is one sequential chain of fmaf per output
//   in step order; silu uses the host's exp polynomial. The gate's sigmoid
//   uses expf, which may differ from the host's exp in the last place;
// - the conv reads the carried state before it writes it: one thread owns a
//   channel of one sequence, computes every output of it, then shifts the
//   state, so no other thread sees a half-moved state;
// - rows are read through the addresses in the RowRef table, which may name
//   device memory, registered host memory or host-mapped slots alike
//   (zero-copy reads over the bus for the last two).
//
// Docs: docs/SPEC.md "Id hash" and "Layer math".

typedef unsigned long long u64;
typedef unsigned int u32;
typedef unsigned short u16;
typedef unsigned char u8;

#define LANES 16

// A row reference, as storage's `RowRef` (repr(C)): data and scale device
// addresses; scale is 0 for BF16 rows.
struct RowRef {
    u64 data;
    u64 scale;
};

// ---- kernel argument structs, generated from their Rust definitions: do not edit ----
struct GatherArgs {
    const RowRef* refs;
    unsigned int n;
    unsigned int head_dim;
    unsigned int dtype;
    float* out;
};
static_assert(sizeof(GatherArgs) == 32, "GatherArgs: 32 bytes in Rust");

struct GatherRunsArgs {
    const RowRef* refs;
    unsigned int n;
    unsigned int head_dim;
    unsigned int dtype;
    float* out;
    unsigned int run;
    unsigned int stride;
};
static_assert(sizeof(GatherRunsArgs) == 40, "GatherRunsArgs: 40 bytes in Rust");

struct GatherIdsArgs {
    const u64* ids;
    unsigned int n;
    unsigned int head_dim;
    unsigned int dtype;
    const u8* table;
    const float* scales;
    unsigned long long rows;
    float* out;
};
static_assert(sizeof(GatherIdsArgs) == 56, "GatherIdsArgs: 56 bytes in Rust");

struct HashArgs {
    const u32* history;
    unsigned int hist_len;
    const u32* tokens;
    unsigned int t;
    const u64* mults;
    const u64* sizes;
    const u64* offsets;
    unsigned int ngram_size;
    unsigned int heads_per_ngram;
    unsigned int eos;
    u64* out;
};
static_assert(sizeof(HashArgs) == 80, "HashArgs: 80 bytes in Rust");

struct ProjectArgs {
    const float* x;
    const u32* w;
    float* y;
    unsigned int t;
    unsigned int e;
    unsigned int o;
};
static_assert(sizeof(ProjectArgs) == 40, "ProjectArgs: 40 bytes in Rust");

struct ProjectRangeArgs {
    const float* x;
    const u32* w;
    float* y;
    unsigned int t;
    unsigned int e;
    unsigned int o;
    unsigned int from;
    unsigned int to;
    unsigned int accumulate;
};
static_assert(sizeof(ProjectRangeArgs) == 48, "ProjectRangeArgs: 48 bytes in Rust");

struct GateArgs {
    const float* highway;
    const float* kv;
    const float* norm_q;
    const float* norm_k;
    const float* norm_conv;
    float* gated;
    float* xn;
    unsigned int t;
    unsigned int h;
    unsigned int hc;
    float eps;
};
static_assert(sizeof(GateArgs) == 72, "GateArgs: 72 bytes in Rust");

struct GateNormsArgs {
    const float* highway;
    const float* kv;
    const float* norm_q;
    const float* norm_k;
    const float* norm_conv;
    float* gated;
    float* xn;
    unsigned int t;
    unsigned int h;
    unsigned int hc;
    float eps_q;
    float eps_k;
    float eps_conv;
    unsigned int form;
    unsigned int conv;
};
static_assert(sizeof(GateNormsArgs) == 88, "GateNormsArgs: 88 bytes in Rust");

struct RmsNormArgs {
    const float* x;
    const float* w;
    float* y;
    unsigned int t;
    unsigned int h;
    unsigned int hc;
    float eps;
};
static_assert(sizeof(RmsNormArgs) == 40, "RmsNormArgs: 40 bytes in Rust");

struct ConvArgs {
    const float* xn;
    const float* gated;
    float* state;
    const float* w;
    float* highway;
    unsigned int t;
    unsigned int c;
    unsigned int k;
    unsigned int d;
};
static_assert(sizeof(ConvArgs) == 56, "ConvArgs: 56 bytes in Rust");

struct ConvBatchArgs {
    const float* xn;
    const float* gated;
    const u64* states;
    const float* w;
    float* highway;
    unsigned int b;
    unsigned int c;
    unsigned int k;
    unsigned int d;
};
static_assert(sizeof(ConvBatchArgs) == 56, "ConvBatchArgs: 56 bytes in Rust");

struct BiasAddArgs {
    float* y;
    const float* bias;
    unsigned int t;
    unsigned int o;
};
static_assert(sizeof(BiasAddArgs) == 24, "BiasAddArgs: 24 bytes in Rust");

struct HighwayAddArgs {
    float* highway;
    const float* out;
    unsigned int n;
};
static_assert(sizeof(HighwayAddArgs) == 24, "HighwayAddArgs: 24 bytes in Rust");

struct MeanAddArgs {
    float* highway;
    const float* value;
    unsigned int n;
    float divisor;
};
static_assert(sizeof(MeanAddArgs) == 24, "MeanAddArgs: 24 bytes in Rust");
// ---- end of the generated kernel argument structs ----

// ------------------------------------------------------------ conversions

__device__ __forceinline__ float bf16_to_f32(u16 v) {
    return __uint_as_float(((u32)v) << 16);
}

// Round to the nearest BF16 value, ties to even; NaN stays NaN (quiet).
__device__ __forceinline__ float bf16_round(float x) {
    u32 bits = __float_as_uint(x);
    if (x != x) {
        return __uint_as_float(((bits >> 16) | 0x0040u) << 16);
    }
    u32 lsb = (bits >> 16) & 1u;
    return __uint_as_float(((bits + 0x7FFFu + lsb) >> 16) << 16);
}

// FP8 E4M3 (no infinities; S.1111.111 is NaN) to f32, exactly.
__device__ __forceinline__ float fp8_e4m3_to_f32(u8 b) {
    u32 sign = ((u32)(b >> 7)) << 31;
    u32 e = (b >> 3) & 0xFu;
    u32 m = b & 0x7u;
    if (e == 0xFu && m == 0x7u) {
        return __uint_as_float(sign | 0x7FC00000u);
    }
    if (e == 0u) {
        if (m == 0u) {
            return __uint_as_float(sign);
        }
        u32 p = 31u - __clz(m);
        u32 exp = p + 118u;
        u32 mant = (m - (1u << p)) << (23u - p);
        return __uint_as_float(sign | (exp << 23) | mant);
    }
    return __uint_as_float(sign | ((e + 120u) << 23) | (m << 20));
}

// A UE8M0 scale byte: 2^(e - 127), exactly; 255 is NaN.
__device__ __forceinline__ float ue8m0_to_f32(u8 e) {
    if (e == 255u) {
        return __uint_as_float(0x7FC00000u);
    }
    if (e == 0u) {
        return __uint_as_float(1u << 22);
    }
    return __uint_as_float(((u32)e) << 23);
}

// Bytes of one table row of `head_dim` values of type `dtype`.
__device__ __forceinline__ u64 row_bytes_of(u32 dtype, u32 head_dim) {
    if (dtype == 0u) {
        return (u64)head_dim * 2u;
    }
    if (dtype == 3u) {
        return (u64)head_dim * 4u;
    }
    if (dtype == 2u) {
        return (u64)head_dim + (head_dim + 31u) / 32u;
    }
    return head_dim;
}

// Value j of a block-scaled FP8 row (values, then a scale per 32 values).
__device__ __forceinline__ float fp8_block_value(const u8* row, u32 head_dim, u32 j) {
    return bf16_round(fp8_e4m3_to_f32(row[j]) * ue8m0_to_f32(row[head_dim + j / 32u]));
}

// ------------------------------------------------------------------- math

// The host's exp: Cody-Waite reduction and a degree-6 polynomial.
__device__ __forceinline__ float exp_vec(float x) {
    const float MAGIC = 12582912.0f;
    const float LOG2E = 1.44269504088896340736f;
    const float LN2_HI = 0.693359375f;
    const float LN2_LO = -2.12194440e-4f;
    // Clamp, keeping NaN.
    x = x < -87.0f ? -87.0f : (x > 88.0f ? 88.0f : x);
    float t = x * LOG2E + MAGIC;
    float n = t - MAGIC;
    int ni = (int)__float_as_uint(t) - 0x4B400000;
    float r = (x - n * LN2_HI) - n * LN2_LO;
    float p = 1.9875691e-4f;
    p = p * r + 1.3981999e-3f;
    p = p * r + 8.3334520e-3f;
    p = p * r + 4.1665796e-2f;
    p = p * r + 1.6666665e-1f;
    p = p * r + 0.5f;
    float er = p * (r * r) + r + 1.0f;
    return __uint_as_float(((u32)(ni + 127)) << 23) * er;
}

__device__ __forceinline__ float silu(float y) {
    return y / (1.0f + exp_vec(-y));
}

__device__ __forceinline__ float sigmoid(float z) {
    return 1.0f / (1.0f + expf(-z));
}

// sigmoid(sign(g) * sqrt(max(|g|, 1e-6))), sign(0) = 0, NaN passes.
__device__ __forceinline__ float gate_sigma(float g) {
    float sign;
    if (g > 0.0f) {
        sign = 1.0f;
    } else if (g < 0.0f) {
        sign = -1.0f;
    } else if (g == 0.0f) {
        sign = 0.0f;
    } else {
        sign = g;
    }
    // fmaxf, like the host's max, returns the number when g is NaN; the
    // sign (NaN) still makes the result NaN.
    float a = fmaxf(fabsf(g), 1e-6f);
    return sigmoid(sign * sqrtf(a));
}

// DeepSeek-V4.1's gate: sigmoid(copysign(sqrt(max(|g|, 1e-6)), g)); the
// sign bit of a zero g picks the side, and NaN stays NaN as torch's
// clamp_min keeps it (fmaxf would drop it).
__device__ __forceinline__ float gate_sigma_copysign(float g) {
    if (g != g) {
        return g;
    }
    return sigmoid(copysignf(sqrtf(fmaxf(fabsf(g), 1e-6f)), g));
}

// Fold the 16 lanes of a group (lane l holds lane sum l) with the host's
// tree: for w in 8, 4, 2, 1: acc[i] += acc[i + w]. The result is in lane 0
// and broadcast to the group.
__device__ __forceinline__ float fold16(float v) {
    const u32 mask = 0xFFFFFFFFu;
    v += __shfl_down_sync(mask, v, 8, LANES);
    v += __shfl_down_sync(mask, v, 4, LANES);
    v += __shfl_down_sync(mask, v, 2, LANES);
    v += __shfl_down_sync(mask, v, 1, LANES);
    return __shfl_sync(mask, v, 0, LANES);
}

// The sum of f(i) for i < n in the host's 16-lane layout and fold order.
// Cooperative (`coop`): this thread is lane `lane` of a group of 16 threads
// in one warp, and every lane gets the result. Otherwise this thread
// computes all 16 lanes itself (same order, so the same bits).
template <typename F>
__device__ __forceinline__ float lane_sum(F f, u32 n, u32 lane, bool coop) {
    if (coop) {
        float acc = 0.0f;
        for (u32 i = lane; i < n; i += LANES) {
            acc += f(i);
        }
        return fold16(acc);
    }
    float acc[LANES];
    for (u32 l = 0; l < LANES; ++l) {
        acc[l] = 0.0f;
    }
    for (u32 i = 0; i < n; ++i) {
        acc[i % LANES] += f(i);
    }
    for (u32 w = LANES / 2; w > 0; w /= 2) {
        for (u32 l = 0; l < w; ++l) {
            acc[l] += acc[l + w];
        }
    }
    return acc[0];
}

// 1 / sqrt(mean(x^2) + eps) over n values at x.
__device__ __forceinline__ float rms_factor(const float* x, u32 n, float eps, u32 lane, bool coop) {
    float s = lane_sum([&](u32 i) { return x[i] * x[i]; }, n, lane, coop);
    return 1.0f / sqrtf(s / (float)n + eps);
}

// How a row-per-group kernel splits its threads: 16 lanes per row when the
// block is one-dimensional with a multiple of 32 threads (whole warps),
// else one thread per row. `step` is the stride of a lane's elements.
struct Rows {
    bool coop;
    u32 lane;
    u32 step;
    u64 first;
    u64 count;
};

__device__ __forceinline__ Rows rows_split() {
    Rows r;
    r.coop = blockDim.y == 1u && blockDim.z == 1u && blockDim.x % 32u == 0u;
    u32 per = r.coop ? LANES : 1u;
    u32 nthreads = blockDim.x * blockDim.y * blockDim.z;
    u32 tid = (threadIdx.z * blockDim.y + threadIdx.y) * blockDim.x + threadIdx.x;
    r.lane = r.coop ? tid % LANES : 0u;
    r.step = per;
    r.first = ((u64)blockIdx.x * nthreads + tid) / per;
    r.count = ((u64)gridDim.x * nthreads) / per;
    return r;
}

// The number of loop rounds for `items` rows: every lane of a group runs
// the same number, so the shuffles always see their whole warp.
__device__ __forceinline__ u64 rounds_end(u64 items, u64 count) {
    return ((items + count - 1) / count) * count;
}

// ------------------------------------------------------------------ gather

// out[i, :] = row i of the references, as f32: BF16 values exactly; FP8
// values times the row's scale (dtype 1) or their block's UE8M0 scale
// (dtype 2), rounded to BF16; F32 values (dtype 3) as stored.
__device__ float gather_value(RowRef r, u32 j, u32 head_dim, u32 dtype) {
    if (dtype == 0u) {
        return bf16_to_f32(((const u16*)r.data)[j]);
    } else if (dtype == 3u) {
        return ((const float*)r.data)[j];
    } else if (dtype == 2u) {
        return fp8_block_value((const u8*)r.data, head_dim, j);
    }
    float scale = *(const float*)r.scale;
    return bf16_round(fp8_e4m3_to_f32(((const u8*)r.data)[j]) * scale);
}

extern "C" __global__ void gather(GatherArgs a) {
    u32 head_dim = a.head_dim;
    u64 total = (u64)a.n * head_dim;
    for (u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x; i < total;
         i += (u64)gridDim.x * blockDim.x) {
        u64 row = i / head_dim;
        u32 j = (u32)(i - row * head_dim);
        a.out[i] = gather_value(a.refs[row], j, head_dim, a.dtype);
    }
}

// Like gather, with the rows placed in runs: reference i lands on out row
// (i / run) * stride + i % run (one head group of every token of a batch,
// into the token-major emb).
extern "C" __global__ void gather_runs(GatherRunsArgs a) {
    u32 head_dim = a.head_dim;
    u64 total = (u64)a.n * head_dim;
    for (u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x; i < total;
         i += (u64)gridDim.x * blockDim.x) {
        u64 row = i / head_dim;
        u32 j = (u32)(i - row * head_dim);
        u64 dst = (row / a.run) * a.stride + row % a.run;
        a.out[dst * head_dim + j] = gather_value(a.refs[row], j, head_dim, a.dtype);
    }
}

// Like gather, with rows addressed by id in one table of `rows` rows
// (device memory or registered host memory): row r at table + r * row
// bytes, its FP8 scale at scales[r]. An id past the table gives a row of
// NaN.
extern "C" __global__ void gather_ids(GatherIdsArgs a) {
    const u64* ids = a.ids;
    u32 head_dim = a.head_dim, dtype = a.dtype;
    const u8* table = a.table;
    const float* scales = a.scales;
    u64 rows = a.rows;
    float* out = a.out;
    u64 total = (u64)a.n * head_dim;
    u64 row_bytes = row_bytes_of(dtype, head_dim);
    for (u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x; i < total;
         i += (u64)gridDim.x * blockDim.x) {
        u64 k = i / head_dim;
        u32 j = (u32)(i - k * head_dim);
        u64 id = ids[k];
        float v;
        if (id >= rows) {
            v = __uint_as_float(0x7FC00000u);
        } else if (dtype == 0u) {
            v = bf16_to_f32(((const u16*)(table + id * row_bytes))[j]);
        } else if (dtype == 3u) {
            v = ((const float*)(table + id * row_bytes))[j];
        } else if (dtype == 2u) {
            v = fp8_block_value(table + id * row_bytes, head_dim, j);
        } else {
            v = bf16_round(fp8_e4m3_to_f32(table[id * row_bytes + j]) * scales[id]);
        }
        out[i] = v;
    }
}

// --------------------------------------------------------------------- hash

// The ids of T new tokens (docs/SPEC.md "Id hash"): out[t * heads + h] for
// heads = (N - 1) * K. The sequence is history (hist_len tokens, only the
// last N - 1 matter) followed by tokens; positions before it read as EOS,
// and so does every position at or before an earlier EOS.
extern "C" __global__ void hash(HashArgs a) {
    const u32* history = a.history;
    const u32* tokens = a.tokens;
    const u64* mults = a.mults;
    const u64* sizes = a.sizes;
    const u64* offsets = a.offsets;
    u32 hist_len = a.hist_len, T = a.t, K = a.heads_per_ngram, eos = a.eos;
    u64* out = a.out;
    u32 ctx = a.ngram_size - 1u;
    u32 heads = ctx * K;
    for (u32 t = blockIdx.x * blockDim.x + threadIdx.x; t < T; t += gridDim.x * blockDim.x) {
        u64 mixed = (u64)tokens[t] * mults[0];
        bool ended = false;
        for (u32 p = 1; p <= ctx; ++p) {
            u32 v = eos;
            if (!ended) {
                // Position t - p of tokens, or of the history before them.
                if (p <= t) {
                    v = tokens[t - p];
                } else if (p - t <= hist_len) {
                    v = history[hist_len - (p - t)];
                }
                if (v == eos) {
                    ended = true;
                }
            }
            mixed ^= (u64)v * mults[p];
            u32 h0 = (p - 1u) * K;
            for (u32 h = h0; h < h0 + K; ++h) {
                out[(u64)t * heads + h] = mixed % sizes[h] + offsets[h];
            }
        }
    }
}

// ---------------------------------------------------------------- project

#define PR_NR 16
#define PR_TX 32
#define PR_TY 8
#define PR_KT 64

// y[t, o] = sum_e x[t, e] * W[o, e], as acc = fmaf(x, w, acc) in e order.
// W is packed as the host packs it: panels of 16 output rows; for each pair
// of steps (2i, 2i+1) a panel holds 16 words, word j = (W[j, 2i] << 16) |
// W[j, 2i+1] (BF16 bits), the last pair padded with zero when E is odd.
// Blocks of (32, 8) threads work on tiles of 32 outputs x 8 tokens through
// shared memory; any other block shape computes one output per thread
// directly, with the same chain (so the same bits). The body runs steps
// k0..k1 (k0 even; k1 even or E), from zero or, with accumulate, from the
// sums y holds: consecutive ranges give one call's bits.
__device__ void project_steps(const float* x, const u32* w, float* y, u32 T, u32 E, u32 O,
                              u32 k0, u32 k1, bool accumulate) {
    __shared__ float xs[PR_TY][PR_KT];
    u32 half_e = (E + 1u) / 2u;
    if (blockDim.x != PR_TX || blockDim.y != PR_TY || blockDim.z != 1u) {
        u64 total = (u64)T * O;
        u64 nthreads = (u64)gridDim.x * blockDim.x * blockDim.y * blockDim.z;
        u64 first = (u64)blockIdx.x * blockDim.x * blockDim.y * blockDim.z +
                    (threadIdx.z * blockDim.y + threadIdx.y) * blockDim.x + threadIdx.x;
        for (u64 i = first; i < total; i += nthreads) {
            u64 t = i / O;
            u32 o = (u32)(i - t * O);
            const u32* panel = w + (u64)(o / PR_NR) * half_e * PR_NR + (o % PR_NR);
            const float* xr = x + t * E;
            float acc = accumulate ? y[i] : 0.0f;
            for (u32 e = k0; e < k1; e += 2u) {
                u32 word = panel[(u64)(e / 2u) * PR_NR];
                acc = fmaf(xr[e], bf16_to_f32((u16)(word >> 16)), acc);
                if (e + 1u < k1) {
                    acc = fmaf(xr[e + 1u], bf16_to_f32((u16)(word & 0xFFFFu)), acc);
                }
            }
            y[i] = acc;
        }
        return;
    }
    u32 tiles_o = (O + PR_TX - 1u) / PR_TX;
    u32 tiles_t = (T + PR_TY - 1u) / PR_TY;
    u32 tid = threadIdx.y * blockDim.x + threadIdx.x;
    u32 nthreads = blockDim.x * blockDim.y;
    for (u64 tile = blockIdx.x; tile < (u64)tiles_o * tiles_t; tile += gridDim.x) {
        u32 o0 = (u32)(tile % tiles_o) * PR_TX;
        u32 t0 = (u32)(tile / tiles_o) * PR_TY;
        u32 o = o0 + threadIdx.x;
        u32 t = t0 + threadIdx.y;
        bool live = threadIdx.x < PR_TX && threadIdx.y < PR_TY && o < O && t < T;
        const u32* panel = w + (u64)(o / PR_NR) * half_e * PR_NR + (o % PR_NR);
        float acc = (live && accumulate) ? y[(u64)t * O + o] : 0.0f;
        for (u32 e0 = k0; e0 < k1; e0 += PR_KT) {
            __syncthreads();
            for (u32 k = tid; k < PR_TY * PR_KT; k += nthreads) {
                u32 r = k / PR_KT, c = k % PR_KT;
                xs[r][c] = (t0 + r < T && e0 + c < k1) ? x[(u64)(t0 + r) * E + e0 + c] : 0.0f;
            }
            __syncthreads();
            if (live) {
                u32 e1 = min(k1, e0 + PR_KT);
                for (u32 e = e0; e < e1; e += 2u) {
                    u32 word = panel[(u64)(e / 2u) * PR_NR];
                    acc = fmaf(xs[threadIdx.y][e - e0], bf16_to_f32((u16)(word >> 16)), acc);
                    if (e + 1u < e1) {
                        acc = fmaf(xs[threadIdx.y][e + 1u - e0], bf16_to_f32((u16)(word & 0xFFFFu)), acc);
                    }
                }
            }
        }
        if (live) {
            y[(u64)t * O + o] = acc;
        }
    }
}

extern "C" __global__ void project(ProjectArgs a) {
    project_steps(a.x, a.w, a.y, a.t, a.e, a.o, 0u, a.e, false);
}

// project over steps from..to only (from even, to even or E, from < to <=
// E; a launch that breaks this computes nothing), continuing y's sums when
// accumulate is 1.
extern "C" __global__ void project_range(ProjectRangeArgs a) {
    u32 from = a.from, to = a.to, E = a.e;
    if (from >= to || to > E || (from & 1u) != 0u || (to != E && (to & 1u) != 0u)) {
        return;
    }
    project_steps(a.x, a.w, a.y, a.t, E, a.o, from, to, a.accumulate != 0u);
}

// -------------------------------------------------------------------- gate

// Per token t and stream s (H values each): q = highway slice, k = key
// slice of kv (kv rows are [key (C) | value (H)]); g = dot(norm_q(q),
// norm_k(k)) / sqrt(H); gated = sigma(g) * value; xn = norm_conv(gated)
// when `conv`. A norm is x * rsqrt(mean(x^2) + eps) * (off + w): off 1 is
// the (1 + w) form, 0 the w form (0 + w is w exactly). Rows are split as
// `rows_split` says.
__device__ __forceinline__ void gate_rows(const float* highway, const float* kv,
                                          const float* norm_q, const float* norm_k,
                                          const float* norm_conv, float* gated, float* xn, u32 T,
                                          u32 H, u32 hc, float eps_q, float eps_k, float eps_c,
                                          float off, bool conv, bool copysign) {
    u32 C = H * hc;
    Rows rs = rows_split();
    u64 pairs = (u64)T * hc;
    float inv_sqrt_h = 1.0f / sqrtf((float)H);
    for (u64 pair = rs.first; pair < rounds_end(pairs, rs.count); pair += rs.count) {
        bool live = pair < pairs;
        u64 t = live ? pair / hc : 0;
        u32 s = live ? (u32)(pair % hc) : 0;
        const float* q = highway + t * C + (u64)s * H;
        const float* k = kv + t * (u64)(C + H) + (u64)s * H;
        const float* value = kv + t * (u64)(C + H) + C;
        const float* wq = norm_q + (u64)s * H;
        const float* wk = norm_k + (u64)s * H;
        float* gs = gated + t * C + (u64)s * H;
        u32 n = live ? H : 0u;
        float rq = rms_factor(q, n, eps_q, rs.lane, rs.coop);
        float rk = rms_factor(k, n, eps_k, rs.lane, rs.coop);
        float dot = lane_sum(
            [&](u32 i) { return (q[i] * rq * (off + wq[i])) * (k[i] * rk * (off + wk[i])); }, n,
            rs.lane, rs.coop);
        float g = dot * inv_sqrt_h;
        float sigma = copysign ? gate_sigma_copysign(g) : gate_sigma(g);
        for (u32 i = rs.lane; i < n; i += rs.step) {
            gs[i] = sigma * value[i];
        }
        if (!conv) {
            continue;
        }
        const float* wc = norm_conv + (u64)s * H;
        float* xs = xn + t * C + (u64)s * H;
        // A lane reads back only what it wrote itself.
        float rc = rms_factor(gs, n, eps_c, rs.lane, rs.coop);
        for (u32 i = rs.lane; i < n; i += rs.step) {
            xs[i] = gs[i] * rc * (off + wc[i]);
        }
    }
}

// The Qwen4Exp gate: (1 + w) norms, one eps, with xn.
extern "C" __global__ void gate(GateArgs a) {
    gate_rows(a.highway, a.kv, a.norm_q, a.norm_k, a.norm_conv, a.gated, a.xn, a.t, a.h, a.hc,
              a.eps, a.eps, a.eps, 1.0f, true, false);
}

// The gate with a norm form (form bit 0; 0: 1 + w, 1: w), a zero-dot rule
// (form bit 1: copysign) and an eps per norm; without `conv` neither
// norm_conv nor xn is touched. A form with other bits computes nothing.
extern "C" __global__ void gate_norms(GateNormsArgs a) {
    u32 form = a.form;
    if ((form & ~3u) != 0u) {
        return;
    }
    gate_rows(a.highway, a.kv, a.norm_q, a.norm_k, a.norm_conv, a.gated, a.xn, a.t, a.h, a.hc,
              a.eps_q, a.eps_k, a.eps_conv, (form & 1u) == 0u ? 1.0f : 0.0f, a.conv != 0u,
              (form & 2u) != 0u);
}

// Grouped RMSNorm: y = x * rsqrt(mean(x^2) + eps) * (1 + w) over each
// H-wide group of x [T, hc * H], with w [hc * H].
extern "C" __global__ void rms_norm(RmsNormArgs a) {
    const float* x = a.x;
    const float* w = a.w;
    float* y = a.y;
    u32 T = a.t, H = a.h, hc = a.hc;
    float eps = a.eps;
    u32 C = H * hc;
    Rows rs = rows_split();
    u64 pairs = (u64)T * hc;
    for (u64 pair = rs.first; pair < rounds_end(pairs, rs.count); pair += rs.count) {
        bool live = pair < pairs;
        u64 t = live ? pair / hc : 0;
        u32 s = live ? (u32)(pair % hc) : 0;
        u32 n = live ? H : 0u;
        const float* xr = x + t * C + (u64)s * H;
        const float* wr = w + (u64)s * H;
        float* yr = y + t * C + (u64)s * H;
        float r = rms_factor(xr, n, eps, rs.lane, rs.coop);
        for (u32 i = rs.lane; i < n; i += rs.step) {
            yr[i] = xr[i] * r * (1.0f + wr[i]);
        }
    }
}

// -------------------------------------------------------------------- conv

// One channel c of one sequence: y[t] = sum_j w[c, j] * x[S + t - (K-1-j)D]
// over x = state ++ xn (S = (K-1) * D state rows), highway[t] += gated[t] +
// silu(y[t]); then the state becomes the last S rows of state ++ xn.
__device__ __forceinline__ void conv_channel(const float* xn, const float* gated, float* state,
                                             const float* w, float* highway, u32 T, u32 C,
                                             u32 K, u32 D, u32 c) {
    u32 S = (K - 1u) * D;
    for (u32 t = 0; t < T; ++t) {
        float y = 0.0f;
        for (u32 j = 0; j < K; ++j) {
            u32 r = S + t - (K - 1u - j) * D;
            float src = r < S ? state[(u64)r * C + c] : xn[(u64)(r - S) * C + c];
            y += w[(u64)c * K + j] * src;
        }
        u64 at = (u64)t * C + c;
        highway[at] += gated[at] + silu(y);
    }
    if (T >= S) {
        for (u32 i = 0; i < S; ++i) {
            state[(u64)i * C + c] = xn[(u64)(T - S + i) * C + c];
        }
    } else {
        for (u32 i = 0; i + T < S; ++i) {
            state[(u64)i * C + c] = state[(u64)(i + T) * C + c];
        }
        for (u32 i = 0; i < T; ++i) {
            state[(u64)(S - T + i) * C + c] = xn[(u64)i * C + c];
        }
    }
}

// The dilated causal depthwise conv of T tokens of one sequence, with its
// carried state [S, C], and the highway add. One thread per channel.
extern "C" __global__ void conv(ConvArgs a) {
    u32 C = a.c;
    for (u32 c = blockIdx.x * blockDim.x + threadIdx.x; c < C; c += gridDim.x * blockDim.x) {
        conv_channel(a.xn, a.gated, a.state, a.w, a.highway, a.t, C, a.k, a.d, c);
    }
}

// One token of each of B sequences: row b of xn, gated and highway belongs
// to the sequence whose state is at states[b]. One thread per (b, c).
extern "C" __global__ void conv_batch(ConvBatchArgs a) {
    u32 C = a.c;
    u64 total = (u64)a.b * C;
    for (u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x; i < total;
         i += (u64)gridDim.x * blockDim.x) {
        u64 b = i / C;
        u32 c = (u32)(i - b * C);
        u64 row = b * C;
        conv_channel(a.xn + row, a.gated + row, (float*)a.states[b], a.w, a.highway + row, 1u, C,
                     a.k, a.d, c);
    }
}

// ------------------------------------------------------------- element-wise

// y[t, o] += bias[o] over y [T, O].
extern "C" __global__ void bias_add(BiasAddArgs a) {
    u32 O = a.o;
    u64 total = (u64)a.t * O;
    for (u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x; i < total;
         i += (u64)gridDim.x * blockDim.x) {
        a.y[i] += a.bias[i % O];
    }
}

// highway[i] = (highway[i] + value[i]) / divisor for i < n: the mean of the
// word embedding and the projected rows (LongCat).
extern "C" __global__ void mean_add(MeanAddArgs a) {
    for (u32 i = blockIdx.x * blockDim.x + threadIdx.x; i < a.n; i += gridDim.x * blockDim.x) {
        a.highway[i] = (a.highway[i] + a.value[i]) / a.divisor;
    }
}

// highway[i] += out[i] for i < n.
extern "C" __global__ void highway_add(HighwayAddArgs a) {
    for (u32 i = blockIdx.x * blockDim.x + threadIdx.x; i < a.n; i += gridDim.x * blockDim.x) {
        a.highway[i] += a.out[i];
    }
}
