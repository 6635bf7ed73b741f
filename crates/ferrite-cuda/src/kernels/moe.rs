//! Mixture-of-experts FFN (Qwen3.5-MoE): the routing of each token, the grouping of a batch's
//! (token, slot) pairs by expert, and the weighted combination of the experts' outputs. The
//! experts themselves run on the GEMVs with `EXPERTS` ([`super::gemv`]), which read the expert
//! ids (or the grouping) these kernels leave in device memory, so a whole MoE layer runs
//! without the host (and inside the captured decode graph).
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
//! ## `moe_group` (one 1024-thread block per batch)
//!
//! For the grouped expert GEMV (`EXPERTS == 2`): the batch's pairs (pair `i = token * top_k +
//! slot`) listed expert by expert, ascending pair index inside an expert (so results do not
//! depend on scheduling), in `perm`, and a tile list for the GEMV's grid y: tile `y` is
//! `(expert | pairs << 16, first place in perm)` for up to `tile` pairs of one expert, and
//! `(0, 0)` (no pairs: the blocks exit) past the batch's tiles, up to `max_tiles`
//! ([`group_max_tiles`]: the grid is sized on the host, which never sees the routing). Ids out
//! of range go to a last bucket `n_experts` (reported in the error flag; the GEMV poisons their
//! rows with NaN, as the per-pair GEMV does). Steps, in shared memory: the count of each bucket
//! (atomic adds: a count does not depend on their order); one block scan of (count, tiles) per
//! bucket into the buckets' first places and first tiles; the tile list; each pair scattered to
//! a free place of its bucket (atomic cursors, any order); then each pair's final place is its
//! bucket's first place plus the number of the bucket's pairs below it, which restores
//! ascending order (a bucket of `c` pairs costs `c` reads per pair: a few on average, at most
//! the batch's tokens, since a token routes to distinct experts).
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

device_params! {
    pub struct MoeGroupParams {
        /// Expert ids of the pairs `[pairs]` (u32, from `moe_route`).
        pub ids: u64,
        /// Outputs: the pairs grouped by expert `[pairs]` (u32) and the tile list
        /// `[max_tiles]` (uint2).
        pub perm: u64,
        pub tiles: u64,
        /// `[pairs]` u32 of working memory: the pairs scattered to their buckets, unordered.
        pub scatter: u64,
        pub error_flag: u64,
        pub pairs: u32,
        pub n_experts: u32,
        /// Pairs per tile: the grouped GEMV's `NTOK`.
        pub tile: u32,
        pub max_tiles: u32,
    }
}

const GROUP_SOURCE: &str = r#"
// (count, tiles) of a bucket of c pairs, packed so one scan sums both.
__device__ __forceinline__ u64 bucket_sums(u32 c, u32 tile) { return (u64)c | ((u64)((c + tile - 1) / tile) << 32); }

// Dynamic shared memory: two arrays of n_experts + 2 u32.
extern "C" __global__ void __launch_bounds__(1024) moe_group(const MoeGroupParams p) {
  KERNEL_ENTRY();
  extern __shared__ u32 group_smem[];
  __shared__ u64 warp_sums[32];
  const u32 E = p.n_experts, B = E + 1;  // buckets: the experts, then the ids out of range
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, nthreads = blockDim.x;
  const u32* ids = reinterpret_cast<const u32*>(p.ids);
  u32* first = group_smem;           // bucket counts, then their first places (B + 1: the total last)
  u32* aux = group_smem + B + 1;     // the buckets' first tiles, then the scatter cursors

  for (u32 b = tid; b <= B; b += nthreads) first[b] = 0;
  __syncthreads();
  for (u32 i = tid; i < p.pairs; i += nthreads) {
    const u32 e = ids[i];
    if (e >= E) report_error(p.error_flag, ERR_EXPERT_ID, e);
    atomicAdd(&first[min(e, E)], 1u);
  }
  __syncthreads();

  // Exclusive scan of (count, tiles) over the buckets: thread t sums a run of `per` buckets,
  // the runs are scanned across the block, then each thread writes its run's prefixes.
  const u32 per = (B + nthreads - 1) / nthreads;
  const u32 b0 = min(tid * per, B), b1 = min(b0 + per, B);
  u64 run = 0;
  for (u32 b = b0; b < b1; ++b) run += bucket_sums(first[b], p.tile);
  u64 incl = run;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const u64 v = __shfl_up_sync(FULL_MASK, incl, o);
    if (lane >= o) incl += v;
  }
  if (lane == 31) warp_sums[warp] = incl;
  __syncthreads();
  if (warp == 0) {
    const u64 own = lane < (nthreads >> 5) ? warp_sums[lane] : 0;
    u64 w = own;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const u64 v = __shfl_up_sync(FULL_MASK, w, o);
      if (lane >= o) w += v;
    }
    warp_sums[lane] = w - own;
  }
  __syncthreads();
  u64 prefix = warp_sums[warp] + incl - run;
  for (u32 b = b0; b < b1; ++b) {
    const u32 c = first[b];
    first[b] = (u32)prefix;
    aux[b] = (u32)(prefix >> 32);
    prefix += bucket_sums(c, p.tile);
  }
  if (b0 < b1 && b1 == B) {
    first[B] = (u32)prefix;
    aux[B] = (u32)(prefix >> 32);
  }
  __syncthreads();

  // The tile list, then empty tiles up to the grid's worst case.
  uint2* tiles = reinterpret_cast<uint2*>(p.tiles);
  for (u32 b = tid; b < B; b += nthreads) {
    const u32 f = first[b], c = first[b + 1] - f;
    for (u32 j = 0; j * p.tile < c; ++j) tiles[aux[b] + j] = make_uint2(b | (min(p.tile, c - j * p.tile) << 16), f + j * p.tile);
  }
  for (u32 t = aux[B] + tid; t < p.max_tiles; t += nthreads) tiles[t] = make_uint2(0u, 0u);
  __syncthreads();

  // Every pair to a free place of its bucket, in whatever order the atomics give ...
  for (u32 b = tid; b < B; b += nthreads) aux[b] = first[b];
  __syncthreads();
  u32* scatter = reinterpret_cast<u32*>(p.scatter);
  for (u32 i = tid; i < p.pairs; i += nthreads) scatter[atomicAdd(&aux[min(ids[i], E)], 1u)] = i;
  __syncthreads();  // also makes the block's global writes visible to the block
  // ... then to its place in ascending order: the bucket's pairs below it come first.
  u32* perm = reinterpret_cast<u32*>(p.perm);
  for (u32 q = tid; q < p.pairs; q += nthreads) {
    const u32 i = scatter[q], b = min(ids[i], E), f = first[b], end = first[b + 1];
    u32 rank = 0;
    for (u32 j = f; j < end; ++j) rank += scatter[j] < i;
    perm[f + rank] = i;
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

/// Pairs per tile of the grouped expert GEMV (its `NTOK`): each weight unit it loads serves up
/// to this many pairs of one expert. 8 is the GEMV's largest token tile (its accumulators
/// take `rows x tile` registers).
pub const GROUP_TILE: usize = 8;

/// Most tiles [`MoeGroupVariant`] can list for `pairs` pairs of `n_experts` experts, the grid
/// the grouped GEMV is launched with: each bucket (the experts and the ids out of range) that
/// has pairs adds at most one partial tile to `pairs / GROUP_TILE` full ones.
pub fn group_max_tiles(pairs: usize, n_experts: usize) -> usize {
    (pairs + pairs.min(n_experts + 1) * (GROUP_TILE - 1)) / GROUP_TILE
}

/// The grouping kernel (no compile-time options).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct MoeGroupVariant;

impl MoeGroupVariant {
    pub const BLOCK: u32 = 1024;

    pub fn launch_config(&self, n_experts: usize) -> LaunchConfig {
        LaunchConfig { grid_dim: (1, 1, 1), block_dim: (Self::BLOCK, 1, 1), shared_mem_bytes: (4 * 2 * (n_experts + 2)) as u32 }
    }
}

impl KernelVariant for MoeGroupVariant {
    const FAMILY: &'static str = "moe_group";
    const SOURCES: &'static [&'static str] = &[HEADER, MoeGroupParams::C_DECL, GROUP_SOURCE];
    const ENTRY_POINTS: &'static [&'static str] = &["moe_group"];

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
        crate::kernels::tests::assert_macros_match(MoeGroupVariant);
        crate::kernels::tests::assert_macros_match(MoeCombineVariant { shared: true, residual: false });
    }

    #[test]
    fn launch_geometry() {
        let cfg = MoeRouteVariant.launch_config(5, 256, 8);
        assert_eq!((cfg.grid_dim, cfg.block_dim, cfg.shared_mem_bytes), ((5, 1, 1), (64, 1, 1), 4 * 528));
        // The largest bank still fits the default 48 KiB of shared memory.
        assert!(MoeRouteVariant.launch_config(1, MoeRouteVariant::MAX_EXPERTS, 64).shared_mem_bytes <= 48 * 1024);
        // The grouping keeps two u32 per bucket: the largest bank fits 48 KiB too.
        assert!(MoeGroupVariant.launch_config(MoeRouteVariant::MAX_EXPERTS).shared_mem_bytes <= 48 * 1024);
        let cfg = MoeCombineVariant { shared: false, residual: true }.launch_config(3, 10);
        assert_eq!((cfg.grid_dim, cfg.block_dim, cfg.shared_mem_bytes), ((3, 1, 1), (256, 1, 1), 40));
    }

    #[test]
    fn group_tiles_cover_the_worst_case() {
        // 256 tokens, top 8 of 256: 2048 pairs fill 256 tiles, and each of the 257 buckets may
        // add a partial one (but no more buckets than pairs have pairs).
        assert_eq!(group_max_tiles(2048, 256), (2048 + 257 * 7) / 8);
        assert_eq!(group_max_tiles(1, 256), 1);
        assert_eq!(group_max_tiles(3, 2), 3);
        // Every split of the pairs over the buckets fits: brute force on small cases.
        for e in 1..=3usize {
            for pairs in 0..=17usize {
                let mut worst = 0;
                // Counts per bucket (e experts + the out-of-range bucket) summing to `pairs`.
                let buckets = e + 1;
                let mut counts = vec![0usize; buckets];
                loop {
                    if counts.iter().sum::<usize>() == pairs {
                        worst = worst.max(counts.iter().map(|c| c.div_ceil(GROUP_TILE)).sum::<usize>());
                    }
                    // Next composition (odometer over 0..=pairs per bucket).
                    let mut i = 0;
                    while i < buckets && counts[i] == pairs {
                        counts[i] = 0;
                        i += 1;
                    }
                    if i == buckets {
                        break;
                    }
                    counts[i] += 1;
                }
                assert!(worst <= group_max_tiles(pairs, e), "{pairs} pairs of {e} experts: {worst} tiles");
            }
        }
    }
}
