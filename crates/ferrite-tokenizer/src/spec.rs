//! The plain description a [`crate::Tokenizer`] is built from, independent of where it was read.

use crate::TokenizerError;

/// Which tokenization algorithm the vocabulary belongs to (`tokenizer.ggml.model`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TokenizerModel {
    /// `"gpt2"`: byte-level BPE with ranked merges (GPT-2, Llama 3, Qwen, SmolLM...).
    BytePairGpt2,
    /// `"llama"`: SentencePiece-style BPE driven by token scores (Llama 2, Gemma, Mistral v1...).
    SentencePiece,
}

impl TokenizerModel {
    /// Parses the value of `tokenizer.ggml.model`.
    pub fn from_gguf_name(name: &str) -> Result<Self, TokenizerError> {
        match name {
            "gpt2" => Ok(Self::BytePairGpt2),
            "llama" => Ok(Self::SentencePiece),
            other => Err(TokenizerError::UnsupportedModel(other.to_string())),
        }
    }
}

/// Token attribute from `tokenizer.ggml.token_type` (llama.cpp's `llama_token_type`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TokenType {
    /// 0: written by some converters for tokens they did not classify; treated as normal.
    Undefined,
    Normal,
    Unknown,
    Control,
    UserDefined,
    Unused,
    Byte,
}

impl TokenType {
    /// Converts the GGUF integer; `index` is only used for the error message.
    pub fn from_gguf(value: i32, index: usize) -> Result<Self, TokenizerError> {
        Ok(match value {
            0 => Self::Undefined,
            1 => Self::Normal,
            2 => Self::Unknown,
            3 => Self::Control,
            4 => Self::UserDefined,
            5 => Self::Unused,
            6 => Self::Byte,
            _ => return Err(TokenizerError::UnknownTokenType { index, value }),
        })
    }

    /// Tokens written as whole strings in the input text and matched before BPE.
    pub fn is_special(self) -> bool {
        matches!(self, Self::Control | Self::UserDefined)
    }

    /// Tokens whose text is ordinary vocabulary (spelled in the model's alphabet).
    pub fn is_normal(self) -> bool {
        matches!(self, Self::Normal | Self::Undefined)
    }
}

/// Everything needed to build a tokenizer. `None` flags take the model's default
/// (llama.cpp's rules: BOS is added by default for SentencePiece, not for byte-level BPE).
#[derive(Clone, Debug)]
pub struct TokenizerSpec {
    pub model: TokenizerModel,
    /// Token texts as stored in GGUF (byte-level alphabet for `gpt2`, `▁` for spaces for `llama`).
    pub tokens: Vec<String>,
    /// Per-token scores; required to be meaningful for SentencePiece, may be empty otherwise.
    pub scores: Vec<f32>,
    /// Per-token types; empty means every token is normal.
    pub token_types: Vec<TokenType>,
    /// Merges, `"left right"`, highest priority first: required for byte-level BPE; for
    /// SentencePiece only used with `ranked_merges`.
    pub merges: Vec<String>,
    /// SentencePiece vocabulary merged by the rank of `merges` instead of by `scores` (HF
    /// `tokenizer.json` BPE with byte fallback). GGUF files (llama.cpp) always use the scores.
    pub ranked_merges: bool,
    /// `tokenizer.ggml.pre`: names the pre-tokenizer split rules for byte-level BPE.
    pub pre_tokenizer: Option<String>,
    /// Explicit split regexes for byte-level BPE (from a `tokenizer.json`), applied in order;
    /// they take precedence over `pre_tokenizer`.
    pub split_patterns: Option<Vec<String>>,
    /// Look whole pre-tokenized words up before merging (HF `ignore_merges`); `None` follows the
    /// named pre-tokenizer's rule.
    pub ignore_merges: Option<bool>,
    pub bos_id: Option<u32>,
    pub eos_id: Option<u32>,
    pub unknown_id: Option<u32>,
    pub padding_id: Option<u32>,
    /// End-of-turn / end-of-message tokens (`tokenizer.ggml.eot_token_id`, `eom_token_id`).
    pub eot_id: Option<u32>,
    pub eom_id: Option<u32>,
    pub add_bos: Option<bool>,
    pub add_eos: Option<bool>,
    pub add_space_prefix: Option<bool>,
    /// `tokenizer.chat_template` (Jinja).
    pub chat_template: Option<String>,
}

impl TokenizerSpec {
    /// A spec with the given vocabulary and every optional field empty.
    pub fn new(model: TokenizerModel, tokens: Vec<String>) -> Self {
        Self {
            model,
            tokens,
            scores: Vec::new(),
            token_types: Vec::new(),
            merges: Vec::new(),
            ranked_merges: false,
            pre_tokenizer: None,
            split_patterns: None,
            ignore_merges: None,
            bos_id: None,
            eos_id: None,
            unknown_id: None,
            padding_id: None,
            eot_id: None,
            eom_id: None,
            add_bos: None,
            add_eos: None,
            add_space_prefix: None,
            chat_template: None,
        }
    }
}
