//! Embedding lookup: one block per token decodes the token's table row to f32, and may quantize
//! it for the first int8 GEMV (an int8 hand-off, as `gemv_q8`'s `EMIT` does).

use super::common::{HEADER, QUANT};
use super::dequant::ROW;
use super::quantize::Q8_BLOCK;
use super::{device_params, KernelVariant};
use cudarc::driver::LaunchConfig;
use ferrite_gguf::GgmlType;

device_params! {
    pub struct EmbedParams {
        pub w0: u64,
        pub w1: u64,
        pub w2: u64,
        pub w3: u64,
        pub ids: u64,
        pub out: u64,
        pub error_flag: u64,
        /// 0, or the int8 codes and block scales of each row (`quantize` layout); with
        /// `emit_norm`, codes of the row times that RMSNorm weight (`1 + w` with
        /// `emit_add_one`) and each 32-value block's sum of squares in `emit_partials`.
        pub emit_q: u64,
        pub emit_s: u64,
        pub emit_norm: u64,
        pub emit_partials: u64,
        pub vocab: u32,
        pub dim: u32,
        /// Multiplies every value (1 for a plain lookup).
        pub scale: f32,
        pub emit_add_one: u32,
    }
}

const SOURCE: &str = r#"
extern "C" __global__ void embed(const EmbedParams p) {
  KERNEL_ENTRY();
  const WeightRef w = {(const u8*)p.w0, (const u8*)p.w1, (const u8*)p.w2, (const u8*)p.w3, (i64)p.dim};
  const i64 t = blockIdx.x;
  const u32 id = reinterpret_cast<const u32*>(p.ids)[t];
  float* out = reinterpret_cast<float*>(p.out) + t * p.dim;
  if (id >= p.vocab) {
    // Never read outside the table: flag it for Gpu::check_device and poison the row.
    if (threadIdx.x == 0) report_error(p.error_flag, ERR_TOKEN_ID, id);
    for (u32 c = threadIdx.x; c < p.dim; c += blockDim.x) out[c] = QNAN;
  } else if (p.scale == 1.0f) {
    dequant_row(w, (i64)id, threadIdx.x, blockDim.x, [&](i64 c, float v) { out[c] = v; });
  } else {
    const float scale = p.scale;
    dequant_row(w, (i64)id, threadIdx.x, blockDim.x, [&](i64 c, float v) { out[c] = v * scale; });
  }
  if (p.emit_q == 0) return;
  // The row as the block wrote it, a 32-value block per warp turn.
  __syncthreads();
  const u32 lane = threadIdx.x & 31, units = p.dim / 32;
  for (u32 b = threadIdx.x / 32; b < units; b += blockDim.x / 32) {
    const float v = out[32 * b + lane];
    float x = v;
    if (p.emit_norm) {
      const float ss = warp_sum(v * v);
      if (lane == 0) reinterpret_cast<float*>(p.emit_partials)[t * units + b] = ss;
      const float g = reinterpret_cast<const float*>(p.emit_norm)[32 * b + lane];
      x = v * (p.emit_add_one ? 1.f + g : g);
    }
    quantize_block_warp(x, lane, reinterpret_cast<i8*>(p.emit_q) + t * p.dim + 32 * b, reinterpret_cast<uint2*>(p.emit_s) + t * units + b);
  }
}
"#;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct EmbedVariant {
    pub wtype: GgmlType,
}

impl EmbedVariant {
    pub fn launch_config(&self, n_tokens: usize) -> LaunchConfig {
        LaunchConfig { grid_dim: (n_tokens as u32, 1, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 }
    }
}

impl KernelVariant for EmbedVariant {
    const FAMILY: &'static str = "embedding";
    const SOURCES: &'static [&'static str] = &[HEADER, QUANT, ROW, Q8_BLOCK, EmbedParams::C_DECL, SOURCE];
    const ENTRY_POINTS: &'static [&'static str] = &["embed"];

    fn macros(&self) -> Vec<(&'static str, String)> {
        vec![("WTYPE", (self.wtype as u32).to_string())]
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn macros_match_source() {
        crate::kernels::tests::assert_macros_match(super::EmbedVariant { wtype: ferrite_gguf::GgmlType::Q6_K });
    }
}
