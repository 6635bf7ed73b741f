//! Host-side token sampling: repetition penalty, top-k, top-p, min-p, temperature, seeded RNG.
//!
//! The order follows llama.cpp's default chain: penalties, then top-k, top-p, min-p, then
//! temperature and a draw from the renormalised distribution. `temperature <= 0` is greedy.

use ferrite_cpu::kernels::activation;
use ferrite_model::DeviceSampling;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use std::cmp::Reverse;
use std::collections::BinaryHeap;

#[derive(Clone, Debug, PartialEq)]
pub struct SamplerParams {
    /// 0 (or less) means greedy decoding.
    pub temperature: f32,
    /// Keep the k most likely tokens (0 = off).
    pub top_k: usize,
    /// Keep the smallest set whose probability mass reaches p (1.0 = off).
    pub top_p: f32,
    /// Drop tokens whose probability is below `min_p` times the top probability (0 = off).
    pub min_p: f32,
    /// Divide positive (multiply negative) logits of recently seen tokens (1.0 = off).
    pub repeat_penalty: f32,
    /// How many recent tokens the penalty looks at.
    pub repeat_last_n: usize,
    pub seed: u64,
}

impl Default for SamplerParams {
    fn default() -> Self {
        Self::DEFAULT
    }
}

impl SamplerParams {
    /// llama.cpp's defaults; the CLI flags take theirs from here.
    pub const DEFAULT: Self =
        Self { temperature: 0.8, top_k: 40, top_p: 0.95, min_p: 0.05, repeat_penalty: 1.0, repeat_last_n: 64, seed: 0 };

    pub fn greedy() -> Self {
        Self { temperature: 0.0, ..Self::default() }
    }

    pub fn is_greedy(&self) -> bool {
        self.temperature <= 0.0
    }

    /// These settings for a backend's device sampler at sampling step `step`, or `None` when
    /// they need the host (a repetition penalty reads the history).
    pub fn on_device(&self, step: u64) -> Option<DeviceSampling> {
        (self.repeat_penalty == 1.0).then_some(DeviceSampling {
            temperature: self.temperature,
            top_k: self.top_k,
            top_p: self.top_p,
            min_p: self.min_p,
            seed: self.seed,
            step,
        })
    }

    pub fn validate(&self) -> Result<(), String> {
        if !self.temperature.is_finite() || self.temperature < 0.0 {
            return Err(format!("temperature must be >= 0, got {}", self.temperature));
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return Err(format!("top-p must be in (0, 1], got {}", self.top_p));
        }
        if !(0.0..=1.0).contains(&self.min_p) {
            return Err(format!("min-p must be in [0, 1], got {}", self.min_p));
        }
        if !(self.repeat_penalty > 0.0 && self.repeat_penalty.is_finite()) {
            return Err(format!("repeat penalty must be > 0, got {}", self.repeat_penalty));
        }
        Ok(())
    }
}

pub struct Sampler {
    params: SamplerParams,
    rng: StdRng,
}

pub use ferrite_model::argmax;

impl Sampler {
    pub fn new(params: SamplerParams) -> Self {
        let rng = StdRng::seed_from_u64(params.seed);
        Self { params, rng }
    }

    pub fn params(&self) -> &SamplerParams {
        &self.params
    }

    /// Pick the next token from `logits`, given the tokens produced so far (for the penalty).
    pub fn sample(&mut self, logits: &mut [f32], history: &[u32]) -> u32 {
        let p = &self.params;
        if p.repeat_penalty != 1.0 {
            let start = history.len().saturating_sub(p.repeat_last_n);
            let mut seen: Vec<u32> = history[start..].to_vec();
            seen.sort_unstable();
            seen.dedup();
            for t in seen {
                if let Some(l) = logits.get_mut(t as usize) {
                    *l = if *l > 0.0 { *l / p.repeat_penalty } else { *l * p.repeat_penalty };
                }
            }
        }
        if p.is_greedy() || logits.is_empty() {
            return argmax(logits);
        }
        // NaN logits never win; with no finite maximum (all -inf, or +inf ones) the draw is the
        // argmax.
        let max = nan_to_neg_inf_max(logits);
        if !max.is_finite() {
            return argmax(logits);
        }
        let n = logits.len();
        let top_k = if p.top_k == 0 { n } else { p.top_k.min(n) };
        let cuts = p.top_p < 1.0 || p.min_p > 0.0;
        let t = p.temperature;
        if top_k == n && !cuts {
            // The whole distribution, in token order: no candidate list, no sort.
            let sum = activation::exp_shifted(logits, max, 1.0 / t);
            return self.draw_dense(logits, sum);
        }
        let cand = kept_candidates(p, logits);
        let mut weights: Vec<f32> = cand.iter().map(|c| c.1 / t).collect();
        activation::softmax_inplace(&mut weights);
        self.draw(cand.iter().zip(weights).map(|(c, pr)| (c.0, pr)))
    }

    /// Draws from `(token, probability)` pairs that sum to ~1 (rounding aside: past the end, the
    /// last token with a nonzero probability).
    fn draw(&mut self, probs: impl Iterator<Item = (u32, f32)>) -> u32 {
        let r: f32 = self.rng.random();
        let (mut acc, mut last) = (0.0, 0);
        for (tok, pr) in probs {
            acc += pr;
            if pr > 0.0 {
                last = tok;
            }
            if r < acc {
                return tok;
            }
        }
        last
    }

    /// [`Sampler::draw`] over every token, with weights `weights[token]` that sum to `sum`: the
    /// running sum first skips whole chunks by their sums, which vectorize (a sequential scan
    /// of a vocabulary is ~50 µs).
    fn draw_dense(&mut self, weights: &[f32], sum: f32) -> u32 {
        const CHUNK: usize = 256;
        let r = self.rng.random::<f32>() * sum;
        let mut acc = 0.0;
        for (c, chunk) in weights.chunks(CHUNK).enumerate() {
            let mut lanes = [0f32; 8];
            chunk.chunks(8).for_each(|v| lanes.iter_mut().zip(v).for_each(|(l, &w)| *l += w));
            let chunk_sum: f32 = lanes.iter().sum();
            if r < acc + chunk_sum {
                for (i, &w) in chunk.iter().enumerate() {
                    acc += w;
                    if r < acc {
                        return (c * CHUNK + i) as u32;
                    }
                }
            } else {
                acc += chunk_sum;
            }
        }
        weights.iter().rposition(|&w| w > 0.0).unwrap_or(0) as u32
    }
}

/// Turns NaN logits into -inf and returns the maximum, in one pass over 16 lanes, which
/// vectorizes (a serial max over a vocabulary is ~50 µs).
fn nan_to_neg_inf_max(logits: &mut [f32]) -> f32 {
    let mut lanes = [f32::NEG_INFINITY; 16];
    for chunk in logits.chunks_mut(16) {
        for (m, l) in lanes.iter_mut().zip(chunk) {
            *l = if l.is_nan() { f32::NEG_INFINITY } else { *l };
            *m = m.max(*l);
        }
    }
    lanes.iter().fold(f32::NEG_INFINITY, |m, &l| m.max(l))
}

/// Log-probabilities of one distribution (a NaN logit counts as -inf), for `logprobs`
/// requests: a token's, and the most likely ones. The log-sum-exp comes from the vectorized
/// exponentials and the top from [`top_sorted`]: no 49 152-entry vector of logs, no sort.
pub struct LogProbs {
    logits: Vec<f32>,
    log_sum_exp: f32,
}

impl LogProbs {
    pub fn new(logits: &[f32]) -> Self {
        let mut logits = logits.to_vec();
        let max = nan_to_neg_inf_max(&mut logits);
        let log_sum_exp = if max.is_finite() {
            let mut e = logits.clone();
            activation::exp_shifted(&mut e, max, 1.0);
            // Summed in f64 lanes (vectorized): an f32 sum of a vocabulary's terms is off by ~1e-5.
            let mut lanes = [0f64; 8];
            e.chunks(8).for_each(|c| lanes.iter_mut().zip(c).for_each(|(l, &v)| *l += v as f64));
            max + lanes.iter().sum::<f64>().ln() as f32
        } else {
            max
        };
        LogProbs { logits, log_sum_exp }
    }

    /// `log p(token)`; -inf for a token outside the vocabulary or without probability.
    pub fn of(&self, token: u32) -> f32 {
        let lp = self.logits.get(token as usize).map_or(f32::NEG_INFINITY, |l| l - self.log_sum_exp);
        if lp.is_nan() { f32::NEG_INFINITY } else { lp }
    }

    /// The `k` most likely tokens with their log-probabilities, most likely first.
    pub fn top(&self, k: usize) -> Vec<(u32, f32)> {
        top_sorted(&self.logits, k.min(self.logits.len())).into_iter().map(|(t, _)| (t, self.of(t))).collect()
    }
}

/// The tokens that survive top-k, top-p and min-p, as `(token, logit)`, most likely first.
/// Their probabilities at temperature 1 decide the top-p/min-p cut, as in llama.cpp: over the
/// top k after top-k, else over the whole vocabulary, of which only a sorted prefix long enough
/// for the cut is built. `logits` has no NaN and a finite maximum.
fn kept_candidates(p: &SamplerParams, logits: &[f32]) -> Vec<(u32, f32)> {
    let n = logits.len();
    let top_k = if p.top_k == 0 { n } else { p.top_k.min(n) };
    let (mut cand, probs) = if top_k < n {
        let cand = top_sorted(logits, top_k);
        let mut probs: Vec<f32> = cand.iter().map(|c| c.1).collect();
        activation::softmax_inplace(&mut probs);
        (cand, probs)
    } else {
        let mut all = logits.to_vec();
        activation::softmax_inplace(&mut all);
        let mut k = 64.min(n);
        loop {
            let cand = top_sorted(logits, k);
            let probs: Vec<f32> = cand.iter().map(|c| all[c.0 as usize]).collect();
            let mass_reached = p.top_p < 1.0 && probs.iter().sum::<f32>() >= p.top_p;
            let floor_passed = p.min_p > 0.0 && probs[k - 1] < probs[0] * p.min_p;
            if mass_reached || floor_passed || k == n {
                break (cand, probs);
            }
            k = (16 * k).min(n);
        }
    };
    let mut keep = cand.len();
    if p.top_p < 1.0 {
        let mut mass = 0.0;
        for (i, &pr) in probs.iter().enumerate() {
            mass += pr;
            if mass >= p.top_p {
                keep = i + 1;
                break;
            }
        }
    }
    if p.min_p > 0.0 {
        let floor = probs[0] * p.min_p;
        keep = keep.min(probs.iter().take_while(|&&pr| pr >= floor).count().max(1));
    }
    cand.truncate(keep);
    cand
}

/// The `k` largest of `xs` (NaN-free) as `(index, value)`, largest first, ties to the lower
/// index. For a small `k`, a min-heap of the best `k` so far, fed only from 16-value chunks that
/// hold a value reaching the heap's smallest: on a vocabulary-sized row nearly every chunk is
/// skipped after one vectorized compare, where sorting the whole row took ~1 ms.
fn top_sorted(xs: &[f32], k: usize) -> Vec<(u32, f32)> {
    /// Ordered by value, then by lower index.
    #[derive(PartialEq)]
    struct Entry(f32, u32);
    impl Eq for Entry {}
    impl PartialOrd for Entry {
        fn partial_cmp(&self, o: &Self) -> Option<std::cmp::Ordering> {
            Some(self.cmp(o))
        }
    }
    impl Ord for Entry {
        fn cmp(&self, o: &Self) -> std::cmp::Ordering {
            self.0.total_cmp(&o.0).then(o.1.cmp(&self.1))
        }
    }
    let key = |&(i, v): &(u32, f32)| Entry(v, i);
    if k * 16 > xs.len() {
        // Most values make the cut: select and sort, as a heap would take nearly every one.
        let mut all: Vec<(u32, f32)> = xs.iter().enumerate().map(|(i, &v)| (i as u32, v)).collect();
        if k < all.len() {
            all.select_nth_unstable_by(k, |a, b| key(b).cmp(&key(a)));
            all.truncate(k);
        }
        all.sort_unstable_by_key(|a| std::cmp::Reverse(key(a)));
        return all;
    }
    const CHUNK: usize = 16;
    let mut heap = BinaryHeap::with_capacity(k + 1);
    let mut smallest = f32::NEG_INFINITY;
    for (c, chunk) in xs.chunks(CHUNK).enumerate() {
        if heap.len() == k && !chunk.iter().fold(false, |any, &v| any | (v >= smallest)) {
            continue;
        }
        for (i, &v) in chunk.iter().enumerate() {
            let e = Entry(v, (c * CHUNK + i) as u32);
            if heap.len() < k {
                heap.push(Reverse(e));
            } else if heap.peek().is_some_and(|Reverse(min)| e > *min) {
                heap.pop();
                heap.push(Reverse(e));
            } else {
                continue;
            }
            if heap.len() == k {
                smallest = heap.peek().map_or(f32::NEG_INFINITY, |Reverse(min)| min.0);
            }
        }
    }
    heap.into_sorted_vec().into_iter().map(|Reverse(Entry(v, i))| (i, v)).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn logits() -> Vec<f32> {
        vec![1.0, 3.0, 2.0, -1.0, 2.5]
    }

    #[test]
    fn greedy_picks_argmax() {
        let mut s = Sampler::new(SamplerParams::greedy());
        assert_eq!(s.sample(&mut logits(), &[]), 1);
    }

    #[test]
    fn nan_never_wins_argmax() {
        assert_eq!(argmax(&[f32::NAN, 1.0, 0.5]), 1);
        // The definition the vectorized passes keep: a scan where a larger value or a NaN best
        // hands over the place.
        let scan = |l: &[f32]| (0..l.len()).fold(0, |best, i| if l[i] > l[best] || l[best].is_nan() { i } else { best }) as u32;
        let long: Vec<f32> = (0..1000).map(|i| ((i * 7919) % 1009) as f32 - 500.0).collect();
        let mut spiked = long.clone();
        spiked[999] = 1e9;
        spiked[3] = f32::NAN;
        let (nan, inf) = (f32::NAN, f32::NEG_INFINITY);
        let cases: [&[f32]; 9] = [&[], &[nan], &[nan; 20], &[nan, inf], &[1.0, nan, 3.0, 3.0], &[inf; 17], &[-0.0, 0.0], &long, &spiked];
        for case in cases {
            assert_eq!(argmax(case), scan(case), "{case:?}");
        }
    }

    #[test]
    fn top_k_one_is_greedy() {
        let mut s = Sampler::new(SamplerParams { top_k: 1, temperature: 1.0, ..SamplerParams::default() });
        for _ in 0..20 {
            assert_eq!(s.sample(&mut logits(), &[]), 1);
        }
    }

    #[test]
    fn top_k_restricts_support() {
        let mut s = Sampler::new(SamplerParams { top_k: 2, temperature: 5.0, top_p: 1.0, min_p: 0.0, ..SamplerParams::default() });
        for _ in 0..200 {
            let t = s.sample(&mut logits(), &[]);
            assert!(t == 1 || t == 4, "token {t} outside the top 2");
        }
    }

    #[test]
    fn top_p_restricts_support() {
        // Softmax of [10, 9, 0, 0, 0]: the first two hold > 99.9% of the mass.
        let mut s = Sampler::new(SamplerParams { top_k: 0, top_p: 0.9, min_p: 0.0, temperature: 1.0, ..SamplerParams::default() });
        for _ in 0..200 {
            let t = s.sample(&mut [10.0, 9.0, 0.0, 0.0, 0.0], &[]);
            assert!(t <= 1);
        }
    }

    #[test]
    fn min_p_drops_unlikely_tokens() {
        let mut s = Sampler::new(SamplerParams { top_k: 0, top_p: 1.0, min_p: 0.5, temperature: 1.0, ..SamplerParams::default() });
        for _ in 0..200 {
            // p(1)/p(0) = e^-0.1 > 0.5, p(2)/p(0) = e^-5 < 0.5.
            let t = s.sample(&mut [5.0, 4.9, 0.0], &[]);
            assert!(t <= 1);
        }
    }

    #[test]
    fn same_seed_same_tokens_and_sampling_covers_distribution() {
        let params = SamplerParams { temperature: 1.0, top_k: 0, top_p: 1.0, min_p: 0.0, seed: 42, ..SamplerParams::default() };
        let draw = |p: &SamplerParams| {
            let mut s = Sampler::new(p.clone());
            (0..300).map(|_| s.sample(&mut logits(), &[])).collect::<Vec<_>>()
        };
        let a = draw(&params);
        assert_eq!(a, draw(&params));
        assert_ne!(a, draw(&SamplerParams { seed: 43, ..params.clone() }));
        // Every token with non-negligible probability shows up in 300 draws.
        for t in [0, 1, 2, 4] {
            assert!(a.contains(&t), "token {t} never sampled");
        }
        // Empirical frequency of the top token is near its probability (0.46).
        let freq = a.iter().filter(|&&t| t == 1).count() as f32 / a.len() as f32;
        assert!((freq - 0.46).abs() < 0.1, "top-token frequency {freq}");
    }

    #[test]
    fn nan_logits_are_never_drawn() {
        for top_k in [0, 2, 3] {
            for top_p in [1.0, 0.99] {
                let mut s = Sampler::new(SamplerParams { top_k, top_p, min_p: 0.0, temperature: 1.0, ..SamplerParams::default() });
                for _ in 0..100 {
                    let t = s.sample(&mut [f32::NAN, 1.0, f32::NAN, 0.5], &[]);
                    assert!(t == 1 || t == 3, "top-k {top_k}, top-p {top_p}: drew {t}");
                }
            }
        }
        let mut s = Sampler::new(SamplerParams { temperature: 1.0, ..SamplerParams::default() });
        assert_eq!(s.sample(&mut [f32::NAN, f32::NEG_INFINITY, f32::INFINITY], &[]), 2);
    }

    #[test]
    fn log_probs_normalise_and_rank() {
        let lp = LogProbs::new(&[1.0, 2.0, 3.0, f32::NAN]);
        let total: f32 = (0..4).map(|t| lp.of(t).exp()).sum();
        assert!((total - 1.0).abs() < 1e-6, "{total}");
        assert_eq!(lp.of(3), f32::NEG_INFINITY);
        assert_eq!(lp.of(9), f32::NEG_INFINITY);
        assert_eq!(lp.top(2).iter().map(|t| t.0).collect::<Vec<_>>(), vec![2, 1]);
        assert_eq!(lp.top(2)[0].1, lp.of(2));
        // Against an f64 reference on a vocabulary-sized row.
        let logits = random_logits(49_152, 5, true);
        let m = logits.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b)) as f64;
        let lse = m + logits.iter().map(|&l| (l as f64 - m).exp()).sum::<f64>().ln();
        let lp = LogProbs::new(&logits);
        for t in [0u32, 3, 1000, 49_151] {
            assert!((lp.of(t) as f64 - (logits[t as usize] as f64 - lse)).abs() < 1e-5, "token {t}");
        }
        assert!(LogProbs::new(&[f32::NAN; 3]).top(2).iter().all(|t| t.1 == f32::NEG_INFINITY));
    }

    /// Pseudo-random logits: `n` values, a few far above the rest when `peaked`, many ties.
    fn random_logits(n: usize, seed: u64, peaked: bool) -> Vec<f32> {
        let mut s = seed | 1;
        (0..n)
            .map(|i| {
                s ^= s << 13;
                s ^= s >> 7;
                s ^= s << 17;
                let base = (s >> 54) as f32 / 8.0; // 1 024 levels: ties
                if peaked && i % 997 == 3 { base + 30.0 } else { base }
            })
            .collect()
    }

    #[test]
    fn top_sorted_is_a_prefix_of_the_full_sort() {
        let mut xs = random_logits(5000, 7, false);
        xs[17] = f32::NEG_INFINITY;
        xs[4000] = f32::INFINITY;
        let mut all: Vec<(u32, f32)> = xs.iter().enumerate().map(|(i, &v)| (i as u32, v)).collect();
        all.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
        // Small k take the heap, large ones the select-and-sort.
        for k in [1, 2, 40, 64, 312, 313, 1000, 4999, 5000] {
            assert_eq!(top_sorted(&xs, k), all[..k], "k = {k}");
        }
    }

    /// The cut gives what sorting every token and cutting the sorted list gives.
    #[test]
    fn kept_candidates_match_a_full_sort() {
        let reference = |p: &SamplerParams, logits: &[f32]| {
            let mut cand: Vec<(u32, f32)> = logits.iter().enumerate().map(|(i, &l)| (i as u32, l)).collect();
            cand.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
            if p.top_k > 0 {
                cand.truncate(p.top_k);
            }
            let mut probs: Vec<f32> = cand.iter().map(|c| c.1).collect();
            activation::softmax_inplace(&mut probs);
            let mut keep = cand.len();
            let mut mass = 0.0;
            if let Some(i) = probs.iter().position(|&pr| {
                mass += pr;
                p.top_p < 1.0 && mass >= p.top_p
            }) {
                keep = i + 1;
            }
            let floor = probs[0] * p.min_p;
            keep = keep.min(probs.iter().take_while(|&&pr| pr >= floor).count().max(1));
            cand.truncate(keep);
            cand
        };
        for (seed, peaked) in [(1, true), (2, false), (3, true)] {
            let logits = random_logits(20_000, seed, peaked);
            for top_k in [0, 1, 40, 2000] {
                for top_p in [1.0, 0.95, 0.5] {
                    for min_p in [0.0, 0.05] {
                        let p = SamplerParams { top_k, top_p, min_p, ..SamplerParams::default() };
                        let (got, want) = (kept_candidates(&p, &logits), reference(&p, &logits));
                        assert_eq!(got, want, "seed {seed}, top-k {top_k}, top-p {top_p}, min-p {min_p}");
                    }
                }
            }
        }
    }

    #[test]
    fn repetition_penalty_discourages_seen_tokens() {
        let mut s = Sampler::new(SamplerParams { repeat_penalty: 2.0, ..SamplerParams::greedy() });
        // Token 1 (3.0) is penalised to 1.5, so token 4 (2.5) wins.
        assert_eq!(s.sample(&mut logits(), &[1]), 4);
    }

    #[test]
    fn validate_rejects_bad_values() {
        assert!(SamplerParams { temperature: -1.0, ..SamplerParams::default() }.validate().is_err());
        assert!(SamplerParams { top_p: 0.0, ..SamplerParams::default() }.validate().is_err());
        assert!(SamplerParams { min_p: 2.0, ..SamplerParams::default() }.validate().is_err());
        assert!(SamplerParams::default().validate().is_ok());
    }
}
