//! GGUF: the file format, the GGML tensor dtypes and their block layouts, bit-exact
//! dequantization and reference quantization.

pub mod blocks;
pub mod dtype;
pub mod error;
pub mod metadata;
pub mod quant;
pub mod reader;
pub mod writer;

pub use dtype::GgmlType;
pub use error::GgufError;
pub use metadata::{Metadata, Value};
pub use quant::{dequantize, dequantize_tensor, quantize, QuantBlock};
pub use reader::{GgufFile, TensorInfo};
pub use writer::GgufWriter;
