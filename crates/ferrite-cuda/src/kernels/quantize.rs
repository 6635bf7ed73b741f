//! Activation quantization for the int8 GEMV: each row of f32 activations becomes 32-value
//! blocks of int8 codes with one f32 scale, the numerics of ferrite-cpu's quantized path
//! (`d = max|x| / 127`, codes rounded half to even, a NaN in a block makes `d` NaN).
//!
//! Layout (row `t`, block `b`, `units = cols / 32`): codes `xq[t * cols + 32 b + l]`, and
//! `xs[t * units + b]` = (bits of `d`, code sum of elements 0..15 | code sum of 16..31 << 16),
//! so the GEMV folds weight offsets and mins in with one multiply per half block.
//!
//! `PROLOGUE` computes what is quantized: the row as is, or the row RMS-normalised (the norm of
//! a norm-folded linear, so normalisation and quantization are one launch).

use super::common::HEADER;
use super::{blocks_for, device_params, KernelVariant};
use cudarc::driver::LaunchConfig;

/// One 32-value block quantized by a warp, shared by every kernel that writes int8 activations
/// (this one, and the producers of an int8 hand-off: `gemv_q8` with `EMIT`, attention).
pub const Q8_BLOCK: &str = r#"
// Quantize one 32-value block held one value per lane: writes lane l's code to q[l] and, from
// lane 0, the block's scale and the code sums of its two halves to *scale. A NaN anywhere in the
// block makes the scale NaN.
__device__ __forceinline__ void quantize_block_warp(float v, int lane, i8* q, uint2* scale) {
  const bool nan = __any_sync(FULL_MASK, v != v);
  const float amax = warp_max_redux(fabsf(v));  // unread with a NaN
  const float inv_d = amax > 0.f ? 127.f / amax : 0.f;
  const int c = nan ? 0 : __float2int_rn(v * inv_d);
  q[lane] = (i8)c;
  // Code sums of each half (lanes 0..15 and 16..31), each one `redux.sync`.
  const int s = __reduce_add_sync(FULL_MASK, lane < 16 ? c : 0), s_hi = __reduce_add_sync(FULL_MASK, c) - s;
  if (lane == 0) *scale = make_uint2(__float_as_uint(nan ? QNAN : amax / 127.f), ((u32)s & 0xffffu) | ((u32)s_hi << 16));
}

// `quantize_block_warp` for N blocks, each held by an aligned group of 8 lanes, 4 consecutive
// values each (group lane j: values 4j..4j+3): the same codes, scales and sums, the N blocks in
// the same three shuffle steps (side by side, not one block's chain after another's), the NaN
// check in one ballot. Returns group lane j's code word j of each block and, valid in group lane
// 0, its scale. Every lane of the warp must call it.
template <int N>
__device__ __forceinline__ void quantize_blocks_group8(const float4 (&v)[N], int lane, u32 (&word)[N], uint2 (&scale)[N]) {
  float amax[N];
  bool nan[N];
  int s[N];
#pragma unroll
  for (int r = 0; r < N; ++r) {
    amax[r] = fmaxf(fmaxf(fabsf(v[r].x), fabsf(v[r].y)), fmaxf(fabsf(v[r].z), fabsf(v[r].w)));
    const bool mine = v[r].x != v[r].x || v[r].y != v[r].y || v[r].z != v[r].z || v[r].w != v[r].w;
    nan[r] = (__ballot_sync(FULL_MASK, mine) >> (lane & ~7)) & 0xffu;
  }
#pragma unroll
  for (int o = 1; o < 8; o <<= 1)
#pragma unroll
    for (int r = 0; r < N; ++r) amax[r] = fmaxf(amax[r], __shfl_xor_sync(FULL_MASK, amax[r], o));
#pragma unroll
  for (int r = 0; r < N; ++r) {
    const float inv_d = amax[r] > 0.f ? 127.f / amax[r] : 0.f;
    const int c0 = nan[r] ? 0 : __float2int_rn(v[r].x * inv_d), c1 = nan[r] ? 0 : __float2int_rn(v[r].y * inv_d);
    const int c2 = nan[r] ? 0 : __float2int_rn(v[r].z * inv_d), c3 = nan[r] ? 0 : __float2int_rn(v[r].w * inv_d);
    word[r] = (u32)(c0 & 0xff) | ((u32)(c1 & 0xff) << 8) | ((u32)(c2 & 0xff) << 16) | ((u32)c3 << 24);
    s[r] = c0 + c1 + c2 + c3;  // code sums of each half: group lanes 0..3 and 4..7
  }
#pragma unroll
  for (int o = 1; o < 4; o <<= 1)
#pragma unroll
    for (int r = 0; r < N; ++r) s[r] += __shfl_xor_sync(FULL_MASK, s[r], o);
#pragma unroll
  for (int r = 0; r < N; ++r) {
    const int s_hi = __shfl_sync(FULL_MASK, s[r], (lane & ~7) + 4);
    scale[r] = make_uint2(__float_as_uint(nan[r] ? QNAN : amax[r] / 127.f), ((u32)s[r] & 0xffffu) | ((u32)s_hi << 16));
  }
}
"#;

device_params! {
    pub struct QuantizeParams {
        pub x: u64,
        pub norm_weight: u64,
        pub xq: u64,
        pub xs: u64,
        pub cols: u32,
        pub x_ld: u32,
        pub eps: f32,
        pub add_one: u32,
    }
}

const SOURCE: &str = r#"
#ifndef BLOCK_SIZE
#error "BLOCK_SIZE (threads per row) must come from the kernel variant"
#endif
#ifndef PROLOGUE
#error "PROLOGUE (0 plain, 1 RMS norm) must come from the kernel variant"
#endif

// Grid (x: groups of BLOCK_SIZE / 32 blocks of 32 values, y: rows); warp w of a block
// quantizes one 32-value block (lane l: element l). With the norm, every block first sums the
// squares of its whole row itself: rows are short enough that re-reading them from L2 is
// cheaper than a second launch.
extern "C" __global__ void __launch_bounds__(BLOCK_SIZE) quantize_q8(const QuantizeParams p) {
  KERNEL_ENTRY();
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const i64 row = blockIdx.y;
  const float* x = reinterpret_cast<const float*>(p.x) + row * p.x_ld;
  const u32 units = p.cols / 32;
  const u32 b = blockIdx.x * (BLOCK_SIZE / 32) + warp;
#if PROLOGUE == 1
  __shared__ float scratch[32];
  const float inv = row_rms_inv(x, p.cols, p.eps, scratch);
#endif
  if (b >= units) return;  // after the block-wide sum
  const u32 i = 32 * b + lane;
  float v = x[i];
#if PROLOGUE == 1
  const float g = reinterpret_cast<const float*>(p.norm_weight)[i];
  v = v * inv * (p.add_one ? 1.f + g : g);
#endif
  quantize_block_warp(v, lane, reinterpret_cast<i8*>(p.xq) + row * p.cols + 32 * b,
                      reinterpret_cast<uint2*>(p.xs) + row * units + b);
}
"#;

/// Prologue applied to each row before quantizing.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Prologue {
    Plain = 0,
    RmsNorm = 1,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct QuantizeVariant {
    pub block_size: u32,
    pub prologue: Prologue,
}

impl QuantizeVariant {
    /// One warp per 32-value block, up to 8 warps per block.
    pub fn for_cols(cols: usize, prologue: Prologue) -> Self {
        QuantizeVariant { block_size: (cols.div_ceil(32) * 32).next_power_of_two().clamp(32, 256) as u32, prologue }
    }

    pub fn launch_config(&self, n_rows: usize, cols: usize) -> LaunchConfig {
        let per_block = self.block_size as usize;
        LaunchConfig {
            grid_dim: (blocks_for(cols, per_block), n_rows as u32, 1),
            block_dim: (self.block_size, 1, 1),
            shared_mem_bytes: 0,
        }
    }
}

impl KernelVariant for QuantizeVariant {
    const FAMILY: &'static str = "quantize";
    const SOURCES: &'static [&'static str] = &[HEADER, Q8_BLOCK, QuantizeParams::C_DECL, SOURCE];
    const ENTRY_POINTS: &'static [&'static str] = &["quantize_q8"];

    fn macros(&self) -> Vec<(&'static str, String)> {
        vec![("BLOCK_SIZE", self.block_size.to_string()), ("PROLOGUE", (self.prologue as u32).to_string())]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn macros_match_source() {
        crate::kernels::tests::assert_macros_match(QuantizeVariant::for_cols(576, Prologue::RmsNorm));
    }

    #[test]
    fn block_size_follows_cols() {
        assert_eq!(QuantizeVariant::for_cols(32, Prologue::Plain).block_size, 32);
        assert_eq!(QuantizeVariant::for_cols(96, Prologue::Plain).block_size, 128);
        let v = QuantizeVariant::for_cols(14336, Prologue::Plain);
        assert_eq!(v.block_size, 256);
        assert_eq!(v.launch_config(3, 14336).grid_dim, (56, 3, 1));
    }
}
