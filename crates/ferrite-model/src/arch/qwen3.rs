//! Qwen3 (dense): the Llama layout with QK-norm — an RMSNorm over each Q and K head (weights
//! `attn_q_norm` / `attn_k_norm`, `head_dim` wide) before RoPE — NeoX RoPE, and a head dimension
//! that need not equal `n_embd / n_heads` (`attention.key_length`).

use super::decoder::{self, DecoderOptions};
use crate::{FusionOptions, Graph, ModelConfig, ModelError, WeightSet};
use ferrite_gguf::GgufFile;

pub fn build(cfg: &ModelConfig, file: &GgufFile, fusion: FusionOptions) -> Result<(WeightSet, Graph), ModelError> {
    decoder::build(cfg, file, fusion, DecoderOptions { qk_norm: true, ..DecoderOptions::llama(cfg) })
}
