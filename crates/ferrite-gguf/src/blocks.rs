//! Block layouts of the quantized GGML types, byte-for-byte as in ggml's `ggml-common.h`.
//!
//! All structs are `#[repr(C)]`, alignment 1 or 2 and `Pod`, so a tensor's bytes can be viewed as
//! a slice of blocks with `bytemuck::try_cast_slice` (f16 fields force 2-byte alignment; use
//! `bytemuck::pod_read_unaligned` or copy when the data is not 2-byte aligned).

use crate::dtype::QK_K;
use bytemuck::{Pod, Zeroable};
use half::f16;

/// Size of the packed 6-bit scales/mins of Q4_K/Q5_K (8 scales + 8 mins, 6 bits each).
pub const K_SCALE_SIZE: usize = 12;

/// 32 weights, `x = (q - 8) * d`; `qs[i]` low nibble is element `i`, high nibble element `i + 16`.
#[derive(Clone, Copy, Debug, Pod, Zeroable)]
#[repr(C)]
pub struct BlockQ4_0 {
    pub d: f16,
    pub qs: [u8; 16],
}

/// 32 weights, `x = q * d + m`; nibble order as [`BlockQ4_0`].
#[derive(Clone, Copy, Debug, Pod, Zeroable)]
#[repr(C)]
pub struct BlockQ4_1 {
    pub d: f16,
    pub m: f16,
    pub qs: [u8; 16],
}

/// 32 weights, 5 bits: low 4 bits in `qs` (as Q4_0), bit 4 of element `j` in bit `j` of `qh`
/// (little-endian u32); `x = (q - 16) * d`.
#[derive(Clone, Copy, Debug, Pod, Zeroable)]
#[repr(C)]
pub struct BlockQ5_0 {
    pub d: f16,
    pub qh: [u8; 4],
    pub qs: [u8; 16],
}

/// As [`BlockQ5_0`] with a min: `x = q * d + m`.
#[derive(Clone, Copy, Debug, Pod, Zeroable)]
#[repr(C)]
pub struct BlockQ5_1 {
    pub d: f16,
    pub m: f16,
    pub qh: [u8; 4],
    pub qs: [u8; 16],
}

/// 32 weights, `x = q * d`.
#[derive(Clone, Copy, Debug, Pod, Zeroable)]
#[repr(C)]
pub struct BlockQ8_0 {
    pub d: f16,
    pub qs: [i8; 32],
}

/// 32 weights, `x = q * d`, plus `s = d * sum(q)` (used by dot products with Q4_1/Q5_1).
#[derive(Clone, Copy, Debug, Pod, Zeroable)]
#[repr(C)]
pub struct BlockQ8_1 {
    pub d: f16,
    pub s: f16,
    pub qs: [i8; 32],
}

/// 256 weights in 16 groups of 16, 2 bits each; 4-bit scale and 4-bit min per group.
#[derive(Clone, Copy, Debug, Pod, Zeroable)]
#[repr(C)]
pub struct BlockQ2K {
    pub scales: [u8; QK_K / 16],
    pub qs: [u8; QK_K / 4],
    pub d: f16,
    pub dmin: f16,
}

/// 256 weights, 3 bits (2 low bits in `qs`, high bit in `hmask`), 6-bit scales packed in 12 bytes.
#[derive(Clone, Copy, Debug, Pod, Zeroable)]
#[repr(C)]
pub struct BlockQ3K {
    pub hmask: [u8; QK_K / 8],
    pub qs: [u8; QK_K / 4],
    pub scales: [u8; 12],
    pub d: f16,
}

/// 256 weights in 8 groups of 32, 4 bits; 6-bit scale and min per group.
#[derive(Clone, Copy, Debug, Pod, Zeroable)]
#[repr(C)]
pub struct BlockQ4K {
    pub d: f16,
    pub dmin: f16,
    pub scales: [u8; K_SCALE_SIZE],
    pub qs: [u8; QK_K / 2],
}

/// 256 weights in 8 groups of 32, 5 bits (high bit in `qh`); 6-bit scale and min per group.
#[derive(Clone, Copy, Debug, Pod, Zeroable)]
#[repr(C)]
pub struct BlockQ5K {
    pub d: f16,
    pub dmin: f16,
    pub scales: [u8; K_SCALE_SIZE],
    pub qh: [u8; QK_K / 8],
    pub qs: [u8; QK_K / 2],
}

/// 256 weights in 16 groups of 16, 6 bits (low 4 in `ql`, high 2 in `qh`), i8 scale per group.
#[derive(Clone, Copy, Debug, Pod, Zeroable)]
#[repr(C)]
pub struct BlockQ6K {
    pub ql: [u8; QK_K / 2],
    pub qh: [u8; QK_K / 4],
    pub scales: [i8; QK_K / 16],
    pub d: f16,
}

/// 256 weights, `x = q * d` with an f32 scale, plus the sums of each group of 16 (for k-quant dots).
#[derive(Clone, Copy, Debug, Pod, Zeroable)]
#[repr(C)]
pub struct BlockQ8K {
    pub d: f32,
    pub qs: [i8; QK_K],
    pub bsums: [i16; QK_K / 16],
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::mem::size_of;

    /// Sizes from ggml-common.h's static asserts.
    #[test]
    fn block_sizes_match_ggml() {
        assert_eq!(size_of::<BlockQ4_0>(), 18);
        assert_eq!(size_of::<BlockQ4_1>(), 20);
        assert_eq!(size_of::<BlockQ5_0>(), 22);
        assert_eq!(size_of::<BlockQ5_1>(), 24);
        assert_eq!(size_of::<BlockQ8_0>(), 34);
        assert_eq!(size_of::<BlockQ8_1>(), 36);
        assert_eq!(size_of::<BlockQ2K>(), 84);
        assert_eq!(size_of::<BlockQ3K>(), 110);
        assert_eq!(size_of::<BlockQ4K>(), 144);
        assert_eq!(size_of::<BlockQ5K>(), 176);
        assert_eq!(size_of::<BlockQ6K>(), 210);
        assert_eq!(size_of::<BlockQ8K>(), 292);
    }
}
