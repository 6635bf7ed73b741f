//! Thread-block clusters (see `kernels/cluster.rs`): the probe of their phase cost, and a
//! one-token decoder layer in one cluster.

use super::{addr, addr_mut, as_u32, check_len, DeviceView, KvCache, RopeConfig};
use crate::error::CudaError;
use crate::kernels::attention::KvDtype;
use crate::kernels::cluster::{ClusterLayerParams, ClusterLayerVariant, ClusterPhasesParams, ClusterPhasesVariant, LayerDims};
use crate::weight::DeviceWeight;
use crate::Gpu;
use ferrite_core::env;
use cudarc::driver::{DevicePtr, DevicePtrMut};

/// Most blocks per cluster on the H100/H200 (8 portable, 16 with the non-portable opt-in).
pub const MAX_CLUSTER: usize = 16;

/// Whether `gpu` runs clusters of `cluster` blocks (sm_90, 1-[`MAX_CLUSTER`] blocks).
fn check_cluster(gpu: &Gpu, cluster: usize) -> Result<(), String> {
    let (major, minor) = gpu.compute_capability();
    if major < 9 {
        return Err(format!("thread-block clusters need sm_90, the device is sm_{major}{minor}"));
    }
    if !(1..=MAX_CLUSTER).contains(&cluster) {
        return Err(format!("clusters of {cluster} blocks: need 1-{MAX_CLUSTER} blocks"));
    }
    Ok(())
}

/// `clusters` clusters of `cluster` blocks run `phases` phases; in each, every block streams
/// `bytes_per_block` of `data` (a fresh slice each phase), hands `values` floats to every block
/// of its cluster through distributed shared memory and meets them at the cluster barrier.
/// `out` gets each block's last value. Needs sm_90.
#[allow(clippy::too_many_arguments)]
pub fn cluster_phases(
    gpu: &Gpu,
    data: &impl DevicePtr<u8>,
    bytes_per_block: usize,
    phases: usize,
    values: usize,
    cluster: usize,
    clusters: usize,
    out: &mut impl DevicePtrMut<f32>,
) -> Result<(), CudaError> {
    const OP: &str = "cluster_phases";
    check_cluster(gpu, cluster).map_err(|why| CudaError::invalid(OP, why))?;
    if clusters == 0 {
        return Err(CudaError::invalid(OP, "no clusters to launch"));
    }
    if !(1..=ClusterPhasesVariant::THREADS as usize).contains(&values) {
        return Err(CudaError::invalid(OP, format!("{values} values per block: need 1-{}", ClusterPhasesVariant::THREADS)));
    }
    if !bytes_per_block.is_multiple_of(16) || bytes_per_block > data.len() {
        return Err(CudaError::invalid(OP, format!("{bytes_per_block} bytes per block: need a multiple of 16 within the {} bytes of data", data.len())));
    }
    let blocks = cluster * clusters;
    check_len(OP, "out", out.len(), blocks)?;
    let variant = ClusterPhasesVariant { cluster: cluster as u32 };
    let params = ClusterPhasesParams {
        data: addr(gpu, data),
        data_bytes: data.len() as u64,
        out: addr_mut(gpu, out),
        bytes_per_block: as_u32(OP, "bytes_per_block", bytes_per_block)?,
        phases: as_u32(OP, "phases", phases)?,
        values: values as u32,
        pad: 0,
    };
    gpu.launch(&variant, "cluster_phases", variant.launch_config(as_u32(OP, "clusters", clusters)?, values as u32), &params)
}

/// A decoder layer's weights for [`cluster_layer`]: the fused QKV projection (`q | k | v`
/// rows), the output projection, the gate and up rows (each a weight and its first row, so a
/// fused `[gate; up]` weight serves both) and the down projection.
pub struct ClusterLayerWeights<'a> {
    pub qkv: &'a DeviceWeight,
    pub o: &'a DeviceWeight,
    pub gate: (&'a DeviceWeight, usize),
    pub up: (&'a DeviceWeight, usize),
    pub down: &'a DeviceWeight,
}

/// The layer's shapes and attention settings.
#[derive(Clone, Copy, Debug)]
pub struct ClusterLayerConfig {
    pub dims: LayerDims,
    pub head_dim: usize,
    pub rope: Option<RopeConfig>,
    pub eps: f32,
    /// Attention score scale.
    pub scale: f32,
    /// Most cache rows a block copies into shared memory for its head (`None`: as many as the
    /// device's shared memory holds, up to the cache's length).
    pub kv_rows: Option<usize>,
}

/// The `cluster_layer` variant for a layer of `w` with `cfg` on `gpu` in clusters of `cluster`
/// blocks, or why the kernel cannot run it.
pub fn cluster_layer_variant(gpu: &Gpu, w: &ClusterLayerWeights, cfg: &ClusterLayerConfig, kv: KvDtype, cluster: usize) -> Result<ClusterLayerVariant, String> {
    check_cluster(gpu, cluster)?;
    let wtype = w.qkv.dtype;
    if !ClusterLayerVariant::supports(wtype) || [w.o, w.gate.0, w.up.0, w.down].iter().any(|m| m.dtype != wtype) {
        return Err(format!("weights {} / {} / {} / {} / {}: one of Q4_0, Q4_1, Q8_0 for all", wtype, w.o.dtype, w.gate.0.dtype, w.up.0.dtype, w.down.dtype));
    }
    let LayerDims { dim, n_heads, n_kv_heads, ff } = cfg.dims;
    let hd = cfg.head_dim;
    if !matches!(hd, 32 | 64 | 128 | 256) || n_kv_heads == 0 || !n_heads.is_multiple_of(n_kv_heads) {
        return Err(format!("head size {hd}, {n_heads} query heads over {n_kv_heads} KV heads"));
    }
    let q_dim = cfg.dims.q_dim(hd);
    if [dim, q_dim, ff].iter().any(|n| *n == 0 || !n.is_multiple_of(32)) {
        return Err(format!("width {dim}, query width {q_dim}, MLP width {ff}: whole 32-value blocks only"));
    }
    let shape = |m: &DeviceWeight, first: usize, rows: usize, cols: usize| m.cols == cols && m.rows >= first + rows;
    if !shape(w.qkv, 0, cfg.dims.qkv_rows(hd), dim) || !shape(w.o, 0, dim, q_dim) || !shape(w.gate.0, w.gate.1, ff, dim) || !shape(w.up.0, w.up.1, ff, dim) || !shape(w.down, 0, dim, ff) {
        return Err(format!("weight shapes do not make a layer of width {dim}, {n_heads}/{n_kv_heads} heads of {hd}, MLP width {ff}"));
    }
    if let Some(r) = &cfg.rope {
        if r.head_dim != hd || r.rot_dim == 0 || !r.rot_dim.is_multiple_of(2) || r.rot_dim > hd {
            return Err(format!("RoPE over {} of {} dimensions for heads of {hd}", r.rot_dim, r.head_dim));
        }
    }
    let threads = match env::CUDA_CLUSTER_LAYER_THREADS.parse(256u32) {
        t @ (256 | 512) => t,
        t => return Err(format!("{}={t}: 256 or 512", env::CUDA_CLUSTER_LAYER_THREADS.name)),
    };
    let variant = ClusterLayerVariant { wtype, cluster: cluster as u32, threads, head_dim: hd as u32, neox: cfg.rope.is_some_and(|r| r.neox), kv };
    let smem = variant.base_smem_bytes(&cfg.dims);
    if smem > gpu.max_shared_memory() as usize {
        return Err(format!("{smem} bytes of shared memory per block in clusters of {cluster}: over the device's {}", gpu.max_shared_memory()));
    }
    match gpu.max_active_clusters(&variant, "cluster_layer", variant.launch_config(&cfg.dims, staged_rows(gpu, &variant, cfg, usize::MAX))) {
        Ok(0) => Err(format!("the device cannot place a cluster of {cluster} blocks of {smem} bytes of shared memory")),
        Ok(_) => Ok(variant),
        Err(e) => Err(e.to_string()),
    }
}

/// Cache rows a block of `variant` stages for a cache of `max_seq` positions: what the
/// configuration allows and the device's shared memory holds.
fn staged_rows(gpu: &Gpu, variant: &ClusterLayerVariant, cfg: &ClusterLayerConfig, max_seq: usize) -> usize {
    let room = (gpu.max_shared_memory() as usize).saturating_sub(variant.base_smem_bytes(&cfg.dims)) / variant.kv_row_bytes();
    room.min(max_seq).min(cfg.kv_rows.unwrap_or(usize::MAX))
}

/// [`cluster_layer_variant`] in the largest cluster the device can place (16 blocks, else 8).
pub fn cluster_layer_plan(gpu: &Gpu, w: &ClusterLayerWeights, cfg: &ClusterLayerConfig, kv: KvDtype) -> Result<ClusterLayerVariant, String> {
    cluster_layer_variant(gpu, w, cfg, kv, MAX_CLUSTER).or_else(|wide| cluster_layer_variant(gpu, w, cfg, kv, 8).map_err(|narrow| format!("{wide}; {narrow}")))
}

/// One decoder layer of a one-token decode step (see [`ClusterLayerVariant`]) from the residual
/// stream `x` (`dim` values) to `out` (which may be `x`): RMSNorm (`attn_norm`), QKV, RoPE, the K/V store
/// at `positions[0]` of `cache`, attention over rows `0..=positions[0]`, the output projection
/// plus the residual, RMSNorm (`ffn_norm`), gate/up with SwiGLU, the down projection plus the
/// residual. A position `>= max_seq` leaves NaN in `out` and is reported by
/// [`Gpu::check_device`].
#[allow(clippy::too_many_arguments)]
pub fn cluster_layer(
    gpu: &Gpu,
    w: &ClusterLayerWeights,
    attn_norm: &impl DevicePtr<f32>,
    ffn_norm: &impl DevicePtr<f32>,
    cfg: &ClusterLayerConfig,
    cache: &mut KvCache,
    positions: &impl DevicePtr<u32>,
    cluster: usize,
    x: DeviceView,
    out: DeviceView,
) -> Result<(), CudaError> {
    const OP: &str = "cluster_layer";
    let variant = cluster_layer_variant(gpu, w, cfg, cache.dtype, cluster).map_err(|why| CudaError::invalid(OP, why))?;
    let d = cfg.dims;
    if cache.head_dim != cfg.head_dim || cache.n_kv_heads != d.n_kv_heads {
        return Err(CudaError::invalid(OP, format!("cache of {} KV heads of {} for a layer of {} of {}", cache.n_kv_heads, cache.head_dim, d.n_kv_heads, cfg.head_dim)));
    }
    check_len(OP, "attn_norm", attn_norm.len(), d.dim)?;
    check_len(OP, "ffn_norm", ffn_norm.len(), d.dim)?;
    check_len(OP, "positions", positions.len(), 1)?;
    check_len(OP, "x", x.len, d.dim)?;
    check_len(OP, "out", out.len, d.dim)?;
    // Planes 0 and 1 of `m` from row `first` on.
    let planes = |m: &DeviceWeight, first: usize| {
        let [p0, p1, ..] = m.row_plane_ptrs(gpu, first);
        (p0, p1)
    };
    let (wqkv0, wqkv1) = planes(w.qkv, 0);
    let (wo0, wo1) = planes(w.o, 0);
    let (wgate0, wgate1) = planes(w.gate.0, w.gate.1);
    let (wup0, wup1) = planes(w.up.0, w.up.1);
    let (wdown0, wdown1) = planes(w.down, 0);
    let kv_rows = staged_rows(gpu, &variant, cfg, cache.max_seq);
    let (k_cache, v_cache) = cache.ptrs(gpu);
    let rope = cfg.rope;
    let params = ClusterLayerParams {
        wqkv0,
        wqkv1,
        wo0,
        wo1,
        wgate0,
        wgate1,
        wup0,
        wup1,
        wdown0,
        wdown1,
        attn_norm: addr(gpu, attn_norm),
        ffn_norm: addr(gpu, ffn_norm),
        x: x.ptr,
        out: out.ptr,
        k_cache,
        v_cache,
        positions: addr(gpu, positions),
        error_flag: gpu.error_flag_ptr(),
        dim: as_u32(OP, "dim", d.dim)?,
        n_heads: d.n_heads as u32,
        n_kv_heads: d.n_kv_heads as u32,
        ff: as_u32(OP, "ff", d.ff)?,
        max_seq: cache.max_seq as u32,
        rot_dim: rope.map_or(0, |r| r.rot_dim as u32),
        weight_bytes: variant.weight_bytes(&d) as u32,
        kv_rows: kv_rows as u32,
        eps: cfg.eps,
        theta: rope.map_or(0.0, |r| r.theta),
        freq_scale: rope.map_or(0.0, |r| r.freq_scale),
        scale: cfg.scale,
        pad: 0,
    };
    gpu.launch(&variant, "cluster_layer", variant.launch_config(&d, kv_rows), &params)
}
