//! GEMV: `out[t, r] = sum_c W[r, c] * x[t, c]` for a few tokens, reading packed weights once.
//! One template per activation format for every GGML type; `WTYPE` picks the decoder from
//! `common::QUANT`, the other macros the tiling.
//!
//! ## `gemv` (f32 activations)
//!
//! Work split: a warp owns `ROWS_PER_WARP` rows; lane `l` walks the rows' 32-weight units
//! `l, l + 32, ...` (consecutive lanes read consecutive 16-byte quant chunks). Per unit it loads
//! the packed weights of all its rows first; with one token it then reads the 32 activations
//! into registers and decodes while multiplying, with several it decodes each row's codes once
//! and multiplies them with each token's activations. Block scales are applied once per half
//! unit. A warp shuffle reduction finishes each
//! output. Grid y walks token tiles of `NTOK`, so any token count works (larger counts re-read
//! the weights).
//!
//! ## `gemv_q8` (int8 activations from [`super::quantize`], quantized weights)
//!
//! Four weights per `dp4a`, block scales applied once per half unit: about a tenth of the
//! instructions of the f32 path per weight, which is what lets a decode step run at memory
//! speed. A group of `TPR` lanes (a power of two up to a warp) shares `ROWS` rows and splits
//! their units; each lane loads `UNROLL` units of every row before multiplying, so that enough
//! bytes are in flight to cover DRAM latency, and a warp-shuffle reduction ends each output (no
//! block barrier, no shared memory). Short rows (small models) use groups under a warp. The epilogue
//! adds a bias and/or a residual and writes a column range of a wider output (`out_ld`,
//! `out_col`), so a projection and its residual add are one launch.
//!
//! MoE expert GEMVs (`EXPERTS`) take the rows of a routed expert: with `EXPERTS == 1` grid y
//! walks the batch's (token, slot) pairs one by one (decode); with `EXPERTS == 2` it walks the
//! tiles `moe::moe_group` lists, up to `NTOK` pairs of one expert each, so every weight unit
//! loaded serves all the tile's pairs (prefill). Either way a pair reads activation row
//! `pair / x_div` and writes output row `pair`.

use super::common::{HEADER, QUANT};
use super::moe::GROUP_TILE;
use super::quantize::Q8_BLOCK;
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
        /// `EXPERTS`: the expert of each (token, slot) pair, `u32 [n_tokens]` (`n_tokens` counts
        /// pairs then), and the device error flag for an expert id out of range.
        pub experts: u64,
        pub error_flag: u64,
        pub rows: u32,
        pub cols: u32,
        pub n_tokens: u32,
        /// `EXPERTS`: weight rows per expert, the first row of this GEMV inside an expert (the up
        /// half of a fused `[gate; up]` bank), the expert count, and pairs per activation row
        /// (pair `i` reads row `i / x_div`: `top_k` for a per-token input, 1 for a per-pair one).
        pub expert_rows: u32,
        pub expert_off: u32,
        pub n_experts: u32,
        pub x_div: u32,
        pub pad: u32,
    }
}

device_params! {
    pub struct GemvQ8Params {
        pub w0: u64,
        pub w1: u64,
        pub w2: u64,
        pub w3: u64,
        pub xq: u64,
        pub xs: u64,
        pub out: u64,
        pub residual: u64,
        pub bias: u64,
        pub rows: u32,
        pub cols: u32,
        pub n_tokens: u32,
        pub out_ld: u32,
        pub out_col: u32,
        pub res_ld: u32,
        pub res_col: u32,
        /// `IN_NORM`: the producer's sums of squares, `[n_tokens, cols / 32]`, and the norm's eps.
        pub in_partials: u64,
        pub in_eps: f32,
        /// `EMIT == 2`: Gemma's `(1 + w)` norm convention.
        pub emit_add_one: u32,
        /// `EMIT`: int8 codes `[n_tokens, rows]` and block scales / code sums `[n_tokens, rows / 32]`
        /// of the output (see `quantize`), and with `EMIT == 2` the next norm's weight and the
        /// per-block sums of squares of the output.
        pub emit_q: u64,
        pub emit_s: u64,
        pub emit_norm: u64,
        pub emit_partials: u64,
        /// `UP_SPLIT`: the planes of the up weight (rows at the gate rows' indices).
        pub u0: u64,
        pub u1: u64,
        pub u2: u64,
        pub u3: u64,
        /// `EXPERTS`: as in [`GemvParams`].
        pub experts: u64,
        pub error_flag: u64,
        /// `EXPERTS == 2`: `moe_group`'s tile list and permutation (see [`super::moe`]).
        pub expert_tiles: u64,
        pub expert_perm: u64,
        pub expert_rows: u32,
        pub expert_off: u32,
        pub n_experts: u32,
        pub x_div: u32,
        /// `IN_F32`: one token's f32 activations and, with `IN_NORM`, their RMSNorm's weight.
        pub x32: u64,
        pub in_norm_w: u64,
        /// `IN_F32` with `IN_NORM`: Gemma's `(1 + w)` norm convention.
        pub in_add_one: u32,
        /// `DOWN`: rows of the down projection (its columns are this GEMV's `rows`).
        pub down_rows: u32,
        /// `DOWN`: the planes of the down projection.
        pub d0: u64,
        pub d1: u64,
        pub d2: u64,
        pub d3: u64,
    }
}

const SOURCE_Q8: &str = r#"
#ifndef NWARPS
#error "NWARPS (warps per block) must come from the kernel variant"
#endif
#ifndef TPR
#error "TPR (lanes sharing a row group: a power of two up to 32) must come from the kernel variant"
#endif
#ifndef ROWS
#error "ROWS (rows per lane group) must come from the kernel variant"
#endif
#ifndef UNROLL
#error "UNROLL (units per row a lane loads before multiplying) must come from the kernel variant"
#endif
#ifndef NTOK
#error "NTOK (tokens per grid-y tile) must come from the kernel variant"
#endif
#ifndef RESIDUAL
#error "RESIDUAL (0/1: add a residual in the epilogue) must come from the kernel variant"
#endif
#ifndef BIAS
#error "BIAS (0/1: add a bias in the epilogue) must come from the kernel variant"
#endif
#ifndef GLU
#error "GLU (0 none, 1 SwiGLU, 2 GeGLU over [gate | up] weight rows) must come from the kernel variant"
#endif
#ifndef IN_NORM
#error "IN_NORM (1: the activations are codes of x * norm weight; finish the RMSNorm from in_partials) must come from the kernel variant"
#endif
#ifndef EMIT
#error "EMIT (0 none, 1 int8 blocks of the output, 2 of the output times the next norm's weight, with sums of squares) must come from the kernel variant"
#endif
#ifndef KSPLIT
#error "KSPLIT (slices of NWARPS warps splitting each row's units; partial sums meet in shared memory) must come from the kernel variant"
#endif
#ifndef UP_SPLIT
#error "UP_SPLIT (1: with GLU, the up rows come from a second weight (u0..u3) at the gate rows' indices) must come from the kernel variant"
#endif
#ifndef EXPERTS
#error "EXPERTS (1: grid y walks (token, slot) pairs, each multiplying the rows of its pair's expert, read from device memory; 2: grid y walks moe_group's tiles of up to NTOK pairs of one expert) must come from the kernel variant"
#endif
#ifndef IN_F32
#error "IN_F32 (0, or the 32-value blocks each group of 8 lanes quantizes: the activations are one token's f32 row x32, quantized (times in_norm_w with IN_NORM) by every block into shared memory) must come from the kernel variant"
#endif
#ifndef DOWN
#error "DOWN (0, or the down-projection rows per thread: the fused MLP, see down_red) must come from the kernel variant"
#endif
#ifndef EARLY_RELEASE
#error "EARLY_RELEASE (1: release the next launch before waiting for the previous one, see gemv_q8) must come from the kernel variant"
#endif
#define ROWS_PER_BLOCK (NWARPS * 32 / TPR * ROWS)
#define SLICE_THREADS (NWARPS * 32)
#if IN_F32 && (NTOK != 1 || EXPERTS)
#error "IN_F32 quantizes one token's row of a plain GEMV"
#endif
#if DOWN && (NTOK != 1 || !GLU || EMIT || RESIDUAL || BIAS || EXPERTS || ROWS_PER_BLOCK % 32 != 0)
#error "DOWN follows a one-token GLU whose blocks own whole 32-value units of the down projection's columns"
#endif
#if EMIT && ROWS_PER_BLOCK % 32 != 0
#error "EMIT needs blocks that own whole 32-row quantization blocks"
#endif
#if UP_SPLIT && !GLU
#error "UP_SPLIT needs GLU"
#endif
#if EXPERTS == 1 && NTOK != 1
#error "EXPERTS == 1 runs one pair per grid-y tile"
#endif
#if EXPERTS && (IN_NORM || EMIT || RESIDUAL || BIAS)
#error "EXPERTS runs without hand-offs, bias or residual"
#endif

// Accumulators per lane group: ROWS output rows, or with GLU their gate rows then their up rows
// (the fused weight is [gate; up], p.rows output rows each).
#if GLU
#define WROWS (2 * ROWS)
#else
#define WROWS ROWS
#endif
// Weight row of accumulator i: its expert's first row (ebase, 0 without EXPERTS) plus the row,
// for an up accumulator of a fused [gate; up] weight p.rows further on.
__device__ __forceinline__ i64 weight_row(const GemvQ8Params& p, i64 ebase, i64 row0, int i) {
  const i64 row = min(row0 + i % ROWS, (i64)p.rows - 1);  // past the end: a safe re-read
  return ebase + (GLU && !UP_SPLIT && i >= ROWS ? (i64)p.rows + row : row);
}

// Output row of token t of the block's tile (p.n_tokens or more past its end): with EXPERTS == 2
// the pair moe_group placed there. Its activation row: with EXPERTS a (token, slot) pair reads
// row pair / x_div (its token's row for the gate/up GEMV, its own for the down GEMV).
#if EXPERTS == 2
#define TOK(t) pair[t]
#else
#define TOK(t) (tok0 + (t))
#endif
#if EXPERTS
#define XROW(t) (TOK(t) / (int)p.x_div)
#else
#define XROW(t) TOK(t)
#endif

// The epilogue's and the norm's inputs, requested as soon as they may be read (see gemv_q8) so
// that their loads overlap the main loop's instead of adding round trips after the reduction.
// Only the lanes that use them load them (bias and residual: lane k == 0 of slice 0; the norm
// sums: every lane of slice 0, the only one that finishes the norm; the next norm's weight:
// every lane).
#define NORM_PARTS (NTOK == 1 ? 4 : 1)
struct Prefetched {
  float bias[ROWS];         // BIAS: the rows' biases
  float res[ROWS][NTOK];    // RESIDUAL: the rows' residuals
  float ss[NTOK][NORM_PARTS];  // IN_NORM: the producer's sums of squares lane, lane + 32, ...
  float emit_g[ROWS_PER_BLOCK >= 32 ? ROWS_PER_BLOCK / 32 : 1];  // EMIT == 2: the next norm's weight, row 32 c + lane
};

// Before the wait: weights only (the next norm's weight).
__device__ __forceinline__ void prefetch_weights(const GemvQ8Params& p, Prefetched& f) {
#if EMIT == 2
  const int lane = threadIdx.x & 31;
#pragma unroll
  for (int c = 0; c < ROWS_PER_BLOCK / 32; ++c) {
    const i64 row = (i64)blockIdx.x * ROWS_PER_BLOCK + 32 * c + lane;
    f.emit_g[c] = row < p.rows ? reinterpret_cast<const float*>(p.emit_norm)[row] : 0.f;
  }
#endif
}

// After the wait: what earlier kernels wrote (the residual, the norm's sums) and the bias.
__device__ __forceinline__ void prefetch_inputs(const GemvQ8Params& p, Prefetched& f, i64 row0, int tok0, bool epilogue_lane, bool norm_lane, const float* in_partials) {
#if BIAS || RESIDUAL
  if (epilogue_lane) {
#pragma unroll
    for (int r = 0; r < ROWS; ++r) {
      const i64 row = min(row0 + r, (i64)p.rows - 1);
#if BIAS
      f.bias[r] = reinterpret_cast<const float*>(p.bias)[row];
#endif
#if RESIDUAL
#pragma unroll
      for (int t = 0; t < NTOK; ++t) {
        const int tok = min(tok0 + t, (int)p.n_tokens - 1);
        f.res[r][t] = reinterpret_cast<const float*>(p.residual)[(i64)tok * p.res_ld + p.res_col + row];
      }
#endif
    }
  }
#endif
#if IN_NORM
  {
    const int lane = threadIdx.x & 31, units = (int)(p.cols / 32);
#pragma unroll
    for (int t = 0; t < NTOK; ++t)
#pragma unroll
      for (int k = 0; k < NORM_PARTS; ++k) {
        const int i = lane + 32 * k;
        f.ss[t][k] = norm_lane && tok0 + t < (int)p.n_tokens && i < units ? in_partials[(i64)(tok0 + t) * units + i] : 0.f;
      }
  }
#endif
}

// Adds bias and residual (prefetched for row r, token tile slot t), stores, and returns the
// stored value.
__device__ __forceinline__ float store_q8(const GemvQ8Params& p, const Prefetched& f, i64 row, int tok, int r, int t, float s) {
  if (row >= p.rows || tok >= (int)p.n_tokens) return s;
#if BIAS
  s += f.bias[r];
#endif
#if RESIDUAL
  s += f.res[r][t];
#endif
  reinterpret_cast<float*>(p.out)[(i64)tok * p.out_ld + p.out_col + row] = s;
  return s;
}

#if EMIT
// The int8 hand-off: the block's outputs (staged in shared memory) become the next GEMV's int8
// activations, one 32-row block (a job) per warp turn. With EMIT == 2 the codes are of the output
// times the next RMSNorm's weight, and each block's sum of squares goes out beside them:
// quantization is scale-invariant, so the consumer applies 1 / rms once to its dot products
// (IN_NORM). The sums are taken by the warps half the block further on than the codes, so the
// two chains of a job run side by side (up to half as many jobs as warps).
__device__ __forceinline__ i64 emit_block(const GemvQ8Params& p, int job, int tok0) {
  const int t = job / (ROWS_PER_BLOCK / 32), c = job % (ROWS_PER_BLOCK / 32);
  const i64 row0 = (i64)blockIdx.x * ROWS_PER_BLOCK + 32 * c;
  return tok0 + t >= (int)p.n_tokens || row0 >= p.rows ? -1 : (i64)(tok0 + t) * (p.rows / 32) + row0 / 32;
}
__device__ __forceinline__ void emit_q8(const GemvQ8Params& p, const Prefetched& f, const float (*staged)[ROWS_PER_BLOCK], int tok0) {
  constexpr int jobs = NTOK * (ROWS_PER_BLOCK / 32), warps = NWARPS * KSPLIT;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#define STAGED(job) staged[(job) / (ROWS_PER_BLOCK / 32)][32 * ((job) % (ROWS_PER_BLOCK / 32)) + lane]
#if EMIT == 2
  for (int job = (warp + warps / 2) % warps; job < jobs; job += warps) {
    const i64 blk = emit_block(p, job, tok0);
    if (blk < 0) continue;  // warp-uniform
    const float v = STAGED(job);
    const float ss = warp_sum(v * v);
    if (lane == 0) reinterpret_cast<float*>(p.emit_partials)[blk] = ss;
  }
#endif
  for (int job = warp; job < jobs; job += warps) {
    const i64 blk = emit_block(p, job, tok0);
    if (blk < 0) continue;  // warp-uniform
    float v = STAGED(job);
#if EMIT == 2
    const float g = f.emit_g[job % (ROWS_PER_BLOCK / 32)];
    v *= p.emit_add_one ? 1.f + g : g;
#endif
    quantize_block_warp(v, lane, reinterpret_cast<i8*>(p.emit_q) + blk * 32, reinterpret_cast<uint2*>(p.emit_s) + blk);
  }
#undef STAGED
}
#endif

#if IN_F32
#define IN_F32_GROUPS (SLICE_THREADS * KSPLIT / 8)
#define IN_F32_UNITS (IN_F32 * IN_F32_GROUPS)
// The four values of the row thread `threadIdx.x` quantizes in its r-th 32-value block.
__device__ __forceinline__ int in_f32_index(int r, int units) {
  return 8 * min((int)(threadIdx.x >> 3) + r * IN_F32_GROUPS, units - 1) + (threadIdx.x & 7);
}
// Before the wait: the norm's weight at those values (a weight: no earlier kernel writes it).
__device__ __forceinline__ void prefetch_in_norm(const GemvQ8Params& p, float4 (&g)[IN_F32]) {
#pragma unroll
  for (int r = 0; r < IN_F32; ++r) {
#if IN_NORM
    const float4 w = reinterpret_cast<const float4*>(p.in_norm_w)[in_f32_index(r, (int)(p.cols / 32))];
    const float one = p.in_add_one ? 1.f : 0.f;
    g[r] = make_float4(one + w.x, one + w.y, one + w.z, one + w.w);
#else
    g[r] = make_float4(1.f, 1.f, 1.f, 1.f);
#endif
  }
}
// After the wait: the consumer makes its own int8 hand-off. The block's groups of 8 lanes
// quantize the 32-value blocks of the token's f32 row (times the norm's weight `g`, each block's
// sum of squares beside it, as `emit_q8` does), group i the blocks i, i + groups, ..., into
// shared memory; every load is issued first, and a lane's blocks share the shuffle steps.
__device__ __forceinline__ void quantize_input(const GemvQ8Params& p, const float4 (&g)[IN_F32], u32* s_q, uint2* s_s, float* s_ss) {
  const int lane = threadIdx.x & 31, group = threadIdx.x >> 3, units = (int)(p.cols / 32);
  float4 x[IN_F32], q[IN_F32];
#pragma unroll
  for (int r = 0; r < IN_F32; ++r) x[r] = reinterpret_cast<const float4*>(p.x32)[in_f32_index(r, units)];
#pragma unroll
  for (int r = 0; r < IN_F32; ++r) q[r] = make_float4(x[r].x * g[r].x, x[r].y * g[r].y, x[r].z * g[r].z, x[r].w * g[r].w);
  u32 word[IN_F32];
  uint2 scale[IN_F32];
  quantize_blocks_group8(q, lane, word, scale);
#if IN_NORM
  float ss[IN_F32];
#pragma unroll
  for (int r = 0; r < IN_F32; ++r) ss[r] = x[r].x * x[r].x + x[r].y * x[r].y + x[r].z * x[r].z + x[r].w * x[r].w;
#pragma unroll
  for (int o = 1; o < 8; o <<= 1)
#pragma unroll
    for (int r = 0; r < IN_F32; ++r) ss[r] += __shfl_xor_sync(FULL_MASK, ss[r], o);
#endif
#pragma unroll
  for (int r = 0; r < IN_F32; ++r) {
    const int u = group + r * IN_F32_GROUPS;
    if (u >= units) continue;
    s_q[8 * u + (lane & 7)] = word[r];
    if ((lane & 7) == 0) {
      s_s[u] = scale[r];
#if IN_NORM
      s_ss[u] = ss[r];
#endif
    }
  }
  __syncthreads();
}
#endif

#if DOWN
// The fused MLP: the block's GLU outputs are columns blockIdx.x * ROWS_PER_BLOCK + ... of the
// down projection's input. The block quantizes them as the gated GEMV's int8 hand-off to the
// down projection would, multiplies them by those columns of every down row and adds the
// products into `out`, which holds the residual stream (one atomic add per row and block: the
// sum's order varies from run to run in the last bits). Thread i takes the rows i, i + threads,
// ...; its units are loaded before the wait.
#define DOWN_UNITS (ROWS_PER_BLOCK / 32)
__device__ __forceinline__ void prefetch_down(const GemvQ8Params& p, Unit (&dw)[DOWN][DOWN_UNITS]) {
  const WeightRef w = {(const u8*)p.d0, (const u8*)p.d1, (const u8*)p.d2, (const u8*)p.d3, (i64)p.rows};
#pragma unroll
  for (int i = 0; i < DOWN; ++i)
#pragma unroll
    for (int c = 0; c < DOWN_UNITS; ++c)
      load_unit(w, min((i64)threadIdx.x + i * SLICE_THREADS * KSPLIT, (i64)p.down_rows - 1), blockIdx.x * DOWN_UNITS + c, dw[i][c]);
}
__device__ __forceinline__ void down_red(const GemvQ8Params& p, const Unit (&dw)[DOWN][DOWN_UNITS], const int4* hq, const uint2* hs) {
  float* out = reinterpret_cast<float*>(p.out);
#pragma unroll
  for (int i = 0; i < DOWN; ++i) {
    const i64 row = (i64)threadIdx.x + i * SLICE_THREADS * KSPLIT;
    if (row < p.down_rows) {
      float s = 0.f;
#pragma unroll
      for (int c = 0; c < DOWN_UNITS; ++c) {
        const uint2 sc = hs[c];
        const float sq0 = (float)(int)(short)(sc.y & 0xffffu), sq1 = (float)((int)sc.y >> 16);
        s += unit_dot_q8(dw[i][c], hq[2 * c], hq[2 * c + 1], __uint_as_float(sc.x), sq0, sq1);
      }
      atomicAdd(out + row, s);
    }
  }
}
#endif

extern "C" __global__ void __launch_bounds__(SLICE_THREADS * KSPLIT) gemv_q8(const GemvQ8Params p) {
  // Slice `slice` of the block takes every KSPLIT-th batch of units of the block's rows.
  const int tid = threadIdx.x % SLICE_THREADS, slice = threadIdx.x / SLICE_THREADS, k = tid % TPR, group = tid / TPR;
  const i64 row0 = ((i64)blockIdx.x * (NWARPS * 32 / TPR) + group) * ROWS;
  const int tok0 = blockIdx.y * NTOK;
  const WeightRef w = {(const u8*)p.w0, (const u8*)p.w1, (const u8*)p.w2, (const u8*)p.w3, (i64)p.cols};
#if UP_SPLIT
  const WeightRef wup = {(const u8*)p.u0, (const u8*)p.u1, (const u8*)p.u2, (const u8*)p.u3, (i64)p.cols};
#define WEIGHT_OF(r) ((r) >= ROWS ? wup : w)
#else
#define WEIGHT_OF(r) w
#endif
  const int units = (int)(p.cols / 32);
#if IN_F32
  __shared__ int4 s_xq[2 * IN_F32_UNITS];
  __shared__ uint2 s_xs[IN_F32_UNITS];
  __shared__ float s_ss[IN_F32_UNITS];
  const int4* xq = s_xq;
  const uint2* xs = s_xs;
  const float* in_partials = s_ss;
#else
  const int4* xq = reinterpret_cast<const int4*>(p.xq);
  const uint2* xs = reinterpret_cast<const uint2*>(p.xs);
  const float* in_partials = reinterpret_cast<const float*>(p.in_partials);
#endif

  float acc[WROWS][NTOK];
#pragma unroll
  for (int r = 0; r < WROWS; ++r)
#pragma unroll
    for (int t = 0; t < NTOK; ++t) acc[r][t] = 0.f;

  // Lanes never leave early: the reduction below shuffles across the whole warp. The first
  // batch of weights is requested before waiting for the previous kernel (see pdl_wait): the
  // weights stream in while that kernel finishes. Right after the wait the epilogue's inputs
  // are requested too, so they arrive with the activations. With EXPERTS the rows depend on the
  // routing (an earlier kernel's output), so the block waits first.
  Prefetched pre;
  prefetch_weights(p, pre);
#if DOWN
  Unit dw[DOWN][DOWN_UNITS];
  prefetch_down(p, dw);
#endif
#if IN_F32
  float4 in_g[IN_F32];
  prefetch_in_norm(p, in_g);
#endif
  bool waited = false;
#if EARLY_RELEASE
  // The next launch may be scheduled now, before this one waits: its blocks become resident and
  // load their weights while this kernel's predecessor finishes (the launch plan never lets two
  // such kernels follow each other, so at most three grids are resident at once).
  pdl_release();
#endif
  const auto wait_then_prefetch = [&]() {
    pdl_wait();
#if !EARLY_RELEASE
    pdl_release();
#endif
    waited = true;
#if IN_F32
    quantize_input(p, in_g, reinterpret_cast<u32*>(s_xq), s_xs, s_ss);
#endif
    prefetch_inputs(p, pre, row0, tok0, k == 0 && slice == 0, slice == 0, in_partials);
  };
  i64 ebase = 0;
#if EXPERTS
  wait_then_prefetch();
#if EXPERTS == 2
  // Tile y: (expert | pairs << 16, first place in the permutation). The grid covers the worst
  // case; past the batch's tiles (no pairs) the whole block leaves, before any barrier.
  const uint2 tile = reinterpret_cast<const uint2*>(p.expert_tiles)[blockIdx.y];
  const u32 expert = tile.x & 0xffffu, count = tile.x >> 16;
  if (count == 0) return;
  int pair[NTOK];
#pragma unroll
  for (int t = 0; t < NTOK; ++t) pair[t] = t < (int)count ? (int)reinterpret_cast<const u32*>(p.expert_perm)[tile.y + t] : (int)p.n_tokens;
  // Ids out of range come as the bucket n_experts (moe_group reported them): NaN outputs.
  const bool bad_expert = expert >= p.n_experts;
#else
  const u32 expert = reinterpret_cast<const u32*>(p.experts)[blockIdx.y];
  // An id out of range is never used as an index: the pair's outputs become NaN, the flag says why.
  const bool bad_expert = expert >= p.n_experts;
  if (bad_expert && tid == 0 && blockIdx.x == 0) report_error(p.error_flag, ERR_EXPERT_ID, expert);
#endif
  if (!bad_expert) ebase = (i64)expert * p.expert_rows + p.expert_off;
#endif
  // With IN_F32 every thread takes the first batch (whose math the unit checks guard), so that
  // all of them meet at the prologue's barrier in wait_then_prefetch.
  {
    const int u_first = k + slice * TPR * UNROLL;
    for (int u0 = u_first; (IN_F32 && u0 == u_first) || (row0 < p.rows && u0 < units); u0 += TPR * UNROLL * KSPLIT) {
      // Issue all UNROLL x ROWS weight loads before any math, so that each lane keeps that many
      // bytes in flight. Indices past the end are clamped (a safe re-read, never used).
      Unit wu[UNROLL][WROWS];
#pragma unroll
      for (int j = 0; j < UNROLL; ++j)
#pragma unroll
        for (int r = 0; r < WROWS; ++r) load_unit(WEIGHT_OF(r), weight_row(p, ebase, row0, r), min(u0 + j * TPR, units - 1), wu[j][r]);
      if (!waited) wait_then_prefetch();
#pragma unroll
      for (int t = 0; t < NTOK; ++t) {
        if (TOK(t) < (int)p.n_tokens) {
          int4 xa[UNROLL], xb[UNROLL];
          uint2 sc[UNROLL];
#pragma unroll
          for (int j = 0; j < UNROLL; ++j) {
            const i64 blk = (i64)XROW(t) * units + min(u0 + j * TPR, units - 1);
            xa[j] = xq[2 * blk];
            xb[j] = xq[2 * blk + 1];
            sc[j] = xs[blk];
          }
#pragma unroll
          for (int j = 0; j < UNROLL; ++j) {
            if (u0 + j * TPR < units) {
              const float dx = __uint_as_float(sc[j].x);
              const float sq0 = (float)(int)(short)(sc[j].y & 0xffffu), sq1 = (float)((int)sc[j].y >> 16);
#pragma unroll
              for (int r = 0; r < WROWS; ++r) acc[r][t] += unit_dot_q8(wu[j][r], xa[j], xb[j], dx, sq0, sq1);
            }
          }
        }
      }
    }
  }

  if (!waited) wait_then_prefetch();

#if IN_NORM
  // The producer's RMSNorm is finished below from its per-block sums of squares: the lanes' shares
  // are summed over the warp (in the same order by every warp) in the shuffle rounds of the dot
  // products, two independent chains side by side instead of one after the other.
  float ss[NTOK];
#pragma unroll
  for (int t = 0; t < NTOK; ++t) {
    ss[t] = 0.f;
#pragma unroll
    for (int part = 0; part < NORM_PARTS; ++part) ss[t] += pre.ss[t][part];  // 0 past the sums (exact)
    if (slice == 0 && tok0 + t < (int)p.n_tokens)
      for (int i = (tid & 31) + 32 * NORM_PARTS; i < units; i += 32) ss[t] += in_partials[(i64)(tok0 + t) * units + i];
  }
#pragma unroll
  for (int o = 16; o >= TPR; o >>= 1)  // the rounds across lane groups (TPR < 32)
#pragma unroll
    for (int t = 0; t < NTOK; ++t) ss[t] += __shfl_xor_sync(FULL_MASK, ss[t], o);
#endif
  // A group is TPR consecutive lanes of one warp: xor offsets below TPR stay inside it.
#pragma unroll
  for (int o = TPR / 2; o > 0; o >>= 1) {
#pragma unroll
    for (int r = 0; r < WROWS; ++r)
#pragma unroll
      for (int t = 0; t < NTOK; ++t) acc[r][t] += __shfl_xor_sync(FULL_MASK, acc[r][t], o);
#if IN_NORM
#pragma unroll
    for (int t = 0; t < NTOK; ++t) ss[t] += __shfl_xor_sync(FULL_MASK, ss[t], o);
#endif
  }
#if KSPLIT > 1
  // The other slices' sums, added by slice 0 in slice order (deterministic).
  __shared__ float s_part[KSPLIT - 1][SLICE_THREADS / TPR][WROWS][NTOK];
  if (slice > 0 && k == 0)
#pragma unroll
    for (int r = 0; r < WROWS; ++r)
#pragma unroll
      for (int t = 0; t < NTOK; ++t) s_part[slice - 1][group][r][t] = acc[r][t];
  __syncthreads();
  if (slice == 0 && k == 0)
    for (int s = 0; s < KSPLIT - 1; ++s)
#pragma unroll
      for (int r = 0; r < WROWS; ++r)
#pragma unroll
        for (int t = 0; t < NTOK; ++t) acc[r][t] += s_part[s][group][r][t];
#endif
#if IN_NORM
  // 1 / rms per token (slice 0 holds the sums: warp-uniform), in approximate arithmetic: no
  // slow-path branches in the chain, and 2 ulp are far below the int8 codes' error.
  if (slice == 0)
#pragma unroll
    for (int t = 0; t < NTOK; ++t) {
      const float inv = rsqrtf(__fdividef(ss[t], (float)p.cols) + p.in_eps);
#pragma unroll
      for (int r = 0; r < WROWS; ++r) acc[r][t] *= inv;
    }
#endif
#if EMIT
  __shared__ float staged[NTOK][ROWS_PER_BLOCK];
#endif
#if DOWN
  __shared__ float s_h[ROWS_PER_BLOCK];
#endif
  if (k == 0 && slice == 0) {
#pragma unroll
    for (int r = 0; r < ROWS; ++r)
#pragma unroll
      for (int t = 0; t < NTOK; ++t) {
#if GLU
        // x / (1 + e^-z) with an approximate division, as the norm above: no branch per row.
        const float x = acc[r][t];
        float v = __fdividef(x, 1.f + expf(GLU == 1 ? -x : -gelu_tanh_z(x))) * acc[ROWS + r][t];
#else
        float v = acc[r][t];
#endif
#if EXPERTS
        if (bad_expert) v = QNAN;
#endif
#if DOWN
        s_h[group * ROWS + r] = row0 + r < p.rows ? v : 0.f;
#else
        const float stored = store_q8(p, pre, row0 + r, TOK(t), r, t, v);
#if EMIT
        staged[t][group * ROWS + r] = stored;
#endif
#endif
      }
  }
#if EMIT
  __syncthreads();
  emit_q8(p, pre, staged, tok0);
#endif
#if DOWN
  __shared__ int4 s_hq[2 * DOWN_UNITS];
  __shared__ uint2 s_hs[DOWN_UNITS];
  __syncthreads();
  for (int c = threadIdx.x >> 5; c < DOWN_UNITS; c += NWARPS * KSPLIT) quantize_block_warp(s_h[32 * c + (threadIdx.x & 31)], threadIdx.x & 31, reinterpret_cast<i8*>(s_hq) + 32 * c, s_hs + c);
  __syncthreads();
  down_red(p, dw, s_hq, s_hs);
#endif
}
"#;


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
#ifndef EXPERTS
#error "EXPERTS (1: grid y walks (token, slot) pairs, each multiplying the rows of its pair's expert, read from device memory) must come from the kernel variant"
#endif
#if EXPERTS && NTOK != 1
#error "EXPERTS runs one pair per grid-y tile"
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
  KERNEL_ENTRY();
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const i64 row0 = ((i64)blockIdx.x * NWARPS + warp) * ROWS_PER_WARP;
  const int tok0 = blockIdx.y * NTOK;
  // Warp-uniform exit; the kernel has no block-level barrier.
  if (row0 >= p.rows) return;
  const WeightRef w = {(const u8*)p.w0, (const u8*)p.w1, (const u8*)p.w2, (const u8*)p.w3, (i64)p.cols};
  const float* x = reinterpret_cast<const float*>(p.x);
  const int units = (int)(p.cols / 32);
  // The first weight row (of the pair's expert with EXPERTS) and the activation row.
  i64 ebase = 0;
  int xrow = tok0;
#if EXPERTS
  const u32 expert = reinterpret_cast<const u32*>(p.experts)[blockIdx.y];
  // An id out of range is never used as an index: the pair's outputs become NaN, the flag says why.
  const bool bad_expert = expert >= p.n_experts;
  if (bad_expert && lane == 0 && row0 == 0) report_error(p.error_flag, ERR_EXPERT_ID, expert);
  if (!bad_expert) ebase = (i64)expert * p.expert_rows + p.expert_off;
  xrow = tok0 / (int)p.x_div;
#endif

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
    for (int r = 0; r < ROWS_PER_WARP; ++r) load_unit(w, ebase + min(row0 + r, (i64)p.rows - 1), u, wu[r]);
#if NTOK == 1
    // One token: decode while multiplying.
    float xv[32];
    load_x(x + (i64)xrow * p.cols + (i64)u * 32, xv);
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
      float v = warp_sum(acc[r][t]);
#if EXPERTS
      if (bad_expert) v = QNAN;
#endif
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
    /// Grid y walks (token, slot) pairs of a MoE FFN, each on its routed expert's rows.
    pub experts: bool,
}

impl GemvVariant {
    /// Tiling for `n_tokens` tokens: token tiles up to 8. More rows per warp share each
    /// activation load, at the price of registers (packed units, plus `rows x NTOK`
    /// accumulators); f32 units are the bulkiest.
    pub fn for_shape(wtype: GgmlType, n_tokens: usize) -> Self {
        let ntok = n_tokens.clamp(1, 8).next_power_of_two() as u32;
        let rows_per_warp = if ntok <= 2 && wtype != GgmlType::F32 { 4 } else { 2 };
        GemvVariant { wtype, nwarps: 4, rows_per_warp, ntok, experts: false }
    }

    /// The expert GEMV of a MoE FFN: one (token, slot) pair per grid-y tile.
    pub fn for_experts(wtype: GgmlType) -> Self {
        GemvVariant { experts: true, ..Self::for_shape(wtype, 1) }
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
            ("EXPERTS", u32::from(self.experts).to_string()),
        ]
    }
}

/// Compile-time shape of the int8-activation GEMV.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct GemvQ8Variant {
    pub wtype: GgmlType,
    pub nwarps: u32,
    /// Lanes sharing one row group (a power of two, at most 32).
    pub tpr: u32,
    pub rows: u32,
    pub unroll: u32,
    pub ntok: u32,
    pub residual: bool,
    pub bias: bool,
    /// Gated activation over `[gate; up]` weight rows: 0 none, 1 SwiGLU, 2 GeGLU.
    pub glu: u32,
    /// The activations are codes of `x * norm weight` from an int8 hand-off: finish the norm.
    pub in_norm: bool,
    /// Also quantize the output for the next GEMV: 0 no, 1 as is, 2 times the next norm's weight.
    pub emit: u32,
    /// Slices of `nwarps` warps that split each row's units (a block of `nwarps * 32 * k_split`
    /// threads); see [`Self::split_k`].
    pub k_split: u32,
    /// With `glu`: the up rows come from a second weight of the same type (split gate and up).
    pub up_split: bool,
    /// Whether grid y walks a MoE FFN's (token, slot) pairs on their routed experts' rows.
    pub experts: ExpertGrid,
    /// One token's f32 activations, quantized by every block itself: 0, or the 32-value blocks
    /// each group of 8 lanes quantizes (see [`Self::with_f32_input`]).
    pub in_f32: u32,
    /// The fused MLP: 0, or the down-projection rows each thread multiplies (see
    /// [`Self::with_down`]).
    pub down: u32,
    /// Release the next launch before waiting for the previous one ([`Epilogue::early_release`]).
    ///
    /// [`Epilogue::early_release`]: crate::ops::Epilogue::early_release
    pub early_release: bool,
}

/// What grid y of the int8 GEMV walks (the `EXPERTS` macro).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ExpertGrid {
    /// Tiles of `ntok` tokens of one weight.
    Off = 0,
    /// One (token, slot) pair per tile, on its expert's rows (decode).
    Pairs = 1,
    /// `moe_group`'s tiles of up to `ntok` pairs of one expert (prefill).
    Grouped = 2,
}

impl GemvQ8Variant {
    const NWARPS: usize = 4;

    /// Tiling for a `rows x cols` weight and `n_tokens` tokens on a GPU with `sm_count` SMs.
    /// Lanes per row: the units of a row, up to a warp. Units loaded per lane and row: up to 2
    /// (measured on the 8B QKV shape, `kernel_bench decode`: 4 units per lane and row took 122
    /// registers and ran 18% slower than 2 at 56, which keep more warps resident).
    /// Rows per group: as many (4, 2, 1) as the register budget for loaded units allows while
    /// the grid still has two blocks per SM, since every extra row shares the activation loads.
    pub fn for_shape(wtype: GgmlType, rows: usize, cols: usize, n_tokens: usize, sm_count: u32) -> Self {
        let units = (cols / 32).max(1);
        let tpr = units.next_power_of_two().min(32);
        let unroll = units.div_ceil(tpr).min(2);
        let ntok = n_tokens.clamp(1, 8).next_power_of_two();
        let groups = Self::NWARPS * 32 / tpr;
        let token_tiles = n_tokens.max(1).div_ceil(ntok);
        let rows_per_group = [4, 2, 1]
            .into_iter()
            .filter(|&r| r * unroll <= Self::unit_budget(wtype) && r * ntok <= 16)
            .find(|&r| rows.div_ceil(groups * r) * token_tiles >= 2 * sm_count as usize)
            .unwrap_or(1);
        GemvQ8Variant {
            wtype,
            nwarps: Self::NWARPS as u32,
            tpr: tpr as u32,
            rows: rows_per_group as u32,
            unroll: unroll as u32,
            ntok: ntok as u32,
            residual: false,
            bias: false,
            glu: 0,
            in_norm: false,
            emit: 0,
            k_split: 1,
            up_split: false,
            experts: ExpertGrid::Off,
            in_f32: 0,
            down: 0,
            early_release: false,
        }
    }

    /// The expert GEMV of a MoE FFN over `pairs` (token, slot) pairs, `out_rows` outputs per
    /// pair (with `glu` each reads a gate and an up row): one pair per grid-y tile, the tiling of
    /// a one-token GEMV over all the pairs' rows.
    pub fn for_experts(wtype: GgmlType, out_rows: usize, cols: usize, pairs: usize, sm_count: u32, glu: u32) -> Self {
        let rows = out_rows * pairs.max(1);
        let v = if glu > 0 { Self::for_gated(wtype, rows, cols, 1, sm_count, glu) } else { Self::for_shape(wtype, rows, cols, 1, sm_count) };
        GemvQ8Variant { experts: ExpertGrid::Pairs, ..v }
    }

    /// The grouped expert GEMV over `tiles` tiles of up to [`GROUP_TILE`] pairs of one expert,
    /// `out_rows` outputs per pair: the tiling of a GEMV of that many token tiles.
    pub fn for_grouped_experts(wtype: GgmlType, out_rows: usize, cols: usize, tiles: usize, sm_count: u32, glu: u32) -> Self {
        let tokens = tiles.max(1) * GROUP_TILE;
        let v = if glu > 0 { Self::for_gated(wtype, out_rows, cols, tokens, sm_count, glu) } else { Self::for_shape(wtype, out_rows, cols, tokens, sm_count) };
        GemvQ8Variant { experts: ExpertGrid::Grouped, ntok: GROUP_TILE as u32, ..v }
    }

    /// Loaded units per lane: small for types whose unit carries several 16-byte vectors.
    fn unit_budget(wtype: GgmlType) -> usize {
        match wtype {
            GgmlType::Q4_0 | GgmlType::Q4_1 | GgmlType::Q5_0 | GgmlType::Q5_1 => 8,
            _ => 4,
        }
    }

    /// The tiling when the epilogue also quantizes the output (`emit` 1 or 2): a block owns one
    /// 32-row quantization block. As many rows per group as the unit budget allows (up to 4, so
    /// at most 16 warps per block), then fewer units per lane to stay within it.
    pub fn emitting(self, emit: u32) -> Self {
        let groups_per_warp = (32 / self.tpr) as usize;
        let weight_rows = if self.glu > 0 { 2 } else { 1 };
        // A one-token gated group of the small (Q4-family) units may hold twice the budget: its
        // gate and up units (measured on the 8B gate/up, `kernel_bench decode`: 16 units per
        // lane at 128 registers ran 6% faster than 8).
        let budget = match Self::unit_budget(self.wtype) {
            8 if self.glu > 0 && self.ntok == 1 => 16,
            b => b,
        };
        let rows = [4, 2, 1]
            .into_iter()
            .find(|&r| groups_per_warp * r <= 32 && r * weight_rows <= budget && r * self.ntok as usize <= 16)
            .unwrap_or(1);
        let unroll = (budget / (rows * weight_rows)).clamp(1, self.unroll as usize);
        let nwarps = (32 / (groups_per_warp * rows)).max(1);
        GemvQ8Variant { rows: rows as u32, unroll: unroll as u32, nwarps: nwarps as u32, emit, ..self }
    }

    /// [`Self::for_shape`] for a gated linear with `out_rows` outputs: each output reads a gate
    /// and an up row, so half as many outputs per group keep the register budget.
    pub fn for_gated(wtype: GgmlType, out_rows: usize, cols: usize, n_tokens: usize, sm_count: u32, glu: u32) -> Self {
        let v = Self::for_shape(wtype, 2 * out_rows, cols, n_tokens, sm_count);
        GemvQ8Variant { rows: (v.rows / 2).max(1), glu, ..v }
    }

    /// The tiling of a plain one-token GEMV (no GLU, no hand-off, as a QKV projection) over
    /// long rows of Q4_0/Q4_1 units: 8 warps of 4-row groups, 32 rows per block, each lane loading
    /// up to 2 units of each row; other shapes are returned unchanged. Measured (`kernel_bench
    /// decode`, H100, alternatives in parentheses): the 8B QKV 6.4 -> 5.8 us (16 warps x 2 rows
    /// 5.8, 8 x 4 x 1 unit x 2 slices 5.7), the 1B QKV 2.2 -> 2.0 us (the same three 2.0).
    pub fn wide_rows(self, cols: usize) -> Self {
        let long_rows = cols / 32 >= Self::WIDE_MIN_UNITS && self.tpr == 32;
        let q4 = matches!(self.wtype, GgmlType::Q4_0 | GgmlType::Q4_1);
        if self.ntok != 1 || self.glu != 0 || self.emit != 0 || self.experts != ExpertGrid::Off || !q4 || !long_rows {
            return self;
        }
        GemvQ8Variant { nwarps: 8, rows: 4, unroll: self.unroll.min(2), ..self }
    }

    /// Fewest 32-value units per row for [`Self::wide_rows`] (2 048 columns).
    const WIDE_MIN_UNITS: usize = 64;

    /// Most threads per block with slices: 512 keeps 128 registers per thread; 1 024 (64
    /// registers) only for lanes that load one small unit per row and batch.
    const MAX_SPLIT_THREADS: u32 = 512;
    const MAX_SPLIT_THREADS_ONE_UNIT: u32 = 1024;

    /// Splits each row's units over up to 4 slices of the block when the grid of `rows` rows
    /// has at most one block per SM (as for the emitting projections into a model's width: 128
    /// blocks for the 8B shape, 64 for 1B) and each lane would otherwise walk its units in
    /// several dependent batches: more bytes in flight per SM. (Measured: with grids of up to
    /// two blocks per SM also split, the 1B shape's gate/up lost 4% of its decode rate.)
    /// A one-token emitting GEMV of Q4-family units then loads one unit per row and batch, so
    /// that up to 4 slices of 1 024 threads fit (`kernel_bench decode`: 8B down 10.9 -> 9.8 us,
    /// 1B output 2.5 -> 2.3 us, 1B down 5.7 -> 5.6 us; 8B output unchanged).
    pub fn split_k(self, rows: usize, cols: usize, n_tokens: usize, sm_count: u32) -> Self {
        let blocks = rows.div_ceil(self.rows_per_block()) * n_tokens.max(1).div_ceil(self.ntok as usize);
        if blocks > sm_count as usize {
            return GemvQ8Variant { k_split: 1, ..self };
        }
        let one_unit = self.emit > 0 && self.glu == 0 && self.ntok == 1 && Self::unit_budget(self.wtype) == 8;
        let (v, max_threads) = if one_unit { (GemvQ8Variant { unroll: 1, ..self }, Self::MAX_SPLIT_THREADS_ONE_UNIT) } else { (self, Self::MAX_SPLIT_THREADS) };
        let batches = (cols / 32).div_ceil((v.tpr * v.unroll) as usize);
        let mut k_split = 1;
        while k_split * 2 <= 4 && batches >= k_split * 2 && v.nwarps * 32 * (k_split as u32) * 2 <= max_threads {
            k_split *= 2;
        }
        GemvQ8Variant { k_split: k_split as u32, ..v }
    }

    /// A plain one-token GEMV of Q4-family units (no hand-off, so a block need not own 32 rows)
    /// whose 32-row blocks would leave half the SMs idle takes 16-row blocks of 4 slices of 8
    /// warps, one unit per lane and batch, when its rows have at least
    /// [`Self::SPREAD_MIN_UNITS`] units ([`Self::spreads_rows`]); other tilings are returned
    /// unchanged. Measured (`kernel_bench decode`, H100): the 1B down projection 5.7 -> 4.0 us
    /// on twice the SMs (8 rows per block 4.2).
    pub fn spread_rows(self, rows: usize, cols: usize, sm_count: u32) -> Self {
        let plain = self.emit == 0 && self.glu == 0 && self.ntok == 1 && self.experts == ExpertGrid::Off && self.down == 0;
        if plain && self.tpr == 32 && self.rows_per_block() > 16 && Self::spreads_rows(self.wtype, rows, cols, sm_count) {
            return GemvQ8Variant { nwarps: 8, rows: 2, unroll: 1, k_split: 4, ..self };
        }
        self
    }

    /// Whether a plain one-token GEMV of Q4-family units over `rows x cols` spreads its rows
    /// ([`Self::spread_rows`]): 32-row blocks would fill at most half of `sm_count` SMs and its
    /// rows are long enough for 4 slices of full warps. The decode plan drops an int8 hand-off
    /// from such a producer (a block must own 32 rows to quantize them), so that it spreads.
    pub fn spreads_rows(wtype: GgmlType, rows: usize, cols: usize, sm_count: u32) -> bool {
        Self::unit_budget(wtype) == 8 && 2 * rows.div_ceil(32) <= sm_count as usize && cols / 32 >= Self::SPREAD_MIN_UNITS
    }

    /// Fewest 32-value units per row for [`Self::spreads_rows`]: one per lane of 4 slices.
    const SPREAD_MIN_UNITS: usize = 128;

    /// The fused MLP of one token: each thread multiplies `down_rows / threads` of the down
    /// projection's rows by the block's outputs (the block's tiling must own whole 32-value units
    /// of the down projection's columns, as [`Self::emitting`]'s does).
    pub fn with_down(self, down_rows: usize) -> Self {
        GemvQ8Variant { down: down_rows.div_ceil(self.threads()) as u32, ..self }
    }

    /// One token's activations arrive as f32 and every block quantizes them itself (a prologue
    /// instead of a quantize launch or a producer's hand-off): `cols / 32` blocks over the
    /// block's groups of 8 lanes.
    pub fn with_f32_input(self, cols: usize) -> Self {
        GemvQ8Variant { in_f32: (cols / 32).div_ceil(self.threads() / 8) as u32, ..self }
    }

    /// Threads per block.
    pub fn threads(&self) -> usize {
        (self.nwarps * 32 * self.k_split) as usize
    }

    pub fn rows_per_block(&self) -> usize {
        (self.nwarps * 32 / self.tpr * self.rows) as usize
    }

    pub fn launch_config(&self, rows: usize, n_tokens: usize) -> LaunchConfig {
        LaunchConfig {
            grid_dim: (blocks_for(rows, self.rows_per_block()), blocks_for(n_tokens, self.ntok as usize), 1),
            block_dim: (self.nwarps * 32 * self.k_split, 1, 1),
            shared_mem_bytes: 0,
        }
    }
}

impl KernelVariant for GemvQ8Variant {
    const FAMILY: &'static str = "gemv_q8";
    const SOURCES: &'static [&'static str] = &[HEADER, QUANT, Q8_BLOCK, GemvQ8Params::C_DECL, SOURCE_Q8];
    const ENTRY_POINTS: &'static [&'static str] = &["gemv_q8"];

    fn macros(&self) -> Vec<(&'static str, String)> {
        vec![
            ("WTYPE", (self.wtype as u32).to_string()),
            ("NWARPS", self.nwarps.to_string()),
            ("TPR", self.tpr.to_string()),
            ("ROWS", self.rows.to_string()),
            ("UNROLL", self.unroll.to_string()),
            ("NTOK", self.ntok.to_string()),
            ("RESIDUAL", u32::from(self.residual).to_string()),
            ("BIAS", u32::from(self.bias).to_string()),
            ("GLU", self.glu.to_string()),
            ("IN_NORM", u32::from(self.in_norm).to_string()),
            ("EMIT", self.emit.to_string()),
            ("KSPLIT", self.k_split.to_string()),
            ("UP_SPLIT", u32::from(self.up_split).to_string()),
            ("EXPERTS", (self.experts as u32).to_string()),
            ("IN_F32", self.in_f32.to_string()),
            ("DOWN", self.down.to_string()),
            ("EARLY_RELEASE", u32::from(self.early_release).to_string()),
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
    fn q8_macros_match_source() {
        crate::kernels::tests::assert_macros_match(GemvQ8Variant::for_shape(GgmlType::Q4_K, 4096, 4096, 1, 132));
    }

    #[test]
    fn grouped_experts_take_tiles_of_pairs() {
        // Qwen3.5-35B-A3B gate/up at 256 tokens, top 8: 2048 pairs in at most 480 tiles of 8;
        // 8 tokens per tile leave one gate and one up row per lane group.
        let tiles = crate::kernels::moe::group_max_tiles(2048, 256);
        let v = GemvQ8Variant::for_grouped_experts(GgmlType::Q4_0, 512, 2048, tiles, 132, 1);
        assert_eq!((v.experts, v.ntok, v.rows, v.glu), (ExpertGrid::Grouped, GROUP_TILE as u32, 1, 1));
        assert_eq!(v.launch_config(512, tiles * GROUP_TILE).grid_dim.1 as usize, tiles);
        crate::kernels::tests::assert_macros_match(v);
        // One tile still gets whole tiles of 8.
        assert_eq!(GemvQ8Variant::for_grouped_experts(GgmlType::Q6_K, 2048, 512, 1, 132, 0).ntok, 8);
    }

    #[test]
    fn q8_tiling_follows_the_shape() {
        // SmolLM2 QKV: 18 units per row -> a warp per row, one unit each; 960 rows need 1-row
        // groups to give about two blocks per SM.
        let v = GemvQ8Variant::for_shape(GgmlType::Q4_1, 960, 576, 1, 132);
        assert_eq!((v.tpr, v.unroll, v.rows, v.rows_per_block()), (32, 1, 1, 4));
        assert_eq!(v.launch_config(960, 1).grid_dim, (240, 1, 1));
        // 8B down projection (without a hand-off): 448 units -> 2 units per lane and row, 2 rows
        // per group (4 would leave under two blocks per SM).
        let v = GemvQ8Variant::for_shape(GgmlType::Q4_0, 4096, 14336, 1, 132);
        assert_eq!((v.tpr, v.unroll, v.rows, v.rows_per_block()), (32, 2, 2, 8));
        assert_eq!(v.launch_config(4096, 1).grid_dim, (512, 1, 1));
        // Bulkier units (Q6_K) get a smaller budget; eight tokens, at most two rows per group.
        let v = GemvQ8Variant::for_shape(GgmlType::Q6_K, 28672, 4096, 8, 132);
        assert_eq!((v.ntok, v.unroll, v.rows), (8, 2, 2));
        assert_eq!(v.launch_config(28672, 19).grid_dim, (3584, 3, 1));
        // Rows shorter than a warp: groups of 8 lanes.
        let v = GemvQ8Variant::for_shape(GgmlType::Q8_0, 100, 256, 1, 132);
        assert_eq!((v.tpr, v.unroll, v.rows_per_block()), (8, 1, 16));
    }

    #[test]
    fn emitting_blocks_own_one_quantization_block() {
        for (wtype, rows, cols, n, glu) in [
            (GgmlType::Q4_1, 576, 576, 1, 0),
            (GgmlType::Q4_0, 4096, 14336, 1, 0),
            (GgmlType::Q4_0, 14336, 4096, 1, 1),
            (GgmlType::Q6_K, 4096, 4096, 8, 1),
            (GgmlType::Q8_0, 64, 256, 3, 0),
        ] {
            let v = GemvQ8Variant { glu, ..GemvQ8Variant::for_shape(wtype, rows, cols, n, 132) }.emitting(2);
            assert_eq!(v.rows_per_block(), 32, "{wtype} {rows}x{cols} n={n}");
            let budget = if glu > 0 && n == 1 && wtype == GgmlType::Q4_0 { 16 } else { 8 };
            assert!(v.nwarps <= 16 && v.rows as usize * v.unroll as usize * if glu > 0 { 2 } else { 1 } <= budget);
        }
        // 8B gate/up (one token): 4 output rows per warp, each lane 2 units of each gate and up row.
        let v = GemvQ8Variant::for_gated(GgmlType::Q4_0, 14336, 4096, 1, 132, 1).emitting(2);
        assert_eq!((v.rows, v.unroll, v.nwarps), (4, 2, 8));
        // 8B output projection: 4 rows per warp, 2 units each, 8 warps.
        let v = GemvQ8Variant::for_shape(GgmlType::Q4_0, 4096, 4096, 1, 132).emitting(1);
        assert_eq!((v.rows, v.unroll, v.nwarps), (4, 2, 8));
    }

    #[test]
    fn plain_long_rows_take_eight_warps() {
        // 8B and 1B QKV: 8 warps x 4 rows x 2 units, 32 rows per block, no split (8B: 192 blocks;
        // 1B: 96 blocks of one batch of units, nothing to split).
        for (rows, cols) in [(6144, 4096), (3072, 2048)] {
            let v = GemvQ8Variant::for_shape(GgmlType::Q4_0, rows, cols, 1, 132).wide_rows(cols).split_k(rows, cols, 1, 132);
            assert_eq!((v.nwarps, v.rows, v.unroll, v.k_split, v.rows_per_block()), (8, 4, 2, 1, 32), "{rows}x{cols}");
        }
        // SmolLM2's short rows, several tokens, bulkier units and hand-offs keep their tilings.
        let short = GemvQ8Variant::for_shape(GgmlType::Q4_1, 960, 576, 1, 132);
        assert_eq!(short.wide_rows(576), short);
        let batch = GemvQ8Variant::for_shape(GgmlType::Q4_0, 6144, 4096, 4, 132);
        assert_eq!(batch.wide_rows(4096), batch);
        let bulky = GemvQ8Variant::for_shape(GgmlType::Q8_0, 6144, 4096, 1, 132);
        assert_eq!(bulky.wide_rows(4096), bulky);
        let emitting = GemvQ8Variant::for_shape(GgmlType::Q4_0, 4096, 4096, 1, 132).emitting(1);
        assert_eq!(emitting.wide_rows(4096), emitting);
    }

    #[test]
    fn fused_mlp_and_f32_rows_tile_by_units() {
        // SmolLM2's gate/up with its down projection: 48 blocks of 8 warps x 4 rows, each owning
        // 32 channels (one unit of every down row); 576 down rows over 256 threads: 3 each.
        let v = GemvQ8Variant::for_gated(GgmlType::Q4_1, 1536, 576, 1, 132, 1);
        let v = GemvQ8Variant { emit: 0, ..v.emitting(2) }.with_down(576);
        assert_eq!((v.rows_per_block(), v.threads(), v.down, v.in_f32), (32, 256, 3, 0));
        assert_eq!(v.launch_config(1536, 1).grid_dim, (48, 1, 1));
        crate::kernels::tests::assert_macros_match(v);
        // SmolLM2's QKV reading the f32 stream: 18 blocks of 32 values over 16 groups of 8 lanes.
        let q = GemvQ8Variant::for_shape(GgmlType::Q4_1, 960, 576, 1, 132).with_f32_input(576);
        assert_eq!((q.threads(), q.in_f32, q.down), (128, 2, 0));
        crate::kernels::tests::assert_macros_match(q);
    }

    #[test]
    fn split_k_fills_underused_sms() {
        // 8B down projection, emitting: 128 blocks of 8 warps, one unit per lane and batch (14
        // batches) -> 4 slices, 1 024 threads.
        let v = GemvQ8Variant::for_shape(GgmlType::Q4_0, 4096, 14336, 1, 132).emitting(2).split_k(4096, 14336, 1, 132);
        assert_eq!((v.unroll, v.k_split, v.launch_config(4096, 1).block_dim.0), (1, 4, 1024));
        // Bulkier units (Q6_K) keep their unroll and at most 512 threads: 2 slices.
        let v = GemvQ8Variant::for_shape(GgmlType::Q6_K, 4096, 14336, 1, 132).emitting(2).split_k(4096, 14336, 1, 132);
        assert!(v.launch_config(4096, 1).block_dim.0 <= 512 && v.k_split == 2);
        // 1B output projection: two batches of one unit -> 2 slices.
        let v = GemvQ8Variant::for_shape(GgmlType::Q4_0, 2048, 2048, 1, 132).emitting(1).split_k(2048, 2048, 1, 132);
        assert_eq!((v.unroll, v.k_split), (1, 2));
        // Without a hand-off (no emit) a lane keeps its unroll: 1 batch, nothing to split.
        let v = GemvQ8Variant::for_shape(GgmlType::Q4_0, 64, 2048, 1, 132).split_k(64, 2048, 1, 132);
        assert_eq!(v.k_split, 1);
        // Grids that fill the device stay unsplit (8B QKV: 768 blocks).
        let v = GemvQ8Variant::for_shape(GgmlType::Q4_0, 6144, 4096, 1, 132).split_k(6144, 4096, 1, 132);
        assert_eq!(v.k_split, 1);
        // 1B down projection without a hand-off: 64 blocks of 32 rows would leave half the SMs
        // idle -> 128 blocks of 16 rows, 4 slices of 8 warps, one unit per lane and batch.
        let v = GemvQ8Variant::for_shape(GgmlType::Q4_0, 2048, 8192, 1, 132).wide_rows(8192).split_k(2048, 8192, 1, 132).spread_rows(2048, 8192, 132);
        assert_eq!((v.nwarps, v.rows, v.unroll, v.k_split, v.rows_per_block()), (8, 2, 1, 4, 16));
        assert_eq!(v.launch_config(2048, 1).grid_dim, (128, 1, 1));
        crate::kernels::tests::assert_macros_match(v);
        // Not with the hand-off (a block owns 32 rows), nor over short rows (1B output), nor when
        // 32-row blocks fill more than half the SMs (8B down), nor already narrow blocks.
        let emitting = GemvQ8Variant::for_shape(GgmlType::Q4_0, 2048, 8192, 1, 132).emitting(2).split_k(2048, 8192, 1, 132);
        assert_eq!(emitting.spread_rows(2048, 8192, 132), emitting);
        let narrow = GemvQ8Variant::for_shape(GgmlType::Q4_0, 64, 16384, 1, 132);
        assert_eq!(narrow.spread_rows(64, 16384, 132), narrow);
        assert!(!GemvQ8Variant::spreads_rows(GgmlType::Q4_0, 2048, 2048, 132) && !GemvQ8Variant::spreads_rows(GgmlType::Q4_0, 4096, 14336, 132));
        assert!(!GemvQ8Variant::spreads_rows(GgmlType::Q6_K, 2048, 8192, 132));
        // The op test's shapes as `linear_q8` tiles them before a retile: 520 x 4096 spreads,
        // 96 x 576 (18 units a row) does not.
        let dispatched = |rows, cols| GemvQ8Variant::for_shape(GgmlType::Q4_0, rows, cols, 1, 132).wide_rows(cols).split_k(rows, cols, 1, 132);
        assert_eq!(dispatched(520, 4096).spread_rows(520, 4096, 132).rows_per_block(), 16);
        assert_eq!(dispatched(96, 576).spread_rows(96, 576, 132), dispatched(96, 576));
        // Four warps of short groups: up to 4 slices.
        let v = GemvQ8Variant::for_shape(GgmlType::Q4_0, 64, 16384, 1, 132).split_k(64, 16384, 1, 132);
        assert_eq!((v.nwarps, v.k_split), (4, 4));
        crate::kernels::tests::assert_macros_match(v);
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
