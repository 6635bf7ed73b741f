//! `linear_chain`: consecutive one-token int8 GEMVs (a decoder layer's output projection,
//! gate/up, down, and the next layer's QKV) as the phases of one persistent launch
//! ([`crate::kernels::chain`]). Each phase reads the f32 output of an earlier phase (or a
//! buffer written before the launch), so links are described by device addresses.

use super::{addr, as_u32, check_len, Glu, NormPrologue};
use crate::error::CudaError;
use crate::kernels::chain::{phase_tiling, plane_fields, ChainParams, ChainPhase, ChainVariant, PhaseTiling, MAX_PHASES};
use crate::weight::{self, DeviceWeight};
use crate::Gpu;
use cudarc::driver::{CudaSlice, DevicePtr};
use ferrite_gguf::GgmlType;

/// A device buffer of f32 values by address, so that one link's output can be a later link's
/// input (the buffers are the caller's; the launch only reads the addresses).
#[derive(Clone, Copy, Debug)]
pub struct DeviceView {
    pub ptr: u64,
    pub len: usize,
}

impl DeviceView {
    pub fn of(gpu: &Gpu, buf: &impl DevicePtr<f32>) -> Self {
        DeviceView { ptr: addr(gpu, buf), len: buf.len() }
    }

    /// Elements `start..` of the buffer (`start <= len`).
    pub fn skip(self, start: usize) -> Self {
        let start = start.min(self.len);
        DeviceView { ptr: self.ptr + 4 * start as u64, len: self.len - start }
    }
}

/// One linear of a chain: `out = act(W q8(norm(x))) + bias + residual`.
pub struct ChainLink<'a> {
    pub w: &'a DeviceWeight,
    pub x: DeviceView,
    pub norm: Option<NormPrologue<'a>>,
    pub bias: Option<&'a CudaSlice<f32>>,
    /// May be `out` itself: each output row reads only its own residual.
    pub residual: Option<DeviceView>,
    pub glu: Option<Glu>,
    pub out: DeviceView,
}

/// What decides whether a chain runs as one launch: each link's weight and whether it is gated.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ChainShape {
    pub dtype: GgmlType,
    pub weight_rows: usize,
    pub cols: usize,
    pub gated: bool,
}

/// The chain kernel's grid-barrier counter (a `u64` that only grows): zeroed once. Launches that
/// share one must be ordered on the stream (they are: one stream).
pub struct ChainBarrier(CudaSlice<u64>);

impl ChainBarrier {
    pub fn new(gpu: &Gpu) -> Result<Self, CudaError> {
        Ok(ChainBarrier(gpu.alloc_zeros(1)?))
    }
}

/// The kernel variant that runs these links as one launch on `gpu`, or why it cannot: the
/// reason is for the caller's fallback message (the links then run one launch each).
pub fn chain_variant(gpu: &Gpu, shapes: &[ChainShape]) -> Result<ChainVariant, String> {
    chain_plan(gpu, shapes).map(|(variant, _)| variant)
}

/// [`chain_variant`] with each link's tiling.
fn chain_plan(gpu: &Gpu, shapes: &[ChainShape]) -> Result<(ChainVariant, Vec<PhaseTiling>), String> {
    if !(2..=MAX_PHASES).contains(&shapes.len()) {
        return Err(format!("{} linears (a chain runs 2 to {MAX_PHASES})", shapes.len()));
    }
    if gpu.compute_capability().0 < 9 {
        return Err("the chain's bulk copies need sm_90 or newer".into());
    }
    let dtype = shapes[0].dtype;
    if weight::planes(dtype).is_none() || shapes.iter().any(|s| s.dtype != dtype) {
        return Err(format!("weights of one quantized type needed, found {:?}", shapes.iter().map(|s| s.dtype).collect::<Vec<_>>()));
    }
    let max_cols = max_cols(shapes);
    let Some(variant) = ChainVariant::new(dtype, max_cols) else {
        return Err(format!("inputs of {max_cols} columns leave no room for the weight stages in shared memory"));
    };
    let tilings = shapes
        .iter()
        .map(|s| {
            let out_rows = if s.gated { s.weight_rows / 2 } else { s.weight_rows };
            phase_tiling(dtype, out_rows, s.cols, s.gated, variant.stage_bytes as usize)
                .ok_or_else(|| format!("a {dtype} {}x{} weight does not stream in {}-byte stages", s.weight_rows, s.cols, variant.stage_bytes))
        })
        .collect::<Result<_, _>>()?;
    Ok((variant, tilings))
}

/// The widest input, rounded so that the activation codes after the scales stay 16-byte aligned.
fn max_cols(shapes: &[ChainShape]) -> usize {
    shapes.iter().map(|s| s.cols).max().unwrap_or(0).next_multiple_of(64)
}

impl ChainLink<'_> {
    pub fn shape(&self) -> ChainShape {
        ChainShape { dtype: self.w.dtype, weight_rows: self.w.rows, cols: self.w.cols, gated: self.glu.is_some() }
    }

    fn out_rows(&self) -> usize {
        if self.glu.is_some() { self.w.rows / 2 } else { self.w.rows }
    }
}

/// Run `links` (one token) as one launch. Fails, launching nothing, where [`chain_variant`]
/// refuses the shapes or a buffer is too short.
pub fn linear_chain(gpu: &Gpu, links: &[ChainLink], barrier: &mut ChainBarrier) -> Result<(), CudaError> {
    const OP: &str = "linear_chain";
    let shapes: Vec<ChainShape> = links.iter().map(ChainLink::shape).collect();
    let (variant, tilings) = chain_plan(gpu, &shapes).map_err(|why| CudaError::invalid(OP, why))?;
    let max_cols = max_cols(&shapes);
    let mut params = ChainParams {
        barrier: addr(gpu, &barrier.0),
        n_phases: links.len() as u32,
        max_cols: as_u32(OP, "columns", max_cols)?,
        ..Default::default()
    };
    for ((phase, link), t) in params.phases.iter_mut().zip(links).zip(tilings) {
        let (rows, cols) = (link.out_rows(), link.w.cols);
        check_len(OP, "x", link.x.len, cols)?;
        if link.x.ptr % 16 != 0 {
            return Err(CudaError::invalid(OP, "inputs are read as float4: x must be 16-byte aligned"));
        }
        check_len(OP, "out", link.out.len, rows)?;
        if let Some(r) = link.residual {
            check_len(OP, "residual", r.len, rows)?;
        }
        if let Some(b) = link.bias {
            check_len(OP, "bias", b.len(), rows)?;
        }
        if let Some(nm) = &link.norm {
            check_len(OP, "norm weight", nm.weight.len(), cols)?;
        }
        if link.glu.is_some() && (link.bias.is_some() || link.residual.is_some()) {
            return Err(CudaError::invalid(OP, "a gated link takes no bias or residual"));
        }
        let [w0, w1, w2, w3] = link.w.plane_ptrs(gpu);
        let [field0, field1, field2, field3] = plane_fields(link.w.dtype);
        let [stage_off0, stage_off1, stage_off2, stage_off3] = t.stage_off;
        *phase = ChainPhase {
            w0,
            w1,
            w2,
            w3,
            x: link.x.ptr,
            norm: link.norm.as_ref().map_or(0, |nm| addr(gpu, nm.weight)),
            out: link.out.ptr,
            residual: link.residual.map_or(0, |r| r.ptr),
            bias: link.bias.map_or(0, |b| addr(gpu, b)),
            rows: as_u32(OP, "rows", rows)?,
            cols: as_u32(OP, "cols", cols)?,
            glu: link.glu.map_or(0, |g| g as u32),
            eps: link.norm.as_ref().map_or(0.0, |nm| nm.eps),
            norm_add_one: link.norm.as_ref().is_some_and(|nm| nm.add_one) as u32,
            k_chunks: t.k_chunks,
            kc_units: t.kc_units,
            whole_rows: t.whole_rows as u32,
            field0,
            field1,
            field2,
            field3,
            stage_off0,
            stage_off1,
            stage_off2,
            stage_off3,
            chunk_bytes: t.chunk_bytes,
        };
    }
    gpu.launch(&variant, "gemv_chain", variant.launch_config(gpu.sm_count(), max_cols), &params)
}
