//! Small-batch GEMM on tensor cores over packed quantized weights: `out[t, r] = sum_c W[r, c] *
//! x[t, c]` for 9–64 tokens (batched decode steps of a server), where the GEMV would re-read the
//! weights once per 8 tokens and dequantize + cuBLAS would write and re-read a bf16 copy.
//!
//! ## `gemm_mma`
//!
//! A block of `NWARPS` warps owns `BM` weight rows and `8 * NT` tokens; a warp owns `MT`
//! 16-row m-tiles. The block walks 128-column chunks of its K slice (grid z). In a chunk, lane
//! (g, t) of a warp loads unit `4 c + t` (32 weights) of rows g and g + 8 of each m-tile with
//! `load_unit` of `common::QUANT`, so every GGML type works and no two lanes load the same
//! bytes. The unit's word s (weights 4s..4s+3, as 8-bit codes from `unit_word`) becomes the
//! lane's A fragment of k-step s: pairs (w[4s], w[4s+2]) and (w[4s+1], w[4s+3]) made by bit
//! tricks (a code OR'ed into the mantissa of 128.0 or 1024.0 is that float plus the code), then
//! one `fma` with the unit's scales in the MMA input type. The lane's k slots of a step thus
//! hold four of its own unit's weights: a dot product does not care in which order it sums, as
//! long as the activations (B) come in the same order. They do because `convert_f32` writes
//! them with the middle two of every four swapped (`MmaOrder::Pairs`), so lane t's B pairs are plain
//! 32-bit words of its unit's 64 bytes. Those are staged per chunk in shared memory with
//! `cp.async` (`STAGES` stages; the 16-byte pieces of each row swizzled so a warp's loads hit no
//! bank twice) and multiplied with `mma.sync` m16n8k16 (bf16 or f16 inputs, f32 accumulation).
//! Each k-step pair is decoded just before its MMAs, so few fragments are live.
//!
//! The weights stream through registers, not shared memory: a ring of `DEPTH` chunks per lane,
//! each slot reloaded once its chunk is decoded. Grid x walks (row block, token block) pairs,
//! token blocks fastest. `MIN_BLOCKS` caps the registers so that many blocks fit per SM, and
//! the K split (grid z) is sized for one wave of them: the kernel is bound by instruction
//! latency per warp, so resident warps are what makes it fast (docs/perf.md, stop 14). With
//! grid z > 1 each slice writes f32 partials `[z][n][rows]` and `gemm_reduce` sums them in slice
//! order (deterministic).
//!
//! ## Warpgroup MMAs (`WGMMA` > 0, sm_90a)
//!
//! Each of the block's `WARPGROUPS` warpgroups owns `MT` 64-row tiles (16 rows of each per
//! warp) and all `8 * NT` tokens. The weights and their decode are as above; the MMA is
//! `wgmma.mma_async` with A from those registers and B from the shared activation stage through
//! a matrix descriptor. The chunk's 8 k-steps go in commit groups of `WGMMA`, each warp waiting
//! for the group before the one it just issued. The MMAs read their A registers until that
//! wait, so two fragment buffers alternate and each is kept live (an empty asm) until the wait
//! that retires its group: the compiler cannot give its registers to the next decode early.
//! The activations come tiled as the stage's image (`MmaOrder::Wgmma`), so a stage is one bulk
//! copy on an mbarrier: bulk copies are async-proxy writes, which wgmma may read without the
//! proxy fence that `cp.async` would need (it drains the weight prefetch). With `WSTAGES` the
//! weights also pass through shared memory (`cp.async`, read back with plain loads, so no
//! fence): the lanes' registers no longer hold chunks in flight.

use super::common::{HEADER, QUANT};
use super::dequant::MmaOrder;
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
        /// f32 `[n_tokens, rows]`, or with grid z > 1 the partials `[z][n_tokens, rows]`; with
        /// `STAGED_OUT` 16-bit values in the `MmaOrder::Wgmma` order of `out_tile` tokens.
        pub out: u64,
        /// f32 `[n_tokens, rows]` added to the output (0: none; with grid z > 1 the reduce adds it).
        pub residual: u64,
        pub rows: u32,
        pub cols: u32,
        pub n_tokens: u32,
        /// 128-column chunks per K slice (grid z).
        pub slice_chunks: u32,
        /// `STAGED_OUT`: tokens per tile of the stage image written to `out`.
        pub out_tile: u32,
        pub pad: u32,
    }
}

device_params! {
    pub struct GemmReduceParams {
        pub partials: u64,
        pub out: u64,
        /// Elements per slice (`n_tokens * rows`).
        pub n: u64,
        /// f32, `n` elements added to the sum (0: none).
        pub residual: u64,
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
#ifndef MT
#error "MT (16-row m-tiles per warp) must come from the kernel variant"
#endif
#ifndef DEPTH
#error "DEPTH (chunks of weights in flight per lane) must come from the kernel variant"
#endif
#ifndef STAGES
#error "STAGES (shared-memory stages of activations) must come from the kernel variant"
#endif
#ifndef MIN_BLOCKS
#error "MIN_BLOCKS (blocks per SM the registers must allow) must come from the kernel variant"
#endif
#ifndef WGMMA
#error "WGMMA (0: mma.sync; 1, 2, 4: warpgroup MMAs, sm_90a, k-steps per commit group) must come from the kernel variant"
#endif
#ifndef WARPGROUPS
#error "WARPGROUPS (groups of 4 warps per block) must come from the kernel variant"
#endif
#ifndef WSTAGES
#error "WSTAGES (0: weights through registers; 2 or more: shared-memory stages of weights) must come from the kernel variant"
#endif
#ifndef GLU
#error "GLU (0: none; 1: SwiGLU, 2: GeGLU epilogue over the weight's two row halves) must come from the kernel variant"
#endif
#ifndef STAGED_OUT
#error "STAGED_OUT (1: the GLU epilogue writes the next GEMM's staged 16-bit input, 0: f32 rows) must come from the kernel variant"
#endif
#if IS_FLOAT
#error "gemm_mma decodes packed quantized weights; float weights go to cuBLAS"
#endif
#if STAGED_OUT && !GLU
#error "STAGED_OUT is an output of the GLU epilogue"
#endif
#if GLU && !(WGMMA && WARPGROUPS == 2 && MT == 1)
#error "the GLU epilogue pairs warpgroup 0's gate tile with warpgroup 1's up tile (wgmma, 2 warpgroups of one 64-row tile)"
#endif
#define NWARPS (4 * WARPGROUPS)
#define BM (NWARPS * MT * 16)     // weight rows per block
// Output rows per block: with GLU the block's two 64-row tiles are gate rows r0.. and up rows
// rows / 2 + r0.. of one 64-row output tile.
#define BLOCK_OUT_ROWS (GLU ? BM / 2 : BM)
// Rows of a warp's m-tile m: WARP_ROW0(warp) + MTILE_ROWS * m + (g, g + 8). With mma.sync a warp
// owns MT consecutive 16-row tiles; with wgmma each warpgroup owns MT 64-row tiles, 16 rows of
// each per warp.
#if WGMMA
#define WARP_ROW0(warp) ((warp) / 4 * 64 * MT + (warp) % 4 * 16)
#define MTILE_ROWS 64
#else
#define WARP_ROW0(warp) ((warp) * MT * 16)
#define MTILE_ROWS 16
#endif
// Activation chunks staged ahead. wgmma reads a stage asynchronously, so the stage a chunk
// overwrites must be that of two chunks back, whose MMAs have all retired.
#define AHEAD (STAGES - 1 - (WGMMA > 0))
#define KC 128                    // columns per chunk: one 32-weight unit per lane t of a row
#define XROW (KC * 2)             // bytes of a staged token row

// Q8_0 codes are signed bytes: flipping the sign bit makes them unsigned with offset 128.
#if WTYPE == GGML_Q8_0
#define CODE_FLIP 0x80808080u
#define CODE_OFFSET 128
#else
#define CODE_FLIP 0u
#define CODE_OFFSET W_OFFSET
#endif

// Codes become 16-bit floats by bit tricks: `MAGIC | c` is the float MAGIC_VALUE + c, exact
// while c fits the mantissa (7 bits in bf16, 10 in f16). Only Q8_0's 8-bit codes in bf16 need
// the f32 route.
#if BF16_IN
#define MAGIC2 0x43004300u
#define MAGIC_VALUE 128
#define FAST_CODES (WTYPE != GGML_Q8_0)
#define HX2 "bf16x2"
#else
#define MAGIC2 0x64006400u
#define MAGIC_VALUE 1024
#define FAST_CODES 1
#define HX2 "f16x2"
#endif

__device__ __forceinline__ u32 pack2(float lo, float hi) {
  u32 r;
#if BF16_IN
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
#else
  asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
#endif
  return r;
}
// a * b + c on pairs of 16-bit floats, rounded once.
__device__ __forceinline__ u32 fma2(u32 a, u32 b, u32 c) {
  u32 r;
  asm("fma.rn." HX2 " %0, %1, %2, %3;" : "=r"(r) : "r"(a), "r"(b), "r"(c));
  return r;
}

// D += A B for one m16n8k16 tile (A row-major 16x16, B column-major 16x8; D f32). Not
// volatile: the compiler may interleave independent tiles.
__device__ __forceinline__ void mma(float* d, u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
#if BF16_IN
  asm(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
#else
  asm(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
#endif
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

__device__ __forceinline__ u32 smem_addr(const void* p) { return (u32)__cvta_generic_to_shared(p); }

#if WGMMA
#if 8 % WGMMA || WGMMA > 4
#error "WGMMA must divide the 8 k-steps of a chunk into an even number of commit groups"
#endif
// D (64 x 8NT, f32, the warp's 16 rows in the mma.sync C layout per 8 columns) += A B: A 64 x 16
// from registers (the warp's 16 rows in the mma.sync A layout), B 16 x 8NT from shared memory
// (K-major, no swizzle, described by `desc`). Asynchronous: it runs until a `wgmma_wait`.
#define ACC4(j) "+f"(d[j][0]), "+f"(d[j][1]), "+f"(d[j][2]), "+f"(d[j][3])
#if BF16_IN
#define WG_TYPES ".f32.bf16.bf16"
#else
#define WG_TYPES ".f32.f16.f16"
#endif
__device__ __forceinline__ void wgmma(float (&d)[NT][4], u32 a0, u32 a1, u32 a2, u32 a3, u64 desc) {
#if NT == 8
  asm volatile("wgmma.mma_async.sync.aligned.m64n64k16" WG_TYPES
      " {%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31},"
      " {%32,%33,%34,%35}, %36, 1, 1, 1, 0;"
      : ACC4(0), ACC4(1), ACC4(2), ACC4(3), ACC4(4), ACC4(5), ACC4(6), ACC4(7)
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "l"(desc));
#elif NT == 4
  asm volatile("wgmma.mma_async.sync.aligned.m64n32k16" WG_TYPES
      " {%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15}, {%16,%17,%18,%19}, %20, 1, 1, 1, 0;"
      : ACC4(0), ACC4(1), ACC4(2), ACC4(3)
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "l"(desc));
#elif NT == 2
  asm volatile("wgmma.mma_async.sync.aligned.m64n16k16" WG_TYPES
      " {%0,%1,%2,%3,%4,%5,%6,%7}, {%8,%9,%10,%11}, %12, 1, 1, 1, 0;"
      : ACC4(0), ACC4(1)
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "l"(desc));
#else
#error "wgmma takes 2, 4 or 8 n-tiles"
#endif
}
// Orders register writes (fragments, accumulators) before the wgmmas that read them.
__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
template <int N>
__device__ __forceinline__ void wgmma_wait() { asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(N) : "memory"); }
// Keeps the compiler from moving accumulator accesses across the asynchronous MMAs.
__device__ __forceinline__ void fence_acc(float (&d)[NT][4]) {
#pragma unroll
  for (int j = 0; j < NT; ++j)
#pragma unroll
    for (int i = 0; i < 4; ++i) asm volatile("" : "+f"(d[j][i])::"memory");
}
// A commit group's A fragments, kept live (and in their registers) up to this point: after the
// wait that retires the group's MMAs, which read them asynchronously until then.
__device__ __forceinline__ void fence_frags(u32 (&a)[WGMMA][MT][4]) {
#pragma unroll
  for (int s = 0; s < WGMMA; ++s)
#pragma unroll
    for (int m = 0; m < MT; ++m)
#pragma unroll
      for (int i = 0; i < 4; ++i) asm volatile("" : "+r"(a[s][m][i])::"memory");
}
// Shared-memory matrix descriptor of k-step s of a stage: core matrices of 8 token rows x 16
// bytes (8 k), 128 contiguous bytes each; k-group kg (two per step) and token group ng at
// (kg * NT + ng) * 128. Leading (K) byte offset NT * 128, stride (N) byte offset 128.
__device__ __forceinline__ u64 stage_desc(const u8* stage, int s) {
  const u32 addr = smem_addr(stage) + s * 2 * NT * 128;
  return (u64)((addr & 0x3FFFF) >> 4) | ((u64)((NT * 128) >> 4) << 16) | ((u64)(128 >> 4) << 32);
}
#endif

// Weights 4s .. 4s + 3 of a unit as two pairs of the MMA input type: lo = (w[4s], w[4s+2]),
// hi = (w[4s+1], w[4s+3]), each a * (code - offset) + b rounded once. The activations are
// stored with the middle two of every four swapped (`MmaOrder::Pairs`), so the
// same pairs of them are single 32-bit words.
struct Scales2 { u32 a[2], b[2]; };
__device__ __forceinline__ Scales2 unit_scales2(const Unit& o) {
  Scales2 s;
  s.a[0] = pack2(o.a0, o.a0); s.b[0] = pack2(o.b0, o.b0);
  s.a[1] = pack2(o.a1, o.a1); s.b[1] = pack2(o.b1, o.b1);
  return s;
}
__device__ __forceinline__ void decode_word(const Unit& o, const Scales2& sc, int s, u32& lo, u32& hi) {
  const u32 w = unit_word(o, s) ^ CODE_FLIP;
  const int half = s >> 2;
#if FAST_CODES
  // (MAGIC_VALUE + c) - (MAGIC_VALUE + offset) is exact; one more rounding applies the scales.
  const u32 one2 = pack2(1.f, 1.f), base2 = pack2(-(float)(MAGIC_VALUE + CODE_OFFSET), -(float)(MAGIC_VALUE + CODE_OFFSET));
  lo = fma2(fma2((w & 0x00FF00FFu) | MAGIC2, one2, base2), sc.a[half], sc.b[half]);
  hi = fma2(fma2(((w >> 8) & 0x00FF00FFu) | MAGIC2, one2, base2), sc.a[half], sc.b[half]);
#else
  const float a = half ? o.a1 : o.a0, b = half ? o.b1 : o.b0;
  float v[4];
#pragma unroll
  for (int k = 0; k < 4; ++k) v[k] = a * code_f((w >> (8 * k)) & 0xffu, (float)CODE_OFFSET) + b;
  lo = pack2(v[0], v[2]);
  hi = pack2(v[1], v[3]);
#endif
}

__device__ __forceinline__ void cp_async16(void* smem, const void* gmem, u32 bytes) {
  const u32 dst = smem_addr(smem);
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(gmem), "r"(bytes) : "memory");
}
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
}

// A staged token row holds lane t's 64 bytes (its unit) at 64 t, as four 16-byte pieces in an
// order that differs by row parity and t / 2, so that the 8 lanes of each phase of a 16-byte
// shared load (rows g, g + 1, all t) hit 8 different bank groups.
__device__ __forceinline__ int piece_slot(int row, int t, int p) { return 4 * t + (p ^ (((row & 1) << 1) | (t >> 1))); }

#if WGMMA
// The activations come tiled (`MmaOrder::Wgmma`): per block of 8 NT tokens and chunk, the
// stage's image (k-group p = 8 of the chunk's k in the order above, token r: 16 bytes at
// (p * 8 NT + r) * 16, the descriptor's core matrices), so a stage is one bulk copy (the async
// proxy, as wgmma reads it), completed on an mbarrier per stage.
#define STAGE_BYTES (NT * 8 * XROW)
__device__ __forceinline__ void stage_issue(u8* dst, u64* bar, const GemmMmaParams& p, u32 tb, u32 c) {
  if (threadIdx.x != 0) return;
  const u8* src = reinterpret_cast<const u8*>(p.x) + ((u64)tb * (p.cols / KC) + c) * STAGE_BYTES;
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_addr(bar)), "n"(STAGE_BYTES) : "memory");
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
               ::"r"(smem_addr(dst)), "l"(src), "n"(STAGE_BYTES), "r"(smem_addr(bar)) : "memory");
}
// Wait until the stage's copy of its `use`-th chunk (counting from 0) has landed. A copy that
// never lands is a bug; the kernel traps (a launch error) rather than hang the device.
__device__ __forceinline__ void stage_wait(u64* bar, u32 use) {
  for (u32 tries = 0;; ++tries) {
    u32 done;
    asm volatile("{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; selp.u32 %0, 1, 0, p; }"
                 : "=r"(done) : "r"(smem_addr(bar)), "r"(use & 1) : "memory");
    if (done) return;
    if (tries == (1u << 24)) asm volatile("trap;");
  }
}
#else
// Start copying chunk c of the block's NT * 8 token rows into a stage, as one commit group.
// Token rows past the batch and columns past the row are zero-filled.
__device__ __forceinline__ void stage_chunk(u8* dst, const GemmMmaParams& p, u32 tok0, u32 c) {
  const u16* x = reinterpret_cast<const u16*>(p.x);
  for (int i = threadIdx.x; i < NT * 8 * (KC / 8); i += NWARPS * 32) {
    const int r = i / (KC / 8), piece = i % (KC / 8);
    const u32 tok = tok0 + r, col = c * KC + 8 * piece;
    const bool in = tok < p.n_tokens && col < p.cols;
    cp_async16(dst + r * XROW + 16 * piece_slot(r, piece >> 2, piece & 3), in ? x + (i64)tok * p.cols + col : x, in ? 16 : 0);
  }
  asm volatile("cp.async.commit_group;" ::: "memory");
}
#endif

#if WSTAGES
#if !WGMMA || DEPTH != 1 || QK != 32
#error "weights staged in shared memory: the wgmma kernel (DEPTH 1) on the 32-weight block types only"
#endif
// Bytes per 32-weight block of each plane (weight.rs): their sum is the block's size.
#if WTYPE == GGML_Q4_0
#define PB0 16
#define PB1 2
#define PB2 0
#elif WTYPE == GGML_Q4_1
#define PB0 16
#define PB1 4
#define PB2 0
#elif WTYPE == GGML_Q5_0
#define PB0 16
#define PB1 4
#define PB2 2
#elif WTYPE == GGML_Q5_1
#define PB0 16
#define PB1 4
#define PB2 4
#else  // Q8_0
#define PB0 32
#define PB1 2
#define PB2 0
#endif
// A weight stage holds each plane's fields of the chunk's 4 blocks for the block's BM rows,
// [row][4 * PB] bytes per plane: as a WeightRef of 128-column rows, `load_unit` reads it as is.
#define WSTAGE_BYTES (BM * 4 * (PB0 + PB1 + PB2))
template <int N>
__device__ __forceinline__ void cp_async_small(u8* smem, const u8* gmem) {
  if (N == 16) asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(smem_addr(smem)), "l"(gmem) : "memory");
  else asm volatile("cp.async.ca.shared.global [%0], [%1], 8;" ::"r"(smem_addr(smem)), "l"(gmem) : "memory");
}
// Weight row of row r of a block's weight stage: row0 + r, or with GLU the gate tile's row0 + r
// then the up tile's (past the weight: its last row).
__device__ __forceinline__ i64 staged_row(u32 row0, int r, const GemmMmaParams& p) {
#if GLU
  const u32 at = r < 64 ? row0 + r : p.rows / 2 + row0 + (r - 64);
#else
  const u32 at = row0 + r;
#endif
  return min(at, p.rows - 1);
}
// Copy plane fields of blocks 4c .. 4c + 3 of the block's BM staged rows into dst.
template <int PB>
__device__ __forceinline__ void stage_plane(u8* dst, const u8* plane, u32 row0, const GemmMmaParams& p, u32 c) {
  // (PB 0: a type without that plane copies nothing.)
  constexpr int ROW = 4 * PB, PIECE = ROW < 16 ? ROW : 16, PER_ROW = PB ? ROW / PIECE : 0;
  for (int k = threadIdx.x; k < BM * PER_ROW; k += NWARPS * 32) {
    const int r = k / PER_ROW, j = k % PER_ROW;
    const i64 row = staged_row(row0, r, p);
    cp_async_small<PIECE>(dst + r * ROW + j * PIECE, plane + (row * (p.cols / 32) + 4 * c) * PB + j * PIECE);
  }
}
// Start copying chunk c's weights into a stage, as one commit group (empty past the slice).
__device__ __forceinline__ void stage_weights(u8* dst, const WeightRef& w, u32 row0, const GemmMmaParams& p, u32 c, bool in) {
  if (in) {
    stage_plane<PB0>(dst, w.p0, row0, p, c);
    stage_plane<PB1>(dst + BM * 4 * PB0, w.p1, row0, p, c);
    stage_plane<PB2>(dst + BM * 4 * (PB0 + PB1), w.p2, row0, p, c);
  }
  asm volatile("cp.async.commit_group;" ::: "memory");
}
__device__ __forceinline__ WeightRef staged_weights(const u8* stage) {
  return {stage, stage + BM * 4 * PB0, stage + BM * 4 * (PB0 + PB1), nullptr, KC};
}
#else
#define WSTAGE_BYTES 0
#endif

// Lane (g, t) works on rows g and g + 8 of each m-tile and on unit 4 c + t of them (the last
// unit again past the row: its activations are zero).
__device__ __forceinline__ void load_chunk(const WeightRef& w, const i64* row, u32 c, int t, u32 units, Unit (&u)[MT][2]) {
  const int unit = (int)min(4 * c + t, units - 1);
#pragma unroll
  for (int m = 0; m < MT; ++m)
#pragma unroll
    for (int h = 0; h < 2; ++h) load_unit(w, row[2 * m + h], unit, u[m][h]);
}

extern "C" __global__ void __launch_bounds__(NWARPS * 32, MIN_BLOCKS) gemm_mma(const GemmMmaParams p) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
  const WeightRef w = {(const u8*)p.w0, (const u8*)p.w1, (const u8*)p.w2, (const u8*)p.w3, (i64)p.cols};
  // Grid x walks (row block, token block) pairs, token blocks fastest: the blocks that share
  // a row block's weights run side by side, so all but the first read them from L2.
  const u32 token_blocks = (p.n_tokens + NT * 8 - 1) / (NT * 8);
  const u32 block_row0 = blockIdx.x / token_blocks * BLOCK_OUT_ROWS, tok0 = blockIdx.x % token_blocks * NT * 8, units = p.cols / 32;
#if GLU
  const u32 row0 = block_row0 + warp / 4 * (p.rows / 2) + warp % 4 * 16;
#else
  const u32 row0 = block_row0 + WARP_ROW0(warp);
#endif
  const u32 chunks = (p.cols + KC - 1) / KC, c0 = blockIdx.z * p.slice_chunks, c1 = min(chunks, c0 + p.slice_chunks);
  // Rows past the weight decode its last row and are never stored.
  i64 row[2 * MT];
#pragma unroll
  for (int i = 0; i < 2 * MT; ++i) row[i] = min(row0 + MTILE_ROWS * (i >> 1) + g + 8 * (i & 1), p.rows - 1);
#if WGMMA
  // Dynamic shared memory (the launch sizes it): the activation stages, the weight stages,
  // then the activation stages' mbarriers.
  extern __shared__ __align__(128) u8 s_dyn[];
  u8 (*s_x)[STAGE_BYTES] = reinterpret_cast<u8 (*)[STAGE_BYTES]>(s_dyn);
  u64* s_bar = reinterpret_cast<u64*>(s_dyn + STAGES * STAGE_BYTES + WSTAGES * WSTAGE_BYTES);
#else
  __shared__ __align__(16) u8 s_x[STAGES][NT * 8 * XROW];
#endif

  float acc[MT][NT][4];
#pragma unroll
  for (int m = 0; m < MT; ++m)
#pragma unroll
    for (int j = 0; j < NT; ++j)
#pragma unroll
      for (int i = 0; i < 4; ++i) acc[m][j][i] = 0.f;

  Unit u[DEPTH][MT][2];
#if WSTAGES
  // Weight chunks WSTAGES - 1 ahead through shared memory (cp.async: the kernel reads them with
  // plain loads, so no proxy fence), the first ones before the wait. The lane's rows of a
  // stage, as `load_chunk` takes them.
  u8 (*s_w)[WSTAGE_BYTES] = reinterpret_cast<u8 (*)[WSTAGE_BYTES]>(s_dyn + STAGES * STAGE_BYTES);
#pragma unroll
  for (int i = 0; i < WSTAGES - 1; ++i) stage_weights(s_w[i], w, block_row0, p, c0 + i, c0 + i < c1);
  i64 stage_row[2 * MT];
#pragma unroll
  for (int i = 0; i < 2 * MT; ++i) stage_row[i] = WARP_ROW0(warp) + MTILE_ROWS * (i >> 1) + g + 8 * (i & 1);
#else
  // A ring of DEPTH chunks of weights in registers; the first ones load before the wait.
#pragma unroll
  for (int d = 0; d < DEPTH; ++d)
    if (c0 + d < c1) load_chunk(w, row, c0 + d, t, units, u[d]);
#endif
  pdl_wait();
  pdl_release();
#if WGMMA
  // The A fragments of the last two commit groups, in turn (an even number per chunk): PTX
  // leaves rewriting a group's fragment registers before the wait that retires it undefined, so
  // each buffer stays live until then and the next decode cannot take its registers.
  u32 frag[2][WGMMA][MT][4] = {};
  const u32 tb = blockIdx.x % token_blocks;
  if (threadIdx.x == 0) {
#pragma unroll
    for (int i = 0; i < STAGES; ++i) asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(smem_addr(&s_bar[i])) : "memory");
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();
#pragma unroll
  for (int i = 0; i < AHEAD; ++i)
    if (c0 + i < c1) stage_issue(s_x[i], &s_bar[i], p, tb, c0 + i);
#else
  // Activations AHEAD chunks ahead, one commit group per chunk (empty past the slice, so that
  // waiting for all but the newest AHEAD - 1 groups always means this chunk's).
#pragma unroll
  for (int i = 0; i < AHEAD; ++i) {
    if (c0 + i < c1) stage_chunk(s_x[i], p, tok0, c0 + i);
    else asm volatile("cp.async.commit_group;" ::: "memory");
  }
#endif
  for (u32 cb = c0; cb < c1; cb += DEPTH) {
#pragma unroll
    for (int d = 0; d < DEPTH; ++d) {
      const u32 c = cb + d;
      if (c >= c1) break;  // uniform over the block
      const u32 stage = (c - c0) % STAGES;
      const u8* xs = s_x[stage];
      // After the barrier every warp is done with the stage of chunk c + AHEAD - STAGES (with
      // wgmma: its MMAs retired, as each warp waits for all but its latest group), which then
      // receives chunk c + AHEAD.
#if WGMMA
#if WSTAGES
      cp_async_wait<WSTAGES - 2>();  // this thread's copies of chunk c's weights
#endif
      stage_wait(&s_bar[stage], (c - c0) / STAGES);
      __syncthreads();
      if (c + AHEAD < c1) stage_issue(s_x[(c - c0 + AHEAD) % STAGES], &s_bar[(c - c0 + AHEAD) % STAGES], p, tb, c + AHEAD);
#if WSTAGES
      // Every warp has its units of chunk c - 1 in registers: that stage takes chunk c + WSTAGES - 1.
      stage_weights(s_w[(c - c0 + WSTAGES - 1) % WSTAGES], w, block_row0, p, c + WSTAGES - 1, c + WSTAGES - 1 < c1);
      load_chunk(staged_weights(s_w[(c - c0) % WSTAGES]), stage_row, 0, t, 4, u[d]);
#endif
#else
      cp_async_wait<AHEAD - 1>();
      __syncthreads();
      if (c + AHEAD < c1) stage_chunk(s_x[(c - c0 + AHEAD) % STAGES], p, tok0, c + AHEAD);
      else asm volatile("cp.async.commit_group;" ::: "memory");
#endif
      Scales2 sc[MT][2];
#pragma unroll
      for (int m = 0; m < MT; ++m) {
        sc[m][0] = unit_scales2(u[d][m][0]);
        sc[m][1] = unit_scales2(u[d][m][1]);
      }
#if WGMMA
      // k-step s takes weights 4s .. 4s + 3 of the lane's units (the activations are stored in
      // that order, `MmaOrder::Wgmma`). The chunk's steps go in groups of WGMMA: a group's fragments
      // are decoded, its MMAs issued as one commit group, and then the warp waits for the group
      // before it, so the fragments of a group stay untouched until its MMAs retire while the
      // next group decodes.
#pragma unroll
      for (int s0 = 0; s0 < 8; s0 += WGMMA) {
        u32 (&a)[WGMMA][MT][4] = frag[(s0 / WGMMA) & 1];
#pragma unroll
        for (int s = 0; s < WGMMA; ++s)
#pragma unroll
          for (int m = 0; m < MT; ++m) {
            decode_word(u[d][m][0], sc[m][0], s0 + s, a[s][m][0], a[s][m][2]);
            decode_word(u[d][m][1], sc[m][1], s0 + s, a[s][m][1], a[s][m][3]);
          }
        wgmma_fence();
#pragma unroll
        for (int s = 0; s < WGMMA; ++s)
#pragma unroll
          for (int m = 0; m < MT; ++m) wgmma(acc[m], a[s][m][0], a[s][m][1], a[s][m][2], a[s][m][3], stage_desc(xs, s0 + s));
        wgmma_commit();
#pragma unroll
        for (int m = 0; m < MT; ++m) fence_acc(acc[m]);
        wgmma_wait<1>();
        fence_frags(frag[((s0 / WGMMA) & 1) ^ 1]);  // the group before is retired
      }
#else
      // Step pairs: the A fragments of k-steps 2q and 2q + 1 (step s takes weights 4s .. 4s + 3
      // of the lane's units) are decoded just before their MMAs, so the decode of one pair
      // overlaps the MMAs of the last and few registers hold fragments.
#pragma unroll
      for (int q = 0; q < 4; ++q) {
        u32 a[MT][2][4];
#pragma unroll
        for (int m = 0; m < MT; ++m)
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            decode_word(u[d][m][0], sc[m][0], 2 * q + h, a[m][h][0], a[m][h][2]);
            decode_word(u[d][m][1], sc[m][1], 2 * q + h, a[m][h][1], a[m][h][3]);
          }
#pragma unroll
        for (int j = 0; j < NT; ++j) {
          const int r = 8 * j + g;
          const uint4 b = *reinterpret_cast<const uint4*>(xs + r * XROW + 16 * piece_slot(r, t, q));
#pragma unroll
          for (int m = 0; m < MT; ++m) {
            mma(acc[m][j], a[m][0][0], a[m][0][1], a[m][0][2], a[m][0][3], b.x, b.y);
            mma(acc[m][j], a[m][1][0], a[m][1][1], a[m][1][2], a[m][1][3], b.z, b.w);
          }
        }
      }
#endif
#if !WSTAGES
      // The lane's units of chunk c are decoded: their registers take chunk c + DEPTH.
      if (c + DEPTH < c1) load_chunk(w, row, c + DEPTH, t, units, u[d]);
#endif
    }
  }
#if WGMMA
  wgmma_wait<0>();
#pragma unroll
  for (int m = 0; m < MT; ++m) fence_acc(acc[m]);
  fence_frags(frag[0]);
  fence_frags(frag[1]);
#endif

#if GLU
  // Warpgroup 1 hands its up tile to warpgroup 0 through the activation stages (every MMA has
  // retired: nothing reads them any more); lanes of the same place in the two warpgroups hold
  // the same (row, token) fragment, so each up value goes to its gate's lane. Then out[t, r] =
  // act(gate) * up, as the activation kernels compute it.
  static_assert(4 * 32 * NT * 16 <= STAGES * STAGE_BYTES, "the up tile fits the activation stages");
  __syncthreads();
  float4* s_up = reinterpret_cast<float4*>(s_dyn) + (warp % 4 * 32 + lane) * NT;
  if (warp >= 4) {
#pragma unroll
    for (int j = 0; j < NT; ++j) s_up[j] = make_float4(acc[0][j][0], acc[0][j][1], acc[0][j][2], acc[0][j][3]);
  }
  __syncthreads();
  if (warp >= 4) return;
  const u32 half = p.rows / 2;
#if STAGED_OUT
  // The block's 64 outputs x 8 NT tokens as 16-bit MMA inputs, [token][output] in shared
  // memory past the up tile (rows of 66: the copy-out below reads down a column, and 132-byte
  // rows put its lanes in different banks), then written out in the order of the next GEMM's
  // stage image (`MmaOrder::Wgmma`, `p.out_tile` tokens per tile).
  constexpr int SROW = 66;
  u16* s_out = reinterpret_cast<u16*>(s_dyn + 4 * 32 * NT * 16);
  static_assert(4 * 32 * NT * 16 + NT * 8 * SROW * 2 <= STAGES * STAGE_BYTES, "the staged outputs fit the activation stages");
#else
  float* glu_out = reinterpret_cast<float*>(p.out);
#endif
#pragma unroll
  for (int j = 0; j < NT; ++j) {
    const float4 up4 = s_up[j];
    const float up[4] = {up4.x, up4.y, up4.z, up4.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const u32 r = row0 + g + 8 * (i >> 1), tok = tok0 + 8 * j + 2 * t + (i & 1);
#if GLU == 1
      const float v = silu(acc[0][j][i]) * up[i];
#else
      const float v = gelu_tanh(acc[0][j][i]) * up[i];
#endif
#if STAGED_OUT
      s_out[(tok - tok0) * SROW + (r - block_row0)] = BF16_IN ? f32_to_bf16(v) : f32_to_f16(v);
#else
      if (r < half && tok < p.n_tokens) glu_out[(i64)tok * half + r] = v;
#endif
    }
  }
#if STAGED_OUT
  // Warpgroup 0 alone (warpgroup 1 has left): a named barrier, not __syncthreads.
  asm volatile("bar.sync 1, 128;" ::: "memory");
  // In the stage image, output column i (of a 128-column chunk) of a token lies in 8-value
  // group G = 2 ((i >> 2) & 7) + (i & 1), place 2 ((i >> 5) & 3) + ((i >> 1) & 1): a 64-column
  // half h of the chunk fills places 4h .. 4h + 3 of all 16 groups. So each (token, group) of
  // the block is one 8-byte store of the block's outputs (i & 63) = 32 (q >> 1) + 4 (G >> 1) +
  // 2 (q & 1) + (G & 1), q < 4. Consecutive threads take consecutive tokens (16-byte rows).
  // (The host checks that half is whole chunks, so every block's outputs lie below it.)
  const u32 chunk = block_row0 / 128, h = (block_row0 / 64) & 1, out_chunks = half / 128;
  for (u32 k = threadIdx.x; k < NT * 8 * 16; k += 128) {
    const u32 tl = k % (NT * 8), G = k / (NT * 8), tok = tok0 + tl;
    if (tok >= p.n_tokens) continue;
    const u16* src = s_out + tl * SROW + 4 * (G >> 1) + (G & 1);
    const uint2 v = make_uint2((u32)src[0] | ((u32)src[2] << 16), (u32)src[32] | ((u32)src[34] << 16));
    reinterpret_cast<uint2*>(p.out)[((((i64)(tok / p.out_tile) * out_chunks + chunk) * 16 + G) * p.out_tile + tok % p.out_tile) * 2 + h] = v;
  }
#endif
  return;
#endif
  // C fragment: acc[m][j] = rows (g, g + 8) x tokens (2t, 2t + 1) of tile (m, j). The residual
  // is added by the one slice there is (more slices: by the reduce), once, after the sum.
  float* out = reinterpret_cast<float*>(p.out) + (i64)blockIdx.z * p.n_tokens * p.rows;
  const float* residual = gridDim.z == 1 ? reinterpret_cast<const float*>(p.residual) : nullptr;
#pragma unroll
  for (int m = 0; m < MT; ++m)
#pragma unroll
    for (int j = 0; j < NT; ++j)
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const u32 r = row0 + MTILE_ROWS * m + g + 8 * (i >> 1), tok = tok0 + 8 * j + 2 * t + (i & 1);
        if (r < p.rows && tok < p.n_tokens) {
          const i64 at = (i64)tok * p.rows + r;
          out[at] = residual ? acc[m][j][i] + residual[at] : acc[m][j][i];
        }
      }
}
"#;

const REDUCE: &str = r#"
// out[i] = sum over slices z (in order) of partials[z][i], then + residual[i] if given.
extern "C" __global__ void gemm_reduce(const GemmReduceParams p) {
  KERNEL_ENTRY();
  const float* part = reinterpret_cast<const float*>(p.partials);
  const float* residual = reinterpret_cast<const float*>(p.residual);
  float* out = reinterpret_cast<float*>(p.out);
  for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < p.n; i += (u64)gridDim.x * blockDim.x) {
    float s = 0.f;
    for (u32 z = 0; z < p.slices; ++z) s += part[z * p.n + i];
    out[i] = residual ? s + residual[i] : s;
  }
}
"#;

/// Columns of a `gemm_mma` chunk (`KC` in the source).
pub const GEMM_CHUNK_COLS: usize = 128;
/// Shared memory an sm_90 SM gives its blocks (228 KiB, less 1 KiB reserved per block).
const SHARED_BYTES_PER_SM: usize = 220 * 1024;

/// Compile-time shape of the small-batch tensor-core GEMM.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct GemmMmaVariant {
    pub wtype: GgmlType,
    /// 8-token n-tiles per block (2, 4 or 8).
    pub nt: u32,
    /// bf16 MMA inputs (else f16).
    pub bf16: bool,
    /// 16-row m-tiles per warp (1 or 2).
    pub mt: u32,
    /// Groups of 4 warps per block (1 or 2). With wgmma each is a warpgroup with its own MT
    /// 64-row tiles, all multiplying the block's shared activation stages.
    pub warpgroups: u32,
    /// Chunks of weights in flight per lane, in registers (1 to 4).
    pub depth: u32,
    /// Shared-memory stages of activations (2 or more; `STAGES * NT * 2 KiB` <= 48 KiB for
    /// mma.sync, whose stages are static; the wgmma kernel's are dynamic, up to the SM's limit).
    pub stages: u32,
    /// Blocks per SM: the registers are capped so that this many fit, and the grid is sized
    /// for one wave of them. The kernel is latency-bound per warp (decode, then MMAs), so more
    /// resident warps is what makes it faster.
    pub occupancy: u32,
    /// 0: `mma.sync`. 1, 2 or 4: warpgroup MMAs (`wgmma`, sm_90a; at least 3 stages)
    /// issued that many k-steps (of a chunk's 8) per commit group: the block's warpgroup
    /// multiplies 64-row tiles with the shared activation stage as B, asynchronously, while its
    /// warps decode the next group.
    pub wgmma: u32,
    /// 0: each lane loads its weights into registers, `depth` chunks ahead. 2 or more (wgmma,
    /// `depth` 1, 32-weight block types): the block copies the chunks' weights into that many
    /// shared-memory stages (`cp.async`, stages - 1 chunks ahead) and the lanes load them from
    /// there, so the weights in flight do not cost registers.
    pub weight_stages: u32,
    /// 0, or the GLU epilogue (`Glu as u32`: 1 SwiGLU, 2 GeGLU) of a fused gate/up weight:
    /// `out[t, r] = act(gate) * up` with gate rows r and up rows rows / 2 + r. Needs the 64-token
    /// wgmma tiling (2 warpgroups of one tile: the gate tile and the up tile) and one K slice.
    pub glu: u32,
    /// With `glu`: the epilogue writes its outputs as the next GEMM's staged input (16-bit, the
    /// `MmaOrder::Wgmma` order; `GemmMmaParams::out_tile` tokens per tile), not as f32 rows.
    /// Needs rows / 2 a multiple of 128.
    pub staged_out: bool,
}

impl GemmMmaVariant {
    /// The narrowest n-tiling that covers `n_tokens` in one token block (at most 64 tokens).
    pub fn for_shape(wtype: GgmlType, n_tokens: usize, bf16: bool) -> Self {
        let nt = match n_tokens {
            0..=16 => 2,
            17..=32 => 4,
            _ => 8,
        };
        let small_unit = matches!(wtype, GgmlType::Q4_0 | GgmlType::Q4_1 | GgmlType::Q5_0 | GgmlType::Q5_1 | GgmlType::Q8_0);
        // Measured on the H200 (kernel_bench tilings, docs/perf.md): at 9-16 tokens four blocks
        // per SM beat two by up to 27%; at 17-32 tokens four blocks of one m-tile per warp beat
        // three of two (8B gate/up 56 vs 71 us); at 64 tokens capping the registers below two
        // blocks' worth spills.
        let (mt, occupancy) = match nt {
            2 => (2, 4),
            4 => (1, 4),
            _ => (2, 2),
        };
        GemmMmaVariant { wtype, nt, bf16, mt, warpgroups: 1, depth: if small_unit { 2 } else { 1 }, stages: 2, occupancy, wgmma: 0, weight_stages: 0, glu: 0, staged_out: false }
    }

    /// The warpgroup-MMA tiling for `n_tokens` (sm_90), from `kernel_bench tilings` on the H200
    /// (docs/perf.md, stop 20): at 64-token tiles two warpgroups of one 64-row tile share the
    /// activation stages, 2 blocks per SM, 3 stages, 4 k-steps per commit group (8B gate/up at 64
    /// tokens 51.4 µs; one warpgroup of two tiles 51.9, `mma.sync` 77.6); narrower tiles keep one
    /// warpgroup of two. The 32-weight block types stage their weights in shared memory, as many
    /// stages (up to 4) as fit.
    pub fn for_wgmma(wtype: GgmlType, n_tokens: usize, bf16: bool) -> Self {
        let base = GemmMmaVariant::for_shape(wtype, n_tokens, bf16);
        let v = match base.nt {
            8 => GemmMmaVariant { mt: 1, warpgroups: 2, stages: 3, occupancy: 2, wgmma: 4, ..base },
            _ => GemmMmaVariant { mt: 2, stages: 3, occupancy: 3, wgmma: 4, ..base },
        };
        if !v.can_stage_weights() {
            return v;
        }
        let fits = |ws: u32| v.occupancy as usize * v.shared_bytes_with(ws) <= SHARED_BYTES_PER_SM;
        match (2..=4).rev().find(|&ws| fits(ws)) {
            Some(weight_stages) => GemmMmaVariant { depth: 1, weight_stages, ..v },
            None => v,
        }
    }

    /// Whether the kernel can stage this type's weights in shared memory (the wgmma kernel, on
    /// types whose planes hold whole fields per 32-weight block).
    pub fn can_stage_weights(&self) -> bool {
        use GgmlType::*;
        self.wgmma > 0 && matches!(self.wtype, Q4_0 | Q4_1 | Q5_0 | Q5_1 | Q8_0)
    }

    /// Bytes of dynamic shared memory per block.
    pub fn shared_bytes(&self) -> usize {
        if self.wgmma > 0 {
            self.shared_bytes_with(self.weight_stages)
        } else {
            0
        }
    }

    /// The wgmma kernel's stages of 16-bit activations (`GEMM_CHUNK_COLS` per token), `ws`
    /// weight stages (the block's rows' blocks of a chunk) and one 8-byte mbarrier per
    /// activation stage.
    fn shared_bytes_with(&self, ws: u32) -> usize {
        let stage = 8 * self.nt as usize * GEMM_CHUNK_COLS * 2;
        let weight_stage = self.block_rows() * GEMM_CHUNK_COLS / 32 * self.wtype.type_size();
        self.stages as usize * (stage + 8) + ws as usize * weight_stage
    }

    /// The column order the kernel reads its activations in.
    pub fn activation_order(&self) -> MmaOrder {
        if self.wgmma > 0 {
            MmaOrder::Wgmma { tile_tokens: 8 * self.nt as usize }
        } else {
            MmaOrder::Pairs
        }
    }

    /// Warps of a block (`NWARPS` in the source).
    pub fn warps(&self) -> usize {
        4 * self.warpgroups as usize
    }

    /// Weight rows of a block (`BM` in the source).
    pub fn block_rows(&self) -> usize {
        self.warps() * self.mt as usize * 16
    }

    /// Whether this tiling can take the GLU epilogue (see `glu`).
    pub fn can_fuse_glu(&self) -> bool {
        self.wgmma > 0 && self.warpgroups == 2 && self.mt == 1
    }

    /// K slices (grid z): as many as keep the grid within one wave of `occupancy` blocks per
    /// SM (a second, partial wave would take as long as the first), at most 16, each at least
    /// 2 chunks.
    pub fn k_slices(&self, rows: usize, cols: usize, n_tokens: usize, sm_count: usize) -> usize {
        let blocks = (rows.div_ceil(self.block_rows()) * n_tokens.div_ceil(8 * self.nt as usize)).max(1);
        let chunks = cols.div_ceil(GEMM_CHUNK_COLS);
        let slices = (self.occupancy as usize * sm_count / blocks).min(chunks / 2).clamp(1, 16);
        chunks.div_ceil(Self::slice_chunks(cols, slices))
    }

    /// Chunks per slice for `slices` slices (the last slice may be shorter).
    pub fn slice_chunks(cols: usize, slices: usize) -> usize {
        cols.div_ceil(GEMM_CHUNK_COLS).div_ceil(slices)
    }

    pub fn launch_config(&self, rows: usize, n_tokens: usize, slices: usize) -> LaunchConfig {
        LaunchConfig {
            // (With GLU a block's two tiles make one 64-row tile of the rows / 2 outputs: the
            // same count for the even row counts it takes.)
            grid_dim: (blocks_for(rows, self.block_rows()) * blocks_for(n_tokens, 8 * self.nt as usize), 1, slices as u32),
            block_dim: (32 * self.warps() as u32, 1, 1),
            shared_mem_bytes: self.shared_bytes() as u32,
        }
    }
}

impl KernelVariant for GemmMmaVariant {
    const FAMILY: &'static str = "gemm_mma";
    const SOURCES: &'static [&'static str] = &[HEADER, QUANT, GemmMmaParams::C_DECL, GemmReduceParams::C_DECL, SOURCE, REDUCE];
    const ENTRY_POINTS: &'static [&'static str] = &["gemm_mma", "gemm_reduce"];

    fn macros(&self) -> Vec<(&'static str, String)> {
        vec![
            ("WTYPE", (self.wtype as u32).to_string()),
            ("NT", self.nt.to_string()),
            ("BF16_IN", u32::from(self.bf16).to_string()),
            ("MT", self.mt.to_string()),
            ("DEPTH", self.depth.to_string()),
            ("STAGES", self.stages.to_string()),
            ("MIN_BLOCKS", self.occupancy.to_string()),
            ("WGMMA", self.wgmma.to_string()),
            ("WARPGROUPS", self.warpgroups.to_string()),
            ("WSTAGES", self.weight_stages.to_string()),
            ("GLU", self.glu.to_string()),
            ("STAGED_OUT", u32::from(self.staged_out).to_string()),
        ]
    }

    fn arch_specific(&self) -> bool {
        self.wgmma > 0
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
        crate::kernels::tests::assert_macros_match(GemmMmaVariant::for_shape(GgmlType::Q4_0, 64, true));
        crate::kernels::tests::assert_macros_match(GemmMmaVariant { wgmma: 4, stages: 3, ..GemmMmaVariant::for_shape(GgmlType::Q4_0, 64, true) });
        crate::kernels::tests::assert_macros_match(GemmMmaVariant::for_wgmma(GgmlType::Q4_0, 64, true));
        crate::kernels::tests::assert_macros_match(GemmMmaVariant { glu: 1, ..GemmMmaVariant::for_wgmma(GgmlType::Q4_0, 64, true) });
        crate::kernels::tests::assert_macros_match(GemmMmaVariant { glu: 1, staged_out: true, ..GemmMmaVariant::for_wgmma(GgmlType::Q4_0, 64, true) });
    }

    #[test]
    fn wgmma_tiling_stages_weights_where_they_fit() {
        // 64 tokens: two blocks per SM of 3 x 16 KiB activation stages plus the weight stages
        // (128 rows x 4 blocks of each type's bytes); k-quants keep their weights in registers.
        for (dtype, stages) in [(GgmlType::Q4_0, 4), (GgmlType::Q5_1, 4), (GgmlType::Q8_0, 3), (GgmlType::Q6_K, 0)] {
            let v = GemmMmaVariant::for_wgmma(dtype, 64, true);
            assert_eq!((v.weight_stages, v.depth == 1 || stages == 0), (stages, true), "{dtype}");
            assert!(v.occupancy as usize * v.shared_bytes() <= SHARED_BYTES_PER_SM, "{dtype}");
            assert_eq!(v.launch_config(28672, 64, 1).block_dim, (256, 1, 1));
        }
        let q4 = GemmMmaVariant::for_wgmma(GgmlType::Q4_0, 64, true);
        assert_eq!((q4.block_rows(), q4.shared_bytes()), (128, 3 * (16384 + 8) + 4 * 128 * 4 * 18));
    }

    #[test]
    fn tiling_covers_the_batch_and_fills_the_device() {
        let v = GemmMmaVariant::for_shape(GgmlType::Q4_0, 9, true);
        assert_eq!(v.nt, 2);
        assert_eq!(GemmMmaVariant::for_shape(GgmlType::Q4_0, 64, true).nt, 8);
        // 8B QKV (6144 x 4096) at 64 tokens: 48 row blocks, 5 slices of 7 chunks (the last 4)
        // fill 240 of the 264 two-per-SM slots.
        let v = GemmMmaVariant::for_shape(GgmlType::Q4_0, 64, true);
        let z = v.k_slices(6144, 4096, 64, 132);
        assert_eq!(z, 5);
        assert_eq!(GemmMmaVariant::slice_chunks(4096, z), 7);
        assert_eq!(v.launch_config(6144, 64, z).grid_dim, (48, 1, 5));
        // At 16 tokens, four blocks per SM: 11 slices of 3 chunks.
        let v16 = GemmMmaVariant::for_shape(GgmlType::Q4_0, 16, true);
        assert_eq!((v16.nt, v16.occupancy, v16.k_slices(6144, 4096, 16, 132)), (2, 4, 11));
        // Narrower n-tiles than the batch: token blocks times row blocks in grid x.
        assert_eq!(v16.launch_config(6144, 64, 1).grid_dim, (192, 1, 1));
        // 8B down (4096 x 14336): 32 row blocks, 8 slices of 14 chunks.
        assert_eq!(v.k_slices(4096, 14336, 64, 132), 8);
        // Gate/up already has 224 blocks; an LM head more than a wave; a short K at least 2
        // chunks a slice (576 columns: 5 chunks, the last one partial).
        assert_eq!(v.k_slices(28672, 4096, 64, 132), 1);
        assert_eq!(v.k_slices(49152, 4096, 64, 132), 1);
        assert_eq!(v.k_slices(128, 576, 9, 132), 2);
        assert_eq!(GemmMmaVariant::slice_chunks(576, 2), 3);
    }
}
