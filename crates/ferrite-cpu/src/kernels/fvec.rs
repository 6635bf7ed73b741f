//! f32 vector helpers shared by the kernels: lane-wise sums and maxima, and a vectorizable `exp`.

/// Defines `fn $name` (optionally with one const generic) whose body is compiled three times,
/// portable, for AVX2 + FMA and for AVX-512, the widest one the SIMD level has taken. For
/// elementwise loops the compiler vectorizes; each element's arithmetic is the same in every
/// build (no implicit FMA contraction), and the lane-wise sums keep their order, so the results
/// are too.
macro_rules! multiversion {
    ($(#[$m:meta])* $vis:vis fn $name:ident $(<const $c:ident: $cty:ty>)? ($($arg:ident: $ty:ty),* $(,)?) $(-> $ret:ty)? $body:block) => {
        $(#[$m])*
        $vis fn $name $(<const $c: $cty>)? ($($arg: $ty),*) $(-> $ret)? {
            #[inline(always)]
            fn body $(<const $c: $cty>)? ($($arg: $ty),*) $(-> $ret)? $body
            #[cfg(target_arch = "x86_64")]
            {
                #[target_feature(enable = "avx2,fma")]
                unsafe fn avx2 $(<const $c: $cty>)? ($($arg: $ty),*) $(-> $ret)? {
                    body $(::<$c>)? ($($arg),*)
                }
                #[target_feature(enable = "avx2,fma,avx512f,avx512bw,avx512vl")]
                unsafe fn avx512 $(<const $c: $cty>)? ($($arg: $ty),*) $(-> $ret)? {
                    body $(::<$c>)? ($($arg),*)
                }
                use $crate::kernels::simd::{simd_level, SimdLevel};
                match simd_level() {
                    // SAFETY: these levels are only reported when their features are available.
                    SimdLevel::Avx512Vnni => return unsafe { avx512 $(::<$c>)? ($($arg),*) },
                    SimdLevel::Avx2 => return unsafe { avx2 $(::<$c>)? ($($arg),*) },
                    _ => {}
                }
            }
            body $(::<$c>)? ($($arg),*)
        }
    };
}
pub(crate) use multiversion;

/// Partial sums (and maxima) per lane: the loops vectorize, in a fixed order.
const LANES: usize = 8;

/// `Σ x[i]` with lane-wise partial sums (vectorizes; order fixed).
#[inline(always)]
pub(crate) fn sum(x: &[f32]) -> f32 {
    let chunks = x.chunks_exact(LANES);
    let tail: f32 = chunks.remainder().iter().sum();
    let mut lanes = [0f32; LANES];
    for c in chunks {
        for i in 0..LANES {
            lanes[i] += c[i];
        }
    }
    lanes.iter().sum::<f32>() + tail
}

multiversion! {
    /// `max x[i]` (NaNs ignored, `-inf` when empty) with lane-wise partial maxima: a serial fold
    /// of `f32::max` does not vectorize, and inlined into a caller without AVX it took 4-wide SSE
    /// with NaN masks (a fifth of attention's own time deep in a context).
    pub(crate) fn max(x: &[f32]) -> f32 {
        const WIDE: usize = 16;
        let chunks = x.chunks_exact(WIDE);
        let tail = chunks.remainder().iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v));
        let mut lanes = [f32::NEG_INFINITY; WIDE];
        for c in chunks {
            for i in 0..WIDE {
                lanes[i] = lanes[i].max(c[i]);
            }
        }
        lanes.iter().fold(tail, |m, &v| m.max(v))
    }
}

/// Round to nearest, ties to even, for |v| < 2^22. The magic-number form vectorizes on every
/// x86-64, unlike `f32::round` (which needs SSE4.1).
#[inline(always)]
pub(crate) fn round_i32(v: f32) -> i32 {
    // Adding 1.5 * 2^23 leaves the rounded integer in the low mantissa bits.
    const MAGIC: f32 = 12_582_912.0;
    ((v + MAGIC).to_bits() as i32).wrapping_sub(MAGIC.to_bits() as i32)
}

/// `e^x` to within 2 ulp, branch-free so that loops over it vectorize. Overflows to +inf above
/// ln(f32::MAX), flushes to 0 below the smallest normal; NaN stays NaN.
#[inline(always)]
pub(crate) fn exp(x: f32) -> f32 {
    // ln 2 split so that n * LN2_HI is exact for |n| < 2^8 (Cody–Waite reduction).
    const LN2_HI: f32 = 0.693_145_75;
    const LN2_LO: f32 = 1.428_606_8e-6;
    const MAX: f32 = 88.722_83;
    const MIN: f32 = -87.336_54;
    let xc = x.clamp(MIN, MAX);
    let n = round_i32(xc * std::f32::consts::LOG2_E);
    let nf = n as f32;
    let r = (xc - nf * LN2_HI) - nf * LN2_LO;
    // Minimax polynomial of e^r on |r| <= ln2 / 2 (Cephes expf).
    let mut p = 1.987_569_1e-4f32;
    p = p * r + 1.398_199_9e-3;
    p = p * r + 8.333_452e-3;
    p = p * r + 4.166_579_6e-2;
    p = p * r + 1.666_666_5e-1;
    p = p * r + 0.5;
    let er = p * r * r + r + 1.0;
    // n reaches 128, beyond the largest f32 exponent: apply 2^n as two factors.
    let pow2 = |k: i32| f32::from_bits(((k + 127) as u32) << 23);
    let y = er * pow2(n >> 1) * pow2(n - (n >> 1));
    if x > MAX {
        f32::INFINITY
    } else if x < MIN {
        0.0
    } else {
        y
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_i32_is_nearest_even() {
        for (v, r) in [
            (0.5, 0),
            (1.5, 2),
            (-2.5, -2),
            (126.6, 127),
            (-127.4, -127),
            (3.49, 3),
            (-0.2, 0),
        ] {
            assert_eq!(round_i32(v), r, "{v}");
        }
    }

    #[test]
    fn exp_matches_f64_within_two_ulp() {
        let mut x = -87.3f32;
        while x < 88.7 {
            let want = (x as f64).exp();
            let got = exp(x) as f64;
            assert!(
                ((got - want) / want).abs() < 2.5e-7,
                "exp({x}) = {got}, want {want}"
            );
            x += 0.0137;
        }
        assert_eq!(exp(0.0), 1.0);
        assert_eq!(exp(100.0), f32::INFINITY);
        assert_eq!(exp(-100.0), 0.0);
        assert_eq!(exp(f32::NEG_INFINITY), 0.0);
        assert!(exp(f32::NAN).is_nan());
    }
}
