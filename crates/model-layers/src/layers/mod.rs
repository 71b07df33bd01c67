//! Model layers. Only PLE for now.

pub mod ple;
