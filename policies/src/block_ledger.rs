//! The scheduler's exact view of the KV block allocator, and the commit that carries one
//! step's block changes to it.
//!
//! The [`BlockPool`] (free list, eviction order, block ids) belongs to the allocator, which in
//! the server is an actor of its own. The planner decides with a [`BlockLedger`]: refcounts,
//! the prefix-cache index and the free count, kept equal to the pool's because only the
//! scheduler's commits change the pool. Fresh blocks are only *reserved* while planning (a
//! table entry of [`PENDING_BLOCK`]); the commit applies, in this order,
//!
//! 0. dropping every prefix-cache registration, after a failed step (see
//!    [`BlockLedger::clear_cache`]),
//! 1. pins of cached blocks matched by admitted requests,
//! 2. prefix-cache registrations of blocks computed since the last commit,
//! 3. frees (finished, aborted, preempted requests),
//! 4. the allocation of the reserved blocks, least recently used first,
//!
//! and returns the ids, which [`crate::Scheduler::assign_blocks`] writes into the tables. The
//! order makes the commit infallible: pins come before the allocations that could evict a
//! matched block, frees before the allocations that counted on them, and the planner never
//! reserves more than the ledger's free count, which equals the pool's. It also makes the pool
//! take every registration the ledger took: the ledger registers only a referenced block, and
//! with the pins applied first (the frees last) a block is referenced in the pool whenever it
//! was in the ledger at any moment since the last commit (a block pinned from the cache,
//! its registration then cleared, registers again while the pool would still count it free). The ledger learns the
//! evictions from the ids it gets back (an allocated block loses its cached prefix), and with a
//! host KV tier records them for its offloads ([`BlockLedger::take_evicted`]).

use crate::block_pool::{match_cached_prefix, BlockGeometry, BlockPool, CacheMap};
use crate::error::SchedulerError;
use crate::prefix_hash::PrefixHash;
use crate::types::BlockId;

/// A table entry reserved during planning; the commit replaces it with a real block id.
pub const PENDING_BLOCK: BlockId = BlockId::MAX;

/// A table entry whose block was given back while its sequence runs: it left every sliding
/// window the sequence's next steps attend over ([`crate::SlidingWindow`]). Never sent in a
/// plan (only blocks past those already sent are), and never an id of the pool.
pub const RELEASED_BLOCK: BlockId = BlockId::MAX - 1;

/// A table entry, while a plan is built, for a block another sequence admitted in the same
/// plan loads from the host tier: the two share it, and [`crate::Scheduler::assign_blocks`]
/// replaces the entry with that block's id (and adds this sequence's reference). Never in a
/// plan handed out, and never an id of the pool.
pub(crate) const SHARED_LOAD_BLOCK: BlockId = BlockId::MAX - 2;

/// One step's changes to the block pool, in the order the allocator applies them.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct KvCommit {
    /// Drop every prefix-cache registration before the rest (a step failed: blocks it
    /// registered may not hold their KV).
    pub clear_cache: bool,
    /// Blocks gaining one reference (cached prefixes matched at admission).
    pub pin: Vec<BlockId>,
    /// Full, computed blocks to register in the prefix cache.
    pub cache: Vec<(BlockId, PrefixHash)>,
    /// Blocks losing one reference.
    pub free: Vec<BlockId>,
    /// Fresh blocks to allocate; their ids fill the reserved table entries in plan order.
    pub allocate: usize,
}

impl KvCommit {
    /// Whether the commit changes nothing.
    pub fn is_empty(&self) -> bool {
        !self.clear_cache
            && self.cache.is_empty()
            && self.pin.is_empty()
            && self.free.is_empty()
            && self.allocate == 0
    }
}

impl BlockPool {
    /// Applies a commit and appends the allocated ids to `out`.
    ///
    /// A commit built by the scheduler's ledger always applies; an error means the ledger and
    /// the pool diverged (a core bug), and the pool may then be partly updated.
    pub fn commit(&mut self, c: &KvCommit, out: &mut Vec<BlockId>) -> Result<(), SchedulerError> {
        if c.clear_cache {
            self.clear_cache();
        }
        for &b in &c.pin {
            self.touch(b)?;
        }
        for &(b, h) in &c.cache {
            self.cache_block(b, h);
        }
        for &b in &c.free {
            self.free(b)?;
        }
        if c.allocate > self.num_free() {
            return Err(SchedulerError::Invariant(format!(
                "commit allocates {} blocks, {} free",
                c.allocate,
                self.num_free()
            )));
        }
        out.reserve(c.allocate);
        for _ in 0..c.allocate {
            match self.allocate() {
                Some(b) => out.push(b),
                None => return Err(SchedulerError::Invariant("free list ran dry".into())),
            }
        }
        Ok(())
    }
}

/// Refcounts, prefix index and free count of the allocator's pool, as of the last commit
/// plus the changes recorded since (see the module docs).
#[derive(Clone, Debug)]
pub struct BlockLedger {
    geometry: BlockGeometry,
    refs: Vec<u32>,
    hashes: Vec<Option<PrefixHash>>,
    cache: CacheMap,
    /// Prefix-cache registrations dropped so far (evicted or cleared).
    cache_drops: u64,
    /// Blocks with no reference, minus the reserved ones.
    num_free: usize,
    /// Blocks reserved since the last commit.
    reserved: usize,
    /// Changes since the last commit.
    log: KvCommit,
    /// Whether [`BlockLedger::assign`] records the cached blocks it evicts (for a host tier).
    track_evictions: bool,
    /// Cached blocks evicted by allocations, with the prefix each held, since the last
    /// [`BlockLedger::take_evicted`].
    evicted: Vec<(BlockId, PrefixHash)>,
    /// Times each block was allocated (wrapping): a block that kept its generation since a
    /// moment still holds what it held then, unless its registration was dropped.
    gens: Vec<u32>,
    /// Whether [`BlockLedger::cache_block`] records the blocks it registers.
    track_registrations: bool,
    /// Blocks registered in the prefix cache since the last [`BlockLedger::take_registered`],
    /// with their prefix and generation.
    registered: Vec<CachedBlock>,
}

/// A block registered in the prefix cache ([`BlockLedger::take_registered`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CachedBlock {
    /// The block.
    pub block: BlockId,
    /// The prefix it holds.
    pub hash: PrefixHash,
    /// Its generation then ([`BlockLedger::holds`]).
    pub gen: u32,
}

impl BlockLedger {
    /// The view of a fresh pool of `num_blocks` blocks of `block_size` tokens.
    pub fn new(num_blocks: usize, block_size: usize) -> Result<Self, SchedulerError> {
        Ok(Self {
            geometry: BlockGeometry::new(num_blocks, block_size)?,
            refs: vec![0; num_blocks],
            hashes: vec![None; num_blocks],
            cache: CacheMap::with_capacity_and_hasher(num_blocks.min(1 << 20), Default::default()),
            cache_drops: 0,
            num_free: num_blocks,
            reserved: 0,
            log: KvCommit::default(),
            gens: vec![0; num_blocks],
            track_registrations: false,
            registered: Vec::new(),
            track_evictions: false,
            evicted: Vec::new(),
        })
    }

    /// Tokens per block.
    pub fn block_size(&self) -> usize {
        self.geometry.block_size()
    }

    /// Number of blocks in the pool.
    pub fn num_blocks(&self) -> usize {
        self.refs.len()
    }

    /// Blocks that can still be reserved (free or cached-evictable, not yet reserved).
    pub fn num_free(&self) -> usize {
        self.num_free
    }

    /// Fraction of blocks in use (0..=1).
    pub fn usage(&self) -> f64 {
        1.0 - self.num_free as f64 / self.num_blocks() as f64
    }

    /// Blocks registered in the prefix cache.
    pub fn num_cached(&self) -> usize {
        self.cache.len()
    }

    /// Blocks reserved since the last commit.
    pub fn num_reserved(&self) -> usize {
        self.reserved
    }

    /// Whether changes or reservations wait for a commit.
    pub fn has_uncommitted(&self) -> bool {
        self.reserved != 0 || !self.log.is_empty()
    }

    /// References to `block`: 1 for a reserved entry, `None` for an id outside the pool.
    pub fn ref_count(&self, block: BlockId) -> Option<u32> {
        if block == PENDING_BLOCK {
            return Some(1);
        }
        self.refs.get(block as usize).copied()
    }

    /// Blocks needed to hold `tokens` tokens.
    pub fn blocks_for(&self, tokens: usize) -> usize {
        self.geometry.blocks_for(tokens)
    }

    /// Full blocks among `tokens` tokens.
    pub fn full_blocks(&self, tokens: usize) -> usize {
        self.geometry.full_blocks(tokens)
    }

    /// Reserves a fresh block; the commit allocates it. `None` when none is free.
    pub fn reserve(&mut self) -> Option<BlockId> {
        if self.num_free == 0 {
            return None;
        }
        self.num_free -= 1;
        self.reserved += 1;
        Some(PENDING_BLOCK)
    }

    /// Adds a reference to a cached block (a prefix hit). An unreferenced block counts as
    /// free: pinning one when reservations have claimed every free block is an error (the
    /// commit could not allocate them).
    pub fn touch(&mut self, block: BlockId) -> Result<(), SchedulerError> {
        let r = self
            .refs
            .get_mut(block as usize)
            .ok_or(SchedulerError::UnknownBlock(block))?;
        if *r == 0 {
            self.num_free = self.num_free.checked_sub(1).ok_or_else(|| {
                SchedulerError::Invariant(format!(
                    "pin of free block {block} with every free block reserved"
                ))
            })?;
        }
        *r += 1;
        self.log.pin.push(block);
        Ok(())
    }

    /// Drops one reference, or cancels a reservation.
    pub fn free(&mut self, block: BlockId) -> Result<(), SchedulerError> {
        if block == PENDING_BLOCK {
            if self.reserved == 0 {
                return Err(SchedulerError::DoubleFree(block));
            }
            self.reserved -= 1;
            self.num_free += 1;
            return Ok(());
        }
        let r = self
            .refs
            .get_mut(block as usize)
            .ok_or(SchedulerError::UnknownBlock(block))?;
        if *r == 0 {
            return Err(SchedulerError::DoubleFree(block));
        }
        *r -= 1;
        if *r == 0 {
            self.num_free += 1;
        }
        self.log.free.push(block);
        Ok(())
    }

    /// Registers a full, computed, referenced block under `hash`, with the pool's rules
    /// ([`BlockPool::cache_block`]).
    pub fn cache_block(&mut self, block: BlockId, hash: PrefixHash) -> bool {
        let i = block as usize;
        if self.refs.get(i).is_none_or(|&r| r == 0) || self.hashes[i].is_some() {
            return false;
        }
        if self.cache.contains_key(&hash) {
            return false;
        }
        self.cache.insert(hash, block);
        self.hashes[i] = Some(hash);
        self.log.cache.push((block, hash));
        if self.track_registrations {
            self.registered.push(CachedBlock {
                block,
                hash,
                gen: self.gens[i],
            });
        }
        true
    }

    /// Drops every prefix-cache registration, here at once and in the pool with the next
    /// commit (before that commit's registrations, so those recorded after this call stand).
    /// For a failed step: with asynchronous scheduling a step registers the blocks it computes
    /// when it is launched, before they hold their KV, so after a failure no registration can
    /// be trusted. Blocks keep their references; only future prefix hits are lost.
    pub fn clear_cache(&mut self) {
        self.cache_drops += self.cache.len() as u64;
        self.cache.clear();
        self.hashes.fill(None);
        self.log.cache.clear();
        self.log.clear_cache = true;
        // Those registrations are no longer ones to store ahead (`BlockLedger::holds` would
        // refuse them anyway).
        self.registered.clear();
    }

    /// Prefix-cache registrations dropped so far (evicted by an allocation or cleared). While
    /// it stays the same, every hash found registered stays registered, so a prefix walk may
    /// resume where it stopped.
    pub fn cache_drops(&self) -> u64 {
        self.cache_drops
    }

    /// Whether a block with `hash` is registered in the prefix cache (one probe).
    pub fn is_cached(&self, hash: PrefixHash) -> bool {
        self.cache.contains_key(&hash)
    }

    /// Points the prefix-cache entry of `block` at `to` instead: a corrupt ledger, for tests
    /// of what the planner does with one.
    #[cfg(test)]
    pub(crate) fn corrupt_cache_entry(&mut self, block: BlockId, to: BlockId) {
        if let Some(h) = self.hashes.get(block as usize).copied().flatten() {
            self.cache.insert(h, to);
        }
    }

    /// Appends to `out` the cached blocks of the longest cached prefix of `hashes`.
    pub fn match_prefix(&self, hashes: &[PrefixHash], out: &mut Vec<BlockId>) -> usize {
        match_cached_prefix(&self.cache, hashes, out)
    }

    /// The changes since the last commit, for the allocator; the reserved blocks stay
    /// reserved until [`BlockLedger::assign`] gets their ids.
    pub fn take_commit(&mut self) -> KvCommit {
        let mut c = std::mem::take(&mut self.log);
        c.allocate = self.reserved;
        c
    }

    /// Records the ids the allocator gave the reserved blocks: each is referenced once, and
    /// any cached prefix it held is gone (evicted).
    pub fn assign(&mut self, ids: &[BlockId]) -> Result<(), SchedulerError> {
        if ids.len() != self.reserved {
            return Err(SchedulerError::Invariant(format!(
                "{} blocks reserved, {} allocated",
                self.reserved,
                ids.len()
            )));
        }
        for &b in ids {
            let i = b as usize;
            match self.refs.get(i) {
                Some(0) => {}
                Some(r) => {
                    return Err(SchedulerError::Invariant(format!(
                        "allocated block {b} has {r} references"
                    )))
                }
                None => return Err(SchedulerError::UnknownBlock(b)),
            }
            self.refs[i] = 1;
            self.gens[i] = self.gens[i].wrapping_add(1);
            if let Some(h) = self.hashes[i].take() {
                if self.cache.get(&h) == Some(&b) {
                    self.cache.remove(&h);
                    self.cache_drops += 1;
                    if self.track_evictions {
                        self.evicted.push((b, h));
                    }
                }
            }
        }
        self.reserved = 0;
        Ok(())
    }

    /// Makes [`BlockLedger::assign`] record the cached blocks it evicts (for
    /// [`BlockLedger::take_evicted`]).
    pub fn track_evictions(&mut self, on: bool) {
        self.track_evictions = on;
        self.evicted.clear();
    }

    /// Moves to `out` the cached blocks evicted (with the prefix each held, in allocation
    /// order) since the last call; recorded only with [`BlockLedger::track_evictions`] on.
    pub fn take_evicted(&mut self, out: &mut Vec<(BlockId, PrefixHash)>) {
        out.append(&mut self.evicted);
    }

    /// Makes [`BlockLedger::cache_block`] record the blocks it registers (for
    /// [`BlockLedger::take_registered`]: a host tier's stores ahead of eviction).
    pub fn track_registrations(&mut self, on: bool) {
        self.track_registrations = on;
        self.registered.clear();
    }

    /// Moves to `out` the blocks registered in the prefix cache since the last call, in that
    /// order; recorded only with [`BlockLedger::track_registrations`] on. A registration is
    /// made when the plan whose step computes the block is built: the block holds its KV once
    /// that step has run.
    pub fn take_registered(&mut self, out: &mut Vec<CachedBlock>) {
        out.append(&mut self.registered);
    }

    /// Whether `f.block` still holds the cached prefix it held when it was recorded: not
    /// allocated since (so not evicted or overwritten) and still registered.
    pub fn holds(&self, f: &CachedBlock) -> bool {
        let i = f.block as usize;
        self.gens.get(i) == Some(&f.gen)
            && self.hashes[i] == Some(f.hash)
            && self.cache.get(&f.hash) == Some(&f.block)
    }

    /// Checks the ledger against the pool it mirrors (between steps, after a commit).
    pub fn check_against(&self, pool: &BlockPool) -> Result<(), SchedulerError> {
        let bad = |m: String| Err(SchedulerError::Invariant(m));
        if pool.num_blocks() != self.num_blocks() {
            return bad("ledger and pool differ in size".into());
        }
        if self.has_uncommitted() {
            return bad("ledger holds uncommitted changes".into());
        }
        if pool.num_free() != self.num_free {
            return bad(format!(
                "pool has {} free blocks, ledger {}",
                pool.num_free(),
                self.num_free
            ));
        }
        if pool.num_cached() != self.cache.len() {
            return bad(format!(
                "pool caches {} blocks, ledger {}",
                pool.num_cached(),
                self.cache.len()
            ));
        }
        for b in 0..self.num_blocks() {
            let id = b as BlockId;
            if pool.ref_count(id) != Some(self.refs[b]) || pool.block_hash(id) != self.hashes[b] {
                return bad(format!("block {b} differs between ledger and pool"));
            }
        }
        Ok(())
    }

    /// Verifies the free count and the cache index against the refcounts.
    pub fn check_invariants(&self) -> Result<(), SchedulerError> {
        let free = self.refs.iter().filter(|&&r| r == 0).count();
        if free != self.num_free + self.reserved {
            return Err(SchedulerError::Invariant(format!(
                "{free} unreferenced blocks, ledger counts {} free + {} reserved",
                self.num_free, self.reserved
            )));
        }
        for (h, &b) in &self.cache {
            if self.hashes.get(b as usize).copied().flatten() != Some(*h) {
                return Err(SchedulerError::Invariant(format!(
                    "ledger cache entry for {b} stale"
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

    /// Commits the ledger's changes to `pool` and hands back the ids.
    fn commit(l: &mut BlockLedger, pool: &mut BlockPool) -> Vec<BlockId> {
        let c = l.take_commit();
        let mut ids = Vec::new();
        pool.commit(&c, &mut ids).unwrap();
        l.assign(&ids).unwrap();
        l.check_against(pool).unwrap();
        pool.check_invariants().unwrap();
        ids
    }

    #[test]
    fn reservations_become_the_pools_blocks() {
        let mut l = BlockLedger::new(3, 4).unwrap();
        let mut p = BlockPool::new(3, 4).unwrap();
        assert_eq!(l.reserve(), Some(PENDING_BLOCK));
        assert_eq!(l.reserve(), Some(PENDING_BLOCK));
        assert_eq!(l.num_free(), 1);
        assert_eq!(commit(&mut l, &mut p), vec![0, 1]);
        assert_eq!(l.ref_count(0), Some(1));
    }

    #[test]
    fn a_cancelled_reservation_is_not_allocated() {
        let mut l = BlockLedger::new(2, 4).unwrap();
        let mut p = BlockPool::new(2, 4).unwrap();
        let r = l.reserve().unwrap();
        l.free(r).unwrap();
        assert_eq!(l.free(r), Err(SchedulerError::DoubleFree(PENDING_BLOCK)));
        assert_eq!(commit(&mut l, &mut p), Vec::<BlockId>::new());
        assert_eq!(p.num_free(), 2);
    }

    #[test]
    fn the_ledger_learns_evictions_from_the_allocated_ids() {
        let mut l = BlockLedger::new(2, 4).unwrap();
        let mut p = BlockPool::new(2, 4).unwrap();
        l.reserve();
        l.reserve();
        let ids = commit(&mut l, &mut p);
        assert!(l.cache_block(ids[0], h(7)));
        l.free(ids[0]).unwrap();
        l.free(ids[1]).unwrap();
        commit(&mut l, &mut p);
        let mut out = Vec::new();
        assert_eq!(
            l.match_prefix(&[h(7)], &mut out),
            1,
            "freed block stays cached"
        );
        // Two fresh blocks need the cached one too: it is evicted, in both views.
        l.reserve();
        l.reserve();
        commit(&mut l, &mut p);
        out.clear();
        assert_eq!(l.match_prefix(&[h(7)], &mut out), 0);
        assert_eq!(p.lookup(h(7)), None);
    }

    #[test]
    fn clearing_the_cache_drops_every_registration_in_both_views() {
        let mut l = BlockLedger::new(3, 4).unwrap();
        let mut p = BlockPool::new(3, 4).unwrap();
        l.reserve();
        l.reserve();
        l.reserve();
        let ids = commit(&mut l, &mut p);
        // Block 0 cached and committed, block 1 cached and freed (cached, evictable), block 2
        // registered in the same commit window as the clear, before it; then block 0 again
        // after the clear.
        assert!(l.cache_block(ids[0], h(1)));
        assert!(l.cache_block(ids[1], h(2)));
        l.free(ids[1]).unwrap();
        commit(&mut l, &mut p);
        assert!(l.cache_block(ids[2], h(3)));
        l.clear_cache();
        assert!(l.has_uncommitted(), "a clear alone is a change to commit");
        assert!(l.cache_block(ids[0], h(4)));
        commit(&mut l, &mut p);
        let mut out = Vec::new();
        for gone in [h(1), h(2), h(3)] {
            assert_eq!(l.match_prefix(&[gone], &mut out), 0);
            assert_eq!(p.lookup(gone), None);
        }
        assert_eq!(l.match_prefix(&[h(4)], &mut out), 1);
        assert_eq!(p.lookup(h(4)), Some(ids[0]));
        // The freed block is still free, and allocatable.
        l.reserve();
        assert_eq!(commit(&mut l, &mut p), vec![ids[1]]);
    }

    #[test]
    fn pins_come_before_allocations_so_a_matched_block_survives() {
        // One cached free block and one plain free block; a step matches the cached one and
        // reserves one more: the commit must pin first and allocate the other.
        let mut l = BlockLedger::new(2, 4).unwrap();
        let mut p = BlockPool::new(2, 4).unwrap();
        l.reserve();
        l.reserve();
        let ids = commit(&mut l, &mut p);
        assert!(l.cache_block(ids[1], h(9)));
        l.free(ids[0]).unwrap();
        l.free(ids[1]).unwrap();
        commit(&mut l, &mut p);
        let mut m = Vec::new();
        l.match_prefix(&[h(9)], &mut m);
        l.touch(m[0]).unwrap();
        l.reserve().unwrap();
        assert_eq!(l.reserve(), None);
        let got = commit(&mut l, &mut p);
        assert_eq!(got, vec![ids[0]]);
        assert_eq!(p.lookup(h(9)), Some(ids[1]));
    }

    /// A block pinned from the cache while the pool counts it free, its registration then
    /// cleared (a failed step) and registered again before the commit: the pool takes the
    /// registration as the ledger did (the pins are applied before the registrations), and
    /// the two stay equal.
    #[test]
    fn a_block_pinned_then_registered_again_after_a_clear_is_cached_in_both_views() {
        let mut l = BlockLedger::new(3, 4).unwrap();
        let mut p = BlockPool::new(3, 4).unwrap();
        l.reserve();
        let ids = commit(&mut l, &mut p);
        assert!(l.cache_block(ids[0], h(1)));
        l.free(ids[0]).unwrap();
        commit(&mut l, &mut p);
        let mut m = Vec::new();
        assert_eq!(l.match_prefix(&[h(1)], &mut m), 1);
        l.touch(m[0]).unwrap();
        l.clear_cache();
        assert!(l.cache_block(m[0], h(1)));
        commit(&mut l, &mut p);
        assert_eq!(p.lookup(h(1)), Some(ids[0]));
        assert_eq!(p.ref_count(ids[0]), Some(1));
    }

    /// Reservations that claimed every free block, a cached one included: pinning that one is
    /// an error, not a wrapped free count.
    #[test]
    fn a_pin_of_a_block_every_reservation_counts_on_is_an_error() {
        let mut l = BlockLedger::new(2, 4).unwrap();
        let mut p = BlockPool::new(2, 4).unwrap();
        l.reserve();
        let ids = commit(&mut l, &mut p);
        assert!(l.cache_block(ids[0], h(1)));
        l.free(ids[0]).unwrap();
        commit(&mut l, &mut p);
        l.reserve().unwrap();
        l.reserve().unwrap();
        assert_eq!(l.num_free(), 0);
        assert!(matches!(l.touch(ids[0]), Err(SchedulerError::Invariant(_))));
        assert_eq!(l.num_free(), 0);
        assert_eq!(l.ref_count(ids[0]), Some(0));
        l.check_invariants().unwrap();
        assert_eq!(commit(&mut l, &mut p).len(), 2);
    }

    #[test]
    fn bad_frees_and_mismatched_assignments_are_errors() {
        let mut l = BlockLedger::new(2, 4).unwrap();
        assert_eq!(l.free(0), Err(SchedulerError::DoubleFree(0)));
        assert_eq!(l.free(5), Err(SchedulerError::UnknownBlock(5)));
        assert_eq!(l.touch(5), Err(SchedulerError::UnknownBlock(5)));
        l.reserve();
        assert!(l.assign(&[]).is_err());
        assert!(l.assign(&[9]).is_err());
        assert!(BlockLedger::new(0, 4).is_err());
        assert!(BlockLedger::new(4, 0).is_err());
    }
}
