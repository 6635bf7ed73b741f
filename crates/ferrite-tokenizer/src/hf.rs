//! Hugging Face tokenizer folders: `tokenizer.json` (the `tokenizers` library's format) plus
//! `tokenizer_config.json` (BOS/EOS, add_bos/add_eos, chat template) and `chat_template.jinja`.
//!
//! Two layouts of a BPE model are understood:
//! * byte-level BPE (a `ByteLevel` pre-tokenizer or decoder: GPT-2, Llama 3, Qwen, SmolLM): its
//!   `Split` / `Digits` / `ByteLevel` pre-tokenizers become the split regexes, applied in order;
//! * SentencePiece-style BPE (`byte_fallback`, `▁` for spaces: Llama 2, Gemma): its ranked merges
//!   drive the SentencePiece encoder (see `spm.rs`); a `Prepend("▁")` normalizer or a `Metaspace`
//!   pre-tokenizer that prepends means a dummy leading space.
//!
//! Anything else (Unigram/WordPiece models, other normalizers or pre-tokenizers) is refused with
//! the name of what is not supported, rather than tokenized differently from the model.

use crate::pretokenize::{GPT2, SINGLE_DIGITS};
use crate::spec::{TokenType, TokenizerModel, TokenizerSpec};
use crate::{Tokenizer, TokenizerError};
use serde_json::Value as Json;
use std::path::Path;

fn bad(msg: impl Into<String>) -> TokenizerError {
    TokenizerError::HfTokenizer(msg.into())
}

/// Escapes a literal string for use in a regex.
fn regex_literal(s: &str) -> String {
    s.chars()
        .flat_map(|c| {
            let special = "\\.+*?()|[]{}^$#&-~".contains(c);
            special.then_some('\\').into_iter().chain(std::iter::once(c))
        })
        .collect()
}

/// The split regexes of a byte-level pre-tokenizer, in application order.
fn split_patterns(pre: &Json, out: &mut Vec<String>) -> Result<(), TokenizerError> {
    match pre["type"].as_str() {
        None if pre.is_null() => Ok(()),
        Some("Sequence") => {
            let list = pre["pretokenizers"].as_array().ok_or_else(|| bad("pre_tokenizer Sequence without `pretokenizers`"))?;
            list.iter().try_for_each(|p| split_patterns(p, out))
        }
        Some("ByteLevel") => {
            if pre["add_prefix_space"].as_bool() == Some(true) {
                return Err(bad("ByteLevel pre-tokenizer with add_prefix_space is not supported"));
            }
            if pre["use_regex"].as_bool().unwrap_or(true) {
                out.push(GPT2.to_string());
            }
            Ok(())
        }
        Some("Digits") => {
            out.push(if pre["individual_digits"].as_bool() == Some(true) { SINGLE_DIGITS.to_string() } else { r"\p{N}+".to_string() });
            Ok(())
        }
        Some("Split") => {
            let behavior = pre["behavior"].as_str().unwrap_or("");
            if !behavior.eq_ignore_ascii_case("isolated") || pre["invert"].as_bool() == Some(true) {
                return Err(bad(format!("Split pre-tokenizer with behavior `{behavior}` is not supported (Isolated is)")));
            }
            let pattern = match (pre["pattern"]["Regex"].as_str(), pre["pattern"]["String"].as_str()) {
                (Some(r), _) => r.to_string(),
                (None, Some(s)) => regex_literal(s),
                _ => return Err(bad("Split pre-tokenizer without a pattern")),
            };
            out.push(pattern);
            Ok(())
        }
        other => Err(bad(format!("pre-tokenizer `{}` is not supported for byte-level BPE", other.unwrap_or("?")))),
    }
}

/// Does this (possibly nested) normalizer / pre-tokenizer / decoder contain a part of `kind`?
fn contains_type(v: &Json, kind: &str) -> bool {
    if v["type"].as_str() == Some(kind) {
        return true;
    }
    ["pretokenizers", "normalizers", "decoders", "processors"]
        .iter()
        .filter_map(|k| v[*k].as_array())
        .flatten()
        .any(|p| contains_type(p, kind))
}

/// Does the SentencePiece-style layout add a dummy space before the text?
fn prepends_space(j: &Json) -> Result<bool, TokenizerError> {
    fn walk(v: &Json, found: &mut bool) -> Result<(), TokenizerError> {
        match v["type"].as_str() {
            Some("Sequence") => {
                for list in ["normalizers", "pretokenizers"] {
                    for p in v[list].as_array().into_iter().flatten() {
                        walk(p, found)?;
                    }
                }
                Ok(())
            }
            Some("Prepend") if v["prepend"].as_str() == Some("\u{2581}") => {
                *found = true;
                Ok(())
            }
            Some("Metaspace") => {
                let scheme = v["prepend_scheme"].as_str();
                *found |= matches!(scheme, Some("first" | "always")) || (scheme.is_none() && v["add_prefix_space"].as_bool() == Some(true));
                Ok(())
            }
            // Spaces written as ▁ (the encoder does that itself); a split on spaces is a no-op
            // once they are ▁ (Gemma's tokenizer.json has both).
            Some("Replace") if v["pattern"]["String"].as_str() == Some(" ") && v["content"].as_str() == Some("\u{2581}") => Ok(()),
            Some("Split") if v["pattern"]["String"].as_str() == Some(" ") => Ok(()),
            None if v.is_null() => Ok(()),
            other => Err(bad(format!("`{}` is not supported in a SentencePiece-style tokenizer.json", other.unwrap_or("?")))),
        }
    }
    let mut found = false;
    walk(&j["normalizer"], &mut found)?;
    walk(&j["pre_tokenizer"], &mut found)?;
    Ok(found)
}

/// The special token texts a `TemplateProcessing` post-processor puts before / after a single text.
fn template_specials(post: &Json) -> (Option<String>, Option<String>) {
    if post["type"].as_str() == Some("Sequence") {
        return post["processors"]
            .as_array()
            .into_iter()
            .flatten()
            .map(template_specials)
            .fold((None, None), |(a, b), (c, d)| (a.or(c), b.or(d)));
    }
    if post["type"].as_str() != Some("TemplateProcessing") {
        return (None, None);
    }
    let single = post["single"].as_array().cloned().unwrap_or_default();
    let special = |item: Option<&Json>| item.and_then(|i| i["SpecialToken"]["id"].as_str()).map(str::to_string);
    (special(single.first()), special(single.last()))
}

/// `"<bos>"` or `{"content": "<bos>", ...}` in tokenizer_config.json.
fn token_text(v: &Json) -> Option<&str> {
    v.as_str().or_else(|| v["content"].as_str())
}

/// `"<0x0A>"`-style byte tokens.
fn is_byte_token(text: &str) -> bool {
    text.len() == 6 && text.starts_with("<0x") && text.ends_with('>') && text[3..5].chars().all(|c| c.is_ascii_hexdigit())
}

impl TokenizerSpec {
    /// Builds a spec from the contents of `tokenizer.json` and, if present, `tokenizer_config.json`
    /// and a chat template file (`chat_template.jinja`; the config's `chat_template` wins).
    /// Also returns what was accepted but may tokenize differently from `tokenizers`.
    pub fn from_hf_json(tokenizer_json: &str, config_json: Option<&str>, chat_template: Option<&str>) -> Result<(Self, Vec<String>), TokenizerError> {
        let mut warnings = Vec::new();
        let j: Json = serde_json::from_str(tokenizer_json).map_err(|e| bad(format!("tokenizer.json is not valid JSON: {e}")))?;
        let config: Json = match config_json {
            Some(text) => serde_json::from_str(text).map_err(|e| bad(format!("tokenizer_config.json is not valid JSON: {e}")))?,
            None => Json::Null,
        };
        let m = &j["model"];
        match m["type"].as_str() {
            Some("BPE") => {}
            other => return Err(bad(format!("model type `{}` is not supported (BPE is)", other.unwrap_or("?")))),
        }
        let byte_level = contains_type(&j["pre_tokenizer"], "ByteLevel") || contains_type(&j["decoder"], "ByteLevel");
        let model = if byte_level {
            TokenizerModel::BytePairGpt2
        } else if m["byte_fallback"].as_bool() == Some(true) || contains_type(&j["pre_tokenizer"], "Metaspace") || contains_type(&j["normalizer"], "Replace") {
            TokenizerModel::SentencePiece
        } else {
            return Err(bad("a BPE model that is neither byte-level nor SentencePiece-style (byte_fallback / ▁) is not supported"));
        };

        // Vocabulary: model.vocab plus added_tokens, by id; ids nobody names become unused placeholders.
        let vocab = m["vocab"].as_object().ok_or_else(|| bad("model.vocab is missing"))?;
        let added = j["added_tokens"].as_array().cloned().unwrap_or_default();
        let mut entries: Vec<(usize, String, Option<bool>)> = Vec::with_capacity(vocab.len() + added.len());
        for (text, id) in vocab {
            let id = id.as_u64().ok_or_else(|| bad(format!("vocab entry `{text}` has no integer id")))?;
            entries.push((id as usize, text.clone(), None));
        }
        for t in &added {
            let (Some(id), Some(text)) = (t["id"].as_u64(), t["content"].as_str()) else {
                return Err(bad(format!("added token {t} needs an id and a content")));
            };
            entries.push((id as usize, text.to_string(), Some(t["special"].as_bool().unwrap_or(false))));
        }
        let size = entries.iter().map(|e| e.0 + 1).max().ok_or(TokenizerError::EmptyVocabulary)?;
        if size > entries.len() + 4096 || size > u32::MAX as usize {
            return Err(bad(format!("token ids reach {size} for {} tokens", entries.len())));
        }
        let mut tokens: Vec<Option<String>> = vec![None; size];
        let mut added_kind: Vec<Option<bool>> = vec![None; size];
        for (id, text, special) in entries {
            if let Some(old) = &tokens[id] {
                if *old != text {
                    return Err(bad(format!("token id {id} is both `{old}` and `{text}`")));
                }
            }
            tokens[id] = Some(text);
            added_kind[id] = added_kind[id].or(special);
        }
        let unk = m["unk_token"].as_str();
        let mut token_types = Vec::with_capacity(size);
        let tokens: Vec<String> = tokens
            .into_iter()
            .enumerate()
            .map(|(id, t)| {
                let (text, kind) = match t {
                    None => (format!("<ferrite_unused_{id}>"), TokenType::Unused),
                    Some(text) => {
                        let kind = match added_kind[id] {
                            Some(true) => TokenType::Control,
                            Some(false) => TokenType::UserDefined,
                            None if Some(text.as_str()) == unk => TokenType::Unknown,
                            None if model == TokenizerModel::SentencePiece && is_byte_token(&text) => TokenType::Byte,
                            None => TokenType::Normal,
                        };
                        (text, kind)
                    }
                };
                token_types.push(kind);
                text
            })
            .collect();

        // Merges: "a b" strings, or [a, b] pairs in newer files.
        let mut merges = Vec::new();
        for (index, merge) in m["merges"].as_array().into_iter().flatten().enumerate() {
            let (left, right) = match (merge.as_str(), merge.as_array()) {
                (Some(s), _) => match s.split_once(' ') {
                    Some(pair) => pair,
                    None => return Err(bad(format!("merge #{index} `{s}` is not two tokens"))),
                },
                (None, Some(pair)) if pair.len() == 2 && pair.iter().all(Json::is_string) => (pair[0].as_str().unwrap_or(""), pair[1].as_str().unwrap_or("")),
                _ => return Err(bad(format!("merge #{index} {merge} is not two tokens"))),
            };
            if left.contains(' ') || right.contains(' ') {
                // Only possible for SentencePiece-style vocabularies, whose text never keeps a
                // plain space (it becomes ▁): such a merge can never apply.
                if model == TokenizerModel::SentencePiece {
                    continue;
                }
                return Err(bad(format!("merge #{index} has a space inside a token")));
            }
            merges.push(format!("{left} {right}"));
        }

        let mut spec = TokenizerSpec::new(model, tokens);
        spec.token_types = token_types;
        spec.merges = merges;
        spec.ignore_merges = Some(m["ignore_merges"].as_bool().unwrap_or(false));
        match model {
            TokenizerModel::BytePairGpt2 => {
                match j["normalizer"]["type"].as_str() {
                    None => {}
                    Some("NFC") => warnings.push("tokenizer.json: the NFC normalizer is not applied (as in llama.cpp); text that is not NFC-composed may tokenize differently".to_string()),
                    Some(other) => return Err(bad(format!("normalizer `{other}` is not supported for byte-level BPE"))),
                }
                let mut patterns = Vec::new();
                split_patterns(&j["pre_tokenizer"], &mut patterns)?;
                spec.split_patterns = Some(patterns);
            }
            TokenizerModel::SentencePiece => {
                if spec.merges.is_empty() {
                    return Err(bad("SentencePiece-style model.merges is empty"));
                }
                spec.ranked_merges = true;
                spec.add_space_prefix = Some(prepends_space(&j)?);
                if m["fuse_unk"].as_bool() == Some(true) && m["byte_fallback"].as_bool() != Some(true) && m["unk_token"].is_string() {
                    warnings.push("tokenizer.json: fuse_unk is not applied; a run of unknown characters gives one unknown token per character".to_string());
                }
            }
        }
        let id_of = |text: &str| spec.tokens.iter().position(|t| t == text).map(|i| i as u32);
        spec.unknown_id = unk.and_then(id_of);
        let (template_first, template_last) = template_specials(&j["post_processor"]);
        let bos_text = token_text(&config["bos_token"]).map(str::to_string).or(template_first.clone());
        let eos_text = token_text(&config["eos_token"]).map(str::to_string);
        spec.bos_id = bos_text.as_deref().and_then(id_of);
        spec.eos_id = eos_text.as_deref().and_then(id_of);
        spec.padding_id = token_text(&config["pad_token"]).and_then(id_of);
        // add_bos / add_eos: the config's flags, else what the post-processor adds.
        spec.add_bos = Some(config["add_bos_token"].as_bool().unwrap_or(template_first.is_some() && template_first == bos_text));
        spec.add_eos = Some(config["add_eos_token"].as_bool().unwrap_or(template_last.is_some() && template_last == eos_text && eos_text.is_some()));
        spec.chat_template = match &config["chat_template"] {
            Json::String(t) => Some(t.clone()),
            Json::Array(list) => list
                .iter()
                .find(|t| t["name"].as_str() == Some("default"))
                .or(list.first())
                .and_then(|t| t["template"].as_str())
                .map(str::to_string),
            _ => chat_template.map(str::to_string),
        };
        Ok((spec, warnings))
    }
}

impl Tokenizer {
    /// Builds the tokenizer of a Hugging Face folder: `tokenizer.json`, and `tokenizer_config.json`
    /// / `chat_template.jinja` when present.
    pub fn from_hf_dir(dir: &Path) -> Result<Self, TokenizerError> {
        let read = |name: &str| -> Result<Option<String>, TokenizerError> {
            let path = dir.join(name);
            match std::fs::read_to_string(&path) {
                Ok(text) => Ok(Some(text)),
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
                Err(e) => Err(bad(format!("{}: {e}", path.display()))),
            }
        };
        let json = read("tokenizer.json")?.ok_or_else(|| bad(format!("{} has no tokenizer.json", dir.display())))?;
        let (spec, warnings) = TokenizerSpec::from_hf_json(&json, read("tokenizer_config.json")?.as_deref(), read("chat_template.jinja")?.as_deref())?;
        let mut tokenizer = Self::from_spec(spec)?;
        tokenizer.warnings.extend(warnings);
        Ok(tokenizer)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn literal_patterns_are_escaped() {
        let re = fancy_regex::Regex::new(&regex_literal("a.b|c (d)")).unwrap();
        assert!(re.is_match("xa.b|c (d)y").unwrap());
        assert!(!re.is_match("aXb|c (d)").unwrap());
    }

    #[test]
    fn unsupported_layouts_are_refused_by_name() {
        let err = |json: &str| TokenizerSpec::from_hf_json(json, None, None).expect_err("accepted").to_string();
        assert!(err(r#"{"model": {"type": "Unigram", "vocab": []}}"#).contains("Unigram"));
        assert!(err("{ nope").contains("not valid JSON"));
        let wordlevel = r#"{"model": {"type": "BPE", "vocab": {"a": 0}, "merges": []}, "pre_tokenizer": {"type": "Whitespace"}}"#;
        assert!(err(wordlevel).contains("neither byte-level nor SentencePiece"));
        let bert_pre = r#"{"model": {"type": "BPE", "vocab": {"a": 0}, "merges": []}, "pre_tokenizer": {"type": "Sequence", "pretokenizers": [{"type": "BertPreTokenizer"}, {"type": "ByteLevel"}]}}"#;
        assert!(err(bert_pre).contains("BertPreTokenizer"));
        let clash = r#"{"model": {"type": "BPE", "vocab": {"a": 0}, "merges": []}, "decoder": {"type": "ByteLevel"}, "added_tokens": [{"id": 0, "content": "<s>", "special": true}]}"#;
        assert!(err(clash).contains("both"));
    }
}
