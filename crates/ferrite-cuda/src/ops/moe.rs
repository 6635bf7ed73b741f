//! `moe_ffn`: the mixture-of-experts FFN of Qwen3.5-MoE on the device, without the host.
//!
//! Per batch of `n` tokens of (already normalised) input `x`:
//! 1. router logits `x · routerᵀ` in f32 (the f32 GEMV, or SGEMM for ragged rows: routing never
//!    sees quantized activations, as on the CPU, so both backends choose the same experts);
//! 2. [`moe_route`]: softmax, top-k (ties to the lower expert index), optional renormalisation,
//!    into expert ids and weights `[n, top_k]` in device memory;
//! 3. the routed experts on the GEMVs with `EXPERTS` (an expert bank is one matrix of
//!    `n_experts * rows` rows, so an expert is a row offset). The gate/up GEMV reads token
//!    `t`'s activations and writes row `t * top_k + slot` of `act = silu(gate) * up`; the down
//!    GEMV reads that row and writes the same row of `y`. [`MoePath::Pairs`] (decode): grid y
//!    walks the `n * top_k` (token, slot) pairs and each block reads its pair's expert id.
//!    [`MoePath::Grouped`] (prefill, int8 activations): [`moe_group`] lists the pairs expert
//!    by expert on the device, and grid y walks tiles of up to 8 pairs of one expert, so each
//!    weight unit loaded serves the whole tile instead of one pair. With int8 activations (the
//!    default, quantized banks) gate and up are one GEMV with the SwiGLU epilogue (a fused
//!    `[gate; up]` bank, or split banks of one type through the `UP_SPLIT` second weight);
//!    float banks, `FERRITE_CUDA_GEMV_ACTIVATIONS=f32`, or split banks of two types take the
//!    f32 (or per-bank) GEMVs and a separate `swiglu`;
//! 4. the shared expert with the ordinary linear ops (gate and up as one int8 GEMV when they
//!    can be, else two linears and `swiglu`; then the down linear);
//! 5. `moe_combine`: `out = Σ_slot w y + sigmoid(x · gate_inp) shared + residual`.

use super::linear::{gemv, gemv_q8, linear_q8_gated_pair, linear_with, ExpertGroups, ExpertRows};
use super::{addr, addr_mut, as_u32, check_len, elems, quantize_q8, swiglu, Epilogue, GemvActivations, Glu, LinearOptions, LinearPath, LinearPlan, Precision, Q8Activations};
use crate::error::CudaError;
use crate::kernels::moe::{group_max_tiles, MoeCombineParams, MoeCombineVariant, MoeGroupParams, MoeGroupVariant, MoeRouteParams, MoeRouteVariant, GROUP_TILE};
use crate::weight::{self, DeviceWeight};
use crate::Gpu;
use cudarc::driver::{CudaSlice, DevicePtr, DevicePtrMut};
use ferrite_core::env;

/// The gate and up projections of the routed experts.
#[derive(Clone, Copy)]
pub enum ExpertGateUp<'a> {
    /// One bank whose expert `e` owns rows `e * 2 ff ..`: `[gate (ff rows); up (ff rows)]`.
    Fused(&'a DeviceWeight),
    /// Two banks of `n_experts * ff` rows.
    Split { gate: &'a DeviceWeight, up: &'a DeviceWeight },
}

/// The gated shared expert: `sigmoid(x · gate_inp) * down(silu(gate · x) * (up · x))`.
#[derive(Clone, Copy)]
pub struct SharedExpert<'a> {
    pub gate: &'a DeviceWeight,
    pub up: &'a DeviceWeight,
    pub down: &'a DeviceWeight,
    /// `dim` floats.
    pub gate_inp: &'a CudaSlice<f32>,
}

/// The weights of one MoE FFN. Banks are matrices of `n_experts` stacked experts
/// (`gate_up`: `n_experts * 2 ff` or two of `n_experts * ff` rows of `dim`; `down`:
/// `n_experts * dim` rows of `ff`); the router is `n_experts x dim`.
#[derive(Clone, Copy)]
pub struct MoeWeights<'a> {
    pub router: &'a DeviceWeight,
    pub gate_up: ExpertGateUp<'a>,
    pub down: &'a DeviceWeight,
    pub shared: Option<SharedExpert<'a>>,
    pub top_k: usize,
    pub norm_topk_prob: bool,
}

/// Sizes of a MoE FFN (what [`MoeScratch`] is allocated for).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MoeDims {
    pub dim: usize,
    pub n_experts: usize,
    pub top_k: usize,
    /// Hidden width of one routed expert.
    pub n_ff: usize,
    /// Hidden width of the shared expert (0: none).
    pub n_ff_shared: usize,
}

/// Expert counts and `top_k` the kernels take: the routing block keeps two floats per expert in
/// shared memory, the combine block ranks each slot with one thread.
pub fn check_moe_shape(n_experts: usize, top_k: usize) -> Result<(), CudaError> {
    const OP: &str = "moe_ffn";
    if n_experts == 0 || n_experts > MoeRouteVariant::MAX_EXPERTS {
        return Err(CudaError::invalid(OP, format!("{n_experts} experts: the routing kernel takes 1 ..= {}", MoeRouteVariant::MAX_EXPERTS)));
    }
    if top_k == 0 || top_k > n_experts || top_k > MoeCombineVariant::BLOCK {
        return Err(CudaError::invalid(OP, format!("top {top_k} of {n_experts} experts: need 1 ..= min(experts, {})", MoeCombineVariant::BLOCK)));
    }
    Ok(())
}

impl MoeWeights<'_> {
    /// Check that the weights make one MoE FFN the kernels can run; return its sizes.
    pub fn check(&self) -> Result<MoeDims, CudaError> {
        const OP: &str = "moe_ffn";
        let (e, d, ff) = (self.router.rows, self.router.cols, self.down.cols);
        check_moe_shape(e, self.top_k)?;
        let shape = |w: &DeviceWeight| (w.rows, w.cols);
        let bad = |what: &str, w: &DeviceWeight, want: (usize, usize)| {
            CudaError::invalid(OP, format!("{what} is {}x{}, a bank of {e} experts of width {d} and hidden {ff} needs {}x{}", w.rows, w.cols, want.0, want.1))
        };
        let banks: Vec<(&str, &DeviceWeight, (usize, usize))> = match self.gate_up {
            ExpertGateUp::Fused(w) => vec![("the gate/up bank", w, (e * 2 * ff, d))],
            ExpertGateUp::Split { gate, up } => vec![("the gate bank", gate, (e * ff, d)), ("the up bank", up, (e * ff, d))],
        };
        for (what, w, want) in banks.into_iter().chain([("the down bank", self.down, (e * d, ff))]) {
            if shape(w) != want {
                return Err(bad(what, w, want));
            }
            // The expert GEMVs read whole 32-value units (always true of quantized rows).
            if !w.cols.is_multiple_of(32) {
                return Err(CudaError::invalid(OP, format!("{what} has rows of {} {} values: the expert GEMVs need multiples of 32", w.cols, w.dtype)));
            }
        }
        let mut n_ff_shared = 0;
        if let Some(sh) = &self.shared {
            let ffs = sh.gate.rows;
            if shape(sh.gate) != (ffs, d) || shape(sh.up) != (ffs, d) || shape(sh.down) != (d, ffs) || sh.gate_inp.len() < d {
                return Err(CudaError::invalid(
                    OP,
                    format!(
                        "shared expert gate {:?}, up {:?}, down {:?}, gate vector of {} do not fit width {d}",
                        shape(sh.gate),
                        shape(sh.up),
                        shape(sh.down),
                        sh.gate_inp.len()
                    ),
                ));
            }
            n_ff_shared = ffs;
        }
        Ok(MoeDims { dim: d, n_experts: e, top_k: self.top_k, n_ff: ff, n_ff_shared })
    }
}

/// Activations of one expert GEMV.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ExpertGemv {
    /// int8 activations, `dp4a` on the packed bank (quantized banks, the default).
    Q8,
    /// f32 activations (float banks, or `FERRITE_CUDA_GEMV_ACTIVATIONS=f32`).
    F32,
}

/// How the routed experts' GEMVs walk a batch's (token, slot) pairs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MoePath {
    /// One pair per grid-y tile: each pair reads its expert's rows (decode, short batches).
    Pairs,
    /// The pairs grouped by expert on the device ([`moe_group`]), then tiles of up to 8 pairs
    /// of one expert per block: each weight unit loaded serves the tile (prefill). int8 GEMVs
    /// only.
    Grouped,
}

impl MoePath {
    /// The path `FERRITE_CUDA_MOE_PATH` forces (`pairs`, `grouped`), `None` for `auto` or
    /// unset; another value is reported on stderr and means `auto`.
    pub fn forced_by(value: Option<&str>) -> Option<MoePath> {
        super::forced_path(&env::CUDA_MOE_PATH, value, &[("pairs", MoePath::Pairs), ("grouped", MoePath::Grouped)])
    }
}

/// The kernels [`moe_ffn`] runs for a batch.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MoePlan {
    /// How the routed experts walk the pairs.
    pub experts: MoePath,
    /// Gate and up in one int8 GEMV with the SwiGLU epilogue; else two GEMVs (`gate`, `up`)
    /// and `swiglu`.
    pub gate_up_glu: bool,
    pub gate: ExpertGemv,
    pub up: ExpertGemv,
    pub down: ExpertGemv,
    /// The shared expert's gate and up in one int8 GEMV (else two linears and `swiglu`).
    pub shared_glu: bool,
}

fn expert_gemv(w: &DeviceWeight, opts: &LinearOptions) -> ExpertGemv {
    if weight::planes(w.dtype).is_some() && opts.activations == GemvActivations::Q8 {
        ExpertGemv::Q8
    } else {
        ExpertGemv::F32
    }
}

/// What [`moe_ffn`] runs for `n_tokens` tokens with `opts` (whose GEMV activation format also
/// picks the expert GEMVs'; the routed experts always take GEMVs, the shared expert follows
/// [`super::linear_plan`]) on the expert path `path` forces (`None`: pair by pair, which was
/// faster than the grouped path at every batch size `kernel_bench moe` measured on the H200,
/// docs/perf.md). Forcing the grouped path where an expert GEMV takes f32 activations is an
/// error.
pub fn moe_plan(w: &MoeWeights, n_tokens: usize, opts: &LinearOptions, path: Option<MoePath>) -> Result<MoePlan, CudaError> {
    let (gate, up) = match w.gate_up {
        ExpertGateUp::Fused(b) => (expert_gemv(b, opts), expert_gemv(b, opts)),
        ExpertGateUp::Split { gate, up } => (expert_gemv(gate, opts), expert_gemv(up, opts)),
    };
    let gate_up_glu = gate == ExpertGemv::Q8
        && up == ExpertGemv::Q8
        && match w.gate_up {
            ExpertGateUp::Fused(_) => true,
            ExpertGateUp::Split { gate, up } => gate.dtype == up.dtype,
        };
    let shared_glu = w.shared.is_some_and(|sh| {
        sh.gate.dtype == sh.up.dtype && super::linear_plan(sh.gate.dtype, sh.gate.cols, n_tokens, opts) == LinearPlan::GemvQ8
    });
    let down = expert_gemv(w.down, opts);
    let groupable = [gate, up, down].iter().all(|&g| g == ExpertGemv::Q8);
    let experts = match path {
        Some(MoePath::Grouped) if !groupable => {
            let banks = match w.gate_up {
                ExpertGateUp::Fused(b) => format!("gate/up {}", b.dtype),
                ExpertGateUp::Split { gate, up } => format!("gate {}, up {}", gate.dtype, up.dtype),
            };
            return Err(CudaError::invalid(
                "moe_ffn",
                format!(
                    "the grouped expert path needs int8 activations on quantized banks ({banks}, down {}, {:?} activations); run these pair by pair ({}=auto or pairs)",
                    w.down.dtype,
                    opts.activations,
                    env::CUDA_MOE_PATH.name
                ),
            ));
        }
        Some(path) => path,
        None => MoePath::Pairs,
    };
    Ok(MoePlan { experts, gate_up_glu, gate, up, down, shared_glu })
}

/// Device output of [`moe_group`] for up to `max_pairs` pairs: the pairs in expert order, the
/// tile list of the grouped GEMV, and the kernel's working memory.
pub struct MoeGroups {
    n_experts: usize,
    max_pairs: usize,
    perm: CudaSlice<u32>,
    /// (expert | pairs << 16, first place in `perm`) per tile, two u32 each.
    tiles: CudaSlice<u32>,
    scatter: CudaSlice<u32>,
}

impl MoeGroups {
    pub fn new(gpu: &Gpu, max_pairs: usize, n_experts: usize) -> Result<Self, CudaError> {
        let max_pairs = max_pairs.max(1);
        Ok(MoeGroups {
            n_experts,
            max_pairs,
            perm: gpu.alloc_zeros(max_pairs)?,
            tiles: gpu.alloc_zeros(2 * group_max_tiles(max_pairs, n_experts))?,
            scatter: gpu.alloc_zeros(max_pairs)?,
        })
    }

    /// Device bytes held.
    pub fn bytes(&self) -> usize {
        4 * (self.perm.len() + self.tiles.len() + self.scatter.len())
    }

    /// The last grouping: the pairs expert by expert (ascending inside an expert; ids out of
    /// range last), and the tile list as u32 pairs `(expert | pairs << 16, first place)`.
    pub fn output(&self) -> (&CudaSlice<u32>, &CudaSlice<u32>) {
        (&self.perm, &self.tiles)
    }
}

/// Group `pairs` routed pairs by expert on the device (`ids`: `[pairs]` expert ids, pair `i =
/// token * top_k + slot`), into `groups`: see [`crate::kernels::moe`]. Returns the tile list's
/// length, [`group_max_tiles`]: the grouped GEMV's grid, which the host sizes without the
/// routing. An id out of range goes to a last bucket `n_experts` and sets the device error flag.
pub fn moe_group(gpu: &Gpu, ids: &impl DevicePtr<u32>, pairs: usize, n_experts: usize, groups: &mut MoeGroups) -> Result<usize, CudaError> {
    const OP: &str = "moe_group";
    if n_experts != groups.n_experts || pairs > groups.max_pairs {
        return Err(CudaError::invalid(OP, format!("{pairs} pairs of {n_experts} experts do not fit a grouping made for {} of {}", groups.max_pairs, groups.n_experts)));
    }
    if n_experts == 0 || n_experts > MoeRouteVariant::MAX_EXPERTS {
        return Err(CudaError::invalid(OP, format!("{n_experts} experts: the grouping kernel takes 1 ..= {}", MoeRouteVariant::MAX_EXPERTS)));
    }
    check_len(OP, "ids", ids.len(), pairs)?;
    let max_tiles = group_max_tiles(pairs, n_experts);
    if pairs == 0 {
        return Ok(0);
    }
    let params = MoeGroupParams {
        ids: addr(gpu, ids),
        perm: addr_mut(gpu, &mut groups.perm),
        tiles: addr_mut(gpu, &mut groups.tiles),
        scatter: addr_mut(gpu, &mut groups.scatter),
        error_flag: gpu.error_flag_ptr(),
        pairs: as_u32(OP, "pairs", pairs)?,
        n_experts: n_experts as u32,
        tile: GROUP_TILE as u32,
        max_tiles: as_u32(OP, "tiles", max_tiles)?,
    };
    let variant = MoeGroupVariant;
    gpu.launch(&variant, "moe_group", variant.launch_config(n_experts), &params)?;
    Ok(max_tiles)
}

/// Device working memory of [`moe_ffn`] for up to `max_tokens` tokens of one [`MoeDims`].
pub struct MoeScratch {
    dims: MoeDims,
    max_tokens: usize,
    logits: CudaSlice<f32>,
    ids: CudaSlice<u32>,
    weights: CudaSlice<f32>,
    /// `[pairs, ff]`: the SwiGLU of the routed experts, and the gate and up GEMVs' outputs when
    /// they are separate (also the shared expert's gate and up then).
    act: CudaSlice<f32>,
    tmp_a: CudaSlice<f32>,
    tmp_b: CudaSlice<f32>,
    /// `[pairs, dim]`: the routed experts' outputs.
    y: CudaSlice<f32>,
    shared_act: CudaSlice<f32>,
    shared_y: CudaSlice<f32>,
    q8_x: Q8Activations,
    q8_act: Q8Activations,
    groups: MoeGroups,
}

impl MoeScratch {
    pub fn new(gpu: &Gpu, dims: MoeDims, max_tokens: usize) -> Result<Self, CudaError> {
        const OP: &str = "moe_ffn";
        let n = max_tokens.max(1);
        let pairs = elems(OP, &[n, dims.top_k])?;
        let routed = elems(OP, &[pairs, dims.n_ff])?;
        let tmp = routed.max(elems(OP, &[n, dims.n_ff_shared])?);
        let f = |len: usize| gpu.alloc_zeros::<f32>(len.max(1));
        Ok(MoeScratch {
            dims,
            max_tokens: n,
            logits: f(elems(OP, &[n, dims.n_experts])?)?,
            ids: gpu.alloc_zeros(pairs)?,
            weights: f(pairs)?,
            act: f(routed)?,
            tmp_a: f(tmp)?,
            tmp_b: f(tmp)?,
            y: f(elems(OP, &[pairs, dims.dim])?)?,
            shared_act: f(n * dims.n_ff_shared)?,
            shared_y: f(if dims.n_ff_shared > 0 { n * dims.dim } else { 0 })?,
            q8_x: Q8Activations::new(gpu, n * dims.dim)?,
            q8_act: Q8Activations::new(gpu, routed)?,
            groups: MoeGroups::new(gpu, pairs, dims.n_experts)?,
        })
    }

    pub fn dims(&self) -> MoeDims {
        self.dims
    }

    /// Device bytes held.
    pub fn bytes(&self) -> usize {
        let floats = [&self.logits, &self.weights, &self.act, &self.tmp_a, &self.tmp_b, &self.y, &self.shared_act, &self.shared_y];
        4 * (floats.iter().map(|b| b.len()).sum::<usize>() + self.ids.len()) + self.q8_x.bytes() + self.q8_act.bytes() + self.groups.bytes()
    }

    /// The last batch's router logits `[n, n_experts]`.
    pub fn logits(&self) -> &CudaSlice<f32> {
        &self.logits
    }

    /// The last batch's routing `[n, top_k]`: expert ids and weights, slots in routing order.
    pub fn routing(&self) -> (&CudaSlice<u32>, &CudaSlice<f32>) {
        (&self.ids, &self.weights)
    }

    /// The last grouped batch's grouping ([`moe_group`]).
    pub fn groups(&self) -> &MoeGroups {
        &self.groups
    }
}

/// Route `n_tokens` tokens from their router logits (`[n_tokens, n_experts]`) as ferrite-cpu's
/// `kernels::moe::route` does: expert ids (most probable first) and weights, `[n_tokens, top_k]`.
#[allow(clippy::too_many_arguments)]
pub fn moe_route(
    gpu: &Gpu,
    logits: &impl DevicePtr<f32>,
    n_tokens: usize,
    n_experts: usize,
    top_k: usize,
    norm_topk_prob: bool,
    ids: &mut impl DevicePtrMut<u32>,
    weights: &mut impl DevicePtrMut<f32>,
) -> Result<(), CudaError> {
    const OP: &str = "moe_route";
    check_moe_shape(n_experts, top_k)?;
    if n_tokens == 0 {
        return Ok(());
    }
    as_u32(OP, "n_tokens", n_tokens)?;
    check_len(OP, "logits", logits.len(), elems(OP, &[n_tokens, n_experts])?)?;
    let pairs = elems(OP, &[n_tokens, top_k])?;
    check_len(OP, "ids", ids.len(), pairs)?;
    check_len(OP, "weights", weights.len(), pairs)?;
    let params = MoeRouteParams {
        logits: addr(gpu, logits),
        ids: addr_mut(gpu, ids),
        weights: addr_mut(gpu, weights),
        n_experts: n_experts as u32,
        top_k: top_k as u32,
        norm_topk_prob: u32::from(norm_topk_prob),
        pad: 0,
    };
    let variant = MoeRouteVariant;
    gpu.launch(&variant, "moe_route", variant.launch_config(n_tokens, n_experts, top_k), &params)
}

/// The MoE FFN on `n_tokens` rows of the normalised input `x` (`[n_tokens, dim]`):
/// `out = Σ_slot w · expert(x) + shared(x) + residual` (see the module docs), into `out`
/// (`[n_tokens, dim]`, which must not overlap `x` or `residual`). `opts` are the linear options
/// (the GEMV activation format applies to the expert GEMVs too); the expert path is the one
/// `FERRITE_CUDA_MOE_PATH` forces ([`Gpu::moe_path`]) or [`moe_plan`]'s choice. Returns the
/// plan it ran.
#[allow(clippy::too_many_arguments)]
pub fn moe_ffn(
    gpu: &Gpu,
    w: &MoeWeights,
    x: &impl DevicePtr<f32>,
    n_tokens: usize,
    residual: Option<&CudaSlice<f32>>,
    s: &mut MoeScratch,
    out: &mut impl DevicePtrMut<f32>,
    opts: &LinearOptions,
) -> Result<MoePlan, CudaError> {
    moe_ffn_with(gpu, gpu.moe_path(), w, x, n_tokens, residual, s, out, opts)
}

/// [`moe_ffn`] with the expert path forced by `path` (`None`: [`moe_plan`] chooses).
#[allow(clippy::too_many_arguments)]
pub fn moe_ffn_with(
    gpu: &Gpu,
    path: Option<MoePath>,
    w: &MoeWeights,
    x: &impl DevicePtr<f32>,
    n_tokens: usize,
    residual: Option<&CudaSlice<f32>>,
    s: &mut MoeScratch,
    out: &mut impl DevicePtrMut<f32>,
    opts: &LinearOptions,
) -> Result<MoePlan, CudaError> {
    const OP: &str = "moe_ffn";
    let dims = w.check()?;
    let plan = moe_plan(w, n_tokens, opts, path)?;
    if dims != s.dims {
        return Err(CudaError::invalid(OP, format!("the scratch was made for {:?}, the weights are {dims:?}", s.dims)));
    }
    if n_tokens > s.max_tokens {
        return Err(CudaError::invalid(OP, format!("{n_tokens} tokens exceed the scratch's {}", s.max_tokens)));
    }
    if n_tokens == 0 {
        return Ok(plan);
    }
    let MoeDims { dim: d, n_experts: e, top_k: k, n_ff: ff, .. } = dims;
    let (n, pairs) = (n_tokens, n_tokens * k);
    if pairs > 65535 {
        return Err(CudaError::invalid(OP, format!("{n} tokens x {k} experts exceed the expert GEMV grid (65535 pairs); use smaller batches")));
    }
    let len = elems(OP, &[n, d])?;
    check_len(OP, "x", x.len(), len)?;
    check_len(OP, "out", out.len(), len)?;
    if let Some(r) = residual {
        check_len(OP, "residual", r.len(), len)?;
    }
    let xp = addr(gpu, x);
    if xp % 16 != 0 {
        return Err(CudaError::invalid(OP, format!("x at device address {xp:#x} is not 16-byte aligned, as the GEMVs need")));
    }

    // 1-2. Router logits in f32, then the routing.
    let router_opts = LinearOptions { path: LinearPath::Gemv, precision: Precision::F32, activations: GemvActivations::F32, ..*opts };
    linear_with(gpu, w.router, x, n, &mut s.logits, &router_opts)?;
    moe_route(gpu, &s.logits, n, e, k, w.norm_topk_prob, &mut s.ids, &mut s.weights)?;
    let ids = addr(gpu, &s.ids);
    let groups = match plan.experts {
        MoePath::Grouped => {
            let max_tiles = moe_group(gpu, &s.ids, pairs, e, &mut s.groups)?;
            Some(ExpertGroups { tiles: addr(gpu, &s.groups.tiles), perm: addr(gpu, &s.groups.perm), max_tiles })
        }
        MoePath::Pairs => None,
    };
    let rows = |expert_rows: usize, expert_off: usize, x_div: usize| ExpertRows { ids, n_experts: e, expert_rows, expert_off, x_div, groups };

    // 3. The routed experts: gate/up (per token input, x_div = k), then down (per pair input).
    if plan.gate == ExpertGemv::Q8 || plan.up == ExpertGemv::Q8 || plan.shared_glu {
        quantize_q8(gpu, x, n, d, None, &mut s.q8_x)?;
    }
    let act = addr_mut(gpu, &mut s.act);
    if plan.gate_up_glu {
        let (bank, up, expert_rows) = match w.gate_up {
            ExpertGateUp::Fused(b) => (b, None, 2 * ff),
            ExpertGateUp::Split { gate, up } => (gate, Some(up), ff),
        };
        let epilogue = Epilogue { glu: Some(Glu::SwiGlu), ..Default::default() };
        gemv_q8(gpu, bank, up, Some(rows(expert_rows, 0, k)), s.q8_x.input(gpu), pairs, ff, (act, ff, 0), &epilogue, None, None)?;
    } else {
        let (gate, up) = match w.gate_up {
            ExpertGateUp::Fused(b) => ((b, rows(2 * ff, 0, k)), (b, rows(2 * ff, ff, k))),
            ExpertGateUp::Split { gate, up } => ((gate, rows(ff, 0, k)), (up, rows(ff, 0, k))),
        };
        let (a, b) = (addr_mut(gpu, &mut s.tmp_a), addr_mut(gpu, &mut s.tmp_b));
        for ((bank, r), path, dst) in [(gate, plan.gate, a), (up, plan.up, b)] {
            match path {
                ExpertGemv::Q8 => gemv_q8(gpu, bank, None, Some(r), s.q8_x.input(gpu), pairs, ff, (dst, ff, 0), &Epilogue::default(), None, None)?,
                ExpertGemv::F32 => gemv(gpu, bank, xp, pairs, dst, ff, Some(r))?,
            }
        }
        swiglu(gpu, &s.tmp_a, &s.tmp_b, pairs * ff, &mut s.act)?;
    }
    let y = addr_mut(gpu, &mut s.y);
    match plan.down {
        ExpertGemv::Q8 => {
            quantize_q8(gpu, &s.act, pairs, ff, None, &mut s.q8_act)?;
            debug_assert_eq!(s.q8_act.shape(), (pairs, ff));
            gemv_q8(gpu, w.down, None, Some(rows(d, 0, 1)), s.q8_act.input(gpu), pairs, d, (y, d, 0), &Epilogue::default(), None, None)?;
        }
        ExpertGemv::F32 => gemv(gpu, w.down, act, pairs, y, d, Some(rows(d, 0, 1)))?,
    }

    // 4. The shared expert with the ordinary linear ops.
    if let Some(sh) = &w.shared {
        let ffs = sh.gate.rows;
        if plan.shared_glu {
            linear_q8_gated_pair(gpu, sh.gate, sh.up, &s.q8_x, n, Glu::SwiGlu, &mut s.shared_act)?;
        } else {
            linear_with(gpu, sh.gate, x, n, &mut s.tmp_a, opts)?;
            linear_with(gpu, sh.up, x, n, &mut s.tmp_b, opts)?;
            swiglu(gpu, &s.tmp_a, &s.tmp_b, n * ffs, &mut s.shared_act)?;
        }
        linear_with(gpu, sh.down, &s.shared_act, n, &mut s.shared_y, opts)?;
    }

    // 5. The weighted sum, the gated shared expert and the residual.
    let variant = MoeCombineVariant { shared: w.shared.is_some(), residual: residual.is_some() };
    let params = MoeCombineParams {
        ids,
        weights: addr(gpu, &s.weights),
        y: addr(gpu, &s.y),
        shared: if w.shared.is_some() { addr(gpu, &s.shared_y) } else { 0 },
        x: xp,
        gate_inp: w.shared.map_or(0, |sh| addr(gpu, sh.gate_inp)),
        residual: residual.map_or(0, |r| addr(gpu, r)),
        out: addr_mut(gpu, out),
        top_k: k as u32,
        dim: as_u32(OP, "dim", d)?,
    };
    gpu.launch(&variant, "moe_combine", variant.launch_config(n, k), &params)?;
    Ok(plan)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shapes_the_kernels_take() {
        assert!(check_moe_shape(256, 8).is_ok());
        assert!(check_moe_shape(4096, 256).is_ok());
        let err = |e, k| check_moe_shape(e, k).unwrap_err().to_string();
        assert!(err(4, 5).contains("top 5 of 4 experts"));
        assert!(err(512, 300).contains("top 300 of 512"));
        assert!(err(5000, 8).contains("5000 experts"));
        assert!(err(8, 0).contains("top 0"));
    }
}
