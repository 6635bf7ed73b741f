//! Thread-block clusters (sm_90): the primitives a decode step resident in one cluster would
//! rest on, measured by `kernel_bench cluster` before such a step is built.
//!
//! Why: a small model's decode step is a chain of ~5 dependent phases per layer (QKV,
//! attention, output projection, gate/up, down), each today a kernel whose boundary costs
//! ~1.5-2 us with dependent launch (docs/perf.md, stop 17), ~150 of them for SmolLM2; the
//! grid-wide barrier of the persistent chain kernel cost about as much (stop 28). Inside a
//! cluster, blocks meet at a hardware barrier and hand each other activations through
//! distributed shared memory, never through L2.
//!
//! `cluster_phases`: every block of a cluster runs `phases` phases. In each it streams its own
//! `bytes_per_block` of `data` (16-byte loads, a fresh slice each phase, so nothing is served
//! from L2 twice), then writes `values` floats into slot `rank` of every cluster block's
//! shared memory, meets the others at the cluster barrier and reads all slots back: the next
//! phase's values depend on every block's. Slots alternate between two buffers, so one
//! barrier per phase suffices (a block writes buffer `p % 2` only after every block has passed
//! barrier `p - 1`, so after every read of phase `p - 2`).

use super::attention::{KvDtype, KV};
use super::common::{HEADER, QUANT};
use super::quantize::Q8_BLOCK;
use super::rope::ROPE_ANGLE;
use super::{device_params, KernelVariant};
use ferrite_gguf::GgmlType;
use cudarc::driver::LaunchConfig;

device_params! {
    pub struct ClusterPhasesParams {
        /// Bytes every block streams: `data_bytes`, a multiple of 16.
        pub data: u64,
        pub data_bytes: u64,
        /// One float per block: the last phase's value (keeps the work observable).
        pub out: u64,
        pub bytes_per_block: u32,
        pub phases: u32,
        /// Floats each block hands to every block per phase (at most the block's threads).
        pub values: u32,
        pub pad: u32,
    }
}

/// Cluster helpers shared by the kernels of this file.
const CLUSTER_HEADER: &str = r#"
#ifndef CLUSTER
#error "CLUSTER (blocks per thread-block cluster, 1-16) must come from the kernel variant"
#endif

__device__ __forceinline__ u32 cluster_rank() {
  u32 r;
  asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
  return r;
}
// Every thread of every block of the cluster arrives; writes before it (shared::cluster
// included) are visible to reads after it.
__device__ __forceinline__ void cluster_arrive() { asm volatile("barrier.cluster.arrive.release.aligned;" ::: "memory"); }
__device__ __forceinline__ void cluster_wait() { asm volatile("barrier.cluster.wait.acquire.aligned;" ::: "memory"); }
__device__ __forceinline__ void cluster_sync() {
  cluster_arrive();
  cluster_wait();
}
// Stores v at the address of `local` (this block's shared memory) in block `rank`'s.
__device__ __forceinline__ void store_remote(const float* local, u32 rank, float v) {
  u32 remote;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"((u32)__cvta_generic_to_shared(local)), "r"(rank));
  asm volatile("st.shared::cluster.f32 [%0], %1;" :: "r"(remote), "f"(v) : "memory");
}
"#;

const SOURCE: &str = r#"
extern "C" __global__ void cluster_phases(const ClusterPhasesParams p) {
  extern __shared__ float slots[];  // [2][CLUSTER][values]
  KERNEL_ENTRY();
  const u32 rank = cluster_rank(), tid = threadIdx.x;
  // A block's shared memory may be written by the others only once it runs.
  cluster_sync();
  float v = (float)(tid + rank);
  for (u32 ph = 0; ph < p.phases; ++ph) {
    if (p.bytes_per_block > 0) {
      const u64 slice = ((u64)ph * gridDim.x + blockIdx.x) % (p.data_bytes / p.bytes_per_block);
      const int4* src = reinterpret_cast<const int4*>(p.data + slice * p.bytes_per_block);
      int acc = 0;
      const u32 n = p.bytes_per_block / 16;
#pragma unroll 8
      for (u32 i = tid; i < n; i += blockDim.x) {
        const int4 w = __ldg(src + i);
        acc ^= w.x ^ w.y ^ w.z ^ w.w;
      }
      v += (float)(acc & 1);
    }
    float* buf = slots + (ph & 1) * CLUSTER * p.values;
    if (tid < p.values)
      for (u32 r = 0; r < CLUSTER; ++r) store_remote(buf + rank * p.values + tid, r, v);
    cluster_sync();
    float s = 0.f;
    for (u32 r = 0; r < CLUSTER; ++r) s += buf[r * p.values + tid % p.values];
    v = 0.5f * s / CLUSTER;
  }
  // No block leaves while another may still write its shared memory.
  cluster_sync();
  if (tid == 0) reinterpret_cast<float*>(p.out)[blockIdx.x] = v;
}
"#;

device_params! {
    /// One decoder layer of a one-token step (see [`ClusterLayerVariant`]). Weights are given
    /// by their planes 0 and 1 (`up` at the up rows: the fused gate/up weight's second half,
    /// or a weight of its own); `x` is the residual stream in, `out` the stream out (it may be
    /// `x`: every block has read `x` before any writes `out`).
    pub struct ClusterLayerParams {
        pub wqkv0: u64,
        pub wqkv1: u64,
        pub wo0: u64,
        pub wo1: u64,
        pub wgate0: u64,
        pub wgate1: u64,
        pub wup0: u64,
        pub wup1: u64,
        pub wdown0: u64,
        pub wdown1: u64,
        pub attn_norm: u64,
        pub ffn_norm: u64,
        pub x: u64,
        pub out: u64,
        pub k_cache: u64,
        pub v_cache: u64,
        pub positions: u64,
        pub error_flag: u64,
        pub dim: u32,
        pub n_heads: u32,
        pub n_kv_heads: u32,
        pub ff: u32,
        pub max_seq: u32,
        pub rot_dim: u32,
        /// Bytes of the weight region at the start of shared memory (`layer_smem`).
        pub weight_bytes: u32,
        /// Cache rows of the block's first head's KV group that are copied into shared memory
        /// (positions `0 .. min(pos, kv_rows)`); later rows are read from the cache.
        pub kv_rows: u32,
        pub eps: f32,
        pub theta: f32,
        pub freq_scale: f32,
        /// Attention score scale (1 / sqrt(head_dim) unless the model says otherwise).
        pub scale: f32,
        pub pad: u32,
    }
}

/// `cluster_layer`: a whole decoder layer of a one-token decode step in one cluster.
const LAYER_SOURCE: &str = r#"
#ifndef NTHREADS
#error "NTHREADS (threads per block) must come from the kernel variant"
#endif
#ifndef NEOX
#error "NEOX (1: RoPE pairs (i, i + rot_dim/2); 0: pairs (2i, 2i + 1)) must come from the kernel variant"
#endif
#ifndef HEAD_DIM
#error "HEAD_DIM (32, 64, 128 or 256) must come from the kernel variant"
#endif
#if WTYPE == GGML_Q4_0
#define PLANE0 16
#define PLANE1 2
#elif WTYPE == GGML_Q4_1
#define PLANE0 16
#define PLANE1 4
#elif WTYPE == GGML_Q8_0
#define PLANE0 32
#define PLANE1 2
#else
#error "cluster_layer runs Q4_0, Q4_1 and Q8_0 weights"
#endif
#define NWARPS (NTHREADS / 32)
#define HD_LANE (HEAD_DIM / 32)
#define KEY_RUN 8
#define ROW_RUN 4

// Rows [r0, r0 + n) of a matrix of `rows`: block `rank`'s share.
__device__ __forceinline__ u32 share_of(u32 rows) { return (rows + CLUSTER - 1) / CLUSTER; }
__device__ __forceinline__ u32 share_start(u32 rows, u32 rank) { return min(rows, rank * share_of(rows)); }
__device__ __forceinline__ u32 share_len(u32 rows, u32 rank) { return min(rows, (rank + 1) * share_of(rows)) - share_start(rows, rank); }
__device__ __forceinline__ u32 round16(u32 n) { return (n + 15u) & ~15u; }

// A block's rows of one matrix, both planes, in shared memory.
struct Rows { const u8* p0; const u8* p1; u32 r0, n, units; };

// Issues the asynchronous copy of `bytes` from global `src` to shared `dst` (16-byte aligned),
// 16 bytes at a time where `src` allows, else 4, else 1 (plain).
__device__ __forceinline__ void copy_async(u8* dst, const u8* src, u32 bytes) {
  const u32 d = (u32)__cvta_generic_to_shared(dst);
  if (((u64)src & 15) == 0 && (bytes & 15) == 0) {
    for (u32 i = threadIdx.x * 16; i < bytes; i += NTHREADS * 16)
      asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" :: "r"(d + i), "l"(src + i) : "memory");
  } else if (((u64)src & 3) == 0 && (bytes & 3) == 0) {
    for (u32 i = threadIdx.x * 4; i < bytes; i += NTHREADS * 4)
      asm volatile("cp.async.ca.shared.global [%0], [%1], 4;" :: "r"(d + i), "l"(src + i) : "memory");
  } else {
    for (u32 i = threadIdx.x; i < bytes; i += NTHREADS) dst[i] = src[i];
  }
}
__device__ __forceinline__ void copy_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
// Waits until at most N of this thread's copy groups are pending, then for the whole block.
template <int N>
__device__ __forceinline__ void copy_wait() {
  asm volatile("cp.async.wait_group %0;" :: "n"(N) : "memory");
  __syncthreads();
}

// Copies block `rank`'s rows of a `rows x units` matrix (planes w0, w1) to shared memory at
// `*at` (advanced past them) as one copy group.
__device__ __forceinline__ Rows stage_rows(u8* smem, u32* at, const u8* w0, const u8* w1, u32 rows, u32 units, u32 rank) {
  Rows r;
  r.r0 = share_start(rows, rank);
  r.n = share_len(rows, rank);
  r.units = units;
  const u32 b0 = r.n * units * PLANE0, b1 = r.n * units * PLANE1;
  u8* d0 = smem + *at;
  u8* d1 = d0 + round16(b0);
  copy_async(d0, w0 + (u64)r.r0 * units * PLANE0, b0);
  copy_async(d1, w1 + (u64)r.r0 * units * PLANE1, b1);
  copy_commit();
  *at += round16(b0) + round16(b1);
  r.p0 = d0;
  r.p1 = d1;
  return r;
}

// v (n values in shared memory, optionally RMS-normalized with weight w) quantized into int8
// 32-value blocks xq / xs (quantize_q8's numerics); ends with a block barrier.
__device__ void quantize_input(const float* v, const float* w, float eps, u32 n, i8* xq, uint2* xs, float* red) {
  const u32 lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  float inv = 1.f;
  if (w != nullptr) {
    float ss = 0.f;
    for (u32 i = threadIdx.x; i < n; i += NTHREADS) ss += v[i] * v[i];
    inv = 1.f / sqrtf(block_sum(ss, red) / (float)n + eps);
  }
  for (u32 b = warp; b < n / 32; b += NWARPS) {
    float x = v[32 * b + lane];
    if (w != nullptr) x = x * inv * w[32 * b + lane];
    quantize_block_warp(x, lane, xq + 32 * b, xs + b);
  }
  __syncthreads();
}

// out[i] = W[i] . x for the block's rows of NMAT matrices at once (gate and up: the same rows
// of both), ROW_RUN rows per warp turn so that their reductions overlap instead of following
// one another; lanes walk the units. Then f(i, out of matrix 0, out of the last) on every lane.
template <int NMAT, class F>
__device__ __forceinline__ void gemv_rows(const Rows* m, const i8* xq, const uint2* xs, F f) {
  const u32 lane = threadIdx.x & 31, warp = threadIdx.x >> 5, n = m[0].n, units = m[0].units;
  WeightRef w[NMAT];
#pragma unroll
  for (int k = 0; k < NMAT; ++k) w[k] = {m[k].p0, m[k].p1, m[k].p1, m[k].p1, (i64)units * 32};
  const int4* x4 = reinterpret_cast<const int4*>(xq);
  for (u32 i0 = warp * ROW_RUN; i0 < n; i0 += NWARPS * ROW_RUN) {
    float acc[ROW_RUN][NMAT];
#pragma unroll
    for (int r = 0; r < ROW_RUN; ++r)
#pragma unroll
      for (int k = 0; k < NMAT; ++k) acc[r][k] = 0.f;
    for (u32 u = lane; u < units; u += 32) {
      const uint2 s = xs[u];
      const int4 a = x4[2 * u], b = x4[2 * u + 1];
      const float dx = __uint_as_float(s.x), s0 = (float)(int)(short)(s.y & 0xffffu), s1 = (float)((int)s.y >> 16);
#pragma unroll
      for (int r = 0; r < ROW_RUN; ++r) {
        const u32 i = min(i0 + r, n - 1);  // past the block's rows: the last one again, unused
#pragma unroll
        for (int k = 0; k < NMAT; ++k) {
          Unit wu;
          load_unit(w[k], i, u, wu);
          acc[r][k] += unit_dot_q8(wu, a, b, dx, s0, s1);
        }
      }
    }
#pragma unroll
    for (int r = 0; r < ROW_RUN; ++r)
#pragma unroll
      for (int k = 0; k < NMAT; ++k) acc[r][k] = warp_sum(acc[r][k]);
#pragma unroll
    for (int r = 0; r < ROW_RUN; ++r)
      if (i0 + r < n) f(i0 + r, acc[r][0], acc[r][NMAT - 1]);
  }
}

// Lane k < CLUSTER of a warp stores v at `local`'s place in block k.
__device__ __forceinline__ void broadcast(const float* local, float v) {
  const u32 lane = threadIdx.x & 31;
  if (lane < CLUSTER) store_remote(local, lane, v);
}

extern "C" __global__ void __launch_bounds__(NTHREADS, 1) cluster_layer(const ClusterLayerParams p) {
  extern __shared__ __align__(16) u8 smem[];
  const u32 rank = cluster_rank(), tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const u32 q_dim = p.n_heads * HEAD_DIM, kv_dim = p.n_kv_heads * HEAD_DIM, qkv_rows = q_dim + 2 * kv_dim;
  const u32 ud = p.dim / 32, uq = q_dim / 32, uf = p.ff / 32;

  // The block's weight rows, requested before waiting for the previous kernel: nothing writes
  // weights, and each group lands while earlier phases run.
  u32 at = 0;
  const Rows wqkv = stage_rows(smem, &at, (const u8*)p.wqkv0, (const u8*)p.wqkv1, qkv_rows, ud, rank);
  const Rows wo = stage_rows(smem, &at, (const u8*)p.wo0, (const u8*)p.wo1, p.dim, uq, rank);
  const Rows wgate = stage_rows(smem, &at, (const u8*)p.wgate0, (const u8*)p.wgate1, p.ff, ud, rank);
  const Rows wup = stage_rows(smem, &at, (const u8*)p.wup0, (const u8*)p.wup1, p.ff, ud, rank);
  const Rows wdown = stage_rows(smem, &at, (const u8*)p.wdown0, (const u8*)p.wdown1, p.dim, uf, rank);
  // Activations after the weights (the host sized the weight region with the same rule).
  float* x = reinterpret_cast<float*>(smem + p.weight_bytes);
  float* x2 = x + p.dim;               // after attention
  float* qkv = x2 + p.dim;             // q | k | v
  float* attn = qkv + qkv_rows;        // attention output, [n_heads][HEAD_DIM]
  float* act = attn + q_dim;           // gated MLP activation
  float* red = act + p.ff;             // 32 floats: block reductions
  float* merge = red + 32;             // NWARPS x (HEAD_DIM + 2): the warps' softmax states
  float* qr = merge + NWARPS * (HEAD_DIM + 2);  // the head's rotated query
  float* kr = qr + HEAD_DIM;                    // its group's new key (rotated) and value
  float* vr = kr + HEAD_DIM;
  const u32 max_in = max(max(p.dim, q_dim), p.ff);
  // int8 codes read 16 bytes at a time, then their scales.
  i8* xq = reinterpret_cast<i8*>(smem + round16((u32)(reinterpret_cast<u8*>(vr + HEAD_DIM) - smem)));
  uint2* xs = reinterpret_cast<uint2*>(xq + max_in);
  // The first head's K and V rows, `kv_rows` each, 16-byte aligned.
  kv_t* ks = reinterpret_cast<kv_t*>(smem + round16((u32)(reinterpret_cast<u8*>(xs + max_in / 32) - smem)));
  kv_t* vs = ks + (u64)p.kv_rows * HEAD_DIM;

  pdl_wait();
  pdl_release();
  const u32 pos = reinterpret_cast<const u32*>(p.positions)[0];
  const float* xg = reinterpret_cast<const float*>(p.x);
  float* og = reinterpret_cast<float*>(p.out);
  if (pos >= p.max_seq) {
    if (rank == 0 && tid == 0) report_error(p.error_flag, ERR_POSITION, pos);
    for (u32 i = tid; i < wdown.n; i += NTHREADS) og[wdown.r0 + i] = QNAN;
    copy_wait<0>();
    return;
  }
  // The cache rows the first head attends to, requested now (written by earlier steps), to land
  // while phase 1 runs: one copy group after the weights'.
  const u32 heads_per_kv = p.n_heads / p.n_kv_heads;
  const u32 staged_rows = min(pos, p.kv_rows);
  if (rank < p.n_heads) {
    const u32 g = rank / heads_per_kv, chunks = HEAD_DIM * sizeof(kv_t) / 16;
    const u8* kc8 = reinterpret_cast<const u8*>(p.k_cache);
    const u8* vc8 = reinterpret_cast<const u8*>(p.v_cache);
    const u32 dk = (u32)__cvta_generic_to_shared(ks), dv = (u32)__cvta_generic_to_shared(vs);
    for (u32 c = tid; c < staged_rows * chunks; c += NTHREADS) {
      const u32 j = c / chunks, part = c % chunks;
      const u64 src = (((u64)j * p.n_kv_heads + g) * HEAD_DIM) * sizeof(kv_t) + part * 16;
      const u32 dst = (j * HEAD_DIM) * sizeof(kv_t) + part * 16;
      asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" :: "r"(dk + dst), "l"(kc8 + src) : "memory");
      asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" :: "r"(dv + dst), "l"(vc8 + src) : "memory");
    }
  }
  copy_commit();
  // Others may write this block's shared memory once every block runs (waited for below).
  cluster_arrive();
  for (u32 i = tid; i < p.dim; i += NTHREADS) x[i] = xg[i];
  __syncthreads();

  // Phase 1: QKV rows of the normalized input, to every block.
  quantize_input(x, reinterpret_cast<const float*>(p.attn_norm), p.eps, p.dim, xq, xs, red);
  copy_wait<5>();
  cluster_wait();
  gemv_rows<1>(&wqkv, xq, xs, [&](u32 i, float v, float) { broadcast(qkv + wqkv.r0 + i, v); });
  cluster_sync();

  // Phase 2: attention, a block per query head (heads rank, rank + CLUSTER, ...). The staged
  // K/V rows are the last copy group, so from here on every weight has landed too (they were
  // requested before the wait for the previous kernel).
  copy_wait<0>();
  const kv_t* kc = reinterpret_cast<const kv_t*>(p.k_cache);
  const kv_t* vc = reinterpret_cast<const kv_t*>(p.v_cache);
  for (u32 h = rank; h < p.n_heads; h += CLUSTER) {
    const u32 g = h / heads_per_kv;
    const bool first_head = h == rank;
    const float* q = qkv + h * HEAD_DIM;
    const float* k = qkv + q_dim + g * HEAD_DIM;
    const float* v = qkv + q_dim + kv_dim + g * HEAD_DIM;
    for (u32 i = tid; i < HEAD_DIM / 2; i += NTHREADS) {
      // Pair i as qkv_pair_turned takes it: (2i, 2i + 1), or NeoX's (i, i + rot_dim / 2) among
      // the rotated pairs; pairs past rot_dim / 2 (partial RoPE) are copied as they are.
      u32 a = 2 * i, b = 2 * i + 1;
      const bool turned = i < p.rot_dim / 2;
#if NEOX
      if (turned) {
        a = i;
        b = i + p.rot_dim / 2;
      }
#endif
      float q0 = q[a], q1 = q[b], k0 = k[a], k1 = k[b];
      if (turned) {
        float c, s;
        rope_cos_sin(pos, i, p.rot_dim, p.theta, p.freq_scale, &c, &s);
        rope_rotate(&q0, &q1, c, s);
        rope_rotate(&k0, &k1, c, s);
      }
      qr[a] = q0;
      qr[b] = q1;
      kr[a] = kv_round(k0);
      kr[b] = kv_round(k1);
    }
    for (u32 i = tid; i < HEAD_DIM; i += NTHREADS) vr[i] = kv_round(v[i]);
    __syncthreads();
    if (h % heads_per_kv == 0)
      for (u32 i = tid; i < HEAD_DIM; i += NTHREADS) {
        const i64 at_row = ((i64)pos * p.n_kv_heads + g) * HEAD_DIM + i;
        kv_store(const_cast<kv_t*>(kc), at_row, kr[i]);
        kv_store(const_cast<kv_t*>(vc), at_row, vr[i]);
      }
    // Keys 0..pos: warp w takes w, w + NWARPS, ...; lane l holds dimensions l * HD_LANE ...
    float qv[HD_LANE], o[HD_LANE];
#pragma unroll
    for (int e = 0; e < HD_LANE; ++e) {
      qv[e] = qr[lane * HD_LANE + e] * p.scale;
      o[e] = 0.f;
    }
    // Warp w takes runs of KEY_RUN keys (w * KEY_RUN, then NWARPS * KEY_RUN on), loading a run's
    // K and V rows before any math, so a warp waits on memory once per run, not per key.
    float m = NEG_INF, l = 0.f;
    for (u32 j0 = warp * KEY_RUN; j0 <= pos; j0 += NWARPS * KEY_RUN) {
      float kk[KEY_RUN][HD_LANE], vv[KEY_RUN][HD_LANE];
#pragma unroll
      for (int b = 0; b < KEY_RUN; ++b) {
        const u32 j = j0 + b;
        const i64 row = ((i64)min(j, pos) * p.n_kv_heads + g) * HEAD_DIM + lane * HD_LANE;
#pragma unroll
        for (int e = 0; e < HD_LANE; ++e) {
          const u32 at_s = j * HEAD_DIM + lane * HD_LANE + e;  // its place among the staged rows
          const bool staged = first_head && j < staged_rows;
          kk[b][e] = j == pos ? kr[lane * HD_LANE + e] : staged ? kv_load(ks, at_s) : kv_load(kc, row + e);
          vv[b][e] = j == pos ? vr[lane * HD_LANE + e] : staged ? kv_load(vs, at_s) : kv_load(vc, row + e);
        }
      }
#pragma unroll
      for (int b = 0; b < KEY_RUN; ++b) {
        if (j0 + b > pos) break;  // warp-uniform
        float sc = 0.f;
#pragma unroll
        for (int e = 0; e < HD_LANE; ++e) sc += qv[e] * kk[b][e];
        sc = warp_sum(sc);
        const float m2 = fmaxf(m, sc), corr = expf(m - m2), pj = expf(sc - m2);
        l = l * corr + pj;
#pragma unroll
        for (int e = 0; e < HD_LANE; ++e) o[e] = o[e] * corr + pj * vv[b][e];
        m = m2;
      }
    }
    float* mine = merge + warp * (HEAD_DIM + 2);
#pragma unroll
    for (int e = 0; e < HD_LANE; ++e) mine[lane * HD_LANE + e] = o[e];
    if (lane == 0) {
      mine[HEAD_DIM] = m;
      mine[HEAD_DIM + 1] = l;
    }
    __syncthreads();
    for (u32 d = tid; d < HEAD_DIM; d += NTHREADS) {
      float mm = NEG_INF;
      for (u32 w = 0; w < NWARPS; ++w) mm = fmaxf(mm, merge[w * (HEAD_DIM + 2) + HEAD_DIM]);
      float num = 0.f, den = 0.f;
      for (u32 w = 0; w < NWARPS; ++w) {
        const float* st = merge + w * (HEAD_DIM + 2);
        const float f = st[HEAD_DIM] == NEG_INF ? 0.f : expf(st[HEAD_DIM] - mm);
        num += f * st[d];
        den += f * st[HEAD_DIM + 1];
      }
      for (u32 r = 0; r < CLUSTER; ++r) store_remote(attn + h * HEAD_DIM + d, r, num / den);
    }
    __syncthreads();  // qr / kr / vr / merge are reused by the block's next head
  }
  cluster_sync();

  // Phase 3: output projection plus the residual, to every block.
  quantize_input(attn, nullptr, 0.f, q_dim, xq, xs, red);
  gemv_rows<1>(&wo, xq, xs, [&](u32 i, float v, float) { broadcast(x2 + wo.r0 + i, v + x[wo.r0 + i]); });
  cluster_sync();

  // Phase 4: gate and up rows of the normalized stream, SwiGLU, to every block.
  quantize_input(x2, reinterpret_cast<const float*>(p.ffn_norm), p.eps, p.dim, xq, xs, red);
  const Rows gate_up[2] = {wgate, wup};
  gemv_rows<2>(gate_up, xq, xs, [&](u32 i, float g, float u) { broadcast(act + wgate.r0 + i, silu(g) * u); });
  cluster_sync();

  // Phase 5: down projection plus the residual, this block's rows of the stream.
  quantize_input(act, nullptr, 0.f, p.ff, xq, xs, red);
  gemv_rows<1>(&wdown, xq, xs, [&](u32 i, float v, float) {
    if (lane == 0) og[wdown.r0 + i] = v + x2[wdown.r0 + i];
  });
}
"#;

/// `cluster_layer`: one decoder layer of a one-token decode step (pre-norm attention with
/// grouped KV heads, then a SwiGLU MLP: the Llama family's layer) as one cluster of `cluster`
/// blocks. Each block copies its share of every weight's rows into shared memory as soon as it
/// starts (before the wait for the previous kernel) and runs five phases: QKV, attention (a
/// block per query head, storing the group's K/V), the output projection with the residual,
/// gate/up with SwiGLU, and the down projection with the residual. The first four hand their
/// outputs to every block through distributed shared memory and end at the cluster barrier;
/// the last writes the block's rows of the residual stream. Activations are quantized to int8
/// blocks as `quantize_q8` does (the RMSNorms applied first), weights stay packed.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct ClusterLayerVariant {
    pub wtype: GgmlType,
    pub cluster: u32,
    /// Threads per block (256 or 512).
    pub threads: u32,
    pub head_dim: u32,
    pub neox: bool,
    pub kv: KvDtype,
}

/// The shapes of a decoder layer, as [`ClusterLayerVariant::smem_bytes`] needs them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LayerDims {
    pub dim: usize,
    pub n_heads: usize,
    pub n_kv_heads: usize,
    pub ff: usize,
}

impl LayerDims {
    /// Query width for heads of `head_dim`.
    pub fn q_dim(&self, head_dim: usize) -> usize {
        self.n_heads * head_dim
    }

    /// Rows of the fused QKV projection (`q | k | v`) for heads of `head_dim`.
    pub fn qkv_rows(&self, head_dim: usize) -> usize {
        self.q_dim(head_dim) + 2 * self.n_kv_heads * head_dim
    }
}

impl ClusterLayerVariant {
    /// Bytes of plane 0 and plane 1 per 32-weight unit (the repacked planes, `weight.rs`).
    pub(crate) fn plane_bytes(wtype: GgmlType) -> Option<(usize, usize)> {
        match (wtype, crate::weight::planes(wtype)?) {
            (GgmlType::Q4_0 | GgmlType::Q4_1 | GgmlType::Q8_0, [quants, scales]) => Some((quants.size, scales.size)),
            _ => None,
        }
    }

    /// Bytes of the weight region of a block's shared memory: the largest share of each weight
    /// (the same rule as `stage_rows`), every plane rounded to 16 bytes.
    pub fn weight_bytes(&self, d: &LayerDims) -> usize {
        let (b0, b1) = Self::plane_bytes(self.wtype).unwrap_or((0, 0));
        let hd = self.head_dim as usize;
        let c = self.cluster as usize;
        let (q_dim, qkv) = (d.q_dim(hd), d.qkv_rows(hd));
        [(qkv, d.dim), (d.dim, q_dim), (d.ff, d.dim), (d.ff, d.dim), (d.dim, d.ff)]
            .iter()
            .map(|&(rows, cols)| {
                let n = rows.div_ceil(c);
                (n * cols / 32 * b0).next_multiple_of(16) + (n * cols / 32 * b1).next_multiple_of(16)
            })
            .sum()
    }

    /// Bytes of one staged cache row pair (K and V) of a head.
    pub fn kv_row_bytes(&self) -> usize {
        2 * self.head_dim as usize * self.kv.bytes()
    }

    /// Dynamic shared memory of a block: the weight region, the activations, then `kv_rows`
    /// staged K/V rows.
    pub fn smem_bytes(&self, d: &LayerDims, kv_rows: usize) -> usize {
        self.base_smem_bytes(d) + kv_rows * self.kv_row_bytes()
    }

    /// [`Self::smem_bytes`] without staged K/V rows.
    pub fn base_smem_bytes(&self, d: &LayerDims) -> usize {
        let hd = self.head_dim as usize;
        let (q_dim, qkv) = (d.q_dim(hd), d.qkv_rows(hd));
        let warps = (self.threads / 32) as usize;
        let floats = 2 * d.dim + qkv + q_dim + d.ff + 32 + warps * (hd + 2) + 3 * hd;
        let max_in = d.dim.max(q_dim).max(d.ff);
        self.weight_bytes(d) + (4 * floats).next_multiple_of(16) + (max_in + max_in / 32 * 8).next_multiple_of(16)
    }

    pub fn launch_config(&self, d: &LayerDims, kv_rows: usize) -> LaunchConfig {
        LaunchConfig { grid_dim: (self.cluster, 1, 1), block_dim: (self.threads, 1, 1), shared_mem_bytes: self.smem_bytes(d, kv_rows) as u32 }
    }

    /// Whether the kernel runs `wtype` weights.
    pub fn supports(wtype: GgmlType) -> bool {
        Self::plane_bytes(wtype).is_some()
    }
}

impl KernelVariant for ClusterLayerVariant {
    const FAMILY: &'static str = "cluster_layer";
    const SOURCES: &'static [&'static str] = &[HEADER, QUANT, Q8_BLOCK, KV, ROPE_ANGLE, CLUSTER_HEADER, ClusterLayerParams::C_DECL, LAYER_SOURCE];
    const ENTRY_POINTS: &'static [&'static str] = &["cluster_layer"];

    fn macros(&self) -> Vec<(&'static str, String)> {
        vec![
            ("WTYPE", (self.wtype as u32).to_string()),
            ("CLUSTER", self.cluster.to_string()),
            ("NTHREADS", self.threads.to_string()),
            ("HEAD_DIM", self.head_dim.to_string()),
            ("NEOX", u32::from(self.neox).to_string()),
            ("KV_F16", u32::from(self.kv == KvDtype::F16).to_string()),
            ("PAGED", "0".to_string()),
        ]
    }

    fn cluster_size(&self) -> u32 {
        self.cluster
    }
}

/// `cluster_phases` for clusters of `cluster` blocks.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct ClusterPhasesVariant {
    pub cluster: u32,
}

impl ClusterPhasesVariant {
    pub const THREADS: u32 = 256;

    /// `clusters` clusters; shared memory for two buffers of `values` floats per block.
    pub fn launch_config(&self, clusters: u32, values: u32) -> LaunchConfig {
        LaunchConfig { grid_dim: (clusters * self.cluster, 1, 1), block_dim: (Self::THREADS, 1, 1), shared_mem_bytes: 2 * self.cluster * values * 4 }
    }
}

impl KernelVariant for ClusterPhasesVariant {
    const FAMILY: &'static str = "cluster_phases";
    const SOURCES: &'static [&'static str] = &[HEADER, CLUSTER_HEADER, ClusterPhasesParams::C_DECL, SOURCE];
    const ENTRY_POINTS: &'static [&'static str] = &["cluster_phases"];

    fn macros(&self) -> Vec<(&'static str, String)> {
        vec![("CLUSTER", self.cluster.to_string())]
    }

    fn cluster_size(&self) -> u32 {
        self.cluster
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn macros_match_source() {
        crate::kernels::tests::assert_macros_match(ClusterPhasesVariant { cluster: 8 });
        crate::kernels::tests::assert_macros_match(ClusterLayerVariant { wtype: GgmlType::Q4_1, cluster: 16, threads: 256, head_dim: 64, neox: false, kv: KvDtype::F16 });
    }
}
