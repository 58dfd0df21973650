//! The planner's running part: each running sequence's next chunk (in one pass in queue order
//! when all of them fit, otherwise in rank order, preempting the lowest-ranked when the pool or
//! its tier's quota runs dry), the blocks it grows by, preemption by recompute, and the drafts
//! of speculative decoding from what the step left over.

use crate::policy::PolicyEvent;
use crate::scheduler::{Ranked, Scheduler};
use crate::sequence::SeqView;
use crate::types::{RequestState, Timestamp};

use super::{slot_ref, write_entry, Building};

impl Scheduler {
    /// Speculative decoding: gives the plan's decode entries draft tokens from what the step
    /// left over (budget, logit rows, free blocks), in plan order. Never while steps are in
    /// flight (a sequence's drafts follow its known tokens) and never at the expense of
    /// anything already planned.
    pub(super) fn add_drafts(&mut self, b: &mut Building<'_>) {
        let Some(cfg) = self.config.speculative.as_ref() else {
            return;
        };
        if cfg.max_running != 0 && self.running.len() > cfg.max_running {
            return;
        }
        for (n, &slot) in self.last_slots.iter().enumerate().take(b.len) {
            if b.budget == 0 || b.logit_rows == 0 {
                break;
            }
            let entry = &mut b.plan.seqs[n];
            if !entry.samples || entry.is_prefill || entry.num_new_tokens != 1 {
                continue;
            }
            let Some(seq) = self.seqs.get_mut(slot as usize).and_then(|s| s.as_mut()) else {
                continue;
            };
            // Not on a sequence's first sampling step (its backend state still takes fed
            // tokens as prompt tokens) nor for prompt logprobs (every fed row is scored).
            if seq.pending != 0
                || !seq.req.limits.speculate
                || seq.id != entry.id
                || seq.output.is_empty()
                || seq.req.limits.prompt_logits
            {
                continue;
            }
            // At most every output but the one sampled after the drafts.
            let room = (seq.max_tokens as usize).saturating_sub(seq.output.len() + 1);
            let k = cfg
                .num_speculative_tokens
                .min(room)
                .min(b.budget)
                .min(b.logit_rows);
            if k == 0 {
                continue;
            }
            let drafts = &mut entry.draft_tokens;
            drafts.clear();
            match self.draft_source.as_mut() {
                Some(source) => {
                    source.propose(SeqView::new(seq), k, drafts);
                    drafts.truncate(k);
                }
                None => seq.ngrams.get_or_insert_with(Box::default).propose(
                    crate::prefix_hash::PromptAndOutput {
                        prompt: &seq.req.prompt,
                        output: &seq.output,
                    },
                    cfg,
                    k,
                    drafts,
                ),
            }
            // As many as the free blocks (and its tier's KV quota) can hold.
            let have = seq.block_table.len();
            let room = self.ledger.num_free().min(self.quotas.room(seq.tier));
            while !drafts.is_empty()
                && self
                    .ledger
                    .blocks_for(seq.num_computed + 1 + drafts.len())
                    .saturating_sub(have)
                    > room
            {
                drafts.pop();
            }
            let k = drafts.len();
            if k == 0 {
                continue;
            }
            let need = self
                .ledger
                .blocks_for(seq.num_computed + 1 + k)
                .saturating_sub(have);
            for _ in 0..need {
                match self.ledger.reserve() {
                    Some(blk) => {
                        seq.block_table.push(blk);
                        self.quotas.add(seq.tier, 1);
                    }
                    None => self.pool_errors += 1, // unreachable: checked above
                }
            }
            let first = entry.first_new_block.min(seq.block_table.len());
            entry.new_blocks.clear();
            entry
                .new_blocks
                .extend_from_slice(&seq.block_table[first..]);
            seq.blocks_sent = seq.block_table.len();
            entry.num_new_tokens += k;
            b.plan.num_batched_tokens += k;
            b.budget -= k;
            b.logit_rows -= k;
        }
    }

    /// Schedules every running sequence's whole next chunk in queue order, in one pass.
    ///
    /// When everything fits, rank order cannot change the outcome, so ranking is skipped.
    /// Returns false, with the plan and the allocations rolled back, as soon as the budget
    /// or the free blocks would run out. (At the start of a step every running sequence
    /// has sent its whole table, so the blocks past `first_new_block` are this step's.)
    pub(super) fn schedule_all_running(&mut self, b: &mut Building<'_>) -> bool {
        let (budget, logit_rows) = (b.budget, b.logit_rows);
        let mut fits = true;
        for &slot in &self.running {
            let Some(seq) = self.seqs.get_mut(slot as usize).and_then(|s| s.as_mut()) else {
                continue;
            };
            let num_new = seq.schedulable_tokens();
            if num_new == 0 {
                continue;
            }
            let total = seq.num_computed + num_new;
            let need = self
                .ledger
                .blocks_for(total)
                .saturating_sub(seq.block_table.len());
            if num_new > b.budget.min(b.logit_cap(seq))
                || need > self.ledger.num_free()
                || need > self.quotas.room(seq.tier)
            {
                fits = false;
                break;
            }
            for _ in 0..need {
                match self.ledger.reserve() {
                    Some(blk) => {
                        seq.block_table.push(blk);
                        self.quotas.add(seq.tier, 1);
                    }
                    None => self.pool_errors += 1,
                }
            }
            write_entry(b.plan, b.len, seq, num_new);
            b.len += 1;
            b.charge(seq, num_new);
            self.last_slots.push(slot);
        }
        if !fits {
            self.unplan(b, budget, logit_rows);
        }
        fits
    }

    /// Takes back everything planned so far in this step (only running sequences' chunks: no
    /// preemption, no admission), restoring the budget and logit rows it started with.
    fn unplan(&mut self, b: &mut Building<'_>, budget: usize, logit_rows: usize) {
        for (entry, &slot) in b.plan.seqs[..b.len].iter().zip(&self.last_slots) {
            let Some(seq) = self.seqs.get_mut(slot as usize).and_then(|s| s.as_mut()) else {
                continue;
            };
            while seq.block_table.len() > entry.first_new_block {
                if let Some(blk) = seq.block_table.pop() {
                    self.quotas.sub(seq.tier, 1);
                    if self.ledger.free(blk).is_err() {
                        self.pool_errors += 1;
                    }
                }
            }
            seq.blocks_sent = entry.first_new_block;
        }
        self.last_slots.clear();
        b.len = 0;
        b.budget = budget;
        b.logit_rows = logit_rows;
        b.plan.num_batched_tokens = 0;
    }

    /// Ahead of a step in flight, when [`Scheduler::schedule_all_running`] found the whole
    /// chunks too large: schedules the running sequences in rank order, each a chunk within
    /// what the budget leaves, as [`Scheduler::schedule_running`] does (so a long prefill
    /// does not force in-order planning). Returns false, with everything rolled back, when
    /// the blocks run out: that takes a preemption, which only an in-order plan makes.
    pub(super) fn schedule_ranked_ahead(
        &mut self,
        now: Timestamp,
        order: &mut Vec<Ranked>,
        b: &mut Building<'_>,
    ) -> bool {
        let (budget, logit_rows) = (b.budget, b.logit_rows);
        self.rank_into(&self.running, now, order);
        order.sort_unstable();
        for slot in order.iter().map(|r| r.slot) {
            let Some((num_new, need)) = self.next_chunk(slot, b) else {
                continue;
            };
            if self.ledger.num_free() < need || self.quotas.room(self.tier_of(slot)) < need {
                self.unplan(b, budget, logit_rows);
                return false;
            }
            self.grow_and_emit(slot, need, num_new, b);
        }
        true
    }

    /// Schedules running sequences. Returns `Some(n)` when `order` holds them ranked (the
    /// first `n` still running), `None` when the fast path skipped ranking.
    pub(super) fn schedule_running(
        &mut self,
        now: Timestamp,
        order: &mut Vec<Ranked>,
        b: &mut Building<'_>,
    ) -> Option<usize> {
        order.clear();
        if self.schedule_all_running(b) {
            return None;
        }
        self.rank_into(&self.running, now, order);
        order.sort_unstable();
        let mut end = order.len();
        let mut i = 0;
        while i < end {
            let slot = order[i].slot;
            i += 1;
            let Some((num_new, need)) = self.next_chunk(slot, b) else {
                continue;
            };
            let tier = self.tier_of(slot);
            loop {
                if self.ledger.num_free() >= need {
                    if self.quotas.room(tier) >= need {
                        self.grow_and_emit(slot, need, num_new, b);
                        break;
                    }
                    // Its tier is at its KV bound: the tier's own lowest-ranked sequence not
                    // yet scheduled gives way (possibly this one), never another tier's.
                    let j = (i..end)
                        .rev()
                        .find(|&j| self.tier_of(order[j].slot) == tier)
                        .unwrap_or(i - 1);
                    let victim = order[j].slot;
                    order[j..end].rotate_left(1);
                    end -= 1;
                    self.preempt(victim, now, b);
                    if victim == slot {
                        // The next one moved into its place.
                        i -= 1;
                        break;
                    }
                    continue;
                }
                end -= 1;
                let victim = order[end].slot;
                self.preempt(victim, now, b);
                if victim == slot {
                    break;
                }
            }
        }
        Some(end)
    }

    /// The tier position of the sequence in `slot` (see `tier_quota.rs`).
    pub(super) fn tier_of(&self, slot: u32) -> u8 {
        self.seq(slot)
            .map_or(crate::tier_quota::NO_TIER, |q| q.tier)
    }

    /// A running sequence's next chunk within what the budget and the logit rows leave, and
    /// the blocks it needs beyond its table; `None` when it has nothing to schedule.
    fn next_chunk(&self, slot: u32, b: &Building<'_>) -> Option<(usize, usize)> {
        let seq = self.seq(slot)?;
        let num_new = seq.schedulable_tokens().min(b.budget).min(b.logit_cap(seq));
        if num_new == 0 {
            return None;
        }
        let need = self
            .ledger
            .blocks_for(seq.num_computed + num_new)
            .saturating_sub(seq.block_table.len());
        Some((num_new, need))
    }

    /// Allocates `need` more blocks for a running sequence and adds it to the plan.
    fn grow_and_emit(&mut self, slot: u32, need: usize, num_new: usize, b: &mut Building<'_>) {
        let Some(seq) = self.seqs.get_mut(slot as usize).and_then(|s| s.as_mut()) else {
            return;
        };
        for _ in 0..need {
            match self.ledger.reserve() {
                Some(blk) => {
                    seq.block_table.push(blk);
                    self.quotas.add(seq.tier, 1);
                }
                None => {
                    // Unreachable: the caller checked num_free.
                    self.pool_errors += 1;
                    return;
                }
            }
        }
        write_entry(b.plan, b.len, seq, num_new);
        b.len += 1;
        b.charge(seq, num_new);
        self.last_slots.push(slot);
    }

    /// Preempts a running sequence by recompute, unscheduling it if it was planned.
    pub(super) fn preempt(&mut self, slot: u32, now: Timestamp, b: &mut Building<'_>) {
        b.owed = None;
        if let Some(pos) = self.last_slots.iter().position(|&s| s == slot) {
            let removed = b.plan.seqs[pos].num_new_tokens;
            self.remove_entry(pos, b);
            if let Some(seq) = slot_ref(&self.seqs, slot) {
                b.refund(seq, removed);
            }
            b.plan.num_batched_tokens -= removed;
        }
        let Some(seq) = self.seqs.get_mut(slot as usize).and_then(|s| s.as_mut()) else {
            return;
        };
        self.quotas.sub(seq.tier, seq.held_blocks().len());
        for &blk in seq.held_blocks().iter().rev() {
            if self.ledger.free(blk).is_err() {
                self.pool_errors += 1;
            }
        }
        seq.clear_blocks();
        seq.num_computed = 0;
        seq.drop_pending();
        seq.state = RequestState::Preempted;
        self.adapters.stopped(seq.req.lora_adapter);
        seq.queued_at = now;
        seq.num_preemptions = seq.num_preemptions.saturating_add(1);
        self.num_preemptions += 1;
        self.waiting.push(slot);
        b.plan.preempted.push(seq.id);
        self.policy
            .observe(PolicyEvent::Preempted(SeqView::new(seq)));
    }
}

impl Scheduler {
    /// Hands the step's budget out in rank order across running and waiting sequences: what
    /// the prefill chunks planned for running sequences that rank after the waiting sequence
    /// `cand` can lend it, up to what the budget left lacks for its remaining tokens (at most
    /// the step's whole budget), with those sequences left in `reclaim_order`, lowest-ranked
    /// first. Decodes lend nothing (stall-free batching). Admission adds the loan to the budget
    /// and [`Scheduler::settle`]s it once the candidate is admitted or not.
    ///
    /// Running sequences are planned before waiting ones (their chunks must be known before
    /// admission counts the free blocks), so without the loan a policy that shrinks the step's
    /// budget (`slo-aware`'s slack-sized chunks) would have a waiting request that outranks
    /// a running prefill wait for that prefill's chunks. O(planned) per call, plus the
    /// ranking of the planned prefill chunks when the budget falls short.
    pub(super) fn reclaimable(&mut self, cand: Ranked, now: Timestamp, b: &Building<'_>) -> usize {
        let mut victims = std::mem::take(&mut self.reclaim_order);
        victims.clear();
        let want = self.seq(cand.slot).map_or(0, |seq| {
            (seq.num_tokens() - seq.num_computed)
                .min(b.step_budget)
                .min(b.logit_cap(seq))
        });
        let mut lendable = 0usize;
        if b.budget < want {
            // Not a sequence admitted in this step: it ranks before the candidate (admission
            // goes in rank order), and its chunk is its first, with its prefix match.
            for (entry, &slot) in b.plan.seqs[..b.running_len].iter().zip(&self.last_slots) {
                if !entry.is_prefill || !entry.draft_tokens.is_empty() {
                    continue;
                }
                if let Some(s) = self.seq(slot) {
                    let r = Ranked {
                        rank: self.policy.rank(SeqView::new(s), now),
                        arrival: s.req.arrival,
                        id: s.id,
                        slot,
                    };
                    if r > cand {
                        victims.push(r);
                        lendable += entry.num_new_tokens;
                    }
                }
            }
            // Lowest-ranked first.
            victims.sort_unstable_by(|x, y| y.cmp(x));
        }
        self.reclaim_order = victims;
        lendable.min(want.saturating_sub(b.budget))
    }

    /// Settles a loan of `lent` tokens that [`Scheduler::reclaimable`] added to the budget:
    /// what the admission left of the budget pays it back, and the rest is taken from the
    /// lenders' planned chunks, lowest-ranked first. (Lenders preempted in the meantime gave
    /// back their whole chunks, so what is left of the others covers the rest.)
    pub(super) fn settle(&mut self, lent: usize, b: &mut Building<'_>) {
        if b.budget >= lent {
            b.budget -= lent;
            return;
        }
        let mut owed = lent - b.budget;
        b.budget = 0;
        let victims = std::mem::take(&mut self.reclaim_order);
        for v in &victims {
            if owed == 0 {
                break;
            }
            owed -= self.shrink_chunk(v.slot, owed, b);
        }
        self.reclaim_order = victims;
        if owed > 0 {
            self.pool_errors += 1; // unreachable: see above
        }
    }

    /// Takes up to `tokens` back from the planned prefill chunk of the running sequence in
    /// `slot` (returning how many), giving back the blocks reserved for them; a chunk left
    /// empty leaves the plan (the sequence stays running and gets its next chunk in a later
    /// step).
    fn shrink_chunk(&mut self, slot: u32, tokens: usize, b: &mut Building<'_>) -> usize {
        let Some(pos) = self.last_slots.iter().position(|&s| s == slot) else {
            return 0;
        };
        let Some(seq) = self.seqs.get_mut(slot as usize).and_then(|s| s.as_mut()) else {
            return 0;
        };
        let entry = &mut b.plan.seqs[pos];
        let old = entry.num_new_tokens;
        let take = tokens.min(old);
        let new = old - take;
        let keep = self
            .ledger
            .blocks_for(entry.num_computed_tokens + new)
            .max(entry.first_new_block);
        while seq.block_table.len() > keep {
            if let Some(blk) = seq.block_table.pop() {
                self.quotas.sub(seq.tier, 1);
                if self.ledger.free(blk).is_err() {
                    self.pool_errors += 1;
                }
            }
        }
        seq.blocks_sent = seq.block_table.len();
        let first = entry.first_new_block.min(seq.block_table.len());
        entry.new_blocks.clear();
        entry
            .new_blocks
            .extend_from_slice(&seq.block_table[first..]);
        entry.num_new_tokens = new;
        // It no longer reaches the last known token.
        entry.samples &= take == 0;
        b.logit_rows += Building::logit_charge(seq, old) - Building::logit_charge(seq, new);
        b.plan.num_batched_tokens -= take;
        b.owed = None;
        if new == 0 {
            self.remove_entry(pos, b);
        }
        take
    }

    /// Takes entry `pos` out of the plan being built (with its place in `last_slots`): the
    /// entries behind it move up one place, and so do the plan's shares of loaded blocks that
    /// name them (`plan_shares`, resolved by entry once the blocks have ids; a share left
    /// naming the old place would give the loaded blocks' ids to the next entry, over its own
    /// blocks, and leave the sharer's entry with placeholders). Budgets are the caller's.
    fn remove_entry(&mut self, pos: usize, b: &mut Building<'_>) {
        b.plan.seqs[pos..b.len].rotate_left(1);
        b.len -= 1;
        if pos < b.running_len {
            b.running_len -= 1;
        }
        self.last_slots.remove(pos);
        // (Shares are of sequences admitted in this step, which are neither preempted nor
        // shrunk in it: none names `pos`.)
        for sh in &mut self.plan_shares {
            if sh.entry as usize > pos {
                sh.entry -= 1;
            }
        }
    }
}
