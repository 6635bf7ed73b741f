//! Quantized matmul at every SIMD level against the f32 oracle (ferrite_gguf's bit-exact
//! dequantization + `matmul_f32`), and the SIMD kernels against the scalar kernels.

use ferrite_cpu::kernels::simd::SimdLevel;
use ferrite_cpu::kernels::{
    embedding::embed_rows, matmul_f32, matmul_with, KernelError, WeightView,
};
use ferrite_gguf::blocks::*;
use ferrite_gguf::GgmlType;
use half::{bf16, f16};
use std::mem::offset_of;

/// splitmix64: deterministic test data without a dependency.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in [-1, 1).
    fn unit(&mut self) -> f32 {
        (self.next() >> 40) as f32 / (1u64 << 23) as f32 - 1.0
    }
}

/// Byte offsets of the f16 fields of each block type (all other bytes are free bit patterns).
fn f16_fields(dtype: GgmlType) -> Vec<usize> {
    match dtype {
        GgmlType::Q4_0 => vec![offset_of!(BlockQ4_0, d)],
        GgmlType::Q4_1 => vec![offset_of!(BlockQ4_1, d), offset_of!(BlockQ4_1, m)],
        GgmlType::Q5_0 => vec![offset_of!(BlockQ5_0, d)],
        GgmlType::Q5_1 => vec![offset_of!(BlockQ5_1, d), offset_of!(BlockQ5_1, m)],
        GgmlType::Q8_0 => vec![offset_of!(BlockQ8_0, d)],
        GgmlType::Q2_K => vec![offset_of!(BlockQ2K, d), offset_of!(BlockQ2K, dmin)],
        GgmlType::Q3_K => vec![offset_of!(BlockQ3K, d)],
        GgmlType::Q4_K => vec![offset_of!(BlockQ4K, d), offset_of!(BlockQ4K, dmin)],
        GgmlType::Q5_K => vec![offset_of!(BlockQ5K, d), offset_of!(BlockQ5K, dmin)],
        GgmlType::Q6_K => vec![offset_of!(BlockQ6K, d)],
        other => panic!("no block fields for {other}"),
    }
}

/// Random weights: every code bit pattern, scales of both signs over two decades.
fn random_weights(dtype: GgmlType, rows: usize, cols: usize, rng: &mut Rng) -> Vec<u8> {
    let n = rows * cols;
    match dtype {
        GgmlType::F32 => (0..n).flat_map(|_| rng.unit().to_le_bytes()).collect(),
        GgmlType::F16 => (0..n)
            .flat_map(|_| f16::from_f32(rng.unit()).to_le_bytes())
            .collect(),
        GgmlType::BF16 => (0..n)
            .flat_map(|_| bf16::from_f32(rng.unit()).to_le_bytes())
            .collect(),
        _ => {
            let mut data: Vec<u8> = (0..dtype.row_bytes(n).unwrap())
                .map(|_| rng.next() as u8)
                .collect();
            let fields = f16_fields(dtype);
            for block in data.chunks_exact_mut(dtype.type_size()) {
                for &at in &fields {
                    let scale =
                        rng.unit().signum() * 10f32.powf(-1.0 - 2.0 * rng.unit().abs()) * 0.1;
                    block[at..at + 2].copy_from_slice(&f16::from_f32(scale).to_le_bytes());
                }
            }
            data
        }
    }
}

/// Activations with a few outliers per row, as real hidden states have.
fn random_activations(n: usize, rng: &mut Rng) -> Vec<f32> {
    (0..n)
        .map(|i| rng.unit() * if i % 97 == 5 { 20.0 } else { 1.0 })
        .collect()
}

fn dequantize(dtype: GgmlType, data: &[u8], n: usize) -> Vec<f32> {
    let mut w = vec![0f32; n];
    ferrite_gguf::dequantize(dtype, data, &mut w).unwrap();
    w
}

const QUANTIZED: [GgmlType; 10] = [
    GgmlType::Q4_0,
    GgmlType::Q4_1,
    GgmlType::Q5_0,
    GgmlType::Q5_1,
    GgmlType::Q8_0,
    GgmlType::Q2_K,
    GgmlType::Q3_K,
    GgmlType::Q4_K,
    GgmlType::Q5_K,
    GgmlType::Q6_K,
];
const FLOATS: [GgmlType; 3] = [GgmlType::F32, GgmlType::F16, GgmlType::BF16];

/// Error bounds of output `(t, r)` for weights `w` (dequantized) and activations `x`:
/// - `quant`: activations are rounded to `round(x / d) * d` with `d = max|x_block| / 127`, off by
///   at most `d / 2` each, so the result may differ from the exact one by `Σ |w| * d / 2`;
/// - `magnitude`: the size of the float terms the kernels add up, `Σ (|w| + 2 * range(w_block)) * |x|`
///   (a block's offset or minimum term is at most its range plus |w|), whose f32 rounding is
///   bounded by a small multiple of 2^-24 per term added.
struct Bounds {
    quant: f64,
    magnitude: f64,
}

fn bounds(w: &[f32], x: &[f32], dtype: GgmlType) -> Bounds {
    let act_block = if dtype.is_quantized() {
        if dtype.block_size() == 256 {
            256
        } else {
            32
        }
    } else {
        1
    };
    let mut quant = 0f64;
    let mut magnitude = 0f64;
    for (wb, xb) in w
        .chunks(dtype.block_size())
        .zip(x.chunks(dtype.block_size()))
    {
        let range = wb.iter().cloned().fold(f32::NEG_INFINITY, f32::max)
            - wb.iter().cloned().fold(f32::INFINITY, f32::min);
        for (&w, &x) in wb.iter().zip(xb) {
            magnitude += (w.abs() as f64 + 2.0 * range as f64) * x.abs() as f64;
        }
    }
    if dtype.is_quantized() {
        for (wb, xb) in w.chunks(act_block).zip(x.chunks(act_block)) {
            let amax = xb.iter().fold(0f32, |m, v| m.max(v.abs())) as f64;
            quant += wb.iter().map(|&w| w.abs() as f64).sum::<f64>() * amax / 254.0;
        }
    }
    Bounds { quant, magnitude }
}

fn exact_dot(w: &[f32], x: &[f32]) -> f64 {
    w.iter().zip(x).map(|(&a, &b)| a as f64 * b as f64).sum()
}

/// Runs `W x` at every available level and checks each output: the scalar kernel within the
/// activation-quantization bound (+ f32 rounding) of the exact product of the dequantized
/// weights, every SIMD kernel within f32 rounding of the scalar one.
fn check_matmul(
    dtype: GgmlType,
    rows: usize,
    cols: usize,
    data: &[u8],
    x: &[f32],
    n_tokens: usize,
) {
    let levels = SimdLevel::available();
    assert_eq!(levels[0], SimdLevel::Scalar);
    let w = dequantize(dtype, data, rows * cols);
    let view = WeightView {
        dtype,
        rows,
        cols,
        data,
    };
    let outputs: Vec<Vec<f32>> = levels
        .iter()
        .map(|&level| {
            let mut out = vec![f32::NAN; n_tokens * rows];
            matmul_with(level, &view, x, n_tokens, &mut out).unwrap();
            out
        })
        .collect();
    for t in 0..n_tokens {
        for r in 0..rows {
            let (wr, xt) = (&w[r * cols..(r + 1) * cols], &x[t * cols..(t + 1) * cols]);
            let exact = exact_dot(wr, xt);
            let b = bounds(wr, xt, dtype);
            let scalar = outputs[0][t * rows + r] as f64;
            let tol = b.quant * 1.0001 + 1e-5 * b.magnitude;
            assert!(
                (scalar - exact).abs() <= tol,
                "{dtype} {rows}x{cols} token {t} row {r}: scalar {scalar} vs exact {exact} (tolerance {tol})"
            );
            for (level, out) in levels.iter().zip(&outputs).skip(1) {
                let got = out[t * rows + r] as f64;
                assert!(
                    (got - scalar).abs() <= 1e-5 * b.magnitude,
                    "{dtype} {rows}x{cols} token {t} row {r}: {level:?} {got} vs scalar {scalar} (magnitude {})",
                    b.magnitude
                );
            }
        }
    }
}

/// Every dtype, with column counts of odd block counts (the AVX-512 pair loop's tail) and the
/// SmolLM2 widths, row counts that do not divide into the parallel chunks, 1 token and token
/// counts that leave a remainder after the 4-token tiles.
#[test]
fn matmul_matches_dequantized_reference_at_every_level() {
    let mut rng = Rng(42);
    for dtype in QUANTIZED.into_iter().chain(FLOATS) {
        let col_options: &[usize] = match dtype.block_size() {
            256 => &[256, 1536, 4096],
            32 => &[96, 256, 544, 576, 1536, 4096],
            _ => &[13, 37, 256, 576, 1536],
        };
        for &cols in col_options {
            for (rows, n_tokens) in [(37, 1), (100, 7), (300, 1), (1, 9)] {
                let data = random_weights(dtype, rows, cols, &mut rng);
                let x = random_activations(n_tokens * cols, &mut rng);
                check_matmul(dtype, rows, cols, &data, &x, n_tokens);
            }
        }
    }
}

fn model_path() -> std::path::PathBuf {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../models/SmolLM2-135M-Instruct.Q4_1.gguf");
    assert!(
        path.exists(),
        "{} is missing: run scripts/fetch-model.sh first",
        path.display()
    );
    path
}

/// The real SmolLM2 weights (Q4_1 layers, the Q8_0 embedding/output table).
#[test]
fn matmul_and_embedding_on_real_model_weights() {
    let file = ferrite_gguf::GgufFile::open(model_path()).unwrap();
    let mut rng = Rng(5);
    for (name, max_rows, n_tokens) in [
        ("blk.0.ffn_down.weight", usize::MAX, 3),
        ("blk.17.attn_q.weight", usize::MAX, 1),
        ("token_embd.weight", 3000, 5),
    ] {
        let t = file
            .tensor(name)
            .unwrap_or_else(|| panic!("{name} is not in the model"));
        let (cols, rows) = (t.row_len(), t.n_rows().min(max_rows));
        let data = &file.tensor_data(t)[..t.dtype.row_bytes(cols).unwrap() * rows];
        // Hidden-state-like activations: mostly small, a few large.
        let x = random_activations(n_tokens * cols, &mut rng);
        check_matmul(t.dtype, rows, cols, data, &x, n_tokens);
    }
    let t = file.tensor("token_embd.weight").unwrap();
    let table = WeightView {
        dtype: t.dtype,
        rows: t.n_rows(),
        cols: t.row_len(),
        data: file.tensor_data(t),
    };
    let ids = [0u32, 1, 49151, 1234];
    let mut out = vec![0f32; ids.len() * table.cols];
    embed_rows(&table, &ids, &mut out).unwrap();
    let row_bytes = t.dtype.row_bytes(table.cols).unwrap();
    for (i, &id) in ids.iter().enumerate() {
        let want = dequantize(
            t.dtype,
            &table.data[id as usize * row_bytes..][..row_bytes],
            table.cols,
        );
        assert_eq!(
            &out[i * table.cols..(i + 1) * table.cols],
            &want[..],
            "token {id}"
        );
    }
}

/// The reference quantizers produce realistic blocks (scales fitted to the data): the kernels
/// must agree with the f32 reference there too. Rounding an activation to a step `d` errs
/// uniformly within ±d/2 (variance d²/12), independently per element, so the squared error summed
/// over all outputs concentrates around `Σ_outputs Σ_c w_c² d_c² / 12`; it must stay below twice that.
#[test]
fn matmul_of_reference_quantized_weights() {
    let mut rng = Rng(7);
    let (rows, cols, n_tokens) = (64, 1536, 5);
    let original: Vec<f32> = (0..rows * cols).map(|_| rng.unit() * 0.05).collect();
    let x = random_activations(n_tokens * cols, &mut rng);
    for dtype in QUANTIZED {
        let data = ferrite_gguf::quantize(dtype, &original).unwrap();
        let w = dequantize(dtype, &data, rows * cols);
        let act_block = if dtype.block_size() == 256 { 256 } else { 32 };
        let steps: Vec<f64> = x
            .chunks(act_block)
            .flat_map(|b| {
                let d = b.iter().fold(0f32, |m, v| m.max(v.abs())) as f64 / 127.0;
                std::iter::repeat_n(d, act_block)
            })
            .collect();
        let mut variance = 0f64;
        for t in 0..n_tokens {
            for r in 0..rows {
                let steps = &steps[t * cols..(t + 1) * cols];
                variance += w[r * cols..(r + 1) * cols]
                    .iter()
                    .zip(steps)
                    .map(|(&w, d)| (w as f64 * d).powi(2) / 12.0)
                    .sum::<f64>();
            }
        }
        let mut want = vec![0f32; n_tokens * rows];
        matmul_f32(&w, rows, cols, &x, n_tokens, &mut want);
        for level in SimdLevel::available() {
            let mut out = vec![0f32; n_tokens * rows];
            matmul_with(
                level,
                &WeightView {
                    dtype,
                    rows,
                    cols,
                    data: &data,
                },
                &x,
                n_tokens,
                &mut out,
            )
            .unwrap();
            let err2: f64 = out
                .iter()
                .zip(&want)
                .map(|(a, b)| ((a - b) as f64).powi(2))
                .sum();
            assert!(
                err2 <= 2.0 * variance,
                "{dtype} {level:?}: squared error {err2}, expected about {variance}"
            );
        }
    }
}

/// A NaN activation must surface as NaN outputs of its token, not as garbage codes.
#[test]
fn nan_activations_reach_the_outputs() {
    let mut rng = Rng(9);
    for dtype in QUANTIZED.into_iter().chain(FLOATS) {
        let (rows, cols, n_tokens) = (5, 256, 2);
        let data = random_weights(dtype, rows, cols, &mut rng);
        let mut x = random_activations(n_tokens * cols, &mut rng);
        x[cols + 77] = f32::NAN;
        for level in SimdLevel::available() {
            let mut out = vec![0f32; n_tokens * rows];
            matmul_with(
                level,
                &WeightView {
                    dtype,
                    rows,
                    cols,
                    data: &data,
                },
                &x,
                n_tokens,
                &mut out,
            )
            .unwrap();
            assert!(
                out[..rows].iter().all(|v| v.is_finite()),
                "{dtype} {level:?}: token 0 is clean"
            );
            assert!(
                out[rows..].iter().all(|v| v.is_nan()),
                "{dtype} {level:?}: {:?}",
                &out[rows..]
            );
        }
    }
}

#[test]
fn matmul_f32_is_an_exact_reference() {
    let mut rng = Rng(3);
    let (rows, cols, n) = (33, 70, 3);
    let w: Vec<f32> = (0..rows * cols).map(|_| rng.unit()).collect();
    let x: Vec<f32> = (0..n * cols).map(|_| rng.unit()).collect();
    let mut out = vec![0f32; rows * n];
    matmul_f32(&w, rows, cols, &x, n, &mut out);
    for t in 0..n {
        for r in 0..rows {
            let want = exact_dot(&w[r * cols..(r + 1) * cols], &x[t * cols..(t + 1) * cols]);
            assert!((out[t * rows + r] as f64 - want).abs() <= want.abs() * 1e-7 + 1e-12);
        }
    }
}

#[test]
fn matmul_rejects_bad_shapes_and_types() {
    let data = vec![0u8; 2 * 20];
    let view = WeightView {
        dtype: GgmlType::Q4_1,
        rows: 2,
        cols: 32,
        data: &data,
    };
    let x = vec![0f32; 32];
    let mut out = vec![0f32; 2];
    matmul_with(SimdLevel::Scalar, &view, &x, 1, &mut out).unwrap();

    let err = |view: &WeightView, x: &[f32], n: usize, out: &mut [f32]| {
        matmul_with(SimdLevel::Scalar, view, x, n, out)
            .unwrap_err()
            .to_string()
    };
    let short = WeightView {
        data: &data[..39],
        ..view
    };
    assert_eq!(
        err(&short, &x, 1, &mut out),
        "matmul: Q4_1 weight of 2 x 32 needs 40 bytes, got 39"
    );
    let ragged = WeightView { cols: 31, ..view };
    assert!(err(&ragged, &x[..31], 1, &mut out)
        .contains("31 columns: not a whole number of 32-element blocks"));
    assert!(
        err(&view, &x[..31], 1, &mut out).starts_with("matmul: input has 31 values, expected 32")
    );
    assert!(err(&view, &x, 1, &mut out[..1]).starts_with("matmul: output has 1 values, expected 2"));
    let q8k = vec![0u8; 2 * 292];
    let view_k = WeightView {
        dtype: GgmlType::Q8_K,
        rows: 2,
        cols: 256,
        data: &q8k,
    };
    assert_eq!(
        err(&view_k, &[0.0; 256], 1, &mut out),
        "matmul: weight dtype Q8_K is not supported"
    );
    let unavailable = SimdLevel::ALL
        .into_iter()
        .find(|l| !l.is_available())
        .expect("some level is foreign to this CPU");
    assert!(matches!(
        matmul_with(unavailable, &view, &x, 1, &mut out),
        Err(KernelError::UnavailableSimd { .. })
    ));
}

#[test]
fn embedding_dequantizes_rows_and_rejects_bad_ids() {
    let mut rng = Rng(11);
    let rows = 10;
    for (dtype, cols) in [
        (GgmlType::Q8_0, 64),
        (GgmlType::Q4_K, 256),
        (GgmlType::F16, 48),
        (GgmlType::F32, 7),
    ] {
        let data = random_weights(dtype, rows, cols, &mut rng);
        let table = WeightView {
            dtype,
            rows,
            cols,
            data: &data,
        };
        let w = dequantize(dtype, &data, rows * cols);
        let ids = [3u32, 0, 9, 3];
        let mut out = vec![0f32; ids.len() * cols];
        embed_rows(&table, &ids, &mut out).unwrap();
        for (i, &id) in ids.iter().enumerate() {
            assert_eq!(
                &out[i * cols..(i + 1) * cols],
                &w[id as usize * cols..(id as usize + 1) * cols],
                "{dtype}"
            );
        }
        let e = embed_rows(&table, &[1, 10], &mut out[..2 * cols]).unwrap_err();
        assert_eq!(
            e.to_string(),
            "embedding: token id 10 (position 1 of the batch) is outside the table of 10 rows"
        );
        assert!(embed_rows(&table, &[1], &mut out).is_err());
    }
}
