//! The GPU handle: context, compute stream, cuBLAS, module cache, scratch, device error flag.

use crate::cache::{CacheStats, DiskCache, KernelInfo, ModuleCache};
use crate::compile::{nvrtc_version, require_nvrtc, supported_archs};
use crate::error::{Context, CudaError};
use crate::kernels::common::{ERR_EXPERT_ID, ERR_POSITION, ERR_TOKEN_ID};
use crate::kernels::KernelVariant;
use crate::timeline::Timeline;
use crate::ops::{AttentionGroups, AttentionPath, GdnPath, LinearOptions, MoePath};
use crate::blas_lt::BlasLt;
use cudarc::cublas::CudaBlas;
use cudarc::driver::sys::{self, CUdevice_attribute};
use cudarc::driver::{
    CudaContext, CudaSlice, CudaStream, DevicePtr, DeviceRepr, LaunchConfig, PushKernelArg, ValidAsZeroBits,
};
use ferrite_core::env;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};

/// Check that the CUDA libraries load and a device exists, without creating a context.
/// Tests print `skipped: <this error>` when it fails.
pub fn cuda_available() -> Result<(), CudaError> {
    device_count().map(|_| ())
}

fn device_count() -> Result<usize, CudaError> {
    // cudarc panics on the first call into a library it cannot load: probe each one first.
    if !unsafe { cudarc::driver::sys::is_culib_present() } {
        return Err(CudaError::NoDevice("libcuda.so not found (no NVIDIA driver on this machine)".into()));
    }
    require_nvrtc()?;
    if !unsafe { cudarc::cublas::sys::is_culib_present() } {
        return Err(CudaError::NoDevice(
            "libcublas.so not found (add the CUDA toolkit's lib64 or the nvidia-cublas wheel's lib to LD_LIBRARY_PATH)"
                .into(),
        ));
    }
    if !unsafe { cudarc::cublaslt::sys::is_culib_present() } {
        return Err(CudaError::NoDevice(
            "libcublasLt.so not found (add the CUDA toolkit's lib64 or the nvidia-cublas wheel's lib to LD_LIBRARY_PATH)"
                .into(),
        ));
    }
    cudarc::driver::result::init().map_err(|e| CudaError::NoDevice(format!("cuInit failed: {e:?}")))?;
    let count = cudarc::driver::result::device::get_count()
        .map_err(|e| CudaError::NoDevice(format!("cuDeviceGetCount failed: {e:?}")))?;
    if count <= 0 {
        return Err(CudaError::NoDevice("the driver reports no CUDA devices".into()));
    }
    Ok(count as usize)
}

/// Where compiled kernels are kept between runs.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum KernelCacheDir {
    Disk(PathBuf),
    /// In-memory only: every process recompiles.
    Off,
}

impl KernelCacheDir {
    /// `FERRITE_KERNEL_CACHE_OFF`, then `FERRITE_KERNEL_CACHE`, then `$XDG_CACHE_HOME/ferrite/kernels`,
    /// then `~/.cache/ferrite/kernels`; off when none of them gives a folder.
    pub fn from_env() -> Self {
        if env::KERNEL_CACHE_OFF.flag() {
            return KernelCacheDir::Off;
        }
        let var = |name: &str| std::env::var_os(name).filter(|v| !v.is_empty()).map(PathBuf::from);
        env::KERNEL_CACHE
            .get()
            .map(PathBuf::from)
            .or_else(|| var("XDG_CACHE_HOME").map(|d| d.join("ferrite/kernels")))
            .or_else(|| var("HOME").map(|d| d.join(".cache/ferrite/kernels")))
            .map_or(KernelCacheDir::Off, KernelCacheDir::Disk)
    }
}

/// Settings fixed when a [`Gpu`] is created.
#[derive(Clone, Debug)]
pub struct GpuOptions {
    pub kernel_cache: KernelCacheDir,
    /// Default path/precision of [`crate::ops::linear`].
    pub linear: LinearOptions,
    /// Launch kernels with programmatic dependent launch where the device has it (sm_90+).
    pub dependent_launch: bool,
    /// The Gated DeltaNet path every batch takes (`None`: [`crate::ops::gdn_plan`] decides).
    pub gdn_path: Option<GdnPath>,
    /// The attention kernel every batch takes (`None`: [`crate::ops::attention_path`] decides).
    pub attention_path: Option<AttentionPath>,
    /// Which attention kernels run a block per KV group's query heads, sharing its K/V loads.
    pub attention_groups: AttentionGroups,
    /// The most query heads such a block serves (1 to 8).
    pub attention_max_group: usize,
    /// The most warps of a wide one-token decode attention block (4: none; 8 or 16).
    pub attention_warps: usize,
    /// The MoE expert path every batch takes (`None`: [`crate::ops::moe_plan`] decides).
    pub moe_path: Option<MoePath>,
    /// Record every kernel's start on the GPU's timer and print the table when the `Gpu` is
    /// dropped (`FERRITE_CUDA_TIMELINE`, see `timeline.rs`).
    pub timeline: bool,
}

impl GpuOptions {
    pub fn from_env() -> Self {
        GpuOptions {
            kernel_cache: KernelCacheDir::from_env(),
            linear: LinearOptions::from_env(),
            dependent_launch: !env::DISABLE_CUDA_PDL.flag(),
            gdn_path: GdnPath::forced_by(env::CUDA_GDN_PATH.get().as_deref()),
            attention_path: AttentionPath::forced_by(env::CUDA_ATTENTION_PATH.get().as_deref()),
            attention_groups: AttentionGroups::from_env(),
            attention_max_group: env::CUDA_ATTENTION_MAX_GROUP.parse(8usize).clamp(1, 8),
            attention_warps: env::CUDA_ATTENTION_WARPS.parse(16usize).clamp(4, 16).next_power_of_two(),
            moe_path: MoePath::forced_by(env::CUDA_MOE_PATH.get().as_deref()),
            timeline: env::CUDA_TIMELINE.flag(),
        }
    }
}

struct DeviceProps {
    name: String,
    compute_capability: (u32, u32),
    sm_count: u32,
    /// Most dynamic shared memory a block may opt in to, in bytes.
    smem_optin: u32,
}

/// One CUDA device with its compute stream. All ops enqueue on [`Gpu::stream`] without
/// synchronising; results are ready after [`Gpu::synchronize`] or a device-to-host copy.
pub struct Gpu {
    // Declaration order is drop order: modules and buffers go before the stream and context.
    modules: ModuleCache,
    blas: CudaBlas,
    blas_lt: BlasLt,
    error_flag: Mutex<CudaSlice<u32>>,
    error_flag_ptr: u64,
    scratch: Mutex<Option<CudaSlice<u8>>>,
    /// Times the scratch buffer was (re)allocated: a captured CUDA graph holds its address.
    scratch_generation: std::sync::atomic::AtomicU64,
    linear: LinearOptions,
    dependent_launch: bool,
    gdn_path: Option<GdnPath>,
    attention_path: Option<AttentionPath>,
    attention_groups: AttentionGroups,
    attention_max_group: usize,
    attention_warps: usize,
    moe_path: Option<MoePath>,
    props: DeviceProps,
    stream: Arc<CudaStream>,
    ctx: Arc<CudaContext>,
}

impl Drop for Gpu {
    /// With `FERRITE_CUDA_TIMELINE=1`, the timeline table of the process's kernels goes to stderr.
    fn drop(&mut self) {
        match self.timeline_report() {
            Some(Ok(table)) => eprint!("{table}"),
            Some(Err(e)) => eprintln!("warning: no kernel timeline: {e}"),
            None => {}
        }
    }
}

impl Gpu {
    /// Open device `ordinal` with settings from the `FERRITE_*` switches.
    pub fn new(ordinal: usize) -> Result<Self, CudaError> {
        Self::with_options(ordinal, GpuOptions::from_env())
    }

    pub fn with_options(ordinal: usize, options: GpuOptions) -> Result<Self, CudaError> {
        let count = device_count()?;
        if ordinal >= count {
            return Err(CudaError::NoDevice(format!("device {ordinal} requested, but only {count} present")));
        }
        let ctx = CudaContext::new(ordinal).context(|| format!("creating a context on device {ordinal}"))?;
        // We order work ourselves on one stream; cudarc's per-buffer events would add driver
        // calls to every launch and break CUDA-graph capture.
        unsafe { ctx.disable_event_tracking() };
        let stream = ctx.new_stream().context(|| "creating the compute stream".into())?;
        let blas = CudaBlas::new(stream.clone()).context(|| "creating the cuBLAS handle".into())?;
        let blas_lt = BlasLt::new(stream.clone())?;
        let name = ctx.name().context(|| "reading the device name".into())?;
        let (major, minor) = ctx.compute_capability().context(|| "reading the compute capability".into())?;
        let sm_count = ctx
            .attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
            .context(|| "reading the multiprocessor count".into())?;
        let smem_optin = ctx
            .attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN)
            .context(|| "reading the shared memory limit".into())?;
        let arch = major * 10 + minor;
        let nvrtc = nvrtc_version()?;
        let archs = supported_archs()?;
        if !archs.contains(&arch) {
            return Err(CudaError::NoDevice(format!(
                "{name} is sm_{arch}, which NVRTC {}.{} cannot compile for (it supports {archs:?})",
                nvrtc.0, nvrtc.1
            )));
        }
        let disk = match options.kernel_cache {
            KernelCacheDir::Disk(dir) => Some(DiskCache::new(dir)),
            KernelCacheDir::Off => None,
        };
        let timeline = if options.timeline { Some(Arc::new(Timeline::new(stream.clone())?)) } else { None };
        let modules = ModuleCache::new(ctx.clone(), format!("sm_{arch}"), nvrtc, disk, timeline);
        let error_flag = stream.alloc_zeros::<u32>(2).context(|| "allocating the device error flag".into())?;
        let (error_flag_ptr, _) = error_flag.device_ptr(&stream);
        Ok(Gpu {
            modules,
            blas,
            blas_lt,
            error_flag: Mutex::new(error_flag),
            error_flag_ptr,
            scratch: Mutex::new(None),
            scratch_generation: Default::default(),
            linear: options.linear,
            dependent_launch: options.dependent_launch && major >= 9,
            gdn_path: options.gdn_path,
            attention_path: options.attention_path,
            attention_groups: options.attention_groups,
            attention_max_group: options.attention_max_group,
            attention_warps: options.attention_warps,
            moe_path: options.moe_path,
            props: DeviceProps { name, compute_capability: (major as u32, minor as u32), sm_count: sm_count as u32, smem_optin: smem_optin as u32 },
            stream,
            ctx,
        })
    }

    pub fn name(&self) -> String {
        self.props.name.clone()
    }

    /// With `FERRITE_CUDA_TIMELINE=1`: the table of the kernels launched so far, each with the
    /// time it adds to the stream's critical path (waits for the stream).
    pub fn timeline_report(&self) -> Option<Result<String, CudaError>> {
        self.modules.timeline().map(|t| t.report())
    }

    /// With `FERRITE_CUDA_TIMELINE=1`: forget the launches recorded so far (stream-ordered).
    pub fn timeline_reset(&self) -> Option<Result<(), CudaError>> {
        self.modules.timeline().map(|t| t.reset())
    }

    pub fn sm_count(&self) -> u32 {
        self.props.sm_count
    }

    /// Most dynamic shared memory one block may use (after opting in), in bytes.
    pub fn max_shared_memory(&self) -> u32 {
        self.props.smem_optin
    }

    /// Whether the device runs sm_90a code such as warpgroup MMAs (`wgmma`): Hopper only.
    pub fn supports_wgmma(&self) -> bool {
        self.compute_capability() == (9, 0)
    }

    /// Whether the device launches thread-block clusters (sm_90 and later).
    pub fn supports_clusters(&self) -> bool {
        self.compute_capability().0 >= 9
    }

    pub fn compute_capability(&self) -> (u32, u32) {
        self.props.compute_capability
    }

    /// (free, total) device memory in bytes.
    pub fn mem_info(&self) -> Result<(usize, usize), CudaError> {
        self.ctx.mem_get_info().context(|| "cuMemGetInfo".into())
    }

    /// Wait for all work queued on the compute stream.
    pub fn synchronize(&self) -> Result<(), CudaError> {
        self.stream.synchronize().context(|| "synchronizing the compute stream".into())
    }

    /// The (non-default, capturable) stream every op runs on.
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    /// Default options of [`crate::ops::linear`] on this device.
    pub fn linear_options(&self) -> LinearOptions {
        self.linear
    }

    /// The Gated DeltaNet path forced on this device (`FERRITE_CUDA_GDN_PATH`), if any.
    pub fn gdn_path(&self) -> Option<GdnPath> {
        self.gdn_path
    }

    /// The attention kernel forced on this device (`FERRITE_CUDA_ATTENTION_PATH`), if any.
    pub fn attention_path(&self) -> Option<AttentionPath> {
        self.attention_path
    }

    /// Which attention kernels serve a KV group's query heads per block (`FERRITE_CUDA_ATTENTION_GROUPS`).
    pub fn attention_groups(&self) -> AttentionGroups {
        self.attention_groups
    }

    /// The most query heads a grouped attention block serves (`FERRITE_CUDA_ATTENTION_MAX_GROUP`).
    pub fn attention_max_group(&self) -> usize {
        self.attention_max_group
    }

    /// The most warps of a wide one-token decode attention block (`FERRITE_CUDA_ATTENTION_WARPS`).
    pub fn attention_warps(&self) -> usize {
        self.attention_warps
    }

    /// The MoE expert path forced on this device (`FERRITE_CUDA_MOE_PATH`), if any.
    pub fn moe_path(&self) -> Option<MoePath> {
        self.moe_path
    }

    pub fn kernel_cache_stats(&self) -> CacheStats {
        self.modules.stats()
    }

    /// Folder of the on-disk kernel cache, if enabled.
    pub fn kernel_cache_dir(&self) -> Option<PathBuf> {
        self.modules.disk().map(|d| d.dir().to_path_buf())
    }

    /// Compile (or fetch from the caches) a kernel variant now, e.g. to warm up before timing.
    pub fn prepare<V: KernelVariant>(&self, variant: &V) -> Result<(), CudaError> {
        self.modules.get(variant).map(|_| ())
    }

    /// Registers, spills and shared memory of a variant's kernels (compiling it if needed).
    pub fn kernel_info<V: KernelVariant>(&self, variant: &V) -> Result<Vec<KernelInfo>, CudaError> {
        self.modules.get(variant)?.info()
    }

    /// Path of the disk entry a variant is (or would be) cached under.
    pub fn kernel_cache_path<V: KernelVariant>(&self, variant: &V) -> Option<PathBuf> {
        self.modules.disk().map(|d| d.entry_path(V::FAMILY, &self.modules.key(variant)))
    }

    /// Allocate `n` zeroed elements on the compute stream.
    pub fn alloc_zeros<T: DeviceRepr + ValidAsZeroBits>(&self, n: usize) -> Result<CudaSlice<T>, CudaError> {
        self.stream.alloc_zeros(n).context(|| format!("allocating {n} elements"))
    }

    /// Copy host data to a new device buffer.
    pub fn upload<T: DeviceRepr>(&self, data: &[T], what: &str) -> Result<CudaSlice<T>, CudaError> {
        self.stream.clone_htod(data).context(|| format!("copying {what} to the device ({} elements)", data.len()))
    }

    /// Copy device data back to the host (waits for the stream).
    pub fn download<T: DeviceRepr, S: DevicePtr<T>>(&self, data: &S) -> Result<Vec<T>, CudaError> {
        self.stream.clone_dtoh(data).context(|| "copying device data to the host".into())
    }

    /// Report (and clear) the first bad value a kernel met in device memory since the last
    /// check: a token id outside the embedding table, a position beyond the KV cache, or an
    /// expert id outside a MoE expert bank.
    /// Kernels never read or write out of bounds for such values; they skip the work and
    /// poison their output with NaN. Waits for the stream.
    pub fn check_device(&self) -> Result<(), CudaError> {
        let mut flag = self.error_flag.lock().unwrap_or_else(|p| p.into_inner());
        let value = self.stream.clone_dtoh(&*flag).context(|| "reading the device error flag".into())?;
        if value[0] == 0 {
            return Ok(());
        }
        self.stream.memset_zeros(&mut *flag).context(|| "clearing the device error flag".into())?;
        Err(CudaError::DeviceCheck(match value[0] {
            ERR_TOKEN_ID => format!("embed: token id {} is outside the embedding table", value[1]),
            ERR_POSITION => format!("store_qkv/attention: position {} is beyond the KV cache capacity", value[1]),
            ERR_EXPERT_ID => format!("moe_ffn: expert id {} is outside the expert bank", value[1]),
            code => format!("unknown device error code {code} (detail {})", value[1]),
        }))
    }

    pub(crate) fn error_flag_ptr(&self) -> u64 {
        self.error_flag_ptr
    }

    pub(crate) fn blas_lt(&self) -> &BlasLt {
        &self.blas_lt
    }

    pub(crate) fn blas(&self) -> &CudaBlas {
        &self.blas
    }

    /// Launch entry point `entry` of `variant`'s module with one by-value parameter struct.
    pub(crate) fn launch<V: KernelVariant, P: DeviceRepr>(
        &self,
        variant: &V,
        entry: &'static str,
        cfg: LaunchConfig,
        params: &P,
    ) -> Result<(), CudaError> {
        let module = self.modules.get(variant)?;
        let function = module.function(entry);
        let what = || {
            format!("launching {}::{entry} ({variant:?}, grid {:?}, block {:?})", V::FAMILY, cfg.grid_dim, cfg.block_dim)
        };
        allow_launch(function, &cfg).context(what)?;
        let cluster_z = variant.cluster_z();
        if !self.dependent_launch && cluster_z == 1 {
            let mut builder = self.stream.launch_builder(function);
            builder.arg(params);
            unsafe { builder.launch(cfg) }.context(what)?;
            return Ok(());
        }
        // Programmatic dependent launch: the kernel may be scheduled before the previous kernel
        // in the stream has finished; every kernel waits for it (`pdl_wait` in the common
        // header) before touching activations, so only its start-up and weight loads overlap.
        // A clustered kernel (sm_90) takes its cluster shape as a second attribute.
        let mut attributes = [
            sys::CUlaunchAttribute {
                id: sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION,
                pad: [0; 4],
                value: sys::CUlaunchAttributeValue { programmaticStreamSerializationAllowed: i32::from(self.dependent_launch) },
            },
            sys::CUlaunchAttribute {
                id: sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION,
                pad: [0; 4],
                value: sys::CUlaunchAttributeValue { clusterDim: sys::CUlaunchAttributeValue_union__bindgen_ty_1 { x: 1, y: 1, z: cluster_z } },
            },
        ];
        let used = if cluster_z > 1 { 2 } else { 1 };
        let config = self.launch_config_ex(&cfg, &mut attributes[..used]);
        // One kernel argument: the parameter struct, passed by value.
        let mut args = [params as *const P as *mut std::ffi::c_void];
        self.ctx.bind_to_thread().context(what)?;
        unsafe { sys::cuLaunchKernelEx(&config, function.cu_function(), args.as_mut_ptr(), std::ptr::null_mut()) }
            .result()
            .context(what)?;
        Ok(())
    }

    /// `cfg` on this GPU's stream with `attributes`, for `cuLaunchKernelEx`.
    fn launch_config_ex(&self, cfg: &LaunchConfig, attributes: &mut [sys::CUlaunchAttribute]) -> sys::CUlaunchConfig {
        sys::CUlaunchConfig {
            gridDimX: cfg.grid_dim.0,
            gridDimY: cfg.grid_dim.1,
            gridDimZ: cfg.grid_dim.2,
            blockDimX: cfg.block_dim.0,
            blockDimY: cfg.block_dim.1,
            blockDimZ: cfg.block_dim.2,
            sharedMemBytes: cfg.shared_mem_bytes,
            hStream: self.stream.cu_stream(),
            attrs: attributes.as_mut_ptr(),
            numAttrs: attributes.len() as u32,
        }
    }

    /// Grow the scratch buffer used by the GEMM path to at least `bytes` now, so that later
    /// ops do not allocate (useful before capturing a CUDA graph).
    pub fn reserve_scratch(&self, bytes: usize) -> Result<(), CudaError> {
        self.with_scratch(bytes, |_| Ok(()))
    }

    /// Changes whenever the scratch buffer moves: a CUDA graph captured under another generation
    /// holds a freed address and must not be replayed.
    pub(crate) fn scratch_generation(&self) -> u64 {
        self.scratch_generation.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Run `f` with the device address of a scratch area of at least `bytes` bytes.
    /// The lock keeps other threads from resizing it while `f` enqueues work; the old buffer
    /// is freed in stream order, after the work already queued on it.
    pub(crate) fn with_scratch<R>(
        &self,
        bytes: usize,
        f: impl FnOnce(u64) -> Result<R, CudaError>,
    ) -> Result<R, CudaError> {
        let mut scratch = self.scratch.lock().unwrap_or_else(|p| p.into_inner());
        if scratch.as_ref().is_none_or(|s| s.len() < bytes) {
            *scratch = None;
            let buf =
                unsafe { self.stream.alloc::<u8>(bytes) }.context(|| format!("allocating {bytes} bytes of scratch"))?;
            *scratch = Some(buf);
            self.scratch_generation.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        }
        let (ptr, _sync) = scratch.as_ref().expect("allocated above").device_ptr(&self.stream);
        f(ptr)
    }
}

/// Lets `function` take `cfg`: more than 48 KiB of dynamic shared memory only once the function
/// allows it.
fn allow_launch(function: &cudarc::driver::CudaFunction, cfg: &LaunchConfig) -> Result<(), cudarc::driver::DriverError> {
    if cfg.shared_mem_bytes > 48 * 1024 {
        function.set_attribute(sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, cfg.shared_mem_bytes as i32)?;
    }
    Ok(())
}

