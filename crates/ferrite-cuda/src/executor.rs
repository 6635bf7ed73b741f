//! Runs a model graph on the GPU with the op layer.
//!
//! Weights are uploaded (and repacked) once; activations live in one device buffer per planner
//! slot; every op is an async launch on the compute stream. The host only synchronises when it
//! reads something back (logits, a sampled token id, traces).
//!
//! Decode (one token) uses contiguous views of the fused gate-up rows directly. A batch of
//! several tokens has those column ranges strided, so they are gathered with `copy_cols` first
//! (the attention's `store_qkv` reads strided rows itself).
//!
//! Attention layers have a KV cache, Gated DeltaNet layers a recurrent state (conv window and
//! delta-rule matrices, f32), each at a fixed device address so the decode graph replays them.
//! MoE FFN layers route on the device (`ops::moe_ffn`: the expert ids live in device memory) in
//! a scratch of their own, so they replay too.

use crate::kernels::dequant::MmaOrder;
use crate::ops::{self, AttentionConfig, GatedQuery, GdnBatch, GdnSeq, GdnState, GdnWeights, KvCache, KvDtype, RopeConfig, SamplingConfig};
use crate::staging::{Mailbox, Readback, StagingRing};
use crate::{CudaError, DeviceWeight, Gpu};
use anyhow::{anyhow, bail, Context};
use cudarc::driver::sys::{CUgraphInstantiate_flags, CUstreamCaptureMode};
use cudarc::driver::{CudaGraph, CudaSlice};
use ferrite_core::env;
use ferrite_gguf::GgmlType;
use ferrite_model::graph::{DecoderLayer, ExpertGateUp, GatedActivation, GdnShape, Graph, NormSpec, Op, Rows, ValueId, WeightId};
use ferrite_model::planner::{self, Plan};
use ferrite_model::profile::OpProfile;
use ferrite_model::{
    AheadSeq, BatchRows, DeviceSampling, Executor, ExecutorOptions, HardwareCeilings, LayerTrace, LoadProgress, Model, PagedKvConfig,
    PagedOutput, RecurrentCursor, RopeStyle, SeqChunk,
};
use std::collections::HashMap;
use std::ops::{Index, IndexMut};
use std::sync::Arc;

enum GpuWeight {
    Matrix(DeviceWeight),
    Vector(CudaSlice<f32>),
}

/// The matrix in a weight slot, if it holds one.
fn as_matrix(w: &Option<GpuWeight>) -> Option<&DeviceWeight> {
    match w {
        Some(GpuWeight::Matrix(m)) => Some(m),
        _ => None,
    }
}

/// Whether the linear of weight `w` on input `x` takes the int8 GEMV for a batch of `n` rows.
fn takes_int8_gemv(weights: &[Option<GpuWeight>], graph: &Graph, opts: &ops::LinearOptions, w: WeightId, x: ValueId, n: usize) -> bool {
    as_matrix(&weights[w.0 as usize]).is_some_and(|m| ops::linear_plan(m.dtype, graph.value(x).width, n, opts) == ops::LinearPlan::GemvQ8)
}

/// Weight `id` as the graph uses it: a matrix of a linear, or a vector (norm weight, bias).
fn matrix_of(weights: &[Option<GpuWeight>], id: WeightId) -> &DeviceWeight {
    as_matrix(&weights[id.0 as usize]).expect("matrix weights are uploaded as matrices")
}

fn vector_of(weights: &[Option<GpuWeight>], id: WeightId) -> &CudaSlice<f32> {
    match &weights[id.0 as usize] {
        Some(GpuWeight::Vector(v)) => v,
        _ => unreachable!("vector weights are uploaded as f32"),
    }
}

/// Per-layer state that only some layers have (a KV cache: attention layers; recurrent state:
/// Gated DeltaNet layers), indexed by layer.
struct PerLayer<T>(Vec<Option<T>>);

impl<T> PerLayer<T> {
    fn iter(&self) -> impl Iterator<Item = &T> {
        self.0.iter().flatten()
    }

    fn iter_mut(&mut self) -> impl Iterator<Item = &mut T> {
        self.0.iter_mut().flatten()
    }
}

/// Built from `(layer, state)` pairs.
impl<T> FromIterator<(usize, T)> for PerLayer<T> {
    fn from_iter<I: IntoIterator<Item = (usize, T)>>(pairs: I) -> Self {
        let mut by_layer = Vec::new();
        for (layer, state) in pairs {
            if by_layer.len() <= layer {
                by_layer.resize_with(layer + 1, || None);
            }
            by_layer[layer] = Some(state);
        }
        PerLayer(by_layer)
    }
}

impl<T> Index<usize> for PerLayer<T> {
    type Output = T;
    fn index(&self, layer: usize) -> &T {
        self.0.get(layer).and_then(Option::as_ref).unwrap_or_else(|| panic!("layer {layer} has no such state"))
    }
}

impl<T> IndexMut<usize> for PerLayer<T> {
    fn index_mut(&mut self, layer: usize) -> &mut T {
        self.0.get_mut(layer).and_then(Option::as_mut).unwrap_or_else(|| panic!("layer {layer} has no such state"))
    }
}

/// Device buffers a forward pass writes, kept apart from the read-only weights.
struct Buffers {
    /// One buffer per planner slot; `None` only while the running op holds it as its output.
    slots: Vec<Option<CudaSlice<f32>>>,
    /// Normalised input of a norm-folded linear / gathered columns.
    scratch_a: CudaSlice<f32>,
    /// Output of a linear that fills a column range / a second gathered operand.
    scratch_b: CudaSlice<f32>,
    scratch_c: CudaSlice<f32>,
    /// int8 activations of a linear that quantizes its own input (the int8 GEMV path).
    q8: ops::Q8Activations,
    /// int8 activations left by the producer of a hand-off, alternating: hand-off `h` uses
    /// buffer `h % 2`, so a GEMV that consumes one hand-off and produces the next never writes
    /// the buffer it reads.
    q8_handoff: [ops::Q8Activations; 2],
    /// Per op: the hand-off it consumes / produces, when active for the batch being run.
    handoff_in: Vec<Option<usize>>,
    handoff_out: Vec<Option<usize>>,
    /// Per op: a `LastRow` copy the batch being run skips (a one-row batch, whose row reaches
    /// the output head through an int8 hand-off instead).
    copy_skipped: Vec<bool>,
    /// 16-bit GEMM inputs staged by their producer (a GLU GEMM for the down projection, attention
    /// for the output projection), and per op whether it writes them (in the consumer's layout)
    /// or reads them, for the batch being run (`plan_handoffs`). One buffer serves both: each
    /// consumer runs before the next producer.
    staged: ops::StagedActivations,
    staged_out: Vec<Option<ops::StagedLayout>>,
    staged_in: Vec<bool>,
    /// Staged hand-offs enqueued by these buffers' forward passes (launched ops, not replays).
    staged_runs: u64,
    /// Per op: whether the declared decoder layer starting there may run its MLP as one launch
    /// (`FERRITE_CUDA_FUSED_MLP=1`, planned at load; see `mlp_refusal`).
    mlp_layer: Vec<bool>,
    /// For the batch being run (`plan_mlps`), per op: a gate/up op that runs with its down
    /// projection as one launch adding into the layer's output; the value an op writes instead
    /// of its own (the output projection before a fused MLP writes the layer's output, which
    /// the MLP then adds to); and whether a linear quantizes its f32 input row itself.
    mlp_fused: Vec<bool>,
    writes_into: Vec<Option<ValueId>>,
    f32_row_in: Vec<bool>,
    /// Per op, for the batch being run (`plan_early_releases`): an int8 GEMV that releases the
    /// next launch before waiting for its predecessor; off with
    /// `FERRITE_DISABLE_CUDA_EARLY_RELEASE=1`.
    early_release: Vec<bool>,
    early_release_on: bool,
    kv: PerLayer<KvCache>,
    gdn: PerLayer<GdnState>,
    /// Working memory of the MoE FFN ops, one per distinct shape.
    moe: Vec<ops::MoeScratch>,
    /// Key shares of decode attention per batch size (`attention_splits`; 1: no split) and the
    /// scratch of split attention.
    attention_splits: Vec<usize>,
    /// The fused one-token decode kernel's layouts, and the one this step takes.
    decode: ops::DecodeLayouts,
    decode_stage: ops::DecodeStage,
    /// One-token steps store K/V inside the (unsplit) attention kernel.
    fused_kv_store: bool,
    split_scratch: ops::SplitScratch,
    ids: CudaSlice<u32>,
    positions: CudaSlice<u32>,
    token: CudaSlice<u32>,
    profile: Option<OpProfile>,
    /// Batched serving only: where each row's sequence finds its cache rows.
    paging: Option<BatchPaging>,
}

/// The layout of a batched step (`forward_paged`) on the device, and its last rows.
struct BatchPaging {
    /// `[n_seqs, max_blocks]` block tables of the step (capacity: every sequence's whole table).
    tables: CudaSlice<u32>,
    row_seq: CudaSlice<u32>,
    n_seqs: usize,
    max_blocks: usize,
    block_size: usize,
    /// Row of each sequence's last token.
    last_rows: Vec<usize>,
    /// What `row_seq` and `tables` hold (host copies of the last uploads): a step whose rows and
    /// tables are unchanged (decode steps within a block) copies neither again.
    uploaded_row_seq: Vec<u32>,
    uploaded_tables: Vec<u32>,
    /// Models with Gated DeltaNet layers: the step's sequences (rows and state slots) for the
    /// batched mixer, and their device form (`GdnBatch`), with host copies of the last uploads.
    gdn_seqs: Vec<GdnSeq>,
    gdn_rows: CudaSlice<u32>,
    gdn_slots: CudaSlice<u32>,
    uploaded_gdn_rows: Vec<u32>,
    uploaded_gdn_slots: Vec<u32>,
}

/// Copy `src` to the start of `dst` through the staging ring, unless `last` (the host copy of the
/// previous upload) equals it already.
fn upload_if_changed(staging: &mut StagingRing, gpu: &Gpu, src: &[u32], last: &mut Vec<u32>, dst: &mut CudaSlice<u32>) -> Result<(), CudaError> {
    if last.as_slice() != src {
        staging.copy(gpu, src, &mut dst.slice_mut(0..src.len()))?;
        last.clear();
        last.extend_from_slice(src);
    }
    Ok(())
}

/// The paged KV cache and the buffers of batched steps (`init_paged`), swapped in for a step.
struct PagedState {
    config: PagedKvConfig,
    plan: Plan,
    buf: Buffers,
    /// The sequences' tokens drawn on the device (`max_seqs`).
    tokens: CudaSlice<u32>,
    /// The sampled draws of a step in one launch (`ops::sample_rows`; None with
    /// FERRITE_DISABLE_CUDA_ROW_DRAWS=1): their settings on the device and the candidates'
    /// scratch (None with FERRITE_DISABLE_SAMPLE_CANDIDATES=1).
    row_draws: Option<(CudaSlice<u32>, Option<ops::SampleScratch>)>,
    /// Their host copy, then the device error flag's (`max_seqs + 2` words).
    readback: Readback,
    graphs: BatchGraphs,
    /// The decode step enqueued ahead by the last `forward_paged_ahead`, not yet taken.
    ahead: Option<AheadStep>,
    /// Steps enqueued ahead that the next batch took (counted since `init_paged`).
    ahead_taken: u64,
    /// Per state slot: the tokens its recurrent state has consumed (models with Gated DeltaNet
    /// layers).
    cursors: Vec<RecurrentCursor>,
}

/// A decode step enqueued before the tokens that feed it were read back: what it ran, to
/// recognise the batch that asks for it.
struct AheadStep {
    ids: Vec<u32>,
    positions: Vec<u32>,
    tables: Vec<u32>,
    max_blocks: usize,
}

/// The Gated DeltaNet layers of a graph and their shapes.
fn gdn_layers(graph: &Graph) -> Vec<(usize, GdnShape)> {
    graph.ops.iter().filter_map(|o| if let Op::GatedDeltaNet { layer, shape, .. } = o { Some((*layer, *shape)) } else { None }).collect()
}

/// A step's block tables on the device, `[n_seqs, max_blocks]`. A decode step (one token per
/// sequence) keeps its width for 2x growth of the longest table, so that its graph serves the
/// steps until then.
fn step_tables<'a>(tables: impl Iterator<Item = &'a [u32]> + Clone, decode: bool, n_blocks: usize) -> (Vec<u32>, usize) {
    let longest = tables.clone().map(<[u32]>::len).max().unwrap_or(0);
    let max_blocks = if decode { longest.next_power_of_two().min(n_blocks).max(longest) } else { longest };
    let mut out = Vec::with_capacity(tables.clone().count() * max_blocks);
    for t in tables {
        out.extend_from_slice(t);
        out.resize(out.len() + max_blocks - t.len(), 0);
    }
    (out, max_blocks)
}

impl Buffers {
    /// Buffers for up to `rows` token rows under `plan`, around the given caches and states.
    #[allow(clippy::too_many_arguments)]
    fn new(gpu: &Gpu, model: &Model, plan: &Plan, rows: usize, kv: PerLayer<KvCache>, gdn: PerLayer<GdnState>, attention_splits: Vec<usize>, decode: ops::DecodeLayouts) -> anyhow::Result<Self> {
        let (graph, cfg) = (&model.graph, &model.config);
        let widest = model
            .weights
            .used_by(graph)
            .into_iter()
            .map(|id| model.weights.spec(id))
            // Expert banks (`experts > 1`) only feed the MoE op, whose scratch is its own: their
            // stacked rows do not size the shared scratch buffers.
            .filter(|spec| !spec.is_vector() && spec.experts == 1)
            .map(|spec| spec.rows.max(spec.cols))
            .max()
            .unwrap_or(0);
        let scratch = rows * widest.max(cfg.qkv_width()).max(2 * cfg.n_ff);
        // Gated DeltaNet runs in scratch_a; the chunked path's need bounds the recurrent one's.
        let gdn_scratch = gdn.iter().map(|st| ops::gdn_scratch_len(&st.shape, rows, ops::GdnPath::Chunked)).max().unwrap_or(0);
        // One MoE scratch per distinct MoE shape (every layer of a real model has the same).
        let mut moe = Vec::<ops::MoeScratch>::new();
        for op in &graph.ops {
            if let Op::MoeFfn { x, shared, moe: shape, .. } = op {
                let dims = ops::MoeDims {
                    dim: graph.value(*x).width,
                    n_experts: shape.n_experts,
                    top_k: shape.top_k,
                    n_ff: shape.n_ff_exp,
                    n_ff_shared: shared.map_or(0, |sh| model.weights.spec(sh.gate).rows),
                };
                if rows * dims.top_k > 65535 {
                    bail!(
                        "a batch of {rows} tokens x {} experts each exceeds the MoE expert GEMV's 65535 (token, expert) pairs; use a smaller batch",
                        dims.top_k
                    );
                }
                if !moe.iter().any(|m| m.dims() == dims) {
                    moe.push(ops::MoeScratch::new(gpu, dims, rows)?);
                }
            }
        }
        // Staged rows as wide as the widest GLU output (attention's narrower ones fit too, or
        // are not staged) for the batches the small-batch GEMMs serve.
        let glu_width = graph.ops.iter().filter(|op| matches!(op, Op::GatedLinear { .. })).map(|op| graph.value(op.writes()).width).max().unwrap_or(0);
        // Queries of split attention: batches of up to this many tokens, one-token steps included.
        let decode_splits = decode.short.splits.max(decode.long.splits) > 1;
        let split_tokens = (1..attention_splits.len()).filter(|&n| attention_splits[n] > 1).max().unwrap_or(0).max(usize::from(decode_splits));
        let max_splits = attention_splits.iter().copied().chain([decode.short.splits, decode.long.splits]).max().unwrap_or(1);
        Ok(Buffers {
            slots: plan.slot_elems.iter().map(|&n| gpu.alloc_zeros::<f32>(n.max(1)).map(Some)).collect::<Result<_, _>>()?,
            split_scratch: ops::SplitScratch::new(gpu, split_tokens * cfg.n_heads, max_splits, cfg.head_dim)?,
            attention_splits,
            decode,
            decode_stage: ops::DecodeStage::Short,
            fused_kv_store: !env::DISABLE_KV_STORE_FUSION.flag(),
            scratch_a: gpu.alloc_zeros(scratch.max(gdn_scratch))?,
            scratch_b: gpu.alloc_zeros(scratch)?,
            scratch_c: gpu.alloc_zeros(scratch)?,
            q8: ops::Q8Activations::new(gpu, scratch)?,
            q8_handoff: [ops::Q8Activations::new(gpu, scratch)?, ops::Q8Activations::new(gpu, scratch)?],
            handoff_in: vec![None; graph.ops.len()],
            handoff_out: vec![None; graph.ops.len()],
            copy_skipped: vec![false; graph.ops.len()],
            staged: ops::StagedActivations::new(gpu, rows.min(gpu.linear_options().mma_max_tokens), glu_width)?,
            staged_out: vec![None; graph.ops.len()],
            staged_in: vec![false; graph.ops.len()],
            staged_runs: 0,
            mlp_layer: vec![false; graph.ops.len()],
            mlp_fused: vec![false; graph.ops.len()],
            writes_into: vec![None; graph.ops.len()],
            f32_row_in: vec![false; graph.ops.len()],
            early_release: vec![false; graph.ops.len()],
            early_release_on: !env::DISABLE_CUDA_EARLY_RELEASE.flag(),
            ids: gpu.alloc_zeros(rows)?,
            positions: gpu.alloc_zeros(rows)?,
            token: gpu.alloc_zeros(1)?,
            profile: OpProfile::from_env(),
            gdn,
            moe,
            kv,
            paging: None,
        })
    }
}

pub struct CudaExecutor {
    model: Arc<Model>,
    gpu: Gpu,
    weights: Vec<Option<GpuWeight>>,
    plan: Plan,
    buf: Buffers,
    options: ExecutorOptions,
    last_rows: usize,
    /// Bytes of resident GEMM-type weight copies (`FERRITE_CUDA_EXPAND_WEIGHTS`), 0 if none.
    expanded: usize,
    /// Tokens the recurrent state has consumed. Unused without recurrent layers.
    state_pos: RecurrentCursor,
    /// Decode-step replay: the whole one-token op sequence captured once as a CUDA graph per
    /// attention layout (`DecodeLayouts`: short, wide and long). Every per-token input (token
    /// id, position, hence KV length) is read from device buffers at fixed addresses, so the same
    /// graph serves every position of its layout without re-capture. Indexed by
    /// [whether the step ends with its own greedy draw][`ops::DecodeStage`].
    decode_graphs: [[DecodeGraph; 3]; 2],
    /// Batched serving (`init_paged`): the paged cache and its buffers.
    paged: Option<PagedState>,
    /// Token ids, positions and block tables go to the device through this ring.
    staging: StagingRing,
    /// Sampled tokens come back through this (`[token, error flag, detail, tag]`): slot 0 tagged
    /// with the count of draws so far (`mail_tag`), slots 1 and 2 from the draws that end
    /// decode steps (`Mail::Advancing`: tagged with the next position, whose parity picks the
    /// slot).
    mailbox: Mailbox,
    mail_tag: u32,
    /// Unless `FERRITE_DISABLE_CUDA_STEP_DRAWS=1`: a greedy one-token step enqueued ahead ends
    /// with its own draw (inside its graph), so that the next step follows it without a launch
    /// between.
    step_draws: bool,
    /// The position whose token the last enqueued step drew itself (then in mailbox slot
    /// `STEP_DRAW_SLOTS + position % 2`, and in `ids`/`positions` for the step at that position).
    drawn_ahead: Option<usize>,
    /// Draws served by a step's own draw (`drawn_ahead`) so far.
    step_drawn_tokens: u64,
    /// Candidate lists of two-stage draws (`None`: `FERRITE_DISABLE_SAMPLE_CANDIDATES`).
    sample_scratch: Option<ops::SampleScratch>,
}

/// The first of the two mailbox slots that the draws ending decode steps write (slot 0 takes
/// the tagged draws between steps).
const STEP_DRAW_SLOTS: usize = 1;

enum DecodeGraph {
    Disabled,
    /// Enabled; captured at the second one-token step (the first loads every kernel module).
    NotYet { warmed_up: bool },
    Ready(CapturedStep),
}

/// A forward pass captured as a CUDA graph, with the GEMM scratch generation it holds the
/// address of (a graph from an older generation must be captured again).
struct CapturedStep {
    graph: CudaGraph,
    scratch_generation: u64,
}

/// Batched decode steps (one token per sequence) replayed as CUDA graphs, one per step shape:
/// (sequences, block-table width rounded up to a power of two). Everything else a step changes
/// (ids, positions, row sequences, block tables) is read from device buffers at fixed addresses.
/// A shape is captured the second time it runs (the first loads its kernels and sizes the
/// scratch); at most [`BatchGraphs::MAX_READY`] graphs are kept, the least recently used go.
struct BatchGraphs {
    enabled: bool,
    shapes: HashMap<(usize, usize), BatchGraph>,
    clock: u64,
    /// Steps launched from a graph (captures included).
    replays: u64,
}

enum BatchGraph {
    Seen,
    Ready { step: CapturedStep, last_used: u64 },
}

impl BatchGraphs {
    const MAX_READY: usize = 64;

    fn new() -> Self {
        BatchGraphs { enabled: !env::DISABLE_CUDA_BATCH_GRAPHS.flag() && !env::DISABLE_CUDA_GRAPH.flag(), shapes: HashMap::new(), clock: 0, replays: 0 }
    }

    /// Drop the least recently used graph while more than `MAX_READY` are kept.
    fn evict(&mut self) {
        let ready = |g: &BatchGraph| matches!(g, BatchGraph::Ready { .. });
        while self.shapes.values().filter(|g| ready(g)).count() > Self::MAX_READY {
            let oldest = self
                .shapes
                .iter()
                .filter_map(|(k, g)| match g {
                    BatchGraph::Ready { last_used, .. } => Some((*last_used, *k)),
                    BatchGraph::Seen => None,
                })
                .min()
                .map(|(_, k)| k);
            if let Some(k) = oldest {
                self.shapes.insert(k, BatchGraph::Seen);
            }
        }
    }
}

fn kv_dtype() -> KvDtype {
    match env::CUDA_KV_DTYPE.get().as_deref() {
        Some("f32") => KvDtype::F32,
        Some("f16") | None => KvDtype::F16,
        Some(other) => {
            eprintln!("warning: FERRITE_CUDA_KV_DTYPE={other:?} is not f16 or f32; using f16");
            KvDtype::F16
        }
    }
}

/// Refuses graphs whose shapes this backend's kernels cannot run (before touching the device):
/// Gated DeltaNet heads too large for the delta-rule kernel's block, MoE FFNs with more experts
/// or experts per token than the routing kernels take.
pub fn check_supported(graph: &ferrite_model::Graph) -> anyhow::Result<()> {
    if let Some(shard) = &graph.shard {
        anyhow::bail!(
            "this graph is rank {} of a {}-way tensor-parallel split; the CUDA backend has no all-reduce yet (the NCCL executor is not built), so it cannot run a rank",
            shard.rank,
            shard.n_ranks
        );
    }
    for (i, op) in graph.ops.iter().enumerate() {
        if let Op::MoeFfn { out, moe, .. } = op {
            ops::check_moe_shape(moe.n_experts, moe.top_k).with_context(|| format!("MoE FFN op {i} (`{}`) on CUDA", graph.value(*out).name))?;
        }
        if let Op::GatedDeltaNet { layer, shape, .. } = op {
            ops::check_gdn_shape(shape).with_context(|| format!("Gated DeltaNet of layer {layer} on CUDA"))?;
        }
    }
    Ok(())
}

impl CudaExecutor {
    pub fn new(model: Arc<Model>, options: ExecutorOptions) -> anyhow::Result<Self> {
        check_supported(&model.graph)?;
        let gpu = Gpu::new(0)?;
        let graph = &model.graph;
        let cfg = &model.config;
        let max_batch = options.max_batch.max(1);
        let mut weights: Vec<Option<GpuWeight>> = (0..model.weights.len()).map(|_| None).collect();
        let used = model.weights.used_by(graph);
        // Weights that kernels read element-wise rather than through a linear: f32 vectors.
        let elementwise: Vec<WeightId> =
            graph.ops.iter().filter_map(|o| if let Op::GatedDeltaNet { conv, .. } = o { Some(*conv) } else { None }).collect();
        // MoE routers: f32 matrices, as on the CPU (routing never sees quantized weights or
        // activations, so both backends choose the same experts).
        let routers: Vec<WeightId> = graph.ops.iter().filter_map(|o| if let Op::MoeFfn { router, .. } = o { Some(*router) } else { None }).collect();
        for (i, &id) in used.iter().enumerate() {
            LoadProgress::report(&options.progress, i, used.len());
            let spec = model.weights.spec(id);
            let w = if spec.is_vector() || elementwise.contains(&id) {
                GpuWeight::Vector(gpu.upload(&model.weights.to_f32(&model.file, id)?, &spec.name)?)
            } else if routers.contains(&id) {
                let f32s = model.weights.to_f32(&model.file, id)?;
                let bytes: Vec<u8> = f32s.iter().flat_map(|v| v.to_le_bytes()).collect();
                GpuWeight::Matrix(
                    gpu.upload_weight(GgmlType::F32, spec.rows, spec.cols, &bytes).with_context(|| format!("uploading `{}`", spec.name))?,
                )
            } else {
                let bytes = model.weights.bytes(&model.file, id)?;
                GpuWeight::Matrix(
                    gpu.upload_weight(spec.dtype, spec.rows, spec.cols, &bytes).with_context(|| format!("uploading `{}`", spec.name))?,
                )
            };
            weights[id.0 as usize] = Some(w);
        }
        let plan = planner::plan(graph, max_batch, !options.trace);
        plan.check(graph).map_err(|e| anyhow!("memory plan violates the aliasing rule: {e}"))?;
        let gdn_shapes = gdn_layers(graph);
        let state_bytes: usize = gdn_shapes.iter().map(|(_, s)| (s.conv_state_len() + s.ssm_state_len()) * 4).sum();
        let kv_bytes = graph.attention_layers().len() * 2 * options.context_len * cfg.kv_width() * kv_dtype().bytes();
        let (free, _) = gpu.mem_info()?;
        if kv_bytes + state_bytes > free {
            bail!(
                "the KV cache for {} tokens (and the recurrent state) needs {:.1} GiB but only {:.1} GiB of device memory is free (lower --ctx-size)",
                options.context_len,
                (kv_bytes + state_bytes) as f64 / (1u64 << 30) as f64,
                free as f64 / (1u64 << 30) as f64
            );
        }
        let kv = graph
            .attention_layers()
            .into_iter()
            .map(|l| KvCache::new(&gpu, kv_dtype(), options.context_len, cfg.n_kv_heads, cfg.head_dim).map(|c| (l, c)))
            .collect::<Result<_, _>>()?;
        let gdn = gdn_shapes.into_iter().map(|(l, shape)| GdnState::new(&gpu, shape).map(|st| (l, st))).collect::<Result<_, _>>()?;
        let split_attention = env::SPLIT_ATTENTION.flag();
        let attention_splits: Vec<usize> = (0..=max_batch)
            .map(|n| if split_attention { ops::attention_splits(gpu.sm_count() as usize, cfg.n_heads, n, options.context_len) } else { 1 })
            .collect();
        // One-token steps run the fused store + attention kernel in one of three layouts.
        let decode = ops::DecodeLayouts::new(&gpu, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, options.context_len, split_attention);
        let buf = Buffers::new(&gpu, &model, &plan, max_batch, kv, gdn, attention_splits, decode)?;
        let decode_graphs = std::array::from_fn(|_| {
            std::array::from_fn(|_| {
                if env::DISABLE_CUDA_GRAPH.flag() || buf.profile.is_some() {
                    DecodeGraph::Disabled
                } else {
                    DecodeGraph::NotYet { warmed_up: false }
                }
            })
        });
        let options = ExecutorOptions { max_batch, ..options };
        let expanded = expand_batched_weights(&gpu, graph, &mut weights, max_batch)?;
        // Each chunk stages two copies (ids, positions), a batched step four: 8 slots never wait.
        let staging = StagingRing::new(&gpu, 8, max_batch)?;
        let mailbox = Mailbox::new(&gpu, STEP_DRAW_SLOTS + 2)?;
        let vocab = graph.value(graph.logits).width;
        let sample_scratch = if env::DISABLE_SAMPLE_CANDIDATES.flag() { None } else { Some(ops::SampleScratch::new(&gpu, vocab)?) };
        let mut executor = Self {
            expanded,
            buf,
            plan,
            weights,
            gpu,
            model,
            options,
            last_rows: 0,
            state_pos: RecurrentCursor::default(),
            decode_graphs,
            paged: None,
            staging,
            mailbox,
            mail_tag: 0,
            step_draws: !env::DISABLE_CUDA_STEP_DRAWS.flag(),
            drawn_ahead: None,
            step_drawn_tokens: 0,
            sample_scratch,
        };
        if env::CUDA_FUSED_MLP.flag() {
            let mut reasons = Vec::new();
            for layer in executor.model.graph.layers.clone() {
                match executor.mlp_refusal(layer) {
                    None => executor.buf.mlp_layer[layer.first] = true,
                    Some(why) => reasons.push(why),
                }
            }
            reasons.sort();
            reasons.dedup();
            if executor.model.graph.layers.is_empty() {
                reasons.push("the graph declares no decoder layers (not a Llama-family layer, or the fusions are off)".into());
            }
            if !reasons.is_empty() {
                let n = executor.model.graph.layers.len() - executor.mlps_run();
                eprintln!("note: the MLP of {n} decoder layer(s) runs as two launches, not one: {}", reasons.join("; "));
            }
        }
        Ok(executor)
    }

    /// Decoder layers whose MLP one-token steps may run as one launch (none unless
    /// `FERRITE_CUDA_FUSED_MLP=1`).
    pub fn mlps_run(&self) -> usize {
        self.buf.mlp_layer.iter().filter(|&&m| m).count()
    }

    /// Why the MLP of decoder layer `layer` cannot run as one launch (`ops::mlp_q8`), or `None`.
    /// Its output projection then writes the layer's output, the fused launch adds the MLP into
    /// it, and the op after the layer, a linear, quantizes that f32 row itself.
    fn mlp_refusal(&self, layer: DecoderLayer) -> Option<String> {
        let graph = &self.model.graph;
        let f = layer.first;
        let Some([_, _, _, _, _, out]) = ferrite_model::fusion::decoder_layer_at(graph, f) else { return Some("not a decoder layer".into()) };
        let (Op::GatedLinear { w: gate_up, .. }, Op::Linear { w: down, .. }) = (&graph.ops[f + 3], &graph.ops[f + 4]) else { return Some("not a decoder layer".into()) };
        let (Some(gu), Some(d)) = (as_matrix(&self.weights[gate_up.0 as usize]), as_matrix(&self.weights[down.0 as usize])) else { return Some("a weight is not a matrix".into()) };
        if gu.dtype != d.dtype || crate::weight::planes(gu.dtype).is_none() {
            return Some(format!("gate/up ({}) and down ({}) are not one quantized type", gu.dtype, d.dtype));
        }
        if !(gu.rows / 2).is_multiple_of(32) {
            return Some(format!("{} MLP channels are not whole 32-value units", gu.rows / 2));
        }
        let adds = d.rows * (gu.rows / 2 / 32);
        if adds > ops::MLP_MAX_ADDS {
            return Some(format!("{adds} atomic adds per token (over {})", ops::MLP_MAX_ADDS));
        }
        match graph.ops.get(f + DecoderLayer::LEN) {
            Some(Op::Linear { x, .. }) if *x == out => None,
            _ => Some("its output feeds no linear next (the last layer)".into()),
        }
    }

    /// The int8 hand-offs the last forward pass ran, and the copies of its last row it skipped.
    pub fn handoffs_run(&self) -> (usize, usize) {
        (self.buf.handoff_in.iter().flatten().count(), self.buf.copy_skipped.iter().filter(|&&s| s).count())
    }

    /// Linears of the last forward that quantized their f32 input row themselves: after a fused
    /// MLP (`plan_mlps`), or in place of a hand-off from a producer that spread its rows
    /// (`plan_row_spreads`).
    pub fn f32_rows_in(&self) -> usize {
        self.buf.f32_row_in.iter().filter(|&&f| f).count()
    }

    /// Tokens handed out that the step before had drawn itself (none with
    /// `FERRITE_DISABLE_CUDA_STEP_DRAWS=1`).
    pub fn step_drawn_tokens(&self) -> u64 {
        self.step_drawn_tokens
    }

    fn slot(&self, v: ValueId) -> &CudaSlice<f32> {
        self.buf.slots[self.plan.slot(v)].as_ref().expect("slot is not held by a running op")
    }

    /// Staged 16-bit hand-offs (a GLU GEMM or attention writing the next projection's input)
    /// that forward passes enqueued, batched steps included (captures count, graph replays do
    /// not).
    pub fn staged_handoffs_run(&self) -> u64 {
        self.buf.staged_runs + self.paged.as_ref().map_or(0, |p| p.buf.staged_runs)
    }

    /// Batched decode steps launched from a captured CUDA graph since `init_paged`.
    pub fn batch_graph_replays(&self) -> u64 {
        self.paged.as_ref().map_or(0, |p| p.graphs.replays)
    }

    /// Batched steps enqueued ahead (`forward_paged_ahead`) that the next batch took, since
    /// `init_paged`.
    pub fn ahead_steps_taken(&self) -> u64 {
        self.paged.as_ref().map_or(0, |p| p.ahead_taken)
    }

    fn run_chunk(&mut self, ids: &[u32], start_pos: usize) -> anyhow::Result<()> {
        let n = ids.len();
        let positions: Vec<u32> = (start_pos..start_pos + n).map(|p| p as u32).collect();
        self.staging.copy(&self.gpu, ids, &mut self.buf.ids.slice_mut(0..n))?;
        self.staging.copy(&self.gpu, &positions, &mut self.buf.positions.slice_mut(0..n))?;
        self.launch_step(n, start_pos, false)
    }

    /// Enqueue a forward pass of the `n` tokens from `start_pos` whose ids and positions are in
    /// the device buffers: one-token steps replay the decode graph of their attention layout
    /// (captured at the second step of that layout). With `draws` (one token), the step ends
    /// with a greedy draw from its logits for the step after it ([`Self::launch_step_draw`]).
    fn launch_step(&mut self, n: usize, start_pos: usize, draws: bool) -> anyhow::Result<()> {
        self.last_rows = n;
        if n == 1 {
            self.buf.decode_stage = self.buf.decode.stage(start_pos + 1);
            let layout = self.buf.decode_stage as usize;
            let generation = self.gpu.scratch_generation();
            let kind = usize::from(draws);
            match &self.decode_graphs[kind][layout] {
                DecodeGraph::Ready(step) if step.scratch_generation == generation => {
                    return Ok(step.graph.launch().map_err(CudaError::from)?);
                }
                DecodeGraph::Ready(_) | DecodeGraph::NotYet { warmed_up: true } => match self.capture_ops(1, draws) {
                    Ok(Some(step)) => {
                        step.graph.launch().map_err(CudaError::from)?;
                        self.decode_graphs[kind][layout] = DecodeGraph::Ready(step);
                        return Ok(());
                    }
                    // The scratch moved while capturing: run eagerly, capture next time.
                    Ok(None) => self.decode_graphs[kind][layout] = DecodeGraph::NotYet { warmed_up: true },
                    Err(e) => {
                        // Explicit fallback: say why, then launch ops one by one from now on.
                        eprintln!("warning: decode graph capture failed, launching ops individually: {e:#}");
                        self.decode_graphs = std::array::from_fn(|_| std::array::from_fn(|_| DecodeGraph::Disabled));
                    }
                },
                DecodeGraph::NotYet { warmed_up: false } => self.decode_graphs[kind][layout] = DecodeGraph::NotYet { warmed_up: true },
                DecodeGraph::Disabled => {}
            }
        }
        self.run_ops(n)?;
        if draws {
            self.launch_step_draw()?;
        }
        Ok(())
    }

    /// The greedy draw that ends a one-token step: from the step's logits into the next step's
    /// inputs (at the step's position + 1, read on the device) and mailbox slot 1 + its parity.
    fn launch_step_draw(&mut self) -> Result<(), CudaError> {
        let g = &self.model.graph;
        let width = g.value(g.logits).width;
        let logits = self.buf.slots[self.plan.slot(g.logits)].as_ref().expect("logits slot");
        let next_step = Some((&mut self.buf.ids, &mut self.buf.positions));
        let delivery = ops::TokenDelivery { next_step, mail: ops::Mail::Advancing { mailbox: &self.mailbox, pair: STEP_DRAW_SLOTS } };
        ops::sample_delivering(&self.gpu, &logits.slice(0..width), width, &sampling_config(&DeviceSampling::GREEDY), 0, None, &mut self.buf.token, Some(delivery), self.sample_scratch.as_mut())
    }

    /// Checks a forward of `n` tokens at `start_pos` before anything is enqueued, and resets the
    /// recurrent state (in stream order) when the forward starts over.
    fn begin_forward(&mut self, n: usize, start_pos: usize) -> anyhow::Result<()> {
        if start_pos + n > self.options.context_len {
            bail!("prompt too long: {n} tokens at position {start_pos} exceed the context of {} tokens", self.options.context_len);
        }
        if self.model.graph.has_recurrent_state() && self.state_pos.begin(start_pos)? {
            // Before the first kernel of this forward (never part of the decode graph).
            for state in self.buf.gdn.iter_mut() {
                state.reset(&self.gpu)?;
            }
        }
        Ok(())
    }

    /// Draw a token from the current logits on the device; it reaches the host through the
    /// mailbox and, with `next_pos`, the next step's input buffers, and that step is enqueued
    /// before the host waits for the token. A greedy draw whose logits came from a step that
    /// drew itself (`drawn_ahead`; not with `FERRITE_DISABLE_CUDA_STEP_DRAWS=1`) launches
    /// nothing for the draw: the token is in the mailbox and the next step's inputs already.
    fn draw(&mut self, p: &DeviceSampling, next_pos: Option<usize>) -> anyhow::Result<u32> {
        let greedy = p.is_greedy();
        let drawn = self.drawn_ahead.take().filter(|&at| greedy && next_pos.is_none_or(|pos| pos == at));
        if let Some(pos) = next_pos {
            self.begin_forward(1, pos)?;
        }
        let g = &self.model.graph;
        let width = g.value(g.logits).width;
        let (slot, want_tag) = match drawn {
            Some(at) => {
                self.step_drawn_tokens += 1;
                (STEP_DRAW_SLOTS + at % 2, at as u32)
            }
            None => {
                let logits = self.buf.slots[self.plan.slot(g.logits)].as_ref().expect("logits slot");
                let cfg = sampling_config(p);
                self.mail_tag = self.mail_tag.wrapping_add(1);
                let next_step = next_pos.map(|_| (&mut self.buf.ids, &mut self.buf.positions));
                let mail = ops::Mail::Tagged { mailbox: &self.mailbox, slot: 0, tag: self.mail_tag, next_pos: next_pos.unwrap_or(0) as u32 };
                let delivery = ops::TokenDelivery { next_step, mail };
                let scratch = self.sample_scratch.as_mut();
                ops::sample_delivering(&self.gpu, &logits.slice(0..width), width, &cfg, p.step, None, &mut self.buf.token, Some(delivery), scratch)?;
                self.mailbox.post(&self.gpu, 0)?;
                (0, self.mail_tag)
            }
        };
        if let Some(pos) = next_pos {
            let draws = self.step_draws && greedy;
            let stepped = self.launch_step(1, pos, draws);
            self.state_pos.finish(pos + 1);
            stepped?;
            if draws {
                self.mailbox.post(&self.gpu, 1 + (pos + 1) % 2)?;
                self.drawn_ahead = Some(pos + 1);
            }
        }
        let [token, flag, _, tag] = self.mailbox.read(slot)?;
        if flag != 0 {
            self.gpu.check_device()?;
        }
        if tag != want_tag {
            bail!("the device sampler delivered no token (mailbox slot {slot} tag {tag}, expected {want_tag})");
        }
        if token as usize >= width {
            bail!("the device sampler drew token id {token}, outside the vocabulary ({width})");
        }
        Ok(token)
    }

    /// Record the op sequence of an `n`-row step into a graph (capture enqueues nothing).
    /// `None` when the GEMM scratch moved meanwhile: the graph would hold a freed address.
    fn capture_ops(&mut self, n: usize, draws: bool) -> anyhow::Result<Option<CapturedStep>> {
        let stream = Arc::clone(self.gpu.stream());
        let scratch_generation = self.gpu.scratch_generation();
        stream.begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED).map_err(CudaError::from)?;
        let recorded = match self.run_ops(n) {
            Ok(()) if draws => self.launch_step_draw().map_err(anyhow::Error::from),
            other => other,
        };
        // End the capture even when an op failed, so the stream is usable again.
        let graph = stream.end_capture(CUgraphInstantiate_flags::CUDA_GRAPH_INSTANTIATE_FLAG_USE_NODE_PRIORITY).map_err(CudaError::from);
        recorded.with_context(|| format!("capturing a {n}-row step as a CUDA graph"))?;
        let graph = graph?.ok_or_else(|| anyhow!("capturing a {n}-row step produced no CUDA graph"))?;
        Ok((self.gpu.scratch_generation() == scratch_generation).then_some(CapturedStep { graph, scratch_generation }))
    }

    /// Enqueue a batched decode step of `key.0` sequences (the paged buffers swapped in):
    /// replayed from its graph where one is ready, else launched op by op (and captured the
    /// second time its shape runs).
    fn launch_batch_decode(&mut self, graphs: &mut BatchGraphs, key: (usize, usize)) -> anyhow::Result<()> {
        let n = key.0;
        if !graphs.enabled {
            return self.run_ops(n);
        }
        graphs.clock += 1;
        let generation = self.gpu.scratch_generation();
        match graphs.shapes.get_mut(&key) {
            Some(BatchGraph::Ready { step, last_used }) if step.scratch_generation == generation => {
                *last_used = graphs.clock;
                graphs.replays += 1;
                return Ok(step.graph.launch().map_err(CudaError::from)?);
            }
            None => {
                graphs.shapes.insert(key, BatchGraph::Seen);
                return self.run_ops(n);
            }
            Some(_) => {}
        }
        match self.capture_ops(n, false) {
            Ok(Some(step)) => {
                step.graph.launch().map_err(CudaError::from)?;
                graphs.replays += 1;
                graphs.shapes.insert(key, BatchGraph::Ready { step, last_used: graphs.clock });
                graphs.evict();
                Ok(())
            }
            Ok(None) => {
                graphs.shapes.insert(key, BatchGraph::Seen);
                self.run_ops(n)
            }
            Err(e) => {
                eprintln!("warning: batched step graph capture failed, launching ops individually from now on: {e:#}");
                graphs.enabled = false;
                graphs.shapes.clear();
                self.run_ops(n)
            }
        }
    }

    /// Enqueue every op of the graph for a batch of `n` tokens whose ids and positions are in
    /// the device buffers.
    fn run_ops(&mut self, n: usize) -> anyhow::Result<()> {
        let stream = Arc::clone(self.gpu.stream());
        let model = Arc::clone(&self.model);
        let timing = Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT);
        let mut events = Vec::new();
        self.plan_handoffs(n);
        self.plan_mlps(n);
        self.plan_row_spreads(n);
        self.plan_early_releases(n);
        self.buf.staged_runs += self.buf.staged_out.iter().flatten().count() as u64;
        let mut fused_until = 0;
        for (i, op) in model.graph.ops.iter().enumerate() {
            if i < fused_until {
                continue;
            }
            let start = match self.buf.profile {
                Some(_) => Some(stream.record_event(timing).map_err(CudaError::from)?),
                None => None,
            };
            if self.buf.mlp_fused[i] {
                self.run_mlp(i).with_context(|| format!("fused MLP of ops {i}..{}", i + 2))?;
                fused_until = i + 2;
                if let Some(start) = start {
                    events.push(("fused mlp".to_string(), start, stream.record_event(timing).map_err(CudaError::from)?));
                }
                continue;
            }
            if self.buf.copy_skipped[i] {
                continue;
            }
            let out_slot = self.plan.slot(self.buf.writes_into[i].unwrap_or(op.writes()));
            let mut out = self.buf.slots[out_slot].take().expect("slot in use");
            let result = self.run_op(i, op, &mut out, n);
            self.buf.slots[out_slot] = Some(out);
            result.with_context(|| format!("op {} writing `{}`", op.kind(), model.graph.value(op.writes()).name))?;
            if let Some(start) = start {
                // Kind and written value without the layer prefix ("linear attn_out"): the
                // projections of a layer that share a kind stay apart; so do batch sizes (a
                // server's prefill chunks and its decode steps take different kernels).
                let name = &model.graph.value(op.writes()).name;
                let role = name.strip_prefix("blk.").and_then(|s| s.split_once('.')).map_or(name.as_str(), |(_, r)| r);
                let rows = if n > 1 { format!(" [{n} rows]") } else { String::new() };
                events.push((format!("{} {role}{rows}", op.kind()), start, stream.record_event(timing).map_err(CudaError::from)?));
            }
        }
        if let Some(profile) = self.buf.profile.as_mut() {
            stream.synchronize().map_err(CudaError::from)?;
            for (kind, a, b) in events {
                profile.add(&kind, a.elapsed_ms(&b).map_err(CudaError::from)? as f64);
            }
            profile.end_forward();
        }
        Ok(())
    }

    /// Whether a forward of `n` rows is one untraced token outside batched serving: the batches
    /// whose fused launches may leave values inside them unwritten.
    fn untraced_one_row(&self, n: usize) -> bool {
        n == 1 && self.buf.paging.is_none() && !self.options.trace
    }

    /// Which of the graph's int8 hand-offs run for a batch of `n`: those whose consumer takes
    /// the int8 GEMV and whose producer can quantize its output there (attention always; a
    /// linear when it is an int8 GEMV too and its output is whole 32-value blocks). The others
    /// fall back to the consumer's own quantize launch.
    fn plan_handoffs(&mut self, n: usize) {
        let graph = &self.model.graph;
        let opts = self.gpu.linear_options();
        let matrix = |w: WeightId| as_matrix(&self.weights[w.0 as usize]);
        let runs_int8 = |op: &Op| match *op {
            Op::Linear { w, x, .. } | Op::GatedLinear { w, x, .. } => takes_int8_gemv(&self.weights, graph, &opts, w, x, n),
            _ => false,
        };
        self.buf.handoff_in.iter_mut().chain(self.buf.handoff_out.iter_mut()).for_each(|h| *h = None);
        self.buf.copy_skipped.iter_mut().for_each(|s| *s = false);
        // A hand-off through the copy of the last row holds when that row is the whole batch
        // (and the copy's output is not traced).
        let one_row = self.untraced_one_row(n);
        for (i, h) in graph.handoffs.iter().enumerate() {
            if h.last_row.is_some() && !one_row {
                continue;
            }
            let producer = &graph.ops[h.producer];
            let emits = match producer {
                Op::Attention { .. } => graph.attention.head_dim.is_multiple_of(32),
                _ => runs_int8(producer) && graph.value(producer.writes()).width.is_multiple_of(32),
            };
            if emits && runs_int8(&graph.ops[h.consumer]) {
                self.buf.handoff_out[h.producer] = Some(i);
                self.buf.handoff_in[h.consumer] = Some(i);
                if let Some(copy) = h.last_row {
                    self.buf.copy_skipped[copy] = true;
                }
            }
        }
        // 16-bit staged hand-offs: a gated linear whose GLU runs in the warpgroup-MMA GEMM's
        // epilogue writes its output straight in the layout of its only reader, a plain whole
        // linear on that GEMM (no norm, no bias), which then converts nothing.
        self.buf.staged_out.iter_mut().for_each(|s| *s = None);
        self.buf.staged_in.iter_mut().for_each(|s| *s = false);
        if self.options.trace || !opts.staged_handoff {
            return;
        }
        // Likewise attention (its kernels copy their output rows as 16-bit) for an output
        // projection on cuBLAS.
        for h in &graph.handoffs {
            let Op::Linear { x, w, norm: None, bias: None, out_col: 0, out, .. } = &graph.ops[h.consumer] else { continue };
            let Some(w) = matrix(*w) else { continue };
            let rows = graph.value(*x).rows_for(n, 1);
            let only_reader = graph.ops.iter().filter(|op| op.reads().contains(x)).count() == 1;
            if !only_reader || w.rows != graph.value(*out).width || self.buf.handoff_in[h.consumer].is_some() {
                continue;
            }
            let layout = ops::StagedActivations::layout_for(&self.gpu, w, rows, &opts).filter(|l| l.precision == opts.precision && self.buf.staged.fits(l));
            let Some(layout) = layout else { continue };
            let producer_writes_it = match &graph.ops[h.producer] {
                Op::GatedLinear { w: gate_up, x: gx, .. } => matrix(*gate_up).is_some_and(|gu| {
                    matches!(layout.order, MmaOrder::Wgmma { .. })
                        && layout.cols == gu.rows / 2
                        && graph.value(*gx).rows_for(n, 1) == rows
                        && ops::glu_fuses(&self.gpu, gu, rows, &opts)
                }),
                Op::Attention { .. } => layout.order == MmaOrder::Natural,
                _ => false,
            };
            if producer_writes_it {
                self.buf.staged_out[h.producer] = Some(layout);
                self.buf.staged_in[h.consumer] = true;
            }
        }
    }

    /// Which decoder layers run their MLP as one launch for a batch of `n` (see `mlp_refusal`):
    /// in untraced one-token steps, where the MLP's input is its output projection's int8
    /// hand-off, that projection's output may take the layer output's buffer (not the
    /// attention output's, unless the attention hands its output over in int8 too), and the op
    /// after the layer takes the int8 GEMV (it quantizes the f32 row itself; the down
    /// projection's hand-off to it is dropped).
    fn plan_mlps(&mut self, n: usize) {
        self.buf.mlp_fused.iter_mut().chain(self.buf.f32_row_in.iter_mut()).for_each(|m| *m = false);
        self.buf.writes_into.iter_mut().for_each(|w| *w = None);
        if !self.untraced_one_row(n) {
            return;
        }
        let graph = &self.model.graph;
        let opts = self.gpu.linear_options();
        for layer in &graph.layers {
            let f = layer.first;
            if !self.buf.mlp_layer[f] {
                continue;
            }
            let Some([_, _, att, _, _, out]) = ferrite_model::fusion::decoder_layer_at(graph, f) else { continue };
            let Op::Linear { x, w, .. } = graph.ops[f + DecoderLayer::LEN] else { continue };
            let next_int8 = takes_int8_gemv(&self.weights, graph, &opts, w, x, 1);
            let shares_att = self.plan.slot(out) == self.plan.slot(att) && self.buf.handoff_in[f + 2].is_none();
            if self.buf.handoff_in[f + 3].is_none() || shares_att || !next_int8 {
                continue;
            }
            self.buf.mlp_fused[f + 3] = true;
            self.buf.writes_into[f + 2] = Some(out);
            self.buf.f32_row_in[f + DecoderLayer::LEN] = true;
            // The gate/up -> down and down -> next hand-offs do not run.
            for i in [f + 4, f + DecoderLayer::LEN] {
                self.buf.handoff_in[i] = None;
                self.buf.handoff_out[i - 1] = None;
            }
        }
    }

    /// Which int8 hand-offs of a one-token step give way to f32 rows (`row_spread_handoffs`):
    /// the producer writes its f32 row on twice as many blocks, and the consumer quantizes the
    /// row itself (`f32_row_in`, as after a fused MLP). Not with `FERRITE_DISABLE_CUDA_SPREAD_ROWS=1`
    /// (`LinearOptions::spread_rows`, which `ops::gemv_spreads_rows` checks).
    fn plan_row_spreads(&mut self, n: usize) {
        if !self.untraced_one_row(n) {
            return;
        }
        let graph = &self.model.graph;
        let spreads = |w: WeightId| as_matrix(&self.weights[w.0 as usize]).is_some_and(|m| ops::gemv_spreads_rows(&self.gpu, m));
        for i in row_spread_handoffs(graph, &self.buf.handoff_out, spreads) {
            let h = &graph.handoffs[i];
            self.buf.handoff_out[h.producer] = None;
            self.buf.handoff_in[h.consumer] = None;
            self.buf.f32_row_in[h.consumer] = true;
        }
    }

    /// Which int8 GEMVs of a one-token step let the next launch be scheduled before they wait
    /// (`Epilogue::early_release`; see [`early_release_ops`]). Measured on the H100 (tg128,
    /// docs/perf.md stop 44): SmolLM2 +2.7%, Gemma 3 270M +5.4%, 1B +0.9%, 8B +0.4%.
    fn plan_early_releases(&mut self, n: usize) {
        self.buf.early_release.iter_mut().for_each(|e| *e = false);
        if n != 1 || !self.buf.early_release_on {
            return;
        }
        let graph = &self.model.graph;
        let opts = self.gpu.linear_options();
        let alone = |i: usize| {
            let Op::Linear { x, w, .. } = graph.ops[i] else { return false };
            takes_int8_gemv(&self.weights, graph, &opts, w, x, 1) && !self.buf.copy_skipped[i]
        };
        self.buf.early_release = early_release_ops(graph, alone);
    }

    /// Enqueue the gate/up op `index` and the down projection after it (planned by
    /// `plan_mlps`) as one launch, adding into the down projection's output, which its
    /// residual's producer wrote there.
    fn run_mlp(&mut self, index: usize) -> anyhow::Result<()> {
        let graph = &self.model.graph;
        let (Op::GatedLinear { w: gate_up, act, .. }, Op::Linear { w: down, out, .. }) = (&graph.ops[index], &graph.ops[index + 1]) else {
            bail!("op {index}: not a gate/up and down projection");
        };
        let glu = glu_of(*act);
        let h = self.buf.handoff_in[index].ok_or_else(|| anyhow!("op {index}: the fused MLP has no int8 hand-off"))?;
        let Self { gpu, weights, plan, buf, .. } = self;
        let slot = plan.slot(*out);
        let mut stream = buf.slots[slot].take().expect("slot in use");
        let result = ops::mlp_q8(gpu, matrix_of(weights, *gate_up), matrix_of(weights, *down), &buf.q8_handoff[h % 2], glu, &mut stream);
        buf.slots[slot] = Some(stream);
        Ok(result?)
    }

    fn run_op(&mut self, index: usize, op: &Op, out: &mut CudaSlice<f32>, n: usize) -> anyhow::Result<()> {
        let graph = &self.model.graph;
        let width = |v: ValueId| graph.value(v).width;
        let n_seqs = self.buf.paging.as_ref().map_or(1, |pg| pg.n_seqs);
        let rows = |v: ValueId| graph.value(v).rows_for(n, n_seqs);
        let Self { gpu, weights, plan, buf, .. } = self;
        let gpu = &*gpu;
        let matrix = |id: WeightId| matrix_of(weights, id);
        let vector = |id: WeightId| vector_of(weights, id);
        let slots = &buf.slots;
        let input = |v: ValueId| slots[plan.slot(v)].as_ref().expect("an op's input never shares its output's slot");
        let norm_prologue = |nm: NormSpec| ops::NormPrologue { weight: vector(nm.weight), eps: nm.eps, add_one: false };
        // The norm of the linear that consumes this op's int8 hand-off.
        let handoff_norm = |producer: usize| {
            let h = graph.handoffs.iter().find(|h| h.producer == producer)?;
            match graph.ops[h.consumer] {
                Op::Linear { norm, .. } | Op::GatedLinear { norm, .. } => norm,
                _ => None,
            }
        };
        match *op {
            Op::Embed { table, scale, .. } => ops::embed_scaled(gpu, matrix(table), &buf.ids, n, scale, out)?,
            Op::RmsNorm { x, norm, residual: None, .. } => ops::rms_norm(gpu, input(x), vector(norm.weight), norm.eps, rows(x), width(x), false, out)?,
            Op::RmsNorm { x, norm, residual: Some(res), .. } => {
                ops::rms_norm_add(gpu, input(x), vector(norm.weight), norm.eps, input(res), rows(x), width(x), out)?
            }
            Op::Linear { x, norm, w, bias, residual, out_col, .. }
                if ops::linear_plan(matrix(w).dtype, width(x), rows(x), &gpu.linear_options()) == ops::LinearPlan::GemvQ8 =>
            {
                // The input quantized (+ normalised) by its producer or by a launch of its own;
                // one launch multiplies, adds bias and residual, and may quantize for the next.
                let (r, xw, ow) = (rows(x), width(x), width(op.writes()));
                let (q8, quantize, emit) = q8_buffers(&mut buf.q8, &mut buf.q8_handoff, buf.handoff_in[index], buf.handoff_out[index]);
                // The residual in the output's own buffer: an output projection writing the
                // layer's output before a fused MLP (`plan_mlps`), whose input shares it.
                let in_place = residual.is_some_and(|r| buf.writes_into[index].is_some_and(|o| plan.slot(o) == plan.slot(r)));
                let residual = if in_place { None } else { residual.map(input) };
                let epilogue = ops::Epilogue { bias: bias.map(vector), residual, accumulate: in_place, early_release: buf.early_release[index], ..Default::default() };
                let emit = emit.map(|dst| ops::Q8Emit { dst, norm: handoff_norm(index).map(norm_prologue) });
                if buf.f32_row_in[index] {
                    // After a fused MLP (`plan_mlps`): one row, quantized by the GEMV's blocks.
                    ops::linear_q8_f32_row(gpu, matrix(w), input(x), norm.map(norm_prologue), out, ow, out_col, &epilogue, emit)?;
                } else {
                    if quantize {
                        ops::quantize_q8(gpu, input(x), r, xw, norm.map(norm_prologue), q8)?;
                    }
                    ops::linear_q8(gpu, matrix(w), q8, r, out, ow, out_col, &epilogue, emit)?;
                }
            }
            Op::Linear { x, w, residual, .. } if buf.staged_in[index] => {
                // Its input was staged by its producer (`plan_handoffs`).
                ops::linear_staged(gpu, matrix(w), &buf.staged, rows(x), residual.map(input), out, &gpu.linear_options())?;
            }
            Op::Linear { x, norm, w, bias, residual, out_col, .. } => {
                let (r, ow) = (rows(x), width(op.writes()));
                let rows_w = matrix(w).rows;
                let opts = gpu.linear_options();
                // Norm and residual in the linear's own paths where it writes the whole output
                // (the residual only without a bias: bias first, as the graph declares).
                let whole = out_col == 0 && rows_w == ow;
                let fused_residual = if whole && bias.is_none() { residual.map(input) } else { None };
                let fusion = ops::LinearFusion { norm: norm.map(norm_prologue), residual: fused_residual, glu: None };
                if whole {
                    ops::linear_fused(gpu, matrix(w), input(x), &fusion, r, out, &mut buf.scratch_a, &opts)?;
                } else if r == 1 {
                    let dst = &mut out.slice_mut(out_col..out_col + rows_w);
                    ops::linear_fused(gpu, matrix(w), input(x), &fusion, 1, dst, &mut buf.scratch_a, &opts)?;
                } else {
                    ops::linear_fused(gpu, matrix(w), input(x), &fusion, r, &mut buf.scratch_b, &mut buf.scratch_a, &opts)?;
                    ops::copy_cols(gpu, &buf.scratch_b, rows_w, 0, out, ow, out_col, rows_w, r)?;
                }
                if let Some(b) = bias {
                    ops::add_rows(gpu, out, ow, out_col, vector(b), rows_w, r)?;
                }
                if let (Some(res), None) = (residual, fused_residual) {
                    ops::add(gpu, out, input(res), r * ow)?;
                }
            }
            Op::Rope { x, col, n_heads, ref rope } => {
                let cfg = rope_config(rope, n_heads, graph.attention.head_dim);
                let (w, span) = (width(x), n_heads * cfg.head_dim);
                if n == 1 {
                    ops::rope(gpu, &mut out.slice_mut(col..col + span), &buf.positions, 1, &cfg)?;
                } else {
                    ops::copy_cols(gpu, out, w, col, &mut buf.scratch_b, span, 0, span, n)?;
                    ops::rope(gpu, &mut buf.scratch_b, &buf.positions, n, &cfg)?;
                    ops::copy_cols(gpu, &buf.scratch_b, span, 0, out, w, col, span, n)?;
                }
            }
            Op::HeadNorm { x, col, n_heads, norm } => {
                // In place on x's buffer (`out`).
                ops::head_norm(gpu, out, width(x), col, n, n_heads, graph.attention.head_dim, vector(norm.weight), norm.eps)?;
            }
            Op::Attention { layer, qkv, window, ref rope, qk_norm, .. } => {
                let a = graph.attention;
                let cfg = AttentionConfig { n_heads: a.n_heads, scale: a.scale, window, softcap: None };
                let rope = rope.as_ref().map(|r| rope_config(r, a.n_heads, a.head_dim));
                let qk_norm = qk_norm.map(|n| ops::QkNorm { q: vector(n.q.weight), k: vector(n.k.weight), q_eps: n.q.eps, k_eps: n.k.eps });
                let qk_norm = qk_norm.as_ref();
                let cache = &mut buf.kv[layer];
                // The output projection takes no norm: the int8 hand-off is the plain
                // quantization; a staged one is the 16-bit copy of the rows.
                let emit = match (buf.handoff_out[index], buf.staged_out[index]) {
                    (Some(h), _) => Some(ops::AttentionEmit::Q8(&mut buf.q8_handoff[h % 2])),
                    (None, Some(layout)) => Some(ops::AttentionEmit::Staged(&mut buf.staged, layout)),
                    (None, None) => None,
                };
                if let Some(pg) = &buf.paging {
                    // A batched step: every row finds its cache rows through its sequence's blocks.
                    let paging =
                        ops::Paging { tables: &pg.tables, row_seq: &pg.row_seq, n_seqs: pg.n_seqs, max_blocks: pg.max_blocks, block_size: pg.block_size };
                    let (qkv, stride) = (input(qkv), width(qkv));
                    let decode = n == pg.n_seqs && n <= ops::FUSED_PAGED_STORE_MAX_SEQS;
                    if buf.fused_kv_store && decode && stride == (a.n_heads + 2 * cache.n_kv_heads) * a.head_dim {
                        // A decode step: each row stores its own K/V inside its attention.
                        ops::store_and_attend_paged(gpu, cache, qkv, n, &buf.positions, &cfg, rope.as_ref(), qk_norm, &paging, out, emit)?;
                        return Ok(());
                    }
                    ops::store_qkv_paged(gpu, cache, qkv, stride, n, a.n_heads, &buf.positions, rope.as_ref(), qk_norm, &paging, &mut buf.scratch_a)?;
                    let q = buf.scratch_a.slice(0..n * a.n_heads * a.head_dim);
                    ops::attention_paged(gpu, &q, cache, &buf.positions, n, &cfg, &paging, out, emit)?;
                    return Ok(());
                }
                if n == 1 && buf.fused_kv_store {
                    // Decode: one kernel stores the token's K/V and attends.
                    let layout = buf.decode.layout(buf.decode_stage);
                    let scratch = (layout.splits > 1 && !layout.cluster).then_some(&mut buf.split_scratch);
                    ops::store_and_attend(gpu, cache, input(qkv), &buf.positions, &cfg, rope.as_ref(), qk_norm, layout, scratch, out, emit)?;
                    return Ok(());
                }
                // One kernel splits the rows: rotated Q to scratch, rotated K and V into the cache.
                ops::store_qkv(gpu, cache, input(qkv), width(qkv), n, a.n_heads, &buf.positions, rope.as_ref(), qk_norm, &mut buf.scratch_a)?;
                let q = buf.scratch_a.slice(0..n * a.n_heads * a.head_dim);
                match buf.attention_splits[n] {
                    1 => ops::attention(gpu, &q, cache, &buf.positions, n, &cfg, out, emit)?,
                    splits => ops::attention_split(gpu, &q, cache, &buf.positions, n, &cfg, splits, &mut buf.split_scratch, out, emit)?,
                }
            }
            Op::SwiGlu { x, .. } | Op::GeGlu { x, .. } => {
                let glu = if matches!(op, Op::SwiGlu { .. }) { ops::Glu::SwiGlu } else { ops::Glu::GeGlu };
                ops::glu_rows(gpu, input(x), rows(x), width(x) / 2, glu, out)?;
            }
            Op::GatedLinear { x, norm, w, act, .. } => {
                let glu = glu_of(act);
                let (r, xw, half) = (rows(x), width(x), width(op.writes()));
                if ops::linear_plan(matrix(w).dtype, xw, r, &gpu.linear_options()) == ops::LinearPlan::GemvQ8 {
                    // Quantized (+ norm) input, then one GEMV whose epilogue applies the activation.
                    let (q8, quantize, emit) = q8_buffers(&mut buf.q8, &mut buf.q8_handoff, buf.handoff_in[index], buf.handoff_out[index]);
                    if quantize {
                        ops::quantize_q8(gpu, input(x), r, xw, norm.map(norm_prologue), q8)?;
                    }
                    let epilogue = ops::Epilogue { glu: Some(glu), ..Default::default() };
                    let emit = emit.map(|dst| ops::Q8Emit { dst, norm: handoff_norm(index).map(norm_prologue) });
                    ops::linear_q8(gpu, matrix(w), q8, r, out, half, 0, &epilogue, emit)?;
                } else if let Some(layout) = buf.staged_out[index] {
                    // The GLU GEMM writes its consumer's staged input (`plan_handoffs`), not `out`.
                    ops::linear_glu_staged(gpu, matrix(w), input(x), norm.map(norm_prologue), glu, r, &mut buf.staged, layout, &gpu.linear_options())?;
                } else if ops::glu_fuses(gpu, matrix(w), r, &gpu.linear_options()) {
                    // The warpgroup-MMA GEMM pairs gate and up tiles and applies the activation.
                    let fusion = ops::LinearFusion { norm: norm.map(norm_prologue), residual: None, glu: Some(glu) };
                    ops::linear_fused(gpu, matrix(w), input(x), &fusion, r, out, &mut buf.scratch_a, &gpu.linear_options())?;
                } else {
                    // Other paths: the projection (its folded norm in its input path) into
                    // scratch, then the activation kernel.
                    let fusion = ops::LinearFusion { norm: norm.map(norm_prologue), residual: None, glu: None };
                    ops::linear_fused(gpu, matrix(w), input(x), &fusion, r, &mut buf.scratch_c, &mut buf.scratch_a, &gpu.linear_options())?;
                    ops::glu_rows(gpu, &buf.scratch_c, r, half, glu, out)?;
                }
            }
            Op::Add { a, b, .. } => {
                let len = rows(a) * width(a);
                ops::copy_cols(gpu, input(a), len, 0, out, len, 0, len, 1)?;
                ops::add(gpu, out, input(b), len)?;
            }
            Op::LastRow { x, .. } => {
                let w = width(x);
                // The batch as one row of n * w: the last token's w columns (of each sequence,
                // in a batched step) go to the output, one row per sequence.
                match &buf.paging {
                    // A decode step: every row is its sequence's last.
                    Some(pg) if pg.last_rows.iter().enumerate().all(|(i, &r)| i == r) => {
                        ops::copy_cols(gpu, input(x), n * w, 0, out, pg.n_seqs * w, 0, pg.n_seqs * w, 1)?;
                    }
                    Some(pg) => {
                        for (i, &r) in pg.last_rows.iter().enumerate() {
                            ops::copy_cols(gpu, input(x), n * w, r * w, out, pg.n_seqs * w, i * w, w, 1)?;
                        }
                    }
                    None => ops::copy_cols(gpu, input(x), n * w, (n - 1) * w, out, w, 0, w, 1)?,
                }
            }
            Op::SplitGatedQuery { x, n_heads, head_dim, .. } => {
                let heads = GatedQuery { n_heads, head_dim };
                ops::split_gated_query(gpu, input(x), width(x), heads, rows(x), out, width(op.writes()))?;
            }
            Op::SigmoidGate { x, gate, n_heads, head_dim, .. } => {
                let heads = GatedQuery { n_heads, head_dim };
                ops::sigmoid_gate(gpu, input(x), input(gate), width(gate), heads, rows(x), out)?;
            }
            Op::GatedDeltaNet { layer, x, conv, a_coef, dt_bias, norm, .. } => {
                let w = GdnWeights { conv: vector(conv), a_coef: vector(a_coef), dt_bias: vector(dt_bias), norm: vector(norm.weight), eps: norm.eps };
                match &buf.paging {
                    // Batched serving: each sequence on its own state slot.
                    Some(pg) => {
                        let batch = GdnBatch { seqs: &pg.gdn_seqs, seq_rows: &pg.gdn_rows, seq_slots: &pg.gdn_slots };
                        ops::gated_delta_net_batch(gpu, input(x), rows(x), &w, &mut buf.gdn[layer], &mut buf.scratch_a, out, &batch)?;
                    }
                    None => {
                        ops::gated_delta_net(gpu, input(x), rows(x), &w, &mut buf.gdn[layer], &mut buf.scratch_a, out)?;
                    }
                }
            }
            Op::MoeFfn { x, norm, router, gate_up, down, shared, moe, residual, .. } => {
                let (r, d) = (rows(x), width(x));
                // The normalised input in scratch_a: the router, the experts and the shared
                // expert's gate all read it.
                let xn = match norm {
                    Some(nm) => {
                        ops::rms_norm(gpu, input(x), vector(nm.weight), nm.eps, r, d, false, &mut buf.scratch_a)?;
                        &buf.scratch_a
                    }
                    None => input(x),
                };
                let w = ops::MoeWeights {
                    router: matrix(router),
                    gate_up: match gate_up {
                        ExpertGateUp::Fused(b) => ops::ExpertGateUp::Fused(matrix(b)),
                        ExpertGateUp::Split { gate, up } => ops::ExpertGateUp::Split { gate: matrix(gate), up: matrix(up) },
                    },
                    down: matrix(down),
                    shared: shared.map(|sh| ops::SharedExpert { gate: matrix(sh.gate), up: matrix(sh.up), down: matrix(sh.down), gate_inp: vector(sh.gate_inp) }),
                    top_k: moe.top_k,
                    norm_topk_prob: moe.norm_topk_prob,
                };
                let dims = w.check()?;
                let scratch = buf.moe.iter_mut().find(|m| m.dims() == dims).ok_or_else(|| anyhow!("no MoE scratch for {dims:?}"))?;
                ops::moe_ffn(gpu, &w, xn, r, residual.map(input), scratch, out, &gpu.linear_options())?;
            }
        }
        Ok(())
    }

    /// One batched step of `batch` and its outputs, or with `ahead` also the decode step after
    /// it (`forward_paged_ahead`). A batch that is the step enqueued ahead by the last call only
    /// samples its results.
    fn paged_step(&mut self, batch: &[SeqChunk<'_>], sample: &[Option<DeviceSampling>], ahead: Option<&[AheadSeq<'_>]>) -> anyhow::Result<Vec<PagedOutput>> {
        if sample.len() != batch.len() {
            bail!("{} sampling requests for a batch of {} sequences", sample.len(), batch.len());
        }
        // Batched steps swap their own buffers in: a draw after them starts afresh.
        self.drawn_ahead = None;
        if let Some(a) = ahead {
            if a.len() != batch.len() {
                bail!("{} sequences ahead for a batch of {}", a.len(), batch.len());
            }
            if sample.iter().any(Option::is_none) {
                bail!("decoding ahead needs every sequence's token drawn on the device");
            }
        }
        let Some(mut paged) = self.paged.take() else { bail!("forward_paged before init_paged") };
        let pending = paged.ahead.take();
        let recurrent = self.model.graph.has_recurrent_state();
        // A step ahead would advance recurrent states that a different next batch could not
        // rewind: models with them step one batch at a time.
        let ahead = if recurrent { None } else { ahead };
        let result = BatchRows::new(batch, &paged.config).and_then(|rows| {
            let decode = rows.ids.len() == batch.len();
            let (tables, max_blocks) = step_tables(batch.iter().map(|s| s.block_table), decode, paged.config.n_blocks);
            let ran = pending.is_some_and(|p| p.ids == rows.ids && p.positions == rows.positions && p.max_blocks == max_blocks && p.tables == tables);
            if ran {
                paged.ahead_taken += 1;
            } else {
                if recurrent {
                    self.begin_recurrent(&mut paged, batch, &rows)?;
                }
                self.run_paged(&mut paged, &rows, &tables, max_blocks, false)?;
            }
            self.paged_outputs(&mut paged, sample, ahead)
        });
        if result.is_err() {
            paged.ahead = None;
        } else if recurrent {
            batch.iter().for_each(|s| paged.cursors[s.state_slot].finish(s.start_pos + s.tokens.len()));
        }
        self.paged = Some(paged);
        result
    }

    /// Before a batched step of a model with Gated DeltaNet layers: every sequence starts its
    /// state slot over (position 0: zeroed, in stream order) or continues it exactly, checked for
    /// all before any change (the slots stay unusable until the step succeeds); then the step's
    /// rows and slots go to the device for the batched mixer.
    fn begin_recurrent(&mut self, paged: &mut PagedState, batch: &[SeqChunk<'_>], rows: &BatchRows) -> anyhow::Result<()> {
        let mut next = paged.cursors.clone();
        let resets = batch.iter().map(|s| next[s.state_slot].begin(s.start_pos).with_context(|| format!("state slot {}", s.state_slot))).collect::<anyhow::Result<Vec<bool>>>()?;
        paged.cursors = next;
        for (s, _) in batch.iter().zip(resets).filter(|(_, reset)| *reset) {
            for state in paged.buf.gdn.iter_mut() {
                state.reset_slot(&self.gpu, s.state_slot)?;
            }
        }
        let pg = paged.buf.paging.as_mut().expect("init_paged sets the paging buffers");
        pg.gdn_seqs = batch.iter().zip(&rows.seq_start).map(|(s, &first_row)| GdnSeq { first_row, n: s.tokens.len(), slot: s.state_slot }).collect();
        let (seq_rows, seq_slots) = GdnBatch::device_form(&pg.gdn_seqs);
        upload_if_changed(&mut self.staging, &self.gpu, &seq_rows, &mut pg.uploaded_gdn_rows, &mut pg.gdn_rows)?;
        upload_if_changed(&mut self.staging, &self.gpu, &seq_slots, &mut pg.uploaded_gdn_slots, &mut pg.gdn_slots)?;
        Ok(())
    }

    /// Enqueue one batched step on the paged cache: the step's rows and block tables go to the
    /// device (the token ids, with `drawn_ids`, from the tokens the last step drew instead: a
    /// decode step of the same sequences), the paged buffers are swapped in for the graph's ops,
    /// and the sequences' logits are left in the paged logits slot (`[n_seqs, vocab]`).
    fn run_paged(&mut self, paged: &mut PagedState, rows: &BatchRows, tables: &[u32], max_blocks: usize, drawn_ids: bool) -> anyhow::Result<()> {
        let n = rows.ids.len();
        let n_seqs = rows.seq_start.len() - 1;
        let decode = n == n_seqs;
        let buf = &mut paged.buf;
        let pg = buf.paging.as_mut().expect("init_paged sets the paging buffers");
        if drawn_ids {
            debug_assert!(decode);
            self.gpu.stream().memcpy_dtod(&paged.tokens.slice(0..n), &mut buf.ids.slice_mut(0..n)).map_err(CudaError::from)?;
        } else {
            self.staging.copy(&self.gpu, &rows.ids, &mut buf.ids.slice_mut(0..n))?;
        }
        self.staging.copy(&self.gpu, &rows.positions, &mut buf.positions.slice_mut(0..n))?;
        upload_if_changed(&mut self.staging, &self.gpu, &rows.row_seq, &mut pg.uploaded_row_seq, &mut pg.row_seq)?;
        upload_if_changed(&mut self.staging, &self.gpu, tables, &mut pg.uploaded_tables, &mut pg.tables)?;
        (pg.n_seqs, pg.max_blocks, pg.last_rows) = (n_seqs, max_blocks, rows.last_rows().collect());
        std::mem::swap(&mut self.buf, &mut paged.buf);
        std::mem::swap(&mut self.plan, &mut paged.plan);
        let result = if decode { self.launch_batch_decode(&mut paged.graphs, (n, max_blocks)) } else { self.run_ops(n) };
        std::mem::swap(&mut self.buf, &mut paged.buf);
        std::mem::swap(&mut self.plan, &mut paged.plan);
        result.context("batched forward pass")
    }

    /// After [`Self::run_paged`]: tokens drawn on the device for the sequences with a sampling
    /// request (greedy ones by one argmax launch over all rows), logits read back for the rest.
    /// With `ahead`, the next decode step is enqueued on the drawn tokens before they are read
    /// back (their copy to the host is enqueued first, so reading them waits for that copy only).
    fn paged_outputs(&mut self, paged: &mut PagedState, sample: &[Option<DeviceSampling>], ahead: Option<&[AheadSeq<'_>]>) -> anyhow::Result<Vec<PagedOutput>> {
        let g = &self.model.graph;
        let (w, logits_slot) = (g.value(g.logits).width, paged.plan.slot(g.logits));
        let n_seqs = sample.len();
        let logits = paged.buf.slots[logits_slot].as_ref().expect("logits slot");
        if sample.iter().all(Option::is_none) {
            let all = self.gpu.download(&logits.slice(0..n_seqs * w))?;
            self.gpu.check_device()?;
            return Ok(all.chunks(w).map(|l| PagedOutput::Logits(l.to_vec())).collect());
        }
        if sample.iter().flatten().any(DeviceSampling::is_greedy) {
            ops::argmax_rows(&self.gpu, &logits.slice(0..n_seqs * w), w, n_seqs, &mut paged.tokens)?;
        }
        let draws: Vec<ops::RowSample> = sample.iter().enumerate().filter_map(|(row, p)| p.filter(|p| !p.is_greedy()).map(|p| ops::RowSample { row, cfg: sampling_config(&p), step: p.step })).collect();
        if let Some((words, scratch)) = paged.row_draws.as_mut() {
            ops::sample_rows(&self.gpu, &mut self.staging, words, &logits.slice(0..n_seqs * w), w, n_seqs, &draws, &mut paged.tokens, scratch.as_mut())?;
        } else {
            for d in &draws {
                // One draw after another in stream order, so they share the candidate scratch.
                let (row, scratch) = (logits.slice(d.row * w..(d.row + 1) * w), self.sample_scratch.as_mut());
                ops::sample_delivering(&self.gpu, &row, w, &d.cfg, d.step, None, &mut paged.tokens.slice_mut(d.row..d.row + 1), None, scratch)?;
            }
        }
        let flag_at = paged.config.max_seqs;
        paged.readback.copy(&self.gpu, &paged.tokens.slice(0..n_seqs), 0)?;
        paged.readback.copy_error_flag(&self.gpu, flag_at)?;
        paged.readback.post(&self.gpu)?;
        if let Some(ahead) = ahead {
            // Placeholder ids: the step takes the drawn tokens.
            let one = [0u32];
            let next: Vec<SeqChunk> = ahead.iter().enumerate().map(|(i, a)| SeqChunk { tokens: &one, start_pos: a.start_pos, block_table: a.block_table, state_slot: i }).collect();
            let rows = BatchRows::new(&next, &paged.config)?;
            let (tables, max_blocks) = step_tables(ahead.iter().map(|a| a.block_table), true, paged.config.n_blocks);
            self.run_paged(paged, &rows, &tables, max_blocks, true)?;
            paged.ahead = Some(AheadStep { ids: Vec::new(), positions: rows.positions, tables, max_blocks });
        }
        let tokens = paged.readback.read(0..n_seqs)?;
        if paged.readback.read(flag_at..flag_at + 1)?[0] != 0 {
            self.gpu.check_device()?;
        }
        if let Some(a) = &mut paged.ahead {
            a.ids.clone_from(&tokens);
        }
        let logits = paged.buf.slots[logits_slot].as_ref().expect("logits slot");
        let out = sample
            .iter()
            .enumerate()
            .map(|(i, p)| match p {
                Some(_) => Ok(PagedOutput::Token(tokens[i])),
                None => Ok(PagedOutput::Logits(self.gpu.download(&logits.slice(i * w..(i + 1) * w))?)),
            })
            .collect::<Result<Vec<_>, CudaError>>()?;
        Ok(out)
    }

    fn logits_view(&self) -> (&CudaSlice<f32>, usize) {
        let g = &self.model.graph;
        (self.slot(g.logits), g.value(g.logits).width)
    }
}

impl Executor for CudaExecutor {
    fn describe(&self) -> String {
        let (maj, min) = self.gpu.compute_capability();
        format!("cuda: {} (sm_{maj}{min}, {} SMs), KV {:?}", self.gpu.name(), self.gpu.sm_count(), kv_dtype())
    }

    fn forward(&mut self, tokens: &[u32], start_pos: usize) -> anyhow::Result<()> {
        if tokens.is_empty() {
            bail!("forward called with no tokens");
        }
        let vocab = self.model.config.vocab_size;
        if let Some(bad) = tokens.iter().find(|&&t| t as usize >= vocab) {
            bail!("token id {bad} is outside the vocabulary ({vocab})");
        }
        self.drawn_ahead = None;
        self.begin_forward(tokens.len(), start_pos)?;
        let step = self.options.max_batch;
        for (i, chunk) in tokens.chunks(step).enumerate() {
            self.run_chunk(chunk, start_pos + i * step)?;
        }
        self.state_pos.finish(start_pos + tokens.len());
        Ok(())
    }

    fn has_recurrent_state(&self) -> bool {
        self.model.graph.has_recurrent_state()
    }

    fn logits(&mut self) -> anyhow::Result<Vec<f32>> {
        let (slot, width) = self.logits_view();
        let v = self.gpu.download(&slot.slice(0..width))?;
        self.gpu.check_device()?;
        Ok(v)
    }

    fn sample_on_device(&mut self, p: &DeviceSampling) -> Option<anyhow::Result<u32>> {
        Some(self.draw(p, None))
    }

    fn sample_and_step(&mut self, p: &DeviceSampling, next_pos: Option<usize>) -> Option<anyhow::Result<u32>> {
        Some(self.draw(p, next_pos))
    }

    fn traces(&mut self) -> anyhow::Result<Vec<LayerTrace>> {
        if !self.options.trace {
            bail!("this executor was created without tracing");
        }
        let g = &self.model.graph;
        let mut out = Vec::new();
        for (i, v) in g.values.iter().enumerate().filter(|(_, v)| v.traced) {
            let len = v.n_rows(self.last_rows) * v.width;
            let data = self.gpu.download(&self.slot(ValueId(i as u32)).slice(0..len))?;
            out.push(LayerTrace { name: v.name.clone(), width: v.width, data });
        }
        Ok(out)
    }

    fn context_len(&self) -> usize {
        self.options.context_len
    }

    fn kv_bytes_per_position(&self) -> usize {
        self.buf.kv.iter().map(|c| 2 * c.row_len() * c.dtype.bytes()).sum()
    }

    fn init_paged(&mut self, config: PagedKvConfig) -> anyhow::Result<()> {
        let PagedKvConfig { n_blocks, block_size, max_seqs, max_tokens, state_snapshots } = config;
        self.drawn_ahead = None;
        if n_blocks == 0 || block_size == 0 || max_seqs == 0 || max_tokens == 0 {
            bail!("paged kv cache: every size must be positive, got {config:?}");
        }
        let (graph, cfg) = (&self.model.graph, &self.model.config);
        self.paged = None; // free the old cache first
        let plan = planner::plan_rows(graph, max_tokens, max_seqs, true);
        plan.check(graph).map_err(|e| anyhow!("batch memory plan violates the aliasing rule: {e}"))?;
        let Some(cache_rows) = n_blocks.checked_mul(block_size) else { bail!("paged kv cache of {n_blocks} blocks x {block_size} is too large") };
        // Gated DeltaNet layers keep a recurrent state per sequence slot, and the snapshots of
        // the prefix cache in slots after those.
        let gdn_shapes = gdn_layers(graph);
        if state_snapshots > 0 && gdn_shapes.is_empty() {
            bail!("state snapshots asked for a model without recurrent layers");
        }
        let state_slots = max_seqs + state_snapshots;
        let state_bytes: usize = gdn_shapes.iter().map(|(_, s)| (s.conv_state_len() + s.ssm_state_len()) * 4 * state_slots).sum();
        let bytes = graph.attention_layers().len() * 2 * cache_rows * cfg.kv_width() * kv_dtype().bytes() + state_bytes;
        let (free, _) = self.gpu.mem_info()?;
        if bytes > free {
            bail!(
                "the paged KV cache ({n_blocks} blocks of {block_size}{}) needs {:.1} GiB but only {:.1} GiB of device memory is free (lower --kv-memory)",
                if state_bytes > 0 { format!(", and {state_slots} recurrent state slots") } else { String::new() },
                bytes as f64 / (1u64 << 30) as f64,
                free as f64 / (1u64 << 30) as f64
            );
        }
        let gdn = gdn_shapes.into_iter().map(|(l, shape)| GdnState::with_slots(&self.gpu, shape, state_slots).map(|st| (l, st))).collect::<Result<_, _>>()?;
        let kv = graph
            .attention_layers()
            .into_iter()
            .map(|l| KvCache::new(&self.gpu, kv_dtype(), cache_rows, cfg.n_kv_heads, cfg.head_dim).map(|c| (l, c)))
            .collect::<Result<_, _>>()?;
        // Batched steps attend without splitting the keys; decode steps (a token per sequence)
        // store K/V inside the attention kernel, steps with a prefill chunk with store_qkv.
        let unsplit = ops::DecodeLayouts::new(&self.gpu, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cache_rows, false);
        let mut buf = Buffers::new(&self.gpu, &self.model, &plan, max_tokens, kv, gdn, vec![1; max_tokens + 1], unsplit)?;
        buf.paging = Some(BatchPaging {
            tables: self.gpu.alloc_zeros(max_seqs * n_blocks)?,
            row_seq: self.gpu.alloc_zeros(max_tokens)?,
            n_seqs: 0,
            max_blocks: 0,
            block_size,
            last_rows: Vec::new(),
            uploaded_row_seq: Vec::new(),
            uploaded_tables: Vec::new(),
            gdn_seqs: Vec::new(),
            gdn_rows: self.gpu.alloc_zeros(max_seqs + 1)?,
            gdn_slots: self.gpu.alloc_zeros(max_seqs)?,
            uploaded_gdn_rows: Vec::new(),
            uploaded_gdn_slots: Vec::new(),
        });
        let tokens = self.gpu.alloc_zeros(max_seqs)?;
        let row_draws = if env::DISABLE_CUDA_ROW_DRAWS.flag() {
            None
        } else {
            let vocab = self.model.graph.value(self.model.graph.logits).width;
            let scratch = if env::DISABLE_SAMPLE_CANDIDATES.flag() { None } else { Some(ops::SampleScratch::for_draws(&self.gpu, vocab, max_seqs)?) };
            Some((self.gpu.alloc_zeros(max_seqs * ops::ROW_DRAW_WORDS)?, scratch))
        };
        let readback = Readback::new(&self.gpu, max_seqs + 2)?;
        let mut graphs = BatchGraphs::new();
        graphs.enabled &= buf.profile.is_none();
        self.paged = Some(PagedState { config, plan, buf, tokens, row_draws, readback, graphs, ahead: None, ahead_taken: 0, cursors: vec![RecurrentCursor::default(); state_slots] });
        Ok(())
    }

    fn copy_state(&mut self, from: usize, to: usize) -> anyhow::Result<()> {
        let Some(paged) = self.paged.as_mut() else { bail!("copy_state before init_paged") };
        RecurrentCursor::copy_slot(&self.model.graph, &mut paged.cursors, from, to)?;
        for state in paged.buf.gdn.iter_mut() {
            state.copy_slot(&self.gpu, from, to)?;
        }
        Ok(())
    }

    fn forward_paged(&mut self, batch: &[SeqChunk<'_>]) -> anyhow::Result<Vec<Vec<f32>>> {
        let outputs = self.forward_paged_sampled(batch, &vec![None; batch.len()])?;
        Ok(outputs.into_iter().map(|o| match o {
            PagedOutput::Logits(l) => l,
            PagedOutput::Token(_) => unreachable!("nothing was sampled"),
        }).collect())
    }

    /// A one-token forward, then the steps of a generation at positions 1-3: greedy ones that
    /// draw their successor inside their graph, then sampled ones after a separate draw (each
    /// kind runs eagerly once, then is captured), and the draws of the CLI's and an OpenAI
    /// request's defaults and of top-p alone, whose sampling kernels differ.
    fn warm_up(&mut self) -> anyhow::Result<()> {
        if self.options.trace || self.options.context_len < 4 {
            return Ok(());
        }
        let greedy = DeviceSampling::GREEDY;
        let temperature = DeviceSampling { temperature: 1.0, top_k: 0, ..greedy };
        self.forward(&[0], 0)?;
        for (pos, p) in [(1, greedy), (2, greedy), (3, temperature)] {
            self.draw(&p, Some(pos))?;
        }
        let cli = DeviceSampling { temperature: 0.8, top_k: 40, top_p: 0.95, min_p: 0.05, ..greedy };
        for p in [cli, temperature, DeviceSampling { top_p: 0.95, ..temperature }] {
            self.draw(&p, None)?;
        }
        self.drawn_ahead = None;
        Ok(())
    }

    /// One-token steps of 1 to `max_seqs` sequences at the batch sizes where the kernel tiling
    /// changes (int8 GEMV tiles, small-batch GEMM tiles, device argmax), then one full prefill
    /// chunk: NVRTC compiles (or loads from the disk cache) those variants now, not during the
    /// first requests.
    fn warm_up_paged(&mut self) -> anyhow::Result<()> {
        let Some(config) = self.paged.as_ref().map(|p| p.config) else { bail!("warm_up_paged before init_paged") };
        let greedy = DeviceSampling::GREEDY;
        let blocks: Vec<u32> = (0..config.n_blocks as u32).collect();
        let token = [0u32];
        let mut sizes: Vec<usize> = [1, 2, 4, 8, 16, 32, 64, config.max_seqs].into_iter().filter(|&n| n <= config.max_seqs.min(config.n_blocks)).collect();
        sizes.dedup();
        for n in sizes {
            let batch: Vec<SeqChunk> = blocks[..n].iter().enumerate().map(|(i, b)| SeqChunk { tokens: &token, start_pos: 0, block_table: std::slice::from_ref(b), state_slot: i }).collect();
            self.forward_paged_sampled(&batch, &vec![Some(greedy); n])?;
        }
        let len = config.max_tokens.min(config.n_blocks * config.block_size).min(self.model.config.context_length);
        if len > 0 {
            let tokens = vec![0u32; len];
            let table = &blocks[..len.div_ceil(config.block_size)];
            self.forward_paged_sampled(&[SeqChunk { tokens: &tokens, start_pos: 0, block_table: table, state_slot: 0 }], &[Some(greedy)])?;
        }
        Ok(())
    }

    fn forward_paged_sampled(&mut self, batch: &[SeqChunk<'_>], sample: &[Option<DeviceSampling>]) -> anyhow::Result<Vec<PagedOutput>> {
        self.paged_step(batch, sample, None)
    }

    fn forward_paged_ahead(&mut self, batch: &[SeqChunk<'_>], sample: &[Option<DeviceSampling>], ahead: &[AheadSeq<'_>]) -> anyhow::Result<Vec<PagedOutput>> {
        self.paged_step(batch, sample, Some(ahead))
    }

    fn profiler_range(&mut self, on: bool) -> anyhow::Result<()> {
        let result = if on { cudarc::driver::profiler_start() } else { cudarc::driver::profiler_stop() };
        result.map_err(CudaError::from).context(if on { "starting the profiler range" } else { "stopping the profiler range" })
    }

    fn hardware_ceilings(&mut self) -> Option<anyhow::Result<HardwareCeilings>> {
        Some(crate::ceilings::measure(&self.gpu).map_err(Into::into))
    }

    fn memory_report(&self) -> String {
        let mib = |b: usize| b as f64 / 1048576.0;
        let weights: usize = self
            .weights
            .iter()
            .flatten()
            .map(|w| match w {
                GpuWeight::Matrix(m) => m.device_bytes(),
                GpuWeight::Vector(v) => v.len() * 4,
            })
            .sum();
        let kv: usize = self.buf.kv.iter().map(|c| 2 * c.max_seq * c.row_len() * c.dtype.bytes()).sum();
        let state: usize = self.buf.gdn.iter().map(GdnState::bytes).sum();
        let act = self.plan.total_elems() * 4 + 3 * self.buf.scratch_b.len() * 4 + self.buf.moe.iter().map(ops::MoeScratch::bytes).sum::<usize>();
        let (free, total) = self.gpu.mem_info().unwrap_or((0, 0));
        format!(
            "weights (repacked{}): {:.1} MiB\nkv cache ({:?}, {} tokens): {:.1} MiB\nrecurrent state (f32): {:.2} MiB\nactivations + scratch: {:.1} MiB\ndevice: {:.1} GiB free of {:.1} GiB",
            if self.expanded > 0 { format!(", with {:.1} MiB of GEMM-type copies for prefill", mib(self.expanded)) } else { String::new() },
            mib(weights),
            kv_dtype(),
            self.options.context_len,
            mib(kv),
            mib(state),
            mib(act),
            free as f64 / (1u64 << 30) as f64,
            total as f64 / (1u64 << 30) as f64
        )
    }
}

impl Drop for CudaExecutor {
    fn drop(&mut self) {
        if let Some(p) = &self.buf.profile {
            eprint!("{}", p.report(&self.describe()));
        }
        if let Some(p) = self.paged.as_ref().and_then(|p| p.buf.profile.as_ref()) {
            eprint!("{}", p.report(&format!("{}, batched steps", self.describe())));
        }
    }
}

/// The linears of `graph` that release the next launch before their wait in a one-token step:
/// those that run as one int8 GEMV launch of their own (`alone`) and feed an attention op (the
/// QKV projection) or read its output (the output projection). Their neighbours (attention, the
/// MLP's first launch) release after their wait, so that the attention and the MLP get resident
/// and request their cached rows and weights one kernel sooner. Never two such launches in a
/// row: when a kernel starts, every launch before its predecessor's predecessor has finished
/// (what it may read before its wait).
fn early_release_ops(graph: &Graph, alone: impl Fn(usize) -> bool) -> Vec<bool> {
    let mut early = vec![false; graph.ops.len()];
    for (i, op) in graph.ops.iter().enumerate() {
        let Op::Linear { x, out, .. } = *op else { continue };
        let into_attention = matches!(graph.ops.get(i + 1), Some(Op::Attention { qkv, .. }) if *qkv == out);
        let out_of_attention = i > 0 && matches!(graph.ops[i - 1], Op::Attention { out: att, .. } if att == x);
        let after_early = i > 0 && early[i - 1];
        early[i] = (into_attention || out_of_attention) && !after_early && alone(i);
    }
    early
}

/// The running int8 hand-offs (`running`: the hand-off each op produces) from a linear whose
/// weight spreads its rows without one (`spreads`: the 1B shape's down projection, whose 32-row
/// blocks would leave half the SMs idle) to another linear, which can quantize an f32 row itself.
/// Not those through the copy of the last row (the head's input).
fn row_spread_handoffs(graph: &Graph, running: &[Option<usize>], spreads: impl Fn(WeightId) -> bool) -> Vec<usize> {
    let linear_weight = |op: &Op| if let Op::Linear { w, .. } = *op { Some(w) } else { None };
    (0..graph.handoffs.len())
        .filter(|&i| {
            let h = &graph.handoffs[i];
            let from = linear_weight(&graph.ops[h.producer]);
            h.last_row.is_none() && running[h.producer] == Some(i) && linear_weight(&graph.ops[h.consumer]).is_some() && from.is_some_and(&spreads)
        })
        .collect()
}

/// The device sampler's settings for a draw.
fn sampling_config(p: &DeviceSampling) -> SamplingConfig {
    SamplingConfig { temperature: p.temperature, top_k: p.top_k, top_p: p.top_p, min_p: p.min_p, seed: p.seed }
}

fn rope_config(rope: &ferrite_model::RopeConfig, n_heads: usize, head_dim: usize) -> RopeConfig {
    RopeConfig {
        n_heads,
        head_dim,
        rot_dim: rope.rot_dim,
        theta: rope.theta,
        freq_scale: rope.freq_scale,
        neox: rope.style == RopeStyle::Neox,
    }
}

/// The kernels' gated activation for a graph's.
fn glu_of(act: GatedActivation) -> ops::Glu {
    match act {
        GatedActivation::Silu => ops::Glu::SwiGlu,
        GatedActivation::GeluTanh => ops::Glu::GeGlu,
    }
}

/// The int8 activations of a GEMV, whether it must quantize them itself first (no active
/// hand-off into it), and the hand-off buffer its epilogue fills (if it produces one). A GEMV
/// that consumes hand-off `c` and produces `c + 1` reads one buffer and writes the other.
fn q8_buffers<'a>(
    own: &'a mut ops::Q8Activations,
    handoff: &'a mut [ops::Q8Activations; 2],
    consumes: Option<usize>,
    produces: Option<usize>,
) -> (&'a mut ops::Q8Activations, bool, Option<&'a mut ops::Q8Activations>) {
    let [even, odd] = handoff;
    let by_parity = |h: usize, even, odd| if h.is_multiple_of(2) { (even, odd) } else { (odd, even) };
    match consumes {
        Some(c) => {
            debug_assert!(produces.is_none_or(|p| p % 2 != c % 2), "hand-offs {c} and {produces:?} share a buffer");
            let (read, other) = by_parity(c, even, odd);
            (read, false, produces.map(|_| other))
        }
        None => (own, true, produces.map(|p| by_parity(p, even, odd).0)),
    }
}

/// Dequantize the weights of the linears that see whole batches (their GEMMs run in prefill)
/// into resident copies of the GEMM input type, as `FERRITE_CUDA_EXPAND_WEIGHTS` says: `on`,
/// `off`, or `auto` (the default: when batches can reach the GEMM path and the copies fit in half
/// the free device memory). Returns the bytes expanded.
fn expand_batched_weights(gpu: &Gpu, graph: &ferrite_model::Graph, weights: &mut [Option<GpuWeight>], max_batch: usize) -> anyhow::Result<usize> {
    let opts = gpu.linear_options();
    let mut batched: Vec<WeightId> = graph
        .ops
        .iter()
        .filter_map(|o| match *o {
            Op::Linear { w, x, .. } | Op::GatedLinear { w, x, .. } if graph.value(x).rows == Rows::Tokens => Some(w),
            _ => None,
        })
        .collect();
    batched.sort_by_key(|w| w.0);
    batched.dedup();
    let gemm_precision = |m: &DeviceWeight| match ops::linear_plan(m.dtype, m.cols, max_batch, &opts) {
        ops::LinearPlan::Gemm { precision, dequantize_weight: true, .. } => Some(precision),
        _ => None,
    };
    let total: usize = batched
        .iter()
        .filter_map(|w| as_matrix(&weights[w.0 as usize]))
        .filter_map(|m| gemm_precision(m).map(|p| ops::expanded_bytes(m.dtype, m.rows, m.cols, p)))
        .sum();
    let expand = match env::CUDA_EXPAND_WEIGHTS.get().as_deref() {
        Some("on") => true,
        Some("off") => false,
        other => {
            if let Some(v) = other.filter(|v| *v != "auto") {
                eprintln!("warning: FERRITE_CUDA_EXPAND_WEIGHTS={v:?} is not auto, on or off; using auto");
            }
            total > 0 && total <= gpu.mem_info()?.0 / 2
        }
    };
    if !expand || total == 0 {
        return Ok(0);
    }
    for w in batched {
        if let Some(GpuWeight::Matrix(m)) = &mut weights[w.0 as usize] {
            if let Some(precision) = gemm_precision(m) {
                ops::expand_weight(gpu, m, precision).context("expanding prefill weights (FERRITE_CUDA_EXPAND_WEIGHTS=off avoids it)")?;
            }
        }
    }
    Ok(total)
}

/// Open the CUDA executor, or explain why there is no usable GPU.
pub fn open_executor(model: Arc<Model>, options: ExecutorOptions) -> anyhow::Result<Box<dyn Executor>> {
    // The model's needs first: the same answer on machines with and without a GPU.
    check_supported(&model.graph)?;
    crate::cuda_available()?;
    Ok(Box::new(CudaExecutor::new(model, options)?))
}

#[cfg(test)]
mod tests {
    use super::*;
    use ferrite_model::FusionOptions;

    fn tiny(name: &str) -> Model {
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/tiny").join(name);
        Model::load(&path, FusionOptions::default()).unwrap_or_else(|e| panic!("{name}: {e}"))
    }

    #[test]
    fn projections_around_attention_release_early_never_two_in_a_row() {
        for (name, gated) in [("llama.gguf", false), ("qwen3.gguf", false), ("gemma3.gguf", false), ("qwen35.gguf", true)] {
            let model = tiny(name);
            let graph = &model.graph;
            let early = early_release_ops(graph, |_| true);
            let attention: Vec<usize> = (0..graph.ops.len()).filter(|&i| matches!(graph.ops[i], Op::Attention { .. })).collect();
            assert!(!attention.is_empty(), "{name}");
            // Llama, Qwen3, Gemma 3: the QKV projection right before each attention op and the
            // output projection right after it. Qwen3.5's gated attention: the K/V projection
            // (its query's comes before the split), not the output projection (after the gate).
            let want: Vec<usize> = attention.iter().flat_map(|&a| if gated { vec![a - 1] } else { vec![a - 1, a + 1] }).collect();
            let got: Vec<usize> = (0..early.len()).filter(|&i| early[i]).collect();
            assert_eq!(got, want, "{name}");
            assert!(early.windows(2).all(|w| !(w[0] && w[1])), "{name}: two in a row");
            // Only linears that run alone are marked.
            assert!(early_release_ops(graph, |_| false).iter().all(|e| !e), "{name}");
        }
    }

    #[test]
    fn only_down_projections_into_the_next_qkv_give_their_handoffs_way() {
        let model = tiny("llama.gguf");
        let graph = &model.graph;
        let mut running = vec![None; graph.ops.len()];
        for (i, h) in graph.handoffs.iter().enumerate() {
            running[h.producer] = Some(i);
        }
        // Every linear spreading: of the declared hand-offs (attention -> output projection ->
        // gate/up -> down -> next QKV, the last down -> head through the last row's copy) only
        // down -> next QKV goes (a linear into a linear, not through the copy).
        let dropped = row_spread_handoffs(graph, &running, |_| true);
        let layers = graph.layers.len();
        assert!(layers > 1 && dropped.len() == layers - 1, "{dropped:?} of {layers} layers");
        for &i in &dropped {
            let h = &graph.handoffs[i];
            assert!(matches!(graph.ops[h.producer - 1], Op::GatedLinear { .. }), "producer of {i}: not a down projection");
            assert!(matches!(graph.ops[h.consumer + 1], Op::Attention { .. }), "consumer of {i}: not a QKV projection");
        }
        // Nothing when no weight spreads, or when the hand-offs do not run.
        assert!(row_spread_handoffs(graph, &running, |_| false).is_empty());
        assert!(row_spread_handoffs(graph, &vec![None; graph.ops.len()], |_| true).is_empty());
    }
}
