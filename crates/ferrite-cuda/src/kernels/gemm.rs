//! Small-batch GEMM on tensor cores over packed quantized weights: `out[t, r] = sum_c W[r, c] *
//! x[t, c]` for 9–64 tokens (batched decode steps of a server), where the GEMV would re-read the
//! weights once per 8 tokens and dequantize + cuBLAS would write and re-read a bf16 copy.
//!
//! ## `gemm_mma`
//!
//! A block of `NWARPS` warps owns `BM` weight rows and `8 * NT` tokens; a warp owns `MT`
//! 16-row m-tiles. The block walks 64-column chunks of its K slice (grid z). Per chunk, each
//! lane decodes the 16 weights it needs of each of its rows straight from the packed planes
//! (`load_unit` / `unit_value` of `common::QUANT`, so every GGML type works), rounds them to
//! the MMA input type (bf16 or f16) in registers, and multiplies with `mma.sync` m16n8k16 (f32
//! accumulation). The K order inside a chunk is permuted so that the lane holding A's k slots
//! {2t, 2t+1, 2t+8, 2t+9} of step s also holds B's — lane (g, t) of a warp takes chunk columns
//! 16t..16t+15 of its rows (half a 32-weight unit) and of its tokens (two 16-byte loads): no
//! shuffles, and no shared memory for the weights. A dot product does not care in which order
//! it sums. The activations, which all four warps read, are staged per chunk in shared memory
//! with `cp.async` (two stages: the next chunk's copy runs during this chunk's MMAs).
//!
//! The next chunk's weights are loaded into registers while the current chunk's MMAs run. With grid z > 1 each
//! slice writes f32 partials `[z][n][rows]` and `gemm_reduce` sums them in slice order
//! (deterministic), so short-and-wide shapes still fill the SMs.

use super::common::{HEADER, QUANT};
use super::{blocks_for, device_params, KernelVariant};
use cudarc::driver::LaunchConfig;
use ferrite_gguf::GgmlType;

device_params! {
    pub struct GemmMmaParams {
        pub w0: u64,
        pub w1: u64,
        pub w2: u64,
        pub w3: u64,
        /// Activations `[n_tokens, cols]` in the MMA input type.
        pub x: u64,
        /// f32 `[n_tokens, rows]`, or with grid z > 1 the partials `[z][n_tokens, rows]`.
        pub out: u64,
        pub rows: u32,
        pub cols: u32,
        pub n_tokens: u32,
        /// 64-column chunks per K slice (grid z).
        pub slice_chunks: u32,
    }
}

device_params! {
    pub struct GemmReduceParams {
        pub partials: u64,
        pub out: u64,
        /// Elements per slice (`n_tokens * rows`).
        pub n: u64,
        pub slices: u32,
        pub pad: u32,
    }
}

const SOURCE: &str = r#"
#ifndef NT
#error "NT (8-token n-tiles per block) must come from the kernel variant"
#endif
#ifndef BF16_IN
#error "BF16_IN (1: bf16 MMA inputs, 0: f16) must come from the kernel variant"
#endif
#if IS_FLOAT
#error "gemm_mma decodes packed quantized weights; float weights go to cuBLAS"
#endif
#define NWARPS 4
#define MT 2                      // 16-row m-tiles per warp
#define BM (NWARPS * MT * 16)     // weight rows per block
#define KC 64                     // columns per chunk

__device__ __forceinline__ u32 pack2(float lo, float hi) {
  u32 r;
#if BF16_IN
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
#else
  asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
#endif
  return r;
}

// D += A B for one m16n8k16 tile (A row-major 16x16, B column-major 16x8; D f32).
__device__ __forceinline__ void mma(float* d, const u32* a, u32 b0, u32 b1) {
#if BF16_IN
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
#else
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
#endif
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Q8_0 codes are signed bytes: flipping the sign bit makes them unsigned with offset 128.
#if WTYPE == GGML_Q8_0
#define CODE_FLIP 0x80808080u
#define CODE_OFFSET 128.f
#else
#define CODE_FLIP 0u
#define CODE_OFFSET ((float)W_OFFSET)
#endif

// Weights 16 h .. 16 h + 15 of a unit, dequantized exactly as `unit_value` does. `h` differs
// between the lanes of a warp, so the unit is read through `unit_word` (whole 32-bit words
// selected by h) rather than byte by byte.
__device__ __forceinline__ void unit_half(const Unit& o, int h, float* v) {
  const float a = h ? o.a1 : o.a0, b = h ? o.b1 : o.b0;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const u32 word = unit_word(o, 4 * h + i) ^ CODE_FLIP;
#pragma unroll
    for (int k = 0; k < 4; ++k) v[4 * i + k] = a * code_f((word >> (8 * k)) & 0xffu, CODE_OFFSET) + b;
  }
}

#define XLD (KC + 8)  // row stride of a staged activation chunk, in 16-bit elements

__device__ __forceinline__ void cp_async16(void* smem, const void* gmem) {
  const u32 dst = (u32)__cvta_generic_to_shared(smem);
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(dst), "l"(gmem) : "memory");
}
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
}

// Start copying chunk c of the block's NT * 8 token rows into a stage (16 bytes per copy; token
// rows past the batch repeat the last token), as one commit group.
__device__ __forceinline__ void stage_chunk(u16 (*dst)[XLD], const GemmMmaParams& p, u32 tok0, u32 c) {
  const u16* x = reinterpret_cast<const u16*>(p.x);
  for (int i = threadIdx.x; i < NT * 8 * (KC / 8); i += NWARPS * 32) {
    const int r = i / (KC / 8), piece = i % (KC / 8);
    const u32 tok = min(tok0 + r, p.n_tokens - 1);
    cp_async16(&dst[r][8 * piece], x + (i64)tok * p.cols + (i64)c * KC + 8 * piece);
  }
  asm volatile("cp.async.commit_group;" ::: "memory");
}

// Lane (g, t) works on rows g and g + 8 of each m-tile; `units[m][h]` holds unit (2 chunk +
// t / 2) of row 16 m + g + 8 h, whose weights 16 (t & 1) .. + 15 are the lane's chunk columns.
__device__ __forceinline__ void load_chunk(const WeightRef& w, const i64* row, u32 chunk, int t, Unit (&units)[MT][2]) {
#pragma unroll
  for (int m = 0; m < MT; ++m)
#pragma unroll
    for (int h = 0; h < 2; ++h) load_unit(w, row[2 * m + h], (int)(2 * chunk + (t >> 1)), units[m][h]);
}

extern "C" __global__ void __launch_bounds__(NWARPS * 32) gemm_mma(const GemmMmaParams p) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
  const WeightRef w = {(const u8*)p.w0, (const u8*)p.w1, (const u8*)p.w2, (const u8*)p.w3, (i64)p.cols};
  const u32 row0 = blockIdx.x * BM + warp * MT * 16, tok0 = blockIdx.y * NT * 8;
  const u32 chunks = p.cols / KC, c0 = blockIdx.z * p.slice_chunks, c1 = min(chunks, c0 + p.slice_chunks);
  // Rows past the weight decode its last row and are never stored.
  i64 row[2 * MT];
#pragma unroll
  for (int i = 0; i < 2 * MT; ++i) row[i] = min(row0 + 16 * (i >> 1) + g + 8 * (i & 1), p.rows - 1);
  // The block's activations, one chunk per stage: token rows (the last token repeated past the
  // batch) of KC columns, padded so that the 8 rows of a fragment load hit different banks.
  __shared__ __align__(16) u16 s_x[2][NT * 8][XLD];

  float acc[MT][NT][4];
#pragma unroll
  for (int m = 0; m < MT; ++m)
#pragma unroll
    for (int j = 0; j < NT; ++j)
#pragma unroll
      for (int i = 0; i < 4; ++i) acc[m][j][i] = 0.f;

  Unit units[MT][2];
  if (c0 < c1) load_chunk(w, row, c0, t, units);  // weights: before the wait
  pdl_wait();
  pdl_release();
  if (c0 < c1) stage_chunk(s_x[0], p, tok0, c0);
  for (u32 c = c0; c < c1; ++c) {
    const int stage = (c - c0) & 1;
    // The next chunk's activations load while this one is used; the barrier at the end of the
    // previous iteration freed their stage.
    if (c + 1 < c1) {
      stage_chunk(s_x[stage ^ 1], p, tok0, c + 1);
      cp_async_wait<1>();
    } else {
      cp_async_wait<0>();
    }
    __syncthreads();
    // A fragments of the 4 k-steps: step s covers the lane's chunk columns 4s .. 4s + 3.
    u32 a[MT][4][4];
#pragma unroll
    for (int m = 0; m < MT; ++m) {
      float v0[16], v1[16];
      unit_half(units[m][0], t & 1, v0);
      unit_half(units[m][1], t & 1, v1);
#pragma unroll
      for (int s = 0; s < 4; ++s) {
        a[m][s][0] = pack2(v0[4 * s], v0[4 * s + 1]);
        a[m][s][1] = pack2(v1[4 * s], v1[4 * s + 1]);
        a[m][s][2] = pack2(v0[4 * s + 2], v0[4 * s + 3]);
        a[m][s][3] = pack2(v1[4 * s + 2], v1[4 * s + 3]);
      }
    }
    if (c + 1 < c1) load_chunk(w, row, c + 1, t, units);  // in flight during the MMAs
#pragma unroll
    for (int j = 0; j < NT; ++j) {
      const uint4* xs = reinterpret_cast<const uint4*>(&s_x[stage][8 * j + g][16 * t]);
      const uint4 lo = xs[0], hi = xs[1];
      const u32 b[8] = {lo.x, lo.y, lo.z, lo.w, hi.x, hi.y, hi.z, hi.w};
#pragma unroll
      for (int m = 0; m < MT; ++m)
#pragma unroll
        for (int s = 0; s < 4; ++s) mma(acc[m][j], a[m][s], b[2 * s], b[2 * s + 1]);
    }
    __syncthreads();  // every warp is done with this stage before it is refilled
  }

  // C fragment: acc[m][j] = rows (g, g + 8) x tokens (2t, 2t + 1) of tile (m, j).
  float* out = reinterpret_cast<float*>(p.out) + (i64)blockIdx.z * p.n_tokens * p.rows;
#pragma unroll
  for (int m = 0; m < MT; ++m)
#pragma unroll
    for (int j = 0; j < NT; ++j)
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const u32 r = row0 + 16 * m + g + 8 * (i >> 1), tok = tok0 + 8 * j + 2 * t + (i & 1);
        if (r < p.rows && tok < p.n_tokens) out[(i64)tok * p.rows + r] = acc[m][j][i];
      }
}
"#;

const REDUCE: &str = r#"
// out[i] = sum over slices z (in order) of partials[z][i].
extern "C" __global__ void gemm_reduce(const GemmReduceParams p) {
  KERNEL_ENTRY();
  const float* part = reinterpret_cast<const float*>(p.partials);
  float* out = reinterpret_cast<float*>(p.out);
  for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < p.n; i += (u64)gridDim.x * blockDim.x) {
    float s = 0.f;
    for (u32 z = 0; z < p.slices; ++z) s += part[z * p.n + i];
    out[i] = s;
  }
}
"#;

/// Rows of a `gemm_mma` block and columns of a chunk (`BM`, `KC` in the source).
pub const GEMM_BLOCK_ROWS: usize = 128;
pub const GEMM_CHUNK_COLS: usize = 64;

/// Compile-time shape of the small-batch tensor-core GEMM.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct GemmMmaVariant {
    pub wtype: GgmlType,
    /// 8-token n-tiles per block (2, 4 or 8).
    pub nt: u32,
    /// bf16 MMA inputs (else f16).
    pub bf16: bool,
}

impl GemmMmaVariant {
    /// The narrowest n-tiling that covers `n_tokens` in one block row (at most 64 tokens).
    pub fn for_shape(wtype: GgmlType, n_tokens: usize, bf16: bool) -> Self {
        let nt = match n_tokens {
            0..=16 => 2,
            17..=32 => 4,
            _ => 8,
        };
        GemmMmaVariant { wtype, nt, bf16 }
    }

    /// K slices (grid z): enough blocks for two per SM, each slice at least 4 chunks, at most 8.
    pub fn k_slices(&self, rows: usize, cols: usize, n_tokens: usize, sm_count: usize) -> usize {
        let blocks = rows.div_ceil(GEMM_BLOCK_ROWS) * n_tokens.div_ceil(8 * self.nt as usize);
        let chunks = cols / GEMM_CHUNK_COLS;
        (2 * sm_count).div_ceil(blocks).min(chunks / 4).clamp(1, 8)
    }

    /// Chunks per slice for `slices` slices (the last slice may be shorter).
    pub fn slice_chunks(cols: usize, slices: usize) -> usize {
        (cols / GEMM_CHUNK_COLS).div_ceil(slices)
    }

    pub fn launch_config(&self, rows: usize, n_tokens: usize, slices: usize) -> LaunchConfig {
        LaunchConfig {
            grid_dim: (blocks_for(rows, GEMM_BLOCK_ROWS), blocks_for(n_tokens, 8 * self.nt as usize), slices as u32),
            block_dim: (128, 1, 1),
            shared_mem_bytes: 0,
        }
    }
}

impl KernelVariant for GemmMmaVariant {
    const FAMILY: &'static str = "gemm_mma";
    const SOURCES: &'static [&'static str] = &[HEADER, QUANT, GemmMmaParams::C_DECL, GemmReduceParams::C_DECL, SOURCE, REDUCE];
    const ENTRY_POINTS: &'static [&'static str] = &["gemm_mma", "gemm_reduce"];

    fn macros(&self) -> Vec<(&'static str, String)> {
        vec![("WTYPE", (self.wtype as u32).to_string()), ("NT", self.nt.to_string()), ("BF16_IN", u32::from(self.bf16).to_string())]
    }
}

/// Launch geometry of `gemm_reduce` over `n` elements.
pub fn reduce_launch_config(n: usize) -> LaunchConfig {
    LaunchConfig { grid_dim: (blocks_for(n, 256).min(1024), 1, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn macros_match_source() {
        crate::kernels::tests::assert_macros_match(GemmMmaVariant { wtype: GgmlType::Q4_0, nt: 8, bf16: true });
    }

    #[test]
    fn tiling_covers_the_batch_and_fills_the_device() {
        let v = GemmMmaVariant::for_shape(GgmlType::Q4_0, 9, true);
        assert_eq!(v.nt, 2);
        assert_eq!(GemmMmaVariant::for_shape(GgmlType::Q4_0, 64, true).nt, 8);
        // 8B QKV (6144 x 4096) at 64 tokens: 48 row blocks, split 6 ways (11 chunks each).
        let v = GemmMmaVariant::for_shape(GgmlType::Q4_0, 64, true);
        let z = v.k_slices(6144, 4096, 64, 132);
        assert_eq!(z, 6);
        assert_eq!(GemmMmaVariant::slice_chunks(4096, z), 11);
        assert_eq!(v.launch_config(6144, 64, z).grid_dim, (48, 1, 6));
        // The LM head already has enough blocks; a short K never splits below 4 chunks a slice.
        assert_eq!(v.k_slices(49152, 4096, 64, 132), 1);
        assert_eq!(v.k_slices(256, 256, 64, 132), 1);
    }
}
