//! SmolLM2-135M-Instruct (byte-level BPE, `smollm` pre-tokenizer) against HF `tokenizers`.

mod common;

use common::{assert_encodes_like_fixture, fixture, tokenizer, SMOLLM2_PATH};
use ferrite_tokenizer::{ChatTemplate, Message, Tokenizer, TokenizerModel};
use proptest::prelude::*;
use std::sync::OnceLock;

fn smollm2() -> &'static Tokenizer {
    static TOKENIZER: OnceLock<Tokenizer> = OnceLock::new();
    TOKENIZER.get_or_init(|| tokenizer(SMOLLM2_PATH))
}

#[test]
fn encodings_match_hf_tokenizers() {
    let tok = smollm2();
    let fixture = fixture("smollm2.json");
    assert!(fixture.encode_add_special_false.len() >= 30);
    assert_encodes_like_fixture(tok, &fixture);
}

#[test]
fn decoding_the_reference_ids_gives_the_text_back() {
    let tok = smollm2();
    let cases = fixture("smollm2.json").encode_add_special_false;
    let round_trips = |text: &str| text.bytes().all(|b| encodable_bytes()[usize::from(b)]);
    assert!(
        cases.iter().any(|case| !round_trips(&case.text)),
        "the fixture should cover dropped bytes"
    );
    for case in cases.into_iter().filter(|case| round_trips(&case.text)) {
        assert_eq!(tok.decode(&case.ids), case.text);
        let mut stream = tok.stream_decoder();
        let mut streamed: String = case.ids.iter().map(|&id| stream.push(id)).collect();
        streamed.push_str(&stream.finish());
        assert_eq!(streamed, case.text);
    }
}

#[test]
fn metadata_is_read() {
    let tok = smollm2();
    assert_eq!(tok.model(), TokenizerModel::BytePairGpt2);
    assert_eq!(tok.vocab_size(), 49152);
    assert_eq!(tok.bos_id(), Some(1));
    assert_eq!(tok.eos_id(), Some(2));
    assert_eq!(tok.token_to_id("<|im_end|>"), Some(2));
    assert_eq!(tok.token_to_id("Ġthe"), Some(260));
    assert_eq!(tok.token_to_id("no such token"), None);
    assert_eq!(tok.token_bytes(tok.token_to_id("Ġ").unwrap()), b" ");
    assert_eq!(tok.token_bytes(tok.token_to_id("Ċ").unwrap()), b"\n");
    assert_eq!(tok.token_bytes(1), b"<|im_start|>");
    // add_bos_token is false in this file: add_special adds nothing.
    assert_eq!(
        tok.encode("Hello", true).unwrap(),
        tok.encode("Hello", false).unwrap()
    );
}

#[test]
fn end_of_generation_tokens() {
    let tok = smollm2();
    assert!(tok.is_end_of_generation(2)); // <|im_end|>, also EOS
    assert!(tok.is_end_of_generation(0)); // <|endoftext|>
    assert!(!tok.is_end_of_generation(1)); // <|im_start|>
    assert!(!tok.is_end_of_generation(tok.token_to_id("Ġthe").unwrap()));
    assert!(!tok.is_end_of_generation(u32::MAX));
}

#[test]
fn chat_template_matches_transformers() {
    let file = common::open_gguf(SMOLLM2_PATH);
    let template = ChatTemplate::from_gguf(&file.metadata)
        .unwrap()
        .expect("SmolLM2 has a chat template");
    let from_tokenizer = smollm2()
        .chat_template()
        .unwrap()
        .expect("template through the tokenizer");
    let chats = fixture("smollm2.json").chat;
    assert_eq!(chats.len(), 3);
    for case in chats {
        let messages: Vec<Message> = case
            .messages
            .iter()
            .map(|m| Message::new(&m.role, &m.content))
            .collect();
        let rendered = template
            .apply(&messages, case.add_generation_prompt)
            .unwrap();
        assert_eq!(rendered, case.expected);
        assert_eq!(
            from_tokenizer
                .apply(&messages, case.add_generation_prompt)
                .unwrap(),
            case.expected
        );
    }
}

#[test]
fn a_rendered_chat_encodes_with_single_special_tokens() {
    let tok = smollm2();
    let ids = tok
        .encode(
            "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n",
            false,
        )
        .unwrap();
    assert_eq!(ids.iter().filter(|&&id| id == 1).count(), 2);
    assert_eq!(ids.iter().filter(|&&id| id == 2).count(), 1);
    assert_eq!(ids[0], 1);
}

#[test]
fn very_long_words_encode_and_round_trip() {
    let tok = smollm2();
    let word = "abcdefghij".repeat(5_000);
    let ids = tok.encode(&word, false).unwrap();
    assert!(
        ids.len() < word.len() / 2,
        "merges should compress, got {} ids",
        ids.len()
    );
    assert_eq!(tok.decode(&ids), word);
    let spaces = " ".repeat(10_000) + "x";
    assert_eq!(tok.decode(&tok.encode(&spaces, false).unwrap()), spaces);
}

/// The id of the token standing for one byte, if the vocabulary has one.
fn byte_token(tok: &Tokenizer, byte: u8) -> Option<u32> {
    (0..tok.vocab_size() as u32).find(|&id| tok.token_bytes(id) == [byte])
}

#[test]
fn stream_decoder_holds_back_split_characters() {
    let tok = smollm2();
    let emoji: Vec<u32> = "😀".bytes().map(|b| byte_token(tok, b).unwrap()).collect();
    let mut stream = tok.stream_decoder();
    assert_eq!(stream.push(tok.token_to_id("a").unwrap()), "a");
    assert_eq!(stream.push(emoji[0]), "");
    assert_eq!(stream.push(emoji[1]), "");
    assert_eq!(stream.push(emoji[2]), "");
    assert_eq!(stream.push(emoji[3]), "😀");
    // A byte that cannot continue the pending character is replaced at once.
    assert_eq!(stream.push(emoji[0]), "");
    assert_eq!(stream.push(tok.token_to_id("a").unwrap()), "\u{FFFD}a");
    // An incomplete character at the end comes out as one replacement character.
    assert_eq!(stream.push(emoji[0]), "");
    assert_eq!(stream.push(emoji[1]), "");
    assert_eq!(stream.finish(), "\u{FFFD}");
}

/// Bytes SmolLM2's vocabulary has a token for (it lacks a few, e.g. 0x04 and 0xF1).
fn encodable_bytes() -> &'static [bool; 256] {
    static ENCODABLE: OnceLock<[bool; 256]> = OnceLock::new();
    ENCODABLE.get_or_init(|| std::array::from_fn(|b| byte_token(smollm2(), b as u8).is_some()))
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    #[test]
    fn decode_inverts_encode(text in "\\PC*|[ \\t\\n\\r a-z0-9<|>_]*|.*") {
        prop_assume!(text.bytes().all(|b| encodable_bytes()[usize::from(b)]));
        let tok = smollm2();
        let ids = tok.encode(&text, false).unwrap();
        prop_assert_eq!(tok.decode(&ids), text);
    }

    #[test]
    fn streaming_equals_decoding(ids in proptest::collection::vec(0u32..49_200, 0..64)) {
        let tok = smollm2();
        let mut stream = tok.stream_decoder();
        let mut streamed: String = ids.iter().map(|&id| stream.push(id)).collect();
        streamed.push_str(&stream.finish());
        prop_assert_eq!(streamed, tok.decode(&ids));
    }
}
