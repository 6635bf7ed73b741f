//! cuBLASLt products for the GEMM path of `linear`: `out = x · Wᵀ (+ addend)` with f32, f16 or
//! bf16 inputs, f32 accumulation and f32 output. The optional addend (the residual of a linear)
//! is read in the epilogue as cuBLASLt's C while D is written elsewhere, which `cublasGemmEx`
//! cannot do (its C is its D), so the residual costs no launch and no extra pass.
//!
//! The descriptors and the heuristic's algorithm are made once per shape and kept: a prefill
//! repeats a handful of shapes per model.

use crate::error::CudaError;
use crate::kernels::dequant::OutType;
use cudarc::cublaslt::result as lt;
use cudarc::cublaslt::sys::{
    cublasComputeType_t, cublasLtHandle_t, cublasLtMatmulAlgo_t, cublasLtMatmulDescAttributes_t, cublasLtMatmulDesc_t,
    cublasLtMatmulPreferenceAttributes_t, cublasLtMatrixLayout_t, cudaDataType_t,
};
use cudarc::driver::{CudaSlice, CudaStream, DevicePtr};
use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::{Arc, Mutex};

/// One product shape: `out[n, m] = x[n, k] · w[m, k]ᵀ`, inputs of `input` type.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) struct LtShape {
    pub m: u64,
    pub n: u64,
    pub k: u64,
    pub input: OutType,
}

impl LtShape {
    fn input_type(&self) -> cudaDataType_t {
        match self.input {
            OutType::F32 => cudaDataType_t::CUDA_R_32F,
            OutType::F16 => cudaDataType_t::CUDA_R_16F,
            OutType::BF16 => cudaDataType_t::CUDA_R_16BF,
        }
    }
}

/// A shape's descriptors and chosen algorithm.
struct Plan {
    desc: cublasLtMatmulDesc_t,
    w: cublasLtMatrixLayout_t,
    x: cublasLtMatrixLayout_t,
    out: cublasLtMatrixLayout_t,
    algo: cublasLtMatmulAlgo_t,
}

impl Drop for Plan {
    fn drop(&mut self) {
        // SAFETY: created in `Plan::new`, destroyed once here.
        unsafe {
            let _ = lt::destroy_matrix_layout(self.out);
            let _ = lt::destroy_matrix_layout(self.x);
            let _ = lt::destroy_matrix_layout(self.w);
            let _ = lt::destroy_matmul_desc(self.desc);
        }
    }
}

fn lt_err(what: &str, shape: &LtShape, e: impl std::fmt::Debug) -> CudaError {
    CudaError::invalid("linear", format!("cuBLASLt {what} for {}x{}x{} ({:?}): {e:?}", shape.m, shape.n, shape.k, shape.input))
}

impl Plan {
    fn new(handle: cublasLtHandle_t, shape: &LtShape, workspace_bytes: usize) -> Result<Self, CudaError> {
        let s = shape;
        let err = |what: &str, e: cudarc::cublaslt::result::CublasError| lt_err(what, s, e);
        // f32 accumulation for every input type (plain f32 for f32 inputs: no TF32 rounding).
        // Column-major view: the row-major weight is a k x m matrix (transposed in the product),
        // the activations k x n, the output m x n.
        let desc = lt::create_matmul_desc(cublasComputeType_t::CUBLAS_COMPUTE_32F, cudaDataType_t::CUDA_R_32F)
            .map_err(|e| err("descriptor", e))?;
        let mut plan = Plan {
            desc,
            w: std::ptr::null_mut(),
            x: std::ptr::null_mut(),
            out: std::ptr::null_mut(),
            algo: cublasLtMatmulAlgo_t { data: [0; 8] },
        };
        // cublasOperation_t CUBLAS_OP_T (= 1; cuBLASLt's bindings do not export the enum).
        let transpose: i32 = 1;
        // SAFETY: the attribute is a 32-bit cublasOperation_t, passed by address with its size.
        unsafe {
            lt::set_matmul_desc_attribute(
                desc,
                cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_TRANSA,
                &transpose as *const _ as *const c_void,
                std::mem::size_of_val(&transpose),
            )
        }
        .map_err(|e| err("transpose attribute", e))?;
        plan.w = lt::create_matrix_layout(s.input_type(), s.k, s.m, s.k as i64).map_err(|e| err("weight layout", e))?;
        plan.x = lt::create_matrix_layout(s.input_type(), s.k, s.n, s.k as i64).map_err(|e| err("input layout", e))?;
        plan.out = lt::create_matrix_layout(cudaDataType_t::CUDA_R_32F, s.m, s.n, s.m as i64).map_err(|e| err("output layout", e))?;
        let pref = lt::create_matmul_pref().map_err(|e| err("preference", e))?;
        let bytes = workspace_bytes as u64;
        // SAFETY: `pref` is live until destroyed below; the attribute is a u64 by address.
        let heuristic = unsafe {
            let set = lt::set_matmul_pref_attribute(
                pref,
                cublasLtMatmulPreferenceAttributes_t::CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                &bytes as *const u64 as *const c_void,
                std::mem::size_of::<u64>(),
            );
            let found = set.and_then(|_| lt::get_matmul_algo_heuristic(handle, desc, plan.w, plan.x, plan.out, plan.out, pref));
            let _ = lt::destroy_matmul_pref(pref);
            found
        }
        .map_err(|e| err("algorithm heuristic", e))?;
        plan.algo = heuristic.algo;
        Ok(plan)
    }
}

/// The cuBLASLt handle, its workspace and the plans made so far.
pub(crate) struct BlasLt {
    handle: cublasLtHandle_t,
    workspace: CudaSlice<u8>,
    plans: Mutex<HashMap<LtShape, Plan>>,
    stream: Arc<CudaStream>,
}

// SAFETY: the handle and plans are only used under `plans`' lock, on one stream.
unsafe impl Send for BlasLt {}
unsafe impl Sync for BlasLt {}

/// Workspace for the algorithms that split K (NVIDIA's recommendation for Hopper).
const WORKSPACE_BYTES: usize = 32 << 20;

impl BlasLt {
    pub fn new(stream: Arc<CudaStream>) -> Result<Self, CudaError> {
        let handle = lt::create_handle().map_err(|e| CudaError::NoDevice(format!("creating the cuBLASLt handle: {e:?}")))?;
        // SAFETY: the workspace is scratch that cuBLASLt overwrites before reading.
        let workspace = unsafe { stream.alloc::<u8>(WORKSPACE_BYTES) }
            .map_err(|e| CudaError::invalid("linear", format!("allocating the cuBLASLt workspace: {e:?}")))?;
        Ok(BlasLt { handle, workspace, plans: Mutex::new(HashMap::new()), stream })
    }

    /// `out = x · wᵀ + addend` (or without the addend), all device addresses: `w` `[m, k]` and
    /// `x` `[n, k]` of `shape.input`, `addend` and `out` f32 `[n, m]`. Stream-ordered; no sync.
    pub fn matmul(&self, shape: LtShape, w: u64, x: u64, addend: Option<u64>, out: u64) -> Result<(), CudaError> {
        let mut plans = self.plans.lock().unwrap_or_else(|p| p.into_inner());
        let plan = match plans.entry(shape) {
            std::collections::hash_map::Entry::Occupied(e) => e.into_mut(),
            std::collections::hash_map::Entry::Vacant(v) => v.insert(Plan::new(self.handle, &shape, WORKSPACE_BYTES)?),
        };
        let (alpha, beta) = (1f32, if addend.is_some() { 1f32 } else { 0f32 });
        let (workspace, _) = self.workspace.device_ptr(&self.stream);
        // SAFETY: the caller guarantees the buffers hold the shapes described; the plan's
        // descriptors live while the lock is held; C is only read when beta is 1.
        unsafe {
            lt::matmul(
                self.handle,
                plan.desc,
                &alpha as *const f32 as *const c_void,
                &beta as *const f32 as *const c_void,
                w as *const c_void,
                plan.w,
                x as *const c_void,
                plan.x,
                addend.unwrap_or(out) as *const c_void,
                plan.out,
                out as *mut c_void,
                plan.out,
                &plan.algo,
                workspace as *mut c_void,
                WORKSPACE_BYTES,
                self.stream.cu_stream() as *mut _,
            )
        }
        .map_err(|e| lt_err("matmul", &shape, e))
    }
}

impl Drop for BlasLt {
    fn drop(&mut self) {
        self.plans.lock().unwrap_or_else(|p| p.into_inner()).clear();
        // SAFETY: the handle was created in `new` and every plan made with it is gone.
        unsafe {
            let _ = lt::destroy_handle(self.handle);
        }
    }
}
