//! One file per architecture: each turns a config and a GGUF file into weights and a graph.

mod decoder;
mod gemma3;
mod llama;
mod qwen3;
mod qwen35;
mod qwen3next;

use crate::{Arch, FusionOptions, Graph, ModelConfig, ModelError, WeightSet};
use ferrite_gguf::GgufFile;

pub fn build(cfg: &ModelConfig, file: &GgufFile, fusion: FusionOptions) -> Result<(WeightSet, Graph), ModelError> {
    let (weights, mut graph) = match cfg.arch {
        Arch::Llama | Arch::Qwen2 => llama::build(cfg, file, fusion)?,
        Arch::Qwen3 => qwen3::build(cfg, file, fusion)?,
        Arch::Gemma3 => gemma3::build(cfg, file, fusion)?,
        Arch::Qwen35 | Arch::Qwen35Moe => qwen35::build(cfg, file, fusion)?,
        Arch::Qwen3Next => qwen3next::build(cfg, file, fusion)?,
    };
    if fusion.int8_handoff {
        graph.handoffs = crate::fusion::int8_handoffs(&graph, |w| weights.spec(w).rows);
    }
    if fusion.decoder_layer {
        graph.layers = crate::fusion::decoder_layers(&graph);
    }
    graph
        .validate(|w| weights.spec(w).rows)
        .map_err(|e| ModelError::Config(format!("internal graph error: {e}")))?;
    Ok((weights, graph))
}
