//! Embedding lookup: one block per token decodes the token's table row to f32.

use super::common::{HEADER, QUANT};
use super::dequant::ROW;
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
        pub vocab: u32,
        pub dim: u32,
        /// Multiplies every value (1 for a plain lookup).
        pub scale: f32,
        pub pad: u32,
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
    return;
  }
  const float scale = p.scale;
  if (scale == 1.0f) {
    dequant_row(w, (i64)id, threadIdx.x, blockDim.x, [&](i64 c, float v) { out[c] = v; });
  } else {
    dequant_row(w, (i64)id, threadIdx.x, blockDim.x, [&](i64 c, float v) { out[c] = v * scale; });
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
    const SOURCES: &'static [&'static str] = &[HEADER, QUANT, ROW, EmbedParams::C_DECL, SOURCE];
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
