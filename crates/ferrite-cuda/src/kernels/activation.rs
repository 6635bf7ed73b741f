//! Element-wise ops of the MLP and the residual stream: SwiGLU, GeGLU (tanh GELU), add, bias
//! add over a column range, and copies of column ranges between row-major matrices (to split
//! or join fused projections).

use super::common::HEADER;
use super::{blocks_for, device_params, KernelVariant};
use cudarc::driver::LaunchConfig;

device_params! {
    pub struct ElementwiseParams {
        pub a: u64,
        pub b: u64,
        pub out: u64,
        pub n: u64,
    }
}

device_params! {
    pub struct CopyColsParams {
        pub src: u64,
        pub dst: u64,
        pub src_width: u32,
        pub src_col: u32,
        pub dst_width: u32,
        pub dst_col: u32,
        pub n_cols: u32,
        pub n_rows: u32,
    }
}

device_params! {
    pub struct AddRowsParams {
        pub x: u64,
        pub bias: u64,
        pub width: u32,
        pub col: u32,
        pub n_cols: u32,
        pub n_rows: u32,
    }
}

const SOURCE: &str = r#"
#define GRID_STRIDE(i, n) for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < (i64)(n); i += (i64)gridDim.x * blockDim.x)


// out = silu(gate) * up (out may alias either input)
extern "C" __global__ void swiglu(const ElementwiseParams p) {
  KERNEL_ENTRY();
  const float* gate = reinterpret_cast<const float*>(p.a);
  const float* up = reinterpret_cast<const float*>(p.b);
  float* out = reinterpret_cast<float*>(p.out);
  GRID_STRIDE(i, p.n) out[i] = silu(gate[i]) * up[i];
}

// out = gelu_tanh(gate) * up (out may alias either input)
extern "C" __global__ void geglu(const ElementwiseParams p) {
  KERNEL_ENTRY();
  const float* gate = reinterpret_cast<const float*>(p.a);
  const float* up = reinterpret_cast<const float*>(p.b);
  float* out = reinterpret_cast<float*>(p.out);
  GRID_STRIDE(i, p.n) out[i] = gelu_tanh(gate[i]) * up[i];
}

// acc += x (p.a = acc, p.b = x)
extern "C" __global__ void add(const ElementwiseParams p) {
  KERNEL_ENTRY();
  float* acc = reinterpret_cast<float*>(p.a);
  const float* x = reinterpret_cast<const float*>(p.b);
  GRID_STRIDE(i, p.n) acc[i] += x[i];
}

// dst[r, dst_col + c] = src[r, src_col + c] for c < n_cols, r < n_rows
extern "C" __global__ void copy_cols(const CopyColsParams p) {
  KERNEL_ENTRY();
  const float* src = reinterpret_cast<const float*>(p.src);
  float* dst = reinterpret_cast<float*>(p.dst);
  GRID_STRIDE(i, (i64)p.n_rows * p.n_cols) {
    const i64 r = i / p.n_cols, c = i % p.n_cols;
    dst[r * p.dst_width + p.dst_col + c] = src[r * p.src_width + p.src_col + c];
  }
}

// x[r, col + c] += bias[c] for c < n_cols, r < n_rows
extern "C" __global__ void add_rows(const AddRowsParams p) {
  KERNEL_ENTRY();
  float* x = reinterpret_cast<float*>(p.x);
  const float* bias = reinterpret_cast<const float*>(p.bias);
  GRID_STRIDE(i, (i64)p.n_rows * p.n_cols) {
    const i64 r = i / p.n_cols, c = i % p.n_cols;
    x[r * p.width + p.col + c] += bias[c];
  }
}
"#;

/// The element-wise family has no compile-time options.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct ActivationVariant;

impl ActivationVariant {
    pub fn launch_config(&self, n: usize) -> LaunchConfig {
        LaunchConfig {
            grid_dim: (blocks_for(n, 256).clamp(1, 65535), 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        }
    }
}

impl KernelVariant for ActivationVariant {
    const FAMILY: &'static str = "activation";
    const SOURCES: &'static [&'static str] =
        &[HEADER, ElementwiseParams::C_DECL, CopyColsParams::C_DECL, AddRowsParams::C_DECL, SOURCE];
    const ENTRY_POINTS: &'static [&'static str] = &["swiglu", "geglu", "add", "copy_cols", "add_rows"];

    fn macros(&self) -> Vec<(&'static str, String)> {
        Vec::new()
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn macros_match_source() {
        crate::kernels::tests::assert_macros_match(super::ActivationVariant);
    }
}
