//! The block pool: bookkeeping of fixed-size KV-cache blocks.
//!
//! Origin: PagedAttention (Kwon et al. 2023, "Efficient Memory Management for Large Language
//! Model Serving with PagedAttention", SOSP) and vLLM's block manager; the free queue and prefix
//! cache follow vLLM v1's `BlockPool` / `FreeKVCacheBlockQueue` (`vllm/v1/core/block_pool.py`,
//! `kv_cache_utils.py`).
//!
//! The pool owns no tensor data: it hands out block ids `0..num_blocks` and counts references.
//! [`crate::paged_cache::PagedKvCache`] maps block ids to storage.
//!
//! # Structure and complexity
//! - **Reference counts**, one per block. A block is *in use* while its count is positive; a
//!   forked sequence or a prefix-cache hit adds a reference instead of copying.
//! - **Free queue**: an intrusive doubly linked list over block ids (`prev`/`next` arrays), so
//!   that [`allocate`](BlockPool::allocate), [`free`](BlockPool::free) and taking a cached free
//!   block back out of the middle of the queue ([`incref`](BlockPool::incref)) are all **O(1)**.
//!   Freed blocks without cached content go to the *front* (reused first); freed blocks that hold
//!   a cached full-block prefix go to the *back*, so that eviction (always from the front) is
//!   least-recently-freed first.
//! - **Prefix cache**: a hash map from [`PrefixKey`] (hash of the parent block's key chain plus
//!   this block's exact token ids) to the block holding those keys and values. Lookup and insert
//!   are O(block_size) (hashing the tokens). A cached block stays in the map while it is free and
//!   is evicted from the map only when [`allocate`](BlockPool::allocate) reuses it.
//!
//! Memory of the bookkeeping: 4 words per block plus the keys of cached blocks.

use std::collections::HashMap;
use std::hash::{DefaultHasher, Hash, Hasher};

use crate::{Error, Result};

/// Index of a block in the pool (and in the cache's storage), `0..num_blocks`.
pub type BlockId = u32;

const NIL: u32 = u32::MAX;

/// Identity of a full block's content: the chain hash of everything before it and its own token
/// ids. Two sequences whose first `k * block_size` tokens are equal produce equal keys for their
/// first `k` blocks (vLLM's "hash of the block's tokens and all previous tokens"). Token ids are
/// compared exactly; only the prefix before the block is summarized by a 64-bit hash.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct PrefixKey {
    /// [`PrefixKey::chain_hash`] of the previous block (0 for the first block).
    pub parent: u64,
    /// The block's token ids (exactly `block_size` of them).
    pub tokens: Box<[u32]>,
}

impl PrefixKey {
    /// The key of a block holding `tokens` after a prefix whose last block had chain hash
    /// `parent` (0 for the first block).
    pub fn new(parent: u64, tokens: &[u32]) -> Self {
        Self { parent, tokens: tokens.into() }
    }

    /// Hash of this key, used as the `parent` of the next block. Deterministic across runs
    /// (SipHash with fixed keys).
    pub fn chain_hash(&self) -> u64 {
        let mut h = DefaultHasher::new();
        self.hash(&mut h);
        // Never 0, so that "no parent" stays distinct.
        h.finish().max(1)
    }
}

/// Reference-counted pool of `num_blocks` KV-cache blocks with an O(1) free queue and a prefix
/// cache of full blocks. See the [module docs](self).
#[derive(Debug)]
pub struct BlockPool {
    ref_count: Vec<u32>,
    prev: Vec<u32>,
    next: Vec<u32>,
    in_free: Vec<bool>,
    head: u32,
    tail: u32,
    num_free: usize,
    keys: Vec<Option<PrefixKey>>,
    cached: HashMap<PrefixKey, BlockId>,
    evictions: u64,
}

impl BlockPool {
    /// A pool of `num_blocks` free blocks.
    ///
    /// # Errors
    /// [`Error::InvalidRequest`] if `num_blocks` is 0 or does not fit a `u32` id.
    pub fn new(num_blocks: usize) -> Result<Self> {
        if num_blocks == 0 || num_blocks >= NIL as usize {
            return Err(Error::InvalidRequest(format!("block pool size must be in 1..{NIL}, got {num_blocks}")));
        }
        let n = num_blocks as u32;
        let prev = (0..n).map(|i| if i == 0 { NIL } else { i - 1 }).collect();
        let next = (0..n).map(|i| if i + 1 == n { NIL } else { i + 1 }).collect();
        Ok(Self {
            ref_count: vec![0; num_blocks],
            prev,
            next,
            in_free: vec![true; num_blocks],
            head: 0,
            tail: n - 1,
            num_free: num_blocks,
            keys: vec![None; num_blocks],
            cached: HashMap::new(),
            evictions: 0,
        })
    }

    /// Total number of blocks.
    pub fn num_blocks(&self) -> usize {
        self.ref_count.len()
    }

    /// Blocks not referenced by any sequence (including free blocks that still hold a cached
    /// prefix and can be evicted). O(1).
    pub fn num_free(&self) -> usize {
        self.num_free
    }

    /// Blocks referenced by at least one sequence. O(1).
    pub fn num_used(&self) -> usize {
        self.num_blocks() - self.num_free
    }

    /// Number of full blocks currently registered in the prefix cache (used or free).
    pub fn num_cached(&self) -> usize {
        self.cached.len()
    }

    /// Cached blocks evicted so far (their content was overwritten by a new allocation).
    pub fn evictions(&self) -> u64 {
        self.evictions
    }

    /// Reference count of `block` (0 when free).
    pub fn ref_count(&self, block: BlockId) -> u32 {
        self.ref_count.get(block as usize).copied().unwrap_or(0)
    }

    fn unlink(&mut self, b: u32) {
        let (p, n) = (self.prev[b as usize], self.next[b as usize]);
        if p == NIL { self.head = n } else { self.next[p as usize] = n }
        if n == NIL { self.tail = p } else { self.prev[n as usize] = p }
        self.prev[b as usize] = NIL;
        self.next[b as usize] = NIL;
        self.in_free[b as usize] = false;
        self.num_free -= 1;
    }

    fn push_front(&mut self, b: u32) {
        self.prev[b as usize] = NIL;
        self.next[b as usize] = self.head;
        if self.head == NIL { self.tail = b } else { self.prev[self.head as usize] = b }
        self.head = b;
        self.in_free[b as usize] = true;
        self.num_free += 1;
    }

    fn push_back(&mut self, b: u32) {
        self.next[b as usize] = NIL;
        self.prev[b as usize] = self.tail;
        if self.tail == NIL { self.head = b } else { self.next[self.tail as usize] = b }
        self.tail = b;
        self.in_free[b as usize] = true;
        self.num_free += 1;
    }

    /// Takes the block at the front of the free queue, evicting its cached prefix if it had one,
    /// and gives it one reference. O(1).
    ///
    /// # Errors
    /// [`Error::OutOfBlocks`] when every block is in use.
    pub fn allocate(&mut self) -> Result<BlockId> {
        let b = self.head;
        if b == NIL {
            return Err(Error::OutOfBlocks { needed: 1, free: 0 });
        }
        self.unlink(b);
        if let Some(key) = self.keys[b as usize].take() {
            self.cached.remove(&key);
            self.evictions += 1;
        }
        self.ref_count[b as usize] = 1;
        Ok(b)
    }

    /// Adds a reference to `block` (a fork, or a prefix-cache hit). A free cached block is taken
    /// out of the free queue. O(1).
    ///
    /// # Errors
    /// [`Error::InvalidRequest`] for an id outside the pool, or a free block that holds no cached
    /// content (its data may be stale).
    pub fn incref(&mut self, block: BlockId) -> Result<()> {
        let i = block as usize;
        if i >= self.ref_count.len() {
            return Err(Error::InvalidRequest(format!("block {block} outside the pool")));
        }
        if self.ref_count[i] == 0 {
            if self.keys[i].is_none() {
                return Err(Error::InvalidRequest(format!("incref of free uncached block {block}")));
            }
            self.unlink(block);
        }
        self.ref_count[i] += 1;
        Ok(())
    }

    /// Drops one reference to `block`; at zero it returns to the free queue (front if it holds
    /// no cached prefix, back otherwise). O(1).
    ///
    /// # Errors
    /// [`Error::InvalidRequest`] for an id outside the pool or a block that is already free
    /// (a double free).
    pub fn free(&mut self, block: BlockId) -> Result<()> {
        let i = block as usize;
        if i >= self.ref_count.len() {
            return Err(Error::InvalidRequest(format!("block {block} outside the pool")));
        }
        if self.ref_count[i] == 0 {
            return Err(Error::InvalidRequest(format!("double free of block {block}")));
        }
        self.ref_count[i] -= 1;
        if self.ref_count[i] == 0 {
            if self.keys[i].is_some() { self.push_back(block) } else { self.push_front(block) }
        }
        Ok(())
    }

    /// The block caching `key`, if any (in use or free). O(block_size).
    pub fn lookup(&self, key: &PrefixKey) -> Option<BlockId> {
        self.cached.get(key).copied()
    }

    /// Records that the in-use `block` holds the full-block content `key`. If another block
    /// already caches the same key, nothing changes (the first copy stays canonical) and `false`
    /// is returned.
    pub fn register(&mut self, block: BlockId, key: PrefixKey) -> bool {
        let i = block as usize;
        if i >= self.keys.len() || self.keys[i].is_some() || self.cached.contains_key(&key) {
            return false;
        }
        self.cached.insert(key.clone(), block);
        self.keys[i] = Some(key);
        true
    }

    /// Forgets the cached content of `block` (before it is written in place).
    pub fn unregister(&mut self, block: BlockId) {
        if let Some(key) = self.keys.get_mut(block as usize).and_then(Option::take) {
            self.cached.remove(&key);
        }
    }

    /// True when `block` is registered in the prefix cache.
    pub fn is_cached(&self, block: BlockId) -> bool {
        self.keys.get(block as usize).is_some_and(Option::is_some)
    }

    /// Checks the internal invariants (free-queue links and count, cache map and keys agree).
    /// O(num_blocks); for tests.
    ///
    /// # Errors
    /// [`Error::InvalidRequest`] describing the first broken invariant.
    pub fn check_invariants(&self) -> Result<()> {
        let bad = |m: String| Err(Error::InvalidRequest(m));
        let mut count = 0;
        let mut b = self.head;
        let mut last = NIL;
        while b != NIL {
            if !self.in_free[b as usize] || self.ref_count[b as usize] != 0 {
                return bad(format!("block {b} in free queue but in use"));
            }
            if self.prev[b as usize] != last {
                return bad(format!("broken prev link at block {b}"));
            }
            count += 1;
            if count > self.num_blocks() {
                return bad("cycle in free queue".into());
            }
            last = b;
            b = self.next[b as usize];
        }
        if last != self.tail || count != self.num_free {
            return bad(format!("free queue holds {count} blocks, counter says {}", self.num_free));
        }
        let zero = self.ref_count.iter().filter(|&&r| r == 0).count();
        if zero != self.num_free {
            return bad(format!("{zero} blocks with no reference but {} free", self.num_free));
        }
        for (key, &blk) in &self.cached {
            if self.keys[blk as usize].as_ref() != Some(key) {
                return bad(format!("cache map points at block {blk} with another key"));
            }
        }
        if self.keys.iter().filter(|k| k.is_some()).count() != self.cached.len() {
            return bad("cached keys and map differ in size".into());
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn allocate_until_empty_then_free() -> Result<()> {
        let mut p = BlockPool::new(3)?;
        let a = p.allocate()?;
        let b = p.allocate()?;
        let c = p.allocate()?;
        assert_eq!((a, b, c), (0, 1, 2));
        assert!(matches!(p.allocate(), Err(Error::OutOfBlocks { .. })));
        p.free(b)?;
        assert_eq!(p.num_free(), 1);
        assert_eq!(p.allocate()?, 1);
        assert!(matches!(p.free(7), Err(Error::InvalidRequest(_))));
        p.free(a)?;
        assert!(matches!(p.free(a), Err(Error::InvalidRequest(_))));
        p.check_invariants()
    }

    #[test]
    fn cached_blocks_are_evicted_last_and_can_be_revived() -> Result<()> {
        let mut p = BlockPool::new(2)?;
        let a = p.allocate()?;
        let b = p.allocate()?;
        let key = PrefixKey::new(0, &[1, 2, 3, 4]);
        assert!(p.register(a, key.clone()));
        p.free(a)?; // cached: back of the queue
        p.free(b)?; // uncached: front
        assert_eq!(p.lookup(&key), Some(a));
        // Reviving a cached free block takes it out of the middle of the queue.
        p.incref(a)?;
        assert_eq!(p.num_free(), 1);
        p.free(a)?;
        // The uncached block is reused first, the cached one survives.
        assert_eq!(p.allocate()?, b);
        assert_eq!(p.lookup(&key), Some(a));
        // Allocating the cached one evicts it.
        assert_eq!(p.allocate()?, a);
        assert_eq!(p.lookup(&key), None);
        assert_eq!(p.evictions(), 1);
        p.check_invariants()
    }

    #[test]
    fn chain_hash_depends_on_parent() {
        let a = PrefixKey::new(0, &[1, 2]).chain_hash();
        let b = PrefixKey::new(5, &[1, 2]).chain_hash();
        assert_ne!(a, b);
        assert_eq!(a, PrefixKey::new(0, &[1, 2]).chain_hash());
    }
}
