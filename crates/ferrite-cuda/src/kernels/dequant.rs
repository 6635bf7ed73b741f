//! Dequantization to f32/f16/bf16 (the GEMM path's weight operand) and f32 -> f16/bf16
//! conversion of activations. [`ROW`] (decode one weight row) is shared with the embedding.

use super::common::{HEADER, QUANT};
use super::{blocks_for, device_params, KernelVariant};
use cudarc::driver::LaunchConfig;
use ferrite_gguf::GgmlType;

/// Element type written by the dequantize/convert kernels (`OUT_TYPE`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum OutType {
    F32 = 0,
    F16 = 1,
    BF16 = 2,
}

impl OutType {
    pub fn bytes(self) -> usize {
        match self {
            OutType::F32 => 4,
            OutType::F16 | OutType::BF16 => 2,
        }
    }
}

/// The column order of a GEMM input row as `convert_f32` and `rms_norm` write it (`order`): as
/// is, or the order `gemm_mma` pairs its decoded weights in, per MMA instruction.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum MmaOrder {
    Natural,
    /// `mma.sync`: the middle two of every four values swapped (rows of whole fours).
    Pairs,
    /// `wgmma`: each 128 values permuted into k-step order and tiled by blocks of
    /// `tile_tokens` rows as the kernel's shared-memory stage (rows of whole 128s; the buffer
    /// holds whole tiles).
    Wgmma { tile_tokens: usize },
}

impl MmaOrder {
    /// The kernels' `order` code.
    pub fn code(self) -> u32 {
        match self {
            MmaOrder::Natural => 0,
            MmaOrder::Pairs => 1,
            MmaOrder::Wgmma { .. } => 2,
        }
    }

    /// Rows per tile (1 unless tiled).
    pub fn tile_tokens(self) -> u32 {
        match self {
            MmaOrder::Wgmma { tile_tokens } => tile_tokens as u32,
            _ => 1,
        }
    }

    /// The row lengths the order is defined for.
    pub fn row_multiple(self) -> usize {
        match self {
            MmaOrder::Natural => 1,
            MmaOrder::Pairs => 4,
            MmaOrder::Wgmma { .. } => 128,
        }
    }

    /// Rows a buffer of `n` rows in this layout spans (whole tiles).
    pub fn padded_rows(self, n: usize) -> usize {
        n.next_multiple_of(self.tile_tokens() as usize)
    }
}

/// Device code: decode row `row` of a weight, calling `store(column, value)` for each value.
/// Threads `tid` of `nthreads` split the row (by element for float types, by unit otherwise).
pub const ROW: &str = r#"
template <typename Store>
__device__ __forceinline__ void dequant_row(const WeightRef& w, i64 row, int tid, int nthreads, Store store) {
#if IS_FLOAT
  for (i64 c = tid; c < w.cols; c += nthreads) store(c, load_float(w, row * w.cols + c));
#else
  const int units = (int)(w.cols / 32);
  for (int u = tid; u < units; u += nthreads) {
    Unit un;
    load_unit(w, row, u, un);
#pragma unroll
    for (int l = 0; l < 32; ++l) store((i64)u * 32 + l, unit_value(un, l));
  }
#endif
}
"#;

/// Device code: `store_out` / `store_out4` write values as `OUT_TYPE` (also the norm's output);
/// `mma_index` places them in the layout `gemm_mma` reads.
pub(super) const STORE: &str = r#"
#ifndef OUT_TYPE
#error "OUT_TYPE (0 f32, 1 f16, 2 bf16) must come from the kernel variant"
#endif
#if OUT_TYPE == 1
#define store_half f32_to_f16
#elif OUT_TYPE == 2
#define store_half f32_to_bf16
#endif
__device__ __forceinline__ void store_out(u64 out, i64 i, float v) {
#if OUT_TYPE == 0
  reinterpret_cast<float*>(out)[i] = v;
#elif OUT_TYPE == 1
  reinterpret_cast<u16*>(out)[i] = f32_to_f16(v);
#elif OUT_TYPE == 2
  reinterpret_cast<u16*>(out)[i] = f32_to_bf16(v);
#else
#error "OUT_TYPE must be 0, 1 or 2"
#endif
}
// Where value i of row `tok` (of `cols`) goes in the layout `gemm_mma` reads (`MmaOrder`):
// 0 row-major; 1 (mma.sync) row-major with the middle two of every four swapped; 2 (wgmma)
// within each 128 columns, value 4s + r of unit t (32 values) at k = 16 s + 8 (r & 1) + 2 t +
// (r >> 1) (k-step s pairs lane t's weights (4s, 4s + 2) and (4s + 1, 4s + 3) with these), and
// tiled: per block of `tile` rows and 128-column chunk, 8-value groups k / 8 outermost, then
// rows (the staged image of the wgmma kernel's shared memory).
// (Token and tile fit 32 bits: their division is a 32-bit one, not a 64-bit software division
// per value.)
__device__ __forceinline__ i64 mma_index(i64 tok, i64 i, u32 cols, u32 order, u32 tile) {
  if (order == 1) return tok * cols + ((i & ~3ll) | ((i & 1) << 1) | ((i >> 1) & 1));
  if (order == 2) {
    const u32 t = (u32)tok;
    const i64 k = (((i >> 2) & 7) << 4) | ((i & 1) << 3) | (((i >> 5) & 3) << 1) | ((i >> 1) & 1);
    return (((i64)(t / tile) * (cols / 128) + (i >> 7)) * 16 + (k >> 3)) * tile * 8 + (i64)(t % tile) * 8 + (k & 7);
  }
  return tok * cols + i;
}
#if OUT_TYPE != 0
__device__ __forceinline__ u32 pack_out2(float lo, float hi) { return (u32)store_half(lo) | ((u32)store_half(hi) << 16); }
// The wgmma order (`mma_index` 2) 16 values at a time: v[t] = values 4s .. 4s + 3 of unit t of
// 128-column chunk `chunk` of row `tok`. Value 4s + r of unit t goes to 8-value group 2s + (r & 1),
// place 2t + (r >> 1), so the four vectors fill groups 2s and 2s + 1 (two 16-byte stores, `tile`
// groups apart). `out` 16-byte aligned.
__device__ __forceinline__ void store_wgmma16(u64 out, u32 tok, u32 chunk, u32 s, u32 chunks, u32 tile, const float4 (&v)[4]) {
  uint4* dst = reinterpret_cast<uint4*>(out) + (((i64)(tok / tile) * chunks + chunk) * 16 + 2 * s) * tile + tok % tile;
  dst[0] = make_uint4(pack_out2(v[0].x, v[0].z), pack_out2(v[1].x, v[1].z), pack_out2(v[2].x, v[2].z), pack_out2(v[3].x, v[3].z));
  dst[tile] = make_uint4(pack_out2(v[0].y, v[0].w), pack_out2(v[1].y, v[1].w), pack_out2(v[2].y, v[2].w), pack_out2(v[3].y, v[3].w));
}
#endif
// Values i .. i + 3 (i % 4 == 0) in one store: 16 bytes of f32 or 8 of f16/bf16.
__device__ __forceinline__ void store_out4(u64 out, i64 i, float4 v) {
#if OUT_TYPE == 0
  reinterpret_cast<float4*>(out)[i / 4] = v;
#else
  reinterpret_cast<uint2*>(out)[i / 4] = make_uint2((u32)store_half(v.x) | ((u32)store_half(v.y) << 16), (u32)store_half(v.z) | ((u32)store_half(v.w) << 16));
#endif
}
"#;

device_params! {
    pub struct DequantParams {
        pub w0: u64,
        pub w1: u64,
        pub w2: u64,
        pub w3: u64,
        pub out: u64,
        pub rows: u32,
        pub cols: u32,
    }
}

const DEQUANT: &str = r#"
#if !IS_FLOAT
// A unit's 32 values at out[at..at + 32] with 16-byte stores (`at` is a multiple of 32).
__device__ __forceinline__ void store_unit(u64 out, i64 at, const Unit& un) {
#if OUT_TYPE == 0
  float4* dst = reinterpret_cast<float4*>(reinterpret_cast<float*>(out) + at);
#pragma unroll
  for (int i = 0; i < 8; ++i)
    dst[i] = make_float4(unit_value(un, 4 * i), unit_value(un, 4 * i + 1), unit_value(un, 4 * i + 2), unit_value(un, 4 * i + 3));
#else
  uint4* dst = reinterpret_cast<uint4*>(reinterpret_cast<u16*>(out) + at);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    u32 pair[4];
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const float a = unit_value(un, 8 * i + 2 * j), b = unit_value(un, 8 * i + 2 * j + 1);
#if OUT_TYPE == 1
      pair[j] = (u32)f32_to_f16(a) | ((u32)f32_to_f16(b) << 16);
#else
      pair[j] = (u32)f32_to_bf16(a) | ((u32)f32_to_bf16(b) << 16);
#endif
    }
    dst[i] = make_uint4(pair[0], pair[1], pair[2], pair[3]);
  }
#endif
}
#endif

// One block per row: blockIdx.x = row, threads split the row (quantized types: one 32-value
// unit per thread and step, written with vector stores).
extern "C" __global__ void dequantize(const DequantParams p) {
  KERNEL_ENTRY();
  const WeightRef w = {(const u8*)p.w0, (const u8*)p.w1, (const u8*)p.w2, (const u8*)p.w3, (i64)p.cols};
  const i64 row = blockIdx.x;
  const u64 out = p.out;
  const i64 base = row * p.cols;
#if IS_FLOAT
  dequant_row(w, row, threadIdx.x, blockDim.x, [&](i64 c, float v) { store_out(out, base + c, v); });
#else
  for (int u = threadIdx.x; u < (int)(p.cols / 32); u += blockDim.x) {
    Unit un;
    load_unit(w, row, u, un);
    store_unit(out, base + (i64)u * 32, un);
  }
#endif
}
"#;

/// `dequantize`: weight type in, [`OutType`] out.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct DequantVariant {
    pub wtype: GgmlType,
    pub out: OutType,
}

impl DequantVariant {
    pub const THREADS: u32 = 256;

    pub fn launch_config(&self, rows: usize) -> LaunchConfig {
        LaunchConfig { grid_dim: (blocks_for(rows, 1), 1, 1), block_dim: (Self::THREADS, 1, 1), shared_mem_bytes: 0 }
    }
}

impl KernelVariant for DequantVariant {
    const FAMILY: &'static str = "dequant";
    const SOURCES: &'static [&'static str] = &[HEADER, QUANT, ROW, STORE, DequantParams::C_DECL, DEQUANT];
    const ENTRY_POINTS: &'static [&'static str] = &["dequantize"];

    fn macros(&self) -> Vec<(&'static str, String)> {
        vec![("WTYPE", (self.wtype as u32).to_string()), ("OUT_TYPE", (self.out as u32).to_string())]
    }
}

device_params! {
    pub struct ConvertParams {
        pub src: u64,
        pub dst: u64,
        pub n: u64,
        /// [`MmaOrder`] of the output (`n` a multiple of 4; for `Wgmma`, rows of whole 128s).
        pub order: u32,
        /// Row length (a multiple of 4 for `Pairs`) and rows per tile of the `Wgmma` layout.
        pub cols: u32,
        pub tile_tokens: u32,
        pub pad: u32,
    }
}

const CONVERT: &str = r#"
extern "C" __global__ void convert_f32(const ConvertParams p) {
  KERNEL_ENTRY();
  const float* src = reinterpret_cast<const float*>(p.src);
  const i64 first = (i64)blockIdx.x * blockDim.x + threadIdx.x, stride = (i64)gridDim.x * blockDim.x;
#if OUT_TYPE != 0
  // The wgmma order, 16 values per step where the addresses allow it (a thread per step: the
  // launch sizes the grid so).
  if (p.order == 2 && ((p.src | p.dst) & 15) == 0 && p.n < (1ull << 31)) {
    const u32 chunks = p.cols / 128, steps = (u32)(p.n / 16);
    for (u32 g = (u32)first; g < steps; g += (u32)stride) {
      const u32 s = g & 7, tc = g >> 3, chunk = tc % chunks, tok = tc / chunks;
      const float* at = src + (i64)tok * p.cols + chunk * 128 + 4 * s;
      float4 v[4];
#pragma unroll
      for (int t = 0; t < 4; ++t) v[t] = *reinterpret_cast<const float4*>(at + 32 * t);
      store_wgmma16(p.dst, tok, chunk, s, chunks, p.tile_tokens, v);
    }
    return;
  }
#endif
  // Four values per step (one 16-byte load, one store) where the addresses allow it; the pair
  // order swaps the middle two of the four in registers.
  const bool vec = p.order != 2 && ((p.src | p.dst) & (OUT_TYPE == 0 ? 15 : 7)) == 0;
  const i64 done = vec ? (i64)(p.n & ~3ull) : 0;
  for (i64 g = first; g < done / 4; g += stride) {
    float4 v = reinterpret_cast<const float4*>(src)[g];
    if (p.order == 1) {
      const float t = v.y;
      v.y = v.z;
      v.z = t;
    }
    store_out4(p.dst, 4 * g, v);
  }
  for (i64 i = done + first; i < (i64)p.n; i += stride)
    store_out(p.dst, mma_index(i / p.cols, i % p.cols, p.cols, p.order, p.tile_tokens), src[i]);
}
"#;

/// `convert_f32`: f32 activations to [`OutType`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct ConvertVariant {
    pub out: OutType,
}

impl ConvertVariant {
    /// A thread per four of the `n` values, per sixteen in the wgmma order of a 16-bit output
    /// (the kernel's grid-stride loops cover the rest).
    pub fn launch_config(&self, n: usize, order: MmaOrder) -> LaunchConfig {
        let per_thread = if matches!(order, MmaOrder::Wgmma { .. }) && self.out != OutType::F32 { 16 } else { 4 };
        LaunchConfig { grid_dim: (blocks_for(n.div_ceil(per_thread), 256).clamp(1, 65535), 1, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 }
    }
}

impl KernelVariant for ConvertVariant {
    const FAMILY: &'static str = "convert";
    const SOURCES: &'static [&'static str] = &[HEADER, STORE, ConvertParams::C_DECL, CONVERT];
    const ENTRY_POINTS: &'static [&'static str] = &["convert_f32"];

    fn macros(&self) -> Vec<(&'static str, String)> {
        vec![("OUT_TYPE", (self.out as u32).to_string())]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn macros_match_source() {
        crate::kernels::tests::assert_macros_match(DequantVariant { wtype: GgmlType::Q4_K, out: OutType::F16 });
        crate::kernels::tests::assert_macros_match(ConvertVariant { out: OutType::BF16 });
    }
}
