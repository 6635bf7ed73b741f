//! Quantized GEMV: `out[t, r] = sum_c W[r, c] * x[t, c]` for a few tokens, reading packed
//! weights once. One template for every GGML type; `WTYPE` picks the decoder from
//! `common::QUANT`, the other macros the tiling.
//!
//! Work split: a warp owns `ROWS_PER_WARP` rows; lane `l` walks the rows' 32-weight units
//! `l, l + 32, ...` (consecutive lanes read consecutive 16-byte quant chunks). Per unit it loads
//! the packed weights of all its rows first; with one token it then reads the 32 activations
//! into registers and decodes while multiplying, with several it decodes each row's codes once
//! and multiplies them with each token's activations. Block scales are applied once per half
//! unit. A warp shuffle reduction finishes each
//! output. Grid y walks token tiles of `NTOK`, so any token count works (larger counts re-read
//! the weights).

use super::common::{HEADER, QUANT};
use super::{blocks_for, device_params, KernelVariant};
use cudarc::driver::LaunchConfig;
use ferrite_gguf::GgmlType;

device_params! {
    pub struct GemvParams {
        pub w0: u64,
        pub w1: u64,
        pub w2: u64,
        pub w3: u64,
        pub x: u64,
        pub out: u64,
        pub rows: u32,
        pub cols: u32,
        pub n_tokens: u32,
        pub pad: u32,
    }
}

const SOURCE: &str = r#"
#ifndef NWARPS
#error "NWARPS (warps per block) must come from the kernel variant"
#endif
#ifndef ROWS_PER_WARP
#error "ROWS_PER_WARP must come from the kernel variant"
#endif
#ifndef NTOK
#error "NTOK (tokens per grid-y tile) must come from the kernel variant"
#endif

// A token's 32 activations of one unit (16-byte aligned) into registers.
__device__ __forceinline__ void load_x(const float* src, float* xv) {
  const float4* xp = reinterpret_cast<const float4*>(src);
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const float4 v = xp[i];
    xv[4 * i] = v.x; xv[4 * i + 1] = v.y; xv[4 * i + 2] = v.z; xv[4 * i + 3] = v.w;
  }
}

extern "C" __global__ void __launch_bounds__(NWARPS * 32) gemv(const GemvParams p) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const i64 row0 = ((i64)blockIdx.x * NWARPS + warp) * ROWS_PER_WARP;
  const int tok0 = blockIdx.y * NTOK;
  // Warp-uniform exit; the kernel has no block-level barrier.
  if (row0 >= p.rows) return;
  const WeightRef w = {(const u8*)p.w0, (const u8*)p.w1, (const u8*)p.w2, (const u8*)p.w3, (i64)p.cols};
  const float* x = reinterpret_cast<const float*>(p.x);
  const int units = (int)(p.cols / 32);

  float acc[ROWS_PER_WARP][NTOK];
#pragma unroll
  for (int r = 0; r < ROWS_PER_WARP; ++r)
#pragma unroll
    for (int t = 0; t < NTOK; ++t) acc[r][t] = 0.f;

  for (int u = lane; u < units; u += 32) {
    // Issue every row's loads before any math. A row past the end re-reads the last row
    // (a safe read whose result is never stored).
    Unit wu[ROWS_PER_WARP];
#pragma unroll
    for (int r = 0; r < ROWS_PER_WARP; ++r) load_unit(w, min(row0 + r, (i64)p.rows - 1), u, wu[r]);
#if NTOK == 1
    // One token: decode while multiplying.
    float xv[32];
    load_x(x + (i64)tok0 * p.cols + (i64)u * 32, xv);
#pragma unroll
    for (int r = 0; r < ROWS_PER_WARP; ++r) acc[r][0] += unit_dot(wu[r], xv);
#else
    // Several tokens: decode each row's codes once, reuse them for every token.
    float codes[ROWS_PER_WARP][32];
#pragma unroll
    for (int r = 0; r < ROWS_PER_WARP; ++r)
#pragma unroll
      for (int l = 0; l < 32; ++l) codes[r][l] = unit_q(wu[r], l);
#pragma unroll
    for (int t = 0; t < NTOK; ++t) {
      if (tok0 + t < (int)p.n_tokens) {
        float xv[32];
        load_x(x + (i64)(tok0 + t) * p.cols + (i64)u * 32, xv);
#pragma unroll
        for (int r = 0; r < ROWS_PER_WARP; ++r) acc[r][t] += scaled_dot(wu[r], [&](int l) { return codes[r][l]; }, xv);
      }
    }
#endif
  }

  float* out = reinterpret_cast<float*>(p.out);
#pragma unroll
  for (int r = 0; r < ROWS_PER_WARP; ++r) {
#pragma unroll
    for (int t = 0; t < NTOK; ++t) {
      const float v = warp_sum(acc[r][t]);
      if (lane == 0 && row0 + r < p.rows && tok0 + t < (int)p.n_tokens) out[(i64)(tok0 + t) * p.rows + row0 + r] = v;
    }
  }
}
"#;

/// Compile-time shape of the GEMV kernel.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct GemvVariant {
    pub wtype: GgmlType,
    pub nwarps: u32,
    pub rows_per_warp: u32,
    pub ntok: u32,
}

impl GemvVariant {
    /// Tiling for `n_tokens` tokens: token tiles up to 8. More rows per warp share each
    /// activation load, at the price of registers (packed units, plus `rows x NTOK`
    /// accumulators); f32 units are the bulkiest.
    pub fn for_shape(wtype: GgmlType, n_tokens: usize) -> Self {
        let ntok = n_tokens.clamp(1, 8).next_power_of_two() as u32;
        let rows_per_warp = if ntok <= 2 && wtype != GgmlType::F32 { 4 } else { 2 };
        GemvVariant { wtype, nwarps: 4, rows_per_warp, ntok }
    }

    pub fn launch_config(&self, rows: usize, n_tokens: usize) -> LaunchConfig {
        let rows_per_block = (self.nwarps * self.rows_per_warp) as usize;
        LaunchConfig {
            grid_dim: (blocks_for(rows, rows_per_block), blocks_for(n_tokens, self.ntok as usize), 1),
            block_dim: (self.nwarps * 32, 1, 1),
            shared_mem_bytes: 0,
        }
    }
}

impl KernelVariant for GemvVariant {
    const FAMILY: &'static str = "gemv";
    const SOURCES: &'static [&'static str] = &[HEADER, QUANT, GemvParams::C_DECL, SOURCE];
    const ENTRY_POINTS: &'static [&'static str] = &["gemv"];

    fn macros(&self) -> Vec<(&'static str, String)> {
        vec![
            ("WTYPE", (self.wtype as u32).to_string()),
            ("NWARPS", self.nwarps.to_string()),
            ("ROWS_PER_WARP", self.rows_per_warp.to_string()),
            ("NTOK", self.ntok.to_string()),
        ]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn macros_match_source() {
        crate::kernels::tests::assert_macros_match(GemvVariant::for_shape(GgmlType::Q4_0, 1));
    }

    #[test]
    fn grid_covers_rows_and_tokens() {
        let v = GemvVariant::for_shape(GgmlType::Q6_K, 3);
        assert_eq!((v.ntok, v.rows_per_warp), (4, 2));
        let cfg = v.launch_config(1001, 9);
        assert_eq!(cfg.grid_dim, (126, 3, 1));
        assert_eq!(cfg.block_dim, (128, 1, 1));
        let v = GemvVariant::for_shape(GgmlType::Q6_K, 1);
        assert_eq!(v.launch_config(1001, 1).grid_dim, (63, 1, 1));
    }
}
