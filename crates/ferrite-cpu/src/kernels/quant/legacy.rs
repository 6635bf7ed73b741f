//! The 32-element block formats Q4_0, Q4_1, Q5_0, Q5_1 and Q8_0, dotted with [`ActQ8`].
//!
//! Every format is read as one integer code per weight plus two f16 numbers per block, `(d, c)`:
//! `w = d * code + c` for Q4_1/Q5_1 (`c` is the block minimum) and `w = d * (code - offset)` for
//! the others (`c = d`). A block's dot product with activation codes `y` (scale `da`, code sum
//! `s`, so `da * s` is stored) is `d*da * Σ code*y  +  K * c*da*s` with `K = 1` for the `_1`
//! formats and `K = -offset` for the `_0` ones; the second terms are summed over the row and
//! multiplied by `K` once. Q8_0 codes are signed with offset 0.

use super::{check_row, ActQ8, DotKernel, RowDot};
use crate::kernels::simd::SimdLevel;
use ferrite_gguf::blocks::{BlockQ4_0, BlockQ4_1, BlockQ5_0, BlockQ5_1, BlockQ8_0};
use ferrite_gguf::GgmlType;
use half::f16;
use std::marker::PhantomData;
use std::mem::{offset_of, size_of};

#[cfg(target_arch = "x86_64")]
use {super::x86, std::arch::x86_64::*};

/// Elements per block.
pub(crate) const QK: usize = 32;

pub(crate) trait LegacyFormat: Sync + 'static {
    const DTYPE: GgmlType;
    /// Bytes per block.
    const BYTES: usize;
    /// Codes are `i8` (Q8_0); otherwise unsigned, at most 31.
    const SIGNED: bool;
    /// `K` in the module formula.
    const MIN_FACTOR: f32;

    /// The f16 bits of `(d, c)`, `d` in the low half. `block` is `BYTES` long.
    fn scale_bits(block: &[u8]) -> u32;
    /// The 32 codes (signed codes as their two's-complement bytes).
    fn codes(block: &[u8]) -> [u8; QK];

    /// The 32 codes in one register. Safety: `block` points at `BYTES` readable bytes; AVX2.
    #[cfg(target_arch = "x86_64")]
    unsafe fn codes_avx2(block: *const u8) -> __m256i;
    /// The codes of the block at `block` and the one after it, in one register.
    /// Safety: `2 * BYTES` readable bytes; AVX-512 F/BW/VL.
    #[cfg(target_arch = "x86_64")]
    unsafe fn codes_avx512_pair(block: *const u8) -> __m512i;
}

fn le_u16(b: &[u8], at: usize) -> u32 {
    u16::from_le_bytes([b[at], b[at + 1]]) as u32
}

/// Low nibbles are elements 0..16, high nibbles 16..32.
fn nibble_codes(qs: &[u8]) -> [u8; QK] {
    std::array::from_fn(|i| {
        if i < 16 {
            qs[i] & 0x0F
        } else {
            qs[i - 16] >> 4
        }
    })
}

/// Nibbles plus bit `i` of the little-endian `qh` as bit 4 of element `i`.
fn five_bit_codes(qh: &[u8], qs: &[u8]) -> [u8; QK] {
    let qh = u32::from_le_bytes([qh[0], qh[1], qh[2], qh[3]]);
    let mut codes = nibble_codes(qs);
    for (i, c) in codes.iter_mut().enumerate() {
        *c |= (((qh >> i) & 1) as u8) << 4;
    }
    codes
}

/// `(d, d)` for the formats without a minimum.
fn d_twice(block: &[u8]) -> u32 {
    le_u16(block, 0) * 0x0001_0001
}

/// `(d, m)`: the two f16 fields at the start of the `_1` blocks.
fn d_and_min(block: &[u8]) -> u32 {
    le_u16(block, 0) | le_u16(block, 2) << 16
}

macro_rules! format_type {
    ($name:ident, $block:ty, signed: $signed:expr, min_factor: $k:expr, scales: $scales:ident,
     codes: |$b:ident| $codes:expr, avx2: |$p:ident| $avx2:expr, avx512: |$p2:ident| $avx512:expr) => {
        #[allow(non_camel_case_types)]
        pub(crate) struct $name;
        impl LegacyFormat for $name {
            const DTYPE: GgmlType = GgmlType::$name;
            const BYTES: usize = size_of::<$block>();
            const SIGNED: bool = $signed;
            const MIN_FACTOR: f32 = $k;
            fn scale_bits(block: &[u8]) -> u32 {
                $scales(block)
            }
            fn codes($b: &[u8]) -> [u8; QK] {
                $codes
            }
            #[cfg(target_arch = "x86_64")]
            #[inline(always)]
            unsafe fn codes_avx2($p: *const u8) -> __m256i {
                $avx2
            }
            #[cfg(target_arch = "x86_64")]
            #[inline(always)]
            unsafe fn codes_avx512_pair($p2: *const u8) -> __m512i {
                $avx512
            }
        }
    };
}

format_type!(Q4_0, BlockQ4_0, signed: false, min_factor: -8.0, scales: d_twice,
    codes: |b| nibble_codes(&b[offset_of!(BlockQ4_0, qs)..]),
    avx2: |p| x86::nibbles_avx2(p.add(offset_of!(BlockQ4_0, qs))),
    avx512: |p| x86::nibbles_avx512_pair(p.add(offset_of!(BlockQ4_0, qs)), Self::BYTES));
format_type!(Q4_1, BlockQ4_1, signed: false, min_factor: 1.0, scales: d_and_min,
    codes: |b| nibble_codes(&b[offset_of!(BlockQ4_1, qs)..]),
    avx2: |p| x86::nibbles_avx2(p.add(offset_of!(BlockQ4_1, qs))),
    avx512: |p| x86::nibbles_avx512_pair(p.add(offset_of!(BlockQ4_1, qs)), Self::BYTES));
format_type!(Q5_0, BlockQ5_0, signed: false, min_factor: -16.0, scales: d_twice,
    codes: |b| five_bit_codes(&b[offset_of!(BlockQ5_0, qh)..], &b[offset_of!(BlockQ5_0, qs)..]),
    avx2: |p| x86::five_bits_avx2(p.add(offset_of!(BlockQ5_0, qh)), p.add(offset_of!(BlockQ5_0, qs))),
    avx512: |p| x86::five_bits_avx512_pair(p.add(offset_of!(BlockQ5_0, qh)), p.add(offset_of!(BlockQ5_0, qs)), Self::BYTES));
format_type!(Q5_1, BlockQ5_1, signed: false, min_factor: 1.0, scales: d_and_min,
    codes: |b| five_bit_codes(&b[offset_of!(BlockQ5_1, qh)..], &b[offset_of!(BlockQ5_1, qs)..]),
    avx2: |p| x86::five_bits_avx2(p.add(offset_of!(BlockQ5_1, qh)), p.add(offset_of!(BlockQ5_1, qs))),
    avx512: |p| x86::five_bits_avx512_pair(p.add(offset_of!(BlockQ5_1, qh)), p.add(offset_of!(BlockQ5_1, qs)), Self::BYTES));
format_type!(Q8_0, BlockQ8_0, signed: true, min_factor: 0.0, scales: d_twice,
    codes: |b| std::array::from_fn(|i| b[offset_of!(BlockQ8_0, qs) + i]),
    avx2: |p| _mm256_loadu_si256(p.add(offset_of!(BlockQ8_0, qs)) as *const __m256i),
    avx512: |p| x86::bytes_avx512_pair(p.add(offset_of!(BlockQ8_0, qs)), Self::BYTES));

/// The dot-product kernels of format `F`.
pub(crate) struct Legacy<F>(PhantomData<F>);

impl<F: LegacyFormat> DotKernel for Legacy<F> {
    type Acts = ActQ8;

    fn prepare(x: &[f32], cols: usize, n_tokens: usize) -> ActQ8 {
        ActQ8::quantize(x, cols, n_tokens)
    }

    fn row_dot<const NT: usize>(level: SimdLevel) -> RowDot<ActQ8, NT> {
        match level {
            #[cfg(target_arch = "x86_64")]
            SimdLevel::Avx2 => x86::legacy_dot_avx2::<F, NT>,
            #[cfg(target_arch = "x86_64")]
            SimdLevel::Avx512Vnni => x86::legacy_dot_avx512::<F, NT>,
            _ => dot_scalar::<F, NT>,
        }
    }
}

/// Integer dot of one block's codes with activation codes.
fn block_idot<F: LegacyFormat>(codes: &[u8; QK], y: &[i8]) -> i32 {
    codes
        .iter()
        .zip(y)
        .map(|(&c, &y)| if F::SIGNED { c as i8 as i32 } else { c as i32 } * y as i32)
        .sum()
}

fn dot_scalar<F: LegacyFormat, const NT: usize>(row: &[u8], acts: &ActQ8, t0: usize) -> [f32; NT] {
    check_row(
        F::DTYPE,
        row,
        acts.blocks() * F::BYTES,
        t0,
        NT,
        acts.n_tokens(),
    );
    std::array::from_fn(|i| {
        let (qs, ds) = acts.token(t0 + i);
        let (mut main, mut min) = (0f32, 0f32);
        for ((block, y), &[da, sa]) in row.chunks_exact(F::BYTES).zip(qs.chunks_exact(QK)).zip(ds) {
            let bits = F::scale_bits(block);
            let d = f16::from_bits(bits as u16).to_f32();
            let c = f16::from_bits((bits >> 16) as u16).to_f32();
            main += (d * da) * block_idot::<F>(&F::codes(block), y) as f32;
            min += c * sa;
        }
        main + F::MIN_FACTOR * min
    })
}
