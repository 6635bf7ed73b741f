//! GGUF: the file format, the GGML tensor dtypes and their block layouts, bit-exact
//! dequantization and reference quantization.
//!
//! ```no_run
//! use ferrite_gguf::{dequantize_tensor, GgmlType, GgufFile, GgufWriter, Value};
//!
//! let file = GgufFile::open("models/SmolLM2-135M-Instruct.Q4_1.gguf")?;
//! let n_layers = file.metadata.u32("llama.block_count")?;
//! let eps = file.metadata.f32_or("llama.attention.layer_norm_rms_epsilon", 1e-5)?;
//! let norm = file.tensor("output_norm.weight").expect("the model has an output norm");
//! let weights: Vec<f32> = dequantize_tensor(&file, norm)?;
//!
//! let mut w = GgufWriter::new();
//! w.add_metadata("general.architecture", Value::String("llama".into()));
//! w.add_tensor_info("big.weight", &[4096, 4096], GgmlType::Q8_0)?;
//! // Data is produced tensor by tensor while writing.
//! w.write_file_with("synthetic.gguf", |t| {
//!     ferrite_gguf::quantize(t.dtype, &vec![0.5; t.n_elements() as usize])
//! })?;
//! # Ok::<(), ferrite_gguf::GgufError>(())
//! ```

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
