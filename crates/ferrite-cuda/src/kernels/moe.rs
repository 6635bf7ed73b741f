//! Mixture-of-experts FFN (Qwen3.5-MoE): the routing of each token and the weighted combination
//! of its experts' outputs. The experts themselves run on the GEMVs with `EXPERTS`
//! ([`super::gemv`]), which read the expert ids this routing leaves in device memory, so a
//! whole MoE layer runs without the host (and inside the captured decode graph).
//!
//! ## `moe_route` (one 64-thread block per token)
//!
//! ferrite-cpu's `kernels::moe::route`, step for step: the maximum logit, `p_e = exp(l_e - max)`,
//! their sum in expert order by one thread (the CPU's order, so the f32 sum is the same), the
//! `top_k` largest `p_e` (strictly larger wins: ties go to the lower expert index), each
//! divided by the sum, then with `norm_topk_prob` by their own sum (in slot order). While one
//! thread of the second warp sums, the first warp selects: each of the `top_k` passes is a warp
//! argmax over `(p, index)`, a total order, so every lane agrees; a chosen expert's key drops
//! to -1, below every probability. The exponential is taken in double and rounded to f32: the
//! correctly rounded value, which glibc's `expf` (the CPU side) also returns in all but rare
//! cases; CUDA's `expf` is off by up to 2 ulp. Weights therefore match the CPU to an ulp or
//! two, and the ids exactly unless two probabilities are that close.
//!
//! ## `moe_combine` (one 256-thread block per token)
//!
//! `out[t] = Σ_slots w[t, j] y[t * top_k + j] + sigmoid(x[t] · gate_inp) shared[t] + residual[t]`,
//! the slots summed in ascending expert order with separately rounded products and sums:
//! ferrite-cpu adds the experts' outputs in that order, then the shared expert, then the
//! residual (the gate's dot product is a fixed-order block sum instead of the CPU's sequential
//! one). `SHARED` and `RESIDUAL` select the optional terms.

use super::common::HEADER;
use super::{device_params, KernelVariant};
use cudarc::driver::LaunchConfig;

device_params! {
    pub struct MoeRouteParams {
        /// Router logits `[n_tokens, n_experts]`.
        pub logits: u64,
        /// Outputs, `[n_tokens, top_k]`: expert ids (u32) and weights (f32).
        pub ids: u64,
        pub weights: u64,
        pub n_experts: u32,
        pub top_k: u32,
        pub norm_topk_prob: u32,
        pub pad: u32,
    }
}

device_params! {
    pub struct MoeCombineParams {
        /// Routing `[n_tokens, top_k]` (ids u32, weights f32) and the experts' outputs
        /// `[n_tokens * top_k, dim]`.
        pub ids: u64,
        pub weights: u64,
        pub y: u64,
        /// `SHARED`: the shared expert's output `[n_tokens, dim]`, the FFN input `x` and the
        /// gate vector `gate_inp` (`dim`).
        pub shared: u64,
        pub x: u64,
        pub gate_inp: u64,
        /// `RESIDUAL`: `[n_tokens, dim]`.
        pub residual: u64,
        pub out: u64,
        pub top_k: u32,
        pub dim: u32,
    }
}

const ROUTE_SOURCE: &str = r#"
// Dynamic shared memory: prob[n_experts], key[n_experts], sel_p[top_k], sel_id[top_k].
extern "C" __global__ void __launch_bounds__(64) moe_route(const MoeRouteParams p) {
  KERNEL_ENTRY();
  extern __shared__ float smem[];
  __shared__ float part[2];
  __shared__ float total;
  const u32 E = p.n_experts, K = p.top_k;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const i64 t = blockIdx.x;
  const float* logits = reinterpret_cast<const float*>(p.logits) + t * E;
  float* prob = smem;
  float* key = smem + E;
  float* sel_p = smem + 2 * E;
  u32* sel_id = reinterpret_cast<u32*>(smem + 2 * E + K);

  // The maximum (fmaxf, like f32::max, ignores NaN; it is exact in any order).
  float m = NEG_INF;
  for (u32 e = tid; e < E; e += 64) m = fmaxf(m, logits[e]);
  m = warp_max(m);
  if (lane == 0) part[warp] = m;
  __syncthreads();
  m = fmaxf(part[0], part[1]);
  for (u32 e = tid; e < E; e += 64) {
    const float v = (float)exp((double)(logits[e] - m));
    prob[e] = v;
    key[e] = v == v ? v : -0.5f;  // a NaN probability ranks below every number (and stays a valid pick)
  }
  __syncthreads();
  if (warp == 1) {
    // The softmax denominator in expert order, as the CPU sums it.
    if (lane == 0) {
      float s = 0.f;
      for (u32 e = 0; e < E; ++e) s += prob[e];
      total = s;
    }
  } else {
    for (u32 j = 0; j < K; ++j) {
      // Each lane scans its experts upwards (strictly larger wins, so the lower index keeps a
      // tie), then a butterfly over (key, index): the same winner in every lane.
      float best = -2.f;
      u32 bi = E;
      for (u32 e = lane; e < E; e += 32) {
        const float v = key[e];
        if (v > best) { best = v; bi = e; }
      }
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) {
        const float ob = __shfl_xor_sync(FULL_MASK, best, o);
        const u32 oi = __shfl_xor_sync(FULL_MASK, bi, o);
        if (ob > best || (ob == best && oi < bi)) { best = ob; bi = oi; }
      }
      if (lane == 0) {
        sel_id[j] = bi;
        sel_p[j] = prob[bi];
        key[bi] = -1.f;
      }
      __syncwarp();
    }
  }
  __syncthreads();
  if (tid == 0) {
    for (u32 j = 0; j < K; ++j) sel_p[j] = sel_p[j] / total;
    if (p.norm_topk_prob) {
      float s = 0.f;
      for (u32 j = 0; j < K; ++j) s += sel_p[j];
      for (u32 j = 0; j < K; ++j) sel_p[j] = sel_p[j] / s;
    }
    u32* ids = reinterpret_cast<u32*>(p.ids) + t * K;
    float* weights = reinterpret_cast<float*>(p.weights) + t * K;
    for (u32 j = 0; j < K; ++j) {
      ids[j] = sel_id[j];
      weights[j] = sel_p[j];
    }
  }
}
"#;

const COMBINE_SOURCE: &str = r#"
#ifndef SHARED
#error "SHARED (1: add the gated shared expert) must come from the kernel variant"
#endif
#ifndef RESIDUAL
#error "RESIDUAL (1: add the residual) must come from the kernel variant"
#endif

// Dynamic shared memory: the token's slots in ascending expert order (top_k u32).
extern "C" __global__ void __launch_bounds__(256) moe_combine(const MoeCombineParams p) {
  KERNEL_ENTRY();
  extern __shared__ u32 order[];
  const u32 K = p.top_k, d = p.dim;
  const i64 t = blockIdx.x;
  const u32* ids = reinterpret_cast<const u32*>(p.ids) + t * K;
  if (threadIdx.x < K) {
    // Rank of this slot among the token's slots by (expert id, slot).
    const u32 mine = ids[threadIdx.x];
    u32 rank = 0;
    for (u32 j = 0; j < K; ++j) {
      const u32 other = ids[j];
      rank += other < mine || (other == mine && j < threadIdx.x);
    }
    order[rank] = threadIdx.x;
  }
#if SHARED
  __shared__ float scratch[32];
  const float* x = reinterpret_cast<const float*>(p.x) + t * d;
  const float* gate_inp = reinterpret_cast<const float*>(p.gate_inp);
  float s = 0.f;
  for (u32 c = threadIdx.x; c < d; c += blockDim.x) s += x[c] * gate_inp[c];
  const float logit = block_sum(s, scratch);  // its barriers also publish order[]
  const float g = 1.f / (1.f + expf(-logit));
  const float* shared = reinterpret_cast<const float*>(p.shared) + t * d;
#else
  __syncthreads();
#endif
  const float* w = reinterpret_cast<const float*>(p.weights) + t * K;
  const float* y = reinterpret_cast<const float*>(p.y) + t * K * d;
  float* out = reinterpret_cast<float*>(p.out) + t * d;
  for (u32 c = threadIdx.x; c < d; c += blockDim.x) {
    float acc = 0.f;
    for (u32 r = 0; r < K; ++r) {
      const u32 j = order[r];
      acc = __fadd_rn(acc, __fmul_rn(w[j], y[(i64)j * d + c]));
    }
#if SHARED
    acc = __fadd_rn(acc, __fmul_rn(g, shared[c]));
#endif
#if RESIDUAL
    acc = __fadd_rn(acc, reinterpret_cast<const float*>(p.residual)[t * d + c]);
#endif
    out[c] = acc;
  }
}
"#;

/// The routing kernel (no compile-time options).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct MoeRouteVariant;

impl MoeRouteVariant {
    /// Largest expert count: the block keeps two floats per expert in shared memory.
    pub const MAX_EXPERTS: usize = 4096;

    pub fn launch_config(&self, n_tokens: usize, n_experts: usize, top_k: usize) -> LaunchConfig {
        LaunchConfig { grid_dim: (n_tokens as u32, 1, 1), block_dim: (64, 1, 1), shared_mem_bytes: (4 * (2 * n_experts + 2 * top_k)) as u32 }
    }
}

impl KernelVariant for MoeRouteVariant {
    const FAMILY: &'static str = "moe_route";
    const SOURCES: &'static [&'static str] = &[HEADER, MoeRouteParams::C_DECL, ROUTE_SOURCE];
    const ENTRY_POINTS: &'static [&'static str] = &["moe_route"];

    fn macros(&self) -> Vec<(&'static str, String)> {
        Vec::new()
    }
}

/// The combine kernel: which optional terms it adds.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct MoeCombineVariant {
    pub shared: bool,
    pub residual: bool,
}

impl MoeCombineVariant {
    /// Threads per block: also the largest `top_k` (a thread ranks each slot).
    pub const BLOCK: usize = 256;

    pub fn launch_config(&self, n_tokens: usize, top_k: usize) -> LaunchConfig {
        LaunchConfig { grid_dim: (n_tokens as u32, 1, 1), block_dim: (Self::BLOCK as u32, 1, 1), shared_mem_bytes: (4 * top_k) as u32 }
    }
}

impl KernelVariant for MoeCombineVariant {
    const FAMILY: &'static str = "moe_combine";
    const SOURCES: &'static [&'static str] = &[HEADER, MoeCombineParams::C_DECL, COMBINE_SOURCE];
    const ENTRY_POINTS: &'static [&'static str] = &["moe_combine"];

    fn macros(&self) -> Vec<(&'static str, String)> {
        vec![("SHARED", u32::from(self.shared).to_string()), ("RESIDUAL", u32::from(self.residual).to_string())]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn macros_match_source() {
        crate::kernels::tests::assert_macros_match(MoeRouteVariant);
        crate::kernels::tests::assert_macros_match(MoeCombineVariant { shared: true, residual: false });
    }

    #[test]
    fn launch_geometry() {
        let cfg = MoeRouteVariant.launch_config(5, 256, 8);
        assert_eq!((cfg.grid_dim, cfg.block_dim, cfg.shared_mem_bytes), ((5, 1, 1), (64, 1, 1), 4 * 528));
        // The largest bank still fits the default 48 KiB of shared memory.
        assert!(MoeRouteVariant.launch_config(1, MoeRouteVariant::MAX_EXPERTS, 64).shared_mem_bytes <= 48 * 1024);
        let cfg = MoeCombineVariant { shared: false, residual: true }.launch_config(3, 10);
        assert_eq!((cfg.grid_dim, cfg.block_dim, cfg.shared_mem_bytes), ((3, 1, 1), (256, 1, 1), 40));
    }
}
