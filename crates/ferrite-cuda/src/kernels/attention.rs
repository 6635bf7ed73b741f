//! KV-cache store (with RoPE) and causal attention over the cache (prefill and decode alike).
//!
//! Cache layout per layer: `[max_seq, n_kv_heads, head_dim]`, f16 (default) or f32. A paged
//! cache (`PAGED`, serving) has the same rows, `block_size` per block, and each sequence finds
//! its positions through its block table.
//! Query/output layout: `[n_tokens, n_heads, head_dim]` f32. Positions come from device
//! memory; query `t` attends to cache rows `first..=positions[t]` (causal, optional window).
//!
//! Split-KV (flash-decoding): with `SPLIT`, the grid's z dimension cuts each query's keys into
//! equal shares (of at least 32 keys per warp) computed by separate blocks; the last block to
//! finish merges the shares' partial softmax states. The shares follow the key count read from
//! device memory (blocks past the keys leave at once; a lone share skips the merge), so one
//! captured decode graph serves every position.

use super::common::HEADER;
use super::quantize::Q8_BLOCK;
use super::rope::ROPE_ANGLE;
use super::{blocks_for, device_params, KernelVariant};
use cudarc::driver::LaunchConfig;

/// Element type of the KV cache (`KV_F16`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub enum KvDtype {
    #[default]
    F16,
    F32,
}

impl KvDtype {
    pub fn bytes(self) -> usize {
        match self {
            KvDtype::F16 => 2,
            KvDtype::F32 => 4,
        }
    }
}

pub(crate) const KV: &str = r#"
#ifndef KV_F16
#error "KV_F16 (1: f16 cache, 0: f32 cache) must come from the kernel variant"
#endif
#ifndef PAGED
#error "PAGED (1: cache rows found through per-sequence block tables, 0: row = position) must come from the kernel variant"
#endif
// The cache row holding position `pos` for token row `tok`: the position itself, or (PAGED) row
// pos % block_size of block tables[row_seq[tok] * max_blocks + pos / block_size].
__device__ __forceinline__ i64 cache_row(u64 tables, u64 row_seq, u32 max_blocks, u32 block_size, u32 tok, u32 pos) {
#if PAGED
  const u32 seq = reinterpret_cast<const u32*>(row_seq)[tok];
  return (i64)reinterpret_cast<const u32*>(tables)[(i64)seq * max_blocks + pos / block_size] * block_size + pos % block_size;
#else
  return pos;
#endif
}
// kv_load_vec: the KV_VEC values of one 16-byte load (p 16-byte aligned).
#if KV_F16
typedef u16 kv_t;
#define KV_VEC 8
__device__ __forceinline__ float kv_load(const kv_t* p, i64 i) { return f16_to_f32(p[i]); }
__device__ __forceinline__ float kv_round(float v) { return f16_to_f32(f32_to_f16(v)); }
__device__ __forceinline__ void kv_store(kv_t* p, i64 i, float v) { p[i] = f32_to_f16(v); }
__device__ __forceinline__ void kv_load_vec(const kv_t* p, float* out) {
  const uint4 u = *reinterpret_cast<const uint4*>(p);
  const u16* h = reinterpret_cast<const u16*>(&u);
#pragma unroll
  for (int e = 0; e < 8; ++e) out[e] = f16_to_f32(h[e]);
}
#else
typedef float kv_t;
#define KV_VEC 4
__device__ __forceinline__ float kv_load(const kv_t* p, i64 i) { return p[i]; }
__device__ __forceinline__ float kv_round(float v) { return v; }
__device__ __forceinline__ void kv_store(kv_t* p, i64 i, float v) { p[i] = v; }
__device__ __forceinline__ void kv_load_vec(const kv_t* p, float* out) {
  const float4 u = *reinterpret_cast<const float4*>(p);
  out[0] = u.x; out[1] = u.y; out[2] = u.z; out[3] = u.w;
}
#endif
"#;

device_params! {
    pub struct StoreQkvParams {
        pub qkv: u64,
        pub q_out: u64,
        pub k_cache: u64,
        pub v_cache: u64,
        pub positions: u64,
        pub error_flag: u64,
        pub n_tokens: u32,
        /// Elements between consecutive tokens' rows of `qkv`.
        pub stride: u32,
        pub n_heads: u32,
        pub n_kv_heads: u32,
        pub max_seq: u32,
        pub rot_dim: u32,
        pub theta: f32,
        pub freq_scale: f32,
        /// PAGED only: block tables (`[n_seqs, max_blocks]`) and each token row's sequence.
        pub block_tables: u64,
        pub row_seq: u64,
        pub max_blocks: u32,
        pub block_size: u32,
        /// QK_NORM only: the per-head RMSNorm weights of Q and K (`head_dim` each) and their eps.
        pub q_norm: u64,
        pub k_norm: u64,
        pub q_norm_eps: f32,
        pub k_norm_eps: f32,
    }
}

/// Reading one value pair of a head of a `q | k | v` row, normalised (QK-norm) and rotated (RoPE)
/// for Q and K heads: shared by `store_qkv` and the attention kernel's fused K/V store.
const QKV_PAIR: &str = r#"
#ifndef ROPE_STYLE
#error "ROPE_STYLE (0: no RoPE, 1: rotate pairs (2i, 2i + 1), 2: pairs (i, i + rot_dim/2) (NeoX)) must come from the kernel variant"
#endif
#ifndef HEAD_DIM
#error "HEAD_DIM must come from the kernel variant"
#endif
#ifndef QK_NORM
#error "QK_NORM (1: each Q and K head RMS-normalised before RoPE, as Qwen3's QK-norm; 0: as read) must come from the kernel variant"
#endif
// The element indices (a, b) within the head of pair `pair` of head `head` (Q heads, then K,
// then V), and whether RoPE turns it: head < rotated_heads and pair < rot_dim/2 (pairs past
// that, partial RoPE, and V pairs are plain copies).
__device__ __forceinline__ bool qkv_pair_at(u32 head, u32 pair, u32 rotated_heads, u32 rot_dim, u32* a, u32* b) {
  *a = 2 * pair;
  *b = 2 * pair + 1;
#if ROPE_STYLE
  const bool turned = head < rotated_heads && pair < rot_dim / 2;
#if ROPE_STYLE == 2
  if (turned) {
    *a = pair;
    *b = pair + rot_dim / 2;
  }
#endif
  return turned;
#else
  return false;
#endif
}
// The values (a, b) of head `head` of the row `src`, with QK_NORM times `inv` (the head's
// 1 / rms) and the norm's weights at a and b (ga, gb; 1 and 1 for V heads, an exact no-op),
// turned by the angle (c, s) of the pair at the token's position when `turned`. The indices,
// angle and weights depend on the position only, so a kernel may have them before its inputs
// are ready.
// (Split in two: `qkv_pair_load`, then `qkv_pair_finish`, so that a kernel can request all of its
// values before working on any.)
__device__ __forceinline__ void qkv_pair_load(const float* src, u32 head, u32 a, u32 b, float* x0, float* x1) {
  const float* h = src + (i64)head * HEAD_DIM;
  *x0 = h[a];
  *x1 = h[b];
}
__device__ __forceinline__ void qkv_pair_finish(bool turned, float c, float s, float ga, float gb, float inv, float* x0, float* x1) {
#if QK_NORM
  *x0 = *x0 * inv * ga;
  *x1 = *x1 * inv * gb;
#endif
#if ROPE_STYLE
  if (turned) rope_rotate(x0, x1, c, s);
#endif
}
__device__ __forceinline__ void qkv_pair_turned(const float* src, u32 head, u32 a, u32 b, bool turned, float c, float s, float ga, float gb, float inv,
                                                float* x0, float* x1) {
  qkv_pair_load(src, head, a, b, x0, x1);
  qkv_pair_finish(turned, c, s, ga, gb, inv, x0, x1);
}
// 1 / sqrt(mean(x^2) + eps) of the head at `h`, summed by the 32 lanes of a warp (all must call).
__device__ __forceinline__ float head_rms_inv_warp(const float* h, float eps) {
  float ss = 0.f;
  for (u32 d = threadIdx.x & 31; d < HEAD_DIM; d += 32) ss += h[d] * h[d];
  return 1.f / sqrtf(warp_sum(ss) / (float)HEAD_DIM + eps);
}
// The angle of `pair` at `pos` (unused for pairs that are not rotated).
__device__ __forceinline__ void qkv_pair_angle(u32 pair, u32 pos, u32 rot_dim, float theta, float freq_scale, float* c, float* s) {
  *c = 1.f;
  *s = 0.f;
#if ROPE_STYLE
  if (pair < rot_dim / 2) rope_cos_sin(pos, pair, rot_dim, theta, freq_scale, c, s);
#endif
}
"#;

const STORE_QKV: &str = r#"
// Splits each token's `q | k | v` row: Q heads to q_out ([n_tokens, n_heads, HEAD_DIM]), K and
// V heads to cache row positions[t]; Q and K normalised (QK_NORM) and rotated (ROPE_STYLE) on
// the way. One warp per head of a token, a lane per pair of values (and the next pairs 32 on);
// pairs past rot_dim/2 (partial RoPE) and V pairs are copied.
extern "C" __global__ void store_qkv(const StoreQkvParams p) {
  KERNEL_ENTRY();
  constexpr u32 HALF = HEAD_DIM / 2;
  const u32 heads = p.n_heads + 2 * p.n_kv_heads;
  const i64 total = (i64)p.n_tokens * heads;
  const float* qkv = reinterpret_cast<const float*>(p.qkv);
  float* q_out = reinterpret_cast<float*>(p.q_out);
  kv_t* kc = reinterpret_cast<kv_t*>(p.k_cache);
  kv_t* vc = reinterpret_cast<kv_t*>(p.v_cache);
  const u32 lane = threadIdx.x & 31;
  // Warp-uniform: every lane of a warp takes the same heads (the norm sums over the warp).
  for (i64 item = ((i64)blockIdx.x * blockDim.x + threadIdx.x) / 32; item < total; item += (i64)gridDim.x * blockDim.x / 32) {
    const u32 head = (u32)(item % heads);
    const u32 tok = (u32)(item / heads);
    const u32 pos = reinterpret_cast<const u32*>(p.positions)[tok];
    const float* src = qkv + (i64)tok * p.stride;
    const u32 rotated = p.n_heads + p.n_kv_heads;
    const bool is_q = head < p.n_heads, is_k = !is_q && head < rotated;
    const float* norm = nullptr;  // the head's QK-norm weights (none for V heads)
    float inv = 1.f;
#if QK_NORM
    if (head < rotated) {
      norm = reinterpret_cast<const float*>(is_q ? p.q_norm : p.k_norm);
      inv = head_rms_inv_warp(src + (i64)head * HEAD_DIM, is_q ? p.q_norm_eps : p.k_norm_eps);
    }
#endif
    if (!is_q && pos >= p.max_seq) {
      if (lane == 0 && head == p.n_heads) report_error(p.error_flag, ERR_POSITION, pos);
      continue;
    }
    const u32 kv_head = (head - p.n_heads) % p.n_kv_heads;
    kv_t* dst_kv = is_q ? nullptr : (is_k ? kc : vc) + (cache_row(p.block_tables, p.row_seq, p.max_blocks, p.block_size, tok, pos) * p.n_kv_heads + kv_head) * HEAD_DIM;
    for (u32 pair = lane; pair < HALF; pair += 32) {
      u32 a, b;
      float x0, x1, c = 1.f, s = 0.f;
      if (head < rotated) qkv_pair_angle(pair, pos, p.rot_dim, p.theta, p.freq_scale, &c, &s);
      const bool turned = qkv_pair_at(head, pair, rotated, p.rot_dim, &a, &b);
      qkv_pair_turned(src, head, a, b, turned, c, s, norm ? norm[a] : 1.f, norm ? norm[b] : 1.f, inv, &x0, &x1);
      if (is_q) {
        float* dst = q_out + ((i64)tok * p.n_heads + head) * HEAD_DIM;
        dst[a] = x0;
        dst[b] = x1;
      } else {
        kv_store(dst_kv, a, x0);
        kv_store(dst_kv, b, x1);
      }
    }
  }
}
"#;

/// How [`StoreQkvVariant`] rotates Q and K (`ROPE_STYLE`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum RopeStyle {
    None,
    /// Pairs `(2i, 2i + 1)`.
    Normal,
    /// Pairs `(i, i + rot_dim / 2)`.
    Neox,
}

impl RopeStyle {
    /// `ROPE_STYLE`.
    fn macro_value(self) -> u32 {
        match self {
            RopeStyle::None => 0,
            RopeStyle::Normal => 1,
            RopeStyle::Neox => 2,
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct StoreQkvVariant {
    pub kv: KvDtype,
    pub head_dim: u32,
    pub rope: RopeStyle,
    /// Cache rows through block tables.
    pub paged: bool,
    /// Q and K heads RMS-normalised before RoPE (`QK_NORM`).
    pub qk_norm: bool,
}

impl StoreQkvVariant {
    /// A warp per head of a token: `heads` (Q, K and V) over all tokens.
    pub fn launch_config(&self, heads: usize) -> LaunchConfig {
        LaunchConfig {
            grid_dim: (blocks_for(heads.saturating_mul(32), 256).clamp(1, 65535), 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        }
    }
}

impl KernelVariant for StoreQkvVariant {
    const FAMILY: &'static str = "store_qkv";
    const SOURCES: &'static [&'static str] = &[HEADER, KV, ROPE_ANGLE, QKV_PAIR, StoreQkvParams::C_DECL, STORE_QKV];
    const ENTRY_POINTS: &'static [&'static str] = &["store_qkv"];

    fn macros(&self) -> Vec<(&'static str, String)> {
        vec![
            ("HEAD_DIM", self.head_dim.to_string()),
            ("KV_F16", u32::from(self.kv == KvDtype::F16).to_string()),
            ("ROPE_STYLE", self.rope.macro_value().to_string()),
            ("PAGED", u32::from(self.paged).to_string()),
            ("QK_NORM", u32::from(self.qk_norm).to_string()),
        ]
    }
}

device_params! {
    pub struct AttentionParams {
        pub q: u64,
        pub k_cache: u64,
        pub v_cache: u64,
        pub positions: u64,
        pub out: u64,
        /// SPLIT only: `[n_tokens, n_heads, splits, 2 + head_dim]` partial states `(m, l, acc)`.
        pub partials: u64,
        /// SPLIT only: `[n_tokens, n_heads]` arrival counters, zero between launches.
        pub counters: u64,
        pub error_flag: u64,
        pub n_heads: u32,
        pub n_kv_heads: u32,
        pub max_seq: u32,
        pub window: u32,
        pub scale: f32,
        /// 0, or the soft cap of the scores: s -> softcap * tanh(s / softcap) (Gemma 2).
        pub softcap: f32,
        /// 0, or int8 codes and block scales of the output (an int8 hand-off; `quantize` layout).
        pub emit_q: u64,
        pub emit_s: u64,
        /// 0, or a 16-bit copy of the output rows (a staged hand-off to a cuBLAS linear): bf16
        /// when `emit_bf16` is 1, else f16.
        pub emit_half: u64,
        pub emit_bf16: u32,
        pub emit_pad: u32,
        /// STORE only: the token's `q | k | v` row (read instead of `q`) and its RoPE.
        pub qkv: u64,
        pub rot_dim: u32,
        pub theta: f32,
        pub freq_scale: f32,
        /// Query tokens of the launch (the tensor-core kernel's tiles may run past them).
        pub n_tokens: u32,
        /// PAGED only: block tables (`[n_seqs, max_blocks]`) and each query row's sequence.
        pub block_tables: u64,
        pub row_seq: u64,
        pub max_blocks: u32,
        pub block_size: u32,
        /// STORE with QK_NORM: as in [`StoreQkvParams`].
        pub q_norm: u64,
        pub k_norm: u64,
        pub q_norm_eps: f32,
        pub k_norm_eps: f32,
    }
}

/// Stores output element `d` of the query row starting at `qrow` (after the params' C struct),
/// also as 16-bit for a staged hand-off; with an int8 hand-off the warp also quantizes its 32
/// values (`d - lane` is a multiple of 32: warps hold whole blocks of a head). Shared by both
/// attention kernels.
pub(crate) const ATTENTION_OUTPUT: &str = r#"
// Stores output element d of the query row starting at qrow (also as 16-bit for a staged
// hand-off); with an int8 hand-off the warp also quantizes its 32 values (d - lane is a multiple
// of 32: warps hold whole blocks of the head).
__device__ __forceinline__ void store_output(const AttentionParams& p, i64 qrow, int d, float v) {
  reinterpret_cast<float*>(p.out)[qrow + d] = v;
  if (p.emit_half) reinterpret_cast<u16*>(p.emit_half)[qrow + d] = p.emit_bf16 ? f32_to_bf16(v) : f32_to_f16(v);
  if (p.emit_q) {
    const int lane = threadIdx.x & 31;
    const i64 first = qrow + d - lane;
    quantize_block_warp(v, lane, reinterpret_cast<i8*>(p.emit_q) + first, reinterpret_cast<uint2*>(p.emit_s) + first / 32);
  }
}

"#;

const ATTENTION: &str = r#"
#ifndef HEAD_DIM
#error "HEAD_DIM (a multiple of 32) must come from the kernel variant"
#endif
#ifndef NWARPS
#error "NWARPS (warps per block) must come from the kernel variant"
#endif
#ifndef SPLIT
#error "SPLIT (1: gridDim.z blocks share each query's keys, 0: one block has them all) must come from the kernel variant"
#endif
#ifndef STORE
#error "STORE (1: one decode token, its K/V store and RoPE fused in; 0: q and the cache as given) must come from the kernel variant"
#endif
#if PAGED && SPLIT
#error "the paged cache is read by the one-block kernels only"
#endif
#if (HEAD_DIM & (HEAD_DIM - 1)) != 0
#error "HEAD_DIM must be a power of two: lanes split a row in whole 16-byte vectors"
#endif
#if STORE && HEAD_DIM / 2 > NWARPS * 32
#error "the fused K/V store turns one value pair per thread"
#endif
#ifndef CLUSTER
#error "CLUSTER (1: no cluster; n: the gridDim.z == n blocks of a query share its keys as one thread-block cluster, merging through distributed shared memory) must come from the kernel variant"
#endif
#if CLUSTER > 1 && (SPLIT || PAGED || !STORE)
#error "a cluster of shares serves the one-token decode kernel with its K/V store, without the global merge"
#endif
#ifndef GROUP
#error "GROUP (query heads per block: the heads of one KV group score each K row and weigh each V row they load together; 1: a block per query head) must come from the kernel variant"
#endif
// A cache row as 16-byte vectors of KV_VEC values. A lane scores one key: the first K_PRE
// vectors of its K row are requested with the batch's V rows (see load_batch), the rest (long
// rows only) as it multiplies.
#define K_VECS (HEAD_DIM / KV_VEC)
#define K_PRE (K_VECS < 16 ? K_VECS : 16)
// The value accumulation's lane layout: a V row's HEAD_DIM values over V_LANES lanes of V_DIMS
// consecutive dims (V_VECS vectors) each, so one load instruction of the warp reads V_RPI rows.
// A group of V_GROUP rows is requested at once: at most 256 bytes per lane (all 32 rows of a
// batch up to 128 f16 dims), 128 with several query heads (their accumulators need the room).
#define V_LANES (K_VECS < 32 ? K_VECS : 32)
#define V_DIMS (HEAD_DIM / V_LANES)
#define V_VECS (V_DIMS / KV_VEC)
#define V_RPI (32 / V_LANES)
#define V_LANE_BYTES (GROUP > 1 ? 128 : 256)
#define V_GROUP_FIT (32 * V_LANE_BYTES / (HEAD_DIM * (int)sizeof(kv_t)))
#define V_GROUP (V_GROUP_FIT < 32 ? V_GROUP_FIT : 32)
#define V_STEPS (V_GROUP / V_RPI)

// The values of one 16-byte vector of cache entries.
__device__ __forceinline__ void kv_unpack(const uint4& u, float* out) {
#if KV_F16
  const u16* h = reinterpret_cast<const u16*>(&u);
#pragma unroll
  for (int e = 0; e < 8; ++e) out[e] = f16_to_f32(h[e]);
#else
  out[0] = __uint_as_float(u.x); out[1] = __uint_as_float(u.y); out[2] = __uint_as_float(u.z); out[3] = __uint_as_float(u.w);
#endif
}

// A warp's batch of 32 keys in registers: the lane's K row (its first K_PRE vectors) and its
// share of one group of V rows.
struct KvBatch {
  uint4 k[K_PRE];
  uint4 v[V_STEPS * V_VECS];
};

// Requests the lane's share of V rows g .. g + V_GROUP of the batch at `base` (count keys; rows
// past them re-read the last one, whose weight is 0).
__device__ __forceinline__ void load_v_group(const AttentionParams& p, const kv_t* vc, i64 row, u32 tok, u32 base, u32 count, u32 g, int lane, uint4* v) {
  const int rg = lane / V_LANES, dc = lane % V_LANES;
#pragma unroll
  for (int st = 0; st < V_STEPS; ++st) {
    const u32 r = min(g + st * V_RPI + rg, count - 1);
    const uint4* src = reinterpret_cast<const uint4*>(vc + cache_row(p.block_tables, p.row_seq, p.max_blocks, p.block_size, tok, base + r) * row + dc * V_DIMS);
#pragma unroll
    for (int e = 0; e < V_VECS; ++e) v[st * V_VECS + e] = src[e];
  }
}

// Requests the batch of keys base .. min(base + 32, end): every load is issued before any is
// used, so a batch costs one memory round trip (two or more for heads past 128 f16 dims).
__device__ __forceinline__ void load_batch(const AttentionParams& p, const kv_t* kc, const kv_t* vc, i64 row, u32 tok, u32 base, u32 end, int lane, KvBatch& b) {
  if (base + lane < end) {
    const uint4* k = reinterpret_cast<const uint4*>(kc + cache_row(p.block_tables, p.row_seq, p.max_blocks, p.block_size, tok, base + lane) * row);
#pragma unroll
    for (int i = 0; i < K_PRE; ++i) b.k[i] = k[i];
  }
  load_v_group(p, vc, row, tok, base, min(32u, end - base), 0, lane, b.v);
}

// Fewest keys per share: one batch of 32 keys for every warp of the block.
#define MIN_SHARE (32u * NWARPS)
// Most shares per query (the merge keeps a weight per share in shared memory).
#define MAX_SPLITS 256

// Most keys whose rows prefetch_kv requests (a 4k-token share of an 8-head f16 cache is 16 MiB
// of the L2's 50).
#define PREFETCH_KEYS 2048u
// Asks L2 for the K and V rows [begin, end) of the block's KV head, in 128-byte lines, before
// the kernel waits for its predecessor (the QKV projection): the cached rows stream in
// meanwhile instead of after. A hint only; rows the previous kernel may still be writing
// (prefill) are read after the wait, and L2 is coherent.
__device__ __forceinline__ void prefetch_kv(const AttentionParams& p, const kv_t* kc, const kv_t* vc, i64 row, u32 tok, u32 begin, u32 end) {
  constexpr u32 line = 128 / sizeof(kv_t), lines = (HEAD_DIM + line - 1) / line;
  const u32 n = begin < end ? min(end - begin, PREFETCH_KEYS) : 0;
  for (u32 i = threadIdx.x; i < n * lines; i += blockDim.x) {
    const i64 off = cache_row(p.block_tables, p.row_seq, p.max_blocks, p.block_size, tok, begin + i / lines) * row + (i % lines) * line;
    asm volatile("prefetch.global.L2 [%0];" ::"l"(kc + off));
    asm volatile("prefetch.global.L2 [%0];" ::"l"(vc + off));
  }
}

// One block per (GROUP query heads of one KV group, query token, key share). Warps take turns
// on batches of 32 keys of the block's share: each lane scores one key (a whole K row in 16-byte
// loads against each head's q in shared memory), the warp updates each head's online softmax
// once per batch (the running max m in one `redux.sync`; each lane keeps its share of the sum l,
// added up once at the end), then accumulates the batch's V rows (see V_LANES) into
// each head's sums. A head's arithmetic is the same at every GROUP (bit-identical outputs); the
// group only shares the K/V loads. The batch's K and V loads are all issued
// before any is used (load_batch), so a warp waits for memory once per batch, not once per key;
// with the fused K/V store the first batch is requested before the kernel waits for the QKV
// projection. The warps' states are merged through shared memory at the end.
// With SPLIT, each block stores its merged state; the last block of a query to arrive (an
// atomic counter) merges the shares and writes the output, so no second kernel is needed.
#if CLUSTER > 1
// Every thread of the cluster's blocks meets here; writes before it are seen by reads after it.
__device__ __forceinline__ void cluster_barrier() {
  asm volatile("barrier.cluster.arrive.release.aligned;\n\tbarrier.cluster.wait.acquire.aligned;" ::: "memory");
}

// Where `local` (a __shared__ variable) lies in the shared memory of the cluster's block `rank`,
// as a generic address: plain loads through it reach the other block's memory, and being plain
// they may all be in flight together (and stay after the barriers, which clobber memory).
__device__ __forceinline__ const float* cluster_map(const float* local, u32 rank) {
  unsigned long long remote;
  asm("mapa.u64 %0, %1, %2;" : "=l"(remote) : "l"(local), "r"(rank));
  return reinterpret_cast<const float*>(remote);
}
#endif

extern "C" __global__ void __launch_bounds__(NWARPS * 32) attention(const AttentionParams p) {
  __shared__ __align__(16) float s_q[GROUP][HEAD_DIM];
  __shared__ float s_m[NWARPS][GROUP], s_l[NWARPS][GROUP], s_acc[NWARPS][GROUP][HEAD_DIM];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const u32 head = blockIdx.x * GROUP, tok = blockIdx.y;  // the block's first query head
  const i64 qrow = ((i64)tok * p.n_heads + head) * HEAD_DIM;  // head g's row: qrow + g * HEAD_DIM
  // Positions (and block tables) are copied in by the host before the step's first kernel, so
  // they may be read before waiting for the previous kernel; so may the cached rows (below).
  const u32 pos_in = reinterpret_cast<const u32*>(p.positions)[tok];
  const bool bad_pos = pos_in >= p.max_seq;
  const u32 pos = bad_pos ? 0 : pos_in;
  const u32 kv_head = head / (p.n_heads / p.n_kv_heads);
  const u32 first = (p.window > 0 && pos + 1 > p.window) ? pos + 1 - p.window : 0;
  const u32 len = pos + 1 - first;  // keys of the query, the new one included
#if CLUSTER > 1
  // Even shares of whole batches of 32 keys: every block of the cluster has some once there are
  // 32 x CLUSTER keys.
  const u32 share = ((len + gridDim.z - 1) / gridDim.z + 31) & ~31u;
#else
  const u32 share = max((len + gridDim.z - 1) / gridDim.z, SPLIT ? MIN_SHARE : 1u);
#endif
  // The shares that hold keys (the grid is sized for the longest context): blocks past them
  // leave at once (in a cluster they stay, with no keys, for its barriers), and a lone share
  // writes the output itself, without the merge.
  const u32 active = (len + share - 1) / share;
#if CLUSTER <= 1
  if (blockIdx.z >= active) return;  // block-uniform, before any barrier
#endif
  // With STORE the new key (pos) is scored in the loop like the cached ones, its K and V rows
  // taken from shared memory in place of what was loaded for them.
  const u32 begin = min(first + blockIdx.z * share, pos + 1), end = min(pos + 1, begin + share);
  const i64 row = (i64)p.n_kv_heads * HEAD_DIM;
  const kv_t* kc = reinterpret_cast<const kv_t*>(p.k_cache) + (i64)kv_head * HEAD_DIM;
  const kv_t* vc = reinterpret_cast<const kv_t*>(p.v_cache) + (i64)kv_head * HEAD_DIM;
  u32 base = begin + 32 * warp;  // the warp's first batch
  KvBatch batch;
#if STORE
  // The cached rows (before pos) were written by earlier steps, and the angles depend on the
  // position only: both may be had before the wait, while the QKV projection still runs.
  if (!bad_pos && base < end) load_batch(p, kc, vc, row, tok, base, end, lane, batch);
  float rope_c, rope_s;
  qkv_pair_angle(threadIdx.x, pos, p.rot_dim, p.theta, p.freq_scale, &rope_c, &rope_s);
  // Thread `pair`'s elements of the Q and K heads (one layout: all are rotated) and of the V
  // head, and the QK-norm's weights there (weights: no earlier kernel writes them).
  const u32 rotated = p.n_heads + p.n_kv_heads;
  u32 qk_a, qk_b, v_a, v_b;
  const bool qk_turned = qkv_pair_at(0, threadIdx.x, rotated, p.rot_dim, &qk_a, &qk_b);
  qkv_pair_at(rotated, threadIdx.x, rotated, p.rot_dim, &v_a, &v_b);
  float gq_a = 1.f, gq_b = 1.f, gk_a = 1.f, gk_b = 1.f;
#if QK_NORM
  if (threadIdx.x < HEAD_DIM / 2) {
    const float* q_norm = reinterpret_cast<const float*>(p.q_norm);
    const float* k_norm = reinterpret_cast<const float*>(p.k_norm);
    gq_a = q_norm[qk_a];
    gq_b = q_norm[qk_b];
    gk_a = k_norm[qk_a];
    gk_b = k_norm[qk_b];
  }
#endif
  // Which block writes the new rows, and where (positions and block tables are the host's).
  const bool writer = head % (p.n_heads / p.n_kv_heads) == 0 && blockIdx.z == 0;
  const i64 new_row = ((i64)cache_row(p.block_tables, p.row_seq, p.max_blocks, p.block_size, tok, pos) * p.n_kv_heads + kv_head) * HEAD_DIM;
#endif
  if (!bad_pos) prefetch_kv(p, kc, vc, row, tok, begin, end);
  KERNEL_ENTRY();
  if (bad_pos) {  // block-uniform, before any barrier; every share of the query returns
    if (threadIdx.x == 0 && blockIdx.z == 0) report_error(p.error_flag, ERR_POSITION, pos_in);
    if (blockIdx.z == 0)
      for (int g = 0; g < GROUP; ++g)
        for (int d = threadIdx.x; d < HEAD_DIM; d += NWARPS * 32) store_output(p, qrow + g * HEAD_DIM, d, QNAN);
    return;
  }
#if STORE
  // One decode token with its K/V store fused in: the block rotates its Q heads and their
  // group's new K row and reads the new V row from q | k | v itself (rounded as the cache stores
  // them), and the block of the group's first head writes them to cache row pos. Every block
  // keeps the new rows in shared memory (as the cache stores them) and uses those in place of
  // what it loaded for row pos, so no block depends on a row that another block is writing.
  __shared__ __align__(16) kv_t s_knew[HEAD_DIM], s_vnew[HEAD_DIM];
  {
    // (PAGED: a batched decode step, one token of each sequence, q | k | v rows back to back.)
    const float* src = reinterpret_cast<const float*>(p.qkv) + (i64)tok * (p.n_heads + 2 * p.n_kv_heads) * HEAD_DIM;
    // The thread's values of the row, all requested before any is used or anything is stored
    // (a store to the cache could alias the row for the compiler): one round trip, where
    // loading each head as it was turned took the K head's, then the Q and V heads'.
    float xq[GROUP][2], xk[2], xv[2];
    if (threadIdx.x < HEAD_DIM / 2) {
#pragma unroll
      for (int g = 0; g < GROUP; ++g) qkv_pair_load(src, head + g, qk_a, qk_b, &xq[g][0], &xq[g][1]);
      qkv_pair_load(src, p.n_heads + kv_head, qk_a, qk_b, &xk[0], &xk[1]);
      qkv_pair_load(src, rotated + kv_head, v_a, v_b, &xv[0], &xv[1]);
    }
#if QK_NORM
    // The QK-norm's 1 / rms of the block's Q heads (0 .. GROUP) and of its K head (GROUP), a warp each.
    __shared__ float s_inv[GROUP + 1];
    for (int g = warp; g <= GROUP; g += NWARPS) {
      const float inv = head_rms_inv_warp(src + (i64)(g < GROUP ? head + g : p.n_heads + kv_head) * HEAD_DIM, g < GROUP ? p.q_norm_eps : p.k_norm_eps);
      if (lane == 0) s_inv[g] = inv;
    }
    __syncthreads();
#else
    const float s_inv[GROUP + 1] = {};  // unread: no norm
#endif
    if (threadIdx.x < HEAD_DIM / 2) {
#pragma unroll
      for (int g = 0; g < GROUP; ++g) {
        qkv_pair_finish(qk_turned, rope_c, rope_s, gq_a, gq_b, s_inv[g], &xq[g][0], &xq[g][1]);
        s_q[g][qk_a] = xq[g][0] * p.scale;
        s_q[g][qk_b] = xq[g][1] * p.scale;
      }
      qkv_pair_finish(qk_turned, rope_c, rope_s, gk_a, gk_b, s_inv[GROUP], &xk[0], &xk[1]);
      kv_store(s_knew, qk_a, xk[0]);
      kv_store(s_knew, qk_b, xk[1]);
      kv_store(s_vnew, v_a, xv[0]);  // V: as read (no norm, not turned)
      kv_store(s_vnew, v_b, xv[1]);
      if (writer) {
        kv_store((kv_t*)p.k_cache + new_row, qk_a, xk[0]);
        kv_store((kv_t*)p.k_cache + new_row, qk_b, xk[1]);
        kv_store((kv_t*)p.v_cache + new_row, v_a, xv[0]);
        kv_store((kv_t*)p.v_cache + new_row, v_b, xv[1]);
      }
    }
  }
#else
  const float* q = reinterpret_cast<const float*>(p.q) + qrow;
  for (int d = threadIdx.x; d < GROUP * HEAD_DIM; d += NWARPS * 32) s_q[d / HEAD_DIM][d % HEAD_DIM] = q[d] * p.scale;
  // Rows of this launch's tokens may have been written by the previous kernel: read after the wait.
  if (base < end) load_batch(p, kc, vc, row, tok, base, end, lane, batch);
#endif
  __syncthreads();

  // Per lane: V_DIMS dims of the rows rg, rg + V_RPI, ... of each batch (summed over the lanes
  // of a dim chunk at the end).
  const int rg = lane / V_LANES, dc = lane % V_LANES;
  float acc[GROUP][V_DIMS];
  float m[GROUP], l[GROUP];
#pragma unroll
  for (int g = 0; g < GROUP; ++g) {
    m[g] = NEG_INF;
    l[g] = 0.f;
#pragma unroll
    for (int i = 0; i < V_DIMS; ++i) acc[g][i] = 0.f;
  }
  for (; base < end; base += 32 * NWARPS) {
    const u32 j = base + lane;
#if STORE
    // The new key's K row: what was loaded for it (maybe before it was written) is replaced.
    if (j == pos)
#pragma unroll
      for (int c = 0; c < K_PRE; ++c) batch.k[c] = reinterpret_cast<const uint4*>(s_knew)[c];
#endif
    float s[GROUP];
#pragma unroll
    for (int g = 0; g < GROUP; ++g) s[g] = NEG_INF;
    if (j < end) {
      // The vectors past K_PRE (rows over 128 f16 dims) are read here, from the key's row.
      const uint4* krow = K_VECS > K_PRE ? reinterpret_cast<const uint4*>(kc + cache_row(p.block_tables, p.row_seq, p.max_blocks, p.block_size, tok, j) * row) : nullptr;
      float part[GROUP][KV_VEC] = {};  // KV_VEC independent chains per head: shorter sums, more ILP
#pragma unroll
      for (int c = 0; c < K_VECS; ++c) {
        float k[KV_VEC];
        uint4 kv = c < K_PRE ? batch.k[c] : krow[c];
#if STORE
        if (c >= K_PRE && j == pos) kv = reinterpret_cast<const uint4*>(s_knew)[c];
#endif
        kv_unpack(kv, k);
#pragma unroll
        for (int g = 0; g < GROUP; ++g)
#pragma unroll
          for (int e = 0; e < KV_VEC; ++e) part[g][e] += s_q[g][c * KV_VEC + e] * k[e];
      }
#pragma unroll
      for (int g = 0; g < GROUP; ++g) {
        float dot = 0.f;
#pragma unroll
        for (int e = 0; e < KV_VEC; ++e) dot += part[g][e];
        s[g] = p.softcap > 0.f ? p.softcap * tanhf(dot / p.softcap) : dot;
      }
    }
    float pj[GROUP];
#pragma unroll
    for (int g = 0; g < GROUP; ++g) {
      const float m_new = fmaxf(m[g], warp_max_redux(s[g]));  // finite: key `base` (lane 0) is in the share
      const float corr = expf(m[g] - m_new);
      pj[g] = j < end ? expf(s[g] - m_new) : 0.f;
      l[g] = l[g] * corr + pj[g];  // the lane's share of the sum (m is the warp's): summed once at the end
#pragma unroll
      for (int i = 0; i < V_DIMS; ++i) acc[g][i] *= corr;
      m[g] = m_new;
    }
    // The batch's V rows, a group (the first came with the keys) at a time: row r's weight is
    // lane r's pj (0 past the share).
    const u32 count = min(32u, end - base);
    for (u32 g = 0; g < count; g += V_GROUP) {
      if (g > 0) load_v_group(p, vc, row, tok, base, count, g, lane, batch.v);
#pragma unroll
      for (int st = 0; st < V_STEPS; ++st) {
#if STORE
        // The new key's V row, as for its K row (rows past the batch re-read its last one).
        if (base + min(g + st * V_RPI + rg, count - 1) == pos)
#pragma unroll
          for (int e = 0; e < V_VECS; ++e) batch.v[st * V_VECS + e] = reinterpret_cast<const uint4*>(s_vnew)[dc * V_VECS + e];
#endif
        float w[GROUP];
#pragma unroll
        for (int h = 0; h < GROUP; ++h) w[h] = __shfl_sync(FULL_MASK, pj[h], g + st * V_RPI + rg);
#pragma unroll
        for (int e = 0; e < V_VECS; ++e) {
          float v[KV_VEC];
          kv_unpack(batch.v[st * V_VECS + e], v);
#pragma unroll
          for (int h = 0; h < GROUP; ++h)
#pragma unroll
            for (int i = 0; i < KV_VEC; ++i) acc[h][e * KV_VEC + i] += w[h] * v[i];
        }
      }
    }
    if (base + 32 * NWARPS < end) load_batch(p, kc, vc, row, tok, base + 32 * NWARPS, end, lane, batch);
  }
  // Sum each dim chunk over its lanes (lanes dc, dc + V_LANES, ...): every lane then holds the
  // warp's sums of its chunk.
#pragma unroll
  for (int o = V_LANES; o < 32; o <<= 1)
#pragma unroll
    for (int g = 0; g < GROUP; ++g)
#pragma unroll
      for (int i = 0; i < V_DIMS; ++i) acc[g][i] += __shfl_xor_sync(FULL_MASK, acc[g][i], o);
#pragma unroll
  for (int g = 0; g < GROUP; ++g) {
    l[g] = warp_sum(l[g]);
    if (lane == 0) { s_m[warp][g] = m[g]; s_l[warp][g] = l[g]; }
    if (rg == 0)
#pragma unroll
      for (int i = 0; i < V_DIMS; ++i) s_acc[warp][g][dc * V_DIMS + i] = acc[g][i];
  }
  __syncthreads();
  // Per head: the warps' states merged (max, rescaled sums).
  float m_all[GROUP], l_all[GROUP], f[GROUP][NWARPS];
#pragma unroll
  for (int g = 0; g < GROUP; ++g) {
    m_all[g] = NEG_INF;
#pragma unroll
    for (int w = 0; w < NWARPS; ++w) m_all[g] = fmaxf(m_all[g], s_m[w][g]);
    l_all[g] = 0.f;
#pragma unroll
    for (int w = 0; w < NWARPS; ++w) {
      f[g][w] = s_m[w][g] == NEG_INF ? 0.f : expf(s_m[w][g] - m_all[g]);  // a warp that saw no key adds nothing
      l_all[g] += s_l[w][g] * f[g][w];
    }
  }
  // The block's (unnormalised) output value of head g at dim d: its warps' sums, rescaled.
  const auto block_acc = [&](int g, int d) {
    float o = 0.f;
#pragma unroll
    for (int w = 0; w < NWARPS; ++w) o += s_acc[w][g][d] * f[g][w];
    return o;
  };
#if SPLIT
  if (active > 1) {
    // Store this share's state of each head, publish them, count in (one counter per block
    // group: the first head's).
    const i64 query = (i64)tok * p.n_heads + head;
    const i64 part_len = (i64)gridDim.z * (2 + HEAD_DIM);  // one query head's shares
    float* parts = reinterpret_cast<float*>(p.partials) + query * part_len;
#pragma unroll
    for (int g = 0; g < GROUP; ++g) {
      float* mine = parts + g * part_len + blockIdx.z * (2 + HEAD_DIM);
      if (threadIdx.x == 0) { mine[0] = m_all[g]; mine[1] = l_all[g]; }
      for (int d = threadIdx.x; d < HEAD_DIM; d += NWARPS * 32) mine[2 + d] = block_acc(g, d);
    }
    __threadfence();
    __syncthreads();
    __shared__ bool s_last;
    if (threadIdx.x == 0) {
      u32* counter = reinterpret_cast<u32*>(p.counters) + query;
      s_last = atomicAdd(counter, 1u) == active - 1;
      if (s_last) *counter = 0;  // every share has arrived: ready for the next launch
    }
    __syncthreads();
    if (!s_last) return;
    __threadfence();
    // The merge: warp w takes heads w, w + NWARPS, ... (no block barrier, so a group's heads
    // merge side by side). Lane l weighs shares l, l + 32, ... (exp(m_z - max), and the rescaled
    // sums, in registers), then sums dims l, l + 32, ... over the shares in order, each weight
    // broadcast from its lane, all of a share's loads in flight together.
    constexpr int ZL = MAX_SPLITS / 32;  // shares per lane, at most
    for (int g = warp; g < GROUP; g += NWARPS) {
      const float* head_parts = parts + g * part_len;
      float mz[ZL], fz[ZL], lz[ZL];
      float m_max = NEG_INF;
#pragma unroll
      for (int i = 0; i < ZL; ++i) {
        const u32 z = lane + 32 * i;
        mz[i] = z < active ? __ldcg(head_parts + z * (2 + HEAD_DIM)) : NEG_INF;
        lz[i] = z < active ? __ldcg(head_parts + z * (2 + HEAD_DIM) + 1) : 0.f;
        m_max = fmaxf(m_max, mz[i]);
      }
      m_max = warp_max(m_max);
#pragma unroll
      for (int i = 0; i < ZL; ++i) {
        fz[i] = mz[i] == NEG_INF ? 0.f : expf(mz[i] - m_max);
        lz[i] *= fz[i];
      }
      float l_sum = 0.f, o[HEAD_DIM / 32];
#pragma unroll
      for (int c = 0; c < HEAD_DIM / 32; ++c) o[c] = 0.f;
#pragma unroll
      for (int i = 0; i < ZL; ++i) {
        if (32u * i >= active) break;  // warp-uniform
        const int n = (int)min(32u, active - 32u * i);
#pragma unroll 4
        for (int j = 0; j < n; ++j) {
          l_sum += __shfl_sync(FULL_MASK, lz[i], j);
          const float f = __shfl_sync(FULL_MASK, fz[i], j);
          const float* row = head_parts + (32 * i + j) * (2 + HEAD_DIM) + 2 + lane;
#pragma unroll
          for (int c = 0; c < HEAD_DIM / 32; ++c) o[c] += f * __ldcg(row + 32 * c);
        }
      }
#pragma unroll
      for (int c = 0; c < HEAD_DIM / 32; ++c) store_output(p, qrow + g * HEAD_DIM, 32 * c + lane, __fdividef(o[c], l_sum));
    }
    return;
  }
#endif
#if CLUSTER > 1
  if (active > 1) {  // the same in every block of the cluster (one query)
    // Each share leaves its state of each head in its shared memory; after the cluster's
    // barrier the first block (block z of a query is its cluster's rank z) reads them all
    // through distributed shared memory and writes the output; a second barrier keeps the
    // states until it has.
    __shared__ float s_share[GROUP][2 + HEAD_DIM];
    if (blockIdx.z < active) {
#pragma unroll
      for (int g = 0; g < GROUP; ++g) {
        if (threadIdx.x == 0) { s_share[g][0] = m_all[g]; s_share[g][1] = l_all[g]; }
        for (int d = threadIdx.x; d < HEAD_DIM; d += NWARPS * 32) s_share[g][2 + d] = block_acc(g, d);
      }
    }
    cluster_barrier();
    if (blockIdx.z == 0) {
#pragma unroll
      for (int g = 0; g < GROUP; ++g) {
        // Share z's weight exp(m_z - max) (0 past the active ones) and the rescaled sum.
        const float* share_of[CLUSTER];
        float f[CLUSTER], m_max = NEG_INF, l_sum = 0.f;
#pragma unroll
        for (u32 z = 0; z < CLUSTER; ++z) {
          share_of[z] = cluster_map(s_share[g], z);
          f[z] = z < active ? share_of[z][0] : NEG_INF;
          m_max = fmaxf(m_max, f[z]);
        }
#pragma unroll
        for (u32 z = 0; z < CLUSTER; ++z) {
          f[z] = f[z] == NEG_INF ? 0.f : expf(f[z] - m_max);
          if (z < active) l_sum += f[z] * share_of[z][1];
        }
        for (int d = threadIdx.x; d < HEAD_DIM; d += NWARPS * 32) {
          float o = 0.f;
#pragma unroll
          for (u32 z = 0; z < CLUSTER; ++z)
            if (z < active) o += f[z] * share_of[z][2 + d];
          store_output(p, qrow + g * HEAD_DIM, d, __fdividef(o, l_sum));
        }
      }
    }
    cluster_barrier();
    return;
  }
  if (blockIdx.z >= active) return;  // one share: the first block writes the output
#endif
  // (The softmax sums are at least 1, the maximum's own term, and at most the keys' count: the
  // approximate division is within 2 ulp there, with no slow-path branch.)
#pragma unroll
  for (int g = 0; g < GROUP; ++g)
    for (int d = threadIdx.x; d < HEAD_DIM; d += NWARPS * 32) store_output(p, qrow + g * HEAD_DIM, d, __fdividef(block_acc(g, d), l_all[g]));
}
"#;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct AttentionVariant {
    pub head_dim: u32,
    pub kv: KvDtype,
    pub nwarps: u32,
    /// Several blocks share each query's keys (`splits > 1` in the launch grid).
    pub split: bool,
    /// One decode token (paged: one per sequence) whose K/V store (rotated by this RoPE) the
    /// kernel does itself.
    pub store: Option<RopeStyle>,
    /// Cache rows through block tables.
    pub paged: bool,
    /// Query heads per block (`GROUP`): heads of one KV group that share each K/V row load.
    pub group: u32,
    /// With `store`: Q and K heads RMS-normalised before RoPE (`QK_NORM`).
    pub qk_norm: bool,
    /// Blocks of one thread-block cluster (`CLUSTER`; 1: none): the launch's `splits` blocks of a
    /// query share its keys and merge their states through distributed shared memory (sm_90),
    /// not through global memory as `split` does.
    pub cluster: u32,
}

impl AttentionVariant {
    /// Most query heads one block serves (their accumulators live in registers).
    pub const MAX_GROUP: usize = 8;

    pub fn new(head_dim: usize, kv: KvDtype, split: bool) -> Self {
        AttentionVariant { head_dim: head_dim as u32, kv, nwarps: 4, split, store: None, paged: false, group: 1, qk_norm: false, cluster: 1 }
    }

    /// The one-block kernel reading a paged cache, `group` query heads per block (1, or a
    /// divisor of the heads per KV head up to [`Self::MAX_GROUP`]: see [`Self::group_for`]).
    pub fn paged(head_dim: usize, kv: KvDtype, group: usize) -> Self {
        AttentionVariant { paged: true, group: group as u32, ..Self::new(head_dim, kv, false) }
    }

    /// The most query heads of one KV group (`heads_per_kv`) that a block can serve: the largest
    /// divisor of `heads_per_kv` up to `cap` and [`Self::MAX_GROUP`].
    pub fn group_for(heads_per_kv: usize, cap: usize) -> usize {
        (1..=Self::MAX_GROUP.min(cap).min(heads_per_kv)).rev().find(|g| heads_per_kv.is_multiple_of(*g)).unwrap_or(1)
    }

    /// The one-token kernel with the K/V store and RoPE fused in (split-KV or not), `group`
    /// query heads per block.
    pub fn storing(head_dim: usize, kv: KvDtype, rope: RopeStyle, split: bool, group: usize) -> Self {
        AttentionVariant { store: Some(rope), group: group as u32, ..Self::new(head_dim, kv, split) }
    }

    pub fn launch_config(&self, n_heads: usize, n_tokens: usize, splits: usize) -> LaunchConfig {
        LaunchConfig {
            grid_dim: ((n_heads / self.group as usize) as u32, n_tokens as u32, splits as u32),
            block_dim: (self.nwarps * 32, 1, 1),
            shared_mem_bytes: 0,
        }
    }
}

impl KernelVariant for AttentionVariant {
    const FAMILY: &'static str = "attention";
    const SOURCES: &'static [&'static str] = &[HEADER, Q8_BLOCK, KV, ROPE_ANGLE, QKV_PAIR, AttentionParams::C_DECL, ATTENTION_OUTPUT, ATTENTION];
    const ENTRY_POINTS: &'static [&'static str] = &["attention"];

    fn macros(&self) -> Vec<(&'static str, String)> {
        vec![
            ("HEAD_DIM", self.head_dim.to_string()),
            ("KV_F16", u32::from(self.kv == KvDtype::F16).to_string()),
            ("NWARPS", self.nwarps.to_string()),
            ("SPLIT", u32::from(self.split).to_string()),
            ("STORE", u32::from(self.store.is_some()).to_string()),
            ("ROPE_STYLE", self.store.map_or(0, RopeStyle::macro_value).to_string()),
            ("PAGED", u32::from(self.paged).to_string()),
            ("GROUP", self.group.to_string()),
            ("QK_NORM", u32::from(self.store.is_some() && self.qk_norm).to_string()),
            ("CLUSTER", self.cluster.to_string()),
        ]
    }

    fn cluster_z(&self) -> u32 {
        self.cluster
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn split_limit_matches_the_op_layer() {
        let define = format!("#define MAX_SPLITS {}", crate::ops::MAX_SPLITS);
        assert!(ATTENTION.contains(&define), "the kernel's MAX_SPLITS differs from ops::MAX_SPLITS");
    }

    #[test]
    fn macros_match_source() {
        crate::kernels::tests::assert_macros_match(StoreQkvVariant { kv: KvDtype::F32, head_dim: 64, rope: RopeStyle::Neox, paged: true, qk_norm: true });
        crate::kernels::tests::assert_macros_match(AttentionVariant::new(64, KvDtype::F16, true));
        crate::kernels::tests::assert_macros_match(AttentionVariant::storing(128, KvDtype::F16, RopeStyle::Neox, true, 4));
        crate::kernels::tests::assert_macros_match(AttentionVariant::paged(128, KvDtype::F16, 4));
        crate::kernels::tests::assert_macros_match(AttentionVariant { paged: true, ..AttentionVariant::storing(128, KvDtype::F16, RopeStyle::Neox, false, 4) });
        crate::kernels::tests::assert_macros_match(AttentionVariant { qk_norm: true, ..AttentionVariant::storing(128, KvDtype::F16, RopeStyle::Neox, true, 2) });
        crate::kernels::tests::assert_macros_match(AttentionVariant { nwarps: 16, cluster: 4, ..AttentionVariant::storing(64, KvDtype::F16, RopeStyle::Neox, false, 1) });
    }

    #[test]
    fn groups_divide_the_kv_groups() {
        assert_eq!([1, 2, 3, 4, 6, 8, 12, 16].map(|h| AttentionVariant::group_for(h, 8)), [1, 2, 3, 4, 6, 8, 6, 8]);
        assert_eq!([1, 2, 3, 4, 6, 8, 12, 16].map(|h| AttentionVariant::group_for(h, 2)), [1, 2, 1, 2, 2, 2, 2, 2]);
        let v = AttentionVariant::paged(128, KvDtype::F16, 4);
        assert_eq!(v.launch_config(32, 64, 1).grid_dim, (8, 64, 1));
    }
}
