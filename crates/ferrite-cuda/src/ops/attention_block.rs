//! The attention half of a one-token decoder layer in one launch (see
//! `kernels/attention_block.rs`): QKV projection, RoPE and K/V store, attention, output
//! projection plus the residual, and the int8 hand-off to the next linear.

use super::{addr, as_u32, check_len, DeviceView, KvCache, Q8Emit, Q8Input, RopeConfig};
use crate::error::CudaError;
use crate::kernels::attention::KvDtype;
use crate::kernels::attention_block::{AttentionBlockParams, AttentionBlockVariant};
use crate::weight::DeviceWeight;
use crate::Gpu;
use cudarc::driver::{CudaSlice, DevicePtr};

/// The fused QKV projection (`q | k | v` rows) and the output projection of a layer.
#[derive(Clone, Copy)]
pub struct AttentionBlockWeights<'a> {
    pub qkv: &'a DeviceWeight,
    pub o: &'a DeviceWeight,
}

/// A layer's attention shapes and settings.
#[derive(Clone, Copy, Debug)]
pub struct AttentionBlockConfig {
    /// Width of the residual stream.
    pub dim: usize,
    pub n_heads: usize,
    pub n_kv_heads: usize,
    pub head_dim: usize,
    pub rope: RopeConfig,
    /// Attention score scale.
    pub scale: f32,
}

/// How a layer runs as `attention_block`: the kernel variant and the cached rows each block
/// stages in shared memory (one-token steps at positions up to `kv_rows` read no cache row from
/// global memory).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AttentionBlockPlan {
    pub variant: AttentionBlockVariant,
    pub kv_rows: usize,
}

/// The heads' partial sums and the arrival counter of one launch (reused by every layer: the
/// launches of a step are ordered).
pub struct AttentionBlockScratch {
    partials: CudaSlice<f32>,
    counter: CudaSlice<u32>,
}

impl AttentionBlockScratch {
    pub fn new(gpu: &Gpu, n_heads: usize, dim: usize) -> Result<Self, CudaError> {
        Ok(AttentionBlockScratch { partials: gpu.alloc_zeros(n_heads.max(1) * dim.max(1))?, counter: gpu.alloc_zeros(1)? })
    }
}

/// Bytes of shared memory the kernel declares statically, rounded up.
const STATIC_SMEM: usize = 256;

/// Fewest staged cache rows worth the kernel: below, the separate kernels serve every context.
const MIN_KV_ROWS: usize = 64;

/// The plan for a layer of `w` with `cfg` over a cache of `kv` values and `max_seq` positions on
/// `gpu`, or why `attention_block` cannot run it.
pub fn attention_block_plan(gpu: &Gpu, w: &AttentionBlockWeights, cfg: &AttentionBlockConfig, kv: KvDtype, max_seq: usize) -> Result<AttentionBlockPlan, String> {
    let wtype = w.qkv.dtype;
    if !AttentionBlockVariant::supports(wtype) || w.o.dtype != wtype {
        return Err(format!("QKV {wtype} and output {} weights: one of Q4_0, Q4_1, Q8_0 for both", w.o.dtype));
    }
    let AttentionBlockConfig { dim, n_heads, n_kv_heads, head_dim: hd, rope, .. } = *cfg;
    if !matches!(hd, 32 | 64 | 128 | 256) || n_kv_heads == 0 || !n_heads.is_multiple_of(n_kv_heads) {
        return Err(format!("head size {hd}, {n_heads} query heads over {n_kv_heads} KV heads"));
    }
    let q_dim = n_heads * hd;
    if dim == 0 || !dim.is_multiple_of(32) {
        return Err(format!("width {dim}: whole 32-value blocks only"));
    }
    if w.qkv.cols != dim || w.qkv.rows != q_dim + 2 * n_kv_heads * hd || w.o.rows != dim || w.o.cols != q_dim {
        return Err(format!("weight shapes do not make an attention of width {dim}, {n_heads}/{n_kv_heads} heads of {hd}"));
    }
    if rope.head_dim != hd || rope.rot_dim == 0 || !rope.rot_dim.is_multiple_of(2) || rope.rot_dim > hd {
        return Err(format!("RoPE over {} of {} dimensions for heads of {hd}", rope.rot_dim, rope.head_dim));
    }
    let variant = AttentionBlockVariant { wtype, head_dim: hd as u32, neox: rope.neox, kv };
    // (Less the kernel's static shared memory: a flag and alignment.)
    let room = (gpu.max_shared_memory() as usize).saturating_sub(variant.smem_bytes(dim, 0) + STATIC_SMEM) / variant.kv_row_bytes();
    let kv_rows = room.min(max_seq);
    if kv_rows < MIN_KV_ROWS.min(max_seq) {
        return Err(format!(
            "a head's weights take {} bytes of shared memory, leaving room for {room} cached rows of the device's {} bytes (fewest {MIN_KV_ROWS})",
            variant.smem_bytes(dim, 0),
            gpu.max_shared_memory()
        ));
    }
    Ok(AttentionBlockPlan { variant, kv_rows })
}

/// The attention half of a one-token decoder layer at `positions[0]`: `out = residual +
/// o_proj(attention(rope(qkv_proj(input))))`, the new K/V row stored in `cache`, and with `emit`
/// the int8 hand-off of `out` to the next linear (codes of `out * norm weight` and their sums of
/// squares when it has a norm). `input` holds the layer's int8 input (`1 x dim`, the RMSNorm
/// pending or applied). `emit` may be the buffer `input` came from: the kernel writes it after
/// its last read. A position `>= max_seq` leaves NaN in `out` and is reported by
/// [`Gpu::check_device`].
#[allow(clippy::too_many_arguments)]
pub fn attention_block(
    gpu: &Gpu,
    w: &AttentionBlockWeights,
    input: Q8Input,
    cfg: &AttentionBlockConfig,
    plan: &AttentionBlockPlan,
    cache: &mut KvCache,
    positions: &impl DevicePtr<u32>,
    scratch: &mut AttentionBlockScratch,
    residual: DeviceView,
    out: DeviceView,
    emit: Option<Q8Emit>,
) -> Result<(), CudaError> {
    const OP: &str = "attention_block";
    let checked = attention_block_plan(gpu, w, cfg, cache.dtype, cache.max_seq).map_err(|why| CudaError::invalid(OP, why))?;
    if checked.variant != plan.variant || plan.kv_rows > checked.kv_rows {
        return Err(CudaError::invalid(OP, format!("plan {plan:?} does not fit this layer and device ({checked:?})")));
    }
    if cache.head_dim != cfg.head_dim || cache.n_kv_heads != cfg.n_kv_heads {
        return Err(CudaError::invalid(OP, format!("cache of {} KV heads of {} for a layer of {} of {}", cache.n_kv_heads, cache.head_dim, cfg.n_kv_heads, cfg.head_dim)));
    }
    let dim = cfg.dim;
    check_len(OP, "positions", positions.len(), 1)?;
    check_len(OP, "residual", residual.len, dim)?;
    check_len(OP, "out", out.len, dim)?;
    check_len(OP, "partials", scratch.partials.len(), cfg.n_heads * dim)?;
    let (emit_q, emit_s, emit_norm, emit_partials, emit_add_one) = match emit {
        Some(e) => {
            if let Some(nm) = &e.norm {
                check_len(OP, "hand-off norm weight", nm.weight.len(), dim)?;
            }
            e.dst.fill(OP, 1, dim, e.norm.map(|nm| nm.eps))?;
            let (q, s, p) = e.dst.ptrs(gpu);
            match e.norm {
                Some(nm) => (q, s, addr(gpu, nm.weight), p, u32::from(nm.add_one)),
                None => (q, s, 0, 0, 0),
            }
        }
        None => (0, 0, 0, 0, 0),
    };
    let planes = |m: &DeviceWeight| {
        let [p0, p1, ..] = m.row_plane_ptrs(gpu, 0);
        (p0, p1)
    };
    let ((wqkv0, wqkv1), (wo0, wo1)) = (planes(w.qkv), planes(w.o));
    let (k_cache, v_cache) = cache.ptrs(gpu);
    let params = AttentionBlockParams {
        wqkv0,
        wqkv1,
        wo0,
        wo1,
        xq: input.xq,
        xs: input.xs,
        in_partials: input.norm.map_or(0, |(p, _)| p),
        residual: residual.ptr,
        out: out.ptr,
        k_cache,
        v_cache,
        positions: addr(gpu, positions),
        error_flag: gpu.error_flag_ptr(),
        partials: addr(gpu, &scratch.partials),
        counter: addr(gpu, &scratch.counter),
        emit_q,
        emit_s,
        emit_norm,
        emit_partials,
        dim: as_u32(OP, "dim", dim)?,
        n_heads: cfg.n_heads as u32,
        n_kv_heads: cfg.n_kv_heads as u32,
        max_seq: as_u32(OP, "max_seq", cache.max_seq)?,
        rot_dim: cfg.rope.rot_dim as u32,
        kv_rows: plan.kv_rows as u32,
        in_norm: u32::from(input.norm.is_some()),
        emit_add_one,
        in_eps: input.norm.map_or(0.0, |(_, eps)| eps),
        theta: cfg.rope.theta,
        freq_scale: cfg.rope.freq_scale,
        scale: cfg.scale,
    };
    gpu.launch(&plan.variant, "attention_block", plan.variant.launch_config(cfg.n_heads, dim, plan.kv_rows), &params)
}
