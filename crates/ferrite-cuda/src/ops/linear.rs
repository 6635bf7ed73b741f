//! `linear`: `out[t, r] = sum_c w[r, c] * x[t, c]`, dispatched between two kernel paths.
//!
//! - GEMV (few tokens): multiplies directly on the packed weights ([`crate::kernels::gemv`]).
//! - GEMM (many tokens): the weight is dequantized into scratch (skipped when it already has
//!   the GEMM's input type) and cuBLAS multiplies, accumulating in f32.

use super::{addr, addr_mut, as_u32, check_len, elems};
use crate::error::{Context, CudaError};
use crate::kernels::dequant::{ConvertParams, ConvertVariant, DequantParams, DequantVariant, OutType};
use crate::kernels::gemv::{GemvParams, GemvVariant};
use crate::weight::DeviceWeight;
use crate::Gpu;
use cudarc::cublas::result::gemm_ex;
use cudarc::cublas::sys::{cublasComputeType_t, cublasGemmAlgo_t, cublasOperation_t, cudaDataType_t};
use cudarc::driver::{DevicePtr, DevicePtrMut};
use ferrite_core::env;
use ferrite_gguf::GgmlType;
use std::ffi::c_void;

/// Which kernel path [`linear`] takes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LinearPath {
    /// GEMV up to `gemv_max_tokens` tokens, GEMM above.
    Auto,
    /// GEMV for every token count (token tiles of 8 re-read the weights).
    Gemv,
    /// Dequantize + cuBLAS for every token count.
    Gemm,
}

/// Input type of the cuBLAS GEMM (accumulation is f32 in every case).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Precision {
    /// SGEMM on f32 weights and activations: matches the CPU reference to f32 rounding.
    F32,
    F16,
    BF16,
}

impl Precision {
    fn out_type(self) -> OutType {
        match self {
            Precision::F32 => OutType::F32,
            Precision::F16 => OutType::F16,
            Precision::BF16 => OutType::BF16,
        }
    }

    fn cuda_type(self) -> cudaDataType_t {
        match self {
            Precision::F32 => cudaDataType_t::CUDA_R_32F,
            Precision::F16 => cudaDataType_t::CUDA_R_16F,
            Precision::BF16 => cudaDataType_t::CUDA_R_16BF,
        }
    }

    /// The weight type cuBLAS can read directly at this precision.
    fn native_weight(self) -> GgmlType {
        match self {
            Precision::F32 => GgmlType::F32,
            Precision::F16 => GgmlType::F16,
            Precision::BF16 => GgmlType::BF16,
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LinearOptions {
    pub path: LinearPath,
    pub precision: Precision,
    /// Largest token count that takes the GEMV in [`LinearPath::Auto`].
    pub gemv_max_tokens: usize,
}

impl Default for LinearOptions {
    fn default() -> Self {
        LinearOptions { path: LinearPath::Auto, precision: Precision::F32, gemv_max_tokens: 8 }
    }
}

impl LinearOptions {
    /// `FERRITE_CUDA_LINEAR`, `FERRITE_CUDA_GEMM_PRECISION`, `FERRITE_CUDA_GEMV_MAX_TOKENS`;
    /// an unknown value is reported on stderr and the default is kept.
    pub fn from_env() -> Self {
        let d = LinearOptions::default();
        let pick = |switch: &env::Switch, choices: &[&str]| -> Option<usize> {
            let value = switch.get()?.to_ascii_lowercase();
            let found = choices.iter().position(|c| *c == value);
            if found.is_none() {
                eprintln!("warning: {}={value:?} is not one of {choices:?}; using the default", switch.name);
            }
            found
        };
        let path = match pick(&env::CUDA_LINEAR, &["auto", "gemv", "gemm"]) {
            Some(1) => LinearPath::Gemv,
            Some(2) => LinearPath::Gemm,
            _ => d.path,
        };
        let precision = match pick(&env::CUDA_GEMM_PRECISION, &["f32", "f16", "bf16"]) {
            Some(1) => Precision::F16,
            Some(2) => Precision::BF16,
            _ => d.precision,
        };
        let gemv_max_tokens = env::CUDA_GEMV_MAX_TOKENS.parse(d.gemv_max_tokens);
        LinearOptions { path, precision, gemv_max_tokens }
    }
}

/// The kernel sequence [`linear`] runs for a shape.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LinearPlan {
    Gemv,
    Gemm {
        precision: Precision,
        /// Weight dequantized/converted into scratch first (false: cuBLAS reads it as stored).
        dequantize_weight: bool,
        /// Activations converted to f16/bf16 in scratch first.
        convert_input: bool,
    },
}

/// Pick the path: GEMV needs whole 32-value units per row (always true for quantized types;
/// float weights with `cols % 32 != 0` fall back to GEMM even when GEMV is forced).
pub fn linear_plan(dtype: GgmlType, cols: usize, n_tokens: usize, opts: &LinearOptions) -> LinearPlan {
    let gemv_fits = cols.is_multiple_of(32);
    let gemv = match opts.path {
        LinearPath::Gemv => gemv_fits,
        LinearPath::Gemm => false,
        LinearPath::Auto => gemv_fits && n_tokens <= opts.gemv_max_tokens,
    };
    if gemv {
        return LinearPlan::Gemv;
    }
    LinearPlan::Gemm {
        precision: opts.precision,
        dequantize_weight: dtype != opts.precision.native_weight(),
        convert_input: opts.precision != Precision::F32,
    }
}

/// `out[t, r] = sum_c w[r, c] * x[t, c]` for `t < n_tokens`, with the GPU's default options.
/// `x` is `[n_tokens, w.cols]`, `out` is `[n_tokens, w.rows]`, both f32.
pub fn linear(
    gpu: &Gpu,
    w: &DeviceWeight,
    x: &impl DevicePtr<f32>,
    n_tokens: usize,
    out: &mut impl DevicePtrMut<f32>,
) -> Result<(), CudaError> {
    linear_with(gpu, w, x, n_tokens, out, &gpu.linear_options()).map(|_| ())
}

/// [`linear`] with explicit options; returns the plan it ran.
pub fn linear_with(
    gpu: &Gpu,
    w: &DeviceWeight,
    x: &impl DevicePtr<f32>,
    n_tokens: usize,
    out: &mut impl DevicePtrMut<f32>,
    opts: &LinearOptions,
) -> Result<LinearPlan, CudaError> {
    const OP: &str = "linear";
    let plan = linear_plan(w.dtype, w.cols, n_tokens, opts);
    if n_tokens == 0 {
        return Ok(plan);
    }
    check_len(OP, "x", x.len(), elems(OP, &[n_tokens, w.cols])?)?;
    check_len(OP, "out", out.len(), elems(OP, &[n_tokens, w.rows])?)?;
    let (x, out) = (addr(gpu, x), addr_mut(gpu, out));
    if plan == LinearPlan::Gemv && x % 16 != 0 {
        return Err(CudaError::invalid(
            OP,
            format!("x at device address {x:#x} is not 16-byte aligned, as the GEMV needs"),
        ));
    }
    match plan {
        LinearPlan::Gemv => gemv(gpu, w, x, n_tokens, out)?,
        LinearPlan::Gemm { precision, dequantize_weight, convert_input } => {
            gemm(gpu, w, x, n_tokens, out, precision, dequantize_weight, convert_input)?
        }
    }
    Ok(plan)
}

fn gemv(gpu: &Gpu, w: &DeviceWeight, x: u64, n_tokens: usize, out: u64) -> Result<(), CudaError> {
    const OP: &str = "linear";
    let variant = GemvVariant::for_shape(w.dtype, n_tokens);
    let [w0, w1, w2, w3] = w.plane_ptrs(gpu);
    let params = GemvParams {
        w0,
        w1,
        w2,
        w3,
        x,
        out,
        rows: as_u32(OP, "rows", w.rows)?,
        cols: as_u32(OP, "cols", w.cols)?,
        n_tokens: as_u32(OP, "n_tokens", n_tokens)?,
        pad: 0,
    };
    let cfg = variant.launch_config(w.rows, n_tokens);
    if cfg.grid_dim.1 > 65535 {
        return Err(CudaError::invalid(OP, format!("{n_tokens} tokens exceed the GEMV grid; use the GEMM path")));
    }
    gpu.launch(&variant, "gemv", cfg, &params)
}

const SCRATCH_ALIGN: usize = 256;

#[allow(clippy::too_many_arguments)]
fn gemm(
    gpu: &Gpu,
    w: &DeviceWeight,
    x: u64,
    n_tokens: usize,
    out: u64,
    precision: Precision,
    dequantize_weight: bool,
    convert_input: bool,
) -> Result<(), CudaError> {
    const OP: &str = "linear";
    let int = |what: &str, v: usize| {
        i32::try_from(v).map_err(|_| CudaError::invalid(OP, format!("{what} = {v} is too large for cuBLAS")))
    };
    let (m, n, k) = (int("rows", w.rows)?, int("n_tokens", n_tokens)?, int("cols", w.cols)?);
    let elem = precision.out_type().bytes();
    let w_bytes =
        if dequantize_weight { elems(OP, &[w.rows, w.cols, elem])?.next_multiple_of(SCRATCH_ALIGN) } else { 0 };
    let x_bytes = if convert_input { elems(OP, &[n_tokens, w.cols, elem])? } else { 0 };
    gpu.with_scratch((w_bytes + x_bytes).max(1), |scratch| {
        let weight = if dequantize_weight {
            let variant = DequantVariant { wtype: w.dtype, out: precision.out_type() };
            let [w0, w1, w2, w3] = w.plane_ptrs(gpu);
            let params = DequantParams { w0, w1, w2, w3, out: scratch, rows: w.rows as u32, cols: w.cols as u32 };
            gpu.launch(&variant, "dequantize", variant.launch_config(w.rows), &params)?;
            scratch
        } else {
            w.plane_ptrs(gpu)[0]
        };
        let input = if convert_input {
            let variant = ConvertVariant { out: precision.out_type() };
            let dst = scratch + w_bytes as u64;
            let count = n_tokens * w.cols;
            let params = ConvertParams { src: x, dst, n: count as u64 };
            gpu.launch(&variant, "convert_f32", variant.launch_config(count), &params)?;
            dst
        } else {
            x
        };
        let (alpha, beta) = (1.0f32, 0.0f32);
        let ty = precision.cuda_type();
        // Row-major out[n, m] = x[n, k] * w[m, k]^T is column-major out(m x n) = W^T(m x k) * X(k x n),
        // with W the column-major (k x m) view of the row-major weight.
        unsafe {
            gemm_ex(
                *gpu.blas().handle(),
                cublasOperation_t::CUBLAS_OP_T,
                cublasOperation_t::CUBLAS_OP_N,
                m,
                n,
                k,
                &alpha as *const f32 as *const c_void,
                weight as *const c_void,
                ty,
                k,
                input as *const c_void,
                ty,
                k,
                &beta as *const f32 as *const c_void,
                out as *mut c_void,
                cudaDataType_t::CUDA_R_32F,
                m,
                cublasComputeType_t::CUBLAS_COMPUTE_32F,
                cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
            )
        }
        .context(|| format!("cublasGemmEx {m}x{n}x{k} ({precision:?}, weight {})", w.dtype))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plan_follows_tokens_and_switch() {
        let auto = LinearOptions::default();
        assert_eq!(linear_plan(GgmlType::Q4_0, 576, 1, &auto), LinearPlan::Gemv);
        assert_eq!(linear_plan(GgmlType::Q4_0, 576, 8, &auto), LinearPlan::Gemv);
        assert_eq!(
            linear_plan(GgmlType::Q4_0, 576, 9, &auto),
            LinearPlan::Gemm { precision: Precision::F32, dequantize_weight: true, convert_input: false }
        );
        assert_eq!(
            linear_plan(GgmlType::F32, 576, 64, &auto),
            LinearPlan::Gemm { precision: Precision::F32, dequantize_weight: false, convert_input: false }
        );
        let f16 = LinearOptions { precision: Precision::F16, path: LinearPath::Gemm, ..auto };
        assert_eq!(
            linear_plan(GgmlType::F16, 576, 1, &f16),
            LinearPlan::Gemm { precision: Precision::F16, dequantize_weight: false, convert_input: true }
        );
        let gemv = LinearOptions { path: LinearPath::Gemv, ..auto };
        assert_eq!(linear_plan(GgmlType::Q6_K, 256, 100, &gemv), LinearPlan::Gemv);
    }

    #[test]
    fn float_weights_with_ragged_rows_fall_back_to_gemm() {
        let gemv = LinearOptions { path: LinearPath::Gemv, ..LinearOptions::default() };
        assert!(matches!(linear_plan(GgmlType::F16, 100, 1, &gemv), LinearPlan::Gemm { .. }));
        assert!(matches!(linear_plan(GgmlType::F32, 100, 1, &LinearOptions::default()), LinearPlan::Gemm { .. }));
    }
}
