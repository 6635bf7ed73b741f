//! Shared CUDA headers, pasted in front of family sources (NVRTC gets no include paths).
//!
//! [`HEADER`]: scalar typedefs, f16/bf16 conversions through inline PTX (no `cuda_fp16.h`, which
//! needs CCCL headers under NVRTC 13), warp/block reductions, the device-side error flag.
//! [`QUANT`]: the GGML weight formats as the kernels see them after [`crate::weight`]'s repack
//! (each block field in its own "plane" so quant bytes can be read with 16-byte loads), and
//! `load_unit`, which decodes 32 consecutive weights of a row into registers.

/// Error codes a kernel may leave in the device error flag; decoded by `Gpu::check_device`.
pub(crate) const ERR_TOKEN_ID: u32 = 1;
pub(crate) const ERR_POSITION: u32 = 2;
pub(crate) const ERR_EXPERT_ID: u32 = 3;

pub const HEADER: &str = r#"
// ---- ferrite common header ----
typedef unsigned char u8;
typedef signed char i8;
typedef unsigned short u16;
typedef unsigned int u32;
typedef int i32;
typedef unsigned long long u64;
typedef long long i64;

#define FULL_MASK 0xffffffffu
#define NEG_INF __uint_as_float(0xff800000u)
#define QNAN __uint_as_float(0x7fc00000u)
// Must equal ERR_TOKEN_ID / ERR_POSITION / ERR_EXPERT_ID in kernels/common.rs.
#define ERR_TOKEN_ID 1u
#define ERR_POSITION 2u
#define ERR_EXPERT_ID 3u

__device__ __forceinline__ float f16_to_f32(u16 h) {
  float f;
  asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
  return f;
}
__device__ __forceinline__ u16 f32_to_f16(float f) {
  u16 h;
  asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
  return h;
}
__device__ __forceinline__ float bf16_to_f32(u16 h) { return __uint_as_float(((u32)h) << 16); }
__device__ __forceinline__ u16 f32_to_bf16(float f) {
  u16 h;
  asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h) : "f"(f));
  return h;
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(FULL_MASK, v, o);
  return v;
}
__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(FULL_MASK, v, o));
  return v;
}
// The warp's largest value in one `redux.sync` instead of five dependent shuffles: floats
// mapped to ints of the same order (a negative float's magnitude bits flipped). Unlike
// `warp_max`, a NaN is not skipped (a +NaN wins, a -NaN loses): for values that are not NaN, or
// whose NaN the caller handles apart.
__device__ __forceinline__ float warp_max_redux(float v) {
  int i = __float_as_int(v);
  i ^= (i >> 31) & 0x7fffffff;
  int m = __reduce_max_sync(FULL_MASK, i);
  m ^= (m >> 31) & 0x7fffffff;
  return __int_as_float(m);
}

// Sum over the whole block, returned to every thread, in a fixed order (deterministic).
// All threads must call it; `scratch` holds at least 32 floats.
__device__ float block_sum(float v, float* scratch) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = (blockDim.x + 31) >> 5;
  v = warp_sum(v);
  __syncthreads();  // an earlier call may still be reading scratch
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  return warp_sum(lane < nwarps ? scratch[lane] : 0.f);
}

__device__ __forceinline__ float silu(float x) { return x / (1.f + expf(-x)); }
// GELU, tanh approximation (PyTorch's approximate="tanh", used by Gemma's GeGLU), written as
// x * sigmoid(2z) = x * (1 + tanh z) / 2: no cancellation in 1 + tanh z for negative x.
__device__ __forceinline__ float gelu_tanh_z(float x) { return 1.5957691216057308f * (x + 0.044715f * x * x * x); }
__device__ __forceinline__ float gelu_tanh(float x) { return x / (1.f + expf(-gelu_tanh_z(x))); }

// FERRITE_CUDA_TIMELINE (see timeline.rs; the module cache defines TIMELINE=1 then): block
// (0, 0, 0) of every kernel appends (%globaltimer, the module's tag) to the process's timeline
// buffer as it passes the wait. `ferrite_timeline` holds the buffer's address, the tag and the
// buffer's slot count; the host writes them when it loads the module, so thread 0 reads them
// before the wait and the mark costs it one L2 atomic (a round trip) per launch.
#ifndef TIMELINE
#define TIMELINE 0
#endif
#if TIMELINE
extern "C" __device__ u64 ferrite_timeline[3];
struct TimelineRef {
  u64* buf;
  u64 tag, slots;
};
__device__ __forceinline__ bool timeline_marker() { return (threadIdx.x | threadIdx.y | threadIdx.z | blockIdx.x | blockIdx.y | blockIdx.z) == 0; }
__device__ __forceinline__ TimelineRef timeline_ref() {
  if (!timeline_marker()) return {nullptr, 0, 0};
  return {reinterpret_cast<u64*>(ferrite_timeline[0]), ferrite_timeline[1], ferrite_timeline[2]};
}
__device__ __forceinline__ void timeline_mark(const TimelineRef& t) {
  if (t.buf == nullptr) return;
  u64 now;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
  const u32 i = atomicAdd(reinterpret_cast<u32*>(t.buf), 1u);
  if (i < t.slots) {
    t.buf[2 + 2 * (u64)i] = now;
    t.buf[3 + 2 * (u64)i] = t.tag;
  }
}
#endif
// Programmatic dependent launch (Hopper, see `Gpu::launch`): a kernel may be scheduled while the
// previous kernel of the stream is still running. `pdl_wait` blocks until that kernel has
// finished and its writes are visible, so every kernel calls it before it reads an activation
// or writes anything (weights, which nothing writes, may be loaded before). `pdl_release` then
// lets the next kernel be scheduled early. Both are no-ops for an ordinary launch.
__device__ __forceinline__ void pdl_wait() {
#if TIMELINE
  const TimelineRef timeline = timeline_ref();
#endif
#if __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
#if TIMELINE
  timeline_mark(timeline);
#endif
}
__device__ __forceinline__ void pdl_release() {
#if __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" :::);
#endif
}
// The first statement of every kernel that has nothing to load before waiting.
#define KERNEL_ENTRY() \
  do {                 \
    pdl_wait();        \
    pdl_release();     \
  } while (0)

// 1 / sqrt(mean(x^2) + eps) over a row of `cols`, computed by the whole block (every thread
// must call it) and returned to every thread; `scratch` holds 32 floats.
__device__ __forceinline__ float row_rms_inv(const float* x, u32 cols, float eps, float* scratch) {
  float ss = 0.f;
  for (u32 i = threadIdx.x; i < cols; i += blockDim.x) ss += x[i] * x[i];
  ss = block_sum(ss, scratch);
  return 1.f / sqrtf(ss / (float)cols + eps);
}

// Record the first device-side error (code, detail) in the flag the host checks later.
__device__ __forceinline__ void report_error(u64 flag, u32 code, u32 detail) {
  u32* f = reinterpret_cast<u32*>(flag);
  if (atomicCAS(f, 0u, code) == 0u) atomicExch(f + 1, detail);
}
"#;

pub const QUANT: &str = r#"
// ---- ferrite GGML weight formats (repacked into planes) ----
#ifndef WTYPE
#error "WTYPE (the GGML type id of the weight) must come from the kernel variant"
#endif
#define GGML_F32 0
#define GGML_F16 1
#define GGML_Q4_0 2
#define GGML_Q4_1 3
#define GGML_Q5_0 6
#define GGML_Q5_1 7
#define GGML_Q8_0 8
#define GGML_Q2_K 10
#define GGML_Q3_K 11
#define GGML_Q4_K 12
#define GGML_Q5_K 13
#define GGML_Q6_K 14
#define GGML_BF16 30

// Plane base pointers (see weight.rs for which block field each plane holds) and row length.
struct WeightRef { const u8* p0; const u8* p1; const u8* p2; const u8* p3; i64 cols; };

// Each type below defines a `Unit`: 32 consecutive weights of a row as loaded (packed bits
// plus scales), so that several rows' units fit in registers at once, and
//   load_unit(w, row, u, unit)  -- read unit u of a row (16-byte loads of the quant plane),
//   unit_q(unit, l)             -- the integer code of weight l (l a compile-time constant),
// with weight l = a0 * q + b0 for l < 16 and a1 * q + b1 after. Scales stay out of inner
// loops: a dot product applies them once per half unit. For the int8 path each type also has
//   unit_word(unit, i)          -- weights 4i..4i+3 as four 8-bit codes c (one per byte), with
//                                  q = c - W_OFFSET (only Q8_0's codes are signed).

__device__ __forceinline__ uint4 ld_u128(const u8* p) { return *reinterpret_cast<const uint4*>(p); }
__device__ __forceinline__ u32 ld_u32(const u8* p) { return *reinterpret_cast<const u32*>(p); }
__device__ __forceinline__ u16 ld_u16(const u8* p) { return *reinterpret_cast<const u16*>(p); }
__device__ __forceinline__ u32 byte_of(const uint4& v, int j) {
  const u32 w = j < 4 ? v.x : j < 8 ? v.y : j < 12 ? v.z : v.w;
  return (w >> (8 * (j & 3))) & 0xffu;
}
// Byte l (0..31) of 32 bytes held as two 16-byte loads.
__device__ __forceinline__ u32 byte_of2(const uint4& lo, const uint4& hi, int l) {
  return l < 16 ? byte_of(lo, l) : byte_of(hi, l - 16);
}
// Word i (bytes 4i..4i+3) of 16 or 32 bytes held as uint4 loads.
__device__ __forceinline__ u32 word_of(const uint4& v, int i) { return i == 0 ? v.x : i == 1 ? v.y : i == 2 ? v.z : v.w; }
__device__ __forceinline__ u32 word_of2(const uint4& lo, const uint4& hi, int i) { return i < 4 ? word_of(lo, i) : word_of(hi, i - 4); }
#define SCALES float a0, b0, a1, b1
// code - offset as a float, for codes below 2^23: the code is placed in the mantissa of 2^23
// (one OR and one add, both full rate, instead of the quarter-rate integer-to-float convert).
__device__ __forceinline__ float code_f(u32 code, float offset) {
  return __uint_as_float(0x4B000000u | code) - (8388608.f + offset);
}
template <typename U>
__device__ __forceinline__ void set_scales(U& o, float a0, float b0, float a1, float b1) {
  o.a0 = a0; o.b0 = b0; o.a1 = a1; o.b1 = b1;
}

#if WTYPE == GGML_F32 || WTYPE == GGML_F16 || WTYPE == GGML_BF16
#define IS_FLOAT 1
#define HAS_MIN 0
__device__ __forceinline__ float load_float(const WeightRef& w, i64 idx) {
#if WTYPE == GGML_F32
  return reinterpret_cast<const float*>(w.p0)[idx];
#elif WTYPE == GGML_F16
  return f16_to_f32(reinterpret_cast<const u16*>(w.p0)[idx]);
#else
  return bf16_to_f32(reinterpret_cast<const u16*>(w.p0)[idx]);
#endif
}
#if WTYPE == GGML_F32
struct Unit { float4 v[8]; SCALES; };
#else
struct Unit { uint4 v[4]; SCALES; };
#endif
// Needs cols % 32 == 0 (the op layer routes other shapes elsewhere).
__device__ __forceinline__ void load_unit(const WeightRef& w, i64 row, int u, Unit& o) {
  set_scales(o, 1.f, 0.f, 1.f, 0.f);
  const i64 base = row * w.cols + (i64)u * 32;
#if WTYPE == GGML_F32
  const float4* p = reinterpret_cast<const float4*>(reinterpret_cast<const float*>(w.p0) + base);
#pragma unroll
  for (int i = 0; i < 8; ++i) o.v[i] = p[i];
#else
  const uint4* p = reinterpret_cast<const uint4*>(reinterpret_cast<const u16*>(w.p0) + base);
#pragma unroll
  for (int i = 0; i < 4; ++i) o.v[i] = p[i];
#endif
}
__device__ __forceinline__ float unit_q(const Unit& o, int l) {
#if WTYPE == GGML_F32
  const float4 v = o.v[l >> 2];
  return (l & 3) == 0 ? v.x : (l & 3) == 1 ? v.y : (l & 3) == 2 ? v.z : v.w;
#else
  const uint4 v = o.v[l >> 3];
  const int k = l & 7;
  const u32 word = k < 2 ? v.x : k < 4 ? v.y : k < 6 ? v.z : v.w;
  const u16 h = (u16)(word >> (16 * (k & 1)));
#if WTYPE == GGML_F16
  return f16_to_f32(h);
#else
  return bf16_to_f32(h);
#endif
#endif
}

#else  // quantized types
#define IS_FLOAT 0

#if WTYPE == GGML_Q4_0 || WTYPE == GGML_Q4_1
// Q4_0 planes: p0 = qs[16], p1 = d.   Q4_1 planes: p0 = qs[16], p1 = (d, m).
// Element l: nibble (l / 16) of byte l % 16; Q4_0 codes are offset by 8.
#define QK 32
#if WTYPE == GGML_Q4_1
#define HAS_MIN 1
#define Q_OFFSET 0
#else
#define HAS_MIN 0
#define Q_OFFSET 8
#endif
struct Unit { uint4 qs; SCALES; };
__device__ __forceinline__ void load_block_unit(const WeightRef& w, i64 blk, int sub, Unit& o) {
  o.qs = ld_u128(w.p0 + blk * 16);
#if WTYPE == GGML_Q4_1
  const u32 dm = ld_u32(w.p1 + blk * 4);
  const float d = f16_to_f32((u16)dm), m = f16_to_f32((u16)(dm >> 16));
  set_scales(o, d, m, d, m);
#else
  const float d = f16_to_f32(ld_u16(w.p1 + blk * 2));
  set_scales(o, d, 0.f, d, 0.f);
#endif
}
__device__ __forceinline__ float unit_q(const Unit& o, int l) {
  return code_f((byte_of(o.qs, l & 15) >> (l < 16 ? 0 : 4)) & 15u, Q_OFFSET);
}
#define W_OFFSET Q_OFFSET
__device__ __forceinline__ u32 unit_word(const Unit& o, int i) { return (word_of(o.qs, i & 3) >> (i < 4 ? 0 : 4)) & 0x0F0F0F0Fu; }

#elif WTYPE == GGML_Q5_0 || WTYPE == GGML_Q5_1
// planes: p0 = qs[16], p1 = qh (u32: bit l is the 5th bit of element l), p2 = d or (d, m)
// Q5_0 codes are offset by 16.
#define QK 32
#if WTYPE == GGML_Q5_1
#define HAS_MIN 1
#define Q_OFFSET 0
#else
#define HAS_MIN 0
#define Q_OFFSET 16
#endif
struct Unit { uint4 qs; u32 qh; SCALES; };
__device__ __forceinline__ void load_block_unit(const WeightRef& w, i64 blk, int sub, Unit& o) {
  o.qs = ld_u128(w.p0 + blk * 16);
  o.qh = ld_u32(w.p1 + blk * 4);
#if WTYPE == GGML_Q5_1
  const u32 dm = ld_u32(w.p2 + blk * 4);
  const float d = f16_to_f32((u16)dm), m = f16_to_f32((u16)(dm >> 16));
#else
  const float d = f16_to_f32(ld_u16(w.p2 + blk * 2)), m = 0.f;
#endif
  set_scales(o, d, m, d, m);
}
__device__ __forceinline__ float unit_q(const Unit& o, int l) {
  return code_f(((byte_of(o.qs, l & 15) >> (l < 16 ? 0 : 4)) & 15u) | (((o.qh >> l) & 1u) << 4), Q_OFFSET);
}
#define W_OFFSET Q_OFFSET
__device__ __forceinline__ u32 unit_word(const Unit& o, int i) {
  const u32 h = o.qh >> (4 * i);  // 5th bits of elements 4i..4i+3, spread to bit 4 of each byte
  const u32 high = ((h << 4) & 0x10u) | ((h << 11) & 0x1000u) | ((h << 18) & 0x100000u) | ((h << 25) & 0x10000000u);
  return ((word_of(o.qs, i & 3) >> (i < 4 ? 0 : 4)) & 0x0F0F0F0Fu) | high;
}

#elif WTYPE == GGML_Q8_0
// planes: p0 = qs[32] (int8), p1 = d
#define QK 32
#define HAS_MIN 0
struct Unit { uint4 lo, hi; SCALES; };
__device__ __forceinline__ void load_block_unit(const WeightRef& w, i64 blk, int sub, Unit& o) {
  o.lo = ld_u128(w.p0 + blk * 32);
  o.hi = ld_u128(w.p0 + blk * 32 + 16);
  const float d = f16_to_f32(ld_u16(w.p1 + blk * 2));
  set_scales(o, d, 0.f, d, 0.f);
}
// Flipping the sign bit maps int8 q to the unsigned code q + 128.
__device__ __forceinline__ float unit_q(const Unit& o, int l) { return code_f(byte_of2(o.lo, o.hi, l) ^ 0x80u, 128.f); }
// The int8 codes as stored (signed, no offset).
#define W_OFFSET 0
__device__ __forceinline__ u32 unit_word(const Unit& o, int i) { return word_of2(o.lo, o.hi, i); }

#elif WTYPE == GGML_Q2_K
// planes: p0 = qs[64], p1 = scales[16] (low nibble scale, high nibble min), p2 = (d, dmin)
// Unit s: byte l of the 32 at 32*(s/4), 2-bit field s%4; scale byte 8*(s/4) + 2*(s%4) + l/16.
#define QK 256
#define HAS_MIN 1
struct Unit { uint4 lo, hi; int shift; SCALES; };
__device__ __forceinline__ void load_block_unit(const WeightRef& w, i64 blk, int sub, Unit& o) {
  const int n = sub >> 2;
  const u8* q = w.p0 + blk * 64 + 32 * n;
  o.lo = ld_u128(q);
  o.hi = ld_u128(q + 16);
  o.shift = 2 * (sub & 3);
  const u32 sc = ld_u16(w.p1 + blk * 16 + 8 * n + 2 * (sub & 3));
  const u32 dm = ld_u32(w.p2 + blk * 4);
  const float d = f16_to_f32((u16)dm), dmin = f16_to_f32((u16)(dm >> 16));
  set_scales(o, d * (float)(sc & 15u), -dmin * (float)((sc >> 4) & 15u),
             d * (float)((sc >> 8) & 15u), -dmin * (float)((sc >> 12) & 15u));
}
__device__ __forceinline__ float unit_q(const Unit& o, int l) { return code_f((byte_of2(o.lo, o.hi, l) >> o.shift) & 3u, 0.f); }
#define W_OFFSET 0
__device__ __forceinline__ u32 unit_word(const Unit& o, int i) { return (word_of2(o.lo, o.hi, i) >> o.shift) & 0x03030303u; }

#elif WTYPE == GGML_Q3_K
// planes: p0 = qs[64] (low 2 bits), p1 = hmask[32] (3rd bit, set = no -4), p2 = scales[12], p3 = d
// Unit s: byte l at 32*(s/4) field s%4, hmask bit s of byte l; 6-bit scales 8*(s/4)+2*(s%4)+l/16.
#define QK 256
#define HAS_MIN 0
struct Unit { uint4 lo, hi, hlo, hhi; int shift, sub; SCALES; };
__device__ __forceinline__ u32 q3k_scale_byte(const u32* sw, int k) { return (sw[k >> 2] >> (8 * (k & 3))) & 0xffu; }
__device__ __forceinline__ float q3k_scale(const u32* sw, int i) {
  const u32 low = i < 8 ? (q3k_scale_byte(sw, i) & 15u) : (q3k_scale_byte(sw, i - 8) >> 4);
  const u32 high = (q3k_scale_byte(sw, 8 + (i & 3)) >> (2 * (i >> 2))) & 3u;
  return (float)((int)(low | (high << 4)) - 32);
}
__device__ __forceinline__ void load_block_unit(const WeightRef& w, i64 blk, int sub, Unit& o) {
  const int n = sub >> 2;
  const u8* q = w.p0 + blk * 64 + 32 * n;
  o.lo = ld_u128(q);
  o.hi = ld_u128(q + 16);
  o.hlo = ld_u128(w.p1 + blk * 32);
  o.hhi = ld_u128(w.p1 + blk * 32 + 16);
  o.shift = 2 * (sub & 3);
  o.sub = sub;
  const u8* s = w.p2 + blk * 12;
  const u32 sw[3] = {ld_u32(s), ld_u32(s + 4), ld_u32(s + 8)};
  const float d = f16_to_f32(ld_u16(w.p3 + blk * 2));
  const int i0 = 8 * n + 2 * (sub & 3);
  set_scales(o, d * q3k_scale(sw, i0), 0.f, d * q3k_scale(sw, i0 + 1), 0.f);
}
__device__ __forceinline__ float unit_q(const Unit& o, int l) {
  // q = low - 4 unless the hmask bit is set, i.e. the code (low + 4 * bit) minus 4.
  const u32 low = (byte_of2(o.lo, o.hi, l) >> o.shift) & 3u;
  return code_f(low | (((byte_of2(o.hlo, o.hhi, l) >> o.sub) & 1u) << 2), 4.f);
}
#define W_OFFSET 4
__device__ __forceinline__ u32 unit_word(const Unit& o, int i) {
  return ((word_of2(o.lo, o.hi, i) >> o.shift) & 0x03030303u) | (((word_of2(o.hlo, o.hhi, i) >> o.sub) & 0x01010101u) << 2);
}

#elif WTYPE == GGML_Q4_K || WTYPE == GGML_Q5_K
// Q4_K planes: p0 = qs[128] repacked per unit (weight.rs: unit s's 16 bytes at 16 s, element l
//   in nibble l / 16 of byte l % 16, as Q4_0's), p1 = meta[16] = (d, dmin, scales[12])
// Q5_K planes: p0 = qs[128], p1 = qh[32], p2 = meta[16]; unit s: byte l at 32*(s/2), nibble
//   s%2 (+ 16 * bit s of qh[l]).
// Both: 6-bit scale/min s.
#define QK 256
#define HAS_MIN 1
// The scales of sub-block `sub` of a block's meta: a = d * scale, b = -dmin * min.
__device__ __forceinline__ void kquant_scales(const uint4& meta, int sub, float& a, float& b) {
  const float d = f16_to_f32((u16)meta.x), dmin = f16_to_f32((u16)(meta.x >> 16));
  // scales[k] is byte 4 + k of meta: sub-block j < 4 has its 6 bits in scales[j] (scale) and
  // scales[4 + j] (min); j >= 4 has 4 bits in each nibble of scales[4 + j] and its top 2 bits in
  // the top bits of scales[j - 4] and scales[j]. Bytes picked by shifts, not a run-time index.
  const u32 sh = 8 * (sub & 3), y = meta.y >> sh, z = meta.z >> sh, x = meta.w >> sh;
  const u32 sc = sub < 4 ? y & 63u : (x & 15u) | ((y >> 2) & 48u);
  const u32 mn = sub < 4 ? z & 63u : ((x >> 4) & 15u) | ((z >> 2) & 48u);
  a = d * (float)sc;
  b = -dmin * (float)mn;
}
#if WTYPE == GGML_Q4_K
struct Unit { uint4 qs; SCALES; };
__device__ __forceinline__ void load_block_unit(const WeightRef& w, i64 blk, int sub, Unit& o) {
  o.qs = ld_u128(w.p0 + blk * 128 + 16 * sub);
  float a, b;
  kquant_scales(ld_u128(w.p1 + blk * 16), sub, a, b);
  set_scales(o, a, b, a, b);
}
__device__ __forceinline__ float unit_q(const Unit& o, int l) {
  return code_f((byte_of(o.qs, l & 15) >> (l < 16 ? 0 : 4)) & 15u, 0.f);
}
__device__ __forceinline__ u32 unit_word(const Unit& o, int i) { return (word_of(o.qs, i & 3) >> (i < 4 ? 0 : 4)) & 0x0F0F0F0Fu; }
#else
struct Unit { uint4 lo, hi, hlo, hhi; int shift, sub; SCALES; };
__device__ __forceinline__ void load_block_unit(const WeightRef& w, i64 blk, int sub, Unit& o) {
  const u8* q = w.p0 + blk * 128 + 32 * (sub >> 1);
  o.lo = ld_u128(q);
  o.hi = ld_u128(q + 16);
  o.shift = 4 * (sub & 1);
  o.hlo = ld_u128(w.p1 + blk * 32);
  o.hhi = ld_u128(w.p1 + blk * 32 + 16);
  o.sub = sub;
  float a, b;
  kquant_scales(ld_u128(w.p2 + blk * 16), sub, a, b);
  set_scales(o, a, b, a, b);
}
__device__ __forceinline__ float unit_q(const Unit& o, int l) {
  const u32 v = (byte_of2(o.lo, o.hi, l) >> o.shift) & 15u;
  return code_f(v | (((byte_of2(o.hlo, o.hhi, l) >> o.sub) & 1u) << 4), 0.f);
}
__device__ __forceinline__ u32 unit_word(const Unit& o, int i) {
  const u32 v = (word_of2(o.lo, o.hi, i) >> o.shift) & 0x0F0F0F0Fu;
  return v | (((word_of2(o.hlo, o.hhi, i) >> o.sub) & 0x01010101u) << 4);
}
#endif
#define W_OFFSET 0

#elif WTYPE == GGML_Q6_K
// planes: p0 = ql[128], p1 = qh[64], both repacked per unit (weight.rs), p2 = scales[16] (int8),
// p3 = d. Unit s: its low nibbles at ql 16 s as Q4_0's (element l in nibble l / 16 of byte
// l % 16); its 2-bit highs at qh 8 s, two words: element l in word l / 16, byte l % 4, bits
// 2 ((l % 16) / 4), so that one shift gives four consecutive elements' bits; scales 2 s, 2 s + 1.
#define QK 256
#define HAS_MIN 0
struct Unit { uint4 ql; uint2 qh; SCALES; };
__device__ __forceinline__ void load_block_unit(const WeightRef& w, i64 blk, int sub, Unit& o) {
  o.ql = ld_u128(w.p0 + blk * 128 + 16 * sub);
  o.qh = *reinterpret_cast<const uint2*>(w.p1 + blk * 64 + 8 * sub);
  const u32 sc = ld_u16(w.p2 + blk * 16 + 2 * sub);
  const float d = f16_to_f32(ld_u16(w.p3 + blk * 2));
  set_scales(o, d * (float)(i8)(sc & 0xffu), 0.f, d * (float)(i8)(sc >> 8), 0.f);
}
__device__ __forceinline__ float unit_q(const Unit& o, int l) {
  const u32 low = (byte_of(o.ql, l & 15) >> (l < 16 ? 0 : 4)) & 15u;
  const u32 high = ((l < 16 ? o.qh.x : o.qh.y) >> (8 * (l & 3) + 2 * ((l >> 2) & 3))) & 3u;
  return code_f(low | (high << 4), 32.f);
}
#define W_OFFSET 32
__device__ __forceinline__ u32 unit_word(const Unit& o, int i) {
  const u32 low = (word_of(o.ql, i & 3) >> (i < 4 ? 0 : 4)) & 0x0F0F0F0Fu;
  return low | ((((i < 4 ? o.qh.x : o.qh.y) >> (2 * (i & 3))) & 0x03030303u) << 4);
}

#else
#error "WTYPE is not a GGML type these kernels support"
#endif

#define UNITS_PER_BLOCK (QK / 32)
__device__ __forceinline__ void load_unit(const WeightRef& w, i64 row, int u, Unit& o) {
  const i64 blk = row * (w.cols / QK) + u / UNITS_PER_BLOCK;
  load_block_unit(w, blk, u % UNITS_PER_BLOCK, o);
}
#endif  // quantized types

// Weight l of a unit, dequantized.
__device__ __forceinline__ float unit_value(const Unit& o, int l) {
  return l < 16 ? o.a0 * unit_q(o, l) + o.b0 : o.a1 * unit_q(o, l) + o.b1;
}

// sum over the unit of weight l * x[l], with q(l) the code of weight l: the scales are applied
// once per half unit (and sum x only for types with a min).
template <typename Codes>
__device__ __forceinline__ float scaled_dot(const Unit& w, Codes q, const float* x) {
  float s[2] = {0.f, 0.f}, t[2] = {0.f, 0.f};
#pragma unroll
  for (int l = 0; l < 32; ++l) {
    s[l >> 4] += q(l) * x[l];
#if HAS_MIN
    t[l >> 4] += x[l];
#endif
  }
  return w.a0 * s[0] + w.b0 * t[0] + w.a1 * s[1] + w.b1 * t[1];
}

// A unit's 32 weights times 32 activations held in registers, decoding on the fly.
__device__ __forceinline__ float unit_dot(const Unit& w, const float* x) {
  return scaled_dot(w, [&](int l) { return unit_q(w, l); }, x);
}

#if !IS_FLOAT
// A unit times 32 int8-quantized activations x = dx * xq (words xq0 = elements 0..15, xq1 =
// 16..31; sq0/sq1 the code sums of each half): four dp4a per half, scales applied once.
// Weight l = a * q + b = a * c + (b - W_OFFSET * a), so the offset and the min fold into one
// term times the activation code sum.
__device__ __forceinline__ float unit_dot_q8(const Unit& w, const int4& xq0, const int4& xq1, float dx, float sq0, float sq1) {
  const int s0 = __dp4a((int)unit_word(w, 3), xq0.w, __dp4a((int)unit_word(w, 2), xq0.z,
                 __dp4a((int)unit_word(w, 1), xq0.y, __dp4a((int)unit_word(w, 0), xq0.x, 0))));
  const int s1 = __dp4a((int)unit_word(w, 7), xq1.w, __dp4a((int)unit_word(w, 6), xq1.z,
                 __dp4a((int)unit_word(w, 5), xq1.y, __dp4a((int)unit_word(w, 4), xq1.x, 0))));
  float r = w.a0 * (float)s0 + w.a1 * (float)s1;
#if HAS_MIN || W_OFFSET != 0
  r += (w.b0 - (float)W_OFFSET * w.a0) * sq0 + (w.b1 - (float)W_OFFSET * w.a1) * sq1;
#endif
  return dx * r;
}
#endif
"#;
