//! The 256-element k-quant formats Q2_K, Q3_K, Q4_K, Q5_K and Q6_K, dotted with [`ActQ8K`].
//!
//! Every format is read as one unsigned code per weight (at most 63), a signed integer scale per
//! group of 16 (the 32-element groups of Q4_K/Q5_K repeat their scale), optionally an integer
//! minimum per group of 16, and the f16 super-block scales `d`, `dmin`:
//! `w = d * scale_g * (code - offset) - dmin * min_g`. With activation codes `y`, scale `da` and
//! group sums `bsum_g`, a super-block's dot product is
//! `d*da * Σ_g scale_g * (Σ code*y - offset*bsum_g)  -  dmin*da * Σ_g min_g*bsum_g`,
//! all sums exact in i32.

use super::{check_row, ActQ8K, DotKernel, RowDot};
use crate::kernels::simd::SimdLevel;
use ferrite_gguf::blocks::{BlockQ2K, BlockQ3K, BlockQ4K, BlockQ5K, BlockQ6K};
use ferrite_gguf::dtype::QK_K;
use ferrite_gguf::GgmlType;
use half::f16;
use std::marker::PhantomData;
use std::mem::{offset_of, size_of};

#[cfg(target_arch = "x86_64")]
use {super::x86, std::arch::x86_64::__m256i};

/// Groups of 16 per super-block.
pub(crate) const GROUPS: usize = QK_K / 16;

/// The integer scales and minimums of a k-quant block, per group of 16.
pub(crate) struct KScales {
    pub scales: [i16; GROUPS],
    pub mins: [i16; GROUPS],
}

pub(crate) trait KFormat: Sync + 'static {
    const DTYPE: GgmlType;
    const BYTES: usize;
    /// Subtracted from every code (Q6_K: 32, Q3_K: 4).
    const CODE_OFFSET: i32;
    /// Whether the format has group minimums (`dmin` terms).
    const HAS_MIN: bool;
    /// Byte offset of the f16 `d`; `dmin` follows it when `HAS_MIN`.
    const D_OFFSET: usize;

    /// Integer scales and minimums; `block` is `BYTES` long.
    fn scales(block: &[u8]) -> KScales;
    /// The 256 codes.
    fn codes(block: &[u8]) -> [u8; QK_K];
    /// The 256 codes, 32 per register. Safety: `BYTES` readable bytes at `block`; AVX2.
    #[cfg(target_arch = "x86_64")]
    unsafe fn codes_avx2(block: *const u8) -> [__m256i; 8];
    /// [`KFormat::scales`]' `scales` and `mins` as 16 x i16 registers (mins zero without `HAS_MIN`).
    /// Safety: as [`KFormat::codes_avx2`].
    #[cfg(target_arch = "x86_64")]
    unsafe fn scales_avx2(block: *const u8) -> [__m256i; 2];
}

fn f16_at(b: &[u8], at: usize) -> f32 {
    f16::from_bits(u16::from_le_bytes([b[at], b[at + 1]])).to_f32()
}

/// The 6-bit scale and minimum of 32-element group `j` of Q4_K/Q5_K (12 packed bytes).
fn scale_min_k4(j: usize, s: &[u8]) -> (u8, u8) {
    if j < 4 {
        (s[j] & 63, s[j + 4] & 63)
    } else {
        (
            (s[j + 4] & 0x0F) | ((s[j - 4] >> 6) << 4),
            (s[j + 4] >> 4) | ((s[j] >> 6) << 4),
        )
    }
}

/// Scales of Q4_K/Q5_K: the fields `d`, `dmin`, `scales` start both blocks.
fn q4k_q5k_scales(b: &[u8]) -> KScales {
    let packed = &b[offset_of!(BlockQ4K, scales)..offset_of!(BlockQ4K, scales) + 12];
    let mut k = KScales {
        scales: [0; GROUPS],
        mins: [0; GROUPS],
    };
    for j in 0..8 {
        let (sc, m) = scale_min_k4(j, packed);
        k.scales[2 * j..2 * j + 2].fill(sc as i16);
        k.mins[2 * j..2 * j + 2].fill(m as i16);
    }
    k
}

/// Q4_K/Q5_K low bits: 64 elements per 32 bytes, low nibbles first, then high nibbles.
fn nibble_codes(qs: &[u8]) -> [u8; QK_K] {
    std::array::from_fn(|i| {
        let (j, l) = (i / 64, i % 64);
        let q = qs[32 * j + l % 32];
        if l < 32 {
            q & 0x0F
        } else {
            q >> 4
        }
    })
}

pub(crate) struct Q4K;
impl KFormat for Q4K {
    const DTYPE: GgmlType = GgmlType::Q4_K;
    const BYTES: usize = size_of::<BlockQ4K>();
    const CODE_OFFSET: i32 = 0;
    const HAS_MIN: bool = true;
    const D_OFFSET: usize = offset_of!(BlockQ4K, d);
    fn scales(b: &[u8]) -> KScales {
        q4k_q5k_scales(b)
    }
    fn codes(b: &[u8]) -> [u8; QK_K] {
        nibble_codes(&b[offset_of!(BlockQ4K, qs)..])
    }
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn codes_avx2(b: *const u8) -> [__m256i; 8] {
        x86::q4k_codes_avx2(b.add(offset_of!(BlockQ4K, qs)))
    }
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn scales_avx2(b: *const u8) -> [__m256i; 2] {
        x86::q4k_scales_avx2(b.add(offset_of!(BlockQ4K, scales)))
    }
}

pub(crate) struct Q5K;
impl KFormat for Q5K {
    const DTYPE: GgmlType = GgmlType::Q5_K;
    const BYTES: usize = size_of::<BlockQ5K>();
    const CODE_OFFSET: i32 = 0;
    const HAS_MIN: bool = true;
    const D_OFFSET: usize = offset_of!(BlockQ5K, d);
    fn scales(b: &[u8]) -> KScales {
        q4k_q5k_scales(b)
    }
    /// As Q4_K, plus bit `i / 32` of `qh[i % 32]` as bit 4 of element `i`.
    fn codes(b: &[u8]) -> [u8; QK_K] {
        let qh = &b[offset_of!(BlockQ5K, qh)..];
        let low = nibble_codes(&b[offset_of!(BlockQ5K, qs)..]);
        std::array::from_fn(|i| low[i] | ((qh[i % 32] >> (i / 32)) & 1) << 4)
    }
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn codes_avx2(b: *const u8) -> [__m256i; 8] {
        x86::q5k_codes_avx2(
            b.add(offset_of!(BlockQ5K, qh)),
            b.add(offset_of!(BlockQ5K, qs)),
        )
    }
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn scales_avx2(b: *const u8) -> [__m256i; 2] {
        x86::q4k_scales_avx2(b.add(offset_of!(BlockQ5K, scales)))
    }
}

pub(crate) struct Q6K;
impl KFormat for Q6K {
    const DTYPE: GgmlType = GgmlType::Q6_K;
    const BYTES: usize = size_of::<BlockQ6K>();
    const CODE_OFFSET: i32 = 32;
    const HAS_MIN: bool = false;
    const D_OFFSET: usize = offset_of!(BlockQ6K, d);
    fn scales(b: &[u8]) -> KScales {
        let s = &b[offset_of!(BlockQ6K, scales)..];
        KScales {
            scales: std::array::from_fn(|g| s[g] as i8 as i16),
            mins: [0; GROUPS],
        }
    }
    /// Per half of 128: element `32k + l` takes nibble `k / 2` of `ql[l + 32 * (k % 2)]` and bits
    /// `2k, 2k+1` of `qh[l]` as bits 4-5.
    fn codes(b: &[u8]) -> [u8; QK_K] {
        let (ql, qh) = (
            &b[offset_of!(BlockQ6K, ql)..],
            &b[offset_of!(BlockQ6K, qh)..],
        );
        std::array::from_fn(|i| {
            let (n, k, l) = (i / 128, i % 128 / 32, i % 32);
            let low = (ql[64 * n + l + 32 * (k % 2)] >> (4 * (k / 2))) & 0x0F;
            low | ((qh[32 * n + l] >> (2 * k)) & 3) << 4
        })
    }
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn codes_avx2(b: *const u8) -> [__m256i; 8] {
        x86::q6k_codes_avx2(
            b.add(offset_of!(BlockQ6K, ql)),
            b.add(offset_of!(BlockQ6K, qh)),
        )
    }
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn scales_avx2(b: *const u8) -> [__m256i; 2] {
        x86::q6k_scales_avx2(b.add(offset_of!(BlockQ6K, scales)))
    }
}

/// Per half of 128: element `32s + l` is bits `2s, 2s+1` of `qs[l]`.
fn two_bit_codes(qs: &[u8]) -> [u8; QK_K] {
    std::array::from_fn(|i| {
        let (n, s, l) = (i / 128, i % 128 / 32, i % 32);
        (qs[32 * n + l] >> (2 * s)) & 3
    })
}

pub(crate) struct Q2K;
impl KFormat for Q2K {
    const DTYPE: GgmlType = GgmlType::Q2_K;
    const BYTES: usize = size_of::<BlockQ2K>();
    const CODE_OFFSET: i32 = 0;
    const HAS_MIN: bool = true;
    const D_OFFSET: usize = offset_of!(BlockQ2K, d);
    /// A byte per group: scale in the low nibble, minimum in the high one.
    fn scales(b: &[u8]) -> KScales {
        let s = &b[offset_of!(BlockQ2K, scales)..];
        KScales {
            scales: std::array::from_fn(|g| (s[g] & 0x0F) as i16),
            mins: std::array::from_fn(|g| (s[g] >> 4) as i16),
        }
    }
    fn codes(b: &[u8]) -> [u8; QK_K] {
        two_bit_codes(&b[offset_of!(BlockQ2K, qs)..])
    }
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn codes_avx2(b: *const u8) -> [__m256i; 8] {
        x86::q2k_codes_avx2(b.add(offset_of!(BlockQ2K, qs)))
    }
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn scales_avx2(b: *const u8) -> [__m256i; 2] {
        x86::q2k_scales_avx2(b.add(offset_of!(BlockQ2K, scales)))
    }
}

pub(crate) struct Q3K;
impl KFormat for Q3K {
    const DTYPE: GgmlType = GgmlType::Q3_K;
    const BYTES: usize = size_of::<BlockQ3K>();
    const CODE_OFFSET: i32 = 4;
    const HAS_MIN: bool = false;
    const D_OFFSET: usize = offset_of!(BlockQ3K, d);
    /// 16 six-bit scales biased by 32: low nibbles in bytes 0..8 (groups 0..8 low nibble, groups
    /// 8..16 high nibble), top two bits in bytes 8..12 (byte `8 + g % 4`, bits `2 * (g / 4)`).
    fn scales(b: &[u8]) -> KScales {
        let s = &b[offset_of!(BlockQ3K, scales)..];
        KScales {
            scales: std::array::from_fn(|g| {
                let low = if g < 8 { s[g] & 0x0F } else { s[g - 8] >> 4 };
                let high = (s[8 + g % 4] >> (2 * (g / 4))) & 3;
                (low | high << 4) as i16 - 32
            }),
            mins: [0; GROUPS],
        }
    }
    /// Two-bit codes as Q2_K, plus bit `i / 32` of `hmask[i % 32]` as bit 2.
    fn codes(b: &[u8]) -> [u8; QK_K] {
        let hmask = &b[offset_of!(BlockQ3K, hmask)..];
        let low = two_bit_codes(&b[offset_of!(BlockQ3K, qs)..]);
        std::array::from_fn(|i| low[i] | ((hmask[i % 32] >> (i / 32)) & 1) << 2)
    }
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn codes_avx2(b: *const u8) -> [__m256i; 8] {
        x86::q3k_codes_avx2(
            b.add(offset_of!(BlockQ3K, hmask)),
            b.add(offset_of!(BlockQ3K, qs)),
        )
    }
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn scales_avx2(b: *const u8) -> [__m256i; 2] {
        x86::q3k_scales_avx2(b.add(offset_of!(BlockQ3K, scales)))
    }
}

/// The dot-product kernels of format `F`.
pub(crate) struct KQuant<F>(PhantomData<F>);

impl<F: KFormat> DotKernel for KQuant<F> {
    type Acts = ActQ8K;

    fn prepare(x: &[f32], cols: usize, n_tokens: usize) -> ActQ8K {
        ActQ8K::quantize(x, cols, n_tokens)
    }

    fn row_dot<const NT: usize>(level: SimdLevel) -> RowDot<ActQ8K, NT> {
        match level {
            #[cfg(target_arch = "x86_64")]
            SimdLevel::Avx2 => x86::kquant_dot_avx2::<F, NT>,
            #[cfg(target_arch = "x86_64")]
            SimdLevel::Avx512Vnni => x86::kquant_dot_avx512::<F, NT>,
            _ => dot_scalar::<F, NT>,
        }
    }
}

fn dot_scalar<F: KFormat, const NT: usize>(row: &[u8], acts: &ActQ8K, t0: usize) -> [f32; NT] {
    check_row(
        F::DTYPE,
        row,
        acts.blocks() * F::BYTES,
        t0,
        NT,
        acts.n_tokens(),
    );
    std::array::from_fn(|i| {
        let (qs, d, bsums) = acts.token(t0 + i);
        let mut acc = 0f32;
        for (((block, y), &da), bsums) in row
            .chunks_exact(F::BYTES)
            .zip(qs.chunks_exact(QK_K))
            .zip(d)
            .zip(bsums.chunks_exact(GROUPS))
        {
            let (k, codes) = (F::scales(block), F::codes(block));
            let d = f16_at(block, F::D_OFFSET);
            let dmin = if F::HAS_MIN {
                f16_at(block, F::D_OFFSET + 2)
            } else {
                0.0
            };
            let (mut isum, mut msum) = (0i32, 0i32);
            for (g, &bsum) in bsums.iter().enumerate() {
                let dot: i32 = (16 * g..16 * g + 16)
                    .map(|i| codes[i] as i32 * y[i] as i32)
                    .sum();
                isum += k.scales[g] as i32 * (dot - F::CODE_OFFSET * bsum as i32);
                msum += k.mins[g] as i32 * bsum as i32;
            }
            acc += (d * da) * isum as f32 - (dmin * da) * msum as f32;
        }
        acc
    })
}
