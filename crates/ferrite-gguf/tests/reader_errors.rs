//! Hostile and malformed inputs: every check of the reader, with hand-built byte streams.

use ferrite_gguf::{GgmlType, GgufError, GgufFile, Value};

/// Raw little-endian GGUF bytes, field by field, so that any field can be made invalid.
#[derive(Clone, Default)]
struct Raw(Vec<u8>);

impl Raw {
    fn header(version: u32, n_tensors: u64, n_kv: u64) -> Raw {
        Raw::default().bytes(b"GGUF").u32(version).u64(n_tensors).u64(n_kv)
    }
    fn bytes(mut self, b: &[u8]) -> Raw {
        self.0.extend_from_slice(b);
        self
    }
    fn u32(self, v: u32) -> Raw {
        self.bytes(&v.to_le_bytes())
    }
    fn u64(self, v: u64) -> Raw {
        self.bytes(&v.to_le_bytes())
    }
    fn str(self, s: &str) -> Raw {
        self.u64(s.len() as u64).bytes(s.as_bytes())
    }
    /// A key with a u32 value (type 4).
    fn kv_u32(self, key: &str, v: u32) -> Raw {
        self.str(key).u32(4).u32(v)
    }
    fn tensor(self, name: &str, shape: &[u64], dtype: u32, offset: u64) -> Raw {
        let mut r = self.str(name).u32(shape.len() as u32);
        for &d in shape {
            r = r.u64(d);
        }
        r.u32(dtype).u64(offset)
    }
    /// Zero padding up to the next multiple of `alignment`, then `n` data bytes.
    fn data(mut self, alignment: usize, n: usize) -> Raw {
        let padded = self.0.len().div_ceil(alignment) * alignment;
        self.0.resize(padded, 0);
        self.0.extend((0..n).map(|i| i as u8));
        self
    }
    fn parse(self) -> Result<GgufFile, GgufError> {
        GgufFile::from_bytes(self.0)
    }
}

fn err(raw: Raw) -> GgufError {
    match raw.parse() {
        Ok(_) => panic!("expected an error"),
        Err(e) => e,
    }
}

/// A valid file: 2 metadata entries, 2 F32 tensors of 4 and 8 elements.
fn valid() -> Raw {
    Raw::header(3, 2, 2)
        .kv_u32("a.n", 7)
        .str("general.architecture")
        .u32(8)
        .str("llama")
        .tensor("t0", &[4], 0, 0)
        .tensor("t1", &[4, 2], 0, 32)
        .data(32, 64)
}

#[test]
fn valid_file_parses_and_v2_is_accepted() {
    for version in [2, 3] {
        let mut raw = valid();
        raw.0[4..8].copy_from_slice(&u32::to_le_bytes(version));
        let f = raw.parse().unwrap();
        assert_eq!(f.version, version);
        assert_eq!(f.architecture().unwrap(), "llama");
        assert_eq!(f.metadata.u32("a.n").unwrap(), 7);
        let t1 = f.tensor("t1").unwrap();
        assert_eq!((t1.row_len(), t1.n_rows(), t1.n_elements(), t1.n_bytes), (4, 2, 8, 32));
        assert_eq!(f.tensor_data(t1), (32..64).map(|i| i as u8).collect::<Vec<_>>());
        assert!(f.tensor("missing").is_none());
    }
}

#[test]
fn magic_and_version() {
    assert!(matches!(err(Raw::default()), GgufError::Truncated { .. }));
    assert!(matches!(err(Raw::default().bytes(b"GGML").u32(3)), GgufError::BadMagic { .. }));
    assert!(matches!(err(Raw::header(1, 0, 0)), GgufError::UnsupportedVersion(1)));
    assert!(matches!(err(Raw::header(4, 0, 0)), GgufError::UnsupportedVersion(4)));
    let e = err(Raw::default().bytes(b"GGUF").bytes(&3u32.to_be_bytes()).u64(0).u64(0));
    assert!(matches!(e, GgufError::BigEndian { .. }), "{e}");
    assert!(e.to_string().contains("big-endian"));
}

#[test]
fn huge_counts_fail_before_allocating() {
    let e = err(Raw::header(3, 0, u64::MAX));
    assert!(matches!(e, GgufError::Truncated { .. }), "{e}");
    assert!(matches!(err(Raw::header(3, u64::MAX, 0)), GgufError::Truncated { .. }));
    // String length, array lengths (flat and nested).
    assert!(matches!(err(Raw::header(3, 0, 1).u64(u64::MAX)), GgufError::Truncated { .. }));
    let e = err(Raw::header(3, 0, 1).str("k").u32(9).u32(10).u64(1 << 40).u64(0));
    assert!(e.to_string().contains("metadata key `k`"), "{e}");
    assert!(matches!(e, GgufError::Truncated { .. }));
    let nested = Raw::header(3, 0, 1).str("k").u32(9).u32(9).u64(1).u32(8).u64(u64::MAX / 2);
    assert!(matches!(err(nested), GgufError::Truncated { .. }));
}

#[test]
fn metadata_array_element_budget() {
    // 2^24 + 1 one-byte elements (16 MiB of file) exceed the total metadata element limit.
    let n = (1u64 << 24) + 1;
    let raw = Raw::header(3, 0, 1).str("k").u32(9).u32(0).u64(n).bytes(&vec![0; n as usize]);
    assert!(matches!(err(raw), GgufError::TooLarge { .. }));
}

#[test]
fn bad_values() {
    let e = err(Raw::header(3, 0, 1).str("k").u32(13).u32(0));
    assert!(matches!(e, GgufError::UnknownValueType { id: 13, .. }), "{e}");
    let e = err(Raw::header(3, 0, 1).str("k").u32(9).u32(77).u64(0));
    assert!(matches!(e, GgufError::UnknownValueType { id: 77, .. }), "{e}");
    let e = err(Raw::header(3, 0, 1).str("k").u32(7).bytes(&[2]));
    assert!(matches!(e, GgufError::Malformed { .. }), "{e}");
    let e = err(Raw::header(3, 0, 1).u64(2).bytes(&[0xC3, 0x28]).u32(4).u32(0));
    assert!(matches!(e, GgufError::InvalidUtf8 { .. }), "{e}");
    let e = err(Raw::header(3, 0, 1).str("k").u32(8).u64(1).bytes(&[0xFF]));
    assert!(matches!(e, GgufError::InvalidUtf8 { .. }), "{e}");
    // Arrays nested 9 deep.
    let mut raw = Raw::header(3, 0, 1).str("k").u32(9);
    for _ in 0..9 {
        raw = raw.u32(9).u64(1);
    }
    let e = err(raw.u32(0).u64(0));
    assert!(matches!(e, GgufError::Malformed { .. }), "{e}");
    let e = err(Raw::header(3, 0, 2).kv_u32("k", 1).kv_u32("k", 2));
    assert!(matches!(e, GgufError::DuplicateKey(ref k) if k == "k"), "{e}");
}

#[test]
fn every_value_type_and_nesting_parse() {
    let raw = Raw::header(3, 0, 13)
        .str("u8")
        .u32(0)
        .bytes(&[200])
        .str("i8")
        .u32(1)
        .bytes(&[0x80])
        .str("u16")
        .u32(2)
        .bytes(&60000u16.to_le_bytes())
        .str("i16")
        .u32(3)
        .bytes(&(-2i16).to_le_bytes())
        .kv_u32("u32", 70000)
        .str("i32")
        .u32(5)
        .bytes(&(-3i32).to_le_bytes())
        .str("f32")
        .u32(6)
        .bytes(&1.5f32.to_le_bytes())
        .str("bool")
        .u32(7)
        .bytes(&[1])
        .str("str")
        .u32(8)
        .str("hé")
        .str("u64")
        .u32(10)
        .u64(u64::MAX)
        .str("i64")
        .u32(11)
        .bytes(&i64::MIN.to_le_bytes())
        .str("f64")
        .u32(12)
        .bytes(&0.1f64.to_le_bytes())
        .str("arr")
        .u32(9)
        .u32(9)
        .u64(2)
        .u32(8)
        .u64(1)
        .str("x")
        .u32(0)
        .u64(0);
    let md = raw.parse().unwrap().metadata;
    let expected = vec![
        ("u8", Value::U8(200)),
        ("i8", Value::I8(-128)),
        ("u16", Value::U16(60000)),
        ("i16", Value::I16(-2)),
        ("u32", Value::U32(70000)),
        ("i32", Value::I32(-3)),
        ("f32", Value::F32(1.5)),
        ("bool", Value::Bool(true)),
        ("str", Value::String("hé".into())),
        ("u64", Value::U64(u64::MAX)),
        ("i64", Value::I64(i64::MIN)),
        ("f64", Value::F64(0.1)),
        (
            "arr",
            Value::Array(vec![Value::Array(vec![Value::String("x".into())]), Value::Array(vec![])]),
        ),
    ];
    assert_eq!(md.iter().map(|(k, v)| (k, v.clone())).collect::<Vec<_>>(), expected);
}

fn with_tensor(shape: &[u64], dtype: u32, offset: u64, data: usize) -> Raw {
    Raw::header(3, 1, 0).tensor("w", shape, dtype, offset).data(32, data)
}

#[test]
fn bad_tensor_infos() {
    let e = err(with_tensor(&[32], 4, 0, 64)); // 4 was Q4_2, long removed
    assert!(matches!(e, GgufError::UnknownDtype { ref tensor, id: 4 } if tensor == "w"), "{e}");
    assert!(matches!(
        err(with_tensor(&[32], 1000, 0, 64)),
        GgufError::UnknownDtype { id: 1000, .. }
    ));
    assert!(matches!(err(with_tensor(&[], 0, 0, 64)), GgufError::BadShape { .. }));
    assert!(matches!(err(with_tensor(&[1, 1, 1, 1, 1], 0, 0, 64)), GgufError::BadShape { .. }));
    let e = err(with_tensor(&[33], GgmlType::Q4_0 as u32, 0, 64));
    assert!(e.to_string().contains("not a multiple of the Q4_0 block size 32"), "{e}");
    let e = err(with_tensor(&[1 << 40, 1 << 40], 0, 0, 64));
    assert!(e.to_string().contains("overflows"), "{e}");
    let e = err(with_tensor(&[4], 0, 8, 64));
    assert!(matches!(e, GgufError::MisalignedTensor { offset: 8, alignment: 32, .. }), "{e}");
    let e = err(Raw::header(3, 2, 0).tensor("w", &[4], 0, 0).tensor("w", &[4], 0, 32).data(32, 64));
    assert!(matches!(e, GgufError::DuplicateTensor(ref n) if n == "w"), "{e}");
    // Zero-sized dimensions are legal (no data).
    let f = with_tensor(&[0, 3], 0, 0, 0).parse().unwrap();
    assert_eq!(f.tensor_data(&f.tensors[0]), &[] as &[u8]);
}

#[test]
fn tensor_ranges() {
    // Offset far beyond the file, and offsets that overflow when added to the data start.
    let e = err(with_tensor(&[4], 0, 1 << 20, 64));
    assert!(matches!(e, GgufError::TensorOutOfBounds { .. }), "{e}");
    let e = err(with_tensor(&[4], 0, u64::MAX - 31, 64));
    assert!(matches!(e, GgufError::TensorOutOfBounds { .. }), "{e}");
    // Overlaps: partial, and a large tensor covering a later small one.
    let e =
        err(Raw::header(3, 2, 0).tensor("a", &[16], 0, 0).tensor("b", &[4], 0, 32).data(32, 64));
    assert!(matches!(e, GgufError::OverlappingTensors { .. }), "{e}");
    let e = err(Raw::header(3, 3, 0)
        .tensor("big", &[64], 0, 0)
        .tensor("x", &[4], 0, 64)
        .tensor("y", &[4], 0, 128)
        .data(32, 256));
    assert!(e.to_string().contains("`big`"), "{e}");
    // Sharing no bytes is fine even when listed out of order.
    let f =
        Raw::header(3, 2, 0).tensor("b", &[4], 0, 32).tensor("a", &[8], 0, 0).data(32, 64).parse();
    assert!(f.is_ok());
}

#[test]
fn alignment_key() {
    let raw = |v: u32| {
        Raw::header(3, 1, 1)
            .kv_u32("general.alignment", v)
            .tensor("w", &[4], 0, 64)
            .data(v.max(1) as usize, 80)
    };
    let f = raw(64).parse().unwrap();
    assert_eq!((f.alignment, f.data_offset() % 64), (64, 0));
    assert_eq!(f.tensor_data(&f.tensors[0]), (64..80).map(|i| i as u8).collect::<Vec<_>>());
    for bad in [0, 3, 48] {
        let e = err(raw(bad));
        assert!(e.to_string().contains("power of two"), "{e}");
    }
    let e = err(Raw::header(3, 0, 1).str("general.alignment").u32(8).str("32"));
    assert!(matches!(e, GgufError::Malformed { .. }), "{e}");
}

#[test]
fn truncation_at_every_byte_is_a_truncated_error() {
    let full = valid().0;
    let needed = full.len(); // the last tensor ends exactly at the end of the file
    for cut in 0..needed {
        match GgufFile::from_bytes(full[..cut].to_vec()) {
            Err(GgufError::Truncated { .. }) => {}
            other => panic!("cut at {cut}: expected Truncated, got {other:?}"),
        }
    }
    assert!(GgufFile::from_bytes(full).is_ok());
}

#[test]
fn open_names_the_file() {
    let dir = std::env::temp_dir().join(format!("ferrite-gguf-reader-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let missing = dir.join("missing.gguf");
    let e = GgufFile::open(&missing).unwrap_err();
    assert!(matches!(e.root(), GgufError::Io(_)));
    assert!(e.to_string().contains("missing.gguf"), "{e}");
    let bad = dir.join("bad.gguf");
    std::fs::write(&bad, b"GGUF\x01\0\0\0").unwrap();
    let e = GgufFile::open(&bad).unwrap_err();
    assert!(matches!(e.root(), GgufError::UnsupportedVersion(1)));
    assert!(e.to_string().starts_with(&bad.display().to_string()), "{e}");
    let empty = dir.join("empty.gguf");
    std::fs::write(&empty, b"").unwrap();
    assert!(matches!(GgufFile::open(&empty).unwrap_err().root(), GgufError::Truncated { .. }));
    std::fs::remove_dir_all(&dir).unwrap();
}
