//! Runs a model graph on the CPU.
//!
//! Two precisions: `Reference` dequantizes every weight to f32 once and uses plain f32 matmuls —
//! the correctness oracle for every other path —, `Quantized` multiplies directly on the packed
//! GGUF weights with SIMD integer dot products.

use crate::kernels::{self, activation, attention::{AttentionParams, KvElem, PagedKv, PagedSeq, CONTIGUOUS_BLOCK}, gdn, moe, norm, rope::{Rope, RopeTable}, WeightView};
use anyhow::{anyhow, bail, Context};
use half::slice::HalfFloatSliceExt;
use ferrite_gguf::TensorInfo;
use ferrite_model::graph::{ExpertGateUp, GatedActivation, MoeShape, NormSpec, Op, SharedExpert, ValueId, WeightId};
use ferrite_model::planner::{self, Plan};
use ferrite_model::profile::OpProfile;
use rayon::prelude::*;
use ferrite_model::{
    BatchRows,
    Collective, DeviceSampling, Executor, ExecutorOptions, HardwareCeilings, LayerTrace, LoadProgress, Model, PagedKvConfig, PagedOutput, RecurrentCursor, RopeConfig, RopeStyle, SeqChunk,
};
use std::sync::Arc;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CpuPrecision {
    /// f32 weights, f32 math: the oracle.
    Reference,
    /// Packed quantized weights, activations quantized to 8 bits for integer dot products.
    Quantized,
}

/// One layer's K or V cache rows (see `Buffers::k_cache`): f32 at the reference precision;
/// f16 at the quantized one unless `FERRITE_CPU_KV_DTYPE=f32` (a batched decode step reads every
/// sequence's cache from memory, so half the bytes matter).
enum KvRows {
    F32(Vec<f32>),
    F16(Vec<half::f16>),
}

impl Default for KvRows {
    fn default() -> Self {
        KvRows::F32(Vec::new())
    }
}

impl KvRows {
    /// Zeroed by the allocator: pages the cache never reaches are never touched (`vec![f16::ZERO;
    /// n]` wrote all of them, ~100 ms and 94 MB of a 4096-token context before the first token).
    fn zeros(half: bool, n: usize) -> Self {
        if half { KvRows::F16(bytemuck::zeroed_vec(n)) } else { KvRows::F32(vec![0.0; n]) }
    }

    fn len(&self) -> usize {
        match self {
            KvRows::F32(v) => v.len(),
            KvRows::F16(v) => v.len(),
        }
    }

    /// Writes `row` at element `at`, rounded to the cache's type.
    fn store(&mut self, at: usize, row: &[f32]) {
        match self {
            KvRows::F32(v) => v[at..at + row.len()].copy_from_slice(row),
            KvRows::F16(v) => v[at..at + row.len()].convert_from_f32_slice(row),
        }
    }

    /// Writes `x[i]` at element `at + i * stride` (a key into its block's transposed layout).
    fn store_strided(&mut self, at: usize, stride: usize, x: &[f32]) {
        match self {
            KvRows::F32(v) => x.iter().enumerate().for_each(|(i, &x)| v[at + i * stride] = x),
            KvRows::F16(v) => {
                // Rounded as a slice (F16C when the CPU has it), then scattered.
                const CHUNK: usize = 256;
                let mut half = [half::f16::ZERO; CHUNK];
                for (c, part) in x.chunks(CHUNK).enumerate() {
                    let h = &mut half[..part.len()];
                    h.convert_from_f32_slice(part);
                    let first = at + c * CHUNK * stride;
                    h.iter().enumerate().for_each(|(i, &h)| v[first + i * stride] = h);
                }
            }
        }
    }
}

/// Whether a cache for `precision` holds f16 (`KvRows`), read once per executor.
fn kv_half(precision: CpuPrecision) -> bool {
    if precision == CpuPrecision::Reference {
        return false;
    }
    match ferrite_core::env::CPU_KV_DTYPE.get().as_deref() {
        Some("f32") => false,
        Some("f16") | None => true,
        Some(other) => {
            eprintln!("warning: FERRITE_CPU_KV_DTYPE={other:?} is not f16 or f32; using f16");
            true
        }
    }
}

/// A weight as the CPU kernels want it.
enum CpuWeight {
    /// Vectors (norm weights, biases) and, on the reference path, every matrix.
    F32(Vec<f32>),
    /// Packed weight bytes owned here (fused weights, whose parts are not contiguous in the file).
    Packed(Vec<u8>),
    /// Packed weight bytes used in place from the memory-mapped file.
    InFile(TensorInfo),
    /// Q4_0/Q4_1/Q8_0 matrices repacked into row groups for the AVX2 / AVX-512 VNNI matmul (`RowGroups`).
    RowGroups(kernels::RowGroups),
}

/// Mutable buffers of a forward pass, kept apart from the read-only model data.
#[derive(Default)]
struct Buffers {
    slots: Vec<Vec<f32>>,
    /// Per layer: the one-sequence cache (`context_len` rows in blocks of `CONTIGUOUS_BLOCK`
    /// taken in order, allocated on the first `forward`; empty for layers without attention), or
    /// the block arena of the paged cache (`n_blocks * block_size` rows). Both in the paged
    /// layout of `kernels::attention` (keys transposed per block and KV head).
    k_cache: Vec<KvRows>,
    v_cache: Vec<KvRows>,
    /// Recurrent state per layer (empty for layers without a Gated DeltaNet): the conv window and
    /// the delta-rule matrices, for one sequence (`forward`) or one per state slot (paged steps).
    conv_state: Vec<Vec<f32>>,
    ssm_state: Vec<Vec<f32>>,
    /// Normalized input of a norm-folded linear; rotated Q of attention.
    scratch: Vec<f32>,
    /// Output of a linear that fills a column range; rotated K of attention.
    scratch2: Vec<f32>,
    moe: MoeScratch,
    profile: Option<OpProfile>,
    /// This step's RoPE angles, one table per RoPE of the model (computed by the first op
    /// that rotates, reused by the other layers).
    rope_tables: Vec<(Rope, RopeTable)>,
}

/// Index in `tables` (a step's [`Buffers::rope_tables`]) of `rope`'s angles at `positions`,
/// computed if the step has not yet.
fn rope_table(tables: &mut Vec<(Rope, RopeTable)>, rope: Rope, positions: &[u32]) -> usize {
    match tables.iter().position(|(r, _)| *r == rope) {
        Some(i) => i,
        None => {
            tables.push((rope, rope.table(positions)));
            tables.len() - 1
        }
    }
}

/// Working memory of the MoE FFN op.
#[derive(Default)]
struct MoeScratch {
    /// Router logits, `n x n_experts`.
    logits: Vec<f32>,
    /// Chosen experts and their weights, `n x top_k`.
    experts: Vec<usize>,
    weights: Vec<f32>,
    /// The rows routed to one expert: their inputs, `[gate | up]` projections (or the shared
    /// expert's gate and up halves side by side), activations and outputs.
    x: Vec<f32>,
    gate_up: Vec<f32>,
    act: Vec<f32>,
    y: Vec<f32>,
}

/// The batched-serving state: a paged cache and activation buffers planned for a batch of
/// sequences.
struct Paged {
    config: PagedKvConfig,
    plan: Plan,
    /// Its recurrent state holds `max_seqs` slots per Gated DeltaNet layer, slot after slot.
    buf: Buffers,
    /// Tokens each recurrent-state slot has consumed (models with Gated DeltaNet layers).
    cursors: Vec<RecurrentCursor>,
}

/// The rows of one forward step: which sequences they belong to and where their cache lives.
struct Step<'a> {
    ids: &'a [u32],
    /// Position of every row.
    positions: &'a [u32],
    seqs: &'a [StepSeq<'a>],
    /// Positions per block of the cache (`CONTIGUOUS_BLOCK` for the one-sequence cache).
    block_size: usize,
}

struct StepSeq<'a> {
    first_row: usize,
    n: usize,
    start_pos: usize,
    /// Block table (for the one-sequence cache: blocks 0, 1, 2, ...).
    blocks: &'a [u32],
    /// Its recurrent state: slot `state_slot` of each Gated DeltaNet layer's (0 for `forward`).
    state_slot: usize,
}

/// A tensor-parallel rank: how it meets the other ranks, and the pool its kernels run on. The
/// pool is its own because a rank waiting in an all-reduce blocks its thread: on the shared
/// pool, that thread could be the worker another rank's kernels are queued for.
struct Rank {
    collective: Box<dyn Collective>,
    pool: Arc<rayon::ThreadPool>,
}

pub struct CpuExecutor {
    model: Arc<Model>,
    rank: Option<Rank>,
    precision: CpuPrecision,
    /// The KV cache holds f16 (`kv_half`).
    kv_f16: bool,
    weights: Vec<Option<CpuWeight>>,
    plan: Plan,
    buf: Buffers,
    paged: Option<Paged>,
    options: ExecutorOptions,
    /// Rows in the last chunk (for reading traces back).
    last_rows: usize,
    /// Tokens the recurrent state has consumed. Unused without recurrent layers.
    state_pos: RecurrentCursor,
    /// A smaller team of threads for one-token steps (`decode_threads`), where it is smaller
    /// than the global pool.
    decode_pool: Option<Arc<rayon::ThreadPool>>,
    /// The one-sequence cache's block table: blocks 0, 1, 2, ... of `CONTIGUOUS_BLOCK` positions
    /// covering the context.
    contiguous_blocks: Vec<u32>,
}

/// Threads for a one-token step: `FERRITE_DECODE_THREADS`, else one per `DECODE_BYTES_PER_THREAD`
/// of linear weights a token reads, at least `MIN_DECODE_THREADS`, at most `all`. A decode step
/// forks and joins ~5 times per layer; over more threads than its weights keep busy, the joins
/// cost more than the threads stream (docs/perf.md, stop 27: SmolLM2 on a 16-core machine).
fn decode_threads(model: &Model, all: usize) -> usize {
    let setting = ferrite_core::env::DECODE_THREADS.get().and_then(|v| v.parse().ok());
    decode_team(model.linear_weight_bytes(), setting, all)
}

fn decode_team(weight_bytes: usize, setting: Option<usize>, all: usize) -> usize {
    const DECODE_BYTES_PER_THREAD: usize = 16_000_000;
    const MIN_DECODE_THREADS: usize = 4;
    let auto = (weight_bytes / DECODE_BYTES_PER_THREAD).max(MIN_DECODE_THREADS);
    setting.unwrap_or(auto).clamp(1, all.max(1))
}

impl CpuExecutor {
    pub fn new(model: Arc<Model>, precision: CpuPrecision, options: ExecutorOptions) -> anyhow::Result<Self> {
        if let Some(s) = &model.graph.shard {
            bail!("this model is rank {} of {} (tensor parallel): run it with `CpuExecutor::new_rank`", s.rank, s.n_ranks);
        }
        Self::build(model, precision, options, None)
    }

    /// Rank `collective.rank()` of a tensor-parallel model (see `ferrite_model::shard`): its
    /// all-reduces go through `collective`, its kernels run on a pool of their own with an equal
    /// share of the global pool's threads.
    pub fn new_rank(model: Arc<Model>, precision: CpuPrecision, options: ExecutorOptions, collective: Box<dyn Collective>) -> anyhow::Result<Self> {
        let (rank, n_ranks) = (collective.rank(), collective.n_ranks());
        match &model.graph.shard {
            Some(s) if (s.rank, s.n_ranks) == (rank, n_ranks) => {}
            Some(s) => bail!("the model is rank {} of {} but the collective is rank {rank} of {n_ranks}", s.rank, s.n_ranks),
            None => bail!("the model is not a tensor-parallel rank (see `ferrite_model::shard`)"),
        }
        let threads = (rayon::current_num_threads() / n_ranks).max(1);
        let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).thread_name(move |i| format!("rank-{rank}-cpu-{i}")).build()?;
        Self::build(model, precision, options, Some(Rank { collective, pool: Arc::new(pool) }))
    }

    fn build(model: Arc<Model>, precision: CpuPrecision, options: ExecutorOptions, rank: Option<Rank>) -> anyhow::Result<Self> {
        let graph = &model.graph;
        let mut weights: Vec<Option<CpuWeight>> = (0..model.weights.len()).map(|_| None).collect();
        let used = model.weights.used_by(graph);
        // Weights that ops read element-wise rather than through a matmul, and MoE routers (the
        // routing logits are f32 on both paths, so quantized activations cannot flip a choice):
        // always f32.
        let host_f32: Vec<WeightId> = graph
            .ops
            .iter()
            .filter_map(|o| match o {
                Op::GatedDeltaNet { conv, .. } => Some(*conv),
                Op::MoeFfn { router, .. } => Some(*router),
                _ => None,
            })
            .collect();
        // Matrices of the dense linears (whole-row-range matmuls) may be repacked into row groups.
        let row_groups = kernels::RowGroups::preferred();
        let dense: Vec<WeightId> = graph
            .ops
            .iter()
            .filter_map(|o| match o {
                Op::Linear { w, .. } | Op::GatedLinear { w, .. } => Some(*w),
                _ => None,
            })
            .collect();
        let mut repacked = Vec::new();
        for (i, &id) in used.iter().enumerate() {
            LoadProgress::report(&options.progress, i, used.len());
            let spec = model.weights.spec(id);
            let as_f32 = spec.is_vector() || precision == CpuPrecision::Reference || host_f32.contains(&id);
            let layout = (!as_f32 && row_groups && dense.contains(&id)).then(|| kernels::row_groups::Layout::best(spec.dtype, spec.rows, spec.cols));
            if let Some(layout) = layout.flatten() {
                repacked.push((id, layout));
                continue;
            }
            let w = if as_f32 {
                CpuWeight::F32(model.weights.to_f32(&model.file, id)?)
            } else if let Some(name) = spec.whole_tensor() {
                let t = model.file.tensor(name).ok_or_else(|| anyhow!("tensor `{}` vanished", spec.name))?;
                CpuWeight::InFile(t.clone())
            } else {
                // Fused weights and row selections are gathered once at load.
                CpuWeight::Packed(model.weights.bytes(&model.file, id)?.into_owned())
            };
            weights[id.0 as usize] = Some(w);
        }
        // All row groups in one buffer, repacked in place from the file (fused weights from a
        // copy gathered for the moment).
        let layouts: Vec<_> = repacked.iter().map(|&(_, l)| l).collect();
        let groups = kernels::RowGroups::repack_into_one_buffer(&layouts, |i| Ok(model.weights.bytes(&model.file, repacked[i].0)?))?;
        for ((id, _), g) in repacked.iter().zip(groups) {
            weights[id.0 as usize] = Some(CpuWeight::RowGroups(g));
        }
        let max_batch = options.max_batch.max(1);
        let plan = planner::plan(graph, max_batch, !options.trace);
        plan.check(graph).map_err(|e| anyhow!("memory plan violates the aliasing rule: {e}"))?;
        let slots = plan.slot_elems.iter().map(|&n| vec![0f32; n]).collect();
        let (mut conv_state, mut ssm_state) = (vec![Vec::new(); graph.n_layers], vec![Vec::new(); graph.n_layers]);
        for op in &graph.ops {
            if let Op::GatedDeltaNet { layer, shape, .. } = op {
                conv_state[*layer] = vec![0f32; shape.conv_state_len()];
                ssm_state[*layer] = vec![0f32; shape.ssm_state_len()];
            }
        }
        let buf = Buffers { slots, conv_state, ssm_state, profile: OpProfile::from_env(), ..Buffers::default() };
        let options = ExecutorOptions { max_batch, ..options };
        let kv_f16 = kv_half(precision);
        // Tensor-parallel ranks keep their own pools.
        let all = rayon::current_num_threads();
        let team = decode_threads(&model, all);
        let decode_pool = if rank.is_none() && team < all {
            Some(Arc::new(rayon::ThreadPoolBuilder::new().num_threads(team).thread_name(|i| format!("decode-cpu-{i}")).build()?))
        } else {
            None
        };
        let contiguous_blocks = (0..options.context_len.div_ceil(CONTIGUOUS_BLOCK) as u32).collect();
        Ok(Self { model, rank, precision, kv_f16, weights, plan, buf, paged: None, options, last_rows: 0, state_pos: RecurrentCursor::default(), decode_pool, contiguous_blocks })
    }

    /// Token ids must be inside the vocabulary (the embedding op checks). A tensor-parallel rank
    /// checks before any op runs: an op that fails aborts the group, where a bad id (the same on
    /// every rank) should not.
    fn check_tokens(&self, ids: &[u32]) -> anyhow::Result<()> {
        let vocab = self.model.config.vocab_size;
        match ids.iter().find(|&&id| id as usize >= vocab) {
            Some(id) => bail!("token id {id} is outside the vocabulary ({vocab})"),
            None => Ok(()),
        }
    }

    /// Floats of one cached position of one layer (K or V).
    fn kv_width(&self) -> usize {
        self.model.config.kv_width()
    }

    fn f32_weight(&self, id: WeightId) -> &[f32] {
        match &self.weights[id.0 as usize] {
            Some(CpuWeight::F32(v)) => v,
            _ => unreachable!("vector weights are always stored as f32"),
        }
    }

    /// `out[t*rows + r] = x[t] · W[r]` for `n` tokens, on whichever representation is stored.
    fn matmul(&self, id: WeightId, x: &[f32], n: usize, out: &mut [f32]) -> anyhow::Result<()> {
        self.matmul_rows(id, 0..self.model.weights.spec(id).rows, x, n, out)
    }

    /// [`Self::matmul`] with the weight's rows `rows` only (one expert of an expert bank).
    fn matmul_rows(&self, id: WeightId, rows: std::ops::Range<usize>, x: &[f32], n: usize, out: &mut [f32]) -> anyhow::Result<()> {
        let spec = self.model.weights.spec(id);
        let m = rows.len();
        let packed = match &self.weights[id.0 as usize] {
            Some(CpuWeight::F32(w)) => {
                kernels::matmul_f32(&w[rows.start * spec.cols..rows.end * spec.cols], m, spec.cols, x, n, out);
                return Ok(());
            }
            Some(CpuWeight::Packed(bytes)) => bytes.as_slice(),
            Some(CpuWeight::InFile(t)) => self.model.file.tensor_data(t),
            Some(CpuWeight::RowGroups(g)) => return Ok(g.matmul(rows, x, n, out)?),
            None => bail!("weight `{}` was not loaded", spec.name),
        };
        let row_bytes = spec.dtype.row_bytes(spec.cols).ok_or_else(|| anyhow!("`{}`: rows are not whole blocks", spec.name))?;
        let data = &packed[rows.start * row_bytes..rows.end * row_bytes];
        Ok(kernels::matmul(&WeightView { dtype: spec.dtype, rows: m, cols: spec.cols, data }, x, n, out)?)
    }

    /// The MoE FFN on `n` rows of `x` (already normalised): `out = Σ routed experts + shared`.
    /// Tokens are grouped by expert, so each expert's matrices are read once per call.
    #[allow(clippy::too_many_arguments)]
    fn moe_ffn(
        &self,
        s: &mut MoeScratch,
        x: &[f32],
        n: usize,
        router: WeightId,
        gate_up: ExpertGateUp,
        down: WeightId,
        shared: Option<SharedExpert>,
        moe: MoeShape,
        out: &mut [f32],
    ) -> anyhow::Result<()> {
        let d = x.len() / n;
        let MoeShape { n_experts: e, top_k: k, n_ff_exp: ff, norm_topk_prob } = moe;
        s.logits.resize(n * e, 0.0);
        self.matmul(router, x, n, &mut s.logits)?;
        s.experts.resize(n * k, 0);
        s.weights.resize(n * k, 0.0);
        for ((logits, experts), weights) in s.logits.chunks_exact(e).zip(s.experts.chunks_exact_mut(k)).zip(s.weights.chunks_exact_mut(k)) {
            moe::route(logits, norm_topk_prob, experts, weights);
        }
        out.fill(0.0);
        let mut routed: Vec<(usize, f32)> = Vec::with_capacity(n);
        for ex in 0..e {
            routed.clear();
            routed.extend(s.experts.iter().zip(&s.weights).enumerate().filter(|(_, (&x, _))| x == ex).map(|(i, (_, &w))| (i / k, w)));
            if routed.is_empty() {
                continue;
            }
            let m = routed.len();
            s.x.clear();
            for &(t, _) in &routed {
                s.x.extend_from_slice(&x[t * d..(t + 1) * d]);
            }
            self.expert(s, m, gate_up, ex * ff..(ex + 1) * ff, ff)?;
            s.y.resize(m * d, 0.0);
            self.matmul_rows(down, ex * d..(ex + 1) * d, &s.act, m, &mut s.y)?;
            for (&(t, w), y) in routed.iter().zip(s.y.chunks_exact(d)) {
                for (o, &v) in out[t * d..(t + 1) * d].iter_mut().zip(y) {
                    *o += w * v;
                }
            }
        }
        if let Some(sh) = shared {
            let ffs = self.model.weights.spec(sh.gate).rows;
            s.x.clear();
            s.x.extend_from_slice(x);
            self.expert(s, n, ExpertGateUp::Split { gate: sh.gate, up: sh.up }, 0..ffs, ffs)?;
            s.y.resize(n * d, 0.0);
            self.matmul(sh.down, &s.act, n, &mut s.y)?;
            let gate_inp = self.f32_weight(sh.gate_inp);
            for ((o, y), xt) in out.chunks_exact_mut(d).zip(s.y.chunks_exact(d)).zip(x.chunks_exact(d)) {
                let logit: f32 = xt.iter().zip(gate_inp).map(|(&a, &b)| a * b).sum();
                let g = 1.0 / (1.0 + (-logit).exp());
                for (o, &v) in o.iter_mut().zip(y) {
                    *o += g * v;
                }
            }
        }
        Ok(())
    }

    /// `s.act = silu(gate · s.x) * (up · s.x)` for the `m` rows of `s.x`, with the gate and up
    /// rows `rows` (`ff` of them) of one expert.
    fn expert(&self, s: &mut MoeScratch, m: usize, gate_up: ExpertGateUp, rows: std::ops::Range<usize>, ff: usize) -> anyhow::Result<()> {
        s.gate_up.resize(m * 2 * ff, 0.0);
        s.act.resize(m * ff, 0.0);
        match gate_up {
            ExpertGateUp::Fused(w) => {
                // Expert e's rows are [gate | up]: 2 ff of them from 2 ff * e.
                self.matmul_rows(w, 2 * rows.start..2 * rows.end, &s.x, m, &mut s.gate_up)?;
                for (row, a) in s.gate_up.chunks_exact(2 * ff).zip(s.act.chunks_exact_mut(ff)) {
                    activation::swiglu(&row[..ff], &row[ff..], a);
                }
            }
            ExpertGateUp::Split { gate, up } => {
                let (g, u) = s.gate_up.split_at_mut(m * ff);
                self.matmul_rows(gate, rows.clone(), &s.x, m, g)?;
                self.matmul_rows(up, rows, &s.x, m, u)?;
                for ((g, u), a) in g.chunks_exact(ff).zip(u.chunks_exact(ff)).zip(s.act.chunks_exact_mut(ff)) {
                    activation::swiglu(g, u, a);
                }
            }
        }
        Ok(())
    }

    /// The RoPE kernel's parameters for one op's config.
    fn rope(&self, rope: &RopeConfig) -> Rope {
        Rope {
            style: match rope.style {
                RopeStyle::Normal => kernels::rope::RopeStyle::Normal,
                RopeStyle::Neox => kernels::rope::RopeStyle::Neox,
            },
            head_dim: self.model.graph.attention.head_dim,
            rot_dim: rope.rot_dim,
            theta: rope.theta,
            freq_scale: rope.freq_scale,
        }
    }

    fn rms_norm(&self, norm: NormSpec, x: &[f32], out: &mut [f32]) {
        norm::rms_norm(x, self.f32_weight(norm.weight), norm.eps, out);
    }

    /// A linear's input: `x` as is, or RMS-normalised into `scratch` (a norm-folded linear).
    fn linear_input<'a>(&self, norm: Option<NormSpec>, x: &'a [f32], scratch: &'a mut Vec<f32>) -> &'a [f32] {
        match norm {
            Some(nm) => {
                scratch.resize(x.len(), 0.0);
                self.rms_norm(nm, x, scratch);
                scratch
            }
            None => x,
        }
    }

    fn run_chunk(&mut self, ids: &[u32], start_pos: usize) -> anyhow::Result<()> {
        let mut buf = std::mem::take(&mut self.buf);
        let blocks = &self.contiguous_blocks;
        if buf.k_cache.is_empty() {
            // Attention layers only: Gated DeltaNet layers keep recurrent state instead.
            let kv = blocks.len() * CONTIGUOUS_BLOCK * self.kv_width();
            let attention_layers = self.model.graph.attention_layers();
            let cache = |l: usize| KvRows::zeros(self.kv_f16, if attention_layers.contains(&l) { kv } else { 0 });
            buf.k_cache = (0..self.model.graph.n_layers).map(cache).collect();
            buf.v_cache = (0..self.model.graph.n_layers).map(cache).collect();
        }
        let positions: Vec<u32> = (start_pos..start_pos + ids.len()).map(|p| p as u32).collect();
        let seqs = [StepSeq { first_row: 0, n: ids.len(), start_pos, blocks, state_slot: 0 }];
        let step = Step { ids, positions: &positions, seqs: &seqs, block_size: CONTIGUOUS_BLOCK };
        let result = self.run_ops(&mut buf, &self.plan, &step);
        if let Some(p) = buf.profile.as_mut() {
            p.end_forward();
        }
        self.buf = buf;
        self.last_rows = ids.len();
        result
    }

    fn run_ops(&self, buf: &mut Buffers, plan: &Plan, step: &Step<'_>) -> anyhow::Result<()> {
        let model = &*self.model;
        let graph = &model.graph;
        buf.rope_tables.clear();
        for (i, op) in graph.ops.iter().enumerate() {
            let out_id = op.writes();
            let out_slot = plan.slot(out_id);
            // Take the output buffer out so inputs can be borrowed alongside it; the plan
            // guarantees no input lives in the same slot (except in-place ops, handled below).
            let mut out = std::mem::take(&mut buf.slots[out_slot]);
            let t = buf.profile.is_some().then(std::time::Instant::now);
            let mut result = self.run_op(op, buf, plan, &mut out, step);
            if let (Some(p), Some(t)) = (buf.profile.as_mut(), t) {
                p.add(op.kind(), t.elapsed().as_secs_f64() * 1e3);
            }
            if let Some(rank) = &self.rank {
                if result.is_ok() && graph.all_reduces_after(i) {
                    let t = buf.profile.is_some().then(std::time::Instant::now);
                    let len = graph.value(out_id).rows_for(step.ids.len(), step.seqs.len()) * graph.value(out_id).width;
                    result = rank.collective.all_reduce_sum(&mut out[..len]).context("all-reduce");
                    if let (Some(p), Some(t)) = (buf.profile.as_mut(), t) {
                        p.add("all_reduce", t.elapsed().as_secs_f64() * 1e3);
                    }
                }
                // The other ranks may be waiting for this one at its next all-reduce.
                if result.is_err() {
                    rank.collective.abort();
                }
            }
            buf.slots[out_slot] = out;
            result.with_context(|| format!("op {} writing `{}`", op.kind(), graph.value(out_id).name))?;
        }
        Ok(())
    }

    fn run_op(&self, op: &Op, buf: &mut Buffers, plan: &Plan, out: &mut [f32], step: &Step<'_>) -> anyhow::Result<()> {
        let model = &*self.model;
        let graph = &model.graph;
        let (ids, positions) = (step.ids, step.positions);
        let n = ids.len();
        let width = |v: ValueId| graph.value(v).width;
        let rows = |v: ValueId| graph.value(v).rows_for(n, step.seqs.len());
        let out_id = op.writes();
        let slots = &buf.slots;
        let input = |v: ValueId| -> &[f32] { &slots[plan.slot(v)][..rows(v) * width(v)] };
        {
            match *op {
                Op::Embed { table, scale, .. } => {
                    let spec = model.weights.spec(table);
                    let dst = &mut out[..n * spec.cols];
                    match &self.weights[table.0 as usize] {
                        Some(CpuWeight::F32(t)) => {
                            self.check_tokens(ids)?;
                            for (row, &id) in dst.chunks_mut(spec.cols).zip(ids) {
                                let id = id as usize;
                                row.copy_from_slice(&t[id * spec.cols..(id + 1) * spec.cols]);
                            }
                        }
                        _ => {
                            let bytes = model.weights.bytes(&model.file, table)?;
                            let view = WeightView { dtype: spec.dtype, rows: spec.rows, cols: spec.cols, data: &bytes };
                            kernels::embedding::embed_rows(&view, ids, dst)?;
                        }
                    }
                    if scale != 1.0 {
                        dst.iter_mut().for_each(|v| *v *= scale);
                    }
                }
                Op::RmsNorm { x, norm, residual, .. } => {
                    let out = &mut out[..rows(x) * width(x)];
                    self.rms_norm(norm, input(x), out);
                    // The same sums as a separate `Add` of the residual and the normed value.
                    if let Some(res) = residual {
                        activation::add_inplace(out, &input(res)[..out.len()]);
                    }
                }
                Op::Linear { x, norm, w, bias, residual, out_col, .. } => {
                    let spec = model.weights.spec(w);
                    let (r, ow) = (rows(x), width(out_id));
                    let xin = self.linear_input(norm, input(x), &mut buf.scratch);
                    let direct = out_col == 0 && spec.rows == ow;
                    let tmp = &mut buf.scratch2;
                    if let (true, None, Some(CpuWeight::RowGroups(g))) = (direct, bias, &self.weights[w.0 as usize]) {
                        // The residual added by the matmul's own tasks.
                        g.matmul_add(0..spec.rows, xin, r, &mut out[..r * ow], residual.map(|res| &input(res)[..r * ow]))?;
                        return Ok(());
                    }
                    if direct {
                        self.matmul(w, xin, r, &mut out[..r * ow])?;
                    } else {
                        tmp.resize(r * spec.rows, 0.0);
                        self.matmul(w, xin, r, tmp)?;
                        for t in 0..r {
                            out[t * ow + out_col..t * ow + out_col + spec.rows]
                                .copy_from_slice(&tmp[t * spec.rows..(t + 1) * spec.rows]);
                        }
                    }
                    for t in 0..r {
                        let row = &mut out[t * ow + out_col..t * ow + out_col + spec.rows];
                        if let Some(b) = bias {
                            activation::add_inplace(row, self.f32_weight(b));
                        }
                        if let Some(res) = residual {
                            activation::add_inplace(row, &input(res)[t * ow..(t + 1) * ow]);
                        }
                    }
                }
                Op::GatedLinear { x, norm, w, act, .. } => {
                    // The projection into scratch, then `act(gate) * up` row by row: the same
                    // arithmetic as a Linear followed by a SwiGlu/GeGlu op.
                    let spec = model.weights.spec(w);
                    let (r, half) = (rows(x), spec.rows / 2);
                    let xin = self.linear_input(norm, input(x), &mut buf.scratch);
                    let tmp = &mut buf.scratch2;
                    tmp.resize(r * spec.rows, 0.0);
                    self.matmul(w, xin, r, tmp)?;
                    let act = gated_activation(act);
                    kernels::for_each_row(&mut out[..r * half], half, |t, out| {
                        let row = &tmp[t * spec.rows..(t + 1) * spec.rows];
                        act(&row[..half], &row[half..], out);
                    });
                }
                Op::Rope { x, col, n_heads, ref rope } => {
                    // In place: `out` *is* x's buffer.
                    let w = width(x);
                    let rope = self.rope(rope);
                    let span = n_heads * rope.head_dim;
                    let at = rope_table(&mut buf.rope_tables, rope, positions);
                    let table = &buf.rope_tables[at].1;
                    kernels::for_each_row(&mut out[..n * w], w, |t, row| rope.apply_table(&mut row[col..col + span], n_heads, table, t));
                }
                Op::HeadNorm { x, col, n_heads, norm } => {
                    // In place: `out` *is* x's buffer; each head is normalised from a copy.
                    let (w, hd) = (width(x), model.config.head_dim);
                    let head = &mut buf.scratch;
                    for row in out[..n * w].chunks_mut(w) {
                        for h in row[col..col + n_heads * hd].chunks_mut(hd) {
                            head.clear();
                            head.extend_from_slice(h);
                            self.rms_norm(norm, head, h);
                        }
                    }
                }
                Op::Attention { layer, qkv, window, ref rope, qk_norm, .. } => {
                    let a = graph.attention;
                    let rope = rope.as_ref().map(|r| self.rope(r));
                    let (qw, kvw, hd) = (a.n_heads * a.head_dim, a.n_kv_heads * a.head_dim, a.head_dim);
                    let src = input(qkv);
                    let w = width(qkv);
                    let params = AttentionParams {
                        n_heads: a.n_heads,
                        n_kv_heads: a.n_kv_heads,
                        head_dim: a.head_dim,
                        scale: a.scale,
                        window,
                        softcap: None,
                    };
                    // Each row's Q (normalised per head with a QK-norm, then rotated) into
                    // scratch and its K into scratch2, in f32 (before the cache rounds K); then K
                    // and V into each row's cache row, sequence by sequence; then attention over
                    // every row at once.
                    let n_rows = n;
                    let rope = rope.map(|r| (r, rope_table(&mut buf.rope_tables, r, positions)));
                    let (q, k, tables) = (&mut buf.scratch, &mut buf.scratch2, &buf.rope_tables);
                    q.resize(n_rows * qw, 0.0);
                    k.resize(n_rows * kvw, 0.0);
                    let norms = qk_norm.map(|n| (self.f32_weight(n.q.weight), n.q.eps, self.f32_weight(n.k.weight), n.k.eps));
                    let rotate = |t: usize, q: &mut [f32], k: &mut [f32]| {
                        let (q_in, k_in) = (&src[t * w..][..qw], &src[t * w + qw..][..kvw]);
                        if let Some((qn, q_eps, kn, k_eps)) = norms {
                            // The same values as two HeadNorm ops, then the rotation in place.
                            norm::rms_norm(q_in, qn, q_eps, q);
                            norm::rms_norm(k_in, kn, k_eps, k);
                            if let Some((rope, table)) = &rope {
                                rope.apply_table(q, a.n_heads, &tables[*table].1, t);
                                rope.apply_table(k, a.n_kv_heads, &tables[*table].1, t);
                            }
                            return;
                        }
                        match &rope {
                            // The same rotation as a separate Rope op, read from the qkv row.
                            Some((rope, table)) => {
                                rope.apply_table_to(q_in, q, a.n_heads, &tables[*table].1, t);
                                rope.apply_table_to(k_in, k, a.n_kv_heads, &tables[*table].1, t);
                            }
                            None => {
                                q.copy_from_slice(q_in);
                                k.copy_from_slice(k_in);
                            }
                        }
                    };
                    kernels::for_each_row_pair(q, qw, k, kvw, rotate);
                    for seq in step.seqs {
                        let (start_pos, n) = (seq.start_pos, seq.n);
                        let rows = seq.first_row..seq.first_row + n;
                        let (bs, capacity) = (step.block_size, buf.k_cache[layer].len() / kvw);
                        if seq.blocks.len() * bs < start_pos + n || seq.blocks.iter().any(|&b| (b as usize + 1) * bs > capacity) {
                            bail!("block table of {} blocks does not cover {} positions in a cache of {capacity} rows", seq.blocks.len(), start_pos + n);
                        }
                        for t in rows.clone() {
                            let (k_row, v_row) = (&buf.scratch2[t * kvw..][..kvw], &src[t * w + qw + kvw..][..kvw]);
                            let p = start_pos + t - rows.start;
                            let (block, row) = (seq.blocks[p / bs] as usize, p % bs);
                            for h in 0..a.n_kv_heads {
                                let key_at = kernels::attention::paged_key_offset(&params, bs, block, row, h);
                                buf.k_cache[layer].store_strided(key_at, bs, &k_row[h * hd..][..hd]);
                                buf.v_cache[layer].store(kernels::attention::paged_offset(&params, bs, block, row, h), &v_row[h * hd..][..hd]);
                            }
                        }
                    }
                    let q = &buf.scratch[..n_rows * qw];
                    let out = &mut out[..n_rows * qw];
                    match (&buf.k_cache[layer], &buf.v_cache[layer]) {
                        (KvRows::F32(k), KvRows::F32(v)) => attend_step(&params, step, q, k, v, out),
                        (KvRows::F16(k), KvRows::F16(v)) => attend_step(&params, step, q, k, v, out),
                        _ => unreachable!("a layer's K and V caches have one type"),
                    }
                }
                Op::SwiGlu { x, .. } | Op::GeGlu { x, .. } => {
                    let act = gated_activation(match op {
                        Op::SwiGlu { .. } => GatedActivation::Silu,
                        _ => GatedActivation::GeluTanh,
                    });
                    let (w2, src) = (width(x), input(x));
                    let w = w2 / 2;
                    kernels::for_each_row(&mut out[..rows(x) * w], w, |t, out| {
                        let row = &src[t * w2..(t + 1) * w2];
                        act(&row[..w], &row[w..], out);
                    });
                }
                Op::Add { a, b, .. } => {
                    let len = rows(a) * width(a);
                    out[..len].copy_from_slice(input(a));
                    activation::add_inplace(&mut out[..len], input(b));
                }
                Op::LastRow { x, .. } => {
                    let w = width(x);
                    for (i, seq) in step.seqs.iter().enumerate() {
                        let last = seq.first_row + seq.n - 1;
                        out[i * w..(i + 1) * w].copy_from_slice(&input(x)[last * w..(last + 1) * w]);
                    }
                }
                Op::SplitGatedQuery { x, n_heads, head_dim, .. } => {
                    let (xw, ow) = (width(x), width(out_id));
                    for (src, dst) in input(x).chunks_exact(xw).zip(out.chunks_exact_mut(ow)).take(rows(x)) {
                        for h in 0..n_heads {
                            dst[h * head_dim..(h + 1) * head_dim].copy_from_slice(&src[2 * h * head_dim..(2 * h + 1) * head_dim]);
                        }
                    }
                }
                Op::SigmoidGate { x, gate, n_heads, head_dim, .. } => {
                    let (xw, gw) = (width(x), width(gate));
                    let (src, gates) = (input(x), input(gate));
                    for t in 0..rows(x) {
                        for h in 0..n_heads {
                            let g = &gates[t * gw + (2 * h + 1) * head_dim..t * gw + (2 * h + 2) * head_dim];
                            let base = t * xw + h * head_dim;
                            for ((o, &v), &g) in out[base..base + head_dim].iter_mut().zip(&src[base..base + head_dim]).zip(g) {
                                *o = v / (1.0 + (-g).exp());
                            }
                        }
                    }
                }
                Op::MoeFfn { x, norm, router, gate_up, down, shared, moe, residual, .. } => {
                    let (r, d) = (rows(x), width(x));
                    let xin = self.linear_input(norm, input(x), &mut buf.scratch);
                    // The sum over experts first, then the residual: the same arithmetic as a
                    // MoE op followed by an Add op (IEEE addition commutes).
                    let dst = &mut out[..r * d];
                    self.moe_ffn(&mut buf.moe, xin, r, router, gate_up, down, shared, moe, dst)?;
                    if let Some(res) = residual {
                        activation::add_inplace(dst, input(res));
                    }
                }
                Op::GatedDeltaNet { layer, x, conv, a_coef, dt_bias, norm, shape, .. } => {
                    let p = gdn::GdnParams {
                        shape,
                        conv: self.f32_weight(conv),
                        a_coef: self.f32_weight(a_coef),
                        dt_bias: self.f32_weight(dt_bias),
                        norm: self.f32_weight(norm.weight),
                        eps: norm.eps,
                    };
                    // Each sequence's rows through its own state slot, the sequences side by side
                    // (a sequence's tokens one after another: the recurrence is serial).
                    let (xw, ow) = (width(x), width(out_id));
                    let xs = &slots[plan.slot(x)];
                    let mut conv: Vec<Option<&mut [f32]>> = buf.conv_state[layer].chunks_mut(shape.conv_state_len()).map(Some).collect();
                    let mut ssm: Vec<Option<&mut [f32]>> = buf.ssm_state[layer].chunks_mut(shape.ssm_state_len()).map(Some).collect();
                    let mut rest = &mut out[..n * ow];
                    let mut work = Vec::with_capacity(step.seqs.len());
                    for q in step.seqs {
                        let (dst, tail) = std::mem::take(&mut rest).split_at_mut(q.n * ow);
                        rest = tail;
                        let taken = (conv.get_mut(q.state_slot).and_then(Option::take), ssm.get_mut(q.state_slot).and_then(Option::take));
                        let (Some(c), Some(h)) = taken else { bail!("state slot {} is missing or shared", q.state_slot) };
                        work.push((&xs[q.first_row * xw..(q.first_row + q.n) * xw], q.n, c, h, dst));
                    }
                    work.into_par_iter().for_each(|(x, n, c, h, dst)| gdn::gated_delta_net(&p, x, n, c, h, dst));
                }
            }
        }
        Ok(())
    }
}

impl CpuExecutor {
    /// One batched step; then `output(i, logits of sequence i)` for each sequence, side by side
    /// on the pool.
    fn run_paged<T: Send>(&self, paged: &mut Paged, batch: &[SeqChunk<'_>], output: impl Fn(usize, &[f32]) -> T + Sync) -> anyhow::Result<Vec<T>> {
        let c = paged.config;
        let rows = BatchRows::new(batch, &c)?;
        if self.rank.is_some() {
            self.check_tokens(&rows.ids)?;
        }
        let seqs: Vec<StepSeq> = batch
            .iter()
            .enumerate()
            .map(|(i, s)| StepSeq { first_row: rows.seq_start[i], n: s.tokens.len(), start_pos: s.start_pos, blocks: s.block_table, state_slot: s.state_slot })
            .collect();
        let step = Step { ids: &rows.ids, positions: &rows.positions, seqs: &seqs, block_size: c.block_size };
        let Paged { plan, buf, cursors, .. } = paged;
        if self.model.graph.has_recurrent_state() {
            // Every chunk starts its slot over or continues it; checked for all before any
            // changes. The slots stay unusable until the step succeeds.
            let mut next = cursors.clone();
            let resets = seqs.iter().map(|s| next[s.state_slot].begin(s.start_pos).with_context(|| format!("state slot {}", s.state_slot))).collect::<anyhow::Result<Vec<bool>>>()?;
            *cursors = next;
            for (s, _) in seqs.iter().zip(resets).filter(|(_, reset)| *reset) {
                for state in buf.conv_state.iter_mut().chain(buf.ssm_state.iter_mut()).filter(|st| !st.is_empty()) {
                    let len = state.len() / cursors.len();
                    state[s.state_slot * len..][..len].fill(0.0);
                }
            }
        }
        let g = &self.model.graph;
        let w = g.value(g.logits).width;
        // On a pool worker, like `forward`.
        let result = on_pool(self.rank.as_ref().map(|r| &*r.pool), || {
            self.run_ops(buf, plan, &step)?;
            let logits = &buf.slots[plan.slot(g.logits)];
            Ok::<_, anyhow::Error>((0..batch.len()).into_par_iter().map(|i| output(i, &logits[i * w..(i + 1) * w])).collect())
        });
        if result.is_ok() {
            seqs.iter().for_each(|s| cursors[s.state_slot].finish(s.start_pos + s.n));
        }
        if let Some(p) = buf.profile.as_mut() {
            p.end_forward();
        }
        result.context("batched forward pass")
    }
}

impl Executor for CpuExecutor {
    fn describe(&self) -> String {
        let p = match self.precision {
            CpuPrecision::Reference => "fp32 reference",
            CpuPrecision::Quantized => "quantized",
        };
        let threads = self.rank.as_ref().map_or_else(rayon::current_num_threads, |r| r.pool.current_num_threads());
        let rank = self.rank.as_ref().map(|r| format!(", rank {} of {}", r.collective.rank(), r.collective.n_ranks())).unwrap_or_default();
        let decode = self.decode_pool.as_ref().map(|d| format!(" ({} for decode)", d.current_num_threads())).unwrap_or_default();
        format!("cpu ({p}, {:?}, {threads} threads{decode}{rank})", kernels::simd::simd_level())
    }

    fn forward(&mut self, tokens: &[u32], start_pos: usize) -> anyhow::Result<()> {
        if tokens.is_empty() {
            bail!("forward called with no tokens");
        }
        if self.rank.is_some() {
            self.check_tokens(tokens)?;
        }
        if start_pos + tokens.len() > self.options.context_len {
            bail!(
                "prompt too long: {} tokens at position {start_pos} exceed the context of {} tokens",
                tokens.len(),
                self.options.context_len
            );
        }
        if self.model.graph.has_recurrent_state() && self.state_pos.begin(start_pos)? {
            self.buf.conv_state.iter_mut().chain(self.buf.ssm_state.iter_mut()).for_each(|s| s.fill(0.0));
        }
        let step = self.options.max_batch;
        let decode = if tokens.len() == 1 { self.decode_pool.clone() } else { None };
        let pool = self.rank.as_ref().map(|r| Arc::clone(&r.pool)).or(decode);
        on_pool(pool.as_deref(), || {
            for (i, chunk) in tokens.chunks(step).enumerate() {
                self.run_chunk(chunk, start_pos + i * step)
                    .with_context(|| format!("forward pass at position {}", start_pos + i * step))?;
            }
            Ok::<(), anyhow::Error>(())
        })?;
        self.state_pos.finish(start_pos + tokens.len());
        Ok(())
    }

    fn has_recurrent_state(&self) -> bool {
        self.model.graph.has_recurrent_state()
    }

    fn logits(&mut self) -> anyhow::Result<Vec<f32>> {
        let g = &self.model.graph;
        let v = g.logits;
        Ok(self.buf.slots[self.plan.slot(v)][..g.value(v).width].to_vec())
    }

    fn traces(&mut self) -> anyhow::Result<Vec<LayerTrace>> {
        if !self.options.trace {
            bail!("this executor was created without tracing");
        }
        let g = &self.model.graph;
        Ok(g
            .values
            .iter()
            .enumerate()
            .filter(|(_, v)| v.traced)
            .map(|(i, v)| {
                let len = v.n_rows(self.last_rows) * v.width;
                LayerTrace { name: v.name.clone(), width: v.width, data: self.buf.slots[self.plan.slot(ValueId(i as u32))][..len].to_vec() }
            })
            .collect())
    }

    fn context_len(&self) -> usize {
        self.options.context_len
    }

    fn hardware_ceilings(&mut self) -> Option<anyhow::Result<HardwareCeilings>> {
        // A decode step streams the weights: read about as many bytes as the model file holds.
        let bytes = self.model.file.file_size();
        on_pool(self.rank.as_ref().map(|r| &*r.pool), || crate::ceilings::measure(bytes)).map(Ok)
    }

    fn kv_bytes_per_position(&self) -> usize {
        let elem = if self.kv_f16 { 2 } else { 4 };
        self.model.graph.attention_layers().len() * 2 * self.kv_width() * elem
    }

    fn memory_report(&self) -> String {
        let mib = |b: usize| b as f64 / (1024.0 * 1024.0);
        let weights: usize = self
            .weights
            .iter()
            .map(|w| match w {
                Some(CpuWeight::F32(v)) => v.len() * 4,
                Some(CpuWeight::Packed(v)) => v.len(),
                Some(CpuWeight::RowGroups(g)) => g.bytes(),
                _ => 0,
            })
            .sum();
        let kv = self.options.context_len * self.kv_bytes_per_position();
        let state: usize = self.buf.conv_state.iter().chain(&self.buf.ssm_state).map(|c| c.len() * 4).sum();
        let mut report = format!(
            "weights copied to RAM: {:.1} MiB (the rest is used in place from the mapped file)\nkv cache ({}): {:.1} MiB\nrecurrent state (f32): {:.2} MiB\nactivations: {:.1} MiB in {} buffers",
            mib(weights),
            if self.kv_f16 { "f16" } else { "f32" },
            mib(kv),
            mib(state),
            mib(self.plan.total_elems() * 4),
            self.plan.slot_elems.len()
        );
        if let Some(p) = &self.paged {
            let c = p.config;
            report += &format!(
                "\npaged kv cache ({}): {:.1} MiB in {} blocks of {} positions\nbatch activations: {:.1} MiB for {} tokens / {} sequences",
                if self.kv_f16 { "f16" } else { "f32" },
                mib(c.n_blocks * c.block_size * self.kv_bytes_per_position()),
                c.n_blocks,
                c.block_size,
                mib(p.plan.total_elems() * 4),
                c.max_tokens,
                c.max_seqs
            );
            let state: usize = p.buf.conv_state.iter().chain(&p.buf.ssm_state).map(|c| c.len() * 4).sum();
            if state > 0 {
                report += &format!("\nrecurrent state of the batch (f32): {:.2} MiB in {} slots", mib(state), c.max_seqs);
            }
        }
        report
    }

    fn init_paged(&mut self, config: PagedKvConfig) -> anyhow::Result<()> {
        let PagedKvConfig { n_blocks, block_size, max_seqs, max_tokens, state_snapshots } = config;
        if n_blocks == 0 || block_size == 0 || max_seqs == 0 || max_tokens == 0 {
            bail!("paged kv cache: every size must be positive, got {config:?}");
        }
        let graph = &self.model.graph;
        if state_snapshots > 0 && !graph.has_recurrent_state() {
            bail!("state snapshots asked for a model without recurrent layers");
        }
        let state_slots = max_seqs + state_snapshots;
        let plan = planner::plan_rows(graph, max_tokens, max_seqs, true);
        plan.check(graph).map_err(|e| anyhow!("batch memory plan violates the aliasing rule: {e}"))?;
        let rows = n_blocks.checked_mul(block_size).and_then(|r| r.checked_mul(self.kv_width()));
        let Some(elems) = rows else { bail!("paged kv cache of {n_blocks} blocks x {block_size} is too large") };
        self.paged = None; // free the old cache first
        // K/V blocks for the attention layers, state slots for the Gated DeltaNet ones.
        let attention = graph.attention_layers();
        let kv = |l: usize| KvRows::zeros(self.kv_f16, if attention.contains(&l) { elems } else { 0 });
        let (mut conv_state, mut ssm_state) = (vec![Vec::new(); graph.n_layers], vec![Vec::new(); graph.n_layers]);
        for op in &graph.ops {
            if let Op::GatedDeltaNet { layer, shape, .. } = op {
                conv_state[*layer] = vec![0f32; state_slots * shape.conv_state_len()];
                ssm_state[*layer] = vec![0f32; state_slots * shape.ssm_state_len()];
            }
        }
        let buf = Buffers {
            slots: plan.slot_elems.iter().map(|&n| vec![0f32; n]).collect(),
            k_cache: (0..graph.n_layers).map(kv).collect(),
            v_cache: (0..graph.n_layers).map(kv).collect(),
            conv_state,
            ssm_state,
            profile: OpProfile::from_env(),
            ..Buffers::default()
        };
        self.paged = Some(Paged { config, plan, buf, cursors: vec![RecurrentCursor::default(); state_slots] });
        Ok(())
    }

    fn copy_state(&mut self, from: usize, to: usize) -> anyhow::Result<()> {
        let Some(paged) = self.paged.as_mut() else { bail!("copy_state before init_paged") };
        RecurrentCursor::copy_slot(&self.model.graph, &mut paged.cursors, from, to)?;
        let slots = paged.cursors.len();
        for state in paged.buf.conv_state.iter_mut().chain(paged.buf.ssm_state.iter_mut()).filter(|st| !st.is_empty()) {
            let len = state.len() / slots;
            state.copy_within(from * len..(from + 1) * len, to * len);
        }
        Ok(())
    }

    fn forward_paged(&mut self, batch: &[SeqChunk<'_>]) -> anyhow::Result<Vec<Vec<f32>>> {
        let Some(mut paged) = self.paged.take() else { bail!("forward_paged before init_paged") };
        let result = self.run_paged(&mut paged, batch, |_, logits| logits.to_vec());
        self.paged = Some(paged);
        result
    }

    /// Greedy draws here, from the logits in place: a batched step's logits copied out for the
    /// host to take their argmax were ~1.5 MB of copies and fresh pages per 8-sequence step.
    /// Other draws need the host's sampler (its RNG stream), so their logits go back.
    fn forward_paged_sampled(&mut self, batch: &[SeqChunk<'_>], sample: &[Option<DeviceSampling>]) -> anyhow::Result<Vec<PagedOutput>> {
        anyhow::ensure!(batch.len() == sample.len(), "{} sequences but {} sampling settings", batch.len(), sample.len());
        let Some(mut paged) = self.paged.take() else { bail!("forward_paged before init_paged") };
        let result = self.run_paged(&mut paged, batch, |i, logits| match sample[i] {
            Some(s) if s.is_greedy() => PagedOutput::Token(ferrite_model::argmax(logits)),
            _ => PagedOutput::Logits(logits.to_vec()),
        });
        self.paged = Some(paged);
        result
    }
}

impl Drop for CpuExecutor {
    fn drop(&mut self) {
        if let Some(p) = &self.buf.profile {
            eprint!("{}", p.report(&self.describe()));
        }
        if let Some(p) = self.paged.as_ref().and_then(|p| p.buf.profile.as_ref()) {
            eprint!("{}", p.report(&format!("{}, batched steps", self.describe())));
        }
    }
}

/// A step's attention over a layer's cache: `q` and `out` hold the step's rows, each sequence's
/// keys and values are found through its block table.
fn attend_step<T: KvElem>(params: &AttentionParams, step: &Step<'_>, q: &[f32], k: &[T], v: &[T], out: &mut [f32]) {
    let kv = PagedKv { k, v, block_size: step.block_size };
    let seqs: Vec<_> = step.seqs.iter().map(|s| PagedSeq { blocks: s.blocks, start_pos: s.start_pos, n_tokens: s.n }).collect();
    kernels::attention::attention_paged(params, q, &kv, &seqs, out);
}

/// Run `f` on a worker of `pool` (a rank's own) or of the global pool: the kernels' parallel
/// loops then fork from inside the pool, instead of paying a cross-thread hand-off and wake-up
/// per kernel (3x on decode). Meanwhile the pool's other workers stay awake: each runs a job
/// that takes the forward pass's pending work (`rayon::yield_now`) until `f` returns, yielding
/// the core to other threads when there is none, where an idle rayon worker would soon sleep
/// and cost a wake-up at every later parallel loop (~10% of an 8-sequence step).
fn on_pool<R: Send>(pool: Option<&rayon::ThreadPool>, f: impl FnOnce() -> R + Send) -> R {
    match pool {
        Some(pool) => pool.install(|| with_workers_awake(f)),
        None => with_workers_awake(f),
    }
}

fn with_workers_awake<R: Send>(f: impl FnOnce() -> R + Send) -> R {
    use std::sync::atomic::{AtomicBool, Ordering};
    /// Ends the workers' jobs however `f` ends (a panic included: the scope waits for them).
    struct Done<'a>(&'a AtomicBool);
    impl Drop for Done<'_> {
        fn drop(&mut self) {
            self.0.store(true, Ordering::Release);
        }
    }
    let done = AtomicBool::new(false);
    rayon::scope(|s| {
        let caller = rayon::current_thread_index();
        for _ in 1..rayon::current_num_threads() {
            let done = &done;
            s.spawn(move |_| {
                // Taken back by the caller's own thread (in a wait of its own): nothing to do.
                if rayon::current_thread_index() == caller {
                    return;
                }
                while !done.load(Ordering::Acquire) {
                    if rayon::yield_now() == Some(rayon::Yield::Idle) {
                        std::thread::yield_now();
                    }
                }
            });
        }
        let _done = Done(&done);
        f()
    })
}

/// The kernel of a gated MLP activation: `out = act(gate) * up`.
fn gated_activation(act: GatedActivation) -> fn(&[f32], &[f32], &mut [f32]) {
    match act {
        GatedActivation::Silu => activation::swiglu,
        GatedActivation::GeluTanh => activation::geglu_tanh,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The decode team's size: from the weights a token reads, or FERRITE_DECODE_THREADS,
    /// always within the pool.
    #[test]
    fn decode_team_follows_the_weights_a_token_reads() {
        // SmolLM2-135M (~84 MB of linear weights) on 16 cores: 5 threads; on 2 cores: both.
        assert_eq!(decode_team(84_000_000, None, 16), 5);
        assert_eq!(decode_team(84_000_000, None, 2), 2);
        // Small models keep at least 4; large ones take the whole pool.
        assert_eq!(decode_team(10_000_000, None, 16), 4);
        assert_eq!(decode_team(4_000_000_000, None, 16), 16);
        // FERRITE_DECODE_THREADS, within the pool.
        assert_eq!(decode_team(84_000_000, Some(12), 16), 12);
        assert_eq!(decode_team(84_000_000, Some(64), 16), 16);
        assert_eq!(decode_team(84_000_000, Some(0), 16), 1);
    }

    /// The awake workers take the pass's parallel work, the value comes back, and a panic in
    /// the pass ends their jobs (the scope waits for them) and reaches the caller: no hang.
    #[test]
    fn workers_awake_serve_the_pass_and_end_with_it() {
        let sum: u64 = on_pool(None, || (0..100_000u64).into_par_iter().sum());
        assert_eq!(sum, 100_000 * 99_999 / 2);
        let pool = rayon::ThreadPoolBuilder::new().num_threads(3).build().unwrap();
        let caught = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            on_pool(Some(&pool), || (0..64).into_par_iter().for_each(|i| assert!(i != 40, "a kernel's check")))
        }));
        assert!(caught.is_err());
        assert_eq!(on_pool(Some(&pool), || 7), 7);
    }
}
