//! Thread-block cluster probes (see `kernels/cluster.rs`).

use super::{addr, addr_mut, as_u32, check_len};
use crate::error::CudaError;
use crate::kernels::cluster::{ClusterPhasesParams, ClusterPhasesVariant};
use crate::Gpu;
use cudarc::driver::{DevicePtr, DevicePtrMut};

/// Most blocks per cluster on the H100/H200 (8 portable, 16 with the non-portable opt-in).
pub const MAX_CLUSTER: usize = 16;

/// `clusters` clusters of `cluster` blocks run `phases` phases; in each, every block streams
/// `bytes_per_block` of `data` (a fresh slice each phase), hands `values` floats to every block
/// of its cluster through distributed shared memory and meets them at the cluster barrier.
/// `out` gets each block's last value. Needs sm_90.
#[allow(clippy::too_many_arguments)]
pub fn cluster_phases(
    gpu: &Gpu,
    data: &impl DevicePtr<u8>,
    bytes_per_block: usize,
    phases: usize,
    values: usize,
    cluster: usize,
    clusters: usize,
    out: &mut impl DevicePtrMut<f32>,
) -> Result<(), CudaError> {
    const OP: &str = "cluster_phases";
    if gpu.compute_capability().0 < 9 {
        return Err(CudaError::invalid(OP, format!("thread-block clusters need sm_90, the device is sm_{}{}", gpu.compute_capability().0, gpu.compute_capability().1)));
    }
    if !(1..=MAX_CLUSTER).contains(&cluster) || clusters == 0 {
        return Err(CudaError::invalid(OP, format!("{clusters} clusters of {cluster} blocks: need 1-{MAX_CLUSTER} blocks and at least one cluster")));
    }
    if !(1..=ClusterPhasesVariant::THREADS as usize).contains(&values) {
        return Err(CudaError::invalid(OP, format!("{values} values per block: need 1-{}", ClusterPhasesVariant::THREADS)));
    }
    if !bytes_per_block.is_multiple_of(16) || bytes_per_block > data.len() {
        return Err(CudaError::invalid(OP, format!("{bytes_per_block} bytes per block: need a multiple of 16 within the {} bytes of data", data.len())));
    }
    let blocks = cluster * clusters;
    check_len(OP, "out", out.len(), blocks)?;
    let variant = ClusterPhasesVariant { cluster: cluster as u32 };
    let params = ClusterPhasesParams {
        data: addr(gpu, data),
        data_bytes: data.len() as u64,
        out: addr_mut(gpu, out),
        bytes_per_block: as_u32(OP, "bytes_per_block", bytes_per_block)?,
        phases: as_u32(OP, "phases", phases)?,
        values: values as u32,
        pad: 0,
    };
    gpu.launch(&variant, "cluster_phases", variant.launch_config(as_u32(OP, "clusters", clusters)?, values as u32), &params)
}
