//! CUDA backend of ferrite: an embedded kernel library compiled at run time by NVRTC,
//! a module cache in memory and on disk, weights on the device, and the op layer the
//! graph executor calls.
//!
//! - [`kernels`]: CUDA C++ sources, one file per op family, with their typed variants.
//! - [`ops`]: the dispatchers (`embed`, `rms_norm`, `rope`, `linear`, `store_qkv`,
//!   `attention`, `swiglu`, `geglu`, `add`, `add_rows`, `copy_cols`, `argmax`, `sample`).
//! - [`Gpu`]: device, stream, cuBLAS handle, module cache.
//!
//! The crate builds and its CPU tests run without CUDA: libraries are loaded at run time,
//! and [`cuda_available`] says why a GPU cannot be used.

mod blas_lt;
mod cache;
mod ceilings;
mod compile;
mod device;
mod error;
mod executor;
pub mod kernels;
pub mod ops;
mod staging;
mod timeline;
mod weight;

pub use cache::{compile_variant, CacheKey, CacheStats, DiskCache, DiskLookup, KernelInfo};
pub use cudarc::driver::{CudaSlice, CudaView, CudaViewMut};
pub use device::{cuda_available, Gpu, GpuOptions, KernelCacheDir};
pub use error::CudaError;
pub use executor::{check_supported, open_executor, CudaExecutor};
pub use staging::{Mailbox, Readback, StagingRing};
pub use weight::{supported as weight_supported, DeviceWeight};
