//! `linear`: `out[t, r] = sum_c w[r, c] * x[t, c]`, dispatched between four kernel paths.
//!
//! - int8 GEMV (few tokens, quantized weights): activations are quantized to int8 blocks
//!   ([`quantize_q8`], which can also apply the RMSNorm of a norm-folded linear) and multiplied
//!   with `dp4a` on the packed weights ([`linear_q8`], with bias and residual in the epilogue).
//! - f32 GEMV (few tokens; float weights, or `FERRITE_CUDA_GEMV_ACTIVATIONS=f32`): multiplies
//!   f32 activations on the packed weights ([`crate::kernels::gemv`]).
//! - small-batch tensor-core GEMM (quantized weights, `gemv_max_tokens` < tokens <=
//!   `mma_max_tokens`: a server's batched decode steps): weights decoded from the packed planes
//!   in registers and multiplied on `mma.sync` with f32 accumulation ([`crate::kernels::gemm`]).
//! - GEMM (many tokens): the weight is dequantized into scratch (skipped when it already has
//!   the GEMM's input type) and cuBLAS multiplies, accumulating in f32.

use super::{addr, addr_mut, as_u32, check_len, elems, norm_rows, RowNorm};
use crate::blas_lt::LtShape;
use crate::error::CudaError;
use crate::kernels::dequant::{ConvertParams, ConvertVariant, DequantParams, DequantVariant, MmaOrder, OutType};
use crate::kernels::gemm::{self as gemm_kernels, GemmMmaParams, GemmMmaVariant, GemmReduceParams, GEMM_CHUNK_COLS};
use crate::kernels::gemv::{GemvParams, GemvQ8Params, GemvQ8Variant, GemvVariant};
use crate::kernels::moe::GROUP_TILE;
use crate::kernels::quantize::{Prologue, QuantizeParams, QuantizeVariant};
use crate::weight::{self, DeviceWeight};
use crate::Gpu;
use cudarc::driver::{CudaSlice, DevicePtr, DevicePtrMut};
use ferrite_core::env;
use ferrite_gguf::GgmlType;

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


    /// The weight type cuBLAS can read directly at this precision.
    fn native_weight(self) -> GgmlType {
        match self {
            Precision::F32 => GgmlType::F32,
            Precision::F16 => GgmlType::F16,
            Precision::BF16 => GgmlType::BF16,
        }
    }
}

/// Activation format of the GEMV on quantized weights.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GemvActivations {
    /// int8 blocks and `dp4a` (the CPU quantized path's numerics).
    Q8,
    /// f32 activations (matches the fp32 CPU reference to rounding).
    F32,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LinearOptions {
    pub path: LinearPath,
    pub precision: Precision,
    /// Largest token count that takes the GEMV in [`LinearPath::Auto`].
    pub gemv_max_tokens: usize,
    pub activations: GemvActivations,
    /// Let the int8 GEMV split rows' units over slices of a block ([`GemvQ8Variant::split_k`]).
    pub gemv_split_k: bool,
    /// Let a one-token int8 GEMV without a hand-off that would leave half the SMs idle spread
    /// its rows over 16-row blocks ([`GemvQ8Variant::spread_rows`]; the decode plan then drops
    /// such producers' hand-offs, [`gemv_spreads_rows`]).
    pub spread_rows: bool,
    /// Largest token count that takes the small-batch tensor-core GEMM in [`LinearPath::Auto`]
    /// (quantized weights above `gemv_max_tokens`; 0 never).
    pub mma_max_tokens: usize,
    /// Let the small-batch GEMM use warpgroup MMAs from [`WGMMA_MIN_TOKENS`] tokens (rows of
    /// whole 128-column chunks; ignored on devices without them, [`Gpu::supports_wgmma`]).
    pub wgmma: bool,
    /// Let the warpgroup-MMA GEMM apply a fused gate/up weight's GLU in its epilogue
    /// ([`glu_fuses`]).
    pub gemm_glu: bool,
    /// Let that epilogue write the down projection's staged 16-bit input
    /// ([`linear_glu_staged`]; the executor plans it).
    pub staged_handoff: bool,
}

impl Default for LinearOptions {
    fn default() -> Self {
        LinearOptions {
            path: LinearPath::Auto,
            precision: Precision::BF16,
            gemv_max_tokens: 8,
            activations: GemvActivations::Q8,
            gemv_split_k: true,
            spread_rows: true,
            mma_max_tokens: 64,
            wgmma: true,
            gemm_glu: true,
            staged_handoff: true,
        }
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
            Some(0) => LinearPath::Auto,
            Some(1) => LinearPath::Gemv,
            Some(2) => LinearPath::Gemm,
            _ => d.path,
        };
        let precision = match pick(&env::CUDA_GEMM_PRECISION, &["f32", "f16", "bf16"]) {
            Some(0) => Precision::F32,
            Some(1) => Precision::F16,
            Some(2) => Precision::BF16,
            _ => d.precision,
        };
        let gemv_max_tokens = env::CUDA_GEMV_MAX_TOKENS.parse(d.gemv_max_tokens);
        let activations = match pick(&env::CUDA_GEMV_ACTIVATIONS, &["q8", "f32"]) {
            Some(0) => GemvActivations::Q8,
            Some(1) => GemvActivations::F32,
            _ => d.activations,
        };
        let gemv_split_k = !env::DISABLE_GEMV_SPLIT_K.flag();
        let spread_rows = !env::DISABLE_CUDA_SPREAD_ROWS.flag();
        let mma_max_tokens = env::CUDA_MMA_MAX_TOKENS.parse(d.mma_max_tokens);
        let wgmma = !env::DISABLE_CUDA_WGMMA.flag();
        let gemm_glu = !env::DISABLE_CUDA_GEMM_GLU.flag();
        let staged_handoff = !env::DISABLE_CUDA_STAGED_HANDOFF.flag();
        LinearOptions { path, precision, gemv_max_tokens, activations, gemv_split_k, spread_rows, mma_max_tokens, wgmma, gemm_glu, staged_handoff }
    }
}

/// The kernel sequence [`linear`] runs for a shape.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LinearPlan {
    /// f32-activation GEMV.
    Gemv,
    /// int8-activation GEMV (quantized weights only).
    GemvQ8,
    /// Small-batch tensor-core GEMM on the packed weights, activations converted to f16/bf16;
    /// `wgmma`: on warpgroup MMAs, else `mma.sync`.
    Mma { precision: Precision, wgmma: bool },
    Gemm {
        precision: Precision,
        /// Weight dequantized/converted into scratch first (false: cuBLAS reads it as stored).
        dequantize_weight: bool,
        /// Activations converted to f16/bf16 in scratch first.
        convert_input: bool,
    },
}

/// Largest batch for which the `mma.sync` small-batch GEMM on the packed weight is chosen over
/// cuBLAS on a resident bf16 copy; larger batches take the warpgroup-MMA one where it runs.
pub const MMA_OVER_RESIDENT_MAX_TOKENS: usize = 32;

/// Smallest batch that takes the warpgroup-MMA GEMM. Its 32-token tiling beats `mma.sync` on
/// the 8B gate/up alone (46 vs 56 µs) and not end to end (x32 6.93k → 6.87k tok/s), so batches
/// up to 32 tokens stay on `mma.sync` (docs/perf.md, stop 20).
pub const WGMMA_MIN_TOKENS: usize = MMA_OVER_RESIDENT_MAX_TOKENS + 1;

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
        let quantized = weight::planes(dtype).is_some();
        return if quantized && opts.activations == GemvActivations::Q8 { LinearPlan::GemvQ8 } else { LinearPlan::Gemv };
    }
    let mma = opts.path == LinearPath::Auto
        && n_tokens <= opts.mma_max_tokens
        && weight::planes(dtype).is_some()
        && cols.is_multiple_of(32)
        && opts.precision != Precision::F32;
    if mma {
        // Above 32 tokens the warpgroup kernel takes the batch (over a resident copy only the
        // weights with enough work per block, `resolved_plan`).
        let wgmma = opts.wgmma && n_tokens >= WGMMA_MIN_TOKENS && cols.is_multiple_of(GEMM_CHUNK_COLS);
        return LinearPlan::Mma { precision: opts.precision, wgmma };
    }
    LinearPlan::Gemm {
        precision: opts.precision,
        dequantize_weight: dtype != opts.precision.native_weight(),
        convert_input: opts.precision != Precision::F32,
    }
}

/// Bytes of a resident copy of a `rows x cols` weight in the GEMM input type of `precision`
/// (see [`expand_weight`]); 0 when the GEMM reads the weight as stored.
pub fn expanded_bytes(dtype: GgmlType, rows: usize, cols: usize, precision: Precision) -> usize {
    if dtype == precision.native_weight() {
        return 0;
    }
    rows * cols * precision.out_type().bytes()
}

/// Keep a resident copy of `w` dequantized to the GEMM input type of `precision`, so that the
/// GEMM path (prefill) reads it directly instead of dequantizing the weight into scratch on every
/// call: memory for speed (a bf16 copy is 2 bytes per weight). Nothing to do for a weight the
/// GEMM reads as stored. The packed weight stays for the GEMV path.
pub fn expand_weight(gpu: &Gpu, w: &mut DeviceWeight, precision: Precision) -> Result<(), CudaError> {
    const OP: &str = "expand_weight";
    let bytes = expanded_bytes(w.dtype, w.rows, w.cols, precision);
    if bytes == 0 || w.expanded.as_ref().is_some_and(|(t, _)| *t == precision.out_type()) {
        return Ok(());
    }
    let mut data = gpu.alloc_zeros::<u8>(bytes)?;
    let variant = DequantVariant { wtype: w.dtype, out: precision.out_type() };
    let [w0, w1, w2, w3] = w.plane_ptrs(gpu);
    let params = DequantParams { w0, w1, w2, w3, out: addr_mut(gpu, &mut data), rows: as_u32(OP, "rows", w.rows)?, cols: as_u32(OP, "cols", w.cols)? };
    gpu.launch(&variant, "dequantize", variant.launch_config(w.rows), &params)?;
    w.expanded = Some((precision.out_type(), data));
    Ok(())
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
    linear_at("linear", gpu, w, x, &LinearFusion::default(), n_tokens, out, None, opts)
}

/// What a linear folds in besides `x · Wᵀ`: the RMSNorm of its input, the residual added to its
/// output (both declared in the graph at load).
#[derive(Clone, Copy, Default)]
pub struct LinearFusion<'a> {
    pub norm: Option<NormPrologue<'a>>,
    /// `[n_tokens, w.rows]`, added to the whole output.
    pub residual: Option<&'a CudaSlice<f32>>,
    /// The activation of a fused gate/up weight in the GEMM's epilogue: `out[t, r] =
    /// act(x W[r]) * (x W[rows / 2 + r])`, `[n_tokens, w.rows / 2]`. Only where [`glu_fuses`]
    /// says so (no residual then); elsewhere the caller runs the linear, then [`super::glu_rows`].
    pub glu: Option<Glu>,
}

/// Whether [`linear_fused`] of `w` at `n_tokens` can apply a GLU in its epilogue: the 64-token
/// warpgroup-MMA tiling (its two warpgroups take the gate and the up tile of the same rows) in
/// one K slice.
pub fn glu_fuses(gpu: &Gpu, w: &DeviceWeight, n_tokens: usize, opts: &LinearOptions) -> bool {
    if !opts.gemm_glu {
        return false;
    }
    glu_variant(w, n_tokens, device_plan(gpu, w, n_tokens, opts), gpu.sm_count() as usize).is_some()
}

/// The GEMM tiling that applies the GLU in its epilogue for `plan`, if it can.
fn glu_variant(w: &DeviceWeight, n_tokens: usize, plan: LinearPlan, sm_count: usize) -> Option<GemmMmaVariant> {
    let LinearPlan::Mma { precision, wgmma: true } = plan else { return None };
    let v = GemmMmaVariant::for_wgmma(w.dtype, n_tokens, precision == Precision::BF16);
    (v.can_fuse_glu() && w.rows.is_multiple_of(2) && v.k_slices(w.rows, w.cols, n_tokens, sm_count) == 1).then_some(v)
}

/// [`linear_with`] of `RMSNorm(x)`, plus the residual: the tensor-core paths normalise straight
/// into their f16/bf16 input (one launch instead of a norm and a conversion, the same bits) and
/// add the residual in their epilogues (cuBLASLt's, `gemm_mma`'s or `gemm_reduce`'s); the others
/// normalise into `norm_scratch` (f32, at least `[n_tokens, w.cols]`; untouched without a norm)
/// first and add the residual after.
#[allow(clippy::too_many_arguments)]
pub fn linear_fused(
    gpu: &Gpu,
    w: &DeviceWeight,
    x: &impl DevicePtr<f32>,
    fusion: &LinearFusion,
    n_tokens: usize,
    out: &mut impl DevicePtrMut<f32>,
    norm_scratch: &mut impl DevicePtrMut<f32>,
    opts: &LinearOptions,
) -> Result<LinearPlan, CudaError> {
    let scratch = (addr_mut(gpu, norm_scratch), norm_scratch.len());
    linear_at("linear_fused", gpu, w, x, fusion, n_tokens, out, Some(scratch), opts)
}

/// [`linear_fused`] for op name `op` (its errors' prefix); `norm_scratch` is the address and
/// length of the f32 scratch, needed only by a norm on a path that cannot fold it.
#[allow(clippy::too_many_arguments)]
fn linear_at(
    op: &'static str,
    gpu: &Gpu,
    w: &DeviceWeight,
    x: &impl DevicePtr<f32>,
    fusion: &LinearFusion,
    n_tokens: usize,
    out: &mut impl DevicePtrMut<f32>,
    norm_scratch: Option<(u64, usize)>,
    opts: &LinearOptions,
) -> Result<LinearPlan, CudaError> {
    let plan = device_plan(gpu, w, n_tokens, opts);
    if n_tokens == 0 {
        return Ok(plan);
    }
    if let Some(glu) = fusion.glu {
        return linear_glu(op, gpu, w, x, fusion, glu, plan, n_tokens, out);
    }
    let (x, out) = linear_operands(op, gpu, w, x, n_tokens, out)?;
    let residual = residual_addr(op, gpu, fusion.residual, n_tokens, w.rows)?;
    let Some(row_norm) = row_norm(op, gpu, fusion.norm, w.cols)? else {
        run_plan(gpu, w, plan, Input { x, norm: None }, n_tokens, out, residual)?;
        return Ok(plan);
    };
    if matches!(plan, LinearPlan::Mma { .. } | LinearPlan::Gemm { convert_input: true, .. }) {
        run_plan(gpu, w, plan, Input { x, norm: Some(&row_norm) }, n_tokens, out, residual)?;
    } else {
        let (normed, len) = norm_scratch.ok_or_else(|| CudaError::invalid(op, "a norm on this path needs an f32 scratch"))?;
        check_len(op, "norm scratch", len, elems(op, &[n_tokens, w.cols])?)?;
        norm_rows(gpu, x, &row_norm, n_tokens, w.cols, normed, OutType::F32, MmaOrder::Natural, 0)?;
        run_plan(gpu, w, plan, Input { x: normed, norm: None }, n_tokens, out, residual)?;
    }
    Ok(plan)
}

/// A linear's folded norm as the kernels take it, its weight checked against `cols`.
fn row_norm(op: &'static str, gpu: &Gpu, norm: Option<NormPrologue>, cols: usize) -> Result<Option<RowNorm>, CudaError> {
    let Some(norm) = norm else { return Ok(None) };
    check_len(op, "norm weight", norm.weight.len(), cols)?;
    Ok(Some(RowNorm { weight: addr(gpu, norm.weight), eps: norm.eps, add_one: norm.add_one }))
}

/// [`linear_at`] with the GLU in the GEMM's epilogue (an error where [`glu_fuses`] is false).
#[allow(clippy::too_many_arguments)]
fn linear_glu(
    op: &'static str,
    gpu: &Gpu,
    w: &DeviceWeight,
    x: &impl DevicePtr<f32>,
    fusion: &LinearFusion,
    glu: Glu,
    plan: LinearPlan,
    n_tokens: usize,
    out: &mut impl DevicePtrMut<f32>,
) -> Result<LinearPlan, CudaError> {
    let variant = glu_variant(w, n_tokens, plan, gpu.sm_count() as usize).filter(|_| fusion.residual.is_none()).ok_or_else(|| {
        CudaError::invalid(op, format!("no GLU epilogue for a {} {}x{} weight at {n_tokens} tokens ({plan:?}, residual: {})", w.dtype, w.rows, w.cols, fusion.residual.is_some()))
    })?;
    check_len(op, "x", x.len(), elems(op, &[n_tokens, w.cols])?)?;
    check_len(op, "out", out.len(), elems(op, &[n_tokens, w.rows / 2])?)?;
    let (x, out) = (addr(gpu, x), addr_mut(gpu, out));
    let row_norm = row_norm(op, gpu, fusion.norm, w.cols)?;
    gemm_mma(gpu, w, MmaInput::Rows(Input { x, norm: row_norm.as_ref() }), n_tokens, MmaOutput::Rows(out), None, GemmMmaVariant { glu: glu as u32, ..variant })?;
    Ok(plan)
}

/// A batched linear's input in the 16-bit type and column order its GEMM reads (the
/// warpgroup-MMA stage image, or rows for cuBLAS), written by the op that produces it
/// ([`linear_glu_staged`], or attention through `AttentionEmit::Staged`), so that the consumer
/// ([`linear_staged`]) runs no conversion launch and reads half the bytes of f32 rows.
pub struct StagedActivations {
    data: CudaSlice<u16>,
    /// The layout the last producer wrote: what a consumer must expect.
    written: Option<StagedLayout>,
}

/// The order, precision and shape of staged activations.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StagedLayout {
    pub order: MmaOrder,
    pub precision: Precision,
    pub n_tokens: usize,
    pub cols: usize,
}

impl StagedActivations {
    /// Room for `max_tokens` rows (rounded up to whole 64-token tiles) of `max_cols` values.
    pub fn new(gpu: &Gpu, max_tokens: usize, max_cols: usize) -> Result<Self, CudaError> {
        let len = elems("StagedActivations::new", &[max_tokens.next_multiple_of(64).max(64), max_cols.max(1)])?;
        Ok(StagedActivations { data: gpu.alloc_zeros(len)?, written: None })
    }

    /// Whether activations staged in `layout` fit.
    pub fn fits(&self, layout: &StagedLayout) -> bool {
        layout.order.padded_rows(layout.n_tokens).checked_mul(layout.cols).is_some_and(|n| n <= self.data.len())
    }

    /// The device address a producer writes `layout` at, recording that layout for the
    /// consumer; an error where it does not fit.
    pub(super) fn stage(&mut self, op: &'static str, gpu: &Gpu, layout: StagedLayout) -> Result<u64, CudaError> {
        if !self.fits(&layout) {
            return Err(CudaError::invalid(op, format!("{layout:?} does not fit the staged buffer of {} values", self.data.len())));
        }
        self.written = Some(layout);
        Ok(addr_mut(gpu, &mut self.data))
    }

    /// The layout `w` reads its staged input in at `n_tokens` with `opts`: the stage image of
    /// the warpgroup-MMA GEMM, or 16-bit rows for cuBLAS; `None` on the other paths (the
    /// GEMVs, `mma.sync`, f32 GEMMs).
    pub fn layout_for(gpu: &Gpu, w: &DeviceWeight, n_tokens: usize, opts: &LinearOptions) -> Option<StagedLayout> {
        staged_layout(device_plan(gpu, w, n_tokens, opts), w, n_tokens)
    }
}

/// The staged input layout of `w` at `n_tokens` under `plan` (see [`StagedActivations::layout_for`]).
fn staged_layout(plan: LinearPlan, w: &DeviceWeight, n_tokens: usize) -> Option<StagedLayout> {
    let (order, precision) = match plan {
        LinearPlan::Mma { precision, wgmma: true } if w.cols.is_multiple_of(GEMM_CHUNK_COLS) => {
            (GemmMmaVariant::for_wgmma(w.dtype, n_tokens, precision == Precision::BF16).activation_order(), precision)
        }
        LinearPlan::Gemm { precision, convert_input: true, .. } if precision != Precision::F32 => (MmaOrder::Natural, precision),
        _ => return None,
    };
    Some(StagedLayout { order, precision, n_tokens, cols: w.cols })
}

/// [`linear_fused`] with a GLU epilogue whose output goes to `dst` in `layout` (the consumer's,
/// from [`StagedActivations::layout_for`]) instead of f32 rows: an error where [`glu_fuses`] is
/// false, or where the layout is not the GLU GEMM's 16-bit type over its `w.rows / 2` outputs.
#[allow(clippy::too_many_arguments)]
pub fn linear_glu_staged(
    gpu: &Gpu,
    w: &DeviceWeight,
    x: &impl DevicePtr<f32>,
    norm: Option<NormPrologue>,
    glu: Glu,
    n_tokens: usize,
    dst: &mut StagedActivations,
    layout: StagedLayout,
    opts: &LinearOptions,
) -> Result<(), CudaError> {
    const OP: &str = "linear_glu_staged";
    let plan = device_plan(gpu, w, n_tokens, opts);
    let variant = glu_variant(w, n_tokens, plan, gpu.sm_count() as usize)
        .filter(|v| opts.gemm_glu && layout.n_tokens == n_tokens && layout.cols == w.rows / 2 && layout.precision == if v.bf16 { Precision::BF16 } else { Precision::F16 })
        .ok_or_else(|| CudaError::invalid(OP, format!("no staged GLU epilogue for a {} {}x{} weight at {n_tokens} tokens into {layout:?} ({plan:?})", w.dtype, w.rows, w.cols)))?;
    let MmaOrder::Wgmma { tile_tokens } = layout.order else {
        return Err(CudaError::invalid(OP, format!("a staged GLU output is written in the wgmma order, not {layout:?}")));
    };
    check_len(OP, "x", x.len(), elems(OP, &[n_tokens, w.cols])?)?;
    let row_norm = row_norm(OP, gpu, norm, w.cols)?;
    let out = dst.stage(OP, gpu, layout)?;
    let variant = GemmMmaVariant { glu: glu as u32, staged_out: true, ..variant };
    gemm_mma(gpu, w, MmaInput::Rows(Input { x: addr(gpu, x), norm: row_norm.as_ref() }), n_tokens, MmaOutput::Staged { dst: out, tile_tokens }, None, variant)
}

/// `out = x · Wᵀ (+ residual)` on activations a producer staged for `w` in
/// `StagedActivations::layout_for(w, n_tokens)` ([`linear_glu_staged`], or an attention kernel
/// through `AttentionEmit::Staged`): an error if they were staged in another layout.
pub fn linear_staged(
    gpu: &Gpu,
    w: &DeviceWeight,
    x: &StagedActivations,
    n_tokens: usize,
    residual: Option<&CudaSlice<f32>>,
    out: &mut impl DevicePtrMut<f32>,
    opts: &LinearOptions,
) -> Result<(), CudaError> {
    const OP: &str = "linear_staged";
    let plan = device_plan(gpu, w, n_tokens, opts);
    let layout = staged_layout(plan, w, n_tokens);
    if layout.is_none() || layout != x.written {
        return Err(CudaError::invalid(OP, format!("a {} {}x{} weight at {n_tokens} tokens reads {layout:?}, but the activations were staged as {:?}", w.dtype, w.rows, w.cols, x.written)));
    }
    check_len(OP, "out", out.len(), elems(OP, &[n_tokens, w.rows])?)?;
    let residual = residual_addr(OP, gpu, residual, n_tokens, w.rows)?;
    let (x, out) = (addr(gpu, &x.data), addr_mut(gpu, out));
    match plan {
        LinearPlan::Gemm { precision, dequantize_weight, .. } => gemm(gpu, w, Input { x, norm: None }, n_tokens, out, residual, precision, dequantize_weight, false),
        LinearPlan::Mma { precision, .. } => {
            let variant = GemmMmaVariant::for_wgmma(w.dtype, n_tokens, precision == Precision::BF16);
            gemm_mma(gpu, w, MmaInput::Staged(x), n_tokens, MmaOutput::Rows(out), residual, variant)
        }
        plan => unreachable!("layout_for stages no input for {plan:?}"),
    }
}

/// Chunks of work per block slot from which the warpgroup-MMA GEMM beats cuBLAS on a resident
/// bf16 copy at 33–64 tokens (H200, `kernel_bench batched` and `tilings`, docs/perf.md): the 8B
/// gate/up (27 chunks per slot) and down (14) shapes gain 16–19 and 7–8 µs, the QKV (6) and
/// output (4) shapes lose, where each block's short K walk and the split-K reduce weigh more.
pub const WGMMA_MIN_CHUNKS_PER_SLOT: usize = 8;

/// [`resolved_plan`] on `gpu`: warpgroup MMAs only where the device has them.
fn device_plan(gpu: &Gpu, w: &DeviceWeight, n_tokens: usize, opts: &LinearOptions) -> LinearPlan {
    let opts = LinearOptions { wgmma: opts.wgmma && gpu.supports_wgmma(), ..*opts };
    resolved_plan(w, n_tokens, &opts, gpu.sm_count() as usize)
}

/// The device address of a linear's residual (`[n_tokens, rows]`), its length checked.
fn residual_addr(op: &'static str, gpu: &Gpu, residual: Option<&CudaSlice<f32>>, n_tokens: usize, rows: usize) -> Result<Option<u64>, CudaError> {
    let Some(r) = residual else { return Ok(None) };
    check_len(op, "residual", r.len(), elems(op, &[n_tokens, rows])?)?;
    Ok(Some(addr(gpu, r)))
}

/// [`linear_plan`] with the weight's resident copy taken into account (`sm_count` sizes the
/// warpgroup-MMA GEMM's grid).
fn resolved_plan(w: &DeviceWeight, n_tokens: usize, opts: &LinearOptions, sm_count: usize) -> LinearPlan {
    let resident = |precision: Precision| w.expanded.as_ref().is_some_and(|(t, _)| *t == precision.out_type());
    match linear_plan(w.dtype, w.cols, n_tokens, opts) {
        // An expanded copy in the GEMM's input type needs no per-call dequantization; cuBLAS on
        // it beats the mma.sync small-batch GEMM on the packed weight above 32 tokens on the
        // H200, which is faster up to 32 (docs/perf.md); the wgmma one beats both on weights
        // with enough work per block.
        LinearPlan::Gemm { precision, convert_input, .. } if resident(precision) => {
            LinearPlan::Gemm { precision, dequantize_weight: false, convert_input }
        }
        LinearPlan::Mma { precision, wgmma: allowed } => {
            let pays = allowed && wgmma_pays(w.dtype, w.rows, w.cols, n_tokens, sm_count);
            let above = n_tokens > MMA_OVER_RESIDENT_MAX_TOKENS;
            if above && resident(precision) && !pays {
                LinearPlan::Gemm { precision, dequantize_weight: false, convert_input: true }
            } else {
                // Above 32 tokens without a copy, wgmma beats mma.sync on every 8B shape.
                LinearPlan::Mma { precision, wgmma: allowed && (above || pays) }
            }
        }
        plan => plan,
    }
}

/// Whether a `rows x cols` weight has [`WGMMA_MIN_CHUNKS_PER_SLOT`] chunks of work per block
/// slot of the warpgroup-MMA GEMM at `n_tokens`.
fn wgmma_pays(dtype: GgmlType, rows: usize, cols: usize, n_tokens: usize, sm_count: usize) -> bool {
    let v = GemmMmaVariant::for_wgmma(dtype, n_tokens, true);
    let chunks = rows.div_ceil(v.block_rows()) * cols.div_ceil(GEMM_CHUNK_COLS);
    chunks >= WGMMA_MIN_CHUNKS_PER_SLOT * v.occupancy as usize * sm_count
}

/// A linear's input rows: f32 activations at `x`, RMS-normalised on the way in when `norm` is
/// set (only on the paths that convert their input: the norm writes the converted rows).
#[derive(Clone, Copy)]
struct Input<'a> {
    x: u64,
    norm: Option<&'a RowNorm>,
}

/// Where `gemm_mma` finds its activations: f32 rows, converted (and maybe normalised) into
/// scratch first, or a staged buffer already in its input type and order.
enum MmaInput<'a> {
    Rows(Input<'a>),
    Staged(u64),
}

/// Where `gemm_mma` writes: f32 rows, or (GLU epilogue) the next GEMM's staged input, tiled by
/// `tile_tokens` tokens.
enum MmaOutput {
    Rows(u64),
    Staged { dst: u64, tile_tokens: usize },
}

/// Run `plan`; `out += residual` after it (the tensor-core paths add it in their epilogues).
fn run_plan(
    gpu: &Gpu,
    w: &DeviceWeight,
    plan: LinearPlan,
    input: Input,
    n_tokens: usize,
    out: u64,
    residual: Option<u64>,
) -> Result<(), CudaError> {
    const OP: &str = "linear";
    let x = input.x;
    if plan == LinearPlan::Gemv && !x.is_multiple_of(16) {
        return Err(CudaError::invalid(
            OP,
            format!("x at device address {x:#x} is not 16-byte aligned, as the GEMV needs"),
        ));
    }
    match plan {
        LinearPlan::Gemm { precision, dequantize_weight, convert_input } => {
            return gemm(gpu, w, input, n_tokens, out, residual, precision, dequantize_weight, convert_input);
        }
        LinearPlan::Mma { precision, wgmma } => {
            let bf16 = precision == Precision::BF16;
            let variant = if wgmma { GemmMmaVariant::for_wgmma(w.dtype, n_tokens, bf16) } else { GemmMmaVariant::for_shape(w.dtype, n_tokens, bf16) };
            return gemm_mma(gpu, w, MmaInput::Rows(input), n_tokens, MmaOutput::Rows(out), residual, variant);
        }
        LinearPlan::Gemv => gemv(gpu, w, x, n_tokens, out, w.rows, None),
        LinearPlan::GemvQ8 => {
            let (q_bytes, s_bytes, _) = Q8Activations::sizes(n_tokens * w.cols);
            gpu.with_scratch(q_bytes + s_bytes, |scratch| {
                let input = Q8Input { xq: scratch, xs: scratch + q_bytes as u64, norm: None, f32_row: None };
                quantize_raw(gpu, x, w.cols, n_tokens, w.cols, None, input.xq, input.xs)?;
                gemv_q8(gpu, w, None, None, input, n_tokens, w.rows, (out, w.rows, 0), &Epilogue::default(), None, None)
            })
        }
    }?;
    match residual {
        Some(r) => super::add_raw(gpu, out, r, n_tokens * w.rows),
        None => Ok(()),
    }
}

/// The rows of a MoE expert GEMV (device side): pair `i` multiplies rows `ids[i] *
/// expert_rows + expert_off ..` of the bank with activation row `i / x_div` and writes output
/// row `i`. Grid y walks the pairs one by one, or with `groups` (int8 GEMV only) the tiles of
/// pairs of one expert that `moe_group` listed.
#[derive(Clone, Copy, Debug)]
pub(super) struct ExpertRows {
    pub ids: u64,
    pub n_experts: usize,
    pub expert_rows: usize,
    pub expert_off: usize,
    pub x_div: usize,
    pub groups: Option<ExpertGroups>,
}

/// `moe_group`'s output as the grouped GEMV reads it: the tile list (of `max_tiles` entries,
/// the grid) and the permutation.
#[derive(Clone, Copy, Debug)]
pub(super) struct ExpertGroups {
    pub tiles: u64,
    pub perm: u64,
    pub max_tiles: usize,
}

impl ExpertRows {
    /// The parameter fields: (expert_rows, expert_off, n_experts, x_div).
    fn fields(e: Option<ExpertRows>, op: &'static str) -> Result<(u32, u32, u32, u32), CudaError> {
        Ok(match e {
            Some(e) => (
                as_u32(op, "expert rows", e.expert_rows)?,
                as_u32(op, "expert row offset", e.expert_off)?,
                as_u32(op, "experts", e.n_experts)?,
                as_u32(op, "pairs per activation row", e.x_div.max(1))?,
            ),
            None => (0, 0, 0, 1),
        })
    }
}

/// The f32-activation GEMV: `out_rows` outputs per token (all of `w`'s rows, or with `experts`
/// the rows of one expert).
pub(super) fn gemv(gpu: &Gpu, w: &DeviceWeight, x: u64, n_tokens: usize, out: u64, out_rows: usize, experts: Option<ExpertRows>) -> Result<(), CudaError> {
    const OP: &str = "linear";
    if experts.is_some_and(|e| e.groups.is_some()) {
        return Err(CudaError::invalid(OP, "the f32 GEMV has no grouped expert form (int8 activations only)"));
    }
    let variant = if experts.is_some() { GemvVariant::for_experts(w.dtype) } else { GemvVariant::for_shape(w.dtype, n_tokens) };
    let [w0, w1, w2, w3] = w.plane_ptrs(gpu);
    let (expert_rows, expert_off, n_experts, x_div) = ExpertRows::fields(experts, OP)?;
    let params = GemvParams {
        w0,
        w1,
        w2,
        w3,
        x,
        out,
        experts: experts.map_or(0, |e| e.ids),
        error_flag: gpu.error_flag_ptr(),
        rows: as_u32(OP, "rows", out_rows)?,
        cols: as_u32(OP, "cols", w.cols)?,
        n_tokens: as_u32(OP, "n_tokens", n_tokens)?,
        expert_rows,
        expert_off,
        n_experts,
        x_div,
        pad: 0,
    };
    let cfg = variant.launch_config(out_rows, n_tokens);
    if cfg.grid_dim.1 > 65535 {
        return Err(CudaError::invalid(OP, format!("{n_tokens} tokens exceed the GEMV grid; use the GEMM path")));
    }
    gpu.launch(&variant, "gemv", cfg, &params)
}

/// Activations quantized for the int8 GEMV (see [`crate::kernels::quantize`] for the layout),
/// in a device buffer sized once for the largest `rows x cols` it will hold. Written by
/// [`quantize_q8`], or by the producer of an int8 hand-off ([`Q8Emit`]), which may leave the
/// codes of `x * norm weight` and per-block sums of squares for the consumer to finish the norm.
pub struct Q8Activations {
    data: CudaSlice<u8>,
    capacity: usize,
    /// Shape of the last write into this buffer.
    rows: usize,
    cols: usize,
    /// `Some(eps)`: the codes still lack the RMSNorm's `1 / rms` (an int8 hand-off with a norm).
    pending_norm: Option<f32>,
}

impl Q8Activations {
    pub fn new(gpu: &Gpu, max_elems: usize) -> Result<Self, CudaError> {
        let (q, s, p) = Self::sizes(max_elems);
        Ok(Q8Activations { data: gpu.alloc_zeros(q + s + p)?, capacity: max_elems, rows: 0, cols: 0, pending_norm: None })
    }

    /// Bytes of the codes (padded for alignment), of the block scales, and of the per-block sums
    /// of squares for `elems` values.
    fn sizes(elems: usize) -> (usize, usize, usize) {
        (elems.next_multiple_of(SCRATCH_ALIGN), (elems / 32 * 8).next_multiple_of(SCRATCH_ALIGN), elems / 32 * 4)
    }

    /// Device addresses of the codes, the block scales and the sums of squares.
    pub(super) fn ptrs(&self, gpu: &Gpu) -> (u64, u64, u64) {
        let base = addr(gpu, &self.data);
        let (q, s, _) = Self::sizes(self.capacity);
        (base, base + q as u64, base + (q + s) as u64)
    }

    /// Device bytes held.
    pub fn bytes(&self) -> usize {
        self.data.len()
    }

    /// The GEMV's view of the last write.
    pub(super) fn input(&self, gpu: &Gpu) -> Q8Input {
        let (xq, xs, partials) = self.ptrs(gpu);
        Q8Input { xq, xs, norm: self.pending_norm.map(|eps| (partials, eps)), f32_row: None }
    }

    /// Rows and columns of the last write.
    pub(super) fn shape(&self) -> (usize, usize) {
        (self.rows, self.cols)
    }

    /// Record the shape about to be written; an error if it does not fit.
    pub(super) fn fill(&mut self, op: &'static str, rows: usize, cols: usize, pending_norm: Option<f32>) -> Result<(), CudaError> {
        if !cols.is_multiple_of(32) || cols == 0 {
            return Err(CudaError::invalid(op, format!("{cols} columns are not whole 32-value blocks")));
        }
        check_len(op, "the quantized buffer", self.capacity, elems(op, &[rows, cols])?)?;
        (self.rows, self.cols, self.pending_norm) = (rows, cols, pending_norm);
        Ok(())
    }
}

/// The producer side of an int8 hand-off: a kernel that writes f32 rows (`linear_q8`,
/// `attention`) also quantizes them into `dst` for the next int8 GEMV, which then needs no
/// quantize launch. With `norm` (the consumer's RMSNorm), the codes are of `x * norm weight`
/// and the consumer applies `1 / rms(x)` to its dot products (quantization is scale-invariant).
pub struct Q8Emit<'a> {
    pub dst: &'a mut Q8Activations,
    pub norm: Option<NormPrologue<'a>>,
}

/// RMSNorm applied before quantizing (the norm of a norm-folded linear).
#[derive(Clone, Copy)]
pub struct NormPrologue<'a> {
    pub weight: &'a CudaSlice<f32>,
    pub eps: f32,
    /// Gemma's `(1 + w)` convention.
    pub add_one: bool,
}

/// The gated activation of a `[gate; up]` weight: `out = act(x gate^T) * (x up^T)`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Glu {
    SwiGlu = 1,
    GeGlu = 2,
}

/// What the int8 GEMV does before storing: `out = x W^T + bias + residual`, the residual laid
/// out like the output; or, with `glu`, `out = act(gate) * up` over the two halves of `W`'s
/// rows (no bias or residual then); and with `glu` and `down` (one token, see [`mlp_q8`]),
/// `out += down · (act(gate) * up)` instead of a store.
#[derive(Clone, Copy, Default)]
pub struct Epilogue<'a> {
    pub bias: Option<&'a CudaSlice<f32>>,
    pub residual: Option<&'a CudaSlice<f32>>,
    /// The residual is `out` itself (`out += x W^T`: each output read, then written, by one
    /// thread); instead of `residual`.
    pub accumulate: bool,
    pub glu: Option<Glu>,
    pub down: Option<&'a DeviceWeight>,
    /// Let the next launch be scheduled before this one waits for its predecessor (programmatic
    /// dependent launch): its blocks become resident and request their weights while this
    /// kernel's predecessor still runs. Only for a launch whose neighbours release after their
    /// wait (the decode plan's QKV and output projections), so that at most three grids are
    /// resident at once and what a kernel reads before its wait was written three or more
    /// launches back.
    pub early_release: bool,
}

/// Quantize `n_rows` rows of `cols` f32 values (`cols % 32 == 0`) into `dst`, normalising each
/// row first when `norm` is given.
pub fn quantize_q8(
    gpu: &Gpu,
    x: &impl DevicePtr<f32>,
    n_rows: usize,
    cols: usize,
    norm: Option<NormPrologue>,
    dst: &mut Q8Activations,
) -> Result<(), CudaError> {
    const OP: &str = "quantize_q8";
    dst.fill(OP, n_rows, cols, None)?;
    check_len(OP, "x", x.len(), elems(OP, &[n_rows, cols])?)?;
    if let Some(nm) = &norm {
        check_len(OP, "norm weight", nm.weight.len(), cols)?;
    }
    let (xq, xs, _) = dst.ptrs(gpu);
    quantize_raw(gpu, addr(gpu, x), cols, n_rows, cols, norm, xq, xs)
}

#[allow(clippy::too_many_arguments)]
fn quantize_raw(
    gpu: &Gpu,
    x: u64,
    x_ld: usize,
    n_rows: usize,
    cols: usize,
    norm: Option<NormPrologue>,
    xq: u64,
    xs: u64,
) -> Result<(), CudaError> {
    const OP: &str = "quantize_q8";
    if n_rows == 0 {
        return Ok(());
    }
    if n_rows > 65535 {
        return Err(CudaError::invalid(OP, format!("{n_rows} rows exceed the launch grid (65535)")));
    }
    let prologue = if norm.is_some() { Prologue::RmsNorm } else { Prologue::Plain };
    let variant = QuantizeVariant::for_cols(cols, prologue);
    let params = QuantizeParams {
        x,
        norm_weight: norm.map_or(0, |n| addr(gpu, n.weight)),
        xq,
        xs,
        cols: as_u32(OP, "cols", cols)?,
        x_ld: as_u32(OP, "x_ld", x_ld)?,
        eps: norm.map_or(0.0, |n| n.eps),
        add_one: norm.is_some_and(|n| n.add_one) as u32,
    };
    gpu.launch(&variant, "quantize_q8", variant.launch_config(n_rows, cols), &params)
}

/// The int8 GEMV: `out[t, out_col + r] (row stride out_ld) = sum_c w[r, c] x[t, c] + epilogue`
/// for the first `n_tokens` rows quantized into `x`; with `emit`, the stored rows are also
/// quantized for the next int8 GEMV (an int8 hand-off: `out_col == 0`, `out_ld` = the output
/// width, a multiple of 32).
#[allow(clippy::too_many_arguments)]
pub fn linear_q8(
    gpu: &Gpu,
    w: &DeviceWeight,
    x: &Q8Activations,
    n_tokens: usize,
    out: &mut impl DevicePtrMut<f32>,
    out_ld: usize,
    out_col: usize,
    epilogue: &Epilogue,
    emit: Option<Q8Emit>,
) -> Result<(), CudaError> {
    linear_q8_retiled(gpu, w, x, n_tokens, out, out_ld, out_col, epilogue, emit, None)
}

/// Changes the tiling the dispatcher picked for an int8 GEMV (`kernel_bench`'s tiling sweeps).
pub type Retile<'a> = &'a dyn Fn(GemvQ8Variant) -> GemvQ8Variant;

/// [`linear_q8`] with its tiling passed through `retile` (`None`: as dispatched). A tiling the
/// kernel cannot take fails to compile, reported as an error.
#[allow(clippy::too_many_arguments)]
pub fn linear_q8_retiled(
    gpu: &Gpu,
    w: &DeviceWeight,
    x: &Q8Activations,
    n_tokens: usize,
    out: &mut impl DevicePtrMut<f32>,
    out_ld: usize,
    out_col: usize,
    epilogue: &Epilogue,
    emit: Option<Q8Emit>,
    retile: Option<Retile>,
) -> Result<(), CudaError> {
    const OP: &str = "linear_q8";
    if x.cols != w.cols || x.rows < n_tokens {
        return Err(CudaError::invalid(
            OP,
            format!("activations hold {} x {}, the weight needs {n_tokens} x {}", x.rows, x.cols, w.cols),
        ));
    }
    linear_q8_input(gpu, w, x.input(gpu), n_tokens, out, out_ld, out_col, epilogue, emit, retile)
}

/// Whether [`linear_q8`] of one token over `w` without a hand-off (`emit: None`) spreads its
/// rows over more blocks than a hand-off's 32-row blocks allow ([`GemvQ8Variant::spread_rows`],
/// unless `FERRITE_DISABLE_CUDA_SPREAD_ROWS=1`): then the decode plan lets it write its f32 row for a consumer
/// that quantizes it itself.
pub fn gemv_spreads_rows(gpu: &Gpu, w: &DeviceWeight) -> bool {
    let opts = gpu.linear_options();
    opts.gemv_split_k && opts.spread_rows && GemvQ8Variant::spreads_rows(w.dtype, w.rows, w.cols, gpu.sm_count())
}

/// [`linear_q8`] for one token whose activations are an f32 row `x` (`w.cols` values): every
/// block of the GEMV quantizes the row, normalised with `norm`, into its shared memory (no
/// quantize launch, no producer's hand-off).
#[allow(clippy::too_many_arguments)]
pub fn linear_q8_f32_row(
    gpu: &Gpu,
    w: &DeviceWeight,
    x: &impl DevicePtr<f32>,
    norm: Option<NormPrologue>,
    out: &mut impl DevicePtrMut<f32>,
    out_ld: usize,
    out_col: usize,
    epilogue: &Epilogue,
    emit: Option<Q8Emit>,
) -> Result<(), CudaError> {
    const OP: &str = "linear_q8_f32_row";
    if !w.cols.is_multiple_of(32) || w.cols == 0 {
        return Err(CudaError::invalid(OP, format!("{} columns are not whole 32-value blocks", w.cols)));
    }
    check_len(OP, "x", x.len(), w.cols)?;
    if let Some(nm) = &norm {
        check_len(OP, "norm weight", nm.weight.len(), w.cols)?;
    }
    let input = Q8Input {
        xq: 0,
        xs: 0,
        norm: norm.map(|nm| (0, nm.eps)),
        f32_row: Some((addr(gpu, x), norm.map(|nm| (addr(gpu, nm.weight), nm.add_one)))),
    };
    linear_q8_input(gpu, w, input, 1, out, out_ld, out_col, epilogue, emit, None)
}

/// Most atomic adds per token (down rows x 32-channel units) for which [`mlp_q8`] is chosen:
/// measured on the H100 (tg128, docs/perf.md stop 35), the 1B shape's 524 288 (2 048 rows x 256
/// units) made the step 17% slower; SmolLM2's 27 648 (576 x 48) left it 4.5% faster.
pub const MLP_MAX_ADDS: usize = 1 << 16;

/// The fused MLP of one token: `stream += down · act(x gate^T) * (x up^T)` in one int8 GEMV
/// launch, `gate_up` being the fused `[gate; up]` weight and `x` the int8 hand-off of the
/// normalised stream. Each block adds its share of the down projection into `stream` with
/// atomic adds, so the last bits of the sum vary from run to run.
pub fn mlp_q8(gpu: &Gpu, gate_up: &DeviceWeight, down: &DeviceWeight, x: &Q8Activations, glu: Glu, stream: &mut impl DevicePtrMut<f32>) -> Result<(), CudaError> {
    const OP: &str = "mlp_q8";
    let hidden = gate_up.rows / 2;
    if gate_up.dtype != down.dtype || down.cols != hidden || !hidden.is_multiple_of(32) || !gate_up.rows.is_multiple_of(2) {
        return Err(CudaError::invalid(
            OP,
            format!("gate/up ({} {}x{}) and down ({} {}x{}) must be one quantized type, down reading the gate/up's {hidden} outputs (whole 32-value units)", gate_up.dtype, gate_up.rows, gate_up.cols, down.dtype, down.rows, down.cols),
        ));
    }
    if x.cols != gate_up.cols || x.rows != 1 {
        return Err(CudaError::invalid(OP, format!("activations hold {} x {}, the fused MLP takes 1 x {}", x.rows, x.cols, gate_up.cols)));
    }
    check_len(OP, "stream", stream.len(), down.rows)?;
    let epilogue = Epilogue { glu: Some(glu), down: Some(down), ..Default::default() };
    let rows = down.rows;
    linear_q8_input(gpu, gate_up, x.input(gpu), 1, stream, rows, 0, &epilogue, None, None)
}

/// The checks and the hand-off of [`linear_q8_retiled`] and [`linear_q8_f32_row`] (the input's
/// shape already checked).
#[allow(clippy::too_many_arguments)]
fn linear_q8_input(
    gpu: &Gpu,
    w: &DeviceWeight,
    input: Q8Input,
    n_tokens: usize,
    out: &mut impl DevicePtrMut<f32>,
    out_ld: usize,
    out_col: usize,
    epilogue: &Epilogue,
    emit: Option<Q8Emit>,
    retile: Option<Retile>,
) -> Result<(), CudaError> {
    const OP: &str = "linear_q8";
    if weight::planes(w.dtype).is_none() {
        return Err(CudaError::invalid(OP, format!("the int8 GEMV needs a quantized weight, not {}", w.dtype)));
    }
    if n_tokens == 0 {
        return Ok(());
    }
    // With `down`, `out` is the down projection's output (`out_ld` its rows).
    let out_rows = match epilogue.glu {
        _ if epilogue.accumulate && epilogue.residual.is_some() => {
            return Err(CudaError::invalid(OP, "an epilogue adds either a residual or the output's own values, not both"));
        }
        Some(_) if !w.rows.is_multiple_of(2) || epilogue.bias.is_some() || epilogue.residual.is_some() || epilogue.accumulate => {
            return Err(CudaError::invalid(
                OP,
                format!("a gated epilogue needs an even number of weight rows ({}) and no bias or residual", w.rows),
            ))
        }
        Some(_) if epilogue.down.is_some() => out_ld,
        Some(_) => w.rows / 2,
        None => w.rows,
    };
    if out_col + out_rows > out_ld {
        return Err(CudaError::invalid(OP, format!("columns {out_col}..{} exceed the row of {out_ld}", out_col + out_rows)));
    }
    let need = elems(OP, &[n_tokens - 1, out_ld])? + out_col + out_rows;
    check_len(OP, "out", out.len(), need)?;
    if let Some(res) = epilogue.residual {
        check_len(OP, "residual", res.len(), need)?;
    }
    if let Some(b) = epilogue.bias {
        check_len(OP, "bias", b.len(), w.rows)?;
    }
    let emit = match emit {
        Some(e) => {
            if out_col != 0 || out_ld != out_rows || !out_rows.is_multiple_of(32) {
                return Err(CudaError::invalid(
                    OP,
                    format!("an int8 hand-off quantizes whole rows of 32-value blocks, not columns {out_col}..{} of {out_ld}", out_col + out_rows),
                ));
            }
            if let Some(nm) = &e.norm {
                check_len(OP, "hand-off norm weight", nm.weight.len(), out_rows)?;
            }
            e.dst.fill(OP, n_tokens, out_rows, e.norm.map(|nm| nm.eps))?;
            let (q, s, p) = e.dst.ptrs(gpu);
            Some(Q8Output { q, s, partials: p, norm: e.norm.map(|nm| (addr(gpu, nm.weight), nm.add_one)) })
        }
        None => None,
    };
    let gemv_rows = if epilogue.down.is_some() { w.rows / 2 } else { out_rows };
    gemv_q8(gpu, w, None, None, input, n_tokens, gemv_rows, (addr_mut(gpu, out), out_ld, out_col), epilogue, emit, retile)
}

/// A gated linear whose gate and up rows are two weights of the same quantized type (a shared
/// expert's `gate` and `up`): `out[t, r] = act(gate_r . x_t) * (up_r . x_t)` in one int8 GEMV,
/// `out` being `[n_tokens, gate.rows]`.
pub fn linear_q8_gated_pair(
    gpu: &Gpu,
    gate: &DeviceWeight,
    up: &DeviceWeight,
    x: &Q8Activations,
    n_tokens: usize,
    glu: Glu,
    out: &mut impl DevicePtrMut<f32>,
) -> Result<(), CudaError> {
    const OP: &str = "linear_q8_gated_pair";
    if weight::planes(gate.dtype).is_none() || gate.dtype != up.dtype || (gate.rows, gate.cols) != (up.rows, up.cols) {
        return Err(CudaError::invalid(
            OP,
            format!("gate ({} {}x{}) and up ({} {}x{}) must be quantized weights of one type and shape", gate.dtype, gate.rows, gate.cols, up.dtype, up.rows, up.cols),
        ));
    }
    if x.cols != gate.cols || x.rows < n_tokens {
        return Err(CudaError::invalid(OP, format!("activations hold {} x {}, the weights need {n_tokens} x {}", x.rows, x.cols, gate.cols)));
    }
    if n_tokens == 0 {
        return Ok(());
    }
    check_len(OP, "out", out.len(), elems(OP, &[n_tokens, gate.rows])?)?;
    let epilogue = Epilogue { glu: Some(glu), ..Default::default() };
    gemv_q8(gpu, gate, Some(up), None, x.input(gpu), n_tokens, gate.rows, (addr_mut(gpu, out), gate.rows, 0), &epilogue, None, None)
}

/// Device side of [`Q8Activations`] as the GEMV reads it.
#[derive(Clone, Copy)]
pub(super) struct Q8Input {
    xq: u64,
    xs: u64,
    /// The producer's sums of squares and the norm's eps, when the codes lack `1 / rms`.
    norm: Option<(u64, f32)>,
    /// One token's f32 row, and its norm's weight (+ add_one), that the GEMV quantizes itself
    /// (`xq`, `xs` and the sums of squares unused then).
    f32_row: Option<(u64, Option<(u64, bool)>)>,
}

/// Device side of a [`Q8Emit`]: codes, scales, sums of squares, and the norm weight (+ add_one).
#[derive(Clone, Copy)]
pub(super) struct Q8Output {
    q: u64,
    s: u64,
    partials: u64,
    norm: Option<(u64, bool)>,
}

/// The int8 GEMV: `out_rows` outputs per token (grid-y tile); with `up` (and a gated epilogue)
/// the up rows come from that weight, with `experts` the rows of each pair's expert.
#[allow(clippy::too_many_arguments)]
pub(super) fn gemv_q8(
    gpu: &Gpu,
    w: &DeviceWeight,
    up: Option<&DeviceWeight>,
    experts: Option<ExpertRows>,
    x: Q8Input,
    n_tokens: usize,
    out_rows: usize,
    (out, out_ld, out_col): (u64, usize, usize),
    epilogue: &Epilogue,
    emit: Option<Q8Output>,
    retile: Option<Retile>,
) -> Result<(), CudaError> {
    const OP: &str = "linear_q8";
    let glu = epilogue.glu.map_or(0, |g| g as u32);
    let groups = experts.and_then(|e| e.groups);
    // Tokens grid y covers: with grouped experts, the worst case of moe_group's tile list.
    let grid_tokens = groups.map_or(n_tokens, |g| g.max_tiles * GROUP_TILE);
    let tiling = match (experts, glu) {
        (Some(_), glu) if groups.is_some() => GemvQ8Variant::for_grouped_experts(w.dtype, out_rows, w.cols, grid_tokens / GROUP_TILE, gpu.sm_count(), glu),
        (Some(_), glu) => GemvQ8Variant::for_experts(w.dtype, out_rows, w.cols, n_tokens, gpu.sm_count(), glu),
        (None, 0) => GemvQ8Variant::for_shape(w.dtype, out_rows, w.cols, n_tokens, gpu.sm_count()),
        (None, glu) => GemvQ8Variant::for_gated(w.dtype, out_rows, w.cols, n_tokens, gpu.sm_count(), glu),
    };
    let tiling = match (&emit, epilogue.down) {
        // Blocks that own whole 32-value units of the down projection's columns.
        (_, Some(_)) => GemvQ8Variant { emit: 0, ..tiling.emitting(2) },
        (Some(e), None) => tiling.emitting(if e.norm.is_some() { 2 } else { 1 }),
        (None, None) => tiling.wide_rows(w.cols),
    };
    let opts = gpu.linear_options();
    let split = opts.gemv_split_k && epilogue.down.is_none();
    let tiling = if split { tiling.split_k(out_rows, w.cols, grid_tokens, gpu.sm_count()) } else { tiling };
    let tiling = if split && opts.spread_rows { tiling.spread_rows(out_rows, w.cols, gpu.sm_count()) } else { tiling };
    let tiling = retile.map_or(tiling, |f| f(tiling));
    let tiling = match epilogue.down {
        Some(d) => tiling.with_down(d.rows),
        None => tiling,
    };
    let tiling = if x.f32_row.is_some() { tiling.with_f32_input(w.cols) } else { tiling };
    let variant = GemvQ8Variant {
        residual: epilogue.residual.is_some() || epilogue.accumulate,
        bias: epilogue.bias.is_some(),
        in_norm: x.norm.is_some(),
        up_split: up.is_some(),
        early_release: epilogue.early_release,
        ..tiling
    };
    let [w0, w1, w2, w3] = w.plane_ptrs(gpu);
    let [u0, u1, u2, u3] = up.map_or([0; 4], |u| u.plane_ptrs(gpu));
    let [d0, d1, d2, d3] = epilogue.down.map_or([0; 4], |d| d.plane_ptrs(gpu));
    let (expert_rows, expert_off, n_experts, x_div) = ExpertRows::fields(experts, OP)?;
    let params = GemvQ8Params {
        w0,
        w1,
        w2,
        w3,
        xq: x.xq,
        xs: x.xs,
        out,
        residual: if epilogue.accumulate { out } else { epilogue.residual.map_or(0, |r| addr(gpu, r)) },
        bias: epilogue.bias.map_or(0, |b| addr(gpu, b)),
        rows: as_u32(OP, "rows", out_rows)?,
        cols: as_u32(OP, "cols", w.cols)?,
        n_tokens: as_u32(OP, "n_tokens", n_tokens)?,
        out_ld: as_u32(OP, "out_ld", out_ld)?,
        out_col: as_u32(OP, "out_col", out_col)?,
        res_ld: as_u32(OP, "out_ld", out_ld)?,
        res_col: as_u32(OP, "out_col", out_col)?,
        in_partials: x.norm.map_or(0, |(p, _)| p),
        in_eps: x.norm.map_or(0.0, |(_, eps)| eps),
        emit_add_one: emit.and_then(|e| e.norm).is_some_and(|(_, add_one)| add_one) as u32,
        emit_q: emit.map_or(0, |e| e.q),
        emit_s: emit.map_or(0, |e| e.s),
        emit_norm: emit.and_then(|e| e.norm).map_or(0, |(w, _)| w),
        emit_partials: emit.map_or(0, |e| e.partials),
        u0,
        u1,
        u2,
        u3,
        experts: experts.map_or(0, |e| e.ids),
        error_flag: gpu.error_flag_ptr(),
        expert_tiles: groups.map_or(0, |g| g.tiles),
        expert_perm: groups.map_or(0, |g| g.perm),
        expert_rows,
        expert_off,
        n_experts,
        x_div,
        x32: x.f32_row.map_or(0, |(x, _)| x),
        in_norm_w: x.f32_row.and_then(|(_, nm)| nm).map_or(0, |(w, _)| w),
        in_add_one: x.f32_row.and_then(|(_, nm)| nm).is_some_and(|(_, add_one)| add_one) as u32,
        down_rows: epilogue.down.map_or(Ok(0), |d| as_u32(OP, "down rows", d.rows))?,
        d0,
        d1,
        d2,
        d3,
    };
    let cfg = variant.launch_config(out_rows, grid_tokens);
    if cfg.grid_dim.1 > 65535 {
        return Err(CudaError::invalid(OP, format!("{n_tokens} tokens exceed the GEMV grid; use the GEMM path")));
    }
    gpu.launch(&variant, "gemv_q8", cfg, &params)
}

const SCRATCH_ALIGN: usize = 256;

/// A linear's input rows (`n_tokens` of `cols`) written to `dst` in the GEMM input type of
/// `precision`, in column order `order`: converted, or normalised and converted in one launch.
fn convert_activations(
    gpu: &Gpu,
    precision: Precision,
    input: Input,
    n_tokens: usize,
    cols: usize,
    dst: u64,
    order: MmaOrder,
) -> Result<(), CudaError> {
    if let Some(norm) = input.norm {
        return norm_rows(gpu, input.x, norm, n_tokens, cols, dst, precision.out_type(), order, 0);
    }
    let count = n_tokens * cols;
    let variant = ConvertVariant { out: precision.out_type() };
    let params = ConvertParams { src: input.x, dst, n: count as u64, order: order.code(), cols: as_u32("convert", "cols", cols)?, tile_tokens: order.tile_tokens(), pad: 0 };
    gpu.launch(&variant, "convert_f32", variant.launch_config(count, order), &params)
}

/// [`linear`] on the small-batch tensor-core GEMM with an explicit tiling (`kernel_bench`
/// compares tilings with it; [`linear`] takes [`GemmMmaVariant::for_shape`]).
pub fn linear_mma(
    gpu: &Gpu,
    w: &DeviceWeight,
    x: &impl DevicePtr<f32>,
    n_tokens: usize,
    out: &mut impl DevicePtrMut<f32>,
    variant: GemmMmaVariant,
) -> Result<(), CudaError> {
    const OP: &str = "linear_mma";
    if variant.wtype != w.dtype || weight::planes(w.dtype).is_none() || !w.cols.is_multiple_of(32) {
        return Err(CudaError::invalid(OP, format!("{variant:?} does not fit a {} {}x{} weight", w.dtype, w.rows, w.cols)));
    }
    let (x, out) = linear_operands(OP, gpu, w, x, n_tokens, out)?;
    if n_tokens == 0 || w.rows == 0 {
        return Ok(());
    }
    gemm_mma(gpu, w, MmaInput::Rows(Input { x, norm: None }), n_tokens, MmaOutput::Rows(out), None, variant)
}

/// The device addresses of a linear's `x` (`[n_tokens, w.cols]`) and `out` (`[n_tokens,
/// w.rows]`), once their lengths are checked.
fn linear_operands(
    op: &'static str,
    gpu: &Gpu,
    w: &DeviceWeight,
    x: &impl DevicePtr<f32>,
    n_tokens: usize,
    out: &mut impl DevicePtrMut<f32>,
) -> Result<(u64, u64), CudaError> {
    check_len(op, "x", x.len(), elems(op, &[n_tokens, w.cols])?)?;
    check_len(op, "out", out.len(), elems(op, &[n_tokens, w.rows])?)?;
    Ok((addr(gpu, x), addr_mut(gpu, out)))
}

/// The small-batch tensor-core GEMM: activations converted to the MMA input type in scratch,
/// then `gemm_mma` on the packed weight, straight into `out` or, split over K slices, into f32
/// partials in scratch that `gemm_reduce` sums.
fn gemm_mma(
    gpu: &Gpu,
    w: &DeviceWeight,
    input: MmaInput,
    n_tokens: usize,
    out: MmaOutput,
    residual: Option<u64>,
    variant: GemmMmaVariant,
) -> Result<(), CudaError> {
    const OP: &str = "linear";
    if variant.wgmma > 0 {
        if !gpu.supports_wgmma() {
            return Err(CudaError::invalid(OP, format!("the wgmma GEMM needs an sm_90 device, not {}", gpu.name())));
        }
        if !w.cols.is_multiple_of(GEMM_CHUNK_COLS) || variant.stages < 3 {
            return Err(CudaError::invalid(OP, format!("the wgmma GEMM needs rows of whole {GEMM_CHUNK_COLS}-column chunks and 3 stages, not {} columns and {variant:?}", w.cols)));
        }
    }
    if variant.glu > 0 && (!variant.can_fuse_glu() || !w.rows.is_multiple_of(2) || residual.is_some() || variant.k_slices(w.rows, w.cols, n_tokens, gpu.sm_count() as usize) > 1) {
        return Err(CudaError::invalid(OP, format!("the GLU epilogue needs the two-warpgroup wgmma tiling, an even row count, one K slice and no residual: {variant:?}")));
    }
    if variant.weight_stages > 0 && (!variant.can_stage_weights() || variant.weight_stages < 2 || variant.depth != 1) {
        return Err(CudaError::invalid(OP, format!("weights staged in shared memory need the wgmma kernel, a 32-weight block type, 2 or more stages and depth 1: {variant:?}")));
    }
    let (out, out_tile) = match out {
        MmaOutput::Rows(out) => (out, 0),
        MmaOutput::Staged { dst, tile_tokens } => (dst, as_u32(OP, "tile tokens", tile_tokens)?),
    };
    if variant.staged_out != (out_tile > 0) || (variant.staged_out && (variant.glu == 0 || !(w.rows / 2).is_multiple_of(GEMM_CHUNK_COLS))) {
        return Err(CudaError::invalid(OP, format!("a staged output needs the GLU epilogue and outputs of whole {GEMM_CHUNK_COLS}-column chunks: {variant:?}, {} rows", w.rows)));
    }
    let precision = if variant.bf16 { Precision::BF16 } else { Precision::F16 };
    let slices = variant.k_slices(w.rows, w.cols, n_tokens, gpu.sm_count() as usize);
    let x_bytes = match input {
        MmaInput::Staged(_) => 0,
        MmaInput::Rows(_) => elems(OP, &[variant.activation_order().padded_rows(n_tokens), w.cols, 2])?.next_multiple_of(SCRATCH_ALIGN),
    };
    let part_len = elems(OP, &[n_tokens, w.rows])?;
    let part_bytes = if slices > 1 { elems(OP, &[slices, part_len, 4])? } else { 0 };
    gpu.with_scratch((x_bytes + part_bytes).max(1), |scratch| {
        let x = match input {
            MmaInput::Staged(x) => x,
            MmaInput::Rows(input) => {
                convert_activations(gpu, precision, input, n_tokens, w.cols, scratch, variant.activation_order())?;
                scratch
            }
        };
        let partials = scratch + x_bytes as u64;
        let [w0, w1, w2, w3] = w.plane_ptrs(gpu);
        let params = GemmMmaParams {
            w0,
            w1,
            w2,
            w3,
            x,
            out: if slices > 1 { partials } else { out },
            residual: residual.unwrap_or(0),
            rows: as_u32(OP, "rows", w.rows)?,
            cols: as_u32(OP, "cols", w.cols)?,
            n_tokens: as_u32(OP, "n_tokens", n_tokens)?,
            slice_chunks: as_u32(OP, "chunks", GemmMmaVariant::slice_chunks(w.cols, slices))?,
            out_tile,
            pad: 0,
        };
        gpu.launch(&variant, "gemm_mma", variant.launch_config(w.rows, n_tokens, slices), &params)?;
        if slices > 1 {
            let params = GemmReduceParams { partials, out, n: part_len as u64, residual: residual.unwrap_or(0), slices: slices as u32, pad: 0 };
            gpu.launch(&variant, "gemm_reduce", gemm_kernels::reduce_launch_config(part_len), &params)?;
        }
        Ok(())
    })
}

#[allow(clippy::too_many_arguments)]
fn gemm(
    gpu: &Gpu,
    w: &DeviceWeight,
    input: Input,
    n_tokens: usize,
    out: u64,
    residual: Option<u64>,
    precision: Precision,
    dequantize_weight: bool,
    convert_input: bool,
) -> Result<(), CudaError> {
    const OP: &str = "linear";
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
            match &w.expanded {
                Some((t, copy)) if *t == precision.out_type() => addr(gpu, copy),
                _ => w.plane_ptrs(gpu)[0],
            }
        };
        let input = if convert_input {
            let dst = scratch + w_bytes as u64;
            convert_activations(gpu, precision, input, n_tokens, w.cols, dst, MmaOrder::Natural)?;
            dst
        } else {
            input.x
        };
        // Row-major out[n, m] = x[n, k] · w[m, k]ᵀ, the residual (if any) read in the epilogue.
        let shape = LtShape { m: w.rows as u64, n: n_tokens as u64, k: w.cols as u64, input: precision.out_type() };
        gpu.blas_lt().matmul(shape, weight, input, residual, out)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every spelled-out value selects its option, including the ones that are not the default.
    /// (The only test of this crate's library that reads these switches.)
    #[test]
    fn switch_values_select_their_option() {
        let with = |name: &str, value: &str| {
            std::env::set_var(name, value);
            let o = LinearOptions::from_env();
            std::env::remove_var(name);
            o
        };
        let precision = env::CUDA_GEMM_PRECISION.name;
        assert_eq!(with(precision, "f32").precision, Precision::F32);
        assert_eq!(with(precision, "F16").precision, Precision::F16);
        assert_eq!(with(precision, "bf16").precision, Precision::BF16);
        assert_eq!(with(precision, "fp8").precision, LinearOptions::default().precision);
        let activations = env::CUDA_GEMV_ACTIVATIONS.name;
        assert_eq!(with(activations, "f32").activations, GemvActivations::F32);
        assert_eq!(with(activations, "q8").activations, GemvActivations::Q8);
        let path = env::CUDA_LINEAR.name;
        assert_eq!(with(path, "gemm").path, LinearPath::Gemm);
        assert_eq!(with(path, "gemv").path, LinearPath::Gemv);
        assert_eq!(with(path, "auto").path, LinearPath::Auto);
    }

    #[test]
    fn wgmma_takes_the_big_weights() {
        // The 8B shapes on 132 SMs at 64 and 40 tokens: gate/up and down, not QKV and output.
        for n in [64, 40] {
            let pays = |rows, cols| wgmma_pays(GgmlType::Q4_0, rows, cols, n, 132);
            assert!(pays(28672, 4096) && pays(4096, 14336), "{n} tokens");
            assert!(!pays(6144, 4096) && !pays(4096, 4096), "{n} tokens");
        }
    }

    #[test]
    fn plan_follows_tokens_and_switch() {
        let auto = LinearOptions::default();
        assert_eq!(linear_plan(GgmlType::Q4_0, 576, 1, &auto), LinearPlan::GemvQ8);
        assert_eq!(linear_plan(GgmlType::Q4_0, 576, 8, &auto), LinearPlan::GemvQ8);
        let f32_act = LinearOptions { activations: GemvActivations::F32, ..auto };
        assert_eq!(linear_plan(GgmlType::Q4_0, 576, 8, &f32_act), LinearPlan::Gemv);
        assert_eq!(linear_plan(GgmlType::F16, 576, 1, &auto), LinearPlan::Gemv);
        // Batched decode steps: the small-batch tensor-core GEMM up to 64 tokens, cuBLAS above,
        // or when switched off and at f32 (any whole number of 32-value units per row).
        let mma = LinearPlan::Mma { precision: Precision::BF16, wgmma: false };
        assert_eq!(linear_plan(GgmlType::Q4_0, 576, 9, &auto), mma);
        assert_eq!(linear_plan(GgmlType::Q6_K, 4096, 32, &auto), mma);
        // Above 32 tokens, warpgroup MMAs on rows of whole 128-column chunks (where allowed).
        let wgmma = LinearPlan::Mma { precision: Precision::BF16, wgmma: true };
        assert_eq!(linear_plan(GgmlType::Q6_K, 4096, 64, &auto), wgmma);
        assert_eq!(linear_plan(GgmlType::Q4_0, 4096, 33, &auto), wgmma);
        assert_eq!(linear_plan(GgmlType::Q4_0, 576, 64, &auto), mma);
        assert_eq!(linear_plan(GgmlType::Q4_0, 4096, 64, &LinearOptions { wgmma: false, ..auto }), mma);
        let cublas = LinearPlan::Gemm { precision: Precision::BF16, dequantize_weight: true, convert_input: true };
        assert_eq!(linear_plan(GgmlType::Q4_0, 576, 65, &auto), cublas);
        assert_eq!(linear_plan(GgmlType::Q4_0, 544, 9, &auto), mma);
        assert_eq!(linear_plan(GgmlType::Q4_0, 576, 9, &LinearOptions { mma_max_tokens: 0, ..auto }), cublas);
        assert_eq!(linear_plan(GgmlType::Q4_0, 576, 9, &LinearOptions { path: LinearPath::Gemm, ..auto }), cublas);
        assert!(matches!(linear_plan(GgmlType::BF16, 576, 9, &auto), LinearPlan::Gemm { .. }));
        let f32_gemm = LinearOptions { precision: Precision::F32, ..auto };
        assert_eq!(
            linear_plan(GgmlType::F32, 576, 64, &f32_gemm),
            LinearPlan::Gemm { precision: Precision::F32, dequantize_weight: false, convert_input: false }
        );
        let f16 = LinearOptions { precision: Precision::F16, path: LinearPath::Gemm, ..auto };
        assert_eq!(
            linear_plan(GgmlType::F16, 576, 1, &f16),
            LinearPlan::Gemm { precision: Precision::F16, dequantize_weight: false, convert_input: true }
        );
        let gemv = LinearOptions { path: LinearPath::Gemv, ..auto };
        assert_eq!(linear_plan(GgmlType::Q6_K, 256, 100, &gemv), LinearPlan::GemvQ8);
    }

    #[test]
    fn float_weights_with_ragged_rows_fall_back_to_gemm() {
        let gemv = LinearOptions { path: LinearPath::Gemv, ..LinearOptions::default() };
        assert!(matches!(linear_plan(GgmlType::F16, 100, 1, &gemv), LinearPlan::Gemm { .. }));
        assert!(matches!(linear_plan(GgmlType::F32, 100, 1, &LinearOptions::default()), LinearPlan::Gemm { .. }));
    }
}
