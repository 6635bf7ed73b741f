//! Which fusions the graph builder declares. Defaults come from the env-switch registry.

use crate::graph::{DecoderLayer, GatedActivation, Graph, Handoff, Op, ValueId, WeightId};
use ferrite_core::env;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FusionOptions {
    /// Q, K and V projections as one linear over a concatenated weight.
    pub qkv: bool,
    /// Gate and up projections as one linear.
    pub gate_up: bool,
    /// RMSNorm folded into the prologue of the (fused) projection that consumes it. Only applied
    /// when that projection is a single linear: an unfused group would recompute the norm.
    pub norm_into_linear: bool,
    /// Residual add folded into the op that produces the added value: the epilogue of the
    /// output/down projections, or Gemma's post-norm after them.
    pub residual_into_linear: bool,
    /// The MLP's gate activation (SwiGLU/GeGLU) folded into the epilogue of the fused gate/up
    /// linear (needs `gate_up`).
    pub glu_into_linear: bool,
    /// RoPE of Q and K applied by the attention op as it stores K and reads Q, instead of a
    /// separate in-place op.
    pub rope_into_attention: bool,
    /// QK-norm (per-head RMSNorm of Q and K) applied by the attention op before its RoPE, instead
    /// of two separate in-place `HeadNorm` ops (needs `rope_into_attention`: the norm comes first).
    pub head_norm_into_attention: bool,
    /// Declare int8 hand-offs ([`crate::graph::Handoff`]): the op feeding a linear may leave
    /// that linear's quantized input (a backend hint; the CPU executor ignores it).
    pub int8_handoff: bool,
    /// Declare decoder layers ([`crate::graph::DecoderLayer`]): a Llama-family layer's five ops
    /// after the other fusions, whose MLP a backend may run as one launch per token (a backend
    /// hint; the CPU executor ignores it). Needs the QKV, gate/up, norm, residual, GLU and RoPE
    /// fusions.
    pub decoder_layer: bool,
}

impl FusionOptions {
    pub const ALL: Self = Self {
        qkv: true,
        gate_up: true,
        norm_into_linear: true,
        residual_into_linear: true,
        glu_into_linear: true,
        rope_into_attention: true,
        head_norm_into_attention: true,
        int8_handoff: true,
        decoder_layer: true,
    };
    pub const NONE: Self = Self {
        qkv: false,
        gate_up: false,
        norm_into_linear: false,
        residual_into_linear: false,
        glu_into_linear: false,
        rope_into_attention: false,
        head_norm_into_attention: false,
        int8_handoff: false,
        decoder_layer: false,
    };

    /// All fusions on, except those disabled by `FERRITE_DISABLE_*_FUSION=1`.
    pub fn from_env() -> Self {
        Self {
            qkv: !env::DISABLE_QKV_FUSION.flag(),
            gate_up: !env::DISABLE_GATE_UP_FUSION.flag(),
            norm_into_linear: !env::DISABLE_NORM_FUSION.flag(),
            residual_into_linear: !env::DISABLE_RESIDUAL_FUSION.flag(),
            glu_into_linear: !env::DISABLE_GLU_FUSION.flag(),
            rope_into_attention: !env::DISABLE_ROPE_FUSION.flag(),
            head_norm_into_attention: !env::DISABLE_HEAD_NORM_FUSION.flag(),
            int8_handoff: !env::DISABLE_INT8_HANDOFF.flag(),
            decoder_layer: !env::DISABLE_LAYER_FUSION.flag(),
        }
    }
}

impl Default for FusionOptions {
    fn default() -> Self {
        Self::from_env()
    }
}

/// The int8 hand-offs of a graph: each linear (or gated linear) whose input was written by an
/// attention op, a whole-width linear or a gated linear (directly, or through the `LastRow` op
/// before the output head: a hand-off for one-row batches), taking only the first linear after
/// each producer and keeping hand-offs in sequence (a consumer comes no later than the next
/// producer), so that two buffers carry them all. `weight_rows` gives a weight's output rows.
pub fn int8_handoffs(graph: &Graph, weight_rows: impl Fn(WeightId) -> usize) -> Vec<Handoff> {
    let mut found: Vec<Handoff> = Vec::new();
    for (consumer, op) in graph.ops.iter().enumerate() {
        let x = match *op {
            Op::Linear { x, .. } | Op::GatedLinear { x, .. } => x,
            _ => continue,
        };
        let Some(mut producer) = graph.last_writer(consumer, x) else { continue };
        let mut last_row = None;
        if let Op::LastRow { x: rows, out } = graph.ops[producer] {
            // Skipping the copy must leave no reader without its value.
            if graph.ops.iter().filter(|o| o.reads().contains(&out)).count() != 1 {
                continue;
            }
            last_row = Some(producer);
            let Some(p) = graph.last_writer(producer, rows) else { continue };
            producer = p;
        }
        let emits = match graph.ops[producer] {
            Op::Attention { .. } | Op::GatedLinear { .. } => true,
            Op::Linear { w, out, out_col, .. } => out_col == 0 && weight_rows(w) == graph.value(out).width,
            _ => false,
        };
        let in_sequence = found.last().is_none_or(|h| h.consumer <= producer);
        if emits && in_sequence {
            found.push(Handoff { producer, consumer, last_row });
        }
    }
    found
}

/// The values of a decoder layer starting at op `first` (see [`DecoderLayer`]): its input
/// stream, QKV, attention output, stream after attention, MLP activation and output stream; or
/// `None` if the five ops there are not such a layer.
pub fn decoder_layer_at(graph: &Graph, first: usize) -> Option<[ValueId; 6]> {
    let ops = graph.ops.get(first..first + DecoderLayer::LEN)?;
    let values = match *ops {
        [Op::Linear { x, norm: Some(_), bias: None, residual: None, out: qkv, out_col: 0, .. }, Op::Attention { qkv: q2, out: att, window: None, rope: Some(_), qk_norm: None, .. }, Op::Linear { x: a2, norm: None, bias: None, residual: Some(r1), out: mid, out_col: 0, .. }, Op::GatedLinear { x: m2, norm: Some(_), act: GatedActivation::Silu, out: act, .. }, Op::Linear { x: act2, norm: None, bias: None, residual: Some(r2), out, out_col: 0, .. }]
            if q2 == qkv && a2 == att && r1 == x && m2 == mid && act2 == act && r2 == mid =>
        {
            [x, qkv, att, mid, act, out]
        }
        _ => return None,
    };
    // The values inside the layer are read by its own ops only.
    let inside = first..first + DecoderLayer::LEN;
    let read_outside = graph.ops.iter().enumerate().filter(|(i, _)| !inside.contains(i)).any(|(_, op)| op.reads().iter().any(|v| values[1..5].contains(v)));
    (!read_outside && values[5] != values[0]).then_some(values)
}

/// The decoder layers of a graph: every run of five ops that [`decoder_layer_at`] accepts,
/// without overlaps.
pub fn decoder_layers(graph: &Graph) -> Vec<DecoderLayer> {
    let mut layers = Vec::new();
    let mut i = 0;
    while i < graph.ops.len() {
        if decoder_layer_at(graph, i).is_some() {
            layers.push(DecoderLayer { first: i });
            i += DecoderLayer::LEN;
        } else {
            i += 1;
        }
    }
    layers
}
