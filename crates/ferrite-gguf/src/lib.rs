//! GGUF: the file format, the GGML tensor dtypes and their block layouts.

pub mod blocks;
pub mod dtype;

pub use dtype::GgmlType;
