//! The planner's admission part: waiting sequences in rank order while seats, budget and
//! blocks last (their prefix match, their first chunk, the victims a policy may name), with
//! the blocks the running sequences still owe (`blocks_owed`) and, under a sliding window, the
//! blocks given back behind it at the start of a step (`release_out_of_window`) and the most a
//! sequence holds at once (`window_cap`).

use std::collections::{HashMap, HashSet};

use crate::block_ledger::{PENDING_BLOCK, RELEASED_BLOCK, SHARED_LOAD_BLOCK};
use crate::policy::PolicyEvent;
use crate::scheduler::{Ranked, Scheduler};
use crate::sequence::{SeqView, Sequence};
use crate::tier_quota::NO_TIER;
use crate::types::{BlockId, RequestState, Timestamp};

use super::{slot_ref, write_entry, Building, PlanShare};

/// Why a waiting sequence was not admitted.
#[derive(Copy, Clone, Debug)]
struct Shortfall {
    /// Blocks missing for its whole remaining prefill.
    blocks: usize,
    /// Tokens of that chunk.
    num_new: usize,
    /// Its tier's KV quota, not the pool, is what it lacks: it is passed over, and nothing is
    /// preempted for it.
    quota: bool,
}

/// What admitting a waiting sequence takes (see `admission`).
struct Admission {
    /// Tokens its prefix match covers.
    computed: usize,
    /// Tokens of its first chunk.
    num_new: usize,
    /// Blocks to reserve for that chunk.
    need_new: usize,
    /// Blocks its whole remaining prefill takes (those of the chunk included).
    need_all: usize,
}

impl Scheduler {
    /// Admits waiting sequences in rank order. `order[..ranked]` is the step's ranked
    /// running set (victim candidates for policy preemption), ranked here on first need.
    pub(super) fn admit_waiting(
        &mut self,
        now: Timestamp,
        order: &mut Vec<Ranked>,
        ranked: &mut Option<usize>,
        b: &mut Building<'_>,
    ) {
        // With the budget spent, only running prefill chunks can lend some.
        if self.waiting.is_empty() || (b.budget == 0 && !b.may_lend()) {
            return;
        }
        let step_running = self.running.len();
        self.look_up_cached_prefixes();
        let mut worder = std::mem::take(&mut self.wait_order);
        self.rank_into(&self.waiting, now, &mut worder);
        // At most max_num_seqs admissions, plus the one that fails, are ever examined, not
        // counting candidates passed over for want of an adapter slot: only when some were
        // and the first k ran out is the rest ranked too.
        let mut k = worder.len().min(self.config.max_num_seqs.saturating_add(1));
        if k > 0 && k < worder.len() {
            worder.select_nth_unstable(k - 1);
        }
        worder[..k].sort_unstable();
        let mut num_running = self.running.len();
        let mut passed_over = false;
        // The best-ranked request waiting for a LoRA adapter slot: later adapter requests may
        // pass it (as in vLLM, so that the running adapters keep their batches), but at most
        // max_num_seqs of them in all; then they wait too, the running adapters drain, and a
        // slot frees for it. Without the bound, steady traffic for the running adapters keeps
        // it waiting for as long as the traffic lasts.
        let mut slot_waiter: Option<u32> = None;
        let pass_limit = u32::try_from(self.config.max_num_seqs).unwrap_or(u32::MAX);
        // Tiers (bit = position) one of whose requests was passed over in this step for want
        // of KV quota: their later requests are passed over too, so that small requests of
        // a tier cannot keep overtaking a large one (FCFS within the tier). Other tiers'
        // requests pass: they do not take from its quota.
        let mut quota_blocked: u64 = 0;
        let tier_bit = |tier: u8| {
            if tier == NO_TIER {
                0
            } else {
                1u64.checked_shl(u32::from(tier)).unwrap_or(0)
            }
        };
        let mut i = 0;
        let mut lent = 0;
        // Whether running prefill chunks can still lend (`Building::may_lend`, a pass over
        // the plan), known until the plan changes: candidates passed over for an adapter slot
        // or a quota change nothing, so a queue of them costs one pass, not one each.
        let mut can_lend: Option<bool> = None;
        while i < worder.len() {
            self.settle(std::mem::take(&mut lent), b);
            if b.budget == 0 && !*can_lend.get_or_insert_with(|| b.may_lend()) {
                break;
            }
            if i == k {
                if !passed_over {
                    break;
                }
                worder[k..].sort_unstable();
                k = worder.len();
            }
            let cand = worder[i];
            i += 1;
            // A request whose adapter would exceed max_loras distinct adapters among the
            // running sequences waits, keeping its place, and the next ones may pass it (as in
            // vLLM): decided before any preemption, so nothing is preempted on its behalf.
            // Admissions earlier in this step count; preemptions only free slots.
            let adapter = slot_ref(&self.seqs, cand.slot).and_then(|q| q.req.lora_adapter);
            if !self.adapters.admits(adapter, self.config.max_loras) {
                passed_over = true;
                slot_waiter.get_or_insert(cand.slot);
                continue;
            }
            let passes = match (adapter, slot_waiter) {
                (Some(_), Some(w)) => Some(w),
                _ => None,
            };
            if passes.is_some_and(|w| {
                slot_ref(&self.seqs, w).is_some_and(|q| q.lora_passes >= pass_limit)
            }) {
                passed_over = true;
                continue;
            }
            // A request its tier's KV quota cannot hold now waits, keeping its place, and
            // requests of other tiers may pass it; decided (in `admission`) before any
            // preemption, so nothing is preempted for quota, and only its own tier's
            // sequences ending (or being preempted) make room.
            let bit = tier_bit(self.tier_of(cand.slot));
            if quota_blocked & bit != 0 {
                continue;
            }
            // The budget goes in rank order: planned prefill chunks of running sequences that
            // rank after this one lend it what its first chunk lacks, taken from them (`settle`)
            // only if it is admitted, so a request that cannot be seated takes nothing.
            // What follows may admit it, preempt for it or take chunks back for it.
            can_lend = None;
            lent = self.reclaimable(cand, now, b);
            if b.budget + lent == 0 {
                break;
            }
            b.budget += lent;
            if num_running >= self.config.max_num_seqs {
                let end = *ranked.get_or_insert_with(|| {
                    self.rank_into(&self.running[..step_running], now, order);
                    order.sort_unstable();
                    order.len()
                });
                // A seat and the blocks it lacks, from the same victims, or nothing: a victim
                // preempted for the seat alone is lost when the blocks then come up short.
                let short = match self.admission(cand.slot, usize::MAX, b) {
                    Ok(a) => Shortfall {
                        blocks: 0,
                        num_new: a.num_new,
                        quota: false,
                    },
                    Err(short) => short,
                };
                if short.quota {
                    passed_over = true;
                    quota_blocked |= bit;
                    continue;
                }
                let admitted =
                    self.preempt_for(cand, short.blocks, &order[..end], now, b, &mut num_running)
                        && self.try_admit(cand.slot, short.num_new, b).is_ok();
                if !admitted {
                    break;
                }
                self.admitted(cand.slot, passes, &mut num_running);
                continue;
            }
            let admitted = match self.try_admit(cand.slot, usize::MAX, b) {
                Ok(()) => true,
                Err(short) if short.quota => {
                    passed_over = true;
                    quota_blocked |= bit;
                    continue;
                }
                Err(short) => {
                    let end = *ranked.get_or_insert_with(|| {
                        self.rank_into(&self.running[..step_running], now, order);
                        order.sort_unstable();
                        order.len()
                    });
                    // The retry plans the same chunk: preempted victims give back budget
                    // (and logit rows), which would otherwise grow the chunk, and with it
                    // the blocks it needs, past what the victims were chosen to free.
                    self.preempt_for(cand, short.blocks, &order[..end], now, b, &mut num_running)
                        && self.try_admit(cand.slot, short.num_new, b).is_ok()
                }
            };
            if !admitted {
                break;
            }
            self.admitted(cand.slot, passes, &mut num_running);
        }
        self.settle(lent, b);
        self.wait_order = worder;
    }

    /// Books an admission: one more running, and one more pass of the request waiting for an
    /// adapter slot that it overtook (`passed`).
    fn admitted(&mut self, slot: u32, passed: Option<u32>, num_running: &mut usize) {
        *num_running += 1;
        if let Some(q) = self.seqs.get_mut(slot as usize).and_then(Option::as_mut) {
            q.lora_passes = 0;
            self.policy.observe(PolicyEvent::Admitted(SeqView::new(q)));
        }
        if let Some(q) = passed.and_then(|w| self.seqs.get_mut(w as usize)?.as_mut()) {
            q.lora_passes = q.lora_passes.saturating_add(1);
        }
    }

    /// Whether a waiting sequence can be admitted with a first chunk of at most `max_new`
    /// tokens: its prefix match (left in `self.matched`), and the chunk, or what is missing.
    ///
    /// The free blocks must hold its whole remaining prefill, though only the first chunk's
    /// are reserved: a request admitted for its first chunk alone preempts itself when a later
    /// chunk finds no blocks, and is admitted again the next step, over and over (vLLM V0's
    /// whole-prompt `can_allocate` check).
    fn admission(
        &mut self,
        slot: u32,
        max_new: usize,
        b: &mut Building<'_>,
    ) -> Result<Admission, Shortfall> {
        let caching = self.config.enable_prefix_caching;
        let Some(seq) = self.seqs.get_mut(slot as usize).and_then(|s| s.as_mut()) else {
            // Not a live sequence: nothing to admit, and nothing to preempt for.
            return Ok(Admission {
                computed: 0,
                num_new: 0,
                need_new: 0,
                need_all: 0,
            });
        };
        let bs = self.ledger.block_size();
        let total = seq.num_tokens();
        let tier = seq.tier;
        self.matched.clear();
        self.shared_matched.clear();
        self.host_matched.clear();
        if caching {
            // Leave at least the last token to compute, so that a token can be sampled.
            let max_blocks = (total - 1) / bs;
            if seq.hashes.len() < max_blocks {
                let extras = seq.hash_extras();
                let mut hashes = std::mem::take(&mut seq.hashes);
                self.hasher
                    .extend_chain(&mut hashes, seq.tokens(), bs, max_blocks, extras);
                seq.hashes = hashes;
            }
            let upto = max_blocks.min(seq.hashes.len());
            self.ledger
                .match_prefix(&seq.hashes[..upto], &mut self.matched);
            // The chain goes on in the host tier: those blocks are copied back, not computed.
            // First among the loads an earlier admission of this plan decided (shared: the
            // copy runs before the step's compute), then in the tier itself, up to a block
            // this plan loads already (unreachable: a plan's loads of one chain start where
            // the device match ends, the same for every request on it).
            if let Some(host) = self.host.as_ref() {
                let mut at = self.matched.len().min(upto);
                while let Some(&owner) = seq.hashes[..upto]
                    .get(at)
                    .and_then(|h| self.plan_loads.get(h))
                {
                    self.shared_matched.push(owner);
                    at += 1;
                }
                for h in &seq.hashes[at..upto] {
                    match host.lookup(*h) {
                        Some(b) if !self.plan_loads.contains_key(h) => self.host_matched.push(b),
                        _ => break,
                    }
                }
            }
        }
        if let (Some(quota), Some(_)) = (self.quotas.cap(tier), self.config.sliding_window) {
            // Under a sliding window its tier's bound may hold a request of any length (see
            // `add_request`), but admission pins every matched block (those behind the window
            // go back a step later): a hit longer than the bound would keep it waiting
            // forever, so it uses no more of the hit than the bound holds with a first chunk
            // of the largest size (the same however the step's budget moves, so that the retry
            // after a preemption plans what the victims were chosen for).
            let chunk = self.config.max_num_batched_tokens;
            while let Some(k) =
                (self.matched.len() + self.shared_matched.len() + self.host_matched.len())
                    .checked_sub(1)
            {
                let tokens = (k + 1) * bs;
                if self.ledger.blocks_for(tokens + (total - tokens).min(chunk)) <= quota {
                    break;
                }
                if self.host_matched.pop().is_none() && self.shared_matched.pop().is_none() {
                    self.matched.truncate(k);
                }
            }
        }
        // Blocks it holds without reserving them: those the device cache holds and those an
        // earlier admission of this plan loads.
        let held = self.matched.len() + self.shared_matched.len();
        let computed = (held + self.host_matched.len()) * bs;
        let num_new = (total - computed)
            .min(b.budget)
            .min(b.logit_cap(seq))
            .min(max_new);

        let need_new = self.ledger.blocks_for(computed + num_new) - held;
        let mut need_all = self.ledger.blocks_for(total) - held;
        if let Some(cap) = self.window_cap() {
            // Under a sliding window the prefill holds at most `cap` blocks at once (the
            // matched ones count: the first steps give back those behind the window).
            need_all = need_all.min(cap.saturating_sub(held).max(need_new));
        }
        // Matched blocks nobody references are counted free but are pinned, not allocated.
        let evictable = self
            .matched
            .iter()
            .filter(|&&blk| self.ledger.ref_count(blk) == Some(0))
            .count();
        // The running sequences' own known tokens come first: blocks they will take for the
        // rest of their prefills (admitted for a first chunk) are not free for this one.
        let owed = match b.owed {
            Some(owed) => owed,
            None => *b.owed.insert(self.blocks_owed()),
        };
        if let Some(quota) = self.quotas.cap(tier) {
            // Its tier's bound: what the tier holds, what its running sequences owe, and
            // every block this one will hold for its prefill (the matched ones too).
            let tier_owed = self.tier_owed.get(usize::from(tier)).copied().unwrap_or(0);
            let want = held + need_all;
            if self.quotas.held(tier) + tier_owed + want > quota {
                return Err(Shortfall {
                    blocks: 0,
                    num_new,
                    quota: true,
                });
            }
        }
        let available = self
            .ledger
            .num_free()
            .saturating_sub(evictable)
            .saturating_sub(owed);
        if available < need_all {
            return Err(Shortfall {
                blocks: need_all - available,
                num_new,
                quota: false,
            });
        }
        Ok(Admission {
            computed,
            num_new,
            need_new,
            need_all,
        })
    }

    /// Blocks the running sequences still need for the tokens they hold (the rest of a prefill
    /// admitted for its first chunk, a token past a full block): O(running), and only when
    /// something waits. Leaves each tier's share in `self.tier_owed`.
    fn blocks_owed(&mut self) -> usize {
        let mut tier_owed = std::mem::take(&mut self.tier_owed);
        tier_owed.iter_mut().for_each(|o| *o = 0);
        let mut total = 0;
        for q in self
            .running
            .iter()
            .filter_map(|&slot| slot_ref(&self.seqs, slot))
            .filter(|q| q.state == RequestState::Running)
        {
            let owed = self.owed_by(q);
            total += owed;
            if let Some(o) = tier_owed.get_mut(usize::from(q.tier)) {
                *o += owed;
            }
        }
        self.tier_owed = tier_owed;
        total
    }

    /// Blocks a running sequence still needs for the tokens it holds: the rest of its table
    /// or, under a sliding window, at most what it may hold at once less what it holds.
    fn owed_by(&self, q: &Sequence) -> usize {
        let rest = self
            .ledger
            .blocks_for(q.num_tokens())
            .saturating_sub(q.block_table.len());
        match self.window_cap() {
            Some(cap) => rest.min(cap.saturating_sub(q.held_blocks().len())),
            None => rest,
        }
    }

    /// Under a sliding window, the most blocks a sequence holds at once: those of its window
    /// and the keys read before it (see [`Scheduler::release_out_of_window`]) and of a chunk
    /// of `max_num_batched_tokens`, each span's partial blocks at both ends included.
    pub(crate) fn window_cap(&self) -> Option<usize> {
        let w = self.config.sliding_window?;
        Some(w.blocks_held(self.ledger.block_size(), self.config.max_num_batched_tokens))
    }

    /// Gives back the leading blocks of running sequences that hold only keys before every
    /// window their next steps read: the next query of a sequence at `num_computed` attends
    /// from `num_computed + 1 - window` on, the backend may read `read_slack` keys before
    /// that, and a step that fails (or several in flight) moves a sequence back by at most
    /// `WINDOW_MARGIN` positions. Prefix-cached blocks are given back once registered, so
    /// they stay in the cache (evictable) for requests with the same prefix. O(running).
    ///
    /// A step launched earlier may still read a block given back here: the allocator hands
    /// it to a sequence in a later step, whose writes the device orders after that step's
    /// reads (the executors run steps in order).
    pub(super) fn release_out_of_window(&mut self) {
        let Some(w) = self.config.sliding_window else {
            return;
        };
        let bs = self.ledger.block_size();
        let caching = self.config.enable_prefix_caching;
        let behind = w.tokens_kept();
        for &slot in &self.running {
            let Some(seq) = self.seqs.get_mut(slot as usize).and_then(|s| s.as_mut()) else {
                continue;
            };
            if seq.state != RequestState::Running {
                continue;
            }
            let mut upto = (seq.num_computed.saturating_sub(behind) / bs)
                .min(seq.blocks_sent)
                .min(seq.block_table.len());
            if caching {
                upto = upto.min(seq.num_cached_blocks);
            }
            while seq.released_blocks < upto {
                let i = seq.released_blocks;
                let blk = std::mem::replace(&mut seq.block_table[i], RELEASED_BLOCK);
                if blk == PENDING_BLOCK || self.ledger.free(blk).is_err() {
                    self.pool_errors += 1;
                }
                self.quotas.sub(seq.tier, 1);
                seq.released_blocks += 1;
            }
        }
    }

    /// Admits one waiting sequence with a first chunk of at most `max_new` tokens if
    /// [`Scheduler::admission`] allows it; otherwise returns what was missing, leaving the
    /// sequence's prefix match in `self.matched` (for `preempt_for`).
    fn try_admit(
        &mut self,
        slot: u32,
        max_new: usize,
        b: &mut Building<'_>,
    ) -> Result<(), Shortfall> {
        let Admission {
            mut computed,
            num_new,
            mut need_new,
            mut need_all,
        } = self.admission(slot, max_new, b)?;
        let caching = self.config.enable_prefix_caching;
        let Some(seq) = self.seqs.get_mut(slot as usize).and_then(|s| s.as_mut()) else {
            return Ok(());
        };
        let total = seq.num_tokens();
        seq.clear_blocks();
        for &blk in &self.matched {
            if self.ledger.touch(blk).is_err() {
                // Unreachable (the prefix index only holds ids of the pool): the ledger is
                // corrupt. The prefix stops before the block, so that the table stays aligned
                // with positions: what follows is computed again, and counted as not cached.
                self.pool_errors += 1;
                break;
            }
            seq.block_table.push(blk);
        }
        let pinned = seq.block_table.len();
        if pinned < self.matched.len() {
            // The chunk starts earlier but spans as many blocks (the prefix is whole blocks);
            // the rest of the prefill needs the blocks left out.
            computed = pinned * self.ledger.block_size();
            need_all += self.matched.len() - pinned;
            self.matched.truncate(pinned);
            // The host hits (loaded here or by another admission) no longer follow the
            // pinned prefix: computed too.
            need_all += self.shared_matched.len();
            self.shared_matched.clear();
            self.host_matched.clear();
            need_new = self.ledger.blocks_for(computed + num_new) - pinned;
        }
        // Blocks another admission of this plan loads: shared, resolved with the block ids.
        for &(owner, owner_at) in &self.shared_matched {
            self.plan_shares.push(PlanShare {
                entry: b.len as u32,
                slot,
                at: seq.block_table.len() as u32,
                owner,
                owner_at,
            });
            seq.block_table.push(SHARED_LOAD_BLOCK);
        }
        // Running now, it owes the rest of its prefill's blocks.
        if let Some(owed) = b.owed.as_mut() {
            *owed += need_all - need_new;
            if let Some(o) = self.tier_owed.get_mut(usize::from(seq.tier)) {
                *o += need_all - need_new;
            }
        }
        for _ in 0..need_new {
            match self.ledger.reserve() {
                Some(blk) => seq.block_table.push(blk),
                None => self.pool_errors += 1,
            }
        }
        self.quotas.add(seq.tier, seq.block_table.len());
        if !self.host_matched.is_empty() {
            // Copied in with this plan (`host_copies`), and registered in the device cache
            // when launched, as the blocks it computes. Until then the plan's later
            // admissions find them in `plan_loads` and share them. The tier's tokens count
            // once, for the admission that loads them (a sharer's are device hits).
            seq.load_at = self.matched.len() + self.shared_matched.len();
            seq.host_loads.extend_from_slice(&self.host_matched);
            for k in 0..self.host_matched.len() {
                let at = seq.load_at + k;
                if let Some(&h) = seq.hashes.get(at) {
                    self.plan_loads.insert(h, (slot, at as u32));
                }
            }
            self.host_hit_tokens += (self.host_matched.len() * self.ledger.block_size()) as u64;
        }
        seq.num_computed = computed;
        seq.num_cached_blocks = self.matched.len();
        seq.cached_prefix = None;
        // Reported once, as vLLM's `num_cached_tokens`: the recompute after a preemption
        // reuses blocks the request computed itself, which the client was not spared.
        seq.first_cached
            .get_or_insert(u32::try_from(computed.min(seq.prompt_len)).unwrap_or(u32::MAX));
        seq.state = RequestState::Running;
        self.adapters.started(seq.req.lora_adapter);
        if caching {
            self.prefix_queries += total as u64;
            self.prefix_hits += computed as u64;
        }
        write_entry(b.plan, b.len, seq, num_new);
        b.len += 1;
        b.charge(seq, num_new);
        self.last_slots.push(slot);
        self.running.push(slot);
        Ok(())
    }

    /// Preempts running sequences the policy allows (lowest rank first, only ranks after
    /// `cand`) if together they free a seat and `blocks` blocks; otherwise preempts nothing.
    ///
    /// With `blocks > 0`, `self.matched` must hold `cand`'s prefix match (from the
    /// `try_admit` that came up short). A block counts as freed when the victims
    /// hold all its references, unless `cand` matched it: such a block only turns from pinned
    /// into evictable-but-matched, which `try_admit` does not count as available, so counting
    /// it would preempt victims for an admission that then fails.
    fn preempt_for(
        &mut self,
        cand: Ranked,
        blocks: usize,
        running: &[Ranked],
        now: Timestamp,
        b: &mut Building<'_>,
        num_running: &mut usize,
    ) -> bool {
        let mut victims = std::mem::take(&mut self.victims);
        victims.clear();
        let mut freed = 0usize;
        let reused: HashSet<BlockId> = if blocks > 0 {
            self.matched.iter().copied().collect()
        } else {
            HashSet::new()
        };
        // References the victims chosen so far hold to blocks shared with other sequences.
        let mut shared: HashMap<BlockId, u32> = HashMap::new();
        if let Some(w) = slot_ref(&self.seqs, cand.slot) {
            for r in running.iter().rev() {
                if *r <= cand {
                    break;
                }
                let Some(v) = slot_ref(&self.seqs, r.slot) else {
                    continue;
                };
                if v.state != RequestState::Running
                    || !self
                        .policy
                        .may_preempt(SeqView::new(w), SeqView::new(v), now)
                {
                    continue;
                }
                if blocks > 0 {
                    // Blocks it still owes its known tokens were counted as taken (see
                    // `blocks_owed`): preempted, it owes nothing.
                    freed += self.owed_by(v);
                    for &blk in v.held_blocks() {
                        let last_ref = match self.ledger.ref_count(blk) {
                            Some(1) => true,
                            Some(refs) if refs > 1 => {
                                let held = shared.entry(blk).or_insert(0);
                                *held += 1;
                                *held == refs
                            }
                            _ => false,
                        };
                        if last_ref && !reused.contains(&blk) {
                            freed += 1;
                        }
                    }
                }
                victims.push(r.slot);
                if freed >= blocks {
                    break;
                }
            }
        }
        let mut ok = !victims.is_empty() && freed >= blocks;
        if ok && b.ahead {
            // No preemption while steps are in flight: the caller plans again after them.
            self.preemption_wanted = true;
            ok = false;
        }
        if ok {
            for &v in &victims {
                self.preempt(v, now, b);
                *num_running = num_running.saturating_sub(1);
            }
        }
        self.victims = victims;
        ok
    }
}
