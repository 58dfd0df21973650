//! The KV block allocator with automatic prefix caching.
//!
//! Follows vLLM's automatic prefix caching design (V1 `BlockPool` / `FreeKVCacheBlockQueue`):
//! blocks have a fixed number of token slots and a reference count; free blocks sit in one
//! doubly linked list (indices into a `Vec`, no pointers) kept in eviction order, so
//! allocate, free and "touch" (reuse a cached free block) are O(1). A full block may carry a
//! [`PrefixHash`]; when its last reference goes it stays in the cache, at the tail of the
//! free list, and can be reused by any request with the same prefix until it is evicted,
//! least recently used first. One deliberate difference: a freed block that carries no hash
//! is put at the head of the list, since it holds nothing worth keeping.
//!
//! The hash is keyed per process (see [`crate::prefix_hash`] and vLLM's advisory
//! GHSA-rm76-4mrf-v9r8), so the cache map can use a pass-through hasher without exposing a
//! hash-flooding vector.

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};

use crate::error::SchedulerError;
use crate::prefix_hash::PrefixHash;
use crate::types::BlockId;

/// Largest pool: block ids are `u32` and one index is the list sentinel.
pub const MAX_BLOCKS: usize = (u32::MAX - 1) as usize;

/// Pass-through hasher for keys that are already uniformly distributed keyed hashes.
#[derive(Default)]
pub(crate) struct PassThroughHasher(u64);

impl Hasher for PassThroughHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = self.0.rotate_left(8) ^ u64::from(b);
        }
    }
    fn write_u128(&mut self, v: u128) {
        self.0 = (v as u64) ^ ((v >> 64) as u64);
    }
}

/// A map from block hash to the block holding it (the device cache's, the ledger's, the host
/// tier's).
pub(crate) type CacheMap = HashMap<PrefixHash, BlockId, BuildHasherDefault<PassThroughHasher>>;

/// Appends to `out` the blocks `cache` holds for the longest prefix of `hashes`; how many.
pub(crate) fn match_cached_prefix(
    cache: &CacheMap,
    hashes: &[PrefixHash],
    out: &mut Vec<BlockId>,
) -> usize {
    let start = out.len();
    for h in hashes {
        match cache.get(h) {
            Some(&b) => out.push(b),
            None => break,
        }
    }
    out.len() - start
}

/// Block size arithmetic shared by the pool and the ledger (divisions are on the hot path, so
/// a power-of-two size uses shifts).
#[derive(Clone, Copy, Debug)]
pub(crate) struct BlockGeometry {
    block_size: usize,
    /// log2(block_size) when it is a power of two.
    block_shift: Option<u32>,
}

impl BlockGeometry {
    /// Validates a pool of `num_blocks` blocks of `block_size` tokens.
    pub(crate) fn new(num_blocks: usize, block_size: usize) -> Result<Self, SchedulerError> {
        if num_blocks == 0 || num_blocks > MAX_BLOCKS {
            return Err(SchedulerError::InvalidConfig {
                field: "num_gpu_blocks",
                reason: format!("must be in 1..={MAX_BLOCKS}, got {num_blocks}"),
            });
        }
        if block_size == 0 {
            return Err(SchedulerError::InvalidConfig {
                field: "block_size",
                reason: "must be at least 1".into(),
            });
        }
        Ok(Self {
            block_size,
            block_shift: block_size
                .is_power_of_two()
                .then(|| block_size.trailing_zeros()),
        })
    }

    pub(crate) fn block_size(&self) -> usize {
        self.block_size
    }

    /// Blocks needed to hold `tokens` tokens.
    pub(crate) fn blocks_for(&self, tokens: usize) -> usize {
        match self.block_shift {
            Some(s) => (tokens >> s) + usize::from(tokens & (self.block_size - 1) != 0),
            None => tokens.div_ceil(self.block_size),
        }
    }

    /// Full blocks among `tokens` tokens.
    pub(crate) fn full_blocks(&self, tokens: usize) -> usize {
        match self.block_shift {
            Some(s) => tokens >> s,
            None => tokens / self.block_size,
        }
    }
}

/// Per-block metadata. `prev`/`next` link the free list; they are meaningless when in use.
#[derive(Clone, Debug)]
struct BlockMeta {
    /// Number of block tables referencing this block.
    ref_count: u32,
    /// Previous free-list node (the sentinel is `num_blocks`).
    prev: u32,
    /// Next free-list node.
    next: u32,
    /// Prefix hash if the block is registered in the cache.
    hash: Option<PrefixHash>,
}

/// Fixed-size KV blocks with refcounts, an LRU free list and a prefix cache.
#[derive(Clone, Debug)]
pub struct BlockPool {
    geometry: BlockGeometry,
    /// `num_blocks` real blocks followed by the free-list sentinel.
    meta: Vec<BlockMeta>,
    /// Blocks with `ref_count == 0` (free or cached-and-evictable).
    num_free: usize,
    /// Full blocks reusable by prefix.
    cache: CacheMap,
}

impl BlockPool {
    /// A pool of `num_blocks` blocks of `block_size` tokens, all free.
    pub fn new(num_blocks: usize, block_size: usize) -> Result<Self, SchedulerError> {
        let geometry = BlockGeometry::new(num_blocks, block_size)?;
        let sentinel = num_blocks as u32;
        let meta = (0..=num_blocks)
            .map(|i| {
                let i = i as u32;
                BlockMeta {
                    ref_count: 0,
                    prev: if i == 0 { sentinel } else { i - 1 },
                    next: if i == sentinel { 0 } else { i + 1 },
                    hash: None,
                }
            })
            .collect();
        Ok(Self {
            geometry,
            meta,
            num_free: num_blocks,
            // Every block may end up cached: reserve once instead of rehashing on the hot path.
            cache: CacheMap::with_capacity_and_hasher(num_blocks.min(1 << 20), Default::default()),
        })
    }

    /// Tokens per block.
    pub fn block_size(&self) -> usize {
        self.geometry.block_size()
    }

    /// Number of blocks in the pool.
    pub fn num_blocks(&self) -> usize {
        self.meta.len() - 1
    }

    /// Blocks that can be allocated now (free, or cached with no reference).
    pub fn num_free(&self) -> usize {
        self.num_free
    }

    /// Number of blocks registered in the prefix cache (referenced or not).
    pub fn num_cached(&self) -> usize {
        self.cache.len()
    }

    /// Fraction of blocks in use (0..=1).
    pub fn usage(&self) -> f64 {
        1.0 - self.num_free as f64 / self.num_blocks() as f64
    }

    /// References to `block` (0 when free), `None` for an id outside the pool.
    pub fn ref_count(&self, block: BlockId) -> Option<u32> {
        self.real(block).map(|m| m.ref_count)
    }

    /// The prefix hash `block` is cached under, if any.
    pub fn block_hash(&self, block: BlockId) -> Option<PrefixHash> {
        self.real(block).and_then(|m| m.hash)
    }

    /// Blocks needed to hold `tokens` tokens.
    pub fn blocks_for(&self, tokens: usize) -> usize {
        self.geometry.blocks_for(tokens)
    }

    /// Full blocks among `tokens` tokens.
    pub fn full_blocks(&self, tokens: usize) -> usize {
        self.geometry.full_blocks(tokens)
    }

    fn real(&self, block: BlockId) -> Option<&BlockMeta> {
        if (block as usize) < self.num_blocks() {
            self.meta.get(block as usize)
        } else {
            None
        }
    }

    fn sentinel(&self) -> u32 {
        self.num_blocks() as u32
    }

    fn unlink(&mut self, b: u32) {
        let (prev, next) = (self.meta[b as usize].prev, self.meta[b as usize].next);
        self.meta[prev as usize].next = next;
        self.meta[next as usize].prev = prev;
        self.num_free -= 1;
    }

    fn link_after(&mut self, anchor: u32, b: u32) {
        let next = self.meta[anchor as usize].next;
        self.meta[b as usize].prev = anchor;
        self.meta[b as usize].next = next;
        self.meta[anchor as usize].next = b;
        self.meta[next as usize].prev = b;
        self.num_free += 1;
    }

    /// Takes the least recently used free block (evicting its cached prefix) with one reference.
    pub fn allocate(&mut self) -> Option<BlockId> {
        let s = self.sentinel();
        let b = self.meta[s as usize].next;
        if b == s {
            return None;
        }
        self.unlink(b);
        if let Some(h) = self.meta[b as usize].hash.take() {
            if self.cache.get(&h) == Some(&b) {
                self.cache.remove(&h);
            }
        }
        self.meta[b as usize].ref_count = 1;
        Some(b)
    }

    /// Adds a reference to `block`; a cached free block leaves the free list (prefix hit).
    pub fn touch(&mut self, block: BlockId) -> Result<(), SchedulerError> {
        if self.real(block).is_none() {
            return Err(SchedulerError::UnknownBlock(block));
        }
        if self.meta[block as usize].ref_count == 0 {
            self.unlink(block);
        }
        self.meta[block as usize].ref_count += 1;
        Ok(())
    }

    /// Drops one reference; at zero the block becomes free (tail if cached, head if not).
    pub fn free(&mut self, block: BlockId) -> Result<(), SchedulerError> {
        let Some(m) = self.real(block) else {
            return Err(SchedulerError::UnknownBlock(block));
        };
        if m.ref_count == 0 {
            return Err(SchedulerError::DoubleFree(block));
        }
        let cached = m.hash.is_some();
        self.meta[block as usize].ref_count -= 1;
        if self.meta[block as usize].ref_count == 0 {
            let s = self.sentinel();
            let anchor = if cached {
                self.meta[s as usize].prev
            } else {
                s
            };
            self.link_after(anchor, block);
        }
        Ok(())
    }

    /// Registers a full, computed, referenced block under `hash`.
    ///
    /// Returns false (and leaves the block uncached) when another block already holds that
    /// prefix, when the block is free, or when it is already cached.
    pub fn cache_block(&mut self, block: BlockId, hash: PrefixHash) -> bool {
        match self.real(block) {
            Some(m) if m.ref_count > 0 && m.hash.is_none() => {}
            _ => return false,
        }
        if self.cache.contains_key(&hash) {
            return false;
        }
        self.cache.insert(hash, block);
        self.meta[block as usize].hash = Some(hash);
        true
    }

    /// Drops every prefix-cache registration (blocks keep their references and places in
    /// the free list).
    pub fn clear_cache(&mut self) {
        self.cache.clear();
        for m in &mut self.meta {
            m.hash = None;
        }
    }

    /// The cached block holding `hash`, if any.
    pub fn lookup(&self, hash: PrefixHash) -> Option<BlockId> {
        self.cache.get(&hash).copied()
    }

    /// Appends to `out` the cached blocks of the longest cached prefix of `hashes`.
    ///
    /// Does not take references; call [`BlockPool::touch`] on the blocks to pin them.
    pub fn match_prefix(&self, hashes: &[PrefixHash], out: &mut Vec<BlockId>) -> usize {
        match_cached_prefix(&self.cache, hashes, out)
    }

    /// Verifies the free list, refcounts and cache map against each other.
    pub fn check_invariants(&self) -> Result<(), SchedulerError> {
        let n = self.num_blocks();
        let s = self.sentinel();
        let mut seen = vec![false; n];
        let mut cur = self.meta[s as usize].next;
        let mut count = 0usize;
        while cur != s {
            let i = cur as usize;
            if i >= n || seen[i] {
                return Err(SchedulerError::Invariant(format!(
                    "free list corrupt at {cur}"
                )));
            }
            seen[i] = true;
            if self.meta[i].ref_count != 0 {
                return Err(SchedulerError::Invariant(format!(
                    "block {i} in free list with refcount {}",
                    self.meta[i].ref_count
                )));
            }
            if self.meta[self.meta[i].next as usize].prev != cur {
                return Err(SchedulerError::Invariant(format!(
                    "broken back link at {i}"
                )));
            }
            count += 1;
            cur = self.meta[i].next;
        }
        if count != self.num_free {
            return Err(SchedulerError::Invariant(format!(
                "free list holds {count} blocks, counter says {}",
                self.num_free
            )));
        }
        for (i, m) in self.meta[..n].iter().enumerate() {
            if m.ref_count == 0 && !seen[i] {
                return Err(SchedulerError::Invariant(format!("free block {i} lost")));
            }
            if let Some(h) = m.hash {
                if self.cache.get(&h) != Some(&(i as u32)) {
                    return Err(SchedulerError::Invariant(format!(
                        "block {i} hash not mapped"
                    )));
                }
            }
        }
        for (h, &b) in &self.cache {
            if self.real(b).and_then(|m| m.hash) != Some(*h) {
                return Err(SchedulerError::Invariant(format!(
                    "cache entry for {b} stale"
                )));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn h(v: u128) -> PrefixHash {
        PrefixHash(v)
    }

    #[test]
    fn block_arithmetic_matches_division_for_all_sizes() {
        for bs in [1, 3, 4, 16, 17] {
            let p = BlockPool::new(1, bs).unwrap();
            for t in 0..100 {
                assert_eq!(p.blocks_for(t), t.div_ceil(bs));
                assert_eq!(p.full_blocks(t), t / bs);
            }
        }
    }

    #[test]
    fn rejects_empty_pool_and_zero_block_size() {
        assert!(BlockPool::new(0, 16).is_err());
        assert!(BlockPool::new(4, 0).is_err());
    }

    #[test]
    fn allocates_every_block_once_then_runs_dry() {
        let mut p = BlockPool::new(3, 16).unwrap();
        let got: Vec<_> = (0..3).map(|_| p.allocate().unwrap()).collect();
        assert_eq!(got, vec![0, 1, 2]);
        assert_eq!(p.allocate(), None);
        assert_eq!(p.num_free(), 0);
        p.check_invariants().unwrap();
    }

    #[test]
    fn double_free_and_unknown_block_are_errors() {
        let mut p = BlockPool::new(2, 16).unwrap();
        let b = p.allocate().unwrap();
        p.free(b).unwrap();
        assert_eq!(p.free(b), Err(SchedulerError::DoubleFree(b)));
        assert_eq!(p.free(9), Err(SchedulerError::UnknownBlock(9)));
        assert_eq!(p.touch(2), Err(SchedulerError::UnknownBlock(2)));
        p.check_invariants().unwrap();
    }

    #[test]
    fn refcount_keeps_shared_block_until_last_free() {
        let mut p = BlockPool::new(2, 16).unwrap();
        let b = p.allocate().unwrap();
        p.touch(b).unwrap();
        assert_eq!(p.ref_count(b), Some(2));
        p.free(b).unwrap();
        assert_eq!(p.num_free(), 1);
        p.free(b).unwrap();
        assert_eq!(p.num_free(), 2);
        p.check_invariants().unwrap();
    }

    #[test]
    fn cached_blocks_are_evicted_least_recently_freed_first() {
        let mut p = BlockPool::new(4, 4).unwrap();
        let b: Vec<_> = (0..4).map(|_| p.allocate().unwrap()).collect();
        for (i, &blk) in b.iter().enumerate() {
            assert!(p.cache_block(blk, h(i as u128 + 10)));
        }
        // Free in the order 2, 0, 3, 1: that is the eviction order.
        for i in [2, 0, 3, 1] {
            p.free(b[i]).unwrap();
        }
        // Reusing block 0 by prefix removes it from the eviction queue.
        assert_eq!(p.lookup(h(10)), Some(b[0]));
        p.touch(b[0]).unwrap();
        assert_eq!(p.allocate(), Some(b[2]));
        assert_eq!(p.lookup(h(12)), None, "evicted block leaves the cache");
        assert_eq!(p.allocate(), Some(b[3]));
        assert_eq!(p.allocate(), Some(b[1]));
        assert_eq!(p.allocate(), None);
        assert_eq!(p.lookup(h(10)), Some(b[0]));
        p.check_invariants().unwrap();
    }

    #[test]
    fn uncached_free_blocks_are_reused_before_cached_ones() {
        let mut p = BlockPool::new(3, 4).unwrap();
        let (a, b, c) = (
            p.allocate().unwrap(),
            p.allocate().unwrap(),
            p.allocate().unwrap(),
        );
        assert!(p.cache_block(a, h(1)));
        p.free(a).unwrap();
        p.free(b).unwrap();
        p.free(c).unwrap();
        // c and b carry no hash, so they go first (most recently freed at the head).
        assert_eq!(p.allocate(), Some(c));
        assert_eq!(p.allocate(), Some(b));
        assert_eq!(p.allocate(), Some(a));
        p.check_invariants().unwrap();
    }

    #[test]
    fn duplicate_hash_is_not_registered_twice() {
        let mut p = BlockPool::new(2, 4).unwrap();
        let (a, b) = (p.allocate().unwrap(), p.allocate().unwrap());
        assert!(p.cache_block(a, h(5)));
        assert!(!p.cache_block(b, h(5)));
        assert!(!p.cache_block(a, h(6)), "already cached under another hash");
        assert_eq!(p.block_hash(b), None);
        p.check_invariants().unwrap();
    }

    #[test]
    fn match_prefix_stops_at_first_miss() {
        let mut p = BlockPool::new(4, 4).unwrap();
        let blocks: Vec<_> = (0..3).map(|_| p.allocate().unwrap()).collect();
        assert!(p.cache_block(blocks[0], h(1)));
        assert!(p.cache_block(blocks[1], h(2)));
        assert!(p.cache_block(blocks[2], h(4)));
        let mut out = Vec::new();
        assert_eq!(p.match_prefix(&[h(1), h(2), h(3), h(4)], &mut out), 2);
        assert_eq!(out, vec![blocks[0], blocks[1]]);
    }
}
