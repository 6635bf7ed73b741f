//! The counter hand-off probe (see `kernels/handoff.rs`).

use super::{addr, addr_mut, as_u32, check_len};
use crate::error::CudaError;
use crate::kernels::handoff::{HandoffProbeParams, HandoffProbeVariant};
use crate::Gpu;
use cudarc::driver::{DevicePtr, DevicePtrMut};

/// One launch of `blocks` blocks: every block reads all of `x` and writes its share of `y`
/// (`y = x / 2 + 1e-4 * sum(x)`). Chained: inside an open counter chain it waits for its
/// predecessor through the chain's counters (`kernel_bench handoff` times that hand-off).
pub fn handoff_probe(gpu: &Gpu, x: &impl DevicePtr<f32>, y: &mut impl DevicePtrMut<f32>, blocks: usize) -> Result<(), CudaError> {
    const OP: &str = "handoff_probe";
    check_len(OP, "y", y.len(), x.len())?;
    if blocks == 0 {
        return Err(CudaError::invalid(OP, "no blocks to launch"));
    }
    let variant = HandoffProbeVariant;
    let params = HandoffProbeParams { x: addr(gpu, x), y: addr_mut(gpu, y), n: as_u32(OP, "n", x.len())?, pad: 0 };
    gpu.launch(&variant, "handoff_probe", variant.launch_config(blocks), &params)
}
