//! The real Gemma 3 270M (Q4_K_M GGUF, fetched by `scripts/fetch_gemma3.py` into models/) against
//! HF transformers, which loads the same GGUF, dequantizes it and runs in float64
//! (fixtures/logits/gemma3-270m, made by scripts/fixtures/gemma3_logits.py): the tokenizer, the
//! fp32 CPU reference path and the quantized CPU path. Skipped with a message when the model is
//! not there. The `long` case (631 tokens) is longer than the 512-token sliding window.

mod common;

// Skip notes go straight to stderr, past the test harness capture, so CI logs show them.
use std::io::Write as _;

use common::{diff, follow_greedy, logits_cases, workspace_root, LogitsCase};
use ferrite_cpu::{CpuExecutor, CpuPrecision};
use ferrite_engine::sampling::argmax;
use ferrite_engine::Session;
use ferrite_model::{ExecutorOptions, FusionOptions, Model};
use ferrite_tokenizer::Tokenizer;
use std::sync::Arc;

fn model_or_skip() -> Option<Arc<Model>> {
    let path = workspace_root().join("models/gemma-3-270m-q4_k_m.gguf");
    if !path.is_file() {
        let _ = writeln!(std::io::stderr(), "skipped: {} is missing (python3 scripts/fetch_gemma3.py fetches it)", path.display());
        return None;
    }
    Some(Arc::new(Model::load(&path, FusionOptions::from_env()).expect("load Gemma 3 270M")))
}

fn cases() -> Vec<LogitsCase> {
    logits_cases(&workspace_root().join("fixtures/logits/gemma3-270m"))
}

fn session(model: Arc<Model>, precision: CpuPrecision) -> Session {
    let opts = ExecutorOptions { max_batch: 128, context_len: 1024, trace: false, progress: None };
    Session::new(Box::new(CpuExecutor::new(model, precision, opts).unwrap()))
}

#[test]
fn gemma3_tokenizer_matches_transformers() {
    let Some(model) = model_or_skip() else { return };
    let tokenizer = Tokenizer::from_gguf(&model.file.metadata).unwrap();
    for c in cases() {
        assert_eq!(tokenizer.encode(&c.text, true).unwrap(), c.ids, "{}: token ids differ from transformers'", c.name);
    }
}

#[test]
fn gemma3_fp32_reference_matches_transformers() {
    let Some(model) = model_or_skip() else { return };
    let mut s = session(model, CpuPrecision::Reference);
    for c in cases() {
        s.reset();
        s.prefill(&c.ids).unwrap();
        let logits = s.executor().logits().unwrap();
        let (max_abs, rel) = diff(&c.logits, &logits);
        let agreed = follow_greedy(&mut s, &c, 1e-3);
        println!("{} ({} tokens): max |diff| {max_abs:.2e}, relative {rel:.2e}, {agreed}/{} greedy tokens agree", c.name, c.ids.len(), c.greedy.len());
        assert!(max_abs < 1e-2 && rel < 1e-4, "{}: logits differ from transformers: max {max_abs}, rel {rel}", c.name);
        assert_eq!(agreed, c.greedy.len(), "{}: greedy tokens differ", c.name);
    }
}

#[test]
fn gemma3_quantized_cpu_path_stays_close_to_transformers() {
    // 8-bit activations perturb the logits slightly; the top token and the overall shape must hold.
    let Some(model) = model_or_skip() else { return };
    let mut s = session(model, CpuPrecision::Quantized);
    for c in cases() {
        s.reset();
        s.prefill(&c.ids).unwrap();
        let logits = s.executor().logits().unwrap();
        let (max_abs, rel) = diff(&c.logits, &logits);
        let agreed = follow_greedy(&mut s, &c, 1.0);
        println!("{}: max |diff| {max_abs:.2e}, relative {rel:.2e}, {agreed}/{} greedy tokens agree", c.name, c.greedy.len());
        assert!(rel < 8e-2, "{}: relative error {rel} too large", c.name);
        assert_eq!(argmax(&logits), c.greedy[0], "{}: different top token", c.name);
    }
}
