//! The CPU backend: compute kernels (SIMD, multithreaded) and the graph executor.

pub mod ceilings;
pub mod executor;
pub mod kernels;
mod memory;

pub use executor::{CpuExecutor, CpuPrecision};
