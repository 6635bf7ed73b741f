//! Gated DeltaNet: the per-layer recurrent state and the mixer op (conv1d + SiLU, then the
//! gated delta rule with its gated RMSNorm); layouts in [`crate::kernels::gdn`].

use super::{addr, addr_mut, as_u32, check_len, elems};
use crate::error::{Context, CudaError};
use crate::kernels::gdn::{GdnChunkParams, GdnChunkVariant, GdnConvParams, GdnConvVariant, GdnDeltaParams, GdnDeltaVariant};
use crate::Gpu;
use cudarc::driver::{CudaSlice, DevicePtr, DevicePtrMut};
use ferrite_core::env;
use ferrite_model::graph::{GdnShape, ValueHeadOrder};

/// The recurrent kernel's variant for `shape`, or why the CUDA backend cannot run it (on either path).
pub fn check_gdn_shape(shape: &GdnShape) -> Result<GdnDeltaVariant, CudaError> {
    const OP: &str = "gated_delta_net";
    let s = shape;
    if s.n_k_heads == 0 || s.n_v_heads == 0 || !s.n_v_heads.is_multiple_of(s.n_k_heads) || s.conv_kernel == 0 {
        return Err(CudaError::invalid(OP, format!("bad shape {s:?}")));
    }
    as_u32(OP, "projection width", s.proj_width())?;
    GdnChunkVariant::for_shape(s.k_dim, s.v_dim).map_err(|e| CudaError::invalid(OP, e))?;
    GdnDeltaVariant::for_shape(s.k_dim, s.v_dim).map_err(|e| CudaError::invalid(OP, e))
}

/// The kernels' `v_group` for `shape`'s value-head order: value heads per key head when grouped,
/// 0 when tiled.
fn v_group(shape: &GdnShape) -> u32 {
    match shape.v_order {
        ValueHeadOrder::Tiled => 0,
        ValueHeadOrder::Grouped => (shape.n_v_heads / shape.n_k_heads) as u32,
    }
}

/// One Gated DeltaNet layer's recurrent state in device memory, f32: the conv window
/// (`[conv_kernel - 1, conv_width]`, oldest input first) and the delta-rule matrices
/// (`[n_v_heads, k_dim, v_dim]`), as ferrite-cpu lays them out. Its buffers never move, so a
/// captured decode graph keeps updating the same state.
pub struct GdnState {
    conv: CudaSlice<f32>,
    ssm: CudaSlice<f32>,
    pub shape: GdnShape,
}

impl GdnState {
    /// A zeroed state (the state before the first token).
    pub fn new(gpu: &Gpu, shape: GdnShape) -> Result<Self, CudaError> {
        check_gdn_shape(&shape)?;
        // A one-tap conv keeps no window; allocations are never empty.
        let conv = gpu.alloc_zeros(shape.conv_state_len().max(1))?;
        Ok(GdnState { conv, ssm: gpu.alloc_zeros(shape.ssm_state_len())?, shape })
    }

    /// Zero both parts, in stream order (a forward from position 0).
    pub fn reset(&mut self, gpu: &Gpu) -> Result<(), CudaError> {
        let stream = gpu.stream();
        stream.memset_zeros(&mut self.conv).context(|| "clearing the conv state".into())?;
        stream.memset_zeros(&mut self.ssm).context(|| "clearing the delta-rule state".into())
    }

    /// Replace the state with host values (tests start from a non-zero state).
    pub fn upload(&mut self, gpu: &Gpu, conv: &[f32], ssm: &[f32]) -> Result<(), CudaError> {
        const OP: &str = "GdnState::upload";
        let s = self.shape;
        if conv.len() != s.conv_state_len() || ssm.len() != s.ssm_state_len() {
            return Err(CudaError::invalid(
                OP,
                format!("got {} + {} values, the state holds {} + {}", conv.len(), ssm.len(), s.conv_state_len(), s.ssm_state_len()),
            ));
        }
        let stream = gpu.stream();
        stream.memcpy_htod(conv, &mut self.conv.slice_mut(0..conv.len())).context(|| "copying the conv state".into())?;
        stream.memcpy_htod(ssm, &mut self.ssm).context(|| "copying the delta-rule state".into())
    }

    /// Copy the conv and delta-rule state back (waits for the stream).
    pub fn download(&self, gpu: &Gpu) -> Result<(Vec<f32>, Vec<f32>), CudaError> {
        Ok((gpu.download(&self.conv.slice(0..self.shape.conv_state_len()))?, gpu.download(&self.ssm)?))
    }

    /// Device bytes held.
    pub fn bytes(&self) -> usize {
        (self.conv.len() + self.ssm.len()) * 4
    }
}

/// The per-layer parameters of the mixer, f32 on the device.
pub struct GdnWeights<'a> {
    /// `[conv_width, conv_kernel]`, the last tap on the current token.
    pub conv: &'a CudaSlice<f32>,
    /// Per value head: `-exp(A_log)` (llama.cpp's `ssm_a`).
    pub a_coef: &'a CudaSlice<f32>,
    pub dt_bias: &'a CudaSlice<f32>,
    /// Gated RMSNorm weight (`v_dim`, plain multiply) and its epsilon.
    pub norm: &'a CudaSlice<f32>,
    pub eps: f32,
}

/// How [`gated_delta_net`] runs a batch.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GdnPath {
    /// Conv, then the delta rule token by token inside one kernel per layer.
    Recurrent,
    /// Conv, then the chunked (WY / UT transform) form on chunks of 64 tokens: q/k L2 norms, the
    /// per-chunk transforms (all chunks in parallel), the state pass (sequential over chunks),
    /// the per-chunk outputs with the gated norm.
    Chunked,
}

impl GdnPath {
    /// The path `FERRITE_CUDA_GDN_PATH` forces (`recurrent`, `chunked`), `None` for `auto` or
    /// unset; another value is reported on stderr and means `auto`.
    pub fn forced_by(value: Option<&str>) -> Option<GdnPath> {
        super::forced_path(&env::CUDA_GDN_PATH, value, &[("recurrent", GdnPath::Recurrent), ("chunked", GdnPath::Chunked)])
    }
}

/// Smallest batch [`gdn_plan`] gives the chunked path. Measured on the H200 (`kernel_bench`, a
/// Qwen3.5-9B layer): recurrent 53 / 385 µs at 16 / 128 tokens, chunked 113 / 378 µs, so the
/// chunked path (a fixed cost of five launches and the 64-step substitution, then less per
/// token) breaks even near 128 tokens.
pub const GDN_CHUNKED_MIN_TOKENS: usize = 128;

/// The path for a batch of `n_tokens` (`FERRITE_CUDA_GDN_PATH` can force one: [`Gpu::gdn_path`]).
pub fn gdn_plan(n_tokens: usize) -> GdnPath {
    if n_tokens >= GDN_CHUNKED_MIN_TOKENS {
        GdnPath::Chunked
    } else {
        GdnPath::Recurrent
    }
}

/// f32 elements of the `scratch` [`gated_delta_net_with`] needs for `n_tokens` on `path`: the
/// conv output (`n_tokens` rows of `conv_width`) and, chunked, per value head the cumulative
/// log-decays, `W` and `U` (`1 + k_dim + v_dim` per token).
pub fn gdn_scratch_len(shape: &GdnShape, n_tokens: usize, path: GdnPath) -> usize {
    let conv = n_tokens * shape.conv_width();
    match path {
        GdnPath::Recurrent => conv,
        GdnPath::Chunked => conv + n_tokens * shape.n_v_heads * (1 + shape.k_dim + shape.v_dim),
    }
}

/// The mixer of one Gated DeltaNet layer on `n_tokens` rows of `x` (`q | k | v | z | b | a`,
/// `proj_width` each), continuing from and updating `state`; `out` gets `n_tokens` rows of
/// `value_width`. `scratch` holds [`gdn_scratch_len`] elements for the path [`gdn_plan`] (or
/// `FERRITE_CUDA_GDN_PATH`) picks; returns that path.
pub fn gated_delta_net(
    gpu: &Gpu,
    x: &impl DevicePtr<f32>,
    n_tokens: usize,
    w: &GdnWeights,
    state: &mut GdnState,
    scratch: &mut (impl DevicePtr<f32> + DevicePtrMut<f32>),
    out: &mut impl DevicePtrMut<f32>,
) -> Result<GdnPath, CudaError> {
    let path = gpu.gdn_path().unwrap_or_else(|| gdn_plan(n_tokens));
    gated_delta_net_with(gpu, path, x, n_tokens, w, state, scratch, out)?;
    Ok(path)
}

/// [`gated_delta_net`] on a given path. Both leave the same state (to f32 rounding: the chunked
/// form sums in another order), so either may continue the other.
#[allow(clippy::too_many_arguments)]
pub fn gated_delta_net_with(
    gpu: &Gpu,
    path: GdnPath,
    x: &impl DevicePtr<f32>,
    n_tokens: usize,
    w: &GdnWeights,
    state: &mut GdnState,
    scratch: &mut (impl DevicePtr<f32> + DevicePtrMut<f32>),
    out: &mut impl DevicePtrMut<f32>,
) -> Result<(), CudaError> {
    check_len("gated_delta_net", "scratch", scratch.len(), gdn_scratch_len(&state.shape, n_tokens, path))?;
    gdn_conv(gpu, x, n_tokens, w.conv, state, scratch)?;
    match path {
        GdnPath::Recurrent => gdn_delta(gpu, scratch, x, n_tokens, w, state, out),
        GdnPath::Chunked => gdn_chunked(gpu, scratch, x, n_tokens, w, state, out),
    }
}

/// Causal depthwise conv1d + SiLU over the `q | k | v` channels (the first `conv_width` columns
/// of each `x` row of `proj_width`) into `out` (`n_tokens` rows of `conv_width`), through the
/// state's conv window, which it then advances.
pub fn gdn_conv(
    gpu: &Gpu,
    x: &impl DevicePtr<f32>,
    n_tokens: usize,
    weight: &impl DevicePtr<f32>,
    state: &mut GdnState,
    out: &mut impl DevicePtrMut<f32>,
) -> Result<(), CudaError> {
    const OP: &str = "gdn_conv";
    if n_tokens == 0 {
        return Ok(());
    }
    let s = state.shape;
    let cw = s.conv_width();
    check_len(OP, "x", x.len(), elems(OP, &[n_tokens, s.proj_width()])?)?;
    check_len(OP, "weight", weight.len(), elems(OP, &[cw, s.conv_kernel])?)?;
    check_len(OP, "out", out.len(), elems(OP, &[n_tokens, cw])?)?;
    let variant = GdnConvVariant;
    let params = GdnConvParams {
        x: addr(gpu, x),
        weight: addr(gpu, weight),
        state: addr_mut(gpu, &mut state.conv),
        out: addr_mut(gpu, out),
        n_tokens: as_u32(OP, "n_tokens", n_tokens)?,
        channels: cw as u32,
        x_width: s.proj_width() as u32,
        taps: s.conv_kernel as u32,
    };
    gpu.launch(&variant, "gdn_conv", variant.launch_config(cw), &params)
}

/// The gated delta rule and gated RMSNorm on `n_tokens` tokens, in order: `qkv` is the conv
/// output (rows of `conv_width`), `x` the projected input (rows of `proj_width`, read for
/// `z | b | a`); `out` gets rows of `value_width`. Continues from and updates the state's
/// delta-rule matrices.
pub fn gdn_delta(
    gpu: &Gpu,
    qkv: &impl DevicePtr<f32>,
    x: &impl DevicePtr<f32>,
    n_tokens: usize,
    w: &GdnWeights,
    state: &mut GdnState,
    out: &mut impl DevicePtrMut<f32>,
) -> Result<(), CudaError> {
    const OP: &str = "gdn_delta";
    if n_tokens == 0 {
        return Ok(());
    }
    let s = state.shape;
    let variant = check_gdn_shape(&s)?;
    check_delta_args(OP, &s, n_tokens, x.len(), w, out.len())?;
    check_len(OP, "qkv", qkv.len(), elems(OP, &[n_tokens, s.conv_width()])?)?;
    let params = GdnDeltaParams {
        qkv: addr(gpu, qkv),
        x: addr(gpu, x),
        a_coef: addr(gpu, w.a_coef),
        dt_bias: addr(gpu, w.dt_bias),
        norm: addr(gpu, w.norm),
        state: addr_mut(gpu, &mut state.ssm),
        out: addr_mut(gpu, out),
        n_tokens: as_u32(OP, "n_tokens", n_tokens)?,
        n_k_heads: s.n_k_heads as u32,
        n_v_heads: s.n_v_heads as u32,
        v_group: v_group(&s),
        x_width: s.proj_width() as u32,
        q_scale: 1.0 / (s.k_dim as f32).sqrt(),
        eps: w.eps,
    };
    gpu.launch(&variant, "gdn_delta", variant.launch_config(s.n_v_heads), &params)
}

/// The checks both delta-rule paths make on the input, weights and output.
fn check_delta_args(op: &'static str, s: &GdnShape, n_tokens: usize, x_len: usize, w: &GdnWeights, out_len: usize) -> Result<(), CudaError> {
    if !(w.eps >= 0.0 && w.eps.is_finite()) {
        return Err(CudaError::invalid(op, format!("norm epsilon {} is not a non-negative number", w.eps)));
    }
    check_len(op, "x", x_len, elems(op, &[n_tokens, s.proj_width()])?)?;
    check_len(op, "a_coef", w.a_coef.len(), s.n_v_heads)?;
    check_len(op, "dt_bias", w.dt_bias.len(), s.n_v_heads)?;
    check_len(op, "norm", w.norm.len(), s.v_dim)?;
    check_len(op, "out", out_len, elems(op, &[n_tokens, s.value_width()])?)
}

/// The chunked form of [`gdn_delta`]: `scratch` starts with the conv output (`n_tokens` rows of
/// `conv_width`, whose q and k it normalises in place), followed by room for the cumulative
/// log-decays, `W` and `U` ([`gdn_scratch_len`] in all). Four launches: the norms, the per-chunk
/// transforms, the state pass, the per-chunk outputs.
pub fn gdn_chunked(
    gpu: &Gpu,
    scratch: &mut impl DevicePtrMut<f32>,
    x: &impl DevicePtr<f32>,
    n_tokens: usize,
    w: &GdnWeights,
    state: &mut GdnState,
    out: &mut impl DevicePtrMut<f32>,
) -> Result<(), CudaError> {
    const OP: &str = "gdn_chunked";
    if n_tokens == 0 {
        return Ok(());
    }
    let s = state.shape;
    check_gdn_shape(&s)?;
    let variant = GdnChunkVariant::for_shape(s.k_dim, s.v_dim).map_err(|e| CudaError::invalid(OP, e))?;
    check_delta_args(OP, &s, n_tokens, x.len(), w, out.len())?;
    check_len(OP, "scratch", scratch.len(), gdn_scratch_len(&s, n_tokens, GdnPath::Chunked))?;
    // Scratch sections, in f32 elements from its start.
    let gam = n_tokens * s.conv_width();
    let w_at = gam + n_tokens * s.n_v_heads;
    let u_at = w_at + n_tokens * s.n_v_heads * s.k_dim;
    let base = addr_mut(gpu, scratch);
    let at = |elem: usize| base + 4 * elem as u64;
    let params = GdnChunkParams {
        qkv: base,
        x: addr(gpu, x),
        a_coef: addr(gpu, w.a_coef),
        dt_bias: addr(gpu, w.dt_bias),
        norm: addr(gpu, w.norm),
        state: addr_mut(gpu, &mut state.ssm),
        gam: at(gam),
        w: at(w_at),
        u: at(u_at),
        out: addr_mut(gpu, out),
        n_tokens: as_u32(OP, "n_tokens", n_tokens)?,
        n_k_heads: s.n_k_heads as u32,
        n_v_heads: s.n_v_heads as u32,
        v_group: v_group(&s),
        x_width: s.proj_width() as u32,
        q_scale: 1.0 / (s.k_dim as f32).sqrt(),
        eps: w.eps,
    };
    gpu.launch(&variant, "gdn_chunk_norm", variant.norm_config(n_tokens, s.n_k_heads), &params)?;
    gpu.launch(&variant, "gdn_chunk_prep", variant.chunk_config(n_tokens, s.n_v_heads), &params)?;
    gpu.launch(&variant, "gdn_chunk_state", variant.state_config(s.n_v_heads), &params)?;
    gpu.launch(&variant, "gdn_chunk_out", variant.chunk_config(n_tokens, s.n_v_heads), &params)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shapes_the_kernels_cannot_run_are_refused() {
        let qwen35 = GdnShape { n_k_heads: 16, n_v_heads: 32, k_dim: 128, v_dim: 128, conv_kernel: 4, v_order: ValueHeadOrder::Tiled };
        assert_eq!(check_gdn_shape(&qwen35).unwrap(), GdnDeltaVariant { k_dim: 128, v_dim: 128, ksplit: 4 });
        let err = check_gdn_shape(&GdnShape { v_dim: 512, ..qwen35 }).unwrap_err().to_string();
        assert!(err.contains("do not fit the delta-rule kernel"), "{err}");
        let err = check_gdn_shape(&GdnShape { n_v_heads: 24, ..qwen35 }).unwrap_err().to_string();
        assert!(err.starts_with("gated_delta_net: bad shape"), "{err}");
        assert!(check_gdn_shape(&GdnShape { conv_kernel: 0, ..qwen35 }).is_err());
        // Grouped value heads (Qwen3-Next) run too; their bad shapes are refused the same way.
        let qwen3next = GdnShape { v_order: ValueHeadOrder::Grouped, ..qwen35 };
        assert_eq!(check_gdn_shape(&qwen3next).unwrap(), GdnDeltaVariant { k_dim: 128, v_dim: 128, ksplit: 4 });
        let err = check_gdn_shape(&GdnShape { n_v_heads: 24, ..qwen3next }).unwrap_err().to_string();
        assert!(err.starts_with("gated_delta_net: bad shape"), "{err}");
        assert!(check_gdn_shape(&GdnShape { v_dim: 512, ..qwen3next }).is_err());
    }

    /// `v_group` makes the kernels' `gdn_key_head` (`v_group ? h / v_group : h % n_k_heads`)
    /// pick `GdnShape::key_head`'s head in both orders.
    #[test]
    fn v_group_follows_the_value_head_order() {
        for v_order in [ValueHeadOrder::Tiled, ValueHeadOrder::Grouped] {
            for (n_k_heads, n_v_heads) in [(16, 32), (2, 8), (3, 3), (1, 4)] {
                let s = GdnShape { n_k_heads, n_v_heads, k_dim: 16, v_dim: 16, conv_kernel: 4, v_order };
                let g = v_group(&s) as usize;
                let kernel: Vec<usize> = (0..n_v_heads).map(|h| h.checked_div(g).unwrap_or(h % n_k_heads)).collect();
                let want: Vec<usize> = (0..n_v_heads).map(|h| s.key_head(h)).collect();
                assert_eq!(kernel, want, "{s:?}");
            }
        }
        let grouped = GdnShape { n_k_heads: 16, n_v_heads: 32, k_dim: 128, v_dim: 128, conv_kernel: 4, v_order: ValueHeadOrder::Grouped };
        assert_eq!(v_group(&grouped), 2);
        assert_eq!(v_group(&GdnShape { v_order: ValueHeadOrder::Tiled, ..grouped }), 0);
    }

    #[test]
    fn long_batches_take_the_chunked_path() {
        assert_eq!(gdn_plan(1), GdnPath::Recurrent);
        assert_eq!(gdn_plan(GDN_CHUNKED_MIN_TOKENS - 1), GdnPath::Recurrent);
        assert_eq!(gdn_plan(GDN_CHUNKED_MIN_TOKENS), GdnPath::Chunked);
        assert_eq!(gdn_plan(4096), GdnPath::Chunked);
        assert_eq!(GdnPath::forced_by(None), None);
        assert_eq!(GdnPath::forced_by(Some("auto")), None);
        assert_eq!(GdnPath::forced_by(Some("Recurrent")), Some(GdnPath::Recurrent));
        assert_eq!(GdnPath::forced_by(Some("chunked")), Some(GdnPath::Chunked));
        assert_eq!(GdnPath::forced_by(Some("wy")), None);
        use super::super::AttentionPath;
        assert_eq!(AttentionPath::forced_by(Some("auto")), None);
        assert_eq!(AttentionPath::forced_by(Some("Tensor")), Some(AttentionPath::Tensor));
        assert_eq!(AttentionPath::forced_by(Some("simt")), Some(AttentionPath::Simt));
        assert_eq!(AttentionPath::forced_by(Some("flash")), None);
        let qwen35 = GdnShape { n_k_heads: 16, n_v_heads: 32, k_dim: 128, v_dim: 128, conv_kernel: 4, v_order: ValueHeadOrder::Tiled };
        assert_eq!(gdn_scratch_len(&qwen35, 10, GdnPath::Recurrent), 10 * 8192);
        assert_eq!(gdn_scratch_len(&qwen35, 10, GdnPath::Chunked), 10 * (8192 + 32 * 257));
    }
}
