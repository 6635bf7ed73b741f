//! The CPU backend: compute kernels (SIMD, multithreaded) and the graph executor.

pub mod ceilings;
pub mod executor;
pub mod kernels;

pub use executor::{CpuExecutor, CpuPrecision};
