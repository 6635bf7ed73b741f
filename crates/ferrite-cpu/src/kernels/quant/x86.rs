//! x86-64 SIMD dot-product kernels: AVX2 (`vpmaddubsw`) and AVX-512 VNNI (`vpdpbusd`).
//!
//! The `#[inline(always)]` helpers carry no `#[target_feature]` of their own: they are inlined
//! into the `#[target_feature]` kernels below and compiled with those kernels' features.

use super::float::{ActF32, FloatFormat};
use super::kquant::{KFormat, GROUPS};
use super::legacy::{LegacyFormat, QK};
use super::{check_row, ActQ8, ActQ8K};
use ferrite_gguf::dtype::QK_K;
use std::arch::x86_64::*;

/// How far ahead of the weights being read to prefetch. Rows of a chunk are contiguous, so this
/// runs into the next rows; it lets weight streams from L3 run at the speed of L2-resident ones.
const PREFETCH_BYTES: usize = 8192;

/// Prefetches weights `PREFETCH_BYTES` ahead of `p` (may point past the weights: prefetches never fault).
#[inline(always)]
unsafe fn prefetch_ahead(p: *const u8) {
    _mm_prefetch::<_MM_HINT_T0>(p.wrapping_add(PREFETCH_BYTES) as *const i8);
}

#[inline(always)]
unsafe fn hsum128(v: __m128) -> f32 {
    let v = _mm_add_ps(v, _mm_movehl_ps(v, v));
    _mm_cvtss_f32(_mm_add_ss(v, _mm_movehdup_ps(v)))
}

#[inline(always)]
unsafe fn hsum256(v: __m256) -> f32 {
    hsum128(_mm_add_ps(
        _mm256_castps256_ps128(v),
        _mm256_extractf128_ps::<1>(v),
    ))
}

#[inline(always)]
unsafe fn read_u32(p: *const u8) -> u32 {
    (p as *const u32).read_unaligned()
}

#[inline(always)]
unsafe fn read_u16(p: *const u8) -> u32 {
    (p as *const u16).read_unaligned() as u32
}

// ---------------------------------------------------------------------------------------------
// Code unpacking of the 32-element formats.

/// 16 bytes of nibbles to 32 codes: low nibbles are elements 0..16, high nibbles 16..32.
#[inline(always)]
pub(super) unsafe fn nibbles_avx2(qs: *const u8) -> __m256i {
    let v = _mm256_broadcastsi128_si256(_mm_loadu_si128(qs as *const __m128i));
    let v = _mm256_srlv_epi64(v, _mm256_set_epi64x(4, 4, 0, 0));
    _mm256_and_si256(v, _mm256_set1_epi8(0x0F))
}

/// Nibbles plus bit `i` of the little-endian u32 at `qh` as bit 4 of element `i`.
#[inline(always)]
pub(super) unsafe fn five_bits_avx2(qh: *const u8, qs: *const u8) -> __m256i {
    // Byte i gets byte i / 8 of qh, then keeps bit i % 8.
    let spread = _mm256_shuffle_epi8(
        _mm256_set1_epi32(read_u32(qh) as i32),
        _mm256_set_epi64x(
            0x0303_0303_0303_0303,
            0x0202_0202_0202_0202,
            0x0101_0101_0101_0101,
            0,
        ),
    );
    let bit = _mm256_set1_epi64x(0x8040_2010_0804_0201_u64 as i64);
    let set = _mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit);
    _mm256_or_si256(
        nibbles_avx2(qs),
        _mm256_and_si256(set, _mm256_set1_epi8(0x10)),
    )
}

/// [`nibbles_avx2`] of the blocks at `qs` and `qs + stride`, in the two register halves.
#[inline(always)]
pub(super) unsafe fn nibbles_avx512_pair(qs: *const u8, stride: usize) -> __m512i {
    let first = _mm256_broadcastsi128_si256(_mm_loadu_si128(qs as *const __m128i));
    let second = _mm256_broadcastsi128_si256(_mm_loadu_si128(qs.add(stride) as *const __m128i));
    let v = _mm512_inserti64x4::<1>(_mm512_castsi256_si512(first), second);
    let v = _mm512_srlv_epi64(v, _mm512_set_epi64(4, 4, 0, 0, 4, 4, 0, 0));
    _mm512_and_si512(v, _mm512_set1_epi8(0x0F))
}

/// [`five_bits_avx2`] of two consecutive blocks: the two `qh` words form one 64-bit mask.
#[inline(always)]
pub(super) unsafe fn five_bits_avx512_pair(qh: *const u8, qs: *const u8, stride: usize) -> __m512i {
    let codes = nibbles_avx512_pair(qs, stride);
    let high: __mmask64 = read_u32(qh) as u64 | (read_u32(qh.add(stride)) as u64) << 32;
    _mm512_mask_add_epi8(codes, high, codes, _mm512_set1_epi8(0x10))
}

/// 32 bytes at `qs` and 32 at `qs + stride`.
#[inline(always)]
pub(super) unsafe fn bytes_avx512_pair(qs: *const u8, stride: usize) -> __m512i {
    let first = _mm256_loadu_si256(qs as *const __m256i);
    let second = _mm256_loadu_si256(qs.add(stride) as *const __m256i);
    _mm512_inserti64x4::<1>(_mm512_castsi256_si512(first), second)
}

// ---------------------------------------------------------------------------------------------
// 32-element formats.

/// The code and scale pointers of tokens `t0 .. t0 + NT` (bounds checked).
#[inline(always)]
fn q8_tokens<const NT: usize>(acts: &ActQ8, t0: usize) -> ([*const i8; NT], [*const [f32; 2]; NT]) {
    let mut qs = [std::ptr::null(); NT];
    let mut ds = [std::ptr::null(); NT];
    for t in 0..NT {
        let (q, d) = acts.token(t0 + t);
        (qs[t], ds[t]) = (q.as_ptr(), d.as_ptr());
    }
    (qs, ds)
}

/// One block `b` against all tokens, AVX2: adds `d*da * (code · y)` to the lanes of `acc` and the
/// pair `(d*da, c*sa)` to `acc_min` (whose lane 1 thus sums the minimum terms).
#[inline(always)]
unsafe fn legacy_block_avx2<F: LegacyFormat, const NT: usize>(
    block: *const u8,
    b: usize,
    qs: &[*const i8; NT],
    ds: &[*const [f32; 2]; NT],
    acc: &mut [__m256; NT],
    acc_min: &mut [__m128; NT],
) {
    let codes = F::codes_avx2(block);
    let scale_bits = F::scale_bits(std::slice::from_raw_parts(block, F::BYTES));
    let w = _mm_cvtph_ps(_mm_cvtsi32_si128(scale_bits as i32));
    // vpmaddubsw multiplies unsigned by signed bytes: signed codes move their sign onto y.
    let ucodes = if F::SIGNED {
        _mm256_sign_epi8(codes, codes)
    } else {
        codes
    };
    for t in 0..NT {
        let y = _mm256_loadu_si256(qs[t].add(b * QK) as *const __m256i);
        let y = if F::SIGNED {
            _mm256_sign_epi8(y, codes)
        } else {
            y
        };
        let isum = _mm256_madd_epi16(_mm256_maddubs_epi16(ucodes, y), _mm256_set1_epi16(1));
        let p = _mm_mul_ps(w, _mm_castpd_ps(_mm_load_sd(ds[t].add(b) as *const f64)));
        acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), _mm256_broadcastss_ps(p), acc[t]);
        acc_min[t] = _mm_add_ps(acc_min[t], p);
    }
}

#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn legacy_dot_avx2<F: LegacyFormat, const NT: usize>(
    row: &[u8],
    acts: &ActQ8,
    t0: usize,
) -> [f32; NT] {
    let nb = acts.blocks();
    check_row(F::DTYPE, row, nb * F::BYTES, t0, NT, acts.n_tokens());
    let (qs, ds) = q8_tokens::<NT>(acts, t0);
    let mut acc = [_mm256_setzero_ps(); NT];
    let mut acc_min = [_mm_setzero_ps(); NT];
    for b in 0..nb {
        let block = row.as_ptr().add(b * F::BYTES);
        prefetch_ahead(block);
        legacy_block_avx2::<F, NT>(block, b, &qs, &ds, &mut acc, &mut acc_min);
    }
    let mut out = [0f32; NT];
    for t in 0..NT {
        out[t] = hsum256(acc[t]) + F::MIN_FACTOR * _mm_cvtss_f32(_mm_movehdup_ps(acc_min[t]));
    }
    out
}

/// Two blocks per step: 64 codes in one `vpdpbusd`, the lanes of each block scaled by its own
/// `d*da` (the product pair `[d0*da0, c0*sa0, d1*da1, c1*sa1]` is permuted out to 8 + 8 lanes).
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
pub(super) unsafe fn legacy_dot_avx512<F: LegacyFormat, const NT: usize>(
    row: &[u8],
    acts: &ActQ8,
    t0: usize,
) -> [f32; NT] {
    let nb = acts.blocks();
    check_row(F::DTYPE, row, nb * F::BYTES, t0, NT, acts.n_tokens());
    let (qs, ds) = q8_tokens::<NT>(acts, t0);
    let spread = _mm512_set_epi32(2, 2, 2, 2, 2, 2, 2, 2, 0, 0, 0, 0, 0, 0, 0, 0);
    let mut acc = [_mm512_setzero_ps(); NT];
    let mut acc_min = [_mm_setzero_ps(); NT];
    let mut b = 0;
    while b + 2 <= nb {
        let block = row.as_ptr().add(b * F::BYTES);
        prefetch_ahead(block);
        let codes = F::codes_avx512_pair(block);
        let bits = F::scale_bits(std::slice::from_raw_parts(block, F::BYTES)) as u64
            | (F::scale_bits(std::slice::from_raw_parts(block.add(F::BYTES), F::BYTES)) as u64)
                << 32;
        let w = _mm_cvtph_ps(_mm_cvtsi64_si128(bits as i64));
        // vpdpbusd multiplies unsigned by signed bytes: signed codes move their sign onto y.
        let (ucodes, negative) = if F::SIGNED {
            (_mm512_abs_epi8(codes), _mm512_movepi8_mask(codes))
        } else {
            (codes, 0)
        };
        for t in 0..NT {
            let y = _mm512_loadu_si512(qs[t].add(b * QK) as *const _);
            let y = if F::SIGNED {
                _mm512_mask_sub_epi8(y, negative, _mm512_setzero_si512(), y)
            } else {
                y
            };
            let isum = _mm512_dpbusd_epi32(_mm512_setzero_si512(), ucodes, y);
            let p = _mm_mul_ps(w, _mm_loadu_ps(ds[t].add(b) as *const f32));
            let scale = _mm512_permutexvar_ps(spread, _mm512_castps128_ps512(p));
            acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), scale, acc[t]);
            acc_min[t] = _mm_add_ps(acc_min[t], p);
        }
        b += 2;
    }
    let mut tail = [_mm256_setzero_ps(); NT];
    if b < nb {
        legacy_block_avx2::<F, NT>(
            row.as_ptr().add(b * F::BYTES),
            b,
            &qs,
            &ds,
            &mut tail,
            &mut acc_min,
        );
    }
    let mut out = [0f32; NT];
    for t in 0..NT {
        // Minimum terms sit in lanes 1 and 3.
        let m = _mm_movehdup_ps(acc_min[t]);
        let min = _mm_cvtss_f32(_mm_add_ss(m, _mm_movehl_ps(m, m)));
        out[t] = _mm512_reduce_add_ps(acc[t]) + hsum256(tail[t]) + F::MIN_FACTOR * min;
    }
    out
}

// ---------------------------------------------------------------------------------------------
// k-quant code unpacking: 8 registers of 32 codes, element order.

#[inline(always)]
unsafe fn load256(p: *const u8) -> __m256i {
    _mm256_loadu_si256(p as *const __m256i)
}

/// Q4_K: 32 bytes per 64 elements, low nibbles first.
#[inline(always)]
pub(super) unsafe fn q4k_codes_avx2(qs: *const u8) -> [__m256i; 8] {
    let nib = _mm256_set1_epi8(0x0F);
    let mut c = [_mm256_setzero_si256(); 8];
    for j in 0..4 {
        let v = load256(qs.add(32 * j));
        c[2 * j] = _mm256_and_si256(v, nib);
        c[2 * j + 1] = _mm256_and_si256(_mm256_srli_epi16::<4>(v), nib);
    }
    c
}

/// Q5_K: Q4_K codes plus bit `k` of `qh[l]` as bit 4 of element `32k + l`.
#[inline(always)]
pub(super) unsafe fn q5k_codes_avx2(qh: *const u8, qs: *const u8) -> [__m256i; 8] {
    let mut c = q4k_codes_avx2(qs);
    or_mask_bits(&mut c, qh, 0x10);
    c
}

/// OR `value` into element `32k + l` of the codes wherever bit `k` of `mask[l]` is set (the
/// high-bit planes of Q3_K and Q5_K).
#[inline(always)]
unsafe fn or_mask_bits(codes: &mut [__m256i; 8], mask: *const u8, value: i8) {
    let high = load256(mask);
    for (k, c) in codes.iter_mut().enumerate() {
        let bit = _mm256_set1_epi8(1 << k);
        let set = _mm256_cmpeq_epi8(_mm256_and_si256(high, bit), bit);
        *c = _mm256_or_si256(*c, _mm256_and_si256(set, _mm256_set1_epi8(value)));
    }
}

/// Q6_K: per half, nibbles of `ql[0..32]`, `ql[32..64]` (low, then high) plus two bits of `qh`.
#[inline(always)]
pub(super) unsafe fn q6k_codes_avx2(ql: *const u8, qh: *const u8) -> [__m256i; 8] {
    let (nib, top) = (_mm256_set1_epi8(0x0F), _mm256_set1_epi8(0x30));
    let mut c = [_mm256_setzero_si256(); 8];
    for n in 0..2 {
        let (l0, l1) = (load256(ql.add(64 * n)), load256(ql.add(64 * n + 32)));
        let h = load256(qh.add(32 * n));
        c[4 * n] = _mm256_or_si256(
            _mm256_and_si256(l0, nib),
            _mm256_and_si256(_mm256_slli_epi16::<4>(h), top),
        );
        c[4 * n + 1] = _mm256_or_si256(
            _mm256_and_si256(l1, nib),
            _mm256_and_si256(_mm256_slli_epi16::<2>(h), top),
        );
        c[4 * n + 2] = _mm256_or_si256(
            _mm256_and_si256(_mm256_srli_epi16::<4>(l0), nib),
            _mm256_and_si256(h, top),
        );
        c[4 * n + 3] = _mm256_or_si256(
            _mm256_and_si256(_mm256_srli_epi16::<4>(l1), nib),
            _mm256_and_si256(_mm256_srli_epi16::<2>(h), top),
        );
    }
    c
}

/// Q2_K: per half, bit pairs 0..4 of `qs[0..32]`.
#[inline(always)]
pub(super) unsafe fn q2k_codes_avx2(qs: *const u8) -> [__m256i; 8] {
    let three = _mm256_set1_epi8(3);
    let mut c = [_mm256_setzero_si256(); 8];
    for n in 0..2 {
        let v = load256(qs.add(32 * n));
        c[4 * n] = _mm256_and_si256(v, three);
        c[4 * n + 1] = _mm256_and_si256(_mm256_srli_epi16::<2>(v), three);
        c[4 * n + 2] = _mm256_and_si256(_mm256_srli_epi16::<4>(v), three);
        c[4 * n + 3] = _mm256_and_si256(_mm256_srli_epi16::<6>(v), three);
    }
    c
}

/// Q3_K: Q2_K codes plus bit `k` of `hmask[l]` as bit 2 of element `32k + l`.
#[inline(always)]
pub(super) unsafe fn q3k_codes_avx2(hmask: *const u8, qs: *const u8) -> [__m256i; 8] {
    let mut c = q2k_codes_avx2(qs);
    or_mask_bits(&mut c, hmask, 4);
    c
}

/// Q4_K/Q5_K: 8 six-bit scales and 8 minimums packed in 12 bytes (see `scale_min_k4`), rearranged
/// with word operations into 8 scale bytes and 8 minimum bytes, each repeated for its two 16-groups.
#[inline(always)]
pub(super) unsafe fn q4k_scales_avx2(packed: *const u8) -> [__m256i; 2] {
    const LOW6: u32 = 0x3F3F_3F3F;
    const LOW4: u32 = 0x0F0F_0F0F;
    const TOP2: u32 = 0x0303_0303;
    let (w0, w1, w2) = (
        read_u32(packed),
        read_u32(packed.add(4)),
        read_u32(packed.add(8)),
    );
    let scales = _mm_set_epi32(
        0,
        0,
        ((w2 & LOW4) | ((w0 >> 6) & TOP2) << 4) as i32,
        (w0 & LOW6) as i32,
    );
    let mins = _mm_set_epi32(
        0,
        0,
        (((w2 >> 4) & LOW4) | ((w1 >> 6) & TOP2) << 4) as i32,
        (w1 & LOW6) as i32,
    );
    // Each 32-element scale serves two 16-groups.
    [
        _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(scales, scales)),
        _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(mins, mins)),
    ]
}

/// Q6_K: 16 signed byte scales.
#[inline(always)]
pub(super) unsafe fn q6k_scales_avx2(scales: *const u8) -> [__m256i; 2] {
    [
        _mm256_cvtepi8_epi16(_mm_loadu_si128(scales as *const __m128i)),
        _mm256_setzero_si256(),
    ]
}

/// Q2_K: a byte per group, scale in the low nibble, minimum in the high one.
#[inline(always)]
pub(super) unsafe fn q2k_scales_avx2(scales: *const u8) -> [__m256i; 2] {
    let v = _mm_loadu_si128(scales as *const __m128i);
    let nib = _mm_set1_epi8(0x0F);
    [
        _mm256_cvtepu8_epi16(_mm_and_si128(v, nib)),
        _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16::<4>(v), nib)),
    ]
}

/// Q3_K: 16 six-bit scales biased by 32 in 12 bytes (see `Q3K::scales`), by word operations.
#[inline(always)]
pub(super) unsafe fn q3k_scales_avx2(packed: *const u8) -> [__m256i; 2] {
    const LOW4: u32 = 0x0F0F_0F0F;
    const TOP2: u32 = 0x0303_0303;
    let (w0, w1, w2) = (
        read_u32(packed),
        read_u32(packed.add(4)),
        read_u32(packed.add(8)),
    );
    let bytes = _mm_set_epi32(
        (((w1 >> 4) & LOW4) | ((w2 >> 6) & TOP2) << 4) as i32,
        (((w0 >> 4) & LOW4) | ((w2 >> 4) & TOP2) << 4) as i32,
        ((w1 & LOW4) | ((w2 >> 2) & TOP2) << 4) as i32,
        ((w0 & LOW4) | (w2 & TOP2) << 4) as i32,
    );
    [
        _mm256_sub_epi16(_mm256_cvtepu8_epi16(bytes), _mm256_set1_epi16(32)),
        _mm256_setzero_si256(),
    ]
}

// ---------------------------------------------------------------------------------------------
// k-quants.

/// `vpshufb` patterns that spread scale words `2j` (low lane) and `2j + 1` (high lane) of a
/// 128-bit lane holding 8 group scales over the 16-bit lanes of a register.
#[inline(always)]
unsafe fn group_scale_pattern(j: usize) -> __m256i {
    let word = |w: usize| (((2 * w + 1) << 8) | (2 * w)) as i16;
    _mm256_set_m128i(_mm_set1_epi16(word(2 * j + 1)), _mm_set1_epi16(word(2 * j)))
}

#[inline(always)]
unsafe fn kquant_body<F: KFormat, const NT: usize>(
    row: &[u8],
    acts: &ActQ8K,
    t0: usize,
) -> [f32; NT] {
    let nsb = acts.blocks();
    check_row(F::DTYPE, row, nsb * F::BYTES, t0, NT, acts.n_tokens());
    let mut qs = [std::ptr::null(); NT];
    let mut ds = [std::ptr::null(); NT];
    let mut bsums = [std::ptr::null(); NT];
    for t in 0..NT {
        let (q, d, b) = acts.token(t0 + t);
        (qs[t], ds[t], bsums[t]) = (q.as_ptr(), d.as_ptr(), b.as_ptr());
    }
    let patterns = [
        group_scale_pattern(0),
        group_scale_pattern(1),
        group_scale_pattern(2),
        group_scale_pattern(3),
    ];
    let mut acc = [_mm256_setzero_ps(); NT];
    for s in 0..nsb {
        let block = row.as_ptr().add(s * F::BYTES);
        for line in (0..F::BYTES).step_by(64) {
            prefetch_ahead(block.add(line));
        }
        let codes = F::codes_avx2(block);
        let [scales, mins] = F::scales_avx2(block);
        let d_bits = if F::HAS_MIN {
            read_u32(block.add(F::D_OFFSET))
        } else {
            read_u16(block.add(F::D_OFFSET))
        };
        let d_dmin = _mm_cvtph_ps(_mm_cvtsi32_si128(d_bits as i32));
        let halves = [
            _mm256_permute2x128_si256::<0x00>(scales, scales),
            _mm256_permute2x128_si256::<0x11>(scales, scales),
        ];
        let mut group_scales = [_mm256_setzero_si256(); 8];
        for (i, g) in group_scales.iter_mut().enumerate() {
            *g = _mm256_shuffle_epi8(halves[i / 4], patterns[i % 4]);
        }
        for t in 0..NT {
            let y = qs[t].add(s * QK_K) as *const u8;
            let mut sums = [_mm256_setzero_si256(); 8];
            for i in 0..8 {
                let products = _mm256_maddubs_epi16(codes[i], load256(y.add(32 * i)));
                sums[i] = _mm256_madd_epi16(products, group_scales[i]);
            }
            // A tree, not a chain: with VNNI the adds fuse into 5-cycle `vpdpwssd`s.
            let mut isum = _mm256_add_epi32(
                _mm256_add_epi32(
                    _mm256_add_epi32(sums[0], sums[1]),
                    _mm256_add_epi32(sums[2], sums[3]),
                ),
                _mm256_add_epi32(
                    _mm256_add_epi32(sums[4], sums[5]),
                    _mm256_add_epi32(sums[6], sums[7]),
                ),
            );
            let bs = _mm256_loadu_si256(bsums[t].add(s * GROUPS) as *const __m256i);
            if F::CODE_OFFSET != 0 {
                let offsets = _mm256_mullo_epi32(
                    _mm256_madd_epi16(bs, scales),
                    _mm256_set1_epi32(F::CODE_OFFSET),
                );
                isum = _mm256_sub_epi32(isum, offsets);
            }
            // [d * da, dmin * da]
            let p = _mm_mul_ps(d_dmin, _mm_set1_ps(*ds[t].add(s)));
            acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), _mm256_broadcastss_ps(p), acc[t]);
            if F::HAS_MIN {
                let min_sum = _mm256_cvtepi32_ps(_mm256_madd_epi16(bs, mins));
                acc[t] =
                    _mm256_fnmadd_ps(min_sum, _mm256_broadcastss_ps(_mm_movehdup_ps(p)), acc[t]);
            }
        }
    }
    let mut out = [0f32; NT];
    for t in 0..NT {
        out[t] = hsum256(acc[t]);
    }
    out
}

#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn kquant_dot_avx2<F: KFormat, const NT: usize>(
    row: &[u8],
    acts: &ActQ8K,
    t0: usize,
) -> [f32; NT] {
    kquant_body::<F, NT>(row, acts, t0)
}

/// The same code with AVX-512 VNNI enabled, which fuses `vpmaddwd` + `vpaddd` into `vpdpwssd`.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
pub(super) unsafe fn kquant_dot_avx512<F: KFormat, const NT: usize>(
    row: &[u8],
    acts: &ActQ8K,
    t0: usize,
) -> [f32; NT] {
    kquant_body::<F, NT>(row, acts, t0)
}

// ---------------------------------------------------------------------------------------------
// Float weights.

#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn float_dot_avx2<F: FloatFormat, const NT: usize>(
    row: &[u8],
    acts: &ActF32,
    t0: usize,
) -> [f32; NT] {
    let cols = acts.cols;
    check_row(F::DTYPE, row, cols * F::BYTES, t0, NT, acts.n_tokens);
    let mut xs = [std::ptr::null(); NT];
    for (t, x) in xs.iter_mut().enumerate() {
        *x = acts.token(t0 + t).as_ptr();
    }
    // Two accumulators per token hide the FMA latency.
    let mut acc = [[_mm256_setzero_ps(); 2]; NT];
    let w = row.as_ptr();
    let mut c = 0;
    while c + 16 <= cols {
        prefetch_ahead(w.add(c * F::BYTES));
        let w0 = F::load8_avx2(w.add(c * F::BYTES));
        let w1 = F::load8_avx2(w.add((c + 8) * F::BYTES));
        for t in 0..NT {
            acc[t][0] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(xs[t].add(c)), acc[t][0]);
            acc[t][1] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(xs[t].add(c + 8)), acc[t][1]);
        }
        c += 16;
    }
    if c + 8 <= cols {
        let w0 = F::load8_avx2(w.add(c * F::BYTES));
        for t in 0..NT {
            acc[t][0] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(xs[t].add(c)), acc[t][0]);
        }
        c += 8;
    }
    let mut out = [0f32; NT];
    for t in 0..NT {
        out[t] = hsum256(_mm256_add_ps(acc[t][0], acc[t][1]));
        for i in c..cols {
            out[t] += F::to_f32(&row[i * F::BYTES..(i + 1) * F::BYTES]) * acts.token(t0 + t)[i];
        }
    }
    out
}

/// Lane j of the result: `op` folded over the 16 lanes of `v[j]` (integer lanes). Pairs folded
/// twice inside each 128-bit lane (blocks 4i..4i+3 side by side), then the four 128-bit lanes of
/// each group of four added across, in block order (as the attention's score sums).
#[inline(always)]
unsafe fn fold_each(v: &[__m512i; 16], op: impl Fn(__m512i, __m512i) -> __m512i) -> __m512i {
    let r: [__m512i; 8] = std::array::from_fn(|i| op(_mm512_unpacklo_epi32(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_epi32(v[2 * i], v[2 * i + 1])));
    let s: [__m512i; 4] = std::array::from_fn(|i| op(_mm512_unpacklo_epi64(r[2 * i], r[2 * i + 1]), _mm512_unpackhi_epi64(r[2 * i], r[2 * i + 1])));
    let across = |a: __m512i, b: __m512i| op(_mm512_shuffle_i32x4::<0x88>(a, b), _mm512_shuffle_i32x4::<0xDD>(a, b));
    across(across(s[0], s[1]), across(s[2], s[3]))
}

/// [`super::quantize_block`] over the 32-value blocks of one row, 16 blocks at a time: their
/// maxima and code sums finished by one transposing reduction each, their `127 / max` by one
/// division (a block alone spent ~10 ns in its own horizontal reductions and scalar division).
/// The same codes, scales and sums bit for bit; a group of 16 holding a NaN or an infinity, and
/// the last blocks, take the block-by-block code.
///
/// Safety: AVX-512 F and BW must be available.
#[target_feature(enable = "avx2,fma,avx512f,avx512bw,avx512vl")]
pub(super) unsafe fn quantize_blocks32_avx512(x: &[f32], qs: &mut [i8], mut store: impl FnMut(usize, f32, i32)) {
    assert!(x.len() == qs.len() && x.len().is_multiple_of(32), "quantize: sizes");
    let nb = x.len() / 32;
    let abs = _mm512_set1_epi32(0x7FFF_FFFF);
    let mut b0 = 0;
    while b0 + 16 <= nb {
        let p = x.as_ptr().add(b0 * 32);
        let block_max: [__m512i; 16] = std::array::from_fn(|j| {
            let a = _mm512_and_si512(_mm512_loadu_si512(p.add(32 * j) as *const _), abs);
            let b = _mm512_and_si512(_mm512_loadu_si512(p.add(32 * j + 16) as *const _), abs);
            _mm512_max_epu32(a, b)
        });
        let max_bits = fold_each(&block_max, |a, b| _mm512_max_epu32(a, b));
        if _mm512_cmpge_epu32_mask(max_bits, _mm512_set1_epi32(f32::INFINITY.to_bits() as i32)) != 0 {
            break;
        }
        let amax = _mm512_castsi512_ps(max_bits);
        let positive = _mm512_cmp_ps_mask::<_CMP_GT_OQ>(amax, _mm512_setzero_ps());
        let mut inv = [0f32; 16];
        _mm512_storeu_ps(inv.as_mut_ptr(), _mm512_maskz_div_ps(positive, _mm512_set1_ps(127.0), amax));
        let mut d = [0f32; 16];
        _mm512_storeu_ps(d.as_mut_ptr(), _mm512_div_ps(amax, _mm512_set1_ps(127.0)));
        // Two blocks' codes per store: the two saturating packs leave, in each 128-bit lane L,
        // dwords L of the four code vectors; a dword transpose puts them in order. Rounding is
        // to nearest even, as `round_i32`; |code| <= 127, so the packs are exact.
        let order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
        let mut codes = [_mm512_setzero_si512(); 16];
        for j in (0..16).step_by(2) {
            let c: [__m512i; 4] = std::array::from_fn(|h| {
                let inv = _mm512_set1_ps(inv[j + h / 2]);
                _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(p.add(32 * j + 16 * h)), inv))
            });
            let packed = _mm512_packs_epi16(_mm512_packs_epi32(c[0], c[1]), _mm512_packs_epi32(c[2], c[3]));
            _mm512_storeu_si512(qs.as_mut_ptr().add((b0 + j) * 32) as *mut _, _mm512_permutexvar_epi32(order, packed));
            codes[j] = _mm512_add_epi32(c[0], c[1]);
            codes[j + 1] = _mm512_add_epi32(c[2], c[3]);
        }
        let mut sums = [0i32; 16];
        _mm512_storeu_si512(sums.as_mut_ptr() as *mut _, fold_each(&codes, |a, b| _mm512_add_epi32(a, b)));
        for j in 0..16 {
            store(b0 + j, d[j], sums[j]);
        }
        b0 += 16;
    }
    for b in b0..nb {
        let (x, q) = (x[b * 32..][..32].try_into().expect("32 values"), (&mut qs[b * 32..][..32]).try_into().expect("32 codes"));
        let (d, sum) = super::quantize_block::<32>(x, q);
        store(b, d, sum);
    }
}
