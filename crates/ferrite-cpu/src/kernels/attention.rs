//! Causal grouped-query attention over an f32 KV cache.

use super::fvec;
use rayon::prelude::*;

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
        AttentionParams { n_heads, n_kv_heads, head_dim, scale: 1.0 / (head_dim as f32).sqrt(), window: None, softcap: None }
    }
}

/// Attention of `n_tokens` new queries at positions `start_pos ..`, over a cache holding
/// `kv_len = start_pos + n_tokens` rows (the new tokens' keys and values included).
///
/// `q`, `out`: `n_tokens x (n_heads * head_dim)`; `k_cache`, `v_cache`: `kv_len x (n_kv_heads * head_dim)`.
/// Softmax in f32 with the maximum subtracted. Parallel over (token, head).
/// Panics on inconsistent sizes.
pub fn attention(
    p: &AttentionParams,
    q: &[f32],
    k_cache: &[f32],
    v_cache: &[f32],
    start_pos: usize,
    n_tokens: usize,
    out: &mut [f32],
) {
    let (nh, nkv, hd) = (p.n_heads, p.n_kv_heads, p.head_dim);
    assert!(nkv > 0 && nh % nkv == 0 && hd > 0, "attention: {nh} heads cannot share {nkv} KV heads of {hd}");
    assert!(p.window != Some(0), "attention: a window of 0 sees no key");
    let (qw, kvw, kv_len) = (nh * hd, nkv * hd, start_pos + n_tokens);
    assert_eq!(q.len(), n_tokens * qw, "attention: q has {} values, expected {n_tokens} x {qw}", q.len());
    assert_eq!(out.len(), n_tokens * qw, "attention: out has {} values, expected {n_tokens} x {qw}", out.len());
    for (name, cache) in [("k", k_cache), ("v", v_cache)] {
        assert_eq!(cache.len(), kv_len * kvw, "attention: {name} cache has {} values, expected {kv_len} x {kvw}", cache.len());
    }
    let group = nh / nkv;
    out.par_chunks_mut(hd).enumerate().for_each(|(i, out)| {
        let (t, h) = (i / nh, i % nh);
        let pos = start_pos + t;
        let first = p.window.map_or(0, |w| (pos + 1).saturating_sub(w));
        let query = &q[t * qw + h * hd..][..hd];
        let kv_col = h / group * hd;
        let mut scores: Vec<f32> = (first..=pos)
            .map(|j| {
                let s = fvec::dot(query, &k_cache[j * kvw + kv_col..][..hd]) * p.scale;
                match p.softcap {
                    Some(cap) => cap * tanh(s / cap),
                    None => s,
                }
            })
            .collect();
        let sum = softmax_unnormalized(&mut scores);
        out.fill(0.0);
        for (j, &w) in (first..=pos).zip(&scores) {
            for (o, &v) in out.iter_mut().zip(&v_cache[j * kvw + kv_col..][..hd]) {
                *o += w * v;
            }
        }
        let inv = 1.0 / sum;
        out.iter_mut().for_each(|o| *o *= inv);
    });
}

/// `x -> exp(x - max)` in place; returns the sum.
pub(crate) fn softmax_unnormalized(x: &mut [f32]) -> f32 {
    let max = x.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v));
    let mut sum = 0.0;
    for v in x.iter_mut() {
        *v = fvec::exp(*v - max);
        sum += *v;
    }
    sum
}

/// `tanh(x) = 1 - 2 / (e^(2x) + 1)`, saturating to ±1.
pub(crate) fn tanh(x: f32) -> f32 {
    1.0 - 2.0 / (fvec::exp(2.0 * x) + 1.0)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Straightforward f64 attention.
    fn reference(p: &AttentionParams, q: &[f32], k: &[f32], v: &[f32], start: usize, n: usize) -> Vec<f64> {
        let (nh, hd, kvw) = (p.n_heads, p.head_dim, p.n_kv_heads * p.head_dim);
        let mut out = vec![0f64; n * nh * hd];
        for t in 0..n {
            let pos = start + t;
            for h in 0..nh {
                let kvh = h / (nh / p.n_kv_heads);
                let keys: Vec<usize> = (0..=pos).filter(|&j| p.window.is_none_or(|w| j + w > pos)).collect();
                let scores: Vec<f64> = keys
                    .iter()
                    .map(|&j| {
                        let s: f64 = (0..hd).map(|d| q[(t * nh + h) * hd + d] as f64 * k[j * kvw + kvh * hd + d] as f64).sum();
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

    fn values(n: usize, seed: usize) -> Vec<f32> {
        (0..n).map(|i| (((i * 7919 + seed * 104729) % 1000) as f32 / 500.0 - 1.0) * 1.5).collect()
    }

    #[test]
    fn gqa_causal_window_softcap_match_f64() {
        let cases = [
            (9, 3, 64, 0, 1, None, None),
            (9, 3, 64, 5, 7, None, None),
            (9, 3, 64, 13, 4, Some(6), None),
            (4, 1, 16, 0, 9, Some(3), Some(5.0f32)),
            (2, 2, 8, 30, 2, Some(1), None),
        ];
        for (nh, nkv, hd, start, n, window, softcap) in cases {
            let p = AttentionParams { window, softcap, ..AttentionParams::new(nh, nkv, hd) };
            let kv_len = start + n;
            let q = values(n * nh * hd, 1);
            let k = values(kv_len * nkv * hd, 2);
            let v = values(kv_len * nkv * hd, 3);
            let mut out = vec![0f32; q.len()];
            attention(&p, &q, &k, &v, start, n, &mut out);
            let want = reference(&p, &q, &k, &v, start, n);
            for (i, (got, want)) in out.iter().zip(&want).enumerate() {
                // Outputs are convex combinations of values within ±1.5; f32 scores with
                // |q·k| <= 64 * 2.25 carry ~1e-5 of rounding.
                assert!((*got as f64 - want).abs() < 2e-5, "case {nh}/{nkv}/{hd} start {start} at {i}: {got} vs {want}");
            }
        }
    }

    #[test]
    fn window_of_one_returns_the_own_value() {
        let p = AttentionParams { window: Some(1), ..AttentionParams::new(1, 1, 4) };
        let (q, k) = (values(8, 1), values(12, 2));
        let v: Vec<f32> = (0..12).map(|i| i as f32).collect();
        let mut out = vec![0f32; 8];
        attention(&p, &q, &k, &v, 1, 2, &mut out);
        assert_eq!(out, v[4..].to_vec());
    }
}
