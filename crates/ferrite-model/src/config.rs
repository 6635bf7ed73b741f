//! Hyper-parameters read from GGUF metadata (`<arch>.*` keys).

use crate::ModelError;
use ferrite_gguf::{GgufFile, Metadata};

/// Model architectures ferrite can build a graph for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Arch {
    /// Llama 1/2/3, SmolLM, Mistral-style dense decoders.
    Llama,
    /// Qwen2 / Qwen2.5: Llama layout plus q/k/v biases, NeoX RoPE.
    Qwen2,
    /// Qwen3 (dense): Llama layout plus per-head RMSNorm of Q and K (QK-norm), NeoX RoPE.
    Qwen3,
    /// Gemma 3 (text): QK-norm, GeGLU, norms before and after attention and MLP, scaled
    /// embeddings, sliding-window layers with their own RoPE base, NeoX RoPE.
    Gemma3,
    /// Qwen3.5 (dense FFN): hybrid of Gated DeltaNet (linear attention with recurrent state) and
    /// gated full attention with partial RoPE, 3:1 by default.
    Qwen35,
    /// Qwen3.5-MoE: the Qwen3.5 hybrid with a mixture-of-experts FFN (routed experts plus a
    /// gated shared expert) in every layer.
    Qwen35Moe,
    /// Qwen3-Next: the Qwen3.5-MoE hybrid's predecessor, the same layers with Gated DeltaNet
    /// projections interleaved per key head (`ssm_ba`, legacy `ssm_in`) and its value heads in
    /// HF's grouped order.
    Qwen3Next,
}

impl Arch {
    pub const SUPPORTED: &'static str = "llama, qwen2, qwen3, gemma3, qwen35, qwen35moe, qwen3next";

    pub fn from_name(name: &str) -> Option<Self> {
        match name {
            "llama" => Some(Self::Llama),
            "qwen2" => Some(Self::Qwen2),
            "qwen3" => Some(Self::Qwen3),
            "gemma3" => Some(Self::Gemma3),
            "qwen35" => Some(Self::Qwen35),
            "qwen35moe" => Some(Self::Qwen35Moe),
            "qwen3next" => Some(Self::Qwen3Next),
            _ => None,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Self::Llama => "llama",
            Self::Qwen2 => "qwen2",
            Self::Qwen3 => "qwen3",
            Self::Gemma3 => "gemma3",
            Self::Qwen35 => "qwen35",
            Self::Qwen35Moe => "qwen35moe",
            Self::Qwen3Next => "qwen3next",
        }
    }
}

/// How RoPE pairs dimensions: GGML "normal" rotates adjacent pairs (x[2i], x[2i+1]) — llama GGUFs
/// store Q/K permuted for this —, "NeoX" rotates (x[i], x[i + d/2]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RopeStyle {
    Normal,
    Neox,
}

#[derive(Clone, Copy, Debug, PartialEq)]
pub struct RopeConfig {
    pub style: RopeStyle,
    /// Rotated dimensions per head (`rope.dimension_count`), at most `head_dim`.
    pub rot_dim: usize,
    pub theta: f32,
    /// Linear position scaling (1.0 = none).
    pub freq_scale: f32,
}

/// The mixture-of-experts FFN of a MoE architecture (`<arch>.expert_*` keys).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MoeConfig {
    /// `expert_count`.
    pub n_experts: usize,
    /// `expert_used_count`: experts per token.
    pub n_experts_used: usize,
    /// `expert_feed_forward_length`: hidden width of one routed expert.
    pub n_ff_exp: usize,
    /// `expert_shared_feed_forward_length`: hidden width of the shared expert.
    pub n_ff_shexp: usize,
    /// `expert_weights_norm` (default true): renormalise the top-k routing weights.
    pub norm_topk_prob: bool,
}

#[derive(Clone, Debug, PartialEq)]
pub struct ModelConfig {
    pub arch: Arch,
    pub name: String,
    pub n_layers: usize,
    pub n_embd: usize,
    pub n_heads: usize,
    pub n_kv_heads: usize,
    pub head_dim: usize,
    pub n_ff: usize,
    pub vocab_size: usize,
    /// Trained context length.
    pub context_length: usize,
    pub norm_eps: f32,
    pub rope: RopeConfig,
    /// The MoE FFN (MoE architectures only).
    pub moe: Option<MoeConfig>,
}

impl ModelConfig {
    pub fn from_gguf(file: &GgufFile) -> Result<Self, ModelError> {
        let arch_name = file.architecture()?;
        let arch = Arch::from_name(arch_name)
            .ok_or_else(|| ModelError::UnsupportedArch(arch_name.to_string(), Arch::SUPPORTED))?;
        let vocab_from_tokens = file.metadata.str_array("tokenizer.ggml.tokens").map(|t| t.len()).ok();
        Self::from_metadata(arch, &file.metadata, vocab_from_tokens)
    }

    fn from_metadata(arch: Arch, m: &Metadata, vocab_from_tokens: Option<usize>) -> Result<Self, ModelError> {
        let a = arch.name();
        let key = |k: &str| format!("{a}.{k}");
        let usize_key = |k: &str| -> Result<usize, ModelError> { Ok(m.u64(&key(k))? as usize) };
        let n_embd = usize_key("embedding_length")?;
        let n_heads = usize_key("attention.head_count")?;
        let n_kv_heads = m.u64_or(&key("attention.head_count_kv"), n_heads as u64)? as usize;
        if n_heads == 0 || n_kv_heads == 0 || n_heads % n_kv_heads != 0 {
            return Err(ModelError::Config(format!(
                "head counts {n_heads} (query) / {n_kv_heads} (kv): query heads must be a non-zero multiple of kv heads"
            )));
        }
        let head_dim = match m.get(&key("attention.key_length")) {
            Some(_) => usize_key("attention.key_length")?,
            None if n_embd % n_heads == 0 => n_embd / n_heads,
            None => return Err(ModelError::Config(format!("embedding {n_embd} not divisible by {n_heads} heads"))),
        };
        let rot_dim = m.u64_or(&key("rope.dimension_count"), head_dim as u64)? as usize;
        if rot_dim > head_dim || !rot_dim.is_multiple_of(2) {
            return Err(ModelError::Config(format!("rope dimension {rot_dim} must be even and <= head dim {head_dim}")));
        }
        let vocab_size = match m.get(&key("vocab_size")) {
            Some(_) => usize_key("vocab_size")?,
            None => vocab_from_tokens
                .ok_or_else(|| ModelError::Config("no vocab_size and no tokenizer.ggml.tokens".into()))?,
        };
        let freq_scale = match m.get(&key("rope.scaling.factor")) {
            Some(_) => {
                let f = m.f32(&key("rope.scaling.factor"))?;
                if f > 0.0 { 1.0 / f } else { 1.0 }
            }
            None => 1.0,
        };
        // Gemma's converter always writes the epsilon; its models use 1e-6.
        let default_eps = if matches!(arch, Arch::Gemma3 | Arch::Qwen35 | Arch::Qwen35Moe | Arch::Qwen3Next) { 1e-6 } else { 1e-5 };
        let moe = if matches!(arch, Arch::Qwen35Moe | Arch::Qwen3Next) { Some(Self::moe_config(a, m)?) } else { None };
        // MoE models may carry no dense FFN width: the shared expert's (or a routed expert's).
        let n_ff = match (m.get(&key("feed_forward_length")), moe) {
            (None, Some(moe)) => moe.n_ff_shexp,
            _ => usize_key("feed_forward_length")?,
        };
        let cfg = Self {
            arch,
            name: m.str("general.name").unwrap_or(a).to_string(),
            n_layers: usize_key("block_count")?,
            n_embd,
            n_heads,
            n_kv_heads,
            head_dim,
            n_ff,
            vocab_size,
            context_length: m.u64_or(&key("context_length"), 2048)? as usize,
            norm_eps: m.f32_or(&key("attention.layer_norm_rms_epsilon"), default_eps)?,
            rope: RopeConfig {
                style: match arch {
                    Arch::Llama => RopeStyle::Normal,
                    Arch::Qwen2 | Arch::Qwen3 | Arch::Gemma3 | Arch::Qwen35 | Arch::Qwen35Moe | Arch::Qwen3Next => RopeStyle::Neox,
                },
                rot_dim,
                theta: m.f32_or(&key("rope.freq_base"), 10_000.0)?,
                freq_scale,
            },
            moe,
        };
        if cfg.n_layers == 0 || cfg.n_embd == 0 || cfg.n_ff == 0 || cfg.vocab_size == 0 {
            return Err(ModelError::Config("zero-sized dimension (layers, embedding, ffn or vocab)".into()));
        }
        Ok(cfg)
    }

    /// The `<a>.expert_*` keys, as llama.cpp reads them: the expert widths default to
    /// `feed_forward_length` (divided by the used experts for a routed expert).
    fn moe_config(a: &str, m: &Metadata) -> Result<MoeConfig, ModelError> {
        let key = |k: &str| format!("{a}.{k}");
        let get = |k: &str| -> Result<usize, ModelError> {
            let v = m.u64(&key(k)).map_err(|_| ModelError::Config(format!("{a}: `{}` is missing or not an integer", key(k))))?;
            usize::try_from(v).map_err(|_| ModelError::Config(format!("{a}: `{}` = {v} is too large", key(k))))
        };
        let (n_experts, n_experts_used) = (get("expert_count")?, get("expert_used_count")?);
        if n_experts == 0 || n_experts_used == 0 || n_experts_used > n_experts {
            return Err(ModelError::Config(format!("{a}: {n_experts_used} experts used per token out of {n_experts}: need 1 ..= expert_count")));
        }
        let dense = m.get(&key("feed_forward_length")).map(|_| get("feed_forward_length")).transpose()?;
        let or_dense = |k: &str, from_dense: &dyn Fn(usize) -> usize| -> Result<usize, ModelError> {
            match (m.get(&key(k)), dense) {
                (Some(_), _) => get(k),
                (None, Some(ff)) => Ok(from_dense(ff)),
                (None, None) => Err(ModelError::Config(format!("{a}: neither `{}` nor `{}`", key(k), key("feed_forward_length")))),
            }
        };
        let n_ff_exp = or_dense("expert_feed_forward_length", &|ff| ff / n_experts_used)?;
        let n_ff_shexp = or_dense("expert_shared_feed_forward_length", &|ff| ff)?;
        if n_ff_exp == 0 || n_ff_shexp == 0 {
            return Err(ModelError::Config(format!("{a}: zero expert width ({n_ff_exp} routed, {n_ff_shexp} shared)")));
        }
        // llama.cpp's gating functions: 1 = softmax (the only one Qwen3.5-MoE and Qwen3-Next use).
        let gating = m.u64_or(&key("expert_gating_func"), 1)?;
        if gating != 1 {
            return Err(ModelError::Config(format!("{a}: expert gating function {gating} is not supported (softmax, 1, is)")));
        }
        let scale = m.f32_or(&key("expert_weights_scale"), 1.0)?;
        if scale != 1.0 && scale != 0.0 {
            return Err(ModelError::Config(format!("{a}: expert weight scale {scale} is not supported")));
        }
        let norm_topk_prob = m.bool_or(&key("expert_weights_norm"), true)?;
        Ok(MoeConfig { n_experts, n_experts_used, n_ff_exp, n_ff_shexp, norm_topk_prob })
    }

    pub fn q_width(&self) -> usize {
        self.n_heads * self.head_dim
    }

    pub fn kv_width(&self) -> usize {
        self.n_kv_heads * self.head_dim
    }

    /// Width of the fused Q|K|V activation.
    pub fn qkv_width(&self) -> usize {
        self.q_width() + 2 * self.kv_width()
    }
}
