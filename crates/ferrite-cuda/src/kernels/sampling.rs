//! Token selection on the device, so that only the chosen id (4 bytes) is read back.
//!
//! `argmax`: first index of the largest logit (NaN counts as smallest).
//! `sample`: llama.cpp's chain, as ferrite-engine's host sampler runs it: top-k, then top-p and
//! min-p judged on temperature-1 probabilities, then temperature on the survivors and one draw
//! from a counter-based RNG keyed by (seed, step). Thresholds are found over the logits' ordered
//! bit patterns (top-p's four bits per pass) with fixed-order block reductions, and the draw
//! walks the vocabulary in index order (each warp a contiguous share, coalesced), so the same
//! (logits, seed, step) always gives the same token.
//! top-k is a radix select (up to 4 histogram passes); when at most 1024 tokens survive it, they
//! are gathered into shared memory and the later filters run on them alone (at most 64, as after
//! top-k 40: by one warp, without block barriers). With a candidate list (`topk_candidates`, a
//! block per chunk of 1024 logits, for top-k up to 1024) the single `sample` block looks only at
//! the chunks' own top-k (up to twice as many, which spares their selects a pass or two), which
//! hold the vocabulary's: the same token, from a few thousand logits instead of the whole
//! vocabulary (up to `CANDIDATE_CAP` of them; more, and it reads the whole row).
//! With top-k off and a scratch, a draw runs a block per chunk of 1024 logits in each of a few
//! launches: top-p's cut by digits (`sample_pass`, a launch per digit, every block adding the
//! chunks' bins of the launch before in the same fixed order), then the chunks' masses under the
//! cut, the chunk holding the draw and a walk inside it (`sample_chunks`).
//! With a list of draws (`RowDraw`), one launch draws from many rows (a batched step's
//! sequences), a block per draw, each as a launch of its own would.
//! [`sampling_uniform`] reproduces the draw on the host.

use super::common::HEADER;
use super::{device_params, KernelVariant};
use cudarc::driver::LaunchConfig;

device_params! {
    pub struct ArgmaxParams {
        pub logits: u64,
        pub out: u64,
        pub n: u32,
        pub pad: u32,
    }
}

device_params! {
    pub struct SampleParams {
        pub logits: u64,
        pub out: u64,
        /// 0, or a device `u32` added to `step` (e.g. the token's position).
        pub step_ptr: u64,
        pub seed: u64,
        pub step: u64,
        /// 0, or the next decode step's inputs: the token goes to `feed_ids[0]`, and
        /// `next_pos` to `feed_pos[0]` (with `advance`: `feed_pos[0] + 1`; see
        /// `ops::TokenDelivery`).
        pub feed_ids: u64,
        pub feed_pos: u64,
        /// 0, or a device-mapped host `u32 [4]` (with `advance`, two of them): token, the device
        /// error flag's two words, `tag`.
        pub mailbox: u64,
        pub error_flag: u64,
        /// 0, or `topk_candidates`' output for these logits: per chunk of `BLOCK_SIZE` logits the
        /// indices of its candidates (`[n_chunks, BLOCK_SIZE]`) and their count (`[n_chunks]`).
        pub cand: u64,
        pub cand_counts: u64,
        /// `argmax_chunks`' running best, a `u64`, and its blocks' arrival counter, a `u32`
        /// (`fold_best`; both zero between launches).
        pub best: u64,
        pub arrivals: u64,
        /// 0, or the chunk shares of a draw by chunks (`sample_pass`, `sample_chunks`:
        /// `[35 * n_chunks + 8]` words: maxima, masses, tokens, top-p's bins, the cut's state).
        pub stats: u64,
        /// 0, or a draw per block (`RowDraw[gridDim.x]`): block b draws from row `rows[b].row` of
        /// `n` logits with that draw's settings (the ones below are ignored), writes `out[row]`
        /// and keeps its candidates in part b of the scratch (`[n_chunks * BLOCK_SIZE]` each).
        pub rows: u64,
        pub n_chunks: u32,
        pub n: u32,
        pub top_k: u32,
        pub temperature: f32,
        pub top_p: f32,
        pub min_p: f32,
        pub next_pos: u32,
        pub tag: u32,
        /// 1: a draw replayed at the end of a decode step's graph, whose position only the device
        /// knows: the next position is `feed_pos[0] + 1`, it is also the tag, and the mailbox is a
        /// pair of 4-word slots, the next position's parity picking one (the host reads the other
        /// while the next step runs).
        pub advance: u32,
        /// With `cand`: how many candidates the sampling block gathers at most (`u32`s of its
        /// dynamic shared memory); more, and it reads the whole row instead.
        pub cand_cap: u32,
        /// A draw by chunks: this `sample_pass` launch's pass, of `passes` (0: no cut to find).
        pub pass: u32,
        pub passes: u32,
    }
}

device_params! {
    /// One draw of a multi-row `sample` launch: its logits row and settings (as `SampleParams`').
    pub struct RowDraw {
        pub seed: u64,
        pub step: u64,
        pub temperature: f32,
        pub top_p: f32,
        pub min_p: f32,
        pub top_k: u32,
        pub row: u32,
        pub pad: u32,
    }
}

device_params! {
    pub struct CandidateParams {
        pub logits: u64,
        pub cand: u64,
        pub cand_counts: u64,
        /// 0, or `SampleParams::rows`: grid row y keeps the candidates of draw y's logits row
        /// (with its top-k) in part y of `cand` / `cand_counts`; draws that take none return.
        pub rows: u64,
        pub n: u32,
        pub top_k: u32,
        /// The sampling block's `cand_cap`: a chunk may keep up to its share of it (at most twice
        /// its top-k), so that its select can stop early.
        pub cand_cap: u32,
        pub pad: u32,
    }
}

/// Device code of the draws: a logit's ordered key, the packed running best the blocks of a
/// launch fold their bests into, and the token's delivery.
pub const DRAW: &str = r#"
// Monotone map of floats to u32 (larger float -> larger key); NaN maps to 0, below -inf.
__device__ __forceinline__ u32 order_key(float f) {
  if (f != f) return 0u;
  const u32 b = __float_as_uint(f);
  return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}

// A logit and its index as one u64 whose larger value is the larger logit, then the smaller
// index (its complement below the key).
__device__ __forceinline__ u64 pack_best(float logit, u32 index) { return ((u64)order_key(logit) << 32) | (u64)~index; }

// One thread per block of a launch of `blocks`: folds the block's packed best into *best (a
// u64, zero between launches) and arrives at *arrivals (likewise); the last to arrive resets
// both and returns true with the best's index in `token`.
__device__ __forceinline__ bool fold_best(u64 best_addr, u64 arrivals_addr, u32 blocks, u64 mine, u32& token) {
  u64* best = reinterpret_cast<u64*>(best_addr);
  u32* arrivals = reinterpret_cast<u32*>(arrivals_addr);
  atomicMax(best, mine);
  __threadfence();
  if (atomicAdd(arrivals, 1u) != blocks - 1u) return false;
  // Every block has arrived (each folded its best in before its arrival).
  __threadfence();
  *arrivals = 0u;
  token = ~(u32)atomicExch(best, 0ull);
  return true;
}

// Where a drawn token goes (SampleParams' fields of the same names).
struct Delivery {
  u64 out, feed_ids, feed_pos, mailbox, error_flag;
  u32 next_pos, tag, advance;
};

// The chosen token (one thread): to out[0] and, when asked, on to the next decode step (its
// input id and position) and to the host's mailbox with the error flag. The tag goes last, so
// a mailbox holding this call's tag holds this call's token.
__device__ __forceinline__ void deliver_token(const Delivery& d, u32 token) {
  reinterpret_cast<u32*>(d.out)[0] = token;
  u32 next_pos = d.next_pos, tag = d.tag;
  volatile u32* m = reinterpret_cast<volatile u32*>(d.mailbox);
  if (d.advance) {
    next_pos = reinterpret_cast<const u32*>(d.feed_pos)[0] + 1u;
    tag = next_pos;
    m += 4u * (next_pos & 1u);  // Mailbox::SLOT_WORDS
  }
  if (d.feed_ids) {
    reinterpret_cast<u32*>(d.feed_ids)[0] = token;
    reinterpret_cast<u32*>(d.feed_pos)[0] = next_pos;
  }
  if (d.mailbox) {
    const volatile u32* flag = reinterpret_cast<const volatile u32*>(d.error_flag);
    m[0] = token;
    m[1] = flag[0];
    m[2] = flag[1];
    m[3] = tag;  // the host reads after an event behind this kernel: no system fence needed
  }
}
"#;

const SOURCE: &str = r#"
#ifndef BLOCK_SIZE
#error "BLOCK_SIZE (threads of a sampling block, and logits per candidate chunk) must come from the kernel variant"
#endif
#define NO_INDEX 0xffffffffu
// Most survivors of top-k whose draw one warp finishes (`finish_in_warp`): top-k 40 or 50 and
// their ties, without a block barrier after the gather.
#define FINISH_CAP 64u

// (key, index) pairs: larger key wins, then smaller index.
__device__ __forceinline__ void keep_better(u32& key, u32& idx, u32 k2, u32 i2) {
  if (k2 > key || (k2 == key && i2 < idx)) { key = k2; idx = i2; }
}

// The logits a draw looks at, in index order: all of them, or the gathered candidates
// (`idx`, ascending) of a top-k draw.
struct Elements {
  const float* logits;
  const u32* idx;  // nullptr: element e is token e
  u32 m;
  __device__ __forceinline__ u32 index(u32 e) const { return idx ? idx[e] : e; }
  __device__ __forceinline__ float logit(u32 e) const { return logits[index(e)]; }
};

// The best of the threads' (key, index) pairs (keep_better), its index returned to every thread.
__device__ u32 block_best(u32 key, u32 idx, u32* s_key, u32* s_idx) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) keep_better(key, idx, __shfl_xor_sync(FULL_MASK, key, o), __shfl_xor_sync(FULL_MASK, idx, o));
  __syncthreads();
  if (lane == 0) { s_key[warp] = key; s_idx[warp] = idx; }
  __syncthreads();
  if (warp == 0) {
    key = lane < BLOCK_SIZE / 32 ? s_key[lane] : 0u;
    idx = lane < BLOCK_SIZE / 32 ? s_idx[lane] : NO_INDEX;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) keep_better(key, idx, __shfl_xor_sync(FULL_MASK, key, o), __shfl_xor_sync(FULL_MASK, idx, o));
    if (lane == 0) s_idx[0] = idx;
  }
  __syncthreads();
  return s_idx[0];
}

// Of elements base .. base + m of s, the one with the largest logit
// (first on ties; NaN never wins), relative to base: by the block, returned to every thread, or
// by one warp, returned to its lanes.
__device__ u32 block_argmax(const Elements& s, u32 base, u32 m, u32* s_key, u32* s_idx) {
  u32 key = 0u, idx = NO_INDEX;
  for (u32 e = threadIdx.x; e < m; e += BLOCK_SIZE) keep_better(key, idx, order_key(s.logit(base + e)), e);
  return block_best(key, idx, s_key, s_idx);
}
__device__ u32 warp_argmax(const Elements& s, u32 base, u32 m) {
  u32 key = 0u, idx = NO_INDEX;
  for (u32 e = threadIdx.x & 31; e < m; e += 32) keep_better(key, idx, order_key(s.logit(base + e)), e);
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) keep_better(key, idx, __shfl_xor_sync(FULL_MASK, key, o), __shfl_xor_sync(FULL_MASK, idx, o));
  return idx;
}

// A threshold th such that at least k of the keys key_of(e), e < m (k <= m), are >= th and at
// most max(max_kept, the keys at or above the k-th largest), returned to every thread: a radix
// select, 8 bits per pass from the top, that stops at the first bucket whose lower edge keeps at
// most max_kept keys (with max_kept = k: only where it keeps the same keys as the k-th largest
// key; otherwise it runs to that key). Lanes adding to the same bin are merged into one shared
// atomic (logits crowd into few top-byte bins), and warp 0 finds each pass's bin with a scan.
template <typename K>
__device__ u32 block_kth_key(u32 m, u32 k, u32 max_kept, K key_of, u32* s_hist, u32* s_radix) {
  const int lane = threadIdx.x & 31;
  const u32 k0 = k;  // k is the rank left within the bucket; k0 - k keys lie above it
  u32 prefix = 0u, mask = 0u;
  for (int shift = 24; shift >= 0; shift -= 8) {
    for (int b = threadIdx.x; b < 256; b += BLOCK_SIZE) s_hist[b] = 0u;
    __syncthreads();
    for (u32 e0 = threadIdx.x - lane; e0 < m; e0 += BLOCK_SIZE) {  // warp-uniform loop
      const u32 e = e0 + lane;
      const u32 key = e < m ? key_of(e) : 0u;
      const bool in = e < m && (key & mask) == prefix;
      const u32 bin = in ? (key >> shift) & 255u : 256u + lane;  // lanes out of play: bins of their own
      const u32 same = __match_any_sync(FULL_MASK, bin);
      if (in && lane == __ffs(same) - 1) atomicAdd(&s_hist[bin], __popc(same));
    }
    __syncthreads();
    if (threadIdx.x < 32) {
      // Lane l owns bins 255 - 8l down to 248 - 8l; counts above a lane's bins by a warp scan.
      u32 own = 0u;
#pragma unroll
      for (int i = 0; i < 8; ++i) own += s_hist[255 - 8 * lane - i];
      u32 above = own;
#pragma unroll
      for (int o = 1; o < 32; o <<= 1) {
        const u32 v = __shfl_up_sync(FULL_MASK, above, o);
        if (lane >= o) above += v;
      }
      above -= own;
      if (above < k && k <= above + own) {  // exactly one lane: the bins hold at least k keys
        int b = 255 - 8 * lane;
        while (above + s_hist[b] < k) above += s_hist[b--];
        s_radix[0] = prefix | ((u32)b << shift);
        s_radix[1] = k - above;
        s_radix[2] = k0 - k + above + s_hist[b] <= max_kept;  // the keys at or above bin b
      }
    }
    __syncthreads();
    prefix = s_radix[0];
    k = s_radix[1];
    mask |= 255u << shift;
    if (s_radix[2]) break;  // block-uniform
  }
  return prefix;
}

// Whether a draw of a multi-row launch takes the two-stage path (as the host decides for one).
__device__ __forceinline__ bool draws_candidates(const RowDraw& d) { return d.temperature > 0.f && d.top_k >= 2u && d.top_k <= BLOCK_SIZE; }

// Stage 1 of a top-k draw over a large vocabulary: block b takes the BLOCK_SIZE logits of chunk
// b, finds the chunk's top_k-th largest key and writes the indices of the logits at or above it
// (ascending) to cand[b * BLOCK_SIZE ...] and their count to counts[b]. The chunk's k-th key is
// at most the vocabulary's, so every token a top-k keeps (ties included) is a candidate.
// With `rows`, grid row y does so for draw y, in part y of cand and counts.
extern "C" __global__ void __launch_bounds__(BLOCK_SIZE) topk_candidates(const CandidateParams p) {
  KERNEL_ENTRY();
  __shared__ u32 s_hist[256], s_radix[3], s_count[32];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  u32 top_k = p.top_k;
  u64 row = 0;
  if (p.rows) {
    const RowDraw d = reinterpret_cast<const RowDraw*>(p.rows)[blockIdx.y];
    if (!draws_candidates(d)) return;  // block-uniform
    top_k = d.top_k;
    row = d.row;
  }
  const u64 chunk = (u64)blockIdx.y * gridDim.x + blockIdx.x;  // this block's part of cand / counts
  const float* logits = reinterpret_cast<const float*>(p.logits) + row * p.n + (u64)blockIdx.x * BLOCK_SIZE;
  const u32 m = min((u32)BLOCK_SIZE, p.n - blockIdx.x * BLOCK_SIZE);
  const u32 key = threadIdx.x < m ? order_key(logits[threadIdx.x]) : 0u;
  u32 th = 1u;  // key 0 is NaN's alone: never a candidate
  // A few more candidates than top_k (up to twice, within the launch's share of the sampling
  // block's list) spare the select its last passes; the second stage finds the exact cut.
  const u32 max_kept = max(top_k, min(2u * top_k, p.cand_cap / gridDim.x));
  if (top_k < m) th = max(1u, block_kth_key(m, top_k, max_kept, [&](u32 e) { return order_key(logits[e]); }, s_hist, s_radix));
  const bool keep = threadIdx.x < m && key >= th;
  // The candidate's place: earlier warps' counts, then earlier lanes'.
  const u32 ballot = __ballot_sync(FULL_MASK, keep);
  if (lane == 0) s_count[warp] = __popc(ballot);
  __syncthreads();
  u32 before = 0u, total = 0u;
  for (int w = 0; w < BLOCK_SIZE / 32; ++w) {
    before += w < warp ? s_count[w] : 0u;
    total += s_count[w];
  }
  if (keep) reinterpret_cast<u32*>(p.cand)[chunk * BLOCK_SIZE + before + __popc(ballot & ((1u << lane) - 1u))] = blockIdx.x * BLOCK_SIZE + threadIdx.x;
  if (threadIdx.x == 0) reinterpret_cast<u32*>(p.cand_counts)[chunk] = total;
}

// One block per row of n logits (a batched step's sequences): out[row] = its argmax.
extern "C" __global__ void __launch_bounds__(BLOCK_SIZE) argmax(const ArgmaxParams p) {
  KERNEL_ENTRY();
  __shared__ u32 s_key[32], s_idx[32];
  const Elements el = {reinterpret_cast<const float*>(p.logits) + (u64)blockIdx.x * p.n, nullptr, p.n};
  const u32 best = block_argmax(el, 0u, el.m, s_key, s_idx);
  if (threadIdx.x == 0) reinterpret_cast<u32*>(p.out)[blockIdx.x] = best;
}

// splitmix64 finaliser; must match sampling_uniform in kernels/sampling.rs.
__device__ __forceinline__ u64 mix64(u64 z) {
  z += 0x9E3779B97F4A7C15ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}
__device__ __forceinline__ float uniform01(u64 seed, u64 step) {
  return (float)(mix64(seed ^ mix64(step)) >> 40) * (1.0f / 16777216.0f);
}

// Exclusive prefix over the warps of a warp-uniform value (`count`, lane 0's counts), summed
// in warp order by every thread (a fixed order: deterministic for floats), and the block's
// total. `s` holds 32 values.
template <typename T>
__device__ T warp_offsets(T v, T* s, T& total) {
  const int warp = threadIdx.x >> 5;
  __syncthreads();  // an earlier call may still be reading s
  if ((threadIdx.x & 31) == 0) s[warp] = v;
  __syncthreads();
  T before = T(0);
  total = T(0);
  for (int w = 0; w < BLOCK_SIZE / 32; ++w) {
    const T t = s[w];
    before += w < warp ? t : T(0);
    total += t;
  }
  return before;
}

// Warp w's share of m elements: a contiguous run of whole 32-element steps, so that the warps'
// shares in warp order, and a share's steps in turn, walk the elements in index order while
// each step's loads are coalesced.
struct Span {
  u32 begin, end;
};
__device__ __forceinline__ Span warp_span(u32 m) {
  const u32 per = (m + BLOCK_SIZE - 1) / BLOCK_SIZE * 32u;
  const u32 begin = min(m, (u32)(threadIdx.x >> 5) * per);
  return {begin, min(m, begin + per)};
}

// Each of 16 bins summed over the block, returned to every thread in `bins`: warp sums, then
// thread d < 16 adds bin d over the warps in order (a fixed order: deterministic). `s` holds
// 16 floats per warp (BLOCK_SIZE / 2).
__device__ void block_sum_bins(float (&bins)[16], float* s) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
  for (int d = 0; d < 16; ++d) bins[d] = warp_sum(bins[d]);
  __syncthreads();  // an earlier user of s may still be reading it
  if (lane == 0) {
#pragma unroll
    for (int d = 0; d < 16; ++d) s[warp * 16 + d] = bins[d];
  }
  __syncthreads();
  float total = 0.f;
  if (threadIdx.x < 16) {
    for (int w = 0; w < BLOCK_SIZE / 32; ++w) total += s[w * 16 + threadIdx.x];
    s[threadIdx.x] = total;  // only this thread read it
  }
  __syncthreads();
#pragma unroll
  for (int d = 0; d < 16; ++d) bins[d] = s[d];
}

// The candidates of `topk_candidates` gathered into s_cand in index order (warp w copies chunks
// w, w + 32, ...); false (nothing gathered) when more than p.cand_cap or no candidate list.
__device__ bool gather_candidates(const SampleParams& p, u32* s_cand, u32* s_end, u32* s_warp, u32* m) {
  if (!p.cand || p.n_chunks > BLOCK_SIZE) return false;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const u32* counts = reinterpret_cast<const u32*>(p.cand_counts);
  const u32 mine = threadIdx.x < p.n_chunks ? counts[threadIdx.x] : 0u;
  u32 end = mine;  // inclusive scan: the warp's, then the earlier warps' total
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const u32 x = __shfl_up_sync(FULL_MASK, end, o);
    if (lane >= o) end += x;
  }
  u32 total;
  end += warp_offsets(__shfl_sync(FULL_MASK, end, 31), s_warp, total);
  if (total == 0u || total > p.cand_cap) return false;  // block-uniform
  s_end[threadIdx.x] = end;
  __syncthreads();
  const u32* cand = reinterpret_cast<const u32*>(p.cand);
  for (u32 c = warp; c < p.n_chunks; c += BLOCK_SIZE / 32) {
    const u32 end = s_end[c], count = counts[c];
    for (u32 j = lane; j < count; j += 32) s_cand[end - count + j] = cand[(u64)c * BLOCK_SIZE + j];
  }
  __syncthreads();
  *m = total;
  return true;
}

// The tokens that survive top-k, in index order: gathered into shared memory (c_logit,
// c_index) or in place among the elements.
struct Survivors {
  bool gathered;
  u32 m;
  const float* c_logit;
  const u32* c_index;
  Elements el;
  __device__ __forceinline__ float logit(u32 e) const { return gathered ? c_logit[e] : el.logit(e); }
  __device__ __forceinline__ u32 index(u32 e) const { return gathered ? c_index[e] : el.index(e); }
  // Call f(logit) for each, strided over the threads so that a warp's loads are coalesced: for
  // sums that need no index order.
  template <typename F>
  __device__ void each_strided(F&& f) const {
    for (u32 e = threadIdx.x; e < m; e += BLOCK_SIZE) f(logit(e));
  }
};

// The chosen token to where this launch's parameters send it (one thread).
__device__ __forceinline__ void deliver(const SampleParams& p, u32 token) {
  deliver_token({p.out, p.feed_ids, p.feed_pos, p.mailbox, p.error_flag, p.next_pos, p.tag, p.advance}, token);
}

// A greedy draw over many chunks in one launch: block b finds the best (key, index) of chunk b
// of BLOCK_SIZE logits and folds it into the running best (fold_best); the last block to
// arrive delivers it, from one thread: no second reduction. Ties go to the smaller index, as in block_argmax.
extern "C" __global__ void __launch_bounds__(BLOCK_SIZE) argmax_chunks(const SampleParams p) {
  KERNEL_ENTRY();
  __shared__ u32 s_key[32], s_idx[32];
  const u32 base = blockIdx.x * BLOCK_SIZE;
  const Elements chunk = {reinterpret_cast<const float*>(p.logits) + base, nullptr, min((u32)BLOCK_SIZE, p.n - base)};
  const u32 e = block_argmax(chunk, 0u, chunk.m, s_key, s_idx);
  u32 token;
  if (threadIdx.x == 0 && fold_best(p.best, p.arrivals, p.n_chunks, pack_best(chunk.logits[e], base + e), token)) deliver(p, token);
}

// This block's draw: the launch's, or with `rows` its own row's (logits, out, settings and part
// of the candidate scratch; the candidates only if stage 1 kept them for it).
__device__ SampleParams block_draw(const SampleParams& launch) {
  SampleParams p = launch;
  if (!launch.rows) return p;
  const RowDraw d = reinterpret_cast<const RowDraw*>(launch.rows)[blockIdx.x];
  p.logits += 4ull * d.row * launch.n;
  p.out += 4ull * d.row;
  p.seed = d.seed;
  p.step = d.step;
  p.temperature = d.temperature;
  p.top_p = d.top_p;
  p.min_p = d.min_p;
  p.top_k = d.top_k;
  if (launch.cand && draws_candidates(d)) {
    p.cand += 4ull * blockIdx.x * launch.n_chunks * BLOCK_SIZE;
    p.cand_counts += 4ull * blockIdx.x * launch.n_chunks;
  } else {
    p.cand = 0;
  }
  return p;
}

// The rest of a draw over at most FINISH_CAP gathered survivors (index order in c_logit /
// c_index, every key >= th), by warp 0 alone, with no block barrier: top-p keeps the survivors
// whose key's mass (theirs and the larger keys') reaches the target, the largest such key
// being the cut; then min-p and the draw. Every sum runs over the survivors in index order on
// one thread: the same survivors always give the same token.
__device__ void finish_in_warp(const SampleParams& p, const float* c_logit, const u32* c_index, u32 m, u32 th, float max_logit, float* s_w, u32* s_k) {
  const int lane = threadIdx.x & 31;
  for (u32 e = lane; e < m; e += 32) {
    s_k[e] = order_key(c_logit[e]);
    s_w[e] = expf(c_logit[e] - max_logit);
  }
  __syncwarp();
  if (p.top_p > 0.f && p.top_p < 1.f) {
    float total = 0.f;
    for (u32 j = 0; j < m; ++j) total += s_w[j];
    const float target = p.top_p * total;
    u32 cut = 0u;
    for (u32 e = lane; e < m; e += 32) {
      float mass = 0.f;
      for (u32 j = 0; j < m; ++j) mass += s_k[j] >= s_k[e] ? s_w[j] : 0.f;
      if (mass >= target) cut = max(cut, s_k[e]);
    }
    th = max(th, __reduce_max_sync(FULL_MASK, cut));
  }
  if (p.min_p > 0.f) th = max(th, min(order_key(max_logit + logf(p.min_p)), order_key(max_logit)));
  const float inv_t = 1.f / p.temperature;
  __syncwarp();  // every lane has read the temperature-1 weights
  for (u32 e = lane; e < m; e += 32) s_w[e] = s_k[e] >= th ? expf((c_logit[e] - max_logit) * inv_t) : 0.f;
  __syncwarp();
  if (lane != 0) return;
  float total = 0.f;
  for (u32 j = 0; j < m; ++j) total += s_w[j];
  const u64 step = p.step + (p.step_ptr ? (u64)reinterpret_cast<const u32*>(p.step_ptr)[0] : 0ull);
  // u < 1, but u * total may round up to total: stay strictly below it.
  const float r = fminf(uniform01(p.seed, step) * total, __uint_as_float(__float_as_uint(total) - 1u));
  float c = 0.f;
  u32 pick = NO_INDEX;
  for (u32 j = 0; j < m; ++j) {
    if (s_w[j] > 0.f) {
      pick = c_index[j];
      c += s_w[j];
      if (c > r) break;
    }
  }
  deliver(p, pick);
}

__device__ __forceinline__ bool is_finite(float x) { return fabsf(x) <= 3.402823466e38f; }

// ---- Draws by chunks ----
// A draw with top-k off over 2 to BLOCK_SIZE chunks of BLOCK_SIZE logits runs a block per chunk
// in each of a few launches, each chunk with its largest logit cmax and first token with it.
// top-p's cut is found a digit of four bits per pass from the top (8 `sample_pass` launches): a
// pass sums, per chunk, the masses (relative to cmax) of the keys under the digits found so far
// into 16 bins by their next digit; every block of the next launch adds the chunks' bins, scaled
// to the largest maximum M, in one fixed order (the same bits in each), and takes the largest
// digit whose bins from the top, with the mass above them, still reach top_p of the total: no
// block waits for another to hand the cut on. min-p's cut needs M alone (one pass).
// Then `sample_chunks`: each chunk's mass at the temperature over the keys that pass the cut,
// the chunk holding the draw (in chunk order), and a walk inside it. At temperature alone one
// `sample` block (rows, or no scratch) draws the same way, a warp per chunk, with the same sums
// in the same order: the same token.

#define NO_DIGIT 16u

// top-p's state between passes: the cut's digits so far (`prefix` under `mask`), the mass of
// the keys above the current bucket, and the target.
struct TopP {
  u32 prefix, mask;
  float above, target;
};

__device__ __forceinline__ bool top_p_on(const SampleParams& p) { return p.top_p > 0.f && p.top_p < 1.f; }

// An element's part in the pass at `shift`: its weight relative to its chunk's largest logit,
// with its digit, or NO_DIGIT (NaN, outside the bucket, or a chunk without a finite maximum).
__device__ __forceinline__ float pass_weight(float l, float cmax, const TopP& t, int shift, u32& digit) {
  const u32 key = order_key(l);
  digit = NO_DIGIT;
  if (key == 0u || (key & t.mask) != t.prefix || !is_finite(cmax)) return 0.f;
  digit = (key >> shift) & 15u;
  return expf(l - cmax);
}

// An element's weight added to its digit's bin (nothing for NO_DIGIT).
__device__ __forceinline__ void add_to_bin(float (&b)[16], float w, u32 digit) {
#pragma unroll
  for (int d = 0; d < 16; ++d)
    if (digit == (u32)d) b[d] += w;
}

// Each lane's 16 bins summed over the warp: lanes 2d and 2d + 1 return bin d. A reduce-scatter
// butterfly (16 shuffles, one fixed pairing order): each step hands half of the bins still held
// to the partner lane and adds the partner's share of its own half.
template <int HALF>
__device__ __forceinline__ void fold_bins(float (&b)[16]) {
  const bool upper = threadIdx.x & (2 * HALF);
#pragma unroll
  for (int j = 0; j < HALF; ++j) {
    const float give = upper ? b[j] : b[HALF + j];
    b[j] = (upper ? b[HALF + j] : b[j]) + __shfl_xor_sync(FULL_MASK, give, 2 * HALF);
  }
}
__device__ __forceinline__ float reduce_bins(float (&b)[16]) {
  fold_bins<8>(b);
  fold_bins<4>(b);
  fold_bins<2>(b);
  fold_bins<1>(b);
  return b[0] + __shfl_xor_sync(FULL_MASK, b[0], 1);
}

// Runs of 32 elements per group of a chunk's bins (BLOCK_SIZE / 32 / GROUP_RUNS groups).
#define GROUP_RUNS 4

// A chunk's 16 bins in the pass at `shift` (elements base .. base + m of s), returned to threads
// d < 16 as bin d: each thread's weight goes through shared memory (`s_w`: BLOCK_SIZE floats,
// `s_digit`: BLOCK_SIZE bytes); lane L of warp g adds the weights of elements L, L + 32, ... of
// group g of GROUP_RUNS runs (in that order) to its own bins, the warp reduces them
// (reduce_bins) into `s_group` (16 floats per group), and the groups' bins are added in order.
__device__ float chunk_bins_block(const Elements& s, u32 base, u32 m, float cmax, const TopP& t, int shift, float* s_w, unsigned char* s_digit, float* s_group) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  u32 digit = NO_DIGIT;
  const float w = threadIdx.x < m ? pass_weight(s.logit(base + threadIdx.x), cmax, t, shift, digit) : 0.f;
  __syncthreads();  // an earlier call may still be reading s_w, s_group
  s_w[threadIdx.x] = w;
  s_digit[threadIdx.x] = (unsigned char)digit;
  __syncthreads();
  if (warp < BLOCK_SIZE / 32 / GROUP_RUNS) {  // warp-uniform
    float b[16];
#pragma unroll
    for (int d = 0; d < 16; ++d) b[d] = 0.f;
#pragma unroll
    for (int j = 0; j < GROUP_RUNS; ++j) {
      const u32 e = (warp * GROUP_RUNS + j) * 32 + lane;
      add_to_bin(b, s_w[e], s_digit[e]);
    }
    const float bin = reduce_bins(b);
    if ((lane & 1) == 0) s_group[warp * 16 + (lane >> 1)] = bin;
  }
  __syncthreads();
  float acc = 0.f;
  if (threadIdx.x < 16)
    for (u32 g = 0; g * GROUP_RUNS * 32 < m; ++g) acc += s_group[g * 16 + threadIdx.x];
  return acc;
}

// A chunk's bin scaled to the largest maximum M, before the chunks' terms are added (a product
// rounded on its own, never fused into a sum: the same bits wherever the sum runs).
__device__ __forceinline__ float scaled_bin(float bin, float cmax, float M) {
  return bin > 0.f ? __fmul_rn(bin, expf(cmax - M)) : 0.f;
}

// The cut extended by the digit of the pass at `shift`, from the pass's 16 bins (each thread
// alike).
__device__ __forceinline__ void choose_digit(TopP& t, const float* bins, int shift, float top_p) {
  if (shift == 28) {
    float total = 0.f;
#pragma unroll
    for (int d = 0; d < 16; ++d) total += bins[d];
    t.target = top_p * total;
  }
  int digit = 15;
  for (; digit > 0 && t.above + bins[digit] < t.target; --digit) t.above += bins[digit];
  t.prefix |= (u32)digit << shift;
  t.mask |= 15u << shift;
}

// The cut after top-p (its digits, when on) and min-p, over the largest logit M (finite).
__device__ __forceinline__ u32 final_cut(const SampleParams& p, const TopP& t, float M) {
  u32 th = 1u;  // key 0 is NaN's alone: never drawn
  if (top_p_on(p)) th = max(th, t.prefix);
  // min-p: p_i >= min_p * p_max  <=>  l_i >= M + ln(min_p); the top token always stays.
  if (p.min_p > 0.f) th = max(th, min(order_key(M + logf(p.min_p)), order_key(M)));
  return th;
}

// An element's weight in the draw: at temperature 1 / inv_t relative to its chunk's largest
// logit (finite), if its key passes the cut.
__device__ __forceinline__ float draw_weight(float l, float cmax, u32 th, float inv_t) {
  return order_key(l) >= th ? expf((l - cmax) * inv_t) : 0.f;
}

// A chunk's mass in the draw: the sums of its 32 runs of 32 elements (each a warp sum), added
// in run order; by the block (a thread per element, returned to every thread) or by one warp,
// run after run: the same bits.
__device__ float chunk_mass_block(const Elements& s, u32 base, u32 m, float cmax, u32 th, float inv_t, float* s_f) {
  const float w = threadIdx.x < m && is_finite(cmax) ? draw_weight(s.logit(base + threadIdx.x), cmax, th, inv_t) : 0.f;
  float mass;
  warp_offsets(warp_sum(w), s_f, mass);
  return mass;
}
__device__ float chunk_mass_warp(const Elements& s, u32 base, u32 m, float cmax, u32 th, float inv_t) {
  const int lane = threadIdx.x & 31;
  float mass = 0.f;
  if (!is_finite(cmax)) return mass;
  for (u32 run = 0; run < BLOCK_SIZE / 32; ++run) {
    const u32 e = run * 32 + lane;
    mass += warp_sum(e < m ? draw_weight(s.logit(base + e), cmax, th, inv_t) : 0.f);
  }
  return mass;
}

// The chunk holding the largest maximum (the first on ties), to every thread; thread c < nc
// passes chunk c's maximum.
__device__ __forceinline__ u32 top_chunk(float mine, u32 nc, u32* s_key, u32* s_idx) {
  const u32 c = threadIdx.x;
  return block_best(c < nc ? order_key(mine) : 0u, c < nc ? c : NO_INDEX, s_key, s_idx);
}

// The first thread (smallest index) for which `yes` holds, or NO_INDEX, to every thread.
__device__ __forceinline__ u32 block_first(bool yes, u32* s_key, u32* s_idx) {
  return block_best(yes ? 1u : 0u, yes ? (u32)threadIdx.x : NO_INDEX, s_key, s_idx);
}

// The draw from the chunks' shares of m elements of s (`cmax`, `cmass`, `cbest`: maxima, masses
// in the draw, tokens, in shared memory) under the cut th: delivers the token from one thread.
__device__ void finish_chunks(const SampleParams& p, const Elements& s, u32 m, u32 th, const float* cmax, const float* cmass, const u32* cbest, u32* s_key, u32* s_idx, float* s_f, float* s_pick) {
  const int lane = threadIdx.x & 31;
  const u32 nc = (m + BLOCK_SIZE - 1) / BLOCK_SIZE, c = threadIdx.x;
  const float inv_t = 1.f / p.temperature;
  const u32 top = top_chunk(c < nc ? cmax[c] : 0.f, nc, s_key, s_idx);
  const float M = cmax[top];
  if (!is_finite(M)) {  // nothing to weigh: the argmax
    if (threadIdx.x == 0) deliver(p, cbest[top]);
    return;
  }
  // Each chunk's mass scaled to M, and their prefix in chunk order.
  const float scale = c < nc ? expf((cmax[c] - M) * inv_t) : 0.f;
  const float mine = c < nc && cmass[c] > 0.f ? cmass[c] * scale : 0.f;  // an all-NaN chunk's scale is NaN
  float incl = mine;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const float x = __shfl_up_sync(FULL_MASK, incl, o);
    if (lane >= o) incl += x;
  }
  const float excl = __shfl_up_sync(FULL_MASK, incl, 1);
  float total;
  const float wbefore = warp_offsets(__shfl_sync(FULL_MASK, incl, 31), s_f, total);
  const float before = wbefore + (lane ? excl : 0.f), after = wbefore + incl;
  const u64 step = p.step + (p.step_ptr ? (u64)reinterpret_cast<const u32*>(p.step_ptr)[0] : 0ull);
  // u < 1, but u * total may round up to total: stay strictly below it.
  const float r = fminf(uniform01(p.seed, step) * total, __uint_as_float(__float_as_uint(total) - 1u));
  if (r >= before && r < after) {  // one chunk: the draw, in its own units
    s_pick[0] = __uint_as_float(c);
    s_pick[1] = (r - before) / scale;
  }
  __syncthreads();
  const u32 chunk = __float_as_uint(s_pick[0]);
  const float rc = s_pick[1];
  const u32 base = chunk * BLOCK_SIZE, cm = min((u32)BLOCK_SIZE, m - base);
  const float w = threadIdx.x < cm ? draw_weight(s.logit(base + threadIdx.x), cmax[chunk], th, inv_t) : 0.f;
  float winc = w;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const float x = __shfl_up_sync(FULL_MASK, winc, o);
    if (lane >= o) winc += x;
  }
  float chunk_total;
  const float cum = warp_offsets(__shfl_sync(FULL_MASK, winc, 31), s_f, chunk_total) + winc;
  // The first token whose running mass passes the draw; near the chunk's end rounding may leave
  // none past it: then its last token with any mass.
  u32 t = block_first(w > 0.f && cum > rc, s_key, s_idx);
  if (t == NO_INDEX) t = BLOCK_SIZE - 1u - block_best(w > 0.f ? 1u : 0u, w > 0.f ? BLOCK_SIZE - 1u - threadIdx.x : NO_INDEX, s_key, s_idx);
  if (threadIdx.x == 0) deliver(p, s.index(base + t));
}

// Whether `sample`'s one block draws at temperature alone by chunks, a warp each (top-k, top-p
// and min-p off, over 2 to BLOCK_SIZE chunks): the same token as `sample_chunks`.
__device__ __forceinline__ bool temperature_only(const SampleParams& p) {
  return p.temperature > 0.f && (p.top_k == 0u || p.top_k >= p.n) && !(p.top_p > 0.f && p.top_p < 1.f) && !(p.min_p > 0.f) && p.n > BLOCK_SIZE &&
         (p.n + BLOCK_SIZE - 1) / BLOCK_SIZE <= BLOCK_SIZE;
}

// A draw over many chunks of the vocabulary, a block each, in launches: where it was scratch
// (`SampleParams::stats`, `[35 * n_chunks + 8]` words).
struct ChunkStats {
  float* cmax;   // [n_chunks]
  float* cmass;  // [n_chunks]
  u32* cbest;    // [n_chunks]
  float* cbins;  // [2][n_chunks, 16]: pass k's bins in half k & 1
  u32* state;    // [2][CUT_WORDS]: the cut after pass k's digit in half k & 1
};
// top-p's state after a pass (TopP): the launch after pass k writes it in half k & 1 while
// the launch's other blocks read half (k - 1) & 1.
enum CutWord { CUT_PREFIX, CUT_MASK, CUT_ABOVE, CUT_TARGET, CUT_WORDS };
__device__ __forceinline__ ChunkStats chunk_stats(const SampleParams& p) {
  float* f = reinterpret_cast<float*>(p.stats);
  const u32 nc = p.n_chunks;
  return {f, f + nc, reinterpret_cast<u32*>(f + 2 * nc), f + 3 * nc, reinterpret_cast<u32*>(f + 35 * nc)};
}

// Whether this block is the last of the launch's n_chunks blocks to arrive (every thread's
// writes before the call are visible to it); the last resets the counter for the next launch.
__device__ bool last_to_arrive(const SampleParams& p, u32* s_last) {
  __syncthreads();  // the block's writes, then one thread's fence (a grid barrier's pattern)
  if (threadIdx.x == 0) {
    __threadfence();
    u32* arrivals = reinterpret_cast<u32*>(p.arrivals);
    *s_last = atomicAdd(arrivals, 1u) == p.n_chunks - 1u;
    if (*s_last) {
      *arrivals = 0u;  // every block has arrived: ready for the next launch
      __threadfence();
    }
  }
  __syncthreads();
  return *s_last;
}

// The largest of the chunks' maxima (written by the first launch), to every thread.
__device__ __forceinline__ float largest_max(const ChunkStats& st, u32 nc, u32* s_key, u32* s_idx) {
  const u32 top = top_chunk(threadIdx.x < nc ? __ldcg(st.cmax + threadIdx.x) : 0.f, nc, s_key, s_idx);
  return __ldcg(st.cmax + top);
}

// The cut after pass k's digit, found by every block of the launch after pass k alike: the
// chunks' bins of pass k scaled to the largest maximum M and added over the chunks in a fixed
// tree (thread j * 16 + d adds bin d of chunks j, j + BLOCK_SIZE / 16, ..., then pairs of
// threads, then two halves of the warps in order), then the digit chosen from them, extending
// the cut after pass k - 1. The same bits in every block: no block has to hand it on.
__device__ __forceinline__ TopP cut_after(const SampleParams& p, const ChunkStats& st, u32 k, float M, float* s_part, float* s_bins) {
  TopP t = {0u, 0u, 0.f, 0.f};
  if (k > 0) {
    const u32* s = st.state + ((k - 1) & 1) * CUT_WORDS;
    t = {__ldcg(s + CUT_PREFIX), __ldcg(s + CUT_MASK), __uint_as_float(__ldcg(s + CUT_ABOVE)), __uint_as_float(__ldcg(s + CUT_TARGET))};
  }
  const u32 nc = p.n_chunks, d = threadIdx.x & 15;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const float* bins = st.cbins + (k & 1) * 16 * nc;
  float acc = 0.f;
  for (u32 c = threadIdx.x >> 4; c < nc; c += BLOCK_SIZE / 16) acc += scaled_bin(__ldcg(bins + c * 16 + d), __ldcg(st.cmax + c), M);
  acc += __shfl_xor_sync(FULL_MASK, acc, 16);
  __syncthreads();  // an earlier call may still be reading s_part, s_bins
  if (lane < 16) s_part[warp * 16 + lane] = acc;
  __syncthreads();
  if (warp == 0) {
    constexpr int HALF = BLOCK_SIZE / 64;  // warps per half
    float b = 0.f;
    for (int w = (lane >> 4) * HALF; w < ((lane >> 4) + 1) * HALF; ++w) b += s_part[w * 16 + d];
    b += __shfl_xor_sync(FULL_MASK, b, 16);
    if (lane < 16) s_bins[lane] = b;
  }
  __syncthreads();
  choose_digit(t, s_bins, 28 - 4 * (int)k, p.top_p);
  return t;
}

// The cut of a draw by chunks, a pass per launch (`pass` of `passes`: top-p's 8 digits, or one
// for min-p alone), a block per chunk of the vocabulary: pass 0 writes the chunk's largest logit
// and token, each top-p pass the chunk's 16 bins for its digit under the cut so far, which every
// block of pass k > 0 first extends by pass k - 1's digit (`cut_after`; block 0 stores it for the
// next launch). `sample_chunks` takes the last digit and min-p's cut the same way.
extern "C" __global__ void __launch_bounds__(BLOCK_SIZE) sample_pass(const SampleParams p) {
  KERNEL_ENTRY();
  __shared__ u32 s_key[32], s_idx[32];
  __shared__ float s_w[BLOCK_SIZE], s_group[BLOCK_SIZE / 2 / GROUP_RUNS], s_part[BLOCK_SIZE / 2], s_bins[16];
  __shared__ unsigned char s_digit[BLOCK_SIZE];
  const ChunkStats st = chunk_stats(p);
  const u32 nc = p.n_chunks, c = blockIdx.x, base = c * BLOCK_SIZE, m = min((u32)BLOCK_SIZE, p.n - base);
  const Elements el = {reinterpret_cast<const float*>(p.logits), nullptr, p.n};
  float cmax;
  TopP t = {0u, 0u, 0.f, 0.f};
  if (p.pass == 0) {
    const u32 e = block_argmax(el, base, m, s_key, s_idx);
    cmax = el.logit(base + e);
    if (threadIdx.x == 0) {
      st.cmax[c] = cmax;
      st.cbest[c] = base + e;
    }
  } else {
    cmax = __ldcg(st.cmax + c);  // this chunk's block wrote it in pass 0
    t = cut_after(p, st, p.pass - 1, largest_max(st, nc, s_key, s_idx), s_part, s_bins);
    if (c == 0 && threadIdx.x == 0) {
      u32* s = st.state + ((p.pass - 1) & 1) * CUT_WORDS;
      s[CUT_PREFIX] = t.prefix;
      s[CUT_MASK] = t.mask;
      s[CUT_ABOVE] = __float_as_uint(t.above);
      s[CUT_TARGET] = __float_as_uint(t.target);
    }
  }
  if (top_p_on(p)) {
    const float bin = chunk_bins_block(el, base, m, cmax, t, 28 - 4 * (int)p.pass, s_w, s_digit, s_group);
    if (threadIdx.x < 16) st.cbins[((p.pass & 1) * nc + c) * 16 + threadIdx.x] = bin;
  }
}

// The draw over many chunks of the vocabulary, a block each: block b writes its chunk's mass
// in the draw (under the cut of the `sample_pass` launches before, if any) and, without them,
// its largest logit and token; the last to arrive finishes.
extern "C" __global__ void __launch_bounds__(BLOCK_SIZE) sample_chunks(const SampleParams p) {
  KERNEL_ENTRY();
  __shared__ u32 s_key[32], s_idx[32], s_last, s_best[BLOCK_SIZE];
  __shared__ float s_f[32], s_pick[2], s_max[BLOCK_SIZE], s_mass[BLOCK_SIZE], s_part[BLOCK_SIZE / 2], s_bins[16];
  const ChunkStats st = chunk_stats(p);
  const u32 nc = p.n_chunks, c = blockIdx.x, base = c * BLOCK_SIZE, m = min((u32)BLOCK_SIZE, p.n - base);
  const Elements el = {reinterpret_cast<const float*>(p.logits), nullptr, p.n};
  float cmax;
  if (p.passes) {
    cmax = __ldcg(st.cmax + c);
  } else {
    const u32 e = block_argmax(el, base, m, s_key, s_idx);
    cmax = el.logit(base + e);
    if (threadIdx.x == 0) {
      st.cmax[c] = cmax;
      st.cbest[c] = base + e;
    }
  }
  // The cut (every block alike): top-p's last digit and min-p, over the largest maximum.
  u32 th = 1u;
  if (p.passes) {
    const float M = largest_max(st, nc, s_key, s_idx);
    TopP t = {0u, 0u, 0.f, 0.f};
    if (top_p_on(p)) t = cut_after(p, st, p.passes - 1, M, s_part, s_bins);
    if (is_finite(M)) th = final_cut(p, t, M);
  }
  const float mass = chunk_mass_block(el, base, m, cmax, th, 1.f / p.temperature, s_f);
  if (threadIdx.x == 0) st.cmass[c] = mass;
  if (!last_to_arrive(p, &s_last)) return;  // block-uniform
  // The other blocks' shares, through L2 (this SM's L1 may hold an earlier launch's).
  if (threadIdx.x < nc) {
    s_max[threadIdx.x] = __ldcg(st.cmax + threadIdx.x);
    s_mass[threadIdx.x] = __ldcg(st.cmass + threadIdx.x);
    s_best[threadIdx.x] = __ldcg(st.cbest + threadIdx.x);
  }
  __syncthreads();
  finish_chunks(p, el, p.n, th, s_max, s_mass, s_best, s_key, s_idx, s_f, s_pick);
}

extern "C" __global__ void __launch_bounds__(BLOCK_SIZE) sample(const SampleParams launch) {
  KERNEL_ENTRY();
  const SampleParams p = block_draw(launch);
  __shared__ u32 s_key[32], s_idx[32], s_radix[3], s_hist[256], s_uwarp[32];
  __shared__ float s_fwarp[32], s_pick[2];
  __shared__ float s_fscan[BLOCK_SIZE];
  __shared__ u32 s_uscan[BLOCK_SIZE];
  __shared__ float c_logit[BLOCK_SIZE];
  __shared__ u32 c_index[BLOCK_SIZE];
  extern __shared__ u32 s_cand[];  // p.cand_cap of them (dynamic shared memory)
  const int lane = threadIdx.x & 31;
  Elements el = {reinterpret_cast<const float*>(p.logits), nullptr, p.n};
  if (gather_candidates(p, s_cand, s_uscan, s_uwarp, &el.m)) el.idx = s_cand;
  if (!el.idx && temperature_only(p)) {
    // By chunks, a warp each, as `sample_chunks` draws with a block each.
    const u32 nc = (p.n + BLOCK_SIZE - 1) / BLOCK_SIZE;
    for (u32 c = threadIdx.x >> 5; c < nc; c += BLOCK_SIZE / 32) {
      const u32 base = c * BLOCK_SIZE, len = min((u32)BLOCK_SIZE, p.n - base);
      const u32 e = base + warp_argmax(el, base, len);
      const float mass = chunk_mass_warp(el, base, len, el.logit(e), 1u, 1.f / p.temperature);
      if (lane == 0) {
        c_logit[c] = el.logit(e);
        s_fscan[c] = mass;
        c_index[c] = e;
      }
    }
    __syncthreads();
    finish_chunks(p, el, p.n, 1u, c_logit, s_fscan, c_index, s_key, s_idx, s_fwarp, s_pick);
    return;
  }
  const u32 best_e = block_argmax(el, 0u, el.m, s_key, s_idx);
  const u32 best = el.index(best_e);
  const float max_logit = el.logit(best_e);
  // Greedy cases, and logits with no finite maximum (nothing to weigh).
  if (p.temperature <= 0.f || p.top_k == 1u || el.m == 1u || !(fabsf(max_logit) <= 3.402823466e38f)) {
    if (threadIdx.x == 0) deliver(p, best);
    return;
  }

  // top-k: every token with key >= th stays (ties at the cut are all kept). Key 0 is NaN's
  // alone: a NaN logit is never drawn and weighs nothing.
  const bool top_k = p.top_k > 0u && p.top_k < el.m;
  u32 th = 1u;
  if (top_k) th = max(1u, block_kth_key(el.m, p.top_k, p.top_k, [&](u32 e) { return order_key(el.logit(e)); }, s_hist, s_radix));

  // When at most BLOCK_SIZE tokens survive top-k they are gathered (in index order) into shared
  // memory and the filters below touch only them; otherwise they run over the elements in
  // place. (Without top-k over more than a block of elements, nothing is gathered.)
  Survivors s = {false, el.m, c_logit, c_index, el};
  if (top_k || el.m <= BLOCK_SIZE) {
    const Span span = warp_span(el.m);
    u32 count = 0u;
    for (u32 e0 = span.begin; e0 < span.end; e0 += 32) {  // warp-uniform loop
      const u32 e = e0 + lane;
      count += __popc(__ballot_sync(FULL_MASK, e < span.end && order_key(el.logit(e)) >= th));
    }
    u32 kept;
    u32 slot = warp_offsets(count, s_uwarp, kept);
    if (kept <= BLOCK_SIZE) {  // block-uniform
      for (u32 e0 = span.begin; e0 < span.end; e0 += 32) {
        const u32 e = e0 + lane;
        const float l = e < span.end ? el.logit(e) : 0.f;
        const bool keep = e < span.end && order_key(l) >= th;
        const u32 ballot = __ballot_sync(FULL_MASK, keep);
        if (keep) {
          const u32 at = slot + __popc(ballot & ((1u << lane) - 1u));
          c_logit[at] = l;
          c_index[at] = el.index(e);
        }
        slot += __popc(ballot);
      }
      s.gathered = true;
      s.m = kept;
      __syncthreads();
      if (kept <= FINISH_CAP) {
        if (threadIdx.x < 32) finish_in_warp(p, c_logit, c_index, kept, th, max_logit, s_fscan, s_uscan);
        return;
      }
    }
  }

  // top-p: the largest key t whose mass (keys >= max(t, th)) still reaches top_p of the top-k
  // mass, found a digit of four bits per pass from the top (8 passes, not 32 of bisection).
  // A pass sums the masses of the keys under the digits found so far into 16 bins by their next
  // digit; the cut's digit is the largest whose bins from the top, with the mass above them,
  // still reach the target. Each thread's bins stay in registers (added strided, coalesced)
  // and the block adds them in a fixed order: the same logits always give the same cut.
  if (p.top_p > 0.f && p.top_p < 1.f) {
    float target = 0.f, above = 0.f;  // above: the mass of the keys above the current bucket
    u32 prefix = 0u, mask = 0u;
    for (int shift = 28; shift >= 0; shift -= 4) {
      float bins[16];
#pragma unroll
      for (int d = 0; d < 16; ++d) bins[d] = 0.f;
      s.each_strided([&](float l) {
        const u32 key = order_key(l);
        if (key < th || (key & mask) != prefix) return;
        const u32 digit = (key >> shift) & 15u;
        const float w = expf(l - max_logit);
#pragma unroll
        for (int d = 0; d < 16; ++d) bins[d] += digit == (u32)d ? w : 0.f;
      });
      block_sum_bins(bins, s_fscan);
      if (shift == 28) {
        float total = 0.f;
#pragma unroll
        for (int d = 0; d < 16; ++d) total += bins[d];
        target = p.top_p * total;
      }
      int digit = 15;
      for (; digit > 0 && above + bins[digit] < target; --digit) above += bins[digit];
      prefix |= (u32)digit << shift;
      mask |= 15u << shift;
    }
    th = max(th, prefix);
  }
  // min-p: p_i >= min_p * p_max  <=>  l_i >= max + ln(min_p); the top token always stays.
  if (p.min_p > 0.f) th = max(th, min(order_key(max_logit + logf(p.min_p)), order_key(max_logit)));

  // Draw: each warp sums the masses of its share (coalesced steps, then a warp sum), the warps'
  // masses in warp order split [0, total) between them in index order, and the warp whose part
  // holds r walks its share a step at a time (a warp scan per step).
  const float inv_t = 1.f / p.temperature;
  const Span span = warp_span(s.m);
  auto weight = [&](u32 e) {
    const float l = s.logit(e);
    return order_key(l) >= th ? expf((l - max_logit) * inv_t) : 0.f;
  };
  float part = 0.f;
  for (u32 e = span.begin + lane; e < span.end; e += 32) part += weight(e);
  float total;
  const float before = warp_offsets(warp_sum(part), s_fwarp, total);
  const float after = before + s_fwarp[threadIdx.x >> 5];
  const u64 step = p.step + (p.step_ptr ? (u64)reinterpret_cast<const u32*>(p.step_ptr)[0] : 0ull);
  // u < 1, but u * total may round up to total: stay strictly below it.
  const float r = fminf(uniform01(p.seed, step) * total, __uint_as_float(__float_as_uint(total) - 1u));
  if (!(r >= before && r < after)) return;  // warp-uniform: one warp walks
  float c = before;
  u32 pick = NO_INDEX;
  for (u32 e0 = span.begin; e0 < span.end; e0 += 32) {
    const u32 e = e0 + lane;
    const float w = e < span.end ? weight(e) : 0.f;
    float incl = w;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const float x = __shfl_up_sync(FULL_MASK, incl, o);
      if (lane >= o) incl += x;
    }
    const u32 positive = __ballot_sync(FULL_MASK, w > 0.f);
    const u32 past = __ballot_sync(FULL_MASK, w > 0.f && c + incl > r);
    // The first token whose running mass passes r; near the end of the share, rounding may
    // leave none past it: then the last token with any mass.
    if (past) {
      pick = e0 + __ffs(past) - 1;
      break;
    }
    if (positive) pick = e0 + 31 - __clz(positive);
    c += __shfl_sync(FULL_MASK, incl, 31);
  }
  if (lane == 0) deliver(p, pick == NO_INDEX ? NO_INDEX : s.index(pick));
}
"#;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct SamplingVariant {
    pub block_size: u32,
}

impl SamplingVariant {
    pub const DEFAULT: SamplingVariant = SamplingVariant { block_size: 1024 };
    /// Most candidates a `sample` block gathers from `topk_candidates` (64 KiB of dynamic shared
    /// memory): top-k 40 over 256 chunks (Gemma 3's vocabulary), 64 over 256 KiB of logits.
    pub const CANDIDATE_CAP: u32 = 16384;

    /// `sample` drawing `draws` rows (one, or a [`RowDraw`] list), with the shared memory its
    /// candidate list needs when there is one.
    pub fn sample_launch_config(&self, draws: u32, candidates: bool) -> LaunchConfig {
        let shared_mem_bytes = if candidates { Self::CANDIDATE_CAP * 4 } else { 0 };
        LaunchConfig { shared_mem_bytes, ..self.rows_launch_config(draws) }
    }

    /// `argmax` over `rows` rows: a block per row.
    pub fn rows_launch_config(&self, rows: u32) -> LaunchConfig {
        self.grid_launch_config(rows, 1)
    }

    /// `topk_candidates` over `chunks` chunks of each of `draws` rows.
    pub fn grid_launch_config(&self, chunks: u32, draws: u32) -> LaunchConfig {
        LaunchConfig { grid_dim: (chunks, draws, 1), block_dim: (self.block_size, 1, 1), shared_mem_bytes: 0 }
    }
}

impl KernelVariant for SamplingVariant {
    const FAMILY: &'static str = "sampling";
    const SOURCES: &'static [&'static str] = &[HEADER, DRAW, ArgmaxParams::C_DECL, SampleParams::C_DECL, RowDraw::C_DECL, CandidateParams::C_DECL, SOURCE];
    const ENTRY_POINTS: &'static [&'static str] = &["argmax", "sample", "topk_candidates", "argmax_chunks", "sample_pass", "sample_chunks"];

    fn macros(&self) -> Vec<(&'static str, String)> {
        vec![("BLOCK_SIZE", self.block_size.to_string())]
    }
}

fn mix64(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// The uniform number in [0, 1) that `sample` draws for (seed, step): the same on host and
/// device, so a CPU backend can reproduce the CUDA backend's choices.
pub fn sampling_uniform(seed: u64, step: u64) -> f32 {
    (mix64(seed ^ mix64(step)) >> 40) as f32 * (1.0 / 16_777_216.0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn macros_match_source() {
        crate::kernels::tests::assert_macros_match(SamplingVariant::DEFAULT);
    }

    #[test]
    fn uniform_is_in_range_and_spread() {
        let draws: Vec<f32> = (0..10_000).map(|s| sampling_uniform(42, s)).collect();
        assert!(draws.iter().all(|&u| (0.0..1.0).contains(&u)));
        let mean = draws.iter().sum::<f32>() / draws.len() as f32;
        assert!((mean - 0.5).abs() < 0.02, "mean {mean}");
        assert_ne!(sampling_uniform(1, 5), sampling_uniform(2, 5));
        assert_eq!(sampling_uniform(7, 9), sampling_uniform(7, 9));
    }
}
