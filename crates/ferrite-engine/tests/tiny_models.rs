//! Tiny random-weight models of each supported architecture, built by HF transformers
//! (fixtures/tiny, made by scripts/fixtures/tiny_models.py): ferrite's CPU paths against
//! transformers' float64 logits at every position, through prefill and through decode.

mod common;

use common::{diff, workspace_root};
use ferrite_cpu::{CpuExecutor, CpuPrecision};
use ferrite_model::{Executor, ExecutorOptions, FusionOptions, Model};
use std::sync::Arc;

fn fixture(arch: &str) -> (Arc<Model>, Vec<u32>, Vec<Vec<f32>>) {
    let dir = workspace_root().join("fixtures/tiny");
    let model = Arc::new(Model::load(dir.join(format!("{arch}.gguf")), FusionOptions::from_env()).unwrap());
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

fn check(arch: &str) {
    let (model, ids, reference) = fixture(arch);
    let opts = ExecutorOptions { max_batch: 4, context_len: 64, trace: false, progress: None };
    // Prefill in chunks of 4 (the last position's logits), then token by token (every position).
    let mut exec = CpuExecutor::new(Arc::clone(&model), CpuPrecision::Reference, opts.clone()).unwrap();
    exec.forward(&ids, 0).unwrap();
    let (max_abs, rel) = diff(reference.last().unwrap(), &exec.logits().unwrap());
    println!("{arch} prefill: max |diff| {max_abs:.2e}, relative {rel:.2e}");
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
    check("qwen3");
}
