//! Tiny random-weight models of each supported architecture, built by HF transformers
//! (fixtures/tiny, made by scripts/fixtures/tiny_models.py): ferrite's CPU paths against
//! transformers' float64 logits at every position, through prefill and through decode.

mod common;

use common::{diff, workspace_root};
use ferrite_cpu::{CpuExecutor, CpuPrecision};
use ferrite_model::{Executor, ExecutorOptions, FusionOptions, Model};
use std::sync::Arc;

/// The model (from `file` in fixtures/tiny: the GGUF or the HF folder), the token ids and
/// transformers' logits for every position.
fn fixture(arch: &str, file: &str) -> (Arc<Model>, Vec<u32>, Vec<Vec<f32>>) {
    let dir = workspace_root().join("fixtures/tiny");
    let model = Arc::new(Model::load(dir.join(file), FusionOptions::from_env()).unwrap());
    let json: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(dir.join(format!("{arch}.json"))).unwrap()).unwrap();
    let ids = json["ids"].as_array().unwrap().iter().map(|v| v.as_u64().unwrap() as u32).collect();
    let logits = json["logits"]
        .as_array()
        .unwrap()
        .iter()
        .map(|row| row.as_array().unwrap().iter().map(|v| v.as_f64().unwrap() as f32).collect())
        .collect();
    (model, ids, logits)
}

fn check(arch: &str, file: &str) {
    let (model, ids, reference) = fixture(arch, file);
    let opts = ExecutorOptions { max_batch: 4, context_len: 64, trace: false, progress: None };
    // Prefill in chunks of 4 (the last position's logits), then token by token (every position).
    let mut exec = CpuExecutor::new(Arc::clone(&model), CpuPrecision::Reference, opts.clone()).unwrap();
    exec.forward(&ids, 0).unwrap();
    let (max_abs, rel) = diff(reference.last().unwrap(), &exec.logits().unwrap());
    println!("{arch} ({file}) prefill: max |diff| {max_abs:.2e}, relative {rel:.2e}");
    assert!(rel < 1e-5, "{arch}: prefill logits differ from transformers: relative {rel}");
    let mut exec = CpuExecutor::new(model, CpuPrecision::Reference, opts).unwrap();
    for (pos, (&id, want)) in ids.iter().zip(&reference).enumerate() {
        exec.forward(&[id], pos).unwrap();
        let (_, rel) = diff(want, &exec.logits().unwrap());
        assert!(rel < 1e-5, "{arch}: decode logits at position {pos} differ: relative {rel}");
    }
}

#[test]
fn qwen3_matches_transformers() {
    check("qwen3", "qwen3.gguf");
    check("qwen3", "qwen3-hf");
}

#[test]
fn llama_matches_transformers() {
    check("llama", "llama.gguf");
    // From safetensors: the loader applies llama.cpp's Q/K permutation itself.
    check("llama", "llama-hf");
}

#[test]
fn broken_hf_folders_give_clear_errors() {
    let src = workspace_root().join("fixtures/tiny/qwen3-hf");
    let dir = std::env::temp_dir().join(format!("ferrite-hf-broken-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let err = |dir: &std::path::Path| match Model::load(dir, FusionOptions::ALL) {
        Ok(_) => panic!("{} loaded", dir.display()),
        Err(e) => e.to_string(),
    };
    let config = std::fs::read_to_string(src.join("config.json")).unwrap();
    std::fs::write(dir.join("config.json"), config.replace("\"qwen3\"", "\"mamba99\"")).unwrap();
    std::fs::copy(src.join("model.safetensors"), dir.join("model.safetensors")).unwrap();
    assert!(err(&dir).contains("mamba99"));
    std::fs::write(dir.join("config.json"), &config).unwrap();
    let weights = std::fs::read(src.join("model.safetensors")).unwrap();
    std::fs::write(dir.join("model.safetensors"), &weights[..weights.len() / 2]).unwrap();
    assert!(err(&dir).contains("safetensors"));
    std::fs::remove_file(dir.join("model.safetensors")).unwrap();
    assert!(err(&dir).contains("no model.safetensors"));
    std::fs::write(dir.join("config.json"), "{ not json").unwrap();
    assert!(err(&dir).contains("invalid JSON"));
    std::fs::remove_dir_all(&dir).unwrap();
}
