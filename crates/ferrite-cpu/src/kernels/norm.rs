//! RMSNorm.

/// `out = x / sqrt(mean(x^2) + eps) * weight`, row by row: `x` holds rows of `weight.len()`
/// values. The sum of squares is accumulated in f64, as ggml does.
/// Panics if `x` is not whole rows or `out` differs in length.
pub fn rms_norm(x: &[f32], weight: &[f32], eps: f32, out: &mut [f32]) {
    rms_norm_offset(x, weight, 0.0, eps, out);
}

/// Gemma's variant, whose stored weights are offsets from one: `out = x / rms(x) * (1 + weight)`.
pub fn rms_norm_plus_one(x: &[f32], weight: &[f32], eps: f32, out: &mut [f32]) {
    rms_norm_offset(x, weight, 1.0, eps, out);
}

fn rms_norm_offset(x: &[f32], weight: &[f32], offset: f32, eps: f32, out: &mut [f32]) {
    let n = weight.len();
    assert!(
        n > 0 && x.len().is_multiple_of(n),
        "rms_norm: {} values are not whole rows of {n}",
        x.len()
    );
    assert_eq!(
        out.len(),
        x.len(),
        "rms_norm: output length differs from the input's"
    );
    super::for_each_row(out, n, |t, out| {
        let x = &x[t * n..(t + 1) * n];
        let mut lanes = [0f64; 4];
        let chunks = x.chunks_exact(4);
        let tail: f64 = chunks
            .remainder()
            .iter()
            .map(|&v| v as f64 * v as f64)
            .sum();
        for c in chunks {
            for i in 0..4 {
                lanes[i] += c[i] as f64 * c[i] as f64;
            }
        }
        let mean = ((lanes.iter().sum::<f64>() + tail) / n as f64) as f32;
        let scale = 1.0 / (mean + eps).sqrt();
        for ((o, &v), &w) in out.iter_mut().zip(x).zip(weight) {
            *o = v * scale * (w + offset);
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    fn reference(x: &[f32], w: &[f32], offset: f64, eps: f32) -> Vec<f64> {
        let n = w.len();
        x.chunks(n)
            .flat_map(|row| {
                let ms = row.iter().map(|&v| v as f64 * v as f64).sum::<f64>() / n as f64;
                let s = 1.0 / (ms + eps as f64).sqrt();
                row.iter()
                    .zip(w)
                    .map(move |(&v, &w)| v as f64 * s * (w as f64 + offset))
            })
            .collect()
    }

    #[test]
    fn matches_f64_reference() {
        for n in [1, 5, 64, 576, 1001] {
            let rows = 3;
            let x: Vec<f32> = (0..n * rows)
                .map(|i| ((i * 31 % 97) as f32 - 48.0) * 0.05)
                .collect();
            let w: Vec<f32> = (0..n).map(|i| 0.5 + (i % 7) as f32 * 0.1).collect();
            let mut out = vec![0.0; x.len()];
            for (offset, f) in [
                (0.0, rms_norm as fn(&[f32], &[f32], f32, &mut [f32])),
                (1.0, rms_norm_plus_one),
            ] {
                f(&x, &w, 1e-5, &mut out);
                for (got, want) in out.iter().zip(reference(&x, &w, offset, 1e-5)) {
                    assert!(
                        (*got as f64 - want).abs() <= 1e-6 * want.abs().max(1e-3),
                        "n={n}: {got} vs {want}"
                    );
                }
            }
        }
    }

    /// A prompt's rows (normalised on the pool) get the bits each row gets alone.
    #[test]
    fn many_rows_normalise_as_each_alone() {
        let (n, rows) = (64, 3 * crate::kernels::PAR_MIN_ROWS);
        let x: Vec<f32> = (0..n * rows).map(|i| ((i * 37 % 101) as f32 - 50.0) * 0.013).collect();
        let w: Vec<f32> = (0..n).map(|i| 0.5 + i as f32 / n as f32).collect();
        let mut all = vec![0.0; n * rows];
        rms_norm(&x, &w, 1e-6, &mut all);
        for (row, got) in x.chunks(n).zip(all.chunks(n)) {
            let mut one = vec![0.0; n];
            rms_norm(row, &w, 1e-6, &mut one);
            assert_eq!(got, &one[..]);
        }
    }

    #[test]
    fn zero_row_stays_zero() {
        let mut out = vec![1.0; 8];
        rms_norm(&[0.0; 8], &[1.0; 8], 1e-6, &mut out);
        assert!(out.iter().all(|&v| v == 0.0));
    }
}
