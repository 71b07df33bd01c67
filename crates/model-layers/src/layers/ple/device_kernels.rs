//! The PLE kernels on a backend that runs device code, and the launch
//! shapes of every PLE kernel on either kind of backend.
//!
//! A backend that runs host kernels gets the CPU kernels
//! ([`super::kernels::register_cpu_kernels`]); any other backend loads
//! `kernels/ple.cu` as module `"ple"`: the source is compiled through
//! [`metrale_gpu_runtime::compile_source`] (which knows how the backend
//! wants device code, and refuses when it loads none) and loaded with
//! `load_module`. Both modules hold kernels of the same names and argument
//! lists, so the layer launches them the same way and names no backend.
//!
//! Launch shapes ([`LaunchShapes`]): host kernels ignore the configuration
//! and keep the single-thread [`LaunchConfig`] they always had; device
//! kernels get grids that cover their work with the block shapes their fast
//! paths want (see the invariants at the top of `ple.cu`): every device
//! kernel loops grid-stride, so a shape changes speed, never bits.

use metrale_gpu_runtime::gpu::{GpuBackend, LaunchConfig};
use metrale_gpu_runtime::{GpuError, compile_source};

/// The CUDA C++ source of the device kernels.
pub const PLE_CU: &str = include_str!("../../../kernels/ple.cu");

/// The kernel module name on every backend.
pub const MODULE: &str = "ple";

/// The kernels the layer launches, which every module `"ple"` must hold.
pub const LAYER_KERNELS: [&str; 11] = [
    "gather",
    "gather_runs",
    "project",
    "project_range",
    "gate",
    "gate_norms",
    "conv",
    "conv_batch",
    "bias_add",
    "highway_add",
    "mean_add",
];

/// Compile and load `kernels/ple.cu` as module `"ple"`, unless every kernel
/// the layer launches already resolves (a second layer on the same backend
/// reuses the module; replacing it would wait for every queued launch).
pub fn load_ple_module(gpu: &dyn GpuBackend) -> Result<(), GpuError> {
    if LAYER_KERNELS.iter().all(|k| gpu.kernel(MODULE, k).is_ok()) {
        return Ok(());
    }
    let image = compile_source(gpu, "ple.cu", PLE_CU)?;
    gpu.load_module(MODULE, &image)
}

/// Threads per block of the one-dimensional device launches.
const BLOCK: u32 = 256;
/// Threads per block of the row kernels (gate): 16 lanes per row, whole
/// warps, so 8 rows per block.
const ROW_BLOCK: u32 = 128;
/// Threads per block of the conv kernels (one thread per channel).
const CONV_BLOCK: u32 = 128;
/// Most blocks of a grid-stride launch.
const MAX_GRID: u64 = 1 << 16;
/// The projection's tile: 32 outputs by 8 tokens, as `ple.cu` wants.
const PROJECT_TILE: (u32, u32) = (32, 8);

/// How the layer shapes its launches.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LaunchShapes {
    /// Host kernels: the configuration is ignored; one block of one thread.
    Host,
    /// Device kernels: grids that cover the work.
    Device,
}

/// Blocks of `block` threads covering `items`, at least one, at most
/// [`MAX_GRID`] (the kernels loop grid-stride over the rest).
fn blocks(items: u64, block: u32) -> u32 {
    items.div_ceil(u64::from(block)).clamp(1, MAX_GRID) as u32
}

impl LaunchShapes {
    /// The shapes for `gpu`'s kind of kernels.
    pub fn for_backend(gpu: &dyn GpuBackend) -> LaunchShapes {
        if gpu.supports_host_kernels() {
            LaunchShapes::Host
        } else {
            LaunchShapes::Device
        }
    }

    /// `gather` of `rows` rows of `head_dim` values: one thread per value.
    pub fn gather(self, rows: usize, head_dim: usize) -> LaunchConfig {
        match self {
            LaunchShapes::Host => LaunchConfig::linear(1, 1),
            LaunchShapes::Device => {
                LaunchConfig::linear(blocks((rows as u64) * head_dim as u64, BLOCK), BLOCK)
            }
        }
    }

    /// `project` of `t` tokens to `o` outputs: (32, 8) tiles.
    pub fn project(self, t: usize, o: usize) -> LaunchConfig {
        match self {
            LaunchShapes::Host => LaunchConfig::linear(1, 1),
            LaunchShapes::Device => {
                let (tx, ty) = PROJECT_TILE;
                let tiles = (o as u64).div_ceil(u64::from(tx)) * (t as u64).div_ceil(u64::from(ty));
                LaunchConfig {
                    grid: (tiles.clamp(1, MAX_GRID) as u32, 1, 1),
                    block: (tx, ty, 1),
                    shared_mem_bytes: 0,
                }
            }
        }
    }

    /// `gate` over `t` tokens of `hc` streams: 16 lanes per (token, stream).
    pub fn gate(self, t: usize, hc: usize) -> LaunchConfig {
        match self {
            LaunchShapes::Host => LaunchConfig::linear(1, 1),
            LaunchShapes::Device => {
                let rows_per_block = ROW_BLOCK / 16;
                LaunchConfig::linear(blocks((t as u64) * hc as u64, rows_per_block), ROW_BLOCK)
            }
        }
    }

    /// An element-wise kernel over `n` values (`bias_add`, `highway_add`,
    /// `mean_add`): one thread per value.
    pub fn elementwise(self, n: usize) -> LaunchConfig {
        self.gather(n, 1)
    }

    /// `conv` (one sequence, `c` channels, one thread each) or
    /// `conv_batch` (`b` sequences of `c` channels, one thread per pair).
    pub fn conv(self, sequences: usize, c: usize) -> LaunchConfig {
        match self {
            LaunchShapes::Host => LaunchConfig::linear(1, 1),
            LaunchShapes::Device => LaunchConfig::linear(
                blocks((sequences as u64) * c as u64, CONV_BLOCK),
                CONV_BLOCK,
            ),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use metrale_gpu_runtime::cpu::CpuBackend;

    #[test]
    fn host_shapes_stay_single_threaded() {
        let s = LaunchShapes::for_backend(&CpuBackend::new());
        assert_eq!(s, LaunchShapes::Host);
        let one = LaunchConfig::linear(1, 1);
        assert_eq!(s.gather(100, 64), one);
        assert_eq!(s.project(7, 300), one);
        assert_eq!(s.gate(7, 4), one);
        assert_eq!(s.conv(3, 1024), one);
    }

    #[test]
    fn device_shapes_cover_the_work() {
        let s = LaunchShapes::Device;
        let g = s.gather(100, 64);
        assert_eq!(g.block, (256, 1, 1));
        assert!(u64::from(g.grid.0) * 256 >= 6400);
        let p = s.project(9, 33);
        assert_eq!(p.block, (32, 8, 1));
        assert_eq!(p.grid, (4, 1, 1), "2 output tiles x 2 token tiles");
        let q = s.gate(5, 4);
        assert_eq!(q.block.0 % 32, 0, "whole warps for the 16-lane path");
        assert!(u64::from(q.grid.0) * u64::from(q.block.0) / 16 >= 20);
        let c = s.conv(3, 1000);
        assert!(u64::from(c.grid.0) * u64::from(c.block.0) >= 3000);
        // Empty and huge launches stay valid.
        assert_eq!(s.gather(0, 64).grid.0, 1);
        assert_eq!(s.gather(1 << 30, 1 << 10).grid.0 as u64, MAX_GRID);
    }

    #[test]
    fn the_module_has_every_layer_kernel_and_compiling_needs_a_device_backend() {
        for k in LAYER_KERNELS {
            assert!(
                PLE_CU.contains(&format!("__global__ void {k}(")),
                "ple.cu lacks {k}"
            );
        }
        let e = load_ple_module(&CpuBackend::new()).unwrap_err();
        assert!(matches!(e, GpuError::Unsupported { .. }), "{e:?}");
    }
}
