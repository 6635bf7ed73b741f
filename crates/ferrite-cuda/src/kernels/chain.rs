//! A chain of one-token int8 GEMVs in one persistent kernel (`gemv_chain`): a decode layer's
//! output projection, gate/up, down and the next layer's QKV run as phases of one launch, one
//! block per SM, with a grid-wide barrier between phases instead of a kernel boundary.
//!
//! Why: a decode step of a small or mid-size model is mostly fixed cost per kernel (launch,
//! ramp, the wait for the previous grid, the tail), not bytes (docs/perf.md). In this kernel
//! the weights never wait for activations: a producer warp per block streams the block's weight
//! chunks of every phase, in order, through a ring of shared-memory stages with bulk copies
//! (`cp.async.bulk`, completion counted on an mbarrier per stage). It starts before the
//! kernel's dependency wait and runs ahead across the phase barriers, as far as the ring
//! allows, so DRAM keeps streaming while the grid meets.
//!
//! Work split: phase rows come in groups of `NWARPS` (8) outputs; block b takes a contiguous
//! range of groups. A chunk is one group's weight rows (with `glu`, its 8 gate rows then its 8
//! up rows) over `kc` units of the row, every plane of the packed weight side by side in the
//! stage (`ChainPhase::stage_off`). Consumer warp w owns output row w of the group (and its up
//! row), its lanes walk the chunk's units, and the partial sums stay in registers across the
//! group's chunks; a warp reduction ends each output, which gets bias, residual or the gated
//! activation and is stored as f32.
//!
//! Activations: at the start of each phase every block reads the phase's f32 input (written by
//! the previous phase, or before the launch), applies the folded RMSNorm and quantizes it into
//! shared memory with `quantize_block_warp`: the numerics of `quantize_q8` + `gemv_q8`, with no
//! hand-off buffers. Inputs written inside the kernel are read with `ld.global.cg` (L2), never
//! from a possibly stale L1 line.
//!
//! The grid barrier needs every block resident at once: the grid is one block per SM and the
//! stages take most of the SM's shared memory. Blocks of the next kernel are let in early (PDL)
//! only after every block of this one has started, so they cannot crowd it out.

use super::common::{HEADER, QUANT};
use super::quantize::Q8_BLOCK;
use super::KernelVariant;
use cudarc::driver::LaunchConfig;
use ferrite_gguf::GgmlType;

/// Most phases one launch runs (a decoder layer's four linears).
pub const MAX_PHASES: usize = 4;
/// Output rows per group: one per consumer warp.
pub const GROUP_ROWS: usize = 8;

super::device_params! {
    /// One phase: `out[r] = act(W[r] . q8(norm(x))) + bias[r] + residual[r]` for `rows` outputs.
    pub struct ChainPhase {
        pub w0: u64,
        pub w1: u64,
        pub w2: u64,
        pub w3: u64,
        pub x: u64,
        /// RMSNorm weight folded into the input (0: none).
        pub norm: u64,
        pub out: u64,
        /// 0: none. Read by the thread that writes the same row only, so it may be `out`.
        pub residual: u64,
        pub bias: u64,
        pub rows: u32,
        pub cols: u32,
        /// 0 none, 1 SwiGLU, 2 GeGLU over `[gate; up]` weight rows (`rows` outputs each).
        pub glu: u32,
        pub eps: f32,
        pub norm_add_one: u32,
        /// Chunks per group and 32-weight units per chunk (`k_chunks * kc_units` = `cols / 32`).
        pub k_chunks: u32,
        pub kc_units: u32,
        /// 1: a chunk is whole rows, one copy per plane and weight-row block; 0: one per row.
        pub whole_rows: u32,
        /// Bytes of one GGML block in each plane (0: unused plane).
        pub field0: u32,
        pub field1: u32,
        pub field2: u32,
        pub field3: u32,
        /// Where each plane's part of a chunk starts in a stage.
        pub stage_off0: u32,
        pub stage_off1: u32,
        pub stage_off2: u32,
        pub stage_off3: u32,
        /// Bytes of one chunk (all planes).
        pub chunk_bytes: u32,
    }
}

/// Kernel parameters: up to [`MAX_PHASES`] phases by value (no upload, so a captured graph
/// holds everything), the barrier words and the widest input.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct ChainParams {
    pub phases: [ChainPhase; MAX_PHASES],
    /// `u64`: the grid barrier's arrivals over all launches (see `grid_barrier`), zero at first.
    pub barrier: u64,
    pub n_phases: u32,
    /// Widest phase input: sizes the activation area of shared memory.
    pub max_cols: u32,
}

// SAFETY: a repr(C) struct of plain scalars and repr(C) scalar structs, mirrored by C_DECL.
unsafe impl cudarc::driver::DeviceRepr for ChainParams {}

impl ChainParams {
    pub const C_DECL: &'static str =
        "struct ChainParams {\n  ChainPhase phases[4];\n  unsigned long long barrier;\n  unsigned int n_phases;\n  unsigned int max_cols;\n};\n";
}

const SOURCE: &str = r#"
#ifndef NWARPS
#error "NWARPS (consumer warps per block = output rows per group; one more warp issues the weight copies) must come from the kernel variant"
#endif
#ifndef STAGES
#error "STAGES (weight chunks in flight per block) must come from the kernel variant"
#endif
#ifndef STAGE_BYTES
#error "STAGE_BYTES (bytes of one shared-memory stage) must come from the kernel variant"
#endif
#define CONSUMERS (NWARPS * 32)
#define MAX_PHASES 4  // = chain::MAX_PHASES

__device__ __forceinline__ u32 smem_u32(const void* p) { return (u32)__cvta_generic_to_shared(p); }
__device__ __forceinline__ void mbar_init(u64* bar, u32 count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_u32(bar)), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_expect_tx(u64* bar, u32 bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_u32(bar)), "r"(bytes) : "memory");
}
__device__ __forceinline__ void mbar_arrive(u64* bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(smem_u32(bar)) : "memory");
}
__device__ __forceinline__ void mbar_wait(u64* bar, u32 parity) {
  u32 done = 0;
  while (!done)
    asm volatile("{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n selp.u32 %0, 1, 0, p;\n}"
                 : "=r"(done) : "r"(smem_u32(bar)), "r"(parity) : "memory");
}
// Bulk copy global -> this block's shared memory; completion counted on `bar` in bytes.
__device__ __forceinline__ void bulk_copy(u8* dst, const u8* src, u32 bytes, u64* bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
               ::"r"(smem_u32(dst)), "l"(src), "r"(bytes), "r"(smem_u32(bar)) : "memory");
}
// Barrier over the consumer warps only (the producer warp runs on its own).
__device__ __forceinline__ void consumers_sync() { asm volatile("bar.sync 1, %0;" ::"r"(CONSUMERS) : "memory"); }

__device__ __forceinline__ float consumers_sum(float v, float* scratch) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  v = warp_sum(v);
  consumers_sync();  // an earlier call may still be reading scratch
  if (lane == 0) scratch[warp] = v;
  consumers_sync();
  return warp_sum(lane < NWARPS ? scratch[lane] : 0.f);
}

// Grid barrier k of a launch (k = 1, 2, ...): every block adds one to a 64-bit counter that
// only grows, and waits until it reaches `base + k * gridDim.x`, `base` being its value when the
// launch began (see the kernel). One release-add and acquire polls: no reset, no read before
// arriving, so a barrier costs about one L2 round trip after the last arrival.
__device__ __forceinline__ u64 ld_acquire(const u64* p) {
  u64 v;
  asm volatile("ld.acquire.gpu.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}
__device__ void grid_barrier(u64* counter, u64 target) {
  consumers_sync();
  if (threadIdx.x == 0) {
    asm volatile("red.release.gpu.global.add.u64 [%0], 1;" ::"l"(counter) : "memory");
    while (ld_acquire(counter) < target) {
    }
  }
  consumers_sync();
}

// Block b's groups of a phase: a contiguous, balanced range.
__device__ __forceinline__ void group_range(const ChainPhase& f, u32& g0, u32& g1) {
  const u32 groups = f.rows / NWARPS;
  g0 = (u32)(((u64)groups * blockIdx.x) / gridDim.x);
  g1 = (u32)(((u64)groups * (blockIdx.x + 1)) / gridDim.x);
}

__device__ __forceinline__ u64 plane_ptr(const ChainPhase& f, int k) { return k == 0 ? f.w0 : k == 1 ? f.w1 : k == 2 ? f.w2 : f.w3; }
__device__ __forceinline__ u32 field_of(const ChainPhase& f, int k) { return k == 0 ? f.field0 : k == 1 ? f.field1 : k == 2 ? f.field2 : f.field3; }
__device__ __forceinline__ u32 stage_off(const ChainPhase& f, int k) { return k == 0 ? f.stage_off0 : k == 1 ? f.stage_off1 : k == 2 ? f.stage_off2 : f.stage_off3; }

// Copy chunk (group g, k-chunk kc) of a phase into a stage: weight-row blocks of NWARPS rows
// (the gate rows, then with GLU the up rows), each plane's part contiguous in the stage.
__device__ void copy_chunk(const ChainPhase& f, u32 g, u32 kc, u8* stage, u64* bar) {
  const u32 row_blocks = f.cols / QK, chunk_blocks = f.kc_units / UNITS_PER_BLOCK;
  const int segments = f.glu ? 2 : 1;
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    const u32 field = field_of(f, k);
    if (field == 0) continue;
    const u8* plane = reinterpret_cast<const u8*>(plane_ptr(f, k));
    u8* dst = stage + stage_off(f, k);
    for (int s = 0; s < segments; ++s) {
      const u64 row0 = (u64)s * f.rows + (u64)g * NWARPS;
      if (f.whole_rows) {
        const u32 bytes = NWARPS * row_blocks * field;
        bulk_copy(dst + s * bytes, plane + row0 * row_blocks * field, bytes, bar);
      } else {
        const u32 bytes = chunk_blocks * field;
        for (int r = 0; r < NWARPS; ++r)
          bulk_copy(dst + (s * NWARPS + r) * bytes, plane + ((row0 + r) * row_blocks + (u64)kc * chunk_blocks) * field, bytes, bar);
      }
    }
  }
}

// The producer's share of one phase: its chunks in the consumers' order (`i` counts chunks).
__device__ __forceinline__ void produce_phase(const ChainPhase& f, u32& i, u8* stages, u64* full, u64* empty) {
  u32 g0, g1;
  group_range(f, g0, g1);
  for (u32 g = g0; g < g1; ++g)
    for (u32 kc = 0; kc < f.k_chunks; ++kc, ++i) {
      const u32 s = i % STAGES, round = i / STAGES;
      if (round > 0) mbar_wait(&empty[s], (round - 1) & 1);
      mbar_expect_tx(&full[s], f.chunk_bytes);
      copy_chunk(f, g, kc, stages + (u64)s * STAGE_BYTES, &full[s]);
    }
}

// The phase's input, RMS-normalised if it folds a norm, quantized into shared memory. Written
// by another SM in this launch, so it is read from L2 (`ld.global.cg`), and every load is
// issued before any is used: one L2 round trip, not one per 32-value block. The f32 values
// (times the norm weight) wait in `staged`; `1 / rms` is applied as they are quantized.
#define STAGE_BATCH 8
__device__ void quantize_input(const ChainPhase& f, float* staged, i8* act_q, uint2* act_s, float* scratch) {
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const float4* x = reinterpret_cast<const float4*>(f.x);
  const float4* g = reinterpret_cast<const float4*>(f.norm);
  float4* dst = reinterpret_cast<float4*>(staged);
  const u32 n4 = f.cols / 4;
  float ss = 0.f;
  for (u32 i0 = threadIdx.x; i0 < n4; i0 += STAGE_BATCH * CONSUMERS) {
    float4 v[STAGE_BATCH], w[STAGE_BATCH];
#pragma unroll
    for (int j = 0; j < STAGE_BATCH; ++j) {
      const u32 i = i0 + j * CONSUMERS;
      v[j] = i < n4 ? __ldcg(x + i) : make_float4(0.f, 0.f, 0.f, 0.f);
      w[j] = g && i < n4 ? __ldg(g + i) : make_float4(1.f, 1.f, 1.f, 1.f);
    }
#pragma unroll
    for (int j = 0; j < STAGE_BATCH; ++j) {
      const u32 i = i0 + j * CONSUMERS;
      ss += v[j].x * v[j].x + v[j].y * v[j].y + v[j].z * v[j].z + v[j].w * v[j].w;
      if (f.norm_add_one) w[j] = make_float4(1.f + w[j].x, 1.f + w[j].y, 1.f + w[j].z, 1.f + w[j].w);
      if (i < n4) dst[i] = make_float4(v[j].x * w[j].x, v[j].y * w[j].y, v[j].z * w[j].z, v[j].w * w[j].w);
    }
  }
  float inv = 1.f;
  if (g) inv = 1.f / sqrtf(consumers_sum(ss, scratch) / (float)f.cols + f.eps);
  else consumers_sync();
  for (u32 b = warp; b < f.cols / 32; b += NWARPS) quantize_block_warp(staged[32 * b + lane] * inv, lane, act_q + 32 * b, act_s + b);
  consumers_sync();
}

// The consumers' share of one phase (after the barrier or wait that makes its input ready).
// The epilogue's inputs of output row `row`, (bias, residual), 0 where none: requested early.
__device__ __forceinline__ float2 epilogue_inputs(const ChainPhase& f, u32 row) {
  return make_float2(f.bias ? __ldg(reinterpret_cast<const float*>(f.bias) + row) : 0.f,
                     f.residual ? __ldcg(reinterpret_cast<const float*>(f.residual) + row) : 0.f);
}

__device__ __forceinline__ void consume_phase(const ChainPhase& f, u32& i, const u8* stages, u64* full, u64* empty, float* staged, i8* act_q, uint2* act_s, float* scratch) {
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  u32 g0, g1;
  group_range(f, g0, g1);
  // The first group's bias and residual travel with the input's loads; each later group's
  // with the previous group's math.
  float2 add_next = g0 < g1 ? epilogue_inputs(f, g0 * NWARPS + warp) : make_float2(0.f, 0.f);
  quantize_input(f, staged, act_q, act_s, scratch);
  const int4* xq = reinterpret_cast<const int4*>(act_q);
  for (u32 g = g0; g < g1; ++g) {
    const float2 add = add_next;
    if (g + 1 < g1) add_next = epilogue_inputs(f, (g + 1) * NWARPS + warp);
    float acc = 0.f, acc_up = 0.f;
    for (u32 kc = 0; kc < f.k_chunks; ++kc, ++i) {
      const u32 s = i % STAGES;
      mbar_wait(&full[s], (i / STAGES) & 1);
      const u8* stage = stages + (u64)s * STAGE_BYTES;
      const WeightRef w = {stage + f.stage_off0, stage + f.stage_off1, stage + f.stage_off2, stage + f.stage_off3, (i64)f.kc_units * 32};
      for (u32 u = lane; u < f.kc_units; u += 32) {
        const u32 au = kc * f.kc_units + u;
        const uint2 sc = act_s[au];
        const float dx = __uint_as_float(sc.x);
        const float sq0 = (float)(int)(short)(sc.y & 0xffffu), sq1 = (float)((int)sc.y >> 16);
        const int4 xa = xq[2 * au], xb = xq[2 * au + 1];
        Unit wu;
        load_unit(w, warp, (int)u, wu);
        acc += unit_dot_q8(wu, xa, xb, dx, sq0, sq1);
        if (f.glu) {
          load_unit(w, NWARPS + warp, (int)u, wu);
          acc_up += unit_dot_q8(wu, xa, xb, dx, sq0, sq1);
        }
      }
      __syncwarp();
      if (lane == 0) mbar_arrive(&empty[s]);
    }
    acc = warp_sum(acc);
    acc_up = warp_sum(acc_up);
    if (lane == 0) {
      const u32 row = g * NWARPS + warp;
      const float v = f.glu == 1 ? silu(acc) * acc_up : f.glu == 2 ? gelu_tanh(acc) * acc_up : acc;
      // Bias, then residual, as the separate GEMV adds them (adding 0 where none is exact).
      reinterpret_cast<float*>(f.out)[row] = (v + add.x) + add.y;
    }
  }
}

// Phase loops are unrolled so that every phase is read from the parameter space at a constant
// offset (a dynamic index would copy the parameters to local memory).
extern "C" __global__ void __launch_bounds__(CONSUMERS + 32, 1) gemv_chain(const ChainParams p) {
  extern __shared__ __align__(128) u8 smem[];
  u8* stages = smem;
  float* staged = reinterpret_cast<float*>(smem + (u64)STAGES * STAGE_BYTES);
  uint2* act_s = reinterpret_cast<uint2*>(staged + p.max_cols);
  i8* act_q = reinterpret_cast<i8*>(act_s + p.max_cols / 32);
  u64* full = reinterpret_cast<u64*>(act_q + p.max_cols);
  u64* empty = full + STAGES;
  float* scratch = reinterpret_cast<float*>(empty + STAGES);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  if (threadIdx.x == 0) {
    for (int s = 0; s < STAGES; ++s) {
      mbar_init(&full[s], 1);
      mbar_init(&empty[s], NWARPS);
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();
  u32 i = 0;  // chunk counter: the producer and the consumers walk the same sequence
  if (warp == NWARPS) {
    // Weights only, which nothing writes: no wait before streaming them.
    if (lane == 0) {
#pragma unroll
      for (int ph = 0; ph < MAX_PHASES; ++ph)
        if (ph < (int)p.n_phases) produce_phase(p.phases[ph], i, stages, full, empty);
    }
    return;
  }
  u64* counter = reinterpret_cast<u64*>(p.barrier);
  u64 base = 0;
#pragma unroll
  for (int ph = 0; ph < MAX_PHASES; ++ph) {
    if (ph >= (int)p.n_phases) break;
    if (ph == 0) {
      pdl_wait();
      pdl_release();
      // After the wait every earlier launch's arrivals are in, so the counter is a multiple of
      // the grid; blocks of this launch that already arrived at barrier 1 are fewer than the grid.
      if (threadIdx.x == 0) base = ld_acquire(counter) / gridDim.x * gridDim.x;
    } else {
      grid_barrier(counter, base + (u64)ph * gridDim.x);
    }
    consume_phase(p.phases[ph], i, stages, full, empty, staged, act_q, act_s, scratch);
  }
}
"#;

/// The compile-time variant: the weight type (all phases share it) and the ring's shape.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct ChainVariant {
    pub wtype: GgmlType,
    pub stages: u32,
    pub stage_bytes: u32,
}

impl ChainVariant {
    /// Consumer warps (output rows per group); one more warp produces.
    pub const NWARPS: u32 = GROUP_ROWS as u32;
    /// Most dynamic shared memory a block may opt into on sm_90 (227 KiB).
    pub const MAX_SHARED_BYTES: usize = 227 * 1024;
    const STAGE_BYTES: u32 = 32 * 1024;
    const MAX_STAGES: u32 = 5;

    /// The ring for inputs of up to `max_cols` columns: up to 5 stages of 32 KiB, as many as
    /// fit beside the input's f32 and int8 copies; `None` below 2 stages.
    pub fn new(wtype: GgmlType, max_cols: usize) -> Option<Self> {
        let v = ChainVariant { wtype, stages: 0, stage_bytes: Self::STAGE_BYTES };
        let free = Self::MAX_SHARED_BYTES.checked_sub(v.shared_bytes(max_cols))?;
        let stages = (free / Self::STAGE_BYTES as usize).min(Self::MAX_STAGES as usize) as u32;
        (stages >= 2).then_some(ChainVariant { stages, ..v })
    }

    /// Dynamic shared memory: the stages, the widest input as f32 and quantized, the stages'
    /// barriers and the reduction scratch.
    pub fn shared_bytes(&self, max_cols: usize) -> usize {
        self.stages as usize * self.stage_bytes as usize + max_cols * 4 + max_cols / 32 * 8 + max_cols + 16 * self.stages as usize + 128
    }

    pub fn launch_config(&self, sm_count: u32, max_cols: usize) -> LaunchConfig {
        LaunchConfig {
            grid_dim: (sm_count, 1, 1),
            block_dim: ((Self::NWARPS + 1) * 32, 1, 1),
            shared_mem_bytes: self.shared_bytes(max_cols) as u32,
        }
    }
}

impl KernelVariant for ChainVariant {
    const FAMILY: &'static str = "gemv_chain";
    const SOURCES: &'static [&'static str] = &[HEADER, QUANT, Q8_BLOCK, ChainPhase::C_DECL, ChainParams::C_DECL, SOURCE];
    const ENTRY_POINTS: &'static [&'static str] = &["gemv_chain"];

    fn macros(&self) -> Vec<(&'static str, String)> {
        vec![
            ("WTYPE", (self.wtype as u32).to_string()),
            ("NWARPS", Self::NWARPS.to_string()),
            ("STAGES", self.stages.to_string()),
            ("STAGE_BYTES", self.stage_bytes.to_string()),
        ]
    }
}

/// How one phase's weight streams through the stages.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PhaseTiling {
    pub k_chunks: u32,
    pub kc_units: u32,
    pub whole_rows: bool,
    pub stage_off: [u32; 4],
    pub chunk_bytes: u32,
}

/// The tiling of a `rows x cols` weight of type `wtype` (`weight_rows` = `rows`, or `2 * rows`
/// for a gated `[gate; up]` weight) in stages of `stage_bytes`: the fewest chunks per group whose
/// bulk copies are 16-byte aligned and sized and fit a stage. `None` when no split does (the op
/// layer then runs the linears one by one).
pub fn phase_tiling(wtype: GgmlType, out_rows: usize, cols: usize, gated: bool, stage_bytes: usize) -> Option<PhaseTiling> {
    let fields = crate::weight::planes(wtype)?;
    let qk = wtype.block_size();
    if out_rows == 0 || !out_rows.is_multiple_of(GROUP_ROWS) || cols == 0 || !cols.is_multiple_of(qk) {
        return None;
    }
    let weight_rows = GROUP_ROWS * if gated { 2 } else { 1 };
    let row_blocks = cols / qk;
    (1..=row_blocks).filter(|d| row_blocks.is_multiple_of(*d)).find_map(|k_chunks| {
        let chunk_blocks = row_blocks / k_chunks;
        let whole = k_chunks == 1;
        let aligned = fields.iter().all(|f| {
            let (field, row) = (f.size, row_blocks * f.size);
            if whole {
                (GROUP_ROWS * row).is_multiple_of(16)
            } else {
                row.is_multiple_of(16) && (chunk_blocks * field).is_multiple_of(16)
            }
        });
        let mut stage_off = [0u32; 4];
        let mut at = 0usize;
        for (k, f) in fields.iter().enumerate() {
            stage_off[k] = at as u32;
            at += weight_rows * chunk_blocks * f.size;
        }
        (aligned && at <= stage_bytes).then_some(PhaseTiling {
            k_chunks: k_chunks as u32,
            kc_units: (chunk_blocks * qk / 32) as u32,
            whole_rows: whole,
            stage_off,
            chunk_bytes: at as u32,
        })
    })
}

/// Bytes of one GGML block in each plane of `wtype` (0 past the last plane).
pub fn plane_fields(wtype: GgmlType) -> [u32; 4] {
    let mut out = [0u32; 4];
    for (k, f) in crate::weight::planes(wtype).unwrap_or(&[]).iter().enumerate() {
        out[k] = f.size as u32;
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn macros_match_source() {
        crate::kernels::tests::assert_macros_match(ChainVariant::new(GgmlType::Q4_0, 4096).unwrap());
    }

    #[test]
    fn the_ring_shrinks_for_wide_inputs() {
        assert_eq!(ChainVariant::new(GgmlType::Q4_0, 4096).unwrap().stages, 5);
        let wide = ChainVariant::new(GgmlType::Q4_0, 14336).unwrap();
        assert_eq!(wide.stages, 4);
        assert!(wide.shared_bytes(14336) <= ChainVariant::MAX_SHARED_BYTES);
        assert!(ChainVariant::new(GgmlType::Q4_0, 40960).is_none());
    }

    #[test]
    fn params_fit_the_parameter_space() {
        // 4 KiB is the classic kernel-parameter limit.
        assert!(std::mem::size_of::<ChainParams>() <= 4096);
        assert_eq!(std::mem::size_of::<ChainPhase>() % 8, 0);
        assert!(ChainParams::C_DECL.contains(&format!("phases[{MAX_PHASES}]")) && SOURCE.contains(&format!("#define MAX_PHASES {MAX_PHASES} ")));
    }

    #[test]
    fn tilings_split_long_rows_and_keep_copies_aligned() {
        let stage = 32 * 1024;
        // SmolLM2: 18 units per row, whole rows (a row's d plane is 36 bytes: only 8 rows align).
        let t = phase_tiling(GgmlType::Q4_1, 576, 576, false, stage).unwrap();
        assert_eq!((t.k_chunks, t.kc_units, t.whole_rows), (1, 18, true));
        assert_eq!(t.chunk_bytes, 8 * 18 * 20);
        // 8B down: 448 units per row of 18 bytes, 8 rows: 64.5 KB -> split in whole 16-byte copies.
        let t = phase_tiling(GgmlType::Q4_0, 4096, 14336, false, stage).unwrap();
        assert!(t.k_chunks > 1 && t.chunk_bytes as usize <= stage && t.kc_units * t.k_chunks == 448);
        assert_eq!(t.chunk_bytes, 8 * t.kc_units * 18);
        // 8B gate/up: 16 weight rows per group.
        let t = phase_tiling(GgmlType::Q4_0, 14336, 4096, true, stage).unwrap();
        assert_eq!(t.chunk_bytes, 16 * t.kc_units * 18);
        assert_eq!(t.stage_off[1], 16 * t.kc_units * 16);
        // Q6_K: 2-byte d per 256 weights, so chunks take 8 blocks at least.
        let t = phase_tiling(GgmlType::Q6_K, 4096, 4096, false, stage).unwrap();
        assert!(t.kc_units.is_multiple_of(64) || t.whole_rows);
        // Rows not in whole groups, or float weights: no tiling.
        assert!(phase_tiling(GgmlType::Q4_0, 100, 4096, false, stage).is_none());
        assert!(phase_tiling(GgmlType::F16, 4096, 4096, false, stage).is_none());
    }
}
