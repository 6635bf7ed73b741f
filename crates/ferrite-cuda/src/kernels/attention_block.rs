//! `attention_block`: the attention half of a one-token decoder layer in one launch: the QKV
//! projection, RoPE and the K/V store, attention, and the output projection with the residual,
//! which in separate kernels are three dependent launches (docs/perf.md: each costs ~2 µs of a
//! small model's step, ~1.2 µs of it the launch boundary itself).
//!
//! A block per query head. Before waiting for the previous kernel, each block copies into its
//! shared memory what no earlier kernel of the step writes: its QKV rows (the head's query rows,
//! its KV group's key and value rows), its columns of the output projection (the head's units of
//! every row), and its group's cached K/V rows before the step's position. After the wait it
//! multiplies the int8 input (the previous kernel's hand-off, the RMSNorm finished here) by its
//! QKV rows, rotates, stores the group's new K/V row (the group's first head), attends (a lane
//! per key), quantizes its output and multiplies it by its output-projection columns: a partial
//! sum of every output row. The last block to arrive (an atomic counter) adds the heads'
//! partial sums to the residual in head order, stores the stream and, for the next linear,
//! quantizes it (times that linear's RMSNorm weight, with the sums of squares), as `gemv_q8`'s
//! `EMIT == 2` does. The counter is back at zero when the launch ends, so a graph replays it.
//!
//! Shared memory bounds the shapes: a head's QKV rows and output columns must fit, with room for
//! the cached rows of the contexts it serves (`kv_rows`; rows past them are read from the cache
//! in global memory, correct but slow, so the executor switches to the separate kernels there).

use super::attention::KV;
use super::cluster::{ClusterLayerVariant, LAYER_COMMON};
use super::common::{HEADER, QUANT};
use super::quantize::Q8_BLOCK;
use super::rope::ROPE_ANGLE;
use super::{device_params, KernelVariant};
use crate::kernels::attention::KvDtype;
use cudarc::driver::LaunchConfig;
use ferrite_gguf::GgmlType;

device_params! {
    /// Weights by their planes 0 and 1; `xq`/`xs` (and `in_partials` when `in_norm`) the int8
    /// input of the QKV projection; `residual` the layer's input stream and `out` the stream
    /// after attention (they may be one buffer: each element is read, then written, by one
    /// thread of the last block). `partials` holds `n_heads x dim` floats, `counter` one u32,
    /// zero between launches. `emit_q == 0`: no int8 hand-off; `emit_norm == 0`: codes of the
    /// stream itself, without sums of squares.
    pub struct AttentionBlockParams {
        pub wqkv0: u64,
        pub wqkv1: u64,
        pub wo0: u64,
        pub wo1: u64,
        pub xq: u64,
        pub xs: u64,
        pub in_partials: u64,
        pub residual: u64,
        pub out: u64,
        pub k_cache: u64,
        pub v_cache: u64,
        pub positions: u64,
        pub error_flag: u64,
        pub partials: u64,
        pub counter: u64,
        pub emit_q: u64,
        pub emit_s: u64,
        pub emit_norm: u64,
        pub emit_partials: u64,
        pub dim: u32,
        pub n_heads: u32,
        pub n_kv_heads: u32,
        pub max_seq: u32,
        pub rot_dim: u32,
        /// Cached rows per block in shared memory (positions `0 .. min(pos, kv_rows)`).
        pub kv_rows: u32,
        /// 1: the input codes are of `x * norm weight`; finish the norm from `in_partials`.
        pub in_norm: u32,
        pub emit_add_one: u32,
        pub in_eps: f32,
        pub theta: f32,
        pub freq_scale: f32,
        pub scale: f32,
    }
}

const SOURCE: &str = r#"
// A staged cache row: HEAD_DIM values and 16 bytes of padding, so that lanes scoring different
// keys read different banks.
#define KV_STRIDE (HEAD_DIM + 16 / (int)sizeof(kv_t))
#define UH (HEAD_DIM / 32)
#if NWARPS < UH
#error "attention_block quantizes its output a warp per 32 values: NTHREADS / 32 >= HEAD_DIM / 32"
#endif

__device__ __forceinline__ u8* align16(u8* p) { return reinterpret_cast<u8*>(((u64)p + 15) & ~(u64)15); }

extern "C" __global__ void __launch_bounds__(NTHREADS, 1) attention_block(const AttentionBlockParams p) {
  extern __shared__ __align__(16) u8 smem[];
  __shared__ bool s_last;
  const u32 h = blockIdx.x, tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const u32 heads_per_kv = p.n_heads / p.n_kv_heads, g = h / heads_per_kv;
  const u32 q_dim = p.n_heads * HEAD_DIM, kv_dim = p.n_kv_heads * HEAD_DIM;
  const u32 ud = p.dim / 32, uq = q_dim / 32;

  // Shared memory (AttentionBlockVariant::smem_bytes has the same layout): QKV rows (q of the
  // head, k and v of its group: 3 x HEAD_DIM rows), output-projection columns (dim x UH units),
  // staged K and V rows, floats, int8 codes.
  u8* wq0 = smem;
  u8* wq1 = wq0 + round16(3 * HEAD_DIM * ud * PLANE0);
  u8* wo0 = wq1 + round16(3 * HEAD_DIM * ud * PLANE1);
  u8* wo1 = wo0 + round16(p.dim * UH * PLANE0);
  kv_t* ks = reinterpret_cast<kv_t*>(wo1 + round16(p.dim * UH * PLANE1));
  kv_t* vs = ks + (u64)p.kv_rows * KV_STRIDE;
  float* qkv = reinterpret_cast<float*>(align16(reinterpret_cast<u8*>(vs + (u64)p.kv_rows * KV_STRIDE)));
  float* qr = qkv + 3 * HEAD_DIM;  // the rotated query, key and value
  float* kr = qr + HEAD_DIM;
  float* vr = kr + HEAD_DIM;
  float* merge = vr + HEAD_DIM;              // NWARPS x (HEAD_DIM + 2): the warps' softmax states
  float* red = merge + NWARPS * (HEAD_DIM + 2);  // 32 floats: block reductions
  i8* xq = reinterpret_cast<i8*>(align16(reinterpret_cast<u8*>(red + 32)));
  i8* oq = xq + round16(p.dim);              // the head's output, int8
  uint2* xs = reinterpret_cast<uint2*>(oq + HEAD_DIM);
  uint2* os = xs + ud;

  // Weights and the cached rows before the step's position: nothing of this step writes them.
  // Positions are copied in by the host before the step's first kernel.
  const u32 pos_in = reinterpret_cast<const u32*>(p.positions)[0];
  const bool bad_pos = pos_in >= p.max_seq;
  const u32 pos = bad_pos ? 0 : pos_in;
  const u32 first_rows[3] = {h * HEAD_DIM, q_dim + g * HEAD_DIM, q_dim + kv_dim + g * HEAD_DIM};
#pragma unroll
  for (int m = 0; m < 3; ++m)
    stage_units(wq0 + m * HEAD_DIM * ud * PLANE0, wq1 + m * HEAD_DIM * ud * PLANE1, (const u8*)p.wqkv0, (const u8*)p.wqkv1, first_rows[m], HEAD_DIM, ud, 0, ud);
  stage_units(wo0, wo1, (const u8*)p.wo0, (const u8*)p.wo1, 0, p.dim, uq, h * UH, UH);
  const u32 staged = min(pos, p.kv_rows);
  const i64 cache_row = (i64)p.n_kv_heads * HEAD_DIM;  // elements between positions
  const kv_t* kc = reinterpret_cast<const kv_t*>(p.k_cache) + (i64)g * HEAD_DIM;
  const kv_t* vc = reinterpret_cast<const kv_t*>(p.v_cache) + (i64)g * HEAD_DIM;
  copy_rows_async(reinterpret_cast<u8*>(ks), KV_STRIDE * sizeof(kv_t), reinterpret_cast<const u8*>(kc), HEAD_DIM * sizeof(kv_t), cache_row * sizeof(kv_t), staged);
  copy_rows_async(reinterpret_cast<u8*>(vs), KV_STRIDE * sizeof(kv_t), reinterpret_cast<const u8*>(vc), HEAD_DIM * sizeof(kv_t), cache_row * sizeof(kv_t), staged);
  copy_commit();

  pdl_wait();
  pdl_release();
  if (bad_pos && h == 0 && tid == 0) report_error(p.error_flag, ERR_POSITION, pos_in);

  // The int8 input, and 1 / rms when its codes are of x * norm weight.
  for (u32 i = tid; i < 2 * ud; i += NTHREADS) reinterpret_cast<int4*>(xq)[i] = reinterpret_cast<const int4*>(p.xq)[i];
  for (u32 i = tid; i < ud; i += NTHREADS) xs[i] = reinterpret_cast<const uint2*>(p.xs)[i];
  float inv = 1.f;
  if (p.in_norm) {
    float ss = 0.f;
    for (u32 i = tid; i < ud; i += NTHREADS) ss += reinterpret_cast<const float*>(p.in_partials)[i];
    inv = 1.f / sqrtf(block_sum(ss, red) / (float)p.dim + p.in_eps);
  }
  copy_wait<0>();

  // The head's query, key and value.
  const Rows wqkv = {wq0, wq1, 0, 3 * HEAD_DIM, ud};
  gemv_rows<1>(&wqkv, xq, xs, [&](u32 i, float v, float) {
    if (lane == 0) qkv[i] = v * inv;
  });
  __syncthreads();
  rotate_head(qkv, qkv + HEAD_DIM, qkv + 2 * HEAD_DIM, qr, kr, vr, pos, p.rot_dim, p.theta, p.freq_scale);
  __syncthreads();
  if (h % heads_per_kv == 0 && !bad_pos)
    for (u32 i = tid; i < HEAD_DIM; i += NTHREADS) {
      const i64 at = (i64)pos * cache_row + (i64)g * HEAD_DIM + i;
      kv_store(reinterpret_cast<kv_t*>(p.k_cache), at, kr[i]);
      kv_store(reinterpret_cast<kv_t*>(p.v_cache), at, vr[i]);
    }

  // Attention over keys 0..pos: warp w takes batches of 32 keys (w * 32, then NWARPS * 32 on),
  // a lane scores one key; the warp updates its online softmax once per batch, then weighs the
  // batch's V rows, lane l summing dims l * HD_LANE .. + HD_LANE. The new key comes from kr / vr.
  float o[HD_LANE], m = NEG_INF, l = 0.f;
#pragma unroll
  for (int e = 0; e < HD_LANE; ++e) o[e] = 0.f;
  for (u32 base = warp * 32; base <= pos; base += NWARPS * 32) {
    const u32 j = base + lane;
    float s = NEG_INF;
    if (j <= pos) {
      float dot = 0.f;
      if (j == pos) {
        for (int d = 0; d < HEAD_DIM; ++d) dot += qr[d] * kr[d];
      } else {
        const kv_t* krow = j < staged ? ks + (u64)j * KV_STRIDE : kc + (i64)j * cache_row;
#pragma unroll
        for (int c = 0; c < HEAD_DIM / KV_VEC; ++c) {
          float kk[KV_VEC];
          kv_load_vec(krow + c * KV_VEC, kk);
#pragma unroll
          for (int e = 0; e < KV_VEC; ++e) dot += qr[c * KV_VEC + e] * kk[e];
        }
      }
      s = dot * p.scale;
    }
    const float m_new = fmaxf(m, warp_max(s));  // finite: lane 0's key is in range
    const float corr = expf(m - m_new), pj = j <= pos ? expf(s - m_new) : 0.f;
    l = l * corr + warp_sum(pj);
#pragma unroll
    for (int e = 0; e < HD_LANE; ++e) o[e] *= corr;
    m = m_new;
    const u32 count = min(32u, pos + 1 - base);
    for (u32 jj = 0; jj < count; ++jj) {
      const float w = __shfl_sync(FULL_MASK, pj, jj);
      const u32 key = base + jj, d0 = lane * HD_LANE;
#pragma unroll
      for (int e = 0; e < HD_LANE; ++e) {
        const float v = key == pos ? vr[d0 + e] : key < staged ? kv_load(vs, (i64)key * KV_STRIDE + d0 + e) : kv_load(vc, (i64)key * cache_row + d0 + e);
        o[e] += w * v;
      }
    }
  }
  float* mine = merge + warp * (HEAD_DIM + 2);
#pragma unroll
  for (int e = 0; e < HD_LANE; ++e) mine[lane * HD_LANE + e] = o[e];
  if (lane == 0) {
    mine[HEAD_DIM] = m;
    mine[HEAD_DIM + 1] = l;
  }
  __syncthreads();
  // The warps' states merged, and the head's output quantized: warp c takes dims 32c .. 32c + 31.
  if (warp < UH) {
    const u32 d = 32 * warp + lane;
    float mm = NEG_INF;
    for (u32 w = 0; w < NWARPS; ++w) mm = fmaxf(mm, merge[w * (HEAD_DIM + 2) + HEAD_DIM]);
    float num = 0.f, den = 0.f;
    for (u32 w = 0; w < NWARPS; ++w) {
      const float* st = merge + w * (HEAD_DIM + 2);
      const float f = st[HEAD_DIM] == NEG_INF ? 0.f : expf(st[HEAD_DIM] - mm);  // a warp without keys adds nothing
      num += f * st[d];
      den += f * st[HEAD_DIM + 1];
    }
    quantize_block_warp(num / den, lane, oq + 32 * warp, os + warp);
  }
  __syncthreads();

  // The head's share of every output row: its output times its columns of the projection.
  {
    const WeightRef wo = {wo0, wo1, wo1, wo1, (i64)UH * 32};
    const int4* o4 = reinterpret_cast<const int4*>(oq);
    float* part = reinterpret_cast<float*>(p.partials) + (u64)h * p.dim;
    for (u32 r = tid; r < p.dim; r += NTHREADS) {
      float acc = 0.f;
#pragma unroll
      for (int u = 0; u < UH; ++u) {
        Unit wu;
        load_unit(wo, r, u, wu);
        const uint2 sc = os[u];
        acc += unit_dot_q8(wu, o4[2 * u], o4[2 * u + 1], __uint_as_float(sc.x), (float)(int)(short)(sc.y & 0xffffu), (float)((int)sc.y >> 16));
      }
      part[r] = acc;
    }
  }
  __threadfence();
  __syncthreads();
  if (tid == 0) {
    u32* counter = reinterpret_cast<u32*>(p.counter);
    s_last = atomicAdd(counter, 1u) == gridDim.x - 1;
    if (s_last) *counter = 0;  // every head has arrived: ready for the next launch
  }
  __syncthreads();
  if (!s_last) return;
  __threadfence();

  // The last block: the stream after attention, and the next linear's int8 input.
  const float* parts = reinterpret_cast<const float*>(p.partials);
  const float* res = reinterpret_cast<const float*>(p.residual);
  float* out = reinterpret_cast<float*>(p.out);
  for (u32 c = warp; c < ud; c += NWARPS) {
    const u32 r = 32 * c + lane;
    float v = res[r];
    for (u32 b = 0; b < gridDim.x; ++b) v += __ldcg(parts + (u64)b * p.dim + r);
    if (bad_pos) v = QNAN;
    out[r] = v;
    if (p.emit_q) {
      float x = v;
      if (p.emit_norm) {
        const float ss = warp_sum(v * v);
        if (lane == 0) reinterpret_cast<float*>(p.emit_partials)[c] = ss;
        const float gw = reinterpret_cast<const float*>(p.emit_norm)[r];
        x = v * (p.emit_add_one ? 1.f + gw : gw);
      }
      quantize_block_warp(x, lane, reinterpret_cast<i8*>(p.emit_q) + 32 * c, reinterpret_cast<uint2*>(p.emit_s) + c);
    }
  }
}
"#;

/// `attention_block` for one weight type (the QKV and output projections share it), head size,
/// RoPE pairing and cache type; [`Self::THREADS`] threads per block.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct AttentionBlockVariant {
    pub wtype: GgmlType,
    pub head_dim: u32,
    pub neox: bool,
    pub kv: KvDtype,
}

impl AttentionBlockVariant {
    pub const THREADS: u32 = 256;

    /// Whether the kernel runs `wtype` weights.
    pub fn supports(wtype: GgmlType) -> bool {
        ClusterLayerVariant::plane_bytes(wtype).is_some()
    }

    /// Bytes of one staged cache row pair (K and V, padded as `KV_STRIDE`).
    pub fn kv_row_bytes(&self) -> usize {
        2 * (self.head_dim as usize * self.kv.bytes() + 16)
    }

    /// Dynamic shared memory of a block for a stream of `dim` values with `kv_rows` staged cache
    /// rows (the kernel's layout).
    pub fn smem_bytes(&self, dim: usize, kv_rows: usize) -> usize {
        let (b0, b1) = ClusterLayerVariant::plane_bytes(self.wtype).unwrap_or((0, 0));
        let (hd, ud, uh) = (self.head_dim as usize, dim / 32, self.head_dim as usize / 32);
        let r16 = |n: usize| n.next_multiple_of(16);
        let weights = r16(3 * hd * ud * b0) + r16(3 * hd * ud * b1) + r16(dim * uh * b0) + r16(dim * uh * b1);
        let warps = (Self::THREADS / 32) as usize;
        let floats = 4 * (6 * hd + warps * (hd + 2) + 32);
        let codes = r16(dim) + hd + 8 * (ud + uh);
        weights + r16(kv_rows * self.kv_row_bytes()) + r16(floats) + codes
    }

    pub fn launch_config(&self, n_heads: usize, dim: usize, kv_rows: usize) -> LaunchConfig {
        LaunchConfig { grid_dim: (n_heads as u32, 1, 1), block_dim: (Self::THREADS, 1, 1), shared_mem_bytes: self.smem_bytes(dim, kv_rows) as u32 }
    }
}

impl KernelVariant for AttentionBlockVariant {
    const FAMILY: &'static str = "attention_block";
    const SOURCES: &'static [&'static str] = &[HEADER, QUANT, Q8_BLOCK, KV, ROPE_ANGLE, LAYER_COMMON, AttentionBlockParams::C_DECL, SOURCE];
    const ENTRY_POINTS: &'static [&'static str] = &["attention_block"];

    fn macros(&self) -> Vec<(&'static str, String)> {
        vec![
            ("WTYPE", (self.wtype as u32).to_string()),
            ("NTHREADS", Self::THREADS.to_string()),
            ("HEAD_DIM", self.head_dim.to_string()),
            ("NEOX", u32::from(self.neox).to_string()),
            ("KV_F16", u32::from(self.kv == KvDtype::F16).to_string()),
            ("PAGED", "0".to_string()),
        ]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn macros_match_source() {
        crate::kernels::tests::assert_macros_match(AttentionBlockVariant { wtype: GgmlType::Q4_1, head_dim: 64, neox: false, kv: KvDtype::F16 });
    }
}
