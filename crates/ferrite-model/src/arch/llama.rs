//! Llama family: Llama 1-3, SmolLM2, Mistral-style dense decoders, and Qwen2 (the same layout
//! with q/k/v biases, which the decoder picks up when the tensors exist, and NeoX RoPE).

use super::decoder::{self, DecoderOptions};
use crate::{FusionOptions, Graph, ModelConfig, ModelError, WeightSet};
use ferrite_gguf::GgufFile;

pub fn build(cfg: &ModelConfig, file: &GgufFile, fusion: FusionOptions) -> Result<(WeightSet, Graph), ModelError> {
    decoder::build(cfg, file, fusion, DecoderOptions::llama(cfg))
}
