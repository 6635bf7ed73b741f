//! The prefix cache's recurrent-state snapshots, for models with Gated DeltaNet layers.
//!
//! Cached KV blocks restore the attention layers after a prefix, but not the recurrent state,
//! which sums every token before it. So while a sequence runs, its state is copied, every
//! `stride` tokens, into an executor state slot past the running sequences' (see
//! `Executor::copy_state`), keyed by the hash of the block that ends there: a hash names the
//! whole token prefix. A later sequence whose prompt starts with that prefix takes the prefix's
//! blocks and a copy of the state, and computes from there. Snapshots are few (each is a whole
//! state: megabytes on real models); when all are taken the least recently used one is reused.

use crate::kv_pages::BlockHash;
use std::collections::HashMap;

pub struct StateSnapshots {
    /// Executor slot of snapshot `i`: `first_slot + i`.
    first_slot: usize,
    count: usize,
    stride: usize,
    /// The prefix hash each snapshot holds the state after, with its last use.
    by_hash: HashMap<BlockHash, (usize, u64)>,
    /// Snapshots holding nothing.
    free: Vec<usize>,
    tick: u64,
}

impl StateSnapshots {
    /// `count` snapshots in executor slots `first_slot..first_slot + count`, one every `stride`
    /// tokens of a sequence (a positive multiple of the block size).
    pub fn new(first_slot: usize, count: usize, stride: usize) -> Self {
        assert!(stride > 0, "snapshot stride");
        StateSnapshots { first_slot, count, stride, by_hash: HashMap::new(), free: (0..count).rev().collect(), tick: 0 }
    }

    /// Tokens between snapshots.
    pub fn stride(&self) -> usize {
        self.stride
    }

    /// Whether a snapshot slot exists at all.
    pub fn enabled(&self) -> bool {
        self.count > 0
    }

    /// Of the prefixes ending with `hashes[..k]` for the `k` in `counts` (in any order), the
    /// longest whose state is kept: `(k, executor slot)`, marked as used.
    pub fn longest(&mut self, hashes: &[BlockHash], counts: impl Iterator<Item = usize>) -> Option<(usize, usize)> {
        let best = counts.filter(|&k| k > 0 && k <= hashes.len()).filter(|&k| self.by_hash.contains_key(&hashes[k - 1])).max()?;
        self.tick += 1;
        let entry = self.by_hash.get_mut(&hashes[best - 1]).expect("found above");
        entry.1 = self.tick;
        Some((best, self.first_slot + entry.0))
    }

    /// The executor slot to copy the state after the prefix `hash` into: `None` if it is kept
    /// already, else a free snapshot or the least recently used one (which forgets its prefix).
    pub fn slot_for(&mut self, hash: BlockHash) -> Option<usize> {
        if !self.enabled() || self.by_hash.contains_key(&hash) {
            return None;
        }
        let i = match self.free.pop() {
            Some(i) => i,
            None => {
                let (&old, &(i, _)) = self.by_hash.iter().min_by_key(|(_, (_, used))| *used)?;
                self.by_hash.remove(&old);
                i
            }
        };
        self.tick += 1;
        self.by_hash.insert(hash, (i, self.tick));
        Some(self.first_slot + i)
    }

    /// Drop what `hash`'s snapshot holds (its copy failed).
    pub fn forget(&mut self, hash: &BlockHash) {
        if let Some((i, _)) = self.by_hash.remove(hash) {
            self.free.push(i);
        }
    }

    /// Snapshots holding a state.
    pub fn len(&self) -> usize {
        self.by_hash.len()
    }

    pub fn is_empty(&self) -> bool {
        self.by_hash.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn h(i: u8) -> BlockHash {
        [i; 16]
    }

    #[test]
    fn snapshots_are_found_by_prefix_and_reused_least_recent_first() {
        let mut s = StateSnapshots::new(8, 2, 32);
        assert_eq!(s.slot_for(h(1)), Some(8));
        assert_eq!(s.slot_for(h(1)), None, "kept already");
        assert_eq!(s.slot_for(h(3)), Some(9));
        let hashes = [h(0), h(1), h(2), h(3), h(4)];
        // Prefixes of 2 and 4 blocks are kept; 3 blocks is not a snapshot point.
        assert_eq!(s.longest(&hashes, [2, 4].into_iter()), Some((4, 9)));
        assert_eq!(s.longest(&hashes, [2].into_iter()), Some((2, 8)));
        assert_eq!(s.longest(&hashes[..3], [2, 4].into_iter()), Some((2, 8)), "a prefix past the hashes is not looked up");
        assert_eq!(s.longest(&hashes, [0, 1, 3].into_iter()), None);
        // h(1) was used last: a third prefix takes h(3)'s snapshot.
        assert_eq!(s.slot_for(h(5)), Some(9));
        assert_eq!(s.longest(&hashes, [4].into_iter()), None);
        assert_eq!(s.len(), 2);
        s.forget(&h(5));
        assert_eq!(s.len(), 1);
        assert_eq!(s.slot_for(h(6)), Some(9), "a forgotten snapshot is free again");
        let mut none = StateSnapshots::new(4, 0, 16);
        assert!(!none.enabled());
        assert_eq!(none.slot_for(h(1)), None);
        assert!(none.is_empty());
    }
}
