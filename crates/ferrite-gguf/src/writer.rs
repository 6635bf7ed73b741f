//! GGUF writer (version 3, little-endian).
//!
//! Tensor data can be given up front ([`GgufWriter::add_tensor`]) or produced one tensor at a
//! time while writing ([`GgufWriter::add_tensor_info`] + [`GgufWriter::write_file_with`]), so
//! multi-GB files never need all their data in memory.

use crate::dtype::GgmlType;
use crate::error::GgufError;
use crate::metadata::{Metadata, Value};
use crate::reader::{
    align_up, checked_alignment, tensor_n_bytes, value_type, TensorInfo, ALIGNMENT_KEY,
    DEFAULT_ALIGNMENT, MAGIC,
};
use std::io::Write;
use std::path::Path;

const VERSION: u32 = 3;

struct PendingTensor {
    name: String,
    shape: Vec<u64>,
    dtype: GgmlType,
    n_bytes: usize,
    /// `None` for tensors whose data the caller produces at write time.
    data: Option<Vec<u8>>,
}

/// Builds a GGUF file: metadata in insertion order, tensors in insertion order, each tensor's
/// data aligned to `general.alignment` (32 unless that key is set).
#[derive(Default)]
pub struct GgufWriter {
    metadata: Metadata,
    tensors: Vec<PendingTensor>,
}

impl GgufWriter {
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds (or replaces) a metadata entry. Arrays must be homogeneous (checked when writing);
    /// empty arrays are written with element type u8, since [`Value`] carries no element type.
    pub fn add_metadata(&mut self, key: impl Into<String>, v: Value) {
        self.metadata.insert(key, v);
    }

    /// Adds a tensor with its data (`data.len()` must match the shape and dtype).
    pub fn add_tensor(
        &mut self,
        name: impl Into<String>,
        shape: &[u64],
        dtype: GgmlType,
        data: Vec<u8>,
    ) -> Result<(), GgufError> {
        let name = name.into();
        let n_bytes = self.check_new_tensor(&name, shape, dtype)?;
        if data.len() != n_bytes {
            let n_elements = shape.iter().product::<u64>() as usize;
            return Err(GgufError::DataSize {
                dtype,
                n_elements,
                expected: n_bytes,
                actual: data.len(),
            });
        }
        self.tensors.push(PendingTensor {
            name,
            shape: shape.to_vec(),
            dtype,
            n_bytes,
            data: Some(data),
        });
        Ok(())
    }

    /// Declares a tensor whose data will be produced while writing, by the callback of
    /// [`GgufWriter::write_to_with`] / [`GgufWriter::write_file_with`].
    pub fn add_tensor_info(
        &mut self,
        name: impl Into<String>,
        shape: &[u64],
        dtype: GgmlType,
    ) -> Result<(), GgufError> {
        let name = name.into();
        let n_bytes = self.check_new_tensor(&name, shape, dtype)?;
        self.tensors.push(PendingTensor {
            name,
            shape: shape.to_vec(),
            dtype,
            n_bytes,
            data: None,
        });
        Ok(())
    }

    fn check_new_tensor(
        &self,
        name: &str,
        shape: &[u64],
        dtype: GgmlType,
    ) -> Result<usize, GgufError> {
        if self.tensors.iter().any(|t| t.name == name) {
            return Err(GgufError::DuplicateTensor(name.to_string()));
        }
        tensor_n_bytes(name, shape, dtype)
    }

    /// Writes the file; every tensor must have been added with its data.
    pub fn write_to(&self, w: &mut impl Write) -> Result<(), GgufError> {
        self.write_to_with(w, |t| {
            Err(GgufError::InvalidWrite(format!(
                "tensor `{}` was declared without data; write it with write_to_with / write_file_with",
                t.name
            )))
        })
    }

    /// Writes the file, calling `data_for` in tensor order for each tensor declared with
    /// [`GgufWriter::add_tensor_info`]; it must return exactly `info.n_bytes` bytes.
    pub fn write_to_with(
        &self,
        w: &mut impl Write,
        mut data_for: impl FnMut(&TensorInfo) -> Result<Vec<u8>, GgufError>,
    ) -> Result<(), GgufError> {
        let alignment = match self.metadata.get(ALIGNMENT_KEY) {
            Some(v) => checked_alignment(v)?,
            None => DEFAULT_ALIGNMENT,
        };
        let infos = self.tensor_infos(alignment)?;
        for (key, value) in self.metadata.iter() {
            check_homogeneous(key, value)?;
        }
        let mut out = CountingWriter { inner: w, written: 0 };

        out.put(&MAGIC)?;
        out.put(&VERSION.to_le_bytes())?;
        out.put(&(infos.len() as u64).to_le_bytes())?;
        out.put(&(self.metadata.len() as u64).to_le_bytes())?;
        for (key, value) in self.metadata.iter() {
            out.string(key)?;
            out.put(&type_id(value).to_le_bytes())?;
            out.value(value)?;
        }
        for t in &infos {
            out.string(&t.name)?;
            out.put(&(t.shape.len() as u32).to_le_bytes())?;
            for d in &t.shape {
                out.put(&d.to_le_bytes())?;
            }
            out.put(&(t.dtype as u32).to_le_bytes())?;
            out.put(&t.offset.to_le_bytes())?;
        }
        out.pad_to(alignment)?;

        for (pending, info) in self.tensors.iter().zip(&infos) {
            match &pending.data {
                Some(data) => out.put(data)?,
                None => {
                    let data = data_for(info)?;
                    if data.len() != info.n_bytes {
                        return Err(GgufError::InvalidWrite(format!(
                            "tensor `{}`: data callback returned {} bytes, expected {}",
                            info.name,
                            data.len(),
                            info.n_bytes
                        )));
                    }
                    out.put(&data)?;
                }
            }
            out.pad_to(alignment)?;
        }
        Ok(())
    }

    /// Writes the file to `path` (through `path.partial`, renamed when complete).
    pub fn write_file(&self, path: impl AsRef<Path>) -> Result<(), GgufError> {
        self.write_file_with(path, |t| {
            Err(GgufError::InvalidWrite(format!(
                "tensor `{}` was declared without data; use write_file_with",
                t.name
            )))
        })
    }

    /// [`GgufWriter::write_to_with`] to a file at `path` (through `path.partial`).
    pub fn write_file_with(
        &self,
        path: impl AsRef<Path>,
        data_for: impl FnMut(&TensorInfo) -> Result<Vec<u8>, GgufError>,
    ) -> Result<(), GgufError> {
        let path = path.as_ref();
        let mut partial = path.as_os_str().to_owned();
        partial.push(".partial");
        let partial = std::path::PathBuf::from(partial);
        let result = (|| {
            let mut w = std::io::BufWriter::new(std::fs::File::create(&partial)?);
            self.write_to_with(&mut w, data_for)?;
            w.into_inner().map_err(|e| e.into_error())?.sync_all()?;
            std::fs::rename(&partial, path)?;
            Ok(())
        })();
        if result.is_err() {
            let _ = std::fs::remove_file(&partial);
        }
        result.map_err(|e: GgufError| e.in_file(path))
    }

    /// Tensor infos with data offsets laid out back to back, each aligned.
    fn tensor_infos(&self, alignment: u64) -> Result<Vec<TensorInfo>, GgufError> {
        let mut offset = 0u64;
        self.tensors
            .iter()
            .map(|t| {
                let info = TensorInfo {
                    name: t.name.clone(),
                    shape: t.shape.clone(),
                    dtype: t.dtype,
                    offset,
                    n_bytes: t.n_bytes,
                };
                offset = offset
                    .checked_add(t.n_bytes as u64)
                    .and_then(|end| align_up(end, alignment))
                    .ok_or_else(|| {
                        GgufError::InvalidWrite("total tensor data size overflows".into())
                    })?;
                Ok(info)
            })
            .collect()
    }
}

fn type_id(v: &Value) -> u32 {
    use value_type as t;
    match v {
        Value::U8(_) => t::U8,
        Value::I8(_) => t::I8,
        Value::U16(_) => t::U16,
        Value::I16(_) => t::I16,
        Value::U32(_) => t::U32,
        Value::I32(_) => t::I32,
        Value::U64(_) => t::U64,
        Value::I64(_) => t::I64,
        Value::F32(_) => t::F32,
        Value::F64(_) => t::F64,
        Value::Bool(_) => t::BOOL,
        Value::String(_) => t::STRING,
        Value::Array(_) => t::ARRAY,
    }
}

/// GGUF arrays have one element type (nested arrays may differ from each other).
fn check_homogeneous(key: &str, v: &Value) -> Result<(), GgufError> {
    let Value::Array(items) = v else {
        return Ok(());
    };
    if let Some(first) = items.first() {
        if let Some(odd) = items.iter().find(|i| type_id(i) != type_id(first)) {
            return Err(GgufError::InvalidWrite(format!(
                "metadata key `{key}`: array mixes {} and {} elements",
                first.type_name(),
                odd.type_name()
            )));
        }
    }
    items.iter().try_for_each(|item| check_homogeneous(key, item))
}

struct CountingWriter<'a, W: Write> {
    inner: &'a mut W,
    written: u64,
}

impl<W: Write> CountingWriter<'_, W> {
    fn put(&mut self, bytes: &[u8]) -> Result<(), GgufError> {
        self.inner.write_all(bytes)?;
        self.written += bytes.len() as u64;
        Ok(())
    }

    fn pad_to(&mut self, alignment: u64) -> Result<(), GgufError> {
        let target =
            align_up(self.written, alignment).expect("file offsets stay far below u64::MAX");
        self.put(&vec![0; (target - self.written) as usize])
    }

    fn string(&mut self, s: &str) -> Result<(), GgufError> {
        self.put(&(s.len() as u64).to_le_bytes())?;
        self.put(s.as_bytes())
    }

    fn value(&mut self, v: &Value) -> Result<(), GgufError> {
        match v {
            Value::U8(x) => self.put(&x.to_le_bytes()),
            Value::I8(x) => self.put(&x.to_le_bytes()),
            Value::U16(x) => self.put(&x.to_le_bytes()),
            Value::I16(x) => self.put(&x.to_le_bytes()),
            Value::U32(x) => self.put(&x.to_le_bytes()),
            Value::I32(x) => self.put(&x.to_le_bytes()),
            Value::U64(x) => self.put(&x.to_le_bytes()),
            Value::I64(x) => self.put(&x.to_le_bytes()),
            Value::F32(x) => self.put(&x.to_le_bytes()),
            Value::F64(x) => self.put(&x.to_le_bytes()),
            Value::Bool(x) => self.put(&[u8::from(*x)]),
            Value::String(s) => self.string(s),
            Value::Array(items) => {
                let element_type = items.first().map_or(value_type::U8, type_id);
                self.put(&element_type.to_le_bytes())?;
                self.put(&(items.len() as u64).to_le_bytes())?;
                items.iter().try_for_each(|item| self.value(item))
            }
        }
    }
}
