//! The op layer: one function per op, which checks its arguments, picks a kernel variant
//! (and, for [`linear`], a kernel path) and enqueues it on the GPU's stream.
//!
//! Conventions, chosen so that a whole decode step can later be captured in a CUDA graph:
//! - activations are f32 device buffers (any `CudaSlice` or view); outputs are written in full;
//! - ops never synchronise, never copy between host and device, and allocate nothing except
//!   the GEMM path's scratch, which grows once ([`Gpu::reserve_scratch`] pre-sizes it);
//! - kernel parameters travel by value; positions and the sampling step can come from
//!   device memory, so a replayed graph sees new values without being re-captured;
//! - token ids or positions that are out of range in device memory are never used to index
//!   memory: the kernel skips the work, writes NaN and records the error for
//!   [`Gpu::check_device`].
//!
//! Buffers must belong to `gpu`'s context; work on other streams must be ordered by the caller.

mod attention;
mod gdn;
mod linear;
mod moe;
mod sampling;

pub use attention::{
    attention, attention_group, attention_on, AttentionEmit, DecodeLayout, DecodeLayouts, DecodeStage, AttentionGroups, attention_paged, attention_path, attention_split, attention_splits, store_and_attend, store_and_attend_paged, FUSED_PAGED_STORE_MAX_SEQS, store_qkv, store_qkv_paged, AttentionConfig, QkNorm,
    AttentionPath, KvCache, Paging, SplitScratch, FLASH_MIN_TOKENS, MAX_SPLITS,
};
pub use linear::{
    expand_weight, expanded_bytes, gemv_spreads_rows, glu_fuses, linear, linear_mma, linear_plan, linear_fused, linear_q8, linear_q8_f32_row, linear_q8_gated_pair, linear_q8_retiled, mlp_q8, MLP_MAX_ADDS, Retile, linear_with, linear_glu_staged, linear_staged, StagedActivations, StagedLayout, quantize_q8, MMA_OVER_RESIDENT_MAX_TOKENS, Epilogue, GemvActivations, Glu, LinearOptions,
    LinearFusion, LinearPath, LinearPlan, NormPrologue, Precision, Q8Activations, Q8Emit,
};
pub use moe::{
    check_moe_shape, moe_ffn, moe_ffn_with, moe_group, moe_plan, moe_route, ExpertGateUp, ExpertGemv, MoeDims, MoeGroups, MoePath, MoePlan, MoeScratch, MoeWeights,
    SharedExpert,
};
pub use sampling::{argmax, argmax_rows, sample, sample_delivering, sample_rows, Mail, RowSample, SampleScratch, SamplingConfig, TokenDelivery, ROW_DRAW_WORDS};
pub use gdn::{
    check_gdn_shape, gated_delta_net, gated_delta_net_batch, gated_delta_net_with, gdn_chunked, gdn_conv, gdn_delta, gdn_plan, gdn_scratch_len, GdnBatch, GdnPath, GdnSeq, GdnState,
    GdnWeights, GDN_CHUNKED_MIN_TOKENS,
};

pub use crate::kernels::attention::KvDtype;
pub use crate::kernels::sampling::sampling_uniform;

use crate::error::CudaError;
use crate::kernels::activation::{ActivationVariant, AddRowsParams, CopyColsParams, ElementwiseParams, GatedQueryParams, GluParams};
use crate::kernels::dequant::{MmaOrder, OutType};
use crate::kernels::embedding::{EmbedParams, EmbedVariant};
use crate::kernels::norm::{NormVariant, RmsNormParams};
use crate::kernels::rope::{RopeParams, RopeVariant};
use crate::weight::DeviceWeight;
use crate::Gpu;
use cudarc::driver::{DevicePtr, DevicePtrMut};

/// The kernel path an `auto|NAME|...` switch forces: `None` for `auto` or unset, the matching
/// choice (case-insensitive) otherwise; another value is reported on stderr and means `auto`.
pub(crate) fn forced_path<T: Copy>(switch: &ferrite_core::env::Switch, value: Option<&str>, choices: &[(&str, T)]) -> Option<T> {
    let value = value?.to_ascii_lowercase();
    if value == "auto" {
        return None;
    }
    let found = choices.iter().find(|(name, _)| *name == value).map(|&(_, path)| path);
    if found.is_none() {
        let names: Vec<&str> = choices.iter().map(|&(name, _)| name).collect();
        eprintln!("warning: {}={value:?} is not auto, {}; using auto", switch.name, names.join(", "));
    }
    found
}

/// Device address of a buffer, for a parameter struct. Event tracking is off on our context,
/// so the guard cudarc returns does nothing and can be dropped at once.
pub(crate) fn addr<T>(gpu: &Gpu, buf: &impl DevicePtr<T>) -> u64 {
    buf.device_ptr(gpu.stream()).0
}

pub(crate) fn addr_mut<T>(gpu: &Gpu, buf: &mut impl DevicePtrMut<T>) -> u64 {
    buf.device_ptr_mut(gpu.stream()).0
}

/// Product of sizes, or an error naming the op if it overflows.
pub(crate) fn elems(op: &'static str, sizes: &[usize]) -> Result<usize, CudaError> {
    sizes
        .iter()
        .try_fold(1usize, |acc, &s| acc.checked_mul(s))
        .ok_or_else(|| CudaError::invalid(op, format!("sizes {sizes:?} overflow")))
}

/// The buffer must hold at least `need` elements.
pub(crate) fn check_len(op: &'static str, what: &str, have: usize, need: usize) -> Result<(), CudaError> {
    if have < need {
        return Err(CudaError::invalid(op, format!("{what} holds {have} elements, needs {need}")));
    }
    Ok(())
}

/// The size must fit the kernels' 32-bit size fields.
pub(crate) fn as_u32(op: &'static str, what: &str, value: usize) -> Result<u32, CudaError> {
    u32::try_from(value).map_err(|_| CudaError::invalid(op, format!("{what} = {value} does not fit in 32 bits")))
}

/// Look up rows `ids[0..n_tokens]` of `table` into `out` (`[n_tokens, table.cols]` f32).
/// An id `>= table.rows` poisons its row with NaN and is reported by [`Gpu::check_device`].
pub fn embed(
    gpu: &Gpu,
    table: &DeviceWeight,
    ids: &impl DevicePtr<u32>,
    n_tokens: usize,
    out: &mut impl DevicePtrMut<f32>,
) -> Result<(), CudaError> {
    embed_scaled(gpu, table, ids, n_tokens, 1.0, out)
}

/// [`embed`] with every value multiplied by `scale` (Gemma's `sqrt(n_embd)`; 1 leaves the rows exact).
pub fn embed_scaled(
    gpu: &Gpu,
    table: &DeviceWeight,
    ids: &impl DevicePtr<u32>,
    n_tokens: usize,
    scale: f32,
    out: &mut impl DevicePtrMut<f32>,
) -> Result<(), CudaError> {
    const OP: &str = "embed";
    if n_tokens == 0 {
        return Ok(());
    }
    if !scale.is_finite() {
        return Err(CudaError::invalid(OP, format!("scale {scale} is not finite")));
    }
    as_u32(OP, "n_tokens", n_tokens)?;
    check_len(OP, "ids", ids.len(), n_tokens)?;
    check_len(OP, "out", out.len(), elems(OP, &[n_tokens, table.cols])?)?;
    let variant = EmbedVariant { wtype: table.dtype };
    let [w0, w1, w2, w3] = table.plane_ptrs(gpu);
    let params = EmbedParams {
        w0,
        w1,
        w2,
        w3,
        ids: addr(gpu, ids),
        out: addr_mut(gpu, out),
        error_flag: gpu.error_flag_ptr(),
        vocab: as_u32(OP, "vocabulary", table.rows)?,
        dim: as_u32(OP, "dim", table.cols)?,
        scale,
        pad: 0,
    };
    gpu.launch(&variant, "embed", variant.launch_config(n_tokens), &params)
}

/// RMSNorm of `n_rows` rows of `dim`: `out = x / sqrt(mean(x^2) + eps) * g` with
/// `g = weight` or, when `add_one` (Gemma), `g = 1 + weight`.
#[allow(clippy::too_many_arguments)]
pub fn rms_norm(
    gpu: &Gpu,
    x: &impl DevicePtr<f32>,
    weight: &impl DevicePtr<f32>,
    eps: f32,
    n_rows: usize,
    dim: usize,
    add_one: bool,
    out: &mut impl DevicePtrMut<f32>,
) -> Result<(), CudaError> {
    let norm = RowNorm { weight: addr(gpu, weight), eps, add_one };
    norm_rows_checked("rms_norm", gpu, x, (&norm, weight.len()), None, n_rows, dim, out)
}

/// [`rms_norm`] plus `residual` (`n_rows x dim`): `out = residual + x / rms(x) * w`, Gemma's
/// post-norm and its residual add in one launch, bit-identical to [`rms_norm`] then [`add`].
#[allow(clippy::too_many_arguments)]
pub fn rms_norm_add(
    gpu: &Gpu,
    x: &impl DevicePtr<f32>,
    weight: &impl DevicePtr<f32>,
    eps: f32,
    residual: &impl DevicePtr<f32>,
    n_rows: usize,
    dim: usize,
    out: &mut impl DevicePtrMut<f32>,
) -> Result<(), CudaError> {
    let norm = RowNorm { weight: addr(gpu, weight), eps, add_one: false };
    norm_rows_checked("rms_norm_add", gpu, x, (&norm, weight.len()), Some((addr(gpu, residual), residual.len())), n_rows, dim, out)
}

/// The public norms' checks (lengths of `x`, the weight (`norm.1` values), the residual (address,
/// length) and `out`), then [`norm_rows`] in f32 and natural order.
#[allow(clippy::too_many_arguments)]
fn norm_rows_checked(
    op: &'static str,
    gpu: &Gpu,
    x: &impl DevicePtr<f32>,
    norm: (&RowNorm, usize),
    residual: Option<(u64, usize)>,
    n_rows: usize,
    dim: usize,
    out: &mut impl DevicePtrMut<f32>,
) -> Result<(), CudaError> {
    if n_rows == 0 {
        return Ok(());
    }
    if dim == 0 {
        return Err(CudaError::invalid(op, "dim is 0"));
    }
    let n = elems(op, &[n_rows, dim])?;
    check_len(op, "x", x.len(), n)?;
    check_len(op, "weight", norm.1, dim)?;
    if let Some((_, len)) = residual {
        check_len(op, "residual", len, n)?;
    }
    check_len(op, "out", out.len(), n)?;
    let residual = residual.map_or(0, |(at, _)| at);
    norm_rows(gpu, addr(gpu, x), norm.0, n_rows, dim, addr_mut(gpu, out), OutType::F32, MmaOrder::Natural, residual)
}

/// An RMSNorm's weight (device address), epsilon and `(1 + w)` convention.
pub(crate) struct RowNorm {
    pub weight: u64,
    pub eps: f32,
    pub add_one: bool,
}

/// RMSNorm of `n_rows` rows of `dim` at `x` into `out` as `out_type`, in column order `order`,
/// plus the rows at `residual` unless 0 (f32 natural order only; lengths checked by the caller;
/// `dim > 0`).
#[allow(clippy::too_many_arguments)]
pub(crate) fn norm_rows(
    gpu: &Gpu,
    x: u64,
    norm: &RowNorm,
    n_rows: usize,
    dim: usize,
    out: u64,
    out_type: OutType,
    order: MmaOrder,
    residual: u64,
) -> Result<(), CudaError> {
    const OP: &str = "rms_norm";
    as_u32(OP, "n_rows", n_rows)?;
    if !dim.is_multiple_of(order.row_multiple()) {
        return Err(CudaError::invalid(OP, format!("the {order:?} order needs rows of whole {}s, not {dim}", order.row_multiple())));
    }
    let variant = NormVariant { out: out_type, ..NormVariant::for_dim(dim) };
    let params = RmsNormParams {
        x,
        weight: norm.weight,
        out,
        dim: as_u32(OP, "dim", dim)?,
        eps: norm.eps,
        add_one: u32::from(norm.add_one),
        heads: 1,
        ld: as_u32(OP, "dim", dim)?,
        col: 0,
        order: order.code(),
        tile_tokens: order.tile_tokens(),
        residual,
    };
    gpu.launch(&variant, "rms_norm", variant.launch_config(n_rows), &params)
}

/// RMSNorm in place over each of `n_heads` heads (`head_dim` wide, one shared weight) of the
/// `n_rows` rows of `x` (row stride `ld`) from column `col`: Qwen3's QK-norm, one launch.
#[allow(clippy::too_many_arguments)]
pub fn head_norm(
    gpu: &Gpu,
    x: &mut impl DevicePtrMut<f32>,
    ld: usize,
    col: usize,
    n_rows: usize,
    n_heads: usize,
    head_dim: usize,
    weight: &impl DevicePtr<f32>,
    eps: f32,
) -> Result<(), CudaError> {
    const OP: &str = "head_norm";
    if n_rows == 0 || n_heads == 0 {
        return Ok(());
    }
    if head_dim == 0 || col + n_heads * head_dim > ld {
        return Err(CudaError::invalid(OP, format!("{n_heads} heads of {head_dim} from column {col} do not fit rows of {ld}")));
    }
    check_len(OP, "x", x.len(), elems(OP, &[n_rows - 1, ld])? + col + n_heads * head_dim)?;
    check_len(OP, "weight", weight.len(), head_dim)?;
    let blocks = as_u32(OP, "heads", elems(OP, &[n_rows, n_heads])?)?;
    let variant = NormVariant::for_dim(head_dim);
    let x = addr_mut(gpu, x);
    let params = RmsNormParams {
        x,
        weight: addr(gpu, weight),
        out: x,
        dim: as_u32(OP, "head_dim", head_dim)?,
        eps,
        add_one: 0,
        heads: n_heads as u32,
        ld: as_u32(OP, "ld", ld)?,
        col: as_u32(OP, "col", col)?,
        order: MmaOrder::Natural.code(),
        tile_tokens: 1,
        residual: 0,
    };
    gpu.launch(&variant, "rms_norm", variant.launch_config(blocks as usize), &params)
}

/// Shape and frequencies of a rotary embedding.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct RopeConfig {
    pub n_heads: usize,
    pub head_dim: usize,
    /// Leading dims of each head that rotate (the rest pass through); even, `<= head_dim`.
    pub rot_dim: usize,
    /// Base of the frequencies: pair `i` turns by `pos * freq_scale * theta^(-2i/rot_dim)`.
    pub theta: f32,
    pub freq_scale: f32,
    /// NeoX/HF layout (pairs `(i, i + rot_dim/2)`) instead of GPT-J (pairs `(2i, 2i+1)`).
    pub neox: bool,
}

impl RopeConfig {
    pub(crate) fn check(&self, op: &'static str) -> Result<(), CudaError> {
        if self.rot_dim == 0 || !self.rot_dim.is_multiple_of(2) || self.rot_dim > self.head_dim {
            return Err(CudaError::invalid(
                op,
                format!("rot_dim {} must be even, non-zero and at most head_dim {}", self.rot_dim, self.head_dim),
            ));
        }
        if !(self.theta > 0.0 && self.theta.is_finite() && self.freq_scale.is_finite()) {
            return Err(CudaError::invalid(
                op,
                format!("theta {} / freq_scale {} are not usable", self.theta, self.freq_scale),
            ));
        }
        Ok(())
    }
}

/// Rotate `x` (`[n_tokens, n_heads, head_dim]` f32) in place by each token's position
/// (`positions[t]`, device memory).
pub fn rope(
    gpu: &Gpu,
    x: &mut impl DevicePtrMut<f32>,
    positions: &impl DevicePtr<u32>,
    n_tokens: usize,
    cfg: &RopeConfig,
) -> Result<(), CudaError> {
    const OP: &str = "rope";
    if n_tokens == 0 {
        return Ok(());
    }
    cfg.check(OP)?;
    check_len(OP, "x", x.len(), elems(OP, &[n_tokens, cfg.n_heads, cfg.head_dim])?)?;
    check_len(OP, "positions", positions.len(), n_tokens)?;
    let variant = RopeVariant { neox: cfg.neox };
    let pairs = elems(OP, &[n_tokens, cfg.n_heads, cfg.rot_dim / 2])?;
    let params = RopeParams {
        x: addr_mut(gpu, x),
        positions: addr(gpu, positions),
        n_tokens: as_u32(OP, "n_tokens", n_tokens)?,
        n_heads: as_u32(OP, "n_heads", cfg.n_heads)?,
        head_dim: as_u32(OP, "head_dim", cfg.head_dim)?,
        rot_dim: cfg.rot_dim as u32,
        theta: cfg.theta,
        freq_scale: cfg.freq_scale,
    };
    as_u32(OP, "rotated pairs", pairs)?;
    gpu.launch(&variant, "rope", variant.launch_config(pairs), &params)
}

/// An element-wise kernel that takes four elements per thread where it can.
fn elementwise(gpu: &Gpu, entry: &'static str, a: u64, b: u64, out: u64, n: usize) -> Result<(), CudaError> {
    let variant = ActivationVariant;
    let params = ElementwiseParams { a, b, out, n: n as u64 };
    gpu.launch(&variant, entry, variant.launch_config(n.div_ceil(4)), &params)
}

macro_rules! gated_activation {
    ($(#[$doc:meta])* $name:ident) => {
        $(#[$doc])*
        pub fn $name(
            gpu: &Gpu,
            gate: &impl DevicePtr<f32>,
            up: &impl DevicePtr<f32>,
            n: usize,
            out: &mut impl DevicePtrMut<f32>,
        ) -> Result<(), CudaError> {
            const OP: &str = stringify!($name);
            if n == 0 {
                return Ok(());
            }
            check_len(OP, "gate", gate.len(), n)?;
            check_len(OP, "up", up.len(), n)?;
            check_len(OP, "out", out.len(), n)?;
            let params = GluParams { gate: addr(gpu, gate), up: addr(gpu, up), out: addr_mut(gpu, out), n: n as u64, width: n as u64, in_stride: n as u64 };
            launch_glu(gpu, OP, &params)
        }
    };
}

gated_activation! {
    /// `out = silu(gate) * up` over `n` elements.
    swiglu
}
gated_activation! {
    /// `out = gelu_tanh(gate) * up` over `n` elements.
    geglu
}

/// The gated activation of `rows` rows of a fused `[gate | up]` projection (`2 * half` wide)
/// into `out` (`rows x half`), in one launch.
pub fn glu_rows(gpu: &Gpu, src: &impl DevicePtr<f32>, rows: usize, half: usize, glu: Glu, out: &mut impl DevicePtrMut<f32>) -> Result<(), CudaError> {
    const OP: &str = "glu_rows";
    let n = elems(OP, &[rows, half])?;
    if n == 0 {
        return Ok(());
    }
    check_len(OP, "src", src.len(), 2 * n)?;
    check_len(OP, "out", out.len(), n)?;
    let gate = addr(gpu, src);
    let params = GluParams { gate, up: gate + 4 * half as u64, out: addr_mut(gpu, out), n: n as u64, width: half as u64, in_stride: 2 * half as u64 };
    let entry = match glu {
        Glu::SwiGlu => "swiglu",
        Glu::GeGlu => "geglu",
    };
    launch_glu(gpu, entry, &params)
}

/// The `swiglu` / `geglu` kernel over `params.n` outputs (four per thread where it can).
fn launch_glu(gpu: &Gpu, entry: &'static str, params: &GluParams) -> Result<(), CudaError> {
    gpu.launch(&ActivationVariant, entry, ActivationVariant.launch_config((params.n as usize).div_ceil(4)), params)
}

/// `acc += x` over `n` elements (the residual add).
pub fn add(gpu: &Gpu, acc: &mut impl DevicePtrMut<f32>, x: &impl DevicePtr<f32>, n: usize) -> Result<(), CudaError> {
    const OP: &str = "add";
    if n == 0 {
        return Ok(());
    }
    check_len(OP, "acc", acc.len(), n)?;
    check_len(OP, "x", x.len(), n)?;
    let acc = addr_mut(gpu, acc);
    add_raw(gpu, acc, addr(gpu, x), n)
}

/// `acc += x` over `n` f32 at device addresses (lengths checked by the caller).
pub(crate) fn add_raw(gpu: &Gpu, acc: u64, x: u64, n: usize) -> Result<(), CudaError> {
    elementwise(gpu, "add", acc, x, acc, n)
}

/// A column range of a row-major matrix: `n_cols` columns from `col` in rows of `width`.
fn check_cols(
    op: &'static str,
    what: &str,
    len: usize,
    width: usize,
    col: usize,
    n_cols: usize,
    n_rows: usize,
) -> Result<(), CudaError> {
    if col.checked_add(n_cols).is_none_or(|end| end > width) {
        return Err(CudaError::invalid(op, format!("{what} columns {col}..{} exceed its width {width}", col + n_cols)));
    }
    // The last row only needs to reach the end of the range.
    let need = elems(op, &[n_rows - 1, width])? + col + n_cols;
    check_len(op, what, len, need)?;
    as_u32(op, "width", width).map(|_| ())
}

/// `dst[r, dst_col + c] = src[r, src_col + c]` for `c < n_cols`, `r < n_rows` (row-major, rows of
/// `src_width` / `dst_width`): splits or joins the column blocks of fused projections.
#[allow(clippy::too_many_arguments)]
pub fn copy_cols(
    gpu: &Gpu,
    src: &impl DevicePtr<f32>,
    src_width: usize,
    src_col: usize,
    dst: &mut impl DevicePtrMut<f32>,
    dst_width: usize,
    dst_col: usize,
    n_cols: usize,
    n_rows: usize,
) -> Result<(), CudaError> {
    const OP: &str = "copy_cols";
    if n_cols == 0 || n_rows == 0 {
        return Ok(());
    }
    check_cols(OP, "src", src.len(), src_width, src_col, n_cols, n_rows)?;
    check_cols(OP, "dst", dst.len(), dst_width, dst_col, n_cols, n_rows)?;
    let n = elems(OP, &[n_rows, n_cols])?;
    let params = CopyColsParams {
        src: addr(gpu, src),
        dst: addr_mut(gpu, dst),
        src_width: src_width as u32,
        src_col: src_col as u32,
        dst_width: dst_width as u32,
        dst_col: dst_col as u32,
        n_cols: n_cols as u32,
        n_rows: as_u32(OP, "n_rows", n_rows)?,
    };
    let variant = ActivationVariant;
    gpu.launch(&variant, "copy_cols", variant.launch_config(n), &params)
}

/// `x[r, col + c] += bias[c]` for `c < n_cols`, `r < n_rows` (rows of `width`): a projection's bias.
pub fn add_rows(
    gpu: &Gpu,
    x: &mut impl DevicePtrMut<f32>,
    width: usize,
    col: usize,
    bias: &impl DevicePtr<f32>,
    n_cols: usize,
    n_rows: usize,
) -> Result<(), CudaError> {
    const OP: &str = "add_rows";
    if n_cols == 0 || n_rows == 0 {
        return Ok(());
    }
    check_cols(OP, "x", x.len(), width, col, n_cols, n_rows)?;
    check_len(OP, "bias", bias.len(), n_cols)?;
    let n = elems(OP, &[n_rows, n_cols])?;
    let params = AddRowsParams {
        x: addr_mut(gpu, x),
        bias: addr(gpu, bias),
        width: width as u32,
        col: col as u32,
        n_cols: n_cols as u32,
        n_rows: as_u32(OP, "n_rows", n_rows)?,
    };
    let variant = ActivationVariant;
    gpu.launch(&variant, "add_rows", variant.launch_config(n), &params)
}

/// Per-head layout of a gated query projection (Qwen3.5 / Qwen3-Next attention): each of
/// `n_heads` heads is `[query | gate]`, both `head_dim` wide.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GatedQuery {
    pub n_heads: usize,
    pub head_dim: usize,
}

impl GatedQuery {
    /// Query (or gate) values per row.
    pub fn width(&self) -> usize {
        self.n_heads * self.head_dim
    }
}

/// The query halves of `n_rows` rows of a gated query projection `qg` (rows of `qg_width`)
/// into the first `heads.width()` columns of `out` (rows of `out_width`: the Q part of a QKV value).
pub fn split_gated_query(
    gpu: &Gpu,
    qg: &impl DevicePtr<f32>,
    qg_width: usize,
    heads: GatedQuery,
    n_rows: usize,
    out: &mut impl DevicePtrMut<f32>,
    out_width: usize,
) -> Result<(), CudaError> {
    gated_query_launch(gpu, "split_gated_query", 0, qg, qg_width, heads, n_rows, out, out_width)
}

/// `out = x * sigmoid(gate)` over `n_rows` rows of `heads.width()` (`x`, `out`), the gate being
/// the gate halves of the gated query projection `qg` (rows of `qg_width`): gated attention's
/// output gate.
pub fn sigmoid_gate(
    gpu: &Gpu,
    x: &impl DevicePtr<f32>,
    qg: &impl DevicePtr<f32>,
    qg_width: usize,
    heads: GatedQuery,
    n_rows: usize,
    out: &mut impl DevicePtrMut<f32>,
) -> Result<(), CudaError> {
    const OP: &str = "sigmoid_gate";
    check_len(OP, "x", x.len(), elems(OP, &[n_rows, heads.width()])?)?;
    gated_query_launch(gpu, OP, addr(gpu, x), qg, qg_width, heads, n_rows, out, heads.width())
}

/// Check and launch kernel `op` of the gated query pair (`x`: the gated input, or 0).
#[allow(clippy::too_many_arguments)]
fn gated_query_launch(
    gpu: &Gpu,
    op: &'static str,
    x: u64,
    qg: &impl DevicePtr<f32>,
    qg_width: usize,
    heads: GatedQuery,
    n_rows: usize,
    out: &mut impl DevicePtrMut<f32>,
    out_width: usize,
) -> Result<(), CudaError> {
    let w = heads.width();
    if n_rows == 0 || w == 0 {
        return Ok(());
    }
    if 2 * w > qg_width || w > out_width {
        return Err(CudaError::invalid(
            op,
            format!("{} heads of {} do not fit projection rows of {qg_width} and output rows of {out_width}", heads.n_heads, heads.head_dim),
        ));
    }
    check_cols(op, "qg", qg.len(), qg_width, 0, 2 * w, n_rows)?;
    check_cols(op, "out", out.len(), out_width, 0, w, n_rows)?;
    let params = GatedQueryParams {
        qg: addr(gpu, qg),
        x,
        out: addr_mut(gpu, out),
        qg_width: qg_width as u32,
        out_width: out_width as u32,
        n_heads: as_u32(op, "n_heads", heads.n_heads)?,
        head_dim: as_u32(op, "head_dim", heads.head_dim)?,
        n_rows: as_u32(op, "n_rows", n_rows)?,
        pad: 0,
    };
    let variant = ActivationVariant;
    gpu.launch(&variant, op, variant.launch_config(elems(op, &[n_rows, w])?), &params)
}
