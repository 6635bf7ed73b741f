//! Writer: round trips through the reader, streaming writes, and invalid input.

use ferrite_gguf::{quantize, GgmlType, GgufError, GgufFile, GgufWriter, TensorInfo, Value};
use std::path::PathBuf;

fn every_value_type() -> Vec<(&'static str, Value)> {
    vec![
        ("general.architecture", Value::String("llama".into())),
        ("u8", Value::U8(255)),
        ("i8", Value::I8(-1)),
        ("u16", Value::U16(65535)),
        ("i16", Value::I16(i16::MIN)),
        ("u32", Value::U32(u32::MAX)),
        ("i32", Value::I32(-7)),
        ("u64", Value::U64(u64::MAX)),
        ("i64", Value::I64(i64::MIN)),
        ("f32", Value::F32(-0.0)),
        ("f64", Value::F64(1e300)),
        ("bool", Value::Bool(false)),
        ("empty string", Value::String(String::new())),
        ("strings", Value::Array(vec![Value::String("<s>".into()), Value::String("ü ✓".into())])),
        ("floats", Value::Array(vec![Value::F32(1.0), Value::F32(f32::INFINITY)])),
        ("empty", Value::Array(vec![])),
        (
            "nested",
            Value::Array(vec![
                Value::Array(vec![Value::U64(1)]),
                Value::Array(vec![Value::String("x".into()), Value::String("y".into())]),
            ]),
        ),
    ]
}

/// Deterministic pseudo-random values (no RNG dependency needed for this).
fn wave(n: usize, seed: f32) -> Vec<f32> {
    (0..n).map(|i| ((i as f32 + seed) * 0.618).sin() * (1.0 + (i % 7) as f32)).collect()
}

#[test]
fn round_trip_every_value_type_and_dtype() {
    let mut w = GgufWriter::new();
    for (k, v) in every_value_type() {
        w.add_metadata(k, v);
    }
    let mut expected_data = Vec::new();
    for (i, dtype) in GgmlType::ALL.into_iter().enumerate() {
        let shape = [dtype.block_size() as u64 * 2, 3];
        let data = quantize(dtype, &wave(dtype.block_size() * 6, i as f32)).unwrap();
        w.add_tensor(format!("t.{dtype}"), &shape, dtype, data.clone()).unwrap();
        expected_data.push((format!("t.{dtype}"), shape.to_vec(), dtype, data));
    }
    // A tensor whose size is not a multiple of the alignment, followed by another one.
    w.add_tensor("odd", &[3], GgmlType::F32, vec![1; 12]).unwrap();
    expected_data.push(("odd".into(), vec![3], GgmlType::F32, vec![1; 12]));
    w.add_tensor("after_odd", &[1, 1, 1, 2], GgmlType::F16, vec![2; 4]).unwrap();
    expected_data.push(("after_odd".into(), vec![1, 1, 1, 2], GgmlType::F16, vec![2; 4]));

    let mut bytes = Vec::new();
    w.write_to(&mut bytes).unwrap();
    assert_eq!(bytes.len() % 32, 0);
    let f = GgufFile::from_bytes(bytes).unwrap();
    assert_eq!((f.version, f.alignment), (3, 32));
    let metadata: Vec<(&str, Value)> = f.metadata.iter().map(|(k, v)| (k, v.clone())).collect();
    assert_eq!(metadata, every_value_type());
    assert_eq!(f.tensors.len(), expected_data.len());
    for (t, (name, shape, dtype, data)) in f.tensors.iter().zip(&expected_data) {
        assert_eq!((&t.name, &t.shape, t.dtype), (name, shape, *dtype));
        assert_eq!(t.offset % 32, 0);
        assert_eq!(f.tensor_data(t), &data[..], "{name}");
    }
}

#[test]
fn custom_alignment_is_used() {
    let mut w = GgufWriter::new();
    w.add_metadata("general.alignment", Value::U32(256));
    w.add_tensor("a", &[5], GgmlType::F32, vec![7; 20]).unwrap();
    w.add_tensor("b", &[5], GgmlType::F32, vec![8; 20]).unwrap();
    let mut bytes = Vec::new();
    w.write_to(&mut bytes).unwrap();
    let f = GgufFile::from_bytes(bytes).unwrap();
    assert_eq!(f.alignment, 256);
    assert_eq!(f.data_offset() % 256, 0);
    assert_eq!(f.tensors[1].offset, 256);
    assert_eq!(f.tensor_data(&f.tensors[1]), &[8; 20]);
}

fn temp_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("ferrite-gguf-{name}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

#[test]
fn streaming_write_produces_data_lazily_in_order() {
    let dir = temp_dir("stream");
    let path = dir.join("model.gguf");
    let mut w = GgufWriter::new();
    w.add_metadata("general.architecture", Value::String("llama".into()));
    w.add_tensor_info("first", &[64, 4], GgmlType::Q8_0).unwrap();
    w.add_tensor("eager", &[4], GgmlType::F32, vec![9; 16]).unwrap();
    w.add_tensor_info("second", &[256], GgmlType::Q4_K).unwrap();
    let mut calls = Vec::new();
    w.write_file_with(&path, |t: &TensorInfo| {
        calls.push(t.name.clone());
        Ok(quantize(t.dtype, &wave(t.n_elements() as usize, calls.len() as f32)).unwrap())
    })
    .unwrap();
    assert_eq!(calls, ["first", "second"]);
    assert!(!dir.join("model.gguf.partial").exists());
    let f = GgufFile::open(&path).unwrap();
    let second = f.tensor("second").unwrap();
    assert_eq!(f.tensor_data(second), quantize(GgmlType::Q4_K, &wave(256, 2.0)).unwrap());
    assert_eq!(f.tensor_data(f.tensor("eager").unwrap()), &[9; 16]);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn failed_write_leaves_no_file() {
    let dir = temp_dir("failed");
    let path = dir.join("model.gguf");
    let mut w = GgufWriter::new();
    w.add_tensor_info("lazy", &[32], GgmlType::F32).unwrap();
    let e = w.write_file(&path).unwrap_err();
    assert!(e.to_string().contains("`lazy` was declared without data"), "{e}");
    assert!(e.to_string().contains("model.gguf"), "{e}");
    let e = w.write_file_with(&path, |_| Ok(vec![0; 4])).unwrap_err();
    assert!(e.to_string().contains("returned 4 bytes, expected 128"), "{e}");
    assert!(std::fs::read_dir(&dir).unwrap().next().is_none(), "no file or partial file left");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn invalid_input_is_rejected() {
    let mut w = GgufWriter::new();
    w.add_tensor("a", &[32], GgmlType::Q8_0, vec![0; 34]).unwrap();
    let e = w.add_tensor("a", &[32], GgmlType::Q8_0, vec![0; 34]).unwrap_err();
    assert!(matches!(e, GgufError::DuplicateTensor(_)));
    let e = w.add_tensor("b", &[32], GgmlType::Q8_0, vec![0; 33]).unwrap_err();
    assert_eq!(e.to_string(), "Q8_0 data for 32 elements must be 34 bytes, got 33");
    assert!(matches!(
        w.add_tensor_info("c", &[31], GgmlType::Q8_0),
        Err(GgufError::BadShape { .. })
    ));
    assert!(matches!(w.add_tensor_info("c", &[], GgmlType::F32), Err(GgufError::BadShape { .. })));
    assert!(matches!(
        w.add_tensor_info("c", &[1; 5], GgmlType::F32),
        Err(GgufError::BadShape { .. })
    ));

    let mut out = Vec::new();
    let mut mixed = GgufWriter::new();
    mixed.add_metadata("k", Value::Array(vec![Value::U32(1), Value::String("x".into())]));
    let e = mixed.write_to(&mut out).unwrap_err();
    assert!(e.to_string().contains("array mixes u32 and string"), "{e}");
    let mut nested_mixed = GgufWriter::new();
    let inner_mixed = Value::Array(vec![Value::Bool(true), Value::U8(1)]);
    nested_mixed.add_metadata("k", Value::Array(vec![Value::Array(vec![]), inner_mixed]));
    assert!(nested_mixed.write_to(&mut out).is_err());
    let mut bad_alignment = GgufWriter::new();
    bad_alignment.add_metadata("general.alignment", Value::U32(24));
    assert!(bad_alignment.write_to(&mut out).is_err());
    assert!(out.is_empty(), "nothing is written when the content is invalid");
}
