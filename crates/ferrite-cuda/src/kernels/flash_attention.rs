//! Prefill path of the attention family: causal flash attention on tensor cores (`mma.sync`
//! m16n8k16, f16 inputs, f32 accumulation) over an f16 KV cache. Same parameters, cache layout
//! and results (to f16 rounding of Q and of the softmax weights) as [`super::attention`]'s
//! kernel, which still serves decode, f32 caches and the paged cache.
//!
//! One block per (query head, tile of `BQ` = 64 consecutive query tokens); each of its 4 warps
//! owns 16 query rows, whose Q fragments stay in registers. The block walks the key tiles its
//! rows can see (causal, optional sliding window), `BK` keys at a time: it stages the tile's K
//! and V rows in shared memory, each warp computes its 16 x BK scores with `mma`, applies the
//! scale, soft cap and mask, updates its rows' online softmax in registers (FlashAttention-2:
//! the accumulator fragments' row layout is fixed, so the rescale needs no shared memory), and
//! multiplies the f16 weights, reused in place as A fragments, with V (loaded transposed by
//! `ldmatrix.trans`). Every query head re-reads its group's K/V tiles, from L2.

use super::attention::{AttentionParams, ATTENTION_OUTPUT, KV};
use super::common::HEADER;
use super::quantize::Q8_BLOCK;
use super::{blocks_for, KernelVariant};
use cudarc::driver::LaunchConfig;

const SOURCE: &str = r#"
#ifndef HEAD_DIM
#error "HEAD_DIM (a multiple of 16, at most 256) must come from the kernel variant"
#endif
#if !KV_F16
#error "the tensor-core kernel reads an f16 cache"
#endif
#define BQ 64
#define NWARPS 4
// Keys per tile: two K/V tiles of BK x (HEAD_DIM + 8) f16 stay under the 48 KiB static limit.
#define BK (HEAD_DIM <= 128 ? 64 : 32)
// Row stride of the staged tiles: 16 bytes of padding spread consecutive rows over the banks.
#define LDS (HEAD_DIM + 8)
#define DT (HEAD_DIM / 16)  // k-steps of Q K^T
#define NT (BK / 8)         // score n-tiles per key tile
#define OT (HEAD_DIM / 8)   // output n-tiles
#define LOG2E 1.4426950408889634f

__device__ __forceinline__ u32 pack_f16(float lo, float hi) {
  return (u32)f32_to_f16(lo) | ((u32)f32_to_f16(hi) << 16);
}

// D += A B for one m16n8k16 tile (A row-major 16x16, B column-major 16x8, f16; D f32).
__device__ __forceinline__ void mma_16816(float* d, const u32* a, u32 b0, u32 b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// B fragments of two adjacent 8-column n-tiles of V (keys k0..k0+15, dims d0..d0+15) from the
// row-major [key][dim] tile, transposed on the way.
__device__ __forceinline__ void ldmatrix_x4_trans(const u16* tile, int k0, int d0, int lane, u32* r) {
  const int row = k0 + (lane & 7) + ((lane >> 3) & 1) * 8, col = d0 + (lane >> 4) * 8;
  const u32 addr = (u32)__cvta_generic_to_shared(tile + row * LDS + col);
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

// Stages cache rows key0..key0+BK-1 of one KV head (zeros past `end`) in 16-byte pieces.
__device__ __forceinline__ void stage_tile(u16* tile, const kv_t* cache, i64 row_stride, u32 key0, u32 end) {
  constexpr int pieces = HEAD_DIM / 8;
  for (int i = threadIdx.x; i < BK * pieces; i += NWARPS * 32) {
    const int r = i / pieces, c = (i % pieces) * 8;
    uint4 v = make_uint4(0, 0, 0, 0);
    if (key0 + r < end) v = *reinterpret_cast<const uint4*>(cache + (i64)(key0 + r) * row_stride + c);
    *reinterpret_cast<uint4*>(tile + r * LDS + c) = v;
  }
}

extern "C" __global__ void __launch_bounds__(NWARPS * 32) attention_tc(const AttentionParams p) {
  KERNEL_ENTRY();
  __shared__ __align__(16) u16 s_k[BK * LDS];
  __shared__ __align__(16) u16 s_v[BK * LDS];
  __shared__ u32 s_lo, s_hi;
  __shared__ float s_o[NWARPS][16][33];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
  const u32 head = blockIdx.x, tok0 = blockIdx.y * BQ;
  const u32* positions = reinterpret_cast<const u32*>(p.positions);
  const u32 kv_head = head / (p.n_heads / p.n_kv_heads);
  const i64 row_stride = (i64)p.n_kv_heads * HEAD_DIM;

  // This thread's two rows (g and g + 8 of the warp's 16): their positions and first keys.
  // A row past the batch or with a bad position (reported once per row) sees no key.
  u32 pos[2], first[2];
  bool valid[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const u32 tok = tok0 + 16 * warp + g + 8 * h;
    const u32 ps = tok < p.n_tokens ? positions[tok] : 0xffffffffu;
    valid[h] = ps < p.max_seq;
    if (tok < p.n_tokens && !valid[h] && t == 0) report_error(p.error_flag, ERR_POSITION, ps);
    pos[h] = valid[h] ? ps : 0;
    first[h] = (p.window > 0 && pos[h] + 1 > p.window) ? pos[h] + 1 - p.window : 0;
  }
  // The block's key range: the union of its rows' ranges.
  if (threadIdx.x == 0) { s_lo = 0xffffffffu; s_hi = 0; }
  __syncthreads();
#pragma unroll
  for (int h = 0; h < 2; ++h)
    if (valid[h]) { atomicMin(&s_lo, first[h]); atomicMax(&s_hi, pos[h] + 1); }
  __syncthreads();
  const u32 lo = s_lo, hi = s_hi;  // no valid row: lo > hi, no tile

  // Q fragments (f16) of the warp's rows: a[ks] covers dims 16 ks .. 16 ks + 15.
  u32 qa[DT][4];
  {
    const float* q = reinterpret_cast<const float*>(p.q);
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const u32 tok = tok0 + 16 * warp + g + 8 * h;
      const float* qrow = q + ((i64)min(tok, p.n_tokens - 1) * p.n_heads + head) * HEAD_DIM;
#pragma unroll
      for (int ks = 0; ks < DT; ++ks) {
        const float2 x0 = *reinterpret_cast<const float2*>(qrow + 16 * ks + 2 * t);
        const float2 x1 = *reinterpret_cast<const float2*>(qrow + 16 * ks + 8 + 2 * t);
        qa[ks][h] = pack_f16(x0.x, x0.y);
        qa[ks][2 + h] = pack_f16(x1.x, x1.y);
      }
    }
  }

  float o[OT][4];
#pragma unroll
  for (int n = 0; n < OT; ++n) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.f;
  float m[2] = {NEG_INF, NEG_INF}, l[2] = {0.f, 0.f};  // l: this thread's share of the row sum
  const float scale2 = p.scale * LOG2E;
  const kv_t* kc = reinterpret_cast<const kv_t*>(p.k_cache) + (i64)kv_head * HEAD_DIM;
  const kv_t* vc = reinterpret_cast<const kv_t*>(p.v_cache) + (i64)kv_head * HEAD_DIM;

  for (u32 key0 = lo - lo % BK; key0 < hi; key0 += BK) {
    __syncthreads();  // the previous tile is no longer read
    stage_tile(s_k, kc, row_stride, key0, hi);
    stage_tile(s_v, vc, row_stride, key0, hi);
    __syncthreads();

    // Scores: s[n] holds keys key0 + 8n + 2t, +1 of rows g (0, 1) and g + 8 (2, 3).
    float s[NT][4];
#pragma unroll
    for (int n = 0; n < NT; ++n) {
      s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.f;
      const u16* krow = s_k + (8 * n + g) * LDS + 2 * t;
#pragma unroll
      for (int ks = 0; ks < DT; ++ks) {
        const u32 b0 = *reinterpret_cast<const u32*>(krow + 16 * ks);
        const u32 b1 = *reinterpret_cast<const u32*>(krow + 16 * ks + 8);
        mma_16816(s[n], qa[ks], b0, b1);
      }
    }
    // Scale (to log2 units), soft cap, mask; the rows' new maxima.
    float mt[2] = {NEG_INF, NEG_INF};
#pragma unroll
    for (int n = 0; n < NT; ++n)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int h = e >> 1;
        const u32 key = key0 + 8 * n + 2 * t + (e & 1);
        float x = s[n][e] * p.scale;
        if (p.softcap > 0.f) x = p.softcap * tanhf(x / p.softcap);
        x *= LOG2E;
        x = valid[h] && key >= first[h] && key <= pos[h] ? x : NEG_INF;
        s[n][e] = x;
        mt[h] = fmaxf(mt[h], x);
      }
    float corr[2], mu[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      mt[h] = fmaxf(mt[h], __shfl_xor_sync(FULL_MASK, mt[h], 1));
      mt[h] = fmaxf(mt[h], __shfl_xor_sync(FULL_MASK, mt[h], 2));
      const float m_new = fmaxf(m[h], mt[h]);
      mu[h] = m_new == NEG_INF ? 0.f : m_new;  // a row with no key yet: weights and corr 0
      corr[h] = exp2f(m[h] - mu[h]);
      m[h] = m_new;
      l[h] *= corr[h];
    }
#pragma unroll
    for (int n = 0; n < OT; ++n) {
      o[n][0] *= corr[0]; o[n][1] *= corr[0];
      o[n][2] *= corr[1]; o[n][3] *= corr[1];
    }
    // Weights, then O += P V, 16 keys per k-step: the score n-tiles 2 ks and 2 ks + 1 are
    // exactly the A fragment of that k-step.
#pragma unroll
    for (int ks = 0; ks < NT / 2; ++ks) {
      u32 pa[4];
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        float* sn = s[2 * ks + half];
        const float p0 = exp2f(sn[0] - mu[0]), p1 = exp2f(sn[1] - mu[0]);
        const float p2 = exp2f(sn[2] - mu[1]), p3 = exp2f(sn[3] - mu[1]);
        l[0] += p0 + p1;
        l[1] += p2 + p3;
        pa[2 * half] = pack_f16(p0, p1);
        pa[2 * half + 1] = pack_f16(p2, p3);
      }
#pragma unroll
      for (int n = 0; n < OT; n += 2) {
        u32 b[4];
        ldmatrix_x4_trans(s_v, 16 * ks, 8 * n, lane, b);
        mma_16816(o[n], pa, b[0], b[1]);
        mma_16816(o[n + 1], pa, b[2], b[3]);
      }
    }
  }

  // Finish: row sums over the quad, then out = o / l through shared memory, 32 dims at a time,
  // so that a warp stores (and with a hand-off quantizes) whole 32-value blocks of a row.
  float inv[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    float sum = l[h];
    sum += __shfl_xor_sync(FULL_MASK, sum, 1);
    sum += __shfl_xor_sync(FULL_MASK, sum, 2);
    inv[h] = valid[h] ? 1.f / sum : QNAN;
  }
#pragma unroll
  for (int c = 0; c < HEAD_DIM / 32; ++c) {
#pragma unroll
    for (int n = 4 * c; n < 4 * c + 4; ++n) {
      const int col = 8 * (n - 4 * c) + 2 * t;
      s_o[warp][g][col] = o[n][0] * inv[0];
      s_o[warp][g][col + 1] = o[n][1] * inv[0];
      s_o[warp][g + 8][col] = o[n][2] * inv[1];
      s_o[warp][g + 8][col + 1] = o[n][3] * inv[1];
    }
    __syncwarp();
    for (int r = 0; r < 16; ++r) {
      const u32 tok = tok0 + 16 * warp + r;
      if (tok < p.n_tokens)  // warp-uniform
        store_output(p, ((i64)tok * p.n_heads + head) * HEAD_DIM, 32 * c + lane, s_o[warp][r][lane]);
    }
    __syncwarp();
  }
}
"#;

/// The tensor-core prefill kernel for one head size (f16 cache only).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct FlashAttentionVariant {
    pub head_dim: u32,
}

impl FlashAttentionVariant {
    /// Query tokens per block (the kernel's `BQ`).
    pub const QUERY_TILE: usize = 64;

    /// Head sizes the kernel is written for: whole 16-dim k-steps, 32-value output blocks.
    pub fn supports(head_dim: usize) -> bool {
        head_dim.is_multiple_of(32) && (32..=256).contains(&head_dim)
    }

    pub fn launch_config(&self, n_heads: usize, n_tokens: usize) -> LaunchConfig {
        LaunchConfig {
            grid_dim: (n_heads as u32, blocks_for(n_tokens, Self::QUERY_TILE), 1),
            block_dim: (128, 1, 1),
            shared_mem_bytes: 0,
        }
    }
}

impl KernelVariant for FlashAttentionVariant {
    const FAMILY: &'static str = "flash_attention";
    const SOURCES: &'static [&'static str] = &[HEADER, Q8_BLOCK, KV, AttentionParams::C_DECL, ATTENTION_OUTPUT, SOURCE];
    const ENTRY_POINTS: &'static [&'static str] = &["attention_tc"];

    fn macros(&self) -> Vec<(&'static str, String)> {
        // The paged cache (serving) takes the one-query kernel.
        vec![("HEAD_DIM", self.head_dim.to_string()), ("KV_F16", "1".into()), ("PAGED", "0".into())]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn macros_match_source() {
        crate::kernels::tests::assert_macros_match(FlashAttentionVariant { head_dim: 64 });
    }
}
