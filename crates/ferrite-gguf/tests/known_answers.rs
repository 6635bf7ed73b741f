//! Known-answer dequantization vectors built by hand from the GGML format definitions
//! (ggml-common.h layouts, ggml-quants.c `dequantize_row_*` formulas): each block has chosen
//! scales and quants, and the expected f32 values are written out, compared bitwise.

use bytemuck::bytes_of;
use ferrite_gguf::blocks::*;
use ferrite_gguf::{dequantize, GgmlType};
use half::f16;

fn h(x: f32) -> f16 {
    f16::from_f32(x)
}

fn run(dtype: GgmlType, bytes: &[u8]) -> Vec<f32> {
    let mut out = vec![f32::NAN; dtype.block_size() * bytes.len() / dtype.type_size()];
    dequantize(dtype, bytes, &mut out).unwrap();
    out
}

fn assert_bits(actual: &[f32], expected: &[f32]) {
    assert_eq!(actual.len(), expected.len());
    for (i, (a, e)) in actual.iter().zip(expected).enumerate() {
        assert_eq!(a.to_bits(), e.to_bits(), "element {i}: got {a:?}, expected {e:?}");
    }
}

/// `base` everywhere except at the listed positions.
fn sparse(n: usize, base: impl Fn(usize) -> f32, points: &[(usize, f32)]) -> Vec<f32> {
    let mut v: Vec<f32> = (0..n).map(base).collect();
    for &(i, x) in points {
        v[i] = x;
    }
    v
}

#[test]
fn float_types() {
    let f32s = [1.5f32, -0.0, f32::INFINITY, 1e-45, -3.25e38];
    let bytes: Vec<u8> = f32s.iter().flat_map(|v| v.to_le_bytes()).collect();
    assert_bits(&run(GgmlType::F32, &bytes), &f32s);

    let f16_bits: [u16; 6] = [0x3C00, 0xC000, 0x0001, 0x7C00, 0x3555, 0x8000];
    let bytes: Vec<u8> = f16_bits.iter().flat_map(|v| v.to_le_bytes()).collect();
    assert_bits(
        &run(GgmlType::F16, &bytes),
        &[1.0, -2.0, 5.960_464_5e-8, f32::INFINITY, 0.333_251_95, -0.0],
    );

    let bf16_bits: [u16; 5] = [0x3F80, 0xC040, 0x3EAB, 0xFF80, 0x0001];
    let bytes: Vec<u8> = bf16_bits.iter().flat_map(|v| v.to_le_bytes()).collect();
    assert_bits(
        &run(GgmlType::BF16, &bytes),
        &[1.0, -3.0, 0.333_984_38, f32::NEG_INFINITY, f32::from_bits(0x0001_0000)],
    );
}

/// Byte j holds element j (low nibble) and element j + 16 (high nibble).
fn nibbles_0_to_15_and_15_to_0() -> [u8; 16] {
    std::array::from_fn(|j| j as u8 | ((15 - j as u8) << 4))
}

#[test]
fn q4_0() {
    let b = BlockQ4_0 { d: h(0.5), qs: nibbles_0_to_15_and_15_to_0() };
    // x = (q - 8) * d
    let expected = [
        -4.0, -3.5, -3.0, -2.5, -2.0, -1.5, -1.0, -0.5, 0.0, 0.5, 1.0, 1.5, 2.0, 2.5, 3.0,
        3.5, //
        3.5, 3.0, 2.5, 2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -1.5, -2.0, -2.5, -3.0, -3.5, -4.0,
    ];
    assert_bits(&run(GgmlType::Q4_0, bytes_of(&b)), &expected);
}

#[test]
fn q4_1() {
    let b = BlockQ4_1 { d: h(0.25), m: h(-1.0), qs: nibbles_0_to_15_and_15_to_0() };
    // x = q * d + m
    let expected = [
        -1.0, -0.75, -0.5, -0.25, 0.0, 0.25, 0.5, 0.75, 1.0, 1.25, 1.5, 1.75, 2.0, 2.25, 2.5,
        2.75, //
        2.75, 2.5, 2.25, 2.0, 1.75, 1.5, 1.25, 1.0, 0.75, 0.5, 0.25, 0.0, -0.25, -0.5, -0.75, -1.0,
    ];
    assert_bits(&run(GgmlType::Q4_1, bytes_of(&b)), &expected);
}

#[test]
fn q5_0_and_q5_1() {
    // qh = 0xAAAA_5555 little-endian: bit 4 set for even elements 0..16 and odd elements 16..32.
    let qh = 0xAAAA_5555u32.to_le_bytes();
    let qs = nibbles_0_to_15_and_15_to_0();
    let q5: [f32; 32] = [
        16.0, 1.0, 18.0, 3.0, 20.0, 5.0, 22.0, 7.0, 24.0, 9.0, 26.0, 11.0, 28.0, 13.0, 30.0,
        15.0, //
        15.0, 30.0, 13.0, 28.0, 11.0, 26.0, 9.0, 24.0, 7.0, 22.0, 5.0, 20.0, 3.0, 18.0, 1.0, 16.0,
    ];
    let b = BlockQ5_0 { d: h(2.0), qh, qs };
    let expected: Vec<f32> = q5.iter().map(|q| (q - 16.0) * 2.0).collect();
    assert_bits(&run(GgmlType::Q5_0, bytes_of(&b)), &expected);
    let b = BlockQ5_1 { d: h(0.5), m: h(-3.0), qh, qs };
    let expected: Vec<f32> = q5.iter().map(|q| q * 0.5 - 3.0).collect();
    assert_bits(&run(GgmlType::Q5_1, bytes_of(&b)), &expected);
}

#[test]
fn q8_0_q8_1_q8_k() {
    let qs: [i8; 32] = std::array::from_fn(|j| [-128, 127, -1, 0, 5][j % 5]);
    let expected: Vec<f32> = (0..32).map(|j| [-16.0, 15.875, -0.125, 0.0, 0.625][j % 5]).collect();
    let b = BlockQ8_0 { d: h(0.125), qs };
    assert_bits(&run(GgmlType::Q8_0, bytes_of(&b)), &expected);
    let b = BlockQ8_1 { d: h(0.125), s: h(1234.0), qs };
    assert_bits(&run(GgmlType::Q8_1, bytes_of(&b)), &expected);

    let mut qs = [0i8; 256];
    qs[..3].copy_from_slice(&[-128, 127, 3]);
    let b = BlockQ8K { d: 0.5, qs, bsums: [0; 16] };
    assert_bits(
        &run(GgmlType::Q8_K, bytes_of(&b)),
        &sparse(256, |_| 0.0, &[(0, -64.0), (1, 63.5), (2, 1.5)]),
    );
}

#[test]
fn q2_k() {
    // Every sub-block of 16: scale 1, min 1, except sub-block 5: scale 2, min 3.
    let mut scales = [0x11u8; 16];
    scales[5] = 0x32;
    // qs[33]: second half (weights 128..256), lane 1, so weights 129, 161, 193, 225 get the
    // 2-bit fields 0, 1, 2, 3.
    let mut qs = [0u8; 64];
    qs[33] = 0b11_10_01_00;
    let b = BlockQ2K { scales, qs, d: h(2.0), dmin: h(1.0) };
    // x = d * scale * q - dmin * min
    let expected = sparse(
        256,
        |i| if (80..96).contains(&i) { -3.0 } else { -1.0 },
        &[(129, -1.0), (161, 1.0), (193, 3.0), (225, 5.0)],
    );
    assert_bits(&run(GgmlType::Q2_K, bytes_of(&b)), &expected);
}

#[test]
fn q3_k() {
    // 6-bit scales biased by 32: all 33 (+1) except sub-block 9 = 0 (-32), sub-block 15 = 63 (+31).
    // Low nibbles: sub-blocks 0..8 in the low nibbles of bytes 0..8, 8..16 in the high nibbles;
    // high 2 bits of sub-block j at bits 2*(j/4) of byte 8 + j%4.
    let scales = [0x11, 0x01, 0x11, 0x11, 0x11, 0x11, 0x11, 0xF1, 0xAA, 0x8A, 0xAA, 0xEA];
    // hmask bit (i / 32) of byte (i % 32) set means "no -4"; clear it only for weight 67.
    let mut hmask = [0xFFu8; 32];
    hmask[3] &= !(1 << 2);
    let mut qs = [0u8; 64];
    qs[3] = 0b01_11_10_00; // weights 3, 35, 67, 99 get 0, 2, 3, 1
    qs[32 + 16] = 0b01; // weight 144 (sub-block 9) gets 1
    qs[63] = 0b11 << 6; // weight 255 (sub-block 15) gets 3
    let b = BlockQ3K { hmask, qs, scales, d: h(0.5) };
    // x = d * (scale - 32) * (q - (hmask bit ? 0 : 4)); zero quants keep the sign of the scale.
    let expected = sparse(
        256,
        |i| if (144..160).contains(&i) { -0.0 } else { 0.0 },
        &[(35, 1.0), (67, -0.5), (99, 0.5), (144, -16.0), (255, 46.5)],
    );
    assert_bits(&run(GgmlType::Q3_K, bytes_of(&b)), &expected);
}

/// Scales [1, 63, 3, 4, 5, 40, 7, 8] and mins [0, 17, 2, 3, 4, 50, 6, 7] in the 12-byte packing:
/// sub-blocks 0..4 in the low 6 bits of bytes 0..4 (scales) and 4..8 (mins); sub-blocks 4..8
/// as nibbles in bytes 8..12 with their top 2 bits in bits 6..8 of bytes 0..4 / 4..8.
const K4_SCALES: [u8; 12] =
    [0x01, 0xBF, 0x03, 0x04, 0x00, 0xD1, 0x02, 0x03, 0x45, 0x28, 0x67, 0x78];
const K4_MINS: [f32; 8] = [0.0, 17.0, 2.0, 3.0, 4.0, 50.0, 6.0, 7.0];

#[test]
fn q4_k() {
    // qs[69]: chunk 2 (weights 128..192), lane 5: weight 133 gets the low nibble (10), weight 165
    // the high one (9).
    let mut qs = [0u8; 128];
    qs[69] = 0x9A;
    let b = BlockQ4K { d: h(1.0), dmin: h(0.5), scales: K4_SCALES, qs };
    // x = d * scale * q - dmin * min
    let expected = sparse(
        256,
        |i| 0.0 - 0.5 * K4_MINS[i / 32],
        &[(133, 5.0 * 10.0 - 2.0), (165, 40.0 * 9.0 - 25.0)],
    );
    assert_bits(&run(GgmlType::Q4_K, bytes_of(&b)), &expected);
}

#[test]
fn q5_k() {
    let mut qs = [0u8; 128];
    qs[69] = 0x9A;
    // Bit 2c + k of qh[l] is bit 4 of weight 64c + 32k + l: set it for weights 0, 133 and 165.
    let mut qh = [0u8; 32];
    qh[0] = 0b1;
    qh[5] = 0b11_0000;
    let b = BlockQ5K { d: h(1.0), dmin: h(0.5), scales: K4_SCALES, qh, qs };
    let expected = sparse(
        256,
        |i| 0.0 - 0.5 * K4_MINS[i / 32],
        &[(0, 16.0), (133, 5.0 * 26.0 - 2.0), (165, 40.0 * 25.0 - 25.0)],
    );
    assert_bits(&run(GgmlType::Q5_K, bytes_of(&b)), &expected);
}

#[test]
fn q6_k() {
    // Scales: 1 except sub-block 3 = -2, 9 = 127, 15 = -128.
    let mut scales = [1i8; 16];
    scales[3] = -2;
    scales[9] = 127;
    scales[15] = -128;
    // Default quant 32 (value 0): low nibble 0, high bits 2 (qh = 0b10 in every 2-bit field).
    let mut ql = [0u8; 128];
    let mut qh = [0xAAu8; 64];
    // Half 0, lane 5: weight 5 = ql[5] low | qh[5] bits 0-1, weight 37 = ql[37] low | bits 2-3,
    // weight 69 = ql[5] high | bits 4-5, weight 101 = ql[37] high | bits 6-7.
    ql[5] = 0x57;
    ql[37] = 0x0F;
    qh[5] = 0b10_00_11_10;
    ql[48] = 0x03; // weight 48 (sub-block 3): q = 35
    ql[64 + 16] = 0x01; // weight 144 (half 1, sub-block 9): q = 33
    qh[63] = 0b00_10_10_10; // weight 255 (sub-block 15): q = 0
    let b = BlockQ6K { ql, qh, scales, d: h(0.25) };
    // x = d * scale * (q - 32)
    let expected = sparse(
        256,
        |i| if matches!(i / 16, 3 | 15) { -0.0 } else { 0.0 },
        &[(5, 1.75), (37, 7.75), (69, -6.75), (48, -1.5), (144, 31.75), (255, 1024.0)],
    );
    assert_bits(&run(GgmlType::Q6_K, bytes_of(&b)), &expected);
}

#[test]
fn several_blocks_are_independent() {
    let a = BlockQ4_0 { d: h(0.5), qs: nibbles_0_to_15_and_15_to_0() };
    let b = BlockQ4_0 { d: h(-2.0), qs: [0x88; 16] };
    let mut bytes = bytes_of(&a).to_vec();
    bytes.extend_from_slice(bytes_of(&b));
    let out = run(GgmlType::Q4_0, &bytes);
    assert_bits(&out[..32], &run(GgmlType::Q4_0, bytes_of(&a)));
    assert_bits(&out[32..], &[-0.0; 32]);
}
