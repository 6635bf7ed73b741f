//! Named weights, including fused weights declared at load time.
//!
//! A weight is one or more GGUF tensors of the same dtype and row length, concatenated along
//! rows (for matrices) or elements (for vectors). Concatenating the raw bytes does both, because
//! GGUF rows are contiguous and blocks never straddle rows.

use crate::graph::WeightId;
use crate::ModelError;
use ferrite_gguf::{GgmlType, GgufFile, TensorInfo};
use std::borrow::Cow;

#[derive(Clone, Debug, PartialEq)]
pub struct WeightSpec {
    /// Display name (the tensor name, or `a+b+c` for a fused weight).
    pub name: String,
    /// GGUF tensor names, in concatenation order.
    pub parts: Vec<String>,
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
        Ok(self.push(WeightSpec { name: name.to_string(), parts: vec![name.to_string()], dtype: t.dtype, rows, cols, experts: 1 }))
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
        Ok(self.push(WeightSpec { name: name.to_string(), parts: vec![name.to_string()], dtype: t.dtype, rows: experts * rows, cols, experts }))
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

    /// The weight's bytes in its dtype: borrowed from the file for one part, concatenated for a fused weight.
    pub fn bytes<'a>(&self, file: &'a GgufFile, id: WeightId) -> Result<Cow<'a, [u8]>, ModelError> {
        let spec = self.spec(id);
        if let [only] = spec.parts.as_slice() {
            return Ok(Cow::Borrowed(file.tensor_data(tensor(file, only)?)));
        }
        let mut out = Vec::new();
        for p in &spec.parts {
            out.extend_from_slice(file.tensor_data(tensor(file, p)?));
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
