//! The k-quants: super-blocks of 256 weights split in sub-blocks of 16 or 32, each with its own
//! quantized scale (and min), the scales themselves scaled by the f16 `d` (and `dmin`).
//!
//! The quantizers follow ggml's `quantize_row_*_ref` algorithms (search for the best scale/min
//! per sub-block, quantize the scales, then requantize the weights against the stored scales).

use super::{nearest_int, signed_absmax, QuantBlock};
use crate::blocks::*;
use crate::dtype::{GgmlType, QK_K};
use half::f16;

/// Sub-blocks whose largest magnitude is below this are treated as all zero (ggml's
/// `GROUP_MAX_EPS`).
const GROUP_MAX_EPS: f32 = 1e-15;

/// Scale and min of sub-block `j` (of 8) from the 12-byte 6-bit packing of Q4_K/Q5_K
/// (ggml's `get_scale_min_k4`).
fn scale_min_k4(j: usize, s: &[u8; K_SCALE_SIZE]) -> (u8, u8) {
    if j < 4 {
        (s[j] & 63, s[j + 4] & 63)
    } else {
        ((s[j + 4] & 0x0F) | ((s[j - 4] >> 6) << 4), (s[j + 4] >> 4) | ((s[j] >> 6) << 4))
    }
}

/// Inverse of [`scale_min_k4`] for 8 scales and mins of at most 6 bits.
fn pack_scale_min_k4(scales: &[u8; 8], mins: &[u8; 8]) -> [u8; K_SCALE_SIZE] {
    let mut s = [0u8; K_SCALE_SIZE];
    for j in 0..8 {
        let (ls, lm) = (scales[j], mins[j]);
        if j < 4 {
            s[j] = ls;
            s[j + 4] = lm;
        } else {
            s[j + 4] = (ls & 0x0F) | ((lm & 0x0F) << 4);
            s[j - 4] |= (ls >> 4) << 6;
            s[j] |= (lm >> 4) << 6;
        }
    }
    s
}

/// The 16 signed 6-bit scales of Q3_K (stored biased by 32): low nibbles in bytes 0..8
/// (sub-blocks 0..8 low, 8..16 high nibble), high 2-bit pairs in bytes 8..12.
fn q3k_scales(s: &[u8; 12]) -> [i32; 16] {
    std::array::from_fn(|j| {
        let low = if j < 8 { s[j] & 0x0F } else { s[j - 8] >> 4 };
        let high = (s[8 + j % 4] >> (2 * (j / 4))) & 3;
        i32::from(low | (high << 4)) - 32
    })
}

fn pack_q3k_scales(biased: &[u8; 16]) -> [u8; 12] {
    let mut s = [0u8; 12];
    for (j, &l) in biased.iter().enumerate() {
        if j < 8 {
            s[j] |= l & 0x0F;
        } else {
            s[j - 8] |= (l & 0x0F) << 4;
        }
        s[8 + j % 4] |= (l >> 4) << (2 * (j / 4));
    }
    s
}

/// 2-bit fields as in Q2_K `qs` and Q3_K `qs`: each half of 128 weights uses 32 bytes, weight
/// `128 * h + 32 * k + l` in bits `2k..2k+2` of byte `32 * h + l`.
fn unpack_2bit(qs: &[u8; QK_K / 4]) -> [u8; QK_K] {
    std::array::from_fn(|i| {
        let (h, k, l) = (i / 128, (i % 128) / 32, i % 32);
        (qs[32 * h + l] >> (2 * k)) & 3
    })
}

fn pack_2bit(q: &[u8; QK_K]) -> [u8; QK_K / 4] {
    std::array::from_fn(|b| {
        let (h, l) = (b / 32, b % 32);
        (0..4).fold(0, |acc, k| acc | ((q[128 * h + 32 * k + l] & 3) << (2 * k)))
    })
}

/// 4-bit fields as in Q4_K/Q5_K `qs`: each chunk of 64 weights uses 32 bytes, weight `l` of
/// the chunk in the low nibble of byte `l`, weight `32 + l` in its high nibble.
fn unpack_4bit_chunks(qs: &[u8; QK_K / 2]) -> [u8; QK_K] {
    std::array::from_fn(|i| {
        let (c, k, l) = (i / 64, (i % 64) / 32, i % 32);
        (qs[32 * c + l] >> (4 * k)) & 0x0F
    })
}

fn pack_4bit_chunks(q: &[u8; QK_K]) -> [u8; QK_K / 2] {
    std::array::from_fn(|b| {
        let (c, l) = (b / 32, b % 32);
        (q[64 * c + l] & 0x0F) | ((q[64 * c + 32 + l] & 0x0F) << 4)
    })
}

impl QuantBlock for BlockQ2K {
    const DTYPE: GgmlType = GgmlType::Q2_K;
    fn dequantize(&self, out: &mut [f32]) {
        let (d, dmin) = (self.d.to_f32(), self.dmin.to_f32());
        let q = unpack_2bit(&self.qs);
        for (sub, (out, q)) in out.chunks_exact_mut(16).zip(q.chunks_exact(16)).enumerate() {
            let sc = self.scales[sub];
            let (dl, ml) = (d * f32::from(sc & 0x0F), dmin * f32::from(sc >> 4));
            for (o, &q) in out.iter_mut().zip(q) {
                *o = dl * f32::from(q) - ml;
            }
        }
    }

    fn quantize(x: &[f32]) -> Self {
        let mut l = [0u8; QK_K];
        let mut scales = [0f32; 16];
        let mut mins = [0f32; 16];
        for (sub, x) in x.chunks_exact(16).enumerate() {
            let weights: [f32; 16] = std::array::from_fn(|i| x[i].abs());
            let fit = ScaleMinSearch { nmax: 3, rmin: -0.5, rdelta: 0.1, nstep: 15, use_mad: true };
            (scales[sub], mins[sub]) = fit.run(x, &weights, &mut l[16 * sub..16 * (sub + 1)]);
        }
        let (d, scale_q) = quantize_positive_scales(&scales, 15);
        let (dmin, min_q) = quantize_positive_scales(&mins, 15);
        let packed: [u8; 16] = std::array::from_fn(|j| scale_q[j] | (min_q[j] << 4));
        let (d_f, dmin_f) = (d.to_f32(), dmin.to_f32());
        for (sub, x) in x.chunks_exact(16).enumerate() {
            requantize_with_min(
                x,
                d_f * f32::from(packed[sub] & 0x0F),
                dmin_f * f32::from(packed[sub] >> 4),
                3,
                &mut l[16 * sub..16 * (sub + 1)],
            );
        }
        BlockQ2K { scales: packed, qs: pack_2bit(&l), d, dmin }
    }
}

impl QuantBlock for BlockQ3K {
    const DTYPE: GgmlType = GgmlType::Q3_K;
    fn dequantize(&self, out: &mut [f32]) {
        let d_all = self.d.to_f32();
        let scales = q3k_scales(&self.scales);
        let low = unpack_2bit(&self.qs);
        for (sub, out) in out.chunks_exact_mut(16).enumerate() {
            let dl = d_all * scales[sub] as f32;
            for (k, o) in out.iter_mut().enumerate() {
                let i = 16 * sub + k;
                // The high bit of weight i is bit i/32 of hmask[i % 32]; a clear bit means -4.
                let high_clear = self.hmask[i % 32] & (1 << (i / 32)) == 0;
                let q = i32::from(low[i]) - if high_clear { 4 } else { 0 };
                *o = dl * q as f32;
            }
        }
    }

    fn quantize(x: &[f32]) -> Self {
        // l holds quants biased by 4 (0..8).
        let mut l = [0u8; QK_K];
        let mut scales = [0f32; 16];
        for (sub, x) in x.chunks_exact(16).enumerate() {
            scales[sub] = make_q3_quants(x, 4, &mut l[16 * sub..16 * (sub + 1)]);
        }
        let max_scale = signed_absmax(&scales);
        let (d, packed_scales) = if max_scale != 0.0 {
            let iscale = -32.0 / max_scale;
            let biased: [u8; 16] = std::array::from_fn(|j| {
                (nearest_int(iscale * scales[j]).clamp(-32, 31) + 32) as u8
            });
            (f16::from_f32(1.0 / iscale), pack_q3k_scales(&biased))
        } else {
            (f16::ZERO, [0; 12])
        };
        let decoded = q3k_scales(&packed_scales);
        for (sub, x) in x.chunks_exact(16).enumerate() {
            let dl = d.to_f32() * decoded[sub] as f32;
            if dl != 0.0 {
                for (q, &v) in l[16 * sub..16 * (sub + 1)].iter_mut().zip(x) {
                    *q = (nearest_int(v / dl).clamp(-4, 3) + 4) as u8;
                }
            }
        }
        let mut hmask = [0u8; QK_K / 8];
        for (i, q) in l.iter_mut().enumerate() {
            if *q > 3 {
                hmask[i % 32] |= 1 << (i / 32);
                *q -= 4;
            }
        }
        BlockQ3K { hmask, qs: pack_2bit(&l), scales: packed_scales, d }
    }
}

/// Q4_K and Q5_K weights: `d * scale_j * q - dmin * min_j` over 8 sub-blocks of 32.
fn dequantize_scale_min_k4(
    d: f16,
    dmin: f16,
    scales: &[u8; K_SCALE_SIZE],
    q: &[u8; QK_K],
    out: &mut [f32],
) {
    let (d, dmin) = (d.to_f32(), dmin.to_f32());
    for (sub, (out, q)) in out.chunks_exact_mut(32).zip(q.chunks_exact(32)).enumerate() {
        let (sc, m) = scale_min_k4(sub, scales);
        let (d1, m1) = (d * f32::from(sc), dmin * f32::from(m));
        for (o, &q) in out.iter_mut().zip(q) {
            *o = d1 * f32::from(q) - m1;
        }
    }
}

/// Shared quantizer of Q4_K (`nmax` 15) and Q5_K (`nmax` 31): returns `d`, `dmin`, the packed
/// scales and the quants (0..=nmax).
fn quantize_scale_min_k4(
    x: &[f32],
    fit: ScaleMinSearch,
) -> (f16, f16, [u8; K_SCALE_SIZE], [u8; QK_K]) {
    let mut l = [0u8; QK_K];
    let mut scales = [0f32; 8];
    let mut mins = [0f32; 8];
    for (sub, x) in x.chunks_exact(32).enumerate() {
        let av_x = (x.iter().map(|v| v * v).sum::<f32>() / 32.0).sqrt();
        let weights: [f32; 32] = std::array::from_fn(|i| av_x + x[i].abs());
        (scales[sub], mins[sub]) = fit.run(x, &weights, &mut l[32 * sub..32 * (sub + 1)]);
    }
    let (d, scale_q) = quantize_positive_scales(&scales, 63);
    let (dmin, min_q) = quantize_positive_scales(&mins, 63);
    let packed = pack_scale_min_k4(&scale_q, &min_q);
    for (sub, x) in x.chunks_exact(32).enumerate() {
        let (sc, m) = scale_min_k4(sub, &packed);
        let nmax = fit.nmax as u8;
        requantize_with_min(
            x,
            d.to_f32() * f32::from(sc),
            dmin.to_f32() * f32::from(m),
            nmax,
            &mut l[32 * sub..32 * (sub + 1)],
        );
    }
    (d, dmin, packed, l)
}

impl QuantBlock for BlockQ4K {
    const DTYPE: GgmlType = GgmlType::Q4_K;
    fn dequantize(&self, out: &mut [f32]) {
        dequantize_scale_min_k4(
            self.d,
            self.dmin,
            &self.scales,
            &unpack_4bit_chunks(&self.qs),
            out,
        );
    }

    fn quantize(x: &[f32]) -> Self {
        let fit = ScaleMinSearch { nmax: 15, rmin: -1.0, rdelta: 0.1, nstep: 20, use_mad: false };
        let (d, dmin, scales, l) = quantize_scale_min_k4(x, fit);
        BlockQ4K { d, dmin, scales, qs: pack_4bit_chunks(&l) }
    }
}

impl QuantBlock for BlockQ5K {
    const DTYPE: GgmlType = GgmlType::Q5_K;
    fn dequantize(&self, out: &mut [f32]) {
        // Bit 4 of weight `64c + 32k + l` is bit `2c + k` of qh[l].
        let mut q = unpack_4bit_chunks(&self.qs);
        for (i, v) in q.iter_mut().enumerate() {
            let bit = 2 * (i / 64) + (i % 64) / 32;
            *v += ((self.qh[i % 32] >> bit) & 1) << 4;
        }
        dequantize_scale_min_k4(self.d, self.dmin, &self.scales, &q, out);
    }

    fn quantize(x: &[f32]) -> Self {
        let fit = ScaleMinSearch { nmax: 31, rmin: -0.5, rdelta: 0.1, nstep: 15, use_mad: false };
        let (d, dmin, scales, l) = quantize_scale_min_k4(x, fit);
        let mut qh = [0u8; QK_K / 8];
        for (i, &v) in l.iter().enumerate() {
            qh[i % 32] |= (v >> 4) << (2 * (i / 64) + (i % 64) / 32);
        }
        BlockQ5K { d, dmin, scales, qh, qs: pack_4bit_chunks(&l) }
    }
}

impl QuantBlock for BlockQ6K {
    const DTYPE: GgmlType = GgmlType::Q6_K;
    fn dequantize(&self, out: &mut [f32]) {
        let d = self.d.to_f32();
        for (i, o) in out.iter_mut().enumerate() {
            let q = i32::from(q6k_quant(&self.ql, &self.qh, i)) - 32;
            *o = d * f32::from(self.scales[i / 16]) * q as f32;
        }
    }

    fn quantize(x: &[f32]) -> Self {
        // l holds quants biased by 32 (0..64).
        let mut l = [0u8; QK_K];
        let mut scales = [0f32; 16];
        for (sub, x) in x.chunks_exact(16).enumerate() {
            scales[sub] = make_qx_quants(x, 32, &mut l[16 * sub..16 * (sub + 1)]);
        }
        let max_scale = signed_absmax(&scales);
        if max_scale.abs() < GROUP_MAX_EPS {
            return bytemuck::Zeroable::zeroed();
        }
        let iscale = -128.0 / max_scale;
        let d = f16::from_f32(1.0 / iscale);
        let sc: [i8; 16] =
            std::array::from_fn(|j| nearest_int(iscale * scales[j]).clamp(-128, 127) as i8);
        for (sub, x) in x.chunks_exact(16).enumerate() {
            let dl = d.to_f32() * f32::from(sc[sub]);
            if dl != 0.0 {
                for (q, &v) in l[16 * sub..16 * (sub + 1)].iter_mut().zip(x) {
                    *q = (nearest_int(v / dl).clamp(-32, 31) + 32) as u8;
                }
            }
        }
        let (ql, qh) = pack_q6k(&l);
        BlockQ6K { ql, qh, scales: sc, d }
    }
}

/// Weight `i` of Q6_K (0..64): each half of 128 weights uses 64 `ql` and 32 `qh` bytes; within
/// a half, weight `32k + l` has its low nibble in `ql[l + 32 * (k % 2)]` (high nibble for k ≥ 2)
/// and its top 2 bits in bits `2k..2k+2` of `qh[l]`.
fn q6k_quant(ql: &[u8; QK_K / 2], qh: &[u8; QK_K / 4], i: usize) -> u8 {
    let (h, k, l) = (i / 128, (i % 128) / 32, i % 32);
    let low = (ql[64 * h + 32 * (k % 2) + l] >> (4 * (k / 2))) & 0x0F;
    let high = (qh[32 * h + l] >> (2 * k)) & 3;
    low | (high << 4)
}

fn pack_q6k(q: &[u8; QK_K]) -> ([u8; QK_K / 2], [u8; QK_K / 4]) {
    let mut ql = [0u8; QK_K / 2];
    let mut qh = [0u8; QK_K / 4];
    for (i, &v) in q.iter().enumerate() {
        let (h, k, l) = (i / 128, (i % 128) / 32, i % 32);
        ql[64 * h + 32 * (k % 2) + l] |= (v & 0x0F) << (4 * (k / 2));
        qh[32 * h + l] |= ((v >> 4) & 3) << (2 * k);
    }
    (ql, qh)
}

impl QuantBlock for BlockQ8K {
    const DTYPE: GgmlType = GgmlType::Q8_K;
    fn dequantize(&self, out: &mut [f32]) {
        for (o, &q) in out.iter_mut().zip(&self.qs) {
            *o = self.d * f32::from(q);
        }
    }

    fn quantize(x: &[f32]) -> Self {
        let max = signed_absmax(x);
        if max == 0.0 {
            return bytemuck::Zeroable::zeroed();
        }
        let iscale = -127.0 / max;
        let qs: [i8; QK_K] =
            std::array::from_fn(|j| nearest_int(iscale * x[j]).clamp(-128, 127) as i8);
        let bsums =
            std::array::from_fn(|j| qs[16 * j..16 * (j + 1)].iter().map(|&q| i16::from(q)).sum());
        BlockQ8K { d: 1.0 / iscale, qs, bsums }
    }
}

/// Quantizes non-negative sub-block scales to `0..=nmax` against a common f16 factor
/// `max / nmax`; all-zero scales give factor 0.
fn quantize_positive_scales<const N: usize>(scales: &[f32; N], nmax: i32) -> (f16, [u8; N]) {
    let max = scales.iter().fold(0.0f32, |m, &s| if s > m { s } else { m });
    if max <= 0.0 {
        return (f16::ZERO, [0; N]);
    }
    let inv = nmax as f32 / max;
    let q = std::array::from_fn(|j| nearest_int(inv * scales[j]).clamp(0, nmax) as u8);
    (f16::from_f32(max / nmax as f32), q)
}

/// Requantizes a sub-block against its stored scale `d` and min `m` (`x ≈ d * q - m`),
/// keeping the search's quants when the stored scale is zero.
fn requantize_with_min(x: &[f32], d: f32, m: f32, nmax: u8, l: &mut [u8]) {
    if d == 0.0 {
        return;
    }
    for (q, &v) in l.iter_mut().zip(x) {
        *q = nearest_int((v + m) / d).clamp(0, i32::from(nmax)) as u8;
    }
}

/// ggml's `make_qkx2_quants`: finds `scale` and `min` so that `x ≈ scale * q - min`
/// (`q` in `0..=nmax`, `min ≥ 0`), minimising the weighted error over a sweep of trial scales
/// followed by a least-squares fit of each trial's quants.
#[derive(Clone, Copy)]
struct ScaleMinSearch {
    nmax: i32,
    rmin: f32,
    rdelta: f32,
    nstep: i32,
    /// Minimise absolute rather than squared error.
    use_mad: bool,
}

impl ScaleMinSearch {
    /// Returns `(scale, min)` and writes the quants to `l`; `x` has at most 32 elements.
    fn run(&self, x: &[f32], weights: &[f32], l: &mut [u8]) -> (f32, f32) {
        let mut min = x.iter().copied().fold(x[0], |m, v| if v < m { v } else { m });
        let max = x.iter().copied().fold(x[0], |m, v| if v > m { v } else { m });
        let sum_w: f32 = weights.iter().sum();
        let sum_x: f32 = weights.iter().zip(x).map(|(w, v)| w * v).sum();
        if min > 0.0 {
            min = 0.0;
        }
        if max == min {
            l.fill(0);
            return (0.0, -min);
        }
        let quantize_all = |iscale: f32, min: f32, out: &mut [u8]| {
            for (q, &v) in out.iter_mut().zip(x) {
                *q = nearest_int(iscale * (v - min)).clamp(0, self.nmax) as u8;
            }
        };
        let error = |scale: f32, min: f32, q: &[u8]| -> f32 {
            q.iter()
                .zip(x)
                .zip(weights)
                .map(|((&q, &v), &w)| {
                    let diff = scale * f32::from(q) + min - v;
                    w * if self.use_mad { diff.abs() } else { diff * diff }
                })
                .sum()
        };
        let iscale = self.nmax as f32 / (max - min);
        let mut scale = 1.0 / iscale;
        quantize_all(iscale, min, l);
        let mut best_error = error(scale, min, l);
        let mut trial_buf = [0u8; 32];
        let trial = &mut trial_buf[..x.len()];
        for step in 0..=self.nstep {
            let iscale = (self.rmin + self.rdelta * step as f32 + self.nmax as f32) / (max - min);
            quantize_all(iscale, min, trial);
            let (mut sum_l, mut sum_l2, mut sum_xl) = (0.0f32, 0.0f32, 0.0f32);
            for ((&q, &v), &w) in trial.iter().zip(x).zip(weights) {
                let q = f32::from(q);
                sum_l += w * q;
                sum_l2 += w * q * q;
                sum_xl += w * q * v;
            }
            let det = sum_w * sum_l2 - sum_l * sum_l;
            if det > 0.0 {
                let mut this_scale = (sum_w * sum_xl - sum_x * sum_l) / det;
                let mut this_min = (sum_l2 * sum_x - sum_l * sum_xl) / det;
                if this_min > 0.0 {
                    this_min = 0.0;
                    this_scale = sum_xl / sum_l2;
                }
                let this_error = error(this_scale, this_min, trial);
                if this_error < best_error {
                    l.copy_from_slice(trial);
                    best_error = this_error;
                    scale = this_scale;
                    min = this_min;
                }
            }
        }
        (scale, -min)
    }
}

/// ggml's `make_qx_quants` with weights `x²`: symmetric quants `q` in `-nmax..nmax` (written
/// biased by `nmax`), scale refined by least squares over 19 trial scales. Returns the scale.
fn make_qx_quants(x: &[f32], nmax: i32, l: &mut [u8]) -> f32 {
    let max = signed_absmax(x);
    if max.abs() < GROUP_MAX_EPS {
        l.fill(0);
        return 0.0;
    }
    let sums = |iscale: f32| {
        x.iter().fold((0.0f32, 0.0f32), |(sumlx, suml2), &v| {
            let q = nearest_int(iscale * v).clamp(-nmax, nmax - 1) as f32;
            let w = v * v;
            (sumlx + w * v * q, suml2 + w * q * q)
        })
    };
    let store = |iscale: f32, l: &mut [u8]| {
        for (q, &v) in l.iter_mut().zip(x) {
            *q = (nearest_int(iscale * v).clamp(-nmax, nmax - 1) + nmax) as u8;
        }
    };
    let iscale = -(nmax as f32) / max;
    store(iscale, l);
    let (sumlx, suml2) = sums(iscale);
    let mut scale = if suml2 != 0.0 { sumlx / suml2 } else { 0.0 };
    let mut best = scale * sumlx;
    for step in (-9..=9).filter(|&s| s != 0) {
        let iscale = -(nmax as f32 + 0.1 * step as f32) / max;
        let (sumlx, suml2) = sums(iscale);
        if suml2 > 0.0 && sumlx * sumlx > best * suml2 {
            store(iscale, l);
            scale = sumlx / suml2;
            best = scale * sumlx;
        }
    }
    scale
}

/// ggml's `make_q3_quants` (rmse variant): symmetric quants in `-nmax..nmax` (written biased by
/// `nmax`), then up to 5 passes moving single quants while that improves the weighted
/// (`x²`) least-squares fit. Returns the scale.
fn make_q3_quants(x: &[f32], nmax: i32, l_out: &mut [u8]) -> f32 {
    let max = signed_absmax(x);
    if max.abs() < GROUP_MAX_EPS {
        l_out.fill(0);
        return 0.0;
    }
    let iscale = -(nmax as f32) / max;
    let mut l: Vec<i32> =
        x.iter().map(|&v| nearest_int(iscale * v).clamp(-nmax, nmax - 1)).collect();
    let (mut sumlx, mut suml2) = (0.0f32, 0.0f32);
    for (&v, &q) in x.iter().zip(&l) {
        let w = v * v;
        sumlx += w * v * q as f32;
        suml2 += w * q as f32 * q as f32;
    }
    for _ in 0..5 {
        let mut changed = false;
        for (i, &v) in x.iter().enumerate() {
            let w = v * v;
            let q = l[i] as f32;
            let slx = sumlx - w * v * q;
            if slx > 0.0 {
                let sl2 = suml2 - w * q * q;
                let new_q = nearest_int(v * sl2 / slx).clamp(-nmax, nmax - 1);
                if new_q != l[i] {
                    let slx = slx + w * v * new_q as f32;
                    let sl2 = sl2 + w * new_q as f32 * new_q as f32;
                    if sl2 > 0.0 && slx * slx * suml2 > sumlx * sumlx * sl2 {
                        l[i] = new_q;
                        sumlx = slx;
                        suml2 = sl2;
                        changed = true;
                    }
                }
            }
        }
        if !changed {
            break;
        }
    }
    for (out, q) in l_out.iter_mut().zip(l) {
        *out = (q + nmax) as u8;
    }
    if suml2 > 0.0 {
        sumlx / suml2
    } else {
        0.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scale_min_k4_packing_round_trips() {
        let scales: [u8; 8] = [0, 63, 17, 42, 5, 63, 33, 1];
        let mins: [u8; 8] = [63, 0, 9, 50, 31, 2, 63, 60];
        let packed = pack_scale_min_k4(&scales, &mins);
        for j in 0..8 {
            assert_eq!(scale_min_k4(j, &packed), (scales[j], mins[j]));
        }
    }

    #[test]
    fn q3k_scale_packing_round_trips() {
        let biased: [u8; 16] = std::array::from_fn(|j| ((j * 37 + 5) % 64) as u8);
        let decoded = q3k_scales(&pack_q3k_scales(&biased));
        for j in 0..16 {
            assert_eq!(decoded[j], i32::from(biased[j]) - 32);
        }
    }

    #[test]
    fn bit_packings_round_trip() {
        let q2: [u8; QK_K] = std::array::from_fn(|i| (i * 7 % 4) as u8);
        assert_eq!(unpack_2bit(&pack_2bit(&q2)), q2);
        let q4: [u8; QK_K] = std::array::from_fn(|i| (i * 11 % 16) as u8);
        assert_eq!(unpack_4bit_chunks(&pack_4bit_chunks(&q4)), q4);
        let q6: [u8; QK_K] = std::array::from_fn(|i| (i * 13 % 64) as u8);
        let (ql, qh) = pack_q6k(&q6);
        for (i, &q) in q6.iter().enumerate() {
            assert_eq!(q6k_quant(&ql, &qh, i), q);
        }
    }
}
