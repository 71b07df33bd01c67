// The backbone's device kernel: the gated activation of the MLP stand-in
// (`crates/engine/src/backbone.rs`). Its GEMMs are the PLE module's
// `project` (kernels/ple.cu in model-layers), so this file holds only what
// that module lacks.
//
// | name     | args                              |
// |----------|-----------------------------------|
// | silu_mul | SiluMulArgs: up, act, t, inter    |
//
// act[t, i] = silu(up[t, i]) * up[t, I + i] for `up [T, 2I]`, `act [T, I]`
// (I = inter). The kernel takes its argument struct by value; the struct
// is generated from its Rust definition (`SiluMulArgs` in
// crates/engine/src/backbone.rs), whose test regenerates the block below
// and fails on a difference.
//
// Invariant: grid-stride over the `T * I` outputs, so any grid computes
// every output exactly once. Its values feed nothing the model outputs (the
// backbone stands in for compute only), so the host kernel and this one
// need not agree bit for bit.

typedef unsigned long long u64;
typedef unsigned int u32;

// ---- kernel argument structs, generated from their Rust definitions: do not edit ----
struct SiluMulArgs {
    const float* up;
    float* act;
    unsigned int t;
    unsigned int inter;
};
static_assert(sizeof(SiluMulArgs) == 24, "SiluMulArgs: 24 bytes in Rust");
// ---- end of the generated kernel argument structs ----

extern "C" __global__ void silu_mul(SiluMulArgs a) {
    const float* up = a.up;
    float* act = a.act;
    u32 inter = a.inter;
    u64 n = (u64)a.t * inter;
    for (u64 k = (u64)blockIdx.x * blockDim.x + threadIdx.x; k < n;
         k += (u64)gridDim.x * blockDim.x) {
        u64 row = k / inter;
        u64 col = k % inter;
        float g = up[row * 2 * inter + col];
        float u = up[row * 2 * inter + inter + col];
        act[k] = g / (1.0f + expf(-g)) * u;
    }
}
