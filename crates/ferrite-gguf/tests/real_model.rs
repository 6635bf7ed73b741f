//! Checks against the real SmolLM2-135M-Instruct Q4_1 file (fetched by scripts/fetch-model.sh).

use ferrite_gguf::{dequantize_tensor, GgmlType, GgufFile};
use std::path::PathBuf;

fn model_path() -> PathBuf {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../models/SmolLM2-135M-Instruct.Q4_1.gguf");
    assert!(path.exists(), "{} is missing: run scripts/fetch-model.sh first", path.display());
    path
}

#[test]
fn opens_smollm2() {
    let file = GgufFile::open(model_path()).unwrap();
    assert_eq!(file.version, 3);
    assert_eq!(file.tensors.len(), 272);
    assert_eq!(file.architecture().unwrap(), "llama");
    assert_eq!(file.alignment, 32);
    let md = &file.metadata;
    assert_eq!(md.len(), 33);
    assert_eq!(md.str_array("tokenizer.ggml.tokens").unwrap().len(), 49152);
    assert_eq!(md.i32_array("tokenizer.ggml.token_type").unwrap().len(), 49152);
    assert_eq!(md.str_array("tokenizer.ggml.merges").unwrap().len(), 48900);
    assert_eq!(md.u32("llama.block_count").unwrap(), 30);
    assert_eq!(md.u32("llama.embedding_length").unwrap(), 576);
    assert_eq!(md.f32("llama.rope.freq_base").unwrap(), 100000.0);
    assert!(!md.bool("tokenizer.ggml.add_bos_token").unwrap());
    assert_eq!(md.str("tokenizer.ggml.model").unwrap(), "gpt2");

    let embd = file.tensor("token_embd.weight").unwrap();
    assert_eq!(embd.dtype, GgmlType::Q8_0);
    assert_eq!(embd.shape, vec![576, 49152]);
    assert_eq!((embd.row_len(), embd.n_rows()), (576, 49152));
    assert_eq!(embd.n_bytes, 49152 * 576 / 32 * 34);
    let counts = |dtype| file.tensors.iter().filter(|t| t.dtype == dtype).count();
    assert_eq!(
        (counts(GgmlType::Q4_1), counts(GgmlType::F32), counts(GgmlType::Q8_0)),
        (210, 61, 1)
    );
    // Tensors are packed back to back, each at an aligned offset.
    let end = file
        .tensors
        .iter()
        .map(|t| file.data_offset() + t.offset + t.n_bytes as u64)
        .max()
        .unwrap();
    assert!(end <= file.file_size() as u64 && end + 32 > file.file_size() as u64);
}

#[test]
fn norm_weights_dequantize_to_plausible_values() {
    let file = GgufFile::open(model_path()).unwrap();
    let norm = file.tensor("blk.0.attn_norm.weight").unwrap();
    let w = dequantize_tensor(&file, norm).unwrap();
    assert_eq!(w.len(), 576);
    assert!(w.iter().all(|v| v.is_finite()));
    let q = file.tensor("blk.0.attn_q.weight").unwrap();
    let w = dequantize_tensor(&file, q).unwrap();
    assert_eq!(w.len(), 576 * 576);
    let mean_abs = w.iter().map(|v| v.abs()).sum::<f32>() / w.len() as f32;
    assert!(mean_abs > 1e-3 && mean_abs < 1.0, "{mean_abs}");
}
