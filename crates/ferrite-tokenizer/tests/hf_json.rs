//! Tokenizers loaded from Hugging Face `tokenizer.json` folders against HF `tokenizers` itself
//! (fixtures made by scripts/fixtures/hf_tokenizer_fixtures.py): byte-level BPE with a split
//! regex (Llama 3 layout), SentencePiece-style BPE with byte fallback and a dummy prefix (Llama 2)
//! and without one (Gemma, in the tiny Gemma 3 model folder).

mod common;

use common::workspace_path;
use ferrite_tokenizer::{Message, Tokenizer, TokenizerModel};

fn cases(folder: &str) -> Vec<(String, Vec<u32>)> {
    let json: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(workspace_path("fixtures/tokenizer/hf-json.json")).unwrap()).unwrap();
    json[folder]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| (c["text"].as_str().unwrap().to_string(), c["ids"].as_array().unwrap().iter().map(|v| v.as_u64().unwrap() as u32).collect()))
        .collect()
}

fn check(folder: &str, path: &str, model: TokenizerModel) -> Tokenizer {
    let tok = Tokenizer::from_hf_dir(&workspace_path(path)).unwrap_or_else(|e| panic!("{path}: {e}"));
    assert_eq!(tok.model(), model);
    assert!(tok.warnings().is_empty(), "{path}: {:?}", tok.warnings());
    let cases = cases(folder);
    assert!(cases.len() > 10);
    for (text, want) in cases {
        let got = tok.encode(&text, true).unwrap();
        assert_eq!(got, want, "{folder}: {text:?}");
    }
    tok
}

#[test]
fn byte_level_tokenizer_json_matches_hf() {
    let tok = check("hf-bytelevel", "fixtures/tokenizer/hf-bytelevel", TokenizerModel::BytePairGpt2);
    assert_eq!(tok.decode(&tok.encode("naïve café 東京 🤖\n", false).unwrap()), "naïve café 東京 🤖\n");
    // The chat template comes from chat_template.jinja, BOS/EOS from tokenizer_config.json.
    let template = tok.chat_template().unwrap().expect("chat template");
    let prompt = template.apply(&[Message::new("user", "Hi")], true).unwrap();
    assert_eq!(prompt, "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n");
    assert!(tok.is_end_of_generation(tok.token_to_id("<|eot_id|>").unwrap()));
}

#[test]
fn sentencepiece_tokenizer_json_matches_hf() {
    let tok = check("hf-spm", "fixtures/tokenizer/hf-spm", TokenizerModel::SentencePiece);
    // Byte fallback for characters the vocabulary lacks; decoding joins the bytes again.
    let ids = tok.encode("東京", false).unwrap();
    assert!(ids.iter().any(|&id| tok.id_to_token(id).is_some_and(|t| t.starts_with("<0x"))));
    assert_eq!(tok.decode(&ids).trim_start(), "東京");
}

#[test]
fn gemma_layout_tokenizer_json_matches_hf() {
    let tok = check("gemma3-hf", "fixtures/tiny/gemma3-hf", TokenizerModel::SentencePiece);
    assert_eq!(tok.vocab_size(), 256);
    let template = tok.chat_template().unwrap().expect("chat template from tokenizer_config.json");
    let prompt = template.apply(&[Message::new("user", "Hi")], true).unwrap();
    assert_eq!(prompt, "<bos><start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\n");
    // The template writes BOS itself and add_bos is on: one BOS, not two.
    let bos = tok.bos_id().unwrap();
    assert_eq!(&tok.encode(&prompt, true).unwrap()[..2], [bos, bos]);
    let ids = tok.encode_chat(&prompt).unwrap();
    assert_eq!(ids[0], bos);
    assert_ne!(ids[1], bos);
    assert_eq!(tok.encode_chat("Hi").unwrap(), tok.encode("Hi", true).unwrap());
    assert!(tok.is_end_of_generation(tok.token_to_id("<end_of_turn>").unwrap()));
}

#[test]
fn missing_or_broken_tokenizer_json_is_a_clear_error() {
    let dir = std::env::temp_dir().join(format!("ferrite-hf-tok-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let err = |dir: &std::path::Path| Tokenizer::from_hf_dir(dir).err().expect("loaded").to_string();
    assert!(err(&dir).contains("no tokenizer.json"));
    std::fs::write(dir.join("tokenizer.json"), "{ broken").unwrap();
    assert!(err(&dir).contains("not valid JSON"));
    let good = std::fs::read_to_string(workspace_path("fixtures/tokenizer/hf-spm/tokenizer.json")).unwrap();
    std::fs::write(dir.join("tokenizer.json"), good.replace("\"byte_fallback\": true", "\"byte_fallback\": false").replace("\"type\": \"Prepend\"", "\"type\": \"Lowercase\"")).unwrap();
    assert!(err(&dir).contains("Lowercase"), "{}", err(&dir));
    std::fs::remove_dir_all(&dir).unwrap();
}
