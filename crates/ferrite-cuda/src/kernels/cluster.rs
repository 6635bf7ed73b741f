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

use super::common::HEADER;
use super::{device_params, KernelVariant};
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

const SOURCE: &str = r#"
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
__device__ __forceinline__ void cluster_sync() {
  asm volatile("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;" ::: "memory");
}
// Stores v at the address of `local` (this block's shared memory) in block `rank`'s.
__device__ __forceinline__ void store_remote(const float* local, u32 rank, float v) {
  u32 remote;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"((u32)__cvta_generic_to_shared(local)), "r"(rank));
  asm volatile("st.shared::cluster.f32 [%0], %1;" :: "r"(remote), "f"(v) : "memory");
}

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
    const SOURCES: &'static [&'static str] = &[HEADER, ClusterPhasesParams::C_DECL, SOURCE];
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
    }
}
