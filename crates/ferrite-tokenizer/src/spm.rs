//! SentencePiece-style BPE (llama.cpp's `llm_tokenizer_spm`): start from UTF-8 characters and keep
//! merging the adjacent pair whose concatenation is the vocabulary token with the highest score.
//! Characters that never become a token are written as `<0xNN>` byte tokens (byte fallback), or
//! as the unknown token when the vocabulary has no byte tokens.
//!
//! Vocabularies from a Hugging Face `tokenizer.json` carry ranked merges instead of scores (HF's
//! BPE with `byte_fallback`): then only listed pairs merge, the lowest rank first — the same loop
//! with the pair's rank as its priority.

use crate::spec::TokenType;
use crate::vocab::{Vocab, SPM_SPACE};
use crate::TokenizerError;
use std::cmp::Ordering;
use std::collections::{BinaryHeap, HashMap};

pub(crate) struct SentencePieceEncoder {
    scores: Vec<f32>,
    /// (left, right) token pair -> merge rank, when the vocabulary has ranked merges.
    ranks: Option<HashMap<(u32, u32), u32>>,
    byte_tokens: [Option<u32>; 256],
    unknown: Option<u32>,
}

/// A live symbol is the text range `start..end`; merged-away symbols have `start == end`.
#[derive(Clone, Copy)]
struct Symbol {
    start: usize,
    end: usize,
    prev: usize,
    next: usize,
}

const NONE: usize = usize::MAX;

/// A candidate merge of `left` with its right neighbour into a token of `score`.
struct Candidate {
    score: f32,
    left: usize,
    right: usize,
    len: usize,
}

impl Ord for Candidate {
    /// Highest score first; on ties the leftmost pair.
    fn cmp(&self, other: &Self) -> Ordering {
        self.score
            .total_cmp(&other.score)
            .then(other.left.cmp(&self.left))
    }
}

impl PartialOrd for Candidate {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

impl PartialEq for Candidate {
    fn eq(&self, other: &Self) -> bool {
        self.cmp(other) == Ordering::Equal
    }
}

impl Eq for Candidate {}

impl SentencePieceEncoder {
    /// With `merges` (`"left right"`, best first) the merge order is their rank and `scores` may
    /// be empty; otherwise every token needs a score.
    pub(crate) fn new(
        vocab: &Vocab,
        scores: Vec<f32>,
        merges: &[String],
        byte_tokens: [Option<u32>; 256],
        unknown: Option<u32>,
    ) -> Result<Self, TokenizerError> {
        if !merges.is_empty() {
            if merges.len() >= 1 << 24 {
                return Err(TokenizerError::LengthMismatch { what: "tokenizer merges (at most 2^24)", found: merges.len(), expected: 1 << 24 });
            }
            let mut ranks = HashMap::with_capacity(merges.len());
            for (index, merge) in merges.iter().enumerate() {
                let bad = |reason: String| TokenizerError::BadMerge { index, merge: merge.clone(), reason };
                let (left, right) = merge.split_once(' ').ok_or_else(|| bad("expected two tokens separated by a space".into()))?;
                let token = |text: &str| vocab.id(text).ok_or_else(|| bad(format!("`{text}` is not in the vocabulary")));
                let pair = (token(left)?, token(right)?);
                if vocab.id(&format!("{left}{right}")).is_none() {
                    return Err(bad("the merged token is not in the vocabulary".into()));
                }
                // A repeated pair keeps its first (best) rank.
                ranks.entry(pair).or_insert(index as u32);
            }
            return Ok(Self { scores, ranks: Some(ranks), byte_tokens, unknown });
        }
        if scores.len() != vocab.len() {
            return Err(TokenizerError::LengthMismatch {
                what: "tokenizer.ggml.scores",
                found: scores.len(),
                expected: vocab.len(),
            });
        }
        Ok(Self {
            scores,
            ranks: None,
            byte_tokens,
            unknown,
        })
    }

    /// Encodes ordinary text. `prefix_space` adds the dummy leading space SentencePiece models
    /// expect at the start of text; spaces become `▁` before merging.
    pub(crate) fn encode(
        &self,
        vocab: &Vocab,
        text: &str,
        prefix_space: bool,
        out: &mut Vec<u32>,
    ) -> Result<(), TokenizerError> {
        let mut escaped = String::with_capacity(text.len() + 3);
        if prefix_space {
            escaped.push(SPM_SPACE);
        }
        escaped.extend(text.chars().map(|c| if c == ' ' { SPM_SPACE } else { c }));

        let mut symbols: Vec<Symbol> = escaped
            .char_indices()
            .enumerate()
            .map(|(i, (start, ch))| Symbol {
                start,
                end: start + ch.len_utf8(),
                prev: i.wrapping_sub(1),
                next: i + 1,
            })
            .collect();
        match symbols.last_mut() {
            Some(last) => last.next = NONE,
            None => return Ok(()),
        }

        let mut heap = BinaryHeap::new();
        for left in 0..symbols.len() - 1 {
            self.push_candidate(vocab, &escaped, &symbols, left, &mut heap);
        }
        while let Some(candidate) = heap.pop() {
            let (left, right) = (symbols[candidate.left], symbols[candidate.right]);
            // Stale when either side was merged since: the pair is no longer adjacent or sized so.
            if left.start == left.end
                || left.next != candidate.right
                || right.end - left.start != candidate.len
            {
                continue;
            }
            symbols[candidate.left].end = right.end;
            symbols[candidate.left].next = right.next;
            symbols[candidate.right].end = right.start;
            if right.next != NONE {
                symbols[right.next].prev = candidate.left;
            }
            if left.prev != NONE {
                self.push_candidate(vocab, &escaped, &symbols, left.prev, &mut heap);
            }
            self.push_candidate(vocab, &escaped, &symbols, candidate.left, &mut heap);
        }

        let mut at = 0;
        while at != NONE {
            let Symbol {
                start, end, next, ..
            } = symbols[at];
            let piece = &escaped[start..end];
            match mergeable_token(vocab, piece) {
                Some(id) => out.push(id),
                None => self.push_fallback(piece, out)?,
            }
            at = next;
        }
        Ok(())
    }

    fn push_candidate(
        &self,
        vocab: &Vocab,
        text: &str,
        symbols: &[Symbol],
        left: usize,
        heap: &mut BinaryHeap<Candidate>,
    ) {
        let right = symbols[left].next;
        if right == NONE {
            return;
        }
        let (start, end) = (symbols[left].start, symbols[right].end);
        let Some(id) = mergeable_token(vocab, &text[start..end]) else {
            return;
        };
        let score = match &self.ranks {
            None => self.scores[id as usize],
            Some(ranks) => {
                let mid = symbols[right].start;
                let pair = vocab.id(&text[start..mid]).zip(vocab.id(&text[mid..end]));
                // Ranks stay below 2^24, so they are exact as f32; lower rank first.
                match pair.and_then(|p| ranks.get(&p)) {
                    Some(&rank) => -(rank as f32),
                    None => return,
                }
            }
        };
        heap.push(Candidate {
            score,
            left,
            right,
            len: end - start,
        });
    }

    fn push_fallback(&self, piece: &str, out: &mut Vec<u32>) -> Result<(), TokenizerError> {
        let bytes: Option<Vec<u32>> = piece
            .bytes()
            .map(|b| self.byte_tokens[usize::from(b)])
            .collect();
        match (bytes, self.unknown) {
            (Some(ids), _) => out.extend(ids),
            // One unknown token stands for the whole unencodable character.
            (None, Some(unknown)) => out.push(unknown),
            (None, None) => {
                let byte = piece
                    .bytes()
                    .find(|&b| self.byte_tokens[usize::from(b)].is_none());
                return Err(TokenizerError::Unencodable {
                    byte: byte.unwrap_or_default(),
                });
            }
        }
        Ok(())
    }
}

/// Only ordinary and user-defined pieces take part in merging; control, byte, unknown and unused
/// tokens are never produced from text this way (as in SentencePiece).
fn mergeable_token(vocab: &Vocab, piece: &str) -> Option<u32> {
    let id = vocab.id(piece)?;
    match vocab.token_type(id)? {
        t if t.is_normal() || t == TokenType::UserDefined => Some(id),
        _ => None,
    }
}
