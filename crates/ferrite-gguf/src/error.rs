//! Errors of reading, writing, (de)quantizing GGUF data.

use crate::dtype::GgmlType;
use std::path::PathBuf;

/// Everything that can go wrong with a GGUF file or its tensor data. Messages say what is wrong
/// and where (byte offset, metadata key or tensor name).
#[derive(thiserror::Error, Debug)]
pub enum GgufError {
    /// An error while handling a named file (wraps the actual error). The message carries the
    /// wrapped one, which is therefore not also its `source` (a chain would print it twice).
    #[error("{}: {error}", path.display())]
    InFile { path: PathBuf, error: Box<GgufError> },

    #[error("I/O error: {0}")]
    Io(#[from] std::io::Error),

    #[error("file is truncated: {what} at byte offset {offset} runs past the end of the file")]
    Truncated { what: String, offset: u64 },

    #[error("not a GGUF file: magic is {found:02x?}, expected \"GGUF\"")]
    BadMagic { found: [u8; 4] },

    #[error("GGUF version {0} is not supported (only versions 2 and 3 are)")]
    UnsupportedVersion(u32),

    #[error("big-endian GGUF files are not supported (version field reads {version:#010x})")]
    BigEndian { version: u32 },

    #[error("{what}: unknown metadata value type id {id}")]
    UnknownValueType { what: String, id: u32 },

    #[error("tensor `{tensor}`: unknown or unsupported GGML type id {id}")]
    UnknownDtype { tensor: String, id: u32 },

    #[error("tensor `{tensor}`: bad shape {shape:?}: {reason}")]
    BadShape { tensor: String, shape: Vec<u64>, reason: String },

    #[error(
        "tensor `{tensor}`: data offset {offset} is not a multiple of the alignment {alignment}"
    )]
    MisalignedTensor { tensor: String, offset: u64, alignment: u64 },

    #[error(
        "tensor `{tensor}`: data bytes {start}..{end} lie outside the file ({file_size} bytes)"
    )]
    TensorOutOfBounds { tensor: String, start: u64, end: u64, file_size: u64 },

    #[error("tensors `{first}` and `{second}` have overlapping data")]
    OverlappingTensors { first: String, second: String },

    #[error("{what}: {count} exceeds the limit of {limit}")]
    TooLarge { what: String, count: u64, limit: u64 },

    #[error("metadata key `{0}` appears twice")]
    DuplicateKey(String),

    #[error("tensor `{0}` appears twice")]
    DuplicateTensor(String),

    #[error("metadata key `{0}` is missing")]
    MissingKey(String),

    #[error("metadata key `{key}` has type {found}, expected {expected}")]
    WrongType { key: String, found: String, expected: &'static str },

    #[error("metadata key `{key}`: value {value} does not fit in {target}")]
    OutOfRange { key: String, value: String, target: &'static str },

    #[error("{what} at byte offset {offset} is not valid UTF-8")]
    InvalidUtf8 { what: String, offset: u64 },

    /// A structurally invalid header field (bad bool byte, bad alignment, too-deep nesting...).
    #[error("{what}: {reason}")]
    Malformed { what: String, reason: String },

    #[error("{dtype} data for {n_elements} elements must be {expected} bytes, got {actual}")]
    DataSize { dtype: GgmlType, n_elements: usize, expected: usize, actual: usize },

    #[error("{n_elements} elements is not a whole number of {dtype} blocks of {block_size}")]
    NotBlockMultiple { dtype: GgmlType, n_elements: usize, block_size: usize },

    #[error("cannot write GGUF: {0}")]
    InvalidWrite(String),
}

impl GgufError {
    /// The error without any [`GgufError::InFile`] wrapping, for matching on the kind.
    pub fn root(&self) -> &GgufError {
        match self {
            GgufError::InFile { error, .. } => error.root(),
            other => other,
        }
    }

    pub(crate) fn in_file(self, path: &std::path::Path) -> GgufError {
        GgufError::InFile { path: path.to_path_buf(), error: Box::new(self) }
    }
}
