//! CPU compute kernels: quantized SIMD matmul, RMSNorm, RoPE, attention, activations, embedding,
//! MoE routing.
//!
//! SIMD paths are chosen once at run time ([`simd::simd_level`]). Every SIMD dot-product kernel
//! has a scalar twin that performs the same integer arithmetic; the scalar twin is the test oracle
//! for the SIMD code, and dequantize + [`matmul_f32`] is the oracle for both.

pub mod activation;
pub mod attention;
pub mod embedding;
pub mod gdn;
pub mod matmul;
pub mod moe;
pub mod norm;
pub mod rope;
pub mod row_groups;
pub mod simd;

pub(crate) mod fvec;
mod quant;

pub use matmul::{matmul, matmul_f32, matmul_with};
pub use row_groups::RowGroups;

use ferrite_gguf::GgmlType;
use rayon::prelude::*;

/// Rows from which the element-wise row loops (norms, gated activations, RoPE, the activation
/// quantizer) run on the pool: a prompt's rows spent ~12% of a 128-token prefill on one thread
/// while the others waited. Decode steps (one row per sequence) stay on the calling thread: with
/// 8 rows on the pool a batched step was ~5% slower, the fork and join costing more than the
/// rows take (docs/perf.md, stop 29).
pub(crate) const PAR_MIN_ROWS: usize = 16;

/// `f(row index, row)` over the `width`-value rows of `out`, in parallel from [`PAR_MIN_ROWS`]
/// rows on. Each row is computed the same way either way.
pub(crate) fn for_each_row<T: Send>(out: &mut [T], width: usize, f: impl Fn(usize, &mut [T]) + Sync + Send) {
    if out.len() >= PAR_MIN_ROWS * width {
        out.par_chunks_mut(width).enumerate().for_each(|(t, row)| f(t, row));
    } else {
        out.chunks_mut(width).enumerate().for_each(|(t, row)| f(t, row));
    }
}

/// [`for_each_row`] over two arrays of as many rows: `f(row index, row of a, row of b)`, `a` in
/// rows of `wa` values, `b` of `wb`.
pub(crate) fn for_each_row_pair<A: Send, B: Send>(a: &mut [A], wa: usize, b: &mut [B], wb: usize, f: impl Fn(usize, &mut [A], &mut [B]) + Sync + Send) {
    if a.len() >= PAR_MIN_ROWS * wa {
        a.par_chunks_mut(wa).zip(b.par_chunks_mut(wb)).enumerate().for_each(|(t, (a, b))| f(t, a, b));
    } else {
        a.chunks_mut(wa).zip(b.chunks_mut(wb)).enumerate().for_each(|(t, (a, b))| f(t, a, b));
    }
}

/// A weight matrix as stored in GGUF: `rows` rows of `cols` elements; row `r` is
/// `data[r * row_bytes .. (r + 1) * row_bytes]` with `row_bytes = dtype.row_bytes(cols)`.
#[derive(Clone, Copy, Debug)]
pub struct WeightView<'a> {
    pub dtype: GgmlType,
    pub rows: usize,
    pub cols: usize,
    pub data: &'a [u8],
}

impl WeightView<'_> {
    /// Bytes per row, after checking that `cols` is whole blocks and `data` holds exactly
    /// `rows` rows.
    pub fn row_bytes(&self, op: &'static str) -> Result<usize, KernelError> {
        let row_bytes = self
            .dtype
            .row_bytes(self.cols)
            .ok_or_else(|| KernelError::Shape {
                op,
                detail: format!(
                    "{} weight with {} columns: not a whole number of {}-element blocks",
                    self.dtype,
                    self.cols,
                    self.dtype.block_size()
                ),
            })?;
        let expected = row_bytes.checked_mul(self.rows);
        if expected != Some(self.data.len()) {
            return Err(KernelError::Shape {
                op,
                detail: format!(
                    "{} weight of {} x {} needs {} bytes, got {}",
                    self.dtype,
                    self.rows,
                    self.cols,
                    expected.map_or_else(|| "more than usize::MAX".to_string(), |n| n.to_string()),
                    self.data.len()
                ),
            });
        }
        Ok(row_bytes)
    }
}

#[derive(Debug, thiserror::Error)]
pub enum KernelError {
    #[error("{op}: weight dtype {dtype} is not supported")]
    UnsupportedDtype { op: &'static str, dtype: GgmlType },
    #[error("{op}: {detail}")]
    Shape { op: &'static str, detail: String },
    #[error("{op}: SIMD level {level:?} is not available on this CPU")]
    UnavailableSimd {
        op: &'static str,
        level: simd::SimdLevel,
    },
    #[error("embedding: token id {id} (position {index} of the batch) is outside the table of {rows} rows")]
    TokenOutOfRange { index: usize, id: u32, rows: usize },
    #[error("{op}: {source}")]
    Dequantize {
        op: &'static str,
        source: ferrite_gguf::GgufError,
    },
}
