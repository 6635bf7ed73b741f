//! Reference quantizers: dequant(quant(x)) stays within each format's error bound.
//! (Bit-exact agreement with gguf-py's quantizers is checked in gguf_py.rs.)

use ferrite_gguf::{dequantize, quantize, GgmlType};
use proptest::prelude::*;

fn round_trip(dtype: GgmlType, x: &[f32]) -> Vec<f32> {
    let q = quantize(dtype, x).unwrap();
    assert_eq!(q.len(), dtype.row_bytes(x.len()).unwrap());
    let mut y = vec![f32::NAN; x.len()];
    dequantize(dtype, &q, &mut y).unwrap();
    y
}

/// Deterministic Gaussian samples (xorshift64 + Box-Muller).
fn gaussian(n: usize, seed: u64) -> Vec<f32> {
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let mut uniform = move || {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        ((s >> 11) as f64 + 0.5) / (1u64 << 53) as f64
    };
    (0..n)
        .map(|_| {
            ((-2.0 * uniform().ln()).sqrt() * (std::f64::consts::TAU * uniform()).cos()) as f32
        })
        .collect()
}

fn amax(x: &[f32]) -> f32 {
    x.iter().fold(0.0f32, |m, v| m.max(v.abs()))
}

/// Largest error each 32-weight format allows for one block, from its definition: the step
/// `d`, half a step of rounding (a full step where the top level is clamped), and the f16
/// rounding of the stored `d` (up to 2^-11 relative, times the largest quant) and min.
fn legacy_bound(dtype: GgmlType, block: &[f32]) -> f32 {
    let (min, max) = block.iter().fold((f32::MAX, f32::MIN), |(lo, hi), &v| (lo.min(v), hi.max(v)));
    let f16_eps = 2f32.powi(-11);
    match dtype {
        // d = max / -8 (or -16); the level opposite `max` is clamped, so up to one full step.
        GgmlType::Q4_0 => amax(block) / 8.0 * (1.0 + 8.0 * f16_eps) * 1.001,
        GgmlType::Q5_0 => amax(block) / 16.0 * (1.0 + 16.0 * f16_eps) * 1.001,
        GgmlType::Q4_1 => (max - min) / 15.0 * (0.5 + 15.0 * f16_eps) * 1.001 + min.abs() * f16_eps,
        GgmlType::Q5_1 => (max - min) / 31.0 * (0.5 + 31.0 * f16_eps) * 1.001 + min.abs() * f16_eps,
        GgmlType::Q8_0 | GgmlType::Q8_1 => amax(block) / 127.0 * (0.5 + 127.0 * f16_eps) * 1.001,
        other => unreachable!("{other} is not a 32-weight format"),
    }
}

/// Blocks of 32 values with magnitudes from 0.01 to 100 (f16 scales stay normal).
fn blocks() -> impl Strategy<Value = Vec<f32>> {
    prop::collection::vec((0.01f32..100.0, prop::collection::vec(-1.0f32..1.0, 32)), 1..5).prop_map(
        |blocks| {
            blocks
                .into_iter()
                .flat_map(|(scale, b)| b.into_iter().map(move |v| v * scale))
                .collect()
        },
    )
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(200))]

    #[test]
    fn legacy_formats_meet_their_error_bound(x in blocks()) {
        for dtype in [GgmlType::Q4_0, GgmlType::Q4_1, GgmlType::Q5_0, GgmlType::Q5_1, GgmlType::Q8_0, GgmlType::Q8_1] {
            let y = round_trip(dtype, &x);
            for (b, (xb, yb)) in x.chunks(32).zip(y.chunks(32)).enumerate() {
                let bound = legacy_bound(dtype, xb);
                for (i, (a, r)) in xb.iter().zip(yb).enumerate() {
                    prop_assert!((a - r).abs() <= bound, "{dtype} block {b} element {i}: {a} -> {r}, bound {bound}");
                }
            }
        }
    }

    #[test]
    fn float_formats_round_to_nearest(x in prop::collection::vec(-6e4f32..6e4, 1..64)) {
        prop_assert_eq!(round_trip(GgmlType::F32, &x), x.clone());
        for (dtype, eps) in [(GgmlType::F16, 2f32.powi(-11)), (GgmlType::BF16, 2f32.powi(-8))] {
            for (a, r) in x.iter().zip(round_trip(dtype, &x)) {
                // Relative error of a normal number, or the spacing of f16 subnormals.
                prop_assert!((a - r).abs() <= (a.abs() * eps).max(2f32.powi(-25)), "{dtype}: {a} -> {r}");
            }
        }
    }

    /// Any input, NaN and infinities included, quantizes and dequantizes without panicking.
    #[test]
    fn arbitrary_floats_do_not_panic(bits in prop::collection::vec(any::<u32>(), 256)) {
        let x: Vec<f32> = bits.into_iter().map(f32::from_bits).collect();
        for dtype in GgmlType::ALL {
            round_trip(dtype, &x);
        }
    }
}

/// k-quants: RMS error on N(0, σ²) data relative to σ, and worst error relative to the
/// super-block's largest magnitude. Limits sit ~10-20% above what the ggml reference algorithm
/// achieves (measured: Q2_K 0.298, Q3_K 0.152, Q4_K 0.072, Q5_K 0.036, Q6_K 0.018, Q8_K 0.007).
#[test]
fn k_quants_meet_error_bounds_on_gaussian_data() {
    let limits = [
        (GgmlType::Q2_K, 0.33, 0.5),
        (GgmlType::Q3_K, 0.17, 0.25),
        (GgmlType::Q4_K, 0.08, 0.125),
        (GgmlType::Q5_K, 0.04, 0.0625),
        (GgmlType::Q6_K, 0.02, 0.03125),
        (GgmlType::Q8_K, 0.008, 0.51 / 127.0),
    ];
    for sigma in [0.01f32, 1.0, 100.0] {
        let x: Vec<f32> = gaussian(256 * 64, 7).iter().map(|v| v * sigma).collect();
        let mut previous_rms = f64::INFINITY;
        for (dtype, rms_limit, worst_limit) in limits {
            let y = round_trip(dtype, &x);
            let sq: f64 = x.iter().zip(&y).map(|(a, b)| f64::from(a - b).powi(2)).sum();
            let rms = (sq / x.len() as f64).sqrt() / f64::from(sigma);
            assert!(
                rms < rms_limit,
                "{dtype} σ={sigma}: relative RMS error {rms:.4} ≥ {rms_limit}"
            );
            assert!(rms < previous_rms, "{dtype}: more bits must mean less error");
            previous_rms = rms;
            for (xb, yb) in x.chunks(256).zip(y.chunks(256)) {
                let worst =
                    xb.iter().zip(yb).map(|(a, b)| (a - b).abs()).fold(0.0, f32::max) / amax(xb);
                assert!(
                    worst <= worst_limit,
                    "{dtype} σ={sigma}: worst error {worst} of the block max"
                );
            }
        }
    }
}

#[test]
fn zeros_and_constants_are_exact() {
    for dtype in GgmlType::ALL {
        let n = dtype.block_size() * 2;
        assert!(round_trip(dtype, &vec![0.0; n]).iter().all(|&v| v == 0.0), "{dtype}: zeros");
    }
    // A block of one repeated value is exact when the resulting scale (and min) are exact in
    // f16: the value sits at the top level, d = value / top.
    let cases = [
        (GgmlType::Q4_0, -1.0),
        (GgmlType::Q5_0, -1.0),
        (GgmlType::Q8_0, 127.0 / 128.0),
        (GgmlType::Q8_1, 127.0 / 128.0),
        (GgmlType::Q8_K, 127.0 / 128.0),
        (GgmlType::Q4_1, 0.5),
        (GgmlType::Q5_1, 0.5),
    ];
    for (dtype, value) in cases {
        let y = round_trip(dtype, &vec![value; dtype.block_size()]);
        assert!(y.iter().all(|&v| v == value), "{dtype}: {:?}", &y[..4]);
    }
}
