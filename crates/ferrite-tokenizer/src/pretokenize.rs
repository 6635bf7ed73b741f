//! Pre-tokenizers of byte-level BPE: the regex splits that cut text into words before merging.
//!
//! Which rules a vocabulary uses is named by `tokenizer.ggml.pre`; the name -> rules table follows
//! llama.cpp's `llama-vocab.cpp`, and the patterns are those of the models' own `tokenizer.json`
//! (fancy-regex handles their look-aheads and case-insensitive groups, so they need no rewriting).

use crate::TokenizerError;
use fancy_regex::Regex;

pub(crate) const GPT2: &str = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+";

const LLAMA3: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

const QWEN2: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

const QWEN35: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

const GPT4O: &str = r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+";

const TEKKEN: &str = r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+";

pub(crate) const SINGLE_DIGITS: &str = r"\p{N}";

/// DeepSeek LLM's letter class (cased letters), written as escapes so that no Unicode
/// normalisation of this source file can change it.
const DEEPSEEK_LLM: &[&str] = &[
    r"[\r\n]",
    concat!(
        r"\s?[",
        r"\x{0041}-\x{005A}\x{0061}-\x{007A}\x{00B5}\x{00C0}-\x{00D6}\x{00D8}-\x{00F6}",
        r"\x{00F8}-\x{01BA}\x{01BC}-\x{01BF}\x{01C4}-\x{0293}\x{0295}-\x{02AF}",
        r"\x{0370}-\x{0373}\x{0376}-\x{0377}\x{037B}-\x{037D}\x{037F}\x{0386}\x{0388}-\x{038A}",
        r"\x{038C}\x{038E}-\x{03A1}\x{03A3}-\x{03F5}\x{03F7}-\x{0481}\x{048A}-\x{052F}",
        r"\x{0531}-\x{0556}\x{10A0}-\x{10C5}\x{13A0}-\x{13F5}\x{13F8}-\x{13FD}",
        r"\x{1C90}-\x{1CBA}\x{1CBD}-\x{1CBF}\x{1D00}-\x{1D2B}\x{1D6B}-\x{1D77}",
        r"\x{1D79}-\x{1D9A}\x{1E00}-\x{1F15}\x{1F18}-\x{1F1D}\x{1F20}-\x{1F45}",
        r"\x{1F48}-\x{1F4D}\x{1F50}-\x{1F57}\x{1F59}\x{1F5B}\x{1F5D}\x{1F5F}-\x{1F7D}",
        r"\x{1F80}-\x{1FB4}\x{1FB6}-\x{1FBC}\x{1FBE}\x{1FC2}-\x{1FC4}\x{1FC6}-\x{1FCC}",
        r"\x{1FD0}-\x{1FD3}\x{1FD6}-\x{1FDB}\x{1FE0}-\x{1FEC}\x{1FF2}-\x{1FF4}",
        r"\x{1FF6}-\x{1FFC}\x{2102}\x{2107}\x{210A}-\x{2113}\x{2115}\x{2119}-\x{211D}\x{2124}",
        r"\x{2126}\x{2128}\x{212A}-\x{212D}\x{212F}-\x{2134}\x{2139}\x{213C}-\x{213F}",
        r"\x{2145}-\x{2149}\x{214E}\x{2183}-\x{2184}\x{2C00}-\x{2C7B}\x{2C7E}-\x{2CE4}",
        r"\x{2CEB}-\x{2CEE}\x{2CF2}-\x{2CF3}\x{A640}-\x{A66D}\x{A680}-\x{A69B}",
        r"\x{A722}-\x{A76F}\x{A771}-\x{A787}\x{A78B}-\x{A78E}\x{AB70}-\x{ABBF}",
        r"\x{FB00}-\x{FB06}\x{FB13}-\x{FB17}\x{FF21}-\x{FF3A}\x{FF41}-\x{FF5A}",
        r"\x{10400}-\x{1044F}\x{104B0}-\x{104D3}\x{104D8}-\x{104FB}\x{10C80}-\x{10CB2}",
        r"\x{10CC0}-\x{10CF2}\x{118A0}-\x{118DF}\x{1E900}-\x{1E943}",
        r"]+"
    ),
    r"\s?[!-/:-~！-／：-～‘-‟　-。]+",
    r"\s+$",
    r"[一-龥ࠀ-一가-퟿]+",
    r"\p{N}+",
];

const DEEPSEEK_CODER: &[&str] = &[
    r"[\r\n]",
    r"\s?\p{L}+",
    r"\s?\p{P}+",
    r"[一-龥ࠀ-一가-퟿]+",
    r"\p{N}",
];

const DEEPSEEK_V3: &[&str] = &[
    r"\p{N}{1,3}",
    r"[一-龥぀-ゟ゠-ヿ]+",
    r##"[!"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"##,
];

const FALCON: &[&str] = &[
    r"[\p{P}\$\+<=>\^~\|`]+",
    r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)",
    r"[0-9][0-9][0-9]",
];

const BLOOM: &str = r" ?[^(\s|.,!?…。，、।۔،)]+";

/// The split rules for one `tokenizer.ggml.pre` name.
struct Rules {
    /// Applied in order; each one re-splits every piece the previous ones produced.
    stages: &'static [&'static str],
    /// Look a whole word up in the vocabulary before merging (HF `ignore_merges`).
    ignore_merges: bool,
}

const fn rules(stages: &'static [&'static str]) -> Rules {
    Rules {
        stages,
        ignore_merges: false,
    }
}

fn rules_for(pre: &str) -> Option<Rules> {
    Some(match pre {
        "default" | "gpt2" | "gpt-2" | "phi-2" | "mpt" | "olmo" | "jais" | "jina-es"
        | "jina-de" | "jina-v1-en" | "jina-v2-es" | "jina-v2-de" | "jina-v2-code"
        | "roberta-bpe" | "gigachat" | "a.x-4.0" | "mellum" | "modern-bert" | "exaone4"
        | "trillion" | "granite-docling" => rules(&[GPT2]),
        "llama3" | "llama-v3" | "llama-bpe" | "falcon3" | "falcon-h1" | "pixtral" | "midm-2.0"
        | "lfm2" => Rules {
            stages: &[LLAMA3],
            ignore_merges: true,
        },
        "tekken" => Rules {
            stages: &[TEKKEN],
            ignore_merges: true,
        },
        "dbrx" | "smaug-bpe" | "chatglm-bpe" | "glm4" => rules(&[LLAMA3]),
        "qwen2" | "deepseek-r1-qwen" | "megrez" | "stablelm2" | "hunyuan" | "kormo" => {
            rules(&[QWEN2])
        }
        "qwen35" => rules(&[QWEN35]),
        "smollm" | "starcoder" | "refact" | "command-r" | "codeshell" | "exaone" | "minerva-7b" => {
            rules(&[SINGLE_DIGITS, GPT2])
        }
        "deepseek-llm" => rules(DEEPSEEK_LLM),
        "deepseek-coder" => rules(DEEPSEEK_CODER),
        "deepseek-v3" | "hunyuan-dense" => rules(DEEPSEEK_V3),
        "falcon" => rules(FALCON),
        "bloom" | "poro-chat" | "gpt3-finnish" => rules(&[BLOOM]),
        "viking" => rules(&[BLOOM, SINGLE_DIGITS]),
        "gpt-4o" | "llama4" | "minimax-m2" | "kanana2" => rules(&[GPT4O]),
        _ => return None,
    })
}

/// Compiled split rules of one vocabulary.
pub(crate) struct PreTokenizer {
    stages: Vec<Regex>,
    pub(crate) ignore_merges: bool,
}

impl PreTokenizer {
    /// Builds the rules named by `pre`. Unknown or missing names fall back to GPT-2's regex and
    /// return a warning, as llama.cpp does for vocabularies converted without a pre-tokenizer.
    pub(crate) fn for_name(pre: Option<&str>) -> Result<(Self, Option<String>), TokenizerError> {
        let (rules, warning) = match pre.and_then(rules_for) {
            Some(rules) => (rules, None),
            None => {
                let warning = match pre {
                    Some(name) => format!(
                        "unknown pre-tokenizer `{name}` (tokenizer.ggml.pre); using the GPT-2 split regex, tokenization may differ from the model's"
                    ),
                    None => "tokenizer.ggml.pre is missing; using the GPT-2 split regex, tokenization may differ from the model's".to_string(),
                };
                (rules(&[GPT2]), Some(warning))
            }
        };
        let stages = rules
            .stages
            .iter()
            .map(|pattern| {
                Regex::new(pattern).map_err(|e| TokenizerError::Regex {
                    pattern: (*pattern).to_string(),
                    message: e.to_string(),
                })
            })
            .collect::<Result<_, _>>()?;
        Ok((
            Self {
                stages,
                ignore_merges: rules.ignore_merges,
            },
            warning,
        ))
    }

    /// Explicit split stages (e.g. from a `tokenizer.json`).
    pub(crate) fn from_patterns(patterns: &[String], ignore_merges: bool) -> Result<Self, TokenizerError> {
        let stages = patterns
            .iter()
            .map(|pattern| {
                Regex::new(pattern).map_err(|e| TokenizerError::Regex { pattern: pattern.clone(), message: e.to_string() })
            })
            .collect::<Result<_, _>>()?;
        Ok(Self { stages, ignore_merges })
    }

    /// Splits `text` into words, as byte ranges in order. Both the matches of each stage and the
    /// text between them become pieces (HF's `Split` with `isolated` behaviour), so the pieces
    /// always cover the whole text.
    pub(crate) fn split(&self, text: &str) -> Result<Vec<(usize, usize)>, TokenizerError> {
        let mut pieces = vec![(0, text.len())];
        for regex in &self.stages {
            let mut next = Vec::with_capacity(pieces.len() * 2);
            for &(start, end) in &pieces {
                let piece = &text[start..end];
                let mut cursor = 0;
                for found in regex.find_iter(piece) {
                    let found = found.map_err(|e| TokenizerError::Regex {
                        pattern: regex.as_str().to_string(),
                        message: e.to_string(),
                    })?;
                    if found.start() > cursor {
                        next.push((start + cursor, start + found.start()));
                    }
                    if found.end() > found.start() {
                        next.push((start + found.start(), start + found.end()));
                    }
                    cursor = found.end();
                }
                if cursor < piece.len() {
                    next.push((start + cursor, end));
                }
            }
            pieces = next;
        }
        Ok(pieces)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn compile(pre: &str) -> PreTokenizer {
        let (pre, warning) = PreTokenizer::for_name(Some(pre)).unwrap();
        assert!(warning.is_none());
        pre
    }

    fn split_words(pre: &PreTokenizer, text: &str) -> Vec<String> {
        pre.split(text)
            .unwrap()
            .into_iter()
            .map(|(s, e)| text[s..e].to_string())
            .collect()
    }

    fn words(pre: &str, text: &str) -> Vec<String> {
        split_words(&compile(pre), text)
    }

    #[test]
    fn every_named_rule_set_compiles() {
        for name in [
            "gpt2",
            "llama-bpe",
            "tekken",
            "qwen2",
            "qwen35",
            "smollm",
            "deepseek-llm",
            "deepseek-coder",
            "deepseek-v3",
            "falcon",
            "bloom",
            "viking",
            "gpt-4o",
        ] {
            let (pre, warning) = PreTokenizer::for_name(Some(name)).unwrap();
            assert!(warning.is_none(), "{name}");
            let text = "Hello, world! 12345 héllo 日本語\n\n  x";
            let pieces = pre.split(text).unwrap();
            // Pieces tile the text exactly: nothing lost, nothing overlapping.
            let mut cursor = 0;
            for (s, e) in pieces {
                assert_eq!(s, cursor, "{name}");
                assert!(e > s, "{name}");
                cursor = e;
            }
            assert_eq!(cursor, text.len(), "{name}");
        }
    }

    #[test]
    fn gpt2_keeps_one_space_with_the_next_word() {
        // `\s+(?!\S)` leaves the last whitespace character to the next word.
        assert_eq!(
            words("gpt2", "a  b's\n\nc "),
            ["a", " ", " b", "'s", "\n", "\n", "c", " "]
        );
    }

    #[test]
    fn smollm_isolates_every_digit() {
        assert_eq!(words("smollm", "x 123ab"), ["x", " ", "1", "2", "3", "ab"]);
    }

    #[test]
    fn llama3_groups_digits_by_three_and_contractions_case_insensitively() {
        assert_eq!(
            words("llama-bpe", "12345 DON'T"),
            ["123", "45", " DON", "'T"]
        );
    }

    /// fixtures/tokenizer/pretokenizers.json: HF `tokenizers` splits of the same texts.
    #[test]
    fn splits_match_hf_pre_tokenizers() {
        #[derive(serde::Deserialize)]
        struct Case {
            text: String,
            pieces: Vec<String>,
        }
        let path = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../../fixtures/tokenizer/pretokenizers.json"
        );
        let json = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{path}: {e}"));
        let fixture: std::collections::BTreeMap<String, Vec<Case>> =
            serde_json::from_str(&json).unwrap();
        assert!(fixture.len() >= 7);
        let mut failures = Vec::new();
        for (name, cases) in &fixture {
            let pre = compile(name);
            for case in cases {
                let got = split_words(&pre, &case.text);
                if got != case.pieces {
                    failures.push(format!(
                        "{name} {:?}\n  got      {got:?}\n  expected {:?}",
                        case.text, case.pieces
                    ));
                }
            }
        }
        assert!(
            failures.is_empty(),
            "{} mismatches:\n{}",
            failures.len(),
            failures.join("\n")
        );
    }

    #[test]
    fn unknown_name_falls_back_with_a_warning() {
        let (pre, warning) = PreTokenizer::for_name(Some("no-such-pre")).unwrap();
        assert!(warning.unwrap().contains("no-such-pre"));
        assert_eq!(pre.split("a b").unwrap(), [(0, 1), (1, 3)]);
        let (_, warning) = PreTokenizer::for_name(None).unwrap();
        assert!(warning.unwrap().contains("missing"));
    }
}
