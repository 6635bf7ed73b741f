//! Elementwise activations, softmax and residual adds.

use super::attention::tanh;
use super::fvec;

fn check_lengths(op: &str, a: usize, b: usize, out: usize) {
    assert!(
        a == b && b == out,
        "{op}: lengths differ (gate {a}, up {b}, out {out})"
    );
}

fvec::multiversion! {
    /// `out = silu(gate) * up`, `silu(g) = g / (1 + e^-g)`. Panics if the lengths differ.
    pub fn swiglu(gate: &[f32], up: &[f32], out: &mut [f32]) {
        check_lengths("swiglu", gate.len(), up.len(), out.len());
        for ((o, &g), &u) in out.iter_mut().zip(gate).zip(up) {
            *o = g / (1.0 + fvec::exp(-g)) * u;
        }
    }
}

fvec::multiversion! {
    /// `out = gelu(gate) * up` with the tanh approximation of GELU (as Gemma uses):
    /// `gelu(g) = g/2 * (1 + tanh(sqrt(2/pi) * (g + 0.044715 g^3)))`. Panics if the lengths differ.
    pub fn geglu_tanh(gate: &[f32], up: &[f32], out: &mut [f32]) {
        check_lengths("geglu_tanh", gate.len(), up.len(), out.len());
        const SQRT_2_OVER_PI: f32 = 0.797_884_6;
        for ((o, &g), &u) in out.iter_mut().zip(gate).zip(up) {
            let inner = SQRT_2_OVER_PI * (g + 0.044_715 * g * g * g);
            *o = 0.5 * g * (1.0 + tanh(inner)) * u;
        }
    }
}

fvec::multiversion! {
    /// `x -> exp((x - shift) * scale)` in place; returns the sum: softmax numerators, at a
    /// temperature of `1 / scale` (the sampler's), with `shift` the maximum.
    pub fn exp_shifted(x: &mut [f32], shift: f32, scale: f32) -> f32 {
        // Separate loops: the exponentials vectorize, the lane-wise sum too. 16 at a time, the
        // last few padded to 16: the compiler's own loop left up to 63 values to its scalar
        // remainder, a third of the exponentials of a decode attention row of 24-100 keys.
        let exp = |v: &mut f32| *v = fvec::exp((*v - shift) * scale);
        let mut chunks = x.chunks_exact_mut(16);
        for c in &mut chunks {
            c.iter_mut().for_each(exp);
        }
        let tail = chunks.into_remainder();
        if !tail.is_empty() {
            let mut padded = [shift; 16];
            padded[..tail.len()].copy_from_slice(tail);
            padded.iter_mut().for_each(exp);
            tail.copy_from_slice(&padded[..tail.len()]);
        }
        fvec::sum(x)
    }
}

/// `x -> exp(x - max)` in place; returns the sum.
pub(crate) fn softmax_unnormalized(x: &mut [f32]) -> f32 {
    exp_shifted(x, fvec::max(x), 1.0)
}

/// Softmax in place, with the maximum subtracted first.
pub fn softmax_inplace(x: &mut [f32]) {
    let inv = 1.0 / softmax_unnormalized(x);
    x.iter_mut().for_each(|v| *v *= inv);
}

/// `acc += x`. Panics if the lengths differ.
pub fn add_inplace(acc: &mut [f32], x: &[f32]) {
    assert_eq!(acc.len(), x.len(), "add_inplace: lengths differ");
    for (a, &b) in acc.iter_mut().zip(x) {
        *a += b;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn inputs() -> Vec<f32> {
        let mut v: Vec<f32> = (0..2001).map(|i| (i as f32 - 1000.0) * 0.013).collect();
        v.extend([-100.0, -30.0, 30.0, 100.0, 0.0, -0.0, 1e-7]);
        v
    }

    #[test]
    fn swiglu_and_geglu_match_f64() {
        let g = inputs();
        let u: Vec<f32> = g
            .iter()
            .enumerate()
            .map(|(i, _)| 1.0 + (i % 5) as f32 * 0.5)
            .collect();
        let mut out = vec![0.0; g.len()];
        swiglu(&g, &u, &mut out);
        for ((&o, &g), &u) in out.iter().zip(&g).zip(&u) {
            let want = g as f64 / (1.0 + (-g as f64).exp()) * u as f64;
            assert!(
                (o as f64 - want).abs() <= 1e-6 * want.abs() + 1e-30,
                "swiglu({g}) = {o}, want {want}"
            );
        }
        geglu_tanh(&g, &u, &mut out);
        for ((&o, &g), &u) in out.iter().zip(&g).zip(&u) {
            let gd = g as f64;
            let want = 0.5
                * gd
                * (1.0
                    + ((2.0 / std::f64::consts::PI).sqrt() * (gd + 0.044715 * gd.powi(3))).tanh())
                * u as f64;
            // tanh via 1 - 2/(e^2x + 1) loses relative precision near 0, absolutely ~1e-7.
            assert!(
                (o as f64 - want).abs() <= 2e-6 * want.abs() + 2e-7 * (gd * u as f64).abs(),
                "geglu({g}) = {o}, want {want}"
            );
        }
    }

    #[test]
    fn softmax_matches_f64_and_survives_large_inputs() {
        let mut x: Vec<f32> = (0..300)
            .map(|i| ((i * 37 % 101) as f32 - 50.0) * 0.4 + 1000.0)
            .collect();
        let m = x
            .iter()
            .cloned()
            .fold(f64::NEG_INFINITY, |a, b| a.max(b as f64));
        let e: Vec<f64> = x.iter().map(|&v| (v as f64 - m).exp()).collect();
        let z: f64 = e.iter().sum();
        softmax_inplace(&mut x);
        for (got, want) in x.iter().zip(e.iter().map(|v| v / z)) {
            assert!(
                (*got as f64 - want).abs() <= 1e-6 * want + 1e-12,
                "{got} vs {want}"
            );
        }
        let mut one = [f32::NEG_INFINITY, 3.0, f32::NEG_INFINITY];
        softmax_inplace(&mut one);
        assert_eq!(one, [0.0, 1.0, 0.0]);
    }

    #[test]
    fn add_inplace_adds() {
        let mut a = vec![1.0, 2.0, 3.0];
        add_inplace(&mut a, &[0.5, -2.0, 1e10]);
        assert_eq!(a, vec![1.5, 0.0, 3.0 + 1e10]);
    }
}
