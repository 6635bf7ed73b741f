//! Float weights (F32, F16, BF16) dotted with f32 activations.

use super::{check_row, DotKernel, RowDot};
use crate::kernels::simd::SimdLevel;
use ferrite_gguf::GgmlType;
use half::{bf16, f16};
use std::marker::PhantomData;

#[cfg(target_arch = "x86_64")]
use {super::x86, std::arch::x86_64::*};

pub(crate) trait FloatFormat: Sync + 'static {
    const DTYPE: GgmlType;
    const BYTES: usize;
    /// The value of one element (`b` is `BYTES` long).
    fn to_f32(b: &[u8]) -> f32;
    /// Eight elements as f32. Safety: `8 * BYTES` readable bytes at `p`; AVX2 + F16C.
    #[cfg(target_arch = "x86_64")]
    unsafe fn load8_avx2(p: *const u8) -> __m256;
}

pub(crate) struct F32;
impl FloatFormat for F32 {
    const DTYPE: GgmlType = GgmlType::F32;
    const BYTES: usize = 4;
    fn to_f32(b: &[u8]) -> f32 {
        f32::from_le_bytes([b[0], b[1], b[2], b[3]])
    }
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn load8_avx2(p: *const u8) -> __m256 {
        _mm256_loadu_ps(p as *const f32)
    }
}

pub(crate) struct F16;
impl FloatFormat for F16 {
    const DTYPE: GgmlType = GgmlType::F16;
    const BYTES: usize = 2;
    fn to_f32(b: &[u8]) -> f32 {
        f16::from_le_bytes([b[0], b[1]]).to_f32()
    }
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn load8_avx2(p: *const u8) -> __m256 {
        _mm256_cvtph_ps(_mm_loadu_si128(p as *const __m128i))
    }
}

pub(crate) struct BF16;
impl FloatFormat for BF16 {
    const DTYPE: GgmlType = GgmlType::BF16;
    const BYTES: usize = 2;
    fn to_f32(b: &[u8]) -> f32 {
        bf16::from_le_bytes([b[0], b[1]]).to_f32()
    }
    /// bf16 is the top half of an f32.
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn load8_avx2(p: *const u8) -> __m256 {
        let wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(p as *const __m128i));
        _mm256_castsi256_ps(_mm256_slli_epi32::<16>(wide))
    }
}

/// f32 activations of all tokens (a copy, so the kernels own what they read).
pub(crate) struct ActF32 {
    pub(crate) cols: usize,
    pub(crate) n_tokens: usize,
    pub(crate) x: Vec<f32>,
}

impl ActF32 {
    #[inline(always)]
    pub(crate) fn token(&self, t: usize) -> &[f32] {
        &self.x[t * self.cols..(t + 1) * self.cols]
    }
}

/// Partial sums kept per lane, so the scalar kernel's rounding resembles the SIMD one's.
pub(crate) const LANES: usize = 8;

pub(crate) struct Float<F>(PhantomData<F>);

impl<F: FloatFormat> DotKernel for Float<F> {
    type Acts = ActF32;

    fn prepare(x: &[f32], cols: usize, n_tokens: usize) -> ActF32 {
        assert_eq!(x.len(), cols * n_tokens, "activation shape");
        ActF32 {
            cols,
            n_tokens,
            x: x.to_vec(),
        }
    }

    fn row_dot<const NT: usize>(level: SimdLevel) -> RowDot<ActF32, NT> {
        match level {
            #[cfg(target_arch = "x86_64")]
            SimdLevel::Avx2 | SimdLevel::Avx512Vnni => x86::float_dot_avx2::<F, NT>,
            _ => dot_scalar::<F, NT>,
        }
    }
}

fn dot_scalar<F: FloatFormat, const NT: usize>(row: &[u8], acts: &ActF32, t0: usize) -> [f32; NT] {
    check_row(F::DTYPE, row, acts.cols * F::BYTES, t0, NT, acts.n_tokens);
    std::array::from_fn(|i| {
        let x = acts.token(t0 + i);
        let mut lanes = [0f32; LANES];
        for (c, (w, &x)) in row.chunks_exact(F::BYTES).zip(x).enumerate() {
            lanes[c % LANES] += F::to_f32(w) * x;
        }
        lanes.iter().sum()
    })
}
