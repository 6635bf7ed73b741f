//! Gated DeltaNet (Qwen3.5 / Qwen3-Next linear attention) in its recurrent form: the causal
//! depthwise conv1d + SiLU over the `q | k | v` channels, then the gated delta rule on the f32
//! state with the gated RMSNorm of its output. Both walk the batch's tokens in order, so one
//! launch serves decode (one token) and, for now, prefill (see `ops::gdn_plan`).
//!
//! Layouts, as ferrite-cpu's `kernels::gdn`: the projected input `x` has rows of
//! `q | k | v | z | b | a` (`proj_width`); the conv output has rows of `q | k | v` (`conv_width`
//! channels); conv state `[conv_kernel - 1, conv_width]` (the last inputs, oldest first); delta
//! state per value head a row-major `[k_dim, v_dim]` matrix `S` (`S[i][j]`: key dim `i`, value
//! dim `j`). Value head `h` reads key head `h % n_k_heads` (llama.cpp's tiled order).

use super::common::HEADER;
use super::{blocks_for, device_params, KernelVariant};
use cudarc::driver::LaunchConfig;

device_params! {
    pub struct GdnConvParams {
        pub x: u64,
        pub weight: u64,
        pub state: u64,
        pub out: u64,
        pub n_tokens: u32,
        /// Channels (`conv_width`): the first columns of each `x` row, and the `out` row width.
        pub channels: u32,
        /// Row width of `x` (`proj_width`).
        pub x_width: u32,
        /// Taps per channel (`conv_kernel`); the last one multiplies the current token.
        pub taps: u32,
    }
}

const CONV: &str = r#"
// One thread per channel, tokens in order. Input t - (taps - 1) + j feeds tap j; inputs before
// the batch come from the state. The sum starts with the current token's tap, then the older
// ones oldest first: the CPU reference's order.
extern "C" __global__ void gdn_conv(const GdnConvParams p) {
  KERNEL_ENTRY();
  const u32 c = blockIdx.x * blockDim.x + threadIdx.x;
  if (c >= p.channels) return;
  const float* x = reinterpret_cast<const float*>(p.x) + c;
  const float* w = reinterpret_cast<const float*>(p.weight) + (i64)c * p.taps;
  float* state = reinterpret_cast<float*>(p.state) + c;
  float* out = reinterpret_cast<float*>(p.out) + c;
  const i64 hist = p.taps - 1;
  // Input i of the batch (i < 0: state row hist + i).
#define CONV_INPUT(i) ((i) >= 0 ? x[(i) * p.x_width] : state[(hist + (i)) * p.channels])
  for (i64 t = 0; t < p.n_tokens; ++t) {
    float acc = w[hist] * x[t * p.x_width];
    for (i64 j = 0; j < hist; ++j) acc += w[j] * CONV_INPUT(t - hist + j);
    out[t * p.channels] = silu(acc);
  }
  // The new window: inputs n - hist .. n - 1. Row r reads state row n + r > r when it comes
  // from the old state, which is not yet overwritten.
  for (i64 r = 0; r < hist; ++r) state[r * p.channels] = CONV_INPUT((i64)p.n_tokens - hist + r);
#undef CONV_INPUT
}
"#;

/// The conv has no compile-time options.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct GdnConvVariant;

impl GdnConvVariant {
    pub fn launch_config(&self, channels: usize) -> LaunchConfig {
        LaunchConfig { grid_dim: (blocks_for(channels, 256), 1, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 }
    }
}

impl KernelVariant for GdnConvVariant {
    const FAMILY: &'static str = "gdn_conv";
    const SOURCES: &'static [&'static str] = &[HEADER, GdnConvParams::C_DECL, CONV];
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
        pub n_tokens: u32,
        pub n_k_heads: u32,
        pub n_v_heads: u32,
        pub x_width: u32,
        /// `k_dim^-1/2`, the query scale (computed on the host as the CPU reference does).
        pub q_scale: f32,
        pub eps: f32,
    }
}

const DELTA: &str = r#"
#ifndef K_DIM
#error "K_DIM (key head dimension: rows of the state) must come from the kernel variant"
#endif
#ifndef V_DIM
#error "V_DIM (value head dimension: columns of the state) must come from the kernel variant"
#endif
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

// torch's softplus (beta 1, threshold 20).
__device__ __forceinline__ float softplus(float x) { return x > 20.f ? x : log1pf(expf(x)); }

// One block per value head. Thread j * KSPLIT + s owns state column j (value dim j), rows
// s, s + KSPLIT, ... in registers for the whole batch; the state is read once and written once.
// Threads past the last column (blockDim is whole warps) hold zeros and only join the sums.
// Per token: L2-normalise q (times q_scale) and k, decay S, predict Sᵀk, rank-1 update with
// beta (v - Sᵀk), read o = Sᵀq, then out = rmsnorm(o) * norm * silu(z) over the head.
extern "C" __global__ void __launch_bounds__(THREADS) gdn_delta(const GdnDeltaParams p) {
  KERNEL_ENTRY();
  __shared__ float sq[K_DIM], sk[K_DIM], scratch[32];
  const u32 h = blockIdx.x, kh = h % p.n_k_heads;
  const u32 j = threadIdx.x / KSPLIT, s = threadIdx.x % KSPLIT, lane = threadIdx.x & 31;
  const bool owner = j < V_DIM;
  const i64 key_width = (i64)p.n_k_heads * K_DIM, value_width = (i64)p.n_v_heads * V_DIM;
  const i64 conv_width = 2 * key_width + value_width;
  const float* qkv = reinterpret_cast<const float*>(p.qkv);
  const float* x = reinterpret_cast<const float*>(p.x);
  float* st = reinterpret_cast<float*>(p.state) + (i64)h * K_DIM * V_DIM;
  float* out = reinterpret_cast<float*>(p.out);
  const float a_coef = reinterpret_cast<const float*>(p.a_coef)[h];
  const float dt_bias = reinterpret_cast<const float*>(p.dt_bias)[h];
  const float norm_w = owner ? reinterpret_cast<const float*>(p.norm)[j] : 0.f;

  float S[ROWS];
#pragma unroll
  for (int m = 0; m < ROWS; ++m) {
    const u32 i = s + KSPLIT * m;
    S[m] = (owner && i < K_DIM) ? st[(i64)i * V_DIM + j] : 0.f;
  }
  for (u32 t = 0; t < p.n_tokens; ++t) {
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
    const float inv_q = 1.f / sqrtf(warp_sum(qq) + 1e-6f) * p.q_scale;
    const float inv_k = 1.f / sqrtf(warp_sum(kk) + 1e-6f);
    const float b = xrow[conv_width + value_width + h];
    const float a = xrow[conv_width + value_width + p.n_v_heads + h];
    const float beta = 1.f / (1.f + expf(-b));
    const float decay = expf(a_coef * softplus(a + dt_bias));
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
      const float inv = 1.f / sqrtf(ss / (float)V_DIM + p.eps);
      const float z = xrow[conv_width + (i64)h * V_DIM + j];
      out[(i64)t * value_width + (i64)h * V_DIM + j] = o * inv * norm_w * silu(z);
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

    /// One block of whole warps per value head.
    pub fn launch_config(&self, n_v_heads: usize) -> LaunchConfig {
        let threads = (self.ksplit * self.v_dim).next_multiple_of(32);
        LaunchConfig { grid_dim: (n_v_heads as u32, 1, 1), block_dim: (threads, 1, 1), shared_mem_bytes: 0 }
    }
}

impl KernelVariant for GdnDeltaVariant {
    const FAMILY: &'static str = "gdn_delta";
    const SOURCES: &'static [&'static str] = &[HEADER, GdnDeltaParams::C_DECL, DELTA];
    const ENTRY_POINTS: &'static [&'static str] = &["gdn_delta"];

    fn macros(&self) -> Vec<(&'static str, String)> {
        vec![("K_DIM", self.k_dim.to_string()), ("V_DIM", self.v_dim.to_string()), ("KSPLIT", self.ksplit.to_string())]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn macros_match_source() {
        crate::kernels::tests::assert_macros_match(GdnConvVariant);
        crate::kernels::tests::assert_macros_match(GdnDeltaVariant::for_shape(128, 128).unwrap());
    }

    #[test]
    fn delta_variant_follows_the_head_shape() {
        assert_eq!(GdnDeltaVariant::for_shape(128, 128), Ok(GdnDeltaVariant { k_dim: 128, v_dim: 128, ksplit: 4 }));
        assert_eq!(GdnDeltaVariant::for_shape(16, 12), Ok(GdnDeltaVariant { k_dim: 16, v_dim: 12, ksplit: 1 }));
        assert_eq!(GdnDeltaVariant::for_shape(33, 7).unwrap().ksplit, 2);
        assert_eq!(GdnDeltaVariant::for_shape(256, 128).unwrap().ksplit, 8);
        assert_eq!(GdnDeltaVariant::for_shape(128, 128).unwrap().launch_config(32).block_dim, (512, 1, 1));
        assert_eq!(GdnDeltaVariant::for_shape(16, 12).unwrap().launch_config(4).block_dim, (32, 1, 1));
        assert!(GdnDeltaVariant::for_shape(256, 256).is_err());
        assert!(GdnDeltaVariant::for_shape(2048, 8).is_err());
        assert!(GdnDeltaVariant::for_shape(0, 8).is_err());
    }
}
