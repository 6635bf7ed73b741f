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
// Must equal ERR_TOKEN_ID / ERR_POSITION in kernels/common.rs.
#define ERR_TOKEN_ID 1u
#define ERR_POSITION 2u

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

// 32 consecutive weights of one row: w[l] = a0 * q[l] + b0 for l < 16, a1 * q[l] + b1 after.
// Scales stay out of the inner loop: a dot product applies them once per half unit.
struct Unit { float q[32]; float a0, b0, a1, b1; };

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
__device__ __forceinline__ void set_scales(Unit& o, float a0, float b0, float a1, float b1) {
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
// Needs cols % 32 == 0 (the op layer routes other shapes elsewhere).
__device__ __forceinline__ void load_unit(const WeightRef& w, i64 row, int u, Unit& o) {
  set_scales(o, 1.f, 0.f, 1.f, 0.f);
  const i64 base = row * w.cols + (i64)u * 32;
#if WTYPE == GGML_F32
  const float4* p = reinterpret_cast<const float4*>(reinterpret_cast<const float*>(w.p0) + base);
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const float4 v = p[i];
    o.q[4 * i] = v.x; o.q[4 * i + 1] = v.y; o.q[4 * i + 2] = v.z; o.q[4 * i + 3] = v.w;
  }
#else
  const uint4* p = reinterpret_cast<const uint4*>(reinterpret_cast<const u16*>(w.p0) + base);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const uint4 v = p[i];
    const u32 words[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int k = 0; k < 8; ++k) {
      const u16 h = (u16)(words[k >> 1] >> (16 * (k & 1)));
#if WTYPE == GGML_F16
      o.q[8 * i + k] = f16_to_f32(h);
#else
      o.q[8 * i + k] = bf16_to_f32(h);
#endif
    }
  }
#endif
}

#else  // quantized types
#define IS_FLOAT 0

#if WTYPE == GGML_Q4_0
// planes: p0 = qs[16], p1 = d
#define QK 32
#define HAS_MIN 0
__device__ __forceinline__ void load_block_unit(const WeightRef& w, i64 blk, int sub, Unit& o) {
  const uint4 v = ld_u128(w.p0 + blk * 16);
  const float d = f16_to_f32(ld_u16(w.p1 + blk * 2));
#pragma unroll
  for (int j = 0; j < 16; ++j) {
    const u32 b = byte_of(v, j);
    o.q[j] = (float)(int)(b & 15u) - 8.f;
    o.q[j + 16] = (float)(int)(b >> 4) - 8.f;
  }
  set_scales(o, d, 0.f, d, 0.f);
}

#elif WTYPE == GGML_Q4_1
// planes: p0 = qs[16], p1 = (d, m)
#define QK 32
#define HAS_MIN 1
__device__ __forceinline__ void load_block_unit(const WeightRef& w, i64 blk, int sub, Unit& o) {
  const uint4 v = ld_u128(w.p0 + blk * 16);
  const u32 dm = ld_u32(w.p1 + blk * 4);
  const float d = f16_to_f32((u16)dm), m = f16_to_f32((u16)(dm >> 16));
#pragma unroll
  for (int j = 0; j < 16; ++j) {
    const u32 b = byte_of(v, j);
    o.q[j] = (float)(b & 15u);
    o.q[j + 16] = (float)(b >> 4);
  }
  set_scales(o, d, m, d, m);
}

#elif WTYPE == GGML_Q5_0 || WTYPE == GGML_Q5_1
// planes: p0 = qs[16], p1 = qh (u32: bit j is the 5th bit of element j), p2 = d or (d, m)
#define QK 32
#if WTYPE == GGML_Q5_1
#define HAS_MIN 1
#else
#define HAS_MIN 0
#endif
__device__ __forceinline__ void load_block_unit(const WeightRef& w, i64 blk, int sub, Unit& o) {
  const uint4 v = ld_u128(w.p0 + blk * 16);
  const u32 qh = ld_u32(w.p1 + blk * 4);
#if WTYPE == GGML_Q5_1
  const u32 dm = ld_u32(w.p2 + blk * 4);
  const float d = f16_to_f32((u16)dm), m = f16_to_f32((u16)(dm >> 16));
  const float offset = 0.f;
#else
  const float d = f16_to_f32(ld_u16(w.p2 + blk * 2)), m = 0.f;
  const float offset = 16.f;
#endif
#pragma unroll
  for (int j = 0; j < 16; ++j) {
    const u32 b = byte_of(v, j);
    o.q[j] = (float)(int)((b & 15u) | (((qh >> j) & 1u) << 4)) - offset;
    o.q[j + 16] = (float)(int)((b >> 4) | (((qh >> (j + 16)) & 1u) << 4)) - offset;
  }
  set_scales(o, d, m, d, m);
}

#elif WTYPE == GGML_Q8_0
// planes: p0 = qs[32] (int8), p1 = d
#define QK 32
#define HAS_MIN 0
__device__ __forceinline__ void load_block_unit(const WeightRef& w, i64 blk, int sub, Unit& o) {
  const uint4 lo = ld_u128(w.p0 + blk * 32), hi = ld_u128(w.p0 + blk * 32 + 16);
  const float d = f16_to_f32(ld_u16(w.p1 + blk * 2));
#pragma unroll
  for (int l = 0; l < 32; ++l) o.q[l] = (float)(i8)byte_of2(lo, hi, l);
  set_scales(o, d, 0.f, d, 0.f);
}

#elif WTYPE == GGML_Q2_K
// planes: p0 = qs[64], p1 = scales[16] (low nibble scale, high nibble min), p2 = (d, dmin)
// Unit s: quant byte l of 32 at 32*(s/4), 2-bit field s%4; scales 8*(s/4) + 2*(s%4) + l/16.
#define QK 256
#define HAS_MIN 1
__device__ __forceinline__ void load_block_unit(const WeightRef& w, i64 blk, int sub, Unit& o) {
  const int n = sub >> 2, shift = 2 * (sub & 3);
  const u8* q = w.p0 + blk * 64 + 32 * n;
  const uint4 lo = ld_u128(q), hi = ld_u128(q + 16);
  const u32 sc = ld_u16(w.p1 + blk * 16 + 8 * n + 2 * (sub & 3));
  const u32 dm = ld_u32(w.p2 + blk * 4);
  const float d = f16_to_f32((u16)dm), dmin = f16_to_f32((u16)(dm >> 16));
#pragma unroll
  for (int l = 0; l < 32; ++l) o.q[l] = (float)((byte_of2(lo, hi, l) >> shift) & 3u);
  set_scales(o, d * (float)(sc & 15u), -dmin * (float)((sc >> 4) & 15u),
             d * (float)((sc >> 8) & 15u), -dmin * (float)((sc >> 12) & 15u));
}

#elif WTYPE == GGML_Q3_K
// planes: p0 = qs[64] (low 2 bits), p1 = hmask[32] (3rd bit, set = no -4), p2 = scales[12], p3 = d
// Unit s: byte l at 32*(s/4) field s%4, hmask bit s of byte l; 6-bit scales 8*(s/4)+2*(s%4)+l/16.
#define QK 256
#define HAS_MIN 0
__device__ __forceinline__ u32 q3k_scale_byte(const u32* sw, int k) { return (sw[k >> 2] >> (8 * (k & 3))) & 0xffu; }
__device__ __forceinline__ float q3k_scale(const u32* sw, int i) {
  const u32 low = i < 8 ? (q3k_scale_byte(sw, i) & 15u) : (q3k_scale_byte(sw, i - 8) >> 4);
  const u32 high = (q3k_scale_byte(sw, 8 + (i & 3)) >> (2 * (i >> 2))) & 3u;
  return (float)((int)(low | (high << 4)) - 32);
}
__device__ __forceinline__ void load_block_unit(const WeightRef& w, i64 blk, int sub, Unit& o) {
  const int n = sub >> 2, shift = 2 * (sub & 3);
  const u8* q = w.p0 + blk * 64 + 32 * n;
  const uint4 lo = ld_u128(q), hi = ld_u128(q + 16);
  const uint4 hlo = ld_u128(w.p1 + blk * 32), hhi = ld_u128(w.p1 + blk * 32 + 16);
  const u8* s = w.p2 + blk * 12;
  const u32 sw[3] = {ld_u32(s), ld_u32(s + 4), ld_u32(s + 8)};
  const float d = f16_to_f32(ld_u16(w.p3 + blk * 2));
#pragma unroll
  for (int l = 0; l < 32; ++l) {
    const int low = (int)((byte_of2(lo, hi, l) >> shift) & 3u);
    const int high_set = (int)((byte_of2(hlo, hhi, l) >> sub) & 1u);
    o.q[l] = (float)(low - (high_set ? 0 : 4));
  }
  const int i0 = 8 * n + 2 * (sub & 3);
  set_scales(o, d * q3k_scale(sw, i0), 0.f, d * q3k_scale(sw, i0 + 1), 0.f);
}

#elif WTYPE == GGML_Q4_K || WTYPE == GGML_Q5_K
// Q4_K planes: p0 = qs[128], p1 = meta[16] = (d, dmin, scales[12])
// Q5_K planes: p0 = qs[128], p1 = qh[32], p2 = meta[16]
// Unit s: byte l at 32*(s/2), nibble s%2 (+ 16 * bit s of qh[l]); 6-bit scale/min s.
#define QK 256
#define HAS_MIN 1
__device__ __forceinline__ void load_block_unit(const WeightRef& w, i64 blk, int sub, Unit& o) {
  const u8* q = w.p0 + blk * 128 + 32 * (sub >> 1);
  const uint4 lo = ld_u128(q), hi = ld_u128(q + 16);
  const int shift = 4 * (sub & 1);
#if WTYPE == GGML_Q5_K
  const uint4 hlo = ld_u128(w.p1 + blk * 32), hhi = ld_u128(w.p1 + blk * 32 + 16);
  const uint4 meta = ld_u128(w.p2 + blk * 16);
#else
  const uint4 meta = ld_u128(w.p1 + blk * 16);
#endif
  const float d = f16_to_f32((u16)meta.x), dmin = f16_to_f32((u16)(meta.x >> 16));
  // scales[k] is byte 4 + k of meta.
  u32 sc, mn;
  if (sub < 4) {
    sc = byte_of(meta, 4 + sub) & 63u;
    mn = byte_of(meta, 8 + sub) & 63u;
  } else {
    sc = (byte_of(meta, 8 + sub) & 15u) | ((byte_of(meta, sub) >> 6) << 4);
    mn = (byte_of(meta, 8 + sub) >> 4) | ((byte_of(meta, 4 + sub) >> 6) << 4);
  }
#pragma unroll
  for (int l = 0; l < 32; ++l) {
    u32 v = (byte_of2(lo, hi, l) >> shift) & 15u;
#if WTYPE == GGML_Q5_K
    v |= ((byte_of2(hlo, hhi, l) >> sub) & 1u) << 4;
#endif
    o.q[l] = (float)v;
  }
  const float a = d * (float)sc, b = -dmin * (float)mn;
  set_scales(o, a, b, a, b);
}

#elif WTYPE == GGML_Q6_K
// planes: p0 = ql[128], p1 = qh[64], p2 = scales[16] (int8), p3 = d
// Unit s (n = s/4, r = s%4): ql byte 64n + 32(r&1) + l nibble r/2, qh byte 32n + l bits 2r..2r+1,
// scale 8n + 2r + l/16.
#define QK 256
#define HAS_MIN 0
__device__ __forceinline__ void load_block_unit(const WeightRef& w, i64 blk, int sub, Unit& o) {
  const int n = sub >> 2, r = sub & 3;
  const u8* ql = w.p0 + blk * 128 + 64 * n + 32 * (r & 1);
  const u8* qh = w.p1 + blk * 64 + 32 * n;
  const uint4 llo = ld_u128(ql), lhi = ld_u128(ql + 16), hlo = ld_u128(qh), hhi = ld_u128(qh + 16);
  const int lshift = 4 * (r >> 1), hshift = 2 * r;
  const u32 sc = ld_u16(w.p2 + blk * 16 + 8 * n + 2 * r);
  const float d = f16_to_f32(ld_u16(w.p3 + blk * 2));
#pragma unroll
  for (int l = 0; l < 32; ++l) {
    const u32 v = ((byte_of2(llo, lhi, l) >> lshift) & 15u) | (((byte_of2(hlo, hhi, l) >> hshift) & 3u) << 4);
    o.q[l] = (float)((int)v - 32);
  }
  set_scales(o, d * (float)(i8)(sc & 0xffu), 0.f, d * (float)(i8)(sc >> 8), 0.f);
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

// Weight unit times 32 activations (16-byte aligned), scales applied once per half.
__device__ __forceinline__ float unit_dot(const Unit& w, const float* x) {
  const float4* xv = reinterpret_cast<const float4*>(x);
  float s[2] = {0.f, 0.f}, t[2] = {0.f, 0.f};
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const float4 v = xv[i];
    const int h = i >> 2;
    s[h] += w.q[4 * i] * v.x + w.q[4 * i + 1] * v.y + w.q[4 * i + 2] * v.z + w.q[4 * i + 3] * v.w;
#if HAS_MIN
    t[h] += (v.x + v.y) + (v.z + v.w);
#endif
  }
  return w.a0 * s[0] + w.b0 * t[0] + w.a1 * s[1] + w.b1 * t[1];
}
"#;
