//! Cached-prefix lookups for policies that rank by them (see
//! [`crate::Policy::prefix_lookups`]).
//!
//! Before the planner ranks the waiting queue it looks up, for at most the policy's number of
//! waiting sequences, the earliest arrivals first (then the lowest id), how many leading
//! tokens the prefix cache holds, and records it where [`crate::SeqView::cached_prefix_tokens`]
//! reads it; every other waiting sequence reads `None`. A lookup walks the block-hash chain
//! as admission's prefix match does, with the same cap (never the last token), and stops at
//! the first miss: hit length + 1 probes, and a block's hash is computed only when the walk
//! reaches it, once over the request's life (admission reuses it). A walk resumes where the
//! sequence's previous one stopped unless a registration was dropped (evicted or cleared) since
//! ([`crate::BlockLedger::cache_drops`]): registrations only grow in between, so the blocks it
//! found are still there, and a request waiting many steps costs about one probe a step.
//!
//! With a host KV tier (`host_tier.rs`) the walk goes on there where the device cache's hit
//! ends, as admission's match does, with the same cap: those blocks would be copied back
//! rather than computed, so they count as cached (a copy over PCIe, or a memcpy on the CPU,
//! costs far less than the prefill it saves). Only the device part resumes; the host part
//! is walked afresh from the device hit's end at each lookup. That is the simpler of the two
//! correct choices: the tier evicts on every offload that finds it full (and loses a block
//! to nothing else), so a resumed host part would need a drop count of its own kept beside
//! `cache_drops`, whereas a fresh walk over hashes already computed costs host hit + 1 map
//! probes and cannot be stale.
//!
//! The same lookup makes SGLang's in-batch prefix check (`_compute_prefix_matches` in
//! `python/sglang/srt/managers/schedule_policy.py`, which matches the waiting requests with
//! little cached against a temporary radix tree of those before them): the miss that ends a
//! walk is the hash of the first block the sequence would compute, and
//! [`crate::SeqView::shares_pending_prefix`] tells whether a request ahead of it is to compute
//! that same block. Ahead means a running sequence still prefilling for which it is the first
//! block not registered in the cache yet (a prefill in chunks registers its full blocks as each
//! chunk is launched, so a request admitted mid-way would compute the rest of the shared prefix
//! beside it), or a looked-up sequence that arrived earlier and is not flagged itself. Chained hashes make one
//! block enough: two sequences share block *i* exactly when they share blocks 0..=*i*, with
//! the same adapter and cache salt (the tenant's isolation). Where SGLang checks only requests
//! with at most 32 cached tokens, this check holds for any cached length (a request whose
//! shared prefix is partly computed by a running prefill is flagged too).
//!
//! Per step that is O(waiting) to pick the earliest arrivals, O(running) to collect the first
//! uncomputed block of each running prefill, and, for at most [`MAX_PREFIX_LOOKUPS`] sequences,
//! sorted by arrival (O(L log L)), a walk of at most hit length + 1 probes (+ 2 with a host
//! tier: the device miss, then the tier's; only the device part amortises across steps) and one set probe.

use std::collections::HashSet;
use std::hash::BuildHasherDefault;

use crate::block_pool::PassThroughHasher;
use crate::policy::MAX_PREFIX_LOOKUPS;
use crate::prefix_hash::{BlockHasher, PrefixHash};
use crate::scheduler::Scheduler;
use crate::sequence::{PrefixLookup, Sequence};
use crate::types::RequestState;

/// Block hashes that a request ahead in the current step is to compute.
pub(crate) type PendingBlocks = HashSet<PrefixHash, BuildHasherDefault<PassThroughHasher>>;

impl Scheduler {
    /// Records the cached prefix of the earliest-arrived waiting sequences, up to what the
    /// policy asks for; nothing when it asks for none, or with prefix caching off (a setting
    /// fixed at construction: no sequence then ever holds a lookup).
    pub(crate) fn look_up_cached_prefixes(&mut self) {
        let limit = self.policy.prefix_lookups().min(MAX_PREFIX_LOOKUPS);
        if limit == 0 || !self.config.enable_prefix_caching {
            return;
        }
        // Only the sequences of the previous lookups can hold one (admission, the end of a
        // request and a policy swap clear theirs): O(lookups), not O(waiting).
        for &(_, _, slot) in &self.lookups {
            if let Some(s) = self.seqs.get_mut(slot as usize).and_then(Option::as_mut) {
                s.cached_prefix = None;
            }
        }
        let mut earliest = std::mem::take(&mut self.lookups);
        earliest.clear();
        earliest.extend(
            self.waiting
                .iter()
                .filter_map(|&slot| self.seq(slot).map(|s| (s.req.arrival, s.id, slot))),
        );
        let n = limit.min(earliest.len());
        if n < earliest.len() {
            // The n earliest (arrival, id) before position n, in no particular order.
            earliest.select_nth_unstable(n);
        }
        earliest.truncate(n);
        // In arrival order: of the sequences sharing a block to compute, the first is ahead.
        earliest.sort_unstable();
        let mut pending = std::mem::take(&mut self.pending_blocks);
        self.running_prefill_blocks(&mut pending);
        let bs = self.ledger.block_size();
        for &(_, _, slot) in &earliest {
            let blocks = self.cached_prefix_blocks(slot);
            if let Some(s) = self.seqs.get_mut(slot as usize).and_then(Option::as_mut) {
                // The walk hashed the block it missed, if it stopped before its cap.
                let max_blocks = s.num_tokens().saturating_sub(1) / bs;
                let next = s.hashes.get(blocks).filter(|_| blocks < max_blocks);
                s.cached_prefix = Some(PrefixLookup {
                    tokens: u32::try_from(blocks * bs).unwrap_or(u32::MAX),
                    pending_ahead: next.is_some_and(|&h| !pending.insert(h)),
                });
            }
        }
        self.lookups = earliest;
        self.pending_blocks = pending;
    }

    /// Fills `out` with, for each running sequence still prefilling, the first block of its
    /// chain not registered in the cache yet (it computes it in this step or a later one). A
    /// running sequence's chain covers every full block before its last token from its
    /// admission on (admission hashes them to match its prefix), so the hash is there.
    fn running_prefill_blocks(&self, out: &mut PendingBlocks) {
        out.clear();
        for &slot in &self.running {
            let Some(s) = self.seq(slot) else {
                continue;
            };
            if s.state == RequestState::Running && s.num_tokens() - s.num_computed > 1 {
                if let Some(&h) = s.hashes.get(s.num_cached_blocks) {
                    out.insert(h);
                }
            }
        }
    }

    /// Leading blocks of a waiting sequence found in the prefix cache, at most those before
    /// its last token (admission always computes that one), hashing blocks as the walk
    /// reaches them: the device cache's hit, then, with a host tier, the blocks after it held
    /// there (admission's match, which loads them).
    fn cached_prefix_blocks(&mut self, slot: u32) -> usize {
        let bs = self.ledger.block_size();
        let Some(seq) = self.seqs.get_mut(slot as usize).and_then(Option::as_mut) else {
            return 0;
        };
        let max_blocks = seq.num_tokens().saturating_sub(1) / bs;
        // Blocks an earlier walk found are still cached if no registration was dropped since.
        let drops = self.ledger.cache_drops();
        let mut n = match seq.prefix_walk {
            (d, found) if d == drops => (found as usize).min(max_blocks),
            _ => 0,
        };
        while n < max_blocks {
            match hash_of_block(&mut self.hasher, seq, bs, n) {
                Some(h) if self.ledger.is_cached(h) => n += 1,
                _ => break,
            }
        }
        // Only the device part resumes: the host tier's part is walked afresh each time.
        seq.prefix_walk = (drops, u32::try_from(n).unwrap_or(u32::MAX));
        // The chain goes on in the host tier, as admission's match does: those blocks would be
        // copied back, not computed.
        let Some(host) = self.host.as_ref() else {
            return n;
        };
        while n < max_blocks {
            match hash_of_block(&mut self.hasher, seq, bs, n) {
                Some(h) if host.lookup(h).is_some() => n += 1,
                _ => break,
            }
        }
        n
    }
}

/// The hash of block `n` of `seq`'s chain (`None` past its full blocks), computing the chain
/// up to it if the sequence has not yet.
fn hash_of_block(
    hasher: &mut BlockHasher,
    seq: &mut Sequence,
    bs: usize,
    n: usize,
) -> Option<PrefixHash> {
    if seq.hashes.len() <= n {
        let extras = seq.hash_extras();
        let mut hashes = std::mem::take(&mut seq.hashes);
        hasher.extend_chain(&mut hashes, seq.tokens(), bs, n + 1, extras);
        seq.hashes = hashes;
    }
    seq.hashes.get(n).copied()
}

#[cfg(test)]
mod tests {

    use crate::policy::testutil::{request, run_step};
    use crate::policy::{Fcfs, Policy, PrefixAware};
    use crate::types::*;
    use crate::{Scheduler, SeqView};

    /// Blocks of 4 tokens, one seat: each step admits one request, which (max_tokens 1)
    /// ends in that step, so the admission order is the order of the plans.
    fn sched(policy: Box<dyn Policy>, caching: bool) -> Scheduler {
        seated(policy, caching, 1, 1024)
    }

    /// As [`sched`] with `seats` seats and steps of at most `tokens` tokens.
    fn seated(policy: Box<dyn Policy>, caching: bool, seats: usize, tokens: usize) -> Scheduler {
        let c = SchedulerConfig {
            max_num_seqs: seats,
            max_num_batched_tokens: tokens,
            block_size: 4,
            num_gpu_blocks: 64,
            enable_prefix_caching: caching,
            max_model_len: 1024,
            ..SchedulerConfig::default()
        };
        Scheduler::new(c, policy, [3, 4]).unwrap()
    }

    /// The 16-token shared prefix (4 blocks).
    fn shared() -> Vec<u32> {
        (1..=16).collect()
    }

    /// `shared()` then `tail`.
    fn shared_then(tail: &[u32]) -> Vec<u32> {
        let mut p = shared();
        p.extend_from_slice(tail);
        p
    }

    /// 17 tokens no other prompt shares.
    fn unique(id: u64) -> Vec<u32> {
        (0..17).map(|k| 10_000 * id as u32 + k).collect()
    }

    fn add(s: &mut Scheduler, id: u64, arrival: u64, prompt: Vec<u32>) {
        add_salted(s, id, arrival, prompt, None);
    }

    fn add_salted(s: &mut Scheduler, id: u64, arrival: u64, prompt: Vec<u32>, salt: Option<u64>) {
        s.add_request(Request {
            cache_salt: salt,
            ..request(id, "", arrival, prompt, 1)
        })
        .unwrap();
    }

    /// One step at `now`: the (id, cached tokens reused) of each request it admits.
    fn step(s: &mut Scheduler, now: u64) -> Vec<(u64, usize)> {
        let (plan, _) = run_step(s, now, 7);
        plan.seqs
            .iter()
            .map(|q| (q.id.0, q.num_computed_tokens))
            .collect()
    }

    /// Steps from `now` on, one per microsecond, until nothing is left: the admission order.
    fn drain(s: &mut Scheduler, mut now: u64) -> Vec<u64> {
        let mut order = Vec::new();
        while s.has_unfinished() && now < 1_000 {
            order.extend(step(s, now).into_iter().map(|(id, _)| id));
            now += 1;
        }
        order
    }

    /// The cached tokens the last lookup recorded for request `id`.
    fn looked_up(s: &Scheduler, id: u64) -> Option<usize> {
        let slot = s.index[&RequestId(id)];
        s.seq(slot)
            .and_then(|q| q.cached_prefix)
            .map(|l| l.tokens as usize)
    }

    /// Whether the last lookup flagged request `id` as sharing a block still to compute.
    fn held(s: &Scheduler, id: u64) -> bool {
        let slot = s.index[&RequestId(id)];
        s.seq(slot)
            .is_some_and(|q| SeqView::new(q).shares_pending_prefix())
    }

    /// Request 0 (arrival 0) puts `shared()` in the cache; then 1 (arrival 10, a prompt of
    /// its own) and 2 (arrival 20, `shared()` and one token) wait.
    fn warm_then_two(policy: Box<dyn Policy>) -> Scheduler {
        let mut s = sched(policy, true);
        add(&mut s, 0, 0, shared_then(&[99]));
        assert_eq!(step(&mut s, 0), [(0, 0)]);
        add(&mut s, 1, 10, unique(1));
        add(&mut s, 2, 20, shared_then(&[50]));
        s
    }

    #[test]
    fn the_request_with_a_cached_prefix_is_admitted_first() {
        // 2 arrived after 1, but its 16 leading tokens are cached (4 full blocks before its
        // last token): it goes first and reuses them; FCFS admits 1 first.
        let mut s = warm_then_two(Box::new(PrefixAware::new(5_000.0, 128)));
        assert_eq!(step(&mut s, 100), [(2, 16)]);
        assert_eq!(step(&mut s, 101), [(1, 0)]);
        let mut s = warm_then_two(Box::new(Fcfs));
        assert_eq!(step(&mut s, 100), [(1, 0)]);
        assert_eq!(step(&mut s, 101), [(2, 16)]);
    }

    #[test]
    fn a_request_waiting_max_wait_ms_goes_first() {
        // max_wait 1 ms: 1 (arrival 10 us) has waited exactly 1000 us at t = 1010 us and
        // ranks before 2 (990 us waited) despite 2's cached prefix; at t = 1009 it has not.
        let mut s = warm_then_two(Box::new(PrefixAware::new(1.0, 128)));
        assert_eq!(step(&mut s, 1_010), [(1, 0)]);
        let mut s = warm_then_two(Box::new(PrefixAware::new(1.0, 128)));
        assert_eq!(step(&mut s, 1_009), [(2, 16)]);
    }

    /// Request 0 (arrival 0) with `shared()`, then 1 and 3 sharing it and 2, 4, 5 with
    /// prompts of their own, all queued at once.
    fn mixed(policy: Box<dyn Policy>, caching: bool) -> Vec<u64> {
        let mut s = sched(policy, caching);
        add(&mut s, 0, 0, shared_then(&[99]));
        add(&mut s, 1, 30, shared_then(&[51]));
        add(&mut s, 2, 10, unique(2));
        add(&mut s, 3, 20, shared_then(&[53]));
        add(&mut s, 4, 10, unique(4));
        add(&mut s, 5, 5, unique(5));
        drain(&mut s, 100)
    }

    #[test]
    fn without_prefix_caching_the_order_is_fcfs() {
        // Arrival, then id: 0 (0), 5 (5), 2 and 4 (10), 3 (20), 1 (30).
        let fcfs = [0, 5, 2, 4, 3, 1];
        assert_eq!(mixed(Box::new(Fcfs), false), fcfs);
        assert_eq!(mixed(Box::new(Fcfs), true), fcfs);
        assert_eq!(mixed(Box::new(PrefixAware::new(5_000.0, 128)), false), fcfs);
        // With caching: nothing is cached at first (0 goes first by arrival), then 3 and 1
        // hit `shared()` (arrival orders them), then the rest by arrival.
        assert_eq!(
            mixed(Box::new(PrefixAware::new(5_000.0, 128)), true),
            [0, 3, 1, 5, 2, 4]
        );
    }

    /// Blocks of 4 tokens, 6 on the device and `host` in the host tier, one seat: request 0
    /// puts `shared()` in the device cache, then request 1 (23 tokens of its own: the whole
    /// device cache with its output) evicts those 4 blocks, copied to the host tier (so
    /// `host_tier.rs` tests); 2 (arrival 10, a prompt of its own) and 3 (arrival 20,
    /// `shared()` and one token) wait.
    fn host_tier_then_two(policy: Box<dyn Policy>, host: usize) -> Scheduler {
        let c = SchedulerConfig {
            max_num_seqs: 1,
            block_size: 4,
            num_gpu_blocks: 6,
            max_model_len: 1024,
            enable_prefix_caching: true,
            num_host_blocks: host,
            ..SchedulerConfig::default()
        };
        let mut s = Scheduler::new(c, policy, [3, 4]).unwrap();
        add(&mut s, 0, 0, shared_then(&[99]));
        assert_eq!(step(&mut s, 0), [(0, 0)]);
        add(&mut s, 1, 1, (0..23).map(|k| 5_000 + k).collect());
        assert_eq!(step(&mut s, 1), [(1, 0)]);
        add(&mut s, 2, 10, unique(2));
        add(&mut s, 3, 20, shared_then(&[50]));
        s
    }

    #[test]
    fn a_prefix_only_in_the_host_tier_ranks_as_cached() {
        // 3's 4 leading blocks are only in the host tier: the lookup counts them, so 3 goes
        // before 2 (which arrived first) and admission loads them (16 tokens computed).
        let mut s = host_tier_then_two(Box::new(PrefixAware::new(5_000.0, 128)), 16);
        s.look_up_cached_prefixes();
        assert_eq!((looked_up(&s, 2), looked_up(&s, 3)), (Some(0), Some(16)));
        assert_eq!(step(&mut s, 100), [(3, 16)]);
        assert_eq!(step(&mut s, 101), [(2, 0)]);
        // FCFS: 2 first, and 3 still loads its prefix from the tier.
        let mut s = host_tier_then_two(Box::new(Fcfs), 16);
        assert_eq!(step(&mut s, 100), [(2, 0)]);
        assert_eq!(step(&mut s, 101), [(3, 16)]);
    }

    #[test]
    fn a_host_hit_evicted_from_the_tier_is_not_counted_again() {
        // A tier of 4 blocks holds 3's prefix; the lookup finds it. Then 4 other blocks are
        // offloaded (the LRU evicts 3's): the next lookup, with no device drop in between
        // (so the device walk resumes), finds nothing in the tier.
        let mut s = host_tier_then_two(Box::new(PrefixAware::new(5_000.0, 128)), 4);
        s.look_up_cached_prefixes();
        assert_eq!(looked_up(&s, 3), Some(16));
        let drops = s.ledger.cache_drops();
        let host = s.host.as_mut().expect("a host tier");
        host.begin_plan();
        for k in 0..4 {
            assert!(host
                .offload(crate::prefix_hash::PrefixHash(1 << 100 | k))
                .is_some());
        }
        assert_eq!(s.ledger.cache_drops(), drops);
        s.look_up_cached_prefixes();
        assert_eq!(looked_up(&s, 3), Some(0));
        // Ranked as uncached now: 2 goes first by arrival.
        assert_eq!(step(&mut s, 100), [(2, 0)]);
    }

    #[test]
    fn only_the_earliest_arrivals_up_to_the_limit_are_looked_up() {
        // Limit 2: 1 (arrival 10) and 3 (arrival 15) are looked up, 2 (arrival 20, sharing
        // the prefix) is not, and ranks after them by arrival.
        let run = |limit: usize| {
            let mut s = sched(Box::new(PrefixAware::new(5_000.0, limit)), true);
            add(&mut s, 0, 0, shared_then(&[99]));
            assert_eq!(step(&mut s, 0), [(0, 0)]);
            add(&mut s, 1, 10, unique(1));
            add(&mut s, 2, 20, shared_then(&[50]));
            add(&mut s, 3, 15, unique(3));
            let first = step(&mut s, 100);
            let seen = (looked_up(&s, 2), looked_up(&s, 3));
            (first, seen)
        };
        assert_eq!(run(2), (vec![(1, 0)], (None, Some(0))));
        assert_eq!(run(3), (vec![(2, 16)], (None, Some(0))));
    }

    #[test]
    fn a_lookup_finds_what_admission_reuses_and_hashes_hit_plus_one_blocks() {
        let mut s = sched(Box::new(PrefixAware::new(5_000.0, 128)), true);
        add(&mut s, 0, 0, shared_then(&[99]));
        assert_eq!(step(&mut s, 0), [(0, 0)]);
        // 1: exactly `shared()`: its last token is always computed, so 3 blocks (12 tokens).
        // 2: the first 2 blocks of `shared()`, then its own 40 tokens: 8 tokens, and only
        //    3 of its 12 blocks hashed (2 hits and the miss). 3: a miss at once, 1 hashed.
        let mut half: Vec<u32> = (1..=8).collect();
        half.extend(500..540);
        add(&mut s, 1, 10, shared());
        add(&mut s, 2, 20, half);
        add(&mut s, 3, 30, unique(3));
        s.look_up_cached_prefixes();
        let hashed = |s: &Scheduler, id| s.seq(s.index[&RequestId(id)]).unwrap().hashes.len();
        assert_eq!(
            [1, 2, 3].map(|id| looked_up(&s, id)),
            [Some(12), Some(8), Some(0)]
        );
        assert_eq!([2, 3].map(|id| hashed(&s, id)), [3, 1]);
        // Admitted (longest first), each reuses what its lookup found and reads None.
        assert_eq!(step(&mut s, 100), [(1, 12)]);
        assert_eq!(step(&mut s, 101), [(2, 8)]);
        assert_eq!(step(&mut s, 102), [(3, 0)]);
        assert_eq!(looked_up(&s, 1), None);
    }

    #[test]
    fn a_walk_resumes_only_while_nothing_was_dropped_from_the_cache() {
        let mut s = warm_then_two(Box::new(PrefixAware::new(5_000.0, 128)));
        s.look_up_cached_prefixes();
        assert_eq!(looked_up(&s, 2), Some(16));
        let walk = |s: &Scheduler| s.seq(s.index[&RequestId(2)]).unwrap().prefix_walk;
        assert_eq!(walk(&s), (0, 4));
        // A failed step drops every registration: the 4 blocks found before are gone, and a
        // walk resumed from them would still report 16 tokens.
        s.clear_prefix_cache();
        s.look_up_cached_prefixes();
        assert_eq!(looked_up(&s, 2), Some(0));
        assert_eq!(walk(&s).1, 0);
    }

    #[test]
    fn a_policy_that_does_not_ask_sees_no_lookup() {
        let mut s = warm_then_two(Box::new(PrefixAware::new(5_000.0, 128)));
        s.look_up_cached_prefixes();
        assert_eq!(looked_up(&s, 2), Some(16));
        // Swapped out, the lookups are dropped, and FCFS makes none.
        s.swap_policy(Box::new(Fcfs));
        s.look_up_cached_prefixes();
        assert_eq!((looked_up(&s, 1), looked_up(&s, 2)), (None, None));
    }

    /// Requests 0 and 1 share `shared()`, cold; 2 has a prompt of its own; all 17 tokens,
    /// queued at once, with seats for all and steps of 34 tokens (two prompts).
    fn cold_pair_and_one(on: bool) -> Scheduler {
        let p = PrefixAware::new(5_000.0, 128).with_hold_back_shared(on);
        let mut s = seated(Box::new(p), true, 4, 34);
        add(&mut s, 0, 0, shared_then(&[99]));
        add(&mut s, 1, 10, shared_then(&[51]));
        add(&mut s, 2, 20, unique(2));
        s
    }

    #[test]
    fn a_request_sharing_a_cold_prefix_with_one_ahead_waits_and_then_reuses_it() {
        // 1's first block to compute is 0's: held back behind 2, it finds the prefix cached
        // in the next step (16 tokens reused); 0 is the first of the two and is not held back.
        let mut s = cold_pair_and_one(true);
        s.look_up_cached_prefixes();
        assert_eq!([0, 1, 2].map(|id| held(&s, id)), [false, true, false]);
        assert_eq!(step(&mut s, 100), [(0, 0), (2, 0)]);
        assert_eq!(step(&mut s, 101), [(1, 16)]);
        // Without the hold-back, 1 goes second by arrival and computes the prefix again.
        let mut s = cold_pair_and_one(false);
        assert_eq!(step(&mut s, 100), [(0, 0), (1, 0)]);
        assert_eq!(step(&mut s, 101), [(2, 0)]);
    }

    #[test]
    fn a_held_back_request_still_fills_an_otherwise_idle_step() {
        // Only 0 and 1 wait: 1 is held back but the step has room, so it is admitted beside 0
        // (ranks reorder, they never refuse).
        let p = PrefixAware::new(5_000.0, 128);
        let mut s = seated(Box::new(p), true, 4, 1024);
        add(&mut s, 0, 0, shared_then(&[99]));
        add(&mut s, 1, 10, shared_then(&[51]));
        assert_eq!(step(&mut s, 100), [(0, 0), (1, 0)]);
    }

    #[test]
    fn a_request_whose_shared_prefix_is_cached_is_not_held_back() {
        // 1 and 2 share `shared()` with 0, which cached it: their first blocks to compute are
        // their own (here none: only the last token's partial block is left).
        let mut s = warm_then_two(Box::new(PrefixAware::new(5_000.0, 128)));
        add(&mut s, 3, 30, shared_then(&[7]));
        s.look_up_cached_prefixes();
        assert_eq!(looked_up(&s, 3), Some(16));
        assert_eq!([1, 2, 3].map(|id| held(&s, id)), [false, false, false]);
        // Sharing a further block: 4 and 5 have the same 8 tokens after `shared()`, one full
        // block not cached yet. 4 (earlier) computes it; 5 is held back.
        add(&mut s, 4, 40, shared_then(&[5, 5, 5, 5, 4]));
        add(&mut s, 5, 50, shared_then(&[5, 5, 5, 5, 6]));
        s.look_up_cached_prefixes();
        assert_eq!([4, 5].map(|id| looked_up(&s, id)), [Some(16), Some(16)]);
        assert_eq!([4, 5].map(|id| held(&s, id)), [false, true]);
    }

    #[test]
    fn a_running_prefill_holds_back_requests_needing_its_blocks_still_to_compute() {
        // Steps of 10 tokens: 0 (17 tokens) is computed in chunks of 10 and 7; after the
        // first, 2 of its 4 prefix blocks are cached and its third is the first 1 would
        // compute, so 1 (cached 8 tokens) ranks after 2 (nothing cached) for the 3 tokens
        // left in the step. Once 0 has finished, 1 reuses the whole prefix.
        let run = |on: bool| {
            let p = PrefixAware::new(5_000.0, 128)
                .with_token_budget(10)
                .with_hold_back_shared(on);
            let mut s = seated(Box::new(p), true, 4, 1024);
            add(&mut s, 0, 0, shared_then(&[99]));
            assert_eq!(step(&mut s, 0), [(0, 0)]);
            add(&mut s, 1, 10, shared_then(&[51]));
            add(&mut s, 2, 20, unique(2));
            s.look_up_cached_prefixes();
            let flags = (looked_up(&s, 1), held(&s, 1), held(&s, 2));
            let first = step(&mut s, 100);
            // 1's first entry: the tokens it reused.
            let reused = first
                .clone()
                .into_iter()
                .chain((101..110).flat_map(|now| step(&mut s, now)))
                .find(|&(id, _)| id == 1);
            (flags, first, reused)
        };
        let (flags, first, reused) = run(true);
        assert_eq!(flags, (Some(8), true, false));
        assert_eq!(first, [(0, 10), (2, 0)]);
        assert_eq!(reused, Some((1, 16)));
        // Without the hold-back, 1 is admitted mid-way and computes blocks 2 and 3 itself.
        let (_, first, reused) = run(false);
        assert_eq!(first, [(0, 10), (1, 8)]);
        assert_eq!(reused, Some((1, 8)));
    }

    #[test]
    fn requests_that_may_not_share_cached_blocks_are_not_held_back() {
        // The same prompt under another cache salt (another tenant) hashes to other blocks:
        // admitting both computes nothing twice that one could reuse.
        let mut s = seated(Box::new(PrefixAware::new(5_000.0, 128)), true, 4, 1024);
        add_salted(&mut s, 0, 0, shared_then(&[1]), Some(7));
        add_salted(&mut s, 1, 10, shared_then(&[2]), Some(8));
        add_salted(&mut s, 2, 20, shared_then(&[3]), None);
        add_salted(&mut s, 3, 30, shared_then(&[4]), Some(7));
        s.look_up_cached_prefixes();
        assert_eq!(
            [0, 1, 2, 3].map(|id| held(&s, id)),
            [false, false, false, true]
        );
    }

    #[test]
    fn only_looked_up_requests_are_checked_and_nothing_else_is_hashed() {
        // Limit 2 of 3 waiting, all sharing a cold prefix: 0 leads, 1 is held back, and 2 (the
        // latest arrival) is neither looked up nor flagged, nor was any block of it hashed.
        let mut s = seated(Box::new(PrefixAware::new(5_000.0, 2)), true, 4, 1024);
        for id in 0..3 {
            add(&mut s, id, 10 * id, shared_then(&[id as u32]));
        }
        s.look_up_cached_prefixes();
        assert_eq!([0, 1, 2].map(|id| held(&s, id)), [false, true, false]);
        assert_eq!(looked_up(&s, 2), None);
        let hashed = |id| s.seq(s.index[&RequestId(id)]).unwrap().hashes.len();
        // A cold walk hashes the one block it misses.
        assert_eq!([0, 1, 2].map(hashed), [1, 1, 0]);
        // Nothing running and 2 looked-up heads, one shared: one pending block.
        assert_eq!(s.pending_blocks.len(), 1);
    }
}
