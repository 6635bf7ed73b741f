//! Causal grouped-query attention over an f32 or f16 KV cache ([`KvElem`]).

use super::activation::{exp_shifted, softmax_unnormalized};
use super::fvec;
use super::simd::{simd_level, SimdLevel};
use rayon::prelude::*;

/// A KV cache element: f32 (the reference precision), or f16 (the quantized path's default, as
/// llama.cpp's: half the bytes of a decode step's cache reads, which come from memory).
pub trait KvElem: Copy + Send + Sync + 'static {
    /// Whether it is f16 (the SIMD kernels convert 8 at a time with `vcvtph2ps`).
    const HALF: bool;
    const ZERO: Self;
    fn to_f32(self) -> f32;
}

impl KvElem for f32 {
    const HALF: bool = false;
    const ZERO: Self = 0.0;
    fn to_f32(self) -> f32 {
        self
    }
}

impl KvElem for half::f16 {
    const HALF: bool = true;
    const ZERO: Self = half::f16::ZERO;
    fn to_f32(self) -> f32 {
        half::f16::to_f32(self)
    }
}

#[derive(Clone, Copy, Debug)]
pub struct AttentionParams {
    pub n_heads: usize,
    /// Divides `n_heads`; query head `h` reads KV head `h / (n_heads / n_kv_heads)`.
    pub n_kv_heads: usize,
    pub head_dim: usize,
    /// Multiplies the q·k scores (usually `1 / sqrt(head_dim)`, see [`AttentionParams::new`]).
    pub scale: f32,
    /// Sliding window: a query at position `p` sees the keys at `(p - window, p]`.
    pub window: Option<usize>,
    /// Score soft-capping (Gemma 2): `s -> cap * tanh(s / cap)` after scaling.
    pub softcap: Option<f32>,
}

impl AttentionParams {
    /// Plain causal attention with the usual `1 / sqrt(head_dim)` scale.
    pub fn new(n_heads: usize, n_kv_heads: usize, head_dim: usize) -> Self {
        AttentionParams {
            n_heads,
            n_kv_heads,
            head_dim,
            scale: 1.0 / (head_dim as f32).sqrt(),
            window: None,
            softcap: None,
        }
    }
}

/// Attention of `n_tokens` new queries at positions `start_pos ..`, over a cache holding
/// `kv_len = start_pos + n_tokens` rows (the new tokens' keys and values included), given as
/// plain rows: a reference entry (tests, other backends' checks) that copies them into the
/// blocked layout of [`attention_paged`] (blocks of [`CONTIGUOUS_BLOCK`] positions in order) and
/// runs that.
///
/// `q`, `out`: `n_tokens x (n_heads * head_dim)`; `k_cache`, `v_cache`: `kv_len x (n_kv_heads * head_dim)`.
/// Softmax in f32 with the maximum subtracted. Parallel over (token, head).
/// Panics on inconsistent sizes.
pub fn attention<T: KvElem>(p: &AttentionParams, q: &[f32], k_cache: &[T], v_cache: &[T], start_pos: usize, n_tokens: usize, out: &mut [f32]) {
    attention_at(simd_level(), p, q, k_cache, v_cache, start_pos, n_tokens, out);
}

#[allow(clippy::too_many_arguments)]
pub(crate) fn attention_at<T: KvElem>(level: SimdLevel, p: &AttentionParams, q: &[f32], k_cache: &[T], v_cache: &[T], start_pos: usize, n_tokens: usize, out: &mut [f32]) {
    let (kvw, kv_len) = (p.n_kv_heads * p.head_dim, start_pos + n_tokens);
    for (name, cache) in [("k", k_cache), ("v", v_cache)] {
        assert_eq!(cache.len(), kv_len * kvw, "attention: {name} cache has {} values, expected {kv_len} x {kvw}", cache.len());
    }
    let bs = CONTIGUOUS_BLOCK;
    let blocks: Vec<u32> = (0..kv_len.div_ceil(bs) as u32).collect();
    let (k, v) = (to_blocks(p, k_cache, true, bs, &blocks, blocks.len(), T::ZERO), to_blocks(p, v_cache, false, bs, &blocks, blocks.len(), T::ZERO));
    let seq = PagedSeq { blocks: &blocks, start_pos, n_tokens };
    attention_paged_at(level, p, q, &PagedKv { k: &k, v: &v, block_size: bs }, &[seq], out);
}

/// Positions per block of a contiguous cache: the CPU executor's one-sequence cache is the paged
/// layout with blocks `0, 1, 2, ...` of this many positions.
pub const CONTIGUOUS_BLOCK: usize = 16;

/// Cache rows (`rows x (n_kv_heads * head_dim)`, row-major) in the paged layout: row `r` into
/// block `blocks[r / bs]` of an arena of `n_blocks` blocks (the rest `fill`), as keys
/// ([`paged_key_offset`]) or values ([`paged_offset`]).
pub fn to_blocks<T: KvElem>(p: &AttentionParams, rows: &[T], key: bool, bs: usize, blocks: &[u32], n_blocks: usize, fill: T) -> Vec<T> {
    let (kvw, hd) = (p.n_kv_heads * p.head_dim, p.head_dim);
    let mut arena = vec![fill; n_blocks * bs * kvw];
    for (r, row) in rows.chunks(kvw).enumerate() {
        for (h, head) in row.chunks(hd).enumerate() {
            let (block, at) = (blocks[r / bs] as usize, r % bs);
            if key {
                let first = paged_key_offset(p, bs, block, at, h);
                head.iter().enumerate().for_each(|(d, &x)| arena[first + d * bs] = x);
            } else {
                let first = paged_offset(p, bs, block, at, h);
                arena[first..first + hd].copy_from_slice(head);
            }
        }
    }
    arena
}

/// Bytes of the next run that `attend` requests ahead: 512 of a 16-key block's 2 KiB of f16 keys
/// (and as many of its values) were faster than all of them (`attention_bench`, alternated three
/// times: 2 048 positions 2.2-2.7 -> 1.96 ms, 8 sequences at 84 positions 0.79-0.81 -> 0.72 ms)
/// or none (2.25-2.35 and 0.78-0.85 ms).
const RUN_PREFETCH_BYTES: usize = 512;

/// Keys per part of a query row's keys: rows with more are split into parts of at most this many,
/// run as tasks of their own and merged (flash-decoding), so that one sequence's decode step
/// deep in a context has work for every thread. The split depends on the key count only, so the
/// results do not depend on the thread count.
const SPLIT_KEYS: usize = 512;

/// One query row of a paged attention call: its sequence's block table and its keys
/// `first..end` (positions).
struct RowKeys<'a> {
    blocks: &'a [u32],
    first: usize,
    end: usize,
}

/// The cache runs ([`Run`]s) of keys `begin..end` of KV head `h` through the block table
/// `blocks`: consecutive positions inside one block each; allocated once at their final size
/// (growing it cost a sixth of the op).
fn runs_of(p: &AttentionParams, bs: usize, blocks: &[u32], h: usize, begin: usize, end: usize) -> Vec<Run> {
    let mut runs = Vec::with_capacity((end - begin) / bs + 2);
    let mut r = begin;
    while r < end {
        let (b, off) = (r / bs, r % bs);
        let len = (bs - off).min(end - r);
        let block = blocks[b] as usize;
        runs.push((r - begin, paged_key_offset(p, bs, block, off, h), paged_offset(p, bs, block, off, h), len));
        r += len;
    }
    runs
}

/// Attention of the query rows of `q` over their keys (`rows`), in parallel over (row, query
/// heads of a call, part of the keys).
fn attend_rows<T: KvElem>(level: SimdLevel, p: &AttentionParams, q: &[f32], kv: &PagedKv<'_, T>, rows: &[RowKeys], out: &mut [f32]) {
    let (nh, hd, bs) = (p.n_heads, p.head_dim, kv.block_size);
    let (qw, group) = (nh * hd, nh / p.n_kv_heads);
    let keys: Vec<(usize, usize)> = rows.iter().map(|r| (r.first, r.end)).collect();
    let parts: Vec<usize> = keys.iter().map(|&(first, end)| (end - first).div_ceil(SPLIT_KEYS)).collect();
    let total_parts: usize = parts.iter().sum();
    let heads = heads_per_task(total_parts, nh, group);
    let calls = nh / heads; // calls per row (and per part)
    // The query heads h.. of row t over its keys begin..end.
    let call = |t: usize, h: usize, begin: usize, end: usize, out: &mut [f32], state: Option<&mut [(f32, f32)]>| {
        let runs = runs_of(p, bs, rows[t].blocks, h / group, begin, end);
        attend(level, p, &q[t * qw + h * hd..][..heads * hd], kv.k, kv.v, bs, &runs, out, state);
    };
    if total_parts == keys.len() {
        out.par_chunks_mut(heads * hd).enumerate().for_each(|(i, out)| {
            let t = i / calls;
            call(t, i % calls * heads, keys[t].0, keys[t].1, out, None);
        });
        return;
    }
    // Part `part` of row t's keys, for the call's heads from h: its unnormalised sums and states.
    let part_of = |t: usize, h: usize, part: usize, sums: &mut [f32], state: &mut [(f32, f32)]| {
        let ((first, end), n) = (keys[t], parts[t]);
        let len = end - first;
        call(t, h, first + part * len / n, first + (part + 1) * len / n, sums, Some(state));
    };
    let merge = |sums: &[f32], states: &[(f32, f32)], out: &mut [f32]| merge_parts(sums, states, heads, out);
    if keys.len() * calls >= 2 * rayon::current_num_threads() {
        // Tasks enough without splitting them: each call runs its parts in turn, then merges.
        out.par_chunks_mut(heads * hd).enumerate().for_each(|(i, out)| {
            let (t, h) = (i / calls, i % calls * heads);
            let mut sums = vec![0f32; parts[t] * heads * hd];
            let mut states = vec![(0f32, 0f32); parts[t] * heads];
            for (part, (sums, state)) in sums.chunks_mut(heads * hd).zip(states.chunks_mut(heads)).enumerate() {
                part_of(t, h, part, sums, state);
            }
            merge(&sums, &states, out);
        });
        return;
    }
    // Each part a task of its own, in (row, call, part) order (row t's first at `first_task[t]`),
    // then the merges.
    let first_task: Vec<usize> = parts.iter().scan(0, |n, &pt| { let at = *n; *n += pt * calls; Some(at) }).collect();
    let n_tasks = total_parts * calls;
    let mut sums = vec![0f32; n_tasks * heads * hd];
    let mut states = vec![(0f32, 0f32); n_tasks * heads];
    sums.par_chunks_mut(heads * hd).zip(states.par_chunks_mut(heads)).enumerate().for_each(|(i, (sums, state))| {
        let t = first_task.partition_point(|&f| f <= i) - 1;
        let (c, part) = ((i - first_task[t]) / parts[t], (i - first_task[t]) % parts[t]);
        part_of(t, c * heads, part, sums, state);
    });
    out.par_chunks_mut(heads * hd).enumerate().for_each(|(i, out)| {
        let (t, c) = (i / calls, i % calls);
        let at = first_task[t] + c * parts[t];
        merge(&sums[at * heads * hd..(at + parts[t]) * heads * hd], &states[at * heads..(at + parts[t]) * heads], out);
    });
}

/// The softmax over all of a call's parts: each head's parts rescaled to their largest maximum
/// (`sums`: the parts' unnormalised sums, `heads` rows of `out`'s head size each; `states`: their
/// (maximum, sum of exponentials) per head). With one part this is the unsplit arithmetic: a
/// weight of exactly 1, then the same `1 / sum`.
fn merge_parts(sums: &[f32], states: &[(f32, f32)], heads: usize, out: &mut [f32]) {
    let hd = out.len() / heads;
    for (g, out) in out.chunks_mut(hd).enumerate() {
        let parts = || states.iter().skip(g).step_by(heads).zip(sums.chunks(heads * hd).map(|s| &s[g * hd..][..hd]));
        let max = parts().map(|(st, _)| st.0).fold(f32::NEG_INFINITY, f32::max);
        out.fill(0.0);
        let mut sum = 0.0;
        for (&(m, l), part) in parts() {
            let w = if m == max { 1.0 } else { fvec::exp(m - max) };
            sum += w * l;
            out.iter_mut().zip(part).for_each(|(o, &x)| *o += w * x);
        }
        let inv = 1.0 / sum;
        out.iter_mut().for_each(|o| *o *= inv);
    }
}

/// Query heads one task takes together: the largest divisor of the KV group up to
/// [`MAX_HEADS`], so that each K and V row it loads serves them all, unless that leaves fewer
/// than 2 tasks per thread of the pool for `rows` query rows (or parts of rows): then one head
/// per task, so that the threads share the work evenly (one sequence's decode step over 1 000
/// positions: 3 tasks on 2 threads took a third longer than 9).
fn heads_per_task(rows: usize, n_heads: usize, group: usize) -> usize {
    let heads = (1..=MAX_HEADS.min(group)).rev().find(|d| group.is_multiple_of(*d)).unwrap_or(1);
    if rows * n_heads / heads >= 2 * rayon::current_num_threads() {
        heads
    } else {
        1
    }
}

/// Most query heads of one KV group the loops run together (their accumulators stay in registers).
const MAX_HEADS: usize = 4;

/// Consecutive keys of one KV head inside one block: `(index among the call's keys, offset of
/// the first key's element 0 in the K cache, offset of its value row in the V cache, keys)`.
/// Element `d` of key `j` of the run is at `k + d * block_size + j`, its value row at
/// `v + j * head_dim`.
type Run = (usize, usize, usize, usize);

/// Query heads of one KV group (`queries` and `out`: their rows of `head_dim` back to back) over
/// their cache runs: scores, soft-cap, softmax, then the weighted sum of the values, accumulated
/// run by run in `out` and normalised with the last run (multiplying the others by 1.0 is exact,
/// so one run or many give the same result). With a `state` (one part of split keys) the sums
/// stay unnormalised and each head's (maximum score, sum of exponentials) goes there. A head's
/// arithmetic does not depend on which heads share its call, nor on how its keys fall into runs.
#[allow(clippy::too_many_arguments)]
fn attend<T: KvElem>(
    level: SimdLevel,
    p: &AttentionParams,
    queries: &[f32],
    k: &[T],
    v: &[T],
    block_size: usize,
    runs: &[Run],
    out: &mut [f32],
    state: Option<&mut [(f32, f32)]>,
) {
    let hd = p.head_dim;
    let heads = queries.len() / hd;
    let kernels = Kernels::<T>::for_level(level, hd, heads);
    let n_rows: usize = runs.iter().map(|r| r.3).sum();
    // Row g of `scores` holds head g's weights.
    let mut scores = vec![0f32; heads * n_rows];
    let key_span = |len: usize| (hd - 1) * block_size + len;
    for (i, &(at, k_at, _, len)) in runs.iter().enumerate() {
        if let Some(&(_, next, _, len)) = runs.get(i + 1) {
            prefetch(&k[next..next + key_span(len)]);
        }
        // SAFETY: the callers checked that `level` is available.
        unsafe { (kernels.scores)(queries, &k[k_at..k_at + key_span(len)], block_size, p.scale, &mut scores[at..], n_rows, len) };
    }
    if let Some(cap) = p.softcap {
        scores.iter_mut().for_each(|s| *s = cap * tanh(*s / cap));
    }
    // (Heads of one call: at most MAX_HEADS, so these live on the stack.)
    let ones = [1.0; MAX_HEADS];
    let mut norms = ones;
    match state {
        None => scores.chunks_mut(n_rows).zip(&mut norms).for_each(|(row, n)| *n = 1.0 / softmax_unnormalized(row)),
        Some(state) => {
            for (row, st) in scores.chunks_mut(n_rows).zip(state.iter_mut()) {
                let max = fvec::max(row);
                *st = (max, exp_shifted(row, max, 1.0));
            }
        }
    }
    let (ones, norms) = (&ones[..heads], &norms[..heads]);
    for (i, &(at, _, v_at, len)) in runs.iter().enumerate() {
        if let Some(&(_, _, next, len)) = runs.get(i + 1) {
            prefetch(&v[next..next + len * hd]);
        }
        let values = &v[v_at..v_at + len * hd];
        let norms = if i + 1 == runs.len() { norms } else { ones };
        // SAFETY: as above.
        unsafe { (kernels.weighted_sum)(&scores[at..], n_rows, len, values, norms, out, i > 0) };
    }
}

/// Asks for the first [`RUN_PREFETCH_BYTES`] of `span` (the next run's keys or values: the next
/// block of a paged cache is anywhere in it, where the hardware prefetchers do not look; once
/// its first lines are read they stream the rest).
fn prefetch<T>(span: &[T]) {
    #[cfg(target_arch = "x86_64")]
    x86::prefetch_row(span.as_ptr(), span.len().min(RUN_PREFETCH_BYTES / std::mem::size_of::<T>()));
    let _ = span;
}

/// A paged KV cache: row `p` of a sequence is row `p % block_size` of physical block
/// `blocks[p / block_size]` of its [`PagedSeq`]. A block holds `block_size` rows of the cache
/// width, KV head by KV head: the values as rows ([`paged_offset`]), the keys transposed, element
/// by element of the head ([`paged_key_offset`]).
#[derive(Clone, Copy, Debug)]
pub struct PagedKv<'a, T: KvElem = f32> {
    pub k: &'a [T],
    pub v: &'a [T],
    pub block_size: usize,
}

/// Where KV head `head`'s `head_dim` values of row `row` (< `block_size`) of block `block` start
/// in a paged cache: each block holds its rows KV head by KV head, so that the rows one task
/// reads (one head's, in order) follow each other in memory. Row-major blocks put the other
/// heads' columns between them, a stride the hardware prefetchers follow poorly: a batched
/// decode step over 8 sequences at 256 positions took ~5% longer (docs/perf.md, stop 30).
pub fn paged_offset(p: &AttentionParams, block_size: usize, block: usize, row: usize, head: usize) -> usize {
    ((block * p.n_kv_heads + head) * block_size + row) * p.head_dim
}

/// Where element 0 of KV head `head`'s key of row `row` of block `block` is in a paged K cache;
/// element `d` is `d * block_size` further. A block's keys of one head are stored transposed
/// (`head_dim` rows of `block_size` keys), so that the scores loop multiplies a query element
/// into a vector of keys at a time and needs no sum across a vector's lanes: 2.2x fewer cycles
/// per key than the row-major loop's transposing reduction (docs/perf.md, stop 36).
pub fn paged_key_offset(p: &AttentionParams, block_size: usize, block: usize, row: usize, head: usize) -> usize {
    (block * p.n_kv_heads + head) * block_size * p.head_dim + row
}

/// One sequence's query rows in a batched [`attention_paged`] call: `n_tokens` new rows at
/// positions `start_pos ..`, its cache rows through `blocks`.
#[derive(Clone, Copy, Debug)]
pub struct PagedSeq<'a> {
    pub blocks: &'a [u32],
    pub start_pos: usize,
    pub n_tokens: usize,
}

/// [`attention`] over a paged cache for a batch of sequences whose query rows follow each other
/// in `q` and `out`, all (row, head) pairs in one parallel loop (a batched decode step has one
/// row per sequence: one loop per sequence would pay a fork-join each). The same arithmetic in
/// the same order as the contiguous kernel, so a sequence gets bit-identical outputs whichever
/// layout holds its cache and whichever batch it is in.
/// Panics on inconsistent sizes (a block table too short for its rows, a block outside the cache).
pub fn attention_paged<T: KvElem>(p: &AttentionParams, q: &[f32], kv: &PagedKv<'_, T>, seqs: &[PagedSeq<'_>], out: &mut [f32]) {
    attention_paged_at(simd_level(), p, q, kv, seqs, out)
}

pub(crate) fn attention_paged_at<T: KvElem>(level: SimdLevel, p: &AttentionParams, q: &[f32], kv: &PagedKv<'_, T>, seqs: &[PagedSeq<'_>], out: &mut [f32]) {
    let (nh, nkv, hd) = (p.n_heads, p.n_kv_heads, p.head_dim);
    assert!(nkv > 0 && nh % nkv == 0 && hd > 0, "attention: {nh} heads cannot share {nkv} KV heads of {hd}");
    assert!(p.window != Some(0), "attention: a window of 0 sees no key");
    assert!(level.is_available(), "attention: {level:?} is not available on this CPU");
    let (qw, kvw, bs) = (nh * hd, nkv * hd, kv.block_size);
    assert!(bs > 0, "attention: block size 0");
    let n_rows: usize = seqs.iter().map(|s| s.n_tokens).sum();
    assert_eq!(q.len(), n_rows * qw, "attention: q has {} values, expected {n_rows} x {qw}", q.len());
    assert_eq!(out.len(), n_rows * qw, "attention: out has {} values, expected {n_rows} x {qw}", out.len());
    let block_elems = bs * kvw;
    // Each row's block table and keys.
    let mut rows = Vec::with_capacity(n_rows);
    for s in seqs {
        let kv_len = s.start_pos + s.n_tokens;
        assert!(s.blocks.len() * bs >= kv_len, "attention: {} blocks of {bs} cannot hold {kv_len} rows", s.blocks.len());
        for &b in &s.blocks[..kv_len.div_ceil(bs)] {
            let end = (b as usize + 1) * block_elems;
            assert!(end <= kv.k.len() && end <= kv.v.len(), "attention: block {b} is outside the cache");
        }
        let first = |pos: usize| p.window.map_or(0, |w| (pos + 1).saturating_sub(w));
        rows.extend((s.start_pos..kv_len).map(|pos| RowKeys { blocks: s.blocks, first: first(pos), end: pos + 1 }));
    }
    attend_rows(level, p, q, kv, &rows, out);
}

/// The two inner loops over the rows of a run, for the query heads of one call (their rows
/// back to back in `queries`/`out`; row g of the weights at `g * ld`):
/// `scores(queries, keys, block_size, scale, scores, ld, len)` writes `q_g · k_j * scale` for the
/// run's `len` keys (element `d` of key `j` at `keys[d * block_size + j]`), each as four sums
/// over the elements `d = u mod 4` in order, then `(s0 + s1) + (s2 + s3)`, whichever the vector
/// width; `weighted_sum(weights, ld, len, values, norms, out, accumulate)`
/// sets (or, with its last argument, adds to) `out_g = Σ_j w_gj v_j`, then multiplies it by
/// `norms[g]`. `values` are the run's rows, one head's worth each, back to back.
/// Safety: the functions may use the CPU features of the level they were selected for.
struct Kernels<T> {
    scores: Scores<T>,
    weighted_sum: WeightedSum<T>,
}

type Scores<T> = unsafe fn(&[f32], &[T], usize, f32, &mut [f32], usize, usize);
type WeightedSum<T> = unsafe fn(&[f32], usize, usize, &[T], &[f32], &mut [f32], bool);

impl<T: KvElem> Kernels<T> {
    fn for_level(level: SimdLevel, head_dim: usize, heads: usize) -> Kernels<T> {
        #[cfg(target_arch = "x86_64")]
        if head_dim.is_multiple_of(x86::CHUNK) {
            // One monomorphic loop per head count, so that each head's accumulators are registers.
            macro_rules! by_heads {
                ($wide:literal) => {
                    match heads {
                        1 => Some(Kernels { scores: x86::scores::<T, $wide, 1>, weighted_sum: x86::weighted_sum::<T, $wide, 1> }),
                        2 => Some(Kernels { scores: x86::scores::<T, $wide, 2>, weighted_sum: x86::weighted_sum::<T, $wide, 2> }),
                        3 => Some(Kernels { scores: x86::scores::<T, $wide, 3>, weighted_sum: x86::weighted_sum::<T, $wide, 3> }),
                        4 => Some(Kernels { scores: x86::scores::<T, $wide, 4>, weighted_sum: x86::weighted_sum::<T, $wide, 4> }),
                        _ => None,
                    }
                };
            }
            let simd = match level {
                SimdLevel::Avx512Vnni => by_heads!(true),
                SimdLevel::Avx2 => by_heads!(false),
                _ => None,
            };
            if let Some(k) = simd {
                return k;
            }
        }
        let _ = (level, head_dim, heads);
        Kernels {
            scores: scores_portable::<T>,
            weighted_sum: weighted_sum_portable::<T>,
        }
    }
}

fn scores_portable<T: KvElem>(queries: &[f32], keys: &[T], block_size: usize, scale: f32, scores: &mut [f32], ld: usize, len: usize) {
    if len == 0 {
        return;
    }
    // `keys` ends with the last key's last element.
    let hd = (keys.len() - len) / block_size + 1;
    for (g, q) in queries.chunks(hd).enumerate() {
        for j in 0..len {
            let mut sums = [0f32; 4];
            for (d, &qd) in q.iter().enumerate() {
                sums[d % 4] += qd * keys[d * block_size + j].to_f32();
            }
            scores[g * ld + j] = ((sums[0] + sums[1]) + (sums[2] + sums[3])) * scale;
        }
    }
}

fn weighted_sum_portable<T: KvElem>(
    weights: &[f32],
    ld: usize,
    len: usize,
    values: &[T],
    norms: &[f32],
    out: &mut [f32],
    accumulate: bool,
) {
    let hd = out.len() / norms.len();
    if !accumulate {
        out.fill(0.0);
    }
    for (g, out) in out.chunks_mut(hd).enumerate() {
        for j in 0..len {
            let w = weights[g * ld + j];
            for (o, v) in out.iter_mut().zip(&values[j * hd..][..hd]) {
                *o += w * v.to_f32();
            }
        }
        out.iter_mut().for_each(|o| *o *= norms[g]);
    }
}

/// AVX2 and AVX-512 loops, written once by a macro over a vector-width module (as the row-group
/// kernels are). Scores: `LANES` keys at a time from the transposed keys of a block, one vector
/// of one element of each, multiplied by that element of each head's query (a broadcast), so
/// that the lanes are the keys' scores with no reduction across lanes. Weighted sums: each value
/// row is loaded and converted once for all the heads of the call, whose sums stay in registers.
#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::KvElem;

    /// The head size the loops need a multiple of (the weighted sum's pass over the dimensions).
    pub(super) const CHUNK: usize = 64;

    /// Safety: AVX2, FMA and F16C must be available, and AVX-512 F for the `WIDE` (512-bit)
    /// loops. Sizes are checked.
    pub(super) unsafe fn scores<T: KvElem, const WIDE: bool, const G: usize>(
        queries: &[f32],
        keys: &[T],
        block_size: usize,
        scale: f32,
        scores: &mut [f32],
        ld: usize,
        len: usize,
    ) {
        let hd = queries.len() / G;
        assert!(
            queries.len() == G * hd
                && hd.is_multiple_of(CHUNK)
                && len <= block_size
                && (len == 0 || (keys.len() >= (hd - 1) * block_size + len && scores.len() >= (G - 1) * ld + len)),
            "attention scores: sizes"
        );
        // SAFETY: the features per the caller; the reads and writes stay within the slices
        // (checked above).
        if WIDE {
            scores_avx512::<T, G>(queries, keys, block_size, scale, scores, ld, len)
        } else {
            scores_avx2::<T, G>(queries, keys, block_size, scale, scores, ld, len)
        }
    }

    /// Safety: as [`scores`].
    pub(super) unsafe fn weighted_sum<T: KvElem, const WIDE: bool, const G: usize>(
        weights: &[f32],
        ld: usize,
        len: usize,
        values: &[T],
        norms: &[f32],
        out: &mut [f32],
        accumulate: bool,
    ) {
        let hd = out.len() / G;
        assert!(
            out.len() == G * hd
                && norms.len() == G
                && hd.is_multiple_of(CHUNK)
                && (len == 0 || (values.len() >= len * hd && weights.len() >= (G - 1) * ld + len)),
            "attention sum: sizes"
        );
        // SAFETY: as in `scores`.
        if WIDE {
            weighted_sum_avx512::<T, G>(weights, ld, len, values, norms, out, accumulate)
        } else {
            weighted_sum_avx2::<T, G>(weights, ld, len, values, norms, out, accumulate)
        }
    }

    /// The vector width of a pair of loops: f32 intrinsics under one set of names (re-exports,
    /// which inline into the `target_feature` loops), the cache loads and the partial stores.
    mod ymm {
        use super::KvElem;
        use std::arch::x86_64::*;
        pub use std::arch::x86_64::{
            __m256 as F32s, _mm256_add_ps as add, _mm256_fmadd_ps as fmadd, _mm256_loadu_ps as load, _mm256_mul_ps as mul,
            _mm256_set1_ps as set1, _mm256_setzero_ps as setzero, _mm256_storeu_ps as store,
        };
        pub const LANES: usize = 8;

        /// Eight cache values from `p` as f32 (`vcvtph2ps` for f16).
        #[inline(always)]
        pub unsafe fn load_kv<T: KvElem>(p: *const T) -> F32s {
            if T::HALF {
                _mm256_cvtph_ps(_mm_loadu_si128(p as *const __m128i))
            } else {
                _mm256_loadu_ps(p as *const f32)
            }
        }

        /// The first `n` (< 8) cache values from `p` as f32, the other lanes 0 (through a copy:
        /// AVX2 has no 16-bit masked load).
        #[inline(always)]
        pub unsafe fn load_kv_n<T: KvElem>(p: *const T, n: usize) -> F32s {
            let mut part = [T::ZERO; LANES];
            std::ptr::copy_nonoverlapping(p, part.as_mut_ptr(), n);
            load_kv(part.as_ptr())
        }

        /// Stores the first `n` (< 8) lanes of `v` at `p`.
        #[inline(always)]
        pub unsafe fn store_n(p: *mut f32, v: F32s, n: usize) {
            let mut part = [0f32; LANES];
            _mm256_storeu_ps(part.as_mut_ptr(), v);
            std::ptr::copy_nonoverlapping(part.as_ptr(), p, n);
        }
    }

    mod zmm {
        use super::KvElem;
        use std::arch::x86_64::*;
        pub use std::arch::x86_64::{
            __m512 as F32s, _mm512_add_ps as add, _mm512_fmadd_ps as fmadd, _mm512_loadu_ps as load, _mm512_mul_ps as mul,
            _mm512_set1_ps as set1, _mm512_setzero_ps as setzero, _mm512_storeu_ps as store,
        };
        pub const LANES: usize = 16;

        /// Sixteen cache values from `p` as f32.
        #[inline(always)]
        pub unsafe fn load_kv<T: KvElem>(p: *const T) -> F32s {
            if T::HALF {
                _mm512_cvtph_ps(_mm256_loadu_si256(p as *const __m256i))
            } else {
                _mm512_loadu_ps(p as *const f32)
            }
        }

        /// The first `n` (< 16) cache values from `p` as f32, the other lanes 0 (masked loads).
        #[inline(always)]
        pub unsafe fn load_kv_n<T: KvElem>(p: *const T, n: usize) -> F32s {
            let mask = (1u32 << n) - 1;
            if T::HALF {
                _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mask as u16, p as *const i16))
            } else {
                _mm512_maskz_loadu_ps(mask as u16, p as *const f32)
            }
        }

        /// Stores the first `n` (< 16) lanes of `v` at `p`.
        #[inline(always)]
        pub unsafe fn store_n(p: *mut f32, v: F32s, n: usize) {
            _mm512_mask_storeu_ps(p, ((1u32 << n) - 1) as u16, v)
        }
    }

    /// Value rows ahead whose cache lines the weighted sum requests within its run (`attend`
    /// asks for the next run): a batched step's cache outgrows L2, and a run is short for the
    /// hardware prefetchers to pick up.
    pub(super) const PREFETCH_ROWS: usize = 4;

    /// Asks for the cache lines of the `n` elements from `p`.
    #[inline(always)]
    pub(super) fn prefetch_row<T>(p: *const T, n: usize) {
        use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0};
        let bytes = n * std::mem::size_of::<T>();
        for off in (0..bytes).step_by(64) {
            // SAFETY: a prefetch is a hint: it never faults and reads nothing into the program.
            unsafe { _mm_prefetch::<_MM_HINT_T0>((p as *const i8).wrapping_add(off)) };
        }
    }

    /// The scores and weighted-sum loops at one vector width.
    macro_rules! attention_loops {
        ($scores:ident, $weighted_sum:ident, $features:literal, $width:ident) => {
            #[target_feature(enable = $features)]
            unsafe fn $scores<T: KvElem, const G: usize>(q: &[f32], keys: &[T], block_size: usize, scale: f32, scores: &mut [f32], ld: usize, len: usize) {
                use $width::*;
                let hd = q.len() / G;
                let scale = set1(scale);
                for j0 in (0..len).step_by(LANES) {
                    let n = LANES.min(len - j0);
                    let k = keys.as_ptr().add(j0);
                    // A vector of keys per element; four sums per head (element d into sum
                    // d mod 4), so that G x 4 chains of multiply-adds are in flight.
                    let mut acc = [[setzero(); 4]; G];
                    for d0 in (0..hd).step_by(4) {
                        for (u, d) in (d0..d0 + 4).enumerate() {
                            let kv = if n == LANES { load_kv(k.add(d * block_size)) } else { load_kv_n(k.add(d * block_size), n) };
                            for (g, a) in acc.iter_mut().enumerate() {
                                a[u] = fmadd(set1(*q.get_unchecked(g * hd + d)), kv, a[u]);
                            }
                        }
                    }
                    for (g, [s0, s1, s2, s3]) in acc.into_iter().enumerate() {
                        let sums = mul(add(add(s0, s1), add(s2, s3)), scale);
                        let dst = scores.as_mut_ptr().add(g * ld + j0);
                        if n == LANES {
                            store(dst, sums);
                        } else {
                            store_n(dst, sums, n);
                        }
                    }
                }
            }

            #[target_feature(enable = $features)]
            unsafe fn $weighted_sum<T: KvElem, const G: usize>(
                weights: &[f32],
                ld: usize,
                len: usize,
                values: &[T],
                norms: &[f32],
                out: &mut [f32],
                accumulate: bool,
            ) {
                use $width::*;
                // Four vectors of each head's sum per pass: 4 x G accumulators in registers.
                const VECS: usize = 4;
                let hd = out.len() / G;
                for c in (0..hd).step_by(VECS * LANES) {
                    let mut acc = [[setzero(); VECS]; G];
                    if accumulate {
                        for (g, a) in acc.iter_mut().enumerate() {
                            for (i, a) in a.iter_mut().enumerate() {
                                *a = load(out.as_ptr().add(g * hd + c + LANES * i));
                            }
                        }
                    }
                    for j in 0..len {
                        let v = values.as_ptr().add(j * hd + c);
                        if j + PREFETCH_ROWS < len {
                            prefetch_row(v.add(PREFETCH_ROWS * hd), VECS * LANES);
                        }
                        let vv: [F32s; VECS] = std::array::from_fn(|i| load_kv(v.add(LANES * i)));
                        for (g, a) in acc.iter_mut().enumerate() {
                            let w = set1(*weights.get_unchecked(g * ld + j));
                            for (a, v) in a.iter_mut().zip(&vv) {
                                *a = fmadd(w, *v, *a);
                            }
                        }
                    }
                    for (g, a) in acc.iter().enumerate() {
                        let norm = set1(norms[g]);
                        for (i, a) in a.iter().enumerate() {
                            store(out.as_mut_ptr().add(g * hd + c + LANES * i), mul(*a, norm));
                        }
                    }
                }
            }
        };
    }

    attention_loops!(scores_avx2, weighted_sum_avx2, "avx2,fma,f16c", ymm);
    attention_loops!(scores_avx512, weighted_sum_avx512, "avx2,fma,f16c,avx512f", zmm);
}

/// `tanh(x) = 1 - 2 / (e^(2x) + 1)`, saturating to ±1.
#[inline(always)]
pub(crate) fn tanh(x: f32) -> f32 {
    1.0 - 2.0 / (fvec::exp(2.0 * x) + 1.0)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Straightforward f64 attention.
    fn reference(
        p: &AttentionParams,
        q: &[f32],
        k: &[f32],
        v: &[f32],
        start: usize,
        n: usize,
    ) -> Vec<f64> {
        let (nh, hd, kvw) = (p.n_heads, p.head_dim, p.n_kv_heads * p.head_dim);
        let mut out = vec![0f64; n * nh * hd];
        for t in 0..n {
            let pos = start + t;
            for h in 0..nh {
                let kvh = h / (nh / p.n_kv_heads);
                let keys: Vec<usize> = (0..=pos)
                    .filter(|&j| p.window.is_none_or(|w| j + w > pos))
                    .collect();
                let scores: Vec<f64> = keys
                    .iter()
                    .map(|&j| {
                        let s: f64 = (0..hd)
                            .map(|d| {
                                q[(t * nh + h) * hd + d] as f64 * k[j * kvw + kvh * hd + d] as f64
                            })
                            .sum();
                        let s = s * p.scale as f64;
                        p.softcap.map_or(s, |c| c as f64 * (s / c as f64).tanh())
                    })
                    .collect();
                let max = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let e: Vec<f64> = scores.iter().map(|s| (s - max).exp()).collect();
                let z: f64 = e.iter().sum();
                for (&j, w) in keys.iter().zip(&e) {
                    for d in 0..hd {
                        out[(t * nh + h) * hd + d] += w / z * v[j * kvw + kvh * hd + d] as f64;
                    }
                }
            }
        }
        out
    }

    fn pool(threads: usize) -> rayon::ThreadPool {
        rayon::ThreadPoolBuilder::new().num_threads(threads).build().expect("thread pool")
    }

    #[test]
    fn heads_share_a_call_when_there_are_tasks_enough() {
        // SmolLM2 (3 heads per KV head) on 2 threads: one decode row gives 3 grouped tasks,
        // too few; 2 rows (or parts of a row's keys) give 6.
        pool(2).install(|| {
            assert_eq!(heads_per_task(1, 9, 3), 1);
            assert_eq!(heads_per_task(2, 9, 3), 3);
        });
        // Groups of 8 heads run 4 to a call; groups of 5 one (no divisor up to 4 but 1).
        pool(1).install(|| {
            assert_eq!(heads_per_task(1, 32, 8), 4);
            assert_eq!(heads_per_task(8, 10, 5), 1);
        });
    }

    fn values(n: usize, seed: usize) -> Vec<f32> {
        (0..n)
            .map(|i| (((i * 7919 + seed * 104729) % 1000) as f32 / 500.0 - 1.0) * 1.5)
            .collect()
    }

    #[test]
    fn gqa_causal_window_softcap_match_f64() {
        let cases = [
            (9, 3, 64, 0, 1, None, None),
            (4, 2, 128, 3, 5, None, None),
            (2, 1, 80, 2, 3, None, None),
            (9, 3, 64, 5, 7, None, None),
            (9, 3, 64, 13, 4, Some(6), None),
            (4, 1, 16, 0, 9, Some(3), Some(5.0f32)),
            (2, 2, 8, 30, 2, Some(1), None),
            // Four heads per KV head (one call), one, and eight (two calls of four), over several
            // batches of 16 rows and a partial one.
            (8, 2, 64, 37, 5, None, None),
            (4, 4, 64, 16, 17, None, None),
            (8, 1, 128, 40, 3, Some(33), Some(20.0)),
            // Keys split into parts (over SPLIT_KEYS) and merged: 3 parts, a windowed 2 with a
            // soft cap, rows of 2 and 3 parts side by side.
            (9, 3, 64, 600, 2, None, None),
            (8, 2, 128, 300, 1, Some(290), Some(30.0)),
            (4, 2, 64, 500, 30, None, None),
        ];
        for (nh, nkv, hd, start, n, window, softcap) in cases {
            let p = AttentionParams {
                window,
                softcap,
                ..AttentionParams::new(nh, nkv, hd)
            };
            let kv_len = start + n;
            let q = values(n * nh * hd, 1);
            let k = values(kv_len * nkv * hd, 2);
            let v = values(kv_len * nkv * hd, 3);
            // An f16 cache: the same attention over the rounded keys and values.
            let (k16, v16): (Vec<half::f16>, Vec<half::f16>) = (k.iter().map(|&x| half::f16::from_f32(x)).collect(), v.iter().map(|&x| half::f16::from_f32(x)).collect());
            let (kr, vr): (Vec<f32>, Vec<f32>) = (k16.iter().map(|x| x.to_f32()).collect(), v16.iter().map(|x| x.to_f32()).collect());
            let (want, want16) = (reference(&p, &q, &k, &v, start, n), reference(&p, &q, &kr, &vr, start, n));
            for level in SimdLevel::available() {
                let (mut out, mut out16) = (vec![0f32; q.len()], vec![0f32; q.len()]);
                attention_at(level, &p, &q, &k, &v, start, n, &mut out);
                attention_at(level, &p, &q, &k16, &v16, start, n, &mut out16);
                // On one thread most cases run a KV group's heads in one call, on 64 threads one
                // head per call: the same bits either way.
                for threads in [1, 64] {
                    let mut again = vec![0f32; q.len()];
                    pool(threads).install(|| attention_at(level, &p, &q, &k16, &v16, start, n, &mut again));
                    assert_eq!(again, out16, "{level:?} case {nh}/{nkv}/{hd} start {start}: {threads} threads");
                }
                for (i, ((got, want), (got16, want16))) in out.iter().zip(&want).zip(out16.iter().zip(&want16)).enumerate() {
                    // Outputs are convex combinations of values within ±1.5; f32 scores with
                    // |q·k| <= 64 * 2.25 carry ~1e-5 of rounding.
                    assert!(
                        (*got as f64 - want).abs() < 2e-5 && (*got16 as f64 - want16).abs() < 2e-5,
                        "{level:?} case {nh}/{nkv}/{hd} start {start} at {i}: {got} vs {want}, f16 cache {got16} vs {want16}"
                    );
                }
            }
        }
    }

    #[test]
    fn paged_offsets_cover_every_block_once() {
        let p = AttentionParams::new(6, 3, 4);
        let bs = 5;
        let (mut values, mut keys) = (vec![false; 2 * bs * 3 * 4], vec![false; 2 * bs * 3 * 4]);
        for block in 0..2 {
            for row in 0..bs {
                for head in 0..3 {
                    let (at, key_at) = (paged_offset(&p, bs, block, row, head), paged_key_offset(&p, bs, block, row, head));
                    for d in 0..4 {
                        for (seen, i) in [(&mut values, at + d), (&mut keys, key_at + d * bs)] {
                            assert!(!seen[i], "block {block} row {row} head {head} overlaps");
                            seen[i] = true;
                        }
                    }
                    // A key and a value of one (block, head) share that pair's region.
                    assert_eq!(key_at - row, at - row * 4);
                }
            }
        }
        assert!(values.iter().chain(&keys).all(|&s| s));
        // One head's value rows of a block are consecutive, as are its keys' elements d.
        assert_eq!(paged_offset(&p, bs, 1, 3, 2) + 4, paged_offset(&p, bs, 1, 4, 2));
        assert_eq!(paged_key_offset(&p, bs, 1, 3, 2) + 1, paged_key_offset(&p, bs, 1, 4, 2));
    }

    #[test]
    fn paged_attention_is_bit_identical_to_contiguous() {
        let cases = [(9, 3, 64, 0, 1, None, 4), (9, 3, 64, 5, 7, None, 4), (4, 2, 128, 17, 3, None, 16), (9, 3, 64, 13, 4, Some(6), 3), (2, 1, 80, 2, 30, None, 5), (4, 1, 16, 6, 9, Some(3), 1), (8, 2, 64, 37, 5, None, 16), (8, 1, 128, 40, 3, None, 7), (9, 3, 64, 520, 3, None, 16), (4, 2, 64, 700, 2, Some(300), 5)];
        for (nh, nkv, hd, start, n, window, bs) in cases {
            let p = AttentionParams { window, ..AttentionParams::new(nh, nkv, hd) };
            let (kvw, kv_len) = (nkv * hd, start + n);
            let q = values(n * nh * hd, 1);
            let k = values(kv_len * kvw, 2);
            let v = values(kv_len * kvw, 3);
            let n_used = kv_len.div_ceil(bs);
            let n_blocks = 2 * n_used + 1;
            let blocks: Vec<u32> = (0..n_used as u32).map(|b| (n_blocks as u32 - 1) - 2 * b).collect();
            // Scattered in a shuffled order, with unused blocks (NaN) between.
            let (ka, va) = (to_blocks(&p, &k, true, bs, &blocks, n_blocks, f32::NAN), to_blocks(&p, &v, false, bs, &blocks, n_blocks, f32::NAN));
            for level in SimdLevel::available() {
                let mut want = vec![0f32; q.len()];
                attention_at(level, &p, &q, &k, &v, start, n, &mut want);
                let mut got = vec![0f32; q.len()];
                let kv = PagedKv { k: &ka, v: &va, block_size: bs };
                attention_paged_at(level, &p, &q, &kv, &[PagedSeq { blocks: &blocks, start_pos: start, n_tokens: n }], &mut got);
                assert_eq!(got, want, "{level:?} case {nh}/{nkv}/{hd} start {start} n {n} block {bs}");
                // Twice in one batch, behind a one-row sequence on the same blocks: the same bits.
                let seqs = [
                    PagedSeq { blocks: &blocks, start_pos: 0, n_tokens: 1 },
                    PagedSeq { blocks: &blocks, start_pos: start, n_tokens: n },
                    PagedSeq { blocks: &blocks, start_pos: start, n_tokens: n },
                ];
                let mut q3 = q[..nh * hd].to_vec();
                q3.extend_from_slice(&q);
                q3.extend_from_slice(&q);
                let mut got3 = vec![0f32; q3.len()];
                attention_paged_at(level, &p, &q3, &kv, &seqs, &mut got3);
                assert_eq!(got3[nh * hd..nh * hd + q.len()], want[..], "{level:?} batch of three: second sequence");
                assert_eq!(got3[nh * hd + q.len()..], want[..], "{level:?} batch of three: third sequence");
            }
        }
    }

    #[test]
    fn window_of_one_returns_the_own_value() {
        let p = AttentionParams {
            window: Some(1),
            ..AttentionParams::new(1, 1, 4)
        };
        let (q, k) = (values(8, 1), values(12, 2));
        let v: Vec<f32> = (0..12).map(|i| i as f32).collect();
        let mut out = vec![0f32; 8];
        attention(&p, &q, &k, &v, 1, 2, &mut out);
        assert_eq!(out, v[4..].to_vec());
    }
}
