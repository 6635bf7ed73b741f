//! Tensor parallelism, Megatron-style: a dense decoder split over `n` ranks (GPUs), each rank a
//! [`Model`] of its own.
//!
//! * Column-parallel linears (output rows split, no communication): Q, K and V by whole heads —
//!   rank `r` keeps query heads `r·h/n ..` and kv heads `r·kv/n ..`, which GQA pairs correctly
//!   since `n` divides both —, and gate and up by the same rows of each, so that each rank's
//!   `act(gate) * up` is complete for its MLP columns. Their biases are split with them. RoPE,
//!   QK-norm, attention and the gated activation then run on the rank's heads and columns.
//! * Row-parallel linears (input columns split): the attention output and MLP down projections
//!   read their rank's columns and leave a partial sum of the whole output, which the executor
//!   all-reduces right after the op ([`Shard::all_reduce`]): two all-reduces of
//!   `tokens x n_embd` floats per layer. A residual folded into such a linear becomes an `Add`
//!   after the all-reduce, a bias stays on rank 0: both are added once.
//! * Everything else is replicated: the embedding, the norms, the residual stream, the output head.
//!
//! The plan reads the built graph, whatever the fusion options: a projection is column-parallel
//! because attention or the gated activation reads what it writes, row-parallel because it reads
//! what they write. Weights are slices declared at load ([`WeightSet::select_rows`],
//! [`WeightSet::select_cols`]): whole rows, or every row cut between quant blocks, so packed
//! weights stay packed and a rank runs the ordinary kernels on them.

use crate::graph::{Op, Shard, ValueId, ValueInfo};
use crate::{Arch, Graph, Model, ModelError};
use std::ops::Range;
use std::sync::Arc;

/// What a rank does with an op of the whole graph.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OpSplit {
    /// The whole op on every rank (embedding, norms, residual adds, output head).
    Replicated,
    /// A linear whose output rows are split: each rank computes its heads or MLP columns.
    Column,
    /// A linear whose input columns are split: each rank computes a partial sum, all-reduced.
    Row,
    /// An op on the rank's part of split values: attention, RoPE and QK-norm of its heads, the
    /// gated activation of its MLP columns.
    Local,
}

/// How a model splits over `n_ranks` ranks, checked for every rank at once.
#[derive(Clone, Debug)]
pub struct ShardPlan {
    n_ranks: usize,
    /// Per value of the whole graph: `None` if every rank holds it whole, else its segments
    /// (`[q, k, v]` widths of the QKV value, `[ff, ff]` of gate|up, one for the attention
    /// output or the MLP activation), each split evenly over the ranks.
    segments: Vec<Option<Vec<usize>>>,
    ops: Vec<OpSplit>,
}

impl ShardPlan {
    pub fn new(model: &Model, n_ranks: usize) -> Result<Self, ModelError> {
        let n = n_ranks;
        let err = |msg: String| ModelError::Shard { ranks: n, msg };
        if n == 0 {
            return Err(err("a model needs at least one rank".into()));
        }
        if let Arch::Qwen35 | Arch::Qwen35Moe | Arch::Qwen3Next = model.config.arch {
            let layers = if model.config.moe.is_some() { "Gated DeltaNet layers and MoE FFNs" } else { "Gated DeltaNet layers" };
            return Err(err(format!("{} is not supported yet: its {layers} have no split", model.config.arch.name())));
        }
        let g = &model.graph;
        let a = g.attention;
        for (heads, what) in [(a.n_heads, "query heads"), (a.n_kv_heads, "kv heads")] {
            if heads % n != 0 {
                return Err(err(format!("the {heads} {what} cannot be split evenly (each rank takes whole heads)")));
            }
        }
        let (qw, kvw) = (a.n_heads * a.head_dim, a.n_kv_heads * a.head_dim);
        // The MLP activation's width, split by columns.
        let mlp_width = |act: ValueId| match g.value(act).width {
            ff if ff % n == 0 => Ok(ff),
            ff => Err(err(format!("the MLP's {ff} columns (feed-forward width) cannot be split evenly"))),
        };
        let mut segments: Vec<Option<Vec<usize>>> = vec![None; g.values.len()];
        for op in &g.ops {
            let split: &[(ValueId, Vec<usize>)] = &match *op {
                Op::Attention { qkv, out, .. } => vec![(qkv, vec![qw, kvw, kvw]), (out, vec![qw])],
                Op::SwiGlu { x, out } | Op::GeGlu { x, out } => {
                    let ff = mlp_width(out)?;
                    vec![(x, vec![ff, ff]), (out, vec![ff])]
                }
                Op::GatedLinear { out, .. } => vec![(out, vec![mlp_width(out)?])],
                _ => continue,
            };
            for (v, segs) in split {
                let info = g.value(*v);
                match &segments[v.0 as usize] {
                    _ if segs.iter().sum::<usize>() != info.width => return Err(err(format!("`{}` is not {segs:?} wide", info.name))),
                    Some(old) if old != segs => return Err(err(format!("`{}` would be split two ways", info.name))),
                    _ => segments[v.0 as usize] = Some(segs.clone()),
                }
            }
        }
        let split = |v: ValueId| segments[v.0 as usize].as_deref();
        let mut ops = Vec::with_capacity(g.ops.len());
        for (i, op) in g.ops.iter().enumerate() {
            let unsupported = || err(format!("op {i} ({}) uses a value split over the ranks in a way the plan does not handle", op.kind()));
            let whole_segments = |v: ValueId, span: Range<usize>| split(v).is_some_and(|s| covers_whole_segments(s, &span));
            ops.push(match *op {
                Op::Linear { x, norm, w, residual, out, out_col, .. } => match (split(x), split(out)) {
                    (None, None) => OpSplit::Replicated,
                    (None, Some(_)) if residual.is_none() && whole_segments(out, out_col..out_col + model.weights.spec(w).rows) => OpSplit::Column,
                    (Some([_]), None) if norm.is_none() && out_col == 0 => {
                        let spec = model.weights.spec(w);
                        let block = spec.dtype.block_size();
                        if !(spec.cols / n).is_multiple_of(block) {
                            return Err(err(format!(
                                "`{}` ({}): a rank's {} of its {} input columns are not whole {block}-value blocks",
                                spec.name,
                                spec.dtype.name(),
                                spec.cols / n,
                                spec.cols
                            )));
                        }
                        OpSplit::Row
                    }
                    _ => return Err(unsupported()),
                },
                Op::GatedLinear { x, .. } if split(x).is_none() => OpSplit::Column,
                Op::Attention { .. } | Op::SwiGlu { .. } | Op::GeGlu { .. } => OpSplit::Local,
                Op::Rope { x, col, n_heads, .. } | Op::HeadNorm { x, col, n_heads, .. } if split(x).is_some() => {
                    if !whole_segments(x, col..col + n_heads * a.head_dim) {
                        return Err(unsupported());
                    }
                    OpSplit::Local
                }
                Op::Embed { .. } | Op::RmsNorm { .. } | Op::Add { .. } | Op::LastRow { .. } | Op::Rope { .. } | Op::HeadNorm { .. }
                    if op.reads().into_iter().chain([op.writes()]).all(|v| split(v).is_none()) =>
                {
                    OpSplit::Replicated
                }
                _ => return Err(unsupported()),
            });
        }
        Ok(Self { n_ranks: n, segments, ops })
    }

    pub fn n_ranks(&self) -> usize {
        self.n_ranks
    }

    /// What the ranks do with op `op` of the whole graph.
    pub fn op_split(&self, op: usize) -> OpSplit {
        self.ops[op]
    }

    /// The model of rank `rank`: the graph of its share, with the per-rank widths, head counts
    /// and all-reduces, and its weights, slices of the file's tensors.
    pub fn rank_model(&self, model: &Model, rank: usize) -> Result<Model, ModelError> {
        let n = self.n_ranks;
        let g = &model.graph;
        let err = |msg: String| ModelError::Shard { ranks: n, msg };
        if rank >= n {
            return Err(err(format!("no rank {rank}")));
        }
        if self.ops.len() != g.ops.len() || self.segments.len() != g.values.len() {
            return Err(err("the plan was made for another graph".into()));
        }
        let file = &*model.file;
        let mut ws = model.weights.clone();
        let label = format!("rank {rank}/{n}");
        let mut values = g.values.clone();
        for (v, s) in values.iter_mut().zip(&self.segments) {
            if s.is_some() {
                v.width /= n;
            }
        }
        let mut ops = Vec::with_capacity(g.ops.len());
        let mut all_reduce = Vec::new();
        for (op, split) in g.ops.iter().zip(&self.ops) {
            match (*split, op.clone()) {
                (OpSplit::Column, Op::Linear { x, norm, w, bias, residual, out, out_col }) => {
                    let rows = rank_cols(self.segments(out), out_col..out_col + ws.spec(w).rows, n, rank);
                    let w = ws.select_rows(file, w, &label, &rows)?;
                    let bias = bias.map(|b| ws.select_rows(file, b, &label, &rows)).transpose()?;
                    // Whole segments before `out_col`: each leaves a rank 1/n of its columns.
                    ops.push(Op::Linear { x, norm, w, bias, residual, out, out_col: out_col / n });
                }
                (OpSplit::Column, Op::GatedLinear { x, norm, w, act, out }) => {
                    let ff = ws.spec(w).rows / 2;
                    let w = ws.select_rows(file, w, &label, &rank_cols(&[ff, ff], 0..2 * ff, n, rank))?;
                    ops.push(Op::GatedLinear { x, norm, w, act, out });
                }
                (OpSplit::Row, Op::Linear { x, norm, w, bias, residual, out, out_col }) => {
                    let cols = rank_cols(self.segments(x), 0..g.value(x).width, n, rank);
                    let w = ws.select_cols(w, &label, cols[0].clone())?;
                    let bias = bias.filter(|_| rank == 0);
                    let partial = match residual {
                        Some(_) => {
                            let info = g.value(out);
                            values.push(ValueInfo { name: format!("{}.proj", info.name), traced: false, ..info.clone() });
                            ValueId(values.len() as u32 - 1)
                        }
                        None => out,
                    };
                    all_reduce.push(ops.len());
                    ops.push(Op::Linear { x, norm, w, bias, residual: None, out: partial, out_col });
                    if let Some(residual) = residual {
                        ops.push(Op::Add { a: residual, b: partial, out });
                    }
                }
                (OpSplit::Local, Op::Rope { x, col, n_heads, rope }) => ops.push(Op::Rope { x, col: col / n, n_heads: n_heads / n, rope }),
                (OpSplit::Local, Op::HeadNorm { x, col, n_heads, norm }) => ops.push(Op::HeadNorm { x, col: col / n, n_heads: n_heads / n, norm }),
                (_, op) => ops.push(op),
            }
        }
        let attention = crate::graph::AttentionShape { n_heads: g.attention.n_heads / n, n_kv_heads: g.attention.n_kv_heads / n, ..g.attention };
        let shard = Shard { rank, n_ranks: n, all_reduce };
        let mut graph = Graph { values, ops, handoffs: Vec::new(), layers: Vec::new(), logits: g.logits, n_layers: g.n_layers, attention, shard: Some(shard) };
        if !g.handoffs.is_empty() {
            // A producer's hand-off would skip the all-reduce after it.
            let handoffs = crate::fusion::int8_handoffs(&graph, |w| ws.spec(w).rows);
            graph.handoffs = handoffs.into_iter().filter(|h| !graph.all_reduces_after(h.producer)).collect();
        }
        graph.validate(|w| ws.spec(w).rows).map_err(|e| err(format!("rank {rank}: internal graph error: {e}")))?;
        let c = &model.config;
        let config = crate::ModelConfig { n_heads: c.n_heads / n, n_kv_heads: c.n_kv_heads / n, n_ff: c.n_ff / n, ..c.clone() };
        Ok(Model { file: Arc::clone(&model.file), config, weights: ws, graph })
    }

    fn segments(&self, v: ValueId) -> &[usize] {
        self.segments[v.0 as usize].as_deref().unwrap_or_default()
    }
}

/// The models of all `n_ranks` ranks of `model`.
pub fn rank_models(model: &Model, n_ranks: usize) -> Result<Vec<Model>, ModelError> {
    let plan = ShardPlan::new(model, n_ranks)?;
    (0..n_ranks).map(|rank| plan.rank_model(model, rank)).collect()
}

/// True if `span` is made of whole segments.
fn covers_whole_segments(segments: &[usize], span: &Range<usize>) -> bool {
    let mut at = 0;
    segments.iter().all(|&len| {
        let (lo, hi) = (span.start.max(at), span.end.min(at + len));
        at += len;
        lo >= hi || hi - lo == len
    }) && span.end <= at
}

/// Rank `rank`'s columns of the segments inside `span` (whole segments), counted from
/// `span.start`: the `rank`-th of `n` equal parts of each.
fn rank_cols(segments: &[usize], span: Range<usize>, n: usize, rank: usize) -> Vec<Range<usize>> {
    let mut out = Vec::new();
    let mut at = 0;
    for &len in segments {
        if at >= span.start && at + len <= span.end {
            let part = len / n;
            let start = at - span.start + rank * part;
            out.push(start..start + part);
        }
        at += len;
    }
    out
}

#[cfg(test)]
#[allow(clippy::single_range_in_vec_init)] // lists of row ranges, some of one range
mod tests {
    use super::*;
    use crate::synth::{write_temp, SynthShape};
    use crate::FusionOptions;
    use ferrite_gguf::GgmlType;

    /// (`write_temp` caches files by name: one name per shape.)
    fn llama(name: &'static str, n_kv_heads: usize, n_ff: usize) -> SynthShape {
        SynthShape { name, arch: "llama", n_layers: 2, n_embd: 64, n_heads: 4, n_kv_heads, head_dim: 16, n_ff, rope_theta: 1e4, context_length: 64, tied_embeddings: false, gdn: None, moe: None }
    }

    fn load(shape: &SynthShape, dtype: GgmlType, fusion: FusionOptions) -> Model {
        Model::load(write_temp(shape, dtype, 11).unwrap(), fusion).unwrap()
    }

    /// (weight name, split) of every linear of the whole graph.
    fn linears(model: &Model, plan: &ShardPlan) -> Vec<(String, OpSplit)> {
        let g = &model.graph;
        let w = |i: usize| match g.ops[i] {
            Op::Linear { w, .. } | Op::GatedLinear { w, .. } => Some(model.weights.spec(w).name.clone()),
            _ => None,
        };
        (0..g.ops.len()).filter_map(|i| w(i).map(|name| (name, plan.op_split(i)))).collect()
    }

    fn part(tensor: String, rows: Option<Vec<Range<usize>>>, cols: Option<Range<usize>>) -> crate::WeightPart {
        crate::WeightPart { tensor, rows, cols }
    }

    /// Fused: QKV and gate|up column-parallel, attention output and down row-parallel, the
    /// output head replicated; rank 1 of 2 takes query heads 2-3, kv head 1 and MLP columns
    /// 64..128, and all-reduces the two row-parallel outputs of each layer before the residual add.
    #[test]
    fn fused_llama_splits_heads_and_mlp_columns() {
        let m = load(&llama("tp-llama", 2, 128), GgmlType::Q8_0, FusionOptions::ALL);
        let plan = ShardPlan::new(&m, 2).unwrap();
        let b = |s: &str| format!("blk.0.{s}.weight");
        let layer0 = [
            (format!("{}+{}+{}", b("attn_q"), b("attn_k"), b("attn_v")), OpSplit::Column),
            (b("attn_output"), OpSplit::Row),
            (format!("{}+{}", b("ffn_gate"), b("ffn_up")), OpSplit::Column),
            (b("ffn_down"), OpSplit::Row),
        ];
        let all = linears(&m, &plan);
        assert_eq!(all[..4], layer0);
        assert_eq!(all.last().unwrap(), &("output.weight".to_string(), OpSplit::Replicated));
        assert_eq!(all.len(), 9);

        let r1 = plan.rank_model(&m, 1).unwrap();
        let g = &r1.graph;
        assert_eq!((g.attention.n_heads, g.attention.n_kv_heads, r1.config.kv_width()), (2, 1, 16));
        let shard = g.shard.as_ref().unwrap();
        assert_eq!((shard.rank, shard.n_ranks, shard.all_reduce.len()), (1, 2, 4));
        // Each all-reduce is followed by the residual add it was folded into.
        for &i in &shard.all_reduce {
            let Op::Linear { out, residual: None, .. } = g.ops[i] else { panic!("op {i} is not a plain linear") };
            assert!(matches!(g.ops[i + 1], Op::Add { b, .. } if b == out), "{:?}", g.ops[i + 1]);
            assert_eq!(g.value(out).width, 64);
        }
        let ws: Vec<crate::WeightId> = g.ops.iter().filter_map(|o| if let Op::Linear { w, .. } | Op::GatedLinear { w, .. } = o { Some(*w) } else { None }).collect();
        let (q, k, v) = (b("attn_q"), b("attn_k"), b("attn_v"));
        assert_eq!(r1.weights.spec(ws[0]).parts, [part(q, Some(vec![32..64]), None), part(k, Some(vec![16..32]), None), part(v, Some(vec![16..32]), None)]);
        assert_eq!(r1.weights.spec(ws[1]).parts, [part(b("attn_output"), None, Some(32..64))]);
        assert_eq!(r1.weights.spec(ws[2]).parts, [part(b("ffn_gate"), Some(vec![64..128]), None), part(b("ffn_up"), Some(vec![64..128]), None)]);
        assert_eq!(r1.weights.spec(ws[3]).parts, [part(b("ffn_down"), None, Some(64..128))]);
        assert_eq!(r1.weights.spec(ws[3]).name, "blk.0.ffn_down.weight[rank 1/2]");
        assert_eq!(r1.weights.spec(*ws.last().unwrap()).whole_tensor(), Some("output.weight"));
        // A hand-off never skips an all-reduce.
        assert!(!g.handoffs.is_empty() && g.handoffs.iter().all(|h| !g.all_reduces_after(h.producer)));
    }

    /// Unfused: the separate Q, K, V and gate, up linears keep their column ranges (rank-sized),
    /// RoPE covers the rank's Q and K heads, the residual adds were ops already.
    #[test]
    fn unfused_llama_keeps_column_ranges() {
        let m = load(&llama("tp-llama", 2, 128), GgmlType::F32, FusionOptions::NONE);
        let r0 = ShardPlan::new(&m, 2).unwrap().rank_model(&m, 0).unwrap();
        let g = &r0.graph;
        let cols: Vec<(usize, usize)> = g.ops.iter().filter_map(|o| if let Op::Linear { w, out_col, .. } = o { Some((*out_col, r0.weights.spec(*w).rows)) } else { None }).collect();
        // q, k, v; output; gate, up; down (per layer), then the output head.
        assert_eq!(cols[..7], [(0, 32), (32, 16), (48, 16), (0, 64), (0, 64), (64, 64), (0, 64)]);
        let rope = g.ops.iter().find_map(|o| if let Op::Rope { col, n_heads, .. } = o { Some((*col, *n_heads)) } else { None });
        assert_eq!(rope, Some((0, 3)));
        assert_eq!(g.shard.as_ref().unwrap().all_reduce.len(), 4);
        assert_eq!(g.ops.len(), m.graph.ops.len(), "no op added: the residual adds are separate ops already");
    }

    #[test]
    fn what_cannot_be_split_is_refused_clearly() {
        let refused = |m: &Model, n: usize| ShardPlan::new(m, n).unwrap_err().to_string();
        let m = load(&llama("tp-llama-refused", 2, 128), GgmlType::Q8_0, FusionOptions::ALL);
        assert_eq!(refused(&m, 0), "tensor parallelism over 0 ranks: a model needs at least one rank");
        assert!(refused(&m, 3).contains("the 4 query heads cannot be split evenly"), "{}", refused(&m, 3));
        assert!(refused(&m, 4).contains("the 2 kv heads cannot be split evenly"), "{}", refused(&m, 4));
        let plan = ShardPlan::new(&m, 2).unwrap();
        assert!(plan.rank_model(&m, 2).err().is_some_and(|e| e.to_string().contains("no rank 2")));
        let e = refused(&load(&llama("tp-llama-kv4", 4, 128), GgmlType::Q8_0, FusionOptions::ALL), 4);
        assert!(e.contains("`blk.0.attn_output.weight` (Q8_0): a rank's 16 of its 64 input columns are not whole 32-value blocks"), "{e}");
        let e = refused(&load(&llama("tp-llama-ff90", 4, 90), GgmlType::F32, FusionOptions::ALL), 4);
        assert!(e.contains("the MLP's 90 columns (feed-forward width) cannot be split evenly"), "{e}");
        // Q4_K: each rank's input columns of a row-parallel linear must be whole 256-value blocks.
        let wide = SynthShape { n_embd: 256, head_dim: 64, ..llama("tp-llama-wide", 2, 512) };
        let e = refused(&load(&wide, GgmlType::Q4_K, FusionOptions::ALL), 2);
        assert!(e.contains("`blk.0.attn_output.weight` (Q4_K): a rank's 128 of its 256 input columns are not whole 256-value blocks"), "{e}");
        let qwen35 = Model::load(concat!(env!("CARGO_MANIFEST_DIR"), "/../../fixtures/tiny/qwen35.gguf"), FusionOptions::ALL).unwrap();
        assert!(refused(&qwen35, 2).contains("qwen35 is not supported yet: its Gated DeltaNet layers"), "{}", refused(&qwen35, 2));
    }
}
