//! RMSNorm: `out = x / sqrt(mean(x^2) + eps) * w` (or `* (1 + w)`; plus a residual row: Gemma's
//! post-norm and its add), one block per row. A row
//! can also be one head of a wider token row (`heads` per token, `ld` apart, from column `col`):
//! Qwen3's QK-norm in place on the Q and K columns of `q | k | v`. The output may be f16/bf16
//! (`OUT_TYPE`): the GEMM input of a norm-folded linear, written in one launch with the norm,
//! in the order `gemm_mma` multiplies it in (`order`).

use super::common::HEADER;
use super::dequant::{OutType, STORE};
use super::{device_params, KernelVariant};
use cudarc::driver::LaunchConfig;

device_params! {
    pub struct RmsNormParams {
        pub x: u64,
        pub weight: u64,
        pub out: u64,
        pub dim: u32,
        pub eps: f32,
        pub add_one: u32,
        /// Rows (heads) per token row, the token rows' stride and the first head's column.
        pub heads: u32,
        pub ld: u32,
        pub col: u32,
        /// The outputs' [`super::dequant::MmaOrder`] (`convert_f32`'s `order`; one head per
        /// row, `ld == dim`, `col == 0`, `dim` a multiple of 4, of 128 for `Wgmma`) and its rows
        /// per tile.
        pub order: u32,
        pub tile_tokens: u32,
        /// 0, or `[rows, dim]` f32 added to the f32 natural-order output (Gemma's post-norm and
        /// its residual add: [`crate::ops::rms_norm_add`]).
        pub residual: u64,
    }
}

const SOURCE: &str = r#"
#ifndef BLOCK_SIZE
#error "BLOCK_SIZE (threads per row) must come from the kernel variant"
#endif
// Weights per thread loaded before the dependency wait (for_dim gives about four elements per
// thread): a weight, written by no earlier kernel, that would otherwise miss L2 after it.
#define W_PRE 4
// In place (out == x) is allowed: each thread reads an element before writing it.
extern "C" __global__ void __launch_bounds__(BLOCK_SIZE) rms_norm(const RmsNormParams p) {
  const float* wt = reinterpret_cast<const float*>(p.weight);
  const auto weight = [&](u32 i) { return p.add_one ? 1.f + wt[i] : wt[i]; };
  float g_pre[W_PRE];
#pragma unroll
  for (int k = 0; k < W_PRE; ++k) g_pre[k] = threadIdx.x + k * BLOCK_SIZE < p.dim ? weight(threadIdx.x + k * BLOCK_SIZE) : 0.f;
  KERNEL_ENTRY();
  __shared__ float scratch[32];
  const i64 start = (i64)(blockIdx.x / p.heads) * p.ld + p.col + (i64)(blockIdx.x % p.heads) * p.dim;
  const float* x = reinterpret_cast<const float*>(p.x) + start;
  const float inv = row_rms_inv(x, p.dim, p.eps, scratch);
#if OUT_TYPE != 0
  // The wgmma order 16 values per thread where the addresses allow it (store_wgmma16); the
  // same products as below.
  if (p.order == 2 && ((p.x | p.weight | p.out) & 15) == 0) {
    const u32 chunks = p.dim / 128;
    for (u32 w = threadIdx.x; w < chunks * 8; w += BLOCK_SIZE) {
      const u32 s = w & 7, chunk = w >> 3, at = chunk * 128 + 4 * s;
      float4 v[4];
#pragma unroll
      for (int t = 0; t < 4; ++t) {
        const float4 a = *reinterpret_cast<const float4*>(x + at + 32 * t);
        float4 g = *reinterpret_cast<const float4*>(wt + at + 32 * t);
        if (p.add_one) g = make_float4(1.f + g.x, 1.f + g.y, 1.f + g.z, 1.f + g.w);
        v[t] = make_float4(a.x * inv * g.x, a.y * inv * g.y, a.z * inv * g.z, a.w * inv * g.w);
      }
      store_wgmma16(p.out, blockIdx.x, chunk, s, chunks, p.tile_tokens, v);
    }
    return;
  }
#endif
  const float* res = reinterpret_cast<const float*>(p.residual);
  const auto norm_one = [&](u32 i, float g) {
    const float v = x[i] * inv * g;
    // (__fadd_rn: never contracted into the products, so the sum is a separate add's.)
    store_out(p.out, p.order ? mma_index(blockIdx.x, i, p.dim, p.order, p.tile_tokens) : start + i, res ? __fadd_rn(res[start + i], v) : v);
  };
#pragma unroll
  for (int k = 0; k < W_PRE; ++k) {
    const u32 i = threadIdx.x + k * BLOCK_SIZE;
    if (i < p.dim) norm_one(i, g_pre[k]);
  }
  for (u32 i = threadIdx.x + W_PRE * BLOCK_SIZE; i < p.dim; i += BLOCK_SIZE) norm_one(i, weight(i));
}
"#;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct NormVariant {
    pub block_size: u32,
    pub out: OutType,
}

impl NormVariant {
    /// About four elements per thread, between one warp and 1024 threads; f32 output.
    pub fn for_dim(dim: usize) -> Self {
        NormVariant { block_size: (dim / 4).clamp(32, 1024).next_power_of_two() as u32, out: OutType::F32 }
    }

    pub fn launch_config(&self, n_rows: usize) -> LaunchConfig {
        LaunchConfig { grid_dim: (n_rows as u32, 1, 1), block_dim: (self.block_size, 1, 1), shared_mem_bytes: 0 }
    }
}

impl KernelVariant for NormVariant {
    const FAMILY: &'static str = "norm";
    const SOURCES: &'static [&'static str] = &[HEADER, STORE, RmsNormParams::C_DECL, SOURCE];
    const ENTRY_POINTS: &'static [&'static str] = &["rms_norm"];

    fn macros(&self) -> Vec<(&'static str, String)> {
        vec![("BLOCK_SIZE", self.block_size.to_string()), ("OUT_TYPE", (self.out as u32).to_string())]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn macros_match_source() {
        crate::kernels::tests::assert_macros_match(NormVariant::for_dim(576));
        crate::kernels::tests::assert_macros_match(NormVariant { out: OutType::BF16, ..NormVariant::for_dim(576) });
    }

    #[test]
    fn block_size_follows_dim() {
        assert_eq!(NormVariant::for_dim(10).block_size, 32);
        assert_eq!(NormVariant::for_dim(576).block_size, 256);
        assert_eq!(NormVariant::for_dim(1 << 20).block_size, 1024);
    }
}
