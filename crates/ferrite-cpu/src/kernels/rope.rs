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
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Rope {
    pub style: RopeStyle,
    pub head_dim: usize,
    pub rot_dim: usize,
    pub theta: f32,
    pub freq_scale: f32,
}

/// The `(cos, sin)` of every rotated pair's angle at some positions, `rot_dim / 2` per position:
/// what [`Rope::apply_table`] rotates by. A step's positions are the same in every layer, so an
/// executor computes them once per step instead of once per layer (their sines and cosines were
/// ~2% of a batched decode step, on the thread the others wait for).
#[derive(Clone, Debug, Default)]
pub struct RopeTable {
    cos_sin: Vec<(f32, f32)>,
}

impl Rope {
    fn check(&self) {
        let (hd, rot) = (self.head_dim, self.rot_dim);
        assert!(rot % 2 == 0 && rot <= hd, "rope: rot_dim {rot} must be even and at most head_dim {hd}");
    }

    /// The angles of `positions`, in their order, computed in f32 exactly as GGML does
    /// (`pos * s^i` by repeated multiplication with `s = theta^(-2 / rot_dim)`).
    pub fn table(&self, positions: &[u32]) -> RopeTable {
        self.check();
        let half = self.rot_dim / 2;
        let theta_scale = self.theta.powf(-2.0 / self.rot_dim as f32);
        let mut cos_sin = Vec::with_capacity(positions.len() * half);
        for &pos in positions {
            let mut theta = pos as f32;
            for _ in 0..half {
                let angle = self.freq_scale * theta;
                cos_sin.push((angle.cos(), angle.sin()));
                theta *= theta_scale;
            }
        }
        RopeTable { cos_sin }
    }

    /// Rotates `x` (rows of `n_heads` heads) at `positions`.
    pub fn apply(&self, x: &mut [f32], n_heads: usize, positions: &[u32]) {
        let width = n_heads * self.head_dim;
        assert_eq!(x.len(), positions.len() * width, "rope: {} values for {} rows of {n_heads} heads x {}", x.len(), positions.len(), self.head_dim);
        self.apply_table(x, n_heads, &self.table(positions), 0);
    }

    /// Rotates `x` (rows of `n_heads` heads) by the angles of `table`'s positions `first ..`, one
    /// per row: the same arithmetic as [`Rope::apply`] at those positions.
    pub fn apply_table(&self, x: &mut [f32], n_heads: usize, table: &RopeTable, first: usize) {
        let hd = self.head_dim;
        self.for_each_head(x.len(), n_heads, table, first, |at, cos_sin| self.rotate(&mut x[at..at + hd], cos_sin));
    }

    /// [`Rope::apply_table`] of `src` into `dst` (as long), `src` left as it was: what the
    /// attention op needs of its `q | k | v` rows, written straight into its Q and K buffers.
    pub fn apply_table_to(&self, src: &[f32], dst: &mut [f32], n_heads: usize, table: &RopeTable, first: usize) {
        assert_eq!(src.len(), dst.len(), "rope: source and destination lengths differ");
        dst.copy_from_slice(src);
        self.apply_table(dst, n_heads, table, first);
    }

    /// `f(offset of a head, its row's angles)` for every head of `len` values in rows of `n_heads`.
    fn for_each_head(&self, len: usize, n_heads: usize, table: &RopeTable, first: usize, mut f: impl FnMut(usize, &[(f32, f32)])) {
        self.check();
        let (hd, half) = (self.head_dim, self.rot_dim / 2);
        let width = n_heads * hd;
        let rows = len.checked_div(width).unwrap_or(0);
        assert!(
            rows * width == len && (first + rows) * half <= table.cos_sin.len(),
            "rope: {len} values for rows of {n_heads} heads x {hd} from table row {first} of {}",
            table.cos_sin.len() / half.max(1)
        );
        for t in 0..rows {
            let cos_sin = &table.cos_sin[(first + t) * half..][..half];
            for h in 0..n_heads {
                f(t * width + h * hd, cos_sin);
            }
        }
    }

    /// One head in place: its first `rot_dim` values rotated in pairs, the rest as they are.
    fn rotate(&self, head: &mut [f32], cos_sin: &[(f32, f32)]) {
        let half = cos_sin.len();
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
    fn out_of_place_rotation_is_the_in_place_one() {
        for style in [RopeStyle::Normal, RopeStyle::Neox] {
            for (head_dim, rot_dim) in [(64, 64), (80, 20), (8, 0)] {
                let r = Rope { style, head_dim, rot_dim, theta: 10000.0, freq_scale: 1.0 };
                let positions = [3u32, 0, 900];
                let table = r.table(&positions);
                let src: Vec<f32> = (0..positions.len() * 2 * head_dim).map(|i| ((i * 7 % 23) as f32 - 11.0) * 0.1).collect();
                let mut want = src.clone();
                r.apply(&mut want, 2, &positions);
                let mut got = vec![f32::NAN; src.len()];
                r.apply_table_to(&src, &mut got, 2, &table, 0);
                assert_eq!(got, want, "{style:?} {head_dim}/{rot_dim}");
                // From a later row of the table: the positions after the first.
                let mut tail = vec![f32::NAN; 4 * head_dim];
                r.apply_table_to(&src[2 * head_dim..], &mut tail, 2, &table, 1);
                assert_eq!(tail, want[2 * head_dim..], "{style:?} {head_dim}/{rot_dim} from row 1");
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
