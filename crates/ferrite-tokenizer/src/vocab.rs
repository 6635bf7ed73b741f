//! The vocabulary: token texts, types, the text -> id index and every token's decoded bytes.

use crate::byte_level::ByteAlphabet;
use crate::spec::{TokenType, TokenizerModel};
use crate::TokenizerError;
use std::collections::HashMap;

/// What SentencePiece writes for a space.
pub(crate) const SPM_SPACE: char = '\u{2581}';

/// Replacement shown for ids outside the vocabulary (U+FFFD in UTF-8).
const INVALID_ID_BYTES: &[u8] = "\u{FFFD}".as_bytes();

pub(crate) struct Vocab {
    texts: Vec<String>,
    types: Vec<TokenType>,
    ids: HashMap<String, u32>,
    /// All tokens' decoded bytes back to back; token `i` ends at `byte_ends[i]`.
    bytes: Vec<u8>,
    byte_ends: Vec<usize>,
}

impl Vocab {
    pub(crate) fn new(
        model: TokenizerModel,
        texts: Vec<String>,
        types: Vec<TokenType>,
        alphabet: &ByteAlphabet,
    ) -> Result<Self, TokenizerError> {
        if texts.is_empty() {
            return Err(TokenizerError::EmptyVocabulary);
        }
        if u32::try_from(texts.len()).is_err() {
            return Err(TokenizerError::VocabularyTooLarge(texts.len()));
        }
        let types = if types.is_empty() {
            vec![TokenType::Normal; texts.len()]
        } else {
            types
        };
        if types.len() != texts.len() {
            return Err(TokenizerError::LengthMismatch {
                what: "tokenizer.ggml.token_type",
                found: types.len(),
                expected: texts.len(),
            });
        }
        // Later duplicates win, as in llama.cpp and HF's vocab dictionaries.
        let ids = texts
            .iter()
            .enumerate()
            .map(|(id, text)| (text.clone(), id as u32))
            .collect();

        let mut bytes = Vec::with_capacity(texts.iter().map(String::len).sum());
        let mut byte_ends = Vec::with_capacity(texts.len());
        for (id, (text, &token_type)) in texts.iter().zip(&types).enumerate() {
            match (model, token_type) {
                (TokenizerModel::BytePairGpt2, t) if t.is_normal() => {
                    alphabet.decode_into(text, &mut bytes)
                }
                (TokenizerModel::BytePairGpt2, _) => bytes.extend_from_slice(text.as_bytes()),
                (TokenizerModel::SentencePiece, TokenType::Byte) => {
                    bytes.push(parse_byte_token(text).ok_or_else(|| {
                        TokenizerError::BadByteToken {
                            id: id as u32,
                            text: text.clone(),
                        }
                    })?)
                }
                (TokenizerModel::SentencePiece, _) => {
                    for ch in text.chars() {
                        let ch = if ch == SPM_SPACE { ' ' } else { ch };
                        bytes.extend_from_slice(ch.encode_utf8(&mut [0; 4]).as_bytes());
                    }
                }
            }
            byte_ends.push(bytes.len());
        }
        Ok(Self {
            texts,
            types,
            ids,
            bytes,
            byte_ends,
        })
    }

    pub(crate) fn len(&self) -> usize {
        self.texts.len()
    }

    pub(crate) fn id(&self, text: &str) -> Option<u32> {
        self.ids.get(text).copied()
    }

    pub(crate) fn text(&self, id: u32) -> Option<&str> {
        self.texts.get(id as usize).map(String::as_str)
    }

    pub(crate) fn token_type(&self, id: u32) -> Option<TokenType> {
        self.types.get(id as usize).copied()
    }

    pub(crate) fn iter(&self) -> impl Iterator<Item = (u32, &str, TokenType)> {
        self.texts
            .iter()
            .zip(&self.types)
            .enumerate()
            .map(|(id, (t, &ty))| (id as u32, t.as_str(), ty))
    }

    /// The raw bytes a token stands for; U+FFFD for an id outside the vocabulary.
    pub(crate) fn bytes(&self, id: u32) -> &[u8] {
        let id = id as usize;
        match self.byte_ends.get(id) {
            Some(&end) => {
                let start = if id == 0 { 0 } else { self.byte_ends[id - 1] };
                &self.bytes[start..end]
            }
            None => INVALID_ID_BYTES,
        }
    }

    /// Checks that an optional special id from the metadata names a token.
    pub(crate) fn check_id(
        &self,
        what: &'static str,
        id: Option<u32>,
    ) -> Result<Option<u32>, TokenizerError> {
        match id {
            Some(id) if id as usize >= self.len() => Err(TokenizerError::TokenIdOutOfRange {
                what,
                id: u64::from(id),
                vocab_size: self.len(),
            }),
            other => Ok(other),
        }
    }
}

/// `<0xNN>` -> the byte NN.
pub(crate) fn parse_byte_token(text: &str) -> Option<u8> {
    let hex = text.strip_prefix("<0x")?.strip_suffix('>')?;
    if hex.len() != 2 {
        return None;
    }
    u8::from_str_radix(hex, 16).ok()
}

/// For every byte, the id of the vocabulary token that stands for it alone: `<0xNN>` byte tokens
/// for SentencePiece, the byte's alphabet character for byte-level BPE.
pub(crate) fn single_byte_tokens(
    vocab: &Vocab,
    model: TokenizerModel,
    alphabet: &ByteAlphabet,
) -> [Option<u32>; 256] {
    let mut table = [None; 256];
    for (byte, slot) in (0..=255u8).zip(table.iter_mut()) {
        *slot = match model {
            TokenizerModel::BytePairGpt2 => {
                vocab.id(alphabet.char_of(byte).encode_utf8(&mut [0; 4]))
            }
            TokenizerModel::SentencePiece => vocab
                .id(&format!("<0x{byte:02X}>"))
                .filter(|&id| vocab.token_type(id) == Some(TokenType::Byte)),
        };
    }
    table
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn byte_tokens_parse_only_in_exact_form() {
        assert_eq!(parse_byte_token("<0x0A>"), Some(10));
        assert_eq!(parse_byte_token("<0xff>"), Some(255));
        assert_eq!(parse_byte_token("<0x100>"), None);
        assert_eq!(parse_byte_token("<0xZZ>"), None);
        assert_eq!(parse_byte_token("0x0A"), None);
    }

    #[test]
    fn a_malformed_byte_token_is_an_error() {
        let err = Vocab::new(
            TokenizerModel::SentencePiece,
            vec!["<unk>".into(), "<0xG1>".into()],
            vec![TokenType::Unknown, TokenType::Byte],
            &ByteAlphabet::new(),
        )
        .err()
        .unwrap();
        assert!(err.to_string().contains("token 1 `<0xG1>`"), "{err}");
    }

    #[test]
    fn out_of_range_ids_read_as_replacement_character() {
        let vocab = Vocab::new(
            TokenizerModel::SentencePiece,
            vec!["▁a".into()],
            vec![],
            &ByteAlphabet::new(),
        )
        .unwrap();
        assert_eq!(vocab.bytes(0), b" a");
        assert_eq!(vocab.bytes(1), "\u{FFFD}".as_bytes());
        assert_eq!(vocab.bytes(u32::MAX), "\u{FFFD}".as_bytes());
    }
}
