//! Loading the models and known-answer fixtures the integration tests share.
#![allow(dead_code)] // each test binary uses a different subset

use ferrite_gguf::GgufFile;
use ferrite_tokenizer::Tokenizer;
use serde::Deserialize;
use std::path::PathBuf;

pub fn workspace_path(relative: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../..")
        .join(relative)
}

pub const SMOLLM2_PATH: &str = "models/SmolLM2-135M-Instruct.Q4_1.gguf";
pub const SPM_TINY_PATH: &str = "fixtures/tokenizer/spm-tiny.gguf";

pub fn open_gguf(relative: &str) -> GgufFile {
    let path = workspace_path(relative);
    assert!(
        path.exists(),
        "{} is missing: run scripts/fetch-model.sh (model) or scripts/fixtures/make_tokenizer_fixtures.py (fixtures)",
        path.display()
    );
    GgufFile::open(&path).unwrap_or_else(|e| panic!("cannot open {}: {e}", path.display()))
}

pub fn tokenizer(relative: &str) -> Tokenizer {
    let file = open_gguf(relative);
    let tokenizer =
        Tokenizer::from_gguf(&file.metadata).unwrap_or_else(|e| panic!("{relative}: {e}"));
    assert!(
        tokenizer.warnings().is_empty(),
        "{relative}: {:?}",
        tokenizer.warnings()
    );
    tokenizer
}

#[derive(Deserialize)]
pub struct EncodeCase {
    pub text: String,
    pub ids: Vec<u32>,
}

#[derive(Deserialize)]
pub struct ChatCase {
    pub messages: Vec<ChatMessage>,
    pub add_generation_prompt: bool,
    pub expected: String,
}

#[derive(Deserialize)]
pub struct ChatMessage {
    pub role: String,
    pub content: String,
}

#[derive(Deserialize)]
pub struct DecodeCase {
    pub ids: Vec<u32>,
    pub text: String,
}

#[derive(Deserialize)]
pub struct Fixture {
    pub encode_add_special_false: Vec<EncodeCase>,
    pub encode_add_special_true: Vec<EncodeCase>,
    #[serde(default)]
    pub chat: Vec<ChatCase>,
    #[serde(default)]
    pub decode: Vec<DecodeCase>,
}

pub fn fixture(name: &str) -> Fixture {
    let path = workspace_path(&format!("fixtures/tokenizer/{name}"));
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// Every encode case of the fixture (without and with special tokens) must give exactly the
/// reference ids; all mismatches are reported together.
pub fn assert_encodes_like_fixture(tok: &Tokenizer, fixture: &Fixture) {
    let mut failures = Vec::new();
    for (case, add_special) in fixture
        .encode_add_special_false
        .iter()
        .map(|c| (c, false))
        .chain(fixture.encode_add_special_true.iter().map(|c| (c, true)))
    {
        let ids = tok.encode(&case.text, add_special).unwrap();
        if ids != case.ids {
            failures.push(format!(
                "{:?} (add_special {add_special})\n  got      {ids:?}\n  expected {:?}",
                case.text, case.ids
            ));
        }
    }
    assert!(failures.is_empty(), "{} mismatches:\n{}", failures.len(), failures.join("\n"));
}
