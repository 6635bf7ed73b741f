//! The one error type of the CUDA backend.

use cudarc::cublas::result::CublasError;
use cudarc::driver::DriverError;
use cudarc::nvrtc::result::NvrtcError;

/// Everything that can go wrong in `ferrite-cuda`. Each variant's message says what failed and where.
#[derive(Debug, thiserror::Error)]
pub enum CudaError {
    /// No usable GPU: a missing library, no device, or a driver that refuses to start.
    #[error("no CUDA device: {0}")]
    NoDevice(String),
    /// A CUDA driver call failed.
    #[error("CUDA driver error in {context}: {source:?}")]
    Driver { context: String, source: DriverError },
    /// An NVRTC call other than the compilation itself failed.
    #[error("NVRTC error in {context}: {source}")]
    Nvrtc { context: String, source: NvrtcError },
    /// NVRTC rejected a kernel; `log` is the compiler's full output.
    #[error("NVRTC failed to compile kernel family `{family}` with {macros}:\n{log}")]
    Compile { family: &'static str, macros: String, log: String },
    /// A cuBLAS call failed.
    #[error("cuBLAS error in {context}: {source}")]
    Cublas { context: String, source: CublasError },
    /// An op was called with arguments that cannot work (sizes, shapes, dtypes).
    #[error("{op}: {message}")]
    InvalidArgument { op: &'static str, message: String },
    /// A kernel found bad data in device memory (a token id or position out of range).
    #[error("device-side check failed: {0}")]
    DeviceCheck(String),
    /// The on-disk kernel cache could not be read or written.
    #[error("kernel cache {path}: {message}")]
    Cache { path: String, message: String },
}

impl CudaError {
    pub(crate) fn invalid(op: &'static str, message: impl Into<String>) -> Self {
        CudaError::InvalidArgument { op, message: message.into() }
    }
}

/// For callers that use cudarc directly (copies on the GPU's stream) and have no better context.
impl From<DriverError> for CudaError {
    fn from(source: DriverError) -> Self {
        CudaError::Driver { context: "a CUDA driver call".into(), source }
    }
}

/// Attach a context string to the error types of cudarc.
pub(crate) trait Context<T> {
    fn context(self, context: impl FnOnce() -> String) -> Result<T, CudaError>;
}

impl<T> Context<T> for Result<T, DriverError> {
    fn context(self, context: impl FnOnce() -> String) -> Result<T, CudaError> {
        self.map_err(|source| CudaError::Driver { context: context(), source })
    }
}

impl<T> Context<T> for Result<T, NvrtcError> {
    fn context(self, context: impl FnOnce() -> String) -> Result<T, CudaError> {
        self.map_err(|source| CudaError::Nvrtc { context: context(), source })
    }
}

impl<T> Context<T> for Result<T, CublasError> {
    fn context(self, context: impl FnOnce() -> String) -> Result<T, CudaError> {
        self.map_err(|source| CudaError::Cublas { context: context(), source })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn messages_say_what_and_where() {
        let e = CudaError::NoDevice("libcuda.so not found".into());
        assert_eq!(e.to_string(), "no CUDA device: libcuda.so not found");
        let e = CudaError::invalid("rms_norm", "x holds 3 elements, needs 4");
        assert_eq!(e.to_string(), "rms_norm: x holds 3 elements, needs 4");
    }
}
