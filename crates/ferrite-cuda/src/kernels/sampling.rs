//! Token selection on the device, so that only the chosen id (4 bytes) is read back.
//!
//! `argmax`: first index of the largest logit (NaN counts as smallest).
//! `sample`: llama.cpp's chain, as ferrite-engine's host sampler runs it: top-k, then top-p and
//! min-p judged on temperature-1 probabilities, then temperature on the survivors and one draw
//! from a counter-based RNG keyed by (seed, step). Thresholds are found by bisection over the
//! logits' ordered bit patterns with fixed-order block reductions, and the draw walks the
//! vocabulary in index order, so the same (logits, seed, step) always gives the same token.
//! top-k is a radix select (4 histogram passes); when at most 1024 tokens survive it, they are
//! gathered into shared memory and the later filters run on them alone.
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
        /// 0, or the next decode step's inputs: the token goes to `feed_ids[0]`, and
        /// `next_pos` to `feed_pos[0]` (see `ops::TokenDelivery`).
        pub feed_ids: u64,
        pub feed_pos: u64,
        /// 0, or a device-mapped host `u32 [4]`: token, the device error flag's two words, `tag`.
        pub mailbox: u64,
        pub error_flag: u64,
        pub n: u32,
        pub top_k: u32,
        pub temperature: f32,
        pub top_p: f32,
        pub min_p: f32,
        pub next_pos: u32,
        pub tag: u32,
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

// One block per row of n logits (a batched step's sequences): out[row] = its argmax.
extern "C" __global__ void __launch_bounds__(BLOCK_SIZE) argmax(const ArgmaxParams p) {
  KERNEL_ENTRY();
  __shared__ u32 s_key[32], s_idx[32];
  const u32 best = block_argmax(reinterpret_cast<const float*>(p.logits) + (u64)blockIdx.x * p.n, p.n, s_key, s_idx);
  if (threadIdx.x == 0) reinterpret_cast<u32*>(p.out)[blockIdx.x] = best;
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

// Inclusive prefix sum over the block (Hillis-Steele, fixed order). `s` holds BLOCK_SIZE
// values; afterwards s[t] is thread t's inclusive sum, valid until the next scan.
template <typename T>
__device__ T block_scan(T v, T* s) {
  __syncthreads();  // an earlier scan's results may still be being read
  s[threadIdx.x] = v;
  __syncthreads();
  for (int off = 1; off < BLOCK_SIZE; off <<= 1) {
    const T add = threadIdx.x >= off ? s[threadIdx.x - off] : T(0);
    __syncthreads();
    s[threadIdx.x] += add;
    __syncthreads();
  }
  return s[threadIdx.x];
}

// A thread's tokens after top-k: one gathered candidate, or its chunk of the vocabulary.
struct Mine {
  bool gathered;
  u32 kept;
  const float* c_logit;
  const u32* c_index;
  const float* logits;
  u32 begin, end;
  // Call f(logit, index) for each, in index order.
  template <typename F>
  __device__ void each(F&& f) const {
    if (gathered) {
      if (threadIdx.x < kept) f(c_logit[threadIdx.x], c_index[threadIdx.x]);
    } else {
      for (u32 i = begin; i < end; ++i) f(logits[i], i);
    }
  }
};

// The chosen token (one thread): to out[0] and, when asked, on to the next decode step (its
// input id and position) and to the host's mailbox with the error flag. The tag goes last, so
// a mailbox holding this call's tag holds this call's token.
__device__ __forceinline__ void deliver(const SampleParams& p, u32 token) {
  reinterpret_cast<u32*>(p.out)[0] = token;
  if (p.feed_ids) {
    reinterpret_cast<u32*>(p.feed_ids)[0] = token;
    reinterpret_cast<u32*>(p.feed_pos)[0] = p.next_pos;
  }
  if (p.mailbox) {
    volatile u32* m = reinterpret_cast<volatile u32*>(p.mailbox);
    const volatile u32* flag = reinterpret_cast<const volatile u32*>(p.error_flag);
    m[0] = token;
    m[1] = flag[0];
    m[2] = flag[1];
    __threadfence_system();
    m[3] = p.tag;
  }
}

extern "C" __global__ void __launch_bounds__(BLOCK_SIZE) sample(const SampleParams p) {
  KERNEL_ENTRY();
  __shared__ u32 s_key[32], s_idx[32], s_radix[2], s_hist[256];
  __shared__ float scratch[32];
  __shared__ float s_fscan[BLOCK_SIZE];
  __shared__ u32 s_uscan[BLOCK_SIZE];
  __shared__ float c_logit[BLOCK_SIZE];
  __shared__ u32 c_index[BLOCK_SIZE];
  const float* logits = reinterpret_cast<const float*>(p.logits);
  const u32 n = p.n;
  const u32 best = block_argmax(logits, n, s_key, s_idx);
  const float max_logit = logits[best];
  // Greedy cases, and logits with no finite maximum (nothing to weigh).
  if (p.temperature <= 0.f || p.top_k == 1u || n == 1u || !(fabsf(max_logit) <= 3.402823466e38f)) {
    if (threadIdx.x == 0) deliver(p, best);
    return;
  }

  // top-k: radix select of the top_k-th largest key, 8 bits per pass from the top; th is that
  // key, so every token with key >= th stays (ties at the cut are all kept).
  u32 th = 0u;
  if (p.top_k > 0u && p.top_k < n) {
    u32 prefix = 0u, mask = 0u, k = p.top_k;
    for (int shift = 24; shift >= 0; shift -= 8) {
      for (int b = threadIdx.x; b < 256; b += BLOCK_SIZE) s_hist[b] = 0u;
      __syncthreads();
      for (u32 i = threadIdx.x; i < n; i += BLOCK_SIZE) {
        const u32 key = order_key(logits[i]);
        if ((key & mask) == prefix) atomicAdd(&s_hist[(key >> shift) & 255u], 1u);
      }
      __syncthreads();
      if (threadIdx.x == 0) {
        // At least k keys match the prefix, so the walk stops at a bucket >= 0.
        u32 above = 0u;
        int b = 255;
        while (above + s_hist[b] < k) above += s_hist[b--];
        s_radix[0] = prefix | ((u32)b << shift);
        s_radix[1] = k - above;
      }
      __syncthreads();
      prefix = s_radix[0];
      k = s_radix[1];
      mask |= 255u << shift;
    }
    th = prefix;
  }

  // Thread t owns the contiguous chunk [begin, end) of the vocabulary. When at most BLOCK_SIZE
  // tokens survive top-k they are gathered (in index order) into shared memory, one per
  // thread, and the filters below touch only them; otherwise they scan the chunks.
  const u32 chunk = (n + BLOCK_SIZE - 1) / BLOCK_SIZE;
  const u32 begin = min(n, threadIdx.x * chunk), end = min(n, begin + chunk);
  u32 my_count = 0u;
  for (u32 i = begin; i < end; ++i) my_count += order_key(logits[i]) >= th ? 1u : 0u;
  const u32 slot_end = block_scan(my_count, s_uscan);
  const u32 kept = s_uscan[BLOCK_SIZE - 1];
  const bool gathered = kept <= BLOCK_SIZE;
  if (gathered) {
    u32 slot = slot_end - my_count;
    for (u32 i = begin; i < end; ++i) {
      if (order_key(logits[i]) >= th) {
        c_logit[slot] = logits[i];
        c_index[slot] = i;
        ++slot;
      }
    }
  }
  __syncthreads();
  const Mine mine = {gathered, kept, c_logit, c_index, logits, begin, end};
  // This thread's unnormalised probability mass at temperature 1/inv_t over keys >= t.
  auto mass = [&](u32 t, float inv_t) {
    float m = 0.f;
    mine.each([&](float l, u32) {
      if (order_key(l) >= t) m += expf((l - max_logit) * inv_t);
    });
    return m;
  };

  // top-p: the largest threshold whose kept mass still reaches top_p of the top-k mass.
  if (p.top_p > 0.f && p.top_p < 1.f) {
    const float target = p.top_p * block_sum(mass(th, 1.f), scratch);
    u32 tp = 0u;
    for (int bit = 31; bit >= 0; --bit) {
      const u32 cand = tp | (1u << bit);
      if (block_sum(mass(max(cand, th), 1.f), scratch) >= target) tp = cand;
    }
    th = max(th, tp);
  }
  // min-p: p_i >= min_p * p_max  <=>  l_i >= max + ln(min_p); the top token always stays.
  if (p.min_p > 0.f) th = max(th, min(order_key(max_logit + logf(p.min_p)), order_key(max_logit)));

  // Draw: an inclusive scan of the threads' masses splits [0, total) between them in index
  // order; the thread whose share holds r walks its tokens.
  const float inv_t = 1.f / p.temperature;
  const float my_mass = mass(th, inv_t);
  const float after = block_scan(my_mass, s_fscan);
  const float total = s_fscan[BLOCK_SIZE - 1];
  const float before = threadIdx.x ? s_fscan[threadIdx.x - 1] : 0.f;
  const u64 step = p.step + (p.step_ptr ? (u64)reinterpret_cast<const u32*>(p.step_ptr)[0] : 0ull);
  // u < 1, but u * total may round up to total: stay strictly below it.
  const float r = fminf(uniform01(p.seed, step) * total, __uint_as_float(__float_as_uint(total) - 1u));
  if (r >= before && r < after) {
    float c = before;
    u32 pick = NO_INDEX;
    bool done = false;
    mine.each([&](float l, u32 i) {
      if (done || order_key(l) < th) return;
      const float w = expf((l - max_logit) * inv_t);
      if (w > 0.f) {
        pick = i;
        c += w;
        done = c > r;
      }
    });
    deliver(p, pick);
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
        self.rows_launch_config(1)
    }

    /// `argmax` over `rows` rows: a block per row.
    pub fn rows_launch_config(&self, rows: u32) -> LaunchConfig {
        LaunchConfig { grid_dim: (rows, 1, 1), block_dim: (self.block_size, 1, 1), shared_mem_bytes: 0 }
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
