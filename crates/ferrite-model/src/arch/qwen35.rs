//! Qwen3.5 (dense FFN, llama.cpp arch `qwen35`): a hybrid of Gated DeltaNet layers (linear
//! attention with a recurrent state) and gated full-attention layers; layer `l` is full attention
//! iff `(l + 1) % full_attention_interval == 0` (default 4: three GDN layers, then one attention).
//! Every layer is pre-norm with the SwiGLU MLP of the shared decoder (`post_attention_norm` is
//! the pre-MLP norm).
//!
//! * Gated DeltaNet (see [`Op::GatedDeltaNet`]): `attn_qkv` (q | k | v), `attn_gate` (z),
//!   `ssm_beta` (b), `ssm_alpha` (a) project the normed input into one value (a single fused,
//!   norm-folded linear when fusions are on), then the op (conv1d `ssm_conv1d`, `ssm_a` =
//!   `-exp(A_log)`, `ssm_dt.bias`, gated norm `ssm_norm`), then `ssm_out` and the residual.
//! * Gated attention: `attn_q` yields per head `[query | gate]`; the queries join `attn_k` /
//!   `attn_v` in a QKV value, get QK-norm and partial NeoX RoPE (`rope.dimension_count` of the
//!   head dimensions), attention, then `out * sigmoid(gate)` before `attn_output`.
//!
//! llama.cpp's converter stores `1 + w` for the zero-centred norms (all but `ssm_norm`) and the
//! GDN value heads in tiled order, so every norm here is a plain RMSNorm and value head `h` uses
//! key head `h % n_k_heads`. Text positions only: Qwen3.5's interleaved MRoPE reduces to 1-D
//! RoPE when the three position components are equal, which they are for text.
//!
//! Qwen3.5-MoE (llama.cpp arch `qwen35moe`) is the same hybrid with a mixture-of-experts FFN in
//! every layer instead of the dense MLP (see [`Op::MoeFfn`]): router `ffn_gate_inp`, routed
//! experts `ffn_gate_exps` / `ffn_up_exps` (or the fused `ffn_gate_up_exps`) / `ffn_down_exps`
//! (3-D), and the shared expert `ffn_{gate,up,down}_shexp` gated by `ffn_gate_inp_shexp`.
//!
//! Qwen3-Next (`qwen3next.rs`) is built by the same [`build_hybrid`] with its own GDN input
//! projections and value-head order.

use super::decoder::{self, DecoderOptions, ProjectionGroup};
use crate::config::MoeConfig;
use crate::graph::{AttentionShape, ExpertGateUp, GdnShape, GraphBuilder, MoeShape, NormSpec, Op, Rows, SharedExpert, ValueHeadOrder, ValueId, WeightId};
use crate::{FusionOptions, Graph, ModelConfig, ModelError, WeightSet};
use ferrite_gguf::GgufFile;

/// The per-layer schedule and GDN shape (value heads in `v_order`) from `<arch>.*` metadata.
pub fn hybrid_layout(cfg: &ModelConfig, file: &GgufFile, v_order: ValueHeadOrder) -> Result<(Vec<bool>, GdnShape), ModelError> {
    let m = &file.metadata;
    let a = cfg.arch.name();
    let key = |k: &str| format!("{a}.{k}");
    let get = |k: &str| -> Result<usize, ModelError> {
        let v = m.u64(&key(k)).map_err(|_| ModelError::Config(format!("{a}: `{}` is missing or not an integer", key(k))))?;
        usize::try_from(v).map_err(|_| ModelError::Config(format!("{a}: `{}` = {v} is too large", key(k))))
    };
    let interval = m.u64_or(&key("full_attention_interval"), 4)? as usize;
    if interval == 0 {
        return Err(ModelError::Config(format!("{a}: `full_attention_interval` must be positive")));
    }
    let full: Vec<bool> = (0..cfg.n_layers).map(|l| (l + 1) % interval == 0).collect();
    let (n_k_heads, n_v_heads, k_dim, inner, conv_kernel) =
        (get("ssm.group_count")?, get("ssm.time_step_rank")?, get("ssm.state_size")?, get("ssm.inner_size")?, get("ssm.conv_kernel")?);
    if n_k_heads == 0 || n_v_heads == 0 || n_v_heads % n_k_heads != 0 {
        return Err(ModelError::Config(format!(
            "{a}: {n_v_heads} value heads (ssm.time_step_rank) must be a non-zero multiple of {n_k_heads} key heads (ssm.group_count)"
        )));
    }
    if inner == 0 || inner % n_v_heads != 0 {
        return Err(ModelError::Config(format!("{a}: ssm.inner_size {inner} is not a multiple of {n_v_heads} value heads")));
    }
    if k_dim == 0 || conv_kernel == 0 || conv_kernel > 16 {
        return Err(ModelError::Config(format!("{a}: unsupported ssm.state_size {k_dim} / ssm.conv_kernel {conv_kernel}")));
    }
    Ok((full, GdnShape { n_k_heads, n_v_heads, k_dim, v_dim: inner / n_v_heads, conv_kernel, v_order }))
}

/// The input projections of a Gated DeltaNet layer, in the order the op reads them:
/// `q | k | v` (`conv_width` rows), `z` (`value_width`), `b` and `a` (`n_v_heads` each).
pub(super) type GdnInputs = [WeightId; 4];

pub fn build(cfg: &ModelConfig, file: &GgufFile, fusion: FusionOptions) -> Result<(WeightSet, Graph), ModelError> {
    // llama.cpp's qwen35 converter stores the value heads tiled.
    build_hybrid(cfg, file, fusion, ValueHeadOrder::Tiled, |ws, l, s| {
        let t = |n: &str| format!("blk.{l}.{n}.weight");
        let d = cfg.n_embd;
        Ok([
            ws.add(file, &t("attn_qkv"), s.conv_width(), d)?,
            ws.add(file, &t("attn_gate"), s.value_width(), d)?,
            ws.add(file, &t("ssm_beta"), s.n_v_heads, d)?,
            ws.add(file, &t("ssm_alpha"), s.n_v_heads, d)?,
        ])
    })
}

/// The Qwen3.5-style hybrid: GDN layers whose input projections `gdn_inputs(ws, layer, shape)`
/// declares (value heads in `v_order`), gated attention every `full_attention_interval` layers,
/// the dense MLP or (with `cfg.moe`) the MoE FFN in every layer.
pub(super) fn build_hybrid(
    cfg: &ModelConfig,
    file: &GgufFile,
    fusion: FusionOptions,
    v_order: ValueHeadOrder,
    gdn_inputs: impl Fn(&mut WeightSet, usize, &GdnShape) -> Result<GdnInputs, ModelError>,
) -> Result<(WeightSet, Graph), ModelError> {
    let (full, shape) = hybrid_layout(cfg, file, v_order)?;
    let opts = DecoderOptions::llama(cfg);
    let mut ws = WeightSet::default();
    let mut g = GraphBuilder::new();
    let (d, qw, kvw, hd) = (cfg.n_embd, cfg.q_width(), cfg.kv_width(), cfg.head_dim);
    let eps = cfg.norm_eps;

    let embd = ws.add(file, "token_embd.weight", cfg.vocab_size, d)?;
    let mut h = g.value("embd", d, Rows::Tokens);
    g.push(Op::Embed { table: embd, out: h, scale: 1.0 });

    for (l, &is_full) in full.iter().enumerate() {
        let t = |s: &str| format!("blk.{l}.{s}");
        let attn_norm = NormSpec { weight: ws.add(file, &t("attn_norm.weight"), 1, d)?, eps };
        let (mixed, wo) = if is_full {
            // Every projection reads the normed input: the norm runs once, as its own op.
            let xn = g.value(t("attn_norm"), d, Rows::Tokens);
            g.push(Op::RmsNorm { x: h, norm: attn_norm, residual: None, out: xn });
            let wq = ws.add(file, &t("attn_q.weight"), 2 * qw, d)?;
            let qg = g.value(t("q_gate"), 2 * qw, Rows::Tokens);
            g.push(Op::Linear { x: xn, norm: None, w: wq, bias: None, residual: None, out: qg, out_col: 0 });
            let qkv = g.value(t("qkv"), cfg.qkv_width(), Rows::Tokens);
            g.push(Op::SplitGatedQuery { x: qg, n_heads: cfg.n_heads, head_dim: hd, out: qkv });
            let wk = ws.add(file, &t("attn_k.weight"), kvw, d)?;
            let wv = ws.add(file, &t("attn_v.weight"), kvw, d)?;
            let kv = if fusion.qkv { ws.fuse(&[wk, wv]).map(|w| vec![w]) } else { None }.unwrap_or(vec![wk, wv]);
            let mut col = qw;
            for w in kv {
                g.push(Op::Linear { x: xn, norm: None, w, bias: None, residual: None, out: qkv, out_col: col });
                col += ws.spec(w).rows;
            }
            let qk_norm = Some(decoder::qk_norm(&mut ws, file, cfg, l, eps)?);
            let attn = g.value(t("attn"), qw, Rows::Tokens);
            let attention = Op::Attention { layer: l, qkv, out: attn, window: None, rope: Some(cfg.rope), qk_norm };
            decoder::rope_attention(&mut g, fusion, cfg, attention);
            let gated = g.value(t("attn_gated"), qw, Rows::Tokens);
            g.push(Op::SigmoidGate { x: attn, gate: qg, n_heads: cfg.n_heads, head_dim: hd, out: gated });
            (gated, ws.add(file, &t("attn_output.weight"), d, qw)?)
        } else {
            let s = shape;
            let vw = s.value_width();
            let parts = gdn_inputs(&mut ws, l, &s)?.map(|w| (w, None));
            let proj = g.value(t("gdn_proj"), s.proj_width(), Rows::Tokens);
            let group = ProjectionGroup { x: h, norm: attn_norm, parts: &parts, out: proj, normed_name: &t("attn_norm") };
            decoder::projection_group(&mut g, &mut ws, group, fusion.qkv, fusion.norm_into_linear);
            let conv = ws.add(file, &t("ssm_conv1d.weight"), s.conv_width(), s.conv_kernel)?;
            let a_coef = ws.add(file, &t("ssm_a"), 1, s.n_v_heads)?;
            let dt_bias = ws.add_first_of(file, &[&t("ssm_dt.bias"), &t("ssm_dt")], 1, s.n_v_heads)?;
            let norm = NormSpec { weight: ws.add(file, &t("ssm_norm.weight"), 1, s.v_dim)?, eps };
            let out = g.value(t("gdn"), vw, Rows::Tokens);
            g.push(Op::GatedDeltaNet { layer: l, x: proj, out, conv, a_coef, dt_bias, norm, shape: s });
            (out, ws.add(file, &t("ssm_out.weight"), d, vw)?)
        };
        let width = g.width(mixed);
        debug_assert_eq!(ws.spec(wo).cols, width);
        h = decoder::residual_linear(&mut g, mixed, wo, h, fusion.residual_into_linear, &t("attn_out"), d);
        h = match cfg.moe {
            Some(moe) => moe_block(&mut g, &mut ws, file, cfg, fusion, moe, l, h)?,
            None => decoder::mlp_block(&mut g, &mut ws, file, cfg, fusion, &opts, l, "post_attention_norm", h)?,
        };
    }
    let logits = decoder::output_head(&mut g, &mut ws, file, cfg, fusion, embd, h)?;
    let attention = AttentionShape { n_heads: cfg.n_heads, n_kv_heads: cfg.n_kv_heads, head_dim: hd, scale: opts.attention_scale };
    Ok((ws, g.finish(logits, cfg.n_layers, attention)))
}

/// The MoE FFN of layer `l` with its residual: `h + moe(norm(h))`, the norm
/// (`post_attention_norm`) and the residual add folded into the op under the
/// `norm_into_linear` / `residual_into_linear` fusions.
#[allow(clippy::too_many_arguments)]
fn moe_block(
    g: &mut GraphBuilder,
    ws: &mut WeightSet,
    file: &GgufFile,
    cfg: &ModelConfig,
    fusion: FusionOptions,
    moe: MoeConfig,
    l: usize,
    h: ValueId,
) -> Result<ValueId, ModelError> {
    let d = cfg.n_embd;
    let (e, ff, ffs) = (moe.n_experts, moe.n_ff_exp, moe.n_ff_shexp);
    let t = |s: &str| format!("blk.{l}.{s}");
    let norm = NormSpec { weight: ws.add(file, &t("post_attention_norm.weight"), 1, d)?, eps: cfg.norm_eps };
    let router = ws.add(file, &t("ffn_gate_inp.weight"), e, d)?;
    let gate_up = match file.tensor(&t("ffn_gate_up_exps.weight")) {
        Some(_) => ExpertGateUp::Fused(ws.add_experts(file, &t("ffn_gate_up_exps.weight"), e, 2 * ff, d)?),
        None => ExpertGateUp::Split {
            gate: ws.add_experts(file, &t("ffn_gate_exps.weight"), e, ff, d)?,
            up: ws.add_experts(file, &t("ffn_up_exps.weight"), e, ff, d)?,
        },
    };
    let down = ws.add_experts(file, &t("ffn_down_exps.weight"), e, d, ff)?;
    // Every Qwen3.5-MoE layer has the gated shared expert (llama.cpp requires it too).
    let shared = SharedExpert {
        gate: ws.add(file, &t("ffn_gate_shexp.weight"), ffs, d)?,
        up: ws.add(file, &t("ffn_up_shexp.weight"), ffs, d)?,
        down: ws.add(file, &t("ffn_down_shexp.weight"), d, ffs)?,
        gate_inp: ws.add(file, &t("ffn_gate_inp_shexp.weight"), 1, d)?,
    };
    let shape = MoeShape { n_experts: e, top_k: moe.n_experts_used, n_ff_exp: ff, norm_topk_prob: moe.norm_topk_prob };
    let (x, norm) = if fusion.norm_into_linear {
        (h, Some(norm))
    } else {
        let xn = g.value(t("post_attention_norm"), d, Rows::Tokens);
        g.push(Op::RmsNorm { x: h, norm, residual: None, out: xn });
        (xn, None)
    };
    let out = g.value(t("out"), d, Rows::Tokens);
    let op = |residual, out| Op::MoeFfn { x, norm, router, gate_up, down, shared: Some(shared), moe: shape, residual, out };
    if fusion.residual_into_linear {
        g.push(op(Some(h), out));
    } else {
        let y = g.value(t("moe"), d, Rows::Tokens);
        g.push(op(None, y));
        g.push(Op::Add { a: h, b: y, out });
    }
    g.trace(out);
    Ok(out)
}
