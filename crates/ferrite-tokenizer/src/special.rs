//! Finding special-token strings (control and user-defined tokens) in input text.

use crate::vocab::Vocab;

/// A run of ordinary text, or a special token found whole in the input.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Fragment<'t> {
    Text(&'t str),
    Token(u32),
}

/// Leftmost-longest matcher over the special tokens' texts (what HF's added-token splitter does).
pub(crate) struct SpecialMatcher {
    /// Candidates by first byte, longest first (ties: lowest id first).
    by_first_byte: Vec<Vec<(Box<[u8]>, u32)>>,
}

impl SpecialMatcher {
    pub(crate) fn new(vocab: &Vocab) -> Self {
        let mut by_first_byte: Vec<Vec<(Box<[u8]>, u32)>> = vec![Vec::new(); 256];
        for (id, text, token_type) in vocab.iter() {
            if let (true, Some(&first)) = (token_type.is_special(), text.as_bytes().first()) {
                by_first_byte[usize::from(first)].push((text.as_bytes().into(), id));
            }
        }
        for bucket in &mut by_first_byte {
            bucket.sort_by(|(a, a_id), (b, b_id)| b.len().cmp(&a.len()).then(a_id.cmp(b_id)));
        }
        Self { by_first_byte }
    }

    /// Cuts `text` into ordinary runs and special tokens, in order; empty runs are left out.
    pub(crate) fn split<'t>(&self, text: &'t str) -> Vec<Fragment<'t>> {
        let bytes = text.as_bytes();
        let mut fragments = Vec::new();
        let mut run_start = 0;
        let mut at = 0;
        while at < bytes.len() {
            let found = self.by_first_byte[usize::from(bytes[at])]
                .iter()
                .find(|(special, _)| bytes[at..].starts_with(special));
            match found {
                Some((special, id)) => {
                    // A match starts with a UTF-8 lead byte, so `at` is a char boundary.
                    if let Some(run) = text.get(run_start..at).filter(|run| !run.is_empty()) {
                        fragments.push(Fragment::Text(run));
                    }
                    fragments.push(Fragment::Token(*id));
                    at += special.len();
                    run_start = at;
                }
                None => at += 1,
            }
        }
        if let Some(run) = text.get(run_start..).filter(|run| !run.is_empty()) {
            fragments.push(Fragment::Text(run));
        }
        fragments
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::byte_level::ByteAlphabet;
    use crate::spec::{TokenType, TokenizerModel};

    fn matcher() -> SpecialMatcher {
        let texts = ["a", "<|x|>", "<|x|>y", "<|", "<b>", "é"];
        let types = [
            TokenType::Normal,
            TokenType::Control,
            TokenType::UserDefined,
            TokenType::Normal,
            TokenType::Control,
            TokenType::UserDefined,
        ];
        let vocab = Vocab::new(
            TokenizerModel::SentencePiece,
            texts.iter().map(|t| t.to_string()).collect(),
            types.to_vec(),
            &ByteAlphabet::new(),
        )
        .unwrap();
        SpecialMatcher::new(&vocab)
    }

    #[test]
    fn longest_match_wins_and_text_between_is_kept() {
        use Fragment::*;
        let m = matcher();
        assert_eq!(
            m.split("<|x|>yz<|x|><b>"),
            [Token(2), Text("z"), Token(1), Token(4)]
        );
        assert_eq!(m.split("q<|x|"), [Text("q<|x|")]);
        assert_eq!(m.split("ééa"), [Token(5), Token(5), Text("a")]);
        assert_eq!(m.split(""), []);
    }

    #[test]
    fn normal_tokens_are_not_special() {
        assert_eq!(matcher().split("<|a"), [Fragment::Text("<|a")]);
    }
}
