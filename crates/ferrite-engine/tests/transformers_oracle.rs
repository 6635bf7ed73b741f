//! ferrite's CPU paths against reference logits and greedy tokens computed by HF transformers
//! (fp32) for the real SmolLM2-135M-Instruct GGUF (fixtures/logits, made by
//! scripts/fixtures/transformers_logits.py).

mod common;

use common::{diff, read_f32, smollm2, workspace_root};
use ferrite_cpu::{CpuExecutor, CpuPrecision};
use ferrite_engine::sampling::argmax;
use ferrite_engine::Session;
use ferrite_model::{ExecutorOptions, FusionOptions};

struct Case {
    name: String,
    ids: Vec<u32>,
    greedy: Vec<u32>,
    logits: Vec<f32>,
}

fn cases() -> Vec<Case> {
    let dir = workspace_root().join("fixtures/logits");
    let json: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(dir.join("cases.json")).unwrap()).unwrap();
    let ids = |v: &serde_json::Value| v.as_array().unwrap().iter().map(|x| x.as_u64().unwrap() as u32).collect::<Vec<_>>();
    json["cases"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| {
            let name = c["name"].as_str().unwrap().to_string();
            Case { logits: read_f32(&dir.join(format!("{name}.logits.f32"))), ids: ids(&c["ids"]), greedy: ids(&c["greedy"]), name }
        })
        .collect()
}

fn session(precision: CpuPrecision) -> Session {
    let model = smollm2(FusionOptions::ALL);
    let opts = ExecutorOptions { max_batch: 64, context_len: 256, trace: false, progress: None };
    Session::new(Box::new(CpuExecutor::new(model, precision, opts).unwrap()))
}

/// Follow the reference's greedy tokens step by step. Where our argmax differs, the reference's
/// token must be a near-tie in our logits (fp32 summation order differs between the engines);
/// the comparison ends there. Returns how many steps agreed.
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
fn fp32_reference_matches_transformers() {
    let mut s = session(CpuPrecision::Reference);
    for c in cases() {
        s.reset();
        s.prefill(&c.ids).unwrap();
        let logits = s.executor().logits().unwrap();
        let (max_abs, rel) = diff(&c.logits, &logits);
        println!("{}: max |diff| {max_abs:.2e}, relative {rel:.2e}", c.name);
        assert!(max_abs < 2e-3 && rel < 1e-4, "{}: logits differ from transformers: max {max_abs}, rel {rel}", c.name);
        let agreed = follow_greedy(&mut s, &c, 1e-3);
        println!("{}: {agreed}/{} greedy tokens agree", c.name, c.greedy.len());
        assert!(agreed >= 16, "{}: only {agreed} greedy tokens agree", c.name);
    }
}

#[test]
fn quantized_cpu_path_stays_close_to_transformers() {
    // 8-bit activations perturb the logits slightly; the top token and the overall shape must hold.
    let mut s = session(CpuPrecision::Quantized);
    let mut results = Vec::new();
    for c in cases() {
        s.reset();
        s.prefill(&c.ids).unwrap();
        let logits = s.executor().logits().unwrap();
        let (max_abs, rel) = diff(&c.logits, &logits);
        let agreed = follow_greedy(&mut s, &c, 0.5);
        println!("{}: max |diff| {max_abs:.2e}, relative {rel:.2e}, {agreed} greedy tokens agree", c.name);
        results.push((c.name.clone(), rel, argmax(&logits) == c.greedy[0]));
    }
    for (name, rel, top) in results {
        assert!(rel < 8e-2, "{name}: relative error {rel} too large");
        assert!(top, "{name}: different top token");
    }
}
