//! Bad or inconsistent metadata gives an error that names the problem, never a panic.

use ferrite_gguf::{Metadata, Value};
use ferrite_tokenizer::{ChatTemplate, Tokenizer, TokenizerError};

fn strings(items: &[&str]) -> Value {
    Value::Array(items.iter().map(|s| Value::String(s.to_string())).collect())
}

/// A small valid byte-level BPE vocabulary: "a", "b", "ab" and the special "<|end|>".
fn bpe_metadata() -> Metadata {
    let mut meta = Metadata::new();
    meta.insert("tokenizer.ggml.model", Value::String("gpt2".into()));
    meta.insert("tokenizer.ggml.pre", Value::String("gpt-2".into()));
    meta.insert(
        "tokenizer.ggml.tokens",
        strings(&["a", "b", "ab", "<|end|>"]),
    );
    meta.insert(
        "tokenizer.ggml.token_type",
        Value::Array([1, 1, 1, 3].map(Value::I32).to_vec()),
    );
    meta.insert("tokenizer.ggml.merges", strings(&["a b"]));
    meta.insert("tokenizer.ggml.eos_token_id", Value::U32(3));
    meta
}

fn error_of(meta: &Metadata) -> String {
    match Tokenizer::from_gguf(meta) {
        Ok(_) => panic!("bad metadata was accepted"),
        Err(e) => e.to_string(),
    }
}

fn assert_mentions(message: &str, parts: &[&str]) {
    for part in parts {
        assert!(
            message.contains(part),
            "error {message:?} should mention {part:?}"
        );
    }
}

#[test]
fn the_valid_base_vocabulary_works() {
    let tok = Tokenizer::from_gguf(&bpe_metadata()).unwrap();
    assert_eq!(tok.encode("abab<|end|>a", false).unwrap(), [2, 2, 3, 0]);
    assert!(tok.is_end_of_generation(3));
    assert!(tok.warnings().is_empty());
}

#[test]
fn missing_or_mistyped_keys() {
    let mut meta = bpe_metadata();
    meta.insert("tokenizer.ggml.tokens", Value::U32(5));
    assert_mentions(&error_of(&meta), &["tokenizer.ggml.tokens"]);

    let mut meta = Metadata::new();
    meta.insert("tokenizer.ggml.model", Value::String("gpt2".into()));
    assert_mentions(&error_of(&meta), &["tokenizer.ggml.tokens", "missing"]);

    assert_mentions(&error_of(&Metadata::new()), &["tokenizer.ggml.model"]);

    let mut meta = bpe_metadata();
    meta.insert("tokenizer.ggml.add_bos_token", Value::String("yes".into()));
    assert_mentions(&error_of(&meta), &["tokenizer.ggml.add_bos_token"]);
}

#[test]
fn unsupported_model_and_empty_vocabulary() {
    let mut meta = bpe_metadata();
    meta.insert("tokenizer.ggml.model", Value::String("bert".into()));
    assert_mentions(&error_of(&meta), &["bert", "not supported"]);

    let mut meta = bpe_metadata();
    meta.insert("tokenizer.ggml.tokens", Value::Array(Vec::new()));
    assert_mentions(&error_of(&meta), &["empty"]);
}

#[test]
fn merges_must_refer_to_known_tokens() {
    for (merge, expected) in [
        ("a c", "`c` is not in the vocabulary"),
        ("b a", "merged token is not in the vocabulary"),
        ("ab", "two tokens separated by a space"),
    ] {
        let mut meta = bpe_metadata();
        meta.insert("tokenizer.ggml.merges", strings(&["a b", merge]));
        assert_mentions(&error_of(&meta), &["merge #1", merge, expected]);
    }
    let mut meta = bpe_metadata();
    meta.insert("tokenizer.ggml.merges", Value::Array(Vec::new()));
    assert_mentions(&error_of(&meta), &["merges"]);
}

#[test]
fn special_ids_must_be_in_range() {
    for key in [
        "tokenizer.ggml.bos_token_id",
        "tokenizer.ggml.eos_token_id",
        "tokenizer.ggml.unknown_token_id",
        "tokenizer.ggml.padding_token_id",
        "tokenizer.ggml.eot_token_id",
    ] {
        let mut meta = bpe_metadata();
        meta.insert(key, Value::U32(4));
        assert_mentions(&error_of(&meta), &[key, "4", "4 tokens"]);
    }
    let mut meta = bpe_metadata();
    meta.insert("tokenizer.ggml.bos_token_id", Value::I32(-1));
    assert_mentions(&error_of(&meta), &["tokenizer.ggml.bos_token_id"]);
}

#[test]
fn add_flags_need_their_token() {
    let mut meta = bpe_metadata();
    meta.insert("tokenizer.ggml.add_bos_token", Value::Bool(true));
    assert_mentions(&error_of(&meta), &["add_bos_token", "bos_token_id"]);
}

#[test]
fn per_token_arrays_must_match_the_vocabulary() {
    let mut meta = bpe_metadata();
    meta.insert(
        "tokenizer.ggml.token_type",
        Value::Array(vec![Value::I32(1)]),
    );
    assert_mentions(
        &error_of(&meta),
        &["tokenizer.ggml.token_type", "1 entries", "4 tokens"],
    );

    let mut meta = bpe_metadata();
    meta.insert(
        "tokenizer.ggml.token_type",
        Value::Array([1, 1, 9, 3].map(Value::I32).to_vec()),
    );
    assert_mentions(&error_of(&meta), &["token_type[2] = 9"]);

    let mut meta = bpe_metadata();
    meta.insert("tokenizer.ggml.model", Value::String("llama".into()));
    meta.insert("tokenizer.ggml.bos_token_id", Value::U32(3));
    assert_mentions(&error_of(&meta), &["tokenizer.ggml.scores", "0 entries"]);
    meta.insert(
        "tokenizer.ggml.scores",
        Value::Array(vec![Value::F32(0.0); 5]),
    );
    assert_mentions(
        &error_of(&meta),
        &["tokenizer.ggml.scores", "5 entries", "4 tokens"],
    );
}

#[test]
fn an_unknown_pre_tokenizer_is_a_warning_not_an_error() {
    let mut meta = bpe_metadata();
    meta.insert("tokenizer.ggml.pre", Value::String("brand-new".into()));
    let tok = Tokenizer::from_gguf(&meta).unwrap();
    assert_eq!(tok.warnings().len(), 1);
    assert_mentions(&tok.warnings()[0], &["brand-new"]);
    assert_eq!(tok.encode("ab", false).unwrap(), [2]);
}

#[test]
fn spm_without_byte_tokens_or_unknown_cannot_encode_strange_text() {
    let mut meta = Metadata::new();
    meta.insert("tokenizer.ggml.model", Value::String("llama".into()));
    meta.insert("tokenizer.ggml.tokens", strings(&["<s>", "▁", "a"]));
    meta.insert(
        "tokenizer.ggml.scores",
        Value::Array([0.0, -1.0, -2.0].map(Value::F32).to_vec()),
    );
    meta.insert(
        "tokenizer.ggml.token_type",
        Value::Array([3, 1, 1].map(Value::I32).to_vec()),
    );
    meta.insert("tokenizer.ggml.bos_token_id", Value::U32(0));
    let tok = Tokenizer::from_gguf(&meta).unwrap();
    assert_eq!(tok.encode("a a", true).unwrap(), [0, 1, 2, 1, 2]);
    let err = tok.encode("ä", false).unwrap_err();
    assert!(
        matches!(err, TokenizerError::Unencodable { byte: 0xC3 }),
        "{err}"
    );

    // With an unknown token, each unencodable character becomes one unknown token.
    meta.insert("tokenizer.ggml.unknown_token_id", Value::U32(0));
    let tok = Tokenizer::from_gguf(&meta).unwrap();
    assert_eq!(tok.encode("äa", false).unwrap(), [1, 0, 2]);
}

#[test]
fn chat_template_from_metadata() {
    let mut meta = bpe_metadata();
    assert!(ChatTemplate::from_gguf(&meta).unwrap().is_none());

    meta.insert(
        "tokenizer.chat_template",
        Value::String("{{ eos_token }}|{{ bos_token }}".into()),
    );
    let template = ChatTemplate::from_gguf(&meta).unwrap().unwrap();
    assert_eq!(template.apply(&[], false).unwrap(), "<|end|>|");

    meta.insert("tokenizer.chat_template", Value::String("{% if %}".into()));
    assert_mentions(
        &ChatTemplate::from_gguf(&meta).unwrap_err().to_string(),
        &["chat template"],
    );

    meta.insert("tokenizer.chat_template", Value::String("ok".into()));
    meta.insert("tokenizer.ggml.eos_token_id", Value::U32(99));
    assert_mentions(
        &ChatTemplate::from_gguf(&meta).unwrap_err().to_string(),
        &["eos_token_id", "99"],
    );
}

#[test]
fn out_of_range_ids_decode_to_replacement_characters() {
    let tok = Tokenizer::from_gguf(&bpe_metadata()).unwrap();
    assert_eq!(tok.decode(&[0, 4, u32::MAX, 1]), "a\u{FFFD}\u{FFFD}b");
    assert_eq!(tok.token_bytes(4), "\u{FFFD}".as_bytes());
    assert_eq!(tok.id_to_token(4), None);
}
