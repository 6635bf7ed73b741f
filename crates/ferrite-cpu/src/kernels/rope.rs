//! Rotary position embedding.

/// Which dimensions form the rotated pairs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RopeStyle {
    /// Adjacent pairs `(2i, 2i + 1)` (GGML "norm", llama-family GGUF).
    Normal,
    /// Pairs `(i, i + rot_dim / 2)` (GPT-NeoX, Qwen, Gemma).
    Neox,
}

/// RoPE parameters: the first `rot_dim` (even, `<= head_dim`) dimensions of each head rotate,
/// pair `i` by `freq_scale * pos * theta^(-2i / rot_dim)`; the rest pass through.
#[derive(Clone, Copy, Debug)]
pub struct Rope {
    pub style: RopeStyle,
    pub head_dim: usize,
    pub rot_dim: usize,
    pub theta: f32,
    pub freq_scale: f32,
}

impl Rope {
    /// Rotates `x`, `positions.len()` rows of `n_heads * head_dim`, row `t` at `positions[t]`.
    ///
    /// Angles are computed in f32 exactly as GGML does (`pos * s^i` by repeated multiplication
    /// with `s = theta^(-2 / rot_dim)`), once per row and shared by its heads.
    /// Panics on inconsistent sizes.
    pub fn apply(&self, x: &mut [f32], n_heads: usize, positions: &[u32]) {
        let (hd, rot) = (self.head_dim, self.rot_dim);
        assert!(
            rot % 2 == 0 && rot <= hd,
            "rope: rot_dim {rot} must be even and at most head_dim {hd}"
        );
        let width = n_heads * hd;
        assert_eq!(
            x.len(),
            positions.len() * width,
            "rope: {} values for {} rows of {n_heads} heads x {hd}",
            x.len(),
            positions.len()
        );
        if width == 0 || rot == 0 {
            return;
        }
        let half = rot / 2;
        let theta_scale = self.theta.powf(-2.0 / rot as f32);
        let mut cos_sin = vec![(0f32, 0f32); half];
        for (row, &pos) in x.chunks_exact_mut(width).zip(positions) {
            let mut theta = pos as f32;
            for cs in cos_sin.iter_mut() {
                let angle = self.freq_scale * theta;
                *cs = (angle.cos(), angle.sin());
                theta *= theta_scale;
            }
            for head in row.chunks_exact_mut(hd) {
                for (i, &(c, s)) in cos_sin.iter().enumerate() {
                    let (a, b) = match self.style {
                        RopeStyle::Normal => (2 * i, 2 * i + 1),
                        RopeStyle::Neox => (i, i + half),
                    };
                    let (x0, x1) = (head[a], head[b]);
                    head[a] = x0 * c - x1 * s;
                    head[b] = x0 * s + x1 * c;
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Straightforward f64 rotation by `freq_scale * pos * theta^(-2i/rot)`, and for each value
    /// the error the f32 algorithm may make: each of the `i + 2` roundings in the angle
    /// (`powf`, `i` products, the `freq_scale` product) is at most 2^-24 relative, and an angle error
    /// `e` moves a rotated value by at most `e * (|x0| + |x1|)`; plus a few ulp for the rotation.
    fn reference(r: &Rope, x: &[f32], n_heads: usize, positions: &[u32]) -> (Vec<f64>, Vec<f64>) {
        let mut y: Vec<f64> = x.iter().map(|&v| v as f64).collect();
        let mut tol = vec![0f64; x.len()];
        let half = r.rot_dim / 2;
        let eps = f32::EPSILON as f64 / 2.0;
        for (t, &p) in positions.iter().enumerate() {
            for h in 0..n_heads {
                let at = (t * n_heads + h) * r.head_dim;
                for i in 0..half {
                    let angle = r.freq_scale as f64
                        * p as f64
                        * (r.theta as f64).powf(-2.0 * i as f64 / r.rot_dim as f64);
                    let (a, b) = match r.style {
                        RopeStyle::Normal => (at + 2 * i, at + 2 * i + 1),
                        RopeStyle::Neox => (at + i, at + i + half),
                    };
                    let (x0, x1) = (y[a], y[b]);
                    y[a] = x0 * angle.cos() - x1 * angle.sin();
                    y[b] = x0 * angle.sin() + x1 * angle.cos();
                    // powf itself may be off by an ulp or two: count it twice per power.
                    let angle_err = angle.abs() * eps * (3 * i + 3) as f64;
                    let e = (angle_err + 4.0 * eps) * (x0.abs() + x1.abs());
                    (tol[a], tol[b]) = (e, e);
                }
            }
        }
        (y, tol)
    }

    #[test]
    fn matches_f64_rotation() {
        let n_heads = 3;
        let positions = [0u32, 1, 7, 100, 2047];
        for style in [RopeStyle::Normal, RopeStyle::Neox] {
            for (head_dim, rot_dim, freq_scale) in
                [(64, 64, 1.0), (64, 32, 1.0), (80, 20, 0.25), (8, 0, 1.0)]
            {
                let r = Rope {
                    style,
                    head_dim,
                    rot_dim,
                    theta: 10000.0,
                    freq_scale,
                };
                let x: Vec<f32> = (0..positions.len() * n_heads * head_dim)
                    .map(|i| ((i * 13 % 29) as f32 - 14.0) * 0.1)
                    .collect();
                let mut y = x.clone();
                r.apply(&mut y, n_heads, &positions);
                let (want, tol) = reference(&r, &x, n_heads, &positions);
                for (i, ((got, want), tol)) in y.iter().zip(&want).zip(&tol).enumerate() {
                    assert!(
                        (*got as f64 - want).abs() <= *tol,
                        "{style:?} {head_dim}/{rot_dim} at {i}: {got} vs {want}"
                    );
                }
                // Dimensions past rot_dim are untouched.
                for (i, (a, b)) in x.iter().zip(&y).enumerate() {
                    if i % head_dim >= rot_dim {
                        assert_eq!(a, b);
                    }
                }
            }
        }
    }

    #[test]
    fn rotation_preserves_pair_norms() {
        let r = Rope {
            style: RopeStyle::Normal,
            head_dim: 4,
            rot_dim: 4,
            theta: 500.0,
            freq_scale: 1.0,
        };
        let mut x = vec![3.0, 4.0, 1.0, 0.0];
        r.apply(&mut x, 1, &[5]);
        assert!(((x[0] * x[0] + x[1] * x[1]).sqrt() - 5.0).abs() < 1e-5);
        assert!(((x[2] * x[2] + x[3] * x[3]).sqrt() - 1.0).abs() < 1e-6);
        assert!((x[0] - (3.0 * 5f32.cos() - 4.0 * 5f32.sin())).abs() < 1e-5);
    }
}
