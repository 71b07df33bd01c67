//! The PLE layer (SPEC.md sections 4 and 5).

pub mod ids;
pub mod kernels;
