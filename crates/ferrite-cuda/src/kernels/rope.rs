//! Rotary position embedding, in place on `[n_tokens, n_heads, head_dim]` f32 rows, with
//! per-token positions read from device memory (so a captured graph can replay it).

use super::common::HEADER;
use super::{blocks_for, device_params, KernelVariant};
use cudarc::driver::LaunchConfig;

device_params! {
    pub struct RopeParams {
        pub x: u64,
        pub positions: u64,
        pub n_tokens: u32,
        pub n_heads: u32,
        pub head_dim: u32,
        pub rot_dim: u32,
        pub theta: f32,
        pub freq_scale: f32,
    }
}

/// The rotation angle of pair `i` at `pos`, shared by every kernel that applies RoPE. Angles
/// follow GGML (and ferrite-cpu's Rope) exactly, in f32: pair i turns by
/// freq_scale * (pos * s^i), the power taken by i repeated multiplications with
/// s = theta^(-2 / rot_dim), so both backends round the same way.
pub(crate) const ROPE_ANGLE: &str = r#"
__device__ __forceinline__ void rope_cos_sin(u32 pos, u32 i, u32 rot_dim, float theta, float freq_scale, float* c, float* s) {
  const float theta_scale = powf(theta, -2.0f / (float)rot_dim);
  float th = (float)pos;
  for (u32 k = 0; k < i; ++k) th *= theta_scale;
  const float angle = freq_scale * th;
  *c = cosf(angle);
  *s = sinf(angle);
}
// Turns (x0, x1) by the angle of (c, s). Explicitly rounded (no FMA contraction, as the CPU
// computes it), so every kernel that rotates gets the same bits.
__device__ __forceinline__ void rope_rotate(float* x0, float* x1, float c, float s) {
  const float a = *x0, b = *x1;
  *x0 = __fsub_rn(__fmul_rn(a, c), __fmul_rn(b, s));
  *x1 = __fadd_rn(__fmul_rn(a, s), __fmul_rn(b, c));
}
"#;

const SOURCE: &str = r#"
#ifndef NEOX
#error "NEOX (1: rotate pairs (i, i + rot_dim/2); 0: pairs (2i, 2i + 1)) must come from the kernel variant"
#endif
// One thread per rotated pair.
extern "C" __global__ void rope(const RopeParams p) {
  KERNEL_ENTRY();
  const u32 half = p.rot_dim / 2;
  const i64 idx = (i64)blockIdx.x * blockDim.x + threadIdx.x;
  if (idx >= (i64)p.n_tokens * p.n_heads * half) return;
  const u32 i = (u32)(idx % half);
  const i64 head_row = idx / half;  // token * n_heads + head
  const u32 tok = (u32)(head_row / p.n_heads);
  float c, s;
  rope_cos_sin(reinterpret_cast<const u32*>(p.positions)[tok], i, p.rot_dim, p.theta, p.freq_scale, &c, &s);
  float* x = reinterpret_cast<float*>(p.x) + head_row * p.head_dim;
#if NEOX
  const u32 a = i, b = i + half;
#else
  const u32 a = 2 * i, b = 2 * i + 1;
#endif
  rope_rotate(&x[a], &x[b], c, s);
}
"#;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct RopeVariant {
    pub neox: bool,
}

impl RopeVariant {
    pub fn launch_config(&self, pairs: usize) -> LaunchConfig {
        LaunchConfig { grid_dim: (blocks_for(pairs, 256), 1, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 }
    }
}

impl KernelVariant for RopeVariant {
    const FAMILY: &'static str = "rope";
    const SOURCES: &'static [&'static str] = &[HEADER, ROPE_ANGLE, RopeParams::C_DECL, SOURCE];
    const ENTRY_POINTS: &'static [&'static str] = &["rope"];

    fn macros(&self) -> Vec<(&'static str, String)> {
        vec![("NEOX", u32::from(self.neox).to_string())]
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn macros_match_source() {
        crate::kernels::tests::assert_macros_match(super::RopeVariant { neox: true });
    }
}
