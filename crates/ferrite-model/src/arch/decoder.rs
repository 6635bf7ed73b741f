//! The dense pre-norm decoder shared by the Llama-like architectures (see `llama.rs`,
//! `qwen3.rs`, `gemma3.rs`): per layer h += post_norm?(Wo · attn(rope(qk_norm?(Wqkv · norm(h) + bias?))))
//! and h += post_norm?(Wdown · act(Wgate · norm(h)) * (Wup · norm(h))). Each architecture file says
//! which options it uses.

use crate::config::RopeConfig;
pub use crate::graph::GatedActivation;
use crate::graph::{AttentionShape, GraphBuilder, NormSpec, Op, QkNorm, Rows, ValueId, WeightId};
use crate::{FusionOptions, Graph, ModelConfig, ModelError, WeightSet};
use ferrite_gguf::GgufFile;

/// Projections (weight, optional bias) that read `norm(x)` and fill column ranges of `out`.
pub(super) struct ProjectionGroup<'a> {
    pub x: ValueId,
    pub norm: NormSpec,
    pub parts: &'a [(WeightId, Option<WeightId>)],
    pub out: ValueId,
    /// Name of the normalised input when the norm runs as its own op.
    pub normed_name: &'a str,
}

/// Emit a projection group: fused into a single linear when `fuse` and the weights allow, and
/// the norm folded into that linear only if `fold_norm` and the group is a single linear.
pub(super) fn projection_group(g: &mut GraphBuilder, ws: &mut WeightSet, group: ProjectionGroup, fuse: bool, fold_norm: bool) {
    let ProjectionGroup { x, norm, parts, out, normed_name } = group;
    let weights: Vec<WeightId> = parts.iter().map(|p| p.0).collect();
    let biases: Option<Vec<WeightId>> = parts.iter().map(|p| p.1).collect();
    let fused = if fuse && parts.len() > 1 {
        ws.fuse(&weights).and_then(|w| match &biases {
            Some(b) => ws.fuse(b).map(|b| (w, Some(b))),
            None if parts.iter().all(|p| p.1.is_none()) => Some((w, None)),
            None => None,
        })
    } else {
        None
    };
    let single = fused.or(if parts.len() == 1 { Some(parts[0]) } else { None });
    match single {
        Some((w, bias)) if fold_norm => {
            g.push(Op::Linear { x, norm: Some(norm), w, bias, residual: None, out, out_col: 0 });
        }
        _ => {
            let xn = g.value(normed_name, g.width(x), Rows::Tokens);
            g.push(Op::RmsNorm { x, norm, residual: None, out: xn });
            let list: Vec<(WeightId, Option<WeightId>)> = match single {
                Some(p) => vec![p],
                None => parts.to_vec(),
            };
            let mut col = 0;
            for (w, bias) in list {
                g.push(Op::Linear { x: xn, norm: None, w, bias, residual: None, out, out_col: col });
                col += ws.spec(w).rows;
            }
        }
    }
}

/// Push an `Attention` op carrying its layer's QK-norm and RoPE: kept inside the op under the
/// `head_norm_into_attention` and `rope_into_attention` fusions, else separate in-place ops go
/// first: `HeadNorm` on the Q heads and on the K heads, then one `Rope` on the adjacent Q and K
/// heads (they rotate alike). The norm comes before the rotation, so it stays inside the op only
/// with the rotation.
pub(super) fn rope_attention(g: &mut GraphBuilder, fusion: FusionOptions, cfg: &ModelConfig, attention: Op) {
    let Op::Attention { layer, qkv, out, window, mut rope, mut qk_norm } = attention else {
        unreachable!("rope_attention pushes attention ops")
    };
    if let Some(QkNorm { q, k }) = qk_norm.filter(|_| !(fusion.head_norm_into_attention && fusion.rope_into_attention)) {
        g.push(Op::HeadNorm { x: qkv, col: 0, n_heads: cfg.n_heads, norm: q });
        g.push(Op::HeadNorm { x: qkv, col: cfg.q_width(), n_heads: cfg.n_kv_heads, norm: k });
        qk_norm = None;
    }
    if let Some(r) = rope.filter(|_| !fusion.rope_into_attention) {
        g.push(Op::Rope { x: qkv, col: 0, n_heads: cfg.n_heads + cfg.n_kv_heads, rope: r });
        rope = None;
    }
    g.push(Op::Attention { layer, qkv, out, window, rope, qk_norm });
}

/// The QK-norm weights of layer `l` (`blk.{l}.attn_q_norm.weight`, `attn_k_norm`), `head_dim` wide.
pub(super) fn qk_norm(ws: &mut WeightSet, file: &GgufFile, cfg: &ModelConfig, l: usize, eps: f32) -> Result<QkNorm, ModelError> {
    let mut norm = |name: &str| Ok::<_, ModelError>(NormSpec { weight: ws.add(file, &format!("blk.{l}.{name}.weight"), 1, cfg.head_dim)?, eps });
    Ok(QkNorm { q: norm("attn_q_norm")?, k: norm("attn_k_norm")? })
}

/// `out = residual + W · x`, fused into the linear's epilogue or as a separate add.
pub(super) fn residual_linear(g: &mut GraphBuilder, x: ValueId, w: WeightId, residual: ValueId, fuse: bool, name: &str, width: usize) -> ValueId {
    let out = g.value(name, width, Rows::Tokens);
    if fuse {
        g.push(Op::Linear { x, norm: None, w, bias: None, residual: Some(residual), out, out_col: 0 });
    } else {
        let proj = g.value(format!("{name}.proj"), width, Rows::Tokens);
        g.push(Op::Linear { x, norm: None, w, bias: None, residual: None, out: proj, out_col: 0 });
        g.push(Op::Add { a: residual, b: proj, out });
    }
    out
}

/// `out = residual + post_norm(W · x)`: Gemma's norm on a block's output before the residual
/// add. The norm sits between the linear and the add, so the add cannot be folded into the
/// linear; the `residual_into_linear` fusion folds it into the norm instead.
struct PostNormResidual<'a> {
    x: ValueId,
    w: WeightId,
    norm: NormSpec,
    residual: ValueId,
    name: &'a str,
    width: usize,
}

fn post_norm_residual(g: &mut GraphBuilder, p: PostNormResidual, fuse: bool) -> ValueId {
    let proj = g.value(format!("{}.proj", p.name), p.width, Rows::Tokens);
    g.push(Op::Linear { x: p.x, norm: None, w: p.w, bias: None, residual: None, out: proj, out_col: 0 });
    let out = g.value(p.name, p.width, Rows::Tokens);
    if fuse {
        g.push(Op::RmsNorm { x: proj, norm: p.norm, residual: Some(p.residual), out });
    } else {
        let normed = g.value(format!("{}.post_norm", p.name), p.width, Rows::Tokens);
        g.push(Op::RmsNorm { x: proj, norm: p.norm, residual: None, out: normed });
        g.push(Op::Add { a: p.residual, b: normed, out });
    }
    out
}

/// The attention of one layer: its window (`None`: every earlier position) and its RoPE.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LayerAttention {
    pub window: Option<usize>,
    pub rope: RopeConfig,
}

/// What distinguishes the architectures built by [`build`].
#[derive(Clone, Debug, PartialEq)]
pub struct DecoderOptions {
    /// Per-head RMSNorm of Q and K before RoPE (`attn_q_norm` / `attn_k_norm`, `head_dim` wide).
    pub qk_norm: bool,
    /// RMSNorms of the attention and MLP outputs before their residual adds
    /// (`post_attention_norm`, `post_ffw_norm`: Gemma 2/3).
    pub post_norms: bool,
    pub activation: GatedActivation,
    /// Multiplies the token embeddings (Gemma: `sqrt(n_embd)`).
    pub embed_scale: f32,
    /// Multiplies q·k (usually `1 / sqrt(head_dim)`).
    pub attention_scale: f32,
    /// Window and RoPE of each layer (`n_layers` entries).
    pub layers: Vec<LayerAttention>,
}

impl DecoderOptions {
    /// The Llama layout: SwiGLU, no QK-norm or post-norms, every layer attends to the whole
    /// context with the model's RoPE.
    pub fn llama(cfg: &ModelConfig) -> Self {
        Self {
            qk_norm: false,
            post_norms: false,
            activation: GatedActivation::Silu,
            embed_scale: 1.0,
            attention_scale: 1.0 / (cfg.head_dim as f32).sqrt(),
            layers: vec![LayerAttention { window: None, rope: cfg.rope }; cfg.n_layers],
        }
    }
}

/// The gated MLP of layer `l` with its residual: `h + post_norm?(Wdown · act(Wgate · n(h)) * (Wup · n(h)))`
/// where `n` is the RMSNorm `blk.{l}.{norm_name}` (`ffn_norm`; Qwen3.5 calls it `post_attention_norm`).
#[allow(clippy::too_many_arguments)]
pub(super) fn mlp_block(
    g: &mut GraphBuilder,
    ws: &mut WeightSet,
    file: &GgufFile,
    cfg: &ModelConfig,
    fusion: FusionOptions,
    opts: &DecoderOptions,
    l: usize,
    norm_name: &str,
    h: ValueId,
) -> Result<ValueId, ModelError> {
    let (d, ff) = (cfg.n_embd, cfg.n_ff);
    let t = |s: &str| format!("blk.{l}.{s}");
    let ffn_norm = NormSpec { weight: ws.add(file, &t(&format!("{norm_name}.weight")), 1, d)?, eps: cfg.norm_eps };
    let gate = ws.add(file, &t("ffn_gate.weight"), ff, d)?;
    let up = ws.add(file, &t("ffn_up.weight"), ff, d)?;
    let act = g.value(t("ffn_act"), ff, Rows::Tokens);
    // With gate/up fused into one weight, the activation can be that linear's epilogue.
    let gated = if fusion.gate_up && fusion.glu_into_linear { ws.fuse(&[gate, up]) } else { None };
    if let Some(w) = gated {
        let (x, norm) = if fusion.norm_into_linear {
            (h, Some(ffn_norm))
        } else {
            let xn = g.value(t(norm_name), d, Rows::Tokens);
            g.push(Op::RmsNorm { x: h, norm: ffn_norm, residual: None, out: xn });
            (xn, None)
        };
        g.push(Op::GatedLinear { x, norm, w, act: opts.activation, out: act });
    } else {
        let gate_up = g.value(t("gate_up"), 2 * ff, Rows::Tokens);
        let group = ProjectionGroup { x: h, norm: ffn_norm, parts: &[(gate, None), (up, None)], out: gate_up, normed_name: &t(norm_name) };
        projection_group(g, ws, group, fusion.gate_up, fusion.norm_into_linear);
        g.push(match opts.activation {
            GatedActivation::Silu => Op::SwiGlu { x: gate_up, out: act },
            GatedActivation::GeluTanh => Op::GeGlu { x: gate_up, out: act },
        });
    }
    let down = ws.add(file, &t("ffn_down.weight"), d, ff)?;
    let h = if opts.post_norms {
        let norm = NormSpec { weight: ws.add(file, &t("post_ffw_norm.weight"), 1, d)?, eps: cfg.norm_eps };
        post_norm_residual(g, PostNormResidual { x: act, w: down, norm, residual: h, name: &t("out"), width: d }, fusion.residual_into_linear)
    } else {
        residual_linear(g, act, down, h, fusion.residual_into_linear, &t("out"), d)
    };
    g.trace(h);
    Ok(h)
}

/// Final norm and output head on the last token (`output.weight`, or the tied embedding table).
pub(super) fn output_head(
    g: &mut GraphBuilder,
    ws: &mut WeightSet,
    file: &GgufFile,
    cfg: &ModelConfig,
    fusion: FusionOptions,
    embd: WeightId,
    h: ValueId,
) -> Result<ValueId, ModelError> {
    let d = cfg.n_embd;
    let last = g.value("last", d, Rows::Last);
    g.push(Op::LastRow { x: h, out: last });
    let out_norm = NormSpec { weight: ws.add(file, "output_norm.weight", 1, d)?, eps: cfg.norm_eps };
    // Tied embeddings: no output.weight, the embedding table doubles as the output head.
    let head = match file.tensor("output.weight") {
        Some(_) => ws.add(file, "output.weight", cfg.vocab_size, d)?,
        None => embd,
    };
    let logits = g.value("logits", cfg.vocab_size, Rows::Last);
    if fusion.norm_into_linear {
        g.push(Op::Linear { x: last, norm: Some(out_norm), w: head, bias: None, residual: None, out: logits, out_col: 0 });
    } else {
        let normed = g.value("output_norm", d, Rows::Last);
        g.push(Op::RmsNorm { x: last, norm: out_norm, residual: None, out: normed });
        g.push(Op::Linear { x: normed, norm: None, w: head, bias: None, residual: None, out: logits, out_col: 0 });
    }
    g.trace(logits);
    Ok(logits)
}

pub fn build(cfg: &ModelConfig, file: &GgufFile, fusion: FusionOptions, opts: DecoderOptions) -> Result<(WeightSet, Graph), ModelError> {
    if opts.layers.len() != cfg.n_layers {
        return Err(ModelError::Config(format!("{} layer attention settings for {} layers", opts.layers.len(), cfg.n_layers)));
    }
    let mut ws = WeightSet::default();
    let mut g = GraphBuilder::new();
    let (d, qw, kvw) = (cfg.n_embd, cfg.q_width(), cfg.kv_width());

    let embd = ws.add(file, "token_embd.weight", cfg.vocab_size, d)?;
    let mut h = g.value("embd", d, Rows::Tokens);
    g.push(Op::Embed { table: embd, out: h, scale: opts.embed_scale });

    for l in 0..cfg.n_layers {
        let t = |s: &str| format!("blk.{l}.{s}");
        let attn_norm = NormSpec { weight: ws.add(file, &t("attn_norm.weight"), 1, d)?, eps: cfg.norm_eps };
        let mut qkv_parts = Vec::new();
        for (name, rows) in [("attn_q", qw), ("attn_k", kvw), ("attn_v", kvw)] {
            let w = ws.add(file, &t(&format!("{name}.weight")), rows, d)?;
            let b = ws.add_optional(file, &t(&format!("{name}.bias")), 1, rows)?;
            qkv_parts.push((w, b));
        }
        let qkv = g.value(t("qkv"), cfg.qkv_width(), Rows::Tokens);
        let fold = fusion.norm_into_linear;
        let group = ProjectionGroup { x: h, norm: attn_norm, parts: &qkv_parts, out: qkv, normed_name: &t("attn_norm") };
        projection_group(&mut g, &mut ws, group, fusion.qkv, fold);
        let qk_norm = if opts.qk_norm { Some(qk_norm(&mut ws, file, cfg, l, cfg.norm_eps)?) } else { None };
        let LayerAttention { window, rope } = opts.layers[l];
        let attn = g.value(t("attn"), qw, Rows::Tokens);
        rope_attention(&mut g, fusion, cfg, Op::Attention { layer: l, qkv, out: attn, window, rope: Some(rope), qk_norm });
        let wo = ws.add(file, &t("attn_output.weight"), d, qw)?;
        h = if opts.post_norms {
            let norm = NormSpec { weight: ws.add(file, &t("post_attention_norm.weight"), 1, d)?, eps: cfg.norm_eps };
            post_norm_residual(&mut g, PostNormResidual { x: attn, w: wo, norm, residual: h, name: &t("attn_out"), width: d }, fusion.residual_into_linear)
        } else {
            residual_linear(&mut g, attn, wo, h, fusion.residual_into_linear, &t("attn_out"), d)
        };

        h = mlp_block(&mut g, &mut ws, file, cfg, fusion, &opts, l, "ffn_norm", h)?;
    }

    let logits = output_head(&mut g, &mut ws, file, cfg, fusion, embd, h)?;

    let attention = AttentionShape {
        n_heads: cfg.n_heads,
        n_kv_heads: cfg.n_kv_heads,
        head_dim: cfg.head_dim,
        scale: opts.attention_scale,
    };
    Ok((ws, g.finish(logits, cfg.n_layers, attention)))
}
