//! Choosing and instantiating a backend executor for a model.

use anyhow::Result;
use ferrite_cpu::{CpuExecutor, CpuPrecision};
use ferrite_model::{Executor, ExecutorOptions, Model};
use std::str::FromStr;
use std::sync::Arc;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BackendKind {
    /// CPU, multiplying on packed quantized weights (the fast CPU path).
    Cpu,
    /// CPU, fp32 reference (weights dequantized to f32): the correctness oracle.
    CpuRef,
    /// CUDA GPU 0.
    Cuda,
}

impl FromStr for BackendKind {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "cpu" => Ok(Self::Cpu),
            "cpu-ref" | "ref" => Ok(Self::CpuRef),
            "cuda" | "gpu" => Ok(Self::Cuda),
            other => Err(format!("unknown backend `{other}` (expected cpu, cpu-ref or cuda)")),
        }
    }
}

impl std::fmt::Display for BackendKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::Cpu => "cpu",
            Self::CpuRef => "cpu-ref",
            Self::Cuda => "cuda",
        })
    }
}

pub fn open_executor(model: Arc<Model>, kind: BackendKind, options: ExecutorOptions) -> Result<Box<dyn Executor>> {
    Ok(match kind {
        BackendKind::Cpu => Box::new(CpuExecutor::new(model, CpuPrecision::Quantized, options)?),
        BackendKind::CpuRef => Box::new(CpuExecutor::new(model, CpuPrecision::Reference, options)?),
        BackendKind::Cuda => ferrite_cuda::open_executor(model, options)?,
    })
}
