//! NVRTC: CUDA C++ source to CUBIN for one GPU architecture.
//!
//! CUBIN rather than PTX: the driver loads it as is, with no second JIT and no
//! "PTX too new for this driver" failure when NVRTC is newer than the driver.

use crate::error::{Context, CudaError};
use cudarc::nvrtc::{result, sys};
use std::ffi::{c_char, CString};

/// Error unless libnvrtc can be loaded (cudarc panics on the first call otherwise).
pub(crate) fn require_nvrtc() -> Result<(), CudaError> {
    if unsafe { sys::is_culib_present() } {
        return Ok(());
    }
    Err(CudaError::NoDevice(
        "libnvrtc.so not found (add the CUDA toolkit's lib64 or the nvidia-cuda-nvrtc wheel's lib to LD_LIBRARY_PATH)"
            .into(),
    ))
}

/// The NVRTC release, part of every cache key (a new compiler may emit different code).
pub(crate) fn nvrtc_version() -> Result<(i32, i32), CudaError> {
    let (mut major, mut minor) = (0, 0);
    unsafe { sys::nvrtcVersion(&mut major, &mut minor) }.result().context(|| "nvrtcVersion".into())?;
    Ok((major, minor))
}

/// The `sm_XY` numbers (e.g. 90) this NVRTC can emit machine code for.
pub(crate) fn supported_archs() -> Result<Vec<i32>, CudaError> {
    let mut count = 0;
    unsafe { sys::nvrtcGetNumSupportedArchs(&mut count) }.result().context(|| "nvrtcGetNumSupportedArchs".into())?;
    let mut archs = vec![0i32; count.max(0) as usize];
    unsafe { sys::nvrtcGetSupportedArchs(archs.as_mut_ptr()) }.result().context(|| "nvrtcGetSupportedArchs".into())?;
    Ok(archs)
}

/// Destroys the NVRTC program however compilation ends.
struct Program(sys::nvrtcProgram);

impl Drop for Program {
    fn drop(&mut self) {
        // Nothing useful can be done if destruction fails; the program is gone either way.
        let _ = unsafe { result::destroy_program(self.0) };
    }
}

/// Compile `source` to a CUBIN. `options` are complete NVRTC flags (arch, `-D` macros, ...).
/// A compile error returns [`CudaError::Compile`] carrying NVRTC's full log.
pub(crate) fn compile_cubin(family: &'static str, source: &str, options: &[String]) -> Result<Vec<u8>, CudaError> {
    let src = CString::new(source).map_err(|_| CudaError::Compile {
        family,
        macros: options.join(" "),
        log: "kernel source contains a NUL byte".into(),
    })?;
    let name = CString::new(format!("{family}.cu")).expect("family names have no NUL");
    let program =
        Program(result::create_program(&src, Some(&name)).context(|| format!("nvrtcCreateProgram for {family}"))?);
    if let Err(err) = unsafe { result::compile_program(program.0, options) } {
        let log = program_log(&program).unwrap_or_else(|e| format!("(no log: {e})"));
        return Err(CudaError::Compile { family, macros: options.join(" "), log: format!("{err}\n{log}") });
    }
    let mut size = 0usize;
    unsafe { sys::nvrtcGetCUBINSize(program.0, &mut size) }
        .result()
        .context(|| format!("nvrtcGetCUBINSize for {family}"))?;
    if size == 0 {
        return Err(CudaError::Compile {
            family,
            macros: options.join(" "),
            log: "NVRTC produced an empty CUBIN (was a virtual compute_XY arch requested?)".into(),
        });
    }
    let mut cubin = vec![0u8; size];
    unsafe { sys::nvrtcGetCUBIN(program.0, cubin.as_mut_ptr() as *mut c_char) }
        .result()
        .context(|| format!("nvrtcGetCUBIN for {family}"))?;
    if let Some(dir) = ferrite_core::env::KERNEL_DUMP.get() {
        dump_cubin(&dir, family, options, &cubin);
    }
    Ok(cubin)
}

/// `FERRITE_KERNEL_DUMP`: the module as `DIR/<family><-D macros>.cubin` (best effort: a
/// diagnostic must not fail a compile).
fn dump_cubin(dir: &str, family: &str, options: &[String], cubin: &[u8]) {
    let macros: String = options.iter().filter(|o| o.starts_with("-D")).map(String::as_str).collect();
    let path = std::path::Path::new(dir).join(format!("{family}{macros}.cubin"));
    if let Err(e) = std::fs::create_dir_all(dir).and_then(|()| std::fs::write(&path, cubin)) {
        eprintln!("warning: FERRITE_KERNEL_DUMP: writing {}: {e}", path.display());
    }
}

fn program_log(program: &Program) -> Result<String, CudaError> {
    let raw = unsafe { result::get_program_log(program.0) }.context(|| "nvrtcGetProgramLog".into())?;
    let bytes: Vec<u8> = raw.iter().map(|&c| c as u8).take_while(|&b| b != 0).collect();
    Ok(String::from_utf8_lossy(&bytes).into_owned())
}
