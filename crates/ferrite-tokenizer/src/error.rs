//! Errors of building a tokenizer, encoding text and rendering chat templates.

/// Everything that can go wrong. Messages name the metadata key, token id or template involved.
#[derive(thiserror::Error, Debug)]
pub enum TokenizerError {
    #[error("tokenizer model `{0}` is not supported (supported: \"gpt2\" byte-level BPE, \"llama\" SentencePiece)")]
    UnsupportedModel(String),

    #[error("the vocabulary is empty (tokenizer.ggml.tokens has no entries)")]
    EmptyVocabulary,

    #[error("vocabulary of {0} tokens is too large for 32-bit token ids")]
    VocabularyTooLarge(usize),

    #[error("{what} has {found} entries but the vocabulary has {expected} tokens")]
    LengthMismatch {
        what: &'static str,
        found: usize,
        expected: usize,
    },

    #[error("tokenizer.ggml.token_type[{index}] = {value} is not a known token type (0..=6)")]
    UnknownTokenType { index: usize, value: i32 },

    #[error("{what} = {id} is out of range for a vocabulary of {vocab_size} tokens")]
    TokenIdOutOfRange {
        what: &'static str,
        id: u64,
        vocab_size: usize,
    },

    #[error("merge #{index} `{merge}`: {reason}")]
    BadMerge {
        index: usize,
        merge: String,
        reason: String,
    },

    #[error("byte-level BPE vocabulary needs merges (tokenizer.ggml.merges is missing or empty)")]
    MissingMerges,

    #[error("token {id} `{text}` is marked as a byte token but is not of the form <0xNN>")]
    BadByteToken { id: u32, text: String },

    #[error("{flag} is true but {id_key} is not set")]
    MissingSpecialToken {
        flag: &'static str,
        id_key: &'static str,
    },

    #[error("pre-tokenizer regex {pattern:?}: {message}")]
    Regex { pattern: String, message: String },

    #[error(
        "cannot encode byte {byte:#04x}: the vocabulary has no token for it and no unknown token"
    )]
    Unencodable { byte: u8 },

    #[error("Hugging Face tokenizer: {0}")]
    HfTokenizer(String),

    #[error("chat template: {0}")]
    Template(String),

    #[error("GGUF metadata: {0}")]
    Metadata(#[from] ferrite_gguf::GgufError),
}
