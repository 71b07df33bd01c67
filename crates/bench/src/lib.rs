//! metrale-bench: the benchmarks of metrale-ple, kept out of the library
//! crates so that a library user (and the default `metrale-ple` binary)
//! links none of them.
//!
//! The workloads, one module per crate they measure, are shared by the
//! `cargo bench` harnesses of this crate (`benches/`) and by `metrale-ple
//! bench` (the command line's `bench` feature):
//! - [`runtime`]: device copies against a host `memcpy`;
//! - [`table`]: row gather, the row cache's hit path and the miss path's
//!   random reads, each against its plain baseline;
//! - [`layer`]: the id hash and one PLE layer's forward against naive
//!   forms;
//! - [`engine`]: prefix restore and carry swap against recompute and
//!   `memcpy`.
//!
//! Beside them the measurement helpers of the command's drivers, which need
//! nothing of the command line: [`stats`] (alternating repetitions,
//! medians and their confidence interval), [`report`] (the
//! figure-beside-baseline table), [`memory`] (RSS and page-cache figures
//! read from the kernel), [`counters`] (storage bytes read and thread CPU
//! time), [`disk`] (the disk's random-read ceiling and a read's CPU cost).
//!
//! Invariant: a workload only sets up and runs the measured operation and
//! its same-run baseline; the caller does the timing, so the harnesses and
//! the command time the same code.

pub mod counters;
pub mod disk;
pub mod engine;
pub mod layer;
pub mod memory;
pub mod report;
pub mod runtime;
pub mod stats;
pub mod table;
