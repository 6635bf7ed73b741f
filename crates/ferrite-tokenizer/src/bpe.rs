//! Byte-level BPE: ranked merges applied to each pre-tokenized word.
//!
//! A word starts as one symbol per byte; a heap keyed on (merge rank, position) always applies the
//! best merge next, and a doubly linked list lets each merge touch only its two neighbours, so a
//! word of n bytes costs O(n log n) rather than repeated rescans.

use crate::byte_level::ByteAlphabet;
use crate::pretokenize::PreTokenizer;
use crate::vocab::Vocab;
use crate::TokenizerError;
use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap};

/// Where a pair of adjacent tokens goes: its priority (lower first) and the merged token.
#[derive(Clone, Copy)]
struct Merge {
    rank: usize,
    merged: u32,
}

pub(crate) struct BytePairEncoder {
    merges: HashMap<(u32, u32), Merge>,
    byte_tokens: [Option<u32>; 256],
    pre_tokenizer: PreTokenizer,
}

/// One symbol of the word being merged. Merging folds the right symbol into the left one, so the
/// list only ever shrinks; `NONE` marks list ends.
#[derive(Clone, Copy)]
struct Symbol {
    token: u32,
    prev: usize,
    next: usize,
    alive: bool,
}

const NONE: usize = usize::MAX;

impl BytePairEncoder {
    pub(crate) fn new(
        vocab: &Vocab,
        merges: &[String],
        byte_tokens: [Option<u32>; 256],
        pre_tokenizer: PreTokenizer,
    ) -> Result<Self, TokenizerError> {
        if merges.is_empty() {
            return Err(TokenizerError::MissingMerges);
        }
        let mut table = HashMap::with_capacity(merges.len());
        for (index, merge) in merges.iter().enumerate() {
            let bad = |reason: String| TokenizerError::BadMerge {
                index,
                merge: merge.clone(),
                reason,
            };
            let (left, right) = merge
                .split_once(' ')
                .ok_or_else(|| bad("expected two tokens separated by a space".into()))?;
            let token = |text: &str| {
                vocab
                    .id(text)
                    .ok_or_else(|| bad(format!("`{text}` is not in the vocabulary")))
            };
            let (left_id, right_id) = (token(left)?, token(right)?);
            let merged = vocab
                .id(&format!("{left}{right}"))
                .ok_or_else(|| bad("the merged token is not in the vocabulary".into()))?;
            // A repeated pair keeps its first (best) rank.
            table.entry((left_id, right_id)).or_insert(Merge {
                rank: index,
                merged,
            });
        }
        Ok(Self {
            merges: table,
            byte_tokens,
            pre_tokenizer,
        })
    }

    /// Encodes ordinary text (no special tokens in it) and appends the ids to `out`.
    pub(crate) fn encode(
        &self,
        vocab: &Vocab,
        alphabet: &ByteAlphabet,
        text: &str,
        out: &mut Vec<u32>,
    ) -> Result<(), TokenizerError> {
        let mut symbols = Vec::new();
        for (start, end) in self.pre_tokenizer.split(text)? {
            let word = &text.as_bytes()[start..end];
            if self.pre_tokenizer.ignore_merges {
                if let Some(id) = vocab.id(&alphabet.encode(word)) {
                    out.push(id);
                    continue;
                }
            }
            self.merge_word(word, &mut symbols);
            out.extend(symbols.iter().filter(|s| s.alive).map(|s| s.token));
        }
        Ok(())
    }

    /// Merges one word. Bytes the vocabulary has no token for are dropped, as HF `tokenizers`
    /// and llama.cpp do (some vocabularies lack bytes never seen in training, like 0xF1).
    fn merge_word(&self, word: &[u8], symbols: &mut Vec<Symbol>) {
        symbols.clear();
        for token in word
            .iter()
            .filter_map(|&byte| self.byte_tokens[usize::from(byte)])
        {
            let i = symbols.len();
            symbols.push(Symbol {
                token,
                prev: i.wrapping_sub(1),
                next: i + 1,
                alive: true,
            });
        }
        let Some(last) = symbols.last_mut() else {
            return;
        };
        last.next = NONE;

        // Entries: (rank, left position, left token, right token); stale ones are skipped on pop.
        let mut heap = BinaryHeap::new();
        let push_pair = |heap: &mut BinaryHeap<_>, symbols: &[Symbol], left: usize| {
            let right = symbols[left].next;
            if right == NONE {
                return;
            }
            let pair = (symbols[left].token, symbols[right].token);
            if let Some(merge) = self.merges.get(&pair) {
                heap.push(Reverse((merge.rank, left, pair.0, pair.1)));
            }
        };
        for left in 0..symbols.len() {
            push_pair(&mut heap, symbols, left);
        }
        while let Some(Reverse((_, left, left_token, right_token))) = heap.pop() {
            let right = symbols[left].next;
            // A symbol's token only ever grows, so equal tokens mean the pair is still there.
            if !symbols[left].alive
                || right == NONE
                || symbols[left].token != left_token
                || symbols[right].token != right_token
            {
                continue;
            }
            let Some(merge) = self.merges.get(&(left_token, right_token)) else {
                continue;
            };
            symbols[left].token = merge.merged;
            symbols[right].alive = false;
            let after = symbols[right].next;
            symbols[left].next = after;
            if after != NONE {
                symbols[after].prev = left;
            }
            if symbols[left].prev != NONE {
                push_pair(&mut heap, symbols, symbols[left].prev);
            }
            push_pair(&mut heap, symbols, left);
        }
    }
}
