//! Helpers shared by the engine's integration tests.
#![allow(dead_code)]

use ferrite_engine::sampling::argmax;
use ferrite_engine::Session;
use ferrite_model::{FusionOptions, Model};
use std::path::{Path, PathBuf};
use std::sync::Arc;

pub fn workspace_root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// The real SmolLM2-135M model; the test fails with instructions if it was not fetched.
pub fn smollm2(fusion: FusionOptions) -> Arc<Model> {
    let path = workspace_root().join("models/SmolLM2-135M-Instruct.Q4_1.gguf");
    assert!(path.is_file(), "{} is missing: run scripts/fetch-model.sh first", path.display());
    Arc::new(Model::load(&path, fusion).expect("load SmolLM2"))
}

pub fn read_f32(path: &std::path::Path) -> Vec<f32> {
    let bytes = std::fs::read(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    bytes.chunks_exact(4).map(|c| f32::from_le_bytes(c.try_into().unwrap())).collect()
}

/// (max |a-b|, ||a-b|| / ||a||)
pub fn diff(a: &[f32], b: &[f32]) -> (f32, f64) {
    assert_eq!(a.len(), b.len());
    let max = a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0f32, f32::max);
    let num: f64 = a.iter().zip(b).map(|(x, y)| ((x - y) as f64).powi(2)).sum();
    let den: f64 = a.iter().map(|x| (*x as f64).powi(2)).sum();
    (max, (num / den).sqrt())
}

/// A prompt with HF transformers' logits for its last position and its greedy continuation
/// (`fixtures/logits/**/cases.json` plus `<name>.logits.f32`).
pub struct LogitsCase {
    pub name: String,
    pub text: String,
    pub ids: Vec<u32>,
    pub greedy: Vec<u32>,
    pub logits: Vec<f32>,
}

/// The cases of a transformers logits fixture folder.
pub fn logits_cases(dir: &Path) -> Vec<LogitsCase> {
    let json: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(dir.join("cases.json")).unwrap()).unwrap();
    let ids = |v: &serde_json::Value| v.as_array().unwrap().iter().map(|x| x.as_u64().unwrap() as u32).collect::<Vec<_>>();
    json["cases"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| {
            let name = c["name"].as_str().unwrap().to_string();
            LogitsCase {
                logits: read_f32(&dir.join(format!("{name}.logits.f32"))),
                text: c["text"].as_str().unwrap().to_string(),
                ids: ids(&c["ids"]),
                greedy: ids(&c["greedy"]),
                name,
            }
        })
        .collect()
}

/// Follow the reference's greedy tokens step by step. Where our argmax differs, the reference's
/// token must be within `tie` of ours in our logits (summation order differs between the
/// engines); the comparison ends there. Returns how many steps agreed.
pub fn follow_greedy(s: &mut Session, case: &LogitsCase, tie: f32) -> usize {
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
