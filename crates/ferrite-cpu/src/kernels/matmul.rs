//! `out[t * rows + r] = Σ_c x[t * cols + c] * W[r, c]` for every token `t`.

use super::quant::float::{Float, BF16, F16, F32};
use super::quant::kquant::{KQuant, Q2K, Q3K, Q4K, Q5K, Q6K};
use super::quant::legacy::{Legacy, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0};
use super::quant::DotKernel;
use super::simd::{simd_level, SimdLevel};
use super::{KernelError, WeightView};
use ferrite_gguf::GgmlType;
use rayon::prelude::*;

/// Tokens per kernel call when several tokens share a weight row: the row is unpacked once for
/// all of them.
const TOKEN_TILE: usize = 4;
/// Rows swept per token tile, so that they stay in L1 while every token tile passes over them.
const ROW_BLOCK: usize = 16;
/// Parallel tasks per thread (several balance uneven progress between cores).
const TASKS_PER_THREAD: usize = 4;
/// Least weight bytes x tokens per task: below this a task costs more to hand out than it saves.
const MIN_TASK_WORK: usize = 16 * 1024;

/// Quantized weights: the activations are quantized once per token to the matching 8-bit dot
/// type (Q8_0 numerics for Q4_0/Q5_0/Q8_0, Q8_1 for Q4_1/Q5_1, Q8_K for the k-quants), then integer
/// dot products per block; F32/F16/BF16 weights use float dot products. Parallel over row chunks
/// on the global rayon pool; with several tokens each chunk of rows is multiplied with all tokens
/// while it is in cache, so the weights stream from memory once.
///
/// Call it from a thread of the pool (run the whole forward pass inside `rayon::scope` or
/// `ThreadPool::install`): from any other thread every call pays a cross-thread hand-off and
/// wake-up, tens of microseconds on a small VM — more than a decode-sized matmul takes.
pub fn matmul(
    w: &WeightView,
    x: &[f32],
    n_tokens: usize,
    out: &mut [f32],
) -> Result<(), KernelError> {
    matmul_with(simd_level(), w, x, n_tokens, out)
}

/// [`matmul`] with the kernels of a given SIMD level (for A/B comparisons and tests); an error if
/// the CPU cannot run that level.
pub fn matmul_with(
    level: SimdLevel,
    w: &WeightView,
    x: &[f32],
    n_tokens: usize,
    out: &mut [f32],
) -> Result<(), KernelError> {
    const OP: &str = "matmul";
    if !level.is_available() {
        return Err(KernelError::UnavailableSimd { op: OP, level });
    }
    let row_bytes = w.row_bytes(OP)?;
    check_len("input", x.len(), n_tokens, w.cols, w)?;
    check_len("output", out.len(), n_tokens, w.rows, w)?;
    if out.is_empty() {
        return Ok(());
    }
    if w.cols == 0 {
        out.fill(0.0);
        return Ok(());
    }
    match w.dtype {
        GgmlType::Q4_0 => run::<Legacy<Q4_0>>(level, w, row_bytes, x, n_tokens, out),
        GgmlType::Q4_1 => run::<Legacy<Q4_1>>(level, w, row_bytes, x, n_tokens, out),
        GgmlType::Q5_0 => run::<Legacy<Q5_0>>(level, w, row_bytes, x, n_tokens, out),
        GgmlType::Q5_1 => run::<Legacy<Q5_1>>(level, w, row_bytes, x, n_tokens, out),
        GgmlType::Q8_0 => run::<Legacy<Q8_0>>(level, w, row_bytes, x, n_tokens, out),
        GgmlType::Q2_K => run::<KQuant<Q2K>>(level, w, row_bytes, x, n_tokens, out),
        GgmlType::Q3_K => run::<KQuant<Q3K>>(level, w, row_bytes, x, n_tokens, out),
        GgmlType::Q4_K => run::<KQuant<Q4K>>(level, w, row_bytes, x, n_tokens, out),
        GgmlType::Q5_K => run::<KQuant<Q5K>>(level, w, row_bytes, x, n_tokens, out),
        GgmlType::Q6_K => run::<KQuant<Q6K>>(level, w, row_bytes, x, n_tokens, out),
        GgmlType::F32 => run::<Float<F32>>(level, w, row_bytes, x, n_tokens, out),
        GgmlType::F16 => run::<Float<F16>>(level, w, row_bytes, x, n_tokens, out),
        GgmlType::BF16 => run::<Float<BF16>>(level, w, row_bytes, x, n_tokens, out),
        // Activation-side formats: no model stores weights in them.
        GgmlType::Q8_1 | GgmlType::Q8_K => {
            return Err(KernelError::UnsupportedDtype {
                op: OP,
                dtype: w.dtype,
            })
        }
    }
    Ok(())
}

/// `got == n_tokens * per_token`, or an error naming `what`.
fn check_len(
    what: &str,
    got: usize,
    n_tokens: usize,
    per_token: usize,
    w: &WeightView,
) -> Result<(), KernelError> {
    let want = n_tokens.checked_mul(per_token);
    if want == Some(got) {
        return Ok(());
    }
    let want = want.map_or_else(|| "more than usize::MAX".to_string(), |n| n.to_string());
    let (rows, cols) = (w.rows, w.cols);
    Err(KernelError::Shape {
        op: "matmul",
        detail: format!(
            "{what} has {got} values, expected {want} ({n_tokens} tokens x {per_token}; weight {rows} x {cols})"
        ),
    })
}

/// Rows per parallel task.
fn chunk_rows(rows: usize, row_bytes: usize, n_tokens: usize) -> usize {
    let tasks = rayon::current_num_threads() * TASKS_PER_THREAD;
    let least = MIN_TASK_WORK.div_ceil(row_bytes.saturating_mul(n_tokens).max(1));
    rows.div_ceil(tasks).max(least).max(1)
}

fn run<K: DotKernel>(
    level: SimdLevel,
    w: &WeightView,
    row_bytes: usize,
    x: &[f32],
    n_tokens: usize,
    out: &mut [f32],
) {
    let acts = K::prepare(x, w.cols, n_tokens);
    let dot_one = K::row_dot::<1>(level);
    let dot_pair = K::row_dot::<2>(level);
    let dot_tile = K::row_dot::<TOKEN_TILE>(level);
    let rows = w.rows;
    let chunk = chunk_rows(rows, row_bytes, n_tokens);
    for_each_row_chunk(out, rows, n_tokens, chunk, |c, outs| {
            let weights = &w.data[c * chunk * row_bytes..];
            let row = |r: usize| &weights[r * row_bytes..(r + 1) * row_bytes];
            let n_rows = outs[0].len();
            for first in (0..n_rows).step_by(ROW_BLOCK) {
                let block = first..(first + ROW_BLOCK).min(n_rows);
                let mut t = 0;
                while t + TOKEN_TILE <= n_tokens {
                    for r in block.clone() {
                        // SAFETY: the kernels were selected for `level`, checked available above.
                        let v = unsafe { dot_tile(row(r), &acts, t) };
                        for (i, v) in v.into_iter().enumerate() {
                            outs[t + i][r] = v;
                        }
                    }
                    t += TOKEN_TILE;
                }
                // Two or three tokens left (batched decoding of a few sequences): a pair still
                // unpacks each row once for both.
                if t + 2 <= n_tokens {
                    for r in block.clone() {
                        // SAFETY: as above.
                        let v = unsafe { dot_pair(row(r), &acts, t) };
                        outs[t][r] = v[0];
                        outs[t + 1][r] = v[1];
                    }
                    t += 2;
                }
                for (t, out) in outs.iter_mut().enumerate().skip(t) {
                    for r in block.clone() {
                        // SAFETY: as above.
                        out[r] = unsafe { dot_one(row(r), &acts, t) }[0];
                    }
                }
            }
        });
}

/// Runs `f(c, outs)` in parallel for every chunk `c` of `chunk` output rows (the last may be
/// shorter), where `outs[t]` is that chunk's piece of token `t`'s row of the token-major `out`
/// (`n_tokens` rows of `rows`).
pub(crate) fn for_each_row_chunk(
    out: &mut [f32],
    rows: usize,
    n_tokens: usize,
    chunk: usize,
    f: impl Fn(usize, &mut [&mut [f32]]) + Sync,
) {
    let mut per_token: Vec<_> = out.chunks_mut(rows).map(|o| o.chunks_mut(chunk)).collect();
    let n_chunks = rows.div_ceil(chunk);
    let mut pieces: Vec<&mut [f32]> = Vec::with_capacity(n_chunks * n_tokens);
    for _ in 0..n_chunks {
        pieces.extend(
            per_token
                .iter_mut()
                .map(|t| t.next().expect("every token row has n_chunks pieces")),
        );
    }
    pieces
        .par_chunks_mut(n_tokens)
        .enumerate()
        .for_each(|(c, outs)| f(c, outs));
}

/// The f32 reference: `w` is `rows x cols` row-major (already dequantized). Each output is an
/// f64-accumulated dot product in a fixed order, so results do not depend on threading.
/// Parallel over outputs. Panics if the slice lengths do not match the shape.
pub fn matmul_f32(
    w: &[f32],
    rows: usize,
    cols: usize,
    x: &[f32],
    n_tokens: usize,
    out: &mut [f32],
) {
    assert_eq!(
        w.len(),
        rows * cols,
        "matmul_f32: weight has {} values, expected {rows} x {cols}",
        w.len()
    );
    assert_eq!(
        x.len(),
        n_tokens * cols,
        "matmul_f32: input has {} values, expected {n_tokens} x {cols}",
        x.len()
    );
    assert_eq!(
        out.len(),
        n_tokens * rows,
        "matmul_f32: output has {} values, expected {n_tokens} x {rows}",
        out.len()
    );
    out.par_iter_mut()
        .enumerate()
        .with_min_len(64)
        .for_each(|(i, o)| {
            let (t, r) = (i / rows, i % rows);
            *o = dot_f64(&w[r * cols..(r + 1) * cols], &x[t * cols..(t + 1) * cols]);
        });
}

/// f64 dot product with four interleaved partial sums (vectorizable, fixed order).
fn dot_f64(a: &[f32], b: &[f32]) -> f32 {
    let (ca, cb) = (a.chunks_exact(4), b.chunks_exact(4));
    let tail: f64 = ca
        .remainder()
        .iter()
        .zip(cb.remainder())
        .map(|(&x, &y)| x as f64 * y as f64)
        .sum();
    let mut lanes = [0f64; 4];
    for (x, y) in ca.zip(cb) {
        for i in 0..4 {
            lanes[i] += x[i] as f64 * y[i] as f64;
        }
    }
    (lanes.iter().sum::<f64>() + tail) as f32
}
