//! Token selection on the device, so that only the chosen id (4 bytes) is read back.
//!
//! `argmax`: first index of the largest logit (NaN counts as smallest).
//! `sample`: llama.cpp's chain, as ferrite-engine's host sampler runs it: top-k, then top-p and
//! min-p judged on temperature-1 probabilities, then temperature on the survivors and one draw
//! from a counter-based RNG keyed by (seed, step). Thresholds are found by bisection over the
//! logits' ordered bit patterns with fixed-order block reductions, and the draw walks the
//! vocabulary in index order, so the same (logits, seed, step) always gives the same token.
//! [`sampling_uniform`] reproduces the draw on the host.

use super::common::HEADER;
use super::{device_params, KernelVariant};
use cudarc::driver::LaunchConfig;

device_params! {
    pub struct ArgmaxParams {
        pub logits: u64,
        pub out: u64,
        pub n: u32,
        pub pad: u32,
    }
}

device_params! {
    pub struct SampleParams {
        pub logits: u64,
        pub out: u64,
        /// 0, or a device `u32` added to `step` (e.g. the token's position).
        pub step_ptr: u64,
        pub seed: u64,
        pub step: u64,
        pub n: u32,
        pub top_k: u32,
        pub temperature: f32,
        pub top_p: f32,
        pub min_p: f32,
        pub pad: u32,
    }
}

const SOURCE: &str = r#"
#ifndef BLOCK_SIZE
#error "BLOCK_SIZE (threads of the single sampling block) must come from the kernel variant"
#endif
#define NO_INDEX 0xffffffffu

// Monotone map of floats to u32 (larger float -> larger key); NaN maps to 0, below -inf.
__device__ __forceinline__ u32 order_key(float f) {
  if (f != f) return 0u;
  const u32 b = __float_as_uint(f);
  return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}

// (key, index) pairs: larger key wins, then smaller index.
__device__ __forceinline__ void keep_better(u32& key, u32& idx, u32 k2, u32 i2) {
  if (k2 > key || (k2 == key && i2 < idx)) { key = k2; idx = i2; }
}

__device__ u32 block_argmax(const float* logits, u32 n, u32* s_key, u32* s_idx) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  u32 key = 0u, idx = NO_INDEX;
  for (u32 i = threadIdx.x; i < n; i += BLOCK_SIZE) keep_better(key, idx, order_key(logits[i]), i);
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) keep_better(key, idx, __shfl_xor_sync(FULL_MASK, key, o), __shfl_xor_sync(FULL_MASK, idx, o));
  __syncthreads();
  if (lane == 0) { s_key[warp] = key; s_idx[warp] = idx; }
  __syncthreads();
  if (warp == 0) {
    key = lane < BLOCK_SIZE / 32 ? s_key[lane] : 0u;
    idx = lane < BLOCK_SIZE / 32 ? s_idx[lane] : NO_INDEX;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) keep_better(key, idx, __shfl_xor_sync(FULL_MASK, key, o), __shfl_xor_sync(FULL_MASK, idx, o));
    if (lane == 0) s_idx[0] = idx;
  }
  __syncthreads();
  return s_idx[0];
}

extern "C" __global__ void __launch_bounds__(BLOCK_SIZE) argmax(const ArgmaxParams p) {
  __shared__ u32 s_key[32], s_idx[32];
  const u32 best = block_argmax(reinterpret_cast<const float*>(p.logits), p.n, s_key, s_idx);
  if (threadIdx.x == 0) reinterpret_cast<u32*>(p.out)[0] = best;
}

// splitmix64 finaliser; must match sampling_uniform in kernels/sampling.rs.
__device__ __forceinline__ u64 mix64(u64 z) {
  z += 0x9E3779B97F4A7C15ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}
__device__ __forceinline__ float uniform01(u64 seed, u64 step) {
  return (float)(mix64(seed ^ mix64(step)) >> 40) * (1.0f / 16777216.0f);
}

extern "C" __global__ void __launch_bounds__(BLOCK_SIZE) sample(const SampleParams p) {
  __shared__ u32 s_key[32], s_idx[32];
  __shared__ float scratch[32];
  __shared__ float s_scan[BLOCK_SIZE];
  const float* logits = reinterpret_cast<const float*>(p.logits);
  u32* out = reinterpret_cast<u32*>(p.out);
  const u32 n = p.n;
  const u32 best = block_argmax(logits, n, s_key, s_idx);
  const float max_logit = logits[best];
  // Greedy cases, and logits with no finite maximum (nothing to weigh).
  if (p.temperature <= 0.f || p.top_k == 1u || n == 1u || !(fabsf(max_logit) <= 3.402823466e38f)) {
    if (threadIdx.x == 0) out[0] = best;
    return;
  }
  // Weight of token i at temperature 1 (filters) or T (draw), if its key reaches threshold th.
  auto weight = [&](u32 i, u32 th, float inv_t) -> float {
    const float l = logits[i];
    return order_key(l) >= th ? expf((l - max_logit) * inv_t) : 0.f;
  };

  // top-k: the largest key th with at least top_k keys >= th (ties at the cut are all kept).
  u32 th = 0u;
  if (p.top_k > 0u && p.top_k < n) {
    for (int bit = 31; bit >= 0; --bit) {
      const u32 cand = th | (1u << bit);
      float count = 0.f;
      for (u32 i = threadIdx.x; i < n; i += BLOCK_SIZE) count += order_key(logits[i]) >= cand ? 1.f : 0.f;
      if (block_sum(count, scratch) >= (float)p.top_k) th = cand;
    }
  }
  // top-p: the largest threshold whose kept mass still reaches top_p of the top-k mass.
  if (p.top_p > 0.f && p.top_p < 1.f) {
    float z = 0.f;
    for (u32 i = threadIdx.x; i < n; i += BLOCK_SIZE) z += weight(i, th, 1.f);
    const float target = p.top_p * block_sum(z, scratch);
    u32 tp = 0u;
    for (int bit = 31; bit >= 0; --bit) {
      const u32 cand = tp | (1u << bit), t = max(cand, th);
      float mass = 0.f;
      for (u32 i = threadIdx.x; i < n; i += BLOCK_SIZE) mass += weight(i, t, 1.f);
      if (block_sum(mass, scratch) >= target) tp = cand;
    }
    th = max(th, tp);
  }
  // min-p: p_i >= min_p * p_max  <=>  l_i >= max + ln(min_p); the top token always stays.
  if (p.min_p > 0.f) th = max(th, min(order_key(max_logit + logf(p.min_p)), order_key(max_logit)));
  const float inv_t = 1.f / p.temperature;

  // Draw: thread t owns the contiguous chunk [begin, end); an inclusive scan of the chunk
  // masses splits [0, total) between threads in index order.
  const u32 chunk = (n + BLOCK_SIZE - 1) / BLOCK_SIZE;
  const u32 begin = min(n, threadIdx.x * chunk), end = min(n, begin + chunk);
  float mass = 0.f;
  for (u32 i = begin; i < end; ++i) mass += weight(i, th, inv_t);
  s_scan[threadIdx.x] = mass;
  __syncthreads();
  for (int off = 1; off < BLOCK_SIZE; off <<= 1) {
    const float v = threadIdx.x >= off ? s_scan[threadIdx.x - off] : 0.f;
    __syncthreads();
    s_scan[threadIdx.x] += v;
    __syncthreads();
  }
  const float total = s_scan[BLOCK_SIZE - 1];
  const u64 step = p.step + (p.step_ptr ? (u64)reinterpret_cast<const u32*>(p.step_ptr)[0] : 0ull);
  // u < 1, but u * total may round up to total: stay strictly below it.
  const float r = fminf(uniform01(p.seed, step) * total, __uint_as_float(__float_as_uint(total) - 1u));
  const float before = threadIdx.x ? s_scan[threadIdx.x - 1] : 0.f, after = s_scan[threadIdx.x];
  if (r >= before && r < after) {
    float c = before;
    u32 pick = NO_INDEX;
    for (u32 i = begin; i < end; ++i) {
      const float pr = weight(i, th, inv_t);
      if (pr > 0.f) {
        pick = i;
        c += pr;
        if (c > r) break;
      }
    }
    out[0] = pick;
  }
}
"#;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct SamplingVariant {
    pub block_size: u32,
}

impl SamplingVariant {
    pub const DEFAULT: SamplingVariant = SamplingVariant { block_size: 1024 };

    pub fn launch_config(&self) -> LaunchConfig {
        LaunchConfig { grid_dim: (1, 1, 1), block_dim: (self.block_size, 1, 1), shared_mem_bytes: 0 }
    }
}

impl KernelVariant for SamplingVariant {
    const FAMILY: &'static str = "sampling";
    const SOURCES: &'static [&'static str] = &[HEADER, ArgmaxParams::C_DECL, SampleParams::C_DECL, SOURCE];
    const ENTRY_POINTS: &'static [&'static str] = &["argmax", "sample"];

    fn macros(&self) -> Vec<(&'static str, String)> {
        vec![("BLOCK_SIZE", self.block_size.to_string())]
    }
}

fn mix64(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// The uniform number in [0, 1) that `sample` draws for (seed, step): the same on host and
/// device, so a CPU backend can reproduce the CUDA backend's choices.
pub fn sampling_uniform(seed: u64, step: u64) -> f32 {
    (mix64(seed ^ mix64(step)) >> 40) as f32 * (1.0 / 16_777_216.0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn macros_match_source() {
        crate::kernels::tests::assert_macros_match(SamplingVariant::DEFAULT);
    }

    #[test]
    fn uniform_is_in_range_and_spread() {
        let draws: Vec<f32> = (0..10_000).map(|s| sampling_uniform(42, s)).collect();
        assert!(draws.iter().all(|&u| (0.0..1.0).contains(&u)));
        let mean = draws.iter().sum::<f32>() / draws.len() as f32;
        assert!((mean - 0.5).abs() < 0.02, "mean {mean}");
        assert_ne!(sampling_uniform(1, 5), sampling_uniform(2, 5));
        assert_eq!(sampling_uniform(7, 9), sampling_uniform(7, 9));
    }
}
