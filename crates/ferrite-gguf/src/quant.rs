//! Dequantization, bit-exact with ggml's `dequantize_row_*` (same f32 operations in the same
//! order), and reference quantization following ggml's `quantize_row_*_ref` algorithms.

mod kquants;
mod legacy;

use crate::blocks::*;
use crate::dtype::GgmlType;
use crate::error::GgufError;
use crate::reader::{GgufFile, TensorInfo};
use bytemuck::Pod;
use half::{bf16, f16};

/// One block of a GGML type: `DTYPE.block_size()` weights stored in `size_of::<Self>()` bytes.
/// Plain float types are "blocks" of one element.
pub trait QuantBlock: Pod {
    const DTYPE: GgmlType;

    /// Writes the block's `DTYPE.block_size()` weights to `out` (exactly that long).
    fn dequantize(&self, out: &mut [f32]);

    /// Reference quantization of `DTYPE.block_size()` weights (`x` is exactly that long).
    fn quantize(x: &[f32]) -> Self;
}

impl QuantBlock for f32 {
    const DTYPE: GgmlType = GgmlType::F32;
    fn dequantize(&self, out: &mut [f32]) {
        out[0] = *self;
    }
    fn quantize(x: &[f32]) -> Self {
        x[0]
    }
}

/// The half-precision types convert with round-to-nearest-even, as ggml does (`half` quiets
/// NaNs the same way as ggml's `fp32_to_bf16`).
macro_rules! half_block {
    ($ty:ty, $dtype:ident) => {
        impl QuantBlock for $ty {
            const DTYPE: GgmlType = GgmlType::$dtype;
            fn dequantize(&self, out: &mut [f32]) {
                out[0] = self.to_f32();
            }
            fn quantize(x: &[f32]) -> Self {
                <$ty>::from_f32(x[0])
            }
        }
    };
}
half_block!(f16, F16);
half_block!(bf16, BF16);

/// Runs `$body` with `$B` bound to the block type of `$dtype`.
macro_rules! with_block_type {
    ($dtype:expr, $B:ident => $body:expr) => {
        match $dtype {
            GgmlType::F32 => {
                type $B = f32;
                $body
            }
            GgmlType::F16 => {
                type $B = f16;
                $body
            }
            GgmlType::BF16 => {
                type $B = bf16;
                $body
            }
            GgmlType::Q4_0 => {
                type $B = BlockQ4_0;
                $body
            }
            GgmlType::Q4_1 => {
                type $B = BlockQ4_1;
                $body
            }
            GgmlType::Q5_0 => {
                type $B = BlockQ5_0;
                $body
            }
            GgmlType::Q5_1 => {
                type $B = BlockQ5_1;
                $body
            }
            GgmlType::Q8_0 => {
                type $B = BlockQ8_0;
                $body
            }
            GgmlType::Q8_1 => {
                type $B = BlockQ8_1;
                $body
            }
            GgmlType::Q2_K => {
                type $B = BlockQ2K;
                $body
            }
            GgmlType::Q3_K => {
                type $B = BlockQ3K;
                $body
            }
            GgmlType::Q4_K => {
                type $B = BlockQ4K;
                $body
            }
            GgmlType::Q5_K => {
                type $B = BlockQ5K;
                $body
            }
            GgmlType::Q6_K => {
                type $B = BlockQ6K;
                $body
            }
            GgmlType::Q8_K => {
                type $B = BlockQ8K;
                $body
            }
        }
    };
}

fn check_block_multiple(dtype: GgmlType, n_elements: usize) -> Result<(), GgufError> {
    if !n_elements.is_multiple_of(dtype.block_size()) {
        return Err(GgufError::NotBlockMultiple {
            dtype,
            n_elements,
            block_size: dtype.block_size(),
        });
    }
    Ok(())
}

/// Dequantizes `out.len()` elements of type `dtype` from `data`, which must be exactly
/// `dtype.row_bytes(out.len())` bytes (any alignment).
pub fn dequantize(dtype: GgmlType, data: &[u8], out: &mut [f32]) -> Result<(), GgufError> {
    check_block_multiple(dtype, out.len())?;
    let expected = dtype.row_bytes(out.len()).expect("block multiple checked above");
    if data.len() != expected {
        return Err(GgufError::DataSize {
            dtype,
            n_elements: out.len(),
            expected,
            actual: data.len(),
        });
    }
    with_block_type!(dtype, B => dequantize_blocks::<B>(data, out));
    Ok(())
}

fn dequantize_blocks<B: QuantBlock>(data: &[u8], out: &mut [f32]) {
    let blocks = data.chunks_exact(std::mem::size_of::<B>());
    for (raw, out) in blocks.zip(out.chunks_exact_mut(B::DTYPE.block_size())) {
        bytemuck::pod_read_unaligned::<B>(raw).dequantize(out);
    }
}

/// Dequantizes a whole tensor of `file` (all its elements, row-major in GGML order).
pub fn dequantize_tensor(file: &GgufFile, t: &TensorInfo) -> Result<Vec<f32>, GgufError> {
    let n = usize::try_from(t.n_elements()).map_err(|_| GgufError::TooLarge {
        what: format!("tensor `{}` element count", t.name),
        count: t.n_elements(),
        limit: usize::MAX as u64,
    })?;
    let mut out = vec![0.0; n];
    dequantize(t.dtype, file.tensor_data(t), &mut out)?;
    Ok(out)
}

/// Reference quantization of `data` (a whole number of blocks) to `dtype`'s bytes.
pub fn quantize(dtype: GgmlType, data: &[f32]) -> Result<Vec<u8>, GgufError> {
    check_block_multiple(dtype, data.len())?;
    Ok(with_block_type!(dtype, B => quantize_blocks::<B>(data)))
}

fn quantize_blocks<B: QuantBlock>(data: &[f32]) -> Vec<u8> {
    let mut out = Vec::with_capacity(data.len() / B::DTYPE.block_size() * std::mem::size_of::<B>());
    for x in data.chunks_exact(B::DTYPE.block_size()) {
        out.extend_from_slice(bytemuck::bytes_of(&B::quantize(x)));
    }
    out
}

/// ggml's `nearest_int`: round half to even (exact for |x| < 2^22, saturating beyond).
fn nearest_int(x: f32) -> i32 {
    x.round_ties_even() as i32
}

/// The element with the largest magnitude (first one on ties), with its sign; 0 for all-zero
/// (or all-NaN) input.
fn signed_absmax(x: &[f32]) -> f32 {
    let mut amax = 0.0f32;
    let mut max = 0.0f32;
    for &v in x {
        if v.abs() > amax {
            amax = v.abs();
            max = v;
        }
    }
    max
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nearest_int_rounds_half_to_even() {
        assert_eq!(nearest_int(0.5), 0);
        assert_eq!(nearest_int(1.5), 2);
        assert_eq!(nearest_int(-2.5), -2);
        assert_eq!(nearest_int(2.4999), 2);
        assert_eq!(nearest_int(f32::NAN), 0);
    }

    #[test]
    fn size_errors() {
        let mut out = vec![0.0; 64];
        let err = dequantize(GgmlType::Q4_0, &[0; 35], &mut out).unwrap_err();
        assert_eq!(err.to_string(), "Q4_0 data for 64 elements must be 36 bytes, got 35");
        let err = dequantize(GgmlType::Q4_K, &[0; 144], &mut out).unwrap_err();
        assert_eq!(err.to_string(), "64 elements is not a whole number of Q4_K blocks of 256");
        assert!(matches!(
            quantize(GgmlType::Q8_0, &[0.0; 33]),
            Err(GgufError::NotBlockMultiple { .. })
        ));
    }

    #[test]
    fn every_type_quantizes_to_the_right_size() {
        for dtype in GgmlType::ALL {
            let n = dtype.block_size() * 3;
            let x: Vec<f32> = (0..n).map(|i| (i as f32 * 0.37).sin()).collect();
            let q = quantize(dtype, &x).unwrap();
            assert_eq!(q.len(), dtype.row_bytes(n).unwrap(), "{dtype}");
        }
    }
}
