//! Cross-checks against gguf-py, an independent GGUF implementation: dequantized values,
//! quantized bytes, rows of the real SmolLM2 model and files written by gguf-py's GGUFWriter.
//! Fixtures: fixtures/gguf/ (regenerate with scripts/fixtures/gguf_fixtures.py).

use ferrite_gguf::{dequantize, quantize, GgmlType, GgufFile, Value};
use serde_json::Value as Json;
use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

fn fixtures() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/gguf")
}

fn manifest() -> Json {
    let text = std::fs::read_to_string(fixtures().join("manifest.json")).unwrap();
    serde_json::from_str(&text).unwrap()
}

fn read(rel: &Json) -> Vec<u8> {
    let path = fixtures().join(rel.as_str().unwrap());
    std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

fn read_f32(rel: &Json) -> Vec<f32> {
    read(rel).chunks_exact(4).map(|b| f32::from_le_bytes(b.try_into().unwrap())).collect()
}

fn dtype(entry: &Json) -> GgmlType {
    GgmlType::from_name(entry["dtype"].as_str().unwrap()).unwrap()
}

/// Bitwise equality, reporting the first mismatch.
fn assert_bits_eq(actual: &[f32], expected: &[f32], what: &str) {
    assert_eq!(actual.len(), expected.len(), "{what}: length");
    if let Some(i) = (0..actual.len()).find(|&i| actual[i].to_bits() != expected[i].to_bits()) {
        panic!(
            "{what}: element {i} is {:e} ({:#010x}), gguf-py says {:e} ({:#010x})",
            actual[i],
            actual[i].to_bits(),
            expected[i],
            expected[i].to_bits()
        );
    }
}

#[test]
fn dequantize_matches_gguf_py_for_every_type() {
    let manifest = manifest();
    let mut covered = BTreeSet::new();
    for entry in manifest["dequant"].as_array().unwrap() {
        let dtype = dtype(entry);
        let raw = read(&entry["raw"]);
        let expected = read_f32(&entry["expected"]);
        let mut out = vec![f32::NAN; expected.len()];
        dequantize(dtype, &raw, &mut out).unwrap();
        assert_bits_eq(&out, &expected, dtype.name());
        // Unaligned input must give the same values.
        let mut shifted = vec![0u8; raw.len() + 1];
        shifted[1..].copy_from_slice(&raw);
        let mut out2 = vec![0.0; expected.len()];
        dequantize(dtype, &shifted[1..], &mut out2).unwrap();
        assert_bits_eq(&out2, &expected, dtype.name());
        covered.insert(dtype.name());
    }
    let all: BTreeSet<_> = GgmlType::ALL.iter().map(|t| t.name()).collect();
    assert_eq!(covered, all, "every type has a gguf-py vector");
}

#[test]
fn quantize_matches_gguf_py_bytes() {
    let manifest = manifest();
    for entry in manifest["quant"].as_array().unwrap() {
        let dtype = dtype(entry);
        let input = read_f32(&entry["input"]);
        let expected = read(&entry["expected"]);
        let ours = quantize(dtype, &input).unwrap();
        assert_eq!(ours.len(), expected.len(), "{dtype}");
        if let Some(i) = (0..ours.len()).find(|&i| ours[i] != expected[i]) {
            let block = i / dtype.type_size();
            panic!(
                "{dtype}: byte {i} (block {block}) is {:#04x}, gguf-py wrote {:#04x}",
                ours[i], expected[i]
            );
        }
        // And so dequant(quant(x)) is the same as dequantizing gguf-py's quantization.
        let mut a = vec![0.0; input.len()];
        let mut b = vec![0.0; input.len()];
        dequantize(dtype, &ours, &mut a).unwrap();
        dequantize(dtype, &expected, &mut b).unwrap();
        assert_bits_eq(&a, &b, dtype.name());
    }
}

#[test]
fn smollm2_rows_match_gguf_py() {
    let model = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../models/SmolLM2-135M-Instruct.Q4_1.gguf");
    assert!(model.exists(), "{} is missing: run scripts/fetch-model.sh first", model.display());
    let file = GgufFile::open(&model).unwrap();
    let manifest = manifest();
    let entries = manifest["smollm2"].as_array().unwrap();
    let kinds: BTreeSet<_> = entries.iter().map(|e| e["dtype"].as_str().unwrap()).collect();
    assert_eq!(kinds, BTreeSet::from(["F32", "Q4_1", "Q8_0"]));
    for entry in entries {
        let name = entry["tensor"].as_str().unwrap();
        let t = file.tensor(name).unwrap();
        assert_eq!(t.dtype, dtype(entry), "{name}");
        let row_bytes = t.dtype.row_bytes(t.row_len()).unwrap();
        let raw = read(&entry["raw"]);
        let expected = read_f32(&entry["expected"]);
        let data = file.tensor_data(t);
        for (k, row) in entry["rows"].as_array().unwrap().iter().enumerate() {
            let row = row.as_u64().unwrap() as usize;
            let ours = &data[row * row_bytes..(row + 1) * row_bytes];
            assert!(
                ours == &raw[k * row_bytes..(k + 1) * row_bytes],
                "{name} row {row}: raw bytes differ from gguf-py's"
            );
            let mut out = vec![0.0; t.row_len()];
            dequantize(t.dtype, ours, &mut out).unwrap();
            assert_bits_eq(
                &out,
                &expected[k * t.row_len()..(k + 1) * t.row_len()],
                &format!("{name} row {row}"),
            );
        }
    }
}

fn hex(s: &str) -> Vec<u8> {
    (0..s.len()).step_by(2).map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap()).collect()
}

fn check_gguf_py_file(entry: &Json) -> GgufFile {
    let path = fixtures().join(entry["path"].as_str().unwrap());
    let file = GgufFile::open(&path).unwrap();
    assert_eq!(file.version, 3);
    assert_eq!(file.alignment, entry["alignment"].as_u64().unwrap());
    assert_eq!(file.architecture().unwrap(), "testarch");
    let expected = entry["tensors"].as_array().unwrap();
    assert_eq!(file.tensors.len(), expected.len());
    for (t, e) in file.tensors.iter().zip(expected) {
        assert_eq!(t.name, e["name"].as_str().unwrap());
        assert_eq!(t.dtype, dtype(e), "{}", t.name);
        let shape: Vec<u64> =
            e["shape"].as_array().unwrap().iter().map(|d| d.as_u64().unwrap()).collect();
        assert_eq!(t.shape, shape, "{}", t.name);
        assert_eq!(t.offset % file.alignment, 0);
        assert_eq!(file.tensor_data(t), hex(e["data_hex"].as_str().unwrap()), "{}", t.name);
    }
    file
}

fn file_entry(manifest: &Json, path: &str) -> Json {
    let files = manifest["gguf_py_files"].as_array().unwrap();
    files.iter().find(|f| f["path"] == path).unwrap().clone()
}

#[test]
fn reads_gguf_py_file_with_every_value_type() {
    let file = check_gguf_py_file(&file_entry(&manifest(), "gguf_py/all_types.gguf"));
    let md = &file.metadata;
    let s = |v: &str| Value::String(v.into());
    let expected = [
        ("general.architecture", s("testarch")),
        ("t.u8", Value::U8(200)),
        ("t.i8", Value::I8(-100)),
        ("t.u16", Value::U16(60000)),
        ("t.i16", Value::I16(-30000)),
        ("t.u32", Value::U32(4_000_000_000)),
        ("t.i32", Value::I32(-2_000_000_000)),
        ("t.f32", Value::F32(0.1)),
        ("t.u64", Value::U64((1 << 40) + 1)),
        ("t.i64", Value::I64(-(1 << 40))),
        ("t.f64", Value::F64(std::f64::consts::PI)),
        ("t.bool", Value::Bool(true)),
        ("t.string", s("h\u{e9}llo \u{2713}")),
        ("t.strings", Value::Array(vec![s("a"), s("bc"), s("\u{fc}")])),
        ("t.i32s", Value::Array(vec![Value::I32(1), Value::I32(-2), Value::I32(3)])),
        ("t.u8s", Value::Array(vec![Value::U8(1), Value::U8(2), Value::U8(255)])),
        ("t.f32s", Value::Array(vec![Value::F32(0.5), Value::F32(-1.25)])),
        ("t.bools", Value::Array(vec![Value::Bool(true), Value::Bool(false)])),
        (
            "t.nested",
            Value::Array(vec![
                Value::Array(vec![Value::I32(1), Value::I32(2)]),
                Value::Array(vec![Value::I32(3)]),
            ]),
        ),
    ];
    let actual: Vec<(&str, &Value)> = md.iter().collect();
    let expected: Vec<(&str, &Value)> = expected.iter().map(|(k, v)| (*k, v)).collect();
    assert_eq!(actual, expected);
    assert_eq!(md.str_array("t.strings").unwrap(), vec!["a", "bc", "\u{fc}"]);
    assert_eq!(md.i32_array("t.u8s").unwrap(), vec![1, 2, 255]);
}

#[test]
fn reads_gguf_py_file_with_custom_alignment() {
    let file = check_gguf_py_file(&file_entry(&manifest(), "gguf_py/align64.gguf"));
    assert_eq!(file.metadata.u64("general.alignment").unwrap(), 64);
    assert_eq!(file.data_offset() % 64, 0);
    let offsets: Vec<u64> = file.tensors.iter().map(|t| t.offset).collect();
    assert_eq!(offsets, vec![0, 64, 128]);
}

/// Our writer must reproduce gguf-py's file byte for byte from the same content.
#[test]
fn writer_reproduces_gguf_py_file() {
    for rel in ["gguf_py/all_types.gguf", "gguf_py/align64.gguf"] {
        let path = fixtures().join(rel);
        let original = std::fs::read(&path).unwrap();
        let file = GgufFile::open(&path).unwrap();
        let mut w = ferrite_gguf::GgufWriter::new();
        for (k, v) in file.metadata.iter() {
            w.add_metadata(k, v.clone());
        }
        for t in &file.tensors {
            w.add_tensor(&t.name, &t.shape, t.dtype, file.tensor_data(t).to_vec()).unwrap();
        }
        let mut ours = Vec::new();
        w.write_to(&mut ours).unwrap();
        assert!(
            ours == original,
            "{}: rewritten file differs ({} vs {} bytes)",
            Path::new(rel).display(),
            ours.len(),
            original.len()
        );
    }
}
