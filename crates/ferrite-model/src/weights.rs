//! Named weights, including fused weights declared at load time.
//!
//! A weight is one or more GGUF tensors of the same dtype and row length, concatenated along
//! rows (for matrices) or elements (for vectors). Concatenating the raw bytes does both, because
//! GGUF rows are contiguous and blocks never straddle rows. A part may also be a selection of a
//! matrix's rows in any order ([`WeightSet::add_rows`]): a layout change declared at load time
//! (Qwen3-Next's per-key-head interleaved projections are de-interleaved that way), which works
//! on quantized rows as well.

use crate::graph::WeightId;
use crate::ModelError;
use ferrite_gguf::{GgmlType, GgufFile, TensorInfo};
use std::borrow::Cow;
use std::ops::Range;

/// A GGUF tensor, or a selection of its rows, that a weight is made of.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct WeightPart {
    pub tensor: String,
    /// The tensor's rows taken, in this order; `None`: the whole tensor.
    pub rows: Option<Vec<Range<usize>>>,
}

impl WeightPart {
    fn whole(tensor: &str) -> Self {
        Self { tensor: tensor.to_string(), rows: None }
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
    /// in place), `None` for a fused weight or a row selection.
    pub fn whole_tensor(&self) -> Option<&str> {
        match self.parts.as_slice() {
            [WeightPart { tensor, rows: None }] => Some(tensor),
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
        let part = WeightPart { tensor: name.to_string(), rows: Some(ranges) };
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

    fn push(&mut self, spec: WeightSpec) -> WeightId {
        self.specs.push(spec);
        WeightId(self.specs.len() as u32 - 1)
    }

    /// The weight's bytes in its dtype: borrowed from the file for one whole tensor, gathered for
    /// a fused weight or a row selection.
    pub fn bytes<'a>(&self, file: &'a GgufFile, id: WeightId) -> Result<Cow<'a, [u8]>, ModelError> {
        let spec = self.spec(id);
        if let Some(only) = spec.whole_tensor() {
            return Ok(Cow::Borrowed(file.tensor_data(tensor(file, only)?)));
        }
        let mut out = Vec::new();
        for p in &spec.parts {
            let t = tensor(file, &p.tensor)?;
            let data = file.tensor_data(t);
            match &p.rows {
                None => out.extend_from_slice(data),
                Some(ranges) => {
                    let row = data.len() / matrix_shape(t)?.0;
                    for r in ranges {
                        out.extend_from_slice(&data[r.start * row..r.end * row]);
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

#[cfg(test)]
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
