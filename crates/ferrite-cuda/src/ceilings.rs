//! The two hardware ceilings `ferrite bench` reports against, measured on the device in the same
//! run: device-to-device copy bandwidth (bytes read + bytes written per second) and the cuBLAS
//! bf16 matrix-product rate (8192³, f32 accumulation, random inputs — never zeros).

use crate::error::{Context, CudaError};
use crate::Gpu;
use cudarc::cublas::result::gemm_ex;
use cudarc::cublas::sys::{cublasComputeType_t, cublasGemmAlgo_t, cublasOperation_t, cudaDataType_t};
use cudarc::driver::sys::CUevent_flags;
use cudarc::driver::{DevicePtr, DevicePtrMut};
use ferrite_model::executor::HardwareCeilings;
use std::ffi::c_void;

/// Time `reps` runs of `work` with device events, after `warmup` untimed runs; seconds per run.
fn time_per_run(gpu: &Gpu, warmup: usize, reps: usize, mut work: impl FnMut() -> Result<(), CudaError>) -> Result<f64, CudaError> {
    for _ in 0..warmup {
        work()?;
    }
    let stream = gpu.stream();
    let timing = Some(CUevent_flags::CU_EVENT_DEFAULT);
    let start = stream.record_event(timing).context(|| "recording an event".into())?;
    for _ in 0..reps {
        work()?;
    }
    let end = stream.record_event(timing).context(|| "recording an event".into())?;
    end.synchronize().context(|| "waiting for the timed work".into())?;
    let ms = start.elapsed_ms(&end).context(|| "reading event times".into())?;
    Ok(ms as f64 / 1e3 / reps as f64)
}

pub fn measure(gpu: &Gpu) -> Result<HardwareCeilings, CudaError> {
    // Copy: 1 GiB each way, many times the L2.
    let n = 256 << 20;
    let src = gpu.alloc_zeros::<u32>(n)?;
    let mut dst = gpu.alloc_zeros::<u32>(n)?;
    let stream = gpu.stream().clone();
    let copy = time_per_run(gpu, 2, 10, || stream.memcpy_dtod(&src, &mut dst).context(|| "device-to-device copy".into()))?;
    let copy_bytes_per_s = 2.0 * (n * 4) as f64 / copy;
    drop((src, dst));

    // GEMM: bf16 8192 x 8192 x 8192 on pseudo-random data.
    let d = 8192usize;
    let host: Vec<u16> = (0..d * d)
        .map(|i| {
            let x = (i as u32).wrapping_mul(2_654_435_761) >> 9; // 23 random-ish bits
            let v = (x as f32 / (1u32 << 23) as f32) * 2.0 - 1.0;
            (v.to_bits() >> 16) as u16 // bf16: the top half of the f32
        })
        .collect();
    let a = gpu.upload(&host, "ceiling A")?;
    let b = gpu.upload(&host, "ceiling B")?;
    let mut c = gpu.alloc_zeros::<f32>(d * d)?;
    let (alpha, beta) = (1f32, 0f32);
    let (pa, pb, pc) = (a.device_ptr(&stream).0, b.device_ptr(&stream).0, c.device_ptr_mut(&stream).0);
    let gemm = || {
        // SAFETY: a, b (bf16) and c (f32) hold d*d elements each and outlive the timed runs.
        unsafe {
            gemm_ex(
                *gpu.blas().handle(),
                cublasOperation_t::CUBLAS_OP_T,
                cublasOperation_t::CUBLAS_OP_N,
                d as i32,
                d as i32,
                d as i32,
                &alpha as *const f32 as *const c_void,
                pa as *const c_void,
                cudaDataType_t::CUDA_R_16BF,
                d as i32,
                pb as *const c_void,
                cudaDataType_t::CUDA_R_16BF,
                d as i32,
                &beta as *const f32 as *const c_void,
                pc as *mut c_void,
                cudaDataType_t::CUDA_R_32F,
                d as i32,
                cublasComputeType_t::CUBLAS_COMPUTE_32F,
                cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
            )
        }
        .context(|| "cublasGemmEx bf16 8192^3".into())
    };
    let t = time_per_run(gpu, 3, 10, gemm)?;
    Ok(HardwareCeilings { bytes_per_s: copy_bytes_per_s, bandwidth: "device-to-device copy (read + write)".into(), matmul_flops: 2.0 * (d as f64).powi(3) / t, matmul: "cuBLAS bf16 GEMM 8192³".into() })
}
