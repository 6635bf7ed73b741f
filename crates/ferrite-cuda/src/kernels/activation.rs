//! Element-wise ops of the MLP and the residual stream: SwiGLU, GeGLU (tanh GELU), add, bias
//! add over a column range, and copies of column ranges between row-major matrices (to split
//! or join fused projections); and the two halves of a gated query projection (Qwen3.5's gated
//! attention): the query split off into the QKV value, the sigmoid gate of the output.

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
    /// `out[r, c] = act(gate[r * in_stride + c]) * up[r * in_stride + c]` for the `n` elements of
    /// rows of `width` (`out` dense; one row of `n` with `width = in_stride = n`).
    pub struct GluParams {
        pub gate: u64,
        pub up: u64,
        pub out: u64,
        pub n: u64,
        pub width: u64,
        pub in_stride: u64,
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

device_params! {
    /// A gated query projection `qg` (rows of `qg_width`; per head `[query | gate]`, each
    /// `head_dim` wide) and the `n_heads * head_dim` columns of `out` (rows of `out_width`) that
    /// hold one value per query dimension; `x` (rows of `out_width`) is the gated input.
    pub struct GatedQueryParams {
        pub qg: u64,
        pub x: u64,
        pub out: u64,
        pub qg_width: u32,
        pub out_width: u32,
        pub n_heads: u32,
        pub head_dim: u32,
        pub n_rows: u32,
        pub pad: u32,
    }
}

const SOURCE: &str = r#"
#define GRID_STRIDE(i, n) for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < (i64)(n); i += (i64)gridDim.x * blockDim.x)


// Where element i of a GLU output reads its gate and up values (rows of `width` in rows of
// `in_stride`: the halves of a fused [gate | up] projection, or one dense row).
__device__ __forceinline__ i64 glu_at(const GluParams& p, i64 i) { return (i / (i64)p.width) * (i64)p.in_stride + i % (i64)p.width; }

// True when the addresses allow 16-byte accesses: the kernels below then move four floats per
// load and store (a quarter of the instructions, and whole 16-byte sectors per lane).
__device__ __forceinline__ bool aligned16(u64 a, u64 b, u64 c) { return ((a | b | c) & 15) == 0; }
__device__ __forceinline__ float4 ld4(const float* p, i64 i) { return *reinterpret_cast<const float4*>(p + i); }

// out = act(gate) * up (out may alias gate or up when they are dense: each thread reads its
// elements before writing them). Four at a time when rows of 4-aligned width allow it.
template <typename Act>
__device__ __forceinline__ void gated(const GluParams& p, Act act) {
  const float* gate = reinterpret_cast<const float*>(p.gate);
  const float* up = reinterpret_cast<const float*>(p.up);
  float* out = reinterpret_cast<float*>(p.out);
  if (aligned16(p.gate, p.up, p.out) && p.width % 4 == 0 && p.in_stride % 4 == 0) {
    GRID_STRIDE(g, p.n / 4) {
      const i64 at = glu_at(p, 4 * g);
      const float4 a = ld4(gate, at), b = ld4(up, at);
      reinterpret_cast<float4*>(out)[g] = make_float4(act(a.x) * b.x, act(a.y) * b.y, act(a.z) * b.z, act(a.w) * b.w);
    }
  } else {
    GRID_STRIDE(i, p.n) out[i] = act(gate[glu_at(p, i)]) * up[glu_at(p, i)];
  }
}

extern "C" __global__ void swiglu(const GluParams p) {
  KERNEL_ENTRY();
  gated(p, [](float g) { return silu(g); });
}

extern "C" __global__ void geglu(const GluParams p) {
  KERNEL_ENTRY();
  gated(p, [](float g) { return gelu_tanh(g); });
}

// acc += x (p.a = acc, p.b = x)
extern "C" __global__ void add(const ElementwiseParams p) {
  KERNEL_ENTRY();
  float* acc = reinterpret_cast<float*>(p.a);
  const float* x = reinterpret_cast<const float*>(p.b);
  if (aligned16(p.a, p.b, 0) && p.n % 4 == 0) {
    GRID_STRIDE(g, p.n / 4) {
      float4 a = ld4(acc, 4 * g);
      const float4 b = ld4(x, 4 * g);
      a.x += b.x; a.y += b.y; a.z += b.z; a.w += b.w;
      reinterpret_cast<float4*>(acc)[g] = a;
    }
  } else {
    GRID_STRIDE(i, p.n) acc[i] += x[i];
  }
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

// Column of query dimension e = h * head_dim + d in a row of a gated query projection
// (2 h head_dim + d); its gate is head_dim further.
__device__ __forceinline__ i64 query_col(i64 e, u32 head_dim) { return e + (e / head_dim) * head_dim; }

// out[r, e] = query e of qg row r, for e < n_heads * head_dim (the Q columns of a QKV row)
extern "C" __global__ void split_gated_query(const GatedQueryParams p) {
  KERNEL_ENTRY();
  const float* qg = reinterpret_cast<const float*>(p.qg);
  float* out = reinterpret_cast<float*>(p.out);
  const i64 width = (i64)p.n_heads * p.head_dim;
  GRID_STRIDE(i, (i64)p.n_rows * width) {
    const i64 r = i / width, e = i % width;
    out[r * p.out_width + e] = qg[r * p.qg_width + query_col(e, p.head_dim)];
  }
}

// out[r, e] = x[r, e] * sigmoid(gate e of qg row r) (out may alias x)
extern "C" __global__ void sigmoid_gate(const GatedQueryParams p) {
  KERNEL_ENTRY();
  const float* qg = reinterpret_cast<const float*>(p.qg);
  const float* x = reinterpret_cast<const float*>(p.x);
  float* out = reinterpret_cast<float*>(p.out);
  const i64 width = (i64)p.n_heads * p.head_dim;
  GRID_STRIDE(i, (i64)p.n_rows * width) {
    const i64 r = i / width, e = i % width;
    const float gate = qg[r * p.qg_width + query_col(e, p.head_dim) + p.head_dim];
    out[r * p.out_width + e] = x[r * p.out_width + e] / (1.f + expf(-gate));
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
    /// Threads for `n` work items: elements, or groups of four for the kernels that take four
    /// at a time (`swiglu`, `geglu`, `add`; their grid-stride loops cover any remainder).
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
        &[HEADER, ElementwiseParams::C_DECL, GluParams::C_DECL, CopyColsParams::C_DECL, AddRowsParams::C_DECL, GatedQueryParams::C_DECL, SOURCE];
    const ENTRY_POINTS: &'static [&'static str] =
        &["swiglu", "geglu", "add", "copy_cols", "add_rows", "split_gated_query", "sigmoid_gate"];

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
