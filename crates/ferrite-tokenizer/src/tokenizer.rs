//! [`Tokenizer`]: text <-> token ids for byte-level BPE and SentencePiece vocabularies.

use crate::bpe::BytePairEncoder;
use crate::byte_level::ByteAlphabet;
use crate::chat::ChatTemplate;
use crate::decoder::StreamDecoder;
use crate::pretokenize::PreTokenizer;
use crate::spec::{TokenizerModel, TokenizerSpec};
use crate::special::{Fragment, SpecialMatcher};
use crate::spm::SentencePieceEncoder;
use crate::vocab::{single_byte_tokens, Vocab};
use crate::TokenizerError;

/// Texts of special tokens that end a turn in common chat formats (llama.cpp's end-of-generation
/// list); they stop generation even when the metadata names only EOS.
const END_OF_TURN_TEXTS: &[&str] = &[
    "<|eot_id|>",
    "<|im_end|>",
    "<|end|>",
    "<end_of_turn>",
    "<|endoftext|>",
    "<|eom_id|>",
    "<EOT>",
    "_<EOT>",
    "<|end_of_text|>",
    "<end_of_utterance>",
    "<|return|>",
    "<|call|>",
];

enum Encoder {
    BytePair(BytePairEncoder),
    SentencePiece(SentencePieceEncoder),
}

/// A tokenizer built from GGUF metadata (or a [`TokenizerSpec`]).
pub struct Tokenizer {
    vocab: Vocab,
    alphabet: ByteAlphabet,
    encoder: Encoder,
    specials: SpecialMatcher,
    bos: Option<u32>,
    eos: Option<u32>,
    end_of_generation: Vec<u32>,
    add_bos: bool,
    add_eos: bool,
    add_space_prefix: bool,
    chat_template: Option<String>,
    pub(crate) warnings: Vec<String>,
}

impl Tokenizer {
    /// Builds the tokenizer, checking that the metadata is consistent (lengths, merges, ids).
    pub fn from_spec(spec: TokenizerSpec) -> Result<Self, TokenizerError> {
        let alphabet = ByteAlphabet::new();
        let vocab = Vocab::new(spec.model, spec.tokens, spec.token_types, &alphabet)?;
        let bos = vocab.check_id("tokenizer.ggml.bos_token_id", spec.bos_id)?;
        let eos = vocab.check_id("tokenizer.ggml.eos_token_id", spec.eos_id)?;
        let unknown = vocab.check_id("tokenizer.ggml.unknown_token_id", spec.unknown_id)?;
        vocab.check_id("tokenizer.ggml.padding_token_id", spec.padding_id)?;
        let eot = vocab.check_id("tokenizer.ggml.eot_token_id", spec.eot_id)?;
        let eom = vocab.check_id("tokenizer.ggml.eom_token_id", spec.eom_id)?;

        let sentencepiece = spec.model == TokenizerModel::SentencePiece;
        let add_bos = spec.add_bos.unwrap_or(sentencepiece);
        let add_eos = spec.add_eos.unwrap_or(false);
        // Byte-level BPE writes spaces as ordinary bytes; only SentencePiece uses a dummy prefix.
        let add_space_prefix = sentencepiece && spec.add_space_prefix.unwrap_or(true);
        if add_bos && bos.is_none() {
            return Err(TokenizerError::MissingSpecialToken {
                flag: "tokenizer.ggml.add_bos_token",
                id_key: "tokenizer.ggml.bos_token_id",
            });
        }
        if add_eos && eos.is_none() {
            return Err(TokenizerError::MissingSpecialToken {
                flag: "tokenizer.ggml.add_eos_token",
                id_key: "tokenizer.ggml.eos_token_id",
            });
        }

        let byte_tokens = single_byte_tokens(&vocab, spec.model, &alphabet);
        let mut warnings = Vec::new();
        let encoder = match spec.model {
            TokenizerModel::BytePairGpt2 => {
                let (pre_tokenizer, warning) = match &spec.split_patterns {
                    Some(patterns) => (
                        PreTokenizer::from_patterns(patterns, spec.ignore_merges.unwrap_or(false))?,
                        None,
                    ),
                    None => PreTokenizer::for_name(spec.pre_tokenizer.as_deref())?,
                };
                warnings.extend(warning);
                Encoder::BytePair(BytePairEncoder::new(
                    &vocab,
                    &spec.merges,
                    byte_tokens,
                    pre_tokenizer,
                )?)
            }
            TokenizerModel::SentencePiece => Encoder::SentencePiece(SentencePieceEncoder::new(
                &vocab,
                spec.scores,
                if spec.ranked_merges { &spec.merges } else { &[] },
                byte_tokens,
                unknown,
            )?),
        };

        let mut end_of_generation: Vec<u32> = [eos, eot, eom].into_iter().flatten().collect();
        end_of_generation.extend(
            vocab
                .iter()
                .filter(|(_, text, _)| END_OF_TURN_TEXTS.contains(text))
                .map(|(id, _, _)| id),
        );
        end_of_generation.sort_unstable();
        end_of_generation.dedup();

        Ok(Self {
            specials: SpecialMatcher::new(&vocab),
            vocab,
            alphabet,
            encoder,
            bos,
            eos,
            end_of_generation,
            add_bos,
            add_eos,
            add_space_prefix,
            chat_template: spec.chat_template,
            warnings,
        })
    }

    /// Encodes `text`. Special-token strings in it (e.g. `<|im_start|>`) become their single
    /// tokens; with `add_special`, BOS/EOS are added as the model's add_bos/add_eos flags say.
    pub fn encode(&self, text: &str, add_special: bool) -> Result<Vec<u32>, TokenizerError> {
        let mut ids = Vec::with_capacity(text.len() / 3 + 2);
        if add_special && self.add_bos {
            ids.extend(self.bos);
        }
        // SentencePiece models get a dummy space at the start of text and after each special
        // token, as llama.cpp does.
        let mut after_special = true;
        for fragment in self.specials.split(text) {
            match fragment {
                Fragment::Token(id) => {
                    ids.push(id);
                    after_special = true;
                }
                Fragment::Text(run) => {
                    match &self.encoder {
                        Encoder::BytePair(bpe) => {
                            bpe.encode(&self.vocab, &self.alphabet, run, &mut ids)?
                        }
                        Encoder::SentencePiece(spm) => spm.encode(
                            &self.vocab,
                            run,
                            self.add_space_prefix && after_special,
                            &mut ids,
                        )?,
                    }
                    after_special = false;
                }
            }
        }
        if add_special && self.add_eos {
            ids.extend(self.eos);
        }
        Ok(ids)
    }

    /// Encodes a prompt rendered by the chat template: as `encode(text, true)`, except that BOS is
    /// not added a second time when the template already wrote it (most templates start with
    /// `{{ bos_token }}`), as llama.cpp does.
    pub fn encode_chat(&self, text: &str) -> Result<Vec<u32>, TokenizerError> {
        let mut ids = self.encode(text, true)?;
        if self.add_bos && self.bos.is_some() && ids.len() >= 2 && ids[0] == ids[1] && Some(ids[0]) == self.bos {
            ids.remove(0);
        }
        Ok(ids)
    }

    /// Decodes ids to text, special tokens included, invalid UTF-8 replaced by U+FFFD. Token
    /// bytes are joined as they are: the dummy space a SentencePiece model puts before the first
    /// word is kept, as when streaming a continuation.
    pub fn decode(&self, ids: &[u32]) -> String {
        let mut bytes = Vec::with_capacity(ids.len() * 4);
        for &id in ids {
            bytes.extend_from_slice(self.token_bytes(id));
        }
        String::from_utf8_lossy(&bytes).into_owned()
    }

    /// The raw bytes one token stands for (byte-level alphabet undone, `▁` as space, `<0xNN>` as
    /// its byte, special tokens as their text). An id outside the vocabulary gives U+FFFD.
    pub fn token_bytes(&self, id: u32) -> &[u8] {
        self.vocab.bytes(id)
    }

    /// A decoder that turns ids into text one at a time as generation produces them.
    pub fn stream_decoder(&self) -> StreamDecoder<'_> {
        StreamDecoder::new(self)
    }

    pub fn bos_id(&self) -> Option<u32> {
        self.bos
    }

    pub fn eos_id(&self) -> Option<u32> {
        self.eos
    }

    /// True for EOS, EOT/EOM and end-of-turn tokens like `<|im_end|>` or `<end_of_turn>`.
    pub fn is_end_of_generation(&self, id: u32) -> bool {
        self.end_of_generation.binary_search(&id).is_ok()
    }

    pub fn vocab_size(&self) -> usize {
        self.vocab.len()
    }

    /// Looks a token up by its text as stored in the vocabulary (e.g. `Ġthe` for byte-level
    /// BPE, `▁the` for SentencePiece, `<|im_end|>` for special tokens).
    pub fn token_to_id(&self, text: &str) -> Option<u32> {
        self.vocab.id(text)
    }

    /// The text of a token as stored in the vocabulary.
    pub fn id_to_token(&self, id: u32) -> Option<&str> {
        self.vocab.text(id)
    }

    pub fn model(&self) -> TokenizerModel {
        match self.encoder {
            Encoder::BytePair(_) => TokenizerModel::BytePairGpt2,
            Encoder::SentencePiece(_) => TokenizerModel::SentencePiece,
        }
    }

    /// The model's chat template with its BOS/EOS texts, if the metadata carries one.
    pub fn chat_template(&self) -> Result<Option<ChatTemplate>, TokenizerError> {
        let text_of = |id: Option<u32>| id.and_then(|id| self.vocab.text(id)).unwrap_or_default();
        self.chat_template
            .as_deref()
            .map(|template| ChatTemplate::new(template, text_of(self.bos), text_of(self.eos)))
            .transpose()
    }

    /// Things that were accepted but may make tokenization differ from the model's reference
    /// (e.g. an unknown pre-tokenizer name); callers should show them to the user.
    pub fn warnings(&self) -> &[String] {
        &self.warnings
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The engine shares one tokenizer between threads.
    #[test]
    fn tokenizer_and_chat_template_are_send_and_sync() {
        fn assert_send_sync<T: Send + Sync>() {}
        assert_send_sync::<Tokenizer>();
        assert_send_sync::<ChatTemplate>();
    }
}
