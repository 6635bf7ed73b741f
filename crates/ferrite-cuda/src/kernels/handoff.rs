//! Counter hand-offs between the kernels of a captured step (`FERRITE_CUDA_COUNTER_HANDOFF`).
//!
//! Why: a small model's decode step is ~150 dependent kernels, and each boundary costs ~1.2 us
//! with programmatic dependent launch (docs/perf.md, stops 17 and 33): `griddepcontrol.wait`
//! returns only once the whole previous grid has exited and its writes are flushed. Dependent
//! launch already schedules the next kernel's blocks while the previous one runs, so they can
//! instead watch a counter that every block of the previous kernel bumps (a fenced add after
//! a block barrier) once its last store is done: the wait becomes an L2 round trip.
//!
//! A kernel of a chained entry point ([`crate::kernels::KernelVariant::CHAINED`]) takes a
//! second parameter, [`HandoffArgs`], filled by `Gpu::launch` while a counter chain is open
//! (`Gpu::open_counter_chain`, around a graph capture); outside one it is all zeros and the
//! kernel waits with `griddepcontrol.wait` and bumps nothing. In a chain, launch `i` bumps
//! counter `i` (`i > 0`); launch `i + 1` polls it when launch `i` was the capture's last node
//! (so nothing else runs between them), else waits as usual. Launch 0 of the chain waits as
//! usual, zeroes the chain's other counters (nothing before it still runs, and launch 1 waits
//! for it to finish before anything reads one) and bumps none, so every counter starts from
//! zero at each replay.
//!
//! `handoff_probe` (`kernel_bench handoff`): a launch reads all of `x` (as a GEMV reads its
//! whole input row) and each block writes its share of `y`: the hand-off's cost on its own.

use super::common::HEADER;
use super::{blocks_for, device_params, KernelVariant};
use cudarc::driver::LaunchConfig;

device_params! {
    /// The chained kernel's place in a counter chain (all zero: no chain).
    pub struct HandoffArgs {
        /// The chain's counters (one u32 per launch), or 0.
        pub counters: u64,
        /// This launch's counter: bumped once per block at the end (0: none).
        pub index: u32,
        /// Blocks of the previous launch, whose counter (`index - 1`) to poll (0: wait with
        /// `griddepcontrol.wait`).
        pub wait_blocks: u32,
        /// Counters to zero after waiting (the chain's first launch: all of them but its own).
        pub zero_count: u32,
        /// Nanoseconds a poller sleeps between polls (0: none; fewer requests on the counter's
        /// L2 slice while the predecessor runs).
        pub poll_sleep_ns: u32,
    }
}

/// The device side of a hand-off, pasted after [`HEADER`] and [`HandoffArgs::C_DECL`] in the
/// sources of chained kernels. A chained kernel's body (`NAME_body(p, h)`) calls `handoff_wait`
/// where it would call `pdl_wait` (it also releases the next launch), and `CHAINED_KERNEL`
/// defines the entry point around it, which every thread leaves through `handoff_signal`: the
/// body's early returns must be block-uniform, or followed by no block barrier.
pub const HANDOFF: &str = r#"
// One lane of each group of converged lanes polls with an acquire load (the kernels call this
// from divergent code, so no block barrier; one request per group, not per lane, eases the load
// on the counter's L2 slice); the group's other lanes are ordered after it by the warp barrier. A
// counter that never arrives (a bug) traps after 2 s instead of hanging the device.
__device__ __forceinline__ void handoff_wait(const HandoffArgs& h) {
  if (h.wait_blocks == 0) {
    pdl_wait();
  } else {
    const unsigned group = __activemask();
    u32 lane;
    asm("mov.u32 %0, %%laneid;" : "=r"(lane));
    if (lane == (u32)(__ffs(group) - 1)) {
      const u32* c = reinterpret_cast<const u32*>(h.counters) + h.index - 1;
      u32 seen;
      asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(seen) : "l"(c) : "memory");
      if (seen < h.wait_blocks) {
        u64 t0, t;
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
        do {
          if (h.poll_sleep_ns != 0) __nanosleep(h.poll_sleep_ns);
          asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(seen) : "l"(c) : "memory");
          asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
          if (t - t0 > 2000000000ull) __trap();
        } while (seen < h.wait_blocks);
      }
    }
    __syncwarp(group);
#if TIMELINE
    timeline_mark();
#endif
  }
  pdl_release();
  if (h.zero_count != 0 && blockIdx.x == 0 && blockIdx.y == 0 && blockIdx.z == 0) {
    u32* c = reinterpret_cast<u32*>(h.counters);
    const u32 threads = blockDim.x * blockDim.y * blockDim.z;
    for (u32 i = 1 + threadIdx.x + blockDim.x * (threadIdx.y + blockDim.y * threadIdx.z); i < h.zero_count; i += threads) c[i] = 0;
  }
}
// After the block's last store: one add per block, behind a block barrier and a GPU-scope fence
// (as cooperative groups' grid barrier publishes a block's writes).
__device__ __forceinline__ void handoff_signal(const HandoffArgs& h) {
  if (h.index == 0) return;  // uniform: a kernel parameter
  __syncthreads();
  if (threadIdx.x == 0 && threadIdx.y == 0 && threadIdx.z == 0) {
    __threadfence();
    atomicAdd(reinterpret_cast<u32*>(h.counters) + h.index, 1u);
  }
}
#define CHAINED_KERNEL(BOUNDS, NAME, PARAMS)                                       \
  extern "C" __global__ void BOUNDS NAME(const PARAMS p, const HandoffArgs h) { \
    NAME##_body(p, h);                                                           \
    handoff_signal(h);                                                           \
  }
"#;

device_params! {
    pub struct HandoffProbeParams {
        pub x: u64,
        pub y: u64,
        pub n: u32,
        pub pad: u32,
    }
}

const PROBE_SOURCE: &str = r#"
__device__ __forceinline__ void handoff_probe_body(const HandoffProbeParams& p, const HandoffArgs& h) {
  __shared__ float scratch[32];
  handoff_wait(h);
  const float* x = reinterpret_cast<const float*>(p.x);
  float* y = reinterpret_cast<float*>(p.y);
  float s = 0.f;
  for (u32 i = threadIdx.x; i < p.n; i += blockDim.x) s += x[i];
  s = block_sum(s, scratch);
  const u32 per_block = (p.n + gridDim.x - 1) / gridDim.x;
  for (u32 i = blockIdx.x * per_block + threadIdx.x; i < min(p.n, (blockIdx.x + 1) * per_block); i += blockDim.x) {
    y[i] = 0.5f * x[i] + 1e-4f * s;
  }
}

CHAINED_KERNEL(, handoff_probe, HandoffProbeParams)
"#;

/// `handoff_probe` (no compile-time variants).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct HandoffProbeVariant;

impl HandoffProbeVariant {
    pub const THREADS: u32 = 256;

    pub fn launch_config(&self, blocks: usize) -> LaunchConfig {
        LaunchConfig { grid_dim: (blocks_for(blocks, 1), 1, 1), block_dim: (Self::THREADS, 1, 1), shared_mem_bytes: 0 }
    }
}

impl KernelVariant for HandoffProbeVariant {
    const FAMILY: &'static str = "handoff_probe";
    const SOURCES: &'static [&'static str] = &[HEADER, HandoffArgs::C_DECL, HANDOFF, HandoffProbeParams::C_DECL, PROBE_SOURCE];
    const ENTRY_POINTS: &'static [&'static str] = &["handoff_probe"];
    const CHAINED: &'static [&'static str] = &["handoff_probe"];

    fn macros(&self) -> Vec<(&'static str, String)> {
        Vec::new()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn macros_match_source() {
        crate::kernels::tests::assert_macros_match(HandoffProbeVariant);
    }
}
