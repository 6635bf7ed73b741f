//! Bookkeeping of a paged KV cache: fixed-size blocks with reference counts, per-sequence block
//! tables and a prefix cache.
//!
//! The executor owns the memory of the blocks; this module only decides which block holds what.
//! A block becomes *cached* once it is full: it is keyed by a hash of its token ids chained with
//! the previous block's hash, so equal keys mean equal token prefixes, and a later sequence
//! with the same prefix takes the block instead of recomputing it. Cached blocks that no sequence
//! references stay in the cache until their memory is needed: `allocate` takes never-cached free
//! blocks first, then evicts the least recently released cached block.
//!
//! Only full blocks are shared, and a sequence writes only into positions past its shared prefix,
//! so shared blocks are never written (no copy-on-write is needed).

use std::collections::{BTreeMap, HashMap};

/// Identity of a full block: a hash of the token ids of every block up to and including it.
pub type BlockHash = [u8; 16];

/// The chained hash of the block holding `tokens` (exactly one block's worth) after `prev`.
pub fn block_hash(prev: Option<&BlockHash>, tokens: &[u32]) -> BlockHash {
    let mut h = blake3::Hasher::new();
    h.update(prev.map_or(&[0u8; 16][..], |p| &p[..]));
    for t in tokens {
        h.update(&t.to_le_bytes());
    }
    let mut out = [0u8; 16];
    out.copy_from_slice(&h.finalize().as_bytes()[..16]);
    out
}

/// Hashes of the full blocks of `tokens`.
pub fn prefix_hashes(tokens: &[u32], block_size: usize) -> Vec<BlockHash> {
    let mut out: Vec<BlockHash> = Vec::with_capacity(tokens.len() / block_size);
    for chunk in tokens.chunks_exact(block_size) {
        let h = block_hash(out.last(), chunk);
        out.push(h);
    }
    out
}

#[derive(Clone, Debug, Default)]
struct BlockState {
    refs: u32,
    hash: Option<BlockHash>,
    /// Position in `evictable` (set while the block is cached and unreferenced).
    lru_tick: Option<u64>,
}

/// The block allocator and prefix cache.
#[derive(Debug)]
pub struct BlockPool {
    block_size: usize,
    blocks: Vec<BlockState>,
    /// Unreferenced blocks holding nothing reusable.
    free: Vec<u32>,
    /// Unreferenced cached blocks by release time (oldest first).
    evictable: BTreeMap<u64, u32>,
    by_hash: HashMap<BlockHash, u32>,
    tick: u64,
    /// Blocks taken from the prefix cache since creation (for metrics).
    pub hits: u64,
}

impl BlockPool {
    pub fn new(n_blocks: usize, block_size: usize) -> Self {
        assert!(block_size > 0, "block size 0");
        Self {
            block_size,
            blocks: vec![BlockState::default(); n_blocks],
            free: (0..n_blocks as u32).rev().collect(),
            evictable: BTreeMap::new(),
            by_hash: HashMap::new(),
            tick: 0,
            hits: 0,
        }
    }

    pub fn block_size(&self) -> usize {
        self.block_size
    }

    pub fn n_blocks(&self) -> usize {
        self.blocks.len()
    }

    /// Blocks that `allocate` can hand out (free plus evictable cached ones).
    pub fn available(&self) -> usize {
        self.free.len() + self.evictable.len()
    }

    /// Blocks referenced by at least one sequence.
    pub fn in_use(&self) -> usize {
        self.blocks.len() - self.available()
    }

    /// Cached blocks (referenced or not) that a later prefix can reuse.
    pub fn cached(&self) -> usize {
        self.by_hash.len()
    }

    /// A block for one sequence (reference count 1), or `None` if every block is referenced.
    pub fn allocate(&mut self) -> Option<u32> {
        let b = match self.free.pop() {
            Some(b) => b,
            None => {
                let (_, b) = self.evictable.pop_first()?;
                let st = &mut self.blocks[b as usize];
                st.lru_tick = None;
                if let Some(h) = st.hash.take() {
                    self.by_hash.remove(&h);
                }
                b
            }
        };
        let st = &mut self.blocks[b as usize];
        debug_assert_eq!(st.refs, 0);
        st.refs = 1;
        Some(b)
    }

    /// Drop one reference; an unreferenced block becomes free, or evictable if it is cached.
    pub fn release(&mut self, b: u32) {
        let st = &mut self.blocks[b as usize];
        assert!(st.refs > 0, "block {b} released more often than taken");
        st.refs -= 1;
        if st.refs == 0 {
            if st.hash.is_some() {
                self.tick += 1;
                st.lru_tick = Some(self.tick);
                self.evictable.insert(self.tick, b);
            } else {
                self.free.push(b);
            }
        }
    }

    /// Release every block of a table.
    pub fn release_all(&mut self, table: &mut Vec<u32>) {
        for b in table.drain(..) {
            self.release(b);
        }
    }

    /// Take (a reference to) the cached blocks holding the longest prefix of `hashes`.
    pub fn lookup(&mut self, hashes: &[BlockHash]) -> Vec<u32> {
        let mut out = Vec::new();
        for h in hashes {
            let Some(&b) = self.by_hash.get(h) else { break };
            let st = &mut self.blocks[b as usize];
            if st.refs == 0 {
                if let Some(t) = st.lru_tick.take() {
                    self.evictable.remove(&t);
                }
            }
            st.refs += 1;
            out.push(b);
        }
        self.hits += out.len() as u64;
        out
    }

    /// Mark a full, computed block of a sequence as holding the prefix `hash`. If another block
    /// already holds it (two sequences computed the same prefix at once), this one stays private.
    pub fn register(&mut self, b: u32, hash: BlockHash) {
        let st = &mut self.blocks[b as usize];
        if st.hash.is_some() || self.by_hash.contains_key(&hash) {
            return;
        }
        st.hash = Some(hash);
        self.by_hash.insert(hash, b);
    }

    /// Reference count of a block (for tests and leak checks).
    pub fn refs(&self, b: u32) -> u32 {
        self.blocks[b as usize].refs
    }

    /// Check the internal invariants; returns a description of the first broken one.
    pub fn check(&self) -> Result<(), String> {
        let mut seen = vec![0u8; self.blocks.len()];
        for &b in &self.free {
            seen[b as usize] += 1;
            let st = &self.blocks[b as usize];
            if st.refs != 0 || st.hash.is_some() {
                return Err(format!("free block {b} is referenced or cached"));
            }
        }
        for (&t, &b) in &self.evictable {
            seen[b as usize] += 1;
            let st = &self.blocks[b as usize];
            if st.refs != 0 || st.hash.is_none() || st.lru_tick != Some(t) {
                return Err(format!("evictable block {b} is referenced or not cached"));
            }
        }
        for (b, st) in self.blocks.iter().enumerate() {
            let listed = seen[b];
            if (st.refs == 0 && listed != 1) || (st.refs > 0 && listed != 0) {
                return Err(format!("block {b} ({} refs) is listed {listed} times", st.refs));
            }
            if let Some(h) = st.hash {
                if self.by_hash.get(&h) != Some(&(b as u32)) {
                    return Err(format!("block {b}'s hash maps elsewhere"));
                }
            }
        }
        if self.by_hash.len() != self.blocks.iter().filter(|s| s.hash.is_some()).count() {
            return Err("hash index and blocks disagree".into());
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn hashes_chain_over_the_prefix() {
        let a = prefix_hashes(&[1, 2, 3, 4, 5, 6, 7], 2);
        assert_eq!(a.len(), 3);
        let b = prefix_hashes(&[9, 2, 3, 4], 2);
        // Same second block, different first block: different keys.
        assert_ne!(a[1], b[1]);
        assert_eq!(a[..2], prefix_hashes(&[1, 2, 3, 4], 2)[..]);
    }

    #[test]
    fn cached_prefix_is_reused_then_evicted_lru() {
        let mut p = BlockPool::new(3, 2);
        let h = prefix_hashes(&[1, 2, 3, 4], 2);
        let (a, b) = (p.allocate().unwrap(), p.allocate().unwrap());
        p.register(a, h[0]);
        p.register(b, h[1]);
        let mut t = vec![a, b];
        p.release_all(&mut t);
        assert_eq!((p.available(), p.in_use(), p.cached()), (3, 0, 2));
        // A second sequence with the same prefix takes both blocks.
        let mut again = p.lookup(&h);
        assert_eq!(again, vec![a, b]);
        assert_eq!(p.in_use(), 2);
        p.release_all(&mut again);
        // Allocation prefers the never-cached block, then evicts the least recently released.
        let c = p.allocate().unwrap();
        assert!(c != a && c != b);
        let d = p.allocate().unwrap();
        assert_eq!(d, a, "the first released cached block goes first");
        assert_eq!(p.lookup(&h), Vec::<u32>::new(), "the chain is broken at its first block");
        assert_eq!(p.cached(), 1);
        assert!(p.allocate().is_some());
        assert!(p.allocate().is_none());
        p.check().unwrap();
    }

    #[test]
    fn duplicate_registration_keeps_the_first_block() {
        let mut p = BlockPool::new(2, 4);
        let h = block_hash(None, &[1, 2, 3, 4]);
        let (a, b) = (p.allocate().unwrap(), p.allocate().unwrap());
        p.register(a, h);
        p.register(b, h);
        p.release(b);
        assert_eq!(p.cached(), 1);
        assert_eq!(p.lookup(&[h]), vec![a]);
        assert_eq!(p.refs(a), 2);
        p.check().unwrap();
    }

    #[derive(Clone, Debug)]
    enum Action {
        /// Start a sequence with this prompt (token values from a small alphabet so prefixes repeat).
        Start(Vec<u32>),
        /// Grow sequence `i % live` by `n` tokens.
        Grow(usize, usize),
        /// End sequence `i % live`.
        End(usize),
    }

    fn action() -> impl Strategy<Value = Action> {
        prop_oneof![
            prop::collection::vec(0u32..3, 0..20).prop_map(Action::Start),
            (0usize..100, 1usize..6).prop_map(|(i, n)| Action::Grow(i, n)),
            (0usize..100).prop_map(Action::End),
        ]
    }

    proptest! {
        /// Random sequences starting (with prefix lookups), growing (allocating and registering
        /// full blocks, giving up when the pool is exhausted) and ending: the invariants hold after
        /// every action, and once every sequence has ended no block is referenced.
        #[test]
        fn no_block_leaks(actions in prop::collection::vec(action(), 1..80), n_blocks in 1usize..12, bs in 1usize..5) {
            let mut p = BlockPool::new(n_blocks, bs);
            // (tokens, block table)
            let mut live: Vec<(Vec<u32>, Vec<u32>)> = Vec::new();
            let fill = |p: &mut BlockPool, toks: &[u32], table: &mut Vec<u32>| -> bool {
                while table.len() * bs < toks.len() {
                    match p.allocate() {
                        Some(b) => table.push(b),
                        None => return false,
                    }
                }
                for (i, h) in prefix_hashes(toks, bs).into_iter().enumerate() {
                    p.register(table[i], h);
                }
                true
            };
            for a in actions {
                match a {
                    Action::Start(toks) => {
                        let hashes = prefix_hashes(&toks, bs);
                        let mut table = p.lookup(&hashes[..hashes.len().min(toks.len().saturating_sub(1) / bs)]);
                        if fill(&mut p, &toks, &mut table) {
                            live.push((toks, table));
                        } else {
                            p.release_all(&mut table);
                        }
                    }
                    Action::Grow(i, n) if !live.is_empty() => {
                        let i = i % live.len();
                        let (mut toks, mut table) = live.swap_remove(i);
                        toks.extend((0..n as u32).map(|k| k % 3));
                        if fill(&mut p, &toks, &mut table) {
                            live.push((toks, table));
                        } else {
                            p.release_all(&mut table);
                        }
                    }
                    Action::End(i) if !live.is_empty() => {
                        let (_, mut table) = live.swap_remove(i % live.len());
                        p.release_all(&mut table);
                    }
                    _ => {}
                }
                prop_assert!(p.check().is_ok(), "{:?}", p.check());
                let referenced: usize = live.iter().map(|(_, t)| t.len()).sum();
                prop_assert!(p.in_use() <= referenced);
            }
            for (_, mut t) in live.drain(..) {
                p.release_all(&mut t);
            }
            prop_assert_eq!(p.in_use(), 0);
            prop_assert_eq!(p.available(), n_blocks);
            prop_assert!(p.check().is_ok());
        }
    }
}
