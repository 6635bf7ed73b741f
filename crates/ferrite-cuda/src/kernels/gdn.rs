//! Gated DeltaNet (Qwen3.5 / Qwen3-Next linear attention): the causal depthwise conv1d + SiLU
//! over the `q | k | v` channels, then the gated delta rule on the f32 state with the gated
//! RMSNorm of its output, in two forms (`ops::gdn_plan` picks one per batch):
//! - recurrent (`gdn_delta`): one kernel walks the batch's tokens in order (decode, short batches);
//! - chunked (`gdn_chunk_*`): the WY / UT-transform form on chunks of 64 tokens
//!   (`shared/reference/gated-deltanet.md` §2), where only the state pass is sequential, per
//!   chunk rather than per token (prefill).
//!
//! Layouts, as ferrite-cpu's `kernels::gdn`: the projected input `x` has rows of
//! `q | k | v | z | b | a` (`proj_width`); the conv output has rows of `q | k | v` (`conv_width`
//! channels); conv state `[conv_kernel - 1, conv_width]` (the last inputs, oldest first); delta
//! state per value head a row-major `[k_dim, v_dim]` matrix `S` (`S[i][j]`: key dim `i`, value
//! dim `j`). Value head `h` reads key head `h % n_k_heads` in llama.cpp's tiled order (Qwen3.5's
//! GGUFs) or `h / v_group` in HF's grouped order (Qwen3-Next; `v_group` = value heads per key
//! head), as `GdnShape::key_head`: the order is a launch parameter, not a variant.
//! Batches of several sequences (batched serving): the conv and the recurrent form take
//! `seq_rows` (the first row of each sequence, then the row count) and `seq_slots` (each
//! sequence's state slot: its conv window and delta-rule matrices sit at `slot` times one
//! sequence's state from the start) and run a grid row per sequence (`blockIdx.y`); null
//! `seq_rows` is one sequence of `n_tokens` rows on slot 0. The chunked form runs one sequence
//! per launch, at addresses the op offsets.
//! The chunked form's scratch, per value head: the in-chunk cumulative log-decays `gam`
//! (`[n_v_heads, n_tokens]`), `W` (`[n_v_heads, n_tokens, k_dim]`) and `U`, then `V'`
//! (`[n_v_heads, n_tokens, v_dim]`).

use super::common::HEADER;
use super::{blocks_for, device_params, KernelVariant};
use cudarc::driver::LaunchConfig;

device_params! {
    pub struct GdnConvParams {
        pub x: u64,
        pub weight: u64,
        pub state: u64,
        pub out: u64,
        /// A batch of sequences (module doc), or 0 for one sequence of `n_tokens`.
        pub seq_rows: u64,
        pub seq_slots: u64,
        pub n_tokens: u32,
        /// Channels (`conv_width`): the first columns of each `x` row, and the `out` row width.
        pub channels: u32,
        /// Row width of `x` (`proj_width`).
        pub x_width: u32,
        /// Taps per channel (`conv_kernel`); the last one multiplies the current token.
        pub taps: u32,
    }
}

/// The sequence a block serves (module doc).
const SEQS: &str = r#"
struct GdnSeq { i64 first; u32 n; u32 slot; };
__device__ __forceinline__ GdnSeq gdn_seq(u64 seq_rows, u64 seq_slots, u32 n_tokens) {
  if (!seq_rows) return GdnSeq{0, n_tokens, 0};
  const u32* rows = reinterpret_cast<const u32*>(seq_rows);
  const u32 s = blockIdx.y;
  return GdnSeq{(i64)rows[s], rows[s + 1] - rows[s], reinterpret_cast<const u32*>(seq_slots)[s]};
}
"#;

const CONV: &str = r#"
// One thread per channel, tokens in order. Input t - (taps - 1) + j feeds tap j; inputs before
// the batch come from the state. The sum starts with the current token's tap, then the older
// ones oldest first: the CPU reference's order.
extern "C" __global__ void gdn_conv(const GdnConvParams p) {
  KERNEL_ENTRY();
  const u32 c = blockIdx.x * blockDim.x + threadIdx.x;
  if (c >= p.channels) return;
  const GdnSeq q = gdn_seq(p.seq_rows, p.seq_slots, p.n_tokens);
  const i64 hist = p.taps - 1;
  const float* x = reinterpret_cast<const float*>(p.x) + q.first * p.x_width + c;
  const float* w = reinterpret_cast<const float*>(p.weight) + (i64)c * p.taps;
  float* state = reinterpret_cast<float*>(p.state) + (i64)q.slot * hist * p.channels + c;
  float* out = reinterpret_cast<float*>(p.out) + q.first * p.channels + c;
  // Input i of the sequence (i < 0: state row hist + i).
#define CONV_INPUT(i) ((i) >= 0 ? x[(i) * p.x_width] : state[(hist + (i)) * p.channels])
  for (i64 t = 0; t < q.n; ++t) {
    float acc = w[hist] * x[t * p.x_width];
    for (i64 j = 0; j < hist; ++j) acc += w[j] * CONV_INPUT(t - hist + j);
    out[t * p.channels] = silu(acc);
  }
  // The new window: inputs n - hist .. n - 1. Row r reads state row n + r > r when it comes
  // from the old state, which is not yet overwritten.
  for (i64 r = 0; r < hist; ++r) state[r * p.channels] = CONV_INPUT((i64)q.n - hist + r);
#undef CONV_INPUT
}
"#;

/// The conv has no compile-time options.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct GdnConvVariant;

impl GdnConvVariant {
    /// A thread per channel, a grid row per sequence.
    pub fn launch_config(&self, channels: usize, n_seqs: usize) -> LaunchConfig {
        LaunchConfig { grid_dim: (blocks_for(channels, 256), n_seqs as u32, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 }
    }
}

impl KernelVariant for GdnConvVariant {
    const FAMILY: &'static str = "gdn_conv";
    const SOURCES: &'static [&'static str] = &[HEADER, GdnConvParams::C_DECL, SEQS, CONV];
    const ENTRY_POINTS: &'static [&'static str] = &["gdn_conv"];

    fn macros(&self) -> Vec<(&'static str, String)> {
        Vec::new()
    }
}

device_params! {
    pub struct GdnDeltaParams {
        /// Conv output, rows of `q | k | v`.
        pub qkv: u64,
        /// The projected input (for `z | b | a`), rows of `x_width`.
        pub x: u64,
        pub a_coef: u64,
        pub dt_bias: u64,
        pub norm: u64,
        pub state: u64,
        pub out: u64,
        /// A batch of sequences (module doc), or 0 for one sequence of `n_tokens`.
        pub seq_rows: u64,
        pub seq_slots: u64,
        pub n_tokens: u32,
        /// Sequences of at least this many tokens are left alone (the op runs them on the
        /// chunked path); 0: none.
        pub skip_from: u32,
        pub n_k_heads: u32,
        pub n_v_heads: u32,
        /// Value heads per key head in grouped order (value head `h` reads key head
        /// `h / v_group`); 0 in tiled order (key head `h % n_k_heads`).
        pub v_group: u32,
        pub x_width: u32,
        /// `k_dim^-1/2`, the query scale (computed on the host as the CPU reference does).
        pub q_scale: f32,
        pub eps: f32,
    }
}

/// What both forms of the delta rule share: the head shape, the gates, the L2 norm and the
/// gated RMSNorm, so that they compute these the same way.
const HEAD: &str = r#"
#ifndef K_DIM
#error "K_DIM (key head dimension: rows of the state) must come from the kernel variant"
#endif
#ifndef V_DIM
#error "V_DIM (value head dimension: columns of the state) must come from the kernel variant"
#endif

// torch's softplus (beta 1, threshold 20).
__device__ __forceinline__ float softplus(float x) { return x > 20.f ? x : log1pf(expf(x)); }

// The gates of value head h at one token (xrow: its projected row, b and a after q | k | v | z):
// beta = sigmoid(b) and the log-decay a_coef * softplus(a + dt_bias) (<= 0).
struct Gate { float beta, log_decay; };
__device__ __forceinline__ Gate gdn_gate(const float* xrow, i64 conv_width, i64 value_width, u32 n_v_heads, u32 h,
                                         float a_coef, float dt_bias) {
  const float b = xrow[conv_width + value_width + h];
  const float a = xrow[conv_width + value_width + n_v_heads + h];
  return Gate{1.f / (1.f + expf(-b)), a_coef * softplus(a + dt_bias)};
}

// The key (and query) head that value head h reads: grouped order when v_group > 0, else tiled.
__device__ __forceinline__ u32 gdn_key_head(u32 h, u32 n_k_heads, u32 v_group) {
  return v_group ? h / v_group : h % n_k_heads;
}

// The factor that L2-normalises a vector whose squares sum to ss (HF's and fla's epsilon), times scale.
__device__ __forceinline__ float l2_inv(float ss, float scale) { return 1.f / sqrtf(ss + 1e-6f) * scale; }

// One output of the gated RMSNorm: o times rsqrt(mean square of the head's outputs + eps) (ss:
// their sum of squares), the plain norm weight and silu(z).
__device__ __forceinline__ float gated_norm(float o, float ss, float eps, float norm_w, float z) {
  const float inv = 1.f / sqrtf(ss / (float)V_DIM + eps);
  return o * inv * norm_w * silu(z);
}
"#;

const DELTA: &str = r#"
#ifndef KSPLIT
#error "KSPLIT (threads sharing one state column; a power of two up to 32) must come from the kernel variant"
#endif
#define ROWS ((K_DIM + KSPLIT - 1) / KSPLIT)
#define THREADS ((KSPLIT * V_DIM + 31) / 32 * 32)

// Sum over the KSPLIT consecutive lanes that share a state column.
__device__ __forceinline__ float column_sum(float v) {
#pragma unroll
  for (int o = 1; o < KSPLIT; o <<= 1) v += __shfl_xor_sync(FULL_MASK, v, o);
  return v;
}

// One block per (value head, sequence). Thread j * KSPLIT + s owns state column j (value dim j), rows
// s, s + KSPLIT, ... in registers for the whole batch; the state is read once and written once.
// Threads past the last column (blockDim is whole warps) hold zeros and only join the sums.
// Per token: L2-normalise q (times q_scale) and k, decay S, predict Sᵀk, rank-1 update with
// beta (v - Sᵀk), read o = Sᵀq, then out = rmsnorm(o) * norm * silu(z) over the head.
// The weights, and the state (written by this kernel in earlier steps, or by launches that are
// not dependent launches), are loaded before the wait for the conv: they stream in while it
// and the projection before it still run.
extern "C" __global__ void __launch_bounds__(THREADS) gdn_delta(const GdnDeltaParams p) {
  __shared__ float sq[K_DIM], sk[K_DIM], scratch[32];
  const GdnSeq seq = gdn_seq(p.seq_rows, p.seq_slots, p.n_tokens);
  // Block-uniform: this block writes nothing. It leaves without waiting for its predecessor,
  // which is safe only because ops launches this kernel when some sequence is not skipped: a
  // block that waits keeps the grid from finishing (and its dependents from starting) early.
  if (p.skip_from && seq.n >= p.skip_from) return;
  const u32 h = blockIdx.x, kh = gdn_key_head(h, p.n_k_heads, p.v_group);
  const u32 j = threadIdx.x / KSPLIT, s = threadIdx.x % KSPLIT, lane = threadIdx.x & 31;
  const bool owner = j < V_DIM;
  const i64 key_width = (i64)p.n_k_heads * K_DIM, value_width = (i64)p.n_v_heads * V_DIM;
  const i64 conv_width = 2 * key_width + value_width;
  const float* qkv = reinterpret_cast<const float*>(p.qkv) + seq.first * conv_width;
  const float* x = reinterpret_cast<const float*>(p.x) + seq.first * p.x_width;
  float* st = reinterpret_cast<float*>(p.state) + ((i64)seq.slot * p.n_v_heads + h) * K_DIM * V_DIM;
  float* out = reinterpret_cast<float*>(p.out) + seq.first * value_width;
  const float a_coef = reinterpret_cast<const float*>(p.a_coef)[h];
  const float dt_bias = reinterpret_cast<const float*>(p.dt_bias)[h];
  const float norm_w = owner ? reinterpret_cast<const float*>(p.norm)[j] : 0.f;

  float S[ROWS];
#pragma unroll
  for (int m = 0; m < ROWS; ++m) {
    const u32 i = s + KSPLIT * m;
    S[m] = (owner && i < K_DIM) ? st[(i64)i * V_DIM + j] : 0.f;
  }
  KERNEL_ENTRY();
  for (u32 t = 0; t < seq.n; ++t) {
    const float* row = qkv + t * conv_width;
    const float* xrow = x + (i64)t * p.x_width;
    for (u32 i = threadIdx.x; i < K_DIM; i += THREADS) {
      sq[i] = row[kh * K_DIM + i];
      sk[i] = row[key_width + kh * K_DIM + i];
    }
    __syncthreads();
    // Every warp computes both norms itself: no extra barrier.
    float qq = 0.f, kk = 0.f;
    for (u32 i = lane; i < K_DIM; i += 32) {
      qq += sq[i] * sq[i];
      kk += sk[i] * sk[i];
    }
    const float inv_q = l2_inv(warp_sum(qq), p.q_scale);
    const float inv_k = l2_inv(warp_sum(kk), 1.f);
    const Gate gate = gdn_gate(xrow, conv_width, value_width, p.n_v_heads, h, a_coef, dt_bias);
    const float beta = gate.beta;
    const float decay = expf(gate.log_decay);
    float pred = 0.f;
#pragma unroll
    for (int m = 0; m < ROWS; ++m) {
      const u32 i = s + KSPLIT * m;
      S[m] *= decay;
      if (i < K_DIM) pred += S[m] * (sk[i] * inv_k);
    }
    pred = column_sum(pred);
    const float v = owner ? row[2 * key_width + (i64)h * V_DIM + j] : 0.f;
    const float delta = beta * (v - pred);
    float o = 0.f;
#pragma unroll
    for (int m = 0; m < ROWS; ++m) {
      const u32 i = s + KSPLIT * m;
      if (i < K_DIM) {
        S[m] += (sk[i] * inv_k) * delta;
        o += S[m] * (sq[i] * inv_q);
      }
    }
    o = column_sum(o);
    // Its barriers also keep the next token's loads from overwriting sq/sk too early.
    const float ss = block_sum(owner && s == 0 ? o * o : 0.f, scratch);
    if (owner && s == 0) {
      const float z = xrow[conv_width + (i64)h * V_DIM + j];
      out[(i64)t * value_width + (i64)h * V_DIM + j] = gated_norm(o, ss, p.eps, norm_w, z);
    }
  }
#pragma unroll
  for (int m = 0; m < ROWS; ++m) {
    const u32 i = s + KSPLIT * m;
    if (owner && i < K_DIM) st[(i64)i * V_DIM + j] = S[m];
  }
}
"#;

/// The delta-rule kernel for one head shape: the `k_dim` state rows of a value column split
/// over `ksplit` threads, so each thread keeps at most 32 state values in registers.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct GdnDeltaVariant {
    pub k_dim: u32,
    pub v_dim: u32,
    pub ksplit: u32,
}

impl GdnDeltaVariant {
    /// The variant for a head shape, or why the kernel cannot run it: a block holds
    /// `ksplit * v_dim` threads, at most 1024.
    pub fn for_shape(k_dim: usize, v_dim: usize) -> Result<Self, String> {
        let ksplit = k_dim.div_ceil(32).next_power_of_two();
        if k_dim == 0 || v_dim == 0 || ksplit > 32 || ksplit * v_dim > 1024 {
            return Err(format!(
                "key/value head dims {k_dim}/{v_dim} do not fit the delta-rule kernel ({ksplit} threads per value column x {v_dim} columns > 1024)"
            ));
        }
        Ok(GdnDeltaVariant { k_dim: k_dim as u32, v_dim: v_dim as u32, ksplit: ksplit as u32 })
    }

    /// One block of whole warps per (value head, sequence).
    pub fn launch_config(&self, n_v_heads: usize, n_seqs: usize) -> LaunchConfig {
        let threads = (self.ksplit * self.v_dim).next_multiple_of(32);
        LaunchConfig { grid_dim: (n_v_heads as u32, n_seqs as u32, 1), block_dim: (threads, 1, 1), shared_mem_bytes: 0 }
    }
}

impl KernelVariant for GdnDeltaVariant {
    const FAMILY: &'static str = "gdn_delta";
    const SOURCES: &'static [&'static str] = &[HEADER, HEAD, GdnDeltaParams::C_DECL, SEQS, DELTA];
    const ENTRY_POINTS: &'static [&'static str] = &["gdn_delta"];

    fn macros(&self) -> Vec<(&'static str, String)> {
        vec![("K_DIM", self.k_dim.to_string()), ("V_DIM", self.v_dim.to_string()), ("KSPLIT", self.ksplit.to_string())]
    }
}

device_params! {
    pub struct GdnChunkParams {
        /// Conv output, rows of `q | k | v`; `gdn_chunk_norm` normalises q and k in place.
        pub qkv: u64,
        /// The projected input (for `z | b | a`), rows of `x_width`.
        pub x: u64,
        pub a_coef: u64,
        pub dt_bias: u64,
        pub norm: u64,
        pub state: u64,
        /// Scratch: in-chunk cumulative log-decays, `W`, `U` then `V'` (layouts in the module doc).
        pub gam: u64,
        pub w: u64,
        pub u: u64,
        /// Output rows of `value_width`: `gdn_chunk_state` leaves the inter-chunk part there,
        /// `gdn_chunk_out` adds the intra-chunk part and applies the gated norm in place.
        pub out: u64,
        pub n_tokens: u32,
        pub n_k_heads: u32,
        pub n_v_heads: u32,
        /// Value heads per key head in grouped order (value head `h` reads key head
        /// `h / v_group`); 0 in tiled order (key head `h % n_k_heads`).
        pub v_group: u32,
        pub x_width: u32,
        pub q_scale: f32,
        pub eps: f32,
    }
}

const CHUNK_SRC: &str = r#"
#ifndef V_TILE
#error "V_TILE (state columns per block of gdn_chunk_state) must come from the kernel variant"
#endif
// Must equal CHUNK / CHUNK_THREADS / TILE in kernels/gdn.rs.
#define CHUNK 64
#define CHUNK_THREADS 256
// Feature columns staged in shared memory per step (grams, W / U, the state pass).
#define TILE 16
#define K_PAD ((K_DIM + TILE - 1) / TILE * TILE)
#define GRAM_PER_THREAD (CHUNK * CHUNK / CHUNK_THREADS)
#define APPLY_PER_THREAD (CHUNK * TILE / CHUNK_THREADS)
#define STATE_PER_THREAD ((CHUNK * V_TILE + CHUNK_THREADS - 1) / CHUNK_THREADS)
#define WARPS (CHUNK_THREADS / 32)

// One chunk of one value head: tokens [t0, t0 + len), with row pointers into the conv output
// (q and k of the key head that h reads, v of head h) and the head's scratch rows.
struct Chunk {
  u32 h, len;
  i64 t0, conv_width, value_width;
  const float *q, *k, *v;
  float *gam, *w, *u;
};
__device__ __forceinline__ Chunk chunk_at(const GdnChunkParams& p, u32 h, i64 t0) {
  Chunk c;
  c.h = h;
  c.t0 = t0;
  c.len = (u32)min((i64)CHUNK, (i64)p.n_tokens - t0);
  const i64 key_width = (i64)p.n_k_heads * K_DIM;
  c.value_width = (i64)p.n_v_heads * V_DIM;
  c.conv_width = 2 * key_width + c.value_width;
  const float* row = reinterpret_cast<const float*>(p.qkv) + t0 * c.conv_width;
  const u32 kh = gdn_key_head(h, p.n_k_heads, p.v_group);
  c.q = row + (i64)kh * K_DIM;
  c.k = row + key_width + (i64)kh * K_DIM;
  c.v = row + 2 * key_width + (i64)h * V_DIM;
  const i64 first = (i64)h * p.n_tokens + t0;
  c.gam = reinterpret_cast<float*>(p.gam) + first;
  c.w = reinterpret_cast<float*>(p.w) + first * K_DIM;
  c.u = reinterpret_cast<float*>(p.u) + first * V_DIM;
  return c;
}

// Columns [col0, col0 + TILE) of the chunk's rows (stride apart), times row_scale[i] when given,
// into dst; zeros past len rows and width columns, so padded rows and columns add nothing.
__device__ __forceinline__ void stage_tile(float (*dst)[TILE + 1], const float* src, i64 stride, u32 len, u32 col0,
                                           u32 width, const float* row_scale) {
  for (u32 e = threadIdx.x; e < CHUNK * TILE; e += CHUNK_THREADS) {
    const u32 i = e / TILE, d = e % TILE;
    float v = 0.f;
    if (i < len && col0 + d < width) v = row_scale ? src[i * stride + col0 + d] * row_scale[i] : src[i * stride + col0 + d];
    dst[i][d] = v;
  }
}

// acc[r] = x_i . y_j over K_DIM for the pair (i, j) = (e / CHUNK, e % CHUNK), e = tid + CHUNK_THREADS r;
// rows past len are zero. Sums run over the key dims in order. Starts with a barrier.
__device__ __forceinline__ void chunk_gram(const float* x, const float* y, i64 stride, u32 len, float (*xs)[TILE + 1],
                                           float (*ys)[TILE + 1], float* acc) {
#pragma unroll
  for (int r = 0; r < GRAM_PER_THREAD; ++r) acc[r] = 0.f;
  for (u32 d0 = 0; d0 < K_DIM; d0 += TILE) {
    __syncthreads();  // the previous tile is consumed
    stage_tile(xs, x, stride, len, d0, K_DIM, nullptr);
    stage_tile(ys, y, stride, len, d0, K_DIM, nullptr);
    __syncthreads();
#pragma unroll
    for (int r = 0; r < GRAM_PER_THREAD; ++r) {
      const u32 e = threadIdx.x + CHUNK_THREADS * r, i = e / CHUNK, j = e % CHUNK;
#pragma unroll
      for (int d = 0; d < TILE; ++d) acc[r] += xs[i][d] * ys[j][d];
    }
  }
}

// dst (rows [0, len) of width, row-major) = T diag(row_scale) src, for the unit lower-triangular T.
__device__ __forceinline__ void apply_t(float (*tinv)[CHUNK + 1], const float* src, i64 stride, const float* row_scale,
                                        u32 len, u32 width, float* dst, float (*xs)[TILE + 1]) {
  for (u32 d0 = 0; d0 < width; d0 += TILE) {
    __syncthreads();  // tinv is complete / the previous tile is consumed
    stage_tile(xs, src, stride, len, d0, width, row_scale);
    __syncthreads();
#pragma unroll
    for (int r = 0; r < APPLY_PER_THREAD; ++r) {
      const u32 e = threadIdx.x + CHUNK_THREADS * r, i = e / TILE, d = e % TILE;
      if (i < len && d0 + d < width) {
        float sum = 0.f;
        for (u32 j = 0; j <= i; ++j) sum += tinv[i][j] * xs[j][d];
        dst[(i64)i * width + d0 + d] = sum;
      }
    }
  }
}

// One warp per (token, q or k head): L2-normalise in place, q also times q_scale, with the sums
// gdn_delta uses, so both paths see the same vectors.
extern "C" __global__ void __launch_bounds__(CHUNK_THREADS) gdn_chunk_norm(const GdnChunkParams p) {
  KERNEL_ENTRY();
  const u32 lane = threadIdx.x & 31;
  const i64 per_token = 2 * (i64)p.n_k_heads;
  const i64 row = (i64)blockIdx.x * WARPS + threadIdx.x / 32;
  if (row >= (i64)p.n_tokens * per_token) return;  // whole warps
  const i64 conv_width = 2 * (i64)p.n_k_heads * K_DIM + (i64)p.n_v_heads * V_DIM;
  const i64 t = row / per_token, head = row % per_token;
  float* vec = reinterpret_cast<float*>(p.qkv) + t * conv_width + head * K_DIM;
  float ss = 0.f;
  for (u32 i = lane; i < K_DIM; i += 32) ss += vec[i] * vec[i];
  const float inv = l2_inv(warp_sum(ss), head < p.n_k_heads ? p.q_scale : 1.f);
  for (u32 i = lane; i < K_DIM; i += 32) vec[i] *= inv;
}

// Per (value head, chunk), all in parallel: the gates and their running sum gam (to scratch),
// A = strictly lower(beta_i k_i.k_j exp(gam_i - gam_j)), the UT transform T = (I + A)^-1, then
// W = T diag(beta exp(gam)) K and U = T diag(beta) V (to scratch).
extern "C" __global__ void __launch_bounds__(CHUNK_THREADS) gdn_chunk_prep(const GdnChunkParams p) {
  KERNEL_ENTRY();
  __shared__ float a[CHUNK][CHUNK + 1], tinv[CHUNK][CHUNK + 1];
  __shared__ float xs[CHUNK][TILE + 1], ys[CHUNK][TILE + 1];
  __shared__ float beta[CHUNK], gam[CHUNK], wscale[CHUNK];
  const Chunk c = chunk_at(p, blockIdx.x, (i64)blockIdx.y * CHUNK);
  const u32 tid = threadIdx.x;
  if (tid < CHUNK) {
    Gate g = {0.f, 0.f};
    if (tid < c.len) {
      const float* xrow = reinterpret_cast<const float*>(p.x) + (c.t0 + tid) * p.x_width;
      g = gdn_gate(xrow, c.conv_width, c.value_width, p.n_v_heads, c.h, reinterpret_cast<const float*>(p.a_coef)[c.h],
                   reinterpret_cast<const float*>(p.dt_bias)[c.h]);
    }
    beta[tid] = g.beta;
    gam[tid] = g.log_decay;
  }
  __syncthreads();
  if (tid == 0)  // one thread: a fixed order
    for (u32 i = 1; i < c.len; ++i) gam[i] += gam[i - 1];
  __syncthreads();
  if (tid < c.len) {
    c.gam[tid] = gam[tid];
    wscale[tid] = beta[tid] * expf(gam[tid]);
  }
  float acc[GRAM_PER_THREAD];
  chunk_gram(c.k, c.k, c.conv_width, c.len, xs, ys, acc);
#pragma unroll
  for (int r = 0; r < GRAM_PER_THREAD; ++r) {
    const u32 e = tid + CHUNK_THREADS * r, i = e / CHUNK, j = e % CHUNK;
    // Masked before exp: above the diagonal gam_i - gam_j > 0 could overflow.
    a[i][j] = (j < i && i < c.len) ? beta[i] * expf(gam[i] - gam[j]) * acc[r] : 0.f;
  }
  __syncthreads();
  // Forward substitution: thread j solves (I + A) t = e_j for column j of T, reading only its
  // own column and A, so the rows need no barriers. Columns past len come out zero.
  if (tid < CHUNK) {
    const u32 j = tid;
    for (u32 i = 0; i < c.len; ++i) {
      float sum = 0.f;
      for (u32 m = 0; m < i; ++m) sum += a[i][m] * tinv[m][j];
      tinv[i][j] = i == j ? 1.f : (i > j ? -sum : 0.f);
    }
  }
  apply_t(tinv, c.k, c.conv_width, wscale, c.len, K_DIM, c.w, xs);
  apply_t(tinv, c.v, c.conv_width, beta, c.len, V_DIM, c.u, xs);
}

// Per (value head, V_TILE state columns): the chunks in order, the state's columns in shared
// memory throughout. Per chunk: V' = U - W S (over U in scratch), the inter-chunk output
// exp(gam) Q S (to out), then S = exp(gam_last) S + Kᵀ (exp(gam_last - gam) V').
extern "C" __global__ void __launch_bounds__(CHUNK_THREADS) gdn_chunk_state(const GdnChunkParams p) {
  KERNEL_ENTRY();
  __shared__ float s[K_PAD][V_TILE];
  __shared__ float vn[CHUNK][V_TILE + 1];
  __shared__ float xs[CHUNK][TILE + 1], ys[CHUNK][TILE + 1];
  __shared__ float gam[CHUNK];
  const u32 h = blockIdx.x, j0 = blockIdx.y * V_TILE, cols = min((u32)V_TILE, (u32)V_DIM - j0), tid = threadIdx.x;
  float* st = reinterpret_cast<float*>(p.state) + (i64)h * K_DIM * V_DIM + j0;
  float* out = reinterpret_cast<float*>(p.out);
  // Rows past K_DIM and columns past cols stay zero.
  for (u32 e = tid; e < K_PAD * V_TILE; e += CHUNK_THREADS) {
    const u32 d = e / V_TILE, jj = e % V_TILE;
    s[d][jj] = (d < K_DIM && jj < cols) ? st[(i64)d * V_DIM + jj] : 0.f;
  }
  for (i64 t0 = 0; t0 < p.n_tokens; t0 += CHUNK) {
    const Chunk c = chunk_at(p, h, t0);
    __syncthreads();  // the previous chunk's update is done
    if (tid < CHUNK) gam[tid] = tid < c.len ? c.gam[tid] : 0.f;
    float ws[STATE_PER_THREAD], qs[STATE_PER_THREAD];
#pragma unroll
    for (int r = 0; r < STATE_PER_THREAD; ++r) ws[r] = qs[r] = 0.f;
    for (u32 d0 = 0; d0 < K_DIM; d0 += TILE) {
      __syncthreads();
      stage_tile(xs, c.w, K_DIM, c.len, d0, K_DIM, nullptr);
      stage_tile(ys, c.q, c.conv_width, c.len, d0, K_DIM, nullptr);
      __syncthreads();
#pragma unroll
      for (int r = 0; r < STATE_PER_THREAD; ++r) {
        const u32 e = tid + CHUNK_THREADS * r, t = e / V_TILE, jj = e % V_TILE;
        if (e < CHUNK * V_TILE) {
#pragma unroll
          for (int d = 0; d < TILE; ++d) {
            ws[r] += xs[t][d] * s[d0 + d][jj];
            qs[r] += ys[t][d] * s[d0 + d][jj];
          }
        }
      }
    }
    const float last = gam[c.len - 1];
#pragma unroll
    for (int r = 0; r < STATE_PER_THREAD; ++r) {
      const u32 e = tid + CHUNK_THREADS * r, t = e / V_TILE, jj = e % V_TILE;
      if (e < CHUNK * V_TILE) {
        float scaled = 0.f;
        if (t < c.len && jj < cols) {
          float* u = c.u + (i64)t * V_DIM + j0 + jj;
          const float vnew = *u - ws[r];
          *u = vnew;
          out[(c.t0 + t) * c.value_width + (i64)h * V_DIM + j0 + jj] = expf(gam[t]) * qs[r];
          scaled = expf(last - gam[t]) * vnew;
        }
        vn[t][jj] = scaled;
      }
    }
    const float carry = expf(last);
    for (u32 d0 = 0; d0 < K_DIM; d0 += TILE) {
      __syncthreads();  // vn is complete / the previous tile is consumed; s is no longer read
      stage_tile(xs, c.k, c.conv_width, c.len, d0, K_DIM, nullptr);
      __syncthreads();
      for (u32 e = tid; e < TILE * V_TILE; e += CHUNK_THREADS) {
        const u32 d = e / V_TILE, jj = e % V_TILE;
        float upd = 0.f;
        for (u32 t = 0; t < CHUNK; ++t) upd += xs[t][d] * vn[t][jj];
        s[d0 + d][jj] = carry * s[d0 + d][jj] + upd;
      }
    }
  }
  __syncthreads();
  for (u32 e = tid; e < K_DIM * V_TILE; e += CHUNK_THREADS) {
    const u32 d = e / V_TILE, jj = e % V_TILE;
    if (jj < cols) st[(i64)d * V_DIM + jj] = s[d][jj];
  }
}

// Per (value head, chunk), all in parallel: O = (inter-chunk part in out) + (Q Kᵀ ⊙ decay,
// lower with the diagonal) V', then the gated RMSNorm times silu(z), in place. Warp w owns rows
// w, w + WARPS, ...; lane l value columns l, l + 32, ..., so a row's sum of squares is a warp sum.
extern "C" __global__ void __launch_bounds__(CHUNK_THREADS) gdn_chunk_out(const GdnChunkParams p) {
  KERNEL_ENTRY();
  __shared__ float pm[CHUNK][CHUNK + 1];
  __shared__ float xs[CHUNK][TILE + 1], ys[CHUNK][TILE + 1];
  __shared__ float vs[CHUNK][33];
  __shared__ float gam[CHUNK];
  const Chunk c = chunk_at(p, blockIdx.x, (i64)blockIdx.y * CHUNK);
  const u32 tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const float* x = reinterpret_cast<const float*>(p.x);
  const float* norm = reinterpret_cast<const float*>(p.norm);
  float* out = reinterpret_cast<float*>(p.out) + c.t0 * c.value_width + (i64)c.h * V_DIM;
  if (tid < CHUNK) gam[tid] = tid < c.len ? c.gam[tid] : 0.f;
  float acc[GRAM_PER_THREAD];
  chunk_gram(c.q, c.k, c.conv_width, c.len, xs, ys, acc);
#pragma unroll
  for (int r = 0; r < GRAM_PER_THREAD; ++r) {
    const u32 e = tid + CHUNK_THREADS * r, i = e / CHUNK, j = e % CHUNK;
    pm[i][j] = (j <= i && i < c.len) ? expf(gam[i] - gam[j]) * acc[r] : 0.f;
  }
  float ss[CHUNK / WARPS];
#pragma unroll
  for (int r = 0; r < CHUNK / WARPS; ++r) ss[r] = 0.f;
  for (u32 j0 = 0; j0 < V_DIM; j0 += 32) {
    __syncthreads();  // pm is complete / the previous columns are consumed
    for (u32 e = tid; e < CHUNK * 32; e += CHUNK_THREADS) {
      const u32 t = e / 32, jj = e % 32;
      vs[t][jj] = (t < c.len && j0 + jj < V_DIM) ? c.u[(i64)t * V_DIM + j0 + jj] : 0.f;
    }
    __syncthreads();
#pragma unroll
    for (int r = 0; r < CHUNK / WARPS; ++r) {
      const u32 i = warp + WARPS * r, col = j0 + lane;
      if (i < c.len && col < V_DIM) {
        float* o = out + (i64)i * c.value_width + col;
        float sum = *o;
        for (u32 j = 0; j <= i; ++j) sum += pm[i][j] * vs[j][lane];
        *o = sum;
        ss[r] += sum * sum;
      }
    }
  }
  // Each thread rereads only what it wrote above.
#pragma unroll
  for (int r = 0; r < CHUNK / WARPS; ++r) {
    const u32 i = warp + WARPS * r;
    if (i >= c.len) continue;  // whole warps
    const float total = warp_sum(ss[r]);
    const float* z = x + (c.t0 + i) * p.x_width + c.conv_width + (i64)c.h * V_DIM;
    for (u32 col = lane; col < V_DIM; col += 32) {
      float* o = out + (i64)i * c.value_width + col;
      *o = gated_norm(*o, total, p.eps, norm[col], z[col]);
    }
  }
}
"#;

/// The chunked form's kernels for one head shape. `v_tile` state columns per block of the state
/// pass keep its shared copy of them at `k_dim` (rounded up to [`TILE`]) x `v_tile` <= 4096 floats.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct GdnChunkVariant {
    pub k_dim: u32,
    pub v_dim: u32,
    pub v_tile: u32,
}

/// Tokens per chunk (`CHUNK` in the source).
pub const CHUNK: usize = 64;
/// Threads per block of every chunked kernel (`CHUNK_THREADS`).
const CHUNK_THREADS: u32 = 256;
/// Feature columns staged per step (`TILE`).
const TILE: usize = 16;
/// The state pass's shared copy of its columns, in floats (16 KiB).
const STATE_TILE_FLOATS: usize = 4096;

impl GdnChunkVariant {
    /// The variant for a head shape, or why the kernels cannot run it.
    pub fn for_shape(k_dim: usize, v_dim: usize) -> Result<Self, String> {
        let k_pad = k_dim.next_multiple_of(TILE);
        if k_dim == 0 || v_dim == 0 || k_pad > STATE_TILE_FLOATS {
            return Err(format!("key/value head dims {k_dim}/{v_dim} do not fit the chunked delta-rule kernels"));
        }
        let v_tile = (STATE_TILE_FLOATS / k_pad).min(32).min(v_dim);
        Ok(GdnChunkVariant { k_dim: k_dim as u32, v_dim: v_dim as u32, v_tile: v_tile as u32 })
    }

    /// `gdn_chunk_norm`: one warp per q or k head of a token.
    pub fn norm_config(&self, n_tokens: usize, n_k_heads: usize) -> LaunchConfig {
        let warps = (CHUNK_THREADS / 32) as usize;
        LaunchConfig { grid_dim: (blocks_for(n_tokens * 2 * n_k_heads, warps), 1, 1), block_dim: (CHUNK_THREADS, 1, 1), shared_mem_bytes: 0 }
    }

    /// `gdn_chunk_prep` and `gdn_chunk_out`: one block per (value head, chunk).
    pub fn chunk_config(&self, n_tokens: usize, n_v_heads: usize) -> LaunchConfig {
        let grid = (n_v_heads as u32, blocks_for(n_tokens, CHUNK), 1);
        LaunchConfig { grid_dim: grid, block_dim: (CHUNK_THREADS, 1, 1), shared_mem_bytes: 0 }
    }

    /// `gdn_chunk_state`: one block per (value head, `v_tile` state columns).
    pub fn state_config(&self, n_v_heads: usize) -> LaunchConfig {
        let grid = (n_v_heads as u32, self.v_dim.div_ceil(self.v_tile), 1);
        LaunchConfig { grid_dim: grid, block_dim: (CHUNK_THREADS, 1, 1), shared_mem_bytes: 0 }
    }
}

impl KernelVariant for GdnChunkVariant {
    const FAMILY: &'static str = "gdn_chunk";
    const SOURCES: &'static [&'static str] = &[HEADER, HEAD, GdnChunkParams::C_DECL, CHUNK_SRC];
    const ENTRY_POINTS: &'static [&'static str] = &["gdn_chunk_norm", "gdn_chunk_prep", "gdn_chunk_state", "gdn_chunk_out"];

    fn macros(&self) -> Vec<(&'static str, String)> {
        vec![("K_DIM", self.k_dim.to_string()), ("V_DIM", self.v_dim.to_string()), ("V_TILE", self.v_tile.to_string())]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn macros_match_source() {
        crate::kernels::tests::assert_macros_match(GdnConvVariant);
        crate::kernels::tests::assert_macros_match(GdnDeltaVariant::for_shape(128, 128).unwrap());
        crate::kernels::tests::assert_macros_match(GdnChunkVariant::for_shape(128, 128).unwrap());
    }

    #[test]
    fn chunk_constants_match_the_source() {
        assert!(CHUNK_SRC.contains(&format!("#define CHUNK {CHUNK}\n")));
        assert!(CHUNK_SRC.contains(&format!("#define CHUNK_THREADS {CHUNK_THREADS}\n")));
        assert!(CHUNK_SRC.contains(&format!("#define TILE {TILE}\n")));
    }

    #[test]
    fn chunk_variant_follows_the_head_shape() {
        let v = GdnChunkVariant::for_shape(128, 128).unwrap();
        assert_eq!(v, GdnChunkVariant { k_dim: 128, v_dim: 128, v_tile: 32 });
        assert_eq!(v.state_config(32).grid_dim, (32, 4, 1));
        assert_eq!(v.chunk_config(129, 32).grid_dim, (32, 3, 1));
        assert_eq!(v.norm_config(3, 16).grid_dim, (12, 1, 1));
        assert_eq!(GdnChunkVariant::for_shape(256, 64).unwrap().v_tile, 16);
        assert_eq!(GdnChunkVariant::for_shape(33, 7).unwrap().v_tile, 7);
        assert_eq!(GdnChunkVariant::for_shape(1024, 32).unwrap().v_tile, 4);
        assert!(GdnChunkVariant::for_shape(4097, 8).is_err());
        assert!(GdnChunkVariant::for_shape(16, 0).is_err());
    }

    #[test]
    fn delta_variant_follows_the_head_shape() {
        assert_eq!(GdnDeltaVariant::for_shape(128, 128), Ok(GdnDeltaVariant { k_dim: 128, v_dim: 128, ksplit: 4 }));
        assert_eq!(GdnDeltaVariant::for_shape(16, 12), Ok(GdnDeltaVariant { k_dim: 16, v_dim: 12, ksplit: 1 }));
        assert_eq!(GdnDeltaVariant::for_shape(33, 7).unwrap().ksplit, 2);
        assert_eq!(GdnDeltaVariant::for_shape(256, 128).unwrap().ksplit, 8);
        assert_eq!(GdnDeltaVariant::for_shape(128, 128).unwrap().launch_config(32, 1).block_dim, (512, 1, 1));
        assert_eq!(GdnDeltaVariant::for_shape(16, 12).unwrap().launch_config(4, 3).block_dim, (32, 1, 1));
        assert_eq!(GdnDeltaVariant::for_shape(16, 12).unwrap().launch_config(4, 3).grid_dim, (4, 3, 1));
        assert!(GdnDeltaVariant::for_shape(256, 256).is_err());
        assert!(GdnDeltaVariant::for_shape(2048, 8).is_err());
        assert!(GdnDeltaVariant::for_shape(0, 8).is_err());
    }
}
