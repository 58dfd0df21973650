//! The host KV tier: a second, inclusive level of the prefix cache in host memory (vLLM's
//! CPU KV offloading, SGLang's HiCache).
//!
//! Full cached blocks evicted from the device cache are copied here
//! ([`crate::StepPlan::kv_offloads`]) under the same [`PrefixHash`] as the device cache, and a
//! prefix found here past the end of the device match is copied back
//! ([`crate::StepPlan::kv_loads`]) instead of recomputed. The tier is inclusive: a block loaded
//! back stays here too, so evicting it again copies nothing. A plan loads each block at most
//! once: requests admitted after the one whose admission decided a load share its device
//! block (found in the scheduler's `plan_loads` after their device match), and count its
//! tokens as device hits; the tier's hit tokens (`num_host_hit_tokens`) count once.
//!
//! Blocks holding a cached block sit in one doubly linked LRU list (indices into a `Vec`, the
//! least recently used at the head); unused ones in a stack. Every operation is O(1) but
//! picking an offload destination, which skips the blocks pinned for the plan being built
//! (load sources and blocks already written by that plan, both moved to the tail, so the
//! walk is O(1) unless the pins fill the whole tier).

use crate::block_pool::{match_cached_prefix, CacheMap};
use crate::error::SchedulerError;
use crate::prefix_hash::PrefixHash;
use crate::types::BlockId;

/// Per-block state. `prev`/`next` link the LRU list; meaningless for an unused block.
#[derive(Clone, Debug)]
struct HostMeta {
    hash: Option<PrefixHash>,
    prev: u32,
    next: u32,
    /// The plan (see [`HostTier::begin_plan`]) that last pinned the block.
    pinned_in: u64,
}

/// The host tier's blocks, their cached prefixes and their LRU order.
#[derive(Clone, Debug)]
pub struct HostTier {
    /// `num_blocks` blocks followed by the LRU list's sentinel.
    meta: Vec<HostMeta>,
    /// Blocks holding no cached block.
    unused: Vec<BlockId>,
    cache: CacheMap,
    /// The plan being built; a block with `pinned_in == plan` is pinned.
    plan: u64,
}

impl HostTier {
    /// A tier of `num_blocks` (at least 1) blocks, all unused.
    pub fn new(num_blocks: usize) -> Result<Self, SchedulerError> {
        if num_blocks == 0 || num_blocks > crate::scheduler::MAX_HOST_BLOCKS {
            return Err(SchedulerError::InvalidConfig {
                field: "num_host_blocks",
                reason: format!(
                    "a host tier has 1..={} blocks, got {num_blocks}",
                    crate::scheduler::MAX_HOST_BLOCKS
                ),
            });
        }
        let s = num_blocks as u32;
        Ok(Self {
            meta: (0..=s)
                .map(|_| HostMeta {
                    hash: None,
                    prev: s,
                    next: s,
                    pinned_in: 0,
                })
                .collect(),
            unused: (0..s).rev().collect(),
            cache: CacheMap::with_capacity_and_hasher(num_blocks.min(1 << 20), Default::default()),
            plan: 1,
        })
    }

    /// Number of blocks of the tier.
    pub fn num_blocks(&self) -> usize {
        self.meta.len() - 1
    }

    /// Blocks holding a cached block.
    pub fn num_used(&self) -> usize {
        self.cache.len()
    }

    fn sentinel(&self) -> u32 {
        self.num_blocks() as u32
    }

    /// The block holding `hash`, if any (no LRU change).
    pub fn lookup(&self, hash: PrefixHash) -> Option<BlockId> {
        self.cache.get(&hash).copied()
    }

    /// The prefix `hash` a block holds, if any.
    pub fn block_hash(&self, block: BlockId) -> Option<PrefixHash> {
        self.meta
            .get(block as usize)
            .filter(|_| (block as usize) < self.num_blocks())
            .and_then(|m| m.hash)
    }

    /// Appends to `out` the blocks of the longest prefix of `hashes` held here.
    pub fn match_prefix(&self, hashes: &[PrefixHash], out: &mut Vec<BlockId>) -> usize {
        match_cached_prefix(&self.cache, hashes, out)
    }

    fn unlink(&mut self, b: u32) {
        let (prev, next) = (self.meta[b as usize].prev, self.meta[b as usize].next);
        self.meta[prev as usize].next = next;
        self.meta[next as usize].prev = prev;
    }

    /// Links `b` at the tail (most recently used).
    fn push_back(&mut self, b: u32) {
        let s = self.sentinel();
        let last = self.meta[s as usize].prev;
        self.meta[b as usize].prev = last;
        self.meta[b as usize].next = s;
        self.meta[last as usize].next = b;
        self.meta[s as usize].prev = b;
    }

    /// Starts a new plan: every pin of the previous one is dropped.
    pub fn begin_plan(&mut self) {
        self.plan += 1;
    }

    /// Pins a cached block for the plan being built (it is a load source: no offload of this
    /// plan may overwrite it) and makes it the most recently used.
    pub fn pin(&mut self, block: BlockId) -> Result<(), SchedulerError> {
        if self.block_hash(block).is_none() {
            return Err(SchedulerError::UnknownBlock(block));
        }
        self.unlink(block);
        self.push_back(block);
        self.meta[block as usize].pinned_in = self.plan;
        Ok(())
    }

    fn pinned(&self, block: u32) -> bool {
        self.meta[block as usize].pinned_in == self.plan
    }

    /// A device block cached under `hash` is evicted: returns the host block to copy it to,
    /// or `None` when no copy is needed (the tier holds `hash` already, which becomes the most
    /// recently used) or possible (every block is pinned by the plan being built). The
    /// destination, an unused block or the least recently used unpinned one (whose cached
    /// prefix is dropped), is pinned for the plan: no later offload of it overwrites it.
    pub fn offload(&mut self, hash: PrefixHash) -> Option<BlockId> {
        if let Some(&b) = self.cache.get(&hash) {
            self.unlink(b);
            self.push_back(b);
            return None;
        }
        let b = match self.unused.pop() {
            Some(b) => b,
            None => {
                let s = self.sentinel();
                let mut cur = self.meta[s as usize].next;
                while cur != s && self.pinned(cur) {
                    cur = self.meta[cur as usize].next;
                }
                if cur == s {
                    return None;
                }
                self.unlink(cur);
                if let Some(old) = self.meta[cur as usize].hash.take() {
                    self.cache.remove(&old);
                }
                cur
            }
        };
        self.meta[b as usize].hash = Some(hash);
        self.meta[b as usize].pinned_in = self.plan;
        self.cache.insert(hash, b);
        self.push_back(b);
        Some(b)
    }

    /// Drops every cached block (after a failed step, as the device cache's registrations).
    pub fn clear(&mut self) {
        let s = self.sentinel();
        self.cache.clear();
        for m in &mut self.meta {
            m.hash = None;
            m.prev = s;
            m.next = s;
        }
        self.unused = (0..s).rev().collect();
    }

    /// Verifies the LRU list, the unused stack and the cache map against each other.
    pub fn check_invariants(&self) -> Result<(), SchedulerError> {
        let bad = |m: String| Err(SchedulerError::Invariant(m));
        let n = self.num_blocks();
        let s = self.sentinel();
        let mut seen = vec![false; n];
        let mut cur = self.meta[s as usize].next;
        let mut listed = 0usize;
        while cur != s {
            let i = cur as usize;
            if i >= n || seen[i] {
                return bad(format!("host LRU list corrupt at {cur}"));
            }
            seen[i] = true;
            match self.meta[i].hash {
                Some(h) if self.cache.get(&h) == Some(&cur) => {}
                _ => return bad(format!("host block {i} listed but not cached")),
            }
            if self.meta[self.meta[i].next as usize].prev != cur {
                return bad(format!("host LRU back link broken at {i}"));
            }
            listed += 1;
            cur = self.meta[i].next;
        }
        if listed != self.cache.len() {
            return bad(format!(
                "host tier caches {} blocks, {listed} listed",
                self.cache.len()
            ));
        }
        for &b in &self.unused {
            let i = b as usize;
            if i >= n || seen[i] || self.meta[i].hash.is_some() {
                return bad(format!("unused host block {b} in use"));
            }
            seen[i] = true;
        }
        if let Some(i) = seen.iter().position(|&x| !x) {
            return bad(format!("host block {i} lost"));
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
    fn sizes_outside_the_bounds_are_refused() {
        assert!(HostTier::new(0).is_err());
        assert!(HostTier::new(crate::scheduler::MAX_HOST_BLOCKS + 1).is_err());
        assert_eq!(HostTier::new(3).unwrap().num_blocks(), 3);
    }

    #[test]
    fn an_evicted_block_is_copied_once_and_again_only_after_it_left() {
        let mut t = HostTier::new(2).unwrap();
        t.begin_plan();
        assert_eq!(t.offload(h(1)), Some(0));
        // Inclusive: evicted again (loaded back in between), nothing is copied.
        t.begin_plan();
        assert_eq!(t.offload(h(1)), None);
        assert_eq!(t.lookup(h(1)), Some(0));
        assert_eq!(t.num_used(), 1);
        t.check_invariants().unwrap();
    }

    #[test]
    fn the_least_recently_used_block_makes_room() {
        let mut t = HostTier::new(2).unwrap();
        t.begin_plan();
        assert_eq!(t.offload(h(1)), Some(0));
        assert_eq!(t.offload(h(2)), Some(1));
        // h(1) is used again (evicted once more from the device): h(2) is now the LRU.
        t.begin_plan();
        assert_eq!(t.offload(h(1)), None);
        assert_eq!(t.offload(h(3)), Some(1));
        assert_eq!(t.lookup(h(2)), None);
        assert_eq!(t.lookup(h(1)), Some(0));
        assert_eq!(t.block_hash(1), Some(h(3)));
        t.check_invariants().unwrap();
    }

    #[test]
    fn a_pinned_load_source_is_never_an_offload_destination_of_its_plan() {
        let mut t = HostTier::new(2).unwrap();
        t.begin_plan();
        assert_eq!(t.offload(h(1)), Some(0));
        assert_eq!(t.offload(h(2)), Some(1));
        // The next plan loads h(1)'s and h(2)'s blocks: nothing may be overwritten.
        t.begin_plan();
        t.pin(0).unwrap();
        t.pin(1).unwrap();
        assert_eq!(t.offload(h(3)), None);
        assert_eq!(t.num_used(), 2);
        // Only h(2)'s is loaded in the next one: the LRU (h(1), pinned earlier) goes.
        t.begin_plan();
        t.pin(1).unwrap();
        assert_eq!(t.offload(h(3)), Some(0));
        assert_eq!(t.lookup(h(2)), Some(1));
        assert_eq!(t.pin(7), Err(SchedulerError::UnknownBlock(7)));
        t.check_invariants().unwrap();
    }

    #[test]
    fn no_two_offloads_of_one_plan_write_the_same_block() {
        let mut t = HostTier::new(1).unwrap();
        t.begin_plan();
        assert_eq!(t.offload(h(1)), Some(0));
        assert_eq!(
            t.offload(h(2)),
            None,
            "the only block was written by this plan"
        );
        t.begin_plan();
        assert_eq!(t.offload(h(2)), Some(0));
        assert_eq!(t.lookup(h(1)), None);
        t.check_invariants().unwrap();
    }

    #[test]
    fn match_prefix_stops_at_the_first_miss_and_clear_drops_everything() {
        let mut t = HostTier::new(4).unwrap();
        t.begin_plan();
        for v in [1, 2, 4] {
            t.offload(h(v));
        }
        let mut out = vec![9];
        assert_eq!(t.match_prefix(&[h(1), h(2), h(3), h(4)], &mut out), 2);
        assert_eq!(out, vec![9, 0, 1]);
        t.clear();
        assert_eq!(t.num_used(), 0);
        assert_eq!(t.lookup(h(1)), None);
        t.check_invariants().unwrap();
        t.begin_plan();
        assert_eq!(t.offload(h(5)), Some(0));
        t.check_invariants().unwrap();
    }
}

/// The tier in the planner: hand-made cases, expected copies derived in the comments.
#[cfg(test)]
mod planner_tests {
    use std::collections::BTreeSet;

    use crate::policy::testutil::{request, run_step};
    use crate::policy::Fcfs;
    use crate::types::*;
    use crate::Scheduler;

    /// Blocks of 4 tokens, 6 on the device, `host` in the host tier.
    fn sched(host: usize) -> Scheduler {
        sched_with(6, host)
    }

    /// Blocks of 4 tokens, `device` on the device, `host` in the host tier; cached blocks
    /// copied there when evicted only (the tests of stores ahead use [`sched_ahead`]).
    fn sched_with(device: usize, host: usize) -> Scheduler {
        sched_config(device, host, false)
    }

    /// Blocks of 4 tokens, `device` on the device, `host` in the host tier, stores ahead of
    /// eviction when `ahead`.
    fn sched_config(device: usize, host: usize, ahead: bool) -> Scheduler {
        let c = SchedulerConfig {
            block_size: 4,
            num_gpu_blocks: device,
            max_model_len: 1024,
            enable_prefix_caching: true,
            num_host_blocks: host,
            kv_offload_ahead: ahead,
            ..SchedulerConfig::default()
        };
        Scheduler::new(c, Box::new(Fcfs), [5, 6]).unwrap()
    }

    /// 17 tokens: 4 full blocks and the last token's.
    fn a() -> Vec<u32> {
        (1..=17).collect()
    }

    /// 23 tokens of request `id` alone: 5 full blocks and the last token's; with its one
    /// output, the whole device cache.
    fn unique(id: u32) -> Vec<u32> {
        (0..23).map(|k| 1000 * id + k).collect()
    }

    /// Runs request `id` with `prompt` alone for one step (it ends then, after 1 token).
    fn one(s: &mut Scheduler, id: u64, prompt: Vec<u32>) -> StepPlan {
        s.add_request(request(id, "", id, prompt, 1)).unwrap();
        let (plan, _) = run_step(s, id, 7);
        assert_eq!(plan.seqs.len(), 1);
        assert!(!s.has_unfinished());
        plan
    }

    fn hosts(c: &[BlockCopy]) -> BTreeSet<BlockId> {
        c.iter().map(|c| c.host).collect()
    }

    /// A then B (B evicts A's 4 cached blocks): the plans and A's 4 full blocks.
    fn a_then_b(s: &mut Scheduler) -> (StepPlan, Vec<BlockId>) {
        let pa = one(s, 0, a());
        assert!(pa.kv_offloads.is_empty() && pa.kv_loads.is_empty());
        let a_full = pa.seqs[0].new_blocks[..4].to_vec();
        (one(s, 1, unique(1)), a_full)
    }

    #[test]
    fn evicted_blocks_are_offloaded_once_and_loaded_back_as_a_prefix_hit() {
        let mut s = sched(16);
        let (pb, a_full) = a_then_b(&mut s);
        // B takes the 2 blocks holding nothing, then evicts A's 4 cached ones: each copied
        // to an unused host block.
        let devs: BTreeSet<_> = pb.kv_offloads.iter().map(|c| c.device).collect();
        assert_eq!(devs, a_full.iter().copied().collect());
        assert_eq!(hosts(&pb.kv_offloads), (0..4).collect());
        assert!(pb.kv_loads.is_empty());
        // C = A's prompt: nothing on the device (B holds it all), the 4 blocks in the host
        // tier: loaded into C's first 4 blocks, 16 tokens computed and counted as cached.
        s.add_request(request(2, "", 2, a(), 1)).unwrap();
        let (pc, ev) = run_step(&mut s, 2, 7);
        assert_eq!(pc.seqs[0].num_computed_tokens, 16);
        assert_eq!(pc.seqs[0].num_new_tokens, 1);
        assert!(ev.contains(&SeqEvent::FirstToken {
            id: RequestId(2),
            at: Timestamp(2),
            cached_prompt_tokens: 16,
        }));
        let by_host = |h| pb.kv_offloads.iter().find(|c| c.host == h).unwrap().device;
        let c_table = &pc.seqs[0].new_blocks;
        // Each load brings A's block k (offloaded from a_full[k]) into C's block k.
        for (k, l) in pc.kv_loads.iter().enumerate() {
            assert_eq!(l.device, c_table[k]);
            assert_eq!(by_host(l.host), a_full[k]);
        }
        assert_eq!(pc.kv_loads.len(), 4);
        // C's 5 blocks: B's partial one (nothing cached) and 4 of B's 5 cached ones, evicted:
        // 4 new host blocks, none a load source.
        assert_eq!(pc.kv_offloads.len(), 4);
        assert!(hosts(&pc.kv_offloads).is_disjoint(&hosts(&pc.kv_loads)));
        let st = s.stats();
        assert_eq!(
            (
                st.num_host_blocks_used,
                st.num_kv_offloaded_blocks,
                st.num_kv_loaded_blocks,
                st.num_host_hit_tokens
            ),
            (8, 8, 4, 16)
        );
        assert_eq!(st.prefix_hits, 16);
        // D evicts C's partial block (nothing cached), B's last one (copied) and C's 4
        // loaded blocks, which the host tier holds already (inclusive: no copy).
        let pd = one(&mut s, 3, unique(3));
        assert_eq!(pd.kv_offloads.len(), 1);
        assert!(!c_table[..4].contains(&pd.kv_offloads[0].device));
        assert_eq!(s.stats().num_host_blocks_used, 9);
        s.check_invariants().unwrap();
    }

    /// A short request of its own (one block, none full: nothing cached, nothing evicted
    /// while 2 of the device's 6 blocks hold nothing).
    fn small(s: &mut Scheduler, id: u64) -> StepPlan {
        one(s, id, vec![9000 + id as u32, 9001])
    }

    /// As [`sched`], storing cached blocks ahead of their eviction.
    fn sched_ahead(host: usize) -> Scheduler {
        sched_config(6, host, true)
    }

    #[test]
    fn computed_blocks_are_stored_ahead_so_their_eviction_copies_nothing() {
        let mut s = sched_ahead(16);
        let pa = one(&mut s, 0, a());
        // A's plan computes its blocks: none can be stored before its step ran.
        assert!(pa.kv_stores.is_empty());
        let a_full = pa.seqs[0].new_blocks[..4].to_vec();
        // The next plan stores A's 4 full blocks (registered once A's step ran), in device
        // order, to host blocks given in turn.
        let p1 = small(&mut s, 1);
        let mut stored = p1.kv_stores.clone();
        stored.sort_by_key(|c| c.device);
        assert_eq!(stored, p1.kv_stores);
        let devs: BTreeSet<_> = stored.iter().map(|c| c.device).collect();
        assert_eq!(devs, a_full.iter().copied().collect());
        assert_eq!(hosts(&stored), (0..4).collect());
        assert!(p1.kv_offloads.is_empty() && p1.kv_loads.is_empty());
        let st = s.stats();
        assert_eq!(
            (st.num_kv_offloaded_blocks, st.num_kv_stored_ahead_blocks),
            (4, 4)
        );
        // B evicts A's blocks: the tier holds them already, so nothing is copied (the small
        // request's block held no whole block).
        let pb = one(&mut s, 3, unique(3));
        assert!(pb.kv_offloads.is_empty(), "{:?}", pb.kv_offloads);
        let b_full = pb.seqs[0].new_blocks[..5].to_vec();
        // C = A's prompt loads the 4 blocks the stores wrote.
        s.add_request(request(4, "", 4, a(), 1)).unwrap();
        let (pc, _) = run_step(&mut s, 4, 7);
        assert_eq!(pc.seqs[0].num_computed_tokens, 16);
        let by_host = |h| stored.iter().find(|c| c.host == h).unwrap().device;
        assert_eq!(pc.kv_loads.len(), 4);
        for (k, l) in pc.kv_loads.iter().enumerate() {
            assert_eq!(by_host(l.host), a_full[k]);
        }
        // C takes B's partial block and 4 of its 5 cached ones: those are offloaded by their
        // eviction (decided before the plan's stores); the fifth, still cached, is stored.
        assert_eq!(pc.kv_offloads.len(), 4);
        assert_eq!(pc.kv_stores.len(), 1, "{:?}", pc.kv_stores);
        let kept = pc.kv_stores[0].device;
        assert!(b_full.contains(&kept));
        assert!(!pc.kv_offloads.iter().any(|c| c.device == kept));
        assert!(hosts(&pc.kv_stores).is_disjoint(&hosts(&pc.kv_offloads)));
        assert!(hosts(&pc.kv_stores).is_disjoint(&hosts(&pc.kv_loads)));
        let st = s.stats();
        assert_eq!(
            (st.num_kv_offloaded_blocks, st.num_kv_stored_ahead_blocks),
            (9, 5)
        );
        s.check_invariants().unwrap();
    }

    #[test]
    fn without_stores_ahead_blocks_reach_the_tier_when_evicted() {
        let mut s = sched(16);
        one(&mut s, 0, a());
        for id in 1..4 {
            let p = small(&mut s, id);
            assert!(p.kv_stores.is_empty() && p.kv_offloads.is_empty());
        }
        let pb = one(&mut s, 9, unique(9));
        assert_eq!(pb.kv_offloads.len(), 4);
        assert!(pb.kv_stores.is_empty());
        assert_eq!(s.stats().num_kv_stored_ahead_blocks, 0);
    }

    /// A block stored ahead and then matched again (a prefix hit on the device) is not stored
    /// again, and one evicted before its turn is offloaded by its eviction instead.
    #[test]
    fn a_block_is_stored_once_and_an_evicted_one_not_at_all() {
        let mut s = sched_ahead(16);
        one(&mut s, 0, a());
        assert_eq!(small(&mut s, 1).kv_stores.len(), 4);
        // A again: a device hit on the 4 blocks, which it computes no block of again.
        one(&mut s, 3, a());
        for id in 4..7 {
            let p = small(&mut s, id);
            assert!(p.kv_stores.is_empty(), "{id}: {:?}", p.kv_stores);
        }
        assert_eq!(s.stats().num_kv_stored_ahead_blocks, 4);
        // D computes 5 full blocks; E's allocations evict all of them in the plan that would
        // store them: its offloads copy them, its stores skip them.
        one(&mut s, 7, unique(7));
        let pe = one(&mut s, 8, unique(8));
        assert!(pe.kv_stores.is_empty(), "{:?}", pe.kv_stores);
        assert_eq!(pe.kv_offloads.len(), 5, "{:?}", pe.kv_offloads);
        assert_eq!(s.stats().num_kv_stored_ahead_blocks, 4);
        s.check_invariants().unwrap();
    }

    /// Copies as runs of blocks consecutive on both sides, as the CUDA backend batches them.
    fn runs(c: &[BlockCopy]) -> usize {
        let mut runs = 0;
        for (k, x) in c.iter().enumerate() {
            let joins = k > 0 && {
                let p = c[k - 1];
                p.device + 1 == x.device && p.host + 1 == x.host
            };
            if !joins {
                runs += 1;
            }
        }
        runs
    }

    /// A plan's offloads come in device order with the host blocks given in turn, so a
    /// request's blocks evicted together go out as one run consecutive on both sides (the
    /// allocator evicts a freed table back to front: in eviction order, every block would be
    /// a transfer of its own on the GPU).
    #[test]
    fn blocks_evicted_together_are_offloaded_as_one_run() {
        let c = SchedulerConfig {
            block_size: 4,
            num_gpu_blocks: 40,
            max_model_len: 1024,
            enable_prefix_caching: true,
            num_host_blocks: 64,
            kv_offload_ahead: false,
            ..SchedulerConfig::default()
        };
        let mut s = Scheduler::new(c, Box::new(Fcfs), [5, 6]).unwrap();
        // Three prompts of 70 tokens, 18 blocks each: the first two take 35 of the 40 blocks
        // (they share none), the third the 5 left and 13 of the first's, 12 of them cached
        // (consecutive ids: the first's table was the cache's first blocks, in order).
        let mut offloads = Vec::new();
        for id in 0..3u64 {
            let prompt = (0..70).map(|k| 1000 * id as u32 + k).collect();
            offloads = one(&mut s, id, prompt).kv_offloads;
        }
        assert_eq!(offloads.len(), 12, "{offloads:?}");
        assert!(offloads.windows(2).all(|w| w[0].device < w[1].device));
        assert_eq!(runs(&offloads), 1, "{offloads:?}");
        s.check_invariants().unwrap();
    }

    #[test]
    fn a_host_tier_full_of_the_plans_load_sources_takes_no_offload() {
        // 4 host blocks: A's. C loads all 4 (pinned), so the 4 blocks C's allocations evict
        // are dropped rather than copied over a load source.
        let mut s = sched(4);
        a_then_b(&mut s);
        let pc = one(&mut s, 2, a());
        assert_eq!(pc.kv_loads.len(), 4);
        assert!(pc.kv_offloads.is_empty());
        assert_eq!(s.stats().num_host_blocks_used, 4);
        s.check_invariants().unwrap();
    }

    #[test]
    fn without_a_host_tier_nothing_is_copied_and_the_prefix_is_computed() {
        let mut s = sched(0);
        let (pb, _) = a_then_b(&mut s);
        assert!(pb.kv_offloads.is_empty());
        let pc = one(&mut s, 2, a());
        assert_eq!(pc.seqs[0].num_computed_tokens, 0);
        assert!(pc.kv_loads.is_empty() && pc.kv_offloads.is_empty());
        let st = s.stats();
        assert_eq!((st.num_kv_offloaded_blocks, st.num_host_hit_tokens), (0, 0));
    }

    #[test]
    fn a_failed_step_drops_the_host_tier_too() {
        let mut s = sched(16);
        a_then_b(&mut s);
        s.clear_prefix_cache();
        assert_eq!(s.stats().num_host_blocks_used, 0);
        let pc = one(&mut s, 2, a());
        assert_eq!(pc.seqs[0].num_computed_tokens, 0);
        assert!(pc.kv_loads.is_empty());
        s.check_invariants().unwrap();
    }

    #[test]
    fn a_preempted_requests_blocks_come_back_by_copy() {
        // L (priority 5, 17 tokens) runs; H (priority 0, 20 tokens: 5 blocks) arrives: the
        // pool (1 block free) cannot hold it, so L is preempted (its 4 full blocks stay
        // cached, freed back to front) and H's 5 blocks take the unused one, L's partial one
        // and the 3 least recently freed of L's cached ones (L's blocks 3, 2, 1), copied out.
        // H ends after its token; L comes back with 18 tokens, finds its block 0 on the
        // device and blocks 1 to 3 in the host tier: 16 tokens cached, 12 loaded, 2 computed.
        let c = SchedulerConfig {
            block_size: 4,
            num_gpu_blocks: 6,
            max_model_len: 1024,
            enable_prefix_caching: true,
            num_host_blocks: 16,
            ..SchedulerConfig::default()
        };
        let p = crate::policy::PriorityPolicy::new(0.0, true, 3);
        let mut s = Scheduler::new(c, Box::new(p), [5, 6]).unwrap();
        let with_priority = |id, prompt, max_tokens, priority| Request {
            priority,
            ..request(id, "", id, prompt, max_tokens)
        };
        s.add_request(with_priority(0, a(), 4, 5)).unwrap();
        let (p0, _) = run_step(&mut s, 0, 7);
        let l_full = p0.seqs[0].new_blocks[..4].to_vec();
        s.add_request(with_priority(1, unique(1)[..20].to_vec(), 1, 0))
            .unwrap();
        let (p1, _) = run_step(&mut s, 1, 7);
        assert_eq!(p1.preempted, [RequestId(0)]);
        let out: BTreeSet<_> = p1.kv_offloads.iter().map(|c| c.device).collect();
        assert_eq!(out, l_full[1..].iter().copied().collect());
        let (p2, _) = run_step(&mut s, 2, 7);
        let q = &p2.seqs[0];
        assert_eq!(
            (q.id, q.num_computed_tokens, q.num_new_tokens),
            (RequestId(0), 16, 2)
        );
        assert_eq!(q.new_blocks[0], l_full[0]);
        assert_eq!(hosts(&p2.kv_loads), hosts(&p1.kv_offloads));
        for (k, l) in p2.kv_loads.iter().enumerate() {
            assert_eq!(l.device, q.new_blocks[k + 1]);
            // Block k + 1 of L went out from l_full[k + 1] and comes back to L's block k + 1.
            let went = p1.kv_offloads.iter().find(|c| c.host == l.host).unwrap();
            assert_eq!(went.device, l_full[k + 1]);
        }
        assert_eq!(s.stats().num_host_hit_tokens, 12);
        assert_eq!(s.stats().num_preemptions, 1);
        s.check_invariants().unwrap();
    }

    /// Two requests admitted in one step with the same prefix held in the host tier: the first
    /// loads it, the second finds those loads (`Scheduler::plan_loads`) after its device match
    /// and shares the loaded blocks, as a device cache hit. The plan names each tier block
    /// once; it used to load it for each request, into blocks of their own (8 loads).
    #[test]
    fn one_plan_loads_a_tier_block_once_for_every_request_that_needs_it() {
        let mut s = sched_with(12, 4);
        one(&mut s, 0, a());
        // 47 tokens and its one output: the whole device cache, A's 4 blocks offloaded.
        let pb = one(&mut s, 1, (0..47).map(|k| 5_000 + k).collect());
        assert_eq!(pb.kv_offloads.len(), 4);
        s.add_request(request(2, "", 2, a(), 1)).unwrap();
        s.add_request(request(3, "", 3, a(), 1)).unwrap();
        let p = s.schedule(Timestamp(4));
        assert_eq!(p.seqs.len(), 2);
        assert_eq!(p.kv_loads.len(), 4, "{:?}", p.kv_loads);
        assert_eq!(hosts(&p.kv_loads), (0..4).collect());
        // Both tables start with the 4 loaded blocks, in load order; each request then has
        // a block of its own for its last token.
        let (c, d) = (&p.seqs[0], &p.seqs[1]);
        let loaded: Vec<BlockId> = p.kv_loads.iter().map(|l| l.device).collect();
        assert_eq!(c.new_blocks[..4], loaded[..]);
        assert_eq!(d.new_blocks[..4], loaded[..]);
        assert_eq!((c.new_blocks.len(), d.new_blocks.len()), (5, 5));
        assert_ne!(c.new_blocks[4], d.new_blocks[4]);
        assert_eq!((c.num_computed_tokens, d.num_computed_tokens), (16, 16));
        for &blk in &loaded {
            assert_eq!(
                s.ledger().ref_count(blk),
                Some(2),
                "shared like a cache hit"
            );
        }
        // 4 + 2 blocks taken of the 12, not 8 + 2.
        assert_eq!(s.ledger().num_free(), 6);
        s.check_invariants().unwrap();
        // Both report 16 cached tokens; the tier's 16 count once, the second's as device hits.
        let out = [
            StepOutput::new(RequestId(2), 7),
            StepOutput::new(RequestId(3), 7),
        ];
        let ev = s.apply_outputs(&p, &out, Timestamp(5));
        for id in [2, 3] {
            assert!(ev.contains(&SeqEvent::FirstToken {
                id: RequestId(id),
                at: Timestamp(5),
                cached_prompt_tokens: 16,
            }));
        }
        let st = s.stats();
        assert_eq!((st.num_kv_loaded_blocks, st.num_host_hit_tokens), (4, 16));
        assert_eq!(st.prefix_hits, 32);
        assert!(!s.has_unfinished());
        // Once both ended, the loaded blocks are cached on the device, unreferenced.
        for &blk in &loaded {
            assert_eq!(s.ledger().ref_count(blk), Some(0));
        }
        s.check_invariants().unwrap();
    }

    /// Two requests admitted in one step share a tier load; a third, admitted after them,
    /// preempts a running request planned earlier in the step, so the sharer's plan entry
    /// moves up one place. The share must follow it: it used to keep the old index, so the
    /// loaded blocks' ids went into the third request's entry (over its own new blocks) and
    /// the sharer's entry kept placeholders instead of block ids.
    #[test]
    fn a_share_follows_its_entry_when_an_admission_preempts_a_running_request() {
        let c = crate::types::SchedulerConfig {
            block_size: 4,
            num_gpu_blocks: 16,
            max_model_len: 1024,
            enable_prefix_caching: true,
            num_host_blocks: 32,
            kv_offload_ahead: false,
            ..crate::types::SchedulerConfig::default()
        };
        let p = crate::policy::PriorityPolicy::new(0.0, true, 3);
        let mut s = Scheduler::new(c, Box::new(p), [5, 6]).unwrap();
        one(&mut s, 0, a());
        // 63 tokens and the output: the whole device; A's 4 cached blocks go to the tier.
        let pb = one(&mut s, 1, (0..63).map(|k| 5_000 + k).collect());
        assert_eq!(pb.kv_offloads.len(), 4);
        let with_priority = |id, prompt, max_tokens, priority| Request {
            priority,
            ..request(id, "", id, prompt, max_tokens)
        };
        // L (priority 5) decodes in one block.
        s.add_request(with_priority(2, vec![7_000, 7_001], 50, 5))
            .unwrap();
        run_step(&mut s, 2, 7);
        run_step(&mut s, 3, 7);
        // C loads A's 4 blocks (5 blocks in all), D shares them (1 of its own): 16 - 1 - 6 =
        // 9 left. E's 40 tokens need 10: L is preempted for it.
        s.add_request(with_priority(3, a(), 1, 0)).unwrap();
        s.add_request(with_priority(4, a(), 1, 0)).unwrap();
        s.add_request(with_priority(5, (0..40).map(|k| 9_000 + k).collect(), 1, 0))
            .unwrap();
        let p = s.schedule(Timestamp(4));
        assert_eq!(p.preempted, [RequestId(2)]);
        let ids: Vec<u64> = p.seqs.iter().map(|q| q.id.0).collect();
        assert_eq!(ids, [3, 4, 5]);
        let loaded: Vec<BlockId> = p.kv_loads.iter().map(|l| l.device).collect();
        assert_eq!(loaded.len(), 4);
        let (c, d, e) = (&p.seqs[0], &p.seqs[1], &p.seqs[2]);
        assert_eq!(c.new_blocks[..4], loaded[..]);
        assert_eq!(
            d.new_blocks[..4],
            loaded[..],
            "the sharer gets the loaded blocks"
        );
        assert_eq!(e.new_blocks.len(), 10);
        assert!(
            e.new_blocks.iter().all(|b| !loaded.contains(b)),
            "E's own blocks: {:?}, loaded {loaded:?}",
            e.new_blocks
        );
        s.check_invariants().unwrap();
    }

    /// The step's budget lent by a running prefill (`planner/running.rs`, `reclaimable`):
    /// C loads a prefix from the tier and D shares it, both outranking R, whose planned chunk
    /// they take, the last of it after D's admission. R's entry leaves the plan ahead of D's,
    /// so D's share moves with it (else D's entry would keep placeholders); R gives back its
    /// chunk's blocks and goes on from where it was.
    #[test]
    fn a_share_follows_its_entry_when_a_lenders_chunk_leaves_the_plan() {
        let c = crate::types::SchedulerConfig {
            block_size: 4,
            num_gpu_blocks: 24,
            max_model_len: 1024,
            max_num_batched_tokens: 16,
            enable_prefix_caching: true,
            num_host_blocks: 64,
            kv_offload_ahead: false,
            ..crate::types::SchedulerConfig::default()
        };
        let p = crate::policy::PriorityPolicy::new(0.0, false, 3);
        let mut s = Scheduler::new(c, Box::new(p), [5, 6]).unwrap();
        let with_priority = |id, prompt, max_tokens, priority| Request {
            priority,
            ..request(id, "", id, prompt, max_tokens)
        };
        // A, then 95 tokens and the output (the whole device), each in 16-token chunks: A's
        // 4 cached blocks go to the tier.
        s.add_request(with_priority(0, a(), 1, 0)).unwrap();
        let mut t = 0;
        while s.has_unfinished() {
            run_step(&mut s, t, 7);
            t += 1;
        }
        s.add_request(with_priority(1, (0..95).map(|k| 5_000 + k).collect(), 1, 0))
            .unwrap();
        while s.has_unfinished() {
            run_step(&mut s, t, 7);
            t += 1;
        }
        assert_eq!(s.stats().num_host_blocks_used, 4);
        // R (priority 5): 40 tokens, 16 a step.
        s.add_request(with_priority(2, (0..40).map(|k| 7_000 + k).collect(), 4, 5))
            .unwrap();
        let (p, _) = run_step(&mut s, t, 7);
        assert_eq!(p.seqs[0].num_new_tokens, 16);
        // C = A (1 token to compute: 16 loaded) and D = A's 16 tokens and 15 of its own.
        s.add_request(with_priority(3, a(), 1, 0)).unwrap();
        let mut d_prompt: Vec<u32> = a()[..16].to_vec();
        d_prompt.extend(8_000..8_015);
        s.add_request(with_priority(4, d_prompt, 1, 0)).unwrap();
        let p = s.schedule(Timestamp(t + 1));
        let chunks: Vec<(u64, usize, usize)> = p
            .seqs
            .iter()
            .map(|q| (q.id.0, q.num_computed_tokens, q.num_new_tokens))
            .collect();
        assert_eq!(chunks, [(3, 16, 1), (4, 16, 15)]);
        assert_eq!(p.num_batched_tokens, 16);
        let loaded: Vec<BlockId> = p.kv_loads.iter().map(|l| l.device).collect();
        assert_eq!(loaded.len(), 4);
        assert_eq!(p.seqs[0].new_blocks[..4], loaded[..]);
        assert_eq!(p.seqs[1].new_blocks[..4], loaded[..], "the sharer's blocks");
        assert_eq!(p.seqs[1].new_blocks.len(), 8);
        // R holds its first chunk's 4 blocks again.
        assert_eq!(s.block_table(RequestId(2)).map(<[_]>::len), Some(4));
        s.check_invariants().unwrap();
        let out = [
            StepOutput::new(RequestId(3), 7),
            StepOutput::new(RequestId(4), 7),
        ];
        s.apply_outputs(&p, &out, Timestamp(t + 1));
        let (p, _) = run_step(&mut s, t + 2, 7);
        let r = p.seqs.iter().find(|q| q.id == RequestId(2)).unwrap();
        assert_eq!((r.num_computed_tokens, r.num_new_tokens), (16, 16));
        assert_eq!(r.first_new_block, 4);
    }

    #[test]
    fn num_host_blocks_is_bounded() {
        let c = SchedulerConfig {
            num_host_blocks: crate::scheduler::MAX_HOST_BLOCKS + 1,
            ..SchedulerConfig::default()
        };
        match crate::validate_config(&c) {
            Err(crate::SchedulerError::InvalidConfig { field, .. }) => {
                assert_eq!(field, "num_host_blocks")
            }
            other => panic!("{other:?}"),
        }
    }
}
