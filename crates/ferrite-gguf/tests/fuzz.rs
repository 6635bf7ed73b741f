//! Parser fuzzing with proptest: valid files mutated (bit flips, truncation, overwrites with
//! random or "interesting" integers, insertions, random headers) must give `Ok` or `Err`, never
//! a panic; files that parse must have fully usable tensors and metadata.
//! (The long-running coverage-guided fuzzer is fuzz/fuzz_targets/gguf_parse.rs.)

use ferrite_gguf::{dequantize_tensor, quantize, GgmlType, GgufFile, GgufWriter, Value};
use proptest::prelude::*;
use std::sync::OnceLock;

/// Seed files: one written by ferrite's writer with every value type and several dtypes, one
/// written by gguf-py.
fn seeds() -> &'static [Vec<u8>] {
    static SEEDS: OnceLock<Vec<Vec<u8>>> = OnceLock::new();
    SEEDS.get_or_init(|| {
        let mut w = GgufWriter::new();
        w.add_metadata("general.architecture", Value::String("llama".into()));
        w.add_metadata("general.alignment", Value::U32(32));
        w.add_metadata("n", Value::U32(3));
        w.add_metadata("b", Value::Bool(true));
        w.add_metadata("eps", Value::F32(1e-5));
        w.add_metadata(
            "tokens",
            Value::Array(vec![Value::String("a".into()), Value::String("bc".into())]),
        );
        w.add_metadata("scores", Value::Array(vec![Value::F32(0.5), Value::F32(-1.0)]));
        w.add_metadata(
            "nested",
            Value::Array(vec![Value::Array(vec![Value::I64(-1)]), Value::Array(vec![])]),
        );
        for (i, dtype) in
            [GgmlType::F32, GgmlType::F16, GgmlType::Q4_0, GgmlType::Q6_K].into_iter().enumerate()
        {
            let n = dtype.block_size() * 2;
            let x: Vec<f32> = (0..n).map(|j| ((i * n + j) as f32).sin()).collect();
            w.add_tensor(format!("t{i}"), &[n as u64], dtype, quantize(dtype, &x).unwrap())
                .unwrap();
        }
        let mut ours = Vec::new();
        w.write_to(&mut ours).unwrap();
        let gguf_py = std::fs::read(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../../fixtures/gguf/gguf_py/all_types.gguf"
        ))
        .unwrap();
        vec![ours, gguf_py]
    })
}

#[derive(Debug, Clone)]
enum Mutation {
    FlipBit {
        at: usize,
        bit: u8,
    },
    Truncate {
        at: usize,
    },
    Overwrite {
        at: usize,
        bytes: Vec<u8>,
    },
    /// A little-endian u32/u64 at a 4-byte aligned position (counts, lengths, types, offsets).
    Integer {
        at: usize,
        value: u64,
        wide: bool,
    },
    Insert {
        at: usize,
        bytes: Vec<u8>,
    },
}

fn mutation() -> impl Strategy<Value = Mutation> {
    let interesting = prop_oneof![
        Just(0u64),
        Just(1),
        Just(31),
        Just(32),
        Just(255),
        Just(u32::MAX as u64),
        Just(1 << 31),
        Just(1 << 32),
        Just(1 << 40),
        Just(u64::MAX),
        Just(u64::MAX - 31),
        any::<u64>(),
    ];
    prop_oneof![
        4 => (any::<usize>(), 0u8..8).prop_map(|(at, bit)| Mutation::FlipBit { at, bit }),
        1 => any::<usize>().prop_map(|at| Mutation::Truncate { at }),
        2 => (any::<usize>(), prop::collection::vec(any::<u8>(), 1..16)).prop_map(|(at, bytes)| Mutation::Overwrite { at, bytes }),
        3 => (any::<usize>(), interesting, any::<bool>()).prop_map(|(at, value, wide)| Mutation::Integer { at, value, wide }),
        1 => (any::<usize>(), prop::collection::vec(any::<u8>(), 1..16)).prop_map(|(at, bytes)| Mutation::Insert { at, bytes }),
    ]
}

fn apply(bytes: &mut Vec<u8>, m: &Mutation) {
    if bytes.is_empty() {
        return;
    }
    let len = bytes.len();
    match m {
        Mutation::FlipBit { at, bit } => bytes[at % len] ^= 1 << bit,
        Mutation::Truncate { at } => bytes.truncate(at % len),
        Mutation::Overwrite { at, bytes: new } => {
            for (i, b) in new.iter().enumerate() {
                if let Some(slot) = bytes.get_mut(at % len + i) {
                    *slot = *b;
                }
            }
        }
        Mutation::Integer { at, value, wide } => {
            let at = at % len / 4 * 4;
            let raw = value.to_le_bytes();
            let raw = if *wide { &raw[..] } else { &raw[..4] };
            for (i, b) in raw.iter().enumerate() {
                if let Some(slot) = bytes.get_mut(at + i) {
                    *slot = *b;
                }
            }
        }
        Mutation::Insert { at, bytes: new } => {
            let at = at % len;
            bytes.splice(at..at, new.iter().copied());
        }
    }
}

/// Whatever parses must be fully usable: data of every tensor in range and dequantizable,
/// every metadata getter answering without panicking.
fn exercise(bytes: Vec<u8>) {
    let Ok(file) = GgufFile::from_bytes(bytes) else { return };
    let _ = file.architecture();
    for t in &file.tensors {
        assert_eq!(file.tensor_data(t).len(), t.n_bytes);
        assert_eq!(file.tensor(&t.name).map(|found| found.offset), Some(t.offset));
        let values = dequantize_tensor(&file, t).expect("validated tensors dequantize");
        assert_eq!(values.len() as u64, t.n_elements());
    }
    for (key, value) in file.metadata.iter() {
        let _ = (file.metadata.u64(key), file.metadata.u32(key), file.metadata.f32(key));
        let _ = (file.metadata.bool(key), file.metadata.str(key), file.metadata.str_array(key));
        let _ = (file.metadata.f32_array(key), file.metadata.i32_array(key));
        let _ = (value.as_u64(), value.as_i64(), value.as_f64(), value.type_name());
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 3000, failure_persistence: None, ..ProptestConfig::default() })]

    #[test]
    fn mutated_files_never_panic(seed in 0usize..2, mutations in prop::collection::vec(mutation(), 1..6)) {
        let mut bytes = seeds()[seed].clone();
        for m in &mutations {
            apply(&mut bytes, m);
        }
        exercise(bytes);
    }

    #[test]
    fn random_headers_never_panic(version in prop_oneof![Just(2u32), Just(3), any::<u32>()], rest in prop::collection::vec(any::<u8>(), 0..512)) {
        let mut bytes = b"GGUF".to_vec();
        bytes.extend_from_slice(&version.to_le_bytes());
        bytes.extend_from_slice(&rest);
        exercise(bytes);
    }

    /// Truncation at any point of a valid file is an error (the files end with tensor data).
    #[test]
    fn truncated_files_are_errors(seed in 0usize..2, cut in any::<usize>()) {
        let bytes = &seeds()[seed];
        let cut = cut % bytes.len();
        let last_tensor_end = {
            let f = GgufFile::from_bytes(bytes.clone()).unwrap();
            f.tensors.iter().map(|t| f.data_offset() + t.offset + t.n_bytes as u64).max().unwrap()
        };
        let result = GgufFile::from_bytes(bytes[..cut].to_vec());
        prop_assert_eq!(result.is_err(), (cut as u64) < last_tensor_end);
    }
}
