//! The model graph: a straight-line op list over activation values.
//!
//! Values are 2-D activations `rows x width` (f32 on the reference path); `rows` is the number of
//! tokens in the batch, or 1 for values computed on the last token only. Fusion is *declared* in
//! this graph when it is built (fused weights, a norm folded into a linear, a residual add folded
//! into a linear's epilogue): backends execute what the graph says and never pattern-match.

use crate::config::RopeConfig;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ValueId(pub u32);

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct WeightId(pub u32);

/// How many rows a value has for a batch of `n` tokens.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Rows {
    /// One row per token in the batch.
    Tokens,
    /// One row: the last token of the batch.
    Last,
}

#[derive(Clone, Debug)]
pub struct ValueInfo {
    pub name: String,
    pub width: usize,
    pub rows: Rows,
    /// Kept for `compare`/trace output: the planner never reuses its buffer.
    pub traced: bool,
}

impl ValueInfo {
    pub fn n_rows(&self, n_tokens: usize) -> usize {
        match self.rows {
            Rows::Tokens => n_tokens,
            Rows::Last => 1,
        }
    }

    /// Rows in a batch of `n_tokens` tokens from `n_seqs` sequences (one last row per sequence).
    pub fn rows_for(&self, n_tokens: usize, n_seqs: usize) -> usize {
        match self.rows {
            Rows::Tokens => n_tokens,
            Rows::Last => n_seqs,
        }
    }
}

/// The gate activation of a gated MLP: `act(gate) * up`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GatedActivation {
    /// SwiGLU: `silu(gate) * up` (Llama, Qwen).
    Silu,
    /// GeGLU with the tanh approximation of GELU (Gemma).
    GeluTanh,
}

/// An RMSNorm folded into the prologue of the op that consumes its output.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct NormSpec {
    pub weight: WeightId,
    pub eps: f32,
}

/// The per-head RMSNorms of Q and K (Qwen3's and Gemma 3's QK-norm) applied by the attention op:
/// each `head_dim` wide, one weight shared by all heads of its kind.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct QkNorm {
    pub q: NormSpec,
    pub k: NormSpec,
}

/// Shapes of a Gated DeltaNet layer (Qwen3.5 / Qwen3-Next linear attention).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GdnShape {
    /// Key (and query) heads (`ssm.group_count`).
    pub n_k_heads: usize,
    /// Value heads (`ssm.time_step_rank`), a multiple of `n_k_heads`.
    pub n_v_heads: usize,
    /// Key head dimension (`ssm.state_size`).
    pub k_dim: usize,
    /// Value head dimension (`ssm.inner_size / n_v_heads`).
    pub v_dim: usize,
    /// Causal conv1d taps (`ssm.conv_kernel`, 4).
    pub conv_kernel: usize,
    /// Which key head each value head reads (the order of the value heads in the weights).
    pub v_order: ValueHeadOrder,
}

/// The order of a Gated DeltaNet's value heads, which decides the key (and query) head each one
/// reads when there are more value heads than key heads (`r = n_v_heads / n_k_heads`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ValueHeadOrder {
    /// `[K0v0, K1v0, .., K0v1, K1v1, ..]`: value head `h` reads key head `h % n_k_heads`.
    /// llama.cpp's Qwen3.5 GGUFs (its converter reorders HF's heads so).
    Tiled,
    /// `[K0v0 .. K0v(r-1), K1v0 ..]`: value head `h` reads key head `h / r`. HF's order, which
    /// llama.cpp's Qwen3-Next GGUFs keep.
    Grouped,
}

impl GdnShape {
    /// The key (and query) head that value head `h` reads.
    pub fn key_head(&self, h: usize) -> usize {
        match self.v_order {
            ValueHeadOrder::Tiled => h % self.n_k_heads,
            ValueHeadOrder::Grouped => h / (self.n_v_heads / self.n_k_heads),
        }
    }

    pub fn key_width(&self) -> usize {
        self.n_k_heads * self.k_dim
    }

    pub fn value_width(&self) -> usize {
        self.n_v_heads * self.v_dim
    }

    /// Channels of the causal conv: `q | k | v`.
    pub fn conv_width(&self) -> usize {
        2 * self.key_width() + self.value_width()
    }

    /// Width of the projected input the op reads: `q | k | v | z | b | a`.
    pub fn proj_width(&self) -> usize {
        self.conv_width() + self.value_width() + 2 * self.n_v_heads
    }

    /// f32 elements of the conv state (the last `conv_kernel - 1` inputs of each channel).
    pub fn conv_state_len(&self) -> usize {
        (self.conv_kernel - 1) * self.conv_width()
    }

    /// f32 elements of the delta-rule state (`n_v_heads` matrices `k_dim x v_dim`).
    pub fn ssm_state_len(&self) -> usize {
        self.n_v_heads * self.k_dim * self.v_dim
    }
}

/// The gate and up projections of a bank of experts (3-D weights, see
/// [`crate::WeightSpec::experts`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ExpertGateUp {
    /// One bank whose expert `e` is `[gate (n_ff_exp rows) | up (n_ff_exp rows)]`
    /// (llama.cpp `ffn_gate_up_exps`, HF Qwen3.5-MoE `experts.gate_up_proj`).
    Fused(WeightId),
    /// Two banks (llama.cpp `ffn_gate_exps` and `ffn_up_exps`).
    Split { gate: WeightId, up: WeightId },
}

/// The gated shared expert of a MoE FFN: `sigmoid(x · gate_inp) * down(silu(gate · x) * (up · x))`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SharedExpert {
    pub gate: WeightId,
    pub up: WeightId,
    pub down: WeightId,
    /// The `n_embd` vector whose dot product with `x` gives the expert's gate logit
    /// (`ffn_gate_inp_shexp`).
    pub gate_inp: WeightId,
}

/// Routing of a MoE FFN.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MoeShape {
    pub n_experts: usize,
    /// Experts used per token (`top_k`).
    pub top_k: usize,
    /// Hidden width of one routed expert.
    pub n_ff_exp: usize,
    /// Renormalise the top-k probabilities to sum to 1 (`norm_topk_prob`).
    pub norm_topk_prob: bool,
}

#[derive(Clone, Debug, PartialEq)]
pub enum Op {
    /// `out[t] = table[tokens[t]] * scale` (`scale` is 1 except for Gemma's `sqrt(n_embd)`).
    Embed { table: WeightId, out: ValueId, scale: f32 },
    /// `out = x / rms(x) * weight`, plus `residual` when given (Gemma's post-norm and its
    /// residual add in one op, declared by the `residual_into_linear` fusion).
    RmsNorm { x: ValueId, norm: NormSpec, residual: Option<ValueId>, out: ValueId },
    /// `out[:, out_col .. out_col + w.rows] = norm?(x) · wᵀ + bias + residual`.
    /// With `out_col > 0` several linears fill column ranges of one value (unfused QKV, gate/up).
    Linear {
        x: ValueId,
        norm: Option<NormSpec>,
        w: WeightId,
        bias: Option<WeightId>,
        residual: Option<ValueId>,
        out: ValueId,
        out_col: usize,
    },
    /// RoPE in place on `n_heads` heads of `x` starting at column `col`, at the batch positions,
    /// with this layer's frequencies (Gemma 3's sliding-window layers use another base).
    Rope { x: ValueId, col: usize, n_heads: usize, rope: RopeConfig },
    /// RMSNorm in place over each of `n_heads` heads (`head_dim` wide, one shared weight) of `x`
    /// starting at column `col`: Qwen3's QK-norm.
    HeadNorm { x: ValueId, col: usize, n_heads: usize, norm: NormSpec },
    /// Writes the K and V columns of `qkv` into layer `layer`'s cache at the batch positions, then
    /// causal GQA attention of the Q columns over the cache. `out` is `n_heads * head_dim` wide.
    /// With `rope` (declared by the `rope_into_attention` fusion) Q and K are rotated on the way
    /// into the cache and the attention; with `qk_norm` (the `head_norm_into_attention` fusion)
    /// each Q and K head is RMS-normalised first, as a `HeadNorm` op would; `qkv` itself is left
    /// as it was.
    Attention { layer: usize, qkv: ValueId, out: ValueId, window: Option<usize>, rope: Option<RopeConfig>, qk_norm: Option<QkNorm> },
    /// `out = silu(x[:, ..w]) * x[:, w..]` where `x` is `[gate | up]`, `2w` wide.
    SwiGlu { x: ValueId, out: ValueId },
    /// `out = gelu_tanh(x[:, ..w]) * x[:, w..]` where `x` is `[gate | up]`, `2w` wide (Gemma).
    GeGlu { x: ValueId, out: ValueId },
    /// The gate/up projection with its activation folded into the epilogue (declared by the
    /// `glu_into_linear` fusion): `[gate | up] = norm?(x) · wᵀ`, `out = act(gate) * up`, where
    /// `w` is the fused gate+up weight and `out` is half its rows wide.
    GatedLinear { x: ValueId, norm: Option<NormSpec>, w: WeightId, act: GatedActivation, out: ValueId },
    /// `out = a + b`.
    Add { a: ValueId, b: ValueId, out: ValueId },
    /// `out = x[last row]`.
    LastRow { x: ValueId, out: ValueId },
    /// Copies the query half of each head of a gated query projection (`x`: per head
    /// `[query (head_dim) | gate (head_dim)]`, Qwen3.5 / Qwen3-Next) into columns
    /// `0 .. n_heads * head_dim` of `out` (the Q part of a QKV value).
    SplitGatedQuery { x: ValueId, n_heads: usize, head_dim: usize, out: ValueId },
    /// `out[h*hd + j] = x[h*hd + j] * sigmoid(gate[h*2hd + hd + j])`: the output gate of gated
    /// attention, read from the gate halves of the gated query projection.
    SigmoidGate { x: ValueId, gate: ValueId, n_heads: usize, head_dim: usize, out: ValueId },
    /// One Gated DeltaNet mixer of layer `layer` on `x` = `q | k | v | z | b | a` (see [`GdnShape`]):
    /// causal depthwise conv (`conv`, `[conv_width x conv_kernel]`, last tap on the current token)
    /// and SiLU over `q | k | v`; L2-normalised q (scaled by `k_dim^-1/2`) and k; per value head
    /// `beta = sigmoid(b)`, `g = a_coef * softplus(a + dt_bias)` (`a_coef` = `ssm_a` = `-exp(A_log)`);
    /// the delta rule on the layer's recurrent state `S` (`k_dim x v_dim` per value head, f32):
    /// `S = exp(g) S; S += k (beta (v - Sᵀk))ᵀ; o = Sᵀq`; then `out = norm(o) * silu(z)` per value head
    /// (plain RMSNorm weight). Value head `h` uses key head [`GdnShape::key_head`]`(h)` (tiled or
    /// grouped order). Reads and updates the layer's conv and delta-rule state: the session state.
    GatedDeltaNet {
        layer: usize,
        x: ValueId,
        out: ValueId,
        conv: WeightId,
        a_coef: WeightId,
        dt_bias: WeightId,
        norm: NormSpec,
        shape: GdnShape,
    },
    /// A mixture-of-experts FFN (Qwen3.5-MoE, Qwen3-Next), per token of `xn = norm?(x)`: router logits
    /// `router · xn` (`[n_experts x n_embd]`), softmax over all experts in f32, the `top_k` most
    /// probable (ties: the lower expert index), renormalised to sum to 1 if `norm_topk_prob`;
    /// `out = Σ_j p_j · down_j(silu(gate_j · xn) * (up_j · xn)) + shared?(xn) + residual?`.
    MoeFfn {
        x: ValueId,
        norm: Option<NormSpec>,
        router: WeightId,
        gate_up: ExpertGateUp,
        /// `n_experts` matrices `n_embd x n_ff_exp`.
        down: WeightId,
        shared: Option<SharedExpert>,
        moe: MoeShape,
        residual: Option<ValueId>,
        out: ValueId,
    },
}

impl Op {
    /// Values this op reads.
    pub fn reads(&self) -> Vec<ValueId> {
        match *self {
            Op::Embed { .. } => vec![],
            Op::RmsNorm { x, residual, .. } => std::iter::once(x).chain(residual).collect(),
            Op::SwiGlu { x, .. }
            | Op::GeGlu { x, .. }
            | Op::LastRow { x, .. }
            | Op::Rope { x, .. }
            | Op::GatedLinear { x, .. }
            | Op::HeadNorm { x, .. }
            | Op::SplitGatedQuery { x, .. }
            | Op::GatedDeltaNet { x, .. } => vec![x],
            Op::SigmoidGate { x, gate, .. } => vec![x, gate],
            Op::Linear { x, residual, .. } | Op::MoeFfn { x, residual, .. } => std::iter::once(x).chain(residual).collect(),
            Op::Attention { qkv, .. } => vec![qkv],
            Op::Add { a, b, .. } => vec![a, b],
        }
    }

    /// The value this op writes (`Rope` and `HeadNorm` write the value they read: in place by design).
    pub fn writes(&self) -> ValueId {
        match *self {
            Op::Embed { out, .. }
            | Op::RmsNorm { out, .. }
            | Op::Linear { out, .. }
            | Op::GatedLinear { out, .. }
            | Op::Attention { out, .. }
            | Op::SwiGlu { out, .. }
            | Op::GeGlu { out, .. }
            | Op::Add { out, .. }
            | Op::LastRow { out, .. }
            | Op::SplitGatedQuery { out, .. }
            | Op::SigmoidGate { out, .. }
            | Op::GatedDeltaNet { out, .. }
            | Op::MoeFfn { out, .. } => out,
            Op::Rope { x, .. } | Op::HeadNorm { x, .. } => x,
        }
    }

    pub fn kind(&self) -> &'static str {
        match self {
            Op::Embed { .. } => "embed",
            Op::RmsNorm { residual: Some(_), .. } => "rms_norm+add",
            Op::RmsNorm { .. } => "rms_norm",
            Op::Linear { norm: Some(_), .. } => "norm+linear",
            Op::Linear { .. } => "linear",
            Op::GatedLinear { norm: Some(_), .. } => "norm+gated_linear",
            Op::GatedLinear { .. } => "gated_linear",
            Op::Rope { .. } => "rope",
            Op::HeadNorm { .. } => "head_norm",
            Op::Attention { .. } => "attention",
            Op::SwiGlu { .. } => "swiglu",
            Op::GeGlu { .. } => "geglu",
            Op::Add { .. } => "add",
            Op::LastRow { .. } => "last_row",
            Op::SplitGatedQuery { .. } => "split_gated_query",
            Op::SigmoidGate { .. } => "sigmoid_gate",
            Op::GatedDeltaNet { .. } => "gated_delta_net",
            Op::MoeFfn { norm: Some(_), .. } => "norm+moe_ffn",
            Op::MoeFfn { .. } => "moe_ffn",
        }
    }
}

/// Shapes shared by all attention ops of the model.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AttentionShape {
    pub n_heads: usize,
    pub n_kv_heads: usize,
    pub head_dim: usize,
    pub scale: f32,
}

/// An int8 hand-off, declared at load by the `int8_handoff` fusion: op `producer` writes the
/// value that the linear op `consumer` reads as input. A backend whose linears quantize their
/// input (the CUDA int8 GEMV) may have the producer also leave it quantized, with the
/// consumer's RMSNorm folded in, instead of a quantize step before the consumer. Hand-offs are
/// ordered and never overlap: each consumer comes no later than the next producer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Handoff {
    pub producer: usize,
    pub consumer: usize,
    /// `Some(op)`: the consumer reads the last row of the producer's output through this
    /// `LastRow` op (the output head after the last layer). The hand-off then holds for
    /// one-row batches only, where that op copies the whole value and a backend may skip it.
    pub last_row: Option<usize>,
}

/// A decoder layer, declared at load by the `decoder_layer` fusion: ops `first .. first + 5`
/// are the fused QKV linear (its RMSNorm folded, no bias), the attention (RoPE folded, no
/// window), the output projection (the residual folded), the gate/up linear with SwiGLU (its
/// RMSNorm folded) and the down projection (the residual folded), and the values between them
/// are read by no op outside the five. A backend may run the gate/up and down projections as
/// one launch for a one-token step (the CUDA fused MLP).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DecoderLayer {
    pub first: usize,
}

impl DecoderLayer {
    pub const LEN: usize = 5;

    pub fn ops(&self) -> std::ops::Range<usize> {
        self.first..self.first + Self::LEN
    }
}

/// The share of one rank of a tensor-parallel model (see [`crate::shard`]): its graph computes
/// its heads and MLP columns, and some of its ops leave a partial sum that all ranks must add up.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Shard {
    pub rank: usize,
    pub n_ranks: usize,
    /// Ops (increasing indices) whose output holds this rank's partial sum: the executor replaces
    /// it by the sum over all ranks (an all-reduce, in place) right after the op, before any op
    /// reads it. Every rank has the same list, so the ranks meet in the same order.
    pub all_reduce: Vec<usize>,
}

#[derive(Clone, Debug)]
pub struct Graph {
    pub values: Vec<ValueInfo>,
    pub ops: Vec<Op>,
    pub handoffs: Vec<Handoff>,
    pub layers: Vec<DecoderLayer>,
    /// The value holding the logits of the last token.
    pub logits: ValueId,
    pub n_layers: usize,
    pub attention: AttentionShape,
    /// Set on a tensor-parallel rank's graph. An executor that cannot all-reduce must refuse it.
    pub shard: Option<Shard>,
}

impl Graph {
    pub fn value(&self, id: ValueId) -> &ValueInfo {
        &self.values[id.0 as usize]
    }

    /// True if some op keeps recurrent state across `forward` calls (Gated DeltaNet): such a
    /// state cannot be rewound, so a forward must start at 0 or where the last one ended.
    pub fn has_recurrent_state(&self) -> bool {
        self.ops.iter().any(|o| matches!(o, Op::GatedDeltaNet { .. }))
    }

    /// Floats of one sequence's recurrent state over all Gated DeltaNet layers (conv windows
    /// and delta-rule matrices); 0 for models without them.
    pub fn recurrent_state_floats(&self) -> usize {
        self.ops.iter().map(|o| if let Op::GatedDeltaNet { shape, .. } = o { shape.conv_state_len() + shape.ssm_state_len() } else { 0 }).sum()
    }

    /// True if op `op`'s output is all-reduced over the ranks after it runs.
    pub fn all_reduces_after(&self, op: usize) -> bool {
        self.shard.as_ref().is_some_and(|s| s.all_reduce.binary_search(&op).is_ok())
    }

    /// Layers with a KV cache (an `Attention` op).
    pub fn attention_layers(&self) -> Vec<usize> {
        self.ops.iter().filter_map(|o| if let Op::Attention { layer, .. } = o { Some(*layer) } else { None }).collect()
    }

    /// The last op before op `end` that writes value `v`.
    pub fn last_writer(&self, end: usize, v: ValueId) -> Option<usize> {
        self.ops[..end].iter().rposition(|o| o.writes() == v)
    }

    /// Check that every value is written before it is read and that column ranges fit.
    pub fn validate(&self, weight_rows: impl Fn(WeightId) -> usize) -> Result<(), String> {
        let mut written = vec![false; self.values.len()];
        for (i, op) in self.ops.iter().enumerate() {
            for r in op.reads() {
                if !written[r.0 as usize] {
                    return Err(format!("op {i} ({}) reads `{}` before it is written", op.kind(), self.value(r).name));
                }
            }
            if let Op::Attention { window: Some(0), .. } = op {
                return Err(format!("op {i}: attention window of 0 positions"));
            }
            if let Op::GatedDeltaNet { x, out, shape, .. } = op {
                let s = shape;
                if s.n_k_heads == 0 || s.n_v_heads % s.n_k_heads != 0 || s.k_dim == 0 || s.v_dim == 0 || s.conv_kernel == 0 {
                    return Err(format!("op {i}: bad Gated DeltaNet shape {s:?}"));
                }
                if self.value(*x).width != s.proj_width() || self.value(*out).width != s.value_width() {
                    return Err(format!("op {i}: Gated DeltaNet input/output widths do not match {s:?}"));
                }
            }
            if let Op::Linear { w, out, out_col, .. } = op {
                let width = self.value(*out).width;
                if out_col + weight_rows(*w) > width {
                    return Err(format!("op {i}: linear output columns exceed `{}`", self.value(*out).name));
                }
            }
            if let Op::MoeFfn { x, router, gate_up, down, moe, residual, out, .. } = op {
                self.validate_moe(*x, *router, *gate_up, *down, *moe, *residual, *out, &weight_rows).map_err(|e| format!("op {i}: {e}"))?;
            }
            if let Op::GatedLinear { w, out, .. } = op {
                if weight_rows(*w) != 2 * self.value(*out).width {
                    return Err(format!("op {i}: gated linear weight is not twice as tall as `{}`", self.value(*out).name));
                }
            }
            written[op.writes().0 as usize] = true;
        }
        if !written[self.logits.0 as usize] {
            return Err("logits are never written".into());
        }
        if let Some(s) = &self.shard {
            if s.rank >= s.n_ranks {
                return Err(format!("rank {} of {} ranks", s.rank, s.n_ranks));
            }
            if s.all_reduce.windows(2).any(|w| w[0] >= w[1]) || s.all_reduce.last().is_some_and(|&i| i >= self.ops.len()) {
                return Err("all-reduces out of order or past the last op".into());
            }
        }
        let mut layer_end = 0;
        for l in &self.layers {
            if l.first < layer_end || crate::fusion::decoder_layer_at(self, l.first).is_none() {
                return Err(format!("decoder layer {l:?}: not the five ops of a fusable layer, or overlapping"));
            }
            layer_end = l.first + DecoderLayer::LEN;
        }
        let mut previous_consumer = 0;
        for h in &self.handoffs {
            let reads = match self.ops.get(h.consumer) {
                Some(Op::Linear { x, .. } | Op::GatedLinear { x, .. }) => *x,
                _ => return Err(format!("hand-off {h:?}: the consumer is not a linear")),
            };
            let writer = match h.last_row {
                Some(l) => match self.ops.get(l) {
                    Some(Op::LastRow { x, out }) if *out == reads && self.last_writer(h.consumer, reads) == Some(l) => self.last_writer(l, *x),
                    _ => return Err(format!("hand-off {h:?}: op {l} is not the LastRow the consumer reads")),
                },
                None => self.last_writer(h.consumer, reads),
            };
            if writer != Some(h.producer) || h.producer < previous_consumer {
                return Err(format!("hand-off {h:?}: not the last writer of the consumer's input, or out of sequence"));
            }
            previous_consumer = h.consumer;
        }
        Ok(())
    }
}

impl Graph {
    /// Widths and expert bank heights of a MoE FFN op (shared-expert shapes are checked when
    /// the weights are added).
    #[allow(clippy::too_many_arguments)]
    fn validate_moe(
        &self,
        x: ValueId,
        router: WeightId,
        gate_up: ExpertGateUp,
        down: WeightId,
        moe: MoeShape,
        residual: Option<ValueId>,
        out: ValueId,
        weight_rows: &impl Fn(WeightId) -> usize,
    ) -> Result<(), String> {
        let MoeShape { n_experts: e, top_k, n_ff_exp: ff, .. } = moe;
        if e == 0 || top_k == 0 || top_k > e || ff == 0 {
            return Err(format!("bad MoE shape {moe:?}"));
        }
        let d = self.value(out).width;
        if self.value(x).width != d || residual.is_some_and(|r| self.value(r).width != d) {
            return Err("MoE FFN input, residual and output widths differ".into());
        }
        let gate_up_ok = match gate_up {
            ExpertGateUp::Fused(w) => weight_rows(w) == e * 2 * ff,
            ExpertGateUp::Split { gate, up } => weight_rows(gate) == e * ff && weight_rows(up) == e * ff,
        };
        if weight_rows(router) != e || !gate_up_ok || weight_rows(down) != e * d {
            return Err(format!("MoE FFN weights do not match {moe:?} and width {d}"));
        }
        Ok(())
    }
}

/// Incremental graph construction used by the architecture files.
pub struct GraphBuilder {
    values: Vec<ValueInfo>,
    ops: Vec<Op>,
}

impl GraphBuilder {
    pub fn new() -> Self {
        Self { values: Vec::new(), ops: Vec::new() }
    }

    pub fn value(&mut self, name: impl Into<String>, width: usize, rows: Rows) -> ValueId {
        self.values.push(ValueInfo { name: name.into(), width, rows, traced: false });
        ValueId(self.values.len() as u32 - 1)
    }

    pub fn width(&self, v: ValueId) -> usize {
        self.values[v.0 as usize].width
    }

    pub fn trace(&mut self, v: ValueId) {
        self.values[v.0 as usize].traced = true;
    }

    pub fn push(&mut self, op: Op) {
        self.ops.push(op);
    }

    pub fn finish(self, logits: ValueId, n_layers: usize, attention: AttentionShape) -> Graph {
        Graph { values: self.values, ops: self.ops, handoffs: Vec::new(), layers: Vec::new(), logits, n_layers, attention, shard: None }
    }
}

impl Default for GraphBuilder {
    fn default() -> Self {
        Self::new()
    }
}
