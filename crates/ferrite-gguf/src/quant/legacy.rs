//! The 32-weight formats: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q8_1.
//!
//! 4- and 5-bit quants are stored split in halves: byte `j` of `qs` holds element `j` in its low
//! nibble and element `j + 16` in its high nibble; bit `j` of `qh` is bit 4 of element `j`.

use super::{signed_absmax, QuantBlock};
use crate::blocks::*;
use crate::dtype::GgmlType;
use half::f16;

const QK: usize = 32;

fn unpack_nibbles(qs: &[u8; QK / 2]) -> [u8; QK] {
    let mut q = [0; QK];
    for (j, &byte) in qs.iter().enumerate() {
        q[j] = byte & 0x0F;
        q[j + QK / 2] = byte >> 4;
    }
    q
}

fn pack_nibbles(q: &[u8; QK]) -> [u8; QK / 2] {
    std::array::from_fn(|j| q[j] | (q[j + QK / 2] << 4))
}

fn unpack_5bit(qs: &[u8; QK / 2], qh: [u8; 4]) -> [u8; QK] {
    let high = u32::from_le_bytes(qh);
    let mut q = unpack_nibbles(qs);
    for (j, v) in q.iter_mut().enumerate() {
        *v |= (((high >> j) & 1) as u8) << 4;
    }
    q
}

fn pack_5bit(q: &[u8; QK]) -> ([u8; QK / 2], [u8; 4]) {
    let low: [u8; QK] = std::array::from_fn(|j| q[j] & 0x0F);
    let high = q.iter().enumerate().fold(0u32, |acc, (j, &v)| acc | (u32::from(v >> 4) << j));
    (pack_nibbles(&low), high.to_le_bytes())
}

/// Symmetric quantization of ggml's `quantize_row_q{4,5}_0_ref`: `d = max / -(2^(bits-1))`
/// where `max` is the signed value of largest magnitude, `q = trunc(x / d + offset + 0.5)`.
fn quantize_symmetric(x: &[f32], levels: u8) -> (f16, [u8; QK]) {
    let offset = f32::from(levels / 2);
    let d = signed_absmax(x) / -offset;
    let id = if d != 0.0 { 1.0 / d } else { 0.0 };
    let q = std::array::from_fn(|j| {
        ((x[j] * id + offset + 0.5) as i32).clamp(0, i32::from(levels) - 1) as u8
    });
    (f16::from_f32(d), q)
}

/// Asymmetric quantization of `quantize_row_q{4,5}_1_ref`: `x ≈ q * d + min`.
fn quantize_with_min(x: &[f32], levels: u8) -> (f16, f16, [u8; QK]) {
    let (mut min, mut max) = (f32::MAX, -f32::MAX);
    for &v in x {
        if v < min {
            min = v;
        }
        if v > max {
            max = v;
        }
    }
    let d = (max - min) / f32::from(levels - 1);
    let id = if d != 0.0 { 1.0 / d } else { 0.0 };
    let q = std::array::from_fn(|j| {
        (((x[j] - min) * id + 0.5) as i32).clamp(0, i32::from(levels) - 1) as u8
    });
    (f16::from_f32(d), f16::from_f32(min), q)
}

/// `quantize_row_q8_{0,1}_ref`: `d = amax / 127`, `q = round(x / d)` (half away from zero).
fn quantize_8bit(x: &[f32]) -> (f32, [i8; QK]) {
    let amax = x.iter().fold(0.0f32, |m, v| m.max(v.abs()));
    let d = amax / 127.0;
    let id = if d != 0.0 { 1.0 / d } else { 0.0 };
    (d, std::array::from_fn(|j| (x[j] * id).round() as i8))
}

impl QuantBlock for BlockQ4_0 {
    const DTYPE: GgmlType = GgmlType::Q4_0;
    fn dequantize(&self, out: &mut [f32]) {
        let d = self.d.to_f32();
        for (o, q) in out.iter_mut().zip(unpack_nibbles(&self.qs)) {
            *o = (i32::from(q) - 8) as f32 * d;
        }
    }
    fn quantize(x: &[f32]) -> Self {
        let (d, q) = quantize_symmetric(x, 16);
        BlockQ4_0 { d, qs: pack_nibbles(&q) }
    }
}

impl QuantBlock for BlockQ4_1 {
    const DTYPE: GgmlType = GgmlType::Q4_1;
    fn dequantize(&self, out: &mut [f32]) {
        let (d, m) = (self.d.to_f32(), self.m.to_f32());
        for (o, q) in out.iter_mut().zip(unpack_nibbles(&self.qs)) {
            *o = f32::from(q) * d + m;
        }
    }
    fn quantize(x: &[f32]) -> Self {
        let (d, m, q) = quantize_with_min(x, 16);
        BlockQ4_1 { d, m, qs: pack_nibbles(&q) }
    }
}

impl QuantBlock for BlockQ5_0 {
    const DTYPE: GgmlType = GgmlType::Q5_0;
    fn dequantize(&self, out: &mut [f32]) {
        let d = self.d.to_f32();
        for (o, q) in out.iter_mut().zip(unpack_5bit(&self.qs, self.qh)) {
            *o = (i32::from(q) - 16) as f32 * d;
        }
    }
    fn quantize(x: &[f32]) -> Self {
        let (d, q) = quantize_symmetric(x, 32);
        let (qs, qh) = pack_5bit(&q);
        BlockQ5_0 { d, qh, qs }
    }
}

impl QuantBlock for BlockQ5_1 {
    const DTYPE: GgmlType = GgmlType::Q5_1;
    fn dequantize(&self, out: &mut [f32]) {
        let (d, m) = (self.d.to_f32(), self.m.to_f32());
        for (o, q) in out.iter_mut().zip(unpack_5bit(&self.qs, self.qh)) {
            *o = f32::from(q) * d + m;
        }
    }
    fn quantize(x: &[f32]) -> Self {
        let (d, m, q) = quantize_with_min(x, 32);
        let (qs, qh) = pack_5bit(&q);
        BlockQ5_1 { d, m, qh, qs }
    }
}

impl QuantBlock for BlockQ8_0 {
    const DTYPE: GgmlType = GgmlType::Q8_0;
    fn dequantize(&self, out: &mut [f32]) {
        let d = self.d.to_f32();
        for (o, &q) in out.iter_mut().zip(&self.qs) {
            *o = f32::from(q) * d;
        }
    }
    fn quantize(x: &[f32]) -> Self {
        let (d, qs) = quantize_8bit(x);
        BlockQ8_0 { d: f16::from_f32(d), qs }
    }
}

/// ggml has no `dequantize_row_q8_1` (Q8_1 only feeds dot products); the values are `q * d`,
/// `s` being a derived sum.
impl QuantBlock for BlockQ8_1 {
    const DTYPE: GgmlType = GgmlType::Q8_1;
    fn dequantize(&self, out: &mut [f32]) {
        let d = self.d.to_f32();
        for (o, &q) in out.iter_mut().zip(&self.qs) {
            *o = f32::from(q) * d;
        }
    }
    fn quantize(x: &[f32]) -> Self {
        let (d, qs) = quantize_8bit(x);
        let sum: i32 = qs.iter().map(|&q| i32::from(q)).sum();
        BlockQ8_1 { d: f16::from_f32(d), s: f16::from_f32(sum as f32 * d), qs }
    }
}
