//! GGML tensor element types as stored in GGUF files.

/// Elements per super-block of the k-quants.
pub const QK_K: usize = 256;

/// A GGML tensor type, with its GGUF numeric id.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(u32)]
#[allow(non_camel_case_types)]
pub enum GgmlType {
    F32 = 0,
    F16 = 1,
    Q4_0 = 2,
    Q4_1 = 3,
    Q5_0 = 6,
    Q5_1 = 7,
    Q8_0 = 8,
    Q8_1 = 9,
    Q2_K = 10,
    Q3_K = 11,
    Q4_K = 12,
    Q5_K = 13,
    Q6_K = 14,
    Q8_K = 15,
    BF16 = 30,
}

impl GgmlType {
    pub const ALL: [GgmlType; 15] = [
        Self::F32, Self::F16, Self::Q4_0, Self::Q4_1, Self::Q5_0, Self::Q5_1, Self::Q8_0,
        Self::Q8_1, Self::Q2_K, Self::Q3_K, Self::Q4_K, Self::Q5_K, Self::Q6_K, Self::Q8_K,
        Self::BF16,
    ];

    /// The type for a GGUF type id; `None` for ids ferrite does not know.
    pub fn from_u32(id: u32) -> Option<Self> {
        Self::ALL.iter().copied().find(|t| *t as u32 == id)
    }

    /// Elements per block (1 for plain float types).
    pub const fn block_size(self) -> usize {
        match self {
            Self::F32 | Self::F16 | Self::BF16 => 1,
            Self::Q4_0 | Self::Q4_1 | Self::Q5_0 | Self::Q5_1 | Self::Q8_0 | Self::Q8_1 => 32,
            Self::Q2_K | Self::Q3_K | Self::Q4_K | Self::Q5_K | Self::Q6_K | Self::Q8_K => QK_K,
        }
    }

    /// Bytes per block.
    pub const fn type_size(self) -> usize {
        use crate::blocks::*;
        use std::mem::size_of;
        match self {
            Self::F32 => 4,
            Self::F16 | Self::BF16 => 2,
            Self::Q4_0 => size_of::<BlockQ4_0>(),
            Self::Q4_1 => size_of::<BlockQ4_1>(),
            Self::Q5_0 => size_of::<BlockQ5_0>(),
            Self::Q5_1 => size_of::<BlockQ5_1>(),
            Self::Q8_0 => size_of::<BlockQ8_0>(),
            Self::Q8_1 => size_of::<BlockQ8_1>(),
            Self::Q2_K => size_of::<BlockQ2K>(),
            Self::Q3_K => size_of::<BlockQ3K>(),
            Self::Q4_K => size_of::<BlockQ4K>(),
            Self::Q5_K => size_of::<BlockQ5K>(),
            Self::Q6_K => size_of::<BlockQ6K>(),
            Self::Q8_K => size_of::<BlockQ8K>(),
        }
    }

    /// Bytes of a row of `n` elements, or `None` if `n` is not a whole number of blocks
    /// or the size overflows.
    pub fn row_bytes(self, n: usize) -> Option<usize> {
        if !n.is_multiple_of(self.block_size()) {
            return None;
        }
        (n / self.block_size()).checked_mul(self.type_size())
    }

    pub const fn name(self) -> &'static str {
        match self {
            Self::F32 => "F32",
            Self::F16 => "F16",
            Self::Q4_0 => "Q4_0",
            Self::Q4_1 => "Q4_1",
            Self::Q5_0 => "Q5_0",
            Self::Q5_1 => "Q5_1",
            Self::Q8_0 => "Q8_0",
            Self::Q8_1 => "Q8_1",
            Self::Q2_K => "Q2_K",
            Self::Q3_K => "Q3_K",
            Self::Q4_K => "Q4_K",
            Self::Q5_K => "Q5_K",
            Self::Q6_K => "Q6_K",
            Self::Q8_K => "Q8_K",
            Self::BF16 => "BF16",
        }
    }

    /// Parse a name as printed by [`GgmlType::name`] (case-insensitive).
    pub fn from_name(s: &str) -> Option<Self> {
        Self::ALL.iter().copied().find(|t| t.name().eq_ignore_ascii_case(s))
    }

    pub const fn is_quantized(self) -> bool {
        !matches!(self, Self::F32 | Self::F16 | Self::BF16)
    }
}

impl std::fmt::Display for GgmlType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}
