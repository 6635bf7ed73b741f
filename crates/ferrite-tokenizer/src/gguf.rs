//! Reading a [`TokenizerSpec`] and chat template from GGUF metadata (`tokenizer.*` keys).

use crate::spec::{TokenType, TokenizerModel, TokenizerSpec};
use crate::{ChatTemplate, Tokenizer, TokenizerError};
use ferrite_gguf::{GgufError, Metadata};

const MODEL: &str = "tokenizer.ggml.model";
const TOKENS: &str = "tokenizer.ggml.tokens";
const SCORES: &str = "tokenizer.ggml.scores";
const TOKEN_TYPES: &str = "tokenizer.ggml.token_type";
const MERGES: &str = "tokenizer.ggml.merges";
const PRE: &str = "tokenizer.ggml.pre";
const BOS_ID: &str = "tokenizer.ggml.bos_token_id";
const EOS_ID: &str = "tokenizer.ggml.eos_token_id";
const UNKNOWN_ID: &str = "tokenizer.ggml.unknown_token_id";
const PADDING_ID: &str = "tokenizer.ggml.padding_token_id";
const EOT_ID: &str = "tokenizer.ggml.eot_token_id";
const EOM_ID: &str = "tokenizer.ggml.eom_token_id";
const ADD_BOS: &str = "tokenizer.ggml.add_bos_token";
const ADD_EOS: &str = "tokenizer.ggml.add_eos_token";
const ADD_SPACE_PREFIX: &str = "tokenizer.ggml.add_space_prefix";
const CHAT_TEMPLATE: &str = "tokenizer.chat_template";

/// Reads an optional key: absent is `None`, present with the wrong type is an error.
fn optional<'m, T>(
    meta: &'m Metadata,
    key: &str,
    read: impl FnOnce(&'m Metadata, &str) -> Result<T, GgufError>,
) -> Result<Option<T>, TokenizerError> {
    if meta.contains_key(key) {
        Ok(Some(read(meta, key)?))
    } else {
        Ok(None)
    }
}

fn owned(strings: Vec<&str>) -> Vec<String> {
    strings.into_iter().map(str::to_string).collect()
}

impl TokenizerSpec {
    /// Collects the `tokenizer.*` keys. `tokenizer.ggml.model` and `tokenizer.ggml.tokens` are
    /// required; everything else is optional here and checked by [`Tokenizer::from_spec`].
    pub fn from_gguf(meta: &Metadata) -> Result<Self, TokenizerError> {
        let model = TokenizerModel::from_gguf_name(meta.str(MODEL)?)?;
        let mut spec = TokenizerSpec::new(model, owned(meta.str_array(TOKENS)?));
        spec.scores = optional(meta, SCORES, Metadata::f32_array)?.unwrap_or_default();
        spec.token_types = optional(meta, TOKEN_TYPES, Metadata::i32_array)?
            .unwrap_or_default()
            .into_iter()
            .enumerate()
            .map(|(index, value)| TokenType::from_gguf(value, index))
            .collect::<Result<_, _>>()?;
        spec.merges = optional(meta, MERGES, Metadata::str_array)?
            .map(owned)
            .unwrap_or_default();
        spec.pre_tokenizer = optional(meta, PRE, Metadata::str)?.map(str::to_string);
        spec.bos_id = optional(meta, BOS_ID, Metadata::u32)?;
        spec.eos_id = optional(meta, EOS_ID, Metadata::u32)?;
        spec.unknown_id = optional(meta, UNKNOWN_ID, Metadata::u32)?;
        spec.padding_id = optional(meta, PADDING_ID, Metadata::u32)?;
        spec.eot_id = optional(meta, EOT_ID, Metadata::u32)?;
        spec.eom_id = optional(meta, EOM_ID, Metadata::u32)?;
        spec.add_bos = optional(meta, ADD_BOS, Metadata::bool)?;
        spec.add_eos = optional(meta, ADD_EOS, Metadata::bool)?;
        spec.add_space_prefix = optional(meta, ADD_SPACE_PREFIX, Metadata::bool)?;
        spec.chat_template = optional(meta, CHAT_TEMPLATE, Metadata::str)?.map(str::to_string);
        Ok(spec)
    }
}

impl Tokenizer {
    /// Builds the tokenizer described by a GGUF file's metadata.
    pub fn from_gguf(meta: &Metadata) -> Result<Self, TokenizerError> {
        Self::from_spec(TokenizerSpec::from_gguf(meta)?)
    }
}

impl ChatTemplate {
    /// The model's `tokenizer.chat_template`, or `None` when it has none (the caller then falls
    /// back to a plain prompt format).
    pub fn from_gguf(meta: &Metadata) -> Result<Option<Self>, TokenizerError> {
        let Some(template) = optional(meta, CHAT_TEMPLATE, Metadata::str)? else {
            return Ok(None);
        };
        let tokens = meta.str_array(TOKENS)?;
        let text_of = |key: &'static str| -> Result<&str, TokenizerError> {
            match optional(meta, key, Metadata::u32)? {
                None => Ok(""),
                Some(id) => {
                    tokens
                        .get(id as usize)
                        .copied()
                        .ok_or(TokenizerError::TokenIdOutOfRange {
                            what: key,
                            id: u64::from(id),
                            vocab_size: tokens.len(),
                        })
                }
            }
        };
        let bos = text_of(BOS_ID)?;
        let eos = text_of(EOS_ID)?;
        ChatTemplate::new(template, bos, eos).map(Some)
    }
}
