//! Mixture-of-experts routing: which experts a token goes to, and with what weight.
//!
//! As transformers' Qwen3.5-MoE router (and llama.cpp's softmax gating): a softmax over all
//! experts' logits in f32, the `top_k` most probable experts, and — with `norm_topk_prob` —
//! their probabilities divided by their sum.

/// Route one token. `logits` holds one router logit per expert; `experts` and `weights`
/// (`top_k` long each) receive the chosen experts, most probable first, and their weights.
/// Ties go to the lower expert index: `torch.topk` leaves the order of equal values
/// unspecified; this is what a stable descending sort gives. Exact ties in f32 router
/// probabilities are rare in real models.
/// Panics if `top_k` is 0 or exceeds the number of experts, or the output lengths differ.
pub fn route(logits: &[f32], norm_topk_prob: bool, experts: &mut [usize], weights: &mut [f32]) {
    let (n, k) = (logits.len(), experts.len());
    assert!(k >= 1 && k <= n && weights.len() == k, "route: top {k} of {n} experts into {} weights", weights.len());
    // Softmax in f32 with the maximum subtracted (what torch.softmax computes).
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let mut sum = 0f32;
    let probs: Vec<f32> = logits
        .iter()
        .map(|&l| {
            let p = (l - max).exp();
            sum += p;
            p
        })
        .collect();
    // Partial selection: k passes over the experts, each taking the largest not yet taken
    // (strictly greater wins, so the lower index keeps a tie). k is small (8 of 256 for the
    // 35B-A3B model), so this beats sorting.
    for j in 0..k {
        let mut best = usize::MAX;
        for (e, &p) in probs.iter().enumerate() {
            if experts[..j].contains(&e) {
                continue;
            }
            if best == usize::MAX || p > probs[best] {
                best = e;
            }
        }
        experts[j] = best;
        weights[j] = probs[best] / sum;
    }
    if norm_topk_prob {
        let total: f32 = weights.iter().sum();
        weights.iter_mut().for_each(|w| *w /= total);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn routed(logits: &[f32], k: usize, norm: bool) -> (Vec<usize>, Vec<f32>) {
        let (mut e, mut w) = (vec![0; k], vec![0.0; k]);
        route(logits, norm, &mut e, &mut w);
        (e, w)
    }

    fn softmax(l: &[f32]) -> Vec<f64> {
        let m = l.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
        let e: Vec<f64> = l.iter().map(|&v| (v as f64 - m).exp()).collect();
        let s: f64 = e.iter().sum();
        e.iter().map(|v| v / s).collect()
    }

    #[test]
    fn top_k_picks_the_most_probable_in_order() {
        let logits = [0.1, 2.0, -1.0, 1.5, 0.7, 3.0];
        let (e, w) = routed(&logits, 3, false);
        assert_eq!(e, [5, 1, 3]);
        let p = softmax(&logits);
        for (j, &ex) in e.iter().enumerate() {
            assert!((w[j] as f64 - p[ex]).abs() < 1e-6, "{j}: {} vs {}", w[j], p[ex]);
        }
        // Without renormalisation the weights are the plain probabilities: they sum below 1.
        assert!(w.iter().sum::<f32>() < 0.99);
    }

    #[test]
    fn renormalised_weights_sum_to_one_and_keep_their_ratios() {
        let logits = [0.3, -0.2, 1.1, 0.9, -2.0, 0.0, 0.5, 0.25];
        let (e, w) = routed(&logits, 2, true);
        assert_eq!(e, [2, 3]);
        assert!((w.iter().sum::<f32>() - 1.0).abs() < 1e-6);
        let p = softmax(&logits);
        let want = p[2] / (p[2] + p[3]);
        assert!((w[0] as f64 - want).abs() < 1e-6);
        // k = all experts with renormalisation: the full softmax.
        let (e, w) = routed(&logits, 8, true);
        let mut sorted = e.clone();
        sorted.sort();
        assert_eq!(sorted, (0..8).collect::<Vec<_>>());
        for (j, &ex) in e.iter().enumerate() {
            assert!((w[j] as f64 - p[ex]).abs() < 1e-6);
        }
        // k = 1 with renormalisation: weight exactly 1.
        let (e, w) = routed(&logits, 1, true);
        assert_eq!((e[0], w[0]), (2, 1.0));
    }

    #[test]
    fn ties_go_to_the_lower_index() {
        let (e, w) = routed(&[1.0, 2.0, 2.0, 0.0, 2.0], 2, true);
        assert_eq!(e, [1, 2]);
        assert_eq!(w, [0.5, 0.5]);
        let (e, _) = routed(&[0.5; 6], 4, false);
        assert_eq!(e, [0, 1, 2, 3]);
        let (e, _) = routed(&[-1.0, 3.0, -1.0, -1.0], 3, false);
        assert_eq!(e, [1, 0, 2]);
    }

    #[test]
    fn large_logits_do_not_overflow() {
        let (e, w) = routed(&[1000.0, 999.0, -1000.0, 998.0], 2, true);
        assert_eq!(e, [0, 1]);
        assert!(w.iter().all(|v| v.is_finite()));
        let want = 1.0 / (1.0 + (-1f64).exp());
        assert!((w[0] as f64 - want).abs() < 1e-6);
    }

    #[test]
    #[should_panic(expected = "top 3 of 2 experts")]
    fn more_experts_than_exist_panics() {
        routed(&[0.0, 1.0], 3, true);
    }
}
