//! Helpers shared by the engine's integration tests.
#![allow(dead_code)]

use ferrite_model::{FusionOptions, Model};
use std::path::PathBuf;
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
