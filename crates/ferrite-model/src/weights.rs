//! Named weights, including fused weights declared at load time.
//!
//! A weight is one or more GGUF tensors of the same dtype and row length, concatenated along
//! rows (for matrices) or elements (for vectors). Concatenating the raw bytes does both, because
//! GGUF rows are contiguous and blocks never straddle rows. A part may also be a selection of a
//! matrix's rows in any order ([`WeightSet::add_rows`]): a layout change declared at load time
//! (Qwen3-Next's per-key-head interleaved projections are de-interleaved that way), which works
//! on quantized rows as well. Slices of a weight ([`WeightSet::select_rows`],
//! [`WeightSet::select_cols`]: a tensor-parallel rank's share) are declared the same way: whole
//! rows, or every row cut at quant-block boundaries, so packed weights stay packed.

use crate::graph::WeightId;
use crate::ModelError;
use ferrite_gguf::{GgmlType, GgufFile, TensorInfo};
use std::borrow::Cow;
use std::ops::Range;

/// A GGUF tensor, or a selection of its rows and columns, that a weight is made of.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct WeightPart {
    pub tensor: String,
    /// The tensor's rows taken, in this order; `None`: all of them.
    pub rows: Option<Vec<Range<usize>>>,
    /// The columns taken from each of those rows (a vector's elements), on block boundaries;
    /// `None`: all of them.
    pub cols: Option<Range<usize>>,
}

impl WeightPart {
    fn whole(tensor: &str) -> Self {
        Self { tensor: tensor.to_string(), rows: None, cols: None }
    }
}

#[derive(Clone, Debug, PartialEq)]
pub struct WeightSpec {
    /// Display name (the tensor name, or `a+b+c` for a fused weight).
    pub name: String,
    /// GGUF tensors (or row selections of them), in concatenation order.
    pub parts: Vec<WeightPart>,
    pub dtype: GgmlType,
    /// Output rows (1 for a vector). For a bank of experts: the rows of all experts, expert `e`
    /// owning rows `e * expert_rows() .. (e + 1) * expert_rows()`.
    pub rows: usize,
    /// Elements per row (the vector length for a vector).
    pub cols: usize,
    /// Matrices stacked along rows: the expert count of a 3-D expert tensor (llama.cpp's
    /// `ffn_*_exps`), 1 for everything else.
    pub experts: usize,
}

impl WeightSpec {
    pub fn is_vector(&self) -> bool {
        self.rows == 1 && self.experts == 1
    }

    /// Rows of one expert's matrix (all rows for an ordinary weight).
    pub fn expert_rows(&self) -> usize {
        self.rows / self.experts
    }

    /// The tensor name when the weight is exactly one whole GGUF tensor (its bytes can be used
    /// in place), `None` for a fused weight or a selection of rows or columns.
    pub fn whole_tensor(&self) -> Option<&str> {
        match self.parts.as_slice() {
            [WeightPart { tensor, rows: None, cols: None }] => Some(tensor),
            _ => None,
        }
    }
}

#[derive(Clone, Debug, Default)]
pub struct WeightSet {
    specs: Vec<WeightSpec>,
}

fn tensor<'a>(file: &'a GgufFile, name: &str) -> Result<&'a TensorInfo, ModelError> {
    file.tensor(name).ok_or_else(|| ModelError::MissingTensor(name.to_string()))
}

/// (rows, cols) of a 1-D or 2-D tensor.
fn matrix_shape(t: &TensorInfo) -> Result<(usize, usize), ModelError> {
    match t.shape.len() {
        1 => Ok((1, t.shape[0] as usize)),
        2 => Ok((t.shape[1] as usize, t.shape[0] as usize)),
        n => Err(ModelError::tensor(&t.name, format!("expected 1 or 2 dimensions, found {n}"))),
    }
}

impl WeightSet {
    pub fn spec(&self, id: WeightId) -> &WeightSpec {
        &self.specs[id.0 as usize]
    }

    pub fn iter(&self) -> impl Iterator<Item = (WeightId, &WeightSpec)> {
        self.specs.iter().enumerate().map(|(i, s)| (WeightId(i as u32), s))
    }

    pub fn len(&self) -> usize {
        self.specs.len()
    }

    pub fn is_empty(&self) -> bool {
        self.specs.is_empty()
    }

    /// Add one tensor, checking its shape is `rows x cols` (`rows == 1` for a vector).
    pub fn add(&mut self, file: &GgufFile, name: &str, rows: usize, cols: usize) -> Result<WeightId, ModelError> {
        let t = tensor(file, name)?;
        let shape = matrix_shape(t)?;
        if shape != (rows, cols) {
            return Err(ModelError::tensor(name, format!("shape {rows}x{cols} expected, found {}x{}", shape.0, shape.1)));
        }
        Ok(self.push(WeightSpec { name: name.to_string(), parts: vec![WeightPart::whole(name)], dtype: t.dtype, rows, cols, experts: 1 }))
    }

    /// Add the rows `ranges` (in that order) of the 2-D tensor `name`, which must be
    /// `tensor_rows x cols`, as one weight named `name[label]`: a row permutation or selection
    /// declared at load time. Row bytes are copied whole, so any dtype works.
    pub fn add_rows(
        &mut self,
        file: &GgufFile,
        name: &str,
        label: &str,
        ranges: Vec<Range<usize>>,
        tensor_rows: usize,
        cols: usize,
    ) -> Result<WeightId, ModelError> {
        let t = tensor(file, name)?;
        if t.shape.len() != 2 || matrix_shape(t)? != (tensor_rows, cols) {
            return Err(ModelError::tensor(name, format!("shape {tensor_rows}x{cols} expected, found {:?} (GGML order)", t.shape)));
        }
        if let Some(r) = ranges.iter().find(|r| r.start >= r.end || r.end > tensor_rows) {
            return Err(ModelError::tensor(name, format!("row range {r:?} is empty or outside its {tensor_rows} rows")));
        }
        let rows = ranges.iter().map(|r| r.len()).sum();
        let part = WeightPart { tensor: name.to_string(), rows: Some(ranges), cols: None };
        Ok(self.push(WeightSpec { name: format!("{name}[{label}]"), parts: vec![part], dtype: t.dtype, rows, cols, experts: 1 }))
    }

    /// Add a 3-D expert tensor: `experts` matrices of `rows x cols` (GGML shape
    /// `[cols, rows, experts]`), stored as one weight of `experts * rows` rows.
    pub fn add_experts(&mut self, file: &GgufFile, name: &str, experts: usize, rows: usize, cols: usize) -> Result<WeightId, ModelError> {
        let t = tensor(file, name)?;
        let want = [cols as u64, rows as u64, experts as u64];
        if t.shape != want {
            return Err(ModelError::tensor(name, format!("shape {want:?} (GGML order: cols, rows, experts) expected, found {:?}", t.shape)));
        }
        if experts == 0 || rows == 0 || cols == 0 {
            return Err(ModelError::tensor(name, "empty expert tensor"));
        }
        Ok(self.push(WeightSpec { name: name.to_string(), parts: vec![WeightPart::whole(name)], dtype: t.dtype, rows: experts * rows, cols, experts }))
    }

    /// Add the first of `names` that exists in the file.
    pub fn add_first_of(&mut self, file: &GgufFile, names: &[&str], rows: usize, cols: usize) -> Result<WeightId, ModelError> {
        let name = names
            .iter()
            .find(|n| file.tensor(n).is_some())
            .ok_or_else(|| ModelError::MissingTensor(names.join(" or ")))?;
        self.add(file, name, rows, cols)
    }

    /// Add `name` if the file has it.
    pub fn add_optional(&mut self, file: &GgufFile, name: &str, rows: usize, cols: usize) -> Result<Option<WeightId>, ModelError> {
        if file.tensor(name).is_none() {
            return Ok(None);
        }
        self.add(file, name, rows, cols).map(Some)
    }

    /// Declare a fused weight made of already-added weights, concatenated in order. Returns `None`
    /// (the caller then keeps the parts separate) when the parts cannot share one layout.
    pub fn fuse(&mut self, parts: &[WeightId]) -> Option<WeightId> {
        let specs: Vec<&WeightSpec> = parts.iter().map(|&p| self.spec(p)).collect();
        let first = specs.first()?;
        let vector = first.is_vector();
        let mismatch = |s: &&WeightSpec| s.dtype != first.dtype || s.is_vector() != vector || (!vector && s.cols != first.cols);
        // Expert banks are never fused: concatenation would not keep each expert's rows together.
        if specs.iter().any(|s| mismatch(s) || s.experts != 1) {
            return None;
        }
        let fused = WeightSpec {
            name: specs.iter().map(|s| s.name.as_str()).collect::<Vec<_>>().join("+"),
            parts: specs.iter().flat_map(|s| s.parts.iter().cloned()).collect(),
            dtype: first.dtype,
            rows: if vector { 1 } else { specs.iter().map(|s| s.rows).sum() },
            cols: if vector { specs.iter().map(|s| s.cols).sum() } else { first.cols },
            experts: 1,
        };
        Some(self.push(fused))
    }

    /// Declare the rows `rows` (in order) of weight `id` — a matrix's output rows, a vector's
    /// elements — as a new weight named `name[label]`: a column-parallel linear's share, or its
    /// bias's. Rows move whole, so any dtype works; a fused weight is cut across its parts.
    pub fn select_rows(&mut self, file: &GgufFile, id: WeightId, label: &str, rows: &[Range<usize>]) -> Result<WeightId, ModelError> {
        let spec = self.spec(id).clone();
        let vector = spec.is_vector();
        let len = if vector { spec.cols } else { spec.rows };
        if spec.experts != 1 {
            return Err(ModelError::tensor(&spec.name, "a bank of experts cannot be sliced"));
        }
        if let Some(r) = rows.iter().find(|r| r.start >= r.end || r.end > len) {
            return Err(ModelError::tensor(&spec.name, format!("row range {r:?} is empty or outside its {len} rows")));
        }
        // What each part contributes, as ranges of its tensor: rows of a matrix, elements of a vector.
        let mut units: Vec<(usize, Range<usize>)> = Vec::new();
        for (i, p) in spec.parts.iter().enumerate() {
            let (t_rows, t_cols) = matrix_shape(tensor(file, &p.tensor)?)?;
            match (vector, &p.rows) {
                (true, _) => units.push((i, p.cols.clone().unwrap_or(0..t_cols))),
                (false, Some(ranges)) => units.extend(ranges.iter().map(|r| (i, r.clone()))),
                (false, None) => units.push((i, 0..t_rows)),
            }
        }
        let mut parts = Vec::new();
        for r in rows {
            for (i, piece) in pick(&units, r.clone()) {
                let part = &spec.parts[i];
                parts.push(if vector {
                    check_block_cols(spec.dtype, &part.tensor, &piece)?;
                    WeightPart { tensor: part.tensor.clone(), rows: None, cols: Some(piece) }
                } else {
                    WeightPart { tensor: part.tensor.clone(), rows: Some(vec![piece]), cols: part.cols.clone() }
                });
            }
        }
        let n = rows.iter().map(|r| r.len()).sum();
        let (rows, cols) = if vector { (1, n) } else { (n, spec.cols) };
        Ok(self.push(WeightSpec { name: format!("{}[{label}]", spec.name), parts, dtype: spec.dtype, rows, cols, experts: 1 }))
    }

    /// Declare the columns `cols` of every row of the matrix `id` as a new weight named
    /// `name[label]`: a row-parallel linear's share. Quantized rows are cut between blocks, so
    /// `cols` must start and end on block boundaries.
    pub fn select_cols(&mut self, id: WeightId, label: &str, cols: Range<usize>) -> Result<WeightId, ModelError> {
        let spec = self.spec(id).clone();
        if spec.is_vector() || spec.experts != 1 {
            return Err(ModelError::tensor(&spec.name, "only the columns of a plain matrix can be selected"));
        }
        if cols.start >= cols.end || cols.end > spec.cols {
            return Err(ModelError::tensor(&spec.name, format!("column range {cols:?} is empty or outside its {} columns", spec.cols)));
        }
        check_block_cols(spec.dtype, &spec.name, &cols)?;
        let parts = spec
            .parts
            .iter()
            .map(|p| {
                let base = p.cols.as_ref().map_or(0, |c| c.start);
                WeightPart { cols: Some(base + cols.start..base + cols.end), ..p.clone() }
            })
            .collect();
        Ok(self.push(WeightSpec { name: format!("{}[{label}]", spec.name), parts, cols: cols.len(), ..spec }))
    }

    fn push(&mut self, spec: WeightSpec) -> WeightId {
        self.specs.push(spec);
        WeightId(self.specs.len() as u32 - 1)
    }

    /// The weight's bytes in its dtype: borrowed from the file for one whole tensor, gathered for
    /// a fused weight or a selection of rows or columns.
    pub fn bytes<'a>(&self, file: &'a GgufFile, id: WeightId) -> Result<Cow<'a, [u8]>, ModelError> {
        let spec = self.spec(id);
        if let Some(only) = spec.whole_tensor() {
            return Ok(Cow::Borrowed(file.tensor_data(tensor(file, only)?)));
        }
        let mut out = Vec::new();
        for p in &spec.parts {
            let t = tensor(file, &p.tensor)?;
            let data = file.tensor_data(t);
            if p.rows.is_none() && p.cols.is_none() {
                out.extend_from_slice(data);
                continue;
            }
            let n_rows = matrix_shape(t)?.0;
            let row = data.len() / n_rows;
            let all = 0..n_rows;
            let ranges = p.rows.as_deref().unwrap_or(std::slice::from_ref(&all));
            match &p.cols {
                None => ranges.iter().for_each(|r| out.extend_from_slice(&data[r.start * row..r.end * row])),
                Some(c) => {
                    let byte = |col: usize| {
                        let msg = || format!("column {col} is not on a block boundary of {}", spec.dtype.name());
                        spec.dtype.row_bytes(col).ok_or_else(|| ModelError::tensor(&p.tensor, msg()))
                    };
                    let (start, end) = (byte(c.start)?, byte(c.end)?);
                    for i in ranges.iter().flat_map(|r| r.clone()) {
                        out.extend_from_slice(&data[i * row + start..i * row + end]);
                    }
                }
            }
        }
        Ok(Cow::Owned(out))
    }

    /// The weight dequantized to f32 (the reference path).
    pub fn to_f32(&self, file: &GgufFile, id: WeightId) -> Result<Vec<f32>, ModelError> {
        let spec = self.spec(id);
        let bytes = self.bytes(file, id)?;
        let mut out = vec![0f32; spec.rows * spec.cols];
        ferrite_gguf::quant::dequantize(spec.dtype, &bytes, &mut out)?;
        Ok(out)
    }

    /// Weights that the graph actually uses (fused parts are superseded by the fused weight).
    pub fn used_by(&self, graph: &crate::Graph) -> Vec<WeightId> {
        use crate::graph::{ExpertGateUp, Op};
        let mut ids = Vec::new();
        for op in &graph.ops {
            match op {
                Op::Embed { table, .. } => ids.push(*table),
                Op::RmsNorm { norm, .. } | Op::HeadNorm { norm, .. } => ids.push(norm.weight),
                Op::Attention { qk_norm: Some(n), .. } => ids.extend([n.q.weight, n.k.weight]),
                Op::Linear { norm, w, bias, .. } => {
                    ids.push(*w);
                    ids.extend(norm.map(|n| n.weight));
                    ids.extend(*bias);
                }
                Op::GatedLinear { norm, w, .. } => {
                    ids.push(*w);
                    ids.extend(norm.map(|n| n.weight));
                }
                Op::GatedDeltaNet { conv, a_coef, dt_bias, norm, .. } => ids.extend([*conv, *a_coef, *dt_bias, norm.weight]),
                Op::MoeFfn { norm, router, gate_up, down, shared, .. } => {
                    ids.extend(norm.map(|n| n.weight));
                    ids.extend([*router, *down]);
                    match *gate_up {
                        ExpertGateUp::Fused(w) => ids.push(w),
                        ExpertGateUp::Split { gate, up } => ids.extend([gate, up]),
                    }
                    if let Some(s) = shared {
                        ids.extend([s.gate, s.up, s.down, s.gate_inp]);
                    }
                }
                _ => {}
            }
        }
        ids.sort();
        ids.dedup();
        ids
    }
}

/// The pieces of the concatenation of `units` (ranges, each tagged with its part) at positions
/// `sel`, as sub-ranges of those units.
fn pick(units: &[(usize, Range<usize>)], sel: Range<usize>) -> Vec<(usize, Range<usize>)> {
    let mut out = Vec::new();
    let mut at = 0;
    for (part, u) in units {
        let (lo, hi) = (sel.start.max(at), sel.end.min(at + u.len()));
        if lo < hi {
            out.push((*part, u.start + lo - at..u.start + hi - at));
        }
        at += u.len();
    }
    out
}

/// Columns `cols` of a row of `dtype` must start and end on block boundaries to be cut out.
fn check_block_cols(dtype: GgmlType, name: &str, cols: &Range<usize>) -> Result<(), ModelError> {
    let block = dtype.block_size();
    if cols.start.is_multiple_of(block) && cols.end.is_multiple_of(block) {
        return Ok(());
    }
    Err(ModelError::tensor(name, format!("columns {cols:?} do not fall on the {block}-value block boundaries of {}", dtype.name())))
}

#[cfg(test)]
#[allow(clippy::single_range_in_vec_init)] // lists of row ranges, some of one range
mod tests {
    use super::*;
    use ferrite_gguf::GgufWriter;

    /// A file with `m`: 6 rows x 32 columns, row `r` all `r`, in f32 and in Q8_0.
    fn file() -> GgufFile {
        let values: Vec<f32> = (0..6).flat_map(|r| [r as f32; 32]).collect();
        let mut w = GgufWriter::new();
        w.add_metadata("general.architecture", ferrite_gguf::Value::String("llama".into()));
        let f32_bytes: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
        w.add_tensor("m", &[32, 6], GgmlType::F32, f32_bytes).unwrap();
        w.add_tensor("q", &[32, 6], GgmlType::Q8_0, ferrite_gguf::quantize(GgmlType::Q8_0, &values).unwrap()).unwrap();
        let mut bytes = Vec::new();
        w.write_to(&mut bytes).unwrap();
        GgufFile::from_bytes(bytes).unwrap()
    }

    /// Row selections gather whole rows in the declared order, on any dtype, and fuse like
    /// whole tensors.
    #[test]
    fn row_selections_gather_rows_in_order() {
        let f = file();
        let mut ws = WeightSet::default();
        let sel = ws.add_rows(&f, "m", "odd", vec![5..6, 1..2, 3..4], 6, 32).unwrap();
        let spec = ws.spec(sel).clone();
        assert_eq!((spec.name.as_str(), spec.rows, spec.cols, spec.whole_tensor()), ("m[odd]", 3, 32, None));
        let rows = |v: Vec<f32>| v.chunks(32).map(|r| r[0]).collect::<Vec<_>>();
        assert_eq!(rows(ws.to_f32(&f, sel).unwrap()), [5.0, 1.0, 3.0]);
        let even = ws.add_rows(&f, "m", "even", vec![0..1, 2..3, 4..5], 6, 32).unwrap();
        let fused = ws.fuse(&[sel, even]).unwrap();
        assert_eq!(rows(ws.to_f32(&f, fused).unwrap()), [5.0, 1.0, 3.0, 0.0, 2.0, 4.0]);
        // Quantized rows move as whole blocks: the selection equals the same rows of the tensor.
        let q = ws.add_rows(&f, "q", "tail", vec![4..6, 0..1], 6, 32).unwrap();
        let all = ws.add(&f, "q", 6, 32).unwrap();
        assert_eq!(ws.spec(all).whole_tensor(), Some("q"));
        let whole = ws.bytes(&f, all).unwrap();
        let row = whole.len() / 6;
        assert_eq!(&ws.bytes(&f, q).unwrap()[..], [&whole[4 * row..6 * row], &whole[..row]].concat().as_slice());
        let deq = rows(ws.to_f32(&f, all).unwrap());
        assert_eq!(rows(ws.to_f32(&f, q).unwrap()), [deq[4], deq[5], deq[0]]);
    }

    /// A file with `a` and `b` (6 and 4 rows x 512 columns) in each of `dtypes`, and the f32
    /// vectors `u` (6) and `v` (4). Returns the file and, per dtype, `a` and `b` dequantized,
    /// concatenated.
    fn slicing_file(dtypes: &[GgmlType]) -> (GgufFile, Vec<Vec<f32>>) {
        let mut w = GgufWriter::new();
        w.add_metadata("general.architecture", ferrite_gguf::Value::String("llama".into()));
        let value = |i: usize| ((i * 7919 % 1009) as f32 / 1009.0 - 0.5) * (1.0 + (i / 512) as f32);
        let mut whole = Vec::new();
        for dt in dtypes {
            let mut deq = Vec::new();
            for (name, rows, seed) in [("a", 6, 0), ("b", 4, 6 * 512)] {
                let x: Vec<f32> = (0..rows * 512).map(|i| value(i + seed)).collect();
                let bytes = ferrite_gguf::quantize(*dt, &x).unwrap();
                let mut d = vec![0f32; x.len()];
                ferrite_gguf::dequantize(*dt, &bytes, &mut d).unwrap();
                w.add_tensor(format!("{name}.{}", dt.name()), &[512, rows as u64], *dt, bytes).unwrap();
                deq.extend(d);
            }
            whole.push(deq);
        }
        for (name, len) in [("u", 6), ("v", 4)] {
            let x: Vec<u8> = (0..len).flat_map(|i| (i as f32 + if name == "v" { 10.0 } else { 0.0 }).to_le_bytes()).collect();
            w.add_tensor(name, &[len as u64], GgmlType::F32, x).unwrap();
        }
        let mut bytes = Vec::new();
        w.write_to(&mut bytes).unwrap();
        (GgufFile::from_bytes(bytes).unwrap(), whole)
    }

    /// Slices of packed weights — rows of a fused weight across its parts, columns cut between
    /// blocks, a slice of a slice — dequantize to exactly the same slices of the dequantized
    /// whole, for float, legacy and k-quant types; a vector's elements are sliced like rows.
    #[test]
    fn slices_of_packed_weights_dequantize_to_slices_of_the_whole() {
        use GgmlType::*;
        let dtypes = [F32, F16, BF16, Q8_0, Q4_0, Q5_1, Q4_K, Q6_K];
        let (f, whole) = slicing_file(&dtypes);
        let slice = |m: &[f32], rows: &[usize], cols: Range<usize>| -> Vec<f32> { rows.iter().flat_map(|&r| m[r * 512 + cols.start..r * 512 + cols.end].to_vec()).collect() };
        for (dt, ab_whole) in dtypes.iter().zip(&whole) {
            let mut ws = WeightSet::default();
            let ia = ws.add(&f, &format!("a.{}", dt.name()), 6, 512).unwrap();
            let ib = ws.add(&f, &format!("b.{}", dt.name()), 4, 512).unwrap();
            let ab = ws.fuse(&[ia, ib]).unwrap();
            // Rows 4..8 cross from `a` into `b`; 1..2 comes back to `a`.
            let rows = ws.select_rows(&f, ab, "r", &[4..8, 1..2]).unwrap();
            assert_eq!((ws.spec(rows).rows, ws.spec(rows).cols, ws.spec(rows).whole_tensor()), (5, 512, None));
            assert!(ws.to_f32(&f, rows).unwrap() == slice(ab_whole, &[4, 5, 6, 7, 1], 0..512), "{dt:?} rows");
            let cols = ws.select_cols(ab, "c", 256..512).unwrap();
            assert!(ws.to_f32(&f, cols).unwrap() == slice(ab_whole, &(0..10).collect::<Vec<_>>(), 256..512), "{dt:?} cols");
            // Both ways round: rows of a column slice, columns of a row slice.
            let both = ws.select_rows(&f, cols, "r", &[3..7]).unwrap();
            let other = ws.select_cols(rows, "c", 256..512).unwrap();
            assert!(ws.to_f32(&f, both).unwrap() == slice(ab_whole, &[3, 4, 5, 6], 256..512), "{dt:?} rows of cols");
            assert!(ws.to_f32(&f, other).unwrap() == slice(ab_whole, &[4, 5, 6, 7, 1], 256..512), "{dt:?} cols of rows");
            let inner = ws.select_cols(cols, "c", 0..256).unwrap();
            assert_eq!(ws.spec(inner).parts[0].cols, Some(256..512));
        }
        let mut ws = WeightSet::default();
        let (u, v) = (ws.add(&f, "u", 1, 6).unwrap(), ws.add(&f, "v", 1, 4).unwrap());
        let uv = ws.fuse(&[u, v]).unwrap();
        let sel = ws.select_rows(&f, uv, "r", &[5..7, 9..10]).unwrap();
        assert!(ws.spec(sel).is_vector());
        assert_eq!(ws.to_f32(&f, sel).unwrap(), [5.0, 10.0, 13.0]);
    }

    #[test]
    fn bad_slices_are_refused_by_name() {
        let (f, _) = slicing_file(&[GgmlType::Q4_K, GgmlType::Q8_0]);
        let mut ws = WeightSet::default();
        let k = ws.add(&f, "a.Q4_K", 6, 512).unwrap();
        let e = ws.select_cols(k, "c", 128..384).unwrap_err().to_string();
        assert!(e.contains("`a.Q4_K`") && e.contains("256-value block boundaries of Q4_K"), "{e}");
        let q = ws.add(&f, "a.Q8_0", 6, 512).unwrap();
        assert!(ws.select_cols(q, "c", 32..96).is_ok());
        let e = ws.select_cols(q, "c", 16..48).unwrap_err().to_string();
        assert!(e.contains("32-value block"), "{e}");
        let e = ws.select_rows(&f, q, "r", &[5..7]).unwrap_err().to_string();
        assert!(e.contains("5..7") && e.contains("outside its 6 rows"), "{e}");
        let u = ws.add(&f, "u", 1, 6).unwrap();
        assert!(ws.select_cols(u, "c", 0..2).unwrap_err().to_string().contains("only the columns of a plain matrix"));
    }

    #[test]
    fn bad_row_selections_are_refused_by_name() {
        let f = file();
        let mut ws = WeightSet::default();
        let e = ws.add_rows(&f, "m", "x", vec![0..1, 4..7], 6, 32).unwrap_err().to_string();
        assert!(e.contains("`m`") && e.contains("4..7"), "{e}");
        let e = ws.add_rows(&f, "m", "x", vec![0..1, 1..2], 8, 32).unwrap_err().to_string();
        assert!(e.contains("`m`") && e.contains("shape 8x32 expected"), "{e}");
        let e = ws.add_rows(&f, "nope", "x", vec![0..1, 1..2], 6, 32).unwrap_err().to_string();
        assert!(e.contains("missing tensor `nope`"), "{e}");
    }
}
