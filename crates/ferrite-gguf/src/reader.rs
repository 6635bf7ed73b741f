//! GGUF reader: parses and validates the header of a memory-mapped (or owned) file.
//!
//! Everything a hostile file could use to make us misbehave is checked while parsing: lengths
//! and counts against the bytes that remain (before allocating), nesting depth, tensor shapes,
//! dtypes, alignment, byte ranges (checked arithmetic, inside the file, no overlaps). After
//! [`GgufFile::from_bytes`] / [`GgufFile::open`] succeed, tensor data access cannot fail.

use crate::dtype::GgmlType;
use crate::error::GgufError;
use crate::metadata::{Metadata, Value};
use memmap2::Mmap;
use std::collections::HashMap;
use std::path::Path;

pub(crate) const MAGIC: [u8; 4] = *b"GGUF";
/// Alignment of tensor data when `general.alignment` is absent.
pub const DEFAULT_ALIGNMENT: u64 = 32;
pub(crate) const ALIGNMENT_KEY: &str = "general.alignment";
/// GGML tensors have at most 4 dimensions.
pub const MAX_DIMS: usize = 4;
/// Deepest nesting of metadata arrays (real files use 1; bounds recursion on hostile input).
const MAX_ARRAY_DEPTH: usize = 8;
/// Total metadata array elements per file. Real vocabularies have well under a million tokens
/// (tokens + scores + types + merges); a decoded [`Value`] is 32 bytes, so this caps the
/// metadata at about 512 MiB whatever the header claims.
const MAX_METADATA_ELEMENTS: u64 = 1 << 24;

/// Value type ids of the GGUF metadata encoding.
pub(crate) mod value_type {
    pub const U8: u32 = 0;
    pub const I8: u32 = 1;
    pub const U16: u32 = 2;
    pub const I16: u32 = 3;
    pub const U32: u32 = 4;
    pub const I32: u32 = 5;
    pub const F32: u32 = 6;
    pub const BOOL: u32 = 7;
    pub const STRING: u32 = 8;
    pub const ARRAY: u32 = 9;
    pub const U64: u32 = 10;
    pub const I64: u32 = 11;
    pub const F64: u32 = 12;
}

/// Where one tensor's data lies and how to read it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TensorInfo {
    pub name: String,
    /// GGML order: `shape[0]` is the contiguous row length.
    pub shape: Vec<u64>,
    pub dtype: GgmlType,
    /// Byte offset from the start of the data section.
    pub offset: u64,
    pub n_bytes: usize,
}

impl TensorInfo {
    pub fn n_elements(&self) -> u64 {
        self.shape.iter().product()
    }

    /// Elements per row (`shape[0]`).
    pub fn row_len(&self) -> usize {
        self.shape[0] as usize
    }

    /// Number of rows (product of all dimensions but the first).
    pub fn n_rows(&self) -> usize {
        self.shape[1..].iter().product::<u64>() as usize
    }
}

/// The bytes of an opened file.
enum FileBytes {
    Mapped(Mmap),
    Owned(Vec<u8>),
}

impl std::ops::Deref for FileBytes {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        match self {
            FileBytes::Mapped(m) => m,
            FileBytes::Owned(v) => v,
        }
    }
}

/// A parsed and validated GGUF file.
pub struct GgufFile {
    pub version: u32,
    pub metadata: Metadata,
    pub tensors: Vec<TensorInfo>,
    pub alignment: u64,
    bytes: FileBytes,
    data_offset: u64,
    tensor_index: HashMap<String, usize>,
}

impl std::fmt::Debug for GgufFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GgufFile")
            .field("version", &self.version)
            .field("metadata_entries", &self.metadata.len())
            .field("tensors", &self.tensors.len())
            .field("alignment", &self.alignment)
            .field("data_offset", &self.data_offset)
            .field("file_size", &self.file_size())
            .finish()
    }
}

impl GgufFile {
    /// Memory-maps and parses a file. Errors name the file.
    pub fn open(path: impl AsRef<Path>) -> Result<Self, GgufError> {
        let path = path.as_ref();
        let file = std::fs::File::open(path).map_err(|e| GgufError::from(e).in_file(path))?;
        // SAFETY: the mapping is read-only; like every mmap reader we rely on the file not being
        // truncated or rewritten by another process while it is open.
        let map = unsafe { Mmap::map(&file) }.map_err(|e| GgufError::from(e).in_file(path))?;
        Self::parse(FileBytes::Mapped(map)).map_err(|e| e.in_file(path))
    }

    /// Parses a file held in memory.
    pub fn from_bytes(bytes: Vec<u8>) -> Result<Self, GgufError> {
        Self::parse(FileBytes::Owned(bytes))
    }

    fn parse(bytes: FileBytes) -> Result<Self, GgufError> {
        let header = parse_header(&bytes)?;
        Ok(GgufFile {
            version: header.version,
            metadata: header.metadata,
            tensors: header.tensors,
            alignment: header.alignment,
            bytes,
            data_offset: header.data_offset,
            tensor_index: header.tensor_index,
        })
    }

    pub fn tensor(&self, name: &str) -> Option<&TensorInfo> {
        // `tensors` is public and may have been edited since opening; fall back to a scan then.
        match self.tensor_index.get(name).and_then(|&i| self.tensors.get(i)) {
            Some(t) if t.name == name => Some(t),
            _ => self.tensors.iter().find(|t| t.name == name),
        }
    }

    /// The bytes of a tensor of this file (validated when the file was opened).
    ///
    /// # Panics
    /// If `t` describes a range outside this file, i.e. it does not come from this file.
    pub fn tensor_data(&self, t: &TensorInfo) -> &[u8] {
        let range = || {
            let start = usize::try_from(self.data_offset.checked_add(t.offset)?).ok()?;
            Some(start..start.checked_add(t.n_bytes)?)
        };
        match range().and_then(|r| self.bytes.get(r)) {
            Some(data) => data,
            None => panic!(
                "tensor `{}` does not lie inside this GGUF file; it is not one of its tensors",
                t.name
            ),
        }
    }

    /// `general.architecture`, e.g. "llama".
    pub fn architecture(&self) -> Result<&str, GgufError> {
        self.metadata.str("general.architecture")
    }

    pub fn file_size(&self) -> usize {
        self.bytes.len()
    }

    /// Byte offset of the data section (tensor offsets are relative to it).
    pub fn data_offset(&self) -> u64 {
        self.data_offset
    }
}

struct Header {
    version: u32,
    metadata: Metadata,
    tensors: Vec<TensorInfo>,
    tensor_index: HashMap<String, usize>,
    alignment: u64,
    data_offset: u64,
}

fn parse_header(bytes: &[u8]) -> Result<Header, GgufError> {
    let mut p = Parser {
        bytes,
        pos: 0,
        context: "header".to_string(),
        array_elements_left: MAX_METADATA_ELEMENTS,
    };
    let magic: [u8; 4] = p.fixed("magic")?;
    if magic != MAGIC {
        return Err(GgufError::BadMagic { found: magic });
    }
    let version = u32::from_le_bytes(p.fixed("version")?);
    match version {
        2 | 3 => {}
        v if matches!(v.swap_bytes(), 1..=3) => return Err(GgufError::BigEndian { version: v }),
        v => return Err(GgufError::UnsupportedVersion(v)),
    }
    let tensor_count = p.u64("tensor count")?;
    let kv_count = p.u64("metadata entry count")?;

    // Smallest entry: key length (8) + value type (4) + a 1-byte value.
    p.check_room(kv_count, 8 + 4 + 1, "metadata entries")?;
    let mut metadata = Metadata::new();
    for i in 0..kv_count {
        p.context = format!("metadata entry #{i}");
        let key = p.string("key")?;
        p.context = format!("metadata key `{key}`");
        let type_id = p.u32("value type")?;
        let value = p.value(type_id, 0)?;
        if metadata.contains_key(&key) {
            return Err(GgufError::DuplicateKey(key));
        }
        metadata.insert(key, value);
    }

    let alignment = match metadata.get(ALIGNMENT_KEY) {
        None => DEFAULT_ALIGNMENT,
        Some(v) => checked_alignment(v)?,
    };

    // Smallest tensor info: name length (8) + n_dims (4) + one dim (8) + type (4) + offset (8).
    p.check_room(tensor_count, 8 + 4 + 8 + 4 + 8, "tensor infos")?;
    let mut tensors: Vec<TensorInfo> = Vec::with_capacity(tensor_count as usize);
    let mut tensor_index = HashMap::with_capacity(tensors.capacity());
    for i in 0..tensor_count {
        p.context = format!("tensor info #{i}");
        let name = p.string("name")?;
        p.context = format!("tensor `{name}`");
        let tensor = p.tensor_info(name, alignment)?;
        if tensor_index.insert(tensor.name.clone(), tensors.len()).is_some() {
            return Err(GgufError::DuplicateTensor(tensor.name));
        }
        tensors.push(tensor);
    }

    let data_offset = align_up(p.pos as u64, alignment).ok_or_else(|| GgufError::Malformed {
        what: "data section".into(),
        reason: "start offset overflows".into(),
    })?;
    check_tensor_ranges(&tensors, data_offset, alignment, bytes.len() as u64)?;
    Ok(Header { version, metadata, tensors, tensor_index, alignment, data_offset })
}

pub(crate) fn checked_alignment(v: &Value) -> Result<u64, GgufError> {
    let malformed = |reason: String| GgufError::Malformed {
        what: format!("metadata key `{ALIGNMENT_KEY}`"),
        reason,
    };
    match v.as_u64() {
        Some(a) if a.is_power_of_two() => Ok(a),
        Some(a) => Err(malformed(format!("alignment {a} is not a non-zero power of two"))),
        None => Err(malformed(format!("has type {}, expected an unsigned integer", v.type_name()))),
    }
}

pub(crate) fn align_up(x: u64, alignment: u64) -> Option<u64> {
    Some(x.checked_add(alignment - 1)? & !(alignment - 1))
}

/// Every tensor's bytes must lie inside the file, and no two tensors may share bytes.
///
/// A tensor running past the end of the file is reported as truncation when it starts no
/// further than the (aligned) end of the file, so that a file cut at any byte gives
/// [`GgufError::Truncated`]; offsets further out are [`GgufError::TensorOutOfBounds`].
fn check_tensor_ranges(
    tensors: &[TensorInfo],
    data_offset: u64,
    alignment: u64,
    file_size: u64,
) -> Result<(), GgufError> {
    let out_of_bounds =
        |t: &TensorInfo, start: Option<u64>, end: Option<u64>| GgufError::TensorOutOfBounds {
            tensor: t.name.clone(),
            start: start.unwrap_or(u64::MAX),
            end: end.unwrap_or(u64::MAX),
            file_size,
        };
    let mut ranges = Vec::with_capacity(tensors.len());
    for t in tensors {
        let start = data_offset.checked_add(t.offset);
        let end = start.and_then(|s| s.checked_add(t.n_bytes as u64));
        match (start, end) {
            (Some(start), Some(end)) => ranges.push((start, end, t)),
            _ => return Err(out_of_bounds(t, start, end)),
        }
    }
    ranges.sort_unstable_by_key(|(start, end, _)| (*start, *end));
    if let Some(&(start, end, t)) = ranges.iter().find(|(_, end, _)| *end > file_size) {
        if align_up(file_size, alignment).is_some_and(|aligned_end| start <= aligned_end) {
            return Err(GgufError::Truncated {
                what: format!(
                    "tensor `{}` data ({} bytes, ending at byte {end})",
                    t.name, t.n_bytes
                ),
                offset: start,
            });
        }
        return Err(out_of_bounds(t, Some(start), Some(end)));
    }
    let mut furthest: Option<(u64, &TensorInfo)> = None;
    for &(start, end, t) in ranges.iter().filter(|(start, end, _)| start < end) {
        if let Some((prev_end, prev)) = furthest {
            if start < prev_end {
                return Err(GgufError::OverlappingTensors {
                    first: prev.name.clone(),
                    second: t.name.clone(),
                });
            }
        }
        if furthest.is_none_or(|(prev_end, _)| end > prev_end) {
            furthest = Some((end, t));
        }
    }
    Ok(())
}

/// A bounds-checked little-endian cursor. `context` names the item being parsed for errors.
struct Parser<'a> {
    bytes: &'a [u8],
    pos: usize,
    context: String,
    array_elements_left: u64,
}

impl<'a> Parser<'a> {
    fn remaining(&self) -> u64 {
        (self.bytes.len() - self.pos) as u64
    }

    fn what(&self, field: &str) -> String {
        format!("{}: {field}", self.context)
    }

    fn take(&mut self, n: u64, field: &str) -> Result<&'a [u8], GgufError> {
        if n > self.remaining() {
            return Err(GgufError::Truncated { what: self.what(field), offset: self.pos as u64 });
        }
        let slice = &self.bytes[self.pos..self.pos + n as usize];
        self.pos += n as usize;
        Ok(slice)
    }

    fn fixed<const N: usize>(&mut self, field: &str) -> Result<[u8; N], GgufError> {
        Ok(self.take(N as u64, field)?.try_into().expect("take returns exactly N bytes"))
    }

    fn u32(&mut self, field: &str) -> Result<u32, GgufError> {
        Ok(u32::from_le_bytes(self.fixed(field)?))
    }

    fn u64(&mut self, field: &str) -> Result<u64, GgufError> {
        Ok(u64::from_le_bytes(self.fixed(field)?))
    }

    /// Fails early if `count` items of at least `min_size` bytes each cannot fit in the rest of
    /// the file, so that a hostile count never drives an allocation.
    fn check_room(&self, count: u64, min_size: u64, items: &str) -> Result<(), GgufError> {
        if count.saturating_mul(min_size) > self.remaining() {
            return Err(GgufError::Truncated {
                what: self.what(&format!("{count} {items} (at least {min_size} bytes each)")),
                offset: self.pos as u64,
            });
        }
        Ok(())
    }

    fn string(&mut self, field: &str) -> Result<String, GgufError> {
        let len = self.u64(field)?;
        let offset = self.pos as u64;
        let raw = self.take(len, field)?;
        std::str::from_utf8(raw)
            .map(str::to_owned)
            .map_err(|_| GgufError::InvalidUtf8 { what: self.what(field), offset })
    }

    fn value(&mut self, type_id: u32, depth: usize) -> Result<Value, GgufError> {
        use value_type as t;
        macro_rules! number {
            ($variant:ident, $ty:ty) => {
                Value::$variant(<$ty>::from_le_bytes(
                    self.fixed(concat!(stringify!($ty), " value"))?,
                ))
            };
        }
        Ok(match type_id {
            t::U8 => number!(U8, u8),
            t::I8 => number!(I8, i8),
            t::U16 => number!(U16, u16),
            t::I16 => number!(I16, i16),
            t::U32 => number!(U32, u32),
            t::I32 => number!(I32, i32),
            t::U64 => number!(U64, u64),
            t::I64 => number!(I64, i64),
            t::F32 => number!(F32, f32),
            t::F64 => number!(F64, f64),
            t::BOOL => {
                let offset = self.pos;
                match self.fixed::<1>("bool value")?[0] {
                    0 => Value::Bool(false),
                    1 => Value::Bool(true),
                    other => {
                        return Err(GgufError::Malformed {
                            what: self.what(&format!("bool value at byte offset {offset}")),
                            reason: format!("byte {other:#04x} is neither 0 nor 1"),
                        })
                    }
                }
            }
            t::STRING => Value::String(self.string("string value")?),
            t::ARRAY => self.array(depth)?,
            id => return Err(GgufError::UnknownValueType { what: self.what("value"), id }),
        })
    }

    fn array(&mut self, depth: usize) -> Result<Value, GgufError> {
        if depth >= MAX_ARRAY_DEPTH {
            return Err(GgufError::Malformed {
                what: self.what("array"),
                reason: format!("arrays nested more than {MAX_ARRAY_DEPTH} deep"),
            });
        }
        let element_type = self.u32("array element type")?;
        let count = self.u64("array length")?;
        let min_size = encoded_size_at_least(element_type).ok_or_else(|| {
            GgufError::UnknownValueType { what: self.what("array element"), id: element_type }
        })?;
        self.check_room(count, min_size, "array elements")?;
        if count > self.array_elements_left {
            return Err(GgufError::TooLarge {
                what: self.what("total number of metadata array elements"),
                count: MAX_METADATA_ELEMENTS - self.array_elements_left + count,
                limit: MAX_METADATA_ELEMENTS,
            });
        }
        self.array_elements_left -= count;
        let mut items = Vec::with_capacity(count as usize);
        for _ in 0..count {
            items.push(self.value(element_type, depth + 1)?);
        }
        Ok(Value::Array(items))
    }

    fn tensor_info(&mut self, name: String, alignment: u64) -> Result<TensorInfo, GgufError> {
        let n_dims = self.u32("dimension count")?;
        if n_dims == 0 || n_dims as usize > MAX_DIMS {
            return Err(bad_dimension_count(name, n_dims as usize));
        }
        let shape = (0..n_dims).map(|_| self.u64("dimension")).collect::<Result<Vec<u64>, _>>()?;
        let type_id = self.u32("type")?;
        let offset = self.u64("data offset")?;
        let dtype = GgmlType::from_u32(type_id)
            .ok_or(GgufError::UnknownDtype { tensor: name.clone(), id: type_id })?;
        let n_bytes = tensor_n_bytes(&name, &shape, dtype)?;
        if offset % alignment != 0 {
            return Err(GgufError::MisalignedTensor { tensor: name, offset, alignment });
        }
        Ok(TensorInfo { name, shape, dtype, offset, n_bytes })
    }
}

fn bad_dimension_count(tensor: String, n_dims: usize) -> GgufError {
    GgufError::BadShape {
        tensor,
        shape: vec![],
        reason: format!("{n_dims} dimensions, expected 1 to {MAX_DIMS}"),
    }
}

/// Validates a tensor shape for `dtype` and returns its data size in bytes.
pub(crate) fn tensor_n_bytes(
    name: &str,
    shape: &[u64],
    dtype: GgmlType,
) -> Result<usize, GgufError> {
    if shape.is_empty() || shape.len() > MAX_DIMS {
        return Err(bad_dimension_count(name.to_string(), shape.len()));
    }
    let bad_shape = |reason: String| GgufError::BadShape {
        tensor: name.to_string(),
        shape: shape.to_vec(),
        reason,
    };
    let block_size = dtype.block_size() as u64;
    if !shape[0].is_multiple_of(block_size) {
        return Err(bad_shape(format!(
            "row length {} is not a multiple of the {dtype} block size {block_size}",
            shape[0]
        )));
    }
    let n_elements = shape
        .iter()
        .try_fold(1u64, |acc, &d| acc.checked_mul(d))
        .filter(|&n| n <= i64::MAX as u64)
        .ok_or_else(|| bad_shape("element count overflows".into()))?;
    (n_elements / block_size)
        .checked_mul(dtype.type_size() as u64)
        .and_then(|n| usize::try_from(n).ok())
        .ok_or_else(|| bad_shape(format!("{dtype} data size overflows")))
}

/// Fewest bytes one value of a type takes, or `None` for an unknown type id.
fn encoded_size_at_least(type_id: u32) -> Option<u64> {
    use value_type as t;
    Some(match type_id {
        t::U8 | t::I8 | t::BOOL => 1,
        t::U16 | t::I16 => 2,
        t::U32 | t::I32 | t::F32 => 4,
        t::U64 | t::I64 | t::F64 | t::STRING => 8,
        t::ARRAY => 12,
        _ => return None,
    })
}
