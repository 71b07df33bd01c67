// The backbone's device kernel: the gated activation of the MLP stand-in
// (`crates/engine/src/backbone.rs`). Its GEMMs are the PLE module's
// `project` (kernels/ple.cu in model-layers), so this file holds only what
// that module lacks.
//
// | name     | args                 |
// |----------|----------------------|
// | silu_mul | up, act, T, I        |
//
// act[t, i] = silu(up[t, i]) * up[t, I + i] for `up [T, 2I]`, `act [T, I]`.
// Pointers are `u64` parameters, `U32` arguments `unsigned int`.
//
// Invariant: grid-stride over the `T * I` outputs, so any grid computes
// every output exactly once. Its values feed nothing the model outputs (the
// backbone stands in for compute only), so the host kernel and this one
// need not agree bit for bit.

typedef unsigned long long u64;
typedef unsigned int u32;

extern "C" __global__ void silu_mul(const float* up, float* act, u32 t, u32 inter) {
    u64 n = (u64)t * inter;
    for (u64 k = (u64)blockIdx.x * blockDim.x + threadIdx.x; k < n;
         k += (u64)gridDim.x * blockDim.x) {
        u64 row = k / inter;
        u64 col = k % inter;
        float g = up[row * 2 * inter + col];
        float u = up[row * 2 * inter + inter + col];
        act[k] = g / (1.0f + expf(-g)) * u;
    }
}
