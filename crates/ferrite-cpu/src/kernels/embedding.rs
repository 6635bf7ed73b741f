//! Token embedding lookup.

use super::{KernelError, WeightView};

/// Dequantizes table rows `ids` into `out` (`ids.len() x table.cols`). An id outside the table
/// is an error naming it.
pub fn embed_rows(table: &WeightView, ids: &[u32], out: &mut [f32]) -> Result<(), KernelError> {
    const OP: &str = "embedding";
    let row_bytes = table.row_bytes(OP)?;
    if Some(out.len()) != ids.len().checked_mul(table.cols) {
        return Err(KernelError::Shape {
            op: OP,
            detail: format!(
                "output has {} values, expected {} ids x {} columns",
                out.len(),
                ids.len(),
                table.cols
            ),
        });
    }
    if table.cols == 0 {
        return Ok(());
    }
    for (index, (&id, out)) in ids.iter().zip(out.chunks_exact_mut(table.cols)).enumerate() {
        let row = id as usize;
        if row >= table.rows {
            return Err(KernelError::TokenOutOfRange {
                index,
                id,
                rows: table.rows,
            });
        }
        ferrite_gguf::dequantize(
            table.dtype,
            &table.data[row * row_bytes..(row + 1) * row_bytes],
            out,
        )
        .map_err(|source| KernelError::Dequantize { op: OP, source })?;
    }
    Ok(())
}
