//! Gemma 3 (text): the shared decoder with
//! * QK-norm (`attn_q_norm` / `attn_k_norm`, as Qwen3),
//! * GeGLU (tanh-approximated GELU of the gate times up),
//! * RMSNorms after attention and after the MLP, before each residual add (`post_attention_norm`,
//!   `post_ffw_norm`, besides the usual `attn_norm` / `ffn_norm` before them),
//! * token embeddings multiplied by `sqrt(n_embd)` (the tied output head uses them unscaled),
//! * sliding-window layers: all but every `sliding_window_pattern`-th layer (default 6) see only
//!   the last `attention.sliding_window` positions and use RoPE base `rope.freq_base_swa`
//!   (default 10 000) without scaling; the others see everything with `rope.freq_base` (1e6) and
//!   the model's RoPE scaling,
//! * NeoX RoPE, and q·k scaled by `1 / sqrt(head_dim)` (`1 / sqrt(n_embd / n_heads)` for the 62-layer
//!   27B, as llama.cpp does), unless `attention.scale` says otherwise.
//!
//! Gemma's RMSNorm multiplies by `1 + w`; llama.cpp's converter stores `1 + w` in the GGUF, so the
//! norms here are plain RMSNorms (the safetensors loader in `hf.rs` adds the one itself).

use super::decoder::{self, DecoderOptions, GatedActivation, LayerAttention};
use crate::config::RopeConfig;
use crate::{FusionOptions, Graph, ModelConfig, ModelError, WeightSet};
use ferrite_gguf::{GgufFile, Value};

/// Which layers use the sliding window: llama.cpp's `sliding_window_pattern` key is either a
/// period `n` (layer `l` slides unless `l % n == n - 1`; 0: every layer slides) or one flag per layer.
fn sliding_layers(file: &GgufFile, key: &str, n_layers: usize) -> Result<Vec<bool>, ModelError> {
    let bad = |what: String| ModelError::Config(format!("`{key}`: {what}"));
    let flag = |v: &Value| v.as_bool().or(match v.as_u64() { Some(0) => Some(false), Some(1) => Some(true), _ => None });
    match file.metadata.get(key) {
        None => Ok(period_pattern(6, n_layers)),
        Some(Value::Array(items)) => {
            if items.len() != n_layers {
                return Err(bad(format!("{} entries for {n_layers} layers", items.len())));
            }
            items
                .iter()
                .map(|v| flag(v).ok_or_else(|| bad(format!("per-layer entries must be booleans, found {v:?}"))))
                .collect()
        }
        Some(v) => match v.as_u64() {
            Some(n) => Ok(period_pattern(n as usize, n_layers)),
            None => Err(bad(format!("expected a layer period or per-layer flags, found {v:?}"))),
        },
    }
}

fn period_pattern(n: usize, n_layers: usize) -> Vec<bool> {
    (0..n_layers).map(|l| n == 0 || l % n < n - 1).collect()
}

/// The per-layer attention settings and scales of a Gemma 3 file.
pub fn options(cfg: &ModelConfig, file: &GgufFile) -> Result<DecoderOptions, ModelError> {
    let m = &file.metadata;
    let key = |k: &str| format!("gemma3.{k}");
    for cap in ["final_logit_softcapping", "attn_logit_softcapping"] {
        if m.get(&key(cap)).is_some() {
            return Err(ModelError::Config(format!("`{}` is set: logit soft-capping is not supported for gemma3", key(cap))));
        }
    }
    let window = match m.get(&key("attention.sliding_window")) {
        Some(_) => match m.u64(&key("attention.sliding_window"))? {
            0 => None,
            w => Some(usize::try_from(w).map_err(|_| ModelError::Config(format!("sliding window {w} is too large")))?),
        },
        None => None,
    };
    let sliding = match window {
        Some(_) => sliding_layers(file, &key("attention.sliding_window_pattern"), cfg.n_layers)?,
        None => vec![false; cfg.n_layers],
    };
    let local_theta = m.f32_or(&key("rope.freq_base_swa"), 10_000.0)?;
    if !(local_theta > 0.0 && local_theta.is_finite()) {
        return Err(ModelError::Config(format!("rope.freq_base_swa {local_theta} is not a positive number")));
    }
    let local_rope = RopeConfig { theta: local_theta, freq_scale: 1.0, ..cfg.rope };
    let layers = sliding
        .iter()
        .map(|&s| if s { LayerAttention { window, rope: local_rope } } else { LayerAttention { window: None, rope: cfg.rope } })
        .collect();
    let attention_scale = match m.get(&key("attention.scale")) {
        Some(_) => m.f32(&key("attention.scale"))?,
        None if cfg.n_layers == 62 => 1.0 / ((cfg.n_embd / cfg.n_heads) as f32).sqrt(),
        None => 1.0 / (cfg.head_dim as f32).sqrt(),
    };
    if !(attention_scale > 0.0 && attention_scale.is_finite()) {
        return Err(ModelError::Config(format!("attention scale {attention_scale} is not a positive number")));
    }
    Ok(DecoderOptions {
        qk_norm: true,
        post_norms: true,
        activation: GatedActivation::GeluTanh,
        embed_scale: (cfg.n_embd as f32).sqrt(),
        attention_scale,
        layers,
    })
}

pub fn build(cfg: &ModelConfig, file: &GgufFile, fusion: FusionOptions) -> Result<(WeightSet, Graph), ModelError> {
    decoder::build(cfg, file, fusion, options(cfg, file)?)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_sixth_layer_is_global_by_default() {
        let p = period_pattern(6, 13);
        let global: Vec<usize> = (0..13).filter(|&l| !p[l]).collect();
        assert_eq!(global, vec![5, 11]);
        assert!(period_pattern(0, 3).iter().all(|&s| s));
        assert!(period_pattern(1, 3).iter().all(|&s| !s));
    }
}
