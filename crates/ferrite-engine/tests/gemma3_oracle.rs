//! The real Gemma 3 270M (Q4_K_M GGUF, fetched by `scripts/fetch_gemma3.py` into models/) against
//! HF transformers, which loads the same GGUF, dequantizes it and runs in float64
//! (fixtures/logits/gemma3-270m, made by scripts/fixtures/gemma3_logits.py): the tokenizer, the
//! fp32 CPU reference path and the quantized CPU path. Skipped with a message when the model is
//! not there. The `long` case (631 tokens) is longer than the 512-token sliding window.

mod common;

// Skip notes go straight to stderr, past the test harness capture, so CI logs show them.
use std::io::Write as _;

use common::{diff, read_f32, workspace_root};
use ferrite_cpu::{CpuExecutor, CpuPrecision};
use ferrite_engine::sampling::argmax;
use ferrite_engine::Session;
use ferrite_model::{ExecutorOptions, FusionOptions, Model};
use ferrite_tokenizer::Tokenizer;
use std::sync::Arc;

struct Case {
    name: String,
    text: String,
    ids: Vec<u32>,
    greedy: Vec<u32>,
    logits: Vec<f32>,
}

fn model_or_skip() -> Option<Arc<Model>> {
    let path = workspace_root().join("models/gemma-3-270m-q4_k_m.gguf");
    if !path.is_file() {
        let _ = writeln!(std::io::stderr(), "skipped: {} is missing (python3 scripts/fetch_gemma3.py fetches it)", path.display());
        return None;
    }
    Some(Arc::new(Model::load(&path, FusionOptions::from_env()).expect("load Gemma 3 270M")))
}

fn cases() -> Vec<Case> {
    let dir = workspace_root().join("fixtures/logits/gemma3-270m");
    let json: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(dir.join("cases.json")).unwrap()).unwrap();
    let ids = |v: &serde_json::Value| v.as_array().unwrap().iter().map(|x| x.as_u64().unwrap() as u32).collect::<Vec<_>>();
    json["cases"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| {
            let name = c["name"].as_str().unwrap().to_string();
            Case {
                logits: read_f32(&dir.join(format!("{name}.logits.f32"))),
                text: c["text"].as_str().unwrap().to_string(),
                ids: ids(&c["ids"]),
                greedy: ids(&c["greedy"]),
                name,
            }
        })
        .collect()
}

fn session(model: Arc<Model>, precision: CpuPrecision) -> Session {
    let opts = ExecutorOptions { max_batch: 128, context_len: 1024, trace: false, progress: None };
    Session::new(Box::new(CpuExecutor::new(model, precision, opts).unwrap()))
}

/// Follow the reference's greedy tokens; where our argmax differs the reference's token must be
/// within `tie` of ours. Returns how many steps agreed.
fn follow_greedy(s: &mut Session, case: &Case, tie: f32) -> usize {
    s.reset();
    s.prefill(&case.ids).unwrap();
    for (i, &want) in case.greedy.iter().enumerate() {
        let logits = s.executor().logits().unwrap();
        let got = argmax(&logits);
        if got != want {
            let gap = logits[got as usize] - logits[want as usize];
            assert!(gap < tie, "{}: step {i}: we pick {got}, transformers {want}; logit gap {gap} is not a tie", case.name);
            return i;
        }
        s.step(want).unwrap();
    }
    case.greedy.len()
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
