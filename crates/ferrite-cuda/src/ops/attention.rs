//! KV cache and attention ops.

use super::{addr, addr_mut, as_u32, check_len, elems};
use super::{Precision, Q8Activations, StagedActivations, StagedLayout};
use crate::kernels::dequant::MmaOrder;
use crate::error::CudaError;
use super::RopeConfig;
use crate::kernels::attention::{AttentionParams, AttentionVariant, KvDtype, RopeStyle, StoreQkvParams, StoreQkvVariant};
use crate::kernels::flash_attention::FlashAttentionVariant;
use ferrite_core::env;
use crate::Gpu;
use cudarc::driver::{CudaSlice, DevicePtr, DevicePtrMut};
use half::f16;

/// One layer's K and V cache, `[max_seq, n_kv_heads, head_dim]` each, in device memory.
pub struct KvCache {
    k: CudaSlice<u8>,
    v: CudaSlice<u8>,
    pub dtype: KvDtype,
    pub max_seq: usize,
    pub n_kv_heads: usize,
    pub head_dim: usize,
}

impl KvCache {
    /// A zeroed cache. `head_dim` must be 32, 64, 128 or 256 (the attention kernel's lane
    /// layout splits rows in whole 16-byte vectors).
    pub fn new(
        gpu: &Gpu,
        dtype: KvDtype,
        max_seq: usize,
        n_kv_heads: usize,
        head_dim: usize,
    ) -> Result<Self, CudaError> {
        const OP: &str = "KvCache::new";
        if !matches!(head_dim, 32 | 64 | 128 | 256) {
            return Err(CudaError::invalid(OP, format!("head_dim {head_dim} is not one of 32, 64, 128, 256")));
        }
        if max_seq == 0 || n_kv_heads == 0 {
            return Err(CudaError::invalid(OP, format!("empty cache ({max_seq} positions, {n_kv_heads} KV heads)")));
        }
        as_u32(OP, "max_seq", max_seq)?;
        as_u32(OP, "KV row", n_kv_heads * head_dim)?;
        let bytes = elems(OP, &[max_seq, n_kv_heads, head_dim, dtype.bytes()])?;
        Ok(KvCache { k: gpu.alloc_zeros(bytes)?, v: gpu.alloc_zeros(bytes)?, dtype, max_seq, n_kv_heads, head_dim })
    }

    /// Values per cache row (one position).
    pub fn row_len(&self) -> usize {
        self.n_kv_heads * self.head_dim
    }

    /// Copy K and V back as f32 (diagnostics and tests; waits for the stream).
    pub fn download(&self, gpu: &Gpu) -> Result<(Vec<f32>, Vec<f32>), CudaError> {
        let to_f32 = |bytes: Vec<u8>| -> Vec<f32> {
            match self.dtype {
                KvDtype::F32 => {
                    bytes.chunks_exact(4).map(|c| f32::from_le_bytes(c.try_into().expect("4 bytes"))).collect()
                }
                KvDtype::F16 => {
                    bytes.chunks_exact(2).map(|c| f16::from_le_bytes(c.try_into().expect("2 bytes")).to_f32()).collect()
                }
            }
        };
        Ok((to_f32(gpu.download(&self.k)?), to_f32(gpu.download(&self.v)?)))
    }
}

/// Split `qkv` (`[n_tokens, stride]` f32 rows holding `n_heads` Q heads, then the cache's K
/// heads, then its V heads) into `q_out` (`[n_tokens, n_heads, head_dim]`) and the cache rows
/// `positions[t]`, rotating Q and K by `rope` (its `n_heads` is ignored) on the way. A position
/// `>= max_seq` stores no K/V and is reported by [`Gpu::check_device`].
#[allow(clippy::too_many_arguments)]
pub fn store_qkv(
    gpu: &Gpu,
    cache: &mut KvCache,
    qkv: &impl DevicePtr<f32>,
    stride: usize,
    n_tokens: usize,
    n_heads: usize,
    positions: &impl DevicePtr<u32>,
    rope: Option<&RopeConfig>,
    qk_norm: Option<&QkNorm>,
    q_out: &mut impl DevicePtrMut<f32>,
) -> Result<(), CudaError> {
    store_qkv_with(gpu, cache, qkv, stride, n_tokens, n_heads, positions, rope, qk_norm, None, q_out)
}

/// Where a batch's tokens find their rows in a paged cache (serving): the sequences' block
/// tables, `max_blocks` entries each (`[n_seqs, max_blocks]` on the device), and the sequence of
/// every token row. The cache is a [`KvCache`] of `n_blocks * block_size` rows; table entries
/// must be below `n_blocks` (the caller checks them on the host, where they come from).
pub struct Paging<'a> {
    pub tables: &'a CudaSlice<u32>,
    pub row_seq: &'a CudaSlice<u32>,
    pub n_seqs: usize,
    pub max_blocks: usize,
    pub block_size: usize,
}

impl Paging<'_> {
    /// Checks the shapes against the cache and the batch; returns the addressable positions.
    fn check(&self, op: &'static str, cache: &KvCache, n_tokens: usize) -> Result<usize, CudaError> {
        if self.block_size == 0 || !cache.max_seq.is_multiple_of(self.block_size) {
            return Err(CudaError::invalid(op, format!("{} cache rows are not whole blocks of {}", cache.max_seq, self.block_size)));
        }
        check_len(op, "block tables", self.tables.len(), elems(op, &[self.n_seqs, self.max_blocks])?)?;
        check_len(op, "row sequences", self.row_seq.len(), n_tokens)?;
        let positions = elems(op, &[self.max_blocks, self.block_size])?;
        as_u32(op, "positions per sequence", positions)?;
        Ok(positions)
    }
}

/// [`store_qkv`] into a paged cache: token `t` writes position `positions[t]` of its sequence.
#[allow(clippy::too_many_arguments)]
pub fn store_qkv_paged(
    gpu: &Gpu,
    cache: &mut KvCache,
    qkv: &impl DevicePtr<f32>,
    stride: usize,
    n_tokens: usize,
    n_heads: usize,
    positions: &impl DevicePtr<u32>,
    rope: Option<&RopeConfig>,
    qk_norm: Option<&QkNorm>,
    paging: &Paging,
    q_out: &mut impl DevicePtrMut<f32>,
) -> Result<(), CudaError> {
    store_qkv_with(gpu, cache, qkv, stride, n_tokens, n_heads, positions, rope, qk_norm, Some(paging), q_out)
}

#[allow(clippy::too_many_arguments)]
fn store_qkv_with(
    gpu: &Gpu,
    cache: &mut KvCache,
    qkv: &impl DevicePtr<f32>,
    stride: usize,
    n_tokens: usize,
    n_heads: usize,
    positions: &impl DevicePtr<u32>,
    rope: Option<&RopeConfig>,
    qk_norm: Option<&QkNorm>,
    paging: Option<&Paging>,
    q_out: &mut impl DevicePtrMut<f32>,
) -> Result<(), CudaError> {
    const OP: &str = "store_qkv";
    if n_tokens == 0 {
        return Ok(());
    }
    let row = (n_heads + 2 * cache.n_kv_heads) * cache.head_dim;
    if stride < row {
        return Err(CudaError::invalid(OP, format!("row stride {stride} is shorter than the {row} values of q | k | v")));
    }
    if let Some(r) = rope {
        r.check(OP)?;
        if r.head_dim != cache.head_dim {
            return Err(CudaError::invalid(OP, format!("RoPE head_dim {} differs from the cache's {}", r.head_dim, cache.head_dim)));
        }
    }
    check_len(OP, "qkv", qkv.len(), elems(OP, &[n_tokens - 1, stride])? + row)?;
    check_len(OP, "q_out", q_out.len(), elems(OP, &[n_tokens, n_heads, cache.head_dim])?)?;
    check_len(OP, "positions", positions.len(), n_tokens)?;
    let heads = elems(OP, &[n_tokens, n_heads + 2 * cache.n_kv_heads])?;
    let max_seq = match paging {
        Some(pg) => pg.check(OP, cache, n_tokens)?,
        None => cache.max_seq,
    };
    let norm = QkNorm::params(gpu, OP, qk_norm, cache)?;
    let variant =
        StoreQkvVariant { kv: cache.dtype, head_dim: cache.head_dim as u32, rope: rope_style(rope), paged: paging.is_some(), qk_norm: qk_norm.is_some() };
    let params = StoreQkvParams {
        qkv: addr(gpu, qkv),
        q_out: addr_mut(gpu, q_out),
        k_cache: addr_mut(gpu, &mut cache.k),
        v_cache: addr_mut(gpu, &mut cache.v),
        positions: addr(gpu, positions),
        error_flag: gpu.error_flag_ptr(),
        n_tokens: as_u32(OP, "n_tokens", n_tokens)?,
        stride: as_u32(OP, "stride", stride)?,
        n_heads: as_u32(OP, "n_heads", n_heads)?,
        n_kv_heads: cache.n_kv_heads as u32,
        max_seq: max_seq as u32,
        rot_dim: rope.map_or(0, |r| r.rot_dim as u32),
        theta: rope.map_or(0.0, |r| r.theta),
        freq_scale: rope.map_or(0.0, |r| r.freq_scale),
        block_tables: paging.map_or(0, |pg| addr(gpu, pg.tables)),
        row_seq: paging.map_or(0, |pg| addr(gpu, pg.row_seq)),
        max_blocks: paging.map_or(0, |pg| pg.max_blocks as u32),
        block_size: paging.map_or(0, |pg| pg.block_size as u32),
        q_norm: norm.q,
        k_norm: norm.k,
        q_norm_eps: norm.q_eps,
        k_norm_eps: norm.k_eps,
    };
    as_u32(OP, "heads", heads)?;
    gpu.launch(&variant, "store_qkv", variant.launch_config(heads), &params)
}

/// QK-norm (Qwen3, Gemma 3) applied by [`store_qkv`] and the fused decode store before RoPE:
/// each Q head RMS-normalised with the `head_dim` weights `q` (eps `q_eps`), each K head with
/// `k`, as an in-place [`super::head_norm`] on the Q and K columns would (up to the order of the
/// sums of squares).
pub struct QkNorm<'a> {
    pub q: &'a CudaSlice<f32>,
    pub k: &'a CudaSlice<f32>,
    pub q_eps: f32,
    pub k_eps: f32,
}

/// [`QkNorm`]'s kernel parameters: the weights' addresses (0 without a norm).
#[derive(Default)]
struct QkNormParams {
    q: u64,
    k: u64,
    q_eps: f32,
    k_eps: f32,
}

impl QkNorm<'_> {
    fn params(gpu: &Gpu, op: &'static str, norm: Option<&QkNorm>, cache: &KvCache) -> Result<QkNormParams, CudaError> {
        let Some(n) = norm else { return Ok(QkNormParams::default()) };
        check_len(op, "q_norm weight", n.q.len(), cache.head_dim)?;
        check_len(op, "k_norm weight", n.k.len(), cache.head_dim)?;
        Ok(QkNormParams { q: addr(gpu, n.q), k: addr(gpu, n.k), q_eps: n.q_eps, k_eps: n.k_eps })
    }
}

/// One decode token's attention with its K/V store fused in: `qkv` is the token's
/// `q | k | v` row (as [`store_qkv`] reads it); the kernel rotates Q and K by `rope`, writes K
/// and V to cache row `positions[0]` and attends over rows up to it, in one launch. Same
/// results as [`store_qkv`] then [`attention`] (the new key's score is summed in another order).
/// With `layout.splits > 1` the keys are cut into up to that many shares of separate blocks,
/// as in [`attention_split`], whose states `scratch` holds: as many shares run as the position
/// needs (one up to `32 x layout.warps` keys, which then skips the merge), so one launch (and
/// one captured graph) serves every context length. Each block serves `layout.group` query heads
/// of one KV group (1, or a divisor of the heads per KV head up to
/// [`AttentionVariant::MAX_GROUP`]) with `layout.warps` warps (see [`DecodeLayouts`]).
#[allow(clippy::too_many_arguments)]
pub fn store_and_attend(
    gpu: &Gpu,
    cache: &mut KvCache,
    qkv: &impl DevicePtr<f32>,
    positions: &impl DevicePtr<u32>,
    cfg: &AttentionConfig,
    rope: Option<&RopeConfig>,
    qk_norm: Option<&QkNorm>,
    layout: DecodeLayout,
    scratch: Option<&mut SplitScratch>,
    out: &mut impl DevicePtrMut<f32>,
    emit: Option<AttentionEmit>,
) -> Result<(), CudaError> {
    const OP: &str = "store_and_attend";
    let DecodeLayout { group, splits, warps, cluster } = layout;
    let row = (cfg.n_heads + 2 * cache.n_kv_heads) * cache.head_dim;
    check_len(OP, "qkv", qkv.len(), row)?;
    check_rope(OP, rope, cache)?;
    let heads_per_kv = cfg.n_heads / cache.n_kv_heads.max(1);
    if !(1..=AttentionVariant::MAX_GROUP).contains(&group) || !heads_per_kv.is_multiple_of(group) {
        return Err(CudaError::invalid(OP, format!("{group} query heads per block: not a divisor of the {heads_per_kv} heads per KV head up to {}", AttentionVariant::MAX_GROUP)));
    }
    if !matches!(warps, 4 | 8 | 16) || (group > 1 && warps != 4) {
        return Err(CudaError::invalid(OP, format!("{warps} warps per block of {group} query heads (4, 8 or 16 with one head, 4 with several)")));
    }
    if cluster && (group > 1 || !(2..=MAX_CLUSTER).contains(&splits) || !gpu.supports_clusters()) {
        return Err(CudaError::invalid(OP, format!("a cluster of {splits} shares of {group} query heads (2-{MAX_CLUSTER} shares of one head, sm_90 and later)")));
    }
    let norm = QkNorm::params(gpu, OP, qk_norm, cache)?;
    let Some(mut params) = attention_params(gpu, qkv, cache, positions, 1, cfg, out, emit)? else { return Ok(()) };
    set_store(gpu, &mut params, cache, rope, norm);
    if splits > 1 && !cluster {
        let Some(scratch) = scratch else { return Err(CudaError::invalid(OP, format!("{splits} key shares without a scratch for their states"))) };
        scratch.check(OP, splits, cfg.n_heads, cache.head_dim)?;
        params.partials = addr_mut(gpu, &mut scratch.partials);
        params.counters = addr_mut(gpu, &mut scratch.counters);
    }
    let variant = AttentionVariant {
        qk_norm: qk_norm.is_some(),
        nwarps: warps as u32,
        cluster: if cluster { splits as u32 } else { 1 },
        ..AttentionVariant::storing(cache.head_dim, cache.dtype, rope_style(rope), splits > 1 && !cluster, group)
    };
    gpu.launch(&variant, "attention", variant.launch_config(cfg.n_heads, 1, splits), &params)
}

/// A launch of the fused one-token decode kernel: query heads per block, key shares and warps
/// per block, and whether the shares of a query form a thread-block cluster (`cluster`: they
/// merge through distributed shared memory, at most [`MAX_CLUSTER`]) or merge through global
/// memory.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DecodeLayout {
    pub group: usize,
    pub splits: usize,
    pub warps: usize,
    pub cluster: bool,
}

/// Most blocks of a decode attention cluster (the portable cluster size).
pub const MAX_CLUSTER: usize = 8;

impl DecodeLayout {
    /// One block of 4 warps per `group` query heads, all keys in it.
    pub fn one_block(group: usize) -> Self {
        DecodeLayout { group, splits: 1, warps: 4, cluster: false }
    }
}

/// The one-token decode launches a model's steps take ([`store_and_attend`]), as
/// [`AttentionGroups`] allows: a block per query head (`off`, `paged`), per KV group's heads
/// (`all`), or (`adaptive`, the default) per head for short contexts and per KV group from
/// `group_from_keys` keys on. Grouped blocks load each K/V row once for their heads, which wins
/// only where per-head blocks would each read many K/V values (H200: the 8B shape from ~1 200
/// keys on, 9 shares of 128-value rows; the 1B shape from ~2 000, 64-value rows), so the switch
/// point is K/V values per share of the per-head launch, keys times head size
/// (`FERRITE_CUDA_ATTENTION_GROUP_SHARE_VALUES`, 16 384). The host knows each step's position, so
/// each layout is a captured graph of its own (no branch in the kernel: a kernel holding both
/// bodies was 12% slower at short contexts, docs/perf.md stop 24).
///
/// Between the two, a per-head launch of 4 warps splits any context past one share of 128 keys
/// and merges the shares through global memory (a partial state written, an atomic arrival, the
/// last block reading every share). From 129 keys up to `wide_to_keys` a per-head block of more
/// warps (`wide`, `FERRITE_CUDA_ATTENTION_WARPS`, default 16: 16 for heads of 64 values, 8 for
/// 128), each warp taking up to `FERRITE_CUDA_ATTENTION_WIDE_BATCHES` (2) batches of 32 keys,
/// holds every key instead, its warps merging in shared memory (H100, stop 55: SmolLM2 tg128 at
/// depth 256 +23%; two batches a warp against one, at depth 512: +3%, the 1B +10%; 16-warp
/// blocks at depth 0, or split in shares, were slower: docs/perf.md, stops 53 and 55).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DecodeLayouts {
    pub short: DecodeLayout,
    pub wide: DecodeLayout,
    pub long: DecodeLayout,
    /// Keys of the query up to which `wide` serves, from 129 on (0: never).
    pub wide_to_keys: usize,
    /// Keys of the query from which `long` serves (`usize::MAX`: never).
    pub group_from_keys: usize,
}

/// Which of [`DecodeLayouts`]'s launches a one-token step takes (each its own decode graph).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DecodeStage {
    Short = 0,
    Wide = 1,
    Long = 2,
}

impl DecodeLayouts {
    /// For a cache of `max_seq` positions of `head_dim`-value rows on `gpu`, split-KV or not
    /// (`split`).
    pub fn new(gpu: &Gpu, n_heads: usize, n_kv_heads: usize, head_dim: usize, max_seq: usize, split: bool) -> Self {
        let share_keys = env::CUDA_ATTENTION_GROUP_SHARE_VALUES.parse(16_384usize) / head_dim.max(1);
        let wide_batches = env::CUDA_ATTENTION_WIDE_BATCHES.parse(2usize).clamp(1, 64);
        let wide_cluster = if gpu.supports_clusters() { env::CUDA_ATTENTION_WIDE_CLUSTER.parse(1usize).clamp(1, MAX_CLUSTER) } else { 1 };
        let blocks =
            DecodeBlocks { mode: gpu.attention_groups(), kv_group: kv_group(gpu, n_heads, n_kv_heads), wide_warps: gpu.attention_warps(), wide_batches, wide_cluster };
        Self::plan(blocks, gpu.sm_count() as usize, n_heads, head_dim, max_seq, split, share_keys)
    }

    /// `share_keys`: keys per share of the per-head launch from which the grouped one serves.
    fn plan(blocks: DecodeBlocks, sm_count: usize, n_heads: usize, head_dim: usize, max_seq: usize, split: bool, share_keys: usize) -> Self {
        let DecodeBlocks { mode, kv_group, wide_warps, wide_batches, wide_cluster } = blocks;
        let layout = |group: usize| DecodeLayout { splits: if split { attention_splits(sm_count, n_heads / group, 1, max_seq) } else { 1 }, ..DecodeLayout::one_block(group) };
        let (short, long) = match mode {
            AttentionGroups::Off | AttentionGroups::Paged => (layout(1), layout(1)),
            AttentionGroups::All => (layout(kv_group), layout(kv_group)),
            AttentionGroups::Adaptive => (layout(1), layout(kv_group)),
        };
        let group_from_keys = if long == short { usize::MAX } else { share_keys.saturating_mul(short.splits) };
        // A wide block's batch holds at most 32 768 K/V values of its head (32 keys per warp: 16
        // warps for 64-value heads, 8 for 128, none for 256), `wide_batches` batches in all; only
        // where the short layout splits per head.
        let warps = [16, 8].into_iter().find(|&w| w <= wide_warps && w * head_dim <= 1024).unwrap_or(4);
        let wide = DecodeLayout { warps, splits: wide_cluster, cluster: wide_cluster > 1, group: 1 };
        let wide_to_keys = if split && short.group == 1 && warps > 4 { (32 * warps * wide_batches * wide_cluster).min(max_seq) } else { 0 };
        DecodeLayouts { short, wide, long, wide_to_keys, group_from_keys }
    }

    /// The launch a query of `keys` keys takes.
    pub fn stage(&self, keys: usize) -> DecodeStage {
        if keys >= self.group_from_keys {
            DecodeStage::Long
        } else if keys > 32 * self.short.warps && keys <= self.wide_to_keys {
            // Past one batch of 32 keys per warp of the short layout's block, where it splits.
            DecodeStage::Wide
        } else {
            DecodeStage::Short
        }
    }

    pub fn layout(&self, stage: DecodeStage) -> DecodeLayout {
        match stage {
            DecodeStage::Short => self.short,
            DecodeStage::Wide => self.wide,
            DecodeStage::Long => self.long,
        }
    }
}

/// How the one-token decode blocks may be shaped: [`AttentionGroups`], the query heads of a KV
/// group, the most warps of a wide block (`FERRITE_CUDA_ATTENTION_WARPS`) and the batches of 32
/// keys each of its warps takes (`FERRITE_CUDA_ATTENTION_WIDE_BATCHES`), and the wide blocks per
/// query head, one cluster (`FERRITE_CUDA_ATTENTION_WIDE_CLUSTER`).
#[derive(Clone, Copy, Debug)]
struct DecodeBlocks {
    mode: AttentionGroups,
    kv_group: usize,
    wide_warps: usize,
    wide_batches: usize,
    wide_cluster: usize,
}

/// What an attention kernel hands to the linear after it, besides its f32 output rows.
pub enum AttentionEmit<'a> {
    /// int8 blocks for an int8 GEMV (an int8 hand-off).
    Q8(&'a mut Q8Activations),
    /// 16-bit rows in the natural order, for a linear that reads its input that way
    /// (`StagedActivations::layout_for`: cuBLAS on bf16/f16; a staged hand-off).
    Staged(&'a mut StagedActivations, StagedLayout),
}

/// Most sequences of a batched decode step that [`store_and_attend_paged`] serves: on the H200
/// (8B Q4_0, docs/perf.md stop 21) it made 16-sequence steps 1.5% faster and 64-sequence ones 2%
/// slower than [`store_qkv_paged`] then [`attention_paged`].
pub const FUSED_PAGED_STORE_MAX_SEQS: usize = 16;

/// A batched decode step on the paged cache in one launch: row `t` of `qkv` (`q | k | v`
/// rows of `n_tokens` sequences, one token each, back to back) has its K/V rotated and stored
/// at `positions[t]` of its sequence and attends to its sequence's keys, the new one included;
/// the cache rows [`store_qkv_paged`] writes and the output of [`attention_paged`] after it up
/// to rounding (the new key's rows come from shared memory; op test). A step with a
/// sequence of several rows needs those two: its rows read each other's new keys.
#[allow(clippy::too_many_arguments)]
pub fn store_and_attend_paged(
    gpu: &Gpu,
    cache: &mut KvCache,
    qkv: &impl DevicePtr<f32>,
    n_tokens: usize,
    positions: &impl DevicePtr<u32>,
    cfg: &AttentionConfig,
    rope: Option<&RopeConfig>,
    qk_norm: Option<&QkNorm>,
    paging: &Paging,
    out: &mut impl DevicePtrMut<f32>,
    emit: Option<AttentionEmit>,
) -> Result<(), CudaError> {
    const OP: &str = "store_and_attend_paged";
    if n_tokens != paging.n_seqs {
        return Err(CudaError::invalid(OP, format!("{n_tokens} rows for {} sequences: one decode token per sequence", paging.n_seqs)));
    }
    let row = (cfg.n_heads + 2 * cache.n_kv_heads) * cache.head_dim;
    check_len(OP, "qkv", qkv.len(), elems(OP, &[n_tokens, row])?)?;
    check_rope(OP, rope, cache)?;
    let max_seq = paging.check(OP, cache, n_tokens)?;
    let norm = QkNorm::params(gpu, OP, qk_norm, cache)?;
    let Some(mut params) = attention_params(gpu, qkv, cache, positions, n_tokens, cfg, out, emit)? else { return Ok(()) };
    set_store(gpu, &mut params, cache, rope, norm);
    set_paging(gpu, &mut params, cfg, paging, max_seq);
    let group = attention_group(gpu, cfg.n_heads, cache.n_kv_heads);
    let variant =
        AttentionVariant { paged: true, qk_norm: qk_norm.is_some(), ..AttentionVariant::storing(cache.head_dim, cache.dtype, rope_style(rope), false, group) };
    gpu.launch(&variant, "attention", variant.launch_config(cfg.n_heads, n_tokens, 1), &params)
}

fn check_rope(op: &'static str, rope: Option<&RopeConfig>, cache: &KvCache) -> Result<(), CudaError> {
    if let Some(r) = rope {
        r.check(op)?;
        if r.head_dim != cache.head_dim {
            return Err(CudaError::invalid(op, format!("RoPE head_dim {} differs from the cache's {}", r.head_dim, cache.head_dim)));
        }
    }
    Ok(())
}

/// The fused K/V store's parameters: `q | k | v` rows where the query was, the caches written,
/// the RoPE and the QK-norm.
fn set_store(gpu: &Gpu, params: &mut AttentionParams, cache: &mut KvCache, rope: Option<&RopeConfig>, norm: QkNormParams) {
    (params.qkv, params.q) = (params.q, 0);
    (params.q_norm, params.k_norm, params.q_norm_eps, params.k_norm_eps) = (norm.q, norm.k, norm.q_eps, norm.k_eps);
    params.k_cache = addr_mut(gpu, &mut cache.k);
    params.v_cache = addr_mut(gpu, &mut cache.v);
    params.rot_dim = rope.map_or(0, |r| r.rot_dim as u32);
    params.theta = rope.map_or(0.0, |r| r.theta);
    params.freq_scale = rope.map_or(0.0, |r| r.freq_scale);
}

/// The paged kernels' parameters: block tables, row sequences, and the positions a sequence can
/// address (`max_seq`, from [`Paging::check`]) bounding positions and the window.
fn set_paging(gpu: &Gpu, params: &mut AttentionParams, cfg: &AttentionConfig, paging: &Paging, max_seq: usize) {
    params.max_seq = max_seq as u32;
    if let Some(w) = cfg.window {
        params.window = w.min(max_seq) as u32;
    }
    params.block_tables = addr(gpu, paging.tables);
    params.row_seq = addr(gpu, paging.row_seq);
    params.max_blocks = paging.max_blocks as u32;
    params.block_size = paging.block_size as u32;
}

fn rope_style(rope: Option<&RopeConfig>) -> RopeStyle {
    match rope {
        None => RopeStyle::None,
        Some(r) if r.neox => RopeStyle::Neox,
        Some(_) => RopeStyle::Normal,
    }
}

/// Query-side attention settings.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AttentionConfig {
    /// Query heads; a multiple of the cache's KV heads (grouped-query attention).
    pub n_heads: usize,
    /// Multiplier of q·k, usually `1 / sqrt(head_dim)`.
    pub scale: f32,
    /// Sliding window: attend to the last `window` positions only (`Some(0)` is an error).
    pub window: Option<usize>,
    /// Score soft-capping (Gemma 2): `s -> cap * tanh(s / cap)` after scaling.
    pub softcap: Option<f32>,
}

/// Causal attention of `q` (`[n_tokens, n_heads, head_dim]` f32) over the cache: query `t`
/// sees cache rows up to `positions[t]` (store them first with [`store_qkv`]); output has
/// `q`'s layout. Prefill and decode are the same call with different `n_tokens`. With `emit`
/// the output is also quantized into int8 blocks for the output projection's GEMV (an int8
/// hand-off; each head is whole 32-value blocks).
#[allow(clippy::too_many_arguments)]
pub fn attention(
    gpu: &Gpu,
    q: &impl DevicePtr<f32>,
    cache: &KvCache,
    positions: &impl DevicePtr<u32>,
    n_tokens: usize,
    cfg: &AttentionConfig,
    out: &mut impl DevicePtrMut<f32>,
    emit: Option<AttentionEmit>,
) -> Result<(), CudaError> {
    let path = attention_path(gpu, cache, n_tokens)?;
    attention_on(gpu, path, q, cache, positions, n_tokens, cfg, out, emit)
}

/// [`attention`] on a given kernel path (tests compare paths; the tensor path needs an f16
/// cache).
#[allow(clippy::too_many_arguments)]
pub fn attention_on(
    gpu: &Gpu,
    path: AttentionPath,
    q: &impl DevicePtr<f32>,
    cache: &KvCache,
    positions: &impl DevicePtr<u32>,
    n_tokens: usize,
    cfg: &AttentionConfig,
    out: &mut impl DevicePtrMut<f32>,
    emit: Option<AttentionEmit>,
) -> Result<(), CudaError> {
    if path == AttentionPath::Tensor {
        tensor_supports(gpu, cache)?;
    }
    let Some(params) = attention_params(gpu, q, cache, positions, n_tokens, cfg, out, emit)? else { return Ok(()) };
    match path {
        AttentionPath::Tensor => {
            let variant = FlashAttentionVariant { head_dim: cache.head_dim as u32 };
            gpu.launch(&variant, "attention_tc", variant.launch_config(cfg.n_heads, n_tokens), &params)
        }
        AttentionPath::Simt => {
            let variant = AttentionVariant::new(cache.head_dim, cache.dtype, false);
            gpu.launch(&variant, "attention", variant.launch_config(cfg.n_heads, n_tokens, 1), &params)
        }
    }
}

/// Which attention kernels run a block per KV group's query heads (`FERRITE_CUDA_ATTENTION_GROUPS`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AttentionGroups {
    /// A block per query head everywhere.
    Off,
    /// The paged kernel of batched steps.
    Paged,
    /// The paged kernel, and the one-token decode kernel deep in a context ([`DecodeLayouts`]).
    /// The default.
    Adaptive,
    /// Also the fused one-token decode kernel ([`store_and_attend`]) at every length: faster deep
    /// in a context, slower at short ones (fewer, busier blocks on the step's critical path).
    All,
}

impl AttentionGroups {
    /// `FERRITE_CUDA_ATTENTION_GROUPS`; unset, `auto` or an unknown value (reported on stderr)
    /// is the default, `adaptive`.
    pub fn from_env() -> Self {
        let choices = [("off", AttentionGroups::Off), ("paged", AttentionGroups::Paged), ("adaptive", AttentionGroups::Adaptive), ("all", AttentionGroups::All)];
        super::forced_path(&env::CUDA_ATTENTION_GROUPS, env::CUDA_ATTENTION_GROUPS.get().as_deref(), &choices).unwrap_or(AttentionGroups::Adaptive)
    }
}

/// Which kernel [`attention`] runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AttentionPath {
    /// A block per (head, query) on CUDA cores, any cache type: decode and short batches.
    Simt,
    /// Flash attention on tensor cores (f16 cache, sm_80+), 64 queries per block: prefill.
    Tensor,
}

impl AttentionPath {
    /// The path `FERRITE_CUDA_ATTENTION_PATH` forces (`simt`, `tensor`), `None` for `auto` or
    /// unset; another value is reported on stderr and means `auto`.
    pub fn forced_by(value: Option<&str>) -> Option<AttentionPath> {
        super::forced_path(&env::CUDA_ATTENTION_PATH, value, &[("simt", AttentionPath::Simt), ("tensor", AttentionPath::Tensor)])
    }
}

/// Smallest batch the tensor-core kernel takes by default: below it most of each 64-query
/// tile would be idle, and decode-sized batches are the one-query kernel's job.
pub const FLASH_MIN_TOKENS: usize = 16;

/// The kernel for `n_tokens` queries over `cache`: the tensor-core kernel from
/// [`FLASH_MIN_TOKENS`] where it applies (f16 cache, sm_80+), else the SIMT kernel. Forcing the
/// tensor path where it cannot run is an error, not a silent fallback.
pub fn attention_path(gpu: &Gpu, cache: &KvCache, n_tokens: usize) -> Result<AttentionPath, CudaError> {
    match gpu.attention_path() {
        Some(AttentionPath::Tensor) => tensor_supports(gpu, cache).map(|()| AttentionPath::Tensor),
        Some(path) => Ok(path),
        None if n_tokens >= FLASH_MIN_TOKENS && tensor_supports(gpu, cache).is_ok() => Ok(AttentionPath::Tensor),
        None => Ok(AttentionPath::Simt),
    }
}

/// Whether the tensor-core kernel can attend over `cache` on this device; the error says why not.
fn tensor_supports(gpu: &Gpu, cache: &KvCache) -> Result<(), CudaError> {
    let (major, minor) = gpu.compute_capability();
    let why = if cache.dtype != KvDtype::F16 {
        "an f32 KV cache (the kernel reads f16)".to_string()
    } else if major < 8 {
        format!("compute capability {major}.{minor} (mma.sync f16 needs 8.0)")
    } else if !FlashAttentionVariant::supports(cache.head_dim) {
        format!("head_dim {}", cache.head_dim)
    } else {
        return Ok(());
    };
    Err(CudaError::invalid("attention", format!("the tensor-core kernel does not support {why} ({} to choose the path)", env::CUDA_ATTENTION_PATH.name)))
}

/// [`attention`] over a paged cache: query `t` sees positions up to `positions[t]` of its
/// sequence's blocks.
#[allow(clippy::too_many_arguments)]
pub fn attention_paged(
    gpu: &Gpu,
    q: &impl DevicePtr<f32>,
    cache: &KvCache,
    positions: &impl DevicePtr<u32>,
    n_tokens: usize,
    cfg: &AttentionConfig,
    paging: &Paging,
    out: &mut impl DevicePtrMut<f32>,
    emit: Option<AttentionEmit>,
) -> Result<(), CudaError> {
    let max_seq = paging.check("attention", cache, n_tokens)?;
    let Some(mut params) = attention_params(gpu, q, cache, positions, n_tokens, cfg, out, emit)? else { return Ok(()) };
    set_paging(gpu, &mut params, cfg, paging, max_seq);
    let variant = AttentionVariant::paged(cache.head_dim, cache.dtype, attention_group(gpu, cfg.n_heads, cache.n_kv_heads));
    gpu.launch(&variant, "attention", variant.launch_config(cfg.n_heads, n_tokens, 1), &params)
}

/// Query heads per block of the paged kernels (batched steps), as [`AttentionGroups`] allows:
/// a KV group's heads (capped by `FERRITE_CUDA_ATTENTION_MAX_GROUP`) unless grouping is `off`.
/// Their launch grids have `n_heads / group` blocks per token. (The one-token decode kernel's
/// grouping is [`DecodeLayouts`].)
pub fn attention_group(gpu: &Gpu, n_heads: usize, n_kv_heads: usize) -> usize {
    if gpu.attention_groups() == AttentionGroups::Off { 1 } else { kv_group(gpu, n_heads, n_kv_heads) }
}

/// [`AttentionVariant::group_for`] of the heads per KV head, capped by the device, or 1.
fn kv_group(gpu: &Gpu, n_heads: usize, n_kv_heads: usize) -> usize {
    if n_kv_heads > 0 && n_heads.is_multiple_of(n_kv_heads) {
        AttentionVariant::group_for(n_heads / n_kv_heads, gpu.attention_max_group())
    } else {
        1
    }
}

/// Most key shares per query of [`attention_split`] (the kernel's `MAX_SPLITS`).
pub const MAX_SPLITS: usize = 256;

/// Key shares per query for split-KV decode attention, for `n_heads` blocks per token (query
/// heads, or head groups: [`attention_group`]): enough blocks to cover the device twice over,
/// each share at least 128 of the cache's `max_seq` positions (the kernel also keeps 128
/// keys per share at run time, a batch of 32 for each of its 4 warps, so short contexts use
/// fewer shares). 1 (no split) for batches of more than 8 tokens (prefill has blocks enough)
/// and caches of at most 256 positions.
pub fn attention_splits(sm_count: usize, n_heads: usize, n_tokens: usize, max_seq: usize) -> usize {
    if n_tokens == 0 || n_tokens > 8 || max_seq <= 256 {
        return 1;
    }
    (2 * sm_count).div_ceil(n_heads * n_tokens).clamp(1, (max_seq / 128).clamp(1, MAX_SPLITS))
}

/// Device scratch of [`attention_split`]: the shares' partial softmax states and one arrival
/// counter per query (zero between launches: the last share to arrive resets it).
pub struct SplitScratch {
    partials: CudaSlice<f32>,
    counters: CudaSlice<u32>,
    queries: usize,
    splits: usize,
    head_dim: usize,
}

impl SplitScratch {
    /// Room for `queries` (tokens x heads) of up to `splits` shares of `head_dim` values.
    pub fn new(gpu: &Gpu, queries: usize, splits: usize, head_dim: usize) -> Result<Self, CudaError> {
        let len = elems("SplitScratch::new", &[queries.max(1), splits.max(1), 2 + head_dim])?;
        Ok(SplitScratch {
            partials: gpu.alloc_zeros(len)?,
            counters: gpu.alloc_zeros(queries.max(1))?,
            queries,
            splits,
            head_dim,
        })
    }

    /// Whether `queries` queries of `splits` shares of `head_dim` values fit.
    fn check(&self, op: &'static str, splits: usize, queries: usize, head_dim: usize) -> Result<(), CudaError> {
        if !(1..=MAX_SPLITS).contains(&splits) {
            return Err(CudaError::invalid(op, format!("{splits} key shares (1..={MAX_SPLITS})")));
        }
        if queries > self.queries || splits > self.splits || head_dim != self.head_dim {
            return Err(CudaError::invalid(
                op,
                format!(
                    "scratch for {} queries x {} shares of {} dims cannot hold {queries} x {splits} of {head_dim}",
                    self.queries, self.splits, self.head_dim
                ),
            ));
        }
        Ok(())
    }
}

/// [`attention`] with each query's keys cut into `splits` shares computed by separate blocks
/// (flash-decoding); the last block of each query merges the shares. Same results as
/// [`attention`] up to rounding.
#[allow(clippy::too_many_arguments)]
pub fn attention_split(
    gpu: &Gpu,
    q: &impl DevicePtr<f32>,
    cache: &KvCache,
    positions: &impl DevicePtr<u32>,
    n_tokens: usize,
    cfg: &AttentionConfig,
    splits: usize,
    scratch: &mut SplitScratch,
    out: &mut impl DevicePtrMut<f32>,
    emit: Option<AttentionEmit>,
) -> Result<(), CudaError> {
    const OP: &str = "attention_split";
    scratch.check(OP, splits, n_tokens * cfg.n_heads, cache.head_dim)?;
    let Some(mut params) = attention_params(gpu, q, cache, positions, n_tokens, cfg, out, emit)? else { return Ok(()) };
    params.partials = addr_mut(gpu, &mut scratch.partials);
    params.counters = addr_mut(gpu, &mut scratch.counters);
    let variant = AttentionVariant::new(cache.head_dim, cache.dtype, true);
    gpu.launch(&variant, "attention", variant.launch_config(cfg.n_heads, n_tokens, splits), &params)
}

/// Checks the shapes and settings of an attention call and builds its parameters (`None`: no
/// tokens, nothing to do).
#[allow(clippy::too_many_arguments)]
fn attention_params(
    gpu: &Gpu,
    q: &impl DevicePtr<f32>,
    cache: &KvCache,
    positions: &impl DevicePtr<u32>,
    n_tokens: usize,
    cfg: &AttentionConfig,
    out: &mut impl DevicePtrMut<f32>,
    emit: Option<AttentionEmit>,
) -> Result<Option<AttentionParams>, CudaError> {
    const OP: &str = "attention";
    if n_tokens == 0 {
        return Ok(None);
    }
    if cfg.n_heads == 0 || !cfg.n_heads.is_multiple_of(cache.n_kv_heads) {
        return Err(CudaError::invalid(
            OP,
            format!("{} query heads are not a multiple of {} KV heads", cfg.n_heads, cache.n_kv_heads),
        ));
    }
    let softcap = match cfg.softcap {
        Some(cap) if !(cap > 0.0 && cap.is_finite()) => {
            return Err(CudaError::invalid(OP, format!("softcap {cap} is not a positive number")))
        }
        Some(cap) => cap,
        None => 0.0,
    };
    let window = match cfg.window {
        Some(0) => return Err(CudaError::invalid(OP, "window of 0 positions")),
        Some(w) => w.min(cache.max_seq) as u32,
        None => 0,
    };
    if n_tokens > 65535 || cfg.n_heads > 65535 {
        return Err(CudaError::invalid(
            OP,
            format!("{n_tokens} tokens x {} heads exceed the launch grid", cfg.n_heads),
        ));
    }
    let n = elems(OP, &[n_tokens, cfg.n_heads, cache.head_dim])?;
    check_len(OP, "q", q.len(), n)?;
    check_len(OP, "out", out.len(), n)?;
    check_len(OP, "positions", positions.len(), n_tokens)?;
    let (mut emit_q, mut emit_s, mut emit_half, mut emit_bf16) = (0, 0, 0, 0);
    match emit {
        Some(AttentionEmit::Q8(dst)) => {
            dst.fill(OP, n_tokens, cfg.n_heads * cache.head_dim, None)?;
            (emit_q, emit_s, _) = dst.ptrs(gpu);
        }
        Some(AttentionEmit::Staged(dst, layout)) => {
            let rows = StagedLayout { order: MmaOrder::Natural, n_tokens, cols: cfg.n_heads * cache.head_dim, precision: layout.precision };
            if layout != rows || layout.precision == Precision::F32 {
                return Err(CudaError::invalid(OP, format!("attention stages 16-bit rows of its output ({rows:?}), not {layout:?}")));
            }
            emit_half = dst.stage(OP, gpu, layout)?;
            emit_bf16 = u32::from(layout.precision == Precision::BF16);
        }
        None => {}
    }
    Ok(Some(AttentionParams {
        emit_q,
        emit_s,
        emit_half,
        emit_bf16,
        emit_pad: 0,
        qkv: 0,
        rot_dim: 0,
        theta: 0.0,
        freq_scale: 0.0,
        n_tokens: n_tokens as u32,
        block_tables: 0,
        row_seq: 0,
        max_blocks: 0,
        block_size: 0,
        q_norm: 0,
        k_norm: 0,
        q_norm_eps: 0.0,
        k_norm_eps: 0.0,
        q: addr(gpu, q),
        k_cache: addr(gpu, &cache.k),
        v_cache: addr(gpu, &cache.v),
        positions: addr(gpu, positions),
        out: addr_mut(gpu, out),
        partials: 0,
        counters: 0,
        error_flag: gpu.error_flag_ptr(),
        n_heads: cfg.n_heads as u32,
        n_kv_heads: cache.n_kv_heads as u32,
        max_seq: cache.max_seq as u32,
        window,
        scale: cfg.scale,
        softcap,
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The decode layouts of the 8B and SmolLM2 shapes on 132 SMs and a 4 096-position cache.
    #[test]
    fn decode_layouts_group_deep_in_a_context() {
        let blocks = |mode, kv_group| DecodeBlocks { mode, kv_group, wide_warps: 16, wide_batches: 1, wide_cluster: 1 };
        let plan = |mode, kv_group, n_heads, split| DecodeLayouts::plan(blocks(mode, kv_group), 132, n_heads, 128, 4096, split, 128);
        let l = plan(AttentionGroups::Adaptive, 4, 32, true);
        assert_eq!((l.short, l.long), (DecodeLayout { splits: 9, ..DecodeLayout::one_block(1) }, DecodeLayout { splits: 32, ..DecodeLayout::one_block(4) }));
        assert_eq!(l.group_from_keys, 128 * 9);
        // Heads of 128 values: wide blocks of 8 warps, 129 to 256 keys.
        assert_eq!((l.wide, l.wide_to_keys), (DecodeLayout { warps: 8, ..DecodeLayout::one_block(1) }, 256));
        let stages = [1, 128, 129, 256, 257, 1151, 1152].map(|k| l.stage(k));
        use DecodeStage::*;
        assert_eq!(stages, [Short, Short, Wide, Wide, Short, Short, Long]);
        assert_eq!((l.layout(Short).group, l.layout(Long).group), (1, 4));
        // SmolLM2: 30 shares per head (and rows of 64 values: 256 keys per share), so grouping
        // starts past a 4 096-position cache.
        // Wide blocks of 16 warps up to 512 keys.
        let l = DecodeLayouts::plan(blocks(AttentionGroups::Adaptive, 3), 132, 9, 64, 4096, true, 256);
        assert_eq!((l.short.splits, l.long.group, l.group_from_keys), (30, 3, 256 * 30));
        assert_eq!((l.wide.warps, l.wide_to_keys, l.stage(512), l.stage(513)), (16, 512, Wide, Short));
        // None with FERRITE_CUDA_ATTENTION_WARPS=4, 256-value heads, without splits, or grouped
        // short blocks; 8 warps where asked.
        let narrow = DecodeBlocks { wide_warps: 4, ..blocks(AttentionGroups::Adaptive, 3) };
        assert_eq!(DecodeLayouts::plan(narrow, 132, 9, 64, 4096, true, 256).stage(200), Short);
        assert_eq!(DecodeLayouts::plan(blocks(AttentionGroups::Adaptive, 1), 132, 8, 256, 4096, true, 64).wide_to_keys, 0);
        assert_eq!(plan(AttentionGroups::Adaptive, 4, 32, false).wide_to_keys, 0);
        assert_eq!(plan(AttentionGroups::All, 4, 32, true).wide_to_keys, 0);
        let eight = DecodeBlocks { wide_warps: 8, ..blocks(AttentionGroups::Adaptive, 3) };
        assert_eq!(DecodeLayouts::plan(eight, 132, 9, 64, 4096, true, 256).wide_to_keys, 256);
        // Several batches a warp: 4 x 512 keys, still short past them.
        let four = DecodeBlocks { wide_batches: 4, ..blocks(AttentionGroups::Adaptive, 3) };
        let l = DecodeLayouts::plan(four, 132, 9, 64, 4096, true, 256);
        assert_eq!((l.wide_to_keys, l.stage(2048), l.stage(2049)), (2048, Wide, Short));
        // Wide blocks as clusters of 4 per head: 4 x 512 keys, a launch of 4 shares.
        let clustered = DecodeBlocks { wide_cluster: 4, ..blocks(AttentionGroups::Adaptive, 3) };
        let l = DecodeLayouts::plan(clustered, 132, 9, 64, 4096, true, 256);
        assert_eq!((l.wide, l.wide_to_keys, l.stage(2049)), (DecodeLayout { warps: 16, splits: 4, cluster: true, group: 1 }, 2048, Short));
        for mode in [AttentionGroups::Off, AttentionGroups::Paged, AttentionGroups::All] {
            let l = plan(mode, 4, 32, true);
            assert_eq!((l.short, l.group_from_keys), (l.long, usize::MAX), "{mode:?}: one layout");
        }
        assert_eq!(plan(AttentionGroups::All, 4, 32, false).short, DecodeLayout::one_block(4));
        assert_eq!(plan(AttentionGroups::Adaptive, 1, 32, true).group_from_keys, usize::MAX, "no KV groups to share");
    }
}
