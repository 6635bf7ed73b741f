//! Tokenizers for GGUF models: byte-level BPE (`tokenizer.ggml.model = "gpt2"`) and
//! SentencePiece-style BPE (`"llama"`), a streaming detokenizer and Jinja chat templates.
//!
//! The core is built from a plain [`TokenizerSpec`]; [`Tokenizer::from_gguf`] fills one from GGUF
//! metadata, [`Tokenizer::from_hf_dir`] from a Hugging Face `tokenizer.json` folder. Encodings match Hugging Face `tokenizers` / SentencePiece (see the known-answer tests
//! and `scripts/fixtures/make_tokenizer_fixtures.py`).

mod bpe;
mod byte_level;
mod chat;
mod decoder;
mod error;
mod gguf;
mod hf;
mod pretokenize;
mod spec;
mod special;
mod spm;
mod tokenizer;
mod vocab;

pub use chat::{ChatTemplate, Message};
pub use decoder::StreamDecoder;
pub use error::TokenizerError;
pub use spec::{TokenType, TokenizerModel, TokenizerSpec};
pub use tokenizer::Tokenizer;
