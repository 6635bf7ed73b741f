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

/// One Gated DeltaNet layer's recurrent state in device memory, f32, for one sequence or, in
/// batched serving, one per state slot: the conv window (`[conv_kernel - 1, conv_width]`, oldest
/// input first) and the delta-rule matrices (`[n_v_heads, k_dim, v_dim]`), as ferrite-cpu lays
/// them out, slot after slot. Its buffers never move, so a captured decode graph keeps updating
/// the same state.
pub struct GdnState {
    conv: CudaSlice<f32>,
    ssm: CudaSlice<f32>,
    slots: usize,
    pub shape: GdnShape,
}

impl GdnState {
    /// A zeroed state for one sequence (the state before the first token).
    pub fn new(gpu: &Gpu, shape: GdnShape) -> Result<Self, CudaError> {
        Self::with_slots(gpu, shape, 1)
    }

    /// Zeroed states for `slots` sequences ([`gated_delta_net_batch`]).
    pub fn with_slots(gpu: &Gpu, shape: GdnShape, slots: usize) -> Result<Self, CudaError> {
        check_gdn_shape(&shape)?;
        let len = |per_slot: usize| elems("GdnState", &[per_slot, slots]);
        // A one-tap conv keeps no window; allocations are never empty.
        let conv = gpu.alloc_zeros(len(shape.conv_state_len())?.max(1))?;
        Ok(GdnState { conv, ssm: gpu.alloc_zeros(len(shape.ssm_state_len())?.max(1))?, slots, shape })
    }

    /// Zero every slot, in stream order (a forward from position 0).
    pub fn reset(&mut self, gpu: &Gpu) -> Result<(), CudaError> {
        let stream = gpu.stream();
        stream.memset_zeros(&mut self.conv).context(|| "clearing the conv state".into())?;
        stream.memset_zeros(&mut self.ssm).context(|| "clearing the delta-rule state".into())
    }

    /// Why `slot` is not one of this state's.
    fn check_slot(&self, op: &'static str, slot: usize) -> Result<(), CudaError> {
        if slot >= self.slots {
            return Err(CudaError::invalid(op, format!("slot {slot} of {}", self.slots)));
        }
        Ok(())
    }

    /// Zero one slot, in stream order (a sequence starting at position 0).
    pub fn reset_slot(&mut self, gpu: &Gpu, slot: usize) -> Result<(), CudaError> {
        self.check_slot("GdnState::reset_slot", slot)?;
        let (c, s) = (self.shape.conv_state_len(), self.shape.ssm_state_len());
        let stream = gpu.stream();
        if c > 0 {
            stream.memset_zeros(&mut self.conv.slice_mut(slot * c..(slot + 1) * c)).context(|| "clearing a conv state slot".into())?;
        }
        stream.memset_zeros(&mut self.ssm.slice_mut(slot * s..(slot + 1) * s)).context(|| "clearing a delta-rule state slot".into())
    }

    /// Copy slot `from`'s state into slot `to`, in stream order (the prefix cache's snapshots).
    pub fn copy_slot(&mut self, gpu: &Gpu, from: usize, to: usize) -> Result<(), CudaError> {
        self.check_slot("GdnState::copy_slot", from)?;
        self.check_slot("GdnState::copy_slot", to)?;
        if from == to {
            return Ok(());
        }
        let stream = gpu.stream();
        for (buf, len) in [(&mut self.conv, self.shape.conv_state_len()), (&mut self.ssm, self.shape.ssm_state_len())] {
            if len == 0 {
                continue;
            }
            // Two views of one buffer: split it between the slots.
            let (lo, hi) = (from.min(to), from.max(to));
            let (mut first, mut second) = buf.split_at_mut(hi * len);
            let (mut a, mut b) = (first.slice_mut(lo * len..(lo + 1) * len), second.slice_mut(0..len));
            let result = if from < to { stream.memcpy_dtod(&a, &mut b) } else { stream.memcpy_dtod(&b, &mut a) };
            result.context(|| "copying a recurrent state slot".into())?;
        }
        Ok(())
    }

    /// Replace slot 0's state with host values (tests start from a non-zero state).
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
        stream.memcpy_htod(ssm, &mut self.ssm.slice_mut(0..ssm.len())).context(|| "copying the delta-rule state".into())
    }

    /// Copy one slot's conv and delta-rule state back (waits for the stream).
    pub fn download_slot(&self, gpu: &Gpu, slot: usize) -> Result<(Vec<f32>, Vec<f32>), CudaError> {
        self.check_slot("GdnState::download_slot", slot)?;
        let (c, s) = (self.shape.conv_state_len(), self.shape.ssm_state_len());
        Ok((gpu.download(&self.conv.slice(slot * c..(slot + 1) * c))?, gpu.download(&self.ssm.slice(slot * s..(slot + 1) * s))?))
    }

    /// Copy slot 0's conv and delta-rule state back (waits for the stream).
    pub fn download(&self, gpu: &Gpu) -> Result<(Vec<f32>, Vec<f32>), CudaError> {
        self.download_slot(gpu, 0)
    }

    /// Device bytes held.
    pub fn bytes(&self) -> usize {
        (self.conv.len() + self.ssm.len()) * 4
    }

    /// Device address of a slot's delta-rule matrices.
    fn ssm_addr(&mut self, gpu: &Gpu, slot: usize) -> u64 {
        addr_mut(gpu, &mut self.ssm) + 4 * (slot * self.shape.ssm_state_len()) as u64
    }
}

/// One sequence of a batch for [`gated_delta_net_batch`]: its rows and its state slot.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GdnSeq {
    pub first_row: usize,
    pub n: usize,
    pub slot: usize,
}

/// A batch of sequences for [`gated_delta_net_batch`]: `seqs` on the host, and the same on the
/// device for the kernels, `seq_rows` (every sequence's first row, then the row count) and
/// `seq_slots` (the caller keeps them equal).
pub struct GdnBatch<'a> {
    pub seqs: &'a [GdnSeq],
    pub seq_rows: &'a CudaSlice<u32>,
    pub seq_slots: &'a CudaSlice<u32>,
}

impl GdnBatch<'_> {
    /// The device form of `seqs`: (`seq_rows`, `seq_slots`).
    pub fn device_form(seqs: &[GdnSeq]) -> (Vec<u32>, Vec<u32>) {
        let rows = seqs.iter().map(|s| s.first_row as u32).chain(seqs.last().map(|s| (s.first_row + s.n) as u32)).collect();
        (rows, seqs.iter().map(|s| s.slot as u32).collect())
    }

    /// Why the batch cannot run on `n_rows` rows with `slots` state slots ([`check_seqs`]), or
    /// its device arrays cannot hold it.
    fn check(&self, n_rows: usize, slots: usize) -> Result<(), CudaError> {
        check_seqs(self.seqs, n_rows, slots)?;
        check_len("gated_delta_net_batch", "seq_rows", self.seq_rows.len(), self.seqs.len() + 1)?;
        check_len("gated_delta_net_batch", "seq_slots", self.seq_slots.len(), self.seqs.len())
    }
}

/// The sequences must cover `n_rows` rows in order, each with tokens, on distinct slots below
/// `slots` (the kernels of two sequences on one slot would race).
fn check_seqs(seqs: &[GdnSeq], n_rows: usize, slots: usize) -> Result<(), CudaError> {
    const OP: &str = "gated_delta_net_batch";
    let mut next = 0;
    let mut taken = vec![false; slots];
    for (i, s) in seqs.iter().enumerate() {
        if s.first_row != next || s.n == 0 {
            return Err(CudaError::invalid(OP, format!("sequence {i} has rows {}..{}, expected a non-empty run from row {next}", s.first_row, s.first_row + s.n)));
        }
        match taken.get_mut(s.slot) {
            None => return Err(CudaError::invalid(OP, format!("sequence {i}: state slot {} of {slots}", s.slot))),
            Some(true) => return Err(CudaError::invalid(OP, format!("sequence {i}: state slot {} belongs to another sequence of the batch", s.slot))),
            Some(t) => *t = true,
        }
        next += s.n;
    }
    if seqs.is_empty() || next != n_rows {
        return Err(CudaError::invalid(OP, format!("{} sequences cover {next} rows of {n_rows}", seqs.len())));
    }
    Ok(())
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

/// [`gated_delta_net`] on a batch of sequences, each continuing from and updating its own
/// state slot: one conv launch for all, the recurrent kernel for all sequences shorter than
/// [`GDN_CHUNKED_MIN_TOKENS`] in one launch (a decode step's whole batch), the chunked form
/// for each longer one (`FERRITE_CUDA_GDN_PATH` forces either for every sequence). Each
/// sequence gets what [`gated_delta_net`] on its rows alone would give.
#[allow(clippy::too_many_arguments)]
pub fn gated_delta_net_batch(
    gpu: &Gpu,
    x: &impl DevicePtr<f32>,
    n_rows: usize,
    w: &GdnWeights,
    state: &mut GdnState,
    scratch: &mut (impl DevicePtr<f32> + DevicePtrMut<f32>),
    out: &mut impl DevicePtrMut<f32>,
    batch: &GdnBatch,
) -> Result<(), CudaError> {
    const OP: &str = "gated_delta_net_batch";
    batch.check(n_rows, state.slots)?;
    let s = state.shape;
    let skip_from = match gpu.gdn_path() {
        Some(GdnPath::Recurrent) => 0,
        Some(GdnPath::Chunked) => 1,
        None => GDN_CHUNKED_MIN_TOKENS,
    };
    let chunked = |q: &&GdnSeq| skip_from > 0 && q.n >= skip_from;
    let path = if batch.seqs.iter().any(|q| chunked(&q)) { GdnPath::Chunked } else { GdnPath::Recurrent };
    check_len(OP, "scratch", scratch.len(), gdn_scratch_len(&s, n_rows, path))?;
    check_delta_args(OP, &s, n_rows, x.len(), w, out.len())?;
    let seqs = Some(batch);
    conv_launch(gpu, x, n_rows, w.conv, state, scratch, seqs)?;
    if batch.seqs.iter().any(|q| !chunked(&q)) {
        delta_launch(gpu, scratch, x, n_rows, w, state, out, seqs, skip_from)?;
    }
    // Each long sequence's rows of the conv output, input and output; its chunk sections after
    // the whole batch's conv output.
    let (qkv, x, out) = (addr_mut(gpu, scratch), addr(gpu, x), addr_mut(gpu, out));
    let sections = qkv + 4 * (n_rows * s.conv_width()) as u64;
    for q in batch.seqs.iter().filter(chunked) {
        let at = |base: u64, width: usize| base + 4 * (q.first_row * width) as u64;
        let rows = ChunkRows { qkv: at(qkv, s.conv_width()), x: at(x, s.proj_width()), out: at(out, s.value_width()), sections };
        chunked_launch(gpu, rows, q.n, w, state, q.slot)?;
    }
    Ok(())
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
    conv_launch(gpu, x, n_tokens, weight, state, out, None)
}

/// [`gdn_conv`] on one sequence (slot 0) or on a batch (its rows: `n_tokens`).
fn conv_launch(
    gpu: &Gpu,
    x: &impl DevicePtr<f32>,
    n_tokens: usize,
    weight: &impl DevicePtr<f32>,
    state: &mut GdnState,
    out: &mut impl DevicePtrMut<f32>,
    seqs: Option<&GdnBatch>,
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
    let (seq_rows, seq_slots, n_seqs) = seq_arrays(gpu, seqs);
    let params = GdnConvParams {
        x: addr(gpu, x),
        weight: addr(gpu, weight),
        state: addr_mut(gpu, &mut state.conv),
        out: addr_mut(gpu, out),
        seq_rows,
        seq_slots,
        n_tokens: as_u32(OP, "n_tokens", n_tokens)?,
        channels: cw as u32,
        x_width: s.proj_width() as u32,
        taps: s.conv_kernel as u32,
    };
    gpu.launch(&variant, "gdn_conv", variant.launch_config(cw, n_seqs), &params)
}

/// The kernels' `seq_rows`, `seq_slots` and sequence count for a batch (0, 0, 1: one sequence).
fn seq_arrays(gpu: &Gpu, seqs: Option<&GdnBatch>) -> (u64, u64, usize) {
    seqs.map_or((0, 0, 1), |b| (addr(gpu, b.seq_rows), addr(gpu, b.seq_slots), b.seqs.len()))
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
    check_delta_args("gdn_delta", &state.shape, n_tokens, x.len(), w, out.len())?;
    check_len("gdn_delta", "qkv", qkv.len(), elems("gdn_delta", &[n_tokens, state.shape.conv_width()])?)?;
    delta_launch(gpu, qkv, x, n_tokens, w, state, out, None, 0)
}

/// [`gdn_delta`] on one sequence (slot 0) or on a batch, skipping its sequences of at least
/// `skip_from` tokens (0: none). The caller has checked the lengths.
#[allow(clippy::too_many_arguments)]
fn delta_launch(
    gpu: &Gpu,
    qkv: &impl DevicePtr<f32>,
    x: &impl DevicePtr<f32>,
    n_tokens: usize,
    w: &GdnWeights,
    state: &mut GdnState,
    out: &mut impl DevicePtrMut<f32>,
    seqs: Option<&GdnBatch>,
    skip_from: usize,
) -> Result<(), CudaError> {
    const OP: &str = "gdn_delta";
    if n_tokens == 0 {
        return Ok(());
    }
    let s = state.shape;
    let variant = check_gdn_shape(&s)?;
    let (seq_rows, seq_slots, n_seqs) = seq_arrays(gpu, seqs);
    let params = GdnDeltaParams {
        qkv: addr(gpu, qkv),
        x: addr(gpu, x),
        a_coef: addr(gpu, w.a_coef),
        dt_bias: addr(gpu, w.dt_bias),
        norm: addr(gpu, w.norm),
        state: addr_mut(gpu, &mut state.ssm),
        out: addr_mut(gpu, out),
        seq_rows,
        seq_slots,
        n_tokens: as_u32(OP, "n_tokens", n_tokens)?,
        skip_from: as_u32(OP, "skip_from", skip_from)?,
        n_k_heads: s.n_k_heads as u32,
        n_v_heads: s.n_v_heads as u32,
        v_group: v_group(&s),
        x_width: s.proj_width() as u32,
        q_scale: 1.0 / (s.k_dim as f32).sqrt(),
        eps: w.eps,
    };
    gpu.launch(&variant, "gdn_delta", variant.launch_config(s.n_v_heads, n_seqs), &params)
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
    let s = state.shape;
    check_gdn_shape(&s)?;
    check_delta_args(OP, &s, n_tokens, x.len(), w, out.len())?;
    check_len(OP, "scratch", scratch.len(), gdn_scratch_len(&s, n_tokens, GdnPath::Chunked))?;
    let base = addr_mut(gpu, scratch);
    let rows = ChunkRows { qkv: base, x: addr(gpu, x), out: addr_mut(gpu, out), sections: base + 4 * (n_tokens * s.conv_width()) as u64 };
    chunked_launch(gpu, rows, n_tokens, w, state, 0)
}

/// Where one sequence's chunked pass reads and writes: its conv output rows, its projected
/// input rows, its output rows, and room for the chunk sections (cumulative log-decays, `W`, `U`
/// for its tokens).
struct ChunkRows {
    qkv: u64,
    x: u64,
    out: u64,
    sections: u64,
}

/// The four chunked launches on `n_tokens` rows at `rows`, on state slot `slot`. The caller has
/// checked the lengths.
fn chunked_launch(gpu: &Gpu, rows: ChunkRows, n_tokens: usize, w: &GdnWeights, state: &mut GdnState, slot: usize) -> Result<(), CudaError> {
    const OP: &str = "gdn_chunked";
    if n_tokens == 0 {
        return Ok(());
    }
    let s = state.shape;
    let variant = GdnChunkVariant::for_shape(s.k_dim, s.v_dim).map_err(|e| CudaError::invalid(OP, e))?;
    // Sections, in f32 elements from `rows.sections`.
    let w_at = n_tokens * s.n_v_heads;
    let u_at = w_at + n_tokens * s.n_v_heads * s.k_dim;
    let at = |elem: usize| rows.sections + 4 * elem as u64;
    let params = GdnChunkParams {
        qkv: rows.qkv,
        x: rows.x,
        a_coef: addr(gpu, w.a_coef),
        dt_bias: addr(gpu, w.dt_bias),
        norm: addr(gpu, w.norm),
        state: state.ssm_addr(gpu, slot),
        gam: at(0),
        w: at(w_at),
        u: at(u_at),
        out: rows.out,
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
    fn batches_must_cover_their_rows_on_distinct_slots() {
        let seq = |first_row, n, slot| GdnSeq { first_row, n, slot };
        let seqs = [seq(0, 3, 2), seq(3, 1, 0), seq(4, 130, 1)];
        assert!(check_seqs(&seqs, 134, 3).is_ok());
        assert_eq!(GdnBatch::device_form(&seqs), (vec![0, 3, 4, 134], vec![2, 0, 1]));
        for (seqs, n_rows, slots, what) in [
            (vec![seq(0, 2, 0), seq(3, 1, 1)], 4, 2, "expected a non-empty run from row 2"),
            (vec![seq(0, 0, 0)], 0, 1, "expected a non-empty run from row 0"),
            (vec![seq(0, 4, 2)], 4, 2, "state slot 2 of 2"),
            (vec![seq(0, 2, 1), seq(2, 2, 1)], 4, 2, "belongs to another sequence"),
            (vec![seq(0, 2, 1)], 4, 2, "1 sequences cover 2 rows of 4"),
            (vec![], 0, 2, "0 sequences cover 0 rows of 0"),
        ] {
            let err = check_seqs(&seqs, n_rows, slots).unwrap_err().to_string();
            assert!(err.contains(what), "{seqs:?}: {err}");
        }
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
